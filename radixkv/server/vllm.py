"""vLLM's extra HTTP endpoints on radixkv (an ``APIRouter`` the app includes).

| method | path | answer |
|---|---|---|
| POST | ``/reset_prefix_cache`` | ``/flush_cache``'s semantics: 200 ``{"flushed": true, ...}``; 409 ``requests_running`` while requests are unfinished (as vLLM answers when active requests prevent the reset); 409 ``flush_not_offered`` across replicas |
| GET | ``/version`` | ``{"version": radixkv's version}`` |
| POST | ``/tokenize`` | ``{"count", "max_model_len", "tokens", "token_strs"}`` for a ``prompt`` or chat ``messages`` |
| POST | ``/detokenize`` | ``{"prompt": text}`` for ``tokens`` |

Bodies follow vLLM's ``TokenizeCompletionRequest`` / ``TokenizeChatRequest`` /
``DetokenizeRequest`` (strict: unknown fields are a 400 ``unknown_parameter``); the chat form
renders ``messages`` (tool calls and results too) and ``tools`` as ``/v1/chat/completions`` does.
``model`` is
optional; when given it must be the served model. ``/reset_prefix_cache`` takes vLLM's query
parameters: ``reset_running_requests=true`` (preempting running requests) is refused with a 400
naming it; ``reset_external`` is accepted (radixkv has no external, connector-managed cache).
"""

from __future__ import annotations

from typing import Any, Optional

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict
from starlette.requests import Request

import radixkv
from radixkv.chat_template import encode_chat
from radixkv.errors import RequestError
from radixkv.server.body import check_query, parse_body, query_bool, tokenize_off_loop
from radixkv.server.engine_client import EngineClient, request_error_to_api
from radixkv.server.openai.protocol import APIError, ChatMessage

__all__ = ["router", "TokenizeRequest", "DetokenizeRequest", "query_bool"]

router = APIRouter()


class TokenizeRequest(BaseModel):
    """``POST /tokenize``: a ``prompt`` (vLLM's completion form) or ``messages`` (its chat form,
    rendered with the model's chat template like ``/v1/chat/completions``)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: Optional[bool] = None
    add_generation_prompt: Optional[bool] = True
    continue_final_message: Optional[bool] = False
    return_token_strs: Optional[bool] = False
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict] = None
    tools: Optional[list[dict]] = None
    mm_processor_kwargs: Optional[dict] = None


class DetokenizeRequest(BaseModel):
    """``POST /detokenize``: token ids back to text."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: Optional[str] = None
    tokens: list[int]


def _client(request: Request) -> EngineClient:
    return request.app.state.client


def _check_model(request: Request, model: str | None) -> None:
    if model is not None:
        request.app.state.models.check(model)


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(request: Request) -> dict:
    """Flush the prefix cache (the same as ``/flush_cache``)."""
    check_query(request, ("reset_running_requests", "reset_external"))
    if query_bool(request, "reset_running_requests"):
        raise APIError(
            "reset_running_requests=true is not supported: radixkv flushes only while no request runs "
            "(retry when idle, or use /flush_cache?timeout=SECONDS)",
            "reset_running_requests",
            code="unsupported_parameter",
        )
    query_bool(request, "reset_external")  # validated; there is no external cache to reset
    return await _client(request).flush_or_409()


@router.get("/version")
async def version() -> dict:
    """radixkv's version."""
    return {"version": radixkv.__version__}


@router.post("/tokenize")
async def tokenize(request: Request) -> dict:
    """Token ids of a prompt or a conversation."""
    req = await parse_body(request, TokenizeRequest)
    _check_model(request, req.model)
    return await tokenize_off_loop(request, _tokenize, _client(request), req)


def _tokenize(client: Any, req: TokenizeRequest) -> dict:
    """:func:`tokenize`'s answer (in a worker thread)."""
    tok = client.tokenizer
    for name in ("chat_template", "chat_template_kwargs", "mm_processor_kwargs"):
        if getattr(req, name) is not None:
            raise APIError(f"{name} is not supported by /tokenize", name, code="unsupported_parameter")
    if (req.prompt is None) == (req.messages is None):
        raise APIError("exactly one of prompt and messages is required", "prompt")
    if req.prompt is not None:
        for name in ("add_generation_prompt", "continue_final_message", "tools"):
            if name in req.model_fields_set:
                raise APIError(f"{name} belongs to the chat form (messages)", name)
        add_special = True if req.add_special_tokens is None else req.add_special_tokens
        ids = list(tok.encode(req.prompt, add_special_tokens=add_special))
    else:
        if req.continue_final_message:
            raise APIError(
                "continue_final_message is not supported by /tokenize",
                "continue_final_message",
                code="unsupported_parameter",
            )
        if not req.messages:
            raise APIError("messages must be a non-empty list", "messages")
        for i, m in enumerate(req.messages):
            m.check(i)
        messages = [m.to_template() for m in req.messages]
        try:
            ids = encode_chat(tok, messages, add_generation_prompt=bool(req.add_generation_prompt), tools=req.tools)
        except RequestError as exc:
            raise request_error_to_api(exc, "messages", {"tools": "tools"}) from exc
        if req.add_special_tokens:
            ids = list(tok.build_inputs_with_special_tokens(ids))
    return {
        "count": len(ids),
        "max_model_len": client.max_context_len,
        "tokens": ids,
        "token_strs": list(tok.convert_ids_to_tokens(ids)) if req.return_token_strs else None,
    }


@router.post("/detokenize")
async def detokenize(request: Request) -> dict:
    """The text of token ids (special tokens kept, as vLLM decodes them)."""
    req = await parse_body(request, DetokenizeRequest)
    _check_model(request, req.model)
    client = _client(request)
    vocab = client.model_facts().vocab_size or len(client.tokenizer)
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise APIError(f"tokens must be token ids in [0, {vocab}), got {bad[:5]}", "tokens")
    return {"prompt": client.tokenizer.decode(req.tokens)}
