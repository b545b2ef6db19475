"""Stateful property test: RadixCache + SlotAllocator against a brute-force oracle.

Hypothesis drives random inserts, matches, lock/unlock, evictions, resets and slot holds over
short sequences from a 3-token alphabet (so edges branch and split all the time), in two
namespaces, at page_size 1 and 4 (LRU, the default policy), at page_size 2 under the LFU
policy and at page_size 4 under reuse-odds; at page_size 4 over an engine's own tree,
allocator and bfloat16 KV pool (tiny random Llama), whose cached pages' K/V must read back intact;
and at page_size 2 with tenants and soft quotas (tenant "a" over two namespaces with a quota, "b"
with one, the shared default without; small evictions interleaved so that both phases run in one
call). The *_derived rules reuse a prefix of an earlier insert plus a random tail, so that long
edges are matched, extended and split deep inside, not only near the root. Every match and
insert hands the tree its tokens in a container drawn from CONTAINERS (list, tuple, array of
i/l/q, numpy int32/int64, memoryviews, int32/int64 tensors), so every container type meets every
tree shape without multiplying the runs.

The oracle is page-level: a dict per namespace from every cached page-aligned prefix (a tuple
of tokens) to the slots of its last page, the logical time of the last match / insert that
walked through that page and the number of such walks. Eviction is checked exactly: the oracle
frees, one page at a time, the evictable leaf page (cached, not on a locked prefix, no cached
page below it) that the policy ranks lowest (LRU: oldest access; LFU: fewest walks, then
oldest), until ``ceil(num / page_size)`` pages are gone or none is left, and the tree must free
exactly those slots: partial eviction (a leaf's tail pages go, its head stays) included. With
quotas the oracle first frees, page by page while some tenant holds more tokens than its quota
(every page of its namespaces, locked ones included), the least recently walked evictable leaf
page of such tenants, then goes on as above.
(Reuse-odds learns its order from the run, so for it the oracle checks what every policy must
do: exactly that many slots, never a locked page, the cache prefix-closed afterwards.) (Two
evictable leaf pages never share an access time: the pages one call walks through lie on one
path, so at most one of them is a leaf.)

After every step: check_integrity(); sizes are non-negative and equal the oracle's, and so do
the tokens per tenant (``tenant_sizes()``); the
protected size equals the number of distinct locked prefix pages; allocator available + tree
evictable + tree protected + slots held by the test == capacity (so no slot leaks and, with the
allocator's double-free check, none is owned twice); the slots of the last 8 non-empty matches,
held on to, still hold the values they had when returned (``MatchResult.slots`` may be a
read-only view of an edge's slot bytes, which later splits, inserts, evictions and resets must
leave untouched).

CI runs MAX_EXAMPLES = 150 examples of up to STEPS = 40 rule steps for each of the five machines
(up to 30,000 steps in all; ~40 s of CPU, 1-3 min wall on the busy 2-core dev machine),
derandomized so every run checks the same cases. RADIXKV_SOAK=1 runs 20,000 examples of up to 100 steps each
(~330x more; hours) with fresh random seeds each run.
"""

import os
import zlib
from array import array

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixkv.cache import RadixCache, SlotAllocator
from radixkv.cache.tenants import tenant_of
from radixkv.namespace import Namespace

SOAK = os.environ.get("RADIXKV_SOAK") == "1"
MAX_EXAMPLES = 20_000 if SOAK else 150
STEPS = 100 if SOAK else 40
CAPACITY = 96  # slots; small so that inserts hit "no room" and must evict
NAMESPACES = [None, "lora-b", None, "lora-b"]  # drawn by index (ns_st); the tenant machine has its own
TENANT_NAMESPACES = [Namespace(tenant="a"), Namespace(tenant="a", salt="s"), Namespace(tenant="b"), None]
QUOTAS = {"a": 6, "b": 10}  # tenant "a" spans two namespaces; None (no tenant) has no quota

