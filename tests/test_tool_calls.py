"""Tool calls without a server: the built-in (Hermes / Qwen) rendering of tools, calls and results
in radixkv.chat_template (with the default model's template, which has no tools section, and a
template that takes tools), the parser of radixkv.server.parsers.tool_calls (whole and streamed
in every split), and the structural tag of forced calls checked with xgrammar's matcher on the
default model's tokenizer."""

from __future__ import annotations

import copy
import json
import re

import pytest
import xgrammar
from hypothesis import given, settings
from hypothesis import strategies as st

from radixkv.chat_template import (
    builtin_tools_block,
    encode_chat,
    format_tool_call,
    render_chat,
    template_takes_tools,
)
from radixkv.errors import RequestError
from radixkv.server.openai.params import auto_calls, forced_calls
from radixkv.server.parsers.tool_calls import ToolCallStream, parse_tool_calls

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
NOARGS = {"type": "function", "function": {"name": "now"}}


@pytest.fixture(scope="module")
def tok(default_model):
    return default_model.tokenizer


# ---------------------------------------------------------------------------------- rendering


def test_smollm2_template_takes_no_tools_so_the_builtin_block_is_rendered(tok):
    assert template_takes_tools(tok) is False
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"}]
    text = render_chat(tok, conv, tools=[WEATHER])
    sig = json.dumps({"type": "function", "function": WEATHER["function"]})
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n") and f"<tools>\n{sig}\n</tools>" in text
    assert text.endswith("<|im_start|>user\nWeather in Oslo?<|im_end|>\n<|im_start|>assistant\n")
    assert builtin_tools_block([WEATHER]) in text
    # no system message: the block is one; no tools: the plain template text, unchanged
    assert render_chat(tok, conv[1:], tools=[WEATHER]).startswith("<|im_start|>system\n# Tools\n")
    assert render_chat(tok, conv, tools=[]) == tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)


def test_tool_history_is_rendered_deterministically_and_extends_the_previous_turn(tok):
    turn1 = [{"role": "user", "content": "Weather in Oslo and Rome?"}]
    calls = [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo", "days":1}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome", "days": 2}'}},
    ]  # fmt: skip
    turn2 = turn1 + [
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_1", "content": "cold"},
        {"role": "tool", "tool_call_id": "call_2", "content": "warm"},
    ]
    text = render_chat(tok, turn2, tools=[WEATHER])
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city":"Oslo", "days":1}}\n'
        '</tool_call><tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}\n</tool_call>'
        "<|im_end|>\n<|im_start|>user\n<tool_response>\ncold\n</tool_response>\n<tool_response>\nwarm\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    ) in text
    ids1, ids2 = encode_chat(tok, turn1, tools=[WEATHER]), encode_chat(tok, turn2, tools=[WEATHER])
    assert ids2[: len(ids1)] == ids1  # turn 2's prompt extends turn 1's: a prefix-cache hit
    assert encode_chat(tok, copy.deepcopy(turn2), tools=copy.deepcopy([WEATHER])) == ids2
    # arguments' JSON text is rendered as sent (the model's own text, which the server returned)
    spaced = copy.deepcopy(turn2)
    spaced[1]["tool_calls"][0]["function"]["arguments"] = '{ "city" : "Oslo" ,"days":1 }'
    assert '{"name": "get_weather", "arguments": { "city" : "Oslo" ,"days":1 }}' in render_chat(tok, spaced)
    # a value is written by json.dumps, text that is not JSON as a JSON string
    assert (
        format_tool_call("f", {"a": [1, "é"]})
        == '<tool_call>\n{"name": "f", "arguments": {"a": [1, "é"]}}\n</tool_call>'
    )
    assert format_tool_call("f", "{oops") == '<tool_call>\n{"name": "f", "arguments": "{oops"}\n</tool_call>'
    assert format_tool_call("f", None) == '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'


@pytest.mark.parametrize(
    "arguments",
    ['{\n    "city": "Oslo",\n    "days": 1\n}', '{"city":"Zürich","days":2}', '{ "city": "a\\"b}" , "days": 10 }'],
)
def test_a_call_sent_back_renders_the_tokens_the_model_generated(tok, arguments):
    """A tool loop's turn 2 must extend turn 1's prompt plus the reply's tokens (all cached but
    the end of turn, whose K/V is never computed). The arguments the grammar let the model write
    (SmolLM2 writes them indented) were re-serialized as json.dumps does, so turn 2 diverged from
    the reply inside the arguments and recomputed the rest of it (tests/test_agent_clients.py: 331
    of the 346 tokens a text prompt can reuse)."""
    turn1 = [{"role": "user", "content": "Weather in Oslo?"}]
    reply = f'Checking.\n<tool_call>\n{{"name": "get_weather", "arguments": {arguments}}}\n</tool_call>'
    content, (call,) = parse_tool_calls(reply)
    assert call.arguments == arguments  # the model's own text, byte for byte
    msg = {"role": "assistant", "content": content, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]}  # fmt: skip
    turn2 = turn1 + [msg, {"role": "tool", "tool_call_id": call.id, "content": "cold"}]
    generated = encode_chat(tok, turn1, tools=[WEATHER]) + tok.encode(reply, add_special_tokens=False)
    ids2 = encode_chat(tok, turn2, tools=[WEATHER])
    assert ids2[: len(generated)] == generated and ids2[len(generated)] == tok.convert_tokens_to_ids("<|im_end|>")


