"""The disk tier's directory: its layout, its manifest, atomic writes, reads and the scan that
rebuilds the in-memory index (what :class:`~radixkv.tiers.disk.DiskStore` stands on).

Layout of ``disk_cache_dir``::

    radixkv-kv-tier.json          the manifest: {"format": "radixkv-kv-tier", "version": 1, "fanout": 256}
    blocks/<xx>/<key hex>.kvb     one record per block (radixkv.tiers.codec); <xx>: the block
                                  digest's first byte in hex (BlockKey.hex()[64:66])
    blocks/<xx>/.<key hex>.<pid>.<random>.tmp   a record being written (then os.replace'd)

The tier makes its directories 0700 and its files 0600 (:data:`DIR_MODE`, :data:`FILE_MODE`; a
directory the operator made keeps its mode). A record's mtime is its last use (set on write and on each read), so the least recently used
order survives restarts and is shared by every process using the directory.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import stat
import tempfile
import time
from typing import Iterator

__all__ = [
    "BLOCKS",
    "DIR_MODE",
    "FILE_MODE",
    "MANIFEST",
    "NotARecord",
    "drop_entry",
    "layout_path",
    "prepare",
    "read_head",
    "read_record",
    "remove_records",
    "scan",
    "unlink_if_same",
    "write_record",
]

MANIFEST = "radixkv-kv-tier.json"
BLOCKS = "blocks"
_FORMAT = {"format": "radixkv-kv-tier", "version": 1, "fanout": 256}
_SUFFIX = ".kvb"
_NAME_LEN = 96
_HEX = frozenset("0123456789abcdef")
STALE_TMP_S = 3600.0
"""A temporary file older than this (seconds, by its mtime) is a crashed writer's: removed by scans."""
_READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
"""Opening what should be a file: never through a symlink, never blocking on a FIFO."""
DIR_MODE = 0o700
"""The mode of the directories the tier makes (the root, ``blocks``, the fan-out folders)."""
FILE_MODE = 0o600
"""The mode of the records (the manifest's too): a record holds a tenant's prompt token ids in the
clear, and K/V that gives them back, so only the server's user reads them (docs/tiers.md)."""


def layout_path(root: str, name: str) -> str:
    """The record file of the key whose ``hex()`` is ``name``."""
    return os.path.join(root, BLOCKS, name[64:66], name + _SUFFIX)


def _unwritable(root: str, why: str) -> ValueError:
    return ValueError(f"disk_cache_dir {root!r} is not a writable directory: {why}")


def _stray_entry(root: str) -> str | None:
    """The first entry under ``blocks/`` that no disk tier writes (a ``blocks`` that is not a
    folder, a folder not named by a byte in hex, a file that is neither a record of its folder
    nor a temporary one), or None."""
    blocks = os.path.join(root, BLOCKS)
    if os.path.islink(blocks) or not os.path.isdir(blocks):
        return blocks
    with os.scandir(blocks) as it:
        subs = list(it)
    for sub in subs:
        if len(sub.name) != 2 or not _HEX.issuperset(sub.name) or not sub.is_dir(follow_symlinks=False):
            return sub.path
        for e in _entries(sub):
            if _record_name(e, sub.name) is None and not (e.name.startswith(".") and e.name.endswith(".tmp")):
                return e.path
    return None


def _write_manifest(root: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".manifest.", suffix=".tmp", dir=root)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(_FORMAT, f)
        os.replace(tmp, os.path.join(root, MANIFEST))
    except BaseException:
        _unlink(tmp)
        raise


def _manifest_ok(root: str) -> bool:
    """Whether the manifest is a regular file of this format (read without following a symlink
    or blocking on a FIFO: a FIFO there hung the engine's start)."""
    try:
        fd = os.open(os.path.join(root, MANIFEST), _READ_FLAGS)
    except OSError:
        return False
    try:
        return stat.S_ISREG(os.fstat(fd).st_mode) and json.loads(os.read(fd, 4096)) == _FORMAT
    except (OSError, ValueError):
        return False
    finally:
        os.close(fd)


