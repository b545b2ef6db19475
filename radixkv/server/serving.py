"""Turning OpenAI requests into engine requests and engine outputs into OpenAI responses.

One :class:`OpenAIServing` per app. For each API request it validates the body against the
model (name, prompt length, ``max_tokens`` against the context), builds one ``SamplingParams``,
submits one engine request per prompt through :class:`~radixkv.async_llm.AsyncLLM` (``n``
choices of one prompt share one engine request, so its prompt is prefilled and counted once),
and renders either one JSON response or a server-sent-event stream of OpenAI chunks.

Streaming text is the difference between consecutive cumulative outputs. While a request has
stop strings and is unfinished, the last ``max(len(stop)) - 1`` characters are held back, so a
stop string that completes later is never streamed and the joined chunks equal the
non-streamed text.
"""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any, AsyncIterator, Callable, Sequence

from starlette.requests import Request

from radixkv.async_llm import AsyncLLM
from radixkv.sampling_params import SamplingParams
from radixkv.server.metrics import ServerMetrics
from radixkv.server.protocol import (
    APIError,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessageOut,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    PromptTokensDetails,
    Usage,
    new_id,
)
from radixkv.server.sse import Deltas, chain, close_all, merge, sse

_FIELDS = (
    "max_tokens", "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
    "stop_token_ids", "ignore_eos", "n", "prompt", "prompt_token_ids", "request_id",
)  # fmt: skip
_COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class ClientDisconnected(Exception):
    """The client went away before a non-streamed answer was ready (its requests are aborted)."""


def render_chat(tokenizer: Any, messages: Sequence[dict]) -> list[int]:
    """Token ids of a conversation rendered with the tokenizer's chat template, ending with the
    assistant generation prompt. The template already holds the special tokens, so none are
    added when encoding. Raises :class:`APIError` (param ``messages``) when the template fails."""
    try:
        text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # noqa: BLE001 - template errors are the client's conversation
        raise APIError(f"messages could not be rendered with the chat template: {exc}", "messages") from exc
    return list(tokenizer.encode(text, add_special_tokens=False))


def value_error_to_api(exc: ValueError, prompt_param: str = "prompt") -> APIError:
    """Map the engine's ValueError (its message names the field first) to a 400 APIError;
    prompt errors get ``prompt_param`` (``"messages"`` for chat)."""
    msg = str(exc)
    m = re.match(r"\s*([A-Za-z_]+)", msg)
    param = m.group(1) if m and m.group(1) in _FIELDS else None
    if param in ("prompt", "prompt_token_ids"):
        param = prompt_param
    elif param == "request_id":
        param = None
    if param == "max_new_tokens":
        param = "max_tokens"
    return APIError(msg, param)


