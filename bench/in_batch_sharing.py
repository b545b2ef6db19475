"""Branching workloads submitted all at once: how close does each prefix-cache policy come to
computing every distinct prompt token once?

Workloads (``bench/workloads/``, the end-to-end sizes of ``bench/e2e_workloads.py``): ``gsp``
(groups of prompts sharing a long system prompt), ``few_shot`` (questions after one shared k-shot
history) and ``fork`` (branches of one prompt, each with a follow-up on top of its reply; the
follow-ups are built on the dataset's replies so that every prompt is known up front). Every
request of a workload is submitted in one go (``Engine.add_request`` for all, then ``step``
until done): nothing is cached when they arrive, so whatever is shared must be shared between
requests waiting together.

Policies: ``radix-p1`` / ``radix-p16`` (radix tree, page 1 / 16), ``hash-b16`` (chained block
hashes, block 16), ``none`` (caching off), and ``radix-p1-off``: the radix tree with in-batch
prefix sharing turned off (``in_batch_prefix_sharing=False``: only what is cached at admission
is shared), i.e. the engine before issue 17, measured in the same run as the baseline.

Measure: ``ratio = prefill tokens computed / distinct tokens of the trie of all prompts``
(1.00 is the physical limit of prefix caching with room for everything; page-granular caches
cannot reach it, since a prefix shared up to the middle of a page is recomputed by each request
from that page's start). Also TTFT p50 / p90 (from submission), wall time, and the ratio's
steps. Greedy decoding except the fork branches (temperature 1, a seed per branch),
``ignore_eos``, ``--max-tokens`` tokens per request. Writes
``bench/results/in_batch_sharing_<UTC time>.json``; ``--plot`` draws ``docs/in_batch_sharing.png``.

Usage::

    python bench/in_batch_sharing.py            # ~3 minutes on 2 CPU cores
    python bench/in_batch_sharing.py --plot-only bench/results/in_batch_sharing_<time>.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.e2e_workloads import e2e_specs  # noqa: E402
from bench.results_io import write_result  # noqa: E402
from bench.workloads import Workload, make_workload  # noqa: E402

POLICIES = {
    "radix-p1": dict(prefix_cache="radix", page_size=1),
    "radix-p1-off": dict(prefix_cache="radix", page_size=1, in_batch_prefix_sharing=False),
    "radix-p16": dict(prefix_cache="radix", page_size=16),
    "hash-b16": dict(prefix_cache="hash", page_size=16),
    "none": dict(prefix_cache="none", page_size=16),
}
WORKLOADS = ("gsp", "few_shot", "fork")


def trie_tokens(prompts) -> int:
    """Distinct tokens of the trie of ``prompts``."""
    root: dict = {}
    n = 0
    for p in prompts:
        node = root
        for t in p:
            nxt = node.get(t)
            if nxt is None:
                nxt = node[t] = {}
                n += 1
            node = nxt
    return n


def all_prompts(wl: Workload) -> list[list[int]]:
    """Every request's full prompt, follow-ups built on the dataset's replies."""
    return [wl.full_prompt(i, None) for i in range(len(wl.requests))]


def run_all_at_once(llm, wl: Workload, prompts: list[list[int]], max_tokens: int) -> dict:
    """Submit every request, step until all finished; the cell's metrics."""
    from radixkv import SamplingParams

    engine = llm.engine
    if not engine.reset_prefix_cache():
        raise RuntimeError("could not reset the prefix cache (requests still running)")
    before = engine.cache_stats()
    branches = wl.name == "fork"
    t0 = time.perf_counter()
    rids = []
    for i, (r, p) in enumerate(zip(wl.requests, prompts)):
        branch = branches and r.parent is None
        sp = SamplingParams(
            max_tokens=max_tokens,
            ignore_eos=True,
            temperature=1.0 if branch else 0.0,
            seed=r.seed if branch else None,
        )
        rids.append(engine.add_request(p, sp, request_id=f"{wl.name}-{i}", namespace=r.namespace))
    done: dict[str, object] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        steps += 1
    wall = time.perf_counter() - t0
    engine.check_integrity()
    after = engine.cache_stats()
    ttft = np.array([done[r].metrics.ttft for r in rids], dtype=np.float64)
    distinct = trie_tokens(prompts)
    prefill = after["prefill_tokens"] - before["prefill_tokens"]
    return dict(
        requests=len(rids),
        prompt_tokens=sum(map(len, prompts)),
        distinct_tokens=distinct,
        prefill_tokens=prefill,
        ratio=prefill / distinct,
        cached_tokens=sum(done[r].num_cached_tokens for r in rids),
        ttft_p50_s=float(np.percentile(ttft, 50)),
        ttft_p90_s=float(np.percentile(ttft, 90)),
        wall_s=wall,
        steps=steps,
        evicted_tokens=after["evicted_tokens"] - before["evicted_tokens"],
    )


