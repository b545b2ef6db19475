"""The engine side of the KV tiers (radixkv/engine/tiers.py, tier_io.py, the KV manager's tier
path) over a fake model whose K/V encodes each position's token, position and prefix
(tier_fakes.KVRunner: a block loaded for other tokens fails the forward) and in-memory stores
(tier_fakes.MemoryStore): write-through and a new engine over the same store, write-back on
eviction and load back (the evicted blocks' cached heads included), exact cached-token counts by
tier, namespaces, corrupt and failing tiers, the cost rule, aborts while waiting, flush, events.
"""

from __future__ import annotations

import random
import threading
import time
from collections import OrderedDict

import pytest
from process_helpers import run_in_fork
from tier_fakes import VOCAB, KVRunner, MemoryStore, kv_engine, pool_holds_its_tokens, reference, run_all

from radixkv.config import EngineConfig, resolve_write_policy
from radixkv.engine.events import CacheInserted, RequestAdmitted
from radixkv.memory.kv_io import layout_of
from radixkv.namespace import Namespace
from radixkv.sampling_params import SamplingParams
from radixkv.tiers.codec import HEADER_SIZE

pytestmark = pytest.mark.timeout(300)


def greedy(n=6, **kw):
    return SamplingParams(temperature=0.0, max_tokens=n, **kw)


def prompt(seed, n):
    rng = random.Random(seed)
    return [rng.randrange(1, VOCAB) for _ in range(n)]


def generate(engine, prompts, params=None, namespace=None):
    ids = [engine.add_request(p, params or greedy(), namespace=namespace) for p in prompts]
    done = run_all(engine)
    pool_holds_its_tokens(engine)
    return [done[i] for i in ids]


def generate_closed(engine, prompts, params=None):
    """:func:`generate`, then close ``engine``: all its writes are in its stores before the next
    engine over them looks (an engine left to the garbage collector drained them at some later
    moment, racing the next engine's lookups)."""
    outs = generate(engine, prompts, params)
    assert engine.close()
    return outs


def test_write_policy_resolution():
    assert resolve_write_policy(None) == {"host": "write_back", "disk": "write_through", "remote": "write_through"}
    assert resolve_write_policy("write_back") == dict.fromkeys(("host", "disk", "remote"), "write_back")
    assert resolve_write_policy({"disk": "write_back"})["disk"] == "write_back"
    for bad in ("sometimes", {"tape": "write_back"}, {"host": "later"}, 3):
        with pytest.raises(ValueError, match="kv_tier_write_policy"):
            EngineConfig(kv_tier_write_policy=bad).resolve()
    with pytest.raises(ValueError, match="names the disk tier, which is not configured \\(set disk_cache_dir\\)"):
        EngineConfig(kv_tier_write_policy={"disk": "write_back"}, host_cache_bytes=1 << 20).resolve()
    cfg = EngineConfig(kv_tier_write_policy={"host": "write_through"}, host_cache_bytes=1 << 20)
    cfg.resolve()
    assert cfg.kv_tier_write_policy["host"] == "write_through"
    # the hash cache reports no evictions: an asked-for write_back was turned into write_through silently
    for asked in ("write_back", {"host": "write_back"}):
        with pytest.raises(
            ValueError, match="^kv_tier_write_policy write_back needs prefix_cache='radix' \\(the 'hash'"
        ):
            EngineConfig(kv_tier_write_policy=asked, host_cache_bytes=1 << 20, prefix_cache="hash").resolve()
    cfg = EngineConfig(host_cache_bytes=1 << 20, prefix_cache="hash")  # host's default write-back: through
    assert cfg.resolve().kv_tier_write_policy["host"] == "write_back"
    # byte budgets take the strings kv_cache_memory_bytes takes ('64MiB' was a ValueError)
    cfg = EngineConfig(host_cache_bytes="64MiB", disk_cache_dir="d", disk_cache_bytes="1.5GB").resolve()
    assert (cfg.host_cache_bytes, cfg.disk_cache_bytes, cfg.kv_tiers) == (64 << 20, 1_500_000_000, ("host", "disk"))
    assert EngineConfig(host_cache_bytes="0").resolve().kv_tiers == ()
    bad = (("host_cache_bytes", -1), ("host_cache_bytes", "64 parsecs"), ("disk_cache_bytes", True))
    for field, value in bad + (("host_cache_bytes", False), ("disk_cache_bytes", 0.0)):
        with pytest.raises(ValueError, match=f"^{field} must be a number of bytes >= 1 \\(or 0: none\\)"):
            EngineConfig(**{field: value}).resolve()
    for field, value in (("host_cache_bytes", -1), ("disk_cache_dir", ""), ("remote_cache_url", 5)):
        with pytest.raises(ValueError, match=field):
            EngineConfig(**{field: value}).resolve()
    assert EngineConfig(host_cache_bytes=1 << 20, remote_cache_url="redis://h:1/0").resolve().kv_tiers == (
        "host",
        "remote",
    )


@pytest.mark.parametrize("page_size", [1, 4, 16, 32])
def test_write_through_then_a_new_engine_loads_the_exact_blocks(page_size):
    shared: OrderedDict = OrderedDict()
    p = prompt(1, 100)
    first = generate_closed(kv_engine(page_size=page_size, stores=[MemoryStore("disk", data=shared)]), [p])[0]
    assert first.num_cached_tokens == 0 and first.outputs[0].token_ids == reference(p, 6)
    # the new engine over the same store: every token below the last (99), page-floored: 6 whole
    # blocks, then 3 tokens of the tail after them (the first engine's 105 computed tokens end
    # with a 9-token tail)
    e = kv_engine(page_size=page_size, stores=[MemoryStore("disk", data=shared)])
    out = generate(e, [p])[0]
    want = 99 // page_size * page_size
    assert out.num_cached_tokens == want
    assert out.cached_tokens_by_tier == {"device": 0, "host": 0, "disk": want, "remote": 0}
    assert out.outputs[0].token_ids == reference(p, 6)
    s = e.cache_stats()
    assert s.cached_tokens_by_tier["disk"] == want and s.tiers["disk"]["served_tokens"] == want
    assert s.tiers["disk"]["loaded"] == 6
    assert (s.tiers["disk"]["tails_loaded"], s.tiers["disk"]["tail_tokens"]) == ((1, 3) if want == 99 else (0, 0))


def test_write_back_on_eviction_and_load_back_through_the_cached_head():
    host = MemoryStore("host")  # write-back by default
    e = kv_engine(capacity=160, stores=[host])
    a = prompt(2, 100)
    generate(e, [a], greedy(4))
    assert host.puts == []  # nothing evicted yet: nothing written back
    b, c = prompt(3, 70), prompt(4, 70)
    generate(e, [b], greedy(4))
    generate(e, [c], greedy(4))  # evicts a's tail (least recently used, tail first)
    e.kv.tiers.drain()
    held = e.explain(a)  # a's head is still in the pool
    assert 0 < held.num_cached_tokens < 96 and len(host.data) >= 1
    out = generate(e, [a], greedy(4))[0]
    by = out.cached_tokens_by_tier
    assert by["device"] == held.num_cached_tokens and by["device"] + by["host"] == out.num_cached_tokens
    assert out.num_cached_tokens == 99 and by["host"] > 0  # blocks and the tail after them written back
    assert out.outputs[0].token_ids == reference(a, 4)


def test_requests_wait_for_their_blocks_without_stalling_others():
    shared: OrderedDict = OrderedDict()
    p = prompt(5, 90)
    generate_closed(kv_engine(stores=[MemoryStore("disk", data=shared)]), [p])
    e = kv_engine(stores=[MemoryStore("disk", data=shared)])
    other = prompt(6, 30)
    r1 = e.add_request(p, greedy())
    r2 = e.add_request(other, greedy())
    first = e.step()  # p waits for its load; the other request is admitted and computes
    assert e.scheduler.running and e.scheduler.running[0].request_id == r2
    assert [r.request_id for r in e.scheduler.waiting] == [r1] and e.kv.tier_waiting(e.scheduler.waiting[0])
    assert [o.request_id for o in first] == [r2]  # its first token, in the step the other waited
    done = run_all(e)
    assert done[r1].cached_tokens_by_tier["disk"] == 89 and done[r1].outputs[0].token_ids == reference(p, 6)
    assert done[r2].outputs[0].token_ids == reference(other, 6)


