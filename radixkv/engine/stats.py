"""`EngineStats`: one typed snapshot of the KV pool, the prefix cache and the engine's counters."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Dict, Iterator

__all__ = ["TENANT_COUNTERS_KEPT", "EngineStats", "tenant_row", "merge_tenants", "TenantTable", "TenantSnapshot"]


@dataclass(frozen=True)
class EngineStats(Mapping):
    """What ``Engine.cache_stats()`` returns (sizes in tokens). Attributes, and also a read-only
    mapping with the same keys (``stats["hit_rate"]``, ``dict(stats)``).

    Attributes:
        capacity: KV slots in the pool.
        free: slots nobody holds.
        evictable: cached tokens no request locks (the cache may evict them).
        protected: cached tokens on a path locked by running requests or pins.
        pinned: tokens held by pins (n > 1 prompts shared with samples not admitted yet).
        cached: tokens held by the prefix cache (``evictable + protected``).
        in_use: tokens held by requests outside the cache (``capacity - free - cached``).
        prompt_tokens, cached_tokens: summed over requests at first admission (cached = served
            from the prefix cache; a request aborted after that counts, one aborted while it
            waited does not, as vLLM's prefix-cache queries and hits count a request when the
            scheduler looks it up); hit_rate: ``cached_tokens / prompt_tokens`` (0.0 before any).
        prefill_tokens: prompt/history tokens computed (recomputation after retraction included).
        generated_tokens: tokens sampled.
        evicted_tokens: tokens evicted from the prefix cache.
        num_retractions: retractions so far.
        running, waiting: samples admitted / queued.
        page_size: tokens per KV page.
        prefix_cache: "radix", "hash" or "none".
        cached_tokens_by_tier: ``cached_tokens`` split by where they came from: ``device`` (the
            pool: cached, or shared in the same forward), ``host``, ``disk``, ``remote`` (KV
            tiers, docs/tiers.md).
        tiers: per KV tier (``host``, ``disk``, ``remote``; only those configured) a dict of its
            counters: the store's (``hits``, ``misses``, ``blocks_read``, ``blocks_written``,
            ``bytes_read``, ``bytes_written``, ``corrupt``, ``errors``, ``degraded``) and the
            engine's (:class:`~radixkv.engine.tier_io.TierCounters`: ``lookups``, ``found``,
            ``loaded``, ``load_rejected``, ``load_skipped``, ``tails_loaded``, ``tail_tokens``,
            ``write_dropped``, ``write_pending``, ``served_tokens``, ``load_latency`` histogram), ``used_bytes``, ``capacity_bytes``,
            ``load_s_per_token`` and ``prefill_s_per_token`` (the cost model's running averages),
            ``write_policy``.
        kv_cache_dtype: the K/V storage dtype's canonical name ("float32", "bfloat16",
            "float16", "fp8_e4m3", "fp8_e5m2").
        kv_bytes_per_token: K+V bytes of one token in every layer, fp8 scales included.
        kv_cache_bytes: bytes of the pool's K/V tensors, scales included
            (``capacity * kv_bytes_per_token``).
        tenants: per named tenant (``Namespace.tenant``; the server's API keys set it), a dict:
            ``cached`` (tokens its namespaces hold in the prefix cache now, pinned and locked
            included), ``quota`` (its ``kv_quota_tokens``, or None), ``prompt_tokens`` /
            ``cached_tokens`` (summed as above, over its requests) and ``hit_rate``. Every tenant
            with a quota is listed from the start; others once a request names them, while
            they hold cached tokens or are among the :data:`TENANT_COUNTERS_KEPT` tenants
            admitted most recently.
        spec_draft_tokens: draft tokens verified so far (speculative decoding; 0 when off).
        spec_accepted_tokens: those of them accepted (each saved a forward of its own).
    """

    capacity: int
    free: int
    evictable: int
    protected: int
    pinned: int
    cached: int
    in_use: int
    prompt_tokens: int
    cached_tokens: int
    hit_rate: float
    prefill_tokens: int
    generated_tokens: int
    evicted_tokens: int
    num_retractions: int
    running: int
    waiting: int
    page_size: int
    prefix_cache: str
    kv_cache_dtype: str
    kv_bytes_per_token: int
    kv_cache_bytes: int
    cached_tokens_by_tier: dict = field(default_factory=dict)
    tiers: dict = field(default_factory=dict)
    tenants: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0

    def __getitem__(self, key: str) -> Any:
        if key not in _KEYS:
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(_KEYS)

    def __len__(self) -> int:
        return len(_KEYS)

    def as_dict(self) -> dict[str, Any]:
        """A plain dict copy (JSON-ready)."""
        return asdict(self)


_KEYS = tuple(f.name for f in fields(EngineStats))


TENANT_COUNTERS_KEPT = 10_000
"""Most tenants whose lifetime ``prompt_tokens`` / ``cached_tokens`` counters an engine keeps
(:attr:`EngineStats.tenants`). Beyond it the least recently admitted tenant's counters are
forgotten: its row stays while it holds cached tokens or has a KV quota, and counts from 0 if it
comes back (a Prometheus counter reset). It bounds the memory and the cost of each read of
``cache_stats()`` / ``/metrics`` (O(tenants listed)) when the Python API names a tenant per end
user; the server's tenants are its API keys."""


def tenant_row(cached: int, quota: Any, prompt_tokens: int, cached_tokens: int) -> Dict[str, Any]:
    """One tenant's entry of :attr:`EngineStats.tenants`."""
    return dict(
        cached=cached,
        quota=quota,
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens,
        hit_rate=cached_tokens / prompt_tokens if prompt_tokens else 0.0,
    )


class TenantSnapshot:
    """The per-tenant rows of :class:`TenantTable` at one moment, taken in O(1): :meth:`rows`
    builds :attr:`EngineStats.tenants` from them (O(tenants), on the reader's thread; the
    table's later changes are not seen)."""

    __slots__ = ("_base", "_log", "_n", "_rows")

    def __init__(self, base: dict, log: list, n: int) -> None:
        self._base, self._log, self._n = base, log, n
        self._rows: Dict[str, Dict[str, Any]] | None = None

    def rows(self) -> Dict[str, Dict[str, Any]]:
        """``EngineStats.tenants``: one :func:`tenant_row` per tenant, sorted by name (a fresh
        dict each call)."""
        if self._rows is None:  # NOTE: two threads may both build it; they build the same
            table = _replay(self._base, self._log, self._n)
            self._rows = {t: tenant_row(*table[t]) for t in sorted(table)}
        return {t: dict(row) for t, row in self._rows.items()}


def _replay(base: dict, log: list, n: int) -> dict:
    out = dict(base)
    for tenant, row in log[:n]:
        if row is None:
            out.pop(tenant, None)
        else:
            out[tenant] = row
    return out


class TenantTable:
    """The rows of :attr:`EngineStats.tenants` kept incrementally by the engine (its thread
    only): :meth:`set` replaces one tenant's row in O(1), :meth:`snapshot` is O(1) amortized, so
    a step's bookkeeping costs what its own tenants changed, never a walk over every tenant
    (an AsyncLLM takes a snapshot after every step). Internally a base dict and an append-only
    log of changes since it; a snapshot holds both and its log length; the log is folded into a
    new base once it outgrows the base (never changing a base or log a snapshot holds)."""

    __slots__ = ("_base", "_log")

    def __init__(self) -> None:
        self._base: dict = {}
        self._log: list = []

    def set(self, tenant: str, row: tuple | None) -> None:
        """``tenant``'s row: ``(cached, quota, prompt_tokens, cached_tokens)``; None: not listed."""
        self._log.append((tenant, row))

    def snapshot(self) -> TenantSnapshot:
        if len(self._log) > 64 + len(self._base):
            self._base, self._log = _replay(self._base, self._log, len(self._log)), []
        return TenantSnapshot(self._base, self._log, len(self._log))


def merge_tenants(per_engine: Any) -> Dict[str, Dict[str, Any]]:
    """Several engines' ``tenants`` (dicts of :func:`tenant_row` entries) as one: counts summed,
    quotas summed where every engine has one (each engine's quota is its own), hit rates
    recomputed."""
    acc: Dict[str, list] = {}
    for tenants in per_engine:
        for name, row in (tenants or {}).items():
            a = acc.setdefault(name, [0, 0, 0, 0])
            a[0] += int(row.get("cached", 0))
            a[2] += int(row.get("prompt_tokens", 0))
            a[3] += int(row.get("cached_tokens", 0))
            q = row.get("quota")
            a[1] = None if q is None or a[1] is None else a[1] + int(q)
    return {name: tenant_row(*a) for name, a in sorted(acc.items())}
