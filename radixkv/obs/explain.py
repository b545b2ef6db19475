"""``radixkv explain``: why a trace's prompts miss the prefix cache, and what would fix it.

:func:`explain_trace` replays a trace through the cache alone (:mod:`radixkv.sim`, no model) at a
KV capacity and page size, with the engine's per-request cache outcomes
(:mod:`radixkv.cache.outcome`), and reports:

* the hit rate, and the infinite-capacity bound (the same replay with memory that never runs out);
* the missed prompt tokens by cause (they sum exactly to the missed tokens);
* the prompts that miss most, with the text around the place their match stops;
* the volatile spans (:mod:`radixkv.obs.spans`): where, what shape, an example, how many
  requests and missed tokens they cost, and for each a what-if: the hit rate of the trace with
  the span removed, moved after the shared part, or made static, by replaying the rewritten
  trace;
* the hit rate over the trace and against capacity (fractions of the working set: the tokens
  the infinite cache holds at the end).

Renderers are in :mod:`radixkv.obs.report` (terminal, JSON, self-contained HTML).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from radixkv.cache.outcome import CAUSES
from radixkv.engine.outcome import explain_text
from radixkv.obs.spans import classify_values, expand_to_lines, find_spans, locate, rewrite, shape_of
from radixkv.obs.trace import TraceRequest
from radixkv.sim import SimRequest, simulate

__all__ = ["explain_trace", "FRACTIONS", "DEFAULT_CAPACITY"]

FRACTIONS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 0.9, 1.0)
DEFAULT_CAPACITY = 32768
"""The engine's default KV pool on CPU (tokens)."""


def _decode(tokenizer: Any, ids: Sequence[int]) -> str:
    if tokenizer is None:
        return " ".join(map(str, ids))
    return tokenizer.decode(list(ids), skip_special_tokens=False)


def _position(req: Any, a: int, b: int, tokenizer: Any) -> dict:
    """Where tokens ``[a, b)`` of a request sit: token range, and for chat requests the message
    (index, role), line and column inside its content."""
    pos: dict = dict(tokens=[a, b])
    text = getattr(req, "text", None)
    messages = getattr(req, "messages", None)
    if tokenizer is None or not text:
        return pos
    prefix = _decode(tokenizer, req.tokens[:a])
    off = len(prefix) if text.startswith(prefix) else text.find(_decode(tokenizer, req.tokens[a:b]))
    if off < 0:
        return pos
    pos["char"] = off
    if messages:
        cursor = 0
        for j, m in enumerate(messages):
            start = text.find(m["content"], cursor) if m["content"] else -1
            if start < 0:
                continue
            cursor = start + len(m["content"])
            if start <= off <= cursor:
                inner = m["content"][: off - start]
                pos.update(message=j, role=m["role"], line=inner.count("\n") + 1, column=len(inner.rsplit("\n", 1)[-1]))
                break
    return pos


