"""Bad engine settings given to ``LLM`` / ``AsyncLLM`` / ``EngineConfig``: each is a ValueError
naming the field and its limit, raised before the model loads or anything large is allocated
(never a torch ``RuntimeError`` from deep inside, a silent acceptance, or a setting ignored)."""

from __future__ import annotations

import math
import os
import re

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
        (
            "attention_backend",
            "foo",
            "attention_backend must be one of ('auto', 'torch', 'cpu', 'flashinfer'), got 'foo'",
        ),
        ("attention_backend", None, "attention_backend must be one of"),
        ("attention_backend", "flashinfer", "attention_backend 'flashinfer' needs a CUDA device, got device='cpu'"),
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
    for kw in (
        {"seed": "1"},
        {"device": "tpu"},
        {"hash_algo": "md5"},
        {"quantization": "int4"},
        {"attention_backend": "foo"},
    ):
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


# ------------------------------------------------------------------ model loading


@pytest.fixture(scope="module")
def default_dir():
    from radixkv.models.loader import resolve_hf_dir

    return resolve_hf_dir("smollm2-135m")


def _copy_model(default_dir, dest, drop=(), config=None):
    """A copy of the default model's directory (weights linked, not copied) without ``drop``,
    its config.json updated with ``config``."""
    import json

    dest.mkdir()
    for f in default_dir.iterdir():
        if f.name not in drop and f.name != "config.json":
            (dest / f.name).symlink_to(f)
    if "config.json" not in drop:
        cfg = json.loads((default_dir / "config.json").read_text())
        cfg.update(config or {})
        (dest / "config.json").write_text(json.dumps(cfg))
    return dest


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("hidden_size", 0, "hidden_size must be an integer >= 1, got 0"),
        ("num_hidden_layers", 0, "num_hidden_layers must be an integer >= 1, got 0"),
        ("vocab_size", 0, "vocab_size must be an integer >= 1, got 0"),
        ("num_key_value_heads", 0, "num_key_value_heads must be an integer >= 1, got 0"),
        ("num_key_value_heads", 2, "num_key_value_heads 2 does not divide num_attention_heads 9"),
        ("max_position_embeddings", 1, "max_position_embeddings must be an integer >= 2, got 1"),
        ("max_position_embeddings", 0, "max_position_embeddings must be an integer >= 2, got 0"),
    ],
)
def test_a_config_json_out_of_range_is_a_value_error_naming_the_field(default_dir, tmp_path, field, value, words):
    """num_hidden_layers 0 was an IndexError from torch's ModuleList; max_position_embeddings 0
    blamed max_context_len ("ModelRunner: max_context_len must be >= 1"), and 1 loaded an
    engine that refused every prompt; a zero size failed later on a weight's shape."""
    from radixkv.models import load_model

    d = _copy_model(default_dir, tmp_path / "m", config={field: value})
    with pytest.raises(ValueError) as e:
        load_model(str(d))
    assert str(e.value) == f"{d / 'config.json'}: {words}"


def test_unreadable_model_files_are_errors_naming_the_file(default_dir, tmp_path, monkeypatch):
    """A directory without config.json was transformers' "Unrecognized model ... Should have a
    `model_type` key"; a truncated safetensors file a SafetensorError (no ValueError, no file
    named); config.json that transformers refuses an OSError or huggingface_hub's
    StrictDataclassError; no tokenizer a ValueError naming no directory."""
    from radixkv.models import load_model

    monkeypatch.setenv("RADIXKV_CACHE_DIR", str(tmp_path / "cache"))
    d = _copy_model(default_dir, tmp_path / "nocfg", drop=("config.json",))
    with pytest.raises(FileNotFoundError, match=rf"^model '{d}': no config.json in {d}$"):
        load_model(str(d))
    d = _copy_model(default_dir, tmp_path / "cut", drop=("model.safetensors",))
    (d / "model.safetensors").write_bytes((default_dir / "model.safetensors").read_bytes()[:1000])
    with pytest.raises(ValueError, match=rf"^weights file {d}/model.safetensors cannot be read \(truncated"):
        load_model(str(d))
    d = _copy_model(default_dir, tmp_path / "heads", config={"num_attention_heads": 7})
    with pytest.raises(ValueError, match=rf"(?s)^{d}/config.json: .*not a multiple of the number of attention heads"):
        load_model(str(d))
    d = _copy_model(default_dir, tmp_path / "json", drop=("config.json",))
    (d / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=rf"^{d}/config.json: .*not a valid JSON file"):
        load_model(str(d))
    d = _copy_model(default_dir, tmp_path / "notok", drop=("tokenizer.json", "tokenizer_config.json"))
    with pytest.raises(ValueError, match=rf"^model '{d}': no tokenizer can be loaded from {d}: "):
        load_model(str(d))


