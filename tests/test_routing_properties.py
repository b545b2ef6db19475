"""Properties of the ``cache_events`` routing policy (radixkv/router/cache_events.py), over
random replica states: a longer cached prefix wins at equal load, a replica far above the mean
queue is avoided, the cost never falls as a replica's queue grows; none re-derives a default
constant."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from radixkv.cache.digests import block_digests
from radixkv.router import RouteRequest, make_policy

PROMPT = list(range(1, 1 + 16 * 12)) + [7]  # 12 whole blocks and one more token
_FILLER = iter(range(100_000, 10**9, 1000))


def _policy(n: int, seed: int = 0):
    p = make_policy("cache_events", seed=seed)
    for r in range(n):
        p.add_replica(f"r{r}")
    return p


def _hold(p, replica: str, blocks: int) -> None:
    """``replica`` reports the first ``blocks`` blocks of PROMPT cached (one insert event)."""
    if blocks:
        digests = tuple(block_digests(PROMPT[: 16 * blocks], None, 0, blocks))
        assert not p.on_events(replica, {"epoch": replica, "events": [("insert", 1, None, 0, digests)]})


def _queue(p, replica: str, k: int, tokens: int = 40) -> None:
    """``k`` outstanding requests on ``replica``, each ``tokens`` uncached tokens of their own."""
    for _ in range(k):
        base = next(_FILLER)
        p.choose(RouteRequest(f"f{base}", list(range(base, base + tokens))), [replica])


@settings(max_examples=60, deadline=None)
@given(
    held=st.lists(st.integers(0, 12), min_size=2, max_size=5, unique=True),
    queued=st.integers(0, 20),
    seed=st.integers(0, 3),
)
def test_a_longer_cached_prefix_wins_at_equal_load(held, queued, seed):
    p = _policy(len(held), seed)
    for i, k in enumerate(held):
        _hold(p, f"r{i}", k)
        _queue(p, f"r{i}", queued)
    d = p.choose(RouteRequest("q", PROMPT))
    best = max(range(len(held)), key=lambda i: held[i])
    assert (d.replica, d.cached_tokens) == (f"r{best}", 16 * held[best])


@settings(max_examples=60, deadline=None)
@given(
    others=st.lists(st.integers(0, 15), min_size=1, max_size=4),
    hot_load=st.integers(0, 120),
    held=st.integers(1, 12),
)
def test_a_replica_far_above_the_mean_queue_is_avoided_whatever_it_holds(others, hot_load, held):
    p = _policy(len(others) + 1)
    loads = [hot_load] + others
    mean = sum(loads) / len(loads)
    far = hot_load - mean > p.balance_abs_threshold and hot_load > p.balance_rel_threshold * mean
    _hold(p, "r0", held)  # only r0 holds the prompt
    for i, k in enumerate(loads):
        _queue(p, f"r{i}", k)
    costs = p.costs(RouteRequest("probe", PROMPT))
    d = p.choose(RouteRequest("q", PROMPT))
    if far:  # the mean is at least the least queue: SGLang's guard (on the least) keeps it out
        assert d.replica != "r0" and costs["r0"] == math.inf
    elif all(hot_load <= k + p.balance_abs_threshold or hot_load <= p.balance_rel_threshold * k for k in others):
        assert costs["r0"] < math.inf  # within the guard of every other replica: a candidate


@settings(max_examples=60, deadline=None)
@given(
    held=st.lists(st.integers(0, 12), min_size=2, max_size=4),
    queued=st.lists(st.integers(0, 6), min_size=4, max_size=4),
    hot=st.booleans(),
    tokens=st.integers(1, 400),
)
def test_the_cost_never_falls_as_a_replica_queue_grows(held, queued, hot, tokens):
    p = _policy(len(held))
    reps = [f"r{i}" for i in range(len(held))]
    for r, k, q in zip(reps, held, queued):
        _hold(p, r, k)
        _queue(p, r, q)
    if hot:  # the prompt's blocks are the deepest held ones of many requests: a hot prefix
        for i in range(12):
            p.choose(RouteRequest(f"h{i}", PROMPT[:-1] + [i]))
    req = RouteRequest("probe", PROMPT)
    for r in reps:
        before = p.costs(req)
        _queue(p, r, 1, tokens)
        after = p.costs(req)
        assert after[r] >= before[r] + p.load_weight * tokens - 1e-9  # its uncached tokens at least
        if hot and after[r] < math.inf:  # and, on a hot prefix, one more request's price
            assert after[r] >= before[r] + p.load_weight * (tokens + p.hot_request_tokens) - 1e-9
        assert all(after[c] == before[c] for c in reps if c != r and max(after[c], before[c]) < math.inf)


def test_the_choice_is_the_least_cost_and_options_are_checked():
    p = _policy(3)
    _hold(p, "r1", 4)
    _queue(p, "r1", 3)
    costs = p.costs(RouteRequest("probe", PROMPT))
    assert p.choose(RouteRequest("q", PROMPT)).replica == min(costs, key=costs.get)
    for bad in (dict(load_weight=-1), dict(hot_share=0), dict(hot_share=1.5), dict(home=1), dict(pending_ttl=-1)):
        try:
            make_policy("cache_events", **bad)
        except ValueError as exc:
            assert next(iter(bad)) in str(exc)
        else:
            raise AssertionError(f"{bad} accepted")


LONG = list(range(1, 1 + 16 * 40)) + [7]  # 40 whole blocks and one more token
HOT_BLOCKS = 12  # a preamble every request shares: LONG's first 12 blocks


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(2, 4),
    beyond=st.integers(1, 28),
    queued=st.integers(1, 5),
    fewer=st.lists(st.integers(1, 5), min_size=3, max_size=3),
    seed=st.integers(0, 3),
)
def test_held_blocks_beyond_a_hot_prefix_worth_less_than_one_queued_request_do_not_hold_a_request(
    n, beyond, queued, fewer, seed
):
    p = _policy(n, seed)
    reps = [f"r{i}" for i in range(n)]
    pre = tuple(block_digests(LONG[: 16 * HOT_BLOCKS], None, 0, HOT_BLOCKS))
    for r in reps:  # every replica holds the preamble
        assert not p.on_events(r, {"epoch": r, "events": [("insert", 1, None, 0, pre)]})
    for i in range(40):  # the deepest held block of 40 requests, more than a quarter of all: hot
        p.choose(RouteRequest(f"h{i}", LONG[: 16 * HOT_BLOCKS] + [10**6 + i] * 20))
        p.finished(f"h{i}", expire=True)
    more = tuple(block_digests(LONG[: 16 * (HOT_BLOCKS + beyond)], None, HOT_BLOCKS, HOT_BLOCKS + beyond))
    assert not p.on_events("r0", {"epoch": "r0", "events": [("insert", 2, None, HOT_BLOCKS, more)]})
    _queue(p, "r0", queued)  # r0 holds `beyond` blocks more and is busier than every other
    for r, k in zip(reps[1:], fewer):
        _queue(p, r, max(queued - k, 0))
    d = p.choose(RouteRequest("q", LONG))
    if 16 * beyond < p.load_weight * p.hot_request_tokens:  # worth less than one queued request
        assert d.replica != "r0" and d.cached_tokens == 16 * HOT_BLOCKS
    else:  # worth more: the longer prefix wins as without a hot prefix (queues differ by <= 5)
        assert (d.replica, d.cached_tokens) == ("r0", 16 * (HOT_BLOCKS + beyond))
