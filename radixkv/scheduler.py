"""The scheduler: waiting queue, running batch, admission with prefix matching, chunked prefill,
retraction, and every KV-slot hand-over between a request, the prefix cache and the allocator.

One call to :meth:`Scheduler.schedule` plans one forward pass (SGLang's continuous batching,
Zheng et al. 2024, with its "lpm" policy and one chunked request at a time):

1. Decode reservation: every decoding request gets a slot for its next token (a new page when
   its last page is full). When the pool is short, unlocked cached prefixes are evicted; if that
   is not enough, the newest admitted request is retracted (its computed K/V handed to the
   prefix cache, everything else freed, the request requeued at the front) until it fits.
2. Prefill: the partly computed (chunked) request continues, then waiting requests are admitted
   (ordered by longest cached prefix for "lpm", arrival for "fcfs") under the prefill token
   budget ``chunked_prefill_size``, the row budget and the memory budget. Admission matches at
   most ``len(tokens) - 1`` tokens, locks the match, and only then evicts for headroom, so
   eviction never frees what the request just matched. A prompt longer than the remaining budget
   is split; only one request is partly prefilled at a time. Nothing is admitted in a step that
   retracted (so a request is not readmitted right after being retracted).

The slot rules are tabulated in docs/engine.md.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Deque, List, Optional

import torch

from radixkv.request import Request, RequestStatus, SharedPrefix

SCHEDULE_POLICIES = ("lpm", "fcfs")
_LPM_MAX_QUEUE = 128  # above this many waiting requests "lpm" falls back to "fcfs" (as SGLang)


@dataclass
class ScheduledBatch:
    """One planned forward pass.

    Attributes:
        reqs: the ``B`` requests in the batch (prefill chunks and decodes).
        prefix_lens: K/V length of each before the forward (``kv_len``).
        extend_lens: new tokens of each (1 for a decode).
        input_ids: the new tokens, request after request (``sum(extend_lens)`` ints).
        sample: whether each request samples a token after this forward (decodes and last
            prefill chunks; False for a non-final chunk).
        retracted: requests retracted while planning.
    """

    reqs: List[Request] = field(default_factory=list)
    prefix_lens: List[int] = field(default_factory=list)
    extend_lens: List[int] = field(default_factory=list)
    input_ids: List[int] = field(default_factory=list)
    sample: List[bool] = field(default_factory=list)
    retracted: List[Request] = field(default_factory=list)

    def add(self, req: Request, extend: int, sample: bool) -> None:
        """Append ``extend`` new tokens of ``req`` starting at its ``kv_len``."""
        self.reqs.append(req)
        self.prefix_lens.append(req.kv_len)
        self.extend_lens.append(extend)
        tokens = req.all_token_ids
        self.input_ids.extend(tokens[req.kv_len : req.kv_len + extend])
        self.sample.append(sample)

    @property
    def num_prefill_tokens(self) -> int:
        """New tokens of requests that were not decoding."""
        return sum(e for r, e in zip(self.reqs, self.extend_lens) if r.status == RequestStatus.PREFILL)


class Scheduler:
    """Waiting queue + running batch over one prefix cache and one slot allocator.

    Args:
        cache: a :class:`~radixkv.cache.base.PrefixCache` (radix tree, hash blocks, or none).
        allocator: the :class:`~radixkv.cache.allocator.SlotAllocator` of the KV pool.
        req_to_token_pool: the :class:`~radixkv.kv_pool.ReqToTokenPool` (one row per admitted request).
        chunked_prefill_size: prefill token budget per step (>= 1).
        schedule_policy: "lpm" or "fcfs".
        caching: False for ``prefix_cache="none"``: nothing is matched or inserted.

    Raises:
        ValueError: bad ``chunked_prefill_size`` / ``schedule_policy``, or page sizes of the
            cache and the allocator differ.
    """

    def __init__(
        self,
        cache: Any,
        allocator: Any,
        req_to_token_pool: Any,
        *,
        chunked_prefill_size: int,
        schedule_policy: str = "lpm",
        caching: bool = True,
    ) -> None:
        if schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule_policy must be one of {SCHEDULE_POLICIES}, got {schedule_policy!r}")
        if chunked_prefill_size < 1:
            raise ValueError(f"chunked_prefill_size must be >= 1, got {chunked_prefill_size}")
        if cache.page_size != allocator.page_size:
            raise ValueError(f"cache page_size {cache.page_size} != allocator page_size {allocator.page_size}")
        self.cache = cache
        self.allocator = allocator
        self.req_to_token_pool = req_to_token_pool
        self.page_size = allocator.page_size
        self.chunked_prefill_size = chunked_prefill_size
        self.policy = schedule_policy
        self.caching = caching
        self.waiting: Deque[Request] = deque()
        self.running: List[Request] = []
        self._admit_counter = 0
        self.evicted_tokens = 0
        self.prefill_tokens = 0
        self.num_retractions = 0

    # ------------------------------------------------------------------ queue
    def add(self, req: Request) -> None:
        """Append a new request to the waiting queue."""
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def has_work(self) -> bool:
        """True while any request waits or runs."""
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ memory
    def _pages(self, n: int) -> int:
        """``n`` rounded up to whole pages (in slots)."""
        ps = self.page_size
        return (n + ps - 1) // ps * ps

    def _free_slots(self, slots: List[int]) -> None:
        if slots:
            self.allocator.free(torch.tensor(slots, dtype=torch.int64))

    def _ensure_free(self, n: int) -> bool:
        """Evict unlocked cached prefixes until ``n`` slots are free; False if impossible."""
        avail = self.allocator.available_size()
        if avail >= n:
            return True
        if self.caching and self.cache.evictable_size() > 0:
            freed = self.cache.evict(n - avail)
            if freed.numel():
                self.allocator.free(freed)
                self.evicted_tokens += int(freed.numel())
        return self.allocator.available_size() >= n

    def _grow(self, req: Request, upto: int) -> None:
        """Give ``req`` slots for positions ``[len(req.slots), upto)`` (whole pages); the caller
        has made them free."""
        need = self._pages(upto) - len(req.slots)
        if need <= 0:
            return
        new = self.allocator.alloc(need)
        if new is None:
            raise RuntimeError(f"allocator refused {need} slots after _ensure_free")
        start = len(req.slots)
        req.slots.extend(new.tolist())
        self.req_to_token_pool.write(req.row, start, new)

    # ------------------------------------------------------------------ release paths
    def _release(self, req: Request) -> None:
        """Hand ``req``'s computed K/V to the prefix cache, free the rest, unlock, drop its row.

        Ranges (``a = kv_len`` floored to pages, ``k`` = what ``insert`` found already cached):
        ``[prefix_len, k)`` freed (duplicates), ``[k, a)`` handed to the cache, ``[a, len(slots))``
        freed, ``[0, prefix_len)`` unlocked (or its shared reference dropped).
        """
        if req.row is not None:
            own_from = req.prefix_len
            aligned = req.kv_len // self.page_size * self.page_size
            if self.caching and aligned > req.prefix_len:
                tokens = req.all_token_ids[:aligned]
                k = self.cache.insert(tokens, torch.tensor(req.slots[:aligned], dtype=torch.int64), req.namespace)
                if k < req.prefix_len:
                    raise RuntimeError(f"cache.insert found {k} tokens, fewer than the locked prefix {req.prefix_len}")
                self._free_slots(req.slots[own_from:k])
                self._free_slots(req.slots[aligned:])
            else:
                self._free_slots(req.slots[own_from:])
            self.req_to_token_pool.free(req.row)
            req.row = None
        if req.prefix_node is not None:
            self.cache.dec_lock_ref(req.prefix_node)
            req.prefix_node = None
        self._drop_shared(req)
        req.slots = []
        req.prefix_len = 0
        req.kv_len = 0

    def _drop_shared(self, req: Request) -> None:
        sp = req.shared
        if sp is None:
            return
        req.shared = None
        sp.ref -= 1
        if sp.ref == 0:
            self._free_slots(sp.slots)

    def finish(self, req: Request) -> None:
        """Release a finished request (see :meth:`_release`) and take it off the running batch."""
        if req in self.running:
            self.running.remove(req)
        self._release(req)
        req.status = RequestStatus.FINISHED

    def abort(self, req: Request) -> None:
        """Abort a waiting or running request; its computed K/V stays cached and unlocked."""
        if req in self.waiting:
            self.waiting.remove(req)
        self.finish(req)

    def retract(self, req: Request) -> None:
        """Release an admitted request and put it back at the front of the waiting queue; it keeps
        its output tokens and recomputes (or re-matches) their K/V when readmitted."""
        self.running.remove(req)
        self._release(req)
        req.status = RequestStatus.WAITING
        req.num_retractions += 1
        self.num_retractions += 1
        self.waiting.appendleft(req)

    # ------------------------------------------------------------------ n > 1
    def fork(self, parent: Request, children: List[Request]) -> None:
        """Share ``parent``'s computed prompt with ``children`` (samples 1..n-1 of one request).

        With a prefix cache, the parent's prompt pages are inserted into the cache now and the
        parent's lock moves to the new node (:meth:`_hand_over`); the children are queued first
        and their admission matches the prompt like any cached prefix, computing only the last
        ``len(prompt) - matched`` tokens (1 token at page_size 1). Without one, the parent's whole
        pages below the last prompt token become a :class:`SharedPrefix` that every sample
        references; each child starts with it attached.
        """
        n_prompt = len(parent.prompt_token_ids)
        if self.caching:
            self._hand_over(parent, n_prompt)
        else:
            upto = (n_prompt - 1) // self.page_size * self.page_size
            if upto > parent.prefix_len and parent.shared is None and parent.prefix_len == 0:
                sp = SharedPrefix(parent.slots[:upto])
                sp.ref = 1
                parent.shared, parent.prefix_len = sp, upto
            sp = parent.shared
            for c in children:
                if sp is not None:
                    sp.ref += 1
                    c.shared, c.slots, c.prefix_len, c.kv_len = sp, list(sp.slots), len(sp.slots), len(sp.slots)
        for c in reversed(children):
            c.status = RequestStatus.WAITING
            self.waiting.appendleft(c)

    def _hand_over(self, req: Request, upto: int) -> None:
        """Insert ``req``'s computed tokens ``[0, upto)`` (whole pages) into the cache and move its
        lock to the inserted node: ``[prefix_len, k)`` duplicates are freed and replaced by the
        cache's slots, ``[k, a)`` become the cache's, ``[0, a)`` is the new locked prefix."""
        aligned = min(upto, req.kv_len) // self.page_size * self.page_size
        if aligned <= req.prefix_len:
            return
        tokens = req.all_token_ids[:aligned]
        k = self.cache.insert(tokens, torch.tensor(req.slots[:aligned], dtype=torch.int64), req.namespace)
        m = self.cache.match_prefix(tokens, req.namespace)
        if k < req.prefix_len or m.length != aligned:
            raise RuntimeError(
                f"hand-over: insert found {k}, match {m.length}, expected >= {req.prefix_len} / {aligned}"
            )
        self._free_slots(req.slots[req.prefix_len : k])
        self.cache.inc_lock_ref(m.node)
        if req.prefix_node is not None:
            self.cache.dec_lock_ref(req.prefix_node)
        req.prefix_node = m.node
        req.slots[:aligned] = m.slots.tolist()
        self.req_to_token_pool.write(req.row, 0, m.slots)
        req.prefix_len = aligned

    # ------------------------------------------------------------------ planning
    def _match(self, req: Request):
        tokens = req.all_token_ids
        return self.cache.match_prefix(tokens[: len(tokens) - 1], req.namespace)

    def _ordered_waiting(self) -> List[Request]:
        reqs = list(self.waiting)
        if self.policy == "lpm" and self.caching and 1 < len(reqs) <= _LPM_MAX_QUEUE:
            lens = {id(r): (r.prefix_len if r.shared is not None else self._match(r).length) for r in reqs}
            reqs.sort(key=lambda r: -lens[id(r)])  # stable: ties keep queue order
        return reqs

    def _admit(self, req: Request, budget: int, reserve: int) -> int:
        """Try to admit ``req`` with at most ``budget`` new tokens; returns the chunk length or 0."""
        tokens_len = req.seq_len
        if self.req_to_token_pool.available_size() == 0:
            return 0
        node = None
        if req.shared is not None:
            prefix_len, prefix_slots = req.prefix_len, req.slots[: req.prefix_len]
        elif self.caching:
            m = self._match(req)
            prefix_len, prefix_slots, node = m.length, m.slots.tolist(), m.node
            self.cache.inc_lock_ref(node)  # lock before any eviction below
        else:
            prefix_len, prefix_slots = 0, []
        extend = min(tokens_len - prefix_len, budget)
        need = self._pages(prefix_len + extend) - prefix_len
        headroom = self.allocator.available_size() + (self.cache.evictable_size() if self.caching else 0)
        if headroom < need + reserve or not self._ensure_free(need):
            if node is not None:
                self.cache.dec_lock_ref(node)
            return 0
        req.row = self.req_to_token_pool.alloc()
        req.prefix_node, req.prefix_len, req.kv_len = node, prefix_len, prefix_len
        req.slots = list(prefix_slots)
        if prefix_slots:
            self.req_to_token_pool.write(req.row, 0, torch.tensor(prefix_slots, dtype=torch.int64))
        self._grow(req, prefix_len + extend)
        if req.num_cached_tokens is None:
            req.num_cached_tokens = prefix_len if req.index == 0 else 0
        self._admit_counter += 1
        req.admit_seq = self._admit_counter
        req.status = RequestStatus.PREFILL
        self.waiting.remove(req)
        self.running.append(req)
        return extend

    def schedule(self) -> Optional[ScheduledBatch]:
        """Plan the next forward pass; None when nothing can run. See the module docstring."""
        batch = ScheduledBatch()
        ps = self.page_size
        # 1. decode reservation, retracting the newest admitted request while short.
        while self.running:
            decodes = [r for r in self.running if r.status == RequestStatus.DECODE]
            need = sum(ps for r in decodes if r.kv_len >= len(r.slots))
            if self._ensure_free(need):
                break
            victim = max(self.running, key=lambda r: r.admit_seq)
            if len(self.running) == 1:
                self._detach_waiting_shared()
                if self._ensure_free(need):
                    break
            self.retract(victim)
            batch.retracted.append(victim)
        for r in self.running:
            if r.status == RequestStatus.DECODE:
                self._grow(r, r.kv_len + 1)
                batch.add(r, 1, True)
        # 2. prefill: the chunked request first, then admissions.
        budget = self.chunked_prefill_size
        reserve = ps * len(self.running)
        partial = False
        for r in self.running:
            if r.status != RequestStatus.PREFILL:
                continue
            extend = min(r.seq_len - r.kv_len, budget)
            if extend <= 0 or not self._ensure_free(self._pages(r.kv_len + extend) - len(r.slots)):
                partial = True
                continue
            self._grow(r, r.kv_len + extend)
            done = r.kv_len + extend == r.seq_len
            batch.add(r, extend, done)
            budget -= extend
            partial = partial or not done
        if not batch.retracted:
            for r in self._ordered_waiting():
                if budget <= 0 or partial:
                    break
                extend = self._admit(r, budget, reserve)
                if extend == 0:
                    break
                done = r.kv_len + extend == r.seq_len
                batch.add(r, extend, done)
                budget -= extend
                reserve += ps
                partial = not done
        if not batch.reqs:
            return None
        self.prefill_tokens += batch.num_prefill_tokens
        return batch

    def _detach_waiting_shared(self) -> None:
        """Last resort when one request is left short of memory: waiting samples drop their
        shared prompt references (they recompute the prompt when admitted)."""
        for r in self.waiting:
            if r.shared is not None:
                self._drop_shared(r)
                r.slots, r.prefix_len, r.kv_len = [], 0, 0

    def after_forward(self, batch: ScheduledBatch) -> None:
        """Advance ``kv_len`` of every request of ``batch``; finished prefills start decoding.

        With a prefix cache, every prefill chunk's whole pages go into the cache right away
        (:meth:`_hand_over`, as SGLang's ``cache_unfinished_req``), so requests admitted while this
        one still runs share its prompt instead of recomputing it.
        """
        for r, e in zip(batch.reqs, batch.extend_lens):
            was_prefill = r.status == RequestStatus.PREFILL
            r.kv_len += e
            if was_prefill and r.kv_len == r.seq_len:
                r.status = RequestStatus.DECODE
            if was_prefill and self.caching:
                self._hand_over(r, r.kv_len)

    # ------------------------------------------------------------------ accounting
    def reset_cache(self) -> bool:
        """Drop every cached prefix (False and nothing done while any request is admitted)."""
        if self.running or any(r.shared is not None for r in self.waiting):
            return False
        freed = self.cache.reset()
        if freed.numel():
            self.allocator.free(freed)
        return True
