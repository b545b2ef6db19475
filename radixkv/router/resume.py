"""Resuming a request whose replica died mid-stream on another replica, exactly (docs/routing.md,
"A replica that dies").

Pure Python (no Ray, no torch); :class:`radixkv.router.ray.RemoteLLM` drives it. ``delivered``
is the last cumulative :class:`~radixkv.outputs.RequestOutput` the caller has already yielded to
its consumer. :func:`resume_plan` says how the request can go on:

* ``"continue"`` (n == 1, no structured output, greedy or unseeded sampling; presence /
  frequency penalties only with ``repetition_penalty`` 1 and the delivered tokens' penalty
  within ``logit_bias``' range): a continuation request (:func:`continuation`): the prompt + the
  tokens already produced, the remaining ``max_tokens`` / ``min_tokens``, prompt logprobs off
  (already delivered), the delivered tokens' presence / frequency penalty folded into
  ``logit_bias`` (both are additive on the logits before the repetition penalty, which then
  sees the same prompt + output tokens). :class:`Stitcher` turns its outputs into the original
  request's cumulative outputs: token ids, logprobs and the cumulative logprob appended to the
  delivered ones, the text detokenized across the seam by the engine's own
  :class:`~radixkv.engine.detokenizer.IncrementalDetokenizer`, token by token as the engine does,
  so a stop string spanning the seam is found at the token that completes it.
  Greedy: the tokens an uninterrupted run gives (the continuation's prefill computes the same
  logits as the dead replica's decode steps, up to floating-point summation order). Unseeded
  sampling: a sample of the same distribution.
* ``"replay"`` (greedy or seeded: any n, grammars, any penalties): the request again from its
  start; :class:`Replayer` withholds its snapshots until every sample has caught up with what was
  delivered, checking them token for token (a divergence raises :class:`ResumeError`).
* ``None``: unseeded sampling with ``n > 1``, a structured output, or penalties that cannot be
  folded: a new sample would contradict what the consumer already has, so the caller ends the
  request with an error (the reason is returned).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Optional, Sequence

from radixkv.engine.detokenizer import IncrementalDetokenizer
from radixkv.outputs import CompletionOutput, RequestOutput
from radixkv.sampling_params import SamplingParams

__all__ = ["ResumeError", "Replayer", "Stitcher", "continuation", "resume_plan"]


class ResumeError(RuntimeError):
    """A resumed request cannot reproduce what its consumer already received."""


def _penalty_bias(params: SamplingParams, produced: Sequence[int]) -> Optional[dict]:
    """``logit_bias`` with the presence / frequency penalty of ``produced`` folded in, or None
    when that is not exact (repetition penalty on, or a bias outside [-100, 100])."""
    bias = dict(params.logit_bias or {})
    if params.presence_penalty == 0.0 and params.frequency_penalty == 0.0:
        return bias
    if params.repetition_penalty != 1.0:
        return None
    for tok, count in Counter(produced).items():
        v = bias.get(tok, 0.0) - params.frequency_penalty * count - params.presence_penalty
        if not -100.0 <= v <= 100.0:
            return None
        bias[tok] = v
    return bias


def resume_plan(params: SamplingParams, delivered: Optional[RequestOutput]) -> tuple[Optional[str], str]:
    """How a request whose replica died can go on: ``("restart" | "continue" | "replay" | None,
    reason)`` (module docstring); ``"restart"`` when nothing was delivered."""
    if delivered is None or all(not o.token_ids for o in delivered.outputs):
        return "restart", "nothing was delivered yet"
    deterministic = params.greedy or params.seed is not None
    if params.n == 1 and params.structured_output is None and (params.greedy or params.seed is None):
        if _penalty_bias(params, delivered.outputs[0].token_ids) is not None:
            return "continue", "continued from the tokens already produced"
        why = "presence/frequency penalties with repetition_penalty or beyond logit_bias' range"
    elif params.n != 1:
        why = f"n={params.n}"
    elif params.structured_output is not None:
        why = f"a {params.structured_output[0]} constraint"
    else:
        why = "seeded sampling"
    if deterministic:
        return "replay", f"replayed from the start ({why}, {'greedy' if params.greedy else 'seeded'})"
    return None, f"unseeded sampling with {why} cannot be resumed exactly once output was delivered"


def continuation(
    prompt_ids: Sequence[int], params: SamplingParams, delivered: RequestOutput
) -> tuple[list[int], SamplingParams]:
    """The continuation request of a ``"continue"`` plan: ``(prompt token ids, params)``."""
    out = delivered.outputs[0]
    k = len(out.token_ids)
    if out.finished() or (params.max_tokens is not None and k >= params.max_tokens):
        raise ValueError("the request already finished")
    cont = params.clone(
        # None: up to the context on the new replica too (the prompt there holds the k tokens)
        max_tokens=None if params.max_tokens is None else params.max_tokens - k,
        min_tokens=max(0, params.min_tokens - k),
        prompt_logprobs=None,
        logit_bias=_penalty_bias(params, out.token_ids) or None,
    )
    return list(prompt_ids) + list(out.token_ids), cont


class Stitcher:
    """The original request's cumulative outputs from its continuation's (module docstring).

    Args:
        delivered: the last output the consumer got (n == 1).
        params: the original request's SamplingParams.
        tokenizer: the engine's tokenizer (None: text as the delivered text + the continuation's).

    Attributes:
        done: True once a stitched output finished (the continuation may still run: the seam's
            stop check can end it earlier than the continuation's own check).
    """

    def __init__(self, delivered: RequestOutput, params: SamplingParams, tokenizer) -> None:
        self.delivered = delivered
        self.params = params
        self.base = delivered.outputs[0]
        self.ids = list(self.base.token_ids)
        self.k0 = len(self.ids)
        self.logprobs = None if self.base.logprobs is None else list(self.base.logprobs)
        self.cum = self.base.cumulative_logprob
        self.tokenizer = tokenizer if params.detokenize else None
        self.det = IncrementalDetokenizer(
            self.tokenizer, params.stop, params.skip_special_tokens, params.include_stop_str_in_output
        )
        self.det.update(self.ids, check_stop=False)
        self.done = False

    def _text(self, cont: CompletionOutput) -> str:
        if self.tokenizer is None:
            return self.base.text + cont.text
        # NOTE: the delivered text is the engine's settled text (a stop string's possible start
        # held back), a prefix of what the detokenizer primed with the delivered tokens has: the
        # text goes on from the detokenizer's, held back the same way until the output is done
        return self.det.text if self.done else self.det.settled_text

    def take(self, out: RequestOutput) -> Optional[RequestOutput]:
        """The stitched snapshot for the continuation's snapshot ``out`` (None: nothing new)."""
        if self.done:
            return None
        c = out.outputs[0]
        start = len(self.ids) - self.k0
        new = c.token_ids[start:]
        reason, stop_reason = None, None
        # it ended on a stop token (stop_token_ids, EOS): its text is not part of the output's
        token_stop = c.finish_reason == "stop" and not isinstance(c.stop_reason, str)
        for j, tok in enumerate(new):
            self.ids.append(tok)
            if self.logprobs is not None and c.logprobs is not None:
                lp = c.logprobs[start + j]
                self.logprobs.append(lp)
                self.cum = (self.cum or 0.0) + lp[tok].logprob
            if token_stop and start + j == len(c.token_ids) - 1:
                break
            if self.tokenizer is not None and self.det.update(
                self.ids, check_stop=len(self.ids) > self.params.min_tokens
            ):
                reason, stop_reason = "stop", self.det.stopped_by
                break
        if not new and c.finish_reason is None:
            return None
        if reason is None and c.finish_reason is not None and len(self.ids) - self.k0 == len(c.token_ids):
            reason, stop_reason = c.finish_reason, c.stop_reason
        if reason is not None and self.det.stopped_by is None and self.tokenizer is not None:
            keep = not token_stop or self.params.include_stop_str_in_output
            self.det.update(self.ids if keep else self.ids[:-1], final=True, check_stop=not token_stop)
        self.done = reason is not None
        stitched = CompletionOutput(
            0,
            self._text(c),
            list(self.ids),
            reason,
            stop_reason,
            None if self.logprobs is None else list(self.logprobs),
            self.cum,
        )
        return replace(self.delivered, outputs=[stitched], finished=self.done)


class Replayer:
    """The original request's outputs from a replay of it (module docstring): None until every
    sample has caught up with ``delivered``, then the replay's snapshots under the original's
    id, cached-token count, metrics and prompt logprobs.

    Raises:
        ResumeError: (from :meth:`take`) the replay's tokens differ from the delivered ones.
    """

    def __init__(self, delivered: RequestOutput) -> None:
        self.delivered = delivered
        self.caught_up = False

    def take(self, out: RequestOutput) -> Optional[RequestOutput]:
        d = self.delivered
        if not self.caught_up:
            if len(out.outputs) != len(d.outputs):
                raise ResumeError("the replay has a different number of samples")
            behind = False
            for a, b in zip(d.outputs, out.outputs):
                m = min(len(a.token_ids), len(b.token_ids))
                if (
                    list(a.token_ids[:m]) != list(b.token_ids[:m])
                    or (a.finished() and len(b.token_ids) > m)
                    or (b.finished() and len(b.token_ids) < len(a.token_ids))
                ):
                    raise ResumeError(f"the replay of sample {a.index} diverged from the delivered tokens")
                behind |= len(b.token_ids) < len(a.token_ids) or (a.finished() and not b.finished())
            if behind:
                return None
            self.caught_up = True
        return replace(
            out,
            request_id=d.request_id,
            prompt=d.prompt,
            num_cached_tokens=d.num_cached_tokens,
            metrics=d.metrics,
            prompt_logprobs=d.prompt_logprobs,
            cache_outcome=d.cache_outcome,
        )
