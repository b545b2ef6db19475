"""Sessions, ``fork`` and ``select`` attacked as a hostile caller would (on the fake runner of
test_scheduler.py, whose outputs must equal a pure-Python reference and which trips on a stale
or doubly owned slot): a session closed while its turn (or its ``select``) runs, from another
task or thread. After each case no pin is left behind: ``free + evictable == capacity``,
``protected == 0`` once every session is closed."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from test_scheduler import FakeRunner, assert_no_leak, greedy, reference
from test_sessions import idle_invariant, make_llm

from radixkv import AsyncLLM
from radixkv.engine import StepFinished

pytestmark = pytest.mark.timeout(120)


def fake_async_llm(capacity=512, page_size=1):
    return AsyncLLM(
        device="cpu",
        model_runner=FakeRunner(capacity, page_size, 16),
        tokenizer=None,
        eos_token_ids=[],
        max_total_tokens=capacity,
        page_size=page_size,
    )


async def async_no_leak(alm):
    while await alm.call_in_engine_thread(lambda e: e.has_unfinished_requests()):
        await alm.call_in_engine_thread(lambda e: None)
    await alm.call_in_engine_thread(lambda e: e.run_posted())
    await alm.call_in_engine_thread(assert_no_leak)


def test_async_close_while_a_turn_runs_leaves_nothing_pinned():
    """``await s.close()`` while ``s.generate`` runs in another task: the turn still returns its
    reply, and neither the old context's pin nor the new one's stays behind (the new context
    used to be pinned after the close, by a session that no ``close`` or finalizer releases:
    pinned until ``pin_idle_timeout``)."""
    alm = fake_async_llm()

    async def main():
        ctx = list(range(1, 30))
        s = alm.session(ctx)
        first = await s.generate(sampling_params=greedy(2))
        turn = asyncio.ensure_future(s.generate(prompt_token_ids=[4], sampling_params=greedy(20)))
        await asyncio.sleep(0)  # the turn is submitted
        await s.close()
        out = await turn
        full = ctx + first.outputs[0].token_ids + [4]
        assert out.outputs[0].token_ids == reference(full, 20)
        assert s.closed and s.pinned_tokens == 0
        await async_no_leak(alm)

    try:
        asyncio.run(main())
    finally:
        alm.shutdown()


def test_async_close_while_select_appends_leaves_nothing_pinned():
    """The same for ``select(append=True)``: the chosen choice must not be pinned for a closed session."""
    alm = fake_async_llm()

    async def main():
        s = alm.session(list(range(1, 30)))
        await s.generate(sampling_params=greedy(2))
        sel = asyncio.ensure_future(s.select([[1, 2], [3], [4, 5, 6]]))
        await asyncio.sleep(0)
        await s.close()
        result = await sel
        assert result.index in (0, 1, 2) and s.closed and s.pinned_tokens == 0
        await async_no_leak(alm)

    try:
        asyncio.run(main())
    finally:
        alm.shutdown()


@pytest.mark.parametrize("when", [2, 5])
def test_close_from_another_thread_mid_turn_on_llm(when):
    """On ``LLM``, another thread closes a session while its turn runs (its close waits for the
    LLM's lock): the turn completes, nothing stays pinned. ``when``: the step at which the other
    thread has closed it (the turn's last step is 5)."""
    llm = make_llm()
    s = llm.session(list(range(1, 30)))
    s.generate(sampling_params=greedy(2))
    steps, closer = [], threading.Thread(target=s.close)

    def on_step(ev):
        steps.append(ev.step)
        if len(steps) == when:
            closer.start()
            deadline = time.monotonic() + 30
            while not s.closed:  # the closer marked it closed; its release waits for the lock
                assert time.monotonic() < deadline, "the closing thread did not run"
                time.sleep(0.001)

    off = llm.engine.events.subscribe(on_step, (StepFinished,))
    ctx = s.tokens
    out = s.generate(prompt_token_ids=[7], sampling_params=greedy(5))
    off()
    closer.join(30)
    assert not closer.is_alive() and len(steps) == 5
    assert out.outputs[0].token_ids == reference(ctx + [7], 5)
    assert s.closed and s.pinned_tokens == 0
    idle_invariant(llm)
    assert_no_leak(llm.engine)


def test_wrong_types_are_refused_naming_the_argument():
    """``select``'s ``append`` must be a bool (``append="no"`` used to append: any truthy value
    did); a numpy array as a fork batch's ``prompt_token_ids`` is a RequestError naming it (it
    was numpy's own "truth value of an array is ambiguous"); a choice that takes the prompt past
    ``max_context_len`` names ``choices`` (it named ``prompt``, which alone fits). Nothing is
    submitted and the session is unchanged."""
    np = pytest.importorskip("numpy")
    from radixkv.errors import RequestError

    llm = make_llm(capacity=256)
    s = llm.session(list(range(1, 30)))
    s.generate(sampling_params=greedy(2))
    ctx, before = s.tokens, llm.cache_stats()["prompt_tokens"]
    kids = s.fork(2)
    cases = [
        (lambda: s.select([[1], [2]], append="no"), "append", "append must be a bool, got 'no'"),
        (lambda: s.select([[1], [2]], append=1), "append", "append must be a bool, got 1"),
        (
            lambda: kids.generate(prompt_token_ids=np.array([1, 2])),
            "prompt_token_ids",
            "prompt_token_ids must be one value or a list of 2 (one per fork)",
        ),
        (
            lambda: s.select([[1], [2] * 600]),
            "choices",
            "choice 1 makes a prompt of 631 tokens (the prompt's 31 and its 600); max_context_len is 512 "
            "(the prompt plus at least one generated token must fit)",
        ),
    ]
    for call, param, message in cases:
        with pytest.raises(RequestError) as e:
            call()
        assert (e.value.param, str(e.value)) == (param, message)
    assert s.tokens == ctx and [k.tokens for k in kids] == [ctx, ctx]
    assert llm.cache_stats()["prompt_tokens"] == before  # nothing was submitted
    kids.close()
    s.close()
    assert_no_leak(llm.engine)
