"""Routing policies: choose a replica for a request's token ids (pure Python, torch-free).

A policy sees the replicas' load as it records it itself (every decision counts at once: the
request's replica gets one more outstanding request and its estimated uncached prompt tokens,
until :meth:`Policy.finished`) and, for ``cache_events``, the replicas' exact cache contents
from their cache events (:mod:`radixkv.router.index`). Nothing here imports the engine or torch;
the same objects drive the simulation (bench/sim_routing.py) and the Ray Serve router
(:mod:`radixkv.router.ray`).

Policies (:data:`POLICIES`, :func:`make_policy`):

* ``round_robin`` -- the next replica in turn.
* ``least_load`` -- power of two choices (Mitzenmacher, "The Power of Two Choices in Randomized
  Load Balancing", 2001): two random replicas, the one with fewer outstanding requests (then
  fewer queued prefill tokens). Ray Serve's default router does the same on queue lengths.
* ``session`` -- consistent hashing of a conversation key (``RouteRequest.session``, else the
  request id) over the replicas: rendezvous (highest-random-weight) hashing (Thaler & Ravishankar
  1998), so a replica that leaves moves only its own keys.
* ``approx_tree`` -- SGLang's router (sgl-router ``cache_aware``): an approximate radix tree per
  replica of the tokens routed there (here a torch-free :class:`~radixkv.cache.RadixCache` with
  dummy slots, pruned LRU at ``max_tree_tokens``; it never learns of the replica's evictions).
  Rule: if loads are imbalanced (``max - min > balance_abs_threshold`` and ``max >
  balance_rel_threshold * min``, on outstanding requests) the least-loaded replica; else the
  longest match if its match rate exceeds ``cache_threshold``, else the smallest tree.
* ``cache_events`` -- radixkv's: the longest *exactly* cached prefix, from the replicas' events,
  weighed against load. Rule (docs/routing.md has the measurements behind it): for each replica
  ``r`` with ``h_r`` cached prompt tokens (its event-fed view, plus the prompt blocks of requests
  this router sent it that have not finished ``pending_ttl`` seconds ago, because their events
  may not have arrived yet), queued prefill tokens ``W_r`` and ``L_r`` outstanding requests::

      cost_r = (n - h_r) + load_weight * (W_r + request_tokens * L_r)

  the replica of least cost wins (ties: fewer outstanding requests, then more held tokens, then
  at random); ``n - h_r`` is the prefill it would compute, the second term the work queued ahead
  of it in the same units (tokens of prefill; ``request_tokens`` prices one request's decode). SGLang's balance
  guard bounds the pile-up on one hot prefix: a replica with ``L_r - L_min >
  balance_abs_threshold`` and ``L_r > balance_rel_threshold * L_min`` is not a candidate.
  Two refinements: a request whose deepest cached block (over all replicas) was also the
  deepest cached block of more than ``hot_share`` of the last ``hot_window`` requests shares a
  *hot* prefix (a few-shot preamble, the system prompt of new conversations): computing it once
  more on another replica is cheap against the traffic it serves there, so its outstanding
  requests are priced at ``hot_request_tokens`` (the load decides, join-the-shortest-queue
  like), and the hot prefix counts as cached on every candidate (``hot_everywhere``, on since
  2026-12-03: a replica lacking it is not kept out of the hot traffic by one prefill of it). A
  request cached nowhere (``miss_home``, on) goes *home*: to the replica its first
  block was last routed to (the router remembers, for the last ``home_size`` first blocks, where
  it sent each; it never forgets a prefix because the replica evicted it, as SGLang's
  approximate trees do not); a first block never seen goes among the replicas that are home to
  the fewest first blocks, then those sent the fewest uncached prompt tokens so far, so the
  distinct prefixes partition evenly. Three more (on since 2026-12-02 evening; docs/routing.md
  has the measurements): ``reply_record``: a finished request's ``prompt + output[:-1]`` (what
  its replica inserts when it ends; the serving layer passes the output token ids to
  :meth:`CacheEvents.finished` or :meth:`CacheEvents.replied`) counts as held there at once,
  so a conversation's next turn sent before the replica's events arrive follows its reply;
  ``tail_credit``: for a hot request, the tokens past its held blocks that a held block this
  router sent the same replica after the same prefix shares with it (16-token blocks hide
  shorter overlaps, which the token-level tree still serves; a block in the view is whole, so
  its every token is cached) count as cached, so among equally loaded replicas the one holding
  more of it wins; ``residual``: a replica's oldest outstanding request (the running one, FIFO
  assumed) counts as the share of a mean request it has left, from the mean residual life of
  the durations seen (:meth:`CacheEvents._left`), so the load term of hot requests prefers the
  replica about to be free. And one for a conversation's next turn (on since 2026-12-03;
  ``turn_tokens``, ``turn_slack``): a request whose deepest held block ends a reply this router
  recorded (:meth:`CacheEvents.replied`) pays, on a replica with more than ``turn_slack``
  outstanding requests above the candidates' mean ``m``, ``turn_tokens * (L_r - m -
  turn_slack)**2`` tokens more: a short history leaves a replica whose queue its own
  conversations keep full (each reply there releases the next turn there at once), a long one
  stays, since recomputing it costs more. And one for one-shot traffic (on since 2026-12-03 noon;
  ``one_shot_credit``, ``one_shot_share``): a hot request whose first block's replies are seldom
  followed by a next turn (a few-shot preamble, not a chat's system prompt) gets, on the replicas
  with the fewest outstanding requests, ``one_shot_credit`` tokens per token of its sub-block rest
  beyond the least any candidate holds: where such a request goes commits nothing later, so among
  replicas equal in queue length the few tokens it shares with earlier questions decide (against
  the residual-time estimate that would otherwise); a conversation's start stays placed by load,
  since its later turns follow it. Optional (``miss_by_volume``, off: measured worse on gsp
  without the home rule): a request cached nowhere goes among the replicas sent the fewest
  uncached prompt tokens so far (SGLang's "smallest tree").
"""