def test_a_file_that_is_not_a_readable_gguf_is_a_value_error_naming_it(tmp_path, monkeypatch):
    """An empty .gguf was "cannot mmap an empty file", a truncated one numpy's "cannot reshape
    array of size 3214336 into shape (49152,612)": neither named the file."""
    from radixkv.models import load_model
    from radixkv.models.loader import default_gguf_path

    monkeypatch.setenv("RADIXKV_CACHE_DIR", str(tmp_path / "cache"))
    with open(default_gguf_path(), "rb") as f:
        head = f.read(5 << 20)
    for name, data in (("empty", b""), ("junk", b"hello" * 100), ("truncated", head)):
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(data)
        with pytest.raises(ValueError, match=rf"^model '{path}' is not a GGUF file transformers can read"):
            load_model(str(path))
    assert not [p for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")]  # nothing half-written


@pytest.mark.parametrize("model", [123, None, "", b"smollm2-135m"])
def test_model_must_be_a_name_or_path(model):
    with pytest.raises(ValueError, match="model must be a model name or path"):
        LLM(model)


# ------------------------------------------------------------------ lifecycle


def test_an_llm_with_kv_tiers_dropped_without_close_is_freed_and_its_writes_finished(tiny):
    """``del llm`` of an LLM with KV tiers kept its engine (KV pool, model runner) alive for the
    rest of the process: the tiers' I/O thread held the engine's wake-up method, ran forever and
    the interpreter-exit drain was the only one; a loop making LLMs leaked a pool each."""
    import gc
    import weakref

    from tier_fakes import MemoryStore

    store = MemoryStore("disk")
    llm = LLM(loaded_model=tiny, max_total_tokens=256, tier_stores=[store])
    prompt = list(range(1, 50))
    llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    engine, io_thread = weakref.ref(llm.engine), llm.engine.kv.tiers.io._thread
    del llm
    gc.collect()
    assert engine() is None
    assert not io_thread.is_alive() and store.closed
    assert sorted(len(b.tokens) for b in store.data.values()) == [2, 16, 16, 16]  # 3 blocks, the tail of 50


def test_engines_sharing_a_loaded_model_in_other_dtypes_leave_each_other_alone():
    """``loaded_model`` shares weights between engines; an engine asking for another dtype cast
    them in place (``nn.Module.to``): the first engine then ran bfloat16-rounded weights with
    its float32 pool and answered other tokens ([8094, 47591, ...] became [2090, 7991, ...])."""
    shared = tiny_loaded_model()
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    a = LLM(loaded_model=shared, max_total_tokens=256, attention_backend="torch")
    before = a.generate([[1, 2, 3]], sp, use_tqdm=False)[0].outputs[0].token_ids
    b = LLM(loaded_model=shared, max_total_tokens=256, dtype="bfloat16", attention_backend="torch")
    assert next(shared.model.parameters()).dtype == torch.float32
    assert next(b.engine.runner.model.parameters()).dtype == torch.bfloat16
    assert a.engine.runner.model is shared.model  # the same dtype and device: shared, not copied
    assert a.generate([[1, 2, 3]], sp, use_tqdm=False)[0].outputs[0].token_ids == before
    assert len(b.generate([[1, 2, 3]], sp, use_tqdm=False)[0].outputs[0].token_ids) == 6


def test_engine_keywords_that_are_objects_are_checked_and_a_tokenizer_path_is_loaded(tiny, default_dir):
    """vLLM's ``LLM(tokenizer="path")`` takes a name or path: here the str itself became the
    tokenizer and the first text prompt failed in ``str.encode`` (a TypeError); a str
    ``loaded_model``, a ``model_runner`` or stores that are not, and a ``clock`` that is not
    callable were AttributeErrors from inside the engine (the clock's only when a pin aged)."""
    llm = LLM(loaded_model=tiny, max_total_tokens=256, tokenizer=str(default_dir))
    greedy = SamplingParams(max_tokens=2, temperature=0)
    assert llm.generate("Hello", greedy, use_tqdm=False)[0].prompt_token_ids == tiny.tokenizer.encode("Hello")
    for kw, words in (
        ({"loaded_model": "smollm2-135m"}, "loaded_model: str 'smollm2-135m' has no model, hf_config, tokenizer"),
        ({"model_runner": 3}, "model_runner: int 3 has no forward, build_batch"),
        ({"tier_stores": "disk"}, "tier_stores must be a list of KV tier stores"),
        ({"tier_stores": [3]}, "tier_stores: int 3 has no medium"),
        ({"tokenizer": 3}, "tokenizer: int 3 has no decode"),
        ({"clock": 3}, "clock must be a function returning seconds, got 3"),
    ):
        with pytest.raises(ValueError) as e:
            LLM(**{"loaded_model": tiny, "max_total_tokens": 256, **kw})
        assert str(e.value).startswith(words)


@pytest.mark.parametrize(
    "kw, words",
    [
        (
            {"prefix_cache": "hash", "eviction_policy": "lfu"},
            "eviction_policy='lfu' applies to prefix_cache='radix' only",
        ),
        ({"enable_prefix_caching": False, "eviction_policy": "gdf"}, "got prefix_cache='none'"),
        ({"hash_algo": "builtin"}, "hash_algo='builtin' applies to prefix_cache='hash' only, got prefix_cache='radix'"),
    ],
)
def test_a_cache_setting_the_chosen_cache_would_ignore_is_refused(kw, words):
    """``radixkv serve --prefix-cache hash --radix-eviction-policy lfu`` ran the hash cache's
    LRU, and ``hash_algo="builtin"`` with the radix tree hashed nothing: both silently."""
    with pytest.raises(ValueError, match=re.escape(words)):
        EngineConfig(**kw).resolve()
    assert EngineConfig(prefix_cache="hash", hash_algo="builtin").resolve().hash_algo == "builtin"


def test_a_model_with_scaled_rope_loads_and_matches_transformers(default_dir, tmp_path):
    """A config.json with ``rope_scaling`` (Llama 3.x's llama3, yarn, linear) failed in
    load_model with NotImplementedError "Cannot copy out of meta tensor; no data!": the model is
    built on the meta device and transformers' RoPE functions move their tensors to the CPU."""
    from model_helpers import PagedRequests
    from transformers import AutoModelForCausalLM

    from radixkv.executor.model_runner import ModelRunner
    from radixkv.models import load_model

    d = _copy_model(default_dir, tmp_path / "m", config={"rope_scaling": {"rope_type": "linear", "factor": 4.0}})
    loaded = load_model(str(d))
    hf = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32, local_files_only=True).eval()
    assert loaded.hf_config.rope_parameters["rope_type"] == "linear"
    ids = loaded.tokenizer.encode("The quick brown fox jumps over the lazy dog, then runs far away.")
    runner = ModelRunner(loaded, num_slots=256, max_running_requests=2, max_context_len=128, attention_backend="torch")
    ours = PagedRequests(runner).forward([("a", ids)], all_logits=True)[0]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=0)
    plain = PagedRequests(ModelRunner(load_model(str(default_dir)), num_slots=256, attention_backend="torch"))
    assert (plain.forward([("a", ids)], all_logits=True)[0] - ours).abs().max() > 0.1  # the scaling is in effect


