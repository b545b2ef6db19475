"""RadixCache unit tests with exact expected values (tokens, slots, sizes, eviction order)."""

import contextlib
import ctypes
import math
import random
from array import array

import numpy as np
import pytest
import torch

from radixkv.cache import MatchResult, PrefixCache, RadixCache, SlotAllocator, radix_tree, token_keys

pytestmark = pytest.mark.timeout(120)


def S(*xs):
    return torch.tensor(xs, dtype=torch.int64)


def edges(tree, ns=None):
    """{tokens tuple of every edge: (slots list, lock_ref)} of one namespace."""
    out = {}
    stack = list(tree.root.children[ns].children.values()) if ns in tree.root.children else []
    while stack:
        n = stack.pop()
        out[tuple(n.tokens())] = (n.slots(), n.lock_ref)
        stack.extend(n.children.values())
    return out


def test_is_a_prefix_cache():
    assert isinstance(RadixCache(), PrefixCache)
    with pytest.raises(ValueError, match="page_size"):
        RadixCache(0)


def test_empty_key():
    t = RadixCache()
    r = t.match_prefix([])
    assert isinstance(r, MatchResult)
    assert r.length == 0 and r.slots.dtype == torch.int64 and r.slots.tolist() == []
    assert r.node is t.root
    assert t.insert([], S()) == 0
    assert t.total_size() == 0 and t.root.children == {}
    t.inc_lock_ref(r.node)  # locking the root is a no-op
    t.dec_lock_ref(r.node)
    assert t.protected_size() == 0
    t.check_integrity()


def test_key_shorter_than_one_page():
    t = RadixCache(page_size=4)
    assert t.insert([1, 2, 3], S(10, 11, 12)) == 0
    assert t.total_size() == 0  # nothing inserted: the caller frees all three slots
    assert t.match_prefix([1, 2, 3]).length == 0
    assert t.insert([1, 2, 3, 4, 5, 6], S(10, 11, 12, 13, 14, 15)) == 0
    assert t.total_size() == 4  # only the whole page; the caller frees slots 14, 15
    r = t.match_prefix([1, 2, 3, 4, 5, 6, 7])
    assert (r.length, r.slots.tolist()) == (4, [10, 11, 12, 13])
    assert t.match_prefix([1, 2, 3, 9, 5]).length == 0  # partial page never matches
    t.check_integrity()


def test_match_ending_exactly_at_edge_end_does_not_split():
    t = RadixCache()
    t.insert([1, 2, 3], S(10, 11, 12))
    t.insert([1, 2, 3, 4, 5], S(90, 91, 92, 13, 14))
    assert edges(t) == {(1, 2, 3): ([10, 11, 12], 0), (4, 5): ([13, 14], 0)}
    r = t.match_prefix([1, 2, 3, 9])
    assert (r.length, r.slots.tolist(), r.node.tokens()) == (3, [10, 11, 12], [1, 2, 3])
    assert t.num_nodes() == 2
    r = t.match_prefix([1, 2, 3, 4, 5, 6])
    assert (r.length, r.slots.tolist(), r.node.tokens()) == (5, [10, 11, 12, 13, 14], [4, 5])
    t.check_integrity()


@pytest.mark.parametrize(
    "query,length,upper,lower",
    [
        ([1, 2, 3, 7], 3, (1, 2, 3), (4, 5, 6)),  # middle of the edge
        ([1, 9], 1, (1,), (2, 3, 4, 5, 6)),  # offset 1
        ([1, 2, 3, 4, 5], 5, (1, 2, 3, 4, 5), (6,)),  # query ends inside the edge
    ],
)
def test_split_inside_an_edge(query, length, upper, lower):
    t = RadixCache()
    t.insert([1, 2, 3, 4, 5, 6], S(10, 11, 12, 13, 14, 15))
    r = t.match_prefix(query)
    assert r.length == length and r.slots.tolist() == list(range(10, 10 + length))
    assert tuple(r.node.tokens()) == upper
    assert edges(t) == {upper: (list(range(10, 10 + length)), 0), lower: (list(range(10 + length, 16)), 0)}
    t.check_integrity()


def test_split_at_page_boundary():
    t = RadixCache(page_size=2)
    t.insert([1, 2, 3, 4, 5, 6, 7, 8], S(*range(20, 28)))
    r = t.match_prefix([1, 2, 3, 9, 5])
    assert (r.length, r.slots.tolist(), r.node.tokens()) == (2, [20, 21], [1, 2])
    assert edges(t) == {(1, 2): ([20, 21], 0), (3, 4, 5, 6, 7, 8): ([22, 23, 24, 25, 26, 27], 0)}
    assert t.insert([1, 2, 3, 4, 9, 9, 9], S(*range(30, 37))) == 4
    assert edges(t)[(9, 9)] == ([34, 35], 0)  # slot 36 (partial page) stays the caller's
    assert t.total_size() == 10
    t.check_integrity()


def test_insert_prefix_of_cached_key_and_extension():
    t = RadixCache()
    assert t.insert([1, 2, 3, 4, 5, 6], S(10, 11, 12, 13, 14, 15)) == 0
    assert t.insert([1, 2, 3], S(50, 51, 52)) == 3  # all cached; the tree keeps 10, 11, 12
    assert t.total_size() == 6
    assert t.match_prefix([1, 2, 3]).slots.tolist() == [10, 11, 12]
    assert t.insert([1, 2, 3, 4, 5, 6, 7, 8], S(60, 61, 62, 63, 64, 65, 16, 17)) == 6
    assert t.total_size() == 8
    r = t.match_prefix([1, 2, 3, 4, 5, 6, 7, 8])
    assert r.slots.tolist() == [10, 11, 12, 13, 14, 15, 16, 17] and r.length == 8
    assert edges(t) == {(1, 2, 3): ([10, 11, 12], 0), (4, 5, 6): ([13, 14, 15], 0), (7, 8): ([16, 17], 0)}
    t.check_integrity()