def test_a_template_that_takes_tools_renders_them_itself(tok):
    t = copy.copy(tok)
    own = tok.chat_template
    t.chat_template = (
        "{% if tools %}TOOLS:{% for x in tools %}{{ x.function.name }};{% endfor %}{{ '\\n' }}{% endif %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}"
        "{% for c in m.tool_calls or [] %}[call {{ c.function.name }} {{ c.function.arguments.city }}]{% endfor %}"
        "{{ '\\n' }}{% endfor %}"
    )
    assert tok.chat_template == own
    assert template_takes_tools(t) is True and template_takes_tools(tok) is False
    conv = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                               "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c", "content": "cold"},
    ]  # fmt: skip
    # arguments reach the template as a dict (transformers' convention); tool results stay tool turns
    assert render_chat(t, conv, tools=[WEATHER, NOARGS]) == (
        "TOOLS:get_weather;now;\nuser: hi\nassistant: [call get_weather Oslo]\ntool: cold\n"
    )


def test_a_chat_template_argument_is_the_one_probed_for_tools(tok):
    """vLLM's ``LLM.chat(chat_template=...)`` with tools: the given template is asked whether it
    takes tools, not the model's. Before, a template rendering tools got ``tools`` None and the
    built-in block as a system message (the template's own tool format silently not used); with a
    model template taking tools, a given template without them got the tools and dropped them."""
    takes = "{% if tools %}TOOLS:{% for x in tools %}{{ x.function.name }};{% endfor %}{% endif %}" + (
        "{% for m in messages %}|{{ m.role }}: {{ m.content }}{% endfor %}"
    )
    user = [{"role": "user", "content": "hi"}]
    assert render_chat(tok, user, tools=[WEATHER, NOARGS], chat_template=takes) == "TOOLS:get_weather;now;|user: hi"
    assert template_takes_tools(tok, takes) is True and template_takes_tools(tok) is False
    t = copy.copy(tok)
    t.chat_template = takes
    plain = "{% for m in messages %}|{{ m.role }}: {{ m.content }}{% endfor %}"
    text = render_chat(t, user, tools=[WEATHER], chat_template=plain)
    assert text == f"|system: {builtin_tools_block([WEATHER])}|user: hi"


def test_render_errors_name_the_field(tok):
    with pytest.raises(RequestError) as e:
        render_chat(tok, [{"role": "user", "content": "x"}], tools=[{"type": "function", "function": {}}])
    assert e.value.param == "tools"
    with pytest.raises(RequestError) as e:
        render_chat(tok, [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}])
    assert e.value.param == "messages"
    with pytest.raises(RequestError) as e:
        render_chat(tok, [{"role": "user"}])
    assert e.value.param == "messages"


def test_an_assistant_refusal_renders_as_the_server_renders_it(tok):
    # LLM.chat (and every Python caller of render_chat) dropped a refusal: a response message sent back as
    # {"content": None, "refusal": ...} became an empty assistant turn, where the server renders its text, so
    # the one conversation gave two prompts (and missed the cache the other door filled)
    from radixkv.server.openai.protocol import ChatMessage

    user = {"role": "user", "content": "hi"}
    said = encode_chat(tok, [user, {"role": "assistant", "content": "I cannot."}, user])
    for refused in ({"content": None, "refusal": "I cannot."}, {"content": "", "refusal": "I cannot."}):
        conv = [user, {"role": "assistant", **refused}, user]
        assert encode_chat(tok, conv) == said
        assert encode_chat(tok, [ChatMessage(**m).to_template() for m in conv]) == said  # the server's door
    assert encode_chat(tok, [user, {"role": "assistant", "content": "I cannot.", "refusal": ""}, user]) == said
    for bad, says in (
        ({"role": "assistant", "content": "ok", "refusal": "no"}, "not both"),
        ({"role": "user", "content": "ok", "refusal": "no"}, "messages[1].refusal"),
    ):
        with pytest.raises(RequestError, match=re.escape(says)) as e:
            render_chat(tok, [user, bad, user])
        assert e.value.param == "messages"


