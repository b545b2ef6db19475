"""Tiny random Llama / Qwen2 / Mistral models: radixkv logits equal transformers' (fp32, atol 1e-4)
for one prompt, a batch of prompts, an extend over a cached prefix (prefix not page aligned) and
decode steps, at page_size 1 and 16, including one batch mixing all three kinds."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from model_helpers import PagedRequests
from transformers import LlamaConfig, MistralConfig, Qwen2Config
from transformers import LlamaForCausalLM as HFLlama
from transformers import MistralForCausalLM as HFMistral
from transformers import Qwen2ForCausalLM as HFQwen2

from radixkv.executor import cpu_decode as native_decode
from radixkv.executor.model_runner import ModelRunner
from radixkv.kernels import cpu as cpu_kernels
from radixkv.models import build_model, get_model_class

pytestmark = pytest.mark.timeout(300)

ATOL = 1e-4
COMMON = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)


def _configs():
    return {
        "llama-mha-tied": (
            LlamaConfig(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True, **COMMON),
            HFLlama,
        ),
        "llama3-gqa-ropescaling": (
            LlamaConfig(
                num_attention_heads=4,
                num_key_value_heads=2,
                tie_word_embeddings=False,
                rope_parameters={
                    "rope_type": "llama3",
                    "rope_theta": 500000.0,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 32,
                },
                **COMMON,
            ),
            HFLlama,
        ),
        "qwen2-gqa-bias": (
            Qwen2Config(num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=False, **COMMON),
            HFQwen2,
        ),
        "qwen2-gqa-bias-hd16": (  # head_dim 16: the native CPU kernels run it (they need a multiple of 8)
            Qwen2Config(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, **COMMON),
            HFQwen2,
        ),
        "mistral-gqa": (
            MistralConfig(
                num_attention_heads=4,
                num_key_value_heads=1,
                sliding_window=4096,
                tie_word_embeddings=False,
                head_dim=16,
                **COMMON,
            ),
            HFMistral,
        ),
    }


CONFIG_NAMES = list(_configs())


@pytest.fixture(scope="module", params=CONFIG_NAMES)
def pair(request):
    cfg, hf_cls = _configs()[request.param]
    cfg.architectures = [hf_cls.__name__]
    torch.manual_seed(0)
    hf = hf_cls(cfg).eval()
    with torch.no_grad():  # give biases and norms non-trivial values so they are really checked
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    ours = get_model_class(cfg)(cfg)
    ours.load_weights(hf.state_dict().items())
    return cfg, hf, ours.eval()


# "cpu": the native kernels (decode-sized batches run the whole forward pass as one native call,
# radixkv/executor/cpu_decode.py); "torch": the reference modules and attention.
BACKENDS = ["torch"] + (["cpu"] if cpu_kernels.AVAILABLE else [])


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def _runner(ours, cfg, page_size, backend="torch"):
    if backend == "cpu" and ours.head_dim % 8:
        pytest.skip(f"the native CPU kernels need head_dim % 8 == 0 (this config: {ours.head_dim})")
    return ModelRunner(
        ours,
        cfg,
        num_slots=64 * 16,
        page_size=page_size,
        max_running_requests=8,
        max_context_len=256,
        attention_backend=backend,
    )


def _count_fused_steps(monkeypatch) -> list:
    """A list that gets one entry per forward pass the fused native step computed
    (radixkv/executor/cpu_decode.py: the whole pass in one native call)."""
    fused = []
    real = native_decode.DecodeStep.forward

    def counting(self, batch):
        out = real(self, batch)
        if out is not None:
            fused.append(1)
        return out

    monkeypatch.setattr(native_decode.DecodeStep, "forward", counting)
    return fused


def _hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def _prompt(seed, n, vocab=97):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


@pytest.mark.parametrize("page_size", [1, 16])
def test_single_prompt_all_positions(pair, page_size, backend):
    cfg, hf, ours = pair
    ids = _prompt(1, 37)
    reqs = PagedRequests(_runner(ours, cfg, page_size, backend))
    (got,) = reqs.forward([("a", ids)], all_logits=True)
    torch.testing.assert_close(got, _hf_logits(hf, ids), atol=ATOL, rtol=0)


@pytest.mark.parametrize("page_size", [1, 16])
def test_batch_of_prompts(pair, page_size, backend):
    cfg, hf, ours = pair
    prompts = [_prompt(10 + i, n) for i, n in enumerate([5, 40, 17, 1, 33])]
    reqs = PagedRequests(_runner(ours, cfg, page_size, backend), seed=page_size)
    got = reqs.forward([(f"r{i}", p) for i, p in enumerate(prompts)], all_logits=True)
    for p, g in zip(prompts, got):
        torch.testing.assert_close(g, _hf_logits(hf, p), atol=ATOL, rtol=0)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("k", [5, 19])
def test_extend_over_cached_prefix(pair, page_size, k, backend):
    cfg, hf, ours = pair
    ids = _prompt(2, 45)
    ref = _hf_logits(hf, ids)
    reqs = PagedRequests(_runner(ours, cfg, page_size, backend))
    (first,) = reqs.forward([("a", ids[:k])], all_logits=True)
    (rest,) = reqs.forward([("a", ids[k:])], all_logits=True)
    torch.testing.assert_close(first, ref[:k], atol=ATOL, rtol=0)
    torch.testing.assert_close(rest, ref[k:], atol=ATOL, rtol=0)


@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_steps_and_mixed_batch(pair, page_size, backend, monkeypatch):
    cfg, hf, ours = pair
    a, b, c = _prompt(3, 20), _prompt(4, 31), _prompt(5, 26)
    reqs = PagedRequests(_runner(ours, cfg, page_size, backend), seed=7)
    fused = _count_fused_steps(monkeypatch)
    first = reqs.forward([("a", a), ("b", b[:9])])
    torch.testing.assert_close(first[1], _hf_logits(hf, b[:9])[-1:], atol=ATOL, rtol=0)
    a.append(int(first[0].argmax()))
    # decode a (greedy from our logits), extend b over its 9 cached tokens, fresh prefill c
    for step in range(6):
        items = [("a", [a[-1]])]
        if step == 0:
            items += [("b", b[9:]), ("c", c)]
        else:
            items += [("b", [b[-1]]), ("c", [c[-1]])]
        got = reqs.forward(items)
        for (rid, _), seq, g in zip(items, (a, b, c), got):
            ref = _hf_logits(hf, seq)[-1:]
            torch.testing.assert_close(g, ref, atol=ATOL, rtol=0, msg=f"step {step} request {rid}")
            seq.append(int(g.argmax()))
    # the fused step served exactly the pure-decode steps (1-5: every request brings one token)
    # and, in step 0, a's decode row, split out of the batch whose prefills are longer than
    # MAX_EXTEND (row_split: a decode row runs on the one-row path in any batch); the first pass
    # has no decode row. The torch backend never uses it
    assert len(fused) == (6 if backend == "cpu" else 0)


def test_native_decode_does_not_depend_on_thread_count(pair, monkeypatch):
    """The same decode step at 1 and at 2 threads gives the same logits bit for bit: the GEMMs and
    the attention share out their work units (panels, heads, chunks of positions), but every output
    element is computed by one thread in a fixed order."""
    cfg, _, ours = pair
    runner = _runner(ours, cfg, 1, "cpu")
    prompts = [_prompt(10 + i, n) for i, n in enumerate((7, 12, 9))]  # 3 rows: an uneven split
    pool = runner.req_to_token_pool
    rows = [pool.alloc() for _ in prompts]
    for i, (r, p) in enumerate(zip(rows, prompts)):
        pool.write(r, 0, torch.arange(i * 32, i * 32 + len(p) + 1))
    nxt = runner.forward(runner.build_batch(sum(prompts, []), rows, [0] * 3, [len(p) for p in prompts])).argmax(-1)
    decode = runner.build_batch(nxt, rows, [len(p) for p in prompts], [1] * 3)
    fused = _count_fused_steps(monkeypatch)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = runner.forward(decode)  # writes the step's K/V; the second run rewrites the same values
        torch.set_num_threads(2)
        two = runner.forward(decode)
    finally:
        torch.set_num_threads(before)
    assert len(fused) == 2
    assert torch.equal(one, two)


def test_build_model_random_init_runs(pair):
    cfg, _, _ = pair
    m1, m2 = build_model(cfg, seed=3), build_model(cfg, seed=3)
    for (n1, p1), (_, p2) in zip(m1.named_parameters(), m2.named_parameters()):
        assert torch.equal(p1, p2), n1
    reqs = PagedRequests(_runner(m1, cfg, 1))
    (logits,) = reqs.forward([("a", _prompt(6, 9))], all_logits=True)
    assert logits.shape == (9, cfg.vocab_size) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all() and logits.std() > 0


def test_runner_contract_form_and_errors(pair):
    from radixkv.memory.kv_pool import KVPool

    cfg, hf, ours = pair
    pool = KVPool(ours.num_layers, ours.num_kv_heads, ours.head_dim, 256, 16)
    runner = ModelRunner(ours, pool, "torch")  # architecture-contract form
    assert runner.kv_pool is pool and runner.page_size == 16 and runner.max_context_len == 256
    ids = _prompt(8, 21)
    (got,) = PagedRequests(runner).forward([("a", ids)])
    torch.testing.assert_close(got, _hf_logits(hf, ids)[-1:], atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="num_slots is required"):
        ModelRunner(ours, cfg)
    with pytest.raises(ValueError, match="does not fit the model"):
        ModelRunner(ours, cfg, kv_pool=KVPool(ours.num_layers + 1, ours.num_kv_heads, ours.head_dim, 16))
    if getattr(cfg, "sliding_window", None):
        with pytest.raises(ValueError, match="sliding_window"):
            ModelRunner(ours, cfg, num_slots=64, max_context_len=cfg.sliding_window + 1)


@pytest.mark.parametrize("rows", [1, 3, 16, 128, 129, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_weight_major_linear_equals_f_linear(rows, with_bias):
    """layers.linear computes (W @ x.T).T for up to SMALL_M_ROWS float32 CPU rows (decode) and
    F.linear otherwise; either way the values are F.linear's up to float32 rounding, the output
    is a contiguous [rows, out] tensor, and the Linear module holds nn.Linear's parameters."""
    from torch.nn import functional as F

    from radixkv.models import layers

    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g)
    w = torch.randn(200, 96, generator=g) / 10
    b = torch.randn(200, generator=g) if with_bias else None
    y = layers.linear(x, w, b)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert y.shape == (rows, 200) and y.dtype == torch.float32 and y.is_contiguous()
    torch.testing.assert_close(y.double(), ref, atol=1e-5, rtol=1e-5)
    assert layers.SMALL_M_ROWS == 128  # the crossover measured in docs/model.md
    lin = layers.Linear(96, 200, bias=with_bias)
    assert isinstance(lin, torch.nn.Linear) and set(lin.state_dict()) == set(
        torch.nn.Linear(96, 200, bias=with_bias).state_dict()
    )
    with torch.no_grad():
        lin.weight.copy_(w)
        if with_bias:
            lin.bias.copy_(b)
        torch.testing.assert_close(lin(x).double(), ref, atol=1e-5, rtol=1e-5)


