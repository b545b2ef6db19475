"""A request abandoned by its consumer is aborted, however the consumer leaves (issue 19): a
``break`` or an exception out of ``async for`` over a stream held in a variable, cancellation,
garbage collection; ``AsyncLLM``'s stats methods have ``LLM``'s shape; one ``LLM`` shared by
threads is serialized. Over a gated null runner (no model): after its first forward every
forward waits for the test's gate, so a request cannot finish before the consumer has left, and
the test then waits on the engine's ``RequestFinished`` event (no sleeps)."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import threading

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from obs_helpers import NullRunner  # noqa: E402

from radixkv import LLM, AsyncLLM, SamplingParams  # noqa: E402
from radixkv.async_llm import EngineDeadError  # noqa: E402
from radixkv.engine import CacheEvicted, CacheInserted, EngineStats, RequestFinished  # noqa: E402

pytestmark = pytest.mark.timeout(300)

VOCAB = 1000
LONG = SamplingParams(max_tokens=200, ignore_eos=True, temperature=0)


class GatedRunner(NullRunner):
    """Forwards beyond ``free`` wait until ``gate`` is set."""

    def __init__(self) -> None:
        super().__init__(VOCAB, 1, 8, max_context_len=512)
        self.calls = 0
        self.free = 1 << 30
        self.gate = threading.Event()

    def forward(self, b):
        self.calls += 1
        if self.calls > self.free:
            assert self.gate.wait(60), "the test never opened the gate"
        return super().forward(b)

    def hold_after(self, n: int) -> None:
        """Let ``n`` more forwards run, then hold the rest until :meth:`release`."""
        self.gate.clear()
        self.free = self.calls + n

    def release(self) -> None:
        self.free = 1 << 30
        self.gate.set()


@pytest.fixture(scope="module")
def alm():
    runner = GatedRunner()
    a = AsyncLLM(model_runner=runner, tokenizer=None, eos_token_ids=[], device="cpu", max_total_tokens=4096)
    finished: dict[str, tuple] = {}
    done = threading.Condition()

    def on_finished(ev: RequestFinished) -> None:  # the engine thread
        with done:
            finished[ev.request_id] = ev.finish_reasons
            done.notify_all()

    a.subscribe(on_finished, (RequestFinished,))
    a.runner, a.finished, a.done = runner, finished, done
    yield a
    a.shutdown()


def wait_finished(a, rid: str) -> tuple:
    with a.done:
        assert a.done.wait_for(lambda: rid in a.finished, 60), f"{rid} never finished"
        return a.finished[rid]


def assert_whole(a) -> None:
    asyncio.run(a.call_in_engine_thread(lambda e: e.check_integrity()))
    st = a.cache_stats()
    assert st["free"] + st["evictable"] + st["pinned"] == st["capacity"], st
    assert st["protected"] == st["pinned"] == 0, st
    assert a.num_unfinished_requests() == 0


def abandon(a, rid: str, how) -> tuple:
    """Start ``rid``, let ``how`` consume its first output and leave; returns its finish reasons."""
    a.runner.hold_after(1)
    try:
        asyncio.run(how(a, rid))
    finally:
        a.runner.release()
    return wait_finished(a, rid)


async def _break_held(a, rid):
    gen = a.generate([1, 2, 3], LONG, rid)
    async for out in gen:
        assert not out.finished
        break
    assert gen.request_id == rid  # still held: only the loop's iterator was dropped


async def _raise_held(a, rid):
    gen = a.generate([1, 2, 3], LONG, rid)
    with pytest.raises(KeyError):
        async for _ in gen:
            raise KeyError("consumer failed")
    assert gen.request_id == rid


async def _cancel(a, rid):
    first = asyncio.Event()

    async def consume():
        async for _ in a.generate([1, 2, 3], LONG, rid):
            first.set()

    task = asyncio.create_task(consume())
    await first.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def _collect_garbage(a, rid):
    gen = a.generate([1, 2, 3], LONG, rid)
    out = await gen.__anext__()  # consumed by hand, never closed
    assert not out.finished
    del gen
    gc.collect()


async def _return_from_loop(a, rid):
    async def first_text():
        async for out in a.generate([1, 2, 3], LONG, rid):
            return out

    assert (await first_text()).outputs[0].token_ids == [0]


@pytest.mark.parametrize(
    "how", [_break_held, _raise_held, _cancel, _collect_garbage, _return_from_loop], ids=lambda f: f.__name__[1:]
)
def test_an_abandoned_request_is_aborted(alm, how):
    rid = f"abandoned-{how.__name__}"
    assert abandon(alm, rid, how) == ("abort",)
    assert_whole(alm)


def test_a_consumed_request_finishes_normally(alm):
    async def run():
        gen = alm.generate([1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True, temperature=0), "whole")
        return [out async for out in gen]

    outs = asyncio.run(run())
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
    assert outs[-1].outputs[0].token_ids == [0] * 5
    assert wait_finished(alm, "whole") == ("length",)
    assert_whole(alm)


def test_async_stats_have_llms_shape(alm):
    st = before = alm.cache_stats()
    assert isinstance(st, EngineStats) and st["capacity"] == 4096  # plain method, subscriptable
    assert isinstance(alm.num_unfinished_requests(), int)

    async def run():
        gen = alm.generate([7, 8, 9, 10], SamplingParams(max_tokens=3, ignore_eos=True), "stats")
        async for out in gen:
            if out.finished:
                # the snapshot is published before the final output is delivered
                return alm.cache_stats(), alm.num_unfinished_requests()

    st, running = asyncio.run(run())
    assert running == 0
    assert st["free"] + st["evictable"] == st["capacity"] and st["protected"] == 0
    # prompt + output less the last sampled token (never computed) joined the cache
    assert st["cached"] - before["cached"] == 4 + 3 - 1


# ------------------------------------------------------------------------------ LLM from threads


def test_one_llm_shared_by_threads_is_serialized():
    from radixkv.models.loader import load_tokenizer

    tok = load_tokenizer()
    llm = LLM(
        model_runner=NullRunner(len(tok), 1, 8, max_context_len=512),
        tokenizer=tok,
        eos_token_ids=[],
        device="cpu",
        max_total_tokens=2048,
    )
    errors: list[BaseException] = []
    results: dict[tuple, list] = {}
    start = threading.Barrier(4)
    p = SamplingParams(max_tokens=3, temperature=0)

    def work(k: int) -> None:
        try:
            start.wait(30)
            for i in range(15):
                if k == 0:
                    outs = llm.generate(prompt_token_ids=[[k + 1, i + 1, 5]] * 2, sampling_params=p, use_tqdm=False)
                elif k == 1:
                    outs = llm.chat([{"role": "user", "content": f"question {i}"}], p, use_tqdm=False)
                elif k == 2:
                    with llm.session([9, 9, i + 1]) as s:
                        outs = [s.generate(prompt_token_ids=[4], sampling_params=p)]
                else:
                    st = llm.cache_stats()
                    assert st["free"] + st["cached"] + st["in_use"] == st["capacity"], st
                    outs = llm.generate(f"text {i}", p, use_tqdm=False)
                results[(k, i)] = [o.outputs[0].token_ids for o in outs]
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert len(results) == 60
    assert all(toks == [[0, 0, 0]] * len(toks) for toks in results.values())
    assert not llm.engine.has_unfinished_requests() and llm.num_unfinished_requests() == 0
    llm.engine.check_integrity()
    st = llm.cache_stats()
    assert st["free"] + st["evictable"] == st["capacity"] and st["protected"] == st["pinned"] == 0, st


def test_stats_after_shutdown_show_the_aborted_request_released():
    """``cache_stats()`` after ``shutdown()`` is the engine's state once the request in flight
    was aborted and released (it kept the last step's snapshot: a request still running, its
    slots in use)."""
    runner = GatedRunner()
    a = AsyncLLM(model_runner=runner, tokenizer=None, eos_token_ids=[], device="cpu", max_total_tokens=4096)
    runner.hold_after(1)  # the prefill runs; the next forward waits at the gate

    async def shut_down_in_flight() -> None:
        stream = a.generate([1, 2, 3], LONG, "in-flight")
        assert not (await stream.__anext__()).finished
        assert a.cache_stats()["running"] == 1
        a.shutdown(timeout=0)  # posts the stop; the thread ends after its current step
        runner.release()
        await asyncio.get_running_loop().run_in_executor(None, a.shutdown)
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass

    asyncio.run(shut_down_in_flight())
    assert not a.is_running
    st = a.cache_stats()
    assert (st["running"], st["waiting"], st["in_use"], st["protected"]) == (0, 0, 0, 0), st
    assert st == a.engine.cache_stats()
    assert st["free"] + st["evictable"] == st["capacity"] == 4096


@pytest.fixture
def default_sigint():
    """Python's own SIGINT handler for the test: a shell's background job (``cmd &``, nohup)
    starts Python with SIGINT ignored, and Ctrl-C is then no KeyboardInterrupt at all."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


