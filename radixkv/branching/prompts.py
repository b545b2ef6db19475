"""What sessions and ``select`` take, checked: token ids, chat messages, sampling params of a turn,
per-child values of a fork batch, ``fork``'s ``n``, a session's first context, ``select``'s prompt
and choices. Every refusal is a :class:`~radixkv.errors.RequestError` naming the argument."""

from __future__ import annotations

import re
from typing import Any, Callable, List, Mapping, Optional, Sequence, Tuple, Union

from radixkv.chat_template import render_chat
from radixkv.errors import RequestError
from radixkv.sampling_params import SamplingParams
from radixkv.text import encode_text

__all__ = [
    "Prompt",
    "is_messages",
    "token_ids",
    "messages",
    "render_messages",
    "turn_params",
    "per_child",
    "fork_count",
    "initial_context",
    "select_prompt",
    "choice_ids",
]

Message = Mapping[str, Any]
Prompt = Union[None, str, Sequence[int], Sequence[Message]]


def is_messages(x: Any) -> bool:
    """Whether ``x`` is a conversation (a list or tuple whose first item is a mapping, or empty)."""
    return isinstance(x, (list, tuple)) and (len(x) == 0 or isinstance(x[0], Mapping))


def token_ids(x: Any, vocab_size: int, param: str) -> List[int]:
    """``x`` (a sequence of ints in ``[0, vocab_size)``, maybe empty) as a list of int.

    Raises:
        RequestError: (param ``param``) a str, a non-sequence, a non-integer or out-of-vocabulary id.
    """
    if isinstance(x, (str, bytes)) or not isinstance(x, Sequence):
        raise RequestError(f"{param} must be a sequence of token ids, got {type(x).__name__}", param)
    out = []
    for t in x:
        if isinstance(t, bool) or not isinstance(t, int):
            raise RequestError(f"{param} must hold integer token ids, got {t!r}", param)
        if not 0 <= t < vocab_size:
            raise RequestError(f"{param} holds {t}, outside the vocabulary [0, {vocab_size})", param)
        out.append(int(t))
    return out


def messages(x: Any, param: str = "messages") -> List[dict]:
    """One message or a list of them, as a list of dict copies.

    Raises:
        RequestError: (param ``param``) not a message or list, or a message without a str
            ``role`` and a ``content``.
    """
    if isinstance(x, Mapping):
        x = [x]
    if not isinstance(x, (list, tuple)):
        raise RequestError(f"{param} must be a message, a list of messages or a str, got {type(x).__name__}", param)
    out = []
    for m in x:
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or "content" not in m:
            raise RequestError(f"{param}: every message needs a str 'role' and a 'content', got {m!r}", param)
        out.append(dict(m))
    return out


def render_messages(tok: Any, msgs: List[dict], add_generation_prompt: bool, param: str) -> str:
    """The chat template's text of ``msgs``, the argument ``param`` of a branching call.

    Raises:
        RequestError: (param ``param``) what the chat template refuses in them (a role it does
            not know, content that is not text), ``messages[i]`` in its message as ``param[i]``.
    """
    try:
        return render_chat(tok, msgs, add_generation_prompt=add_generation_prompt)
    except RequestError as exc:
        if exc.param != "messages" or param == "messages":
            raise
        raise RequestError(re.sub(r"\bmessages\[", f"{param}[", str(exc)), param) from exc


def turn_params(p: Any, param: str = "sampling_params") -> SamplingParams:
    """The sampling params of a session turn (default ``SamplingParams()``).

    Raises:
        RequestError: not a ``SamplingParams`` (param ``sampling_params``), or ``n != 1`` (param
            ``n``: a turn continues one context; ``fork(n)`` makes branches).
    """
    if p is None:
        return SamplingParams()
    if not isinstance(p, SamplingParams):
        raise RequestError(f"{param} must be a SamplingParams, got {type(p).__name__}", param)
    if p.n != 1:
        raise RequestError(
            f"n must be 1 in a session turn (it continues one context), got {p.n}; use session.fork(n) for n branches",
            "n",
        )
    return p


