"""Per-request failure isolation (issue 19): when sampling, a logits processor or a grammar matcher
raises for ONE request's row, only that request ends (finish_reason "error" and
``RequestOutput.error`` for the Python API, ``RequestFailed`` from AsyncLLM, a 500 in OpenAI's
format or an in-band error on a stream from the server), its slots are released, and every other
request of the batch gets exactly the greedy tokens it gets without the faulty one. The faults are
injected by wrapping the real function so that it raises for the marked request's row only (the
default model, CPU, float32; real ShareGPT prompts)."""

from __future__ import annotations

import asyncio
import json
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from server_helpers import Server, assert_pool_whole, new_async_llm  # noqa: E402

from radixkv import LLM, AsyncLLM, SamplingParams  # noqa: E402
from radixkv.datasets import load_conversations  # noqa: E402
from radixkv.errors import RequestFailed  # noqa: E402
from radixkv.sampling import pipeline, processors  # noqa: E402
from radixkv.sampling.grammar import GrammarState  # noqa: E402

pytestmark = pytest.mark.timeout(600)
MAX_TOKENS = 8
BAD_TOKEN = 7  # a logit_bias on this token marks the faulty request for the processor fault


@pytest.fixture(scope="module")
def llm(default_model):
    return LLM(device="cpu", loaded_model=default_model, max_total_tokens=4096)


@pytest.fixture(scope="module")
def prompts(llm):
    convs = load_conversations(4, 1, max_user_chars=200)
    return [
        llm.tokenizer.encode(llm.render_chat([{"role": "user", "content": c[0]}]), add_special_tokens=False)
        for c in convs
    ]


def assert_no_leak(llm):
    llm.engine.check_integrity()
    s = llm.cache_stats()
    assert s["protected"] == 0 and s["pinned"] == 0 and s["running"] == 0 and s["waiting"] == 0, s
    assert s["free"] + s["evictable"] + s["pinned"] == s["capacity"], s


def ids(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def sampler_fault(monkeypatch, bad: SamplingParams, after: int = 0) -> None:
    """``sample`` raises for any batch holding ``bad``'s rows once they drew ``after`` tokens
    (after drawing: the other rows' generators have moved on)."""
    real, calls = pipeline.sample, [0]

    def sample(x, params, gens, default=None):
        out = real(x, params, gens, default)
        if any(p is bad for p in params):
            calls[0] += 1
            if calls[0] > after:
                raise RuntimeError("injected sampler fault")
        return out

    monkeypatch.setattr(pipeline, "sample", sample)


def processor_fault(monkeypatch) -> None:
    """``apply_logit_bias`` raises for any batch holding a bias on BAD_TOKEN."""
    real = processors.apply_logit_bias

    def apply_logit_bias(x, rows, bias_ids, bias_vals):
        if any(BAD_TOKEN in t.tolist() for t in bias_ids):
            raise IndexError("injected logit_bias fault")
        return real(x, rows, bias_ids, bias_vals)

    monkeypatch.setattr(processors, "apply_logit_bias", apply_logit_bias)


def grammar_fault(monkeypatch) -> None:
    """Every grammar matcher raises when it is advanced (only the faulty request has one)."""

    def accept(self, token_id):
        raise RuntimeError("injected matcher fault")

    monkeypatch.setattr(GrammarState, "accept", accept)


CASES = {
    # kind: (the others' params, the faulty one's params, tokens the faulty one gets first)
    "sampler": (SamplingParams(temperature=0, max_tokens=MAX_TOKENS), None, 0),
    "sampler_mid_decode_n2": (SamplingParams(temperature=0, max_tokens=MAX_TOKENS), None, 3),
    "processor": (
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logit_bias={5: 0.25}, logprobs=2),
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logit_bias={BAD_TOKEN: 0.5}),
        0,
    ),
    "grammar": (
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, repetition_penalty=1.1),
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, regex="[a-z ]+"),
        0,
    ),
}


@pytest.mark.parametrize("kind", list(CASES))
def test_one_failing_row_fails_only_its_request(kind, llm, prompts, monkeypatch):
    good, bad, after = CASES[kind]
    if bad is None:
        bad = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, n=2 if after else 1)
    others, victim = prompts[:3], prompts[3]
    ref = llm.generate(prompt_token_ids=others, sampling_params=good)  # without the faulty request
    victim_alone = llm.generate(prompt_token_ids=[victim], sampling_params=bad.clone(n=1))[0]
    failed_before = llm.engine.num_failed_requests
    if kind.startswith("sampler"):
        sampler_fault(monkeypatch, bad, after)
    elif kind == "processor":
        processor_fault(monkeypatch)
    else:
        grammar_fault(monkeypatch)

    outs = llm.generate(prompt_token_ids=[*others[:2], victim, others[2]], sampling_params=[good, good, bad, good])
    got = outs[:2] + outs[3:]
    assert ids(got) == ids(ref)
    assert [o.outputs[0].finish_reason for o in got] == [o.outputs[0].finish_reason for o in ref]
    assert all(o.error is None for o in got)
    if good.logprobs is not None:
        for o, r in zip(got, ref):
            a = [{t: round(lp.logprob, 4) for t, lp in pos.items()} for pos in o.outputs[0].logprobs]
            b = [{t: round(lp.logprob, 4) for t, lp in pos.items()} for pos in r.outputs[0].logprobs]
            assert a == b
    v = outs[2]
    assert v.finished and [c.finish_reason for c in v.outputs] == ["error"] * bad.n
    assert v.error is not None and "injected" in v.error
    # the tokens it drew before the fault are the ones it draws alone
    assert v.outputs[0].token_ids == victim_alone.outputs[0].token_ids[:after]
    assert llm.engine.num_failed_requests == failed_before + 1
    assert_no_leak(llm)

    monkeypatch.undo()  # the engine keeps running: the same batch now succeeds
    again = llm.generate(prompt_token_ids=[*others[:2], victim, others[2]], sampling_params=[good, good, bad, good])
    assert ids(again[:2] + again[3:]) == ids(ref)
    assert all(o.error is None for o in again)
    assert_no_leak(llm)