from __future__ import annotations

import bisect
import hashlib
import heapq
import itertools
import random
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Optional, Sequence

from radixkv.cache.digests import BLOCK_TOKENS, block_digests
from radixkv.router.index import CacheView

__all__ = [
    "RouteRequest",
    "Decision",
    "ReplicaLoad",
    "Policy",
    "RoundRobin",
    "LeastLoad",
    "Session",
    "ApproxTree",
    "CacheEvents",
    "POLICIES",
    "make_policy",
]


@dataclass
class RouteRequest:
    """What a router knows of a request.

    Attributes:
        request_id: unique among outstanding requests.
        token_ids: the prompt's token ids.
        namespace: its prefix-cache namespace (blocks only match within one).
        session: a conversation key for ``session`` routing (None: the request id).
        output_tokens: expected output tokens (a load estimate; 0 when unknown).
    """

    request_id: str
    token_ids: Sequence[int]
    namespace: Hashable = None
    session: Optional[str] = None
    output_tokens: int = 0
    _digests: Optional[list] = field(default=None, repr=False)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def digests(self) -> list[bytes]:
        """Chained digests of the whole 16-token blocks of ``token_ids[:-1]`` (the engine never
        serves a prompt's last token from the cache), computed once."""
        if self._digests is None:
            n = max(len(self.token_ids) - 1, 0) // BLOCK_TOKENS
            self._digests = block_digests(self.token_ids[: n * BLOCK_TOKENS], self.namespace, 0, n) if n else []
        return self._digests


@dataclass(frozen=True)
class Decision:
    """A routing decision: the replica, the cached prompt tokens the policy expects there (0
    when it does not know), and why (``"cache"``, ``"load"``, ``"miss"``, ``"home"``,
    ``"session"``, ``"turn"``)."""

    replica: str
    cached_tokens: int = 0
    reason: str = ""


@dataclass
class ReplicaLoad:
    """A replica's load as the router records it: outstanding requests and their estimated
    uncached prompt tokens."""

    requests: int = 0
    prefill_tokens: int = 0


