"""Grammar overhead: decode step time with every row under a JSON-schema grammar vs none, same run.

``--batch`` requests (default 16) decode together on the default model; rounds alternate between
"free" (no constraint) and "grammar" (each row under one of a few JSON schemas whose outputs are
long enough that no row finishes during the round: an array of at least 50 objects). Only steps
in which all ``--batch`` rows decode (one token each, no prefill) are timed, each as the wall
time of one ``Engine.step()`` (forward, grammar masks, sampling, matcher advance, stop checks);
the grammars are compiled in an untimed warm-up round. Prints the median step time of each mode
and their ratio grammar / free (the target is <= 1.10 on CPU), plus the grammar work itself
(bitmask fill + apply + accept) per step, measured inside the same steps.

    python bench/grammar_speed.py                      # batch 16, 3 rounds of 40 steps per mode
    python bench/grammar_speed.py --batch 16 --rounds 5 --steps 48 --temperature 0
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from radixkv import SamplingParams
from radixkv.config import EngineConfig
from radixkv.engine import Engine, StepFinished
from radixkv.models import load_model
from radixkv.sampling import grammar as grammar_mod
from radixkv.sampling import pipeline as pipeline_mod


def _schemas() -> list[dict]:
    item = {
        "type": "object",
        "properties": {"id": {"type": "integer"}, "name": {"type": "string"}, "ok": {"type": "boolean"}},
        "required": ["id", "name", "ok"],
        "additionalProperties": False,
    }
    return [
        {"type": "array", "items": item, "minItems": 50},
        {
            "type": "object",
            "properties": {"rows": {"type": "array", "items": item, "minItems": 50}, "total": {"type": "number"}},
            "required": ["rows", "total"],
            "additionalProperties": False,
        },
        {"type": "array", "items": {"type": "array", "items": {"type": "number"}, "minItems": 3}, "minItems": 60},
        {"type": "array", "items": {"enum": ["alpha", "beta", "gamma", "delta"]}, "minItems": 200},
    ]


class _GrammarTimer:
    """Accumulates the time spent in grammar work (fill, apply, accept) by wrapping the three
    module functions the pipeline calls; read and reset per step."""

    def __init__(self) -> None:
        self.t = 0.0
        fill, accept = grammar_mod.GrammarState.fill, grammar_mod.GrammarState.accept
        apply = pipeline_mod.apply_token_bitmask
        timer = self

        def timed(fn):
            def run(*a, **k):
                t0 = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    timer.t += time.perf_counter() - t0

            return run

        grammar_mod.GrammarState.fill = timed(fill)
        grammar_mod.GrammarState.accept = timed(accept)
        pipeline_mod.apply_token_bitmask = timed(apply)


def _round(engine: Engine, prompts, params_list, steps: int, batch: int, timer: _GrammarTimer):
    rids = [engine.add_request(p, sp) for p, sp in zip(prompts, params_list)]
    last: dict = {}
    unsubscribe = engine.events.subscribe(lambda e: last.__setitem__("e", e), kinds=(StepFinished,))
    times, gtimes = [], []
    while len(times) < steps and engine.has_unfinished_requests():
        timer.t = 0.0
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        e = last.get("e")
        if e is not None and len(e.samples) == batch and all(x == 1 for x in e.extend_lens) and e.prefill_tokens == 0:
            times.append(dt)
            gtimes.append(timer.t)
        if any(o.finished for o in outs):
            raise RuntimeError("a request finished during a timed round; raise minItems or lower --steps")
    unsubscribe()
    for r in rids:
        engine.abort_request(r)
    while engine.has_unfinished_requests():
        engine.step()
    return times, gtimes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per mode (alternating)")
    ap.add_argument("--steps", type=int, default=40, help="timed decode steps per round")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model("smollm2-135m", "cpu", torch.float32)
    cfg = EngineConfig(device="cpu", max_total_tokens=args.batch * 1024, max_running_requests=args.batch)
    engine = Engine(cfg, loaded_model=loaded)
    tok = loaded.tokenizer
    schemas = _schemas()
    prompts = []
    for i in range(args.batch):
        msg = [{"role": "user", "content": f"List record {i}: write a long JSON list of records."}]
        prompts.append(tok.apply_chat_template(msg, add_generation_prompt=True, tokenize=True, return_dict=False))
    budget = args.steps + 8

    def params(mode: str, rnd: int) -> list:
        out = []
        for i in range(args.batch):
            kw = dict(temperature=args.temperature, seed=1000 * rnd + i, max_tokens=budget, ignore_eos=True)
            if mode == "grammar":
                kw["json_schema"] = schemas[i % len(schemas)]
                kw.pop("ignore_eos")
            out.append(SamplingParams(**kw))
        return out

    timer = _GrammarTimer()
    print(f"threads {torch.get_num_threads()}, batch {args.batch}, {args.rounds} rounds x {args.steps} steps per mode")
    _round(engine, prompts, params("grammar", 0), 4, args.batch, timer)  # warm-up + compiles
    _round(engine, prompts, params("free", 0), 4, args.batch, timer)
    res: dict = {"free": [], "grammar": []}
    gwork: list = []
    for rnd in range(1, args.rounds + 1):
        for mode in ("free", "grammar"):
            t, g = _round(engine, prompts, params(mode, rnd), args.steps, args.batch, timer)
            res[mode].extend(t)
            if mode == "grammar":
                gwork.extend(g)
            print(f"  round {rnd} {mode:8s} median step {statistics.median(t) * 1e3:7.2f} ms over {len(t)} steps")
    free, gram = statistics.median(res["free"]), statistics.median(res["grammar"])
    summary = {
        "batch": args.batch,
        "threads": torch.get_num_threads(),
        "steps_per_mode": len(res["free"]),
        "free_step_ms": round(free * 1e3, 2),
        "grammar_step_ms": round(gram * 1e3, 2),
        "grammar_work_ms": round(statistics.median(gwork) * 1e3, 3),
        "ratio": round(gram / free, 3),
        "compiles": engine.grammars.num_compiles,
    }
    print(json.dumps(summary))
    print(f"decode step, batch {args.batch}: grammar / free = {gram / free:.3f}x (target <= 1.10)")


if __name__ == "__main__":
    main()
