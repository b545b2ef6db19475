"""`Drafter`: the draft tokens of each decoding request, from what the engine already holds.

Sources, for a request whose sequence so far is ``S`` (prompt + output):

1. ``"radix"`` only: the radix tree. When all of ``S`` is a cached path of the request's
   namespace (a regenerated request, a replayed conversation, a sibling that finished), the
   tree's next tokens are the draft (:meth:`PrefixCache.peek <radixkv.cache.base.PrefixCache.peek>`:
   read-only, nothing locked, no access time refreshed). A request whose sequence left the tree
   looks again only every :data:`TREE_RETRY` steps.
2. Prompt lookup (both methods): the last ``prompt_lookup_min`` tokens of ``S`` found earlier in
   ``S`` (:class:`~radixkv.spec.ngram.NgramIndex`).
3. Siblings (both methods): the same lookup in the sequences of the other decoding requests of
   the namespace with the same prompt (the samples of an ``n > 1`` request, forks of a session).
4. ``"radix"`` only: the cross-request :class:`~radixkv.spec.suffix.SuffixIndex` of recently
   finished sequences of the namespace.

The tree's continuation wins (it agrees with all of ``S``); among the lookups the longest match
wins (:func:`~radixkv.spec.ngram.best_continuation`). Every source is read in the request's own
namespace only, so an accepted draft never reveals another tenant's text. With a structured output
the draft is cut where the grammar refuses it and extended by the tokens the grammar forces
(:func:`~radixkv.spec.grammar_drafts.grammar_draft`).

How many tokens: per request, :class:`~radixkv.spec.adaptive.Acceptance` (the cost model, at the
row cost :func:`~radixkv.spec.adaptive.row_cost_at` gives for the step's decode rows) unless
``adaptive`` is off, capped by ``num_speculative_tokens``, by what ``max_tokens`` and the context
length leave, and by ``max_draft_tokens_per_step`` over the whole step (the requests with the best
acceptance rate first). A sample of an ``n > 1`` request that is more than
``num_speculative_tokens`` output tokens ahead of its slowest decoding sibling drafts nothing that
step: the request ends with its slowest sample, so rows that speed up a sample already ahead only
cost (each verify row is a full row of multiply-adds once the forward is compute-bound, as it is
with several samples), while the slow samples go on drafting.

Requests are read by attribute (``prompt_token_ids``, ``output_token_ids``, ``namespace``,
``params``, ``sampling_state``); the drafter sets ``draft_tokens`` and keeps its per-request state
in ``spec_state``; this package does not import the engine.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Dict, List, Optional, Sequence

from radixkv.spec.adaptive import Acceptance, row_cost_at
from radixkv.spec.config import SpeculativeConfig
from radixkv.spec.grammar_drafts import grammar_draft_split
from radixkv.spec.ngram import NgramIndex, best_continuation
from radixkv.spec.suffix import SuffixIndex

__all__ = ["Drafter", "SpecState", "TREE_RETRY"]

TREE_RETRY = 16
"""Decode steps before a request whose sequence left the radix tree looks it up again."""


class SpecState:
    """A request's drafting state (``Request.spec_state``).

    Attributes:
        own: the :class:`~radixkv.spec.ngram.NgramIndex` of its sequence.
        acceptance: the :class:`~radixkv.spec.adaptive.Acceptance` of its looked-up drafts
            (tree, lookups).
        forced: the :class:`~radixkv.spec.adaptive.Acceptance` of the tokens its grammar forced.
        n_free: how many of its last draft's tokens were looked up (the rest were forced).
        prompt_key: ``(len, hash)`` of its prompt (siblings share it).
        tree_wait: decode steps to skip before the next radix tree lookup.
    """

    __slots__ = ("own", "acceptance", "forced", "n_free", "prompt_key", "tree_wait")

    def __init__(self, key_len: int, prompt: Sequence[int]) -> None:
        self.own = NgramIndex(key_len)
        self.acceptance = Acceptance()
        self.forced = Acceptance()
        self.n_free = 0
        self.prompt_key = (len(prompt), hash(tuple(prompt)))
        self.tree_wait = 0


class Drafter:
    """Drafts for the decoding requests of one engine (module docstring).

    Args:
        config: the :class:`~radixkv.spec.config.SpeculativeConfig`.
        cache: the engine's prefix cache (its ``peek``), read only for ``"radix"``.
        encode: text -> token ids (the tokenizer, no special tokens), for the text a grammar
            forces (:func:`~radixkv.spec.grammar_drafts.grammar_draft`); None: xgrammar's split.

    Attributes:
        suffix: the cross-request :class:`~radixkv.spec.suffix.SuffixIndex` (None for
            ``"ngram"`` or ``suffix_index_tokens=0``).
        num_draft_tokens, num_accepted_tokens: totals over every verify so far.
        failed: request id -> what its drafting raised in this step (:meth:`take_failed`).
    """

    def __init__(self, config: SpeculativeConfig, cache: Any = None, encode: Any = None) -> None:
        self.config = config
        self.encode = encode
        radix = config.method == "radix"
        self.cache = cache if radix else None
        self.suffix: Optional[SuffixIndex] = None
        if radix and config.suffix_index_tokens > 0:
            self.suffix = SuffixIndex(config.prompt_lookup_min, config.suffix_index_tokens)
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.failed: Dict[str, BaseException] = {}  # request id -> what its drafting raised

    def state(self, req: Any) -> SpecState:
        """``req``'s :class:`SpecState` (made at its first use)."""
        st = req.spec_state
        if st is None:
            st = req.spec_state = SpecState(self.config.prompt_lookup_min, req.prompt_token_ids)
        return st

    # ------------------------------------------------------------------ proposing
    def propose(self, reqs: Sequence[Any], max_context_len: int) -> None:
        """Set ``draft_tokens`` of each of ``reqs`` (the decoding requests; an empty list when it
        does not draft this step)."""
        cfg = self.config
        wants = []
        slowest = _slowest_sibling(reqs) if len(reqs) > 1 else {}
        cost = row_cost_at(cfg.draft_row_cost, len(reqs))
        for r in reqs:
            r.draft_tokens = []
            st = self.state(r)
            behind = slowest.get(r.request_id)
            if behind is not None:  # a sample of an n > 1 request: its siblings draft from its index
                st.own.sync(r.prompt_token_ids, r.output_token_ids)
                if len(r.output_token_ids) > behind + cfg.num_speculative_tokens:
                    continue  # its request waits for a slower sample: rows for this one buy nothing
            room = min(
                r.params.max_tokens - len(r.output_token_ids) - 1,
                max_context_len - len(r.prompt_token_ids) - len(r.output_token_ids) - 1,
            )
            cap = min(cfg.num_speculative_tokens, room)
            if cap <= 0:
                continue
            k = st.acceptance.draft_len(cap, cost) if cfg.adaptive else cap
            try:
                kf = self._forced_len(r, st, cap, cost)  # asks its grammar matcher
            except Exception as exc:  # noqa: BLE001 - it fails alone (take_failed)
                self.failed.setdefault(r.request_id, exc)
                continue
            if k > 0 or kf > 0:
                st.own.sync(r.prompt_token_ids, r.output_token_ids)
                wants.append((st.acceptance.rate, (k, kf, cap), r, st))
        if not wants:
            return
        wants.sort(key=lambda w: -w[0])  # stable: the best acceptance rate drafts first
        peers = self._peers(reqs) if len(reqs) > 1 else {}
        budget = cfg.max_draft_tokens_per_step
        for _, (k, kf, cap), r, st in wants:
            if budget <= 0:
                break
            siblings = [p for p in peers.get((r.namespace, st.prompt_key), ()) if p is not st]
            try:
                draft = self._draft(r, st, (k, kf, min(cap, budget)), siblings)
            except Exception as exc:  # noqa: BLE001 - its grammar matcher (or a source) raised: it fails alone
                self.failed.setdefault(r.request_id, exc)
                continue
            r.draft_tokens = draft
            budget -= len(draft)

    def take_failed(self) -> Dict[str, BaseException]:
        """Request id -> what its drafting raised in the last :meth:`propose` (its grammar
        matcher, or a source); the engine ends those requests with finish_reason ``"error"``,
        as when their row's sampling raises, so one request's fault never stops the step."""
        failed, self.failed = self.failed, {}
        return failed

    def _forced_len(self, r: Any, st: SpecState, cap: int, cost: float) -> int:
        """Forced tokens worth drafting for ``r`` now (0 without an active grammar or with
        ``grammar_drafts`` off): its own adaptive length, apart from its looked-up drafts', so
        a request whose free text is never guessed still drafts the keys and punctuation its
        grammar forces."""
        gs = r.sampling_state.grammar if r.sampling_state is not None else None
        if gs is None or gs.terminated or not self.config.grammar_drafts:
            return 0
        return st.forced.draft_len(cap, cost) if self.config.adaptive else cap

    def _peers(self, reqs: Sequence[Any]) -> Dict[tuple, List[SpecState]]:
        """The decoding requests' states grouped by (namespace, prompt)."""
        groups: Dict[tuple, List[SpecState]] = defaultdict(list)
        for r in reqs:
            st = r.spec_state
            if st is not None:
                groups[(r.namespace, st.prompt_key)].append(st)
        return groups

    def _draft(self, r: Any, st: SpecState, lens: tuple, siblings: List[SpecState]) -> List[int]:
        """``r``'s draft (module docstring's sources, then its grammar); ``lens`` is ``(k,
        k_forced, cap)``: up to ``k`` looked-up tokens, then up to ``k_forced`` forced ones, at
        most ``cap`` in all. Sets ``st.n_free``."""
        k, kf, cap = lens
        k = min(k, cap)
        seq = st.own.tokens
        draft: List[int] = []
        if k > 0:
            draft = self._tree(r, st, seq, k) if self.cache is not None else []
            if not draft:
                draft = self._lookup(r, st, seq, k, siblings)
        draft = draft[:k]
        st.n_free = len(draft)
        gs = r.sampling_state.grammar if r.sampling_state is not None else None
        if gs is not None:
            if gs.terminated:
                st.n_free = 0
                return []
            draft, st.n_free = grammar_draft_split(gs.matcher, draft, k, kf, cap, self.encode)
        return draft

    def _tree(self, r: Any, st: SpecState, seq: List[int], k: int) -> List[int]:
        """The radix tree's continuation of all of ``seq`` (empty when it is not a cached path)."""
        if st.tree_wait > 0:
            st.tree_wait -= 1
            return []
        peek = self.cache.peek(seq, r.namespace, context=k)
        if peek.token_length == len(seq) and peek.next_tokens:
            return [int(t) for t in peek.next_tokens[:k]]
        st.tree_wait = TREE_RETRY
        return []

    def _lookup(self, r: Any, st: SpecState, seq: List[int], k: int, siblings: List[SpecState]) -> List[int]:
        """The best prompt-lookup draft: own sequence, siblings', then the suffix index."""
        key = st.own.suffix_key()
        if key is None:
            return []
        sources = [(seq, st.own.ends(key))]
        for p in siblings:
            ends = p.own.ends(key)
            if ends:
                sources.append((p.own.tokens, ends))
        match, draft = best_continuation(seq, sources, k, self.config.prompt_lookup_max)
        if self.suffix is not None and match < self.config.prompt_lookup_max:
            m2, d2 = self.suffix.lookup(r.namespace, seq, k, self.config.prompt_lookup_max)
            if (m2, len(d2)) > (match, len(draft)):
                draft = d2
        return draft

    # ------------------------------------------------------------------ results
    def observe(self, req: Any, drafted: int, accepted: int, rejected: bool) -> None:
        """A verify of ``req`` ran: ``drafted`` tokens, ``accepted`` of them taken, ``rejected``
        whether a draft token was compared and refused (False when all were taken or the
        request stopped first)."""
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        st = self.state(req)
        free = min(st.n_free, drafted)
        st.acceptance.update(free, min(accepted, free), rejected and accepted < free)
        if accepted >= free:  # the forced tokens were compared too
            st.forced.update(drafted - free, accepted - free, rejected)

    def reset(self) -> None:
        """The prefix cache was flushed: the suffix index forgets the finished sequences too, so
        no draft (and no timing) after a flush comes from text that ran before it."""
        if self.suffix is not None:
            self.suffix.clear()

    def on_finished(self, req: Any) -> None:
        """``req`` finished: its sequence (verified tokens only) joins the suffix index."""
        if self.suffix is not None:
            self.suffix.add(req.namespace, req.prompt_token_ids + req.output_token_ids)


def _slowest_sibling(reqs: Sequence[Any]) -> Dict[str, int]:
    """Request id -> the fewest output tokens among its decoding samples, for the requests with
    two or more of them in ``reqs`` (the samples of an ``n > 1`` request)."""
    low: Dict[str, int] = {}
    count: Dict[str, int] = defaultdict(int)
    for r in reqs:
        n = len(r.output_token_ids)
        count[r.request_id] += 1
        if n < low.get(r.request_id, n + 1):
            low[r.request_id] = n
    return {rid: n for rid, n in low.items() if count[rid] > 1}
