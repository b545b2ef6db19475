"""Rendering a conversation with the model's chat template: the one renderer ``LLM.chat``, the
``AsyncLLM`` callers and the server's chat endpoint share (so the same conversation gives the
same tokens, and the prefix cache sees the same prefix, whichever door it came in by).

Tools. Conversations are OpenAI-shaped: ``tools`` is a list of ``{"type": "function",
"function": {"name", "description", "parameters"}}``; an assistant message may carry
``tool_calls`` (``{"id", "type": "function", "function": {"name", "arguments": <JSON text>}}``)
and a ``{"role": "tool", "tool_call_id", "content"}`` message answers one call.

* When the model's own template takes ``tools`` (transformers ``apply_chat_template(tools=...)``;
  detected by rendering a probe tool and looking for its name, :func:`template_takes_tools`),
  the template renders tools, calls and results itself (call arguments are handed to it as
  dicts, transformers' convention).
* Otherwise (SmolLM2's template has no tools section) radixkv renders the built-in tool format,
  the Hermes / Qwen form: the tools' JSON signatures inside ``<tools></tools>`` at the end of the
  system message (:func:`builtin_tools_block`), calls as ``<tool_call>\\n{"name": ...,
  "arguments": {...}}\\n</tool_call>`` in the assistant's content (:func:`format_tool_call`), and
  each run of consecutive tool results as one user turn of ``<tool_response>`` blocks.

Rendering is deterministic: the same tools and history give the same text (JSON is written with
``json.dumps`` in the order given), so each turn of a tool loop extends the previous turn's prompt
and hits the prefix cache. A call's ``arguments`` JSON text is written as sent (only text that is
not JSON, or a value, goes through ``json.dumps``): the server returns the model's own argument
text (:mod:`radixkv.server.parsers.tool_calls`), so a call sent back renders the tokens the model
generated and the next turn reuses the reply's KV too, whatever whitespace the grammar let the
model write.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Optional, Sequence

from radixkv.errors import RequestError
from radixkv.text import encode_text

__all__ = [
    "CHAT_ROLES",
    "TOOL_CALL_CLOSE",
    "TOOL_CALL_OPEN",
    "builtin_tools_block",
    "encode_chat",
    "format_tool_call",
    "render_chat",
    "request_template_options",
    "template_takes_tools",
]

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
"""The message roles rendered: OpenAI's chat roles but the deprecated ``function`` (refused with a
pointer to ``tools``)."""

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
TOOL_CALLS_SEPARATOR = ""
"""Between two calls of one assistant turn (the built-in format): nothing, so that after a
``</tool_call>`` a grammar offers only the end of the turn or another ``<tool_call>``, and a small
model's habit of a newline after a tag does not lead it into repeating the call."""

_PROBE_NAME = "radixkv_probe_tool_5b1f9e"
_takes_tools: dict[str, bool] = {}


def template_takes_tools(tokenizer: Any, chat_template: Optional[str] = None) -> bool:
    """True when the chat template (``chat_template``, else the tokenizer's) renders a ``tools``
    argument: a probe tool's name shows up in the rendered text (cached per template text, the
    last 64 templates)."""
    template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):  # no template, or a dict of named templates
        template = repr(template)
    if template not in _takes_tools:
        probe = [{"type": "function", "function": {"name": _PROBE_NAME, "description": "probe", "parameters": {}}}]
        extra = {} if chat_template is None else {"chat_template": chat_template}
        try:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": "hi"}], tools=probe, tokenize=False, add_generation_prompt=True, **extra
            )
            takes = _PROBE_NAME in text
        except Exception:  # noqa: BLE001 - a template that fails on tools does not take them
            takes = False
        while len(_takes_tools) >= 64:  # callers' own templates: bounded
            del _takes_tools[next(iter(_takes_tools))]
        _takes_tools[template] = takes
    return _takes_tools[template]


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False)


