"""Row-count invariance of decode rows: the verify rows of speculative decoding.

A request's ``k + 1`` verify rows (its block-table row repeated at consecutive positions, one new
token each: :func:`radixkv.executor.row_split.verify_rows`) in one forward, alone or beside other
requests' verify rows, decode rows and prefill chunks, must give every row exactly the bits that a
one-row decode step at that position gives: the K/V written into the pool (every layer, fp8 scales
included) and the logits. Checked on every backend (the torch reference, the cpu backend's fused
native step, the cpu backend's module path with ``paged_attention``), in every K/V dtype, at page
sizes 1 and 16, on the AVX-512 and the AVX2 kernels, with float32 and GGUF-block (Q4_1 / Q8_0)
weights, on a tiny random model and on the default model, for random requests whose contexts
cross the fused step's 256-position attention chunks. The default model also decodes greedily
with drafts (right and wrong ones) verified this way and gives the one-row steps' tokens.
"""

from __future__ import annotations

import random

import pytest
import torch
from test_cpu_kernels import _q4_1_weight, _q8_0_weight
from test_decode_step import _tiny
from test_kernels_isa import _blocky_tiny

from radixkv.executor import row_split
from radixkv.executor.model_runner import ModelRunner
from radixkv.kernels import cpu as ck

pytestmark = [
    pytest.mark.skipif(not ck.AVAILABLE, reason="native CPU kernels not built or no AVX2/FMA/F16C"),
    pytest.mark.timeout(900),
]

