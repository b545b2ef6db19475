"""The eviction side of the cache simulator: Belady's MIN (radixkv/sim/belady.py) and the
RadixCache eviction policies replayed through radixkv.sim.

* the offline loop with LRU ranks (``optimal(policy="lru")``) caches exactly the tokens the online
  replay of RadixCache's LRU does, on traces with heavy eviction: the offline model is the online
  one (and tests/test_sim.py ties the online one to the engine);
* MIN caches at least as much as every online policy (LRU, LFU, GreedyDual-Frequency,
  reuse-odds, block hashing at the same page size) on every trace, and as much as an unbounded
  cache when nothing has to be evicted;
* MIN on a hand-made trace where the farthest next use decides.
"""

from __future__ import annotations

import random

import pytest

from radixkv.sim import CacheSimulator, SimRequest, capacity_bound, optimal, simulate

pytestmark = pytest.mark.timeout(300)


def _trace(seed: int, n: int = 120) -> list[SimRequest]:
    """Conversations that come back (multi-turn), shared system prompts and one-off prompts, in
    two namespaces."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1, 50) for _ in range(rng.randrange(8, 30))] for _ in range(3)]
    convs: list = []
    out = []
    for _ in range(n):
        r = rng.random()
        if convs and r < 0.45:
            k = rng.randrange(len(convs))
            prompt, reply, ns = convs[k]
            prompt = prompt + reply + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 10))]
        else:
            prompt = rng.choice(systems) + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 25))]
            ns = rng.choice([None, None, "b"])
            k = None
        reply = [rng.randrange(1, 50) for _ in range(rng.randrange(0, 12))]
        if k is None:
            convs.append((prompt, reply, ns))
        else:
            convs[k] = (prompt, reply, ns)
        out.append(SimRequest(prompt, reply, ns))
    return out


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("seed", range(4))
def test_offline_lru_is_the_online_replay_and_min_bounds_every_policy(page_size, seed):
    trace = _trace(seed)
    inf = capacity_bound(trace, page_size)
    unbounded = optimal(trace, page_size, inf)
    assert unbounded.evicted_tokens == 0
    assert unbounded.cached_tokens == simulate(trace, "radix", page_size, outcomes=False).cached_tokens
    for capacity in (96, 160, 320):
        online = CacheSimulator("radix", page_size, capacity, outcomes=False, chunked_prefill_size=16).run(trace)
        twin = optimal(trace, page_size, capacity, policy="lru")
        assert (twin.cached_tokens, twin.evicted_tokens, twin.skipped) == (
            online.cached_tokens,
            online.evicted_tokens,
            online.skipped,
        )
        assert twin.cache_tokens_end == online.cache_tokens_end
        best = optimal(trace, page_size, capacity)
        assert best.skipped == online.skipped and best.prompt_tokens == online.prompt_tokens
        assert best.cached_tokens <= unbounded.cached_tokens
        for policy in ("radix", "radix-lfu", "radix-gdf", "radix-reuse-odds", "hash"):
            if policy == "hash" and page_size == 1:
                continue
            got = CacheSimulator(policy, page_size, capacity, outcomes=False).run(trace)
            assert got.cached_tokens <= best.cached_tokens, (policy, capacity)


def test_min_keeps_the_page_used_soonest():
    """Capacity 8 tokens, page 1; prompts of 5 tokens, no reply: each request caches its 5 tokens
    and may reuse its first 4. B makes room by evicting 2 of A's tokens (MIN: A's last token,
    never reused, and its 4th; LRU: A's tail, the same). C must evict 5: LRU takes A (older) and
    B's tail, so neither return hits; MIN takes all of B (used after A) and A's 3 tokens hit."""
    a, b, c = [1, 2, 3, 4, 0], [5, 6, 7, 8, 0], [9, 10, 11, 12, 0]
    trace = [SimRequest(a), SimRequest(b), SimRequest(c), SimRequest(a), SimRequest(b)]
    lru = optimal(trace, 1, 8, policy="lru")
    best = optimal(trace, 1, 8)
    assert (lru.cached_tokens, best.cached_tokens) == (0, 3)
    assert CacheSimulator("radix", 1, 8, outcomes=False).run(trace).cached_tokens == 0


def test_bad_arguments():
    with pytest.raises(ValueError, match="policy"):
        optimal([SimRequest([1])], 1, 8, policy="fifo")
    with pytest.raises(ValueError, match="capacity"):
        optimal([SimRequest([1])], 4, 2)
    with pytest.raises(ValueError, match="empty"):
        optimal([SimRequest([])], 1, 8)
