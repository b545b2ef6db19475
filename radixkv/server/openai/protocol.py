"""Request and response bodies of the OpenAI-compatible API (pydantic v2 models).

Field names and shapes follow OpenAI's API reference for ``/v1/completions`` and
``/v1/chat/completions`` (https://platform.openai.com/docs/api-reference; the ``openai``
SDK's ``completion_create_params`` types). Requests are parsed strictly: a string or a float
for an integer, a string for a boolean, and any field neither OpenAI nor the documented
extensions define is a 400 naming the field. Every OpenAI field is in one class
(docs/server.md has the table): implemented; accepted with no effect on generation
(:data:`NO_EFFECT_FIELDS`); or 400 ``unsupported_parameter`` when set to a value that would
change the output (:meth:`_SamplingFields.check_values`).

Extensions accepted in the body (``extra_body`` in the openai client), with vLLM's and
SGLang's names: ``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``,
``stop_token_ids``, ``skip_special_tokens``, ``include_stop_str_in_output``, ``allowed_token_ids``,
``prompt_logprobs``, ``logprob_start_len`` (SGLang),
and the structured-output constraints ``regex``, ``ebnf`` (SGLang), ``guided_json``,
``guided_regex``, ``guided_choice``, ``guided_grammar`` (vLLM) and ``structured_outputs`` (vLLM's
newer object form).

Checks that need the model (prompt length against the context, the model name) live in the
handlers; the checks here only need the request itself. Every failed check raises
:class:`APIError`, which the app renders as HTTP 400 in OpenAI's error format.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Iterable, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

ChatServiceTier = Literal["auto", "default", "flex", "scale", "priority", "fast"]
"""``service_tier`` of chat, the openai SDK's values (``chat.completion_create_params``); another
is a 400 naming the field and these values. Accepted, no effect: one tier here."""

ResponsesServiceTier = Literal["auto", "default", "flex", "scale", "priority", "fast", "ultrafast"]
"""``service_tier`` of ``/v1/responses`` (the SDK's ``responses.ServiceTier``); no effect, the
response says ``"default"``."""

PromptCacheRetention = Literal["in_memory", "24h"]
"""``prompt_cache_retention`` (chat and Responses, the SDK's values); no effect: a cached prefix
stays until evicted, whatever the value."""

NO_EFFECT_FIELDS = {
    "chat": (
        "user",
        "metadata",
        "store",
        "service_tier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "prompt_cache_options",
        "safety_identifier",
        "prediction",
    ),
    "completions": ("user",),
}
"""OpenAI fields accepted and without effect on generation here (``prompt_cache_key``, else
``user``, only picks the replica under ``--router-policy session``; it is never a cache
namespace: a request's namespace is its API key's tenant and its ``cache_salt``,
:func:`radixkv.server.auth.request_namespace`; ``prediction`` only speeds OpenAI up and never
changes its output)."""


class APIError(Exception):
    """An error for the client, rendered as ``{"error": {"message", "type", "param", "code"}}``.

    Args:
        message: human-readable reason, naming the field and the limit.
        param: the request field at fault (None when not one field).
        status_code: HTTP status (400 for bad input).
        type: OpenAI error type (``invalid_request_error`` for 4xx).
        code: short machine-readable code, e.g. ``invalid_value`` or ``model_not_found``.
    """

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status_code: int = 400,
        type: str = "invalid_request_error",
        code: str | None = "invalid_value",
    ):
        super().__init__(message)
        self.message = message
        self.param = param
        self.status_code = status_code
        self.type = type
        self.code = code

    def to_dict(self) -> dict:
        """The JSON body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def unsupported(param: str, why: str) -> APIError:
    """400 ``unsupported_parameter`` naming ``param``."""
    return APIError(f"{param}: {why}", param, code="unsupported_parameter")


def check_keys(obj: dict, allowed: Iterable[str], where: str, param: str) -> None:
    """400 ``unknown_parameter`` naming the first key of ``obj`` (at ``where``) not in
    ``allowed``: what a pydantic model with ``extra="forbid"`` does, for the objects the protocol
    keeps as plain dicts."""
    extra = sorted(set(obj) - set(allowed))
    if extra:
        raise APIError(f"{where}.{extra[0]}: unknown parameter (see docs/server.md)", param, code="unknown_parameter")


def check_metadata(meta: Optional[dict[str, str]]) -> None:
    """OpenAI's bounds on ``metadata`` (at most 16 pairs, keys of at most 64 characters, values
    of at most 512), as OpenAI checks them on chat and Responses; past them a 400 naming it."""
    meta = meta or {}
    if len(meta) > 16:
        raise APIError(f"metadata may hold at most 16 key-value pairs, got {len(meta)}", "metadata")
    for k, v in meta.items():
        if len(k) > 64:
            raise APIError(f"metadata keys must be at most 64 characters, got one of {len(k)}", "metadata")
        if len(v) > 512:
            raise APIError(f"metadata values must be at most 512 characters, got one of {len(v)}", "metadata")


def server_error_event(exc: Exception) -> dict:
    """The in-band OpenAI error event for a failure after a stream's headers were sent."""
    return APIError(str(exc), type="server_error", code="internal_error").to_dict()


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class StreamOptions(_Strict):
    include_usage: Optional[bool] = False
    include_obfuscation: Optional[bool] = None  # no effect: chunks carry no obfuscation field


class StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs`` object (one of its fields at most)."""

    json_: Union[str, dict[str, Any], None] = Field(None, alias="json")
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None


class _SamplingFields(_Strict):
    """The fields both endpoints share (OpenAI names; extensions at the end)."""

    model: str
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    n: Optional[int] = 1
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None
    # vLLM / SGLang extensions
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: Optional[int] = None
    ignore_eos: Optional[bool] = False
    stop_token_ids: Optional[list[int]] = None
    skip_special_tokens: Optional[bool] = None
    include_stop_str_in_output: Optional[bool] = None
    allowed_token_ids: Optional[list[int]] = None
    prompt_logprobs: Optional[int] = None
    logprob_start_len: Optional[int] = None
    regex: Optional[str] = None
    ebnf: Optional[str] = None
    guided_json: Union[str, dict[str, Any], None] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    structured_outputs: Optional[StructuredOutputs] = None
    # vLLM's: the prefix-cache salt (a non-empty string of at most 128 characters)
    cache_salt: Optional[str] = None

    def check_values(self) -> None:
        """Checks of this endpoint's own fields; raises :class:`APIError` (param = the field).
        The sampling fields' types and ranges have one owner, :class:`~radixkv.sampling_params.
        SamplingParams` (its :class:`~radixkv.errors.RequestError` becomes a 400 naming the
        field, :func:`radixkv.server.openai.params.sampling_params`)."""
        if self.stream_options is not None and not self.stream:
            # NOTE: as OpenAI answers: options of a stream that is not one would change nothing
            raise APIError("The 'stream_options' parameter is only allowed when 'stream' is enabled.", "stream_options")
        if self.prompt_logprobs is not None and self.stream:
            # NOTE: as vLLM answers: no chunk carries them (they were dropped without a word)
            raise unsupported("prompt_logprobs", "prompt logprobs are not available when stream is true")

    def routing_key(self) -> Optional[str]:
        """The conversation key ``--router-policy session`` hashes across replicas: OpenAI's
        ``prompt_cache_key`` (its documented routing hint), else the deprecated ``user`` it
        replaces; None: the request's own id."""
        return getattr(self, "prompt_cache_key", None) or self.user

    @property
    def stop_list(self) -> list[str]:
        """``stop`` as a list (empty when unset)."""
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def num_top_logprobs(self) -> Optional[int]:
        """Alternatives per generated token the response reports (None: no logprobs)."""
        raise NotImplementedError


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``. ``prompt``: a string, a list of strings, a list of token ids,
    or a list of token-id lists; each prompt gets ``n`` choices (index ``prompt_idx * n + i``).
    ``max_tokens`` defaults to 16, as in OpenAI's API. ``logprobs`` (0-5) reports that many
    alternatives per token; ``echo`` puts the prompt before each choice's text (and, with
    ``logprobs``, the prompt tokens' logprobs before the generated ones); ``echo`` with
    ``max_tokens`` 0 answers the prompt alone (scoring it, as vLLM: ``completion_tokens`` 0,
    finish ``"length"``)."""

    prompt: Union[str, list[str], list[int], list[list[int]], None] = None
    echo: Optional[bool] = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None
    logprobs: Optional[int] = None
    # SGLang's extension: report the prompt's cached tokens as ``sglext.cached_tokens_details``
    # (``{"device": d, "host": h}``; ``h``: every KV tier below the pool, docs/tiers.md) on the
    # response, or on each prompt's finishing chunk when streamed (what ``bench_serving --backend
    # vllm --cache-report`` reads)
    return_cached_tokens_details: Optional[bool] = False

    def check_values(self) -> None:
        super().check_values()
        if self.suffix:
            raise unsupported("suffix", "fill-in-the-middle is not supported")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise unsupported("best_of", f"only best_of == n is supported, got best_of={self.best_of}, n={self.n}")
        if self.logprobs is not None and not (0 <= self.logprobs <= 5):
            raise APIError(f"logprobs must be in [0, 5], got {self.logprobs}", "logprobs")
        if self.max_tokens == 0 and not self.echo:
            raise APIError("max_tokens must be >= 1 (0 is only allowed with echo, to score the prompt)", "max_tokens")
        if self.max_tokens == 0 and self.min_tokens:  # scoring runs as max_tokens 1 inside: say what was sent
            raise APIError(f"min_tokens must be in [0, max_tokens=0], got {self.min_tokens}", "min_tokens")

    def num_top_logprobs(self) -> Optional[int]:
        return self.logprobs


class TextPart(_Strict):
    """One content part of a message; only ``text`` (and an assistant's ``refusal``) parts are
    supported."""

    type: Literal["text", "refusal", "image_url", "input_audio", "file"]
    text: Optional[str] = None
    refusal: Optional[str] = None
    image_url: Optional[dict[str, Any]] = None
    input_audio: Optional[dict[str, Any]] = None
    file: Optional[dict[str, Any]] = None
    prompt_cache_breakpoint: Optional[dict[str, Any]] = None  # no effect

    def check(self, where: str, role: str) -> None:
        """Raises :class:`APIError` (param ``messages``): a part without its own key, with a key
        of another part type (it would be dropped), or a refusal part outside an assistant message."""
        own = "text" if self.type == "text" else "refusal"
        if getattr(self, own) is None:
            raise APIError(f"{where}: a {self.type} part needs its {own!r} string", "messages")
        reads = {"type", own} | ({"prompt_cache_breakpoint"} if self.type == "text" else set())
        extra = sorted(k for k in self.model_fields_set - reads if getattr(self, k) is not None)
        if extra:
            raise APIError(f"{where}.{extra[0]}: a {self.type} part has no {extra[0]!r}", "messages")
        if self.type == "refusal" and role != "assistant":
            raise APIError(f"{where}: only assistant messages carry refusal parts", "messages")


class FunctionCallIn(_Strict):
    name: str
    arguments: str


class ToolCallIn(_Strict):
    """An assistant message's earlier call."""

    id: str
    type: Literal["function", "custom"] = "function"
    function: Optional[FunctionCallIn] = None
    custom: Optional[dict[str, Any]] = None


_ROLE_OF_FIELD = {"refusal": "assistant", "tool_call_id": "tool"}
"""Message fields only one role's OpenAI message type defines."""


class ChatMessage(_Strict):
    """One message of the conversation (the fields of every role of OpenAI's message union)."""

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Optional[Union[str, list[TextPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCallIn]] = None
    tool_call_id: Optional[str] = None
    refusal: Optional[str] = None
    audio: Optional[dict[str, Any]] = None
    function_call: Optional[dict[str, Any]] = None
    annotations: Optional[list[dict[str, Any]]] = None
    """An assistant message's output annotations (URL citations), as a client that sends a
    response's ``message.model_dump()`` back includes them; they do not change the prompt."""

    def check(self, i: int) -> None:
        """Raises :class:`APIError` (param ``messages``) for what this server cannot render, and
        for a field the message's role does not define or a part key its type does not read
        (OpenAI's message and part types: nothing in a message is dropped without a word)."""
        where = f"messages[{i}]"
        if self.role == "function":
            raise unsupported("messages", f"{where}: role 'function' is deprecated and unsupported; use tools")
        if self.audio is not None:
            raise unsupported("messages", f"{where}: audio is not supported")
        if self.function_call is not None:
            raise unsupported("messages", f"{where}: function_call is deprecated and unsupported; use tool_calls")
        for name in ("refusal", "tool_call_id"):
            if getattr(self, name) is not None and self.role != _ROLE_OF_FIELD[name]:
                raise APIError(f"{where}.{name}: only {_ROLE_OF_FIELD[name]} messages carry {name}", "messages")
        if self.refusal and self.content:  # an empty refusal beside the content loses nothing
            raise APIError(f"{where}: an assistant message carries content or a refusal, not both", "messages")
        for j, part in enumerate(self.content if isinstance(self.content, list) else ()):
            if part.type not in ("text", "refusal"):
                raise unsupported("messages", f"{where}: {part.type} content parts are not supported (text only)")
            part.check(f"{where}.content[{j}]", self.role)
        for j, call in enumerate(self.tool_calls or ()):
            if call.type != "function" or call.function is None:
                raise unsupported("messages", f"{where}: only function tool calls are supported")
            if call.custom is not None:
                raise APIError(f"{where}.tool_calls[{j}].custom: a function tool call has no 'custom'", "messages")
        if self.tool_calls and self.role != "assistant":
            raise APIError(f"{where}: only assistant messages carry tool_calls", "messages")
        if self.annotations and self.role != "assistant":
            raise APIError(f"{where}: only assistant messages carry annotations", "messages")
        if self.role == "tool" and not self.tool_call_id:
            raise APIError(f"{where}: a tool message needs tool_call_id", "messages")
        if self.content is None and not (self.role == "assistant" and (self.tool_calls or self.refusal)):
            raise APIError(f"{where}: content is required", "messages")

    def to_template(self) -> dict:
        """The message as :func:`radixkv.chat_template.render_chat` takes it."""
        out: dict[str, Any] = {"role": self.role}
        if isinstance(self.content, list) and self.content:
            out["content"] = [{"type": "text", "text": p.text if p.type == "text" else p.refusal} for p in self.content]
        else:  # an empty content is no content: the refusal, if any, is the message
            out["content"] = self.content or self.refusal or ""
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": c.function.arguments},
                }
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def check_tool_answers(messages: list[ChatMessage]) -> None:
    """Each ``tool`` message answers a call of the assistant message right before its run of tool
    messages, as OpenAI checks: its ``tool_call_id`` is the ``id`` of one of that message's
    ``tool_calls`` (the rendered prompt carries no ids, so a mismatch would pass unnoticed).

    Raises:
        APIError: (param ``messages``) a tool message after no assistant ``tool_calls``, or whose
            ``tool_call_id`` is none of their ids; the message names its index and the ids.
    """
    calls: Optional[list[str]] = None  # the ids the current run of tool messages may answer
    for i, m in enumerate(messages):
        if m.role != "tool":
            calls = [c.id for c in m.tool_calls or ()] if m.role == "assistant" and m.tool_calls else None
        elif calls is None:
            raise APIError(
                f"messages[{i}]: a tool message must answer a tool call of the assistant message before it "
                "(messages with role 'tool' follow an assistant message with tool_calls)",
                "messages",
            )
        elif m.tool_call_id not in calls:
            raise APIError(
                f"messages[{i}]: tool_call_id {m.tool_call_id!r} is not the id of a tool call of the assistant "
                f"message before it (its tool_calls ids: {calls})",
                "messages",
            )


class FunctionDef(_Strict):
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None  # always enforced: every decoded call is held to its schema


class Tool(_Strict):
    type: Literal["function", "custom"]
    function: Optional[FunctionDef] = None
    custom: Optional[dict[str, Any]] = None


class JSONSchemaFormat(_Strict):
    name: str
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JSONSchemaFormat] = None

    @model_validator(mode="after")
    def _schema_only_for_json_schema(self) -> "ResponseFormat":
        if self.json_schema is not None and self.type != "json_schema":
            raise ValueError(f"json_schema is only read with type 'json_schema', got type {self.type!r}")
        return self


class Prediction(_Strict):
    """``prediction`` (OpenAI's predicted outputs): accepted, no effect (module docstring)."""

    type: Literal["content"]
    content: Union[str, list[dict[str, Any]]]


class PromptCacheOptions(_Strict):
    """``prompt_cache_options`` (OpenAI's cache breakpoints): accepted, no effect (every prefix
    is cached here; module docstring); a key it does not define (``prewarm`` is the Responses
    API's, which skips generation) is refused."""

    mode: Optional[Literal["implicit", "explicit"]] = None
    ttl: Optional[str] = None


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``. ``max_completion_tokens`` is the newer name of
    ``max_tokens``; when both are unset the answer may run to the end of the context."""

    messages: Optional[list[ChatMessage]] = None
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None
    response_format: Optional[ResponseFormat] = None
    tools: Optional[list[Tool]] = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: Optional[bool] = None
    # vLLM's chat-template extensions (radixkv.chat_template.request_template_options)
    add_generation_prompt: Optional[bool] = None
    continue_final_message: Optional[bool] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    chat_template: Optional[Any] = None  # refused: a client's Jinja runs in the server
    # accepted, no effect (NO_EFFECT_FIELDS)
    metadata: Optional[dict[str, str]] = None
    store: Optional[bool] = None
    service_tier: Optional[ChatServiceTier] = None
    prompt_cache_key: Optional[str] = None
    prompt_cache_retention: Optional[PromptCacheRetention] = None
    prompt_cache_options: Optional[PromptCacheOptions] = None
    safety_identifier: Optional[str] = None
    prediction: Optional[Prediction] = None
    # unsupported unless unset (or at their no-op value)
    audio: Optional[dict[str, Any]] = None
    modalities: Optional[list[str]] = None
    moderation: Optional[dict[str, Any]] = None
    web_search_options: Optional[dict[str, Any]] = None
    functions: Optional[list[Any]] = None
    function_call: Union[str, dict[str, Any], None] = None
    reasoning_effort: Optional[str] = None
    verbosity: Optional[str] = None

    def check_values(self) -> None:
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise APIError("max_tokens and max_completion_tokens differ", "max_completion_tokens")
            if self.max_completion_tokens < 1:
                raise APIError(
                    f"max_completion_tokens must be >= 1, got {self.max_completion_tokens}", "max_completion_tokens"
                )
            self.max_tokens = self.max_completion_tokens
        super().check_values()
        check_metadata(self.metadata)
        if not self.messages:
            raise APIError("messages must be a non-empty list", "messages")
        for i, m in enumerate(self.messages):
            m.check(i)
        check_tool_answers(self.messages)
        if self.top_logprobs is not None:
            if not (0 <= self.top_logprobs <= 20):
                raise APIError(f"top_logprobs must be in [0, 20], got {self.top_logprobs}", "top_logprobs")
            if not self.logprobs:
                raise APIError("top_logprobs needs logprobs: true", "top_logprobs")
        if self.audio is not None:
            raise unsupported("audio", "audio output is not supported")
        if self.modalities is not None and list(self.modalities) != ["text"]:
            raise unsupported("modalities", f"only ['text'] is supported, got {self.modalities}")
        for name in ("moderation", "web_search_options"):
            if getattr(self, name) is not None:
                raise unsupported(name, "not supported")
        if self.functions is not None or self.function_call is not None:
            name = "functions" if self.functions is not None else "function_call"
            raise unsupported(name, "deprecated and unsupported; use tools and tool_choice")
        if self.reasoning_effort not in (None, "none"):
            raise unsupported("reasoning_effort", "this model does not reason; only 'none' is accepted")
        if self.verbosity not in (None, "medium"):
            raise unsupported("verbosity", "only the model's own verbosity ('medium') is supported")
        for i, tool in enumerate(self.tools or ()):
            if tool.type != "function" or tool.function is None:
                raise unsupported("tools", "only function tools are supported")
            if tool.custom is not None:
                raise APIError(f"tools[{i}].custom: a function tool has no 'custom'", "tools")
        if self.chat_template is not None:
            raise unsupported(
                "chat_template",
                "a request's own chat template is not run (as vLLM without --trust-request-chat-template)",
            )

    def num_top_logprobs(self) -> Optional[int]:
        return (self.top_logprobs or 0) if self.logprobs else None


# ---------------------------------------------------------------------- responses


def new_id(prefix: str) -> str:
    """An OpenAI-style object id, e.g. ``chatcmpl-3f2a...``."""
    return f"{prefix}-{uuid.uuid4().hex}"


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    """Token counts of one API request. ``prompt_tokens`` counts each prompt once, however many
    choices it has; ``prompt_tokens_details.cached_tokens`` is the engine's ``num_cached_tokens``
    (prompt tokens whose KV came from the prefix cache), always present, 0 on a miss."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    """The legacy completions logprobs: per token its text, logprob, alternatives (text ->
    logprob) and character offset in the choice's text."""

    tokens: list[str] = []
    token_logprobs: list[Optional[float]] = []
    top_logprobs: list[Optional[dict[str, float]]] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    prompt_logprobs: Optional[list[Optional[dict[str, Any]]]] = None  # vLLM's extension


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: Optional[list[TokenLogprob]] = None
    refusal: Optional[list[TokenLogprob]] = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: Optional[str]
    refusal: Optional[str] = None
    tool_calls: Optional[list[ToolCallOut]] = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: Optional[ChoiceLogprobs] = None
    finish_reason: Optional[str] = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: Optional[list[Optional[dict[str, Any]]]] = None  # vLLM's extension


class DeltaFunction(BaseModel):
    name: Optional[str] = None
    arguments: Optional[str] = None


class DeltaToolCall(BaseModel):
    index: int
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: Optional[DeltaFunction] = None


class DeltaMessage(BaseModel):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None
    tool_calls: Optional[list[DeltaToolCall]] = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChoiceLogprobs] = None
    finish_reason: Optional[str] = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Optional[Usage] = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "radixkv"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
