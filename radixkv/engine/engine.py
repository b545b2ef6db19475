"""`Engine`: continuous batching over a prefix cache, one forward pass per :meth:`Engine.step`.

The engine owns the model runner (model + KV pool + block table + attention backend), the
prefix cache and slot allocator behind a :class:`~radixkv.engine.kv_manager.KVManager`, the
:class:`~radixkv.engine.scheduler.Scheduler` and the :class:`~radixkv.engine.events.EventBus`.
Each step applies the messages in its inbox (new requests, aborts, posted calls), lets the
scheduler plan one mixed batch (prefill chunks + decodes), runs the model once, samples, checks
stop conditions (:mod:`radixkv.engine.output`), releases finished requests (their computed tokens
go into the prefix cache) and emits its events. Sampling (grammar masks, logits processors,
logprobs, prompt logprobs) is one call per step into
:class:`~radixkv.sampling.pipeline.SamplingPipeline`; a request with a structured-output
constraint waits outside the scheduler until its grammar has compiled on the grammar backend's
thread (:class:`~radixkv.sampling.grammar.GrammarBackend`), so it delays no other request.

Concurrency (the one model, docs/architecture.md): one thread at a time drives an engine (calls
``step`` and every other method); :class:`~radixkv.llm.LLM` serializes its callers and
:class:`~radixkv.async_llm.AsyncLLM` drives it from its engine thread. From any other thread only
:meth:`add_request`, :meth:`abort_request` and :meth:`post` may be called: they validate and put a
message into the inbox, which the driver applies in order at the start of its next ``step``
(or :meth:`run_posted`).
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import itertools
import logging
import numbers
import os
import threading
import time
import weakref
from itertools import repeat
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence

import torch

from radixkv.cache import HashBlockCache, NoPrefixCache, RadixCache
from radixkv.cache.tenants import tenant_of
from radixkv.config import EngineConfig, asks_write_back, write_back_refused
from radixkv.engine.events import EventBus, RequestAdmitted, RequestFinished, StepFinished
from radixkv.engine.kv_manager import KVManager
from radixkv.engine.outcome import OutcomeTracker
from radixkv.engine.output import NO_TEXT, RequestGroup
from radixkv.engine.request import Request, RequestStatus
from radixkv.engine.scheduler import ScheduledBatch, Scheduler
from radixkv.engine.stats import TENANT_COUNTERS_KEPT, EngineStats, TenantSnapshot, TenantTable
from radixkv.engine.tiers import (
    TierManager,
    build_stores,
    check_budgets,
    check_settings,
    kv_producer,
    model_fingerprint,
)
from radixkv.engine.validation import Limits, check_prompt_fits, validate_request
from radixkv.engine.verify import Verify, verify_rounds
from radixkv.errors import QueueFullError, RequestError
from radixkv.memory.allocator import SlotAllocator
from radixkv.memory.fit import check_table_fits
from radixkv.memory.kv_io import layout_of
from radixkv.memory.kv_pool import KVPool
from radixkv.namespace import Namespace, with_salt
from radixkv.outputs import CACHE_MEDIA, RequestOutput
from radixkv.sampling.grammar import GrammarBackend
from radixkv.sampling.logprobs import TokenDecoder, to_position_logprobs
from radixkv.sampling.pipeline import PromptSegment, SamplingPipeline
from radixkv.sampling.sampler import make_generator
from radixkv.sampling_params import SamplingParams
from radixkv.spec.drafter import Drafter

__all__ = ["Engine"]

logger = logging.getLogger(__name__)


def _load(cfg: EngineConfig) -> Any:
    """``cfg.model`` loaded (a :class:`~radixkv.models.loader.LoadedModel`)."""
    from radixkv.models.loader import load_model  # lazy: the model stack (torch + transformers)

    return load_model(cfg.model, cfg.device, cfg.dtype, quantization=cfg.quantization)


def _default_runner(cfg: EngineConfig, loaded: Any) -> Any:
    """A :class:`~radixkv.executor.model_runner.ModelRunner` over ``loaded``, its KV pool and
    context sized by ``cfg`` once resolved with the model's facts (``cfg`` is updated)."""
    from radixkv.executor.model_runner import ModelRunner  # lazy: the model stack (torch + transformers)

    m = loaded.model
    shape = (m.num_layers, m.num_kv_heads, m.head_dim)
    cfg.resolve(
        kv_bytes_per_token=KVPool.token_bytes(*shape, cfg.kv_cache_dtype),
        float32_kv_bytes_per_token=KVPool.token_bytes(*shape, "float32"),
        max_position_embeddings=int(getattr(loaded.hf_config, "max_position_embeddings", 1 << 62)),
    )
    check_table_fits(cfg.max_running_requests, cfg.max_context_len, cfg.page_size, cfg.device)
    return ModelRunner(
        loaded,
        num_slots=cfg.max_total_tokens,
        page_size=cfg.page_size,
        max_running_requests=cfg.max_running_requests,
        max_context_len=cfg.max_context_len,
        device=cfg.device,
        dtype=cfg.dtype,
        attention_backend=cfg.attention_backend,
        kv_cache_dtype=cfg.kv_cache_dtype,
    )


_SHAPES = {
    "model_runner": ("forward", "build_batch", "req_to_token_pool", "max_context_len", "vocab_size"),
    "loaded_model": ("model", "hf_config", "tokenizer"),
    "tokenizer": ("decode",),  # encode too for text prompts; a decode-only one serves token prompts
    "tier_stores": ("medium", "contains", "get", "put", "close"),
}


def _check_keywords(model_runner: Any, tokenizer: Any, loaded_model: Any, clock: Any, tier_stores: Any) -> Any:
    """Check the Engine keywords that are objects (each None or of the shape the engine uses)
    before anything loads; returns the tokenizer, loaded when given as a name or path (as vLLM's
    ``tokenizer=``: :func:`radixkv.models.loader.load_tokenizer`).

    Raises:
        ValueError: naming the keyword and the attributes it lacks (``clock``: not callable;
            ``tier_stores``: not a list of stores).
    """
    if isinstance(tokenizer, (str, os.PathLike)):
        from radixkv.models.loader import load_tokenizer  # lazy: transformers

        tokenizer = load_tokenizer(tokenizer)
    if isinstance(tier_stores, (str, bytes)) or (tier_stores is not None and not hasattr(tier_stores, "__iter__")):
        raise ValueError(f"tier_stores must be a list of KV tier stores (radixkv.tiers), got {tier_stores!r}")
    given = {"model_runner": [model_runner], "loaded_model": [loaded_model], "tokenizer": [tokenizer]}
    given["tier_stores"] = list(tier_stores or [])
    for name, objs in given.items():
        for obj in objs:
            missing = [a for a in _SHAPES[name] if obj is not None and not hasattr(obj, a)]
            if missing:
                raise ValueError(f"{name}: {type(obj).__name__} {obj!r:.60} has no {', '.join(missing)}")
    if clock is not None and not callable(clock):
        raise ValueError(f"clock must be a function returning seconds, got {clock!r}")
    return tokenizer