@pytest.mark.parametrize("kind", [CacheEvicted, CacheInserted], ids=lambda k: k.__name__)
def test_ctrl_c_in_the_middle_of_a_step_leaves_the_engine_whole(kind, default_sigint):
    """A SIGINT (Ctrl-C) arriving while ``LLM.generate`` is inside a step (here: while the radix
    tree evicts or inserts, where an event subscriber raises it) is held until the step returns;
    then KeyboardInterrupt ends the call, its requests aborted, and the engine is whole and gives
    the same tokens. Raised mid-step, it left the tree and the slot allocator half-updated
    (an evictable leaf missing from the LRU, slots neither free nor cached)."""
    assert threading.current_thread() is threading.main_thread()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    llm = LLM(
        model_runner=NullRunner(VOCAB, 1, 8, max_context_len=512),
        tokenizer=None,
        eos_token_ids=[],
        device="cpu",
        max_total_tokens=200,
    )
    p = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0)
    prompts = [[i + 1] * 40 for i in range(6)]
    for ids in prompts:  # the pool holds 200 tokens: later prompts evict earlier ones
        assert llm.generate(prompt_token_ids=ids, sampling_params=p, use_tqdm=False)[0].outputs[0].token_ids == [0] * 6
    seen = []

    def interrupt(ev) -> None:
        seen.append(ev)
        if len(seen) == 1:
            signal.raise_signal(signal.SIGINT)

    unsubscribe = llm.engine.events.subscribe(interrupt, (kind,))
    with pytest.raises(KeyboardInterrupt):
        for ids in prompts[::-1]:
            llm.generate(prompt_token_ids=ids, sampling_params=p, use_tqdm=False)
    unsubscribe()
    assert len(seen) >= 1 and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    llm.engine.check_integrity()
    assert llm.num_unfinished_requests() == 0
    st = llm.cache_stats()
    assert st["free"] + st["evictable"] == st["capacity"] == 200 and st["protected"] == 0, st
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=p, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [[0] * 6] * 6
    llm.engine.check_integrity()


