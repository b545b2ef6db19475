"""OpenAI's Responses API (``/v1/responses``) against one real radixkv server (the default model on
CPU, uvicorn on a free 127.0.0.1 port in a thread of this process), through real clients: the
``openai`` SDK's ``client.responses.create`` / ``client.responses.stream`` (with and without
``previous_response_id``) and ``openai-agents`` with its default model class
(``OpenAIResponsesModel``) running a function tool to a final output.

A follow-up through ``previous_response_id`` must compute only its new input: its cached tokens
are the whole stored context (prompt + output, but the last output token, whose KV is never
computed), held by the stored response's pin in the KV manager.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os

import httpx
import jsonschema
import openai
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")

from server_helpers import abort_all_once_running, assert_pool_whole  # noqa: E402

from radixkv.chat_template import encode_chat  # noqa: E402

pytestmark = pytest.mark.timeout(900)

MODEL = "smollm2-135m"
INSTRUCTIONS = "You are a helpful assistant. Answer in one short sentence."
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "description": "The city, e.g. Paris"}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}
VOLATILE = {"id", "created_at", "completed_at"}


def _same(a, b) -> None:
    """Two Responses are equal but for ids, times and cached tokens (item ids are per response;
    the SDK's parsed stream adds ``parsed`` fields)."""
    da, db = a.model_dump(exclude=VOLATILE), b.model_dump(exclude=VOLATILE)
    for d in (da, db):
        d["usage"]["input_tokens_details"].pop("cached_tokens")
        for item in d["output"]:
            item.pop("id", None)
            item.pop("parsed_arguments", None)
            if item.get("type") == "function_call":
                item.pop("call_id")
            for part in item.get("content") or []:
                part.pop("parsed", None)
    assert da == db


def _flush(server) -> None:
    assert httpx.post(server.base_url + "/flush_cache").status_code == 200


def test_create_stream_and_previous_response_id_computes_only_the_new_input(server, client, llm):
    _flush(server)
    first = client.responses.create(
        model=MODEL, input="Name one fruit.", instructions=INSTRUCTIONS, max_output_tokens=48, temperature=0
    )
    assert first.status == "completed" and first.output_text and first.store
    ids = encode_chat(
        llm.tokenizer, [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": "Name one fruit."}]
    )
    assert first.usage.input_tokens == len(ids) and first.usage.input_tokens_details.cached_tokens == 0
    context = first.usage.input_tokens + first.usage.output_tokens
    store = server.server.config.app.state.responses.store
    assert store.pinned_tokens(first.id) == context - 1  # the last output token's KV is never computed

    # streamed: the final Response equals the non-streamed one (greedy), built from the events
    with client.responses.stream(
        model=MODEL, input="Name one fruit.", instructions=INSTRUCTIONS, max_output_tokens=48, temperature=0
    ) as stream:
        events = [e.type for e in stream]
        streamed = stream.get_final_response()
    assert events[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                          "response.content_part.added"]  # fmt: skip
    assert "response.output_text.delta" in events and events[-1] == "response.completed"
    assert events[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    _same(first, streamed)
    # the same prompt again: all of it but the last token (whose logits are needed) is cached
    assert streamed.usage.input_tokens_details.cached_tokens == first.usage.input_tokens - 1

    # the follow-up continues the stored context token for token: all of it is cached
    follow = client.responses.create(
        model=MODEL,
        input="And one vegetable?",
        instructions=INSTRUCTIONS,
        previous_response_id=first.id,
        max_output_tokens=48,
        temperature=0,
    )
    assert follow.previous_response_id == first.id
    assert follow.usage.input_tokens_details.cached_tokens == context - 1
    assert follow.usage.input_tokens > context
    # streamed follow-up: the same answer, and the same cached tokens
    with client.responses.stream(
        model=MODEL,
        input="And one vegetable?",
        instructions=INSTRUCTIONS,
        previous_response_id=first.id,
        max_output_tokens=48,
        temperature=0,
    ) as stream:
        list(stream)
        again = stream.get_final_response()
    _same(follow, again)

    # retrieve and delete: the stored body, then a 404; the pin goes with it
    assert client.responses.retrieve(first.id).model_dump(exclude={"completed_at"}) == first.model_dump(
        exclude={"completed_at"}
    )
    client.responses.delete(first.id)
    assert store.pinned_tokens(first.id) == 0
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as exc:
        client.responses.create(model=MODEL, input="x", previous_response_id=first.id)
    assert exc.value.body["param"] == "previous_response_id"

    # store false: nothing kept, nothing pinned
    unstored = client.responses.create(model=MODEL, input="Hi", store=False, max_output_tokens=4, temperature=0)
    assert not unstored.store
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    for rid in list(store._items):
        client.responses.delete(rid)
    assert_pool_whole(llm)


def test_stored_responses_past_the_pin_bound_stay_retrievable_unpinned(server, client, llm):
    store = server.server.config.app.state.responses.store
    bound, store.max_pinned = store.max_pinned, 1
    try:
        a = client.responses.create(model=MODEL, input="Say A.", max_output_tokens=8, temperature=0)
        assert store.pinned_tokens(a.id) > 0
        b = client.responses.create(model=MODEL, input="Say B.", max_output_tokens=8, temperature=0)
        assert store.pinned_tokens(a.id) == 0 and store.pinned_tokens(b.id) > 0  # LRU: a lost its pin
        assert client.responses.retrieve(a.id).output_text == a.output_text  # still retrievable as text
        c = client.responses.create(
            model=MODEL, input="Again.", previous_response_id=a.id, max_output_tokens=8, temperature=0
        )
        assert c.status in ("completed", "incomplete") and store.pinned_tokens(c.id) > 0
        assert store.pinned_tokens(b.id) == 0
    finally:
        store.max_pinned = bound
    for rid in list(store._items):
        client.responses.delete(rid)
    assert_pool_whole(llm)


def test_function_call_and_its_output_through_previous_response_id(server, client, llm):
    _flush(server)
    call = client.responses.create(
        model=MODEL,
        input="What is the weather in Paris?",
        instructions=INSTRUCTIONS,
        tools=[WEATHER],
        tool_choice="required",
        max_output_tokens=64,
        temperature=0,
    )
    (item,) = call.output
    assert item.type == "function_call" and item.name == "get_weather" and item.call_id.startswith("call_")
    jsonschema.validate(json.loads(item.arguments), WEATHER["parameters"])
    with client.responses.stream(
        model=MODEL,
        input="What is the weather in Paris?",
        instructions=INSTRUCTIONS,
        tools=[WEATHER],
        tool_choice="required",
        max_output_tokens=64,
        temperature=0,
    ) as stream:
        events = [e.type for e in stream]
        streamed = stream.get_final_response()
    assert "response.function_call_arguments.delta" in events
    assert events[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    _same(call, streamed)
    assert streamed.output[0].arguments == item.arguments

    context = call.usage.input_tokens + call.usage.output_tokens
    with pytest.raises(openai.BadRequestError) as info:  # an output answering no call of the conversation
        client.responses.create(
            model=MODEL,
            input=[{"type": "function_call_output", "call_id": item.call_id + "x", "output": "Sunny."}],
            previous_response_id=call.id,
            max_output_tokens=4,
        )
    err = info.value.body
    assert err["param"] == "input" and err["code"] == "invalid_value", err
    assert f"call_id {item.call_id + 'x'!r}" in err["message"] and item.call_id in err["message"], err
    result = client.responses.create(
        model=MODEL,
        input=[{"type": "function_call_output", "call_id": item.call_id, "output": "Sunny, 21 degrees."}],
        instructions=INSTRUCTIONS,
        tools=[WEATHER],
        tool_choice="none",
        previous_response_id=call.id,
        max_output_tokens=48,
        temperature=0,
    )
    assert result.output[0].type == "message" and result.output_text
    assert result.usage.input_tokens_details.cached_tokens == context - 1
    listed = client.responses.input_items.list(result.id, order="asc").data
    assert [it.type for it in listed] == ["message", "function_call", "function_call_output"]
    assert (listed[1].id, listed[1].call_id, listed[1].arguments) == (item.id, item.call_id, item.arguments)
    assert listed[2].call_id == item.call_id and listed[2].output == "Sunny, 21 degrees."
    store = server.server.config.app.state.responses.store
    for rid in list(store._items):
        client.responses.delete(rid)
    assert_pool_whole(llm)


def test_input_items_list_the_chain_newest_first_with_cursor_pages(server, client, llm):
    first = client.responses.create(model=MODEL, input="Name a colour.", max_output_tokens=4, temperature=0)
    mine = {
        "type": "message",
        "role": "user",
        "content": [{"type": "input_text", "text": "And a fruit?"}],
        "id": "msg_mine",
    }
    second = client.responses.create(
        model=MODEL, input=[mine], previous_response_id=first.id, max_output_tokens=4, temperature=0
    )
    page = client.responses.input_items.list(second.id)  # default: newest first
    items = page.data
    assert [(it.type, getattr(it, "role", None)) for it in items] == [
        ("message", "user"),
        ("message", "assistant"),
        ("message", "user"),
    ]
    assert items[0].id == "msg_mine" and items[0].content[0].text == "And a fruit?"
    assert items[1].id == first.output[0].id and items[1].content[0].text == first.output_text
    assert items[2].content[0].type == "input_text" and items[2].content[0].text == "Name a colour."
    assert items[2].id.startswith("msg_") and items[2].status == "completed"
    assert [it.id for it in client.responses.input_items.list(first.id).data] == [items[2].id]
    asc = client.responses.input_items.list(second.id, order="asc", limit=2)
    assert [it.id for it in asc.data] == [items[2].id, items[1].id] and asc.has_more
    assert [it.id for it in asc.get_next_page().data] == ["msg_mine"]
    assert [
        it.id for it in client.responses.input_items.list(second.id, order="asc", limit=2, after=items[1].id).data
    ] == ["msg_mine"]
    url = f"{server.base_url}/v1/responses/{second.id}/input_items"
    for query, param in (
        ({"limit": "0"}, "limit"),
        ({"order": "up"}, "order"),
        ({"after": "msg_x"}, "after"),
        ({"include": "message.input_image.image_url"}, "include"),
        ({"before": "x"}, "before"),
    ):
        r = httpx.get(url, params=query)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (query, r.text)
    # retrieving: stream=true used to answer the plain JSON the SDK's stream reader cannot read
    for query, param, code in (
        ({"stream": "true"}, "stream", "unsupported_parameter"),
        ({"starting_after": "3"}, "starting_after", "unsupported_parameter"),
        ({"include": "reasoning.encrypted_content"}, "include", "unsupported_parameter"),
        ({"stream": "maybe"}, "stream", "invalid_value"),
        ({"strem": "true"}, "strem", "unknown_parameter"),
    ):
        r = httpx.get(f"{server.base_url}/v1/responses/{second.id}", params=query)
        assert r.status_code == 400 and (r.json()["error"]["param"], r.json()["error"]["code"]) == (param, code), query
    r = httpx.get(f"{server.base_url}/v1/responses/{second.id}", params={"stream": "false"})
    assert r.status_code == 200 and r.json()["id"] == second.id == client.responses.retrieve(second.id).id
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_unknown")
    for rid in (first.id, second.id):
        client.responses.delete(rid)
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list(first.id)
    assert_pool_whole(llm)


def test_text_format_json_schema_and_refusals_naming_the_field(server, client):
    schema = {
        "type": "object",
        "properties": {"fruit": {"type": "string", "enum": ["apple", "banana", "cherry"]}},
        "required": ["fruit"],
        "additionalProperties": False,
    }
    r = client.responses.create(
        model=MODEL,
        input="Pick a fruit.",
        text={"format": {"type": "json_schema", "name": "pick", "schema": schema, "strict": True}},
        max_output_tokens=32,
        temperature=0,
        store=False,
    )
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"
    base = {"model": MODEL, "input": "Hi", "store": False}
    cases = [
        ({"tools": [{"type": "web_search"}]}, "tools", "unsupported_parameter"),
        ({"reasoning": {"effort": "high"}}, "reasoning", "unsupported_parameter"),
        ({"include": ["reasoning.encrypted_content"]}, "include", "unsupported_parameter"),
        ({"conversation": "conv_1"}, "conversation", "unsupported_parameter"),
        ({"truncation": "auto"}, "truncation", "unsupported_parameter"),
        ({"max_output_tokens": 0}, "max_output_tokens", "invalid_value"),
        ({"max_output_tokens": 100000}, "max_output_tokens", "context_length_exceeded"),
        ({"tool_choice": "required"}, "tool_choice", "invalid_value"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}}, "text", None),
        ({"bogus": 1}, "bogus", "unknown_parameter"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/a.png"}]}]},
            "input",
            "unsupported_parameter",
        ),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input", "unsupported_parameter"),
        # keys no field reads: refused, never ignored
        ({"text": {"format": {"type": "json_schema", "name": "x", "scheme": {}}}}, "text", "unknown_parameter"),
        ({"text": {"format": {"type": "json_object", "zz": 1}}}, "text", "unknown_parameter"),
        ({"input": [{"role": "user", "content": "Hi", "q": 1}]}, "input", "unknown_parameter"),
        ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi", "q": 1}]}]}, "input",
         "unknown_parameter"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": "1", "q": 1}]}, "input",
         "unknown_parameter"),
        ({"reasoning": {"zz": 1}}, "reasoning", "unknown_parameter"),
        # the options of a stream on a request that does not stream (a 200 that dropped them)
        ({"stream_options": {"include_obfuscation": False}}, "stream_options", "invalid_value"),
        # a function_call_output answers a function_call made before it (as OpenAI checks)
        ({"input": [{"type": "function_call_output", "call_id": "c9", "output": "1"}]}, "input", "invalid_value"),
        ({"input": [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                    {"type": "function_call_output", "call_id": "c9", "output": "1"}]}, "input", "invalid_value"),
        ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "f", "zz": 1}},
         "tool_choice", "unknown_parameter"),
        # OpenAI's bounds on metadata (a stored response keeps it: unbounded, a tenant's 20 stored
        # responses with a 20 MB value each held 410 MiB more of the server's memory)
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "invalid_value"),
        ({"metadata": {"k" * 65: "v"}}, "metadata", "invalid_value"),
        ({"metadata": {"k": "v" * 513}}, "metadata", "invalid_value"),
    ]  # fmt: skip
    most = {f"{i:02d}" + "k" * 62: "v" * 512 for i in range(16)}  # at every bound: accepted, echoed
    r = httpx.post(
        server.base_url + "/v1/responses", json={**base, "metadata": most, "max_output_tokens": 1}, timeout=60
    )
    assert r.status_code == 200 and r.json()["metadata"] == most, r.text
    echoed = [  # what the openai SDK's input types define (a client echoing an earlier response): accepted
        {"role": "user", "content": [{"type": "input_text", "text": "Hi", "prompt_cache_breakpoint": {"mode": "explicit"}}]},
        {"role": "assistant", "phase": "commentary", "content": "Hello"},
        {"type": "message", "role": "assistant", "phase": "final_answer", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Hello", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}", "namespace": "x",
         "caller": {"type": "direct"}, "async": False},
        {"type": "function_call_output", "call_id": "c1", "output": "1", "name": "f", "namespace": "x"},
        {"role": "user", "content": "Thanks"},
    ]  # fmt: skip
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]
    resp = httpx.post(
        server.base_url + "/v1/responses",
        json={**base, "input": echoed, "tools": tools, "max_output_tokens": 2},
        timeout=60,
    )
    assert resp.status_code == 200, resp.text
    for extra, param, code in cases:
        resp = httpx.post(server.base_url + "/v1/responses", json={**base, **extra}, timeout=60)
        assert resp.status_code == 400, (extra, resp.text)
        err = resp.json()["error"]
        assert err["param"] == param, (extra, err)
        if code is not None:
            assert err["code"] == code, (extra, err)


