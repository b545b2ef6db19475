"""The engine: continuous batching over a prefix cache.

:class:`~radixkv.engine.engine.Engine` (``add_request`` / ``step`` / ``abort_request``) owns the
loop; :mod:`~radixkv.engine.scheduler` is the admission policy; :mod:`~radixkv.engine.kv_manager`
alone moves KV slots (request <-> prefix cache <-> allocator), beside its helpers
:mod:`~radixkv.engine.pins` (the pin table) and :mod:`~radixkv.engine.batch_sharing` (the
in-batch sharing index); :mod:`~radixkv.engine.validation` checks new requests;
:mod:`~radixkv.engine.request` is per-sample state; :mod:`~radixkv.engine.output` turns samples
into ``RequestOutput``; :mod:`~radixkv.engine.events` defines the typed events and their bus;
:mod:`~radixkv.engine.stats` the ``cache_stats()`` snapshot.
"""

from radixkv.engine.engine import Engine
from radixkv.engine.events import (
    CacheEvicted,
    CacheInserted,
    CacheReset,
    Event,
    EventBus,
    RequestAdmitted,
    RequestFinished,
    StepFinished,
)
from radixkv.engine.stats import EngineStats

__all__ = [
    "Engine",
    "EngineStats",
    "Event",
    "EventBus",
    "RequestAdmitted",
    "StepFinished",
    "RequestFinished",
    "CacheInserted",
    "CacheEvicted",
    "CacheReset",
]
