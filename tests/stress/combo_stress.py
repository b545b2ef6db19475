"""Exploratory differential stress harness (not a test): a reference engine (defaults) vs a
"loaded" one with every feature on at once, fed ShareGPT text in random interleavings.

python tests/stress/combo_stress.py [--seed S] [--rounds R] [--kv float32|bfloat16] [--model default|tiny]
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
import tempfile
import time

sys.path.insert(0, "tests")

import torch  # noqa: E402
from test_combined_features import NAMESPACES, SCHEMA  # noqa: E402  (one copy of the shared inputs)

from radixkv.config import EngineConfig  # noqa: E402
from radixkv.engine import Engine  # noqa: E402
from radixkv.sampling_params import SamplingParams  # noqa: E402


def build_prompts(tok, n_conv, turns, max_len):
    from radixkv.datasets import load_conversations

    convs = load_conversations(n_conv, turns, max_user_chars=600)
    prompts = []
    for conv in convs:
        msgs = []
        for i, u in enumerate(conv):
            msgs.append({"role": "user", "content": u})
            ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
            if hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            ids = list(ids)[:max_len]
            prompts.append(ids)
            msgs.append({"role": "assistant", "content": f"Reply number {i} to that."})
    return prompts


def random_params(rng):
    """A random combination of sampling features."""
    kw = dict(max_tokens=rng.choice([1, rng.randint(2, 24)]))
    tags = []
    if rng.random() < 0.4:
        kw.update(temperature=0.8, top_p=0.95, seed=rng.randrange(1000))
        tags.append("seeded")
    else:
        kw.update(temperature=0)
    if rng.random() < 0.3:
        kw["n"] = rng.randint(2, 3)
        if kw["temperature"] == 0:
            kw.update(temperature=0.7, seed=rng.randrange(1000))
        tags.append("n")
    if rng.random() < 0.3:
        kw.update(logprobs=2)
        tags.append("logprobs")
    if rng.random() < 0.15:
        kw.update(prompt_logprobs=1)
        tags.append("plp")
    if rng.random() < 0.25:
        kw["stop"] = ["the", "."]
        tags.append("stop")
    if rng.random() < 0.15:
        kw.update(json_schema=SCHEMA, max_tokens=rng.choice([3, 24]))
        tags.append("json")
    if rng.random() < 0.1:
        kw.update(repetition_penalty=1.2, presence_penalty=0.3)
        tags.append("pen")
    return "+".join(tags) or "greedy", SamplingParams(**kw)


def summarize(out):
    return [(c.token_ids, c.text, c.finish_reason) for c in out.outputs]


def lps(out):
    return [c.logprobs for c in out.outputs], out.prompt_logprobs


def run_alone(ref, prompt, params, ns):
    params = dataclasses.replace(params, logprobs=max(2, params.logprobs or 0))
    rid = ref.add_request(prompt, params, namespace=ns)
    done = None
    while ref.has_unfinished_requests():
        for o in ref.step():
            if o.finished and o.request_id == rid:
                done = o
    ref.reset_prefix_cache()
    return done


def close_lp(a, b):
    if a is None or b is None or len(a) != len(b):
        return a is None and b is None
    for x, y in zip(a, b):
        for t in set(x) & set(y):
            if abs(x[t].logprob - y[t].logprob) > 1e-3:
                return False
    return True


def near_tie(got, exp):
    """The first divergence of ``got`` from the reference sample ``exp`` is at a near-tie."""
    e = exp
    for i, (a, b) in enumerate(zip(got, e.token_ids)):
        if a != b:
            top = sorted((lp.logprob for lp in e.logprobs[i].values()), reverse=True)
            return len(top) >= 2 and top[0] - top[1] < 2e-3
    return False


def check_counts(out):
    by = out.cached_tokens_by_tier
    assert sum(by.values()) == out.num_cached_tokens, (out.request_id, out.num_cached_tokens, by)
    assert 0 <= out.num_cached_tokens < len(out.prompt_token_ids) or (
        out.num_cached_tokens == len(out.prompt_token_ids)
    ), (out.num_cached_tokens, len(out.prompt_token_ids))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--kv", default="float32")
    ap.add_argument("--model", default="default")
    ap.add_argument("--pool", type=int, default=768)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=48)
    ap.add_argument("--conv", type=int, default=6)
    ap.add_argument("--maxlen", type=int, default=300)
    ap.add_argument("--nospec", action="store_true")
    ap.add_argument("--cache", default="radix")
    ap.add_argument("--policy", default="lru")
    ap.add_argument("--quota", action="store_true")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--maxrun", type=int, default=8)
    ap.add_argument("--dup", type=float, default=0.0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rng = random.Random(args.seed)
    if args.model == "tiny":
        from model_helpers import tiny_loaded_model

        loaded = tiny_loaded_model(0)
    else:
        from radixkv.models import load_model

        loaded = load_model("smollm2-135m", "cpu", torch.float32)
    tok = loaded.tokenizer
    prompts = build_prompts(tok, args.conv, args.turns, args.maxlen)
    print("prompts", len(prompts), [len(p) for p in prompts], flush=True)
    ref = Engine(EngineConfig(device="cpu", max_total_tokens=8192), loaded_model=loaded)
    tmp = tempfile.mkdtemp()
    cfg = EngineConfig(
        device="cpu",
        max_total_tokens=args.pool,
        page_size=args.page,
        chunked_prefill_size=args.chunk,
        kv_cache_dtype=args.kv,
        host_cache_bytes=64 << 20,
        disk_cache_dir=tmp,
        speculative_config=None if args.nospec else {"method": "radix", "num_speculative_tokens": 5},
        max_running_requests=args.maxrun,
        prefix_cache=args.cache,
        eviction_policy=args.policy,
        tenant_kv_quota_tokens={"t1": 64} if args.quota else None,
    )
    eng = Engine(cfg, loaded_model=loaded)
    exact = args.kv == "float32"
    refcache = {}
    nreq = nmis = nties = 0
    t0 = time.time()
    for rnd in range(args.rounds):
        todo = []
        for _ in range(rng.randint(4, 10)):
            if todo and rng.random() < args.dup:
                todo.append(todo[-1])
                continue
            p = rng.choice(prompts)
            kind, sp = random_params(rng)
            ns = rng.choice(NAMESPACES)
            todo.append((p, kind, sp, ns))
        expected = {}
        kinds = {}
        aborted = set()
        done = {}
        while todo or eng.has_unfinished_requests():
            for _ in range(rng.randint(0, 3)):
                if todo:
                    p, kind, sp, ns = todo.pop()
                    rid = eng.add_request(p, sp, namespace=ns)
                    key = (tuple(p), repr(sp), ns)
                    if key not in refcache:
                        refcache[key] = run_alone(ref, p, sp, ns)
                    expected[rid] = refcache[key]
                    kinds[rid] = kind
            if expected and rng.random() < 0.07:
                rid = rng.choice(sorted(expected))
                if rid not in done:
                    eng.abort_request(rid)
                    aborted.add(rid)
            if rng.random() < 0.05:
                r = eng.reset_prefix_cache(tiers=rng.random() < 0.5)
                assert r is False or not eng.has_unfinished_requests()
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = out
            eng.check_integrity()
        for rid, out in done.items():
            nreq += 1
            check_counts(out)
            exp = expected[rid]
            for c, e in zip(out.outputs, exp.outputs):
                if c.finish_reason == "abort":
                    assert rid in aborted
                    ok = c.token_ids == e.token_ids[: len(c.token_ids)]
                else:
                    ok = (c.token_ids, c.finish_reason) == (e.token_ids, e.finish_reason)
                    if ok and exact and "logprobs" in kinds[rid]:
                        ok = close_lp(c.logprobs, e.logprobs) and (
                            out.prompt_logprobs is None or close_lp(out.prompt_logprobs[1:], exp.prompt_logprobs[1:])
                        )
                if not ok and (near_tie(c.token_ids, e) or not exact):
                    nties += 1
                    continue
                if not ok:
                    nmis += 1
                    print(
                        "MISMATCH",
                        rnd,
                        rid,
                        kinds[rid],
                        out.namespace if hasattr(out, "namespace") else "",
                        "\n  got",
                        c.token_ids,
                        c.finish_reason,
                        "\n  exp",
                        e.token_ids,
                        e.finish_reason,
                        flush=True,
                    )
        st = eng.cache_stats()
        print(
            f"round {rnd}: {len(done)} done, {len(aborted)} aborted, retractions {st['num_retractions']}, "
            f"evicted {st['evicted_tokens']}, by tier {st['cached_tokens_by_tier']}, spec acc "
            f"{st['spec_accepted_tokens']}/{st['spec_draft_tokens']}, {time.time() - t0:.0f}s",
            flush=True,
        )
        assert st["cached_tokens"] == sum(st["cached_tokens_by_tier"].values()), st
        if rng.random() < 0.5:
            assert eng.reset_prefix_cache(tiers=rng.random() < 0.5)
    assert eng.reset_prefix_cache()
    st = eng.cache_stats()
    assert st["free"] == st["capacity"], st
    eng.check_integrity()
    print("requests", nreq, "mismatches", nmis, "near-ties", nties, "free==capacity", st["free"], flush=True)
    eng.close()


if __name__ == "__main__":
    main()
