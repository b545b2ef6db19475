"""Structured outputs on the default model (xgrammar): 20 JSON schemas sampled at temperature 1
end with "stop" and validate with ``jsonschema``; regex outputs fullmatch, choices are one of the
choices, EBNF and json_object hold; free greedy rows in the same batch are unchanged token for
token; a grammar that is still compiling delays no other row (seen through engine events); n > 1
samples each have their own matcher; tool calls through a structural tag parse and validate; bad
constraints are refused with xgrammar's message before anything enters the engine."""

from __future__ import annotations

import json
import os
import re
import threading

import jsonschema
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from process_helpers import run_in_fork

from radixkv import LLM, SamplingParams  # noqa: E402
from radixkv.engine import RequestAdmitted, RequestFinished, StepFinished  # noqa: E402
from radixkv.errors import RequestError  # noqa: E402
from radixkv.sampling.grammar import tool_call_structural_tag  # noqa: E402

pytestmark = pytest.mark.timeout(900)

SCHEMAS = [
    # 1 flat object, required fields
    {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    # 2 enum + boolean
    {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "bright": {"type": "boolean"}},
        "required": ["color", "bright"],
        "additionalProperties": False,
    },
    # 3 array of strings with bounds
    {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "minItems": 1, "maxItems": 4}
        },
        "required": ["tags"],
        "additionalProperties": False,
    },
    # 4 nested object
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"id": {"type": "integer", "minimum": 1}, "email": {"type": "string", "maxLength": 40}},
                "required": ["id", "email"],
                "additionalProperties": False,
            }
        },
        "required": ["user"],
        "additionalProperties": False,
    },
    # 5 numbers with ranges
    {
        "type": "object",
        "properties": {
            "lat": {"type": "number", "minimum": -90, "maximum": 90},
            "lon": {"type": "number", "minimum": -180, "maximum": 180},
        },
        "required": ["lat", "lon"],
        "additionalProperties": False,
    },
    # 6 array of objects
    {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "maxLength": 12},
                        "qty": {"type": "integer", "minimum": 0, "maximum": 99},
                    },
                    "required": ["sku", "qty"],
                    "additionalProperties": False,
                },
            }
        },
        "required": ["items"],
        "additionalProperties": False,
    },
    # 7 string pattern
    {
        "type": "object",
        "properties": {"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}},
        "required": ["date"],
        "additionalProperties": False,
    },
    # 8 optional fields (only some required)
    {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 30},
            "year": {"type": "integer"},
            "rating": {"type": "number"},
        },
        "required": ["title"],
        "additionalProperties": False,
    },
    # 9 nullable via anyOf
    {
        "type": "object",
        "properties": {"nickname": {"anyOf": [{"type": "string", "maxLength": 15}, {"type": "null"}]}},
        "required": ["nickname"],
        "additionalProperties": False,
    },
    # 10 const + enum of numbers
    {
        "type": "object",
        "properties": {"version": {"const": 2}, "level": {"enum": [1, 2, 3]}},
        "required": ["version", "level"],
        "additionalProperties": False,
    },
    # 11 top-level array
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 1000}, "minItems": 2, "maxItems": 5},
    # 12 deeper nesting
    {
        "type": "object",
        "properties": {
            "a": {
                "type": "object",
                "properties": {
                    "b": {
                        "type": "object",
                        "properties": {"c": {"type": "string", "maxLength": 10}},
                        "required": ["c"],
                        "additionalProperties": False,
                    }
                },
                "required": ["b"],
                "additionalProperties": False,
            }
        },
        "required": ["a"],
        "additionalProperties": False,
    },
    # 13 $defs / $ref
    {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
        "additionalProperties": False,
    },
    # 14 boolean flags
    {
        "type": "object",
        "properties": {"done": {"type": "boolean"}, "urgent": {"type": "boolean"}, "archived": {"type": "boolean"}},
        "required": ["done", "urgent", "archived"],
        "additionalProperties": False,
    },
    # 15 string length bounds
    {
        "type": "object",
        "properties": {"code": {"type": "string", "minLength": 3, "maxLength": 6}},
        "required": ["code"],
        "additionalProperties": False,
    },
    # 16 array of enums, unique
    {
        "type": "object",
        "properties": {
            "days": {
                "type": "array",
                "items": {"enum": ["mon", "tue", "wed", "thu", "fri"]},
                "minItems": 1,
                "maxItems": 3,
            }
        },
        "required": ["days"],
        "additionalProperties": False,
    },
    # 17 integer bounds + exclusive
    {
        "type": "object",
        "properties": {
            "percent": {"type": "integer", "minimum": 0, "maximum": 100},
            "score": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 10},
        },
        "required": ["percent", "score"],
        "additionalProperties": False,
    },
    # 18 oneOf of objects
    {
        "type": "object",
        "properties": {
            "shape": {
                "anyOf": [
                    {
                        "type": "object",
                        "properties": {"kind": {"const": "circle"}, "r": {"type": "number"}},
                        "required": ["kind", "r"],
                        "additionalProperties": False,
                    },
                    {
                        "type": "object",
                        "properties": {"kind": {"const": "square"}, "side": {"type": "number"}},
                        "required": ["kind", "side"],
                        "additionalProperties": False,
                    },
                ]
            }
        },
        "required": ["shape"],
        "additionalProperties": False,
    },
    # 19 map-like object with patternless additionalProperties of integers
    {
        "type": "object",
        "properties": {"counts": {"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 3}},
        "required": ["counts"],
        "additionalProperties": False,
    },
    # 20 mixed: string enum, array of numbers, nested optional
    {
        "type": "object",
        "properties": {
            "status": {"enum": ["ok", "error"]},
            "values": {"type": "array", "items": {"type": "number"}, "maxItems": 4},
            "meta": {
                "type": "object",
                "properties": {"source": {"type": "string", "maxLength": 20}},
                "additionalProperties": False,
            },
        },
        "required": ["status", "values"],
        "additionalProperties": False,
    },
]


@pytest.fixture(scope="module")
def llm(default_model):
    return LLM(device="cpu", loaded_model=default_model, max_total_tokens=16384)


def chat(llm, text):
    return llm.tokenizer.encode(llm.render_chat([{"role": "user", "content": text}]), add_special_tokens=False)


def assert_idle(llm):
    llm.engine.check_integrity()
    s = llm.cache_stats()
    assert s["protected"] == 0 and s["running"] == 0 and s["waiting"] == 0
    assert s["free"] + s["evictable"] == s["capacity"]


def test_twenty_schemas_at_temperature_one_stop_and_validate(llm):
    assert len({json.dumps(s) for s in SCHEMAS}) == 20
    prompts = [
        chat(llm, "Reply with only a JSON value that follows this JSON schema:\n" + json.dumps(s)) for s in SCHEMAS
    ]
    params = [
        SamplingParams(temperature=1.0, seed=100 + i, max_tokens=512, json_schema=s) for i, s in enumerate(SCHEMAS)
    ]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    reasons = [o.outputs[0].finish_reason for o in outs]
    assert sum(r == "stop" for r in reasons) >= 19, reasons
    for schema, o in zip(SCHEMAS, outs):
        c = o.outputs[0]
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.text), schema)
            assert c.token_ids[-1] in llm.engine.eos_token_ids  # the grammar ended, then EOS
    assert llm.engine.grammars.num_compiles >= 20
    assert_idle(llm)


