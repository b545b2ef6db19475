"""Sessions and forks (radixkv/branching.py) and the KV manager's soft pins, on the fake runner of
test_scheduler.py: each turn computes only its new tokens, the context stays pinned between
turns within ``max_pinned_tokens`` and ``pin_idle_timeout`` (a fake clock), pins give way to
running requests, forks share one pin, and nothing leaks (also after an exception in a ``with``
block). The idle invariant ``free + evictable + pinned == capacity``, ``protected == pinned`` is
checked after every call."""

from __future__ import annotations

import asyncio
import gc

import pytest
from test_scheduler import VOCAB, FakeRunner, assert_no_leak, greedy, reference

from radixkv import LLM, AsyncLLM, SamplingParams
from radixkv.errors import RequestError
from radixkv.namespace import Namespace

pytestmark = pytest.mark.timeout(120)


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def make_llm(capacity=512, page_size=1, cache="radix", clock=None, **kw):
    runner = FakeRunner(capacity, page_size, kw.pop("max_running", 16))
    return LLM(
        device="cpu",
        model_runner=runner,
        tokenizer=None,
        eos_token_ids=[],
        max_total_tokens=capacity,
        page_size=page_size,
        prefix_cache=cache,
        chunked_prefill_size=kw.pop("chunk", 64),
        clock=clock or Clock(),
        **kw,
    )


def idle_invariant(llm):
    llm.engine.check_integrity()
    s = llm.cache_stats()
    assert s["running"] == 0 and s["waiting"] == 0
    assert s["free"] + s["evictable"] + s["pinned"] == s["capacity"], dict(s)
    assert s["protected"] == s["pinned"], dict(s)
    return s


def prefill(llm):
    return llm.cache_stats()["prefill_tokens"]


@pytest.mark.parametrize("page_size", [1, 4])
def test_each_turn_computes_only_its_new_tokens_and_the_context_stays_pinned(page_size):
    llm = make_llm(page_size=page_size)
    ps = page_size
    ctx = list(range(1, 30))
    with llm.session(ctx) as s:
        out = s.generate(prompt_token_ids=[3, 4, 5], sampling_params=greedy(6))
        p1 = ctx + [3, 4, 5]
        assert out.prompt_token_ids == p1 and out.outputs[0].token_ids == reference(p1, 6)
        assert s.tokens == p1 + reference(p1, 6)
        assert prefill(llm) == len(p1)
        s1 = idle_invariant(llm)
        assert s1["pinned"] == s.pinned_tokens == (len(s.tokens) - 1) // ps * ps  # what the turn left cached
        before = prefill(llm)
        out2 = s.generate(prompt_token_ids=[9, 9], sampling_params=greedy(4))
        p2 = s.tokens[:-4]
        assert out2.prompt_token_ids == p2 and out2.outputs[0].token_ids == reference(p2, 4)
        # the new prompt is the old context (prompt + reply, token for token) + the new text; its
        # cached part is all the old context but the reply's last token (which has no K/V yet)
        assert out2.num_cached_tokens == (len(p1) + 6 - 1) // ps * ps
        assert prefill(llm) - before == len(p2) - out2.num_cached_tokens
        idle_invariant(llm)
    assert_no_leak(llm.engine)


def test_pin_protects_the_context_from_eviction():
    llm = make_llm(capacity=128)
    s = llm.session(list(range(1, 40)))
    s.generate(sampling_params=greedy(3))
    pinned = idle_invariant(llm)["pinned"]
    assert pinned == 41
    # other traffic fills the pool several times over: unpinned prefixes are evicted, not the session's
    for i in range(6):
        llm.generate(prompt_token_ids=[[i + 2] * 60], sampling_params=greedy(4), use_tqdm=False)
    assert llm.cache_stats()["evicted_tokens"] > 0
    assert idle_invariant(llm)["pinned"] == pinned
    out = s.generate(prompt_token_ids=[7], sampling_params=greedy(2))
    assert out.num_cached_tokens == 41
    s.close()
    assert_no_leak(llm.engine)