def _function_of(tool: Mapping[str, Any]) -> dict:
    """The ``{"name", "description", "parameters"}`` of one OpenAI tool (keys in that order,
    absent ones left out)."""
    if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
        raise RequestError(f"tools: only function tools are supported, got {tool!r}", "tools")
    fn = tool.get("function")
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise RequestError(f"tools: every tool needs function.name, got {tool!r}", "tools")
    out = {"name": fn["name"]}
    for key in ("description", "parameters"):
        if fn.get(key) is not None:
            out[key] = fn[key]
    return out


def builtin_tools_block(tools: Sequence[Mapping[str, Any]]) -> str:
    """The built-in tool section appended to the system message (Hermes / Qwen form): one JSON
    signature per line inside ``<tools></tools>`` and the call format."""
    sigs = "\n".join(_dumps({"type": "function", "function": _function_of(t)}) for t in tools)
    return (
        "# Tools\n\n"
        "You can call functions to help with the user's request. The available functions are "
        "described by the JSON signatures inside <tools></tools>:\n"
        f"<tools>\n{sigs}\n</tools>\n\n"
        "To call a function, answer with a JSON object holding its name and arguments inside "
        f"{TOOL_CALL_OPEN}{TOOL_CALL_CLOSE} tags, one block per call:\n"
        f'{TOOL_CALL_OPEN}\n{{"name": <function-name>, "arguments": <arguments-json-object>}}\n{TOOL_CALL_CLOSE}'
    )


def _arguments_value(arguments: Any) -> Any:
    """A call's arguments as a JSON value: parsed from JSON text (kept as the string when it is
    not JSON), a mapping as is."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return {} if arguments is None else arguments


def _arguments_json(arguments: Any) -> str:
    """A call's arguments as JSON text: JSON text as it is (the model's own spacing, which the
    server returned: re-serializing it would change the tokens the model generated), anything
    else (text that is not JSON, a value) written by ``json.dumps``."""
    if isinstance(arguments, str):
        try:
            json.loads(arguments)
        except json.JSONDecodeError:
            return _dumps(arguments)
        return arguments
    return _dumps({} if arguments is None else arguments)


def format_tool_call(name: str, arguments: Any) -> str:
    """One call in the built-in format: ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``
    (``arguments``: JSON text, written verbatim, or a value, written by ``json.dumps``; the text
    the call grammar of :func:`radixkv.server.openai.params.forced_calls` makes the model write)."""
    body = '{"name": ' + _dumps(name) + ', "arguments": ' + _arguments_json(arguments) + "}"
    return f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"


def _text(content: Any, where: str) -> str:
    """A message's content as one string (None -> "", text parts joined by newlines, as vLLM
    joins them)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        parts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") not in ("text", "refusal"):
                raise RequestError(f"{where}: only text content parts are supported, got {part!r}", "messages")
            text = part.get("text", part.get("refusal"))
            if not isinstance(text, str):
                raise RequestError(f"{where}: a text part needs a string 'text', got {part!r}", "messages")
            parts.append(text)
        return "\n".join(parts)
    raise RequestError(f"{where}: content must be a string or a list of text parts, got {content!r}", "messages")


