"""Engine events (radixkv/engine/events.py) on the fake-runner engine of test_scheduler.py: what
each event says, in what order, and that a consumer of the cache events mirrors the tree."""

from __future__ import annotations

import random

import pytest
from test_scheduler import VOCAB, greedy, make_engine, reference, run_all

from radixkv.cache.digests import BLOCK_TOKENS, block_digests
from radixkv.engine import (
    CacheEvicted,
    CacheInserted,
    CacheReset,
    EventBus,
    RequestAdmitted,
    RequestFinished,
    StepFinished,
)

pytestmark = pytest.mark.timeout(120)


def test_admitted_step_finished_and_finished_tell_the_story():
    eng = make_engine(capacity=256, chunk=16)
    events = []
    eng.events.subscribe(events.append)
    system = list(range(1, 41))
    a = eng.add_request(system + [3, 4], greedy(3))
    run_all(eng)
    b = eng.add_request(system + [5], greedy(2, n=2))
    run_all(eng)
    admitted = [e for e in events if isinstance(e, RequestAdmitted)]
    assert [(e.request_id, e.index, e.num_cached_tokens, e.readmission) for e in admitted] == [
        (a, 0, 0, False),
        (b, 0, 40, False),
        (b, 1, 0, False),
    ]
    assert admitted[1].prefix_len == 40 and admitted[2].prefix_len == len(system)  # sample 1 on the pin
    steps = [e for e in events if isinstance(e, StepFinished)]
    assert [s.step for s in steps] == list(range(1, len(steps) + 1)) and len(steps) == eng.num_steps
    # a's 42-token prompt in chunks of 16: 16, 16, 10 (samples), then 2 decodes
    assert [s.extend_lens for s in steps[:5]] == [(16,), (16,), (10,), (1,), (1,)]
    assert [s.sampled for s in steps[:3]] == [(False,), (False,), (True,)]
    assert sum(s.prefill_tokens for s in steps) == eng.cache_stats()["prefill_tokens"]
    finished = [e for e in events if isinstance(e, RequestFinished)]
    assert [(f.request_id, f.finish_reasons, f.num_output_tokens, f.num_cached_tokens) for f in finished] == [
        (a, ("length",), 3, 0),
        (b, ("length", "length"), 4, 40),
    ]
    # each request's admission comes before its first step and its finish after its last
    order = [type(e).__name__ for e in events if not isinstance(e, (CacheInserted, CacheEvicted))]
    assert order.index("RequestAdmitted") < order.index("StepFinished") < order.index("RequestFinished")


def test_abort_is_finished_with_abort_and_a_failing_subscriber_does_not_stop_the_engine():
    eng = make_engine()
    seen = []

    def boom(ev):
        raise RuntimeError("subscriber bug")

    eng.events.subscribe(boom, (StepFinished,))
    off = eng.events.subscribe(seen.append, (RequestFinished,))
    rid = eng.add_request([1, 2, 3, 4], greedy(50))
    eng.step()
    eng.abort_request(rid)
    keep = eng.add_request([5, 6, 7], greedy(4))
    done = run_all(eng)
    assert done[keep].outputs[0].token_ids == reference([5, 6, 7], 4)
    assert [(e.request_id, e.finish_reasons) for e in seen] == [(rid, ("abort",)), (keep, ("length",))]
    assert eng.events.errors == eng.num_steps  # one logged failure per step, none fatal
    off()
    off()  # idempotent
    eng.add_request([9, 9], greedy(1))
    run_all(eng)
    assert len(seen) == 2


def test_a_subscriber_leaving_inside_its_callback_costs_the_next_one_nothing():
    """A one-shot subscriber that unsubscribes inside its callback (on the engine thread, where
    ``AsyncLLM.subscribe``'s ``off()`` acts at once) removed itself from the list the bus was
    iterating, so the subscriber after it missed that event: the server's metrics, subscribed
    after such a listener, never saw a RequestFinished, kept the request's missed-token record
    forever and did not count its finish."""
    eng = make_engine()
    first, rest = [], []

    def once(ev):
        first.append(ev.request_id)
        off_once()
        off_once()  # idempotent inside the callback too

    off_once = eng.events.subscribe(once, (RequestFinished,))
    eng.events.subscribe(lambda ev: rest.append(ev.request_id), (RequestFinished,))
    late = []
    eng.events.subscribe(lambda ev: late.append(ev.request_id), (RequestFinished,))
    a = eng.add_request([1, 2, 3], greedy(2))
    b = eng.add_request([4, 5], greedy(3))
    run_all(eng)
    assert first == [a] and rest == [a, b] and late == [a, b]
    assert not eng.events.wants(StepFinished) and eng.events.wants(RequestFinished)


