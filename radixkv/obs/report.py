"""Rendering the explain and plan reports: terminal text, JSON, and one self-contained HTML file
(plots drawn with matplotlib's Agg backend and embedded as base64 PNG ``data:`` URIs; no script,
stylesheet, font or image is fetched from anywhere)."""

from __future__ import annotations

import base64
import html
import io
import json
from typing import Any, Optional

from radixkv.cache.outcome import CAUSE_NOTES, CAUSES
from radixkv.obs.plan import GB, format_bytes

__all__ = ["explain_text_report", "plan_text_report", "to_json", "explain_html", "plan_html"]

_CAUSE_COLORS = {
    "full": "#4c9f70",
    "page_floor": "#9ccfa8",
    "diverged": "#d1495b",
    "cold": "#8d99ae",
    "evicted": "#edae49",
    "namespace": "#7b5ea7",
    "in_flight": "#00798c",
    "disabled": "#444444",
}


TOO_LARGE = (
    "(k too large: k requests do not fit a pool that small, which the engine refuses; the hit rate counts the others)"
)


_AUTO = ", the engine's default here: --kv-cache-dtype auto"


def _pool_rate(row: dict, requests: Optional[int]) -> str:
    """A pool's hit rate (``plan --max-total-tokens``): as a curve's point, ``-`` when the pool
    holds no page of that policy."""
    return "-" if row["hit_rate"] is None else _rate(row, requests)


def _rate(point: dict, requests: Optional[int]) -> str:
    """A hit-rate-vs-capacity point: its hit rate (``->`` the rate with tiers), and the requests
    too large for that pool (all of them: no hit rate, ``-``)."""
    skipped = point.get("skipped", 0)
    if skipped and skipped == requests:
        return f"- (all {skipped:,} too large)"
    out = _pct(point["hit_rate"]) + (f"->{_pct(point['hit_rate_tiers'])}" if "hit_rate_tiers" in point else "")
    return out + (f" ({skipped:,} too large)" if skipped else "")


def to_json(report: dict) -> str:
    """The report as indented JSON."""
    return json.dumps(report, indent=1, ensure_ascii=False, default=str)


def _pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _short(s: str, n: int = 70) -> str:
    s = s.replace("\n", "\\n")
    return s if len(s) <= n else s[: n - 3] + "..."


def _where(pos: dict) -> str:
    t = pos.get("tokens", [0, 0])
    if "message" in pos:
        return f"{pos['role']} message {pos['message']}, line {pos['line']} col {pos['column']} (tokens {t[0]}-{t[1]})"
    return f"tokens {t[0]}-{t[1]}"


def _cause_of(m: dict) -> str:
    """A top miss's cause, with what it means when that is ``full`` (whose name alone misleads)."""
    return f"{m['cause']} ({m['cause_meaning']})" if m["cause"] == "full" and m.get("cause_meaning") else m["cause"]


