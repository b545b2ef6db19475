"""Belady's MIN on a radix tree: the offline eviction bound of a cache replay.

:func:`optimal` replays the same trace as :class:`~radixkv.sim.simulator.CacheSimulator`, with
the same model of what is reused and what is cached (request ``i`` may reuse the cached prefix
of its prompt but the last token; it needs slots for prompt + reply but the last generated token,
``final`` tokens, evicting when the pool is short; then every whole page of those ``final``
tokens is cached; a request larger than the pool is skipped), but chooses its victims knowing the
future. Pages are page-granular prefixes (page ``k`` of a sequence stands for its first
``(k + 1) * page_size`` tokens in its namespace); only leaf pages are evictable (a cached page's
parent is cached); nothing is locked but the request's own reused prefix (it is in use now).

MIN (L. A. Belady, "A study of replacement algorithms for a virtual-storage computer", IBM
Systems Journal 5(2), 1966): evict the page whose next use is farthest in the future. A page's
next use is the next request whose reusable prefix covers it. A child page is used only with its
parent, so along any path next use never decreases with depth; among the pages of farthest next
use the deepest one is a leaf, so ranking pages by (next use, depth) and evicting the top one
keeps the cache prefix-closed: the tree constraint costs MIN nothing. (MIN is the optimum of
classic demand paging; here pages arrive a request at a time and a miss of one page means the
recomputation of every page below it, so it is the field's reference bound rather than a proven
optimum of this model; every online policy measured on the same traces stays below it.)

Implementation, O(total tokens) numpy work plus a heap of page *runs*: the trace's pages get
global ids by inserting every request's tokens into one unbounded
:class:`~radixkv.cache.radix_tree.RadixCache` with fresh slots (a page's id is its slot // page
size); every use event ``(page, request)`` is sorted once, and each page's next use after request
``i`` is one ``searchsorted``. A request's pages form a path whose next uses are non-decreasing,
so they are pushed as runs of equal next use; a run is evicted from its tail and dropped once its
pages are used again (their next use changed). The same loop ranks pages by last use instead
(``policy="lru"``: LRU at page granularity, leaf tail first, which is what
``RadixCache(eviction_policy="lru")`` does): it reproduces the online replay's cached tokens
exactly (tests/test_sim.py), which checks that this model and the online replay agree.
"""

from __future__ import annotations

import heapq
import time
from typing import Sequence

import numpy as np

from radixkv.cache.radix_tree import RadixCache
from radixkv.namespace import Namespace
from radixkv.sim.simulator import SimRequest, SimResult

__all__ = ["optimal"]