class GatedStore(MemoryStore):
    """A :class:`MemoryStore` whose ``get`` blocks until ``gate`` is set (a slow tier)."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.gate = threading.Event()

    def get(self, keys, tokens):
        assert self.gate.wait(60), "the test never opened the gate"
        return super().get(keys, tokens)


def record_waits(engine) -> list:
    """Wrap ``engine``'s ``TierIO.wait_loads``: the list gets ``(timeout, seconds waited)`` per call."""
    io, calls = engine.kv.tiers.io, []
    wait = io.wait_loads

    def recorded(jobs, timeout):
        t0 = time.perf_counter()
        wait(jobs, timeout)
        calls.append((timeout, time.perf_counter() - t0))

    io.wait_loads = recorded
    return calls


def stored(prompts, **kw):
    """A dict of blocks a first engine wrote through for ``prompts`` (closed: all written)."""
    shared: OrderedDict = OrderedDict()
    generate_closed(kv_engine(stores=[MemoryStore("disk", data=shared)], **kw), prompts)
    return shared


def test_a_lone_request_whose_load_is_quick_is_admitted_in_the_step_that_looked_it_up(monkeypatch):
    """The step that starts the first lookup of every waiting request waits for it a little
    (CostModel.lookup_wait_s: half a step, at most 50 ms; here raised to a minute so a loaded
    machine cannot make the test flaky) and installs it: no step of delay for a quick load."""
    from radixkv.engine import tier_io

    monkeypatch.setattr(tier_io, "LOOKUP_WAIT_MAX_S", 60.0)
    p = prompt(5, 90)
    e = kv_engine(stores=[MemoryStore("disk", data=stored([p]))])
    e.kv.tiers.costs.step_s = 120.0
    waits = record_waits(e)
    rid = e.add_request(p, greedy())
    first = e.step()
    assert [o.request_id for o in first] == [rid] and not e.scheduler.waiting  # admitted at once
    assert first[0].num_cached_tokens == 89 and first[0].cached_tokens_by_tier["disk"] == 89
    assert len(waits) == 1 and waits[0][0] == 60.0 and waits[0][1] < 60.0
    done = run_all(e)
    assert done[rid].outputs[0].token_ids == reference(p, 6)


def test_a_slow_load_is_waited_for_at_most_half_a_step_and_not_when_others_wait(monkeypatch):
    from radixkv.engine import tier_io

    p, q = prompt(5, 90), prompt(7, 90)
    store = GatedStore("disk", data=stored([p, q]))
    e = kv_engine(stores=[store])
    costs = e.kv.tiers.costs
    waits = record_waits(e)
    costs.step_s = 0.02  # a 10 ms wait at most
    r1 = e.add_request(p, greedy())
    assert e.step() == []  # alone, but its load is held: the step waited 10 ms, then went on
    assert len(waits) == 1 and waits[0][0] == 0.01 and 0.01 <= waits[0][1] < 5.0
    assert e.kv.tier_waiting(e.scheduler.waiting[0])
    monkeypatch.setattr(tier_io, "LOOKUP_WAIT_MAX_S", 60.0)
    costs.step_s = 120.0  # a minute's wait were r2 alone; r1 waits too, so no wait at all
    r2 = e.add_request(q, greedy())
    assert e.step() == [] and len(waits) == 1 and len(e.scheduler.waiting) == 2
    assert all(e.kv.tier_waiting(r) for r in e.scheduler.waiting)
    store.gate.set()
    done = run_all(e)
    assert len(waits) == 1
    for rid, x in ((r1, p), (r2, q)):
        assert done[rid].cached_tokens_by_tier["disk"] == 89 and done[rid].outputs[0].token_ids == reference(x, 6)


def test_no_wait_for_a_lookup_in_a_step_that_cannot_admit_it(monkeypatch):
    """While a long prompt is prefilled chunk by chunk nothing else is admitted: a newcomer's
    lookup is not waited for then (the running chunk would wait for nothing), only in the step
    whose chunk is the last one, if its load is not in by then."""
    from radixkv.engine import tier_io

    monkeypatch.setattr(tier_io, "LOOKUP_WAIT_MAX_S", 60.0)
    p, long = prompt(5, 90), prompt(8, 300)
    store = GatedStore("disk", data=stored([p], capacity=512))
    e = kv_engine(stores=[store], capacity=512)
    e.kv.tiers.costs.step_s = 120.0
    waits = record_waits(e)
    r_long = e.add_request(long, greedy())
    e.step()  # its first 64-token chunk
    r1 = e.add_request(p, greedy())
    chunks = 0
    while e.scheduler.running[0].kv_len + 64 < len(long):
        e.step()  # a chunk in progress: nothing is admitted, nothing waited for
        chunks += 1
        assert waits == [] and e.kv.tier_waiting(e.scheduler.waiting[0])
    assert chunks == 3  # 64 + 3 x 64 of 300 computed; the last chunk's step may admit
    store.gate.set()
    done = run_all(e)
    assert done[r1].cached_tokens_by_tier["disk"] == 89 and done[r1].outputs[0].token_ids == reference(p, 6)
    assert done[r_long].outputs[0].token_ids == reference(long, 6)


def test_namespaces_are_isolated_in_every_tier_and_local_ones_stay_in_host():
    stores = [MemoryStore("host"), MemoryStore("disk"), MemoryStore("remote")]
    e = kv_engine(stores=stores, kv_tier_write_policy="write_through")
    p = prompt(7, 70)
    generate(e, [p], namespace="a")
    e.kv.tiers.drain()
    assert all(len(s.data) == 5 for s in stores)  # 4 blocks, the tail after them (11 tokens)
    assert e.reset_prefix_cache()
    other = generate(e, [p], namespace="b")[0]
    assert other.num_cached_tokens == 0  # the same tokens in another namespace: no block
    local = Namespace(extra_key=object())  # process-local: host only
    assert e.reset_prefix_cache()
    generate(e, [prompt(8, 70)], namespace=local)
    e.kv.tiers.drain()
    assert [len(s.data) for s in stores] == [15, 10, 10]
    assert e.reset_prefix_cache()
    again = generate(e, [p], namespace="a")[0]
    assert again.cached_tokens_by_tier["host"] == 69


def test_a_corrupt_block_ends_the_run_and_a_failing_tier_is_a_miss():
    shared: OrderedDict = OrderedDict()
    p = prompt(9, 100)
    generate_closed(kv_engine(stores=[MemoryStore("disk", data=shared)]), [p])
    disk = MemoryStore("disk", data=shared)
    disk.corrupt(next(k for k, b in shared.items() if b.tokens == tuple(p[32:48])))  # block 2
    e = kv_engine(stores=[disk])
    out = generate(e, [p])[0]
    assert out.num_cached_tokens == 32 and out.outputs[0].token_ids == reference(p, 6)
    assert e.cache_stats().tiers["disk"]["corrupt"] == 1
    down = MemoryStore("disk", data=shared)
    down.failing = True
    e = kv_engine(stores=[down])
    out = generate(e, [p])[0]
    s = e.cache_stats()
    assert out.num_cached_tokens == 0 and out.outputs[0].token_ids == reference(p, 6)
    assert s.tiers["disk"]["degraded"] is True and s.tiers["disk"]["errors"] >= 1


def test_a_tier_dearer_than_prefill_is_not_loaded():
    shared: OrderedDict = OrderedDict()
    p = prompt(10, 100)
    generate_closed(kv_engine(stores=[MemoryStore("disk", data=shared)]), [p])
    e = kv_engine(stores=[MemoryStore("disk", data=shared)])
    costs = e.kv.tiers.costs
    costs.prefill_token_s, costs.block_s["disk"] = 1e-6, 1.0  # one block: 1 s; recomputing it: 16 us
    out = generate(e, [p])[0]
    assert out.num_cached_tokens == 0 and e.cache_stats().tiers["disk"]["load_skipped"] == 6
    costs.prefill_token_s, costs.block_s["disk"] = 1e-3, 1e-6
    assert e.reset_prefix_cache()
    assert generate(e, [p])[0].cached_tokens_by_tier["disk"] == 99


def test_prompt_logprobs_limit_what_is_loaded():
    shared: OrderedDict = OrderedDict()
    p = prompt(11, 100)
    generate_closed(kv_engine(stores=[MemoryStore("disk", data=shared)]), [p])
    e = kv_engine(stores=[MemoryStore("disk", data=shared)])
    out = generate(e, [p], greedy(prompt_logprobs=0, logprob_start_len=40))[0]
    # positions from 39 on need their logits: blocks 0-1 and the first 7 tokens of block 2 (the
    # request knows all of block 2, so its digest names it), as the pool itself would serve
    assert out.num_cached_tokens == 39
    assert out.cached_tokens_by_tier["disk"] == 39


