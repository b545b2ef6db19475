"""The OpenAI-compatible FastAPI app over an :class:`~radixkv.server.backend.EngineBackend` (one
local :class:`~radixkv.async_llm.AsyncLLM`, or engine replicas on Ray Serve: every route below
answers the same on both, except the flushes, 409 ``flush_not_offered`` across replicas).

Routes:

| method | path | answer |
|---|---|---|
| POST | ``/v1/completions`` | OpenAI completion (JSON, or SSE chunks with ``stream``) |
| POST | ``/v1/chat/completions`` | OpenAI chat completion (JSON, or SSE chunks with ``stream``) |
| POST | ``/v1/responses`` | OpenAI Responses API (JSON, or its event stream with ``stream``; :mod:`radixkv.server.openai.responses`) |
| GET, DELETE | ``/v1/responses/{id}`` | a stored Response; delete it (and its KV pin): ``{"id", "object": "response", "deleted": true}``; 404 ``not_found`` for an unknown id |
| GET | ``/v1/responses/{id}/input_items`` | the input items a stored Response was generated from |
| POST | ``/v1/responses/{id}/cancel`` | 400 ``invalid_request`` for a stored Response (OpenAI cancels only ``background`` responses, which radixkv does not create), 404 ``not_found`` for an unknown id |
| GET | ``/v1/models`` | the served model |
| GET | ``/v1/models/{id}`` | the served model's card (404 ``model_not_found`` for another id) |
| GET | ``/health`` | 200 ``{"status": "ok" or "degraded", "degraded_tiers": [...]}`` while the engine runs (a failing KV tier, e.g. Redis down, is a miss: still 200, named there), 503 otherwise; across replicas also ``"replicas": {"live": L, "replicas": N}``, ``"degraded"`` while ``L < N``, 503 while ``L`` is 0 |
| GET | ``/metrics`` | Prometheus text (see :mod:`radixkv.server.metrics`) |
| GET | ``/cache_stats`` | ``Engine.cache_stats()`` as JSON (capacity, free, evictable, protected, hit_rate, running, waiting, ...; summed over replicas); ``?check=1`` first runs ``Engine.check_integrity()`` (every slot owned once; 500 when not) on the engine, on every replica |
| GET, POST | ``/flush_cache`` | 200 ``{"flushed": true}`` when the prefix cache was flushed; 409 with the reason while requests are unfinished (``?timeout=S``: wait up to S seconds for them first, as SGLang's; ``?tiers=true``: also the KV tiers the engine owns, host and disk, not a shared remote tier) |

SGLang's native routes (:mod:`radixkv.server.sglang.routes`: ``/generate``, ``/get_model_info``,
``/server_info``, ``/health_generate``, ``/abort_request``, ``/get_load``) and vLLM's extras (:mod:`radixkv.server.vllm`:
``/reset_prefix_cache``, ``/version``, ``/tokenize``, ``/detokenize``) are included routers.

With API keys (``create_app(api_keys=...)``, :mod:`radixkv.server.auth`) every route but
``/health`` needs ``Authorization: Bearer <key>`` (401 ``invalid_api_key``), the routes that
describe every tenant answer 403 ``permission_denied`` to a key that is not an admin's, and each
request's prefix-cache namespace is its key's tenant plus its ``cache_salt``.

Every error is ``{"error": {"message", "type", "param", "code"}}``: 400 for bad input (malformed
JSON, schema and value errors, unknown model, too-long prompt), 404/405 for unknown routes,
503 when the engine has stopped, 500 ``request_failed`` when one request's sampling raised in the
engine (only it stopped: :class:`~radixkv.errors.RequestFailed`), 500 otherwise. The handlers
only await the backend (no route touches an engine's internals), so they never block the engine
thread, and concurrent requests batch together in the engine.
"""

from __future__ import annotations

import logging
import weakref
from contextlib import asynccontextmanager
from typing import Any, Callable

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect, Request

