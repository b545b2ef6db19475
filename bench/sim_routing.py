"""Multi-replica routing simulation: N replicas, each a real RadixCache + SlotAllocator, behind
each routing policy of :mod:`radixkv.router.policy` (docs/routing.md has the figures).

Model (no model runs):

* **Replicas**: a :class:`~radixkv.cache.RadixCache` (page 1) and a
  :class:`~radixkv.memory.allocator.SlotAllocator` of ``capacity`` slots each, driven the way the
  engine's KV manager drives them: at service start ``match_prefix(prompt[:-1])`` (the engine
  never serves a prompt's last token from the cache), lock, allocate the rest of ``prompt +
  reply`` (evicting LRU leaves when short), at the end ``insert(prompt + reply[:-1])`` (the last
  sampled token's K/V is never computed), free the duplicates, unlock. Every insertion and
  eviction becomes the cache-event record the engine publishes (:mod:`radixkv.engine.publish`:
  chained 16-token block digests, a gap-free ``seq``), delivered to the router in one batch per
  request, ``--event-lag`` seconds after the request ends; at the end the router is also told
  the request's output token ids (``Policy.finished(..., output_token_ids=...)``, as the Ray
  ingress tells the index when it sees the final output).
* **Service**: one request at a time per replica, FIFO (a simple service-time model):
  ``t_fixed + prefill_tokens * t_prefill + output_tokens * t_decode`` (``t_decode`` is the
  per-token decode cost amortized over a batch); TTFT = queueing + ``t_fixed + prefill_tokens *
  t_prefill``; busy time = the sum of service times.
* **Arrivals**: Poisson in the trace's order at a rate that loads the N replicas to ``--rho`` at
  the infinite-cache hit rate; a follow-up turn never arrives before its parent's reply is back
  (plus ``--think`` seconds): clients wait for the answer.
* **Bound**: one replica with N times the capacity and N times the speed, same arrivals.

Metrics per (trace, N, policy): hit rate (cached / prompt tokens), prefill tokens computed,
load imbalance (max / mean busy time over replicas), TTFT p50 / p99, the router's decisions.
With ``--seeds``, every policy (and the bound, unless ``--no-bound``) runs on each arrival seed
(a seed fixes the Poisson arrivals, identical for every policy, and the policies' random
tie-breaks); each run records its ``seed``, and ``traces[name]["means"]`` holds per (N, policy)
the mean hit rate, prefill tokens and TTFT p50 / p99 over the seeds (the mean of the per-seed
percentiles) and the worst imbalance. ``targets`` (:func:`target_rows`, printed by
:func:`targets`) judges ``cache_events`` on those means: hit rate at least approx_tree's minus
0.5 point and at least least_load's, TTFT p99 at most 1.10x the best other policy's.

Usage (docs/routing.md has the committed runs)::

    python bench/sim_routing.py --check --no-bound --seeds $(seq -s ' ' 20 39)      # defaults, held-out seeds
    python bench/sim_routing.py --check --no-bound --seeds 40 41 42 --think 0.5 --event-lag 0.05 --rho 0.85
    python bench/sim_routing.py --traces gsp --replicas 4 --policies cache_events least_load
    python bench/sim_routing.py --policies cache_events --set hot_share=0.5 home=false --reuse bench/results/sim_routing_X.json

Writes ``bench/results/sim_routing_<UTC time>.json`` and, with ``--plot``, docs/routing.png.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import sys
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from bench.results_io import write_result  # noqa: E402
from bench.workloads import Workload, make_workload  # noqa: E402
from radixkv.cache.digests import BLOCK_TOKENS, block_digests  # noqa: E402
from radixkv.cache.radix_tree import RadixCache  # noqa: E402
from radixkv.memory.allocator import SlotAllocator  # noqa: E402
from radixkv.router.policy import POLICIES, RouteRequest, make_policy  # noqa: E402

DEFAULT_POLICIES = ["round_robin", "least_load", "session", "approx_tree", "cache_events"]


@dataclass
class Timing:
    """The service-time model (seconds)."""

    t_fixed: float = 0.002
    t_prefill: float = 1e-4
    t_decode: float = 1e-3
    speed: float = 1.0  # a replica this many times faster (the bound)

    def prefill(self, tokens: int) -> float:
        return (self.t_fixed + tokens * self.t_prefill) / self.speed

    def service(self, prefill_tokens: int, output_tokens: int) -> float:
        return (self.t_fixed + prefill_tokens * self.t_prefill + output_tokens * self.t_decode) / self.speed


class Trace:
    """A workload prepared once for every run: full prompts, the K/V sequence each request
    leaves in the cache (``prompt + reply[:-1]``), its block digests, session keys."""

    def __init__(self, wl: Workload) -> None:
        self.name = wl.name
        self.wl = wl
        n = len(wl.requests)
        self.prompts: list[list[int]] = []
        self.kv: list[list[int]] = []
        self.digests: list[list[bytes]] = []
        self.parent = [r.parent for r in wl.requests]
        self.session: list[str] = []
        root = list(range(n))
        for i, r in enumerate(wl.requests):
            if r.parent is not None:
                root[i] = root[r.parent]
            p = wl.full_prompt(i)
            kv = p + r.reply[:-1]
            self.prompts.append(p)
            self.kv.append(kv)
            nb = len(kv) // BLOCK_TOKENS
            prev_i = r.parent
            if prev_i is not None and len(self.kv[prev_i]) <= len(kv) and kv[: len(self.kv[prev_i])] == self.kv[prev_i]:
                # the parent's blocks are a prefix: extend its chain
                pd = self.digests[prev_i]
                k = len(pd)
                more = block_digests(kv, r.namespace, k, nb, pd[-1] if k else None) if nb > k else []
                self.digests.append(pd + more)
            else:
                self.digests.append(block_digests(kv, r.namespace, 0, nb) if nb else [])
            self.session.append(f"conv-{root[i]}")
        self.output = [len(r.reply) for r in wl.requests]
        self.prompt_tokens = sum(len(p) for p in self.prompts)

    def infinite_hit_rate(self) -> tuple[float, int]:
        """Hit rate of one cache that never evicts, in trace order, and its final size (the
        working set, tokens)."""
        cache = RadixCache(1)
        hit = 0
        for i in range(len(self.prompts)):
            p = self.prompts[i]
            hit += cache.match_prefix(p[:-1], self.wl.requests[i].namespace).length
            kv = self.kv[i]
            cache.insert(kv, np.zeros(len(kv), np.int64), self.wl.requests[i].namespace)
        return hit / max(self.prompt_tokens, 1), cache.total_size()


class SimReplica:
    """One replica: a real RadixCache + SlotAllocator, a FIFO queue, its cache events."""

    def __init__(self, name: str, capacity: int, timing: Timing) -> None:
        self.name = name
        self.cache = RadixCache(1)
        self.alloc = SlotAllocator(capacity, 1)
        self.capacity = capacity
        self.timing = timing
        self.cache.evict_listener = self._on_evict
        self.seq = 0
        self.events: list[tuple] = []
        self.queue: deque = deque()
        self.busy = False
        self.busy_time = 0.0
        self.served = 0

    def _on_evict(self, namespace, path: bytes, start: int) -> None:
        end = len(path) >> 2
        first, stop = start // BLOCK_TOKENS, end // BLOCK_TOKENS
        digests = tuple(block_digests(path, namespace, first, stop)) if stop > first else ()
        self.seq += 1
        self.events.append(("evict", self.seq, namespace, digests))

    def run(self, trace: Trace, i: int) -> int | None:
        """Serve request ``i``'s cache operations; returns its cached prompt tokens (None: it
        does not fit in this replica at all)."""
        ns = trace.wl.requests[i].namespace
        prompt, kv = trace.prompts[i], trace.kv[i]
        m = self.cache.match_prefix(prompt[:-1], ns)
        need = len(kv) - m.length
        self.cache.inc_lock_ref(m.node)
        short = need - self.alloc.available_size()
        if short > 0:
            got = self.cache.evict(short)
            if len(got):
                self.alloc.free(got)
        new = self.alloc.alloc(need) if need > 0 else np.zeros(0, np.int64)
        if new is None:
            self.cache.dec_lock_ref(m.node)
            return None
        slots = np.concatenate([np.asarray(m.slots, dtype=np.int64), np.asarray(new, dtype=np.int64)])
        k = self.cache.insert(kv, slots, ns)
        if k > m.length:
            self.alloc.free(slots[m.length : k])
        n = len(kv)
        if n > k:
            first, stop = k // BLOCK_TOKENS, n // BLOCK_TOKENS
            self.seq += 1
            self.events.append(("insert", self.seq, ns, first, tuple(trace.digests[i][first:stop])))
        self.cache.dec_lock_ref(m.node)
        return m.length

    def take_events(self) -> dict:
        ev, self.events = self.events, []
        return {"epoch": self.name, "events": ev, "dropped": False}

    def mirror_ok(self, view_blocks: set) -> bool:
        """The router's view equals the tree's fully cached blocks (a self-check)."""
        return view_blocks == set(self.cache.block_digests())


def simulate(
    trace: Trace,
    policy_name: str,
    n_replicas: int,
    capacity: int,
    rate: float,
    timing: Timing,
    seed: int = 0,
    think: float = 0.0,
    event_lag: float = 0.01,
    policy_kwargs: dict | None = None,
    check: bool = False,
    detail: bool = False,
) -> dict:
    """One run (module docstring); returns its metrics (``detail``: also per-request lists
    ``arrival``, ``ttft``, ``cached``, ``replica``)."""
    t0 = time.perf_counter()
    rng = random.Random(seed)
    n = len(trace.prompts)
    slot = []
    t = 0.0
    for _ in range(n):
        t += rng.expovariate(rate)
        slot.append(t)
    policy = make_policy(policy_name, seed=seed, **(policy_kwargs or {}))
    reps = {f"r{k}": SimReplica(f"r{k}", capacity, timing) for k in range(n_replicas)}
    for name in reps:
        policy.add_replica(name)
    children: dict[int, list[int]] = {}
    for i, p in enumerate(trace.parent):
        if p is not None:
            children.setdefault(p, []).append(i)
    heap: list = []
    seq = 0

    def push(t: float, kind: int, payload) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(heap, (t, kind, seq, payload))

    ARRIVE, FINISH, DELIVER = 1, 0, 2  # at one instant: finishes, then arrivals, then deliveries
    for i in range(n):
        if trace.parent[i] is None:
            push(slot[i], ARRIVE, i)
    arrival = [0.0] * n
    ttft = [0.0] * n
    cached = [0] * n
    where = [""] * n
    skipped = 0
    reqs: dict[int, RouteRequest] = {}

    def start(rep: SimReplica, now: float) -> None:
        nonlocal skipped
        while rep.queue:
            i = rep.queue.popleft()
            got = rep.run(trace, i)
            if got is None:
                skipped += 1
                policy.finished(str(i), now, expire=True)
                continue
            cached[i] = got
            pf = len(trace.prompts[i]) - got
            ttft[i] = now - arrival[i] + timing.prefill(pf)
            s = timing.service(pf, trace.output[i])
            rep.busy = True
            rep.busy_time += s
            rep.served += 1
            push(now + s, FINISH, (rep.name, i))
            return
        rep.busy = False

    while heap:
        now, kind, _, payload = heapq.heappop(heap)
        if kind == ARRIVE:
            i = payload
            arrival[i] = now
            rq = RouteRequest(str(i), trace.prompts[i], trace.wl.requests[i].namespace, trace.session[i])
            nb = (len(trace.prompts[i]) - 1) // BLOCK_TOKENS
            rq._digests = trace.digests[i][:nb]
            reqs[i] = rq
            d = policy.choose(rq, None, now)
            where[i] = d.replica
            rep = reps[d.replica]
            rep.queue.append(i)
            if not rep.busy:
                start(rep, now)
        elif kind == FINISH:
            name, i = payload
            rep = reps[name]
            policy.finished(str(i), now, output_token_ids=trace.wl.requests[i].reply)
            reqs.pop(i, None)
            push(now + event_lag, DELIVER, (name, rep.take_events()))
            for c in children.get(i, ()):
                push(max(slot[c], now + think), ARRIVE, c)
            start(rep, now)
        else:
            name, batch = payload
            if policy.on_events(name, batch, now):  # a gap: resync from a snapshot
                rep = reps[name]
                policy.on_snapshot(name, {"epoch": name, "seq": rep.seq, "blocks": rep.cache.block_digests()})
    if check and policy_name == "cache_events":
        for name, rep in reps.items():
            assert rep.mirror_ok(policy.views[name].blocks), f"{name}: the router's view differs from the tree"
    served = [i for i in range(n) if where[i]]
    prompt_tokens = sum(len(trace.prompts[i]) for i in served)
    hit = sum(cached[i] for i in served)
    busy = [r.busy_time for r in reps.values()]
    tt = np.array([ttft[i] for i in served]) if served else np.zeros(1)
    extra = dict(arrival=arrival, ttft=ttft, cached=cached, replica=where) if detail else {}
    return extra | dict(
        trace=trace.name,
        policy=policy_name,
        replicas=n_replicas,
        capacity=capacity,
        requests=len(served) - skipped,
        skipped=skipped,
        prompt_tokens=prompt_tokens,
        cached_tokens=hit,
        prefill_tokens=prompt_tokens - hit,
        hit_rate=hit / max(prompt_tokens, 1),
        imbalance=max(busy) / (sum(busy) / len(busy)) if sum(busy) else 1.0,
        busy_s=[round(b, 2) for b in busy],
        ttft_p50_s=float(np.percentile(tt, 50)),
        ttft_p99_s=float(np.percentile(tt, 99)),
        ttft_mean_s=float(tt.mean()),
        makespan_s=max((r.busy_time for r in reps.values()), default=0.0),
        seconds=round(time.perf_counter() - t0, 2),
    )


# ---------------------------------------------------------------------------- driver
_TRACES: dict = {}
_DATA: list = []


def trace_specs(args) -> dict[str, dict]:
    specs = {
        "multi_turn": dict(
            n_conversations=args.conversations, concurrency=args.concurrency, max_context=args.max_context, seed=0
        ),
        "few_shot": dict(n=args.few_shot, seed=0),
        "gsp": dict(groups=args.gsp_groups, prompts_per_group=32, seed=0),
    }
    return {k: specs[k] for k in args.traces}


def get_trace(name: str, kw: dict) -> Trace:
    key = (name, json.dumps(kw, sort_keys=True))
    if key not in _TRACES:
        if not _DATA:
            from bench.workloads.sharegpt import load_conversations

            _DATA.append(load_conversations())
        _TRACES[key] = Trace(make_workload(name, data=_DATA[0], **kw))
    return _TRACES[key]


def _job(a: dict) -> dict:
    tr = get_trace(a["trace"], a["trace_kw"])
    res = simulate(
        tr,
        a["policy"],
        a["replicas"],
        a["capacity"],
        a["rate"],
        Timing(**a["timing"]),
        seed=a["seed"],
        think=a["think"],
        event_lag=a["event_lag"],
        policy_kwargs=a.get("policy_kwargs"),
        check=a.get("check", False),
    )
    res["label"] = a.get("label", a["policy"])
    return res


def _prep(a: dict) -> dict:
    tr = get_trace(a["trace"], a["trace_kw"])
    h, ws = tr.infinite_hit_rate()
    return dict(
        trace=a["trace"],
        requests=len(tr.prompts),
        prompt_tokens=tr.prompt_tokens,
        output_tokens=sum(tr.output),
        infinite_hit_rate=h,
        working_set=ws,
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", nargs="+", default=["multi_turn", "few_shot", "gsp"])
    ap.add_argument("--replicas", nargs="+", type=int, default=[2, 4, 8])
    ap.add_argument("--policies", nargs="+", default=DEFAULT_POLICIES, choices=sorted(POLICIES))
    ap.add_argument(
        "--capacity-fraction",
        type=float,
        default=0.25,
        help="all N replicas together hold this share of the working set (so one replica holds 1/N of it)",
    )
    ap.add_argument("--rho", type=float, default=0.7, help="utilization at the infinite-cache hit rate")
    ap.add_argument("--think", type=float, default=0.0, help="seconds between a reply and the next turn")
    ap.add_argument("--event-lag", type=float, default=0.01, help="seconds from a request's end to its events")
    ap.add_argument("--conversations", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--max-context", type=int, default=8192)
    ap.add_argument("--few-shot", type=int, default=2000)
    ap.add_argument("--gsp-groups", type=int, default=64)
    ap.add_argument("--t-fixed", type=float, default=0.002)
    ap.add_argument("--t-prefill", type=float, default=1e-4)
    ap.add_argument("--t-decode", type=float, default=1e-3)
    ap.add_argument("--set", nargs="*", default=[], help="cache_events options, NAME=VALUE (a number, or true / false)")
    ap.add_argument("--seed", type=int, default=0, help="the arrival seed (one seed; see --seeds)")
    ap.add_argument(
        "--seeds",
        nargs="+",
        type=int,
        default=None,
        help="run every policy and the bound on each of these arrival seeds (the same arrivals for "
        "every policy of a seed); the result adds per (N, policy) the mean over seeds (hit rate, TTFT "
        "p50 / p99 of the per-seed figures) and the worst imbalance",
    )
    ap.add_argument("--no-bound", action="store_true", help="skip the bound's runs (the targets do not use it)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--check", action="store_true", help="assert that the router's views mirror the trees")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--plot", action="store_true", help="also write docs/routing.png")
    ap.add_argument(
        "--reuse",
        type=Path,
        default=None,
        help="an earlier result file: its runs of the policies not given (and the bound) are copied, "
        "after checking that it ran the same traces, replicas and model settings (the simulation is "
        "deterministic for a seed, so a policy whose code did not change gives the same run)",
    )
    args = ap.parse_args(argv)
    ce_kw = {k: _option(v) for k, v in (s.split("=", 1) for s in args.set)}
    seeds = args.seeds if args.seeds else [args.seed]

    t_start = time.time()
    specs = trace_specs(args)
    timing = dict(t_fixed=args.t_fixed, t_prefill=args.t_prefill, t_decode=args.t_decode)
    results: dict = {}
    with ProcessPoolExecutor(max_workers=args.jobs) as ex:
        preps = list(ex.map(_prep, [dict(trace=t, trace_kw=kw) for t, kw in specs.items()]))
        jobs = []
        for info in preps:
            name = info["trace"]
            tm = Timing(**timing)
            n_req = info["requests"]
            mean_s = (
                n_req * tm.t_fixed
                + info["prompt_tokens"] * (1 - info["infinite_hit_rate"]) * tm.t_prefill
                + info["output_tokens"] * tm.t_decode
            ) / n_req
            results[name] = dict(params=specs[name], info=info, runs=[])
            print(
                f"[{time.time() - t_start:5.0f}s] {name}: {n_req} requests, {info['prompt_tokens']} prompt tokens, "
                f"working set {info['working_set']}, infinite-cache hit {info['infinite_hit_rate']:.4f}",
                flush=True,
            )
            for nr, seed in ((nr, sd) for nr in args.replicas for sd in seeds):
                cap = max(4096, int(args.capacity_fraction * info["working_set"] / nr))
                rate = args.rho * nr / mean_s
                base = dict(trace=name, trace_kw=specs[name], replicas=nr, capacity=cap, rate=rate, seed=seed)
                base.update(think=args.think, event_lag=args.event_lag, check=args.check)
                for p in args.policies:
                    jobs.append(
                        dict(base, policy=p, timing=timing, policy_kwargs=ce_kw if p == "cache_events" else None)
                    )
                if args.reuse is not None or args.no_bound:
                    continue  # the bound comes from the reused file, or is not wanted
                # the bound: one replica, N x the capacity, N x the speed
                jobs.append(
                    dict(base, replicas=1, capacity=cap * nr, policy="round_robin", timing=dict(timing, speed=nr))
                    | dict(label="bound", bound_for=nr)
                )
        for a, res in zip(jobs, ex.map(_job, jobs)):
            res["rate_per_s"] = a["rate"]
            res["seed"] = a["seed"]
            if a.get("label") == "bound":
                res["replicas"] = a["bound_for"]
                res["policy"] = "bound"
            results[a["trace"]]["runs"].append(res)
            print(
                f"[{time.time() - t_start:5.0f}s] {res['trace']:10s} N={res['replicas']} s{res['seed']} {res['policy']:12s} "
                f"hit {res['hit_rate']:.4f} prefill {res['prefill_tokens']:>10d} imb {res['imbalance']:.3f} "
                f"ttft p50 {res['ttft_p50_s']:.3f} p99 {res['ttft_p99_s']:.3f} ({res['seconds']}s)",
                flush=True,
            )
    reused = _reuse(args, results, seeds) if args.reuse is not None else None
    for tr in results.values():
        tr["means"] = seed_means(tr["runs"])
    out = dict(
        reused_from=reused,
        settings=dict(vars(args), out=str(args.out) if args.out else None, seeds=seeds),
        cache_events_options=ce_kw,
        traces=results,
    )
    out["targets"] = target_rows(out)
    path = write_result("sim_routing", out, args.out, argv=argv, started=t_start, default=str)
    print(f"wrote {path} in {time.time() - t_start:.0f}s")
    print(summary(out))
    print(targets(out))
    if args.plot:
        print("plot:", plot(out))
    return 0


def _option(v: str):
    """A ``--set`` value: ``true`` / ``false`` as a bool, else a float."""
    low = v.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    return float(v)


_SAME = ("replicas", "capacity_fraction", "rho", "think", "event_lag", "conversations", "concurrency", "max_context")
_SAME += ("few_shot", "gsp_groups", "t_fixed", "t_prefill", "t_decode")


def _reuse(args, results: dict, seeds: list[int]) -> dict:
    """Copy ``args.reuse``'s runs of the policies not run now (and the bound) into ``results``."""
    old = json.loads(args.reuse.read_text())
    for k in _SAME:
        if old["settings"][k] != getattr(args, k):
            raise SystemExit(f"--reuse: {args.reuse} ran {k}={old['settings'][k]}, not {getattr(args, k)}")
    old_seeds = old["settings"].get("seeds") or [old["settings"]["seed"]]
    if old_seeds != seeds:
        raise SystemExit(f"--reuse: {args.reuse} ran seeds {old_seeds}, not {seeds}")
    for name, tr in results.items():
        if name not in old["traces"] or old["traces"][name]["params"] != tr["params"]:
            raise SystemExit(f"--reuse: {args.reuse} has no run of trace {name} with these parameters")
        kept = [r for r in old["traces"][name]["runs"] if r["policy"] not in args.policies]
        tr["runs"] = kept + tr["runs"]
    return dict(
        path=_shown(args.reuse),
        policies=sorted({r["policy"] for tr in results.values() for r in tr["runs"]} - set(args.policies)),
    )