def _engine_loading_a_written_prompt() -> tuple:
    """``(engine, request id, store)``: an engine one step into a 100-token prompt whose blocks
    another engine wrote to their shared disk store; its load is held until ``store.gate`` is set
    (NOTE: else a load done within the step, a slow engine thread's, would be installed in it)."""
    p = prompt(12, 100)
    store = GatedStore("disk", data=stored([p]))
    e = kv_engine(stores=[store])
    rid = e.add_request(p, greedy())
    e.step()
    return e, rid, store


def test_abort_while_waiting_for_blocks_releases_the_lock():
    e, rid, store = _engine_loading_a_written_prompt()
    assert e.kv.tier_waiting(e.scheduler.waiting[0])
    assert e.kv.tiers.held_tokens == 0 and e.cache_stats().protected == 0  # the pool holds nothing for it
    e.abort_request(rid)
    store.gate.set()
    run_all(e)
    e.kv.tiers.drain()
    e.step()  # a finished load of the aborted request is dropped, not installed
    e.check_integrity()
    s = e.cache_stats()
    assert s.protected == 0 and e.kv.tiers.held_tokens == 0 and s.free + s.evictable == s.capacity


def test_a_load_finished_for_a_request_aborted_between_steps_is_let_go_at_once():
    """A request aborted between steps (AsyncLLM's abort, a client that left) whose blocks had
    finished loading: the finished load, with the K/V rows it read from the tier, waited for the
    engine's next step to be dropped, and an idle engine runs none, so an idle server held the
    loaded prefix of every such request (up to a whole prompt's K/V) until the next request."""
    e, rid, store = _engine_loading_a_written_prompt()
    assert e.kv.tier_waiting(e.scheduler.waiting[0])  # its load is held
    store.gate.set()
    assert e.kv.tiers.drain(60)
    assert [tuple(j.rows.shape) for j in e.kv.tiers.io._done_loads] == [(99, e.kv.tiers.layout.token_bytes)]
    out = e.abort_now(rid, report=False)
    assert out.outputs[0].finish_reason == "abort" and not e.has_unfinished_requests()
    assert e.kv.tiers.io._done_loads == []
    e.check_integrity()
    s = e.cache_stats()
    assert s.protected == 0 and e.kv.tiers.held_tokens == 0 and s.free + s.evictable == s.capacity


def test_flush_with_tiers_empties_the_owned_ones_only():
    stores = [MemoryStore("host"), MemoryStore("disk"), MemoryStore("remote")]
    e = kv_engine(stores=stores, kv_tier_write_policy="write_through")
    generate(e, [prompt(13, 70)])
    assert e.reset_prefix_cache(tiers=False)
    e.kv.tiers.drain()
    assert [len(s.data) for s in stores] == [5, 5, 5]  # 4 blocks and a tail
    assert e.reset_prefix_cache(tiers=True)
    assert [len(s.data) for s in stores] == [0, 0, 5]


def test_tier_writes_are_cache_events_with_their_medium():
    e = kv_engine(stores=[MemoryStore("disk"), MemoryStore("remote")])
    seen = []
    e.events.subscribe(seen.append, (CacheInserted,))
    generate(e, [prompt(14, 50)])
    e.kv.tiers.drain()
    e.step()  # finished writes are announced on the engine thread
    media = [(ev.medium, ev.first_block, len(ev.block_digests)) for ev in seen]
    assert ("device", 0, 3) in media and ("disk", 0, 3) in media and ("remote", 0, 3) in media
    assert [ev.seq for ev in seen] == list(range(1, len(seen) + 1))
    device = next(ev for ev in seen if ev.medium == "device")
    assert all(ev.block_digests == device.block_digests for ev in seen if ev.medium != "device")


def test_a_finished_write_keeps_no_copy_of_its_blocks_on_an_idle_engine():
    """A write the I/O thread finished waits for the engine's next step to be announced, and an
    idle engine (AsyncLLM steps none) runs none: each kept the K/V rows it had copied out of the
    pool, so after a burst an idle server held a second copy of every block written since its last
    step (up to the 1 GiB write backlog) that ``write_pending`` 0 said was gone."""
    e = kv_engine(stores=[MemoryStore("disk")])
    generate(e, [prompt(16, 64)], greedy(1))  # its 4 blocks are written in its one step
    assert e.kv.tiers.drain(60)
    done = e.kv.tiers.io._done_writes
    assert [len(j.keys) for j in done] == [4] and e.cache_stats().tiers["disk"]["write_pending"] == 0
    assert [tuple(j.rows.shape) for j in done] == [(0, e.kv.tiers.layout.token_bytes)]
    seen = []
    e.events.subscribe(seen.append, (CacheInserted,))
    e.step()  # announced all the same
    assert [(ev.medium, ev.first_block, len(ev.block_digests)) for ev in seen] == [("disk", 0, 4)]
    assert e.kv.tiers.io._done_writes == []


def test_a_full_write_backlog_drops_writes_and_counts_them():
    e = kv_engine(stores=[MemoryStore("disk")])
    e.kv.tiers.io.max_pending_bytes = 0
    generate(e, [prompt(15, 50)])
    assert e.cache_stats().tiers["disk"]["write_dropped"] == 3


def test_close_drains_and_closes_the_stores():
    disk = MemoryStore("disk")
    e = kv_engine(stores=[disk])
    generate(e, [prompt(16, 80)])
    assert e.close() and disk.closed and len(disk.data) == 6  # 5 blocks and the 5-token tail
    assert e.close()  # idempotent
    out = generate(e, [prompt(17, 40)])[0]  # runs on without its tiers
    assert out.outputs[0].token_ids == reference(prompt(17, 40), 6) and len(disk.data) == 6


def test_bad_tier_settings_fail_at_start(tmp_path):
    with pytest.raises(ValueError, match="remote_cache_url"):
        kv_engine(remote_cache_url="http://127.0.0.1:6379/0")
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="disk_cache_dir"):
        kv_engine(disk_cache_dir=str(tmp_path / "f" / "sub"))
    with pytest.raises(ValueError, match="prefix cache"):
        kv_engine(stores=[MemoryStore("host")], cache="none")
    from radixkv.config import EngineConfig, parse_bytes

    assert (parse_bytes("0"), parse_bytes(0), parse_bytes("1KiB")) == (0, 0, 1024)  # the CLIs' budgets
    with pytest.raises(ValueError, match=r"host_cache_bytes must be a number of bytes >= 1 \(or 0: none\)"):
        parse_bytes("-1", "host_cache_bytes")
    # a budget below one block's K/V: every write was rejected, silently, the tier never held a block
    # (radixkv serve --disk-cache-bytes 100KB on the default model: rejected 12, health ok)
    # ... and one of exactly a block's K/V too: a stored block is its record (the K/V, the token ids,
    # the layout's meta; on disk the codec's header, padding and checksum), so every write was
    # rejected there as well (host: 64 + len(meta) bytes over, disk: the codec's encoded size)
    lay = layout_of(KVRunner(8, 1, 1).kv_pool)
    block = 16 * lay.token_bytes
    host_need = block + 64 + len(lay.meta)
    disk_need = HEADER_SIZE + 64 + len(lay.meta) + (-(HEADER_SIZE + 64 + len(lay.meta)) % 64) + block + 16
    disk = {"disk_cache_dir": str(tmp_path / "d")}
    for field, need, kw in (("host_cache_bytes", host_need, {}), ("disk_cache_bytes", disk_need, disk)):
        for budget in (block, need - 1):
            with pytest.raises(ValueError) as e:
                kv_engine(**{field: budget}, **kw)
            assert str(e.value) == (
                f"{field} {budget} holds no block: one block of this model is {need} bytes in that tier "
                f"(16 tokens x {block // 16} bytes of K/V and {need - block} of its record); give at least that"
            )
        e = kv_engine(**{field: need}, kv_tier_write_policy="write_through", **kw)
        generate(e, [prompt(19, 40)])
        assert e.kv.tiers.drain(30)
        st = e.cache_stats().tiers[field.split("_")[0]]
        # the 2 whole blocks and the tails after the prompt and the reply stored, none rejected
        assert (st["blocks_written"], st["rejected"], st["blocks"]) == (4, 0, 1)
        assert st["used_bytes"] <= need
        assert e.close()
    for off in ({"prefix_cache": "none"}, {"enable_prefix_caching": False}):  # refused before a model loads
        with pytest.raises(ValueError, match="need a prefix cache"):
            EngineConfig(model="no-such-model", host_cache_bytes=1 << 20, **off).resolve()


