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
from radixkv.sim import SimRequest, capacity_bound, simulate

__all__ = ["explain_trace", "FRACTIONS", "DEFAULT_CAPACITY"]

FRACTIONS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 0.9, 1.0)
FIX_ORDER = ("static", "moved", "removed")
"""The what-if rewrites preferred, in order, when their hit rates tie (the first keeps the most
of the prompt)."""
FIX_WORDS = {"static": "made static", "moved": "moved after the shared part", "removed": "removed"}
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
    tiers: Optional[dict] = None,
    tier_write_policy: Any = None,
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
        tiers: KV tiers below the pool, ``{medium: capacity in tokens}`` (docs/tiers.md): the
            replay counts what they hold as served (``tiers`` in the report: tokens served by
            each; ``hit_rate`` and ``cached_tokens`` include them, ``missed_tokens`` and its
            causes stay the pool's, and each top miss lists its ``tier_spans``).
        tier_write_policy: their write policy, as ``EngineConfig.kv_tier_write_policy`` (None:
            the engine's defaults).

    Returns:
        The report, a JSON-ready dict (see docs/explain.md for its fields).

    Raises:
        ValueError: an empty trace, or bad policy / page size / capacity.
    """
    if not requests:
        raise ValueError("the trace has no requests")
    sims = [r.sim_request() if isinstance(r, TraceRequest) else r for r in requests]
    tokens = [list(s.tokens) for s in sims]
    sim_kw = dict(policy=policy, page_size=page_size, hash_algo=hash_algo)
    if capacity is not None and capacity < page_size:
        raise ValueError(f"capacity {capacity} holds no page of page_size {page_size} tokens")
    cap = _sim_capacity(sims, capacity, page_size)
    main = simulate(sims, capacity=cap, tiers=tiers, tier_write_policy=tier_write_policy, **sim_kw)
    inf = simulate(sims, capacity=None, outcomes=False, keep_requests=False, **sim_kw)
    served = [r for r in main.requests if r.served]
    report = _summary(main, inf, served, source, hash_algo)
    if capacity is not None:
        report["config"]["capacity"] = capacity  # as asked (the replay's may be the trace's bound)
    if tiers:
        report["tiers"] = dict(capacity_tokens=dict(tiers), served_tokens=dict(main.cached_tokens_by_tier))
    report["top_misses"] = _top_misses(served, requests, tokens, tokenizer, top, context)
    report["spans"] = []
    if spans:
        missed_idx = [r.index for r in served if r.outcome.cause not in ("full", "disabled")]
        found, report["aligned_misses"] = find_spans(tokens, missed_idx)
        for k, sp in enumerate(found):
            report["spans"].append(
                _span_report(
                    k, sp, requests, tokens, sims, main.requests, tokenizer, what_if, dict(sim_kw, capacity=capacity)
                )
            )
    report["series"]["fix"] = _fix_series(report["spans"])
    sweep = sweep if policy != "none" else ()  # no cache: nothing to size (working set 0)
    report["capacity_curve"] = _capacity_curve(sims, sim_kw, max(page_size, inf.cache_tokens_end), sweep)
    return report


def _sim_capacity(sims: Sequence[SimRequest], capacity: Optional[int], page_size: int) -> Optional[int]:
    """The capacity to replay ``sims`` at: None (the trace's bound, never short: the same replay)
    for one at least that bound, so a huge ``--capacity`` does not allocate slots never used."""
    return None if capacity is None or capacity >= capacity_bound(sims, page_size) else capacity


def _summary(main: Any, inf: Any, served: list, source: str, hash_algo: str) -> dict:
    """The report's totals: config, hit rates, missed tokens and requests by cause, the series."""
    missed_total = main.prompt_tokens - main.cached_tokens + sum(main.cached_tokens_by_tier.values())  # the pool's
    by_cause = {c: main.missed_by_cause.get(c, 0) for c in CAUSES if main.missed_by_cause.get(c, 0)}
    by_request = {c: sum(1 for r in served if r.outcome.cause == c) for c in CAUSES}
    report: dict = dict(
        source=source,
        config=dict(policy=main.policy, page_size=main.page_size, capacity=main.capacity, hash_algo=hash_algo),
        requests=len(main.requests),
        skipped=main.skipped,
        prompt_tokens=main.prompt_tokens,
        cached_tokens=main.cached_tokens,
        missed_tokens=missed_total,
        hit_rate=main.hit_rate,
        infinite=dict(hit_rate=inf.hit_rate, cached_tokens=inf.cached_tokens, working_set_tokens=inf.cache_tokens_end),
        evicted_tokens=main.evicted_tokens,
        missed_by_cause=by_cause,
        causes_sum_to_missed=sum(by_cause.values()) == missed_total,
        requests_by_cause={c: n for c, n in by_request.items() if n},
    )
    report["series"] = _series_of(served)
    return report


def _series_of(served: list) -> dict:
    """:func:`_series` of the served requests of a replay, indexed by request index."""
    series = _series([r.num_cached_tokens for r in served], [r.num_prompt_tokens for r in served])
    series["index"] = [served[i].index for i in series["index"]]
    return series


def _top_misses(served: list, requests: Sequence[Any], tokens: list, tokenizer: Any, top: int, context: int) -> list:
    """The ``top`` requests that miss most, with the text around their stop position."""
    worst = sorted(served, key=lambda r: -(r.num_prompt_tokens - r.num_cached_tokens))[:top]
    out = []
    for r in worst:
        o = r.outcome
        ex = explain_text(o, tokens[r.index], tokenizer, context)
        out.append(
            dict(
                index=r.index,
                line=getattr(requests[r.index], "line", r.index + 1),
                prompt_tokens=o.num_prompt_tokens,
                cached_tokens=o.num_cached_tokens,
                missed_tokens=o.num_missed_tokens,
                cause=o.cause,
                cause_meaning=o.cause_meaning,
                missed=o.missed,
                stop_pos=ex.stop_pos,
                before=ex.before,
                prompt_side=ex.prompt_side,
                cached_side=ex.cached_side,
                tier_spans=[list(t) for t in o.tier_spans],
            )
        )
    return out


def _fix_series(spans: list) -> Optional[dict]:
    """The predicted hit rate over the trace with the best fix applied: the first span's what-if
    with the highest hit rate (:data:`FIX_ORDER` on a tie), as ``{label, how, span, hit_rate,
    window, index, cumulative, rolling}``; None without one. Takes the per-request series out of
    the span's what-ifs."""
    if not spans or not spans[0]["what_if"]:
        return None
    sp = spans[0]
    series = {how: v.pop("series") for how, v in sp["what_if"].items() if "series" in v}
    options = [(sp["what_if"][how]["hit_rate"], -i, how) for i, how in enumerate(FIX_ORDER) if how in series]
    if not options:
        return None
    how = max(options)[2]
    label = f"the {sp['kind']} span (#{sp['id']}) {FIX_WORDS[how]}"
    return dict(label=label, how=how, span=sp["id"], hit_rate=sp["what_if"][how]["hit_rate"], **series[how])


def _capacity_curve(sims: list, sim_kw: dict, working_set: int, sweep: Sequence[float]) -> list:
    """The hit rate at each fraction of the working set (tokens), replayed; ``skipped``: the
    requests too large for that pool (the engine refuses them; the hit rate counts the others)."""
    page_size = sim_kw["page_size"]
    curve = []
    for f in sweep:
        r = simulate(sims, capacity=max(page_size, int(working_set * f)), outcomes=False, keep_requests=False, **sim_kw)
        curve.append(dict(fraction=f, capacity=r.capacity, hit_rate=r.hit_rate, skipped=r.skipped))
    return curve


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
            new_sims = [SimRequest(t, s.reply, s.namespace, s.max_prefix_len) for t, s in zip(new, sims)]
            cap = _sim_capacity(new_sims, sim_kw["capacity"], sim_kw["page_size"])
            res = simulate(new_sims, outcomes=False, keep_requests=k == 0, **dict(sim_kw, capacity=cap))
            out["what_if"][how] = dict(
                hit_rate=res.hit_rate, cached_tokens=res.cached_tokens, prompt_tokens=res.prompt_tokens
            )
            if k == 0:  # the fix's predicted line over the trace (taken out by _fix_series)
                out["what_if"][how]["series"] = _series_of([r for r in res.requests if r.served])
    return out
