"""``POST /v1/completions``: prompts (text, token ids, or lists of them) to completion choices,
with ``logprobs`` (0-5 alternatives per token), ``echo`` and structured-output constraints."""

from __future__ import annotations

from typing import AsyncIterator

from starlette.requests import Request

from radixkv.server.auth import request_namespace
from radixkv.server.body import tokenize_off_loop
from radixkv.server.engine_client import EngineClient
from radixkv.server.openai.logprobs import TokenText, completion_logprobs, prompt_logprobs_json
from radixkv.server.openai.params import ModelNames, constraint_of, constraint_renames, sampling_params
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
        self.token_text = TokenText(client.tokenizer)

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

    def _echo(self, text: str | None, ids: list[int]) -> str:
        return text if text is not None else self.client.tokenizer.decode(ids)

    def _logprobs(self, req: CompletionRequest, out, c, echo: str, start: int = 0, first: bool = True):
        """Completions logprobs of ``c``'s tokens from ``start`` (with ``echo``, the prompt's
        tokens first in the choice's ``first`` logprobs: a streamed choice's first chunk, which
        may come before its first token)."""
        k = req.num_top_logprobs()
        if k is None or c.logprobs is None:
            return None
        ids, entries, offset = list(c.token_ids[start:]), list(c.logprobs[start:]), len(echo)
        if req.echo and first and getattr(out, "prompt_logprobs", None) is not None:
            ids = list(out.prompt_token_ids) + ids
            entries = list(out.prompt_logprobs) + entries
            offset = 0
        return completion_logprobs(ids, entries, k, self.token_text, offset)

    async def __call__(self, req: CompletionRequest, raw: Request) -> dict | AsyncIterator[str]:
        """A response dict, or an SSE chunk stream when ``stream``."""
        req.check_values()
        self.models.check(req.model)
        prompts = await tokenize_off_loop(raw, self._prompts, req)
        # NOTE: echo with max_tokens 0 scores the prompt (vLLM's and legacy OpenAI's, e.g. lm-eval's
        # loglikelihood): one token is sampled and dropped, as SGLang's max_new_tokens 0
        zero = bool(req.echo) and req.max_tokens == 0
        params = sampling_params(
            req.model_copy(update={"max_tokens": 1}) if zero else req,
            [len(ids) for _, ids in prompts],
            self.client.max_context_len,
            DEFAULT_MAX_TOKENS,
            "prompt",
        )
        renames = constraint_renames(constraint_of(req)[0])
        ns = request_namespace(raw, req.cache_salt)
        run = await self.client.start(
            "completions", prompts, params, "prompt", renames, namespace=ns, routing_key=req.routing_key(),
            hidden_outputs=[zero] * len(prompts),
        )  # fmt: skip
        rid, n, model = new_id("cmpl"), params.n, self.models.served
        echoes = [self._echo(text, ids) if req.echo else "" for text, ids in prompts]

        def usage(outs: list):
            u = run.usage(outs)
            return u.model_copy(update={"completion_tokens": 0, "total_tokens": u.prompt_tokens}) if zero else u

        def chunk(choices: list[CompletionChoice], u=None, extra: dict | None = None) -> str:
            return sse(
                {**CompletionResponse(id=rid, model=model, choices=choices, usage=u).model_dump(), **(extra or {})}
            )

        if not req.stream:
            outs = await self.client.collect(raw, run)
            choices = self._choices(req, outs, echoes, n, zero)
            body = CompletionResponse(id=rid, model=model, choices=choices, usage=usage(outs)).model_dump()
            if req.return_cached_tokens_details:
                body["sglext"] = _sglext(outs)
            return body

        async def events() -> AsyncIterator[str]:
            deltas = Deltas()
            latest = list(run.firsts)
            tokens_sent: dict[int, int] = {}
            offsets: dict[int, int] = {}
            async for p, out in chain(run.firsts, run.rest):
                latest[p] = out
                for c in out.outputs:
                    k = p * n + c.index
                    first = k not in tokens_sent
                    text = "" if zero else deltas.take(k, c.text)
                    if first:
                        text = echoes[p] + text
                    lps = None
                    start = len(c.token_ids) if zero else tokens_sent.get(k, 0)
                    if len(c.token_ids) > start or first:
                        lps = self._logprobs(req, out, c, echoes[p] if first else "", start, first)
                        if lps is not None and not first:
                            lps.text_offset = [x + offsets.get(k, 0) for x in lps.text_offset]
                        if lps is not None:
                            offsets[k] = (
                                (lps.text_offset[-1] + len(lps.tokens[-1])) if lps.tokens else offsets.get(k, 0)
                            )
                        tokens_sent[k] = len(c.token_ids)
                    reason = c.finish_reason if c.finish_reason is not None and (zero or deltas.finish(k)) else None
                    reason = "length" if zero and reason else reason
                    if text or reason or (lps is not None and lps.tokens):
                        extra = None
                        if reason and req.return_cached_tokens_details and c.index == 0:
                            extra = {"sglext": _sglext([out])}
                        yield chunk(
                            [CompletionChoice(index=k, text=text, logprobs=lps, finish_reason=reason)], None, extra
                        )
            if req.include_usage:
                yield chunk([], usage(latest))

        return framed(events(), run.rest, server_error_event, run.stream_failed)

    def _choices(self, req: CompletionRequest, outs: list, echoes: list[str], n: int, zero: bool) -> list:
        """The choices of a non-streamed answer (``zero``: echo with ``max_tokens`` 0, the
        prompt alone: its text, its logprobs, finish ``"length"``)."""
        choices = []
        for p, o in enumerate(outs):
            plp = None
            if req.prompt_logprobs is not None:
                plp = prompt_logprobs_json(
                    getattr(o, "prompt_logprobs", None), self.token_text, req.prompt_logprobs, o.prompt_token_ids
                )
            for c in o.outputs:
                choices.append(
                    CompletionChoice(
                        index=p * n + c.index,
                        text=echoes[p] + ("" if zero else c.text),
                        logprobs=self._logprobs(req, o, c, echoes[p], len(c.token_ids) if zero else 0),
                        finish_reason="length" if zero else c.finish_reason,
                        prompt_logprobs=plp,
                    )
                )
        return choices


def _sglext(outs: list) -> dict:
    """SGLang's ``sglext`` of a completion: the prompts' cached tokens by tier, in SGLang's two
    keys: ``device`` (the KV pool) and ``host`` (every KV tier below it: host RAM, disk and the
    remote tier, docs/tiers.md; ``RequestOutput.cached_tokens_by_tier`` has them apart)."""
    device = host = 0
    for o in outs:
        by = getattr(o, "cached_tokens_by_tier", None) or {"device": int(o.num_cached_tokens or 0)}
        device += int(by.get("device", 0))
        host += sum(int(n) for m, n in by.items() if m != "device")
    return {"cached_tokens_details": {"device": device, "host": host}}
