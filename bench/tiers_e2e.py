"""The KV tiers end to end (issue 36's targets; docs/tiers.md has the committed figures).

Parts (``--parts``, all by default), each on the default model (SmolLM2-135M) on the CPU:

* ``replay``: ShareGPT multi-turn replay (``radixkv replay``'s ``replay_mode``, greedy) under each
  ``--arrivals`` pattern: ``waves`` (every active conversation's next turn submitted together, the
  next turn when all replied: TTFT is mostly queueing behind the whole wave) and a closed loop of
  ``C`` requests in flight (default 4; a reply queues its conversation's next turn at the back,
  as SGLang's HiCache multi-turn bench does: TTFT is mostly the request's own prefill or load),
  with the pool at ``--pool-fraction`` (10%)
  of the working set (the tokens an unbounded pool holds at the end), without tiers, with a disk
  tier, with a host tier and with a remote (Redis) tier, beside the unbounded pool. Targets: hit
  rate with the disk tier >= 0.95 x the unbounded pool's, TTFT p50 <= 0.5 x the no-tier run's;
  greedy replies identical in every run. Also each tier's load cost per token against prefill per
  token, as the engine's cost model measured them in the run (the stores' own figures:
  bench/tiers_io.py).
* ``restart``: ``radixkv serve --disk-cache-dir D``, the conversations replayed over HTTP, the
  server stopped (SIGINT) and started again on D, replayed again: the second replay's hit rate
  against a server that never stopped (the same replay twice). Target >= 0.9.
* ``shared``: two ``radixkv serve`` processes on one Redis (``--remote-cache-url``), each
  conversation's turns sent to the two alternately: the reuse of a turn sent to the other engine
  (cached / prompt tokens), beside the reuse the same turn gets on one engine. Target >= 90%.
  Once per ``--shared-max-tokens`` reply length (32 and 256 tokens).
* ``replicas``: ``radixkv serve --replicas 2 --remote-cache-url``: one request with a shared
  prefix, then a concurrent burst of ``--burst`` requests with it: each one's cached tokens
  (target: every one reuses the prefix's whole blocks, on whichever replica), beside the same
  without the remote tier.
* ``overhead``: engine step CPU time with a write-through disk tier against no tier (alternating
  rounds, as bench/events_overhead.py). Target <= 1.05.

    python bench/tiers_e2e.py                          # everything (about 20 min on 2 cores)
    python bench/tiers_e2e.py --parts replay,overhead --conversations 48 --turns 4

Writes ``bench/results/tiers_e2e_<UTC time>.json`` (bench/results_io.py).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "tests"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.results_io import write_result  # noqa: E402

PARTS = ("replay", "restart", "shared", "replicas", "overhead")


# ---------------------------------------------------------------------------- replay (in process)
def _llm(loaded, pool: int, **tiers):
    from radixkv import LLM

    return LLM(loaded_model=loaded, device="cpu", max_total_tokens=pool, **tiers)


def _run(llm, convs, max_tokens: int, label: str, concurrency=None) -> dict:
    from radixkv.replay import replay_mode

    res = replay_mode(llm, convs, max_tokens, progress=False, concurrency=concurrency)
    s = llm.cache_stats()
    res["tiers"] = {
        m: {k: t.get(k) for k in ("served_tokens", "loaded", "load_skipped", "load_s_per_token", "prefill_s_per_token")}
        for m, t in s.tiers.items()
    }
    res["working_set_tokens"] = s.cached
    print(
        f"[{label}] hit {res['hit_rate']:.1%} by tier {res['cached_tokens_by_tier']} TTFT p50 {res['ttft_p50_s']:.3f}s "
        f"wall {res['wall_s']:.1f}s",
        flush=True,
    )
    llm.close()
    return res


def _arrival(spec: str):
    """``--arrivals`` item: "waves" (None) or a closed loop's concurrency (int)."""
    return None if spec == "waves" else int(spec)


