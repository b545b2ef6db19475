"""The OpenAI-compatible server on the real engine (default model, CPU), called with the
official ``openai`` client over HTTP on a free loopback port.

One server per module (uvicorn in a thread of this process, so the engine's cache statistics
can be read directly through the AsyncLLM). ``max_tokens`` stays small to keep the module quick.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import threading
import time

import httpx
import openai
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from route_table import ROUTES, Target, uncovered  # noqa: E402
from server_helpers import (  # noqa: E402
    abort_all_once_running,
    assert_pool_whole,
    scrape,
    serve_process,
    sigterm_mid_stream,
    wait_idle,
)

from radixkv.async_llm import AsyncLLM  # noqa: E402
from radixkv.chat_template import encode_chat as render_chat  # noqa: E402
from radixkv.engine import StepFinished  # noqa: E402
from radixkv.sampling_params import SamplingParams  # noqa: E402

pytestmark = pytest.mark.timeout(600)

MODEL = "smollm2-135m"
SYSTEM = (
    "You are a careful assistant for a hardware store. Answer in one short sentence, name the "
    "aisle when you can, and never invent products that the store does not sell."
)


@pytest.fixture(scope="module")
def llm(default_model):
    from radixkv.config import EngineConfig
    from radixkv.engine import Engine

    engine = Engine(
        EngineConfig(model=MODEL, device="cpu", page_size=1, max_total_tokens=16384), loaded_model=default_model
    )
    batch_sizes: list[int] = []
    # records how many requests each step served (an engine event, on the engine thread)
    engine.events.subscribe(lambda ev: batch_sizes.append(ev.num_reqs), (StepFinished,))
    a = AsyncLLM(engine=engine)
    a.batch_sizes = batch_sizes
    yield a
    a.shutdown()


def chat_messages(user: str, system: str = SYSTEM) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def prompt_ids(llm: AsyncLLM, messages: list[dict]) -> list[int]:
    return render_chat(llm.tokenizer, messages)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def flush(server) -> httpx.Response:
    return httpx.post(server.base_url + "/flush_cache", timeout=60)


# ---------------------------------------------------------------------------------- basics


def test_models_and_health(server, client, llm):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].max_model_len == llm.max_context_len
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_chat_completion(client, llm):
    messages = chat_messages("Where do I find hammers?")
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    assert r.object == "chat.completion" and r.model == MODEL and len(r.choices) == 1
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == len(prompt_ids(llm, messages))
    assert 1 <= r.usage.completion_tokens <= 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    cached = r.usage.prompt_tokens_details.cached_tokens
    assert isinstance(cached, int) and 0 <= cached <= r.usage.prompt_tokens - 1
    assert_pool_whole(llm)


def test_chat_template_fields_are_vllms(server, client, llm):
    """``add_generation_prompt``, ``continue_final_message`` and ``chat_template_kwargs`` render
    the prompt as transformers' ``apply_chat_template`` with those options (the server refused
    them as unknown while ``LLM.chat`` took them); the continuation is the greedy completion of
    those ids; a request's own ``chat_template`` is refused."""
    tok = llm.tokenizer
    conv = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "My favourite color is"}]
    ids = tok.apply_chat_template(conv, continue_final_message=True, tokenize=True, return_dict=False)
    go = dict(model=MODEL, messages=conv, max_tokens=4, temperature=0)
    r = client.chat.completions.create(
        **go, extra_body={"continue_final_message": True, "add_generation_prompt": False}
    )
    assert r.usage.prompt_tokens == len(ids)
    ref = client.completions.create(model=MODEL, prompt=list(ids), max_tokens=4, temperature=0)
    assert r.choices[0].message.content == ref.choices[0].text
    assert ref.usage.prompt_tokens_details.cached_tokens == len(ids) - 1  # the chat's prompt, cached
    no_turn = tok.apply_chat_template(conv[:1], add_generation_prompt=False, tokenize=True, return_dict=False)
    r = client.chat.completions.create(**{**go, "messages": conv[:1]}, extra_body={"add_generation_prompt": False})
    full = prompt_ids(llm, conv[:1])
    assert r.usage.prompt_tokens == len(no_turn) < len(full) and full[: len(no_turn)] == list(no_turn)  # no new turn
    r = client.chat.completions.create(**{**go, "messages": conv[:1]}, extra_body={"chat_template_kwargs": {"x": 1}})
    assert r.usage.prompt_tokens == len(prompt_ids(llm, conv[:1]))  # a variable SmolLM2's template never reads
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        for extra, param, code in (
            ({"continue_final_message": True}, "continue_final_message", "invalid_value"),
            ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", "invalid_value"),
            ({"chat_template": "{{ messages }}"}, "chat_template", "unsupported_parameter"),
        ):
            r = http.post("/v1/chat/completions", json={**go, **extra})
            assert r.status_code == 400, (extra, r.text)
            err = r.json()["error"]
            assert err["param"] == param and (code == "invalid_value" or err["code"] == code), err
    assert_pool_whole(llm)


def test_stream_joins_to_the_greedy_answer_with_the_same_usage(client, llm):
    messages = chat_messages("Do you sell garden hoses?")
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [plain.choices[0].finish_reason]
    assert chunks[0].choices[0].delta.role == "assistant"
    # With include_usage, every chunk carries usage=None except the last, choice-less one.
    assert all(c.usage is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    n_prompt = len(prompt_ids(llm, messages))
    assert last.usage.prompt_tokens == plain.usage.prompt_tokens == n_prompt
    assert last.usage.completion_tokens == plain.usage.completion_tokens
    # The same prompt was just served: at page_size 1 every prompt token but the last is cached.
    assert last.usage.prompt_tokens_details.cached_tokens == n_prompt - 1
    assert_pool_whole(llm)


def test_completions_text_token_ids_batch_and_stream(client, llm):
    prompt = "The three primary colors are"
    ids = list(llm.tokenizer.encode(prompt, add_special_tokens=False))
    a = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    b = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert a.object == "text_completion" and a.choices[0].text == b.choices[0].text
    assert a.usage.prompt_tokens == b.usage.prompt_tokens == len(ids)
    assert b.usage.prompt_tokens_details.cached_tokens == len(ids) - 1
    both = client.completions.create(model=MODEL, prompt=[prompt, "Water boils at"], max_tokens=6, temperature=0, n=2)
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert both.choices[0].text == both.choices[1].text == a.choices[0].text  # greedy: n copies
    assert both.usage.prompt_tokens == len(ids) + len(llm.tokenizer.encode("Water boils at", add_special_tokens=False))
    streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == a.choices[0].text
    assert_pool_whole(llm)


def test_stop_strings_and_seed(client, llm):
    messages = chat_messages("What can I use to glue wood?")
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    text = full.choices[0].message.content
    assert len(text) > 12, text
    stop = text[6:10]  # a stop string the greedy answer is known to contain
    cut = text[: text.find(stop)]
    stopped = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0, stop=[stop])
    assert stopped.choices[0].message.content == cut and stopped.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, temperature=0, stop=[stop], stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == cut  # no stop text leaked
    a, b = (
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=1.0, seed=11)
        for _ in range(2)
    )
    assert a.choices[0].message.content == b.choices[0].message.content
    assert_pool_whole(llm)


