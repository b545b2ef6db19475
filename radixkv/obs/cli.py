"""``radixkv explain`` and ``radixkv plan``: arguments and runs (the console script is
:mod:`radixkv.cli`).

A TRACE is a JSONL file of OpenAI request bodies (:mod:`radixkv.obs.trace`), or a built-in
trace: ``synthetic:KIND[:N]`` (:func:`radixkv.obs.synthetic.agent_trace`, KIND one of
timestamp, uuid, user, tools, control; ``synthetic:KIND:N:fixed`` for the fixed version) or
``sharegpt:multi_turn[:CONVERSATIONS[:TURNS]]``
(:func:`radixkv.obs.synthetic.sharegpt_multi_turn_trace`).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import Any, Optional

from radixkv.memory.kv_dtype import KV_DTYPE_ALIASES, KV_DTYPES, canonical_kv_dtype

__all__ = ["add_explain_arguments", "run_explain", "add_plan_arguments", "run_plan", "load_bodies"]


def _kv_dtype_flag(value: str) -> str:
    """``--kv-dtype``: the spellings ``radixkv serve --kv-cache-dtype`` takes, lower-cased
    (``auto``: the engine's default, :func:`engine_kv_dtype`)."""
    if value.strip().lower() == "auto":
        return "auto"
    try:
        canonical_kv_dtype(value)
    except ValueError:
        names = list(KV_DTYPES) + sorted(KV_DTYPE_ALIASES)
        raise argparse.ArgumentTypeError(f"must be one of {names}, got {value!r}") from None
    return value.strip().lower()


def load_bodies(trace: str) -> tuple[list[dict], Optional[list[int]]]:
    """The request bodies of TRACE (module docstring) and, for a file, the line each is on
    (None for a built-in trace).

    Raises:
        ValueError: an unknown built-in trace, a directory or a malformed file. FileNotFoundError:
            no such file.
    """
    from radixkv.obs import synthetic
    from radixkv.obs.trace import read_trace_lines

    if trace.startswith("synthetic:"):
        parts = trace.split(":")[1:]
        if len(parts) > 3 or (len(parts) == 3 and parts[2] != "fixed"):
            raise ValueError(f"built-in synthetic traces: synthetic:KIND[:N[:fixed]], got {trace!r}")
        kind = parts[0]
        n = _count(trace, "N", parts[1]) if len(parts) > 1 and parts[1] else 40
        try:
            return synthetic.agent_trace(kind, n, fixed=len(parts) == 3), None
        except RuntimeError as exc:  # fewer ShareGPT questions than N
            raise ValueError(f"trace {trace!r}: {exc}") from None
    if trace.startswith("sharegpt:"):
        parts = trace.split(":")[1:]
        if parts[0] != "multi_turn" or len(parts) > 3:
            raise ValueError(f"built-in ShareGPT traces: sharegpt:multi_turn[:CONVERSATIONS[:TURNS]], got {trace!r}")
        convs = _count(trace, "CONVERSATIONS", parts[1]) if len(parts) > 1 else 24
        turns = _count(trace, "TURNS", parts[2]) if len(parts) > 2 else 4
        return synthetic.sharegpt_multi_turn_trace(convs, turns), None
    if Path(trace).is_dir():
        raise ValueError(f"trace {trace!r} is a directory, not a trace file (a JSONL file of request bodies)")
    if not Path(trace).is_file():
        raise FileNotFoundError(f"trace file {trace!r} not found")
    return read_trace_lines(trace)


def model_mismatch(bodies: list, model: str, flag: str) -> Optional[str]:
    """A warning when bodies of the trace name a ``model`` other than ``model``, the one whose
    tokenizer and chat template the replay uses (``flag`` sets it), or None. A warning, not an
    error: a server's ``--served-model-name`` is any alias, so a trace of the same model may name
    another; but a trace of another model is counted in this one's tokens, its volatile spans and
    hit rates are not the server's, and nothing else would say so."""
    names: dict = {}
    for b in bodies:
        name = b.get("model") if isinstance(b, dict) else None
        if isinstance(name, str) and name not in (model, os.path.basename(model.rstrip("/\\"))):
            names[name] = names.get(name, 0) + 1
    if not names:
        return None
    listed = ", ".join(f"{n!r} ({c:,} requests)" for n, c in sorted(names.items(), key=lambda x: -x[1])[:3])
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return (
        f"the trace names model {listed}{more}, not {model!r}, whose tokenizer and chat template the replay "
        f"uses: give {flag} (a model name, a .gguf or a Hugging Face directory) when it is another model "
        "(a --served-model-name alias of this one: nothing to do)"
    )


def _count(trace: str, name: str, text: str) -> int:
    """A count of a built-in trace's spec: an integer >= 1 (ValueError naming the trace)."""
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"trace {trace!r}: {name} must be an integer >= 1, got {text!r}")
    return int(text)


