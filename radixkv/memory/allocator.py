"""Free list of KV slots (``page_size == 1``) or KV pages (``page_size > 1``).

Slot ``s`` lives in page ``s // page_size``; a page's slots are ``[p * page_size, (p + 1) *
page_size)``. The free pages are a LIFO stack in a ``numpy.int64`` array (recently freed pages
are handed out first), with a per-page ``allocated`` flag array for the double-free check, so
``alloc`` and ``free`` are a few vectorised numpy operations. The flags live in a ``bytearray``
viewed by numpy: a ``free`` of a few slots (a finished decode request's tail) checks them with
plain Python indexing, cheaper than numpy calls at that size; large frees use numpy.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from radixkv.memory.slots import is_tensor, slot_array

__all__ = ["SlotAllocator"]

_SMALL = 64  # frees of at most this many slots take the plain-Python path


class SlotAllocator:
    """Hands out and takes back KV slot indices in ``[0, num_slots)``.

    Args:
        num_slots: capacity in slots (int >= 0, a multiple of ``page_size``).
        page_size: slots per page (int >= 1). With ``page_size > 1`` allocation is in whole
            pages and each page's slots are contiguous and ascending.

    Attributes:
        num_slots: capacity in slots.
        page_size: slots per page.
        num_pages: ``num_slots // page_size``.

    Raises:
        ValueError: ``page_size < 1``, ``num_slots < 0`` or ``num_slots % page_size != 0``.
    """

    def __init__(self, num_slots: int, page_size: int = 1) -> None:
        if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
            raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
        if not isinstance(num_slots, int) or isinstance(num_slots, bool) or num_slots < 0:
            raise ValueError(f"num_slots must be an int >= 0, got {num_slots!r}")
        if num_slots % page_size:
            raise ValueError(f"num_slots ({num_slots}) must be a multiple of page_size ({page_size})")
        self.num_slots = num_slots
        self.page_size = page_size
        self.num_pages = num_slots // page_size
        self._page_offsets = np.arange(page_size, dtype=np.int64)
        self._stamp = np.zeros(num_slots, dtype=np.int32)  # scratch for duplicate checks
        self.clear()

    def clear(self) -> None:
        """Marks every slot free again (forgets all allocations)."""
        # Descending, so that popping from the top hands out low page ids first.
        self._free_pages = np.arange(self.num_pages - 1, -1, -1, dtype=np.int64)
        self._num_free = self.num_pages
        self._flags = bytearray(self.num_pages)  # 1 = allocated
        self._allocated = np.frombuffer(self._flags, dtype=np.uint8)  # the same memory
        if self.num_pages == 0:
            self._allocated = np.zeros(0, dtype=np.uint8)

    def available_size(self) -> int:
        """Free capacity in slots."""
        return self._num_free * self.page_size

    def alloc(self, n: int) -> Optional[Any]:
        """Takes ``n`` free slots.

        Args:
            n: number of slots (int >= 0; a multiple of ``page_size`` when ``page_size > 1``).

        Returns:
            1-D int64 slot array (:func:`~radixkv.memory.slots.slot_array`: a CPU tensor when
            torch imports) of ``n`` slot indices (whole pages, each page's slots contiguous and
            ascending), or ``None`` when fewer than ``n`` slots are free (nothing
            is taken then).

        Raises:
            ValueError: ``n`` is negative, not an int, or not a multiple of ``page_size``.
        """
        if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 0:
            raise ValueError(f"n must be an int >= 0, got {n!r}")
        ps = self.page_size
        if n % ps:
            raise ValueError(f"n ({n}) must be a multiple of page_size ({ps})")
        k = n // ps
        if k > self._num_free:
            return None
        top = self._num_free
        pages = self._free_pages[top - k : top][::-1]
        self._num_free = top - k
        self._allocated[pages] = 1
        if ps == 1:
            return slot_array(pages.copy())
        return slot_array((pages[:, None] * ps + self._page_offsets).reshape(-1))

    def free(self, slots: Any | Sequence[int]) -> None:
        """Gives slots back. With ``page_size > 1`` the pages containing the slots are freed,
        each page once (so passing any subset of a page's slots frees the whole page).

        Args:
            slots: 1-D integer tensor, numpy array or sequence of slot indices.

        Raises:
            ValueError: a slot is out of ``[0, num_slots)``, listed twice, or its page is not
                currently allocated (double free / never handed out). Nothing is freed then.
        """
        if is_tensor(slots):
            try:
                arr = slots.numpy()
            except (TypeError, RuntimeError):  # on a GPU, or requires grad
                arr = slots.detach().cpu().numpy()
        else:
            arr = np.asarray(slots)
        if arr.size == 0:
            return
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            raise ValueError(f"slots must be a 1-D integer tensor or sequence, got shape {arr.shape} dtype {arr.dtype}")
        if arr.size <= _SMALL:
            self._free_small(arr.tolist())
            return
        arr = arr.astype(np.int64, copy=False)
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= self.num_slots:
            raise ValueError(f"slots must lie in [0, num_slots={self.num_slots}), got min {lo} max {hi}")
        if not self._first_occurrence(arr).all():
            raise ValueError("slots lists a slot more than once (double free)")
        ps = self.page_size
        if ps == 1:
            pages = arr
        else:
            pages = arr // ps
            pages = pages[self._first_occurrence(pages)]
        flags = self._allocated[pages]
        if not flags.all():
            bad = pages[flags == 0][:8] * ps
            raise ValueError(
                f"freeing slots that are not allocated (double free or never "
                f"handed out), e.g. page(s) starting at slot {bad.tolist()}"
            )
        self._allocated[pages] = 0
        self._push(pages)

    def _first_occurrence(self, idx: np.ndarray) -> np.ndarray:
        """Boolean mask keeping one occurrence of each value of ``idx`` (values in
        ``[0, num_slots)``): O(len) scatter/gather through a scratch array, no sort."""
        pos = np.arange(idx.size, dtype=np.int32)
        self._stamp[idx] = pos
        return self._stamp[idx] == pos

    def _free_small(self, slots: list) -> None:
        """``free`` for a few slots, in plain Python (same checks, same errors)."""
        lo, hi = min(slots), max(slots)
        if lo < 0 or hi >= self.num_slots:
            raise ValueError(f"slots must lie in [0, num_slots={self.num_slots}), got min {lo} max {hi}")
        if len(set(slots)) != len(slots):
            raise ValueError("slots lists a slot more than once (double free)")
        ps = self.page_size
        pages = slots if ps == 1 else sorted({s // ps for s in slots})
        flags = self._flags
        bad = [p * ps for p in pages if not flags[p]]
        if bad:
            raise ValueError(
                f"freeing slots that are not allocated (double free or never "
                f"handed out), e.g. page(s) starting at slot {bad[:8]}"
            )
        for p in pages:
            flags[p] = 0
        self._push(pages)

    def _push(self, pages) -> None:
        top = self._num_free
        self._free_pages[top : top + len(pages)] = pages
        self._num_free = top + len(pages)

    def __repr__(self) -> str:
        return (
            f"SlotAllocator(num_slots={self.num_slots}, page_size={self.page_size}, available={self.available_size()})"
        )
