"""K/V pool dtypes on the native CPU kernels (issue 35): the write rounding (``kv_quantize``, the
fused step's K/V write) bit for bit against torch's casts and the contract's reference
(tests/kv_dtype_ref.py), every stored code read back exactly, ``paged_attention`` and the fused
decode step in each dtype against float64 / float32 references over the rounded pool, and the
AVX2 and AVX-512 paths giving the same bits in every dtype.
"""

from __future__ import annotations

import pytest
import torch
from kv_dtype_ref import DTYPES, FP8_MAX, STORAGE, RoundedF32Pool, make_pool, pool_rows, ref_quantize, ref_round
from model_helpers import PagedRequests
from test_decode_step import _tiny
from transformers import LlamaConfig

from radixkv.executor.model_runner import ModelRunner
from radixkv.kernels import cpu as ck
from radixkv.models import build_model

pytestmark = [
    pytest.mark.skipif(not ck.AVAILABLE, reason="native CPU kernels not built or no AVX2/FMA/F16C"),
    pytest.mark.timeout(600),
]

ISAS = ("avx2", "avx512") if ck.has_avx512() else ("avx2",)
FP8 = tuple(FP8_MAX)


@pytest.fixture
def restore_isa():
    was = ck.isa()
    yield
    ck.set_isa(was)


def _same_bits(a: torch.Tensor, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a.contiguous().view(view), b.contiguous().view(view))


