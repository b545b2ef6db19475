"""Bad engine settings given to ``LLM`` / ``AsyncLLM`` / ``EngineConfig``: each is a ValueError
naming the field and its limit, raised before the model loads or anything large is allocated
(never a torch ``RuntimeError`` from deep inside, a silent acceptance, or a setting ignored)."""

from __future__ import annotations

import math
import os

import pytest
import torch
from model_helpers import tiny_loaded_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from radixkv import LLM, AsyncLLM, SamplingParams  # noqa: E402
from radixkv.config import EngineConfig  # noqa: E402
from radixkv.models.quantize import quantize_model  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def tiny():
    return tiny_loaded_model()


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("seed", "abc", "seed must be an integer in [-2**63, 2**63 - 1]"),
        ("seed", 1.5, "seed must be an integer"),
        ("seed", None, "seed must be an integer"),
        ("seed", True, "seed must be an integer"),
        ("seed", math.nan, "seed must be an integer"),
        ("seed", 2**70, "seed must be an integer in [-2**63, 2**63 - 1], got 1180591620717411303424"),
        ("device", "tpu", "device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got 'tpu'"),
        ("device", "meta", "device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got 'meta'"),
        ("device", torch.device("meta"), "device must be"),
        ("device", None, "device must be"),
        ("device", 3, "device must be"),
        ("device", "CPU", "device must be"),
        ("dtype", torch.int8, "dtype must be 'auto' or one of"),
        ("dtype", torch.float64, "dtype must be 'auto' or one of"),
        ("dtype", None, "dtype must be 'auto' or one of"),
        ("enable_prefix_caching", "false", "enable_prefix_caching must be a bool, got 'false'"),
        ("enable_prefix_caching", None, "enable_prefix_caching must be a bool"),
        ("cache_outcome", "no", "cache_outcome must be a bool, got 'no'"),
        ("hash_algo", "md5", "hash_algo must be one of ('sha256', 'builtin'), got 'md5'"),
        ("quantization", "int4", "quantization must be one of (None, 'int8'), got 'int4'"),
        ("quantization", "", "quantization must be one of (None, 'int8')"),
        ("max_total_tokens", True, "max_total_tokens must be an integer >= page_size (1), got True"),
    ],
)
def test_a_bad_setting_is_a_value_error_naming_it(field, value, words):
    with pytest.raises(ValueError) as e:
        EngineConfig(**{field: value}).resolve()
    assert words in str(e.value)


def test_quantization_needs_the_cpu_in_float32_before_the_model_loads():
    with pytest.raises(ValueError, match=r"quantization='int8' needs device='cpu' and dtype float32"):
        EngineConfig(device="cpu", dtype="bf16", quantization="int8").resolve()


@pytest.mark.parametrize("front", [LLM, AsyncLLM])
def test_both_fronts_refuse_a_bad_setting_before_loading(front, monkeypatch):
    import radixkv.engine.engine as engine_mod

    def no_load(cfg):  # a setting refused must not cost a model load first
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(engine_mod, "_load", no_load)
    for kw in ({"seed": "1"}, {"device": "tpu"}, {"hash_algo": "md5"}, {"quantization": "int4"}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            front(**kw)


def test_a_block_table_past_the_memory_is_refused_before_allocating(tiny):
    """max_running_requests sizes the block table (rows x max_context_len int32): 10**12 rows was a
    torch RuntimeError from the allocator (a TypeError on some builds) out of ReqToTokenPool."""
    with pytest.raises(ValueError) as e:
        LLM(loaded_model=tiny, max_total_tokens=256, max_running_requests=10**12)
    msg = str(e.value)
    assert msg.startswith("max_running_requests 1000000000000: its block table of 1000000000000 rows x 256 tokens")
    assert "bytes of memory available on cpu" in msg


@pytest.mark.parametrize("eos", ["abc", 7, [-1], [49152], [True], [1.0]])
def test_eos_token_ids_must_be_ids_of_the_vocabulary(tiny, eos):
    """``eos_token_ids=[-1]`` was taken: the sampler's min_tokens mask then hid the vocabulary's
    last token; "abc" was ``int('a')``'s ValueError, naming nothing."""
    with pytest.raises(ValueError, match=r"eos_token_ids must be a list of integer token ids in \[0, 49152\)"):
        LLM(loaded_model=tiny, max_total_tokens=256, eos_token_ids=eos)


def test_quantization_is_never_silently_dropped_for_a_loaded_model(tiny):
    """``LLM(loaded_model=float weights, quantization="int8")`` ran the float weights as if no
    quantization had been asked; a quantized loaded model with quantization left out now
    reports it (the KV tiers' fingerprint names it)."""
    with pytest.raises(ValueError, match=r"quantization='int8' but the loaded_model's weights are not quantized"):
        LLM(loaded_model=tiny, max_total_tokens=256, quantization="int8")
    q = tiny_loaded_model()
    quantize_model(q.model, "int8")
    llm = LLM(loaded_model=q, max_total_tokens=256)
    assert llm.engine.config.quantization == "int8"
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 2
    assert LLM(loaded_model=q, max_total_tokens=256, quantization="int8").engine.config.quantization == "int8"