class Policy:
    """Base class: replica membership, load recording, decisions (module docstring).

    Args:
        seed: seeds the policy's random choices.

    Attributes:
        loads: ``replica -> ReplicaLoad``.
        decisions: ``request_id -> replica`` of the outstanding requests.
    """

    name = "base"

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.loads: dict[str, ReplicaLoad] = {}
        self.decisions: dict[str, str] = {}
        self._out: dict[str, tuple[str, int]] = {}

    # ------------------------------------------------------------------ membership
    @property
    def replicas(self) -> list[str]:
        return list(self.loads)

    def add_replica(self, replica: str) -> None:
        """Make ``replica`` routable (idempotent)."""
        self.loads.setdefault(replica, ReplicaLoad())

    def remove_replica(self, replica: str) -> None:
        """Forget ``replica``: its load, its outstanding requests and (subclasses) its cache."""
        self.loads.pop(replica, None)
        for rid in [r for r, (rep, _) in self._out.items() if rep == replica]:
            del self._out[rid]
            self.decisions.pop(rid, None)

    # ------------------------------------------------------------------ decisions
    def choose(self, req: RouteRequest, candidates: Optional[Sequence[str]] = None, now: float = 0.0) -> Decision:
        """Pick a replica among ``candidates`` (default: all known) and record the decision.

        Raises:
            ValueError: no candidate replica.
        """
        cands = [c for c in (self.replicas if candidates is None else candidates) if c in self.loads]
        if not cands:
            raise ValueError("choose: no replica to route to")
        if req.request_id in self._out:  # a retry: undo the earlier decision first
            self.finished(req.request_id, now, expire=True)
        d = self._select(req, cands, now)
        self.record(req, d, now)
        return d

    def _select(self, req: RouteRequest, cands: list[str], now: float) -> Decision:
        raise NotImplementedError

    def record(self, req: RouteRequest, d: Decision, now: float = 0.0) -> None:
        """Count ``req`` on ``d.replica`` at once."""
        uncached = max(req.num_tokens - d.cached_tokens, 0)
        self._out[req.request_id] = (d.replica, uncached)
        self.decisions[req.request_id] = d.replica
        load = self.loads[d.replica]
        load.requests += 1
        load.prefill_tokens += uncached

    def finished(
        self, request_id: str, now: float = 0.0, expire: bool = False, output_token_ids: Optional[Sequence[int]] = None
    ) -> None:
        """``request_id`` ended (done, failed or cancelled); unknown ids are ignored. ``expire``:
        drop what the decision implied at once (a retry, a request that never ran).
        ``output_token_ids``: the tokens it generated, when known (``cache_events`` counts the
        blocks of ``prompt + output[:-1]``, what the replica caches, as soon held)."""
        got = self._out.pop(request_id, None)
        self.decisions.pop(request_id, None)
        if got is None:
            return
        rep, uncached = got
        load = self.loads.get(rep)
        if load is not None:
            load.requests -= 1
            load.prefill_tokens -= uncached

    def moved(self, req: RouteRequest, replica: str, now: float = 0.0) -> None:
        """The request went to ``replica`` instead of the chosen one (the serving layer overrode
        the choice): re-record it there."""
        if self._out.get(req.request_id, (None,))[0] == replica:
            return
        self.finished(req.request_id, now, expire=True)
        if replica in self.loads:
            self.record(req, Decision(replica, 0, "moved"), now)

    # ------------------------------------------------------------------ cache information
    def on_events(self, replica: str, batch: dict, now: float = 0.0) -> bool:
        """A batch of ``replica``'s cache events; True when a snapshot is wanted."""
        return False

    def on_snapshot(self, replica: str, snap: dict) -> None:
        """A snapshot of ``replica``'s cache."""

    def stats(self) -> dict:
        return {"policy": self.name, "loads": {r: (ld.requests, ld.prefill_tokens) for r, ld in self.loads.items()}}

    # ------------------------------------------------------------------ helpers
    def _least_loaded(self, cands: list[str]) -> str:
        best = min((self.loads[c].requests, self.loads[c].prefill_tokens) for c in cands)
        ties = [c for c in cands if (self.loads[c].requests, self.loads[c].prefill_tokens) == best]
        return ties[0] if len(ties) == 1 else self.rng.choice(ties)

    def _imbalanced(self, cands: list[str], abs_t: float, rel_t: float) -> bool:
        ls = [self.loads[c].requests for c in cands]
        hi, lo = max(ls), min(ls)
        return hi - lo > abs_t and hi > rel_t * lo


class RoundRobin(Policy):
    """The next replica in turn."""

    name = "round_robin"

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        self._turn = itertools.count()

    def _select(self, req, cands, now):
        cands = sorted(cands)
        return Decision(cands[next(self._turn) % len(cands)], 0, "turn")


class LeastLoad(Policy):
    """Power of two choices on outstanding requests (then queued prefill tokens)."""

    name = "least_load"

    def _select(self, req, cands, now):
        pick = cands if len(cands) <= 2 else self.rng.sample(cands, 2)
        return Decision(self._least_loaded(pick), 0, "load")


def _weight(key: str, replica: str) -> bytes:
    return hashlib.blake2b(f"{key}\x00{replica}".encode(), digest_size=8).digest()


class Session(Policy):
    """Rendezvous hashing of the conversation key over the replicas."""

    name = "session"

    def _select(self, req, cands, now):
        key = req.session if req.session is not None else req.request_id
        return Decision(max(cands, key=lambda c: _weight(key, c)), 0, "session")


