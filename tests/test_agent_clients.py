"""Real agent clients against one real radixkv server (the default model on CPU, uvicorn on a free
127.0.0.1 port in a thread of this process): the ``openai`` SDK (forced and parsed tool calls,
streamed tool-call deltas, ``chat.completions.parse`` with a pydantic model, logprobs checked
against transformers), ``openai-agents`` (an Agent with a function tool through
``OpenAIChatCompletionsModel``), ``langchain-openai`` (``bind_tools``, ``with_structured_output``),
``litellm`` (tools, a pydantic ``response_format``) and ``dspy`` (``Predict`` with a typed
signature through its JSONAdapter).

Greedy decoding and small ``max_tokens`` keep the module short; everything a tool call produces
is checked against the function's JSON schema with the ``jsonschema`` package.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm: no cost-map download at import
os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")


from server_helpers import assert_pool_whole  # noqa: E402

from radixkv.async_llm import AsyncLLM  # noqa: E402
from radixkv.chat_template import encode_chat, render_chat  # noqa: E402
from radixkv.server.openai.logprobs import _unicode_to_byte  # noqa: E402
from radixkv.text import encode_text  # noqa: E402

pytestmark = pytest.mark.timeout(900)

MODEL = "smollm2-135m"
SYSTEM = "You are a helpful assistant. Use the tools when they help."

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city, e.g. Paris"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
_AUTO_CALL = r'<tool_call>\n\{"name": "add", "arguments": \{\n    "a": 8,\n    "b": 9\n\}\}\n</tool_call>'


class Person(BaseModel):
    name: str
    age: int = Field(ge=0, le=120)  # bounded: greedy, the tiny model would write 1000000... forever
    role: Literal["engineer", "doctor", "teacher"]


def ask(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def check_call(call, names=None) -> dict:
    """A parsed tool call: OpenAI's shape, a known function, arguments valid under its schema."""
    assert call.type == "function" and call.id.startswith("call_") and len(call.id) > 5
    assert call.function.name in (names or SCHEMAS)
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return args


def assert_idle(llm: AsyncLLM) -> None:
    assert_pool_whole(llm)  # waits for the engine too (an aborted stream frees its slots after)


# ---------------------------------------------------------------------------------- openai SDK


def test_openai_required_and_named_tool_calls(client, llm):
    r = client.chat.completions.create(
        model=MODEL, messages=ask("What is the weather in Paris?"), tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, temperature=0, max_tokens=64,
    )  # fmt: skip
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert len(choice.message.tool_calls) == 1
    check_call(choice.message.tool_calls[0])
    # a response_format beside a forced call (openai-agents' output_type): the calls, unchanged
    place = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": place}}
    typed = client.chat.completions.create(
        model=MODEL, messages=ask("What is the weather in Paris?"), tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, temperature=0, max_tokens=64, response_format=fmt,
    )  # fmt: skip
    assert typed.choices[0].finish_reason == "tool_calls"
    same = [(c.function.name, c.function.arguments) for c in typed.choices[0].message.tool_calls]
    assert same == [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    # named: this function, whatever the question
    r = client.chat.completions.create(
        model=MODEL, messages=ask("What is 2 plus 3?"), tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "add"}}, temperature=0, max_tokens=64,
    )  # fmt: skip
    (call,) = r.choices[0].message.tool_calls
    # a named tool_choice finishes "stop" (OpenAI's answer, and vLLM's), "required" "tool_calls"
    assert call.function.name == "add" and r.choices[0].finish_reason == "stop"
    check_call(call, ["add"])
    # required with parallel calls allowed, sampled: every call is valid
    r = client.chat.completions.create(
        model=MODEL, messages=ask("Weather in Rome and in Oslo?"), tools=TOOLS, tool_choice="required",
        temperature=1.0, seed=5, max_tokens=160, n=2,
    )  # fmt: skip
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            check_call(call)
    assert_idle(llm)