def _page_ids(seqs: Sequence[tuple], page_size: int) -> list[np.ndarray]:
    """Global page ids of the whole pages of every ``(tokens, namespace)`` (equal prefix and
    namespace, equal id)."""
    tree = RadixCache(page_size)
    nxt = 0
    out = []
    for toks, namespace in seqs:
        n = len(toks) - len(toks) % page_size
        toks = toks[:n]
        tree.insert(toks, np.arange(nxt, nxt + n, dtype=np.int64), namespace)
        nxt += n  # fresh ids for every position; the tree keeps those of the pages it lacked
        ids = np.asarray(tree.match_prefix(toks, namespace).slots, dtype=np.int64)
        out.append(ids[::page_size] // page_size)
    return out


def _next_uses(pids: list[np.ndarray], mpages: list[int]) -> list[np.ndarray]:
    """For every request ``i`` and page of its path: the first later request whose match range
    covers that page (``len(pids) + 1`` when none does)."""
    nreq = len(pids)
    inf = nreq + 1
    ev_u = np.concatenate([p[:m] for p, m in zip(pids, mpages)] + [np.empty(0, np.int64)])
    ev_t = np.concatenate([np.full(m, j, np.int64) for j, m in enumerate(mpages)] + [np.empty(0, np.int64)])
    stride = nreq + 1
    keys = np.sort(ev_u * stride + ev_t)
    out = []
    for i, p in enumerate(pids):
        k = np.searchsorted(keys, p * stride + i + 1)
        nx = np.full(len(p), inf, np.int64)
        inside = np.flatnonzero(k < len(keys))
        found = keys[k[inside]]
        same = found // stride == p[inside]
        nx[inside[same]] = found[same] % stride
        out.append(nx)
    return out


def optimal(
    requests: Sequence[SimRequest], page_size: int = 1, capacity: int = 1 << 20, policy: str = "min"
) -> SimResult:
    """Replays ``requests`` with ``capacity`` slots evicting by Belady's MIN (module docstring).

    Args:
        requests: the trace (as for :meth:`CacheSimulator.run`; a sequence, read twice).
        page_size: tokens per page (>= 1).
        capacity: KV slots, floored to whole pages.
        policy: ``"min"``, or ``"lru"`` (the same loop evicting least recently used pages, tail
            first: the online replay's twin, for checking the model).

    Returns:
        :class:`~radixkv.sim.simulator.SimResult` with ``policy`` ``"min"`` / ``"lru"``: served
        and skipped requests, prompt / cached / evicted tokens, the cache size at the end (no
        per-request rows, no outcomes).

    Raises:
        ValueError: unknown policy, bad page size or capacity, an empty prompt.
    """
    _check(policy, page_size, capacity)
    t0 = time.perf_counter()
    ps = page_size
    seqs, match_pages, finals, plens = _paths(requests, ps)
    pids = _page_ids(seqs, ps)
    nexts = _next_uses(pids, match_pages) if policy == "min" else None
    npages = 1 + max((int(p.max()) for p in pids if len(p)), default=0)
    pages = _Pages(pids, npages, policy)
    used = 0
    cap_pages = capacity // ps
    res = SimResult(policy, ps, cap_pages * ps)
    for i, p in enumerate(pids):
        need = -(-finals[i] // ps)
        if need > cap_pages:  # larger than the pool: not served (nothing is looked up)
            res.skipped += 1
            continue
        m = match_pages[i]
        c = pages.cached[p[:m]]
        h = m if c.all() else int(np.argmin(c))
        if policy == "lru" and h:  # the match refreshes the reused prefix (and it is in use)
            pages.file(i, p[:h], np.full(h, i, np.int64))
        short = need - h - (cap_pages - used)
        if short > 0:
            evicted = pages.evict(short)
            used -= evicted
            res.evicted_tokens += evicted * ps
        res.num_requests += 1
        res.cached_tokens += h * ps
        res.prompt_tokens += plens[i]
        used += int(np.count_nonzero(~pages.cached[p]))
        pages.cached[p] = True
        if len(p):
            pages.file(i, p, nexts[i] if policy == "min" else np.full(len(p), i, np.int64))
    res.cache_tokens_end = used * ps
    res.seconds = time.perf_counter() - t0
    return res


def _check(policy: str, page_size: int, capacity: int) -> None:
    """Raises ValueError for an unknown policy, a bad page size or capacity."""
    if policy not in ("min", "lru"):
        raise ValueError(f"policy must be 'min' or 'lru', got {policy!r}")
    if not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
    if not isinstance(capacity, int) or capacity < page_size:
        raise ValueError(f"capacity must be an int >= page_size ({page_size}), got {capacity!r}")


def _paths(requests: Sequence[SimRequest], ps: int) -> tuple[list, list, list, list]:
    """Per request: the ``(tokens, namespace)`` whose K/V is computed (prompt + reply but the last
    generated token), the whole pages its match may reuse (all prompt tokens but the last,
    floored), its ``final`` token count and its prompt length.

    Raises:
        ValueError: an empty prompt.
    """
    seqs, match_pages, finals, plens = [], [], [], []
    for r in requests:
        tokens = list(r.tokens)
        if not tokens:
            raise ValueError("SimRequest.tokens is empty: a prompt needs at least 1 token")
        reply = list(r.reply)
        final = len(tokens) + max(len(reply) - 1, 0)  # positions whose K/V is computed
        seqs.append(((tokens + reply)[:final], Namespace.of(r.namespace)))
        match_pages.append((len(tokens) - 1) // ps)  # all prompt tokens but the last, floored
        finals.append(final)
        plens.append(len(tokens))
    return seqs, match_pages, finals, plens


class _Pages:
    """The pages of a replay: which are cached, the rank each was last filed under (next use for
    MIN, last use for LRU), and a heap of runs ``(sign * rank, -tail depth, request, a, b)``:
    pages ``[a, b)`` of one request's path filed with one rank (heapq pops the smallest; MIN
    evicts the largest next use, so its ranks are negated)."""

    def __init__(self, pids: list[np.ndarray], npages: int, policy: str) -> None:
        self.pids = pids
        self.cached = np.zeros(npages, bool)
        self.value = np.full(npages, -1, np.int64)
        self.sign = -1 if policy == "min" else 1
        self.heap: list = []

    def file(self, i: int, p: np.ndarray, ranks: np.ndarray) -> None:
        """File pages ``p`` (a prefix of request ``i``'s path) under ``ranks`` (non-decreasing
        along the path): one run per stretch of equal rank."""
        self.value[p] = ranks
        cuts = (np.flatnonzero(np.diff(ranks)) + 1).tolist()
        for a, b in zip([0] + cuts, cuts + [len(p)]):
            heapq.heappush(self.heap, (self.sign * int(ranks[a]), -(b - 1), i, a, b))

    def evict(self, short: int) -> int:
        """Evict at least ``short`` pages, runs in heap order, each from its tail; returns the pages
        evicted. A run whose tail went through another run is trimmed and re-filed; one whose
        pages were used again since (their rank changed) is dropped."""
        cached, value, heap = self.cached, self.value, self.heap
        evicted = 0
        while short > 0:
            key, _, rid, a, b = heapq.heappop(heap)
            ids = self.pids[rid][a:b]
            rank = self.sign * key
            if not cached[ids[-1]]:  # its tail went through another run: trim and re-file
                left = np.flatnonzero(cached[ids])
                if len(left):
                    b2 = a + int(left[-1]) + 1
                    heapq.heappush(heap, (key, -(b2 - 1), rid, a, b2))
                continue
            if value[ids[-1]] != rank:  # used again since: newer runs cover these pages
                continue
            window = ids[max(0, len(ids) - short) :]
            bad = np.flatnonzero(~(cached[window] & (value[window] == rank)))
            k = len(window) - (int(bad[-1]) + 1 if len(bad) else 0)
            cached[window[len(window) - k :]] = False
            evicted += k
            short -= k
            if k == len(window) and b - k > a:  # the rest of the run keeps its place
                heapq.heappush(heap, (key, -(b - k - 1), rid, a, b - k))
        return evicted
