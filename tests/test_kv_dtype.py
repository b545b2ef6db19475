"""K/V storage dtypes (issue 35): float32, bfloat16, float16, fp8_e4m3, fp8_e5m2 in the KV pool.

* sizes: bytes per token (scales included) of the default model and the tiny model, the pool's
  capacity and ``kv_cache_bytes`` from ``kv_cache_memory_bytes`` (and the default memory), the
  memory-string parser;
* the rounding: a K/V row written through the torch path and read back equals the dtype's
  rounding, computed here by an independent numpy implementation of the contract
  (docs/model.md); attention reads those rounded values on every group shape;
* the engine in each dtype (tiny random Llama): greedy output deterministic and equal to the
  native ``cpu`` backend's (skipped only while that backend refuses the dtype), cached-prefix
  reuse after a split and an eviction with exact cached-token counts and continuations equal to
  a fresh run in the same dtype;
* reporting (``cache_stats``, ``/cache_stats``, ``/metrics``, replicas' sums, ``radixkv plan``),
  the CLI flags, the simulator sized in bytes, and the ValueErrors.
"""

from __future__ import annotations

import math
import random
import sys

import httpx
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from model_helpers import tiny_loaded_model
from prometheus_client.parser import text_string_to_metric_families

from radixkv import LLM, SamplingParams
from radixkv.attention import CPUAttentionBackend, TorchAttentionBackend, create_attention_backend
from radixkv.attention.metadata import ForwardBatch
from radixkv.config import EngineConfig, parse_memory_bytes
from radixkv.memory.kv_dtype import KV_DTYPES
from radixkv.memory.kv_pool import KVPool, ReqToTokenPool

pytestmark = pytest.mark.timeout(600)

SPELLINGS = {
    "float32": ("float32", "fp32", torch.float32),
    "bfloat16": ("bfloat16", "bf16", "BF16", torch.bfloat16),
    "float16": ("float16", "fp16", "half", torch.float16),
    "fp8_e4m3": ("fp8_e4m3", "fp8", torch.float8_e4m3fn),
    "fp8_e5m2": ("fp8_e5m2", torch.float8_e5m2),
}
DEFAULT_MODEL_BPT = {"float32": 46080, "bfloat16": 23040, "float16": 23040, "fp8_e4m3": 11880, "fp8_e5m2": 11880}
TINY_BPT = {"float32": 512, "bfloat16": 256, "float16": 256, "fp8_e4m3": 144, "fp8_e5m2": 144}  # 2 layers, 2x16


@pytest.fixture(scope="module")
def tiny():
    return tiny_loaded_model(seed=0)


# ------------------------------------------------------------------------------------- sizes


