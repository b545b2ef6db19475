"""`AsyncLLM`: the engine loop in a background thread, streamed to asyncio callers.

The synchronous :class:`~radixkv.engine.Engine` is driven by exactly one thread (the *engine
thread*), as the engine's concurrency model requires (docs/architecture.md): every call that
touches engine state (add, abort, cache stats, flush, inspection) is posted into the engine's
inbox (``Engine.post``) from the caller's thread and runs on the engine thread between two steps.
Callers on any asyncio event loop receive outputs through a per-request :class:`asyncio.Queue`,
filled with ``loop.call_soon_threadsafe``; no caller ever blocks the model loop and the model loop
never blocks an event loop. Requests submitted concurrently are batched by the engine's
scheduler (continuous batching), because the engine thread admits all of them before its next
step.

The design follows vLLM's ``AsyncLLM`` / SGLang's tokenizer-manager split (an output-collector
per request fed by one background loop), reduced to one process and one thread.

Example::

    import asyncio
    from radixkv import AsyncLLM, SamplingParams

    async def main():
        async with AsyncLLM(model="smollm2-135m") as llm:
            async for out in llm.generate("The capital of France is", SamplingParams(max_tokens=8)):
                print(out.outputs[0].text)       # cumulative text so far

    asyncio.run(main())
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import concurrent.futures
import dataclasses
import logging
import threading
import uuid
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Hashable, Mapping, Sequence

from radixkv.branching import AsyncSession, Prompt, SelectResult, drive_async, select_program
from radixkv.engine.stats import EngineStats
from radixkv.errors import RequestError, RequestFailed
from radixkv.inputs import batch_requests, check_sampling_params, refuse_vllm_options, to_token_ids, to_token_prompt
from radixkv.namespace import Namespace, with_salt
from radixkv.outputs import RequestOutput, delta_output, ended_early
from radixkv.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

__all__ = ["AsyncLLM", "EngineDeadError", "RequestStream"]


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (shut down, or ``Engine.step()`` raised); no more requests."""


@dataclass
class _Stream:
    """Where the engine thread delivers one request's outputs: an asyncio queue on its loop.
    ``aborted``: its request was aborted by id (:meth:`AsyncLLM.abort`; set before its final
    output is put), unlike a request the engine itself ended with "abort" (a grammar that failed
    to compile)."""

    loop: asyncio.AbstractEventLoop | None
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    aborted: bool = False

    def put(self, item: RequestOutput | BaseException) -> None:
        """Thread-safe: schedule ``item`` onto the caller's loop (no-op if that loop is closed)."""
        if self.loop is None:
            return
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the caller's event loop is closed; nobody is listening
            pass


_ABORTED = object()  # delivered to a stream whose request was aborted via AsyncLLM.abort()


