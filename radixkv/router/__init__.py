"""Routing requests across radixkv replicas (docs/routing.md).

* :mod:`radixkv.router.policy` -- the policies (``round_robin``, ``least_load``, ``session``,
  ``approx_tree``, and :mod:`radixkv.router.cache_events`'s ``cache_events``) on the interface of
  :mod:`radixkv.router.base`: pure Python, torch-free, no engine import; they consume token ids,
  plain cache-event batches and snapshots (:mod:`radixkv.router.index`).
* :mod:`radixkv.router.ray` -- the Ray Serve deployment (optional extra ``radixkv[ray]``; the only
  module that imports ray).
"""

from radixkv.router.index import CacheView
from radixkv.router.policy import POLICIES, Decision, Policy, RouteRequest, make_policy

__all__ = ["CacheView", "POLICIES", "Decision", "Policy", "RouteRequest", "make_policy"]
