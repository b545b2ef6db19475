"""Request fields combined, against the real engine (default model, CPU) with the ``openai``
SDK and plain HTTP: streamed answers joined equal the non-streamed ones field for field (text,
logprobs, tool calls, finish reasons, usage), and a server with speculative decoding
(``--speculative-config``) answers what the plain one answers, greedy and seeded.

Two servers share the session's loaded model: ``server`` (conftest's, over ``llm``) and
``spec_server`` (radix speculation, 5 tokens)."""

from __future__ import annotations

import json
import os

import httpx
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from server_helpers import Server, assert_pool_whole, new_async_llm  # noqa: E402

pytestmark = pytest.mark.timeout(600)

MODEL = "smollm2-135m"
SPEC = {"method": "radix", "num_speculative_tokens": 5}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
        "strict": True,
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]},
    },
}
ASK = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the weather in Paris and the time in Tokyo?"},
]


@pytest.fixture(scope="module")
def llm(default_model):
    a = new_async_llm(default_model, max_total_tokens=4096)
    yield a
    a.shutdown()


@pytest.fixture(scope="module")
def spec_llm(default_model):
    a = new_async_llm(default_model, max_total_tokens=4096, speculative_config=SPEC)
    yield a
    a.shutdown()


@pytest.fixture(scope="module")
def spec_server(spec_llm):
    from radixkv.server.app import create_app

    s = Server(create_app(spec_llm, served_model_name=MODEL))
    yield s
    s.stop()


