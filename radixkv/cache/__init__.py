"""Prefix caches (index from token sequences to KV slots) and the KV slot allocator.

``RadixCache`` (token-level radix tree), ``SlotAllocator``, ``MatchResult`` and ``PrefixCache``
are imported eagerly; ``HashBlockCache`` and ``NoPrefixCache`` lazily from
``radixkv.cache.hash_cache``.
"""

from __future__ import annotations

from radixkv.cache.allocator import SlotAllocator
from radixkv.cache.base import MatchResult, PrefixCache
from radixkv.cache.radix_tree import RadixCache

__all__ = ["RadixCache", "SlotAllocator", "MatchResult", "PrefixCache", "HashBlockCache", "NoPrefixCache"]


def __getattr__(name: str):
    if name in ("HashBlockCache", "NoPrefixCache"):
        from radixkv.cache import hash_cache

        return getattr(hash_cache, name)
    raise AttributeError(f"module 'radixkv.cache' has no attribute {name!r}")
