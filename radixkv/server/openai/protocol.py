"""Request and response bodies of the OpenAI-compatible API (pydantic v2 models).

Field names and shapes follow OpenAI's API reference for ``/v1/completions`` and
``/v1/chat/completions`` (https://platform.openai.com/docs/api-reference). Unknown request
fields are ignored, so clients written for OpenAI work unchanged. Value checks that need the
model (prompt length against the context, the model name) live in :mod:`radixkv.server.serving`;
the checks here only need the request itself. Every failed check raises :class:`APIError`,
which the app renders as HTTP 400 in OpenAI's error format.

vLLM-style extensions accepted in the body (``extra_body`` in the openai client): ``top_k``,
``min_p``, ``ignore_eos``, ``stop_token_ids``.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field


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


def server_error_event(exc: Exception) -> dict:
    """The in-band OpenAI error event for a failure after a stream's headers were sent."""
    return APIError(str(exc), type="server_error", code="internal_error").to_dict()


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: Optional[bool] = False


class _SamplingFields(_Request):
    """The sampling fields both endpoints share (OpenAI names; vLLM extensions at the end)."""

    model: str
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    n: Optional[int] = 1
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    presence_penalty: Optional[float] = 0.0
    frequency_penalty: Optional[float] = 0.0
    logprobs: Optional[Any] = None
    user: Optional[str] = None
    # vLLM / SGLang extensions
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    ignore_eos: Optional[bool] = False
    stop_token_ids: Optional[list[int]] = None

    def check_values(self) -> None:
        """Range checks that need no model; raises :class:`APIError` (param = the field)."""
        if self.max_tokens is not None and self.max_tokens < 1:
            raise APIError(f"max_tokens must be >= 1, got {self.max_tokens}", "max_tokens")
        if self.temperature is not None and self.temperature < 0:
            raise APIError(f"temperature must be >= 0, got {self.temperature}", "temperature")
        if self.top_p is not None and not (0.0 < self.top_p <= 1.0):
            raise APIError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.n is not None and self.n < 1:
            raise APIError(f"n must be >= 1, got {self.n}", "n")
        if self.top_k is not None and self.top_k < -1:
            raise APIError(f"top_k must be -1 (off) or >= 0, got {self.top_k}", "top_k")
        if self.min_p is not None and not (0.0 <= self.min_p <= 1.0):
            raise APIError(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if any(s == "" for s in stops):
            raise APIError("stop strings must be non-empty", "stop")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise APIError(f"{name} is not supported (only 0)", name, code="unsupported_parameter")
        if self.logprobs:
            raise APIError("logprobs is not supported", "logprobs", code="unsupported_parameter")

    @property
    def stop_list(self) -> list[str]:
        """``stop`` as a list (empty when unset)."""
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``. ``prompt``: a string, a list of strings, a list of token ids,
    or a list of token-id lists; each prompt gets ``n`` choices (index ``prompt_idx * n + i``).
    ``max_tokens`` defaults to 16, as in OpenAI's API."""

    prompt: Union[str, list[str], list[int], list[list[int]], None] = None
    echo: Optional[bool] = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None

    def check_values(self) -> None:
        super().check_values()
        if self.echo:
            raise APIError("echo is not supported", "echo", code="unsupported_parameter")
        if self.suffix:
            raise APIError("suffix is not supported", "suffix", code="unsupported_parameter")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise APIError("best_of other than n is not supported", "best_of", code="unsupported_parameter")


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[dict[str, Any]]]] = None
    name: Optional[str] = None

    def text(self) -> str:
        """The content as one string (text parts of a multi-part content joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError("only text content parts are supported", "messages", code="unsupported_parameter")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``. ``max_completion_tokens`` is the newer name of
    ``max_tokens``; when both are unset the answer may run to the end of the context."""

    messages: Optional[list[ChatMessage]] = None
    max_completion_tokens: Optional[int] = None

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
        if not self.messages:
            raise APIError("messages must be a non-empty list", "messages")


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


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[Any] = None
    finish_reason: Optional[str] = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: Optional[Any] = None
    finish_reason: Optional[str] = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(BaseModel):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: Optional[Any] = None
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
