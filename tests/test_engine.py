"""End-to-end engine tests on the default model (SmolLM2-135M-Instruct, CPU, float32).

Greedy outputs with the radix cache, with hash blocks and with caching off must equal
transformers' greedy ``generate`` on real ShareGPT chat prompts, cached-token counts must be
exact, a tiny pool must force eviction and retraction without changing outputs, and after every
test ``free + evictable == capacity`` with nothing protected.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from radixkv import LLM, SamplingParams  # noqa: E402
from radixkv.datasets import load_conversations  # noqa: E402
from radixkv.engine import RequestAdmitted  # noqa: E402

pytestmark = pytest.mark.timeout(1200)
MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def loaded(default_model):
    return default_model


@pytest.fixture(scope="module")
def hf_greedy(loaded, hf_default):
    """transformers' greedy generate (the reference), memoized per prompt. ``ignore_eos``: it
    does not stop at EOS (``eos_token_id=[]``), so it gives ``max_tokens`` tokens, as the engine
    does with ``SamplingParams(ignore_eos=True)``."""
    model = hf_default
    memo = {}

    def run(ids, max_tokens=MAX_TOKENS, ignore_eos=False):
        key = (tuple(ids), max_tokens, ignore_eos)
        if key not in memo:
            kw = {"eos_token_id": []} if ignore_eos else {}
            with torch.no_grad():
                out = model.generate(
                    torch.tensor([ids]),
                    attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                    do_sample=False,
                    max_new_tokens=max_tokens,
                    pad_token_id=loaded.tokenizer.eos_token_id,
                    **kw,
                )
            memo[key] = out[0, len(ids) :].tolist()
            assert not ignore_eos or len(memo[key]) == max_tokens
        return memo[key]

    return run


def make_llm(loaded, **kw):
    kw.setdefault("max_total_tokens", 4096)
    return LLM(device="cpu", loaded_model=loaded, **kw)


@pytest.fixture(scope="module")
def llms(loaded):
    return {
        "radix": make_llm(loaded),
        "hash": make_llm(loaded, prefix_cache="hash", page_size=16),
        "off": make_llm(loaded, enable_prefix_caching=False),
    }


@pytest.fixture(scope="module")
def convs():
    return load_conversations(3, 2, max_user_chars=300)


def render(llm, messages):
    return llm.tokenizer.encode(llm.render_chat(messages), add_special_tokens=False)


def assert_no_leak(llm):
    llm.engine.check_integrity()
    s = llm.cache_stats()
    assert s["protected"] == 0 and s["running"] == 0 and s["waiting"] == 0
    assert s["free"] + s["evictable"] == s["capacity"]


def lcp(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def in_batch_share(prompt, earlier, page_size):
    """What ``prompt`` borrows from rows computing ``earlier`` prompts in the same forward: all of
    it when one of them covers it and it ends on a page boundary (it samples from that row's
    logits), else the longest common prefix but the last token, floored to pages."""
    best = 0
    for e in earlier:
        n = lcp(prompt, e)
        if n == len(prompt) and n % page_size == 0:
            return n
        best = max(best, min(n, len(prompt) - 1) // page_size * page_size)
    return best


def expected_cached(cached_seqs, prompt, page_size=1):
    """Longest prefix of prompt[:-1] among the committed sequences in the cache, floored to pages."""
    best = max((lcp(s, prompt[:-1]) for s in cached_seqs), default=0)
    return best // page_size * page_size


@pytest.mark.parametrize("mode", ["radix", "hash", "off"])
def test_greedy_equals_transformers_and_exact_cached_tokens(mode, llms, convs, hf_greedy):
    llm = llms[mode]
    ps = llm.engine.config.page_size
    assert llm.reset_prefix_cache()
    prefill_before = llm.cache_stats()["prefill_tokens"]
    p1 = render(llm, [{"role": "user", "content": convs[0][0]}])
    p2 = render(llm, [{"role": "user", "content": convs[1][0]}])
    prefix_of_p2 = p2[: len(p2) - 7]
    # batch 1: shared system prompt (the template's), a prompt that is a prefix of another, a prompt twice
    batch = [p1, p2, prefix_of_p2, p1]
    admitted = []
    off = llm.engine.events.subscribe(admitted.append, (RequestAdmitted,))
    try:
        outs = llm.generate(prompt_token_ids=batch, sampling_params=GREEDY, use_tqdm=False)
    finally:
        off()
    for p, o in zip(batch, outs):
        assert o.outputs[0].token_ids == hf_greedy(p)
    # cold, all admitted in the first step: each shares what the rows admitted before it compute
    # in that forward (in-batch sharing; nothing without a prefix cache), exactly
    assert {e.step for e in admitted} == {admitted[0].step}
    order = [next(i for i, o in enumerate(outs) if o.request_id == e.request_id) for e in admitted]
    for k, i in enumerate(order):
        want = 0 if mode == "off" else in_batch_share(batch[i], [batch[j] for j in order[:k]], ps)
        assert outs[i].num_cached_tokens == want == admitted[k].num_shared_tokens
    s = llm.cache_stats()
    assert s["prefill_tokens"] - prefill_before == sum(map(len, batch)) - sum(o.num_cached_tokens for o in outs)
    committed = [(p + o.outputs[0].token_ids)[: len(p) + len(o.outputs[0].token_ids) - 1] for p, o in zip(batch, outs)]
    assert_no_leak(llm)

    # multi-turn: turn 2 continues conversation 0 with the model's own reply
    reply = outs[0].outputs[0].text
    t2 = render(
        llm,
        [
            {"role": "user", "content": convs[0][0]},
            {"role": "assistant", "content": reply},
            {"role": "user", "content": convs[0][1]},
        ],
    )
    p3 = render(llm, [{"role": "user", "content": convs[2][0]}])  # new user, same system prompt
    for prompt in (t2, p2, p3):  # one at a time: the count depends only on what is cached
        o = llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY, use_tqdm=False)[0]
        assert o.outputs[0].token_ids == hf_greedy(prompt)
        want = 0 if mode == "off" else expected_cached(committed, prompt, ps)
        assert o.num_cached_tokens == want
        committed.append((prompt + o.outputs[0].token_ids)[:-1])
        assert_no_leak(llm)
    if mode == "radix":
        # the identical repeat of p2 hit all but its last token; the system prompt is shared
        assert expected_cached(committed[:4], p2) == len(p2) - 1
        assert expected_cached(committed[:4], p3) >= 20
    if mode == "off":
        assert llm.cache_stats()["cached_tokens"] == 0


def test_tiny_pool_eviction_and_retraction(loaded, convs, hf_greedy):
    tok = loaded.tokenizer
    prompts = []
    for c in convs:
        for u in c:
            prompts.append(
                tok.apply_chat_template([{"role": "user", "content": u}], add_generation_prompt=True, tokenize=False)
            )
    ids = [tok.encode(p, add_special_tokens=False) for p in prompts]
    longest = max(len(i) for i in ids)
    llm = make_llm(loaded, max_total_tokens=longest + 48, chunked_prefill_size=512)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=ids, sampling_params=params, use_tqdm=False)
    for p, o in zip(ids, outs):
        assert o.outputs[0].token_ids == hf_greedy(p, ignore_eos=True)
    s = llm.cache_stats()
    assert s["num_retractions"] > 0 and s["evicted_tokens"] > 0
    assert_no_leak(llm)


def test_n_samples_and_seeds(llms, convs, hf_greedy):
    llm = llms["radix"]
    p = render(llm, [{"role": "user", "content": convs[1][1]}])
    o = llm.generate(
        prompt_token_ids=[p], sampling_params=SamplingParams(temperature=0, max_tokens=MAX_TOKENS, n=3), use_tqdm=False
    )[0]
    assert [c.token_ids for c in o.outputs] == [hf_greedy(p)] * 3
    sp = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=MAX_TOKENS, n=2, seed=1234, ignore_eos=True)
    a = llm.generate(prompt_token_ids=[p], sampling_params=sp, use_tqdm=False)[0]
    b = llms["off"].generate(prompt_token_ids=[p], sampling_params=sp, use_tqdm=False)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert all(len(c.token_ids) == MAX_TOKENS for c in a.outputs)
    assert_no_leak(llm)
    assert_no_leak(llms["off"])


def test_stop_string_and_text(llms, convs, hf_greedy):
    llm = llms["radix"]
    p = render(llm, [{"role": "user", "content": convs[0][0]}])
    ref = hf_greedy(p)
    full = llm.tokenizer.decode(ref, skip_special_tokens=True)
    o = llm.generate(prompt_token_ids=[p], sampling_params=GREEDY, use_tqdm=False)[0]
    assert o.outputs[0].text == full
    words = full.split()
    assert len(words) >= 3
    stop = words[2]
    o = llm.generate(prompt_token_ids=[p], sampling_params=GREEDY.clone(stop=[stop]), use_tqdm=False)[0]
    c = o.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == full[: full.index(stop)]
    assert c.token_ids == ref[: len(c.token_ids)]
    assert_no_leak(llm)


def test_abort_running_frees_everything(llms, convs):
    llm = llms["radix"]
    eng = llm.engine
    p = render(llm, [{"role": "user", "content": convs[2][1]}])
    rid = eng.add_request(p, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    eng.step()
    eng.step()
    assert eng.cache_stats()["in_use"] > 0
    eng.abort_request(rid)
    outs = eng.step()
    assert outs[0].request_id == rid and outs[0].outputs[0].finish_reason == "abort"
    assert not eng.has_unfinished_requests()
    assert_no_leak(llm)


def test_bad_inputs_raise_and_engine_stays_usable(llms, hf_greedy):
    llm = llms["radix"]
    with pytest.raises(ValueError, match="empty"):
        llm.generate(prompt_token_ids=[[]], use_tqdm=False)
    with pytest.raises(ValueError, match="max_context_len"):
        llm.generate(prompt_token_ids=[[1] * llm.engine.max_context_len], use_tqdm=False)
    for kw, field in [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
    ]:
        with pytest.raises(ValueError, match=field):
            llm.generate(["hi"], SamplingParams(**kw), use_tqdm=False)
    with pytest.raises(ValueError, match="unknown"):
        LLM(bogus=1)
    with pytest.raises(ValueError, match="prefix_cache"):
        LLM(prefix_cache="lru")
    # a batch with one bad prompt submits nothing
    with pytest.raises(ValueError, match="empty"):
        llm.generate(prompt_token_ids=[[1, 2, 3], []], use_tqdm=False)
    assert_no_leak(llm)
    ids = llm.tokenizer.encode("The capital of France is", add_special_tokens=False)
    o = llm.generate(prompt_token_ids=[ids], sampling_params=GREEDY, use_tqdm=False)[0]
    assert o.outputs[0].token_ids == hf_greedy(ids)
    assert_no_leak(llm)


def test_replay_tiny(tmp_path, loaded):
    import argparse

    from radixkv import replay

    parser = argparse.ArgumentParser()
    replay.add_arguments(parser)
    out = tmp_path / "rows.json"
    args = parser.parse_args(
        [
            "--conversations",
            "2",
            "--turns",
            "2",
            "--max-tokens",
            "4",
            "--device",
            "cpu",
            "--max-total-tokens",
            "2048",
            "--output",
            str(out),
            "--no-progress",
        ]
    )
    assert replay.run(args, loaded_model=loaded) == 0
    rows = json.loads(out.read_text())
    assert [r["mode"] for r in rows] == ["radix", "off"]
    for r in rows:
        assert set(replay.ROW_KEYS) <= set(r)
        assert r["requests"] == 4 and r["prompt_tokens"] > 0
        assert r["prefill_tokens"] == r["prompt_tokens"] - r["cached_tokens"]
    assert rows[0]["prompt_tokens"] == rows[1]["prompt_tokens"]
    assert rows[0]["cached_tokens"] > 0 and rows[1]["cached_tokens"] == 0


def test_replay_closed_loop(loaded):
    """``replay_mode(concurrency=c)``: never more than ``c`` requests in flight, every turn of every
    conversation served once in order, the same greedy replies and prompts as the waves."""
    from radixkv import LLM
    from radixkv.datasets import load_conversations
    from radixkv.replay import replay_mode

    convs = load_conversations(3, 2)
    waves = replay_mode(LLM(loaded_model=loaded, device="cpu", max_total_tokens=4096), convs, 4, progress=False)
    llm = LLM(loaded_model=loaded, device="cpu", max_total_tokens=4096)
    engine, add = llm.engine, llm.engine.add_request
    in_flight = []

    def counted(*a, **kw):
        in_flight.append(engine.num_unfinished_requests())
        return add(*a, **kw)

    engine.add_request = counted
    loop = replay_mode(llm, convs, 4, progress=False, concurrency=2)
    assert len(in_flight) == sum(len(c) for c in convs) == loop["requests"] == waves["requests"]
    assert max(in_flight) == 1  # 2 in flight at most: the third turn waits for a reply
    assert loop["replies"] == waves["replies"]
    assert loop["prompt_tokens"] == waves["prompt_tokens"]
    assert loop["prefill_tokens"] == loop["prompt_tokens"] - loop["cached_tokens"]
    assert_no_leak(llm)
    with pytest.raises(ValueError, match="concurrency"):
        replay_mode(llm, convs, 4, progress=False, concurrency=0)
