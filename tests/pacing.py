"""A stream's consumer paces the engine thread: tests that leave or cancel a stream after a few
chunks, whatever the machine's speed (on a loaded machine a stream of a few dozen tokens could
end before its consumer read its second chunk, or all of it come as one chunk)."""

from __future__ import annotations

import contextlib
import threading

from radixkv import AsyncLLM
from radixkv.engine import StepFinished


@contextlib.contextmanager
def paced_by_the_client(llm: AsyncLLM, lead: int = 8, monkeypatch=None):
    """While inside, ``llm``'s engine thread runs at most ``lead`` steps ahead of the chunks a
    client read (it calls the yielded function as it reads each): after each step a posted call
    waits for a read not yet matched by a step. So a stream left after a few chunks is a few
    steps in, and each chunk read is at most ``lead`` steps of tokens.

    With ``monkeypatch``, leaving waits until the abort of the stream left was posted (the first
    ``Engine.post`` from another thread after a step) before the engine is let go, so the abort
    lands before its next step; without, the engine is let go at once (its next step races the
    abort)."""
    reads, armed, stalled = threading.Semaphore(lead), [True], []
    stepping, aborted = [], threading.Event()

    def brake(engine) -> None:
        if armed[0] and not reads.acquire(timeout=120):
            stalled.append(True)

    def stepped(ev) -> None:  # on the engine thread
        stepping[:] = [threading.current_thread()]
        if armed[0]:
            llm.submit(brake)  # runs after this step, before the next

    post = llm.engine.post

    def watched(fn) -> None:
        post(fn)  # NOTE: posted before it is said to be: the abort lands before the next step
        if stepping and threading.current_thread() is not stepping[0]:
            aborted.set()

    off = llm.subscribe(stepped, (StepFinished,))
    if monkeypatch is not None:
        monkeypatch.setattr(llm.engine, "post", watched)
    try:
        yield reads.release
        if monkeypatch is not None:
            assert aborted.wait(120), "the dropped stream's abort was not posted"
    finally:
        armed[0] = False
        reads.release()
        off()
    assert not stalled, "the engine waited 120 s for the client"