# ---------------------------------------------------------------------------------- cache reporting


def test_cached_tokens_cold_then_shared_system_prompt_then_flushed(server, client, llm):
    system = "You are the help desk of a public library. Be brief and kind. " * 3
    first, second = chat_messages("How late are you open?", system), chat_messages("Can I renew a book?", system)
    assert flush(server).status_code == 200
    r1 = client.chat.completions.create(model=MODEL, messages=first, max_tokens=4, temperature=0)
    assert r1.usage.prompt_tokens_details.cached_tokens == 0  # cold: the cache was just flushed
    r2 = client.chat.completions.create(model=MODEL, messages=second, max_tokens=4, temperature=0)
    shared = common_prefix(prompt_ids(llm, first), prompt_ids(llm, second))
    assert shared > 40  # the system prompt and the template around it
    assert r2.usage.prompt_tokens_details.cached_tokens == min(shared, r2.usage.prompt_tokens - 1)
    # n > 1: the prompt is counted once, and cached once.
    r3 = client.chat.completions.create(model=MODEL, messages=second, max_tokens=4, temperature=0.9, seed=3, n=3)
    assert len(r3.choices) == 3 and [c.index for c in r3.choices] == [0, 1, 2]
    assert r3.usage.prompt_tokens == r2.usage.prompt_tokens
    assert r3.usage.prompt_tokens_details.cached_tokens == r3.usage.prompt_tokens - 1
    assert 3 <= r3.usage.completion_tokens <= 3 * 4  # summed over the choices
    # After a flush the same request is cold again.
    assert flush(server).json() == {"flushed": True, "message": "the prefix cache was flushed"}
    r4 = client.chat.completions.create(model=MODEL, messages=second, max_tokens=4, temperature=0)
    assert r4.usage.prompt_tokens_details.cached_tokens == 0
    assert r4.choices[0].message.content == r2.choices[0].message.content
    assert_pool_whole(llm)


def test_flush_cache_is_refused_while_a_request_runs(server, llm):
    body = {"model": MODEL, "prompt": "Count from one to one hundred:", "max_tokens": 300, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    with httpx.Client(base_url=server.base_url, timeout=300) as http:
        with http.stream("POST", "/v1/completions", json=body) as resp:
            lines = resp.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            refused = http.post("/flush_cache")
            assert refused.status_code == 409
            err = refused.json()["error"]
            assert "unfinished" in err["message"] and err["code"] == "requests_running"
    wait_idle(llm)
    assert flush(server).status_code == 200
    assert_pool_whole(llm)


# ---------------------------------------------------------------------------------- load and aborts


def test_32_concurrent_streaming_clients(server, llm, monkeypatch):
    aclient = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=600)
    llm.batch_sizes.clear()
    # the engine thread waits (a posted call) until the 32 requests are queued behind it: they share
    # its batches however slowly they arrive (on a loaded machine the first could finish before the
    # last came)
    gate, queued, submit = threading.Event(), [], llm.submit
    submit(lambda e: gate.wait(120))
    monkeypatch.setattr(llm, "submit", lambda fn: queued.append(fn) or submit(fn))

    async def one(i: int):
        stream = await aclient.chat.completions.create(
            model=MODEL, messages=chat_messages(f"Question {i}: where are the screws of size {i}?"),
            max_tokens=6, temperature=0, stream=True, stream_options={"include_usage": True},
        )  # fmt: skip
        text, finish, usage = "", None, None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage is not None:
                usage = chunk.usage
        return text, finish, usage

    async def all_of_them():
        try:
            answers = asyncio.gather(*(one(i) for i in range(32)))
            try:
                deadline = time.monotonic() + 120
                while len(queued) < 32 and not answers.done():  # each request's engine call
                    assert time.monotonic() < deadline, f"{len(queued)} of 32 requests queued"
                    await asyncio.sleep(0.01)
            finally:
                gate.set()
            return await answers
        finally:
            await aclient.close()

    results = asyncio.run(all_of_them())
    assert len(results) == 32
    for _text, finish, usage in results:
        assert finish in ("stop", "length") and usage is not None
        assert 1 <= usage.completion_tokens <= 6
        assert usage.prompt_tokens_details.cached_tokens <= usage.prompt_tokens - 1
    # Requests shared the engine's batches rather than running one by one.
    print("outputs per engine step:", llm.batch_sizes)
    assert max(llm.batch_sizes) >= 16, llm.batch_sizes
    wait_idle(llm)
    assert_pool_whole(llm)


