"""Logits processors: ``logit_bias``, ``min_tokens`` and the repetition / frequency / presence
penalties, each vectorized over the rows of a step that use it.

Order (vLLM v1's sampler): logit_bias and min_tokens, then the penalties (repetition, then
frequency, then presence), all after the grammar mask and before temperature / top-k / top-p /
min-p (:mod:`radixkv.sampling.pipeline`). Semantics:

* ``logit_bias`` (OpenAI): ``logits[t] += bias[t]``.
* ``min_tokens`` (vLLM): while a sample has fewer than ``min_tokens`` tokens, its stop tokens
  (EOS unless ``ignore_eos``, and ``stop_token_ids``) get ``-inf``.
* ``repetition_penalty`` (CTRL, Keskar et al. 2019, as Hugging Face's
  ``RepetitionPenaltyLogitsProcessor`` and vLLM): for every token in the prompt or the output so
  far, ``logit / p`` when the logit is > 0, else ``logit * p``.
* ``frequency_penalty`` / ``presence_penalty`` (OpenAI): ``logits[t] -= f * count[t] + p * (count[t] >
  0)`` with ``count`` the token's occurrences in the sample's generated tokens (not the prompt).
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["apply_logit_bias", "apply_min_tokens", "apply_penalties", "token_mask"]


def apply_logit_bias(logits: torch.Tensor, rows: Sequence[int], ids: Sequence[torch.Tensor], values) -> None:
    """``logits[rows[i], ids[i]] += values[i]`` in place.

    Args:
        logits: ``[S, V]`` float logits.
        rows: rows of ``logits``.
        ids: per row, 1-D int64 token ids (< V).
        values: per row, 1-D float32 biases (same length as its ids).
    """
    if not rows:
        return
    r = torch.cat([torch.full((len(t),), row, dtype=torch.int64) for row, t in zip(rows, ids)])
    t = torch.cat(list(ids))
    v = torch.cat(list(values)).to(logits.dtype)
    logits.index_put_((r.to(logits.device), t.to(logits.device)), v.to(logits.device), accumulate=True)


def apply_min_tokens(logits: torch.Tensor, rows: Sequence[int], stop_ids: Sequence[torch.Tensor]) -> None:
    """``logits[rows[i], stop_ids[i]] = -inf`` in place (samples still short of ``min_tokens``).

    Args:
        logits: ``[S, V]`` float logits.
        rows: rows of ``logits``.
        stop_ids: per row, 1-D int64 token ids to mask.
    """
    if not rows:
        return
    r = torch.cat([torch.full((len(t),), row, dtype=torch.int64) for row, t in zip(rows, stop_ids)])
    t = torch.cat(list(stop_ids))
    logits.index_put_((r.to(logits.device), t.to(logits.device)), torch.tensor(float("-inf"), device=logits.device))


def _counts(token_lists: Sequence[Sequence[int]], vocab: int, device) -> torch.Tensor:
    """``[R, V]`` float32 occurrence counts of each row's tokens."""
    width = max((len(t) for t in token_lists), default=0)
    counts = torch.zeros(len(token_lists), vocab + 1, dtype=torch.float32, device=device)
    if width:
        padded = torch.full((len(token_lists), width), vocab, dtype=torch.int64)
        for i, t in enumerate(token_lists):
            if t:
                padded[i, : len(t)] = torch.as_tensor(t, dtype=torch.int64)
        padded = padded.to(device)
        counts.scatter_add_(1, padded, torch.ones(padded.shape, dtype=torch.float32, device=device))
    return counts[:, :vocab]


def apply_penalties(
    logits: torch.Tensor,
    rows: Sequence[int],
    outputs: Sequence[Sequence[int]],
    prompt_masks: Sequence[torch.Tensor | None],
    repetition: Sequence[float],
    frequency: Sequence[float],
    presence: Sequence[float],
) -> None:
    """Repetition, frequency and presence penalties of the given rows, in place.

    Args:
        logits: ``[S, V]`` float logits.
        rows: ``R`` rows of ``logits``.
        outputs: per row, the sample's generated token ids so far.
        prompt_masks: per row, a ``[V]`` bool tensor of the tokens in its prompt (needed for a
            repetition penalty != 1; None otherwise).
        repetition, frequency, presence: per row, the three penalties (1, 0, 0 = off).
    """
    if not rows:
        return
    dev = logits.device
    vocab = logits.shape[1]
    idx = torch.tensor(list(rows), dtype=torch.int64, device=dev)
    x = logits.index_select(0, idx)
    counts = _counts(outputs, vocab, dev)
    seen = counts > 0
    rep = torch.tensor(list(repetition), dtype=x.dtype, device=dev).unsqueeze(1)
    if bool((rep != 1.0).any()):
        used = seen.clone()
        for i, m in enumerate(prompt_masks):
            if m is not None:
                used[i] |= m.to(dev)
        penalized = torch.where(x > 0, x / rep, x * rep)
        x = torch.where(used, penalized, x)
    freq = torch.tensor(list(frequency), dtype=x.dtype, device=dev).unsqueeze(1)
    pres = torch.tensor(list(presence), dtype=x.dtype, device=dev).unsqueeze(1)
    x = x - freq * counts.to(x.dtype) - pres * seen.to(x.dtype)
    logits.index_copy_(0, idx, x)


def token_mask(token_ids: Sequence[int], vocab: int) -> torch.Tensor:
    """A ``[vocab]`` bool tensor, True at each of ``token_ids``."""
    m = torch.zeros(vocab, dtype=torch.bool)
    if token_ids:
        m[torch.as_tensor(list(token_ids), dtype=torch.int64)] = True
    return m
