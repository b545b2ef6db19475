"""Cache-only simulation: replay a workload's token ids through a prefix cache + SlotAllocator.

No model runs. Requests are served one at a time in arrival order, exactly as the engine drives a
cache: ``match_prefix(prompt)`` -> ``inc_lock_ref`` -> allocate the uncached positions of
``prompt + reply`` (evicting from the cache when the allocator is short) -> ``insert(prompt +
reply)`` -> free the caller's duplicate slots and the unaligned tail -> ``dec_lock_ref``.
The capacity (allocator size, in slots) is a fraction of the workload's *working set* (the tokens
an infinite token-level cache holds at the end: every distinct prefix token + reply token), so all
policies get the same KV memory. Policies: ``radix-p1`` / ``radix-p16`` (RadixCache, page 1 / 16),
``hash-b16`` (HashBlockCache, block 16), ``none`` (NoPrefixCache).

Metric: hit rate = cached prompt tokens / prompt tokens (``num_cached_tokens`` summed over
requests); prefill tokens = prompt tokens - cached.

Usage::

    python bench/sim_cache.py                      # all workloads, default sizes (a few minutes)
    python bench/sim_cache.py --workloads multi_turn --conversations 4000 --jobs 2

Writes ``bench/results/sim_cache_<UTC time>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.workloads import Workload, make_workload  # noqa: E402
from radixkv.cache import HashBlockCache, NoPrefixCache  # noqa: E402
from radixkv.cache.radix_tree import RadixCache  # noqa: E402
from radixkv.memory.allocator import SlotAllocator  # noqa: E402

POLICIES = {
    "radix-p1": lambda algo: RadixCache(1),
    "radix-p16": lambda algo: RadixCache(16),
    "hash-b16": lambda algo: HashBlockCache(16, hash_algo=algo),
    "none": lambda algo: NoPrefixCache(16),
}
FRACTIONS = [0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0]


def simulate(wl: Workload, policy: str, capacity: int | None, hash_algo: str = "sha256", check_every: int = 0) -> dict:
    """Replay ``wl`` through ``policy`` with ``capacity`` slots (None: infinite). Returns stats."""
    cache = POLICIES[policy](hash_algo)
    ps = cache.page_size
    total_tokens = sum(len(r.prompt) + len(r.reply) for r in wl.requests)
    if capacity is None:  # never evicts: each request adds at most its own suffix + reply tokens,
        # plus its parent's uncached unaligned tail (< ps) and page rounding (< ps)
        capacity = total_tokens + 2 * ps * len(wl.requests)
    capacity -= capacity % ps
    alloc = SlotAllocator(capacity, page_size=ps)
    prompt_tokens = cached = evicted = skipped = 0
    t0 = time.perf_counter()
    for i, r in enumerate(wl.requests):
        prompt = wl.full_prompt(i)
        full = prompt + r.reply
        m = cache.match_prefix(prompt, r.namespace)
        need = -(-(len(full) - m.length) // ps) * ps
        cache.inc_lock_ref(m.node)
        short = need - alloc.available_size()
        if short > 0:
            got = cache.evict(short)
            evicted += len(got)
            alloc.free(got)
        new = alloc.alloc(need)
        if new is None:  # the request alone is larger than the memory: not served
            cache.dec_lock_ref(m.node)
            skipped += 1
            continue
        prompt_tokens += len(prompt)
        cached += m.length
        slots = torch.cat([m.slots, new])
        n = cache.insert(full, slots[: len(full)], r.namespace)
        if n > m.length:
            alloc.free(slots[m.length : n])
        aligned = len(full) - len(full) % ps
        if len(slots) > max(aligned, n):
            alloc.free(slots[max(aligned, n) :])
        cache.dec_lock_ref(m.node)
        if check_every and i % check_every == 0:
            cache.check_integrity()
            assert alloc.available_size() + cache.total_size() == capacity
    cache.check_integrity()
    if alloc.available_size() + cache.total_size() != capacity:
        raise AssertionError(f"{policy}: leaked {capacity - alloc.available_size() - cache.total_size()} slots")
    return dict(
        policy=policy,
        capacity=capacity,
        requests=len(wl.requests) - skipped,
        skipped=skipped,
        prompt_tokens=prompt_tokens,
        cached_tokens=cached,
        prefill_tokens=prompt_tokens - cached,
        hit_rate=cached / max(prompt_tokens, 1),
        evicted_tokens=evicted,
        cache_tokens_end=cache.total_size(),
        seconds=round(time.perf_counter() - t0, 2),
    )


_WL: dict = {}
_DATA: list = []


def _job(args):
    """One simulation in a worker process (the token data and recent workloads are kept)."""
    name, kwargs, policy, capacity, algo = args
    key = (name, json.dumps(kwargs, sort_keys=True))
    if key not in _WL:
        if not _DATA:
            from bench.workloads.sharegpt import load_conversations

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
        default=["radix-p1", "radix-p16", "hash-b16"],
        help="'none' (NoPrefixCache) has hit rate 0 by construction; add it to check that",
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
    with ProcessPoolExecutor(max_workers=args.jobs) as ex:
        # 1) infinite-capacity bound per policy: also gives the working set (radix-p1's cache size)
        jobs = [(n, kw, p, None, args.hash_algo) for n, kw in specs.items() for p in args.policies]
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
                inf = [(name, kw, p, None, args.hash_algo) for p in args.policies]
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
    out = dict(
        kind="sim_cache",
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        argv=sys.argv[1:] if argv is None else argv,
        seconds=round(time.time() - t0, 1),
        machine=dict(
            platform=platform.platform(), cpus=os.cpu_count(), python=platform.python_version(), torch=torch.__version__
        ),
        hash_algo=args.hash_algo,
        fractions=args.fractions,
        workloads=results,
    )
    path = args.out or ROOT / "bench" / "results" / f"sim_cache_{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path} in {time.time() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