def test_client_disconnect_mid_stream_aborts_and_releases_slots(server, llm):
    before = scrape(server)
    body = {"model": MODEL, "messages": chat_messages("Tell me a long story."), "max_tokens": 400,
            "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
    with httpx.Client(base_url=server.base_url, timeout=300) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as resp:
            contents = 0
            for line in resp.iter_lines():
                if line.startswith("data:") and '"content"' in line:
                    contents += 1
                if contents == 3:
                    break  # leaving the block closes the connection mid-stream
    wait_idle(llm)
    after = scrape(server)
    key = ("radixkv_requests_finished_total", (("finish_reason", "abort"),))
    assert after.get(key, 0) == before.get(key, 0) + 1
    # The aborted request never reached its 400 tokens.
    gen = ("radixkv_generation_tokens_total", ())
    assert after[gen] == before[gen]
    assert_pool_whole(llm)


def test_client_disconnect_of_a_non_streamed_request_aborts_it(server, llm):
    before = scrape(server)
    body = {"model": MODEL, "prompt": "Write a very long essay about rivers.", "max_tokens": 2000, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/v1/completions", json=body, timeout=2.0)
    wait_idle(llm, timeout=120)
    after = scrape(server)
    key = ("radixkv_requests_finished_total", (("finish_reason", "abort"),))
    assert after.get(key, 0) == before.get(key, 0) + 1
    gen = ("radixkv_generation_tokens_total", ())
    assert after[gen] == before[gen]
    assert_pool_whole(llm)


# ---------------------------------------------------------------------------------- metrics


def test_metrics_parse_and_move(server, client, llm):
    before = scrape(server)
    messages = chat_messages("Do you cut keys?")
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0)
    after = scrape(server)
    req = ("radixkv_requests_total", (("endpoint", "chat"),))
    assert after[req] == before.get(req, 0) + 1
    for name, delta in (
        ("radixkv_prompt_tokens_total", r.usage.prompt_tokens),
        ("radixkv_cached_tokens_total", r.usage.prompt_tokens_details.cached_tokens),
        ("radixkv_generation_tokens_total", r.usage.completion_tokens),
    ):
        assert after[(name, ())] == before.get((name, ()), 0) + delta, name
    assert (
        after[("radixkv_time_to_first_token_seconds_count", ())]
        == before[("radixkv_time_to_first_token_seconds_count", ())] + 1
    )
    stats = llm.get_cache_stats()
    assert after[("radixkv_kv_capacity_tokens", ())] == stats["capacity"]
    assert after[("radixkv_page_size", ())] == 1
    assert after[("radixkv_num_requests_running", ())] == 0 and after[("radixkv_num_requests_waiting", ())] == 0
    assert after[("radixkv_cache_hit_rate", ())] == pytest.approx(stats["hit_rate"])
    assert after[("radixkv_evicted_tokens_total", ())] == stats["evicted_tokens"]
    assert after[("radixkv_kv_free_tokens", ())] + after[("radixkv_kv_evictable_tokens", ())] == stats["capacity"]


# ---------------------------------------------------------------------------------- bad input


def _bad_inputs(ctx: int) -> list[tuple[str, str, bytes, str | None]]:
    chat = "/v1/chat/completions"
    comp = "/v1/completions"
    msgs = [{"role": "user", "content": "hi"}]

    def j(obj) -> bytes:
        return json.dumps(obj).encode()

    return [
        ("malformed json", chat, b'{"model": "smollm2-135m", "messages": [', None),
        ("missing messages", chat, j({"model": MODEL}), "messages"),
        ("empty messages", chat, j({"model": MODEL, "messages": []}), "messages"),
        ("missing prompt", comp, j({"model": MODEL}), "prompt"),
        ("empty prompt", comp, j({"model": MODEL, "prompt": ""}), "prompt"),
        ("prompt longer than context (ids)", comp, j({"model": MODEL, "prompt": [42] * ctx}), "prompt"),
        ("prompt longer than context (chat)", chat,
         j({"model": MODEL, "messages": [{"role": "user", "content": "hello " * ctx}]}), "messages"),
        ("max_tokens < 1", chat, j({"model": MODEL, "messages": msgs, "max_tokens": 0}), "max_tokens"),
        ("max_tokens beyond context", chat, j({"model": MODEL, "messages": msgs, "max_tokens": ctx}), "max_tokens"),
        ("temperature < 0", chat, j({"model": MODEL, "messages": msgs, "temperature": -0.5}), "temperature"),
        ("top_p = 0", chat, j({"model": MODEL, "messages": msgs, "top_p": 0}), "top_p"),
        ("top_p > 1", comp, j({"model": MODEL, "prompt": "hi", "top_p": 1.5}), "top_p"),
        ("n < 1", chat, j({"model": MODEL, "messages": msgs, "n": 0}), "n"),
        ("257 stop strings", comp, j({"model": MODEL, "prompt": "hi", "stop": [f"s{i}" for i in range(257)]}), "stop"),
        ("a stop string over 1,024 characters", chat, j({"model": MODEL, "messages": msgs, "stop": "x" * 1025}), "stop"),
        ("token id outside the vocabulary", comp, j({"model": MODEL, "prompt": [10**6]}), "prompt"),
        ("wrong type", comp, j({"model": MODEL, "prompt": "hi", "max_tokens": "many"}), "max_tokens"),
        # strict types: no coercion
        ("string for an integer", chat, j({"model": MODEL, "messages": msgs, "max_tokens": "3"}), "max_tokens"),
        ("float for an integer", comp, j({"model": MODEL, "prompt": "hi", "max_tokens": 3.0}), "max_tokens"),
        ("string for a boolean", chat, j({"model": MODEL, "messages": msgs, "stream": "yes"}), "stream"),
        ("string for a float", comp, j({"model": MODEL, "prompt": "hi", "temperature": "0"}), "temperature"),
        ("integer for a string", chat, j({"model": MODEL, "messages": [{"role": "user", "content": 7}]}), "messages"),
        # fields the endpoint does not define
        ("unknown field", chat, j({"model": MODEL, "messages": msgs, "temprature": 0}), "temprature"),
        # streaming options of a request that does not stream (OpenAI: only allowed with stream)
        ("stream_options without stream", chat, j({"model": MODEL, "messages": msgs,
         "stream_options": {"include_usage": True}}), "stream_options"),
        ("stream_options with stream false", comp, j({"model": MODEL, "prompt": "hi", "stream": False,
         "stream_options": {"include_usage": True}}), "stream_options"),
        ("prompt on chat", chat, j({"model": MODEL, "messages": msgs, "prompt": "hi"}), "prompt"),
        ("messages on completions", comp, j({"model": MODEL, "prompt": "hi", "messages": msgs}), "messages"),
        ("unknown message field", chat, j({"model": MODEL, "messages": [{"role": "user", "content": "hi", "x": 1}]}),
         "messages"),
        # values out of range
        ("presence_penalty > 2", chat, j({"model": MODEL, "messages": msgs, "presence_penalty": 2.5}),
         "presence_penalty"),
        ("logit_bias key not a token id", chat, j({"model": MODEL, "messages": msgs, "logit_bias": {"a": 1}}),
         "logit_bias"),
        ("metadata past OpenAI's 16 pairs", chat, j({"model": MODEL, "messages": msgs, "metadata": {
            f"k{i}": "v" for i in range(17)}}), "metadata"),
        ("metadata value past 512 characters", chat, j({"model": MODEL, "messages": msgs, "metadata": {
            "k": "v" * 513}}), "metadata"),
        ("logit_bias naming one token twice", comp, j({"model": MODEL, "prompt": "hi", "logit_bias": {"28": -100,
         "028": 100}}), "logit_bias"),
        ("logit_bias beyond 100", comp, j({"model": MODEL, "prompt": "hi", "logit_bias": {"5": 101}}), "logit_bias"),
        ("top_logprobs > 20", chat, j({"model": MODEL, "messages": msgs, "logprobs": True, "top_logprobs": 21}),
         "top_logprobs"),
        ("top_logprobs without logprobs", chat, j({"model": MODEL, "messages": msgs, "top_logprobs": 2}),
         "top_logprobs"),
        ("completions logprobs > 5", comp, j({"model": MODEL, "prompt": "hi", "logprobs": 6}), "logprobs"),
        # tools
        ("tool_choice without tools", chat, j({"model": MODEL, "messages": msgs, "tool_choice": "required"}),
         "tool_choice"),
        ("named tool not in tools", chat, j({"model": MODEL, "messages": msgs, "tools": [_TOOL],
         "tool_choice": {"type": "function", "function": {"name": "other"}}}), "tool_choice"),
        ("tool_choice of a wrong shape", chat, j({"model": MODEL, "messages": msgs, "tools": [_TOOL],
         "tool_choice": {"type": "function"}}), "tool_choice"),
        ("tool schema xgrammar refuses", chat, j({"model": MODEL, "messages": msgs, "tool_choice": "required",
         "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]}), "tools"),
        # a key of the other tool type beside a function's: it was dropped without a word
        ("a function tool with custom", chat, j({"model": MODEL, "messages": msgs, "tools": [{**_TOOL,
         "custom": {"name": "x"}}]}), "tools"),
        ("a function tool call with custom", chat, j({"model": MODEL, "messages": msgs + [{**_CALLED, "tool_calls": [
            {**_CALLED["tool_calls"][0], "custom": {"name": "x", "input": ""}}]}]}), "messages"),
        ("tool message without tool_call_id", chat, j({"model": MODEL, "messages": msgs + [
            {"role": "tool", "content": "42"}]}), "messages"),
        # a tool result answers a call of the assistant message right before its run (as OpenAI checks)
        ("tool message answering no call", chat, j({"model": MODEL, "messages": msgs + [
            {"role": "tool", "tool_call_id": "c1", "content": "42"}]}), "messages"),
        ("tool_call_id of no call", chat, j({"model": MODEL, "messages": msgs + [_CALLED,
            {"role": "tool", "tool_call_id": "c1", "content": "42"}, {"role": "tool", "tool_call_id": "c2",
            "content": "42"}]}), "messages"),
        ("tool_call_id of an older turn's call", chat, j({"model": MODEL, "messages": msgs + [_CALLED,
            {"role": "tool", "tool_call_id": "c1", "content": "42"}, {"role": "assistant", "content": "ok"},
            {"role": "tool", "tool_call_id": "c1", "content": "42"}]}), "messages"),
        # two constraints
        ("two constraints", chat, j({"model": MODEL, "messages": msgs, "regex": "a+", "guided_choice": ["a", "b"]}),
         "guided_choice"),
        ("two constraints beside auto tools", chat, j({"model": MODEL, "messages": msgs, "tools": [_TOOL],
         "regex": "a+", "response_format": {"type": "json_object"}}), "regex"),
        ("a bad schema beside auto tools", chat, j({"model": MODEL, "messages": msgs, "tools": [_TOOL],
         "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}),
         "response_format"),
        ("a bad tool schema beside a response_format", chat, j({"model": MODEL, "messages": msgs, "tools": [_TOOL,
         {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties":
         {"x": {"type": "nonsense"}}}}}], "response_format": {"type": "json_object"}}), "tools"),
    ]  # fmt: skip


_CALLED = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}  # fmt: skip
_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}  # fmt: skip


def test_each_bad_input_gets_400_in_openai_format_and_the_server_keeps_serving(server, client, llm):
    cases = _bad_inputs(llm.max_context_len)
    ok_bodies = {  # each endpoint's own fields only: a field the endpoint does not define is a 400
        "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
        "/v1/completions": {"model": MODEL, "prompt": "hi", "max_tokens": 1},
    }
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        for name, path, body, param in cases:
            r = http.post(path, content=body, headers={"Content-Type": "application/json"})
            assert r.status_code == 400, (name, r.status_code, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}, name
            assert err["type"] == "invalid_request_error" and err["message"], name
            assert err["param"] == param, (name, err)
            ok = http.post(path, json=ok_bodies[path])
            assert ok.status_code == 200, (name, ok.text)
    # The official client surfaces the same error as BadRequestError.
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], top_p=2.0)
    assert info.value.status_code == 400 and info.value.body["param"] == "top_p"
    wait_idle(llm)
    assert_pool_whole(llm)