def test_explain_names_the_tier_holding_each_missed_span():
    disk = MemoryStore("disk")
    host = MemoryStore("host")
    e = kv_engine(stores=[host, disk])
    p = prompt(18, 100)
    generate(e, [p])
    e.kv.tiers.drain()
    head = p[:40]
    assert e.reset_prefix_cache()
    generate(e, [head + prompt(19, 5)])  # the pool holds 40 tokens of p again (computed)
    keys = e.kv.tiers._keys(None, p, 3, 4)[0]
    host.data[keys[0]] = disk.data[keys[0]]  # block 3 also in host, which is asked first
    loaded = e.cache_stats().tiers["disk"]["loaded"]
    o = e.explain(p)
    # the tail after block 5 (p's 105 computed tokens end with 9) serves 96..99
    assert o.num_cached_tokens == 40 and o.tier_spans == ((40, 48, "disk"), (48, 64, "host"), (64, 99, "disk"))
    assert o.as_dict()["tier_spans"] == [[40, 48, "disk"], [48, 64, "host"], [64, 99, "disk"]]
    assert "KV tiers hold disk [40, 48), host [48, 64), disk [64, 99)" in str(
        __import__("radixkv.engine.outcome", fromlist=["explain_text"]).explain_text(o, p, None)
    )
    assert e.cache_stats().tiers["disk"]["loaded"] == loaded  # a dry run: nothing loaded


def test_a_load_without_room_waits_for_it_and_is_installed_later():
    shared: OrderedDict = OrderedDict()
    p = prompt(20, 100)
    generate_closed(kv_engine(stores=[MemoryStore("disk", data=shared)]), [p])
    e = kv_engine(capacity=160, stores=[MemoryStore("disk", data=shared)])
    busy = prompt(21, 120)
    r_busy = e.add_request(busy, greedy(30))  # holds up to 150 of the 160 slots while it runs
    outs = e.step() + e.step()
    r = e.add_request(p, greedy())
    outs += e.step()  # its lookup starts
    waited = 0
    while e.scheduler.waiting and e.kv.tier_waiting(e.scheduler.waiting[0]):
        assert waited < 100  # it waits while the busy one runs (then its memory is evictable)
        outs += e.step()
        e.check_integrity()
        waited += 1
    done = {o.request_id: o for o in outs if o.finished}
    done.update(run_all(e))
    assert waited > 1 and done[r].cached_tokens_by_tier["disk"] == 99
    assert done[r].outputs[0].token_ids == reference(p, 6) and done[r_busy].outputs[0].token_ids == reference(busy, 30)
    pool_holds_its_tokens(e)


def test_fingerprint_names_weights_dtypes_quantization_and_layout():
    import torch

    from radixkv.engine.tiers import model_fingerprint
    from radixkv.models.fingerprint import weights_digest

    lin = torch.nn.Linear(4, 4)
    w = weights_digest(lin)
    assert w == weights_digest(lin) and len(w) == 16
    twin = torch.nn.Linear(4, 4)
    twin.load_state_dict(lin.state_dict())
    assert weights_digest(twin) == w  # the same weights in another object (another process)
    with torch.no_grad():
        twin.weight[0, 0] += 1e-6
    twin2 = torch.nn.Linear(4, 4)
    twin2.load_state_dict(twin.state_dict())
    assert weights_digest(twin2) != w
    base = model_fingerprint(w, torch.float32, "float32", None, b"layout")
    assert base == model_fingerprint(w, torch.float32, "float32", None, b"layout")
    others = [
        model_fingerprint(weights_digest(twin2), torch.float32, "float32", None, b"layout"),
        model_fingerprint(w, torch.bfloat16, "float32", None, b"layout"),
        model_fingerprint(w, torch.float32, "fp8_e4m3", None, b"layout"),
        model_fingerprint(w, torch.float32, "float32", "int8", b"layout"),
        model_fingerprint(w, torch.float32, "float32", None, b"other layout"),
        model_fingerprint(w, torch.float32, "float32", None, b"layout", b"cuda:sm90/flashinfer/(False, False)"),
    ]
    assert len({base, *others}) == 7


def test_another_fingerprint_never_reads_a_block():
    shared: OrderedDict = OrderedDict()
    p = prompt(22, 80)
    generate_closed(kv_engine(stores=[MemoryStore("disk", data=shared)]), [p])
    from tier_fakes import KVRunner

    from radixkv.config import EngineConfig
    from radixkv.engine import Engine

    cfg = EngineConfig(model="kv-runner", device="cpu", max_total_tokens=256, chunked_prefill_size=64)
    other = Engine(
        cfg,
        model_runner=KVRunner(256, 1, fingerprint="another model"),
        tokenizer=None,
        eos_token_ids=[],
        tier_stores=[MemoryStore("disk", data=shared)],
    )
    assert generate(other, [p])[0].num_cached_tokens == 0
    # the same model: every token below the last (5 blocks, the last used for 15 tokens)
    assert generate(kv_engine(stores=[MemoryStore("disk", data=shared)]), [p])[0].num_cached_tokens == 79


def _gated_async_llm(seed: int):
    """An AsyncLLM over an engine with a disk tier whose writes wait for ``gate`` (still queued
    when the test shuts it down), after one 70-token request ran: ``(llm, engine, disk, gate)``."""
    import asyncio
    import threading

    from radixkv.async_llm import AsyncLLM

    disk = MemoryStore("disk")
    e = kv_engine(stores=[disk])
    e.kv.tiers.io.max_pending_bytes = 1 << 30
    llm = AsyncLLM.from_engine(e)
    gate = threading.Event()
    orig = disk.put

    def slow_put(keys, blocks, replace=False):
        gate.wait(30)
        orig(keys, blocks, replace)

    disk.put = slow_put

    async def go():
        async for _ in llm.generate(prompt_token_ids=prompt(seed, 70), sampling_params=greedy()):
            pass

    asyncio.run(go())
    return llm, e, disk, gate


def test_async_llm_shutdown_drains_the_writes():
    llm, e, disk, gate = _gated_async_llm(23)
    assert len(disk.data) == 0
    # queued or being written: the 4 blocks, then the tail twice (6 tokens after the prompt, 11 at the end)
    assert e.cache_stats().tiers["disk"]["write_pending"] == 6
    gate.set()
    assert e.kv.tiers.drain(timeout=60)
    assert e.cache_stats().tiers["disk"]["write_pending"] == 0
    llm.shutdown()
    assert len(disk.data) == 5 and disk.closed  # 4 blocks and the tail


def test_exit_after_a_shutdown_that_timed_out_still_drains_the_writes():
    """``AsyncLLM.shutdown(timeout)`` returns while its engine thread still drains the tiers
    (a slow disk); the interpreter's exit then closes the tiers again (the TierManager's
    ``weakref.finalize``, which runs at exit as atexit does): that close waits
    for the same drain (it returned at once, the process exited and the daemon I/O thread died
    with the writes still queued: a restart found none of them)."""
    import threading

    llm, e, disk, gate = _gated_async_llm(25)
    tm = e.kv.tiers
    llm.shutdown(timeout=0.01)
    assert tm.io.drain(0) is False and len(disk.data) == 0  # still queued
    got = []
    assert tm._finalizer.atexit  # what the interpreter's exit runs
    at_exit = threading.Thread(target=lambda: got.append((tm._finalizer(), len(disk.data))))
    at_exit.start()
    at_exit.join(0.5)
    gate.set()
    at_exit.join(30)
    assert got == [(True, 5)]  # 4 blocks and the 6-token tail
    llm.shutdown()
    assert disk.closed


def test_block_hashing_cache_works_with_tiers_written_through():
    shared: OrderedDict = OrderedDict()
    host = MemoryStore("host", data=shared)  # write-back asked: the hash cache cannot tell its evictions
    p = prompt(24, 100)
    e = kv_engine(page_size=16, cache="hash", stores=[host])
    generate(e, [p])
    assert e.kv.tiers.back == [] and e.kv.tiers.drain()
    assert len(shared) == 6  # written through instead
    assert e.reset_prefix_cache()
    out = generate(e, [p])[0]
    assert out.cached_tokens_by_tier["host"] == 96 and out.outputs[0].token_ids == reference(p, 6)


