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

Failure isolation: one request's row must not stop the batch (a fuzzed body that makes a
processor, the sampler or an xgrammar matcher raise). Every stage runs batched; when it raises,
it is run again row by row on the untouched logits (the stages write only to copies, and the
random generators are restored first, so the other rows draw exactly what the batch would have
drawn) and only the rows that raise on their own fail (:attr:`StepResult.errors`). The matchers
are advanced last, one call per step; a matcher that raises fails its row only. The redo costs
nothing until a stage raises.

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
        refused: ``[V]`` bool tensor of the tokens ``allowed_token_ids`` leaves out, or None.
    """

    __slots__ = ("grammar", "bias_ids", "bias_values", "stop_ids", "prompt_mask", "refused")

    def __init__(self) -> None:
        self.grammar: Optional[GrammarState] = None
        self.bias_ids: Optional[torch.Tensor] = None
        self.bias_values: Optional[torch.Tensor] = None
        self.stop_ids: Optional[torch.Tensor] = None
        self.prompt_mask: Optional[torch.Tensor] = None
        self.refused: Optional[torch.Tensor] = None


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
    """What one step sampled: ``tokens`` (one per sampling row; None for a row that failed);
    ``logprobs`` (per row a :class:`~radixkv.sampling.logprobs.TokenLogprobs`, or None when the
    row did not ask); per prompt segment its positions' :class:`TokenLogprobs`; ``errors`` (per
    row the exception its sampling raised, else None) and ``prompt_errors`` (the same per prompt
    segment). The engine fails the request of an errored row and keeps the others."""

    tokens: List[Optional[int]]
    logprobs: List[Optional[TokenLogprobs]]
    prompt_logprobs: List[List[TokenLogprobs]]
    errors: List[Optional[BaseException]] = []
    prompt_errors: List[Optional[BaseException]] = []


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
        if params.allowed_token_ids is not None:
            st.refused = ~processors.token_mask(params.allowed_token_ids, self.vocab_size)
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
            logits: ``[S, V]`` float32 logits of the forward (not written to).
            rows: the sampling rows (requests), one per sampled token.
            default_generator: generator of unseeded rows.
            sample_index: the logits row of each of ``rows`` (default: row ``i`` is ``logits[i]``).
            prompt_segments: prompt rows to score (:class:`PromptSegment`).

        Returns:
            A :class:`StepResult`.

        Never raises for one row's fault: a row whose sampling raises gets token None and its
        exception in ``errors`` (module docstring, "Failure isolation").
        """
        with torch.inference_mode():  # the forward's logits are inference tensors
            return self._step(logits, rows, default_generator, sample_index, prompt_segments)

    def _step(self, logits, rows, default_generator, sample_index, prompt_segments) -> StepResult:
        n = len(rows)
        errors: List[Optional[BaseException]] = [None] * n
        prompt_lps: List[List[TokenLogprobs]] = []
        prompt_errors: List[Optional[BaseException]] = []
        for seg in prompt_segments:  # one segment per request: each on its own already
            try:
                prompt_lps.append(self._prompt_logprobs(logits, seg))
                prompt_errors.append(None)
            except Exception as exc:  # noqa: BLE001 - that request fails, not the step
                logger.error("prompt logprobs of one request failed: %r", exc)
                prompt_lps.append([])
                prompt_errors.append(exc)
        src = list(sample_index) if sample_index is not None else list(range(n))
        params = [r.params for r in rows]
        gens = [r.generator for r in rows]
        plain = not any(p._needs_pipeline for p in params)
        saved = _generator_states(params, gens, default_generator)

        def draw(sel: List[int]) -> List[tuple]:
            idx = [src[i] for i in sel]
            if plain and idx and idx == list(range(idx[0], idx[0] + len(idx))):
                x = logits.narrow(0, idx[0], len(idx))  # a view: sample() does not write to its input
            else:  # a copy: the masks and processors below write to it, the logits stay as they were
                x = logits.index_select(0, torch.as_tensor(idx, dtype=torch.int64, device=logits.device))
            sub = [rows[i] for i in sel]
            if plain:
                toks = sample(x, [params[i] for i in sel], [gens[i] for i in sel], default_generator)
                return [(t, None, None) for t in toks]
            return self._draw(x, sub, default_generator)

        drawn = _isolated(draw, list(range(n)), errors, "sampling", lambda: _restore(saved))
        tokens: List[Optional[int]] = [None if d is None else d[0] for d in drawn]
        if not plain:
            self._accept(rows, drawn, tokens, errors)
        logprobs: List[Optional[TokenLogprobs]] = [None] * n
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None and errors[i] is None]
        if lp_rows:

            def lps(sel: List[int]) -> List[TokenLogprobs]:
                raw = logits.index_select(0, torch.as_tensor([src[i] for i in sel], dtype=torch.int64))
                return token_logprobs(raw, [tokens[i] for i in sel], [params[i].logprobs for i in sel])

            for i, e in zip(lp_rows, _isolated(lps, lp_rows, errors, "logprobs")):
                logprobs[i] = e
        return StepResult(tokens, logprobs, prompt_lps, errors, prompt_errors)

    def _draw(self, x: torch.Tensor, rows: Sequence[Any], default_generator) -> List[tuple]:
        """Grammar masks, processors and the draw of ``rows`` on their logits ``x`` (a copy,
        written to): per row ``(token, its masked logits row, its bitmask row or None)``. Changes
        no state but the generators'."""
        params = [r.params for r in rows]
        states = [r.sampling_state for r in rows]
        grammar_rows = [i for i, st in enumerate(states) if st is not None and st.grammar is not None]
        bm = None
        if grammar_rows:
            bm = self._bitmask_rows(x.shape[0])
            if self._batch is None and len(grammar_rows) > 1:
                self._batch = batch_matcher()
            fill_bitmasks([states[i].grammar for i in grammar_rows], bm, grammar_rows, self._batch)
            apply_token_bitmask(x, bm, grammar_rows)  # the kernel skips all-allowed words
        self._apply_processors(x, rows, params, states, grammar_rows)
        tokens = sample(x, params, [r.generator for r in rows], default_generator)
        g = set(grammar_rows)
        # the bitmask buffer is reused by the next call: keep a copy of each grammar row's words
        return [(t, x[i], bm[i].clone() if i in g else None) for i, t in enumerate(tokens)]

    def _accept(self, rows, drawn, tokens, errors) -> None:
        """Advance each constrained row's matcher on its token (the only state a step changes);
        a draw that left the mask takes the best allowed token, a grammar that allows none stops
        its request. A matcher that raises fails its row only."""
        grows = [
            i
            for i, r in enumerate(rows)
            if errors[i] is None and r.sampling_state is not None and r.sampling_state.grammar is not None
        ]
        if not grows:
            return
        states = [rows[i].sampling_state.grammar for i in grows]
        try:
            ok = accept_tokens(states, [tokens[i] for i in grows])
        except Exception as exc:  # noqa: BLE001 - redo one matcher at a time
            logger.warning("grammar accept failed for the batch (%r); accepting row by row", exc)
            ok = []
            for i, st in zip(grows, states):
                try:
                    ok.append(st.accept(tokens[i]))
                except Exception as e:  # noqa: BLE001 - that request fails
                    logger.error("grammar of %r failed: %r", rows[i], e)
                    errors[i] = e
                    ok.append(True)
        for i, st, accepted in zip(grows, states, ok):
            if accepted or errors[i] is not None:
                continue
            try:  # the draw left the mask (no finite probability): best allowed token
                t = _best_allowed(drawn[i][1], drawn[i][2])
                if t is None or not st.accept(t):  # the grammar allows nothing
                    logger.warning("grammar of %r accepts no token; the request stops here", rows[i])
                    st.stuck = True  # finishes with "stop" on this step
                    t = self.eos_token_ids[0] if self.eos_token_ids else tokens[i]
                tokens[i] = t
            except Exception as e:  # noqa: BLE001 - that request fails
                logger.error("grammar of %r failed: %r", rows[i], e)
                errors[i] = e
                tokens[i] = None

    def _apply_processors(self, x, rows, params, states, grammar_rows) -> None:
        bias_rows, bias_ids, bias_vals = [], [], []
        min_rows, min_ids = [], []
        pen_rows = []
        for i, (p, st) in enumerate(zip(params, states)):
            if not p._uses_processors or st is None:
                continue
            if st.refused is not None:  # allowed_token_ids: first, as in vLLM
                x[i].masked_fill_(st.refused.to(x.device), float("-inf"))
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


