"""HashBlockCache (vLLM-style chained block hashes) and NoPrefixCache: exact hit lengths, LRU
eviction order, orphans, and the no-leak invariants with the real SlotAllocator."""

from __future__ import annotations

import hashlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixkv.cache import HashBlockCache, NoPrefixCache
from radixkv.cache.base import PrefixCache
from radixkv.memory.allocator import SlotAllocator
from radixkv.namespace import Namespace

pytestmark = pytest.mark.timeout(120)


class Harness:
    """Drives a cache the way the engine does, and checks slot conservation after every step:
    every slot is exactly one of {free in the allocator, held by the cache, held by a request}.
    ``content[slot]`` records the token prefix whose last token's KV was written there, so every
    matched slot can be checked against the prompt."""

    def __init__(self, cache, num_slots: int):
        self.cache = cache
        self.alloc = SlotAllocator(num_slots, page_size=cache.page_size)
        self.num_slots = num_slots
        self.content: dict[int, tuple] = {}

    def check(self, held_by_requests: int = 0) -> None:
        self.cache.check_integrity()
        assert self.alloc.available_size() + self.cache.total_size() + held_by_requests == self.num_slots
        assert self.cache.evictable_size() + self.cache.protected_size() == self.cache.total_size()

    def match(self, tokens, ns=None):
        m = self.cache.match_prefix(tokens, ns)
        assert m.length == len(m.slots) and m.length % self.cache.page_size == 0
        assert m.slots.dtype == torch.int64
        for i, s in enumerate(m.slots.tolist()):
            assert self.content[s] == (ns, tuple(tokens[: i + 1]))
        return m

    def run(self, tokens, ns=None) -> int:
        """One request: match, lock, allocate (evicting if needed), write, insert, free, unlock.
        Returns the matched (cached) token count, or -1 if it could not get memory."""
        ps = self.cache.page_size
        m = self.match(tokens, ns)
        self.cache.inc_lock_ref(m.node)
        need = -(-(len(tokens) - m.length) // ps) * ps
        if self.alloc.available_size() < need:
            self.alloc.free(self.cache.evict(need - self.alloc.available_size()))
        new = self.alloc.alloc(need) if need else torch.empty(0, dtype=torch.int64)
        if new is None:
            self.cache.dec_lock_ref(m.node)
            self.check()
            return -1
        self.check(held_by_requests=need)
        slots = torch.cat([m.slots, new])
        for i in range(m.length, len(tokens)):
            self.content[int(slots[i])] = (ns, tuple(tokens[: i + 1]))
        n = self.cache.insert(tokens, slots[: len(tokens)], ns)
        assert n >= m.length
        aligned = len(tokens) // ps * ps
        if n > m.length:
            self.alloc.free(slots[m.length : n])
        if len(slots) > aligned and need:
            self.alloc.free(slots[max(aligned, m.length) :])
        self.cache.dec_lock_ref(m.node)
        self.check()
        return m.length


def toks(*runs):
    out = []
    for start, n in runs:
        out.extend(range(start, start + n))
    return out


def test_implements_protocol():
    assert isinstance(HashBlockCache(16), PrefixCache)
    assert isinstance(NoPrefixCache(16), PrefixCache)


@pytest.mark.parametrize("algo", ["sha256", "builtin"])
def test_exact_hit_lengths_shared_prefix_and_partial_blocks(algo):
    h = Harness(HashBlockCache(4, hash_algo=algo), 64)
    a = toks((100, 10))  # 2 full blocks + 2-token tail
    assert h.run(a) == 0
    assert h.cache.total_size() == 8 and h.cache.evictable_size() == 8
    assert h.match(a).length == 8
    assert h.match(a[:7]).length == 4  # partial second block: not shared
    assert h.match(a[:3]).length == 0  # shorter than a block
    assert h.match([999] + a[1:]).length == 0  # first token differs
    assert h.match(a[:5] + [999] + a[6:]).length == 4
    assert h.run(a + [7, 8]) == 8  # 12 tokens = 3 blocks; the third is new
    assert h.cache.total_size() == 12
    assert h.match(a + [7, 8, 9]).length == 12


def test_branching_prompts_share_only_whole_blocks():
    h = Harness(HashBlockCache(16), 256)
    sys_prompt = toks((1000, 20))
    q1, q2 = toks((5000, 13)), toks((6000, 29))
    assert h.run(sys_prompt + q1) == 0
    # the radix tree would reuse all 20 shared tokens; chained blocks reuse only the first 16
    assert h.run(sys_prompt + q2) == 16
    # [shared 16] + a's [4 sys + 12 q1] + b's [4 sys + 12 q2] and [16 q2]; tails are not cached
    assert h.cache.total_size() == 16 + 16 + 32
    assert h.match(sys_prompt + q2).length == 48


def test_namespace_isolation():
    h = Harness(HashBlockCache(4), 64)
    a = toks((1, 12))
    h.run(a, ns="tenant-a")
    assert h.match(a, "tenant-b").length == 0
    assert h.match(a, None).length == 0
    assert h.match(a, "tenant-a").length == 12
    assert h.run(a, ns="tenant-b") == 0
    assert h.cache.total_size() == 24


def test_sha256_keys_are_the_documented_chain():
    c = HashBlockCache(2)
    keys = c.block_keys([5, 6, 7, 8, 9], namespace="ns")
    extra = b"\x01NNS\x00\x00\x00\x02ns"  # Namespace(extra_key="ns").to_bytes(): no salt, no tenant
    assert Namespace.of("ns").to_bytes() == extra
    k0 = hashlib.sha256(b"\x00" * 32 + torch.tensor([5, 6]).numpy().astype("<i8").tobytes() + extra).digest()
    k1 = hashlib.sha256(k0 + torch.tensor([7, 8]).numpy().astype("<i8").tobytes() + extra).digest()
    assert keys == [k0, k1]
    assert HashBlockCache(2).block_keys(torch.tensor([5, 6, 7, 8]), "ns") == [k0, k1]
    assert c.block_keys([5, 6, 7, 8], Namespace(extra_key="ns")) == [k0, k1]  # one namespace, two spellings


def test_insert_returns_leading_cached_and_caller_frees_duplicates():
    c = HashBlockCache(4)
    alloc = SlotAllocator(32, page_size=4)
    t = toks((10, 8))
    s1, s2 = alloc.alloc(8), alloc.alloc(8)
    assert c.insert(t, s1) == 0
    assert c.insert(t, s2) == 8  # both blocks already cached: s2 is all duplicates
    alloc.free(s2)
    assert torch.equal(c.match_prefix(t).slots, s1)
    assert alloc.available_size() + c.total_size() == 32
    assert torch.equal(torch.sort(c.reset()).values, torch.sort(s1).values)
    alloc.free(s1)
    assert alloc.available_size() == 32 and c.total_size() == 0
    c.check_integrity()


def test_locked_blocks_survive_eviction_and_lru_order():
    c = HashBlockCache(2)
    alloc = SlotAllocator(16, page_size=2)
    a, b = [1, 2, 3, 4], [9, 8, 7, 6]
    sa, sb = alloc.alloc(4), alloc.alloc(4)
    c.insert(a, sa)
    c.insert(b, sb)
    ma = c.match_prefix(a)
    c.inc_lock_ref(ma.node)
    assert c.protected_size() == 4 and c.evictable_size() == 4
    freed = c.evict(100)  # only b's blocks are unreferenced
    assert sorted(freed.tolist()) == sorted(sb.tolist())
    alloc.free(freed)
    assert c.match_prefix(b).length == 0 and c.match_prefix(a).length == 4
    c.dec_lock_ref(ma.node)
    # released tail first: evicting one block takes a's second block, leaving its head cached
    first = c.evict(1)
    assert first.tolist() == sa[2:].tolist()
    assert c.match_prefix(a).length == 2
    c.check_integrity()


def test_new_blocks_queue_tail_first_so_eviction_keeps_heads():
    c = HashBlockCache(2)
    alloc = SlotAllocator(16, page_size=2)
    t = [1, 2, 3, 4, 5, 6, 7]  # 3 full blocks + 1-token tail
    s = alloc.alloc(8)
    assert c.insert(t, s[:7]) == 0
    assert c.evictable_size() == 6 and c.protected_size() == 0
    assert c.evict(1).tolist() == s[4:6].tolist()  # the chain's last block goes first
    assert c.match_prefix(t).length == 4
    assert c.evict(1).tolist() == s[2:4].tolist()
    assert c.match_prefix(t).length == 2
    c.check_integrity()


def test_least_recently_freed_evicted_first():
    c = HashBlockCache(1)
    alloc = SlotAllocator(8)
    seqs = [[1], [2], [3]]
    handles = []
    for t in seqs:
        c.insert(t, alloc.alloc(1))
        handles.append(c.match_prefix(t).node)
        c.inc_lock_ref(handles[-1])
    for i in (1, 2, 0):  # release order decides eviction order, not insertion order
        c.dec_lock_ref(handles[i])
    order = [c.match_prefix(seqs[i]).slots.item() for i in (1, 2, 0)]
    assert [c.evict(1).item() for _ in range(3)] == order
    assert c.total_size() == 0 and c.evict(5).numel() == 0


def test_orphaned_blocks_are_unreachable_then_reattached():
    c = HashBlockCache(2)
    h = Harness(c, 16)
    t = [1, 2, 3, 4, 5, 6]
    h.run(t)
    full = c.match_prefix(t)
    blocks = full.node.blocks
    # Release order head-last: lock the whole chain, then the tail two again, release in an
    # order that leaves the head least recently freed.
    c.inc_lock_ref(full.node)
    tail_chain = type(full.node)(blocks[1:])
    c.inc_lock_ref(tail_chain)
    c.dec_lock_ref(full.node)  # head -> ref 0 (queued); tail blocks still ref 1
    c.dec_lock_ref(tail_chain)  # then block3, block2
    freed = c.evict(1)  # interior eviction: the head, although its descendants stay cached
    assert freed.tolist() == full.slots[:2].tolist()
    h.alloc.free(freed)
    h.check()
    assert c.match_prefix(t).length == 0  # walk stops at the first miss
    assert c.total_size() == 4  # the two orphans stay cached (evictable)
    # recomputing only the head re-attaches the orphans (same chained keys)
    assert h.run(t[:2]) == 0
    assert h.match(t).length == 6
    h.check()


def test_insert_after_a_miss_replaces_orphan_without_leak():
    c = HashBlockCache(2)
    h = Harness(c, 16)
    t = [1, 2, 3, 4, 5, 6]
    h.run(t)
    full = c.match_prefix(t)
    blocks = full.node.blocks
    c.inc_lock_ref(full.node)
    tail_chain = type(full.node)(blocks[1:])
    c.inc_lock_ref(tail_chain)
    c.dec_lock_ref(full.node)
    c.dec_lock_ref(tail_chain)
    h.alloc.free(c.evict(1))  # head gone, two orphans left
    old_orphan_slots = full.slots[2:].tolist()
    assert h.run(t) == 0  # recomputes all three blocks; the orphans are replaced
    assert c.total_size() == 10  # 3 new blocks + 2 retired orphans until evicted
    m = h.match(t)
    assert m.length == 6 and not set(m.slots.tolist()) & set(old_orphan_slots)
    assert sorted(c.evict(4).tolist()) == sorted(old_orphan_slots)  # retired ones go first
    h.check(held_by_requests=4)


def test_no_prefix_cache_frees_everything():
    for ps in (1, 4):
        h = Harness(NoPrefixCache(ps), 32)
        for t in ([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6, 7], [1, 2, 3]):
            assert h.run(t) == 0
            assert h.alloc.available_size() == 32
        assert h.cache.match_prefix([1, 2, 3, 4]).length == 0
        assert h.cache.total_size() == 0 and h.cache.evict(8).numel() == 0


def test_bad_input_raises_value_error():
    with pytest.raises(ValueError, match="page_size"):
        HashBlockCache(0)
    with pytest.raises(ValueError, match="hash_algo"):
        HashBlockCache(4, hash_algo="md5")
    c = HashBlockCache(4)
    with pytest.raises(ValueError, match="len\\(slots\\)"):
        c.insert([1, 2, 3, 4], torch.arange(3))
    with pytest.raises(ValueError, match="one page"):
        c.insert([1, 2, 3, 4], torch.tensor([0, 1, 3, 2]))
    with pytest.raises(ValueError, match="num_tokens"):
        c.evict(-1)
    with pytest.raises(ValueError, match="tokens"):
        c.match_prefix(torch.zeros(2, 2, dtype=torch.int64))
    c.insert([1, 2, 3, 4], torch.arange(4))
    m = c.match_prefix([1, 2, 3, 4])
    with pytest.raises(ValueError, match="lock_ref"):
        c.dec_lock_ref(m.node)
    c.inc_lock_ref(m.node)
    with pytest.raises(RuntimeError, match="locked"):
        c.reset()
    with pytest.raises(ValueError, match="page_size"):
        NoPrefixCache(0)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    page_size=st.sampled_from([1, 2, 4]),
    capacity_pages=st.integers(6, 24),
    reqs=st.lists(
        st.tuples(
            st.integers(0, 3),
            st.integers(0, 2),
            st.lists(st.integers(0, 2), min_size=1, max_size=14),
            st.sampled_from([None, "x"]),
        ),
        min_size=1,
        max_size=25,
    ),
)
def test_random_requests_keep_invariants(page_size, capacity_pages, reqs):
    """Random requests over a few shared prefixes under memory pressure: every matched slot holds
    the right prefix, slots are conserved, and integrity holds after every request."""
    prefixes = [[7] * 5, [7] * 3 + [8] * 6, [9, 9, 1, 2, 3, 4, 5, 6, 7, 8], []]
    h = Harness(HashBlockCache(page_size), capacity_pages * page_size)
    for pi, rep, suffix, ns in reqs:
        t = prefixes[pi] * (rep + 1) + suffix
        got = h.run(t, ns)
        if got >= 0:
            assert h.match(t, ns).length == len(t) // page_size * page_size
    h.alloc.free(h.cache.reset())
    assert h.alloc.available_size() == h.num_slots


@pytest.mark.parametrize("algo", ["sha256", "builtin"])
def test_a_block_key_chains_its_parent(algo):
    """The same block after a different first block is another block: both sequences stay
    cached whole (4 blocks), each matching its own slots (the Harness checks every slot's
    content), and equal blocks under different parents get different keys."""
    h = Harness(HashBlockCache(4, hash_algo=algo), 64)
    a, b = toks((100, 4), (500, 4)), toks((200, 4), (500, 4))
    assert h.run(a) == 0 and h.run(b) == 0
    assert h.cache.total_size() == 16 and h.cache.evictable_size() == 16
    assert h.match(a).length == 8 and h.match(b).length == 8
    ka, kb = h.cache.block_keys(a), h.cache.block_keys(b)
    assert len(ka) == len(kb) == 2 and ka[0] != kb[0] and ka[1] != kb[1]
    assert len(set(ka) | set(kb)) == 4
