"""Request traces: JSONL files of OpenAI request bodies, and their tokenization.

Format: one JSON object a line, the body of a ``POST /v1/chat/completions`` (it has
``messages``) or ``POST /v1/completions`` (it has ``prompt``: a string or a list of token ids),
exactly as a client sent it. ``radixkv serve --log-requests FILE`` and ``radixkv replay
--log-requests FILE`` write it (:class:`TraceWriter`); blank lines are skipped.

Tokenization (:func:`tokenize_trace`) follows the server: a chat body's messages (text and
refusal content parts joined, assistant ``tool_calls``, ``tool`` results) and its ``tools`` are
rendered with the model's chat template (:func:`radixkv.chat_template.render_chat`) and its
generation prompt, exactly as ``/v1/chat/completions`` renders them (tools in the prompt whatever
the ``tool_choice``); a completions prompt string is encoded without special tokens, a token-id
prompt taken as it is (integers in [0, the tokenizer's vocabulary)). A body with a list of prompts
becomes one request per prompt.

Replies: a trace holds requests only. When a later chat body repeats an earlier one's messages
followed by an ``assistant`` message (a multi-turn client re-sending the history), that
assistant message is taken as what the earlier request generated: its tokens as they appear in
the later prompt, up to and including the model's end-of-turn token, are the earlier request's
``reply`` (the engine caches them when it finishes); a reply of exactly the earlier body's
``max_completion_tokens`` / ``max_tokens`` was cut off there, and the end-of-turn token after it
is the template's, not the model's: it is left out. Other requests get no reply.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Hashable, Iterable, Optional, Sequence

from radixkv.chat_template import render_chat, request_template_options
from radixkv.namespace import Namespace, check_cache_salt
from radixkv.sim import SimRequest
from radixkv.text import encode_text

__all__ = [
    "TraceRequest",
    "read_trace",
    "read_trace_lines",
    "tokenize_trace",
    "TraceWriter",
    "write_trace",
    "message_text",
]


@dataclass
class TraceRequest:
    """One tokenized request of a trace.

    Attributes:
        index: its position in the trace (after splitting multi-prompt bodies).
        line: the line of the file (or body index) it came from.
        kind: "chat" or "completions".
        tokens: the prompt's token ids.
        reply: inferred generated token ids (module docstring), possibly empty.
        text: the rendered prompt text (None for token-id prompts).
        messages: the chat messages as ``{"role", "content"}`` (chat only).
        namespace: its prefix-cache namespace, as the server set it: ``Namespace(tenant,
            cache_salt)`` from the body's ``"tenant"`` (what ``--log-requests`` adds with API
            keys) and ``"cache_salt"``; None when it has neither.
        max_tokens: the body's ``max_completion_tokens`` or ``max_tokens`` (an int; else None):
            a reply of exactly that many tokens was cut off, so the end-of-turn token after it
            in the next turn was never generated (:func:`_set_reply`).
        max_prefix_len: the most tokens it may take from the cache, when the body asks for
            prompt logprobs (:func:`_prompt_logprobs_limit`); else None.
    """

    index: int
    line: int
    kind: str
    tokens: list
    reply: list = field(default_factory=list)
    text: Optional[str] = None
    messages: Optional[list] = None
    namespace: Hashable = None
    max_tokens: Optional[int] = None
    max_prefix_len: Optional[int] = None

    def sim_request(self) -> SimRequest:
        """This request for :mod:`radixkv.sim`."""
        return SimRequest(self.tokens, self.reply, self.namespace, self.max_prefix_len)


_TEMPLATE_FIELDS = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs")
"""A chat body's chat-template fields (vLLM's), rendered as the server renders them."""


def read_trace(path: str | Path) -> list[dict]:
    """The bodies of a JSONL trace file.

    Raises:
        ValueError: a line that is not UTF-8 text or not a JSON object (naming the line).
    """
    return read_trace_lines(path)[0]


def read_trace_lines(path: str | Path) -> tuple[list[dict], list[int]]:
    """The bodies of a JSONL trace file and the line of the file each is on (blank lines are
    skipped, so a body's position is not its line; :func:`tokenize_trace` takes them as ``lines``).

    Raises:
        ValueError: as :func:`read_trace`.
    """
    bodies, lines = [], []
    with open(path, "rb") as f:
        for no, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(f"{path}:{no}: not UTF-8 text: {exc}") from None
            if not line.strip():
                continue
            try:
                body = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{no}: not JSON: {exc}") from exc
            if not isinstance(body, dict):
                raise ValueError(f"{path}:{no}: a request body must be a JSON object")
            bodies.append(body)
            lines.append(no)
    return bodies, lines


def message_text(content: Any) -> str:
    """A chat message's content as one string (text parts joined, as the server does).

    Raises:
        ValueError: a content part that is not text.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            text = part.get("text" if kind == "text" else "refusal") if kind in ("text", "refusal") else None
            if not isinstance(text, str):
                raise ValueError(f"only text and refusal content parts are supported, got {part!r:.80}")
            parts.append(text)
        return "".join(parts)
    raise ValueError(f"message content must be a string or a list of parts, got {type(content).__name__}")


def _key(messages: Sequence[dict], tools: Optional[list]) -> str:
    return json.dumps([messages, tools], ensure_ascii=False, sort_keys=True, default=repr)


def _template_message(m: Any, i: int) -> dict:
    """A body's message as the server hands it to the chat template (``ChatMessage.to_template``):
    role, content, and ``refusal`` (an assistant's text when its content is empty, as
    :func:`~radixkv.chat_template.render_chat` reads it), ``name``, ``tool_calls``, ``tool_call_id``."""
    if not isinstance(m, dict):
        raise ValueError(f"messages[{i}] must be an object, got {m!r:.80}")
    content = m.get("content")
    if content is None and not (m.get("role") == "assistant" and (m.get("tool_calls") or m.get("refusal"))):
        raise ValueError(f"messages[{i}]: content is required")
    out = {"role": m.get("role"), "content": content}
    for key in ("refusal", "name", "tool_calls", "tool_call_id"):
        if m.get(key) is not None:
            out[key] = m[key]
    return out


def _chat_tools(tools: Any) -> Optional[list]:
    """A body's ``tools`` as the server renders them: its function tools (None: none)."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ValueError(f"tools must be a list, got {tools!r:.80}")
    return [t for t in tools if not isinstance(t, dict) or t.get("function") is not None] or None


def _token_ids(item: Any, vocab: Optional[int]) -> list:
    """A token-id prompt, checked as the server checks it: integers (not bools) in [0, vocab)."""
    for i, t in enumerate(item):
        if isinstance(t, bool) or not isinstance(t, int) or t < 0 or (vocab is not None and t >= vocab):
            limit = f"[0, {vocab})" if vocab is not None else ">= 0"
            raise ValueError(f"prompt token {i} must be an integer token id in {limit}, got {t!r:.40}")
    return list(item)


def tokenize_trace(
    bodies: Iterable[dict],
    tokenizer: Any,
    infer_replies: bool = True,
    invalid: Optional[list] = None,
    lines: Optional[Sequence[int]] = None,
) -> list[TraceRequest]:
    """Tokenize request bodies (module docstring).

    Args:
        invalid: None: a malformed body raises. A list: malformed bodies are skipped and
            ``(position, reason)`` appended to it for each (a server's ``--log-requests`` trace
            also holds the bodies it answered with a 400).
        lines: the file line of each body (:func:`read_trace_lines`), the requests' ``line``;
            None: the body's position (from 1).

    Raises:
        ValueError: (``invalid`` None) a body with neither ``messages`` nor ``prompt``, or
            malformed ones (naming the body's position).
    """
    out: list[TraceRequest] = []
    by_history: dict[str, int] = {}  # messages of a chat request -> its index
    eos = {tokenizer.eos_token_id} if getattr(tokenizer, "eos_token_id", None) is not None else set()
    vocab = len(tokenizer) if hasattr(tokenizer, "__len__") else None
    for no, body in enumerate(bodies, 1):
        mark = len(out)
        line = lines[no - 1] if lines is not None else no
        try:
            ns = _namespace(body)
            if "messages" in body:
                if not isinstance(body["messages"], list) or not body["messages"]:
                    raise ValueError("messages must be a non-empty list of messages")
                conv = [_template_message(m, i) for i, m in enumerate(body["messages"])]
                tools = _chat_tools(body.get("tools"))
                opts = request_template_options(*(body.get(k) for k in _TEMPLATE_FIELDS))
                text = render_chat(tokenizer, conv, tools=tools, **opts)
                ids = encode_text(tokenizer, text, "messages", "the rendered conversation")
                msgs = [{"role": str(m["role"]), "content": message_text(m["content"])} for m in conv]
                req = TraceRequest(len(out), line, "chat", ids, text=text, messages=msgs, max_tokens=_max_tokens(body))
                if infer_replies and len(conv) >= 3 and conv[-2]["role"] == "assistant":
                    j = by_history.get(repr(ns) + _key(conv[:-2], tools))
                    if j is not None:
                        _set_reply(out[j], ids, tokenizer, msgs[-2]["content"], eos)
                by_history[repr(ns) + _key(conv, tools)] = len(out)
                out.append(req)
            elif "prompt" in body:
                p = body["prompt"]
                items = [p] if isinstance(p, str) or (isinstance(p, list) and p and isinstance(p[0], int)) else p
                if not isinstance(items, list) or not items:
                    raise ValueError("prompt must be a non-empty string, token list, or list of those")
                for item in items:
                    if isinstance(item, str):
                        ids = encode_text(tokenizer, item, "prompt")
                        out.append(TraceRequest(len(out), line, "completions", ids, text=item))
                    elif isinstance(item, list):
                        out.append(TraceRequest(len(out), line, "completions", _token_ids(item, vocab)))
                    else:
                        raise ValueError(f"prompt must be a string, a token list, or a list of those, got {item!r:.40}")
            else:
                raise ValueError("a body needs 'messages' (chat) or 'prompt' (completions)")
            if any(not r.tokens for r in out[mark:]):
                raise ValueError("the prompt has no tokens")
            for r in out[mark:]:
                r.namespace, r.max_prefix_len = ns, _prompt_logprobs_limit(body)
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            if invalid is None:
                raise ValueError(f"trace request {no}: {exc}") from exc
            del out[mark:]
            invalid.append((no, str(exc)))
    return out


def _namespace(body: dict) -> Optional[Namespace]:
    """A logged body's namespace: its ``"tenant"`` and ``"cache_salt"`` (None: none).

    Raises:
        ValueError: a ``cache_salt`` the server refuses (:func:`~radixkv.namespace.check_cache_salt`)
            or a ``tenant`` that is not a non-empty string (``--log-requests`` writes its name).
    """
    tenant, salt = body.get("tenant"), check_cache_salt(body.get("cache_salt"))
    if tenant is not None and (not isinstance(tenant, str) or not tenant):
        raise ValueError(f"tenant must be a non-empty string, got {type(tenant).__name__}")
    return Namespace.of(Namespace(tenant, salt))


def _set_reply(earlier: TraceRequest, later_ids: list, tokenizer: Any, content: str, eos: set) -> None:
    """``earlier``'s reply: the tokens after its prompt in ``later_ids``, through the first
    end-of-turn token (or as many tokens as the assistant content encodes to, when none); without
    that token when the tokens before it are exactly ``earlier.max_tokens`` (cut off there)."""
    n = len(earlier.tokens)
    if later_ids[:n] != earlier.tokens:
        return
    rest = later_ids[n:]
    end = next((i + 1 for i, t in enumerate(rest) if t in eos), None)
    if end is None:
        end = min(len(rest), len(tokenizer.encode(content, add_special_tokens=False)) + 1)
    if earlier.max_tokens is not None and end - 1 == earlier.max_tokens:
        end -= 1  # cut off at max_tokens: the template closed the turn, the model never generated it
    earlier.reply = rest[:end]


def _prompt_logprobs_limit(body: dict) -> Optional[int]:
    """The most prompt tokens a body's request may take from the cache when it asks for prompt
    logprobs (``prompt_logprobs``, or a completions ``echo`` with ``logprobs``, as the server maps
    them): ``max(logprob_start_len, 1) - 1`` (docs/sampling.md); None when it does not ask."""

    def count(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    echoed = "prompt" in body and body.get("echo") is True and count(body.get("logprobs"))
    if not (count(body.get("prompt_logprobs")) or echoed):
        return None
    start = body.get("logprob_start_len")
    return max(start if count(start) else 0, 1) - 1


def _max_tokens(body: dict) -> Optional[int]:
    """A chat body's generation limit (``max_completion_tokens``, else ``max_tokens``), or None."""
    for key in ("max_completion_tokens", "max_tokens"):
        v = body.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v >= 1:
            return v
    return None


class TraceWriter:
    """Appends request bodies to a JSONL trace file, one line each, thread-safe; every line is
    flushed at once (a crash loses nothing written before it).

    Args:
        path: the file (appended to; created with its directory when missing, mode 0600: it
            holds every tenant's prompts; an existing file keeps its mode).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_CLOEXEC", 0), 0o600)
        self._f = os.fdopen(fd, "a", encoding="utf-8")
        self._lock = threading.Lock()
        self.count = 0

    def write(self, body: dict) -> None:
        """Append one body."""
        line = json.dumps(body, ensure_ascii=False, separators=(",", ":"))
        with self._lock:
            self._f.write(line + "\n")
            self._f.flush()
            self.count += 1

    def close(self) -> None:
        with self._lock:
            if not self._f.closed:
                self._f.close()

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_trace(path: str | Path, bodies: Iterable[dict]) -> Path:
    """Write ``bodies`` as a new JSONL trace at ``path`` (replacing it); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for b in bodies:
            f.write(json.dumps(b, ensure_ascii=False, separators=(",", ":")) + "\n")
    return path
