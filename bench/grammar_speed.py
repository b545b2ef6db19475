"""Grammar overhead: decode step time with every row under a JSON-schema grammar vs none, same run.

Two engines share the default model's weights: one decodes ``--batch`` free requests (no
constraint), the other ``--batch`` requests each under one of a few JSON schemas whose outputs
are long enough that no row finishes while timed (arrays of at least 50 objects). Their steps
alternate one by one (free, grammar, free, ...), so a shared machine's slowly varying load hits
both modes alike. Only steps in which all ``--batch`` rows decode (one token each, no prefill)
count, each timed as one ``Engine.step()`` (forward, grammar masks, sampling, matcher advance,
stop checks); the grammars compile before timing starts. Prints the median step time of each
mode, their ratio grammar / free (the target is <= 1.10 on CPU) and the grammar work itself
(bitmask fill + mask apply + matcher advance) per step, measured inside the same steps.

    python bench/grammar_speed.py                      # batch 16, 3 rounds of 40 step pairs
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


class _Mode:
    """One engine and the requests it decodes in a round."""

    def __init__(self, engine: Engine, batch: int) -> None:
        self.engine = engine
        self.batch = batch
        self.last = None
        self.times: list = []
        self.gwork: list = []
        engine.events.subscribe(self._seen, kinds=(StepFinished,))

    def _seen(self, e) -> None:
        self.last = e

    def start(self, prompts, params_list) -> None:
        self.rids = [self.engine.add_request(p, sp) for p, sp in zip(prompts, params_list)]
        while True:  # prefill (untimed) until every row decodes
            self.last = None
            self.engine.step()
            e = self.last
            if e is not None and len(e.samples) == self.batch and all(x == 1 for x in e.extend_lens):
                return

    def timed_step(self, timer: "_GrammarTimer", keep: bool) -> None:
        timer.t = 0.0
        self.last = None
        t0 = time.perf_counter()
        outs = self.engine.step()
        dt = time.perf_counter() - t0
        e = self.last
        if any(o.finished for o in outs):
            raise RuntimeError("a request finished during a timed round; raise minItems or lower --steps")
        if keep and e is not None and len(e.samples) == self.batch and e.prefill_tokens == 0:
            self.times.append(dt)
            self.gwork.append(timer.t)

    def stop(self) -> None:
        for r in self.rids:
            self.engine.abort_request(r)
        while self.engine.has_unfinished_requests():
            self.engine.step()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds (each --steps free/grammar step pairs)")
    ap.add_argument("--steps", type=int, default=40, help="timed step pairs per round")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model("smollm2-135m", "cpu", torch.float32)
    cfg = dict(device="cpu", max_total_tokens=args.batch * 1024, max_running_requests=args.batch)
    free = _Mode(Engine(EngineConfig(**cfg), loaded_model=loaded), args.batch)
    gram = _Mode(Engine(EngineConfig(**cfg), loaded_model=loaded), args.batch)
    tok = loaded.tokenizer
    schemas = _schemas()
    prompts = []
    for i in range(args.batch):
        msg = [{"role": "user", "content": f"List record {i}: write a long JSON list of records."}]
        prompts.append(tok.apply_chat_template(msg, add_generation_prompt=True, tokenize=True, return_dict=False))
    budget = args.steps + 16

    def params(constrained: bool, rnd: int) -> list:
        out = []
        for i in range(args.batch):
            kw = dict(temperature=args.temperature, seed=1000 * rnd + i, max_tokens=budget)
            if constrained:
                kw["json_schema"] = schemas[i % len(schemas)]
            else:
                kw["ignore_eos"] = True
            out.append(SamplingParams(**kw))
        return out

    for p in params(True, 0)[: len(schemas)]:  # compile before timing
        gram.engine.grammars.compile(p.structured_output).result()
    timer = _GrammarTimer()
    print(f"threads {torch.get_num_threads()}, batch {args.batch}, {args.rounds} rounds x {args.steps} step pairs")
    for rnd in range(args.rounds + 1):  # round 0 warms up, untimed
        free.start(prompts, params(False, rnd))
        gram.start(prompts, params(True, rnd))
        n0f, n0g = len(free.times), len(gram.times)
        for _ in range(args.steps if rnd else 4):
            free.timed_step(timer, keep=rnd > 0)
            gram.timed_step(timer, keep=rnd > 0)
        free.stop()
        gram.stop()
        if rnd:
            f = statistics.median(free.times[n0f:])
            g = statistics.median(gram.times[n0g:])
            print(f"  round {rnd}: free {f * 1e3:7.2f} ms, grammar {g * 1e3:7.2f} ms, ratio {g / f:.3f}")
    f, g = statistics.median(free.times), statistics.median(gram.times)
    summary = {
        "batch": args.batch,
        "threads": torch.get_num_threads(),
        "steps_per_mode": len(free.times),
        "free_step_ms": round(f * 1e3, 2),
        "grammar_step_ms": round(g * 1e3, 2),
        "grammar_work_ms": round(statistics.median(gram.gwork) * 1e3, 3),
        "ratio": round(g / f, 3),
        "compiles": gram.engine.grammars.num_compiles,
    }
    print(json.dumps(summary))
    print(f"decode step, batch {args.batch}: grammar / free = {g / f:.3f}x (target <= 1.10)")


if __name__ == "__main__":
    main()