def test_gguf_cache_key_depends_on_content_not_path_or_mtime(tmp_path):
    """The dequantized-GGUF cache is keyed by size + SHA-256 of the first and last MiB, so the
    same file installed in two virtual environments shares one cache; any change of those bytes
    or of the size gives a new key."""
    import os
    import shutil

    from radixkv.models import loader

    data = bytes(range(256)) * (3 * 4096 + 7)  # ~3 MiB: head, middle and tail differ in position
    a = tmp_path / "a" / "m.gguf"
    b = tmp_path / "b" / "m.gguf"
    a.parent.mkdir()
    b.parent.mkdir()
    a.write_bytes(data)
    shutil.copyfile(a, b)
    os.utime(b, (1, 1))
    assert loader._gguf_signature(a) == loader._gguf_signature(b)
    for pos in (0, len(data) - 1):
        c = bytearray(data)
        c[pos] ^= 1
        b.write_bytes(bytes(c))
        assert loader._gguf_signature(a) != loader._gguf_signature(b)
    b.write_bytes(data + b"\0")
    assert loader._gguf_signature(a) != loader._gguf_signature(b)


def test_torch_only_path_when_native_kernels_are_unavailable(pair, monkeypatch):
    """Without the C extension (or AVX2), every op falls back to torch: same logits."""
    cfg, hf, ours = pair
    monkeypatch.setattr(cpu_kernels, "AVAILABLE", False)
    a, b = _prompt(21, 12), _prompt(22, 7)
    reqs = PagedRequests(
        ModelRunner(ours, cfg, num_slots=256, max_running_requests=4, max_context_len=64, attention_backend="auto")
    )
    assert reqs.runner.attn_backend.name == "torch"
    first = reqs.forward([("a", a), ("b", b)])
    for seq, g in zip((a, b), first):
        torch.testing.assert_close(g, _hf_logits(hf, seq)[-1:], atol=ATOL, rtol=0)
        seq.append(int(g.argmax()))
    got = reqs.forward([("a", [a[-1]]), ("b", [b[-1]])])  # a decode step: 2 rows
    for seq, g in zip((a, b), got):
        torch.testing.assert_close(g, _hf_logits(hf, seq)[-1:], atol=ATOL, rtol=0)


