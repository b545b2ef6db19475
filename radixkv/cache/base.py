"""The prefix-cache interface the engine talks to.

A prefix cache is a pure index from token sequences to KV slot indices: it owns no KV memory.
The engine's KV manager owns the :class:`~radixkv.memory.allocator.SlotAllocator`; the cache hands
slots back to it only through the slot arrays returned by :meth:`PrefixCache.evict` and
:meth:`PrefixCache.reset`. The package imports without torch: slot arrays are ``torch.int64``
CPU tensors when torch is installed, else ``numpy.int64`` arrays
(:func:`radixkv.memory.slots.slot_array`).

Implementations: :class:`~radixkv.cache.radix_tree.RadixCache` (SGLang's RadixAttention tree,
Zheng et al., "SGLang: Efficient Execution of Structured Language Model Programs", 2024),
:class:`~radixkv.cache.hash_cache.HashBlockCache` (vLLM's automatic prefix caching with chained
block hashes) and :class:`~radixkv.cache.hash_cache.NoPrefixCache` (caching off).

Every ``namespace`` argument is a :class:`~radixkv.namespace.Namespace` or None (the shared
default; the engine normalizes with ``Namespace.of``): entries only match within an equal one.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Protocol, Sequence, Union, runtime_checkable

from radixkv.namespace import Namespace

Tokens = Union[Sequence[int], Any]
"""A token sequence: a sequence of ints, a 1-D integer numpy array or a 1-D integer tensor."""


class PeekResult(NamedTuple):
    """What :meth:`PrefixCache.peek` sees of a token sequence, read-only (nothing locked, no
    access time refreshed, no edge split).

    Attributes:
        length: what ``match_prefix`` would return as ``length`` now (tokens, whole pages).
        token_length: the longest common prefix, in tokens, of the sequence and any cached
            sequence of its namespace (``>= length``; the radix tree counts it to the token also
            inside a page, block caches cannot look inside a block and report ``length``).
        next_tokens: up to ``context`` token ids of the nearest cached sequence after
            ``token_length`` (empty when it ends there or the cache cannot tell).
        diverged: True when a cached sequence continues past ``token_length`` with other tokens
            than the query (the query *diverged* from it), False when the cached path ends there
            or the query was matched to its end.
    """

    length: int
    token_length: int
    next_tokens: tuple
    diverged: bool


class MatchResult(NamedTuple):
    """The longest cached prefix of a token sequence (an immutable named tuple, as SGLang's
    ``MatchResult``: cheap to build on the hot path, unpackable as ``slots, length, node``).

    Attributes:
        slots: 1-D int64 slot array (a CPU tensor when torch imports), the KV slot of every
            matched token, in order. Read-only: it may share memory with the cache's own
            record (the radix tree hands out a view of an edge's slot bytes when one edge holds
            the match); it never changes after the call; ``.clone()`` it before writing.
        length: number of matched tokens (``== len(slots)``); a multiple of ``page_size``.
        node: opaque handle of the deepest cached entry ending exactly at ``length``; pass it to
            ``inc_lock_ref`` / ``dec_lock_ref``. For the radix tree it is a tree node (the root
            when nothing matched).
    """

    slots: Any
    length: int
    node: Any


@runtime_checkable
class PrefixCache(Protocol):
    """What the engine needs from a prefix cache (sizes are in tokens).

    Attributes:
        page_size: tokens per page; matches and insertions are whole pages.
        shares_prefixes: True when inserted entries are kept and matched by later requests
            (radix, hash); False for :class:`~radixkv.cache.none.NoPrefixCache`, whose
            ``insert`` keeps nothing (the KV manager then never hands pages over early).
    """

    page_size: int
    shares_prefixes: bool

    def match_prefix(self, tokens: Tokens, namespace: Namespace | None = None) -> MatchResult: ...

    def peek(self, tokens: Tokens, namespace: Namespace | None = None, context: int = 8) -> PeekResult:
        """A read-only look at ``tokens``' cached prefix (:class:`PeekResult`): O(match), nothing
        locked, no access time refreshed (eviction order unchanged), no edge split. For dry runs
        (``LLM.explain``) and the per-request cache outcome."""
        ...

    def insert(self, tokens: Tokens, slots: Any, namespace: Namespace | None = None) -> int: ...

    def inc_lock_ref(self, node: Any) -> None: ...

    def dec_lock_ref(self, node: Any) -> None: ...

    def evict(self, num_tokens: int) -> Any: ...

    def evictable_size(self) -> int: ...

    def protected_size(self) -> int: ...

    def total_size(self) -> int: ...

    def reset(self) -> Any: ...

    def check_integrity(self) -> None: ...

    def tenant_sizes(self) -> dict:
        """Tokens cached per tenant (:mod:`radixkv.cache.tenants`), kept incrementally."""
        ...

    def tenant_count(self, tenant: str) -> int:
        """Tokens cached in ``tenant``'s namespaces (O(1))."""
        ...

    def take_changed_tenants(self) -> set:
        """The named tenants whose cached tokens changed since the last call (O(them))."""
        ...

    def set_tenant_quotas(self, quotas: Optional[dict]) -> None:
        """Soft per-tenant quotas that :meth:`evict` applies first (tenant -> tokens)."""
        ...
