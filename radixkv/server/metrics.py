"""Prometheus metrics of one server (``GET /metrics``), in a private ``CollectorRegistry``.

Two sources, both exposed with the ``radixkv_`` prefix:

- Counters and histograms of requests: the HTTP layer counts ``radixkv_requests_total{endpoint}``
  and ``radixkv_request_errors_total{status}`` and observes
  ``radixkv_time_to_first_token_seconds`` and ``radixkv_e2e_request_latency_seconds``; the
  engine's :class:`~radixkv.engine.events.RequestFinished` events (:meth:`ServerMetrics.on_event`)
  count ``radixkv_requests_finished_total{finish_reason}`` (per choice; ``abort`` for a client
  that went away, ``error`` for a request that failed), ``radixkv_prompt_tokens_total``,
  ``radixkv_cached_tokens_total`` (prompt tokens served from the prefix cache) and
  ``radixkv_generation_tokens_total`` of the requests that completed (neither aborted nor
  failed): the numbers their clients see in ``usage``; the
  :class:`~radixkv.engine.events.RequestAdmitted` events (with their cache outcome) count
  ``radixkv_missed_prompt_tokens_total{cause}``: prompt tokens not served from the prefix
  cache, by cause (:data:`radixkv.cache.outcome.CAUSES`), of the same completed requests (so
  the causes sum to ``prompt_tokens - cached_tokens``).
- A snapshot of the engine taken on the engine thread at scrape time
  (:class:`~radixkv.engine.stats.EngineStats`): ``radixkv_cache_hit_rate`` (the
  engine's cached_tokens / prompt_tokens of every request admitted, aborted ones included, as
  vLLM's prefix-cache hit rate; the token counters above count completed requests only), ``radixkv_evicted_tokens_total``,
  ``radixkv_num_requests_running``, ``radixkv_num_requests_waiting``,
  ``radixkv_kv_capacity_tokens``, ``radixkv_kv_free_tokens``, ``radixkv_kv_evictable_tokens``,
  ``radixkv_kv_protected_tokens``, ``radixkv_kv_usage_ratio`` ((capacity - free) / capacity),
  ``radixkv_page_size``, ``radixkv_kv_bytes_per_token``, ``radixkv_kv_cache_bytes`` and
  ``radixkv_kv_cache_dtype{kv_cache_dtype="..."}`` (1: the pool's K/V dtype);
  ``radixkv_cached_tokens_by_tier_total{tier}`` (the engine's cached
  tokens by where they came from: ``device`` the pool, or a KV tier) and, per KV tier
  (docs/tiers.md; label ``tier``: host, disk, remote), the store's counters
  ``radixkv_kv_tier_{hits,misses,blocks_read,blocks_written,bytes_read,bytes_written,corrupt,errors}_total``,
  the engine's ``radixkv_kv_tier_{lookups,blocks_found,blocks_loaded,load_rejected,load_skipped,write_dropped,served_tokens}_total``
  and ``radixkv_kv_tier_{tails_loaded,tail_tokens}_total`` (tails: a sequence's last partial block),
  the gauges ``radixkv_kv_tier_{used,capacity}_bytes``, ``radixkv_kv_tier_degraded`` (1 while
  the tier fails: every lookup there is a miss) and ``radixkv_kv_tier_write_pending`` (blocks
  queued or being written), and the histogram
  ``radixkv_kv_tier_load_latency_seconds`` (one ``get`` call); speculative decoding's
  ``radixkv_spec_decode_num_draft_tokens_total`` / ``radixkv_spec_decode_num_accepted_tokens_total``
  (vLLM's names; 0 when it is off).

Per tenant (the tenants of the server's API keys, by name: never a key), when any request named
one: ``radixkv_tenant_prompt_tokens_total{tenant}`` and ``radixkv_tenant_cached_tokens_total{tenant}``
(from ``RequestFinished`` events, completed requests, as the totals above), and from the engine
snapshot ``radixkv_tenant_kv_cached_tokens{tenant}`` (tokens its namespaces hold in the prefix
cache now), ``radixkv_tenant_kv_quota_tokens{tenant}`` (its soft quota, where it has one) and
``radixkv_tenant_cache_hit_rate{tenant}`` (its cached / prompt tokens at admission); the three
snapshot gauges list a tenant with a KV quota from the start (0 cached, hit rate 0).

A private registry per app keeps several apps in one process (tests) from colliding.
"""