# ---------------------------------------------------------------------------------- constraints, bias, penalties


def test_an_unknown_model_is_openais_404_model_not_found_on_every_route(server, client, llm):
    """OpenAI answers an unknown ``model`` with HTTP 404 (``invalid_request_error``, ``param``
    ``model``, ``code`` ``model_not_found``: the SDK's ``NotFoundError``). Before the fix every
    generating route answered 400 (the SDK raised ``BadRequestError``) while ``/v1/models/{id}``
    answered 404."""
    msgs = [{"role": "user", "content": "hi"}]
    bodies = {
        "/v1/chat/completions": {"messages": msgs, "max_tokens": 1},
        "/v1/completions": {"prompt": "hi", "max_tokens": 1},
        "/v1/responses": {"input": "hi", "max_output_tokens": 1, "store": False},
        "/tokenize": {"prompt": "hi"},
        "/detokenize": {"tokens": [42]},
    }
    want = {"type": "invalid_request_error", "param": "model", "code": "model_not_found"}
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        for path, body in bodies.items():
            r = http.post(path, json={"model": "gpt-4o", **body})
            assert r.status_code == 404, (path, r.status_code, r.text)
            err = r.json()["error"]
            assert {k: err[k] for k in want} == want and "'gpt-4o'" in err["message"], (path, err)
            assert http.post(path, json={"model": MODEL, **body}).status_code == 200, path
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=msgs, max_tokens=1)
    assert info.value.status_code == 404 and info.value.body["code"] == "model_not_found"
    wait_idle(llm)
    assert_pool_whole(llm)


def test_a_body_over_max_request_bytes_is_a_413_with_or_without_content_length(llm):
    """``create_app(max_request_bytes=)`` (``radixkv serve --max-request-bytes``, 32 MiB by
    default): a body over it is HTTP 413 in OpenAI's format naming the limit, refused from its
    ``Content-Length`` before it is read, or, sent chunked, as soon as the bytes read pass it; a
    body of exactly the limit runs. Before, any size was read whole into memory."""
    from server_helpers import Server

    from radixkv.server.app import create_app

    limit = 4096

    def body(size: int) -> bytes:  # a valid completions body of exactly ``size`` bytes
        head = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1}).encode()
        return head[:-1] + b" " * (size - len(head)) + b"}"

    def chunked(data: bytes):
        for i in range(0, len(data), 1000):
            yield data[i : i + 1000]

    s = Server(create_app(llm, served_model_name=MODEL, max_request_bytes=limit))
    try:
        with httpx.Client(base_url=s.base_url, timeout=120) as http:
            headers = {"Content-Type": "application/json"}
            for size, status in ((limit, 200), (limit + 1, 413), (50 * limit, 413)):
                for content in (body(size), chunked(body(size))):
                    r = http.post("/v1/completions", content=content, headers=headers)
                    assert r.status_code == status, (size, r.text)
                    if status == 413:
                        assert r.json() == {"error": {
                            "message": f"the request body is larger than this server's limit of {limit} bytes "
                            "(radixkv serve --max-request-bytes, create_app(max_request_bytes=...))",
                            "type": "invalid_request_error", "param": None, "code": "request_too_large"}}  # fmt: skip
            assert scrape(s)[("radixkv_request_errors_total", (("status", "413"),))] == 4
            assert http.post("/v1/completions", content=body(100), headers=headers).status_code == 200
    finally:
        s.stop()
    with pytest.raises(ValueError, match="max_request_bytes must be an integer >= 1, got 0"):
        create_app(llm, max_request_bytes=0)
    wait_idle(llm)
    assert_pool_whole(llm)


def test_apps_whose_lifespan_never_runs_leave_no_subscriber_on_the_engine(llm):
    """An app served through httpx's ``ASGITransport`` (which runs no lifespan), or built and
    dropped, is collected; each one's metrics stayed subscribed to the engine's events for good
    (the engine held them strongly, and only the lifespan's end unsubscribed), so an engine
    embedded in a framework that builds an app per agent or per test kept every app's metrics
    and called all of them on every finished request."""
    import gc
    import weakref

    from radixkv.server.app import create_app

    def subscribers() -> int:
        return asyncio.run(llm.call_in_engine_thread(lambda e: len(e.events._subs)))

    async def complete(app) -> int:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as c:
            r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 1})
        return r.status_code

    async def one_request() -> None:  # its events let go of the dropped apps' subscriptions
        async for _ in llm.generate("Hi", SamplingParams(max_tokens=1)):
            pass

    gc.collect()
    asyncio.run(one_request())
    before = subscribers()
    apps = [create_app(llm, served_model_name=MODEL) for _ in range(3)]
    metrics = [weakref.ref(a.state.metrics) for a in apps]
    assert asyncio.run(complete(apps[0])) == 200
    assert scrape_app(apps[0])[("radixkv_requests_finished_total", (("finish_reason", "length"),))] == 1
    assert subscribers() == before + 3
    del apps
    forget_fastapi_route_cache()
    gc.collect()
    assert [m() for m in metrics] == [None, None, None]
    asyncio.run(one_request())
    assert subscribers() == before
    assert_pool_whole(llm)


