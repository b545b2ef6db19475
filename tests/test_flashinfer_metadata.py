"""FlashInfer backend, CPU side: the exact ``plan()`` inputs it builds, checked against the page
table and against what the torch reference backend computes; flashinfer is never imported here.

The GPU test at the end (marked ``gpu``) compares the real kernels with the torch backend and
skips cleanly without CUDA or without flashinfer.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixkv.attention import TorchAttentionBackend, create_attention_backend
from radixkv.attention.flashinfer_backend import (
    FlashInferAttentionBackend,
    FlashInferPlan,
    flashinfer_plan_inputs,
)
from radixkv.attention.metadata import ForwardBatch
from radixkv.memory.kv_pool import KVPool, ReqToTokenPool

pytestmark = pytest.mark.timeout(120)

HQ, HKV, D = 9, 3, 64


def _make_batch(prefix_lens, extend_lens, page_size, seed=0, device="cpu", num_pages=None):
    """A batch over shuffled pages: each request owns whole pages drawn from a random permutation
    of the pool (so neighbouring pages of a request are never adjacent on purpose)."""
    g = torch.Generator().manual_seed(seed)
    seq = [p + e for p, e in zip(prefix_lens, extend_lens)]
    need = sum(math.ceil(s / page_size) for s in seq)
    num_pages = num_pages or need + 3
    perm = torch.randperm(num_pages, generator=g)
    r2t = ReqToTokenPool(len(seq) + 2, max(seq) + 5, device=device)
    rows, k = [], 0
    for s in seq:
        row = r2t.alloc()
        n = math.ceil(s / page_size)
        pages = perm[k : k + n]
        k += n
        slots = (pages[:, None] * page_size + torch.arange(page_size)[None, :]).reshape(-1)[:s]
        r2t.write(row, 0, slots)
        rows.append(row)
    ids = torch.randint(0, 1000, (sum(extend_lens),), generator=g)
    batch = ForwardBatch.build(ids, rows, prefix_lens, extend_lens, r2t.req_to_token, page_size, device=device)
    return batch, r2t, rows, num_pages


def _slots_from_plan(plan: FlashInferPlan, i: int, page_size: int) -> list[int]:
    """Token slots of request ``i`` as FlashInfer reads them from its plan inputs."""
    lo, hi = int(plan.kv_indptr[i]), int(plan.kv_indptr[i + 1])
    pages = plan.kv_indices[lo:hi].to(torch.int64).cpu()
    n = (hi - lo - 1) * page_size + int(plan.kv_last_page_len[i])
    slots = (pages[:, None] * page_size + torch.arange(page_size)[None, :]).reshape(-1)
    return slots[:n].tolist()


def _attention_from_plan(plan, pool: KVPool, q: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """FlashInfer's documented semantics, evaluated in float64 straight from the plan inputs:
    rows ``qo_indptr[i]:qo_indptr[i+1]`` attend to the request's paged KV with a bottom-right
    aligned causal mask; query head h uses KV head h // group."""
    k_all, v_all = pool.k_slots(0).double(), pool.v_slots(0).double()
    group = HQ // HKV
    out = torch.empty(q.shape, dtype=torch.float64)
    ps = plan.kwargs["page_size"]
    for i in range(plan.kv_indptr.numel() - 1):
        q0, q1 = int(plan.qo_indptr[i]), int(plan.qo_indptr[i + 1])
        slots = torch.tensor(_slots_from_plan(plan, i, ps))
        kv_len, q_len = slots.numel(), q1 - q0
        kk = k_all[slots].repeat_interleave(group, dim=1)  # [L, HQ, D]
        vv = v_all[slots].repeat_interleave(group, dim=1)
        s = torch.einsum("qhd,lhd->hql", q[q0:q1].double(), kk) * sm_scale
        qpos = torch.arange(q_len)[:, None] + (kv_len - q_len)
        s = s.masked_fill(torch.arange(kv_len)[None, :] > qpos, float("-inf"))
        out[q0:q1] = torch.einsum("hql,lhd->qhd", s.softmax(-1), vv)
    return out