def per_child(value: Any, n: int, param: str, is_single: Callable[[Any], bool]) -> list:
    """``value`` for each of ``n`` children: one value for all (``is_single(value)``), or a list of ``n``.

    Raises:
        RequestError: (param ``param``) a list of another length, or another type.
    """
    if is_single(value):
        return [value] * n
    if not isinstance(value, (list, tuple)) or len(value) != n:
        raise RequestError(f"{param} must be one value or a list of {n} (one per fork)", param)
    return list(value)


def fork_count(n: Any, max_n: int) -> int:
    """``fork``'s ``n``: an integer in ``[1, max_n]`` (``EngineConfig.max_n``, the bound of
    ``SamplingParams.n``: a fork's children run their turns as one batch of ``n`` requests).

    Raises:
        RequestError: (param ``n``) not an integer (a bool is not one), below 1 or above ``max_n``.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise RequestError(f"n must be an integer >= 1, got {n!r}", "n")
    if n > max_n:
        raise RequestError(f"fork n={n} exceeds this engine's max_n {max_n}", "n")
    return n


def _encode(owner: Any, text: str, param: str) -> List[int]:
    return encode_text(owner.tokenizer, text, param)


def initial_context(owner: Any, prompt: Prompt) -> Tuple[List[int], Optional[List[dict]]]:
    """A session's first context on ``owner`` (an ``LLM`` or ``AsyncLLM``): ``(token ids,
    messages or None)`` from text (no template), token ids, or chat messages (rendered without a
    generation prompt: ``chat`` adds the next turn); None: empty.

    Raises:
        RequestError: (param ``prompt``) a malformed prompt, or text / messages without a tokenizer.
    """
    if prompt is None:
        return [], None
    if isinstance(prompt, str):
        if owner.tokenizer is None:
            raise RequestError("text prompts need the model's tokenizer", "prompt")
        return _encode(owner, prompt, "prompt") if prompt else [], None
    if is_messages(prompt):
        msgs = messages(prompt, "prompt")
        if owner.tokenizer is None:
            raise RequestError("chat messages need the model's tokenizer", "prompt")
        text = render_messages(owner.tokenizer, msgs, False, "prompt") if msgs else ""
        return _encode(owner, text, "prompt"), msgs
    return token_ids(prompt, int(owner.engine.vocab_size), "prompt"), None


def select_prompt(owner: Any, prompt: Prompt, param: str = "prompt") -> List[int]:
    """Token ids of ``select``'s prompt: text (no template), token ids, or chat messages (rendered
    with the assistant's generation prompt: the choices are the reply).

    Raises:
        RequestError: (param ``param``) an empty or malformed prompt.
    """
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError("prompt must not be empty", param)
        return _encode(owner, prompt, param)
    if is_messages(prompt):
        msgs = messages(prompt, param)
        if not msgs:
            raise RequestError("prompt must not be an empty conversation", param)
        return _encode(owner, render_messages(owner.tokenizer, msgs, True, param), param)
    ids = token_ids(prompt, int(owner.engine.vocab_size), param)
    if not ids:
        raise RequestError("prompt must not be empty", param)
    return ids


def choice_ids(tokenizer: Any, vocab_size: int, choices: Any) -> List[List[int]]:
    """Each choice's token ids (a str tokenized on its own, no special tokens; or token ids).

    Raises:
        RequestError: (param ``choices``) not a non-empty list, an empty string, a choice without
            tokens, or malformed token ids.
    """
    if isinstance(choices, (str, bytes)) or not isinstance(choices, Sequence) or len(choices) == 0:
        raise RequestError("choices must be a non-empty list of str (or of token-id lists)", "choices")
    out = []
    for c in choices:
        if isinstance(c, str):
            if not c:
                raise RequestError("choices must not hold an empty string", "choices")
            if tokenizer is None:
                raise RequestError("text prompts and chat need the model's tokenizer", "prompt")
            ids = encode_text(tokenizer, c, "choices")
        else:
            ids = token_ids(c, vocab_size, "choices")
        if not ids:
            raise RequestError(f"choice {c!r} has no tokens", "choices")
        out.append(ids)
    return out