def post(server, path: str, body: dict) -> dict:
    r = httpx.post(server.base_url + path, json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def stream(server, path: str, body: dict) -> list[dict]:
    """The chunks of a streamed request (``data: [DONE]`` checked and dropped)."""
    events = []
    with httpx.stream("POST", server.base_url + path, json={**body, "stream": True}, timeout=300) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert not [c for c in chunks if "error" in c]
    return chunks


# ---------------------------------------------------------------------------------- completions


def joined_completion_choices(chunks: list[dict]) -> dict[int, dict]:
    """Per choice index: the joined text, logprobs (each list concatenated) and finish reason."""
    out: dict[int, dict] = {}
    for ch in chunks:
        for c in ch["choices"]:
            j = out.setdefault(c["index"], {"text": "", "logprobs": None, "finish_reason": None})
            j["text"] += c["text"]
            if c["logprobs"] is not None:
                lp = j["logprobs"] = j["logprobs"] or {k: [] for k in c["logprobs"]}
                for k, v in c["logprobs"].items():
                    lp[k] += v
            j["finish_reason"] = c["finish_reason"] or j["finish_reason"]
    return out


def test_streamed_echo_logprobs_with_n_samples_and_several_prompts_join_to_the_answer(server, llm):
    """``echo`` + ``logprobs`` + ``n = 2`` + two prompts + a stop string, streamed: each choice's
    chunks join to its non-streamed text and logprobs, the prompt's tokens once at the front (a
    sample's first chunk can come before its first token: its prompt logprobs were sent a second
    time with its first token's), and the usage chunk equals the non-streamed usage."""
    body = dict(
        model=MODEL, prompt=["The capital of France is", "Once upon a time"], max_tokens=10, temperature=0.9,
        seed=1, n=2, echo=True, logprobs=2, stop=[","],
    )  # fmt: skip
    whole = post(server, "/v1/completions", body)
    chunks = stream(server, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    # echo + logprobs computes the whole prompt again (cached_tokens 0), so both runs have the same bits
    assert whole["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    joined = joined_completion_choices(chunks[:-1])
    assert sorted(joined) == [0, 1, 2, 3]
    tok = llm.tokenizer
    for c in whole["choices"]:
        j, prompt = joined[c["index"]], body["prompt"][c["index"] // 2]
        assert j["text"] == c["text"] and c["text"].startswith(prompt)
        assert j["finish_reason"] == c["finish_reason"]
        lp = c["logprobs"]
        n_prompt = len(tok.encode(prompt, add_special_tokens=False))
        assert lp["token_logprobs"][0] is None and None not in lp["token_logprobs"][1:]
        assert "".join(lp["tokens"][:n_prompt]) == prompt
        assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
        assert j["logprobs"] == lp
    assert_pool_whole(llm)


# ---------------------------------------------------------------------------------- tool calls


def joined_chat_choice(chunks: list[dict]) -> dict:
    """The one choice of a streamed chat answer: content, calls [(name, arguments)], finish."""
    content, calls, finish = "", [], []
    for ch in chunks:
        for c in ch["choices"]:
            content += c["delta"].get("content") or ""
            for tc in c["delta"].get("tool_calls") or ():
                if tc.get("id"):
                    assert tc["index"] == len(calls) and tc["type"] == "function"
                    calls.append([tc["function"]["name"], ""])
                calls[tc["index"]][1] += tc["function"].get("arguments") or ""
            if c["finish_reason"]:
                finish.append(c["finish_reason"])
    return {"content": content or None, "calls": [tuple(c) for c in calls], "finish": finish}


def calls_of(message: dict) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"] or ()]


def test_a_call_cut_by_a_stop_string_or_max_tokens_is_a_call_streamed_or_not(server, llm):
    """A ``<tool_call>`` block the end of the output cuts off is reported as the call so far,
    whatever cut it and whatever the ``tool_choice``, the same streamed and not: a stream has sent
    the call's name and arguments by then. It used to be so only for a forced call cut by
    ``max_tokens``: a named call cut by a stop string came back as ``<tool_call>`` markup in
    ``content`` (finish ``stop``) while its stream had sent a call (finish ``tool_calls``); an
    ``auto`` call cut by ``max_tokens`` came back as markup while its stream sent a call and then
    the markup again as content."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    base = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], temperature=0)
    full = post(server, "/v1/chat/completions", {**base, "tool_choice": named, "max_tokens": 64})["choices"][0]
    assert full["finish_reason"] == "stop"  # a named tool_choice: OpenAI's and vLLM's "stop", not "tool_calls"
    ((name, args),) = calls_of(full["message"])
    assert name == "get_weather" and json.loads(args)["city"] == "Paris"
    cases = [  # (request, the arguments so far, finish reason)
        ({"tool_choice": named, "stop": ["Paris"], "parallel_tool_calls": False}, args[: args.index("Paris")], "stop"),
    ]
    # auto (a JSON format beside the tools): the model calls get_weather with the same arguments
    auto = {"response_format": {"type": "json_object"}}
    full_auto = post(server, "/v1/chat/completions", {**base, **auto, "max_tokens": 64})["choices"][0]
    assert full_auto["finish_reason"] == "tool_calls" and calls_of(full_auto["message"]) == [(name, args)]
    toks = llm.tokenizer.encode(args, add_special_tokens=False)
    head = llm.tokenizer.encode('<tool_call>\n{"name": "get_weather", "arguments": ', add_special_tokens=False)
    k = len(head) + 2  # two tokens into the arguments (the model writes them as the tokenizer splits them)
    cases.append(({**auto, "max_tokens": k}, llm.tokenizer.decode(toks[:2]), "length"))
    for extra, so_far, reason in cases:
        body = {**base, **extra}
        choice = post(server, "/v1/chat/completions", body)["choices"][0]
        assert choice["finish_reason"] == reason, extra
        assert choice["message"]["content"] is None, extra
        assert calls_of(choice["message"]) == [("get_weather", so_far)], extra
        assert 0 < len(so_far) < len(args) and args.startswith(so_far)
        joined = joined_chat_choice(stream(server, "/v1/chat/completions", body))
        assert joined == {"content": None, "calls": [("get_weather", so_far)], "finish": [reason]}, extra
    assert_pool_whole(llm)


def _literal_regex(text: str) -> str:
    """A regex matching exactly ``text`` (xgrammar's syntax: ``\\n`` for a newline)."""
    return "".join("\\n" if ch == "\n" else "\\" + ch if ch in "\\^$.|?*+()[]{}" else ch for ch in text)


def test_parallel_tool_calls_false_returns_only_the_first_of_two_calls_streamed_or_not(server, llm):
    """``parallel_tool_calls: false`` means at most one call (OpenAI's guarantee). ``auto``'s
    grammar stops after the first call, but a ``regex`` beside the tools (calls or text under it)
    lets the model write a second ``<tool_call>`` block: here the regex takes the model's own
    greedy two calls (those it writes with parallel calls allowed), ``min_tokens`` holding EOS
    off where the one-call grammar would end. Both came back as calls, streamed and not; now the first alone, as vLLM
    filters them. With parallel calls allowed (or unset), both."""
    weather = '{"name": "get_weather", "arguments": {\n    "city": "Paris",\n    "unit": "c"\n}}'
    first = f"<tool_call>\n{weather}\n</tool_call>"
    text = first + '<tool_call>\n{"name": "get_time", "arguments": {\n    "tz": "UTC"\n}}\n</tool_call>'
    base = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], temperature=0, max_tokens=96)
    base |= {"regex": _literal_regex(text), "min_tokens": len(llm.tokenizer.encode(first)) + 4}
    both = [("get_weather", '{\n    "city": "Paris",\n    "unit": "c"\n}'), ("get_time", '{\n    "tz": "UTC"\n}')]
    written = set()  # the output's tokens, joined
    for parallel, calls in ((True, both), (None, both), (False, both[:1])):
        body = dict(base) if parallel is None else {**base, "parallel_tool_calls": parallel}
        choice = post(server, "/v1/chat/completions", {**body, "logprobs": True})["choices"][0]
        assert (choice["finish_reason"], choice["message"]["content"]) == ("tool_calls", None), parallel
        assert calls_of(choice["message"]) == calls, parallel
        written.add("".join(t["token"] for t in choice["logprobs"]["content"]))
        joined = joined_chat_choice(stream(server, "/v1/chat/completions", body))
        assert joined == {"content": None, "calls": calls, "finish": ["tool_calls"]}, parallel
    assert written == {text + "<|im_end|>"}, written  # the model wrote both blocks every time, then EOS
    assert_pool_whole(llm)


def test_an_auto_output_ending_in_part_of_the_opening_tag_is_text():
    """Under ``auto`` the text before a call is free: ``<tool`` at the end of a cut output is text
    (streamed: held back, then sent as content); under a forced choice it is the call begun."""
    from radixkv.server.parsers.tool_calls import ToolCallStream, parse_tool_calls

    text = "<tool_ca"
    assert parse_tool_calls(text, ["get_weather"], partial_tag=False) == (text, [])
    s = ToolCallStream()
    events = s.update(text, False) + s.update(text, True, ["get_weather"], partial_tag=False)
    assert events == [("content", "<tool_ca")] and not s.cut_off
    content, (call,) = parse_tool_calls(text, ["get_weather"])
    assert content is None and (call.name, call.arguments, call.complete) == ("get_weather", "", False)
    s = ToolCallStream()
    events = s.update(text, False) + s.update(text, True, ["get_weather"])
    assert [e[0] for e in events] == ["call"] and events[0][3] == "get_weather" and s.cut_off


# ---------------------------------------------------------------------------------- fields a stream cannot honour


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions", {"prompt": "hi there"}),
    ],
)
def test_prompt_logprobs_with_stream_is_a_400_naming_it(server, path, body):
    """No chunk carries ``prompt_logprobs``: streamed, the field was dropped without a word (vLLM
    answers 400 too); unstreamed it is answered."""
    body = {"model": MODEL, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 1, **body}
    r = httpx.post(server.base_url + path, json={**body, "stream": True}, timeout=120)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"], err["type"]) == (
        "prompt_logprobs",
        "unsupported_parameter",
        "invalid_request_error",
    )
    assert "stream" in err["message"]
    whole = post(server, path, body)
    plp = whole["prompt_logprobs"] if path == "/v1/chat/completions" else whole["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == whole["usage"]["prompt_tokens"]


# ---------------------------------------------------------------------------------- speculative decoding


SCHEMA = {
    "type": "object",
    "$defs": {
        "pt": {
            "type": "object",
            "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
            "required": ["x", "y"],
            "additionalProperties": False,
        }
    },
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "a": {"$ref": "#/$defs/pt"},
        "b": {"type": "array", "items": {"$ref": "#/$defs/pt"}, "minItems": 1, "maxItems": 2},
    },
    "required": ["color", "a", "b"],
    "additionalProperties": False,
}
REWRITE = [{"role": "user", "content": 'Rewrite {"id": 7, "name": "Ada", "age": 36} with age 37, twice.'}]
REPEAT = [{"role": "user", "content": "Repeat exactly, three times: the quick brown fox jumps over the lazy dog."}]
SPEC_CASES = {
    "greedy, stop strings, logprobs": (
        "/v1/chat/completions",
        dict(messages=REPEAT, temperature=0, stop=["dog. The", "\n\n"], logprobs=True, top_logprobs=2),
    ),
    "seeded n=3, top-k/p, penalties, stop": (
        "/v1/chat/completions",
        dict(
            messages=REPEAT, temperature=0.8, seed=11, n=3, top_k=40, top_p=0.9, presence_penalty=0.5,
            frequency_penalty=0.3, repetition_penalty=1.1, stop=["lazy cat"], logprobs=True,
        ),
    ),
    "named call, parallel_tool_calls false": (
        "/v1/chat/completions",
        dict(messages=ASK, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}},
             parallel_tool_calls=False, temperature=0.7, seed=2),
    ),
    "json_schema strict, $defs, enum, nested array": (
        "/v1/chat/completions",
        dict(messages=REWRITE, temperature=0,
             response_format={"type": "json_schema", "json_schema": {"name": "p", "strict": True, "schema": SCHEMA}}),
    ),
    "logit_bias, min_tokens, stop": (
        "/v1/chat/completions",
        dict(messages=REWRITE, temperature=0, logit_bias={"28": -100, "30": 5}, min_tokens=12, stop=[","]),
    ),
    "completions: two prompts, n=2, echo, logprobs, stop": (
        "/v1/completions",
        dict(prompt=["The quick brown fox jumps over the lazy dog. The quick brown fox", "1, 2, 3, 4, 5, 6, 7,"], n=2,
             temperature=0.9, seed=4, echo=True, logprobs=2, stop=["lazy cat"]),
    ),
}  # fmt: skip