class ApproxTree(Policy):
    """SGLang's cache-aware router: an approximate tree per replica of what was routed there.

    Args:
        cache_threshold: minimum match rate (matched / prompt tokens) to follow the match
            (SGLang's gateway default 0.3).
        balance_abs_threshold, balance_rel_threshold: SGLang's imbalance test on outstanding
            requests (defaults 64 and 1.5, SGLang's).
        max_tree_tokens: LRU-prune each tree to this many tokens (SGLang prunes to
            ``max_tree_size`` every ``eviction_interval_secs``; its default 2**26 rarely prunes).
    """

    name = "approx_tree"

    def __init__(
        self,
        seed: int = 0,
        cache_threshold: float = 0.3,
        balance_abs_threshold: float = 64,
        balance_rel_threshold: float = 1.5,
        max_tree_tokens: int = 1 << 26,
    ) -> None:
        super().__init__(seed)
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.max_tree_tokens = max_tree_tokens
        self.trees: dict[str, Any] = {}

    def add_replica(self, replica: str) -> None:
        from radixkv.cache.radix_tree import RadixCache  # torch-free

        super().add_replica(replica)
        self.trees.setdefault(replica, RadixCache(1))

    def remove_replica(self, replica: str) -> None:
        super().remove_replica(replica)
        self.trees.pop(replica, None)

    def _select(self, req, cands, now):
        if self._imbalanced(cands, self.balance_abs_threshold, self.balance_rel_threshold):
            return Decision(self._least_loaded(cands), 0, "load")
        toks = list(req.token_ids)
        best, best_len = None, -1
        for c in cands:
            m = self.trees[c].match_prefix(toks, req.namespace).length
            if m > best_len:
                best, best_len = c, m
        if toks and best_len / len(toks) > self.cache_threshold:
            return Decision(best, 0, "cache")
        smallest = min(self.trees[c].total_size() for c in cands)
        ties = [c for c in cands if self.trees[c].total_size() == smallest]
        return Decision(self.rng.choice(ties), 0, "miss")

    def record(self, req, d, now=0.0):
        super().record(req, d, now)
        import numpy as np

        tree = self.trees[d.replica]
        toks = list(req.token_ids)
        tree.insert(toks, np.zeros(len(toks), dtype=np.int64), req.namespace)
        over = tree.total_size() - self.max_tree_tokens
        if over > 0:
            tree.evict(over)