def test_text_parts_are_joined_by_newlines_as_vllm_joins_them(tok):
    # they ran together ("Hello" + "world" rendered "Helloworld"); vLLM joins a message's text parts with "\n"
    from radixkv.server.openai.responses_protocol import input_messages

    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
    joined = [{"role": "user", "content": "Hello\nworld"}]
    assert render_chat(tok, [{"role": "user", "content": parts}]) == render_chat(tok, joined)
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Hello"}, {"type": "input_text", "text": "world"}]}
    ]
    assert [m["content"] for m in input_messages(items, [])] == ["Hello\nworld"]  # Responses input alike


# ---------------------------------------------------------------------------------- parsing

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo \\"}\\" x", "days": 3}}\n</tool_call>'
TEXTS = {
    "content and two calls": "Let me look.\n" + CALL + CALL + "\nDone.",
    "only a call": CALL,
    "no call": "Just text, with a < sign and <tool",
    "malformed block": "a <tool_call>\nnot json\n</tool_call> b",
    "call then a malformed block": "x " + CALL + " y <tool_call>[1]</tool_call> z" + CALL,
    "cut off": "x " + CALL[:40],
    "keys reordered": '<tool_call>{"arguments": {"q": [1, {"r": "}"}]}, "name": "find"}</tool_call>',
    "parameters alias, string arguments": '<tool_call>{"name": "f", "parameters": "{\\"a\\": 1}"}</tool_call>',
    # the grammar allows the closing tag inside a string: it does not end the call
    "a closing tag inside an argument": 'x <tool_call>\n{"name": "emit", "arguments": {"html": "a</tool_call>b"}}\n</tool_call>',
}


def test_parse_tool_calls():
    content, calls = parse_tool_calls(TEXTS["content and two calls"])
    assert content == "Let me look.\nDone."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": 'Oslo "}" x', "days": 3})
    ] * 2
    assert calls[0].arguments == '{"city": "Oslo \\"}\\" x", "days": 3}'  # the model's own text
    assert calls[0].id.startswith("call_") and calls[0].id != calls[1].id
    # parallel_tool_calls false: the first call only, the content the same (the second block dropped)
    content, (first,) = parse_tool_calls(TEXTS["content and two calls"], max_calls=1)
    assert (content, first.name, first.arguments) == ("Let me look.\nDone.", "get_weather", calls[0].arguments)
    assert parse_tool_calls(TEXTS["only a call"])[0] is None
    content, calls = parse_tool_calls(TEXTS["call then a malformed block"])
    assert content == "x\ny <tool_call>[1]</tool_call>\nz" and len(calls) == 2
    for name in ("no call", "malformed block", "cut off"):
        assert parse_tool_calls(TEXTS[name]) == (TEXTS[name], []), name
    (c,) = parse_tool_calls(TEXTS["keys reordered"])[1]
    assert (c.name, json.loads(c.arguments)) == ("find", {"q": [1, {"r": "}"}]})
    (c,) = parse_tool_calls(TEXTS["parameters alias, string arguments"])[1]
    assert (c.name, json.loads(c.arguments)) == ("f", {"a": 1})
    content, (c,) = parse_tool_calls(TEXTS["a closing tag inside an argument"])
    assert content == "x" and (c.name, json.loads(c.arguments)) == ("emit", {"html": "a</tool_call>b"})


def _stream(text: str, cuts: list[int], max_calls=None) -> tuple[str, list[tuple[str, str]], list[tuple]]:
    s, events = ToolCallStream(), []
    for k in sorted(set(cuts)):
        events += s.update(text[:k], False, max_calls=max_calls)
    events += s.update(text, True, max_calls=max_calls)
    content = "".join(e[1] for e in events if e[0] == "content")
    calls: list[list[str]] = []
    for e in events:
        if e[0] == "call":
            assert e[1] == len(calls) and e[2].startswith("call_")
            calls.append([e[3], ""])
        elif e[0] == "args":
            calls[e[1]][1] += e[2]
    return content, [tuple(c) for c in calls], events


@settings(max_examples=150, deadline=None)
@given(name=st.sampled_from(sorted(TEXTS)), data=st.data())
def test_streamed_deltas_join_to_the_parsed_output_in_every_split(name, data):
    text = TEXTS[name]
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    max_calls = data.draw(st.sampled_from([None, 1]))  # parallel_tool_calls: true / false
    content, calls, _ = _stream(text, cuts, max_calls)
    want_content, want_calls = parse_tool_calls(text, max_calls=max_calls)
    assert max_calls is None or len(want_calls) <= 1
    want = [(c.name, c.arguments) for c in want_calls]
    if name == "cut off":  # a call cut off by the end: its header may have gone out; then its text follows
        assert content.endswith(CALL[:40]) or content == text
        return
    assert content == (want_content or "")
    assert calls == want