def comparable(body: dict) -> list:
    """The choices without their logprob values (compared to 1e-4 apart) and the usage."""
    out = []
    for c in body["choices"]:
        c = json.loads(json.dumps(c))
        for call in (c.get("message") or {}).get("tool_calls") or ():
            call.pop("id")
        lp = c.get("logprobs") or {}
        values = []
        for e in lp.get("content") or ():
            values.append(e.pop("logprob"))
            values += [t.pop("logprob") for t in e["top_logprobs"]]
        if "token_logprobs" in lp:
            values += [v for v in lp.pop("token_logprobs") if v is not None]
            values += [v for d in lp.pop("top_logprobs") if d for v in d.values()]
        out.append((c, values))
    return [out, body["usage"]]


@pytest.mark.parametrize("name", sorted(SPEC_CASES))
def test_a_speculative_server_answers_what_the_plain_one_answers(server, spec_server, spec_llm, name):
    """``--speculative-config`` changes no answer: each combination, greedy and seeded, gets the
    same choices (text, tool calls, finish reasons, logprob tokens; values to 1e-4), the same usage
    (cached tokens included: both caches flushed first)."""
    path, body = SPEC_CASES[name]
    body = {"model": MODEL, "max_tokens": 48, **body}
    for s in (server, spec_server):  # the same cache on both: the other tests ran on the plain one only
        assert httpx.post(s.base_url + "/flush_cache", timeout=60).status_code == 200
    before = spec_llm.cache_stats()["spec_accepted_tokens"]
    plain, spec = post(server, path, body), post(spec_server, path, body)
    assert spec_llm.cache_stats()["spec_accepted_tokens"] > before  # the answer came partly from drafts
    (want, usage), (got, spec_usage) = comparable(plain), comparable(spec)
    assert [c for c, _ in got] == [c for c, _ in want] and spec_usage == usage
    for (_, v), (_, w) in zip(got, want):
        assert v == pytest.approx(w, abs=1e-4)
    assert_pool_whole(spec_llm)