REGEXES = [
    r"\(\d{3}\) \d{3}-\d{4}",
    r"\d{4}-\d{2}-\d{2}",
    r"[A-Z][a-z]{1,10}( [A-Z][a-z]{1,10})?",
    r"(yes|no), because [a-z ]{3,30}\.",
]
CHOICES = [["positive", "negative", "neutral"], ['say "hi"', "back\\slash", "café", "tab\there"]]
EBNF = 'root ::= "The answer is " digit digit? "."\ndigit ::= [0-9]'


def test_regex_choice_ebnf_json_object_beside_free_greedy_rows(llm):
    eng = llm.engine
    free_prompts = [chat(llm, "Name three prime numbers."), chat(llm, "What is the capital of France?")]
    greedy = SamplingParams(temperature=0, max_tokens=24)
    solo = [llm.generate(prompt_token_ids=[p], sampling_params=greedy, use_tqdm=False)[0] for p in free_prompts]
    cons = [SamplingParams(temperature=1.0, seed=7 + i, max_tokens=64, regex=r) for i, r in enumerate(REGEXES)]
    cons += [SamplingParams(temperature=1.0, seed=20 + i, max_tokens=64, choice=c) for i, c in enumerate(CHOICES)]
    cons += [SamplingParams(temperature=1.0, seed=30, max_tokens=64, grammar=EBNF)]
    cons += [SamplingParams(temperature=0.7, seed=31, max_tokens=128, json_object=True)]
    for p in cons:  # compiled before the batch, so constrained and free rows are admitted together
        eng.grammars.compile(p.structured_output).result()
    steps = []
    unsub = eng.events.subscribe(steps.append, kinds=(StepFinished,))
    prompt = chat(llm, "Answer with a short phrase.")
    outs = llm.generate(
        prompt_token_ids=[free_prompts[0]] + [prompt] * len(cons) + [free_prompts[1]],
        sampling_params=[greedy] + cons + [greedy],
        use_tqdm=False,
    )
    unsub()
    ids = {o.request_id for o in outs}
    free_ids = {outs[0].request_id, outs[-1].request_id}
    mixed = [s for s in steps if {r for r, _ in s.samples} & free_ids and len({r for r, _ in s.samples} & ids) > 2]
    assert len(mixed) >= 10  # the free rows decoded beside constrained rows
    for o, ref in zip([outs[0], outs[-1]], solo):
        assert o.outputs[0].token_ids == ref.outputs[0].token_ids  # unchanged token for token
    texts = [o.outputs[0] for o in outs[1:-1]]
    for c, r in zip(texts[: len(REGEXES)], REGEXES):
        assert c.finish_reason == "stop" and re.fullmatch(r, c.text), (r, c.text)
    for c, ch in zip(texts[len(REGEXES) : len(REGEXES) + len(CHOICES)], CHOICES):
        assert c.finish_reason == "stop" and c.text in ch, (ch, c.text)
    assert texts[-2].finish_reason == "stop" and re.fullmatch(r"The answer is [0-9][0-9]?\.", texts[-2].text)
    if texts[-1].finish_reason == "stop":
        assert isinstance(json.loads(texts[-1].text), dict)
    assert_idle(llm)