def _shown(path: Path) -> str:
    """``path`` relative to the repository when it lies inside it, else as given."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def seed_means(runs: list[dict]) -> list[dict]:
    """Per (N, policy) over its seeds: the mean hit rate, prefill tokens, TTFT p50 / p99 (the mean
    of the per-seed percentiles) and the worst (largest) imbalance."""
    groups: dict = {}
    for r in runs:
        groups.setdefault((r["replicas"], r["policy"]), []).append(r)
    out = []
    for (nr, pol), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1] != "bound", kv[0][1])):
        k = len(rs)
        out.append(
            dict(
                replicas=nr,
                policy=pol,
                seeds=sorted(r.get("seed", 0) for r in rs),
                hit_rate=sum(r["hit_rate"] for r in rs) / k,
                prefill_tokens=sum(r["prefill_tokens"] for r in rs) / k,
                imbalance=max(r["imbalance"] for r in rs),
                ttft_p50_s=sum(r["ttft_p50_s"] for r in rs) / k,
                ttft_p99_s=sum(r["ttft_p99_s"] for r in rs) / k,
            )
        )
    return out


HIT_SLACK = 0.005  # hit rate at least approx_tree's minus half a point
P99_RATIO = 1.10  # TTFT p99 at most 1.10x the best other policy's


def target_rows(out: dict, policy: str = "cache_events", per_seed: bool = False) -> list[dict]:
    """The targets for ``policy`` per (trace, N) on the means over seeds (``per_seed``: also on
    each seed): its hit rate at least approx_tree's minus :data:`HIT_SLACK` and at least
    least_load's; its TTFT p99 at most :data:`P99_RATIO` x the least of every other policy's (the
    bound excluded). Each row: ``trace``, ``replicas``, ``seed`` ("mean" or the seed), ``hit``,
    ``approx_tree``, ``least_load`` (hit rates), ``p99_s``, ``best_p99_s``, ``best_p99`` (whose),
    ``met`` (bool); a row lacks the comparisons whose policy did not run."""
    rows = []
    for name, tr in out["traces"].items():
        by: dict = {}
        for r in tr["runs"]:
            by.setdefault((r["replicas"], r.get("seed", 0)), {})[r["policy"]] = r
        for nr in sorted({k[0] for k in by}):
            groups = [(sd, pols) for (n2, sd), pols in sorted(by.items()) if n2 == nr] if per_seed else []
            groups.append(("mean", {m["policy"]: m for m in tr.get("means", ()) if m["replicas"] == nr}))
            for label, pols in groups:
                me = pols.get(policy)
                others = {p: r for p, r in pols.items() if p not in (policy, "bound")}
                if me is None or not others:
                    continue
                best = min(others, key=lambda p: others[p]["ttft_p99_s"])
                row = dict(trace=name, replicas=nr, seed=label, hit=me["hit_rate"], p99_s=me["ttft_p99_s"])
                row.update(best_p99=best, best_p99_s=others[best]["ttft_p99_s"])
                met = me["ttft_p99_s"] <= P99_RATIO * others[best]["ttft_p99_s"]
                for p in ("approx_tree", "least_load"):
                    if p in others:
                        row[p] = others[p]["hit_rate"]
                if "approx_tree" in row:
                    met = met and me["hit_rate"] >= row["approx_tree"] - HIT_SLACK
                if "least_load" in row:
                    met = met and me["hit_rate"] >= row["least_load"]
                rows.append(dict(row, met=met))
    return rows


def targets(out: dict, policy: str = "cache_events", per_seed: bool = False) -> str:
    """:func:`target_rows` as a markdown table (hit rates in %, gaps in points)."""
    lines = [
        "",
        f"targets for {policy}: hit >= approx_tree - {100 * HIT_SLACK:.1f} pt and >= least_load; "
        f"TTFT p99 <= {P99_RATIO:.2f} x the best other policy's",
        "| trace | N | seed | hit % | - approx_tree (pt) | - least_load (pt) | p99 (s) | / best other [who] | met |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in target_rows(out, policy, per_seed):
        gaps = [f"{100 * (r['hit'] - r[p]):+.2f}" if p in r else "-" for p in ("approx_tree", "least_load")]
        lines.append(
            f"| {r['trace']} | {r['replicas']} | {r['seed']} | {100 * r['hit']:.2f} | {gaps[0]} | {gaps[1]} | "
            f"{r['p99_s']:.3f} | {r['p99_s'] / r['best_p99_s']:.3f} [{r['best_p99']}] | {'yes' if r['met'] else 'NO'} |"
        )
    return "\n".join(lines)


def summary(out: dict) -> str:
    """A markdown table per trace: policy rows x N columns of hit rate / imbalance / TTFT p99 (with
    several seeds: the means over seeds, imbalance the worst seed's)."""
    lines = []
    for name, tr in out["traces"].items():
        multi = len({r.get("seed", 0) for r in tr["runs"]}) > 1
        lines.append(
            f"\n{name} (infinite-cache hit {tr['info']['infinite_hit_rate']:.3f})"
            + (", means over seeds" if multi else "")
            + "\n"
        )
        lines.append("| N | policy | hit rate | prefill tokens | imbalance | TTFT p50 (s) | TTFT p99 (s) |")
        lines.append("|---|---|---|---|---|---|---|")
        rows = tr.get("means") if multi and tr.get("means") else tr["runs"]
        for r in sorted(rows, key=lambda r: (r["replicas"], r["policy"] != "bound", r["policy"])):
            lines.append(
                f"| {r['replicas']} | {r['policy']} | {r['hit_rate']:.4f} | {round(r['prefill_tokens'])} | "
                f"{r['imbalance']:.3f} | {r['ttft_p50_s']:.3f} | {r['ttft_p99_s']:.3f} |"
            )
    return "\n".join(lines)


def plot(out: dict, path: Path | None = None) -> Path:
    """docs/routing.png: per trace, hit rate and TTFT p99 vs N for each policy (bound dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = list(out["traces"])
    fig, axes = plt.subplots(2, len(traces), figsize=(4.6 * len(traces), 7.5), squeeze=False)
    for col, name in enumerate(traces):
        runs = out["traces"][name].get("means") or out["traces"][name]["runs"]
        pols = sorted({r["policy"] for r in runs}, key=lambda p: (p == "bound", p))
        for p in pols:
            rs = sorted((r for r in runs if r["policy"] == p), key=lambda r: r["replicas"])
            xs = [r["replicas"] for r in rs]
            style = dict(ls="--", color="k") if p == "bound" else dict(marker="o")
            axes[0][col].plot(xs, [r["hit_rate"] for r in rs], label=p, **style)
            if p != "bound":
                axes[1][col].plot(xs, [r["ttft_p99_s"] for r in rs], label=p, **style)
        axes[0][col].set_title(
            f"{name}: hit rate" + (" (mean over seeds)" if len(out["settings"].get("seeds") or [0]) > 1 else "")
        )
        axes[1][col].set_title(f"{name}: TTFT p99 (s, simulated)")
        axes[1][col].set_yscale("log")
        for ax in (axes[0][col], axes[1][col]):
            ax.set_xlabel("replicas")
            ax.set_xticks(sorted({r["replicas"] for r in runs}))
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    path = path or ROOT / "docs" / "routing.png"
    fig.savefig(path, dpi=110)
    return path


if __name__ == "__main__":
    raise SystemExit(main())