# ---------------------------------------------------------------------------------- schemas the grammar cannot hold


def test_a_schema_keyword_the_grammar_drops_is_a_400_naming_the_field_that_carried_it(server, llm):
    """``uniqueItems`` (and the other keywords xgrammar compiles into nothing,
    radixkv/sampling/schema_check.py) used to be accepted and then not obeyed: a strict
    ``response_format`` schema of distinct items in 0..2 got ``[1, 2, 2]`` from the model. Now each
    field that carries a schema answers 400 naming itself, the keyword and its path."""
    tags = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 2}, "uniqueItems": True}
    schema = {"type": "object", "properties": {"tags": tags}, "required": ["tags"], "additionalProperties": False}
    tool = {"type": "function", "function": {"name": "tag", "parameters": schema}}
    chat = {"model": MODEL, "messages": ASK, "max_tokens": 8}
    cases = [
        ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "t", "strict": True, "schema": schema}}}, "response_format"),
        ("/v1/chat/completions", {"tools": [tool], "tool_choice": "required"}, "tools"),
        ("/v1/chat/completions", {"tools": [tool]}, "tools"),
        ("/v1/completions", {"prompt": "Tags:", "guided_json": schema}, "guided_json"),
        ("/v1/completions", {"prompt": "Tags:", "structured_outputs": {"json": schema}}, "structured_outputs"),
        ("/v1/responses", {"input": "Tags?", "text": {"format": {"type": "json_schema", "name": "t", "schema": schema}}}, "text"),
    ]  # fmt: skip
    for path, extra, param in cases:
        body = {**chat, **extra} if path == "/v1/chat/completions" else {"model": MODEL, **extra}
        r = httpx.post(server.base_url + path, json=body, timeout=120)
        assert r.status_code == 400, (path, extra, r.text)
        err = r.json()["error"]
        assert err["param"] == param and err["type"] == "invalid_request_error", (param, err)
        assert "#/properties/tags/uniqueItems: uniqueItems is not enforced" in err["message"], err
    r = httpx.post(
        server.base_url + "/generate",
        json={"text": "Tags:", "sampling_params": {"max_new_tokens": 4, "json_schema": json.dumps(schema)}},
        timeout=120,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params.json_schema", r.text
    ok = {**schema, "properties": {"tags": {**tags, "uniqueItems": False}}}
    body = {**chat, "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": ok}}}
    assert post(server, "/v1/chat/completions", body)["choices"][0]["message"]["content"].startswith('{"tags": [')
    assert_pool_whole(llm)


