"""The Python API refuses bad input as the server does: a ``RequestError`` (a ValueError) whose
``.param`` names the field and whose message names the limit, before anything is submitted
(issue 19). Engines run over the null runner (no model: the outcome of a refusal does not depend
on the model's outputs) with the default model's tokenizer, so this module needs no weights."""

from __future__ import annotations

import asyncio
import os

import httpx
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from obs_helpers import NullRunner  # noqa: E402

from radixkv import LLM, AsyncLLM, SamplingParams  # noqa: E402
from radixkv.config import EngineConfig  # noqa: E402
from radixkv.errors import RequestError  # noqa: E402

pytestmark = pytest.mark.timeout(300)

CTX = 256  # the null runner's context (max_context_len)


@pytest.fixture(scope="module")
def tokenizer():
    from radixkv.models.loader import load_tokenizer

    return load_tokenizer()


def null_llm(tokenizer, **kw) -> LLM:
    runner = NullRunner(len(tokenizer), 1, 8, max_context_len=CTX)
    return LLM(model_runner=runner, tokenizer=tokenizer, eos_token_ids=[], device="cpu", max_total_tokens=4096, **kw)


@pytest.fixture(scope="module")
def llm(tokenizer):
    return null_llm(tokenizer)


def refused(fn, param: str, *words: str) -> RequestError:
    """``fn()`` raises a RequestError naming ``param`` whose message holds every one of ``words``."""
    with pytest.raises(RequestError) as info:
        fn()
    assert info.value.param == param, (info.value.param, str(info.value))
    for w in words:
        assert w in str(info.value), (w, str(info.value))
    return info.value


def assert_idle(engine) -> None:
    """Nothing was submitted, or everything submitted is released: no request, every slot once."""
    assert not engine.has_unfinished_requests()
    engine.check_integrity()
    st = engine.cache_stats()
    assert st["free"] + st["evictable"] + st["pinned"] == st["capacity"], st
    assert st["protected"] == st["pinned"], st


# ------------------------------------------------------------------------------ SamplingParams


@pytest.mark.parametrize(
    "kwargs,param,words",
    [
        ({"stop": 123}, "stop", ("a string or a list of strings", "123")),
        ({"stop": [1]}, "stop", ("a string or a list of strings",)),
        ({"stop": ["ok", ""]}, "stop", ("non-empty",)),
        ({"stop": [f"s{i}" for i in range(257)]}, "stop", ("at most 256 strings", "257")),
        ({"stop": ["x" * 1025]}, "stop", ("at most 1024 characters", "1025")),
        ({"stop_token_ids": "x"}, "stop_token_ids", ("list of integer token ids",)),
        ({"stop_token_ids": "12"}, "stop_token_ids", ("list of integer token ids",)),  # not [1, 2]
        ({"stop_token_ids": [1.0]}, "stop_token_ids", ("list of integer token ids",)),
        ({"stop_token_ids": [True]}, "stop_token_ids", ("list of integer token ids",)),
        ({"stop_token_ids": [-1]}, "stop_token_ids", (">= 0",)),
        ({"max_tokens": 5, "max_new_tokens": 7}, "max_new_tokens", ("only one of max_tokens", "max_new_tokens")),
        ({"max_tokens": 16, "max_new_tokens": 7}, "max_new_tokens", ("only one of",)),  # 16 given, not the default
        ({"max_tokens": 0}, "max_tokens", (">= 1",)),  # None: up to the context (vLLM)
        ({"max_tokens": True}, "max_tokens", (">= 1",)),
        ({"max_tokens": 2.0}, "max_tokens", (">= 1",)),
        ({"n": True}, "n", (">= 1",)),
        ({"n": "2"}, "n", (">= 1",)),
        ({"temperature": "1"}, "temperature", (">= 0",)),
        ({"temperature": True}, "temperature", (">= 0",)),
        ({"temperature": float("inf")}, "temperature", ("finite",)),
        ({"top_p": True}, "top_p", ("(0, 1]",)),
        ({"top_p": float("nan")}, "top_p", ("(0, 1]",)),
        ({"min_p": None}, "min_p", ("[0, 1]",)),
        ({"top_k": 1.5}, "top_k", ("-1",)),
        ({"seed": 2**64}, "seed", ("2**63",)),
        ({"seed": "7"}, "seed", ("integer",)),
        ({"ignore_eos": "yes"}, "ignore_eos", ("bool",)),
        ({"skip_special_tokens": 1}, "skip_special_tokens", ("bool",)),
        ({"presence_penalty": 3}, "presence_penalty", ("[-2, 2]",)),
        ({"frequency_penalty": "0"}, "frequency_penalty", ("[-2, 2]",)),
        ({"repetition_penalty": 0}, "repetition_penalty", ("> 0",)),
        ({"logit_bias": {"a": 1}}, "logit_bias", ("token ids",)),
        ({"logit_bias": {5: 101}}, "logit_bias", ("[-100, 100]",)),
        ({"logit_bias": [1]}, "logit_bias", ("map token ids",)),
        ({"min_tokens": 20}, "min_tokens", ("max_tokens=16",)),
        ({"logprobs": 21}, "logprobs", ("[0, 20]",)),
        ({"prompt_logprobs": -1}, "prompt_logprobs", ("[0, 20]",)),
        ({"logprob_start_len": 2}, "logprob_start_len", ("prompt_logprobs",)),
        ({"json_object": 1}, "json_object", ("boolean",)),
        ({"choice": "ab"}, "choice", ("non-empty list",)),
        ({"regex": "a", "choice": ["a"]}, "choice", ("at most one",)),
    ],
)
def test_every_sampling_field_is_type_and_range_checked(kwargs, param, words):
    refused(lambda: SamplingParams(**kwargs), param, *words)


