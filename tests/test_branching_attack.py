"""Sessions, ``fork`` and ``select`` attacked as a hostile caller would (on the fake runner of
test_scheduler.py, whose outputs must equal a pure-Python reference and which trips on a stale
or doubly owned slot): a session closed while its turn (or its ``select``) runs, from another
task or thread; wrong argument types; and rounds of random concurrent turns, forks, selects,
flushes, cancels and closes. After each case no pin is left behind: ``free + evictable ==
capacity``, ``protected == 0`` once every session is closed."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from test_scheduler import FakeRunner, assert_no_leak, greedy, reference
from test_sessions import idle_invariant, make_llm

from radixkv import AsyncLLM
from radixkv.engine import RequestAdmitted, RequestFinished, StepFinished
from radixkv.errors import RequestError

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


def test_a_turn_from_another_thread_while_one_builds_its_prompt_is_refused():
    """Thread B's ``generate`` on a Session is still building its prompt (from the context as
    it was) when thread A's ``generate`` on the same Session runs: the session was marked busy
    only after the prompt was built, so A's whole turn ran, then B's ran on the old context and
    the session kept B's: A's turn was lost from the context, with no error. A turn now claims
    the session before it reads the context: A gets the RequestError naming ``session``."""
    llm = make_llm()
    ctx = list(range(1, 20))
    s = llm.session(ctx)
    inside, go = threading.Event(), threading.Event()

    class Slow(list):  # B's prompt_token_ids: read while B builds its prompt
        def __iter__(self):
            inside.set()
            go.wait(30)
            return super().__iter__()

    got: list = []
    b = threading.Thread(target=lambda: got.append(s.generate(prompt_token_ids=Slow([6]), sampling_params=greedy(4))))
    b.start()
    assert inside.wait(30)
    try:
        with pytest.raises(RequestError, match="one at a time") as refused:
            s.generate(prompt_token_ids=[5], sampling_params=greedy(4))
        assert refused.value.param == "session"
    finally:
        go.set()
        b.join(60)
    assert got[0].outputs[0].token_ids == reference(ctx + [6], 4)
    assert s.tokens == ctx + [6] + got[0].outputs[0].token_ids
    s.close()
    idle_invariant(llm)


def test_wrong_types_are_refused_naming_the_argument():
    """``select``'s ``append`` must be a bool (``append="no"`` used to append: any truthy value
    did); a numpy array as a fork batch's ``prompt_token_ids`` is a RequestError naming it (it
    was numpy's own "truth value of an array is ambiguous"); a choice that takes the prompt past
    ``max_context_len`` names ``choices`` (it named ``prompt``, which alone fits), and one that takes
    it past the KV pool too (it named ``max_tokens``, which select sets itself). Nothing is
    submitted and the session is unchanged."""
    np = pytest.importorskip("numpy")
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
    with pytest.raises(RequestError) as e:  # within max_context_len, past the pool: select's max_tokens is its own
        s.select([[1], [2] * 230])
    assert e.value.param == "choices" and str(e.value) == (
        "the prompt + a choice does not fit the KV pool: prompt (261 tokens) + max_tokens (1) needs 262 KV "
        "slots, more than the KV pool's 256 slots (max_total_tokens, or what kv_cache_memory_bytes holds)"
    )
    assert s.tokens == ctx and [k.tokens for k in kids] == [ctx, ctx]
    assert llm.cache_stats()["prompt_tokens"] == before  # nothing was submitted
    kids.close()
    s.close()
    assert_no_leak(llm.engine)


def test_a_fork_batch_takes_empty_prompt_token_ids_as_session_generate_does():
    """``forks.generate(prompt_token_ids=[])`` continues every child with no new tokens, as
    ``Session.generate(prompt_token_ids=[])`` does (it was a RequestError: "must be one value or a
    list of 2", an empty list read as a list of per-child values)."""
    llm = make_llm()
    ctx = list(range(1, 30))
    s = llm.session(ctx)
    kids = s.fork(2)
    outs = kids.generate(prompt_token_ids=[], sampling_params=greedy(3))
    assert [o.outputs[0].token_ids for o in outs] == [reference(ctx, 3)] * 2
    assert [k.tokens for k in kids] == [ctx + reference(ctx, 3)] * 2
    assert s.generate(prompt_token_ids=[], sampling_params=greedy(3)).outputs[0].token_ids == reference(ctx, 3)
    kids.close()
    s.close()
    assert_no_leak(llm.engine)


class Chaos:
    """One random operation at a time on a random open session of ``alm`` (fake runner): a turn,
    a fork and its children's batch turn, ``select`` (appending or not), ``LLM.select``, a
    flush, a close; each awaited call cancelled at a random point with probability 1/4. Every
    reply that comes back equals the reference; a cancelled turn leaves its context as it was."""

    def __init__(self, alm, rng):
        self.alm, self.rng = alm, rng
        self.sessions = [
            alm.session([rng.randrange(1, 64) for _ in range(rng.randrange(5, 40))], namespace=ns)
            for ns in (None, "a", None, "a")
        ]
        self.refused: list[str] = []

    async def cancel_maybe(self, coro):
        """``coro``'s result, or None when it was cancelled at a random point."""
        t = asyncio.ensure_future(coro)
        if self.rng.random() < 0.25:
            for _ in range(self.rng.randrange(0, 6)):
                await asyncio.sleep(0)
            t.cancel()
        try:
            return await t
        except asyncio.CancelledError:
            return None

    async def turn(self, s):
        rng = self.rng
        ctx, mt = s.tokens, rng.randrange(1, 10)
        new = [rng.randrange(1, 64) for _ in range(rng.randrange(0 if ctx else 1, 4))]
        out = await self.cancel_maybe(s.generate(prompt_token_ids=new, sampling_params=greedy(mt)))
        if out is None:
            assert s.tokens in (ctx, ctx + new + reference(ctx + new, mt))
            return
        assert out.outputs[0].token_ids == reference(ctx + new, mt)
        if not s.closed:
            assert s.tokens == ctx + new + out.outputs[0].token_ids

    async def fork(self, s):
        rng = self.rng
        kids = await self.cancel_maybe(s.fork(rng.randrange(1, 6)))
        if kids is None:
            return
        ctx, news = s.tokens, [[rng.randrange(1, 64)] for _ in kids]
        outs = await self.cancel_maybe(
            kids.generate(prompt_token_ids=news, sampling_params=greedy(rng.randrange(1, 6)))
        )
        for o, n in zip(outs or [], news):
            assert o.outputs[0].token_ids == reference(ctx + n, len(o.outputs[0].token_ids))
        if rng.random() < 0.5:
            await kids.close()
        else:
            self.sessions.extend(kids)

    async def op(self, s):
        k = self.rng.random()
        try:
            if k < 0.3:
                await self.turn(s)
            elif k < 0.5:
                await self.fork(s)
            elif k < 0.6 and s.tokens:
                await self.cancel_maybe(s.select([[1], [2, 3]], append=self.rng.random() < 0.5))
            elif k < 0.7:
                await self.alm.call_in_engine_thread(lambda e: e.reset_prefix_cache())
            elif k < 0.85:
                await s.close()
            else:
                await self.cancel_maybe(self.alm.select([1, 2, 3], [[4], [5]]))
        except RequestError as e:  # a busy session (two operations on it at once)
            assert e.param == "session", str(e)
            self.refused.append(e.param)


@pytest.mark.parametrize("seed", range(4))
def test_random_concurrent_turns_forks_selects_cancels_and_closes(seed):
    """Rounds of concurrent random operations (:class:`Chaos`) on a small pool (160 slots, 8
    running, 8-token chunks; page_size 1 and 4): the KV manager's integrity after every round,
    and once every session is closed nothing is pinned or protected."""
    import random

    ps = 1 + 3 * (seed % 2)
    alm = AsyncLLM(
        device="cpu",
        model_runner=FakeRunner(160, ps, 8),
        tokenizer=None,
        eos_token_ids=[],
        max_total_tokens=160,
        page_size=ps,
        chunked_prefill_size=8,
        max_running_requests=8,
    )

    async def main():
        chaos = Chaos(alm, random.Random(seed))
        for _ in range(10):
            live = [s for s in chaos.sessions if not s.closed]
            if not live:
                break
            await asyncio.gather(*[chaos.op(chaos.rng.choice(live)) for _ in range(chaos.rng.randrange(1, 6))])
            await alm.call_in_engine_thread(lambda e: e.check_integrity())
        for s in chaos.sessions:
            await s.close()
        await async_no_leak(alm)

    try:
        asyncio.run(main())
    finally:
        alm.shutdown()


@pytest.mark.parametrize("kind", [StepFinished, RequestAdmitted, RequestFinished])
def test_call_in_engine_thread_from_inside_a_step_is_refused(kind):
    """An event subscriber's ``LLM.call_in_engine_thread(fn)`` (the RLock lets the stepping
    thread in) ran ``fn`` in the middle of the step, though documented "never during a step":
    aborting the batch's requests there made the outer ``generate`` die with a KeyError. It
    raises a RuntimeError saying why; a finish hook (between steps) still runs it."""
    llm = make_llm()
    got: list = []

    def call_back(_event) -> None:
        try:
            got.append(llm.call_in_engine_thread(lambda e: [e.abort_now(rid) for rid in list(e._groups)]))
        except RuntimeError as exc:
            got.append("inside this LLM's own step" in str(exc))

    off = llm.engine.events.subscribe(call_back, (kind,))
    prompts = [[1, 2, 3, 4], [1, 2, 3, 5], [7, 8, 9]]
    outs = llm.generate(prompts, greedy(4))
    off()
    assert [o.outputs[0].token_ids for o in outs] == [reference(p, 4) for p in prompts]
    assert got and set(got) == {True}
    hooked: list = []
    hook = lambda e, out: hooked.append(llm.call_in_engine_thread(lambda e: e.has_unfinished_requests()))  # noqa: E731
    llm.generate_batch([([5, 6, 7], greedy(3), None)], [hook])
    assert hooked == [False]
    idle_invariant(llm)


def _errors_from_a_subscriber(llm, call) -> list:
    """Run ``generate([1, 2, 3, 4])`` with ``call()`` made from a ``StepFinished`` subscriber
    (inside each step); the outer output must be the reference; the RuntimeError messages."""
    errors: list = []

    def call_back(_event) -> None:
        try:
            call()
        except RuntimeError as exc:
            errors.append(str(exc))

    off = llm.engine.events.subscribe(call_back, (StepFinished,))
    out = llm.generate([[1, 2, 3, 4]], greedy(4))[0]
    off()
    assert out.outputs[0].token_ids == reference([1, 2, 3, 4], 4)
    return errors


def test_generate_from_inside_a_step_is_refused_and_the_outer_call_completes():
    """An event subscriber calling back into ``LLM.generate`` (the RLock lets the stepping thread
    in again) gets a RuntimeError saying why; before, it stepped the engine inside its own step
    and the outer call died with a KeyError."""
    llm = make_llm()
    errors = _errors_from_a_subscriber(llm, lambda: llm.generate([[5, 6, 7]], greedy(3)))
    assert errors and all("inside this LLM's own step" in e for e in errors)
    assert llm.generate([[5, 6, 7]], greedy(3))[0].outputs[0].token_ids == reference([5, 6, 7], 3)
    idle_invariant(llm)


@pytest.mark.parametrize("method", ["close", "cache_stats", "reset_prefix_cache"])
def test_other_llm_calls_from_inside_a_step_are_refused(method):
    """``close`` (closing the KV tiers mid-step), ``cache_stats`` (running posted calls and
    expiring pins mid-step) and ``reset_prefix_cache`` from an event subscriber ran inside the
    step (the RLock lets the stepping thread in): each raises a RuntimeError saying why, the outer
    ``generate`` completes, and after the step each works."""
    llm = make_llm()
    errors = _errors_from_a_subscriber(llm, getattr(llm, method))
    assert errors and all(f"LLM.{method} was made from inside this LLM's own step" in e for e in errors)
    assert llm.cache_stats()["prompt_tokens"] == 4 and llm.reset_prefix_cache() and llm.close()
    idle_invariant(llm)
