"""The body of ``POST /v1/responses`` (OpenAI's Responses API) and its translation to the chat
terms the rest of the server speaks.

Field names and shapes follow OpenAI's API reference ("Responses": create) and the ``openai``
SDK's ``response_create_params`` types. Parsing is strict, as for the other endpoints: a field
OpenAI does not define is a 400 ``unknown_parameter``. Every OpenAI field is in one class:

* implemented: ``model``, ``input`` (a string, or items: messages with ``input_text`` /
  ``output_text`` / ``refusal`` parts, ``function_call``, ``function_call_output``),
  ``instructions``, ``tools`` (function tools), ``tool_choice``, ``parallel_tool_calls``,
  ``text.format`` (``text``, ``json_object``, ``json_schema``), ``max_output_tokens``,
  ``temperature``, ``top_p``, ``stream``, ``store``, ``previous_response_id``, ``metadata``
  (echoed; OpenAI's bounds: 16 pairs, keys of 64 and values of 512 characters at most); and
  vLLM's extension ``cache_salt`` (the prefix-cache salt, as on chat);
* accepted without effect on generation: ``user``, ``safety_identifier``, ``prompt_cache_key``,
  ``prompt_cache_retention``, ``service_tier`` (each the SDK's values only: a 400 naming the
  field and them otherwise), ``stream_options.include_obfuscation``,
  ``include: []``, ``truncation: "disabled"``, ``text.verbosity: "medium"``,
  ``reasoning`` without an effort (or effort ``none``), ``top_logprobs: 0``, ``background: false``;
* anything else set (built-in tools such as web search, reasoning effort, images, files, audio,
  ``conversation``, ``prompt``, ``include`` entries, ``truncation: "auto"``, ``max_tool_calls``,
  ``background``, ...): a 400 ``unsupported_parameter`` naming the field.

:meth:`ResponsesRequest.chat_request` builds the equivalent
:class:`~radixkv.server.openai.protocol.ChatCompletionRequest` (messages, chat-form tools and
``tool_choice``, ``max_tokens``, ``response_format``), so the tool plan, the structured-output
constraint and ``SamplingParams`` come from the one place chat uses
(:mod:`radixkv.server.openai.params`).
"""

from __future__ import annotations

from typing import Any, Iterable, Optional, Union

from pydantic import ValidationError

from radixkv.server.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    PromptCacheRetention,
    ResponsesServiceTier,
    _Strict,
    check_keys,
    check_metadata,
    unsupported,
)

__all__ = ["ResponsesRequest", "input_messages", "chat_param"]

_CHAT_TO_RESPONSES = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text",
}


def chat_param(param: Optional[str]) -> Optional[str]:
    """The Responses field behind a chat request field (for an error's ``param``)."""
    return _CHAT_TO_RESPONSES.get(param, param) if param else param


def remap_error(exc: APIError) -> APIError:
    """``exc`` with its ``param`` (and the field named in its message) in Responses' terms."""
    exc.param = chat_param(exc.param)
    for chat, resp in _CHAT_TO_RESPONSES.items():
        if exc.message.startswith(chat):
            exc.message = resp + exc.message[len(chat) :]
            break
    exc.args = (exc.message,)
    return exc


# The keys each input item and content part may carry: those the openai SDK's input types define
# and no other. The ones a chat prompt has no place for are what a client echoes back from an
# earlier response (``id``, ``status``, ``annotations``, ``logprobs``, a message's ``phase``, a
# call's ``caller`` / ``namespace`` / ``async``) or a cache hint (``prompt_cache_breakpoint``:
# every prefix is cached here anyway); they change nothing.
_PART_KEYS = {
    "input_text": ("type", "text", "prompt_cache_breakpoint"),
    "output_text": ("type", "text", "annotations", "logprobs"),
    "refusal": ("type", "refusal"),
}
_ITEM_KEYS = {
    "message": ("type", "role", "content", "id", "status", "phase"),
    "function_call": ("type", "call_id", "name", "arguments", "id", "status", "caller", "namespace", "async"),
    "function_call_output": ("type", "call_id", "output", "id", "status", "caller", "name", "namespace"),
}


def _text_of(content: Any, where: str, allowed: tuple[str, ...], key: str = "content") -> str:
    """The text of a message's ``content`` (a string or a list of text parts); ``key``: the
    item's field holding it, as errors name it (a ``function_call_output``'s ``output``)."""
    if isinstance(content, str):
        return content
    where = f"{where}.{key}"
    if not isinstance(content, list):
        raise APIError(f"{where} must be a string or a list of content parts, got {content!r:.80}", "input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_image", "input_file", "input_audio"):
            raise unsupported("input", f"{where}[{j}]: {kind} parts are not supported (text only)")
        if kind not in allowed:
            raise APIError(f"{where}[{j}]: a part of type {kind!r} is not valid here ({allowed})", "input")
        own = "refusal" if kind == "refusal" else "text"
        if not isinstance(part.get(own), str):
            raise APIError(f"{where}[{j}]: a {kind} part needs its {own!r} string", "input")
        check_keys(part, _PART_KEYS[kind], f"{where}[{j}]", "input")
        texts.append(part[own])
    return "\n".join(texts)  # NOTE: text parts joined by newlines, as vLLM and chat's messages