def test_aliases_and_defaults():
    assert SamplingParams(max_new_tokens=7).max_tokens == 7
    assert SamplingParams().max_tokens == 16 and type(SamplingParams().max_tokens) is int
    assert SamplingParams(max_tokens=16).max_tokens == 16
    assert SamplingParams(stop="x", stop_token_ids=(3, 4)).stop_token_ids == [3, 4]
    at_limit = [f"{i:04d}" + "y" * 1020 for i in range(256)]  # 256 strings of 1,024 characters
    assert SamplingParams(stop=at_limit).stop == at_limit
    assert SamplingParams(max_tokens=3).clone(seed=1).max_tokens == 3  # a clone is no alias conflict
    assert SamplingParams(seed=2**63 - 1).seed == 2**63 - 1


# ------------------------------------------------------------------------------ LLM


def test_max_tokens_is_checked_against_the_context_at_submit_time(llm):
    err = refused(
        lambda: llm.generate("hi", SamplingParams(max_tokens=10**12), use_tqdm=False),
        "max_tokens",
        "max_context_len 256",
        "max_tokens=1000000000000",
    )
    n_prompt = len(llm.tokenizer.encode("hi", add_special_tokens=False))
    assert f"at most {CTX - n_prompt} new tokens" in str(err)
    assert_idle(llm.engine)
    # the last token of the context is allowed, one more is not
    ids = list(range(10, 10 + 200))
    out = llm.generate(prompt_token_ids=ids, sampling_params=SamplingParams(max_tokens=CTX - 200, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == CTX - 200 and out[0].outputs[0].finish_reason == "length"
    refused(
        lambda: llm.generate(prompt_token_ids=ids, sampling_params=SamplingParams(max_tokens=CTX - 199)), "max_tokens"
    )
    assert_idle(llm.engine)


def test_n_is_capped_by_engine_config(tokenizer, llm):
    refused(
        lambda: llm.generate("hi", SamplingParams(n=10000, max_tokens=16), use_tqdm=False), "n", "max_n 128", "10000"
    )
    small = null_llm(tokenizer, max_n=3)
    assert small.engine.config.max_n == 3
    refused(lambda: small.generate(prompt_token_ids=[5, 6], sampling_params=SamplingParams(n=4)), "n", "max_n 3")
    outs = small.generate(prompt_token_ids=[5, 6], sampling_params=SamplingParams(n=3, max_tokens=2), use_tqdm=False)
    assert len(outs[0].outputs) == 3
    assert_idle(small.engine)
    with pytest.raises(ValueError, match="max_n must be an integer >= 1"):
        null_llm(tokenizer, max_n=0)


def test_bad_prompts_name_the_argument(llm):
    refused(lambda: llm.generate(123), "prompts", "got int")
    refused(lambda: llm.generate(["fine", 7]), "prompts", "prompts[1]", "got int")
    refused(lambda: llm.generate(None), "prompts", "exactly one of prompts or prompt_token_ids")
    refused(lambda: llm.generate("a", prompt_token_ids=[1]), "prompts", "exactly one")
    refused(lambda: llm.generate(prompt_token_ids=[[1, 2], "x"]), "prompt_token_ids", "prompt_token_ids[1]")
    refused(lambda: llm.generate(prompt_token_ids=[1.5, 2]), "prompt_token_ids", "prompt_token_ids")
    refused(lambda: llm.generate({"text": "hi"}), "prompts", "'prompt' and/or 'prompt_token_ids'")
    refused(lambda: llm.generate(prompt_token_ids=[[10**9]]), "prompt", "outside the vocabulary")
    refused(lambda: llm.generate(""), "prompt", "empty")
    refused(lambda: llm.generate("hi", {"max_tokens": 4}), "sampling_params", "got dict", "SamplingParams(**")
    refused(lambda: llm.generate(["a", "b"], [SamplingParams()]), "sampling_params", "1 sampling_params for 2 prompts")
    refused(lambda: llm.generate("a", [SamplingParams(), "x"]), "sampling_params", "sampling_params[1]")
    assert_idle(llm.engine)


def test_token_prompts_in_vllm_shapes(llm):
    p = SamplingParams(max_tokens=2, temperature=0)
    one = llm.generate(prompt_token_ids=[1, 2, 3], sampling_params=p, use_tqdm=False)
    assert [o.prompt_token_ids for o in one] == [[1, 2, 3]]
    flat = llm.generate([1, 2, 3], p, use_tqdm=False)  # a list of ints is one token prompt (vLLM)
    assert [o.prompt_token_ids for o in flat] == [[1, 2, 3]]
    many = llm.generate([[4, 5], {"prompt_token_ids": [6]}, "hi"], p, use_tqdm=False)
    hi = llm.tokenizer.encode("hi", add_special_tokens=False)
    assert [o.prompt_token_ids for o in many] == [[4, 5], [6], hi]
    assert [o.outputs[0].token_ids for o in many] == [[0, 0]] * 3  # the null runner's argmax
    assert_idle(llm.engine)


def test_chat_roles_are_openais(llm):
    refused(lambda: llm.chat([{"role": "wizard", "content": "hi"}]), "messages", "messages[0]", "'wizard'", "developer")
    refused(lambda: llm.chat([{"role": "function", "content": "hi", "name": "f"}]), "messages", "deprecated")
    refused(lambda: llm.chat("hello"), "messages", "non-empty list")
    refused(lambda: llm.chat([]), "messages", "non-empty list")
    refused(lambda: llm.chat([[{"role": "user", "content": "a"}], ["x"]]), "messages", "messages[1]")
    for role in ("system", "developer", "user"):
        assert llm.render_chat([{"role": role, "content": "x"}, {"role": "user", "content": "hi"}])
    assert_idle(llm.engine)


def test_text_with_a_lone_surrogate_is_a_request_error_naming_the_field(llm, tokenizer):
    """A str holding a lone UTF-16 surrogate (U+D800..U+DFFF, e.g. half of an emoji cut from a
    JSON escape) is not valid Unicode: the tokenizer would raise a bare TypeError, and a stop
    string holding one could never match decoded text. Every text entry point names its field."""
    bad = "caf\u00e9 \ud83d tail"  # a high surrogate without its low half
    refused(lambda: llm.generate(bad), "prompts", "surrogate", "U+D83D", "position 5")
    refused(lambda: llm.generate(["ok", {"prompt": bad}]), "prompts", "prompts[1]", "surrogate")
    refused(lambda: llm.chat([{"role": "user", "content": bad}]), "messages", "surrogate")
    refused(lambda: llm.explain(bad), "prompt", "surrogate")
    refused(lambda: llm.explain([{"role": "user", "content": bad}]), "messages", "surrogate")
    refused(lambda: llm.select(bad, ["a"]), "prompt", "surrogate")
    refused(lambda: llm.select("ok", ["a", "b\udc00"]), "choices", "surrogate", "U+DC00")
    refused(lambda: llm.session(bad), "prompt", "surrogate")
    refused(lambda: llm.session([{"role": "user", "content": bad}]), "prompt", "surrogate")
    refused(lambda: SamplingParams(stop=["ok", "\udfff"]), "stop", "surrogate")
    with llm.session([{"role": "user", "content": "hi"}]) as s:
        refused(lambda: s.chat(bad), "message", "surrogate")
        refused(lambda: s.generate(bad), "text", "surrogate")
        refused(lambda: s.select(["a"], message=bad), "message", "surrogate")
        before = s.tokens
        out = s.chat("fine", SamplingParams(max_tokens=1))  # the refusals left the session as it was
        assert (
            out.prompt_token_ids[: len(before)] == before
            and s.tokens == out.prompt_token_ids + out.outputs[0].token_ids
        )
    assert llm.generate("emoji \U0001f600 ok", SamplingParams(max_tokens=1), use_tqdm=False)[0].prompt_token_ids == (
        tokenizer.encode("emoji \U0001f600 ok", add_special_tokens=False)
    )
    assert_idle(llm.engine)


def test_a_session_refuses_an_unhashable_namespace_when_made(llm, tokenizer):
    """``session(prompt, namespace=...)`` validates its namespace as it validates its prompt: at
    once (a RequestError naming ``namespace``), not at the session's first turn; nothing is pinned."""
    for ns in (["a"], {"t": 1}):
        refused(lambda ns=ns: llm.session("hello", namespace=ns), "namespace", "hashable")
    runner = NullRunner(len(tokenizer), 1, 8, max_context_len=CTX)
    with AsyncLLM(model_runner=runner, tokenizer=tokenizer, eos_token_ids=[], device="cpu", max_total_tokens=4096) as a:
        refused(lambda: a.session("hello", namespace=["a"]), "namespace", "hashable")
        asyncio.run(a.call_in_engine_thread(assert_idle))
    with llm.session("hello", namespace=("tenant", 1)) as s:  # a hashable one still works
        assert s.generate(" there", SamplingParams(max_tokens=1)).finished
    assert_idle(llm.engine)


# ------------------------------------------------------------------------------ AsyncLLM


def test_async_llm_checks_at_submit_time(tokenizer):
    runner = NullRunner(len(tokenizer), 1, 8, max_context_len=CTX)
    with AsyncLLM(model_runner=runner, tokenizer=tokenizer, eos_token_ids=[], device="cpu", max_total_tokens=4096) as a:

        async def first(*args, **kw):
            async for out in a.generate(*args, **kw):
                return out

        cases = [
            (("hi", SamplingParams(max_tokens=10**9)), {}, "max_tokens", "max_context_len 256"),
            (("hi", SamplingParams(n=129)), {}, "n", "max_n 128"),
            ((123,), {}, "prompt", "got int"),
            ((None,), {"prompt_token_ids": "abc"}, "prompt_token_ids", "list of integer token ids"),
            ((["a"],), {}, "prompt", "got list"),
            (("hi", {"max_tokens": 4}), {}, "sampling_params", "got dict"),
        ]
        for args, kw, param, words in cases:
            refused(lambda a=args, k=kw: asyncio.run(first(*a, **k)), param, words)
        out = asyncio.run(first(prompt_token_ids=[7, 8], sampling_params=SamplingParams(max_tokens=1)))
        assert out.finished and out.prompt_token_ids == [7, 8]
        assert a.num_unfinished_requests() == 0
        asyncio.run(a.call_in_engine_thread(assert_idle))


# ------------------------------------------------------------------------------ server


def test_server_enforces_the_same_limits(tokenizer):
    """The server answers 400 in OpenAI's format naming the field, from the same checks."""
    from radixkv.server.app import create_app

    runner = NullRunner(len(tokenizer), 1, 8, max_context_len=CTX)
    with AsyncLLM(
        model_runner=runner, tokenizer=tokenizer, eos_token_ids=[], device="cpu", max_total_tokens=4096, max_n=4
    ) as a:
        app = create_app(a, served_model_name="m")
        msgs = [{"role": "user", "content": "hi"}]

        async def run():
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
                cases = [
                    ("/v1/completions", {"prompt": "hi", "n": 5, "max_tokens": 1}, "n", "max_n 4"),
                    ("/v1/chat/completions", {"messages": msgs, "n": 5, "max_tokens": 1}, "n", "max_n 4"),
                    ("/v1/completions", {"prompt": "hi", "n": 0}, "n", ">= 1"),
                    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**9}, "max_tokens", "context"),
                    ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p", "(0, 1]"),
                    ("/v1/completions", {"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias", "token ids"),
                    ("/v1/completions", {"prompt": "hi", "logit_bias": {"9": 101}}, "logit_bias", "[-100, 100]"),
                    ("/v1/completions", {"prompt": "hi", "stop": [""]}, "stop", "non-empty"),
                    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages", ""),
                ]
                for path, body, param, words in cases:
                    r = await http.post(path, json={"model": "m", **body})
                    assert r.status_code == 400, (body, r.text)
                    err = r.json()["error"]
                    assert err["param"] == param and words in err["message"], (body, err)
                    assert err["type"] == "invalid_request_error", err
                ok = await http.post("/v1/completions", json={"model": "m", "prompt": "hi", "n": 4, "max_tokens": 1})
                assert ok.status_code == 200 and len(ok.json()["choices"]) == 4, ok.text

        asyncio.run(run())
        asyncio.run(a.call_in_engine_thread(assert_idle))


def _queue_bounded_llm(tokenizer, max_queued_requests: int) -> AsyncLLM:
    """An AsyncLLM over the null runner whose queue holds ``max_queued_requests``."""
    return AsyncLLM(
        model_runner=NullRunner(len(tokenizer), 1, 8, max_context_len=CTX),
        tokenizer=tokenizer,
        eos_token_ids=[],
        device="cpu",
        max_total_tokens=4096,
        max_queued_requests=max_queued_requests,
    )


def test_queue_is_bounded_by_max_queued_requests(tokenizer):
    """``EngineConfig.max_queued_requests`` bounds the requests waiting for admission: the engine
    refuses one more with a QueueFullError naming the field (nothing submitted), admits the
    queue at its next step, and then accepts again; the server answers 429 ``queue_full`` in
    OpenAI's error format."""
    from radixkv.engine import Engine
    from radixkv.errors import QueueFullError
    from radixkv.server.app import create_app

    assert EngineConfig().max_queued_requests is None  # unbounded by default, as SGLang / vLLM
    runner = NullRunner(len(tokenizer), 1, 8, max_context_len=CTX)
    cfg = EngineConfig(device="cpu", max_total_tokens=4096, max_queued_requests=2)
    engine = Engine(cfg, model_runner=runner, tokenizer=tokenizer, eos_token_ids=[])
    p = SamplingParams(max_tokens=3, ignore_eos=True)
    engine.add_request([5, 6], p)
    engine.add_request([7, 8], p)
    err = refused(
        lambda: engine.add_request([9, 10], p), "max_queued_requests", "max_queued_requests is 2", "2 requests wait"
    )
    assert isinstance(err, QueueFullError) and engine.num_unfinished_requests() == 2
    engine.step()  # both admitted: the queue is empty again
    assert engine.cache_stats()["running"] == 2
    engine.add_request([9, 10], p)
    engine.add_request([11, 12], p)
    refused(lambda: engine.add_request([13, 14], p), "max_queued_requests")
    while engine.has_unfinished_requests():
        engine.step()
    assert_idle(engine)
    with pytest.raises(ValueError, match="max_queued_requests must be None or an integer >= 0"):
        EngineConfig(max_queued_requests=-1).resolve()

    with _queue_bounded_llm(tokenizer, 0) as a:  # nothing may wait: every request is refused, deterministically
        app = create_app(a, served_model_name="m")

        async def run():
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
                r = await http.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 1})
                assert r.status_code == 429, r.text
                e = r.json()["error"]
                assert set(e) == {"message", "type", "param", "code"} and e["code"] == "queue_full", e
                assert "max_queued_requests is 0" in e["message"]

        asyncio.run(run())
        asyncio.run(a.call_in_engine_thread(assert_idle))