@pytest.mark.parametrize("medium", ["host", "disk"])
def test_tenants_are_isolated_in_the_host_and_disk_tiers(tmp_path, medium):
    """Blocks are keyed by the whole namespace (tenant, salt, extra_key: its stable bytes): over
    the real stores, a new engine (nothing in its pool) serves tenant A's prompt entirely from the
    tier and tenant B's identical prompt, or A's with a salt, not at all. (Redis: the same in
    tests/test_tiers_redis.py.)"""
    from radixkv.tiers import DiskStore, HostStore

    store = HostStore(1 << 30) if medium == "host" else DiskStore(str(tmp_path), 1 << 30)
    e = kv_engine(stores=[store], kv_tier_write_policy="write_through")
    p = prompt(21, 70)
    generate(e, [p], namespace=Namespace(tenant="A"))
    assert e.kv.tiers.drain(60)
    other = kv_engine(stores=[store])  # a restart over the same store: nothing in the pool
    none = {"device": 0, "host": 0, "disk": 0, "remote": 0}
    for ns in (Namespace(tenant="B"), Namespace(tenant="A", salt="s"), Namespace(extra_key="A"), None):
        out = generate(other, [p], namespace=ns)[0]
        assert out.num_cached_tokens == 0 and out.cached_tokens_by_tier == none, ns
    assert other.reset_prefix_cache()
    a = generate(other, [p], namespace=Namespace(tenant="A"))[0]
    assert a.cached_tokens_by_tier == {**none, medium: 69} and a.outputs[0].token_ids == reference(p, 6)
    assert other.cache_stats().tiers[medium]["corrupt"] == 0


def test_cost_model_picks_the_run_that_saves_and_remeasures_a_skipped_tier():
    """The load rule (docs/tiers.md, "Cost rule"): the prefix of the run that saves the most time;
    a tier its estimate keeps from loading is measured again after 64 skipped blocks, so one slow
    load does not stop that tier for good; a tail's fetch counts as one block."""
    from radixkv.engine.tier_io import CostModel

    cm = CostModel(alpha=1.0, reprobe_blocks=64)
    assert cm.best_run(["disk", "remote"]) == 2  # nothing measured: load everything
    cm.note_prefill(1.0, 1000)  # 1 ms a token: recomputing a block costs 16 ms
    cm.note_load("disk", 0.004, 2)  # 2 ms a block
    cm.note_load("remote", 0.030, 1)  # 30 ms a block: dearer than recomputing
    assert cm.best_run(["disk", "disk", "remote"]) == 2
    assert cm.best_run(["disk", "remote", "remote", "disk", "disk", "disk"]) == 6  # 3 x 14 > 2 x 14 ms
    assert cm.saves("disk") and not cm.saves("remote")
    cm.skipped.clear()
    for _ in range(31):
        assert cm.best_run(["remote", "remote"]) == 0
    assert cm.skipped["remote"] == 62
    assert not cm.saves("remote") and cm.skipped["remote"] == 63  # a tail not fetched counts too
    assert cm.best_run(["remote"]) == 0 and cm.skipped["remote"] == 64
    assert cm.saves("remote") and cm.best_run(["remote", "remote"]) == 2  # stale: measured again
    cm.note_load("remote", 0.002, 2)  # the tier was slow for a moment only
    assert cm.skipped["remote"] == 0 and cm.best_run(["remote"]) == 1
    cm.note_load("host", 0.001, 1)  # a tail's fetch: one record, 1 ms
    assert cm.token_s("host") == 0.001 / 16


def test_write_through_marks_the_head_the_pool_hit_as_used(tmp_path):
    """Write-through marks the blocks before a request's new ones (the head its pool hit covers)
    used in the stores: a head every request shares, never read back from the disk while the pool
    holds it, is not the first block the disk evicts. It was (its mtime stayed its first write),
    and after a restart no block under it could be loaded: the last prompt, every block of it
    still on disk, reused 0 tokens."""
    from radixkv.tiers import Block, DiskStore, HostStore, encoded_size

    layout = kv_engine(stores=[HostStore(1 << 20)]).kv.tiers.layout
    rec = encoded_size(Block(tuple(range(16)), bytes(16 * layout.token_bytes), layout.meta))
    head, tails = prompt(31, 32), [prompt(40 + i, 48) for i in range(4)]  # 2 blocks, then 3 each
    e = kv_engine(stores=[DiskStore(tmp_path, 9 * rec)])
    for t in tails:
        generate(e, [head + t], greedy(1))
    assert e.kv.tiers.drain(60)
    again = kv_engine(stores=[DiskStore(tmp_path, 9 * rec)])  # a restart: nothing in the pool
    out = generate(again, [head + tails[-1]], greedy(1))[0]
    assert out.cached_tokens_by_tier["disk"] == 79 and out.outputs[0].token_ids == reference(head + tails[-1], 1)


def test_a_load_waits_for_the_queued_write_of_its_blocks():
    """Blocks evicted to the host tier (written back) while the I/O thread is busy are still in
    its write queue when their request comes back: its load runs after that write and serves
    them, instead of the lookup missing them and the request recomputing its prompt."""
    import threading

    host = MemoryStore("host")  # write-back: blocks reach it when the pool evicts them
    e = kv_engine(capacity=160, stores=[host])
    gate, orig = threading.Event(), host.put

    def gated_put(keys, blocks, replace=False):
        assert gate.wait(60)
        orig(keys, blocks, replace)

    host.put = gated_put
    x, a = prompt(40, 70), prompt(41, 70)
    generate(e, [x], greedy(4))
    generate(e, [a], greedy(4))
    generate(e, [prompt(42, 70)], greedy(4))  # evicts x: its write holds the I/O thread at the gate
    generate(e, [prompt(43, 70)], greedy(4))  # evicts a: its write waits in the queue
    assert host.data == {} and e.cache_stats().tiers["host"]["write_pending"] > 0
    held = e.explain(a).num_cached_tokens  # the head the pool still holds
    rid = e.add_request(a, greedy(4))
    gate.set()
    out = run_all(e)[rid]
    pool_holds_its_tokens(e)
    by = out.cached_tokens_by_tier
    assert (by["device"], by["host"], out.num_cached_tokens) == (held, 69 - held, 69)
    assert out.outputs[0].token_ids == reference(a, 4)


def test_write_back_beside_the_hash_cache_is_refused_with_stores_given_too():
    """``tier_stores=`` given to the Engine (no tier fields in the config) get the config's
    check: an explicit write-back beside the hash cache, which does not report what it evicts,
    is a ValueError, not a policy silently written through."""
    with pytest.raises(ValueError, match="write_back needs prefix_cache='radix'"):
        kv_engine(stores=[MemoryStore("host")], cache="hash", kv_tier_write_policy="write_back")
    with pytest.raises(ValueError, match="write_back needs prefix_cache='radix'"):
        kv_engine(stores=[MemoryStore("disk")], cache="hash", kv_tier_write_policy={"disk": "write_back"})
    assert kv_engine(stores=[MemoryStore("host")], cache="hash").kv.tiers is not None  # the default: through


@pytest.mark.timeout(120)
def test_a_forked_child_loads_from_the_tiers_of_an_engine_its_parent_made():
    """``multiprocessing`` with the 'fork' start method after an engine with KV tiers exists: the
    child's engine needs its own I/O thread (a fork copies only the thread that forked). The
    child's request waiting for its blocks from the tier waited forever (``_wait_for_tiers`` in
    every step: no I/O thread ran the load), and so did its ``close()`` with writes queued."""
    import multiprocessing as mp

    if "fork" not in mp.get_all_start_methods():
        pytest.skip("no fork start method on this platform")
    e = kv_engine(stores=[MemoryStore("host")], kv_tier_write_policy="write_through")
    p = prompt(26, 70)
    generate(e, [p])
    assert e.kv.tiers.drain(timeout=60) and e.reset_prefix_cache()  # p's blocks now only in the tier

    def child(queue):
        import torch

        # NOTE: torch's OpenMP pool does not survive a fork either: a parallel op in the child of a
        # parent that ran one hangs (torch's own limitation; the child must use one thread)
        torch.set_num_threads(1)
        out = generate(e, [p, prompt(27, 40)])  # p loads its blocks; the other request is written
        queue.put((out[0].cached_tokens_by_tier["host"], out[0].outputs[0].token_ids, e.close(timeout=60)))

    got, exitcode = run_in_fork(child, 30)
    assert got == (69, reference(p, 6), True)
    assert exitcode == 0
    assert generate(e, [p])[0].cached_tokens_by_tier["host"] == 69  # the parent's I/O goes on


def forge_first_block(engine, store, tokens) -> tuple:
    """Put a record of another layout (a forged or damaged one that passes the store's checks)
    under the key of ``tokens``' first block in ``store``; ``(key, its 16 tokens)``."""
    from radixkv.tiers import Block

    tiers = engine.kv.tiers
    keys, toks, _, _, _ = tiers._keys(None, tokens, 0, 1)
    store.put(keys, [Block(toks[0], bytes(16 * tiers.layout.token_bytes), b"another layout")])
    return keys[0], toks[0]


