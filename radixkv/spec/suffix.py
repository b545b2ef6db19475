"""`SuffixIndex`: continuations across requests, from recently finished sequences of a namespace.

The radix tree drafts only where a request's whole sequence so far is a cached path; this index
finds a request's last tokens *anywhere* in a recently finished sequence of the same namespace
(an answer quoted in another conversation, a regeneration under another prompt) and drafts what
followed there (Arctic Inference's suffix decoding, reduced to an n-gram index).

Bounded: at most ``max_tokens`` tokens of sequences are kept, the oldest sequence dropped first
(with its index entries); each n-gram keeps its :data:`~radixkv.spec.ngram.MAX_CANDIDATES` most
recent occurrences. Keys are the hash of ``(namespace, n-gram)``; a lookup checks the namespace
and the tokens themselves, so a hash collision never drafts another namespace's text.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Dict, List, Sequence, Tuple

from radixkv.spec.ngram import MAX_CANDIDATES, best_continuation

__all__ = ["SuffixIndex"]


class _Seq:
    __slots__ = ("namespace", "tokens")

    def __init__(self, namespace: Any, tokens: List[int]) -> None:
        self.namespace = namespace
        self.tokens = tokens


class SuffixIndex:
    """N-gram positions over recently finished sequences, per namespace (module docstring).

    Args:
        key_len: tokens per indexed n-gram (>= 1).
        max_tokens: the most tokens kept (0: nothing is kept).

    Attributes:
        size: tokens kept now.
    """

    def __init__(self, key_len: int, max_tokens: int) -> None:
        self.key_len = int(key_len)
        self.max_tokens = int(max_tokens)
        self.size = 0
        self._seqs: "OrderedDict[int, _Seq]" = OrderedDict()
        self._keys: Dict[int, List[Tuple[_Seq, int]]] = {}
        self._next_id = 0

    def __len__(self) -> int:
        """Sequences kept."""
        return len(self._seqs)

    def _key(self, namespace: Any, t: Sequence[int], end: int) -> int:
        return hash((namespace, tuple(t[end - self.key_len + 1 : end + 1])))

    def add(self, namespace: Any, tokens: Sequence[int]) -> None:
        """Keep ``tokens`` (a finished sequence of ``namespace``; its last ``max_tokens`` when
        longer), dropping the oldest sequences to stay within ``max_tokens``."""
        if self.max_tokens <= 0 or len(tokens) <= self.key_len:
            return
        seq = _Seq(namespace, list(tokens[-self.max_tokens :]))
        n = len(seq.tokens)
        while self._seqs and self.size + n > self.max_tokens:
            self._drop_oldest()
        self._seqs[self._next_id] = seq
        self._next_id += 1
        self.size += n
        keys = self._keys
        for e in range(self.key_len - 1, n - 1):  # the last token has no continuation
            key = self._key(namespace, seq.tokens, e)
            lst = keys.get(key)
            if lst is None:
                keys[key] = [(seq, e)]
            else:
                lst.append((seq, e))
                if len(lst) > MAX_CANDIDATES:
                    del lst[0]

    def clear(self) -> None:
        """Forget every kept sequence (the prefix cache was flushed: nothing of what ran before
        may be drafted after it)."""
        self._seqs.clear()
        self._keys.clear()
        self.size = 0

    def _drop_oldest(self) -> None:
        _, seq = self._seqs.popitem(last=False)
        self.size -= len(seq.tokens)
        keys = self._keys
        for e in range(self.key_len - 1, len(seq.tokens) - 1):
            key = self._key(seq.namespace, seq.tokens, e)
            lst = keys.get(key)
            if lst is None:
                continue
            lst[:] = [c for c in lst if c[0] is not seq]
            if not lst:
                del keys[key]

    def lookup(self, namespace: Any, query: Sequence[int], k: int, max_match: int) -> Tuple[int, List[int]]:
        """``(match, draft)`` of :func:`~radixkv.spec.ngram.best_continuation` over the kept
        sequences of ``namespace`` whose n-gram equals the query's last ``key_len`` tokens
        (``(0, [])`` when none)."""
        if len(query) < self.key_len or not self._keys:
            return 0, []
        cands = self._keys.get(self._key(namespace, query, len(query) - 1))
        if not cands:
            return 0, []
        tail = list(query[-self.key_len :])
        sources = []
        for seq, e in cands:
            t = seq.tokens
            if seq.namespace == namespace and t[e - self.key_len + 1 : e + 1] == tail:
                sources.append((t, (e,)))
        return best_continuation(query, sources, k, max_match)
