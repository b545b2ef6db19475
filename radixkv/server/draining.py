"""`radixkv serve`'s uvicorn server with a bounded graceful shutdown (``--shutdown-timeout``)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Optional

import uvicorn

__all__ = ["DrainingServer"]

logger = logging.getLogger(__name__)

_ABORT_GRACE_S = 10.0
"""Seconds after the abort before uvicorn cancels the request tasks still left (a backstop)."""


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose graceful shutdown (SIGTERM, Ctrl-C) gives the requests in flight
    ``shutdown_timeout`` seconds (None: no limit), then aborts those still running through
    ``abort_all`` (an async callable: ``EngineBackend.abort_requests(None)``), so each one's
    response or stream ends with finish_reason ``"abort"`` (and ``[DONE]``) instead of a cut
    connection; uvicorn cancels what is left 10 s later (``timeout_graceful_shutdown``)."""

    def __init__(self, config: Any, shutdown_timeout: Optional[float], abort_all: Callable[[], Any]) -> None:
        if shutdown_timeout is not None:
            config.timeout_graceful_shutdown = shutdown_timeout + _ABORT_GRACE_S
        super().__init__(config)
        self.shutdown_timeout = shutdown_timeout
        self._abort_all = abort_all
        self._aborting: Optional[asyncio.Task] = None

    async def shutdown(self, sockets: Any = None) -> None:
        timer = None
        if self.shutdown_timeout is not None:
            timer = asyncio.get_running_loop().call_later(self.shutdown_timeout, self._abort)
        try:
            await super().shutdown(sockets)
        finally:
            if timer is not None:
                timer.cancel()

    def _abort(self) -> None:
        logger.warning("shutdown timeout (%s s) reached: aborting the requests still running", self.shutdown_timeout)
        self._aborting = asyncio.ensure_future(self._abort_all())
