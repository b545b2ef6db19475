"""Prefix caches: indexes from token sequences to KV slots, torch-free at their core.

``RadixCache`` (token-level radix tree), ``HashBlockCache`` (vLLM-style chained block hashes),
``NoPrefixCache`` (caching off), the ``PrefixCache`` protocol, ``MatchResult`` and ``PeekResult``; ``SlotAllocator``
(which lives in :mod:`radixkv.memory.allocator`) is re-exported here. Importing this package
needs numpy and sortedcontainers, not torch.
"""

from __future__ import annotations

from radixkv.cache.base import MatchResult, PeekResult, PrefixCache
from radixkv.cache.hash_cache import HashBlockCache
from radixkv.cache.none import NoPrefixCache
from radixkv.cache.radix_tree import RadixCache
from radixkv.memory.allocator import SlotAllocator

__all__ = ["RadixCache", "SlotAllocator", "MatchResult", "PeekResult", "PrefixCache", "HashBlockCache", "NoPrefixCache"]