@pytest.mark.parametrize("medium", ["host", "disk"])
def test_a_block_of_another_layout_is_dropped_so_a_good_one_replaces_it(tmp_path, medium):
    """A record under the right key whose layout is not the pool's is rejected by the load, and
    dropped from its store: the write of the block computed instead stores a good one (it stayed,
    every read renewing it, every write skipping the key it held: the tier never served it)."""
    from radixkv.tiers import DiskStore, HostStore

    store = HostStore(1 << 30) if medium == "host" else DiskStore(str(tmp_path), 1 << 30)
    e = kv_engine(stores=[store], kv_tier_write_policy="write_through")
    p = prompt(22, 40)
    key, toks = forge_first_block(e, store, p)
    out = generate(e, [p])[0]
    assert out.num_cached_tokens == 0 and out.outputs[0].token_ids == reference(p, 6)
    assert e.cache_stats().tiers[medium]["load_rejected"] == 1
    assert e.kv.tiers.drain(60)
    assert store.get([key], [toks])[0].meta == e.kv.tiers.layout.meta  # the computed block replaced it
    assert e.reset_prefix_cache()
    again = generate(e, [p])[0]
    assert again.cached_tokens_by_tier[medium] == 39 and again.outputs[0].token_ids == reference(p, 6)
    assert e.cache_stats().tiers[medium]["load_rejected"] == 1


@pytest.mark.parametrize("page_size", [1, 4])
def test_close_writes_the_pools_blocks_to_a_persistent_write_back_tier(tmp_path, page_size):
    """A disk tier written back gets the pool's blocks when the pool evicts them, so whatever the
    pool still held at close was lost to a restart (docs/tiers.md: pending writes drain at close).
    Close writes every cached sequence's blocks and tail there (not to the host tier, which the
    process takes with it); a new engine on the directory serves every token below the last."""
    from radixkv.tiers import DiskStore, HostStore

    host = HostStore(1 << 30)
    e = kv_engine(
        page_size=page_size, stores=[host, DiskStore(str(tmp_path), 1 << 30)], kv_tier_write_policy="write_back"
    )
    a, b = prompt(23, 40), prompt(23, 40)[:20] + prompt(24, 30)  # 20 tokens in common
    generate(e, [a, b])
    assert e.cache_stats().tiers["disk"]["blocks_written"] == 0  # nothing evicted
    assert e.close() and host.stats()["blocks_written"] == 0
    other = kv_engine(page_size=page_size, stores=[DiskStore(str(tmp_path), 1 << 30)])
    for p in (a, b):
        out = generate(other, [p])[0]
        want = (len(p) - 1) // page_size * page_size
        assert out.cached_tokens_by_tier == {"device": 0, "host": 0, "disk": want, "remote": 0}
        assert out.outputs[0].token_ids == reference(p, 6)
        assert other.reset_prefix_cache()
    # pages of 1: a (45 tokens cached) blocks 0, 1 and 7 of its 13-token tail, b (55) blocks 0 (a's), 1, 2 and
    # 1 of its 7-token tail; pages of 4 (44 and 52 cached, limits 36 and 48): a 4 tokens of its tail, b none
    st = other.cache_stats().tiers["disk"]
    assert (st["loaded"], st["tails_loaded"], st["tail_tokens"]) == ((5, 2, 8) if page_size == 1 else (5, 1, 4))


@pytest.mark.parametrize("medium", ["host", "disk"])
def test_a_path_evicted_page_by_page_keeps_its_longest_tail(tmp_path, medium):
    """The pool evicts one page per decode step, so a written-back path's end goes in pieces, each
    writing the tail after its last whole block: 13 tokens, then 12, then 11, each replacing the
    one before (the last writer won). A tail whose tokens the held one starts with is not written
    over: the next turn gets the whole previous sequence (45 tokens, not 42)."""
    from radixkv.tiers import DiskStore, HostStore

    store = HostStore(1 << 30) if medium == "host" else DiskStore(str(tmp_path), 1 << 30)
    e = kv_engine(capacity=64, stores=[store], kv_tier_write_policy="write_back")
    a = prompt(30, 40)
    seq = a + generate(e, [a])[0].outputs[0].token_ids  # 45 of its 46 tokens cached
    generate(e, [prompt(31, 15)], greedy(8))  # its decode steps evict a's last 3 tokens, one at a time
    generate(e, [prompt(32, 45)], greedy(4))  # evicts the rest of a
    assert e.reset_prefix_cache()
    nxt = seq + prompt(33, 3)
    out = generate(e, [nxt], greedy(2))[0]
    assert out.cached_tokens_by_tier == {"device": 0, "host": 0, "disk": 0, "remote": 0, medium: 45}
    assert out.outputs[0].token_ids == reference(nxt, 2)
    assert e.cache_stats().tiers[medium]["tail_tokens"] == 13


def test_a_tier_smaller_than_a_sequence_keeps_its_head_not_its_unreachable_end():
    """A lookup loads a sequence's blocks from block 0 on, up to the first one missing. A write put
    them in order, block 0 first, so it was each tier's least recently used of them: a tier too
    small for the whole sequence evicted its head and kept its end, which no lookup reaches (3
    blocks' room, an 80-token prompt written through in one prefill: 0 tokens served). Written
    deepest first (the tail, then the last block), a tier keeps the head, as the pool evicts a
    path's end first. (A later write after that head, the reply's tail, still evicts the head's
    least recent block to make its room: an LRU store cannot refuse a newer record.)"""
    from radixkv.tiers import Block, HostStore, block_nbytes

    probe = kv_engine(stores=[HostStore(1 << 30)])
    lay = probe.kv.tiers.layout
    blk = block_nbytes(Block((0,) * 16, bytes(16 * lay.token_bytes), lay.meta))
    host = HostStore(3 * blk)
    p = prompt(40, 80)
    first = kv_engine(stores=[host], chunk=128, kv_tier_write_policy="write_through")
    generate(first, [p], greedy(1))  # one write: its 5 blocks (80 tokens cached, no tail)
    assert first.kv.tiers.drain(60)
    other = kv_engine(stores=[host])
    out = generate(other, [p], greedy(1))[0]
    assert out.cached_tokens_by_tier == {"device": 0, "host": 48, "disk": 0, "remote": 0}
    assert out.outputs[0].token_ids == reference(p, 1)


def _block_payload(engine) -> int:
    """The payload bytes of one 16-token block of ``engine``'s pool (what a MemoryStore counts)."""
    return 16 * engine.kv.tiers.layout.token_bytes


def test_close_writes_the_pool_deepest_first_so_a_small_tier_keeps_the_heads():
    """Close writes the pool's nodes to a persistent tier written back. It walked the tree
    parent first, so the heads (block 0, what every lookup reads first) were each tier's least
    recently used records: a tier smaller than the pool kept the ends of the conversation, which
    no lookup reaches. Written children first (and a node's blocks from the last), the head stays."""
    a = prompt(50, 40)
    b = a + prompt(51, 40)  # a three-node chain: a, b's rest, c's rest
    c = b + prompt(52, 40)
    probe = kv_engine(stores=[MemoryStore("disk")], kv_tier_write_policy="write_back")
    disk = MemoryStore("disk", capacity_bytes=3 * _block_payload(probe))
    e = kv_engine(stores=[disk], kv_tier_write_policy="write_back")
    generate(e, [a])
    generate(e, [b])
    generate(e, [c])
    assert e.close() and disk.used_bytes <= disk.capacity_bytes
    other = kv_engine(stores=[disk])
    out = generate(other, [c], greedy(1))[0]
    assert out.cached_tokens_by_tier == {"device": 0, "host": 0, "disk": 40, "remote": 0}  # blocks 0-1, 8 of a tail
    assert out.outputs[0].token_ids == reference(c, 1)


def test_close_writes_a_node_larger_than_the_backlog_in_pieces():
    """A node is one write at close; one larger than the backlog's bound (1 GiB by default: an
    8k-token prompt of an 8B model in bf16) was dropped (counted in write_dropped) and close still
    said True. It is written in pieces of at most a quarter of the bound, drained as they go."""
    p = prompt(53, 100)
    disk = MemoryStore("disk")
    e = kv_engine(stores=[disk], chunk=128, kv_tier_write_policy="write_back")
    e.kv.tiers.io.max_pending_bytes = 2 * _block_payload(e)  # a 6-block node is 3x the bound
    generate(e, [p], greedy(1))
    assert e.close()
    assert e.cache_stats().tiers["disk"]["write_dropped"] == 0
    other = kv_engine(stores=[disk])
    out = generate(other, [p], greedy(1))[0]
    assert out.cached_tokens_by_tier["disk"] == 99 and out.outputs[0].token_ids == reference(p, 1)