def test_one_token_key():
    t = RadixCache()
    assert t.insert([7], S(3)) == 0
    r = t.match_prefix([7, 8])
    assert (r.length, r.slots.tolist(), r.node.tokens()) == (1, [3], [7])
    assert t.insert([7], S(4)) == 1
    assert t.evict(1).tolist() == [3]
    assert t.total_size() == 0 and t.root.children == {}
    t.check_integrity()


def test_lru_order_follows_access_not_insertion():
    t = RadixCache()
    t.insert([1, 1], S(0, 1))  # oldest insert
    t.insert([2, 2], S(2, 3))
    t.insert([3, 3], S(4, 5))
    assert t.match_prefix([1, 1]).length == 2  # touch the oldest
    assert t.evict(2).tolist() == [2, 3]  # [2, 2] is now least recently used
    assert t.evict(2).tolist() == [4, 5]
    assert t.evict(2).tolist() == [0, 1]
    assert t.total_size() == 0


def test_match_refreshes_only_the_matched_part_of_a_split():
    t = RadixCache()
    t.insert([1, 2, 3, 4], S(0, 1, 2, 3))
    t.insert([5, 6], S(4, 5))
    t.match_prefix([1, 2, 9])  # splits [1 2 | 3 4]; [3, 4] keeps its old access time
    assert t.evict(2).tolist() == [2, 3]
    assert t.evict(2).tolist() == [4, 5]
    assert t.evict(2).tolist() == [0, 1]


def test_parent_evicted_after_its_last_child_in_the_same_call():
    t = RadixCache()
    t.insert([1, 2, 3, 4], S(0, 1, 2, 3))
    t.insert([1, 2, 5, 6], S(9, 9, 4, 5))
    t.insert([7], S(6))
    assert t.evict(6).tolist() == [2, 3, 4, 5, 0, 1]  # children, then their parent [1, 2]
    assert edges(t) == {(7,): ([6], 0)}
    assert (t.total_size(), t.evictable_size()) == (1, 1)
    t.check_integrity()


def test_partial_eviction_frees_the_tail_pages_and_keeps_the_head():
    t = RadixCache()
    calls = []
    t.evict_listener = lambda ns, path, start: calls.append((ns, np.frombuffer(path, np.int32).tolist(), start))
    t.insert([1, 2, 3, 4, 5, 6], S(10, 11, 12, 13, 14, 15))
    old = t.match_prefix([1, 2, 3, 4, 5, 6]).node
    t.insert([7, 8], S(16, 17))
    assert t.evict(2).tolist() == [14, 15]  # only what is needed, from the tail
    assert calls == [(None, [1, 2, 3, 4, 5, 6], 4)]  # path to the old end, first freed position
    assert edges(t) == {(1, 2, 3, 4): ([10, 11, 12, 13], 0), (7, 8): ([16, 17], 0)}
    assert (t.total_size(), t.evictable_size()) == (6, 6)
    with pytest.raises(ValueError, match="not in this tree"):  # the freed tail's handle is dead
        t.inc_lock_ref(old)
    assert t.evict(1).tolist() == [13]  # the kept head is still the least recently used
    assert t.match_prefix([1, 2, 9]).length == 2  # refresh its first half
    assert t.evict(3).tolist() == [12, 16, 17]  # [3] (older), then the whole of [7, 8]
    assert edges(t) == {(1, 2): ([10, 11], 0)}
    t.check_integrity()


def test_partial_eviction_in_whole_pages_under_a_locked_prefix():
    t = RadixCache(page_size=4)
    t.insert(list(range(8)), torch.arange(8))
    t.insert(list(range(8)) + list(range(100, 112)), torch.arange(100, 120))
    r = t.match_prefix(list(range(8)))
    t.inc_lock_ref(r.node)
    assert t.evict(1).tolist() == [116, 117, 118, 119]  # one token asked: its whole page goes
    assert t.evict(5).tolist() == [108, 109, 110, 111, 112, 113, 114, 115]
    assert (t.total_size(), t.protected_size(), t.evictable_size()) == (8, 8, 0)
    assert t.evict(100).tolist() == []  # the locked prefix stays
    assert r.node.lock_ref == 1 and t.match_prefix(list(range(20))).length == 8
    t.dec_lock_ref(r.node)
    assert t.evict(7).tolist() == list(range(8))
    assert t.root.children == {}
    t.check_integrity()


def test_evicting_everything_evictable_cuts_the_unlocked_subtrees_and_tells_the_listener():
    t = RadixCache(page_size=2)
    calls = []
    t.evict_listener = lambda ns, path, start: calls.append((ns, tuple(np.frombuffer(path, np.int32)), start))
    t.insert([1, 2, 3, 4, 5, 6], torch.arange(6))
    t.insert([1, 2, 3, 4, 7, 8, 9, 9], torch.arange(10, 18))
    t.insert([1, 2, 5, 5], torch.arange(20, 24))
    t.insert([4, 4, 4, 4], torch.arange(30, 34), namespace="b")
    locked = t.match_prefix([1, 2, 3, 4, 5, 6]).node
    t.inc_lock_ref(locked)
    gone = t.match_prefix([1, 2, 5, 5]).node
    assert t.evictable_size() == 4 + 2 + 4
    freed = t.evict(10**6)
    assert sorted(freed.tolist()) == [14, 15, 16, 17, 22, 23, 30, 31, 32, 33]
    assert sorted(calls, key=repr) == sorted(
        [(None, (1, 2, 3, 4, 7, 8, 9, 9), 4), (None, (1, 2, 5, 5), 2), ("b", (4, 4, 4, 4), 0)], key=repr
    )
    assert list(t.root.children) == [None]  # the emptied namespace is dropped
    assert (t.total_size(), t.protected_size(), t.evictable_size()) == (6, 6, 0)
    with pytest.raises(ValueError, match="not in this tree"):
        t.inc_lock_ref(gone)
    assert t.match_prefix([1, 2, 3, 4, 5, 6, 7]).length == 6
    t.dec_lock_ref(locked)
    t.check_integrity()
    assert sorted(t.evict(6).tolist()) == list(range(6)) and t.root.children == {}