class AsyncLLM:
    """Asynchronous, streaming front end of :class:`~radixkv.engine.Engine`.

    Args:
        model: model name or path, as for :class:`~radixkv.llm.LLM` (ignored when ``engine`` is given).
        engine: an existing ``Engine`` to drive instead of building one. AsyncLLM takes it over:
            afterwards only the engine thread should call its methods.
        **kwargs: the same keywords as :class:`~radixkv.llm.LLM`
            (:func:`radixkv.engine_args.split_engine_kwargs`): :class:`~radixkv.config.EngineConfig`
            fields (``device``, ``dtype``, ``page_size``, ``max_total_tokens``, ``prefix_cache``,
            ``enable_prefix_caching``, ``attention_backend``, ``max_running_requests``,
            ``chunked_prefill_size``, ``schedule_policy``, ...) plus the ``Engine`` keywords
            ``loaded_model``, ``model_runner``, ``tokenizer``, ``eos_token_ids`` and ``clock``.
            Not allowed together with ``engine``.
        namespace: the prefix-cache namespace of every request that names none, as
            :class:`~radixkv.llm.LLM`'s (``generate``, ``generate_batch``, sessions, ``select``).

    Thread model: one daemon thread named ``radixkv-engine``; all public methods are safe to call
    from any thread and any event loop (one AsyncLLM can serve several loops at once). Dropped
    without :meth:`shutdown` (and no stream of it left), it is collected: its thread then closes
    the engine (the KV tiers' writes) and ends, freeing the engine and its KV pool. One still
    running at interpreter exit is shut down then (its requests aborted, its tiers' writes done),
    before the interpreter finalizes; the exit also waits for a dropped one's close still running.
    A process forked after it was made has no engine thread
    (a fork copies only the forking thread): there its calls raise EngineDeadError.

    Raises:
        ValueError: an unknown keyword, keywords together with ``engine``, an ``engine`` that is
            not an :class:`~radixkv.engine.engine.Engine`, or an invalid engine option (naming the
            field).
    """

    def __init__(self, model: str = "smollm2-135m", *, engine: Any = None, namespace: Hashable = None, **kwargs: Any):
        self.namespace = Namespace.of(namespace)
        if engine is None:
            from radixkv.engine_args import build_engine

            engine = build_engine("AsyncLLM", model, kwargs)
        elif kwargs:
            raise ValueError(f"AsyncLLM: engine options {sorted(kwargs)} given together with an engine")
        else:
            from radixkv.engine.engine import Engine

            if not isinstance(engine, Engine):
                raise ValueError(f"AsyncLLM: engine must be a radixkv Engine, got {type(engine).__name__}")
        self.engine = engine
        # Engine-thread-only state: request_id -> stream of a request the engine still runs,
        # and the calls to make on the engine thread when one of them finishes (sessions' pins).
        self._streams: dict[str, _Stream] = {}
        self._hooks: dict[str, Callable[[Any, RequestOutput], None]] = {}
        self._dead: BaseException | None = None
        self._closing = False
        self._stop = False  # set on the engine thread by the posted stop command
        self._pending: set[concurrent.futures.Future] = set()  # futures of posted calls not run yet
        self._abandoned: collections.deque = collections.deque()  # (rid, stream) dropped by consumers
        # published by the engine thread, one pair: the stats without the per-tenant rows, and those
        self._stats: tuple[EngineStats, Any] = (engine.cache_stats(tenants=False), engine.tenant_snapshot())
        self._refresh_posted = False  # a stats refresh is posted and has not run yet (KV tiers)
        self._lock = threading.Lock()  # orders "check alive + post" against "stop + fail the rest"
        # NOTE: the thread holds this AsyncLLM weakly, so one dropped without shutdown() is
        # collected; its finalizer wakes the thread, which then releases the engine (its pool)
        self._thread = threading.Thread(
            target=_engine_thread, args=(weakref.ref(self), engine), name="radixkv-engine", daemon=True
        )
        weakref.finalize(self, engine.post, _nothing).atexit = False
        _stop_at_exit(self)
        self._thread.start()

    @classmethod
    def from_engine(cls, engine: Any) -> "AsyncLLM":
        """Drive an existing :class:`~radixkv.engine.Engine` (same as ``AsyncLLM(engine=engine)``)."""
        return cls(engine=engine)

    # ------------------------------------------------------------------ public API

    @property
    def tokenizer(self) -> Any:
        """The engine's (transformers) tokenizer; read-only use is thread-safe."""
        return self.engine.tokenizer

    async def get_tokenizer(self) -> Any:
        """The engine's tokenizer, awaited as vLLM's ``AsyncLLM.get_tokenizer()`` is (the same
        object as :attr:`tokenizer`)."""
        return self.engine.tokenizer

    @property
    def max_context_len(self) -> int:
        """Longest sequence (prompt + output tokens) the engine accepts."""
        return int(self.engine.max_context_len)

    @property
    def is_running(self) -> bool:
        """True while the engine thread is alive and has not failed."""
        return self._dead is None and self._thread.is_alive()

    @property
    def dead_error(self) -> BaseException | None:
        """The reason the engine thread stopped (None while it runs)."""
        return self._dead

    def generate(
        self,
        prompt: str | Sequence[int] | None = None,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        namespace: Hashable = None,
        on_finish: Callable[[Any, RequestOutput], None] | None = None,
        lora_request: Any = None,
        priority: Any = 0,
    ) -> "RequestStream":
        """Submit one request and stream its cumulative outputs (``async for out in
        llm.generate(...)``). The request is submitted at the first ``__anext__``.

        Args:
            prompt: text (tokenized with the engine's tokenizer without added special tokens,
                as ``LLM.generate`` does; no chat template), a list of token ids, or a dict
                ``{"prompt": ...}`` / ``{"prompt_token_ids": [...]}`` (:mod:`radixkv.inputs`;
                its ``"cache_salt"`` joins the namespace as its salt).
            sampling_params: default ``SamplingParams()``.
            request_id: unique among unfinished requests; a fresh ``"req-<uuid>"`` when None.
            prompt_token_ids: token ids, as an alternative to ``prompt`` (then ``prompt`` must
                be None or the text those ids came from, kept for the output).
            namespace: prefix-cache namespace (requests only share cache within one namespace);
                None: this AsyncLLM's ``namespace``.
            on_finish: ``on_finish(engine, final output)`` runs on the engine thread when the
                request finishes, before its final output is delivered (no step runs in between;
                not on abort or error: ``radixkv.outputs.ended_early``): e.g. pin what it left
                cached (stored Responses).
            lora_request, priority: vLLM's; taken at their defaults (None; 0 or None), else a
                RequestError naming them (:func:`radixkv.inputs.refuse_vllm_options`).

        Returns:
            A :class:`RequestStream`: an async iterator of ``RequestOutput`` snapshots,
            cumulative (``outputs[i].text`` / ``token_ids`` hold everything generated so far);
            the last one has ``finished == True``. When the consumer falls behind, intermediate
            snapshots are skipped (each one contains the previous), never the final one. With
            ``sampling_params.output_kind`` ``RequestOutputKind.DELTA`` each output holds only
            what is new since the one before (:func:`radixkv.outputs.delta_output`: the samples
            with new tokens or text, or that finished; joined, the deltas are the cumulative
            output); with ``FINAL_ONLY`` the final output alone is yielded.

        Raises:
            RequestError: (a ValueError naming the field; from the first ``__anext__``, before
                anything is yielded) invalid prompt or sampling params (``Engine.add_request``'s
                checks), or a duplicate ``request_id``.
            EngineDeadError: the engine thread is not running.
            RequestFailed: (in place of the final output) the request's sampling raised in the
                engine (finish_reason ``"error"``): only it stopped, its slots are released.

        Abandoning: the request is aborted in the engine (its KV slots released) however its
        consumer leaves before the final output: ``break`` or an exception out of ``async for``
        (also over a stream held in a variable: each ``async for`` iterates through a fresh
        iterator, and dropping it aborts), cancellation of the consuming task, ``aclose()``, or
        the stream being garbage-collected.
        """
        rid = request_id if request_id is not None else f"req-{uuid.uuid4().hex}"
        stream = _Stream(loop=None)
        state = [False]  # [finished or failed]: nothing left to abort
        body = self._generate(
            prompt,
            sampling_params,
            rid,
            prompt_token_ids,
            namespace,
            stream,
            state,
            on_finish,
            (lora_request, priority),
        )
        return RequestStream(self, rid, stream, state, body)

    async def _generate(
        self,
        prompt: Any,
        sampling_params: Any,
        rid: str,
        prompt_token_ids: Any,
        namespace: Hashable,
        stream: "_Stream",
        state: list,
        on_finish: Callable[[Any, RequestOutput], None] | None = None,
        vllm_options: tuple = (None, None),
    ) -> AsyncIterator[RequestOutput]:
        """The body of :meth:`generate` (an async generator; its ``finally`` aborts)."""
        self._check_alive()
        refuse_vllm_options(*vllm_options)
        sampling_params = check_sampling_params(sampling_params)
        text: str | None
        if prompt_token_ids is not None:
            if prompt is not None and not isinstance(prompt, str):
                raise RequestError("with prompt_token_ids, prompt must be None or their text (a str)", "prompt")
            ids, text = to_token_ids(prompt_token_ids, "prompt_token_ids"), prompt
        elif prompt is not None:
            ids, text = to_token_prompt(self.engine.tokenizer, prompt)
        else:
            raise RequestError("prompt: one of prompt or prompt_token_ids is required", "prompt")
        namespace = self.namespace if namespace is None else namespace
        if isinstance(prompt, Mapping) and prompt.get("cache_salt") is not None:
            namespace = with_salt(namespace, prompt["cache_salt"])
        stream.loop = asyncio.get_running_loop()

        def add(engine: Any) -> None:
            if rid in self._streams:
                self._drain_abandoned()  # a consumer of this id that left before this call frees it
            if rid in self._streams:
                raise RequestError(f"request_id {rid!r} is already running", "request_id")
            engine.add_request(ids, sampling_params, request_id=rid, prompt=text, namespace=namespace)
            self._streams[rid] = stream
            if on_finish is not None:
                self._hooks[rid] = on_finish

        finished, kind, sent = False, sampling_params.output_kind, {}
        try:
            await asyncio.wrap_future(self.submit(add))
            while True:
                item = await stream.queue.get()
                while not stream.queue.empty() and not _is_final(item):
                    item = stream.queue.get_nowait()  # skip to the newest cumulative snapshot
                if isinstance(item, BaseException):
                    finished = True  # the engine thread already dropped this request
                    raise item
                if item is _ABORTED:
                    finished = True
                    return
                finished = bool(item.finished)
                if finished and item.error is not None:
                    raise RequestFailed(item)  # its slots are released; the engine goes on
                if kind == RequestOutputKind.DELTA:
                    item = delta_output(item, sent)
                if item is None or (kind == RequestOutputKind.FINAL_ONLY and not finished):
                    continue
                yield item
                if finished:
                    return
        finally:
            state[0] = True
            if not finished:
                self._abort_nowait(rid, stream)

    def _abandon(self, rid: str, stream: "_Stream", state: list) -> None:
        """A :class:`RequestStream` or one ``async for`` over it was dropped (a finalizer: any
        thread, maybe inside a garbage collection, so nothing here takes a lock): queue the abort
        of ``rid``; the engine thread applies it before its next step (a no-op when the request
        finished or was never submitted)."""
        if not state[0]:
            self._abandoned.append((rid, stream))

    async def generate_batch(
        self,
        requests: Sequence[tuple],
        on_finish: Sequence[Callable[[Any, RequestOutput], None] | None] | None = None,
    ) -> list[RequestOutput]:
        """Submit every ``(prompt token ids, SamplingParams, namespace)`` of ``requests`` in ONE
        engine message (so they wait together and are admitted in the same step while they fit:
        their common prefixes are computed once) and return their final outputs, in order (the
        same method as :meth:`radixkv.llm.LLM.generate_batch`, awaited; sessions and ``select``
        run on it). ``on_finish[i](engine, output)`` (or None) runs on the engine thread when
        request ``i`` finishes, before its output is delivered (no step runs in between; not on
        abort or error: ``radixkv.outputs.ended_early``; an exception it raises is logged).
        Cancelling aborts them all. A request the engine itself ended (its grammar failed to
        compile: finish_reason ``"abort"``) is returned, as on LLM.

        Raises:
            RequestError: any request refused (then none is submitted); a request that is not such
                a triple (param ``requests``), ``on_finish`` not one hook or None per request
                (``on_finish``).
            RequestFailed: a request's sampling raised in the engine (the others are aborted).
            asyncio.CancelledError: a request of it was aborted by id (:meth:`abort`; the others
                are aborted).
            EngineDeadError: the engine thread is not running.
        """
        requests, hooks = batch_requests(requests, on_finish)
        self._check_alive()
        loop = asyncio.get_running_loop()
        base = uuid.uuid4().hex
        rids = [f"req-{base}-{i}" for i in range(len(requests))]
        streams = [_Stream(loop=loop) for _ in requests]

        def add(engine: Any) -> None:
            added: list[str] = []
            try:
                for rid, stream, (ids, params, ns), hook in zip(rids, streams, requests, hooks):
                    engine.add_request(ids, params, request_id=rid, namespace=self.namespace if ns is None else ns)
                    added.append(rid)
                    self._streams[rid] = stream
                    if hook is not None:
                        self._hooks[rid] = hook
            except BaseException:
                for rid in added:
                    self._streams.pop(rid, None)
                    self._hooks.pop(rid, None)
                    engine.abort_now(rid)
                raise

        finals: list[RequestOutput | None] = [None] * len(requests)
        submitted = False
        try:
            await asyncio.wrap_future(self.submit(add))
            submitted = True
            for i, stream in enumerate(streams):
                while True:
                    item = await stream.queue.get()
                    if isinstance(item, BaseException):
                        raise item
                    if item is _ABORTED or stream.aborted:
                        raise asyncio.CancelledError(f"request {rids[i]} was aborted")
                    if item.finished:
                        if item.error is not None:
                            raise RequestFailed(item)
                        finals[i] = item
                        break
            return finals  # type: ignore[return-value]
        finally:
            if submitted:
                for rid, stream, out in zip(rids, streams, finals):
                    if out is None:
                        self._abort_nowait(rid, stream)

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Abort unfinished requests by id: one id or an iterable of them (a list, a generator),
        as vLLM's ``abort`` takes (no-op for an id that already finished or is unknown).

        The engine releases the request's KV slots; its ``generate`` iterator then yields one
        last output, ``finished``, with finish_reason ``"abort"`` on each sample still running
        (its tokens so far), and ends, as vLLM's; that output is queued before this returns, so
        the request no longer counts in :meth:`num_unfinished_requests` and its id can be reused
        at once. A :meth:`generate_batch` waiting for it raises
        ``asyncio.CancelledError``. Callers usually abort by cancelling or closing the iterator.

        Raises:
            RequestError: (param ``request_id``) an id that is not a str, or neither a str nor an
                iterable.
        """
        bad = RequestError(f"request_id must be a str or an iterable of them, got {request_id!r:.80}", "request_id")
        if isinstance(request_id, str):
            ids = [request_id]
        elif isinstance(request_id, (bytes, bytearray)) or not isinstance(request_id, Iterable):
            raise bad
        else:
            ids = list(request_id)  # vLLM's as_list: a generator or dict.keys() too
        if not all(isinstance(r, str) for r in ids):
            raise bad

        def abort_all(engine: Any) -> None:
            finals = [f for f in (self._abort_in_thread(rid, None) for rid in ids) if f is not None]
            self._publish_stats()  # before any consumer sees a final output
            for stream, out in finals:
                stream.put(out)

        await asyncio.wrap_future(self.submit(abort_all))

    def cache_stats(self) -> EngineStats:
        """``Engine.cache_stats()`` as of the engine thread's latest step or posted call (a
        consistent snapshot taken between steps; a plain method, as :meth:`radixkv.llm.LLM.cache_stats`,
        that never blocks: the engine thread publishes it after every step, before it delivers
        that step's outputs, and after every call it runs, before its result is delivered; so an
        awaited ``generate`` / ``reset_prefix_cache`` / ``call_in_engine_thread`` is always
        reflected).

        With KV tiers, whose state also moves off the engine thread (writes finishing, a degraded
        remote tier's probe), each read also posts one refresh (none while one is pending), so
        an idle engine's next read reports them: a ``/health`` poll sees a recovered Redis on
        the read after the probe's ``PING`` answers."""
        if getattr(getattr(self.engine, "kv", None), "tiers", None) is not None:
            self._post_refresh()
        stats, tenants = self._stats  # NOTE: the per-tenant rows are built here, on the reader's thread
        return dataclasses.replace(stats, tenants=tenants.rows())

    def _publish_stats(self) -> None:
        """The engine thread publishes its stats (O(1) of the number of tenants: their rows are a
        :class:`~radixkv.engine.stats.TenantSnapshot`, built when read)."""
        engine = self.engine
        self._stats = (engine.cache_stats(tenants=False), engine.tenant_snapshot())

    def _post_refresh(self) -> None:
        def refreshed(engine: Any) -> None:  # _apply publishes the stats after it
            self._refresh_posted = False

        with self._lock:
            if self._refresh_posted or self._dead is not None or self._closing:
                return
            self._refresh_posted = True
            self.engine.post(lambda e: self._apply(refreshed, None))

    def get_cache_stats(self, timeout: float | None = None) -> EngineStats:
        """The same as :meth:`cache_stats` (kept for older callers; ``timeout`` is unused)."""
        return self.cache_stats()

    async def reset_prefix_cache(self, tiers: bool = False) -> bool:
        """Flush the prefix cache (``tiers``: also the KV tiers the engine owns, host and disk);
        False (and nothing done) while any request is unfinished."""
        return await asyncio.wrap_future(self.submit(lambda e: self._reset_in_thread(e, tiers)))

    def num_unfinished_requests(self) -> int:
        """Requests submitted through this AsyncLLM whose streams are still open (a plain method,
        as on :class:`~radixkv.llm.LLM`). An aborted request leaves this count when the engine
        thread applies the abort (before its next step); the engine releases its slots in that
        step (``Engine.has_unfinished_requests()`` stays True until then)."""
        return len(self._streams)

    async def unfinished_request_ids(self) -> list[str]:
        """The ids of the requests :meth:`num_unfinished_requests` counts, read on the engine
        thread (what :meth:`abort` may still abort: SGLang's ``abort_all``)."""
        return await asyncio.wrap_future(self.submit(lambda e: list(self._streams)))

    def subscribe(self, fn: Callable[[Any], None], kinds: tuple[type, ...] | None = None) -> Callable[[], None]:
        """Subscribe ``fn`` to the engine's events (:meth:`radixkv.engine.events.EventBus.subscribe`);
        ``fn`` runs on the engine thread. Blocks until subscribed (on the engine thread itself, a
        finish hook or a subscriber, it subscribes at once); returns the unsubscribe
        function (which, called from any thread, takes effect between two steps)."""
        if self._on_engine_thread():  # a hook or subscriber: waiting would block itself
            unsubscribe = self.engine.events.subscribe(fn, kinds)
        else:
            unsubscribe = self.submit(lambda e: e.events.subscribe(fn, kinds)).result(60.0)

        def off() -> None:
            if self._on_engine_thread() or self._dead is not None:
                unsubscribe()
            else:
                self.submit(lambda e: unsubscribe())

        return off

    def session(self, prompt: Prompt = None, *, namespace: Hashable = None) -> AsyncSession:
        """An :class:`~radixkv.branching.AsyncSession` (as :meth:`radixkv.llm.LLM.session`): a
        growing context whose KV stays pinned between its awaited calls.

        Raises:
            RequestError: a malformed prompt (naming ``prompt``), an unhashable ``namespace``.
        """
        return AsyncSession(self, prompt, namespace=self.namespace if namespace is None else namespace)

    async def select(
        self, prompt: Prompt, choices: Sequence, *, method: str = "normalized", namespace: Hashable = None
    ) -> SelectResult:
        """As :meth:`radixkv.llm.LLM.select`, awaited: every choice submitted in one engine message."""
        ns = self.namespace if namespace is None else namespace
        return await drive_async(self, select_program(self, prompt, choices, method, ns))

    async def call_in_engine_thread(self, fn: Callable[[Any], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread between two steps and return its result.

        Use for read-only inspection (scheduler queue lengths, pool sizes) without racing a step.
        """
        return await asyncio.wrap_future(self.submit(fn))

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the engine thread after its current step. Unfinished requests are aborted and
        their streams raise ``EngineDeadError``; the writes queued for the KV tiers are done
        before the thread ends (``Engine.close``). Idempotent; safe from any thread."""
        with self._lock:
            if not self._closing:
                self._closing = True
                self.engine.post(self._request_stop)
        if not self._on_engine_thread():
            self._thread.join(timeout)

    def __enter__(self) -> "AsyncLLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    async def __aenter__(self) -> "AsyncLLM":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.shutdown)

    # ------------------------------------------------------------------ internals

    def _on_engine_thread(self) -> bool:
        """Whether the caller runs on the engine thread (a finish hook, an event subscriber, a
        posted call): there, waiting for anything posted to that thread would wait forever."""
        return threading.current_thread() is self._thread

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine thread has stopped: {self._dead!r}") from self._dead
        if self._closing:
            raise EngineDeadError("AsyncLLM is shut down")
        if not self._thread.is_alive():  # a fork's child: only the forking thread came along
            raise EngineDeadError(
                "the engine thread is not running in this process (an AsyncLLM made before a fork has none in "
                "the child: make a new AsyncLLM there, or use the 'spawn' start method)"
            )

    def submit(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Post ``fn(engine)`` to the engine thread now, from any thread (no event loop needed),
        and return a :class:`concurrent.futures.Future` of its result or exception
        (:meth:`call_in_engine_thread` awaits one). The future fails with
        :class:`EngineDeadError` when the engine thread is not running; cancelling it before the
        call starts skips the call. On the engine thread itself (a finish hook, an event
        subscriber, a posted call) the call is posted as well, to run after the caller returns,
        so waiting there for its result (``result()``, ``exception()``) raises RuntimeError
        instead of waiting forever: use the hook's own ``engine`` argument."""
        fut: concurrent.futures.Future = _EngineFuture(self._on_engine_thread)
        with self._lock:
            try:
                self._check_alive()
            except EngineDeadError as exc:
                fut.set_exception(exc)
                return fut
            self._pending.add(fut)
            self.engine.post(lambda e: self._apply(fn, fut))
        return fut

    def _abort_nowait(self, rid: str, stream: _Stream) -> None:
        with self._lock:
            if self._dead is None and not self._closing:
                self.engine.post(lambda e: self._apply(lambda e: self._abort_in_thread(rid, stream), None))

    def _abort_in_thread(self, rid: str, stream: _Stream | None) -> tuple[_Stream, RequestOutput] | None:
        """Abort ``rid`` on the engine thread: for its consumer that gave up (``stream``; nobody
        reads it any more) or by id (``stream`` None: :meth:`abort`). By id, the request leaves
        at once and its final output (finish_reason "abort") is returned with its stream for the
        caller to deliver, as vLLM's ``abort`` queues it before it returns: once the abort is
        awaited the request is no longer unfinished and its id is free (a later step delivering it
        would refuse a new request of that id, or end its stream)."""
        # Only a request still in _streams is unfinished in the engine, so a request that
        # finished in the same step as its consumer gave up is never aborted twice.
        current = self._streams.get(rid)
        if current is None or (stream is not None and current is not stream):
            return None
        # NOTE: never reported by a later step: by then a new request may have taken the id
        # (its consumer left first), and that step would deliver this final output to its stream
        final = self.engine.abort_now(rid, report=False)
        if stream is None and final is None:
            return None  # it ended in the engine already (its final output is the next step's)
        del self._streams[rid]
        self._hooks.pop(rid, None)
        logger.debug("aborted %s", rid)
        if stream is not None:  # its consumer left: nobody reads the final output
            current.put(_ABORTED)
            return None
        current.aborted = True
        return current, final

    def _drain_abandoned(self) -> None:
        """Abort the requests whose consumers left without closing their stream (engine thread)."""
        while self._abandoned:
            rid, stream = self._abandoned.popleft()
            self._abort_in_thread(rid, stream)

    def _reset_in_thread(self, engine: Any, tiers: bool = False) -> bool:
        if self._streams:
            return False
        return bool(engine.reset_prefix_cache(tiers=tiers))

    def _request_stop(self, engine: Any) -> None:
        self._stop = True

    def _step_once(self) -> None:
        """One ``Engine.step()``; each output goes to its request's stream (if still open)."""
        deliveries = []
        for out in self.engine.step():
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
                hook = self._hooks.pop(out.request_id, None)
                if hook is not None and not ended_early(out):
                    try:
                        hook(self.engine, out)
                    except Exception:  # noqa: BLE001 - a caller's hook must not stop the engine
                        logger.exception("finish hook of %s failed", out.request_id)
            deliveries.append((stream, out))
        self._publish_stats()  # after the hooks, before any consumer sees an output
        for stream, out in deliveries:
            stream.put(out)  # the engine builds a fresh RequestOutput every step

    def _apply(self, fn: Callable[[Any], Any], fut: concurrent.futures.Future | None) -> None:
        """Run one posted call on the engine thread (nothing once the thread has stopped)."""
        if self._dead is not None:
            return
        if fut is not None:
            self._pending.discard(fut)
            if not fut.set_running_or_notify_cancel():
                return
        try:
            result = fn(self.engine)
            self._publish_stats()  # before the caller sees the result
        except BaseException as exc:  # noqa: BLE001 - delivered to the caller
            if fut is None:
                logger.exception("engine command failed")
            else:
                fut.set_exception(exc)
        else:
            if fut is not None:
                fut.set_result(result)

    def _turn(self) -> bool:
        """One turn of the engine thread (:func:`_engine_thread`, after its wait for work):
        posted calls, then one step. False once it stopped (shut down, or the engine failed)."""
        engine = self.engine
        try:
            engine.run_posted()
            if self._stop:
                raise _Stopped
            self._drain_abandoned()
            if engine.has_unfinished_requests():
                self._step_once()
            return True
        except _Stopped:
            self._fail_all(EngineDeadError("AsyncLLM is shut down"), abort=True)
        except BaseException as exc:  # noqa: BLE001 - the engine is unusable after this
            logger.exception("engine step failed; AsyncLLM stops")
            self._dead = exc
            self._fail_all(EngineDeadError(f"engine failed: {exc!r}"), abort=False)
        if self._dead is None:
            self._dead = EngineDeadError("AsyncLLM is shut down")
        _close_engine(engine)
        try:  # the stats a reader sees from now on: the aborted requests released, the tiers closed
            self._publish_stats()
        except Exception:  # noqa: BLE001 - a failed engine may not report; the last snapshot stays
            logger.exception("reading the stats of the stopped engine failed")
        return False

    def _fail_all(self, exc: BaseException, abort: bool) -> None:
        with self._lock:  # nothing can be posted after this point
            self._closing = True
            pending, self._pending = list(self._pending), set()
        for rid, stream in list(self._streams.items()):
            if abort:
                self.engine.abort_now(rid)
            stream.put(type(exc)(*exc.args))  # one exception object per waiting task
        self._streams.clear()
        self._hooks.clear()
        for fut in pending:  # calls that will never run
            if fut.set_running_or_notify_cancel():
                fut.set_exception(type(exc)(*exc.args))
        if abort:
            try:  # report the aborts (the engine then holds nothing)
                self._dead = self._dead or EngineDeadError("AsyncLLM is shut down")
                self.engine.run_posted()  # the posted calls left are no-ops now
                self.engine.step()
            except Exception:  # noqa: BLE001 - shutting down; the streams are told already
                logger.exception("releasing aborted requests at shutdown failed")


class _EngineFuture(concurrent.futures.Future):
    """What :meth:`AsyncLLM.submit` returns: a future of a call posted to the engine thread,
    whose ``result()`` / ``exception()`` raise RuntimeError, rather than wait forever, when the
    call has not run yet and the waiter is the engine thread itself (the call runs only after
    the waiter returns)."""

    def __init__(self, on_engine_thread: Callable[[], bool]) -> None:
        super().__init__()
        self._on_engine_thread = on_engine_thread

    def result(self, timeout: float | None = None) -> Any:
        self._refuse_to_wait_on_engine_thread()
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._refuse_to_wait_on_engine_thread()
        return super().exception(timeout)

    def _refuse_to_wait_on_engine_thread(self) -> None:
        if not self.done() and self._on_engine_thread():
            raise RuntimeError(
                "AsyncLLM.submit(...).result() on the engine thread (in a finish hook, an event subscriber or a "
                "posted call) would wait forever: the call runs on that thread after the caller returns; use the "
                "engine the hook is given, or post without waiting"
            )


class RequestStream:
    """What :meth:`AsyncLLM.generate` returns: an async iterator of one request's cumulative
    ``RequestOutput`` snapshots whose abandonment aborts the request.

    An async generator's ``finally`` runs only on ``aclose()``, cancellation or collection, so a
    ``break`` out of ``async for`` over a generator kept in a variable would leave the request
    running. Here each ``async for`` gets a fresh iterator object (:meth:`__aiter__`) that only
    the loop holds; leaving the loop before the final output (``break``, ``return``, an
    exception) drops it, and its finalizer (``weakref.finalize``, run at once by CPython's
    reference counting) queues the abort. The stream's own finalizer does the same when the
    stream is collected unfinished. ``aclose()`` and cancellation abort through the generator's
    ``finally`` as before.

    Attributes:
        request_id: the engine request id.
    """

    __slots__ = ("request_id", "_body", "_finalizer", "__weakref__")

    def __init__(self, llm: AsyncLLM, request_id: str, stream: _Stream, state: list, body: Any) -> None:
        self.request_id = request_id
        self._body = body
        self._finalizer = (llm._abandon, request_id, stream, state)
        weakref.finalize(self, *self._finalizer).atexit = False

    def __aiter__(self) -> "_Iteration":
        return _Iteration(self)

    def __anext__(self) -> Any:
        return self._body.__anext__()

    def aclose(self) -> Any:
        """Close the stream (aborts the request if unfinished); awaitable."""
        return self._body.aclose()


class _Iteration:
    """One ``async for`` over a :class:`RequestStream`; dropped unfinished, it aborts."""

    __slots__ = ("_stream", "__weakref__")

    def __init__(self, stream: RequestStream) -> None:
        self._stream = stream
        weakref.finalize(self, *stream._finalizer).atexit = False

    def __aiter__(self) -> "_Iteration":
        return self

    def __anext__(self) -> Any:
        return self._stream._body.__anext__()


_RUNNING: "weakref.WeakSet[AsyncLLM]" = weakref.WeakSet()  # AsyncLLMs for the exit hook to stop
# their engine threads, for the exit hook to wait on: one whose AsyncLLM was collected (dropped
# without shutdown) goes on closing its engine, the KV tiers' writes, after _RUNNING forgot it
_THREADS: "weakref.WeakSet[threading.Thread]" = weakref.WeakSet()
_EXIT_HOOK: list = []  # [True] once _shutdown_at_exit is registered
_EXIT_TIMEOUT_S = 30.0  # how long the exit hook waits for each engine thread's current step


def _stop_at_exit(llm: AsyncLLM) -> None:
    """Shut ``llm`` down at interpreter exit, if still running (:func:`_shutdown_at_exit`)."""
    # NOTE: registered once, at the first AsyncLLM: after weakref.finalize's own exit hook (that
    # AsyncLLM made a finalizer already), so it runs first, before the KV tiers' finalizers
    if not _EXIT_HOOK:
        atexit.register(_shutdown_at_exit)
        _EXIT_HOOK.append(True)
    _RUNNING.add(llm)
    _THREADS.add(llm._thread)


def _shutdown_at_exit() -> None:
    """At interpreter exit, stop every engine thread still running (its requests aborted, its
    KV tiers' writes done) before the interpreter finalizes: a daemon thread caught inside a
    torch call then is killed there, and the process aborts ("terminate called without an
    active exception", exit code 134)."""
    for llm in list(_RUNNING):
        llm.shutdown(_EXIT_TIMEOUT_S)
    for thread in list(_THREADS):  # those of AsyncLLMs dropped without shutdown, still closing
        if thread.is_alive() and thread is not threading.current_thread():
            thread.join(_EXIT_TIMEOUT_S)


def _nothing(engine: Any) -> None:
    """A posted no-op: wakes the engine thread (its AsyncLLM was collected)."""


def _close_engine(engine: Any) -> None:
    try:
        engine.close()  # the KV tiers' queued writes, so a restart finds them
    except Exception:  # noqa: BLE001 - shutting down
        logger.exception("closing the engine's KV tiers failed")


def _engine_thread(ref: "weakref.ref[AsyncLLM]", engine: Any) -> None:
    """The engine thread: a turn (:meth:`AsyncLLM._turn`) whenever there is work, until stopped.
    It holds its AsyncLLM only during a turn: one dropped without ``shutdown()`` (no stream of it
    left either) is collected, and the thread then closes the engine and ends, so the engine and
    its KV pool are freed (vLLM's AsyncLLM shuts down when collected too)."""
    while True:
        if not engine.has_unfinished_requests():
            engine.wait_for_work()  # block only when there is nothing to step
        llm = ref()
        if llm is None:
            _close_engine(engine)
            return
        if not llm._turn():
            return
        del llm


class _Stopped(Exception):
    """Internal: the stop sentinel was read."""


def _is_final(item: Any) -> bool:
    return item is _ABORTED or isinstance(item, BaseException) or bool(getattr(item, "finished", False))
