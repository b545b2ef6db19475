"""The one interface between the HTTP routes and an engine: :class:`EngineBackend`.

Every route of :func:`radixkv.server.app.create_app` (OpenAI, SGLang's native API, vLLM's
extras, ``/metrics``, ``/cache_stats``, stored Responses) reaches its engine only through this
Protocol, through :class:`~radixkv.server.engine_client.EngineClient`. Two implementations:

* :class:`LocalBackend`: one :class:`~radixkv.async_llm.AsyncLLM` in this process
  (``radixkv serve``); the only server module that touches the engine itself (its static facts,
  posted calls, the pins of finish hooks).
* :class:`radixkv.router.ray.RemoteLLM`: N engine replicas on Ray Serve
  (``radixkv serve --replicas N``); model facts come from a replica, ``cache_stats`` sums the
  replicas', the integrity check runs on every replica, and stored Responses hold no pins there
  (:data:`NO_PINS`).

A finish hook (``generate(..., on_finish=)``) runs where the engine lives, before the final
output is delivered, and gets a :class:`Pins` view: the soft pins of the KV manager on a local
engine, :data:`NO_PINS` across replicas (the replicas' KV cannot be pinned from the ingress).

Growing it: a new engine capability the routes need becomes one documented method here, with a
local and a replica implementation (``flush_refused`` shows how a backend says it does not offer
one: the route answers 409 naming why).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, AsyncIterator, Callable, Hashable, Optional, Protocol, Sequence, runtime_checkable

from radixkv.async_llm import AsyncLLM
from radixkv.engine.stats import EngineStats, merge_tenants
from radixkv.outputs import RequestOutput
from radixkv.sampling_params import SamplingParams
from radixkv.tiers.redis_url import parse_redis_url

__all__ = [
    "EngineBackend",
    "LocalBackend",
    "ModelFacts",
    "NO_PINS",
    "Pins",
    "as_backend",
    "engine_load",
    "model_facts_of",
    "sum_stats",
]


@dataclass(frozen=True)
class ModelFacts:
    """Static facts of the served model and engine (fixed once the engine is built).

    Attributes:
        model_path: the ``--model`` given (a name, GGUF file or HF directory).
        tokenizer_path: the local Hugging Face directory the tokenizer was read from.
        model_type: the HF config's ``model_type`` (e.g. ``"llama"``).
        architectures: the HF config's ``architectures``.
        vocab_size: rows of the model's logits (token ids are in ``[0, vocab_size)``).
        max_context_len: longest prompt + output the engine accepts, in tokens.
        page_size: tokens per KV page.
        config: the resolved :class:`~radixkv.config.EngineConfig` as a JSON-ready dict (dicts
            and lists as JSON, ``speculative_config`` as its fields' object, other values that
            are not JSON scalars, e.g. the dtype, as strings; ``remote_cache_url``'s password as
            ``***``).
    """

    model_path: Optional[str]
    tokenizer_path: Optional[str]
    model_type: Optional[str]
    architectures: Optional[list[str]]
    vocab_size: Optional[int]
    max_context_len: int
    page_size: Optional[int] = None
    config: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """The facts as a plain dict (what crosses Ray; :meth:`from_dict` reads it back)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelFacts":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


