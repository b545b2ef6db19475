"""``POST /v1/completions``: prompts (text, token ids, or lists of them) to completion choices."""

from __future__ import annotations

from typing import AsyncIterator

from starlette.requests import Request

from radixkv.server.engine_client import EngineClient
from radixkv.server.openai.params import ModelNames, sampling_params
from radixkv.server.openai.protocol import (
    APIError,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    new_id,
    server_error_event,
)
from radixkv.server.sse import Deltas, chain, framed, sse

__all__ = ["Completions", "DEFAULT_MAX_TOKENS"]

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class Completions:
    """The handler of ``/v1/completions`` (each prompt gets ``n`` choices, index
    ``prompt_idx * n + i``)."""

    def __init__(self, client: EngineClient, models: ModelNames) -> None:
        self.client = client
        self.models = models

    def _prompts(self, req: CompletionRequest) -> list[tuple[str | None, list[int]]]:
        p = req.prompt
        if p is None or (isinstance(p, (str, list)) and len(p) == 0):
            raise APIError("prompt must be a non-empty string, token list, or list of those", "prompt")
        items: list = [p] if isinstance(p, str) or isinstance(p[0], int) else list(p)
        prompts: list[tuple[str | None, list[int]]] = []
        tok = self.client.tokenizer
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

    async def __call__(self, req: CompletionRequest, raw: Request) -> dict | AsyncIterator[str]:
        """A response dict, or an SSE chunk stream when ``stream``."""
        req.check_values()
        self.models.check(req.model)
        prompts = self._prompts(req)
        params = sampling_params(
            req, [len(ids) for _, ids in prompts], self.client.max_context_len, DEFAULT_MAX_TOKENS, "prompt"
        )
        run = await self.client.start("completions", prompts, params, "prompt")
        rid, n, model = new_id("cmpl"), params.n, self.models.served

        def chunk(choices: list[CompletionChoice], u=None) -> str:
            return sse(CompletionResponse(id=rid, model=model, choices=choices, usage=u).model_dump())

        if not req.stream:
            outs = await self.client.collect(raw, run)
            choices = [
                CompletionChoice(index=p * n + c.index, text=c.text, finish_reason=c.finish_reason)
                for p, o in enumerate(outs)
                for c in o.outputs
            ]
            return CompletionResponse(id=rid, model=model, choices=choices, usage=run.usage(outs)).model_dump()

        async def events() -> AsyncIterator[str]:
            deltas = Deltas(params.stop)
            latest = list(run.firsts)
            async for p, out in chain(run.firsts, run.rest):
                latest[p] = out
                for c in out.outputs:
                    k = p * n + c.index
                    text = deltas.take(k, c.text, c.finish_reason is not None)
                    reason = c.finish_reason if c.finish_reason is not None and deltas.finish(k) else None
                    if text or reason:
                        yield chunk([CompletionChoice(index=k, text=text, finish_reason=reason)])
            if req.include_usage:
                yield chunk([], run.usage(latest))

        return framed(events(), run.rest, server_error_event)