def test_bus_rejects_bad_subscriptions_and_filters_by_kind():
    bus = EventBus()
    with pytest.raises(ValueError, match="callable"):
        bus.subscribe(42)
    with pytest.raises(ValueError, match="Event classes"):
        bus.subscribe(print, (int,))
    got = []
    bus.subscribe(got.append, (CacheReset,))
    assert bus.wants(CacheReset) and not bus.wants(CacheInserted)
    bus.emit(CacheInserted(1, None, 16, 0, ()))
    bus.emit(CacheReset(2, 16))
    assert got == [CacheReset(2, 16)]


def _tree_blocks(tree) -> set[bytes]:
    """Digests of every 16-token block fully held by the radix tree, from a walk of it."""
    out = set()
    stack = [(ns_root, b"") for ns_root in tree.root.children.values()]
    while stack:
        node, path = stack.pop()
        path = path + node.key
        n = len(path) >> 2
        start = (n - (len(node.key) >> 2)) // BLOCK_TOKENS
        if n // BLOCK_TOKENS > start:
            out.update(block_digests(path, node.namespace, start, n // BLOCK_TOKENS))
        stack.extend((c, path) for c in node.children.values())
    return out


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("seed", range(3))
def test_cache_events_mirror_the_tree_exactly(page_size, seed):
    """A consumer that only sees CacheInserted / CacheEvicted / CacheReset holds exactly the
    blocks the tree holds, after a random workload with eviction and retraction; ``seq`` has no
    gaps."""
    rng = random.Random(seed)
    eng = make_engine(capacity=160, page_size=page_size, chunk=rng.choice([16, 48]), max_running=4)
    mirror: set[bytes] = set()
    seqs = []

    def on_cache(ev):
        seqs.append(ev.seq)
        if isinstance(ev, CacheInserted):
            assert not mirror & set(ev.block_digests), "a block was announced twice"
            mirror.update(ev.block_digests)
        elif isinstance(ev, CacheEvicted):
            assert set(ev.block_digests) <= mirror, "an eviction of an unknown block"
            mirror.difference_update(ev.block_digests)
        else:
            mirror.clear()

    eng.events.subscribe(on_cache, (CacheInserted, CacheEvicted, CacheReset))
    bases = [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(20, 50))] for _ in range(3)]
    for _ in range(30):
        p = rng.choice(bases) + [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 30))]
        eng.add_request(p, greedy(rng.randrange(1, 20), n=rng.choice([1, 1, 2])))
        if rng.random() < 0.3:
            eng.step()
    run_all(eng)
    s = eng.cache_stats()
    assert s["evicted_tokens"] > 0 and mirror == _tree_blocks(eng.cache) and mirror
    assert seqs == list(range(1, len(seqs) + 1))
    assert eng.reset_prefix_cache() and mirror == set() and seqs[-1] == len(seqs)


@pytest.mark.parametrize("page_size", [1, 4])
def test_partial_eviction_reports_exactly_the_pages_freed(page_size):
    """A request that needs part of the memory an older cached sequence holds evicts only that
    sequence's tail pages: the CacheEvicted event counts exactly those tokens and names exactly
    the 16-token blocks the tree no longer holds; the head stays cached and matchable."""
    eng = make_engine(capacity=96, page_size=page_size, chunk=96)
    mirror: set[bytes] = set()
    evicted = []

    def on_cache(ev):
        if isinstance(ev, CacheInserted):
            mirror.update(ev.block_digests)
        elif isinstance(ev, CacheEvicted):
            evicted.append(ev)
            mirror.difference_update(ev.block_digests)

    eng.events.subscribe(on_cache, (CacheInserted, CacheEvicted))
    a = [(7 * i) % (VOCAB - 1) + 1 for i in range(64)]
    eng.add_request(a, greedy(1))
    run_all(eng)
    held = eng.cache.total_size()  # a's prompt (+ its output token, whole pages only)
    b = [(5 * i + 3) % (VOCAB - 1) + 1 for i in range(40)]
    eng.add_request(b, greedy(1))
    run_all(eng)
    assert evicted, "b did not need to evict"
    need = sum(e.num_tokens for e in evicted)
    assert need % page_size == 0 and need < held  # a tail, not the whole sequence
    kept = eng.cache.match_prefix(a).length
    assert kept == held - need - (held - need) % page_size and kept > 0
    assert mirror == _tree_blocks(eng.cache)
    # the blocks reported gone are exactly a's blocks from the first one that lost a token
    first = kept // BLOCK_TOKENS
    assert {d for e in evicted for d in e.block_digests} == set(block_digests(a, None, first, held // BLOCK_TOKENS))