def test_streaming_holds_back_a_possible_tag_and_sends_fragments_early():
    s = ToolCallStream()
    assert s.update("Hi <tool", False) == [("content", "Hi")]  # " <tool" could start a tag
    assert s.update('Hi <tool_call>\n{"name": "get_weather", "arg', False) == []
    ev = s.update('Hi <tool_call>\n{"name": "get_weather", "arguments": {"city": "Os', False)
    assert [e[0] for e in ev] == ["call", "args"] and ev[0][3] == "get_weather" and ev[1][2] == '{"city": "Os'
    assert s.update('Hi <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool', False) == [
        ("args", 0, 'lo"}')
    ]
    assert s.update('Hi <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>', True) == []


# ---------------------------------------------------------------------------------- forced calls


@pytest.fixture(scope="module")
def compiler(tok):
    return xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.from_huggingface(tok))


def _accepts(compiler, tok, tag: dict, text: str) -> bool:
    grammar = xgrammar.Grammar.from_structural_tag(json.dumps(tag))
    matcher = xgrammar.GrammarMatcher(compiler.compile_grammar(grammar))
    for t in tok.encode(text, add_special_tokens=False):
        if not matcher.accept_token(t):
            return False
    return matcher.accept_token(tok.eos_token_id) and matcher.is_terminated()


def test_forced_calls_accept_valid_calls_in_the_builtin_format_only(tok, compiler):
    """The server's structural tag for ``required`` / named: calls exactly as
    :func:`format_tool_call` writes them (so the parser reads them), back to back, arguments
    valid under the function's schema."""
    fns = [WEATHER["function"], NOARGS["function"]]
    one, many = forced_calls(fns, parallel=False), forced_calls(fns, parallel=True)
    weather = format_tool_call("get_weather", '{"city": "Oslo", "days": 3}')
    now = format_tool_call("now", "{}")
    assert _accepts(compiler, tok, one, weather) and _accepts(compiler, tok, one, now)
    assert not _accepts(compiler, tok, one, weather + now)
    assert _accepts(compiler, tok, many, weather + now + weather)
    assert [c.name for c in parse_tool_calls(weather + now + weather)[1]] == ["get_weather", "now", "get_weather"]
    assert not _accepts(compiler, tok, many, weather + "\n" + now)  # no newline between calls
    for bad in (
        weather.replace("3", '"3"'),  # a string for an integer
        weather.replace(', "days": 3', ""),  # a required property missing
        weather.replace("}}", ', "x": 1}}'),  # a property beyond the schema
        weather.replace("get_weather", "get_time"),  # an unknown function
        "Sure! " + weather,  # text before the call
    ):
        assert not _accepts(compiler, tok, one, bad), bad
    named = forced_calls([WEATHER["function"]], parallel=False)
    assert _accepts(compiler, tok, named, weather) and not _accepts(compiler, tok, named, now)


def test_auto_calls_leave_text_free_and_make_every_call_valid(tok, compiler):
    """``auto``: any text, a ``<tool_call>`` block must be a valid call (``strict`` for every
    function); ``parallel_tool_calls: false`` ends the turn after the first call."""
    fns = [WEATHER["function"], NOARGS["function"]]
    weather = format_tool_call("get_weather", '{"city": "Oslo", "days": 3}')
    for parallel in (False, True):
        tag = auto_calls(fns, parallel)
        assert _accepts(compiler, tok, tag, "No tool needed: it is 3 o'clock.")
        assert _accepts(compiler, tok, tag, "Let me look.\n" + weather)
        assert not _accepts(compiler, tok, tag, "x " + weather.replace("3", '"3"'))
        assert not _accepts(compiler, tok, tag, "I like <tool_call> tags")  # the tag opens a call
        assert _accepts(compiler, tok, tag, weather + "\nAnd then " + weather) == parallel


@pytest.mark.parametrize("parameters", [{"type": "string"}, {"type": ["object", "null"]}, {"enum": [1, 2]}])
def test_a_function_whose_parameters_are_not_an_object_schema_is_refused_naming_tools(parameters):
    """Arguments are a JSON object (the parser reads nothing else): parameters {"type": "string"}
    compiled, and with tool_choice "required" the model wrote a call with "arguments": "f", which
    the parser could not read, so the response had no tool_calls and the raw <tool_call> markup
    as content. Such a function is refused (as OpenAI does), a 400 with param tools."""
    fn = {"name": "f", "parameters": parameters}
    for build in (lambda: forced_calls([fn], parallel=True), lambda: auto_calls([fn], parallel=True)):
        with pytest.raises(RequestError) as e:
            build()
        assert e.value.param == "tools" and "'f'" in str(e.value) and 'type "object"' in str(e.value)
    for ok in ({}, {"type": "object"}, {"type": "object", "properties": {"a": {"type": "integer"}}}):
        assert forced_calls([{"name": "f", "parameters": ok}], parallel=True)["type"] == "structural_tag"