def _series(cached: list, prompt: list, points: int = 400) -> dict:
    """Cumulative and rolling hit rate per request (downsampled to ``points``)."""
    n = len(cached)
    w = max(5, n // 20)
    cum_c = cum_p = 0
    cumulative, rolling = [], []
    win_c = win_p = 0
    for i in range(n):
        cum_c += cached[i]
        cum_p += prompt[i]
        win_c += cached[i]
        win_p += prompt[i]
        if i >= w:
            win_c -= cached[i - w]
            win_p -= prompt[i - w]
        cumulative.append(cum_c / cum_p if cum_p else 0.0)
        rolling.append(win_c / win_p if win_p else 0.0)
    step = max(1, n // points)
    idx = list(range(0, n, step))
    if n and idx[-1] != n - 1:
        idx.append(n - 1)
    return dict(window=w, index=idx, cumulative=[cumulative[i] for i in idx], rolling=[rolling[i] for i in idx])


def explain_trace(
    requests: Sequence[Any],
    tokenizer: Any = None,
    policy: str = "radix",
    page_size: int = 1,
    capacity: Optional[int] = DEFAULT_CAPACITY,
    hash_algo: str = "builtin",
    top: int = 10,
    spans: bool = True,
    what_if: bool = True,
    sweep: Sequence[float] = FRACTIONS,
    context: int = 24,
    source: str = "",
) -> dict:
    """Analyse a trace (module docstring).

    Args:
        requests: :class:`~radixkv.obs.trace.TraceRequest` (from :func:`radixkv.obs.trace.tokenize_trace`)
            or :class:`~radixkv.sim.SimRequest` items, in arrival order.
        tokenizer: decodes token ids for the texts (None: token ids are shown).
        policy, page_size, capacity, hash_algo: the simulated cache (capacity in tokens; None:
            infinite).
        top: how many of the prompts that miss most to list.
        spans: look for volatile spans; ``what_if``: replay their rewrites.
        sweep: capacity fractions of the working set for the hit-rate-vs-capacity curve (empty:
            none).
        context: tokens of text shown on each side of a divergence.
        source: where the trace came from (shown in the report).

    Returns:
        The report, a JSON-ready dict (see docs/explain.md for its fields).

    Raises:
        ValueError: an empty trace, or bad policy / page size / capacity.
    """
    if not requests:
        raise ValueError("the trace has no requests")
    sims = [r.sim_request() if isinstance(r, TraceRequest) else r for r in requests]
    tokens = [list(s.tokens) for s in sims]
    main = simulate(sims, policy, page_size, capacity, hash_algo)
    inf = simulate(sims, policy, page_size, None, hash_algo, outcomes=False, keep_requests=False)
    missed_total = main.prompt_tokens - main.cached_tokens
    by_cause = {c: main.missed_by_cause.get(c, 0) for c in CAUSES if main.missed_by_cause.get(c, 0)}
    rows = main.requests
    served = [r for r in rows if r.served]
    report: dict = dict(
        source=source,
        config=dict(policy=policy, page_size=page_size, capacity=main.capacity, hash_algo=hash_algo),
        requests=len(rows),
        skipped=main.skipped,
        prompt_tokens=main.prompt_tokens,
        cached_tokens=main.cached_tokens,
        missed_tokens=missed_total,
        hit_rate=main.hit_rate,
        infinite=dict(hit_rate=inf.hit_rate, cached_tokens=inf.cached_tokens, working_set_tokens=inf.cache_tokens_end),
        evicted_tokens=main.evicted_tokens,
        missed_by_cause=by_cause,
        causes_sum_to_missed=sum(by_cause.values()) == missed_total,
        requests_by_cause=dict(
            sorted(
                ((c, sum(1 for r in served if r.outcome.cause == c)) for c in CAUSES),
                key=lambda kv: CAUSES.index(kv[0]),
            )
        ),
    )
    report["requests_by_cause"] = {c: n for c, n in report["requests_by_cause"].items() if n}
    report["series"] = _series([r.num_cached_tokens for r in served], [r.num_prompt_tokens for r in served])
    report["series"]["index"] = [served[i].index for i in report["series"]["index"]]

    worst = sorted(served, key=lambda r: -(r.num_prompt_tokens - r.num_cached_tokens))[:top]
    report["top_misses"] = []
    for r in worst:
        o = r.outcome
        ex = explain_text(o, tokens[r.index], tokenizer, context)
        report["top_misses"].append(
            dict(
                index=r.index,
                line=getattr(requests[r.index], "line", r.index + 1),
                prompt_tokens=o.num_prompt_tokens,
                cached_tokens=o.num_cached_tokens,
                missed_tokens=o.num_missed_tokens,
                cause=o.cause,
                missed=o.missed,
                stop_pos=ex.stop_pos,
                before=ex.before,
                prompt_side=ex.prompt_side,
                cached_side=ex.cached_side,
            )
        )

    report["spans"] = []
    if spans:
        missed_idx = [r.index for r in served if r.outcome.cause not in ("full", "disabled")]
        found, aligned = find_spans(tokens, missed_idx)
        report["aligned_misses"] = aligned
        for k, sp in enumerate(found):
            report["spans"].append(_span_report(k, sp, requests, tokens, sims, rows, tokenizer, what_if, dict(
                policy=policy, page_size=page_size, capacity=capacity, hash_algo=hash_algo)))  # fmt: skip

    report["capacity_curve"] = []
    ws = max(page_size, inf.cache_tokens_end)
    for f in sweep:
        cap = max(page_size, int(ws * f))
        r = simulate(sims, policy, page_size, cap, hash_algo, outcomes=False, keep_requests=False)
        report["capacity_curve"].append(dict(fraction=f, capacity=r.capacity, hit_rate=r.hit_rate))
    return report


def _span_report(k, sp, requests, tokens, sims, rows, tokenizer, what_if, sim_kw) -> dict:
    regions = locate(sp, tokens)
    order = sorted(regions)
    values = [_decode(tokenizer, tokens[r][a:b]) for r, (a, b) in ((r, regions[r]) for r in order[:6])]
    sp.kind = classify_values(values)
    sp.shape = shape_of(values[0]) if values else ""
    members = sp.requests
    cost = 0
    for i in members:
        o = rows[i].outcome
        if o is not None:
            cost += o.num_missed_tokens - o.missed.get("full", 0)
    first = order[0] if order else members[0]
    a, b = regions.get(first, (sp.start, sp.end))
    hit0 = sp.hits[0]
    out = dict(
        id=k,
        kind=sp.kind,
        shape=sp.shape,
        position=_position(requests[first], a, b, tokenizer),
        examples=values[:3],
        aligned=dict(
            request=hit0.request,
            neighbour=hit0.neighbour,
            prompt_side=_decode(tokenizer, tokens[hit0.request][hit0.start : hit0.end]),
            neighbour_side=_decode(tokenizer, tokens[hit0.neighbour][hit0.n_start : hit0.n_end]),
            shared_before=hit0.start,
            shared_after=hit0.suffix,
        ),
        requests=len(members),
        located_in=len(regions),
        missed_tokens=cost,
        what_if={},
    )
    if what_if and regions:
        lines = regions
        if tokenizer is not None:
            nl: dict = {}

            def is_newline(t: int) -> bool:
                if t not in nl:
                    nl[t] = "\n" in tokenizer.decode([t])
                return nl[t]

            lines = expand_to_lines(regions, tokens, is_newline)
        for how in ("removed", "moved", "static"):
            new = rewrite(sp, tokens, how, regions if how == "static" else lines)
            res = simulate(
                [SimRequest(t, s.reply, s.namespace) for t, s in zip(new, sims)],
                outcomes=False,
                keep_requests=False,
                **sim_kw,
            )
            out["what_if"][how] = dict(
                hit_rate=res.hit_rate, cached_tokens=res.cached_tokens, prompt_tokens=res.prompt_tokens
            )
    return out