def forget_fastapi_route_cache() -> None:
    """Empty FastAPI's own caches of route callables (``functools.lru_cache`` s of 4096 entries in
    ``fastapi.dependencies.models``): they hold the last apps' handlers, and with them their
    metrics, until newer routes push them out."""
    from fastapi.dependencies import models

    caches = [f for f in vars(models).values() if callable(getattr(f, "cache_clear", None))]
    assert caches, "FastAPI keeps no route cache here any more: drop this helper"
    for f in caches:
        f.cache_clear()


def scrape_app(app) -> dict:
    """:func:`server_helpers.scrape` of an app without a server (its ``/metrics`` over ASGI)."""
    from prometheus_client.parser import text_string_to_metric_families

    async def get() -> str:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as c:
            return (await c.get("/metrics")).text

    fams = text_string_to_metric_families(asyncio.run(get()))
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for fam in fams for s in fam.samples}


def test_structured_output_spellings_constrain_the_output(server, llm):
    """Every spelling of a constraint reaches the engine (the output obeys it); an invalid one is
    a 400 naming the field the client sent."""
    import re

    import jsonschema

    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["color", "n"], "additionalProperties": False}  # fmt: skip
    chat_msgs = chat_messages("Pick a color and a number.")
    base = {"model": MODEL, "messages": chat_msgs, "max_tokens": 40, "temperature": 0}
    comp = {"model": MODEL, "prompt": "My favourite color is", "max_tokens": 40, "temperature": 0}
    rf = {"type": "json_schema", "json_schema": {"name": "pick", "schema": schema, "strict": True}}
    cases = [
        ("/v1/chat/completions", {"response_format": rf}, "schema"),
        ("/v1/chat/completions", {"guided_json": schema}, "schema"),
        ("/v1/completions", {"structured_outputs": {"json": schema}}, "schema"),
        ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "object"),
        ("/v1/chat/completions", {"regex": "(red|green) [0-9]{2}"}, "regex"),
        ("/v1/completions", {"guided_regex": "(red|green) [0-9]{2}"}, "regex"),
        ("/v1/chat/completions", {"guided_choice": ["yes", "no"]}, "choice"),
        ("/v1/completions", {"structured_outputs": {"choice": ["yes", "no"]}}, "choice"),
        ("/v1/chat/completions", {"ebnf": 'root ::= "red" | "blue"'}, "ebnf"),
        ("/v1/completions", {"guided_grammar": 'root ::= "red" | "blue"'}, "ebnf"),
    ]
    with httpx.Client(base_url=server.base_url, timeout=300) as http:
        for path, extra, kind in cases:
            body = {**(base if "chat" in path else comp), **extra}
            r = http.post(path, json=body)
            assert r.status_code == 200, (extra, r.text)
            choice = r.json()["choices"][0]
            text = choice["message"]["content"] if "chat" in path else choice["text"]
            assert choice["finish_reason"] == "stop", (extra, choice)
            if kind == "schema":
                jsonschema.validate(json.loads(text), schema)
            elif kind == "object":
                assert isinstance(json.loads(text), dict), text
            elif kind == "regex":
                assert re.fullmatch("(red|green) [0-9]{2}", text), text
            elif kind == "choice":
                assert text in ("yes", "no"), text
            else:
                assert text in ("red", "blue"), text
        for extra, param in (
            ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
             "response_format"),
            ({"regex": "(unclosed"}, "regex"),
            ({"guided_json": "{not json"}, "guided_json"),
            ({"ebnf": "root ::= undefined_rule"}, "ebnf"),
        ):  # fmt: skip
            r = http.post("/v1/chat/completions", json={**base, **extra})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)
    assert_pool_whole(llm)


def test_logit_bias_penalties_min_tokens_reach_the_engine(server, llm):
    tok = llm.tokenizer
    with httpx.Client(base_url=server.base_url, timeout=300) as http:
        comp = {"model": MODEL, "prompt": "The three primary colors are", "max_tokens": 6, "temperature": 0}
        plain = http.post("/v1/completions", json=comp).json()["choices"][0]["text"]
        # +100 on one token: greedy picks it every time
        forced = tok.encode(" banana", add_special_tokens=False)[0]
        r = http.post("/v1/completions", json={**comp, "logit_bias": {str(forced): 100}}).json()
        assert r["choices"][0]["text"] == tok.decode([forced] * 6)
        # -100 on the greedy first token: it never appears
        first = tok.encode(plain, add_special_tokens=False)[0]
        r = http.post("/v1/completions", json={**comp, "logit_bias": {str(first): -100}, "logprobs": 0}).json()
        assert r["choices"][0]["logprobs"]["tokens"][0] != tok.decode([first])
        # penalties break the greedy repetition (-to-many-to-many...)
        rep = {**comp, "prompt": "one one one one one one", "max_tokens": 8}
        base_text = http.post("/v1/completions", json=rep).json()["choices"][0]["text"]
        for extra in ({"frequency_penalty": 2.0}, {"repetition_penalty": 3.0}):
            text = http.post("/v1/completions", json={**rep, **extra}).json()["choices"][0]["text"]
            assert text != base_text, extra
        # min_tokens: a greedy chat answer that stops early is held to at least min_tokens
        chat = {"model": MODEL, "messages": chat_messages("Say yes."), "max_tokens": 40, "temperature": 0}
        short = http.post("/v1/chat/completions", json=chat).json()
        n = short["usage"]["completion_tokens"]
        assert short["choices"][0]["finish_reason"] == "stop" and n < 40
        held = http.post("/v1/chat/completions", json={**chat, "min_tokens": n + 5}).json()
        assert held["usage"]["completion_tokens"] >= n + 5
    assert_pool_whole(llm)


def test_tools_with_a_response_format_give_calls_or_text_in_the_format():
    """OpenAI's semantics: with ``tool_choice: "auto"`` the model calls tools or answers in the
    ``response_format``; a forced call leaves no text for the format to shape."""
    from xgrammar import Grammar
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from radixkv.server.openai.params import constraint_of, tool_plan
    from radixkv.server.openai.protocol import ChatCompletionRequest

    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    schema["additionalProperties"] = False
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": [_TOOL]}
    body["response_format"] = {"type": "json_schema", "json_schema": {"name": "place", "schema": schema}}
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'

    def grammar(extra):
        req = ChatCompletionRequest.model_validate(body | extra)
        source, kw = constraint_of(req, tool_plan(req))
        return source, Grammar.from_structural_tag(json.dumps(kw["structural_tag"]))

    source, auto = grammar({})
    assert source == "response_format"
    assert accepts(auto, call) and accepts(auto, '{"city": "Paris"}')
    assert not accepts(auto, "It is sunny.") and not accepts(auto, '{"town": "Paris"}')
    source, forced = grammar({"tool_choice": "required"})
    assert source == "tool_choice"
    assert accepts(forced, call) and not accepts(forced, '{"city": "Paris"}')


