"""What the engine returns: `RequestOutput` (one per request), `CompletionOutput` (one per sample)
and `RequestMetrics` (timestamps). Shapes follow vLLM's classes of the same names."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, List, Optional

if TYPE_CHECKING:
    from radixkv.cache.outcome import CacheOutcome


@dataclass
class CompletionOutput:
    """One sample of a request.

    Attributes:
        index: sample index in ``[0, n)``.
        text: detokenized output text (truncated before a matched stop string).
        token_ids: generated token ids (the matched stop token id, if any, included).
        finish_reason: ``None`` while running, else ``"stop"`` (EOS, a stop token or a stop
            string), ``"length"`` (max_tokens or the context length reached) or ``"abort"``.
        stop_reason: the stop string or stop token id that ended it, if any.
    """

    index: int
    text: str = ""
    token_ids: List[int] = field(default_factory=list)
    finish_reason: Optional[str] = None
    stop_reason: object = None

    def finished(self) -> bool:
        """True once ``finish_reason`` is set."""
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timestamps of one request in seconds (``time.perf_counter()`` clock).

    Attributes:
        arrival_time: when ``add_request`` accepted it.
        first_scheduled_time: when its prefill was first scheduled.
        first_token_time: when its first output token was sampled (TTFT = this - arrival).
        finished_time: when its last sample finished.
    """

    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    finished_time: Optional[float] = None

    @property
    def ttft(self) -> Optional[float]:
        """Time to first token in seconds, or None before the first token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    """The cumulative state of one request, returned by ``Engine.step`` and ``LLM.generate``.

    Attributes:
        request_id: the id given to / returned by ``add_request``.
        prompt: the prompt text, if it was given as text.
        prompt_token_ids: the prompt's token ids.
        outputs: one ``CompletionOutput`` per sample (``n`` of them).
        finished: True when every sample has finished.
        num_cached_tokens: prompt tokens served from the prefix cache when the request was first
            admitted (the same count as ``cache_stats()["cached_tokens"]``).
        metrics: the request's timestamps.
        cache_outcome: why its prefix match stopped at its first admission
            (:class:`~radixkv.cache.outcome.CacheOutcome`: cause, missed tokens per cause,
            divergence position); None when the engine runs with ``cache_outcome=False``.
    """

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: List[int]
    outputs: List[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics
    cache_outcome: Optional["CacheOutcome"] = None
