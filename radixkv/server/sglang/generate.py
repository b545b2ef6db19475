"""``POST /generate``: SGLang's native generation endpoint, answered as SGLang answers it.

One prompt with ``n = 1`` gets one object, anything else (a batch, or ``n > 1``) a list ordered by
prompt, then sample (index ``prompt * n + sample``)::

    {"text": "...", "output_ids": [...],
     "meta_info": {"id": rid, "finish_reason": {"type": "stop", "matched": 2},
                   "prompt_tokens": 12, "completion_tokens": 7, "cached_tokens": 11,
                   "e2e_latency": 0.41,
                   # with return_logprob:
                   "input_token_logprobs": [[null, id, text], [logprob, id, text], ...],
                   "output_token_logprobs": [[logprob, id, text], ...],
                   "output_token_logprobs_length": 7,
                   # with top_logprobs_num = k > 0 (top-k [logprob, id, text] per position):
                   "input_top_logprobs": [null, [[...], ...], ...], "output_top_logprobs": [...]}}

``finish_reason`` is SGLang's: ``{"type": "stop", "matched": <token id or stop string>}``,
``{"type": "length", "length": <tokens generated>}``, ``{"type": "abort", "message": ...}``, and
``null`` while running. ``cached_tokens`` is the engine's ``num_cached_tokens``; with ``n > 1`` the
prompt is prefilled once, and every sample repeats that one request's ``prompt_tokens`` and
``cached_tokens``. Text is trimmed before a matched stop string or stop token unless
``no_stop_trim``.

Logprobs follow SGLang's shapes: ``input_token_logprobs`` covers the prompt positions from
``logprob_start_len`` (default: the last prompt token) to the end; its first entry's logprob is
``null`` (SGLang computes logprobs of the tokens after that position). The token text of each
entry is filled with ``return_text_in_logprobs``, else ``null``.

Streaming (``"stream": true``) sends server-sent events ``data: {...}`` with the same objects, the
text and ``output_ids`` cumulative (SGLang's default, non-incremental streaming), plus ``"index"``
when the answer is a list, then ``data: [DONE]``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

from starlette.requests import Request

from radixkv.outputs import CompletionOutput, RequestOutput
from radixkv.sampling_params import MAX_LOGPROBS
from radixkv.server.auth import engine_request_id, request_tenant
from radixkv.server.body import tokenize_off_loop
from radixkv.server.engine_client import EngineClient
from radixkv.server.openai.protocol import APIError, server_error_event
from radixkv.server.sglang.protocol import (
    ENGINE_RENAMES,
    GenerateRequest,
    OutputOptions,
    _engine_has,
    unsupported,
)
from radixkv.server.sse import chain, framed, sse

__all__ = ["Generate", "LogprobOptions"]


@dataclass(frozen=True)
class LogprobOptions:
    """What one prompt asked for with ``return_logprob``.

    Attributes:
        start: SGLang's ``logprob_start_len`` resolved (``-1`` / unset: the last prompt token).
        top: ``top_logprobs_num`` (0: no top-k lists).
        text: ``return_text_in_logprobs``.
    """

    start: int
    top: int
    text: bool


class Generate:
    """The handler of ``POST /generate``."""

    def __init__(self, client: EngineClient) -> None:
        self.client = client

    async def __call__(self, req: GenerateRequest, raw: Request) -> dict | list | AsyncIterator[str]:
        """The answer (an object or a list), or an SSE stream when ``stream``."""
        t0 = time.perf_counter()
        req.check_fields()
        tenant = request_tenant(raw)
        namespace = req.namespace(tenant.name if tenant is not None else None)
        prompts, batch, prompt_param = await tokenize_off_loop(raw, req.prompts, self.client.tokenizer)
        count = len(prompts)
        converted = self._converted(req, prompts, prompt_param)
        ns = {p.n for p, _ in converted}
        if len(ns) > 1:
            raise APIError("every prompt of a batch must ask for the same n", "sampling_params.n")
        n = ns.pop()
        lps = self._logprob_options(req, prompts)
        params = [self._with_logprobs(p, lp, len(ids)) for (p, _), lp, (_, ids) in zip(converted, lps, prompts)]
        opts = [o for _, o in converted]
        rids = req.request_ids(count, batch)
        listed = batch or n > 1
        run = await self._start(raw, prompts, params, prompt_param, rids, namespace, [o.zero_tokens for o in opts])

        def item(p: int, out: RequestOutput, c: CompletionOutput, text: str | None = None) -> dict:
            rid = rids[p] if n == 1 else f"{rids[p]}-{c.index}"
            body = self._item(out, c, opts[p], lps[p], rid, t0, bool(req.return_prompt_token_ids))
            if text is not None:
                body["text"] = text
            return body

        if not req.stream:
            outs = await self.client.collect(raw, run)
            items = [item(p, o, c) for p, o in enumerate(outs) for c in o.outputs]
            return items if listed else items[0]

        async def events() -> AsyncIterator[str]:
            emitted: dict[tuple[int, int], int] = {}
            async for p, out in chain(run.firsts, run.rest):
                for c in out.outputs:
                    key = (p, c.index)
                    done = c.finish_reason is not None
                    if key in emitted and emitted[key] < 0:
                        continue  # already sent its final state
                    ntok, last = len(c.token_ids), emitted.get(key)
                    # SGLang's pacing: the first token at once, then every stream_interval tokens
                    waits = ntok == 0 if last is None else ntok - last < opts[p].stream_interval
                    if not done and (opts[p].zero_tokens or waits):
                        continue
                    body = item(p, out, c)
                    if listed:
                        body["index"] = p * n + c.index
                    emitted[key] = -1 if done else ntok
                    yield sse(body)

        return framed(events(), run.rest, server_error_event, run.stream_failed)

    def _converted(self, req: GenerateRequest, prompts: list, prompt_param: str) -> list:
        """Each prompt's ``(SamplingParams, OutputOptions)``. With ``sampling_params`` a list, an
        entry's error names its index: ``sampling_params[1].temperature``.

        Raises:
            APIError: an entry out of range or a prompt beyond the context (400)."""
        sps = req.sampling_list(len(prompts))
        ctx = self.client.max_context_len
        listed = isinstance(req.sampling_params, list)
        field = "sampling_params."
        out = []
        for i, (sp, (_, ids)) in enumerate(zip(sps, prompts)):
            at = f"sampling_params[{i}]." if listed else field
            if not req.stream and sp.stream_interval not in (None, 1):
                # NOTE: as stream_options without stream on chat: the pacing of a stream that is not one
                raise APIError(f"{at}stream_interval needs stream: true", at + "stream_interval")
            try:
                out.append(sp.to_engine(len(ids), ctx, prompt_param))
            except APIError as exc:
                if not listed or not (exc.param or "").startswith(field):
                    raise
                raise APIError(exc.message.replace(field, at), at + exc.param[len(field) :], exc.status_code,
                               exc.type, exc.code) from None  # fmt: skip
        return out

    async def _start(
        self, raw: Request, prompts: list, params: list, prompt_param: str, rids: list, namespace: Any, hidden: list
    ):
        """``client.start`` under the engine ids of the client's ``rids`` (its tenant's own:
        :func:`~radixkv.server.auth.engine_request_id`); a duplicate of a running one is a 400
        naming ``rid`` and the client's id.

        Raises:
            APIError: the engine refused a request (400).
        """
        ids = [engine_request_id(raw, r) for r in rids]
        try:
            return await self.client.start(
                "generate", prompts, params, prompt_param, ENGINE_RENAMES, request_ids=ids, namespace=namespace,
                hidden_outputs=hidden,
            )  # fmt: skip
        except APIError as exc:
            if exc.param != "rid":
                raise
            for engine_id, rid in zip(ids, rids):
                if repr(engine_id) in exc.message:
                    raise APIError(f"rid {rid!r} is already running", "rid") from None
            raise

    # ------------------------------------------------------------------ logprobs

    def _logprob_options(self, req: GenerateRequest, prompts: list) -> list[LogprobOptions | None]:
        count = len(prompts)
        wants = req.per_prompt("return_logprob", count)
        starts = req.per_prompt("logprob_start_len", count)
        tops = req.per_prompt("top_logprobs_num", count)
        out: list[LogprobOptions | None] = []
        if req.return_text_in_logprobs and not any(wants):
            raise APIError("return_text_in_logprobs needs return_logprob: true", "return_text_in_logprobs")
        for want, start, top, (_, ids) in zip(wants, starts, tops, prompts):
            if not want:
                # NOTE: SGLang drops these without return_logprob; at their defaults they are what
                # clients send anyway (bench_serving: logprob_start_len -1), set they ask for logprobs.
                # One value for the batch is used by the prompts that want logprobs: refused only
                # when none does; a list's entry is that prompt's own
                for name, value, default in (("top_logprobs_num", top, 0), ("logprob_start_len", start, -1)):
                    listed = isinstance(getattr(req, name), list)
                    if value not in (None, default) and (listed or not any(wants)):
                        raise APIError(f"{name}={value} needs return_logprob: true (for that prompt)", name)
                out.append(None)
                continue
            if not _engine_has("logprobs"):
                raise unsupported("return_logprob", "return_logprob is not supported by this radixkv build")
            if start is None or start == -1:
                start = len(ids) - 1
            if start < 0 or start >= len(ids):
                raise APIError(
                    f"logprob_start_len must be -1 or in [0, {len(ids) - 1}] for a prompt of {len(ids)} tokens, "
                    f"got {start}",
                    "logprob_start_len",
                )
            top = 0 if top is None else top
            if not 0 <= top <= MAX_LOGPROBS:
                raise APIError(f"top_logprobs_num must be in [0, {MAX_LOGPROBS}], got {top}", "top_logprobs_num")
            out.append(LogprobOptions(start, top, bool(req.return_text_in_logprobs)))
        return out

    @staticmethod
    def _with_logprobs(params: Any, lp: LogprobOptions | None, prompt_len: int) -> Any:
        """``params`` asking the engine for what ``lp`` needs: logprobs of the generated tokens and,
        when the prompt has positions after ``start``, prompt logprobs from ``start + 1`` on (the
        entry at ``start`` itself has no logprob in SGLang's shape)."""
        if lp is None:
            return params
        extra: dict[str, Any] = {"logprobs": lp.top}
        if lp.start + 1 < prompt_len:
            extra.update(prompt_logprobs=lp.top, logprob_start_len=lp.start + 1)
        return params.clone(**extra)

    def _entry(self, tok: int, pos: dict | None, lp: LogprobOptions) -> list:
        """``[logprob, token id, text]`` of ``tok`` at a position (logprob None when unknown)."""
        e = pos.get(tok) if pos else None
        text = self._token_text(tok, e) if lp.text else None
        return [None if e is None else float(e.logprob), int(tok), text]

    def _top(self, pos: dict | None, lp: LogprobOptions) -> list | None:
        if not pos:
            return None
        ranked = sorted(((e.rank, t, e) for t, e in pos.items() if e.rank <= lp.top), key=lambda x: (x[0], x[1]))
        return [[float(e.logprob), int(t), self._token_text(t, e) if lp.text else None] for _, t, e in ranked[: lp.top]]

    def _token_text(self, tok: int, e: Any) -> str:
        text = getattr(e, "decoded_token", None) if e is not None else None
        return text if text is not None else self.client.tokenizer.decode([tok])

    def _logprobs(self, out: RequestOutput, c: CompletionOutput, lp: LogprobOptions, ntok: int) -> dict:
        ids = out.prompt_token_ids
        prompt_lps = getattr(out, "prompt_logprobs", None) or []
        positions = range(lp.start, len(ids))
        pos_of = [prompt_lps[i] if i > lp.start and i < len(prompt_lps) else None for i in positions]
        meta: dict[str, Any] = {
            "input_token_logprobs": [self._entry(ids[i], d, lp) for i, d in zip(positions, pos_of)],
        }
        out_lps = (c.logprobs or [])[:ntok]
        meta["output_token_logprobs"] = [self._entry(t, d, lp) for t, d in zip(c.token_ids[:ntok], out_lps)]
        meta["output_token_logprobs_length"] = len(meta["output_token_logprobs"])
        if lp.top > 0:
            meta["input_top_logprobs"] = [self._top(d, lp) for d in pos_of]
            meta["output_top_logprobs"] = [self._top(d, lp) for d in out_lps]
        return meta

    # ------------------------------------------------------------------ one answer

    def _item(
        self,
        out: RequestOutput,
        c: CompletionOutput,
        opts: OutputOptions,
        lp: LogprobOptions | None,
        rid: str,
        t0: float,
        prompt_ids: bool,
    ) -> dict:
        done = c.finish_reason is not None
        if opts.zero_tokens:
            text, ids = "", []
        else:
            text, ids = self._text(c, opts), list(c.token_ids)
        meta: dict[str, Any] = {
            "id": rid,
            "finish_reason": finish_reason(c, 0 if opts.zero_tokens else len(ids)),
            "prompt_tokens": len(out.prompt_token_ids),
            "completion_tokens": len(ids),
            "cached_tokens": int(out.num_cached_tokens or 0),
        }
        if done:
            meta["e2e_latency"] = time.perf_counter() - t0
        if lp is not None:
            meta.update(self._logprobs(out, c, lp, len(ids)))
        body: dict[str, Any] = {"text": text, "output_ids": ids, "meta_info": meta}
        if prompt_ids:
            body["prompt_token_ids"] = list(out.prompt_token_ids)
        return body

    def _text(self, c: CompletionOutput, opts: OutputOptions) -> str:
        """The sample's text as SGLang returns it: with ``no_stop_trim`` a stopped sample's text is
        all its tokens decoded, so nothing the engine cut is lost: a matched stop string with the
        rest of the token it ends in, a matched stop token's text (EOS, ``stop_token_ids``: left
        out by radixkv's engine, as vLLM does)."""
        if c.finish_reason != "stop" or not opts.no_stop_trim or not c.token_ids:
            return c.text
        return self.client.tokenizer.decode(c.token_ids, skip_special_tokens=opts.skip_special_tokens)


def finish_reason(c: CompletionOutput, ntok: int) -> dict | None:
    """SGLang's ``finish_reason`` object of a sample (None while it runs)."""
    if c.finish_reason is None:
        return None
    if c.finish_reason == "stop":
        # SGLang names the matched token also for EOS (radixkv's stop_reason is None there, as vLLM's)
        matched = c.stop_reason if c.stop_reason is not None or not c.token_ids else int(c.token_ids[-1])
        return {"type": "stop", "matched": matched}
    if c.finish_reason == "length":
        return {"type": "length", "length": ntok}
    return {"type": "abort", "message": "the request was aborted", "status_code": None, "err_type": None}