def test_evict_frees_exactly_the_rounded_request_or_everything_evictable():
    rng = random.Random(2)
    for ps in (1, 3, 16):
        t, alloc = RadixCache(ps), SlotAllocator(ps << 14, ps)
        for _ in range(200):
            toks = [rng.randrange(5) for _ in range(rng.randrange(1, 80))]
            slots = alloc.alloc(-(-len(toks) // ps) * ps)
            p = t.insert(toks, slots[: len(toks)])
            alloc.free(slots[:p])
            alloc.free(slots[len(toks) - len(toks) % ps :])
            if rng.random() < 0.3:
                num, before = rng.randrange(0, 60), t.evictable_size()
                freed = t.evict(num)
                assert len(freed) == min(-(-num // ps) * ps, before)
                alloc.free(freed)
        t.check_integrity()
        assert alloc.available_size() + t.total_size() == alloc.num_slots


def test_lfu_and_greedy_dual_policies_order_leaves_by_hits():
    def tree(policy):
        t = RadixCache(eviction_policy=policy)
        t.insert([1, 1], S(0, 1))  # A
        t.match_prefix([1, 1])
        t.match_prefix([1, 1])  # A: 3 walks, the oldest after B and C arrive
        t.insert([2, 2], S(2, 3))  # B: 1 walk
        t.insert([3, 3], S(4, 5))  # C: 1 walk
        return t

    assert tree("lru").evict(2).tolist() == [0, 1]  # A is least recently used
    lfu = tree("lfu")
    assert lfu.eviction_policy == "lfu" and lfu.root.children[None].children[b"\x01\0\0\0"].hits == 3
    assert [lfu.evict(2).tolist() for _ in range(3)] == [[2, 3], [4, 5], [0, 1]]
    gdf = tree("gdf")
    assert gdf.evict(2).tolist() == [2, 3]  # H: A 3, B 1, C 1 -> B (older), L = 1
    gdf.insert([4, 4], S(6, 7))  # D: H = L + 1 = 2
    gdf.check_integrity()
    assert [gdf.evict(2).tolist() for _ in range(3)] == [[4, 5], [6, 7], [0, 1]]
    assert gdf._policy.inflation == 3
    gdf.insert([5], S(8))
    gdf.reset()
    assert gdf._policy.inflation == 0
    with pytest.raises(ValueError, match="eviction_policy"):
        RadixCache(eviction_policy="fifo")


def test_reuse_odds_learns_which_leaves_come_back():
    """Long leaves (depth >= 256) that are never matched again and short ones that are: once
    reuse-odds has seen both, a short leaf outlives a long one inserted after it (LRU would
    evict the short one first); a freed leaf whose tokens come back under the same node is a
    ghost hit (counted reused, not dead)."""
    from radixkv.cache.evict_policy import ReuseOdds

    policy = ReuseOdds(depth_block=256)
    t = RadixCache(eviction_policy=policy)
    slot = iter(range(10**6))

    def put(toks):
        slots = torch.tensor([next(slot) for _ in toks])
        t.insert(toks, slots)
        return slots.tolist()

    for i in range(20):  # short sequences come back, long ones do not
        short, long = [1000 + i] * 8, [2000 + i] * 300
        put(short)
        put(long)
        t.match_prefix(short)
    t.evict(t.total_size())
    # a leaf is judged by the class it was filed under: fresh short leaves (1 walk, depth < 256)
    # were all reused, fresh long ones (depth 256-511) never, short ones reused once never again
    fresh_short, fresh_long, reused_short = (1, 0), (1, 1), (2, 0)
    assert policy.reused_count == {fresh_short: 20} and policy.mean_gap == 2  # matched 2 ticks later
    assert policy.dead_count == {fresh_long: 20, reused_short: 20}
    assert policy.log_odds(fresh_short) > 0 > policy.log_odds(fresh_long)
    put([7] * 8)  # short, older
    long_slots = put([8] * 300)  # long, newer
    assert t.evict(300).tolist() == long_slots  # LRU would have evicted the short one first
    assert t.match_prefix([7] * 8).length == 8 and t.match_prefix([8] * 300).length == 0
    # a ghost hit: the freed long leaf comes back under the same (namespace root) node
    dead = policy.dead_count.get((1, 1), 0)
    put([8] * 300)
    assert policy.dead_count[(1, 1)] == dead - 1
    t.check_integrity()
    with pytest.raises(ValueError, match="depth_block"):
        ReuseOdds(depth_block=0)


def test_reuse_odds_horizon_weights_the_odds_against_recency():
    """``horizon`` scales the odds credit: priority = last_access + horizon * K * ln(odds). An old
    leaf of a class that always comes back outlives a newer leaf of a class that never does
    under horizon 2 but not under horizon 1 (its credit is then too small for the age gap)."""
    from radixkv.cache.evict_policy import ReuseOdds

    for horizon, survivor in ((1.0, "new"), (2.0, "old")):
        policy = ReuseOdds(depth_block=256, horizon=horizon)
        t = RadixCache(eviction_policy=policy)
        slot = iter(range(10**6))

        def put(toks, t=t, slot=slot):
            slots = torch.tensor([next(slot) for _ in toks])
            t.insert(toks, slots)
            return slots.tolist()

        for i in range(3):  # short leaves come back 4 ticks later, long ones never
            short = [1000 + i] * 8
            put(short)
            for j in range(3):
                put([2000 + 10 * i + j] * 300)
            t.match_prefix(short)
        t.evict(t.total_size())
        k = policy.mean_gap
        assert k == 4 and policy.reused_count == {(1, 0): 3} and policy.dead_count[(1, 1)] == 9
        credit = policy.log_odds((1, 0)) - policy.log_odds((1, 1))  # ln(4) - ln(1 / 10)
        assert credit == pytest.approx(math.log(4) - math.log(1 / 10))
        put([7] * 8)  # short, filed at tick c
        for _ in range(int(k * credit * 1.5)):  # ticks of age: between 1x and 2x the credit in K
            t.match_prefix([9])
        long_slots = put([8] * 300)
        freed = t.evict(8).tolist()
        if survivor == "old":
            assert freed == long_slots[-8:] and t.match_prefix([7] * 8).length == 8
        else:
            assert t.match_prefix([7] * 8).length == 0 and t.match_prefix([8] * 300).length == 300
        t.check_integrity()
    for bad in (0, -1.0, float("inf"), float("nan"), True, "2"):
        with pytest.raises(ValueError, match="horizon"):
            ReuseOdds(horizon=bad)


def test_lock_after_split_pins_exactly_the_matched_tokens():
    t = RadixCache()
    t.insert([1, 2, 3, 4, 5, 6], S(10, 11, 12, 13, 14, 15))
    r = t.match_prefix([1, 2, 3, 9])
    t.inc_lock_ref(r.node)
    assert (t.protected_size(), t.evictable_size(), t.total_size()) == (3, 3, 6)
    assert t.evict(100).tolist() == [13, 14, 15]
    assert edges(t) == {(1, 2, 3): ([10, 11, 12], 1)}
    assert t.evict(100).tolist() == []
    t.dec_lock_ref(r.node)
    assert (t.protected_size(), t.evictable_size()) == (0, 3)
    with pytest.raises(RuntimeError, match="dec_lock_ref"):
        t.dec_lock_ref(r.node)  # unbalanced
    assert (t.protected_size(), t.evictable_size()) == (0, 3)
    assert t.evict(3).tolist() == [10, 11, 12]
    with pytest.raises(ValueError, match="not in this tree"):
        t.inc_lock_ref(r.node)
    t.check_integrity()


def test_lock_survives_a_later_split_of_the_locked_edge():
    t = RadixCache()
    t.insert([1, 2, 3, 4], S(0, 1, 2, 3))
    r = t.match_prefix([1, 2, 3, 4])
    t.inc_lock_ref(r.node)
    t.match_prefix([1, 2, 8])  # splits the locked edge
    assert edges(t) == {(1, 2): ([0, 1], 1), (3, 4): ([2, 3], 1)}
    assert t.protected_size() == 4
    t.dec_lock_ref(r.node)
    assert t.protected_size() == 0 and t.evictable_size() == 4
    t.check_integrity()


def test_evict_with_nothing_evictable_returns_empty():
    t = RadixCache()
    out = t.evict(10)
    assert out.dtype == torch.int64 and out.tolist() == []
    t.insert([1, 2], S(0, 1))
    t.inc_lock_ref(t.match_prefix([1, 2]).node)
    assert t.evict(10).tolist() == [] and t.total_size() == 2
    assert t.evict(0).tolist() == []
    with pytest.raises(ValueError, match="num_tokens"):
        t.evict(-1)


def test_same_tokens_in_two_namespaces():
    t = RadixCache()
    assert t.insert([1, 2, 3], S(0, 1, 2), namespace="lora-a") == 0
    assert t.insert([1, 2, 3], S(3, 4, 5), namespace=("salt", 7)) == 0
    assert t.match_prefix([1, 2, 3], namespace="lora-a").slots.tolist() == [0, 1, 2]
    assert t.match_prefix([1, 2, 3], namespace=("salt", 7)).slots.tolist() == [3, 4, 5]
    assert t.match_prefix([1, 2, 3]).length == 0  # default namespace None is a third one
    assert t.total_size() == 6
    r = t.match_prefix([1, 2], namespace="lora-a")
    t.inc_lock_ref(r.node)
    assert sorted(t.evict(100).tolist()) == [2, 3, 4, 5]
    assert list(t.root.children) == ["lora-a"]  # the emptied namespace is dropped
    t.dec_lock_ref(r.node)
    t.check_integrity()


def test_insert_validation():
    t = RadixCache()
    with pytest.raises(ValueError, match=r"len\(tokens\)=3 and len\(slots\)=2"):
        t.insert([1, 2, 3], S(0, 1))
    with pytest.raises(ValueError, match="int32"):
        t.insert([2**31], S(0))
    with pytest.raises(ValueError, match="int32"):
        t.match_prefix(torch.tensor([2**40]))
    with pytest.raises(ValueError, match="1-D integer"):
        t.match_prefix(torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="1-D integer"):
        t.insert([1], torch.tensor([[0]]))
    assert t.total_size() == 0


def test_token_input_types_agree():
    t = RadixCache()
    t.insert(torch.tensor([5, 6, 7], dtype=torch.int32), S(0, 1, 2))
    for q in (
        [5, 6, 7],
        (5, 6, 7),
        np.array([5, 6, 7]),
        array("i", [5, 6, 7]),
        array("q", [5, 6, 7]),
        torch.tensor([5, 6, 7]),
        range(5, 8),
    ):
        assert t.match_prefix(q).slots.tolist() == [0, 1, 2]
    assert t.insert([5, 6, 7], [9, 9, 9]) == 3


def _containers(toks):
    """Every token container the tree reads in place (and a few it converts), for one list."""
    out = {
        "list": list(toks),
        "tuple": tuple(toks),
        "array_i": array("i", toks),
        "array_l": array("l", toks),
        "array_q": array("q", toks),
        "numpy_int32": np.array(toks, dtype=np.int32),
        "numpy_int64": np.array(toks, dtype=np.int64),
        "memoryview_i": memoryview(array("i", toks)),
        "memoryview_l": memoryview(array("l", toks)),
        "memoryview_q": memoryview(array("q", toks)),
        "tensor_int64": torch.tensor(toks, dtype=torch.int64),
        "tensor_int32": torch.tensor(toks, dtype=torch.int32),
        # converted, not read in place: other dtypes, strided views, non-native byte order
        "numpy_uint16": np.array(toks, dtype=np.uint16),
        "numpy_strided": np.repeat(np.array(toks, dtype=np.int64), 2)[::2],
        "numpy_big_endian": np.array(toks, dtype=">i4"),
        "tensor_strided": torch.tensor(toks, dtype=torch.int64).repeat_interleave(2)[::2],
        "range": range(toks[0], toks[0] + len(toks)) if toks == list(range(toks[0], toks[0] + len(toks))) else toks,
    }
    return out


@pytest.mark.parametrize("page_size", [1, 16])
def test_every_token_container_gives_the_same_answers(page_size):
    """match_prefix and insert give the same results (lengths, slots, tree) for every container
    of the same ids, with and without the C helper; raw bytes and bad ids are refused."""
    rng = random.Random(5)
    base = [rng.randrange(40000) for _ in range(3000)]
    other = base[:1000] + [rng.randrange(40000) for _ in range(1000)]
    queries = [base, base[:2047], other, base[:5], [base[0] + 1] + base[1:64]]

    def run(box):
        t = RadixCache(page_size)
        log = [t.insert(_containers(base)[box], torch.arange(3000))]
        log.append(t.insert(_containers(other)[box], torch.arange(3000, 5000)))
        for q in queries:
            r = t.match_prefix(_containers(q)[box])
            log.append((r.length, r.slots.tolist()))
        t.check_integrity()
        return log, t.pretty_print()

    impls = [False, True] if radix_tree.HAS_CEXT else [True]
    results = {}
    for py in impls:
        for box in _containers(base):
            if py:
                with token_keys.use_python_path():
                    results[box, py] = run(box)
            else:
                results[box, py] = run(box)
    ref = results["list", impls[0]]
    assert ref[0][:2] == [0, 1000 - 1000 % page_size]
    for key, got in results.items():
        assert got == ref, key
    t = RadixCache(page_size)
    t.insert(base, torch.arange(3000))
    for bad in (bytes(array("i", base)), bytearray(array("i", base)), memoryview(bytes(16))):
        with pytest.raises(ValueError, match="raw bytes"):
            t.match_prefix(bad)
        with pytest.raises(ValueError, match="raw bytes"):
            t.insert(bad, torch.arange(len(bad)))
    int64_boxes = (
        lambda x: array("q", x),
        lambda x: array("l", x),
        lambda x: np.array(x, dtype=np.int64),
        lambda x: memoryview(array("q", x)),
        lambda x: torch.tensor(x, dtype=torch.int64),
    )
    for box in int64_boxes:
        for q in (box(base[:40] + [2**31] + base[41:80]), box([2**40] * 3), box(base[:16] + [-(2**31) - 1])):
            with pytest.raises(ValueError, match="int32"):
                t.match_prefix(q)
            with pytest.raises(ValueError, match="int32"):
                t.insert(q, torch.arange(len(q)))
    for bad in (np.zeros((2, 2), dtype=np.int64), torch.zeros(2, 2, dtype=torch.int64), np.array([1.5])):
        with pytest.raises(ValueError, match="1-D integer"):
            t.match_prefix(bad)
    with pytest.raises(ValueError, match="integers"):
        t.match_prefix(array("d", [1.0]))
    assert t.total_size() == 3000 - 3000 % page_size
    t.check_integrity()


def test_reset_returns_every_slot_and_refuses_while_locked():
    t = RadixCache()
    t.insert([1, 2, 3], S(0, 1, 2))
    t.insert([1, 5], S(7, 3))
    r = t.match_prefix([1, 5])
    t.inc_lock_ref(r.node)
    with pytest.raises(RuntimeError, match="locked"):
        t.reset()
    assert t.total_size() == 4
    t.dec_lock_ref(r.node)
    assert sorted(t.reset().tolist()) == [0, 1, 2, 3]
    assert (t.total_size(), t.evictable_size(), t.protected_size()) == (0, 0, 0)
    assert t.reset().tolist() == []
    t.check_integrity()


def test_pretty_print_and_integrity_check_catch_corruption():
    t = RadixCache()
    t.insert([1, 2, 3], S(0, 1, 2))
    t.insert([1, 2, 4], S(9, 9, 3))
    text = t.pretty_print()
    assert "total=4" in text and "[1 2] len=2 slots=0..1" in text and "[4] len=1" in text
    t.check_integrity()
    node = t.match_prefix([1, 2, 4]).node
    node.lock_ref = 1  # bypassing inc_lock_ref breaks the size counters
    with pytest.raises(RuntimeError, match="integrity"):
        t.check_integrity()
    node.lock_ref = 0
    node.value = np.array([0], dtype=np.int64).tobytes()  # slot 0 now held twice
    with pytest.raises(RuntimeError, match="two tree positions"):
        t.check_integrity()


@pytest.mark.skipif(not radix_tree.HAS_CEXT, reason="C helper not built")
def test_c_helpers_equal_python_helpers():
    from radixkv.cache import _cprefix

    rng = random.Random(7)
    for _ in range(3000):
        a = [rng.randrange(3) for _ in range(rng.randrange(0, 40))]
        b = [rng.choice([rng.randrange(3), -rng.randrange(2**31)]) for _ in range(40)]
        ab, bb = _cprefix.pack_int32(a), _cprefix.pack_int32(tuple(b))
        assert ab == token_keys.pack_int32_py(a) and bb == token_keys.pack_int32_py(b)
        start = rng.randrange(0, 41)
        limit = rng.randrange(start, 41)
        assert _cprefix.common_prefix_len(ab, bb, start, limit) == token_keys.common_prefix_len_py(ab, bb, start, limit)
        # and against the definition
        n = min(len(a), limit - start)
        m = next((i for i in range(n) if a[i] != b[start + i]), n)
        assert token_keys.common_prefix_len_py(ab, bb, start, limit) == m
    edge_ids = [0, 1, -1, 2**30 - 1, 2**30, -(2**30), -(2**30) - 1, 2**31 - 1, -(2**31), True]
    assert (
        _cprefix.pack_int32(edge_ids)
        == token_keys.pack_int32_py(edge_ids)
        == np.array(edge_ids, dtype=np.int32).tobytes()
    )
    for bad in ([2**31], [-(2**31) - 1], [2**70]):
        with pytest.raises(ValueError):
            _cprefix.pack_int32(bad)
        with pytest.raises(ValueError):
            token_keys.pack_int32_py(bad)
    with pytest.raises(ValueError):
        _cprefix.common_prefix_len(b"", b"\0" * 8, 1, 3)


@pytest.mark.skipif(not radix_tree.HAS_CEXT, reason="C helper not built")
def test_tree_with_and_without_c_helper_agree():
    def run():
        rng = random.Random(3)
        log = []
        for ps in (1, 4):
            log += run_one(rng, ps)
        return log

    def run_one(rng, ps):
        t, alloc, log = RadixCache(ps), SlotAllocator(8192, ps), []
        for _ in range(400):
            toks = [rng.randrange(4) for _ in range(rng.randrange(1, 30))]
            ns = rng.choice([None, "b"])
            if rng.random() < 0.5:
                slots = alloc.alloc(-(-len(toks) // ps) * ps)
                p = t.insert(toks, slots[: len(toks)], namespace=ns)
                alloc.free(slots[:p])
                alloc.free(slots[len(toks) - len(toks) % ps :])
                log.append(p)
            elif rng.random() < 0.8:
                r = t.match_prefix(toks, namespace=ns)
                log.append((r.length, r.slots.tolist(), r.node.uid - t.root.uid))
            else:
                freed = t.evict(rng.randrange(1, 20))
                alloc.free(freed)
                log.append(freed.tolist())
        t.check_integrity()
        return log

    with_c = run()
    with token_keys.use_python_path():
        assert token_keys.match_walk is token_keys.match_walk_py
        with_py = run()
    assert token_keys.match_walk is not token_keys.match_walk_py
    assert with_py == with_c


def test_package_works_without_the_c_helper():
    import os
    import subprocess
    import sys

    code = (
        "import torch; from radixkv.cache import RadixCache, token_keys as k; "
        "assert not k.HAS_CEXT and k.common_prefix_len is k.common_prefix_len_py; "
        "assert k.pack_int32 is k.pack_int32_py and k.match_walk is k.match_walk_py; "
        "t = RadixCache(); t.insert([1, 2, 3], torch.arange(3)); "
        "m = t.match_prefix([1, 2, 9]); assert (m.length, m.slots.tolist()) == (2, [0, 1]); "
        "t.check_integrity(); print('ok')"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, RADIXKV_NO_CEXT="1", PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_containers_and_partial_eviction_without_torch_and_without_the_c_helper():
    import os
    import subprocess
    import sys

    code = """
import sys
sys.modules["torch"] = None
from array import array
import numpy as np
from radixkv.cache import RadixCache, SlotAllocator, token_keys as k
assert not k.HAS_CEXT
base = list(range(100, 164))
for ps in (1, 4):
    got = []
    for q in (base, tuple(base), array("i", base), array("q", base), np.array(base, dtype=np.int32),
              np.array(base), memoryview(array("q", base)), np.array(base, dtype=np.uint16)):
        a, t = SlotAllocator(128, ps), RadixCache(ps)
        assert t.insert(q, a.alloc(64)) == 0
        m = t.match_prefix(q[:50])
        freed = t.evict(5)
        got.append((m.length, m.slots.tolist(), sorted(freed.tolist()), t.total_size()))
        t.check_integrity()
    assert all(g == got[0] for g in got), got
    assert got[0][2] == list(range(64 - (5 + ps - 1) // ps * ps, 64)) and got[0][3] == 64 - len(got[0][2])
try:
    RadixCache().match_prefix(b"1234")
except ValueError as e:
    assert "raw bytes" in str(e)
else:
    raise AssertionError("bytes accepted")
print("ok")
"""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, RADIXKV_NO_CEXT="1", PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_unlocked_older_leaf_goes_before_newer_leaves():
    t = RadixCache()
    t.insert([1, 1], S(0, 1))
    r = t.match_prefix([1, 1])
    t.inc_lock_ref(r.node)
    t.insert([2, 2], S(2, 3))
    t.insert([3, 3], S(4, 5))
    t.dec_lock_ref(r.node)  # [1, 1] is evictable again, with its older access time
    assert t.evict(2).tolist() == [0, 1]
    t.match_prefix([2, 2])
    assert t.evict(2).tolist() == [4, 5]
    assert t.evict(2).tolist() == [2, 3]


@pytest.mark.parametrize("page_size", [1, 2])
def test_every_eviction_takes_a_least_recently_used_leaf(page_size):
    """Checks each evict(1) against a full scan of the evictable leaves' access times."""
    rng = random.Random(11 + page_size)
    t, alloc = RadixCache(page_size), SlotAllocator(1 << 14, page_size)
    locks = []
    for step in range(1500):
        toks = [rng.randrange(3) for _ in range(rng.randrange(1, 16))]
        op = rng.random()
        if op < 0.35:
            slots = alloc.alloc(-(-len(toks) // page_size) * page_size)
            p = t.insert(toks, slots[: len(toks)])
            n = len(toks) - len(toks) % page_size
            alloc.free(slots[:p])
            alloc.free(slots[n:])
        elif op < 0.6:
            t.match_prefix(toks)
        elif op < 0.7:
            r = t.match_prefix(toks)
            if r.length:
                t.inc_lock_ref(r.node)
                locks.append(r.node)
        elif op < 0.8 and locks:
            t.dec_lock_ref(locks.pop(rng.randrange(len(locks))))
        else:
            leaves = [n for n in t._iter_nodes() if n.key and not n.children and n.lock_ref == 0]
            freed = t.evict(1)
            alloc.free(freed)
            if not leaves:
                assert freed.tolist() == []
                continue
            oldest = min(n.last_access for n in leaves)
            assert freed.tolist() in [n.slots()[-page_size:] for n in leaves if n.last_access == oldest]
        if step % 50 == 0:
            t.check_integrity()
    t.check_integrity()


def _walk_impls():
    impls = [(token_keys.match_walk_py, token_keys.insert_walk_py)]
    if radix_tree.HAS_CEXT:
        from radixkv.cache import _cprefix

        impls.append((_cprefix.match_walk, _cprefix.insert_walk))
    return impls


@pytest.mark.parametrize("page_size", [1, 2])
def test_walks_return_the_matched_path_slots_and_tail(page_size):
    """match_walk / insert_walk (C and Python, list and int32-bytes queries) against the
    definition: the deepest fully matched node, the matched length, the slots of the matched
    tokens (split edge's first m included; slots were inserted as arange, so slot == insertion
    position), and for an insert the new leaf's key and slots."""
    rng = random.Random(9)
    t = RadixCache(page_size)
    oracle = {}  # (prefix up to the end of position i's page, i) -> slot of position i
    slot = 0
    for _ in range(60):
        toks = [rng.randrange(3) for _ in range(rng.randrange(1, 20))]
        n = len(toks) - len(toks) % page_size
        p = t.insert(toks, torch.arange(slot, slot + len(toks)))
        for i in range(p, n):
            oracle[tuple(toks[: (i // page_size + 1) * page_size]), i] = slot + i
        slot += len(toks)
    ns_root = t.root.children[None]
    for _ in range(300):
        toks = [rng.randrange(3) for _ in range(rng.randrange(0, 24))]
        n = len(toks) - len(toks) % page_size
        kb = token_keys.pack_int32_py(toks)
        # the definition: longest cached prefix, floored to pages
        length = max(
            i
            for i in range(0, n + 1, page_size)
            if i == 0 or (tuple(toks[: (i - 1) // page_size * page_size + page_size]), i - 1) in oracle
        )
        results = []
        for match_walk, insert_walk in _walk_impls():
            for q in (toks, tuple(toks), kb):
                node, pos, buf, child, m = match_walk(ns_root, q, page_size, 7)
                if child is None and pos and node.parent is ns_root:  # one edge: its own bytes
                    assert buf is node.value
                elif child is not None and pos == 0:  # the split's upper value, made once
                    assert type(buf) is bytes and buf == child.value[: m * 8]
                else:
                    assert type(buf) is (bytearray if pos else bytes)
                assert pos + m == length and (child is None) == (m == 0)
                got = np.frombuffer(bytes(buf), dtype=np.int64).tolist()
                assert got == [oracle[tuple(toks[: (i // page_size + 1) * page_size]), i] for i in range(length)]
                src = torch.arange(100, 100 + len(toks))
                addr = token_keys.slot_tensor_address(src)
                w = insert_walk(ns_root, q, page_size, 7, addr)
                assert w[:4] == (node, pos, child, m)
                assert w[4] == kb[length * 4 : n * 4]
                assert np.frombuffer(w[5], dtype=np.int64).tolist() == list(range(100 + length, 100 + n))
                assert insert_walk(ns_root, q, page_size, 7, -1)[5] is None
                results.append((node, pos, child, m))
        assert all(r == results[0] for r in results)


def test_walks_validate_every_token_before_changing_anything():
    t = RadixCache(1)
    t.insert([1, 2, 3, 4], torch.arange(4))
    ns_root = t.root.children[None]
    leaf = t.match_prefix([1, 2, 3, 4]).node
    before = leaf.last_access
    for match_walk, insert_walk in _walk_impls():
        for bad in ([1, 2, 3, 4, 2**31], [1, 2, 9, 2**40], [2**31, 1]):
            with pytest.raises(ValueError):
                match_walk(ns_root, bad, 1, 99)
            with pytest.raises(ValueError):
                insert_walk(ns_root, bad, 1, 99, -1)
        with pytest.raises(TypeError):
            match_walk(ns_root, [1, 2, 3, 4, 1.5], 1, 99)
        assert leaf.last_access == before and ns_root.last_access == before
    with pytest.raises(ValueError):
        t.match_prefix([1, 2, 3, 4, 2**31])
    with pytest.raises(ValueError):
        t.insert([1, 2, 9, 2**31], torch.arange(10, 14))
    with pytest.raises(ValueError):
        t.match_prefix([2**31], namespace="unseen")
    t.check_integrity()
    assert t.total_size() == 4 and "unseen" not in t.root.children
    if radix_tree.HAS_CEXT:
        from radixkv.cache import _cprefix

        with pytest.raises(ValueError, match="page_size"):
            _cprefix.match_walk(ns_root, [1], 0, 0)
        with pytest.raises(TypeError):
            _cprefix.match_walk(ns_root, {1, 2}, 1, 0)
        with pytest.raises(ValueError):
            _cprefix.match_walk(ns_root, b"\0" * 5, 1, 0)
        with pytest.raises(ValueError, match="null"):
            _cprefix.insert_walk(ns_root, [7], 1, 0, 0)


def test_insert_reads_slots_from_any_valid_input():
    """The contiguous-tensor fast path and the validating path (strided, int32, list, numpy,
    offset view) store the same slots: the tree keeps its own 4, takes the rest."""
    toks = list(range(10))
    for slots in (
        torch.arange(200, 210),
        torch.arange(200, 220)[::2],
        torch.arange(200, 210, dtype=torch.int32),
        list(range(200, 210)),
        np.arange(200, 210),
        torch.arange(198, 210)[2:],
    ):
        t = RadixCache()
        assert t.insert(toks[:4], torch.arange(100, 104)) == 0
        assert t.insert(toks, slots) == 4
        r = t.match_prefix(toks)
        assert r.slots.dtype == torch.int64 and r.length == 10
        assert r.slots.tolist() == [100, 101, 102, 103] + [int(s) for s in list(slots)[4:]]
        t.check_integrity()


def test_list_items_that_are_not_ints_are_converted_safely():
    """The C walk never runs an item's __index__ while it reads the list in place (that code
    could change the list under it); such lists are converted in Python first. An __index__ that
    empties the list mid-read must not crash, and an insert whose tokens change length while
    being read is refused with the tree unchanged."""
    t = RadixCache(1)
    t.insert(list(range(100)), torch.arange(100))
    assert t.match_prefix([np.int64(0), np.int32(1), 2, True]).length == 3  # True == 1 != 3
    assert t.insert(np.arange(5, dtype=np.int64).tolist() + [np.int16(7)], torch.arange(200, 206)) == 5
    lst = []

    class ClearsTheList:
        def __index__(self):
            lst.clear()
            return 5

    before = (t.total_size(), t.pretty_print())
    lst.extend(list(range(50)) + [ClearsTheList()] + list(range(1000, 1300)))
    with pytest.raises(ValueError, match="changed length"):
        t.match_prefix(lst)
    lst[:] = list(range(50)) + [ClearsTheList()] + list(range(1000, 1300))
    with pytest.raises(ValueError, match="changed length"):
        t.insert(lst, torch.arange(500, 500 + len(lst)))
    assert (t.total_size(), t.pretty_print()) == before
    for bad, pos in (([1, 2.5], 1), ([None], 0), (["a"], 0)):
        with pytest.raises(TypeError, match=f"position {pos}"):
            t.match_prefix(bad)
    t.check_integrity()


def test_foreign_node_bad_evict_arguments_and_slot_ranges_raise_cleanly():
    a, b = RadixCache(), RadixCache()
    a.insert([1, 2, 3], S(0, 1, 2))
    b.insert([1, 2, 3], S(5, 6, 7))
    foreign = b.match_prefix([1, 2, 3]).node
    with pytest.raises(ValueError, match="another cache"):
        a.inc_lock_ref(foreign)
    with pytest.raises(ValueError, match="another cache"):
        a.dec_lock_ref(foreign)
    a.check_integrity()
    assert a.protected_size() == 0
    for bad in (None, "3", -1, True, 1.5):
        with pytest.raises(ValueError, match="num_tokens"):
            a.evict(bad)
    assert a.evict(np.int64(3)).tolist() == [0, 1, 2]
    for bad in ([2**63], [2**63, -1], np.array([2**63], dtype=np.uint64)):
        with pytest.raises(ValueError, match="int64"):
            a.insert([5], bad)
    assert a.total_size() == 0
    a.check_integrity()


def test_pretty_print_any_depth_and_non_contiguous_slots():
    t = RadixCache()
    for i in range(1, 1200):  # a chain of 1199 nodes, deeper than Python's recursion limit
        t.insert(list(range(i)), torch.arange(i))
    assert len(t.pretty_print().splitlines()) == 2 + 1199
    u = RadixCache()
    u.insert([1, 2, 3, 4], torch.tensor([30, 10, 20, 40]))
    assert "[1 2 3 4] len=4 slots=[30 10 20 40]" in u.pretty_print()


def _bytes_address(b: bytes) -> int:
    return ctypes.cast(ctypes.c_char_p(b), ctypes.c_void_p).value


@pytest.mark.parametrize("python_path", [False, True])
@pytest.mark.parametrize("page_size", [1, 4])
def test_match_slots_share_one_edge_and_never_change_after_later_calls(page_size, python_path):
    """A match held by one edge is a view of that node's slot bytes (no copy); one spanning
    edges is a fresh buffer. Either way a held ``slots`` keeps its values after later splits
    (by a match and by an insert), a partial eviction that splits its edge, a full eviction,
    new inserts reusing the freed slots, and reset."""
    ps = page_size
    with token_keys.use_python_path() if python_path else contextlib.nullcontext():
        t = RadixCache(ps)
        alloc = SlotAllocator(64, ps)
        toks = list(range(100, 132))
        t.insert(toks, alloc.alloc(32))
        whole = t.match_prefix(toks)
        want = whole.slots.tolist()
        assert len(want) == 32 and whole.node.parent is t.root.children[None]
        assert whole.slots.data_ptr() == _bytes_address(whole.node.value)  # shared, not copied
        head = t.match_prefix(toks[:16] + [7] * 4)  # splits the edge after 16 tokens
        assert head.slots.tolist() == want[:16] and head.node.value is not whole.node.value
        assert head.slots.data_ptr() == _bytes_address(head.node.value)  # the split's new upper
        dup = alloc.alloc(32)
        assert t.insert(toks[:24] + [5] * 8, dup) == 24  # splits the lower part at 24
        alloc.free(dup[:24])
        deep = t.match_prefix(toks)  # three edges now: a fresh buffer
        assert deep.slots.tolist() == want and deep.node.parent.parent.parent is t.root.children[None]
        views = [(whole.slots, want), (head.slots, want[:16]), (deep.slots, want)]
        t.match_prefix(toks[:24] + [5] * 8)  # now the views' last edge is the LRU leaf
        freed = t.evict(ps)  # frees its tail page, splitting it
        assert freed.tolist() == want[-ps:] and t.total_size() == 40 - ps
        alloc.free(freed)
        for v, w in views:
            assert v.tolist() == w
        alloc.free(t.evict(t.total_size()))
        assert t.total_size() == 0
        t.insert(list(range(200, 264)), alloc.alloc(64))  # every slot again, the views' too
        again = t.match_prefix(list(range(200, 264)))
        assert sorted(again.slots.tolist()) == list(range(64))
        alloc.free(t.reset())
        for v, w in views:
            assert v.tolist() == w
        t.check_integrity()
