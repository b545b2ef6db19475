"""The scheduler: waiting queue, running batch, and the admission policy.

One call to :meth:`Scheduler.schedule` plans one forward pass (SGLang's continuous batching,
Zheng et al. 2024, with its "lpm" policy and one chunked request at a time):

1. Decode reservation: every decoding request gets a slot for its next token (a new page when
   its last page is full). When the pool is short, unlocked cached prefixes are evicted; if that
   is not enough, the newest admitted request is retracted (its computed K/V handed to the
   prefix cache, everything else freed, the request requeued at the front) until it fits.
2. Prefill: the partly computed (chunked) request continues, then waiting requests are admitted
   (ordered by longest cached prefix for "lpm", arrival for "fcfs") under the prefill token
   budget ``chunked_prefill_size``, the row budget and the memory budget. Admission locks the
   request's prefix first and only then evicts for headroom, so eviction never frees what the
   request just matched. A prompt longer than the remaining budget is split; only one request is
   partly prefilled at a time. Nothing is admitted in a step that retracted (so a request is not
   readmitted right after being retracted).

The scheduler decides; every slot it implies moves through the
:class:`~radixkv.engine.kv_manager.KVManager` (docs/engine.md has the slot-range table).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Deque, List, Optional

from radixkv.engine.kv_manager import KVManager
from radixkv.engine.outcome import OutcomeTracker
from radixkv.engine.request import Request, RequestStatus

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
        prefill_tokens: new tokens of the requests that were prefilling when it was planned.
    """

    reqs: List[Request] = field(default_factory=list)
    prefix_lens: List[int] = field(default_factory=list)
    extend_lens: List[int] = field(default_factory=list)
    input_ids: List[int] = field(default_factory=list)
    sample: List[bool] = field(default_factory=list)
    retracted: List[Request] = field(default_factory=list)
    prefill_tokens: int = 0

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
    """Waiting queue + running batch over one :class:`~radixkv.engine.kv_manager.KVManager`.

    Args:
        kv: the KV manager (prefix cache, allocator and block table behind it).
        chunked_prefill_size: prefill token budget per step (>= 1).
        schedule_policy: "lpm" or "fcfs".

    Attributes:
        outcomes: the :class:`~radixkv.engine.outcome.OutcomeTracker` told of every first
            admission of a request, or None.
        waiting: requests not admitted (new or retracted), in queue order.
        running: admitted requests (prefilling or decoding).
        prefill_tokens: prompt/history tokens computed so far (recomputation included).
        num_retractions: retractions so far.

    Raises:
        ValueError: bad ``chunked_prefill_size`` / ``schedule_policy``.
    """

    def __init__(self, kv: KVManager, *, chunked_prefill_size: int, schedule_policy: str = "lpm") -> None:
        if schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule_policy must be one of {SCHEDULE_POLICIES}, got {schedule_policy!r}")
        if chunked_prefill_size < 1:
            raise ValueError(f"chunked_prefill_size must be >= 1, got {chunked_prefill_size}")
        self.kv = kv
        self.page_size = kv.page_size
        self.chunked_prefill_size = chunked_prefill_size
        self.policy = schedule_policy
        self.waiting: Deque[Request] = deque()
        self.running: List[Request] = []
        self._admit_counter = 0
        self.outcomes: Optional[OutcomeTracker] = None  # set by the engine (cache_outcome=True)
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

    def finish(self, req: Request) -> None:
        """Release a finished request (:meth:`KVManager.release`) and take it off the running batch."""
        if req in self.running:
            self.running.remove(req)
        self.kv.release(req)
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
        self.kv.release(req)
        req.status = RequestStatus.WAITING
        req.num_retractions += 1
        self.num_retractions += 1
        self.waiting.appendleft(req)

    def fork(self, parent: Request, children: List[Request]) -> None:
        """Queue ``children`` (samples 1..n-1 of ``parent``'s request) first, sharing ``parent``'s
        computed prompt (:meth:`KVManager.fork`): each computes only the rest of the prompt."""
        self.kv.fork(parent, children)
        for c in reversed(children):
            c.status = RequestStatus.WAITING
            self.waiting.appendleft(c)

    # ------------------------------------------------------------------ planning
    def _ordered_waiting(self) -> List[Request]:
        reqs = list(self.waiting)
        if self.policy == "lpm" and self.kv.shares and 1 < len(reqs) <= _LPM_MAX_QUEUE:
            lens = {id(r): self.kv.prefix_len(r) for r in reqs}
            reqs.sort(key=lambda r: -lens[id(r)])  # stable: ties keep queue order
        return reqs

    def _admit(self, req: Request, budget: int, reserve: int) -> int:
        """Try to admit ``req`` with at most ``budget`` new tokens; returns the chunk length or 0."""
        kv = self.kv
        if not kv.has_free_row():
            return 0
        prefix = kv.lock_prefix(req)  # before any eviction below
        if self.outcomes is not None:  # why the match stopped (first admission of sample 0)
            self.outcomes.on_admit(req, prefix.length, self.running)
        extend = min(req.seq_len - prefix.length, budget)
        if not kv.reserve(kv.pages(prefix.length + extend) - prefix.length, reserve):
            kv.unlock_prefix(prefix)
            return 0
        kv.admit(req, prefix, prefix.length + extend)
        if req.num_cached_tokens is None:
            req.num_cached_tokens = prefix.length if req.index == 0 else 0
        self._admit_counter += 1
        req.admit_seq = self._admit_counter
        req.status = RequestStatus.PREFILL
        self.waiting.remove(req)
        self.running.append(req)
        return extend

    def schedule(self) -> Optional[ScheduledBatch]:
        """Plan the next forward pass; None when nothing can run. See the module docstring."""
        kv = self.kv
        batch = ScheduledBatch()
        ps = self.page_size
        # 1. decode reservation, retracting the newest admitted request while short.
        while self.running:
            decodes = [r for r in self.running if r.status == RequestStatus.DECODE]
            need = sum(ps for r in decodes if r.kv_len >= len(r.slots))
            if kv.ensure_free(need):
                break
            victim = max(self.running, key=lambda r: r.admit_seq)
            if len(self.running) == 1:
                kv.detach_pins(self.waiting)
                if kv.ensure_free(need):
                    break
            self.retract(victim)
            batch.retracted.append(victim)
        for r in self.running:
            if r.status == RequestStatus.DECODE:
                kv.grow(r, r.kv_len + 1)
                batch.add(r, 1, True)
        # 2. prefill: the chunked request first, then admissions.
        budget = self.chunked_prefill_size
        reserve = ps * len(self.running)
        partial = False
        for r in self.running:
            if r.status != RequestStatus.PREFILL:
                continue
            extend = min(r.seq_len - r.kv_len, budget)
            if extend <= 0 or not kv.ensure_free(kv.pages(r.kv_len + extend) - len(r.slots)):
                partial = True
                continue
            kv.grow(r, r.kv_len + extend)
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
        batch.prefill_tokens = batch.num_prefill_tokens
        self.prefill_tokens += batch.prefill_tokens
        return batch

    def after_forward(self, batch: ScheduledBatch) -> None:
        """Advance ``kv_len`` of every request of ``batch``; finished prefills start decoding.

        Every prefill chunk's whole pages go into the prefix cache right away
        (:meth:`KVManager.hand_over`, as SGLang's ``cache_unfinished_req``), so requests admitted
        while this one still runs share its prompt instead of recomputing it.
        """
        for r, e in zip(batch.reqs, batch.extend_lens):
            was_prefill = r.status == RequestStatus.PREFILL
            r.kv_len += e
            if was_prefill and r.kv_len == r.seq_len:
                r.status = RequestStatus.DECODE
            if was_prefill:
                self.kv.hand_over(r, r.kv_len)

    def reset_cache(self) -> bool:
        """Drop every cached prefix (False and nothing done while any request is admitted or a
        pin is held)."""
        if self.running:
            return False
        return self.kv.reset_cache()