def test_a_close_that_times_out_still_closes_the_tiers():
    """``Engine.close(timeout)`` timing out while it queued the pool for a written-back tier
    returned before closing the tiers: the engine went on loading and writing through them, and a
    second close queued the whole pool again. It now closes them (their queued writes finish
    later) and returns False."""
    import threading

    class Held(MemoryStore):
        def __init__(self) -> None:
            super().__init__("disk")
            self.go = threading.Event()

        def put(self, keys, blocks, replace=False):
            assert self.go.wait(60)
            return super().put(keys, blocks, replace)

    disk = Held()
    e = kv_engine(stores=[disk], chunk=128, kv_tier_write_policy="write_back")
    e.kv.tiers.io.max_pending_bytes = 2 * _block_payload(e)
    generate(e, [prompt(54, 100)], greedy(1))
    assert not e.close(timeout=0.2)  # the store holds the first piece: the drain times out
    assert e.kv.tiers.closed  # the engine runs on without its tiers
    written = e.cache_stats().tiers["disk"]
    generate(e, [prompt(55, 40)], greedy(1))
    assert e.cache_stats().tiers["disk"]["write_pending"] == written["write_pending"]  # nothing new queued
    disk.go.set()
    assert e.close(60)  # the queued pieces finish; the pool is not queued again
    assert e.cache_stats().tiers["disk"]["write_pending"] == 0


def test_a_close_with_a_load_stuck_in_a_store_takes_its_timeout_once():
    """``Engine.close(timeout)`` while the I/O thread is stuck in a store's ``get``: the drain
    and the thread's stop share the one ``timeout`` (each took a whole one: 2 s for 1 s)."""
    p = prompt(5, 90)
    store = GatedStore("disk", data=stored([p]))
    e = kv_engine(stores=[store])
    e.add_request(p, greedy())
    assert e.step() == [] and e.kv.tier_waiting(e.scheduler.waiting[0])  # its load is held
    # NOTE: the join's own timeout is what is left of the one second: none (a wall-clock bound
    # failed on a machine that stalled for a garbage collection)
    th = e.kv.tiers.io._thread
    joins, join = [], th.join
    th.join = lambda timeout=None: (joins.append(timeout), join(timeout))[1]
    t0 = time.perf_counter()
    assert not e.close(timeout=1.0)
    assert time.perf_counter() - t0 >= 1.0 and joins == [0.0], joins
    store.gate.set()


def _burst(engine, prompts, max_tokens=12, arrivals=None):
    """Step ``engine`` through ``prompts`` (all at once, or ``arrivals[i]`` of them added before
    step ``i``), checking its invariants after every step; the step of each request's first
    token, of each finish, and each output, in prompt order."""
    ids, first, done, step = [], {}, {}, 0
    queue = list(prompts)
    for n in arrivals or [len(queue)]:
        ids += [engine.add_request(p, greedy(max_tokens)) for p in queue[:n]]
        queue = queue[n:]
        if engine.has_unfinished_requests() or queue:
            step += 1
            _note(engine.step(), step, first, done)
            engine.check_integrity()
    while engine.has_unfinished_requests():
        step += 1
        assert step < 500, "a livelock"
        _note(engine.step(), step, first, done)
        engine.check_integrity()
    pool_holds_its_tokens(engine)
    return [first[i] for i in ids], [done[i][0] for i in ids], [done[i][1] for i in ids]


def _note(outs, step, first, done):
    for o in outs:
        if o.outputs[0].token_ids and o.request_id not in first:
            first[o.request_id] = step
        if o.finished:
            done[o.request_id] = (step, list(o.outputs[0].token_ids))


@pytest.mark.parametrize("medium", ["host", "disk"])  # written back on eviction / through at insert
def test_first_token_preemption_gives_a_bursts_first_tokens_before_any_finish(medium):
    """A burst of 8 into a pool that holds 3: without preemption the last 3 requests produce their
    first token only after the first ones finished (their slots); with it, running requests are
    retracted (their K/V kept by the tier, loaded back on readmission, never recomputed wrong) and
    every first token comes before any request finishes; outputs are the reference's."""
    prompts = [prompt(i, 30) for i in range(8)]
    off = _burst(kv_engine(capacity=160, stores=[MemoryStore(medium)]), prompts)
    store = MemoryStore(medium)
    e = kv_engine(capacity=160, stores=[store], first_token_preemption=True)
    on = _burst(e, prompts)
    for _, _, outs in (off, on):
        assert outs == [reference(p, 12) for p in prompts]
    assert max(off[0]) > min(off[1])  # without it a newcomer waited for a finish
    assert max(on[0]) < min(on[1]) and max(on[0]) < max(off[0])
    assert 0 < e.scheduler.num_first_token_preemptions <= len(prompts)
    assert store.counts["blocks_read"] > 0  # the preempted requests' K/V came back from the tier


def test_first_token_preemption_under_a_stream_of_arrivals_starves_no_one():
    """Two newcomers before every step for 10 steps into a pool of 4 requests: every request
    finishes with the reference output (the preempted ones are readmitted before anything that
    arrived after their retraction), each preempted at most once."""
    prompts = [prompt(100 + i, 24) for i in range(20)]
    e = kv_engine(capacity=160, stores=[MemoryStore("host")], first_token_preemption=True)
    firsts, finishes, outs = _burst(e, prompts, max_tokens=10, arrivals=[2] * 10)
    assert outs == [reference(p, 10) for p in prompts]
    assert 0 < e.scheduler.num_first_token_preemptions <= len(prompts)
    assert all(f <= d for f, d in zip(firsts, finishes))


def test_first_token_preemption_needs_a_tier():
    """Refused without a tier; a tier given as ``tier_stores`` (the public Engine / LLM keyword)
    counts (the config alone refused it: it sees only the configured tiers)."""
    with pytest.raises(ValueError, match="^first_token_preemption needs a KV tier"):
        kv_engine(first_token_preemption=True)
    assert kv_engine(stores=[MemoryStore("host")], first_token_preemption=True).scheduler.first_token_preemption
    with pytest.raises(ValueError, match="^first_token_preemption must be True or False, got 1"):
        EngineConfig(first_token_preemption=1, host_cache_bytes=1 << 20).resolve()


@pytest.mark.parametrize("medium", ["host", "disk"])
def test_a_retracted_request_resumes_from_the_tier_what_the_pool_lost(medium):
    """A request retracted mid-decode, whose K/V the pool then evicts (to the tier: written back
    on eviction, or through at insert), loads it back on readmission. Its tier lookup was made
    once, at its first admission, so it recomputed all it had computed."""
    store = MemoryStore(medium)
    e = kv_engine(capacity=256, stores=[store])
    p = prompt(7, 40)
    rid = e.add_request(p, greedy(30))
    while not e.scheduler.running or len(e.scheduler.running[0].output_token_ids) < 12:
        e.step()
    (req,) = e.scheduler.running
    e.scheduler.retract(req)  # as the decode reservation does when short of memory
    e.kv.tiers.drain()
    e.kv.ensure_free(e.kv.capacity)  # the pool loses all of it (host: written back now)
    e.kv.tiers.drain()
    admitted: list = []
    e.events.subscribe(lambda ev: admitted.append(ev.prefix_len), (RequestAdmitted,))
    done = run_all(e)
    assert done[rid].outputs[0].token_ids == reference(p, 30)
    assert admitted == [51] and store.counts["blocks_read"] >= 3  # the 51 computed: 3 blocks and a tail


def test_close_writes_the_tail_of_a_prompt_its_reply_continues_past_a_block(tmp_path):
    """A 28-token prompt and its 6-token reply: the reply completes the prompt's second block
    (16-31). Close wrote that whole block and the reply's tail, not the prompt's own 12-token tail
    (a node continued mid-block was left to its children), so a restart asking the same prompt
    again got its first block only: 16 tokens, not 27 (the default model, serve --kv-tier-write-
    policy disk=write_back, SIGTERM and a restart: 976 of 989; written through: 989)."""
    from radixkv.tiers import DiskStore

    e = kv_engine(stores=[DiskStore(str(tmp_path), 1 << 30)], kv_tier_write_policy="write_back")
    p = prompt(25, 28)
    assert generate(e, [p])[0].outputs[0].token_ids == reference(p, 6)
    assert e.close()
    other = kv_engine(stores=[DiskStore(str(tmp_path), 1 << 30)])
    out = generate(other, [p])[0]
    assert out.cached_tokens_by_tier == {"device": 0, "host": 0, "disk": 27, "remote": 0}
    assert out.outputs[0].token_ids == reference(p, 6)
    assert other.cache_stats().tiers["disk"]["tail_tokens"] == 11


