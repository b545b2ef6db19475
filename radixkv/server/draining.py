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

_ABORT_EVERY_S = 0.2
"""Seconds between two aborts of what runs, once the shutdown timeout has passed."""


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose graceful shutdown (SIGTERM, Ctrl-C) gives the requests in flight
    ``shutdown_timeout`` seconds (None: no limit), then aborts those still running through
    ``abort_all`` (an async callable: ``EngineBackend.abort_requests(None)``), and again every
    :data:`_ABORT_EVERY_S` until the shutdown ends (a request whose body was still arriving
    reaches the engine later), so each one's response or stream ends as an aborted request's does
    (finish_reason ``"abort"``, a cancelled Response) instead of a cut connection; uvicorn
    cancels what is left :data:`_ABORT_GRACE_S` later (``timeout_graceful_shutdown``)."""

    def __init__(self, config: Any, shutdown_timeout: Optional[float], abort_all: Callable[[], Any]) -> None:
        if shutdown_timeout is not None:
            config.timeout_graceful_shutdown = shutdown_timeout + _ABORT_GRACE_S
        super().__init__(config)
        self.shutdown_timeout = shutdown_timeout
        self._abort_all = abort_all

    async def shutdown(self, sockets: Any = None) -> None:
        aborting = None
        if self.shutdown_timeout is not None:
            aborting = asyncio.ensure_future(self._abort_after(self.shutdown_timeout))
        try:
            await super().shutdown(sockets)
        finally:
            if aborting is not None:
                aborting.cancel()

    async def _abort_after(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
        logger.warning("shutdown timeout (%s s) reached: aborting the requests still running", seconds)
        while True:
            try:
                await self._abort_all()
            except Exception:  # noqa: BLE001 - an engine already gone: uvicorn's backstop ends the rest
                logger.exception("shutdown timeout: aborting the requests failed")
                return
            await asyncio.sleep(_ABORT_EVERY_S)