async def _leave_by_aclose(stream) -> None:
    assert not (await stream.__anext__()).finished
    await stream.aclose()


async def _leave_by_break(stream) -> None:
    async for out in stream:
        assert not out.finished
        break


@pytest.mark.parametrize("leave", [_leave_by_aclose, _leave_by_break], ids=["aclose", "break"])
def test_a_request_id_is_free_again_once_its_consumer_left(alm, leave):
    """A consumer that closes its stream (or breaks out of it) and at once submits a new request
    of the same id gets the new request's outputs. The old request's final "abort" output was
    delivered to the new stream (its prompt, its tokens), which ended there while the new request
    ran on unread (aclose); after a break the new request was refused as a duplicate id."""
    new_params = SamplingParams(max_tokens=2, ignore_eos=True, temperature=0)

    async def run() -> list:
        alm.runner.hold_after(1)  # the first request cannot finish before its consumer leaves
        await leave(alm.generate([1, 2, 3], LONG, "reused"))  # after its first output
        new = asyncio.create_task(collect(alm.generate([4, 5, 6, 7], new_params, "reused")))
        await asyncio.sleep(0)  # not a wait: lets the task post its request (it then awaits the engine)
        alm.runner.release()
        return await new

    async def collect(stream) -> list:
        return [out async for out in stream]

    try:
        outs = asyncio.run(run())
    finally:
        alm.runner.release()
    last = outs[-1]
    assert last.finished and last.prompt_token_ids == [4, 5, 6, 7]
    assert last.outputs[0].finish_reason == "length" and last.outputs[0].token_ids == [0, 0]
    assert all(o.prompt_token_ids == [4, 5, 6, 7] for o in outs)
    assert_whole(alm)


_EXIT_HEADER = """
def report():  # registered first, so it runs last at exit
    alive = [t for t in threading.enumerate() if t.name == "radixkv-engine" and t.is_alive()]
    print("engine threads alive at exit:", len(alive), flush=True)

atexit.register(report)
a = AsyncLLM(model_runner=NullRunner(1000, 1, 8, max_context_len=8192), tokenizer=None, eos_token_ids=[],
             device="cpu", max_total_tokens=16384)
"""  # the two exit scripts' start: an AsyncLLM, and a report of the engine threads alive at exit


