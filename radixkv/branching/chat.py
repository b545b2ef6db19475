"""A chat continued token for token: the prompt of a conversation's next turn built from the
previous turn's tokens (its prompt + the model's reply) and the text the chat template adds, so
a follow-up computes only its new tokens. Sessions (:mod:`radixkv.branching`) and stored
Responses (``previous_response_id``, :mod:`radixkv.server.openai.responses`) continue this way."""

from __future__ import annotations

from typing import Any, List, Mapping, Optional, Sequence

from radixkv.chat_template import render_chat
from radixkv.errors import RequestError
from radixkv.text import encode_text

__all__ = ["continue_chat", "reply_stop_text", "reply_tokens"]

_SENTINEL = "\x00radixkv-reply\x00"


def continue_chat(
    tok: Any,
    tokens: List[int],
    history: List[dict],
    new: List[dict],
    stop_text: Optional[str],
    tools: Optional[Sequence[Mapping[str, Any]]] = None,
) -> List[int]:
    """Token ids of a chat continued token for token: ``tokens`` (the context: the prompt of the
    last turn + the model's reply, whose conversation is ``history``) + the text the chat template
    puts after ``history`` for the ``new`` messages and the assistant's generation prompt (with
    the end-of-turn text after the model's last reply that it did not generate itself;
    ``stop_text`` is the text of the stop token the model stopped on, the last of ``tokens``
    (:func:`reply_stop_text`), None when the last message is not the model's reply). A stop token
    that is not the template's end-of-turn (another EOS, such as ``<|endoftext|>`` beside
    ``<|im_end|>``, or one of ``stop_token_ids`` the reply's text left out) is no text of the
    conversation: it is dropped and the template's end-of-turn closes the reply, so the prompt
    decodes to the conversation's render. Sessions and stored Responses
    (``previous_response_id``) continue this way, so a follow-up computes only its new tokens.

    Raises:
        RequestError: the template renders ``history`` differently once ``new`` is added (param
            ``messages``): the conversation cannot be continued token for token.
    """
    old = render_chat(tok, history, add_generation_prompt=False, tools=tools) if history else ""
    full = render_chat(tok, list(history) + list(new), add_generation_prompt=True, tools=tools)
    if not full.startswith(old):
        raise RequestError(
            "the chat template renders earlier turns differently once a turn is added; a session "
            "cannot continue it token for token (use generate with the whole prompt)",
            "messages",
        )
    text = full[len(old) :]
    tokens = list(tokens)
    if history and history[-1]["role"] == "assistant" and stop_text is not None:
        closing = _reply_closing(tok, history, tools)
        if closing.startswith(stop_text):
            closing = closing[len(stop_text) :]  # the model's end-of-turn token is in the context already
        else:
            tokens = tokens[:-1]  # a stop token the conversation does not have (its K/V was never computed)
        text = closing + text
    return tokens + encode_text(tok, text, "message", "the rendered turn")


def reply_tokens(tok: Any, completion: Any) -> List[int]:
    """The token ids a reply (a ``CompletionOutput``) joins its session's context with: its
    ``token_ids``, except when it ended on a stop string (``finish_reason`` ``"stop"``,
    ``stop_reason`` a str), whose ``text`` is cut before the stop string: then the longest run of
    its tokens whose decoded text starts ``text``, plus the tokens of the rest of ``text`` (a stop
    string that starts inside a token), so the context decodes to exactly the returned text."""
    c = completion
    ids = list(c.token_ids)
    if tok is None or c.finish_reason != "stop" or not isinstance(c.stop_reason, str):
        return ids
    n, head = _longest_head(tok, ids, c.text)
    rest = c.text[len(head) :]
    return ids[:n] + (encode_text(tok, rest, "text") if rest else [])


def _longest_head(tok: Any, ids: List[int], text: str) -> tuple:
    """``(n, decode(ids[:n]))`` for the largest ``n`` whose decoded text starts ``text`` (0 and
    "" when none does).

    NOTE: a binary search, then a downward scan: a prefix's text with its trailing U+FFFD (a
    character cut between tokens) dropped grows with ``n``, so whether it starts ``text`` holds up
    to some ``n`` and not after. Scanning down from ``len(ids)`` decoded every prefix, quadratic
    where a special token the reply's text skips sits early (thousands of tokens: seconds)."""

    def starts(n: int, strip: bool) -> tuple:
        head = tok.decode(ids[:n], skip_special_tokens=False)
        return text.startswith(head.rstrip("\ufffd") if strip else head), head

    lo, hi = 0, len(ids)  # starts(lo, strip) holds (the empty prefix); find the last n where it does
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if starts(mid, True)[0] else (lo, mid - 1)
    for n in range(lo, 0, -1):  # the exact test; a cut character (U+FFFD) steps back a token or two
        ok, head = starts(n, False)
        if ok:
            return n, head
    return 0, ""


def reply_stop_text(tok: Any, completion: Any, params: Any = None) -> str:
    """The text of the stop token a reply (a ``CompletionOutput``) ended on: what
    :func:`continue_chat` takes as ``stop_text``. "" when it stopped otherwise, or when that
    token's text is part of the reply's text (its ``params``: ``include_stop_str_in_output``, or
    no ``detokenize``, whose reply joins the conversation as its decoded tokens; a special token
    ``skip_special_tokens`` drops is not)."""
    c = completion
    # a stop token (stop_token_ids, or EOS whose stop_reason is None) is the last of token_ids
    token_stop = c.finish_reason == "stop" and not isinstance(c.stop_reason, str) and c.token_ids
    if not token_stop or tok is None:
        return ""
    last = [c.token_ids[-1]]
    if params is not None and (params.include_stop_str_in_output or not params.detokenize):
        if tok.decode(last, skip_special_tokens=params.skip_special_tokens):
            return ""  # the reply's own text
    return tok.decode(last, skip_special_tokens=False)


def _reply_closing(tok: Any, hist: List[dict], tools: Any = None) -> str:
    """The text the template puts after the model's last reply (its end-of-turn)."""
    probe = hist[:-1] + [{"role": "assistant", "content": _SENTINEL}]
    rendered = render_chat(tok, probe, add_generation_prompt=False, tools=tools)
    i = rendered.rfind(_SENTINEL)
    return rendered[i + len(_SENTINEL) :] if i >= 0 else ""
