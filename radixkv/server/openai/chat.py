"""``POST /v1/chat/completions``: a conversation, rendered with the model's chat template, to
``n`` assistant messages."""

from __future__ import annotations

from typing import AsyncIterator

from starlette.requests import Request

from radixkv.chat_template import encode_chat
from radixkv.errors import RequestError
from radixkv.server.engine_client import EngineClient, request_error_to_api
from radixkv.server.openai.params import ModelNames, sampling_params
from radixkv.server.openai.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessageOut,
    DeltaMessage,
    new_id,
    server_error_event,
)
from radixkv.server.sse import Deltas, chain, framed, sse

__all__ = ["Chat"]


class Chat:
    """The handler of ``/v1/chat/completions``."""

    def __init__(self, client: EngineClient, models: ModelNames) -> None:
        self.client = client
        self.models = models

    async def __call__(self, req: ChatCompletionRequest, raw: Request) -> dict | AsyncIterator[str]:
        """A response dict, or an SSE chunk stream when ``stream``."""
        req.check_values()
        self.models.check(req.model)
        messages = [{"role": m.role, "content": m.text()} for m in req.messages or []]
        try:
            ids = encode_chat(self.client.tokenizer, messages)
        except RequestError as exc:
            raise request_error_to_api(exc, "messages") from exc
        params = sampling_params(req, [len(ids)], self.client.max_context_len, None, "messages")
        run = await self.client.start("chat", [(None, ids)], params, "messages")
        rid, model = new_id("chatcmpl"), self.models.served

        def chunk(choices: list[ChatChunkChoice], u=None) -> str:
            body = ChatCompletionChunk(id=rid, model=model, choices=choices, usage=u).model_dump()
            for choice in body["choices"]:  # OpenAI omits unset delta fields
                choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
            return sse(body)

        if not req.stream:
            (out,) = await self.client.collect(raw, run)
            choices = [
                ChatChoice(index=c.index, message=ChatMessageOut(content=c.text), finish_reason=c.finish_reason)
                for c in out.outputs
            ]
            return ChatCompletionResponse(id=rid, model=model, choices=choices, usage=run.usage([out])).model_dump()

        async def events() -> AsyncIterator[str]:
            deltas = Deltas(params.stop)
            latest = run.firsts[0]
            for i in range(params.n):
                yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
            async for _, out in chain(run.firsts, run.rest):
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
                yield chunk([], run.usage([latest]))

        return framed(events(), run.rest, server_error_event)
