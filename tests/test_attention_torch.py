"""ForwardBatch metadata (FlashInfer format) and the torch attention backend vs a naive reference."""

from __future__ import annotations

import math
import random

import pytest
import torch

from radixkv.attention import CPUAttentionBackend, TorchAttentionBackend, create_attention_backend
from radixkv.attention.metadata import ForwardBatch
from radixkv.kernels import cpu as cpu_kernels
from radixkv.memory.kv_pool import KVPool, ReqToTokenPool

pytestmark = pytest.mark.timeout(120)


def test_build_metadata_by_hand():
    r2t = torch.zeros(4, 64, dtype=torch.int32)
    r2t[1, :8] = torch.tensor([12, 13, 14, 15, 28, 29, 30, 31])  # pages 3, 7
    r2t[2, :4] = torch.tensor([20, 21, 22, 23])  # page 5
    b = ForwardBatch.build([11, 12, 13, 14], [1, 2], [3, 0], [3, 1], r2t, page_size=4)
    assert b.positions.tolist() == [3, 4, 5, 0]
    assert b.out_slots.tolist() == [15, 28, 29, 20]
    assert b.qo_indptr.tolist() == [0, 3, 4] and b.qo_indptr.dtype == torch.int32
    assert b.kv_indptr.tolist() == [0, 2, 3]
    assert b.kv_indices.tolist() == [3, 7, 5] and b.kv_indices.dtype == torch.int32
    assert b.kv_last_page_len.tolist() == [2, 1]
    assert b.logits_indices.tolist() == [2, 3]
    assert b.kv_indptr_cpu.device.type == "cpu" and b.qo_indptr_cpu.tolist() == [0, 3, 4]
    assert (b.batch_size, b.num_tokens, b.max_extend_len, b.max_seq_len) == (2, 4, 3, 6)
    assert not b.is_decode
    r2t_next = torch.cat([r2t[:, :8], torch.full((4, 8), 40, dtype=torch.int32)], 1)  # position 8 -> slot 40
    d = ForwardBatch.build([5], [1], [8], [1], r2t_next, 4)
    assert d.is_decode and d.kv_indices.tolist() == [3, 7, 10] and d.kv_last_page_len.tolist() == [1]


@pytest.mark.parametrize(
    "kwargs, msg",
    [
        (dict(input_ids=[1], req_rows=[], prefix_lens=[], extend_lens=[]), "no requests"),
        (dict(input_ids=[1, 2], req_rows=[0], prefix_lens=[0], extend_lens=[1]), "sum\\(extend_lens\\)"),
        (dict(input_ids=[], req_rows=[0], prefix_lens=[0], extend_lens=[0]), "extend_len must be >= 1"),
        (dict(input_ids=[1], req_rows=[0], prefix_lens=[-1], extend_lens=[1]), "prefix_len must be >= 0"),
        (dict(input_ids=[1], req_rows=[0], prefix_lens=[16], extend_lens=[1]), "max_context_len 16"),
        (dict(input_ids=[1], req_rows=[5], prefix_lens=[0], extend_lens=[1]), "req_rows must be in"),
        (dict(input_ids=[1], req_rows=[0, 1], prefix_lens=[0], extend_lens=[1]), "same length"),
        (dict(input_ids=[1], req_rows=[0], prefix_lens=[0], extend_lens=[1], logits_indices=[1]), "logits_indices"),
    ],
)
def test_build_rejects_bad_input(kwargs, msg):
    r2t = torch.arange(32, dtype=torch.int32).view(2, 16)
    with pytest.raises(ValueError, match=msg):
        ForwardBatch.build(req_to_token=r2t, page_size=1, **kwargs)


def test_build_rejects_unaligned_pages():
    r2t = torch.zeros(1, 8, dtype=torch.int32)
    r2t[0, :3] = torch.tensor([4, 6, 5])  # position 1 not at offset 1 of page 1
    with pytest.raises(ValueError, match="not aligned to page_size 4"):
        ForwardBatch.build([1, 2, 3], [0], [0], [3], r2t, 4)


