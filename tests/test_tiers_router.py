"""Cache events carry the KV tier (``medium``) to routers: the publisher's records, the router's
view of each replica (pool blocks apart from tier blocks), and the ``cache_events`` policy pricing
a block a tier holds between a local hit and a miss (radixkv/router/cache_events.py,
``tier_weight``)."""

from __future__ import annotations

from collections import OrderedDict

import pytest
from tier_fakes import MemoryStore, kv_engine, run_all

from radixkv.cache.digests import block_digests
from radixkv.engine.publish import CacheEventPublisher
from radixkv.namespace import namespace_key
from radixkv.router import CacheView, RouteRequest, make_policy
from radixkv.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(120)


def test_published_records_carry_the_tier_and_the_view_keeps_them_apart():
    e = kv_engine(stores=[MemoryStore("remote")])
    pub = CacheEventPublisher()
    pub.attach(e.events)
    prompt = list(range(1, 51))
    e.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=2))
    run_all(e)
    e.kv.tiers.drain()
    e.step()  # the finished writes are announced
    batch = pub.drain()
    inserts = [ev for ev in batch["events"] if ev[0] == "insert"]
    d = block_digests(prompt, None, 0, 3)
    assert inserts[0][:5] == ("insert", 1, namespace_key(None), 0, tuple(d)) and len(inserts[0]) == 5
    assert [ev[2:] for ev in inserts if len(ev) == 6] == [(namespace_key(None), 0, tuple(d), "remote")]
    assert [ev[1] for ev in batch["events"]] == list(range(1, len(batch["events"]) + 1))
    v = CacheView()
    assert v.apply(batch) is False
    assert v.blocks == set(d) and list(v.tiered["remote"]) == d
    e.reset_prefix_cache()  # the pool forgets; the tier keeps them
    assert v.apply(pub.drain()) is False
    assert v.blocks == set() and list(v.tiered["remote"]) == d


def _batch(epoch, seq, digests, medium=None):
    rec = ("insert", seq, namespace_key(None), 0, tuple(digests))
    return {"epoch": epoch, "events": [rec + ((medium,) if medium else ())], "dropped": False}


@pytest.mark.parametrize("tier_weight,winner", [(0.25, "b"), (1.0, "a")])
def test_a_block_in_the_shared_tier_is_cheaper_than_a_miss_dearer_than_a_local_hit(tier_weight, winner):
    toks = list(range(100, 260))  # 160 tokens: 9 whole blocks below the last one
    d = block_digests(toks, None, 0, 10)
    # hot_share 1: the popularity rule off (the same prompt again would be on a hot prefix, the
    # deepest held block of the one request before it, and count as held on "b" too)
    p = make_policy("cache_events", tier_weight=tier_weight, home=False, hot_share=1.0)
    for r in ("a", "b"):
        p.add_replica(r)
    p.on_events("a", _batch("ea", 1, d))  # a's pool holds the prompt
    p.on_events("a", _batch("ea", 2, d, "remote"))  # and it stored it in the shared tier
    req = RouteRequest("x", toks)
    assert p.choose(req, ["a", "b"]).replica == "a"  # equal loads: the local hit wins
    p.finished("x")
    # a is busy: 1,000 tokens of prefill queued (0.05 per token: 50). b must load the prompt
    # from the shared tier (0.25 x 159 = 40 tokens of cost) or, without tiers, compute it (159).
    p.loads["a"].prefill_tokens = 1000
    d2 = p.choose(RouteRequest("y", toks), ["a", "b"])
    assert d2.replica == winner


def test_a_replicas_own_host_tier_counts_only_for_it():
    toks = list(range(300, 460))
    d = block_digests(toks, None, 0, 10)
    p = make_policy("cache_events", home=False)
    for r in ("a", "b"):
        p.add_replica(r)
    p.on_events("b", _batch("eb", 1, d, "host"))
    assert p._tiered(d, {"a": 0, "b": 0}, ["a", "b"]) == {"a": 0, "b": 10}
    assert p.choose(RouteRequest("z", toks), ["a", "b"]).replica == "b"
    assert isinstance(p.views["b"].tiered["host"], OrderedDict)


def test_a_restarted_replica_is_not_credited_with_its_former_host_tier():
    """A new epoch (the replica's engine restarted, its view kept under the same name): its host
    RAM tier is empty, so the view forgets its host blocks (they were still priced as held);
    its disk directory and the shared remote tier keep theirs. The same through a snapshot."""
    d = block_digests(list(range(500, 660)), None, 0, 10)
    v = CacheView()
    for seq, medium in enumerate(("host", "disk", "remote"), 1):
        assert v.apply(_batch("e1", seq, d, medium)) is False
    assert set(v.tiered) == {"host", "disk", "remote"}
    assert v.apply(_batch("e2", 1, d[:2])) is False  # the restarted engine's first event
    assert set(v.tiered) == {"disk", "remote"} and list(v.tiered["disk"]) == d and v.blocks == set(d[:2])
    assert v.apply(_batch("e2", 2, d[:3], "host")) is False
    v.load_snapshot({"epoch": "e2", "seq": 2, "blocks": []})  # the same engine: its host tier stays
    assert list(v.tiered["host"]) == d[:3]
    v.load_snapshot({"epoch": "e3", "seq": 0, "blocks": []})
    assert "host" not in v.tiered and list(v.tiered["remote"]) == d
