"""Eviction policies of :class:`~radixkv.cache.radix_tree.RadixCache` other than LRU.

Only unlocked leaves are evictable, and a leaf is freed tail first, page by page (see
``RadixCache.evict``); a policy decides which leaf goes first. Every policy gives a leaf a
priority when it enters the evictable set or is refreshed by a match / insert through it (the
tree keeps the set in a ``SortedList`` ordered by priority, so eviction never scans the tree);
the lowest priority is evicted first. What a policy may use is what the tree knows of a node:

* ``last_access``: the logical time of the last match / insert through it (the tree's clock
  ticks once per ``match_prefix`` / ``insert`` call);
* ``hits``: how many match / insert calls walked through it (counted when a policy asks,
  ``counts_hits``);
* its depth (tokens from its namespace root to the end of its edge; :func:`node_depth`);
* what became of earlier leaves (the hooks :meth:`EvictionPolicy.reused`,
  :meth:`EvictionPolicy.freed`, :meth:`EvictionPolicy.inserted`).

``"lru"`` is not here: the tree runs it on its own O(1) containers, and it stays the default
(docs/benchmarks.md has the measurements of every policy).

Policies:

* ``"lfu"``: SGLang's LFU (``sglang.srt.mem_cache.evict_policy.LFUStrategy``): fewest hits
  first, least recently used among equals.
* ``"gdf"``: GreedyDual with frequency (Cao and Irani, "Cost-aware WWW proxy caching
  algorithms", USENIX 1997; the frequency term of Cherkasova's GDSF, HP Labs 1998) with a cost
  of one recomputed token per evicted token, so the size term drops out of a page-granular
  eviction: ``H = L + hits``, where the inflation ``L`` is the priority of the last victim.
* ``"reuse-odds"``: LRU with learned reuse odds (:class:`ReuseOdds`): a leaf's last-access
  time plus a credit, in clock ticks, of ``horizon * K * ln(odds that a leaf of its class is
  used again)``, ``K`` and the odds learned online from the tree's own history. With
  ``horizon = 1`` it ranks leaves by the posterior odds that they are still alive when reuse
  arrives at a constant rate ``1 / K``; the default ``horizon = 2`` gives the odds twice that
  weight against recency, because real reuse gaps are heavier-tailed than that memoryless model
  (docs/benchmarks.md has the sweep). With nothing learned yet it is LRU.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any, Union

__all__ = ["EvictionPolicy", "LFU", "GreedyDualFrequency", "ReuseOdds", "POLICIES", "make_policy", "node_depth"]


def node_depth(node: Any) -> int:
    """Tokens from ``node``'s namespace root to the end of its edge (walks up: O(path nodes))."""
    d = 0
    while node.key:
        d += len(node.key) >> 2
        node = node.parent
    return d


class EvictionPolicy:
    """Base class: the priority of an evictable leaf (lower goes first) and the hooks the tree
    calls. One policy object serves one tree.

    Attributes:
        name: the policy's name (what ``RadixCache(eviction_policy=...)`` takes).
        counts_hits: when True the tree keeps ``node.hits`` up to date.
    """

    name = "?"
    counts_hits = False
    page_bytes = 4

    def bind(self, page_size: int) -> None:
        """Called once by the tree that uses this policy (``page_bytes = 4 * page_size``: the
        length of a child's key in its parent's ``children``)."""
        self.page_bytes = 4 * page_size

    def priority(self, node: Any) -> Any:
        """Sort key of ``node`` (a tuple; totally ordered among this policy's keys), computed
        when the leaf enters the evictable set or is refreshed."""
        raise NotImplementedError

    def reused(self, priority: Any, node: Any) -> None:
        """A match reached the evictable leaf ``node``, filed under ``priority`` (called before
        it is filed anew)."""

    def freed(self, priority: Any, node: Any) -> None:
        """``evict`` frees ``node`` (a whole leaf, or the tail piece of a leaf it split; still
        linked to its parent), whose leaf was filed under ``priority``."""

    def inserted(self, leaf: Any) -> None:
        """An insert linked the new leaf ``leaf`` (called before it is filed)."""

    def reset(self) -> None:
        """Forget all state (the tree was reset)."""


class LFU(EvictionPolicy):
    """Fewest hits first; among equal hits, least recently used (SGLang's ``LFUStrategy``)."""

    name = "lfu"
    counts_hits = True

    def priority(self, node: Any) -> tuple:
        return (node.hits, node.last_access)


class GreedyDualFrequency(EvictionPolicy):
    """GreedyDual-Frequency: ``H = L + hits``; ``L`` becomes each victim's ``H`` (see module
    docstring). Ties go to the least recently used leaf."""

    name = "gdf"
    counts_hits = True

    def __init__(self) -> None:
        self.inflation = 0

    def priority(self, node: Any) -> tuple:
        return (self.inflation + node.hits, node.last_access)

    def freed(self, priority: Any, node: Any) -> None:
        if priority[0] > self.inflation:
            self.inflation = priority[0]

    def reset(self) -> None:
        self.inflation = 0