def test_request_fields_map_onto_sampling_params():
    """Every sampling field of a body lands in ``SamplingParams`` under its engine name."""
    from radixkv.server.openai.params import sampling_params, tool_plan
    from radixkv.server.openai.protocol import ChatCompletionRequest, CompletionRequest

    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 7,
            "temperature": 0.5, "top_p": 0.9, "n": 2, "seed": 3, "stop": "x", "presence_penalty": 0.5,
            "frequency_penalty": -0.5, "logit_bias": {"12": -3, "7": 100}, "logprobs": True, "top_logprobs": 4,
            "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "min_tokens": 2, "ignore_eos": True,
            "stop_token_ids": [9], "skip_special_tokens": False, "prompt_logprobs": 1,
            "logprob_start_len": 3}  # fmt: skip
    req = ChatCompletionRequest.model_validate_json(json.dumps(body))
    req.check_values()
    p = sampling_params(req, [10], 100, None, "messages", tool_plan(req))
    got = {k: getattr(p, k) for k in ("max_tokens", "temperature", "top_p", "n", "seed", "stop", "presence_penalty",
           "frequency_penalty", "logit_bias", "logprobs", "top_k", "min_p", "repetition_penalty", "min_tokens",
           "ignore_eos", "stop_token_ids", "skip_special_tokens", "prompt_logprobs", "logprob_start_len")}  # fmt: skip
    assert got == {"max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "n": 2, "seed": 3, "stop": ["x"],
                   "presence_penalty": 0.5, "frequency_penalty": -0.5, "logit_bias": {12: -3.0, 7: 100.0},
                   "logprobs": 4, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "min_tokens": 2,
                   "ignore_eos": True, "stop_token_ids": [9], "skip_special_tokens": False,
                   "prompt_logprobs": 1, "logprob_start_len": 3}  # fmt: skip
    # completions: logprobs is the number of alternatives; echo + logprobs asks for prompt logprobs
    req = CompletionRequest.model_validate_json(
        json.dumps({"model": MODEL, "prompt": "hi", "logprobs": 2, "echo": True})
    )
    p = sampling_params(req, [3], 100, 16, "prompt")
    assert (p.logprobs, p.prompt_logprobs, p.max_tokens) == (2, 2, 16)
    # unset: the engine's defaults (no penalty, no bias, no logprobs)
    req = CompletionRequest.model_validate_json(json.dumps({"model": MODEL, "prompt": "hi"}))
    p = sampling_params(req, [3], 100, 16, "prompt")
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.logit_bias, p.logprobs) == (
        0.0, 0.0, 1.0, None, None)  # fmt: skip


# ---------------------------------------------------------------------------------- field classes

_NO_EFFECT = {
    "/v1/chat/completions": {
        "user": "u-1",
        "metadata": {"k": "v"},
        "store": False,
        "service_tier": "auto",
        "prompt_cache_key": "a",
        "prompt_cache_retention": "24h",
        "prompt_cache_options": {"mode": "implicit"},
        "safety_identifier": "s",
        "prediction": {"type": "content", "content": "Hello"},
        "modalities": ["text"],
        "reasoning_effort": "none",
        "verbosity": "medium",
        "parallel_tool_calls": True,
    },
    "/v1/completions": {"user": "u-1", "best_of": 1},
}
_UNSUPPORTED = {
    "/v1/chat/completions": {
        "audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"],
        "moderation": {"model": "omni-moderation-latest"}, "web_search_options": {},
        "functions": [{"name": "f"}], "function_call": "auto", "reasoning_effort": "high", "verbosity": "low",
        "tools": [{"type": "custom", "custom": {"name": "c"}}],
    },
    "/v1/completions": {"suffix": "x", "best_of": 3},
}  # fmt: skip


def _sdk_fields(endpoint: str) -> set[str]:
    import typing

    from openai.types import completion_create_params as comp_params
    from openai.types.chat import completion_create_params as chat_params

    mod = chat_params if endpoint == "chat" else comp_params
    return set(typing.get_type_hints(mod.CompletionCreateParamsBase)) | {"stream"}


def test_every_openai_field_is_defined_and_documented():
    """Each field of the openai SDK's request types is a field of our bodies (so it is never an
    unknown-field 400) and has a row in docs/server.md's field table."""
    from pathlib import Path

    from radixkv.server.openai.protocol import ChatCompletionRequest, CompletionRequest

    doc = (Path(__file__).resolve().parents[1] / "docs" / "server.md").read_text()
    table = doc[doc.index("### Request fields") :]
    table = table[: table.index("\n## ")]
    for endpoint, model in (("chat", ChatCompletionRequest), ("completions", CompletionRequest)):
        ours = {f.alias or name for name, f in model.model_fields.items()}
        missing = _sdk_fields(endpoint) - ours
        assert not missing, (endpoint, missing)
        undocumented = [f for f in _sdk_fields(endpoint) | ours if f"`{f}`" not in table]
        assert not undocumented, (endpoint, undocumented)


def _sdk_literal(module: str, cls: str, field: str) -> set[str]:
    """The string values of an openai SDK request field's ``Literal`` (inside Optional / aliases)."""
    import importlib
    import typing

    def strings(tp) -> set[str]:
        args = typing.get_args(tp)
        if typing.get_origin(tp) is typing.Literal:
            return set(args)
        return set().union(*(strings(a) for a in args)) if args else set()

    return strings(typing.get_type_hints(getattr(importlib.import_module(module), cls))[field])


def test_service_tier_and_prompt_cache_retention_take_only_the_sdks_values(server):
    """``service_tier`` and ``prompt_cache_retention`` (no effect here) take the openai SDK's
    values; another is a 400 naming the field and the values. Before the fix any string was a 200
    (``"service_tier": "turbo"`` was dropped without a word, as a typo of a real tier would be)."""
    chat_tiers = ["auto", "default", "flex", "scale", "priority", "fast"]
    retention = ["in_memory", "24h"]
    chat_mod, resp_mod = "openai.types.chat.completion_create_params", "openai.types.responses.response_create_params"
    assert _sdk_literal(chat_mod, "CompletionCreateParamsBase", "service_tier") == set(chat_tiers)
    assert _sdk_literal(resp_mod, "ResponseCreateParamsBase", "service_tier") == {*chat_tiers, "ultrafast"}
    for mod, cls in ((chat_mod, "CompletionCreateParamsBase"), (resp_mod, "ResponseCreateParamsBase")):
        assert _sdk_literal(mod, cls, "prompt_cache_retention") == set(retention)
    bodies = {
        "/v1/chat/completions": ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}, chat_tiers),
        "/v1/responses": ({"input": "hi", "max_output_tokens": 1, "store": False}, [*chat_tiers, "ultrafast"]),
    }
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        for path, (body, tiers) in bodies.items():
            for field, values in (("service_tier", tiers), ("prompt_cache_retention", retention)):
                for v in [*values, None]:
                    r = http.post(path, json={"model": MODEL, **body, field: v})
                    assert r.status_code == 200, (path, field, v, r.text)
                for bad in ("turbo", "Default", ""):
                    r = http.post(path, json={"model": MODEL, **body, field: bad})
                    assert r.status_code == 400, (path, field, bad, r.text)
                    err = r.json()["error"]
                    assert (err["param"], err["code"]) == (field, "invalid_value"), (path, err)
                    assert err["message"].startswith(f"{field}: ") and all(f"'{v}'" in err["message"] for v in values)
        # the Responses object says the one tier it ran on
        r = http.post("/v1/responses", json={"model": MODEL, **bodies["/v1/responses"][0], "service_tier": "flex"})
        assert r.json()["service_tier"] == "default"