def _generator_states(params, gens, default_generator) -> List[tuple]:
    """``(generator, state)`` of every generator a random row of this step draws from (the
    per-row redo of a failed batch restores them, so a seeded row draws the same tokens)."""
    out, seen = [], set()
    for p, g in zip(params, gens):
        if p.greedy:
            continue
        g = g if g is not None else default_generator
        if g is not None and id(g) not in seen:
            seen.add(id(g))
            out.append((g, g.get_state()))
    return out


def _restore(saved: List[tuple]) -> None:
    for g, state in saved:
        g.set_state(state)


def _isolated(fn, sel: List[int], errors: List[Optional[BaseException]], what: str, before_redo=None) -> list:
    """``fn(sel)`` (one result per row of ``sel``) for the whole batch; when it raises, ``fn([i])``
    for each row alone (after ``before_redo()``), so a row that fails on its own fails only itself:
    ``errors[i]`` gets its exception and its result is None. Returns results aligned to ``sel``."""
    try:
        return fn(sel)
    except Exception as exc:  # noqa: BLE001 - find the row at fault
        logger.warning("%s failed for a batch of %d rows (%r); redoing it row by row", what, len(sel), exc)
    if before_redo is not None:
        before_redo()
    out: list = []
    for i in sel:
        try:
            out.append(fn([i])[0])
        except Exception as exc:  # noqa: BLE001 - that request fails, not the step
            logger.error("%s failed for one request's row: %r", what, exc)
            errors[i] = exc
            out.append(None)
    return out