def check_writable(*paths: Optional[str]) -> None:
    """Raise ValueError for an output file (``--output``, ``--html``) whose folder does not exist
    or is not writable, before any work is done."""
    for p in [Path(p) for p in paths if p]:
        if not p.parent.is_dir() or not os.access(p.parent, os.W_OK) or p.is_dir():
            raise ValueError(f"cannot write {str(p)!r}: no such writable folder, or it is a folder")


def _capacity(s: str) -> Any:
    if s.lower() in ("inf", "infinite", "none"):
        return None
    try:
        v = int(s)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"capacity must be an integer >= 1 (tokens) or 'inf', got {s!r}")
    return v


def add_explain_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``radixkv explain``."""
    p.add_argument(
        "trace", help="JSONL file of OpenAI request bodies, or synthetic:KIND[:N] / sharegpt:multi_turn[:C[:T]]"
    )
    p.add_argument(
        "--model", default="smollm2-135m", help="tokenizer and chat template of this model (default %(default)s)"
    )
    p.add_argument("--policy", choices=["radix", "hash", "none"], default="radix", help="prefix cache (default radix)")
    p.add_argument(
        "--radix-eviction-policy", choices=["lru", "lfu", "gdf", "reuse-odds"], default="lru",
        help="the radix tree's eviction policy, as radixkv serve's flag (default: %(default)s)",
    )  # fmt: skip
    p.add_argument("--page-size", type=int, default=1, help="KV page size in tokens (default 1)")
    p.add_argument("--capacity", type=_capacity, default=32768, help="KV capacity in tokens, or 'inf' (default 32768)")
    p.add_argument("--top", type=int, default=5, help="prompts that miss most to show (default 5)")
    for tier in ("host", "disk", "remote"):
        p.add_argument(
            f"--{tier}-cache-tokens", type=int, default=None, metavar="TOKENS",
            help=f"a {tier} KV tier of TOKENS below the pool: which missed tokens it would serve (docs/tiers.md)",
        )  # fmt: skip
    _write_policy_argument(p, "--*-cache-tokens")
    p.add_argument("--no-what-if", action="store_true", help="skip replaying the volatile spans' rewrites")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of the summary")
    p.add_argument("--html", default=None, metavar="FILE", help="also write a self-contained HTML report")
    p.add_argument("--output", default=None, metavar="FILE", help="also write the JSON report to FILE")


def _write_policy_argument(p: argparse.ArgumentParser, tiers: str) -> None:
    p.add_argument(
        "--kv-tier-write-policy", default=None, metavar="POLICY",
        help=f"the {tiers} tiers' write policy, as radixkv serve takes it: write_through or write_back, or "
        "per tier as host=write_back,disk=write_through (default: write_back for host, write_through for the others)",
    )  # fmt: skip


def _write_policy(args: argparse.Namespace, tiers: dict) -> Any:
    """``--kv-tier-write-policy`` parsed and checked (ValueError: malformed, or without a tier)."""
    from radixkv.config import parse_write_policy, resolve_write_policy

    text = getattr(args, "kv_tier_write_policy", None)
    if text is None:
        return None
    if not tiers:
        raise ValueError("--kv-tier-write-policy needs a KV tier (--host-, --disk- or --remote-cache-...)")
    policy = parse_write_policy(text)
    resolve_write_policy(policy)
    return policy


def _check_tier_blocks(budgets: dict) -> None:
    """Refuse a tier budget that holds no whole block (``BLOCK_TOKENS`` tokens; the simulator's
    tiers, as the engine's, hold whole blocks): ``{flag: (value, one block, bytes per token)}``,
    the value and the block in tokens (bytes per token 1) or in bytes (the block's record in that
    tier, :func:`radixkv.obs.plan.tier_block_bytes`). ValueError naming the flag; 0 (no tier) is
    never passed here."""
    from radixkv.cache.digests import BLOCK_TOKENS

    for flag, (value, block, per_token) in budgets.items():
        if value < block:
            kv = BLOCK_TOKENS * per_token
            unit = (
                "tokens"
                if per_token == 1
                else f"bytes ({BLOCK_TOKENS} tokens x {per_token:,} bytes of KV and {block - kv:,} of its record)"
            )
            raise ValueError(
                f"{flag} {value:,} holds no block: a KV tier holds whole blocks of {block:,} {unit}; "
                "give at least that (or 0: no tier)"
            )


def run_explain(args: argparse.Namespace) -> int:
    """Run ``radixkv explain``; returns the exit code (2 for bad input)."""
    from radixkv.cache.digests import BLOCK_TOKENS
    from radixkv.models.loader import load_tokenizer
    from radixkv.obs.explain import explain_trace
    from radixkv.obs.report import explain_html, explain_text_report, to_json
    from radixkv.obs.trace import tokenize_trace

    for flag, value, low in (("--page-size", args.page_size, 1), ("--top", args.top, 0)):
        if value < low:
            print(f"radixkv explain: {flag} must be >= {low}, got {value}", file=sys.stderr)
            return 2
    if args.capacity is not None and args.capacity < args.page_size:  # the engine refuses such a pool
        print(f"radixkv explain: --capacity {args.capacity} holds no page of --page-size {args.page_size} tokens",
              file=sys.stderr)  # fmt: skip
        return 2
    evict = getattr(args, "radix_eviction_policy", "lru")
    if evict != "lru" and args.policy != "radix":
        print("radixkv explain: --radix-eviction-policy needs --policy radix", file=sys.stderr)
        return 2
    policy = args.policy if evict == "lru" else f"radix-{evict}"  # radixkv.sim's name of it
    try:
        check_writable(args.output, args.html)
        tiers = {m: getattr(args, f"{m}_cache_tokens") for m in ("host", "disk", "remote")
                 if getattr(args, f"{m}_cache_tokens", None)}  # fmt: skip
        if tiers and args.policy == "none":  # the engine refuses tiers without a prefix cache too
            raise ValueError(
                "KV tiers (--host-, --disk-, --remote-cache-tokens) need a prefix cache: not --policy none"
            )
        _check_tier_blocks({f"--{m}-cache-tokens": (t, BLOCK_TOKENS, 1) for m, t in tiers.items()})
        write_policy = _write_policy(args, tiers)
        bodies, lines = load_bodies(args.trace)
        note = model_mismatch(bodies, args.model, "--model")
        if note:
            print(f"radixkv explain: warning: {note}", file=sys.stderr)
        tok = load_tokenizer(args.model)
        invalid: list = []
        reqs = tokenize_trace(bodies, tok, invalid=invalid, lines=lines)
        if invalid:
            no, why = invalid[0]
            print(
                f"radixkv explain: skipped {len(invalid)} invalid request bodies (first: request {no}: {why})",
                file=sys.stderr,
            )
        if not reqs:
            raise ValueError("the trace has no valid request")
        rep = explain_trace(
            reqs,
            tok,
            policy=policy,
            page_size=args.page_size,
            capacity=args.capacity,
            top=max(args.top, 10),
            what_if=not args.no_what_if,
            source=args.trace,
            tiers=tiers or None,
            tier_write_policy=write_policy,
        )
    except (ValueError, FileNotFoundError) as exc:
        print(f"radixkv explain: {exc}", file=sys.stderr)
        return 2
    print(to_json(rep) if args.json else explain_text_report(rep, args.top))
    if args.output:
        Path(args.output).write_text(to_json(rep))
    if args.html:
        try:
            Path(args.html).write_text(explain_html(rep), encoding="utf-8")
        except ImportError as exc:
            print(f"radixkv explain: {exc}", file=sys.stderr)
            return 2
        print(f"wrote {args.html}", file=sys.stderr)
    return 0


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``radixkv plan``."""
    p.add_argument(
        "--model", default=None,
        help="an architecture of the table (llama-2-7b, llama-3-8b, llama-3-70b, mistral-7b, qwen2.5-7b, "
        "deepseek-v3, smollm2-135m), a config.json or its directory (default smollm2-135m)",
    )  # fmt: skip
    p.add_argument(
        "--kv-dtype",
        "--kv-cache-dtype",
        dest="kv_dtype",
        type=_kv_dtype_flag,
        default=None,
        help="float32, bfloat16/bf16, float16/fp16, fp8 (= fp8_e4m3), fp8_e5m2 or auto (default: auto, the engine's: "
        "its compute dtype, bfloat16 on a GPU (with --gpu-memory, or where CUDA is), else float32)",
    )
    p.add_argument(
        "--max-total-tokens", type=int, default=None, metavar="TOKENS",
        help="the engine's KV pool in tokens (as radixkv serve's flag): its bytes, and with --trace its hit rate",
    )  # fmt: skip
    p.add_argument(
        "--kv-cache-memory-bytes", type=_tier_bytes, default=None, metavar="BYTES",
        help="the engine's KV pool in bytes, e.g. 2GiB (as radixkv serve's flag, instead of --max-total-tokens): "
        "its tokens, and with --trace its hit rate",
    )  # fmt: skip
    p.add_argument(
        "--weight-dtype",
        default=None,
        help="with --gpu-memory: dtype of the weights, for their size (default bfloat16)",
    )
    p.add_argument("--gpu-memory", type=float, default=None, metavar="GB", help="GPU memory in GB: how many tokens fit")
    p.add_argument(
        "--memory-fraction", type=float, default=None, help="with --gpu-memory: share of it usable (default 0.9)"
    )
    p.add_argument(
        "--weights-gb", type=float, default=None,
        help="with --gpu-memory: size of the weights in GB (default: from the parameters)",
    )  # fmt: skip
    p.add_argument(
        "--page-size", type=int, default=None,
        help="with --gpu-memory or a pool size: the KV page size radixkv serve will run with; tokens fit in whole "
        "pages (default 1)",
    )  # fmt: skip
    p.add_argument(
        "--context", type=int, default=None, metavar="TOKENS", help="KV memory of one sequence of this length"
    )
    p.add_argument("--trace", default=None, help="a TRACE (as for explain): hit rate vs KV memory for it")
    p.add_argument("--target-hit-rate", type=float, default=None, help="KV memory needed to reach this hit rate (0-1)")
    p.add_argument(
        "--policies", default=None, help="simulated policies for --trace (default radix-p1,radix-p16,hash-b16)"
    )
    p.add_argument("--tokenizer", default=None, help="tokenizer for --trace (default smollm2-135m)")
    for tier, where in (("host", "host RAM"), ("disk", "local disk"), ("remote", "a shared Redis")):
        p.add_argument(
            f"--{tier}-cache-bytes", type=_tier_bytes, default=None, metavar="BYTES",
            help=f"with --trace: also the hit rate with a KV tier in {where} of BYTES (e.g. 8GiB; docs/tiers.md)",
        )  # fmt: skip
    _write_policy_argument(p, "--*-cache-bytes")
    p.add_argument(
        "--list", action="store_true",
        help="print the table of architectures (KV bytes per token, 1M tokens) in --kv-dtype and fp8, and nothing else",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--html", default=None, metavar="FILE", help="also write a self-contained HTML report")


def _tier_bytes(s: str) -> int:
    from radixkv.config import parse_bytes

    try:
        return parse_bytes(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _policies(s: str) -> list[tuple[str, int]]:
    out = []
    for item in s.split(","):
        m = re.fullmatch(r"(radix|hash|none)-[pb](\d+)", item.strip())
        if m is None or int(m.group(2)) < 1:
            raise ValueError(f"--policies items look like radix-p1, radix-p16, hash-b16; got {item!r}")
        out.append((m.group(1), int(m.group(2))))
    return out


def list_architectures(kv_dtypes=("bfloat16", "fp8")) -> str:
    """The architecture table with KV bytes per token and the KV of 1M tokens per dtype, and
    beside them radixkv's own KV pool's bytes per token in each dtype (fp8 scales included;
    "-" for a model radixkv does not load)."""
    from radixkv.obs.architectures import ARCHITECTURES
    from radixkv.obs.plan import GB, engine_bytes_per_token, load_spec

    head = f"{'model':<24}{'attention':<22}{'layers':>7}" + "".join(
        f"{'B/token ' + d:>18}{'1M tok ' + d:>16}" for d in kv_dtypes
    )
    head += "".join(f"{'radixkv B/tok ' + d:>24}" for d in kv_dtypes)
    lines = [head]
    for key in ARCHITECTURES:
        s = load_spec(key)
        row = f"{s.name:<24}{s.attention:<22}{s.num_layers:>7}"
        for d in kv_dtypes:
            row += f"{s.bytes_per_token(d):>18,}{s.sequence_bytes(10**6, d) / GB:>13,.1f} GB"
        for d in kv_dtypes:
            e = engine_bytes_per_token(s, d)
            row += f"{'-' if e is None else format(e, ','):>24}"
        lines.append(row)
    return "\n".join(lines)


PLAN_DEFAULTS = dict(
    model="smollm2-135m",
    kv_dtype="auto",
    weight_dtype="bfloat16",
    memory_fraction=0.9,
    page_size=1,
    policies="radix-p1,radix-p16,hash-b16",
    tokenizer="smollm2-135m",
)
"""The defaults of the ``radixkv plan`` flags whose parser default is None (so that giving one
where it does nothing is told apart from leaving it out)."""

PLAN_NEEDS = dict(
    memory_fraction="gpu_memory",
    weights_gb="gpu_memory",
    weight_dtype="gpu_memory",
    target_hit_rate="trace",
    policies="trace",
    tokenizer="trace",
    host_cache_bytes="trace",
    disk_cache_bytes="trace",
    remote_cache_bytes="trace",
    kv_tier_write_policy="trace",
)
"""``radixkv plan`` flags that only mean something beside another: ``dest -> dest it needs``."""


def _flag(dest: str) -> str:
    return "--kv-dtype" if dest == "kv_dtype" else "--" + dest.replace("_", "-")


def plan_flags_error(args: argparse.Namespace) -> Optional[str]:
    """Why the ``radixkv plan`` flags cannot be used as given (a flag that would do nothing), or
    None; then the flags left out get :data:`PLAN_DEFAULTS`."""

    def given(dest: str) -> bool:
        v = getattr(args, dest, None)
        return v is not None and v is not False  # 0 is given (and then refused by its own check)

    if args.list:
        pool = ("page_size", "max_total_tokens", "kv_cache_memory_bytes")
        others = [_flag(d) for d in ("model", "gpu_memory", "context", "json", "html", *PLAN_NEEDS, *pool) if given(d)]
        if others:
            return f"--list prints the architecture table only (with --kv-dtype); not with {', '.join(others)}"
    for dest, needs in PLAN_NEEDS.items():
        if given(dest) and not given(needs):
            return f"{_flag(dest)} needs {_flag(needs)}"
    sized = [d for d in ("gpu_memory", "max_total_tokens", "kv_cache_memory_bytes") if given(d)]
    if given("page_size") and not sized:
        return "--page-size needs --gpu-memory, --max-total-tokens or --kv-cache-memory-bytes"
    if given("max_total_tokens") and given("kv_cache_memory_bytes"):
        return "give --kv-cache-memory-bytes or --max-total-tokens, not both (as radixkv serve)"
    for dest, default in PLAN_DEFAULTS.items():
        if getattr(args, dest, None) is None:
            setattr(args, dest, default)
    args.kv_dtype_auto = args.kv_dtype == "auto"
    if args.kv_dtype_auto:  # --list: a table of GPU architectures (the engine's default there)
        args.kv_dtype = engine_kv_dtype(args.gpu_memory is not None or args.list)
    return None


def engine_kv_dtype(gpu: bool) -> str:
    """``--kv-dtype auto``: the engine's default K/V dtype (``kv_cache_dtype="auto"``: its compute
    dtype, ``dtype="auto"``): bfloat16 on CUDA (a plan with ``--gpu-memory``, or run where CUDA
    is), float32 on the CPU."""
    if not gpu:
        import torch

        gpu = torch.cuda.is_available()
    return "bfloat16" if gpu else "float32"


def _plan_trace(args: argparse.Namespace, spec: Any, pool: Optional[dict] = None) -> dict:
    """``radixkv plan --trace``'s part of the report: the flags checked first (ValueError naming
    one), then the trace tokenized and replayed: ``{"trace", "curve"[, "target"]}``."""
    from radixkv.config import asks_write_back
    from radixkv.models.loader import load_tokenizer
    from radixkv.obs.plan import (
        hit_rate_curve,
        memory_for_hit_rate,
        pool_bytes_per_token,
        pool_hit_rates,
        tier_block_bytes,
    )
    from radixkv.obs.trace import tokenize_trace

    pols = _policies(args.policies)
    tiers = {m: getattr(args, f"{m}_cache_bytes", None) for m in ("host", "disk", "remote")}
    tiers = {m: b for m, b in tiers.items() if b}
    if tiers and all(p == "none" for p, _ in pols):  # the engine refuses tiers without a prefix cache
        raise ValueError(
            "KV tiers (--host-, --disk-, --remote-cache-bytes) need a prefix cache: --policies has only none"
        )
    bpt = pool_bytes_per_token(spec, args.kv_dtype)  # a tier holds the pool's bytes per token
    block = tier_block_bytes(spec, args.kv_dtype)  # and a block's record around them
    _check_tier_blocks({f"--{m}-cache-bytes": (b, block[m], bpt) for m, b in tiers.items()})
    policy = _write_policy(args, tiers)
    hashed = [f"{p}-b{ps}" for p, ps in pols if p == "hash"]
    if tiers and hashed and asks_write_back(policy):
        raise ValueError(  # the engine refuses it: the hash cache does not report what it evicts
            f"--kv-tier-write-policy write_back needs radix policies (the hash cache's tiers are written "
            f"through); --policies has {', '.join(hashed)} (its default adds hash-b16): pass --policies "
            "radix-p1,radix-p16"
        )
    invalid: list = []
    bodies, _ = load_bodies(args.trace)
    note = model_mismatch(bodies, args.tokenizer, "--tokenizer")
    if note:
        print(f"radixkv plan: warning: {note}", file=sys.stderr)
    reqs = [r.sim_request() for r in tokenize_trace(bodies, load_tokenizer(args.tokenizer), invalid=invalid)]
    if invalid:
        no, why = invalid[0]
        print(
            f"radixkv plan: skipped {len(invalid)} invalid request bodies of the trace (first: request {no}: {why})",
            file=sys.stderr,
        )
    if not reqs:
        raise ValueError("the trace has no valid request")
    out: dict = dict(trace=dict(source=args.trace, requests=len(reqs), tokenizer=args.tokenizer))
    out["curve"] = hit_rate_curve(reqs, spec, args.kv_dtype, pols, tiers=tiers or None, write_policy=policy)
    if args.target_hit_rate is not None:
        out["target"] = [memory_for_hit_rate(reqs, spec, args.target_hit_rate, args.kv_dtype, p, ps) for p, ps in pols]
    if pool is not None:  # the engine's pool as --max-total-tokens / --kv-cache-memory-bytes size it
        t = {m: v["tokens"] for m, v in out["curve"].get("tiers", {}).items()}
        out["pool_hit_rate"] = pool_hit_rates(reqs, pool["tokens"], pols, t or None, policy)
    return out


def run_plan(args: argparse.Namespace) -> int:
    """Run ``radixkv plan``; returns the exit code (2 for bad input)."""
    from radixkv.obs.plan import load_spec, plan_memory
    from radixkv.obs.report import plan_html, plan_text_report, to_json

    why = plan_flags_error(args)
    if why is not None:
        print(f"radixkv plan: {why}", file=sys.stderr)
        return 2
    try:
        if args.list:
            fp8 = canonical_kv_dtype(args.kv_dtype) == "fp8_e4m3"  # fp8 and fp8_e4m3: one column, and bfloat16
            print(list_architectures(("bfloat16", "fp8") if fp8 else (args.kv_dtype, "fp8")))
            return 0
        check_writable(args.html)
        model = args.model
        if model.endswith(".gguf"):
            from radixkv.models.loader import resolve_hf_dir

            model = str(resolve_hf_dir(model))
        spec = load_spec(model)
        rep = plan_memory(
            spec, args.kv_dtype, args.weight_dtype, args.gpu_memory, args.memory_fraction, args.weights_gb, args.context,
            args.page_size, args.max_total_tokens, args.kv_cache_memory_bytes,
        )  # fmt: skip
        rep["kv_dtype_auto"] = args.kv_dtype_auto
        if args.trace:
            rep.update(_plan_trace(args, spec, rep.get("pool")))
    except (ValueError, FileNotFoundError) as exc:
        print(f"radixkv plan: {exc}", file=sys.stderr)
        return 2
    print(to_json(rep) if args.json else plan_text_report(rep))
    if args.html:
        try:
            Path(args.html).write_text(plan_html(rep), encoding="utf-8")
        except ImportError as exc:
            print(f"radixkv plan: {exc}", file=sys.stderr)
            return 2
        print(f"wrote {args.html}", file=sys.stderr)
    return 0