def prepare(root: str) -> bool:
    """Make ``root`` a disk tier's directory; returns True when its index was corrupt (a manifest
    unreadable, of another format or version, or missing beside existing blocks) and the tier was
    emptied.

    Raises:
        ValueError: (naming ``disk_cache_dir``) ``root`` cannot be created, is not a directory,
            or a file cannot be written in it; or it has a ``blocks`` but no manifest and
            something under ``blocks`` is not a disk tier's (another program's directory: nothing
            of it is removed).
    """
    try:
        os.makedirs(root, mode=DIR_MODE, exist_ok=True)
    except OSError as e:
        raise _unwritable(root, e.strerror or str(e)) from None
    if not os.path.isdir(root):
        raise _unwritable(root, "not a directory")
    if not os.access(root, os.W_OK | os.X_OK):
        raise _unwritable(root, "permission denied")
    blocks = os.path.join(root, BLOCKS)
    # NOTE: blocks/ is looked at before the manifest: a process creating the tier writes the
    # manifest first, so blocks/ seen here means its manifest is visible below.
    had_blocks = os.path.lexists(blocks)
    has_manifest = os.path.lexists(os.path.join(root, MANIFEST))
    corrupt = (has_manifest and not _manifest_ok(root)) or (had_blocks and not has_manifest)
    try:
        stray = _stray_entry(root) if had_blocks and not has_manifest else None
    except OSError as e:
        raise _unwritable(root, e.strerror or str(e)) from None
    if stray is not None:
        raise ValueError(
            f"disk_cache_dir {root!r} is not a KV tier's directory: it has no {MANIFEST} and {stray!r} is "
            "not a tier's record (give an empty or new directory)"
        )
    try:
        if corrupt:
            remove_records(root, everything=True)
            drop_entry(os.path.join(root, MANIFEST))  # NOTE: an empty directory there too
        if corrupt or not has_manifest:
            _write_manifest(root)
        if os.path.lexists(blocks) and not os.path.isdir(blocks):
            corrupt = True
            os.unlink(blocks)
        os.makedirs(blocks, mode=DIR_MODE, exist_ok=True)
    except OSError as e:
        raise _unwritable(root, e.strerror or str(e)) from None
    return corrupt


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except OSError:
        return False


def _fanout_dirs(root: str) -> Iterator[os.DirEntry]:
    try:
        with os.scandir(os.path.join(root, BLOCKS)) as it:
            subs = [e for e in it if len(e.name) == 2 and e.is_dir(follow_symlinks=False)]
    except OSError:
        return
    yield from subs


def _entries(sub: os.DirEntry) -> list[os.DirEntry]:
    try:
        with os.scandir(sub.path) as it:
            return list(it)
    except OSError:
        return []


def _record_name(entry: os.DirEntry, sub: str) -> str | None:
    n = entry.name
    if len(n) != _NAME_LEN + len(_SUFFIX) or not n.endswith(_SUFFIX) or n[64:66] != sub:
        return None
    return n[:_NAME_LEN] if _HEX.issuperset(n[:_NAME_LEN]) else None


def scan(root: str) -> list[tuple[str, int, int]]:
    """Every record in the directory as ``(key hex, size in bytes, mtime in ns)``, oldest use
    first (ties by name). Removes temporary files older than :data:`STALE_TMP_S`; ignores any
    other file and entries that vanish meanwhile (another process evicting)."""
    out = []
    stale_before = time.time_ns() - int(STALE_TMP_S * 1e9)
    for sub in _fanout_dirs(root):
        for e in _entries(sub):
            name = _record_name(e, sub.name)
            is_tmp = name is None and e.name.startswith(".") and e.name.endswith(".tmp")
            if name is None and not is_tmp:
                continue
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            if is_tmp:
                if st.st_mtime_ns < stale_before:
                    _unlink(e.path)
            elif stat.S_ISREG(st.st_mode):
                out.append((name, st.st_size, st.st_mtime_ns))
    out.sort(key=lambda r: (r[2], r[0]))
    return out


def remove_records(root: str, everything: bool = False) -> int:
    """Unlink every record (``everything``: also every other entry under ``blocks/``, emptied
    fan-out folders and a ``blocks`` that is not a folder); returns the number of records removed."""
    removed = 0
    blocks = os.path.join(root, BLOCKS)
    if everything and os.path.lexists(blocks) and not os.path.isdir(blocks):
        _unlink(blocks)
        return 0
    for sub in _fanout_dirs(root):
        for e in _entries(sub):
            if _record_name(e, sub.name) is not None:
                removed += _unlink(e.path)
            elif everything:
                _unlink(e.path)
        if everything:
            try:
                os.rmdir(sub.path)
            except OSError:
                pass
    return removed