MIXED = [
    # (prefix_lens, extend_lens): fresh prefill, extend of a cached prefix (not page aligned),
    # decode requests, a fresh 1-token prompt, a long extend over a long prefix
    ([0, 5, 16, 33, 0, 17], [7, 3, 1, 1, 1, 20]),
    ([0], [1]),
    ([40, 0], [9, 31]),
]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("case", range(len(MIXED)))
def test_plan_inputs_match_page_table_and_torch_backend(page_size, case):
    prefix, extend = MIXED[case]
    batch, r2t, rows, num_pages = _make_batch(prefix, extend, page_size, seed=case)
    scale = 1.0 / math.sqrt(D)
    plan = flashinfer_plan_inputs(batch, HQ, HKV, D, torch.bfloat16, scale)

    is_decode = all(e == 1 for e in extend)
    assert plan.kind == ("decode" if is_decode else "prefill")
    # host tensors for plan() (no device sync), int32 everywhere
    for t in (plan.qo_indptr, plan.kv_indptr, plan.kv_last_page_len):
        assert t.device.type == "cpu" and t.dtype == torch.int32
    assert plan.kv_indices.dtype == torch.int32
    assert plan.qo_indptr.tolist() == [0] + torch.tensor(extend).cumsum(0).tolist()
    seq = [p + e for p, e in zip(prefix, extend)]
    assert plan.kv_indptr.tolist() == [0] + torch.tensor([math.ceil(s / page_size) for s in seq]).cumsum(0).tolist()
    assert plan.kv_last_page_len.tolist() == [s - (math.ceil(s / page_size) - 1) * page_size for s in seq]
    assert all(1 <= x <= page_size for x in plan.kv_last_page_len.tolist())
    # every request's KV, read through the plan, is exactly its block-table row
    for i, (row, s) in enumerate(zip(rows, seq)):
        assert _slots_from_plan(plan, i, page_size) == r2t.req_to_token[row, :s].tolist()
    kw = plan.kwargs
    assert (kw["num_qo_heads"], kw["num_kv_heads"], kw["page_size"]) == (HQ, HKV, page_size)
    assert kw["sm_scale"] == pytest.approx(scale) and kw["pos_encoding_mode"] == "NONE"
    assert kw["q_data_type"] == torch.bfloat16 and kw["kv_data_type"] == torch.bfloat16
    if is_decode:
        assert kw["head_dim"] == D and "causal" not in kw
    else:
        assert kw["head_dim_qk"] == D and kw["causal"] is True

    # what FlashInfer would compute from these inputs == what the torch backend computes
    pool = KVPool(1, HKV, D, num_pages * page_size, page_size, torch.float32)
    g = torch.Generator().manual_seed(100 + case)
    pool.k_buffer[0].copy_(torch.randn(pool.k_buffer[0].shape, generator=g))
    pool.v_buffer[0].copy_(torch.randn(pool.v_buffer[0].shape, generator=g))
    t = batch.num_tokens
    q = torch.randn(t, HQ, D, generator=g)
    k = torch.randn(t, HKV, D, generator=g)
    v = torch.randn(t, HKV, D, generator=g)
    ref_backend = TorchAttentionBackend(pool, HQ)
    ref_backend.plan(batch)
    got = ref_backend.forward(0, q, k, v)  # also writes k/v into the pool at out_slots
    want = _attention_from_plan(plan, pool, q, scale)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@settings(max_examples=25, deadline=None)
@given(
    reqs=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 24)), min_size=1, max_size=6),
    page_size=st.sampled_from([1, 16]),
)
def test_plan_inputs_cover_every_token_once(reqs, page_size):
    prefix = [p for p, _ in reqs]
    extend = [e for _, e in reqs]
    batch, r2t, rows, _ = _make_batch(prefix, extend, page_size, seed=len(reqs))
    plan = flashinfer_plan_inputs(batch, HQ, HKV, D, torch.float16, 0.125)
    assert plan.kind == ("decode" if max(extend) == 1 else "prefill")
    seen: list[int] = []
    for i, (row, p, e) in enumerate(zip(rows, prefix, extend)):
        slots = _slots_from_plan(plan, i, page_size)
        assert slots == r2t.req_to_token[row, : p + e].tolist()
        # the new tokens' K/V go exactly to the last `extend` slots FlashInfer reads
        q0, q1 = int(plan.qo_indptr[i]), int(plan.qo_indptr[i + 1])
        assert batch.out_slots[q0:q1].tolist() == slots[p:]
        seen.extend(slots)
    assert len(seen) == len(set(seen))  # no slot shared between requests
    assert int(plan.kv_indptr[-1]) == plan.kv_indices.numel()


def test_plan_inputs_reject_fp32():
    batch, *_ = _make_batch([0], [3], 1)
    with pytest.raises(ValueError, match="dtype"):
        flashinfer_plan_inputs(batch, HQ, HKV, D, torch.float32, 0.125)


