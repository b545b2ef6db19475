"""Server-sent-event helpers: the ``data: ...`` framing, streamed-text deltas, and merging several
output streams (one per prompt) into one."""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Callable

__all__ = ["Deltas", "chain", "close_all", "framed", "merge", "sse"]


class Deltas:
    """Per-choice streamed-text bookkeeping: the characters sent and the choices finished.

    A running sample's text only grows: the engine holds back what a stop string completed later
    could cut off (:attr:`radixkv.engine.detokenizer.IncrementalDetokenizer.settled_text`), so
    the part not sent yet is always safe to send."""

    def __init__(self) -> None:
        self.sent: dict[int, int] = {}
        self.done: set[int] = set()

    def take(self, index: int, text: str) -> str:
        """The not-yet-sent part of choice ``index``'s cumulative ``text``."""
        start = self.sent.get(index, 0)
        self.sent[index] = len(text)
        return text[start:]

    def finish(self, index: int) -> bool:
        """True the first time ``index`` finishes (its finish chunk is sent once)."""
        if index in self.done:
            return False
        self.done.add(index)
        return True


async def chain(firsts: list, rest: AsyncIterator) -> AsyncIterator[tuple[int, Any]]:
    """The first output of every prompt, then the later ones as they arrive."""
    for i, out in enumerate(firsts):
        yield i, out
    async for item in rest:
        yield item


def sse(obj: dict) -> str:
    """One server-sent event: ``data: <json>`` and a blank line."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def close_all(gens: list) -> None:
    """``aclose()`` every async generator (an unfinished ``AsyncLLM.generate`` aborts its request)."""
    for g in gens:
        try:
            await g.aclose()
        except Exception:  # noqa: BLE001 - closing is best effort; each close aborts its request
            pass


async def merge(gens: list[AsyncIterator]) -> AsyncIterator[tuple[int, Any]]:
    """Interleave several async iterators, yielding (iterator index, item) as items arrive.
    Closing or cancelling the merged iterator cancels every source (which aborts its request)."""
    if len(gens) == 1:
        async for item in gens[0]:
            yield 0, item
        return
    q: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, g: AsyncIterator) -> None:
        try:
            async for item in g:
                await q.put((i, item))
            await q.put((i, done))
        except Exception as exc:  # noqa: BLE001 - re-raised by the consumer
            await q.put((i, exc))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await q.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def framed(
    events: AsyncIterator[str],
    rest: Any,
    error_event: Callable[[Exception], dict],
    on_error: Callable[[Exception], None] | None = None,
) -> AsyncIterator[str]:
    """An SSE response body: ``events``, then ``data: [DONE]``. An error after the headers were
    sent is reported in-band as ``error_event(exc)`` (and told to ``on_error``: the metrics); the
    engine streams in ``rest`` are closed in every case (closing aborts unfinished requests, so a
    disconnect frees their KV slots)."""
    try:
        async for e in events:
            yield e
    except Exception as exc:  # noqa: BLE001 - headers are sent; report in-band
        if on_error is not None:
            on_error(exc)
        yield sse(error_event(exc))
    finally:
        await rest.aclose()
    yield "data: [DONE]\n\n"