def _unshared(loaded: Any, cfg: EngineConfig) -> Any:
    """A ``loaded_model`` the caller gave, as this engine will run it: itself when its weights are
    on ``cfg``'s device in ``cfg``'s dtype (shared with other engines, as meant), else a copy
    holding a converted copy of the model: ``nn.Module.to`` converts in place, which changed the
    weights under every other engine sharing them."""
    param = next(loaded.model.parameters())
    want = torch.device(cfg.device)
    if want.type == "cuda" and want.index is None:
        want = torch.device("cuda", torch.cuda.current_device())
    if param.device == want and param.dtype == cfg.dtype:
        return loaded
    own = copy.copy(loaded)
    own.model = copy.deepcopy(loaded.model)
    return own


def _match_quantization(cfg: EngineConfig, model: Any) -> None:
    """A given ``loaded_model``'s quantization against ``cfg``'s: None takes the model's (so the
    KV tiers' fingerprint names it); another value must be the model's, since the engine does
    not quantize weights another engine may share.

    Raises:
        ValueError: naming ``quantization``, the value given and the model's.
    """
    have = getattr(model, "quantization", None)
    if cfg.quantization is None:
        cfg.quantization = have
    elif cfg.quantization != have:
        raise ValueError(
            f"quantization={cfg.quantization!r} but the loaded_model's weights are "
            f"{'not quantized' if have is None else repr(have)}; load it with "
            f"load_model(..., quantization={cfg.quantization!r}), or leave quantization out"
        )


def _match_runner_pool(cfg: EngineConfig, runner: Any, kv_given: Any) -> None:
    """Check a given runner's KV pool against ``cfg`` (a runner without a
    :class:`~radixkv.memory.kv_pool.KVPool`, as tests' stand-ins, is taken as it is): it holds
    ``max_total_tokens`` slots, in pages of ``page_size``; ``kv_cache_dtype`` as given
    (``kv_given``) ``"auto"`` takes the pool's, another must be the pool's.

    Raises:
        ValueError: naming ``max_total_tokens``, ``page_size`` or ``kv_cache_dtype`` and the pool's value.
    """
    pool = getattr(runner, "kv_pool", None)
    if not isinstance(pool, KVPool):
        return
    if pool.num_slots < cfg.max_total_tokens:
        raise ValueError(
            f"max_total_tokens {cfg.max_total_tokens} is more than the model_runner's KV pool holds "
            f"({pool.num_slots} slots)"
        )
    if pool.page_size != cfg.page_size:
        raise ValueError(
            f"page_size {cfg.page_size} differs from the model_runner's KV pool's page_size {pool.page_size}"
        )
    if isinstance(kv_given, str) and kv_given.strip().lower() == "auto":
        cfg.kv_cache_dtype = pool.kv_cache_dtype
    elif cfg.kv_cache_dtype != pool.kv_cache_dtype:
        raise ValueError(
            f"kv_cache_dtype {cfg.kv_cache_dtype!r} differs from the model_runner's KV pool's {pool.kv_cache_dtype} "
            f"(give 'auto' or {pool.kv_cache_dtype!r})"
        )


def _encoder(tokenizer: Any) -> Optional[Callable[[str], List[int]]]:
    """Text -> token ids without special tokens, for the drafts of forced grammar text (None
    without a transformers-style ``encode``: the drafter then takes xgrammar's split)."""
    encode = getattr(tokenizer, "encode", None)
    return None if encode is None else functools.partial(encode, add_special_tokens=False)


