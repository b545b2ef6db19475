"""Plots for docs/benchmarks.md from the JSON results in bench/results/ (matplotlib, PNG).

* ``docs/sim_hit_rate_vs_capacity.png``: cache-only simulation, hit rate vs cache capacity (share
  of the working set) per policy, one panel per workload, the infinite-cache bound dashed.
* ``docs/e2e_workloads.png``: end to end, per workload and policy: hit rate, prefill tokens
  computed, TTFT p50 (bar) and p90 (tick).

Usage: ``python bench/plot.py [--sim FILE ...] [--e2e FILE]`` (default: every sim_cache run, the
newest one per workload, and the newest e2e run).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
DOCS = ROOT / "docs"
COLORS = {"radix-p1": "tab:blue", "radix-p16": "tab:green", "hash-b16": "tab:orange", "none": "tab:gray"}
MARKERS = {"radix-p1": "o", "radix-p16": "s", "hash-b16": "^", "none": "x"}
# eviction variants of a base policy (bench/sim_cache.py): its colour, their own line style
VARIANT_STYLE = {
    "lfu": (":", "v"),
    "gdf": (":", "<"),
    "odds": ("-.", "D"),
    "odds1": ((0, (3, 1, 1, 1, 1, 1)), "d"),  # reuse-odds, horizon 1
    "min": ((0, (1, 1)), "."),
}


def style(policy: str) -> tuple:
    """(colour, marker, line style, base policy) of a bench policy name."""
    if policy.startswith("min-"):
        base = "radix-" + policy[len("min-") :]
        ls, mk = VARIANT_STYLE["min"]
        return "black" if base == "radix-p1" else "dimgray", mk, ls, base
    for v, (ls, mk) in VARIANT_STYLE.items():
        if policy.endswith("-" + v):
            base = policy[: -len(v) - 1]
            return COLORS.get(base, "tab:purple"), mk, ls, base
    return COLORS.get(policy, "tab:purple"), MARKERS.get(policy, "o"), "-", policy


def newest(kind: str) -> Path | None:
    files = sorted(RESULTS.glob(f"{kind}_*.json"))
    return files[-1] if files else None


def load_sim(paths: list[Path]) -> dict:
    """Merge sim_cache runs: for each workload, the newest run that has it wins."""
    data: dict = {"workloads": {}, "files": []}
    for p in sorted(paths):
        d = json.loads(p.read_text())
        for name, w in d["workloads"].items():
            w["file"] = p.name
            data["workloads"][name] = w
        data["files"].append(p.name)
    order = ["multi_turn", "few_shot", "gsp", "fork", "unique"]
    data["workloads"] = {k: data["workloads"][k] for k in sorted(data["workloads"], key=order.index)}
    return data


def plot_sim(paths: list[Path], out: Path) -> None:
    data = load_sim(paths)
    wls = list(data["workloads"])
    ncol = 3
    nrow = (len(wls) + 1 + ncol - 1) // ncol
    fig, axes = plt.subplots(nrow, ncol, figsize=(5 * ncol, 3.9 * nrow), squeeze=False)
    flat = [a for row in axes for a in row]
    for ax, name in zip(flat, wls):
        w = data["workloads"][name]
        bound = w.get("sweep_infinite", w["infinite"])
        for p, rows in w["sweep"].items():
            xs = [r["fraction"] * 100 for r in rows]
            ys = [r["hit_rate"] * 100 for r in rows]
            color, marker, ls, base = style(p)
            ax.plot(xs, ys, marker=marker, color=color, ls=ls, label=p, ms=4 if ls == "-" else 3, lw=1.2)
            if p == base and p in bound:
                ax.axhline(bound[p]["hit_rate"] * 100, color=color, ls="--", lw=0.8)
        ax.set_xscale("log")
        ax.set_xlabel("cache capacity (% of working set)")
        ax.set_ylabel("hit rate (% of prompt tokens)")
        sub = w.get("sweep_params", w["params"])
        title = name if name != "multi_turn" else f"multi_turn ({sub['n_conversations']} conv.)"
        ax.set_title(title)
        ax.grid(alpha=0.3)
    flat[0].legend(
        loc="lower right", fontsize=7, title="dashed: infinite; min-pN: Belady's MIN", title_fontsize=7, ncol=2
    )
    # last panel: hit-rate gap to the token-level tree (points), per workload
    ax = flat[len(wls)]
    for name in wls:
        sw = data["workloads"][name]["sweep"]
        if "radix-p1" not in sw:
            continue
        for p, ls in (("hash-b16", "-"), ("radix-p16", ":")):
            if p in sw:
                xs = [r["fraction"] * 100 for r in sw[p]]
                ys = [(r["hit_rate"] - b["hit_rate"]) * 100 for r, b in zip(sw[p], sw["radix-p1"])]
                ax.plot(xs, ys, ls=ls, marker=MARKERS[p], ms=3, label=f"{name} {p}")
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("cache capacity (% of working set)")
    ax.set_ylabel("hit rate minus radix-p1 (points)")
    ax.set_title("gap to the token-level tree")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    for a in flat[len(wls) + 1 :]:
        a.axis("off")
    fig.suptitle("Cache-only simulation (ShareGPT token ids): hit rate vs capacity", fontsize=11)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    print(f"wrote {out}")


def plot_e2e(path: Path, out: Path) -> None:
    data = json.loads(path.read_text())
    wls = list(data["workloads"])
    policies = [p for p in COLORS if any(p in data["workloads"][w] for w in wls)]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    width = 0.8 / len(policies)
    for k, p in enumerate(policies):
        xs = [i + (k - (len(policies) - 1) / 2) * width for i in range(len(wls))]
        cells = [data["workloads"][w].get(p) for w in wls]
        hit = [c["hit_rate"] * 100 if c else 0 for c in cells]
        pre = [c["prefill_tokens"] if c else 0 for c in cells]
        p50 = [c["ttft_p50_s"] * 1e3 if c else 0 for c in cells]
        p90 = [c["ttft_p90_s"] * 1e3 if c else 0 for c in cells]
        axes[0].bar(xs, hit, width, color=COLORS[p], label=p)
        axes[1].bar(xs, pre, width, color=COLORS[p], label=p)
        axes[2].bar(xs, p50, width, color=COLORS[p], label=p)
        axes[2].scatter(xs, p90, marker="_", color="black", s=60, zorder=3)
    for ax, lab in zip(axes, ["hit rate (% of prompt tokens)", "prefill tokens computed", "TTFT p50 (ms; tick: p90)"]):
        ax.set_xticks(range(len(wls)))
        ax.set_xticklabels(wls, rotation=15)
        ax.set_ylabel(lab)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    m = data["machine"]
    fig.suptitle(
        f"End to end, {data['model']} on {m['device']} ({m['cpus']} CPUs, {m['threads']} threads), "
        f"max_tokens {data['max_tokens']}, {data['concurrency']} in flight",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    print(f"wrote {out}")


def e2e_table(path: Path) -> str:
    """Markdown table of an e2e_workloads run (for docs/benchmarks.md)."""
    data = json.loads(path.read_text())
    lines = [
        "| workload | policy | hit rate | prefill tokens | TTFT p50 (s) | TTFT p90 (s) | output tok/s | wall (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for w, row in data["workloads"].items():
        for p, c in row.items():
            lines.append(
                f"| {w} | {p} | {c['hit_rate'] * 100:.1f}% | {c['prefill_tokens']} | {c['ttft_p50_s']:.2f} "
                f"| {c['ttft_p90_s']:.2f} | {c['output_tokens_per_s']:.2f} | {c['wall_s']:.1f} |"
            )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument(
        "--sim",
        type=Path,
        nargs="+",
        default=None,
        help="sim_cache JSON files (default: all; per workload the newest run wins)",
    )
    ap.add_argument("--e2e", type=Path, default=None)
    ap.add_argument("--table", action="store_true", help="also print the e2e results as a markdown table")
    args = ap.parse_args(argv)
    DOCS.mkdir(exist_ok=True)
    sim = args.sim or sorted(RESULTS.glob("sim_cache_*.json"))
    e2e = args.e2e or newest("e2e_workloads")
    if sim:
        plot_sim(sim, DOCS / "sim_hit_rate_vs_capacity.png")
    if e2e:
        plot_e2e(e2e, DOCS / "e2e_workloads.png")
        if args.table:
            print(e2e_table(e2e))
    if not sim and not e2e:
        print("no results in bench/results/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
