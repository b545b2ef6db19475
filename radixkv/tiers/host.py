"""`HostStore`: the RAM tier, blocks kept as handed over, least recently used evicted first."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Optional, Sequence

from radixkv.tiers.base import Block, BlockKey, StoreStats, block_nbytes, keeps_held

__all__ = ["HostStore"]


class HostStore:
    """Blocks in this process's memory, within ``capacity_bytes`` (:func:`block_nbytes` each).

    A block is kept as ``put`` hands it (no copy, no encoding: the caller hands the payload
    over); ``get`` checks its token ids against the ones expected (a mismatch is ``corrupt``, the
    block dropped). ``get`` and a repeated ``put`` make a block the most recently used; a ``put``
    evicts the least recently used blocks until the new one fits; a block larger than the whole
    capacity is ``rejected``.

    Args:
        capacity_bytes: the budget in bytes (>= 0).
        on_evict: called after each ``put`` that evicted blocks, outside the store's lock, with
            the evicted ``(key, block)`` pairs, least recently used first (a write-back to a
            lower tier); None: nothing.

    Raises:
        ValueError: ``capacity_bytes`` (named ``host_cache_bytes``) not an int >= 0.
    """

    medium = "host"

    def __init__(
        self, capacity_bytes: int, on_evict: Optional[Callable[[list[tuple[BlockKey, Block]]], None]] = None
    ) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes < 0:
            raise ValueError(f"host_cache_bytes must be an integer >= 0, got {capacity_bytes!r}")
        self._capacity = capacity_bytes
        self._used = 0
        self._blocks: OrderedDict[BlockKey, Block] = OrderedDict()
        self._lock = threading.Lock()
        self._stats = StoreStats()
        self._closed = False
        self._on_evict = on_evict

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        return self._used

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Whether each key is held (nothing counted, no LRU change)."""
        with self._lock:
            return [k in self._blocks for k in keys]

    def get(self, keys: Sequence[BlockKey], tokens: Sequence[Optional[Sequence[int]]]) -> list[Block | None]:
        """The held block of each key when its token ids equal ``tokens[i]`` (None: any), else None."""
        out: list[Block | None] = []
        hits = corrupt = nbytes = 0
        with self._lock:
            for key, toks in zip(keys, tokens, strict=True):
                b = self._blocks.get(key) if not self._closed else None
                if b is not None and toks is not None and b.tokens != tuple(toks):
                    nbytes += block_nbytes(b)
                    del self._blocks[key]
                    self._used -= block_nbytes(b)
                    corrupt += 1
                    b = None
                if b is not None:
                    self._blocks.move_to_end(key)
                    hits += 1
                    nbytes += block_nbytes(b)
                out.append(b)
        self._stats.add(
            hits=hits, misses=len(out) - hits, blocks_read=hits + corrupt, bytes_read=nbytes, corrupt=corrupt
        )
        return out

    def touch(self, keys: Sequence[BlockKey]) -> None:
        """Make each held key the most recently used (the others stay absent)."""
        with self._lock:
            for key in keys:
                if key in self._blocks:
                    self._blocks.move_to_end(key)

    def drop(self, keys: Sequence[BlockKey]) -> None:
        """Remove each key's block (one the engine side refused after this store's checks: its
        layout or length is not the pool's), so that a later ``put`` stores a new one."""
        with self._lock:
            for key in keys:
                b = self._blocks.pop(key, None)
                if b is not None:
                    self._used -= block_nbytes(b)

    def put(self, keys: Sequence[BlockKey], blocks: Sequence[Block], replace: bool = False) -> None:
        """Hold each block (an already held key: only made the most recently used, or with
        ``replace`` given the new block, unless the held one's tokens start with all of its own)."""
        written = nbytes = rejected = 0
        evicted: list[tuple[BlockKey, Block]] = []
        with self._lock:
            for key, block in zip(keys, blocks, strict=True):
                if self._closed:
                    break
                held = self._blocks.get(key)
                if held is not None:
                    if not replace or keeps_held(held.tokens, block.tokens):
                        self._blocks.move_to_end(key)
                        continue
                    self._used -= block_nbytes(self._blocks.pop(key))
                size = block_nbytes(block)
                if size > self._capacity:
                    rejected += 1
                    continue
                while self._used + size > self._capacity:
                    old = self._blocks.popitem(last=False)
                    self._used -= block_nbytes(old[1])
                    evicted.append(old)
                self._blocks[key] = block
                self._used += size
                written += 1
                nbytes += size
        self._stats.add(blocks_written=written, bytes_written=nbytes, evicted=len(evicted), rejected=rejected)
        if evicted and self._on_evict is not None:
            self._on_evict(evicted)

    def delete_all(self) -> None:
        """Drop every block."""
        with self._lock:
            self._blocks.clear()
            self._used = 0

    def stats(self) -> dict[str, int | bool]:
        """Counters (docs/tiers.md "Stores"), ``blocks`` and ``used_bytes`` held, ``degraded`` (False)."""
        with self._lock:
            held = dict(blocks=len(self._blocks), used_bytes=self._used, capacity_bytes=self._capacity)
        return {**self._stats.snapshot(), **held, "degraded": False}

    def close(self) -> None:
        """Drop every block; later calls miss and store nothing. Idempotent."""
        with self._lock:
            self._closed = True
            self._blocks.clear()
            self._used = 0