from radixkv.async_llm import AsyncLLM, EngineDeadError
from radixkv.engine.events import RequestAdmitted, RequestFinished
from radixkv.errors import RequestFailed
from radixkv.obs.trace import TraceWriter
from radixkv.server.auth import APIKeys, AuthMiddleware, request_namespace, request_tenant
from radixkv.server.backend import EngineBackend, as_backend
from radixkv.server.body import (
    DEFAULT_MAX_REQUEST_BYTES,
    BodyLimitMiddleware,
    check_max_request_bytes,
    check_query,
    first_error,
    is_type_tag,
    parse_json,
    query_bool,
)
from radixkv.server.engine_client import ClientDisconnected, EngineClient
from radixkv.server.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from radixkv.server.openai.chat import Chat
from radixkv.server.openai.completions import Completions
from radixkv.server.openai.params import ModelNames
from radixkv.server.openai.protocol import APIError, ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from radixkv.server.openai.responses import Responses
from radixkv.server.openai.responses_protocol import ResponsesRequest
from radixkv.server.request_log import RequestLogMiddleware
from radixkv.server.sglang.routes import router as sglang_router
from radixkv.server.vllm import router as vllm_router

logger = logging.getLogger(__name__)

__all__ = ["create_app"]

DEFAULT_SERVED_MODEL_NAME = "smollm2-135m"


def validation_error(exc: ValidationError) -> APIError:
    """The 400 for a body pydantic refused: ``param`` is the top-level field at fault; a field no
    one defines is ``unknown_parameter``."""
    err = first_error(exc)
    loc = [str(p) for p in err.get("loc", ()) if not isinstance(p, int)]
    param = loc[0] if loc else None
    where = ".".join(str(p) for p in err.get("loc", ()) if not is_type_tag(p))
    if err.get("type") == "extra_forbidden":
        return APIError(
            f"{where}: unknown parameter (neither OpenAI's API nor radixkv's documented extensions define it; "
            "see docs/server.md)",
            param,
            code="unknown_parameter",
        )
    return APIError(f"{where}: {err.get('msg')}", param)


def _body(model: str) -> dict:
    """The OpenAPI ``requestBody`` of a handler that parses its body itself (strictly, with the
    pydantic model ``model``, whose JSON schema :func:`_openapi` adds to the components)."""
    ref = {"$ref": f"#/components/schemas/{model}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def _openapi(app: FastAPI) -> dict:
    """FastAPI's OpenAPI document plus the request models' JSON schemas (``/openapi.json``:
    what clients and the fuzzing in tests/test_load_fault.py generate bodies from)."""
    if app.openapi_schema is None:
        doc = FastAPI.openapi(app)
        _, defs = models_json_schema(
            [(CompletionRequest, "validation"), (ChatCompletionRequest, "validation")],
            ref_template="#/components/schemas/{model}",
        )
        doc.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
        app.openapi_schema = doc
    return app.openapi_schema


def create_app(
    llm: AsyncLLM | EngineBackend,
    served_model_name: str = DEFAULT_SERVED_MODEL_NAME,
    model_aliases: tuple[str, ...] = (),
    shutdown_engine: bool = False,
    log_requests: str | None = None,
    api_keys: APIKeys | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
) -> FastAPI:
    """Build the app.

    Args:
        llm: the engine the app submits requests to: a running AsyncLLM (served through
            :class:`~radixkv.server.backend.LocalBackend`) or any
            :class:`~radixkv.server.backend.EngineBackend` (Ray Serve's
            :class:`~radixkv.router.ray.RemoteLLM`).
        served_model_name: the ``model`` name clients use and ``/v1/models`` lists.
        model_aliases: more names accepted as ``model`` (e.g. the ``--model`` path).
        shutdown_engine: shut the engine down when the app's lifespan ends (``radixkv serve``).
        log_requests: append every completions / chat body to this JSONL file (the trace
            ``radixkv explain`` reads; :mod:`radixkv.server.request_log`).
        api_keys: the keys and tenants (:class:`~radixkv.server.auth.APIKeys`); None: no
            authentication, one tenant (None).
        max_request_bytes: the largest request body read; a larger one is a 413 in OpenAI's
            format naming the limit (:class:`~radixkv.server.body.BodyLimitMiddleware`).

    Returns:
        A FastAPI app; ``app.state.llm`` (``llm`` as given), ``app.state.backend``,
        ``app.state.metrics``, ``app.state.client`` (the
        :class:`~radixkv.server.engine_client.EngineClient`), ``app.state.models`` and
        ``app.state.responses`` hold its parts.

    Raises:
        TypeError: ``llm`` is neither an AsyncLLM nor an EngineBackend.
        ValueError: ``max_request_bytes`` is not an integer >= 1.
    """
    check_max_request_bytes(max_request_bytes)
    backend = as_backend(llm)
    metrics = ServerMetrics()
    unsubscribe = _subscribe_weakly(backend, metrics)
    request_log = TraceWriter(log_requests) if log_requests else None

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        unsubscribe()
        if request_log is not None:
            request_log.close()
        if shutdown_engine:
            backend.shutdown()

    app = FastAPI(title="radixkv", summary="OpenAI-compatible radixkv server", lifespan=lifespan)
    app.openapi = lambda: _openapi(app)
    if request_log is not None:
        app.add_middleware(RequestLogMiddleware, writer=request_log)

    def count_error(status: int) -> None:
        metrics.request_errors.labels(str(status)).inc()

    if api_keys is not None:  # added after the log, so it runs first: the request log sees the tenant
        app.add_middleware(AuthMiddleware, keys=api_keys, on_error=count_error)
    # added last, so it runs first: a body over the limit is refused before anything reads it
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_bytes, on_error=count_error)
    app.state.api_keys = api_keys
    client = EngineClient(backend, metrics)
    models = ModelNames(served_model_name, model_aliases)
    app.state.llm, app.state.backend, app.state.metrics, app.state.client = llm, backend, metrics, client
    app.state.models, app.state.responses = models, Responses(client, models)
    _add_error_handlers(app, metrics)
    _add_openai_routes(app, client, models, app.state.responses)
    _add_engine_routes(app, client, metrics)
    app.include_router(sglang_router)
    app.include_router(vllm_router)
    return app


