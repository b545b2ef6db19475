"""Scheduler and cache life-cycle tests on CPU with a fake model runner (no weights).

The fake runner is a faithful stand-in for the KV pool: it stores (token, position) in every slot
it is told to write, reads each request's whole context back through ``kv_indptr`` /
``kv_indices`` exactly like an attention kernel, and returns one-hot logits of a hash of the
tokens it read. A wrong, stale or doubly-owned slot therefore changes the output (or trips the
position check), and the outputs must equal a pure-Python reference generator.
"""

from __future__ import annotations

import random
import zlib

import pytest
import torch
from random_drive import assert_outputs, random_drive

from radixkv.attention.metadata import ForwardBatch
from radixkv.config import EngineConfig
from radixkv.engine import Engine
from radixkv.engine.detokenizer import IncrementalDetokenizer
from radixkv.memory.kv_pool import ReqToTokenPool
from radixkv.sampling_params import SamplingParams

VOCAB = 64
pytestmark = pytest.mark.timeout(120)


def next_token(tokens) -> int:
    return 1 + zlib.crc32(bytes(str(list(tokens)), "ascii")) % (VOCAB - 1)


def reference(prompt, max_tokens):
    seq = list(prompt)
    for _ in range(max_tokens):
        seq.append(next_token(seq))
    return seq[len(prompt) :]


class FakeRunner:
    """Stores (token, position) per slot and computes next_token(context read through the page table)."""

    def __init__(self, num_slots, page_size, max_running=16, max_context_len=512, soft=False):
        self.page_size = page_size
        self.max_context_len = max_context_len
        self.vocab_size = VOCAB
        self.req_to_token_pool = ReqToTokenPool(max_running, max_context_len)
        self.kv = [None] * num_slots
        self.soft = soft  # sampling tests: logits spread over many tokens

    def build_batch(self, input_ids, req_rows, prefix_lens, extend_lens, logits_indices=None):
        return ForwardBatch.build(
            input_ids,
            req_rows,
            prefix_lens,
            extend_lens,
            self.req_to_token_pool.req_to_token,
            self.page_size,
            logits_indices=logits_indices,
        )

    def forward(self, b: ForwardBatch) -> torch.Tensor:
        ps = self.page_size
        for tok, pos, slot in zip(b.input_ids.tolist(), b.positions.tolist(), b.out_slots.tolist()):
            self.kv[slot] = (tok, pos)
        # every row's K/V is written before any row reads (as the attention backends do), so a
        # row may read positions another row of the same batch wrote (in-batch sharing)
        rows_logits = {}
        qo = b.qo_indptr_cpu.tolist()
        kvp = b.kv_indptr_cpu.tolist()
        pages = b.kv_indices.tolist()
        prefix = b.prefix_lens_cpu.tolist()
        contexts = []
        for i in range(b.batch_size):
            toks = []
            for p in range(int(b.seq_lens_cpu[i])):
                slot = pages[kvp[i] + p // ps] * ps + p % ps
                tok, pos = self.kv[slot]
                assert pos == p, f"slot {slot} holds position {pos}, expected {p}"
                toks.append(tok)
            contexts.append(toks)
        for row in b.logits_indices.tolist():  # the context of any row, not only a request's last
            i = next(k for k in range(b.batch_size) if qo[k] <= row < qo[k + 1])
            rows_logits[row] = contexts[i][: prefix[i] + row - qo[i] + 1]
        out = torch.full((b.num_logits, VOCAB), -1e9)
        for j, row in enumerate(b.logits_indices.tolist()):
            if self.soft:
                g = torch.Generator().manual_seed(zlib.crc32(bytes(str(rows_logits[row]), "ascii")))
                out[j] = torch.randn(VOCAB, generator=g)
            else:
                out[j, next_token(rows_logits[row])] = 10.0
        return out


def make_engine(
    capacity=512,
    page_size=1,
    cache="radix",
    chunk=64,
    max_running=16,
    policy="lpm",
    soft=False,
    in_batch=True,
    eviction="lru",
):
    cfg = EngineConfig(
        eviction_policy=eviction,
        device="cpu",
        page_size=page_size,
        max_total_tokens=capacity,
        prefix_cache=cache,
        chunked_prefill_size=chunk,
        max_running_requests=max_running,
        schedule_policy=policy,
        in_batch_prefix_sharing=in_batch,
    )
    runner = FakeRunner(capacity, page_size, max_running, soft=soft)
    return Engine(cfg, model_runner=runner, tokenizer=None, eos_token_ids=[])


def run_all(engine, check_every_step=True):
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if check_every_step:
            engine.check_integrity()
    return done


def assert_no_leak(engine):
    engine.check_integrity()
    s = engine.cache_stats()
    assert s["protected"] == 0
    assert s["free"] + s["evictable"] == s["capacity"]
    assert s["running"] == 0 and s["waiting"] == 0


def greedy(max_tokens=8, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def prompts_with_sharing(rng, n=8):
    system = [rng.randrange(1, VOCAB) for _ in range(37)]
    out = []
    for _i in range(n):
        out.append(system + [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 30))])
    out.append(out[0] + [5, 6, 7])  # extends another prompt
    out.append(list(out[1]))  # sent twice
    return system, out


