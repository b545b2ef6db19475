"""The fused native decode step (radixkv/executor/cpu_decode.py, ``decode_step`` in
csrc/cpu_kernels/step.c): the one-row GEMV against the micro-kernel bit for bit, long contexts (several
attention chunks) against the torch reference, batch invariance, the plan following weight
changes, and every out-of-range value refused before anything is written.

The fused step against transformers (tiny configs, the default model, batch 1 and 5) is in
tests/test_models_tiny.py and tests/test_model_default.py.
"""

from __future__ import annotations

import pytest
import torch
from model_helpers import PagedRequests
from test_cpu_kernels import _q4_1_weight, _q8_0_weight
from transformers import LlamaConfig

from radixkv.executor import cpu_decode
from radixkv.executor.model_runner import ModelRunner
from radixkv.kernels import cpu as ck
from radixkv.models import build_model

pytestmark = [
    pytest.mark.skipif(not ck.AVAILABLE, reason="native CPU kernels not built or no AVX2/FMA/F16C"),
    pytest.mark.timeout(300),
]


@pytest.mark.parametrize("fmt", ["f32", "q4_1", "q8_0"])
@pytest.mark.parametrize("n, k", [(16, 64), (35, 96), (130, 576), (7, 37)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_one_row_gemv_gives_the_micro_kernels_bits(fmt, n, k, with_bias):
    """One row takes the GEMV (panel chains interleaved, blocks decoded in registers); more rows
    the register-blocked micro-kernel. Each output is the same FMA chain over k either way, so
    row r alone gives exactly row r of a larger call, in every format and at every tail of N."""
    if fmt != "f32" and k % 32:
        pytest.skip("block formats need K % 32 == 0")
    g = torch.Generator().manual_seed(n + k)
    w = {"f32": lambda: torch.randn(n, k, generator=g), "q4_1": lambda: _q4_1_weight(n, k, g)}.get(
        fmt, lambda: _q8_0_weight(n, k, g)
    )()
    packed = ck.PackedWeight(w, (fmt,))
    b = torch.randn(n, generator=g) if with_bias else None
    x = torch.randn(7, k, generator=g)
    many = ck.packed_linear(x, packed, b)
    for r in range(7):
        assert torch.equal(ck.packed_linear(x[r : r + 1], packed, b), many[r : r + 1]), r


def _tiny(layers=2, vocab=97, **kw):
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        **kw,
    )
    cfg.architectures = ["LlamaForCausalLM"]
    return cfg, build_model(cfg, seed=1).eval()


def _runner(model, cfg, backend, page_size=1, max_context_len=1024):
    return ModelRunner(
        model,
        cfg,
        num_slots=4096,
        page_size=page_size,
        max_running_requests=4,
        max_context_len=max_context_len,
        attention_backend=backend,
    )


@pytest.mark.parametrize("page_size", [1, 16])
def test_long_context_decode_matches_the_torch_reference(page_size):
    """Decode rows at 600+ positions are split into 256-position attention chunks merged in order:
    the logits stay equal to the torch backend's (which tests/test_attention_torch.py holds to a
    float64 reference), and the fused step served every decode."""
    cfg, model = _tiny()
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, cfg.vocab_size, (600,), generator=g).tolist()
    runs = {}
    for backend in ("cpu", "torch"):
        reqs = PagedRequests(_runner(model, cfg, backend, page_size), seed=3)
        seq = list(prompt)
        (lg,) = reqs.forward([("a", seq)])
        out = [lg]
        for _ in range(4):
            seq.append(int(out[-1].argmax()))
            (lg,) = reqs.forward([("a", [seq[-1]])])
            out.append(lg)
        runs[backend] = torch.cat(out)
        if backend == "cpu":
            assert reqs.runner.decode_step is not None and reqs.runner.decode_step._plan is not None
    torch.testing.assert_close(runs["cpu"], runs["torch"], atol=1e-4, rtol=0)


