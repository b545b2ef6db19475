"""`EngineClient`: what every protocol handler needs from the engine, written once.

A handler (OpenAI completions and chat today; more protocols later) turns its request body into
prompts (``(text, token ids)`` pairs) and one ``SamplingParams``; :meth:`EngineClient.start`
submits one engine request per prompt through :class:`~radixkv.async_llm.AsyncLLM` (``n``
choices of one prompt share one engine request, so its prompt is prefilled and counted once),
waits for every first output (so an engine refusal becomes an HTTP 400 before any header is
sent), and hands back a :class:`Run`: the first outputs, the stream of later ones, and usage.
Errors reach the client typed: a :class:`~radixkv.errors.RequestError` becomes an
:class:`~radixkv.server.openai.protocol.APIError` carrying its field.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from starlette.requests import Request

from radixkv.async_llm import AsyncLLM
from radixkv.errors import RequestError
from radixkv.outputs import RequestOutput
from radixkv.sampling_params import SamplingParams
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
    request field it came from (e.g. ``json_schema`` -> ``response_format``), and fields the
    client did not send (``request_id``, ``sampling_params``) none."""
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
    """

    firsts: list[RequestOutput]
    rest: AsyncIterator[tuple[int, RequestOutput]]
    usage: Callable[[list], Usage]


class EngineClient:
    """Submits prompts to the engine for the protocol handlers.

    Args:
        llm: the running AsyncLLM.
        metrics: the app's metrics (time to first output and end-to-end latency are observed
            here; token and finish counts come from the engine's events).
    """

    def __init__(self, llm: AsyncLLM, metrics: ServerMetrics) -> None:
        self.llm = llm
        self.metrics = metrics

    @property
    def tokenizer(self) -> Any:
        """The engine's tokenizer."""
        return self.llm.tokenizer

    @property
    def max_context_len(self) -> int:
        """Longest sequence (prompt + output) the engine accepts."""
        return self.llm.max_context_len

    async def _first_outputs(self, gens: list[AsyncIterator], prompt_param: str, renames: dict | None) -> list:
        try:
            return list(await asyncio.gather(*(g.__anext__() for g in gens)))
        except ValueError as exc:
            await close_all(gens)
            raise request_error_to_api(exc, prompt_param, renames) from exc
        except BaseException:
            await close_all(gens)
            raise

    async def start(
        self,
        endpoint: str,
        prompts: list[Prompt],
        params: SamplingParams,
        prompt_param: str,
        renames: dict | None = None,
    ) -> Run:
        """Submit one engine request per prompt and wait for each one's first output; counts the
        API request as accepted under ``endpoint`` in ``radixkv_requests_total``. ``renames``
        maps engine fields to the request fields that set them (for a refusal's ``param``).

        Raises:
            APIError: the engine refused a request (400, ``param`` from the refusal).
        """
        base = new_id("cmpl")
        start = time.perf_counter()
        gens = [
            self.llm.generate(text, params, f"{base}-{i}", prompt_token_ids=ids)
            for i, (text, ids) in enumerate(prompts)
        ]
        self.metrics.requests.labels(endpoint=endpoint).inc()
        firsts = await self._first_outputs(gens, prompt_param, renames)
        ttft = time.perf_counter() - start
        for _ in firsts:
            self.metrics.ttft.observe(ttft)
        finals: dict[int, Any] = {i: o for i, o in enumerate(firsts) if o.finished}
        for _ in finals:
            self.metrics.e2e.observe(ttft)

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

        return Run(firsts, rest(), usage)

    async def collect(self, raw: Request, run: Run) -> list:
        """Run to completion for a non-streamed answer; a client that disconnects aborts it.

        Raises:
            ClientDisconnected: the client went away first.
        """
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