CASES = [(c, ps) for c in ("radix", "hash", "none") for ps in (1, 4)]


@pytest.mark.parametrize("cache,page_size", CASES)
def test_outputs_match_reference_and_no_leak(cache, page_size):
    rng = random.Random(0)
    _, prompts = prompts_with_sharing(rng)
    eng = make_engine(page_size=page_size, cache=cache, chunk=32)
    ids = [eng.add_request(p, greedy(6 + i % 5)) for i, p in enumerate(prompts)]
    done = run_all(eng)
    for rid, p, i in zip(ids, prompts, range(len(prompts))):
        assert done[rid].outputs[0].token_ids == reference(p, 6 + i % 5)
        assert done[rid].outputs[0].finish_reason == "length"
    assert_no_leak(eng)
    if cache == "none":
        assert eng.cache_stats()["cached_tokens"] == 0


@pytest.mark.parametrize("cache,page_size", [(c, ps) for c in ("radix", "hash") for ps in (1, 4)])
def test_exact_cached_tokens(cache, page_size):
    rng = random.Random(1)
    system = [rng.randrange(1, VOCAB) for _ in range(30)]
    a = system + [1, 2, 3, 4, 5]
    b = system + [9, 9, 9]
    eng = make_engine(page_size=page_size, cache=cache)
    floor = lambda n: n // page_size * page_size  # noqa: E731
    # cold
    out = run_all_one(eng, a)
    assert out.num_cached_tokens == 0
    # identical repeat: everything but the last prompt token (page_size 1), floored to pages
    out = run_all_one(eng, a)
    assert out.num_cached_tokens == floor(len(a) - 1)
    # shared system prompt: the common prefix, floored to pages
    out = run_all_one(eng, b)
    assert out.num_cached_tokens == floor(len(system))
    # multi-turn continuation: prompt a + its reply (committed) + new tokens
    reply = reference(a, 8)
    turn2 = a + reply + [7, 7]
    out = run_all_one(eng, turn2)
    # the finished request inserted a + reply[:-1] (the last sampled token has no K/V)
    assert out.num_cached_tokens == floor(len(a) + len(reply) - 1)
    assert out.outputs[0].token_ids == reference(turn2, 8)
    s = eng.cache_stats()
    assert s["prompt_tokens"] == 2 * len(a) + len(b) + len(turn2)
    assert s["cached_tokens"] == floor(len(a) - 1) + floor(len(system)) + floor(len(a) + len(reply) - 1)
    assert s["hit_rate"] == pytest.approx(s["cached_tokens"] / s["prompt_tokens"])
    assert_no_leak(eng)


def run_all_one(eng, prompt, params=None):
    rid = eng.add_request(prompt, params or greedy(8))
    return run_all(eng)[rid]


