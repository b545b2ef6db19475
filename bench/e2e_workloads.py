"""End-to-end workload benchmark: every workload x prefix-cache policy through ``radixkv.LLM``.

Policies: ``radix-p1`` (radix tree, page_size 1), ``radix-p16`` (radix tree, page_size 16),
``hash-b16`` (vLLM-style chained block hashes, block 16), ``none`` (prefix caching off). One
engine per policy (default model, SmolLM2-135M-Instruct, on the chosen device), all loaded first;
each workload then runs on every policy back to back, and the prefix cache is reset before every
(workload, policy) cell, so each starts cold.

Client: at most ``--concurrency`` requests in flight and ``--arrivals-per-step`` (1) new ones per
engine step, so arrivals are staggered (a shared prefix is cached after its first prefill before
the next request that needs it arrives). Submitting everything at once is measured by
``bench/in_batch_sharing.py`` (in-batch prefix sharing computes what requests waiting together
share once). Requests are submitted in the workload's arrival order once a slot is
free and their parent (if any) has finished; a
follow-up's prompt is built from the parent's *generated* tokens for workloads whose history is
generated (fork), from the dataset replies otherwise (multi_turn). Greedy decoding except for
the fork branches (temperature 1 with a per-branch seed, so branches differ), ``ignore_eos`` so
every request generates exactly ``--max-tokens`` tokens.

Per cell: hit rate (sum of ``num_cached_tokens`` / prompt tokens), prefill tokens computed
(``cache_stats()["prefill_tokens"]``), TTFT p50 / p90 (``RequestMetrics.ttft``), output tokens/s
and wall time. Writes ``bench/results/e2e_workloads_<UTC time>.json``.

Usage::

    python bench/e2e_workloads.py                 # small sizes, ~10 minutes on 2 CPU cores
    python bench/e2e_workloads.py --device cuda --scale 8
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.results_io import write_result  # noqa: E402
from bench.workloads import Workload, make_workload  # noqa: E402

POLICIES = {
    "radix-p1": dict(prefix_cache="radix", page_size=1),
    "radix-p16": dict(prefix_cache="radix", page_size=16),
    "hash-b16": dict(prefix_cache="hash", page_size=16),
    "none": dict(prefix_cache="none", page_size=16),
}


def e2e_specs(scale: int, seed: int) -> dict[str, dict]:
    """Workload sizes for the end-to-end run (``scale`` multiplies the request counts)."""
    return {
        "multi_turn": dict(
            n_conversations=4 * scale, concurrency=4 * scale, max_turns=3, max_context=1024, reply_cap=64, seed=seed
        ),
        "few_shot": dict(n=8 * scale, k=5, shot_q=48, shot_a=32, question_len=48, reply_len=16, seed=seed),
        "gsp": dict(groups=2, prompts_per_group=4 * scale, system_len=256, question_len=48, reply_len=16, seed=seed),
        "fork": dict(
            roots=2 * scale, branches=4, prompt_len=192, branch_len=16, followup_len=32, reply_len=16, seed=seed
        ),
        "unique": dict(n=8 * scale, prompt_len=128, reply_len=16, seed=seed),
    }


def run_workload(llm, wl: Workload, max_tokens: int, concurrency: int, arrivals_per_step: int = 1) -> dict:
    """Serve ``wl`` on ``llm``'s engine with a closed-loop client; returns the cell's metrics."""
    from radixkv import SamplingParams

    engine = llm.engine
    if not engine.reset_prefix_cache():
        raise RuntimeError("could not reset the prefix cache (requests still running)")
    before = engine.cache_stats()
    generated_hist = wl.params.get("history") == "generated"
    outputs: dict[int, list[int]] = {}
    done: set[int] = set()
    in_flight: dict[str, int] = {}
    nxt = 0
    pending = list(range(len(wl.requests)))
    ttft, cached, prompt_tokens, gen_tokens = [], 0, 0, 0
    t0 = time.perf_counter()
    while pending or in_flight:
        submitted = []
        for i in pending:
            if len(in_flight) >= concurrency or len(submitted) >= arrivals_per_step:
                break
            r = wl.requests[i]
            if r.parent is not None and r.parent not in done:
                continue
            prompt = wl.full_prompt(i, outputs if generated_hist else None)
            is_branch = generated_hist and r.parent is None
            sp = SamplingParams(
                max_tokens=max_tokens,
                ignore_eos=True,
                temperature=1.0 if is_branch else 0.0,
                seed=r.seed if is_branch else None,
            )
            rid = engine.add_request(prompt, sp, request_id=f"{wl.name}-{i}", namespace=r.namespace)
            in_flight[rid] = i
            submitted.append(i)
        for i in submitted:
            pending.remove(i)
        for out in engine.step():
            if not out.finished:
                continue
            i = in_flight.pop(out.request_id)
            done.add(i)
            outputs[i] = list(out.outputs[0].token_ids)
            ttft.append(out.metrics.ttft)
            cached += out.num_cached_tokens
            prompt_tokens += len(out.prompt_token_ids)
            gen_tokens += len(out.outputs[0].token_ids)
        nxt += 1
    wall = time.perf_counter() - t0
    after = engine.cache_stats()
    engine.check_integrity()
    t = np.array(ttft, dtype=np.float64)
    return dict(
        requests=len(wl.requests),
        prompt_tokens=prompt_tokens,
        cached_tokens=cached,
        hit_rate=cached / max(prompt_tokens, 1),
        prefill_tokens=after["prefill_tokens"] - before["prefill_tokens"],
        generated_tokens=gen_tokens,
        ttft_p50_s=float(np.percentile(t, 50)),
        ttft_p90_s=float(np.percentile(t, 90)),
        ttft_mean_s=float(t.mean()),
        output_tokens_per_s=gen_tokens / wall,
        wall_s=wall,
        steps=nxt,
        evicted_tokens=after["evicted_tokens"] - before["evicted_tokens"],
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", nargs="+", default=["multi_turn", "few_shot", "gsp", "fork", "unique"])
    ap.add_argument("--policies", nargs="+", default=list(POLICIES))
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--scale", type=int, default=1, help="multiplies the request counts")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=16, help="requests in flight (closed loop)")
    ap.add_argument(
        "--arrivals-per-step",
        type=int,
        default=1,
        help="new requests submitted per engine step (staggered arrivals; bench/in_batch_sharing.py "
        "submits everything at once)",
    )
    ap.add_argument("--max-total-tokens", type=int, default=8192, help="KV pool capacity (tokens)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.threads:
        torch.set_num_threads(args.threads)

    from radixkv import LLM

    t_start = time.time()
    specs = {k: v for k, v in e2e_specs(args.scale, args.seed).items() if k in args.workloads}
    workloads = {name: make_workload(name, **kw) for name, kw in specs.items()}
    cells: dict[str, dict[str, dict]] = {name: {} for name in workloads}
    # All engines first, then each workload on every policy back to back, so that a change in
    # machine load (a shared box) hits the policies of one workload alike.
    engines, load_s = {}, {}
    for policy in args.policies:
        t = time.time()
        engines[policy] = LLM(
            args.model, device=args.device, max_total_tokens=args.max_total_tokens, seed=args.seed, **POLICIES[policy]
        )
        load_s[policy] = round(time.time() - t, 1)
    for name, wl in workloads.items():
        for policy, llm in engines.items():
            res = run_workload(llm, wl, args.max_tokens, args.concurrency, args.arrivals_per_step)
            res["engine_load_s"] = load_s[policy]
            cells[name][policy] = res
            print(
                f"[{time.time() - t_start:6.0f}s] {name:10s} {policy:9s} hit {res['hit_rate']:.3f} "
                f"prefill {res['prefill_tokens']:6d} TTFT p50 {res['ttft_p50_s'] * 1e3:7.1f} ms "
                f"p90 {res['ttft_p90_s'] * 1e3:7.1f} ms  {res['output_tokens_per_s']:6.1f} tok/s  "
                f"wall {res['wall_s']:6.1f}s",
                flush=True,
            )
    del engines
    gc.collect()
    # speedups against "none", measured in this run
    for row in cells.values():
        base = row.get("none")
        if base:
            for r in row.values():
                r["ttft_p50_vs_none"] = base["ttft_p50_s"] / r["ttft_p50_s"]
                r["wall_vs_none"] = base["wall_s"] / r["wall_s"]
    out = dict(
        arrivals_per_step=args.arrivals_per_step,
        model=args.model,
        max_tokens=args.max_tokens,
        concurrency=args.concurrency,
        max_total_tokens=args.max_total_tokens,
        params=specs,
        workloads=cells,
    )
    machine = dict(torch=torch.__version__, device=args.device, threads=torch.get_num_threads())
    path = write_result("e2e_workloads", out, args.out, argv=argv, started=t_start, machine=machine)
    print(f"wrote {path} in {time.time() - t_start:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