def _json_value(v: Any) -> Any:
    """A config value as JSON: scalars as they are, dicts and lists / tuples element-wise, an
    object with ``as_dict`` (``SpeculativeConfig``) as that dict, anything else (a dtype) as its
    ``str``."""
    if isinstance(v, (int, float, str, bool, type(None))):
        return v
    if isinstance(v, dict):
        return {str(k): _json_value(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json_value(x) for x in v]
    if callable(getattr(v, "as_dict", None)):
        return _json_value(v.as_dict())
    return str(v)


def model_facts_of(engine: Any) -> ModelFacts:
    """The :class:`ModelFacts` of an :class:`~radixkv.engine.Engine` (static attributes only, so
    any thread may read them)."""
    cfg = getattr(engine, "config", None)
    hf = getattr(getattr(engine, "runner", None), "hf_config", None)
    config: dict[str, Any] = {}
    if cfg is not None:
        config = {k: _json_value(v) for k, v in vars(cfg).items()}
        if config.get("remote_cache_url"):
            # NOTE: /server_info shows this dict; the Redis password must never reach a client
            config["remote_cache_url"] = parse_redis_url(config["remote_cache_url"]).redacted()
    arch = getattr(hf, "architectures", None)
    return ModelFacts(
        model_path=config.get("model"),
        tokenizer_path=getattr(engine.tokenizer, "name_or_path", None),
        model_type=getattr(hf, "model_type", None),
        architectures=list(arch) if arch is not None else None,
        vocab_size=int(getattr(engine, "vocab_size", 0)) or None,
        max_context_len=int(engine.max_context_len),
        page_size=config.get("page_size"),
        config=config,
    )


def _sum_nested(dicts: Sequence[dict]) -> dict:
    """Dicts of numbers (and nested dicts, lists of numbers, bools) summed key by key: numbers
    added (rates, the keys ending in ``_per_token``: the largest), bools or-ed, lists added
    element-wise, None kept only when every value is None (a cost not measured anywhere), other
    values the first's."""
    out: dict = {}
    for d in dicts:
        for k, v in d.items():
            if k not in out:
                out[k] = v if not isinstance(v, dict) else _sum_nested([v])
            elif k.endswith("_per_token") and v is not None:
                out[k] = v if out[k] is None else max(out[k], v)
            elif isinstance(v, bool):
                out[k] = bool(out[k]) or v
            elif isinstance(v, dict):
                out[k] = _sum_nested([out[k], v])
            elif isinstance(v, (int, float)) and isinstance(out[k], (int, float)):
                out[k] = out[k] + v
            elif isinstance(v, list) and isinstance(out[k], list) and len(v) == len(out[k]):
                out[k] = [a + b if not isinstance(a, str) else a for a, b in zip(out[k], v)]
            elif out[k] is None:
                out[k] = v
    return out


def _sum_tiers(per_engine: Sequence[dict]) -> dict:
    """Several engines' ``EngineStats.tiers`` as one (:func:`_sum_nested`), except what is not a
    count: a ``load_latency`` histogram's bucket bounds (the same on every engine: the first's,
    its counts summed), and the sizes of the one ``remote`` tier every replica shares
    (``used_bytes``, ``capacity_bytes``: the largest any replica reports, not one per replica)."""
    out = _sum_nested(per_engine)
    for medium, t in out.items():
        firsts = [p[medium] for p in per_engine if isinstance(p.get(medium), dict)]
        lat = t.get("load_latency")
        if isinstance(lat, dict) and "buckets" in lat:
            lat["buckets"] = next(list(f["load_latency"]["buckets"]) for f in firsts if "load_latency" in f)
        if medium == "remote":
            for key in ("used_bytes", "capacity_bytes"):
                if key in t:
                    t[key] = max(int(f.get(key) or 0) for f in firsts)
    return out


# facts of each engine's configuration (the same on every replica): the first replica's, not a sum
_PER_ENGINE_FACTS = {"page_size": 1, "prefix_cache": "radix", "kv_cache_dtype": "float32", "kv_bytes_per_token": 0}


def sum_stats(per_engine: Sequence[dict[str, Any]]) -> EngineStats:
    """Several engines' ``EngineStats.as_dict()`` as one :class:`EngineStats`: counts and sizes
    summed (``kv_cache_bytes`` too: the pools' total, as ``capacity``), ``hit_rate`` recomputed
    from the sums, the configuration facts ``page_size``, ``prefix_cache``, ``kv_cache_dtype`` and
    ``kv_bytes_per_token`` the first's (every replica has the same), ``tenants`` merged
    (:func:`~radixkv.engine.stats.merge_tenants`); ``cached_tokens_by_tier`` and the per-tier
    ``tiers`` counters summed per key (a ``degraded`` tier: on any replica; the cost model's
    seconds per token: the slowest replica's; :func:`_sum_tiers` says what is not summed)."""
    agg: dict[str, Any] = {}
    for k in EngineStats.__dataclass_fields__:
        if k in _PER_ENGINE_FACTS:
            agg[k] = per_engine[0][k] if per_engine else _PER_ENGINE_FACTS[k]
        elif k == "tenants":
            agg[k] = merge_tenants(p.get(k) for p in per_engine)
        elif k == "tiers":
            agg[k] = _sum_tiers([p.get(k) or {} for p in per_engine])
        elif k == "cached_tokens_by_tier":
            agg[k] = _sum_nested([p.get(k) or {} for p in per_engine])
        elif k != "hit_rate":
            agg[k] = sum(int(p.get(k, 0)) for p in per_engine)
    agg["hit_rate"] = agg["cached_tokens"] / agg["prompt_tokens"] if agg["prompt_tokens"] else 0.0
    return EngineStats(**agg)


def engine_load(rank: int, stats: dict[str, Any]) -> dict[str, int]:
    """One engine's entry of SGLang's ``/get_load`` from its ``EngineStats.as_dict()``
    (:meth:`EngineBackend.load`)."""
    running, waiting = int(stats["running"]), int(stats["waiting"])
    held = int(stats["capacity"]) - int(stats["free"]) - int(stats["evictable"])
    return {"dp_rank": rank, "num_reqs": running + waiting, "num_waiting_reqs": waiting, "num_tokens": held}


# ---------------------------------------------------------------------------- pins
class Pins(Protocol):
    """What a finish hook may do with the KV its request left cached (on the engine's thread).

    A pin is opaque to the caller: ``None`` means nothing is pinned; ``len(pin)`` is the tokens
    it holds and ``pin.live`` whether the engine still keeps it (it may drop soft pins: its
    ``max_pinned_tokens`` and ``pin_idle_timeout`` bounds, memory a running request needs).
    """

    def pin_prefix(self, tokens: Sequence[int], namespace: Hashable = None) -> Any:
        """A soft pin (one reference) on the cached prefix of ``tokens``; None when nothing of
        them is cached or pinning is not offered."""

    def release_pin(self, pin: Any) -> None:
        """Let go of ``pin`` (its tokens become evictable); a no-op on a dead pin."""

    def touch_pin(self, pin: Any) -> None:
        """``pin`` is used now (it becomes the most recently used soft pin)."""


class _EnginePins:
    """:class:`Pins` over a local engine (valid on its thread, inside a finish hook)."""

    __slots__ = ("_engine",)

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def pin_prefix(self, tokens: Sequence[int], namespace: Hashable = None) -> Any:
        return self._engine.pin_prefix(list(tokens), namespace)

    def release_pin(self, pin: Any) -> None:
        self._engine.release_pin(pin)

    def touch_pin(self, pin: Any) -> None:
        self._engine.touch_pin(pin)


class _NoPins:
    """:class:`Pins` where pinning is not offered (engine replicas seen from the ingress)."""

    def pin_prefix(self, tokens: Sequence[int], namespace: Hashable = None) -> None:
        return None

    def release_pin(self, pin: Any) -> None:
        return None

    def touch_pin(self, pin: Any) -> None:
        return None


NO_PINS: Pins = _NoPins()
"""The :class:`Pins` of a backend without pins: ``pin_prefix`` is None, the rest no-ops."""


# ---------------------------------------------------------------------------- the interface
FinishHook = Callable[[Pins, RequestOutput], None]
"""``on_finish(pins, final output)``: run where the engine lives when a request finishes (not on
abort), before its final output is delivered."""


@runtime_checkable
class EngineBackend(Protocol):
    """What the HTTP routes need from an engine, and nothing else.

    Attributes (read-only):
        tokenizer: the model's (transformers) tokenizer; the routes encode prompts and decode
            token ids with it (read-only use is thread-safe).
        max_context_len: longest prompt + output in tokens.
        is_running: False once the engine (or the front end) has stopped: ``/health`` answers
            503 with ``dead_error``.
        dead_error: why it stopped (None while running).
        flush_refused: None when ``reset_prefix_cache`` is offered; else the reason it never is
            (``/flush_cache`` and ``/reset_prefix_cache`` answer 409 ``flush_not_offered`` with it).
    """

    @property
    def tokenizer(self) -> Any: ...

    @property
    def max_context_len(self) -> int: ...

    @property
    def is_running(self) -> bool: ...

    @property
    def dead_error(self) -> Optional[BaseException]: ...

    @property
    def flush_refused(self) -> Optional[str]: ...

    def model_facts(self) -> ModelFacts:
        """The served model's static facts (no engine round trip)."""

    def generate(
        self,
        prompt: Any = None,
        sampling_params: Optional[SamplingParams] = None,
        request_id: Optional[str] = None,
        *,
        prompt_token_ids: Optional[Sequence[int]] = None,
        namespace: Hashable = None,
        on_finish: Optional[FinishHook] = None,
        routing_key: Optional[str] = None,
    ) -> AsyncIterator[RequestOutput]:
        """One request's cumulative ``RequestOutput`` snapshots (the last has ``finished``), as
        :meth:`AsyncLLM.generate <radixkv.async_llm.AsyncLLM.generate>`: submitted at the first
        ``__anext__``, which raises the engine's refusal (a ``RequestError``, ``QueueFullError``);
        closing the iterator (``aclose``, or leaving it unfinished) aborts the request and frees
        its KV. ``on_finish`` gets this backend's :class:`Pins`. ``routing_key``: the
        conversation key of ``--router-policy session`` across replicas (OpenAI's
        ``prompt_cache_key``, else ``user``); one engine has nowhere else to send a request.

        Raises:
            RequestError: bad prompt or parameters (naming the field), a duplicate ``request_id``.
            EngineDeadError: the engine stopped (or, across replicas, the request could not go
                on exactly after its replica died).
            RequestFailed: (in place of the final output) its sampling raised in the engine.
        """

    async def cache_stats(self, check: bool = False) -> EngineStats:
        """The KV pool and prefix-cache statistics (tokens; summed over replicas).

        Args:
            check: first run the engine's integrity check (every slot owned exactly once) where
                the engine lives; across replicas on every replica, and the stats are then the
                replicas' own at that moment.

        Raises:
            AssertionError: the integrity check failed (the route answers 500).
            EngineDeadError: the engine stopped, or a replica did not answer the check.
        """

    async def reset_prefix_cache(self, tiers: bool = False) -> bool:
        """Flush the prefix cache; False (nothing done) while requests are unfinished or when
        not offered (:attr:`flush_refused`).

        Args:
            tiers: also empty the KV tiers the engine owns (host RAM and disk, after the writes
                queued for them; never a shared remote tier), ``/flush_cache?tiers=true``.
        """

    async def replica_health(self) -> Optional[dict[str, int]]:
        """None for one engine; across replicas ``{"live": L, "replicas": N}``: the replicas
        registered with the router, not seen dead and routable (``L``; a replica still starting
        is not), of the ``N`` deployed. ``/health``
        answers 503 when ``L`` is 0 and ``"degraded"`` while ``L < N``."""

    def hold_partials(self, request_id: str) -> None:
        """The consumer of ``request_id``'s stream keeps every output before the final one to
        itself (a non-streamed answer): across replicas, a request whose replica died and that
        would end because a new sample contradicts what its client has (docs/routing.md) is
        restarted instead. One engine: a no-op."""

    def num_unfinished_requests(self) -> int:
        """Requests submitted through this backend whose streams are still open."""

    def subscribe(self, fn: Callable[[Any], None], kinds: Optional[tuple[type, ...]] = None) -> Callable[[], None]:
        """Call ``fn(event)`` for the engine's events of ``kinds`` (all when None); returns the
        unsubscribe function. Across replicas only ``RequestFinished`` and (with its cache outcome)
        ``RequestAdmitted``, rebuilt at the ingress from each final output, or from the last
        output of a request its client left (``"abort"``)."""

    async def abort_requests(self, request_ids: Optional[Sequence[str]] = None, prefix: str = "") -> None:
        """Abort unfinished requests (SGLang's ``/abort_request``): each of ``request_ids`` that
        runs (an unknown or finished id is a no-op), or with None every unfinished request whose
        id starts with ``prefix``. Each one's stream ends with a final output, finish_reason
        ``"abort"`` (its tokens so far), and its KV slots are released; across replicas on the
        replica that runs it (a resumed request too)."""

    async def load(self) -> list[dict[str, int]]:
        """SGLang's ``/get_load``: one dict per engine (the replicas in order), ``dp_rank`` (its
        index), ``num_reqs`` (samples running + waiting), ``num_waiting_reqs`` and ``num_tokens``
        (KV tokens requests and pins hold: ``capacity - free - evictable``), as of now."""

    async def release_pin(self, pin: Any) -> None:
        """Let go of a pin a finish hook took (a deleted stored Response); None and pins of a
        stopped engine are no-ops."""

    def shutdown(self, timeout: Optional[float] = None) -> None:
        """Stop serving (the app's lifespan end with ``shutdown_engine``); idempotent."""


# ---------------------------------------------------------------------------- one local engine
class LocalBackend:
    """:class:`EngineBackend` over an :class:`~radixkv.async_llm.AsyncLLM` in this process.

    Args:
        llm: the running AsyncLLM (its engine's static facts are read once, on first use).
    """

    flush_refused: Optional[str] = None

    def __init__(self, llm: AsyncLLM) -> None:
        self.llm = llm
        self._facts: Optional[ModelFacts] = None

    @property
    def tokenizer(self) -> Any:
        return self.llm.tokenizer

    @property
    def max_context_len(self) -> int:
        return self.llm.max_context_len

    @property
    def is_running(self) -> bool:
        return self.llm.is_running

    @property
    def dead_error(self) -> Optional[BaseException]:
        return self.llm.dead_error

    async def replica_health(self) -> Optional[dict[str, int]]:
        """One engine: None (:attr:`is_running` says it all)."""
        return None

    def hold_partials(self, request_id: str) -> None:
        """One engine: nothing to do (a request never moves)."""

    def model_facts(self) -> ModelFacts:
        if self._facts is None:
            self._facts = model_facts_of(self.llm.engine)
        return self._facts

    def generate(
        self,
        prompt: Any = None,
        sampling_params: Optional[SamplingParams] = None,
        request_id: Optional[str] = None,
        *,
        prompt_token_ids: Optional[Sequence[int]] = None,
        namespace: Hashable = None,
        on_finish: Optional[FinishHook] = None,
        routing_key: Optional[str] = None,
    ) -> AsyncIterator[RequestOutput]:
        hook = None
        if on_finish is not None:

            def hook(engine: Any, out: RequestOutput) -> None:
                on_finish(_EnginePins(engine), out)

        return self.llm.generate(
            prompt, sampling_params, request_id, prompt_token_ids=prompt_token_ids, namespace=namespace, on_finish=hook
        )

    async def cache_stats(self, check: bool = False) -> EngineStats:
        if check:
            await self.llm.call_in_engine_thread(lambda e: e.check_integrity())
        return self.llm.cache_stats()  # the snapshot published after the check ran

    async def reset_prefix_cache(self, tiers: bool = False) -> bool:
        return await self.llm.reset_prefix_cache(tiers)

    def num_unfinished_requests(self) -> int:
        return self.llm.num_unfinished_requests()

    def subscribe(self, fn: Callable[[Any], None], kinds: Optional[tuple[type, ...]] = None) -> Callable[[], None]:
        return self.llm.subscribe(fn, kinds)

    async def abort_requests(self, request_ids: Optional[Sequence[str]] = None, prefix: str = "") -> None:
        if request_ids is None:
            request_ids = [r for r in await self.llm.unfinished_request_ids() if r.startswith(prefix)]
        await self.llm.abort(list(request_ids))

    async def load(self) -> list[dict[str, int]]:
        stats = await self.llm.call_in_engine_thread(lambda e: e.cache_stats(tenants=False))
        return [engine_load(0, stats.as_dict())]

    async def release_pin(self, pin: Any) -> None:
        if pin is not None and self.llm.is_running:
            await self.llm.call_in_engine_thread(lambda e: e.release_pin(pin))

    def shutdown(self, timeout: Optional[float] = 30.0) -> None:
        self.llm.shutdown(timeout)


def as_backend(llm: Any) -> EngineBackend:
    """``llm`` as an :class:`EngineBackend`: an AsyncLLM wrapped in :class:`LocalBackend`, a
    backend (e.g. :class:`~radixkv.router.ray.RemoteLLM`) as it is.

    Raises:
        TypeError: ``llm`` is neither.
    """
    if isinstance(llm, AsyncLLM):
        return LocalBackend(llm)
    if not isinstance(llm, EngineBackend):
        raise TypeError(f"create_app needs an AsyncLLM or an EngineBackend, got {type(llm).__name__}")
    return llm