def test_logits_do_not_depend_on_the_rest_of_the_batch():
    """A request's logits on the fused step are the same bits alone (the one-row GEMV) and beside
    other requests (the micro-kernel): every row is computed by itself."""
    cfg, model = _tiny()
    g = torch.Generator().manual_seed(4)
    a, b = (torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (30, 300))
    alone = PagedRequests(_runner(model, cfg, "cpu"), seed=1)
    both = PagedRequests(_runner(model, cfg, "cpu"), seed=2)
    alone.forward([("a", a)])
    both.forward([("a", a)])  # the same prefill (a larger batch would take torch's prefill kernels)
    both.forward([("b", b)])
    for step in range(3):
        (la,) = alone.forward([("a", [step + 5])])
        lab, _ = both.forward([("a", [step + 5]), ("b", [step + 9])])
        assert torch.equal(la, lab), step


def test_plan_follows_weight_changes_and_replacements():
    """The plan of addresses is rebuilt when a weight changes in place (its packed copy would be
    stale) or a module or parameter is replaced: the fused logits keep equal the module path's."""
    cfg, model = _tiny()
    runner = _runner(model, cfg, "cpu")
    ref_runner = _runner(model, cfg, "torch")
    prompt = list(range(3, 40))

    def logits_both():
        got = []
        for r in (runner, ref_runner):
            reqs = PagedRequests(r)
            reqs.forward([("a", prompt)])
            (lg,) = reqs.forward([("a", [7])])
            got.append(lg)
            for row in reqs.rows.values():
                r.req_to_token_pool.free(row)
        return got

    first, ref = logits_both()
    torch.testing.assert_close(first, ref, atol=1e-4, rtol=0)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(-3)  # in place: _version moves
        model.model.layers[0].input_layernorm.weight.add_(0.5)  # read live by address
    second, ref2 = logits_both()
    assert (second - first).abs().max() > 1e-3
    torch.testing.assert_close(second, ref2, atol=1e-4, rtol=0)
    lin = model.model.layers[0].self_attn.o_proj
    lin.weight = torch.nn.Parameter(lin.weight.detach() * 2)  # a replaced parameter: the epoch moves
    third, ref3 = logits_both()
    assert (third - second).abs().max() > 1e-3
    torch.testing.assert_close(third, ref3, atol=1e-4, rtol=0)
    up = model.model.layers[1].mlp.gate_up_proj.weight
    version = up._version
    up.data = up.detach() * -1  # ``.data =``: neither the epoch nor _version moves, data_ptr does
    assert up._version == version
    fourth, ref4 = logits_both()
    assert (fourth - third).abs().max() > 1e-3
    torch.testing.assert_close(fourth, ref4, atol=1e-4, rtol=0)
    with torch.no_grad():  # two in-place edits on two weights: the version sum moves by 2
        model.model.layers[0].mlp.down_proj.weight.mul_(0.5)
        model.model.layers[1].self_attn.qkv_proj.weight.mul_(2)
    fifth, ref5 = logits_both()
    assert (fifth - fourth).abs().max() > 1e-3
    torch.testing.assert_close(fifth, ref5, atol=1e-4, rtol=0)


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(2, 1, 264), (66, 1, 8)])
def test_a_model_outside_the_fused_steps_limits_runs_on_the_module_path(heads, kv_heads, head_dim):
    """head_dim above 256 or more than 64 query heads per KV head (step.c's step_dims_ok): the cpu
    backend runs the model on its module path, with the torch backend's logits. Every forward
    used to fail with 'step_plan: bad dimensions or layer table' (the model was taken as fused)."""
    cfg = LlamaConfig(
        vocab_size=50,
        hidden_size=max(64, heads * 8),
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    cfg.architectures = ["LlamaForCausalLM"]
    model = build_model(cfg, seed=0).eval()
    assert "head_dim" in cpu_decode.model_supported(model)
    logits = {}
    for backend in ("cpu", "torch"):
        reqs = PagedRequests(_runner(model, cfg, backend, max_context_len=64))
        (prefill,) = reqs.forward([("a", list(range(1, 11)))])
        (decode,) = reqs.forward([("a", [3])])
        logits[backend] = torch.cat([prefill, decode])
    torch.testing.assert_close(logits["cpu"], logits["torch"], atol=1e-5, rtol=0)


def test_bad_values_are_refused_before_anything_is_written():
    cfg, model = _tiny(layers=1)
    runner = _runner(model, cfg, "cpu", page_size=4, max_context_len=64)
    step = runner.decode_step
    assert step is not None
    pool = runner.req_to_token_pool
    row = pool.alloc()
    pool.write(row, 0, torch.arange(16, 32))  # positions 0..15 in pages 4..7
    runner.forward(runner.build_batch(list(range(1, 13)), [row], [0], [12]))  # a short extend: fused
    k_before = runner.kv_pool.k_buffer[0].clone()
    r2t = pool.req_to_token

    def step_with(**kw):
        args = dict(tokens=[5], rows=[row], prefix_lens=[12], extend_lens=[1], logits_rows=[0])
        args.update(kw)
        b = cpu_decode.DecodeBatch(
            args["tokens"], args["rows"], args["prefix_lens"], args["extend_lens"], args["logits_rows"], 4, r2t
        )
        return step.forward(b)

    assert step_with() is not None
    runner.kv_pool.k_buffer[0].copy_(k_before)
    cases = [
        (dict(tokens=[cfg.vocab_size]), "outside the vocabulary"),
        (dict(tokens=[-1]), "outside the vocabulary"),
        (dict(rows=[4]), "outside the block table"),
        (dict(prefix_lens=[63], extend_lens=[2]), "max_context_len"),
        # prefix_len + extend_len overflows int64: was taken as in range, the step then read the
        # block table and the RoPE tables at position -1 and wrote K/V through that slot
        (dict(prefix_lens=[2**63 - 1]), "max_context_len"),
        (dict(prefix_lens=[2**63 - 2], extend_lens=[2], tokens=[5, 6]), "max_context_len"),
        (dict(tokens=[5, 6]), "sum\\(extend_lens\\)"),
        (dict(logits_rows=[1]), "logits row"),
        (dict(extend_lens=[0]), "extend_len >= 1"),
    ]
    for kw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            step_with(**kw)
    saved = r2t[row, 12].item()
    r2t[row, 12] = 4096 * 4  # a slot outside the pool
    with pytest.raises(ValueError, match="outside the KV pool"):
        step_with()
    r2t[row, 12] = 1  # inside the pool, but not at offset 12 % 4 of its page
    with pytest.raises(ValueError, match="not aligned to page_size"):
        step_with()
    r2t[row, 12] = saved
    assert torch.equal(runner.kv_pool.k_buffer[0], k_before)  # nothing was written by a refused step
    # through the runner, bad arguments still get ForwardBatch.build's errors
    with pytest.raises(ValueError, match="extend_len must be >= 1"):
        runner.build_batch([], [row], [12], [0])


def test_decode_batch_reads_as_a_forward_batch():
    """A DecodeBatch answers ForwardBatch's fields (built on first read) with the same values."""
    cfg, model = _tiny(layers=1)
    runner = _runner(model, cfg, "cpu", page_size=1, max_context_len=64)
    pool = runner.req_to_token_pool
    rows = [pool.alloc(), pool.alloc()]
    pool.write(rows[0], 0, torch.arange(0, 10))
    pool.write(rows[1], 0, torch.arange(20, 28))
    b = runner.build_batch([3, 4, 5], rows, [9, 5], [1, 2])
    assert isinstance(b, cpu_decode.DecodeBatch) and b.batch_size == 2 and b.num_tokens == 3
    assert b.positions.tolist() == [9, 5, 6] and b.out_slots.tolist() == [9, 25, 26]
    assert b.logits_indices.tolist() == [0, 2] and b.seq_lens.tolist() == [10, 7]
    assert not b.is_decode
    t = runner.build_batch(torch.tensor([3, 4, 5]), torch.tensor(rows), torch.tensor([9, 5]), torch.tensor([1, 2]))
    assert isinstance(t, cpu_decode.DecodeBatch) and (t.tokens, t.rows, t.prefix_lens) == ([3, 4, 5], rows, [9, 5])
    assert torch.equal(runner.forward(t), runner.forward(b))  # the same step twice: the same K/V, the same logits
