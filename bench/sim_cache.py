"""Cache-only simulation of the benchmark workloads: a thin CLI over :mod:`radixkv.sim`.

No model runs. Every request goes through the engine's own slot path in the simulator
(:class:`radixkv.sim.CacheSimulator`: ``lock_prefix`` of all prompt tokens but the last ->
``reserve`` (evicting LRU unlocked prefixes when short) -> ``admit`` -> ``release``, which caches
prompt + reply but the last generated token, as the engine does). The capacity (allocator size, in
slots) is a fraction of the workload's *working set* (the tokens an infinite token-level cache
holds at the end), so all policies get the same KV memory. Policies: ``radix-p1`` /
``radix-p16`` (RadixCache, page 1 / 16, LRU), ``radix-pN-lfu`` / ``-gdf`` / ``-odds`` / ``-odds1`` (its other
eviction policies), ``min-pN`` (Belady's MIN on the same trace: the offline bound,
:func:`radixkv.sim.optimal`), ``hash-b16`` (HashBlockCache, block 16), ``none`` (NoPrefixCache).

Metric: hit rate = cached prompt tokens / prompt tokens; prefill tokens = prompt tokens - cached.

Usage::

    python bench/sim_cache.py                      # all workloads, default sizes (a few minutes)
    python bench/sim_cache.py --workloads multi_turn --conversations 4000 --jobs 2

Writes ``bench/results/sim_cache_<UTC time>.json``. The worker processes share one tokenized
ShareGPT set, built once (:mod:`radixkv.sim.sharegpt`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.results_io import write_result  # noqa: E402
from bench.workloads import Workload, make_workload  # noqa: E402
from radixkv.sim import CacheSimulator, SimRequest, optimal  # noqa: E402

POLICIES = {  # bench name -> (radixkv.sim policy, page size); "min": radixkv.sim.optimal
    "radix-p1": ("radix", 1),
    "radix-p16": ("radix", 16),
    "hash-b16": ("hash", 16),
    "none": ("none", 16),
    **{
        f"radix-p{ps}-{short}": (f"radix-{policy}", ps)
        for ps in (1, 16)
        for short, policy in (("lfu", "lfu"), ("gdf", "gdf"), ("odds", "reuse-odds"), ("odds1", "reuse-odds-h1"))
    },
    "min-p1": ("min", 1),
    "min-p16": ("min", 16),
}
EVICTION_ONLY = {p for p, (name, _) in POLICIES.items() if name == "min" or name.startswith("radix-")}
"""Policies that differ from another one only in what they evict: equal to it when nothing is
evicted, so the infinite-capacity pass skips them."""
FRACTIONS = [0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0]


def simulate(wl: Workload, policy: str, capacity: int | None, hash_algo: str = "sha256") -> dict:
    """Replay ``wl`` through ``policy`` with ``capacity`` slots (None: infinite). Returns stats."""
    name, ps = POLICIES[policy]
    if capacity is None:  # never evicts: each request adds at most its own suffix + reply tokens,
        # plus its parent's uncached unaligned tail (< ps) and page rounding (< ps)
        capacity = sum(len(r.prompt) + len(r.reply) for r in wl.requests) + 2 * ps * len(wl.requests)
    reqs = (SimRequest(wl.full_prompt(i), r.reply, r.namespace) for i, r in enumerate(wl.requests))
    if name == "min":
        res = optimal(list(reqs), ps, max(ps, capacity))
    else:
        sim = CacheSimulator(name, ps, max(ps, capacity), hash_algo, outcomes=False)
        res = sim.run(reqs, keep_requests=False)
    return dict(
        policy=policy,
        capacity=res.capacity,
        requests=res.num_requests,
        skipped=res.skipped,
        prompt_tokens=res.prompt_tokens,
        cached_tokens=res.cached_tokens,
        prefill_tokens=res.prefill_tokens,
        hit_rate=res.hit_rate,
        evicted_tokens=res.evicted_tokens,
        cache_tokens_end=res.cache_tokens_end,
        seconds=round(res.seconds, 2),
    )


_WL: dict = {}
_DATA: list = []


def _job(args):
    """One simulation in a worker process (the token data and recent workloads are kept)."""
    name, kwargs, policy, capacity, algo = args
    key = (name, json.dumps(kwargs, sort_keys=True))
    if key not in _WL:
        if not _DATA:
            from radixkv.sim.sharegpt import load_conversations

            _DATA.append(load_conversations())
        if len(_WL) >= 3:
            _WL.pop(next(iter(_WL)))
        _WL[key] = make_workload(name, data=_DATA[0], **kwargs)
    return name, simulate(_WL[key], policy, capacity, algo)


def workload_specs(args) -> dict[str, dict]:
    specs = {
        "multi_turn": dict(
            n_conversations=args.conversations,
            concurrency=args.concurrency,
            max_context=args.max_context,
            seed=args.seed,
        ),
        "few_shot": dict(n=2000, seed=args.seed),
        "gsp": dict(groups=64, prompts_per_group=32, seed=args.seed),
        "fork": dict(roots=128, branches=8, seed=args.seed),
        "unique": dict(n=2000, seed=args.seed),
    }
    return {k: specs[k] for k in args.workloads}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", nargs="+", default=["multi_turn", "few_shot", "gsp", "fork", "unique"])
    ap.add_argument(
        "--policies",
        nargs="+",
        default=["radix-p1", "radix-p16", "hash-b16", "radix-p1-odds", "radix-p16-odds", "min-p1", "min-p16"],
        choices=sorted(POLICIES),
        help="radix-pN: RadixCache (LRU), page N; radix-pN-lfu / -gdf / -odds / -odds1: its LFU, "
        "GreedyDual-Frequency and reuse-odds eviction policies; min-pN: Belady's MIN, the offline "
        "bound (radixkv.sim.optimal); hash-b16: vLLM-style block hashing. 'none' (NoPrefixCache) "
        "has hit rate 0 by construction; add it to check that",
    )
    ap.add_argument("--fractions", nargs="+", type=float, default=FRACTIONS)
    ap.add_argument("--conversations", type=int, default=17318, help="ShareGPT conversations (all: 17318)")
    ap.add_argument("--concurrency", type=int, default=1024, help="open conversations at a time")
    ap.add_argument("--max-context", type=int, default=8192, help="drop turns beyond this context (tokens)")
    ap.add_argument(
        "--sweep-conversations",
        type=int,
        default=2000,
        help="multi_turn capacity sweep on this many conversations (0: all), to fit a few "
        "minutes on 2 cores; the infinite bound always uses --conversations",
    )
    ap.add_argument(
        "--hash-algo",
        default="builtin",
        choices=["sha256", "builtin"],
        help="HashBlockCache key function (hit rates are identical barring 64-bit collisions)",
    )
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    t0 = time.time()
    specs = workload_specs(args)
    results: dict[str, dict] = {}
    from radixkv.sim.sharegpt import ensure_token_cache

    ensure_token_cache()  # once, before the workers (they would wait on its lock otherwise)
    with ProcessPoolExecutor(max_workers=args.jobs) as ex:
        # 1) infinite-capacity bound per policy: also gives the working set (radix-p1's cache size)
        base = [p for p in args.policies if p not in EVICTION_ONLY]
        if "radix-p1" not in base:
            base.insert(0, "radix-p1")  # its cache size is the working set
        jobs = [(n, kw, p, None, args.hash_algo) for n, kw in specs.items() for p in base]
        for name, res in ex.map(_job, jobs):
            wl_res = results.setdefault(name, dict(params=specs[name], infinite={}, sweep={}))
            wl_res["infinite"][res["policy"]] = res
            print(
                f"[{time.time() - t0:6.0f}s] {name:10s} {res['policy']:9s} infinite  hit {res['hit_rate']:.4f} "
                f"({res['seconds']}s)",
                flush=True,
            )
        # 2) capacity sweep (fractions of the working set); multi_turn may use a subsample, with
        #    the number of open conversations scaled so that it is the same share of the set
        jobs = []
        for name, kw in specs.items():
            if name == "multi_turn" and args.sweep_conversations and args.sweep_conversations < args.conversations:
                kw = dict(
                    kw,
                    n_conversations=args.sweep_conversations,
                    concurrency=max(1, round(args.concurrency * args.sweep_conversations / args.conversations)),
                )
                inf = [(name, kw, p, None, args.hash_algo) for p in base]
                results[name]["sweep_params"] = kw
                results[name]["sweep_infinite"] = {r["policy"]: r for _, r in ex.map(_job, inf)}
                ws = results[name]["sweep_infinite"]["radix-p1"]["cache_tokens_end"]
                print(
                    f"[{time.time() - t0:6.0f}s] {name} sweep subsample {kw}: infinite hit "
                    + ", ".join(f"{p} {r['hit_rate']:.4f}" for p, r in results[name]["sweep_infinite"].items()),
                    flush=True,
                )
            else:
                ws = results[name]["infinite"]["radix-p1"]["cache_tokens_end"]
            results[name]["working_set_tokens"] = ws
            for f in args.fractions:
                for p in args.policies:
                    if p != "none":
                        jobs.append((name, kw, p, max(16, int(ws * f)), args.hash_algo))
        for (name, _kw, p, cap, _), (_, res) in zip(jobs, ex.map(_job, jobs)):
            ws = results[name]["working_set_tokens"]
            res["fraction"] = round(cap / ws, 4)
            results[name]["sweep"].setdefault(p, []).append(res)
            print(
                f"[{time.time() - t0:6.0f}s] {name:10s} {p:9s} cap {cap / ws:5.0%}  hit {res['hit_rate']:.4f} "
                f"evicted {res['evicted_tokens']} ({res['seconds']}s)",
                flush=True,
            )
    out = dict(hash_algo=args.hash_algo, fractions=args.fractions, workloads=results)
    path = write_result("sim_cache", out, args.out, argv=argv, started=t0, machine=dict(torch=torch.__version__))
    print(f"wrote {path} in {time.time() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
