"""Routing policies: choose a replica for a request's token ids (pure Python, torch-free).

A policy sees the replicas' load as it records it itself (every decision counts at once: the
request's replica gets one more outstanding request and its estimated uncached prompt tokens,
until :meth:`Policy.finished`) and, for ``cache_events``, the replicas' exact cache contents
from their cache events (:mod:`radixkv.router.index`). Nothing here imports the engine or torch;
the same objects drive the simulation (bench/sim_routing.py) and the Ray Serve router
(:mod:`radixkv.router.ray`).

Policies (:data:`POLICIES`, :func:`make_policy`):

* ``round_robin`` -- the next replica in turn.
* ``least_load`` -- power of two choices (Mitzenmacher, "The Power of Two Choices in Randomized
  Load Balancing", 2001): two random replicas, the one with fewer outstanding requests (then
  fewer queued prefill tokens). Ray Serve's default router does the same on queue lengths.
* ``session`` -- consistent hashing of a conversation key (``RouteRequest.session``, else the
  request id) over the replicas: rendezvous (highest-random-weight) hashing (Thaler & Ravishankar
  1998), so a replica that leaves moves only its own keys.
* ``approx_tree`` -- SGLang's router (sgl-router ``cache_aware``): an approximate radix tree per
  replica of the tokens routed there (here a torch-free :class:`~radixkv.cache.RadixCache` with
  dummy slots, pruned LRU at ``max_tree_tokens``; it never learns of the replica's evictions).
  Rule: if loads are imbalanced (``max - min > balance_abs_threshold`` and ``max >
  balance_rel_threshold * min``, on outstanding requests) the least-loaded replica; else the
  longest match if its match rate exceeds ``cache_threshold``, else the smallest tree.
* ``cache_events`` -- radixkv's: the longest *exactly* cached prefix, from the replicas' events
  (prompts in flight and replies counted as held at once), weighed against load in tokens of
  prefill, SGLang's balance guard, one popularity rule and a home for prefixes held nowhere
  (:class:`~radixkv.router.cache_events.CacheEvents`; its module states the rule in one
  paragraph, docs/routing.md the measurements).
"""

from __future__ import annotations

import hashlib
import itertools
from typing import Any, Callable

from radixkv.router.base import Decision, Policy, ReplicaLoad, RouteRequest
from radixkv.router.cache_events import CacheEvents

__all__ = [
    "RouteRequest",
    "Decision",
    "ReplicaLoad",
    "Policy",
    "RoundRobin",
    "LeastLoad",
    "Session",
    "ApproxTree",
    "CacheEvents",
    "POLICIES",
    "make_policy",
]


class RoundRobin(Policy):
    """The next replica in turn."""

    name = "round_robin"

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        self._turn = itertools.count()

    def _select(self, req, cands, now):
        cands = sorted(cands)
        return Decision(cands[next(self._turn) % len(cands)], 0, "turn")


class LeastLoad(Policy):
    """Power of two choices on outstanding requests (then queued prefill tokens)."""

    name = "least_load"

    def _select(self, req, cands, now):
        pick = cands if len(cands) <= 2 else self.rng.sample(cands, 2)
        return Decision(self._least_loaded(pick), 0, "load")


def _weight(key: str, replica: str) -> bytes:
    return hashlib.blake2b(f"{key}\x00{replica}".encode(), digest_size=8).digest()


class Session(Policy):
    """Rendezvous hashing of the conversation key over the replicas."""

    name = "session"

    def _select(self, req, cands, now):
        key = req.session if req.session is not None else req.request_id
        return Decision(max(cands, key=lambda c: _weight(key, c)), 0, "session")


class ApproxTree(Policy):
    """SGLang's cache-aware router: an approximate tree per replica of what was routed there.

    Args:
        cache_threshold: minimum match rate (matched / prompt tokens) to follow the match
            (SGLang's gateway default 0.3).
        balance_abs_threshold, balance_rel_threshold: SGLang's imbalance test on outstanding
            requests (defaults 64 and 1.5, SGLang's).
        max_tree_tokens: LRU-prune each tree to this many tokens (SGLang prunes to
            ``max_tree_size`` every ``eviction_interval_secs``; its default 2**26 rarely prunes).
    """

    name = "approx_tree"

    def __init__(
        self,
        seed: int = 0,
        cache_threshold: float = 0.3,
        balance_abs_threshold: float = 64,
        balance_rel_threshold: float = 1.5,
        max_tree_tokens: int = 1 << 26,
    ) -> None:
        super().__init__(seed)
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.max_tree_tokens = max_tree_tokens
        self.trees: dict[str, Any] = {}

    def add_replica(self, replica: str) -> None:
        from radixkv.cache.radix_tree import RadixCache  # torch-free

        super().add_replica(replica)
        self.trees.setdefault(replica, RadixCache(1))

    def remove_replica(self, replica: str) -> None:
        super().remove_replica(replica)
        self.trees.pop(replica, None)

    def _select(self, req, cands, now):
        if self._imbalanced(cands, self.balance_abs_threshold, self.balance_rel_threshold):
            return Decision(self._least_loaded(cands), 0, "load")
        toks = list(req.token_ids)
        best, best_len = None, -1
        for c in cands:
            m = self.trees[c].match_prefix(toks, req.namespace).length
            if m > best_len:
                best, best_len = c, m
        if toks and best_len / len(toks) > self.cache_threshold:
            return Decision(best, 0, "cache")
        smallest = min(self.trees[c].total_size() for c in cands)
        ties = [c for c in cands if self.trees[c].total_size() == smallest]
        return Decision(self.rng.choice(ties), 0, "miss")

    def record(self, req, d, now=0.0):
        super().record(req, d, now)
        import numpy as np

        tree = self.trees[d.replica]
        toks = list(req.token_ids)
        tree.insert(toks, np.zeros(len(toks), dtype=np.int64), req.namespace)
        over = tree.total_size() - self.max_tree_tokens
        if over > 0:
            tree.evict(over)


POLICIES: dict[str, Callable[..., Policy]] = {
    "round_robin": RoundRobin,
    "least_load": LeastLoad,
    "session": Session,
    "approx_tree": ApproxTree,
    "cache_events": CacheEvents,
}


def make_policy(name: str, **kwargs: Any) -> Policy:
    """The policy called ``name`` (a key of :data:`POLICIES`) with its keyword options.

    Raises:
        ValueError: an unknown name, or an option the policy does not take.
    """
    if name not in POLICIES:
        raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {name!r}")
    try:
        return POLICIES[name](**kwargs)
    except TypeError as exc:
        raise ValueError(f"policy {name!r}: {exc}") from None
