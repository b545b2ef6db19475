"""Verify forward vs one-row decode step: what checking k drafts costs at batch 1.

Speculative decoding verifies a request's ``k`` drafts in one forward of ``k + 1`` decode rows
(the last sampled token and the drafts, at consecutive positions: ``row_split.verify_rows``). On
the CPU a one-row decode step is bound by reading the weights; the verify forward reads them once
too (the small-M GEMM of the packed Q4_1 / Q8_0 weights FMAs each decoded block into every row), so
it should cost little more than the one-row step. Target (issue 38): ``k + 1 = 5`` rows cost at
most 1.5x a one-row step, batch 1, 2 threads, on the default model as the engine loads it (the
cpu backend, its fused native decode step, page size 1, float32 K/V).

One ModelRunner, two requests with the same ``--context``-token random prompt (prefilled once):
the decode request runs one-row steps at position ``context``, the verify request forwards
``--rows`` rows at positions ``context .. context + rows - 1`` (each step rewrites the same slots,
so every step costs the same). A step is ``build_batch`` + ``forward`` + the argmax of every
logits row, as the engine does. A trial times ``--steps`` steps of each, interleaved step by step
(the order alternating), and keeps each one's median step; the ratio verify / decode is taken
within a trial (paired: load from other jobs hits both), then its median over ``--trials``. Also
printed: the ratio of the process's CPU time (which counts OpenMP's spinning at barriers, so it
grows with the machine's load) and the ratio of the fastest steps of the run (the least disturbed).

    python bench/verify_rows.py                                  # context 256, 5 rows, 2 threads
    python bench/verify_rows.py --contexts 256 1024 --rows 2 3 5 9 --trials 11
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from radixkv.executor import cpu_decode, row_split  # noqa: E402
from radixkv.executor.model_runner import ModelRunner  # noqa: E402
from radixkv.kernels import cpu  # noqa: E402
from radixkv.models import load_model  # noqa: E402


class Bench:
    """The two requests over one runner (module docstring)."""

    def __init__(self, loaded, context: int, rows: int, page_size: int, kv_dtype: str) -> None:
        per = -(-(context + rows + 1) // page_size) * page_size
        self.runner = ModelRunner(
            loaded,
            num_slots=2 * per,
            page_size=page_size,
            max_running_requests=2,
            max_context_len=per,
            attention_backend="cpu",
            kv_cache_dtype=kv_dtype,
        )
        if self.runner.decode_step is None:
            raise SystemExit("the fused decode step is not available (native kernels not built?)")
        r2t = self.runner.req_to_token_pool
        self.decode_row, self.verify_row = r2t.alloc(), r2t.alloc()
        r2t.write(self.decode_row, 0, torch.arange(0, per))
        r2t.write(self.verify_row, 0, torch.arange(per, 2 * per))
        g = torch.Generator().manual_seed(0)
        vocab = loaded.hf_config.vocab_size
        prompt = torch.randint(100, vocab - 100, (context,), generator=g).tolist()
        for row in (self.decode_row, self.verify_row):
            for i in range(0, context, 128):
                chunk = prompt[i : i + 128]
                self.runner.forward(self.runner.build_batch(chunk, [row], [i], [len(chunk)]))
        self.tokens = torch.randint(100, vocab - 100, (rows,), generator=g).tolist()
        self.context, self.rows = context, rows
        probe = self.runner.build_batch(*self._verify_args())
        if not isinstance(probe, cpu_decode.DecodeBatch):
            raise SystemExit(f"{rows} verify rows do not take the fused decode step ({type(probe).__name__})")

    def _verify_args(self):
        rows, prefix, extend = row_split.verify_rows(self.verify_row, self.context, self.rows)
        return self.tokens, rows, prefix, extend, list(range(self.rows))

    def decode(self) -> None:
        r = self.runner
        r.forward(r.build_batch(self.tokens[:1], [self.decode_row], [self.context], [1])).argmax(-1).tolist()

    def verify(self) -> None:
        r = self.runner
        r.forward(r.build_batch(*self._verify_args())).argmax(-1).tolist()


def trial(fns: dict, steps: int, flip: bool) -> dict[str, tuple[float, float, float]]:
    """Per name of ``fns``: median wall, median CPU and least wall seconds of a call, over
    ``steps`` calls each, interleaved call by call (the order flipped every call, and at the start
    when ``flip``), after one warm call each."""
    names = list(fns)
    for fn in fns.values():
        fn()
    wall: dict[str, list[float]] = {n: [] for n in names}
    cpu_t: dict[str, list[float]] = {n: [] for n in names}
    for s in range(steps):
        for n in names if (s % 2 == 0) != flip else reversed(names):
            w0, c0 = time.perf_counter(), time.process_time()
            fns[n]()
            wall[n].append(time.perf_counter() - w0)
            cpu_t[n].append(time.process_time() - c0)
    return {n: (statistics.median(wall[n]), statistics.median(cpu_t[n]), min(wall[n])) for n in names}


def measure(loaded, context: int, rows: int, args) -> dict:
    """Paired alternating trials at one (context, rows); prints a line, returns the result entry."""
    b = Bench(loaded, context, rows, args.page_size, args.kv_cache_dtype)
    per_trial = [trial({"decode": b.decode, "verify": b.verify}, args.steps, t % 2 == 1) for t in range(args.trials)]
    ratios = [tr["verify"][0] / tr["decode"][0] for tr in per_trial]
    cratios = [tr["verify"][1] / tr["decode"][1] for tr in per_trial]
    dec = statistics.median(tr["decode"][0] for tr in per_trial)
    ver = statistics.median(tr["verify"][0] for tr in per_trial)
    ratio, cratio = statistics.median(ratios), statistics.median(cratios)
    best = min(tr["verify"][2] for tr in per_trial) / min(tr["decode"][2] for tr in per_trial)
    load = os.getloadavg()[0]
    print(
        f"context {context:>5}  rows {rows:>2}  decode {dec * 1e3:7.2f} ms  verify {ver * 1e3:7.2f} ms  "
        f"ratio {ratio:5.2f}x (cpu {cratio:5.2f}x, fastest {best:5.2f}x; per trial {', '.join(f'{r:.2f}' for r in ratios[:9])})  "
        f"load {load:.1f}"
    )
    return {
        "context": context,
        "rows": rows,
        "decode_ms": round(dec * 1e3, 3),
        "verify_ms": round(ver * 1e3, 3),
        "ratio": round(ratio, 3),
        "ratio_per_trial": [round(r, 3) for r in ratios],
        "cpu_ratio": round(cratio, 3),
        "cpu_ratio_per_trial": [round(r, 3) for r in cratios],
        "fastest_ratio": round(best, 3),
        "target": args.target if rows == 5 else None,
        "meets_target": ratio <= args.target if rows == 5 else None,
        "load": round(load, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--contexts", type=int, nargs="+", default=[256])
    ap.add_argument("--rows", type=int, nargs="+", default=[5], help="verify rows (k + 1)")
    ap.add_argument("--trials", type=int, default=9)
    ap.add_argument("--steps", type=int, default=20, help="timed steps of each per trial")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--page-size", type=int, default=1)
    ap.add_argument("--kv-cache-dtype", default="float32")
    ap.add_argument("--isa", default=None, help="the kernels' ISA (avx2, avx512; default: the best)")
    ap.add_argument("--target", type=float, default=1.5, help="the 5-row target ratio")
    ap.add_argument("--out", default=None, help="result JSON (default bench/results/verify_rows_<UTC time>.json)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    if args.isa:
        cpu.set_isa(args.isa)
    loaded = load_model(args.model, device="cpu", dtype=torch.float32)
    print(
        f"model {args.model}, {torch.get_num_threads()} threads, kernels {cpu.isa()} / {cpu.threading_mode()}, "
        f"page size {args.page_size}, {args.kv_cache_dtype} K/V, {args.trials} trials x {args.steps} steps, "
        f"torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )
    started = time.time()
    results = [measure(loaded, c, r, args) for c in args.contexts for r in args.rows]
    from bench.results_io import write_result

    machine = {"torch": torch.__version__, "threads": args.threads, "isa": cpu.isa()}
    path = write_result("verify_rows", {"results": results}, args.out, started=started, machine=machine)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
