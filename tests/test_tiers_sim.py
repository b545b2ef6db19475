"""KV tiers in the cache simulator (radixkv/sim/tiers.py) and `radixkv plan --trace` with them:
tiers by capacity written as the engine writes them, lookups as the engine's, the same cached tokens
by tier as the engine over the same requests, and the plan's hit rate without and with tiers."""

from __future__ import annotations

import json
import random

import pytest
from tier_fakes import VOCAB, MemoryStore, kv_engine, reference, run_all

from radixkv import LLM
from radixkv.cache.digests import block_digests
from radixkv.memory.kv_io import layout_of
from radixkv.obs.plan import hit_rate_curve
from radixkv.sampling_params import SamplingParams
from radixkv.sim import SimRequest, simulate
from radixkv.sim.tiers import TierModel

pytestmark = pytest.mark.timeout(300)


def test_tier_model_takes_written_blocks_lru_within_capacity():
    """The engine's writes (``TierModel.write``): write-through blocks go to the write-through
    tiers, evicted ones to the write-back tiers, each least recently used first within its
    capacity; lookups as the engine's, in whole pages."""
    tm = TierModel({"host": 32, "disk": 48})  # host: write-back, 2 blocks; disk: write-through, 3 blocks
    toks = list(range(1, 81))
    d = block_digests(toks, None, 0, 5)
    tm.write("write_through", None, toks, 0, 5)
    assert set(tm.held["disk"]) == set(d[:3]) and not tm.held["host"]  # deepest first: the head stays
    tm.write("write_back", None, toks, 3, 5)
    assert set(tm.held["host"]) == set(d[3:5])
    tm.write("write_through", None, toks, 0, 1, skip=("disk",))  # a tier the block came from: skipped
    assert set(tm.held["disk"]) == set(d[:3])
    # lookup after 5 pool tokens, below position 79: disk holds blocks 0-2, host 3-4
    assert tm.lookup(None, toks, 5, 79 // 16 * 16, 1) == [(5, 48, "disk"), (48, 64, "host")]
    assert tm.lookup(None, toks, 0, 64, 32) == [(0, 48, "disk"), (48, 64, "host")]  # pages of 32
    assert tm.lookup(None, toks, 0, 48, 32) == [(0, 32, "disk")]  # the run floored to whole pages
    assert tm.lookup("other", toks, 0, 64, 1) == []  # another namespace: other digests
    with pytest.raises(ValueError, match="tier"):
        TierModel({"tape": 16})


def test_a_tail_takes_its_own_tokens_of_a_tiers_capacity():
    """The engine's stores count a record's bytes, and a tail of ``c`` tokens is about ``c / 16``
    of a block's: the model counts a tail as its own tokens of a tier's capacity, not a whole
    block, so a tier that fills up keeps the blocks the engine keeps."""
    tm = TierModel({"host": 32})  # 2 blocks' worth, written back
    toks = list(range(1, 41))
    tm.write("write_back", None, toks, 0, 1, tail=4)  # block 0 and the 4-token tail after it
    tm.write("write_back", None, toks[16:], 0, 0, tail=8)  # another path's 8-token tail
    assert tm.used == {"host": 16 + 4 + 8} and len(tm.held["host"]) == 3
    assert tm.lookup(None, toks, 0, 39, 1) == [(0, 20, "host")]  # block 0 and its tail
    # block 1 (16 tokens): the least recently used go, the other path's tail, then block 0
    tm.write("write_back", None, toks, 1, 2, tail=0)
    assert tm.used == {"host": 4 + 16} and tm.lookup(None, toks, 0, 39, 1) == []


def _conversations(seed=0, n=6, turns=3, first=60, step=40, reply=3):
    """Turns of ``n`` conversations; each reply is the fake model's (tier_fakes.reference)."""
    rng = random.Random(seed)
    convs = [[rng.randrange(1, VOCAB) for _ in range(first + step * turns)] for _ in range(n)]
    return [
        SimRequest(c[: first + step * t], reply=reference(c[: first + step * t], reply))
        for t in range(turns)
        for c in convs
    ]


def test_simulated_tiers_raise_the_hit_rate_to_the_infinite_pools():
    reqs = _conversations()
    small = simulate(reqs, "radix", 1, 200, outcomes=False)
    infinite = simulate(reqs, "radix", 1, None, outcomes=False)
    assert small.hit_rate < 0.2 < infinite.hit_rate
    for ps, tier in ((1, "disk"), (4, "host")):
        tiered = simulate(reqs, "radix", ps, 200, outcomes=False, tiers={tier: 1 << 20})
        inf = simulate(reqs, "radix", ps, None, outcomes=False)
        assert set(tiered.cached_tokens_by_tier) == {tier} and tiered.cached_tokens_by_tier[tier] > 0
        # each request gets what the infinite pool gives it, but the tail of its last partial block
        gaps = [a.num_cached_tokens - b.num_cached_tokens for a, b in zip(inf.requests, tiered.requests)]
        assert all(0 <= g < 16 for g in gaps), gaps


@pytest.mark.parametrize("tier", ["disk", "host"])
def test_simulator_and_engine_agree_on_cached_tokens_by_tier(tier):
    reqs = _conversations(seed=1, n=4)
    sim = simulate(reqs, "radix", 1, 200, outcomes=False, tiers={tier: 1 << 20}, keep_requests=True)
    e = kv_engine(capacity=200, stores=[MemoryStore(tier)], chunk=2048)
    e.kv.tiers.costs.prefill_token_s = 1.0  # loading always pays: the simulator counts every held block
    got = []
    for r in reqs:  # one at a time, as the simulator serves them; the engine's replies are r.reply
        rid = e.add_request(list(r.tokens), SamplingParams(temperature=0.0, max_tokens=len(r.reply)))
        out = run_all(e)[rid]
        assert out.outputs[0].token_ids == list(r.reply)
        got.append((out.num_cached_tokens, out.cached_tokens_by_tier[tier]))
        e.kv.tiers.drain()
    want = [(x.num_cached_tokens, x.tier_tokens.get(tier, 0)) for x in sim.requests]
    assert got == want and sum(t for _, t in want) > 0


@pytest.mark.parametrize("capacity", [120, 200])
def test_a_written_back_tier_holds_the_tails_the_engines_evictions_leave(capacity):
    """A write-back tier stores the tail of each evicted path, replacing the one held after the
    same block: what it holds depends on how the evictions are cut. The engine evicts one page
    per decode step and installs a tier load (evicting for it) before admitting the prefill; the
    simulator evicted a reply's whole shortfall, and the load's slots with the prefill's, at once,
    so it kept other tails: with 12-token replies it served 32 cached tokens where the engine
    served 37 (``radixkv plan --trace`` / ``explain`` with a host tier, written back by default,
    differed from the engine fed the same requests)."""
    reqs = _conversations(seed=0, n=4, first=40, step=30, reply=12)
    sim = simulate(reqs, "radix", 1, capacity, outcomes=False, tiers={"host": 1 << 20}, keep_requests=True)
    e = kv_engine(capacity=capacity, stores=[MemoryStore("host")], chunk=2048)
    assert [s.medium for s in e.kv.tiers.back] == ["host"]  # the engine's default for host: written back
    got = _engine_tokens(e, reqs, "host")
    assert got == [(x.num_cached_tokens, x.tier_tokens.get("host", 0)) for x in sim.requests]
    assert sum(t for _, t in got) > 0


def test_plan_trace_shows_the_hit_rate_with_tiers(tmp_path, capsys):
    from radixkv.cli import main

    trace = tmp_path / "trace.jsonl"
    rng = random.Random(2)
    words = [f"w{i}" for i in range(300)]
    with trace.open("w") as f:
        convs = [[rng.choice(words) for _ in range(120)] for _ in range(6)]
        for t in range(3):
            for c in convs:
                body = {"model": "m", "messages": [{"role": "user", "content": " ".join(c[: 50 + 35 * t])}]}
                f.write(json.dumps(body) + "\n")
    rc = main(
        ["plan", "--model", "smollm2-135m", "--trace", str(trace), "--policies", "radix-p1", "--kv-dtype", "bf16"]
        + ["--json"]
        + ["--disk-cache-bytes", "1GiB"]
    )
    assert rc == 0
    rep = json.loads(capsys.readouterr().out)
    cv = rep["curve"]
    assert cv["tiers"]["disk"]["tokens"] == (1 << 30) // 370704 * 16  # whole bf16 records (below)
    rows = cv["curves"]["radix-p1"]
    assert all(r["hit_rate_tiers"] >= r["hit_rate"] for r in rows)
    assert any(r["hit_rate_tiers"] > r["hit_rate"] + 0.1 for r in rows)
    assert main(["plan", "--model", "smollm2-135m", "--disk-cache-bytes", "1GiB"]) == 2


def test_explain_trace_counts_what_the_tiers_serve():
    from radixkv.obs.explain import explain_trace
    from radixkv.obs.report import explain_text_report

    reqs = _conversations(seed=3)
    rep = explain_trace(reqs, None, capacity=200, tiers={"disk": 1 << 20}, spans=False, sweep=())
    plain = explain_trace(reqs, None, capacity=200, spans=False, sweep=())
    served = rep["tiers"]["served_tokens"]["disk"]
    assert served > 0 and rep["cached_tokens"] == plain["cached_tokens"] + served
    assert rep["missed_tokens"] == plain["missed_tokens"] and rep["causes_sum_to_missed"]
    assert any(m["tier_spans"] for m in rep["top_misses"]) or served
    assert f"the KV tiers below the pool served {served:,}: disk {served:,}" in explain_text_report(rep)


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_the_tiers_write_policy_is_replayed_as_the_engine_runs_it(policy, tmp_path, capsys):
    """A disk tier written back (only what the pool evicts) holds less than one written through:
    the simulator replays either policy as the engine runs it, request by request, and
    ``radixkv explain`` / ``radixkv plan`` take ``--kv-tier-write-policy`` as ``radixkv serve``
    does (they had no such flag and always replayed the engine's default, write-through for disk:
    a server run with a written-back disk tier served fewer tokens than explain said)."""
    from radixkv.cli import main
    from radixkv.obs.trace import write_trace

    reqs = _conversations(seed=4, n=4)
    sim = simulate(reqs, "radix", 1, 200, outcomes=False, tiers={"disk": 1 << 20}, tier_write_policy=policy)
    e = kv_engine(capacity=200, stores=[MemoryStore("disk")], chunk=2048, kv_tier_write_policy=policy)
    e.kv.tiers.costs.prefill_token_s = 1.0  # loading always pays: the simulator counts every held block
    assert _engine_tokens(e, reqs, "disk") == [
        (x.num_cached_tokens, x.tier_tokens.get("disk", 0)) for x in sim.requests
    ]
    other = simulate(reqs, "radix", 1, 200, outcomes=False, tiers={"disk": 1 << 20})  # the default: through
    # a tier that never fills serves the same either way: what the pool evicts, a written-back tier
    # gets, the longest tail of each path included
    assert sim.cached_tokens == other.cached_tokens == 640
    # the CLI: token-id prompts (completions bodies), no replies: the same replay without them; a
    # disk tier of 256 tokens serves 336 tokens written back, 72 written through (it keeps the latest),
    # as the engine's does: each write puts a sequence deepest first, so a tier too small keeps its head
    trace = write_trace(tmp_path / "t.jsonl", [{"prompt": list(r.tokens)} for r in reqs])
    bare = [SimRequest(r.tokens) for r in reqs]
    want = simulate(bare, "radix", 1, 200, tiers={"disk": 256}, tier_write_policy={"disk": policy})
    assert want.cached_tokens_by_tier == {"disk": {"write_back": 336, "write_through": 72}[policy]}
    small = MemoryStore("disk", capacity_bytes=256 * layout_of(e.runner.kv_pool).token_bytes)  # payload bytes
    e = kv_engine(capacity=200, stores=[small], chunk=2048, kv_tier_write_policy=policy)
    e.kv.tiers.costs.prefill_token_s = 1.0
    assert sum(t for _, t in _engine_tokens(e, bare, "disk", max_tokens=1)) == want.cached_tokens_by_tier["disk"]
    args = ["explain", str(trace), "--capacity", "200", "--disk-cache-tokens", "256", "--json", "--no-what-if"]
    assert main(args + ["--kv-tier-write-policy", f"disk={policy}"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["tiers"]["served_tokens"] == want.cached_tokens_by_tier and rep["cached_tokens"] == want.cached_tokens
    assert main(args + ["--kv-tier-write-policy", "disk=write_sideways"]) == 2
    assert "kv_tier_write_policy: disk must be one of" in capsys.readouterr().err
    assert main(["explain", str(trace), "--kv-tier-write-policy", policy]) == 2
    assert "--kv-tier-write-policy needs a KV tier" in capsys.readouterr().err


def _engine_tokens(e, reqs, medium: str, max_tokens=None) -> list:
    """Each of ``reqs`` run on engine ``e`` in turn (greedy, its reply's length or ``max_tokens``),
    the tier's writes drained after each: ``(num_cached_tokens, cached from medium)`` per request."""
    got = []
    for r in reqs:
        n = max_tokens or len(r.reply)
        rid = e.add_request(list(r.tokens), SamplingParams(temperature=0.0, max_tokens=n))
        out = run_all(e)[rid]
        got.append((out.num_cached_tokens, out.cached_tokens_by_tier[medium]))
        e.kv.tiers.drain()
    return got


def test_the_hash_caches_tiers_are_replayed_written_through_as_the_engine_runs_them():
    """The engine writes every tier through under ``prefix_cache="hash"`` (it does not report the
    blocks it evicts), so its default write-back host tier serves what it was written through; the
    simulator kept host write-back there and never wrote it: ``radixkv plan --trace T
    --host-cache-bytes 8GiB`` showed no gain from the host tier on its hash-b16 row (and
    ``radixkv explain --policy hash --host-cache-tokens N`` served 0) where the engine serves it.
    An explicit write-back with the hash cache is refused, as ``EngineConfig`` refuses it."""
    reqs = _conversations(seed=5, n=4)
    sim = simulate(reqs, "hash", 16, 208, outcomes=False, tiers={"host": 1 << 20}, keep_requests=True)
    e = kv_engine(capacity=208, page_size=16, stores=[MemoryStore("host")], chunk=2048, cache="hash")
    assert _engine_tokens(e, reqs, "host") == [
        (x.num_cached_tokens, x.tier_tokens.get("host", 0)) for x in sim.requests
    ]
    assert sim.cached_tokens_by_tier["host"] > 0
    for policy in ("write_back", {"host": "write_back"}):
        with pytest.raises(ValueError, match="write_back needs prefix_cache='radix'"):
            simulate(reqs, "hash", 16, 208, tiers={"host": 1 << 20}, tier_write_policy=policy)


@pytest.mark.parametrize("kv", ["float32", "fp8_e4m3"])
def test_plans_tier_blocks_are_the_blocks_the_engines_tiers_hold(kv, default_model, tmp_path):
    """``radixkv plan``'s tiers hold the whole blocks the engine's do: a block is its record (K/V
    with fp8's scales, token ids, the layout's meta; on disk the codec's header and checksum), not
    16 tokens of K/V alone. The plan turned bytes into tokens by the K/V alone: 1 GiB of fp8 disk
    tier was 5,648 blocks where the engine holds 5,532 (2% more), and a budget of one block's K/V
    a tier of 16 tokens where the engine stored nothing."""
    from radixkv.obs.plan import load_spec, tier_block_bytes
    from radixkv.tiers import Block, block_nbytes, encoded_size

    spec = load_spec("smollm2-135m")
    rec = tier_block_bytes(spec, kv)
    llm = LLM(loaded_model=default_model, device="cpu", max_total_tokens=256, kv_cache_dtype=kv)
    lay = layout_of(llm.engine.runner.kv_pool)
    sample = Block((0,) * 16, bytes(16 * lay.token_bytes), lay.meta)
    assert rec == {"host": block_nbytes(sample), "disk": encoded_size(sample), "remote": encoded_size(sample)}
    assert rec["disk"] > 16 * lay.token_bytes
    # tiers of 2 records and a byte short of a third: the plan's 32 tokens, the engine's 2 blocks
    budget = {m: 3 * rec[m] - 1 for m in ("host", "disk")}
    tiers = hit_rate_curve([SimRequest(list(range(1, 40)))], spec, kv, [("radix", 1)], tiers=budget)["tiers"]
    assert {m: t["tokens"] for m, t in tiers.items()} == {"host": 32, "disk": 32}
    llm = LLM(
        loaded_model=default_model,
        device="cpu",
        max_total_tokens=256,
        kv_cache_dtype=kv,
        host_cache_bytes=budget["host"],
        disk_cache_dir=str(tmp_path),
        disk_cache_bytes=budget["disk"],
        kv_tier_write_policy="write_through",
    )
    params = SamplingParams(temperature=0, max_tokens=1)
    llm.generate(prompt_token_ids=[list(range(1000, 1096))], sampling_params=params, use_tqdm=False)
    assert llm.engine.kv.tiers.drain(60)
    st = llm.cache_stats().tiers
    for m in ("host", "disk"):  # 6 whole blocks written (no tail), the last 2 held
        assert (st[m]["blocks_written"], st[m]["blocks"], st[m]["evicted"], st[m]["rejected"]) == (6, 2, 4, 0)
        assert st[m]["used_bytes"] == 2 * rec[m]
    llm.close()
