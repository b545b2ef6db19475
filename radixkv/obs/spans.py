"""Volatile spans: short differing stretches between prompts that otherwise share a long prefix
and a long suffix (a timestamp, a request id, a user name, a shuffled list), and the rewrites
that take them out of the way of the prefix cache.

Finding them (:func:`find_spans`):

1. Each request that missed (its match stopped before its last token) is aligned with its
   nearest neighbour: of the ``lookback`` requests before it, the one sharing the longest
   common prefix (the most recent on a tie). Both agree up to the divergence ``k``.
2. Resynchronisation: the smallest offsets after ``k`` at which the two sequences agree again for
   a long run. Candidate pairs are positions whose next ``gram`` tokens are equal; the earliest
   candidate whose common run is at least ``long_run`` tokens wins, else the longest run if it
   is at least ``min_suffix``. Then ``[k, i)`` of the prompt is a differing span and the run its
   shared suffix; the alignment goes on after the run (up to ``max_spans_per_request`` spans).
3. Clustering: spans of different requests whose token ranges overlap (within ``tolerance``
   tokens) are one volatile span; a cluster is reported when it holds at least ``min_requests``
   requests and ``min_share`` of the aligned misses.

Each cluster gets its *shape* from its values (:func:`classify_values`: uuid, timestamp, date,
number, hex id, reordered list, name, text), and *anchors*: the tokens just before its members'
spans and the first tokens of their shared suffixes. The anchors locate the span's *region* in
every request of the trace (also in those that were not aligned), which gives three rewrites
(:func:`rewrite`): ``removed`` (region deleted), ``moved`` (region moved after the shared
suffix that follows it) and ``static`` (every region replaced by the first request's). With a
tokenizer the removed and moved regions are first widened to whole lines
(:func:`expand_to_lines`: the value's label goes with it, as a developer's fix does). The
explainer replays each rewritten trace to predict the hit rate of the fix.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional, Sequence

from radixkv.cache.token_keys import common_prefix_len, pack_tokens

__all__ = [
    "SpanHit",
    "VolatileSpan",
    "find_spans",
    "locate",
    "expand_to_lines",
    "rewrite",
    "classify_values",
    "shape_of",
]


@dataclass
class SpanHit:
    """One aligned difference: request ``request`` differs from ``neighbour`` on ``[start, end)``
    (``[n_start, n_end)`` in the neighbour); both agree on the ``suffix`` tokens after it."""

    request: int
    neighbour: int
    start: int
    end: int
    n_start: int
    n_end: int
    suffix: int


@dataclass
class VolatileSpan:
    """A cluster of :class:`SpanHit` (module docstring).

    Attributes:
        hits: its members.
        start, end: the smallest start and the largest end of the members (request coordinates).
        left_anchors, right_anchors: token tuples before the members' spans (earliest start
            first) / starting their shared suffixes (latest end first).
        regions: request index -> ``(a, b)`` token range of the span in that request (where the
            anchors were found).
        kind, shape: from :func:`classify_values` / :func:`shape_of` (filled by the explainer,
            which has the tokenizer).
    """

    hits: list = field(default_factory=list)
    start: int = 0
    end: int = 0
    left_anchors: list = field(default_factory=list)
    right_anchors: list = field(default_factory=list)
    regions: dict = field(default_factory=dict)
    kind: str = ""
    shape: str = ""

    @property
    def requests(self) -> list:
        """Indices of the requests whose alignment found this span (sorted, unique)."""
        return sorted({h.request for h in self.hits})


def _lcp(a: bytes, b: bytes, ia: int, ib: int) -> int:
    """Common run, in tokens, of int32 buffers ``a`` from token ``ia`` and ``b`` from ``ib``."""
    return common_prefix_len(a[ia << 2 :], b, ib, len(b) >> 2)


def _resync(p: list, q: list, pb: bytes, qb: bytes, kp: int, kq: int, max_span: int, gram: int,
            min_suffix: int, long_run: int) -> Optional[tuple]:  # fmt: skip
    """``(i, j, run)``: where ``p`` (from ``kp``) and ``q`` (from ``kq``) agree again (module doc)."""
    index: dict = {}
    for j in range(kq, min(len(q) - gram, kq + max_span) + 1):
        index.setdefault(tuple(q[j : j + gram]), j)
    best = None
    for i in range(kp, min(len(p) - gram, kp + max_span) + 1):
        j = index.get(tuple(p[i : i + gram]))
        if j is None:
            continue
        run = _lcp(pb, qb, i, j)
        if run >= long_run:
            return i, j, run
        if run >= min_suffix and (best is None or run > best[2]):
            best = (i, j, run)
    return best


def find_spans(
    tokens: Sequence[Sequence[int]],
    missed: Sequence[int],
    lookback: int = 64,
    max_span: int = 1024,
    gram: int = 8,
    min_suffix: int = 64,
    long_run: int = 128,
    tolerance: int = 8,
    min_requests: int = 3,
    min_share: float = 0.1,
    max_spans_per_request: int = 4,
    max_aligned: int = 2000,
) -> tuple[list, int]:
    """Find the volatile spans of a trace (module docstring).

    Args:
        tokens: every request's prompt token ids, in trace order.
        missed: indices of the requests to align (those whose match stopped early); at most
            ``max_aligned`` of them, evenly spread, are aligned.
        lookback: how many earlier requests are candidates for the nearest neighbour.
        max_span, gram, min_suffix, long_run, tolerance, min_requests, min_share,
            max_spans_per_request: as in the module docstring.

    Returns:
        ``(spans, aligned)``: the :class:`VolatileSpan` clusters (largest first) and how many
        misses were aligned.
    """
    packed = [pack_tokens(list(t)) for t in tokens]
    idx = list(missed)
    if len(idx) > max_aligned:
        step = len(idx) / max_aligned
        idx = [idx[int(k * step)] for k in range(max_aligned)]
    hits: list = []
    for r in idx:
        p, pb = tokens[r], packed[r]
        best_j, best_k = None, -1
        for j in range(r - 1, max(-1, r - 1 - lookback), -1):
            k = _lcp(pb, packed[j], 0, 0)
            if k > best_k:
                best_j, best_k = j, k
        if best_j is None:
            continue
        q, qb = tokens[best_j], packed[best_j]
        kp = kq = best_k
        for _ in range(max_spans_per_request):
            if kp >= len(p) - gram or kq >= len(q) - gram:
                break
            found = _resync(p, q, pb, qb, kp, kq, max_span, gram, min_suffix, long_run)
            if found is None:
                break
            i, j, run = found
            hits.append(SpanHit(r, best_j, kp, i, kq, j, run))
            kp, kq = i + run, j + run
    spans = _cluster(hits, tolerance)
    need = max(min_requests, int(min_share * len(idx) + 0.999))
    spans = [s for s in spans if len(s.requests) >= need]
    for s in spans:  # the outermost members' anchors first: they bound the whole volatile value
        by_start = sorted(s.hits, key=lambda h: (h.start, h.request))
        by_end = sorted(s.hits, key=lambda h: (-h.end, h.request))
        s.left_anchors = _distinct(tuple(tokens[h.request][max(0, h.start - gram) : h.start]) for h in by_start)
        s.right_anchors = _distinct(tuple(tokens[h.request][h.end : h.end + 2 * gram]) for h in by_end)
    spans.sort(key=lambda s: -len(s.requests))
    return spans, len(idx)


def _distinct(items, limit: int = 8) -> list:
    """The first ``limit`` distinct items, in order."""
    out: list = []
    for x in items:
        if x not in out:
            out.append(x)
            if len(out) == limit:
                break
    return out


def _cluster(hits: list, tolerance: int) -> list:
    """Spans whose ranges overlap (within ``tolerance`` tokens) form one cluster."""
    out: list = []
    for h in sorted(hits, key=lambda h: (h.start, h.end)):
        end = max(h.end, h.start + 1)
        if out and h.start <= out[-1].end + tolerance:
            out[-1].hits.append(h)
            out[-1].end = max(out[-1].end, end)
        else:
            out.append(VolatileSpan([h], h.start, end))
    return out


def _find(hay: bytes, needle: bytes, lo: int, hi: int) -> int:
    """First token position ``>= lo`` where ``needle`` starts in ``hay`` and ends by ``hi``
    (token positions of int32 buffers), or -1."""
    if not needle:
        return lo
    pos = hay.find(needle, lo << 2, (hi << 2) + len(needle))
    while pos != -1 and pos % 4:
        pos = hay.find(needle, pos + 1, (hi << 2) + len(needle))
    return -1 if pos == -1 else pos >> 2


def locate(span: VolatileSpan, tokens: Sequence[Sequence[int]], max_span: int = 1024, window: int = 256) -> dict:
    """The span's region ``(a, b)`` in each request where its anchors are found (module
    docstring); fills and returns ``span.regions``."""
    regions: dict = {}
    lo_exp, hi_exp = span.start - window, span.end + window
    lefts = [pack_tokens(list(a)) for a in span.left_anchors]
    rights = [pack_tokens(list(a)) for a in span.right_anchors if a]
    for r, toks in enumerate(tokens):
        hb = pack_tokens(list(toks))
        n = len(toks)
        a = b = None
        for lb in lefts:  # the first anchor (in priority order) found near the span
            k = len(lb) >> 2
            pos = _find(hb, lb, max(0, lo_exp - k), min(n, hi_exp))
            if pos != -1:
                a = pos + k
                break
        if a is None:
            continue
        for rb in rights:
            pos = _find(hb, rb, a, min(n, a + max_span + window))
            if pos != -1:
                b = pos
                break
        if b is not None and b > a:
            regions[r] = (a, b)
    span.regions = regions
    return regions


def expand_to_lines(regions: dict, tokens: Sequence[Sequence[int]], is_newline, reach: int = 64) -> dict:
    """``regions`` widened to whole lines: each start moved back to just after the nearest
    earlier token that ``is_newline(token_id)`` (at most ``reach`` tokens back), each end forward
    past the first such token at or after it (at most ``reach`` tokens on). What a developer
    removes or moves is the line holding the value, label included."""
    out = {}
    for r, (a, b) in regions.items():
        t = tokens[r]
        a2 = a
        for i in range(a - 1, max(-1, a - 1 - reach), -1):
            if is_newline(t[i]):
                a2 = i + 1
                break
        b2 = b
        for i in range(b - 1 if b > a else b, min(len(t), b + reach)):
            if is_newline(t[i]):
                b2 = i + 1
                break
        out[r] = (min(a, a2), max(b, b2))
    return out


def rewrite(span: VolatileSpan, tokens: Sequence[Sequence[int]], how: str, regions: Optional[dict] = None) -> list:
    """Every request's tokens with the span's region ``removed``, ``moved`` after the shared
    suffix that follows it, or made ``static`` (the first region's tokens everywhere); requests
    without a region are unchanged. ``regions`` defaults to ``span.regions`` (:func:`locate`).

    Raises:
        ValueError: unknown ``how``.
    """
    if how not in ("removed", "moved", "static"):
        raise ValueError(f"how must be 'removed', 'moved' or 'static', got {how!r}")
    regions = span.regions if regions is None else regions
    out = [list(t) for t in tokens]
    if not regions:
        return out
    order = sorted(regions)
    ref = order[0]
    ra, rb = regions[ref]
    ref_value = list(tokens[ref][ra:rb])
    ref_b = pack_tokens(list(tokens[ref]))
    other = order[1] if len(order) > 1 else ref
    oa, ob = regions[other]
    other_b = pack_tokens(list(tokens[other]))
    for r, (a, b) in regions.items():
        t = out[r]
        if how == "removed":
            out[r] = t[:a] + t[b:]
        elif how == "static":
            out[r] = t[:a] + ref_value + t[b:]
        else:  # moved: after the suffix this request shares with another one
            cmp_b, cmp_pos = (other_b, ob) if r == ref else (ref_b, rb)
            e = b + _lcp(pack_tokens(t), cmp_b, b, cmp_pos)
            out[r] = t[:a] + t[b:e] + t[a:b] + t[e:]
    return out


_UUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
_DATETIME = re.compile(r"\d{4}-\d{2}-\d{2}[T ]\d{1,2}:\d{2}|\d{1,2}:\d{2}(:\d{2})?")
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}|\d{1,2}/\d{1,2}/\d{2,4}")
_HEX = re.compile(r"\b[0-9a-fA-F]{8,}\b")
_NAME = re.compile(r"\s*[A-Z][a-z]+(?: [A-Z][a-z]+){0,2}\s*")


def classify_values(values: Sequence[str]) -> str:
    """The kind of a volatile span from some of its values: ``uuid``, ``timestamp``, ``date``,
    ``number``, ``hex id``, ``reordered list`` (the values are permutations of one another's
    lines or words), ``name``, else ``text``."""
    vals = [v for v in values if v is not None]
    if not vals:
        return "text"
    if all(_UUID.search(v) for v in vals):
        return "uuid"
    if all(_DATETIME.search(v) for v in vals):
        return "timestamp"
    if all(_DATE.search(v) for v in vals):
        return "date"
    if all(v.strip().isdigit() for v in vals):
        return "number"
    if all(_HEX.search(v) for v in vals):
        return "hex id"
    if len(vals) > 1 and len(set(vals)) > 1:  # the same words (punctuation aside) in other orders
        words = {tuple(sorted(re.findall(r"\w+", v))) for v in vals}
        if len(words) == 1 and len(next(iter(words))) > 1:
            return "reordered list"
    if all(_NAME.fullmatch(v) for v in vals):
        return "name"
    return "text"


def shape_of(value: str, limit: int = 60) -> str:
    """``value`` with digits as ``9``, lower-case letters as ``a``, upper-case as ``A`` (runs of
    letters collapsed to three), for showing a span's form; cut to ``limit`` characters."""
    s = re.sub(r"\d", "9", value)
    s = re.sub(r"[a-z]", "a", s)
    s = re.sub(r"[A-Z]", "A", s)
    s = re.sub(r"a{4,}", "aaa", s)
    s = re.sub(r"A{4,}", "AAA", s)
    return s if len(s) <= limit else s[: limit - 3] + "..."
