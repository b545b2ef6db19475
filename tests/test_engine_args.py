"""The constructor keywords LLM and AsyncLLM share (radixkv/engine_args.py): every EngineConfig
field and every Engine keyword on both (AsyncLLM takes ``loaded_model`` as LLM does), an unknown
keyword refused by both with a ValueError naming it."""

from __future__ import annotations

import asyncio
import os

import pytest
from test_scheduler import FakeRunner, greedy, reference

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from radixkv import LLM, AsyncLLM, SamplingParams  # noqa: E402
from radixkv.engine_args import engine_keywords, split_engine_kwargs  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def test_engine_keywords_are_the_engines():
    assert engine_keywords() == ["clock", "eos_token_ids", "loaded_model", "model_runner", "tier_stores", "tokenizer"]


def test_split_into_config_and_engine_keywords():
    clock = object()
    given = {"page_size": 4, "max_n": 8, "clock": clock, "loaded_model": "weights", "device": "cpu"}
    config, engine_kwargs = split_engine_kwargs("LLM", "some-model", given)
    assert (config.model, config.page_size, config.max_n, config.device) == ("some-model", 4, 8, "cpu")
    assert engine_kwargs == {"clock": clock, "loaded_model": "weights"}
    assert given["page_size"] == 4 and len(given) == 5  # not consumed


@pytest.mark.parametrize("front", [LLM, AsyncLLM])
def test_unknown_keywords_are_named_by_both(front):
    with pytest.raises(ValueError) as e:
        front(device="cpu", bogus=1, page_sise=4)
    msg = str(e.value)
    assert msg.startswith(
        f"{front.__name__}: unknown argument(s) ['bogus', 'page_sise'] (did you mean: page_size for page_sise);"
    )
    with pytest.raises(ValueError, match=r"\['max_model_len'\] \(did you mean: max_context_len for max_model_len\);"):
        front(device="cpu", max_model_len=512)  # vLLM's name
    assert "'loaded_model'" in msg and "'page_size'" in msg  # the valid ones are listed


@pytest.mark.parametrize("front", [LLM, AsyncLLM])
def test_invalid_values_are_named_by_both(front):
    runner = FakeRunner(64, 1, 4)
    with pytest.raises(ValueError, match="max_pinned_tokens"):
        front(device="cpu", model_runner=runner, tokenizer=None, eos_token_ids=[], max_pinned_tokens=-1)


def test_async_llm_takes_engine_keywords_like_llm():
    """A fake runner, no tokenizer, a clock: the same keywords build the same engine on both."""
    kw = dict(device="cpu", tokenizer=None, eos_token_ids=[], max_total_tokens=256, page_size=4, clock=lambda: 5.0)
    llm = LLM(model_runner=FakeRunner(256, 4, 16), **kw)
    with AsyncLLM(model_runner=FakeRunner(256, 4, 16), **kw) as alm:
        for e in (llm.engine, alm.engine):
            assert (e.config.page_size, e.config.max_total_tokens, e.kv.clock()) == (4, 256, 5.0)
        prompt = list(range(1, 20))
        want = reference(prompt, 5)
        out = llm.generate(prompt_token_ids=[prompt], sampling_params=greedy(5), use_tqdm=False)[0]
        assert out.outputs[0].token_ids == want

        async def run():
            return [o async for o in alm.generate(prompt_token_ids=prompt, sampling_params=greedy(5))][-1]

        assert asyncio.run(run()).outputs[0].token_ids == want
    with pytest.raises(ValueError, match="given together with an engine"):
        AsyncLLM(engine=llm.engine, page_size=4)


def test_async_llm_takes_loaded_model(default_model):
    """``loaded_model`` shares one model's weights: LLM and AsyncLLM built from it give the same
    greedy tokens (AsyncLLM refused it before)."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm = LLM(device="cpu", loaded_model=default_model, max_total_tokens=1024)
    want = llm.generate("The capital of France is", params, use_tqdm=False)[0].outputs[0].token_ids
    with AsyncLLM(device="cpu", loaded_model=default_model, max_total_tokens=1024) as alm:
        assert alm.engine.runner.model is default_model.model  # the same weights, not a copy

        async def run():
            return [o async for o in alm.generate("The capital of France is", params)][-1]

        assert asyncio.run(run()).outputs[0].token_ids == want
    assert len(want) == 6
