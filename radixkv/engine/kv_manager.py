"""`KVManager`: the one place that moves KV slots between requests, the prefix cache and the
allocator, and that holds pins.

The scheduler decides *which* requests run; the KV manager alone carries out what that means for
memory: it locks a request's cached prefix, allocates its new pages, writes its row of the block
table (``req_to_token``), hands computed pages to the prefix cache, evicts unlocked cached pages
when the pool is short, frees what nobody holds, and emits the cache events
(:mod:`radixkv.engine.events`). No other module calls the allocator's ``alloc`` / ``free`` or
writes ``req_to_token`` (a test checks this).

Slots take one form per place: a request's ``slots`` is a ``list[int]`` (it grows by a page at a
time); everything that crosses the cache and allocator APIs is a 1-D int64 slot array
(:func:`radixkv.memory.slots.slot_array`, a CPU tensor), converted here and nowhere else.

Pins: a :class:`Pin` keeps a computed prefix in memory for requests that are not running yet
(today the samples ``1 .. n-1`` of a request with ``n > 1``, which share sample 0's prompt). With
a prefix cache the pin holds a lock on the cached prefix (its tokens are *protected*); without one
(``prefix_cache="none"``) it owns the slots and frees them when its last holder lets go. Each
holder keeps one reference until it is released.

Invariant (:meth:`check_integrity`): every slot is exactly one of free, held by the cache, owned
by a running request, or owned by a pin; when idle, ``free + evictable + pinned == capacity``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, List, Optional

import torch

from radixkv.cache.base import MatchResult, PrefixCache
from radixkv.cache.digests import BLOCK_TOKENS, block_digests
from radixkv.engine.events import CacheEvicted, CacheInserted, CacheReset, EventBus
from radixkv.engine.request import Request
from radixkv.memory.allocator import SlotAllocator
from radixkv.memory.kv_pool import ReqToTokenPool

__all__ = ["KVManager", "Pin", "Prefix"]


def _as_slots(slots: List[int]) -> torch.Tensor:
    return torch.tensor(slots, dtype=torch.int64)


class Pin:
    """A computed prefix kept for requests that will attach to it (module docstring).

    Attributes:
        slots: ``list[int]`` KV slots of positions ``[0, len(slots))``, page aligned.
        node: the locked prefix-cache handle (with a prefix cache), else None (the pin owns
            ``slots``).
        refs: holders left; the pin is released when it drops to 0.
    """

    __slots__ = ("slots", "node", "refs")

    def __init__(self, slots: List[int], node: Any, refs: int) -> None:
        self.slots = slots
        self.node = node
        self.refs = refs

    def __len__(self) -> int:
        return len(self.slots)


@dataclass
class Prefix:
    """The borrowed prefix a request is admitted on (:meth:`KVManager.lock_prefix`): its length,
    its slots, and the cache lock (``node``) or the pin that holds them."""

    length: int
    slots: List[int]
    node: Any = None
    pin: Optional[Pin] = None


class KVManager:
    """Slot hand-overs between requests, the prefix cache and the allocator (module docstring).

    Args:
        cache: the prefix cache (:class:`~radixkv.cache.base.PrefixCache`).
        allocator: the KV pool's :class:`~radixkv.memory.allocator.SlotAllocator`.
        req_to_token_pool: the block table (one row per admitted request).
        events: the engine's bus; cache events go there when someone subscribes.

    Attributes:
        evicted_tokens: tokens evicted from the cache so far.

    Raises:
        ValueError: the cache and the allocator have different page sizes.
    """

    def __init__(
        self,
        cache: PrefixCache,
        allocator: SlotAllocator,
        req_to_token_pool: ReqToTokenPool,
        events: Optional[EventBus] = None,
    ) -> None:
        if cache.page_size != allocator.page_size:
            raise ValueError(f"cache page_size {cache.page_size} != allocator page_size {allocator.page_size}")
        self.cache = cache
        self.allocator = allocator
        self.req_to_token_pool = req_to_token_pool
        self.page_size = allocator.page_size
        self.shares = bool(cache.shares_prefixes)
        self.events = events if events is not None else EventBus()
        self.evicted_tokens = 0
        self._seq = 0
        self._pins: dict[int, Pin] = {}  # id(pin) -> pin, every live pin
        if hasattr(cache, "evict_listener"):
            cache.evict_listener = self._on_evict

    # ------------------------------------------------------------------ sizes
    def pages(self, n: int) -> int:
        """``n`` rounded up to whole pages (in slots)."""
        ps = self.page_size
        return (n + ps - 1) // ps * ps

    @property
    def capacity(self) -> int:
        """KV slots in the pool."""
        return self.allocator.num_slots

    def free_size(self) -> int:
        """Slots nobody holds."""
        return self.allocator.available_size()

    def pinned_size(self) -> int:
        """Tokens held by pins (locked in the cache or owned)."""
        return sum(len(p) for p in self._pins.values())

    @property
    def event_seq(self) -> int:
        """The ``seq`` of the last cache event emitted (0: none yet)."""
        return self._seq

    def has_free_row(self) -> bool:
        """True when a ``req_to_token`` row is free."""
        return self.req_to_token_pool.available_size() > 0

    def headroom(self) -> int:
        """Slots that can be made free now: free + evictable."""
        return self.allocator.available_size() + self.cache.evictable_size()

    # ------------------------------------------------------------------ memory
    def _free(self, slots: List[int]) -> None:
        if slots:
            self.allocator.free(_as_slots(slots))

    def ensure_free(self, n: int) -> bool:
        """Evict unlocked cached prefixes until ``n`` slots are free; False if impossible."""
        avail = self.allocator.available_size()
        if avail >= n:
            return True
        if self.cache.evictable_size() > 0:
            freed = self.cache.evict(n - avail)
            if freed.numel():
                self.allocator.free(freed)
                self.evicted_tokens += int(freed.numel())
                if not hasattr(self.cache, "evict_listener") and self.events.wants(CacheEvicted):
                    self._seq += 1
                    self.events.emit(CacheEvicted(self._seq, None, int(freed.numel()), None))
        return self.allocator.available_size() >= n

    def reserve(self, need: int, extra: int) -> bool:
        """Make ``need`` slots free now, provided ``need + extra`` could be (``extra``: what
        running requests will need next); False (nothing evicted) otherwise."""
        return self.headroom() >= need + extra and self.ensure_free(need)

    def grow(self, req: Request, upto: int) -> None:
        """Give ``req`` slots for positions ``[len(req.slots), upto)`` (whole pages); the caller
        has made them free (:meth:`ensure_free`)."""
        need = self.pages(upto) - len(req.slots)
        if need <= 0:
            return
        new = self.allocator.alloc(need)
        if new is None:
            raise RuntimeError(f"allocator refused {need} slots after ensure_free")
        start = len(req.slots)
        req.slots.extend(new.tolist())
        self.req_to_token_pool.write(req.row, start, new)

    # ------------------------------------------------------------------ cache events
    def _insert(self, tokens: List[int], slots: List[int], namespace: Any) -> int:
        k = self.cache.insert(tokens, _as_slots(slots), namespace)
        if self.shares and self.events.wants(CacheInserted) and len(tokens) > k:
            n = len(tokens)
            first, stop = k // BLOCK_TOKENS, n // BLOCK_TOKENS
            digests = tuple(block_digests(tokens, namespace, first, stop)) if stop > first else ()
            self._seq += 1
            self.events.emit(CacheInserted(self._seq, namespace, n - k, first, digests))
        return k

    def _on_evict(self, namespace: Any, path: bytes, start: int) -> None:
        if not self.events.wants(CacheEvicted):
            return
        end = len(path) >> 2
        first, stop = start // BLOCK_TOKENS, end // BLOCK_TOKENS
        digests = tuple(block_digests(path, namespace, first, stop)) if stop > first else ()
        self._seq += 1
        self.events.emit(CacheEvicted(self._seq, namespace, end - start, digests))

    # ------------------------------------------------------------------ admission
    def match(self, req: Request) -> MatchResult:
        """The cached prefix of ``req``'s tokens but the last (whose logits must be computed), at
        most ``req.max_prefix_len`` tokens (prompt logprobs need their positions' logits)."""
        tokens = req.all_token_ids
        n = len(tokens) - 1
        if req.max_prefix_len is not None:
            n = min(n, req.max_prefix_len)
        return self.cache.match_prefix(tokens[:n], req.namespace)

    def prefix_len(self, req: Request) -> int:
        """What ``req`` would reuse if admitted now (its pin, else its cached prefix)."""
        return len(req.pin) if req.pin is not None else self.match(req).length

    def lock_prefix(self, req: Request) -> Prefix:
        """The prefix ``req`` would be admitted on, locked so that no eviction frees it; undo with
        :meth:`unlock_prefix` when it is not admitted after all."""
        if req.pin is not None:
            return Prefix(len(req.pin), list(req.pin.slots), None, req.pin)
        m = self.match(req)
        self.cache.inc_lock_ref(m.node)
        return Prefix(m.length, m.slots.tolist(), m.node)

    def unlock_prefix(self, prefix: Prefix) -> None:
        """Undo :meth:`lock_prefix` (the request was not admitted)."""
        if prefix.pin is None:
            self.cache.dec_lock_ref(prefix.node)

    def admit(self, req: Request, prefix: Prefix, upto: int) -> None:
        """Give ``req`` a ``req_to_token`` row holding ``prefix`` and new pages up to position
        ``upto`` (made free by :meth:`reserve`)."""
        req.row = self.req_to_token_pool.alloc()
        if req.row is None:
            raise RuntimeError("admit: no free req_to_token row (check has_free_row first)")
        req.prefix_node = prefix.node
        req.prefix_len = req.kv_len = prefix.length
        req.slots = list(prefix.slots)
        if prefix.slots:
            self.req_to_token_pool.write(req.row, 0, _as_slots(prefix.slots))
        self.grow(req, upto)

    # ------------------------------------------------------------------ hand-over and release
    def release(self, req: Request) -> None:
        """Hand ``req``'s computed K/V to the prefix cache, free the rest, unlock, drop its row.

        Ranges (``a = kv_len`` floored to pages, ``k`` = what ``insert`` found already cached):
        ``[prefix_len, k)`` freed (duplicates), ``[k, a)`` handed to the cache, ``[a, len(slots))``
        freed, ``[0, prefix_len)`` unlocked (or its pin reference dropped).
        """
        if req.row is not None:
            own_from = req.prefix_len
            aligned = req.kv_len // self.page_size * self.page_size
            if aligned > req.prefix_len:
                k = self._insert(req.all_token_ids[:aligned], req.slots[:aligned], req.namespace)
                if k < req.prefix_len:
                    raise RuntimeError(f"cache.insert found {k} tokens, fewer than the locked prefix {req.prefix_len}")
                self._free(req.slots[own_from:k])
                self._free(req.slots[aligned:])
            else:
                self._free(req.slots[own_from:])
            self.req_to_token_pool.free(req.row)
            req.row = None
        if req.prefix_node is not None:
            self.cache.dec_lock_ref(req.prefix_node)
            req.prefix_node = None
        self.drop_pin(req)
        req.slots = []
        req.prefix_len = 0
        req.kv_len = 0

    def hand_over(self, req: Request, upto: int) -> None:
        """Insert ``req``'s computed tokens ``[0, upto)`` (whole pages) into the cache and move its
        lock to the inserted node: ``[prefix_len, k)`` duplicates are freed and replaced by the
        cache's slots, ``[k, a)`` become the cache's, ``[0, a)`` is the new locked prefix. No-op
        without a prefix cache that shares prefixes, or when nothing new is whole pages."""
        if not self.shares:
            return
        aligned = min(upto, req.kv_len) // self.page_size * self.page_size
        if aligned <= req.prefix_len:
            return
        tokens = req.all_token_ids[:aligned]
        k = self._insert(tokens, req.slots[:aligned], req.namespace)
        m = self.cache.match_prefix(tokens, req.namespace)
        if k < req.prefix_len or m.length != aligned:
            raise RuntimeError(
                f"hand-over: insert found {k}, match {m.length}, expected >= {req.prefix_len} / {aligned}"
            )
        self._free(req.slots[req.prefix_len : k])
        self.cache.inc_lock_ref(m.node)
        if req.prefix_node is not None:
            self.cache.dec_lock_ref(req.prefix_node)
        self.drop_pin(req)  # the cache's lock now covers at least the pin's pages
        req.prefix_node = m.node
        req.slots[:aligned] = m.slots.tolist()
        self.req_to_token_pool.write(req.row, 0, m.slots)
        req.prefix_len = aligned

    # ------------------------------------------------------------------ pins (n > 1)
    def fork(self, parent: Request, children: List[Request]) -> None:
        """Share ``parent``'s computed prompt with ``children`` (samples 1..n-1 of one request):
        the whole pages below its last prompt token are pinned (a cache lock after handing them
        to the cache, or the parent's own slots without a cache) and each child holds a reference
        and is admitted on them, computing only the rest of the prompt."""
        n_prompt = len(parent.prompt_token_ids)
        upto = (n_prompt - 1) // self.page_size * self.page_size
        if self.shares:
            self.hand_over(parent, n_prompt)
            if upto == 0:
                return
            m = self.cache.match_prefix(parent.prompt_token_ids[:upto], parent.namespace)
            if m.length != upto:
                raise RuntimeError(f"fork: the parent's prompt is cached up to {m.length}, expected {upto}")
            self.cache.inc_lock_ref(m.node)
            pin = Pin(m.slots.tolist(), m.node, len(children))
        else:
            if upto == 0 or parent.prefix_len or parent.pin is not None or parent.kv_len < upto:
                return
            # the parent's first pages become the pin's; the parent borrows them from it
            pin = Pin(parent.slots[:upto], None, len(children) + 1)
            parent.pin, parent.prefix_len = pin, upto
        self._pins[id(pin)] = pin
        for c in children:
            c.pin = pin

    def drop_pin(self, req: Request) -> None:
        """Drop ``req``'s pin reference; the last one unlocks (or frees) the pinned prefix."""
        pin = req.pin
        if pin is None:
            return
        req.pin = None
        pin.refs -= 1
        if pin.refs == 0:
            del self._pins[id(pin)]
            if pin.node is not None:
                self.cache.dec_lock_ref(pin.node)
            else:
                self._free(pin.slots)

    def detach_pins(self, waiting: Iterable[Request]) -> None:
        """Last resort when one running request is left short of memory: waiting requests drop
        their pins (they recompute, or re-match, their prefix when admitted)."""
        for r in waiting:
            if r.pin is not None and r.row is None:
                self.drop_pin(r)

    # ------------------------------------------------------------------ cache
    def reset_cache(self) -> bool:
        """Drop every cached prefix; False (nothing done) while a pin or a lock holds any."""
        if self._pins or self.cache.protected_size():
            return False
        freed = self.cache.reset()
        n = int(freed.numel())
        if n:
            self.allocator.free(freed)
        if self.events.wants(CacheReset):
            self._seq += 1
            self.events.emit(CacheReset(self._seq, n))
        return True

    def check_integrity(self, requests: Iterable[Request]) -> None:
        """Raise AssertionError when slot ownership is inconsistent: the cache's own check, and
        every slot counted exactly once among free, cached, owned by ``requests`` (the admitted
        ones; others hold nothing but pins) and owned by pins."""
        self.cache.check_integrity()
        held: set = set()

        def own(slots: List[int]) -> None:
            for s in slots:
                if s in held:
                    raise AssertionError(f"slot {s} owned twice")
                held.add(s)

        for r in requests:
            if r.row is not None:
                own(r.slots[r.prefix_len :])
            elif r.slots:
                raise AssertionError(f"{r!r} holds slots without a req_to_token row")
        for pin in self._pins.values():
            if pin.refs < 1:
                raise AssertionError(f"a live pin has {pin.refs} references")
            if pin.node is None:
                own(pin.slots)
        cap = self.allocator.num_slots
        free, total = self.allocator.available_size(), self.cache.total_size()
        if free + total + len(held) != cap:
            raise AssertionError(f"free {free} + cached {total} + held {len(held)} != capacity {cap}")