def test_a_preempted_request_held_back_does_not_lock_its_load_against_an_older_newcomers():
    """A newcomer whose 176 prompt tokens come back from the tier cannot install them while two
    requests decode; a second newcomer preempts the newest of them, which the pool then evicts and
    which loads its K/V back, held back behind the first newcomer (it arrived before the
    preemption). Installed, that load locked over 80 slots: the first newcomer's install was
    crowded out for good (80 + 176 tokens above 3/4 of the pool) and, the held-back one's lock
    being a tier install, never given up either: both waited forever, the engine stepping idle.
    A held-back request's finished load now waits uninstalled until it may be admitted."""
    store = MemoryStore("disk")
    e = kv_engine(capacity=256, stores=[store], chunk=256, first_token_preemption=True)
    first = prompt(1, 177)
    run_all(e.add_request(first, greedy(1)) and e)
    assert e.kv.tiers.drain(60)
    e.kv.ensure_free(256)  # the tier keeps the newcomer's prompt, the pool forgets it
    prompts = [(prompt(2, 80), 60), (prompt(3, 80), 60)]
    ids = [e.add_request(p, greedy(n)) for p, n in prompts]
    for _ in range(3):
        e.step()
    prompts += [(first + [5], 2), (prompt(4, 100), 5)]
    ids += [e.add_request(p, greedy(n)) for p, n in prompts[2:]]
    done = {}
    for _ in range(200):
        if not e.has_unfinished_requests():
            break
        done.update((o.request_id, o) for o in e.step() if o.finished)
        assert e.kv.tiers.drain(60)  # each load lands in the step after it (a fixed run)
        e.check_integrity()
    assert [done[i].outputs[0].token_ids if i in done else None for i in ids] == [reference(p, n) for p, n in prompts]
    assert e.scheduler.num_first_token_preemptions == 3 and store.counts["blocks_read"] >= 11 + 5


def test_first_token_preemption_drops_soft_pins_first_and_takes_only_its_own_tenants_requests():
    """Step 0 gives way as step 1 does: a session's soft pin is dropped before any running request
    is retracted (it kept the pin and retracted a decoder); and a newcomer retracts only running
    requests of its own tenant (another tenant's burst took them, and their requests then
    counted against their own tenant's queue share)."""
    from radixkv.namespace import Namespace

    a, b = Namespace(tenant="a"), Namespace(tenant="b")
    e = kv_engine(capacity=160, stores=[MemoryStore("host")], first_token_preemption=True)
    ctx = prompt(40, 60)
    generate(e, [ctx], greedy(2))
    pin = e.pin_prefix(ctx)
    assert pin is not None and pin.live
    ids = [e.add_request(prompt(41 + i, 40), greedy(20)) for i in range(2)]
    while any(len(r.output_token_ids) < 2 for r in e.scheduler.running) or len(e.scheduler.running) < 2:
        e.step()
    late = e.add_request(prompt(50, 30), greedy(4))
    done = run_all(e)
    assert not pin.live and e.scheduler.num_first_token_preemptions == 0  # the pin gave way
    assert [done[i].outputs[0].token_ids for i in ids + [late]] == [
        reference(prompt(41 + i, 40), 20) for i in range(2)
    ] + [reference(prompt(50, 30), 4)]
    # tenants: b's decoders are never retracted for a's newcomer; a's own are
    for owner, want in ((b, 0), (a, 1)):
        e = kv_engine(capacity=160, stores=[MemoryStore("host")], first_token_preemption=True)
        for i in range(3):
            e.add_request(prompt(60 + i, 40), greedy(16), namespace=owner)
        while len(e.scheduler.running) < 3 or any(not r.output_token_ids for r in e.scheduler.running):
            e.step()
        e.add_request(prompt(70, 40), greedy(4), namespace=a)
        run_all(e)
        assert min(e.scheduler.num_first_token_preemptions, 1) == want


@pytest.mark.parametrize("cached, chunk", [(True, 64), (False, 64), (False, 256)])
def test_first_token_preemption_fires_for_a_returning_turn_and_a_chunked_newcomer(cached, chunk):
    """Two decoders fill the pool; a newcomer continues a 70-token context (cached or not) with 20
    tokens. Its first token comes within 2 steps. Before: with its context cached, step 0 counted
    that (evictable) prefix as room it would free and as reused, so it never preempted while the
    decoders ate the prefix (first token at step 39); longer than a prefill chunk, it was admitted
    a chunk, retracted for memory, and was no newcomer any more (step 39)."""
    e = kv_engine(capacity=160, stores=[MemoryStore("host")], first_token_preemption=True, chunk=chunk)
    ctx = prompt(40, 70)
    if cached:
        generate(e, [ctx], greedy(2))
    ids = [e.add_request(prompt(41 + i, 40), greedy(60)) for i in range(2)]
    for _ in range(4):
        e.step()
    late = e.add_request(ctx + prompt(99, 20), greedy(4))
    firsts, finishes = {}, {}
    step = 0
    while e.has_unfinished_requests():
        step += 1
        _note(e.step(), step, firsts, finishes)
        e.check_integrity()
    assert firsts[late] <= 2 and e.scheduler.num_first_token_preemptions == 1
    assert finishes[late][1] == reference(ctx + prompt(99, 20), 4)
    assert [finishes[i][1] for i in ids] == [reference(prompt(41 + i, 40), 60) for i in range(2)]


@pytest.mark.parametrize("k", [1, 3, 4])
def test_first_token_preemption_counts_a_prefix_its_newcomers_share_once(k):
    """Six decoders fill the pool; ``k`` newcomers share a 48-token uncached prefix (a system
    prompt), which step 2 computes once for all. One retraction makes room for them; each
    newcomer's whole uncached prompt was counted (4 retractions for 3 newcomers, 5 for 4), and
    every retraction is reported by a StepFinished (a step that retracted and ran no forward
    reported none)."""
    from radixkv.engine.events import StepFinished

    e = kv_engine(capacity=256, stores=[MemoryStore("host")], first_token_preemption=True, chunk=256)
    reported: list = []
    e.events.subscribe(lambda ev: reported.extend(ev.retracted), (StepFinished,))
    s = e.scheduler
    ids = [e.add_request(prompt(400 + i, 30), greedy(40)) for i in range(6)]
    while len(s.running) < 6 or not all(r.output_token_ids for r in s.running):
        e.step()
    for _ in range(6):
        e.step()
    system = prompt(500, 48)
    news = [e.add_request(system + prompt(600 + j, 4), greedy(3)) for j in range(k)]
    e.step()
    assert s.num_first_token_preemptions == 1
    assert sum(1 for r in s.running if r.request_id in news) == min(k, 3)
    done = run_all(e)
    assert [done[i].outputs[0].token_ids for i in ids] == [reference(prompt(400 + i, 30), 40) for i in range(6)]
    assert [done[i].outputs[0].token_ids for i in news] == [reference(system + prompt(600 + j, 4), 3) for j in range(k)]
    assert len(reported) == s.num_retractions


def test_first_token_preemption_retracts_nothing_for_a_newcomer_that_cannot_fit():
    """Another tenant's long request holds most of the pool; a newcomer of tenant a that could
    not fit even with all of a's decoders retracted used to retract them all (a newcomer that
    fits among them too), and they waited behind it: nothing gained."""
    from radixkv.namespace import Namespace

    a, b = Namespace(tenant="a"), Namespace(tenant="b")
    e = kv_engine(capacity=160, stores=[MemoryStore("host")], first_token_preemption=True, chunk=256)
    e.add_request(prompt(80, 60), greedy(95), namespace=b)
    mine = [e.add_request(prompt(81 + i, 25), greedy(60), namespace=a) for i in range(2)]
    while len(e.scheduler.running) < 3 or not all(r.output_token_ids for r in e.scheduler.running):
        e.step()
    big = e.add_request(prompt(90, 100), greedy(3), namespace=a)
    e.step()
    assert e.scheduler.num_first_token_preemptions == 0
    done = run_all(e)
    assert done[big].outputs[0].token_ids == reference(prompt(90, 100), 3)
    assert [done[i].outputs[0].token_ids for i in mine] == [reference(prompt(81 + i, 25), 60) for i in range(2)]