def test_openai_streamed_tool_call_deltas_reassemble_to_the_same_call(client, llm):
    kwargs = dict(
        model=MODEL, messages=ask("What is the weather in Berlin?"), tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=0, max_tokens=64,
    )  # fmt: skip
    plain = client.chat.completions.create(**kwargs)
    (want,) = plain.choices[0].message.tool_calls
    chunks = [c.choices[0] for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
    deltas = [c.delta for c in chunks]
    # named tool_choice: "stop", streamed as not (OpenAI's and vLLM's answer)
    assert [c.finish_reason for c in chunks if c.finish_reason] == ["stop"] == [plain.choices[0].finish_reason]
    parts = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert len(parts) >= 2  # a first delta with id and name, then argument fragments
    first, rest = parts[0], parts[1:]
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function"
    assert first.function.name == "get_weather"
    assert all(p.index == 0 and p.id is None and p.function.name is None for p in rest)
    arguments = (first.function.arguments or "") + "".join(p.function.arguments or "" for p in rest)
    assert arguments == want.function.arguments  # greedy: the same call as the non-streamed one
    check_call(want)
    # the SDK's own stream accumulator builds the same message
    with client.chat.completions.stream(**kwargs) as stream:
        final = stream.get_final_completion()
    (got,) = final.choices[0].message.tool_calls
    assert (got.function.name, got.function.arguments) == (want.function.name, want.function.arguments)
    # a forced call has no text: no delta carries content (OpenAI's first delta has `content: null`), and the
    # accumulated message's content is None, as the non-streamed one's
    assert deltas[0].role == "assistant" and all(d.content is None for d in deltas)
    assert plain.choices[0].message.content is None and final.choices[0].message.content is None
    assert_idle(llm)


def _cut_at(tokens: list[str], pos: int, more: int) -> int:
    """How many of ``tokens`` (the texts of a greedy output's tokens) reach past character ``pos``
    of their joined text, plus ``more``."""
    end = 0
    for i, t in enumerate(tokens):
        end += len(t)
        if end > pos:
            return i + 1 + more
    raise AssertionError(f"the output ends before character {pos}")


def test_a_forced_call_cut_by_max_tokens_is_still_a_call(client, llm):
    """As OpenAI and vLLM report a forced call whatever the finish reason: cut by ``max_tokens``
    it is ``tool_calls`` (the function's name, ``arguments`` the JSON text generated so far) with
    finish reason ``length``, not ``<tool_call>`` markup in ``content``; streamed and not, and as
    a Responses ``function_call`` item (status ``incomplete``)."""
    kwargs = dict(
        model=MODEL, messages=ask("What is the weather in Berlin?"), tools=TOOLS, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )  # fmt: skip
    full = client.chat.completions.create(max_tokens=64, logprobs=True, **kwargs).choices[0]
    (want,) = full.message.tool_calls
    tokens = [t.token for t in full.logprobs.content]
    raw = "".join(tokens)  # the output: <tool_call>\n{"name": "get_weather", "arguments": {...}}\n</tool_call>
    assert raw.startswith("<tool_call>") and want.function.arguments in raw
    args_at = raw.index(want.function.arguments)
    k = _cut_at(tokens, args_at, 2)  # two tokens into the arguments
    expected = raw[args_at : len("".join(tokens[:k]))]
    assert 0 < len(expected) < len(want.function.arguments)

    cut = client.chat.completions.create(max_tokens=k, **kwargs).choices[0]
    assert cut.finish_reason == "length" and cut.message.content is None
    (call,) = cut.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert (call.function.name, call.function.arguments) == ("get_weather", expected)
    assert want.function.arguments.startswith(call.function.arguments)

    chunks = [c.choices[0] for c in client.chat.completions.create(max_tokens=k, stream=True, **kwargs) if c.choices]
    assert [c.finish_reason for c in chunks if c.finish_reason] == ["length"]
    assert not any(c.delta.content for c in chunks)  # no markup as content
    parts = [tc for c in chunks for tc in (c.delta.tool_calls or [])]
    assert parts[0].function.name == "get_weather" and all(p.index == 0 for p in parts)
    assert "".join(p.function.arguments or "" for p in parts) == expected

    # cut inside the opening tag: the call is there, with no arguments yet; required with one
    # tool: its name
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        early = client.chat.completions.create(max_tokens=2, **dict(kwargs, tools=[WEATHER], tool_choice=choice))
        early = early.choices[0]
        assert early.finish_reason == "length" and early.message.content is None
        assert [(c.function.name, c.function.arguments) for c in early.message.tool_calls] == [("get_weather", "")]

    # the Responses API: a function_call item, incomplete
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    r = client.responses.create(
        model=MODEL, input=kwargs["messages"][1:], instructions=SYSTEM, tools=tools,
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=k, temperature=0,
    )  # fmt: skip
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    (item,) = r.output
    assert item.type == "function_call" and item.status == "incomplete"
    assert (item.name, item.arguments) == ("get_weather", expected)
    client.responses.delete(r.id)
    assert_idle(llm)


def test_openai_auto_tool_calls_are_parsed_from_the_output(client, llm):
    """``auto``: the model's text is parsed; the tiny model rarely calls on its own, so a regex on
    the same request makes it write content and a call in the built-in format."""
    forced = r'Let me check\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Lyon", "unit": "celsius"\}\}\n</tool_call>'
    kwargs = dict(model=MODEL, messages=ask("Weather in Lyon?"), tools=TOOLS, tool_choice="auto", temperature=0,
                  max_tokens=64, extra_body={"regex": forced})  # fmt: skip
    r = client.chat.completions.create(**kwargs)
    msg = r.choices[0].message
    assert msg.content == "Let me check." and r.choices[0].finish_reason == "tool_calls"
    (call,) = msg.tool_calls
    assert check_call(call) == {"city": "Lyon", "unit": "celsius"}
    chunks = [c.choices[0] for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
    content = "".join(c.delta.content or "" for c in chunks)
    assert content == "Let me check."  # nothing of the tag leaked into the content
    calls = [tc for c in chunks for tc in (c.delta.tool_calls or [])]
    assert calls[0].function.name == "get_weather"
    assert "".join(tc.function.arguments or "" for tc in calls) == call.function.arguments
    assert chunks[-1].finish_reason == "tool_calls"
    # tool_choice none: the same text stays text
    r = client.chat.completions.create(**{**kwargs, "tool_choice": "none"})
    assert r.choices[0].message.tool_calls is None and "<tool_call>" in r.choices[0].message.content
    assert_idle(llm)


def test_openai_stream_helper_accumulates_an_auto_call_without_text_to_the_same_message(client, llm):
    """``auto`` output that is only a call: the non-streamed message has ``content`` None; the SDK's
    stream accumulator (``chat.completions.stream`` ... ``get_final_completion()``) must build the
    same message. The first delta used to carry ``content: ""`` whenever the choice was not forced,
    so the accumulated message had ``content`` '' beside its call."""
    only_call = r'<tool_call>\n\{"name": "add", "arguments": \{"a": 2, "b": 3\}\}\n</tool_call>'
    kwargs = dict(model=MODEL, messages=ask("What is 2 plus 3?"), tools=TOOLS, tool_choice="auto", temperature=0,
                  max_tokens=64, extra_body={"regex": only_call})  # fmt: skip
    plain = client.chat.completions.create(**kwargs).choices[0]
    assert plain.finish_reason == "tool_calls" and plain.message.content is None
    (want,) = plain.message.tool_calls
    assert check_call(want, ["add"]) == {"a": 2, "b": 3}
    with client.chat.completions.stream(**kwargs) as stream:
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and final.message.content is None
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == [
        ("add", want.function.arguments)
    ]
    # neither text nor a call (the end of turn first): content '' streamed or not
    eos = llm.tokenizer.convert_tokens_to_ids("<|im_end|>")
    empty = dict(kwargs, max_tokens=4, logit_bias={str(eos): 100}, extra_body=None)
    assert client.chat.completions.create(**empty).choices[0].message.content == ""
    with client.chat.completions.stream(**empty) as stream:
        final = stream.get_final_completion().choices[0]
    assert (final.message.content, final.message.tool_calls, final.finish_reason) == ("", None, "stop")
    # text beside the tools, no call: the accumulated content is the text, as the non-streamed one's
    text = dict(kwargs, messages=ask("Name three colors."), max_tokens=12, extra_body=None)
    want = client.chat.completions.create(**text).choices[0]
    assert want.message.tool_calls is None and want.message.content and want.finish_reason == "length"
    with client.chat.completions.stream(**text) as stream:
        for _ in stream:
            pass
        final = stream.current_completion_snapshot.choices[0]  # get_final_completion() raises at "length"
    assert (final.message.content, final.message.tool_calls, final.finish_reason) == (
        want.message.content,
        None,
        "length",
    )
    assert_idle(llm)


def _reply_ids(choice, tokenizer) -> list[int]:
    """The token ids of a reply, from its logprobs' bytes (SmolLM2's byte-level vocabulary)."""
    to_char = {b: ch for ch, b in _unicode_to_byte().items()}
    return [tokenizer.convert_tokens_to_ids("".join(to_char[b] for b in t.bytes)) for t in choice.logprobs.content]


def _common(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _tool_loop(client, llm, question: str, **turn1) -> tuple[int, int, int, bool]:
    """Turn 1 (a reply with calls), then turn 2 with the reply and the results appended, as an
    agent sends it: (turn 2's cached tokens, the most a text prompt can reuse, turn 1's prompt +
    reply - 1, whether turn 2's text holds turn 1's and the reply's verbatim). The engine caches
    turn 1's prompt and its reply but the last token (its K/V is never computed); the reply's
    text encoded afresh may split differently from the model's own tokens (the model writes "g"
    "et" where the tokenizer writes "get"), and no text rendering can reuse beyond that."""
    tok, messages = llm.tokenizer, ask(question)
    r1 = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=64, logprobs=True, **turn1
    )
    choice = r1.choices[0]
    ids1, out = encode_chat(tok, messages, tools=TOOLS), _reply_ids(choice, tok)
    assert choice.message.tool_calls and out[-1] == tok.convert_tokens_to_ids("<|im_end|>")
    assert len(ids1) == r1.usage.prompt_tokens and len(out) == r1.usage.completion_tokens
    messages = messages + [choice.message.model_dump(exclude_none=True)]
    messages += [{"role": "tool", "tool_call_id": c.id, "content": '{"result": 21}'} for c in choice.message.tool_calls]
    r2 = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=2)
    # turn 2 renders the reply's text as the model wrote it, and its prompt extends turn 1's
    text1, reply = render_chat(tok, ask(question), tools=TOOLS), tok.decode(out[:-1])
    verbatim = render_chat(tok, messages, tools=TOOLS).startswith(text1 + reply + "<|im_end|>")
    best = _common(ids1 + out[:-1], encode_text(tok, text1 + reply, "messages", "turn 1"))
    ids2 = encode_chat(tok, messages, tools=TOOLS)
    assert ids2[: len(ids1)] == ids1 and len(ids2) == r2.usage.prompt_tokens
    return r2.usage.prompt_tokens_details.cached_tokens, best, len(ids1) + len(out) - 1, verbatim


@pytest.mark.parametrize(
    "question, turn1",
    [
        ("What is the weather in Madrid?", dict(tool_choice="required", parallel_tool_calls=False)),
        ("What is 4 plus 5?", dict(tool_choice="required")),
        ("What is 6 plus 7?", dict(tool_choice={"type": "function", "function": {"name": "add"}})),
        # auto: the tiny model does not call on its own, so a regex makes it write a call (the
        # parser reads free text), its arguments spaced as the call grammar lets the model space them
        ("What is 8 plus 9?", dict(tool_choice="auto", extra_body={"regex": _AUTO_CALL})),
    ],
)
def test_openai_tool_loop_extends_the_prompt_and_hits_the_cache(client, llm, question, turn1):
    """Turn 2 of a tool loop reuses all of turn 1 that a text prompt can: the prompt and the
    reply's tokens. The call arguments the model wrote (indented, under the call grammar) were
    re-rendered as json.dumps writes them, so turn 2 diverged inside the arguments and
    recomputed the rest of the reply (the "add" call: 331 of 346 cached)."""
    cached, best, possible, verbatim = _tool_loop(client, llm, question, **turn1)
    print(f"tool loop {question!r}: turn 2 cached {cached}; text can reuse {best} of {possible}")
    assert cached == best > possible - 40  # the reply's first tokens at least (the call's head)
    assert verbatim  # turn 2 writes the reply as the model wrote it
    assert_idle(llm)


def test_openai_parse_with_a_pydantic_model_is_valid_for_every_seed(server, llm):
    aclient = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)

    async def one(seed: int):
        r = await aclient.chat.completions.parse(
            model=MODEL, messages=ask("Invent a person: a name, an age and a job."), response_format=Person,
            temperature=1.0, seed=seed, max_tokens=96,
        )  # fmt: skip
        return r.choices[0]

    async def all_seeds():
        try:
            return await asyncio.gather(*(one(s) for s in range(10)))  # batched together by the engine
        finally:
            await aclient.close()

    for choice in asyncio.run(all_seeds()):
        assert choice.finish_reason == "stop", choice
        assert isinstance(choice.message.parsed, Person), choice.message.content
    assert_idle(llm)


