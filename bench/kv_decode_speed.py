"""Decode speed per K/V pool dtype: the fused native CPU decode step over a pool of each dtype.

For each (context, batch) asked: one ModelRunner per dtype over the same model (the CPU backend,
so decode runs the fused step), its pool filled with K/V already written in that dtype (random
rows rounded by ``kv_quantize``: attention costs the same whatever the values), ``batch``
requests of ``context`` tokens each. A trial times ``--steps`` decode steps of each dtype in turn
(``build_batch`` + ``forward`` + argmax, the order rotated every trial) and keeps each dtype's
median step; the ratios to float32 are taken within a trial (paired), then their median over
``--trials``. Wall time and the process's CPU time per step are both printed: on a shared machine
the wall time moves with the other jobs, the CPU time with the work.

    python bench/kv_decode_speed.py                                  # 256 and 4096 tokens, batch 1 and 16
    python bench/kv_decode_speed.py --contexts 4096 --batches 1 --trials 9 --dtypes float32 bfloat16 fp8_e4m3
    python bench/kv_decode_speed.py --contexts 4096 --batches 1 --llamacpp f16 q8_0   # and llama.cpp beside

``--llamacpp TYPE ...`` adds llama.cpp (llama-cpp-python over bench/llamacpp_setup.sh's build, the
same model's GGUF file, flash attention on, ``--threads`` threads) with its K/V cache in each
type, batch 1 only, in the same alternation: its context is a prefill of ``context`` random tokens
once, then each trial times ``--steps`` one-token ``eval`` calls and an argmax of the logits (the
cache cut back to ``context`` before each trial). Printed beside: radixkv bfloat16 / llama.cpp f16
and radixkv fp8_e4m3 / llama.cpp q8_0 (the pairs of equal K/V bytes), per trial and their median.

The pool is radixkv's KVPool in the dtype when it takes ``kv_cache_dtype``, else a stand-in with
the same layout (the kernels only read its tensors).
"""

from __future__ import annotations

import argparse
import inspect
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

from radixkv.executor.model_runner import ModelRunner  # noqa: E402
from radixkv.kernels import cpu  # noqa: E402
from radixkv.memory.kv_pool import KVPool  # noqa: E402
from radixkv.models import load_model  # noqa: E402


def make_pool(layers: int, hkv: int, d: int, slots: int, name: str):
    """A CPU pool of ``slots`` tokens in dtype ``name``: KVPool's own when it takes the dtype, else a
    float32-less stand-in with the contract's layout (buffers in the dtype, fp8 scales)."""
    if "kv_cache_dtype" in inspect.signature(KVPool).parameters:
        return KVPool(
            num_layers=layers, num_kv_heads=hkv, head_dim=d, num_slots=slots, page_size=1, kv_cache_dtype=name
        )
    pool = KVPool(layers, hkv, d, slots, 1, cpu.KV_DTYPES[name], "cpu")
    pool.kv_cache_dtype = name
    pool.k_scale = pool.v_scale = None
    if name in cpu.FP8_MAX:
        pool.k_scale = [torch.ones(slots, 1, hkv, dtype=torch.bfloat16) for _ in range(layers)]
        pool.v_scale = [torch.ones(slots, 1, hkv, dtype=torch.bfloat16) for _ in range(layers)]
    return pool


def fill(pool, name: str, seed: int) -> None:
    """Every slot of every layer: random K/V rows (N(0, 1)) as ``kv_quantize`` writes them (float32:
    as they are, so the script also times a build without the other dtypes)."""
    g = torch.Generator().manual_seed(seed)
    n = min(pool.num_slots, 4096)
    hkv, d = pool.num_kv_heads, pool.head_dim
    blocks = [torch.randn(n, hkv, d, generator=g) for _ in range(4)]
    blocks = [(x, None) if name == "float32" else cpu.kv_quantize(x, name) for x in blocks]
    for layer in range(pool.num_layers):
        for i, (buf, scales) in enumerate(((pool.k_buffer, pool.k_scale), (pool.v_buffer, pool.v_scale))):
            q, s = blocks[(layer + i) % 4]
            flat = buf[layer].view(pool.num_slots, hkv, d)
            for s0 in range(0, pool.num_slots, n):
                m = min(n, pool.num_slots - s0)
                flat[s0 : s0 + m].view(torch.uint8).copy_(q[:m].view(torch.uint8))
                if s is not None:
                    scales[layer].view(pool.num_slots, hkv)[s0 : s0 + m].copy_(s[:m])


