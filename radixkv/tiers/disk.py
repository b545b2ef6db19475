"""`DiskStore`: the local-disk tier, one checked file per block, persistent across restarts and
shared safely by processes using the same directory (layout: :mod:`radixkv.tiers.disk_files`)."""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
import time
from collections import OrderedDict
from typing import Callable, Optional, Sequence

from radixkv.tiers import disk_files as files
from radixkv.tiers.base import (
    DEFAULT_DISK_CACHE_BYTES,
    Backoff,
    Block,
    BlockKey,
    StoreStats,
    ThrottledLog,
    keeps_held,
)
from radixkv.tiers.codec import HEAD_SIZE, decode, encode, head_tokens, why_corrupt

__all__ = ["DiskStore"]

logger = logging.getLogger(__name__)

_FULL = (errno.ENOSPC, errno.EDQUOT)
_time_lock = threading.Lock()
_last_ns = 0


def _use_time_ns() -> int:
    """Wall time in ns, strictly increasing within the process: records' mtimes order their uses
    (every store of the process, and across restarts)."""
    global _last_ns
    with _time_lock:
        _last_ns = max(time.time_ns(), _last_ns + 1)
        return _last_ns


class DiskStore:
    """Blocks as files under ``path``, within ``capacity_bytes`` of records (their encoded sizes).

    Writes are atomic (a temporary file in the same folder, then ``os.replace``); every read is
    verified by the codec: a corrupt or truncated file is a miss, counted (``corrupt``) and
    removed. A record's mtime is its last use; an in-memory index (name -> size, mtime), rebuilt
    from a scan at start and rescanned every ``refresh_s`` seconds at a ``put``, orders eviction
    (least recently used first; a victim another process used since is kept) and accounts the
    bytes of every process's records. A failing write (a full disk: ``full``) is counted, logged
    with backoff, and writes pause for the backoff (``skipped``); ``degraded`` while they do.

    Args:
        path: the directory (``disk_cache_dir``; ``~`` is the user's home), created when missing.
        capacity_bytes: the byte budget (``disk_cache_bytes``, default 8 GiB).
        refresh_s: seconds between rescans of the directory (other processes' writes).
        fsync: fsync each record before it replaces the old one.
        clock: the monotonic time source of rescans and backoff (tests pass their own).
        backoff_base_s, backoff_max_s: the write backoff after a failure.

    Raises:
        ValueError: ``path`` cannot be created, is not a directory or is not writable (naming
            ``disk_cache_dir``); ``capacity_bytes`` not an int >= 0 (naming ``disk_cache_bytes``).
            A corrupt index (manifest) is no error: the tier starts empty (``corrupt_index`` 1).
    """

    medium = "disk"

    def __init__(
        self,
        path: str | os.PathLike,
        capacity_bytes: int = DEFAULT_DISK_CACHE_BYTES,
        *,
        refresh_s: float = 10.0,
        fsync: bool = False,
        clock: Callable[[], float] = time.monotonic,
        backoff_base_s: float = 1.0,
        backoff_max_s: float = 60.0,
    ) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes < 0:
            raise ValueError(f"disk_cache_bytes must be an integer >= 0, got {capacity_bytes!r}")
        if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
            raise ValueError(f"disk_cache_dir must be a directory path, got {path!r}")
        self.path = os.path.abspath(os.path.expanduser(os.fspath(path)))
        self._capacity = capacity_bytes
        self._refresh_s, self._fsync, self._clock = refresh_s, fsync, clock
        self._stats = StoreStats(extra=("full", "corrupt_index"))
        self._lock = threading.Lock()
        # NOTE: one put at a time: room made for a record stays free until it is written
        self._put_lock = threading.Lock()
        self._index: OrderedDict[str, tuple[int, int]] = OrderedDict()
        self._used = 0
        self._closed = False
        self._backoff = Backoff(backoff_base_s, backoff_max_s, clock)
        self._write_log = ThrottledLog(logger, f"disk tier {self.path}: write")
        self._read_log = ThrottledLog(logger, f"disk tier {self.path}: read")
        if files.prepare(self.path):
            self._stats.add(corrupt_index=1)
            logger.warning("disk tier %s: corrupt index (manifest); the tier starts empty", self.path)
        self.refresh()

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def degraded(self) -> bool:
        """Writes are failing (a full or failing disk) and paused for the backoff."""
        return self._backoff.failing

    def refresh(self) -> None:
        """Rebuild the index from the directory (every process's records, by last use)."""
        records = files.scan(self.path)
        with self._lock:
            self._index = OrderedDict((name, (size, mtime)) for name, size, mtime in records)
            self._used = sum(size for _, size, _ in records)
            self._scanned_at = self._clock()

    def _now_ns(self) -> int:
        return _use_time_ns()

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Whether each key's file exists (another process's included; nothing counted)."""
        if self._closed:
            return [False] * len(keys)
        with self._lock:
            indexed = [k.hex() in self._index for k in keys]
        return [hit or os.path.exists(files.layout_path(self.path, k.hex())) for hit, k in zip(indexed, keys)]

    def get(self, keys: Sequence[BlockKey], tokens: Sequence[Optional[Sequence[int]]]) -> list[Block | None]:
        """Each key's block, read and verified against ``tokens[i]`` (None: any token ids); a
        missing, unreadable or corrupt file is None (corrupt ones are removed)."""
        out = [self._get_one(k, t) for k, t in zip(keys, tokens, strict=True)]
        hits = sum(b is not None for b in out)
        self._stats.add(hits=hits, misses=len(out) - hits)
        return out

    def _get_one(self, key: BlockKey, tokens: Optional[Sequence[int]]) -> Block | None:
        if self._closed:
            return None
        name = key.hex()
        path = files.layout_path(self.path, name)
        try:
            # NOTE: no record is larger than the tier (put rejects those): a larger file is not read
            data, ino, size = files.read_record(path, self._capacity)
        except FileNotFoundError:
            self._forget(name)
            return None
        except files.NotARecord as e:
            self._stats.add(corrupt=1)
            logger.warning("disk tier: dropped corrupt record %s (%s, not a file)", path, e.kind)
            files.drop_entry(path)
            self._forget(name)
            return None
        except OSError as e:
            self._stats.add(errors=1)
            self._read_log.failure(e)
            return None
        self._stats.add(blocks_read=1, bytes_read=size if data is None else len(data))
        block = None if data is None else decode(key, data, tokens)
        if block is None:
            self._stats.add(corrupt=1)
            why = f"length: {size} bytes, more than the tier" if data is None else why_corrupt(key, data, tokens)
            logger.warning("disk tier: dropped corrupt record %s (%s)", path, why)
            files.unlink_if_same(path, ino)
            self._forget(name)
            return None
        self._touch(name, path, len(data))
        return block

    def drop(self, keys: Sequence[BlockKey]) -> None:
        """Remove each key's record (one the engine side refused after this store's checks: its
        layout or length is not the pool's), so that a later ``put`` writes a new one."""
        for key in keys:
            if self._closed:
                return
            name = key.hex()
            files.drop_entry(files.layout_path(self.path, name))
            self._forget(name)

    def touch(self, keys: Sequence[BlockKey]) -> None:
        """Mark each key's record used now (a missing one stays missing; nothing is written)."""
        for key in keys:
            if self._closed:
                return
            name = key.hex()
            self._touch(name, files.layout_path(self.path, name), None)

    def _touch(self, name: str, path: str, size: int | None) -> bool:
        """Mark the record used now (its mtime, its place in the index); False when it is gone.
        Under the lock, so that no eviction of this process comes between the two."""
        now = self._now_ns()
        with self._lock:
            try:
                if size is None:
                    st = os.lstat(path)
                    if not stat.S_ISREG(st.st_mode):  # a symlink (dangling too), a FIFO, ...: no record
                        self._stats.add(corrupt=1)
                        logger.warning("disk tier: dropped corrupt record %s (not a file)", path)
                        files.drop_entry(path)
                        if os.path.lexists(path):
                            return True  # a non-empty directory: left, a miss (a write there would fail)
                        raise FileNotFoundError(path)
                    known = self._index.get(name)
                    size = known[0] if known else st.st_size
                os.utime(path, ns=(now, now), follow_symlinks=False)  # NOTE: never a symlink's target
            except (FileNotFoundError, NotADirectoryError):  # ENOTDIR: the directory became a file
                old = self._index.pop(name, None)
                self._used -= old[0] if old else 0
                return False
            except OSError:
                return True
            old = self._index.pop(name, None)
            self._used += size - (old[0] if old else 0)
            self._index[name] = (size, now)
            return True

    def _forget(self, name: str) -> None:
        with self._lock:
            old = self._index.pop(name, None)
            if old is not None:
                self._used -= old[0]

    def _remember(self, name: str, size: int, mtime_ns: int) -> None:
        with self._lock:
            old = self._index.pop(name, None)
            self._used += size - (old[0] if old else 0)
            self._index[name] = (size, mtime_ns)

    def put(self, keys: Sequence[BlockKey], blocks: Sequence[Block], replace: bool = False) -> None:
        """Write each block not yet stored (a stored one is only marked used now; with ``replace``
        written again, atomically, unless the stored one's tokens start with all of the new
        one's: ``keeps_held``), evicting the least recently used records to stay within
        ``capacity_bytes``. Never raises for the disk's failures (counted: ``errors``, ``full``;
        later writes ``skipped`` during the backoff)."""
        with self._put_lock:
            if self._clock() - self._scanned_at >= self._refresh_s:
                self.refresh()
            for key, block in zip(keys, blocks, strict=True):
                if self._closed:
                    return
                self._put_one(key, block, replace)

    def _put_one(self, key: BlockKey, block: Block, replace: bool) -> None:
        name = key.hex()
        path = files.layout_path(self.path, name)
        if not replace and self._touch(name, path, None):
            return  # stored already (by this process or another): only marked used now
        if replace and keeps_held(head_tokens(key, files.read_head(path, HEAD_SIZE) or b""), block.tokens):
            self._touch(name, path, None)  # a longer tail of the same tokens: kept, marked used
            return
        if not self._backoff.ready():
            self._stats.add(skipped=1)
            return
        data = encode(key, block)
        if len(data) > self._capacity:
            self._stats.add(rejected=1)
            return
        self._make_room(len(data))
        now = self._now_ns()
        try:
            files.write_record(path, data, now, self._fsync)
        except OSError as e:
            self._write_failed(e)
            return
        if self._backoff.succeeded():
            self._write_log.recovered()
        self._remember(name, len(data), now)
        self._stats.add(blocks_written=1, bytes_written=len(data))

    def probe(self) -> None:
        """While degraded, once the backoff allows, write and remove a small file in the
        directory (a success ends ``degraded``), so a disk that recovers says so without a block
        having to be written; otherwise nothing. The engine calls it off its thread when a
        degraded tier's stats are read (as the remote tier's ``PING``)."""
        if not self.degraded or not self._backoff.ready() or self._closed:
            return
        # NOTE: a temporary file's name in a fan-out folder, which a scan skips and a start
        # tolerates; write_record remakes the folders (and the manifest) when they are gone
        path = os.path.join(self.path, files.BLOCKS, "00", f".probe.{os.getpid()}.tmp")
        try:
            files.write_record(path, b"radixkv", self._now_ns(), self._fsync)
            os.unlink(path)
        except OSError as e:
            self._write_failed(e)
            return
        if self._backoff.succeeded():
            self._write_log.recovered()

    def _write_failed(self, e: OSError) -> None:
        full = e.errno in _FULL
        self._stats.add(errors=1, full=int(full))
        delay = self._backoff.failed()
        self._write_log.failure(e, f"writes paused {delay:g} s" + (" (disk full)" if full else ""))

    def _make_room(self, size: int) -> None:
        evicted = 0
        with self._lock:
            passes = len(self._index)
            while self._used + size > self._capacity and self._index:
                name, (old_size, mtime) = next(iter(self._index.items()))
                path = files.layout_path(self.path, name)
                try:
                    st = os.lstat(path)
                except FileNotFoundError:
                    self._forget_locked(name)
                    continue
                except OSError:
                    st = None
                if st is not None and st.st_mtime_ns > mtime and passes > 0:
                    # another process used it since: it is not the least recently used
                    passes -= 1
                    self._index.pop(name)
                    self._used += st.st_size - old_size
                    self._index[name] = (st.st_size, st.st_mtime_ns)
                    continue
                try:
                    os.unlink(path)
                    evicted += 1
                except OSError:
                    pass
                self._forget_locked(name)
        self._stats.add(evicted=evicted)

    def _forget_locked(self, name: str) -> None:
        self._used -= self._index.pop(name)[0]

    def delete_all(self) -> None:
        """Remove every record in the directory (every process's)."""
        files.remove_records(self.path)
        with self._lock:
            self._index.clear()
            self._used = 0

    def stats(self) -> dict[str, int | bool]:
        """Counters (docs/tiers.md "Stores"; ``full``: writes that found the disk full,
        ``corrupt_index``: 1 when the tier started empty for it), ``blocks`` / ``used_bytes`` in
        the index, ``capacity_bytes``, ``degraded``."""
        with self._lock:
            held = dict(blocks=len(self._index), used_bytes=self._used, capacity_bytes=self._capacity)
        return {**self._stats.snapshot(), **held, "degraded": self.degraded}

    def close(self) -> None:
        """Stop: later calls miss and write nothing (every write was already on disk). Idempotent."""
        self._closed = True
