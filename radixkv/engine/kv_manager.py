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

In-batch sharing (docs/engine.md, "In-batch prefix sharing"): while the scheduler plans one
forward it publishes (:meth:`~KVManager.publish`) every prefill row it adds into a small radix
tree of the tokens that will have K/V at the end of that forward (the rows' computed prefixes
plus what they compute now, whole pages). A request admitted later in the same plan borrows the
longest such prefix beyond its cached one: its ``req_to_token`` row points at the computing
row's slots, which every attention backend writes before it attends in each layer, so the sharer
attends to them as its prefix in that very forward. After the forward,
:meth:`~KVManager.settle` re-points the borrowed positions at the prefix cache (the computing row
has handed them over by then) and the sharer locks them there like any cached prefix. A request
whose whole sequence is computed by another row (an identical prompt, or a prefix of a longer
one, ending on a page boundary) computes nothing: it samples from that row's logits
(``Request.logits_from``).

Pins: a :class:`Pin` keeps a computed prefix in memory for holders that are not running now: the
samples ``1 .. n-1`` of a request with ``n > 1`` (hard pins, released by the samples), and
sessions (soft pins, :meth:`~KVManager.pin_prefix`; also the server's stored responses). With a
prefix cache the pin holds a lock on the cached prefix (its tokens are *protected*); without one
(``prefix_cache="none"``) it owns the slots and frees them when its last holder lets go. Each
holder keeps one reference until it is released. Soft pins are bounded: past
``max_pinned_tokens`` (distinct pinned tokens) or ``pin_idle_timeout`` seconds without use, the
least recently used soft pin is dropped (its tokens become evictable, not freed), and when a
running request is short of memory soft pins are dropped before anything is retracted.

Invariant (:meth:`check_integrity`): every slot is exactly one of free, held by the cache, owned
by a running request, or owned by a pin; when idle, ``free + evictable + pinned == capacity``
and ``protected == pinned``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, List, Optional

import torch

from radixkv.cache.base import MatchResult, PrefixCache
from radixkv.cache.digests import BLOCK_TOKENS, block_digests
from radixkv.cache.radix_tree import RadixCache
from radixkv.engine.events import CacheEvicted, CacheInserted, CacheReset, EventBus
from radixkv.engine.request import Request
from radixkv.memory.allocator import SlotAllocator
from radixkv.memory.kv_pool import ReqToTokenPool
from radixkv.namespace import Namespace

__all__ = ["KVManager", "Pin", "Prefix"]


def _as_slots(slots: List[int]) -> torch.Tensor:
    return torch.tensor(slots, dtype=torch.int64)


class Pin:
    """A computed prefix kept for holders that will attach to it (module docstring).

    Attributes:
        slots: ``list[int]`` KV slots of positions ``[0, len(slots))``, page aligned.
        node: the locked prefix-cache handle (with a prefix cache), else None (the pin owns
            ``slots``).
        refs: holders left; the pin is released when it drops to 0.
        soft: True for a session's pin, which the KV manager may drop (LRU, idle timeout, or
            memory for running requests); False for the pin of ``n > 1`` samples.
        last_used: the KV manager's clock (seconds) when a holder last used it.
        live: False once released or dropped (a holder's handle then pins nothing).
    """

    __slots__ = ("slots", "node", "refs", "soft", "last_used", "live")

    def __init__(self, slots: List[int], node: Any, refs: int, soft: bool = False, last_used: float = 0.0) -> None:
        self.slots = slots
        self.node = node
        self.refs = refs
        self.soft = soft
        self.last_used = last_used
        self.live = True

    def __len__(self) -> int:
        return len(self.slots)

    def __repr__(self) -> str:
        return f"Pin({len(self.slots)} tokens, refs={self.refs}, soft={self.soft}, live={self.live})"


@dataclass
class Prefix:
    """The borrowed prefix a request is admitted on (:meth:`KVManager.lock_prefix`): its length,
    its slots, and the cache lock (``node``) or the pin that holds them. ``shared``: how many of
    its last positions are borrowed from rows computing them in the forward being planned
    (in-batch sharing); ``logits_from``: ``(request, position)`` whose logits it samples from
    when that row computes its whole sequence (it then computes nothing itself)."""

    length: int
    slots: List[int]
    node: Any = None
    pin: Optional[Pin] = None
    shared: int = 0
    logits_from: Optional[tuple] = None


class _BatchPrefixes:
    """The prefixes that will have K/V at the end of the forward being planned: a radix tree
    (used as a pure index, :class:`~radixkv.cache.radix_tree.RadixCache`) from the tokens of
    every published prefill row to their slots, and each row's computed range."""

    __slots__ = ("tree", "rows")

    def __init__(self, page_size: int) -> None:
        self.tree = RadixCache(page_size)
        self.rows: List[tuple] = []  # (request, first position computed now, end)

    def computing(self, slot: int, pos: int) -> Optional[Request]:
        """The published row that computes position ``pos`` into ``slot`` in this forward."""
        for r, start, end in self.rows:
            if start <= pos < end and r.slots[pos] == slot:
                return r
        return None


class KVManager:
    """Slot hand-overs between requests, the prefix cache and the allocator (module docstring).

    Args:
        cache: the prefix cache (:class:`~radixkv.cache.base.PrefixCache`).
        allocator: the KV pool's :class:`~radixkv.memory.allocator.SlotAllocator`.
        req_to_token_pool: the block table (one row per admitted request).
        events: the engine's bus; cache events go there when someone subscribes.
        max_pinned_tokens: bound on the distinct tokens soft pins hold (None: no bound).
        pin_idle_timeout: seconds after which an unused soft pin is dropped (None: never).
        clock: the time source of ``pin_idle_timeout`` (default ``time.monotonic``; tests
            inject a fake one).
        in_batch_sharing: share prefixes computed by rows of the same forward (False: only
            what is cached when a request is admitted is shared).

    Attributes:
        evicted_tokens: tokens evicted from the cache so far.
        dropped_pins: soft pins dropped by the KV manager (limit, timeout, memory) so far.

    Raises:
        ValueError: the cache and the allocator have different page sizes.
    """

    def __init__(
        self,
        cache: PrefixCache,
        allocator: SlotAllocator,
        req_to_token_pool: ReqToTokenPool,
        events: Optional[EventBus] = None,
        *,
        max_pinned_tokens: Optional[int] = None,
        pin_idle_timeout: Optional[float] = None,
        clock: Optional[Callable[[], float]] = None,
        in_batch_sharing: bool = True,
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
        self.dropped_pins = 0
        self.max_pinned_tokens = max_pinned_tokens
        self.pin_idle_timeout = pin_idle_timeout
        self.clock: Callable[[], float] = clock if clock is not None else time.monotonic
        self.in_batch_sharing = bool(in_batch_sharing) and self.shares
        self._seq = 0
        self._pins: dict[int, Pin] = {}  # id(pin) -> pin, every live pin
        self._pinned: dict[int, int] = {}  # slot -> live pins holding it (distinct pinned tokens)
        self._batch: Optional[_BatchPrefixes] = None  # the forward being planned (in-batch sharing)
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
        """Distinct tokens held by pins (locked in the cache or owned); pins sharing a prefix
        (forked sessions) count it once."""
        return len(self._pinned)

    @property
    def num_pins(self) -> int:
        """Live pins."""
        return len(self._pins)

    @property
    def event_seq(self) -> int:
        """The ``seq`` of the last cache event emitted (0: none yet)."""
        return self._seq

    def replace_block_table(self, req_to_token_pool: ReqToTokenPool) -> None:
        """Swap in another block table (e.g. longer rows) while no request holds a row.

        Raises:
            RuntimeError: a row of the current table is in use.
        """
        old = self.req_to_token_pool
        if old.available_size() != old.max_running_requests:
            raise RuntimeError("replace_block_table: rows of the block table are in use")
        self.req_to_token_pool = req_to_token_pool

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
    def _insert(self, tokens: List[int], slots: List[int], namespace: Optional[Namespace]) -> int:
        k = self.cache.insert(tokens, _as_slots(slots), namespace)
        if self.shares and self.events.wants(CacheInserted) and len(tokens) > k:
            n = len(tokens)
            first, stop = k // BLOCK_TOKENS, n // BLOCK_TOKENS
            digests = tuple(block_digests(tokens, namespace, first, stop)) if stop > first else ()
            self._seq += 1
            self.events.emit(CacheInserted(self._seq, namespace, n - k, first, digests))
        return k

    def _on_evict(self, namespace: Optional[Namespace], path: bytes, start: int) -> None:
        if not self.events.wants(CacheEvicted):
            return
        end = len(path) >> 2
        first, stop = start // BLOCK_TOKENS, end // BLOCK_TOKENS
        digests = tuple(block_digests(path, namespace, first, stop)) if stop > first else ()
        self._seq += 1
        self.events.emit(CacheEvicted(self._seq, namespace, end - start, digests))

    # ------------------------------------------------------------------ in-batch sharing
    def begin_batch(self) -> None:
        """Start planning a forward: nothing is published yet (module docstring)."""
        self._batch = _BatchPrefixes(self.page_size) if self.in_batch_sharing else None

    def end_batch(self) -> None:
        """The plan is complete; later admissions share nothing of it."""
        self._batch = None

    def publish(self, req: Request, upto: int) -> None:
        """``req`` (admitted, with slots up to ``upto``) computes positions ``[kv_len, upto)`` in
        the forward being planned: its whole pages ``[0, floor(upto))`` may be borrowed by
        requests admitted after it in the same plan."""
        b = self._batch
        if b is None:
            return
        b.rows.append((req, req.kv_len, upto))
        n = upto // self.page_size * self.page_size
        if n:
            b.tree.insert(req.all_token_ids[:n], _as_slots(req.slots[:n]), req.namespace)

    def _batch_match(self, req: Request) -> Optional[MatchResult]:
        if self._batch is None or req.pin is not None or not self._batch.rows:
            return None
        return self._batch.tree.match_prefix(req.all_token_ids, req.namespace)

    def _borrow_limit(self, req: Request) -> int:
        """The most positions ``req`` may borrow without being a rider: all but its last token,
        at most ``max_prefix_len`` (prompt logprobs need their positions' logits), whole pages."""
        n = req.seq_len - 1
        if req.max_prefix_len is not None:
            n = min(n, req.max_prefix_len)
        return n // self.page_size * self.page_size

    def _rider_source(self, req: Request, b: MatchResult) -> Optional[tuple]:
        """``(row, position)`` when a published row computes ``req``'s last position in this
        forward and every position before it is published too: ``req`` then samples from that
        row's logits and computes nothing (not when it wants prompt logprobs)."""
        n = req.seq_len
        if b.length != n or req.max_prefix_len is not None:
            return None
        src = self._batch.computing(int(b.slots[n - 1]), n - 1)
        return None if src is None else (src, n - 1)

    def batch_prefix_len(self, req: Request) -> int:
        """The prefix ``req`` could borrow from the forward being planned (0 when none): its
        whole sequence when a row computes all of it now, else at most all but its last token."""
        b = self._batch_match(req)
        if b is None or b.length == 0:
            return 0
        if self._rider_source(req, b) is not None:
            return b.length
        return min(b.length, self._borrow_limit(req))

    def settle(self, req: Request) -> None:
        """After the forward in which ``req`` borrowed positions from other rows: re-point its
        whole borrowed prefix ``[0, prefix_len)`` at the prefix cache (those rows have handed
        their pages over by now) and lock it there, like a cached prefix."""
        if not req.shared_len:
            return
        n = req.prefix_len
        m = self.cache.match_prefix(req.all_token_ids[:n], req.namespace)
        if m.length != n:
            raise RuntimeError(f"settle: {req!r} borrowed {n} tokens but the cache holds {m.length} of them")
        self.cache.inc_lock_ref(m.node)
        if req.prefix_node is not None:
            self.cache.dec_lock_ref(req.prefix_node)
        req.prefix_node = m.node
        req.slots[:n] = m.slots.tolist()
        self.req_to_token_pool.write(req.row, 0, m.slots)
        req.shared_len = 0
        req.logits_from = None

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
        """What ``req`` would reuse if admitted now (its pin, else its cached prefix or what it
        can borrow from the forward being planned)."""
        if req.pin is not None:
            return len(req.pin)
        return max(self.match(req).length, self.batch_prefix_len(req))

    def lock_prefix(self, req: Request) -> Prefix:
        """The prefix ``req`` would be admitted on, locked so that no eviction frees it; undo with
        :meth:`unlock_prefix` when it is not admitted after all. Beyond its cached prefix it
        borrows what rows published in the forward being planned compute (module docstring)."""
        if req.pin is not None:
            return Prefix(len(req.pin), list(req.pin.slots), None, req.pin)
        m = self.match(req)
        self.cache.inc_lock_ref(m.node)
        slots = m.slots.tolist()
        b = self._batch_match(req)
        if b is not None and b.length > m.length:
            src = self._rider_source(req, b)
            n = b.length if src is not None else min(b.length, self._borrow_limit(req))
            if n > m.length:
                slots += b.slots[m.length : n].tolist()
                return Prefix(n, slots, m.node, None, n - m.length, src)
        return Prefix(m.length, slots, m.node)

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
        req.shared_len = req.num_shared_tokens = prefix.shared
        req.logits_from = prefix.logits_from
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
        req.shared_len = 0
        req.logits_from = None

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
            pin = Pin(m.slots.tolist(), m.node, len(children), last_used=self.clock())
        else:
            if upto == 0 or parent.prefix_len or parent.pin is not None or parent.kv_len < upto:
                return
            # the parent's first pages become the pin's; the parent borrows them from it
            pin = Pin(parent.slots[:upto], None, len(children) + 1, last_used=self.clock())
            parent.pin, parent.prefix_len = pin, upto
        self._add_pin(pin)
        for c in children:
            c.pin = pin

    def drop_pin(self, req: Request) -> None:
        """Drop ``req``'s pin reference; the last one unlocks (or frees) the pinned prefix."""
        pin = req.pin
        if pin is None:
            return
        req.pin = None
        self.release_pin(pin)

    def detach_pins(self, waiting: Iterable[Request]) -> None:
        """Last resort when one running request is left short of memory: waiting requests drop
        their pins (they recompute, or re-match, their prefix when admitted)."""
        for r in waiting:
            if r.pin is not None and r.row is None:
                self.drop_pin(r)

    # ------------------------------------------------------------------ pins (sessions)
    def _add_pin(self, pin: Pin) -> None:
        self._pins[id(pin)] = pin
        counts = self._pinned
        for s in pin.slots:
            counts[s] = counts.get(s, 0) + 1

    def _remove_pin(self, pin: Pin) -> None:
        """Unlock (or free) what ``pin`` holds, whatever its references; it is dead afterwards."""
        del self._pins[id(pin)]
        pin.live = False
        counts = self._pinned
        for s in pin.slots:
            c = counts[s] - 1
            if c:
                counts[s] = c
            else:
                del counts[s]
        if pin.node is not None:
            self.cache.dec_lock_ref(pin.node)
        else:
            self._free(pin.slots)

    def pin_prefix(self, tokens: List[int], namespace: Optional[Namespace] = None) -> Optional[Pin]:
        """A soft pin (one reference, the caller's) on the cached prefix of ``tokens``: its whole
        pages stay in memory, protected from eviction, until :meth:`release_pin` (or until the
        KV manager drops it: ``max_pinned_tokens``, ``pin_idle_timeout``, or memory a running
        request needs). None when nothing of ``tokens`` is cached, or without a prefix cache
        (``prefix_cache="none"`` keeps nothing). The bounds are applied at once, so the pin
        returned may already be dead (``live`` False) when it alone exceeds the token bound.
        ``namespace``: normalized (``Namespace.of``; the engine's ``pin_prefix`` does it)."""
        if not self.shares or not tokens:
            return None
        m = self.cache.match_prefix(tokens, namespace)
        if m.length == 0:
            return None
        self.cache.inc_lock_ref(m.node)
        pin = Pin(m.slots.tolist(), m.node, 1, soft=True, last_used=self.clock())
        self._add_pin(pin)
        self.expire_pins()
        return pin

    def retain_pin(self, pin: Pin) -> bool:
        """One more holder of ``pin`` (a forked session): True, or False when it is dead."""
        if not pin.live:
            return False
        pin.refs += 1
        pin.last_used = self.clock()
        return True

    def touch_pin(self, pin: Pin) -> None:
        """A holder uses ``pin`` now (it becomes the most recently used)."""
        pin.last_used = self.clock()

    def release_pin(self, pin: Pin) -> None:
        """A holder lets go of ``pin``; the last one unlocks (or frees) it. No-op on a dead pin."""
        if not pin.live:
            return
        pin.refs -= 1
        if pin.refs <= 0:
            self._remove_pin(pin)

    def _soft_pins_lru(self) -> List[Pin]:
        return sorted((p for p in self._pins.values() if p.soft), key=lambda p: p.last_used)

    def _drop_soft(self, pin: Pin) -> None:
        self._remove_pin(pin)
        self.dropped_pins += 1

    def expire_pins(self) -> int:
        """Drop the soft pins idle for ``pin_idle_timeout`` seconds, then the least recently used
        ones while more than ``max_pinned_tokens`` distinct tokens are pinned; returns how many
        were dropped. Their tokens stay cached, evictable."""
        if not self._pins:
            return 0
        dropped = 0
        if self.pin_idle_timeout is not None:
            now = self.clock()
            for p in [p for p in self._pins.values() if p.soft and now - p.last_used >= self.pin_idle_timeout]:
                self._drop_soft(p)
                dropped += 1
        if self.max_pinned_tokens is not None and len(self._pinned) > self.max_pinned_tokens:
            lru = self._soft_pins_lru()
            while lru and len(self._pinned) > self.max_pinned_tokens:
                self._drop_soft(lru.pop(0))
                dropped += 1
        return dropped

    def yield_pins(self, need: int) -> bool:
        """Make ``need`` slots free for a running request, dropping soft pins (least recently used
        first) when evicting what is unlocked is not enough; False if even that is not."""
        lru = None
        while not self.ensure_free(need):
            if lru is None:
                lru = self._soft_pins_lru()
            if not lru:
                return False
            self._drop_soft(lru.pop(0))
        return True

    # ------------------------------------------------------------------ cache
    def reset_cache(self) -> bool:
        """Drop every cached prefix, and the soft pins on them (sessions keep their contexts and
        recompute them); False (nothing done) while a request's pin or lock holds any."""
        if any(not p.soft for p in self._pins.values()):
            return False
        for p in list(self._pins.values()):
            self._drop_soft(p)
        if self.cache.protected_size():  # a request's lock (the caller checks none is admitted)
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
            if r.shared_len or r.logits_from is not None:
                raise AssertionError(f"{r!r} still borrows {r.shared_len} tokens from a forward that has run")
            if r.row is not None:
                own(r.slots[r.prefix_len :])
            elif r.slots:
                raise AssertionError(f"{r!r} holds slots without a req_to_token row")
            if r.pin is not None and not r.pin.live:
                raise AssertionError(f"{r!r} holds a dead pin")
        counts: dict[int, int] = {}
        for pin in self._pins.values():
            if pin.refs < 1 or not pin.live:
                raise AssertionError(f"a registered pin has {pin.refs} references (live={pin.live})")
            if pin.node is None:
                own(pin.slots)
            for s in pin.slots:
                counts[s] = counts.get(s, 0) + 1
        if counts != self._pinned:
            raise AssertionError("the pinned-token counts disagree with the live pins")
        cap = self.allocator.num_slots
        free, total = self.allocator.available_size(), self.cache.total_size()
        if free + total + len(held) != cap:
            raise AssertionError(f"free {free} + cached {total} + held {len(held)} != capacity {cap}")