def test_pin_bound_unpins_the_least_recently_used_session():
    clock = Clock()
    llm = make_llm(clock=clock, max_pinned_tokens=70)
    a, b, c = (llm.session([k] * 20 + list(range(1, 11))) for k in (1, 2, 3))
    a.generate(sampling_params=greedy(2))
    clock.t += 1
    b.generate(sampling_params=greedy(2))
    assert a.pinned_tokens == b.pinned_tokens == 31 and idle_invariant(llm)["pinned"] == 62
    clock.t += 1
    a.generate(prompt_token_ids=[5], sampling_params=greedy(1))  # a is used again: b is now the LRU
    clock.t += 1
    c.generate(sampling_params=greedy(2))  # 3 x ~31 > 70: the least recently used goes
    assert b.pinned_tokens == 0 and a.pinned_tokens > 0 and c.pinned_tokens > 0
    s = idle_invariant(llm)
    assert s["pinned"] <= 70 and llm.engine.kv.dropped_pins == 1
    # unpinned is not freed: b's context is still cached (evictable), its next turn reuses it
    out = b.generate(prompt_token_ids=[6], sampling_params=greedy(1))
    assert out.num_cached_tokens == 31
    for x in (a, b, c):
        x.close()
    assert_no_leak(llm.engine)


def test_idle_timeout_with_a_fake_clock():
    clock = Clock()
    llm = make_llm(clock=clock, pin_idle_timeout=30.0)
    s = llm.session(list(range(1, 20)))
    t = llm.session(list(range(20, 40)))
    s.generate(sampling_params=greedy(2))
    clock.t += 20
    t.generate(sampling_params=greedy(2))
    clock.t += 15  # s idle for 35 s, t for 15 s
    st = idle_invariant(llm)  # cache_stats applies the timeout
    assert s.pinned_tokens == 0 and t.pinned_tokens == 21 and st["pinned"] == 21  # 20 + 2 - 1
    assert st["evictable"] >= 20  # s's context stays cached
    clock.t += 30
    assert idle_invariant(llm)["pinned"] == 0 and t.pinned_tokens == 0
    s.close()
    t.close()
    assert_no_leak(llm.engine)