def test_a_host_tier_budget_past_the_host_memory_is_refused_before_loading(monkeypatch):
    """``host_cache_bytes=10**18`` was taken: the host tier (lazily filled) would have grown
    until the kernel's OOM killer ended the process."""
    import radixkv.engine.tiers as tiers

    monkeypatch.setattr(tiers, "free_memory_bytes", lambda device: 1 << 30)
    with pytest.raises(ValueError, match=r"^host_cache_bytes 1073741825 is more than the 1073741824 bytes of host"):
        LLM(host_cache_bytes=(1 << 30) + 1)
    with pytest.raises(ValueError, match=r"^host_cache_bytes 1000000000000000000 is more than"):
        AsyncLLM(host_cache_bytes=10**18)


def test_a_close_that_times_out_leaves_the_stores_open_for_the_writes_still_queued(tiny, tmp_path):
    """``LLM.close(timeout)`` returning False (a slow disk) closed the stores at once: the I/O
    thread then wrote the queued blocks into a closed DiskStore, which drops them, and a later
    ``close()`` reported True with none of them on disk (a restart found nothing)."""
    import threading

    llm = LLM(loaded_model=tiny, max_total_tokens=256, disk_cache_dir=str(tmp_path))
    store = llm.engine.kv.tiers.stores[0]
    gate, put = threading.Event(), store.put

    def slow_put(*a, **kw):
        gate.wait(30)
        return put(*a, **kw)

    store.put = slow_put
    prompt = list(range(1, 50))
    greedy = SamplingParams(max_tokens=2, temperature=0)
    llm.generate([prompt], greedy, use_tqdm=False)
    assert llm.close(timeout=0.01) is False
    gate.set()
    assert llm.close() is True
    again = LLM(loaded_model=tiny, max_total_tokens=256, disk_cache_dir=str(tmp_path))
    again.generate([prompt], greedy, use_tqdm=False)
    assert again.cache_stats()["cached_tokens_by_tier"]["disk"] == 48  # every block below the last prompt token
    again.close()


