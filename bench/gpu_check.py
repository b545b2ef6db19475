#!/usr/bin/env python3
"""One-shot GPU check of radixkv's FlashInfer backend (run on an H200 without network).

    python bench/gpu_check.py --carry .fi --out $OUT      # on the GPU box (PYTHONPATH=.), via gpu_check.sh
    python bench/gpu_check.py --cpu --out /tmp/gpu_check  # CPU dry run of the same logic

Set-up (every step recorded under ``"setup"`` in the JSON, with the traceback of a failure;
``passed`` is then false): ``FLASHINFER_DISABLE_JIT=1`` (unless ``--allow-jit``) so a missing or
unloadable prebuilt module fails loudly instead of compiling, one ``FLASHINFER_WORKSPACE_BASE``
(default ``/tmp/radixkv_fi_ws``; ``gpu_check.sh`` exports it for the pytest step too), the
toolchain a JIT fallback would need (``which nvcc ninja``, ``$CUDA_HOME/lib64``,
``lib64/stubs/libcuda.so``), the carry verified against its manifest
(``prepare_gpu_carry.verify_carry``) and pip-installed, CUDA, ``import flashinfer``, and the
``attention_backend="auto"`` probe. Sections run only when torch, radixkv, CUDA and flashinfer
are there; otherwise the JSON says which step failed.

Sections, in this order, each with a time cap (``SECTION_CAPS_S``; the engine's cap is reserved,
so the earlier sections cannot eat it), inside one budget (``--budget``, 210 s on the GPU).
Results are written into the section's dict while it runs and ``gpu_check.json`` is saved after
every case, after every section, on a section's timeout (SIGALRM), on SIGTERM (``timeout``) and,
if the main thread is stuck in native code, by a watchdog thread shortly after the budget:

1. ``attention`` (gate): FlashInfer and the torch backend vs a float32 reference computed
   straight from the block table, on random batches (prefill / extend with cached prefixes incl.
   0 / decode; shuffled pages; page_size 1 and 16; 9/3 heads x 64 and 32/8 heads x 128; bf16).
   Passes when every max abs difference to the reference is below ``--atol``.
2. ``greedy`` (gate): a SmolLM2-135M-shaped and a ~1B Llama-shaped model with seeded random
   weights: greedy tokens through radixkv's ModelRunner with FlashInfer vs the torch backend on 5
   prompts (prefill in two chunks, so the extend path runs, then decode); rule in
   :func:`greedy_gate`. Also run through ``radixkv.LLM`` and transformers' greedy ``generate``
   (reported, not gated).
3. ``speed`` (figures): decode tokens/s at batch 1, 32, 128 and prefill tokens/s for
   2048-token prompts on the ~1B model, radixkv (FlashInfer) vs transformers ``generate``;
   medians of 3 runs, each a single interval of one clock inside one run (:func:`median_s`,
   :func:`hf_timed_generate`), so never negative.
4. ``bandwidth`` (figures): achieved KV read bandwidth of FlashInfer decode at long context
   (bytes of K and V read / kernel time) against the H200's 4.8 TB/s, page_size 1 and 16.
5. ``engine`` (gate, last, own cap): the engine itself, ``radixkv.LLM`` with FlashInfer on a
   shared-prefix workload (SGLang's "generated shared prefix" shape: 32 groups x 16 prompts,
   a 1,024-token system prompt per group, 128-token questions, exactly 64 output tokens with
   ``ignore_eos``) on the ~1B random-weight model, ``prefix_cache="radix"`` vs ``"none"``:
   output tokens/s, TTFT p50/p99, prefill tokens. Gates: each mode's prefill tokens equal the
   exact count of :func:`gsp_expected_prefill`, and radix and none give the same greedy tokens
   (a divergence passes only as a certified near tie, :func:`certify_divergences`).

``passed`` = every set-up step ok, every gating section passed, no section raised, and (added
by ``--merge-pytest`` in ``gpu_check.sh``) the pytest step passed. A timeout of a figures
section is recorded under ``"incomplete"`` and does not fail the check.

``gpu_check.json`` and ``gpu_check.md`` (short tables) go to ``--out``. In ``--cpu`` mode the
torch backend stands in for FlashInfer, dtype is float32 and all sizes are tiny: it checks the
script, not the kernels.
"""

from __future__ import annotations