class Runner:
    """A ModelRunner over a pool of one dtype with ``batch`` requests of ``context`` tokens."""

    def __init__(self, loaded, name: str, batch: int, context: int, steps: int) -> None:
        cfg = loaded.hf_config
        layers, hkv = cfg.num_hidden_layers, cfg.num_key_value_heads
        d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        per = context + steps + 1
        self.pool = make_pool(layers, hkv, d, batch * per, name)
        fill(self.pool, name, seed=1)
        self.runner = ModelRunner(
            loaded, kv_pool=self.pool, max_running_requests=batch, max_context_len=per, attention_backend="cpu"
        )
        if self.runner.decode_step is None:
            raise SystemExit("the fused decode step is not available (native kernels not built?)")
        r2t = self.runner.req_to_token_pool
        self.rows = [r2t.alloc() for _ in range(batch)]
        for i, row in enumerate(self.rows):
            r2t.write(row, 0, torch.arange(i * per, (i + 1) * per))
        self.context, self.batch = context, batch
        self.tokens = torch.full((batch,), 1000, dtype=torch.int64)

    def step(self, s: int) -> None:
        r = self.runner
        b = r.build_batch(self.tokens, self.rows, [self.context + s] * self.batch, [1] * self.batch)
        self.tokens = r.forward(b).argmax(-1)


class LlamaCpp:
    """llama.cpp decoding one request at ``context`` tokens with its K/V cache in ``cache_type``."""

    flags = ""  # llama.cpp's system_info (its build's CPU features), once one was made

    def __init__(self, gguf: str, cache_type: str, context: int, steps: int, threads: int) -> None:
        from bench.vs_llamacpp import import_llama_cpp

        llama_cpp = import_llama_cpp()
        code = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0, "f32": llama_cpp.GGML_TYPE_F32}
        self.llm = llama_cpp.Llama(
            model_path=gguf,
            n_ctx=context + steps + 8,
            n_batch=512,
            n_threads=threads,
            n_threads_batch=threads,
            flash_attn=True,
            type_k=code[cache_type],
            type_v=code[cache_type],
            verbose=False,
        )
        LlamaCpp.flags = llama_cpp.llama_print_system_info().decode().strip()
        g = torch.Generator().manual_seed(7)
        self.llm.eval(torch.randint(100, self.llm.n_vocab() - 100, (context,), generator=g).tolist())
        self.context, self.vocab, self.np = context, self.llm.n_vocab(), __import__("numpy")

    def step(self, s: int) -> None:
        if s == 0:
            self.llm.n_tokens = self.context  # eval() drops the cache past n_tokens
        logits = self.np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.vocab,))
        self.llm.eval([int(logits.argmax())])


def trial(runners: dict, steps: int, order: list[str]) -> dict[str, tuple[float, float]]:
    """Median wall and CPU seconds of a decode step, per dtype, the dtypes in ``order``."""
    out = {}
    for name in order:
        rn = runners[name]
        rn.step(0)  # warm: the plan, the RoPE table, the caches
        wall, cpu_t = [], []
        for s in range(steps):
            w0, c0 = time.perf_counter(), time.process_time()
            rn.step(s)
            wall.append(time.perf_counter() - w0)
            cpu_t.append(time.process_time() - c0)
        out[name] = (statistics.median(wall), statistics.median(cpu_t))
    return out


