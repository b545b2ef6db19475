"""``select``'s scores: each choice's log-likelihood given the prompt, from the prompt logprobs of
its request (SGLang's ``select``, with ``token_length_normalized``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, List, Sequence

from radixkv.errors import RequestError
from radixkv.outputs import RequestOutput
from radixkv.sampling_params import SamplingParams

__all__ = ["ChoiceScore", "SelectResult", "select_params", "score_choices", "check_method", "SELECT_METHODS"]

SELECT_METHODS = ("normalized", "sum")


@dataclass(frozen=True)
class ChoiceScore:
    """One choice of :meth:`Session.select` / ``LLM.select``.

    Attributes:
        choice: the choice as given (text or token ids).
        token_ids: its tokens, appended to the prompt's.
        token_logprobs: natural-log probability of each of its tokens given everything before it.
        logprob: their sum (the choice's log-likelihood given the prompt).
        normalized_logprob: ``logprob / len(token_ids)`` (SGLang's ``token_length_normalized``).
    """

    choice: Any
    token_ids: List[int]
    token_logprobs: List[float]
    logprob: float
    normalized_logprob: float


@dataclass(frozen=True)
class SelectResult:
    """What ``select`` returns: ``index`` of the chosen choice (the highest ``normalized_logprob``,
    or ``logprob`` with ``method="sum"``; the first on ties), ``choice`` (it, as given),
    ``scores`` (every choice's :class:`ChoiceScore`, in input order) and ``method``."""

    index: int
    choice: Any
    scores: List[ChoiceScore]
    method: str

    @property
    def logprobs(self) -> List[float]:
        """Every choice's summed logprob."""
        return [s.logprob for s in self.scores]

    @property
    def normalized_logprobs(self) -> List[float]:
        """Every choice's length-normalized logprob."""
        return [s.normalized_logprob for s in self.scores]


def select_params(prompt_len: int) -> SamplingParams:
    """What each choice of ``select`` is submitted with: one greedy token (not used) and the
    logprob of every prompt token from ``prompt_len`` on, i.e. of the choice's tokens."""
    return SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, logprob_start_len=prompt_len)


def score_choices(
    choices: Sequence[Any], prompt_len: int, ids: List[List[int]], outs: List[RequestOutput], method: str
) -> SelectResult:
    """The :class:`SelectResult` of ``select`` from each choice's output (its prompt logprobs)."""
    scores = []
    for c, toks, out in zip(choices, ids, outs):
        lps = out.prompt_logprobs
        if lps is None or out.outputs[0].finish_reason == "abort":
            raise RuntimeError(f"select: choice {c!r} was not scored (aborted)")
        row = []
        for pos, t in zip(range(prompt_len, prompt_len + len(toks)), toks):
            entry = lps[pos]
            if entry is None or t not in entry:
                raise RuntimeError(f"select: no logprob for position {pos} of choice {c!r}")
            row.append(float(entry[t].logprob))
        total = math.fsum(row)
        scores.append(ChoiceScore(c, list(toks), row, total, total / len(row)))
    key = (lambda s: s.normalized_logprob) if method == "normalized" else (lambda s: s.logprob)
    best = max(range(len(scores)), key=lambda i: (key(scores[i]), -i))
    return SelectResult(best, choices[best], scores, method)


def check_method(method: Any) -> str:
    """``method`` if it is one of :data:`SELECT_METHODS`.

    Raises:
        RequestError: (param ``method``) anything else.
    """
    if method not in SELECT_METHODS:
        raise RequestError(f"method must be one of {SELECT_METHODS}, got {method!r}", "method")
    return method