from __future__ import annotations

from typing import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from radixkv.engine.events import Event, RequestAdmitted, RequestFinished
from radixkv.engine.stats import EngineStats

__all__ = ["ServerMetrics", "CONTENT_TYPE_LATEST"]

_UNCOMPLETED = frozenset(("abort", "error"))
"""Finish reasons of a request that did not complete (its client saw no ``usage``): aborted, or
failed (a 500 ``request_failed``)."""

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class _EngineCollector(Collector):
    """Exposes the latest engine snapshot given to :meth:`ServerMetrics.update_engine`."""

    def __init__(self) -> None:
        self.stats: EngineStats | None = None

    def collect(self) -> Iterator[Metric]:
        s = self.stats
        if s is None:
            return
        gauges = [
            ("cache_hit_rate", "Prefix-cache hit rate of the engine: cached_tokens / prompt_tokens.", s.hit_rate),
            ("num_requests_running", "Requests (samples) in the engine's running batch.", s.running),
            ("num_requests_waiting", "Requests in the engine's waiting queue.", s.waiting),
            ("kv_capacity_tokens", "KV pool capacity in tokens.", s.capacity),
            ("kv_free_tokens", "KV slots not held by any request or the prefix cache.", s.free),
            ("kv_evictable_tokens", "KV slots held only by the prefix cache (unlocked, evictable).", s.evictable),
            ("kv_protected_tokens", "KV slots of cached prefixes locked by running requests.", s.protected),
            ("page_size", "Tokens per KV page.", s.page_size),
            (
                "kv_bytes_per_token",
                "K+V bytes of one token in every layer (fp8 scales included).",
                s.kv_bytes_per_token,
            ),
            ("kv_cache_bytes", "Bytes of the KV pool's K/V tensors (scales included).", s.kv_cache_bytes),
        ]
        for name, doc, value in gauges:
            yield GaugeMetricFamily(f"radixkv_{name}", doc, value=float(value))
        dtype = GaugeMetricFamily(
            "radixkv_kv_cache_dtype", "K/V storage dtype of the KV pool (1 for its name).", labels=["kv_cache_dtype"]
        )
        dtype.add_metric([s.kv_cache_dtype], 1.0)
        yield dtype
        if s.capacity:
            yield GaugeMetricFamily(
                "radixkv_kv_usage_ratio",
                "Fraction of the KV pool in use: (capacity - free) / capacity.",
                value=(s.capacity - s.free) / s.capacity,
            )
        yield CounterMetricFamily(
            "radixkv_evicted_tokens", "Tokens evicted from the prefix cache since start.", value=float(s.evicted_tokens)
        )
        yield from _tier_metrics(s)
        yield CounterMetricFamily(
            "radixkv_spec_decode_num_draft_tokens",
            "Draft tokens verified by speculative decoding since start.",
            value=float(s.spec_draft_tokens),
        )
        yield CounterMetricFamily(
            "radixkv_spec_decode_num_accepted_tokens",
            "Draft tokens accepted by speculative decoding since start.",
            value=float(s.spec_accepted_tokens),
        )
        yield from _tenant_families(s)