def measure(loaded, dtypes: list[str], batch: int, context: int, args) -> dict:
    """Time every dtype (and llama.cpp at batch 1) at one (context, batch); print the table and
    return it as a dict for the result file."""
    runners = {name: Runner(loaded, name, batch, context, args.steps) for name in dtypes}
    if batch == 1:
        for t in args.llamacpp:
            runners[f"llama.cpp {t}"] = LlamaCpp(args.gguf, t, context, args.steps, args.threads)
    base = dtypes[0]
    dtypes = list(runners)
    per_trial = []
    for t in range(args.trials):
        k = t % len(dtypes)
        order = dtypes[k:] + dtypes[:k] if t % 2 == 0 else list(reversed(dtypes[k:] + dtypes[:k]))
        per_trial.append(trial(runners, args.steps, order))
    load = os.getloadavg()[0]
    result = {"context": context, "batch": batch, "load": round(load, 2), "rows": {}, "pairs": {}}
    print(f"\ncontext {context}, batch {batch} ({args.trials} trials x {args.steps} steps, load {load:.2f})")
    print(f"{'dtype':<15}{'ms/step':>9}{'tok/s':>9}{'ratio':>8}  {'per trial':<40}{'cpu ms':>8}{'cpu ratio':>10}")
    for name in dtypes:
        wall = statistics.median(tr[name][0] for tr in per_trial)
        cpu_ms = statistics.median(tr[name][1] for tr in per_trial)
        ratios = [tr[base][0] / tr[name][0] for tr in per_trial]
        cratio = statistics.median(tr[base][1] / tr[name][1] for tr in per_trial)
        shown = ", ".join(f"{r:.2f}" for r in ratios[:8])
        result["rows"][name] = {
            "ms_per_step": round(wall * 1e3, 3),
            "tok_s": round(batch / wall, 2),
            "ratio": round(statistics.median(ratios), 3),
            "ratio_per_trial": [round(r, 3) for r in ratios],
            "cpu_ms_per_step": round(cpu_ms * 1e3, 3),
            "cpu_ratio": round(cratio, 3),
        }
        print(
            f"{name:<15}{wall * 1e3:>9.2f}{batch / wall:>9.1f}{statistics.median(ratios):>7.2f}x  {shown:<40}"
            f"{cpu_ms * 1e3:>8.2f}{cratio:>9.2f}x"
        )
    for ours, theirs in (("bfloat16", "llama.cpp f16"), ("fp8_e4m3", "llama.cpp q8_0")):
        if ours in runners and theirs in runners:
            r = [tr[theirs][0] / tr[ours][0] for tr in per_trial]
            rc = statistics.median(tr[theirs][1] / tr[ours][1] for tr in per_trial)
            result["pairs"][f"{ours} / {theirs}"] = {"ratio": round(statistics.median(r), 3), "cpu_ratio": round(rc, 3)}
            print(
                f"radixkv {ours} / {theirs}: {statistics.median(r):.2f}x tok/s (per trial "
                + ", ".join(f"{x:.2f}" for x in r)
                + f"), CPU time {rc:.2f}x"
            )
    del runners
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "fp8_e4m3"], help="the first is the base")
    ap.add_argument("--contexts", type=int, nargs="+", default=[256, 4096])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--trials", type=int, default=7)
    ap.add_argument("--steps", type=int, default=16, help="timed decode steps per dtype per trial")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llamacpp", nargs="*", default=[], help="llama.cpp K/V cache types to time beside (f16, q8_0)")
    ap.add_argument("--gguf", default=None, help="llama.cpp's model file (default: the default model's GGUF)")
    ap.add_argument("--out", default=None, help="result JSON (default bench/results/kv_decode_speed_<UTC time>.json)")
    args = ap.parse_args()
    if args.llamacpp and args.gguf is None:
        from radixkv.models.loader import default_gguf_path

        args.gguf = str(default_gguf_path())
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    for name in args.dtypes:
        if name not in cpu.KV_DTYPES:
            raise SystemExit(f"--dtypes: {name!r} is not one of {list(cpu.KV_DTYPES)}")
    loaded = load_model(args.model, device="cpu", dtype=torch.float32)
    print(
        f"model {args.model}, {torch.get_num_threads()} threads, kernels {cpu.isa()} / {cpu.threading_mode()}, "
        f"torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )
    started, results = time.time(), []
    for context in args.contexts:
        for batch in args.batches:
            results.append(measure(loaded, args.dtypes, batch, context, args))
    if LlamaCpp.flags:
        print(f"\nllama.cpp: {Path(args.gguf).name}, flash attention on, {args.threads} threads; {LlamaCpp.flags}")
    from bench.results_io import write_result

    machine = {"torch": torch.__version__, "threads": args.threads, "isa": cpu.isa(), "llama_cpp": LlamaCpp.flags}
    path = write_result("kv_decode_speed", {"results": results}, args.out, started=started, machine=machine)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
