"""``cache_events``, radixkv's routing policy: the longest *exactly* cached prefix, from the
replicas' cache events, weighed against load in one unit, tokens of prefill.

The rule. SGLang's balance guard first drops every replica with ``L_r - L_min >
balance_abs_threshold`` and ``L_r > balance_rel_threshold * L_min`` (``L``: outstanding
requests). For each remaining candidate ``r``, ``h_r`` is the request's leading prompt tokens
(whole 16-token blocks) that ``r`` holds by its event-fed view or soon will: the blocks of every
prompt this router sent ``r`` and, once a request ends, of its ``prompt + output[:-1]`` (what
``r`` inserts then), until ``pending_ttl`` seconds after it ended. The cost is ``cost_r = (n -
h_r) + load_weight * W_r``, with ``n`` the prompt's tokens and ``W_r`` the uncached prompt
tokens of ``r``'s outstanding requests; the least cost wins (ties: fewer outstanding requests,
then more held tokens, then at random). One popularity rule: a block is hot when it was the
deepest held block (over all replicas) of more than ``hot_share`` of the last 256 requests (all
of them, while fewer), and a request is on a hot prefix (a few-shot preamble, a shared system
prompt) when its held prefix reaches a hot block and holds fewer tokens beyond it than one
outstanding request on a hot prefix costs (``load_weight * hot_request_tokens``); that prefix
then counts as held on every candidate and each outstanding request adds ``hot_request_tokens``
to ``W_r``, so the load places it (computing the prefix once more serves that replica's share of
the traffic). With ``home`` on, a request not on a hot prefix that is held nowhere, or of which
only a stub is held (fewer tokens than one outstanding request on a hot prefix costs, most of
them on its home and less on every other candidate, and its first block begins no more than
``hot_share`` of the last 256 requests: not a template every conversation shares), goes home
instead: to the candidate its first block was last routed to; a request held nowhere whose first
block was never seen (or whose home is not a candidate) goes to a candidate home to the fewest
first blocks (then the one sent the fewest uncached tokens). So distinct prefixes partition evenly, and a prefix its replica
evicted, wholly or all but its first blocks, comes back there instead of moving to whichever
replica is least loaded that moment.

Nothing assumes a service order: the load is the router's own count of outstanding requests and
their uncached tokens, whatever order (or batch) a replica runs them in.

KV tiers (docs/tiers.md) count in :meth:`CacheEvents.miss_cost`: the ``t_r`` tokens after
``h_r`` that a KV tier holds for ``r`` (its own host or disk tier, or the ``remote`` tier every
replica shares, from the replicas' tier insert records) cost ``tier_weight`` of a missed token
each (default 0.25: loading is cheaper than recomputing, dearer than a local hit), so ``n - h_r``
becomes ``n - h_r - t_r + tier_weight * t_r``, in the same unit.

Pure Python and torch-free, as every policy (:mod:`radixkv.router.policy`); the replicas' views
come from :mod:`radixkv.router.index`.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import OrderedDict, deque
from typing import Optional, Sequence

from radixkv.cache.digests import BLOCK_TOKENS, block_digests
from radixkv.router.base import Decision, Policy, RouteRequest
from radixkv.router.index import CacheView

__all__ = ["CacheEvents"]

HOT_WINDOW = 256  # requests whose deepest held block the popularity rule counts
HOME_SIZE = 1 << 16  # first blocks whose home is remembered (least recently routed forgotten)


class _Window:
    """How many of the last :data:`HOT_WINDOW` requests had each key (a block digest)."""

    __slots__ = ("keys", "counts")

    def __init__(self) -> None:
        self.keys: deque = deque()
        self.counts: dict = {}

    def add(self, key) -> None:
        self.keys.append(key)
        self.counts[key] = self.counts.get(key, 0) + 1
        if len(self.keys) > HOT_WINDOW:
            old = self.keys.popleft()
            k = self.counts[old] - 1
            if k:
                self.counts[old] = k
            else:
                del self.counts[old]

    def over(self, key, share: float) -> bool:
        """``key`` was had by more than ``share`` of the requests counted (all of them, while
        fewer than the window)."""
        return self.counts.get(key, 0) > share * len(self.keys)


class CacheEvents(Policy):
    """radixkv's policy: longest exactly cached prefix weighed against load (the module docstring
    states the rule).

    Args:
        seed: seeds the random tie-break.
        load_weight: tokens of cost per token of queued work (dimensionless, >= 0).
        hot_request_tokens: queued work of one outstanding request (its decode and its share of
            the queue), in prefill tokens, for a request on a hot prefix (>= 0).
        hot_share: a block is hot when it was the deepest held block of more than this share
            of the last 256 requests (0 < hot_share <= 1; 1: never).
        balance_abs_threshold, balance_rel_threshold: SGLang's balance guard on outstanding
            requests.
        pending_ttl: seconds after a request ends that its prompt and reply blocks still count
            as held on its replica (until its own events have surely arrived).
        home: a request held nowhere, or only as a stub on its home, goes to its first block's
            home replica.
        tier_weight: cost of a prompt token a KV tier holds for a replica, per token of a miss
            (1: the tiers do not count; 0: as a local hit).

    Raises:
        ValueError: a negative weight or ttl, ``hot_share`` outside (0, 1], ``home`` not a bool.
    """

    name = "cache_events"

    def __init__(
        self,
        seed: int = 0,
        load_weight: float = 0.05,
        hot_request_tokens: float = 6000.0,
        hot_share: float = 0.25,
        balance_abs_threshold: float = 32,
        balance_rel_threshold: float = 1.5,
        pending_ttl: float = 2.0,
        home: bool = True,
        tier_weight: float = 0.25,
    ) -> None:
        super().__init__(seed)
        for k, v in (
            ("load_weight", load_weight),
            ("tier_weight", tier_weight),
            ("hot_request_tokens", hot_request_tokens),
            ("pending_ttl", pending_ttl),
        ):
            if not v >= 0:
                raise ValueError(f"cache_events: {k} must be >= 0, got {v!r}")
        if not 0 < hot_share <= 1:
            raise ValueError(f"cache_events: hot_share must be in (0, 1], got {hot_share!r}")
        if not isinstance(home, bool):
            raise ValueError(f"cache_events: home must be a bool, got {home!r}")
        self.load_weight = float(load_weight)
        self.tier_weight = float(tier_weight)
        self.hot_request_tokens = float(hot_request_tokens)
        self.hot_share = float(hot_share)
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.pending_ttl = float(pending_ttl)
        self.home_on = home
        self.views: dict[str, CacheView] = {}
        # replica -> digest -> how many of this router's requests there hold it (in flight, or
        # ended under pending_ttl ago)
        self.pending: dict[str, dict[bytes, int]] = {}
        self._pending_req: dict[str, tuple[str, list[bytes]]] = {}  # request -> (replica, its blocks)
        self._prompts: dict[str, RouteRequest] = {}  # requests whose reply may still be recorded
        self._expiry: list[tuple[float, int, str]] = []  # (when, tie, request) of ended requests
        self._tick = itertools.count()
        self.replies = 0  # outputs recorded
        self._deepest = _Window()  # the deepest held block of the last HOT_WINDOW requests
        self._firsts = _Window()  # the first block of the last HOT_WINDOW requests
        self.home: OrderedDict = OrderedDict()  # first block digest -> the replica it was last routed to
        self.home_count: dict[str, int] = {}  # replica -> first blocks it is home to
        self.volume: dict[str, int] = {}  # replica -> uncached prompt tokens routed there so far

    # ------------------------------------------------------------------ membership, events
    def add_replica(self, replica: str) -> None:
        super().add_replica(replica)
        self.views.setdefault(replica, CacheView())
        self.pending.setdefault(replica, {})

    def remove_replica(self, replica: str) -> None:
        super().remove_replica(replica)
        self.views.pop(replica, None)
        self.pending.pop(replica, None)
        self.volume.pop(replica, None)
        self.home_count.pop(replica, None)
        for g in [g for g, r in self.home.items() if r == replica]:
            del self.home[g]
        for rid in [r for r, (rep, _) in self._pending_req.items() if rep == replica]:
            del self._pending_req[rid]
            self._prompts.pop(rid, None)

    def on_events(self, replica: str, batch: dict, now: float = 0.0) -> bool:
        view = self.views.get(replica)
        return False if view is None else view.apply(batch)

    def on_snapshot(self, replica: str, snap: dict) -> None:
        view = self.views.get(replica)
        if view is not None:
            view.load_snapshot(snap)

    def cached_tokens(self, req: RouteRequest, replica: str) -> int:
        """Prompt tokens of ``req`` that ``replica`` holds (view + in flight), whole blocks."""
        return self.views[replica].prefix_blocks(req.digests(), self.pending[replica]) * BLOCK_TOKENS

    # ------------------------------------------------------------------ the rule
    def costs(self, req: RouteRequest, candidates: Optional[Sequence[str]] = None, now: float = 0.0) -> dict:
        """``cost_r`` of routing ``req`` to each candidate (default: all), in prefill tokens, as
        :meth:`choose` would weigh it now (``math.inf``: out by the balance guard); routes and
        records nothing. The home rule, which overrides the cost for a request held nowhere or
        as a stub, is not applied."""
        self._purge(now)
        cands = [c for c in (self.replicas if candidates is None else candidates) if c in self.loads]
        held, deepest, top = self._held(req, cands)
        kept = set(self._guard(cands))
        cost = self._cost(req, cands, held, self._hot_floor(req.digests(), deepest))
        return {c: cost[c] if c in kept else math.inf for c in cands}

    def _select(self, req, cands, now):
        self._purge(now)
        held, deepest, top = self._held(req, cands)
        floor = self._hot_floor(req.digests(), deepest)
        self._deepest.add(top)
        cands = self._guard(cands)
        digests = req.digests()
        if digests:
            self._firsts.add(digests[0])
        if self.home_on and digests and not floor:
            c = self.home.get(digests[0])
            if c in cands and self._stays_home(c, held, cands, digests[0]):
                h = min(held[c] * BLOCK_TOKENS, max(req.num_tokens - 1, 0))
                return Decision(c, h, "cache" if h else "home")
            if top is None:
                cands = self._fewest_homes(cands)
        cost = self._cost(req, cands, held, floor)
        best_key, ties = None, []
        for c in cands:
            key = (cost[c], self.loads[c].requests, -held[c])
            if best_key is None or key < best_key:
                best_key, ties = key, [c]
            elif key == best_key:
                ties.append(c)
        c = ties[0] if len(ties) == 1 else self.rng.choice(ties)
        h = min(held[c] * BLOCK_TOKENS, max(req.num_tokens - 1, 0))
        return Decision(c, h, "cache" if h else "miss")

    def _held(self, req: RouteRequest, cands: list[str]) -> tuple[dict, int, Optional[bytes]]:
        """Per candidate its leading held blocks of ``req``; the most any holds; that block."""
        digests = req.digests()
        held = {c: self.views[c].prefix_blocks(digests, self.pending[c]) for c in cands}
        deepest = max(held.values(), default=0)
        return held, deepest, digests[deepest - 1] if deepest else None

    def _hot_floor(self, digests: list, deepest: int) -> int:
        """The hot prefix a request of block ``digests`` is on, in blocks (0: none): the deepest
        hot block among its ``deepest`` held ones that it holds fewer than ``load_weight *
        hot_request_tokens`` tokens beyond (its deepest held block itself always counts)."""
        price = self.load_weight * self.hot_request_tokens
        k = deepest
        while k > 0 and (k == deepest or (deepest - k) * BLOCK_TOKENS < price):
            if self._deepest.over(digests[k - 1], self.hot_share):
                return k
            k -= 1
        return 0

    def _stays_home(self, home: str, held: dict, cands: list[str], first: bytes) -> bool:
        """Whether a request whose first block ``first`` has its home on ``home`` (a candidate)
        goes home: it is held nowhere, or only a stub of it is held (fewer tokens than one
        outstanding request is worth, ``load_weight * hot_request_tokens``), most of it on its
        home, and ``first`` begins no more than ``hot_share`` of the last 256 requests.

        NOTE: a prefix its home partly evicted (the leading blocks survive the LRU's tail
        eviction) would otherwise go to whichever replica is least loaded that moment, and the
        prefix's later requests would follow it there: its home drifts, and a replica that
        collects more prefixes than its share stays overloaded until the balance guard fires.
        A first block that many requests begin with (a chat template's system prompt) names no
        prefix: its "home" is just where it was last routed, and a stub of it (a new
        conversation) is placed by the cost, or a replica that does not hold it yet (one just
        added or flushed) would never be sent one.
        """
        h = held[home]
        if h == 0:
            return all(held[c] == 0 for c in cands)
        if self._firsts.over(first, self.hot_share):
            return False
        stub = h * BLOCK_TOKENS < self.load_weight * self.hot_request_tokens
        return stub and all(held[c] < h for c in cands if c != home)

    def _guard(self, cands: list[str]) -> list[str]:
        """SGLang's balance guard: the candidates not too far above the least loaded one."""
        lo = min(self.loads[c].requests for c in cands)
        a, r = self.balance_abs_threshold, self.balance_rel_threshold
        return [c for c in cands if not (self.loads[c].requests - lo > a and self.loads[c].requests > r * lo)]

    def _cost(self, req: RouteRequest, cands: list[str], held: dict, floor: int) -> dict:
        """``cost_r`` per candidate: :meth:`miss_cost` (a hot prefix of ``floor`` blocks held
        everywhere; 0: none) plus the weighted queued work."""
        cost = self.miss_cost(req, cands, held, floor)
        w, q = self.load_weight, self.hot_request_tokens if floor else 0.0
        for c in cands:
            ld = self.loads[c]
            cost[c] += w * (ld.prefill_tokens + q * ld.requests)
        return cost

    def miss_cost(self, req: RouteRequest, cands: list[str], held: dict, floor: int) -> dict:
        """Per candidate, the prompt tokens it would compute, ``n - h_r``, with ``h_r`` its
        ``held`` blocks but at least ``floor`` blocks (a hot prefix), in tokens; the tokens after
        those that a KV tier holds for it count ``tier_weight`` each instead of 1."""
        n = req.num_tokens
        cap = max(n - 1, 0)  # the prompt's last token is never served from the cache
        cost = {c: n - min(max(held[c], floor) * BLOCK_TOKENS, cap) for c in cands}
        if self.tier_weight < 1:
            tiered = self._tiered(req.digests(), held, cands)
            for c in cands:
                hc = min(max(held[c], floor) * BLOCK_TOKENS, cap)
                cost[c] -= (1.0 - self.tier_weight) * max(0, min(tiered[c] * BLOCK_TOKENS, cap) - hc)
        return cost

    def _tiered(self, digests: list, held: dict, cands: list) -> dict:
        """Per candidate, the leading blocks of ``digests`` it holds in its pool or a KV tier
        holds for it (its own, or the remote tier any replica stored them in)."""
        remote = [v.tiered["remote"] for v in self.views.values() if "remote" in v.tiered]
        out = {}
        for c in cands:
            own = list(self.views[c].tiered.values())
            k = held[c]
            while k < len(digests) and any(digests[k] in t for t in own + remote):
                k += 1
            out[c] = k
        return out

    def _fewest_homes(self, cands: list[str]) -> list[str]:
        """The candidates home to the fewest first blocks, then sent the fewest uncached tokens."""
        hc, vol = self.home_count, self.volume
        lo = min(hc.get(c, 0) for c in cands)
        cands = [c for c in cands if hc.get(c, 0) == lo]
        v = min(vol.get(c, 0) for c in cands)
        return [c for c in cands if vol.get(c, 0) == v]

    # ------------------------------------------------------------------ bookkeeping
    def record(self, req, d, now=0.0):
        super().record(req, d, now)
        self.volume[d.replica] = self.volume.get(d.replica, 0) + max(req.num_tokens - d.cached_tokens, 0)
        digests = req.digests()
        if not digests:
            return
        if self.home_on:
            self._set_home(digests[0], d.replica)
        self._hold(d.replica, digests)
        self._pending_req[req.request_id] = (d.replica, digests)
        self._prompts[req.request_id] = req

    def _hold(self, replica: str, digests: Sequence[bytes], step: int = 1) -> None:
        counts = self.pending.get(replica)
        if counts is None:
            return
        for g in digests:
            k = counts.get(g, 0) + step
            if k > 0:
                counts[g] = k
            else:
                counts.pop(g, None)

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
        if len(home) > HOME_SIZE:
            _, r = home.popitem(last=False)
            hc[r] = hc.get(r, 0) - 1

    def replied(self, request_id: str, output_token_ids: Sequence[int]) -> None:
        """``request_id`` generated ``output_token_ids`` (before or after :meth:`finished`, while
        its blocks still count; unknown ids are ignored): the blocks of ``prompt +
        output[:-1]``, what its replica caches when it ends, count as held there until
        ``pending_ttl`` after it ended."""
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
        self._hold(rep, more)
        self._pending_req[request_id] = (rep, digests + more)

    def finished(self, request_id, now=0.0, expire=False, output_token_ids=None):
        super().finished(request_id, now, expire)
        if output_token_ids is not None and not expire:
            self.replied(request_id, output_token_ids)
        if request_id in self._pending_req:
            if expire or self.pending_ttl <= 0:
                self._drop_pending(request_id)
            else:
                heapq.heappush(self._expiry, (now + self.pending_ttl, next(self._tick), request_id))

    def _purge(self, now: float) -> None:
        exp = self._expiry
        while exp and exp[0][0] <= now:
            self._drop_pending(heapq.heappop(exp)[2])

    def _drop_pending(self, rid: str) -> None:
        self._prompts.pop(rid, None)
        got = self._pending_req.pop(rid, None)
        if got is not None:
            self._hold(got[0], got[1], -1)

    def stats(self) -> dict:
        out = super().stats()
        out["blocks"] = {r: len(v) for r, v in self.views.items()}
        out["synced"] = {r: v.synced for r, v in self.views.items()}
        out["replies"] = self.replies
        return out