def test_a_compiling_grammar_delays_no_other_row(llm):
    """The constrained request waits outside the scheduler while its grammar compiles (held
    here by a gate, not a timer); the free request is admitted, steps and finishes meanwhile."""
    eng = llm.engine
    backend = eng.grammars
    gate = threading.Event()
    compile_fn = backend._compile

    def gated(grammar):
        gate.wait(120)
        return compile_fn(grammar)

    schema = {"type": "object", "properties": {"held": {"type": "integer"}}, "required": ["held"]}
    events = []
    unsub = eng.events.subscribe(events.append, kinds=(RequestAdmitted, StepFinished, RequestFinished))
    backend._compile = gated
    try:
        slow = eng.add_request(
            chat(llm, "Give a JSON object."), SamplingParams(temperature=0, max_tokens=32, json_schema=schema)
        )
        fast = eng.add_request(chat(llm, "Say hello."), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        done = {}
        while fast not in done:
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = o
        assert slow not in done and len(done[fast].outputs[0].token_ids) == 6
        admitted = [e.request_id for e in events if isinstance(e, RequestAdmitted)]
        stepped = [e for e in events if isinstance(e, StepFinished)]
        assert admitted == [fast]
        assert len(stepped) == 6 and all({r for r, _ in e.samples} == {fast} for e in stepped)
        assert [e.request_id for e in events if isinstance(e, RequestFinished)] == [fast]
        assert eng.has_unfinished_requests()
        gate.set()
        while slow not in done:
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = o
    finally:
        backend._compile = compile_fn
        gate.set()
        unsub()
    admitted = [e.request_id for e in events if isinstance(e, RequestAdmitted)]
    assert admitted == [fast, slow]
    c = done[slow].outputs[0]
    assert c.finish_reason == "stop" and isinstance(json.loads(c.text)["held"], int)
    assert_idle(llm)


def test_n_samples_have_their_own_matchers_and_tool_calls_validate(llm):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Current weather of a city",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "city": {"type": "string", "maxLength": 30},
                        "unit": {"enum": ["celsius", "fahrenheit"]},
                    },
                    "required": ["city", "unit"],
                    "additionalProperties": False,
                },
            },
        },
        {
            "type": "function",
            "function": {
                "name": "add",
                "description": "Add two integers",
                "parameters": {
                    "type": "object",
                    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                    "required": ["a", "b"],
                    "additionalProperties": False,
                },
            },
        },
    ]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    msgs = [
        {"role": "system", "content": "You can call these tools: " + json.dumps(tools)},
        {"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"},
    ]
    prompt = llm.tokenizer.encode(llm.render_chat(msgs), add_special_tokens=False)
    params = [
        SamplingParams(
            n=3, temperature=1.0, seed=5, max_tokens=160, structural_tag=tool_call_structural_tag(tools, parallel=False)
        ),
        SamplingParams(
            temperature=1.0,
            seed=9,
            max_tokens=160,
            structural_tag=tool_call_structural_tag(tools, name="add", parallel=False),
        ),
        SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=96, json_schema=SCHEMAS[0]),
    ]
    outs = llm.generate(
        prompt_token_ids=[prompt, prompt, chat(llm, "Describe a person as JSON.")],
        sampling_params=params,
        use_tqdm=False,
    )
    call = re.compile(r"<tool_call>\n(\{.*?\})\n</tool_call>", re.S)
    for o, p in zip(outs[:2], params[:2]):
        assert len(o.outputs) == p.n
        for c in o.outputs:
            assert c.finish_reason == "stop", c.text
            calls = call.findall(c.text)
            assert len(calls) == 1 and call.sub("", c.text) == ""
            obj = json.loads(calls[0])
            assert set(obj) == {"name", "arguments"} and obj["name"] in schemas
            jsonschema.validate(obj["arguments"], schemas[obj["name"]])
    assert json.loads(call.findall(outs[1].outputs[0].text)[0])["name"] == "add"
    for c in outs[2].outputs:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), SCHEMAS[0])
    assert_idle(llm)


