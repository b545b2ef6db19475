"""The scheduler: waiting queue, running batch, and the admission policy.

One call to :meth:`Scheduler.schedule` plans one forward pass (SGLang's continuous batching,
Zheng et al. 2024, with its "lpm" policy and one chunked request at a time):

1. Decode reservation: every decoding request gets a slot for its next token (a new page when
   its last page is full). When the pool is short, unlocked cached prefixes are evicted; if that
   is not enough, the newest admitted request is retracted (its computed K/V handed to the
   prefix cache, everything else freed, the request requeued at the front) until it fits.
   Soft pins (sessions) are dropped before anything is retracted.
2. Prefill: the partly computed (chunked) request continues (its slots come before any draft's),
   then a request with draft tokens (speculative decoding) gets tentative slots for them from
   what is left (cached prefixes may be evicted for them; a pin or a running request never gives
   way to a draft: a request short of memory drafts fewer tokens), then waiting requests are admitted
   under the prefill token budget ``chunked_prefill_size``, the row budget and the memory
   budget. Admission locks the request's prefix first and only then evicts for headroom, so
   eviction never frees what the request just matched. A prompt longer than the remaining budget
   is split; only one request is partly prefilled at a time. Nothing is admitted in a step that
   retracted (so a request is not readmitted right after being retracted).

   In-batch prefix sharing: every prefill row added to the plan is published to the KV manager,
   and a request admitted after it borrows whatever prefix that row computes in the same
   forward beyond its own cached prefix (docs/engine.md, "In-batch prefix sharing"), so a
   prefix shared by requests waiting together is computed once, by the first of them, and the
   others are admitted on top of it in the same step while the budget lasts (else they wait for
   it: a request sharing with the one partly prefilled is not admitted before that one's last
   chunk, and then on top of it). "lpm" orders by the longest prefix a request can reuse now,
   cached or being computed in this plan (re-ranked after each admission, so the sharers of a
   row follow it), as SGLang's longest-prefix-match; "fcfs" keeps queue order. A request whose
   whole sequence a row computes (an identical prompt) takes no budget: it samples from that
   row's logits. With KV tiers (docs/tiers.md), before admissions the KV manager installs the
   tier loads that finished and starts lookups (``KVManager.tier_step``; when the step can admit
   and only new lookups wait, it waits a little for the first: docs/tiers.md); a request whose
   blocks are still on their way is skipped (it waits in the queue; the step runs the others).
   Tenants (``Namespace.tenant``): when several tenants' requests wait, admission takes the
   tenants in turn (:func:`tenants_in_turn`; re-ranking picks among the requests of the tenant
   whose turn it is), so one tenant's burst never holds back another tenant's request.

0. First-token preemption (``EngineConfig.first_token_preemption``, with KV tiers only): when the
   requests that have produced no token yet ("newcomers"), those step 2 can admit now (in
   policy order, within the prefill budget, of the first one's tenant; only the first when
   several tenants' newcomers wait), cannot fit, soft pins are dropped, then the newest
   admitted decoding requests of that tenant are retracted until they can (a shared uncached
   prefix counted once; nothing retracted for a newcomer that even all of them would not make
   room for), each at most once; their K/V stays cached and goes to the
   tiers before the pool reuses it, so they load it back when readmitted. A request so retracted
   is not readmitted while a request that arrived before its retraction still waits for its
   first token (so a burst's first tokens come first, and later arrivals never overtake it).
   Step 2 admits in the same step.

The scheduler decides; every slot it implies moves through the
:class:`~radixkv.engine.kv_manager.KVManager` (docs/engine.md has the slot-range table).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Deque, List, Optional

from radixkv.cache.tenants import tenant_of
from radixkv.cache.token_keys import common_prefix_len, pack_tokens
from radixkv.engine.kv_manager import KVManager
from radixkv.engine.outcome import OutcomeTracker
from radixkv.engine.request import Request, RequestStatus

SCHEDULE_POLICIES = ("lpm", "fcfs")


def first_token_pending(r: Request) -> bool:
    """True for a request that has produced no token yet (a burst's newcomer; also one retracted
    for memory in the middle of its chunked prefill)."""
    return not r.output_token_ids


def _common(a: Request, b: Request) -> int:
    """The tokens ``a`` may borrow from ``b`` computed in the same forward: their common prefix
    in one namespace (in-batch sharing's rule), else 0 (one memcmp in the cache's C helper)."""
    if a.namespace != b.namespace:
        return 0
    x, y = a.all_token_ids, b.all_token_ids
    n = min(len(x), len(y))
    return common_prefix_len(pack_tokens(x[:n]), pack_tokens(y[:n]), 0, n)


def tenants_in_turn(reqs: List[Request], last_turn: dict) -> List[Request]:
    """``reqs`` (in policy order) interleaved by tenant, round robin: the tenants ordered by their
    last admission (``last_turn``: tenant -> admission number; a tenant without one first; ties in
    the order of their first requests), then the first request of each, the second of each, and
    so on, so that one tenant's many waiting requests never hold back another tenant's. One
    tenant: ``reqs`` unchanged. O(n log tenants)."""
    queues: dict = {}
    for r in reqs:
        queues.setdefault(tenant_of(r.namespace), []).append(r)
    if len(queues) < 2:
        return reqs
    lists = [queues[t] for t in sorted(queues, key=lambda t: last_turn.get(t, -1))]  # stable
    return [q[j] for j in range(max(map(len, lists))) for q in lists if j < len(q)]


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
        riders: requests with no row of their own that sample from another row's logits (their
            whole sequence is computed by that row in this forward; in-batch sharing).
        rider_rows: for each rider, the row of the ``sum(extend_lens)`` new tokens whose logits it
            samples from.
        drafts: per request, the draft tokens it verifies in this forward (speculative decoding;
            empty for most): a decode with ``k`` drafts has ``extend_len`` ``1 + k`` and its new
            tokens are its last sampled token, then the drafts (docs/speculative.md).
    """

    reqs: List[Request] = field(default_factory=list)
    prefix_lens: List[int] = field(default_factory=list)
    extend_lens: List[int] = field(default_factory=list)
    input_ids: List[int] = field(default_factory=list)
    sample: List[bool] = field(default_factory=list)
    retracted: List[Request] = field(default_factory=list)
    prefill_tokens: int = 0
    riders: List[Request] = field(default_factory=list)
    rider_rows: List[int] = field(default_factory=list)
    drafts: List[List[int]] = field(default_factory=list)

    def add(self, req: Request, extend: int, sample: bool, drafts: List[int] = ()) -> None:
        """Append ``extend`` new tokens of ``req`` starting at its ``kv_len``: its own tokens,
        then ``drafts`` (the last ``len(drafts)`` of the ``extend``)."""
        self.reqs.append(req)
        self.prefix_lens.append(req.kv_len)
        self.extend_lens.append(extend)
        own = extend - len(drafts)
        if own == 1 and req.kv_len == req.seq_len - 1:  # a decode: no copy of the whole sequence
            last = req.output_token_ids[-1] if req.output_token_ids else req.prompt_token_ids[-1]
            self.input_ids.append(last)
        else:
            self.input_ids.extend(req.all_token_ids[req.kv_len : req.kv_len + own])
        self.input_ids.extend(drafts)
        self.sample.append(sample)
        self.drafts.append(list(drafts))

    def add_rider(self, req: Request, source: Request, position: int) -> None:
        """``req`` samples from the logits of ``source``'s row at ``position`` (computed in this
        forward) and has no row of its own."""
        i = next(k for k, r in enumerate(self.reqs) if r is source)
        start = sum(self.extend_lens[:i])
        if not self.prefix_lens[i] <= position < self.prefix_lens[i] + self.extend_lens[i]:
            raise RuntimeError(f"add_rider: {source!r} does not compute position {position} in this forward")
        self.riders.append(req)
        self.rider_rows.append(start + position - self.prefix_lens[i])

    @property
    def members(self) -> List[Request]:
        """Every request of the plan: the rows, then the riders."""
        return self.reqs + self.riders

    @property
    def samplers(self) -> List[Request]:
        """The requests that sample a token after this forward: the rows that sample (in batch
        order), then the riders (each from its ``rider_rows`` entry)."""
        return [r for r, s in zip(self.reqs, self.sample) if s] + self.riders

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

    def __init__(
        self,
        kv: KVManager,
        *,
        chunked_prefill_size: int,
        schedule_policy: str = "lpm",
        first_token_preemption: bool = False,
    ) -> None:
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
        self._last_turn: dict = {}  # tenant -> its last admission number (waiting tenants only)
        self.outcomes: Optional[OutcomeTracker] = None  # set by the engine (cache_outcome=True)
        self.prefill_tokens = 0
        self.num_retractions = 0
        if first_token_preemption and kv.tiers is None:
            raise ValueError(
                "first_token_preemption needs a KV tier (host_cache_bytes, disk_cache_dir or remote_cache_url): "
                "without one a retracted request's K/V would be recomputed"
            )
        self.first_token_preemption = first_token_preemption
        self.num_first_token_preemptions = 0
        self._seq = 0  # arrivals and first-token preemptions, in order
        self._unreported: List[Request] = []  # retracted in a step that planned no forward

    # ------------------------------------------------------------------ queue
    def add(self, req: Request) -> None:
        """Append a new request to the waiting queue."""
        req.status = RequestStatus.WAITING
        self._seq += 1
        req.arrival_seq = self._seq
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
        its output tokens and re-matches, loads from the KV tiers or recomputes their K/V when readmitted."""
        self.running.remove(req)
        self.kv.release(req, retracted=True)
        req.status = RequestStatus.WAITING
        req.draft_tokens = []
        req.num_retractions += 1
        self.num_retractions += 1
        self.waiting.appendleft(req)

    def fork(self, parent: Request, children: List[Request]) -> None:
        """Queue ``children`` (samples 1..n-1 of ``parent``'s request) first, sharing ``parent``'s
        computed prompt (:meth:`KVManager.fork`): each computes only the rest of the prompt."""
        self.kv.fork(parent, children)
        for c in reversed(children):
            c.status = RequestStatus.WAITING
            c.arrival_seq = parent.arrival_seq  # a sample arrived with its request (step 0's order)
            self.waiting.appendleft(c)

    # ------------------------------------------------------------------ planning
    def _lpm(self, n: int) -> bool:
        return self.policy == "lpm" and self.kv.shares and 1 < n <= _LPM_MAX_QUEUE

    def _ordered_waiting(self, include_tier_waiting: bool = False) -> tuple[List[Request], dict]:
        """The waiting queue in policy order, and (lpm) each one's reusable prefix length; not
        the requests waiting for their blocks from the KV tiers (unless ``include_tier_waiting``)."""
        reqs = [r for r in self.waiting if include_tier_waiting or not self.kv.tier_waiting(r)]
        lens: dict = {}
        if self._lpm(len(reqs)):
            lens = {id(r): self.kv.prefix_len(r) for r in reqs}
            reqs.sort(key=lambda r: -lens[id(r)])  # stable: ties keep queue order
        held = self._held_back()  # step 0's order: a preempted request after the older newcomers
        if held:
            reqs = [r for r in reqs if id(r) not in held]
        if self._last_turn:  # forget the tenants with nothing waiting (a new request starts a new turn);
            # NOTE: a request waiting for its tier blocks waits too (its tenant keeps its turn)
            tenants = {tenant_of(r.namespace) for r in self.waiting}
            self._last_turn = {t: n for t, n in self._last_turn.items() if t in tenants}
        return tenants_in_turn(reqs, self._last_turn), lens

    def _held_back(self) -> set:
        """The ids of the waiting requests first-token preemption holds back (step 0): those
        retracted after the arrival of the oldest newcomer still waiting."""
        if not self.first_token_preemption:
            return set()
        pending = [r.arrival_seq for r in self.waiting if first_token_pending(r)]
        if not pending:
            return set()
        oldest = min(pending)
        return {id(r) for r in self.waiting if r.preempted_seq is not None and r.preempted_seq > oldest}

    def _admit(self, req: Request, budget: int, reserve: int) -> Optional[int]:
        """Try to admit ``req`` with at most ``budget`` new tokens (its prefix cached or borrowed
        from the plan); returns the chunk length (0 for a rider, which computes nothing) or None
        when it does not fit."""
        kv = self.kv
        if not kv.has_free_row():
            return None
        prefix = kv.lock_prefix(req)  # before any eviction below
        if self.outcomes is not None:  # why the match stopped (first admission of sample 0)
            self.outcomes.on_admit(req, prefix.length, self.running)
        extend = min(req.seq_len - prefix.length, budget)
        if extend <= 0 and prefix.logits_from is None:
            kv.unlock_prefix(prefix)
            return None
        need = kv.pages(prefix.length + extend) - prefix.length
        if not kv.reserve(need, reserve) and not (
            not self.running and self._make_room(need + reserve, keep=req) and kv.reserve(need, reserve)
        ):  # pins give way when nothing runs that could free memory later
            kv.unlock_prefix(prefix)
            return None
        kv.admit(req, prefix, prefix.length + extend)
        if req.num_cached_tokens is None:
            req.num_cached_tokens = prefix.length if req.index == 0 else 0
        self._admit_counter += 1
        req.admit_seq = self._admit_counter
        self._last_turn[tenant_of(req.namespace)] = self._admit_counter
        req.status = RequestStatus.PREFILL
        self.waiting.remove(req)
        self.running.append(req)
        return extend

    def _admit_waiting(self, batch: ScheduledBatch, budget: int, reserve: int, partial: bool) -> None:
        """Admit waiting requests into ``batch`` (module docstring, step 2): in policy order while
        the budget, a row and memory allow; riders (no budget) also after the budget is spent."""
        kv = self.kv
        cands, cached = self._ordered_waiting()
        rerank = bool(cached) and kv.in_batch_sharing
        while cands:
            if budget <= 0 or partial:  # only riders fit now (looked for among the first ones)
                for r in [r for r in cands[:_LPM_MAX_QUEUE] if kv.batch_prefix_len(r) == r.seq_len]:
                    if self._admit_one(batch, r, 0, reserve) is None:
                        break
                    reserve += self.page_size
                return
            if rerank and batch.reqs:  # longest reusable prefix now, the plan's rows included
                turn = tenant_of(cands[0].namespace)  # among the requests of the tenant whose turn it is
                lens = [
                    max(cached[id(r)], kv.batch_prefix_len(r)) if tenant_of(r.namespace) == turn else -1 for r in cands
                ]
                i = lens.index(max(lens))
                if i and -1 in lens:  # several tenants wait: the chosen one takes the head's turn
                    cands[0], cands[i] = cands[i], cands[0]  # and the head the chosen one's
                    i = 0
                r = cands.pop(i)
            else:
                r = cands.pop(0)
            extend = self._admit_one(batch, r, budget, reserve)
            if extend is None:
                return
            budget -= extend
            reserve += self.page_size
            partial = r.kv_len + extend < r.seq_len

    def _admit_one(self, batch: ScheduledBatch, r: Request, budget: int, reserve: int) -> Optional[int]:
        """:meth:`_admit` ``r`` and add it to ``batch`` (a row, published for sharing, or a rider)."""
        extend = self._admit(r, budget, reserve)
        if extend is None:
            return None
        if r.logits_from is not None:
            source, position = r.logits_from
            batch.add_rider(r, source, position)
            return 0
        done = r.kv_len + extend == r.seq_len
        batch.add(r, extend, done)
        self.kv.publish(r, r.kv_len + extend)
        return extend

    def _make_room(self, need: int, keep: Request) -> bool:
        """Make ``need`` slots free for ``keep`` when nothing else runs that could free memory
        later: soft pins and tier installs give way (:meth:`KVManager.yield_pins`), then the
        waiting requests' own pins (the samples ``1 .. n-1`` of ``n > 1`` requests; they
        re-match or recompute their prefix when admitted), else nothing would ever run."""
        kv = self.kv
        if kv.yield_pins(need):
            return True
        kv.detach_pins(r for r in self.waiting if r is not keep)
        return kv.ensure_free(need)

    def _plan_chunks(self, budget: int) -> tuple[List[tuple], bool]:
        """Slots for the next prefill chunk of each running prefilling request, within
        ``budget`` tokens (evicting, then dropping soft pins: a running request's need). Returns
        ``([(request, chunk length)], partial)``: ``partial`` when one is left partly prefilled
        (then no new request is admitted beside it)."""
        kv, chunks, partial = self.kv, [], False
        for r in self.running:
            if r.status != RequestStatus.PREFILL:
                continue
            extend = min(r.seq_len - r.kv_len, budget)
            alone = len(self.running) == 1  # nothing else running will free memory for it
            need = kv.pages(r.kv_len + extend) - len(r.slots)
            if extend <= 0 or not (kv.yield_pins(need) or (alone and self._make_room(need, keep=r))):
                partial = True
                continue
            kv.grow(r, r.kv_len + extend)
            chunks.append((r, extend))
            budget -= extend
            partial = partial or r.kv_len + extend < r.seq_len
        return chunks, partial

    def schedule(self) -> Optional[ScheduledBatch]:
        """Plan the next forward pass; None when nothing can run. See the module docstring."""
        kv = self.kv
        batch = ScheduledBatch()
        batch.retracted, self._unreported = self._unreported, []  # those of a step that ran nothing
        ps = self.page_size
        if self.first_token_preemption:
            self._preempt_for_first_token(batch)
        preempted = len(batch.retracted)
        # 1. decode reservation, retracting the newest admitted request while short.
        while self.running:
            decodes = [r for r in self.running if r.status == RequestStatus.DECODE]
            need = sum(ps for r in decodes if r.kv_len >= len(r.slots))
            if kv.yield_pins(need):  # evicts, then drops soft pins: never retract for a session
                break
            victim = max(self.running, key=lambda r: r.admit_seq)
            if len(self.running) == 1:
                kv.detach_pins(self.waiting)
                if kv.ensure_free(need):
                    break
            self.retract(victim)
            batch.retracted.append(victim)
        decodes = [r for r in self.running if r.status == RequestStatus.DECODE]
        for r in decodes:
            kv.grow(r, r.kv_len + 1)
        # 2. prefill: the chunked request first (its memory before any draft's), then admissions.
        budget = self.chunked_prefill_size
        chunks, partial = self._plan_chunks(budget)
        for r in decodes:  # drafts' tentative slots: never at a decode's, a chunk's or a pin's cost
            drafts, r.draft_tokens = r.draft_tokens, []
            if drafts:
                drafts = drafts[: kv.reserve_drafts(r, len(drafts))]
            batch.add(r, 1 + len(drafts), True, drafts)
        reserve = ps * len(self.running)
        kv.begin_batch()
        for r, extend in chunks:
            batch.add(r, extend, r.kv_len + extend == r.seq_len)
            kv.publish(r, r.kv_len + extend)
            budget -= extend
        # finished tier loads enter the cache; not a held-back request's: its install's lock would
        # hold slots that no admission frees, and a newcomer's load would never find room
        admits = len(batch.retracted) == preempted  # no retraction for memory (step 1)
        may_admit = admits and budget > 0 and not partial and kv.has_free_row()
        kv.tier_step(self.waiting, idle=not self.running, defer=self._held_back(), may_wait=may_admit)
        if admits:
            self._admit_waiting(batch, budget, reserve, partial)
        kv.end_batch()
        if not batch.reqs:
            self._unreported = batch.retracted  # NOTE: the next forward's StepFinished reports them
            return None
        batch.prefill_tokens = batch.num_prefill_tokens
        self.prefill_tokens += batch.prefill_tokens
        return batch

    def _preempt_for_first_token(self, batch: ScheduledBatch) -> None:
        """Step 0 (module docstring): make room for the newcomers step 2 can admit in this step:
        in policy order, within the prefill budget ``chunked_prefill_size`` (the first always),
        those of the first one's tenant (only the first when several tenants' newcomers wait:
        step 2 takes tenants in turn, and another tenant's must not take the room). Each needs
        its pages beyond its cached prefix (locked meanwhile, so it is not counted as room) and
        beyond what an earlier one of them computes for it (in-batch sharing), plus a page for
        each running request. Soft pins give way first (as for a decode), then the newest
        admitted decoding requests of that tenant, not preempted before, are retracted; it
        stops at the first newcomer for which even all of them would not be enough."""
        kv = self.kv
        if any(r.status == RequestStatus.PREFILL for r in self.running):
            return  # a chunked prefill goes first; nothing is admitted beside it
        if not any(first_token_pending(r) for r in self.waiting):
            return
        # NOTE: not only newcomers whose tier lookup is done: one whose cached prefix the decoders
        # keep evicting is looked up again at every step (the preempted wait behind it anyway)
        news = [r for r in self._ordered_waiting(include_tier_waiting=True)[0] if first_token_pending(r)]
        tenant = tenant_of(news[0].namespace) if news else None
        mine = [r for r in news if tenant_of(r.namespace) == tenant]
        if len(mine) < len(news):
            mine = mine[:1]
        locked: list = []
        need, budget = self.page_size * (len(self.running) + 1), self.chunked_prefill_size
        try:
            for new in mine:
                prefix = kv.lock_prefix(new)
                shared = max([prefix.length] + [_common(new, o) for o, _ in locked])
                locked.append((new, prefix))
                extend = new.seq_len - shared
                if len(locked) > 1 and extend > budget:
                    return
                budget -= extend
                need += kv.pages(new.seq_len) - shared
                if not self._retract_for_room(need, tenant, batch):
                    return
        finally:
            for _, prefix in locked:
                kv.unlock_prefix(prefix)

    def _retract_for_room(self, need: int, tenant, batch: ScheduledBatch) -> bool:
        """Step 0's retractions until ``need`` slots could be made free (:meth:`KVManager.headroom`):
        soft pins dropped first, then ``tenant``'s newest admitted decoding requests not
        preempted before. False (nothing done) when even all of that would not be enough."""
        kv = self.kv
        victims = [
            r
            for r in self.running
            if r.status == RequestStatus.DECODE and r.preempted_seq is None and tenant_of(r.namespace) == tenant
        ]  # NOTE: never another tenant's: a tenant's burst must not push others out of the pool
        if kv.headroom() >= need:
            return True
        if kv.headroom() + kv.pinned_size() + sum(len(r.slots) for r in victims) < need:
            return False
        while not kv.yield_soft_pins(need):
            if not victims:
                return False
            victim = max(victims, key=lambda r: r.admit_seq)
            victims.remove(victim)
            self._seq += 1
            victim.preempted_seq = self._seq
            self.retract(victim)
            self.num_first_token_preemptions += 1
            batch.retracted.append(victim)
        return True

    def after_forward(self, batch: ScheduledBatch) -> None:
        """Advance ``kv_len`` of every request of ``batch``; finished prefills start decoding.

        Every prefill chunk's whole pages go into the prefix cache right away
        (:meth:`KVManager.hand_over`, as SGLang's ``cache_unfinished_req``), so requests admitted
        while this one still runs share its prompt instead of recomputing it.
        Rows that borrowed from other rows of the forward are settled first (their borrowed
        prefix re-pointed at the cache those rows have just handed their pages to), in batch
        order, so every row's sources come before it; the riders last.
        """
        for r, e, d in zip(batch.reqs, batch.extend_lens, batch.drafts):
            was_prefill = r.status == RequestStatus.PREFILL
            r.kv_len += e - len(d)  # a draft position counts once its token is accepted
            if was_prefill and r.kv_len == r.seq_len:
                r.status = RequestStatus.DECODE
            if was_prefill:
                self.kv.settle(r)
                self.kv.hand_over(r, r.kv_len)
        for r in batch.riders:
            self.kv.settle(r)
            r.status = RequestStatus.DECODE

    def reset_cache(self) -> bool:
        """Drop every cached prefix (False and nothing done while any request is admitted or a
        pin is held)."""
        if self.running:
            return False
        return self.kv.reset_cache()