@pytest.mark.parametrize("page_size", [1, 4])
def test_pins_give_way_to_a_running_request(page_size):
    """Sessions pin most of the pool; a request that needs it is never retracted for them: the
    pins are dropped (tokens evictable, then evicted) instead."""
    llm = make_llm(capacity=256, page_size=page_size, max_pinned_tokens=256)
    sessions = [llm.session([k] * 50) for k in range(1, 5)]
    for s in sessions:
        s.generate(sampling_params=greedy(2))
    assert idle_invariant(llm)["pinned"] >= 4 * 48
    big = list(range(1, 61)) * 2
    out = llm.generate(prompt_token_ids=[big], sampling_params=greedy(100), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == reference(big, 100)
    st = idle_invariant(llm)
    assert st["num_retractions"] == 0 and llm.engine.kv.dropped_pins >= 1
    for s in sessions:
        s.close()
    assert_no_leak(llm.engine)


@pytest.mark.parametrize("page_size", [1, 4])
def test_fork_shares_the_pin_and_the_children_run_as_one_batch(page_size):
    llm = make_llm(page_size=page_size)
    ps = page_size
    s = llm.session(list(range(1, 41)))
    s.generate(sampling_params=greedy(3))
    ctx = s.tokens
    before = prefill(llm)
    kids = s.fork(3)
    assert [k.tokens for k in kids] == [ctx] * 3
    pinned = idle_invariant(llm)["pinned"]
    assert pinned == s.pinned_tokens and llm.engine.kv.num_pins == 1  # one pin, four holders
    s.close()
    assert idle_invariant(llm)["pinned"] == pinned  # the children still hold it
    outs = kids.generate(prompt_token_ids=[[7, 8], [9], [10, 11, 12]], sampling_params=greedy(4))
    for k, out, new in zip(kids, outs, ([7, 8], [9], [10, 11, 12])):
        assert k.tokens == ctx + new + out.outputs[0].token_ids
        assert out.prompt_token_ids == ctx + new
        assert out.outputs[0].token_ids == reference(ctx + new, 4)
    # the context's last token (the reply's, without K/V) is computed once for the three: at
    # page_size 1 by the first child, the others share it in the same forward
    cached = (len(ctx) - 1) // ps * ps
    if ps == 1:
        assert prefill(llm) - before == 1 + 2 + 1 + 3
    else:
        assert prefill(llm) - before == sum(len(ctx) + len(n) - cached for n in ([7, 8], [9], [10, 11, 12]))
    st = idle_invariant(llm)
    assert llm.engine.kv.num_pins == 3 and st["pinned"] >= cached
    kids.close()
    assert_no_leak(llm.engine)


def test_exception_inside_with_blocks_unpins_everything():
    llm = make_llm()
    with pytest.raises(KeyError):
        with llm.session(list(range(1, 30))) as s:
            s.generate(sampling_params=greedy(2))
            with s.fork(2) as kids:
                kids.generate(prompt_token_ids=[[1], [2]], sampling_params=greedy(2))
                assert idle_invariant(llm)["pinned"] > 0
                raise KeyError("tool call failed")
    assert s.closed and all(k.closed for k in kids)
    assert_no_leak(llm.engine)


def test_a_session_dropped_without_close_gives_its_pin_back():
    """A session (or a fork's child) garbage-collected while open releases its pin reference, as
    an abandoned AsyncLLM stream aborts: its tokens become evictable, not pinned until
    ``pin_idle_timeout``; a session still open keeps the pin it shares."""
    llm = make_llm()
    s = llm.session(list(range(1, 30)))
    s.generate(sampling_params=greedy(2))
    kids = s.fork(2)
    kids.generate(prompt_token_ids=[[1], [2]], sampling_params=greedy(2))
    keep = kids[0]
    context = len(keep.tokens) - 1
    assert idle_invariant(llm)["pinned"] > context
    del s, kids
    gc.collect()
    assert idle_invariant(llm)["pinned"] == context == keep.pinned_tokens  # the kept child's own pin
    del keep
    gc.collect()
    assert idle_invariant(llm)["pinned"] == 0
    assert_no_leak(llm.engine)

    alm = AsyncLLM(engine=make_llm().engine)

    async def main():
        s = alm.session(list(range(1, 30)))
        await s.generate(sampling_params=greedy(2))
        assert alm.cache_stats()["pinned"] == len(s.tokens) - 1
        del s
        gc.collect()
        assert await alm.call_in_engine_thread(lambda e: e.cache_stats()["pinned"]) == 0  # the release came first
        await alm.call_in_engine_thread(assert_no_leak)

    try:
        asyncio.run(main())
    finally:
        alm.shutdown()


def test_validation_names_the_argument():
    llm = make_llm()
    s = llm.session([1, 2, 3])
    cases = [
        (lambda: s.generate(sampling_params=SamplingParams(n=2)), "n"),
        (lambda: s.generate(sampling_params={"max_tokens": 3}), "sampling_params"),
        (lambda: s.generate(prompt_token_ids=[1, VOCAB]), "prompt_token_ids"),
        (lambda: s.generate(prompt_token_ids="abc"), "prompt_token_ids"),
        (lambda: s.generate(text=5), "text"),
        (lambda: s.generate(text="x", prompt_token_ids=[1]), "prompt_token_ids"),
        (lambda: s.chat("hello"), "messages"),
        (lambda: s.fork(0), "n"),
        (lambda: s.fork(True), "n"),
        (lambda: s.select([]), "choices"),
        (lambda: s.select("ab"), "choices"),
        (lambda: s.select([[1], [VOCAB]]), "choices"),
        (lambda: s.select([[1]], method="max"), "method"),
        (lambda: s.select([[1]], message="hi"), "message"),
        (lambda: llm.session([1, -1]), "prompt"),
        (lambda: llm.session(3.5), "prompt"),
        (lambda: llm.session([{"content": "no role"}]), "prompt"),
        (lambda: llm.session().generate(), "text"),
        (lambda: llm.select([], [[1]]), "prompt"),
        (lambda: s.fork(2).generate(prompt_token_ids=[[1]]), "prompt_token_ids"),
    ]
    for call, param in cases:
        with pytest.raises(RequestError) as e:
            call()
        assert e.value.param == param, (param, str(e.value))
    s.generate(sampling_params=greedy(2))  # still usable
    s.close()
    with pytest.raises(RequestError) as e:
        s.generate()
    assert e.value.param == "session"
    s.close()  # idempotent
    with pytest.raises(ValueError, match="max_pinned_tokens"):
        make_llm(max_pinned_tokens=-1)
    with pytest.raises(ValueError, match="pin_idle_timeout"):
        make_llm(pin_idle_timeout=0)
    assert_no_leak(llm.engine)  # the forks made above had nothing pinned to hold


def test_a_turn_with_a_cache_salt_pins_its_context_in_the_salted_namespace():
    """A turn's ``SamplingParams.cache_salt`` joins its namespace (as in ``generate``); the turn's
    context is pinned there (it was pinned in the unsalted namespace, where nothing of it is
    cached: the session held no pin, its context was evictable)."""
    llm = make_llm()
    ctx = list(range(1, 30))
    with llm.session(ctx) as s:
        out = s.generate(prompt_token_ids=[3], sampling_params=greedy(4, cache_salt="k"))
        assert out.outputs[0].token_ids == reference(ctx + [3], 4)
        assert s.pinned_tokens == len(s.tokens) - 1 == idle_invariant(llm)["pinned"]
        old = len(s.tokens)
        out2 = s.generate(prompt_token_ids=[5], sampling_params=greedy(2, cache_salt="k"))
        assert out2.num_cached_tokens == old - 1  # the old context but its last token
        unsalted = s.generate(prompt_token_ids=[6], sampling_params=greedy(2))  # another namespace: a miss
        assert unsalted.num_cached_tokens == 0 and s.pinned_tokens == len(s.tokens) - 1
    with llm.session(ctx, namespace=Namespace(salt="a")) as s:
        with pytest.raises(RequestError) as e:
            s.generate(sampling_params=greedy(2, cache_salt="b"))
        assert e.value.param == "cache_salt"
        s.generate(sampling_params=greedy(2, cache_salt="a"))  # its own salt: the same namespace
        assert s.pinned_tokens == len(s.tokens) - 1
    idle_invariant(llm)
    assert_no_leak(llm.engine)
    tenant = make_llm(namespace="t")  # an explicit default namespace on an LLM that has its own
    with tenant.session(ctx, namespace=Namespace()) as s:
        for salt in (None, "k"):
            s.generate(sampling_params=greedy(2, cache_salt=salt))
            assert s.pinned_tokens == len(s.tokens) - 1
    assert_no_leak(tenant.engine)


def test_without_a_prefix_cache_sessions_work_and_pin_nothing():
    llm = make_llm(cache="none")
    with llm.session(list(range(1, 20))) as s:
        out = s.generate(sampling_params=greedy(3))
        assert out.outputs[0].token_ids == reference(list(range(1, 20)), 3)
        out2 = s.generate(prompt_token_ids=[4], sampling_params=greedy(3))
        assert out2.num_cached_tokens == 0 and out2.outputs[0].token_ids == reference(s.tokens[:-3], 3)
        assert s.pinned_tokens == 0 and idle_invariant(llm)["pinned"] == 0
    assert_no_leak(llm.engine)


def test_reset_prefix_cache_drops_session_pins():
    llm = make_llm()
    s = llm.session(list(range(1, 20)))
    s.generate(sampling_params=greedy(2))
    assert s.pinned_tokens > 0
    assert llm.reset_prefix_cache() is True
    assert s.pinned_tokens == 0 and llm.cache_stats()["free"] == llm.cache_stats()["capacity"]
    out = s.generate(prompt_token_ids=[3], sampling_params=greedy(2))  # recomputed, still correct
    assert out.num_cached_tokens == 0 and out.outputs[0].token_ids == reference(s.tokens[:-2], 2)
    s.close()
    assert_no_leak(llm.engine)


def test_async_sessions_and_forks():
    runner = FakeRunner(512, 1, 16)
    alm = AsyncLLM(
        engine=LLM(device="cpu", model_runner=runner, tokenizer=None, eos_token_ids=[], max_total_tokens=512).engine
    )

    async def main():
        async with alm.session(list(range(1, 30))) as s:
            out = await s.generate(prompt_token_ids=[5, 6], sampling_params=greedy(4))
            assert out.outputs[0].token_ids == reference(list(range(1, 30)) + [5, 6], 4)
            stats = alm.cache_stats()
            assert stats["pinned"] == s.pinned_tokens == len(s.tokens) - 1
            async with await s.fork(2) as kids:
                outs = await kids.generate(prompt_token_ids=[[1], [2]], sampling_params=greedy(3))
                for k, o, new in zip(kids, outs, ([1], [2])):
                    assert o.outputs[0].token_ids == reference(s.tokens + new, 3)
                    assert k.tokens == s.tokens + new + o.outputs[0].token_ids
                    assert o.num_cached_tokens == len(s.tokens) - 1 + (k is kids[1])  # the 2nd shares the 1st's row
            with pytest.raises(RequestError):
                await s.generate(sampling_params=SamplingParams(n=3))
        stats = alm.cache_stats()
        assert stats["pinned"] == 0 and stats["protected"] == 0
        assert stats["free"] + stats["evictable"] == stats["capacity"]
        await alm.call_in_engine_thread(lambda e: e.check_integrity())

    try:
        asyncio.run(main())
    finally:
        alm.shutdown()


def test_async_turn_cancelled_midway_leaves_the_session_as_it_was():
    from radixkv.engine import StepFinished

    runner = FakeRunner(512, 1, 16)
    alm = AsyncLLM(
        engine=LLM(device="cpu", model_runner=runner, tokenizer=None, eos_token_ids=[], max_total_tokens=512).engine
    )

    async def main():
        s = alm.session(list(range(1, 30)))
        await s.generate(sampling_params=greedy(2))
        ctx, pinned = s.tokens, s.pinned_tokens
        loop = asyncio.get_running_loop()
        turn = asyncio.ensure_future(s.generate(prompt_token_ids=[4], sampling_params=greedy(200)))
        steps = []

        def on_step(ev):
            steps.append(ev.step)
            if len(steps) == 3:
                loop.call_soon_threadsafe(turn.cancel)

        off = alm.subscribe(on_step, (StepFinished,))
        with pytest.raises(asyncio.CancelledError):
            await turn
        off()
        assert s.tokens == ctx and s.pinned_tokens == pinned  # the old context, still pinned
        out = await s.generate(prompt_token_ids=[4], sampling_params=greedy(3))  # usable again
        assert out.outputs[0].token_ids == reference(ctx + [4], 3)
        await s.close()
        while await alm.call_in_engine_thread(lambda e: e.has_unfinished_requests()):
            await alm.call_in_engine_thread(lambda e: None)
        st = alm.cache_stats()
        assert st["pinned"] == 0 and st["protected"] == 0 and st["free"] + st["evictable"] == st["capacity"]
        await alm.call_in_engine_thread(lambda e: e.check_integrity())

    try:
        asyncio.run(main())
    finally:
        alm.shutdown()


def test_fork_is_bounded_by_max_n():
    """``fork(n)`` takes n in [1, max_n] (the bound of SamplingParams.n): past it a RequestError
    naming the limit, before any reference is taken."""
    llm = make_llm(max_n=4)
    s = llm.session(list(range(1, 20)))
    s.generate(sampling_params=greedy(2))
    pin = s._pin
    for n in (5, 100000):
        with pytest.raises(RequestError) as e:
            s.fork(n)
        assert e.value.param == "n" and str(e.value) == f"fork n={n} exceeds this engine's max_n 4"
    assert pin.refs == 1 and llm.engine.kv.num_pins == 1
    with s.fork(4) as kids:
        assert len(kids) == 4 and pin.refs == 5
    s.close()
    assert_no_leak(llm.engine)
    with pytest.raises(RequestError, match="max_n 128"):  # the default bound
        make_llm().session([1, 2]).fork(100000)


def test_async_fork_is_bounded_by_max_n():
    runner = FakeRunner(256, 1, 16)
    alm = AsyncLLM(device="cpu", model_runner=runner, tokenizer=None, eos_token_ids=[], max_total_tokens=256, max_n=3)

    async def main():
        async with alm.session(list(range(1, 20))) as s:
            with pytest.raises(RequestError) as e:
                await s.fork(100000)
            assert e.value.param == "n" and "max_n 3" in str(e.value)
            async with await s.fork(3) as kids:
                assert len(kids) == 3

    try:
        asyncio.run(main())
    finally:
        alm.shutdown()


def test_batch_turns_pin_each_context_when_its_turn_finishes():
    """A child whose turn ends first holds its new context's pin from the next step on, while the
    others still run (its finish hook runs before any further step, on LLM as on AsyncLLM)."""
    from radixkv.engine import StepFinished

    llm = make_llm()
    s = llm.session(list(range(1, 30)))
    s.generate(sampling_params=greedy(2))
    kids = s.fork(2)
    pins_per_step = []
    off = llm.engine.events.subscribe(lambda ev: pins_per_step.append(llm.engine.kv.num_pins), (StepFinished,))
    outs = kids.generate(prompt_token_ids=[[1], [2]], sampling_params=[greedy(1), greedy(6)])
    off()
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 6]
    # one pin (the parent's, three holders) until the first child's turn ends, then two, then its
    # sibling's new pin replaces their shared one's last child reference (the parent still holds it)
    assert pins_per_step[0] == 1 and pins_per_step[-1] == 2 and pins_per_step.count(2) == len(pins_per_step) - 1
    assert kids[0].pinned_tokens == len(kids[0].tokens) - 1 and llm.engine.kv.num_pins == 3
    kids.close()
    s.close()
    assert_no_leak(llm.engine)