@pytest.mark.parametrize(
    "output, says",
    [(None, "input[1].output must be a string"), (5, "input[1].output must be a string"),
     ([{"type": "input_text"}], "input[1].output[0]: a input_text part needs its 'text'"),
     ([{"type": "input_image", "image_url": "http://x/a.png"}], "input[1].output[0]: input_image parts")],
    ids=["missing", "a number", "a part without text", "an image part"],
)  # fmt: skip
def test_a_bad_function_call_output_names_its_output(server, output, says):
    # a function_call_output without 'output' (or with a number) said "input[1].content must be a string or
    # a list of content parts": a field the item does not have, so the client could not find its mistake
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    answer = {"type": "function_call_output", "call_id": "c1", **({} if output is None else {"output": output})}
    body = {"model": MODEL, "input": [call, answer], "tools": [{"type": "function", "name": "f"}], "store": False}
    r = httpx.post(server.base_url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "input" and says in err["message"], err


def test_openai_agents_default_responses_model_runs_a_function_tool(server, llm):
    from agents import Agent, ModelSettings, RunConfig, Runner, function_tool, set_tracing_disabled
    from agents.models.openai_provider import OpenAIProvider
    from agents.models.openai_responses import OpenAIResponsesModel

    set_tracing_disabled(True)
    seen: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city.

        Args:
            city: The city, e.g. Paris.
        """
        seen.append(city)
        return f"It is sunny and 21 degrees in {city}."

    aclient = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    provider = OpenAIProvider(openai_client=aclient)  # the default provider: Responses models
    assert isinstance(provider.get_model(MODEL), OpenAIResponsesModel)
    agent = Agent(
        name="weather",
        instructions=INSTRUCTIONS,
        tools=[get_weather],
        model=MODEL,
        # one forced call, then (reset_tool_choice, the default) the tool choice goes back to auto
        model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=64),
    )

    async def run():
        try:
            config = RunConfig(model_provider=provider, tracing_disabled=True)
            return await Runner.run(
                agent, "What is the weather in Paris?", max_turns=4, run_config=config, auto_previous_response_id=True
            )
        finally:
            await aclient.close()

    result = asyncio.run(run())
    assert seen and all(seen)
    assert isinstance(result.final_output, str) and result.final_output
    responses = result.raw_responses
    assert len(responses) >= 2 and all(r.response_id.startswith("resp_") for r in responses)
    # every turn after the first continued the previous response server-side: its input was cached
    assert all(r.usage.input_tokens_details.cached_tokens > 0 for r in responses[1:])
    store = server.server.config.app.state.responses.store
    for rid in list(store._items):
        asyncio.run(_delete(server, rid))
    assert_pool_whole(llm)


async def _delete(server, rid: str) -> None:
    async with httpx.AsyncClient(base_url=server.base_url) as c:
        assert (await c.delete(f"/v1/responses/{rid}")).status_code == 200


def test_a_stream_the_client_leaves_keeps_nothing(server, llm):
    store = server.server.config.app.state.responses.store
    for rid in list(store._items):
        asyncio.run(_delete(server, rid))
    body = {
        "model": MODEL,
        "input": "Tell me a long story.",
        "max_output_tokens": 200,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", server.base_url + "/v1/responses", json=body, timeout=300) as r:
        lines = r.iter_lines()
        kinds = []
        for line in lines:
            if line.startswith("event:"):
                kinds.append(line[6:].strip())
            if "response.output_text.delta" in kinds:
                break  # leave mid-answer
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert_pool_whole(llm)  # aborted: its slots were freed, nothing pinned
    assert len(store) == 0


def test_the_store_keeps_exact_lru_bounds_through_gets_and_deletes():
    """The stored-Response bounds count exactly: a deleted pinned response frees its place among
    the pinned, and a lookup refreshes a response in both LRU orders."""
    from radixkv.server.openai.responses import ResponseStore, StoredResponse

    class Pins:
        def __init__(self) -> None:
            self.released: list = []

        def release_pin(self, pin) -> None:
            self.released.append(pin)

    store, pins = ResponseStore(max_stored=3, max_pinned=2), Pins()

    def put(rid: str) -> None:
        store.put(rid, StoredResponse({}, [], None, [], [1], pin=f"pin-{rid}"), pins)

    put("r1")
    put("r2")
    assert store.take_pin(store.pop("r1")) == "pin-r1" and len(store) == 1
    put("r3")  # r2 and r3 pinned: within the bound, nothing released
    assert pins.released == [] and store.get("r2").pin == "pin-r2"  # r2 is now the most recent
    put("r4")  # three pinned: the least recently used (r3, not r2) loses its pin
    assert pins.released == ["pin-r3"] and len(store) == 3
    put("r5")  # four stored: r3 (least recently used) is deleted; three pinned: r2 loses its pin
    assert store.get("r3") is None and sorted(store._items) == ["r2", "r4", "r5"]
    assert pins.released == ["pin-r3", "pin-r2"] and store.get("r4").pin == "pin-r4"


async def _stream_held_after_created(app, body: dict, chunks: list, created: asyncio.Event, release: asyncio.Event):
    """``POST /v1/responses`` (a stream) straight through ``app``'s ASGI interface into ``chunks``
    (the body chunks), whose ``send`` holds the stream at its first body chunk
    (``response.created``) until ``release``: the handler reads none of the engine's outputs
    meanwhile."""
    raw = json.dumps(body).encode()
    sent = [False]

    async def receive():
        if not sent[0]:
            sent[0] = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await release.wait()  # no disconnect while held
        await asyncio.Event().wait()

    async def send(message):
        if message["type"] == "http.response.body" and message.get("body"):
            chunks.append(message["body"].decode())
            if not created.is_set():
                created.set()
                await release.wait()

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/v1/responses", "raw_path": b"/v1/responses", "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json"), (b"host", b"test")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}  # fmt: skip
    await app(scope, receive, send)


def test_previous_response_id_of_a_response_still_streaming_is_not_found(server, client, llm):
    """A stored response is complete once its stream's handler wrote its body. Between the engine
    finishing it (its finish hook stores the context tokens and the pin) and that, a follow-up
    naming it ran on an empty stored conversation: a 47-token prompt where the completed one gives
    49 (the context continued as if it were the system message alone), and a stored history and
    input items without the earlier turn. It is 404 ``previous_response_not_found`` then, as a GET
    of that id answers, and a DELETE (it answered 200 "deleted" and dropped the item the stream
    then completed)."""
    _flush(server)
    app = server.server.config.app
    store = app.state.responses.store
    body = {"model": MODEL, "input": "Name one fruit.", "instructions": INSTRUCTIONS, "temperature": 0,
            "max_output_tokens": 4, "stream": True}  # fmt: skip

    chunks: list = []

    def data(chunk: str) -> dict:
        return json.loads(next(line[5:] for line in chunk.split("\n") if line.startswith("data:")))

    async def run() -> tuple:
        created, release = asyncio.Event(), asyncio.Event()
        task = asyncio.ensure_future(_stream_held_after_created(app, body, chunks, created, release))
        await asyncio.wait_for(created.wait(), 300)
        rid = data(chunks[0])["response"]["id"]
        deadline = asyncio.get_running_loop().time() + 300
        while store.get(rid) is None:  # the engine finished it: its finish hook stored it
            assert asyncio.get_running_loop().time() < deadline, "the held response never finished"
            await asyncio.sleep(0.01)
        try:
            follow = await asyncio.to_thread(
                lambda: client.responses.create(model=MODEL, input="And one vegetable?", instructions=INSTRUCTIONS,
                                                temperature=0, max_output_tokens=2, previous_response_id=rid)
            )  # fmt: skip
        except openai.NotFoundError as exc:
            follow = exc
        gone = await asyncio.to_thread(lambda: httpx.delete(f"{server.base_url}/v1/responses/{rid}", timeout=60))
        assert gone.status_code == 404, gone.text  # as a GET answers: it deleted it before
        assert store.get(rid) is not None
        release.set()
        await asyncio.wait_for(task, 300)
        return follow, rid

    follow, rid = asyncio.run(run())
    assert isinstance(follow, openai.NotFoundError), follow.usage
    assert follow.body["code"] == "previous_response_not_found"
    lines = "".join(chunks).split("\n")
    final = [json.loads(line[5:]) for line in lines if line.startswith("data:") and line[5:].strip() != "[DONE]"][-1]
    assert final["type"] in ("response.completed", "response.incomplete")
    done = client.responses.retrieve(rid)  # complete now: retrievable, and a follow-up gets its context
    context = done.usage.input_tokens + done.usage.output_tokens
    assert done.usage.output_tokens == final["response"]["usage"]["output_tokens"]
    later = client.responses.create(model=MODEL, input="And one vegetable?", instructions=INSTRUCTIONS,
                                    temperature=0, max_output_tokens=2, previous_response_id=rid)  # fmt: skip
    assert later.usage.input_tokens_details.cached_tokens == context - 1, (later.usage, context)
    asyncio.run(_delete(server, later.id))
    asyncio.run(_delete(server, rid))
    assert_pool_whole(llm)


def test_the_sdks_delete_frees_the_pin_and_its_cancel_is_a_400_without_background(server, client, llm):
    """``client.responses.delete`` drops a stored Response and the KV its pin held (an unknown id:
    ``NotFoundError``, OpenAI's 404 ``not_found``); ``client.responses.cancel`` of a stored
    Response is a ``BadRequestError`` (OpenAI cancels only ``background`` responses, which radixkv
    refuses to create), of an unknown id a ``NotFoundError``."""
    _flush(server)
    store = server.server.config.app.state.responses.store
    before = llm.get_cache_stats()["pinned"]
    made = client.responses.create(model=MODEL, input="Name a mountain.", temperature=0, max_output_tokens=4)
    context = made.usage.input_tokens + made.usage.output_tokens
    assert store.pinned_tokens(made.id) == context - 1 == llm.get_cache_stats()["pinned"] - before
    with pytest.raises(openai.BadRequestError) as bad:
        client.responses.cancel(made.id)
    assert bad.value.body["code"] == "invalid_request" and bad.value.body["param"] == "response_id"
    assert client.responses.retrieve(made.id).id == made.id  # the cancel changed nothing
    assert client.responses.delete(made.id) is None  # the SDK returns nothing for a 200
    assert store.pinned_tokens(made.id) == 0 and llm.get_cache_stats()["pinned"] == before
    for call in (client.responses.delete, client.responses.cancel, client.responses.retrieve):
        with pytest.raises(openai.NotFoundError) as gone:
            call(made.id)
        assert gone.value.body["code"] == "not_found" and gone.value.body["param"] == "response_id"
    assert_pool_whole(llm)


def test_an_aborted_response_is_cancelled_and_not_stored(server, client, llm):
    """A Response whose request is aborted (``/abort_request`` ``abort_all``) has status
    ``cancelled`` (OpenAI's status, vLLM's for an aborted request), its message ``incomplete``,
    the tokens generated before the abort in ``usage``; streamed, it ends with
    ``response.incomplete`` (OpenAI has no cancelled event), which the SDK parses. It was
    ``response.completed`` / ``completed``: a client took the cut reply for a whole one. It is not
    stored: a GET and a ``previous_response_id`` find no such id."""
    _flush(server)
    ask = dict(model=MODEL, input="Tell me a long story.", temperature=0)
    full = client.responses.create(**ask, max_output_tokens=200, store=False)
    assert full.status == "completed" or full.incomplete_details.reason == "max_output_tokens"
    assert full.usage.output_tokens > 50  # long enough that the abort comes before its end

    events, aborted = [], False
    for event in client.responses.create(**ask, max_output_tokens=200, stream=True):
        events.append(event)
        if not aborted and event.type == "response.output_text.delta":  # once
            abort_all_once_running(server)
            aborted = True
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds.count("response.completed") == 0
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]  # fmt: skip
    cut = events[-1].response
    assert cut.status == "cancelled" and cut.incomplete_details is None and cut.error is None
    assert events[-2].item.status == cut.output[0].status == "incomplete"
    k = cut.usage.output_tokens
    assert 1 <= k < full.usage.output_tokens and full.output_text.startswith(cut.output_text)
    assert cut.usage.total_tokens == cut.usage.input_tokens + k == full.usage.input_tokens + k
    # its k output tokens are the greedy reply's first k: the same text as a reply cut at k
    assert client.responses.create(**ask, max_output_tokens=k, store=False).output_text == cut.output_text
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == cut.output_text

    # non-streamed: the same, as the body
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(client.responses.create, **ask, max_output_tokens=200)
        abort_all_once_running(server)
        body = pending.result(300)
    assert body.status == "cancelled" and body.output[0].status == "incomplete" and body.incomplete_details is None
    assert body.usage.output_tokens < full.usage.output_tokens and full.output_text.startswith(body.output_text)

    store = server.server.config.app.state.responses.store
    for rid in (cut.id, body.id):
        assert store.get(rid) is None
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(rid)
        with pytest.raises(openai.NotFoundError) as gone:
            client.responses.create(**ask, max_output_tokens=2, previous_response_id=rid)
        assert gone.value.body["code"] == "previous_response_not_found"
    assert_pool_whole(llm)