def test_chunked_prefill_own_chunks_are_not_hits():
    prompt = list(range(1, 60)) + list(range(1, 42))
    eng = make_engine(chunk=16)
    out = run_all_one(eng, prompt)
    assert out.num_cached_tokens == 0
    assert out.outputs[0].token_ids == reference(prompt, 8)
    assert eng.cache_stats()["prefill_tokens"] == len(prompt)
    assert eng.num_forwards == -(-len(prompt) // 16) + 7  # chunks (last one samples) + 7 decodes
    assert_no_leak(eng)


@pytest.mark.parametrize("cache,page_size", [(c, ps) for c in ("radix", "hash") for ps in (1, 4)])
def test_running_request_shares_its_prefilled_prompt(cache, page_size):
    """A prompt is cached as soon as its prefill ends (chunk by chunk), not only at finish: a
    request arriving while the first one still decodes reuses the shared system prompt."""
    rng = random.Random(5)
    system = [rng.randrange(1, VOCAB) for _ in range(45)]
    a, b = system + [1, 2, 3], system + [4, 5]
    eng = make_engine(page_size=page_size, cache=cache, chunk=16)
    rid_a = eng.add_request(a, greedy(20))
    while eng.scheduler.running == [] or eng.scheduler.running[0].status.name != "DECODE":
        eng.step()
        eng.check_integrity()
    assert eng.cache_stats()["protected"] == len(a) // page_size * page_size
    rid_b = eng.add_request(b, greedy(5))
    done = run_all(eng)
    assert done[rid_a].num_cached_tokens == 0  # its own earlier chunks are not hits
    assert done[rid_b].num_cached_tokens == len(system) // page_size * page_size
    assert done[rid_a].outputs[0].token_ids == reference(a, 20)
    assert done[rid_b].outputs[0].token_ids == reference(b, 5)
    assert eng.cache_stats()["prefill_tokens"] == len(a) + len(b) - len(system) // page_size * page_size
    assert_no_leak(eng)


@pytest.mark.parametrize("cache,page_size", CASES)
def test_tiny_pool_evicts_and_retracts(cache, page_size):
    rng = random.Random(2)
    _, prompts = prompts_with_sharing(rng, n=10)
    eng = make_engine(capacity=160, page_size=page_size, cache=cache, chunk=48)
    params = greedy(24)
    ids = [eng.add_request(p, params) for p in prompts]
    done = run_all(eng)
    for rid, p in zip(ids, prompts):
        assert done[rid].outputs[0].token_ids == reference(p, 24)
    s = eng.cache_stats()
    assert s["num_retractions"] > 0
    if cache != "none":
        assert s["evicted_tokens"] > 0
    assert_no_leak(eng)


@pytest.mark.parametrize("eviction", ["lfu", "gdf", "reuse-odds"])
def test_eviction_policies_serve_exact_outputs_under_pressure(eviction):
    """EngineConfig.eviction_policy reaches the tree; every policy evicts (page by page) under a
    tiny pool with exact outputs and no leaked slot."""
    rng = random.Random(2)
    _, prompts = prompts_with_sharing(rng, n=10)
    eng = make_engine(capacity=160, page_size=4, chunk=48, eviction=eviction)
    assert eng.kv.cache.eviction_policy == eviction
    params = greedy(24)
    ids = [eng.add_request(p, params) for p in prompts]
    done = run_all(eng)
    for rid, p in zip(ids, prompts):
        assert done[rid].outputs[0].token_ids == reference(p, 24)
    assert eng.cache_stats()["evicted_tokens"] > 0
    assert_no_leak(eng)


def test_unknown_eviction_policy_is_refused():
    from radixkv.cache.evict_policy import POLICIES
    from radixkv.config import EVICTION_POLICIES

    assert set(EVICTION_POLICIES) == {"lru", *POLICIES}
    with pytest.raises(ValueError, match="eviction_policy must be one of"):
        EngineConfig(device="cpu", eviction_policy="mru").resolve()


@pytest.mark.parametrize("cache", ["hash", "none"])
def test_an_eviction_policy_without_the_radix_tree_is_refused(cache):
    # prefix_cache="hash" with eviction_policy="lfu" (serve --prefix-cache hash --radix-eviction-policy lfu)
    # ran the hash cache's LRU and said nothing
    with pytest.raises(ValueError) as e:
        EngineConfig(device="cpu", prefix_cache=cache, eviction_policy="lfu").resolve()
    assert str(e.value) == (
        f"eviction_policy='lfu' applies to prefix_cache='radix' only, got prefix_cache={cache!r} "
        "(the hash cache evicts LRU; none keeps nothing)"
    )
    assert EngineConfig(device="cpu", prefix_cache=cache).resolve().eviction_policy == "lru"


def test_eviction_never_frees_the_fresh_match():
    # The pool holds one cached 60-token sequence; the new request matches 40 of them and needs
    # room only eviction can make: pages of the 20 unmatched tokens go (page-granular, exactly what
    # is short: 30 prompt + 3 decode slots - 20 free = 13), the matched 40 stay and are reused.
    base = list(range(1, 61))
    eng = make_engine(capacity=80, chunk=128)
    first = run_all_one(eng, base, greedy(1))
    assert eng.cache_stats()["evictable"] == 60
    prompt = base[:40] + [3] * 30
    out = run_all_one(eng, prompt, greedy(4))
    assert out.num_cached_tokens == 40
    assert out.outputs[0].token_ids == reference(prompt, 4)
    assert eng.cache_stats()["evicted_tokens"] == 13
    assert first.outputs[0].token_ids == reference(base, 1)
    assert_no_leak(eng)


@pytest.mark.parametrize("cache,page_size", CASES)
def test_n_samples_share_one_prefill(cache, page_size):
    prompt = list(range(3, 40))
    L = len(prompt)
    eng = make_engine(page_size=page_size, cache=cache)
    out = run_all_one(eng, prompt, greedy(5, n=3))
    assert [o.index for o in out.outputs] == [0, 1, 2]
    for o in out.outputs:
        assert o.token_ids == reference(prompt, 5)
    # sample 0 computes the prompt; samples 1, 2 only what lies past the shared whole pages
    # (whole pages below the last prompt token, for every cache kind)
    shared = (L - 1) // page_size * page_size
    assert eng.cache_stats()["prefill_tokens"] == L + 2 * (L - shared)
    assert out.num_cached_tokens == 0
    assert_no_leak(eng)


def test_n_samples_seeded_are_reproducible_and_distinct():
    prompt = list(range(3, 30))
    outs = []
    for _ in range(2):
        eng = make_engine(soft=True)
        outs.append(run_all_one(eng, prompt, SamplingParams(n=3, max_tokens=12, temperature=1.0, seed=7)))
        assert_no_leak(eng)
    a, b = outs
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1


def test_seeded_sampling_independent_of_batch():
    prompt = list(range(5, 25))
    p = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=123)
    eng = make_engine(soft=True)
    alone = run_all_one(eng, prompt, p).outputs[0].token_ids
    eng2 = make_engine(soft=True)
    rid = eng2.add_request(prompt, p)
    for i in range(4):
        eng2.add_request([i + 1] * 7, SamplingParams(max_tokens=10, temperature=1.0))
    done = run_all(eng2)
    assert done[rid].outputs[0].token_ids == alone
    assert_no_leak(eng2)


