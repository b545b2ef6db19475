"""``/v1/responses``: OpenAI's Responses API over the chat machinery, with stored responses whose
KV stays pinned, so ``previous_response_id`` computes only the new input.

* ``POST /v1/responses`` (:class:`Responses`): ``input`` (+ ``instructions``) rendered with the
  chat template as ``/v1/chat/completions`` renders messages; tools, ``tool_choice`` and
  ``text.format`` through the same tool plan and constraint (:mod:`.params`). The output is a
  ``message`` item (one ``output_text`` part) and/or ``function_call`` items. ``stream`` sends
  OpenAI's event stream: ``response.created``, ``response.in_progress``, per item
  ``response.output_item.added``, for a message ``response.content_part.added``,
  ``response.output_text.delta`` ... ``.done``, ``response.content_part.done``, for a call
  ``response.function_call_arguments.delta`` ... ``.done``, then ``response.output_item.done``,
  and ``response.completed`` (``response.incomplete`` when ``max_output_tokens`` cut it, status
  ``incomplete``, or when it was aborted, status ``cancelled``: OpenAI has no cancelled event)
  carrying the same Response a non-streamed request returns. A forced call (``tool_choice`` required or
  named) cut by ``max_output_tokens`` is still a ``function_call`` item, status ``incomplete``,
  with the argument text generated so far.
* ``store`` (default true, as OpenAI's) keeps the Response in the :class:`ResponseStore`:
  ``GET /v1/responses/{id}`` returns it, ``GET /v1/responses/{id}/input_items`` lists the items
  it was generated from (:mod:`.response_items`), ``DELETE`` removes it (and its pin). A
  cancelled (aborted) Response is never stored: its reply was cut, and a follow-up must not
  build on it unawares (its id is not found, as an unknown one).
* ``previous_response_id``: the stored conversation (its input and output; not its
  ``instructions``, as in OpenAI) continues with the new ``input``. When the instructions and
  tools are the same, the prompt is the stored context token for token (the previous prompt +
  the model's own output tokens) + the template's text for the new items
  (:func:`radixkv.branching.continue_chat`, as sessions continue), and that context's KV was
  pinned when the previous response finished (:meth:`Engine.pin_prefix
  <radixkv.engine.engine.Engine.pin_prefix>`, one soft pin per stored response, in the KV
  manager with every other pin): the follow-up's ``usage.input_tokens_details.cached_tokens`` is
  the whole stored context. Otherwise the conversation is rendered afresh (the prefix cache
  still serves what matches). A stored response remembers its prefix-cache namespace
  (``Responses.create``'s ``namespace``: its API key's tenant and its ``cache_salt``,
  :func:`radixkv.server.auth.request_namespace`): its pin is taken in it. It belongs to its
  tenant: another tenant's ``GET`` / ``DELETE`` is a 404 and its ``previous_response_id`` is not
  found, exactly as for an id that never existed; the same tenant may continue it under
  another salt (the follow-up runs in its own namespace, so it reuses no KV of the other
  salt). Across replicas
  (``radixkv serve --replicas``) no pin is taken (the backend's
  :data:`~radixkv.server.backend.NO_PINS`): the follow-up, the same tokens, is routed to the
  replica that caches them.

Bounds, per tenant (one tenant's responses never push out another's; without API keys there is
one): at most ``max_pinned`` stored responses hold a pin (LRU: the least recently used loses its
pin, its text stays retrievable); the KV manager's own bounds (``max_pinned_tokens``,
``pin_idle_timeout``) apply to these pins as to sessions'. At most ``max_stored`` responses, and
at most ``max_stored_bytes`` of them (their JSON size, plus the context token ids), are kept at all
(the least recently used go first; the newest is always kept).
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Mapping, Optional

from starlette.requests import Request

from radixkv.branching import continue_chat, reply_stop_text
from radixkv.chat_template import encode_chat
from radixkv.errors import RequestError
from radixkv.namespace import Namespace
from radixkv.server.backend import Pins
from radixkv.server.body import tokenize_off_loop
from radixkv.server.engine_client import EngineClient, request_error_to_api
from radixkv.server.openai.params import ModelNames, constraint_of, constraint_renames, sampling_params, tool_plan
from radixkv.server.openai.protocol import APIError, server_error_event
from radixkv.server.openai.response_items import input_items, page
from radixkv.server.openai.responses_protocol import ResponsesRequest, chat_param, input_messages, remap_error
from radixkv.server.parsers.tool_calls import ToolCallStream, parse_tool_calls
from radixkv.server.sse import chain, framed

__all__ = ["Responses", "ResponseStore", "StoredResponse"]

_ANY = object()  # ResponseStore lookups for any tenant (the server's own, e.g. a follow-up's finish hook)


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class StoredResponse:
    """One stored Response.

    Attributes:
        body: the Response object as returned.
        messages: the conversation after it (chat messages, without ``instructions``).
        instructions: its ``instructions``.
        tools: the tools rendered into its prompt (chat form).
        tokens: its context token ids: the prompt + the output tokens.
        stop_text: the end-of-turn token's text its output stopped on ("" otherwise).
        pin: the KV manager's pin on the cached prefix of ``tokens`` (None: unpinned).
        namespace: the prefix-cache namespace it ran in (None: the shared default): its pin is
            taken in it; its ``tenant`` owns the response.
        input_items: the items it was generated from, oldest first
            (:func:`~radixkv.server.openai.response_items.input_items`).
        nbytes: the memory it is counted for in the store's byte bound (set when stored:
            :func:`stored_size`).
    """

    body: dict
    messages: list[dict]
    instructions: Optional[str]
    tools: list[dict]
    tokens: list[int] = field(default_factory=list)
    stop_text: str = ""
    pin: Any = None
    namespace: Optional[Namespace] = None
    input_items: list[dict] = field(default_factory=list)
    nbytes: int = 0

    @property
    def tenant(self) -> Optional[str]:
        """The tenant that owns it (its namespace's; None without API keys)."""
        return self.namespace.tenant if self.namespace is not None else None


class ResponseStore:
    """Stored Responses by id, LRU ordered (a lookup or a follow-up refreshes one).

    Pins are taken, touched and released through the backend's
    :class:`~radixkv.server.backend.Pins` in finish hooks (where the engine lives); a deleted
    response's pin is taken out here and released through
    :meth:`EngineBackend.release_pin <radixkv.server.backend.EngineBackend.release_pin>`. The
    store's lock orders them against the event loop's reads.

    Args:
        max_stored: responses kept at most per tenant (its least recently used are deleted, their
            pins released).
        max_pinned: stored responses of a tenant holding a pin at most (its least recently used
            lose theirs).
        max_stored_bytes: bytes of stored responses kept at most per tenant (:func:`stored_size`;
            its least recently used are deleted, the newest always kept).
    """

    def __init__(self, max_stored: int = 10000, max_pinned: int = 64, max_stored_bytes: int = 256 << 20) -> None:
        self.max_stored = max_stored
        self.max_pinned = max_pinned
        self.max_stored_bytes = max_stored_bytes
        self._bytes: dict[Optional[str], int] = {}  # per tenant: the nbytes of its stored responses
        self._items: dict[str, StoredResponse] = {}
        # NOTE: the bounds are per tenant, so one tenant's flood never deletes or unpins another
        # tenant's responses (without API keys there is one tenant, None). Each tenant has its own
        # LRU order of all its responses and of those holding a pin, so a put costs O(1), not a
        # scan of every stored response on the engine thread.
        self._lru: dict[Optional[str], OrderedDict[str, StoredResponse]] = {}
        self._pinned: dict[Optional[str], OrderedDict[str, StoredResponse]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, rid: str, tenant: Any = _ANY) -> Optional[StoredResponse]:
        """The stored Response ``rid`` (refreshed in the LRU order); with ``tenant``, only when
        that tenant owns it (another tenant's lookup changes nothing)."""
        with self._lock:
            item = self._items.get(rid)
            if item is None or (tenant is not _ANY and item.tenant != tenant):
                return None
            self._lru[item.tenant].move_to_end(rid)
            pinned = self._pinned.get(item.tenant)
            if pinned is not None and rid in pinned:
                pinned.move_to_end(rid)
            return item

    def put(self, rid: str, item: StoredResponse, pins: Pins) -> None:
        """Store ``item`` (in a finish hook: it may release other responses' pins): the tenant's
        least recently used beyond ``max_stored`` are deleted, and beyond ``max_pinned`` pinned
        ones lose their pins."""
        item.nbytes = item.nbytes or stored_size(item)
        with self._lock:
            self._drop(rid)
            self._items[rid] = item
            lru = self._lru.setdefault(item.tenant, OrderedDict())
            lru[rid] = item
            pinned = self._pinned.setdefault(item.tenant, OrderedDict())
            if item.pin is not None:
                pinned[rid] = item
            self._bytes[item.tenant] = self._bytes.get(item.tenant, 0) + item.nbytes
            while len(lru) > self.max_stored or (len(lru) > 1 and self._bytes[item.tenant] > self.max_stored_bytes):
                k, old = lru.popitem(last=False)
                del self._items[k]
                pinned.pop(k, None)
                self._bytes[item.tenant] -= old.nbytes
                self._unpin(pins, old)
            while len(pinned) > self.max_pinned:
                self._unpin(pins, pinned.popitem(last=False)[1])

    def pop(self, rid: str, tenant: Any = _ANY) -> Optional[StoredResponse]:
        """Remove ``rid`` from the store (with ``tenant``: only when that tenant owns it); its pin,
        if any, is the caller's to release (:meth:`take_pin`)."""
        with self._lock:
            item = self._items.get(rid)
            if item is None or (tenant is not _ANY and item.tenant != tenant):
                return None
            return self._drop(rid)

    def _drop(self, rid: str) -> Optional[StoredResponse]:
        """Remove ``rid`` from the lookup and its tenant's orders (the lock held)."""
        item = self._items.pop(rid, None)
        if item is not None:
            self._bytes[item.tenant] -= item.nbytes
            if not self._bytes[item.tenant]:
                del self._bytes[item.tenant]
            for orders in (self._lru, self._pinned):
                order = orders.get(item.tenant)
                if order is not None:
                    order.pop(rid, None)
                    if not order:
                        del orders[item.tenant]
        return item

    def take_pin(self, item: StoredResponse) -> Any:
        """``item``'s pin, which it holds no more (None: it had none)."""
        with self._lock:
            pin, item.pin = item.pin, None
            return pin

    def touch(self, item: StoredResponse, pins: Pins) -> None:
        """A follow-up uses ``item``'s pin now (in its finish hook)."""
        pin = item.pin
        if pin is not None:
            pins.touch_pin(pin)

    @staticmethod
    def _unpin(pins: Pins, item: StoredResponse) -> None:
        pin, item.pin = item.pin, None
        if pin is not None:
            pins.release_pin(pin)

    def pinned_tokens(self, rid: str) -> int:
        """Tokens the pin of ``rid`` holds now (0: unpinned, dropped or unknown)."""
        item = self._items.get(rid)
        pin = item.pin if item is not None else None
        return len(pin) if pin is not None and pin.live else 0


def stored_size(item: StoredResponse) -> int:
    """The bytes ``item`` is counted for in the store's byte bound: the JSON of its body,
    conversation, input items, tools and instructions, plus 36 bytes a context token id (a Python
    int and its list slot). An estimate of what it holds in memory, not an exact figure."""
    parts = [item.body, item.messages, item.input_items, item.tools, item.instructions]
    return len(json.dumps(parts, default=str)) + 36 * len(item.tokens)


def _status(finish_reason: Optional[str]) -> str:
    """The Response status of an engine finish reason: ``incomplete`` when ``max_output_tokens``
    cut it, ``cancelled`` when it was aborted (``/abort_request``, or the engine ended it: vLLM's
    Responses server answers ``cancelled`` for an aborted request too), else ``completed``."""
    return {"length": "incomplete", "abort": "cancelled"}.get(finish_reason or "", "completed")


class _EventWriter:
    """The Responses event stream of one response, as SSE events (numbered in order): the output
    items opened, streamed and closed one after the other.

    Args:
        msg_id: the id of the response's message item.
    """

    def __init__(self, msg_id: str) -> None:
        self.msg_id = msg_id
        self.seq = 0
        self.index = -1  # output index of the item open (or last closed)
        self.open_kind: Optional[str] = None  # "message" or "call"
        self.text = ""  # the message text streamed
        self.call_args = ""  # the open call's argument text streamed
        self.call_item: dict = {}
        self.called = False  # text after a call is not streamed (the Response holds one message, first)

    def ev(self, kind: str, **fields: Any) -> str:
        """One event ``kind`` with its ``sequence_number``."""
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def _part(self) -> dict:
        return {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}

    def close_open(self, status: str = "completed") -> list[str]:
        """The events that end the open item (none when no item is open)."""
        out, at = [], dict(output_index=self.index)
        if self.open_kind == "message":
            part, ids = self._part(), dict(item_id=self.msg_id, output_index=self.index, content_index=0)
            out.append(self.ev("response.output_text.done", **ids, text=self.text, logprobs=[]))
            out.append(self.ev("response.content_part.done", **ids, part=part))
            item = {"id": self.msg_id, "type": "message", "role": "assistant", "status": status, "content": [part]}
            out.append(self.ev("response.output_item.done", **at, item=item))
        elif self.open_kind == "call":
            c = self.call_item
            out.append(
                self.ev(
                    "response.function_call_arguments.done",
                    item_id=c["id"],
                    **at,
                    name=c["name"],
                    arguments=self.call_args,
                )
            )
            out.append(
                self.ev("response.output_item.done", **at, item=dict(c, arguments=self.call_args, status=status))
            )
        self.open_kind = None
        return out

    def content(self, delta: str) -> list[str]:
        """Message text ``delta`` (opening the message item first)."""
        if not delta or self.called:
            return []
        out = []
        if self.open_kind != "message":
            out += self.close_open()
            self.index += 1
            self.open_kind, self.text = "message", ""
            item = {"id": self.msg_id, "type": "message", "role": "assistant", "status": "in_progress", "content": []}
            out.append(self.ev("response.output_item.added", output_index=self.index, item=item))
            ids = dict(item_id=self.msg_id, output_index=self.index, content_index=0)
            out.append(self.ev("response.content_part.added", **ids, part=self._part()))
        self.text += delta
        ids = dict(item_id=self.msg_id, output_index=self.index, content_index=0)
        out.append(self.ev("response.output_text.delta", **ids, delta=delta, logprobs=[]))
        return out

    def call(self, call_id: str, name: str) -> list[str]:
        """A function call starts (the open item ends first)."""
        out = self.close_open()
        self.called = True
        self.index += 1
        self.open_kind, self.call_args = "call", ""
        self.call_item = {
            "id": "fc_" + call_id.removeprefix("call_"),
            "type": "function_call",
            "call_id": call_id,
            "name": name,
            "arguments": "",
            "status": "in_progress",
        }
        return out + [self.ev("response.output_item.added", output_index=self.index, item=self.call_item)]

    def args(self, delta: str) -> list[str]:
        """More argument text of the open call."""
        self.call_args += delta
        ids = dict(item_id=self.call_item["id"], output_index=self.index)
        return [self.ev("response.function_call_arguments.delta", **ids, delta=delta)]

    def output(self, c: Any, parser: Optional[ToolCallStream], plan: Any) -> list[str]:
        """The events for the latest snapshot ``c`` (a ``CompletionOutput``) of the reply."""
        if parser is None:
            return self.content(c.text[len(self.text) :])
        out = []
        for e in parser.update(c.text, c.finish_reason is not None, plan.cut, plan.forced, plan.max_calls):
            if e[0] == "content":
                out += self.content(e[1])
            elif e[0] == "call":
                out += self.call(e[2], e[3])
            else:
                out += self.args(e[2])
        return out

    def finish(self, final: dict) -> list[str]:
        """The closing events: the open item's end (or, when nothing was streamed, the empty
        message item whole), then ``response.completed`` / ``response.incomplete``."""
        out = []
        if self.index < 0 and final["output"]:  # nothing was streamed (an empty reply): its item still comes
            item = dict(final["output"][0])
            part, ids = item["content"][0], dict(item_id=self.msg_id, output_index=0, content_index=0)
            out.append(
                self.ev("response.output_item.added", output_index=0, item=dict(item, status="in_progress", content=[]))
            )
            out.append(self.ev("response.content_part.added", **ids, part=part))
            out.append(self.ev("response.output_text.done", **ids, text="", logprobs=[]))
            out.append(self.ev("response.content_part.done", **ids, part=part))
            out.append(self.ev("response.output_item.done", output_index=0, item=item))
        else:
            out += self.close_open(final["output"][min(self.index, len(final["output"]) - 1)]["status"])
        # NOTE: OpenAI defines no response.cancelled event: a cancelled Response (aborted) ends with
        # response.incomplete, the lifecycle event of a response that ended without completing
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        return out + [self.ev(kind, response=final)]


class Responses:
    """The handlers of ``/v1/responses``."""

    def __init__(self, client: EngineClient, models: ModelNames, store: Optional[ResponseStore] = None) -> None:
        self.client = client
        self.models = models
        self.store = store if store is not None else ResponseStore()

    # ---------------------------------------------------------------- prompt
    def _prompt(self, req: ResponsesRequest, prev: Optional[StoredResponse]) -> tuple[list[int], list[dict], Any, Any]:
        """(prompt token ids, the new messages, the chat request, the tool plan)."""
        history = prev.messages if prev is not None else []
        new = input_messages(req.input, [c["id"] for m in history for c in m.get("tool_calls") or ()])
        system = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
        chat_req = req.chat_request(system + history + new)
        try:
            plan = tool_plan(chat_req)
        except APIError as exc:
            raise remap_error(exc) from exc
        messages = [m.to_template() for m in chat_req.messages]
        tools = plan.tools or None
        tok = self.client.tokenizer
        try:
            if prev is not None and prev.tokens and prev.instructions == req.instructions and prev.tools == plan.tools:
                try:
                    n_old = len(system) + len(history)
                    ids = continue_chat(tok, prev.tokens, messages[:n_old], messages[n_old:], prev.stop_text, tools)
                    return ids, messages[len(system) :], chat_req, plan
                except RequestError:
                    pass  # the template cannot continue it token for token: render it whole
            ids = encode_chat(tok, messages, tools=tools)
        except RequestError as exc:
            raise request_error_to_api(exc, "input", {"tools": "tools", "messages": "input"}) from exc
        return ids, messages[len(system) :], chat_req, plan

    # ---------------------------------------------------------------- output
    @staticmethod
    def _items(text: str, plan: Any, reason: Optional[str], msg_id: str, call_ids: list[str] | None) -> list[dict]:
        status = "completed" if _status(reason) == "completed" else "incomplete"
        content, calls = parse_tool_calls(text, plan.cut, plan.forced, plan.max_calls) if plan.parse else (text, [])
        items: list[dict] = []
        if content or not calls:
            part = {"type": "output_text", "text": content or "", "annotations": [], "logprobs": []}
            items.append({"id": msg_id, "type": "message", "role": "assistant", "status": status, "content": [part]})
        for j, c in enumerate(calls):
            call_id = call_ids[j] if call_ids is not None and j < len(call_ids) else c.id
            items.append(
                {
                    "id": "fc_" + call_id.removeprefix("call_"),
                    "type": "function_call",
                    "call_id": call_id,
                    "name": c.name,
                    "arguments": c.arguments,
                    "status": "completed" if c.complete else "incomplete",
                }
            )
        return items

    @staticmethod
    def _history_reply(items: list[dict]) -> dict:
        """The assistant message of ``items`` (for the stored conversation)."""
        text = "".join(p["text"] for it in items if it["type"] == "message" for p in it["content"])
        calls = [
            {"id": it["call_id"], "type": "function", "function": {"name": it["name"], "arguments": it["arguments"]}}
            for it in items
            if it["type"] == "function_call"
        ]
        msg: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            msg["tool_calls"] = calls
        return msg

    def _body(self, rid: str, created: float, req: ResponsesRequest, status: str, output: list, usage: Any) -> dict:
        body = {
            "id": rid,
            "object": "response",
            "created_at": created,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": self.models.served,
            "output": output,
            "usage": None,
        }
        body.update(req.echo())
        if usage is not None:
            body["usage"] = {
                "input_tokens": usage.prompt_tokens,
                "input_tokens_details": {"cached_tokens": usage.prompt_tokens_details.cached_tokens},
                "output_tokens": usage.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage.total_tokens,
            }
        return body

    # ---------------------------------------------------------------- create
    async def create(
        self, req: ResponsesRequest, raw: Request, namespace: Optional[Namespace] = None
    ) -> dict | AsyncIterator[str]:
        """A Response dict, or the event stream when ``stream``. ``namespace``: the prefix-cache
        namespace it runs in (None: the shared default); a ``previous_response_id`` of another
        tenant is not found (ids do not cross tenants: the answer is an unknown id's).

        Raises:
            APIError: 400 naming the field (``previous_response_id`` unknown, unsupported fields,
                values the engine refuses).
        """
        req.check_values()
        self.models.check(req.model)
        prev = None
        if req.previous_response_id is not None:
            prev = self.store.get(req.previous_response_id, namespace.tenant if namespace is not None else None)
            if prev is None or not prev.body:  # no body yet: its handler has not written it (its
                # conversation neither), though the engine finished it; not found, as a GET answers
                raise APIError(
                    f"previous response {req.previous_response_id!r} was not found (not stored, deleted, or "
                    "past the store's bound)",
                    "previous_response_id",
                    status_code=404,  # NOTE: as GET / DELETE answer an unknown id (the tenants issue asks
                    # one answer for all three); OpenAI itself answers 400 here
                    code="previous_response_not_found",
                )
        ids, new_history, chat_req, plan = await tokenize_off_loop(raw, self._prompt, req, prev)
        in_items = input_items(req.input, (prev.input_items, prev.body.get("output", [])) if prev is not None else None)
        try:
            params = sampling_params(chat_req, [len(ids)], self.client.max_context_len, None, "input", plan)
        except APIError as exc:
            raise remap_error(exc) from exc
        renames = {k: chat_param(v) for k, v in constraint_renames(constraint_of(chat_req, plan)[0]).items()}
        rid, msg_id, created = _id("resp"), _id("msg"), time.time()
        holder: dict[str, Any] = {}
        store, tok = self.store, self.client.tokenizer

        def on_finish(pins: Pins, out: Any) -> None:  # where the engine lives, before the output is delivered
            if prev is not None:
                store.touch(prev, pins)
            if not req.store or out.outputs[0].finish_reason == "abort":
                return
            c = out.outputs[0]
            tokens = list(ids) + list(c.token_ids)
            pin = pins.pin_prefix(tokens, namespace)
            item = holder["item"] = StoredResponse(
                {}, [], req.instructions, list(plan.tools), tokens, reply_stop_text(tok, c), pin, namespace, in_items
            )
            store.put(rid, item, pins)

        run = await self.client.start(
            "responses",
            [(None, ids)],
            params,
            "input",
            renames,
            namespace=namespace,
            on_finish=[on_finish],
            routing_key=req.prompt_cache_key or req.user,
        )

        def finish(out: Any, call_ids: list[str] | None) -> dict:
            c = out.outputs[0]
            items = self._items(c.text, plan, c.finish_reason, msg_id, call_ids)
            status = _status(c.finish_reason)
            body = self._body(rid, created, req, status, items, run.usage([out]))
            body["completed_at"] = time.time()
            item = holder.get("item")
            if item is not None:
                item.body = body
                item.messages = new_history + [self._history_reply(items)]
            return body

        if not req.stream:
            try:
                (out,) = await self.client.collect(raw, run)
            except BaseException:  # the client went away: nothing of this response is kept
                await self._forget(rid)
                raise
            return finish(out, None)
        events = self._events(req, rid, created, msg_id, plan, run, finish)
        return framed(events, run.rest, server_error_event, run.stream_failed)

    # ---------------------------------------------------------------- stream
    async def _events(self, req, rid, created, msg_id, plan, run, finish) -> AsyncIterator[str]:
        done = False
        try:
            async for event in self._event_stream(req, rid, created, msg_id, plan, run, finish):
                yield event
            done = True
        finally:
            if not done:  # the client went away (or the engine failed): nothing of it is kept
                await self._forget(rid)

    async def _event_stream(self, req, rid, created, msg_id, plan, run, finish) -> AsyncIterator[str]:
        w = _EventWriter(msg_id)
        head = self._body(rid, created, req, "in_progress", [], None)
        yield w.ev("response.created", response=head)
        yield w.ev("response.in_progress", response=head)
        parser = ToolCallStream() if plan.parse else None
        latest = run.firsts[0]
        async for _, out in chain(run.firsts, run.rest):
            latest = out
            for event in w.output(out.outputs[0], parser, plan):
                yield event
        final = finish(latest, parser.call_ids() if parser is not None else None)
        for event in w.finish(final):
            yield event

    # ---------------------------------------------------------------- retrieve / delete
    def retrieve(self, rid: str, tenant: Optional[str] = None) -> dict:
        """The stored Response ``rid`` of ``tenant`` (None: no API keys). Raises :class:`APIError`
        404 when unknown or another tenant's (the same answer)."""
        return self._stored(rid, tenant).body

    def _stored(self, rid: str, tenant: Optional[str]) -> StoredResponse:
        item = self.store.get(rid, tenant)
        if item is None or not item.body:
            raise APIError(f"response {rid!r} was not found", "response_id", status_code=404, code="not_found")
        return item

    def list_input_items(self, rid: str, tenant: Optional[str], query: Mapping[str, str]) -> dict:
        """A page of the stored Response ``rid``'s input items (:func:`.response_items.page`).
        Raises :class:`APIError` 404 as :meth:`retrieve`, 400 for a bad query parameter."""
        return page(self._stored(rid, tenant).input_items, query)

    async def _forget(self, rid: str) -> None:
        item = self.store.pop(rid)
        if item is not None:
            await self.client.backend.release_pin(self.store.take_pin(item))

    async def delete(self, rid: str, tenant: Optional[str] = None) -> dict:
        """Delete the stored Response ``rid`` of ``tenant`` and release its pin (none across
        replicas). 404 when unknown or another tenant's (the same answer)."""
        self._stored(rid, tenant)  # NOTE: one still being written is not found, as a GET answers
        item = self.store.pop(rid, tenant)
        if item is None:
            raise APIError(f"response {rid!r} was not found", "response_id", status_code=404, code="not_found")
        await self.client.backend.release_pin(self.store.take_pin(item))
        return {"id": rid, "object": "response", "deleted": True}

    def cancel(self, rid: str, tenant: Optional[str] = None) -> dict:
        """OpenAI's ``POST /v1/responses/{id}/cancel``, which cancels only a response created with
        ``background: true``: radixkv creates none (``background`` is refused), so a stored
        Response of ``tenant`` is a 400 ``invalid_request`` saying so, nothing changed; 404 as
        :meth:`retrieve` when unknown or another tenant's.

        Raises:
            APIError: always (400 or 404)."""
        self._stored(rid, tenant)
        raise APIError(
            f"response {rid!r} cannot be cancelled: only a response created with background: true can be, "
            "and background responses are not supported (this one is complete)",
            "response_id",
            code="invalid_request",
        )
