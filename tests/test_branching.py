"""Branching workloads end to end on the default model (SmolLM2-135M-Instruct, CPU, float32):

* the issue's fan-out (a ~340-token system prompt + 4 questions through ``LLM.chat``) computes the
  system prompt once, at page_size 1 and 16, with exact prefill counts, all first tokens in one
  step, and transformers' greedy outputs;
* the same through concurrent ``AsyncLLM`` requests (also one arriving while the shared prefix is
  mid-way through chunked prefill) and through one ``/v1/completions`` request with a list of
  prompts on a real server (one server in this module);
* chat sessions continue token for token, each turn computing only its new tokens; forks and
  ``select`` (scored against transformers' log-probabilities).

First-token steps come from the engine's events (``StepFinished.tokens_for``).
"""

from __future__ import annotations

import asyncio
import math
import os
import threading

import httpx
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from radixkv import LLM, SamplingParams  # noqa: E402
from radixkv.async_llm import AsyncLLM  # noqa: E402
from radixkv.chat_template import encode_chat, render_chat  # noqa: E402
from radixkv.engine import RequestAdmitted, StepFinished  # noqa: E402
from radixkv.errors import RequestError  # noqa: E402

pytestmark = pytest.mark.timeout(900)

SYSTEM = {"role": "system", "content": "You are a meticulous assistant for the ACME corporation. " * 30}
QUESTIONS = ["What is 2+2?", "Name a fruit.", "What color is the sky?", "Say hello."]
GREEDY = SamplingParams(temperature=0, max_tokens=8)


