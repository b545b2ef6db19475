"""Eviction policies of :class:`~radixkv.cache.radix_tree.RadixCache` other than LRU.

Only unlocked leaves are evictable, and a leaf is freed tail first, page by page (see
``RadixCache.evict``); a policy decides which leaf goes first. Every policy gives a leaf a
priority when it enters the evictable set or is refreshed by a match / insert through it (the
tree keeps the set in a ``SortedList`` ordered by priority, so eviction never scans the tree);
the lowest priority is evicted first. What a policy may use is what the tree knows of a node:

* ``last_access``: the logical time of the last match / insert through it (the tree's clock
  counts those calls);
* ``hits``: how many match / insert calls walked through it (counted only when a policy asks,
  ``counts_hits``);
* ``depth``: the position of its last token (its path length in tokens).

``"lru"`` is not here: the tree runs it on its own O(1) containers (and it stays the default).

Policies:

* ``"lfu"``: SGLang's LFU (``sglang.srt.mem_cache.evict_policy.LFUStrategy``): fewest hits
  first, least recently used among equals.
* ``"gdf"``: GreedyDual with frequency (Cao and Irani, "Cost-aware WWW proxy caching
  algorithms", USENIX 1997; the frequency term of Cherkasova's GDSF, HP Labs 1998), with a cost
  of one recomputed token per evicted token, so the size term drops out of a page-granular
  eviction: ``H = L + hits``, where the inflation ``L`` is the priority of the last victim. A
  leaf reached by many requests outlives one reached once, until ``L`` (which grows as
  victims go) catches up with it.
"""

from __future__ import annotations

from typing import Any, Union

__all__ = ["EvictionPolicy", "LFU", "GreedyDualFrequency", "POLICIES", "make_policy"]


class EvictionPolicy:
    """Base class: the priority of an evictable leaf (lower goes first).

    Attributes:
        name: the policy's name (what ``RadixCache(eviction_policy=...)`` takes).
        counts_hits: when True the tree keeps ``node.hits`` up to date.
    """

    name = "?"
    counts_hits = False

    def priority(self, node: Any) -> Any:
        """Sort key of ``node`` (any totally ordered value), computed when the leaf enters the
        evictable set or is refreshed."""
        raise NotImplementedError

    def evicted(self, priority: Any) -> None:
        """Told the priority of every victim, in eviction order (for aging policies)."""

    def reset(self) -> None:
        """Forget any state (the tree was reset)."""


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

    def evicted(self, priority: Any) -> None:
        if priority[0] > self.inflation:
            self.inflation = priority[0]

    def reset(self) -> None:
        self.inflation = 0


POLICIES = {"lfu": LFU, "gdf": GreedyDualFrequency}


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