def test_echo_with_more_logprobs_than_prompt_logprobs_keeps_prompt_logprobs_at_its_k(server, llm):
    """``echo`` + ``logprobs: 3`` asks the engine for 3 alternatives per prompt token; the
    choice's ``prompt_logprobs`` (asked with 1) used to carry all of them (4 entries a token, not
    the prompt token and 1 alternative as vLLM gives). It equals the answer without ``echo``."""
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 2, "temperature": 0}
    alone = post(server, "/v1/completions", {**body, "prompt_logprobs": 1})["choices"][0]["prompt_logprobs"]
    both = post(server, "/v1/completions", {**body, "prompt_logprobs": 1, "echo": True, "logprobs": 3})["choices"][0]
    ids = llm.tokenizer.encode(body["prompt"], add_special_tokens=False)
    assert alone[0] is None and len(alone) == len(ids)
    for i, entry in enumerate(alone[1:], 1):
        ranks = sorted(e["rank"] for t, e in entry.items() if int(t) != ids[i])
        assert str(ids[i]) in entry and ranks in ([1], []) and len(entry) == 1 + len(ranks)
    assert both["prompt_logprobs"] == alone
    assert all(len(d) in (3, 4) for d in both["logprobs"]["top_logprobs"][1 : len(ids)])  # echo's: logprobs=3


