"""`radixkv replay`: the main job. Real ShareGPT conversations replayed turn by turn, radix prefix
caching on vs off, in the same run.

Each turn's prompt is the model's chat template over the conversation so far (the user's real
messages and the model's *own* earlier replies) plus the next user message, so turn ``t + 1``
starts with everything turn ``t`` computed. ``--conversations`` conversations run at once: the
current turn of every active conversation is submitted together, and the next turn goes out when
all replies are back; with ``--concurrency C``, at most C requests are in flight instead, a
conversation's next turn queued behind the others' once its reply is back (closed loop). Greedy decoding, so every mode sees the same prompts and must give the same
replies (checked and printed; a difference is exit status 1 with float32 K/V, and reported
only with a smaller K/V dtype, whose rounding can flip a reply: docs/model.md).

Reported per mode: requests, prompt tokens, cached tokens (prompt tokens served from the prefix
cache), hit rate, prefill tokens computed, TTFT p50/p90 (submission to first token, queueing
included), output tokens/s, wall time (model load excluded). ``--speculative-config JSON``
turns on speculative decoding in every mode (the JSON rows then count its draft and accepted
tokens; the replies stay identical). ``--kv-cache-dtype`` and
``--kv-cache-memory-bytes`` (or ``--max-total-tokens``) set the KV pool as the engine's options do;
the JSON rows (``--output``) carry its ``capacity``, ``kv_cache_dtype``, ``kv_bytes_per_token`` and
``kv_cache_bytes``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from collections import deque
from typing import Dict, List, Optional

import numpy as np

from radixkv.datasets import load_conversations
from radixkv.spec import config as spec_config

MODES = {"radix": "radix", "hash": "hash", "off": "none"}
ROW_KEYS = (
    "mode",
    "requests",
    "prompt_tokens",
    "cached_tokens",
    "hit_rate",
    "prefill_tokens",
    "ttft_p50_s",
    "ttft_p90_s",
    "output_tokens_per_s",
    "wall_s",
)


_KV_KEYS = ("capacity", "kv_cache_dtype", "kv_bytes_per_token", "kv_cache_bytes")


def room_of(llm) -> int:
    """The most tokens a request (prompt + ``max_tokens``) may take in ``llm``'s engine: its
    ``max_context_len``, and the KV pool's whole pages."""
    cfg = llm.engine.config
    return min(llm.engine.max_context_len, cfg.max_total_tokens // cfg.page_size * cfg.page_size)


def first_turn_error(llm, conversations: List[List[str]], max_tokens: int) -> Optional[str]:
    """Why the replay cannot start (None: it can): a conversation whose first prompt (no reply in
    it yet: its exact length) and ``max_tokens`` exceed what ``llm``'s engine takes, said with the
    flags that change it. Later turns that outgrow the engine end their conversation early (counted
    and reported), since their length depends on the replies."""
    room = room_of(llm)
    for k, c in enumerate(conversations):
        n = len(llm.tokenizer.encode(llm.render_chat([{"role": "user", "content": c[0]}]), add_special_tokens=False))
        if n + max_tokens > room:
            return (
                f"conversation {k}'s first prompt ({n} tokens) + --max-tokens {max_tokens} exceeds the {room} tokens a "
                f"request may take (max_context_len {llm.engine.max_context_len}, the KV pool's "
                f"{llm.engine.config.max_total_tokens} slots): lower --max-tokens or --max-user-chars, or give a "
                "larger --max-total-tokens / --kv-cache-memory-bytes"
            )
    return None


class _Replay:
    """One replay's state: each conversation's history and replies, the requests' TTFTs; builds
    a conversation's next prompt and takes its reply."""

    def __init__(self, llm, conversations: List[List[str]], max_tokens: int, log, model: str) -> None:
        self.llm, self.conversations, self.max_tokens, self.log, self.model = llm, conversations, max_tokens, log, model
        self.histories: List[List[dict]] = [[] for _ in conversations]
        self.replies: List[List[List[int]]] = [[] for _ in conversations]
        self.ttfts: List[float] = []
        self.out_tokens = 0
        self.longest = 0
        self.room = room_of(llm)
        self.ended: set = set()  # conversations ended before their last turn (their next prompt did not fit)

    def prompt(self, i: int) -> Optional[List[int]]:
        """Conversation ``i``'s next turn: the chat template over its history plus its next user
        message (token ids); logged as the chat body a client would send. None, and the
        conversation ends there, when the prompt and ``max_tokens`` exceed what the engine takes
        (``self.room``: its replies made the history too long)."""
        h = self.histories[i]
        h.append({"role": "user", "content": self.conversations[i][len(self.replies[i])]})
        ids = self.llm.tokenizer.encode(self.llm.render_chat(h), add_special_tokens=False)
        if len(ids) + self.max_tokens > self.room:
            self.ended.add(i)
            return None
        self.longest = max(self.longest, len(ids))
        if self.log is not None:
            self.log.write(
                dict(model=self.model, messages=[dict(m) for m in h], max_tokens=self.max_tokens, temperature=0)
            )
        return ids

    def reply(self, i: int, out) -> bool:
        """Take conversation ``i``'s finished request ``out``; True while it has turns left."""
        c = out.outputs[0]
        self.histories[i].append({"role": "assistant", "content": c.text})
        self.replies[i].append(list(c.token_ids))
        self.out_tokens += len(c.token_ids)
        self.ttfts.append(out.metrics.ttft)
        return len(self.replies[i]) < len(self.conversations[i])


def _waves(rp: _Replay, params, bar) -> None:
    """Every active conversation's next turn submitted together; the next wave once all replied."""
    for t in range(max(len(c) for c in rp.conversations)):
        active = [i for i, c in enumerate(rp.conversations) if t < len(c) and i not in rp.ended]
        prompts = {i: rp.prompt(i) for i in active}
        active = [i for i in active if prompts[i] is not None]
        if not active:
            break
        outs = rp.llm.generate(prompt_token_ids=[prompts[i] for i in active], sampling_params=params, use_tqdm=False)
        for i, o in zip(active, outs):
            rp.reply(i, o)
        bar.update(len(active))


def _closed_loop(rp: _Replay, params, concurrency: int, bar) -> None:
    """At most ``concurrency`` requests in flight, from a FIFO queue that starts with every
    conversation's first turn; a reply puts its conversation's next turn at the back of the queue
    (SGLang's multi-turn bench for HiCache, ``benchmark/hicache/bench_multiturn.py`` with
    ``--max-parallel``, works so)."""

    def drive(engine) -> None:
        queue, running = deque(range(len(rp.conversations))), {}
        try:
            while queue or running:
                while queue and len(running) < concurrency:
                    i = queue.popleft()
                    ids = rp.prompt(i)
                    if ids is not None:  # else the conversation ends here
                        running[engine.add_request(ids, params)] = i
                for out in engine.step():
                    if out.finished and out.request_id in running:
                        i = running.pop(out.request_id)
                        bar.update(1)
                        if rp.reply(i, out):
                            queue.append(i)
        except BaseException:
            for rid in running:
                engine.abort_request(rid)
            while engine.has_unfinished_requests():
                engine.step()
            raise

    rp.llm.call_in_engine_thread(drive)


def replay_mode(
    llm,
    conversations: List[List[str]],
    max_tokens: int,
    progress: bool = True,
    desc: str = "replay",
    log=None,
    model: str = "smollm2-135m",
    concurrency: Optional[int] = None,
) -> Dict[str, object]:
    """Replay ``conversations`` turn by turn through ``llm`` (greedy); returns the metrics row
    (without "mode") plus ``replies`` (token ids per conversation and turn). ``concurrency``:
    None sends every active conversation's next turn together (waves); an int ``c >= 1`` keeps
    at most ``c`` requests in flight, a conversation's next turn queued behind the others' when
    its reply is back (:func:`_closed_loop`). TTFT counts from submission (queueing in the engine
    included). ``log``: a :class:`~radixkv.obs.trace.TraceWriter` that gets each request as the
    chat body a client would send (``model`` in it), the trace ``radixkv explain`` reads.

    A conversation whose next prompt and ``max_tokens`` outgrow what the engine takes ends there
    (the row's ``conversations_ended_early``).

    Raises:
        ValueError: ``concurrency`` below 1, or a first prompt the engine cannot take
            (:func:`first_turn_error`).
    """
    from tqdm.auto import tqdm

    from radixkv.sampling_params import SamplingParams

    if concurrency is not None and concurrency < 1:
        raise ValueError(f"concurrency must be >= 1 (or None: waves), got {concurrency}")
    why = first_turn_error(llm, conversations, max_tokens)
    if why is not None:
        raise ValueError(why)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    rp = _Replay(llm, conversations, max_tokens, log, model)
    before = llm.cache_stats()
    bar = tqdm(total=sum(len(c) for c in conversations), desc=desc, unit="req", disable=not progress)
    t0 = time.perf_counter()
    if concurrency is None:
        _waves(rp, params, bar)
    else:
        _closed_loop(rp, params, concurrency, bar)
    wall = time.perf_counter() - t0
    bar.close()
    return _row(rp, before, llm.cache_stats(), wall)


def _row(rp: _Replay, before, after, wall: float) -> Dict[str, object]:
    """The replay's metrics row from the engine's stats before and after it."""
    prompt_tokens = after["prompt_tokens"] - before["prompt_tokens"]
    cached = after["cached_tokens"] - before["cached_tokens"]
    return {
        "requests": len(rp.ttfts),
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached,
        "hit_rate": cached / prompt_tokens if prompt_tokens else 0.0,
        "prefill_tokens": after["prefill_tokens"] - before["prefill_tokens"],
        "ttft_p50_s": float(np.percentile(rp.ttfts, 50)),
        "ttft_p90_s": float(np.percentile(rp.ttfts, 90)),
        "output_tokens_per_s": rp.out_tokens / wall if wall > 0 else 0.0,
        "wall_s": wall,
        "output_tokens": rp.out_tokens,
        "evicted_tokens": after["evicted_tokens"] - before["evicted_tokens"],
        "max_prompt_tokens": rp.longest,
        "cached_tokens_by_tier": {
            m: n - before.cached_tokens_by_tier.get(m, 0) for m, n in after.cached_tokens_by_tier.items()
        },
        "spec_draft_tokens": after["spec_draft_tokens"] - before["spec_draft_tokens"],
        "spec_accepted_tokens": after["spec_accepted_tokens"] - before["spec_accepted_tokens"],
        "retractions": after["num_retractions"] - before["num_retractions"],
        "conversations_ended_early": len(rp.ended),
        "max_request_tokens": rp.room,
        "replies": rp.replies,
    }


def format_table(rows: List[dict]) -> str:
    """The rows as a fixed-width text table."""
    cols = [
        ("mode", "mode", "{}"),
        ("requests", "reqs", "{}"),
        ("prompt_tokens", "prompt tok", "{}"),
        ("cached_tokens", "cached tok", "{}"),
        ("hit_rate", "hit rate", "{:.1%}"),
        ("prefill_tokens", "prefill tok", "{}"),
        ("ttft_p50_s", "TTFT p50 s", "{:.3f}"),
        ("ttft_p90_s", "TTFT p90 s", "{:.3f}"),
        ("output_tokens_per_s", "out tok/s", "{:.1f}"),
        ("wall_s", "wall s", "{:.1f}"),
    ]
    cells = [[h for _, h, _ in cols]] + [[fmt.format(r[k]) for k, _, fmt in cols] for r in rows]
    widths = [max(len(row[j]) for row in cells) for j in range(len(cols))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``radixkv replay``."""
    parser.add_argument("--conversations", type=int, default=8, help="conversations replayed at once (default 8)")
    parser.add_argument("--turns", type=int, default=4, help="user turns per conversation (default 4)")
    parser.add_argument("--max-tokens", type=int, default=32, help="max tokens per reply (default 32)")
    parser.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="at most this many requests in flight, each reply queueing its conversation's next turn "
        "(default: every conversation's turn at once, turn by turn)",
    )
    parser.add_argument("--page-size", type=int, default=1, help="KV page size in tokens (default 1)")
    parser.add_argument(
        "--max-total-tokens",
        type=int,
        default=None,
        help="KV pool capacity in tokens (default: the engine's, 32768 on CPU)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="K/V storage dtype: auto (the model's), float32, bfloat16, float16, fp8_e4m3, fp8_e5m2 (default auto)",
    )
    parser.add_argument(
        "--kv-cache-memory-bytes",
        default=None,
        metavar="BYTES",
        help="KV pool size in bytes, e.g. 512MiB, 1.5GB (instead of --max-total-tokens)",
    )
    parser.add_argument(
        "--modes", default="radix,off", help="comma-separated modes among radix, hash, off (default radix,off)"
    )
    parser.add_argument("--model", default="smollm2-135m", help="model name or path (default smollm2-135m)")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda (default auto)")
    parser.add_argument(
        "--max-user-chars", type=int, default=1200, help="skip conversations with a longer user message (default 1200)"
    )
    parser.add_argument("--skip", type=int, default=0, help="skip this many eligible conversations first")
    parser.add_argument("--output", default=None, help="write the rows as a JSON list to this file")
    parser.add_argument(
        "--log-requests",
        default=None,
        metavar="FILE",
        help="write the first mode's requests as a JSONL trace of chat bodies (what `radixkv explain` reads)",
    )
    parser.add_argument(
        "--speculative-config", type=spec_config.cli_arg, default=None, metavar="JSON", help=spec_config.CLI_HELP
    )
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    from radixkv.server.cli import add_tier_arguments

    add_tier_arguments(parser)  # KV tiers of the cached modes (docs/tiers.md)


def _print_spec_rows(rows: List[dict], spec) -> None:
    """Each mode's speculative-decoding totals (nothing when ``spec`` is None)."""
    if spec is None:
        return
    for r in rows:
        d, a = r["spec_draft_tokens"], r["spec_accepted_tokens"]
        print(f"[{r['mode']}] speculative {spec.method}: {d} draft tokens, {a} accepted ({a / max(d, 1):.0%})")


def identical_verdict(replies: Dict[str, list], modes: List[str], rows: List[dict]) -> tuple:
    """(the line to print, or "" with one mode; whether the run passes) for the modes' greedy
    replies: a difference fails with a float32 pool, and is only reported with a smaller K/V
    dtype, whose rounding magnifies the last-bit differences of a prompt prefilled in other
    pieces (a cached prefix), so a greedy reply may flip (docs/model.md)."""
    same = all(replies[m] == replies[modes[0]] for m in modes)
    lossy = rows[0]["kv_cache_dtype"] if rows and rows[0]["kv_cache_dtype"] != "float32" else None
    if len(modes) < 2:
        return "", True
    note = f" (possible with {lossy} K/V, not a failure: docs/model.md)" if lossy and not same else ""
    return f"greedy replies identical across modes: {'yes' if same else 'NO'}{note}", same or lossy is not None


def _print_retractions(rows: List[dict]) -> None:
    """A line per mode whose engine retracted (preempted) requests for KV room: how many times (the
    tokens a retracted request computes again count in its prefill tokens)."""
    for r in rows:
        if r["retractions"]:
            print(
                f"[{r['mode']}] {r['retractions']} retractions: requests preempted for KV room and resumed "
                "(what they computed again counts in prefill tok)"
            )


def _print_ended_early(rows: List[dict], args: argparse.Namespace) -> None:
    """A line per mode in which conversations ended before their last turn (their history outgrew
    what a request may take)."""
    for r in rows:
        if r["conversations_ended_early"]:
            print(
                f"[{r['mode']}] {r['conversations_ended_early']} of {args.conversations} conversations ended before "
                f"their last turn: the next prompt + --max-tokens {args.max_tokens} exceeded the "
                f"{r['max_request_tokens']} tokens a request may take (give a larger --max-total-tokens / "
                "--kv-cache-memory-bytes, or fewer --turns / --max-tokens)"
            )


def _print_tier_rows(rows: List[dict]) -> None:
    """A line per mode whose KV tiers served tokens: its cached tokens by tier."""
    for r in rows:
        if any(n for m, n in r["cached_tokens_by_tier"].items() if m != "device"):
            print(f"{r['mode']}: cached tokens by tier {r['cached_tokens_by_tier']}")


def _bad_args(args: argparse.Namespace, modes: List[str]) -> Optional[str]:
    """What is wrong with the replay's ``modes`` and counts (None: nothing)."""
    if not modes or any(m not in MODES for m in modes):
        return f"--modes must list some of {sorted(MODES)}, got {args.modes!r}"
    twice = sorted({m for m in modes if modes.count(m) > 1})
    if twice:
        return f"--modes lists {', '.join(twice)} more than once, got {args.modes!r} (a mode's row is its own run)"
    for name in ("conversations", "turns", "max_tokens", "page_size", "concurrency", "max_user_chars"):
        if getattr(args, name, None) is not None and getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be >= 1"
    if getattr(args, "skip", 0) < 0:
        return "--skip must be >= 0"
    tiers = [f"--{n.replace('_', '-')}" for n in ("host_cache_bytes", "disk_cache_dir", "remote_cache_url")]
    given = {f: getattr(args, f[2:].replace("-", "_"), None) for f in tiers}  # '' is given; host 0 is none
    tiers = [f for f, v in given.items() if (v if f == "--host-cache-bytes" else v is not None)]
    if tiers and "hash" in modes and "write_back" in (getattr(args, "kv_tier_write_policy", None) or ""):
        return "--kv-tier-write-policy write_back needs the radix cache; --modes hash writes every tier through"
    if tiers and "off" in modes and len(modes) == 1:
        return f"{', '.join(tiers)}: KV tiers serve the cached modes (radix, hash); --modes off has none"
    shared = [f for f in tiers if f != "--host-cache-bytes"]
    if shared and len([m for m in modes if m != "off"]) > 1:
        return (
            f"{', '.join(shared)}: with more than one cached mode the later one reads the blocks the earlier "
            "one wrote there (its hit rate would not be its own); replay one cached mode per run"
        )
    out, log = getattr(args, "output", None), getattr(args, "log_requests", None)
    if out and log and os.path.realpath(out) == os.path.realpath(log):
        return f"--output and --log-requests name the same file {out!r} (the rows would overwrite the trace)"
    from radixkv.obs.cli import check_writable

    try:  # before the model loads and the replay runs, not after
        check_writable(getattr(args, "output", None), getattr(args, "log_requests", None))
    except ValueError as exc:
        return str(exc)
    return None


def _conversations(args: argparse.Namespace) -> Optional[List[List[str]]]:
    """The replay's conversations (None, said on stderr: too few ShareGPT conversations qualify)."""
    try:
        return load_conversations(args.conversations, args.turns, args.max_user_chars, args.skip)
    except RuntimeError as exc:
        print(f"radixkv replay: {exc}", file=sys.stderr)
        return None


def _tier_kwargs(args: argparse.Namespace) -> dict:
    """The KV tier keywords of the cached modes' engines (``radixkv serve``'s flags)."""
    from radixkv.server.cli import tier_kwargs_from_args

    return tier_kwargs_from_args(args)


def _engine_config(args: argparse.Namespace, modes: List[str], kv: dict, tiers: dict):
    """The replay's resolved ``EngineConfig`` (no tiers), after checking the cached modes' KV tier
    settings as their engines will (a malformed URL, a zero disk budget, a bad write policy).

    Raises:
        ValueError: naming the field.
    """
    from radixkv.config import EngineConfig

    cfg = EngineConfig(model=args.model, device=args.device, page_size=args.page_size, **kv).resolve()
    cached = [MODES[m] for m in modes if m != "off"]
    if tiers and cached:
        from radixkv.engine.tiers import check_settings

        check_settings(
            EngineConfig(model=args.model, device=cfg.device, prefix_cache=cached[0], **kv, **tiers).resolve()
        )
    return cfg


def run(args: argparse.Namespace, loaded_model=None) -> int:
    """Run the replay described by ``args``; prints the table, returns 0 (1 if outputs differ
    between modes, 2 for bad arguments). ``loaded_model`` reuses already loaded weights."""
    from radixkv.llm import LLM
    from radixkv.models.loader import load_model

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    err = _bad_args(args, modes)
    if err is not None:
        print(f"radixkv replay: {err}", file=sys.stderr)
        return 2
    kv = dict(
        max_total_tokens=args.max_total_tokens,
        kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
        kv_cache_memory_bytes=getattr(args, "kv_cache_memory_bytes", None),
    )
    spec = getattr(args, "speculative_config", None)
    tiers = _tier_kwargs(args)
    try:  # bad K/V and tier options fail before the dataset and the model load
        cfg = _engine_config(args, modes, kv, tiers)
    except ValueError as exc:
        print(f"radixkv replay: {exc}", file=sys.stderr)
        return 2
    t_setup = time.perf_counter()
    convs = _conversations(args)
    if convs is None:
        return 2
    rows: List[dict] = []
    replies: Dict[str, list] = {}
    t_load = time.perf_counter()
    loaded = loaded_model if loaded_model is not None else load_model(args.model, cfg.device, cfg.dtype)
    print(f"model {args.model} loaded in {time.perf_counter() - t_load:.1f} s on {cfg.device}", file=sys.stderr)
    # Untimed warm-up (first turn, 2 tokens, no cache): torch's first calls of each kernel and
    # shape are slow, which would otherwise penalize whichever mode is timed first.
    warm = LLM(
        args.model,
        device=cfg.device,
        page_size=args.page_size,
        **kv,
        prefix_cache="none",
        loaded_model=loaded,
    )
    why = first_turn_error(warm, convs, args.max_tokens)
    if why is not None:  # before any mode replays
        print(f"radixkv replay: {why}", file=sys.stderr)
        return 2
    replay_mode(warm, [c[:1] for c in convs], 2, progress=False)
    del warm
    log = None
    if args.log_requests:
        from radixkv.obs.trace import TraceWriter

        open(args.log_requests, "w").close()  # a fresh trace
        log = TraceWriter(args.log_requests)
    for k, mode in enumerate(modes):
        llm = LLM(
            args.model,
            device=cfg.device,
            page_size=args.page_size,
            **kv,
            prefix_cache=MODES[mode],
            loaded_model=loaded,
            **(tiers if mode != "off" else {}),
            speculative_config=spec,
        )
        st = llm.cache_stats()
        print(
            f"[{mode}] engine: {st['capacity']} KV slots, page_size {args.page_size}, {st['kv_cache_dtype']} K/V "
            f"({st['kv_bytes_per_token']} bytes/token, {st['kv_cache_bytes'] / 2**20:.1f} MiB)",
            file=sys.stderr,
        )
        res = replay_mode(
            llm,
            convs,
            args.max_tokens,
            progress=not args.no_progress,
            desc=f"replay {mode}",
            log=log if k == 0 else None,
            model=args.model,
            concurrency=getattr(args, "concurrency", None),
        )
        replies[mode] = res.pop("replies")
        rows.append({"mode": mode, **res, "page_size": args.page_size, **{k: st[k] for k in _KV_KEYS}})
        llm.close()  # the KV tiers' queued writes (a later run on the same --disk-cache-dir finds them)
        del llm
        gc.collect()
    if log is not None:
        log.close()
        print(f"wrote {log.count} requests to {args.log_requests}", file=sys.stderr)
    ok = _report(args, rows, replies, modes, spec)
    print(f"total time {time.perf_counter() - t_setup:.1f} s (dataset, model loads and replays)")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(rows, f, indent=2)
    return 0 if ok else 1


def _report(args: argparse.Namespace, rows: List[dict], replies: Dict[str, list], modes: List[str], spec) -> bool:
    """Print the table and the lines below it; whether the run passes (:func:`identical_verdict`)."""
    print(format_table(rows))
    _print_tier_rows(rows)
    _print_ended_early(rows, args)
    _print_retractions(rows)
    _print_spec_rows(rows, spec)
    line, ok = identical_verdict(replies, modes, rows)
    if line:
        print(line)
    return ok
