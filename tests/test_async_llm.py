"""AsyncLLM on the real engine (default model, CPU): streaming, batching, aborts, shutdown.

One engine per module. Every test runs its own ``asyncio.run`` loop, so the AsyncLLM is also
checked to serve several event loops one after another. After each test the KV pool must be
whole: free + evictable == capacity and protected == 0, with no unfinished request.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from process_helpers import run_in_fork
from server_helpers import assert_pool_whole  # noqa: E402

from radixkv.async_llm import AsyncLLM, EngineDeadError  # noqa: E402
from radixkv.engine import StepFinished  # noqa: E402
from radixkv.sampling_params import RequestOutputKind, SamplingParams  # noqa: E402

pytestmark = pytest.mark.timeout(600)

PROMPTS = [
    "The capital of France is",
    "List three colors:",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
]


@pytest.fixture(scope="module")
def engine(default_model):
    from radixkv.config import EngineConfig
    from radixkv.engine import Engine

    eng = Engine(
        EngineConfig(model="smollm2-135m", device="cpu", page_size=1, max_total_tokens=8192), loaded_model=default_model
    )
    batch_sizes: list[int] = []
    # records how many requests each step served (an engine event, on the engine thread)
    eng.events.subscribe(lambda ev: batch_sizes.append(ev.num_reqs), (StepFinished,))
    eng.batch_sizes = batch_sizes
    return eng


@pytest.fixture(scope="module")
def llm(engine):
    with AsyncLLM(engine=engine) as a:
        yield a


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


async def collect(llm: AsyncLLM, prompt, params, request_id=None) -> list:
    return [out async for out in llm.generate(prompt, params, request_id)]


def test_stream_is_cumulative_and_ends_finished(llm):
    outs = asyncio.run(collect(llm, PROMPTS[0], greedy(12, ignore_eos=True), "cumulative-1"))
    assert outs[-1].finished and all(not o.finished for o in outs[:-1])
    assert {o.request_id for o in outs} == {"cumulative-1"}
    final = outs[-1].outputs[0]
    assert len(final.token_ids) == 12 and final.finish_reason == "length"
    for a, b in zip(outs, outs[1:]):  # each snapshot extends the previous one
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        assert len(tb) > len(ta) and tb[: len(ta)] == ta
        assert b.outputs[0].text.startswith(a.outputs[0].text)
    assert outs[-1].prompt == PROMPTS[0]
    assert outs[-1].prompt_token_ids == list(llm.tokenizer.encode(PROMPTS[0], add_special_tokens=False))
    assert_pool_whole(llm)


def test_concurrent_requests_batch_and_match_sequential(llm, engine):
    params = greedy(10, ignore_eos=True)
    sequential = [asyncio.run(collect(llm, p, params))[-1] for p in PROMPTS]
    engine.batch_sizes.clear()

    async def together():
        return await asyncio.gather(*(collect(llm, p, params) for p in PROMPTS))

    concurrent = [outs[-1] for outs in asyncio.run(together())]
    # All four were decoded in one batch at least once (continuous batching).
    assert max(engine.batch_sizes) == len(PROMPTS)
    for s, c in zip(sequential, concurrent):
        assert c.outputs[0].token_ids == s.outputs[0].token_ids
        assert c.outputs[0].text == s.outputs[0].text
        # The sequential run cached each prompt: at page_size 1 all but its last token hit.
        assert c.num_cached_tokens == len(c.prompt_token_ids) - 1
    assert_pool_whole(llm)


def test_an_abort_storm_among_cancels_and_threads_leaves_exact_survivors(llm):
    """Three threads, each with its own event loop, stream 24 requests on one AsyncLLM: a third
    are cancelled after their second output, a third aborted by id after their first (with 50
    aborts of unknown ids in the same calls), both of 200 tokens; the rest finish with exactly the
    token ids a request alone gets, and the pool is whole afterwards."""
    params = greedy(6, ignore_eos=True)
    # the cancelled and aborted ones run long: a stalled consumer must not see them end before it
    # leaves (6 tokens may all be generated meanwhile, and then read as one output)
    long = greedy(200, ignore_eos=True)
    alone = {p: asyncio.run(collect(llm, p, params))[-1].outputs[0].token_ids for p in PROMPTS}
    aborted = {PROMPTS[i % 4] for i in range(8) if i % 3 == 2}
    alone_long = {p: asyncio.run(collect(llm, p, long))[-1].outputs[0].token_ids for p in aborted}
    got: dict = {}

    async def one(k: int, i: int) -> None:
        p, rid, seen = PROMPTS[i % 4], f"storm-{k}-{i}", 0
        ref = alone_long[p] if i % 3 == 2 else alone[p]
        async for out in llm.generate(p, long if i % 3 else params, rid):
            seen, last = seen + 1, out
            if i % 3 == 1 and seen == 2:
                raise asyncio.CancelledError  # as a cancelled consumer leaves
            if i % 3 == 2 and seen == 1:
                await llm.abort([rid] + [f"none-{k}-{j}" for j in range(50)])
        got[(k, i)] = (last.outputs[0].finish_reason, last.outputs[0].token_ids, ref)

    async def loop(k: int) -> None:
        results = await asyncio.gather(*(one(k, i) for i in range(8)), return_exceptions=True)
        got.update({(k, i, "raised"): type(r).__name__ for i, r in enumerate(results) if r is not None})

    threads = [threading.Thread(target=asyncio.run, args=(loop(k),)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    finished = {key: v for key, v in got.items() if len(key) == 2}
    assert {key[:2] for key in got if len(key) == 3} == {(k, i) for k in range(3) for i in range(8) if i % 3 == 1}
    assert sorted(finished) == [(k, i) for k in range(3) for i in range(8) if i % 3 != 1]
    for (k, i), (reason, ids, ref) in finished.items():
        assert (reason, ids) == (("length", ref) if i % 3 == 0 else ("abort", ref[: len(ids)])), (k, i)
    assert_pool_whole(llm)


def test_token_id_prompt_and_n_samples(llm):
    ids = list(llm.tokenizer.encode(PROMPTS[1], add_special_tokens=False))
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=7, n=3, ignore_eos=True)
    final = asyncio.run(collect(llm, ids, params))[-1]
    assert final.prompt_token_ids == ids and final.prompt is None
    assert [c.index for c in final.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 6 and c.finish_reason == "length" for c in final.outputs)
    again = asyncio.run(collect(llm, ids, params))[-1]  # same seed, same samples
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in final.outputs]
    assert_pool_whole(llm)


def test_output_kind_delta_and_final_only(llm):
    """vLLM's ``output_kind``: DELTA yields only what is new (joined, the deltas are the
    cumulative output: token ids, text with a stop string cut, logprobs; prompt logprobs once),
    FINAL_ONLY the final output alone; the samples are those of a cumulative run."""
    kw = dict(max_tokens=10, temperature=0.8, seed=3, n=2, logprobs=2, prompt_logprobs=1, stop=[" the"])
    cumulative = asyncio.run(collect(llm, PROMPTS[3], SamplingParams(**kw)))[-1]
    deltas = asyncio.run(collect(llm, PROMPTS[3], SamplingParams(output_kind=RequestOutputKind.DELTA, **kw)))
    assert len(deltas) > 2 and deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    assert deltas[0].prompt_logprobs == cumulative.prompt_logprobs
    assert all(d.prompt_logprobs is None for d in deltas[1:])
    for want in cumulative.outputs:
        parts = [c for d in deltas for c in d.outputs if c.index == want.index]
        assert all(c.token_ids for c in parts[:-1])  # a sample appears when it has something new
        assert [t for c in parts for t in c.token_ids] == want.token_ids
        assert "".join(c.text for c in parts) == want.text
        assert [lp for c in parts for lp in c.logprobs] == want.logprobs
        assert parts[-1].finish_reason == want.finish_reason and parts[-1].stop_reason == want.stop_reason
        assert parts[-1].cumulative_logprob == want.cumulative_logprob
    final_only = asyncio.run(collect(llm, PROMPTS[3], SamplingParams(output_kind=2, **kw)))
    assert len(final_only) == 1 and final_only[0].outputs == cumulative.outputs
    with pytest.raises(ValueError, match="output_kind must be a RequestOutputKind"):
        SamplingParams(output_kind=3)
    assert_pool_whole(llm)


def test_closing_the_iterator_aborts_and_releases_slots(llm):
    async def run():
        async with contextlib.aclosing(llm.generate(PROMPTS[3], greedy(400, ignore_eos=True), "closed-1")) as gen:
            seen = 0
            async for out in gen:
                seen += 1
                assert not out.finished
                if seen == 3:
                    break
        await llm.call_in_engine_thread(lambda e: None)  # runs after the posted abort
        return llm.num_unfinished_requests()

    assert asyncio.run(run()) == 0
    assert_pool_whole(llm)


def test_cancelling_the_task_aborts_and_releases_slots(llm):
    async def run():
        first = asyncio.Event()

        async def consume():
            async for _ in llm.generate(PROMPTS[2], greedy(400, ignore_eos=True), "cancelled-1"):
                first.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(first.wait(), 120)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await llm.call_in_engine_thread(lambda e: None)  # runs after the posted abort
        return llm.num_unfinished_requests()

    assert asyncio.run(run()) == 0
    assert_pool_whole(llm)


def test_abort_by_id_ends_the_stream(llm):
    async def run():
        outs = []
        async for out in llm.generate(PROMPTS[0], greedy(400, ignore_eos=True), "by-id-1"):
            outs.append(out)
            if len(outs) == 2:
                await llm.abort("by-id-1")
        return outs

    outs = asyncio.run(run())
    # as vLLM's: one last output, finished, finish_reason "abort", with the tokens it had
    last = outs[-1].outputs[0]
    assert 3 <= len(outs) < 400 and outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert last.finish_reason == "abort" and last.stop_reason is None
    assert last.token_ids[: len(outs[-2].outputs[0].token_ids)] == outs[-2].outputs[0].token_ids
    assert_pool_whole(llm)


def test_abort_by_id_is_done_when_awaited_and_the_id_can_be_reused(llm):
    # vLLM's AsyncLLM.abort takes the request out of its output processor and queues the final
    # output before it returns: once awaited, nothing of it is unfinished and its id is free. The
    # engine thread is held (a posted call waiting on ``gate``) right after the abort, so no step
    # can deliver anything in between.
    expected = asyncio.run(collect(llm, PROMPTS[1], greedy(5, ignore_eos=True)))[-1].outputs[0].token_ids
    gate = threading.Event()

    async def run():
        old = llm.generate(PROMPTS[0], greedy(400, ignore_eos=True), "reuse-1")
        first = await old.__anext__()
        aborting = asyncio.ensure_future(llm.abort("reuse-1"))
        await asyncio.sleep(0)  # the abort is posted
        held = llm.submit(lambda e: gate.wait(60))
        try:
            await aborting
            unfinished = llm.num_unfinished_requests()
            new = asyncio.ensure_future(collect(llm, PROMPTS[1], greedy(5, ignore_eos=True), "reuse-1"))
            await asyncio.sleep(0)  # its request is posted while the engine thread is held
        finally:
            gate.set()
        await asyncio.wrap_future(held)
        return first, unfinished, [o async for o in old], await new

    first, unfinished, old, new = asyncio.run(run())
    assert unfinished == 0  # nothing of it was left once the abort returned
    assert len(old) == 1 and old[0].finished and old[0].outputs[0].finish_reason == "abort"
    assert old[0].outputs[0].token_ids[: len(first.outputs[0].token_ids)] == first.outputs[0].token_ids
    # the id was free for a new request at once: it ran in full, its one final output its own
    assert new[-1].outputs[0].token_ids == expected and new[-1].outputs[0].finish_reason == "length"
    assert [o.finished for o in new] == [False] * (len(new) - 1) + [True]
    assert_pool_whole(llm)


def test_bad_input_raises_value_error_and_engine_stays_usable(llm):
    ctx = llm.max_context_len

    async def expect_value_error(prompt, params, request_id=None):
        with pytest.raises(ValueError):
            await collect(llm, prompt, params, request_id)

    asyncio.run(expect_value_error([], greedy(4)))
    asyncio.run(expect_value_error([1] * ctx, greedy(4)))  # no room for one new token
    asyncio.run(expect_value_error([llm.engine.vocab_size], greedy(4)))  # token id outside the vocabulary

    async def duplicate_id():
        gen = llm.generate(PROMPTS[3], greedy(400, ignore_eos=True), "dup-1")
        async with contextlib.aclosing(gen):
            await gen.__anext__()
            with pytest.raises(ValueError, match="dup-1"):
                await collect(llm, PROMPTS[0], greedy(2), "dup-1")

    asyncio.run(duplicate_id())
    final = asyncio.run(collect(llm, PROMPTS[1], greedy(3, ignore_eos=True)))[-1]
    assert final.finished and len(final.outputs[0].token_ids) == 3
    assert_pool_whole(llm)


def test_reset_prefix_cache_refuses_while_running_then_flushes(llm):
    async def run():
        gen = llm.generate(PROMPTS[3], greedy(400, ignore_eos=True), "flush-1")
        async with contextlib.aclosing(gen):
            await gen.__anext__()
            refused = await llm.reset_prefix_cache()
        flushed = await llm.reset_prefix_cache()
        final = (await collect(llm, PROMPTS[0], greedy(2)))[-1]
        return refused, flushed, final

    refused, flushed, final = asyncio.run(run())
    assert refused is False and flushed is True
    assert final.num_cached_tokens == 0  # the cache was empty
    stats = assert_pool_whole(llm)
    assert stats["evictable"] > 0  # the last request was cached again


def test_usable_from_another_threads_event_loop(llm):
    result: dict = {}

    def worker():
        result["out"] = asyncio.run(collect(llm, PROMPTS[0], greedy(4, ignore_eos=True)))[-1]

    t = threading.Thread(target=worker)
    t.start()
    t.join(300)
    assert result["out"].finished and len(result["out"].outputs[0].token_ids) == 4


@pytest.mark.timeout(120)
def test_a_forked_child_is_told_the_engine_thread_did_not_come_along(llm):
    """``multiprocessing`` with the 'fork' start method after an AsyncLLM exists: the child's copy
    has no engine thread (a fork copies only the forking thread). Its requests and posted calls
    were queued to nobody: ``generate`` and ``call_in_engine_thread`` waited forever; now they
    raise EngineDeadError saying so (the parent's AsyncLLM goes on)."""
    import multiprocessing as mp

    if "fork" not in mp.get_all_start_methods():
        pytest.skip("no fork start method on this platform")

    async def in_child():
        got = []
        for call in (collect(llm, PROMPTS[0], greedy(2)), llm.call_in_engine_thread(lambda e: 1)):
            try:
                await asyncio.wait_for(call, 20)
            except Exception as exc:  # noqa: BLE001 - reported to the parent
                got.append(f"{type(exc).__name__}: {exc}")
        return got, llm.is_running

    def child(queue):
        queue.put(asyncio.run(in_child()))

    got, exitcode = run_in_fork(child, 60)
    told = "EngineDeadError: the engine thread is not running in this process (an AsyncLLM made before a fork"
    assert [m[: len(told)] for m in got[0]] == [told, told] and got[1] is False
    assert asyncio.run(collect(llm, PROMPTS[0], greedy(2, ignore_eos=True)))[-1].finished  # the parent's


@pytest.mark.timeout(120)
def test_subscribe_from_the_engine_thread_subscribes_at_once(llm):
    """``subscribe`` called on the engine thread (a finish hook or an event subscriber)
    subscribes there: it posted the subscription to that same thread and waited for it, so the
    engine stood still 60 s and the hook got a bare TimeoutError."""
    seen: list = []
    offs: list = []

    def hook(engine, out):
        offs.append(llm.subscribe(lambda ev: seen.append(ev.num_reqs), (StepFinished,)))

    async def run():
        async for _ in llm.generate(PROMPTS[0], greedy(1), on_finish=hook):
            pass
        return await collect(llm, PROMPTS[1], greedy(3, ignore_eos=True))

    done = threading.Event()
    result: list = []
    threading.Thread(target=lambda: (result.append(asyncio.run(run())), done.set()), daemon=True).start()
    assert done.wait(30), "the engine thread stood still"
    assert len(offs) == 1 and result[0][-1].finished
    assert seen == [1, 1, 1]  # the 3 steps of the request after it, one request each
    offs[0]()


@pytest.mark.timeout(120)
def test_waiting_for_a_submitted_call_on_the_engine_thread_raises(llm):
    """``submit(fn).result()`` in a finish hook or an event subscriber waited for a call posted to
    the engine thread from that thread: it could never run, so the engine stood still (forever,
    or until the wait's timeout). It raises a RuntimeError saying so; the call itself still runs
    after the hook returns, its future done for any other thread to read."""
    got: list = []

    def wait_in_engine_thread(tag):
        fut = llm.submit(lambda e: tag)
        for wait in (fut.result, fut.exception):
            try:
                wait(2)
            except RuntimeError as exc:
                got.append((tag, "would wait forever" in str(exc)))
            except Exception as exc:  # noqa: BLE001 - the failure this test reports
                got.append((tag, repr(exc)))
        got.append(fut)

    def on_step(ev):
        if not got:  # the first step's event only
            off()
            wait_in_engine_thread("subscriber")

    off = llm.subscribe(on_step, (StepFinished,))

    async def run():
        async for _ in llm.generate(PROMPTS[0], greedy(2), on_finish=lambda e, o: wait_in_engine_thread("hook")):
            pass
        return await llm.call_in_engine_thread(lambda e: None)

    done = threading.Event()
    threading.Thread(target=lambda: (asyncio.run(run()), done.set()), daemon=True).start()
    assert done.wait(30), "the engine thread stood still"
    futs = [x for x in got if not isinstance(x, tuple)]
    assert [x for x in got if isinstance(x, tuple)] == [("subscriber", True)] * 2 + [("hook", True)] * 2
    assert [f.result(5) for f in futs] == ["subscriber", "hook"]  # posted all the same, run after
    assert_pool_whole(llm)


def test_shutdown_fails_unfinished_streams_and_refuses_new_requests(engine, llm):
    async def run():
        gen = llm.generate(PROMPTS[2], greedy(400, ignore_eos=True), "shutdown-1")
        await gen.__anext__()
        await asyncio.get_running_loop().run_in_executor(None, llm.shutdown)
        with pytest.raises(EngineDeadError):
            async for _ in gen:
                pass
        with pytest.raises(EngineDeadError):
            await collect(llm, PROMPTS[0], greedy(2))

    asyncio.run(run())
    assert not llm.is_running
    # The engine thread has stopped, so the engine may be inspected directly: the unfinished
    # request was aborted at shutdown and its slots released.
    assert not engine.has_unfinished_requests()
    stats = engine.cache_stats()
    assert stats["free"] + stats["evictable"] == stats["capacity"] and stats["protected"] == 0


def test_engine_failure_is_reported_to_waiters(engine, llm):
    assert not llm.is_running  # the previous test shut the module's AsyncLLM down
    real_forward = engine.runner.forward

    def broken_forward(batch):
        raise RuntimeError("simulated device failure")

    engine.runner.forward = broken_forward
    try:
        failing = AsyncLLM(engine=engine)

        async def run():
            with pytest.raises(EngineDeadError, match="simulated device failure"):
                await collect(failing, PROMPTS[0], greedy(2))

        asyncio.run(run())
        failing._thread.join(30)
        assert not failing.is_running and isinstance(failing.dead_error, RuntimeError)
        with pytest.raises(EngineDeadError):
            asyncio.run(failing.call_in_engine_thread(lambda e: e.cache_stats()))
    finally:
        engine.runner.forward = real_forward
