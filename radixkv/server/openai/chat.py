"""``POST /v1/chat/completions``: a conversation (with its tools), rendered with the model's chat
template, to ``n`` assistant messages: text, tool calls (parsed from the built-in
``<tool_call>`` format; forced by a grammar for ``tool_choice`` ``required`` or named; a forced
call cut by ``max_tokens`` is still a call, finish reason ``length``, with the argument text
generated so far), structured output, logprobs."""

from __future__ import annotations

from typing import AsyncIterator, Optional

from starlette.requests import Request

from radixkv.chat_template import encode_chat, request_template_options
from radixkv.errors import RequestError
from radixkv.server.auth import request_namespace
from radixkv.server.body import tokenize_off_loop
from radixkv.server.engine_client import EngineClient, request_error_to_api
from radixkv.server.openai.logprobs import TokenText, chat_logprobs, prompt_logprobs_json
from radixkv.server.openai.params import (
    ModelNames,
    ToolPlan,
    constraint_of,
    constraint_renames,
    sampling_params,
    tool_plan,
)
from radixkv.server.openai.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessageOut,
    DeltaFunction,
    DeltaMessage,
    DeltaToolCall,
    FunctionCallOut,
    ToolCallOut,
    new_id,
    server_error_event,
)
from radixkv.server.parsers.tool_calls import ToolCallStream, parse_tool_calls
from radixkv.server.sse import Deltas, chain, framed, sse

__all__ = ["Chat"]


def finish_reason(
    engine_reason: Optional[str], num_calls: int, cut_off: bool = False, named: bool = False
) -> Optional[str]:
    """OpenAI's finish reason: ``tool_calls`` when the output ended naturally with calls (not
    when a stop string or stop token cut its last call off: that is ``stop``), except for a
    named ``tool_choice`` (``named``): OpenAI, and vLLM after it, answer ``stop`` for the one
    function the request forced."""
    return "tool_calls" if engine_reason == "stop" and num_calls and not cut_off and not named else engine_reason


