"""Routing without Ray: the cache-event publisher (engine side), the router's event-fed view and
its resync, the tree's block listing, each policy's rule, tenants never routed on each other's
cache, and the multi-replica simulator's self-check (bench/sim_routing.py). Engines here run the
fake runner of test_scheduler.py."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_events import _tree_blocks
from test_scheduler import VOCAB, greedy, make_engine, run_all

from radixkv.cache.radix_tree import RadixCache
from radixkv.engine.publish import CacheEventPublisher
from radixkv.router import CacheView, RouteRequest, make_policy
from radixkv.router.policy import Decision

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[1]


def _workload(eng, rng, n=30):
    bases = [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(20, 50))] for _ in range(3)]
    for _ in range(n):
        p = rng.choice(bases) + [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 30))]
        eng.add_request(p, greedy(rng.randrange(1, 20), n=rng.choice([1, 1, 2])))
        if rng.random() < 0.3:
            eng.step()
            yield


@pytest.mark.parametrize("page_size", [1, 4])
def test_published_batches_mirror_the_tree_and_a_snapshot_resyncs_after_lost_events(page_size):
    rng = random.Random(page_size)
    eng = make_engine(capacity=160, page_size=page_size, chunk=16, max_running=4)
    pub = CacheEventPublisher()
    pub.attach(eng.events)
    view = CacheView()
    batches = 0
    for _ in _workload(eng, rng):
        b = pub.drain()
        if b is not None:
            batches += 1
            assert not view.apply(b)
    run_all(eng)
    assert not view.apply(pub.drain())
    assert eng.cache_stats()["evicted_tokens"] > 0 and batches > 3
    assert view.blocks == _tree_blocks(eng.cache) == set(eng.cache.block_digests()) and view.seq == eng.kv.event_seq
    assert pub.drain() is None and not pub.wakeup.is_set()

    # a small buffer overflows: the batch says so, the view asks for a snapshot and resyncs
    small = CacheEventPublisher(max_events=2, epoch=pub.epoch)
    pub_off = small.attach(eng.events)
    for _ in _workload(eng, rng, 12):
        pass
    run_all(eng)
    b = small.drain()
    assert b["dropped"] and small.dropped_events > 0
    assert view.apply(b) and not view.synced
    view.load_snapshot(small.snapshot(eng))
    assert view.synced and view.blocks == _tree_blocks(eng.cache) and view.seq == eng.kv.event_seq
    small.max_events = 100_000  # later batches continue right after the snapshot
    for _ in _workload(eng, rng, 6):
        pass
    run_all(eng)
    assert not view.apply(small.drain())
    assert view.blocks == _tree_blocks(eng.cache)
    # the engine empties its cache: a reset record
    assert eng.reset_prefix_cache()
    assert not view.apply(small.drain()) and view.blocks == set()
    pub_off()


def test_view_detects_gaps_epochs_and_unknown_evictions():
    v = CacheView()
    d = [bytes([i]) * 16 for i in range(4)]
    assert not v.apply({"epoch": "a", "events": [("insert", 1, None, 0, (d[0], d[1]))]})
    assert not v.apply({"epoch": "a", "events": [("insert", 1, None, 0, (d[0],)), ("evict", 2, None, (d[1],))]})
    assert v.blocks == {d[0]} and v.seq == 2  # seq 1 again was skipped
    assert v.apply({"epoch": "a", "events": [("insert", 4, None, 0, (d[2],))]}) and not v.synced  # gap
    assert v.apply({"epoch": "a", "events": [("insert", 5, None, 0, (d[3],))]})  # stays unsynced
    v.load_snapshot({"epoch": "a", "seq": 5, "blocks": [d[0], d[3]]})
    assert v.synced and v.blocks == {d[0], d[3]}
    assert v.apply({"epoch": "a", "events": [("evict", 6, None, None)]})  # the cache cannot tell
    # a restarted replica (new epoch) starts empty at seq 1; not at 1 -> resync
    assert not v.apply({"epoch": "b", "events": [("insert", 1, None, 0, (d[1],))]}) and v.blocks == {d[1]}
    assert v.apply({"epoch": "c", "events": [("insert", 7, None, 0, (d[1],))]}) and v.blocks == set()
    with pytest.raises(ValueError, match="unknown"):
        CacheView().apply({"epoch": "x", "events": [("bogus", 1)]})


@pytest.mark.parametrize("page_size", [1, 4])
def test_tree_block_digests_equal_a_walk_of_the_tree(page_size):
    rng = random.Random(7)
    t = RadixCache(page_size)
    for _ in range(200):
        base = [rng.randrange(1, 9) for _ in range(rng.randrange(0, 40))]
        seq = base + [rng.randrange(1, 500) for _ in range(rng.randrange(1, 60))]
        seq = seq[: len(seq) // page_size * page_size]
        t.insert(seq, np.zeros(len(seq), np.int64), rng.choice([None, "ns"]))
        if rng.random() < 0.2:
            t.evict(rng.randrange(1, 80))
    got = t.block_digests()
    assert len(got) == len(set(got)) and set(got) == _tree_blocks(t) and got


def _req(rid, toks, session=None):
    return RouteRequest(str(rid), toks, None, session)


def test_round_robin_least_load_and_session():
    rr = make_policy("round_robin")
    for r in ("a", "b", "c"):
        rr.add_replica(r)
    assert [rr.choose(_req(i, [1, 2])).replica for i in range(6)] == ["a", "b", "c"] * 2
    ll = make_policy("least_load", seed=1)
    for r in ("a", "b"):
        ll.add_replica(r)
    ll.choose(_req("x", [1] * 40))
    busy = ll.decisions["x"]
    assert ll.choose(_req("y", [1])).replica != busy  # two choices of two: the idle one
    ll.finished("x")
    ll.finished("y")
    assert all(v.requests == 0 and v.prefill_tokens == 0 for v in ll.loads.values())
    s = make_policy("session")
    reps = [f"r{i}" for i in range(4)]
    for r in reps:
        s.add_replica(r)
    keys = [f"conv-{i}" for i in range(200)]
    home = {k: s.choose(_req(k + "-1", [1], k)).replica for k in keys}
    assert all(s.choose(_req(k + "-2", [1], k)).replica == home[k] for k in keys)
    assert len(set(home.values())) == 4
    s.remove_replica("r0")  # consistent hashing: only r0's keys move
    moved = {k for k in keys if s.choose(_req(k + "-3", [1], k)).replica != home[k]}
    assert moved == {k for k in keys if home[k] == "r0"}
    with pytest.raises(ValueError, match="policy must be one of"):
        make_policy("random")
    with pytest.raises(ValueError, match="cache_events"):
        make_policy("cache_events", nonsense=1)


def test_approx_tree_follows_what_it_routed_and_never_learns_of_evictions():
    p = make_policy("approx_tree")
    for r in ("a", "b"):
        p.add_replica(r)
    conv = list(range(100, 180))
    first = p.choose(_req(1, conv)).replica
    p.finished("1")
    d = p.choose(_req(2, conv + [5, 6, 7]))
    assert d.replica == first and d.reason == "cache"
    p.finished("2")
    assert p.choose(_req(3, [9] * 50)).replica != first  # a miss goes to the smaller tree


def _replica_events(rep, tokens, seq, first=0):
    from radixkv.cache.digests import block_digests

    n = len(tokens) // 16
    return {"epoch": rep, "events": [("insert", seq, None, first, tuple(block_digests(tokens, None, first, n)))]}


def test_cache_events_routes_to_the_exact_prefix_counts_its_own_decisions_at_once_and_balances():
    p = make_policy("cache_events", seed=0)
    for r in ("a", "b", "c"):
        p.add_replica(r)
    sys_prompt = list(range(1, 1025))
    assert not p.on_events("b", _replica_events("b", sys_prompt, 1))
    d = p.choose(_req(1, sys_prompt + [7, 8, 9]))
    assert (d.replica, d.cached_tokens, d.reason) == ("b", 1024, "cache")
    # its own decision counts at once: a second turn, sent before any event arrives, follows it
    conv = list(range(5000, 5300))
    d1 = p.choose(_req(2, conv), now=0.0)
    p.finished("2", now=1.0)
    d2 = p.choose(_req(3, conv + [1] * 40), now=1.5)
    assert d2.replica == d1.replica and d2.cached_tokens == 288
    p.finished("3", now=2.0)
    assert p.choose(_req(4, conv + [2] * 40), now=10.0).cached_tokens == 0  # past pending_ttl, no event
    p.finished("4", now=10.0)
    # one hot prefix cannot pile everything on one replica: the hot-prefix rule and the balance
    # guard move requests on
    for i in range(40):
        p.choose(_req(f"hot{i}", sys_prompt + [i]), now=20.0)
    per = {r: p.loads[r].requests for r in ("a", "b", "c")}
    assert per["b"] == max(per.values()) and min(per.values()) >= 8 and per["b"] - min(per.values()) <= 9
    # a dead replica is forgotten: its cache and its requests
    p.remove_replica("b")
    assert "b" not in p.views and all(r != "b" for r in p.decisions.values())
    assert p.choose(_req(99, sys_prompt + [1])).replica in ("a", "c")


def test_cache_events_keeps_requests_that_arrive_together_on_one_replica_per_prefix():
    # 8 groups x 3 requests on distinct 1,024-token system prompts, interleaved and all in flight
    # at once (no event has arrived): the prefixes routed but not yet inserted count as soon
    # cached, so each group's later requests join its first one (cached_tokens 1024), and the
    # 24 outstanding requests stay within the balance guard (32) instead of scattering
    p = make_policy("cache_events", seed=0)
    for r in ("a", "b", "c"):
        p.add_replica(r)
    groups = [list(range(10_000 * (g + 1), 10_000 * (g + 1) + 1024)) for g in range(8)]
    where: dict[int, set] = {g: set() for g in range(8)}
    for k in range(3):
        for g, sp in enumerate(groups):
            d = p.choose(_req(f"g{g}q{k}", sp + [1, 2, 3 + k]), now=0.0)
            where[g].add(d.replica)
            assert d.cached_tokens == (0 if k == 0 else 1024), (g, k, d)
    assert all(len(v) == 1 for v in where.values())
    assert sorted(p.loads[r].requests for r in ("a", "b", "c")) == [6, 9, 9]  # groups 2 / 3 / 3
    # a request that was rejected (never ran) retracts its soon-cached blocks at once
    p.finished("g0q0", now=0.1, expire=True)
    p.finished("g0q1", now=0.1, expire=True)
    p.finished("g0q2", now=0.1, expire=True)
    home = next(iter(where[0]))
    assert p.cached_tokens(_req("probe", groups[0] + [9]), home) == 0


def test_cache_events_spreads_a_hot_prefix_by_load_and_keeps_a_conversation_home():
    p = make_policy("cache_events", seed=0)
    for r in ("a", "b"):
        p.add_replica(r)
    shots = list(range(1, 801))  # a few-shot preamble every request shares: hot once seen
    conv = list(range(3000, 4600))  # one conversation's history (on "a" only)
    assert not p.on_events("a", _replica_events("a", shots, 1))
    assert not p.on_events("a", _replica_events("a", conv, 2))
    got = [p.choose(_req(f"q{i}", shots + [900 + i])).replica for i in range(12)]
    # the first follows the cache; from the second on the preamble is hot (the deepest held block
    # of 1 of the 1 request before it, more than a quarter) and the load decides: "b" computes the
    # preamble once and shares the traffic (a hot request is priced 300 tokens per outstanding
    # request)
    assert got[:2] == ["a", "b"] and got.count("b") >= 5
    assert abs(p.loads["a"].requests - p.loads["b"].requests) <= 4
    # a turn of the conversation is not hot (its deepest block is its own): it stays home even
    # when "a" has more outstanding requests
    for i in range(5):
        p.choose(_req(f"x{i}", list(range(7000 + 100 * i, 7050 + 100 * i))), ["a"])
    assert p.loads["a"].requests >= p.loads["b"].requests + 3
    d = p.choose(_req("turn", conv + [5, 6]))
    assert (d.replica, d.cached_tokens) == ("a", 1600)


def test_cache_events_lets_a_replica_lacking_a_hot_prefix_take_its_share():
    # a 2,000-token preamble only "a" holds, hot from the 2nd request on (the deepest held block
    # of more than a quarter of the requests before it). Counted as held on every candidate, "b"
    # takes the first hot request that finds "a" busier, computing the preamble once
    p = make_policy("cache_events", seed=0)
    for r in ("a", "b"):
        p.add_replica(r)
    shots = list(range(1, 2001))
    p.on_events("a", _replica_events("a", shots, 1))
    got = [p.choose(_req(f"q{i}", shots + [900 + i])) for i in range(5)]
    assert [d.replica for d in got] == ["a", "b", "a", "b", "a"]
    # the decision reports what "b" holds (nothing, then the first one's blocks in flight)
    assert [d.cached_tokens for d in got] == [2000, 0, 2000, 2000, 2000]
    # both idle: the one that holds it, whatever the seed (ties go to more held tokens)
    for seed in range(10):
        p = make_policy("cache_events", seed=seed)
        for r in ("a", "b"):
            p.add_replica(r)
        p.on_events("a", _replica_events("a", shots, 1))
        for i in range(6):  # hot from the 2nd on; each finished before the next
            d = p.choose(_req(f"q{i}", shots + [900 + i]), now=float(i))
            assert d.replica == "a"
            p.finished(f"q{i}", now=i + 0.5, expire=True)


def test_cache_events_sends_a_prefix_cached_nowhere_home_and_spreads_new_prefixes_evenly(monkeypatch):
    p = make_policy("cache_events", seed=0)
    for r in ("a", "b"):
        p.add_replica(r)
    A, B, C = list(range(1, 101)), list(range(2001, 2041)), list(range(4001, 4061))
    da = p.choose(_req("A", A))
    other = "b" if da.replica == "a" else "a"
    # a new prefix goes where no prefix lives yet
    assert p.choose(_req("B", B)) == Decision(other, 0, "miss")
    for rid in ("A", "B"):
        p.finished(rid, expire=True)  # never ran: nothing of them is cached anywhere
    assert p.home_count == {da.replica: 1, other: 1}
    # each replica is home to one prefix: C goes where fewer new tokens went (B's 40, not A's 100)
    assert p.choose(_req("C", C)) == Decision(other, 0, "miss")
    # A is cached nowhere (its replica never reported it): it goes home, whatever the load
    for i in range(3):
        p.choose(_req(f"x{i}", list(range(7000 + 100 * i, 7050 + 100 * i))), [da.replica])
    assert p.loads[da.replica].requests == 3 and p.loads[other].requests == 1
    assert p.choose(_req("A2", A[:80] + [9, 9])) == Decision(da.replica, 0, "home")
    # the home is forgotten with its replica, and beyond HOME_SIZE (least recently routed first)
    p.remove_replica(other)
    assert set(p.home.values()) == {da.replica} and p.home_count == {da.replica: 4}
    monkeypatch.setattr("radixkv.router.cache_events.HOME_SIZE", 2)
    q = make_policy("cache_events", seed=0)
    q.add_replica("a")
    for rid, toks in (("A", A), ("B", B), ("C", C)):
        q.choose(_req(rid, toks))
    assert len(q.home) == 2 and q.home_count == {"a": 2}
    off = make_policy("cache_events", seed=0, home=False)
    off.add_replica("a")
    off.choose(_req("A", A))
    assert not off.home and not off.home_count


def test_cache_events_brings_a_prefix_its_home_partly_evicted_back_home():
    # SGLang's generated-shared-prefix shape: a 1,024-token system prompt per group. Its home
    # evicted all but the first two blocks (the LRU evicts from a leaf's tail): a stub, worth
    # less than one outstanding request (0.05 x 6,000 = 300 tokens).
    p = make_policy("cache_events", seed=0)
    for r in ("a", "b"):
        p.add_replica(r)
    system = list(range(1, 1025))
    home = p.choose(_req("g0", system + [5])).replica
    other = "b" if home == "a" else "a"
    p.finished("g0", expire=True)
    assert not p.on_events(home, _replica_events(home, system[:32], 1))
    for i in range(10):  # the home is busier (10,000 uncached tokens queued); other prefixes, so
        # this group's first block begins under a quarter of the requests (a group, not a template)
        p.choose(_req(f"x{i}", list(range(7000 + 2000 * i, 8000 + 2000 * i))), [home])
    costs = p.costs(_req("probe", system + [6]))
    assert costs[other] < costs[home]  # by the cost alone it would move, and its group with it
    assert p.choose(_req("g1", system + [6])) == Decision(home, 32, "cache")
    p.finished("g1", expire=True)
    # a stub the other replica holds as much of has no home (a template every replica holds)
    assert not p.on_events(other, _replica_events(other, system[:32], 1))
    assert p.choose(_req("g2", system + [7])).replica == other
    # more than a stub (320 tokens on the home): the cost decides, and 8,000 queued tokens there
    # (x 0.05 = 400) outweigh them
    q = make_policy("cache_events", seed=0)
    for r in ("a", "b"):
        q.add_replica(r)
    home = q.choose(_req("g0", system + [5])).replica
    other = "b" if home == "a" else "a"
    q.finished("g0", expire=True)
    q.on_events(home, _replica_events(home, system[:320], 1))
    for i in range(8):
        q.choose(_req(f"x{i}", list(range(7000 + 2000 * i, 8000 + 2000 * i))), [home])
    assert q.choose(_req("g1", system + [6])) == Decision(other, 0, "miss")


def test_cache_events_gives_no_home_to_a_template_every_conversation_begins_with():
    # chat traffic: every conversation begins with the same 32-token system prompt, most requests
    # are later turns (so the template is not the deepest held block of many: not hot), and "b"
    # has just been added. A new conversation holds only the template, on "a" alone: a stub, but
    # of a first block every request begins with, so the cost places it, on the idle "b"
    p = make_policy("cache_events", seed=0)
    p.add_replica("a")
    template = list(range(1, 33))
    convs = [template + list(range(1000 + 100 * i, 1050 + 100 * i)) for i in range(2)]
    for i, conv in enumerate(convs):
        p.choose(_req(f"c{i}", conv))
    for t in range(12):  # later turns, all outstanding on "a"
        convs[t % 2] = convs[t % 2] + list(range(5000 + 100 * t, 5060 + 100 * t))
        assert p.choose(_req(f"t{t}", convs[t % 2])).replica == "a"
    p.add_replica("b")
    d = p.choose(_req("new", template + list(range(9000, 9050))))
    assert d == Decision("b", 0, "miss"), (d, p.costs(_req("probe", template + [7])))
    assert p.choose(_req("t12", convs[0] + [3])).replica == "a"  # a later turn follows its history


def test_cache_events_counts_a_finished_reply_as_held_until_its_events_come():
    p = make_policy("cache_events", seed=0)
    for r in ("a", "b"):
        p.add_replica(r)
    prompt, out = list(range(100, 150)), list(range(500, 540))  # 50 prompt, 40 output tokens
    d = p.choose(_req("t1", prompt), now=0.0)
    p.finished("t1", now=1.0, output_token_ids=out)
    nxt = prompt + out + [7, 8, 9]  # the next turn: the history and a new message
    # what t1's replica caches (prompt + out[:-1], 89 tokens: 5 whole blocks) counts before any event
    assert p.choose(_req("t2", nxt), now=1.1) == Decision(d.replica, 80, "cache")
    p.finished("t2", now=1.2)
    p.replied("t2", [1] * 33)  # the reply may reach the router after the completion: the same
    d3 = p.choose(_req("t3", nxt + [1] * 33 + [5]), now=1.3)
    assert (d3.replica, d3.cached_tokens) == (d.replica, 112)  # nxt + 32 of the reply: 7 blocks
    assert p.stats()["replies"] == 2
    p.finished("t3", now=1.4)
    assert p.choose(_req("t4", nxt + [2]), now=10.0).cached_tokens == 0  # past pending_ttl, no event


def test_router_policies_import_without_torch_or_the_engine():
    code = (
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "import radixkv.router.policy as p\n"
        "bad = sorted(m for m in sys.modules if m.startswith('radixkv.engine') or m.split('.')[0] == 'torch'"
        " and sys.modules[m] is not None)\n"
        "assert not bad, bad\n"
        "pol = p.make_policy('approx_tree'); pol.add_replica('a'); pol.choose(p.RouteRequest('1', [1, 2, 3]))\n"
        "pol = p.make_policy('cache_events'); pol.add_replica('a'); pol.choose(p.RouteRequest('2', [1] * 40))\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_simulator_views_mirror_every_replica_tree_and_cache_events_beats_round_robin():
    sys.path.insert(0, str(ROOT))
    from bench.sim_routing import Timing, Trace, simulate
    from bench.workloads import Workload, WorkloadRequest

    rng = random.Random(0)
    reqs, last = [], {}
    for _ in range(400):
        c = rng.randrange(24)
        toks = [rng.randrange(1, 5000) for _ in range(rng.randrange(20, 120))]
        reply = [rng.randrange(1, 5000) for _ in range(rng.randrange(5, 60))]
        reqs.append(WorkloadRequest(toks, reply, parent=last.get(c)))
        last[c] = len(reqs) - 1
    tr = Trace(Workload("synthetic", reqs))
    hit, ws = tr.infinite_hit_rate()
    res = {
        p: simulate(tr, p, 4, ws // 8, rate=20.0, timing=Timing(), check=True) for p in ("round_robin", "cache_events")
    }
    assert res["cache_events"]["hit_rate"] > res["round_robin"]["hit_rate"] + 0.2
    assert res["cache_events"]["hit_rate"] <= hit and res["cache_events"]["requests"] == len(reqs)


def test_simulator_seed_means_and_targets_over_seeds():
    sys.path.insert(0, str(ROOT))
    from bench.sim_routing import seed_means, target_rows, targets

    def run(pol, seed, hit, p99, imb):
        return dict(
            replicas=2,
            policy=pol,
            seed=seed,
            hit_rate=hit,
            prefill_tokens=round(1000 * (1 - hit)),
            imbalance=imb,
            ttft_p50_s=p99 / 10,
            ttft_p99_s=p99,
        )

    runs = [
        run("cache_events", 0, 0.80, 1.0, 1.02),
        run("cache_events", 1, 0.70, 3.0, 1.10),
        run("least_load", 0, 0.60, 2.0, 1.01),
        run("least_load", 1, 0.50, 2.5, 1.03),
        run("approx_tree", 0, 0.82, 4.0, 1.2),
        run("approx_tree", 1, 0.70, 4.0, 1.3),
        run("bound", 0, 0.81, 0.5, 1.0),
        run("bound", 1, 0.81, 0.7, 1.0),
    ]
    m = {r["policy"]: r for r in seed_means(runs)}
    assert [r["policy"] for r in seed_means(runs)] == ["bound", "approx_tree", "cache_events", "least_load"]
    ce = m["cache_events"]
    assert ce["seeds"] == [0, 1] and ce["hit_rate"] == pytest.approx(0.75) and ce["ttft_p99_s"] == pytest.approx(2.0)
    assert ce["imbalance"] == 1.10 and ce["prefill_tokens"] == pytest.approx(250.0)
    assert m["least_load"]["ttft_p99_s"] == pytest.approx(2.25)
    out = {"traces": {"t": {"runs": runs, "means": seed_means(runs)}}}
    rows = target_rows(out, per_seed=True)
    # seed 0: 2 points under approx_tree; seed 1: p99 3.0 s against least_load's 2.5 s (1.2x); the
    # mean: 75% against approx_tree's 76% (1 point under), p99 2.0 / 2.25 s; the bound never counts
    assert [(r["seed"], r["met"]) for r in rows] == [(0, False), (1, False), ("mean", False)]
    assert [r["best_p99"] for r in rows] == ["least_load"] * 3
    mean = rows[-1]
    assert (mean["hit"], mean["approx_tree"], mean["least_load"]) == pytest.approx((0.75, 0.76, 0.55))
    assert mean["p99_s"] / mean["best_p99_s"] == pytest.approx(2.0 / 2.25)
    assert "| t | 2 | mean | 75.00 | -1.00 | +20.00 | 2.000 | 0.889 [least_load] | NO |" in targets(out).splitlines()
    # half a point under approx_tree is within the target; under least_load is not
    near = [dict(r, hit_rate=0.757) if r["policy"] == "cache_events" else r for r in runs]
    assert target_rows({"traces": {"t": {"runs": near, "means": seed_means(near)}}})[-1]["met"]
    low = [dict(r, hit_rate=0.54) if r["policy"] == "approx_tree" else r for r in near]
    low = [dict(r, hit_rate=0.80) if r["policy"] == "least_load" else r for r in low]
    assert not target_rows({"traces": {"t": {"runs": low, "means": seed_means(low)}}})[-1]["met"]


# ---------------------------------------------------------------------------- resuming after a replica died
def _stream(eng, prompt, params):
    """One request's cumulative snapshots on a fake-runner engine."""
    rid = eng.add_request(prompt, params)
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.request_id == rid:
                yield out


