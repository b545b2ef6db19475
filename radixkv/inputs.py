"""Prompts and sampling params as the Python API takes them, checked once for ``LLM.generate`` and
``AsyncLLM.generate`` (the server parses its own bodies with pydantic, radixkv/server/openai/).

A prompt is, as in vLLM (``vllm.inputs``): a text (tokenized with the model's tokenizer, no
special tokens added, no chat template), a list of token ids, or a dict ``{"prompt": text}`` /
``{"prompt_token_ids": [...]}`` (vLLM's ``TextPrompt`` / ``TokensPrompt``; ``prompt`` may come
along with ``prompt_token_ids`` as the text reported back; ``cache_salt``, as in vLLM, names the
prompt's prefix-cache salt: :func:`prompt_salts`). Anything else is a
:class:`~radixkv.errors.RequestError` naming the argument (and the index in a list) and the
accepted shapes. The token ids themselves (integers inside the vocabulary, the context limit)
are checked by :meth:`radixkv.engine.Engine.add_request`, their one owner.
"""

from __future__ import annotations

import numbers
from typing import Any, Callable, List, Mapping, Optional, Sequence, Tuple

from radixkv.errors import RequestError
from radixkv.namespace import check_cache_salt
from radixkv.sampling_params import SamplingParams
from radixkv.text import encode_text

__all__ = [
    "refuse_vllm_options",
    "batch_requests",
    "check_sampling_params",
    "conversations",
    "to_token_ids",
    "params_per_prompt",
    "prompt_salts",
    "to_token_prompt",
    "to_token_prompts",
]

_SHAPES = "a str, a list of token ids, or a dict {'prompt': str} / {'prompt_token_ids': [int, ...]}"
_PROMPT_KEYS = {"prompt", "prompt_token_ids"}


