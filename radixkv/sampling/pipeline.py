"""`SamplingPipeline`: the one entry point from a step's logits to its tokens and logprobs.

:meth:`SamplingPipeline.step` runs once per engine step:

1. raw logprobs of the rows that asked for them (``log_softmax`` of the model's logits),
2. the grammar bitmask of the constrained rows only (:mod:`radixkv.sampling.grammar`),
3. logit_bias and min_tokens, then the repetition / frequency / presence penalties
   (:mod:`radixkv.sampling.processors`),
4. temperature, top-k, top-p, min-p and the draw (:mod:`radixkv.sampling.sampler`),
5. each constrained row's matcher advances on its token; the sampled tokens' logprobs and ranks,
6. prompt logprobs of the prompt rows the forward computed logits for.

A step in which no row uses a processor, a grammar or logprobs (and no prompt logprobs are due)
goes straight to the sampler: the default path costs one flag test per row.

Per-sample state (:class:`SampleState`: the grammar matcher, cached bias / stop-id tensors and
the prompt's token mask) lives on the sample (``Request.sampling_state``); rows are read by
attribute (``params``, ``generator``, ``prompt_token_ids``, ``output_token_ids``,
``sampling_state``), so this package does not import the engine.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, List, NamedTuple, Optional, Sequence

import torch

from radixkv.sampling import processors
from radixkv.sampling.grammar import GrammarState, accept_tokens, apply_token_bitmask, batch_matcher, fill_bitmasks
from radixkv.sampling.logprobs import TokenLogprobs, token_logprobs
from radixkv.sampling.sampler import sample
from radixkv.sampling_params import SamplingParams

__all__ = ["PromptSegment", "SampleState", "SamplingPipeline", "StepResult"]

logger = logging.getLogger(__name__)


class SampleState:
    """Sampling state of one sample (``Request.sampling_state``), built by
    :meth:`SamplingPipeline.new_state`.

    Attributes:
        grammar: its :class:`~radixkv.sampling.grammar.GrammarState`, or None (unconstrained).
        bias_ids, bias_values: ``logit_bias`` as int64 / float32 tensors (None without).
        stop_ids: int64 tensor of the tokens ``min_tokens`` masks (EOS unless ``ignore_eos``,
            and ``stop_token_ids``), or None when ``min_tokens`` is 0.
        prompt_mask: ``[V]`` bool tensor of the prompt's tokens (repetition penalty), built on
            first use.
    """

    __slots__ = ("grammar", "bias_ids", "bias_values", "stop_ids", "prompt_mask")

    def __init__(self) -> None:
        self.grammar: Optional[GrammarState] = None
        self.bias_ids: Optional[torch.Tensor] = None
        self.bias_values: Optional[torch.Tensor] = None
        self.stop_ids: Optional[torch.Tensor] = None
        self.prompt_mask: Optional[torch.Tensor] = None


class PromptSegment(NamedTuple):
    """Prompt rows of one request in a forward: ``n`` consecutive logits rows from ``row``, the
    logits of prompt positions ``first .. first + n - 1``, which score the prompt tokens
    ``targets`` (positions ``first + 1 ..``), each with ``k`` alternatives."""

    row: int
    n: int
    first: int
    targets: List[int]
    k: int


class StepResult(NamedTuple):
    """What one step sampled: ``tokens`` (one per sampling row); ``logprobs`` (per row a
    :class:`~radixkv.sampling.logprobs.TokenLogprobs`, or None when the row did not ask); and
    per prompt segment its positions' :class:`TokenLogprobs`."""

    tokens: List[int]
    logprobs: List[Optional[TokenLogprobs]]
    prompt_logprobs: List[List[TokenLogprobs]]


