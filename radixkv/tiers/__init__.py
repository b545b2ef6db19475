"""KV tiers below the pool: host RAM, local disk and a shared Redis / Valkey server.

The stores (:class:`HostStore`, :class:`DiskStore`, :class:`RedisStore`) implement
:class:`PageStore` over 16-token blocks named by :class:`BlockKey` and checked by the codec
(:mod:`radixkv.tiers.codec`); the engine side moves pages between the pool and them.
docs/tiers.md describes formats, integrity, faults and the Redis policy. ``RedisStore`` (and the
``redis`` client) is imported on first use.
"""

from __future__ import annotations

from typing import Any

from radixkv.tiers.base import (
    BLOCK_TOKENS,
    DEFAULT_DISK_CACHE_BYTES,
    STAT_KEYS,
    Block,
    BlockKey,
    PageStore,
    block_nbytes,
)
from radixkv.tiers.codec import decode, encode, encoded_size, why_corrupt
from radixkv.tiers.disk import DiskStore
from radixkv.tiers.factory import make_stores
from radixkv.tiers.host import HostStore
from radixkv.tiers.redis_url import RedisURL, parse_redis_url

__all__ = [
    "BLOCK_TOKENS",
    "DEFAULT_DISK_CACHE_BYTES",
    "STAT_KEYS",
    "Block",
    "BlockKey",
    "DiskStore",
    "HostStore",
    "PageStore",
    "RedisStore",
    "RedisURL",
    "block_nbytes",
    "decode",
    "encode",
    "encoded_size",
    "make_stores",
    "parse_redis_url",
    "why_corrupt",
]


def __getattr__(name: str) -> Any:
    if name == "RedisStore":
        from radixkv.tiers.remote import RedisStore

        return RedisStore
    raise AttributeError(f"module 'radixkv.tiers' has no attribute {name!r}")