@pytest.mark.parametrize("cache", ["radix", "hash", "none"])
def test_abort_running_and_waiting(cache):
    eng = make_engine(cache=cache, page_size=4 if cache == "hash" else 1, max_running=2)
    a = eng.add_request(list(range(1, 30)), greedy(50))
    b = eng.add_request(list(range(1, 20)) + [7], greedy(50, n=2))
    c = eng.add_request(list(range(2, 20)), greedy(50))  # waits: 2 rows only
    for _ in range(4):
        eng.step()
        eng.check_integrity()
    eng.abort_request(a)
    eng.abort_request(c)
    eng.abort_request("no-such-id")  # ignored
    outs = {o.request_id: o for o in eng.step()}
    assert outs[a].finished and outs[a].outputs[0].finish_reason == "abort"
    assert outs[c].finished and outs[c].outputs[0].finish_reason == "abort"
    assert 0 < len(outs[a].outputs[0].token_ids) < 50
    eng.check_integrity()
    eng.abort_request(b)
    done = run_all(eng)
    assert [o.finish_reason for o in done[b].outputs] == ["abort", "abort"]
    assert_no_leak(eng)
    # still usable
    out = run_all_one(eng, list(range(1, 30)))
    assert out.outputs[0].token_ids == reference(list(range(1, 30)), 8)
    assert_no_leak(eng)