def test_a_refused_constrained_request_starts_no_grammar_compile(tokenizer):
    """A constrained request refused for a full queue (or a duplicate request id) started its
    grammar's compile first: an overloaded server answering 429 kept its one grammar thread
    compiling, in an unbounded queue, a schema for every request it refused, ahead of the
    compiles of the requests it accepted."""
    from radixkv.engine import Engine

    runner = NullRunner(len(tokenizer), 1, 8, max_context_len=CTX)
    cfg = EngineConfig(device="cpu", max_total_tokens=4096, max_queued_requests=1)
    engine = Engine(cfg, model_runner=runner, tokenizer=tokenizer, eos_token_ids=[])
    free = SamplingParams(max_tokens=3, ignore_eos=True)
    engine.add_request([5, 6], free, request_id="waiting")
    for i in range(3):
        schema = {"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]}
        p = SamplingParams(max_tokens=3, json_schema=schema)
        refused(lambda p=p: engine.add_request([7, 8], p), "max_queued_requests", "max_queued_requests is 1")
    engine.step()  # admitted: the queue is empty again
    p = SamplingParams(max_tokens=3, json_object=True)
    refused(lambda: engine.add_request([9], p, request_id="waiting"), "request_id", "already in use")
    assert engine.grammars._compiled == {} and engine.grammars._executor is None
    while engine.has_unfinished_requests():
        engine.step()
    assert_idle(engine)


def test_a_batch_larger_than_the_queue_is_a_400_not_a_429(tokenizer):
    """A completions prompt list or a /generate text list of more prompts than
    ``max_queued_requests`` can never be queued, even by an idle server: a 400 naming the prompt
    field and the limit (before the fix a 429 ``queue_full`` whose retry never succeeds, its
    message counting the batch's own prompts as waiting); a batch at the limit runs."""
    from radixkv.server.app import create_app

    with _queue_bounded_llm(tokenizer, 3) as a:
        app = create_app(a, served_model_name="m")

        async def run():
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
                for path, body, param in [
                    ("/v1/completions", {"model": "m", "prompt": ["a", "b", "c", "d"], "max_tokens": 1}, "prompt"),
                    ("/v1/completions", {"model": "m", "prompt": [[5], [6], [7], [8]], "max_tokens": 1}, "prompt"),
                    ("/generate", {"text": ["a", "b", "c", "d"], "sampling_params": {"max_new_tokens": 1}}, "text"),
                ]:
                    r = await http.post(path, json=body)
                    assert r.status_code == 400, (path, r.text)
                    e = r.json()["error"]
                    assert (e["param"], e["type"]) == (param, "invalid_request_error"), e
                    assert "a batch of 4 prompts" in e["message"] and "max_queued_requests 3" in e["message"], e
                three = {"model": "m", "prompt": ["a", "b", "c"], "max_tokens": 1, "n": 2}
                r = await http.post("/v1/completions", json=three)
                assert r.status_code == 200 and len(r.json()["choices"]) == 6, r.text

        asyncio.run(run())
        asyncio.run(a.call_in_engine_thread(assert_idle))


def test_a_batch_larger_than_a_tenants_share_of_the_queue_is_a_400(tokenizer):
    """``max_queued_requests_per_tenant`` bounds a batch as ``max_queued_requests`` does: a
    completions prompt list of more prompts than one tenant may queue is a 400 naming the prompt
    field and the limit; at the limit it runs."""
    from radixkv.server.app import create_app

    runner = NullRunner(len(tokenizer), 1, 8, max_context_len=CTX)
    kw = dict(model_runner=runner, tokenizer=tokenizer, eos_token_ids=[], device="cpu", max_total_tokens=4096)
    with AsyncLLM(**kw, max_queued_requests=10, max_queued_requests_per_tenant=2) as a:
        app = create_app(a, served_model_name="m")

        async def run():
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
                r = await http.post("/v1/completions", json={"model": "m", "prompt": ["a", "b", "c"], "max_tokens": 1})
                assert r.status_code == 400, r.text
                e = r.json()["error"]
                assert e["param"] == "prompt" and "max_queued_requests_per_tenant 2" in e["message"], e
                r = await http.post("/v1/completions", json={"model": "m", "prompt": ["a", "b"], "max_tokens": 1})
                assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text

        asyncio.run(run())
        asyncio.run(a.call_in_engine_thread(assert_idle))


def test_llm_generate_of_a_batch_larger_than_the_queue_is_a_value_error(tokenizer):
    """``LLM.generate`` submits a batch at once, so a batch of more prompts than
    ``max_queued_requests`` (or more of one tenant's than ``max_queued_requests_per_tenant``)
    could never be queued: a RequestError naming the field, nothing submitted (before, a
    QueueFullError 'retry later' after the first prompts were queued and aborted); a batch at the
    limit runs."""
    from radixkv.errors import QueueFullError
    from radixkv.namespace import Namespace

    p = SamplingParams(max_tokens=2, ignore_eos=True)
    with null_llm(tokenizer, max_queued_requests=3) as llm:
        err = refused(lambda: llm.generate([[5], [6], [7], [8]], p, use_tqdm=False), "max_queued_requests")
        assert not isinstance(err, QueueFullError) and "a batch of 4 prompts" in str(err)
        assert len(llm.generate([[5], [6], [7]], p, use_tqdm=False)) == 3
        assert_idle(llm.engine)
    with null_llm(tokenizer, max_queued_requests_per_tenant=2, namespace=Namespace(tenant="a")) as llm:
        err = refused(lambda: llm.generate([[5], [6], [7]], p, use_tqdm=False), "max_queued_requests_per_tenant")
        assert "a batch of 3 prompts" in str(err) and "max_queued_requests_per_tenant 2" in str(err)
        outs = llm.generate([[5], [6]], p, use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in outs] == [2, 2]
        assert_idle(llm.engine)
