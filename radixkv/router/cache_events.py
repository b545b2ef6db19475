"""``cache_events``, radixkv's routing policy: the longest *exactly* cached prefix, from the
replicas' events, weighed against load. Rule (docs/routing.md has the measurements behind it): for
each replica ``r`` with ``h_r`` cached prompt tokens (its event-fed view, plus the prompt blocks
of requests this router sent it that have not finished ``pending_ttl`` seconds ago, because their
events may not have arrived yet), queued prefill tokens ``W_r`` and ``L_r`` outstanding requests::

    cost_r = (n - h_r) + load_weight * (W_r + request_tokens * L_r)

the replica of least cost wins (ties: fewer outstanding requests, then more held tokens, then at
random); ``n - h_r`` is the prefill it would compute, the second term the work queued ahead of it
in the same units (tokens of prefill; ``request_tokens`` prices one request's decode). SGLang's
balance guard bounds the pile-up on one hot prefix: a replica with ``L_r - L_min >
balance_abs_threshold`` and ``L_r > balance_rel_threshold * L_min`` is not a candidate. Two
refinements: a request whose deepest cached block (over all replicas) was also the deepest cached
block of more than ``hot_share`` of the last ``hot_window`` requests shares a *hot* prefix (a
few-shot preamble, the system prompt of new conversations): computing it once more on another
replica is cheap against the traffic it serves there, so its outstanding requests are priced at
``hot_request_tokens`` (the load decides, join-the-shortest-queue like), and the hot prefix counts
as cached on every candidate (``hot_everywhere``, on since 2026-12-03: a replica lacking it is not
kept out of the hot traffic by one prefill of it). A request cached nowhere (``miss_home``, on)
goes *home*: to the replica its first block was last routed to (the router remembers, for the last
``home_size`` first blocks, where it sent each; it never forgets a prefix because the replica
evicted it, as SGLang's approximate trees do not); a first block never seen goes among the
replicas that are home to the fewest first blocks, then those sent the fewest uncached prompt
tokens so far, so the distinct prefixes partition evenly. Three more (on since 2026-12-02 evening;
docs/routing.md has the measurements): ``reply_record``: a finished request's ``prompt +
output[:-1]`` (what its replica inserts when it ends; the serving layer passes the output token
ids to :meth:`CacheEvents.finished` or :meth:`CacheEvents.replied`) counts as held there at once,
so a conversation's next turn sent before the replica's events arrive follows its reply;
``tail_credit``: for a hot request, the tokens past its held blocks that a held block this router
sent the same replica after the same prefix shares with it (16-token blocks hide shorter overlaps,
which the token-level tree still serves; a block in the view is whole, so its every token is
cached) count as cached, so among equally loaded replicas the one holding more of it wins;
``residual``: a replica's oldest outstanding request (the running one, FIFO assumed) counts as the
share of a mean request it has left, from the mean residual life of the durations seen
(:meth:`CacheEvents._left`), so the load term of hot requests prefers the replica about to be
free. And one for a conversation's next turn (on since 2026-12-03; ``turn_tokens``,
``turn_slack``): a request whose deepest held block ends a reply this router recorded
(:meth:`CacheEvents.replied`) pays, on a replica with more than ``turn_slack`` outstanding
requests above the candidates' mean ``m``, ``turn_tokens * (L_r - m - turn_slack)**2`` tokens
more: a short history leaves a replica whose queue its own conversations keep full (each reply
there releases the next turn there at once), a long one stays, since recomputing it costs more.
And one for one-shot traffic (on since 2026-12-03 noon; ``one_shot_credit``, ``one_shot_share``):
a hot request whose first block's replies are seldom followed by a next turn (a few-shot preamble,
not a chat's system prompt) gets, on the replicas with the fewest outstanding requests,
``one_shot_credit`` tokens per token of its sub-block rest beyond the least any candidate holds:
where such a request goes commits nothing later, so among replicas equal in queue length the few
tokens it shares with earlier questions decide (against the residual-time estimate that would
otherwise); a conversation's start stays placed by load, since its later turns follow it. Optional
(``miss_by_volume``, off: measured worse on gsp without the home rule): a request cached nowhere
goes among the replicas sent the fewest uncached prompt tokens so far (SGLang's "smallest tree").

KV tiers (``tier_weight``, docs/tiers.md): the blocks after a replica's held ones that a KV tier
holds for it (its own host or disk tier, or the ``remote`` tier every replica shares, from the
replicas' tier insert records) cost ``tier_weight`` of a missed token each (default 0.25: loading
is cheaper than recomputing, dearer than a local hit), so ``n - h_r`` becomes
``n - h_r - t_r + tier_weight * t_r``.

Pure Python and torch-free, as every policy (:mod:`radixkv.router.policy`); the replicas' views
come from :mod:`radixkv.router.index`.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections import OrderedDict, deque
from typing import Optional, Sequence

from radixkv.cache.digests import BLOCK_TOKENS, block_digests
from radixkv.router.base import Decision, Policy, RouteRequest
from radixkv.router.index import CacheView

__all__ = ["CacheEvents"]


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
            next turn can be told to follow) and next turns routed, at least ``hot_min`` are
            replies to requests with its first block, and that block's next turns number under
            ``one_shot_share`` of them.
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
        tier_weight: cost of a prompt token a KV tier holds for a replica (its host or disk
            tier, or the shared remote tier), per token of a miss (1: the tiers do not count; 0:
            as a local hit).
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
        tier_weight: float = 0.25,
    ) -> None:
        super().__init__(seed)
        self.tier_weight = tier_weight
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
        cap = max(n - 1, 0)  # the prompt's last token is never served from the cache
        # a hot prefix counts as held on every candidate (hot_everywhere): computed once where it
        # is missing, it then serves that replica's share of the traffic
        floor = min(deepest * BLOCK_TOKENS, cap) if hot and self.hot_everywhere else 0
        best_key, ties = None, []
        tiered = self._tiered(digests, held, cands) if self.tier_weight < 1 else None
        for c in cands:
            h = min(held[c] * BLOCK_TOKENS + (tail[c] if tail else 0), cap)
            ld = self.loads[c]
            reqs = self._outstanding(c, now) if rt else ld.requests
            hc = max(h, floor)
            cost = (n - hc) + self.load_weight * (ld.prefill_tokens + rt * reqs)
            if tiered:  # tokens a KV tier holds after what the pool holds: cheaper than a miss
                cost -= (1.0 - self.tier_weight) * max(0, min(tiered[c] * BLOCK_TOKENS, cap) - hc)
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
