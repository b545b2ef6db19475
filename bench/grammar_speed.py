"""Grammar overhead: decode step time with every row under a JSON-schema grammar vs none, same run.

Two engines share the default model's weights: one decodes ``--batch`` free requests (no
constraint), the other ``--batch`` requests each under one of a few JSON schemas whose outputs
are long enough that no row finishes while timed (arrays of at least 50 objects). Their steps
alternate one by one (free, grammar, free, ...), so a shared machine's slowly varying load hits
both modes alike. Only steps in which all ``--batch`` rows decode (one token each, no prefill)
count, each timed as one ``Engine.step()`` (forward, grammar masks, sampling, matcher advance,
stop checks); the grammars compile before timing starts. Prints the median step time of each
mode, the median over step pairs of grammar / free (the headline; the target is <= 1.10 on CPU;
which mode of a pair runs first alternates), the ratio of the medians, and the grammar work itself
(batched bitmask fill + mask apply + batched matcher advance) per step, measured inside the same
steps, also as a share of a free step (the overhead with the machine's load taken out). Writes
``bench/results/grammar_speed_<UTC time>.json``.

    python bench/grammar_speed.py                      # batch 16, 3 rounds of 40 step pairs
    python bench/grammar_speed.py --batch 16 --rounds 5 --steps 48 --temperature 0
"""

from __future__ import annotations

import argparse
import json
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

from bench.results_io import write_result  # noqa: E402
from radixkv import SamplingParams  # noqa: E402
from radixkv.config import EngineConfig  # noqa: E402
from radixkv.engine import Engine, StepFinished  # noqa: E402
from radixkv.models import load_model  # noqa: E402
from radixkv.sampling import grammar as grammar_mod  # noqa: E402
from radixkv.sampling import pipeline as pipeline_mod  # noqa: E402


def _xgr_version() -> str:
    from importlib.metadata import version

    return version("xgrammar")


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
    """Accumulates the time spent in grammar work (batched bitmask fill, mask apply, batched
    matcher advance) by wrapping the three functions the pipeline calls; read and reset per step."""

    def __init__(self) -> None:
        self.t = 0.0
        timer = self

        def timed(fn):
            def run(*a, **k):
                t0 = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    timer.t += time.perf_counter() - t0

            return run

        for name in ("fill_bitmasks", "apply_token_bitmask", "accept_tokens"):
            setattr(pipeline_mod, name, timed(getattr(grammar_mod, name)))


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

    def timed_step(self, timer: "_GrammarTimer", keep: bool) -> "float | None":
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
            return dt
        return None

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
    ap.add_argument(
        "--out", default=None, help="result JSON (default bench/results/grammar_speed_<UTC>.json; - for none)"
    )
    args = ap.parse_args()
    load0 = list(os.getloadavg())
    pairs: list = []
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
        for k in range(args.steps if rnd else 4):
            # alternate which mode goes first, so a step's position in the pair biases neither
            if k % 2 == 0:
                tf, tg = free.timed_step(timer, keep=rnd > 0), gram.timed_step(timer, keep=rnd > 0)
            else:
                tg, tf = gram.timed_step(timer, keep=rnd > 0), free.timed_step(timer, keep=rnd > 0)
            if tf is not None and tg is not None:
                pairs.append(tg / tf)
        free.stop()
        gram.stop()
        if rnd:
            f = statistics.median(free.times[n0f:])
            g = statistics.median(gram.times[n0g:])
            print(f"  round {rnd}: free {f * 1e3:7.2f} ms, grammar {g * 1e3:7.2f} ms, ratio {g / f:.3f}")
    f, g = statistics.median(free.times), statistics.median(gram.times)
    gw = statistics.median(gram.gwork)
    pair_ratio = statistics.median(pairs)
    summary = {
        "batch": args.batch,
        "threads": torch.get_num_threads(),
        "temperature": args.temperature,
        "steps_per_mode": len(free.times),
        "free_step_ms": round(f * 1e3, 2),
        "grammar_step_ms": round(g * 1e3, 2),
        "ratio_of_medians": round(g / f, 3),
        "median_pair_ratio": round(pair_ratio, 3),
        "grammar_work_ms": round(gw * 1e3, 3),
        "grammar_work_share_of_free_step": round(gw / f, 4),
        "compiles": gram.engine.grammars.num_compiles,
        "loadavg_start": load0,
        "loadavg_end": list(os.getloadavg()),
        "xgrammar": _xgr_version(),
        "torch": torch.__version__,
    }
    print(json.dumps(summary))
    print(
        f"decode step, batch {args.batch}: grammar / free = {pair_ratio:.3f}x (median of adjacent-step ratios; "
        f"ratio of medians {g / f:.3f}x; target <= 1.10); grammar work {gw * 1e3:.2f} ms = "
        f"{100 * gw / f:.2f}% of a free step"
    )
    if args.out != "-":
        print(f"wrote {write_result('grammar_speed', summary, args.out)}")


if __name__ == "__main__":
    main()