def lcp(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def trie_tokens(prompts) -> int:
    root: dict = {}
    n = 0
    for p in prompts:
        node = root
        for t in p:
            if t not in node:
                node[t] = {}
                n += 1
            node = node[t]
    return n


def expected_prefill(prompts_in_admission_order, page_size) -> int:
    """Waiting together, admitted in this order in one step: each computes all but what it shares
    with the rows admitted before it (floored to whole pages, its last token always its own)."""
    total = 0
    for i, p in enumerate(prompts_in_admission_order):
        share = max((lcp(p, q) for q in prompts_in_admission_order[:i]), default=0)
        total += len(p) - min(share, len(p) - 1) // page_size * page_size
    return total


class Events:
    """Admissions and each request's first-token step, recorded on the engine thread."""

    def __init__(self, engine):
        self.admitted: list[RequestAdmitted] = []
        self.first_token: dict[str, int] = {}
        self.off = engine.events.subscribe(self._on, (RequestAdmitted, StepFinished))

    def _on(self, ev):
        if isinstance(ev, RequestAdmitted):
            self.admitted.append(ev)
        else:
            for rid, _ in ev.tokens_for:
                self.first_token.setdefault(rid, ev.step)


@pytest.fixture(scope="module")
def hf_greedy(default_model, hf_default):
    memo = {}

    def run(ids, max_tokens=8):
        key = (tuple(ids), max_tokens)
        if key not in memo:
            with torch.no_grad():
                out = hf_default.generate(
                    torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                    do_sample=False, max_new_tokens=max_tokens, pad_token_id=default_model.tokenizer.eos_token_id,
                )  # fmt: skip
            memo[key] = out[0, len(ids) :].tolist()
        return memo[key]

    return run


@pytest.fixture(scope="module")
def llms(default_model):
    return {ps: LLM(device="cpu", loaded_model=default_model, max_total_tokens=4096, page_size=ps) for ps in (1, 16)}


def assert_idle(llm):
    llm.engine.check_integrity()
    s = llm.cache_stats()
    assert s["running"] == 0 and s["waiting"] == 0
    assert s["free"] + s["evictable"] + s["pinned"] == s["capacity"] and s["protected"] == s["pinned"]
    return s


@pytest.mark.parametrize("page_size", [1, 16])
def test_fan_out_chat_computes_the_system_prompt_once(llms, hf_greedy, page_size):
    llm = llms[page_size]
    assert llm.reset_prefix_cache()
    convs = [[SYSTEM, {"role": "user", "content": q}] for q in QUESTIONS]
    prompts = [encode_chat(llm.tokenizer, c) for c in convs]
    shared = lcp(prompts[0], prompts[1])
    assert shared > 330 and all(lcp(prompts[0], p) >= shared for p in prompts[2:])
    ev = Events(llm.engine)
    before = llm.cache_stats()["prefill_tokens"]
    try:
        outs = llm.chat(convs, GREEDY, use_tqdm=False)
    finally:
        ev.off()
    for p, o in zip(prompts, outs):
        assert o.prompt_token_ids == p
        assert o.outputs[0].token_ids == hf_greedy(p)
    computed = llm.cache_stats()["prefill_tokens"] - before
    order = [next(p for p, o in zip(prompts, outs) if o.request_id == e.request_id) for e in ev.admitted]
    assert computed == expected_prefill(order, page_size)
    if page_size == 1:
        # the system prompt (and the template around it) once, then each question's own tokens
        assert computed == trie_tokens(prompts) == shared + sum(len(p) - shared for p in prompts) - 1
        # ("What" starts two questions: computed once too)
    else:
        floor = shared // 16 * 16
        assert computed == len(order[0]) + sum(len(p) - floor for p in order[1:])
    assert len({e.step for e in ev.admitted}) == 1  # all four admitted together ...
    assert len({ev.first_token[o.request_id] for o in outs}) == 1  # ... and sampled in the same step
    cached = {o.request_id: o.num_cached_tokens for o in outs}
    assert [cached[e.request_id] for e in ev.admitted] == [0] + [e.num_shared_tokens for e in ev.admitted[1:]]
    assert_idle(llm)


def test_branching_prompts_in_one_generate(llms, hf_greedy):
    """Three branching text prompts (one a prefix of another) in one generate call."""
    llm = llms[1]
    assert llm.reset_prefix_cache()
    texts = [
        "The history of the Roman Empire begins with",
        "The history of the Roman Empire begins with the founding of Rome, which",
        "The history of the Roman Empire ends with",
    ]
    ids = [llm.tokenizer.encode(t, add_special_tokens=False) for t in texts]
    before = llm.cache_stats()["prefill_tokens"]
    outs = llm.generate(texts, GREEDY, use_tqdm=False)
    for p, o in zip(ids, outs):
        assert o.outputs[0].token_ids == hf_greedy(p)
    # the prefix prompt computes nothing: it samples from the longer prompt's row
    assert llm.cache_stats()["prefill_tokens"] - before == trie_tokens(ids)
    assert_idle(llm)


# ---------------------------------------------------------------------------------- AsyncLLM
@pytest.fixture(scope="module")
def alm(default_model):
    from radixkv.config import EngineConfig
    from radixkv.engine import Engine

    engine = Engine(
        EngineConfig(device="cpu", page_size=1, max_total_tokens=4096, chunked_prefill_size=128),
        loaded_model=default_model,
    )
    with AsyncLLM(engine=engine) as a:
        yield a


def async_idle(alm):
    asyncio.run(alm.call_in_engine_thread(lambda e: e.check_integrity()))
    s = alm.get_cache_stats()
    assert s["running"] == 0 and s["waiting"] == 0 and s["protected"] == s["pinned"]
    assert s["free"] + s["evictable"] + s["pinned"] == s["capacity"]
    return s


async def final(alm, prompt, params, rid=None):
    outs = [o async for o in alm.generate(prompt_token_ids=prompt, sampling_params=params, request_id=rid)]
    return outs[-1]


def test_concurrent_async_requests_share_the_prefix(alm, hf_greedy):
    prompts = [encode_chat(alm.tokenizer, [SYSTEM, {"role": "user", "content": q}]) for q in QUESTIONS]
    assert asyncio.run(alm.reset_prefix_cache())
    ev = Events(alm.engine)
    before = alm.get_cache_stats()["prefill_tokens"]

    async def main():
        return await asyncio.gather(*(final(alm, p, GREEDY, f"conc-{i}") for i, p in enumerate(prompts)))

    try:
        outs = asyncio.run(main())
    finally:
        alm.subscribe(lambda e: None)  # a round trip: every event of the run has been delivered
        ev.off()
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(p)
    # whether they arrived in one step or over two, the shared prefix was computed once
    assert alm.get_cache_stats()["prefill_tokens"] - before == trie_tokens(prompts)
    steps = sorted(ev.first_token[o.request_id] for o in outs)
    assert steps[-1] - steps[0] <= 1 + (-(-len(prompts[0]) // 128) - 1), steps
    async_idle(alm)


def test_async_request_arriving_mid_chunked_prefill_joins_its_last_chunk(alm, hf_greedy):
    """The first request's ~360-token prompt runs in chunks of 128; the other three arrive after
    its first chunk (the engine thread is held in that step's event until they are posted). They
    wait for the shared prefix instead of computing it, and are admitted on top of its last chunk:
    their first tokens come in the same step as the first request's."""
    prompts = [encode_chat(alm.tokenizer, [SYSTEM, {"role": "user", "content": q}]) for q in QUESTIONS]
    assert asyncio.run(alm.reset_prefix_cache())
    ev = Events(alm.engine)
    resume = threading.Event()
    state = {}

    def hold(e):
        if e.samples == (("mid-0", 0),) and not e.sampled[0] and "held" not in state:
            state["held"] = e.step
            state["loop"].call_soon_threadsafe(state["first_chunk"].set)
            assert resume.wait(120)

    hold_off = alm.engine.events.subscribe(hold, (StepFinished,))
    before = alm.get_cache_stats()["prefill_tokens"]

    async def main():
        state["loop"], state["first_chunk"] = asyncio.get_running_loop(), asyncio.Event()
        first = asyncio.ensure_future(final(alm, prompts[0], GREEDY, "mid-0"))
        await state["first_chunk"].wait()
        rest = [asyncio.ensure_future(final(alm, p, GREEDY, f"mid-{i}")) for i, p in enumerate(prompts[1:], 1)]
        await asyncio.sleep(0)  # each task runs to its first await: its request is posted
        resume.set()
        return await asyncio.gather(first, *rest)

    try:
        outs = asyncio.run(main())
    finally:
        resume.set()
        hold_off()
        ev.off()
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(p)
    chunks = -(-len(prompts[0]) // 128)
    assert chunks >= 3 and state["held"] == ev.first_token["mid-0"] - chunks + 1
    assert {ev.first_token[f"mid-{i}"] for i in range(4)} == {ev.first_token["mid-0"]}
    assert alm.get_cache_stats()["prefill_tokens"] - before == trie_tokens(prompts)
    shared = {e.request_id: e.num_shared_tokens for e in ev.admitted}
    assert all(shared[f"mid-{i}"] > 0 for i in (1, 2, 3))  # borrowed from the last chunk in flight
    async_idle(alm)


# ---------------------------------------------------------------------------------- server
@pytest.fixture(scope="module")
def server(alm):
    from server_helpers import Server

    from radixkv.server.app import create_app

    s = Server(create_app(alm, served_model_name="smollm2-135m"))
    yield s
    s.stop()


def test_server_list_of_prompts_computes_the_shared_prefix_once(server, alm):
    prefix = "The following is a conversation log of the ACME support desk, kept for training. " * 12
    prompts = [prefix + f"Customer {i}: {q}\nAgent:" for i, q in enumerate(QUESTIONS)]
    ids = [alm.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    assert httpx.post(server.base_url + "/flush_cache", timeout=60).status_code == 200
    ev = Events(alm.engine)
    before = alm.get_cache_stats()["prefill_tokens"]
    body = {"model": "smollm2-135m", "prompt": prompts, "max_tokens": 6, "temperature": 0}
    try:
        r = httpx.post(server.base_url + "/v1/completions", json=body, timeout=300)
    finally:
        alm.subscribe(lambda e: None)
        ev.off()
    assert r.status_code == 200, r.text
    data = r.json()
    assert [c["index"] for c in data["choices"]] == [0, 1, 2, 3]
    assert alm.get_cache_stats()["prefill_tokens"] - before == trie_tokens(ids)
    assert data["usage"]["prompt_tokens_details"]["cached_tokens"] == sum(map(len, ids)) - trie_tokens(ids)
    steps = sorted(ev.first_token.values())
    assert len(steps) == 4 and steps[-1] - steps[0] <= 1, steps
    # the same answers as each prompt alone on a cold cache
    for p, c in zip(prompts, data["choices"]):
        assert httpx.post(server.base_url + "/flush_cache", timeout=60).status_code == 200
        alone = httpx.post(server.base_url + "/v1/completions", json=dict(body, prompt=p), timeout=300).json()
        assert alone["choices"][0]["text"] == c["text"]
    async_idle(alm)


# ---------------------------------------------------------------------------------- sessions
def test_chat_session_continues_token_for_token(llms, hf_greedy):
    llm = llms[1]
    assert llm.reset_prefix_cache()
    params = SamplingParams(temperature=0, max_tokens=24)
    with llm.session([SYSTEM]) as s:
        o1 = s.chat("Name a color.", params)
        assert o1.num_cached_tokens == 0 and o1.outputs[0].token_ids == hf_greedy(o1.prompt_token_ids, 24)
        o2 = s.chat("And another one?", params)
        # turn 2's prompt is turn 1's prompt + the reply + the template's text for the new turn
        ctx1 = o1.prompt_token_ids + o1.outputs[0].token_ids
        assert o2.prompt_token_ids[: len(ctx1)] == ctx1
        assert o2.num_cached_tokens == len(ctx1) - 1  # all but the reply's last token (no K/V)
        assert o2.outputs[0].token_ids == hf_greedy(o2.prompt_token_ids, 24)
        conv = [
            SYSTEM,
            {"role": "user", "content": "Name a color."},
            {"role": "assistant", "content": o1.outputs[0].text},
            {"role": "user", "content": "And another one?"},
        ]
        assert s.messages[:4] == conv
        if o1.outputs[0].finish_reason == "stop":  # the model closed its turn: the same text as a fresh render
            text = llm.tokenizer.decode(o2.prompt_token_ids, skip_special_tokens=False)
            assert text == render_chat(llm.tokenizer, conv, add_generation_prompt=True)
        st = assert_idle(llm)
        assert st["pinned"] == s.pinned_tokens == len(s.tokens) - 1
    assert assert_idle(llm)["pinned"] == 0


def test_a_reply_cut_by_a_stop_string_joins_the_context_as_returned(llms):
    """A reply that ended on a stop string joins the context as the text it returned (the stop
    string cut off): the tokens before it, plus the tokens of the rest of the text when the stop
    string starts inside a token. So a chat session's next prompt is still a fresh render of its
    conversation, and the kept tokens' K/V is reused."""
    llm = llms[1]
    tok = llm.tokenizer
    assert llm.reset_prefix_cache()
    with llm.session([{"role": "system", "content": "You count."}]) as s:
        o1 = s.chat("Count from 1 to 10 separated by commas.", SamplingParams(temperature=0, max_tokens=40, stop=["5"]))
        c1 = o1.outputs[0]
        assert (c1.text, c1.finish_reason, c1.stop_reason) == ("1. 1\n2. 2\n3. 3\n4. 4\n", "stop", "5")
        kept = len(c1.token_ids) - 1  # the stop string is the last token: it is dropped
        assert tok.decode(c1.token_ids[:kept]) == c1.text
        o2 = s.chat("Continue.", SamplingParams(temperature=0, max_tokens=4))
        assert tok.decode(o2.prompt_token_ids, skip_special_tokens=False) == render_chat(
            tok, s.messages[:-1], add_generation_prompt=True
        )
        assert o2.prompt_token_ids[: len(o1.prompt_token_ids) + kept] == o1.prompt_token_ids + c1.token_ids[:kept]
        assert o2.num_cached_tokens == len(o1.prompt_token_ids) + kept
        assert_idle(llm)
    with llm.session("The quick brown fox") as s:  # a stop string that starts inside a token (" bear")
        o = s.generate(None, SamplingParams(temperature=0, max_tokens=20, stop=["ear."]))
        c = o.outputs[0]
        assert (c.text, c.stop_reason) == (" with a quick brown b", "ear.")
        assert tok.decode(s.tokens) == "The quick brown fox with a quick brown b"
        n = len(o.prompt_token_ids) + 4  # " with a quick brown": the tokens before " bear"
        assert s.tokens[:n] == o.prompt_token_ids + c.token_ids[:4]
        assert s.tokens[n:] == tok.encode(" b", add_special_tokens=False)
        ctx = s.tokens
        nxt = s.generate(" and", SamplingParams(temperature=0, max_tokens=2))
        assert nxt.prompt_token_ids[: len(ctx)] == ctx
        assert nxt.num_cached_tokens == n
        assert_idle(llm)
    assert assert_idle(llm)["pinned"] == 0


def test_a_chat_reply_stopped_by_a_token_that_is_not_the_end_of_turn_is_closed_by_the_template(llms, default_model):
    """A chat reply that stopped on a token that is not the template's end-of-turn (one of its
    ``stop_token_ids``, whose text the reply leaves out as vLLM's; or another EOS, as Qwen2.5's
    ``<|endoftext|>`` beside ``<|im_end|>``) is closed by the template's own end-of-turn: the next
    prompt is still a fresh render of the conversation. With ``include_stop_str_in_output`` the
    token's text is the reply's and stays. (The token stayed before the end-of-turn: the model was
    shown "Paris.<|im_end|>" where ``messages`` said "Paris".) The tokens before it keep their K/V."""
    tok = llms[1].tokenizer
    dot = tok.encode(".", add_special_tokens=False)
    two_eos = LLM(device="cpu", loaded_model=default_model, max_total_tokens=1024, eos_token_ids=[2, 0])
    question = [{"role": "user", "content": "What is the capital of France? Answer in a sentence."}]
    cases = [  # (engine, params, the reply's text, its last token)
        (llms[1], dict(stop_token_ids=dot), "The capital of France is Paris", dot[0]),
        (llms[1], dict(stop_token_ids=dot, include_stop_str_in_output=True), "The capital of France is Paris.", dot[0]),
        (two_eos, dict(min_tokens=3, logit_bias={0: 100.0}), "The capital of", 0),  # <|endoftext|>, an EOS
    ]
    for llm, kw, text, last in cases:
        assert llm.reset_prefix_cache()
        with llm.session(question) as s:
            o1 = s.chat(None, SamplingParams(temperature=0, max_tokens=30, **kw))
            c1 = o1.outputs[0]
            assert (c1.text, c1.finish_reason, c1.token_ids[-1]) == (text, "stop", last)
            o2 = s.chat("And of Italy?", SamplingParams(temperature=0, max_tokens=2))
            assert s.messages[1] == {"role": "assistant", "content": text}
            assert tok.decode(o2.prompt_token_ids, skip_special_tokens=False) == render_chat(
                tok, s.messages[:-1], add_generation_prompt=True
            )
            kept = len(c1.token_ids) - (not text.endswith("."))  # the stop token goes unless it is text
            assert o2.prompt_token_ids[: len(o1.prompt_token_ids) + kept] == o1.prompt_token_ids + c1.token_ids[:kept]
            assert o2.num_cached_tokens == len(o1.prompt_token_ids) + len(c1.token_ids) - 1
        assert assert_idle(llm)["pinned"] == 0


def test_a_reply_without_text_joins_the_conversation_as_its_decoded_tokens(llms):
    """A chat turn with ``detokenize=False`` (no ``text``) adds the reply to ``messages`` as its
    tokens' text, as with ``detokenize=True`` (it added an empty assistant message, so
    ``messages`` no longer matched the context)."""
    llm = llms[1]
    convs = []
    for detok in (True, False):
        with llm.session([{"role": "system", "content": "You count."}]) as s:
            o = s.chat("Count from 1 to 3.", SamplingParams(temperature=0, max_tokens=6, detokenize=detok))
            assert o.outputs[0].text == ("1. 1\n2" if detok else "")
            convs.append(s.messages)
            o2 = s.chat("Go on.", SamplingParams(temperature=0, max_tokens=2))
            assert llm.tokenizer.decode(o2.prompt_token_ids, skip_special_tokens=False) == render_chat(
                llm.tokenizer, s.messages[:-1], add_generation_prompt=True
            )
    assert convs[0] == convs[1] and convs[1][-1] == {"role": "assistant", "content": "1. 1\n2"}
    assert assert_idle(llm)["pinned"] == 0


def test_a_message_the_chat_template_refuses_is_named_as_the_argument(llms):
    """A role or content the chat template refuses is a RequestError naming the argument it came
    in (``prompt`` of ``session`` / ``select``, ``message`` of ``chat``; it named ``messages``, with
    the index in the whole conversation), and the session stays usable."""
    llm = llms[1]
    bogus, number = {"role": "bogus", "content": "x"}, {"role": "user", "content": 5}
    for call, param, where in [
        (lambda: llm.session([SYSTEM, bogus]), "prompt", "prompt[1]: role must be one of"),
        (lambda: llm.select([number], ["a"]), "prompt", "prompt[0]: content must be a string"),
    ]:
        with pytest.raises(RequestError) as e:
            call()
        assert (e.value.param, str(e.value)[: len(where)]) == (param, where)
    with llm.session([SYSTEM]) as s:
        s.chat("Hi.", SamplingParams(temperature=0, max_tokens=2))
        for message, where in [
            (bogus, "message[0]: role must be one of"),
            ([{"role": "user", "content": "a"}, number], "message[1]: content must be a string"),
        ]:
            with pytest.raises(RequestError) as e:
                s.chat(message, SamplingParams(max_tokens=2))
            assert (e.value.param, str(e.value)[: len(where)]) == ("message", where)
        with pytest.raises(RequestError) as e:
            s.select(["a"], message=bogus)
        assert e.value.param == "message"
        assert len(s.messages) == 3 and s.chat("Bye.", SamplingParams(max_tokens=2)).outputs[0].token_ids
    assert assert_idle(llm)["pinned"] == 0


# ---------------------------------------------------------------------------------- select / fork
@pytest.fixture(scope="module")
def hf_logprobs(hf_default):
    memo = {}

    def run(ids):
        key = tuple(ids)
        if key not in memo:
            with torch.no_grad():
                memo[key] = torch.log_softmax(hf_default(torch.tensor([list(ids)])).logits[0].double(), dim=-1)
        return memo[key]

    return run


def test_select_scores_equal_transformers_log_probabilities(llms, hf_logprobs):
    llm = llms[1]
    assert llm.reset_prefix_cache()
    prompt = "Question: What is the capital of France?\nAnswer: The capital of France is"
    choices = [" Paris", " London", " Rome, the eternal city", " Berlin"]
    ids = llm.tokenizer.encode(prompt, add_special_tokens=False)
    ev = Events(llm.engine)
    before = llm.cache_stats()["prefill_tokens"]
    try:
        res = llm.select(prompt, choices)
    finally:
        ev.off()
    computed = llm.cache_stats()["prefill_tokens"] - before
    want = []
    for c, sc in zip(choices, res.scores):
        toks = llm.tokenizer.encode(c, add_special_tokens=False)
        lp = hf_logprobs(ids + toks)
        ref = [lp[len(ids) + j - 1, t].item() for j, t in enumerate(toks)]
        assert sc.choice == c and sc.token_ids == toks
        assert sc.token_logprobs == pytest.approx(ref, abs=1e-4)
        assert sc.logprob == pytest.approx(sum(ref), abs=1e-4)
        assert sc.normalized_logprob == pytest.approx(sum(ref) / len(ref), abs=1e-4)
        want.append(sum(ref) / len(ref))
    assert res.index == max(range(len(want)), key=want.__getitem__) and res.choice == choices[res.index]
    assert res.choice == " Paris" and res.method == "normalized"
    # one step: the prompt computed once (but its last token, by every choice: its logits score
    # the choice's first token), the choices as one batched extend over it
    assert len(ev.admitted) == 4 and len({e.step for e in ev.admitted}) == 1
    assert [e.num_shared_tokens for e in ev.admitted] == [0, len(ids) - 1, len(ids) - 1, len(ids) - 1]
    n_choice = sum(len(sc.token_ids) for sc in res.scores)
    assert computed == len(ids) + n_choice + len(choices) - 1
    assert computed == trie_tokens([ids + sc.token_ids for sc in res.scores]) + len(choices) - 1
    by_sum = llm.select(ids, choices, method="sum")  # token ids in, the cached prompt reused
    assert by_sum.index == max(range(4), key=lambda i: res.scores[i].logprob)
    assert by_sum.logprobs == pytest.approx(res.logprobs, abs=1e-4)
    assert_idle(llm)


def test_tree_of_thought_fork_select_continue(llms):
    """Fork 4 thoughts from a session, select the best by its likelihood, continue it: the context
    is computed once, every later call only its new tokens; nothing leaks."""
    llm = llms[1]
    assert llm.reset_prefix_cache()
    question = [{"role": "user", "content": "A farmer has 17 sheep and all but 9 run away. How many are left?"}]
    base = llm.cache_stats()["prefill_tokens"]
    with llm.session(question) as s:
        with s.fork(4) as thoughts:
            params = [SamplingParams(temperature=0.8, seed=i, max_tokens=12) for i in range(4)]
            outs = thoughts.chat(None, params)  # the assistant's reply, four ways
            ctx = outs[0].prompt_token_ids
            assert all(o.prompt_token_ids == ctx for o in outs)
            # the question computed once: the others ride on the first row (identical prompts)
            assert llm.cache_stats()["prefill_tokens"] - base == len(ctx)
            texts = [o.outputs[0].text for o in outs]
            best = s.select(texts, message=None)  # each thought's likelihood as the reply
            assert best.choice == texts[best.index]
            assert s.messages[-1] == {"role": "assistant", "content": texts[best.index]}
            pinned = assert_idle(llm)["pinned"]
            assert pinned >= len(ctx) and llm.engine.kv.num_pins == 5
        before = llm.cache_stats()["prefill_tokens"]
        final_out = s.chat("So what is the answer? One number.", SamplingParams(temperature=0, max_tokens=8))
        new = len(final_out.prompt_token_ids) - final_out.num_cached_tokens
        assert llm.cache_stats()["prefill_tokens"] - before == new
        assert final_out.num_cached_tokens == len(ctx) + len(best.scores[best.index].token_ids)
    s2 = assert_idle(llm)
    assert s2["pinned"] == 0 and s2["protected"] == 0


def test_async_select_and_session(alm, llms):
    prompt = "Question: Is water wet?\nAnswer:"
    choices = [" Yes", " No"]

    async def main():
        res = await alm.select(prompt, choices)
        async with alm.session([SYSTEM]) as s:
            o1 = await s.chat("Name a fruit.", SamplingParams(temperature=0, max_tokens=6))
            o2 = await s.chat("Another?", SamplingParams(temperature=0, max_tokens=6))
            assert o2.num_cached_tokens == len(o1.prompt_token_ids) + len(o1.outputs[0].token_ids) - 1
            picked = await s.select([" Apple", " Banana"], message={"role": "user", "content": "Pick one."})
            assert s.tokens[-len(picked.scores[picked.index].token_ids) :] == picked.scores[picked.index].token_ids
            st = alm.cache_stats()
            assert st["pinned"] == s.pinned_tokens > 0
        return res

    res = asyncio.run(main())
    sync = llms[1].select(prompt, choices)  # the same weights in another engine
    assert res.index == sync.index and res.logprobs == pytest.approx(sync.logprobs, abs=1e-4)
    assert all(math.isfinite(x) and x < 0 for x in res.logprobs)
    assert_idle(llms[1])
    async_idle(alm)


def _reply_tokens_by_every_prefix(tok, c):
    """reply_tokens as it was: every prefix decoded, longest first (the reference)."""
    from radixkv.text import encode_text

    ids, n, head = list(c.token_ids), len(c.token_ids), ""
    while n > 0:
        head = tok.decode(ids[:n], skip_special_tokens=False)
        if c.text.startswith(head):
            break
        n -= 1
    rest = c.text[len(head) :] if n > 0 else c.text
    return ids[:n] + (encode_text(tok, rest, "text") if rest else [])


def test_a_long_reply_cut_by_a_stop_string_joins_the_context_in_few_decodes(default_model):
    """A reply cut by a stop string whose text skipped a special token near its start (e.g.
    ``ignore_eos`` with ``<|im_end|>`` generated early) decoded every prefix of the reply on the
    engine thread: quadratic, seconds for thousands of tokens. The same tokens now come from a
    binary search; multi-byte characters cut between tokens and the cut inside a token agree with
    decoding every prefix."""
    from types import SimpleNamespace

    from radixkv.branching.chat import reply_tokens

    tok = default_model.tokenizer
    end = tok.convert_tokens_to_ids("<|im_end|>")
    body = tok.encode("Café 東京 naïve 🙂 déjà vu, " * 120, add_special_tokens=False)
    calls = [0]
    real = tok.decode

    def counting(*a, **k):
        calls[0] += 1
        return real(*a, **k)

    for ids, cut in (([5, end] + body, 7), (body, 3), (body + [end] + body[:40], 11), (body[:9], 2)):
        text = tok.decode(ids, skip_special_tokens=True)
        c = SimpleNamespace(token_ids=ids, text=text[: len(text) - cut], finish_reason="stop", stop_reason="vu")
        want = _reply_tokens_by_every_prefix(tok, c)
        calls[0] = 0
        tok.decode = counting
        try:
            got = reply_tokens(tok, c)
        finally:
            del tok.decode
        assert got == want and tok.decode(got) == c.text
        assert calls[0] <= 2 * len(ids).bit_length() + 8, (len(ids), calls[0])


def test_forks_chat_reads_a_list_of_message_dicts_as_one_turn(llms):
    """``forks.chat`` reads arguments as ``LLM.chat`` does: a list of message dicts is one turn
    (several messages) for every child, whatever the number of children; one per child is a list
    of texts, dicts or lists of dicts. Before, two dicts sent to two children were split between
    them (each got one message) and three children refused them."""
    llm = llms[1]
    base = [{"role": "system", "content": "Answer in one word."}]
    turn = [{"role": "user", "content": "Hello."}, {"role": "user", "content": "Name a color."}]
    params = SamplingParams(temperature=0, max_tokens=3)

    def alone(messages):
        return llm.chat(messages, params, use_tqdm=False)[0].outputs[0].token_ids

    for n in (2, 3):
        with llm.session(base) as s, s.fork(n) as kids:
            outs = kids.chat(turn, params)
            assert [o.outputs[0].token_ids for o in outs] == [alone(base + turn)] * n
            assert all(k.messages[1:3] == turn for k in kids)
    fruit = {"role": "user", "content": "Name a fruit."}
    with llm.session(base) as s, s.fork(2) as kids:
        outs = kids.chat([turn[1:], fruit["content"]], params)
        assert kids[0].messages[1] == turn[1] and kids[1].messages[1] == fruit
        assert [o.outputs[0].token_ids for o in outs] == [alone(base + turn[1:]), alone(base + [fruit])]
    assert_idle(llm)