def test_no_effect_fields_are_accepted_and_unsupported_ones_named(server, llm):
    bodies = {"/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
              "/v1/completions": {"model": MODEL, "prompt": "hi", "max_tokens": 1}}  # fmt: skip
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        for path, fields in _NO_EFFECT.items():
            r = http.post(path, json={**bodies[path], **fields})
            assert r.status_code == 200, (path, r.text)
        # include_obfuscation changes nothing (chunks carry no obfuscation); stream_options needs stream
        streamed = {**bodies["/v1/chat/completions"], "stream": True, "stream_options": {"include_obfuscation": False}}
        with http.stream("POST", "/v1/chat/completions", json=streamed) as r:
            assert r.status_code == 200 and "data: [DONE]" in r.read().decode()
        for path, fields in _UNSUPPORTED.items():
            for name, value in fields.items():
                r = http.post(path, json={**bodies[path], name: value})
                assert r.status_code == 400, (path, name, r.text)
                err = r.json()["error"]
                assert (err["param"], err["code"]) == (name, "unsupported_parameter"), (name, err)
        r = http.post("/v1/chat/completions", json={**bodies["/v1/chat/completions"], "frobnicate": 1})
        assert r.json()["error"]["code"] == "unknown_parameter" and r.json()["error"]["param"] == "frobnicate"
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
        named = {"type": "function", "function": {"name": "f"}}
        for extra, param, code in [  # a key no field reads, or a part the chosen type ignores: refused
            ({"prediction": {"type": "content", "content": "x", "zz": 1}}, "prediction", "unknown_parameter"),
            # the Responses API's prewarm (no generation) on chat was dropped: the answer was generated
            ({"prompt_cache_options": {"mode": "implicit", "prewarm": True}}, "prompt_cache_options",
             "unknown_parameter"),
            ({"prompt_cache_options": {"mode": "always"}}, "prompt_cache_options", "invalid_value"),
            ({"tools": tools, "tool_choice": {**named, "zz": 1}}, "tool_choice", "unknown_parameter"),
            ({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "f", "zz": 1}}},
             "tool_choice", "unknown_parameter"),
            ({"tools": tools, "tool_choice": {"type": "allowed_tools",
                                              "allowed_tools": {"mode": "auto", "tools": [named], "zz": 1}}},
             "tool_choice", "unknown_parameter"),
            ({"response_format": {"type": "json_object", "json_schema": {"name": "x", "schema": {}}}},
             "response_format", "invalid_value"),
            ({"response_format": {"type": "text", "json_schema": {"name": "x", "schema": {}}}},
             "response_format", "invalid_value"),
        ]:  # fmt: skip
            err = http.post("/v1/chat/completions", json={**bodies["/v1/chat/completions"], **extra}).json()["error"]
            assert (err["param"], err["code"]) == (param, code), (extra, err)
        # prompt_cache_key is no cache namespace: another key still hits the same prefix cache
        msgs = chat_messages("Where are the ladders?")
        a = http.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs, "max_tokens": 1,
                                                    "prompt_cache_key": "tenant-a"}).json()  # fmt: skip
        b = http.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs, "max_tokens": 1,
                                                    "prompt_cache_key": "tenant-b"}).json()  # fmt: skip
        assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == a["usage"]["prompt_tokens"] - 1
        # /v1/models/{id}
        card = http.get(f"/v1/models/{MODEL}")
        assert card.status_code == 200 and card.json()["id"] == MODEL
        gone = http.get("/v1/models/gpt-4o")
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
    assert_pool_whole(llm)


_USER = {"role": "user", "content": "hi"}


@pytest.mark.parametrize(
    "messages, says",
    [
        ([{"role": "system", "content": "x", "refusal": "no"}, _USER], "messages[0].refusal"),
        ([{**_USER, "tool_call_id": "c1"}], "messages[0].tool_call_id"),
        ([{"role": "user", "content": [{"type": "text", "text": "hi", "image_url": {"url": "http://x/a.png"}}]}],
         "messages[0].content[0].image_url"),
        ([{"role": "user", "content": [{"type": "text", "text": "hi", "refusal": "no"}]}],
         "messages[0].content[0].refusal"),
        ([_USER, {"role": "assistant", "content": [{"type": "refusal", "refusal": "no", "text": "yes"}]}, _USER],
         "messages[1].content[0].text"),
        ([{"role": "user", "content": [{"type": "refusal", "refusal": "hi"}]}], "only assistant messages"),
        ([_USER, {"role": "assistant", "content": "ok", "refusal": "no"}, _USER], "not both"),
    ],
    ids=["system refusal", "user tool_call_id", "text part image_url", "text part refusal",
         "refusal part text", "user refusal part", "assistant content and refusal"],
)  # fmt: skip
def test_message_fields_the_role_or_part_type_does_not_read_are_refused(server, messages, says):
    # each was a 200 with the field dropped from the prompt (OpenAI's types do not define it there)
    r = httpx.post(server.base_url + "/v1/chat/completions", json={"model": MODEL, "messages": messages,
                                                                    "max_tokens": 1}, timeout=60)  # fmt: skip
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages" and says in err["message"], err


def test_an_assistant_refusal_with_empty_content_is_the_message(server):
    def prompt_tokens(assistant: dict) -> int:
        body = {"model": MODEL, "messages": [_USER, {"role": "assistant", **assistant}, _USER], "max_tokens": 1}
        r = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    said = prompt_tokens({"content": "I cannot help with that."})
    assert prompt_tokens({"content": None, "refusal": "I cannot help with that."}) == said
    assert prompt_tokens({"content": "", "refusal": "I cannot help with that."}) == said  # it was dropped
    assert prompt_tokens({"content": "I cannot help with that.", "refusal": ""}) == said  # an empty one loses nothing


# ---------------------------------------------------------------------------------- every route


def test_the_route_table_covers_every_route_of_the_app(server):
    """tests/route_table.py has a row for every route ``create_app`` serves (the same table runs
    on Ray Serve replicas in tests/test_ray_routing.py)."""
    assert uncovered(server.server.config.app) == set()


