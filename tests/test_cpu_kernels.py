"""The native CPU kernels (radixkv/kernels/cpu.py, csrc/cpu_kernels/) against torch references.

The attention kernel is checked against a float64 reference in tests/test_attention_torch.py and
the fused decoder layer against transformers in tests/test_models_tiny.py / test_model_default.py.
"""

from __future__ import annotations

import multiprocessing as mp
import sys
import threading

import pytest
import torch
import torch.nn.functional as F

from radixkv.kernels import cpu as ck
from radixkv.models.layers import PackCache, apply_rope, linear

pytestmark = pytest.mark.skipif(not ck.AVAILABLE, reason="native CPU kernels not built or no AVX2/FMA/F16C")


def _f64_linear(x, w, b=None):
    return F.linear(x.double(), w.double(), None if b is None else b.double())


@pytest.mark.parametrize("m", [1, 5, 6, 7, 16, 64])
@pytest.mark.parametrize("n, k", [(16, 8), (17, 200), (960, 576), (100, 1536), (33, 129)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_equals_float64(m, n, k, with_bias):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if with_bias else None
    got = ck.packed_linear(x, ck.PackedWeight(w), b)
    assert got.shape == (m, n) and got.dtype == torch.float32
    # float32 accumulation over k terms of size ~1: error ~ sqrt(k) * 2^-24 * |terms|
    torch.testing.assert_close(got.double(), _f64_linear(x, w, b), atol=2e-5 * k**0.5, rtol=0)


def test_packed_linear_strided_rows_and_errors():
    w = torch.randn(40, 24)
    pw = ck.PackedWeight(w)
    assert pw.format == "f32" and pw.nbytes == 64 + 3 * 24 * 16 * 4
    panels = pw.data[64:].view(torch.float32).view(3, 24, 16)  # after the 64-byte header
    assert torch.equal(panels[1], w[16:32].T) and torch.equal(panels[2, :, 8:], torch.zeros(24, 8))  # padded past N
    big = torch.randn(5, 30)
    x = big[:, 3:27]  # rows 30 floats apart
    torch.testing.assert_close(ck.packed_linear(x, pw).double(), _f64_linear(x, w), atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="x has 23 columns, the weight has K=24"):
        ck.packed_linear(torch.randn(2, 23), pw)
    with pytest.raises(ValueError, match="float32"):
        ck.packed_linear(torch.randn(2, 24, dtype=torch.float64), pw)
    with pytest.raises(ValueError, match="bias has 39 entries, N=40"):
        ck.packed_linear(torch.randn(2, 24), pw, torch.randn(39))
    with pytest.raises(ValueError, match="2-d float32 CPU tensor"):
        ck.PackedWeight(torch.randn(3))
    assert ck.packed_linear(torch.randn(0, 24), pw).shape == (0, 40)


def _q4_1_weight(n, k, g):
    """Values of GGUF's Q4_1 form: per 32 k, q * d + m with fp16 d, m and q in 0..15."""
    d = (torch.rand(n, k // 32, 1, generator=g) * 0.02).half().float()
    m = (-torch.rand(n, k // 32, 1, generator=g) * 0.1).half().float()
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15  # the block's minimum and maximum, as the quantizer makes them
    return (q * d + m).reshape(n, k)


def _q8_0_weight(n, k, g):
    """Values of GGUF's Q8_0 form: per 32 k, q * d with fp16 d and q in -127..127."""
    d = (torch.rand(n, k // 32, 1, generator=g) * 0.01).half().float()
    q = torch.randint(-127, 128, (n, k // 32, 32), generator=g).float()
    q[..., 0] = 127
    return (q * d).reshape(n, k)


@pytest.mark.parametrize("fmt, make", [("q4_1", _q4_1_weight), ("q8_0", _q8_0_weight)])
@pytest.mark.parametrize("n, k", [(16, 32), (40, 64), (37, 160), (960, 576), (100, 1536)])
def test_block_formats_are_lossless(fmt, make, n, k):
    """A weight in Q4_1 / Q8_0 form packs into that format (6.4x / 3.8x fewer bytes) and holds its
    values exactly: a one-hot x gives every weight back bit for bit. Each GEMM sums with the block
    scale factored out (csrc/cpu_kernels/gemm.c, "the factored sum"), so it is held to float64, not to
    the float32 packing's bits."""
    g = torch.Generator().manual_seed(n * 7 + k)
    w = make(n, k, g)
    packed, plain = ck.PackedWeight(w), ck.PackedWeight(w, ("f32",))
    assert packed.format == fmt and plain.format == "f32"
    panels = -(-n // 16)
    assert packed.nbytes == 64 + panels * (k // 32) * (320 if fmt == "q4_1" else 544)  # 5 / 8.5 bits a weight
    assert plain.nbytes == 64 + panels * k * 64
    b = torch.randn(n, generator=g)
    eye = torch.eye(k)
    assert torch.equal(ck.packed_linear(eye, packed), w.T)  # the micro-kernel
    assert all(torch.equal(ck.packed_linear(eye[i : i + 1], packed)[0], w[:, i]) for i in (0, 1, k // 2, k - 1))
    for m in (1, 5, 6, 7, 16, 17, 64):
        x = torch.randn(m, k, generator=g)
        got = ck.packed_linear(x, packed, b)
        torch.testing.assert_close(got.double(), _f64_linear(x, w, b), atol=2e-5 * k**0.5, rtol=0)
        torch.testing.assert_close(got, ck.packed_linear(x, plain, b), atol=2e-5 * k**0.5, rtol=0)


def test_gguf_dequantized_weights_pack_in_their_block_format():
    """The values gguf-py dequantizes a Q4_1 / Q8_0 tensor to (what transformers loads from a
    GGUF file) are recovered exactly, including blocks of equal values and all zeros."""
    gq = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType as T

    g = torch.Generator().manual_seed(3)
    src = torch.randn(48, 256, generator=g) * 0.05
    src[0, :32] = 0.0  # one block of zeros
    src[1, 32:64] = 0.25  # one block of a single value
    for qtype, fmt in ((T.Q4_1, "q4_1"), (T.Q8_0, "q8_0")):
        deq = torch.from_numpy(gq.dequantize(gq.quantize(src.numpy(), qtype), qtype).copy()).float()
        packed = ck.PackedWeight(deq)
        assert packed.format == fmt
        eye = torch.eye(256)
        assert torch.equal(ck.packed_linear(eye, packed), deq.T)  # every value recovered bit for bit
        assert torch.equal(ck.packed_linear(eye[7:8], packed)[0], deq[:, 7])  # the one-row GEMV too


def test_block_formats_refuse_weights_they_cannot_hold_exactly():
    g = torch.Generator().manual_seed(4)
    w = _q4_1_weight(32, 64, g)
    assert ck.PackedWeight(torch.randn(32, 64, generator=g)).format == "f32"  # arbitrary floats
    assert ck.PackedWeight(w[:, :48].contiguous()).format == "f32"  # K not a multiple of 32
    bent = w.clone()
    bent[5, 40] = torch.nextafter(bent[5, 40], torch.tensor(1.0))  # one value off the grid by 1 ulp
    assert ck.PackedWeight(bent).format == "f32"
    assert ck.PackedWeight(w, ("q8_0", "q4_1")).format == "q4_1"
    with pytest.raises(ValueError, match="not exact in any of"):
        ck.PackedWeight(bent, ("q4_1", "q8_0"))
    with pytest.raises(ValueError, match="unknown format 'int4'"):
        ck.PackedWeight(w, ("int4",))


def test_strided_and_expanded_weights_pack():
    g = torch.Generator().manual_seed(11)
    ws = (
        torch.randn(64, 1, generator=g).t(),
        torch.randn(64, generator=g).expand(8, 64),
        torch.randn(40, 70, generator=g)[:, 3:67],
    )
    for w in ws:
        x = torch.randn(5, w.shape[1], generator=g)
        got = ck.packed_linear(x, ck.PackedWeight(w)).double()
        # float32 summation of K products: |error| <= K * eps32 * sum_k |x_k w_k| (any order)
        bound = w.shape[1] * 2.0**-24 * (x.double().abs() @ w.double().abs().t())
        assert bool(((got - _f64_linear(x, w)).abs() <= bound).all())


def test_negative_zero_is_not_taken_into_a_block_format():
    """A stored integer decodes to +0.0; a -0.0 weight keeps float32 panels, so the bits match in
    every rounding mode."""
    w = torch.zeros(16, 32)
    w[:, 0] = 127 * 2.0**-10  # a Q8_0 block (d = 2^-10) but for the -0.0 below
    w[:, 1] = -0.0
    assert ck.PackedWeight(w).format == "f32"
    w[:, 1] = 0.0
    assert ck.PackedWeight(w).format == "q8_0"


def test_pack_cache_notices_a_transposed_replacement():
    g = torch.Generator().manual_seed(11)  # NOTE: the global RNG's state depends on the tests before
    w = torch.randn(32, 32, generator=g)
    x = torch.randn(3, 32, generator=g)
    cache = PackCache()
    with torch.no_grad():
        linear(x, w, None, cache)
        got = linear(x, w.t(), None, cache)  # same address, shape and version: other strides
    torch.testing.assert_close(got.double(), _f64_linear(x, w.t()), atol=1e-5, rtol=0)


def test_kernels_check_the_packed_weight_header():
    pw = ck.PackedWeight(torch.randn(32, 64))
    out = torch.empty(2, 32)
    x = torch.randn(2, 64)
    small = ck.PackedWeight(torch.randn(1, 1))
    small.data[4] = 2  # a tampered header: format q8_0 with K = 1 (its blocks would read past the buffer)
    with pytest.raises(ValueError, match="multiple of 32"):
        ck._ck.sgemm_packed(x.data_ptr(), 2, 1, 64, small.address, 1, 0, out.data_ptr(), 32, 1)
    with pytest.raises(ValueError, match="shape does not match"):
        ck._ck.sgemm_packed(x.data_ptr(), 2, 64, 64, pw.data.data_ptr(), 31, 0, out.data_ptr(), 32, 1)
    junk = torch.zeros(4096, dtype=torch.uint8)
    with pytest.raises(ValueError, match="not a packed weight"):
        ck._ck.sgemm_packed(x.data_ptr(), 2, 64, 64, junk.data_ptr(), 32, 0, out.data_ptr(), 32, 1)


def test_results_do_not_depend_on_thread_count():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(16, 576, generator=g), torch.randn(3072, 576, generator=g)
    pw = ck.PackedWeight(w)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ck.packed_linear(x, pw)
        torch.set_num_threads(2)
        two = ck.packed_linear(x, pw)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)  # each output is one FMA chain, whichever thread computes it


def test_concurrent_callers_get_their_own_results():
    """Kernels release the GIL; calls from several Python threads take turns, one parallel region
    at a time (OpenMP would give each calling thread its own team of spinning threads)."""
    ws = [torch.randn(200 + 16 * i, 64) for i in range(4)]
    xs = [torch.randn(8, 64) for _ in range(4)]
    pws = [ck.PackedWeight(w) for w in ws]
    want = [ck.packed_linear(x, pw) for x, pw in zip(xs, pws)]
    got: dict[int, list] = {i: [] for i in range(4)}

    def work(i):
        for _ in range(50):
            got[i].append(ck.packed_linear(xs[i], pws[i]))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(4):
        assert all(torch.equal(r, want[i]) for r in got[i])


def _child(q):
    x, w = torch.ones(16, 64), torch.ones(512, 64)  # 32 panels: split over the threads
    q.put((ck.packed_linear(x, ck.PackedWeight(w)).sum().item(), ck._ck.threading()))


def test_pool_works_after_fork():
    """A child forked after the parent ran parallel kernels computes the same, on the pthread pool
    (GNU libgomp's threads do not survive fork(): an OpenMP region there would hang)."""
    threading_before = ck._ck.threading()
    ck.packed_linear(torch.randn(16, 64), ck.PackedWeight(torch.randn(512, 64)))  # start the workers here
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(q,))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    assert q.get(timeout=5) == (16 * 512 * 64, "pthreads")
    assert ck._ck.threading() == threading_before  # the parent keeps its threads
    x, w = torch.randn(16, 64), torch.randn(512, 64)
    torch.testing.assert_close(ck.packed_linear(x, ck.PackedWeight(w)), x @ w.T, atol=1e-4, rtol=0)


def _libgomp_paths() -> set[str]:
    with open("/proc/self/maps") as f:
        return {line.split()[-1] for line in f if "libgomp" in line.split()[-1]}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_kernels_run_on_torchs_openmp_threads():
    """Built with OpenMP, the kernels use the libgomp torch loaded (one runtime, one set of
    worker threads), not a second copy whose spinning workers would fight torch's for the cores."""
    if ck._ck.threading() != "openmp":
        pytest.skip("built without OpenMP: the kernels use their pthread pool")
    torch_gomp = {p for p in _libgomp_paths() if "/torch/" in p}
    if not torch_gomp:
        pytest.skip("this torch does not ship GNU libgomp")
    ck.packed_linear(torch.randn(16, 64), ck.PackedWeight(torch.randn(512, 64)))
    assert _libgomp_paths() == torch_gomp


def test_pack_cache_follows_in_place_weight_changes():
    g = torch.Generator().manual_seed(12)  # NOTE: the global RNG's state depends on the tests before
    w = torch.randn(32, 16, generator=g)
    x = torch.randn(3, 16, generator=g)
    cache = PackCache()
    with torch.no_grad():
        first = linear(x, w, None, cache)
        torch.testing.assert_close(first.double(), _f64_linear(x, w), atol=1e-5, rtol=0)
        w.mul_(2)  # e.g. load_weights copying new values in
        second = linear(x, w, None, cache)
    torch.testing.assert_close(second.double(), _f64_linear(x, w), atol=1e-5, rtol=0)


@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm(with_delta):
    g = torch.Generator().manual_seed(1)
    res, delta, w = torch.randn(7, 100, generator=g), torch.randn(7, 100, generator=g), torch.randn(100, generator=g)
    ref_res = res + delta if with_delta else res.clone()
    h = ref_res.double()
    ref = w.double() * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5))
    out = ck.add_rms_norm(delta if with_delta else None, res, w, 1e-5)
    torch.testing.assert_close(res, ref_res, atol=0, rtol=0)  # the residual was updated in place
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="weight must be a contiguous float32 CPU tensor of shape \\(100,\\)"):
        ck.add_rms_norm(None, res, torch.randn(99), 1e-5)
    with pytest.raises(ValueError, match="delta has 6 rows, residual 7"):
        ck.add_rms_norm(torch.randn(6, 100), res, w, 1e-5)


def test_rope_in_place_equals_apply_rope():
    t, hq, hkv, d = 5, 6, 2, 16
    qkv = torch.randn(t, (hq + 2 * hkv) * d)
    pos = torch.tensor([0, 3, 17, 100, 4095])
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    emb = torch.cat([pos[:, None] * inv, pos[:, None] * inv], -1)
    cos, sin = emb.cos().unsqueeze(1), emb.sin().unsqueeze(1)
    ref_q = apply_rope(qkv[:, : hq * d].reshape(t, hq, d), cos, sin)
    ref_k = apply_rope(qkv[:, hq * d : (hq + hkv) * d].reshape(t, hkv, d), cos, sin)
    v_before = qkv[:, (hq + hkv) * d :].clone()
    ck.rope_(qkv, hq + hkv, d, cos.view(t, d), sin.view(t, d))
    torch.testing.assert_close(qkv[:, : hq * d].reshape(t, hq, d), ref_q, atol=1e-5, rtol=0)
    torch.testing.assert_close(qkv[:, hq * d : (hq + hkv) * d].reshape(t, hkv, d), ref_k, atol=1e-5, rtol=0)
    assert torch.equal(qkv[:, (hq + hkv) * d :], v_before)  # v untouched
    with pytest.raises(ValueError, match="do not fit"):
        ck.rope_(qkv, 100, d, cos.view(t, d), sin.view(t, d))


def test_silu_mul_including_large_inputs():
    gu = torch.randn(9, 2 * 37) * 4
    gu[0, :5] = torch.tensor([-100.0, -88.0, 0.0, 88.0, 100.0])
    gate, up = gu.split(37, -1)
    ref = F.silu(gate.double()) * up.double()
    torch.testing.assert_close(ck.silu_mul(gu).double(), ref, atol=1e-5, rtol=1e-6)
    with pytest.raises(ValueError, match="even number of columns"):
        ck.silu_mul(torch.randn(2, 5))


def _attn_case():
    """2 requests over a pool of 4 pages of 4 slots: (q rows 0-1, kv_len 6), (q row 2, kv_len 3)."""
    q, kc = torch.randn(3, 2, 8), torch.randn(16, 1, 8)
    meta = torch.tensor([[0, 2], [2, 1], [0, 2], [6, 3]], dtype=torch.int32)
    kv_indices = torch.tensor([3, 1, 0], dtype=torch.int32)
    return q, kc, meta, kv_indices


@pytest.mark.parametrize(
    "change, msg",
    [
        (lambda m, kvi: None, None),
        (lambda m, kvi: kvi.__setitem__(1, 4), "page id is outside the pool"),
        (lambda m, kvi: kvi.__setitem__(0, -1), "page id is outside the pool"),
        (lambda m, kvi: m.__setitem__((3, 1), 9), "pages fall outside kv_indices"),
        (lambda m, kvi: m.__setitem__((1, 1), 4), "0 <= q_len <= kv_len"),
        (lambda m, kvi: m.__setitem__((1, 0), -1), "0 <= q_len <= kv_len"),
        (lambda m, kvi: m.__setitem__((0, 1), 3), "query rows fall outside q"),
    ],
)
def test_paged_attention_rejects_out_of_range_metadata(change, msg):
    q, kc, meta, kvi = _attn_case()
    change(meta, kvi)
    out = torch.empty_like(q)
    if msg is None:
        ck.paged_attention(q, out, meta, kvi, 4, kc, kc, 0.5)
        assert torch.isfinite(out).all()
    else:
        with pytest.raises(ValueError, match=msg):
            ck.paged_attention(q, out, meta, kvi, 4, kc, kc, 0.5)


def test_paged_attention_rejects_bad_page_size_and_heads():
    q, kc, meta, kvi = _attn_case()
    for ps in (0, -1, 3):  # 3 does not divide the 16 slots
        with pytest.raises(ValueError, match="page_size must be >= 1 and divide num_slots"):
            ck.paged_attention(q, torch.empty_like(q), meta, kvi, ps, kc, kc, 0.5)
    empty = torch.randn(16, 0, 8)
    with pytest.raises(ValueError, match="Hkv|agree"):
        ck.paged_attention(q, torch.empty_like(q), meta, kvi, 4, empty, empty, 0.5)


def test_other_argument_errors():
    with pytest.raises(ValueError, match=r"at least \[1, 1\]"):
        ck.PackedWeight(torch.randn(5, 0))
    x = torch.randn(2, 8, requires_grad=True)
    with pytest.raises(ValueError, match="records no gradient"):
        ck.packed_linear(x, ck.PackedWeight(torch.randn(4, 8)))
    with pytest.raises(ValueError, match="num_heads >= 1"):
        ck.rope_(torch.randn(2, 16), 0, 8, torch.randn(2, 8), torch.randn(2, 8))


def test_arguments_that_are_not_tensors_are_named_in_a_value_error():
    """None (or a list) where a tensor belongs: a ValueError naming the argument, not an
    AttributeError from inside the wrapper."""
    pw = ck.PackedWeight(torch.randn(4, 8))
    q, kc, meta, kvi = _attn_case()
    out = torch.empty_like(q)
    fp8 = kc.to(torch.float8_e4m3fn)
    cases = [
        (lambda: ck.packed_linear(None, pw), "packed_linear: x"),
        (lambda: ck.packed_linear(torch.randn(2, 8), None), "packed_linear: packed must be a PackedWeight"),
        (lambda: ck.PackedWeight([[1.0] * 8]), "PackedWeight: weight"),
        (lambda: ck.kv_quantize(None, "bfloat16"), "kv_quantize: x"),
        (lambda: ck.paged_attention(None, out, meta, kvi, 4, kc, kc, 0.5), "paged_attention: q"),
        (lambda: ck.paged_attention(q, out, meta.tolist(), kvi, 4, kc, kc, 0.5), "paged_attention: req_meta"),
        (lambda: ck.paged_attention(q, out, meta, kvi, 4, None, kc, 0.5), "paged_attention: k_cache"),
        (lambda: ck.paged_attention(q, out, meta, kvi, 4, fp8, fp8, 0.5, [1.0], [1.0]), "paged_attention: k_scale"),
        (lambda: ck.add_rms_norm(None, torch.randn(2, 8), None, 1e-6), "add_rms_norm: weight"),
        (lambda: ck.rope_(None, 1, 8, torch.randn(2, 8), torch.randn(2, 8)), "rope_: x"),
        (lambda: ck.silu_mul(None), "silu_mul: gate_up"),
        (lambda: ck.apply_token_bitmask_(torch.randn(2, 32), torch.zeros(2, 1, dtype=torch.int32), [0]), "rows"),
    ]
    for call, name in cases:
        with pytest.raises(ValueError, match=name):
            call()


def test_reset_packed_weights_after_edits_through_data():
    from transformers import LlamaConfig

    from radixkv.models import build_model

    cfg = LlamaConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=False,
    )
    model = build_model(cfg, seed=0).eval()
    lin = model.model.layers[0].mlp.down_proj
    x = torch.randn(3, 48)
    with torch.no_grad():
        lin(x)  # packs the weight
        lin.weight.data.mul_(2)  # not counted in weight._version: the packed copy is stale
        stale = lin(x)
        model.reset_packed_weights()
        fresh = lin(x)
    want = _f64_linear(x, lin.weight.detach())
    assert (stale.double() - want).abs().max() > 1e-2
    torch.testing.assert_close(fresh.double(), want, atol=1e-5, rtol=0)