def _subscribe_weakly(backend: EngineBackend, metrics: ServerMetrics) -> Callable[[], None]:
    """Subscribe ``metrics`` to the engine's request events, holding it weakly; returns the
    unsubscribe. The lifespan's end unsubscribes, but an app whose lifespan never runs (served
    through httpx's ``ASGITransport``, or built and dropped) is collected with its metrics, and
    the next event lets go of the subscription (an engine outlives many such apps)."""
    ref = weakref.ref(metrics)
    off: list[Callable[[], None]] = []

    def on_event(event: Any) -> None:
        m = ref()
        if m is not None:
            m.on_event(event)
        elif off:  # NOTE: on the thread delivering events: unsubscribing there is immediate
            off[0]()

    off.append(backend.subscribe(on_event, (RequestFinished, RequestAdmitted)))
    return off[0]


def _add_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    """Every error in OpenAI's format (module docstring), counted in ``radixkv_request_errors_total``."""

    def error(exc: APIError) -> JSONResponse:
        metrics.request_errors.labels(status=str(exc.status_code)).inc()
        return JSONResponse(exc.to_dict(), status_code=exc.status_code)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return error(APIError(str(exc.detail), status_code=exc.status_code, code=None))

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, exc: EngineDeadError):
        return error(APIError(str(exc), status_code=503, type="server_error", code="engine_dead"))

    @app.exception_handler(RequestFailed)
    async def _failed(request: Request, exc: RequestFailed):
        return error(APIError(str(exc), status_code=500, type="server_error", code="request_failed"))

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, exc: ClientDisconnected):
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        logger.exception("internal error")
        return error(APIError(f"internal error: {exc!r}", status_code=500, type="server_error", code="internal_error"))


async def _parse(request: Request, model: type) -> Any:
    """The request body validated strictly by the pydantic ``model`` (JSON types are not
    coerced: "3" or 3.0 is no integer, "yes" no boolean).

    Raises:
        ClientDisconnected: the client left before its body arrived.
        APIError: 400 ``invalid_json``, not an object, or a field pydantic refused.
    """
    try:
        body = await request.body()
    except ClientDisconnect as exc:  # the client left before its body arrived: nothing to answer
        raise ClientDisconnected("the client disconnected before sending its body") from exc
    return parse_json(body, model, validation_error, strict=None)


