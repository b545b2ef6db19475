"""The cache simulator (radixkv/sim): it replays a trace exactly as the engine serves it one
request at a time (same cached tokens, same outcomes, same evictions, checked against the
fake-runner engine of test_scheduler.py), conserves slots, and its ShareGPT token cache is built
once when two processes ask for it at the same time."""

from __future__ import annotations

import multiprocessing as mp
import random

import numpy as np
import pytest
from test_scheduler import VOCAB, make_engine, run_all

from radixkv.sampling_params import SamplingParams
from radixkv.sim import CacheSimulator, SimRequest, capacity_bound, simulate

pytestmark = pytest.mark.timeout(300)


def _trace(seed: int, n: int = 40) -> list[tuple[list[int], object]]:
    """Prompts with shared system prompts, follow-ups that extend earlier prompts, repeats and
    two namespaces."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(10, 40))] for _ in range(3)]
    out: list = []
    for _ in range(n):
        r = rng.random()
        if out and r < 0.2:
            p, ns = rng.choice(out)
            p = p + [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 12))]
        elif out and r < 0.3:
            p, ns = rng.choice(out)
        else:
            p = rng.choice(systems) + [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 30))]
            ns = rng.choice([None, None, "tenant-b"])
        out.append((p, ns))
    return out


@pytest.mark.parametrize(
    "cache,page_size,capacity", [("radix", 1, 160), ("radix", 4, 192), ("hash", 4, 192), ("radix", 1, 4096)]
)
def test_simulator_equals_the_engine_served_one_request_at_a_time(cache, page_size, capacity):
    trace = _trace(page_size * 7 + capacity)
    eng = make_engine(capacity=capacity, page_size=page_size, cache=cache, chunk=16)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    engine_rows, replies = [], []
    for p, ns in trace:
        rid = eng.add_request(p, params, namespace=ns)
        out = run_all(eng)[rid]
        engine_rows.append((out.num_cached_tokens, out.cache_outcome))
        replies.append(out.outputs[0].token_ids)
    sim = CacheSimulator(cache, page_size, capacity, hash_algo="sha256", chunked_prefill_size=16)
    res = sim.run([SimRequest(p, r, ns) for (p, ns), r in zip(trace, replies)])
    assert [(r.num_cached_tokens, r.outcome) for r in res.requests] == engine_rows
    assert res.evicted_tokens == eng.cache_stats()["evicted_tokens"]
    assert res.cached_tokens == eng.cache_stats()["cached_tokens"] and res.skipped == 0
    assert sum(res.missed_by_cause.values()) == res.prompt_tokens - res.cached_tokens
    if capacity < 1000:
        assert res.evicted_tokens > 0 and "evicted" in res.missed_by_cause


def test_infinite_capacity_never_evicts_and_a_request_larger_than_memory_is_skipped():
    trace = [SimRequest(p, [7, 8, 9], ns) for p, ns in _trace(3, 60)]
    res = simulate(trace, "radix", 1, None)
    assert res.evicted_tokens == 0 and res.capacity == capacity_bound(trace, 1)
    assert res.hit_rate == simulate(trace, "radix", 1, 10**6).hit_rate
    none = simulate(trace, "none", 4, None)
    assert none.cached_tokens == 0 and set(none.missed_by_cause) == {"disabled", "full"}
    small = CacheSimulator("radix", 1, 32)
    r = small.serve(SimRequest(list(range(1, 40))))
    assert not r.served and small.kv.free_size() == 32
    with pytest.raises(ValueError):
        small.serve(SimRequest([]))
    with pytest.raises(ValueError):
        CacheSimulator("lru-k", 1, 64)


def _build(path: str, q) -> None:
    from radixkv.sim.sharegpt import ensure_token_cache

    q.put(ensure_token_cache(path, limit=12))


def test_two_processes_build_the_sharegpt_token_cache_once(tmp_path):
    path = tmp_path / "tokens.npz"
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_build, args=(str(path), q)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(240)
    assert [p.exitcode for p in procs] == [0, 0]
    built = sorted(q.get(timeout=5) for _ in procs)
    assert built == [False, True]  # one built it, the other waited and found it
    assert sorted(f.name for f in tmp_path.iterdir()) == ["tokens.npz", "tokens.npz.lock"]  # no temp file left
    from radixkv.sim.sharegpt import load_conversations

    convs, frame = load_conversations(path=path)
    assert len(convs) == 12 and all(len(c) % 2 == 0 and c for c in convs)
    with np.load(path) as z:
        assert int(z["lens"].sum()) == sum(len(m) for c in convs for m in c)
    assert frame["eos"] and frame["user"]


def test_pages_larger_than_the_first_block_table():
    """Pages of 8,192 tokens: a 100-token prompt takes one whole page of slots, which the
    simulator's block table (4,096 positions at first) must hold; it raised "ReqToTokenPool.write:
    positions [0, 8192) exceed max_context_len 4096" (``radixkv explain --page-size 8192``)."""
    long = list(range(1, 9001))
    res = simulate([SimRequest(long[:100])] * 2 + [SimRequest(long)] * 2, "radix", 8192, 32768)
    assert [r.num_cached_tokens for r in res.requests] == [0, 0, 0, 8192]
    assert res.skipped == 0 and res.cache_tokens_end == 8192