@pytest.mark.parametrize(
    "kwargs,field,message",
    [
        ({"json_schema": {"type": "objectx"}}, "json_schema", 'Unsupported type "objectx"'),
        (
            {"json_schema": {"type": "integer", "minimum": 5, "maximum": 1}},
            "json_schema",
            "minimum greater than maximum",
        ),
        ({"regex": "(ab"}, "regex", "parenthesis is not closed"),
        ({"regex": "(?!a)[a-z]"}, "regex", "lookahead / lookbehind ((?= (?! (?<= (?<!) is not supported"),
        ({"grammar": "root ::= undefined_rule"}, "grammar", 'Rule "undefined_rule" is not defined'),
        ({"structural_tag": {"type": "structural_tag", "format": {"type": "bogus"}}}, "structural_tag", "bogus"),
        (
            {"json_schema": {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}},
            "json_schema",
            "#/properties/tags/uniqueItems: uniqueItems is not enforced",
        ),
        (
            {
                "structural_tag": tool_call_structural_tag(
                    [
                        {
                            "name": "f",
                            "parameters": {
                                "type": "object",
                                "properties": {"x": {"type": "number", "multipleOf": 0.5}},
                            },
                        }
                    ]
                )
            },
            "structural_tag",
            "structural_tag.format.tags[0].content: #/properties/x/multipleOf: multipleOf is not enforced",
        ),
    ],
)
def test_invalid_constraints_are_refused_before_the_engine(llm, kwargs, field, message):
    eng = llm.engine
    with pytest.raises(RequestError) as e:
        eng.add_request([1, 2, 3], SamplingParams(**kwargs))
    assert e.value.param == field and message in str(e.value) and "/project/" not in str(e.value)
    assert not eng.has_unfinished_requests()
    with pytest.raises(RequestError) as e:  # the LLM API refuses the whole batch
        llm.generate(prompt_token_ids=[[1, 2], [3, 4]], sampling_params=[SamplingParams(), SamplingParams(**kwargs)])
    assert e.value.param == field and not eng.has_unfinished_requests()


