#!/usr/bin/env python3
"""One-shot GPU check of radixkv's FlashInfer backend (run on an H200 without network).

    python bench/gpu_check.py --carry .fi --out $OUT      # on the GPU box (PYTHONPATH=.)
    python bench/gpu_check.py --cpu --out /tmp/gpu_check  # CPU dry run of the same logic

Sections (each writes into ``gpu_check.json`` as soon as it finishes, so a run killed at its
time limit still returns what it measured):

1. ``attention``: FlashInfer vs the torch backend vs a float32 reference computed straight from
   the block table, on random batches (prefill / extend with cached prefixes incl. 0 / decode;
   shuffled pages; page_size 1 and 16; 9/3 heads x 64 and 32/8 heads x 128; bf16). Passes when
   every max abs difference to the reference is below ``--atol``.
2. ``greedy``: a SmolLM2-135M-shaped and a ~1B Llama-shaped model with seeded random weights
   (the real 98 MB GGUF is over the carry limit): greedy tokens through radixkv's ModelRunner
   with FlashInfer equal the torch backend on 5 prompts (prefill in two chunks, so the extend
   path runs, then decode). Gates: the first step's logits (prefill + extend on identical
   inputs) differ by at most a quarter of their standard deviation (bf16 rounding gives a few
   percent; a wrong kernel about 100%), and a divergence passes only as a near tie: at the
   first differing step the torch backend's top-2 logit gap is at most twice the two backends'
   max logit difference there, itself within the same bound (all recorded). Also run through ``radixkv.LLM`` when the
   engine accepts a prepared ModelRunner, and against transformers' greedy ``generate``
   (reported, not gated: a different bf16 kernel stack).
3. ``speed`` (~1B model, same GPU, same run): decode tokens/s at batch 1, 32, 128 and prefill
   tokens/s for 2048-token prompts, radixkv (FlashInfer) vs transformers ``generate``.
4. ``bandwidth``: achieved KV read bandwidth of FlashInfer decode at long context (bytes of K and
   V read / kernel time) against the H200's 4.8 TB/s, page_size 1 and 16.

``gpu_check.json`` (top-level ``"passed"``) and ``gpu_check.md`` (a short table) go to ``--out``.
In ``--cpu`` mode the torch backend stands in for FlashInfer, dtype is float32 and all sizes are
tiny: it checks the script, not the kernels.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

H200_HBM_TBPS = 4.8
SMOLLM2 = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    rope_theta=100000.0,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
    rms_norm_eps=1e-5,
)
LLAMA_1B = dict(
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=7168,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    rope_theta=500000.0,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
    rms_norm_eps=1e-5,
)
TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rope_theta=10000.0,
    max_position_embeddings=1024,
    tie_word_embeddings=True,
    rms_norm_eps=1e-5,
)


def install_carry(carry: Path) -> dict:
    """pip-install the carried wheels into a private target dir and put it on sys.path."""
    site = Path(os.environ.get("RADIXKV_FI_SITE", "/tmp/radixkv_fi_site"))
    wheels = sorted(glob.glob(str(carry / "wheels" / "*.whl")))
    if not wheels:
        raise FileNotFoundError(f"no wheels under {carry}/wheels (run bench/prepare_gpu_carry.py)")
    t0 = time.time()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--no-compile",
            "--no-cache-dir",
            "--upgrade",
            "--target",
            str(site),
            *wheels,
        ],
        check=True,
    )
    sys.path.insert(0, str(site))
    os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", "/tmp/radixkv_fi_ws")
    man = carry / "manifest.json"
    return {
        "install_s": round(time.time() - t0, 1),
        "wheels": [Path(w).name for w in wheels],
        "manifest": json.loads(man.read_text()) if man.exists() else None,
    }


class Check:
    """Holds the device, the backends under test and the results; writes JSON as it goes."""

    def __init__(self, args):
        import torch

        self.torch = torch
        self.cpu = args.cpu
        self.device = torch.device("cpu" if args.cpu else "cuda")
        self.dtype = torch.float32 if args.cpu else torch.bfloat16
        self.atol = args.atol if args.atol else (1e-4 if args.cpu else 2e-2)
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.fast = "torch" if args.cpu else "flashinfer"  # backend under test
        self.res: dict = {"passed": False, "mode": "cpu-dry-run" if args.cpu else "gpu", "sections": {}}
        self.t0 = time.time()

    def log(self, msg: str) -> None:
        print(f"[{time.time() - self.t0:6.1f}s] {msg}", flush=True)

    def save(self) -> None:
        self.res["wall_s"] = round(time.time() - self.t0, 1)
        (self.out / "gpu_check.json").write_text(json.dumps(self.res, indent=1, default=str) + "\n")

    def sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()

    def backend(self, name, pool, hq, **kw):
        from radixkv.attention import create_attention_backend

        return create_attention_backend(name, self.device, pool, hq, **kw)


# ----------------------------------------------------------------------------- helpers
def paged_rows(torch, r2t, seq_lens, page_size, num_pages, gen):
    """Give each request whole pages drawn from a shuffled permutation; fill its block-table row."""
    perm = torch.randperm(num_pages, generator=gen)
    rows, k = [], 0
    for s in seq_lens:
        n = math.ceil(s / page_size)
        if k + n > num_pages:
            raise ValueError(f"pool too small: need more than {num_pages} pages")
        slots = (perm[k : k + n, None] * page_size + torch.arange(page_size)[None, :]).reshape(-1)[:s]
        k += n
        row = r2t.alloc()
        r2t.write(row, 0, slots)
        rows.append(row)
    return rows


def reference_attention(torch, pool, r2t, rows, prefix, extend, q, sm_scale):
    """float32 attention per request, reading K/V through req_to_token (not the page table)."""
    hq, hkv = q.shape[1], pool.num_kv_heads
    out, r = torch.empty(q.shape, dtype=torch.float32, device=q.device), 0
    for row, p, e in zip(rows, prefix, extend):
        slots = r2t.req_to_token[row, : p + e].long()
        kk = pool.k_slots(0)[slots].float().repeat_interleave(hq // hkv, 1)
        vv = pool.v_slots(0)[slots].float().repeat_interleave(hq // hkv, 1)
        s = torch.einsum("qhd,lhd->hql", q[r : r + e].float(), kk) * sm_scale
        mask = torch.arange(p + e, device=q.device)[None, :] > (torch.arange(e, device=q.device)[:, None] + p)
        out[r : r + e] = torch.einsum("hql,lhd->qhd", s.masked_fill(mask, float("-inf")).softmax(-1), vv)
        r += e
    return out


# ----------------------------------------------------------------------------- 1. attention
def check_attention(c: Check) -> dict:
    torch = c.torch
    from radixkv.attention.metadata import ForwardBatch
    from radixkv.memory.kv_pool import KVPool, ReqToTokenPool

    rows_out, ok = [], True
    scale = 0.1 if c.cpu else 1.0
    for hq, hkv, d in ((9, 3, 64), (32, 8, 128)):
        for ps in (1, 16):
            for kind in ("prefill", "extend", "decode"):
                g = torch.Generator().manual_seed(hash((hq, ps, kind)) % 2**31)
                bs = 8
                pmax, emax = int(3000 * scale), int(700 * scale)
                prefix = (
                    [0] * bs if kind == "prefill" else [0] + torch.randint(1, pmax, (bs - 1,), generator=g).tolist()
                )
                if kind == "decode":
                    extend = [1] * bs
                else:
                    extend = torch.randint(1, emax, (bs,), generator=g).tolist()
                    if kind == "extend":
                        extend[1] = extend[3] = 1  # decode requests inside a mixed batch
                seq = [p + e for p, e in zip(prefix, extend)]
                num_pages = sum(math.ceil(s / ps) for s in seq) + 7
                pool = KVPool(1, hkv, d, num_pages * ps, ps, c.dtype, c.device)
                r2t = ReqToTokenPool(bs, max(seq), c.device)
                rows = paged_rows(torch, r2t, seq, ps, num_pages, g)
                batch = ForwardBatch.build(
                    torch.zeros(sum(extend), dtype=torch.long),
                    rows,
                    prefix,
                    extend,
                    r2t.req_to_token,
                    ps,
                    device=c.device,
                )
                dg = torch.Generator(device=c.device).manual_seed(7)
                for buf in (pool.k_buffer[0], pool.v_buffer[0]):
                    buf.copy_(torch.randn(buf.shape, generator=dg, device=c.device, dtype=torch.float32).to(c.dtype))
                t = batch.num_tokens
                q, k, v = (torch.randn(t, h, d, generator=dg, device=c.device).to(c.dtype) for h in (hq, hkv, hkv))
                variants = [(c.fast, {})]
                if kind == "decode" and not c.cpu and hq // hkv < 4:
                    # group 3 decodes on CUDA cores by default: also check the tensor-core path
                    variants.append((c.fast, {"use_tensor_cores": True}))
                outs = {}
                for name, kw in variants + [("torch", {})]:
                    be = c.backend(name, pool, hq, **kw)
                    be.plan(batch)
                    key = name + ("" if not kw else f"_tc{int(kw['use_tensor_cores'])}")
                    outs[key] = be.forward(0, q, k, v).float()
                ref = reference_attention(torch, pool, r2t, rows, prefix, extend, q, 1.0 / math.sqrt(d))
                diffs = {f"{k_}_vs_f32": float((o - ref).abs().max()) for k_, o in outs.items()}
                diffs[f"{c.fast}_vs_torch"] = float((outs[c.fast] - outs["torch"]).abs().max())
                passed = all(v_ < c.atol for k_, v_ in diffs.items() if k_.endswith("_vs_f32"))
                ok &= passed
                rows_out.append(
                    {
                        "heads": f"{hq}/{hkv}x{d}",
                        "page_size": ps,
                        "kind": kind,
                        "batch": bs,
                        "prefix_lens": prefix,
                        "extend_lens": extend,
                        **diffs,
                        "passed": passed,
                    }
                )
                c.log(
                    f"attention {hq}/{hkv}x{d} ps={ps} {kind:7s} "
                    + " ".join(f"{k_}={v_:.2e}" for k_, v_ in diffs.items())
                    + f" {'ok' if passed else 'FAIL'}"
                )
    return {"passed": ok, "atol": c.atol, "cases": rows_out}


# ----------------------------------------------------------------------------- models
def build_pair(c: Check, cfg_kwargs: dict, seed: int):
    """A transformers LlamaForCausalLM with seeded random weights and the radixkv model holding
    the same weights (both on the device, in the check's dtype)."""
    torch = c.torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from radixkv.models.layers import RotaryEmbedding
    from radixkv.models.registry import get_model_class

    cfg = LlamaConfig(**cfg_kwargs, architectures=["LlamaForCausalLM"], bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    with torch.device(c.device):
        hf = LlamaForCausalLM(cfg)
    hf = hf.to(c.dtype).eval()
    with torch.device("meta"):
        ours = get_model_class(cfg)(cfg)
    ours = ours.to_empty(device=c.device).to(c.dtype)
    ours.model.rotary_emb = RotaryEmbedding(cfg).to(c.device)
    ours.load_weights(hf.state_dict().items())
    return cfg, hf, ours.eval()


class Driver:
    """Drives a ModelRunner without the engine: shuffled pages, chunked prefill, greedy decode."""

    def __init__(self, c: Check, runner, seed: int = 0):
        self.c, self.runner, self.seed = c, runner, seed

    def generate(self, prompts, max_new, chunks=2, keep_logits=False, time_decode=False):
        torch = self.c.torch
        r = self.runner
        ps = r.page_size
        g = torch.Generator().manual_seed(self.seed)
        seq = [len(p) + max_new for p in prompts]
        rows = paged_rows(torch, r.req_to_token_pool, seq, ps, r.kv_pool.num_pages, g)
        try:
            done = [0] * len(prompts)
            logits = None
            for ci in range(chunks):  # prefill in `chunks` pieces: piece 2+ is an extend
                ext = [math.ceil(len(p) * (ci + 1) / chunks) - d for p, d in zip(prompts, done)]
                ids = [t for p, d, e in zip(prompts, done, ext) for t in p[d : d + e]]
                logits = r.forward(r.build_batch(ids, rows, done, ext))
                done = [d + e for d, e in zip(done, ext)]
            toks = [logits.argmax(-1)]
            hist = [logits] if keep_logits else []
            self.c.sync()
            t0 = time.perf_counter()
            for _ in range(max_new - 1):
                batch = r.build_batch(toks[-1], rows, done, [1] * len(prompts))
                logits = r.forward(batch)
                toks.append(logits.argmax(-1))
                if keep_logits:
                    hist.append(logits)
                done = [d + 1 for d in done]
            self.c.sync()
            dt = time.perf_counter() - t0
        finally:
            for row in rows:
                r.req_to_token_pool.free(row)
        out = torch.stack(toks, 1).tolist()
        return (out, hist, dt) if (keep_logits or time_decode) else out


def make_runner(c, model, cfg, backend, num_slots, page_size=1, max_rows=256):
    from radixkv.executor.model_runner import ModelRunner

    return ModelRunner(
        model,
        cfg,
        num_slots=num_slots,
        page_size=page_size,
        max_running_requests=max_rows,
        max_context_len=min(num_slots, int(cfg.max_position_embeddings)),
        attention_backend=backend,
    )


def compare_greedy(c: Check, name: str, cfg_kwargs: dict, prompts, max_new: int, page_size: int) -> dict:
    torch = c.torch
    cfg, hf, ours = build_pair(c, cfg_kwargs, seed=1234)
    slots = (sum(len(p) + max_new for p in prompts) // page_size + 2 * len(prompts) + 8) * page_size
    res = {
        "model": name,
        "page_size": page_size,
        "max_new_tokens": max_new,
        "prompt_lens": [len(p) for p in prompts],
        "params_m": round(sum(p.numel() for p in ours.parameters()) / 1e6, 1),
    }
    runs = {}
    for be in (c.fast, "torch"):
        runner = make_runner(c, ours, cfg, be, slots, page_size)
        res[f"{be}_backend_class"] = type(runner.attn_backend).__name__
        runs[be] = Driver(c, runner).generate(prompts, max_new, keep_logits=True)
        del runner
    (tf, hist_f, _), (tt, hist_t, _) = runs[c.fast], runs["torch"]
    # noise scale: a correct kernel changes logits by bf16 rounding only (a few % of their spread);
    # a wrong one by about their spread. Gate every compared step at a quarter of the spread.
    spread = float(hist_t[0].std())
    res["logit_std_step0"] = spread
    res["max_logit_diff_bound"] = 0.25 * spread
    per, ok = [], True
    for b in range(len(prompts)):
        div = next((s for s in range(max_new) if tf[b][s] != tt[b][s]), None)
        entry = {"prompt": b, "equal": div is None}
        if div is not None:
            lt, lf = hist_t[div][b], hist_f[div][b]
            top = lt.topk(2)
            gap = float(top.values[0] - top.values[1])
            diff = float((lt - lf).abs().max())
            near_tie = gap <= 2 * diff and diff <= 0.25 * spread
            entry.update(
                {
                    "first_divergence": div,
                    "torch_top2": top.indices.tolist(),
                    "torch_top2_gap": gap,
                    "fast_token": tf[b][div],
                    "max_logit_diff_at_step": diff,
                    "near_tie": near_tie,
                }
            )
            ok &= near_tie
        per.append(entry)
    same = [s for s in range(max_new) if all(tf[b][s] == tt[b][s] for b in range(len(prompts)))]
    res["max_logit_diff_step0"] = float(max((hist_t[0][b] - hist_f[0][b]).abs().max() for b in range(len(prompts))))
    ok &= res["max_logit_diff_step0"] <= 0.25 * spread  # prefill + extend, identical inputs
    res["prompts"] = per
    res["all_equal"] = all(e["equal"] for e in per)
    res["passed"] = ok
    res["equal_steps_all_prompts"] = len(same)
    # transformers greedy generate on the same weights: reported, not gated
    try:
        hf_out = []
        for p in prompts:
            ids = torch.tensor([p], device=c.device)
            o = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                pad_token_id=0,
            )
            hf_out.append(o[0, len(p) :].tolist())
        res["transformers_equal_prompts"] = sum(a == b for a, b in zip(hf_out, tt))
        res["transformers_matching_prefix_tokens"] = [
            next((s for s in range(max_new) if a[s] != b[s]), max_new) for a, b in zip(hf_out, tt)
        ]
    except Exception as exc:  # noqa: BLE001 - reported
        res["transformers_error"] = f"{type(exc).__name__}: {exc}"
    # the engine (radixkv.LLM) over a prepared runner, when it accepts one
    try:
        from radixkv import LLM, SamplingParams

        runner = make_runner(c, ours, cfg, c.fast, slots * 2, page_size)
        llm = LLM(
            model_runner=runner,
            tokenizer=None,
            eos_token_ids=[],
            max_total_tokens=runner.kv_pool.num_slots,
            page_size=page_size,
            attention_backend=c.fast,
        )
        outs = llm.generate(
            prompt_token_ids=prompts,
            sampling_params=SamplingParams(max_tokens=max_new, temperature=0, ignore_eos=True),
            use_tqdm=False,
        )
        eng = [list(o.outputs[0].token_ids) for o in outs]
        res["engine_equal_prompts"] = sum(a == b for a, b in zip(eng, tf))
        del llm, runner
    except Exception as exc:  # noqa: BLE001 - reported, the engine is optional here
        res["engine_error"] = f"{type(exc).__name__}: {exc}"[:300]
    del hf, ours
    if c.device.type == "cuda":
        torch.cuda.empty_cache()
    c.log(
        f"greedy {name} ps={page_size}: all_equal={res['all_equal']} passed={ok} "
        f"step0 logit diff={res['max_logit_diff_step0']:.3e} hf_equal={res.get('transformers_equal_prompts')} "
        f"engine_equal={res.get('engine_equal_prompts', res.get('engine_error'))}"
    )
    return res


def check_greedy(c: Check) -> dict:
    torch = c.torch
    g = torch.Generator().manual_seed(99)
    out = {"runs": []}
    if c.cpu:
        specs = [("tiny", TINY, 1), ("tiny", TINY, 16)]
    else:
        specs = [
            ("smollm2-135m-shape", SMOLLM2, 1),
            ("smollm2-135m-shape", SMOLLM2, 16),
            ("llama-1b-shape", LLAMA_1B, 1),
        ]
    lens = [17, 64, 200, 333, 512] if not c.cpu else [5, 9, 17, 30, 41]
    for name, cfg, ps in specs:
        prompts = [torch.randint(3, cfg["vocab_size"], (n,), generator=g).tolist() for n in lens]
        out["runs"].append(compare_greedy(c, name, cfg, prompts, 32 if not c.cpu else 8, ps))
        c.save()
    out["passed"] = all(r["passed"] for r in out["runs"])
    return out


# ----------------------------------------------------------------------------- 3. speed
def check_speed(c: Check) -> dict:
    torch = c.torch
    cfg_kw = TINY if c.cpu else LLAMA_1B
    cfg, hf, ours = build_pair(c, cfg_kw, seed=5)
    res = {
        "model": "llama-1b-shape" if not c.cpu else "tiny",
        "params_m": round(sum(p.numel() for p in ours.parameters()) / 1e6, 1),
        "decode": [],
        "prefill": [],
    }
    g = torch.Generator().manual_seed(3)
    plen, new = (128, 64) if not c.cpu else (16, 8)
    batches = (1, 32, 128) if not c.cpu else (1, 4)
    runner = make_runner(c, ours, cfg, c.fast, num_slots=max(batches) * (plen + new) + 4 * 2048 + 4096)
    drv = Driver(c, runner)

    def hf_gen(ids, n):
        c.sync()
        t0 = time.perf_counter()
        hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
        c.sync()
        return time.perf_counter() - t0

    for bs in batches:
        prompts = [torch.randint(3, cfg.vocab_size, (plen,), generator=g).tolist() for _ in range(bs)]
        drv.generate(prompts, 4, time_decode=True)  # warm-up
        _, _, dt = drv.generate(prompts, new + 1, time_decode=True)
        ids = torch.tensor(prompts, device=c.device)
        hf_gen(ids, 2)  # warm-up
        t_hf = hf_gen(ids, new + 1) - hf_gen(ids, 1)
        row = {
            "batch": bs,
            "prompt_len": plen,
            "decode_steps": new,
            "radixkv_tok_s": bs * new / dt,
            "transformers_tok_s": bs * new / t_hf,
        }
        row["speedup"] = row["radixkv_tok_s"] / row["transformers_tok_s"]
        res["decode"].append(row)
        c.log(
            f"decode bs={bs}: radixkv {row['radixkv_tok_s']:.0f} tok/s, transformers "
            f"{row['transformers_tok_s']:.0f} tok/s (x{row['speedup']:.2f})"
        )
    n_p, L = (4, 2048) if not c.cpu else (2, 64)
    prompts = [torch.randint(3, cfg.vocab_size, (L,), generator=g).tolist() for _ in range(n_p)]
    drv.generate(prompts, 1, chunks=1)  # warm-up
    c.sync()
    t0 = time.perf_counter()
    for _ in range(3):
        drv.generate(prompts, 1, chunks=1)
    c.sync()
    t_ours = (time.perf_counter() - t0) / 3
    ids = torch.tensor(prompts, device=c.device)
    hf_gen(ids, 1)
    t_hf = min(hf_gen(ids, 1) for _ in range(3))
    row = {"prompts": n_p, "prompt_len": L, "radixkv_tok_s": n_p * L / t_ours, "transformers_tok_s": n_p * L / t_hf}
    row["speedup"] = row["radixkv_tok_s"] / row["transformers_tok_s"]
    res["prefill"].append(row)
    c.log(
        f"prefill {n_p}x{L}: radixkv {row['radixkv_tok_s']:.0f} tok/s, transformers {row['transformers_tok_s']:.0f} "
        f"tok/s (x{row['speedup']:.2f})"
    )
    del runner, drv, ours
    if c.device.type == "cuda":
        torch.cuda.empty_cache()
    res["passed"] = True  # figures, not gates
    return res


# ----------------------------------------------------------------------------- 4. bandwidth
def check_bandwidth(c: Check) -> dict:
    torch = c.torch
    from radixkv.attention.metadata import ForwardBatch
    from radixkv.memory.kv_pool import KVPool, ReqToTokenPool

    out = {"peak_tbps": H200_HBM_TBPS, "cases": []}
    shapes = [(32, 8, 128, 16, 32768), (9, 3, 64, 64, 16384)] if not c.cpu else [(4, 2, 16, 2, 256)]
    for hq, hkv, d, bs, ctx in shapes:
        for ps in (1, 16):
            pool = KVPool(1, hkv, d, bs * ctx + 16 * ps, ps, c.dtype, c.device)
            r2t = ReqToTokenPool(bs, ctx, c.device)
            g = torch.Generator().manual_seed(1)
            rows = paged_rows(torch, r2t, [ctx] * bs, ps, pool.num_pages, g)
            batch = ForwardBatch.build(
                torch.zeros(bs, dtype=torch.long), rows, [ctx - 1] * bs, [1] * bs, r2t.req_to_token, ps, device=c.device
            )
            q = torch.randn(bs, hq, d, device=c.device).to(c.dtype)
            kv = torch.randn(bs, hkv, d, device=c.device).to(c.dtype)
            kv_bytes = 2 * bs * ctx * hkv * d * pool.k_buffer[0].element_size()
            names = [c.fast] + (["torch"] if ps == 1 and c.fast != "torch" else [])
            for name in names:
                be = c.backend(name, pool, hq)
                be.plan(batch)
                for _ in range(3):
                    be.forward(0, q, kv, kv)
                iters = 20 if not c.cpu else 2
                c.sync()
                t0 = time.perf_counter()
                for _ in range(iters):
                    be.forward(0, q, kv, kv)
                c.sync()
                dt = (time.perf_counter() - t0) / iters
                row = {
                    "backend": name,
                    "heads": f"{hq}/{hkv}x{d}",
                    "page_size": ps,
                    "batch": bs,
                    "context": ctx,
                    "kv_gb": kv_bytes / 1e9,
                    "us_per_call": dt * 1e6,
                    "tbps": kv_bytes / dt / 1e12,
                }
                row["fraction_of_peak"] = row["tbps"] / H200_HBM_TBPS
                out["cases"].append(row)
                c.log(
                    f"bandwidth {name} {hq}/{hkv}x{d} ps={ps} bs={bs} ctx={ctx}: {dt * 1e6:.0f} us, "
                    f"{row['tbps']:.2f} TB/s ({100 * row['fraction_of_peak']:.0f}% of {H200_HBM_TBPS})"
                )
                del be
            del pool, r2t
            if c.device.type == "cuda":
                torch.cuda.empty_cache()
    out["passed"] = True
    return out


# ----------------------------------------------------------------------------- report
def write_table(c: Check) -> None:
    r, s = c.res, c.res["sections"]
    lines = [
        f"# radixkv GPU check ({r['mode']}): passed={r['passed']}",
        "",
        f"device: {r.get('device')}; versions: {json.dumps(r.get('versions'))}",
        "",
    ]
    if "attention" in s and "cases" in s["attention"]:
        lines += [
            "| heads | page | kind | fast vs f32 | torch vs f32 | fast vs torch | ok |",
            "|---|---|---|---|---|---|---|",
        ]
        for x in s["attention"]["cases"]:
            lines.append(
                f"| {x['heads']} | {x['page_size']} | {x['kind']} | {x[c.fast + '_vs_f32']:.1e} | "
                f"{x['torch_vs_f32']:.1e} | {x[c.fast + '_vs_torch']:.1e} | {x['passed']} |"
            )
        lines.append("")
    if "greedy" in s and "runs" in s["greedy"]:
        lines += ["| model | page | all 5 equal | passed | hf equal | engine equal |", "|---|---|---|---|---|---|"]
        for x in s["greedy"]["runs"]:
            lines.append(
                f"| {x['model']} | {x['page_size']} | {x['all_equal']} | {x['passed']} | "
                f"{x.get('transformers_equal_prompts')} | {x.get('engine_equal_prompts', 'n/a')} |"
            )
        lines.append("")
    if "speed" in s and "decode" in s["speed"]:
        lines += ["| phase | batch | radixkv tok/s | transformers tok/s | x |", "|---|---|---|---|---|"]
        for x in s["speed"]["decode"]:
            lines.append(
                f"| decode | {x['batch']} | {x['radixkv_tok_s']:.0f} | {x['transformers_tok_s']:.0f} | {x['speedup']:.2f} |"
            )
        for x in s["speed"]["prefill"]:
            lines.append(
                f"| prefill {x['prompt_len']} | {x['prompts']} | {x['radixkv_tok_s']:.0f} | "
                f"{x['transformers_tok_s']:.0f} | {x['speedup']:.2f} |"
            )
        lines.append("")
    if "bandwidth" in s and "cases" in s["bandwidth"]:
        lines += ["| backend | heads | page | batch x ctx | us | TB/s | % of 4.8 |", "|---|---|---|---|---|---|---|"]
        for x in s["bandwidth"]["cases"]:
            lines.append(
                f"| {x['backend']} | {x['heads']} | {x['page_size']} | {x['batch']}x{x['context']} | "
                f"{x['us_per_call']:.0f} | {x['tbps']:.2f} | {100 * x['fraction_of_peak']:.0f} |"
            )
    (c.out / "gpu_check.md").write_text("\n".join(lines) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description="radixkv FlashInfer GPU check (see module docstring)")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results/tmp/gpu_check"))
    ap.add_argument("--carry", default=None, help="folder made by bench/prepare_gpu_carry.py (e.g. .fi)")
    ap.add_argument("--cpu", action="store_true", help="dry run on CPU with the torch backend, tiny sizes")
    ap.add_argument("--atol", type=float, default=None, help="bound on max |backend - f32 reference|")
    ap.add_argument("--sections", default="attention,greedy,speed,bandwidth")
    args = ap.parse_args()
    carry_info = install_carry(Path(args.carry)) if args.carry else None
    c = Check(args)
    torch = c.torch
    import transformers

    c.res["versions"] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
    }
    c.res["carry"] = carry_info
    if not c.cpu:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device (use --cpu for a dry run)")
        import flashinfer

        c.res["versions"]["flashinfer"] = flashinfer.__version__
        aot = Path(flashinfer.__file__).parent / "data" / "aot"
        c.res["aot_modules"] = sorted(p.name for p in aot.iterdir()) if aot.is_dir() else []
        c.res["device"] = torch.cuda.get_device_name(0)
        from radixkv.memory.kv_pool import KVPool

        c.res["auto_backend"] = c.backend("auto", KVPool(1, 3, 64, 16, 1, c.dtype, c.device), 9).name
    else:
        c.res["device"] = "cpu"
    c.log(f"device {c.res['device']} versions {c.res['versions']}")
    fns = {"attention": check_attention, "greedy": check_greedy, "speed": check_speed, "bandwidth": check_bandwidth}
    for name in args.sections.split(","):
        try:
            c.res["sections"][name] = fns[name](c)
        except Exception as exc:  # noqa: BLE001 - record and go on with the other sections
            traceback.print_exc()
            c.res["sections"][name] = {"passed": False, "error": f"{type(exc).__name__}: {exc}"}
        c.save()
    if not c.cpu:
        # which modules were loaded from the carried AOT .so files vs compiled here
        ws = Path(os.environ.get("FLASHINFER_WORKSPACE_BASE", str(Path.home())))
        c.res["jit_built_here"] = sorted(p.name for p in ws.glob(".cache/flashinfer/*/*/cached_ops/*") if p.is_dir())
    c.res["passed"] = all(sec.get("passed") for sec in c.res["sections"].values()) and (
        c.cpu or c.res.get("auto_backend") == "flashinfer"
    )
    c.save()
    write_table(c)
    c.log(f"passed={c.res['passed']} -> {c.out}/gpu_check.json")
    print((c.out / "gpu_check.md").read_text())
    return 0 if c.res["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