def _resumed(prompt, params, delivered, tokenizer):
    """What the consumer gets after ``delivered`` when the request goes on on a fresh replica."""
    from radixkv.router.resume import Replayer, Stitcher, continuation, resume_plan

    plan, _ = resume_plan(params, delivered)
    eng = _char_engine(soft=True)
    if plan == "continue":
        ids, cont = continuation(prompt, params, delivered)
        fix = Stitcher(delivered, params, tokenizer)
    else:
        assert plan == "replay"
        ids, cont, fix = prompt, params, Replayer(delivered)
    outs = []
    for raw in _stream(eng, ids, cont):
        out = fix.take(raw)
        if out is not None:
            outs.append(out)
            if out.finished:
                break
    return plan, outs


def _char_engine(soft=True):
    from test_scheduler import CharTokenizer, FakeRunner

    from radixkv.config import EngineConfig
    from radixkv.engine import Engine

    cfg = EngineConfig(device="cpu", max_total_tokens=512, chunked_prefill_size=64, max_running_requests=4)
    return Engine(cfg, model_runner=FakeRunner(512, 1, 4, soft=True), tokenizer=CharTokenizer(), eos_token_ids=[])


def _same_output(a, b):
    assert a.request_id == b.request_id and a.prompt_token_ids == b.prompt_token_ids and a.finished == b.finished
    assert a.num_cached_tokens == b.num_cached_tokens
    for x, y in zip(a.outputs, b.outputs, strict=True):
        assert (x.token_ids, x.text, x.finish_reason, x.stop_reason) == (
            y.token_ids,
            y.text,
            y.finish_reason,
            y.stop_reason,
        )
        assert x.logprobs == y.logprobs and x.cumulative_logprob == y.cumulative_logprob