def test_backend_rejects_cpu_pool_and_fp32_without_importing_flashinfer():
    pool = KVPool(1, HKV, D, 16, 1, torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match="CUDA"):
        FlashInferAttentionBackend(pool, HQ)
    with pytest.raises(ValueError, match="num_q_heads"):
        FlashInferAttentionBackend(pool, 4)
    auto = create_attention_backend("auto", "cpu", KVPool(1, HKV, D, 16, 1, torch.float32), HQ)
    assert isinstance(auto, TorchAttentionBackend)
    if not torch.cuda.is_available():
        assert "flashinfer" not in sys.modules


class _FakeWrapper:
    """Stand-in for FlashInfer's paged prefill/decode wrappers with the same ``plan``/``run``
    parameter names (flashinfer 0.7.2); ``run`` evaluates the documented semantics in float64
    from what ``plan`` received, so the backend's glue is checked end to end on CPU."""

    calls: list = []

    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_tensor_cores=False, backend="auto"):
        assert kv_layout == "NHD" and backend == "fa2"
        assert float_workspace_buffer.dtype == torch.uint8 and int(float_workspace_buffer.sum()) == 0
        self.kind = "decode" if type(self).__name__.startswith("BatchDecode") else "prefill"
        self.plan_args = None

    def _plan(self, qo_indptr, kv_indptr, kv_indices, last, heads, kv_heads, head_dim, page_size, kw):
        for t in (qo_indptr, kv_indptr, last):
            assert t.device.type == "cpu" and t.dtype == torch.int32  # host arrays: no device sync
        assert kw["pos_encoding_mode"] == "NONE" and kw["q_data_type"] == kw["kv_data_type"]
        self.plan_args = FlashInferPlan(
            self.kind, qo_indptr, kv_indptr, kv_indices, last, dict(page_size=page_size, sm_scale=kw["sm_scale"])
        )
        self.heads = (heads, kv_heads, head_dim)
        _FakeWrapper.calls.append(("plan", self.kind))

    def run(self, q, paged_kv_cache):
        k_cache, v_cache = paged_kv_cache
        hq, hkv, d = self.heads
        assert k_cache.dim() == 4 and k_cache.shape[1:] == (self.plan_args.kwargs["page_size"], hkv, d)
        assert q.is_contiguous() and q.shape[1:] == (hq, d) and q.dtype == k_cache.dtype
        pool = KVPool(1, hkv, d, k_cache.shape[0] * k_cache.shape[1], k_cache.shape[1], k_cache.dtype)
        pool.k_buffer[0], pool.v_buffer[0] = k_cache, v_cache
        _FakeWrapper.calls.append(("run", self.kind))
        return _attention_from_plan(self.plan_args, pool, q, self.plan_args.kwargs["sm_scale"]).to(q.dtype)


class _FakePrefill(_FakeWrapper):
    def plan(
        self,
        qo_indptr,
        paged_kv_indptr,
        paged_kv_indices,
        paged_kv_last_page_len,
        num_qo_heads,
        num_kv_heads,
        head_dim_qk,
        page_size,
        *,
        causal=False,
        **kw,
    ):
        assert causal is True
        self._plan(
            qo_indptr,
            paged_kv_indptr,
            paged_kv_indices,
            paged_kv_last_page_len,
            num_qo_heads,
            num_kv_heads,
            head_dim_qk,
            page_size,
            kw,
        )


class _FakeDecode(_FakeWrapper):
    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, **kw):
        bs = indptr.numel() - 1
        self._plan(
            torch.arange(bs + 1, dtype=torch.int32),
            indptr,
            indices,
            last_page_len,
            num_qo_heads,
            num_kv_heads,
            head_dim,
            page_size,
            kw,
        )