def replay_part(args, loaded) -> dict:
    """The replay under each ``--arrivals`` pattern (module docstring)."""
    from radixkv.datasets import load_conversations

    convs = load_conversations(args.conversations, args.turns, args.max_user_chars, args.skip)
    return {a: _replay_one(args, loaded, convs, _arrival(a)) for a in args.arrivals.split(",")}


def _replay_one(args, loaded, convs, concurrency) -> dict:
    from redis_fixture import RedisServer

    tag = "waves" if concurrency is None else f"c={concurrency}"

    def run(label: str, pool: int, **tiers) -> dict:
        return _run(_llm(loaded, pool, **tiers), convs, args.max_tokens, f"{tag} {label}", concurrency)

    inf = run("unbounded", 1 << 16)
    longest = inf["max_prompt_tokens"] + args.max_tokens
    pool = max(int(inf["working_set_tokens"] * args.pool_fraction), longest + 16)
    runs = {"unbounded": inf, "no_tier": run("no tier", pool)}
    d = tempfile.mkdtemp(prefix="radixkv-bench-disk-")
    want = args.replay_tiers.split(",")
    try:
        if "disk" in want:
            runs["disk"] = run("disk", pool, disk_cache_dir=d)
        if "disk_preempt" in want:  # the same, its burst's first tokens first (a fresh directory)
            d2 = tempfile.mkdtemp(prefix="radixkv-bench-disk-", dir=d)
            runs["disk_preempt"] = run("disk, first-token preemption", pool, disk_cache_dir=d2,
                                       first_token_preemption=True)  # fmt: skip
        if "host" in want:
            runs["host"] = run("host", pool, host_cache_bytes=8 << 30)
        if "remote" in want:
            with RedisServer() as redis:
                runs["remote"] = run("remote", pool, remote_cache_url=redis.url)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    replies = {k: r.pop("replies") for k, r in runs.items()}
    same = all(v == replies["unbounded"] for v in replies.values())
    costs = {}
    for m in [m for m in ("host", "disk", "remote") if m in runs]:
        t = runs[m]["tiers"][m]
        if t["load_s_per_token"] and t["prefill_s_per_token"]:
            costs[m] = round(t["load_s_per_token"] / t["prefill_s_per_token"], 4)
    out = dict(
        arrivals=tag,
        concurrency=concurrency,
        conversations=args.conversations,
        skip=args.skip,
        turns=args.turns,
        max_tokens=args.max_tokens,
        working_set_tokens=inf["working_set_tokens"],
        pool_tokens=pool,
        runs=runs,
        replies_identical=same,
        hit_ratio_disk_vs_unbounded=runs["disk"]["hit_rate"] / inf["hit_rate"],
        ttft_p50_ratio_disk_vs_no_tier=runs["disk"]["ttft_p50_s"] / runs["no_tier"]["ttft_p50_s"],
        ttft_p50_ratio_unbounded_vs_no_tier=inf["ttft_p50_s"] / runs["no_tier"]["ttft_p50_s"],
        ttft_p50_ratio_disk_preempt_vs_no_tier=(
            runs["disk_preempt"]["ttft_p50_s"] / runs["no_tier"]["ttft_p50_s"] if "disk_preempt" in runs else None
        ),
        load_cost_vs_prefill_per_token=costs,
    )
    print(
        f"replay ({tag}): pool {pool} tokens ({args.pool_fraction:.0%} of {inf['working_set_tokens']}); hit rate disk "
        f"{runs['disk']['hit_rate']:.1%} / unbounded {inf['hit_rate']:.1%} = {out['hit_ratio_disk_vs_unbounded']:.3f} "
        f"(no tier {runs['no_tier']['hit_rate']:.1%}); TTFT p50 disk / no tier = "
        f"{out['ttft_p50_ratio_disk_vs_no_tier']:.3f} (unbounded / no tier {out['ttft_p50_ratio_unbounded_vs_no_tier']:.3f}"
        f"; disk with first-token preemption / no tier {out['ttft_p50_ratio_disk_preempt_vs_no_tier'] or float('nan'):.3f}); "
        f"load/prefill per token {costs}; replies identical: {same}",
        flush=True,
    )
    return out