@pytest.mark.parametrize(
    "kw, plan",
    [
        (dict(temperature=0.0, logprobs=2), "continue"),
        (dict(temperature=0.0, presence_penalty=1.5, frequency_penalty=0.7, min_tokens=20), "continue"),
        (dict(temperature=0.0, stop=["<seam>"]), "continue"),  # a stop string across the seam
        (dict(temperature=1.0, seed=7, n=2, logprobs=1, frequency_penalty=0.5), "replay"),
    ],
)
def test_a_request_resumed_after_its_replica_died_gives_what_an_uninterrupted_run_gives(kw, plan):
    from test_scheduler import CharTokenizer

    from radixkv.router.resume import resume_plan
    from radixkv.sampling_params import SamplingParams

    tok = CharTokenizer()
    prompt = [5, 9, 2, 33, 17, 8, 41, 3]
    if kw.get("stop") == ["<seam>"]:  # the 3 characters at output positions 9..11 (seam after 10)
        free = list(_stream(_char_engine(), prompt, SamplingParams(temperature=0.0, max_tokens=40)))[-1]
        kw = dict(kw, stop=[free.outputs[0].text[9:12]])
    params = SamplingParams(max_tokens=40, **kw)
    ref = list(_stream(_char_engine(), prompt, params))  # the uninterrupted run, on a fresh replica
    final = ref[-1]
    cut = 10 if "stop" in kw else 13
    delivered = next(o for o in ref if len(o.outputs[0].token_ids) >= cut)
    assert not delivered.finished
    got_plan, outs = _resumed(prompt, params, delivered, tok)
    assert got_plan == plan == resume_plan(params, delivered)[0]
    _same_output(outs[-1], final)
    if "stop" in kw:
        assert final.outputs[0].finish_reason == "stop" and len(final.outputs[0].token_ids) == 12
    # every snapshot is the uninterrupted run's at the same point: streaming deltas stay consistent
    at = {tuple(len(c.token_ids) for c in o.outputs): o for o in ref}
    for o in outs:
        _same_output(o, at[tuple(len(c.token_ids) for c in o.outputs)])
    assert len(outs) == len(ref) - ref.index(delivered) - 1 or plan == "replay"