_OBJ = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
DROPPED = [  # (schema, a JSON text it forbids that xgrammar's grammar of it accepts, the keyword)
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 1]", "uniqueItems"),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 7}, "minContains": 1}, "[1]", "contains"),
    ({"type": "integer", "not": {"const": 1}}, "1", "not"),
    ({**_OBJ, "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}}, '{"a": 1}', "if"),
    ({**_OBJ, "dependentRequired": {"a": ["b"]}}, '{"a": 1}', "dependentRequired"),
    (
        {**_OBJ, "$schema": "http://json-schema.org/draft-07/schema#", "dependencies": {"a": ["b"]}},
        '{"a": 1}',
        "dependencies",
    ),
    ({**_OBJ, "dependentSchemas": {"a": {"required": ["b"]}}}, '{"a": 1}', "dependentSchemas"),
    ({"type": "number", "multipleOf": 0.5}, "0.3", "multipleOf"),
    ({"multipleOf": 3}, "4", "multipleOf"),
    ({"allOf": [{"type": "integer"}, {"maximum": 3}]}, '"s"', "allOf"),
    ({"type": "integer", "allOf": [{"maximum": 3}]}, "5", "allOf"),
    # keywords xgrammar drops beside others, or without a type (found by a helper with pydantic
    # and hand-written schemas: each compiled and the grammar let the forbidden text through)
    ({"type": "integer", "multipleOf": 3, "minimum": 0}, "4", "multipleOf"),  # conint(multiple_of, ge)
    ({"type": "string", "pattern": "^a+$", "minLength": 3}, '"a"', "minLength"),  # constr(pattern, min_length)
    ({"type": "string", "format": "email", "pattern": "^x"}, '"a@b.com"', "pattern"),
    ({"type": "string", "format": "uuid", "maxLength": 5}, '"123e4567-e89b-12d3-a456-426614174000"', "maxLength"),
    ({"type": "string", "pattern": "^(?!a).$"}, '"a"', "pattern"),  # lookahead
    ({"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["a"]}, '{"b": 1}', "required"),
    ({"type": "object", "additionalProperties": {"type": "integer"}, "required": ["a"]}, "{}", "required"),
    ({"$defs": {"p": {"type": "integer"}}, "$ref": "#/$defs/p", "maximum": 3}, "5", "maximum"),
    ({"$defs": {"p": {"$anchor": "P", "type": "integer"}}, "$ref": "#P"}, '"a"', "$ref"),
    ({"type": "string", "anyOf": [{"type": "integer"}, {"type": "string"}]}, "1", "type"),
    ({"anyOf": [{"type": "integer"}, {"type": "number"}], "minimum": 3}, "1", "minimum"),
    ({"type": "string", "enum": ["a", "bb"], "maxLength": 1}, '"bb"', "maxLength"),
    ({"type": "string", "enum": ["a", 1]}, "1", "enum"),
    ({"type": "integer", "const": 5, "minimum": 6}, "5", "minimum"),
    ({"enum": [12345678901234567890]}, "1.2345678901234567e+19", "enum"),  # written as a float: not it
    ({"const": {"a": [12345678901234567890]}}, '{"a":[1.2345678901234567e+19]}', "const"),
    ({"minimum": 3}, "1", "minimum"),
    ({"minLength": 3}, '"a"', "minLength"),
    ({"maxProperties": 0}, '{"a": 1}', "maxProperties"),
    (
        {"type": "object", "properties": {"x1": {"type": "string"}}, "patternProperties": {"^x": {"type": "integer"}}},
        '{"x1": "s"}',
        "patternProperties",
    ),
    (
        {"type": "object", "properties": {"ABC": {"type": "integer"}}, "propertyNames": {"pattern": "^[a-z]+$"}},
        '{"ABC": 1}',
        "propertyNames",
    ),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "5", "oneOf"),
    ({"oneOf": [{"enum": ["a", "b"]}, {"enum": ["b"]}]}, '"b"', "oneOf"),
    (  # a recursive schema's branches share themselves: the disjointness check is bounded
        {
            "oneOf": [{"$ref": "#/$defs/n"}, {"$ref": "#/$defs/n"}],
            "$defs": {"n": {"type": ["object", "null"], "properties": {"c": {"$ref": "#/$defs/n"}}}},
        },
        "null",
        "oneOf",
    ),
]
KEPT = [  # (schema, a JSON text it forbids, which xgrammar's grammar refuses)
    ({"type": "integer", "multipleOf": 3}, "4"),
    ({"allOf": [{"$ref": "#/$defs/p"}], "description": "d", "$defs": {"p": {"type": "integer", "maximum": 3}}}, "5"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": False, "maxItems": 1}, "[1, 2]"),
    ({"type": "string", "enum": ["a", "b"], "title": "T"}, '"c"'),
    ({"type": "object", "properties": {"ab": {"type": "integer"}}, "propertyNames": {"maxLength": 2}}, '{"ab": "s"}'),
    (
        {"type": "object", "properties": {"y": {"type": "string"}}, "patternProperties": {"^x": {"type": "integer"}}},
        '{"y": 1}',
    ),
    (
        {"type": "object", "additionalProperties": {"type": "integer"}, "propertyNames": {"pattern": "^[a-z]+$"}},
        '{"A": 1}',
    ),
    ({"anyOf": [{"$ref": "#/$defs/p"}, {"type": "null"}], "default": None, "$defs": {"p": {"type": "integer"}}}, '"a"'),
    (  # pydantic's discriminated union: oneOf of objects with distinct const tags
        {
            "oneOf": [{"$ref": "#/$defs/cat"}, {"$ref": "#/$defs/dog"}],
            "discriminator": {"propertyName": "kind"},
            "$defs": {
                "cat": {**_OBJ, "properties": {"kind": {"const": "cat", "type": "string"}}, "required": ["kind"]},
                "dog": {**_OBJ, "properties": {"kind": {"const": "dog", "type": "string"}}, "required": ["kind"]},
            },
        },
        '{"kind": "cow"}',
    ),
]


def _xgrammar_accepts(schema: dict, text: str) -> bool:
    import xgrammar
    from xgrammar.testing import _is_grammar_accept_string

    grammar = xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
    return _is_grammar_accept_string(grammar, text)


@pytest.mark.parametrize("schema, text, keyword", DROPPED, ids=[k for _, _, k in DROPPED])
def test_a_schema_keyword_xgrammar_drops_is_refused_with_its_path(schema, text, keyword):
    """xgrammar compiles these keywords into nothing: its grammar accepts a text the schema
    forbids (if a later xgrammar enforces one, this fails and the keyword can leave
    radixkv/sampling/schema_check.py's list). Such a schema, anywhere in a bigger one, is refused
    naming the keyword and where it is, not accepted and then not obeyed."""
    from radixkv.sampling.schema_check import unenforced_keyword

    assert not jsonschema.validators.validator_for(schema)(schema).is_valid(json.loads(text))
    assert _xgrammar_accepts(schema, text)
    outer = {"type": "object", "properties": {"x": {"type": "array", "items": schema}}, "$defs": {"d": schema}}
    assert unenforced_keyword(outer).startswith(f"#/properties/x/items/{keyword}: {keyword} is not enforced")
    from radixkv.sampling.grammar import GrammarBackend

    constraint = SamplingParams(json_schema={"$defs": {"d": schema}, "$ref": "#/$defs/d"}).structured_output
    with pytest.raises(RequestError) as e:
        GrammarBackend(None, 64, []).validate(constraint)
    assert e.value.param == "json_schema" and f"#/$defs/d/{keyword}: {keyword} is not enforced" in str(e.value)


def test_a_recursive_one_of_is_checked_in_bounded_time():
    """The branches of a recursive schema's oneOf share themselves: the disjointness check
    recursed until RecursionError (a 400 reading "maximum recursion depth exceeded")."""
    from radixkv.sampling.schema_check import unenforced_keyword

    node = {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}
    schema = {"oneOf": [{"$ref": "#/$defs/n"}, {"$ref": "#/$defs/n"}], "$defs": {"n": node}}
    assert unenforced_keyword(schema).startswith("#/oneOf: oneOf is not enforced")


@pytest.mark.parametrize(
    "pattern, text",
    [
        ('^a"b$', '"a"b"'),
        ("^a\\nb$", '"a\nb"'),
        ("^\\x22$", '"""'),
        ("^C:\\\\$", '"C:\\"'),
        ("^[\\n]$", '"\n"'),
        ("^[\\x00-\\x1f]$", '"\x01"'),
    ],
)
def test_a_pattern_naming_a_character_json_escapes_is_refused(pattern, text):
    """xgrammar writes a ", a backslash or a control character that a pattern names raw inside
    the JSON string: the grammar of {"type": "string", "pattern": '^a"b$'} accepts '"a"b"', so
    the output was not JSON at all. Refused naming pattern (patternProperties' keys too); a
    range of printable characters or a negated class holding them is safe (xgrammar leaves them
    out)."""
    from radixkv.sampling.schema_check import unenforced_keyword

    with pytest.raises(ValueError):
        json.loads(text)
    schema = {"type": "string", "pattern": pattern}
    assert _xgrammar_accepts(schema, text)
    assert unenforced_keyword(schema).startswith("#/pattern: pattern is not enforced (it matches a")
    props = {"type": "object", "patternProperties": {pattern: {"type": "integer"}}}
    assert unenforced_keyword(props).startswith("#/patternProperties: patternProperties is not enforced")
    for safe in ("^[ -~]+$", '^[^"]$', "^\\d{3}-[0-9]{4}$", "^\\S+\\.com$"):
        safe_schema = {"type": "string", "pattern": safe}
        assert unenforced_keyword(safe_schema) is None
        assert not _xgrammar_accepts(safe_schema, '"' + '"' + '"') and not _xgrammar_accepts(safe_schema, '"\\"')


@pytest.mark.parametrize("schema, text", KEPT)
def test_schema_keywords_xgrammar_enforces_are_accepted(schema, text):
    from radixkv.sampling.schema_check import unenforced_keyword

    assert not jsonschema.validators.validator_for(schema)(schema).is_valid(json.loads(text))
    assert not _xgrammar_accepts(schema, text) and unenforced_keyword(schema) is None


def test_constraints_need_a_tokenizer_and_bias_ids_the_vocabulary():
    from test_scheduler import make_engine

    eng = make_engine()
    with pytest.raises(RequestError) as e:
        eng.add_request([1, 2, 3], SamplingParams(regex="a+"))
    assert e.value.param == "regex"
    with pytest.raises(RequestError) as e:
        eng.add_request([1, 2, 3], SamplingParams(logit_bias={64: 1.0}))
    assert e.value.param == "logit_bias" and "[0, 64)" in str(e.value)
    with pytest.raises(RequestError) as e:
        eng.add_request([1, 2, 3], SamplingParams(prompt_logprobs=1, logprob_start_len=3))
    assert e.value.param == "logprob_start_len"
    assert not eng.has_unfinished_requests()


def test_async_llm_waits_for_compiles_without_spinning_and_refuses_bad_constraints(llm):
    import asyncio

    from radixkv.async_llm import AsyncLLM

    prompt = chat(llm, "Is the sky blue? Answer yes or no.")

    async def run(a):
        with pytest.raises(RequestError) as e:
            async for _ in a.generate(prompt_token_ids=prompt, sampling_params=SamplingParams(regex="[a-")):
                pass
        assert e.value.param == "regex"
        params = SamplingParams(temperature=1.0, seed=2, max_tokens=8, choice=["yes indeed", "no way", "unsure"])
        last = None
        async for out in a.generate(prompt_token_ids=prompt, sampling_params=params):
            last = out
        return last

    with AsyncLLM(engine=llm.engine) as a:
        out = asyncio.run(run(a))
    assert out.finished and out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].text in ("yes indeed", "no way", "unsure")
    assert_idle(llm)


def test_a_grammar_that_fails_to_compile_ends_its_request_the_same_on_llm_and_async_llm(llm, monkeypatch):
    """A constraint xgrammar accepted at validation but whose compile raised ends its request
    with finish_reason "abort" (Engine._admit_compiled). ``generate_batch`` (sessions, select)
    returns that output on LLM; AsyncLLM's raised ``asyncio.CancelledError`` instead, as if the
    caller had aborted it, out of a task nobody cancelled (an AsyncSession turn with a
    response_format ended so). Neither runs its finish hook, and the session stays as it was."""
    import asyncio
    from concurrent.futures import Future

    from radixkv.async_llm import AsyncLLM

    def failing(structured, namespace=None):
        fut: Future = Future()
        fut.set_exception(RuntimeError("compile failed"))
        return fut

    monkeypatch.setattr(llm.engine.grammars, "compile", failing)
    prompt = chat(llm, "Give me a JSON object.")
    params = SamplingParams(temperature=0, max_tokens=8, json_object=True)
    hooked: list = []
    (want,) = llm.generate_batch([(prompt, params, None)], on_finish=[lambda e, o: hooked.append(o)])
    assert want.finished and want.outputs[0].finish_reason == "abort" and want.outputs[0].token_ids == []

    async def run(a):
        (got,) = await a.generate_batch([(prompt, params, None)], on_finish=[lambda e, o: hooked.append(o)])
        s = a.session("Hello")
        before = (s.tokens, s.pinned_tokens)
        turn = await s.generate(" world", params)
        after = (s.tokens, s.pinned_tokens)
        await s.close()
        return got, turn, before, after

    with AsyncLLM(engine=llm.engine) as a:
        got, turn, before, after = asyncio.run(run(a))
    assert (got.finished, got.outputs[0].finish_reason, got.outputs[0].token_ids) == (True, "abort", [])
    assert turn.outputs[0].finish_reason == "abort" and after == before and hooked == []
    assert_idle(llm)


def test_min_tokens_holds_back_eos_and_stop_strings_on_the_model(llm):
    prompt = chat(llm, "Say hi.")
    (ref,) = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(temperature=0, max_tokens=48))
    ids = ref.outputs[0].token_ids
    assert ref.outputs[0].finish_reason == "stop" and ids[-1] in llm.engine.eos_token_ids
    k = len(ids)
    stop = ref.outputs[0].text[:3]
    outs = llm.generate(
        prompt_token_ids=[prompt, prompt],
        sampling_params=[
            SamplingParams(temperature=0, max_tokens=48, min_tokens=k + 2),
            SamplingParams(temperature=0, max_tokens=48, min_tokens=k + 2, stop=[stop]),
        ],
        use_tqdm=False,
    )
    for o in outs:
        got = o.outputs[0].token_ids
        assert got[: k - 1] == ids[: k - 1]  # the same greedy path until EOS would have come
        assert len(got) >= k + 2 and not set(got[: k + 1]) & llm.engine.eos_token_ids
    assert ref.outputs[0].text.startswith(stop) and not outs[1].outputs[0].text == ""
    assert_idle(llm)


def test_a_compiled_grammar_is_never_shared_across_namespaces(llm):
    """The compiled-grammar cache is a cache keyed by what a client sent, as the prefix cache is:
    another tenant's (or salt's) identical schema is compiled anew, so whether a schema was
    compiled for someone else never shows in one's own time to first token (before: one cache
    for everyone, and through a real server a tenant's probe of another tenant's 40-field
    schema answered in 111-130 ms against 359-399 ms for a schema nobody used)."""
    from radixkv.namespace import Namespace

    schema = {
        "type": "object",
        "properties": {"invoice_4471": {"enum": ["Globex", "Initech"]}},
        "required": ["invoice_4471"],
    }
    prompt = chat(llm, "Whose invoice is it?")
    eng = llm.engine

    def compiles(namespace, salt=None) -> int:
        before = eng.grammars.num_compiles
        params = SamplingParams(temperature=0, max_tokens=64, json_schema=schema, cache_salt=salt)
        (out,) = llm.generate_batch([(prompt, params, namespace)])
        assert json.loads(out.outputs[0].text)["invoice_4471"] in ("Globex", "Initech")
        return eng.grammars.num_compiles - before

    alice, mallory = Namespace(tenant="alice"), Namespace(tenant="mallory")
    assert compiles(alice) == 1
    assert compiles(alice) == 0  # the control: a tenant's own repeat is served from the cache
    assert compiles(mallory) == 1  # another tenant's identical schema: compiled for it alone
    assert compiles(mallory) == 0
    assert compiles(alice, salt="end-user-7") == 1  # a salt splits it within a tenant, as the prefix cache
    assert compiles(None) == 1  # the shared default namespace (no keys) is one more
    assert_idle(llm)


def test_a_request_aborted_while_its_grammar_compiles_leaves_nothing_behind(llm, monkeypatch):
    """A constrained request whose consumer leaves (or that is aborted by id) while its grammar
    still compiles is released at once on AsyncLLM (the abort is applied between steps and no
    step follows on an idle engine); the engine kept it in its list of compiling requests until
    some later request made a step run, so an idle server held every such request (its prompt,
    its generator) after the clients had gone."""
    import asyncio
    from concurrent.futures import Future

    from radixkv.async_llm import AsyncLLM

    never: Future = Future()  # a compile that is still running
    monkeypatch.setattr(llm.engine.grammars, "compile", lambda structured, namespace=None: never)
    prompt = chat(llm, "Give me a JSON object.")
    params = SamplingParams(temperature=0, max_tokens=8, json_object=True)

    async def held(a) -> tuple:
        deadline = asyncio.get_running_loop().time() + 60
        while not await a.call_in_engine_thread(lambda e: len(e._compiling)):
            assert asyncio.get_running_loop().time() < deadline, "the request never reached the engine"
        return await a.call_in_engine_thread(lambda e: ([r.request_id for r in e._compiling], len(e._groups)))

    async def run(a) -> list:
        seen = []
        by_id = a.generate(prompt_token_ids=prompt, sampling_params=params, request_id="by-id")
        first = asyncio.ensure_future(by_id.__anext__())
        seen.append(await held(a))
        await a.abort("by-id")
        out = await first
        seen.append((out.finished, out.outputs[0].finish_reason))
        seen.append(
            await a.call_in_engine_thread(lambda e: ([r.request_id for r in e._compiling], e.has_unfinished_requests()))
        )
        left = a.generate(prompt_token_ids=prompt, sampling_params=params, request_id="left")
        first = asyncio.ensure_future(left.__anext__())
        seen.append(await held(a))
        first.cancel()  # its consumer leaves: the stream's finally posts the abort
        await asyncio.gather(first, return_exceptions=True)
        await left.aclose()
        seen.append(
            await a.call_in_engine_thread(lambda e: ([r.request_id for r in e._compiling], e.has_unfinished_requests()))
        )
        return seen

    with AsyncLLM(engine=llm.engine) as a:
        seen = asyncio.run(run(a))
        assert a.num_unfinished_requests() == 0
    assert seen == [(["by-id"], 1), (True, "abort"), ([], False), (["left"], 1), ([], False)]
    assert_idle(llm)


@pytest.mark.timeout(120)
def test_a_forked_child_compiles_grammars_after_its_parent_did():
    """``multiprocessing`` with the 'fork' start method after an engine compiled a grammar: the
    child's copy of the compile thread pool has no thread (a fork copies only the forking one),
    and the pool, believing its thread idle, started none: the child's constrained request waited
    forever for its compile (``_wait_for_grammars`` every step)."""
    import multiprocessing as mp

    from transformers import AutoTokenizer

    from radixkv.models.loader import resolve_hf_dir
    from radixkv.sampling.grammar import GrammarBackend

    if "fork" not in mp.get_all_start_methods():
        pytest.skip("no fork start method on this platform")
    tok = AutoTokenizer.from_pretrained(str(resolve_hf_dir("smollm2-135m")), local_files_only=True)
    backend = GrammarBackend(tok, len(tok), [tok.eos_token_id])
    assert backend.compile(("regex", "[ab]+")).result(60) is not None and backend.num_compiles == 1

    def child(queue):
        fut = backend.compile(("regex", "[cd]+"))
        queue.put((fut.result(30) is not None, backend.num_compiles))

    got, exitcode = run_in_fork(child, 40)
    assert got == (True, 2) and exitcode == 0
    assert backend.compile(("regex", "[cd]+")).result(60) is not None and backend.num_compiles == 2  # the parent's