def input_messages(items: Union[str, list], earlier_calls: Iterable[str] = ()) -> list[dict]:
    """Chat messages (the form :func:`radixkv.chat_template.render_chat` takes) of ``input``.

    A ``function_call`` item joins the assistant message right before it (the text and the calls
    of one model turn are one assistant message in chat); ``function_call_output`` becomes a
    ``tool`` message. ``earlier_calls``: the ``call_id`` of every function call the conversation
    made before ``input`` (the previous response's).

    Raises:
        APIError: (param ``input``) a malformed or unsupported item, or a
            ``function_call_output`` whose ``call_id`` is no ``function_call``'s before it (in
            ``input`` or ``earlier_calls``), as OpenAI checks.
    """
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    calls = list(earlier_calls)
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError(f"{where} must be an object", "input")
        kind = item.get("type", "message" if "role" in item else None)
        if kind in _ITEM_KEYS:
            check_keys(item, _ITEM_KEYS[kind], where, "input")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(f"{where}.role must be user, system, developer or assistant, got {role!r}", "input")
            allowed = ("output_text", "refusal") if role == "assistant" else ("input_text",)
            if role == "assistant":
                allowed = allowed + ("input_text",)
            text = _text_of(item.get("content"), where, allowed)
            out.append({"role": role, "content": text})
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise APIError(f"{where}: a function_call needs a string {key!r}", "input")
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            calls.append(item["call_id"])
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise APIError(f"{where}: a function_call_output needs a string 'call_id'", "input")
            if item["call_id"] not in calls:
                raise APIError(
                    f"{where}: no function call found for the function_call_output with call_id {item['call_id']!r} "
                    f"(the conversation's function calls: {calls})",
                    "input",
                )
            text = _text_of(item.get("output"), where, ("input_text",), "output")
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
        elif kind in ("reasoning", "item_reference") or isinstance(kind, str):
            raise unsupported("input", f"{where}: items of type {kind!r} are not supported")
        else:
            raise APIError(f"{where} needs a 'type' (or a 'role' for a message)", "input")
    return out


def _chat_tool_choice(choice: Any) -> Any:
    """Responses' ``tool_choice`` in chat's form."""
    if choice is None or isinstance(choice, str):
        return choice
    if not isinstance(choice, dict):
        raise APIError(f"tool_choice must be a string or an object, got {choice!r}", "tool_choice")
    if choice.get("type") == "function":
        check_keys(choice, ("type", "name"), "tool_choice", "tool_choice")
        return {"type": "function", "function": {"name": choice.get("name")}}
    if choice.get("type") == "allowed_tools":
        check_keys(choice, ("type", "mode", "tools"), "tool_choice", "tool_choice")
        listed = choice.get("tools") or []
        for i, t in enumerate(listed):
            if isinstance(t, dict):
                check_keys(t, ("type", "name"), f"tool_choice.tools[{i}]", "tool_choice")
        tools = [{"type": "function", "function": {"name": t.get("name")}} for t in listed]
        return {"type": "allowed_tools", "allowed_tools": {"mode": choice.get("mode"), "tools": tools}}
    raise unsupported("tool_choice", f"only function tool choices are supported, got {choice.get('type')!r}")