def test_resuming_unseeded_samples_after_output_is_refused_and_a_diverged_replay_is_caught():
    from radixkv.router.resume import Replayer, ResumeError, resume_plan
    from radixkv.sampling_params import SamplingParams

    prompt = [5, 9, 2, 33]
    assert resume_plan(SamplingParams(temperature=0.0, regex="[a-z]+"), None)[0] == "restart"
    for kw in (dict(n=2), dict(presence_penalty=1.0, repetition_penalty=1.2)):
        p = SamplingParams(temperature=1.0, max_tokens=20, **kw)
        assert resume_plan(p, None)[0] == "restart"
        delivered = next(o for o in _stream(_char_engine(), prompt, p) if len(o.outputs[0].token_ids) >= 3)
        plan, why = resume_plan(p, delivered)
        assert plan is None and "unseeded" in why
    p = SamplingParams(temperature=1.0, seed=1, max_tokens=20)
    delivered = next(o for o in _stream(_char_engine(), prompt, p) if len(o.outputs[0].token_ids) >= 3)
    other = list(_stream(_char_engine(), prompt, p.clone(seed=2)))
    with pytest.raises(ResumeError, match="diverged"):
        for o in other:
            Replayer(delivered).take(o)


@pytest.mark.parametrize("policy", ["cache_events", "approx_tree"])
def test_a_tenant_is_never_routed_on_another_tenants_cache(policy):
    """Replica r1's engine caches alice's prompt (its real cache events, namespace alice). Bob's
    identical prompt holds nothing anywhere (the router's view and its in-flight blocks are per
    namespace, as the engine's cache is), so it is routed as a miss, never "cache" on alice's
    blocks, while alice's repeat is routed to r1 on all her whole blocks; the same through the
    index actor's wire format (the namespace's bytes)."""
    from radixkv.namespace import Namespace

    rng = random.Random(3)
    prompt = [rng.randrange(1, VOCAB) for _ in range(70)]  # 4 whole blocks before its last token
    alice, bob = Namespace("alice"), Namespace("bob")
    eng = make_engine(capacity=512)
    pub = CacheEventPublisher()
    pub.attach(eng.events)
    eng.add_request(prompt, greedy(4), namespace=alice)
    run_all(eng)
    p = make_policy(policy)
    for r in ("r0", "r1"):
        p.add_replica(r)
    if policy == "cache_events":
        assert not p.on_events("r1", pub.drain())
        assert p.cached_tokens(RouteRequest("a", prompt, alice), "r1") == 64
        assert p.cached_tokens(RouteRequest("b", prompt, bob), "r1") == 0
    else:  # approx_tree learns only from what it routes: alice's first request goes to r1
        p.record(RouteRequest("a0", prompt, alice), Decision("r1"))
        p.finished("a0")
    d = p.choose(RouteRequest("b1", prompt, bob))
    assert d.cached_tokens == 0 and d.reason != "cache", d
    p.finished("b1")
    d = p.choose(RouteRequest("a1", prompt, alice))
    assert d.replica == "r1" and d.reason == "cache", d
    assert d.cached_tokens == (64 if policy == "cache_events" else 0)

    if policy == "cache_events":  # the index actor, as Ray calls it: namespaces as bytes
        rr = pytest.importorskip("radixkv.router.ray")
        index = rr.CacheIndex.__ray_metadata__.modified_class(policy)
        for r in ("r0", "r1"):
            index.register(r, {})
        index.policy.on_events("r1", {"epoch": "e", "events": [], "dropped": False})
        index.policy.on_snapshot("r1", pub.snapshot(eng))
        for key, ns in (("kb", bob), ("ka", alice)):
            index.route(key, dict(request_id=key, token_ids=prompt, namespace=rr.wire_namespace(ns)), ["r0", "r1"])
            index.completed(key)
        got = {d["key"]: (d["replica"], d["cached"], d["reason"]) for d in index.decisions()}
        assert got["kb"][1] == 0 and got["kb"][2] != "cache" and got["ka"] == ("r1", 64, "cache"), got
