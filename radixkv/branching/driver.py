"""How a branching program meets an engine. A program (a session turn, a fork, ``select``, a
close; :mod:`radixkv.branching.core`) is a generator written once: it yields what it needs from
the engine, as :class:`Submit` (requests to run as one batch) or :class:`EngineCall` (a function
to run on the engine's driver thread), and is sent back the result. Two thin drivers run it:
:func:`drive` on an :class:`~radixkv.llm.LLM` (each effect runs in the caller's thread, under the
LLM's lock) and :func:`drive_async` on an :class:`~radixkv.async_llm.AsyncLLM` (each effect posted
to the engine thread and awaited). A failed effect is thrown into the program, so its ``finally``
leaves the sessions consistent before the error propagates.

The drivers use only the front ends' public methods: ``generate_batch(requests, on_finish)``,
``call_in_engine_thread(fn)`` and, on AsyncLLM, ``submit(fn)`` and ``is_running``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Callable, Generator, Optional, Sequence

__all__ = ["Submit", "EngineCall", "Program", "drive", "drive_async"]

FinishHook = Callable[[Any, Any], None]


@dataclass(frozen=True)
class Submit:
    """Run ``requests`` (each ``(prompt token ids, SamplingParams, namespace)``) as one batch,
    submitted together; the program is sent their final ``RequestOutput`` list, in order.
    ``on_finish[i](engine, output)`` (or None) runs on the engine's driver thread when request
    ``i`` finishes, before any further step (so what it pins is still cached)."""

    requests: Sequence[tuple]
    on_finish: Optional[Sequence[Optional[FinishHook]]] = None


@dataclass(frozen=True)
class EngineCall:
    """Run ``fn(engine)`` on the engine's driver thread; the program is sent its result.

    ``fn`` runs to completion even when the awaiting caller is cancelled meanwhile (AsyncLLM);
    then ``undo(engine, result)`` (if given) runs on the engine thread afterwards, so nothing
    ``fn`` took (a pin reference) is lost. ``release``: ``fn`` only lets go of what the engine
    holds; it is skipped once the AsyncLLM has stopped (its engine holds nothing any more)."""

    fn: Callable[[Any], Any]
    undo: Optional[Callable[[Any, Any], None]] = None
    release: bool = False


Program = Generator[Any, Any, Any]


def drive(llm: Any, program: Program) -> Any:
    """Run ``program`` on an :class:`~radixkv.llm.LLM` and return what it returns (or raise what
    it raises). Each effect runs in the calling thread, taking the LLM's lock."""
    value: Any = None
    error: Optional[BaseException] = None
    while True:
        try:
            effect = program.send(value) if error is None else program.throw(error)
        except StopIteration as stop:
            return stop.value
        value, error = None, None
        try:
            if isinstance(effect, Submit):
                value = llm.generate_batch(effect.requests, effect.on_finish)
            else:
                value = llm.call_in_engine_thread(effect.fn)
        except BaseException as exc:  # noqa: BLE001 - thrown into the program, which re-raises it
            error = exc


async def drive_async(alm: Any, program: Program) -> Any:
    """Run ``program`` on an :class:`~radixkv.async_llm.AsyncLLM` and return what it returns (or
    raise what it raises); each effect is posted to the engine thread and awaited. Cancelling
    the caller is thrown into the program like any error."""
    value: Any = None
    error: Optional[BaseException] = None
    while True:
        try:
            effect = program.send(value) if error is None else program.throw(error)
        except StopIteration as stop:
            return stop.value
        value, error = None, None
        try:
            if isinstance(effect, Submit):
                value = await alm.generate_batch(effect.requests, effect.on_finish)
            else:
                value = await _engine_call(alm, effect)
        except BaseException as exc:  # noqa: BLE001 - thrown into the program, which re-raises it
            error = exc


async def _engine_call(alm: Any, call: EngineCall) -> Any:
    """``call`` posted at once and awaited; shielded, so cancelling the caller never cancels it
    (its ``undo`` then gets its result on the engine thread)."""
    if call.release and not alm.is_running:
        return None
    fut = alm.submit(call.fn)
    inner = asyncio.wrap_future(fut)
    try:
        return await asyncio.shield(inner)
    except asyncio.CancelledError:
        inner.add_done_callback(lambda f: f.cancelled() or f.exception())  # nobody awaits it any more
        if call.undo is not None:
            undo = call.undo
            fut.add_done_callback(lambda f: _undo_later(alm, f, undo))
        raise


def _undo_later(alm: Any, fut: Any, undo: Callable[[Any, Any], None]) -> None:
    """``undo(engine, result)`` posted to the engine thread, if the call succeeded (a future's
    callback may run on any thread, so it never touches the engine itself)."""
    if fut.cancelled() or fut.exception() is not None:
        return
    result = fut.result()
    alm.submit(lambda engine: undo(engine, result))