def _naive(q, pool, layer, r2t, rows, prefix, extend, scale):
    """Per request, per head softmax(q k^T) v in float64 over req_to_token (not the page table)."""
    out = torch.zeros_like(q, dtype=torch.float64)
    hq, hkv = q.shape[1], pool.num_kv_heads
    k_all, v_all = pool.k_slots(layer).double(), pool.v_slots(layer).double()
    off = 0
    for row, p, e in zip(rows, prefix, extend):
        slots = r2t[row, : p + e].long()
        k, v = k_all[slots], v_all[slots]
        for j in range(e):
            for h in range(hq):
                kh = h // (hq // hkv)
                s = (k[: p + j + 1, kh] @ q[off + j, h].double()) * scale
                out[off + j, h] = torch.softmax(s, 0) @ v[: p + j + 1, kh]
        off += e
    return out


def _scenario(seed, page_size, hq, hkv, head_dim=8):
    rng = random.Random(seed)
    kinds = ["fresh", "extend", "decode", "decode", "extend", "fresh"]
    rng.shuffle(kinds)
    prefix, extend = [], []
    for kind in kinds:
        if kind == "fresh":
            prefix.append(0), extend.append(rng.randint(1, 23))
        elif kind == "extend":
            prefix.append(rng.randint(1, 30)), extend.append(rng.randint(2, 17))
        else:
            prefix.append(rng.randint(1, 40)), extend.append(1)
    num_pages = 512 // page_size
    pool = KVPool(2, hkv, head_dim, num_pages * page_size, page_size)
    r2t_pool = ReqToTokenPool(8, 64)
    pages = list(range(num_pages))
    rng.shuffle(pages)
    rows = []
    for p, e in zip(prefix, extend):
        row = r2t_pool.alloc()
        rows.append(row)
        n = -(-(p + e) // page_size)
        mine = [pages.pop() for _ in range(n)]
        slots = torch.tensor([mine[i // page_size] * page_size + i % page_size for i in range(p + e)])
        r2t_pool.write(row, 0, slots)
    g = torch.Generator().manual_seed(seed)
    for layer in range(2):  # earlier tokens' K/V already in the pool
        pool.k_buffer[layer].copy_(torch.randn(pool.k_buffer[layer].shape, generator=g))
        pool.v_buffer[layer].copy_(torch.randn(pool.v_buffer[layer].shape, generator=g))
    t = sum(extend)
    q = torch.randn(t, hq, head_dim, generator=g)
    k = torch.randn(t, hkv, head_dim, generator=g)
    v = torch.randn(t, hkv, head_dim, generator=g)
    batch = ForwardBatch.build(list(range(t)), rows, prefix, extend, r2t_pool.req_to_token, page_size)
    return pool, r2t_pool.req_to_token, rows, prefix, extend, batch, q, k, v


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("hq, hkv", [(4, 4), (6, 2), (3, 1)])
@pytest.mark.parametrize("max_pad_waste", [1.0, 100.0])
@pytest.mark.parametrize("seed", [0, 1])
def test_torch_backend_matches_naive(page_size, hq, hkv, max_pad_waste, seed):
    _check_backend_against_naive(
        lambda pool: TorchAttentionBackend(pool, hq, max_pad_waste=max_pad_waste), seed, page_size, hq, hkv
    )


@pytest.mark.skipif(not cpu_kernels.AVAILABLE, reason="native CPU kernels not built or no AVX2/FMA/F16C")
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("hq, hkv", [(4, 4), (6, 2), (3, 1)])
@pytest.mark.parametrize("native_max_q", [1, 8, 64])  # decode only / short extends too / everything
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cpu_backend_matches_naive(page_size, hq, hkv, native_max_q, seed):
    _check_backend_against_naive(
        lambda pool: CPUAttentionBackend(pool, hq, native_max_q=native_max_q), seed, page_size, hq, hkv, head_dim=16
    )


def _check_backend_against_naive(make, seed, page_size, hq, hkv, head_dim=8):
    pool, r2t, rows, prefix, extend, batch, q, k, v = _scenario(seed, page_size, hq, hkv, head_dim)
    backend = make(pool)
    backend.plan(batch)
    layer = 1
    out = backend.forward(layer, q, k, v)
    # the new tokens' K/V were written at out_slots
    assert torch.equal(pool.k_slots(layer)[batch.out_slots], k)
    assert torch.equal(pool.v_slots(layer)[batch.out_slots], v)
    ref = _naive(q, pool, layer, r2t, rows, prefix, extend, 1 / math.sqrt(q.shape[-1]))
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_row_exact_rows_do_not_depend_on_the_other_requests(page_size, seed):
    """On the CPU (``row_exact``) every request attends in its own SDPA call: its rows are the
    same bits in the mixed batch as in a batch of that request alone (a padded group's blocked
    reductions would make them depend on the others' lengths)."""
    pool, r2t, rows, prefix, extend, batch, q, k, v = _scenario(seed, page_size, 6, 2)
    backend = TorchAttentionBackend(pool, 6, max_pad_waste=100.0)  # would pad every extend together
    assert backend.row_exact
    backend.plan(batch)
    mixed = backend.forward(1, q, k, v)
    off = 0
    for row, p, e in zip(rows, prefix, extend):
        alone = ForwardBatch.build(list(range(e)), [row], [p], [e], r2t, page_size)
        backend.plan(alone)
        out = backend.forward(1, q[off : off + e], k[off : off + e], v[off : off + e])
        assert torch.equal(out, mixed[off : off + e]), (p, e)
        off += e


def test_create_attention_backend_cpu():
    pool = KVPool(1, 2, 8, 16)
    auto = create_attention_backend("auto", "cpu", pool, 4)
    assert type(auto) is (CPUAttentionBackend if cpu_kernels.AVAILABLE else TorchAttentionBackend)
    if cpu_kernels.AVAILABLE:
        assert type(create_attention_backend("cpu", "cpu", pool, 4)) is CPUAttentionBackend
    # the native kernel needs head_dim % 8 == 0: auto falls back, "cpu" refuses
    odd = KVPool(1, 2, 6, 16)
    assert type(create_attention_backend("auto", "cpu", odd, 4)) is TorchAttentionBackend
    with pytest.raises(ValueError, match="CPUAttentionBackend: .*(head_dim 6|_ckernels)"):
        create_attention_backend("cpu", "cpu", odd, 4)
    half = KVPool(1, 2, 8, 16, dtype=torch.bfloat16)  # it reads bfloat16 pools too (issue 35)
    want = CPUAttentionBackend if cpu_kernels.AVAILABLE else TorchAttentionBackend
    assert type(create_attention_backend("auto", "cpu", half, 4)) is want
    assert isinstance(create_attention_backend("torch", "cpu", pool, 4), TorchAttentionBackend)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        create_attention_backend("flashinfer", "cpu", pool, 4)
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        create_attention_backend("triton", "cpu", pool, 4)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        TorchAttentionBackend(pool, 3)


@pytest.mark.skipif(not cpu_kernels.AVAILABLE, reason="native CPU kernels not built or no AVX2/FMA/F16C")
@pytest.mark.parametrize("native_max_q", [1, 64])  # decode rows native, the rest in groups / all native
def test_cpu_backend_returns_the_queries_dtype(native_max_q):
    """A bfloat16 model (``--dtype bfloat16``) hands bfloat16 queries: the output is bfloat16 too
    (the base contract), the attention of the queries' values, so ``o_proj``'s bfloat16 weight
    takes it (a float32 output stopped the engine at the first request)."""
    pool, r2t, rows, prefix, extend, batch, q, k, v = _scenario(0, 1, 4, 2, head_dim=16)
    half = KVPool(2, 2, 16, pool.num_slots, 1, dtype=torch.bfloat16)
    for layer in range(2):
        half.k_buffer[layer].copy_(pool.k_buffer[layer])
        half.v_buffer[layer].copy_(pool.v_buffer[layer])
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    backend = CPUAttentionBackend(half, 4, native_max_q=native_max_q)
    backend.plan(batch)
    out = backend.forward(1, q, k, v)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    ref = _naive(q.float(), half, 1, r2t, rows, prefix, extend, 1 / math.sqrt(16))
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=0)
