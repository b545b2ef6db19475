"""`make_stores`: the configured tiers, in the order a miss searches them."""

from __future__ import annotations

import os
from typing import Optional

from radixkv.tiers.base import DEFAULT_DISK_CACHE_BYTES, PageStore
from radixkv.tiers.disk import DiskStore
from radixkv.tiers.host import HostStore

__all__ = ["make_stores"]


def make_stores(
    host_cache_bytes: Optional[int] = None,
    disk_cache_dir: Optional[str | os.PathLike] = None,
    disk_cache_bytes: Optional[int] = None,
    remote_cache_url: Optional[str] = None,
    *,
    fingerprint: Optional[bytes] = None,
    remote_ttl_s: Optional[int] = None,
) -> list[PageStore]:
    """The stores the settings name, host then disk then remote (each optional: None or 0 leaves
    the host tier out, None the disk and remote tiers).

    Args:
        host_cache_bytes: the RAM tier's bytes.
        disk_cache_dir, disk_cache_bytes: the disk tier's directory and bytes (default 8 GiB).
        remote_cache_url: the Redis / Valkey URL.
        fingerprint: the model fingerprint the remote store's ``delete_all`` deletes.
        remote_ttl_s: the remote records' TTL (``RedisStore``'s ``ttl_s``).

    Raises:
        ValueError: a bad setting, naming it (``host_cache_bytes``, ``disk_cache_dir``,
            ``disk_cache_bytes``, ``remote_cache_url``).
    """
    stores: list[PageStore] = []
    if host_cache_bytes:
        stores.append(HostStore(host_cache_bytes))
    if disk_cache_dir is not None:
        cap = DEFAULT_DISK_CACHE_BYTES if disk_cache_bytes is None else disk_cache_bytes
        stores.append(DiskStore(disk_cache_dir, cap))
    if remote_cache_url is not None:
        from radixkv.tiers.remote import RedisStore

        stores.append(RedisStore(remote_cache_url, ttl_s=remote_ttl_s, fingerprint=fingerprint))
    return stores
