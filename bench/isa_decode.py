"""Batch-1 decode tok/s of the engine in separate, alternating processes: an A/B of kernel settings.

Each variant is a set of environment variables (default: the CPU's own ISA against
``RADIXKV_KERNELS_ISA=avx2``). Every trial is one fresh child process per variant, run one after the
other in alternating order; a child loads the model, warms up, then runs ``--reps`` requests of a
``--prompt-len``-token ShareGPT prompt and ``--gen`` greedy tokens through the engine
(``bench/vs_llamacpp.py``'s ``RadixkvStream``: ``add_request`` / ``step``, prefix cache off) and
reports its median decode tok/s (the ``gen - 1`` tokens after the first over their time) and
tokens per CPU second. The parent prints per-variant medians over the trials and each variant's
ratio to the first one, per trial and of the medians, and writes them to
``bench/results/isa_decode_<UTC time>.json`` (``--out``; bench/results_io.py).

    python bench/isa_decode.py                         # default ISA vs avx2, 5 trials
    python bench/isa_decode.py --trials 7 --threads 2
    python bench/isa_decode.py --variant new= --variant old=RADIXKV_BENCH_ROOT=/tmp/base

``RADIXKV_BENCH_ROOT=<checkout>`` in a variant imports radixkv from that checkout instead (an A/B
of two builds of the code). Timing is noisy on a shared machine: run it under ``flock -x``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(args) -> int:
    sys.path.insert(0, str(ROOT / "bench"))
    from vs_llamacpp import RadixkvStream, sharegpt_text

    alt = os.environ.get("RADIXKV_BENCH_ROOT")
    if alt:  # radixkv from another checkout
        sys.path.insert(0, alt)
    ours = RadixkvStream(args.model, args.threads)
    import radixkv
    from radixkv.kernels import cpu

    tok = ours.llm.tokenizer
    prompts = []
    for t in sharegpt_text(args.prompt_len * 6, skip=args.skip):
        ids = tok.encode(t, add_special_tokens=False)
        if len(ids) >= args.prompt_len:
            prompts.append(ids[: args.prompt_len])
        if len(prompts) == args.reps + 1:
            break
    ours.run(prompts[0][: args.prompt_len // 2], 8)  # untimed warm-up
    dec, cpu_dec, tokens = [], [], []
    for p in prompts[1:]:
        _, t_dec, toks, _, c_dec = ours.run(p, args.gen)
        dec.append((len(toks) - 1) / t_dec)
        cpu_dec.append((len(toks) - 1) / c_dec)
        tokens.append(toks)
    print(
        json.dumps(
            {
                "decode_tok_s": statistics.median(dec),
                "decode_tok_per_cpu_s": statistics.median(cpu_dec),
                "isa": cpu.isa(),
                "radixkv": str(Path(radixkv.__file__).parent),
                "tokens": tokens,
            }
        )
    )
    return 0


def parse_variant(spec: str) -> tuple[str, dict[str, str]]:
    name, _, rest = spec.partition("=")
    env = {}
    for kv in filter(None, rest.split(",")):
        k, _, v = kv.partition("=")
        env[k] = v
    return name, env


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--trials", type=int, default=5, help="processes per variant (alternating)")
    ap.add_argument("--reps", type=int, default=2, help="requests per process (its median is reported)")
    ap.add_argument("--skip", type=int, default=0)
    ap.add_argument(
        "--variant",
        action="append",
        default=None,
        help="NAME=VAR=VAL,VAR=VAL (repeatable; the first is the baseline). Default: default= avx2=RADIXKV_KERNELS_ISA=avx2",
    )
    ap.add_argument("--out", default=None, help="result JSON path (default bench/results/isa_decode_<time>.json)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(args)
    t0 = time.time()
    variants = [parse_variant(v) for v in (args.variant or ["default=", "avx2=RADIXKV_KERNELS_ISA=avx2"])]
    print(
        f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, load average {os.getloadavg()[0]:.2f}, "
        f"{args.threads} threads, {args.prompt_len}-token prompt, {args.gen} greedy tokens",
        file=sys.stderr,
    )
    rows: dict[str, list[dict]] = {n: [] for n, _ in variants}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child"]
    cmd += ["--model", args.model, "--threads", str(args.threads), "--prompt-len", str(args.prompt_len)]
    cmd += ["--gen", str(args.gen), "--reps", str(args.reps), "--skip", str(args.skip)]
    for i in range(args.trials):
        order = variants if i % 2 == 0 else variants[::-1]
        for name, env in order:
            out = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True)
            if out.returncode:
                sys.stderr.write(out.stderr[-4000:])
                raise SystemExit(f"isa_decode: variant {name} failed (rc {out.returncode})")
            r = json.loads(out.stdout.strip().splitlines()[-1])
            rows[name].append(r)
            print(
                f"trial {i} {name}: decode {r['decode_tok_s']:.1f} tok/s ({r['decode_tok_per_cpu_s']:.1f} per CPU-s), "
                f"isa {r['isa']}, {r['radixkv']}",
                file=sys.stderr,
            )
    base = variants[0][0]
    med = {n: statistics.median(r["decode_tok_s"] for r in v) for n, v in rows.items()}
    med_cpu = {n: statistics.median(r["decode_tok_per_cpu_s"] for r in v) for n, v in rows.items()}
    print(f"load average after {os.getloadavg()[0]:.2f}")
    result = {}
    for n, v in rows.items():
        per = [a["decode_tok_s"] / b["decode_tok_s"] for a, b in zip(v, rows[base])]
        same = all(a["tokens"] == b["tokens"] for a, b in zip(v, rows[base]))
        print(
            f"{n}: decode median {med[n]:.1f} tok/s ({med_cpu[n]:.1f} per CPU-s); vs {base}: {med[n] / med[base]:.3f}x "
            f"(per trial {', '.join(f'{x:.3f}' for x in per)}); greedy tokens equal to {base}'s: {same}"
        )
        trials = [{k: x for k, x in r.items() if k != "tokens"} for r in v]
        result[n] = dict(env=dict(variants)[n], decode_tok_s_median=med[n], decode_tok_per_cpu_s_median=med_cpu[n])
        result[n].update(
            ratio_to_base=med[n] / med[base], ratio_per_trial=per, tokens_equal_to_base=same, trials=trials
        )
    _write(args, argv, base, result, t0)
    return 0


def _write(args: argparse.Namespace, argv, base: str, variants: dict, started: float) -> None:
    """The result JSON (bench/results_io.py; ``--out``, default ``bench/results/isa_decode_<time>.json``).
    Imported here, not at load: a child imports radixkv from the checkout its variant names."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from bench.results_io import write_result

    fields = dict(model=args.model, threads=args.threads, prompt_len=args.prompt_len, gen=args.gen, base=base)
    path = write_result("isa_decode", {**fields, "variants": variants}, args.out, argv=argv, started=started)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