class SamplingPipeline:
    """Logits -> tokens for one engine (module docstring).

    Args:
        vocab_size: the logits width ``V``.
        eos_token_ids: the engine's EOS ids (``min_tokens`` masks them unless ``ignore_eos``).
    """

    def __init__(self, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        self.vocab_size = int(vocab_size)
        self.eos_token_ids = sorted(int(t) for t in eos_token_ids)
        self._bitmask: Optional[torch.Tensor] = None
        self._batch: Any = None  # xgrammar.BatchGrammarMatcher, built at the first constrained step

    def new_state(self, params: SamplingParams, grammar: Optional[GrammarState] = None) -> Optional[SampleState]:
        """The :class:`SampleState` of a new sample, or None when it needs none (no grammar, no
        processor)."""
        if grammar is None and not params._uses_processors:
            return None
        st = SampleState()
        st.grammar = grammar
        if params.logit_bias:
            st.bias_ids = torch.tensor(list(params.logit_bias.keys()), dtype=torch.int64)
            st.bias_values = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32)
        if params.min_tokens > 0:
            ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
            ids = sorted(t for t in ids if t < self.vocab_size)
            st.stop_ids = torch.tensor(ids, dtype=torch.int64) if ids else None
        return st

    def _bitmask_rows(self, n: int) -> torch.Tensor:
        words = (self.vocab_size + 31) // 32
        if self._bitmask is None or self._bitmask.shape[0] < n:
            self._bitmask = torch.empty(max(n, 16), words, dtype=torch.int32)
        return self._bitmask

    def step(
        self,
        logits: torch.Tensor,
        rows: Sequence[Any],
        default_generator: Optional[torch.Generator] = None,
        sample_index: Optional[Sequence[int]] = None,
        prompt_segments: Sequence[PromptSegment] = (),
    ) -> StepResult:
        """Sample one token per row (module docstring has the order of operations).

        Args:
            logits: ``[S, V]`` float32 logits of the forward (modified in place).
            rows: the sampling rows (requests), one per sampled token.
            default_generator: generator of unseeded rows.
            sample_index: the logits row of each of ``rows`` (default: row ``i`` is ``logits[i]``).
            prompt_segments: prompt rows to score (:class:`PromptSegment`).

        Returns:
            A :class:`StepResult`.

        Raises:
            RuntimeError: a constrained row's grammar refused its sampled token (a bug: the mask
                allows only grammatical tokens).
        """
        with torch.inference_mode():  # the forward's logits are inference tensors
            return self._step(logits, rows, default_generator, sample_index, prompt_segments)

    def _step(self, logits, rows, default_generator, sample_index, prompt_segments) -> StepResult:
        prompt_lps = [self._prompt_logprobs(logits, seg) for seg in prompt_segments]
        if sample_index is not None:
            x = logits.index_select(0, torch.as_tensor(list(sample_index), dtype=torch.int64, device=logits.device))
        else:
            x = logits
        params = [r.params for r in rows]
        gens = [r.generator for r in rows]
        if not any(p._needs_pipeline for p in params):
            return StepResult(sample(x, params, gens, default_generator), [None] * len(rows), prompt_lps)

        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw = x[lp_rows] if lp_rows else None  # a copy: the model's logits before any mask
        states = [r.sampling_state for r in rows]
        grammar_rows = [i for i, st in enumerate(states) if st is not None and st.grammar is not None]
        if grammar_rows:
            bm = self._bitmask_rows(x.shape[0])
            if self._batch is None and len(grammar_rows) > 1:
                self._batch = batch_matcher()
            fill_bitmasks([states[i].grammar for i in grammar_rows], bm, grammar_rows, self._batch)
            apply_token_bitmask(x, bm, grammar_rows)  # the kernel skips all-allowed words
        self._apply_processors(x, rows, params, states, grammar_rows)
        tokens = sample(x, params, gens, default_generator)
        if grammar_rows:
            ok = accept_tokens([states[i].grammar for i in grammar_rows], [tokens[i] for i in grammar_rows])
            for i, accepted in zip(grammar_rows, ok):
                if not accepted:  # the draw left the mask (no finite probability): best allowed token
                    t = _best_allowed(x[i], bm[i])
                    if t is None or not states[i].grammar.accept(t):  # the grammar allows nothing
                        logger.warning("grammar of %r accepts no token; the request stops here", rows[i])
                        states[i].grammar.stuck = True  # finishes with "stop" on this step
                        t = self.eos_token_ids[0] if self.eos_token_ids else tokens[i]
                    tokens[i] = t
        logprobs: List[Optional[TokenLogprobs]] = [None] * len(rows)
        if lp_rows:
            got = token_logprobs(raw, [tokens[i] for i in lp_rows], [params[i].logprobs for i in lp_rows])
            for i, e in zip(lp_rows, got):
                logprobs[i] = e
        return StepResult(tokens, logprobs, prompt_lps)

    def _apply_processors(self, x, rows, params, states, grammar_rows) -> None:
        bias_rows, bias_ids, bias_vals = [], [], []
        min_rows, min_ids = [], []
        pen_rows = []
        for i, (p, st) in enumerate(zip(params, states)):
            if not p._uses_processors or st is None:
                continue
            if st.bias_ids is not None:
                bias_rows.append(i)
                bias_ids.append(st.bias_ids)
                bias_vals.append(st.bias_values)
            if st.stop_ids is not None and len(rows[i].output_token_ids) < p.min_tokens:
                min_rows.append(i)
                min_ids.append(st.stop_ids)
            if p._uses_penalties:
                pen_rows.append(i)
        processors.apply_logit_bias(x, bias_rows, bias_ids, bias_vals)
        if min_rows:
            # a grammar that allows only EOS now wins over min_tokens (else no token is left)
            keep = {i for i in min_rows if i in grammar_rows}
            before = {i: x[i, min_ids[j]].clone() for j, i in enumerate(min_rows) if i in keep}
            processors.apply_min_tokens(x, min_rows, min_ids)
            for j, i in enumerate(min_rows):
                if i in before and not bool(torch.isfinite(x[i]).any()):
                    x[i, min_ids[j]] = before[i]
        if pen_rows:
            masks = []
            for i in pen_rows:
                st = states[i]
                if params[i].repetition_penalty != 1.0:
                    if st.prompt_mask is None:
                        st.prompt_mask = processors.token_mask(rows[i].prompt_token_ids, self.vocab_size)
                    masks.append(st.prompt_mask)
                else:
                    masks.append(None)
            processors.apply_penalties(
                x,
                pen_rows,
                [rows[i].output_token_ids for i in pen_rows],
                masks,
                [params[i].repetition_penalty for i in pen_rows],
                [params[i].frequency_penalty for i in pen_rows],
                [params[i].presence_penalty for i in pen_rows],
            )

    def _prompt_logprobs(self, logits: torch.Tensor, seg: PromptSegment) -> List[TokenLogprobs]:
        return token_logprobs(logits[seg.row : seg.row + seg.n], seg.targets, [seg.k] * seg.n)


def _best_allowed(row: torch.Tensor, words: torch.Tensor) -> Optional[int]:
    """The highest-scoring token of ``row`` (``[V]`` logits) that the bitmask ``words`` (int32,
    bit ``j % 32`` of word ``j // 32``) allows; None when it allows none."""
    ids = torch.arange(row.shape[0])
    allowed = ((words[ids // 32].to(torch.int64) >> (ids % 32)) & 1).bool()
    if not bool(allowed.any()):
        return None
    scores = torch.nan_to_num(row.float(), nan=float("-inf")).masked_fill(~allowed, float("-inf"))
    if bool(torch.isinf(scores).all()):  # every allowed token at -inf: the first allowed one
        return int(allowed.nonzero()[0])
    return int(scores.argmax())
