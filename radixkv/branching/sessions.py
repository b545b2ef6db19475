"""The public session classes: each is the core's class (:mod:`radixkv.branching.core`) bound to
one driver. :class:`Session` / :class:`Forks` run their calls on an :class:`~radixkv.llm.LLM`
(synchronously, under its lock); :class:`AsyncSession` / :class:`AsyncForks` on an
:class:`~radixkv.async_llm.AsyncLLM` (every call returns an awaitable; pins move on the engine
thread in the step a turn finishes)."""

from __future__ import annotations

from typing import Any

from radixkv.branching.core import Context, ForkList
from radixkv.branching.driver import Program, drive, drive_async

__all__ = ["Session", "Forks", "AsyncSession", "AsyncForks"]


class Forks(ForkList):
    """The children of :meth:`Session.fork` (a list of :class:`Session`), with batch calls
    ``generate`` / ``chat`` (every child's turn in one engine batch) and ``close``; a context
    manager that closes them all."""

    def _run(self, program: Program) -> Any:
        return drive(self._owner_of(), program)

    def __enter__(self) -> "Forks":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Session(Context):
    """A growing, pinned context on an :class:`~radixkv.llm.LLM` (``llm.session(...)``;
    docs/branching.md): ``generate``, ``chat``, ``fork``, ``select``, ``close`` (module
    :mod:`radixkv.branching.core` documents each). Its calls take the LLM's lock like every LLM
    call; a context manager that closes it (also on an exception).

    Attributes:
        namespace: the prefix-cache namespace of its requests.
    """

    _forks = Forks

    def _run(self, program: Program) -> Any:
        return drive(self._owner, program)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class AsyncForks(ForkList):
    """The children of :meth:`AsyncSession.fork`, with batch calls (as :class:`Forks`), awaited;
    an async context manager that closes them all."""

    def _run(self, program: Program) -> Any:
        return drive_async(self._owner_of(), program)

    async def __aenter__(self) -> "AsyncForks":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


class AsyncSession(Context):
    """:class:`Session`'s counterpart on an :class:`~radixkv.async_llm.AsyncLLM`
    (``llm.session(...)``): the same calls, each returning an awaitable (``await s.chat(...)``,
    ``async with await s.fork(n)``); pins move on the engine thread right when a turn's request
    finishes. One turn at a time per session; an async context manager that closes it."""

    _forks = AsyncForks

    def _run(self, program: Program) -> Any:
        return drive_async(self._owner, program)

    async def __aenter__(self) -> "AsyncSession":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()