def explain_text_report(rep: dict, top: int = 5) -> str:
    """The terminal summary of an explain report."""
    c = rep["config"]
    out = [
        f"radixkv explain {rep.get('source') or ''}".rstrip(),
        f"{rep['requests']} requests, {rep['prompt_tokens']:,} prompt tokens; cache {c['policy']}, page_size "
        f"{c['page_size']}, capacity {c['capacity']:,} tokens"
        + (f" ({rep['skipped']} skipped)" if rep["skipped"] else ""),
        f"hit rate {_pct(rep['hit_rate'])} ({rep['cached_tokens']:,} cached); infinite capacity "
        f"{_pct(rep['infinite']['hit_rate'])}; working set {rep['infinite']['working_set_tokens']:,} tokens",
        "",
        f"missed {rep['missed_tokens']:,} prompt tokens, by cause"
        + (" (sums exactly" if rep.get("causes_sum_to_missed") else " (DOES NOT SUM")
        + "; requests: how many it is the main cause of):",
        f"  {'cause':<11}{'tokens':>12}  {'share':>6}  {'requests':>8}  what the tokens are",
    ]
    for cause, n in rep["missed_by_cause"].items():
        reqs = rep["requests_by_cause"].get(cause, 0)
        share = n / rep["missed_tokens"] if rep["missed_tokens"] else 0
        out.append(f"  {cause:<11}{n:>12,}  {_pct(share):>6}  {reqs:>8,}  {CAUSE_NOTES.get(cause, '')}")
    if rep.get("tiers"):
        served = rep["tiers"]["served_tokens"]
        by = ", ".join(f"{m} {n:,}" for m, n in served.items()) or "nothing"
        out.append(f"  of these, the KV tiers below the pool served {sum(served.values()):,}: {by}")
    spans = rep.get("spans", [])
    out.append("")
    if "aligned_misses" in rep:
        out.append(
            f"volatile spans: {len(spans)} (aligned {rep['aligned_misses']} misses with their nearest neighbour)"
        )
    for s in spans:
        wi = "  ".join(f"{k} {_pct(v['hit_rate'])}" for k, v in s["what_if"].items())
        out.append(f"  #{s['id']} {s['kind']} {s['shape']!r} at {_where(s['position'])}")
        out.append(
            f"     in {s['requests']} requests, {s['missed_tokens']:,} missed tokens; e.g. {_short(s['examples'][0], 50)!r}"
        )
        a = s["aligned"]
        out.append(
            f"     request {a['request']} vs {a['neighbour']}: {_short(a['prompt_side'], 30)!r} vs "
            f"{_short(a['neighbour_side'], 30)!r} after {a['shared_before']} shared tokens, {a['shared_after']} shared after"
        )
        if wi:
            out.append(f"     what if: {wi}")
    out += ["", "prompts that miss most:"]
    for m in rep["top_misses"][:top]:
        out.append(
            f"  request {m['index']} (line {m['line']}): {m['missed_tokens']:,} of {m['prompt_tokens']:,} missed, "
            f"{_cause_of(m)} at token {m['stop_pos']}"
        )
        out.append(f"     shared ...{_short(m['before'], 60)!r}")
        out.append(f"     prompt    {_short(m['prompt_side'], 60)!r}")
        if m["cached_side"]:
            out.append(f"     cached    {_short(m['cached_side'], 60)!r}")
        if m.get("tier_spans"):
            out.append("     served by " + ", ".join(f"{t} [{a}, {b})" for a, b, t in m["tier_spans"]))
    if rep.get("capacity_curve"):
        out += ["", "hit rate vs capacity (share of the working set):"]
        out.append(
            "  " + "  ".join(f"{100 * p['fraction']:g}% {_rate(p, rep['requests'])}" for p in rep["capacity_curve"])
        )
        if any(p.get("skipped") for p in rep["capacity_curve"]):
            out.append(f"  {TOO_LARGE}")
    return "\n".join(out)