class ResponsesRequest(_Strict):
    """``POST /v1/responses`` (see the module docstring for what each field does here)."""

    model: str
    input: Union[str, list[dict[str, Any]]]
    instructions: Optional[str] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[dict[str, Any]] = None
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stream: Optional[bool] = False
    stream_options: Optional[dict[str, Any]] = None
    store: Optional[bool] = True
    previous_response_id: Optional[str] = None
    metadata: Optional[dict[str, str]] = None
    include: Optional[list[str]] = None
    truncation: Optional[str] = None
    reasoning: Optional[dict[str, Any]] = None
    top_logprobs: Optional[int] = None
    background: Optional[bool] = None
    # accepted, no effect
    user: Optional[str] = None
    safety_identifier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    prompt_cache_retention: Optional[PromptCacheRetention] = None
    service_tier: Optional[ResponsesServiceTier] = None
    # vLLM's extension: the prefix-cache salt
    cache_salt: Optional[str] = None
    # unsupported unless unset
    conversation: Union[str, dict[str, Any], None] = None
    prompt: Optional[dict[str, Any]] = None
    max_tool_calls: Optional[int] = None
    context_management: Optional[list[Any]] = None
    moderation: Optional[dict[str, Any]] = None
    image: Optional[dict[str, Any]] = None
    access_programs: Optional[dict[str, Any]] = None
    background_options: Optional[dict[str, Any]] = None
    prompt_cache_options: Optional[dict[str, Any]] = None

    def check_values(self) -> None:
        """What needs no model: unsupported fields and ranges; raises :class:`APIError`."""
        for name in (
            "conversation",
            "prompt",
            "max_tool_calls",
            "context_management",
            "moderation",
            "image",
            "access_programs",
            "background_options",
            "prompt_cache_options",
        ):
            if getattr(self, name) is not None:
                raise unsupported(name, "not supported by this server")
        if self.background:
            raise unsupported("background", "background responses are not supported")
        if self.include:
            raise unsupported("include", f"no extra output data is available, got {self.include}")
        if self.truncation not in (None, "disabled"):
            raise unsupported("truncation", "only 'disabled' is supported (a too-long input is a 400)")
        check_keys(self.reasoning or {}, ("effort", "summary", "generate_summary"), "reasoning", "reasoning")
        r = self.reasoning or {}
        if r.get("effort") not in (None, "none") or r.get("summary") or r.get("generate_summary"):
            raise unsupported("reasoning", "this model does not reason; only effort 'none' is accepted")
        if self.top_logprobs:
            raise unsupported("top_logprobs", "logprobs are not reported by /v1/responses")
        if self.stream_options is not None and not self.stream:
            # NOTE: as chat answers (OpenAI's rule there): options of a stream that is not one change nothing
            raise APIError("The 'stream_options' parameter is only allowed when 'stream' is enabled.", "stream_options")
        if set(self.stream_options or {}) - {"include_obfuscation"}:
            raise APIError(f"stream_options: unknown fields {sorted(self.stream_options)}", "stream_options")
        check_metadata(self.metadata)  # a stored response keeps it
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise APIError(f"max_output_tokens must be >= 1, got {self.max_output_tokens}", "max_output_tokens")
        if isinstance(self.input, list) and not self.input and self.previous_response_id is None:
            raise APIError("input must not be empty", "input")
        text = self.text or {}
        if set(text) - {"format", "verbosity"}:
            raise APIError(f"text: unknown fields {sorted(set(text) - {'format', 'verbosity'})}", "text")
        if text.get("verbosity") not in (None, "medium"):
            raise unsupported("text", "only the model's own verbosity ('medium') is supported")

    def chat_tools(self) -> Optional[list[dict]]:
        """``tools`` in chat's form (function tools only)."""
        if not self.tools:
            return None
        out = []
        for i, tool in enumerate(self.tools):
            if tool.get("type") != "function":
                raise unsupported("tools", f"tools[{i}]: only function tools are supported, got {tool.get('type')!r}")
            extra = set(tool) - {"type", "name", "description", "parameters", "strict"}
            if extra:
                raise APIError(f"tools[{i}]: unknown fields {sorted(extra)}", "tools")
            if not isinstance(tool.get("name"), str):
                raise APIError(f"tools[{i}] needs a string 'name'", "tools")
            fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
            out.append({"type": "function", "function": fn})
        return out

    def response_format(self) -> Optional[dict]:
        """``text.format`` in chat's ``response_format`` form."""
        fmt = (self.text or {}).get("format")
        if fmt is None:
            return None
        if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
            raise APIError(f"text.format.type must be text, json_object or json_schema, got {fmt!r}", "text")
        keys = ("type", "name", "description", "schema", "strict") if fmt["type"] == "json_schema" else ("type",)
        check_keys(fmt, keys, "text.format", "text")
        if fmt["type"] != "json_schema":
            return {"type": fmt["type"]}
        schema = {k: fmt[k] for k in ("name", "description", "schema", "strict") if fmt.get(k) is not None}
        return {"type": "json_schema", "json_schema": schema}

    def chat_request(self, messages: list[dict]) -> ChatCompletionRequest:
        """The chat request generating this response from ``messages`` (checked as chat checks
        it; errors name the Responses fields)."""
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "tools": self.chat_tools(),
            "tool_choice": _chat_tool_choice(self.tool_choice),
            "parallel_tool_calls": self.parallel_tool_calls,
            "max_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "response_format": self.response_format(),
        }
        try:
            req = ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None}, strict=False)
        except ValidationError as exc:
            err = exc.errors()[0]
            loc = [str(p) for p in err.get("loc", ())]
            raise APIError(f"{'.'.join(loc)}: {err.get('msg')}", chat_param(loc[0] if loc else None)) from exc
        try:
            req.check_values()
        except APIError as exc:
            raise remap_error(exc) from exc
        return req

    def echo(self) -> dict[str, Any]:
        """The request fields a Response object repeats."""
        fmt = (self.text or {}).get("format") or {"type": "text"}
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "metadata": dict(self.metadata or {}),
            "parallel_tool_calls": True if self.parallel_tool_calls is None else self.parallel_tool_calls,
            "previous_response_id": self.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": bool(self.store),
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "text": {"format": fmt, "verbosity": "medium"},
            "tool_choice": self.tool_choice if self.tool_choice is not None else "auto",
            "tools": [dict(t) for t in self.tools or []],
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "truncation": "disabled",
            "user": self.user,
            "service_tier": "default",
        }
