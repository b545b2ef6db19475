"""In-batch prefix sharing at the model level: a row whose prefix K/V another row of the same
forward writes (its ``req_to_token`` row points at that row's slots) attends to them, on every
attention backend. Every backend writes the K/V of all new tokens of a layer before any row of
that layer attends (torch and cpu: ``KVPool.write`` then attention; the fused CPU decode step:
the qkv GEMM's post-step writes every row's K/V before ``paged_attention``; FlashInfer: write,
then ``run``). Checked against transformers' logits of the sharer's whole sequence (tiny random
Llama), and for FlashInfer's glue with the stand-in module of test_flashinfer_metadata.py."""

from __future__ import annotations

import math
import os
import random
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from test_flashinfer_metadata import HKV, HQ, _attention_from_plan, _FakeDecode, _FakePrefill, _FakeWrapper
from transformers import LlamaConfig
from transformers import LlamaForCausalLM as HFLlama

from radixkv.attention import TorchAttentionBackend
from radixkv.attention.flashinfer_backend import flashinfer_plan_inputs
from radixkv.attention.metadata import ForwardBatch
from radixkv.executor import cpu_decode
from radixkv.executor.model_runner import ModelRunner
from radixkv.kernels import cpu as cpu_kernels
from radixkv.memory.kv_pool import KVPool, ReqToTokenPool
from radixkv.models import get_model_class

pytestmark = pytest.mark.timeout(300)

BACKENDS = ["torch"] + (["cpu"] if cpu_kernels.AVAILABLE else [])


@pytest.fixture(scope="module")
def pair():
    cfg = LlamaConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    cfg.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    hf = HFLlama(cfg).eval()
    ours = get_model_class(cfg)(cfg)
    ours.load_weights(hf.state_dict().items())
    return cfg, hf, ours.eval()


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


class Rows:
    """Block-table rows over shuffled pages; a row may start with another row's slots."""

    def __init__(self, runner):
        self.runner = runner
        self.ps = runner.page_size
        self.free = list(range(runner.kv_pool.num_pages))
        random.Random(0).shuffle(self.free)  # no two neighbouring pages of a row are adjacent on purpose
        self.slots: dict[str, list[int]] = {}
        self.row: dict[str, int] = {}

    def new(self, name, n, borrow=None, borrow_len=0):
        """Row ``name`` with slots for ``n`` positions; the first ``borrow_len`` (whole pages) are
        ``borrow``'s."""
        assert borrow_len % self.ps == 0
        slots = list(self.slots[borrow][:borrow_len]) if borrow else []
        self.slots[name] = slots
        self.row[name] = self.runner.req_to_token_pool.alloc()
        self.grow(name, n)

    def grow(self, name, n):
        slots = self.slots[name]
        while len(slots) < n:
            page = self.free.pop()
            slots.extend(page * self.ps + i for i in range(self.ps))
        self.runner.req_to_token_pool.write(self.row[name], 0, torch.tensor(slots))

    def forward(self, items, all_logits=True):
        """items: (name, prefix_len, new tokens); returns each item's logits rows."""
        ids, rows, pre, ext = [], [], [], []
        for name, p, toks in items:
            ids += toks
            rows.append(self.row[name])
            pre.append(p)
            ext.append(len(toks))
        idx = list(range(len(ids))) if all_logits else None
        batch = self.runner.build_batch(ids, rows, pre, ext, logits_indices=idx)
        out = self.runner.forward(batch)
        res, off = [], 0
        for e in ext:
            res.append(out[off : off + e] if all_logits else out[len(res) : len(res) + 1])
            off += e
        return res


def runner(ours, cfg, page_size, backend):
    return ModelRunner(
        ours, cfg, num_slots=64 * 16, page_size=page_size, max_running_requests=8, max_context_len=256,
        attention_backend=backend,
    )  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_size", [1, 16])