def plan_text_report(rep: dict) -> str:
    """The terminal summary of a plan report."""
    m = rep["model"]
    out = [
        f"radixkv plan: {m['name']} ({m['attention']}, {m['num_layers']} layers) - source: {m['source']}",
        f"KV cache per token ({rep['kv_dtype']}{_AUTO if rep.get('kv_dtype_auto') else ''}): "
        f"{rep['kv_bytes_per_token']:,} bytes "
        f"({rep['kv_bytes_per_token_per_layer']:,} per layer x {m['num_layers']})",
    ]
    engine = rep.get("engine_kv_bytes_per_token")
    if engine is not None:
        scales = " (its bfloat16 scales per token and KV head included)" if engine != rep["kv_bytes_per_token"] else ""
        out.append(f"  radixkv's own KV pool in {rep['kv_dtype']}: {engine:,} bytes per token{scales}")
    if m.get("windows"):
        out.append(f"  sliding window {m['windows']} tokens on {m['facts'].get('sliding_layers')} layers")
    if "context" in rep:
        ctx = rep["context"]
        line = f"one sequence of {ctx['tokens']:,} tokens: {format_bytes(ctx['kv_bytes'])} of KV"
        if abs(ctx["full_attention_gb"] - ctx["kv_gb"]) > 1e-9:
            line += f" (without the sliding windows: {ctx['full_attention_gb']:,.2f} GB)"
        out.append(line)
    if "fit" in rep:
        f = rep["fit"]
        out.append(
            f"{f['gpu_memory_gb']:g} GB GPU x {f['memory_fraction']:g}: weights {f['weights_gb']:,.2f} GB "
            f"({f['weight_dtype']}), KV budget {f['kv_budget_gb']:,.2f} GB -> {f['tokens']:,} tokens"
        )
        if f.get("page_size", 1) > 1:
            out[-1] += f" (whole pages of {f['page_size']})"
        if f.get("formula_tokens", f["tokens"]) != f["tokens"]:
            out[-1] += f" in radixkv's pool ({f['formula_tokens']:,} at {rep['kv_bytes_per_token']:,} bytes per token)"
        if not f.get("weights_fit", True):
            out.append(
                f"  the weights do not fit: {f['weights_gb']:,.2f} GB > {f['gpu_memory_gb'] * f['memory_fraction']:,.2f} GB "
                "usable (a bigger GPU, several GPUs, or smaller weights: --weight-dtype)"
            )
        if f.get("sequences_of_context") is not None:
            out.append(f"  = {f['sequences_of_context']:,} sequences of {rep['context']['tokens']:,} tokens")
    if "pool" in rep:
        pl = rep["pool"]
        flag = "--" + pl["given"].replace("_", "-")
        out.append(f"KV pool ({flag}): {pl['tokens']:,} tokens = {format_bytes(pl['kv_bytes'])} of KV")
        if pl.get("page_size", 1) > 1:
            out[-1] += f" (whole pages of {pl['page_size']})"
        if pl.get("sequences_of_context") is not None:
            out.append(f"  = {pl['sequences_of_context']:,} sequences of {rep['context']['tokens']:,} tokens")
    if "curve" in rep:
        cv = rep["curve"]
        out.append(
            f"trace: working set {cv['working_set_tokens']:,} tokens = {format_bytes(cv['working_set_tokens'] * cv['kv_bytes_per_token'])}"
        )
        if cv.get("tiers"):
            tiers = ", ".join(
                f"{m} {format_bytes(t['bytes'])} ({t['tokens']:,} tokens)" for m, t in cv["tiers"].items()
            )
            out.append(f"  KV tiers below the pool: {tiers}; hit rate without -> with them")
        for label, rows in cv["curves"].items():
            step = max(1, (len(rows) + 5) // 6)
            shown = rows[::-1][::step][::-1]  # about six points, the largest one always
            total = rep.get("trace", {}).get("requests")
            pts = "  ".join(f"{format_bytes(r['kv_gb'] * GB)} {_rate(r, total)}" for r in shown)
            out.append(f"  {label:<10} infinite {_pct(cv['infinite'][label])}; {pts}")
        if "pool_hit_rate" in rep:
            total = rep.get("trace", {}).get("requests")
            pts = "  ".join(f"{label} {_pool_rate(r, total)}" for label, r in rep["pool_hit_rate"].items())
            out.append(f"  in the KV pool of {rep['pool']['tokens']:,} tokens: {pts}")
        pool_rows = rep.get("pool_hit_rate", {}).values()
        if any(r.get("skipped") for rows in cv["curves"].values() for r in rows) or any(
            r.get("skipped") for r in pool_rows
        ):
            out.append(f"  {TOO_LARGE}")
    if "target" in rep:
        for t in rep["target"]:
            if t["reachable"]:
                out.append(
                    f"hit rate {_pct(t['target'])} ({t['policy']}): {t['tokens']:,} tokens = {format_bytes(t['kv_gb'] * GB)} "
                    f"of KV (reaches {_pct(t['hit_rate'])})"
                )
            else:
                out.append(
                    f"hit rate {_pct(t['target'])} ({t['policy']}): unreachable, infinite memory gives {_pct(t['infinite_hit_rate'])}"
                )
    return "\n".join(out)


# ---------------------------------------------------------------------- HTML


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _plt():
    try:
        import matplotlib
    except ImportError as exc:  # an optional extra
        raise ImportError("the HTML report needs matplotlib: pip install 'radixkv[explain]'") from exc

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


FLAT = 0.02
"""A hit-rate-over-the-trace plot whose lines stay within this (fraction) says nothing: it is left
out unless a fix's predicted line is there to compare."""


def _is_flat(series: dict) -> bool:
    ys = list(series["rolling"]) + list(series["cumulative"])
    return not ys or max(ys) - min(ys) < FLAT


def _trace_plot(plt, rep: dict) -> Optional[str]:
    """Hit rate over the trace (rolling and cumulative), with the predicted line of the best fix
    (``series.fix``) when there is one; None when the lines are flat and there is no fix."""
    s = rep["series"]
    fix = s.get("fix")
    if fix is None and _is_flat(s):
        return None
    fig, ax = plt.subplots(figsize=(7.5, 3.2))
    ax.plot(s["index"], [100 * x for x in s["rolling"]], label=f"last {s['window']} requests", color="#00798c")
    ax.plot(s["index"], [100 * x for x in s["cumulative"]], label="cumulative", color="#d1495b")
    if fix is not None:
        ax.plot(
            fix["index"],
            [100 * x for x in fix["rolling"]],
            color="#4c9f70",
            alpha=0.5,
            lw=1,
            label=f"predicted, last {fix['window']} requests",
        )
        ax.plot(
            fix["index"],
            [100 * x for x in fix["cumulative"]],
            color="#4c9f70",
            label="predicted, cumulative",
        )
    ax.axhline(100 * rep["infinite"]["hit_rate"], ls="--", color="#888", lw=1, label="infinite capacity")
    ax.set_xlabel("request")
    ax.set_ylabel("hit rate (% of prompt tokens)")
    ax.set_ylim(0, 100)
    ax.legend(fontsize=8, loc="center right")
    ax.set_title("Hit rate over the trace" + (f"; predicted with {fix['label']}" if fix else ""))
    return _png(fig)


def _explain_plots(rep: dict) -> list[tuple[str, str]]:
    plt = _plt()
    out = []
    trace = _trace_plot(plt, rep)
    if trace is not None:
        out.append(("Hit rate over the trace", trace))

    causes = [c for c in CAUSES if rep["missed_by_cause"].get(c)]
    fig, ax = plt.subplots(figsize=(7.5, 0.6 + 0.45 * max(1, len(causes))))
    vals = [rep["missed_by_cause"][c] for c in causes]
    ax.barh(causes, vals, color=[_CAUSE_COLORS.get(c, "#999") for c in causes])
    for i, v in enumerate(vals):
        ax.text(v, i, f" {v:,}", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("missed prompt tokens")
    ax.set_title(f"Missed tokens by cause ({rep['missed_tokens']:,} in all)")
    out.append(("Missed tokens by cause", _png(fig)))

    if rep.get("capacity_curve"):
        cc = rep["capacity_curve"]
        fig, ax = plt.subplots(figsize=(7.5, 3.2))
        ax.plot([p["capacity"] for p in cc], [100 * p["hit_rate"] for p in cc], marker="o", color="#00798c")
        ax.axvline(rep["config"]["capacity"], ls=":", color="#d1495b", label="simulated capacity")
        for sp in rep.get("spans", [])[:3]:
            for how, v in sp["what_if"].items():
                if how == "removed":
                    ax.axhline(100 * v["hit_rate"], ls="--", lw=1, color="#4c9f70", label=f"span #{sp['id']} removed")
        ax.set_xscale("log")
        ax.set_xlabel("KV capacity (tokens)")
        ax.set_ylabel("hit rate (%)")
        ax.set_ylim(0, 100)
        ax.legend(fontsize=8)
        ax.set_title("Hit rate vs capacity")
        out.append(("Hit rate vs capacity", _png(fig)))
    return out


_CSS = """body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem;color:#222}
h1{font-size:1.4rem}h2{font-size:1.1rem;margin-top:2rem;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:.9rem}td,th{padding:.2rem .6rem;border-bottom:1px solid #eee;text-align:left}
td.n{text-align:right;font-variant-numeric:tabular-nums}.big{font-size:2rem;font-weight:600}
pre{background:#f6f6f6;padding:.5rem;white-space:pre-wrap;word-break:break-all;font-size:.8rem}
.k{color:#666}.card{display:inline-block;margin-right:2rem}img{max-width:100%}"""


def _page(title: str, body: list[str]) -> str:
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>\n"
        + "\n".join(body)
        + "\n</body></html>\n"
    )


def _e(x: Any) -> str:
    return html.escape(str(x))


def explain_html(rep: dict) -> str:
    """A self-contained HTML page of an explain report (plots as embedded PNGs)."""
    c = rep["config"]
    b = [
        f"<h1>radixkv explain {_e(rep.get('source') or '')}</h1>",
        f"<p class=k>{rep['requests']} requests, {rep['prompt_tokens']:,} prompt tokens; cache {_e(c['policy'])}, "
        f"page_size {c['page_size']}, capacity {c['capacity']:,} tokens</p>",
        f"<div class=card><div class=big>{_pct(rep['hit_rate'])}</div>hit rate</div>"
        f"<div class=card><div class=big>{_pct(rep['infinite']['hit_rate'])}</div>with infinite capacity</div>"
        f"<div class=card><div class=big>{len(rep.get('spans', []))}</div>volatile spans</div>",
    ]
    plots = _explain_plots(rep)
    late = [p for p in plots if p[0] == "Hit rate vs capacity"]  # after the spans and prompts
    for title, uri in (p for p in plots if p not in late):
        b.append(f'<h2>{_e(title)}</h2><img alt="{_e(title)}" src="{uri}">')
    b.append(
        "<table><tr><th>cause</th><th>missed tokens</th><th>share</th><th>requests (its cause)</th>"
        "<th>what the tokens are</th></tr>"
    )
    for cause, n in rep["missed_by_cause"].items():
        share = n / rep["missed_tokens"] if rep["missed_tokens"] else 0
        b.append(
            f"<tr><td>{_e(cause)}</td><td class=n>{n:,}</td><td class=n>{_pct(share)}</td>"
            f"<td class=n>{rep['requests_by_cause'].get(cause, 0)}</td><td>{_e(CAUSE_NOTES.get(cause, ''))}</td></tr>"
        )
    b.append("</table>")
    b.append("<h2>Volatile spans</h2>")
    if not rep.get("spans"):
        b.append("<p>None found.</p>")
    for s in rep.get("spans", []):
        b.append(f"<h3>#{s['id']} {_e(s['kind'])} <code>{_e(s['shape'])}</code></h3>")
        b.append(
            f"<p>At {_e(_where(s['position']))}; in {s['requests']} requests (located in {s['located_in']}), "
            f"{s['missed_tokens']:,} missed tokens.</p>"
        )
        a = s["aligned"]
        b.append(
            f"<p>Request {a['request']} vs its neighbour {a['neighbour']}, after {a['shared_before']} shared tokens "
            f"and before {a['shared_after']} shared ones:</p><pre>{_e(a['prompt_side'])}</pre><pre>{_e(a['neighbour_side'])}</pre>"
        )
        if s["what_if"]:
            b.append("<table><tr><th>what if the span were</th><th>hit rate</th></tr>")
            for how, v in s["what_if"].items():
                b.append(f"<tr><td>{_e(how)}</td><td class=n>{_pct(v['hit_rate'])}</td></tr>")
            b.append("</table>")
    b.append("<h2>Prompts that miss most</h2>")
    for m in rep["top_misses"]:
        b.append(
            f"<p><b>request {m['index']}</b> (line {m['line']}): {m['missed_tokens']:,} of {m['prompt_tokens']:,} "
            f"tokens missed, <b>{_e(_cause_of(m))}</b> at token {m['stop_pos']}</p>"
            f"<pre><span class=k>…</span>{_e(m['before'])}<b>|</b>{_e(m['prompt_side'])}</pre>"
            + (f"<pre class=k>cached: {_e(m['cached_side'])}</pre>" if m["cached_side"] else "")
        )
    for title, uri in late:
        b.append(f'<h2>{_e(title)}</h2><img alt="{_e(title)}" src="{uri}">')
    return _page("radixkv explain", b)


def plan_html(rep: dict) -> str:
    """A self-contained HTML page of a plan report (the hit-rate-vs-memory plot embedded)."""
    b = [f"<h1>radixkv plan: {_e(rep['model']['name'])}</h1>", f"<pre>{_e(plan_text_report(rep))}</pre>"]
    if "curve" in rep:
        plt = _plt()
        cv = rep["curve"]
        fig, ax = plt.subplots(figsize=(7.5, 3.6))
        for label, rows in cv["curves"].items():
            ax.plot([r["kv_gb"] for r in rows], [100 * r["hit_rate"] for r in rows], marker="o", label=label)
        for t in rep.get("target", []):
            if t["reachable"]:
                ax.axvline(t["kv_gb"], ls=":", color="#d1495b", lw=1)
                ax.axhline(100 * t["target"], ls=":", color="#d1495b", lw=1)
        ax.set_xscale("log")
        ax.set_xlabel(f"KV memory (GB, {rep['kv_dtype']})")
        ax.set_ylabel("hit rate (%)")
        ax.set_ylim(0, 100)
        ax.legend(fontsize=8)
        ax.set_title(f"Hit rate vs KV memory for {rep['model']['name']}")
        b.append(f'<img alt="hit rate vs KV memory" src="{_png(fig)}">')
    return _page("radixkv plan", b)