@pytest.mark.parametrize("page_size", [1, 16])
def test_backend_glue_with_stand_in_flashinfer(monkeypatch, page_size):
    """Decode, mixed extend and fresh prefill batches through FlashInferAttentionBackend (a
    stand-in flashinfer module) give the torch backend's output; the KV of the new tokens is
    written into the pool; decode batches use the decode wrapper, all others the prefill one."""
    import types

    from radixkv.attention import flashinfer_backend as fb

    fake = types.SimpleNamespace(
        __version__="fake",
        BatchPrefillWithPagedKVCacheWrapper=type("BatchPrefillWithPagedKVCacheWrapper", (_FakePrefill,), {}),
        BatchDecodeWithPagedKVCacheWrapper=type("BatchDecodeWithPagedKVCacheWrapper", (_FakeDecode,), {}),
    )
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    monkeypatch.setattr(fb, "REQUIRE_CUDA", False)
    _FakeWrapper.calls = []
    for case, (prefix, extend) in enumerate(MIXED + [([3, 20, 0], [1, 1, 1])]):
        batch, _, _, num_pages = _make_batch(prefix, extend, page_size, seed=10 + case)
        g = torch.Generator().manual_seed(case)
        pools = []
        for _ in range(2):
            pool = KVPool(1, HKV, D, num_pages * page_size, page_size, torch.float16)
            gg = torch.Generator().manual_seed(case)
            pool.k_buffer[0].copy_(torch.randn(pool.k_buffer[0].shape, generator=gg))
            pool.v_buffer[0].copy_(torch.randn(pool.v_buffer[0].shape, generator=gg))
            pools.append(pool)
        t = batch.num_tokens
        q, k, v = (torch.randn(t, h, D, generator=g).half() for h in (HQ, HKV, HKV))
        fi = fb.FlashInferAttentionBackend(pools[0], HQ, workspace_bytes=1024)
        assert fi.use_tensor_cores is False  # group size 3 -> CUDA-core decode
        fi.plan(batch)
        out = fi.forward(0, q.float(), k, v)  # float32 q: cast for the kernel, output back in float32
        assert out.dtype == torch.float32
        ref = TorchAttentionBackend(pools[1], HQ)
        ref.plan(batch)
        want = ref.forward(0, q, k, v)
        torch.testing.assert_close(out, want.float(), atol=2e-3, rtol=2e-3)
        assert torch.equal(pools[0].k_buffer[0], pools[1].k_buffer[0])  # same KV writes
        assert torch.equal(pools[0].v_buffer[0], pools[1].v_buffer[0])
        kind = "decode" if max(extend) == 1 else "prefill"
        assert _FakeWrapper.calls[-2:] == [("plan", kind), ("run", kind)]
    with pytest.raises(RuntimeError, match="before plan"):
        fb.FlashInferAttentionBackend(pools[0], HQ, workspace_bytes=1024).forward(0, q, k, v)
    with pytest.raises(ValueError, match="workspace_bytes"):
        fb.FlashInferAttentionBackend(pools[0], HQ, workspace_bytes=0)
    with pytest.raises(ValueError, match="dtype"):
        fb.FlashInferAttentionBackend(KVPool(1, HKV, D, 16, 1, torch.float32), HQ)


def test_plan_arguments_bind_to_installed_flashinfer():
    """Where flashinfer is installed (even CPU-only), our plan() arguments bind to its real
    signatures (0.7.x: decode options after page_size are keyword-only)."""
    import inspect

    fi = pytest.importorskip("flashinfer")
    for prefix, extend in MIXED + [([3, 0], [1, 1])]:
        batch, *_ = _make_batch(prefix, extend, 16)
        p = flashinfer_plan_inputs(batch, HQ, HKV, D, torch.bfloat16, 0.125)
        if p.kind == "decode":
            kw = dict(p.kwargs)
            pos = [kw.pop(n) for n in ("num_qo_heads", "num_kv_heads", "head_dim", "page_size")]
            sig = inspect.signature(fi.BatchDecodeWithPagedKVCacheWrapper._plan_impl)
            sig.bind(None, p.kv_indptr, p.kv_indices, p.kv_last_page_len, *pos, **kw)
        else:
            sig = inspect.signature(fi.BatchPrefillWithPagedKVCacheWrapper.plan)
            sig.bind(None, p.qo_indptr, p.kv_indptr, p.kv_indices, p.kv_last_page_len, **p.kwargs)


def _flashinfer_usable() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import flashinfer  # noqa: F401
    except Exception:
        return False
    return True


@pytest.mark.gpu
@pytest.mark.skipif(not _flashinfer_usable(), reason="needs CUDA and flashinfer")
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("case", range(len(MIXED)))
def test_flashinfer_matches_torch_backend_on_gpu(page_size, case):
    prefix, extend = MIXED[case]
    batch, _, _, num_pages = _make_batch(prefix, extend, page_size, seed=case, device="cuda")
    pool = KVPool(1, HKV, D, num_pages * page_size, page_size, torch.bfloat16, "cuda")
    g = torch.Generator(device="cuda").manual_seed(case)
    pool.k_buffer[0].normal_(generator=g)
    pool.v_buffer[0].normal_(generator=g)
    t = batch.num_tokens
    q, k, v = (torch.randn(t, h, D, device="cuda", dtype=torch.bfloat16, generator=g) for h in (HQ, HKV, HKV))
    fi = FlashInferAttentionBackend(pool, HQ)
    fi.plan(batch)
    out_fi = fi.forward(0, q, k, v).float()
    ref = TorchAttentionBackend(pool, HQ)
    ref.plan(batch)
    out_ref = ref.forward(0, q, k, v).float()
    assert (out_fi - out_ref).abs().max().item() < 3e-2