def test_generate_batch_hooks_run_before_the_next_step():
    """``LLM.generate_batch`` / ``AsyncLLM.generate_batch``: each request's ``on_finish`` runs
    right after the step that finished it, before any other step; a hook that raises is logged,
    the batch goes on."""
    from radixkv.engine import RequestFinished, StepFinished

    def check(engine, run):
        steps, finished, seen = [], {}, {}
        off = engine.events.subscribe(
            lambda ev: (
                steps.append(ev.step) if isinstance(ev, StepFinished) else finished.setdefault(ev.request_id, ev.step)
            ),
            (StepFinished, RequestFinished),
        )

        def hook(i):
            def on_finish(e, out):
                seen[i] = (out.request_id, steps[-1], len(out.outputs[0].token_ids))
                if i == 1:
                    raise KeyError("a caller's bug")

            return on_finish

        requests = [([5, 6, 7], greedy(2), None), ([5, 6, 8], greedy(5), None), ([9], greedy(3), "other")]
        outs = run(requests, [hook(0), hook(1), None])
        off()
        assert [o.outputs[0].token_ids for o in outs] == [reference(r[0], r[1].max_tokens) for r in requests]
        assert sorted(seen) == [0, 1]
        for i, (rid, step, n) in seen.items():
            assert rid == outs[i].request_id and step == finished[rid] and n == requests[i][1].max_tokens

    llm = make_llm()
    check(llm.engine, llm.generate_batch)
    alm = AsyncLLM(
        device="cpu", model_runner=FakeRunner(256, 1, 16), tokenizer=None, eos_token_ids=[], max_total_tokens=256
    )
    try:
        check(alm.engine, lambda reqs, hooks: asyncio.run(alm.generate_batch(reqs, hooks)))
    finally:
        alm.shutdown()