def plot(path: Path, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(path.read_text())
    wls = list(data["workloads"])
    policies = list(data["policies"])
    colors = {
        "radix-p1": "tab:blue",
        "radix-p1-off": "tab:purple",
        "radix-p16": "tab:green",
        "hash-b16": "tab:orange",
        "none": "tab:gray",
    }
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    width = 0.8 / len(policies)
    for k, p in enumerate(policies):
        xs = [i + (k - (len(policies) - 1) / 2) * width for i in range(len(wls))]
        cells = [data["workloads"][w][p] for w in wls]
        axes[0].bar(xs, [c["ratio"] for c in cells], width, color=colors.get(p), label=p)
        axes[1].bar(xs, [c["ttft_p50_s"] for c in cells], width, color=colors.get(p), label=p)
        axes[1].scatter(xs, [c["ttft_p90_s"] for c in cells], marker="_", color="black", s=60, zorder=3)
        axes[2].bar(xs, [c["wall_s"] for c in cells], width, color=colors.get(p), label=p)
    axes[0].axhline(1.0, color="black", lw=0.8, ls="--")
    labels = ["prefill tokens / distinct prompt tokens (1.00 = limit)", "TTFT p50 (s; tick: p90)", "wall time (s)"]
    for ax, lab in zip(axes, labels):
        ax.set_xticks(range(len(wls)))
        ax.set_xticklabels(wls)
        ax.set_ylabel(lab)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    m = data["machine"]
    fig.suptitle(
        f"All requests submitted at once: {data['model']} on {m['device']} ({m['threads']} threads), "
        f"max_tokens {data['max_tokens']}",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    print(f"wrote {out}")


def table(path: Path) -> str:
    data = json.loads(path.read_text())
    lines = [
        "| workload | policy | requests | distinct tok | prefill tok | ratio | TTFT p50 (s) | TTFT p90 (s) | wall (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for w, row in data["workloads"].items():
        for p, c in row.items():
            lines.append(
                f"| {w} | {p} | {c['requests']} | {c['distinct_tokens']} | {c['prefill_tokens']} | {c['ratio']:.2f} "
                f"| {c['ttft_p50_s']:.2f} | {c['ttft_p90_s']:.2f} | {c['wall_s']:.1f} |"
            )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS))
    ap.add_argument("--policies", nargs="+", default=list(POLICIES))
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--scale", type=int, default=1, help="multiplies the request counts")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--max-total-tokens", type=int, default=16384, help="KV pool capacity (tokens)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--plot", action="store_true", help="draw docs/in_batch_sharing.png from this run")
    ap.add_argument("--plot-only", type=Path, default=None, help="draw the plot (and print the table) of a run")
    args = ap.parse_args(argv)
    if args.plot_only:
        plot(args.plot_only, ROOT / "docs" / "in_batch_sharing.png")
        print(table(args.plot_only))
        return 0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.threads:
        torch.set_num_threads(args.threads)

    from radixkv import LLM
    from radixkv.models import load_model

    t_start = time.time()
    specs = {k: v for k, v in e2e_specs(args.scale, args.seed).items() if k in args.workloads}
    workloads = {name: make_workload(name, **kw) for name, kw in specs.items()}
    loaded = load_model(args.model, args.device, torch.float32 if args.device == "cpu" else torch.bfloat16)
    engines = {
        p: LLM(
            args.model,
            device=args.device,
            loaded_model=loaded,
            max_total_tokens=args.max_total_tokens,
            seed=args.seed,
            **POLICIES[p],
        )  # fmt: skip
        for p in args.policies
    }
    # warm-up: torch's first calls, outside the timings
    next(iter(engines.values())).generate(["warm up"], use_tqdm=False)
    cells: dict[str, dict] = {}
    for name, wl in workloads.items():
        prompts = all_prompts(wl)
        cells[name] = {}
        for p, llm in engines.items():
            res = run_all_at_once(llm, wl, prompts, args.max_tokens)
            cells[name][p] = res
            print(
                f"[{time.time() - t_start:5.0f}s] {name:9s} {p:13s} prefill {res['prefill_tokens']:6d} / "
                f"{res['distinct_tokens']:6d} distinct = {res['ratio']:.3f}  TTFT p50 {res['ttft_p50_s']:.2f} s "
                f"p90 {res['ttft_p90_s']:.2f} s  wall {res['wall_s']:.1f} s  steps {res['steps']}",
                flush=True,
            )
    out = dict(
        model=args.model,
        max_tokens=args.max_tokens,
        max_total_tokens=args.max_total_tokens,
        policies={p: POLICIES[p] for p in args.policies},
        params=specs,
        workloads=cells,
    )
    machine = dict(torch=torch.__version__, device=args.device, threads=torch.get_num_threads())
    path = write_result("in_batch_sharing", out, args.out, argv=argv, started=t_start, machine=machine)
    print(f"wrote {path} in {time.time() - t_start:.0f}s")
    if args.plot:
        plot(path, ROOT / "docs" / "in_batch_sharing.png")
        print(table(path))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
