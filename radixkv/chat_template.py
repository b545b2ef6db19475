"""Rendering a conversation with the model's chat template: the one renderer ``LLM.chat``, the
``AsyncLLM`` callers and the server's chat endpoint share (so the same conversation gives the
same tokens, and the prefix cache sees the same prefix, whichever door it came in by)."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from radixkv.errors import RequestError

__all__ = ["render_chat", "encode_chat"]


def render_chat(tokenizer: Any, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
    """The chat-template text of one conversation (transformers' ``apply_chat_template``).

    Args:
        tokenizer: a transformers tokenizer with a chat template.
        messages: ``{"role", "content"}`` mappings.
        add_generation_prompt: end with the assistant's turn header.

    Raises:
        RequestError: (param ``messages``) a message without ``role`` / ``content``, or the
            template refused the conversation.
    """
    for m in messages:
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise RequestError(f"chat: every message needs 'role' and 'content', got {m!r}", "messages")
    try:
        return tokenizer.apply_chat_template(
            [dict(m) for m in messages], tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except Exception as exc:  # noqa: BLE001 - template errors are the caller's conversation
        raise RequestError(f"messages could not be rendered with the chat template: {exc}", "messages") from exc


def encode_chat(tokenizer: Any, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of :func:`render_chat`'s text. The template already holds the special tokens,
    so none are added when encoding. Raises :class:`~radixkv.errors.RequestError` as it does."""
    text = render_chat(tokenizer, messages, add_generation_prompt)
    return list(tokenizer.encode(text, add_special_tokens=False))