@pytest.mark.parametrize("kv", KV_DTYPES)
def test_bytes_per_token_and_default_capacity_of_the_default_model(kv):
    """SmolLM2-135M (30 layers, 3 KV heads of 64): 46,080 / 23,040 / 11,880 bytes per token (fp8:
    11,520 + 2 x 30 x 3 x 2 bytes of scales, 25.8% of float32); with neither size given the CPU
    pool takes the bytes of 32,768 float32 tokens, so the smaller dtypes hold more tokens."""
    for spelling in SPELLINGS[kv]:
        assert KVPool.token_bytes(30, 3, 64, spelling) == DEFAULT_MODEL_BPT[kv]
    bpt = DEFAULT_MODEL_BPT[kv]
    if kv.startswith("fp8"):
        assert bpt <= 0.26 * 46080
    else:
        assert bpt * (1 if kv == "float32" else 2) == 46080
    cfg = EngineConfig(device="cpu", kv_cache_dtype=SPELLINGS[kv][-1]).resolve()
    assert cfg.kv_cache_dtype == kv
    cfg.resolve(kv_bytes_per_token=bpt, float32_kv_bytes_per_token=46080)
    assert cfg.max_total_tokens == {"float32": 32768, "bfloat16": 65536, "float16": 65536}.get(kv, 127100)
    assert cfg.max_total_tokens == 32768 * 46080 // bpt
    sized = EngineConfig(device="cpu", kv_cache_dtype=kv, kv_cache_memory_bytes="1GiB", page_size=16).resolve(
        kv_bytes_per_token=bpt, float32_kv_bytes_per_token=46080
    )
    assert sized.kv_cache_memory_bytes == 2**30
    assert sized.max_total_tokens == (2**30 // bpt) // 16 * 16
    assert sized.resolve(kv_bytes_per_token=bpt).max_total_tokens == sized.max_total_tokens  # idempotent


def test_auto_is_the_compute_dtype():
    assert EngineConfig(device="cpu").resolve().kv_cache_dtype == "float32"
    assert EngineConfig(device="cpu", dtype="bf16").resolve().kv_cache_dtype == "bfloat16"
    assert EngineConfig(device="cpu", dtype=torch.float16, kv_cache_dtype="auto").resolve().kv_cache_dtype == "float16"
    assert EngineConfig(device="cpu", dtype="bf16", kv_cache_dtype="fp8").resolve().kv_cache_dtype == "fp8_e4m3"


@pytest.mark.parametrize("kv", KV_DTYPES)
@pytest.mark.parametrize("page_size", [1, 16])
def test_engine_capacity_and_kv_cache_bytes_from_memory(tiny, kv, page_size):
    """tokens = bytes // bytes_per_token in whole pages; ``kv_cache_bytes`` is what the pool's
    tensors (scales included) really take."""
    memory = 100 * 1024 + 77
    llm = LLM(loaded_model=tiny, device="cpu", kv_cache_dtype=kv, kv_cache_memory_bytes="100KiB", page_size=page_size)
    s = llm.cache_stats()
    bpt = TINY_BPT[kv]
    want = (100 * 1024 // bpt) // page_size * page_size
    assert (s["kv_cache_dtype"], s["kv_bytes_per_token"], s["capacity"]) == (kv, bpt, want)
    assert s["kv_cache_bytes"] == want * bpt
    pool = llm.engine.runner.kv_pool
    tensors = pool.k_buffer + pool.v_buffer + (pool.k_scale or []) + (pool.v_scale or [])
    assert sum(t.numel() * t.element_size() for t in tensors) == s["kv_cache_bytes"]
    assert pool.k_buffer[0].dtype == SPELLINGS[kv][-1] and (pool.k_scale is not None) == kv.startswith("fp8")
    from radixkv.engine import Engine

    again = Engine(llm.engine.config, loaded_model=tiny)  # a resolved config (tokens filled in) reused
    assert again.cache_stats()["capacity"] == want and again.config.kv_cache_memory_bytes == 100 * 1024
    odd = LLM(loaded_model=tiny, device="cpu", kv_cache_dtype=kv, kv_cache_memory_bytes=memory, page_size=page_size)
    assert odd.cache_stats()["capacity"] == (memory // bpt) // page_size * page_size


@pytest.mark.parametrize(
    "text, n",
    [
        (1000, 1000),
        ("1000", 1000),
        ("2GiB", 2 * 2**30),
        ("512MiB", 512 * 2**20),
        ("1.5GB", 1_500_000_000),
        ("1.5 gib", 1_610_612_736),
        (" 4 KB ", 4000),
        ("0.5KiB", 512),
        ("3kib", 3072),
        ("1.9B", 1),
        ("2TB", 2 * 10**12),
        (".5MB", 500_000),
    ],
)
def test_memory_strings(text, n):
    assert parse_memory_bytes(text) == n


@pytest.mark.parametrize("bad", ["", "abc", "2 GiBs", "-1", "1e9", "GiB", "0.1B", "1,000", 0, -5, True, 2.5, None])
def test_memory_strings_refused_naming_the_field(bad):
    with pytest.raises(ValueError, match="kv_cache_memory_bytes"):
        parse_memory_bytes(bad)
    if bad is not None:
        with pytest.raises(ValueError, match="kv_cache_memory_bytes"):
            EngineConfig(device="cpu", kv_cache_memory_bytes=bad).resolve()


def test_bad_input_is_a_value_error_naming_the_field(tiny):
    valid = list(KV_DTYPES) + ["fp32", "bf16", "fp16", "half", "fp8"]
    for bad in ("int8", "fp4", "", torch.int8, "float64"):
        with pytest.raises(ValueError, match="kv_cache_dtype") as e:
            EngineConfig(device="cpu", kv_cache_dtype=bad).resolve()
        assert all(repr(v) in str(e.value) for v in valid + ["auto"])
        with pytest.raises(ValueError, match="kv_cache_dtype"):
            KVPool(1, 1, 8, 8, dtype=bad)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        KVPool(1, 1, 8, 8, dtype="auto")  # the pool needs a concrete dtype
    with pytest.raises(ValueError, match="kv_cache_memory_bytes.*max_total_tokens"):
        EngineConfig(device="cpu", kv_cache_memory_bytes="1MiB", max_total_tokens=4096).resolve()
    with pytest.raises(ValueError, match="kv_cache_memory_bytes.*max_total_tokens"):
        LLM(loaded_model=tiny, device="cpu", kv_cache_memory_bytes=1 << 20, max_total_tokens=4096)
    with pytest.raises(ValueError, match="kv_cache_memory_bytes 2000 holds no page"):
        LLM(loaded_model=tiny, device="cpu", kv_cache_dtype="bf16", kv_cache_memory_bytes=2000, page_size=16)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(loaded_model=tiny, device="cpu", kv_cache_dtype="q8_0")


def test_flashinfer_refuses_other_kv_dtypes_without_importing_flashinfer(monkeypatch):
    from radixkv.attention import flashinfer_backend as fb

    monkeypatch.setattr(fb, "REQUIRE_CUDA", False)
    for kv in ("float32", "fp8_e4m3", "fp8_e5m2"):
        pool = KVPool(1, 2, 16, 16, dtype=kv)
        with pytest.raises(ValueError, match=f"'flashinfer': kv_cache_dtype must be one of .*got '{kv}'"):
            fb.check_kv_cache_dtype(pool)
        with pytest.raises(ValueError, match="flashinfer.*kv_cache_dtype"):
            fb.FlashInferAttentionBackend(pool, 4)
    fb.check_kv_cache_dtype(KVPool(1, 2, 16, 16, dtype="bf16"))  # bfloat16 passes the check
    if not torch.cuda.is_available():
        assert "flashinfer" not in sys.modules


def test_auto_backend_on_the_cpu_by_kv_dtype():
    """``auto`` takes the native backend for the dtypes of ``CPU_AUTO_KV_DTYPES`` (and a pool and
    CPU it supports), the torch reference otherwise; never a silent change of the dtype."""
    from radixkv.attention import CPU_AUTO_KV_DTYPES

    for kv in KV_DTYPES:
        pool = KVPool(1, 2, 16, 16, dtype=kv)
        auto = create_attention_backend("auto", "cpu", pool, 4)
        native = _cpu_backend_refusal(kv) is None and kv in CPU_AUTO_KV_DTYPES
        assert type(auto) is (CPUAttentionBackend if native else TorchAttentionBackend)
        assert auto.kv_pool.kv_cache_dtype == kv


# ------------------------------------------------------------------------------------- rounding


def _fp8_grid(exp_bits: int, man_bits: int, e4m3fn: bool) -> tuple[np.ndarray, np.ndarray]:
    """Every finite non-negative value of an fp8 format from its bit layout, ascending, with its
    code (for round-half-to-even: the even code wins a tie)."""
    bias = 2 ** (exp_bits - 1) - 1
    vals, codes = [], []
    for e in range(2**exp_bits):
        for m in range(2**man_bits):
            if e4m3fn and e == 2**exp_bits - 1 and m == 2**man_bits - 1:
                continue  # e4m3fn's only NaN
            if not e4m3fn and e == 2**exp_bits - 1:
                continue  # e5m2's infinities and NaNs
            frac = m / 2**man_bits
            vals.append(math.ldexp(frac, 1 - bias) if e == 0 else math.ldexp(1 + frac, e - bias))
            codes.append((e << man_bits) | m)
    order = np.argsort(vals)
    return np.array(vals, dtype=np.float64)[order], np.array(codes)[order]


GRIDS = {"fp8_e4m3": _fp8_grid(4, 3, True), "fp8_e5m2": _fp8_grid(5, 2, False)}
FP8_MAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}


def _round_fp8(y: np.ndarray, kv: str) -> np.ndarray:
    """Nearest value of the format, ties to the even code, saturated at the largest."""
    grid, codes = GRIDS[kv]
    a = np.minimum(np.abs(y.astype(np.float64)), grid[-1])
    hi = np.clip(np.searchsorted(grid, a), 1, len(grid) - 1)
    lo = hi - 1
    d_lo, d_hi = a - grid[lo], grid[hi] - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (codes[hi] % 2 == 0))
    return np.copysign(np.where(pick_hi, grid[hi], grid[lo]), y).astype(np.float32)


def contract_rounding(x: np.ndarray, kv: str) -> tuple[np.ndarray, np.ndarray | None]:
    """The contract, written plainly in numpy float32: the values read back and (fp8) the scales."""
    x = x.astype(np.float32)
    if kv == "float32":
        return x, None
    if kv == "float16":
        with np.errstate(over="ignore"):  # beyond 65504: inf, as IEEE (and torch) round it
            return x.astype(np.float16).astype(np.float32), None
    if kv == "bfloat16":
        bits = x.view(np.uint32).astype(np.uint64)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        return bits.astype(np.uint32).view(np.float32), None
    amax = np.abs(x).max(axis=-1)
    ratio = (amax / np.float32(FP8_MAX[kv])).astype(np.float32)
    ceil = ((ratio.view(np.uint32).astype(np.uint64) + 0xFFFF) & 0xFFFF0000).astype(np.uint32).view(np.float32)
    scale = np.where(ratio == 0, np.float32(1), ceil).astype(np.float32)
    q = _round_fp8((x / scale[..., None]).astype(np.float32), kv)
    return (q * scale[..., None]).astype(np.float32), scale


rows_st = st.integers(1, 5).flatmap(
    lambda t: st.sampled_from([8, 16, 64]).flatmap(
        lambda d: (
            arrays(
                np.float32,
                (t, 2, d),
                elements=st.floats(-(2.0**100), 2.0**100, width=32, allow_subnormal=False),
            )
            | arrays(np.float32, (t, 2, d), elements=st.floats(-4.0, 4.0, width=32, allow_subnormal=False))
        )
    )
)


@pytest.mark.parametrize("kv", KV_DTYPES)
@settings(max_examples=150, deadline=None, derandomize=settings.default.derandomize, database=None)
@given(x=rows_st, seed=st.integers(0, 2**16))
def test_a_row_written_and_read_back_is_the_dtypes_rounding(kv, x, seed):
    """Bit for bit: ``KVPool.write`` then ``read`` / ``gather`` give the contract's values (the
    numpy reference above), the stored scales are the reference's, and ``-0.0`` stays ``-0.0``."""
    t, h, d = x.shape
    pool = KVPool(2, h, d, 32, page_size=4, dtype=kv)
    slots = torch.tensor(random.Random(seed).sample(range(32), t))
    k = torch.from_numpy(x.copy())
    v = -k.flip(-1)
    pool.write(1, slots, k, v)
    for src, got in zip((k, v), pool.read(1, slots)):
        want, scale = contract_rounding(src.numpy(), kv)
        assert got.dtype == torch.float32 and np.array_equal(got.numpy().view(np.uint32), want.view(np.uint32))
        if scale is not None:
            stored = (pool.k_scale_slots(1) if src is k else pool.v_scale_slots(1))[slots].float().numpy()
            assert np.array_equal(stored, scale)
    k2, _ = pool.gather(1, slots, torch.float32)
    assert torch.equal(k2.view(torch.int32), pool.read(1, slots)[0].view(torch.int32))
    assert pool.read(0, slots)[0].abs().sum() == 0  # the other layer untouched


@st.composite
def fp8_tie_rows(draw, kv: str) -> np.ndarray:
    """Rows whose largest element is ``FP8_MAX * s`` (``s`` a bfloat16 value, so the scale is
    ``s``, or the next bfloat16 value up when nudged by one ulp) and whose other elements are
    ``s`` times a midpoint between two fp8 values, or one float32 ulp beside it: the division and
    the round-half-to-even tie break decide every element."""
    grid = GRIDS[kv][0]
    s = float(draw(st.integers(128, 255))) / 128 * 2.0 ** draw(st.integers(-60, 60))
    shape = (draw(st.integers(1, 4)), 2, draw(st.sampled_from([8, 16])))
    idx = draw(arrays(np.int64, shape, elements=st.integers(0, len(grid) - 2)))
    x = ((grid[idx] + grid[idx + 1]) / 2 * s).astype(np.float32)  # exact: few significant bits
    x[..., 0] = np.float32(FP8_MAX[kv] * s)
    nudge = draw(arrays(np.int8, shape, elements=st.sampled_from([-1, 0, 0, 1])))
    x = np.where(nudge > 0, np.nextafter(x, np.float32(np.inf)), np.where(nudge < 0, np.nextafter(x, np.float32(0)), x))
    return np.where(draw(arrays(np.bool_, shape)), -x, x).astype(np.float32)


@st.composite
def half_tie_rows(draw, low_bits: int) -> np.ndarray:
    """float32 rows whose low ``low_bits`` mantissa bits are half of their range, or one off: the
    ties and near-ties of rounding to bfloat16 (16) and float16 (13)."""
    shape = (draw(st.integers(1, 4)), 2, 8)
    sign = draw(arrays(np.uint32, shape, elements=st.integers(0, 1)))
    exp = draw(arrays(np.uint32, shape, elements=st.integers(90, 160)))
    high = draw(arrays(np.uint32, shape, elements=st.integers(0, 2 ** (23 - low_bits) - 1)))
    low = 2 ** (low_bits - 1) + draw(arrays(np.int64, shape, elements=st.sampled_from([-1, 0, 0, 1])))
    bits = (sign << 31) | (exp << 23) | (high << low_bits) | low.astype(np.uint32)
    return bits.astype(np.uint32).view(np.float32)


TIES = {
    "float32": half_tie_rows(16),
    "bfloat16": half_tie_rows(16),
    "float16": half_tie_rows(13),
    "fp8_e4m3": fp8_tie_rows("fp8_e4m3"),
    "fp8_e5m2": fp8_tie_rows("fp8_e5m2"),
}


@pytest.mark.parametrize("kv", KV_DTYPES)
@settings(max_examples=100, deadline=None, derandomize=settings.default.derandomize, database=None)
@given(data=st.data())
def test_ties_and_scales_round_as_the_contract(kv, data):
    """The cases random floats almost never hit: exact ties (half to even), one ulp beside them,
    and an amax one ulp above an exact bfloat16 scale (the scale rounds up). A reciprocal multiply
    instead of the division, or a scale rounded to nearest, fails here."""
    x = data.draw(TIES[kv])
    pool = KVPool(1, 2, x.shape[-1], 8, dtype=kv)
    slots = torch.arange(x.shape[0])
    pool.write(0, slots, torch.from_numpy(x), torch.from_numpy(x))
    want, scale = contract_rounding(x, kv)
    assert np.array_equal(pool.read(0, slots)[0].numpy().view(np.uint32), want.view(np.uint32))
    if scale is not None:
        assert np.array_equal(pool.k_scale_slots(0)[slots].float().numpy(), scale)


def test_rounding_edge_cases():
    """A zero row (scale 1), a row whose amax lands exactly on a bfloat16 scale, ties of the
    rounding, and values at the formats' limits."""
    for kv in ("fp8_e4m3", "fp8_e5m2"):
        mx = FP8_MAX[kv]
        rows = np.array(
            [
                [0.0] * 8,
                [-0.0, 1.0, -1.0, 0.5, 0.25, 0.0, 2.0, -3.0],
                [mx, -mx, 1.0, 0.0, 7.0, 9.0, 17.0, 33.0],
                [1.0625, 1.1875, -1.0625, 3.0, 5.0, 6.5, 13.0, 448.0],
                [1e-30, 2e-30, 3e-30, 0.0, -1e-30, 0.0, 0.0, 5e-31],
                [1e-45, -1e-45, 0.0, 1e-45, 0.0, 0.0, 0.0, 0.0],  # amax / FP8_MAX underflows to 0
            ],
            dtype=np.float32,
        )[:, None, :]
        pool = KVPool(1, 1, 8, 8, dtype=kv)
        slots = torch.arange(len(rows))
        pool.write(0, slots, torch.from_numpy(rows), torch.from_numpy(rows))
        want, scale = contract_rounding(rows, kv)
        got = pool.read(0, slots)[0].numpy()
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), kv
        assert pool.k_scale_slots(0)[slots, 0].float().tolist() == scale[:, 0].tolist()
        assert scale[0, 0] == 1.0 and scale[-1, 0] == 1.0 and not np.isnan(got).any()


