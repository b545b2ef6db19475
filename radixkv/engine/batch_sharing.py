"""`BatchSharing`: the in-batch prefix-sharing index of the forward being planned, and the borrow
and rider decisions made on it (docs/engine.md, "In-batch prefix sharing").

While the scheduler plans one forward, the KV manager publishes (:meth:`BatchSharing.publish`)
every prefill row it adds: the row's whole pages ``[0, floor(upto))`` (its computed prefix plus
what it computes now) go into a small radix tree (a :class:`~radixkv.cache.radix_tree.RadixCache`
used as a pure index from tokens to the rows' slots; nothing is allocated, locked or freed in it).
A request admitted later in the same plan may borrow the longest such prefix beyond its cached
one (:meth:`BatchSharing.borrow`): all but its last token, whole pages, at most its
``max_prefix_len``; or, when a published row computes its whole sequence in this forward (an
identical prompt, or a prefix of a longer one ending on a page boundary), all of it, as a
*rider* that samples from that row's logits.

This class decides; the KV manager carries the decision out (it writes the borrowed slots into
the request's ``req_to_token`` row, and re-points them at the prefix cache after the forward).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional

from radixkv.cache.base import MatchResult
from radixkv.cache.radix_tree import RadixCache
from radixkv.engine.request import Request

__all__ = ["BatchSharing", "Borrow"]


@dataclass(frozen=True)
class Borrow:
    """What a request may borrow from the forward being planned.

    Attributes:
        length: positions ``[0, length)`` have K/V once the forward ran (a multiple of the page
            size, or the request's whole sequence for a rider).
        slots: the 1-D int64 slot array of the index's match (at least ``length`` long): position
            ``p`` reads slot ``slots[p]``.
        logits_from: ``(row, position)`` for a rider: the published request whose row computes
            its last position, whose logits it samples from; None otherwise.
    """

    length: int
    slots: Any
    logits_from: Optional[tuple] = None


class BatchSharing:
    """The published prefixes of the forward being planned (module docstring).

    Args:
        page_size: tokens per KV page (borrowed prefixes are whole pages).
        enabled: share what rows of the same forward compute (False: :meth:`begin` opens no
            index, so nothing is published or borrowed).

    Attributes:
        enabled: as above; read at each :meth:`begin`.
    """

    __slots__ = ("page_size", "enabled", "_tree", "_rows")

    def __init__(self, page_size: int, enabled: bool = True) -> None:
        self.page_size = page_size
        self.enabled = bool(enabled)
        self._tree: Optional[RadixCache] = None
        self._rows: List[tuple] = []  # (request, first position computed now, end)

    @property
    def planning(self) -> bool:
        """True between :meth:`begin` and :meth:`end` when sharing is enabled."""
        return self._tree is not None

    def begin(self) -> None:
        """Start planning a forward: nothing is published yet."""
        self._tree = RadixCache(self.page_size) if self.enabled else None
        self._rows = []

    def end(self) -> None:
        """The plan is complete; later admissions share nothing of it."""
        self._tree = None
        self._rows = []

    def publish(self, req: Request, upto: int, page_slots: Any) -> None:
        """``req`` computes positions ``[kv_len, upto)`` in this forward; ``page_slots`` (a 1-D
        int64 slot array) holds its slots of the whole pages ``[0, floor(upto))``, which requests
        admitted after it may borrow. No-op while not :attr:`planning`."""
        if self._tree is None:
            return
        self._rows.append((req, req.kv_len, upto))
        n = len(page_slots)
        if n:
            self._tree.insert(req.all_token_ids[:n], page_slots, req.namespace)

    def computing(self, slot: int, pos: int) -> Optional[Request]:
        """The published row that computes position ``pos`` into ``slot`` in this forward."""
        for r, start, end in self._rows:
            if start <= pos < end and r.slots[pos] == slot:
                return r
        return None

    def _match(self, req: Request) -> Optional[MatchResult]:
        if self._tree is None or req.pin is not None or not self._rows:
            return None
        return self._tree.match_prefix(req.all_token_ids, req.namespace)

    def borrow_limit(self, req: Request) -> int:
        """The most positions ``req`` may borrow without being a rider: all but its last token,
        at most ``max_prefix_len`` (prompt logprobs need their positions' logits), whole pages."""
        n = req.seq_len - 1
        if req.max_prefix_len is not None:
            n = min(n, req.max_prefix_len)
        return n // self.page_size * self.page_size

    def _rider_source(self, req: Request, m: MatchResult) -> Optional[tuple]:
        """``(row, position)`` when a published row computes ``req``'s last position in this
        forward and every position before it is published too (not when it wants prompt
        logprobs)."""
        n = req.seq_len
        if m.length != n or req.max_prefix_len is not None:
            return None
        src = self.computing(int(m.slots[n - 1]), n - 1)
        return None if src is None else (src, n - 1)

    def borrow(self, req: Request) -> Optional[Borrow]:
        """What ``req`` could borrow from the forward being planned, or None when nothing: its
        whole sequence when a row computes all of it now (a rider), else the longest published
        prefix within :meth:`borrow_limit` (possibly 0 long)."""
        m = self._match(req)
        if m is None or m.length == 0:
            return None
        src = self._rider_source(req, m)
        n = m.length if src is not None else min(m.length, self.borrow_limit(req))
        return Borrow(n, m.slots, src)

    def prefix_len(self, req: Request) -> int:
        """The length of :meth:`borrow` (0 when nothing)."""
        b = self.borrow(req)
        return 0 if b is None else b.length
