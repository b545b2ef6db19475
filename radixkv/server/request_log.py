"""``radixkv serve --log-requests FILE``: every completions / chat completions request body,
appended to FILE as one JSON line, in the trace format ``radixkv explain`` reads
(:mod:`radixkv.obs.trace`).

A pure ASGI middleware: it passes the request through untouched, copying the body chunks as the
app reads them. Only requests the app accepted are logged: a body waits until its answer starts
(or the request ends without one: a client that left while its request ran) and is dropped when
the answer is an error (4xx / 5xx: a request that never ran would make ``radixkv explain`` count
cache hits the server never had), as soon as that answer starts. Lines keep the order the bodies
were read in: an accepted body waits for the ones read before it. Bodies that are not a JSON object are not logged, nor, without API keys,
a body with a ``"tenant"`` field (the app answers both with a 400 anyway; a trace line's tenant
is only ever the server's).

With API keys (:mod:`radixkv.server.auth`, whose middleware runs first) each line also holds the
request's tenant as ``"tenant"`` (its name, never its key; the server's value replaces any the
body had), and only authenticated requests are logged; ``radixkv explain`` replays a line in
the namespace of its tenant and ``cache_salt``.
"""

from __future__ import annotations

import json
from collections import deque
from typing import Any, Callable, Optional

from radixkv.obs.trace import TraceWriter
from radixkv.server.auth import request_tenant

__all__ = ["RequestLogMiddleware", "LOGGED_PATHS"]

LOGGED_PATHS = ("/v1/completions", "/v1/chat/completions")


class _Entry:
    """One logged body waiting for its request's outcome."""

    __slots__ = ("body", "ok")

    def __init__(self, body: Optional[dict]) -> None:
        self.body = body
        self.ok: Optional[bool] = None  # None: not known yet


class RequestLogMiddleware:
    """ASGI middleware logging the accepted request bodies of :data:`LOGGED_PATHS` to ``writer``,
    in the order they were read.

    Args:
        app: the ASGI app.
        writer: a :class:`~radixkv.obs.trace.TraceWriter` (thread-safe, one line per body).
    """

    def __init__(self, app: Callable, writer: TraceWriter) -> None:
        self.app = app
        self.writer = writer
        self._pending: deque[_Entry] = deque()  # bodies read, in order, until their outcome is known

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> Any:
        if scope.get("type") != "http" or scope.get("method") != "POST" or scope.get("path") not in LOGGED_PATHS:
            return await self.app(scope, receive, send)
        chunks: list[bytes] = []
        entry: Optional[_Entry] = None
        tenant = request_tenant(scope)

        async def logging_receive() -> dict:
            nonlocal entry
            message = await receive()
            if entry is None and message.get("type") == "http.request":
                chunks.append(message.get("body", b""))
                if not message.get("more_body", False):
                    entry = _Entry(_body(b"".join(chunks), tenant.name if tenant is not None else None))
                    self._pending.append(entry)
            return message

        async def outcome_send(message: dict) -> None:
            if entry is not None and entry.ok is None and message.get("type") == "http.response.start":
                self._decide(entry, int(message.get("status", 500)) < 400)
            await send(message)

        try:
            return await self.app(scope, logging_receive, outcome_send)
        finally:
            if entry is not None and entry.ok is None:  # no answer started: the client left while it ran
                self._decide(entry, True)

    def _decide(self, entry: _Entry, ok: bool) -> None:
        """Record ``entry``'s outcome and write every body at the head whose outcome is known."""
        entry.ok = ok
        if not ok:  # never logged: let it go now, not when the requests read before it end
            entry.body = None
        while self._pending and self._pending[0].ok is not None:
            done = self._pending.popleft()
            if done.ok and done.body is not None:
                self.writer.write(done.body)


def _body(raw: bytes, tenant: Optional[str]) -> Optional[dict]:
    """The line to log for the body ``raw`` (None: not logged)."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    if not isinstance(body, dict):
        return None
    if tenant is None and "tenant" in body:  # NOTE: the app refuses the field without keys, and
        return None  # a trace's "tenant" names the namespace explain replays a line in: never a client's
    return body if tenant is None else dict(body, tenant=tenant)