KV_DTYPES = ["float32", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2"]
BACKENDS = ["torch", "cpu", "cpu-generic"]  # cpu-generic: the cpu backend without the fused step
ISAS = ["avx2", "avx512"] if ck.has_avx512() else ["avx2"]


@pytest.fixture
def restore_isa():
    was = ck.isa()
    yield
    ck.set_isa(was)


class Requests:
    """Requests over one runner, each with its own shuffled pages (non-contiguous K/V)."""

    def __init__(self, runner: ModelRunner, max_len: int, names, seed: int) -> None:
        self.runner, ps = runner, runner.page_size
        pages = list(range(runner.kv_pool.num_pages))
        random.Random(seed).shuffle(pages)
        per = -(-max_len // ps)
        self.row, self.slots = {}, {}
        for i, name in enumerate(names):
            own = pages[i * per : (i + 1) * per]
            slots = torch.tensor([own[p // ps] * ps + p % ps for p in range(per * ps)])
            self.row[name] = runner.req_to_token_pool.alloc()
            runner.req_to_token_pool.write(self.row[name], 0, slots)
            self.slots[name] = slots

    def forward(self, entries, all_logits=True) -> torch.Tensor:
        """One forward of ``entries`` = [(name, prefix_len, tokens)], decode rows written
        ``(name, prefix_len, [token])``; logits of every token (``all_logits``) or of each entry's
        last one."""
        r = self.runner
        ids = [t for _, _, toks in entries for t in toks]
        rows = [self.row[n] for n, _, _ in entries]
        prefix = [p for _, p, _ in entries]
        extend = [len(toks) for _, _, toks in entries]
        lrows = list(range(len(ids))) if all_logits else None
        return r.forward(r.build_batch(ids, rows, prefix, extend, logits_indices=lrows))

    def prefill(self, name: str, tokens: list[int], chunk: int = 64) -> None:
        for i in range(0, len(tokens), chunk):
            self.forward([(name, i, tokens[i : i + chunk])], all_logits=False)

    def kv_bytes(self, name: str, upto: int) -> list[torch.Tensor]:
        """The pool's raw bytes (K, V and fp8 scales, every layer) at positions ``0 .. upto - 1``."""
        pool, slots = self.runner.kv_pool, self.slots[name][:upto]
        out = []
        for layer in range(pool.num_layers):
            for t in (pool.k_slots(layer), pool.v_slots(layer), pool.k_scale_slots(layer), pool.v_scale_slots(layer)):
                if t is not None:
                    out.append(t[slots].contiguous().view(torch.uint8).clone())
        return out


def _runner(model, cfg, backend, kv_dtype, page_size, num_slots):
    runner = ModelRunner(
        model,
        cfg,
        num_slots=num_slots,
        page_size=page_size,
        max_running_requests=32,
        max_context_len=512,
        attention_backend="cpu" if backend.startswith("cpu") else "torch",
        kv_cache_dtype=kv_dtype,
    )
    if backend == "cpu-generic":
        runner.decode_step = None
    assert (runner.decode_step is not None) == (backend == "cpu")
    return runner


def _scenario(vocab: int, seed: int, groups: int = 14):
    """Random requests: name -> (prompt, rows to verify after it), and the verify run's batches.

    ``A`` verifies 5 rows from position 254 (its rows cross the 256-position attention chunk);
    the others have random prompts (1-300 tokens) and 1 (a plain decode row) to 5 rows. Batches:
    A alone; B, C (a decode row) beside a 40-token prefill chunk of P (40 + 4 + 1 tokens); D, E
    beside a 100-token chunk of Q (more than 64 tokens); G0..G<groups - 1>, 5 rows each (14: 70
    decode rows, more than the fused step's 64)."""
    rng = random.Random(seed)
    reqs = {"A": (254, 5), "B": (rng.randint(1, 300), 4), "C": (rng.randint(1, 300), 1)}
    reqs.update({"D": (rng.randint(250, 300), 5), "E": (rng.randint(1, 40), rng.randint(1, 5))})
    reqs.update({f"G{i}": (rng.randint(1, 300), 5) for i in range(groups)})
    toks = {n: [rng.randrange(vocab) for _ in range(n_prompt + k)] for n, (n_prompt, k) in reqs.items()}
    prefills = {"P": [rng.randrange(vocab) for _ in range(40)], "Q": [rng.randrange(vocab) for _ in range(100)]}
    batches = [["A"], ["P", "B", "C"], ["D", "Q", "E"]] + ([[f"G{i}" for i in range(groups)]] if groups else [])
    return reqs, toks, prefills, batches


def _check(model, cfg, backend, kv_dtype, page_size, seed, groups=14):
    """The scenario's verify rows against one-row decode steps: logits and K/V bits."""
    reqs, toks, prefills, batches = _scenario(cfg.vocab_size, seed, groups)
    names = [*reqs, *prefills]
    slots = len(names) * (-(-320 // page_size) * page_size)

    ref = Requests(_runner(model, cfg, backend, kv_dtype, page_size, slots), 320, names, seed)
    want = {}
    for n, (n_prompt, k) in reqs.items():
        ref.prefill(n, toks[n][:n_prompt])
        want[n] = torch.cat([ref.forward([(n, n_prompt + j, [toks[n][n_prompt + j]])]) for j in range(k)])

    got = Requests(_runner(model, cfg, backend, kv_dtype, page_size, slots), 320, names, seed)
    for n, (n_prompt, _) in reqs.items():
        got.prefill(n, toks[n][:n_prompt])
    for batch in batches:
        entries, where = [], {}
        for n in batch:
            if n in prefills:
                entries.append((n, 0, prefills[n]))
                continue
            n_prompt, k = reqs[n]
            rows, prefix, extend = row_split.verify_rows(got.row[n], n_prompt, k)
            assert rows == [got.row[n]] * k and extend == [1] * k
            start = sum(len(e[2]) for e in entries)
            where[n] = slice(start, start + k)
            entries += [(n, p, [toks[n][p]]) for p in prefix]
        logits = got.forward(entries)
        for n, rows in where.items():
            assert torch.equal(logits[rows], want[n]), f"logits of {n} ({batch})"
    for n, (n_prompt, k) in reqs.items():
        for a, b in zip(got.kv_bytes(n, n_prompt + k), ref.kv_bytes(n, n_prompt + k)):
            assert torch.equal(a, b), f"K/V of {n}"


@pytest.mark.parametrize("weights", ["f32", "blocks"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_verify_rows_give_the_one_row_bits_tiny(backend, kv_dtype, page_size, weights, restore_isa):
    cfg, model = _blocky_tiny() if weights == "blocks" else _tiny(vocab=160)
    for i, isa in enumerate(ISAS):
        ck.set_isa(isa)
        _check(model, cfg, backend, kv_dtype, page_size, seed=len(kv_dtype) * 10 + page_size + i)


@pytest.mark.parametrize("fmt", ["f32", "q4_1", "q8_0"])
@pytest.mark.parametrize("n, k", [(16, 64), (35, 96), (130, 576), (49, 1536), (7, 37)])
def test_packed_gemm_rows_give_the_one_row_bits(restore_isa, fmt, n, k):
    """The GEMM itself: every row of an M-row product (the small-M GEMM on AVX-512, its row and
    panel groups; the micro-kernel on AVX2) is the bits of that row alone (the GEMV), bias or not,
    whole and partial panels, under both ISAs alike."""
    if fmt != "f32" and k % 32:
        pytest.skip("block formats need K % 32 == 0")
    g = torch.Generator().manual_seed(n * 7 + k)
    make = {"f32": lambda: torch.randn(n, k, generator=g), "q4_1": lambda: _q4_1_weight(n, k, g)}
    packed = ck.PackedWeight(make.get(fmt, lambda: _q8_0_weight(n, k, g))(), (fmt,))
    b, x = torch.randn(n, generator=g), torch.randn(17, k, generator=g)
    one = None
    for isa in ISAS:
        ck.set_isa(isa)
        alone = torch.cat([ck.packed_linear(x[i : i + 1], packed, b) for i in range(len(x))])
        assert one is None or torch.equal(alone, one), isa
        one = alone
        for m in (2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 17):
            assert torch.equal(ck.packed_linear(x[:m], packed, b), one[:m]), (isa, m)
        assert torch.equal(
            ck.packed_linear(x[:5], packed), torch.cat([ck.packed_linear(r[None], packed) for r in x[:5]])
        )


def test_plan_parts_keeps_order_and_maps_logits():
    """The split itself: decode entries in chunks of at most max_rows (a request's verify rows kept
    together when they fit), then the other entries; every logits row lands where it was asked."""
    tokens = list(range(100, 113))
    rows, prefix, extend = [5, 5, 5, 7, 2, 2, 9], [10, 11, 12, 3, 0, 4, 8], [1, 1, 1, 4, 1, 1, 4]
    lrows = [12, 0, 3, 2, 6, 1, 8]
    parts = row_split.plan_parts(tokens, rows, prefix, extend, lrows, max_rows=4)
    assert [p.rows for p in parts] == [[5, 5, 5], [2, 2], [7, 9]]
    assert [p.prefix for p in parts] == [[10, 11, 12], [0, 4], [3, 8]]
    assert [p.tokens for p in parts] == [[100, 101, 102], [107, 108], [103, 104, 105, 106, 109, 110, 111, 112]]
    assert [p.logits_rows for p in parts] == [[0, 2, 1], [1], [7, 0, 3]]
    assert [p.out for p in parts] == [[1, 3, 5], [6], [0, 2, 4]]
    assert row_split.plan_parts(tokens[:3], rows[:3], prefix[:3], [1, 1, 1], [2], 4) is None  # one chunk
    assert row_split.plan_parts(tokens, [5, 5, 5, 5, 2, 2, 9], prefix, extend, lrows, 4) is None  # row 5 in both
    assert row_split.plan_parts(tokens[3:7], [7], [3], [4], [3], 4) is None  # no decode entry
    with pytest.raises(ValueError, match="num_rows must be >= 1"):
        row_split.verify_rows(3, 10, 0)


def test_plan_parts_runs_a_part_after_the_part_whose_slots_it_reads():
    """In-batch prefix sharing puts a request (a rider) on slots another one (its source) writes in
    the same forward. A rider whose only new token is its last one is a decode entry: it must run
    after the source's part, whose K/V it reads (it read the slots before they were written:
    another answer than the rider alone); a source with one new token runs before its riders as
    before; readers in both directions: no split (the whole batch writes every K/V first)."""
    r2t = {
        1: list(range(100, 150)),  # a long chunk: positions 0..49
        2: list(range(100, 133)) + [900],  # rides on row 1's first 33 slots, computes position 33
        3: list(range(300, 320)),  # shares nothing
        4: list(range(200, 211)),  # cached 0..9, computes position 10
        5: list(range(200, 211)) + list(range(600, 620)),  # rides on row 4's position 10
    }

    table = -torch.arange(6 * 64).reshape(6, 64) - 1  # slots no row holds: -1, -2, ...
    for row, slots in r2t.items():
        table[row, : len(slots)] = torch.tensor(slots)

    def plan(rows, prefix, extend):
        lrows = [sum(extend[: i + 1]) - 1 for i in range(len(rows))]
        return row_split.plan_parts(list(range(sum(extend))), rows, prefix, extend, lrows, 4, table=table)

    parts = plan([1, 2], [0, 33], [50, 1])
    assert [p.rows for p in parts] == [[1], [2]] and [p.out for p in parts] == [[0], [1]]  # the source first
    assert [p.rows for p in plan([3, 2], [0, 33], [20, 1])] == [[2], [3]]  # nothing shared: decode first
    assert [p.rows for p in plan([5, 4], [11, 10], [20, 1])] == [[4], [5]]  # a one-token source first
    assert plan([1, 2, 5, 4], [0, 33, 11, 10], [50, 1, 20, 1]) is None  # both ways: no split
    assert [p.rows for p in row_split.plan_parts(list(range(51)), [1, 2], [0, 33], [50, 1], [49, 50], 4)] == [
        [2],
        [1],
    ]  # without a table: no slots are shared


def test_a_one_token_rider_in_the_same_forward_gets_its_alone_answer():
    """The bug behind the test above, end to end: a prompt that is another's first 33 tokens plus
    one, submitted with it (in-batch prefix sharing), decodes exactly as when sent alone."""
    from model_helpers import tiny_loaded_model

    from radixkv import SamplingParams
    from radixkv.config import EngineConfig
    from radixkv.engine import Engine

    rng = random.Random(5)
    a = [rng.randrange(300, 3000) for _ in range(50)]
    b = a[:33] + [7777]
    sp = SamplingParams(temperature=0, max_tokens=4, logprobs=2, ignore_eos=True)
    loaded = tiny_loaded_model(seed=0)

    def run(prompts):
        eng = Engine(EngineConfig(device="cpu", max_total_tokens=1024), loaded_model=loaded)
        ids = [eng.add_request(p, sp) for p in prompts]
        done = {}
        while eng.has_unfinished_requests():
            done.update((o.request_id, o) for o in eng.step() if o.finished)
        return [done[i] for i in ids]

    (alone,) = run([b])
    _, rider = run([a, b])
    assert rider.num_cached_tokens == 33  # it rode on a's prefill
    assert rider.outputs[0].token_ids == alone.outputs[0].token_ids
    assert rider.outputs[0].logprobs == alone.outputs[0].logprobs


def test_split_batch_reads_as_the_whole_forward_batch():
    cfg, model = _tiny(vocab=160)
    runner = _runner(model, cfg, "cpu", "float32", 1, 1024)
    reqs = Requests(runner, 128, ["a", "b"], 0)
    ids, rows = list(range(1, 22)), [reqs.row["a"]] * 3 + [reqs.row["b"]]
    batch = runner.build_batch(ids, rows, [5, 6, 7, 0], [1, 1, 1, 18])  # an 18-token chunk: past MAX_EXTEND
    assert isinstance(batch, row_split.SplitBatch) and len(batch.parts) == 2
    assert batch.positions.tolist() == [5, 6, 7, *range(18)] and batch.num_logits == 4
    assert batch.logits_indices.tolist() == [0, 1, 2, 20]


# ------------------------------------------------------------------ the default model


@pytest.fixture(scope="module")
def default(default_model):
    return default_model


@pytest.mark.parametrize(
    "backend, kv_dtype, page_size",
    [
        ("cpu", "float32", 1),
        ("cpu", "bfloat16", 16),
        ("cpu-generic", "fp8_e4m3", 16),
        ("torch", "float32", 1),
    ],
)
def test_verify_rows_give_the_one_row_bits_default_model(default, backend, kv_dtype, page_size):
    """The default model's packed Q4_1 / Q8_0 weights, on the best ISA, with 3 five-row requests in
    the last batch (the tiny model's test covers the ISAs, every combination and the 70-row batch:
    the default model's 30 layers make that scenario take minutes per case)."""
    _check(default.model, default.hf_config, backend, kv_dtype, page_size, seed=41, groups=3)


def _greedy_steps(reqs, name, prompt, n):
    """n greedy tokens after ``prompt`` by one-row decode steps (the prompt's last token is the
    first step), with the logits of each."""
    reqs.prefill(name, prompt[:-1])
    out, logits = [], []
    for j in range(n):
        lg = reqs.forward([(name, len(prompt) - 1 + j, [out[-1] if out else prompt[-1]])])
        logits.append(lg)
        out.append(int(lg.argmax()))
    return out, torch.cat(logits)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_greedy_with_verified_drafts_equals_one_row_decoding(default, backend):
    """Greedy decoding with k = 4 drafts verified in one forward a step (the right continuation,
    with every third draft replaced by a wrong token) emits exactly the one-row steps' tokens, and
    every accepted position's logits are the one-row step's bits."""
    loaded, k, n = default, 4, 40
    text = "Write a short story about a lighthouse keeper who finds a message in a bottle."
    prompt = loaded.tokenizer(text)["input_ids"]
    ref = Requests(_runner(loaded.model, loaded.hf_config, backend, "float32", 1, 2048), 512, ["a"], 0)
    want, want_logits = _greedy_steps(ref, "a", prompt, n)

    reqs = Requests(_runner(loaded.model, loaded.hf_config, backend, "float32", 1, 2048), 512, ["a"], 0)
    reqs.prefill("a", prompt[:-1])
    out, forwards = [], 0
    while len(out) < n:
        pos, last = len(prompt) - 1 + len(out), out[-1] if out else prompt[-1]  # pos: K/V in the pool
        drafts = [t if (len(out) + j) % 3 else (t + 1) % 49152 for j, t in enumerate(want[len(out) : len(out) + k])]
        _, prefix, _ = row_split.verify_rows(reqs.row["a"], pos, len(drafts) + 1)
        logits = reqs.forward([("a", p, [t]) for p, t in zip(prefix, [last, *drafts])])
        forwards += 1
        for j in range(len(drafts) + 1):  # row j's logits give the token after its input
            assert torch.equal(logits[j], want_logits[len(out)]), len(out)
            out.append(int(logits[j].argmax()))
            if j == len(drafts) or drafts[j] != out[-1]:
                break
    assert out == want
    assert forwards < n  # drafts were accepted: fewer forwards than tokens
