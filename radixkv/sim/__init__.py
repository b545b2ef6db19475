"""The cache simulator: replay a trace of token sequences through a real prefix cache and slot
allocator (the engine's KV manager) at a given capacity and page size, no model; per-request
cache outcomes included; :func:`radixkv.sim.belady.optimal` replays the same trace under Belady's
MIN, the offline eviction bound. :mod:`radixkv.sim.sharegpt` builds the tokenized ShareGPT set it is
often fed with (once, safely under concurrency)."""

from __future__ import annotations

from radixkv.sim.belady import optimal
from radixkv.sim.simulator import (
    POLICIES,
    CacheSimulator,
    RequestResult,
    SimRequest,
    SimResult,
    capacity_bound,
    capacity_for_memory,
    capacity_needed,
    make_cache,
    simulate,
)

__all__ = [
    "POLICIES",
    "CacheSimulator",
    "RequestResult",
    "SimRequest",
    "SimResult",
    "capacity_bound",
    "capacity_for_memory",
    "capacity_needed",
    "make_cache",
    "optimal",
    "simulate",
]
