"""``radixkv serve --log-requests FILE``: every completions / chat completions request body,
appended to FILE as one JSON line, in the trace format ``radixkv explain`` reads
(:mod:`radixkv.obs.trace`).

A pure ASGI middleware: it passes the request through untouched, copying the body chunks as the
app reads them, and writes the body once it is complete, before the answer starts (so a trace
holds the requests in the order they were read). Bodies that are not a JSON object are not
logged, nor, without API keys, a body with a ``"tenant"`` field (the app answers both with a 400
anyway; a trace line's tenant is only ever the server's).

With API keys (:mod:`radixkv.server.auth`, whose middleware runs first) each line also holds the
request's tenant as ``"tenant"`` (its name, never its key; the server's value replaces any the
body had), and only authenticated requests are logged; ``radixkv explain`` replays a line in
the namespace of its tenant and ``cache_salt``.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Optional

from radixkv.obs.trace import TraceWriter
from radixkv.server.auth import request_tenant

__all__ = ["RequestLogMiddleware", "LOGGED_PATHS"]

LOGGED_PATHS = ("/v1/completions", "/v1/chat/completions")


class RequestLogMiddleware:
    """ASGI middleware logging request bodies of :data:`LOGGED_PATHS` to ``writer``.

    Args:
        app: the ASGI app.
        writer: a :class:`~radixkv.obs.trace.TraceWriter` (thread-safe, one line per body).
    """

    def __init__(self, app: Callable, writer: TraceWriter) -> None:
        self.app = app
        self.writer = writer

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> Any:
        if scope.get("type") != "http" or scope.get("method") != "POST" or scope.get("path") not in LOGGED_PATHS:
            return await self.app(scope, receive, send)
        chunks: list[bytes] = []
        done = False
        tenant = request_tenant(scope)

        async def logging_receive() -> dict:
            nonlocal done
            message = await receive()
            if not done and message.get("type") == "http.request":
                chunks.append(message.get("body", b""))
                if not message.get("more_body", False):
                    done = True
                    self._log(b"".join(chunks), tenant.name if tenant is not None else None)
            return message

        return await self.app(scope, logging_receive, send)

    def _log(self, raw: bytes, tenant: Optional[str]) -> None:
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return
        if not isinstance(body, dict):
            return
        if tenant is None and "tenant" in body:  # NOTE: the app refuses the field without keys, and
            return  # a trace's "tenant" names the namespace explain replays a line in: never a client's
        self.writer.write(body if tenant is None else dict(body, tenant=tenant))