def test_echo_with_max_tokens_0_scores_the_prompt(server, llm):
    """``echo`` + ``max_tokens: 0`` + ``logprobs`` (what scoring clients such as lm-eval's
    loglikelihood send, as vLLM answers it) was a 400; it answers the prompt alone: its text, its
    tokens' logprobs (those of the same request with ``max_tokens: 1``), no completion token,
    finish ``"length"``; streamed joined equals it. Without ``echo``, 0 stays a 400."""
    prompts = ["The capital of France is Paris", "Water boils at 100 degrees"]
    body = {"model": MODEL, "prompt": prompts, "echo": True, "logprobs": 1, "temperature": 0}
    zero = post(server, "/v1/completions", {**body, "max_tokens": 0})
    one = post(server, "/v1/completions", {**body, "max_tokens": 1})
    for p, z, o in zip(prompts, zero["choices"], one["choices"]):
        n = len(llm.tokenizer.encode(p, add_special_tokens=False))
        assert z["text"] == p and z["finish_reason"] == "length"
        assert len(z["logprobs"]["tokens"]) == n and z["logprobs"]["token_logprobs"][0] is None
        for key in ("tokens", "token_logprobs", "text_offset"):
            assert z["logprobs"][key] == o["logprobs"][key][:n]
    assert zero["usage"]["completion_tokens"] == 0 and zero["usage"]["total_tokens"] == zero["usage"]["prompt_tokens"]
    joined = joined_completion_choices(stream(server, "/v1/completions", {**body, "max_tokens": 0}))
    assert [joined[i] for i in range(len(prompts))] == [
        {k: c[k] for k in ("text", "logprobs", "finish_reason")} for c in zero["choices"]
    ]
    bad = httpx.post(server.base_url + "/v1/completions", json={**body, "echo": False, "max_tokens": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    assert_pool_whole(llm)


@pytest.mark.parametrize("min_tokens", [1, 2])
def test_echo_with_max_tokens_0_and_min_tokens_is_a_400_naming_min_tokens(server, min_tokens):
    """Scoring (``echo`` + ``max_tokens: 0``) runs as ``max_tokens: 1`` inside: ``min_tokens: 1``
    was answered (its minimum silently ignored, no token generated) and ``min_tokens: 2`` was a 400
    saying ``max_tokens=1``, a value the client never sent. Both are a 400 naming ``min_tokens``
    and the ``max_tokens`` 0 the client sent."""
    body = {"model": MODEL, "prompt": "The cat sat", "echo": True, "max_tokens": 0, "min_tokens": min_tokens}
    r = httpx.post(server.base_url + "/v1/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "min_tokens" and "max_tokens=0" in err["message"]
    assert post(server, "/v1/completions", {**body, "min_tokens": 0})["choices"][0]["text"] == "The cat sat"


def test_vllm_include_stop_str_and_allowed_token_ids_are_obeyed_in_bodies(server, llm):
    """vLLM's body extensions ``include_stop_str_in_output`` and ``allowed_token_ids`` were a 400
    ``unknown_parameter`` (the engine had them, the server did not pass them): now the stop string
    stays in the text, streamed and not, and only the allowed ids are sampled."""
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}
    plain = post(server, "/v1/completions", body)["choices"][0]["text"]
    stop = plain.strip().split()[1]  # a word inside the greedy answer
    cut = plain[: plain.index(stop)]
    kept = post(server, "/v1/completions", {**body, "stop": [stop], "include_stop_str_in_output": True})
    assert kept["choices"][0]["text"] == cut + stop and kept["choices"][0]["finish_reason"] == "stop"
    dropped = post(server, "/v1/completions", {**body, "stop": [stop]})["choices"][0]["text"]
    assert dropped == cut
    chunks = stream(server, "/v1/completions", {**body, "stop": [stop], "include_stop_str_in_output": True})
    assert joined_completion_choices(chunks)[0]["text"] == cut + stop
    allowed = llm.tokenizer.encode(" Paris London Rome", add_special_tokens=False)
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": ASK, "max_tokens": 6, "temperature": 0,
                                              "allowed_token_ids": allowed, "logprobs": True})  # fmt: skip
    words = {llm.tokenizer.decode([i]) for i in allowed}  # " Paris", " London", " Rome"
    got = [t["token"] for t in r["choices"][0]["logprobs"]["content"]]
    assert len(got) == 6 and set(got) <= words and r["choices"][0]["message"]["content"] == "".join(got)
    assert_pool_whole(llm)