def test_sharer_attends_to_a_prefix_computed_in_the_same_forward(pair, backend, page_size):
    cfg, hf, ours = pair
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(0, 97, (32,), generator=g).tolist()  # 32: whole pages at 1 and 16
    a = shared + torch.randint(0, 97, (7,), generator=g).tolist()
    b = shared + torch.randint(0, 97, (5,), generator=g).tolist()
    c = shared[:16] + torch.randint(0, 97, (3,), generator=g).tolist()  # shares less, with a row of its own
    rows = Rows(runner(ours, cfg, page_size, backend))
    rows.new("a", len(a))
    rows.new("b", len(b), borrow="a", borrow_len=32)
    rows.new("c", len(c), borrow="b", borrow_len=16)  # a chain: b's first 16 slots are a's
    got = rows.forward([("a", 0, a), ("b", 32, b[32:]), ("c", 16, c[16:])])
    atol = 1e-4
    torch.testing.assert_close(got[0], hf_logits(hf, a), atol=atol, rtol=0)
    torch.testing.assert_close(got[1], hf_logits(hf, b)[32:], atol=atol, rtol=0)
    torch.testing.assert_close(got[2], hf_logits(hf, c)[16:], atol=atol, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_batch_reading_a_token_written_by_another_row(pair, backend, page_size, monkeypatch):
    """A decode-only batch where one row's last prefix token is the token another row writes in
    that forward: the fused native decode step (cpu backend) serves it and agrees with transformers."""
    cfg, hf, ours = pair
    g = torch.Generator().manual_seed(2)
    a = torch.randint(0, 97, (31,), generator=g).tolist()
    rows = Rows(runner(ours, cfg, page_size, backend))
    rows.new("a", len(a) + 1)
    (first,) = rows.forward([("a", 0, a)], all_logits=False)
    a.append(int(first.argmax()))  # position 31: computed in the next forward
    rows.new("b", 33, borrow="a", borrow_len=32)  # b = a[:32] + one token of its own
    b = a + [5]
    fused = []
    real = cpu_decode.DecodeStep.forward
    monkeypatch.setattr(cpu_decode.DecodeStep, "forward", lambda *x, **k: fused.append(1) or real(*x, **k))
    got = rows.forward([("a", 31, a[31:]), ("b", 32, [5])], all_logits=False)
    assert len(fused) == (1 if backend == "cpu" else 0)
    torch.testing.assert_close(got[0], hf_logits(hf, a)[-1:], atol=1e-4, rtol=0)
    torch.testing.assert_close(got[1], hf_logits(hf, b)[-1:], atol=1e-4, rtol=0)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("decode", [False, True])
def test_flashinfer_glue_with_shared_rows(monkeypatch, page_size, decode):
    """FlashInferAttentionBackend (stand-in flashinfer) on a batch whose second request's prefix
    pages are the first request's, written in this very forward: its plan reads them and its
    output equals the torch backend's and the documented semantics on the written pool."""
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
    D = 64
    ps = page_size
    r2t = ReqToTokenPool(4, 96)
    # a computes positions [a_pre, a_pre + a_new) now; b borrows a's first 32 positions (whole
    # pages), which include a's new token(s), and brings b_new tokens of its own
    a_pre, a_new, b_new = (31, 1, 1) if decode else (0, 40, 6)
    b_pre = 32

    def pages(ids, n):
        return [p * ps + i for p in ids for i in range(ps)][:n] if ps > 1 else [ids[0] * 16 + i for i in range(n)]

    a_slots = pages([3, 7, 9], a_pre + a_new)
    b_slots = a_slots[:b_pre] + pages([11, 10], b_new)
    ra, rb = r2t.alloc(), r2t.alloc()
    r2t.write(ra, 0, torch.tensor(a_slots))
    r2t.write(rb, 0, torch.tensor(b_slots))
    num_pages = 12 * 16 // ps
    t = a_new + b_new
    batch = ForwardBatch.build(list(range(t)), [ra, rb], [a_pre, b_pre], [a_new, b_new], r2t.req_to_token, ps)
    assert batch.is_decode == decode
    pools = []
    for _ in range(2):
        pool = KVPool(1, HKV, D, num_pages * ps, ps, torch.float16)
        gg = torch.Generator().manual_seed(9)
        pool.k_buffer[0].copy_(torch.randn(pool.k_buffer[0].shape, generator=gg))
        pool.v_buffer[0].copy_(torch.randn(pool.v_buffer[0].shape, generator=gg))
        pools.append(pool)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(t, h, D, generator=g).half() for h in (HQ, HKV, HKV))
    fi = fb.FlashInferAttentionBackend(pools[0], HQ, workspace_bytes=1024)
    fi.plan(batch)
    out = fi.forward(0, q, k, v)
    ref = TorchAttentionBackend(pools[1], HQ)
    ref.plan(batch)
    want = ref.forward(0, q, k, v)
    torch.testing.assert_close(out.float(), want.float(), atol=2e-3, rtol=2e-3)
    plan = flashinfer_plan_inputs(batch, HQ, HKV, D, torch.float16, 1 / math.sqrt(D))
    semantics = _attention_from_plan(plan, pools[0], q, 1 / math.sqrt(D))  # on the pool after the writes
    torch.testing.assert_close(out.double(), semantics, atol=2e-3, rtol=2e-3)
    # b's first new token reads a's new token(s) at the shared positions, written this forward
    written = set(batch.out_slots[:a_new].tolist())
    assert written & set(b_slots[:b_pre])
    kind = "decode" if decode else "prefill"
    assert _FakeWrapper.calls[-2:] == [("plan", kind), ("run", kind)]