class CacheEvents(Policy):
    """radixkv's policy: longest exactly cached prefix (from events) weighed against load (module
    docstring states the rule).

    Args:
        load_weight: tokens of cost per token of queued work (1.0: an expected-prefill rule).
        request_tokens: queued work of one outstanding request, in prefill-token units (its
            decode), added to its uncached prompt tokens.
        balance_abs_threshold, balance_rel_threshold: SGLang's balance guard on outstanding
            requests; replicas beyond it are not candidates.
        pending_ttl: seconds a finished request's prompt blocks still count for its replica
            (until its own events have surely arrived).
        hot_share, hot_window, hot_min: a prefix is hot when its deepest cached block was the
            deepest one of more than ``hot_share * max(window length, hot_min)`` of the last
            ``hot_window`` requests.
        hot_request_tokens: ``request_tokens`` for a request on a hot prefix.
        miss_by_volume: nonzero: a request cached nowhere goes among the replicas sent the
            fewest uncached prompt tokens so far.
        miss_home: nonzero: a request cached nowhere goes to its first block's home replica (the
            replica that block was last routed to) when that replica is a candidate; a first
            block with no home goes among the replicas home to the fewest first blocks, then the
            fewest uncached prompt tokens sent so far (before ``miss_by_volume``).
        home_size: first blocks whose home is remembered (least recently routed forgotten first);
            also the reply ends kept (``turn_tokens``) and the parent blocks per replica whose
            children ``tail_credit`` keeps.
        tail_credit: weight per token of a hot request's sub-block rest held on a replica (0:
            off; 1: counted as cached tokens).
        tail_children: blocks remembered per (replica, parent block) for the sub-block rest
            (the most recently routed kept).
        one_shot_credit: tokens of cost per token of a one-shot hot request's sub-block rest
            beyond the least any candidate holds, on the candidates with the fewest outstanding
            requests (0: off; needs ``tail_credit`` and ``reply_record`` with output token ids
            passed, since replies are its evidence). One-shot: of the last ``hot_window`` replies
            recorded (:meth:`replied`; those that complete a block past the prompt, the ones a
            next turn can be told to follow) and next turns routed, at least ``hot_min`` are replies to requests
            with its first block, and that block's next turns number under ``one_shot_share``
            of them.
        one_shot_share: next turns per reply under which a first block's traffic is one-shot.
        hot_everywhere: nonzero: a hot request's hot prefix (its deepest held block and those
            before it) counts as cached on every candidate in the cost (the decision still
            reports what the replica holds), so a replica that lacks it is not kept out of the
            hot traffic by one prefill of it.
        reply_record: nonzero: outputs passed to :meth:`finished` / :meth:`replied` count as
            held on their replica until ``pending_ttl`` after the request ended.
        residual: nonzero: a replica's running request counts by its expected time left (mean
            residual life of the last ``residual_window`` request durations) in hot requests'
            load term.
        residual_window: request durations kept for ``residual``.
        turn_tokens: tokens per squared request of queue excess a conversation's next turn pays
            on a replica more than ``turn_slack`` outstanding requests above the candidates'
            mean (0: off). A next turn: its deepest held block is the last block of a reply
            chain recorded by :meth:`replied` (the last ``home_size`` kept).
        turn_slack: outstanding requests above the candidates' mean a next turn's replica may
            have free of that cost.
    """

    name = "cache_events"

    def __init__(
        self,
        seed: int = 0,
        load_weight: float = 0.05,
        request_tokens: float = 0.0,
        balance_abs_threshold: float = 32,
        balance_rel_threshold: float = 1.5,
        pending_ttl: float = 2.0,
        hot_share: float = 0.25,
        hot_window: int = 256,
        hot_request_tokens: float = 6000.0,
        hot_min: int = 8,
        miss_by_volume: float = 0.0,
        miss_home: float = 1.0,
        home_size: int = 1 << 16,
        tail_credit: float = 1.0,
        tail_children: int = 512,
        one_shot_credit: float = 200.0,
        one_shot_share: float = 0.05,
        hot_everywhere: float = 1.0,
        reply_record: float = 1.0,
        residual: float = 1.0,
        residual_window: int = 512,
        turn_tokens: float = 300.0,
        turn_slack: float = 3.0,
    ) -> None:
        super().__init__(seed)
        self.turn_tokens = turn_tokens
        self.turn_slack = turn_slack
        # the last block digest of each recorded reply chain (prompt + output[:-1]), most recent
        # last, at most home_size: a request whose deepest held block is one is a next turn
        self._ends: OrderedDict = OrderedDict()
        self.tail_credit = tail_credit
        self.one_shot_credit = one_shot_credit
        self.one_shot_share = one_shot_share
        self.hot_everywhere = bool(hot_everywhere)
        # (first block, 0: a reply recorded / 1: a next turn routed) of the last hot_window such
        # events; first block -> [replies, next turns] among them (one-shot: few next turns per reply)
        self._turn_recent: deque = deque()
        self._turn_counts: dict = {}
        self.tail_children = int(tail_children)
        self.reply_record = bool(reply_record)
        self.residual = bool(residual)
        self.residual_window = int(residual_window)
        self._fifo: dict[str, deque] = {}  # replica -> its outstanding request ids, in routing order
        self._since: dict[str, float] = {}  # replica -> when its oldest outstanding request began
        # mean request duration (s): an EWMA (weight 0.05), which follows a change sooner than the
        # window's plain mean (measured: the plain mean moved few-shot N = 8 imbalance 1.155 -> 1.192)
        self.service_s: Optional[float] = None
        self._durs: deque = deque()  # the last residual_window durations, in arrival order
        self._sorted: list[float] = []  # the same, sorted
        self._suffix: Optional[list[float]] = None  # suffix sums of _sorted (None: stale)
        self._prompts: dict[str, RouteRequest] = {}  # requests with a pending record (reply_record)
        self.replies = 0  # outputs recorded (reply_record)
        # replica -> parent digest (None: a chain's first block) -> {child digest: its 16 tokens},
        # the last home_size parents routed to the replica
        self.children: dict[str, OrderedDict] = {}
        self.load_weight = load_weight
        self.request_tokens = request_tokens
        self.hot_share = hot_share
        self.hot_window = int(hot_window)
        self.hot_request_tokens = hot_request_tokens
        self.hot_min = int(hot_min)
        self.miss_by_volume = bool(miss_by_volume)
        self.miss_home = bool(miss_home)
        self.home_size = int(home_size)
        self.home: OrderedDict = OrderedDict()  # first block digest -> the replica it was last routed to
        self.home_count: dict[str, int] = {}  # replica -> first blocks it is home to
        self.volume: dict[str, int] = {}  # uncached prompt tokens routed to each replica so far
        self._recent: deque = deque()  # the deepest matched block of the last hot_window requests
        self._recent_counts: dict = {}
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.pending_ttl = pending_ttl
        self.views: dict[str, CacheView] = {}
        self.pending: dict[str, dict[bytes, int]] = {}
        self._pending_req: dict[str, tuple[str, list[bytes]]] = {}
        self._expiry: list[tuple[float, int, str]] = []
        self._tick = itertools.count()

    def add_replica(self, replica: str) -> None:
        super().add_replica(replica)
        self.views.setdefault(replica, CacheView())
        self.pending.setdefault(replica, {})
        self.children.setdefault(replica, OrderedDict())

    def remove_replica(self, replica: str) -> None:
        super().remove_replica(replica)
        self.views.pop(replica, None)
        self.pending.pop(replica, None)
        self.children.pop(replica, None)
        self._fifo.pop(replica, None)
        self._since.pop(replica, None)
        self.volume.pop(replica, None)
        self.home_count.pop(replica, None)
        for g in [g for g, r in self.home.items() if r == replica]:
            del self.home[g]
        for rid in [r for r, (rep, _) in self._pending_req.items() if rep == replica]:
            del self._pending_req[rid]
            self._prompts.pop(rid, None)

    def on_events(self, replica: str, batch: dict, now: float = 0.0) -> bool:
        view = self.views.get(replica)
        if view is None:
            return False
        return view.apply(batch)

    def on_snapshot(self, replica: str, snap: dict) -> None:
        view = self.views.get(replica)
        if view is not None:
            view.load_snapshot(snap)

    def cached_tokens(self, req: RouteRequest, replica: str) -> int:
        """Prompt tokens of ``req`` held by ``replica`` (view + pending), whole blocks."""
        return self.views[replica].prefix_blocks(req.digests(), self.pending[replica]) * BLOCK_TOKENS

    def _purge(self, now: float) -> None:
        exp = self._expiry
        while exp and exp[0][0] <= now:
            _, _, rid = heapq.heappop(exp)
            self._drop_pending(rid)

    def _drop_pending(self, rid: str) -> None:
        self._prompts.pop(rid, None)
        got = self._pending_req.pop(rid, None)
        if got is None:
            return
        rep, digests = got
        counts = self.pending.get(rep)
        if counts is None:
            return
        for d in digests:
            k = counts.get(d, 0) - 1
            if k > 0:
                counts[d] = k
            else:
                counts.pop(d, None)

    def _select(self, req, cands, now):
        self._purge(now)
        if len(cands) > 1:
            lo = min(self.loads[c].requests for c in cands)
            a, r = self.balance_abs_threshold, self.balance_rel_threshold
            cands = [c for c in cands if not (self.loads[c].requests - lo > a and self.loads[c].requests > r * lo)]
        n = req.num_tokens
        digests = req.digests()
        held = {c: self.views[c].prefix_blocks(digests, self.pending[c]) for c in cands}
        deepest = max(held.values(), default=0)
        top = digests[deepest - 1] if deepest else None
        rt = self.request_tokens
        hot = top is not None and self._recent_counts.get(top, 0) > self.hot_share * max(
            len(self._recent), self.hot_min
        )
        if hot:
            rt = self.hot_request_tokens  # a hot shared prefix: worth holding on every replica
        self._remember(top)
        if top is None and self.miss_home and digests:
            c = self.home.get(digests[0])
            if c in cands:
                return Decision(c, 0, "home")
            # a new prefix (or its home is not a candidate): where the fewest prefixes live,
            # then where the least new content went
            hc = self.home_count
            lo = min(hc.get(c, 0) for c in cands)
            cands = [c for c in cands if hc.get(c, 0) == lo]
            vol = min(self.volume.get(c, 0) for c in cands)
            cands = [c for c in cands if self.volume.get(c, 0) == vol]
        elif top is None and self.miss_by_volume:
            # cached nowhere: new content goes where the least new content went (approx_tree's
            # "smallest tree"), so the distinct prefixes partition evenly over the replicas
            vol = min(self.volume.get(c, 0) for c in cands)
            cands = [c for c in cands if self.volume.get(c, 0) == vol]
        nxt = top is not None and top in self._ends  # a conversation's next turn
        if nxt and self.one_shot_credit:
            self._count_turn(digests[0], 1)
        tail = boost = None
        if self.tail_credit and hot:
            # a hot prefix: the load decides; among equally loaded replicas the sub-block rest
            tail = {c: self._tail(req, c, held[c]) for c in cands}
            if self.one_shot_credit and self._one_shot(digests[0]):
                # one-shot traffic (nothing follows the request there): among the replicas with the
                # fewest outstanding requests, the sub-block rest beyond the least one holds decides
                # (the rest past the hot prefix: a replica holding less of it has none)
                rest = {c: tail[c] if held[c] == deepest else 0 for c in cands}
                least = min(self.loads[c].requests for c in cands)
                t0 = min(rest.values())
                boost = {c: self.one_shot_credit * (rest[c] - t0) for c in cands if self.loads[c].requests == least}
        busy = None
        if self.turn_tokens and not hot and nxt:
            # a conversation's next turn (its deepest held block ends an earlier reply): a replica
            # whose queue is more than turn_slack requests above the candidates' mean pays for it
            ls = [self.loads[c].requests for c in cands]
            busy = sum(ls) / len(ls) + self.turn_slack
        best_key, ties = None, []
        for c in cands:
            h = min(held[c] * BLOCK_TOKENS + (tail[c] if tail else 0), max(n - 1, 0))
            ld = self.loads[c]
            reqs = self._outstanding(c, now) if rt else ld.requests
            # a hot prefix counts as held on every candidate (hot_everywhere): computed once where
            # it is missing, it then serves that replica's share of the traffic
            hc = max(h, min(deepest * BLOCK_TOKENS, max(n - 1, 0))) if hot and self.hot_everywhere else h
            cost = (n - hc) + self.load_weight * (ld.prefill_tokens + rt * reqs)
            if busy is not None and ld.requests > busy:
                cost += self.turn_tokens * (ld.requests - busy) ** 2
            if tail:
                cost -= (self.tail_credit - 1.0) * tail[c]
            if boost:
                cost -= boost.get(c, 0.0)
            key = (cost, ld.requests, -h)  # ties: fewer outstanding, then more truly held
            if best_key is None or key < best_key:
                best_key, ties = key, [(c, h)]
            elif key == best_key:
                ties.append((c, h))
        c, h = ties[0] if len(ties) == 1 else self.rng.choice(ties)
        return Decision(c, h, "cache" if h else "miss")

    def _tail(self, req: RouteRequest, replica: str, k: int) -> int:
        """Tokens of ``req`` past its ``k`` held blocks that ``replica`` surely holds: the common
        prefix of ``req``'s block ``k`` with a block this router sent ``replica`` after the same
        ``k`` blocks that is still whole in its view (so its every token is cached there)."""
        kids = self.children[replica].get(req.digests()[k - 1] if k else None)
        if not kids:
            return 0
        toks = req.token_ids
        lo = k * BLOCK_TOKENS
        hi = min(lo + BLOCK_TOKENS, len(toks) - 1)
        if hi <= lo:
            return 0
        mine = tuple(toks[lo:hi])
        view, pend = self.views[replica].blocks, self.pending[replica]
        best = 0
        for d, blk in kids.items():
            if d in view or d in pend:
                m = 0
                for a, b in zip(mine, blk):
                    if a != b:
                        break
                    m += 1
                if m > best:
                    best = m
        return best

    def _left(self, elapsed: float) -> float:
        """Expected remaining seconds of a request running for ``elapsed`` s: the mean residual
        life E[T - e | T > e] over the last ``residual_window`` durations seen (one mean duration
        when none is longer: no guess past the data): near-constant durations give the time
        left, heavy-tailed ones a longer wait the longer it ran."""
        srt = self._sorted
        if self._suffix is None:
            suf = [0.0] * (len(srt) + 1)
            for i in range(len(srt) - 1, -1, -1):
                suf[i] = suf[i + 1] + srt[i]
            self._suffix = suf
        i = bisect.bisect_right(srt, elapsed)
        k = len(srt) - i
        return (self._suffix[i] / k - elapsed) if k else float(self.service_s or 0.0)

    def _outstanding(self, c: str, now: float) -> float:
        """``c``'s outstanding requests, its oldest one counted as the share of a mean request it
        has still to run (``residual``; the plain count before any request finished)."""
        reqs = self.loads[c].requests
        if self.residual and reqs and self.service_s:
            reqs += self._left(now - self._since.get(c, now)) / self.service_s - 1.0
        return reqs

    def _count_turn(self, first: bytes, kind: int) -> None:
        self._turn_recent.append((first, kind))
        cnt = self._turn_counts.setdefault(first, [0, 0])
        cnt[kind] += 1
        while len(self._turn_recent) > self.hot_window:
            f, k = self._turn_recent.popleft()
            cnt = self._turn_counts[f]
            cnt[k] -= 1
            if not cnt[0] and not cnt[1]:
                del self._turn_counts[f]

    def _one_shot(self, first: bytes) -> bool:
        """Whether requests starting with block ``first`` are one-shot: of the last
        ``hot_window`` replies recorded and next turns routed, at least ``hot_min`` are its replies
        and its next turns number under ``one_shot_share`` of them (before any reply: not)."""
        replies, nxt = self._turn_counts.get(first, (0, 0))
        return replies >= self.hot_min and nxt < self.one_shot_share * replies

    def _remember(self, top) -> None:
        self._recent.append(top)
        self._recent_counts[top] = self._recent_counts.get(top, 0) + 1
        while len(self._recent) > self.hot_window:
            old = self._recent.popleft()
            k = self._recent_counts[old] - 1
            if k:
                self._recent_counts[old] = k
            else:
                del self._recent_counts[old]

    def record(self, req, d, now=0.0):
        super().record(req, d, now)
        if self.residual:  # FIFO service assumed: the oldest outstanding request is the running one
            q = self._fifo.setdefault(d.replica, deque())
            if not q:
                self._since[d.replica] = now
            q.append(req.request_id)
        self.volume[d.replica] = self.volume.get(d.replica, 0) + max(req.num_tokens - d.cached_tokens, 0)
        digests = req.digests()
        if digests and self.miss_home:
            self._set_home(digests[0], d.replica)
        if digests and self.tail_credit:  # all its blocks: the held ones become the most recent
            self._add_children(d.replica, req.token_ids, digests, 0)
        if digests:
            counts = self.pending[d.replica]
            for g in digests:
                counts[g] = counts.get(g, 0) + 1
            self._pending_req[req.request_id] = (d.replica, digests)
            if self.reply_record:
                self._prompts[req.request_id] = req

    def _add_children(self, replica: str, toks: Sequence[int], digests: list[bytes], start: int) -> None:
        kids_of = self.children[replica]
        cap = self.tail_children
        for k in range(start, len(digests)):
            parent = digests[k - 1] if k else None
            kids = kids_of.get(parent)
            if kids is None:
                kids = kids_of[parent] = {}
                if len(kids_of) > self.home_size:  # bounded: the least recently routed parent goes
                    kids_of.popitem(last=False)
            else:
                kids_of.move_to_end(parent)
            d = digests[k]
            if d in kids:
                del kids[d]  # re-insert: most recent last
            kids[d] = tuple(toks[k * BLOCK_TOKENS : (k + 1) * BLOCK_TOKENS])
            if len(kids) > cap:
                del kids[next(iter(kids))]

    def replied(self, request_id: str, output_token_ids: Sequence[int]) -> None:
        """``request_id`` generated ``output_token_ids`` (before or after :meth:`finished`, while
        its pending record lasts; unknown ids are ignored): the blocks of ``prompt +
        output[:-1]``, what its replica caches when it ends, count as held there until its own
        events have surely arrived (``reply_record``)."""
        req = self._prompts.pop(request_id, None)
        got = self._pending_req.get(request_id)
        if req is None or got is None:
            return
        self.replies += 1
        rep, digests = got
        toks = list(req.token_ids) + list(output_token_ids)[:-1]
        k, stop = len(digests), len(toks) // BLOCK_TOKENS
        if stop <= k:
            return
        more = block_digests(toks, req.namespace, k, stop, digests[k - 1] if k else None)
        counts = self.pending[rep]
        for g in more:
            counts[g] = counts.get(g, 0) + 1
        full = digests + more
        self._pending_req[req.request_id] = (rep, full)
        if self.turn_tokens or self.one_shot_credit:  # next turns are told by these ends
            self._end(full[-1])
        if self.one_shot_credit:  # a reply a next turn can be told to follow
            self._count_turn(digests[0], 0)
        if self.tail_credit:
            self._add_children(rep, toks, full, k)

    def _end(self, d: bytes) -> None:
        ends = self._ends
        ends[d] = None
        ends.move_to_end(d)
        while len(ends) > self.home_size:
            ends.popitem(last=False)

    def _set_home(self, first: bytes, replica: str) -> None:
        home, hc = self.home, self.home_count
        old = home.get(first)
        if old is not None:
            home.move_to_end(first)
            if old == replica:
                return
            hc[old] = hc.get(old, 0) - 1
        home[first] = replica
        hc[replica] = hc.get(replica, 0) + 1
        while len(home) > self.home_size:
            _, r = home.popitem(last=False)
            hc[r] = hc.get(r, 0) - 1

    def finished(self, request_id, now=0.0, expire=False, output_token_ids=None):
        rep = self._out.get(request_id, (None,))[0]
        super().finished(request_id, now, expire)
        if output_token_ids is not None and not expire:
            self.replied(request_id, output_token_ids)
        q = self._fifo.get(rep) if rep is not None else None
        if q:
            if q[0] == request_id:
                q.popleft()
                if not expire:
                    dur = now - self._since.get(rep, now)
                    self.service_s = dur if self.service_s is None else 0.95 * self.service_s + 0.05 * dur
                    self._durs.append(dur)
                    bisect.insort(self._sorted, dur)
                    if len(self._durs) > self.residual_window:
                        old = self._durs.popleft()
                        del self._sorted[bisect.bisect_left(self._sorted, old)]
                    self._suffix = None
                self._since[rep] = now
            else:
                try:
                    q.remove(request_id)
                except ValueError:
                    pass
        if request_id in self._pending_req:
            if expire or self.pending_ttl <= 0:
                self._drop_pending(request_id)
            else:
                heapq.heappush(self._expiry, (now + self.pending_ttl, next(self._tick), request_id))

    def stats(self) -> dict:
        out = super().stats()
        out["blocks"] = {r: len(v) for r, v in self.views.items()}
        out["synced"] = {r: v.synced for r, v in self.views.items()}
        out["replies"] = self.replies
        return out


POLICIES: dict[str, Callable[..., Policy]] = {
    "round_robin": RoundRobin,
    "least_load": LeastLoad,
    "session": Session,
    "approx_tree": ApproxTree,
    "cache_events": CacheEvents,
}


def make_policy(name: str, **kwargs: Any) -> Policy:
    """The policy called ``name`` (a key of :data:`POLICIES`) with its keyword options.

    Raises:
        ValueError: an unknown name, or an option the policy does not take.
    """
    if name not in POLICIES:
        raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {name!r}")
    try:
        return POLICIES[name](**kwargs)
    except TypeError as exc:
        raise ValueError(f"policy {name!r}: {exc}") from None