_TIER_COUNTERS = (
    ("hits", "hits", "Blocks a KV tier returned (verified)."),
    ("misses", "misses", "Blocks asked of a KV tier that it did not hold."),
    ("blocks_read", "blocks_read", "Blocks read from a KV tier."),
    ("blocks_written", "blocks_written", "Blocks written to a KV tier."),
    ("bytes_read", "bytes_read", "Bytes read from a KV tier."),
    ("bytes_written", "bytes_written", "Bytes written to a KV tier."),
    ("corrupt", "corrupt", "Stored blocks of a KV tier that failed verification (dropped, never loaded)."),
    ("errors", "errors", "Failed calls to a KV tier's backend (each a miss or a lost write)."),
    ("lookups", "lookups", "Blocks the engine looked up in a KV tier."),
    ("blocks_found", "found", "Blocks a KV tier held when looked up."),
    ("blocks_loaded", "loaded", "Blocks loaded from a KV tier into the pool's staging buffer."),
    ("load_rejected", "load_rejected", "Blocks a KV tier returned that the engine refused (tokens, layout, size)."),
    ("load_skipped", "load_skipped", "Blocks held by a KV tier but not loaded: recomputing them was cheaper."),
    ("write_dropped", "write_dropped", "Blocks whose write to a KV tier was dropped (write backlog full)."),
    ("served_tokens", "served_tokens", "Prompt tokens a KV tier served to requests."),
    ("tails_loaded", "tails_loaded", "Tail records (a sequence's last partial block) loaded from a KV tier."),
    ("tail_tokens", "tail_tokens", "Tokens of the tail records loaded from a KV tier."),
)


def _tier_metrics(s: EngineStats) -> Iterator[Metric]:
    """The KV tier families of an engine snapshot (module docstring)."""
    by = CounterMetricFamily(
        "radixkv_cached_tokens_by_tier", "Cached prompt tokens by where they came from.", labels=["tier"]
    )
    for m, n in (s.cached_tokens_by_tier or {}).items():
        by.add_metric([m], float(n))
    yield by
    if not s.tiers:
        return
    for name, key, doc in _TIER_COUNTERS:
        fam = CounterMetricFamily(f"radixkv_kv_tier_{name}", doc, labels=["tier"])
        for m, t in s.tiers.items():
            fam.add_metric([m], float(t.get(key, 0) or 0))
        yield fam
    for name, key, doc in (
        ("used_bytes", "used_bytes", "Bytes a KV tier holds."),
        ("capacity_bytes", "capacity_bytes", "A KV tier's byte budget."),
        ("degraded", "degraded", "1 while a KV tier fails (its lookups are misses), else 0."),
        ("write_pending", "write_pending", "Blocks queued for a KV tier or being written to it now."),
    ):
        fam = GaugeMetricFamily(f"radixkv_kv_tier_{name}", doc, labels=["tier"])
        for m, t in s.tiers.items():
            fam.add_metric([m], float(t.get(key, 0) or 0))
        yield fam
    hist = HistogramMetricFamily(
        "radixkv_kv_tier_load_latency_seconds", "Seconds of one load (get) from a KV tier.", labels=["tier"]
    )
    for m, t in s.tiers.items():
        lat = t.get("load_latency") or {}
        bounds, counts = lat.get("buckets", []), lat.get("counts", [])
        if len(counts) != len(bounds) + 1:
            continue
        acc, buckets = 0, []
        for b, c in zip([*map(str, bounds), "+Inf"], counts):
            acc += c
            buckets.append((b, float(acc)))
        hist.add_metric([m], buckets, float(lat.get("sum", 0.0)))
    yield hist


def _tenant_families(s: EngineStats) -> Iterator[Metric]:
    """The per-tenant gauges of an engine snapshot (module docstring); none without tenants."""
    if not s.tenants:
        return
    held = GaugeMetricFamily(
        "radixkv_tenant_kv_cached_tokens", "Tokens a tenant's namespaces hold in the prefix cache.", labels=["tenant"]
    )
    quota = GaugeMetricFamily(
        "radixkv_tenant_kv_quota_tokens", "A tenant's soft KV quota in tokens.", labels=["tenant"]
    )
    rate = GaugeMetricFamily(
        "radixkv_tenant_cache_hit_rate", "A tenant's prefix-cache hit rate: cached / prompt tokens.", labels=["tenant"]
    )
    for name, row in s.tenants.items():
        held.add_metric([name], float(row["cached"]))
        if row.get("quota") is not None:
            quota.add_metric([name], float(row["quota"]))
        rate.add_metric([name], float(row["hit_rate"]))
    yield held
    yield quota
    yield rate