def _reference_logprobs(hf_default, prompt_ids: list[int], output_ids: list[int]):
    """float64 log-softmax of transformers' logits at each output position."""
    import torch

    ids = torch.tensor([prompt_ids + output_ids])
    with torch.no_grad():
        logits = hf_default(ids).logits[0].double()
    return logits.log_softmax(-1)[len(prompt_ids) - 1 : len(prompt_ids) + len(output_ids) - 1]


def test_openai_logprobs_match_transformers(client, llm, hf_default):
    tok = llm.tokenizer
    messages = ask("Name a color.")
    r = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=8, logprobs=True, top_logprobs=5
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    out_ids = [_token_id(tok, bytes(e.bytes)) for e in content]  # the generated ids, from their bytes
    prompt_ids = encode_chat(tok, messages)
    ref = _reference_logprobs(hf_default, prompt_ids, out_ids)
    for j, entry in enumerate(content):
        assert entry.logprob == pytest.approx(ref[j, out_ids[j]].item(), abs=1e-4)
        top_vals, top_ids = ref[j].topk(5)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(top_vals.tolist(), abs=1e-4)
        assert [_token_id(tok, bytes(t.bytes)) for t in entry.top_logprobs] == top_ids.tolist()
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy: the top token
    # every generated token has an entry, the end-of-turn token that stopped it included
    texts = [e.token for e in content]
    if r.choices[0].finish_reason == "stop":
        assert out_ids[-1] == tok.eos_token_id and texts[-1] == tok.decode([out_ids[-1]])
        texts = texts[:-1]
    assert "".join(texts) == r.choices[0].message.content
    # streamed: the same entries, chunk by chunk
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=8, logprobs=True, top_logprobs=5, stream=True
    )
    streamed = [e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    # (this request's prompt came from the prefix cache, a different float path: equal to 1e-4)
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-4)
    # completions: logprobs=3, non-streamed and streamed, and echo with the prompt's own logprobs
    prompt = "The capital of France is"
    p_ids = tok.encode(prompt, add_special_tokens=False)
    c = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=5, logprobs=3)
    lp = c.choices[0].logprobs
    c_ids = tok.encode(c.choices[0].text, add_special_tokens=False)
    assert [tok.decode([i]) for i in c_ids] == lp.tokens  # the text re-encodes to the generated tokens
    ref = _reference_logprobs(hf_default, p_ids, c_ids)
    assert len(lp.tokens) == len(c_ids) == c.usage.completion_tokens
    for j in range(len(c_ids)):
        assert lp.token_logprobs[j] == pytest.approx(ref[j, c_ids[j]].item(), abs=1e-4)
        assert len(lp.top_logprobs[j]) == 3  # the greedy token is the top one
        assert sorted(lp.top_logprobs[j].values(), reverse=True) == pytest.approx(
            ref[j].topk(3).values.tolist(), abs=1e-4
        )
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:j]) for j in range(len(lp.tokens))]
    s = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=5, logprobs=3, stream=True)
    s_tokens = [(t, v) for ch in s if ch.choices and ch.choices[0].logprobs
                for t, v in zip(ch.choices[0].logprobs.tokens, ch.choices[0].logprobs.token_logprobs)]  # fmt: skip
    assert [t for t, _ in s_tokens] == lp.tokens
    assert [v for _, v in s_tokens] == pytest.approx(lp.token_logprobs, abs=1e-4)
    e = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=2, logprobs=1, echo=True)
    elp = e.choices[0].logprobs
    assert e.choices[0].text.startswith(prompt) and elp.token_logprobs[0] is None
    ref_p = _reference_logprobs(hf_default, p_ids[:1], p_ids[1:])
    for j in range(1, len(p_ids)):
        assert elp.token_logprobs[j] == pytest.approx(ref_p[j - 1, p_ids[j]].item(), abs=1e-4)
    assert_idle(llm)


