"""SGLang's native HTTP endpoints on radixkv (an ``APIRouter`` the app includes).

| method | path | answer |
|---|---|---|
| POST, PUT | ``/generate`` | :mod:`radixkv.server.sglang.generate` |
| GET | ``/get_model_info``, ``/model_info`` | ``model_path``, ``tokenizer_path``, ``served_model_name``, ``is_generation``, ... (SGLang's keys) |
| GET | ``/server_info``, ``/get_server_info`` | the engine's configuration under SGLang's names, radixkv's own config, ``internal_states`` (the live cache stats), ``version`` |
| GET | ``/health_generate`` | 200 once a one-token generation went through the engine; 503 when the engine stopped |
| POST | ``/abort_request`` | SGLang's ``AbortReq`` ``{"rid": ..., "abort_all": false}``: aborts that unfinished ``/generate`` request (its stream ends with finish_reason ``{"type": "abort", ...}``, its KV freed), or with ``abort_all`` every unfinished request (with API keys and a key that is not an admin's: its tenant's ``/generate`` requests); 200 with an empty body, also for an unknown or finished ``rid`` (a no-op, as SGLang's) |
| GET | ``/get_load`` | SGLang's load report: a list with one entry per engine (per replica across replicas), ``{"dp_rank", "num_reqs" (running + waiting), "num_waiting_reqs", "num_tokens" (KV tokens held by requests and pins)}`` |

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
from radixkv.server.auth import engine_request_id, request_namespace, request_tenant
from radixkv.server.body import parse_body
from radixkv.server.engine_client import EngineClient
from radixkv.server.sglang.generate import Generate
from radixkv.server.sglang.protocol import AbortRequest, GenerateRequest

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


@router.post("/abort_request")
async def abort_request(request: Request) -> Response:
    """SGLang's ``/abort_request`` (module docstring): 200, empty, once the abort is applied (the
    aborted requests' streams have their final output and no longer count as unfinished)."""
    body = await parse_body(request, AbortRequest)
    body.check_fields()
    backend = _client(request).backend
    if body.abort_all:
        tenant = request_tenant(request)
        # NOTE: a tenant's key aborts only its own /generate requests (their engine ids carry its name)
        prefix = "" if tenant is None or tenant.admin else engine_request_id(request, "")
        await backend.abort_requests(None, prefix)
    elif body.rid:
        await backend.abort_requests([engine_request_id(request, body.rid)])
    return Response(status_code=200)


@router.get("/get_load")
async def get_load(request: Request) -> list:
    """SGLang's ``/get_load`` (what sglang-router polls): each engine's requests and KV tokens."""
    return await _client(request).backend.load()
