"""The prefix-cache protocol's read-only ``peek``: it agrees with ``match_prefix`` on the length,
measures the token-level agreement with the nearest cached sequence exactly (checked against
every cached path), and changes nothing (no split, no access time, no LRU move, no lock)."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixkv.cache import HashBlockCache, NoPrefixCache, RadixCache, SlotAllocator
from radixkv.cache.radix_tree import _path_key

pytestmark = pytest.mark.timeout(120)


def _state(tree: RadixCache):
    nodes = sorted((n.uid, n.key, n.value, n.lock_ref, n.last_access, id(n.parent)) for n in tree._iter_nodes())
    return (
        nodes,
        list(tree._lru_new),
        [e[:2] for e in tree._lru_old],
        tree._clock,
        tree.total_size(),
        tree.protected_size(),
    )


def _paths(tree: RadixCache, ns=None) -> list[list[int]]:
    """Every root-to-leaf token path of a namespace."""
    import numpy as np

    root = tree.root.children.get(ns)
    if root is None:
        return []
    out = []
    stack = [root]
    while stack:
        n = stack.pop()
        if not n.children and n.key:
            out.append(np.frombuffer(_path_key(n), dtype=np.int32).tolist())
        stack.extend(n.children.values())
    return out


def _lcp(a, b) -> int:
    k = 0
    while k < len(a) and k < len(b) and a[k] == b[k]:
        k += 1
    return k


def _fill(cache, alloc, seqs, ns=None):
    for s in seqs:
        ps = cache.page_size
        n = len(s) - len(s) % ps
        if n == 0:
            continue
        m = cache.match_prefix(s, ns)
        new = alloc.alloc(n - m.length)
        import torch

        slots = torch.cat([m.slots, new]) if new is not None else m.slots
        k = cache.insert(s[:n], slots[:n], ns)
        if k > m.length:
            alloc.free(slots[m.length : k])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    page_size=st.sampled_from([1, 4]),
    seed=st.integers(0, 10_000),
    n_seqs=st.integers(1, 12),
)
def test_radix_peek_is_exact_and_read_only(page_size, seed, n_seqs):
    rng = random.Random(seed)
    cache = RadixCache(page_size)
    alloc = SlotAllocator(4096, page_size)
    base = [rng.randrange(1, 6) for _ in range(40)]
    seqs = []
    for _ in range(n_seqs):
        cut = rng.randrange(0, 40)
        seqs.append(base[:cut] + [rng.randrange(1, 6) for _ in range(rng.randrange(1, 30))])
    _fill(cache, alloc, seqs)
    if rng.random() < 0.5:  # some eviction and a lock, so that the tree has every kind of node
        alloc.free(cache.evict(rng.randrange(1, 30)))
    locked = cache.match_prefix(seqs[0])
    cache.inc_lock_ref(locked.node)
    paths = _paths(cache)
    for _ in range(8):
        src = rng.choice(seqs)
        q = src[: rng.randrange(1, len(src) + 1)] + [rng.randrange(1, 6) for _ in range(rng.randrange(0, 6))]
        before = _state(cache)
        p = cache.peek(q, None, context=5)
        assert _state(cache) == before, "peek changed the tree"
        best = max((_lcp(q, path) for path in paths), default=0)
        assert p.token_length == best
        assert p.diverged == (best < len(q) and any(_lcp(q, path) == best and len(path) > best for path in paths))
        if p.next_tokens:
            cont = list(q[: p.token_length]) + list(p.next_tokens)
            assert any(path[: len(cont)] == cont for path in paths)
            assert len(p.next_tokens) <= 5
        m = cache.match_prefix(q)
        assert p.length == m.length, (q, p, m.length)
    cache.dec_lock_ref(locked.node)
    cache.check_integrity()


def test_radix_peek_names_the_divergence_and_the_cached_neighbour():
    cache, alloc = RadixCache(1), SlotAllocator(256)
    _fill(cache, alloc, [list(range(1, 31))])
    p = cache.peek(list(range(1, 11)) + [99, 12, 13])
    assert (p.length, p.token_length, p.diverged) == (10, 10, True)
    assert p.next_tokens == tuple(range(11, 19))
    p = cache.peek(list(range(1, 11)))  # a prefix of the cached sequence: no divergence
    assert (p.length, p.token_length, p.diverged) == (10, 10, False)
    p = cache.peek(list(range(1, 41)))  # runs past the cached end
    assert (p.length, p.token_length, p.diverged, p.next_tokens) == (30, 30, False, ())
    assert cache.peek([1, 2], namespace="other") == (0, 0, (), False)
    # page_size 4: the match floors to pages, the token-level agreement does not
    cache4, alloc4 = RadixCache(4), SlotAllocator(256, 4)
    _fill(cache4, alloc4, [list(range(1, 33))])
    p = cache4.peek(list(range(1, 11)) + [99] * 10)
    assert (p.length, p.token_length, p.diverged, p.next_tokens[:2]) == (8, 10, True, (11, 12))
    assert cache4.match_prefix(list(range(1, 11)) + [99] * 10).length == 8


def test_hash_and_none_peek():
    cache, alloc = HashBlockCache(4, "sha256"), SlotAllocator(256, 4)
    x, y = list(range(1, 9)), list(range(20, 28))
    cache.insert(x + y, alloc.alloc(16))
    before = (list(cache._free), dict(cache._kids))
    p = cache.peek(x + [99] * 8)
    assert (p.length, p.token_length, p.diverged, p.next_tokens) == (8, 8, True, ())
    assert (list(cache._free), dict(cache._kids)) == before
    assert cache.peek(x + y + [5] * 4) == (16, 16, (), False)  # the cached chain ends there
    assert cache.peek([7] * 8) == (0, 0, (), True)  # another first block is cached
    assert cache.peek([7] * 8, namespace="ns") == (0, 0, (), False)  # nothing in that namespace
    alloc.free(cache.evict(16))
    assert cache.peek(x + y) == (0, 0, (), False)
    cache.check_integrity()
    assert NoPrefixCache(4).peek([1, 2, 3]) == (0, 0, (), False)
