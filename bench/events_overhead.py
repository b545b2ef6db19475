"""Step time of the engine with cache-event publication on vs off (a printed ratio).

The default model (SmolLM2-135M) on the CPU runs the same multi-turn-shaped workload (ShareGPT-
like prompts sharing a system prompt, a small KV pool so that eviction happens) twice per round:
once with no cache-event subscriber (the KV manager then builds no events at all) and once with a
:class:`~radixkv.engine.publish.CacheEventPublisher` attached and drained after every step, as a
replica's pusher does. Rounds alternate the order; the ratio of total step time (on / off) is
printed with the per-round ratios (noise on this shared machine is +-15%), plus the publisher's
own cost per event and the snapshot's cost, measured in the same run.

Usage: ``python bench/events_overhead.py [--rounds 5] [--requests 24]``; writes
``bench/results/events_overhead_<UTC time>.json`` (docs/routing.md has the committed figure).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.results_io import write_result  # noqa: E402
from radixkv.config import EngineConfig  # noqa: E402
from radixkv.engine import Engine  # noqa: E402
from radixkv.engine.publish import CacheEventPublisher  # noqa: E402
from radixkv.models import load_model  # noqa: E402
from radixkv.sampling_params import SamplingParams  # noqa: E402


def workload(tok, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    system = tok.encode("You are a careful assistant. Answer briefly and cite the steps you take. " * 6)
    words = "cache prefix radix tree token page slot engine replica router event batch snapshot".split()
    out = []
    for _ in range(n):
        q = " ".join(rng.choice(words) for _ in range(rng.randrange(20, 120)))
        out.append(system + tok.encode(q))
    return out


def run(engine: Engine, prompts: list[list[int]], publisher: CacheEventPublisher | None) -> tuple[float, float, int]:
    """Submit all prompts, step to the end; returns (seconds inside step(), CPU seconds of this
    thread inside step(), events published). With one torch thread the CPU time is the step's
    own work, far less sensitive than wall time to other processes on a shared machine."""
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    spent = cpu = 0.0
    events = 0
    while engine.has_unfinished_requests():
        t, c = time.perf_counter(), time.thread_time()
        engine.step()
        if publisher is not None:
            b = publisher.drain()
            events += len(b["events"]) if b else 0
        spent += time.perf_counter() - t
        cpu += time.thread_time() - c
    return spent, cpu, events


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--max-total-tokens", type=int, default=2048, help="small, so that the cache evicts")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: the CPU time is the step's own)")
    args = ap.parse_args(argv)
    t_start = time.time()
    torch.set_num_threads(args.threads)
    loaded = load_model("smollm2-135m")
    engine = Engine(EngineConfig(device="cpu", max_total_tokens=args.max_total_tokens), loaded_model=loaded)
    run(engine, workload(loaded.tokenizer, 4, 99), None)  # warm-up
    ratios, cpu_ratios, on_t, off_t, on_c, off_c, n_events, rounds = [], [], 0.0, 0.0, 0.0, 0.0, 0, []
    for r in range(args.rounds):
        prompts = workload(loaded.tokenizer, args.requests, r)
        times, cpus = {}, {}
        for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):
            engine.reset_prefix_cache()
            pub = CacheEventPublisher() if mode == "on" else None
            off = pub.attach(engine.events) if pub else None
            times[mode], cpus[mode], ev = run(engine, prompts, pub)
            if off:
                off()
                n_events += ev
        ratios.append(times["on"] / times["off"])
        cpu_ratios.append(cpus["on"] / cpus["off"])
        rounds.append(
            dict(
                off_s=round(times["off"], 3),
                on_s=round(times["on"], 3),
                ratio=round(ratios[-1], 4),
                off_cpu_s=round(cpus["off"], 3),
                on_cpu_s=round(cpus["on"], 3),
                cpu_ratio=round(cpu_ratios[-1], 4),
            )
        )
        on_t += times["on"]
        off_t += times["off"]
        on_c += cpus["on"]
        off_c += cpus["off"]
        print(
            f"round {r}: wall off {times['off']:.2f}s on {times['on']:.2f}s ratio {ratios[-1]:.3f}; "
            f"CPU off {cpus['off']:.2f}s on {cpus['on']:.2f}s ratio {cpu_ratios[-1]:.3f}",
            flush=True,
        )
    # the publisher's own cost per event and a snapshot of the cache as it is now
    pub = CacheEventPublisher()
    from radixkv.engine.events import CacheInserted

    ev = CacheInserted(1, None, 64, 0, (b"x" * 16,) * 4)
    t = time.perf_counter()
    for _ in range(100_000):
        pub.on_event(ev)
    per_event_us = (time.perf_counter() - t) / 100_000 * 1e6
    t = time.perf_counter()
    snap = pub.snapshot(engine)
    snap_ms = (time.perf_counter() - t) * 1e3
    print(
        f"step CPU time with events on / off: {on_c / off_c:.3f} (rounds: {', '.join(f'{x:.3f}' for x in cpu_ratios)}); "
        f"step wall time on / off: {on_t / off_t:.3f} (rounds: {', '.join(f'{x:.3f}' for x in ratios)}; "
        f"median {statistics.median(ratios):.3f}); {n_events} events published; "
        f"publisher {per_event_us:.2f} us/event; snapshot of {len(snap['blocks'])} blocks {snap_ms:.2f} ms"
    )
    out = dict(
        settings=dict(rounds=args.rounds, requests=args.requests, max_total_tokens=args.max_total_tokens),
        rounds=rounds,
        ratio_total=round(on_t / off_t, 4),
        ratio_median=round(statistics.median(ratios), 4),
        cpu_ratio_total=round(on_c / off_c, 4),
        cpu_ratio_median=round(statistics.median(cpu_ratios), 4),
        torch_threads=torch.get_num_threads(),
        events=n_events,
        publisher_us_per_event=round(per_event_us, 3),
        snapshot_blocks=len(snap["blocks"]),
        snapshot_ms=round(snap_ms, 3),
    )
    path = write_result("events_overhead", out, args.out, argv=argv, started=t_start)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