def test_tokenizing_a_prompt_never_holds_up_the_other_requests(server, llm, monkeypatch):
    """Prompts were tokenized on the server's event loop: a 5 MB prompt (refused after 7 s of
    tokenizing) stalled every tenant's requests, ``/v1/models`` included, that long; then in the
    loop's default executor, where eight such prompts took every thread and a small chat queued
    7 s behind them. A body over 32 KiB is now tokenized in a pool of its own, a small one at once:
    while big prompts' tokenizing is held, on every route, the server answers other requests and
    a small chat, and the held ones then get their answers."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    mark = "Zebra crossing seventeen"
    big = mark + " ok" * 12000  # a body over 32 KiB; past the context: a 400 once tokenized
    real = llm.tokenizer.encode
    entered, release = threading.Semaphore(0), threading.Event()

    def held(text, *a, **k):
        if isinstance(text, str) and mark in text:
            entered.release()
            assert release.wait(120)
        return real(text, *a, **k)

    def answered(r) -> bool:  # the held request's own answer
        return r.status_code == 200 or r.json()["error"]["code"] == "context_length_exceeded"

    monkeypatch.setattr(llm.tokenizer, "encode", held)
    bodies = {
        "/v1/completions": {"model": MODEL, "prompt": big, "max_tokens": 2},
        "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": big}], "max_tokens": 2},
        "/v1/responses": {"model": MODEL, "input": big, "max_output_tokens": 2, "store": False},
        "/generate": {"text": big, "sampling_params": {"max_new_tokens": 2}},
        "/tokenize": {"model": MODEL, "prompt": big},
    }
    small = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}
    with ThreadPoolExecutor(8) as pool:
        for path, body in bodies.items():
            release.clear()
            pending = pool.submit(httpx.post, server.base_url + path, json=body, timeout=300)
            assert entered.acquire(timeout=120), path
            assert httpx.get(server.base_url + "/v1/models", timeout=30).status_code == 200, path
            assert not pending.done(), path
            release.set()
            assert answered(pending.result()), (path, pending.result().text)
        release.clear()
        floods = [pool.submit(httpx.post, server.base_url + "/v1/completions", json=bodies["/v1/completions"],
                              timeout=300) for _ in range(7)]  # fmt: skip
        assert entered.acquire(timeout=120) and entered.acquire(timeout=120)  # two held, five queued
        assert httpx.post(server.base_url + "/v1/chat/completions", json=small, timeout=60).status_code == 200
        assert not any(f.done() for f in floods)
        release.set()
        assert all(answered(f.result()) for f in floods)
    assert_pool_whole(llm)
