"""What the engine returns: `RequestOutput` (one per request), `CompletionOutput` (one per sample),
`Logprob` and `RequestMetrics` (timestamps). Shapes follow vLLM's classes of the same names."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

if TYPE_CHECKING:
    from radixkv.cache.outcome import CacheOutcome

CACHE_MEDIA = ("device", "host", "disk", "remote")
"""Where a reused prompt token came from: the KV pool (``device``) or a KV tier below it; the keys
of :attr:`RequestOutput.cached_tokens_by_tier`."""


@dataclass
class Logprob:
    """The log-probability of one token at one position (vLLM's ``Logprob``).

    Attributes:
        logprob: natural-log probability under the raw model distribution (``log_softmax`` of the
            model's logits, before grammar masks, biases, penalties and temperature).
        rank: 1 + the number of tokens with a strictly higher logprob at that position (the most
            likely token has rank 1).
        decoded_token: the token's text on its own (``tokenizer.decode([id])``, special tokens
            kept; a token that is part of a multi-byte character decodes to U+FFFD), or None
            without a tokenizer.
    """

    logprob: float
    rank: int
    decoded_token: Optional[str] = None


PositionLogprobs = Dict[int, Logprob]
"""Token id -> :class:`Logprob` at one position: the actual (sampled / prompt) token first, then
the top-k alternatives in rank order (the actual token appears once)."""


@dataclass
class CompletionOutput:
    """One sample of a request.

    Attributes:
        index: sample index in ``[0, n)``.
        text: detokenized output text (truncated before a matched stop string; without the text
            of the stop token it ended on, EOS or a ``stop_token_ids`` entry; both kept with
            ``SamplingParams.include_stop_str_in_output``, as in vLLM).
        token_ids: generated token ids (the matched stop token id, if any, included).
        finish_reason: ``None`` while running, else ``"stop"`` (EOS, a stop token or a stop
            string), ``"length"`` (max_tokens or the context length reached), ``"abort"`` or
            ``"error"`` (its sampling raised; ``RequestOutput.error`` says what).
        stop_reason: the stop string or ``stop_token_ids`` entry that ended it; None when it
            ended otherwise, EOS included (vLLM's).
        logprobs: with ``SamplingParams.logprobs`` set, one :data:`PositionLogprobs` per token
            of ``token_ids`` (the sampled token plus ``logprobs`` alternatives); else None.
        cumulative_logprob: with ``logprobs`` set, the sum of the sampled tokens' logprobs;
            else None.
    """

    index: int
    text: str = ""
    token_ids: List[int] = field(default_factory=list)
    finish_reason: Optional[str] = None
    stop_reason: object = None
    logprobs: Optional[List[PositionLogprobs]] = None
    cumulative_logprob: Optional[float] = None

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
        spec_draft_tokens: draft tokens its samples verified (speculative decoding; 0 when off).
        spec_accepted_tokens: those of them accepted: each is a token that cost no forward of
            its own (tokens per forward = 1 + accepted / verifies).
    """

    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0

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
        prompt_logprobs: with ``SamplingParams.prompt_logprobs`` set, one entry per prompt
            position: None for position 0 and for positions before ``logprob_start_len``, else
            the prompt token's :data:`PositionLogprobs` (plus ``prompt_logprobs``
            alternatives); filled once the prompt's prefill has run. None when not asked for.
        cache_outcome: why its prefix match stopped at its first admission
            (:class:`~radixkv.cache.outcome.CacheOutcome`: cause, missed tokens per cause,
            divergence position); None when the engine runs with ``cache_outcome=False``.
        error: when its sampling, logits processing, grammar or output processing raised (its
            samples end with finish_reason ``"error"``; the other requests of the batch go on),
            ``"<exception type>: <message>"``; else None.
        cached_tokens_by_tier: ``num_cached_tokens`` by where they came from, a plain dict of
            ints with the keys ``device`` (the KV pool: cached, or shared with a request computing
            them in the same forward), ``host``, ``disk`` and ``remote`` (the KV tiers,
            docs/tiers.md); its values sum to ``num_cached_tokens``.
    """

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: List[int]
    outputs: List[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics
    prompt_logprobs: Optional[List[Optional[PositionLogprobs]]] = None
    cache_outcome: Optional["CacheOutcome"] = None
    error: Optional[str] = None
    cached_tokens_by_tier: Dict[str, int] = field(default_factory=lambda: dict.fromkeys(CACHE_MEDIA, 0))


def ended_early(out: RequestOutput) -> bool:
    """Whether ``out`` is the final output of a request that did not run to its end: aborted (a
    sample with finish_reason ``"abort"``) or failed (``error`` set). A caller's finish hook
    (``generate_batch``'s ``on_finish``: a session's turn, a stored Response) does not run for it."""
    return out.finished and (out.error is not None or any(c.finish_reason == "abort" for c in out.outputs))


def delta_output(out: RequestOutput, sent: Dict[int, Tuple[int, int, bool]]) -> Optional[RequestOutput]:
    """``out`` (a cumulative snapshot) as a delta (vLLM's ``RequestOutputKind.DELTA``): each
    sample's ``token_ids``, ``text`` and ``logprobs`` past what ``sent`` says was yielded for it
    (``sent[index] = (tokens, characters, finished)``, updated here), only the samples with
    something new or that finished since; ``prompt_logprobs`` in the first delta alone;
    ``cumulative_logprob`` stays the sum so far, as vLLM's. None: nothing new (no delta to
    yield). A sample's text only grows between snapshots (a stop string is held back until it
    is ruled out, never taken back), so slicing it by length is exact."""
    first = not sent
    outputs = []
    for c in out.outputs:
        tokens, chars, done = sent.get(c.index, (0, 0, False))
        if len(c.token_ids) == tokens and len(c.text) == chars and c.finished() == done:
            continue
        lp = None if c.logprobs is None else c.logprobs[tokens:]
        outputs.append(replace(c, text=c.text[chars:], token_ids=c.token_ids[tokens:], logprobs=lp))
        sent[c.index] = (len(c.token_ids), len(c.text), c.finished())
    if not outputs and not (first or out.finished):
        return None
    return replace(out, outputs=outputs, prompt_logprobs=out.prompt_logprobs if first else None)