def test_a_close_with_a_timeout_returns_in_time_while_another_thread_generates(tiny, tmp_path):
    """``LLM.close(timeout)`` from another thread while a ``generate`` runs (a cleanup thread, a
    watchdog): it waited for the LLM's lock without the timeout, so it returned only when that
    whole generate had; now it returns False once ``timeout`` passes, and the generate is whole."""
    import threading
    import time

    from radixkv.engine import StepFinished

    llm = LLM(loaded_model=tiny, max_total_tokens=256, disk_cache_dir=str(tmp_path))
    stepping, gate = threading.Event(), threading.Event()

    def hold(ev):
        stepping.set()
        gate.wait(60)

    off = llm.engine.events.subscribe(hold, (StepFinished,))
    outs: list = []
    greedy = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    worker = threading.Thread(target=lambda: outs.extend(llm.generate([[1, 2, 3]], greedy, use_tqdm=False)))
    worker.start()
    assert stepping.wait(60)
    start = time.monotonic()
    closed = llm.close(timeout=0.2)
    waited = time.monotonic() - start
    off()
    gate.set()
    worker.join(60)
    assert closed is False and waited < 10
    assert len(outs[0].outputs[0].token_ids) == 3
    assert llm.close() is True


def test_a_pool_too_small_for_any_request_is_refused_at_start(tiny):
    """``max_total_tokens=1`` (or a ``kv_cache_memory_bytes`` of one token) built an engine whose
    context was 1 token, so every request was refused ("prompt has 1 tokens; max_context_len is
    1"): the engine could never serve anything, and said so only per request."""
    with pytest.raises(ValueError, match=r"^max_total_tokens must be >= 2 \(the slots of a prompt token and a gen"):
        EngineConfig(max_total_tokens=1).resolve()
    with pytest.raises(ValueError, match=r"^kv_cache_memory_bytes 1000 holds 1 token of 512 bytes in float32; a req"):
        LLM(loaded_model=tiny, kv_cache_memory_bytes=1000)
    llm = LLM(loaded_model=tiny, max_total_tokens=2)
    assert llm.engine.max_context_len == 2
    out = llm.generate([[1]], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 1
    # the context is the pool's size here: the refusal names the setting to raise (it named only
    # max_context_len, which a replay or serve user never set)
    pool = "max_context_len is 2, the KV pool's 2 slots (max_total_tokens, or what kv_cache_memory_bytes holds)"
    with pytest.raises(ValueError, match=re.escape(f"prompt has 2 tokens; {pool}")):
        llm.generate([[1, 2]], SamplingParams(max_tokens=1), use_tqdm=False)
    with pytest.raises(ValueError, match=re.escape("exceeds max_context_len 2, the KV pool's 2 slots")):
        llm.generate([[1]], SamplingParams(max_tokens=2), use_tqdm=False)


def test_an_async_llm_dropped_without_shutdown_is_freed(tiny):
    """Its engine thread ran a bound method of it, so an AsyncLLM never shut down was never
    collected: ``del alm`` kept the engine, its KV pool and the thread for the rest of the
    process (vLLM's AsyncLLM shuts down when collected)."""
    import asyncio
    import gc
    import weakref

    alm = AsyncLLM(loaded_model=tiny, max_total_tokens=256)

    async def one(llm):
        async for out in llm.generate(prompt_token_ids=[1, 2, 3], sampling_params=SamplingParams(max_tokens=3)):
            last = out
        return last.outputs[0].token_ids

    assert len(asyncio.run(one(alm))) == 3
    engine, thread = weakref.ref(alm.engine), alm._thread
    del alm
    gc.collect()
    thread.join(30)
    assert not thread.is_alive()
    gc.collect()
    assert engine() is None


@pytest.mark.parametrize("engine", [3, "engine", object()])
def test_async_llm_refuses_an_engine_that_is_not_one(engine):
    """``AsyncLLM(engine=3)`` was an AttributeError from deep inside (``int`` has no
    ``cache_stats``); it is a ValueError naming ``engine``."""
    from radixkv.async_llm import AsyncLLM

    with pytest.raises(ValueError, match=r"^AsyncLLM: engine must be a radixkv Engine, got "):
        AsyncLLM(engine=engine)


@pytest.mark.parametrize(
    "spelling, want", [("BF16", torch.bfloat16), (" Float ", torch.float32), ("HALF", torch.float16)]
)
def test_dtype_spellings_are_taken_in_any_case(spelling, want):
    """``dtype="BF16"`` was a ValueError while ``kv_cache_dtype="BF16"`` was bf16 (vLLM takes
    either case, and "float" for float32)."""
    cfg = EngineConfig(dtype=spelling, device="cpu").resolve()
    assert cfg.dtype == want
