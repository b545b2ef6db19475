"""Prompt lookup: where the last tokens of a sequence occurred before, and what followed them.

:class:`NgramIndex` keeps, for one growing token sequence (a request's prompt + output), the end
positions of every n-gram of ``key_len`` tokens (the most recent :data:`MAX_CANDIDATES` of each).
:func:`best_continuation` ranks the candidate occurrences of a query's last ``key_len`` tokens by
how far back they agree with the query (at most ``max_match`` tokens; the longest wins, then the
one with the longer continuation, then the most recent) and returns what followed the winner:
the draft. A continuation that runs into the query's own end copies on from the draft itself, so
a repeating pattern drafts ``k`` tokens however short its period.

Costs: indexing is one tuple hash per token (amortized, as the sequence grows); a lookup is one
dict read plus ``O(MAX_CANDIDATES * max_match)`` token comparisons.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["MAX_CANDIDATES", "NgramIndex", "agreement", "best_continuation", "continuation"]

MAX_CANDIDATES = 4
"""Occurrences kept per n-gram (the most recent ones)."""


def agreement(a: Sequence[int], a_end: int, b: Sequence[int], b_end: int, limit: int) -> int:
    """How many tokens ``a[..a_end]`` and ``b[..b_end]`` (ends inclusive) agree on, counted
    backwards from the ends, at most ``limit``."""
    n = 0
    while n < limit and a_end - n >= 0 and b_end - n >= 0 and a[a_end - n] == b[b_end - n]:
        n += 1
    return n


def continuation(src: Sequence[int], end: int, k: int, query: Optional[Sequence[int]] = None) -> List[int]:
    """The up to ``k`` tokens after position ``end`` of ``src``. When ``src`` is the query itself
    (``query is src``), positions past its end read the continuation being built (a repeating
    pattern goes on); otherwise the draft stops at ``src``'s end."""
    start = end + 1
    out = list(src[start : start + k])
    if query is src and len(out) < k:
        n = len(src)
        while len(out) < k:
            out.append(out[start + len(out) - n])
    return out


class NgramIndex:
    """The n-gram positions of one growing token sequence (module docstring).

    Args:
        key_len: tokens per indexed n-gram (>= 1).

    Attributes:
        tokens: the sequence so far (``list[int]``, grown by :meth:`sync`).
    """

    __slots__ = ("key_len", "tokens", "_pos", "_upto")

    def __init__(self, key_len: int) -> None:
        self.key_len = int(key_len)
        self.tokens: List[int] = []
        self._pos: Dict[tuple, List[int]] = {}
        self._upto = 0  # n-grams ending before this position are indexed

    def sync(self, prompt: Sequence[int], output: Sequence[int]) -> None:
        """Grow :attr:`tokens` to ``prompt + output`` (the sequence only grows) and index every
        n-gram that ends before its last token (the last one is the query's own suffix)."""
        t = self.tokens
        have = len(t)
        if not have:
            t.extend(prompt)
            t.extend(output)
        else:
            missing = len(prompt) + len(output) - have
            if missing > 0:
                t.extend(output[len(output) - missing :])
        self._index(len(t) - 1)

    def _index(self, stop: int) -> None:
        t, n, pos = self.tokens, self.key_len, self._pos
        for e in range(max(self._upto, n - 1), stop):
            key = tuple(t[e - n + 1 : e + 1])
            lst = pos.get(key)
            if lst is None:
                pos[key] = [e]
            else:
                lst.append(e)
                if len(lst) > MAX_CANDIDATES:
                    del lst[0]
        self._upto = max(self._upto, stop)

    def ends(self, key: tuple) -> List[int]:
        """End positions of ``key`` (oldest first; empty when it never occurred)."""
        return self._pos.get(key, [])

    def suffix_key(self) -> Optional[tuple]:
        """The last ``key_len`` tokens (None while shorter)."""
        t = self.tokens
        return tuple(t[-self.key_len :]) if len(t) >= self.key_len else None


def best_continuation(
    query: Sequence[int], sources: Sequence[Tuple[Sequence[int], Sequence[int]]], k: int, max_match: int
) -> Tuple[int, List[int]]:
    """The best draft for ``query`` among candidate occurrences.

    Args:
        query: the sequence whose next tokens are drafted.
        sources: ``(tokens, ends)`` pairs: each end is the position in ``tokens`` where an
            occurrence of the query's last tokens ends.
        k: draft length wanted.
        max_match: the most tokens the agreement is measured over.

    Returns:
        ``(match, draft)``: how many trailing tokens the winner agrees on, and up to ``k`` tokens
        after it; ``(0, [])`` when there is no candidate with a continuation.
    """
    best: Tuple[int, int] = (0, 0)
    draft: List[int] = []
    last = len(query) - 1
    for src, ends in sources:
        for e in reversed(ends):
            if e + 1 >= len(src) and src is not query:
                continue
            m = agreement(query, last, src, e, max_match)
            if m == 0 or (m, k) <= best:
                continue
            cont = continuation(src, e, k, query)
            if cont and (m, len(cont)) > best:
                best, draft = (m, len(cont)), cont
    return best[0], draft