EXIT_SCRIPT = (
    """
import asyncio, atexit, sys, threading
sys.path.insert(0, "tests")
from obs_helpers import NullRunner
from radixkv import AsyncLLM, SamplingParams

"""
    + _EXIT_HEADER
    + """
async def start():
    stream = a.generate([1, 2, 3], SamplingParams(max_tokens=8000, ignore_eos=True), "in-flight")
    assert not (await stream.__anext__()).finished
    return stream

loop = asyncio.new_event_loop()
stream = loop.run_until_complete(start())  # still running when the script ends
print("running:", a.num_unfinished_requests(), flush=True)
"""
)


def test_interpreter_exit_stops_a_running_engine_thread_first():
    """A script that ends with an AsyncLLM request in flight (no shutdown) exits with code 0 and
    nothing on stderr: the engine thread is stopped at exit, before the interpreter finalizes.
    It was a daemon thread still stepping then, and one caught inside a torch call at
    finalization aborted the process now and then ("terminate called without an active
    exception", exit code 134)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root))
    proc = subprocess.run(
        [sys.executable, "-c", EXIT_SCRIPT], cwd=root, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["running: 1", "engine threads alive at exit: 0"], proc.stdout
    assert proc.stderr == ""


DROPPED_EXIT_SCRIPT = (
    """
import atexit, sys, threading, weakref
sys.path.insert(0, "tests")
from obs_helpers import NullRunner
from radixkv import AsyncLLM

"""
    + _EXIT_HEADER
    + """engine, gate, close = a.engine, threading.Event(), a.engine.close

def gated_close(timeout=None):  # the dropped AsyncLLM's thread closes the engine once the exit has begun
    assert gate.wait(60)
    close(timeout)
    print("engine closed", flush=True)

engine.close = gated_close
ref = weakref.ref(a)
del a  # dropped without shutdown(): collected, its thread goes on to close the engine
print("collected:", ref() is None, flush=True)
atexit.register(gate.set)  # registered last, so it runs first at exit
"""
)


def test_interpreter_exit_waits_for_a_dropped_async_llm_closing_its_engine():
    """An AsyncLLM dropped without shutdown closes its engine (the KV tiers' queued writes) on
    its own thread; a script that then ends waits for that close. The exit hook stopped only the
    AsyncLLMs still alive, so the interpreter finalized while the daemon thread was still inside
    the close: the tiers' last writes were cut off and the process aborted now and then
    ("terminate called without an active exception", exit code 134; seen with a disk tier and
    the default model, AsyncLLM made inside ``asyncio.run`` with no shutdown)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root))
    proc = subprocess.run(
        [sys.executable, "-c", DROPPED_EXIT_SCRIPT], cwd=root, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["collected: True", "engine closed", "engine threads alive at exit: 0"], (
        proc.stdout
    )
    assert proc.stderr == ""


LLM_EXIT_SCRIPT = """
import sys
sys.path.insert(0, "tests")
from tier_fakes import KVRunner, prompt_of
from radixkv import LLM, SamplingParams
from radixkv.tiers import DiskStore

llm = LLM("kv-runner", model_runner=KVRunner(256, 1, 16), tokenizer=None, eos_token_ids=[], device="cpu",
          max_total_tokens=256, tier_stores=[DiskStore(sys.argv[1], 1 << 30)], kv_tier_write_policy="write_back")
out = llm.generate([prompt_of(40)], SamplingParams(temperature=0.0, max_tokens=6))[0]
print("generated", len(out.outputs[0].token_ids), flush=True)
# no close(): the script just returns
"""


def test_interpreter_exit_closes_an_llm_so_a_write_back_disk_tier_gets_the_pool(tmp_path):
    """A script that makes an ``LLM`` with a disk tier written back, generates and just returns:
    its exit closes the LLM, so the disk gets what the pool still caches (as ``AsyncLLM``'s
    exit hook does). The tiers' finalizers finished only the writes already queued, and a
    write-back tier gets none before eviction: the next process found 0 tokens on disk."""
    import subprocess
    import sys
    from pathlib import Path

    from tier_fakes import kv_engine, prompt_of, reference, run_all

    from radixkv.sampling_params import SamplingParams
    from radixkv.tiers import DiskStore

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root))
    proc = subprocess.run([sys.executable, "-c", LLM_EXIT_SCRIPT, str(tmp_path)], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["generated 6"]
    e = kv_engine(stores=[DiskStore(str(tmp_path), 1 << 30)])
    rid = e.add_request(prompt_of(40), SamplingParams(temperature=0.0, max_tokens=6))
    out = run_all(e)[rid]
    assert out.outputs[0].token_ids == reference(prompt_of(40), 6)
    assert out.cached_tokens_by_tier == {"device": 0, "host": 0, "disk": 39, "remote": 0}
