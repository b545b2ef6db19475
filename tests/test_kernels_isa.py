"""The kernels' run-time ISA choice (radixkv.kernels.cpu.isa / set_isa, RADIXKV_KERNELS_ISA).

On a CPU with AVX-512 the one-row GEMV and the attention passes over bf16 / fp16 / fp8 K/V run
their AVX-512 forms; they must give exactly the AVX2 path's bits (same FMA chains, same reduction
trees), so the logits and greedy tokens do not depend on the CPU. The
AVX2 path stays tested on such CPUs: the kernel and fused-step test modules run again here
with RADIXKV_KERNELS_ISA=avx2.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kv_dtype_ref import make_pool
from model_helpers import PagedRequests
from test_cpu_kernels import _q4_1_weight, _q8_0_weight
from test_decode_step import _runner, _tiny

from radixkv.executor.model_runner import ModelRunner
from radixkv.kernels import cpu as ck

pytestmark = [
    pytest.mark.skipif(not ck.AVAILABLE, reason="native CPU kernels not built or no AVX2/FMA/F16C"),
    pytest.mark.timeout(600),
]

needs_avx512 = pytest.mark.skipif(not ck.has_avx512(), reason="this CPU has no AVX-512 F/BW/VL")


@pytest.fixture
def restore_isa():
    was = ck.isa()
    yield
    ck.set_isa(was)


def test_isa_names_and_errors(restore_isa):
    assert ck.isa() in ("avx2", "avx512")
    ck.set_isa("avx2")
    assert ck.isa() == "avx2"
    with pytest.raises(ValueError, match="isa must be 'avx2' or 'avx512'"):
        ck.set_isa("sse2")
    if ck.has_avx512():
        ck.set_isa("avx512")
        assert ck.isa() == "avx512"
    else:
        with pytest.raises(ValueError, match="needs AVX-512"):
            ck.set_isa("avx512")


@needs_avx512
@pytest.mark.parametrize("fmt", ["f32", "q4_1", "q8_0"])
@pytest.mark.parametrize("n, k", [(16, 64), (35, 96), (130, 576), (49, 1536), (7, 37)])
def test_avx512_gemv_gives_the_avx2_bits(restore_isa, fmt, n, k):
    if fmt != "f32" and k % 32:
        pytest.skip("block formats need K % 32 == 0")
    g = torch.Generator().manual_seed(n * 3 + k)
    w = {"f32": lambda: torch.randn(n, k, generator=g), "q4_1": lambda: _q4_1_weight(n, k, g)}.get(
        fmt, lambda: _q8_0_weight(n, k, g)
    )()
    packed = ck.PackedWeight(w, (fmt,))
    b = torch.randn(n, generator=g)
    x = torch.randn(1, k, generator=g)
    got = {}
    for isa in ("avx2", "avx512"):
        ck.set_isa(isa)
        got[isa] = (ck.packed_linear(x, packed, b), ck.packed_linear(x, packed))
    assert torch.equal(got["avx2"][0], got["avx512"][0]) and torch.equal(got["avx2"][1], got["avx512"][1])
    many = ck.packed_linear(torch.cat([x, x]), packed, b)  # the micro-kernel (AVX2 on both)
    assert torch.equal(many[:1], got["avx512"][0])


def _blocky_tiny():
    """The tiny Llama with GGUF-block weights: Q4_1 projections and a Q8_0 output projection, the
    formats the default model decodes in."""
    cfg, model = _tiny(vocab=160)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and p.shape[1] % 32 == 0 and "embed" not in name:
                p.copy_((_q8_0_weight if "lm_head" in name else _q4_1_weight)(*p.shape, g))
    model.reset_packed_weights()
    return cfg, model


@needs_avx512
def test_fused_decode_logits_equal_under_both_isas(restore_isa):
    cfg, model = _blocky_tiny()
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, cfg.vocab_size, (40,), generator=g).tolist()
    runs = {}
    for isa in ("avx2", "avx512"):
        ck.set_isa(isa)
        reqs = PagedRequests(_runner(model, cfg, "cpu"), seed=1)
        (logits,) = reqs.forward([("a", prompt)])
        out, tok = [], int(logits.argmax())
        for _ in range(6):
            (logits,) = reqs.forward([("a", [tok])])
            out.append(logits)
            tok = int(logits.argmax())
        runs[isa] = torch.stack(out)
    assert torch.equal(runs["avx2"], runs["avx512"])


@needs_avx512
@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float16", "fp8_e4m3", "fp8_e5m2"])
def test_fused_decode_logits_equal_under_both_isas_in_each_kv_dtype(restore_isa, kv_dtype):
    """The GGUF-block model over a K/V pool of each dtype, 300 positions (two attention chunks):
    the AVX-512 forms of the K/V widening, the scores and the weighted sum of V give the AVX2
    forms' bits (and so do the K/V writes: the pools end equal)."""
    cfg, model = _blocky_tiny()
    g = torch.Generator().manual_seed(9)
    prompt = torch.randint(0, cfg.vocab_size, (300,), generator=g).tolist()
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    runs, pools = {}, {}
    for isa in ("avx2", "avx512"):
        ck.set_isa(isa)
        pool = make_pool(cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim, 1024, 4, kv_dtype)
        runner = ModelRunner(
            model, cfg, kv_pool=pool, max_running_requests=2, max_context_len=512, attention_backend="cpu"
        )
        reqs = PagedRequests(runner, seed=1)
        for i in range(0, len(prompt), 16):  # the fused step's extends
            (logits,) = reqs.forward([("a", prompt[i : i + 16])])
        out, tok = [], int(logits.argmax())
        for _ in range(6):
            (logits,) = reqs.forward([("a", [tok])])
            out.append(logits)
            tok = int(logits.argmax())
        runs[isa], pools[isa] = torch.stack(out), pool
    assert torch.equal(runs["avx2"], runs["avx512"])
    for a, b in zip(
        pools["avx2"].k_buffer + pools["avx2"].v_buffer, pools["avx512"].k_buffer + pools["avx512"].v_buffer
    ):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@needs_avx512
def test_kernel_and_fused_step_tests_pass_with_avx2_forced():
    """tests/test_cpu_kernels.py and tests/test_decode_step.py again, on the AVX2 kernels."""
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "RADIXKV_KERNELS_ISA": "avx2"}
    probe = subprocess.run(
        [sys.executable, "-c", "from radixkv.kernels import cpu; print(cpu.isa())"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert probe.stdout.strip() == "avx2"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-x",
            "-p",
            "no:cacheprovider",
            "tests/test_cpu_kernels.py",
            "tests/test_decode_step.py",
        ],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
