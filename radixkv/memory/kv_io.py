"""Bit-exact copies of KV slots between the pool and host memory: the payload of the KV tiers.

A KV tier (docs/tiers.md) stores the K/V of 16-token blocks as opaque bytes. This module turns
slots of a :class:`~radixkv.memory.kv_pool.KVPool` into those bytes and back, generic over the
pool's per-slot tensors: ``k_buffer`` and ``v_buffer`` of every layer and, when the pool has
them (fp8 K/V), ``k_scale`` and ``v_scale``; any other dtype or head layout too, since every
tensor is copied as raw bytes (a ``uint8`` view), never converted.

Layout of the bytes of ``n`` slots (:class:`KVLayout`): row ``i`` (``token_bytes`` bytes) holds
slot ``slots[i]``: for each tensor name in :data:`PER_SLOT_TENSORS` the pool has, for each layer,
that slot's bytes of that tensor. A 16-token block's payload is its 16 rows. ``meta`` names the
layout (tensor names, dtypes, per-slot shapes, layers): bytes from one pool scatter into another
only when their ``meta`` is equal, so a block never lands in a pool of another dtype or shape.

The KV manager calls these (it alone decides which slots); nothing here allocates or frees slots.
"""

from __future__ import annotations

import json
import weakref
from typing import Any, List, Sequence, Tuple

import torch

__all__ = ["PER_SLOT_TENSORS", "KVLayout", "layout_of", "gather_rows", "scatter_rows", "gather_block", "scatter_block"]

PER_SLOT_TENSORS = ("k_buffer", "v_buffer", "k_scale", "v_scale")
"""The pool attributes copied, in this order (each a list of per-layer tensors, or None)."""

_LAYOUTS: "weakref.WeakKeyDictionary[Any, KVLayout]" = weakref.WeakKeyDictionary()


class KVLayout:
    """How one pool's slots map to bytes (module docstring).

    Args:
        pool: a :class:`~radixkv.memory.kv_pool.KVPool` (or any object with ``num_slots``,
            ``device`` and the per-slot tensor lists of :data:`PER_SLOT_TENSORS`, each tensor
            contiguous with ``num_slots`` rows in its leading dimensions).

    Attributes:
        views: one ``uint8`` view ``[num_slots, row bytes]`` of each per-slot tensor (sharing
            the pool's memory), in payload order.
        token_bytes: bytes of one slot's row (the sum of the views' widths).
        meta: the layout's name (bytes; equal layouts, equal bytes).
        device: the pool's device.

    Raises:
        ValueError: a per-slot tensor that is not contiguous or whose elements do not divide
            into ``num_slots`` rows.
    """

    def __init__(self, pool: Any) -> None:
        n = int(pool.num_slots)
        self.device = torch.device(getattr(pool, "device", "cpu"))
        self.views: List[torch.Tensor] = []
        desc = []
        for name in PER_SLOT_TENSORS:
            bufs = getattr(pool, name, None)
            if bufs is None:
                continue
            for layer, t in enumerate(bufs):
                if t is None:
                    continue
                if not t.is_contiguous() or t.numel() % n:
                    raise ValueError(f"kv_io: {name}[{layer}] {tuple(t.shape)} is not {n} contiguous slot rows")
                self.views.append(t.view(n, -1).view(torch.uint8))
                desc.append([name, layer, str(t.dtype).replace("torch.", ""), t.numel() // n])
        self.widths = [int(v.shape[1]) for v in self.views]
        self.token_bytes = sum(self.widths)
        self.meta = json.dumps({"kv": 1, "tensors": desc}, separators=(",", ":")).encode()

    @property
    def block_bytes(self) -> int:
        """Bytes of a 16-token block's payload."""
        return 16 * self.token_bytes


def layout_of(pool: Any) -> KVLayout:
    """The :class:`KVLayout` of ``pool`` (built once per pool)."""
    lay = _LAYOUTS.get(pool)
    if lay is None:
        lay = _LAYOUTS[pool] = KVLayout(pool)
    return lay


def _index(slots: Any, device: torch.device) -> torch.Tensor:
    idx = slots if isinstance(slots, torch.Tensor) else torch.as_tensor(list(slots), dtype=torch.int64)
    return idx.to(device=device, dtype=torch.int64)


def gather_rows(pool: Any, slots: Any) -> torch.Tensor:
    """The bytes of ``slots`` of ``pool``: a CPU ``uint8`` tensor ``[len(slots), token_bytes]``
    (row ``i`` is slot ``slots[i]``; module docstring), a copy (the slots may be reused after).

    Args:
        pool: the KV pool.
        slots: slot ids (a 1-D int tensor or a sequence of ints), in ``[0, num_slots)``.
    """
    lay = layout_of(pool)
    idx = _index(slots, lay.device)
    if not lay.views:
        return torch.empty((idx.numel(), 0), dtype=torch.uint8)
    out = torch.cat([v.index_select(0, idx) for v in lay.views], dim=1)
    return out.cpu() if out.device.type != "cpu" else out


def scatter_rows(pool: Any, slots: Any, rows: torch.Tensor) -> None:
    """Write ``rows`` (``uint8`` ``[len(slots), token_bytes]``, as :func:`gather_rows` returns,
    on any device) into ``slots`` of ``pool``, bit for bit.

    Raises:
        ValueError: ``rows`` is not ``uint8`` of that shape.
    """
    lay = layout_of(pool)
    idx = _index(slots, lay.device)
    if rows.dtype != torch.uint8 or tuple(rows.shape) != (idx.numel(), lay.token_bytes):
        raise ValueError(
            f"scatter_rows: rows must be uint8 [{idx.numel()}, {lay.token_bytes}], got {rows.dtype} {tuple(rows.shape)}"
        )
    src = rows.to(lay.device, non_blocking=True)
    off = 0
    for v, w in zip(lay.views, lay.widths):
        v.index_copy_(0, idx, src[:, off : off + w])
        off += w


def gather_block(pool: Any, slots: Sequence[int]) -> Tuple[bytes, bytes]:
    """``(payload, meta)`` of one block: the bytes of its slots (16 for a tier block) and the
    pool's layout name (:class:`KVLayout`)."""
    return gather_rows(pool, slots).numpy().tobytes(), layout_of(pool).meta


def scatter_block(pool: Any, slots: Sequence[int], payload: bytes, meta: bytes) -> None:
    """Write a block's ``payload`` (from :func:`gather_block` of a pool with the same layout)
    into ``slots`` of ``pool``.

    Raises:
        ValueError: ``meta`` is not this pool's layout, or the payload's length does not match.
    """
    lay = layout_of(pool)
    if bytes(meta) != lay.meta:
        raise ValueError("scatter_block: the block's layout (meta) differs from this pool's")
    n = len(slots)
    if len(payload) != n * lay.token_bytes:
        raise ValueError(f"scatter_block: payload of {len(payload)} bytes, expected {n * lay.token_bytes}")
    rows = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(n, lay.token_bytes)
    scatter_rows(pool, slots, rows)