def test_generate_batch_refuses_malformed_requests_and_hooks_naming_them():
    """``generate_batch`` on ``LLM`` and ``AsyncLLM``: a request that is not a ``(prompt token
    ids, SamplingParams, namespace)`` triple, or ``on_finish`` of another length than the
    requests, is a RequestError naming ``requests`` / ``on_finish``. AsyncLLM submitted only as
    many requests as hooks and awaited the others forever; a request of two or four items was an
    IndexError / ValueError (or its extra item ignored)."""
    ok = ([5, 6, 7], greedy(2), None)
    cases = [
        ("abc", None, "requests"),
        ([([5, 6], greedy(2))], None, "requests"),
        ([([5, 6], greedy(2), None, "extra")], None, "requests"),
        ([ok, ok], [None], "on_finish"),
        ([ok], [None, None], "on_finish"),
        ([ok], ["not callable"], "on_finish"),
        ([([5, 6], {"max_tokens": 2}, None)], None, "sampling_params"),
    ]
    llm = make_llm()
    alm = AsyncLLM(
        device="cpu", model_runner=FakeRunner(256, 1, 16), tokenizer=None, eos_token_ids=[], max_total_tokens=256
    )

    async def on_alm(reqs, hooks):
        return await asyncio.wait_for(alm.generate_batch(reqs, hooks), 30)

    try:
        for run in (llm.generate_batch, lambda reqs, hooks: asyncio.run(on_alm(reqs, hooks))):
            for reqs, hooks, param in cases:
                with pytest.raises(RequestError) as e:
                    run(reqs, hooks)
                assert e.value.param == param, (reqs, hooks, str(e.value))
            outs = run([ok, ([9], None, None)], [None, None])  # None params: the defaults
            assert outs[0].outputs[0].token_ids == reference([5, 6, 7], 2) and len(outs) == 2
        idle_invariant(llm)
    finally:
        alm.shutdown()