tokens_st = st.lists(st.integers(0, 2), min_size=0, max_size=14)
tail_st = st.lists(st.integers(0, 2), min_size=0, max_size=6)
ns_st = st.integers(0, 3)
CONTAINERS = {
    "list": list,
    "tuple": tuple,
    "array_i": lambda t: array("i", t),
    "array_l": lambda t: array("l", t),
    "array_q": lambda t: array("q", t),
    "numpy_int32": lambda t: np.array(t, dtype=np.int32),
    "numpy_int64": lambda t: np.array(t, dtype=np.int64),
    "memoryview_q": lambda t: memoryview(array("q", t)),
    "memoryview_i": lambda t: memoryview(np.array(t, dtype=np.int32)),
    "tensor_int64": lambda t: torch.tensor(t, dtype=torch.int64),
    "tensor_int32": lambda t: torch.tensor(t, dtype=torch.int32),
}
box_st = st.sampled_from(sorted(CONTAINERS))


class CacheMachine(RuleBasedStateMachine):
    page_size = 1
    policy = "lru"
    namespaces = NAMESPACES
    quotas = None

    @initialize()
    def setup(self):
        self.tree = RadixCache(self.page_size, eviction_policy=self.policy, tenant_quotas=self.quotas)
        self.alloc = SlotAllocator(CAPACITY, self.page_size)
        self.spaces = list(dict.fromkeys(self.namespaces))  # the distinct namespaces
        self.cached = {ns: {} for ns in self.spaces}  # prefix tuple -> slots of its last page
        self.touched = {ns: {} for ns in self.spaces}  # prefix tuple -> (last walk time, walks)
        self.clock = 0
        self.locks = []  # (namespace, locked prefix tuple, node)
        self.held = []  # slot tensors the test holds (like running requests)
        self.seen = []  # (namespace, tokens) of past inserts, to derive long shared prefixes
        self.views = []  # (MatchResult.slots, its values then) of recent matches, held on to

    # ---------------------------------------------------------------- oracle helpers

    def oracle_match(self, ns, toks):
        ps = self.page_size
        n = len(toks) - len(toks) % ps
        slots = []
        for end in range(ps, n + 1, ps):
            page = self.cached[ns].get(tuple(toks[:end]))
            if page is None:
                break
            slots.extend(page)
        return slots

    def touch(self, ns, toks, length):
        """The oracle's record of a match / insert walking through the first ``length`` tokens."""
        self.clock += 1
        for end in range(self.page_size, length + 1, self.page_size):
            key = tuple(toks[:end])
            self.touched[ns][key] = (self.clock, self.touched[ns].get(key, (0, 0))[1] + 1)

    def ns(self, i):
        """The namespace drawn as index ``i``."""
        return self.namespaces[i]

    def rank(self, ns, key):
        t, walks = self.touched[ns][key]
        return t if self.policy == "lru" else (walks, t)

    def tenant_tokens(self, pages):
        """Tokens per tenant of the cached ``(namespace, prefix)`` pages ``pages``."""
        out = {}
        for ns, _ in pages:
            out[tenant_of(ns)] = out.get(tenant_of(ns), 0) + self.page_size
        return out

    def oracle_evict(self, num):
        """The slots the tree must free for ``evict(num)``, page by page (see module docstring):
        while a tenant holds more than its quota, the least recently walked evictable leaf page of
        such tenants; then the one the policy ranks lowest."""
        ps = self.page_size
        locked = {(ns, p[:end]) for ns, p, _ in self.locks for end in range(ps, len(p) + 1, ps)}
        left = {(ns, k) for ns in self.spaces for k in self.cached[ns]}
        freed = []
        while len(freed) < num:
            inner = {(ns, k[:-ps]) for ns, k in left}
            leaves = [(self.rank(ns, k), ns, k) for ns, k in left if (ns, k) not in inner | locked]
            if not leaves:
                break
            held = self.tenant_tokens(left)
            over = {t for t, q in (self.quotas or {}).items() if held.get(t, 0) > q}
            first = [(self.touched[ns][k][0], ns, k) for _, ns, k in leaves if tenant_of(ns) in over]
            ranks = sorted(r for r, _, _ in first or leaves)
            assert len(ranks) < 2 or ranks[0] != ranks[1], "two evictable leaf pages tie"
            _, ns, k = min(first or leaves, key=lambda x: x[0])
            left.discard((ns, k))
            freed.extend(self.cached[ns][k])
        return freed

    def alloc_with_eviction(self, n):
        s = self.alloc.alloc(n)
        if s is None:
            self.do_evict(n - self.alloc.available_size())
            s = self.alloc.alloc(n)
        return s

    def do_evict(self, num):
        ps = self.page_size
        evictable = self.tree.evictable_size()
        expected = self.oracle_evict(num) if self.policy in ("lru", "lfu") else None
        freed = self.tree.evict(num)
        got = freed.tolist()
        assert len(got) == len(set(got))
        assert len(got) == min(-(-num // ps) * ps, evictable)  # exactly what is needed, in pages
        if expected is not None:
            assert sorted(got) == sorted(expected)
        self.alloc.free(freed)  # raises on a double free or a slot never allocated
        gone = set(got)
        for ns in self.spaces:
            for key in [k for k, page in self.cached[ns].items() if page[0] in gone]:
                assert set(self.cached[ns][key]) <= gone  # whole pages go
                del self.cached[ns][key]
                del self.touched[ns][key]
            for key in self.cached[ns]:  # what remains is still prefix-closed
                assert len(key) == ps or key[:-ps] in self.cached[ns]
        for ns, prefix, _ in self.locks:  # a protected token is never freed
            for end in range(ps, len(prefix) + 1, ps):
                assert prefix[:end] in self.cached[ns]

    # ---------------------------------------------------------------- rules

    def derived(self, i, cut, tail):
        """A past insert's first ``cut`` tokens plus ``tail``: a query sharing a long prefix."""
        ns, toks = self.seen[i % len(self.seen)]
        return ns, toks[:cut] + tail

    @rule(toks=tokens_st, ns=ns_st, box=box_st)
    def insert(self, toks, ns, box):
        self.do_insert(toks, self.ns(ns), box)

    @precondition(lambda self: self.seen)
    @rule(i=st.integers(0, 1000), cut=st.integers(0, 20), tail=tail_st, box=box_st)
    def insert_derived(self, i, cut, tail, box):
        ns, toks = self.derived(i, cut, tail)
        self.do_insert(toks, ns, box)

    @precondition(lambda self: self.seen)
    @rule(i=st.integers(0, 1000), cut=st.integers(0, 20), tail=tail_st, box=box_st)
    def match_derived(self, i, cut, tail, box):
        ns, toks = self.derived(i, cut, tail)
        self.match(toks, ns, box)

    @precondition(lambda self: self.seen)
    @rule(i=st.integers(0, 1000), cut=st.integers(0, 20), tail=tail_st)
    def lock_derived(self, i, cut, tail):
        ns, toks = self.derived(i, cut, tail)
        self.lock(toks, ns)

    def do_insert(self, toks, ns, box="list"):
        ps = self.page_size
        n_alloc = -(-len(toks) // ps) * ps
        slots = self.alloc_with_eviction(n_alloc)
        if slots is None:
            return
        expected_p = len(self.oracle_match(ns, toks))
        p = self.tree.insert(CONTAINERS[box](toks), slots[: len(toks)], namespace=ns)
        assert p == expected_p
        n = len(toks) - len(toks) % ps
        if n:
            self.touch(ns, toks, n)
        for end in range(p + ps, n + 1, ps):
            self.cached[ns][tuple(toks[:end])] = slots[end - ps : end].tolist()
        # The caller frees its duplicates and its unaligned tail (whole pages).
        self.alloc.free(slots[:p])
        self.alloc.free(slots[n:])
        if toks:
            self.seen.append((ns, toks))

    @rule(toks=tokens_st, ns=ns_st, box=box_st)
    def match_drawn(self, toks, ns, box):
        self.match(toks, self.ns(ns), box)

    def match(self, toks, ns, box="list"):
        r = self.tree.match_prefix(CONTAINERS[box](toks), namespace=ns)
        expected = self.oracle_match(ns, toks)
        assert r.length == len(expected) == len(r.slots)
        assert r.slots.tolist() == expected
        self.touch(ns, toks, r.length)
        if expected:  # a held result must not change, whatever the tree does next
            self.views = self.views[-7:] + [(r.slots, expected)]

    @rule(toks=tokens_st, ns=ns_st)
    def lock_drawn(self, toks, ns):
        self.lock(toks, self.ns(ns))

    def lock(self, toks, ns):
        r = self.tree.match_prefix(toks, namespace=ns)
        self.touch(ns, toks, r.length)
        if r.length:
            self.tree.inc_lock_ref(r.node)
            self.locks.append((ns, tuple(toks[: r.length]), r.node))

    @precondition(lambda self: self.locks)
    @rule(i=st.integers(0, 1000))
    def unlock(self, i):
        _, _, node = self.locks.pop(i % len(self.locks))
        self.tree.dec_lock_ref(node)

    @rule(toks=tokens_st, ns=ns_st)
    def unbalanced_unlock_raises(self, toks, ns):
        ns = self.ns(ns)
        r = self.tree.match_prefix(toks, namespace=ns)
        self.touch(ns, toks, r.length)
        if r.length and r.node.lock_ref == 0:
            before = (self.tree.protected_size(), self.tree.evictable_size())
            with pytest.raises(RuntimeError):
                self.tree.dec_lock_ref(r.node)
            assert (self.tree.protected_size(), self.tree.evictable_size()) == before

    @rule(num=st.integers(0, 40))
    def evict(self, num):
        self.do_evict(num)

    @rule(k=st.integers(1, 6))
    def hold_slots(self, k):
        s = self.alloc_with_eviction(k * self.page_size)
        if s is not None:
            self.held.append(s)

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 1000))
    def release_slots(self, i):
        self.alloc.free(self.held.pop(i % len(self.held)))

    @rule()
    def reset(self):
        if self.locks:
            with pytest.raises(RuntimeError):
                self.tree.reset()
            return
        freed = self.tree.reset()
        assert len(freed) == sum(len(p) for c in self.cached.values() for p in c.values())
        self.alloc.free(freed)
        self.cached = {ns: {} for ns in self.spaces}
        self.touched = {ns: {} for ns in self.spaces}

    # ---------------------------------------------------------------- invariants

    @invariant()
    def consistent(self):
        t = self.tree
        t.check_integrity()
        ps = self.page_size
        total = ps * sum(len(c) for c in self.cached.values())
        locked_pages = {(ns, prefix[:end]) for ns, prefix, _ in self.locks for end in range(ps, len(prefix) + 1, ps)}
        assert t.total_size() == total
        assert t.protected_size() == ps * len(locked_pages)
        assert t.evictable_size() == total - ps * len(locked_pages) >= 0
        held = sum(len(s) for s in self.held)
        assert self.alloc.available_size() + t.evictable_size() + t.protected_size() + held == CAPACITY
        pages = {(ns, k) for ns in self.spaces for k in self.cached[ns]}
        assert t.tenant_sizes() == self.tenant_tokens(pages)  # every tenant's namespaces, locked ones too
        for view, values in self.views:  # read-only views of edge slot bytes stay as they were
            assert view.tolist() == values


class CacheMachinePage4(CacheMachine):
    page_size = 4


class CacheMachineLFUPage2(CacheMachine):
    page_size = 2
    policy = "lfu"


class CacheMachineReuseOddsPage4(CacheMachine):
    page_size = 4
    policy = "reuse-odds"


class CacheMachineEngineBF16Page4(CacheMachine):
    """The same rules and oracle over an engine's own radix tree, slot allocator and **bfloat16**
    KV pool (the tiny random Llama, ``kv_cache_dtype="bfloat16"``, ``max_total_tokens=CAPACITY``):
    the pool's dtype does not touch slot logic. Every page an insert hands the tree gets K/V rows
    written into the pool (values derived from its namespace and prefix); after every step each
    cached page's slots still read back exactly the bfloat16 rounding of those rows (a slot is
    rewritten only after eviction frees it)."""

    page_size = 4
    _loaded = None

    @initialize()
    def setup(self):
        from model_helpers import tiny_loaded_model

        from radixkv.config import EngineConfig
        from radixkv.engine import Engine

        if CacheMachineEngineBF16Page4._loaded is None:
            CacheMachineEngineBF16Page4._loaded = tiny_loaded_model()
        cfg = EngineConfig(device="cpu", page_size=self.page_size, max_total_tokens=CAPACITY, kv_cache_dtype="bf16")
        engine = Engine(cfg, loaded_model=CacheMachineEngineBF16Page4._loaded)
        CacheMachine.setup(self)
        self.tree, self.alloc, self.pool = engine.kv.cache, engine.kv.allocator, engine.runner.kv_pool
        assert self.pool.kv_cache_dtype == "bfloat16" and self.alloc.num_slots == CAPACITY
        assert type(self.tree) is RadixCache and self.tree.page_size == self.page_size

    def rows(self, ns, key):
        """The K and V rows ``[page_size, kv_heads, head_dim]`` of the cached page ``key``."""
        g = torch.Generator().manual_seed(zlib.crc32(repr((ns, key)).encode()))
        p = self.pool
        return [100 * torch.randn(self.page_size, p.num_kv_heads, p.head_dim, generator=g) for _ in range(2)]

    def do_insert(self, toks, ns, box="list"):
        before = dict(self.cached[ns])
        super().do_insert(toks, ns, box)
        # the pages this insert handed the tree: new keys, and keys evicted by the insert's own
        # allocation and inserted again on other slots
        for key in [key for key, page in self.cached[ns].items() if before.get(key) != page]:
            k, v = self.rows(ns, key)
            for layer in range(self.pool.num_layers):
                self.pool.write(layer, torch.tensor(self.cached[ns][key]), k, v)

    @invariant()
    def cached_kv_intact(self):
        for ns in NAMESPACES:
            for key, page in self.cached[ns].items():
                k, v = self.rows(ns, key)
                got_k, got_v = self.pool.read(self.pool.num_layers - 1, torch.tensor(page))
                assert torch.equal(got_k, k.to(torch.bfloat16).float())
                assert torch.equal(got_v, v.to(torch.bfloat16).float())


class CacheMachineTenantsPage2(CacheMachine):
    """Tenants with soft quotas: tenant "a" over two namespaces (a salt splits it) with a quota of
    6 tokens, "b" with 10, the shared default without one; eviction takes over-quota tenants'
    least recently used pages first (the oracle's first phase)."""

    page_size = 2
    namespaces = TENANT_NAMESPACES
    quotas = QUOTAS

    @rule(num=st.integers(1, 6))
    def evict_few(self, num):  # a little at a time: the quota phase, then the LRU phase, in one call
        self.do_evict(num)


_settings = settings(
    max_examples=MAX_EXAMPLES,
    stateful_step_count=STEPS,
    deadline=None,
    derandomize=settings.default.derandomize and not SOAK,  # the profile's (tests/conftest.py)
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)

TestRadixCachePage1 = CacheMachine.TestCase
TestRadixCachePage1.settings = _settings
TestRadixCachePage4 = CacheMachinePage4.TestCase
TestRadixCachePage4.settings = _settings
TestRadixCacheLFUPage2 = CacheMachineLFUPage2.TestCase
TestRadixCacheLFUPage2.settings = _settings
TestRadixCacheReuseOddsPage4 = CacheMachineReuseOddsPage4.TestCase
TestRadixCacheReuseOddsPage4.settings = _settings
TestEngineBF16PoolPage4 = CacheMachineEngineBF16Page4.TestCase
TestEngineBF16PoolPage4.settings = settings(_settings, max_examples=MAX_EXAMPLES if SOAK else 60)
TestRadixCacheTenantsPage2 = CacheMachineTenantsPage2.TestCase
TestRadixCacheTenantsPage2.settings = _settings

pytestmark = pytest.mark.timeout(None if SOAK else 600)