import argparse
import gc
import glob
import json
import math
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
for _p in (str(REPO), str(BENCH)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from prepare_gpu_carry import verify_carry  # noqa: E402  (stdlib only)

H200_HBM_TBPS = 4.8
SECTIONS = ("attention", "greedy", "speed", "bandwidth", "engine")
GATING = ("attention", "greedy", "engine")
# Caps on the H200, in seconds (expected: ~10 / 20 / 15 / 5 / 30). The whole check, set-up
# included, runs inside --budget (210 s); gpu_check.sh kills it at 225 s and gives pytest 45 s.
SECTION_CAPS_S = {"attention": 30, "greedy": 50, "speed": 30, "bandwidth": 15, "engine": 60}
DEFAULT_BUDGET_S = 210.0
CPU_BUDGET_S = 900.0  # the dry run on a loaded 2-core machine: caps x CPU_CAP_SCALE
CPU_CAP_SCALE = 5.0
MIN_SECTION_S = 2.0  # a section with less time than this left is skipped
WATCHDOG_GRACE_S = 10.0
FI_WORKSPACE_DEFAULT = "/tmp/radixkv_fi_ws"
FI_SITE_DEFAULT = "/tmp/radixkv_fi_site"

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
# The engine section's workload. GPU: SGLang's gsp shape sized to fit the cap (question length
# 128 as SGLang's default). KV of the ~1B shape is 64 KiB/token: 2^19 slots = 32 GiB, room for
# "none"'s peak (256 running x 1,216 tokens) and for radix's cache of every finished request
# (32 x 1,024 + 512 x 191 tokens) without any eviction or retraction.
ENGINE_GPU = dict(
    groups=32,
    per_group=16,
    system_len=1024,
    question_len=128,
    output_len=64,
    max_total_tokens=1 << 19,
    chunked_prefill_size=None,  # the engine's default (8192 on CUDA)
    max_running_requests=None,  # the engine's default (256 on CUDA)
    replay_tokens=16384,
)
ENGINE_CPU = dict(
    groups=3,
    per_group=4,
    system_len=40,
    question_len=8,
    output_len=6,
    max_total_tokens=4096,
    chunked_prefill_size=64,  # several admission steps and a chunked prompt
    max_running_requests=6,  # two waves of admissions
    replay_tokens=512,
)


# ----------------------------------------------------------------------------- pure helpers
class SectionTimeout(BaseException):
    """Raised by SIGALRM when a section passes its cap (a BaseException, so the sections' own
    ``except Exception`` blocks do not swallow it)."""


class Terminated(BaseException):
    """Raised by SIGTERM / SIGINT (e.g. ``timeout`` in gpu_check.sh): save and stop."""


def stable_seed(*parts) -> int:
    """A seed from ``parts`` that is the same in every process: CRC-32 of their ``repr``
    (``hash()`` of a tuple holding strings changes per process with PYTHONHASHSEED)."""
    return zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF


def median_s(samples) -> float:
    """Median of durations in seconds. Every sample must be a single interval of a monotonic clock
    (never a difference of two runs), so a negative one is a bug: ValueError."""
    xs = [float(x) for x in samples]
    if not xs:
        raise ValueError("median_s: no samples")
    if any(not math.isfinite(x) or x < 0 for x in xs):
        raise ValueError(f"median_s: durations must be finite and >= 0, got {xs}")
    return statistics.median(xs)


def per_second(count: float, seconds: float) -> float:
    """``count / seconds`` for a duration from :func:`median_s` (>= 0); a zero duration gives inf."""
    if seconds < 0:
        raise ValueError(f"per_second: negative duration {seconds}")
    return count / seconds if seconds > 0 else float("inf")


def percentile(values, q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation (numpy's default)."""
    xs = sorted(float(v) for v in values)
    if not xs:
        raise ValueError("percentile: no values")
    k = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


class StepClock:
    """A transformers logits processor (duck-typed; wrapped by :func:`hf_timed_generate`) that
    synchronises the device and stamps the clock each time a token's logits are ready: stamp 0
    after the prefill forward, stamp k after the k-th decode forward."""

    def __init__(self, sync=lambda: None) -> None:
        self.sync = sync
        self.stamps: list[float] = []

    def __call__(self, input_ids, scores):
        self.sync()
        self.stamps.append(time.perf_counter())
        return scores

    def prefill_s(self, t_start: float) -> float:
        """Call start -> first token's logits."""
        return self.stamps[0] - t_start

    def decode_s(self) -> float:
        """First -> last token's logits: ``len(stamps) - 1`` decode forwards."""
        return self.stamps[-1] - self.stamps[0]


def greedy_gate(ref_tokens, fast_tokens, ref_logits, fast_logits, eps: float) -> dict:
    """Judge greedy runs of the backend under test ("fast") against the reference (torch backend).

    ``ref_tokens`` / ``fast_tokens``: per prompt, the greedy tokens of every step (argmax of the
    logits); ``ref_logits`` / ``fast_logits``: per step, ``[prompts, vocab]`` float logits.
    ``eps``: the dtype's relative resolution (``torch.finfo(dtype).eps``: 2^-7 for bf16).

    At step ``s`` prompt ``b``'s inputs are the same token ids in both runs as long as
    ``s <= div_b`` (its first differing step), so every such step measures the logit noise of the
    two kernels. Rule:

    1. spread bound: every step with identical inputs, the divergent ones included, differs by at
       most a quarter of the reference's step-0 logit standard deviation (bf16 rounding gives a few
       percent of it; a wrong kernel about 100%);
    2. a divergence at step ``s`` is a near tie only when the reference's margin of its own token
       over the fast backend's token, ``ref[s][a] - ref[s][f]``, is at most twice the noise
       measured on the *agreeing* steps (every prompt's steps ``t < div_b``), floored at one
       resolution step of the logits (``eps * max|ref[s]|``). The difference at the divergent step
       itself must not be the yardstick: there ``ref[a] - ref[f] <= (ref[a] - fast[a]) +
       (fast[f] - ref[f]) <= 2 * diff`` holds for any divergence, so ``gap <= 2 * diff`` never
       fails. With no agreeing step at all, only the floor remains.

    Returns per-prompt entries, the noise, the bounds and ``passed``.
    """
    n, steps = len(ref_tokens), len(ref_logits)
    spread = float(ref_logits[0].float().std())
    bound = 0.25 * spread
    div = [next((s for s in range(steps) if ref_tokens[b][s] != fast_tokens[b][s]), None) for b in range(n)]
    diffs: dict = {}
    for s in range(steps):
        d = (ref_logits[s].float() - fast_logits[s].float()).abs().amax(-1).tolist()
        for b in range(n):
            if div[b] is None or s <= div[b]:
                diffs[(b, s)] = float(d[b])
    agreeing = [v for (b, s), v in diffs.items() if div[b] is None or s < div[b]]
    noise = max(agreeing) if agreeing else None
    max_identical = max(diffs.values())
    ok = max_identical <= bound
    per = []
    for b in range(n):
        entry: dict = {"prompt": b, "equal": div[b] is None}
        if div[b] is not None:
            s = div[b]
            lt = ref_logits[s][b].float()
            a, f = int(ref_tokens[b][s]), int(fast_tokens[b][s])
            margin = float(lt[a] - lt[f])
            floor = eps * float(lt.abs().max())
            tol = 2.0 * max(noise or 0.0, floor)
            near = margin <= tol and diffs[(b, s)] <= bound
            entry.update(
                {
                    "first_divergence": s,
                    "ref_token": a,
                    "fast_token": f,
                    "ref_margin": margin,
                    "ref_top2_gap": float(lt.topk(2).values[0] - lt.topk(2).values[1]),
                    "tolerance": tol,
                    "max_logit_diff_at_step": diffs[(b, s)],
                    "near_tie": near,
                }
            )
            ok &= near
        per.append(entry)
    return {
        "prompts": per,
        "passed": bool(ok),
        "all_equal": all(e["equal"] for e in per),
        "logit_std_step0": spread,
        "max_logit_diff_bound": bound,
        "max_logit_diff_step0": max(diffs[(b, 0)] for b in range(n)),
        "max_logit_diff_identical_inputs": max_identical,
        "noise_agreeing_steps": noise,
        "equal_steps_all_prompts": sum(
            all(ref_tokens[b][s] == fast_tokens[b][s] for b in range(n)) for s in range(steps)
        ),
    }


def certify_divergences(full, split, chosen, eps: float, factor: float = 4.0) -> dict:
    """Certify the engine's radix-vs-none divergences as near ties from a replay.

    ``full`` / ``split``: ``[n, vocab]`` logits of ``n`` replayed contexts (prompt + the common
    output tokens before the first divergence), computed on a fresh runner in two ways: one
    prefill of the whole context (what "none" does) and a prefill of the system prompt followed
    by an extend of the rest (what "radix" does). ``chosen``: per context, None (a control with
    equal outputs, used only for the noise) or ``(radix_token, none_token)``.

    noise = max |full - split| over all contexts: the kernels' rounding noise on identical inputs,
    measured away from the engine's runs. Each of the three computations (radix run, none run,
    replay) is off the exact logits by about that much, so at a genuine tie both chosen tokens lie
    within ``2 * (e_engine + e_replay) ~ 4 * noise`` of the replay's best logit:
    a divergence passes when ``max(full) - min(full[radix], full[none]) <= factor * max(noise,
    eps * max|full|)``. A wrongly reused or corrupted prefix moves logits by their spread, far
    beyond that.
    """
    n = len(chosen)
    noise = float((full.float() - split.float()).abs().amax()) if n else 0.0
    per = []
    for i, ch in enumerate(chosen):
        if ch is None:
            continue
        lf = full[i].float()
        floor = eps * float(lf.abs().max())
        tol = factor * max(noise, floor)
        gap = float(lf.max() - min(lf[int(t)] for t in ch))
        per.append(
            {
                "context": i,
                "tokens": [int(t) for t in ch],
                "replay_top2": lf.topk(2).indices.tolist(),
                "gap": gap,
                "tolerance": tol,
                "near_tie": gap <= tol,
            }
        )
    return {
        "noise": noise,
        "factor": factor,
        "contexts": n,
        "divergences": per,
        "passed": all(p["near_tie"] for p in per),
    }


def gsp_expected_prefill(groups: int, per_group: int, system_len: int, question_len: int, mode: str) -> dict:
    """Exact prefill tokens of the engine section's two phases (page_size 1, no eviction or
    retraction, which the section checks).

    Phase "warm": one request per group whose prompt is the system prompt ``S_g`` alone
    (``max_tokens=1``). Phase "main": ``per_group`` requests ``S_g + Q_gi`` per group. The first
    tokens of the ``S_g`` are pairwise distinct, and so are those of the ``Q_gi`` of one group.

    * radix: a warm request matches nothing (no other cached sequence starts with its first
      token), so it computes all ``system_len`` tokens; when it finishes its ``kv_len`` is exactly
      ``S_g`` (the sampled token is never computed), which stays cached. A main request matches
      ``S_g`` and not one token more (its question's first token differs from every cached
      continuation of ``S_g``), so it computes ``question_len`` tokens, whether or not requests of
      its group are admitted in the same step. Total ``G*Ls + G*P*Lq``.
    * none: every prompt token is computed: ``G*Ls + G*P*(Ls + Lq)``.
    """
    warm = groups * system_len
    if mode == "radix":
        main = groups * per_group * question_len
    elif mode == "none":
        main = groups * per_group * (system_len + question_len)
    else:
        raise ValueError(f"gsp_expected_prefill: mode must be 'radix' or 'none', got {mode!r}")
    return {"warm": warm, "main": main, "total": warm + main}


def gsp_prompts(torch, vocab: int, groups: int, per_group: int, system_len: int, question_len: int, seed: int):
    """The engine workload's prompts: ``(warm, main, group_of)``; ``warm[g]`` is system prompt
    ``S_g``, ``main`` lists ``S_g + Q_gi`` group after group. First tokens are drawn without
    replacement (see :func:`gsp_expected_prefill`); ids 0-2 are left out (pad/bos/eos)."""
    g = torch.Generator().manual_seed(seed)
    if max(groups, per_group) > vocab - 3:
        raise ValueError(f"gsp_prompts: vocabulary {vocab} too small for distinct first tokens")
    firsts = (torch.randperm(vocab - 3, generator=g)[:groups] + 3).tolist()
    warm, main, group_of = [], [], []
    for gi in range(groups):
        s = torch.randint(3, vocab, (system_len,), generator=g).tolist()
        s[0] = firsts[gi]
        q_firsts = (torch.randperm(vocab - 3, generator=g)[:per_group] + 3).tolist()
        for i in range(per_group):
            q = torch.randint(3, vocab, (question_len,), generator=g).tolist()
            q[0] = q_firsts[i]
            main.append(s + q)
            group_of.append(gi)
        warm.append(s)
    return warm, main, group_of


def parse_pytest_summary(text: str) -> dict:
    """Counts from pytest's last summary line (``3 passed, 1 skipped in 2.1s``)."""
    counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0, "xfailed": 0, "xpassed": 0}
    line = ""
    for ln in text.splitlines():
        if re.search(r"\d+ (passed|failed|skipped|errors?|xfailed|xpassed)\b", ln) and " in " in ln:
            line = ln.strip(" =")
    for num, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)\b", line):
        counts["errors" if word.startswith("error") else word] = int(num)
    counts["summary"] = line
    return counts


# ----------------------------------------------------------------------------- the check
class Check:
    """Holds the mode, the budget, the device and the results; writes the JSON as it goes."""

    def __init__(self, args) -> None:
        self.args = args
        self.cpu = bool(args.cpu)
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.fast = "torch" if self.cpu else "flashinfer"  # backend under test
        self.t0 = time.time()
        self.budget = float(
            args.budget if args.budget is not None else (CPU_BUDGET_S if self.cpu else DEFAULT_BUDGET_S)
        )
        self.cap_scale = CPU_CAP_SCALE if self.cpu else 1.0
        self.cap_overrides = dict(getattr(args, "cap", None) or [])
        self.res: dict = {
            "passed": False,
            "mode": "cpu-dry-run" if self.cpu else "gpu",
            "fast_backend": self.fast,
            "budget_s": self.budget,
            "setup": {"ok": None, "fatal": None, "steps": {}},
            "sections": {},
            "incomplete": [],
        }
        self.torch = None
        self.device = None
        self.dtype = None
        self.atol = None
        self._save_lock = threading.Lock()

    # time
    def elapsed(self) -> float:
        return time.time() - self.t0

    def left(self) -> float:
        return self.budget - self.elapsed()

    def log(self, msg: str) -> None:
        print(f"[{self.elapsed():6.1f}s] {msg}", flush=True)

    # results
    def save(self, extra: dict | None = None) -> None:
        """Write gpu_check.json atomically (tmp file + rename: a kill never leaves half a file)."""
        with self._save_lock:
            self.res["wall_s"] = round(self.elapsed(), 1)
            data = dict(self.res, **(extra or {}))
            for _ in range(5):  # the watchdog may read while the main thread writes
                try:
                    text = json.dumps(data, indent=1, default=str) + "\n"
                    break
                except (RuntimeError, ValueError):
                    time.sleep(0.05)
            else:
                text = json.dumps({"passed": False, "error": "results could not be serialised"}) + "\n"
            tmp = self.out / "gpu_check.json.tmp"
            tmp.write_text(text)
            os.replace(tmp, self.out / "gpu_check.json")

    # device helpers
    def sync(self) -> None:
        if self.device is not None and self.device.type == "cuda":
            self.torch.cuda.synchronize()

    def free_memory(self) -> None:
        gc.collect()
        if self.device is not None and self.device.type == "cuda":
            self.torch.cuda.empty_cache()

    def backend(self, name, pool, hq, **kw):
        from radixkv.attention import create_attention_backend

        return create_attention_backend(name, self.device, pool, hq, **kw)


def _on_alarm(signum, frame):
    raise SectionTimeout("section time cap reached")


def _on_term(signum, frame):
    raise Terminated(f"signal {signal.Signals(signum).name}")


def start_watchdog(c: Check) -> threading.Event:
    """A daemon thread that, if the run is still going ``WATCHDOG_GRACE_S`` after the budget (main
    thread stuck in native code, where signal handlers cannot run), saves what there is and ends
    the process (exit 3). Set the returned event to disarm it."""
    done = threading.Event()

    def watch():
        if done.wait(max(0.0, c.budget + WATCHDOG_GRACE_S - c.elapsed())):
            return
        try:
            c.save({"passed": False, "watchdog": f"still running {WATCHDOG_GRACE_S:.0f} s after the budget"})
            write_table(c.res, c.out)
        finally:
            print(f"watchdog: budget {c.budget:.0f} s exceeded; partial results in {c.out}", flush=True)
            os._exit(3)

    threading.Thread(target=watch, name="gpu-check-watchdog", daemon=True).start()
    return done


# ----------------------------------------------------------------------------- set-up
def _step(c: Check, name: str, fn, fatal: bool) -> bool:
    """Run one set-up step; record its result (or error + traceback) and save."""
    st = c.res["setup"]
    rec: dict = {"ok": False}
    st["steps"][name] = rec
    t = time.time()
    try:
        rec.update(fn() or {})
        rec["ok"] = rec.get("ok_override", True)
        rec.pop("ok_override", None)
    except Exception as exc:  # noqa: BLE001 - recorded; a fatal one skips the sections
        rec["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        rec["traceback"] = traceback.format_exc()[-6000:]
        c.log(f"setup {name}: FAILED {rec['error']}")
    rec["s"] = round(time.time() - t, 2)
    if not rec["ok"]:
        st["ok"] = False
        if fatal and st["fatal"] is None:
            st["fatal"] = name
    c.save()
    return rec["ok"]


def step_env(c: Check) -> dict:
    """FlashInfer's environment: no silent JIT, one workspace for the check and the pytest step."""
    if c.args.allow_jit:
        os.environ.pop("FLASHINFER_DISABLE_JIT", None)
    else:
        os.environ.setdefault("FLASHINFER_DISABLE_JIT", "1")
    os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", FI_WORKSPACE_DEFAULT)
    Path(os.environ["FLASHINFER_WORKSPACE_BASE"]).mkdir(parents=True, exist_ok=True)
    keys = ("FLASHINFER_DISABLE_JIT", "FLASHINFER_WORKSPACE_BASE", "FLASHINFER_CUDA_ARCH_LIST", "CUDA_HOME")
    return {"env": {k: os.environ.get(k) for k in keys + ("RADIXKV_FI_SITE", "PYTHONPATH")}}


def step_toolchain(c: Check) -> dict:
    """What a JIT fallback would need (logged, never fails): nvcc, ninja, $CUDA_HOME/lib64 with
    libcudart.so and stubs/libcuda.so."""
    tools = {t: shutil.which(t) for t in ("nvcc", "ninja", "c++", "gcc")}
    nvcc = tools["nvcc"]
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if not home and nvcc:
        home = str(Path(os.path.realpath(nvcc)).parent.parent)
    home = home or "/usr/local/cuda"
    lib64 = Path(home) / "lib64"
    layout = {
        "cuda_home": home,
        "lib64": lib64.is_dir(),
        "lib64/libcudart.so": (lib64 / "libcudart.so").exists(),
        "lib64/stubs/libcuda.so": (lib64 / "stubs" / "libcuda.so").exists(),
        "include/cuda_runtime.h": (Path(home) / "include" / "cuda_runtime.h").exists(),
    }
    info: dict = {"which": tools, "cuda_layout": layout}
    for tool, flag in (("nvcc", "--version"), ("ninja", "--version")):
        if tools[tool]:
            try:
                p = subprocess.run([tools[tool], flag], capture_output=True, text=True, timeout=15)
                lines = p.stdout.strip().splitlines()
                info[f"{tool}_version"] = next((ln for ln in lines if "release" in ln), lines[-1] if lines else "")
            except (OSError, subprocess.SubprocessError) as exc:
                info[f"{tool}_version"] = f"{type(exc).__name__}: {exc}"
    info["jit_possible"] = bool(nvcc and tools["ninja"] and layout["lib64/stubs/libcuda.so"])
    c.log(f"toolchain: nvcc={nvcc} ninja={tools['ninja']} cuda_home={home} layout={layout}")
    return info


def step_carry_verify(c: Check) -> dict:
    res = verify_carry(Path(c.args.carry))
    for p in res["problems"]:
        c.log(f"carry: {p}")
    res["ok_override"] = res["ok"]
    return res


def step_carry_install(c: Check) -> dict:
    """pip-install the carried wheels into a private target dir and put it on sys.path."""
    carry = Path(c.args.carry)
    site = Path(os.environ.get("RADIXKV_FI_SITE", FI_SITE_DEFAULT))
    wheels = sorted(glob.glob(str(carry / "wheels" / "*.whl")))
    if not wheels:
        raise FileNotFoundError(f"no wheels under {carry}/wheels (run bench/prepare_gpu_carry.py)")
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir"]
    cmd += ["--upgrade", "--target", str(site), *wheels]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if p.returncode != 0:
        raise RuntimeError(f"pip install failed ({p.returncode}): {(p.stdout + p.stderr)[-1500:]}")
    sys.path.insert(0, str(site))
    return {"site": str(site), "wheels": [Path(w).name for w in wheels]}


def step_torch(c: Check) -> dict:
    from importlib.metadata import version

    import torch

    c.torch = torch
    c.device = torch.device("cpu" if c.cpu else "cuda")
    c.dtype = torch.float32 if c.cpu else torch.bfloat16
    c.atol = c.args.atol if c.args.atol else (1e-4 if c.cpu else 2e-2)
    c.res["versions"] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": version("transformers"),  # imported by the sections that use it (~3 s)
    }
    return dict(c.res["versions"])


def step_radixkv(c: Check) -> dict:
    import radixkv
    from radixkv.attention import create_attention_backend  # noqa: F401

    return {"path": str(Path(radixkv.__file__).parent)}


def step_cuda(c: Check) -> dict:
    torch = c.torch
    if not torch.cuda.is_available():
        raise RuntimeError("torch.cuda.is_available() is False (use --cpu for a dry run)")
    props = torch.cuda.get_device_properties(0)
    c.res["device"] = torch.cuda.get_device_name(0)
    return {
        "device": c.res["device"],
        "capability": list(torch.cuda.get_device_capability(0)),
        "memory_gib": round(props.total_memory / 2**30, 1),
        "sms": props.multi_processor_count,
    }


def step_flashinfer(c: Check) -> dict:
    """``import flashinfer`` (never tried under the box's torch before) and its AOT modules."""
    import importlib.util

    deps = ("tvm_ffi", "packaging", "requests", "pynvml", "tqdm", "numpy", "jinja2")
    missing = [d for d in deps if importlib.util.find_spec(d) is None]
    info: dict = {"missing_import_deps": missing}
    import flashinfer

    c.res["versions"]["flashinfer"] = flashinfer.__version__
    aot = Path(flashinfer.__file__).parent / "data" / "aot"
    present = sorted(p.name for p in aot.iterdir()) if aot.is_dir() else []
    info.update({"version": flashinfer.__version__, "path": str(Path(flashinfer.__file__).parent), "aot": present})
    carry_step = c.res["setup"]["steps"].get("carry_verify") or {}
    want = [m.split(":") for m in carry_step.get("required", [])]
    man_path = Path(c.args.carry or "") / "manifest.json"
    if c.args.carry and man_path.is_file():
        man = json.loads(man_path.read_text())
        names = {(m["kind"], m["head_dim"], m["dtype"]): m["name"] for m in man.get("aot_modules", [])}
        info["required_installed"] = {
            f"{k}:{hd}:{dt}": names.get(("prefill_fa2" if k == "prefill" else k, int(hd), dt)) in present
            for k, hd, dt in want
        }
        if not all(info["required_installed"].values()):
            info["ok_override"] = False
    return info


def step_auto_backend(c: Check) -> dict:
    """``attention_backend="auto"`` must pick FlashInfer; if it falls back, construct FlashInfer
    explicitly to record why."""
    from radixkv.memory.kv_pool import KVPool

    pool = KVPool(1, 3, 64, 16, 1, c.dtype, c.device)
    name = c.backend("auto", pool, 9).name
    c.res["auto_backend"] = name
    info: dict = {"auto_backend": name}
    if name != "flashinfer":
        try:
            c.backend("flashinfer", pool, 9)
        except Exception as exc:  # noqa: BLE001 - the reason is the result
            info["flashinfer_error"] = f"{type(exc).__name__}: {exc}"[:2000]
        info["ok_override"] = False
    return info


def setup(c: Check) -> bool:
    """All set-up steps; True when the sections can run."""
    st = c.res["setup"]
    st["ok"] = True
    if not c.cpu:
        _step(c, "env", lambda: step_env(c), fatal=False)
        _step(c, "toolchain", lambda: step_toolchain(c), fatal=False)
    if c.args.carry:
        _step(c, "carry_verify", lambda: step_carry_verify(c), fatal=False)
        _step(c, "carry_install", lambda: step_carry_install(c), fatal=True)
    # torch and CUDA are looked at even after a failed carry: one run then reports every problem
    torch_ok = _step(c, "torch", lambda: step_torch(c), fatal=True)
    if st["fatal"] is None:
        _step(c, "radixkv", lambda: step_radixkv(c), fatal=True)
    if c.cpu:
        c.res["device"] = "cpu"
    elif torch_ok:
        _step(c, "cuda", lambda: step_cuda(c), fatal=True)
        if st["fatal"] is None:
            _step(c, "flashinfer", lambda: step_flashinfer(c), fatal=True)
        if st["fatal"] is None:
            _step(c, "auto_backend", lambda: step_auto_backend(c), fatal=False)
    c.log(f"setup ok={st['ok']} fatal={st['fatal']} device={c.res.get('device')} versions={c.res.get('versions')}")
    return st["fatal"] is None


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
def check_attention(c: Check, res: dict) -> bool:
    torch = c.torch
    from radixkv.attention.metadata import ForwardBatch
    from radixkv.memory.kv_pool import KVPool, ReqToTokenPool

    res["atol"] = c.atol
    res["cases"] = cases = []
    ok = True
    scale = 0.1 if c.cpu else 1.0
    for hq, hkv, d in ((9, 3, 64), (32, 8, 128)):
        for ps in (1, 16):
            for kind in ("prefill", "extend", "decode"):
                g = torch.Generator().manual_seed(stable_seed("attention", hq, hkv, d, ps, kind))
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
                cases.append(
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
                c.save()
                c.log(
                    f"attention {hq}/{hkv}x{d} ps={ps} {kind:7s} "
                    + " ".join(f"{k_}={v_:.2e}" for k_, v_ in diffs.items())
                    + f" {'ok' if passed else 'FAIL'}"
                )
    return ok


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


def random_model(c: Check, cfg_kwargs: dict, seed: int):
    """A radixkv model with radixkv's random init (``radixkv.models.loader.init_random_weights``:
    N(0, initializer_range), norms 1, biases 0) drawn on the device (a CPU draw of 1.1B weights
    takes tens of seconds), wrapped as a ``LoadedModel`` (no tokenizer). Returns (config, loaded)."""
    torch = c.torch
    from transformers import LlamaConfig

    from radixkv.models.layers import RotaryEmbedding
    from radixkv.models.loader import LoadedModel, init_random_weights
    from radixkv.models.registry import get_model_class

    cfg = LlamaConfig(**cfg_kwargs, architectures=["LlamaForCausalLM"], bos_token_id=1, eos_token_id=2)
    with torch.device("meta"):
        model = get_model_class(cfg)(cfg)
    model = model.to_empty(device=c.device).to(c.dtype)
    model.model.rotary_emb = RotaryEmbedding(cfg).to(c.device)
    init_random_weights(model, cfg, seed)
    lm = LoadedModel(model=model.eval(), hf_config=cfg, tokenizer=None, name="random-weights", hf_dir=REPO)
    return cfg, lm


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


def hf_timed_generate(c: Check, hf, ids, new_tokens: int) -> tuple[float, float]:
    """One greedy transformers ``generate`` of exactly ``new_tokens`` tokens, timed from inside by a
    :class:`StepClock`: returns ``(prefill_s, decode_s)``, the call start -> first logits and the
    first -> last logits (``new_tokens - 1`` decode forwards). Both are single intervals of one
    monotonic clock inside one run, so never negative (the old difference of two separate runs,
    ``t(n + 1) - t(1)``, came out negative in a CPU dry run)."""
    from transformers import LogitsProcessor, LogitsProcessorList

    clock = StepClock(c.sync)

    class _Clock(LogitsProcessor):
        def __call__(self, input_ids, scores):
            return clock(input_ids, scores)

    c.sync()
    t0 = time.perf_counter()
    hf.generate(
        ids,
        attention_mask=c.torch.ones_like(ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
        logits_processor=LogitsProcessorList([_Clock()]),
    )
    if len(clock.stamps) != new_tokens:
        raise RuntimeError(f"hf_timed_generate: {len(clock.stamps)} logits steps for {new_tokens} tokens")
    return clock.prefill_s(t0), clock.decode_s()


# ----------------------------------------------------------------------------- 2. greedy
def compare_greedy(c: Check, res: dict, name: str, cfg_kwargs: dict, prompts, max_new: int, page_size: int) -> bool:
    torch = c.torch
    cfg, hf, ours = build_pair(c, cfg_kwargs, seed=1234)
    slots = (sum(len(p) + max_new for p in prompts) // page_size + 2 * len(prompts) + 8) * page_size
    res.update(
        {
            "model": name,
            "page_size": page_size,
            "max_new_tokens": max_new,
            "prompt_lens": [len(p) for p in prompts],
            "params_m": round(sum(p.numel() for p in ours.parameters()) / 1e6, 1),
            "passed": False,
        }
    )
    runs = {}
    for be in (c.fast, "torch"):
        runner = make_runner(c, ours, cfg, be, slots, page_size)
        res[f"{be}_backend_class"] = type(runner.attn_backend).__name__
        runs[be] = Driver(c, runner).generate(prompts, max_new, keep_logits=True)
        del runner
    (tf, hist_f, _), (tt, hist_t, _) = runs[c.fast], runs["torch"]
    res.update(greedy_gate(tt, tf, hist_t, hist_f, torch.finfo(c.dtype).eps))
    del runs, hist_f, hist_t
    c.save()
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
    # the engine (radixkv.LLM) over a prepared runner
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
    except Exception as exc:  # noqa: BLE001 - reported, not gated here (the engine section gates)
        res["engine_error"] = f"{type(exc).__name__}: {exc}"[:300]
    del hf, ours
    c.free_memory()
    c.log(
        f"greedy {name} ps={page_size}: all_equal={res['all_equal']} passed={res['passed']} "
        f"step0 diff={res['max_logit_diff_step0']:.3e} noise={res['noise_agreeing_steps']} "
        f"hf_equal={res.get('transformers_equal_prompts')} "
        f"engine_equal={res.get('engine_equal_prompts', res.get('engine_error'))}"
    )
    return res["passed"]


def check_greedy(c: Check, res: dict) -> bool:
    torch = c.torch
    g = torch.Generator().manual_seed(99)
    res["runs"] = runs = []
    if c.cpu:
        specs = [("tiny", TINY, 1), ("tiny", TINY, 16)]
    else:
        specs = [
            ("smollm2-135m-shape", SMOLLM2, 1),
            ("smollm2-135m-shape", SMOLLM2, 16),
            ("llama-1b-shape", LLAMA_1B, 1),
        ]
    lens = [17, 64, 200, 333, 512] if not c.cpu else [5, 9, 17, 30, 41]
    ok = True
    for name, cfg, ps in specs:
        prompts = [torch.randint(3, cfg["vocab_size"], (n,), generator=g).tolist() for n in lens]
        run: dict = {}
        runs.append(run)
        ok &= compare_greedy(c, run, name, cfg, prompts, 32 if not c.cpu else 8, ps)
        c.save()
    return ok


# ----------------------------------------------------------------------------- 3. speed
SPEED_REPEATS = 3


def check_speed(c: Check, res: dict) -> bool:
    torch = c.torch
    cfg_kw = TINY if c.cpu else LLAMA_1B
    cfg, hf, ours = build_pair(c, cfg_kw, seed=5)
    res.update(
        {
            "model": "llama-1b-shape" if not c.cpu else "tiny",
            "params_m": round(sum(p.numel() for p in ours.parameters()) / 1e6, 1),
            "repeats": SPEED_REPEATS,
            "method": "median of repeats; each a single interval inside one run (radixkv: after prefill to "
            "after the last decode step; transformers: first to last logits, StepClock)",
            "decode": [],
            "prefill": [],
        }
    )
    g = torch.Generator().manual_seed(3)
    plen, new = (128, 32) if not c.cpu else (16, 8)
    batches = (1, 32, 128) if not c.cpu else (1, 4)
    n_p, L = (4, 2048) if not c.cpu else (2, 64)
    runner = make_runner(c, ours, cfg, c.fast, num_slots=max(batches) * (plen + new + 1) + n_p * L + 4096)
    drv = Driver(c, runner)
    for bs in batches:
        prompts = [torch.randint(3, cfg.vocab_size, (plen,), generator=g).tolist() for _ in range(bs)]
        drv.generate(prompts, 4, time_decode=True)  # warm-up
        t_ours = median_s(drv.generate(prompts, new + 1, time_decode=True)[2] for _ in range(SPEED_REPEATS))
        ids = torch.tensor(prompts, device=c.device)
        hf_timed_generate(c, hf, ids, 3)  # warm-up
        t_hf = median_s(hf_timed_generate(c, hf, ids, new + 1)[1] for _ in range(SPEED_REPEATS))
        row = {
            "batch": bs,
            "prompt_len": plen,
            "decode_steps": new,
            "radixkv_decode_s": t_ours,
            "transformers_decode_s": t_hf,
            "radixkv_tok_s": per_second(bs * new, t_ours),
            "transformers_tok_s": per_second(bs * new, t_hf),
        }
        row["speedup"] = row["radixkv_tok_s"] / row["transformers_tok_s"]
        res["decode"].append(row)
        c.save()
        c.log(
            f"decode bs={bs}: radixkv {row['radixkv_tok_s']:.0f} tok/s, transformers "
            f"{row['transformers_tok_s']:.0f} tok/s (x{row['speedup']:.2f})"
        )
    prompts = [torch.randint(3, cfg.vocab_size, (L,), generator=g).tolist() for _ in range(n_p)]
    drv.generate(prompts, 1, chunks=1)  # warm-up

    def ours_prefill(drv=drv):
        c.sync()
        t0 = time.perf_counter()
        drv.generate(prompts, 1, chunks=1)
        c.sync()
        return time.perf_counter() - t0

    t_ours = median_s(ours_prefill() for _ in range(SPEED_REPEATS))
    ids = torch.tensor(prompts, device=c.device)
    hf_timed_generate(c, hf, ids, 1)  # warm-up
    t_hf = median_s(hf_timed_generate(c, hf, ids, 1)[0] for _ in range(SPEED_REPEATS))
    row = {
        "prompts": n_p,
        "prompt_len": L,
        "radixkv_s": t_ours,
        "transformers_s": t_hf,
        "radixkv_tok_s": per_second(n_p * L, t_ours),
        "transformers_tok_s": per_second(n_p * L, t_hf),
    }
    row["speedup"] = row["radixkv_tok_s"] / row["transformers_tok_s"]
    res["prefill"].append(row)
    c.log(
        f"prefill {n_p}x{L}: radixkv {row['radixkv_tok_s']:.0f} tok/s, transformers {row['transformers_tok_s']:.0f} "
        f"tok/s (x{row['speedup']:.2f})"
    )
    del runner, drv, ours, hf
    c.free_memory()
    return True  # figures, not gates


# ----------------------------------------------------------------------------- 4. bandwidth
def check_bandwidth(c: Check, res: dict) -> bool:
    torch = c.torch
    from radixkv.attention.metadata import ForwardBatch
    from radixkv.memory.kv_pool import KVPool, ReqToTokenPool

    res["peak_tbps"] = H200_HBM_TBPS
    res["cases"] = cases = []
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
                    "tbps": per_second(kv_bytes, dt) / 1e12,
                }
                row["fraction_of_peak"] = row["tbps"] / H200_HBM_TBPS
                cases.append(row)
                c.save()
                c.log(
                    f"bandwidth {name} {hq}/{hkv}x{d} ps={ps} bs={bs} ctx={ctx}: {dt * 1e6:.0f} us, "
                    f"{row['tbps']:.2f} TB/s ({100 * row['fraction_of_peak']:.0f}% of {H200_HBM_TBPS})"
                )
                del be
            del pool, r2t
            c.free_memory()
    return True  # figures, not gates


# ----------------------------------------------------------------------------- 5. engine
REPLAY_MAX_DIVERGENCES = 128
REPLAY_CONTROLS = 8


def run_gsp(c: Check, lm, wl: dict, mode: str, warm, main, run: dict, expected: dict):
    """One mode of the engine workload through ``radixkv.LLM`` (a throwaway warm-up of the process
    first, then the cache emptied): phase warm (each system prompt alone, ``max_tokens=1``), phase
    main (every prompt, exactly ``output_len`` tokens). Fills ``run``; returns the greedy tokens
    ``(warm_first_tokens, main_tokens)``."""
    from radixkv import LLM, SamplingParams

    kw = dict(
        loaded_model=lm,
        eos_token_ids=[],
        device=str(c.device),
        dtype=c.dtype,
        attention_backend=c.fast,
        prefix_cache=mode,
        page_size=1,
        max_total_tokens=wl["max_total_tokens"],
    )
    for k in ("chunked_prefill_size", "max_running_requests"):
        if wl[k] is not None:
            kw[k] = wl[k]
    llm = LLM(**kw)

    def sp(n):
        return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)

    try:
        run["backend"] = llm.engine.runner.attn_backend.name
        run["chunked_prefill_size"] = llm.engine.config.chunked_prefill_size
        run["max_running_requests"] = llm.engine.config.max_running_requests
        llm.generate(prompt_token_ids=[list(range(3, 19)), list(range(20, 44))], sampling_params=sp(4), use_tqdm=False)
        if not llm.reset_prefix_cache():
            raise RuntimeError("reset_prefix_cache refused after the warm-up")
        s0 = llm.cache_stats()
        c.sync()
        t0 = time.perf_counter()
        o1 = llm.generate(prompt_token_ids=warm, sampling_params=sp(1), use_tqdm=False)
        c.sync()
        t1 = time.perf_counter()
        s1 = llm.cache_stats()
        o2 = llm.generate(prompt_token_ids=main, sampling_params=sp(wl["output_len"]), use_tqdm=False)
        c.sync()
        t2 = time.perf_counter()
        s2 = llm.cache_stats()
    finally:
        del llm
        c.free_memory()
    n_out = sum(len(o.outputs[0].token_ids) for o in o2)
    prefill = {"warm": s1["prefill_tokens"] - s0["prefill_tokens"], "main": s2["prefill_tokens"] - s1["prefill_tokens"]}
    prefill["total"] = prefill["warm"] + prefill["main"]
    ttft = [o.metrics.ttft for o in o2]
    run.update(
        {
            "prefill_tokens": prefill,
            "expected_prefill_tokens": expected,
            "prefill_exact": prefill == expected,
            "prompt_tokens_main": s2["prompt_tokens"] - s1["prompt_tokens"],
            "cached_tokens_main": s2["cached_tokens"] - s1["cached_tokens"],
            "evicted_tokens": s2["evicted_tokens"] - s0["evicted_tokens"],
            "retractions": s2["num_retractions"] - s0["num_retractions"],
            "warm_s": t1 - t0,
            "main_s": t2 - t1,
            "output_tokens": n_out,
            "output_len_ok": all(len(o.outputs[0].token_ids) == wl["output_len"] for o in o2),
            "output_tok_s": per_second(n_out, t2 - t1),
            "output_tok_s_incl_warm": per_second(n_out, t2 - t0),
            "ttft_ms": {
                "p50": 1e3 * percentile(ttft, 50),
                "p99": 1e3 * percentile(ttft, 99),
                "mean": 1e3 * statistics.fmean(ttft),
            },
        }
    )
    run["hit_rate_main"] = run["cached_tokens_main"] / max(1, run["prompt_tokens_main"])
    return [o.outputs[0].token_ids[0] for o in o1], [list(o.outputs[0].token_ids) for o in o2]


def replay_logits(c: Check, lm, contexts, cuts, max_tokens: int):
    """Logits after each context, on a fresh runner with the backend under test, computed twice:
    ``full`` = one prefill of the whole context, ``split`` = a prefill of ``context[:cut]`` then an
    extend of the rest over it. Contexts go in batches of at most ``max_tokens`` tokens."""
    torch = c.torch
    batches, cur, cur_t = [], [], 0
    for i, ctx in enumerate(contexts):
        if cur and cur_t + len(ctx) > max_tokens:
            batches.append(cur)
            cur, cur_t = [], 0
        cur.append(i)
        cur_t += len(ctx)
    if cur:
        batches.append(cur)
    slots = max(max_tokens, max(len(x) for x in contexts)) + 64
    runner = make_runner(c, lm.model, lm.hf_config, c.fast, num_slots=slots, max_rows=max(len(b) for b in batches))
    g = torch.Generator().manual_seed(0)
    full, split = [], []
    for b in batches:
        ctxs = [contexts[i] for i in b]
        lens = [len(x) for x in ctxs]
        cut = [max(1, min(cuts[i], len(contexts[i]) - 1)) for i in b]
        rows = paged_rows(torch, runner.req_to_token_pool, lens, 1, runner.kv_pool.num_pages, g)
        try:
            full.append(runner.forward(runner.build_batch([t for x in ctxs for t in x], rows, [0] * len(b), lens)))
            head = [t for x, k in zip(ctxs, cut) for t in x[:k]]
            runner.forward(runner.build_batch(head, rows, [0] * len(b), cut))
            tail = [t for x, k in zip(ctxs, cut) for t in x[k:]]
            split.append(runner.forward(runner.build_batch(tail, rows, cut, [n - k for n, k in zip(lens, cut)])))
        finally:
            for row in rows:
                runner.req_to_token_pool.free(row)
    del runner
    return torch.cat(full), torch.cat(split)


def compare_engine_tokens(c: Check, lm, wl: dict, warm, main, toks: dict, res: dict) -> bool:
    """radix vs none greedy tokens: exact comparison (``res["tokens"]``), then every divergence (up
    to ``REPLAY_MAX_DIVERGENCES``) replayed with a few agreeing controls and certified as a near tie
    or not (``res["certification"]``, :func:`certify_divergences`). True when all are equal or all
    divergences are certified."""
    torch = c.torch
    G, Ls, out = len(warm), len(warm[0]), wl["output_len"]
    (wr, mr), (wn, mn) = toks["radix"], toks["none"]
    warm_div = [g_ for g_ in range(G) if wr[g_] != wn[g_]]
    main_div = {i: next((s for s in range(out) if mr[i][s] != mn[i][s]), None) for i in range(len(main))}
    main_div = {i: s for i, s in main_div.items() if s is not None}
    tok = {
        "warm_equal": G - len(warm_div),
        "main_equal": len(main) - len(main_div),
        "requests": len(main),
        "all_equal": not warm_div and not main_div,
        "warm_divergent_groups": warm_div,
        "main_first_divergence": {str(i): s for i, s in sorted(main_div.items())},
    }
    res["tokens"] = tok
    c.save()
    # replay: every divergence (up to a cap) plus a few agreeing controls for the noise
    contexts, cuts, chosen = [], [], []
    for g_ in warm_div:
        contexts.append(warm[g_])
        cuts.append(Ls - 1)
        chosen.append((wr[g_], wn[g_]))
    for i, s in sorted(main_div.items()):
        contexts.append(main[i] + mr[i][:s])
        cuts.append(Ls)
        chosen.append((mr[i][s], mn[i][s]))
    uncertified = max(0, len(contexts) - REPLAY_MAX_DIVERGENCES)
    contexts, cuts, chosen = (x[:REPLAY_MAX_DIVERGENCES] for x in (contexts, cuts, chosen))
    agreeing = [i for i in range(len(main)) if i not in main_div]
    for i in agreeing[:: max(1, len(agreeing) // REPLAY_CONTROLS)][:REPLAY_CONTROLS]:
        contexts.append(main[i] + mr[i][: out // 2])
        cuts.append(Ls)
        chosen.append(None)
    if contexts:
        full, split = replay_logits(c, lm, contexts, cuts, wl["replay_tokens"])
        cert = certify_divergences(full, split, chosen, torch.finfo(c.dtype).eps)
        cert["uncertified_over_cap"] = uncertified
        cert["passed"] = cert["passed"] and uncertified == 0
        del full, split
    else:
        cert = {"passed": True, "contexts": 0}
    res["certification"] = cert
    tok["equal_or_near_tie"] = tok["all_equal"] or cert["passed"]
    return bool(tok["equal_or_near_tie"])


def check_engine(c: Check, res: dict) -> bool:
    """The engine on the shared-prefix workload, radix vs none (see the module docstring)."""
    torch = c.torch
    wl = dict(ENGINE_CPU if c.cpu else ENGINE_GPU)
    G, P, Ls, Lq, out = (wl[k] for k in ("groups", "per_group", "system_len", "question_len", "output_len"))
    cfg, lm = random_model(c, TINY if c.cpu else LLAMA_1B, seed=stable_seed("engine-model"))
    warm, main, group_of = gsp_prompts(torch, cfg.vocab_size, G, P, Ls, Lq, stable_seed("engine-prompts"))
    res["workload"] = {
        **wl,
        "model": "tiny" if c.cpu else "llama-1b-shape",
        "params_m": round(sum(p.numel() for p in lm.model.parameters()) / 1e6, 1),
        "page_size": 1,
        "requests": len(main),
        "expected_prefill_formula": "radix: G*Ls + G*P*Lq; none: G*Ls + G*P*(Ls+Lq) (gsp_expected_prefill)",
    }
    res["runs"] = {}
    toks = {}
    for mode in ("radix", "none"):
        run: dict = {"mode": mode}
        res["runs"][mode] = run
        toks[mode] = run_gsp(c, lm, wl, mode, warm, main, run, gsp_expected_prefill(G, P, Ls, Lq, mode))
        c.save()
        c.log(
            f"engine {mode}: prefill {run['prefill_tokens']} (expected {run['expected_prefill_tokens']['total']}) "
            f"{run['output_tok_s']:.0f} out tok/s (incl. warm {run['output_tok_s_incl_warm']:.0f}), TTFT p50 "
            f"{run['ttft_ms']['p50']:.0f} ms p99 {run['ttft_ms']['p99']:.0f} ms, evicted {run['evicted_tokens']}, "
            f"retractions {run['retractions']}"
        )
    tokens_ok = compare_engine_tokens(c, lm, wl, warm, main, toks, res)
    r, n = res["runs"]["radix"], res["runs"]["none"]
    res["headline"] = {
        "output_tok_s": {"radix": r["output_tok_s"], "none": n["output_tok_s"]},
        "throughput_x": r["output_tok_s"] / n["output_tok_s"],
        "throughput_incl_warm_x": r["output_tok_s_incl_warm"] / n["output_tok_s_incl_warm"],
        "ttft_p50_ms": {"radix": r["ttft_ms"]["p50"], "none": n["ttft_ms"]["p50"]},
        "ttft_p99_ms": {"radix": r["ttft_ms"]["p99"], "none": n["ttft_ms"]["p99"]},
        "ttft_p50_x": n["ttft_ms"]["p50"] / r["ttft_ms"]["p50"],
        "prefill_tokens": {"radix": r["prefill_tokens"]["total"], "none": n["prefill_tokens"]["total"]},
        "prefill_tokens_x": n["prefill_tokens"]["total"] / r["prefill_tokens"]["total"],
    }
    del lm
    c.free_memory()
    ok = r["prefill_exact"] and n["prefill_exact"] and r["output_len_ok"] and n["output_len_ok"]
    ok = ok and tokens_ok
    c.log(
        f"engine: radix x{res['headline']['throughput_x']:.2f} output tok/s, TTFT p50 x{res['headline']['ttft_p50_x']:.2f}, "
        f"prefill tokens x{res['headline']['prefill_tokens_x']:.2f}; tokens equal {res['tokens']['main_equal']}/"
        f"{len(main)} (+warm {res['tokens']['warm_equal']}/{G}), certified={res['certification']['passed']} "
        f"noise={res['certification'].get('noise')}"
    )
    return bool(ok)


SECTION_FNS = {
    "attention": check_attention,
    "greedy": check_greedy,
    "speed": check_speed,
    "bandwidth": check_bandwidth,
    "engine": check_engine,
}


# ----------------------------------------------------------------------------- driver
def run_sections(c: Check, names: list[str]) -> None:
    """Run ``names`` in order, each under ``min(its cap, budget left - caps of later gating
    sections)`` enforced by SIGALRM; partial results stay in the section's dict."""
    caps = {n: SECTION_CAPS_S[n] * c.cap_scale for n in SECTIONS}
    caps.update(c.cap_overrides)
    for idx, name in enumerate(names):
        later = sum(caps[n] for n in names[idx + 1 :] if n in GATING)
        avail = min(caps[name], c.left() - later)
        res: dict = {"passed": False, "gating": name in GATING, "cap_s": round(avail, 1)}
        c.res["sections"][name] = res
        if avail < min(MIN_SECTION_S, caps[name]):
            res["skipped"] = f"no time left: {c.left():.0f} s of the budget, {later:.0f} s reserved for later gates"
            c.log(f"section {name}: skipped ({res['skipped']})")
            c.save()
            continue
        c.log(f"section {name}: cap {avail:.0f} s")
        t = time.time()
        try:
            try:
                signal.setitimer(signal.ITIMER_REAL, avail)
                res["passed"] = bool(SECTION_FNS[name](c, res))
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except SectionTimeout:
            res["passed"] = False
            res["timed_out"] = True
            res["timeout"] = f"cap of {avail:.0f} s reached; the results above are partial"
            c.log(f"section {name}: TIMED OUT after {avail:.0f} s (partial results kept)")
        except Exception as exc:  # noqa: BLE001 - record and go on with the other sections
            traceback.print_exc()
            res["passed"] = False
            res["error"] = f"{type(exc).__name__}: {exc}"[:2000]
            res["traceback"] = traceback.format_exc()[-6000:]
        res["s"] = round(time.time() - t, 1)
        if (res.get("timed_out") or res.get("skipped")) and name not in GATING:
            c.res["incomplete"].append(name)
        try:
            c.free_memory()
        except Exception:  # noqa: BLE001 - a broken CUDA context shows in the next section
            pass
        c.save()


def overall_passed(res: dict) -> bool:
    """Set-up ok, no abort, every section passed, except that a figures section (not in GATING)
    cut short by its cap or the budget is only "incomplete"; and pytest, once merged."""
    if not res.get("setup", {}).get("ok") or not res.get("sections"):
        return False
    if res.get("terminated") or res.get("error") or res.get("watchdog"):
        return False
    for name, sec in res["sections"].items():
        if sec.get("passed"):
            continue
        if name not in GATING and (sec.get("timed_out") or sec.get("skipped")) and "error" not in sec:
            continue
        return False
    if "pytest" in res and not res["pytest"].get("passed"):
        return False
    return True


def finalize(c: Check) -> None:
    if not c.cpu:
        ws = Path(os.environ.get("FLASHINFER_WORKSPACE_BASE", str(Path.home())))
        c.res["jit"] = {
            "disabled": os.environ.get("FLASHINFER_DISABLE_JIT"),
            "workspace_base": str(ws),
            "built_here": sorted(p.name for p in ws.glob(".cache/flashinfer/*/*/cached_ops/*") if p.is_dir()),
        }


# ----------------------------------------------------------------------------- report
def _table_setup(r: dict) -> list[str]:
    st = r.get("setup", {})
    lines = [f"set-up ok={st.get('ok')} fatal={st.get('fatal')}", "", "| step | ok | s | note |", "|---|---|---|---|"]
    for name, rec in st.get("steps", {}).items():
        note = rec.get("error") or ""
        if name == "carry_verify" and rec.get("problems"):
            note = "; ".join(rec["problems"])
        elif name == "flashinfer" and not note:
            note = f"{rec.get('version')} aot={len(rec.get('aot', []))} missing deps={rec.get('missing_import_deps')}"
        elif name == "toolchain" and not note:
            note = f"nvcc={rec.get('which', {}).get('nvcc')} ninja={rec.get('which', {}).get('ninja')} jit_possible={rec.get('jit_possible')}"
        elif name == "auto_backend":
            note = note or rec.get("auto_backend", "") + (
                " " + rec.get("flashinfer_error", "") if rec.get("flashinfer_error") else ""
            )
        lines.append(f"| {name} | {rec.get('ok')} | {rec.get('s')} | {str(note)[:200].replace('|', '/')} |")
    return lines + [""]


def _table_sections(r: dict) -> list[str]:
    fast = r.get("fast_backend", "flashinfer")
    s = r.get("sections", {})
    lines = ["| section | passed | s | note |", "|---|---|---|---|"]
    for name, sec in s.items():
        note = sec.get("skipped") or sec.get("timeout") or sec.get("error") or ""
        lines.append(f"| {name} | {sec.get('passed')} | {sec.get('s')} | {str(note)[:160].replace('|', '/')} |")
    lines.append("")
    if s.get("attention", {}).get("cases"):
        lines += [
            "| heads | page | kind | fast vs f32 | torch vs f32 | fast vs torch | ok |",
            "|---|---|---|---|---|---|---|",
        ]
        for x in s["attention"]["cases"]:
            lines.append(
                f"| {x['heads']} | {x['page_size']} | {x['kind']} | {x[fast + '_vs_f32']:.1e} | "
                f"{x['torch_vs_f32']:.1e} | {x[fast + '_vs_torch']:.1e} | {x['passed']} |"
            )
        lines.append("")
    runs = [x for x in s.get("greedy", {}).get("runs", []) if "all_equal" in x]
    if runs:
        lines += [
            "| model | page | all equal | passed | step-0 diff | noise | bound | hf equal | engine equal |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for x in runs:
            noise = x.get("noise_agreeing_steps")
            lines.append(
                f"| {x['model']} | {x['page_size']} | {x['all_equal']} | {x['passed']} | "
                f"{x['max_logit_diff_step0']:.2e} | {'-' if noise is None else f'{noise:.2e}'} | "
                f"{x['max_logit_diff_bound']:.2e} | {x.get('transformers_equal_prompts')} | "
                f"{x.get('engine_equal_prompts', 'n/a')} |"
            )
        lines.append("")
    sp = s.get("speed", {})
    if sp.get("decode") or sp.get("prefill"):
        lines += ["| phase | batch | radixkv tok/s | transformers tok/s | x |", "|---|---|---|---|---|"]
        for x in sp.get("decode", []):
            lines.append(
                f"| decode | {x['batch']} | {x['radixkv_tok_s']:.0f} | {x['transformers_tok_s']:.0f} | {x['speedup']:.2f} |"
            )
        for x in sp.get("prefill", []):
            lines.append(
                f"| prefill {x['prompt_len']} | {x['prompts']} | {x['radixkv_tok_s']:.0f} | "
                f"{x['transformers_tok_s']:.0f} | {x['speedup']:.2f} |"
            )
        lines.append("")
    if s.get("bandwidth", {}).get("cases"):
        lines += ["| backend | heads | page | batch x ctx | us | TB/s | % of 4.8 |", "|---|---|---|---|---|---|---|"]
        for x in s["bandwidth"]["cases"]:
            lines.append(
                f"| {x['backend']} | {x['heads']} | {x['page_size']} | {x['batch']}x{x['context']} | "
                f"{x['us_per_call']:.0f} | {x['tbps']:.2f} | {100 * x['fraction_of_peak']:.0f} |"
            )
        lines.append("")
    eng = s.get("engine", {})
    if eng.get("runs"):
        wl = eng.get("workload", {})
        lines += [
            f"engine: {wl.get('groups')} groups x {wl.get('per_group')} prompts, system {wl.get('system_len')} + "
            f"question {wl.get('question_len')} tokens, {wl.get('output_len')} output tokens, {wl.get('model')}",
            "",
            "| prefix cache | prefill tokens | expected | exact | output tok/s | incl. warm | TTFT p50 ms | p99 ms | hit rate |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for mode, x in eng["runs"].items():
            if "prefill_tokens" not in x:
                lines.append(f"| {mode} | (did not finish) | | | | | | | |")
                continue
            lines.append(
                f"| {mode} | {x['prefill_tokens']['total']} | {x['expected_prefill_tokens']['total']} | "
                f"{x['prefill_exact']} | {x['output_tok_s']:.0f} | {x['output_tok_s_incl_warm']:.0f} | "
                f"{x['ttft_ms']['p50']:.1f} | {x['ttft_ms']['p99']:.1f} | {x['hit_rate_main']:.3f} |"
            )
        if "tokens" in eng:
            t, cert, h = eng["tokens"], eng.get("certification", {}), eng.get("headline", {})
            lines.append("")
            lines.append(
                f"radix vs none greedy tokens: {t['main_equal']}/{t['requests']} requests equal (warm "
                f"{t['warm_equal']}/{len(t['warm_divergent_groups']) + t['warm_equal']}), divergences certified "
                f"as near ties: {cert.get('passed')} "
                f"(replay noise {cert.get('noise')})"
            )
            if h:
                lines.append(
                    f"headline: radix/none output tok/s x{h['throughput_x']:.2f} (incl. warm "
                    f"x{h['throughput_incl_warm_x']:.2f}), TTFT p50 x{h['ttft_p50_x']:.2f}, "
                    f"prefill tokens none/radix x{h['prefill_tokens_x']:.2f}"
                )
        lines.append("")
    return lines


def write_table(r: dict, out: Path) -> None:
    """gpu_check.md from the results dict (partial results too; never raises on missing keys)."""
    lines = [
        f"# radixkv GPU check ({r.get('mode')}): passed={r.get('passed')}",
        "",
        f"device: {r.get('device')}; versions: {json.dumps(r.get('versions'))}; wall {r.get('wall_s')} s "
        f"of a {r.get('budget_s')} s budget",
        "",
    ]
    for key in ("terminated", "watchdog", "error"):
        if r.get(key):
            lines += [f"**{key}**: {r[key]}", ""]
    if r.get("incomplete"):
        lines += [f"incomplete (figures cut short, not failed): {r['incomplete']}", ""]
    for part in (_table_setup, _table_sections):
        try:
            lines += part(r)
        except Exception as exc:  # noqa: BLE001 - a partial result must not lose the report
            lines += [f"({part.__name__} failed: {type(exc).__name__}: {exc})", ""]
    if "pytest" in r:
        p = r["pytest"]
        lines += [f"pytest: passed={p.get('passed')} rc={p.get('rc')} {p.get('summary')}", ""]
    tmp = Path(out) / "gpu_check.md.tmp"
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, Path(out) / "gpu_check.md")


def merge_pytest(args) -> int:
    """``--merge-pytest LOG --pytest-rc RC [--check-rc RC]``: fold gpu_check.sh's pytest step into
    gpu_check.json / .md. pytest passes when rc is 0, nothing failed or errored, something passed
    and, in gpu mode, nothing was skipped (the gpu-marked tests skip when CUDA or flashinfer is
    unusable, which must not read as a pass). Exit status 0 only when everything passed."""
    out = Path(args.out)
    path = out / "gpu_check.json"
    try:
        res = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        res = {
            "passed": False,
            "mode": "gpu" if not args.cpu else "cpu-dry-run",
            "setup": {"ok": False, "fatal": "gpu_check.py", "steps": {}},
            "sections": {},
            "error": f"gpu_check.json unreadable after the check ({type(exc).__name__}: {exc}); see gpu_check.log",
        }
    log = Path(args.merge_pytest)
    counts = parse_pytest_summary(log.read_text(errors="replace") if log.is_file() else "")
    rc = args.pytest_rc
    ok = rc == 0 and counts["failed"] == 0 and counts["errors"] == 0 and counts["passed"] > 0
    if res.get("mode") == "gpu":
        ok = ok and counts["skipped"] == 0
    res["pytest"] = {"rc": rc, **counts, "passed": bool(ok), "log": log.name}
    res.setdefault("check_passed", bool(res.get("passed")))
    if args.check_rc is not None:
        res["check_rc"] = args.check_rc
    res["passed"] = bool(res["check_passed"] and ok and args.check_rc in (None, 0))
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "gpu_check.json.tmp"
    tmp.write_text(json.dumps(res, indent=1, default=str) + "\n")
    os.replace(tmp, path)
    write_table(res, out)
    print(
        f"gpu check: passed={res['passed']} (check {res['check_passed']}, rc {args.check_rc}; "
        f"pytest {ok}: rc {rc}, {counts['summary'] or 'no summary line'})",
        flush=True,
    )
    return 0 if res["passed"] else 1


def _cap_arg(text: str) -> tuple[str, float]:
    name, _, secs = text.partition("=")
    if name not in SECTIONS:
        raise argparse.ArgumentTypeError(f"{text!r}: unknown section (known: {', '.join(SECTIONS)})")
    try:
        return name, float(secs)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: not SECTION=seconds") from None


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="radixkv FlashInfer GPU check (see the module docstring)")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results/tmp/gpu_check"))
    ap.add_argument("--carry", default=None, help="folder made by bench/prepare_gpu_carry.py (e.g. .fi)")
    ap.add_argument("--cpu", action="store_true", help="dry run on CPU with the torch backend, tiny sizes")
    ap.add_argument("--atol", type=float, default=None, help="bound on max |backend - f32 reference|")
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument(
        "--budget",
        type=float,
        default=None,
        help=f"seconds for everything (default {DEFAULT_BUDGET_S:.0f}, cpu {CPU_BUDGET_S:.0f})",
    )
    ap.add_argument(
        "--allow-jit",
        action="store_true",
        help="let FlashInfer compile missing modules (unsets FLASHINFER_DISABLE_JIT)",
    )
    ap.add_argument(
        "--cap", action="append", default=[], type=_cap_arg, metavar="SECTION=S", help="override a section's cap (s)"
    )
    ap.add_argument("--merge-pytest", default=None, metavar="LOG", help="fold a pytest log into --out's JSON and exit")
    ap.add_argument("--pytest-rc", type=int, default=None)
    ap.add_argument("--check-rc", type=int, default=None)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.merge_pytest is not None:
        return merge_pytest(args)
    c = Check(args)
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.signal(signal.SIGTERM, _on_term)
    signal.signal(signal.SIGINT, _on_term)
    disarm = start_watchdog(c)
    c.save()  # a JSON exists from the first second on
    try:
        names = [n for n in args.sections.split(",") if n]
        unknown = [n for n in names if n not in SECTION_FNS]
        if unknown:
            raise ValueError(f"--sections: unknown {unknown}; known {list(SECTIONS)}")
        if setup(c):
            run_sections(c, names)
        else:
            for n in names:
                c.res["sections"][n] = {"passed": False, "skipped": f"set-up step {c.res['setup']['fatal']!r} failed"}
    except Terminated as exc:
        c.res["terminated"] = f"{exc} after {c.elapsed():.0f} s; sections so far are kept"
        c.log(c.res["terminated"])
    except BaseException as exc:  # noqa: BLE001 - whatever escapes, the JSON says it
        c.res["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        c.res["traceback"] = traceback.format_exc()[-6000:]
        traceback.print_exc()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a late SIGTERM must not cut the last save
        try:
            finalize(c)
        except Exception as exc:  # noqa: BLE001 - only a report
            c.res["jit"] = {"error": f"{type(exc).__name__}: {exc}"}
        c.res["passed"] = overall_passed(c.res)
        c.save()
        write_table(c.res, c.out)
        disarm.set()
    c.log(f"passed={c.res['passed']} -> {c.out}/gpu_check.json")
    print((c.out / "gpu_check.md").read_text(), flush=True)
    return 0 if c.res["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
