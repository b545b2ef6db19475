"""Prometheus metrics of one server (``GET /metrics``), in a private ``CollectorRegistry``.

Two sources, both exposed with the ``radixkv_`` prefix:

- Counters and histograms the HTTP layer updates per API request, with the same numbers the
  client sees in ``usage``: ``radixkv_requests_total{endpoint}``,
  ``radixkv_request_errors_total{status}``, ``radixkv_requests_finished_total{finish_reason}``
  (per choice; ``abort`` for a client that went away), ``radixkv_prompt_tokens_total``,
  ``radixkv_cached_tokens_total`` (prompt tokens served from the prefix cache),
  ``radixkv_generation_tokens_total``, ``radixkv_time_to_first_token_seconds``,
  ``radixkv_e2e_request_latency_seconds``.
- A snapshot of the engine taken on the engine thread at scrape time
  (``Engine.cache_stats()`` and the scheduler's queues): ``radixkv_cache_hit_rate`` (the
  engine's cached_tokens / prompt_tokens), ``radixkv_evicted_tokens_total``,
  ``radixkv_num_requests_running``, ``radixkv_num_requests_waiting``,
  ``radixkv_kv_capacity_tokens``, ``radixkv_kv_free_tokens``, ``radixkv_kv_evictable_tokens``,
  ``radixkv_kv_protected_tokens``, ``radixkv_kv_usage_ratio`` ((capacity - free) / capacity),
  ``radixkv_page_size``.

A private registry per app keeps several apps in one process (tests) from colliding.
"""

from __future__ import annotations

from typing import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["ServerMetrics", "CONTENT_TYPE_LATEST"]

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class _EngineCollector(Collector):
    """Exposes the latest engine snapshot given to :meth:`ServerMetrics.update_engine`."""

    def __init__(self) -> None:
        self.stats: dict = {}

    def collect(self) -> Iterator[Metric]:
        s = self.stats
        if not s:
            return
        gauges = [
            ("cache_hit_rate", "Prefix-cache hit rate of the engine: cached_tokens / prompt_tokens.", "hit_rate"),
            ("num_requests_running", "Requests (samples) in the engine's running batch.", "running"),
            ("num_requests_waiting", "Requests in the engine's waiting queue.", "waiting"),
            ("kv_capacity_tokens", "KV pool capacity in tokens.", "capacity"),
            ("kv_free_tokens", "KV slots not held by any request or the prefix cache.", "free"),
            ("kv_evictable_tokens", "KV slots held only by the prefix cache (unlocked, evictable).", "evictable"),
            ("kv_protected_tokens", "KV slots of cached prefixes locked by running requests.", "protected"),
            ("page_size", "Tokens per KV page.", "page_size"),
        ]
        for name, doc, key in gauges:
            if s.get(key) is not None:
                yield GaugeMetricFamily(f"radixkv_{name}", doc, value=float(s[key]))
        cap, free = s.get("capacity"), s.get("free")
        if cap and free is not None:
            yield GaugeMetricFamily(
                "radixkv_kv_usage_ratio", "Fraction of the KV pool in use: (capacity - free) / capacity.",
                value=(float(cap) - float(free)) / float(cap),
            )  # fmt: skip
        if s.get("evicted_tokens") is not None:
            yield CounterMetricFamily(
                "radixkv_evicted_tokens",
                "Tokens evicted from the prefix cache since start.",
                value=float(s["evicted_tokens"]),
            )


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

    def update_engine(self, snapshot: dict) -> None:
        """Store an engine snapshot, ``Engine.cache_stats()`` (keys capacity, free, evictable,
        protected, hit_rate, evicted_tokens, running, waiting, page_size; missing keys are not
        exported)."""
        self._engine.stats = dict(snapshot)

    def render(self) -> bytes:
        """The registry in Prometheus text exposition format (content type ``CONTENT_TYPE_LATEST``)."""
        return generate_latest(self.registry)