def _token_id(tok, raw: bytes) -> int:
    """The byte-level BPE token whose bytes are ``raw`` (GPT-2's byte-to-unicode table, as
    transformers has it)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    table = bytes_to_unicode()
    tid = tok.convert_tokens_to_ids("".join(table[b] for b in raw))
    assert tid is not None and tid != tok.unk_token_id, raw
    return tid


# ---------------------------------------------------------------------------------- openai-agents


def test_openai_agents_function_tool_runs_and_the_run_ends(server, llm):
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        RunConfig,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    seen: list[dict] = []

    @function_tool
    def get_weather(city: str, unit: Literal["celsius", "fahrenheit"]) -> str:
        """Get the current weather in a city.

        Args:
            city: The city, e.g. Paris.
            unit: The temperature unit.
        """
        seen.append({"city": city, "unit": unit})
        return f"It is sunny and 21 degrees {unit} in {city}."

    aclient = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    agent = Agent(
        name="weather",
        instructions=SYSTEM,
        tools=[get_weather],
        model=OpenAIChatCompletionsModel(model=MODEL, openai_client=aclient),
        model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=64),
        # tool_choice "required" forces a call on every turn, so the agent would loop; stopping on
        # the first tool's result makes that result the run's final output
        tool_use_behavior="stop_on_first_tool",
    )

    # output_type: the agent's final output is a parsed Person (a json_schema response_format)
    typed = Agent(
        name="inventor",
        instructions="Invent a person.",
        model=OpenAIChatCompletionsModel(model=MODEL, openai_client=aclient),
        model_settings=ModelSettings(temperature=0, max_tokens=96),
        output_type=Person,
    )

    async def run():
        try:
            config = RunConfig(tracing_disabled=True)
            tool_run = await Runner.run(agent, "What is the weather in Paris?", max_turns=3, run_config=config)
            typed_run = await Runner.run(typed, "Invent a person with a name, age and job.", run_config=config)
            return tool_run, typed_run
        finally:
            await aclient.close()

    result, typed_result = asyncio.run(run())
    assert len(seen) == 1 and seen[0]["unit"] in ("celsius", "fahrenheit") and seen[0]["city"]
    assert result.final_output == f"It is sunny and 21 degrees {seen[0]['unit']} in {seen[0]['city']}."
    assert isinstance(typed_result.final_output, Person)
    assert_idle(llm)


# ---------------------------------------------------------------------------------- langchain-openai


def test_langchain_bind_tools_and_structured_output(server, llm):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    chat = ChatOpenAI(model=MODEL, base_url=server.base_url + "/v1", api_key="unused", temperature=0, max_tokens=64,
                      max_retries=0)  # fmt: skip
    msg = chat.bind_tools([add], tool_choice="required").invoke("What is 2 plus 3?")
    (call,) = msg.tool_calls
    assert call["name"] == "add" and call["id"].startswith("call_")
    jsonschema.validate(call["args"], SCHEMAS["add"])
    assert add.invoke(call["args"]) == call["args"]["a"] + call["args"]["b"]
    for method in ("json_schema", "function_calling"):
        person = chat.with_structured_output(Person, method=method).invoke("Invent a person with a name, age and job.")
        assert isinstance(person, Person), (method, person)
    assert_idle(llm)


# ---------------------------------------------------------------------------------- litellm


def test_litellm_tools_and_pydantic_response_format(server, llm):
    import litellm

    litellm.telemetry = False
    common = dict(model=f"openai/{MODEL}", api_base=server.base_url + "/v1", api_key="unused", temperature=0,
                  max_tokens=64)  # fmt: skip
    r = litellm.completion(messages=ask("What is the weather in Tokyo?"), tools=TOOLS, tool_choice="required", **common)
    assert r.choices[0].finish_reason == "tool_calls"
    for call in r.choices[0].message.tool_calls:
        assert call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    r = litellm.completion(messages=ask("Invent a person with a name, age and job."), response_format=Person, **common)
    Person.model_validate_json(r.choices[0].message.content)
    assert_idle(llm)


# ---------------------------------------------------------------------------------- dspy


def test_dspy_predict_with_a_typed_signature(server, llm):
    """dspy's ``Predict`` with a typed signature, through its JSONAdapter: radixkv is declared to
    dspy as an OpenAI-compatible provider that honours JSON schemas (dspy's documented
    ``register_provider``), so the adapter sends the signature's output fields as a
    ``json_schema`` response_format and the constrained output parses into the typed field."""
    import dspy
    from dspy.lm15 import (
        AccessPolicy,
        ModelSupport,
        OpenAIChatCompat,
        ProviderDefinition,
        register_provider,
        unregister_provider,
    )

    base = server.base_url + "/v1"
    access = AccessPolicy(provider="radixkv", base_url=base)
    register_provider(
        ProviderDefinition.chat(access, compat=OpenAIChatCompat.preset("vllm")),
        supports=ModelSupport(response_schema=True, function_calling=True),
        replace=True,
    )
    try:
        lm = dspy.LM(f"radixkv/{MODEL}", api_base=base, api_key="unused", temperature=0, max_tokens=128, cache=False,
                     num_retries=0)  # fmt: skip

        class Invent(dspy.Signature):
            """Invent a person who fits the description."""

            description: str = dspy.InputField()
            person: Person = dspy.OutputField()
            confident: bool = dspy.OutputField()

        with dspy.context(lm=lm, adapter=dspy.JSONAdapter()):
            pred = dspy.Predict(Invent)(description="an engineer in her thirties")
        assert isinstance(pred.person, Person), pred
        assert isinstance(pred.confident, bool), pred
        (call,) = lm.history
        fmt = call["kwargs"]["response_format"]  # the signature's outputs as a pydantic model, not JSON mode
        assert isinstance(fmt, type) and issubclass(fmt, BaseModel), fmt
        assert set(fmt.model_fields) == {"person", "confident"}, fmt.model_fields
    finally:
        unregister_provider("radixkv")
    assert_idle(llm)