def test_async_fork_cancelled_midway_gives_its_references_back():
    """The caller of ``await s.fork(n)`` is cancelled while the engine thread takes the pin
    references: they are given back on the engine thread, none is lost."""
    import threading

    runner = FakeRunner(256, 1, 16)
    alm = AsyncLLM(device="cpu", model_runner=runner, tokenizer=None, eos_token_ids=[], max_total_tokens=256)

    async def main():
        s = alm.session(list(range(1, 20)))
        await s.generate(sampling_params=greedy(2))
        pin = s._pin
        assert pin.refs == 1
        held, release = threading.Event(), threading.Event()

        def block(e):
            held.set()
            release.wait(60)

        blocker = alm.submit(block)  # the engine thread waits: the fork's call queues behind
        await asyncio.get_running_loop().run_in_executor(None, held.wait, 60)
        fork = asyncio.ensure_future(s.fork(3))
        await asyncio.sleep(0)  # the fork posts its call
        fork.cancel()
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await fork
        await asyncio.wrap_future(blocker)
        await alm.call_in_engine_thread(lambda e: None)  # the fork's call ran and its undo was posted
        await alm.call_in_engine_thread(lambda e: None)  # and ran
        assert pin.refs == 1 and s.pinned_tokens > 0
        await s.close()
        st = alm.cache_stats()
        assert st["pinned"] == 0 and st["free"] + st["evictable"] == st["capacity"]

    try:
        asyncio.run(main())
    finally:
        alm.shutdown()


def test_branching_uses_only_public_methods_of_the_front_ends():
    """The branching package reaches into no private member of LLM / AsyncLLM / Engine, and the
    front ends import no private name of it."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "radixkv"
    for path in (root / "branching").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                if node.value.id in ("owner", "llm", "alm", "engine", "e") and node.attr.startswith("_"):
                    raise AssertionError(f"{path.name}: {node.value.id}.{node.attr}")
            if isinstance(node, ast.Attribute) and node.attr == "kv":
                raise AssertionError(f"{path.name}: reaches into the engine's KV manager")
    for name in ("llm.py", "async_llm.py"):
        tree = ast.parse((root / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("radixkv.branching"):
                assert not [a.name for a in node.names if a.name.startswith("_")], name
