"""A seeded matrix over the engine's configuration, differential-tested on a fake model.

Each case draws one combination of page_size {1, 4, 16}, prefix_cache {radix, hash, none},
chunked_prefill_size {small, large}, in_batch_prefix_sharing, schedule_policy {lpm, fcfs},
speculative_config {None, ngram, radix}, a host KV tier (with a prefix cache), several tenants
(Namespaces with salts, ``max_queued_requests_per_tenant``, ``tenant_kv_quota_tokens``), pools
small enough to evict and retract, ``n > 1``, soft pins on finished contexts (as sessions hold
them), random aborts and flushes. The model is tier_fakes.KVRunner (its K/V encodes each
position's token, position and prefix, so a wrong, stale or mis-loaded slot fails the forward);
greedy outputs must equal the pure-Python reference token for token, the KV manager's
invariants must hold after every step, and when idle ``free + evictable + pinned == capacity``,
with nothing protected once the pins are released. The existing drives (test_scheduler,
test_in_batch_sharing, test_spec_decode) stay at page sizes 1 and 4, one namespace, no tiers and
sharing always on: this one crosses them.
"""

from __future__ import annotations

import random

import pytest
from random_drive import assert_outputs, random_drive
from tier_fakes import VOCAB, MemoryStore, kv_engine, reference

from radixkv.errors import QueueFullError
from radixkv.namespace import Namespace
from radixkv.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(120)

SPECS = [None, {"method": "ngram", "num_speculative_tokens": 3}, {"method": "radix", "num_speculative_tokens": 4}]
NAMESPACES = [None, Namespace(tenant="a"), Namespace(tenant="a", salt="s"), Namespace(tenant="b"), "x"]


def draw_config(rng: random.Random, case: int) -> dict:
    """One combination; the first 18 cases walk page_size x prefix_cache x spec exhaustively."""
    page_size = [1, 4, 16][case % 3]
    cache = ["radix", "hash", "none"][case // 3 % 3]
    spec = SPECS[case // 9 % 3] if case < 27 else rng.choice(SPECS)
    capacity = rng.choice([64, 80, 128]) if page_size < 16 else rng.choice([64, 96, 128])
    cfg = dict(
        page_size=page_size,
        cache=cache,
        capacity=capacity,
        chunk=rng.choice([page_size * 2, 64]),
        max_running=rng.choice([3, 8]),
        schedule_policy=rng.choice(["lpm", "fcfs"]),
        in_batch_prefix_sharing=rng.random() < 0.5,
        speculative_config=spec,
        max_queued_requests_per_tenant=rng.choice([None, 3]),
        tenant_kv_quota_tokens=rng.choice([None, {"a": 16, "b": 32}]),
    )
    if cache != "none" and rng.random() < 0.5:
        cfg["stores"] = [MemoryStore("host", capacity_bytes=rng.choice([1 << 14, 1 << 40]))]
        cfg["kv_tier_write_policy"] = (
            "write_through" if cache == "hash" else rng.choice(["write_back", "write_through"])
        )
    return cfg


def after_each_step(eng, rng: random.Random, asked: dict, pins: list):
    """What follows each step (``random_drive``'s ``after_step``): the tiers' queued writes are
    waited for, so which blocks a later lookup finds (and so every batch) never depends on the I/O
    thread's timing; then the committed context of some finished requests is soft-pinned (as a
    session turn does: ``(prompt + output)[:-1]`` in its namespace) and some earlier pins released."""

    def after(outs) -> None:
        if eng.kv.tiers is not None:
            assert eng.kv.tiers.drain(timeout=60)
        for out in outs:
            tokens = out.outputs[0].token_ids
            if out.finished and tokens and rng.random() < 0.3:
                p, ns = asked[out.request_id]
                pin = eng.pin_prefix((p + tokens)[:-1], ns)
                if pin is not None:
                    pins.append(pin)
        if pins and rng.random() < 0.1:
            eng.release_pin(pins.pop(rng.randrange(len(pins))))

    return after


def run_case(case: int) -> dict:
    rng = random.Random(1300 + case)
    cfg = draw_config(rng, case)
    eng = kv_engine(**cfg)
    stems = [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(4, 40))] for _ in range(3)]
    added, asked, pins = [], {}, []

    def arrive(step):
        idle = not eng.has_unfinished_requests()
        if rng.random() < (0.3 if idle else 0.03):  # a flush: done only when idle, then every slot is free
            flushed = eng.reset_prefix_cache(tiers=rng.random() < 0.5)
            assert flushed == (not eng.has_unfinished_requests())
            assert not flushed or eng.cache_stats()["free"] == cfg["capacity"]
        if len(added) >= 24 or rng.random() > 0.5:
            return
        for _ in range(rng.randrange(1, 4)):
            p = rng.choice(stems)[: rng.randrange(1, 40)] + [rng.randrange(1, VOCAB)]
            mt = rng.randrange(1, 12)
            sp = SamplingParams(temperature=0.0, max_tokens=mt, n=rng.choice([1, 1, 2]))
            try:
                ns = rng.choice(NAMESPACES)
                rid = eng.add_request(p, sp, namespace=ns)
            except QueueFullError as e:  # only under a per-tenant bound, which it names
                assert cfg["max_queued_requests_per_tenant"] and "max_queued_requests_per_tenant" in str(e)
                continue
            added.append(rid)
            asked[rid] = (p, ns)
            yield rid, reference(p, mt)

    after = after_each_step(eng, rng, asked, pins)
    got = random_drive(eng, rng, arrive, lambda _s: len(added) < 24, steps=800, abort_p=0.05, after_step=after)
    assert not eng.has_unfinished_requests(), cfg
    assert_outputs(*got)
    eng.check_integrity()
    s = eng.cache_stats()
    assert s["free"] + s["evictable"] + s["pinned"] == s["capacity"] and s["protected"] == s["pinned"], (cfg, s)
    for pin in pins:
        eng.release_pin(pin)
    s = eng.cache_stats()
    assert s["protected"] == s["pinned"] == 0 and s["free"] + s["evictable"] == s["capacity"], (cfg, s)
    assert eng.close()
    return s


@pytest.mark.parametrize("case", range(30))
def test_config_matrix(case):
    run_case(case)
