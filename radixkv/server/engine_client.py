"""`EngineClient`: what every protocol handler needs from the engine, written once.

A handler (OpenAI completions and chat, SGLang's ``/generate``, the vLLM extras) turns its
request body into prompts (``(text, token ids)`` pairs) and ``SamplingParams`` (one for all
prompts, or one per prompt); :meth:`EngineClient.start` submits one engine request per prompt
through the app's :class:`~radixkv.server.backend.EngineBackend` (one local AsyncLLM, or replicas
on Ray Serve; ``n`` choices of one prompt share one engine
request, so its prompt is prefilled and counted once), waits for every first output (so an engine
refusal becomes an HTTP 400 before any header is sent), and hands back a :class:`Run`: the first
outputs, the stream of later ones, and usage. Errors reach the client typed: a
:class:`~radixkv.errors.RequestError` becomes an
:class:`~radixkv.server.openai.protocol.APIError` carrying its field. :meth:`EngineClient.flush`
is the one prefix-cache flush behind ``/flush_cache`` (SGLang) and ``/reset_prefix_cache`` (vLLM).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Sequence

from starlette.requests import Request

from radixkv.engine.stats import EngineStats
from radixkv.errors import QueueFullError, RequestError
from radixkv.namespace import Namespace
from radixkv.outputs import RequestOutput
from radixkv.sampling_params import SamplingParams
from radixkv.server.backend import EngineBackend, FinishHook, ModelFacts
from radixkv.server.metrics import ServerMetrics
from radixkv.server.openai.protocol import APIError, PromptTokensDetails, Usage, new_id
from radixkv.server.sse import close_all, merge

__all__ = ["EngineClient", "Run", "ClientDisconnected", "request_error_to_api"]

Prompt = tuple[str | None, list[int]]
"""One prompt: its text (None when given as token ids) and its token ids."""


class ClientDisconnected(Exception):
    """The client went away before a non-streamed answer was ready (its requests are aborted)."""


def request_error_to_api(exc: ValueError, prompt_param: str = "prompt", renames: dict | None = None) -> APIError:
    """A 400 :class:`APIError` for the engine's refusal ``exc``, with ``param`` taken from a
    :class:`~radixkv.errors.RequestError`'s field: ``"prompt"`` becomes ``prompt_param``
    (``"messages"`` for chat), ``max_new_tokens`` ``max_tokens``, a field in ``renames`` the
    request field it came from (e.g. ``max_tokens`` -> ``sampling_params.max_new_tokens``), and
    fields the client did not send (``request_id``, ``sampling_params``) none."""
    if isinstance(exc, QueueFullError):  # valid, but the engine is saturated: back off and retry
        return APIError(str(exc), None, status_code=429, type="server_error", code="queue_full")
    param = exc.param if isinstance(exc, RequestError) else None
    if renames and param in renames:
        param = renames[param]
    elif param == "prompt":
        param = prompt_param
    elif param == "max_new_tokens":
        param = "max_tokens"
    elif param in ("request_id", "sampling_params"):
        param = None
    return APIError(str(exc), param)


@dataclass
class Run:
    """The engine requests of one API request.

    Attributes:
        firsts: each prompt's first output.
        rest: later ``(prompt index, output)`` pairs until every request finished; closing it
            aborts the unfinished ones (a disconnect frees their KV slots).
        usage: builds OpenAI usage from the latest outputs.
        request_ids: each prompt's engine request id.
        stream_failed: told of an error reported inside a stream whose headers were sent (it
            counts in ``radixkv_request_errors_total`` as the 500 it stands for).
    """

    firsts: list[RequestOutput]
    rest: AsyncIterator[tuple[int, RequestOutput]]
    usage: Callable[[list], Usage]
    request_ids: list[str] = field(default_factory=list)
    stream_failed: Callable[[Exception], None] = lambda exc: None


class EngineClient:
    """Submits prompts to the engine for the protocol handlers.

    Args:
        backend: the engine behind the routes (:class:`~radixkv.server.backend.EngineBackend`:
            one local AsyncLLM, or replicas on Ray Serve).
        metrics: the app's metrics (time to first output and end-to-end latency are observed
            here; token and finish counts come from the engine's events).
    """

    def __init__(self, backend: EngineBackend, metrics: ServerMetrics) -> None:
        self.backend = backend
        self.metrics = metrics

    @property
    def tokenizer(self) -> Any:
        """The engine's tokenizer."""
        return self.backend.tokenizer

    @property
    def max_context_len(self) -> int:
        """Longest sequence (prompt + output) the engine accepts."""
        return self.backend.max_context_len

    def model_facts(self) -> ModelFacts:
        """Static facts of the served model and engine (:class:`~radixkv.server.backend.ModelFacts`)."""
        return self.backend.model_facts()

    async def _first_outputs(self, gens: list[AsyncIterator], prompt_param: str, renames: dict | None) -> list:
        """Each request's ``(first output, time.perf_counter() when it came)``; when one is refused
        (or this is cancelled), every other request is aborted before this raises: its
        ``__anext__`` still running is cancelled first (``aclose()`` of a generator that is
        running raises, and the request ran on)."""

        async def first(g: AsyncIterator) -> tuple:
            out = await g.__anext__()
            return out, time.perf_counter()

        firsts = [asyncio.ensure_future(first(g)) for g in gens]
        try:
            return list(await asyncio.gather(*firsts))
        except BaseException as exc:
            for f in firsts:
                f.cancel()
            await asyncio.gather(*firsts, return_exceptions=True)
            await close_all(gens)
            if isinstance(exc, ValueError):
                raise request_error_to_api(exc, prompt_param, renames) from exc
            raise

    async def start(
        self,
        endpoint: str,
        prompts: list[Prompt],
        params: SamplingParams | Sequence[SamplingParams],
        prompt_param: str,
        renames: dict | None = None,
        *,
        request_ids: Sequence[str] | None = None,
        namespace: Namespace | None = None,
        on_finish: Sequence[FinishHook | None] | None = None,
        routing_key: str | None = None,
        hidden_outputs: Sequence[bool] | None = None,
    ) -> Run:
        """Submit one engine request per prompt and wait for each one's first output; counts the
        API request as accepted under ``endpoint`` in ``radixkv_requests_total`` unless the engine
        refused it.

        Args:
            endpoint: the ``endpoint`` label of ``radixkv_requests_total``.
            prompts: ``(text or None, token ids)`` per prompt.
            params: one ``SamplingParams`` for every prompt, or a sequence of one per prompt.
            prompt_param: the request field a refusal of the prompt names.
            renames: engine field -> the request field that set it (for a refusal's ``param``).
            request_ids: the engine request id of each prompt (a client's ``rid``); fresh ids
                when None. An id that is already running is refused (400).
            namespace: the prefix-cache namespace of every prompt (e.g. SGLang's ``cache_salt`` /
                ``extra_key``; None: the shared default).
            on_finish: per prompt, a hook run where the engine lives when its request finishes,
                given the backend's :class:`~radixkv.server.backend.Pins`
                (:meth:`EngineBackend.generate <radixkv.server.backend.EngineBackend.generate>`).
            routing_key: the conversation key the ``session`` routing policy hashes across
                replicas (:meth:`~radixkv.server.openai.protocol._SamplingFields.routing_key`).
            hidden_outputs: per prompt, True when its client is shown none of the tokens sampled
                (SGLang's ``max_new_tokens`` 0: one is sampled and dropped); they are not counted
                in ``radixkv_generation_tokens_total``.

        Raises:
            APIError: the engine refused a request (400, ``param`` from the refusal).
        """
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(per_prompt) != len(prompts) or (request_ids is not None and len(request_ids) != len(prompts)):
            raise ValueError("start: one SamplingParams and one request id per prompt")
        self._check_batch(len(prompts), prompt_param)
        base = new_id("cmpl")
        rids = list(request_ids) if request_ids is not None else [f"{base}-{i}" for i in range(len(prompts))]
        start = time.perf_counter()
        hooks = list(on_finish) if on_finish is not None else [None] * len(prompts)
        gens = [
            self.backend.generate(
                text, p, rid, prompt_token_ids=ids, namespace=namespace, on_finish=hook, routing_key=routing_key
            )
            for (text, ids), p, rid, hook in zip(prompts, per_prompt, rids, hooks)
        ]
        hidden = [rid for rid, h in zip(rids, hidden_outputs or ()) if h]
        self.metrics.hide_outputs(hidden)
        try:
            timed = await self._first_outputs(gens, prompt_param, renames)
        except APIError:  # refused (400, 429): not accepted, as a request the server refuses itself
            self.metrics.hide_outputs(hidden, False)
            raise
        except BaseException:  # accepted; the client went away (or the engine died) first
            self.metrics.requests.labels(endpoint=endpoint).inc()
            raise
        self.metrics.requests.labels(endpoint=endpoint).inc()
        for out, t in timed:  # each prompt's own time to its first output
            self.metrics.ttft.observe(t - start)
            if out.finished:
                self.metrics.e2e.observe(t - start)
        firsts = [out for out, _ in timed]
        finals: dict[int, Any] = {i: o for i, o in enumerate(firsts) if o.finished}

        async def rest() -> AsyncIterator[tuple[int, Any]]:
            pending = [g for i, g in enumerate(gens) if i not in finals]
            idx = [i for i in range(len(gens)) if i not in finals]
            try:
                async for j, out in merge(pending):
                    if out.finished:
                        finals[idx[j]] = out
                        self.metrics.e2e.observe(time.perf_counter() - start)
                    yield idx[j], out
            finally:
                await close_all(gens)

        def usage(outs: list) -> Usage:
            prompt_tokens = sum(len(ids) for _, ids in prompts)
            cached = sum(int(o.num_cached_tokens or 0) for o in outs)
            completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
            return Usage(
                prompt_tokens=prompt_tokens,
                completion_tokens=completion,
                total_tokens=prompt_tokens + completion,
                prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
            )

        return Run(firsts, rest(), usage, rids, lambda exc: self.metrics.request_errors.labels(status="500").inc())

    def _check_batch(self, n: int, prompt_param: str) -> None:
        """A 400 naming ``prompt_param`` for a batch of more prompts than the engine queues at
        once (``max_queued_requests``, or one tenant's ``max_queued_requests_per_tenant``): each
        prompt waits as one request, so such a batch is refused whole even by an idle server, and
        a 429 would ask for a retry that never works."""
        config = self.backend.model_facts().config
        for name in ("max_queued_requests", "max_queued_requests_per_tenant"):
            limit = config.get(name)
            if isinstance(limit, int) and n > max(limit, 1):  # NOTE: 0 refuses every request with a 429
                raise APIError(
                    f"a batch of {n} prompts is more than the server queues at once ({name} {limit}); "
                    f"send at most {limit} per request",
                    prompt_param,
                )

    async def collect(self, raw: Request, run: Run) -> list:
        """Run to completion for a non-streamed answer; a client that disconnects aborts it.

        Raises:
            ClientDisconnected: the client went away first.
        """
        for rid in run.request_ids:  # nothing before the final output reaches the client
            self.backend.hold_partials(rid)
        latest = list(run.firsts)
        try:
            async for i, out in run.rest:
                latest[i] = out
                if await raw.is_disconnected():
                    break
        finally:
            await run.rest.aclose()
        if not all(o.finished for o in latest):
            raise ClientDisconnected("the client disconnected; its requests were aborted")
        return latest

    async def cache_stats(self, check: bool = False) -> EngineStats:
        """The engine's :class:`~radixkv.engine.stats.EngineStats` (summed over replicas);
        ``check``: after the integrity check (:meth:`EngineBackend.cache_stats
        <radixkv.server.backend.EngineBackend.cache_stats>`)."""
        return await self.backend.cache_stats(check)

    async def flush(self, timeout: float = 0.0, tiers: bool = False) -> bool:
        """Flush the prefix cache (``Engine.reset_prefix_cache``; ``tiers``: also the KV tiers the
        engine owns). While requests are unfinished nothing is flushed; with ``timeout`` > 0
        (seconds; SGLang's ``/flush_cache?timeout=``) it retries until they finish or the time is
        up.

        Returns:
            True when the cache was flushed, False when requests were still unfinished.
        """
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            if await self.backend.reset_prefix_cache(tiers=tiers):
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            await asyncio.sleep(min(0.05, left))

    async def flush_or_409(self, timeout: float = 0.0, tiers: bool = False) -> dict:
        """:meth:`flush`, answered as ``/flush_cache`` and ``/reset_prefix_cache`` answer it.

        Returns:
            ``{"flushed": True, "message": ...}``.

        Raises:
            APIError: 409 ``requests_running`` (nothing was flushed) while requests are unfinished;
                409 ``flush_not_offered`` when the engine says why it never flushes (its
                ``flush_refused``, as across Ray Serve replicas).
        """
        refused = self.backend.flush_refused
        if refused:
            raise APIError(refused, None, status_code=409, code="flush_not_offered")
        if await self.flush(timeout, tiers):
            owned = tiers and any(m in ("host", "disk") for m in (await self.cache_stats()).tiers)
            what = "the prefix cache and the KV tiers it owns were" if owned else "the prefix cache was"
            none = " (no host or disk tier to flush)" if tiers and not owned else ""
            return {"flushed": True, "message": f"{what} flushed{none}"}
        running = self.backend.num_unfinished_requests()
        raise APIError(
            f"the prefix cache was not flushed: {running} request(s) are unfinished; retry when idle",
            None,
            status_code=409,
            code="requests_running",
        )