def write_record(path: str, data: bytes, mtime_ns: int, fsync: bool = False) -> None:
    """Write ``data`` to ``path`` atomically: a temporary file in the same folder (created when
    missing), its mtime set to ``mtime_ns``, then ``os.replace``. A reader sees the old file, the
    new one, or none, never a part.

    Raises:
        OSError: the write failed (the temporary file is removed).
    """
    folder = os.path.dirname(path)
    tmp = os.path.join(folder, f".{os.path.basename(path)[:_NAME_LEN]}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(tmp, flags, FILE_MODE)
    except (FileNotFoundError, NotADirectoryError):
        _restore(os.path.dirname(os.path.dirname(folder)), folder)
        fd = os.open(tmp, flags, FILE_MODE)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if fsync:
                os.fsync(fd)
            os.utime(fd, ns=(mtime_ns, mtime_ns))
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        _unlink(tmp)
        raise


class NotARecord(Exception):
    """What is at a record's path is not a regular file (a symlink, a directory, a FIFO, a
    device): never read, a corrupt record; ``kind`` names it."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a device"),
    (stat.S_ISBLK, "a device"),
)


def _restore(root: str, folder: str) -> None:
    """Make ``folder`` (a fan-out folder of ``root``) again after someone removed it (or put a
    file there), or the whole directory: the manifest first when it is gone too (a ``blocks`` without one is a
    corrupt index to the next process that starts on the directory: it would remove every
    record written since)."""
    os.makedirs(root, mode=DIR_MODE, exist_ok=True)  # NOTE: a root that became a file raises: the write fails
    if not os.path.lexists(os.path.join(root, MANIFEST)):
        _write_manifest(root)
    try:
        not_a_folder = not stat.S_ISDIR(os.lstat(folder).st_mode)
    except OSError:
        not_a_folder = False
    if not_a_folder and os.path.isdir(os.path.dirname(folder)):
        # a file or a symlink where the fan-out folder goes, under the tier's own blocks/: damage,
        # replaced (every write there failed, and each failure paused all the tier's writes)
        _unlink(folder)
    os.makedirs(os.path.dirname(folder), mode=DIR_MODE, exist_ok=True)  # blocks/ (makedirs gives parents 0777)
    os.makedirs(folder, mode=DIR_MODE, exist_ok=True)


def read_record(path: str, limit: int) -> tuple[bytes | None, int, int]:
    """The bytes of the regular file at ``path`` (None, unread, when it is larger than ``limit``
    bytes), its inode number and its size. Its size at the open is what is read: a file growing
    meanwhile is read to that size (the codec's lengths check the rest).

    Raises:
        FileNotFoundError: no such file; NotARecord: not a regular file (opened without following
            a symlink and without blocking on a FIFO, then closed unread: a FIFO would block the
            tiers' thread for ever, ``/dev/zero`` would be read until memory runs out);
            OSError: it could not be read.
    """
    try:
        fd = os.open(path, _READ_FLAGS)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise NotARecord("a symlink") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotARecord(next((k for f, k in _KINDS if f(st.st_mode)), "not a regular file"))
        if st.st_size > limit:
            return None, st.st_ino, st.st_size
        chunks, left = [], st.st_size
        while left > 0:
            chunk = os.read(fd, left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return (chunks[0] if len(chunks) == 1 else b"".join(chunks)), st.st_ino, st.st_size
    finally:
        os.close(fd)


def read_head(path: str, size: int) -> bytes | None:
    """Up to the first ``size`` bytes of the regular file at ``path`` (opened as
    :func:`read_record` opens it), or None: no such file, not a regular file, unreadable."""
    try:
        fd = os.open(path, _READ_FLAGS)
    except OSError:
        return None
    try:
        return os.read(fd, size) if stat.S_ISREG(os.fstat(fd).st_mode) else None
    except OSError:
        return None
    finally:
        os.close(fd)


def drop_entry(path: str) -> None:
    """Remove what is at a record's path that is not a record (unlink; rmdir for an empty
    directory, a non-empty one is left: the tier removes nothing it cannot know it wrote)."""
    if not _unlink(path):
        try:
            os.rmdir(path)
        except OSError:
            pass


def unlink_if_same(path: str, ino: int) -> bool:
    """Unlink ``path`` if it is still the file with inode ``ino`` (not a newer replacement)."""
    try:
        if os.lstat(path).st_ino != ino:
            return False
    except OSError:
        return False
    return _unlink(path)
