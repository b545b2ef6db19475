"""Why a prompt's prefix match stopped: the per-request cache outcome (torch-free).

Every prompt of ``n`` tokens is matched on its first ``L = n - 1`` tokens (the last one is always
computed, its logits are needed). The match gives ``m`` cached tokens (whole pages). The
:class:`OutcomeClassifier` splits the ``n - m`` missed tokens into segments, each with a cause, so
that the causes of a request (and of a whole trace) sum exactly to its missed tokens:

========== ===============================================================================
cause      tokens charged to it
========== ===============================================================================
full       the last prompt token (always computed). A request whose every whole page of
           ``L`` is cached has ``cause == "full"``.
page_floor tokens after the last cached page that the nearest cached sequence also has (to the
           token), or the unaligned tail of ``L``: lost to page rounding (0 with page_size 1).
diverged   from the first token where the prompt differs from the nearest cached sequence
           (after sharing at least one token with it) to the end (``diverge_pos`` is that
           position, ``cached_next`` what the cache holds there instead).
cold       tokens no cached, running or recently evicted sequence has: never seen (or seen
           before a ``reset_prefix_cache``, or longer ago than the eviction record reaches).
evicted    tokens an earlier request had cached and eviction dropped: the prompt's 16-token
           blocks (chained digests, :mod:`radixkv.cache.digests`) found in a bounded record of
           evicted blocks (for block caches, of once-cached blocks: one that is not matched
           now was evicted); measured in whole blocks from the stop position.
namespace  tokens cached under another namespace (one of the most recent few seen) but not
           under the request's own.
in_flight  tokens a concurrent request holds but has not handed to the cache yet (being
           prefilled, or generated and not yet finished).
disabled   everything but the last token, when prefix caching is off (``NoPrefixCache``).
========== ===============================================================================

After an ``in_flight`` / ``namespace`` / ``evicted`` segment, the rest of ``L`` is ``diverged``
when that source continues with other tokens and ``cold`` otherwise. A request's ``cause`` is
``full``, or ``disabled``, or else the cause with the most tokens in ``[m, L)`` (the earliest on a
tie). Cost per request: a :meth:`~radixkv.cache.base.PrefixCache.peek` (O(match)); on a miss also
the prompt's block digests up to the stop position, one list comparison per running request of
the namespace, and one peek per other recent namespace. Memory: the evicted record keeps at most
``max_evicted_blocks`` digests (oldest dropped first), the namespace record ``max_namespaces``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

from radixkv.cache.digests import BLOCK_TOKENS, block_digests
from radixkv.cache.token_keys import common_prefix_len, pack_tokens
from radixkv.namespace import Namespace

__all__ = ["CAUSES", "CAUSE_NOTES", "CacheOutcome", "EvictedRecord", "OutcomeClassifier"]

_NONE = object()  # no other namespace found

CAUSES = ("full", "page_floor", "diverged", "cold", "evicted", "namespace", "in_flight", "disabled")
"""The documented causes, in report order (see the module docstring)."""

CAUSE_NOTES = {
    "full": "each prompt's last token, always computed (its requests: all else cached)",
    "page_floor": "after the last cached page: lost to page rounding",
    "diverged": "from where the prompt differs from the nearest cached sequence",
    "cold": "never seen (or evicted longer ago than the record reaches)",
    "evicted": "cached once, dropped by eviction",
    "namespace": "cached under another namespace only",
    "in_flight": "held by a running request, not cached yet",
    "disabled": "prefix caching is off",
}
"""What the missed tokens charged to each cause are, in a few words (reports print it beside the
cause; the module docstring has the rules)."""


@dataclass(frozen=True)
class CacheOutcome:
    """Where and why a prompt's prefix match stopped (module docstring).

    Attributes:
        cause: one of :data:`CAUSES`.
        num_prompt_tokens: ``n``.
        num_cached_tokens: ``m``, tokens served from the prefix cache.
        segments: ``(start, end, cause)`` token ranges covering ``[m, n)`` in order.
        token_match: how far (tokens) the nearest cached sequence is known to agree with the
            prompt (``>= m``; ``m`` for block caches and for a full match, which needs no look).
        diverge_pos: the first position where the prompt differs from the nearest cached
            sequence, or None when no cached sequence continues there.
        cached_next: up to 8 token ids the nearest cached sequence holds from ``diverge_pos``
            (empty when unknown: block caches).
        other_namespace: the namespace holding the ``namespace`` segment (a
            :class:`~radixkv.namespace.Namespace`, or None: the shared default), else None.
            ``as_dict`` gives its ``repr`` (a salt shown as a short digest).
        tier_spans: ``(start, end, medium)`` ranges of the missed tokens that a KV tier below
            the pool holds (``host``, ``disk``, ``remote``; docs/tiers.md): the request loads them
            instead of computing them when that is cheaper. The segments stay the pool's view:
            these ranges lie inside them.
    """

    cause: str
    num_prompt_tokens: int
    num_cached_tokens: int
    segments: tuple = ()
    token_match: int = 0
    diverge_pos: Optional[int] = None
    cached_next: tuple = ()
    other_namespace: Optional[Namespace] = None
    tier_spans: tuple = ()

    @property
    def num_missed_tokens(self) -> int:
        """``num_prompt_tokens - num_cached_tokens``."""
        return self.num_prompt_tokens - self.num_cached_tokens

    @property
    def missed(self) -> dict:
        """Missed tokens per cause (only causes with tokens); sums to :attr:`num_missed_tokens`."""
        out: dict = {}
        for a, b, c in self.segments:
            out[c] = out.get(c, 0) + b - a
        return out

    @property
    def cause_meaning(self) -> str:
        """What :attr:`cause` means for this prompt, in words. ``full`` says what was cached: all
        but the last token (always computed), every whole page, or nothing at all because the
        prompt has no whole page before its last token (a one-token prompt, say)."""
        if self.cause != "full":
            return CAUSE_NOTES.get(self.cause, self.cause)
        if self.num_prompt_tokens <= 1:
            return "a one-token prompt: nothing to look up, its only token is always computed"
        if self.num_cached_tokens == 0:
            return "no whole page before the last prompt token to look up; the last token is always computed"
        if self.missed.get("page_floor"):
            return "every whole page before the last prompt token cached; the partial page and the last token computed"
        return "every token cached but the last one, which is always computed"

    def as_dict(self) -> dict:
        """A JSON-ready dict (``missed`` included)."""
        return dict(
            cause=self.cause,
            num_prompt_tokens=self.num_prompt_tokens,
            num_cached_tokens=self.num_cached_tokens,
            missed=self.missed,
            segments=[list(s) for s in self.segments],
            token_match=self.token_match,
            diverge_pos=self.diverge_pos,
            cached_next=list(self.cached_next),
            other_namespace=None if self.other_namespace is None else repr(self.other_namespace),
            tier_spans=[list(t) for t in self.tier_spans],
        )


class EvictedRecord:
    """A bounded set of chained 16-token block digests that were evicted (oldest dropped first).

    Args:
        max_blocks: how many digests to keep (>= 0; 16 bytes each plus a dict entry).
    """

    def __init__(self, max_blocks: int = 1 << 16) -> None:
        if max_blocks < 0:
            raise ValueError(f"max_evicted_blocks must be >= 0, got {max_blocks}")
        self.max_blocks = max_blocks
        self._d: OrderedDict = OrderedDict()

    def add(self, digests: Iterable[bytes]) -> None:
        """Record evicted blocks (a digest seen again moves to the newest end)."""
        d = self._d
        for x in digests:
            if x in d:
                d.move_to_end(x)
            else:
                d[x] = None
        while len(d) > self.max_blocks:
            d.popitem(last=False)

    def clear(self) -> None:
        self._d.clear()

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._d

    def __len__(self) -> int:
        return len(self._d)


@dataclass
class _Seg:
    segs: list = field(default_factory=list)

    def add(self, a: int, b: int, cause: str) -> None:
        if b > a:
            self.segs.append((a, b, cause))


def _lcp(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """Common-prefix length of token sequences ``a`` and ``b``, at most ``limit`` (one memcmp)."""
    n = min(len(a), len(b), limit)
    return common_prefix_len(pack_tokens(a[:n]), pack_tokens(b[:n]), 0, n)


class OutcomeClassifier:
    """Classifies prompts against one prefix cache (module docstring).

    Args:
        cache: the :class:`~radixkv.cache.base.PrefixCache` (only ``peek`` and ``page_size`` are
            used; ``shares_prefixes`` False means caching is off).
        max_evicted_blocks: size bound of the evicted-block record.
        max_namespaces: how many recently seen namespaces are tried for the ``namespace`` cause.

    Feed it the cache's evictions with :meth:`record_evicted` (the engine does so from its
    ``CacheEvicted`` events) and the namespaces of admitted requests with :meth:`seen_namespace`.
    """

    def __init__(self, cache: Any, max_evicted_blocks: int = 1 << 16, max_namespaces: int = 8) -> None:
        self.cache = cache
        self.evicted = EvictedRecord(max_evicted_blocks)
        self.max_namespaces = max_namespaces
        self._namespaces: OrderedDict = OrderedDict()

    def record_evicted(self, digests: Optional[Iterable[bytes]]) -> None:
        """Remember evicted blocks (None: the cache could not name them; nothing recorded)."""
        if digests:
            self.evicted.add(digests)

    def seen_namespace(self, namespace: Optional[Namespace]) -> None:
        """Note a namespace in use (the most recent ``max_namespaces`` are kept)."""
        d = self._namespaces
        if namespace in d:
            d.move_to_end(namespace)
        else:
            d[namespace] = None
            if len(d) > self.max_namespaces:
                d.popitem(last=False)

    def classify(
        self,
        tokens: Sequence[int],
        namespace: Optional[Namespace] = None,
        cached: Optional[int] = None,
        running: Iterable[tuple[Optional[Namespace], Sequence[int]]] = (),
    ) -> CacheOutcome:
        """The outcome of a prompt.

        Args:
            tokens: the prompt's token ids (a list or tuple of int; ``n >= 1`` of them).
            namespace: its namespace.
            cached: the tokens its match got (``m``, as the engine's ``lock_prefix`` returned);
                None for a dry run (taken from the peek).
            running: ``(namespace, token ids)`` of the concurrent requests (for ``in_flight``).

        Returns:
            A :class:`CacheOutcome` whose segments cover ``[m, n)`` exactly.
        """
        n = len(tokens)
        L = n - 1
        ps = self.cache.page_size
        if not getattr(self.cache, "shares_prefixes", True):
            m = 0 if cached is None else cached
            segs = _Seg()
            segs.add(m, L, "disabled")
            segs.add(max(m, L), n, "full")
            return CacheOutcome("disabled", n, m, tuple(segs.segs), m)
        query = tokens[:L]
        floor_l = L - L % ps
        if cached is not None and cached >= floor_l:  # every whole page is cached: no peek needed
            segs = _Seg()
            segs.add(cached, L, "page_floor")
            segs.add(max(cached, L), n, "full")
            return CacheOutcome("full", n, cached, tuple(segs.segs), cached)
        peek = self.cache.peek(query, namespace)
        m = peek.length if cached is None else cached
        k = max(peek.token_length, m)
        segs = _Seg()
        if m >= floor_l:
            segs.add(m, L, "page_floor")
            segs.add(max(m, L), n, "full")
            return CacheOutcome("full", n, m, tuple(segs.segs), max(k, m))
        p = min(k, L)
        segs.add(m, p, "page_floor")
        diverged = peek.diverged and p > 0  # nothing shared at all is cold, not a divergence
        diverge_pos = p if diverged else None
        other_ns = None
        if p < L:
            other_ns = self._stop(query, namespace, p, L, diverged, running, segs)
        segs.add(L, n, "full")
        tally: dict = {}
        for a, b, c in segs.segs:
            if b <= L:
                tally[c] = tally.get(c, 0) + b - a
        cause = max(tally, key=lambda c: (tally[c], -[s[2] for s in segs.segs].index(c)))
        return CacheOutcome(
            cause,
            n,
            m,
            tuple(segs.segs),
            k,
            diverge_pos,
            tuple(peek.next_tokens) if diverge_pos is not None else (),
            other_ns,
        )

    def _stop(self, query, namespace, p: int, L: int, diverged: bool, running, segs: _Seg) -> Any:
        """Segments of ``[p, L)``: why the token-level match stopped at ``p``."""
        # in_flight: a concurrent request of the namespace has the next tokens
        best, best_seq = p, None
        for ns, seq in running:
            if ns != namespace or len(seq) <= p or seq[p] != query[p]:
                continue
            c = _lcp(seq, query, L)
            if c > best:
                best, best_seq = c, seq
        if best_seq is not None:
            segs.add(p, best, "in_flight")
            segs.add(best, L, "diverged" if len(best_seq) > best else "cold")
            return None
        # evicted: the prompt's blocks from the one holding p on were evicted
        first = p // BLOCK_TOKENS
        stop = L // BLOCK_TOKENS
        if first < stop and len(self.evicted):
            ds = block_digests(query, namespace, first, stop)
            j = 0
            while j < len(ds) and ds[j] in self.evicted:
                j += 1
            end = min((first + j) * BLOCK_TOKENS, L)
            if end > p:
                segs.add(p, end, "evicted")
                segs.add(end, L, "cold")
                return None
        # namespace: another namespace has more of it
        best_k, best_ns, best_div = p, _NONE, False
        for ns in reversed(self._namespaces):
            if ns == namespace:
                continue
            other = self.cache.peek(query, ns, 0)
            if other.token_length > best_k:
                best_k, best_ns, best_div = other.token_length, ns, other.diverged
        if best_ns is not _NONE:  # None is a namespace too: the shared default
            end = min(best_k, L)
            segs.add(p, end, "namespace")
            segs.add(end, L, "diverged" if best_div else "cold")
            return best_ns
        segs.add(p, L, "diverged" if diverged else "cold")
        return None
