"""Tool calls in the built-in (Hermes / Qwen) format, parsed out of model text, whole or as it
streams.

The format (written by :func:`radixkv.chat_template.format_tool_call`, described to the model by
:func:`radixkv.chat_template.builtin_tools_block`, forced for ``tool_choice`` ``required`` /
named by :func:`radixkv.server.openai.params.forced_calls`)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

* :func:`parse_tool_calls` splits a finished output into ``content`` (the text outside the calls)
  and :class:`ToolCall` s. A block that is not a JSON object with a string ``name`` and an
  object ``arguments`` (``parameters`` is accepted too) stays in the content, as does a block cut
  off by the end of the output. Whitespace right before a call and right after one is dropped;
  an output without calls keeps its text unchanged. With ``cut`` (a forced call that ran out of
  ``max_tokens``, a stop string or a stop token, under a grammar that makes every block a call)
  the block cut off by the end is a call all the same, marked incomplete: its name (the one
  allowed function its name so far fits, when it was not finished) and the JSON text of its
  arguments generated so far, as OpenAI and vLLM report a cut call whatever the finish reason;
  with ``partial_tag`` (a forced call, where nothing but a call may be written) also an opening
  tag the end cut off. With ``max_calls`` (``parallel_tool_calls: false``: 1) only the first
  calls are kept; a further block is dropped, neither a call nor content (OpenAI returns at most
  one call then; vLLM keeps the first).
* :class:`ToolCallStream` turns the growing text of a streamed output into OpenAI-shaped deltas:
  content (holding back anything that could be the start of ``<tool_call>``), then per call one
  delta with ``id`` and ``name`` and deltas of argument text. Joined, they equal what
  :func:`parse_tool_calls` gives for the final text (the ``arguments`` string is the model's own
  JSON text of the arguments, unchanged).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from radixkv.chat_template import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

__all__ = ["ToolCall", "ToolCallStream", "parse_tool_calls", "new_call_id"]

_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_NAME_SO_FAR = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)(")?')
_DECODER = json.JSONDecoder()


def new_call_id() -> str:
    """An OpenAI-style tool call id, ``call_`` and 24 hex digits."""
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class ToolCall:
    """One parsed call: ``arguments`` is JSON text (an object; for an incomplete call, the text
    of one generated so far, possibly empty); ``complete`` False for a call cut off by the end of
    the output."""

    name: str
    arguments: str
    id: str = ""
    complete: bool = True

    def __post_init__(self) -> None:
        if not self.id:
            self.id = new_call_id()


@dataclass
class _Partial:
    """A call as far as the text goes: ``name`` once known, ``args`` the argument text that is
    certain, ``complete`` once its closing tag arrived and it parsed."""

    name: Optional[str]
    args: str
    complete: bool


def _parse_call(body: str) -> Optional[ToolCall]:
    """A complete block's call, or None when it is not a valid call."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    key = "arguments" if "arguments" in obj else "parameters"
    args = obj.get(key, {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    m = _HEAD.match(body)
    if m is not None:
        try:
            value, end = _DECODER.raw_decode(body, m.end())
        except json.JSONDecodeError:
            value = None
        if isinstance(value, dict):
            return ToolCall(obj["name"], body[m.end() : end])
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _object_end(text: str, i: int) -> int:
    """The index just past the JSON object (or array) that starts at ``text[i]``, or -1 while it
    is open (strings and escapes respected, so a brace or a tag inside a string is text)."""
    depth, in_str, esc = 0, False, False
    for k in range(i, len(text)):
        ch = text[k]
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return k + 1
    return -1


def _args_prefix(region: str) -> str:
    """The certain prefix of a JSON object's text that has not necessarily ended: everything up
    to its closing brace, or all of it while it is open."""
    if not region.startswith("{"):
        return ""
    end = _object_end(region, 0)
    return region if end < 0 else region[:end]


def _close_of(text: str, start: int, final: bool) -> int:
    """Where the closing tag of the block whose body starts at ``start`` is (-1: not yet): the
    first one after the body's JSON object, so that ``</tool_call>`` inside an argument string
    (which the grammar allows) does not end the call. A body that is no JSON object, or one the
    finished output leaves open, ends at the first closing tag."""
    first = text.find(TOOL_CALL_CLOSE, start)
    if first < 0:  # no closing tag at all (the common case while a call streams): no scan
        return -1
    i = start
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    if i < len(text) and text[i] == "{":
        end = _object_end(text, i)
        if end >= 0:
            return text.find(TOOL_CALL_CLOSE, end)
        if not final:
            return -1
    return first


def _partial_call(body: str) -> _Partial:
    m = _HEAD.match(body)
    if m is None:
        return _Partial(None, "", False)
    return _Partial(json.loads(m.group(1)), _args_prefix(body[m.end() :]), False)


def _cut_call(body: str, names: Sequence[str]) -> ToolCall:
    """The call of a block the end of the output cut off (``body``: its text after the opening
    tag): the name, or when it is unfinished the one function of ``names`` it fits (else the part
    written), and the argument text so far."""
    p = _partial_call(body)
    name = p.name
    if name is None:
        m = _NAME_SO_FAR.match(body)
        so_far = m.group(1) if m is not None else ""
        fits = [n for n in names if n == so_far or (m is None or m.group(2) is None) and n.startswith(so_far)]
        name = fits[0] if len(fits) == 1 else so_far
    return ToolCall(name, p.args, complete=False)


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


def _after_call(parts: list[str], text: str) -> str:
    """Text that follows a call: on a new line when content came before."""
    return "\n" + text if text and any(parts) else text


def _scan(
    text: str, final: bool, cut: Optional[Sequence[str]] = None, partial_tag: bool = True
) -> tuple[str, list[Any]]:
    """(content that is certain, calls) of ``text``; when not ``final`` the last call may be a
    :class:`_Partial` and trailing text that could still change is held back. ``cut`` (the
    allowed function names) with ``final``: a block cut off by the end is an incomplete call (with
    ``partial_tag``, also a part of the opening tag that is all the rest of the output)."""
    parts: list[str] = []
    calls: list[Any] = []
    pos = 0
    while True:
        k = text.find(TOOL_CALL_OPEN, pos)
        start = k + len(TOOL_CALL_OPEN)
        j = _close_of(text, start, final) if k >= 0 else -1
        if final and cut is not None and j < 0:  # a forced call the end cut off (maybe in its tag)
            rest = text[pos:].lstrip()
            if k >= 0 or (partial_tag and rest and TOOL_CALL_OPEN.startswith(rest)):
                before = text[pos:k] if k >= 0 else text[pos : len(text) - len(rest)]
                parts.append(_after_call(parts, before.strip()) if calls else before.rstrip())
                calls.append(_cut_call(text[start:] if k >= 0 else "", cut))
                break
        if k < 0 or (j < 0 and final):  # no further call (a block cut off by the end stays text)
            tail = text[pos:].lstrip() if calls else text[pos:]
            if not final:
                tail = tail[: len(tail) - _held_prefix(tail, TOOL_CALL_OPEN)].rstrip()
            parts.append(_after_call(parts, tail) if calls else tail)
            break
        before = text[pos:k]
        call = _parse_call(text[start:j]) if j >= 0 else None
        if j >= 0 and call is None:  # not a call: the block stays text, as does what came before
            block = before + text[k : j + len(TOOL_CALL_CLOSE)]
            parts.append(_after_call(parts, block.lstrip()) if calls else block)
            pos = j + len(TOOL_CALL_CLOSE)
            continue
        parts.append(_after_call(parts, before.strip()) if calls else before.rstrip())
        if j < 0:
            calls.append(_partial_call(text[start:]))
            break
        calls.append(call)
        pos = j + len(TOOL_CALL_CLOSE)
    return "".join(parts), calls


def parse_tool_calls(
    text: str, cut: Optional[Sequence[str]] = None, partial_tag: bool = True, max_calls: Optional[int] = None
) -> tuple[Optional[str], list[ToolCall]]:
    """(content, calls) of a finished output. ``content`` is None when only calls remain;
    without calls it is ``text`` unchanged.

    Args:
        cut: every block of the output is a call (a grammar made it one): the block the end cut
            off is an incomplete call (``complete`` False) to one of these function names.
        partial_tag: with ``cut``, an output ending in part of the opening tag (after its text or
            calls) was cut in a call too (a forced call); False: that part is text (``auto``).
        max_calls: keep only the first this many calls (None: all); the rest are dropped.
    """
    content, calls = _scan(text, True, cut, partial_tag)
    calls = calls[:max_calls]
    if not calls:
        return text, []
    return (content or None), calls


class ToolCallStream:
    """Incremental :func:`parse_tool_calls` for one streamed choice.

    :meth:`update` takes the choice's cumulative text each time and returns the new deltas:
    ``("content", text)``, ``("call", index, id, name)`` (first for each call) and
    ``("args", index, text)``.
    """

    def __init__(self) -> None:
        self.content = ""  # content sent so far
        self.calls: list[tuple[str, int]] = []  # (id, argument chars sent) per started call
        self.cut_off = False  # the finished output's last call was cut off (incomplete)

    @property
    def num_calls(self) -> int:
        """Calls started so far."""
        return len(self.calls)

    def update(
        self,
        text: str,
        final: bool,
        cut: Optional[Sequence[str]] = None,
        partial_tag: bool = True,
        max_calls: Optional[int] = None,
    ) -> list[tuple]:
        """Deltas for cumulative ``text`` (``final``: the output has finished; ``cut``,
        ``partial_tag`` and ``max_calls``: as :func:`parse_tool_calls`')."""
        content, calls = _scan(text, final, cut, partial_tag)
        calls = calls[:max_calls]
        if final and not calls:
            content = text
        if final:
            self.cut_off = bool(calls) and isinstance(calls[-1], ToolCall) and not calls[-1].complete
        events: list[tuple] = []
        if len(content) > len(self.content) and content.startswith(self.content):
            events.append(("content", content[len(self.content) :]))
            self.content = content
        for i, c in enumerate(calls):
            name = c.name
            args = c.arguments if isinstance(c, ToolCall) else c.args
            if name is None:
                break
            if i == len(self.calls):
                call_id = c.id if isinstance(c, ToolCall) else new_call_id()
                self.calls.append((call_id, 0))
                events.append(("call", i, call_id, name))
            call_id, sent = self.calls[i]
            if len(args) > sent:
                events.append(("args", i, args[sent:]))
                self.calls[i] = (call_id, len(args))
        return events

    def call_ids(self) -> list[str]:
        """The ids given to the calls streamed so far (in order)."""
        return [cid for cid, _ in self.calls]