@pytest.mark.parametrize("check", [c for _, _, c in ROUTES], ids=[name for name, _, _ in ROUTES])
def test_every_route_answers_on_the_single_engine(server, llm, check):
    with httpx.Client(base_url=server.base_url, timeout=300) as http:
        check(Target(http, llm.tokenizer, replicas=1, capacity=16384))
    assert_pool_whole(llm)  # every slot owned once, nothing left pinned


# ---------------------------------------------------------------------------------- CLI


def test_serve_cli_starts_and_answers(tmp_path):
    """`python -m radixkv serve` in a subprocess: /health, /v1/models, one completion."""
    args = ["--device", "cpu", "--max-total-tokens", "2048", "--page-size", "4", "--served-model-name", "tiny",
            "--log-level", "warning"]  # fmt: skip
    with serve_process(args, tmp_path / "serve.log") as (base, proc):
        c = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
        assert [m.id for m in c.models.list().data] == ["tiny"]
        r = c.completions.create(model="tiny", prompt="Hello", max_tokens=2, temperature=0)
        assert r.usage.completion_tokens == 2 or r.choices[0].finish_reason == "stop"
        stats = httpx.get(base + "/cache_stats", timeout=30).json()
        assert stats["capacity"] == 2048 and stats["page_size"] == 4
    assert proc.returncode is not None


def test_serve_shutdown_timeout_aborts_what_still_runs_and_exits_0(tmp_path):
    """``radixkv serve --shutdown-timeout 3`` (vLLM's flag) on SIGTERM: a stream that would run for
    much longer goes on for those 3 s (tokens keep coming), then ends with finish_reason "abort"
    and its ``[DONE]`` (not a cut connection), and the server exits with status 0. Without the flag
    the stream runs to its end (tests/test_tiers_server.py). With ``--replicas`` the flag is
    refused before anything starts."""
    args = ["--device", "cpu", "--max-total-tokens", "8192", "--served-model-name", "tiny", "--log-level",
            "warning", "--shutdown-timeout", "3"]  # fmt: skip
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 8000, "stream": True, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    with serve_process(args, tmp_path / "serve.log") as (base, proc):
        reason, chunks = sigterm_mid_stream(base, proc, body, tmp_path / "serve.log")
    assert reason == "abort" and 10 <= chunks < 8000  # 3 s of tokens (a 2-core CI machine makes dozens a second)
    import argparse

    from radixkv.server.cli import add_arguments, replica_flags_error

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    why = replica_flags_error(ap.parse_args(["--replicas", "2", "--shutdown-timeout", "5"]))
    assert why == "--shutdown-timeout is not supported with --replicas > 1"
    assert replica_flags_error(ap.parse_args(["--replicas", "2", "--log-requests", "x.jsonl"])).startswith(
        "--log-requests"
    )
    with pytest.raises(SystemExit):
        ap.parse_args(["--shutdown-timeout", "-1"])


# ---------------------------------------------------------------------------------- aborts


LONG_STORY = "Tell me a long story about a dragon and a knight."


def test_an_aborted_chat_or_completion_ends_with_finish_reason_abort_and_its_usage(server, client, llm):
    """``/abort_request`` ``abort_all`` ends every choice of a running chat completion or
    completion (``n`` 2), streamed or not, with vLLM's finish_reason ``abort``; ``usage`` counts the
    tokens each choice generated before the abort (one logprob each), and the engine is idle after
    (every slot owned once, none protected)."""
    ask = dict(model=MODEL, max_tokens=300, temperature=0, n=2, extra_body={"ignore_eos": True})
    messages = chat_messages(LONG_STORY)
    stream = client.chat.completions.create(
        messages=messages, stream=True, logprobs=True, stream_options={"include_usage": True}, **ask
    )
    tokens, reasons, usage, aborted = [0, 0], [None, None], None, False
    for chunk in stream:
        for c in chunk.choices:
            tokens[c.index] += len(c.logprobs.content) if c.logprobs and c.logprobs.content else 0
            reasons[c.index] = c.finish_reason or reasons[c.index]
        if chunk.usage is not None:
            usage = chunk.usage
        if min(tokens) >= 1 and not aborted:
            abort_all_once_running(server)
            aborted = True
    assert reasons == ["abort", "abort"] and 1 <= min(tokens) and max(tokens) < 300
    assert usage.completion_tokens == sum(tokens) and usage.prompt_tokens == len(prompt_ids(llm, messages))
    assert_pool_whole(llm)

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(client.completions.create, prompt=LONG_STORY, logprobs=0, **ask)
        abort_all_once_running(server)
        body = pending.result(300)
    assert [c.finish_reason for c in body.choices] == ["abort", "abort"]
    counts = [len(c.logprobs.tokens) for c in body.choices]
    assert body.usage.completion_tokens == sum(counts) and max(counts) < 300
    short, long = sorted((c.text for c in body.choices), key=len)
    assert long.startswith(short)  # greedy: the same tokens, each sample as far as it got
    assert_pool_whole(llm)


def test_abort_request_ends_every_sample_of_its_rid_and_matches_no_prefix(server, llm):
    """``/abort_request`` ``{"rid": R}`` of a ``/generate`` with ``n`` 2 ends both samples
    (``R-0``, ``R-1``) with finish_reason abort and their tokens so far. A ``rid`` that only
    starts another's is no match: SGLang's tokenizer manager drops a ``rid`` it does not run (its
    scheduler's prefix match only reaches that rid's own sub-requests, and ``X_1`` would abort
    ``X_10``), so radixkv matches the id exactly."""
    ids = llm.tokenizer.encode(LONG_STORY)
    sp = {"max_new_tokens": 300, "temperature": 0, "ignore_eos": True, "n": 2}
    body = {"input_ids": ids, "rid": "story-1", "sampling_params": sp, "stream": True}
    last: dict = {}
    with httpx.stream("POST", server.base_url + "/generate", json=body, timeout=300) as r:
        assert r.status_code == 200
        data = (line[5:].strip() for line in r.iter_lines() if line.startswith("data:"))
        first = json.loads(next(data))
        assert first["meta_info"]["finish_reason"] is None
        for rid in ("story-", "story", "story-10", "story-1-0"):  # none of them runs
            assert httpx.post(server.base_url + "/abort_request", json={"rid": rid}, timeout=60).status_code == 200
        assert httpx.get(server.base_url + "/get_load", timeout=60).json()[0]["num_reqs"] == 2
        assert httpx.post(server.base_url + "/abort_request", json={"rid": "story-1"}, timeout=60).status_code == 200
        for line in data:
            if line != "[DONE]":
                event = json.loads(line)
                last[event["index"]] = event
    assert sorted(last) == [0, 1]
    for i, event in last.items():
        meta = event["meta_info"]
        assert meta["finish_reason"]["type"] == "abort" and meta["id"] == f"story-1-{i}"
        assert meta["completion_tokens"] == len(event["output_ids"]) < 300
    short, long = sorted((e["output_ids"] for e in last.values()), key=len)
    assert long[: len(short)] == short  # greedy: the same tokens, each sample as far as it got
    assert_pool_whole(llm)