def test_hit_rate_counts_a_request_at_its_first_admission_aborted_or_not():
    """``prompt_tokens`` / ``cached_tokens`` (``hit_rate``, ``radixkv_cache_hit_rate``) count a
    request when it is first admitted, as vLLM's PrefixCacheStats counts a query when the
    scheduler looks its prefix up: one aborted after that counts, one aborted while it waited
    (never looked up) does not."""
    eng = make_engine(max_running=1, policy="fcfs")
    p = list(range(1, 30))
    run_all_one(eng, p)
    a = eng.add_request(p, greedy(50))
    w = eng.add_request(p + [3], greedy(5))
    eng.step()  # a admitted (28 cached tokens), w waits for the one row
    assert eng.cache_stats()["waiting"] == 1
    eng.abort_request(w)
    eng.abort_request(a)
    run_all(eng)
    s = eng.cache_stats()
    assert (s.prompt_tokens, s.cached_tokens, s.hit_rate) == (58, 28, 28 / 58)
    assert_no_leak(eng)


def test_bad_inputs_raise_and_engine_stays_usable():
    eng = make_engine(capacity=256)
    with pytest.raises(ValueError, match="empty"):
        eng.add_request([], greedy())
    with pytest.raises(ValueError, match="max_context_len"):
        eng.add_request([1] * 600, greedy())
    with pytest.raises(ValueError, match="max_total_tokens"):
        eng.add_request([1] * 200, greedy(100))
    with pytest.raises(ValueError, match="vocabulary"):
        eng.add_request([1, VOCAB], greedy())
    with pytest.raises(ValueError, match="sampling_params"):
        eng.add_request([1, 2], {"max_tokens": 3})
    eng.add_request([1, 2, 3], greedy(), request_id="x")
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request([1, 2, 3], greedy(), request_id="x")
    done = run_all(eng)
    assert done["x"].outputs[0].token_ids == reference([1, 2, 3], 8)
    assert_no_leak(eng)


def test_fcfs_and_lpm_give_same_outputs():
    rng = random.Random(3)
    _, prompts = prompts_with_sharing(rng)
    results = []
    for policy in ("fcfs", "lpm"):
        eng = make_engine(policy=policy, chunk=40, max_running=4)
        ids = [eng.add_request(p, greedy(5)) for p in prompts]
        done = run_all(eng)
        results.append([done[r].outputs[0].token_ids for r in ids])
        assert_no_leak(eng)
    assert results[0] == results[1] == [reference(p, 5) for p in prompts]


def test_reset_prefix_cache():
    eng = make_engine()
    run_all_one(eng, list(range(1, 20)))
    assert eng.cache_stats()["evictable"] > 0
    rid = eng.add_request(list(range(1, 20)), greedy(30))
    eng.step()
    assert eng.reset_prefix_cache() is False
    eng.abort_request(rid)
    run_all(eng)
    assert eng.reset_prefix_cache() is True
    s = eng.cache_stats()
    assert s["evictable"] == 0 and s["free"] == s["capacity"]


def test_threaded_add_while_stepping():
    import threading

    eng = make_engine()
    prompts = [[i + 1] * (5 + i) for i in range(12)]
    ids = []

    def producer():
        for p in prompts:
            ids.append(eng.add_request(p, greedy(6)))

    t = threading.Thread(target=producer)
    t.start()
    done = {}
    while t.is_alive() or eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    t.join()
    assert [done[r].outputs[0].token_ids for r in ids] == [reference(p, 6) for p in prompts]
    assert_no_leak(eng)


