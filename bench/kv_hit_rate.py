"""Hit rate at fixed KV memory per K/V dtype: compression as capacity (issue 35).

The same bytes hold 2x the tokens in bfloat16 and 3.88x in fp8 (scales included: 46,080 / 23,040 /
11,880 bytes per token for SmolLM2-135M). Measured two ways, at KV memory ``M`` = 5% and 10% of the
float32 working set of ShareGPT multi-turn conversations (the bytes an infinite float32 cache holds
at the end), each configuration sized with ``kv_cache_memory_bytes`` (tokens = bytes //
bytes_per_token, as the engine does):

* **simulator** (:mod:`radixkv.sim`, no model: slots are slots): ``--sim-conversations``
  conversations, turn by turn, ``--concurrency`` open at once, the engine's KV manager and radix
  tree; rows: float32 at M, 2M and 3.8M; bfloat16 and fp8_e4m3 at M.
* **replay** (``radixkv replay``'s :func:`~radixkv.replay.replay_mode` on the default model, the
  real engine, greedy replies): ``--replay-conversations`` conversations x ``--turns`` turns; the
  same rows. The replies of compressed K/V may differ from float32's, so the prompts may too.

Targets: bf16 at M within 0.5 point of float32 at 2M, fp8 within 0.5 point of float32 at 3.8M,
at both M.

    python bench/kv_hit_rate.py                          # simulator + replay (~15 min on 2 cores)
    python bench/kv_hit_rate.py --parts sim --sim-conversations 2000
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.results_io import write_result  # noqa: E402
from bench.workloads import make_workload  # noqa: E402
from radixkv.memory.kv_dtype import kv_token_bytes  # noqa: E402
from radixkv.sim import SimRequest, simulate  # noqa: E402

SHAPE = (30, 3, 64)  # SmolLM2-135M: layers, KV heads, head_dim
ROWS = [("float32", 1.0), ("float32", 2.0), ("float32", 3.8), ("bfloat16", 1.0), ("fp8_e4m3", 1.0)]
PAIRS = [("bfloat16", ("float32", 2.0)), ("fp8_e4m3", ("float32", 3.8))]


def bpt(kv: str) -> int:
    return kv_token_bytes(*SHAPE, kv)


def sim_part(args) -> dict:
    from radixkv.sim.sharegpt import load_conversations

    wl = make_workload(
        "multi_turn",
        data=load_conversations(),
        n_conversations=args.sim_conversations,
        concurrency=args.concurrency,
        max_context=2048,
    )
    reqs = [SimRequest(wl.full_prompt(i), r.reply, r.namespace) for i, r in enumerate(wl.requests)]
    ws_tokens = simulate(reqs, outcomes=False, keep_requests=False).cache_tokens_end
    out = {"requests": len(reqs), "working_set_tokens": ws_tokens, "cells": {}}
    for frac in args.fractions:
        mem = int(ws_tokens * bpt("float32") * frac)
        for kv, mult in ROWS:
            res = simulate(
                reqs,
                outcomes=False,
                keep_requests=False,
                kv_cache_memory_bytes=int(mem * mult),
                kv_bytes_per_token=bpt(kv),
            )
            out["cells"][f"{frac}/{kv}/{mult}"] = {"capacity_tokens": res.capacity, "hit_rate": res.hit_rate}
            print(f"sim M={frac:.0%} {kv:>9} x{mult}: {res.capacity:>8,} tokens  hit {res.hit_rate:.4f}", flush=True)
    return out


def replay_part(args) -> dict:
    from radixkv import LLM
    from radixkv.datasets import load_conversations
    from radixkv.models import load_model
    from radixkv.replay import replay_mode

    convs = load_conversations(args.replay_conversations, args.turns)
    loaded = load_model("smollm2-135m", "cpu", "float32")
    infinite = LLM(loaded_model=loaded, device="cpu", max_total_tokens=65536)
    base = replay_mode(infinite, convs, args.max_tokens, progress=False)
    ws_tokens = infinite.cache_stats()["cached"]
    del infinite
    out = {"requests": base["requests"], "prompt_tokens": base["prompt_tokens"], "working_set_tokens": ws_tokens}
    out["infinite_hit_rate"] = base["hit_rate"]
    out["cells"] = {}
    print(f"replay: {base['requests']} requests, working set {ws_tokens:,} tokens, infinite hit {base['hit_rate']:.4f}")
    for frac in args.fractions:
        mem = int(ws_tokens * bpt("float32") * frac)
        for kv, mult in ROWS:
            llm = LLM(loaded_model=loaded, device="cpu", kv_cache_dtype=kv, kv_cache_memory_bytes=int(mem * mult))
            row = replay_mode(llm, convs, args.max_tokens, progress=False)
            cap = llm.cache_stats()["capacity"]
            del llm
            out["cells"][f"{frac}/{kv}/{mult}"] = {"capacity_tokens": cap, "hit_rate": row["hit_rate"]}
            print(f"replay M={frac:.0%} {kv:>9} x{mult}: {cap:>7,} tokens  hit {row['hit_rate']:.4f}", flush=True)
    return out


def verdicts(part: dict, fractions) -> dict:
    out = {}
    for frac in fractions:
        for kv, (ref_kv, mult) in PAIRS:
            got = part["cells"][f"{frac}/{kv}/1.0"]["hit_rate"]
            ref = part["cells"][f"{frac}/{ref_kv}/{mult}"]["hit_rate"]
            out[f"M={frac} {kv} vs float32 x{mult}"] = {"points": 100 * (got - ref), "met": got >= ref - 0.005}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default="sim,replay")
    ap.add_argument("--fractions", type=float, nargs="*", default=[0.05, 0.10])
    ap.add_argument("--sim-conversations", type=int, default=4000)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--replay-conversations", type=int, default=48)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    started = time.time()
    result: dict = {"bytes_per_token": {kv: bpt(kv) for kv in ("float32", "bfloat16", "fp8_e4m3")}}
    for name, fn in (("sim", sim_part), ("replay", replay_part)):
        if name in args.parts.split(","):
            result[name] = fn(args)
            result[name]["targets"] = verdicts(result[name], args.fractions)
            for k, v in result[name]["targets"].items():
                print(f"{name} {k}: {v['points']:+.2f} points, {'met' if v['met'] else 'MISSED'}")
    print(f"wrote {write_result('kv_hit_rate', result, args.out, started=started)}")


if __name__ == "__main__":
    main()
