"""The engine's per-request cache outcome: one call at admission, fed by the engine's events.

:class:`OutcomeTracker` owns an :class:`~radixkv.cache.outcome.OutcomeClassifier` over the KV
manager's prefix cache, fills its bounded record of evicted blocks from the engine's
:class:`~radixkv.engine.events.CacheEvicted` events (chained 16-token block digests; for a cache
whose evictions cannot name their blocks, the hash cache, from the
:class:`~radixkv.engine.events.CacheInserted` events instead: a block that was cached once and is
not matched now was evicted), and is
called by the scheduler once per user request, when sample 0 is first admitted
(:meth:`OutcomeTracker.on_admit`): the outcome lands on ``Request.cache_outcome``, then on the
``RequestAdmitted`` event and on ``RequestOutput.cache_outcome``. :meth:`OutcomeTracker.explain`
is the dry run behind ``LLM.explain`` (a read-only peek: nothing locked, LRU untouched).

The simulator (:mod:`radixkv.sim`) drives the same tracker over the same KV manager, so an
outcome means the same in a replay as in the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence

from radixkv.cache.outcome import CacheOutcome, OutcomeClassifier
from radixkv.engine.events import CacheEvicted, CacheInserted, CacheReset, Event, EventBus
from radixkv.namespace import Namespace

__all__ = ["OutcomeTracker", "Explanation", "explain_text"]


class OutcomeTracker:
    """Per-request cache outcomes of one engine (module docstring).

    Args:
        cache: the engine's prefix cache (``kv.cache``).
        events: the engine's bus; the tracker subscribes to ``CacheEvicted``.
        max_evicted_blocks: bound of the evicted-block record (16 bytes a block plus a dict
            entry; the default, 65,536 blocks, covers 1M evicted tokens; for the hash cache it
            records inserted blocks, so it covers the last 1M cached tokens).
    """

    def __init__(self, cache: Any, events: EventBus, max_evicted_blocks: int = 1 << 16) -> None:
        self.classifier = OutcomeClassifier(cache, max_evicted_blocks)
        self._by_insert = not hasattr(cache, "evict_listener")  # evictions without digests
        kinds = (CacheInserted if self._by_insert else CacheEvicted, CacheReset)
        self.unsubscribe = events.subscribe(self._on_event, kinds) if cache.shares_prefixes else (lambda: None)

    def _on_event(self, event: Event) -> None:
        if isinstance(event, (CacheEvicted, CacheInserted)):
            self.classifier.record_evicted(event.block_digests)
        elif isinstance(event, CacheReset):  # a flush: what was cached before counts as cold
            self.classifier.evicted.clear()

    def on_admit(self, req: Any, cached: int, running: Iterable[Any]) -> None:
        """Set ``req.cache_outcome`` when sample 0 of a request is about to be admitted for the
        first time (``num_cached_tokens`` still None; other calls do nothing). Called right after
        its prefix is locked, before any eviction for it; an admission that does not go through
        is classified again at the next attempt.

        Args:
            req: the :class:`~radixkv.engine.request.Request` being admitted.
            cached: the prefix length it is admitted on (``Prefix.length``).
            running: the requests already running (concurrent computations).
        """
        if req.index != 0 or req.num_cached_tokens is not None:
            return
        ns = req.namespace
        self.classifier.seen_namespace(ns)
        req.cache_outcome = self.classifier.classify(
            req.prompt_token_ids, ns, cached, ((r.namespace, r.all_token_ids) for r in running if r is not req)
        )

    def explain(
        self, tokens: Sequence[int], namespace: Optional[Namespace] = None, running: Iterable[Any] = ()
    ) -> CacheOutcome:
        """The outcome ``tokens`` would get if admitted now (dry run: a read-only peek)."""
        return self.classifier.classify(
            list(tokens), namespace, None, ((r.namespace, r.all_token_ids) for r in running)
        )


@dataclass(frozen=True)
class Explanation:
    """``LLM.explain``'s answer: the cache outcome of a prompt if it were sent now, and the text
    around the place its match stops.

    Attributes:
        outcome: the :class:`~radixkv.cache.outcome.CacheOutcome`.
        prompt_token_ids: the prompt's token ids.
        stop_pos: the position the match stops at (``diverge_pos`` when the prompt diverged from
            a cached sequence, else ``num_cached_tokens``).
        before: decoded prompt text of the ``context`` tokens before ``stop_pos`` (shared).
        prompt_side: decoded prompt text of the ``context`` tokens from ``stop_pos`` on.
        cached_side: decoded text of what the cache holds from ``stop_pos`` on (empty when no
            cached sequence continues there, or the cache cannot tell).
    """

    outcome: CacheOutcome
    prompt_token_ids: list
    stop_pos: int
    before: str
    prompt_side: str
    cached_side: str

    @property
    def cause(self) -> str:
        """The outcome's cause."""
        return self.outcome.cause

    def __str__(self) -> str:
        o = self.outcome
        lines = [
            f"cause {o.cause} ({o.cause_meaning}): {o.num_cached_tokens} of {o.num_prompt_tokens} prompt tokens "
            f"cached, missed {o.missed}",
            f"match stops at token {self.stop_pos}",
            f"  shared : {self.before!r}",
            f"  prompt : {self.prompt_side!r}",
        ]
        if self.cached_side:
            lines.append(f"  cached : {self.cached_side!r}")
        if o.tier_spans:
            spans = ", ".join(f"{m} [{a}, {b})" for a, b, m in o.tier_spans)
            lines.append(f"  KV tiers hold {spans} (loaded instead of computed when cheaper)")
        return "\n".join(lines)


def explain_text(outcome: CacheOutcome, tokens: Sequence[int], tokenizer: Any, context: int = 16) -> Explanation:
    """Wrap ``outcome`` with the decoded text around its stop position (``tokenizer.decode``;
    without a tokenizer the texts are the token ids' ``repr``)."""
    stop = outcome.diverge_pos if outcome.diverge_pos is not None else outcome.num_cached_tokens

    def dec(ids: Sequence[int]) -> str:
        ids = list(ids)
        if tokenizer is None:
            return repr(ids)
        return tokenizer.decode(ids, skip_special_tokens=False)

    tokens = list(tokens)
    return Explanation(
        outcome,
        tokens,
        stop,
        dec(tokens[max(0, stop - context) : stop]),
        dec(tokens[stop : stop + context]),
        dec(outcome.cached_next) if outcome.cached_next else "",
    )