# ---------------------------------------------------------------------------- servers over HTTP
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Serve:
    """``radixkv serve`` in a subprocess on a free port, ready once ``/health`` answers 200."""

    def __init__(self, *flags: str, timeout: float = 600.0) -> None:
        import httpx

        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "radixkv", "serve", "--device", "cpu", "--port", str(self.port), *flags]
        self.log = tempfile.NamedTemporaryFile(prefix="radixkv-serve-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"radixkv serve exited: {Path(self.log.name).read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("radixkv serve did not start")
            time.sleep(1.0)

    def stop(self, timeout: float = 120.0) -> None:
        """SIGINT (as Ctrl-C: the engine drains its tier writes), then wait."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def http_replay(urls: list, convs: list, max_tokens: int, route=None) -> dict:
    """Replay ``convs`` over HTTP chat completions, turn by turn, each turn's requests at once
    (``route(conversation, turn)``: the index into ``urls``, default 0). Per request: its
    conversation, turn, prompt and cached tokens; the replies."""
    import httpx

    hist = [[] for _ in convs]
    rows, replies = [], [[] for _ in convs]

    def one(i: int, t: int) -> dict:
        u = urls[route(i, t) if route else 0]
        body = dict(model="smollm2-135m", messages=hist[i], max_tokens=max_tokens, temperature=0)
        r = httpx.post(u + "/v1/chat/completions", json=body, timeout=600)
        r.raise_for_status()
        return r.json()

    with ThreadPoolExecutor(max_workers=max(1, len(convs))) as pool:
        for t in range(max(len(c) for c in convs)):
            active = [i for i, c in enumerate(convs) if t < len(c)]
            for i in active:
                hist[i].append({"role": "user", "content": convs[i][t]})
            for i, res in zip(active, pool.map(one, active, [t] * len(active))):
                text = res["choices"][0]["message"]["content"] or ""
                hist[i].append({"role": "assistant", "content": text})
                replies[i].append(text)
                u = res["usage"]
                cached = u.get("prompt_tokens_details", {}).get("cached_tokens", 0)
                rows.append(dict(conv=i, turn=t, prompt=u["prompt_tokens"], cached=cached))
    prompt = sum(r["prompt"] for r in rows)
    return dict(rows=rows, replies=replies, hit_rate=sum(r["cached"] for r in rows) / prompt if prompt else 0.0)


def restart_part(args) -> dict:
    from radixkv.datasets import load_conversations

    convs = load_conversations(args.http_conversations, args.turns, args.max_user_chars)
    d = tempfile.mkdtemp(prefix="radixkv-bench-restart-")
    try:
        s = Serve("--disk-cache-dir", d)
        first = http_replay([s.url], convs, args.max_tokens)
        s.stop()
        s = Serve("--disk-cache-dir", d)
        after_restart = http_replay([s.url], convs, args.max_tokens)
        s.stop()
    finally:
        shutil.rmtree(d, ignore_errors=True)
    s = Serve()
    http_replay([s.url], convs, args.max_tokens)
    never_stopped = http_replay([s.url], convs, args.max_tokens)
    s.stop()
    ratio = after_restart["hit_rate"] / never_stopped["hit_rate"]
    print(
        f"restart: second replay after a restart on the disk dir {after_restart['hit_rate']:.1%} vs never stopped "
        f"{never_stopped['hit_rate']:.1%} = {ratio:.3f} (first replay {first['hit_rate']:.1%}); replies identical: "
        f"{after_restart['replies'] == never_stopped['replies'] == first['replies']}",
        flush=True,
    )
    return dict(
        conversations=len(convs),
        first_hit_rate=first["hit_rate"],
        after_restart_hit_rate=after_restart["hit_rate"],
        never_stopped_hit_rate=never_stopped["hit_rate"],
        ratio=ratio,
        replies_identical=after_restart["replies"] == never_stopped["replies"] == first["replies"],
    )


def shared_part(args) -> dict:
    """Two engines on one Redis, once per ``--shared-max-tokens`` reply length (module docstring)."""
    return {f"max_tokens_{n}": _shared_one(args, int(n)) for n in args.shared_max_tokens.split(",")}


def _shared_one(args, max_tokens: int) -> dict:
    from redis_fixture import RedisServer

    from radixkv.datasets import load_conversations

    convs = load_conversations(args.http_conversations, args.turns, args.max_user_chars)
    with RedisServer() as redis:
        a, b = Serve("--remote-cache-url", redis.url), Serve("--remote-cache-url", redis.url)
        try:
            alt = http_replay([a.url, b.url], convs, max_tokens, route=lambda i, t: (i + t) % 2)
        finally:
            a.stop()
            b.stop()
    one = Serve()
    try:
        same = http_replay([one.url], convs, max_tokens)
    finally:
        one.stop()
    later = [r for r in alt["rows"] if r["turn"] > 0]
    base = {(r["conv"], r["turn"]): r for r in same["rows"]}
    reuse = [r["cached"] / r["prompt"] for r in later]
    vs_same = [r["cached"] / max(1, base[(r["conv"], r["turn"])]["cached"]) for r in later]
    out = dict(
        conversations=len(convs),
        max_tokens=max_tokens,
        next_turn_reuse_mean=statistics.mean(reuse),
        next_turn_reuse_min=min(reuse),
        same_engine_reuse_mean=statistics.mean(base[(r["conv"], r["turn"])]["cached"] / r["prompt"] for r in later),
        vs_same_engine_mean=statistics.mean(vs_same),
        vs_same_engine_min=min(vs_same),
        rows=alt["rows"],
        same_engine_rows=same["rows"],
        replies_identical=alt["replies"] == same["replies"],
    )
    print(
        f"shared ({max_tokens}-token replies): a next turn on the other engine reuses {out['next_turn_reuse_mean']:.1%} "
        f"of its prompt (min {out['next_turn_reuse_min']:.1%}; one engine: {out['same_engine_reuse_mean']:.1%}); of "
        f"what one engine reuses: mean {out['vs_same_engine_mean']:.1%}, min {out['vs_same_engine_min']:.1%}; "
        f"replies identical: {out['replies_identical']}",
        flush=True,
    )
    return out


def replicas_part(args) -> dict:
    from redis_fixture import RedisServer

    system = "You are the support assistant of the Northwind trading company. " * 24
    questions = [f"Question {i}: what is the status of order {1000 + i}?" for i in range(args.burst + 1)]
    out = {}
    with RedisServer() as redis:
        for label, flags in (("remote", ["--remote-cache-url", redis.url]), ("no_tier", [])):
            s = Serve("--replicas", "2", *flags, timeout=900)
            try:
                out[label] = _burst(s.url, system, questions)
            finally:
                s.stop(300)
            print(f"replicas ({label}): first {out[label]['first']}, burst cached {out[label]['burst']}", flush=True)
    return out


def _burst(url: str, system: str, questions: list) -> dict:
    import httpx

    def ask(q: str) -> dict:
        body = dict(
            model="smollm2-135m",
            messages=[{"role": "system", "content": system}, {"role": "user", "content": q}],
            max_tokens=8,
            temperature=0,
        )
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
        r.raise_for_status()
        u = r.json()["usage"]
        return dict(prompt=u["prompt_tokens"], cached=u.get("prompt_tokens_details", {}).get("cached_tokens", 0))

    first = ask(questions[0])
    with ThreadPoolExecutor(max_workers=len(questions) - 1) as pool:
        burst = list(pool.map(ask, questions[1:]))
    return dict(first=first, burst=burst)


# ---------------------------------------------------------------------------- write-through overhead
def overhead_part(args, loaded) -> dict:
    import torch

    from bench.events_overhead import run as timed_run
    from bench.events_overhead import workload
    from radixkv.config import EngineConfig
    from radixkv.engine import Engine

    torch.set_num_threads(1)
    d = tempfile.mkdtemp(prefix="radixkv-bench-wt-")
    cfg = dict(device="cpu", max_total_tokens=2048)
    engines = {
        "off": Engine(EngineConfig(**cfg), loaded_model=loaded),
        "on": Engine(EngineConfig(**cfg, disk_cache_dir=d), loaded_model=loaded),
    }
    for e in engines.values():
        timed_run(e, workload(loaded.tokenizer, 4, 99), None)  # warm-up
    cpu = {"on": 0.0, "off": 0.0}
    rounds = []
    for r in range(args.rounds):
        prompts = workload(loaded.tokenizer, args.requests, 1000 + r)  # new prompts: every block is new
        got = {}
        for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):
            engines[mode].reset_prefix_cache()
            _, got[mode], _ = timed_run(engines[mode], prompts, None)
            cpu[mode] += got[mode]
        rounds.append(dict(off_cpu_s=round(got["off"], 3), on_cpu_s=round(got["on"], 3)))
        print(f"overhead round {r}: CPU off {got['off']:.2f}s on {got['on']:.2f}s", flush=True)
    written = engines["on"].cache_stats().tiers["disk"]["blocks_written"]
    for e in engines.values():
        e.close()
    shutil.rmtree(d, ignore_errors=True)
    ratio = cpu["on"] / cpu["off"]
    print(f"write-through: engine step CPU time on / off = {ratio:.3f} ({written} blocks written)", flush=True)
    return dict(rounds=rounds, cpu_ratio_total=ratio, blocks_written=written, requests=args.requests)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated among {', '.join(PARTS)}")
    ap.add_argument("--conversations", type=int, default=48, help="replay: conversations (default 48)")
    ap.add_argument("--http-conversations", type=int, default=8, help="restart/shared: conversations (default 8)")
    ap.add_argument(
        "--skip", type=int, default=0,
        help="replay: skip this many eligible conversations first (held-out data; default 0)",
    )  # fmt: skip
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-user-chars", type=int, default=1200)
    ap.add_argument(
        "--shared-max-tokens",
        default="32,256",
        help="shared: comma-separated reply lengths, one run each (default 32,256: ShareGPT's own replies run to "
        "hundreds of tokens, and the reply is most of the history a next turn reuses)",
    )
    ap.add_argument("--pool-fraction", type=float, default=0.1)
    ap.add_argument(
        "--arrivals",
        default="waves,4",
        help="replay: comma-separated arrival patterns, 'waves' (every conversation's turn at once) or a closed "
        "loop's concurrency C (at most C requests in flight; a reply queues the next turn; default waves,4)",
    )
    ap.add_argument(
        "--replay-tiers", default="disk,disk_preempt,host,remote",
        help="replay: the tier runs (disk_preempt: disk with first_token_preemption; default all four)",
    )  # fmt: skip
    ap.add_argument("--burst", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=4, help="overhead: rounds")
    ap.add_argument("--requests", type=int, default=16, help="overhead: requests per round")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    bad = [p for p in parts if p not in PARTS]
    if bad:
        ap.error(f"unknown parts {bad}; choose among {PARTS}")
    t0 = time.time()
    loaded = None
    if {"replay", "overhead"} & set(parts):
        from radixkv.models import load_model

        loaded = load_model("smollm2-135m")
    results: dict = {}
    for p in parts:
        fn = globals()[f"{p}_part"]
        results[p] = fn(args, loaded) if p in ("replay", "overhead") else fn(args)
    import torch

    path = write_result("tiers_e2e", results, args.out, started=t0, machine={"torch": torch.__version__})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
