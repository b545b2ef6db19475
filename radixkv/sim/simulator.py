"""Cache-only replay: a trace of token sequences through the engine's own KV manager, no model.

Each request, in arrival order, runs to completion before the next one arrives, and goes through
exactly the slot path the engine uses for it (:class:`~radixkv.engine.kv_manager.KVManager`
over a real prefix cache and :class:`~radixkv.memory.allocator.SlotAllocator`): ``lock_prefix``
(the match of all prompt tokens but the last) -> the cache outcome
(:class:`~radixkv.engine.outcome.OutcomeTracker`, the same classifier as the engine's) ->
``reserve`` + ``admit`` of the first prefill chunk (evicting least-recently-used unlocked
prefixes when the pool is short) -> ``grow`` + ``hand_over`` of each chunk -> decode pages ->
``release`` (the computed tokens, all but the last generated one, go into the cache, the rest
is freed). So a replay gives the same cached tokens, outcomes and evictions as the engine fed
the same requests one at a time (tests/test_sim.py checks it). The
simulator's :attr:`CacheSimulator.events` carries the same cache events as an engine's, so
observers (the explainer, a router model) subscribe the same way.

The capacity is in slots (tokens); a KV memory in bytes at a K/V dtype becomes slots with
:func:`capacity_for_memory` (``simulate(..., kv_cache_memory_bytes=, kv_bytes_per_token=)``), the
engine's own rule: a smaller dtype holds more tokens in the same memory, and nothing else changes.

Hit rate = cached prompt tokens / prompt tokens of the served requests. A request longer than the
whole pool is skipped (counted in ``skipped``). Slot conservation and the cache's own invariants
are checked at the end of every :meth:`CacheSimulator.run`.

KV tiers below the pool (``tiers``: capacities in tokens per tier, :mod:`radixkv.sim.tiers`): a
request's whole blocks after the pool's match that a tier holds count as cached (by tier in
``cached_tokens_by_tier``), as the engine loads them; its slot path is the same (the engine inserts
what it loads before admitting the request).

Policies (:data:`POLICIES`, extended by the eviction and routing work): ``radix``
(:class:`~radixkv.cache.radix_tree.RadixCache`, LRU), ``radix-lfu`` / ``radix-gdf`` /
``radix-reuse-odds`` (its other eviction policies), ``hash``
(:class:`~radixkv.cache.hash_cache.HashBlockCache`), ``none``
(:class:`~radixkv.cache.none.NoPrefixCache`); any other :class:`~radixkv.cache.base.PrefixCache`
instance can be passed as ``cache``.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterable, Optional, Sequence, Union

from radixkv.cache import HashBlockCache, NoPrefixCache, RadixCache
from radixkv.cache.evict_policy import ReuseOdds
from radixkv.cache.outcome import CAUSES, CacheOutcome
from radixkv.config import (
    asks_write_back,
    kv_tokens_for_bytes,
    parse_memory_bytes,
    resolve_write_policy,
    write_back_refused,
)
from radixkv.engine.events import EventBus
from radixkv.engine.kv_manager import KVManager
from radixkv.engine.outcome import OutcomeTracker
from radixkv.engine.request import Request
from radixkv.memory.allocator import SlotAllocator
from radixkv.memory.kv_pool import ReqToTokenPool
from radixkv.namespace import Namespace
from radixkv.sampling_params import SamplingParams
from radixkv.sim.tiers import TierModel

__all__ = [
    "POLICIES",
    "make_cache",
    "SimRequest",
    "RequestResult",
    "SimResult",
    "CacheSimulator",
    "simulate",
    "capacity_bound",
    "capacity_for_memory",
    "capacity_needed",
]

POLICIES: dict[str, Callable[[int, str], Any]] = {
    "radix": lambda page_size, hash_algo: RadixCache(page_size),
    "radix-lfu": lambda page_size, hash_algo: RadixCache(page_size, eviction_policy="lfu"),
    "radix-gdf": lambda page_size, hash_algo: RadixCache(page_size, eviction_policy="gdf"),
    "radix-reuse-odds": lambda page_size, hash_algo: RadixCache(page_size, eviction_policy="reuse-odds"),
    "radix-reuse-odds-h1": lambda page_size, hash_algo: RadixCache(page_size, eviction_policy=ReuseOdds(horizon=1.0)),
    "hash": lambda page_size, hash_algo: HashBlockCache(page_size, hash_algo),
    "none": lambda page_size, hash_algo: NoPrefixCache(page_size),
}
"""Policy name -> ``factory(page_size, hash_algo)`` building its prefix cache. ``radix`` evicts
LRU (RadixCache's default); ``radix-<name>`` uses :mod:`radixkv.cache.evict_policy`'s policy of
that name (``radix-reuse-odds-h1``: reuse-odds with ``horizon=1``, its earlier weighting). The offline bound (Belady's MIN) is :func:`radixkv.sim.belady.optimal`, on the same
traces."""


def make_cache(policy: str, page_size: int = 1, hash_algo: str = "builtin") -> Any:
    """The prefix cache of ``policy`` (a key of :data:`POLICIES`).

    Raises:
        ValueError: unknown policy, or a bad ``page_size`` / ``hash_algo``.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {policy!r}")
    return POLICIES[policy](page_size, hash_algo)


@dataclass
class SimRequest:
    """One request of a trace.

    Attributes:
        tokens: the prompt's token ids (non-empty).
        reply: the token ids it generates (their K/V is cached when it finishes, all but the
            last one's, as in the engine); empty: one token whose K/V is never computed.
        namespace: its prefix-cache namespace: None, a :class:`~radixkv.namespace.Namespace`,
            or any hashable (normalized by ``Namespace.of``, as ``Engine.add_request`` does).
        max_prefix_len: the most tokens it may take from the cache (None: no limit): a request
            with prompt logprobs from position ``s`` takes at most ``max(s, 1) - 1``
            (``Request.max_prefix_len``; none when that is the prompt's last position or past it).
    """

    tokens: Sequence[int]
    reply: Sequence[int] = ()
    namespace: Hashable = None
    max_prefix_len: Optional[int] = None


@dataclass
class RequestResult:
    """What one request got: prompt tokens, cached tokens (the pool's and the tiers'), its
    outcome (None when outcomes are off or it was skipped; the pool's view), whether it was
    served, and the cached tokens the KV tiers served, by tier."""

    index: int
    num_prompt_tokens: int
    num_cached_tokens: int
    outcome: Optional[CacheOutcome]
    served: bool = True
    tier_tokens: dict = field(default_factory=dict)


@dataclass
class SimResult:
    """The totals (and, unless ``keep_requests=False``, per-request results) of one replay."""

    policy: str
    page_size: int
    capacity: int
    requests: list = field(default_factory=list)
    num_requests: int = 0
    skipped: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    evicted_tokens: int = 0
    cache_tokens_end: int = 0
    missed_by_cause: dict = field(default_factory=dict)
    seconds: float = 0.0
    cached_tokens_by_tier: dict = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        """Cached prompt tokens / prompt tokens (0 for an empty trace)."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens that had to be computed."""
        return self.prompt_tokens - self.cached_tokens

    def as_dict(self, requests: bool = False) -> dict:
        """JSON-ready totals (per-request rows too when ``requests``)."""
        out = dict(
            policy=self.policy,
            page_size=self.page_size,
            capacity=self.capacity,
            requests=self.num_requests,
            skipped=self.skipped,
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens,
            prefill_tokens=self.prefill_tokens,
            hit_rate=self.hit_rate,
            evicted_tokens=self.evicted_tokens,
            cache_tokens_end=self.cache_tokens_end,
            missed_by_cause=dict(self.missed_by_cause),
            seconds=round(self.seconds, 3),
            cached_tokens_by_tier=dict(self.cached_tokens_by_tier),
        )
        if requests:
            out["per_request"] = [
                dict(
                    index=r.index,
                    prompt_tokens=r.num_prompt_tokens,
                    cached_tokens=r.num_cached_tokens,
                    served=r.served,
                    outcome=None if r.outcome is None else r.outcome.as_dict(),
                )
                for r in self.requests
            ]
        return out


def capacity_bound(requests: Sequence[SimRequest], page_size: int = 1) -> int:
    """Slots that are never short for ``requests`` (each request adds at most its own tokens,
    plus page rounding): what ``capacity=None`` ("infinite") means."""
    return sum(len(r.tokens) + len(r.reply) for r in requests) + 2 * page_size * max(1, len(requests))


def capacity_needed(requests: Sequence[SimRequest], page_size: int = 1) -> int:
    """The least capacity (slots, whole pages) that serves every one of ``requests``: the largest
    prompt + reply, as :meth:`CacheSimulator.serve` sizes it. Below it the largest requests are
    skipped (the engine refuses a request that does not fit its pool), so a hit rate measured
    there counts the other requests only."""
    most = max((len(r.tokens) + max(len(r.reply) - 1, 0) for r in requests), default=1)
    return -(-most // page_size) * page_size


def _tier_policy(cache: Any, policy: str, asked: Union[None, str, dict]) -> dict:
    """The tiers' write policy as the engine runs it: a cache that does not report the blocks it
    evicts (no ``evict_listener``: ``hash``) has every tier written through, and an explicit
    ``write_back`` with it is a ValueError (as ``EngineConfig`` refuses it)."""
    resolved = resolve_write_policy(asked)
    if hasattr(cache, "evict_listener"):
        return resolved
    if asks_write_back(asked):
        raise write_back_refused(policy, asked)
    return {m: "write_through" for m in resolved}


class CacheSimulator:
    """Replays requests through a prefix cache + slot allocator at a fixed capacity (module doc).

    Args:
        policy: a key of :data:`POLICIES` (ignored when ``cache`` is given; then its name is
            ``type(cache).__name__``).
        page_size: tokens per page (>= 1).
        capacity: KV slots (tokens), floored to whole pages.
        hash_algo: the ``hash`` policy's key function ("builtin" or "sha256"; same hit rates).
        outcomes: classify every request (:mod:`radixkv.cache.outcome`).
        cache: a prefix cache instance to use instead of ``policy``'s.
        max_evicted_blocks: bound of the outcome tracker's evicted-block record.
        chunked_prefill_size: prefill tokens per step, as the engine's option (default 2048,
            the engine's CPU default; it decides when evictions happen under memory pressure).
        tiers: KV tiers below the pool, ``{medium: capacity in tokens}`` (:mod:`radixkv.sim.tiers`),
            or None.
        tier_write_policy: the tiers' write policy as ``EngineConfig.kv_tier_write_policy`` takes
            it (None: the engine's defaults).

    Attributes:
        kv: the :class:`~radixkv.engine.kv_manager.KVManager`.
        events: its :class:`~radixkv.engine.events.EventBus` (cache events as in the engine).

    Raises:
        ValueError: bad policy, page size or capacity.
    """

    def __init__(
        self,
        policy: str = "radix",
        page_size: int = 1,
        capacity: int = 1 << 20,
        hash_algo: str = "builtin",
        outcomes: bool = True,
        cache: Any = None,
        max_evicted_blocks: int = 1 << 16,
        chunked_prefill_size: int = 2048,
        tiers: Optional[dict] = None,
        tier_write_policy: Union[None, str, dict] = None,
    ) -> None:
        if chunked_prefill_size < 1:
            raise ValueError(f"chunked_prefill_size must be >= 1, got {chunked_prefill_size}")
        self.chunk = chunked_prefill_size
        if cache is None:
            cache = make_cache(policy, page_size, hash_algo)
        else:
            policy = type(cache).__name__
        page_size = cache.page_size
        if not isinstance(capacity, int) or capacity < page_size:
            raise ValueError(f"capacity must be an int >= page_size ({page_size}), got {capacity!r}")
        capacity -= capacity % page_size
        self.policy = policy
        self.page_size = page_size
        self.capacity = capacity
        self.events = EventBus()
        self._ctx = 4096
        self.tiers = TierModel(tiers, _tier_policy(cache, policy, tier_write_policy)) if tiers else None
        # NOTE: the tier model is the KV manager's tiers: it hears the engine's own tier writes
        self.kv = KVManager(
            cache, SlotAllocator(capacity, page_size), ReqToTokenPool(1, self._ctx), self.events, tiers=self.tiers
        )
        self.tracker = OutcomeTracker(cache, self.events, max_evicted_blocks) if outcomes else None
        self._params = SamplingParams()
        self._n = 0

    @property
    def cache(self) -> Any:
        """The prefix cache."""
        return self.kv.cache

    def serve(self, req: SimRequest) -> RequestResult:
        """Serve one request to completion, through the engine's slot path step by step: the
        first prefill chunk admitted on the locked prefix (``reserve``), every chunk handed to
        the cache after it is computed (``hand_over``), each decode page made free when needed
        (``ensure_free``; the engine evicts one page's worth per decode step, the replay the
        whole shortfall at once: the same pages, as eviction is page-granular; page by page with
        a write-back tier, :meth:`_decode_slots`), ``release``. A tier load's slots are made free
        before the prefill's, as the engine installs it first.
        A request whose prompt + reply is larger than the pool is not served.

        Raises:
            ValueError: an empty prompt.
        """
        tokens = list(req.tokens)
        if not tokens:
            raise ValueError("SimRequest.tokens is empty: a prompt needs at least 1 token")
        reply = list(req.reply)
        i = self._n
        self._n += 1
        kv = self.kv
        n = len(tokens)
        final = n + max(len(reply) - 1, 0)  # positions whose K/V gets computed
        if kv.pages(final) > self.capacity:
            return RequestResult(i, n, 0, None, served=False)
        if kv.pages(final) > self._ctx:  # a longer block table (idle between requests, so it can be replaced)
            self._ctx = max(kv.pages(final), 2 * self._ctx)  # whole pages: a page may pass the prompt's end
            kv.replace_block_table(ReqToTokenPool(1, self._ctx))
        r = Request(str(i), 0, tokens, self._params, Namespace.of(req.namespace))
        if req.max_prefix_len is not None and req.max_prefix_len < n - 1:  # as Engine's prompt logprobs
            r.prompt_lp_pos = req.max_prefix_len
        prefix = kv.lock_prefix(r)
        if self.tracker is not None:
            self.tracker.on_admit(r, prefix.length, ())
        loaded: dict = {}
        if self.tiers is not None and kv.shares:  # the engine's limit: below the last token
            limit = (n - 1) // self.page_size * self.page_size
            spans = self.tiers.lookup(r.namespace, tokens, prefix.length, limit, self.page_size)
            for a, b, m in spans:
                loaded[m] = loaded.get(m, 0) + b - a
            if spans and r.cache_outcome is not None:
                r.cache_outcome = dataclasses.replace(r.cache_outcome, tier_spans=tuple(spans))
            # the engine installs a load before the prefill is admitted: slots for it made free
            # first (its own eviction, which a write-back tier's tails depend on)
            if spans and not kv.ensure_free(spans[-1][1] - prefix.length):
                raise AssertionError("a lone request that fits the pool could not install its load")
        extend = min(n - prefix.length, self.chunk)
        if not kv.reserve(kv.pages(prefix.length + extend) - prefix.length, 0):
            raise AssertionError("a lone request that fits the pool could not be admitted")
        kv.admit(r, prefix, prefix.length + extend)
        r.kv_len = prefix.length + extend
        kv.hand_over(r, r.kv_len)
        while r.kv_len < n:  # the next prefill chunks
            extend = min(n - r.kv_len, self.chunk)
            if not kv.ensure_free(kv.pages(r.kv_len + extend) - len(r.slots)):
                raise AssertionError("a lone request that fits the pool ran out of memory")
            kv.grow(r, r.kv_len + extend)
            r.kv_len += extend
            kv.hand_over(r, r.kv_len)
        r.output_token_ids = reply
        if r.kv_len < final:  # decode: free pages first, then the rest evicted
            self._decode_slots(r, final)
        kv.release(r)
        return RequestResult(i, n, prefix.length + sum(loaded.values()), r.cache_outcome, tier_tokens=loaded)

    def _decode_slots(self, r: Request, final: int) -> None:
        """Slots for ``r``'s decode positions up to ``final``. The engine evicts one page's worth
        per decode step when the pool is full; evicting the whole shortfall in one call frees the
        same pages in the same order (eviction is page-granular, and nothing else touches the
        cache meanwhile), without one call per generated token. Not with a write-back tier: each
        eviction writes the tail of the path it evicted, replacing the one held after the same
        block, so the engine's page-by-page evictions leave the shortest of those tails held
        (the replay evicting at once kept others and served other tokens than the engine)."""
        kv = self.kv
        step = self.page_size if self.tiers is not None and self.tiers.writes_back else kv.pages(final)
        while len(r.slots) < kv.pages(final):
            if not kv.ensure_free(min(step, kv.pages(final) - len(r.slots))):
                raise AssertionError("a lone request that fits the pool ran out of memory")
            kv.grow(r, min(final, len(r.slots) + step))
        r.kv_len = final

    def run(self, requests: Iterable[SimRequest], keep_requests: bool = True) -> SimResult:
        """Serve every request in order; returns the totals (and per-request results).

        Raises:
            AssertionError: slot conservation or a cache invariant broke (a bug).
        """
        res = SimResult(self.policy, self.page_size, self.capacity)
        evicted0 = self.kv.evicted_tokens
        missed = {c: 0 for c in CAUSES}
        t0 = time.perf_counter()
        for req in requests:
            rr = self.serve(req)
            if keep_requests:
                res.requests.append(rr)
            if not rr.served:
                res.skipped += 1
                continue
            res.num_requests += 1
            res.prompt_tokens += rr.num_prompt_tokens
            res.cached_tokens += rr.num_cached_tokens
            for m, t in rr.tier_tokens.items():
                res.cached_tokens_by_tier[m] = res.cached_tokens_by_tier.get(m, 0) + t
            if rr.outcome is not None:
                for c, t in rr.outcome.missed.items():
                    missed[c] += t
        res.seconds = time.perf_counter() - t0
        res.evicted_tokens = self.kv.evicted_tokens - evicted0
        res.cache_tokens_end = self.kv.cache.total_size()
        res.missed_by_cause = {c: t for c, t in missed.items() if t} if self.tracker is not None else {}
        self.kv.check_integrity(())
        return res


def capacity_for_memory(kv_cache_memory_bytes: int | str, kv_bytes_per_token: int, page_size: int = 1) -> int:
    """Slots a KV pool of ``kv_cache_memory_bytes`` holds at ``kv_bytes_per_token`` each (the
    engine's rule, :func:`radixkv.config.kv_tokens_for_bytes`: ``bytes // bytes_per_token``, whole
    pages). ``kv_bytes_per_token`` from ``KVPool.token_bytes(layers, kv_heads, head_dim,
    kv_cache_dtype)`` (fp8 scales included): the dtype only changes how many slots the memory
    holds; the replay moves slots, no K/V.

    Raises:
        ValueError: a bad memory size (:func:`radixkv.config.parse_memory_bytes`), bytes per token
            below 1, or less than one page.
    """
    memory = parse_memory_bytes(kv_cache_memory_bytes)
    if isinstance(kv_bytes_per_token, bool) or not isinstance(kv_bytes_per_token, int) or kv_bytes_per_token < 1:
        raise ValueError(f"kv_bytes_per_token must be an int >= 1, got {kv_bytes_per_token!r}")
    tokens = kv_tokens_for_bytes(memory, kv_bytes_per_token, page_size)
    if tokens < page_size:
        raise ValueError(
            f"kv_cache_memory_bytes {memory} holds no page of {page_size} tokens at {kv_bytes_per_token} bytes per token"
        )
    return tokens


def simulate(
    requests: Sequence[SimRequest],
    policy: str = "radix",
    page_size: int = 1,
    capacity: Optional[int] = None,
    hash_algo: str = "builtin",
    outcomes: bool = True,
    keep_requests: bool = True,
    chunked_prefill_size: int = 2048,
    tiers: Optional[dict] = None,
    tier_write_policy: Union[None, str, dict] = None,
    kv_cache_memory_bytes: int | str | None = None,
    kv_bytes_per_token: Optional[int] = None,
) -> SimResult:
    """One replay of ``requests`` (a sequence) at ``capacity`` slots; None: enough that nothing
    is ever evicted (:func:`capacity_bound`); ``tiers``: KV tier capacities in tokens per tier,
    ``tier_write_policy`` their write policy (as :class:`CacheSimulator`).
    See :class:`CacheSimulator`. Or sized in bytes: ``kv_cache_memory_bytes`` with
    ``kv_bytes_per_token`` (:func:`capacity_for_memory`), instead of ``capacity``.

    Raises:
        ValueError: ``capacity`` and ``kv_cache_memory_bytes`` both given, or the memory without
            ``kv_bytes_per_token``; as :class:`CacheSimulator` and :func:`capacity_for_memory`.
    """
    if kv_cache_memory_bytes is not None:
        if capacity is not None:
            raise ValueError("give kv_cache_memory_bytes or capacity, not both")
        if kv_bytes_per_token is None:
            raise ValueError("kv_cache_memory_bytes needs kv_bytes_per_token (KVPool.token_bytes of the model's shape)")
        capacity = capacity_for_memory(kv_cache_memory_bytes, kv_bytes_per_token, page_size)
    if capacity is None:
        capacity = capacity_bound(requests, page_size)
    sim = CacheSimulator(
        policy,
        page_size,
        max(capacity, page_size),
        hash_algo,
        outcomes,
        chunked_prefill_size=chunked_prefill_size,
        tiers=tiers,
        tier_write_policy=tier_write_policy,
    )
    return sim.run(requests, keep_requests)
