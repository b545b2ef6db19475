"""`Engine`: continuous batching over a prefix cache, one forward pass per :meth:`Engine.step`.

The engine owns the model runner (model + KV pool + block table + attention backend), the slot
allocator, the prefix cache (radix tree, hash blocks or none) and the scheduler. Each step drains
new requests and aborts, lets the scheduler plan one mixed batch (prefill chunks + decodes),
runs the model once, samples, detokenizes and checks stop conditions, and releases finished
requests (their committed tokens go into the prefix cache).

Threading: ``add_request`` and ``abort_request`` only validate and append to an inbox under a
small lock, so they are safe to call from any thread while another thread runs ``step``;
``step``, ``cache_stats`` and ``reset_prefix_cache`` take the engine lock (they run one at a time).
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any, Dict, Hashable, List, Optional, Sequence

import torch

from radixkv.cache import RadixCache, SlotAllocator
from radixkv.cache.hash_cache import HashBlockCache, NoPrefixCache
from radixkv.config import EngineConfig
from radixkv.detokenizer import IncrementalDetokenizer
from radixkv.outputs import CompletionOutput, RequestMetrics, RequestOutput
from radixkv.request import Request, RequestStatus
from radixkv.sampler import make_generator, sample
from radixkv.sampling_params import SamplingParams
from radixkv.scheduler import Scheduler


class _Group:
    """The ``n`` samples of one user request and what is reported for them."""

    def __init__(
        self,
        request_id: str,
        prompt: Optional[str],
        prompt_ids: List[int],
        params: SamplingParams,
        namespace: Hashable,
        arrival: float,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_ids = prompt_ids
        self.params = params
        self.namespace = namespace
        self.metrics = RequestMetrics(arrival_time=arrival)
        self.samples: List[Optional[Request]] = [None] * params.n
        self.outputs = [CompletionOutput(index=i) for i in range(params.n)]
        self.detoks: List[Optional[IncrementalDetokenizer]] = [None] * params.n
        self.num_cached_tokens = 0
        self.counted = False

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)

    def to_output(self) -> RequestOutput:
        outs = [
            CompletionOutput(o.index, o.text, list(o.token_ids), o.finish_reason, o.stop_reason) for o in self.outputs
        ]
        return RequestOutput(
            self.request_id,
            self.prompt,
            list(self.prompt_ids),
            outs,
            self.finished,
            self.num_cached_tokens,
            self.metrics,
        )


class Engine:
    """Continuous-batching engine with prefix caching.

    Args:
        config: an :class:`~radixkv.config.EngineConfig` (default: the default model on "auto").
        model_runner: use this runner instead of loading ``config.model`` (tests pass a fake one);
            it must provide ``req_to_token_pool``, ``build_batch``, ``forward``,
            ``max_context_len`` and ``vocab_size``, with ``config.max_total_tokens`` slots.
        tokenizer: tokenizer for text prompts, chat templates and detokenization (default: the
            loaded model's).
        eos_token_ids: tokens that end a sample unless ``ignore_eos`` (default: from the model
            config and the tokenizer).
        loaded_model: a :class:`~radixkv.models.loader.LoadedModel` to use instead of loading
            ``config.model`` (several engines can share one model's weights; each has its own
            KV pool).

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
    ) -> None:
        self.config = cfg = (config or EngineConfig()).resolve()
        hf_config = None
        if model_runner is None:
            from radixkv.model_runner import ModelRunner
            from radixkv.models.loader import load_model

            loaded = loaded_model
            if loaded is None:
                loaded = load_model(cfg.model, cfg.device, cfg.dtype, quantization=cfg.quantization)
            hf_config = loaded.hf_config
            tokenizer = tokenizer if tokenizer is not None else loaded.tokenizer
            m = loaded.model
            bytes_per_token = (
                2 * m.num_layers * m.num_kv_heads * m.head_dim * torch.empty((), dtype=cfg.dtype).element_size()
            )
            if cfg.max_total_tokens is None:
                cfg.max_total_tokens = cfg.default_max_total_tokens(bytes_per_token)
            cfg.max_total_tokens -= cfg.max_total_tokens % cfg.page_size
            max_pos = int(getattr(hf_config, "max_position_embeddings", cfg.max_total_tokens))
            if cfg.max_context_len is None:
                cfg.max_context_len = min(max_pos, cfg.max_total_tokens)
            if cfg.max_context_len > max_pos:
                raise ValueError(
                    f"max_context_len {cfg.max_context_len} exceeds the model's max_position_embeddings {max_pos}"
                )
            model_runner = ModelRunner(
                loaded,
                num_slots=cfg.max_total_tokens,
                page_size=cfg.page_size,
                max_running_requests=cfg.max_running_requests,
                max_context_len=cfg.max_context_len,
                device=cfg.device,
                dtype=cfg.dtype,
                attention_backend=cfg.attention_backend,
            )
        else:
            if cfg.max_total_tokens is None:
                raise ValueError("max_total_tokens is required when a model_runner is given")
            cfg.max_context_len = int(model_runner.max_context_len)
        self.runner = model_runner
        self.tokenizer = tokenizer
        self.max_context_len: int = int(cfg.max_context_len)
        self.vocab_size = int(model_runner.vocab_size)
        if eos_token_ids is None:
            eos: set = set()
            for src in (getattr(hf_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
                if isinstance(src, int):
                    eos.add(src)
                elif isinstance(src, (list, tuple)):
                    eos.update(int(t) for t in src)
            eos_token_ids = sorted(eos)
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)

        self.allocator = SlotAllocator(cfg.max_total_tokens, cfg.page_size)
        if cfg.prefix_cache == "radix":
            self.cache = RadixCache(cfg.page_size)
        elif cfg.prefix_cache == "hash":
            self.cache = HashBlockCache(cfg.page_size, cfg.hash_algo)
        else:
            self.cache = NoPrefixCache(cfg.page_size)
        self.scheduler = Scheduler(
            self.cache,
            self.allocator,
            model_runner.req_to_token_pool,
            chunked_prefill_size=cfg.chunked_prefill_size,
            schedule_policy=cfg.schedule_policy,
            caching=cfg.prefix_cache != "none",
        )
        self._groups: Dict[str, _Group] = {}
        self._inbox: List[tuple] = []
        self._inbox_lock = threading.Lock()
        self._lock = threading.RLock()
        self._ids = itertools.count()
        self._rng = torch.Generator(device=torch.device(cfg.device)).manual_seed(cfg.seed)
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.generated_tokens = 0
        self.num_forwards = 0

    # ------------------------------------------------------------------ requests
    def _pages(self, n: int) -> int:
        ps = self.config.page_size
        return (n + ps - 1) // ps * ps

    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        sampling_params: Optional[SamplingParams] = None,
        request_id: Optional[str] = None,
        prompt: Optional[str] = None,
        namespace: Hashable = None,
    ) -> str:
        """Queue a request; it is admitted by a later :meth:`step`.

        Args:
            prompt_token_ids: the prompt, a non-empty sequence of ints in ``[0, vocab_size)``.
            sampling_params: default ``SamplingParams()``.
            request_id: unique among unfinished requests (default: a fresh number).
            prompt: the prompt text, reported back in the outputs.
            namespace: prefix-cache namespace (prefixes are only shared within one).

        Returns:
            The request id.

        Raises:
            ValueError: empty prompt, a token id outside the vocabulary, a prompt of
                ``max_context_len`` tokens or more, ``len(prompt) + max_tokens`` above the KV pool
                capacity (``max_total_tokens``), a bad ``sampling_params`` or a duplicate id.
        """
        params = sampling_params if sampling_params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if isinstance(prompt_token_ids, torch.Tensor):
            prompt_token_ids = prompt_token_ids.reshape(-1).tolist()
        try:
            ids = [int(t) for t in prompt_token_ids]
        except (TypeError, ValueError):
            raise ValueError("prompt_token_ids must be a sequence of integers") from None
        if not ids:
            raise ValueError("prompt_token_ids is empty: a prompt needs at least 1 token")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids holds {bad[0]}, outside the vocabulary [0, {self.vocab_size})")
        if len(ids) >= self.max_context_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens; max_context_len is {self.max_context_len} "
                f"(the prompt plus at least one generated token must fit)"
            )
        need = self._pages(min(len(ids) + params.max_tokens, self.max_context_len))
        if need > self.allocator.num_slots:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) needs {need} KV slots, "
                f"more than the pool's max_total_tokens {self.allocator.num_slots}"
            )
        rid = str(request_id) if request_id is not None else str(next(self._ids))
        with self._inbox_lock:
            if rid in self._groups or any(item[0] == "add" and item[1].request_id == rid for item in self._inbox):
                raise ValueError(f"request_id {rid!r} is already in use by an unfinished request")
            group = _Group(rid, prompt, ids, params, namespace, time.perf_counter())
            self._inbox.append(("add", group))
            self._groups[rid] = group
        return rid

    def abort_request(self, request_id: str) -> None:
        """Abort a request (any thread); unknown or finished ids are ignored. Its outputs end with
        finish_reason "abort" in the next :meth:`step`; everything it held is released there."""
        with self._inbox_lock:
            self._inbox.append(("abort", str(request_id)))

    def has_unfinished_requests(self) -> bool:
        """True while a request is queued, running, or has an abort to report."""
        return bool(self._groups) or bool(self._inbox)

    def _drain_inbox(self) -> List[RequestOutput]:
        with self._inbox_lock:
            items, self._inbox = self._inbox, []
        out = []
        for kind, x in items:
            if kind == "add":
                if x.request_id not in self._groups:  # aborted before admission
                    continue
                first = Request(
                    x.request_id,
                    0,
                    x.prompt_ids,
                    x.params,
                    x.namespace,
                    make_generator(x.params.seed, self.config.device),
                )
                first.fork_pending = x.params.n - 1
                x.samples[0] = first
                self.scheduler.add(first)
            else:
                group = self._groups.get(x)
                if group is None:
                    continue
                for _i, r in enumerate(group.samples):
                    if r is not None and r.status != RequestStatus.FINISHED:
                        self.scheduler.abort(r)
                for o in group.outputs:
                    if o.finish_reason is None:
                        o.finish_reason = "abort"
                group.metrics.finished_time = time.perf_counter()
                del self._groups[x]
                out.append(group.to_output())
        return out

    # ------------------------------------------------------------------ step
    def step(self) -> List[RequestOutput]:
        """Run one scheduling step (admit + prefill chunk(s) + decode, one forward pass).

        Returns:
            A cumulative :class:`RequestOutput` for every request that produced a token, finished
            or was aborted in this step.
        """
        with self._lock:
            outputs = self._drain_inbox()
            batch = self.scheduler.schedule()
            if batch is None:
                return outputs
            now = time.perf_counter()
            for r in batch.reqs:
                g = self._groups[r.request_id]
                if g.metrics.first_scheduled_time is None:
                    g.metrics.first_scheduled_time = now
                if r.index == 0 and not g.counted and r.num_cached_tokens is not None:
                    g.counted = True
                    g.num_cached_tokens = r.num_cached_tokens
                    self.prompt_tokens += len(g.prompt_ids)
                    self.cached_tokens += r.num_cached_tokens
            rows = [r.row for r in batch.reqs]
            qo_end = list(itertools.accumulate(batch.extend_lens))
            logits_idx = [qo_end[i] - 1 for i, s in enumerate(batch.sample) if s]
            fb = self.runner.build_batch(
                batch.input_ids, rows, batch.prefix_lens, batch.extend_lens, logits_indices=logits_idx
            )
            logits = self.runner.forward(fb)
            self.num_forwards += 1
            self.scheduler.after_forward(batch)
            to_sample = [r for r, s in zip(batch.reqs, batch.sample) if s]
            tokens = sample(logits, [r.params for r in to_sample], [r.generator for r in to_sample], self._rng)
            now = time.perf_counter()
            touched: Dict[str, _Group] = {}
            for r, tok in zip(to_sample, tokens):
                g = self._groups[r.request_id]
                touched[g.request_id] = g
                r.output_token_ids.append(tok)
                self.generated_tokens += 1
                if g.metrics.first_token_time is None:
                    g.metrics.first_token_time = now
                if r.fork_pending:
                    self._fork(g, r)
                self._check_finish(g, r)
            for g in touched.values():
                if g.finished:
                    g.metrics.finished_time = now
                    del self._groups[g.request_id]
                outputs.append(g.to_output())
            return outputs

    def _fork(self, g: _Group, parent: Request) -> None:
        children = []
        for i in range(1, parent.fork_pending + 1):
            seed = None if g.params.seed is None else g.params.seed + i
            c = Request(g.request_id, i, g.prompt_ids, g.params, g.namespace, make_generator(seed, self.config.device))
            g.samples[i] = c
            children.append(c)
        parent.fork_pending = 0
        self.scheduler.fork(parent, children)

    def _check_finish(self, g: _Group, r: Request) -> None:
        p = r.params
        out = g.outputs[r.index]
        if g.detoks[r.index] is None:
            g.detoks[r.index] = IncrementalDetokenizer(self.tokenizer, p.stop, p.skip_special_tokens)
        det = g.detoks[r.index]
        tok = r.output_token_ids[-1]
        reason, stop_reason = None, None
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids):
            reason, stop_reason = "stop", tok
        elif det.update(r.output_token_ids):
            reason, stop_reason = "stop", det.stopped_by
        elif len(r.output_token_ids) >= p.max_tokens or r.seq_len >= self.max_context_len:
            reason = "length"
        if reason is not None and det.stopped_by is None:
            det.update(r.output_token_ids, final=True)
        out.token_ids = list(r.output_token_ids)
        out.text = det.text
        if reason is not None:
            out.finish_reason, out.stop_reason = reason, stop_reason
            self.scheduler.finish(r)

    # ------------------------------------------------------------------ cache
    def cache_stats(self) -> Dict[str, Any]:
        """KV pool and prefix-cache statistics (sizes in tokens).

        Keys: capacity, free, evictable, protected (locked by running requests), cached (held by
        the cache), in_use (held by requests outside the cache), prompt_tokens and cached_tokens
        (summed over requests at first admission; cached = served from the prefix cache),
        hit_rate (cached_tokens / prompt_tokens), prefill_tokens (prompt/history tokens computed,
        recomputation after retraction included), generated_tokens, evicted_tokens,
        num_retractions, running, waiting, page_size, prefix_cache.
        """
        with self._lock:
            cap = self.allocator.num_slots
            free = self.allocator.available_size()
            total = self.cache.total_size()
            return {
                "capacity": cap,
                "free": free,
                "evictable": self.cache.evictable_size(),
                "protected": self.cache.protected_size(),
                "cached": total,
                "in_use": cap - free - total,
                "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens,
                "hit_rate": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
                "prefill_tokens": self.scheduler.prefill_tokens,
                "generated_tokens": self.generated_tokens,
                "evicted_tokens": self.scheduler.evicted_tokens,
                "num_retractions": self.scheduler.num_retractions,
                "running": len(self.scheduler.running),
                "waiting": len(self.scheduler.waiting),
                "page_size": self.config.page_size,
                "prefix_cache": self.config.prefix_cache,
            }

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache; False (and nothing done) while requests are queued or running."""
        with self._lock:
            if self._groups or self._inbox:
                return False
            return self.scheduler.reset_cache()

    def check_integrity(self) -> None:
        """Raise AssertionError when slot ownership is inconsistent: the cache's own check, and
        every slot counted exactly once among free, cached and held by requests."""
        with self._lock:
            self.cache.check_integrity()
            held = set()
            shared = {}
            for r in self.scheduler.running:
                own = r.slots[r.prefix_len :]
                for s in own:
                    if s in held:
                        raise AssertionError(f"slot {s} owned twice")
                    held.add(s)
                if r.shared is not None:
                    shared[id(r.shared)] = r.shared
            for r in self.scheduler.waiting:
                if r.shared is not None:
                    shared[id(r.shared)] = r.shared
            for sp in shared.values():
                for s in sp.slots:
                    if s in held:
                        raise AssertionError(f"slot {s} owned twice")
                    held.add(s)
            cap = self.allocator.num_slots
            if self.allocator.available_size() + self.cache.total_size() + len(held) != cap:
                raise AssertionError(
                    f"free {self.allocator.available_size()} + cached {self.cache.total_size()} + held "
                    f"{len(held)} != capacity {cap}"
                )
