"""`KVManager`: the one place that moves KV slots between requests, the prefix cache and the
allocator, and that holds pins (through its pin table).

The scheduler decides *which* requests run; the KV manager alone carries out what that means for
memory: it locks a request's cached prefix, allocates its new pages, writes its row of the block
table (``req_to_token``), hands computed pages to the prefix cache, evicts unlocked cached pages
when the pool is short, frees what nobody holds, and emits the cache events
(:mod:`radixkv.engine.events`). No other module calls the allocator's ``alloc`` / ``free`` or
writes ``req_to_token`` (a test checks this).

Slots take one form per place: a request's ``slots`` is a ``list[int]`` (it grows by a page at a
time); everything that crosses the cache and allocator APIs is a 1-D int64 slot array
(:func:`radixkv.memory.slots.slot_array`, a CPU tensor), converted here and nowhere else.

Two helpers keep their own bookkeeping beside it and move no slot themselves:

* :class:`~radixkv.engine.batch_sharing.BatchSharing` (``kv.sharing``), in-batch prefix sharing
  (docs/engine.md, "In-batch prefix sharing"): while the scheduler plans one forward, every
  prefill row it adds is published (:meth:`~KVManager.publish`) into an index of what will have
  K/V at the end of that forward; a request admitted later in the same plan borrows the longest
  such prefix beyond its cached one: its ``req_to_token`` row points at the computing row's
  slots, which every attention backend writes before it attends in each layer. After the
  forward, :meth:`~KVManager.settle` re-points the borrowed positions at the prefix cache (the
  computing row has handed them over by then) and locks them there like any cached prefix. A
  request whose whole sequence another row computes (a *rider*) computes nothing: it samples
  from that row's logits (``Request.logits_from``).
* :class:`~radixkv.engine.pins.PinTable` (``kv.pins``), the pins: a :class:`Pin` keeps a computed
  prefix in memory for holders not running now: the samples ``1 .. n-1`` of a request with
  ``n > 1`` (hard pins, :meth:`~KVManager.fork`) and sessions and stored Responses (soft pins,
  :meth:`~KVManager.pin_prefix`). With a prefix cache the pin holds a lock on the cached prefix
  (its tokens are *protected*); without one (``prefix_cache="none"``) it owns the slots. The
  table counts references and distinct pinned tokens and bounds the soft pins
  (``max_pinned_tokens``, ``pin_idle_timeout``; :meth:`PinTable.victim` first: the least recently
  used pin of the tenant pinning the most; also dropped before
  anything is retracted when a running request is short of memory); when a pin dies the table
  calls back here, and the KV manager unlocks (or frees) what it held.

* :class:`~radixkv.engine.tiers.TierManager` (``kv.tiers``, None without tiers), the KV tiers
  below the pool (docs/tiers.md): before a waiting request is admitted, the blocks after its
  cached prefix are looked up tier by tier and loaded into host memory on the tiers' I/O thread
  (:meth:`~KVManager.tier_step`); a finished load is copied into new slots here, after what the
  pool holds then, and inserted into the cache as if computed, its path locked until the
  request is admitted; the request waits in the queue meanwhile
  (:meth:`~KVManager.tier_waiting`), so no step stalls. Blocks entering the cache are written
  through, blocks it evicts written back (per tier), their K/V copied out here before the slots
  are reused.

* :class:`~radixkv.engine.drafts.DraftSlots` (``kv.drafts``), the tentative slots of draft
  tokens (speculative decoding): :meth:`~KVManager.reserve_drafts` gives a decoding request slots
  for its draft positions when the step is planned, :meth:`~KVManager.settle_drafts` keeps the
  accepted ones and frees the rest in the same step. A draft token never reaches the cache.

A new helper plugs in the same way: its own bookkeeping in its own class, every slot it implies
moved by the KV manager (a callback or a returned value).

Invariant (:meth:`check_integrity`): every slot is exactly one of free, held by the cache, owned
by a running request, or owned by a pin; when idle, ``free + evictable + pinned == capacity``
and ``protected == pinned``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Container, Iterable, List, Optional

import torch

from radixkv.cache.base import MatchResult, PrefixCache
from radixkv.cache.digests import BLOCK_TOKENS, block_digests
from radixkv.engine.batch_sharing import BatchSharing
from radixkv.engine.drafts import DraftSlots
from radixkv.engine.events import CacheEvicted, CacheInserted, CacheReset, EventBus
from radixkv.engine.pins import Pin, PinTable
from radixkv.engine.request import Request
from radixkv.engine.tiers import SHARED_MEDIA, TierHold, TierManager
from radixkv.memory.allocator import SlotAllocator
from radixkv.memory.kv_io import layout_of, scatter_rows
from radixkv.memory.kv_pool import ReqToTokenPool
from radixkv.namespace import Namespace

__all__ = ["KVManager", "Pin", "Prefix"]


def _as_slots(slots: List[int]) -> torch.Tensor:
    return torch.tensor(slots, dtype=torch.int64)


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
        tiers: the KV tiers below the pool (:class:`~radixkv.engine.tiers.TierManager`), or None.

    Attributes:
        pins: the :class:`~radixkv.engine.pins.PinTable` (live pins, bounds of the soft ones).
        sharing: the :class:`~radixkv.engine.batch_sharing.BatchSharing` of the forward being
            planned.
        tiers: the :class:`~radixkv.engine.tiers.TierManager`, or None.
        drafts: the :class:`~radixkv.engine.drafts.DraftSlots` (tentative draft slots).
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
        *,
        max_pinned_tokens: Optional[int] = None,
        pin_idle_timeout: Optional[float] = None,
        clock: Optional[Callable[[], float]] = None,
        in_batch_sharing: bool = True,
        tiers: Optional[TierManager] = None,
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
        self.pins = PinTable(self._unhold, max_tokens=max_pinned_tokens, idle_timeout=pin_idle_timeout, clock=clock)
        self.sharing = BatchSharing(self.page_size, enabled=bool(in_batch_sharing) and self.shares)
        self.tiers = tiers if self.shares else None
        self._evicting: Optional[list] = None  # pieces the cache evicts now, for write-back
        self._tier_held: dict = {}  # id(request) -> waiting request holding an installed load
        self.drafts = DraftSlots()
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
        return self.pins.pinned_size()

    @property
    def num_pins(self) -> int:
        """Live pins."""
        return len(self.pins)

    @property
    def dropped_pins(self) -> int:
        """Soft pins dropped by the KV manager (bound, timeout, memory, reset) so far."""
        return self.pins.dropped

    @property
    def clock(self) -> Callable[[], float]:
        """The pins' time source (seconds)."""
        return self.pins.clock

    @property
    def in_batch_sharing(self) -> bool:
        """Whether rows of one forward share what they compute (settable; read when the next
        plan begins; never True without a prefix cache that shares prefixes)."""
        return self.sharing.enabled

    @in_batch_sharing.setter
    def in_batch_sharing(self, on: bool) -> None:
        self.sharing.enabled = bool(on) and self.shares

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
            freed = self._evict(n - avail)
            if freed.numel():
                self.allocator.free(freed)
                self.evicted_tokens += int(freed.numel())
                if not hasattr(self.cache, "evict_listener") and self.events.wants(CacheEvicted):
                    self.events.emit(
                        CacheEvicted(
                            seq=self._next_seq(), namespace=None, num_tokens=int(freed.numel()), block_digests=None
                        )
                    )
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

    # ------------------------------------------------------------------ draft slots
    def reserve_drafts(self, req: Request, n: int) -> int:
        """Give the decoding ``req`` (slots up to ``kv_len + 1`` already) tentative slots for
        ``n`` draft positions ``[kv_len + 1, kv_len + 1 + n)``, evicting unlocked cached prefixes
        when short but never dropping a pin or retracting: fewer when memory is short. Returns
        how many draft positions got slots (0 .. n)."""
        start = req.kv_len + 1
        if n <= 0 or len(req.slots) < start:
            return 0
        need = self.pages(start + n) - len(req.slots)
        if need > 0 and not self.ensure_free(need):
            fit = len(req.slots) + self.allocator.available_size() // self.page_size * self.page_size
            n = min(n, fit - start)
            if n <= 0:
                return 0
        self.grow(req, start + n)
        self.drafts.open(req, start, start + n)
        return n

    def settle_drafts(self, req: Request) -> None:
        """``req``'s verify is decided (``kv_len`` counts its accepted positions): keep the slots
        of ``[0, kv_len)`` rounded up to whole pages, free the rest (the rejected drafts')."""
        if not self.drafts.close(req) or req.row is None:
            return
        keep = self.pages(req.kv_len)
        if len(req.slots) > keep:
            self._free(req.slots[keep:])
            del req.slots[keep:]

    # ------------------------------------------------------------------ cache events
    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _insert(
        self, tokens: List[int], slots: Any, namespace: Optional[Namespace], skip: tuple = (), tail: bool = True
    ) -> int:
        """``cache.insert``; the blocks that became fully cached are written through to the tiers
        (but those in ``skip``), with the partial block after them (a tail, when ``tail`` and
        something new was inserted), and announced (:class:`CacheInserted`)."""
        slots = slots if isinstance(slots, torch.Tensor) else _as_slots(slots)
        k = self.cache.insert(tokens, slots, namespace)
        n = len(tokens)
        first, stop = k // BLOCK_TOKENS, n // BLOCK_TOKENS
        r = n - stop * BLOCK_TOKENS if tail and n > k else 0
        if self.tiers is not None and (stop > first or r) and self.tiers.through:
            self.tiers.write("write_through", namespace, tokens, first, stop, slots[first * BLOCK_TOKENS : n], skip, r)
        if self.shares and self.events.wants(CacheInserted) and n > k:
            digests = tuple(block_digests(tokens, namespace, first, stop)) if stop > first else ()
            self.events.emit(
                CacheInserted(
                    seq=self._next_seq(),
                    namespace=namespace,
                    num_tokens=n - k,
                    first_block=first,
                    block_digests=digests,
                )
            )
        return k

    def _on_evict(self, namespace: Optional[Namespace], path: bytes, start: int) -> None:
        if self._evicting is not None:
            self._evicting.append((namespace, path, start))
        if not self.events.wants(CacheEvicted):
            return
        end = len(path) >> 2
        first, stop = start // BLOCK_TOKENS, end // BLOCK_TOKENS
        digests = tuple(block_digests(path, namespace, first, stop)) if stop > first else ()
        self.events.emit(
            CacheEvicted(seq=self._next_seq(), namespace=namespace, num_tokens=end - start, block_digests=digests)
        )

    def _evict(self, n: int) -> Any:
        """``cache.evict(n)``; with write-back tiers, the K/V of the blocks it evicts is copied
        out (and queued for the tiers) before the caller frees the slots."""
        if self.tiers is None or not self.tiers.writes_back or not hasattr(self.cache, "evict_listener"):
            return self.cache.evict(n)
        self._evicting = []
        try:
            freed = self.cache.evict(n)
        finally:
            pieces, self._evicting = self._evicting, None
        if pieces and freed.numel():
            self._write_back(pieces, freed)
        return freed

    def _write_back(self, pieces: list, freed: Any) -> None:
        """Queue the whole 16-token blocks of evicted ``pieces`` (``(namespace, path, start)`` in
        the order ``freed`` holds their slots), and the tail after them (unless another piece
        continues the path), for the write-back tiers. A block's head may lie
        before its piece: in a piece evicted by the same call, or still cached (read without
        touching the tree's order)."""
        ends: dict = {}
        off = 0
        for ns, path, start in pieces:
            end = len(path) >> 2
            ends[(ns, path)] = (start, freed[off : off + end - start])
            off += end - start

        def head(ns: Any, path: bytes, lo: int, hi: int) -> Any:
            """The slots of positions ``[lo, hi)`` of ``path``, ``hi`` a piece's start."""
            got = ends.get((ns, path[: hi << 2]))
            if got is None:  # still cached (or gone: then too short)
                cached = self.cache.cached_slots(memoryview(path[: hi << 2]).cast("i"), ns)
                return cached[lo:hi] if len(cached) >= hi else None
            start, sl = got
            if start <= lo:
                return sl[lo - start :]
            h = head(ns, path, lo, start)
            return None if h is None else torch.cat([torch.as_tensor(h), torch.as_tensor(sl)])

        continued = {(ns, path[: start << 2]) for ns, path, start in pieces}
        for ns, path, start in pieces:
            end = len(path) >> 2
            first, stop = start // BLOCK_TOKENS, end // BLOCK_TOKENS
            # the tail after the last whole block, unless a piece of this call continues the path
            r = 0 if (ns, path) in continued else end - stop * BLOCK_TOKENS
            if stop <= first and not r:
                continue
            lo = first * BLOCK_TOKENS
            own = torch.as_tensor(ends[(ns, path)][1][max(lo, start) - start :])
            h = head(ns, path, lo, start) if lo < start else own[:0]
            if h is not None:
                self.tiers.write("write_back", ns, path, first, stop, torch.cat([torch.as_tensor(h), own]), tail=r)

    def write_back_pool(self, timeout: Optional[float] = None) -> bool:
        """Queue every block the pool caches, and the tail of each cached node, for the
        persistent tiers written back (disk, remote): they get blocks only when the pool evicts
        them, so what it still holds at close was lost to a restart. Not the host tier (the
        process takes it along); radix cache only (the hash cache keeps no sequences). Deepest
        first (a node after the nodes that continue it, each node's blocks from the last, those a
        tier holds already marked used), so that a tier smaller than the pool keeps the heads
        lookups read first. A node is queued in pieces of at most a quarter of the backlog's bound,
        the backlog drained past half of it, so no piece is dropped. False when a drain outlasted
        ``timeout`` seconds (the rest not queued) or a piece was dropped (the tiers closed)."""
        tiers = self.tiers
        paths = getattr(self.cache, "cached_paths", None)
        if tiers is None or tiers.closed or paths is None:
            return True
        skip = tuple(s.medium for s in tiers.back if s.medium not in SHARED_MEDIA)
        if len(skip) == len(tiers.back):
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        per = max(1, tiers.io.max_pending_bytes // 4 // (BLOCK_TOKENS * layout_of(tiers.pool).token_bytes))
        for ns, path, slots, start, _leaf in paths():
            end = len(path) >> 2
            first, stop = start // BLOCK_TOKENS, end // BLOCK_TOKENS
            # the tail after its last whole block, also where a node is continued mid-block: the
            # children write that block whole, which a lookup of this node's path cannot read
            r = end - stop * BLOCK_TOKENS
            if stop <= first and not r:
                continue
            own = torch.frombuffer(bytearray(slots), dtype=torch.int64)
            for lo in reversed(range(first, stop, per) or [first]):  # the last piece (with the tail) first
                hi = min(lo + per, stop)
                tail = r if hi == stop else 0
                if tiers.io.pending_bytes > tiers.io.max_pending_bytes // 2:
                    left = None if deadline is None else max(0.0, deadline - time.monotonic())
                    if not tiers.drain(left):
                        return False
                piece = own[lo * BLOCK_TOKENS : hi * BLOCK_TOKENS + tail]
                if not tiers.write("write_back", ns, path, lo, hi, piece, skip=skip, tail=tail, touch_own=True):
                    return False
        return True

    # ------------------------------------------------------------------ in-batch sharing
    def begin_batch(self) -> None:
        """Start planning a forward: nothing is published yet (:class:`BatchSharing`)."""
        self.sharing.begin()

    def end_batch(self) -> None:
        """The plan is complete; later admissions share nothing of it."""
        self.sharing.end()

    def publish(self, req: Request, upto: int) -> None:
        """``req`` (admitted, with slots up to ``upto``) computes positions ``[kv_len, upto)`` in
        the forward being planned: its whole pages ``[0, floor(upto))`` may be borrowed by
        requests admitted after it in the same plan."""
        if self.sharing.planning:
            n = upto // self.page_size * self.page_size
            self.sharing.publish(req, upto, _as_slots(req.slots[:n]))

    def batch_prefix_len(self, req: Request) -> int:
        """The prefix ``req`` could borrow from the forward being planned (0 when none): its
        whole sequence when a row computes all of it now, else at most all but its last token."""
        return self.sharing.prefix_len(req)

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
        self._relock(req, m)
        req.shared_len = 0
        req.logits_from = None

    def _relock(self, req: Request, m: MatchResult) -> None:
        """Move ``req``'s lock to the cached path ``m`` and point its positions ``[0, m.length)``
        at the cache's slots (its ``req_to_token`` row included)."""
        self.cache.inc_lock_ref(m.node)
        if req.prefix_node is not None:
            self.cache.dec_lock_ref(req.prefix_node)
        req.prefix_node = m.node
        req.slots[: m.length] = m.slots.tolist()
        self.req_to_token_pool.write(req.row, 0, m.slots)

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
        return max(self.match(req).length, self.sharing.prefix_len(req))

    def lock_prefix(self, req: Request) -> Prefix:
        """The prefix ``req`` would be admitted on, locked so that no eviction frees it; undo with
        :meth:`unlock_prefix` when it is not admitted after all. Beyond its cached prefix it
        borrows what rows published in the forward being planned compute (module docstring)."""
        if req.pin is not None:
            return Prefix(len(req.pin), list(req.pin.slots), None, req.pin)
        m = self.match(req)
        self.cache.inc_lock_ref(m.node)
        slots = m.slots.tolist()
        b = self.sharing.borrow(req)
        if b is not None and b.length > m.length:
            slots += b.slots[m.length : b.length].tolist()
            return Prefix(b.length, slots, m.node, None, b.length - m.length, b.logits_from)
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
        self._tier_unhold(req)  # its own lock covers what a tier load installed for it

    # ------------------------------------------------------------------ hand-over and release
    def release(self, req: Request, retracted: bool = False) -> None:
        """Hand ``req``'s computed K/V to the prefix cache, free the rest, unlock, drop its row.
        ``retracted``: it waits to be readmitted, so the KV tiers are asked again for what the
        pool loses of it meanwhile (its lookup was for a shorter sequence, or found nothing).

        Ranges (``a = kv_len`` floored to pages, ``k`` = what ``insert`` found already cached):
        ``[prefix_len, k)`` freed (duplicates), ``[k, a)`` handed to the cache, ``[a, len(slots))``
        freed, ``[0, prefix_len)`` unlocked (or its pin reference dropped).
        """
        self.drafts.close(req)
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
        self._tier_unhold(req)
        if retracted:  # NOTE: the spans served were counted at its first admission
            req.tier = None
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
        self._relock(req, m)
        self.drop_pin(req)  # the cache's lock now covers at least the pin's pages
        req.prefix_len = aligned

    # ------------------------------------------------------------------ KV tiers
    def tier_waiting(self, req: Request) -> bool:
        """True while ``req``'s blocks are being looked up, loaded or wait to be installed (the
        scheduler skips it meanwhile)."""
        t = req.tier
        return t is not None and t.job is not None

    def tier_step(
        self, waiting: Iterable[Request], idle: bool = False, defer: Container[int] = (), may_wait: bool = False
    ) -> None:
        """The KV tiers' part of a step: announce the writes the I/O thread finished, install
        the finished loads of waiting requests (:meth:`_tier_install`; ``idle``: nothing runs,
        so a load that finds no room now never will: given up), and start a lookup for each
        waiting request not looked up yet, or whose cached prefix shrank since its lookup.
        ``defer``: the ids of waiting requests whose finished loads stay uninstalled for now (the
        scheduler does not admit them yet: what an install locked for them would stay locked).
        ``may_wait``: this step can admit a new request (prefill budget left, a free row, no
        chunked prefill in progress, no retraction for memory); then, when every waiting
        request's first lookup starts now, the step waits a little for the first of them
        (:meth:`_tier_wait`)."""
        tiers = self.tiers
        if tiers is None:
            return
        _, writes = tiers.take_finished()  # loads: each request's own job says when it is done
        if writes and self.events.wants(CacheInserted):
            for w in writes:  # NOTE: tails are not announced: a consumer names whole blocks only
                for medium in w.stored if w.digests else ():
                    self.events.emit(
                        CacheInserted(
                            seq=self._next_seq(),
                            namespace=w.namespace,
                            num_tokens=BLOCK_TOKENS * len(w.digests),
                            first_block=w.first,
                            block_digests=tuple(w.digests),
                            medium=medium,
                        )
                    )
        fresh, queued = [], 0  # requests whose lookup starts now; waiting requests considered
        for r in list(waiting):
            if r.row is not None or r.pin is not None:
                continue
            queued += 1
            t = r.tier
            if t is not None and t.job is not None:
                if t.job.done and id(r) not in defer:
                    self._tier_install(r, idle)
            elif t is None or (t.node is None and self._cached_len(r) < t.start):
                self._tier_lookup(r)
                if t is None and r.tier.job is not None and id(r) not in defer:
                    fresh.append(r)
        if may_wait and fresh and len(fresh) == queued:
            self._tier_wait(fresh, idle)

    def _tier_wait(self, fresh: List[Request], idle: bool) -> None:
        """Wait up to ``CostModel.lookup_wait_s()`` (half a step, at most 50 ms) for the load of
        the first of ``fresh`` (first lookups started in this step, in queue order; nothing else
        waits), then install every one of them that is done, so that they are admitted in this
        step rather than the next: a load from host memory or a warm disk takes milliseconds.
        NOTE: not when another request waits (one queued behind others would most likely not be
        admitted in this step anyway, and the running requests would wait for nothing), not for a
        lookup started again (a request whose prefix the pool keeps losing would make every step
        wait), and not for the slowest of a burst (the quick ones would wait for it)."""
        tiers = self.tiers
        tiers.io.wait_loads([fresh[0].tier.job], tiers.costs.lookup_wait_s())
        for r in fresh:
            if r.tier is not None and r.tier.job is not None and r.tier.job.done:
                self._tier_install(r, idle)

    def _reusable(self, req: Request) -> int:
        """How many of ``req``'s tokens it may take from caches: all but its last, at most
        ``max_prefix_len`` (:meth:`match`'s limit)."""
        n = len(req.all_token_ids) - 1
        return n if req.max_prefix_len is None else min(n, req.max_prefix_len)

    def _cached_len(self, req: Request) -> int:
        """The prefix of ``req`` the pool holds now, read-only (no access time refreshed)."""
        return self.cache.peek(req.all_token_ids[: self._reusable(req)], req.namespace, context=0).length

    def _tier_lookup(self, req: Request) -> None:
        """Ask the tiers for the whole blocks after ``req``'s cached prefix (up to what it may
        reuse, page-floored): the I/O thread looks them up and loads them into host memory while
        the request waits; nothing in the pool is held meanwhile. Looked up again only when the
        pool loses some of its prefix (what it held at the lookup, or what was installed) before
        the request is admitted (:meth:`tier_step`)."""
        start = self._cached_len(req)
        old = req.tier  # looked up again: what its earlier installs served below start still counts
        req.tier = hold = TierHold(start=start)
        if old is not None:
            hold.spans = [(lo, min(hi, start), m) for lo, hi, m in old.spans if lo < start]
        limit = self._reusable(req) // self.page_size * self.page_size
        if limit > start:
            hold.job = self.tiers.plan(req.namespace, req.all_token_ids, start, limit, req)
            hold.limit = limit

    def _tier_install(self, req: Request, idle: bool) -> None:
        """Copy ``req``'s finished load into new slots after the prefix the pool holds now and
        insert it into the cache as if computed; that path stays locked for it until it is
        admitted. No room now (or, with other waiting requests' loads installed, they would all
        hold more than 3/4 of the pool): tried again at a later step, or given up when ``idle``
        with no other load installed (then nothing would ever free memory for it). The pool lost
        blocks before the loaded run: looked up again."""
        hold = req.tier
        job, base = hold.job, hold.job.first * BLOCK_TOKENS
        end = min(hold.limit, base + (job.rows.shape[0] if job.rows is not None else 0))
        end = end // self.page_size * self.page_size
        m = self.match(req)
        if m.length < base:
            req.tier = None
            return
        need = end - m.length
        if need <= 0:
            hold.job = None
            return
        self.cache.inc_lock_ref(m.node)
        crowded = self.tiers.held_tokens and self.tiers.held_tokens + need > self.capacity * 3 // 4
        if crowded or not self.ensure_free(need):
            self.cache.dec_lock_ref(m.node)
            if idle and not self.tiers.held_tokens:  # nothing will free memory for it: compute
                hold.job = None
            return
        hold.job = None
        new = self.allocator.alloc(need)
        if new is None:
            raise RuntimeError(f"allocator refused {need} slots after ensure_free")
        scatter_rows(self.tiers.pool, new, job.rows[m.length - base : end - base])
        tokens = req.all_token_ids[:end]
        slots = torch.cat([m.slots, torch.as_tensor(new)])
        k = self._insert(tokens, slots, req.namespace, tuple(set(job.media)), tail=False)
        if k > m.length:
            self.allocator.free(new[: k - m.length])
        got = self.cache.match_prefix(tokens, req.namespace)
        if got.length != end:
            raise RuntimeError(f"tier install: inserted {end} tokens, the cache matches {got.length}")
        self.cache.inc_lock_ref(got.node)
        self.cache.dec_lock_ref(m.node)
        hold.node, hold.held, hold.start = got.node, end - m.length, end
        self.tiers.held_tokens += hold.held
        self._tier_held[id(req)] = req
        ends = [(base + BLOCK_TOKENS * (b + 1), medium) for b, medium in enumerate(job.media)]
        if job.tail_medium is not None:
            ends.append((base + job.rows.shape[0], job.tail_medium))
        for b, (stop, medium) in enumerate(ends):
            lo, hi = max(k, base + BLOCK_TOKENS * b), min(end, stop)
            if hi > lo:
                hold.spans.append((lo, hi, medium))

    def _tier_unhold(self, req: Request, cancel: bool = True) -> None:
        """Drop the lock on what was installed for ``req`` (that stays cached, evictable;
        ``req.tier`` keeps the spans) and, with ``cancel``, its load not installed yet."""
        hold = req.tier
        if hold is None:
            return
        if cancel and hold.job is not None:
            self.tiers.io.cancel_load(hold.job)
            hold.job = None
        if hold.node is not None:
            self.cache.dec_lock_ref(hold.node)
            hold.node = None
            self.tiers.held_tokens -= hold.held
            hold.held = 0
            del self._tier_held[id(req)]

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
            pin = self.pins.add(m.slots.tolist(), m.node, len(children), soft=False)
        else:
            if upto == 0 or parent.prefix_len or parent.pin is not None or parent.kv_len < upto:
                return
            # the parent's first pages become the pin's; the parent borrows them from it
            pin = self.pins.add(parent.slots[:upto], None, len(children) + 1, soft=False)
            parent.pin, parent.prefix_len = pin, upto
        for c in children:
            c.pin = pin

    def drop_pin(self, req: Request) -> None:
        """Drop ``req``'s pin reference; the last one unlocks (or frees) the pinned prefix."""
        pin = req.pin
        if pin is None:
            return
        req.pin = None
        self.pins.release(pin)

    def detach_pins(self, waiting: Iterable[Request]) -> None:
        """Last resort when one running request is left short of memory: waiting requests drop
        their pins and their tier loads' locks (they recompute, or re-match, their prefix when
        admitted)."""
        for r in waiting:
            if r.pin is not None and r.row is None:
                self.drop_pin(r)
            if r.row is None:
                self._tier_unhold(r, cancel=False)  # a load still in host memory holds no slot

    def _unhold(self, pin: Pin) -> None:
        """``pin`` died (:class:`PinTable`): unlock its cached path, or free the slots it owns."""
        if pin.node is not None:
            self.cache.dec_lock_ref(pin.node)
        else:
            self._free(pin.slots)

    # ------------------------------------------------------------------ pins (sessions)
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
        pin = self.pins.add(m.slots.tolist(), m.node, 1, soft=True, owner=getattr(namespace, "tenant", None))
        self.pins.expire()
        return pin

    def retain_pin(self, pin: Pin) -> bool:
        """One more holder of ``pin`` (a forked session): True, or False when it is dead."""
        return self.pins.retain(pin)

    def touch_pin(self, pin: Pin) -> None:
        """A holder uses ``pin`` now (it becomes the most recently used)."""
        self.pins.touch(pin)

    def release_pin(self, pin: Pin) -> None:
        """A holder lets go of ``pin``; the last one unlocks (or frees) it. No-op on a dead pin."""
        self.pins.release(pin)

    def expire_pins(self) -> int:
        """Drop the soft pins idle for ``pin_idle_timeout`` seconds, then :meth:`PinTable.victim`
        while more than ``max_pinned_tokens`` distinct tokens are soft-pinned; returns how many
        were dropped. Their tokens stay cached, evictable."""
        return self.pins.expire()

    def yield_soft_pins(self, need: int) -> bool:
        """Drop soft pins (:meth:`PinTable.victim` first) until ``need`` slots could be made free
        (:meth:`headroom`), evicting nothing yet; False when they are all dropped first."""
        while self.headroom() < need:
            victim = self.pins.victim()
            if victim is None:
                return False
            self.pins.drop(victim)
        return True

    def yield_pins(self, need: int) -> bool:
        """Make ``need`` slots free for a running request (or the one being admitted while
        nothing runs), dropping soft pins (:meth:`PinTable.victim` first), then the locks on what the
        KV tiers installed for waiting requests (most recent first; they stay cached, evictable),
        when evicting what is unlocked is not enough; False if even that is not."""
        while not self.ensure_free(need):
            victim = self.pins.victim()
            if victim is not None:
                self.pins.drop(victim)
            elif self._tier_held:
                self._tier_unhold(next(reversed(self._tier_held.values())), cancel=False)
            else:
                return False
        return True

    # ------------------------------------------------------------------ cache
    def reset_cache(self) -> bool:
        """Drop every cached prefix, and the soft pins on them (sessions keep their contexts and
        recompute them); False (nothing done) while a request's pin or lock holds any."""
        if self.pins.has_hard():
            return False
        self.pins.drop_soft()
        if self.cache.protected_size():  # a request's lock (the caller checks none is admitted)
            return False
        freed = self.cache.reset()
        n = int(freed.numel())
        if n:
            self.allocator.free(freed)
        if self.events.wants(CacheReset):
            self.events.emit(CacheReset(seq=self._next_seq(), num_tokens=n))
        return True

    def check_integrity(self, requests: Iterable[Request]) -> None:
        """Raise AssertionError when slot ownership is inconsistent: the cache's own check, the
        pin table's, and every slot counted exactly once among free, cached, owned by
        ``requests`` (the admitted ones; others hold nothing but pins) and owned by pins."""
        self.cache.check_integrity()
        self.pins.check_integrity()
        self.drafts.check_integrity()
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
        for pin in self.pins:
            if pin.node is None:
                own(pin.slots)
        if self.tiers is not None:
            holds = [r.tier for r in self._tier_held.values()]
            if any(t is None or t.node is None for t in holds):
                raise AssertionError("a request counted as holding a tier install holds none")
            tier_held = sum(t.held for t in holds)
            if tier_held != self.tiers.held_tokens:
                raise AssertionError(f"tier holds {tier_held} tokens, counted {self.tiers.held_tokens}")
        cap = self.allocator.num_slots
        free, total = self.allocator.available_size(), self.cache.total_size()
        if free + total + len(held) != cap:
            raise AssertionError(f"free {free} + cached {total} + held {len(held)} != capacity {cap}")
