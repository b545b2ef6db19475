"""KV tiers in the cache simulator: each tier a capacity of 16-token blocks, least recently used
first, written as the engine writes its tiers (docs/tiers.md).

A tier holds block digests (:mod:`radixkv.cache.digests`: chained, namespace-seeded) and tails
(the partial block after a sequence's whole blocks, under its
:func:`~radixkv.cache.digests.tail_digest`, with its tokens; a block takes 16 tokens of the
capacity, a tail its own, as the engine's stores count a record's bytes). The
simulator hands the model to its KV manager as its tiers, so the model hears the engine's own
writes (:meth:`TierModel.write`): a write-through tier takes every block that becomes fully
cached in the pool and the tail after them, a write-back tier every block the pool evicts and
the tail of each evicted path. A request's lookup, after the pool's match, takes the longest run of following
whole blocks that some tier holds (in tier order, each block from the first tier holding it; the
run refreshed there), then the part of the tail after them that the first tier holding one
shares with the request's tokens, page-floored, below its last token: what the engine would
load (the cost rule aside: the simulator counts every held block as loaded). It models what a
tier holds, not how long it takes.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Sequence

from radixkv.cache.digests import BLOCK_TOKENS, block_digests, namespace_seed, tail_digest
from radixkv.config import DEFAULT_WRITE_POLICY, TIER_MEDIA
from radixkv.engine.tier_io import lookup_stop, merge_spans, shared_len
from radixkv.tiers.base import keeps_held

__all__ = ["TierModel"]


class TierModel:
    """Tiers of the given capacities (module docstring).

    Args:
        capacities: ``{medium: tokens}`` for some of ``host``, ``disk``, ``remote`` (floored to
            whole 16-token blocks; 0 or absent: no such tier).
        write_policy: ``{medium: "write_through" | "write_back"}`` (default: the engine's,
            write-back for host, write-through for disk and remote).

    Raises:
        ValueError: an unknown medium or a negative capacity.
    """

    def __init__(self, capacities: Dict[str, int], write_policy: Optional[Dict[str, str]] = None) -> None:
        bad = [m for m in capacities if m not in TIER_MEDIA]
        if bad or any(int(c) < 0 for c in capacities.values()):
            raise ValueError(f"tier capacities must be tokens >= 0 for tiers among {TIER_MEDIA}, got {capacities!r}")
        policy = dict(DEFAULT_WRITE_POLICY, **(write_policy or {}))
        self.blocks = {m: int(capacities[m]) // BLOCK_TOKENS for m in TIER_MEDIA if capacities.get(m)}
        self.held: Dict[str, OrderedDict] = {m: OrderedDict() for m in self.blocks}
        self.through = [m for m in self.held if policy[m] == "write_through"]
        self.back = [m for m in self.held if policy[m] == "write_back"]
        self.held_tokens = 0  # the KV manager's view: nothing is ever installed and held
        self.used = dict.fromkeys(self.held, 0)  # tokens held per tier (a tail its own)

    @property
    def writes_back(self) -> bool:
        """Whether some tier is written when the pool evicts."""
        return bool(self.back)

    def write(
        self,
        policy: str,
        namespace: Any,
        tokens: Any,
        first: int,
        stop: int,
        slots: Any = None,
        skip: Sequence[str] = (),
        tail: int = 0,
    ) -> None:
        """The engine's tier write (:meth:`radixkv.engine.tiers.TierManager.write`): blocks
        ``[first, stop)`` of ``tokens`` (ids or their int32 bytes) and the ``tail`` tokens after
        them go to the ``policy`` tiers (but ``skip``); ``slots`` is ignored."""
        media = [m for m in (self.through if policy == "write_through" else self.back) if m not in skip]
        if isinstance(tokens, (bytes, bytearray)):
            tokens = array("i", tokens)
        if tail:  # deepest first, as the engine's I/O thread puts them: the head is the most recent
            key = _tail_key(namespace, tokens, stop)
            self._put(media, [key], tuple(tokens[BLOCK_TOKENS * stop : BLOCK_TOKENS * stop + tail]))
        if stop > first:
            self._put(media, block_digests(tokens, namespace, first, stop)[::-1])

    def _put(self, media: Sequence[str], digests: Sequence[bytes], value: Any = None) -> None:
        """Hold ``digests`` (blocks, or one tail: ``value`` its tokens, kept where the held tail
        starts with all of them, as the engine's stores do) in ``media``, dropping the
        least recently used entries past the capacity: a block costs its 16 tokens, a tail its
        own (the engine's stores count a record's bytes: a tail's are about ``c / 16`` of a
        block's)."""
        cost = BLOCK_TOKENS if value is None else len(value)
        for m in media:
            held, cap = self.held[m], self.blocks[m] * BLOCK_TOKENS
            for d in digests:
                if d in held:
                    prev = held[d]
                    if value is not None and keeps_held(prev, value):  # a longer tail of its tokens: kept
                        held.move_to_end(d)
                        continue
                    self.used[m] -= BLOCK_TOKENS if prev is None else len(prev)
                held[d] = value
                held.move_to_end(d)
                self.used[m] += cost
            while self.used[m] > cap:
                _, v = held.popitem(last=False)
                self.used[m] -= BLOCK_TOKENS if v is None else len(v)

    def lookup(self, namespace: Any, tokens: Sequence[int], start: int, limit: int, page_size: int) -> List[tuple]:
        """``(lo, hi, medium)`` spans of ``tokens`` after the ``start`` the pool holds, up to
        position ``limit`` (exclusive; page-floored here), that the tiers would serve."""
        first, stop = start // BLOCK_TOKENS, lookup_stop(len(tokens), limit)
        if limit <= start or not self.held:
            return []
        media: List[str] = []
        for d in block_digests(tokens, namespace, first, stop):
            m = next((m for m in self.held if d in self.held[m]), None)
            if m is None:
                break
            self.held[m].move_to_end(d)
            media.append(m)
        at = BLOCK_TOKENS * (first + len(media))
        ends = [BLOCK_TOKENS * (first + i + 1) for i in range(len(media))]
        c, m = self._tail(namespace, tokens, first + len(media), tuple(tokens[at:limit]))
        if c:
            media, ends = media + [m], ends + [at + c]
        end = min(limit, ends[-1] if ends else 0) // page_size * page_size
        # each block's own positions, as the engine counts them
        return merge_spans(start, [(BLOCK_TOKENS * (first + i), min(end, ends[i]), m) for i, m in enumerate(media)])

    def _tail(self, namespace: Any, tokens: Sequence[int], b: int, want: tuple) -> tuple:
        """``(c, medium)``: the tokens of ``want`` that the tail after block ``b - 1`` held by the
        first tier holding one that shares any shares (refreshed there); ``(0, None)``: none."""
        want = want[:BLOCK_TOKENS]
        key = _tail_key(namespace, tokens, b) if want else None
        for m in self.held if want else ():
            held = self.held[m].get(key)
            c = shared_len(held, want) if held else 0
            if c:
                self.held[m].move_to_end(key)
                return c, m
        return 0, None


def _tail_key(namespace: Any, tokens: Sequence[int], b: int) -> bytes:
    """The name of the tail after block ``b - 1`` of ``tokens`` (``b`` 0: the namespace's seed)."""
    parent = block_digests(tokens, namespace, b - 1, b)[0] if b else namespace_seed(namespace)
    return tail_digest(parent)
