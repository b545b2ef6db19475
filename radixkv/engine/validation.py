"""What ``Engine.add_request`` checks before it queues a request: the prompt's token ids and the
sampling parameters against the engine's limits. Each refusal is a
:class:`~radixkv.errors.RequestError` (a ValueError) naming the field (``.param``) and the limit
(docs/limits.md). Structured-output constraints are checked by the grammar backend, not here.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, List

from radixkv.errors import RequestError
from radixkv.memory.slots import is_tensor
from radixkv.sampling_params import SamplingParams

__all__ = ["Limits", "validate_request"]


@dataclass(frozen=True)
class Limits:
    """The engine's limits a request is checked against.

    Attributes:
        vocab_size: token ids are in ``[0, vocab_size)``.
        max_context_len: prompt + generated tokens (tokens).
        max_n: most samples per request.
        capacity: KV slots in the pool (tokens).
        page_size: tokens per KV page (a request needs whole pages).
    """

    vocab_size: int
    max_context_len: int
    max_n: int
    capacity: int
    page_size: int


def _token_id(t: Any) -> int:
    """A token id from an integer (numpy integers too; not a bool, a float or a string)."""
    if isinstance(t, bool):
        raise TypeError(t)
    return operator.index(t)


def _short(x: Any, limit: int = 80) -> str:
    text = repr(x)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _sampling_params(sampling_params: Any) -> SamplingParams:
    params = sampling_params if sampling_params is not None else SamplingParams()
    if not isinstance(params, SamplingParams):
        hint = " (build one with SamplingParams(**your_dict))" if isinstance(params, dict) else ""
        raise RequestError(
            f"sampling_params must be a SamplingParams, got {type(params).__name__}{hint}", "sampling_params"
        )
    return params.checked()  # a field set after construction is validated (and takes effect)


def _prompt_ids(prompt_token_ids: Any, lim: Limits) -> List[int]:
    """The prompt as a list of ints: non-empty, in the vocabulary, shorter than the context."""
    if is_tensor(prompt_token_ids):
        prompt_token_ids = prompt_token_ids.reshape(-1).tolist()
    try:
        if isinstance(prompt_token_ids, (str, bytes)):
            raise TypeError
        ids = [_token_id(t) for t in prompt_token_ids]
    except (TypeError, ValueError):
        raise RequestError(
            f"prompt_token_ids must be a sequence of integer token ids, got {_short(prompt_token_ids)}", "prompt"
        ) from None
    if not ids:
        raise RequestError("prompt_token_ids is empty: a prompt needs at least 1 token", "prompt")
    bad = [t for t in ids if not 0 <= t < lim.vocab_size]
    if bad:
        raise RequestError(f"prompt_token_ids holds {bad[0]}, outside the vocabulary [0, {lim.vocab_size})", "prompt")
    if len(ids) >= lim.max_context_len:
        raise RequestError(
            f"prompt has {len(ids)} tokens; max_context_len is {lim.max_context_len}{_pool_cap(lim)} "
            f"(the prompt plus at least one generated token must fit)",
            "prompt",
        )
    return ids


def _pool_cap(lim: Limits) -> str:
    """Where ``max_context_len`` is the KV pool's size (the default context is capped at it),
    the words saying so: the setting to raise is the pool's, not the context's."""
    if lim.max_context_len != lim.capacity:
        return ""
    return f", the KV pool's {lim.capacity} slots (max_total_tokens, or what kv_cache_memory_bytes holds)"


def _check_sizes(params: SamplingParams, n_prompt: int, lim: Limits) -> None:
    """``max_tokens`` within the context and the pool, ``n`` within ``max_n``."""
    if n_prompt + params.max_tokens > lim.max_context_len:
        raise RequestError(
            f"max_tokens={params.max_tokens} plus the {n_prompt} prompt tokens exceeds max_context_len "
            f"{lim.max_context_len}{_pool_cap(lim)} (at most {lim.max_context_len - n_prompt} new tokens for this prompt)",
            "max_tokens",
        )
    if params.n > lim.max_n:
        raise RequestError(f"n={params.n} exceeds this engine's max_n {lim.max_n}", "n")
    need = _pool_slots(n_prompt + params.max_tokens, lim)
    if need > lim.capacity:
        raise RequestError(
            f"prompt ({n_prompt} tokens) + max_tokens ({params.max_tokens}) needs {need} KV slots, "
            f"more than the KV pool's {lim.capacity} slots (max_total_tokens, or what kv_cache_memory_bytes holds)",
            "max_tokens",
        )


def _pool_slots(tokens: int, lim: Limits) -> int:
    """KV slots ``tokens`` positions take in the pool: whole pages of ``lim.page_size``."""
    return -(-tokens // lim.page_size) * lim.page_size


def _up_to_context(params: SamplingParams, n_prompt: int, lim: Limits) -> SamplingParams:
    """``params`` with ``max_tokens=None`` resolved (vLLM's "up to the context length"): what the
    context and the KV pool (whole pages) leave after the prompt (a copy; the caller's is kept)."""
    room = min(lim.max_context_len, lim.capacity // lim.page_size * lim.page_size) - n_prompt
    if room < 1:
        raise RequestError(
            f"max_tokens=None: the {n_prompt} prompt tokens leave no room for output in the KV pool's "
            f"{lim.capacity} slots",
            "max_tokens",
        )
    return params.clone(max_tokens=room)


def _check_token_fields(params: SamplingParams, n_prompt: int, lim: Limits) -> None:
    """``stop_token_ids``, ``allowed_token_ids`` and ``logit_bias`` ids in the vocabulary, ``logprob_start_len`` inside
    the prompt."""
    bad = [t for t in params.stop_token_ids if t >= lim.vocab_size]
    if bad:
        raise RequestError(
            f"stop_token_ids holds {bad[0]}, outside the vocabulary [0, {lim.vocab_size})", "stop_token_ids"
        )
    bad = [t for t in params.allowed_token_ids or () if t >= lim.vocab_size]
    if bad:
        raise RequestError(
            f"allowed_token_ids holds {bad[0]}, outside the vocabulary [0, {lim.vocab_size})", "allowed_token_ids"
        )
    if params.logit_bias:
        bad = [t for t in params.logit_bias if t >= lim.vocab_size]
        if bad:
            raise RequestError(
                f"logit_bias holds token id {bad[0]}, outside the vocabulary [0, {lim.vocab_size})", "logit_bias"
            )
    if params.logprob_start_len is not None and params.logprob_start_len >= n_prompt:
        raise RequestError(
            f"logprob_start_len {params.logprob_start_len} must be below the prompt length {n_prompt}",
            "logprob_start_len",
        )


def check_prompt_fits(prompt_token_ids: Any, lim: Limits) -> List[int]:
    """The prompt as ``add_request`` takes it (:func:`_prompt_ids`), with room for one generated
    token in the pool: what a dry run (``Engine.explain``) checks, so that it never explains a
    prompt the engine would refuse.

    Raises:
        RequestError: as :func:`_prompt_ids`, or (param ``prompt``) a prompt the pool cannot hold.
    """
    ids = _prompt_ids(prompt_token_ids, lim)
    need = _pool_slots(len(ids) + 1, lim)
    if need > lim.capacity:
        raise RequestError(
            f"prompt ({len(ids)} tokens) + 1 generated token needs {need} KV slots, more than the KV pool's "
            f"{lim.capacity} slots (max_total_tokens, or what kv_cache_memory_bytes holds)",
            "prompt",
        )
    return ids


def validate_request(prompt_token_ids: Any, sampling_params: Any, lim: Limits) -> tuple[List[int], SamplingParams]:
    """Check a request against ``lim``, in this order: ``sampling_params`` is a
    :class:`~radixkv.sampling_params.SamplingParams` (None: the defaults); the prompt is a
    non-empty sequence (or 1-D tensor) of integer ids in the vocabulary, shorter than
    ``max_context_len``; ``max_tokens=None`` becomes what the context and the pool leave after
    the prompt; ``len(prompt) + max_tokens`` fits the context and (in whole pages) the
    pool; ``n <= max_n``; ``stop_token_ids`` and ``logit_bias`` ids in the vocabulary;
    ``logprob_start_len`` below the prompt length.

    Returns:
        ``(ids, params)``: the prompt as a ``list[int]`` and the sampling parameters (a copy
        with ``max_tokens`` set when it was None).

    Raises:
        RequestError: the first check that fails, naming its field (``prompt``,
            ``sampling_params``, ``max_tokens``, ``n``, ``stop_token_ids``, ``logit_bias``,
            ``logprob_start_len``) and the limit.
    """
    params = _sampling_params(sampling_params)
    ids = _prompt_ids(prompt_token_ids, lim)
    if params.max_tokens is None:
        params = _up_to_context(params, len(ids), lim)
    _check_sizes(params, len(ids), lim)
    _check_token_fields(params, len(ids), lim)
    return ids, params