def _paged(pool: KVPool, prefix: list[int], extend: list[int], seed: int):
    """A batch of requests with shuffled pages; the prefixes' K/V already written into ``pool``."""
    rng = random.Random(seed)
    ps = pool.page_size
    r2t = ReqToTokenPool(len(prefix), 128)
    pages = list(range(pool.num_pages))
    rng.shuffle(pages)
    rows = []
    g = torch.Generator().manual_seed(seed)
    for p, e in zip(prefix, extend):
        row = r2t.alloc()
        rows.append(row)
        mine = [pages.pop() for _ in range(-(-(p + e) // ps))]
        slots = torch.tensor([mine[i // ps] * ps + i % ps for i in range(p + e)])
        r2t.write(row, 0, slots)
        for layer in range(pool.num_layers):
            kk, vv = (3 * torch.randn(p, pool.num_kv_heads, pool.head_dim, generator=g) for _ in range(2))
            pool.write(layer, slots[:p], kk, vv)
    batch = ForwardBatch.build(list(range(sum(extend))), rows, prefix, extend, r2t.req_to_token, ps)
    return batch, r2t.req_to_token, rows


@pytest.mark.parametrize("kv", KV_DTYPES)
@pytest.mark.parametrize("page_size", [1, 4])
def test_torch_attention_reads_the_rounded_values(kv, page_size):
    """Fresh prefills, extends over a cached prefix and decodes in one batch: the new tokens' K/V
    are stored rounded, and the output equals float64 attention over the pool's read-back values
    (the new tokens' own rounded K/V included)."""
    hq, hkv, d = 6, 2, 16
    pool = KVPool(2, hkv, d, 256, page_size, dtype=kv)
    prefix, extend = [0, 9, 20, 13, 0], [7, 5, 1, 1, 1]
    batch, r2t, rows = _paged(pool, prefix, extend, seed=3)
    g = torch.Generator().manual_seed(4)
    t = sum(extend)
    q, k, v = (2 * torch.randn(t, n, d, generator=g) for n in (hq, hkv, hkv))
    backend = TorchAttentionBackend(pool, hq)
    backend.plan(batch)
    out = backend.forward(1, q, k, v)
    got_k, got_v = pool.read(1, batch.out_slots)
    assert np.array_equal(got_k.numpy(), contract_rounding(k.numpy(), kv)[0])
    assert np.array_equal(got_v.numpy(), contract_rounding(v.numpy(), kv)[0])
    ref = torch.zeros(t, hq, d, dtype=torch.float64)
    off = 0
    for row, p, e in zip(rows, prefix, extend):
        kk, vv = (x.double() for x in pool.read(1, r2t[row, : p + e].long()))
        for j in range(e):
            for h in range(hq):
                s = (kk[: p + j + 1, h // (hq // hkv)] @ q[off + j, h].double()) / math.sqrt(d)
                ref[off + j, h] = torch.softmax(s, 0) @ vv[: p + j + 1, h // (hq // hkv)]
        off += e
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=0)


# ------------------------------------------------------------------------------------- the engine


def _cpu_backend_refusal(kv: str) -> str | None:
    """Why the native ``cpu`` backend refuses a pool of ``kv`` (its own check), or None."""
    try:
        CPUAttentionBackend(KVPool(1, 2, 16, 16, dtype=kv), 4)
    except ValueError as exc:
        return str(exc)
    return None


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(100, 49000) for _ in range(length // 2)]
    return [shared + [rng.randrange(100, 49000) for _ in range(length - len(shared) + i)] for i in range(n)]


def _greedy(llm: LLM, prompts, max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]


@pytest.mark.parametrize("kv", KV_DTYPES)
def test_greedy_in_each_dtype_is_deterministic_and_equal_on_torch_and_cpu(tiny, kv):
    """The torch backend's greedy tokens in a dtype are the same on every run and equal the native
    cpu backend's (prefill through SDPA, decode in the native kernels / the fused step). Skipped
    only while the cpu backend refuses the dtype."""
    prompts = _prompts(3, 40, seed=11)

    def make(backend):
        return LLM(loaded_model=tiny, device="cpu", kv_cache_dtype=kv, max_total_tokens=1024, attention_backend=backend)

    torch_llm = make("torch")
    first = _greedy(torch_llm, prompts, 24)
    assert all(len(o) == 24 for o in first)
    assert _greedy(make("torch"), prompts, 24) == first  # a fresh engine
    torch_llm.reset_prefix_cache()
    assert _greedy(torch_llm, prompts, 24) == first
    refusal = _cpu_backend_refusal(kv)
    if refusal is not None:
        pytest.skip(f"the cpu backend refuses {kv}: {refusal}")
    assert _greedy(make("cpu"), prompts, 24) == first


@pytest.mark.parametrize("kv", KV_DTYPES)
def test_cached_prefix_reuse_after_a_split_and_an_eviction(tiny, kv):
    """A 128-token pool (the memory of 128 tokens plus a byte short of one more): A (50 tokens)
    is cached; B shares A's first 30 (the edge splits: 30 cached); C (60 new tokens) finds 58
    free slots and evicts 2 from the tail of the least recently used leaf, A's; B again is all
    cached but its last token (49) and evicts 5 more of A's tail (its last prompt token and 5
    decode tokens need 6 slots, one of them freed by its own duplicate); A again finds 50 - 7 =
    43 tokens. Every continuation equals a fresh cacheless run in the same dtype."""
    bpt = TINY_BPT[kv]
    llm = LLM(loaded_model=tiny, device="cpu", kv_cache_dtype=kv, kv_cache_memory_bytes=128 * bpt + bpt - 1)
    fresh = LLM(loaded_model=tiny, device="cpu", kv_cache_dtype=kv, max_total_tokens=256, prefix_cache="none")
    assert llm.cache_stats()["capacity"] == 128
    rng = random.Random(7)
    a = [rng.randrange(100, 49000) for _ in range(50)]
    b = a[:30] + [rng.randrange(100, 49000) for _ in range(20)]
    c = [rng.randrange(100, 49000) for _ in range(60)]

    def run(prompt, n):
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        out = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
        llm.engine.check_integrity()
        s = llm.cache_stats()
        assert s["free"] + s["evictable"] == s["capacity"] and s["protected"] == 0
        assert list(out.outputs[0].token_ids) == _greedy(fresh, [prompt], n)[0]
        return out.num_cached_tokens, s["evicted_tokens"]

    assert run(a, 1) == (0, 0)
    assert run(b, 1) == (30, 0)
    assert run(c, 1) == (0, 2)
    assert run(b, 6) == (49, 7)
    assert run(a, 6) == (43, 19)


# ------------------------------------------------------------------------------------- reporting


def test_cache_stats_endpoints_and_metrics_report_the_kv_dtype(tiny):
    from server_helpers import Server

    from radixkv.async_llm import AsyncLLM
    from radixkv.engine import Engine
    from radixkv.server.app import create_app

    cfg = EngineConfig(device="cpu", kv_cache_dtype="fp8", kv_cache_memory_bytes="64KiB")
    llm = AsyncLLM(engine=Engine(cfg, loaded_model=tiny))
    server = Server(create_app(llm, served_model_name="tiny"))
    try:
        want = dict(kv_cache_dtype="fp8_e4m3", kv_bytes_per_token=144, kv_cache_bytes=455 * 144, capacity=455)
        assert {k: llm.cache_stats()[k] for k in want} == want
        stats = httpx.get(server.base_url + "/cache_stats", timeout=60).json()
        assert {k: stats[k] for k in want} == want
        text = httpx.get(server.base_url + "/metrics", timeout=60).text
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
        }
        assert samples[("radixkv_kv_bytes_per_token", ())] == 144
        assert samples[("radixkv_kv_cache_bytes", ())] == 455 * 144
        assert samples[("radixkv_kv_cache_dtype", (("kv_cache_dtype", "fp8_e4m3"),))] == 1
        assert [k for k in samples if k[0] == "radixkv_kv_cache_dtype"] == [
            ("radixkv_kv_cache_dtype", (("kv_cache_dtype", "fp8_e4m3"),))
        ]
    finally:
        server.stop()
        llm.shutdown()


def test_replicas_report_the_facts_once_and_sum_the_bytes():
    from radixkv.server.backend import sum_stats

    one = dict(
        capacity=455, free=400, evictable=55, protected=0, pinned=0, cached=55, in_use=0, prompt_tokens=80,
        cached_tokens=20, hit_rate=0.25, prefill_tokens=60, generated_tokens=9, evicted_tokens=0,
        num_retractions=0, running=0, waiting=0, page_size=1, prefix_cache="radix", kv_cache_dtype="fp8_e4m3",
        kv_bytes_per_token=144, kv_cache_bytes=455 * 144,
    )  # fmt: skip
    two = dict(one, free=455, evictable=0, cached=0, prompt_tokens=20, cached_tokens=0)
    s = sum_stats([one, two])
    assert (s.kv_cache_dtype, s.kv_bytes_per_token) == ("fp8_e4m3", 144)  # per-replica facts, not sums
    assert s.capacity == 910 and s.kv_cache_bytes == 910 * 144 == s.capacity * s.kv_bytes_per_token
    assert s.hit_rate == 20 / 100


def test_serve_and_replay_flags(capsys):
    """``radixkv serve --kv-cache-dtype --kv-cache-memory-bytes`` reach the EngineConfig (the
    replicas get the same keywords); ``radixkv replay`` refuses bad values before loading anything."""
    import argparse

    from radixkv.cli import main
    from radixkv.server import cli as server_cli

    p = argparse.ArgumentParser()
    server_cli.add_arguments(p)
    kw = server_cli.engine_kwargs_from_args(
        p.parse_args(["--kv-cache-dtype", "fp8", "--kv-cache-memory-bytes", "2GiB"])
    )
    assert (kw["kv_cache_dtype"], kw["kv_cache_memory_bytes"]) == ("fp8", "2GiB")
    cfg = EngineConfig(**dict(kw, device="cpu")).resolve()
    assert (cfg.kv_cache_dtype, cfg.kv_cache_memory_bytes) == ("fp8_e4m3", 2 * 2**30)
    from radixkv.engine_args import split_engine_kwargs

    for owner in ("LLM", "AsyncLLM"):  # both front ends take every EngineConfig field
        cfg, _ = split_engine_kwargs(owner, "smollm2-135m", {"kv_cache_dtype": "bf16", "kv_cache_memory_bytes": "1GB"})
        assert (cfg.kv_cache_dtype, cfg.kv_cache_memory_bytes) == ("bf16", "1GB")
    default = server_cli.engine_kwargs_from_args(p.parse_args([]))
    assert default["kv_cache_dtype"] == "auto" and "kv_cache_memory_bytes" not in default
    assert main(["replay", "--kv-cache-dtype", "int4", "--device", "cpu"]) == 2
    assert "kv_cache_dtype must be one of" in capsys.readouterr().err
    assert main(["replay", "--kv-cache-memory-bytes", "1GiB", "--max-total-tokens", "4096", "--device", "cpu"]) == 2
    assert "not both" in capsys.readouterr().err


def test_plan_prints_the_engines_bytes_per_token(capsys):
    from radixkv.cli import main
    from radixkv.obs.plan import engine_bytes_per_token, load_spec, plan_memory

    spec = load_spec("smollm2-135m")
    for kv, bpt in DEFAULT_MODEL_BPT.items():
        assert engine_bytes_per_token(spec, kv) == bpt
        assert plan_memory(spec, kv)["engine_kv_bytes_per_token"] == bpt
    assert engine_bytes_per_token(load_spec("deepseek-v3"), "fp8") is None  # MLA: radixkv does not load it
    assert engine_bytes_per_token(load_spec("llama-3-8b"), "fp8") == 32 * 8 * 128 * 2 + 32 * 8 * 2 * 2
    assert main(["plan", "--kv-cache-dtype", "fp8"]) == 0
    out = capsys.readouterr().out
    assert (
        "KV cache per token (fp8): 11,520 bytes" in out
        and "radixkv's own KV pool in fp8: 11,880 bytes per token" in out
    )
    assert main(["plan", "--list", "--kv-dtype", "bf16"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[-4:] == ["bf16", "radixkv", "B/tok", "fp8"]
    smol = next(line for line in table if line.startswith("SmolLM2"))
    assert smol.split()[-2:] == ["23,040", "11,880"]


def test_simulator_capacity_from_bytes():
    """The simulator sized in bytes: the engine's rule (bytes // bytes per token, whole pages), so
    a dtype at half the bytes per token holds twice the slots; no K/V involved."""
    from radixkv.sim import SimRequest, capacity_for_memory, simulate

    rng = random.Random(5)
    reqs = [SimRequest([rng.randrange(50) for _ in range(40)]) for _ in range(30)]
    assert capacity_for_memory("1MiB", TINY_BPT["bfloat16"], 16) == (2**20 // 256) // 16 * 16 == 4096
    for kv in KV_DTYPES:
        by_bytes = simulate(reqs, "radix", 4, kv_cache_memory_bytes=600 * 144, kv_bytes_per_token=TINY_BPT[kv])
        cap = (600 * 144 // TINY_BPT[kv]) // 4 * 4
        by_tokens = simulate(reqs, "radix", 4, cap)
        assert by_bytes.capacity == cap and by_bytes.as_dict() | {"seconds": 0} == by_tokens.as_dict() | {"seconds": 0}
    with pytest.raises(ValueError, match="not both"):
        simulate(reqs, capacity=100, kv_cache_memory_bytes=1000, kv_bytes_per_token=10)
    with pytest.raises(ValueError, match="kv_bytes_per_token"):
        simulate(reqs, kv_cache_memory_bytes=1000)
    with pytest.raises(ValueError, match="holds no page"):
        capacity_for_memory(1000, 144, 16)


def test_the_pool_takes_the_dtype_by_either_name():
    """``KVPool(dtype=...)`` (a torch dtype or a name) and ``KVPool(kv_cache_dtype=...)`` build the
    same pool; float32 when neither is given; two names that disagree are refused."""
    for kv, spellings in SPELLINGS.items():
        for spelling in spellings:
            for pool in (KVPool(2, 2, 16, 8, dtype=spelling), KVPool(2, 2, 16, 8, kv_cache_dtype=spelling)):
                assert (pool.kv_cache_dtype, pool.dtype, pool.bytes_per_token) == (kv, SPELLINGS[kv][-1], TINY_BPT[kv])
    assert KVPool(1, 1, 8, 8).kv_cache_dtype == "float32"
    assert KVPool(1, 1, 8, 8, dtype=torch.bfloat16, kv_cache_dtype="bf16").kv_cache_dtype == "bfloat16"
    with pytest.raises(ValueError, match="disagree"):
        KVPool(1, 1, 8, 8, dtype=torch.float32, kv_cache_dtype="fp8")
