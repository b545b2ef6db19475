"""Prefill on the native packed GEMM vs MKL's sgemm, paired in one run.

radixkv's CPU model runs every batch, prefill included, on the native kernels
(``radixkv.models.ops.native_rows``): the packed GEMM streams the lossless block formats (4.5-8.5
bits a weight) and gives bits that do not depend on the row count. Until then a batch of more than
64 rows ran torch's ops (MKL's sgemm on the float32 weights). This script times one prompt's
prefill (``ModelRunner.forward``, the whole model) both ways, in paired alternating trials in the
same process, the MKL side by restoring that 64-row limit, and reports the logits' largest
difference between the two paths and against transformers.

    python bench/prefill_path.py                          # 128, 512 and 2048 tokens, 5 trials
    python bench/prefill_path.py --lens 512 --trials 9
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

from bench.model_speed import _HF, _Ours, _tokens  # noqa: E402
from bench.results_io import write_result  # noqa: E402
from radixkv.models import load_model, ops  # noqa: E402

_NATIVE = ops.native_rows


def _mkl_rows(x: torch.Tensor) -> bool:
    """The previous rule: the native kernels for at most 64 rows, torch's ops (MKL) above."""
    return x.dim() == 2 and x.shape[0] <= 64 and _NATIVE(x)


def _logits(ours: _Ours, ids: torch.Tensor) -> torch.Tensor:
    rows = ours._setup(1, ids.shape[1])
    n = ids.shape[1]
    out = ours.runner.forward(ours.runner.build_batch(ids[0], rows, [0], [n], logits_indices=list(range(n))))
    ours._release(rows)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lens", type=int, nargs="+", default=[128, 512, 2048], help="prompt lengths (tokens)")
    ap.add_argument("--trials", type=int, default=5, help="paired trials per length (medians reported)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    started = time.time()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    loaded = load_model("smollm2-135m", device="cpu", dtype=torch.float32)
    n_max = max(args.lens)
    ours = _Ours(loaded, num_slots=n_max, max_batch=1, max_len=n_max, backend="auto")
    vocab = loaded.hf_config.vocab_size
    ours.prefill(_tokens(32, 1, vocab, 0))  # packs the weights
    rows = []
    for n in args.lens:
        ids = _tokens(n, 1, vocab, n)
        times: dict = {"native": [], "mkl": []}
        for t in range(2 * args.trials):
            path = ("native", "mkl")[(t + n) % 2]
            ops.native_rows = _NATIVE if path == "native" else _mkl_rows
            times[path].append(ours.prefill(ids))
        ops.native_rows = _mkl_rows
        mkl_logits = _logits(ours, ids[:, : min(n, 512)])
        ops.native_rows = _NATIVE
        native_logits = _logits(ours, ids[:, : min(n, 512)])
        ref = _HF(loaded.hf_dir, torch.float32).model(input_ids=ids[:, : min(n, 512)]).logits[0]
        med = {k: statistics.median(v) for k, v in times.items()}
        row = dict(
            prompt_tokens=n,
            native_tok_s=round(n / med["native"], 1),
            mkl_tok_s=round(n / med["mkl"], 1),
            ratio=round(med["mkl"] / med["native"], 3),
            native_s=[round(x, 4) for x in times["native"]],
            mkl_s=[round(x, 4) for x in times["mkl"]],
            max_abs_diff_native_vs_mkl=float((native_logits - mkl_logits).abs().max()),
            max_abs_diff_native_vs_transformers=float((native_logits - ref).abs().max()),
            max_abs_diff_mkl_vs_transformers=float((mkl_logits - ref).abs().max()),
            greedy_equal=bool(torch.equal(native_logits.argmax(-1), ref.argmax(-1))),
        )
        rows.append(row)
        print(
            f"{n:>6} tokens: native {row['native_tok_s']:>8.1f} tok/s  mkl {row['mkl_tok_s']:>8.1f} tok/s  "
            f"{row['ratio']:.2f}x  logits vs transformers: native {row['max_abs_diff_native_vs_transformers']:.2e} "
            f"mkl {row['max_abs_diff_mkl_vs_transformers']:.2e}",
            flush=True,
        )
    path = write_result(
        "prefill_path",
        dict(threads=torch.get_num_threads(), trials=args.trials, rows=rows),
        args.out,
        started=started,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
