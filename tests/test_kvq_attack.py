"""Compressed K/V attacked as a user would: pool sizes, kv dtypes and what they touch.

* a pool larger than the device's memory is a ValueError naming the field and the limit, before
  any tensor is allocated (it was a TypeError from torch, a RuntimeError, or the OOM killer);
* a given ``model_runner``'s pool must hold ``max_total_tokens`` in ``page_size`` pages of the
  configured ``kv_cache_dtype`` (a smaller pool crashed the engine mid-generation).
"""

from __future__ import annotations

import pytest
from model_helpers import tiny_loaded_model

from radixkv import LLM, SamplingParams
from radixkv.config import EngineConfig

pytestmark = pytest.mark.timeout(600)

TINY_BPT = {"float32": 512, "bfloat16": 256, "fp8_e4m3": 144}  # bytes per token of the tiny model


@pytest.fixture(scope="module")
def tiny():
    return tiny_loaded_model(seed=0)


def test_a_pool_past_any_memory_is_a_value_error_naming_the_field(tiny):
    """Sizes no machine holds: refused before torch sizes the tensors (10**30 bytes was a
    TypeError from ``torch.zeros``, 10**9 float32 tokens a RuntimeError of the allocator)."""
    with pytest.raises(ValueError, match=r"kv_cache_memory_bytes 10{30}.* more than the \d+ bytes"):
        LLM(loaded_model=tiny, device="cpu", kv_cache_memory_bytes=10**30)
    with pytest.raises(ValueError, match=r"max_total_tokens 10{27}.* more than the \d+ bytes"):
        LLM(loaded_model=tiny, device="cpu", kv_cache_dtype="fp8", max_total_tokens=10**27)


@pytest.mark.parametrize("kv", sorted(TINY_BPT))
def test_the_pool_must_fit_in_the_memory_available(tiny, kv, monkeypatch):
    """The limit is the memory available on the pool's device when the pool is made (Linux
    ``MemAvailable`` on the CPU, CUDA's free memory), scales included; at the limit it fits."""
    import radixkv.engine.engine as engine_mod
    import radixkv.memory.fit as fit

    bpt = TINY_BPT[kv]
    monkeypatch.setattr(fit, "free_memory_bytes", lambda device: 1000 * bpt)
    # the pool's limit alone: the block table has its own check (tests/test_config_attack.py)
    monkeypatch.setattr(engine_mod, "check_table_fits", lambda *a: None)
    llm = LLM(loaded_model=tiny, device="cpu", kv_cache_dtype=kv, max_total_tokens=1000)
    assert llm.cache_stats()["kv_cache_bytes"] == 1000 * bpt
    llm.close()
    llm = LLM(loaded_model=tiny, device="cpu", kv_cache_dtype=kv, kv_cache_memory_bytes=1000 * bpt + bpt - 1)
    assert llm.cache_stats()["capacity"] == 1000
    llm.close()
    with pytest.raises(
        ValueError, match=rf"max_total_tokens 1001: .*{1001 * bpt} bytes.* more than the {1000 * bpt} bytes"
    ):
        LLM(loaded_model=tiny, device="cpu", kv_cache_dtype=kv, max_total_tokens=1001)
    with pytest.raises(ValueError, match=rf"kv_cache_memory_bytes {1001 * bpt}: .* more than the {1000 * bpt} bytes"):
        LLM(loaded_model=tiny, device="cpu", kv_cache_dtype=kv, kv_cache_memory_bytes=1001 * bpt)
    with pytest.raises(ValueError, match=r"the default KV pool: .* give kv_cache_memory_bytes or max_total_tokens"):
        LLM(loaded_model=tiny, device="cpu", kv_cache_dtype=kv)
    EngineConfig(device="cpu", kv_cache_dtype=kv, max_total_tokens=10**9).resolve()  # no model facts: no pool yet


def test_a_given_runners_pool_must_match_the_config(tiny):
    """``LLM(model_runner=...)``: a pool with fewer slots than ``max_total_tokens`` crashed the
    engine mid-generation (``index_copy_(): index 64 is out of bounds``), another page size or an
    explicit other ``kv_cache_dtype`` was silently ignored; now each is a ValueError naming the
    field, and ``kv_cache_dtype="auto"`` takes the pool's."""
    from radixkv.executor.model_runner import ModelRunner

    runner = ModelRunner(tiny, device="cpu", num_slots=64, kv_cache_dtype="bf16")
    with pytest.raises(ValueError, match=r"max_total_tokens 1024 .*\(64 slots\)"):
        LLM(model_runner=runner, tokenizer=tiny.tokenizer, max_total_tokens=1024)
    with pytest.raises(ValueError, match=r"kv_cache_dtype 'fp8_e4m3' .* bfloat16"):
        LLM(model_runner=runner, tokenizer=tiny.tokenizer, max_total_tokens=64, kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match=r"page_size 16 .* page_size 1"):
        LLM(model_runner=runner, tokenizer=tiny.tokenizer, max_total_tokens=64, page_size=16)
    for kv in ("auto", "bf16"):
        llm = LLM(model_runner=runner, tokenizer=tiny.tokenizer, max_total_tokens=64, kv_cache_dtype=kv)
        assert (llm.engine.config.kv_cache_dtype, llm.cache_stats()["kv_cache_dtype"]) == ("bfloat16", "bfloat16")
        prompts = [{"prompt_token_ids": list(range(5 + i, 25 + i))} for i in range(8)]
        outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0), use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in outs] == [10] * 8
        llm.call_in_engine_thread(lambda e: e.kv.check_integrity([]))
        llm.reset_prefix_cache()
        assert llm.cache_stats()["free"] == 64
        llm.close()