class CharTokenizer:
    """Token i decodes to chr(ord('a') + i % 26); token 0 is special (dropped when skipping)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids if not (skip_special_tokens and i == 0))


def test_incremental_detokenizer_stop_string():
    det = IncrementalDetokenizer(CharTokenizer(), stop=["cd"])
    ids = []
    for t, expect_stop in [(0, False), (1, False), (2, False), (3, True)]:
        ids.append(t)
        assert det.update(ids) is expect_stop
    assert det.text == "b" and det.stopped_by == "cd"


@pytest.mark.parametrize("seed", range(6))
def test_random_workload_with_aborts(seed):
    """Random arrivals, shared prefixes, n > 1, aborts and a small pool: after every step the slot
    ownership is consistent, and every request that was not aborted equals the reference."""
    rng = random.Random(seed)
    cache = ["radix", "hash", "none"][seed % 3]
    page_size = [1, 4][seed // 3 % 2]
    eng = make_engine(
        capacity=rng.choice([96, 128, 256]),
        page_size=page_size,
        cache=cache,
        chunk=rng.choice([8, 24, 64]),
        max_running=rng.choice([2, 4, 8]),
        policy=rng.choice(["lpm", "fcfs"]),
    )
    bases = [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(4, 30))] for _ in range(3)]

    def arrive(step):
        if step < 60 and rng.random() < 0.4:
            p = rng.choice(bases) + [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 12))]
            mt, n = rng.randrange(1, 12), rng.choice([1, 1, 2, 3])
            yield eng.add_request(p, greedy(mt, n=n)), reference(p, mt)

    got = random_drive(eng, rng, arrive, lambda step: step < 60, steps=400, abort_p=0.05)
    assert not eng.has_unfinished_requests()
    assert_outputs(*got)
    assert_no_leak(eng)


def test_the_callers_config_is_not_changed():
    """The engine resolves a copy: a config reused for a second engine is what the caller wrote."""
    import dataclasses

    cfg = EngineConfig(device="cpu", max_total_tokens=256, chunked_prefill_size=64)
    before = dataclasses.asdict(cfg)
    eng = Engine(cfg, model_runner=FakeRunner(256, 1), tokenizer=None, eos_token_ids=[])
    assert dataclasses.asdict(cfg) == before and cfg.max_context_len is None
    assert eng.config is not cfg and eng.config.max_context_len == eng.max_context_len > 0
    again = Engine(cfg, model_runner=FakeRunner(256, 1), tokenizer=None, eos_token_ids=[])
    assert dataclasses.asdict(again.config) == dataclasses.asdict(eng.config)


def test_memory_short_decode_retracts_the_newest_admitted_request():
    """Out of slots while decoding, the request admitted last is retracted (not the oldest), it
    goes back to the front of the queue, and both still produce the reference tokens."""
    eng = make_engine(capacity=64, cache="none", chunk=64)
    a, b = [1, 2, 3, 4] * 5, [9, 8, 7, 6] * 5  # 20 tokens each, nothing shared
    rid_a, rid_b = eng.add_request(a, greedy(30)), eng.add_request(b, greedy(30))
    retracted = []
    plan = eng.scheduler.schedule

    def spy():
        batch = plan()
        if batch is not None:
            retracted.extend((r.request_id, r.admit_seq) for r in batch.retracted)
        return batch

    eng.scheduler.schedule = spy
    done = run_all(eng)
    assert done[rid_a].outputs[0].token_ids == reference(a, 30)
    assert done[rid_b].outputs[0].token_ids == reference(b, 30)
    # a and b are admitted together (seq 1, 2); 40 prompt + 2 x 12 decode slots fill the pool
    assert retracted[0] == (rid_b, 2)
    assert all(rid == rid_b for rid, _ in retracted)
    assert_no_leak(eng)