@pytest.mark.skipif(not cpu_kernels.AVAILABLE, reason="native CPU kernels not built or no AVX2/FMA/F16C")
def test_native_decode_with_weights_in_block_form_and_as_buffers():
    """The fused decode path on weights that pack as Q4_1 / Q8_0 (as a GGUF model's do), one of
    them registered as a buffer instead of a parameter: same logits as transformers."""
    cfg, hf_cls = _configs()["mistral-gqa"]
    cfg.architectures = [hf_cls.__name__]
    torch.manual_seed(0)
    hf = hf_cls(cfg).eval()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() == 2 and p.shape[1] % 32 == 0:  # every block: q * d + m (Q4_1) or q * d (Q8_0)
                n, k = p.shape
                d = (torch.rand(n, k // 32, 1, generator=g) * 0.02).half().float()
                if "embed" in name or "lm_head" in name:
                    q = torch.randint(-127, 128, (n, k // 32, 32), generator=g).float()
                    q[..., 0] = 127  # the block's largest magnitude, as the quantizer makes it
                    p.copy_((q * d).reshape(n, k))
                else:
                    m = (-torch.rand(n, k // 32, 1, generator=g) * 0.1).half().float()
                    q = torch.randint(0, 16, (n, k // 32, 32), generator=g).float()
                    q[..., 0], q[..., 1] = 0, 15
                    p.copy_((q * d + m).reshape(n, k))
    ours = get_model_class(cfg)(cfg)
    ours.load_weights(hf.state_dict().items())
    ours.eval()
    down = ours.model.layers[0].mlp.down_proj
    w = down.weight.detach().clone()
    del down.weight
    down.register_buffer("weight", w)  # e.g. a frozen weight
    a, b = _prompt(31, 9), _prompt(32, 14)
    reqs = PagedRequests(_runner(ours, cfg, 1, "cpu"))
    first = reqs.forward([("a", a), ("b", b)])
    for _ in range(3):  # pure decode steps: the fused native path
        for seq, lg in zip((a, b), first):
            seq.append(int(lg.argmax()))
        first = reqs.forward([("a", [a[-1]]), ("b", [b[-1]])])
        for seq, lg in zip((a, b), first):
            torch.testing.assert_close(lg, _hf_logits(hf, seq)[-1:], atol=ATOL, rtol=0)
    packed = ours.packed_weight_bytes()
    assert set(packed) == {"q4_1", "q8_0"}, packed
