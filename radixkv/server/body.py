"""Reading a request body into a pydantic model, strictly: what every route shares (the OpenAI
routes with their own :func:`validation_error`, SGLang's native API, the vLLM extras).

Strict means: the body is a JSON object; JSON types are not coerced (``"3"`` or ``3.0`` is no
integer, ``1`` no boolean; an integer is a valid float); a field the model does not define is a 400
``unknown_parameter`` naming it. Every refusal is an :class:`~radixkv.server.openai.protocol.APIError`
(HTTP 400, OpenAI's error body) whose ``param`` is the dotted path of the field at fault, e.g.
``sampling_params.temperature`` (list positions left out).

Also what every route does with a request before the engine sees it: its size
(:class:`BodyLimitMiddleware`, ``radixkv serve --max-request-bytes``), its query parameters
(:func:`check_query`, :func:`query_bool`) and where its prompt is tokenized
(:func:`tokenize_off_loop`).
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from radixkv.server.openai.protocol import APIError

__all__ = [
    "BodyLimitMiddleware",
    "DEFAULT_MAX_REQUEST_BYTES",
    "body_too_large",
    "check_max_request_bytes",
    "check_query",
    "first_error",
    "is_type_tag",
    "parse_body",
    "parse_json",
    "query_bool",
    "tokenize_off_loop",
    "validation_error",
]

M = TypeVar("M", bound=BaseModel)
R = TypeVar("R")

INLINE_TOKENIZE_BYTES = 32 << 10
"""Bodies up to this size are tokenized on the event loop (milliseconds); larger ones in
:data:`_TOKENIZE_POOL` (:func:`tokenize_off_loop`)."""
_TOKENIZE_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="radixkv-tokenize")

DEFAULT_MAX_REQUEST_BYTES = 32 << 20
"""The largest request body the server reads by default (32 MiB; ``--max-request-bytes``): far
above any prompt the context takes (a 128K-token prompt as JSON token ids is about 1 MB)."""


def check_max_request_bytes(max_bytes: Any) -> None:
    """A ``ValueError`` naming ``max_request_bytes`` unless it is an integer >= 1."""
    if type(max_bytes) is not int or max_bytes < 1:
        raise ValueError(f"max_request_bytes must be an integer >= 1, got {max_bytes!r}")


def body_too_large(limit: int) -> APIError:
    """HTTP 413 in OpenAI's error format naming the limit (``code`` ``request_too_large``)."""
    return APIError(
        f"the request body is larger than this server's limit of {limit} bytes (radixkv serve --max-request-bytes, create_app(max_request_bytes=...))",
        None,
        status_code=413,
        code="request_too_large",
    )