def _calls_of(m: Mapping[str, Any], where: str) -> list[tuple[str, Any]]:
    calls = []
    for c in m.get("tool_calls") or ():
        fn = c.get("function") if isinstance(c, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise RequestError(f"{where}: every tool call needs function.name, got {c!r}", "messages")
        calls.append((fn["name"], fn.get("arguments")))
    return calls


def _refusal_or(content: str, m: Mapping[str, Any], where: str) -> str:
    """An assistant message's text: its ``content``, else its ``refusal`` (as the server's
    :meth:`~radixkv.server.openai.protocol.ChatMessage.to_template` renders a response message
    sent back, ``{"content": None, "refusal": ...}``).

    Raises:
        RequestError: (param ``messages``) a refusal beside non-empty content, or on another role.
    """
    refusal = m.get("refusal")
    if refusal is None:
        return content
    if m["role"] != "assistant" or not isinstance(refusal, str):
        raise RequestError(f"{where}.refusal: only assistant messages carry a refusal (a string)", "messages")
    if content and refusal:
        raise RequestError(f"{where}: an assistant message carries content or a refusal, not both", "messages")
    return content or refusal


def _normalize(messages: Sequence[Mapping[str, Any]], tools: Optional[Sequence], native: bool) -> list[dict]:
    """The conversation as the template gets it (see the module docstring)."""
    out: list[dict] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, Mapping) or "role" not in m:
            raise RequestError(f"chat: every message needs 'role' and 'content', got {m!r}", "messages")
        role = m["role"]
        if role == "function":
            raise RequestError(f"{where}: role 'function' is deprecated and unsupported; use tools", "messages")
        if role not in CHAT_ROLES:
            raise RequestError(f"{where}: role must be one of {', '.join(CHAT_ROLES)}; got {role!r}", "messages")
        calls = _calls_of(m, where) if role == "assistant" else []
        if "content" not in m and not calls:
            raise RequestError(f"chat: every message needs 'role' and 'content', got {m!r}", "messages")
        content = _refusal_or(_text(m.get("content"), where), m, where)
        msg = {k: v for k, v in m.items() if k not in ("content", "tool_calls", "refusal") and v is not None}
        msg["content"] = content
        if native:
            if calls:
                msg["tool_calls"] = [
                    {
                        "id": c.get("id"),
                        "type": "function",
                        "function": {"name": name, "arguments": _arguments_value(args)},
                    }
                    for c, (name, args) in zip(m["tool_calls"], calls)
                ]
            out.append(msg)
            continue
        if calls:
            rendered = TOOL_CALLS_SEPARATOR.join(format_tool_call(n, a) for n, a in calls)
            msg["content"] = f"{content}\n{rendered}" if content else rendered
        if role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
            continue
        out.append({k: v for k, v in msg.items() if k not in ("tool_call_id",)})
    if not native and tools:
        block = builtin_tools_block(tools)
        if out and out[0]["role"] in ("system", "developer"):
            out[0]["content"] = f"{out[0]['content']}\n\n{block}" if out[0]["content"] else block
        else:
            out.insert(0, {"role": "system", "content": block})
    for msg in out:
        msg.pop("_tool_results", None)
    return out


def render_chat(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    tools: Optional[Sequence[Mapping[str, Any]]] = None,
    *,
    continue_final_message: bool = False,
    chat_template: Optional[str] = None,
    chat_template_kwargs: Optional[Mapping[str, Any]] = None,
) -> str:
    """The chat-template text of one conversation (transformers' ``apply_chat_template``).

    Args:
        tokenizer: a transformers tokenizer with a chat template.
        messages: OpenAI-shaped messages: ``{"role", "content"}`` (content a string, None, or a
            list of text parts), assistant ``tool_calls``, ``{"role": "tool", "tool_call_id",
            "content"}`` results.
        add_generation_prompt: end with the assistant's turn header.
        tools: OpenAI function tools (None or empty: no tools), rendered by the template when it
            takes them, else in the built-in format (module docstring).
        continue_final_message: end inside the last message (no end-of-turn after it), so the
            model continues it (vLLM's and transformers'; not with ``add_generation_prompt``).
        chat_template: a Jinja template used instead of the tokenizer's.
        chat_template_kwargs: extra variables for the template (e.g. a template's own switches).

    Raises:
        RequestError: (param ``messages``, or ``tools``) a message without ``role`` /
            ``content``, a non-text content part, a malformed tool or call, or the template
            refused the conversation; (param the argument) a bad ``continue_final_message``,
            ``chat_template`` or ``chat_template_kwargs``.
    """
    kwargs = _template_options(add_generation_prompt, continue_final_message, chat_template, chat_template_kwargs)
    tools = list(tools or [])
    for t in tools:
        _function_of(t)
    uses_tools = bool(tools) or any(
        isinstance(m, Mapping) and (m.get("tool_calls") or m.get("role") == "tool") for m in messages
    )
    native = uses_tools and template_takes_tools(tokenizer, kwargs.get("chat_template"))
    conv = _normalize(messages, tools, native)
    if native and tools:
        kwargs["tools"] = [{"type": "function", "function": _function_of(t)} for t in tools]
    try:
        return tokenizer.apply_chat_template(
            conv, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )
    except Exception as exc:  # noqa: BLE001 - template errors are the caller's conversation
        raise RequestError(f"messages could not be rendered with the chat template: {exc}", "messages") from exc