class OpenAIServing:
    """The handlers behind ``/v1/completions`` and ``/v1/chat/completions``.

    Args:
        llm: the running AsyncLLM.
        served_model_name: the name clients send as ``model`` (and ``/v1/models`` lists).
        metrics: the app's Prometheus metrics.
        model_aliases: further names accepted as ``model`` (e.g. the ``--model`` argument).
    """

    def __init__(self, llm: AsyncLLM, served_model_name: str, metrics: ServerMetrics, model_aliases=()):
        self.llm = llm
        self.served_model_name = served_model_name
        self.accepted_models = {served_model_name, *model_aliases}
        self.metrics = metrics

    # ------------------------------------------------------------------ validation

    def _check_model(self, model: str) -> None:
        if model not in self.accepted_models:
            raise APIError(
                f"model {model!r} does not exist; this server serves {self.served_model_name!r}",
                "model",
                code="model_not_found",
            )

    def _sampling_params(self, req: Any, prompt_lens: list[int], default_max: int | None, param: str) -> SamplingParams:
        ctx = self.llm.max_context_len
        longest = max(prompt_lens)
        if longest >= ctx:
            raise APIError(
                f"{param} has {longest} tokens; this model's context is {ctx} tokens "
                f"(at most {ctx - 1} prompt tokens, leaving room for one generated token)",
                param,
                code="context_length_exceeded",
            )
        room = ctx - longest
        if req.max_tokens is None:
            max_tokens = room if default_max is None else min(default_max, room)
        elif req.max_tokens > room:
            raise APIError(
                f"max_tokens={req.max_tokens} plus the {longest} prompt tokens exceeds this model's "
                f"context of {ctx} tokens (at most {room} new tokens)",
                "max_tokens",
                code="context_length_exceeded",
            )
        else:
            max_tokens = req.max_tokens
        kwargs: dict[str, Any] = dict(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            n=req.n or 1,
            seed=req.seed,
            stop=req.stop_list,
            ignore_eos=bool(req.ignore_eos),
        )
        if req.top_k is not None:
            kwargs["top_k"] = req.top_k
        if req.min_p is not None:
            kwargs["min_p"] = req.min_p
        if req.stop_token_ids:
            kwargs["stop_token_ids"] = list(req.stop_token_ids)
        try:
            return SamplingParams(**kwargs)
        except ValueError as exc:
            raise value_error_to_api(exc) from exc

    def _completion_prompts(self, req: CompletionRequest) -> list[tuple[str | None, list[int]]]:
        p = req.prompt
        if p is None or (isinstance(p, (str, list)) and len(p) == 0):
            raise APIError("prompt must be a non-empty string, token list, or list of those", "prompt")
        items: list = [p] if isinstance(p, str) or isinstance(p[0], int) else list(p)
        prompts: list[tuple[str | None, list[int]]] = []
        tok = self.llm.tokenizer
        for item in items:
            if isinstance(item, str):
                if not item:
                    raise APIError("prompt strings must be non-empty", "prompt")
                prompts.append((item, list(tok.encode(item, add_special_tokens=False))))
            else:
                if not item:
                    raise APIError("prompt token lists must be non-empty", "prompt")
                prompts.append((None, list(item)))
        return prompts

    # ------------------------------------------------------------------ running requests

    async def _first_outputs(self, gens: list[AsyncIterator], prompt_param: str) -> list:
        """Start every engine request and wait for each one's first output, so that a request
        the engine rejects becomes an HTTP 400 before any response header is sent."""
        try:
            return list(await asyncio.gather(*(g.__anext__() for g in gens)))
        except ValueError as exc:
            await close_all(gens)
            raise value_error_to_api(exc, prompt_param) from exc
        except BaseException:
            await close_all(gens)
            raise

    async def _run(
        self, endpoint: str, prompts: list[tuple[str | None, list[int]]], params: SamplingParams, prompt_param: str
    ) -> tuple[list, AsyncIterator[tuple[int, Any]], Callable[[list], Usage]]:
        """Submit one engine request per prompt; returns (first outputs, stream of later
        (prompt_idx, output) pairs, a usage builder). Metrics are recorded as requests finish."""
        base = new_id("cmpl")
        start = time.perf_counter()
        gens = [
            self.llm.generate(text, params, f"{base}-{i}", prompt_token_ids=ids)
            for i, (text, ids) in enumerate(prompts)
        ]
        self.metrics.requests.labels(endpoint=endpoint).inc()
        firsts = await self._first_outputs(gens, prompt_param)
        ttft = time.perf_counter() - start
        for _ in firsts:
            self.metrics.ttft.observe(ttft)
        finals: dict[int, Any] = {i: o for i, o in enumerate(firsts) if o.finished}
        for i in finals:
            self._record(finals[i], start)

        async def rest() -> AsyncIterator[tuple[int, Any]]:
            pending = [g for i, g in enumerate(gens) if i not in finals]
            idx = [i for i in range(len(gens)) if i not in finals]
            try:
                async for j, out in merge(pending):
                    if out.finished:
                        finals[idx[j]] = out
                        self._record(out, start)
                    yield idx[j], out
            finally:
                unfinished = len(gens) - len(finals)
                if unfinished:
                    self.metrics.finished.labels(finish_reason="abort").inc(unfinished * params.n)
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

        return firsts, rest(), usage

    def _record(self, out: Any, start: float) -> None:
        m = self.metrics
        m.prompt_tokens.inc(len(out.prompt_token_ids))
        m.cached_tokens.inc(int(out.num_cached_tokens or 0))
        for c in out.outputs:
            m.generation_tokens.inc(len(c.token_ids))
            m.finished.labels(finish_reason=str(c.finish_reason)).inc()
        m.e2e.observe(time.perf_counter() - start)

    async def _collect(self, raw: Request, firsts: list, rest: AsyncIterator) -> list:
        """Run to completion for a non-streamed answer; a client that disconnects aborts it."""
        latest = list(firsts)
        try:
            async for i, out in rest:
                latest[i] = out
                if await raw.is_disconnected():
                    break
        finally:
            await rest.aclose()
        if not all(o.finished for o in latest):
            raise ClientDisconnected("the client disconnected; its requests were aborted")
        return latest

    # ------------------------------------------------------------------ endpoints

    async def completions(self, req: CompletionRequest, raw: Request) -> dict | AsyncIterator[str]:
        """``POST /v1/completions``: a response dict, or an SSE chunk stream when ``stream``."""
        req.check_values()
        self._check_model(req.model)
        prompts = self._completion_prompts(req)
        params = self._sampling_params(req, [len(ids) for _, ids in prompts], _COMPLETIONS_DEFAULT_MAX_TOKENS, "prompt")
        firsts, rest, usage = await self._run("completions", prompts, params, "prompt")
        rid, n = new_id("cmpl"), params.n

        def chunk(choices: list[CompletionChoice], u: Usage | None = None) -> str:
            body = CompletionResponse(id=rid, model=self.served_model_name, choices=choices, usage=u)
            return sse(body.model_dump())

        if not req.stream:
            outs = await self._collect(raw, firsts, rest)
            choices = [
                CompletionChoice(index=p * n + c.index, text=c.text, finish_reason=c.finish_reason)
                for p, o in enumerate(outs)
                for c in o.outputs
            ]
            return CompletionResponse(
                id=rid, model=self.served_model_name, choices=choices, usage=usage(outs)
            ).model_dump()

        async def events() -> AsyncIterator[str]:
            deltas = Deltas(params.stop)
            latest = list(firsts)
            async for p, out in chain(firsts, rest):
                latest[p] = out
                for c in out.outputs:
                    k = p * n + c.index
                    text = deltas.take(k, c.text, c.finish_reason is not None)
                    reason = c.finish_reason if c.finish_reason is not None and deltas.finish(k) else None
                    if text or reason:
                        yield chunk([CompletionChoice(index=k, text=text, finish_reason=reason)])
            if req.include_usage:
                yield chunk([], usage(latest))

        return _framed(events(), rest)

    async def chat(self, req: ChatCompletionRequest, raw: Request) -> dict | AsyncIterator[str]:
        """``POST /v1/chat/completions``: a response dict, or an SSE chunk stream when ``stream``."""
        req.check_values()
        self._check_model(req.model)
        messages = [{"role": m.role, "content": m.text()} for m in req.messages or []]
        ids = render_chat(self.llm.tokenizer, messages)
        params = self._sampling_params(req, [len(ids)], None, "messages")
        firsts, rest, usage = await self._run("chat", [(None, ids)], params, "messages")
        rid = new_id("chatcmpl")

        def chunk(choices: list[ChatChunkChoice], u: Usage | None = None) -> str:
            body = ChatCompletionChunk(id=rid, model=self.served_model_name, choices=choices, usage=u).model_dump()
            for choice in body["choices"]:  # OpenAI omits unset delta fields
                choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
            return sse(body)

        if not req.stream:
            (out,) = await self._collect(raw, firsts, rest)
            choices = [
                ChatChoice(index=c.index, message=ChatMessageOut(content=c.text), finish_reason=c.finish_reason)
                for c in out.outputs
            ]
            return ChatCompletionResponse(
                id=rid, model=self.served_model_name, choices=choices, usage=usage([out])
            ).model_dump()

        async def events() -> AsyncIterator[str]:
            deltas = Deltas(params.stop)
            latest = firsts[0]
            for i in range(params.n):
                yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
            async for _, out in chain(firsts, rest):
                latest = out
                for c in out.outputs:
                    text = deltas.take(c.index, c.text, c.finish_reason is not None)
                    if text:
                        yield chunk([ChatChunkChoice(index=c.index, delta=DeltaMessage(content=text))])
                    if c.finish_reason is not None and deltas.finish(c.index):
                        yield chunk(
                            [ChatChunkChoice(index=c.index, delta=DeltaMessage(), finish_reason=c.finish_reason)]
                        )
            if req.include_usage:
                yield chunk([], usage([latest]))

        return _framed(events(), rest)


async def _framed(events: AsyncIterator[str], rest) -> AsyncIterator[str]:
    """An SSE response body: ``events``, then ``data: [DONE]``. An error after the headers were
    sent is reported in-band as an OpenAI error event; the engine streams in ``rest`` are closed
    in every case (closing aborts unfinished requests, so a disconnect frees their KV slots)."""
    try:
        async for e in events:
            yield e
    except Exception as exc:  # noqa: BLE001 - headers are sent; report in-band
        yield sse(APIError(str(exc), type="server_error", code="internal_error").to_dict())
    finally:
        await rest.aclose()
    yield "data: [DONE]\n\n"
