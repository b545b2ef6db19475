"""Running a test's closure in a forked child process (the 'fork' start method: the child has
the parent's objects, as a program that forks after making an engine)."""

from __future__ import annotations

import multiprocessing as mp
from typing import Any, Callable


def run_in_fork(child: Callable[[Any], None], timeout: float) -> tuple[Any, int | None]:
    """``child(queue)`` in a forked process: ``(what it put on the queue, its exit code)``; the
    child is killed if it has not ended 10 s after answering (or after ``timeout`` without an
    answer: then ``queue.get`` raises ``queue.Empty``)."""
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=child, args=(queue,))
    proc.start()
    try:
        got = queue.get(timeout=timeout)
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    return got, proc.exitcode