class BodyLimitMiddleware:
    """ASGI middleware refusing a request body over ``max_bytes`` with :func:`body_too_large`:
    at once for a ``Content-Length`` over it (nothing read), and for a body sent without one
    (chunked) as soon as the bytes read pass it (the route reading it gets the 413, so no more
    than ``max_bytes`` plus one chunk is ever held).

    Args:
        app: the ASGI app.
        max_bytes: the limit (>= 1).
        on_error: called with the status (413) of a request refused here (the error metric).
    """

    def __init__(self, app: Callable, max_bytes: int, on_error: Optional[Callable[[int], None]] = None) -> None:
        check_max_request_bytes(max_bytes)
        self.app = app
        self.max_bytes = max_bytes
        self.on_error = on_error

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> Any:
        if scope.get("type") != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or ()).get(b"content-length", b"").strip()
        if declared.isdigit() and int(declared) > self.max_bytes:
            err = body_too_large(self.max_bytes)
            if self.on_error is not None:
                self.on_error(err.status_code)
            body = json.dumps(err.to_dict()).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
            await send({"type": "http.response.start", "status": err.status_code, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return None
        seen = 0

        async def limited_receive() -> dict:
            nonlocal seen
            message = await receive()
            if message.get("type") == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise body_too_large(self.max_bytes)
            return message

        return await self.app(scope, limited_receive, send)


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none", "tuple"})


def is_type_tag(part: Any) -> bool:
    """Whether ``part`` of a pydantic error location names the union member it tried
    (``str``, ``list[str]``, ``GenerateSamplingParams``) rather than a field or a position."""
    p = str(part)
    return not isinstance(part, int) and not (p.isidentifier() and p[0].islower() and p not in _TYPE_TAGS)


def first_error(exc: ValidationError) -> dict:
    """The error of ``exc`` to report: an unknown key first (pydantic lists the errors of a
    union's other members, ``content.str`` say, before it), else the first."""
    errors = exc.errors()
    return next((e for e in errors if e.get("type") == "extra_forbidden"), errors[0])


def validation_error(exc: ValidationError) -> APIError:
    """The 400 for a body pydantic refused: ``param`` is the dotted path of the first field at
    fault; a field the model does not define is ``code="unknown_parameter"``."""
    err = first_error(exc)
    loc = [str(p) for p in err.get("loc", ()) if not isinstance(p, int) and not is_type_tag(p)]
    param = ".".join(loc) or None
    if err.get("type") == "extra_forbidden":
        return APIError(f"{param}: unknown parameter (see docs/server.md)", param, code="unknown_parameter")
    return APIError(f"{param or 'body'}: {err.get('msg')}", param)


def parse_json(
    body: bytes,
    model: type[M],
    to_error: Callable[[ValidationError], APIError] = validation_error,
    strict: Optional[bool] = True,
) -> M:
    """``body`` (a JSON object) validated as ``model`` (``strict``: pydantic's; None: the model's
    own config), a field refused becoming ``to_error(exc)``.

    Raises:
        APIError: malformed JSON, nested too deeply or not UTF-8 (``code="invalid_json"``), not an
            object, or a field refused.
    """
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(f"the request body is not valid JSON: {exc}", None, code="invalid_json") from exc
    except RecursionError:  # NOTE: the stdlib parser recurses once per nesting level
        raise APIError("the request body is not valid JSON: nested too deeply", None, code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError("the request body must be a JSON object", None)
    try:
        return model.model_validate_json(body, strict=strict)
    except ValidationError as exc:
        bad = [e for e in exc.errors() if e["type"] == "json_invalid"]  # e.g. a lone surrogate
        if bad:
            raise APIError(f"the request body is not valid JSON: {bad[0]['msg']}", None, code="invalid_json") from None
        raise to_error(exc) from exc


async def parse_body(request: Request, model: type[M]) -> M:
    """The request's body validated strictly as ``model`` (:func:`parse_json`)."""
    return parse_json(await request.body(), model)


def query_bool(request: Request, name: str, default: bool = False) -> bool:
    """A boolean query parameter (``true``/``false``/``1``/``0``, ``yes``/``no``, ``on``/``off``,
    any case); a 400 naming it otherwise, or given more than once (``?tiers=true&tiers=false``:
    one of the two would be dropped)."""
    raw = request.query_params.get(name)
    if raw is None:
        return default
    if len(request.query_params.getlist(name)) > 1:
        raise APIError(f"query parameter {name} given more than once", name)
    value = raw.strip().lower()
    if value in ("true", "1", "yes", "on"):
        return True
    if value in ("false", "0", "no", "off"):
        return False
    raise APIError(f"query parameter {name} must be true or false, got {raw!r}", name)


def check_query(request: Request, allowed: tuple) -> None:
    """A 400 ``unknown_parameter`` naming the first query parameter not in ``allowed`` (a typo such
    as ``?tier=true`` never passes silently)."""
    for name in request.query_params:
        if name not in allowed:
            raise APIError(
                f"unknown query parameter {name!r}; this route takes {list(allowed) or 'none'}",
                name,
                code="unknown_parameter",
            )


async def tokenize_off_loop(request: Request, fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
    """``fn(*args, **kwargs)`` (a request's tokenizing) where it holds nothing else up: on the
    event loop for a body of at most :data:`INLINE_TOKENIZE_BYTES` (a few milliseconds), else in
    a pool of its own (two threads; the tokenizer lets go of the GIL). A prompt of megabytes takes
    seconds to tokenize: on the loop it stalled every other request; in the loop's default
    executor a few of them took every thread, and small requests queued behind them."""
    if len(await request.body()) <= INLINE_TOKENIZE_BYTES:
        return fn(*args, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(_TOKENIZE_POOL, lambda: fn(*args, **kwargs))