class ServerMetrics:
    """The metrics of one app; ``registry`` is private to it.

    Attributes are ``prometheus_client`` metrics updated by the request handlers; call
    :meth:`update_engine` with a fresh engine snapshot before :meth:`render`.
    """

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("radixkv_requests", "API requests accepted, by endpoint.", ["endpoint"], registry=r)
        self.request_errors = Counter(
            "radixkv_request_errors", "API requests answered with an error, by HTTP status.", ["status"], registry=r
        )
        self.finished = Counter(
            "radixkv_requests_finished", "Choices finished, by finish_reason (abort: client went away).",
            ["finish_reason"], registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter("radixkv_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.cached_tokens = Counter(
            "radixkv_cached_tokens", "Prompt tokens of finished requests served from the prefix cache.", registry=r
        )
        self.generation_tokens = Counter("radixkv_generation_tokens", "Tokens generated.", registry=r)
        self.tenant_prompt_tokens = Counter(
            "radixkv_tenant_prompt_tokens", "Prompt tokens of a tenant's finished requests.", ["tenant"], registry=r
        )
        self.tenant_cached_tokens = Counter(
            "radixkv_tenant_cached_tokens", "Prompt tokens of a tenant's finished requests served from the prefix cache.",
            ["tenant"], registry=r,
        )  # fmt: skip
        self.missed_tokens = Counter(
            "radixkv_missed_prompt_tokens", "Prompt tokens of finished requests not served from the prefix cache, by cause.",
            ["cause"], registry=r,
        )  # fmt: skip
        self.ttft = Histogram(
            "radixkv_time_to_first_token_seconds", "Time from request arrival to its first output.",
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.e2e = Histogram(
            "radixkv_e2e_request_latency_seconds", "Time from request arrival to its last output.",
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self._engine = _EngineCollector()
        r.register(self._engine)
        # missed tokens by cause of the admitted, unfinished requests (engine thread only)
        self._outcomes: dict[str, dict] = {}
        # requests whose sampled tokens their clients never see (:meth:`hide_outputs`)
        self._hidden: set[str] = set()

    def hide_outputs(self, request_ids, hide: bool = True) -> None:
        """Count none of these requests' sampled tokens in ``radixkv_generation_tokens_total``
        (their clients are shown none: SGLang's ``max_new_tokens`` 0); ``hide=False`` forgets
        them (a request refused before it ran). Call before submitting them."""
        for rid in request_ids:
            if hide:
                self._hidden.add(rid)
            else:
                self._hidden.discard(rid)

    def update_engine(self, snapshot: EngineStats) -> None:
        """Store an engine snapshot (``Engine.cache_stats()``) for the next :meth:`render`."""
        self._engine.stats = snapshot

    def on_event(self, event: Event) -> None:
        """Count an engine :class:`~radixkv.engine.events.RequestFinished` or a
        :class:`~radixkv.engine.events.RequestAdmitted` with a cache outcome (subscribe with
        ``kinds=(RequestFinished, RequestAdmitted)``; other events are ignored)."""
        if isinstance(event, RequestAdmitted):
            if event.cache_outcome is not None:  # counted when the request completes (below)
                self._outcomes[event.request_id] = event.cache_outcome.missed
            return
        if not isinstance(event, RequestFinished):
            return
        missed = self._outcomes.pop(event.request_id, None)
        hidden = event.request_id in self._hidden
        self._hidden.discard(event.request_id)
        for reason in event.finish_reasons:
            self.finished.labels(finish_reason=reason).inc()
        if not _UNCOMPLETED.intersection(event.finish_reasons):  # token counts: completed requests only
            self.prompt_tokens.inc(event.num_prompt_tokens)
            self.cached_tokens.inc(event.num_cached_tokens)
            self.generation_tokens.inc(0 if hidden else event.num_output_tokens)
            for cause, n in (missed or {}).items():
                self.missed_tokens.labels(cause=cause).inc(n)
            tenant = event.namespace.tenant if event.namespace is not None else None
            if tenant is not None:
                self.tenant_prompt_tokens.labels(tenant=tenant).inc(event.num_prompt_tokens)
                self.tenant_cached_tokens.labels(tenant=tenant).inc(event.num_cached_tokens)

    def render(self) -> bytes:
        """The registry in Prometheus text exposition format (content type ``CONTENT_TYPE_LATEST``)."""
        return generate_latest(self.registry)