def request_template_options(
    add_generation_prompt: Any, continue_final_message: Any, chat_template_kwargs: Any
) -> dict:
    """:func:`render_chat`'s keywords of a chat request's vLLM fields (None: not sent;
    ``add_generation_prompt`` then True, as vLLM's server defaults it, so continuing the final
    message needs ``add_generation_prompt: false`` there as here). The server's chat route and a
    trace's chat bodies (radixkv explain) read a request alike; :func:`render_chat` checks them."""
    if add_generation_prompt is None:
        add_generation_prompt = True
    opts: dict[str, Any] = {"add_generation_prompt": add_generation_prompt}
    if continue_final_message is not None:
        opts["continue_final_message"] = continue_final_message
    if chat_template_kwargs is not None:
        opts["chat_template_kwargs"] = chat_template_kwargs
    return opts


_RESERVED_TEMPLATE_KWARGS = frozenset(
    ("conversation", "messages", "tools", "add_generation_prompt", "continue_final_message", "tokenize")
    + ("chat_template", "return_dict", "return_tensors", "padding", "truncation", "max_length", "tokenizer_kwargs")
)


def _template_options(
    add_generation_prompt: Any, continue_final_message: Any, chat_template: Any, chat_template_kwargs: Any
) -> dict[str, Any]:
    """``apply_chat_template``'s keywords for :func:`render_chat`'s options, checked.

    Raises:
        RequestError: (param the argument) a non-bool flag, both flags set (as vLLM refuses),
            an empty or non-str ``chat_template``, ``chat_template_kwargs`` not a dict of
            str keys or naming one of ``apply_chat_template``'s own arguments.
    """
    for name, v in (
        ("add_generation_prompt", add_generation_prompt),
        ("continue_final_message", continue_final_message),
    ):
        if not isinstance(v, bool):
            raise RequestError(f"{name} must be a bool, got {v!r}", name)
    if add_generation_prompt and continue_final_message:
        raise RequestError(
            "continue_final_message and add_generation_prompt cannot both be True "
            "(pass add_generation_prompt=False to continue the final message)",
            "continue_final_message",
        )
    kwargs: dict[str, Any] = {"continue_final_message": True} if continue_final_message else {}
    if chat_template is not None:
        if not isinstance(chat_template, str) or not chat_template.strip():
            raise RequestError(f"chat_template must be a non-empty Jinja template string, got {chat_template!r:.80}",
                               "chat_template")  # fmt: skip
        kwargs["chat_template"] = chat_template
    if chat_template_kwargs is not None:
        if not isinstance(chat_template_kwargs, Mapping) or not all(isinstance(k, str) for k in chat_template_kwargs):
            raise RequestError(
                f"chat_template_kwargs must be a dict with str keys, got {chat_template_kwargs!r:.80}",
                "chat_template_kwargs",
            )
        bad = sorted(set(chat_template_kwargs) & _RESERVED_TEMPLATE_KWARGS)
        if bad:
            raise RequestError(
                f"chat_template_kwargs may not set {bad}: messages, tools, add_generation_prompt, "
                "continue_final_message and chat_template are chat's own arguments; the others are set by radixkv",
                "chat_template_kwargs",
            )
        kwargs.update(chat_template_kwargs)
    return kwargs


def encode_chat(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    tools: Optional[Sequence[Mapping[str, Any]]] = None,
    **options: Any,
) -> list[int]:
    """Token ids of :func:`render_chat`'s text (``options``: its keyword-only arguments). The
    template already holds the special tokens, so none are added when encoding. Raises
    :class:`~radixkv.errors.RequestError` as it does."""
    return encode_text(
        tokenizer,
        render_chat(tokenizer, messages, add_generation_prompt, tools, **options),
        "messages",
        "the rendered conversation",
    )
