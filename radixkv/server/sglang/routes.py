"""SGLang's native HTTP endpoints on radixkv (an ``APIRouter`` the app includes).

| method | path | answer |
|---|---|---|
| POST, PUT | ``/generate`` | :mod:`radixkv.server.sglang.generate` |
| GET | ``/get_model_info``, ``/model_info`` | ``model_path``, ``tokenizer_path``, ``served_model_name``, ``is_generation``, ... (SGLang's keys) |
| GET | ``/server_info``, ``/get_server_info`` | the engine's configuration under SGLang's names, radixkv's own config, ``internal_states`` (the live cache stats), ``version`` |
| GET | ``/health_generate`` | 200 once a one-token generation went through the engine; 503 when the engine stopped |

``/health`` and ``/flush_cache`` (with SGLang's ``timeout`` query parameter) are the app's own
routes. The handlers find the app's :class:`~radixkv.server.engine_client.EngineClient` and
model names in ``request.app.state``.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import Request

import radixkv
from radixkv.sampling_params import SamplingParams
from radixkv.server.auth import request_namespace
from radixkv.server.body import parse_body
from radixkv.server.engine_client import EngineClient
from radixkv.server.sglang.generate import Generate
from radixkv.server.sglang.protocol import GenerateRequest

__all__ = ["router", "model_info", "server_info"]

router = APIRouter()


def _client(request: Request) -> EngineClient:
    return request.app.state.client


def model_info(client: EngineClient, served_model_name: str) -> dict[str, Any]:
    """SGLang's ``/get_model_info`` object for this server."""
    facts = client.model_facts()
    return {
        "model_path": facts.model_path,
        "tokenizer_path": facts.tokenizer_path,
        "served_model_name": served_model_name,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": facts.model_type,
        "architectures": facts.architectures,
        "max_context_len": facts.max_context_len,
    }


def server_info(client: EngineClient, served_model_name: str, stats: dict[str, Any]) -> dict[str, Any]:
    """SGLang's ``/server_info`` object: the settings SGLang clients read under SGLang's names
    (``model_path``, ``tokenizer_path``, ``page_size``, ``max_total_num_tokens``,
    ``max_running_requests``, ``chunked_prefill_size``, ``schedule_policy``,
    ``disable_radix_cache``, ``context_length``, ...), radixkv's whole resolved config under
    ``radixkv_config``, ``internal_states`` (one entry: the live ``cache_stats()``) and
    ``version``."""
    facts = client.model_facts()
    cfg = facts.config
    return {
        "model_path": facts.model_path,
        "tokenizer_path": facts.tokenizer_path,
        "served_model_name": served_model_name,
        "device": cfg.get("device"),
        "dtype": cfg.get("dtype"),
        "page_size": cfg.get("page_size"),
        "max_total_num_tokens": cfg.get("max_total_tokens"),
        "max_running_requests": cfg.get("max_running_requests"),
        "chunked_prefill_size": cfg.get("chunked_prefill_size"),
        "schedule_policy": cfg.get("schedule_policy"),
        "disable_radix_cache": cfg.get("prefix_cache") != "radix",
        "attention_backend": cfg.get("attention_backend"),
        "context_length": facts.max_context_len,
        "random_seed": cfg.get("seed"),
        "radixkv_config": cfg,
        "internal_states": [stats],
        "version": radixkv.__version__,
        "engine": "radixkv",
    }


@router.put("/generate", operation_id="generate_put")
@router.post("/generate", operation_id="generate_post")  # one id per method: OpenAPI's rule
async def generate(request: Request) -> Response:
    """SGLang's native generation (:mod:`radixkv.server.sglang.generate`)."""
    handler = Generate(_client(request))
    result = await handler(await parse_body(request, GenerateRequest), request)
    if isinstance(result, (dict, list)):
        return JSONResponse(result)
    return StreamingResponse(result, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


@router.get("/get_model_info")
@router.get("/model_info")
async def get_model_info(request: Request) -> dict:
    """The served model (SGLang's ``RuntimeEndpoint`` reads ``model_path`` from it)."""
    return model_info(_client(request), request.app.state.models.served)


@router.get("/server_info")
@router.get("/get_server_info")
async def get_server_info(request: Request) -> dict:
    """The server's configuration and live state."""
    client = _client(request)
    stats = (await client.cache_stats()).as_dict()
    return server_info(client, request.app.state.models.served, stats)


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    """200 once a one-token greedy generation went through the engine (SGLang's deep health
    check); the engine refusing or having stopped is a 503 from the app's handlers."""
    client = _client(request)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    run = await client.start(
        "health_generate", [(None, [0])], params, "input_ids", namespace=request_namespace(request)
    )
    await client.collect(request, run)
    return Response(status_code=200)
