"""The cache simulator: replay a trace of token sequences through a real prefix cache and slot
allocator (the engine's KV manager) at a given capacity and page size, no model; per-request
cache outcomes included. :mod:`radixkv.sim.sharegpt` builds the tokenized ShareGPT set it is
often fed with (once, safely under concurrency)."""

from __future__ import annotations

from radixkv.sim.simulator import (
    POLICIES,
    CacheSimulator,
    RequestResult,
    SimRequest,
    SimResult,
    capacity_bound,
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
    "make_cache",
    "simulate",
]