class Chat:
    """The handler of ``/v1/chat/completions``."""

    def __init__(self, client: EngineClient, models: ModelNames) -> None:
        self.client = client
        self.models = models
        self.token_text = TokenText(client.tokenizer)

    def _message(self, text: str, plan: ToolPlan, reason: Optional[str]) -> tuple[ChatMessageOut, Optional[str]]:
        """The message of an output and its OpenAI finish reason."""
        if not plan.parse:
            return ChatMessageOut(content=text), reason
        content, calls = parse_tool_calls(text, plan.cut, plan.forced, plan.max_calls)
        out = [ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments)) for c in calls]
        cut_off = bool(calls) and not calls[-1].complete
        named = plan.choice == "named"
        return ChatMessageOut(content=content, tool_calls=out or None), finish_reason(
            reason, len(calls), cut_off, named
        )

    async def __call__(self, req: ChatCompletionRequest, raw: Request) -> dict | AsyncIterator[str]:
        """A response dict, or an SSE chunk stream when ``stream``."""
        req.check_values()
        self.models.check(req.model)
        plan = tool_plan(req)
        messages = [m.to_template() for m in req.messages or []]
        try:
            opts = request_template_options(
                req.add_generation_prompt, req.continue_final_message, req.chat_template_kwargs
            )
            ids = await tokenize_off_loop(
                raw, encode_chat, self.client.tokenizer, messages, tools=plan.tools or None, **opts
            )
        except RequestError as exc:
            raise request_error_to_api(exc, "messages") from exc
        params = sampling_params(req, [len(ids)], self.client.max_context_len, None, "messages", plan)
        renames = constraint_renames(constraint_of(req, plan)[0])
        ns = request_namespace(raw, req.cache_salt)
        run = await self.client.start(
            "chat", [(None, ids)], params, "messages", renames, namespace=ns, routing_key=req.routing_key()
        )
        rid, model = new_id("chatcmpl"), self.models.served
        top = req.num_top_logprobs()

        if not req.stream:
            (out,) = await self.client.collect(raw, run)
            choices = []
            for c in out.outputs:
                message, reason = self._message(c.text, plan, c.finish_reason)
                lps = None
                if top is not None and c.logprobs is not None:
                    lps = chat_logprobs(c.token_ids, c.logprobs, top, self.token_text)
                choices.append(ChatChoice(index=c.index, message=message, logprobs=lps, finish_reason=reason))
            body = ChatCompletionResponse(id=rid, model=model, choices=choices, usage=run.usage([out]))
            if req.prompt_logprobs is not None:
                body.prompt_logprobs = prompt_logprobs_json(getattr(out, "prompt_logprobs", None), self.token_text)
            return body.model_dump(exclude_none=False)

        def chunk(choices: list[ChatChunkChoice], u=None) -> str:
            body = ChatCompletionChunk(id=rid, model=model, choices=choices, usage=u).model_dump()
            for choice in body["choices"]:  # OpenAI omits unset delta fields
                choice["delta"] = _drop_none(choice["delta"])
            return sse(body)

        async def events() -> AsyncIterator[str]:
            deltas = Deltas()
            parsers = {i: ToolCallStream() for i in range(params.n)} if plan.parse else {}
            tokens_sent = {i: 0 for i in range(params.n)}
            latest = run.firsts[0]
            # With tools parsed the first delta carries no content (OpenAI's `content: null` before a call): an
            # output of calls alone accumulates to `content` None, as the non-streamed message has it; one with
            # neither text nor calls gets its `content: ""` on the finish chunk.
            first = None if plan.parse else ""
            for i in range(params.n):
                yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=first))])
            async for _, out in chain(run.firsts, run.rest):
                latest = out
                for c in out.outputs:
                    done = c.finish_reason is not None
                    lps = None
                    if top is not None and c.logprobs is not None and len(c.token_ids) > tokens_sent[c.index]:
                        k = tokens_sent[c.index]
                        lps = chat_logprobs(c.token_ids[k:], c.logprobs[k:], top, self.token_text)
                        tokens_sent[c.index] = len(c.token_ids)
                    if plan.parse:
                        sent = _tool_deltas(
                            parsers[c.index].update(c.text, done, plan.cut, plan.forced, plan.max_calls)
                        )
                    else:
                        text = deltas.take(c.index, c.text)
                        sent = [DeltaMessage(content=text)] if text else []
                    if lps is not None and not sent:
                        sent = [DeltaMessage()]
                    for j, delta in enumerate(sent):
                        yield chunk([ChatChunkChoice(index=c.index, delta=delta, logprobs=lps if j == 0 else None)])
                    if done and deltas.finish(c.index):
                        p = parsers.get(c.index)
                        reason = finish_reason(
                            c.finish_reason, p.num_calls if p else 0, bool(p and p.cut_off), plan.choice == "named"
                        )
                        empty = p is not None and not p.content and not p.num_calls
                        last = DeltaMessage(content="" if empty else None)
                        yield chunk([ChatChunkChoice(index=c.index, delta=last, finish_reason=reason)])
            if req.include_usage:
                yield chunk([], run.usage([latest]))

        return framed(events(), run.rest, server_error_event, run.stream_failed)


def _drop_none(obj):
    if isinstance(obj, dict):
        return {k: _drop_none(v) for k, v in obj.items() if v is not None}
    if isinstance(obj, list):
        return [_drop_none(v) for v in obj]
    return obj


def _tool_deltas(events: list[tuple]) -> list[DeltaMessage]:
    """OpenAI deltas for :class:`ToolCallStream` events (one per event)."""
    out = []
    for ev in events:
        if ev[0] == "content":
            out.append(DeltaMessage(content=ev[1]))
        elif ev[0] == "call":
            _, index, call_id, name = ev
            fn = DeltaFunction(name=name, arguments="")
            out.append(DeltaMessage(tool_calls=[DeltaToolCall(index=index, id=call_id, type="function", function=fn)]))
        else:
            _, index, args = ev
            out.append(DeltaMessage(tool_calls=[DeltaToolCall(index=index, function=DeltaFunction(arguments=args))]))
    return out