def test_seeded_rows_draw_the_same_tokens_when_a_batch_is_redone(llm, prompts, monkeypatch):
    """The redo row by row restores the generators: a seeded random row draws what it draws
    without the faulty request in its batch."""
    seeded = [SamplingParams(temperature=0.8, top_p=0.9, seed=11 + i, max_tokens=MAX_TOKENS) for i in range(3)]
    ref = llm.generate(prompt_token_ids=prompts[:3], sampling_params=seeded)
    bad = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    sampler_fault(monkeypatch, bad, after=1)
    outs = llm.generate(prompt_token_ids=[*prompts[:3], prompts[3]], sampling_params=[*seeded, bad])
    assert ids(outs[:3]) == ids(ref)
    assert outs[3].outputs[0].finish_reason == "error" and len(outs[3].outputs[0].token_ids) == 1
    assert_no_leak(llm)


def test_server_answers_the_failed_request_and_serves_the_others(default_model, prompts, monkeypatch):
    """Over HTTP: the faulty request gets a 500 ``request_failed`` in OpenAI's error format (or
    that error in-band on its stream); a concurrent request gets its normal answer, equal to the
    same request run alone; /health answers and the pool is whole afterwards."""
    import httpx

    from radixkv.server import create_app

    alm = new_async_llm(default_model, max_total_tokens=4096)
    srv = Server(create_app(alm))
    try:
        url = srv.base_url
        good = {"model": "smollm2-135m", "prompt": prompts[0], "max_tokens": MAX_TOKENS, "temperature": 0}
        bad = {**good, "prompt": prompts[1], "logit_bias": {str(BAD_TOKEN): 0.5}}
        with httpx.Client(timeout=120) as c:
            alone = c.post(f"{url}/v1/completions", json=good).json()["choices"][0]["text"]
        processor_fault(monkeypatch)

        async def both(stream: bool):
            async with httpx.AsyncClient(timeout=120) as c:
                if not stream:
                    return await asyncio.gather(
                        c.post(f"{url}/v1/completions", json=good), c.post(f"{url}/v1/completions", json=bad)
                    )

                async def read(body):
                    async with c.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
                        return r.status_code, [ln async for ln in r.aiter_lines() if ln.startswith("data: ")]

                return await asyncio.gather(read(good), read(bad))

        ok, failed = asyncio.run(both(False))
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == alone
        assert failed.status_code == 500
        err = failed.json()["error"]
        assert err["type"] == "server_error" and err["code"] == "request_failed" and "injected" in err["message"]
        assert set(err) >= {"message", "type", "param", "code"}

        (s_ok, ok_lines), (s_bad, bad_lines) = asyncio.run(both(True))
        assert s_ok == 200 and ok_lines[-1] == "data: [DONE]"
        text = "".join(
            ch["text"] for ln in ok_lines[:-1] for ch in json.loads(ln[6:]).get("choices", []) if "text" in ch
        )
        assert text == alone
        # the failure comes before any token (its first step raised): headers not yet sent -> 500,
        # or, once streaming, an in-band error event before [DONE]
        if s_bad == 200:
            events = [json.loads(ln[6:]) for ln in bad_lines[:-1]]
            assert "error" in events[-1] and "injected" in events[-1]["error"]["message"]
        else:
            assert s_bad == 500
        with httpx.Client(timeout=30) as c:
            assert c.get(f"{url}/health").status_code == 200
        assert_pool_whole(alm)
        assert alm.engine.num_failed_requests == 2
    finally:
        srv.stop()
        alm.shutdown()


@pytest.mark.parametrize("front", ["LLM", "AsyncLLM"])
def test_a_failed_session_turn_leaves_the_session_as_it_was(front, llm, default_model, prompts, monkeypatch):
    """A turn whose sampling raised ran its finish hook all the same: the session advanced by the
    partial reply (its context and pin moved) although the turn failed (``finish_reason``
    "error"; ``RequestFailed`` on AsyncLLM). It now stays as it was, as after an abort."""
    processor_fault(monkeypatch)
    bad = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logit_bias={BAD_TOKEN: 0.5})
    good = SamplingParams(temperature=0, max_tokens=4)
    if front == "LLM":
        s = llm.session(prompts[0])
        before = (s.tokens, s.pinned_tokens)
        out = s.generate(prompt_token_ids=prompts[1][:5], sampling_params=bad)
        assert out.outputs[0].finish_reason == "error" and (s.tokens, s.pinned_tokens) == before
        ok = s.generate(prompt_token_ids=prompts[1][:5], sampling_params=good)
        assert s.tokens == before[0] + prompts[1][:5] + ok.outputs[0].token_ids
        s.close()
        assert_no_leak(llm)
        return

    async def run(alm):
        async with alm.session(prompts[0]) as s:
            before = (s.tokens, s.pinned_tokens)
            with pytest.raises(RequestFailed):
                await s.generate(prompt_token_ids=prompts[1][:5], sampling_params=bad)
            assert (s.tokens, s.pinned_tokens) == before
        return await alm.call_in_engine_thread(lambda e: (e.num_unfinished_requests(), e.cache_stats()["pinned"]))

    alm = AsyncLLM(device="cpu", loaded_model=default_model, max_total_tokens=4096)
    try:
        assert asyncio.run(run(alm)) == (0, 0)
    finally:
        alm.shutdown()