def _default_eos(hf_config: Any, tokenizer: Any) -> List[int]:
    """The EOS ids of the model config and the tokenizer (either may be missing), sorted."""
    eos: set = set()
    for src in (getattr(hf_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(src, int):
            eos.add(src)
        elif isinstance(src, (list, tuple)):
            eos.update(int(t) for t in src)
    return sorted(eos)


def _weak_call(method: Callable[[], None]) -> Callable[[], None]:
    """``method()`` through a weak reference to its object (a no-op once it is collected)."""
    ref = weakref.WeakMethod(method)

    def call() -> None:
        fn = ref()
        if fn is not None:
            fn()

    return call


def _check_eos(ids: Any, vocab_size: int) -> frozenset:
    """``eos_token_ids`` as a frozenset of ids.

    Raises:
        ValueError: naming ``eos_token_ids``: not a list of integer ids in [0, vocab_size).
    """
    iterable = not isinstance(ids, (str, bytes)) and hasattr(ids, "__iter__")
    items = list(ids) if iterable else []
    if not iterable or not all(
        isinstance(t, numbers.Integral) and not isinstance(t, bool) and 0 <= t < vocab_size for t in items
    ):
        raise ValueError(f"eos_token_ids must be a list of integer token ids in [0, {vocab_size}), got {ids!r}")
    return frozenset(int(t) for t in items)


def _make_tiers(cfg: EngineConfig, runner: Any, model: Any, stores: Optional[Sequence[Any]]) -> Optional[TierManager]:
    """The KV tiers of ``cfg`` (or the ``stores`` given), over ``runner``'s KV pool; None without
    any.

    Raises:
        ValueError: tiers without a prefix cache or without a runner's ``kv_pool``, or a store
            refused its configuration (naming the field).
    """
    if stores is None and not cfg.kv_tiers:
        return None
    pool = getattr(runner, "kv_pool", None)
    if cfg.prefix_cache == "none" or pool is None:
        for s in stores or ():
            s.close()
        why = "prefix_cache='none' keeps nothing" if pool is not None else "the model runner has no kv_pool"
        raise ValueError(f"KV tiers (host_cache_bytes, disk_cache_dir, remote_cache_url) need a prefix cache: {why}")
    if model is not None:
        from radixkv.models.fingerprint import config_digest, weights_digest  # lazy: the model stack

        weights = weights_digest(model) + config_digest(model)
    else:  # a runner without a model (tests): its name stands for its weights
        weights = str(getattr(runner, "fingerprint", cfg.model)).encode()
    kv_dtype = getattr(cfg, "kv_cache_dtype", None) or getattr(pool, "dtype", None)
    fp = model_fingerprint(weights, cfg.dtype, kv_dtype, cfg.quantization, layout_of(pool).meta, kv_producer(runner))
    if stores is None:
        check_budgets(cfg, layout_of(pool).token_bytes, layout_of(pool).meta)  # before a store is opened
    stores = list(build_stores(cfg, fp) if stores is None else stores)
    if not stores:
        return None
    return TierManager(stores, pool, fp, cfg.kv_tier_write_policy, write_back_ok=cfg.prefix_cache == "radix")


def _make_cache(cfg: EngineConfig) -> Any:
    """The prefix cache ``cfg.prefix_cache`` names (radix, hash blocks, or none)."""
    quotas = cfg.tenant_kv_quota_tokens
    if cfg.prefix_cache == "radix":
        return RadixCache(cfg.page_size, eviction_policy=cfg.eviction_policy, tenant_quotas=quotas)
    if cfg.prefix_cache == "hash":
        return HashBlockCache(cfg.page_size, cfg.hash_algo, tenant_quotas=quotas)
    return NoPrefixCache(cfg.page_size)


class Engine:
    """Continuous-batching engine with prefix caching.

    Args:
        config: an :class:`~radixkv.config.EngineConfig` (default: the default model on "auto").
        model_runner: use this runner instead of loading ``config.model`` (tests pass a fake one);
            it must provide ``req_to_token_pool``, ``build_batch``, ``forward``,
            ``max_context_len`` and ``vocab_size``, with ``config.max_total_tokens`` slots (a
            :class:`~radixkv.memory.kv_pool.KVPool` ``kv_pool`` is checked: at least that many
            slots, ``config.page_size``, and ``config.kv_cache_dtype``, whose ``"auto"`` takes
            the pool's; else a ValueError naming the field).
        tokenizer: tokenizer for text prompts, chat templates and detokenization (default: the
            loaded model's), or a model name or path to load one from (vLLM's ``tokenizer=``).
            These object keywords are checked for the attributes the engine uses (a ValueError
            naming the keyword), ``clock`` for being callable.
        eos_token_ids: tokens that end a sample unless ``ignore_eos`` (default: from the model
            config and the tokenizer).
        loaded_model: a :class:`~radixkv.models.loader.LoadedModel` to use instead of loading
            ``config.model`` (several engines can share one model's weights; each has its own
            KV pool).
        clock: time source in seconds of the pins' idle timeout (default ``time.monotonic``;
            tests pass a fake one).
        tier_stores: the KV tiers' stores (:class:`~radixkv.tiers.PageStore` s) to use instead of
            those ``config`` names (``host_cache_bytes``, ``disk_cache_dir``,
            ``remote_cache_url``); the engine closes them at :meth:`close`.

    Attributes:
        events: the :class:`~radixkv.engine.events.EventBus` (``engine.events.subscribe(fn)``).
        sampling: the :class:`~radixkv.sampling.pipeline.SamplingPipeline` (one call per step).
        grammars: the :class:`~radixkv.sampling.grammar.GrammarBackend` of structured outputs.
        spec: the :class:`~radixkv.spec.drafter.Drafter` of speculative decoding
            (``config.speculative_config``), or None when it is off.
        num_steps: steps that ran a forward pass.
        num_forwards: the same count (vLLM's name).
        num_failed_requests: requests that ended with finish_reason ``"error"``: their row's
            sampling, logits processing, grammar or output processing raised (only that request
            stops; :meth:`step`).

    Raises:
        ValueError: invalid config values (naming the field).
    """

    def __init__(
        self,
        config: Optional[EngineConfig] = None,
        *,
        model_runner: Any = None,
        tokenizer: Any = None,
        eos_token_ids: Optional[Sequence[int]] = None,
        loaded_model: Any = None,
        clock: Optional[Callable[[], float]] = None,
        tier_stores: Optional[Sequence[Any]] = None,
    ) -> None:
        config = config or EngineConfig()
        if tier_stores and config.prefix_cache != "radix" and asks_write_back(config.kv_tier_write_policy):
            raise write_back_refused(config.prefix_cache, config.kv_tier_write_policy)  # as the config's tiers
        # a copy: the caller's config is never changed (it may be reused for another engine)
        self.config = cfg = copy.copy(config).resolve()
        if tier_stores is None:
            check_settings(cfg)  # a bad tier setting fails before the model loads
        tokenizer = _check_keywords(model_runner, tokenizer, loaded_model, clock, tier_stores)
        hf_config = None
        model = getattr(model_runner, "model", None)
        if model_runner is None:
            loaded = _unshared(loaded_model, cfg) if loaded_model is not None else _load(cfg)
            _match_quantization(cfg, loaded.model)
            hf_config, model = loaded.hf_config, loaded.model
            tokenizer = tokenizer if tokenizer is not None else loaded.tokenizer
            model_runner = _default_runner(cfg, loaded)
        else:
            if cfg.max_total_tokens is None:
                raise ValueError("max_total_tokens is required when a model_runner is given")
            cfg.max_context_len = int(model_runner.max_context_len)  # the given runner's table decides
            _match_runner_pool(cfg, model_runner, (config or EngineConfig()).kv_cache_dtype)
            cfg.resolve()
        self.runner = model_runner
        self.tokenizer = tokenizer
        self.max_context_len: int = int(cfg.max_context_len)
        self.vocab_size = int(model_runner.vocab_size)
        if eos_token_ids is None:
            eos_token_ids = _default_eos(hf_config, tokenizer)
        self.eos_token_ids = _check_eos(eos_token_ids, self.vocab_size)

        self.events = EventBus()
        cache = _make_cache(cfg)
        self.kv = KVManager(
            cache,
            SlotAllocator(cfg.max_total_tokens, cfg.page_size),
            model_runner.req_to_token_pool,
            self.events,
            max_pinned_tokens=cfg.max_pinned_tokens,
            pin_idle_timeout=cfg.pin_idle_timeout,
            clock=clock,
            in_batch_sharing=cfg.in_batch_prefix_sharing,
            tiers=_make_tiers(cfg, model_runner, model, tier_stores),
        )
        if self.kv.tiers is not None:
            self.kv.tiers.io.on_load_done = _weak_call(self._wake)  # the I/O thread must not keep the engine
        self.scheduler = Scheduler(self.kv, chunked_prefill_size=cfg.chunked_prefill_size, schedule_policy=cfg.schedule_policy,
                                   first_token_preemption=cfg.first_token_preemption)  # fmt: skip
        self.outcomes = OutcomeTracker(cache, self.events) if cfg.cache_outcome else None
        self.scheduler.outcomes = self.outcomes
        self._groups: Dict[str, RequestGroup] = {}
        self._unfinished_by_tenant: Dict[Optional[str], int] = {}  # tenant -> its groups in _groups
        self._inbox: List[Callable[["Engine"], None]] = []
        # NOTE: re-entrant, so a finalizer that posts (a dropped session's pin release) cannot
        # deadlock when garbage collection runs it inside post() on the same thread
        self._inbox_lock = threading.RLock()
        self._work = threading.Condition(self._inbox_lock)
        self._ready: List[RequestOutput] = []  # outputs of aborts, returned by the next step
        self._ids = itertools.count()
        self._rng = torch.Generator(device=torch.device(cfg.device)).manual_seed(cfg.seed)
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.cached_by_tier = {m: 0 for m in CACHE_MEDIA}  # cached_tokens by where they came from
        self._tenant_counts: Dict[str, List[int]] = {}  # tenant -> [prompt, cached], least recent first
        self._tenant_rows = TenantTable()  # EngineStats.tenants, kept incrementally
        self._tenants_changed: set = set(cfg.tenant_kv_quota_tokens or ())  # rows to refresh (with the cache's)
        self.generated_tokens = 0
        self.num_steps = 0
        self.num_failed_requests = 0  # requests ended with "error" (their sampling raised)
        self._last_admit_seq = 0  # the highest admission number reported in a RequestAdmitted
        self.sampling = SamplingPipeline(self.vocab_size, self.eos_token_ids)
        # structured outputs: validation, background compilation, compiled-grammar cache (xgrammar
        # is imported and the compile thread started at the first constrained request)
        self.grammars = GrammarBackend(tokenizer, self.vocab_size, self.eos_token_ids)
        self._compiling: List[Request] = []  # samples 0 whose grammar is still compiling
        self._decode = TokenDecoder(tokenizer)
        spec = cfg.speculative_config
        self.spec: Optional[Drafter] = Drafter(spec, cache, _encoder(tokenizer)) if spec is not None else None
        if spec is not None and getattr(self.runner, "row_exact", True) is False:
            # NOTE: exact outputs rest on verify rows giving one-row decode bits (docs/speculative.md)
            quant = getattr(getattr(self.runner, "model", None), "quantization", None)
            logger.warning(
                "speculative decoding: on %s with a %s%s model a verify row is not the bits of a one-row "
                "decode step (only an unquantized float32 CPU model on the native kernels is), so outputs "
                "may differ from those without speculation where two logits nearly tie",
                getattr(self.runner, "device", "?"),
                str(getattr(self.runner, "dtype", "?")).replace("torch.", ""),
                f" {quant}-quantized" if quant else "",
            )

    @property
    def cache(self) -> Any:
        """The prefix cache (read-only use; slots move only through ``engine.kv``)."""
        return self.kv.cache

    @property
    def allocator(self) -> SlotAllocator:
        """The KV pool's slot allocator (read-only use; slots move only through ``engine.kv``)."""
        return self.kv.allocator

    @property
    def num_forwards(self) -> int:
        """Forward passes run (the same as ``num_steps``)."""
        return self.num_steps

    # ------------------------------------------------------------------ inbox (any thread)
    def post(self, fn: Callable[["Engine"], None]) -> None:
        """Run ``fn(engine)`` on the driving thread, in order with the other inbox messages, at
        the start of the next :meth:`step` (or :meth:`run_posted`). Any thread."""
        with self._work:
            self._inbox.append(fn)
            self._work.notify_all()

    def wait_for_work(self, timeout: Optional[float] = None) -> bool:
        """Block until the inbox holds a message or a request is unfinished (at most ``timeout``
        seconds); returns whether there is work. For a driver thread that has nothing to step."""
        with self._work:
            return self._work.wait_for(lambda: bool(self._inbox or self._groups or self._ready), timeout)

    def run_posted(self) -> None:
        """Apply every inbox message in order, also those posted while applying (driver thread)."""
        while True:
            with self._inbox_lock:
                if not self._inbox:
                    return
                fn = self._inbox.pop(0)
            fn(self)

    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        sampling_params: Optional[SamplingParams] = None,
        request_id: Optional[str] = None,
        prompt: Optional[str] = None,
        namespace: Hashable = None,
    ) -> str:
        """Queue a request; it is admitted by a later :meth:`step`. Any thread.

        Args:
            prompt_token_ids: the prompt, a non-empty sequence of ints in ``[0, vocab_size)``.
            sampling_params: default ``SamplingParams()``.
            request_id: unique among unfinished requests (default: a fresh number).
            prompt: the prompt text, reported back in the outputs.
            namespace: prefix-cache namespace (prefixes are only shared within one): None (the
                shared default), a :class:`~radixkv.namespace.Namespace`, or any hashable
                (``Namespace.of``: ``"a"`` is ``Namespace(extra_key="a")``);
                ``sampling_params.cache_salt`` joins it as its salt (``with_salt``).

        Returns:
            The request id.

        Raises:
            RequestError: (a ValueError naming the field) empty prompt, a token id that is not an
                integer or is outside the vocabulary, a prompt of ``max_context_len`` tokens or
                more, ``len(prompt) + max_tokens`` above ``max_context_len`` (param
                ``max_tokens``) or above the KV pool capacity (``max_total_tokens``), ``n`` above
                ``EngineConfig.max_n``, a ``stop_token_ids`` id outside the vocabulary, a bad ``sampling_params`` (a ``logit_bias``
                token outside the vocabulary, ``logprob_start_len`` not inside the prompt, a
                schema / regex / grammar xgrammar refuses: its message, the field as ``param``)
                or a duplicate id; an unhashable ``namespace`` (param ``namespace``); a
                ``cache_salt`` other than the namespace's own salt (param ``cache_salt``).
            QueueFullError: (a RequestError naming ``max_queued_requests``) that many requests
                already wait for admission (``EngineConfig.max_queued_requests``).
        """
        ids, params = validate_request(prompt_token_ids, sampling_params, self._limits())
        namespace = with_salt(namespace, params.cache_salt)
        tenant = tenant_of(namespace)
        if params.structured_output is not None:
            with self._work:  # NOTE: a request refused here must start no compile on the grammar thread
                self._check_queue_bound(tenant)
                self._check_id_free(request_id)
        compiled = self._start_grammar(params, namespace)
        with self._work:
            self._check_queue_bound(tenant)
            rid = str(request_id) if request_id is not None else str(next(self._ids))
            self._check_id_free(rid)
            group = RequestGroup(rid, prompt, ids, params, namespace, time.perf_counter())
            group.grammar = compiled
            self._groups[rid] = group
            self._unfinished_by_tenant[tenant] = self._unfinished_by_tenant.get(tenant, 0) + 1
            self._inbox.append(lambda e: e._queue(group))
            self._work.notify_all()
        return rid

    def _limits(self) -> Limits:
        """The limits ``add_request`` checks a request against (:mod:`radixkv.engine.validation`)."""
        return Limits(
            vocab_size=self.vocab_size,
            max_context_len=self.max_context_len,
            max_n=self.config.max_n,
            capacity=self.kv.capacity,
            page_size=self.config.page_size,
        )

    def _start_grammar(self, params: SamplingParams, namespace: Optional[Namespace] = None) -> Any:
        """Validate ``params``' structured-output constraint and start compiling it on the grammar
        thread: the compile's ``Future``, or None without a constraint. The grammar caches are
        per ``namespace`` (the request's), as the prefix cache.

        Raises:
            RequestError: no tokenizer, or a constraint xgrammar refuses (the field as ``param``).
        """
        if params.structured_output is None:
            return None
        kind = params.structured_output[0]
        if self.tokenizer is None:
            raise RequestError(f"{kind}: structured outputs need the model's tokenizer", kind)
        self.grammars.validate(params.structured_output, namespace)
        compiled = self.grammars.compile(params.structured_output, namespace)
        compiled.add_done_callback(self._wake)  # outside the lock: it may run right here
        return compiled

    def _check_id_free(self, request_id: Any) -> None:
        """Raise RequestError when ``request_id`` (None: none asked for) is an unfinished
        request's (called holding the inbox lock)."""
        if request_id is not None and str(request_id) in self._groups:
            raise RequestError(
                f"request_id {str(request_id)!r} is already in use by an unfinished request", "request_id"
            )

    def _check_queue_bound(self, tenant: Optional[str]) -> None:
        """Raise QueueFullError when ``max_queued_requests`` requests wait for admission, or
        ``max_queued_requests_per_tenant`` of ``tenant``'s (called holding the inbox lock)."""
        limit, share = self.config.max_queued_requests, self.config.max_queued_requests_per_tenant
        running = list(self.scheduler.running) if limit is not None or share is not None else []
        if limit is not None:
            queued = len(self._groups) - len({r.request_id for r in running})
            if queued >= limit:
                raise QueueFullError(
                    f"the engine's queue is full: {queued} requests wait for admission, "
                    f"max_queued_requests is {limit}; retry later"
                )
        if share is not None:
            mine = {r.request_id for r in running if tenant_of(r.namespace) == tenant}
            queued = self._unfinished_by_tenant.get(tenant, 0) - len(mine)
            if queued >= share:
                who = "without a tenant" if tenant is None else f"of tenant {tenant!r}"
                raise QueueFullError(
                    f"the tenant's share of the queue is full: {queued} requests {who} wait for admission, "
                    f"max_queued_requests_per_tenant is {share}; retry later",
                    "max_queued_requests_per_tenant",
                )

    def abort_request(self, request_id: str) -> None:
        """Abort a request (any thread); unknown or finished ids are ignored. Its outputs end with
        finish_reason "abort" in the next :meth:`step`; everything it held is released there."""
        rid = str(request_id)
        self.post(lambda e: e.abort_now(rid))

    def num_unfinished_requests(self) -> int:
        """Requests accepted and not finished (queued, compiling, running). Any thread (one
        ``len`` read; a snapshot)."""
        return len(self._groups)

    def has_unfinished_requests(self) -> bool:
        """True while a request is queued, running, or has an output still to report."""
        return bool(self._groups) or bool(self._inbox) or bool(self._ready)

    def _wake(self, _fut: Any = None) -> None:
        """A grammar finished compiling (its thread): wake a driver waiting in :meth:`step`."""
        with self._work:
            self._work.notify_all()

    # ------------------------------------------------------------------ driver thread
    def _queue(self, group: RequestGroup) -> None:
        if self._groups.get(group.request_id) is not group:  # aborted before it was queued
            return
        p = group.params
        first = Request(
            group.request_id, 0, group.prompt_ids, p, group.namespace, make_generator(p.seed, self.config.device)
        )
        first.fork_pending = p.n - 1
        if p.prompt_logprobs is not None:
            start = max(p.logprob_start_len or 0, 1)  # position 0 has no logprob
            if start < len(group.prompt_ids):
                first.prompt_lp_pos = start - 1
        group.samples[0] = first
        if group.grammar is not None:
            self._compiling.append(first)
            self._admit_compiled()
        else:
            first.sampling_state = self.sampling.new_state(p)
            self.scheduler.add(first)

    def _admit_compiled(self) -> None:
        """Queue the samples whose grammar has compiled (in arrival order); the others keep
        waiting outside the scheduler. A grammar that failed to compile (xgrammar accepted it at
        validation) ends its request with ``"abort"``."""
        waiting = []
        for r in self._compiling:
            g = self._groups.get(r.request_id)
            if g is None or r.status == RequestStatus.FINISHED:
                continue
            fut = g.grammar
            if not fut.done():
                waiting.append(r)
                continue
            exc = fut.exception()
            if exc is not None:
                logger.error("request %s: its grammar failed to compile: %r", r.request_id, exc)
                r.status = RequestStatus.FINISHED  # never queued: nothing to release
                self._end_group(g, self._ready, reason="abort")
                continue
            r.sampling_state = self.sampling.new_state(r.params, self.grammars.matcher(fut.result()))
            self.scheduler.add(r)
        self._compiling = waiting

    def _wait_for_grammars(self, timeout: float = 0.1) -> None:
        """Nothing could run and grammars are compiling: sleep until one is done or a message
        arrives (at most ``timeout`` seconds), instead of spinning."""
        futs = [self._groups[r.request_id].grammar for r in self._compiling if r.request_id in self._groups]
        with self._work:
            self._work.wait_for(lambda: bool(self._inbox) or any(f.done() for f in futs), timeout)

    def _wait_for_tiers(self, timeout: float = 0.05) -> None:
        """Nothing could run and waiting requests wait for their blocks from the KV tiers: sleep
        until a load finishes or a message arrives (at most ``timeout`` seconds)."""
        io = self.kv.tiers.io
        with self._work:
            self._work.wait_for(lambda: bool(self._inbox) or io.has_done_loads(), timeout)

    def abort_now(self, request_id: str, report: bool = True) -> Optional[RequestOutput]:
        """Abort a request at once (driver thread: from a posted call or between steps); its
        final output (finish_reason "abort") comes from the next :meth:`step`, or with
        ``report`` False is returned instead (the caller delivers it; no step reports it).
        Unknown or finished ids are ignored (None)."""
        group = self._groups.get(request_id)
        if group is None:
            return None
        outputs = self._ready if report else []
        self._end_group(group, outputs, reason="abort")
        return None if report else outputs[-1]

    def _fail(self, request_id: str, exc: BaseException, outputs: List[RequestOutput]) -> None:
        """Request ``request_id``'s sampling (or output processing) raised ``exc`` for its row:
        end it with finish_reason ``"error"`` and ``RequestOutput.error`` set, release every
        sample (its computed K/V stays cached and unlocked, as on abort) and report it in
        ``outputs``. The other requests of the step are untouched."""
        group = self._groups.get(request_id)
        if group is None:
            return
        logger.error("request %s failed in sampling or drafting; only it stops: %r", request_id, exc, exc_info=exc)
        group.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        self.num_failed_requests += 1
        self._end_group(group, outputs, reason="error")

    def _end_group(
        self,
        group: RequestGroup,
        outputs: List[RequestOutput],
        reason: Optional[str] = None,
        now: Optional[float] = None,
    ) -> None:
        """The one way a request ends: its samples still unfinished are aborted (their slots
        released: computed K/V stays cached, unlocked) and, with ``reason``, marked with it
        (``"abort"`` or ``"error"``); its finish time is set (``now``, default the current
        ``time.perf_counter()``); it leaves the unfinished requests; a
        :class:`~radixkv.engine.events.RequestFinished` is emitted; its final output is appended
        to ``outputs``."""
        for r in group.samples:
            if r is not None and r.status != RequestStatus.FINISHED:
                self.scheduler.abort(r)
        if self._compiling and group.samples[0] is not None:  # ended while its grammar compiled
            self._compiling = [r for r in self._compiling if r is not group.samples[0]]
        if reason is not None:
            group.abort(reason)
        group.metrics.finished_time = time.perf_counter() if now is None else now
        with self._work:
            del self._groups[group.request_id]
            tenant = tenant_of(group.namespace)
            left = self._unfinished_by_tenant[tenant] - 1
            if left:
                self._unfinished_by_tenant[tenant] = left
            else:
                del self._unfinished_by_tenant[tenant]
        if self.events.wants(RequestFinished):
            outs = group.outputs
            self.events.emit(
                RequestFinished(
                    request_id=group.request_id,
                    step=self.num_steps,
                    finish_reasons=tuple(str(o.finish_reason) for o in outs),
                    num_prompt_tokens=len(group.prompt_ids),
                    num_output_tokens=sum(len(o.token_ids) for o in outs),
                    num_cached_tokens=group.num_cached_tokens,
                    namespace=group.namespace,
                )
            )
        outputs.append(group.to_output())

    def step(self) -> List[RequestOutput]:
        """Run one scheduling step (apply the inbox, admit + prefill chunk(s) + decode, one
        forward pass).

        Returns:
            A cumulative :class:`RequestOutput` for every request that produced a token, finished
            or was aborted in this step.

        Failure isolation: when sampling, a logits processor, a grammar matcher, logprobs or the
        detokenizer raises for one request's row, only that request ends, with finish_reason
        ``"error"`` and :attr:`RequestOutput.error` set (its slots released); every other row
        gets exactly the token it would have got (:mod:`radixkv.sampling.pipeline`, "Failure
        isolation") and the engine keeps running.
        """
        self.run_posted()
        if self._compiling:
            self._admit_compiled()
        outputs, self._ready = self._ready, []
        self.kv.expire_pins()
        if self.spec is not None:  # draft tokens of the decoding requests (docs/speculative.md)
            self.spec.propose(
                [r for r in self.scheduler.running if r.status == RequestStatus.DECODE], self.max_context_len
            )
            for rid, exc in self.spec.take_failed().items():  # its drafting raised: only it ends
                self._fail(rid, exc, outputs)
        batch = self.scheduler.schedule()
        if batch is None:
            if self._compiling:
                self._wait_for_grammars()
            elif self.kv.tiers is not None and any(self.kv.tier_waiting(r) for r in self.scheduler.waiting):
                self._wait_for_tiers()
            return outputs
        self.num_steps += 1
        self._note_admissions(batch)
        t0 = time.perf_counter()
        logits, sample_index, segments, verifies = self._forward(batch)
        if self.kv.tiers is not None and batch.prefill_tokens >= max(16, sum(batch.extend_lens) // 2):
            self.kv.tiers.costs.note_prefill(time.perf_counter() - t0, batch.prefill_tokens)
        self.scheduler.after_forward(batch)
        samplers = batch.samplers
        result = self.sampling.step(
            logits, samplers, self._rng, sample_index, [seg for _, seg in segments] if segments else ()
        )
        now = time.perf_counter()
        if self.kv.tiers is not None:
            self.kv.tiers.costs.note_step(now - t0)
        failed: Dict[str, BaseException] = {}  # request id -> what its row raised (that request fails)
        self._take_prompt_logprobs(segments, result, failed)
        touched = self._take_tokens(samplers, result, failed, now)
        if verifies:
            self._verify(verifies, logits, failed, touched, now)
        for rid, exc in failed.items():
            touched.pop(rid, None)
            self._fail(rid, exc, outputs)
        self._emit_step_finished(batch)
        for g in touched.values():
            if g.finished:
                self._end_group(g, outputs, now=now)
            else:
                outputs.append(g.to_output())
        return outputs

    def _note_admissions(self, batch: ScheduledBatch) -> None:
        """Admission bookkeeping of the step's members: first-scheduled times, the prompt and
        cached-token totals (sample 0's first admission), and a
        :class:`~radixkv.engine.events.RequestAdmitted` per new admission."""
        now = time.perf_counter()
        emit = self.events.wants(RequestAdmitted)
        for r in batch.members:
            g = self._groups[r.request_id]
            if g.metrics.first_scheduled_time is None:
                g.metrics.first_scheduled_time = now
            if r.index == 0 and not g.counted and r.num_cached_tokens is not None:
                g.counted = True
                g.num_cached_tokens = r.num_cached_tokens
                g.cache_outcome = r.cache_outcome
                g.cached_tokens_by_tier = self._by_tier(r)
                self.prompt_tokens += len(g.prompt_ids)
                self.cached_tokens += r.num_cached_tokens
                self._count_tenant(tenant_of(r.namespace), len(g.prompt_ids), r.num_cached_tokens)
            if emit and r.admit_seq > self._last_admit_seq:
                first = r.num_retractions == 0
                self.events.emit(
                    RequestAdmitted(
                        request_id=r.request_id,
                        index=r.index,
                        step=self.num_steps,
                        num_prompt_tokens=len(r.prompt_token_ids),
                        num_cached_tokens=(r.num_cached_tokens or 0) if first else 0,
                        prefix_len=r.prefix_len,
                        readmission=not first,
                        namespace=r.namespace,
                        cache_outcome=r.cache_outcome if first else None,
                        num_shared_tokens=r.num_shared_tokens,
                    )
                )
        self._last_admit_seq = max([self._last_admit_seq, *(r.admit_seq for r in batch.members)])

    def _by_tier(self, r: Request) -> Dict[str, int]:
        """Where ``r``'s cached prompt tokens came from (:data:`CACHE_MEDIA`), added to the
        engine's totals: the KV tiers' installs for it, the pool for the rest."""
        n = r.num_cached_tokens or 0
        tiers = r.tier.by_tier(n) if r.tier is not None else {}
        out = {m: tiers.get(m, 0) for m in CACHE_MEDIA}
        out["device"] = n - sum(tiers.values())
        for m, k in out.items():
            self.cached_by_tier[m] += k
        if tiers:
            self.kv.tiers.served(tiers)
        return out

    def _take_prompt_logprobs(self, segments: List[tuple], result: Any, failed: Dict[str, BaseException]) -> None:
        """Record the prompt logprobs computed in this step (``segments``: ``(request,
        PromptSegment)``) on their groups; a request whose row raised goes into ``failed``."""
        errors = result.prompt_errors or repeat(None)
        for (r, seg), lps, err in zip(segments, result.prompt_logprobs, errors):
            try:
                if err is not None:
                    raise err
                g = self._groups[r.request_id]
                decode = self._decode if g.params.detokenize else NO_TEXT
                for pos, e in enumerate(lps, start=seg.first + 1):
                    g.prompt_logprobs[pos] = to_position_logprobs(e, decode)
                r.prompt_lp_pos = seg.first + seg.n
                if r.prompt_lp_pos >= len(r.prompt_token_ids) - 1:
                    r.prompt_lp_pos = None  # all computed: the cache may serve its prompt again
            except Exception as exc:  # noqa: BLE001 - one request fails, not the engine
                failed.setdefault(r.request_id, exc)

    def _take_tokens(
        self, samplers: List[Request], result: Any, failed: Dict[str, BaseException], now: float
    ) -> Dict[str, RequestGroup]:
        """Append each sampled token to its sample, fork the ``n > 1`` samples at sample 0's
        first token, run the stop checks (a finished sample is released). Returns the groups
        that got a token, by request id; a request whose row (or output processing) raised goes
        into ``failed`` instead."""
        touched: Dict[str, RequestGroup] = {}
        for r, tok, lp, err in zip(samplers, result.tokens, result.logprobs, result.errors or repeat(None)):
            if err is not None or r.request_id in failed:
                failed.setdefault(r.request_id, err)
                continue
            g = self._groups[r.request_id]
            touched[g.request_id] = g
            try:
                r.output_token_ids.append(tok)
                self.generated_tokens += 1
                if g.metrics.first_token_time is None:
                    g.metrics.first_token_time = now
                if r.fork_pending:
                    self._fork(g, r)
                if g.update(r, self.tokenizer, self.eos_token_ids, self.max_context_len, lp, self._decode):
                    if self.spec is not None:
                        self.spec.on_finished(r)
                    self.scheduler.finish(r)
            except Exception as exc:  # noqa: BLE001 - one request fails, not the engine
                failed.setdefault(r.request_id, exc)
        return touched

    def _emit_step_finished(self, batch: ScheduledBatch) -> None:
        if not self.events.wants(StepFinished):
            return
        self.events.emit(
            StepFinished(
                step=self.num_steps,
                samples=tuple((r.request_id, r.index) for r in batch.reqs),
                extend_lens=tuple(batch.extend_lens),
                sampled=tuple(batch.sample),
                prefill_tokens=batch.prefill_tokens,
                retracted=tuple((r.request_id, r.index) for r in batch.retracted),
                riders=tuple((r.request_id, r.index) for r in batch.riders),
                draft_lens=tuple(len(d) for d in batch.drafts),
            )
        )

    def _forward(self, batch: ScheduledBatch):
        """One forward pass. Logits are computed for the last new token of each sampling request,
        for a request with prompt logprobs due, for its prompt positions in this chunk, and for
        each draft position of a verifying request (its rows come last, after the riders').

        A request verifying ``k`` drafts runs as ``k + 1`` decode rows of its ``req_to_token``
        row (positions ``kv_len .. kv_len + k``), not as one extend: each row then gives the bits
        of a one-row decode step at its position (docs/speculative.md).

        Returns:
            ``(logits, sample_index, segments, verifies)``: ``logits`` ``[S, V]``;
            ``sample_index`` the logits row of each sampling request (None when they are rows
            ``0 ..`` and nothing else is); ``segments`` a list of ``(request, PromptSegment)``;
            ``verifies`` a :class:`~radixkv.engine.verify.Verify` per verifying request.
        """
        rows: List[int] = []
        prefix_lens: List[int] = []
        extend_lens: List[int] = []
        logits_idx: List[int] = []
        sample_index: List[int] = []
        segments: List[tuple] = []
        verifies: List[Verify] = []
        start = 0
        for r, p, e, s, d in zip(batch.reqs, batch.prefix_lens, batch.extend_lens, batch.sample, batch.drafts):
            if d:  # a verify: 1 + len(d) decode rows
                n = len(d) + 1
                rows.extend([r.row] * n)
                prefix_lens.extend(range(p, p + n))
                extend_lens.extend([1] * n)
                sample_index.append(len(logits_idx))
                logits_idx.append(start)
                verifies.append(Verify(r, d, [start + j for j in range(1, n)]))
                start += n
                continue
            rows.append(r.row)
            prefix_lens.append(p)
            extend_lens.append(e)
            if r.prompt_lp_pos is not None:
                lo, hi = max(r.prompt_lp_pos, p), min(len(r.prompt_token_ids) - 1, p + e)
                if hi > lo:
                    k = r.params.prompt_logprobs
                    targets = r.prompt_token_ids[lo + 1 : hi + 1]
                    segments.append((r, PromptSegment(len(logits_idx), hi - lo, lo, targets, k)))
                    logits_idx.extend(range(start + lo - p, start + hi - p))
            if s:
                sample_index.append(len(logits_idx))
                logits_idx.append(start + e - 1)
            start += e
        for row in batch.rider_rows:  # riders sample from another row's logits (in-batch sharing)
            sample_index.append(len(logits_idx))
            logits_idx.append(row)
        for v in verifies:  # the draft positions' rows, after every sampling row
            v.rows = [self._logits_row(logits_idx, t) for t in v.rows]
        fb = self.runner.build_batch(batch.input_ids, rows, prefix_lens, extend_lens, logits_indices=logits_idx)
        index = sample_index if (segments or verifies) else None
        return self.runner.forward(fb), index, segments, verifies

    @staticmethod
    def _logits_row(logits_idx: List[int], token_row: int) -> int:
        """Ask for the logits of new-token row ``token_row``; returns its logits row."""
        logits_idx.append(token_row)
        return len(logits_idx) - 1

    def _verify(
        self, verifies: List[Verify], logits: Any, failed: Dict[str, BaseException], touched: dict, now: float
    ) -> None:
        """Rounds ``1 ..`` of the step's verifies (:func:`~radixkv.engine.verify.verify_rounds`):
        each accepted draft position is sampled in order as a decode step would sample it; then
        the acceptance is recorded and the rejected drafts' slots are freed (this step)."""

        def sample(reqs: List[Request], idx: List[int]) -> Any:
            return self.sampling.step(logits, reqs, self._rng, idx)

        def take(reqs: List[Request], result: Any) -> None:
            touched.update(self._take_tokens(reqs, result, failed, now))

        verify_rounds(verifies, sample, take, failed)
        for v in verifies:
            r = v.req
            self.spec.observe(r, len(v.drafts), v.accepted, v.rejected)
            g = self._groups.get(r.request_id)
            if g is not None:
                g.metrics.spec_draft_tokens += len(v.drafts)
                g.metrics.spec_accepted_tokens += v.accepted
            self.kv.settle_drafts(r)

    def _fork(self, g: RequestGroup, parent: Request) -> None:
        children = []
        for i in range(1, parent.fork_pending + 1):
            seed = None if g.params.seed is None else g.params.seed + i
            c = Request(g.request_id, i, g.prompt_ids, g.params, g.namespace, make_generator(seed, self.config.device))
            matcher = None if g.grammar is None else self.grammars.matcher(g.grammar.result())
            c.sampling_state = self.sampling.new_state(g.params, matcher)
            g.samples[i] = c
            children.append(c)
        parent.fork_pending = 0
        self.scheduler.fork(parent, children)

    # ------------------------------------------------------------------ pins (driver thread)
    def pin_prefix(self, tokens: Sequence[int], namespace: Hashable = None) -> Any:
        """A soft pin on the cached prefix of ``tokens`` (:meth:`KVManager.pin_prefix
        <radixkv.engine.kv_manager.KVManager.pin_prefix>`): it stays in memory until
        :meth:`release_pin`, within the bounds ``max_pinned_tokens`` / ``pin_idle_timeout``.
        None when nothing of it is cached. Sessions and stored responses hold their context this
        way. ``namespace`` as for :meth:`add_request` (``Namespace.of``)."""
        return self.kv.pin_prefix(list(tokens), Namespace.of(namespace))

    def retain_pin(self, pin: Any) -> bool:
        """One more holder of ``pin`` (False when it was dropped already)."""
        return self.kv.retain_pin(pin)

    def touch_pin(self, pin: Any) -> None:
        """A holder uses ``pin`` now: it becomes the most recently used (the last soft pin the
        bounds drop)."""
        self.kv.touch_pin(pin)

    def release_pin(self, pin: Any) -> None:
        """A holder lets go of ``pin`` (the last one unpins: its tokens become evictable)."""
        self.kv.release_pin(pin)

    # ------------------------------------------------------------------ cache
    def explain(self, prompt_token_ids: Sequence[int], namespace: Hashable = None) -> Any:
        """The :class:`~radixkv.cache.outcome.CacheOutcome` the prompt would get if admitted now
        (driver thread). A dry run: a read-only ``peek`` of the prefix cache, nothing computed,
        locked or refreshed; the running requests count as ``in_flight``; with KV tiers, which
        tier holds each missed whole block after the pool's match, and the tail after them
        (``tier_spans``: the stores are asked, nothing is loaded). ``namespace`` as for :meth:`add_request`
        (``Namespace.of``). A prompt ``add_request`` would refuse (its context, its vocabulary, a
        pool too small for it and one generated token) raises its RequestError."""
        prompt_token_ids = check_prompt_fits(prompt_token_ids, self._limits())
        tracker = self.outcomes
        if tracker is None:  # outcomes off: no record of evictions, the rest is the same
            tracker = OutcomeTracker(self.kv.cache, EventBus())
        ns = Namespace.of(namespace)
        outcome = tracker.explain(prompt_token_ids, ns, self.scheduler.running)
        tiers = self.kv.tiers
        if tiers is None or not outcome.num_missed_tokens:
            return outcome
        limit = (len(prompt_token_ids) - 1) // self.kv.page_size * self.kv.page_size
        spans = tiers.where(ns, list(prompt_token_ids), outcome.num_cached_tokens, limit, self.kv.page_size)
        return dataclasses.replace(outcome, tier_spans=tuple(spans))

    def cache_stats(self, tenants: bool = True) -> EngineStats:
        """KV pool and prefix-cache statistics (sizes in tokens): an
        :class:`~radixkv.engine.stats.EngineStats`, also readable as a dict (``stats["free"]``).
        ``tenants=False``: its ``tenants`` left empty (the rest in O(1) of the number of
        tenants; :meth:`tenant_snapshot` has them, as AsyncLLM takes them after every step)."""
        kv, cache = self.kv, self.kv.cache
        kv.expire_pins()
        cap = kv.capacity
        free = kv.free_size()
        total = cache.total_size()
        return EngineStats(
            capacity=cap,
            free=free,
            evictable=cache.evictable_size(),
            protected=cache.protected_size(),
            pinned=kv.pinned_size(),
            cached=total,
            in_use=cap - free - total,
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens,
            hit_rate=self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            prefill_tokens=self.scheduler.prefill_tokens,
            generated_tokens=self.generated_tokens,
            evicted_tokens=kv.evicted_tokens,
            num_retractions=self.scheduler.num_retractions,
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            page_size=self.config.page_size,
            prefix_cache=self.config.prefix_cache,
            cached_tokens_by_tier=dict(self.cached_by_tier),
            tiers=kv.tiers.stats() if kv.tiers is not None else {},
            tenants=self.tenant_snapshot().rows() if tenants else {},
            spec_draft_tokens=self.spec.num_draft_tokens if self.spec is not None else 0,
            spec_accepted_tokens=self.spec.num_accepted_tokens if self.spec is not None else 0,
            **self._kv_facts(),
        )

    def _kv_facts(self) -> dict:
        """``kv_cache_dtype``, ``kv_bytes_per_token``, ``kv_cache_bytes`` of the runner's KV pool
        (a runner without one, as tests' stand-ins: the configured dtype and 0 bytes)."""
        pool = getattr(self.runner, "kv_pool", None)
        if isinstance(pool, KVPool):
            return dict(
                kv_cache_dtype=pool.kv_cache_dtype,
                kv_bytes_per_token=pool.bytes_per_token,
                kv_cache_bytes=pool.kv_cache_bytes,
            )
        return dict(kv_cache_dtype=str(self.config.kv_cache_dtype), kv_bytes_per_token=0, kv_cache_bytes=0)

    def _count_tenant(self, tenant: Optional[str], prompt_tokens: int, cached_tokens: int) -> None:
        """Add a first admission to ``tenant``'s lifetime counters (none for no tenant). The
        counters of at most :data:`~radixkv.engine.stats.TENANT_COUNTERS_KEPT` tenants are kept,
        the least recently admitted forgotten beyond it (its row stays listed while it holds
        cached tokens or has a quota, counting from 0 again)."""
        if tenant is None:
            return
        # NOTE: popped and put back, so the dict's order is least recently admitted first
        counts = self._tenant_counts.pop(tenant, None) or [0, 0]
        counts[0] += prompt_tokens
        counts[1] += cached_tokens
        self._tenant_counts[tenant] = counts
        self._tenants_changed.add(tenant)
        if len(self._tenant_counts) > TENANT_COUNTERS_KEPT:
            oldest = next(iter(self._tenant_counts))
            del self._tenant_counts[oldest]
            self._tenants_changed.add(oldest)
        if len(self._tenants_changed) > 2 * TENANT_COUNTERS_KEPT:  # no reader took them (LLM, Engine)
            self.tenant_snapshot()

    def tenant_snapshot(self) -> TenantSnapshot:
        """``EngineStats.tenants`` as of now, in O(tenants changed since the last call) (driver
        thread): every named tenant that has a quota, sent a request or holds cached tokens;
        its ``rows()`` builds them (any thread)."""
        changed = self._tenants_changed
        changed |= self.kv.cache.take_changed_tenants()
        quotas = self.config.tenant_kv_quota_tokens or {}
        for t in changed:
            cached, quota, counts = self.kv.cache.tenant_count(t), quotas.get(t), self._tenant_counts.get(t)
            listed = cached or quota is not None or counts is not None
            self._tenant_rows.set(t, (cached, quota, *(counts or (0, 0))) if listed else None)
        changed.clear()
        return self._tenant_rows.snapshot()

    def reset_prefix_cache(self, tiers: bool = False) -> bool:
        """Empty the prefix cache (and speculative decoding's index of finished sequences); False
        (and nothing done) while requests are queued or running.

        Args:
            tiers: also empty the KV tiers this engine owns (host, disk; not the shared remote
                one), once the writes queued for them are done.
        """
        if self._groups or self._inbox:
            return False
        if not self.scheduler.reset_cache():
            return False
        if self.spec is not None:  # its index of finished sequences is a cache of their text
            self.spec.reset()
        if tiers and self.kv.tiers is not None:
            self.kv.tiers.delete_all()
        return True

    def close(self, timeout: Optional[float] = None) -> bool:
        """Write what is queued for the KV tiers and close them (driver thread; idempotent;
        afterwards the engine runs without its tiers); a persistent tier written back (disk,
        remote) first gets the blocks the pool still caches, which it would get only once
        evicted (``KVManager.write_back_pool``). Returns whether every write was done within
        ``timeout`` seconds (None: no limit). ``LLM.close``, ``AsyncLLM.shutdown`` and their
        context exits call it; interpreter exit drains the queued writes too (not the pool's)."""
        if self.kv.tiers is None:
            return True
        start = time.monotonic()
        if not self.kv.write_back_pool(timeout):
            # NOTE: closed anyway (the queued writes left to a later close or the finalizer): a
            # retry must not queue the pool again, and the engine runs on without its tiers
            self.kv.tiers.close(0)
            return False
        left = None if timeout is None else max(0.0, timeout - (time.monotonic() - start))
        return self.kv.tiers.close(left)

    def check_integrity(self) -> None:
        """Raise AssertionError when slot ownership is inconsistent: the cache's own check, and
        every slot counted exactly once among free, cached, held by requests and pins; or when
        the unfinished requests counted per tenant (``max_queued_requests_per_tenant``'s count)
        differ from the unfinished requests' own tenants (a leaked or a lost count)."""
        self.kv.check_integrity(itertools.chain(self.scheduler.running, self.scheduler.waiting))
        with self._work:
            counts = dict(collections.Counter(tenant_of(g.namespace) for g in self._groups.values()))
            if self._unfinished_by_tenant != counts:  # NOTE: a raise, not an assert: it holds under python -O too
                raise AssertionError(f"per-tenant counts {self._unfinished_by_tenant} != {counts}")