def _is_zero(x: Any) -> bool:
    """An integer 0 (numpy's too), not False."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool) and x == 0


def refuse_vllm_options(lora_request: Any = None, priority: Any = None, num_prompts: Optional[int] = None) -> None:
    """vLLM's ``lora_request`` and ``priority`` arguments of ``generate`` / ``chat``, taken at
    their defaults (None; ``priority`` 0 too, ``AsyncLLM.generate``'s default) so that vLLM code
    passing them runs; any other value is a RequestError naming it (no LoRA adapters here, and
    the scheduler has no priorities: docs/engine.md). With ``num_prompts`` (``LLM.generate``,
    whose vLLM ``priority`` is a list with one entry per prompt) a list or tuple of that many
    zeros is the default too."""
    if lora_request is not None:
        raise RequestError("lora_request is not supported: radixkv serves no LoRA adapters", "lora_request")
    per_prompt = num_prompts is not None and isinstance(priority, (list, tuple))
    if priority is None or _is_zero(priority) or (per_prompt and all(_is_zero(p) for p in priority)):
        if per_prompt and len(priority) != num_prompts:
            n = len(priority)
            raise RequestError(
                f"priority has {n} {'entry' if n == 1 else 'entries'} for {num_prompts} prompts (give one per prompt)",
                "priority",
            )
        return
    raise RequestError(
        f"priority is not supported: radixkv schedules by cached prefix and arrival, got {priority!r}", "priority"
    )


def _type(x: Any) -> str:
    return type(x).__name__


def _is_token_list(x: Any) -> bool:
    """A non-empty list / tuple of integers (numpy integers too; not bools), or a 1-D tensor."""
    if hasattr(x, "ndim") and hasattr(x, "tolist") and not isinstance(x, (list, tuple)):
        return getattr(x, "ndim", None) == 1
    return (
        isinstance(x, (list, tuple))
        and len(x) > 0
        and all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in x)
    )


def _tokens(x: Any) -> List[int]:
    return list(x) if isinstance(x, (list, tuple)) else list(x.tolist())


def to_token_ids(x: Any, param: str) -> List[int]:
    """``x`` (a non-empty list / tuple of integers, or a 1-D tensor / array) as a list of int.

    Raises:
        RequestError: (param ``param``) anything else.
    """
    if not _is_token_list(x):
        raise RequestError(f"{param} must be a non-empty list of integer token ids, got {x!r:.80}", param)
    return _tokens(x)


def to_token_prompt(tokenizer: Any, prompt: Any, param: str = "prompt") -> Tuple[List[int], Optional[str]]:
    """``(token ids, text or None)`` of one prompt (module docstring).

    Raises:
        RequestError: (param ``param``) a prompt of another type, a dict with other keys or
            without either key, or a text prompt without a tokenizer.
    """
    if isinstance(prompt, Mapping):
        extra = sorted(str(k) for k in set(prompt) - _PROMPT_KEYS - {"cache_salt"})
        if extra or not set(prompt) & _PROMPT_KEYS:
            raise RequestError(
                f"{param}: a dict prompt takes the keys 'prompt' and/or 'prompt_token_ids' (and 'cache_salt'), "
                f"got {sorted(map(str, prompt))}",
                param,
            )
        text = prompt.get("prompt")
        if text is not None and not isinstance(text, str):
            raise RequestError(f"{param}['prompt'] must be a str, got {_type(text)}", param)
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not _is_token_list(ids):
                raise RequestError(
                    f"{param}['prompt_token_ids'] must be a non-empty list of integer token ids, got {ids!r:.80}", param
                )
            return _tokens(ids), text
        prompt = text
    if isinstance(prompt, str):
        if tokenizer is None:
            raise RequestError(f"{param}: a text prompt needs the model's tokenizer; give token ids", param)
        return encode_text(tokenizer, prompt, param), prompt
    if _is_token_list(prompt):
        return _tokens(prompt), None
    raise RequestError(f"{param} must be {_SHAPES}; got {_type(prompt)} {prompt!r:.80}", param)


def to_token_prompts(
    tokenizer: Any, prompts: Any = None, prompt_token_ids: Any = None
) -> Tuple[List[List[int]], List[Optional[str]]]:
    """``(token ids per prompt, text or None per prompt)`` of ``LLM.generate``'s arguments:
    ``prompts`` is one prompt or a list of them (module docstring); ``prompt_token_ids`` (the
    older vLLM keyword) one list of token ids or a list of them.

    Raises:
        RequestError: neither or both given (param ``prompts``), or a malformed prompt (param
            ``prompts`` / ``prompt_token_ids``, the message naming its index).
    """
    if (prompts is None) == (prompt_token_ids is None):
        raise RequestError("generate: give exactly one of prompts or prompt_token_ids", "prompts")
    if prompt_token_ids is not None:
        if _is_token_list(prompt_token_ids):
            return [to_token_ids(prompt_token_ids, "prompt_token_ids")], [None]
        if not isinstance(prompt_token_ids, (list, tuple)):
            raise RequestError(
                f"prompt_token_ids must be a list of token ids or a list of such lists, got {_type(prompt_token_ids)}",
                "prompt_token_ids",
            )
        ids = []
        for i, p in enumerate(prompt_token_ids):
            if not _is_token_list(p):
                raise RequestError(
                    f"prompt_token_ids[{i}] must be a non-empty list of integer token ids, got {p!r:.80}",
                    "prompt_token_ids",
                )
            ids.append(_tokens(p))
        return ids, [None] * len(ids)
    if isinstance(prompts, (str, Mapping)) or _is_token_list(prompts):
        ids, text = to_token_prompt(tokenizer, prompts, "prompts")
        return [ids], [text]
    if not isinstance(prompts, (list, tuple)):
        raise RequestError(
            f"prompts must be {_SHAPES}, or a list of those; got {_type(prompts)} {prompts!r:.80}", "prompts"
        )
    out_ids, out_texts = [], []
    for i, p in enumerate(prompts):
        try:
            ids, text = to_token_prompt(tokenizer, p, f"prompts[{i}]")
        except RequestError as exc:
            raise RequestError(str(exc), "prompts") from None
        out_ids.append(ids)
        out_texts.append(text)
    return out_ids, out_texts


def prompt_salts(prompts: Any) -> List[Optional[str]]:
    """The ``cache_salt`` of each prompt of ``LLM.generate``'s ``prompts`` (one prompt or a list,
    as :func:`to_token_prompts` takes them; None where a prompt is not a dict or has none).

    Raises:
        RequestError: (param ``cache_salt``) a salt that is not a non-empty str of at most 128
            characters (:func:`radixkv.namespace.check_cache_salt`).
    """
    if prompts is None:
        return []
    items = [prompts] if isinstance(prompts, (str, Mapping)) or _is_token_list(prompts) else list(prompts)
    return [check_cache_salt(p.get("cache_salt")) if isinstance(p, Mapping) else None for p in items]


def params_per_prompt(sampling_params: Any, num_prompts: int) -> List[SamplingParams]:
    """One :class:`SamplingParams` per prompt: None (the defaults), one for all, or a list of
    exactly ``num_prompts``.

    Raises:
        RequestError: (param ``sampling_params``) another type (a dict gets a hint to build a
            ``SamplingParams`` from it), or a list of another length.
    """
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        return [sampling_params or SamplingParams()] * num_prompts
    if isinstance(sampling_params, (list, tuple)):
        params = list(sampling_params)
        for i, p in enumerate(params):
            if not isinstance(p, SamplingParams):
                raise RequestError(f"sampling_params[{i}] must be a SamplingParams, got {_type(p)}", "sampling_params")
        if len(params) != num_prompts:
            raise RequestError(
                f"{len(params)} sampling_params for {num_prompts} prompts (give one, or one per prompt)",
                "sampling_params",
            )
        return params
    hint = " (build one with SamplingParams(**your_dict))" if isinstance(sampling_params, Mapping) else ""
    raise RequestError(
        f"sampling_params must be a SamplingParams or a list of them, one per prompt; got {_type(sampling_params)}{hint}",
        "sampling_params",
    )


def check_sampling_params(sampling_params: Any) -> SamplingParams:
    """One request's :class:`SamplingParams` (None: the defaults).

    Raises:
        RequestError: (param ``sampling_params``) another type, with a hint for a dict.
    """
    if sampling_params is None:
        return SamplingParams()
    if isinstance(sampling_params, SamplingParams):
        return sampling_params
    hint = " (build one with SamplingParams(**your_dict))" if isinstance(sampling_params, Mapping) else ""
    raise RequestError(
        f"sampling_params must be a SamplingParams, got {_type(sampling_params)}{hint}", "sampling_params"
    )


def batch_requests(requests: Any, on_finish: Any) -> Tuple[List[tuple], List[Optional[Callable[..., Any]]]]:
    """``generate_batch``'s arguments checked (``LLM`` and ``AsyncLLM``): ``requests`` as a list of
    ``(prompt token ids, SamplingParams, namespace)`` (params None: the defaults) and ``on_finish``
    as one hook (a callable or None) per request.

    Raises:
        RequestError: (param ``requests``) not a list of such triples; (``sampling_params``) params
            that are not a ``SamplingParams``; (``on_finish``) not None nor a list of one hook per
            request (a shorter one left requests without a hook, or unsubmitted and awaited forever).
    """
    if isinstance(requests, (str, bytes, Mapping)) or not isinstance(requests, Sequence):
        raise RequestError(
            f"requests must be a list of (prompt token ids, SamplingParams, namespace), got {_type(requests)}",
            "requests",
        )
    out = []
    for i, r in enumerate(requests):
        if not isinstance(r, (tuple, list)) or len(r) != 3:
            raise RequestError(
                f"requests[{i}] must be a (prompt token ids, SamplingParams, namespace) triple, got {r!r}", "requests"
            )
        out.append((r[0], check_sampling_params(r[1]), r[2]))
    if on_finish is None:
        return out, [None] * len(out)
    if isinstance(on_finish, (str, bytes)) or not isinstance(on_finish, Sequence) or len(on_finish) != len(out):
        raise RequestError(
            f"on_finish must be None or a list of {len(out)} hooks (one per request, or None)", "on_finish"
        )
    hooks = list(on_finish)
    for i, h in enumerate(hooks):
        if h is not None and not callable(h):
            raise RequestError(f"on_finish[{i}] must be callable or None, got {_type(h)}", "on_finish")
    return out, hooks


def conversations(messages: Any) -> List[Sequence[Mapping[str, Any]]]:
    """``LLM.chat``'s ``messages`` as a list of conversations: one conversation (a list of
    message dicts) or a list of them. The messages themselves are checked by
    :func:`radixkv.chat_template.render_chat`.

    Raises:
        RequestError: (param ``messages``) not a non-empty list, or a conversation that is not
            a non-empty list of dicts.
    """
    if not isinstance(messages, (list, tuple)) or not messages:
        raise RequestError(
            f"messages must be a non-empty list of message dicts (or of conversations), got {messages!r:.80}",
            "messages",
        )
    convs = [messages] if isinstance(messages[0], Mapping) else list(messages)
    for i, c in enumerate(convs):
        if not isinstance(c, (list, tuple)) or not c or not all(isinstance(m, Mapping) for m in c):
            raise RequestError(f"messages[{i}] must be a non-empty list of message dicts, got {c!r:.80}", "messages")
    return convs