def _check_quantize(x: torch.Tensor, name: str) -> None:
    """kv_quantize(x) has the reference's bits on every ISA path; reports the first mismatch."""
    want_q, want_s = ref_quantize(x, name)
    for isa in ISAS:
        ck.set_isa(isa)
        q, s = ck.kv_quantize(x, name)
        assert q.dtype == STORAGE[name] and q.shape == x.shape
        if not _same_bits(q, want_q):
            bad = (q.view(torch.uint8) != want_q.view(torch.uint8)).reshape(-1).nonzero()[0].item()
            flat = x.reshape(-1)[bad // q.element_size()]
            pytest.fail(f"{name} {isa}: {flat.item()!r} (bits {flat.view(torch.int32).item():#x}) rounds differently")
        assert _same_bits(s, want_s), f"{name} {isa}: scales differ"


def _fp8_grid(name: str) -> torch.Tensor:
    """Every finite non-negative fp8 value of ``name`` and every midpoint of two neighbours (float32)."""
    codes = torch.arange(0, 0x7F if name == "fp8_e4m3" else 0x7C, dtype=torch.uint8)
    vals = codes.view(STORAGE[name]).to(torch.float32)
    mids = ((vals[1:].double() + vals[:-1].double()) / 2).float()  # exact: few mantissa bits
    return torch.cat([vals, mids])


@pytest.mark.parametrize("name", FP8)
def test_fp8_rounding_near_every_boundary_matches_torch(name, restore_isa):
    """Rows whose amax is FP8_MAX have scale 1, so x / scale is x: every float32 within 300 ulps
    of every fp8 value and every rounding boundary between two (ties to even), both signs,
    subnormals included, rounds as torch's cast does."""
    grid = _fp8_grid(name).view(torch.int32)
    near = (grid[:, None] + torch.arange(-300, 301, dtype=torch.int32)[None, :]).reshape(-1)
    near = near[near >= 0].view(torch.float32)
    near = near[near <= FP8_MAX[name]]
    vals = torch.cat([near, -near])
    d = 64
    pad = -vals.numel() % (d - 1)
    vals = torch.cat([vals, torch.zeros(pad)]).reshape(-1, d - 1)
    x = torch.cat([torch.full((vals.shape[0], 1), FP8_MAX[name]), vals], 1).reshape(-1, 1, d)
    q, s = ref_quantize(x, name)
    assert torch.equal(s.float(), torch.ones_like(s.float()))  # the premise: scale 1
    _check_quantize(x, name)


@pytest.mark.parametrize("name", FP8)
def test_an_fp8_row_with_a_nan_is_all_nan_wherever_the_nan_is(name, restore_isa):
    """A NaN anywhere in a row makes its amax and so its scale NaN, as in the reference (torch's
    amax): every code of the row is NaN. The kernel's amax used to drop the NaN unless it sat in
    the last 8 values, so a row kept a finite scale and one NaN code, or not, by the NaN's place."""
    x = torch.linspace(-3, 3, 64).repeat(64, 1)
    x[torch.arange(64), torch.arange(64)] = torch.tensor([float("nan"), -float("nan")]).repeat(32)
    x = x.view(64, 1, 64)
    want_q, want_s = ref_quantize(x, name)
    assert torch.isnan(want_s.float()).all()
    for isa in ISAS:
        ck.set_isa(isa)
        q, s = ck.kv_quantize(x, name)
        assert torch.isnan(s.float()).all(), (isa, torch.isnan(s.float()).flatten().tolist())
        assert _same_bits(q, want_q), isa


@pytest.mark.parametrize("name", DTYPES)
def test_no_rows_quantize_to_empty_tensors(name):
    """No tokens (or no heads): empty q and scales in the dtype's shapes. An fp8 call used to fail
    with 'bad kv_dtype, shape or scale buffer' (the empty scale tensor's address is 0)."""
    for shape in ((0, 3, 16), (2, 0, 16)):
        q, scale = ck.kv_quantize(torch.empty(shape), name)
        assert q.shape == shape and q.dtype == STORAGE[name]
        if name in FP8:
            assert scale.shape == shape[:2] and scale.dtype == torch.bfloat16
        else:
            assert scale is None


@pytest.mark.parametrize("name", DTYPES)
def test_random_rows_round_as_the_reference(name, restore_isa):
    """Millions of values: rows at magnitudes from 1e-30 to 1e30 (subnormal float32 too), rows
    with a few large outliers, all-zero rows: the same q and scale bits as the reference, and
    no fp8 NaN code from finite input, also for rows whose amax is so small that amax / FP8_MAX
    underflows to 0 (their scale is 1, as a zero row's)."""
    g = torch.Generator().manual_seed(11)
    rows, d = 8192, 128
    x = torch.randn(rows, 3, d, generator=g)
    mag = 10.0 ** torch.empty(rows, 3, 1).uniform_(-30, 30, generator=g)
    x = x * mag
    x[::13] *= torch.rand(x[::13].shape, generator=g) ** 12  # many values far below the row's max
    x[5::17, :, :3] *= 1e4  # outliers
    x[7::101] = 0.0
    x[9::211] = torch.randn(x[9::211].shape, generator=g) * 1e-39  # float32 subnormals
    x[11::307] = torch.randn(x[11::307].shape, generator=g).sign() * 1e-45  # amax / FP8_MAX underflows
    _check_quantize(x, name)
    if name in FP8:
        q, _ = ck.kv_quantize(x, name)
        assert not torch.isnan(q.float()).any()


def test_bf16_and_fp16_ties_and_extremes_match_torch(restore_isa):
    """Float32 values exactly at, and one ulp beside, every bfloat16 tie (random upper bits), and
    near every float16 rounding boundary, overflow (65520) and subnormals: torch's bits."""
    g = torch.Generator().manual_seed(3)
    hi = torch.randint(0, 1 << 15, (200_000,), generator=g, dtype=torch.int32) << 16
    hi = hi[(hi >> 23) & 0xFF != 0xFF]  # finite
    low = torch.tensor([0x7FFF, 0x8000, 0x8001, 0x0000, 0xFFFF], dtype=torch.int32)
    bits = (hi[:, None] | low[None, :]).reshape(-1)
    x = torch.cat([bits.view(torch.float32), -bits.view(torch.float32)])
    _check_quantize(x[: x.numel() // 64 * 64].reshape(-1, 2, 32), "bfloat16")
    halves = torch.arange(0, 0x7C00, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    mids = torch.cat([(halves[1:].double() + halves[:-1].double()) / 2, torch.tensor([65504.0 + 16.0])]).float()
    grid = torch.cat([halves, mids]).view(torch.int32)
    near = (grid[:, None] + torch.arange(-2, 3, dtype=torch.int32)[None, :]).reshape(-1)
    near = near[near >= 0].view(torch.float32)
    x = torch.cat([near, -near])
    x = torch.cat([x, torch.zeros(-x.numel() % 64)]).reshape(-1, 1, 64)
    _check_quantize(x, "float16")


@pytest.mark.parametrize("name", DTYPES)
def test_every_stored_code_reads_back_exactly(name, restore_isa):
    """paged_attention over one position gives that position's V row times weight 1: the exact
    value of every stored code (fp8: times its scale), so the widening (bf16 shift, F16C, the fp8
    byte tricks with the e4m3 factor 2^8 folded into the scale, subnormals too) is exact."""
    esize = STORAGE[name].itemsize
    n_codes = 1 << (8 * esize) if esize < 4 else 4096
    g = torch.Generator().manual_seed(5)
    if esize == 4:
        v = torch.randn(n_codes, generator=g) * 10.0 ** torch.empty(n_codes).uniform_(-20, 20, generator=g)
    else:
        codes = torch.arange(n_codes, dtype=torch.int32).to(torch.int16 if esize == 2 else torch.uint8)
        v = codes.view(STORAGE[name])
        v = torch.where(torch.isfinite(v.float()), v.float(), torch.zeros(()))
        if name == "fp8_e4m3":
            v = torch.where(v.abs() > 448, torch.zeros(()), v)
        v = v.to(STORAGE[name])
    d = 64
    rows = v.reshape(-1, 1, d)
    n = rows.shape[0]
    k = torch.zeros(n, 1, d, dtype=STORAGE[name])
    scales = {}
    if name in FP8:
        s = (2.0 ** torch.randint(-10, 10, (n, 1), generator=g)) * torch.tensor([1.0, 1.5, 1.75, 1.25]).repeat(n)[
            :n, None
        ]
        scales = dict(k_scale=torch.ones(n, 1, dtype=torch.bfloat16), v_scale=s.to(torch.bfloat16))
    want = rows.float() * (scales["v_scale"].float()[..., None] if scales else 1.0)
    meta = torch.stack(
        [torch.arange(n), torch.ones(n, dtype=torch.int64), torch.arange(n), torch.ones(n, dtype=torch.int64)]
    )
    q = torch.randn(n, 2, d, generator=g)
    for isa in ISAS:
        ck.set_isa(isa)
        out = torch.full_like(q, float("nan"))
        ck.paged_attention(
            q,
            out,
            meta.to(torch.int32).contiguous(),
            torch.arange(n, dtype=torch.int32),
            1,
            k,
            rows.contiguous(),
            0.1,
            **scales,
        )
        assert torch.equal(out, want.expand(n, 2, d)), isa


def _attention_case(name: str, page_size: int, seed: int, hq: int = 6, hkv: int = 2, d: int = 32):
    """A pool of ``name`` written by kv_quantize, its pages shuffled, and requests of mixed query
    and KV lengths (decodes, extends, one long)."""
    g = torch.Generator().manual_seed(seed)
    lens = [(1, 700), (5, 37), (16, 300), (1, 9), (3, 3), (1, 1)]
    num_pages = sum((kl + page_size - 1) // page_size for _, kl in lens) + 3
    slots = num_pages * page_size
    kx, vx = (torch.randn(slots, hkv, d, generator=g) * 3 for _ in range(2))
    kq, ks = ck.kv_quantize(kx, name)
    vq, vs = ck.kv_quantize(vx, name)
    perm = torch.randperm(num_pages, generator=g)
    meta, idx, qs, kvs = [], [], 0, 0
    for ql, kl in lens:
        np_ = (kl + page_size - 1) // page_size
        meta.append((qs, ql, kvs, kl))
        idx += perm[kvs : kvs + np_].tolist()
        qs, kvs = qs + ql, kvs + np_
    q = torch.randn(qs, hq, d, generator=g)
    scales = dict(k_scale=ks, v_scale=vs) if ks is not None else {}
    case = dict(
        req_meta=torch.tensor(meta, dtype=torch.int32).T.contiguous(), kv_indices=torch.tensor(idx, dtype=torch.int32)
    )
    return q, kq, vq, scales, case, lens


def _reference_attention(q, k, v, req_meta, kv_indices, page_size, sm_scale):
    """Causal (bottom-right) paged attention in float64 over float32 K/V rows ``[slots, Hkv, D]``."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    g = q.shape[1] // k.shape[1]
    for qs, ql, ks, kl in req_meta.T.tolist():
        pos = torch.arange(kl)
        slot = kv_indices[ks + pos // page_size].long() * page_size + pos % page_size
        kr = k[slot].double().repeat_interleave(g, 1)  # [kl, Hq, D]
        vr = v[slot].double().repeat_interleave(g, 1)
        for j in range(ql):
            n = kl - ql + j + 1
            s = torch.einsum("hd,phd->hp", q[qs + j].double(), kr[:n]) * sm_scale
            out[qs + j] = torch.einsum("hp,phd->hd", torch.softmax(s, -1), vr[:n])
    return out


@pytest.mark.parametrize("name", DTYPES)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("hq, hkv, d", [(6, 2, 32), (8, 2, 24), (2, 2, 40), (5, 1, 8)])
def test_paged_attention_matches_float64_over_the_rounded_pool(name, page_size, hq, hkv, d, restore_isa):
    """Every dtype, page size, query heads per KV head (1, 3, 4, 5: blocks of 3 heads and their
    remainders) and head_dim (8, 24, 32, 40: whole 16-float groups and a last 8): within float32
    rounding of float64 attention over the pool's values, the same bits on both ISA paths."""
    q, kq, vq, scales, case, _ = _attention_case(name, page_size, page_size + d, hq, hkv, d)
    kf = ref_round(kq.float(), "float32") if not scales else kq.float() * scales["k_scale"].float()[..., None]
    vf = vq.float() if not scales else vq.float() * scales["v_scale"].float()[..., None]
    want = _reference_attention(q, kf, vf, case["req_meta"], case["kv_indices"], page_size, 0.17)
    got = {}
    for isa in ISAS:
        ck.set_isa(isa)
        out = torch.empty_like(q)
        ck.paged_attention(q, out, case["req_meta"], case["kv_indices"], page_size, kq, vq, 0.17, **scales)
        got[isa] = out
    torch.testing.assert_close(got["avx2"].double(), want, atol=2e-5, rtol=1e-5)
    assert torch.equal(got[ISAS[0]], got[ISAS[-1]])


def test_bad_dtypes_and_scales_are_refused():
    x = torch.randn(2, 1, 8)
    with pytest.raises(
        ValueError, match=r"kv_cache_dtype must be one of \['float32', 'bfloat16', 'float16', 'fp8_e4m3', 'fp8_e5m2'\]"
    ):
        ck.kv_quantize(x, "fp4")
    with pytest.raises(ValueError, match="head_dim must be a positive multiple of 8"):
        ck.kv_quantize(torch.randn(2, 1, 12), "bfloat16")
    q, _, vq, scales, case, _ = _attention_case("fp8_e4m3", 1, seed=0)
    kq = vq.clone()
    out = torch.empty_like(q)
    with pytest.raises(ValueError, match="an fp8_e4m3 pool needs k_scale"):
        ck.paged_attention(q, out, case["req_meta"], case["kv_indices"], 1, kq, vq, 0.1)
    with pytest.raises(ValueError, match="v_scale must be a contiguous bfloat16"):
        ck.paged_attention(
            q, out, case["req_meta"], case["kv_indices"], 1, kq, vq, 0.1, scales["k_scale"], scales["v_scale"].float()
        )
    with pytest.raises(ValueError, match="a bfloat16 pool has no scales"):
        kb = torch.zeros(kq.shape, dtype=torch.bfloat16)
        ck.paged_attention(q, out, case["req_meta"], case["kv_indices"], 1, kb, kb, 0.1, **scales)
    with pytest.raises(ValueError, match="k_cache is torch.bfloat16, v_cache torch.float16"):
        ck.paged_attention(q, out, case["req_meta"], case["kv_indices"], 1, kb, kb.half(), 0.1)
    with pytest.raises(ValueError, match="kv_cache_dtype: the kernels read"):
        ck.kv_dtype_name(torch.int8)


# ------------------------------------------------------------------ the fused decode step


def _tiny_d24():
    """A tiny Llama with head_dim 24 (a 16-float group and a last 8) and 4 query heads per KV head."""
    cfg = LlamaConfig(
        vocab_size=97,
        hidden_size=96,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    cfg.architectures = ["LlamaForCausalLM"]
    return cfg, build_model(cfg, seed=2).eval()


def _runner(model, cfg, pool, fused=True):
    r = ModelRunner(model, cfg, kv_pool=pool, max_running_requests=4, max_context_len=1024, attention_backend="cpu")
    assert (r.decode_step is not None) or not fused
    if not fused:
        r.decode_step = None  # the module path: the backend's write, then paged_attention
    return r


def _pool(cfg, name, page_size=1, rounded=False):
    args = (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads, 4096, page_size)
    return RoundedF32Pool(*args, name) if rounded else make_pool(*args, name)


def _generate(runner, prompt, steps, chunk=16):
    """The prompt in extends of ``chunk`` tokens (the fused step's sizes), then ``steps`` greedy
    decodes; returns the logits of every decode input and the token row's slots."""
    reqs = PagedRequests(runner, seed=3)
    for i in range(0, len(prompt), chunk):
        (lg,) = reqs.forward([("a", prompt[i : i + chunk])])
    out, seq = [lg], list(prompt)
    for _ in range(steps):
        seq.append(int(out[-1].argmax()))
        (lg,) = reqs.forward([("a", [seq[-1]])])
        out.append(lg)
    row = reqs.rows["a"]
    slots = runner.req_to_token_pool.req_to_token[row, : len(seq)].long()
    return torch.cat(out), slots


@pytest.mark.parametrize("name", DTYPES)
def test_fused_step_writes_the_dtype_rounding(name, restore_isa):
    """The fused step's K/V write is the contract's rounding: layer 0's new rows (whose inputs do
    not depend on the pool) read back as the reference rounding of the float32 pool's rows, on
    both ISA paths."""
    cfg, model = _tiny()
    prompt = list(range(5, 45))
    f32 = _runner(model, cfg, _pool(cfg, "float32"))
    _, slots32 = _generate(f32, prompt, 3)
    k32, v32 = pool_rows(f32.kv_pool, 0, slots32)
    for isa in ISAS:
        ck.set_isa(isa)
        r = _runner(model, cfg, _pool(cfg, name))
        _, slots = _generate(r, prompt, 3)
        k, v = pool_rows(r.kv_pool, 0, slots)
        assert torch.equal(k, ref_round(k32, name)) and torch.equal(v, ref_round(v32, name)), isa


@pytest.mark.parametrize("name", DTYPES)
@pytest.mark.parametrize("page_size, shape", [(1, "d16"), (16, "d16"), (4, "d24")])
def test_fused_step_matches_the_float32_module_path_over_rounded_kv(name, page_size, shape, restore_isa):
    """Prompt of 600 tokens (the fused step's 16-token extends), then decodes over 3 attention
    chunks: the logits equal, within float32 rounding, those of the module path over a float32
    pool holding the same rounded K/V (the reference), and the AVX2 and AVX-512 paths give the
    same bits. head_dim 16 (2 query heads per KV head) and 24 (4)."""
    cfg, model = _tiny() if shape == "d16" else _tiny_d24()
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, cfg.vocab_size, (600,), generator=g).tolist()
    ref, _ = _generate(_runner(model, cfg, _pool(cfg, name, page_size, rounded=True), fused=False), prompt, 4)
    got = {}
    for isa in ISAS:
        ck.set_isa(isa)
        got[isa], _ = _generate(_runner(model, cfg, _pool(cfg, name, page_size)), prompt, 4)
    torch.testing.assert_close(got["avx2"], ref, atol=2e-6, rtol=0)
    assert torch.equal(got[ISAS[0]], got[ISAS[-1]])
    if name != "float32":  # the rounding is visible at this tolerance: the check above can fail
        f32, _ = _generate(_runner(model, cfg, _pool(cfg, "float32", page_size)), prompt, 4)
        assert (f32 - ref).abs().max() > 2e-5


@pytest.mark.parametrize("name", ["bfloat16", "fp8_e4m3"])
def test_fused_step_equals_the_module_path_in_the_pool_dtype(name):
    """The module path (the backend's write, paged_attention) and the fused step over pools of
    the same dtype give the same greedy tokens and logits within float32 rounding."""
    cfg, model = _tiny()
    prompt = list(range(3, 90))
    a, _ = _generate(_runner(model, cfg, _pool(cfg, name), fused=False), prompt, 6)
    b, _ = _generate(_runner(model, cfg, _pool(cfg, name)), prompt, 6)
    torch.testing.assert_close(a, b, atol=2e-6, rtol=0)
    assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.parametrize("name", DTYPES)
@pytest.mark.parametrize("extend", [3, 40])
def test_cpu_backend_writes_the_reference_rounding(name, extend):
    """The cpu backend's write (the native quantizer through the pool's ``write`` when it takes
    one) stores the contract's bits, for a batch the native kernel serves (3 new tokens) and one it
    leaves to the torch backend's attention (40: that attention is the torch backend's, tested
    with it); the native kernel attends over the stored values: the float64 reference over the
    rounded pool."""
    from radixkv.attention.cpu_backend import CPUAttentionBackend
    from radixkv.attention.metadata import ForwardBatch

    g = torch.Generator().manual_seed(extend)
    hq, hkv, d, prefix = 4, 2, 32, 7
    pool = make_pool(1, hkv, d, 64, 1, name)
    r2t = torch.arange(64, dtype=torch.int32).flip(0).reshape(1, 64).contiguous()  # slots in reverse
    backend = CPUAttentionBackend(pool, hq)
    old_k, old_v = (torch.randn(prefix, hkv, d, generator=g) for _ in range(2))
    pool.write(0, r2t[0, :prefix].long(), old_k, old_v)
    batch = ForwardBatch.build(list(range(extend)), [0], [prefix], [extend], r2t, 1)
    backend.plan(batch)
    q, k, v = (
        torch.randn(extend, hq, d, generator=g),
        torch.randn(extend, hkv, d, generator=g) * 5,
        torch.randn(extend, hkv, d, generator=g),
    )
    out = backend.forward(0, q, k, v)
    slots = r2t[0, : prefix + extend].long()
    got_k, got_v = pool_rows(pool, 0, slots[prefix:])
    assert torch.equal(got_k, ref_round(k, name)) and torch.equal(got_v, ref_round(v, name))
    if extend > backend.native_max_q:
        return
    kf, vf = pool_rows(pool, 0, slots)
    meta = torch.tensor([[0], [extend], [0], [prefix + extend]], dtype=torch.int32)
    want = _reference_attention(q, kf, vf, meta, torch.arange(prefix + extend, dtype=torch.int32), 1, backend.sm_scale)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=1e-5)