def _respond(result: Any) -> Response:
    """A handler's result: a dict as JSON, an iterator of SSE events as an event stream."""
    if isinstance(result, dict):
        return JSONResponse(result)
    return StreamingResponse(result, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _add_openai_routes(app: FastAPI, client: EngineClient, models: ModelNames, responses: Responses) -> None:
    """``/v1/completions``, ``/v1/chat/completions``, ``/v1/responses[/{id}[/input_items|/cancel]]``,
    ``/v1/models[/{id}]``."""
    completions_handler, chat_handler = Completions(client, models), Chat(client, models)

    @app.post("/v1/completions", openapi_extra=_body("CompletionRequest"))
    async def completions(request: Request) -> Response:
        return _respond(await completions_handler(await _parse(request, CompletionRequest), request))

    @app.post("/v1/chat/completions", openapi_extra=_body("ChatCompletionRequest"))
    async def chat_completions(request: Request) -> Response:
        return _respond(await chat_handler(await _parse(request, ChatCompletionRequest), request))

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        body = await _parse(request, ResponsesRequest)
        return _respond(await responses.create(body, request, request_namespace(request, body.cache_salt)))

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str, request: Request) -> dict:
        check_query(request, ("stream", "starting_after", "include", "include_obfuscation"))
        query_bool(request, "include_obfuscation")  # no effect: nothing is streamed, nothing obfuscated
        for name in ("stream", "starting_after", "include"):
            if name in request.query_params and (name != "stream" or query_bool(request, name)):
                raise APIError(
                    f"{name} is not supported when retrieving a stored response (it is complete: "
                    "retrieve it without stream, starting_after or include)",
                    name,
                    code="unsupported_parameter",
                )
        return responses.retrieve(response_id, _tenant_name(request))

    @app.get("/v1/responses/{response_id}/input_items")
    async def list_input_items(response_id: str, request: Request) -> dict:
        return responses.list_input_items(response_id, _tenant_name(request), request.query_params)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request) -> dict:
        return await responses.delete(response_id, _tenant_name(request))

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str, request: Request) -> dict:
        return responses.cancel(response_id, _tenant_name(request))

    @app.get("/v1/models")
    async def list_models() -> dict:
        card = ModelCard(id=models.served, max_model_len=client.max_context_len)
        return ModelList(data=[card]).model_dump()

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> dict:
        models.check(model_id, param="model")
        return ModelCard(id=models.served, max_model_len=client.max_context_len).model_dump()


def _tenant_name(request: Request) -> str | None:
    tenant = request_tenant(request)
    return tenant.name if tenant is not None else None


def _add_engine_routes(app: FastAPI, client: EngineClient, metrics: ServerMetrics) -> None:
    """``/health``, ``/cache_stats``, ``/metrics``, ``/flush_cache``."""
    backend = client.backend

    @app.get("/health")
    async def health() -> Response:
        if not backend.is_running:
            raise EngineDeadError(f"the engine thread has stopped: {backend.dead_error!r}")
        reps = await backend.replica_health()
        if reps is not None and reps["live"] == 0:
            raise EngineDeadError(
                f"no replica is registered with the router's cache index (0 of {reps['replicas']}): replicas "
                "restarting (Ray Serve restarts them), or the index just restarted and they have not pushed yet"
            )
        tiers = (await client.cache_stats()).tiers  # a failing KV tier is a miss: still healthy
        degraded = sorted(m for m, t in tiers.items() if t.get("degraded"))
        body: dict = {"status": "degraded" if degraded else "ok", "degraded_tiers": degraded}
        if reps is not None:  # a dead replica's requests go elsewhere: still healthy
            body.update(replicas=reps, status="degraded" if degraded or reps["live"] < reps["replicas"] else "ok")
        return JSONResponse(body)

    @app.get("/cache_stats")
    async def cache_stats(request: Request) -> dict:
        check_query(request, ("check",))
        check = query_bool(request, "check")  # every slot owned once (else a 500)
        return (await client.cache_stats(check)).as_dict()

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        try:
            metrics.update_engine(await client.cache_stats())
        except EngineDeadError:  # no replica reports now (Ray Serve restarts them): the last figures
            pass
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/flush_cache", operation_id="flush_cache_post")
    @app.get("/flush_cache", operation_id="flush_cache_get")  # one id per method: OpenAPI's rule
    async def flush_cache(request: Request) -> dict:
        check_query(request, ("timeout", "tiers"))
        raw = request.query_params.get("timeout", "0")
        try:
            timeout = float(raw)
        except ValueError:
            timeout = -1.0
        if not timeout >= 0:
            raise APIError(f"timeout must be a number of seconds >= 0, got {raw!r}", "timeout")
        return await client.flush_or_409(timeout, tiers=query_bool(request, "tiers"))
