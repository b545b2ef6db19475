"""docs/branching.md's tree-of-thought program, measured: fork 4 thoughts, select the best,
continue it; prefill tokens with the branching API (sessions, radix cache) vs the same program
written as independent requests with prefix caching off.

The program (default model, greedy except the thoughts):

1. ``s = llm.session([question])``: a chat session on one question;
2. ``thoughts = s.fork(4)``; ``thoughts.chat(None, params)``: four replies sampled at
   temperature 0.8 with seeds 0..3, as one batch;
3. ``s.select(texts, append=False)``: each thought's likelihood as the reply (length-normalized);
4. ``thoughts[best].chat("So what is the answer? ...")``: the chosen thought's session goes on.

The independent version submits the very same token sequences (taken from the branching run's
outputs) as plain requests to an engine with ``prefix_cache="none"``, in the same batches.
Writes ``bench/results/branching_tot_<UTC time>.json``.

Usage: ``python bench/branching_tot.py [--questions N]`` (a few minutes on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.results_io import write_result  # noqa: E402

QUESTIONS = [
    "A farmer has 17 sheep and all but 9 run away. How many sheep are left? Think step by step.",
    "If a train leaves at 3 pm and the trip takes 2 hours and 45 minutes, when does it arrive? Think step by step.",
    "Tom has twice as many apples as Ann, and together they have 18. How many does Tom have? Think step by step.",
]
FOLLOW_UP = "So what is the final answer? Reply with just the answer."


def branching_program(llm, question: str, thought_tokens: int, answer_tokens: int):
    """The program on the branching API; returns (the token sequences of each stage's requests,
    the answer text, the selected index, prefill tokens computed)."""
    from radixkv import SamplingParams

    before = llm.cache_stats()["prefill_tokens"]
    with llm.session([{"role": "user", "content": question}]) as s:
        with s.fork(4) as thoughts:
            params = [SamplingParams(temperature=0.8, seed=i, max_tokens=thought_tokens) for i in range(4)]
            outs = thoughts.chat(None, params)
            texts = [o.outputs[0].text for o in outs]
            best = s.select(texts, append=False)
            choice_ids = [sc.token_ids for sc in best.scores]
            select_prompts = [outs[0].prompt_token_ids + c for c in choice_ids]
            final = thoughts[best.index].chat(FOLLOW_UP, SamplingParams(temperature=0, max_tokens=answer_tokens))
    stages = [
        ([o.prompt_token_ids for o in outs], params),
        (select_prompts, None),
        ([final.prompt_token_ids], SamplingParams(temperature=0, max_tokens=answer_tokens)),
    ]
    stats = llm.cache_stats()
    assert stats["pinned"] == 0 and stats["protected"] == 0
    return stages, final.outputs[0].text, best.index, stats["prefill_tokens"] - before


def independent_program(llm, stages):
    """The same token sequences as independent requests (one batch per stage); prefill tokens."""
    from radixkv import SamplingParams

    before = llm.cache_stats()["prefill_tokens"]
    outs = None
    for prompts, params in stages:
        if params is None:  # the select stage: one token each, prompt logprobs of the choices
            params = SamplingParams(
                max_tokens=1, temperature=0, prompt_logprobs=0, logprob_start_len=len(stages[0][0][0])
            )
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return outs[0].outputs[0].text, llm.cache_stats()["prefill_tokens"] - before


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--questions", type=int, default=len(QUESTIONS))
    ap.add_argument("--thought-tokens", type=int, default=48)
    ap.add_argument("--answer-tokens", type=int, default=16)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from radixkv import LLM
    from radixkv.models import load_model

    loaded = load_model("smollm2-135m", "cpu", torch.float32)
    branching = LLM(device="cpu", loaded_model=loaded, max_total_tokens=8192)
    independent = LLM(device="cpu", loaded_model=loaded, max_total_tokens=8192, prefix_cache="none")
    rows = []
    for q in QUESTIONS[: args.questions]:
        t0 = time.perf_counter()
        stages, answer, best, pre_b = branching_program(branching, q, args.thought_tokens, args.answer_tokens)
        t1 = time.perf_counter()
        answer_i, pre_i = independent_program(independent, stages)
        t2 = time.perf_counter()
        row = dict(
            question=q,
            selected=best,
            answer=answer,
            answer_independent=answer_i,
            requests=sum(len(p) for p, _ in stages),
            prompt_tokens=sum(len(x) for p, _ in stages for x in p),
            prefill_branching=pre_b,
            prefill_independent=pre_i,
            ratio=pre_i / pre_b,
            wall_branching_s=t1 - t0,
            wall_independent_s=t2 - t1,
        )
        rows.append(row)
        print(
            f"prefill {pre_b:5d} (sessions, radix) vs {pre_i:5d} (independent, no cache) = {pre_i / pre_b:.2f}x  "
            f"wall {t1 - t0:.1f} s vs {t2 - t1:.1f} s  selected {best}  answer {answer!r}",
            flush=True,
        )
    out = dict(
        thought_tokens=args.thought_tokens,
        answer_tokens=args.answer_tokens,
        threads=torch.get_num_threads(),
        rows=rows,
        total_branching=sum(r["prefill_branching"] for r in rows),
        total_independent=sum(r["prefill_independent"] for r in rows),
    )
    path = write_result("branching_tot", out, args.out, argv=argv)
    print(f"total prefill {out['total_branching']} vs {out['total_independent']}; wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
