"""Output processing: the ``n`` samples of one user request, their stop checks, detokenizing, and
the cumulative :class:`~radixkv.outputs.RequestOutput` the engine returns."""

from __future__ import annotations

from dataclasses import replace
from typing import List, Optional

from radixkv.engine.detokenizer import IncrementalDetokenizer
from radixkv.engine.request import Request
from radixkv.namespace import Namespace
from radixkv.outputs import CACHE_MEDIA, CompletionOutput, PositionLogprobs, RequestMetrics, RequestOutput
from radixkv.sampling.logprobs import TokenDecoder, TokenLogprobs, to_position_logprobs
from radixkv.sampling_params import SamplingParams

__all__ = ["NO_TEXT", "RequestGroup"]

NO_TEXT = TokenDecoder(None)
"""The decoder of a request with ``detokenize=False``: every ``decoded_token`` None."""


class RequestGroup:
    """The ``n`` samples of one user request and what is reported for them.

    Args:
        request_id: the user request's id.
        prompt: its text (reported back), or None.
        prompt_ids: its token ids.
        params: its sampling parameters (``n`` samples).
        namespace: its prefix-cache namespace.
        arrival: ``time.perf_counter()`` when it was accepted.

    Attributes:
        samples: the :class:`~radixkv.engine.request.Request` of each sample once created (sample
            0 at admission, the others when sample 0 forks them).
        outputs: one :class:`~radixkv.outputs.CompletionOutput` per sample, updated in place.
        num_cached_tokens: sample 0's cached prompt tokens at its first admission.
        cached_tokens_by_tier: the same by where they came from (``RequestOutput``'s).
        cache_outcome: sample 0's cache outcome at its first admission (or None).
        counted: whether its prompt has been counted in the engine's hit-rate totals.
        prompt_logprobs: with ``params.prompt_logprobs`` set, one entry per prompt position
            (None until computed, and for position 0 / before ``logprob_start_len``); else None.
        grammar: the ``Future`` of its compiled grammar (structured outputs), or None.
        error: why it failed (finish_reason ``"error"``), or None.
    """

    def __init__(
        self,
        request_id: str,
        prompt: Optional[str],
        prompt_ids: List[int],
        params: SamplingParams,
        namespace: Optional[Namespace],
        arrival: float,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_ids = prompt_ids
        self.params = params
        self.namespace = namespace
        self.metrics = RequestMetrics(arrival_time=arrival)
        self.samples: List[Optional[Request]] = [None] * params.n
        self.outputs = [CompletionOutput(index=i) for i in range(params.n)]
        self._detoks: List[Optional[IncrementalDetokenizer]] = [None] * params.n
        # NOTE: a set, looked up once per generated token (a list of a million ids was a scan each)
        self._stop_ids = frozenset(params.stop_token_ids)
        self.num_cached_tokens = 0
        self.cached_tokens_by_tier = dict.fromkeys(CACHE_MEDIA, 0)
        self.cache_outcome = None
        self.counted = False
        self.prompt_logprobs: Optional[List[Optional[PositionLogprobs]]] = (
            [None] * len(prompt_ids) if params.prompt_logprobs is not None else None
        )
        self.grammar = None
        self.error: Optional[str] = None
        if params.logprobs is not None:
            for o in self.outputs:
                o.logprobs, o.cumulative_logprob = [], 0.0

    @property
    def finished(self) -> bool:
        """True when every sample has a finish reason."""
        return all(o.finish_reason is not None for o in self.outputs)

    def abort(self, reason: str = "abort") -> None:
        """Mark every unfinished sample with finish_reason ``reason`` (``"abort"``, or ``"error"``
        when its processing raised); its text is all it has (nothing held back for a stop string
        any more)."""
        for o, det in zip(self.outputs, self._detoks):
            if o.finish_reason is None:
                o.finish_reason = reason
                if det is not None:
                    o.text = det.text

    def update(
        self,
        r: Request,
        tokenizer,
        eos_token_ids: frozenset,
        max_context_len: int,
        logprobs: Optional[TokenLogprobs] = None,
        decode: Optional[TokenDecoder] = None,
    ) -> bool:
        """Take sample ``r``'s newest token: detokenize it, record its logprobs, and check the
        stop conditions (a stop token or EOS unless ``ignore_eos``, its grammar terminated, a
        stop string once ``min_tokens`` are generated, ``max_tokens``, the context length). A stop
        token's text is left out of ``text`` unless ``include_stop_str_in_output``; ``stop_reason``
        is the ``stop_token_ids`` entry or stop string matched, None for EOS (vLLM's).

        Args:
            r: the sample.
            tokenizer: for the text.
            eos_token_ids: the engine's EOS ids.
            max_context_len: the engine's context limit.
            logprobs: the token's logprobs (when ``params.logprobs`` is set).
            decode: token id -> text for the logprobs' ``decoded_token``.

        Returns:
            True when the sample finished with this token (its output has the finish reason).
        """
        p = r.params
        out = self.outputs[r.index]
        det = self._detoks[r.index]
        if det is None:
            det = self._detoks[r.index] = IncrementalDetokenizer(
                tokenizer if p.detokenize else None, p.stop, p.skip_special_tokens, p.include_stop_str_in_output
            )
        tok = r.output_token_ids[-1]
        if logprobs is not None and out.logprobs is not None:
            decode = (decode or TokenDecoder(tokenizer)) if p.detokenize else NO_TEXT
            out.logprobs.append(to_position_logprobs(logprobs, decode))
            out.cumulative_logprob += logprobs.logprob
        st = r.sampling_state
        terminated = st is not None and st.grammar is not None and st.grammar.terminated
        ids = r.output_token_ids
        reason, stop_reason = None, None
        if tok in self._stop_ids or (not p.ignore_eos and tok in eos_token_ids) or terminated:
            # vLLM's: the stop token stays in token_ids, its text is left out unless
            # include_stop_str_in_output; stop_reason names a stop_token_ids entry (None for EOS)
            reason, stop_reason = "stop", tok if tok in self._stop_ids else None
            # text held back for an incomplete character ends here: a stop string in it still cuts
            if det.stopped_by is None and det.update(ids[:-1], final=True, check_stop=len(ids) - 1 > p.min_tokens):
                stop_reason = det.stopped_by
            elif det.stopped_by is None and p.include_stop_str_in_output:
                det.update(ids, final=True, check_stop=False)
        elif det.update(ids, check_stop=len(ids) > p.min_tokens):  # vLLM v1: after the first min_tokens
            reason, stop_reason = "stop", det.stopped_by
        elif len(ids) >= p.max_tokens or r.seq_len >= max_context_len:
            reason = "length"
            if det.stopped_by is None and det.update(ids, final=True, check_stop=len(ids) > p.min_tokens):
                reason, stop_reason = "stop", det.stopped_by
        out.token_ids = list(r.output_token_ids)
        # NOTE: an unfinished sample shows only the text no stop string can cut off any more
        out.text = det.text if reason is not None else det.settled_text
        if reason is not None:
            out.finish_reason, out.stop_reason = reason, stop_reason
            return True
        return False

    def to_output(self) -> RequestOutput:
        """A fresh cumulative snapshot (callers may keep it; later steps do not change it)."""
        outs = [
            CompletionOutput(
                o.index,
                o.text,
                list(o.token_ids),
                o.finish_reason,
                o.stop_reason,
                None if o.logprobs is None else list(o.logprobs),
                o.cumulative_logprob,
            )
            for o in self.outputs
        ]
        return RequestOutput(
            self.request_id,
            self.prompt,
            list(self.prompt_ids),
            outs,
            self.finished,
            self.num_cached_tokens,
            replace(self.metrics),  # a copy: later steps update the group's own
            None if self.prompt_logprobs is None else list(self.prompt_logprobs),
            cache_outcome=self.cache_outcome,
            error=self.error,
            cached_tokens_by_tier=dict(self.cached_tokens_by_tier),
        )