class ReuseOdds(EvictionPolicy):
    """LRU with learned reuse odds: ``priority = last_access + horizon * K * ln(odds(class))``.

    A leaf's class is ``(hit bucket, depth bucket)``: ``min(hits.bit_length(), 6)`` (1, 2-3,
    4-7, ..., 32 and more walks) and its depth in blocks of ``depth_block`` tokens (at most 64).
    ``odds(class) = (reused + 1) / (dead + 1)`` counts, per class, the filed leaves that a match
    reached again (reused) and the leaves, or tail pieces of leaves, that eviction freed (dead):
    unless the freed piece comes back, i.e. a later insert hangs a new leaf starting with the
    same tokens under the same node (a *ghost* hit, as in ARC's ghost lists: Megiddo and Modha,
    "ARC: A self-tuning, low overhead replacement cache", FAST 2003), which moves it from dead
    to reused, so that evicting a class early does not teach the policy that it dies early.
    ``K`` is the mean time, in clock ticks, from a leaf's last access to its reuse (over matches
    and ghost hits); ``K = 0`` (pure LRU) until a reuse is seen.

    Why this form: if a class's leaves are ever used again with probability ``p`` and, when
    they are, the wait is memoryless with mean ``K``, the odds that a leaf of age ``a`` is still
    to be used are ``p / (1 - p) * exp(-a / K)``; ranking leaves by those odds is ranking them
    by ``last_access + K * ln(p / (1 - p))``. Measured reuse gaps are not memoryless: a
    conversation that has waited long is still likely to come back (a heavy tail), so the odds
    decay more slowly than ``exp(-a / K)``; ``horizon`` scales the time constant (``horizon * K``).
    On the ShareGPT multi-turn trace at 5% capacity ``horizon = 2`` caches 2.4 points more than
    ``horizon = 1`` (79.71% vs 77.26%; LRU 72.27%). It is not better everywhere: on the fork
    trace at 1% capacity it is below LRU (91.14% vs 91.17%, as is ``horizon = 1``), and on gsp at
    2% below ``horizon = 1`` (7.87% vs 7.89%), which is why LRU stays the default
    (docs/benchmarks.md has the table and its result files).

    Args:
        depth_block: tokens per depth bucket (int >= 1).
        ghosts: freed pieces remembered for ghost hits (FIFO, int >= 0).
        ghost_tokens: leading tokens of a freed piece a new leaf must repeat to count as its
            return.
        horizon: the weight of the odds against recency, in units of ``K`` (a number > 0).
    """

    name = "reuse-odds"
    counts_hits = True

    def __init__(
        self, depth_block: int = 256, ghosts: int = 1 << 16, ghost_tokens: int = 16, horizon: float = 2.0
    ) -> None:
        if isinstance(horizon, bool) or not isinstance(horizon, (int, float)) or not 0 < horizon < math.inf:
            raise ValueError(f"horizon must be a finite number > 0, got {horizon!r}")
        self.horizon = float(horizon)
        for k, v in (("depth_block", depth_block), ("ghost_tokens", ghost_tokens), ("ghosts", ghosts + 1)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{k} must be an int >= {0 if k == 'ghosts' else 1}, got {v!r}")
        self.depth_block = depth_block
        self.max_ghosts = ghosts
        self.ghost_bytes = 4 * ghost_tokens
        self.reset()

    def reset(self) -> None:
        self.reused_count: dict = {}
        self.dead_count: dict = {}
        self.gap_sum = 0
        self.gap_n = 0
        self.ghosts: OrderedDict = OrderedDict()  # (parent uid, first page) -> (class, t, tokens)

    def leaf_class(self, node: Any) -> tuple:
        """``(hit bucket, depth bucket)`` of ``node``."""
        return (min(node.hits.bit_length(), 6), min(node_depth(node) // self.depth_block, 64))

    def log_odds(self, cls: tuple) -> float:
        """``ln((reused + 1) / (dead + 1))`` of a class."""
        return math.log((self.reused_count.get(cls, 0) + 1) / (self.dead_count.get(cls, 0) + 1))

    @property
    def mean_gap(self) -> float:
        """``K``: mean ticks from last access to reuse (0 before any reuse)."""
        return self.gap_sum / self.gap_n if self.gap_n else 0.0

    def priority(self, node: Any) -> tuple:
        cls = self.leaf_class(node)
        return (node.last_access + self.horizon * self.mean_gap * self.log_odds(cls), node.last_access, cls)

    def _count_reuse(self, cls: tuple, gap: int) -> None:
        self.reused_count[cls] = self.reused_count.get(cls, 0) + 1
        self.gap_sum += gap
        self.gap_n += 1

    def reused(self, priority: Any, node: Any) -> None:
        self._count_reuse(priority[2], node.last_access - priority[1])

    def freed(self, priority: Any, node: Any) -> None:
        cls = priority[2]
        self.dead_count[cls] = self.dead_count.get(cls, 0) + 1
        if self.max_ghosts:
            key = (node.parent.uid, node.key[: self.page_bytes])
            self.ghosts[key] = (cls, priority[1], node.key[: self.ghost_bytes])
            self.ghosts.move_to_end(key)
            if len(self.ghosts) > self.max_ghosts:
                self.ghosts.popitem(last=False)

    def inserted(self, leaf: Any) -> None:
        if not self.ghosts:
            return
        key = (leaf.parent.uid, leaf.key[: self.page_bytes])
        ghost = self.ghosts.get(key)
        if ghost is None:
            return
        cls, t, tokens = ghost
        n = min(len(tokens), len(leaf.key))
        if leaf.key[:n] == tokens[:n]:
            del self.ghosts[key]
            self.dead_count[cls] -= 1
            self._count_reuse(cls, leaf.last_access - t)


POLICIES = {"lfu": LFU, "gdf": GreedyDualFrequency, "reuse-odds": ReuseOdds}


def make_policy(policy: Union[str, EvictionPolicy]) -> Union[EvictionPolicy, None]:
    """The policy object for a name (``None`` for ``"lru"``, which the tree runs itself).

    Raises:
        ValueError: an unknown name or object.
    """
    if isinstance(policy, EvictionPolicy):
        return policy
    if policy == "lru":
        return None
    if isinstance(policy, str) and policy in POLICIES:
        return POLICIES[policy]()
    raise ValueError(f"eviction_policy must be 'lru' or one of {sorted(POLICIES)}, got {policy!r}")
