"""The KV tiers' stores and codec (radixkv/tiers/): keys, the record format and every way a record
can be wrong, the host and disk stores' LRU and exact byte accounting, restarts, two processes
sharing a directory, corrupt files and index, an unwritable directory and a full disk (a real
tmpfs in a mount namespace). The Redis store is tests/test_tiers_redis.py's (one server)."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from tier_helpers import FP, FP2, keys_and_tokens, make_block, payload_for, run_two_processes

from radixkv.tiers import (
    Block,
    BlockKey,
    DiskStore,
    HostStore,
    block_nbytes,
    decode,
    encode,
    encoded_size,
    make_stores,
    why_corrupt,
)
from radixkv.tiers import disk_files as files
from radixkv.tiers.codec import ALIGN, HEADER_SIZE

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[1]


def _one(seed: int = 0, size: int = 4096, namespace=None, fp: bytes = FP) -> tuple[BlockKey, tuple, Block]:
    keys, toks = keys_and_tokens(1, seed=seed, namespace=namespace, fp=fp)
    return keys[0], toks[0], make_block(keys[0], toks[0], size)


# --- keys and blocks ---------------------------------------------------------------------------


def test_block_key_names_model_namespace_and_block():
    k, _, _ = _one()
    assert len(k.to_bytes()) == 48 and k.hex() == k.to_bytes().hex() and len(k.hex()) == 96
    assert k.to_bytes()[:16] == FP and k.to_bytes()[32:] == k.digest
    other_ns, _, _ = _one(namespace="tenant-a")
    other_fp, _, _ = _one(fp=FP2)
    assert len({k.hex(), other_ns.hex(), other_fp.hex()}) == 3
    assert other_fp.digest == k.digest  # the same tokens in the same namespace: only the model differs
    with pytest.raises(ValueError, match="fingerprint must be 16 bytes"):
        BlockKey(b"short", k.namespace, k.digest)
    with pytest.raises(ValueError, match="digest must be 16 bytes"):
        BlockKey(FP, k.namespace, b"x" * 15)
    with pytest.raises(ValueError, match="namespace must be bytes"):
        BlockKey(FP, "default", k.digest)


def test_block_checks_its_tokens_and_buffers():
    assert Block(list(range(16)), b"").tokens == tuple(range(16))
    assert Block(tuple(range(15)), b"").tokens == tuple(range(15))  # a tail: 1 to 15 tokens
    for n in (0, 17):
        with pytest.raises(ValueError, match=f"1 to 16 token ids, got {n}"):
            Block(tuple(range(n)), b"")
    with pytest.raises(ValueError, match="int32"):
        Block((1 << 31,) + tuple(range(15)), b"")
    with pytest.raises(ValueError, match="payload must be bytes-like"):
        Block(tuple(range(16)), "text")
    with pytest.raises(ValueError, match="C-contiguous"):
        Block(tuple(range(16)), memoryview(bytes(64))[::2])
    import numpy as np

    arr = np.arange(24, dtype=np.float32).reshape(2, 12)  # any contiguous buffer: its raw bytes
    k, t, _ = _one()
    assert Block(t, arr).payload_nbytes == 96
    assert bytes(decode(k, encode(k, Block(t, arr)), t).payload) == arr.tobytes()
    assert block_nbytes(Block(tuple(range(16)), b"x" * 100, b"meta")) == 100 + 4 + 64


def test_tiers_import_without_torch_and_redis_only_on_use():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import radixkv.tiers as t\n"
        "assert 'redis' not in sys.modules\n"
        "t.parse_redis_url('redis://localhost')\n"
        "assert 'redis' not in sys.modules\n"
        "t.RedisStore\n"
        "assert 'redis' not in sys.modules\n"
        "assert t.RedisStore('redis://127.0.0.1:1/0', timeout_s=0.5).degraded\n"  # nobody listens on port 1
        "assert 'redis' in sys.modules\n"
        "print('ok')"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


# --- codec -------------------------------------------------------------------------------------


def test_codec_round_trip_is_exact_and_zero_copy():
    k, t, b = _one(size=737_280)
    data = encode(k, b)
    assert len(data) == encoded_size(b) == HEADER_SIZE + 64 + len(b.meta) + 42 + 737_280 + 16 == 192 + 737_280 + 16
    out = decode(k, data, t)
    assert out == b and bytes(out.payload) == b.payload and out.meta == b.meta and out.tokens == t
    assert isinstance(out.payload, memoryview) and out.payload.readonly
    assert out.payload.obj is data  # a view of the record, not a copy
    assert (len(data) - 16 - 737_280) % ALIGN == 0  # the payload starts 64-byte aligned
    assert why_corrupt(k, data, t) is None


def _patch(data: bytes, at: int, new: bytes) -> bytes:
    return data[:at] + new + data[at + len(new) :]


def test_codec_every_corruption_is_a_miss_with_its_reason():
    k, t, b = _one(size=1000)
    data = encode(k, b)
    other_key, other_tokens, _ = _one(seed=1)
    other_ns, _, _ = _one(namespace="tenant-a")
    cases = {
        "magic": (k, _patch(data, 0, b"XKVB"), t),
        "version": (k, _patch(data, 4, struct.pack("<H", 3)), t),
        "checksum-version": (k, _patch(data, 4, struct.pack("<H", 1)), t),  # a version-1 record's sum is blake2b
        "flags": (k, _patch(data, 6, struct.pack("<H", 1)), t),
        "key": (other_key, data, t),
        "key-namespace": (other_ns, data, t),
        "key-model": (BlockKey(FP2, k.namespace, k.digest), data, t),
        "tokens": (k, data, other_tokens),
        "tokens-one": (k, data, t[:-1] + (t[-1] + 1,)),
        "length-truncated": (k, data[:-1], t),
        "length-appended": (k, data + b"\0", t),
        "length-header": (k, data[:40], t),
        "length-field": (k, _patch(data, 64, struct.pack("<Q", 999)), t),
        "checksum-payload": (k, _patch(data, len(data) - 100, bytes([data[-100] ^ 1])), t),
        "checksum-meta": (k, _patch(data, HEADER_SIZE + 64, b"g"), t),
        "checksum-sum": (k, _patch(data, len(data) - 1, bytes([data[-1] ^ 0x80])), t),
    }
    reasons = {}
    for name, (key, rec, toks) in cases.items():
        assert decode(key, rec, toks) is None, name
        reasons[name] = why_corrupt(key, rec, toks).split(":")[0]
    assert reasons == {
        "magic": "magic",
        "version": "version",
        "checksum-version": "checksum",
        "flags": "version",
        "key": "key",
        "key-namespace": "key",
        "key-model": "key",
        "tokens": "tokens",
        "tokens-one": "tokens",
        "length-truncated": "length",
        "length-appended": "length",
        "length-header": "length",
        "length-field": "length",
        "checksum-payload": "checksum",
        "checksum-meta": "checksum",
        "checksum-sum": "checksum",
    }


def test_codec_reads_a_version_1_record():
    """Records written before the checksum became XXH3 (version 1: blake2b-128) still load, and
    are checked with their own sum."""
    import hashlib

    k, t, b = _one(size=1000)
    v2 = encode(k, b)
    body = _patch(v2[:-16], 4, struct.pack("<H", 1))
    v1 = body + hashlib.blake2b(body, digest_size=16).digest()
    got = decode(k, v1, t)
    assert got is not None and bytes(got.payload) == bytes(b.payload) and got.tokens == t and got.meta == b.meta
    assert why_corrupt(k, _patch(v1, len(v1) - 100, bytes([v1[-100] ^ 1])), t) == "checksum"
    assert struct.unpack_from("<H", v2, 4) == (2,)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    tokens=st.lists(st.integers(-(1 << 31), (1 << 31) - 1), min_size=16, max_size=16),
    meta=st.binary(max_size=80),
    payload=st.binary(max_size=3000),
    flip=st.integers(0, 1 << 30),
    bit=st.integers(0, 7),
    cut=st.integers(0, 1 << 30),
)
def test_codec_hypothesis_round_trip_and_any_damage(tokens, meta, payload, flip, bit, cut):
    k, _, _ = _one()
    b = Block(tuple(tokens), payload, meta)
    data = encode(k, b)
    assert len(data) == encoded_size(b) and (len(data) - 16 - len(payload)) % ALIGN == 0
    assert decode(k, data, tokens) == b
    i = flip % len(data)
    assert decode(k, _patch(data, i, bytes([data[i] ^ (1 << bit)])), tokens) is None
    assert decode(k, data[: cut % len(data)], tokens) is None
    wrong = list(tokens)
    wrong[cut % 16] ^= 1
    assert decode(k, data, wrong) is None


# --- host --------------------------------------------------------------------------------------


def _blocks(n: int, size: int = 4096, seed: int = 0):
    keys, toks = keys_and_tokens(n, seed=seed)
    return keys, toks, [make_block(k, t, size) for k, t in zip(keys, toks)]


def test_host_round_trip_lru_and_exact_counters():
    keys, toks, blocks = _blocks(4)
    size = block_nbytes(blocks[0])
    evicted = []
    h = HostStore(3 * size, on_evict=evicted.extend)
    h.put(keys[:3], blocks[:3])
    assert h.used_bytes == 3 * size and h.contains(keys) == [True, True, True, False]
    got = h.get(keys[:1], toks[:1])  # block 0 becomes the most recently used
    assert got[0] is blocks[0]
    h.put(keys[3:], blocks[3:])  # evicts block 1, the least recently used
    assert h.contains(keys) == [True, False, True, True] and h.used_bytes == 3 * size
    assert evicted == [(keys[1], blocks[1])]
    assert h.get(keys, toks) == [blocks[0], None, blocks[2], blocks[3]]
    h.put(keys[:1], blocks[:1])  # already held: nothing written
    s = h.stats()
    assert {k: s[k] for k in ("hits", "misses", "blocks_read", "bytes_read", "blocks_written", "bytes_written")} == {
        "hits": 4,
        "misses": 1,
        "blocks_read": 4,
        "bytes_read": 4 * size,
        "blocks_written": 4,
        "bytes_written": 4 * size,
    }
    assert (s["evicted"], s["corrupt"], s["rejected"], s["blocks"], s["used_bytes"], s["degraded"]) == (
        1,
        0,
        0,
        3,
        3 * size,
        False,
    )


def test_host_wrong_tokens_are_corrupt_and_dropped_and_oversize_rejected():
    keys, toks, blocks = _blocks(2)
    h = HostStore(10 * block_nbytes(blocks[0]))
    h.put(keys, blocks)
    wrong = toks[0][:-1] + (toks[0][-1] + 1,)
    assert h.get(keys, [wrong, toks[1]]) == [None, blocks[1]]
    assert h.contains(keys) == [False, True] and h.used_bytes == block_nbytes(blocks[1])
    assert (h.stats()["corrupt"], h.stats()["misses"]) == (1, 1)
    big_k, big_t, big = _one(seed=9, size=20 * 4096)
    h.put([big_k], [big])
    assert h.contains([big_k]) == [False] and h.stats()["rejected"] == 1
    h.close()
    h.close()
    assert h.get(keys[1:], toks[1:]) == [None] and h.used_bytes == 0
    with pytest.raises(ValueError, match="host_cache_bytes"):
        HostStore(-1)


# --- disk --------------------------------------------------------------------------------------


def test_disk_round_trip_restart_and_lru_order_survive(tmp_path):
    keys, toks, blocks = _blocks(5)
    rec = encoded_size(blocks[0])
    d = DiskStore(tmp_path, 3 * rec)
    d.put(keys[:3], blocks[:3])
    assert d.get(keys[:1], toks[:1]) == blocks[:1]  # block 0: most recently used
    d.put(keys[3:4], blocks[3:4])  # evicts block 1
    assert d.contains(keys) == [True, False, True, True, False]
    assert d.used_bytes == 3 * rec == sum(f.stat().st_size for f in tmp_path.rglob("*.kvb"))
    s = d.stats()
    assert [s[k] for k in ("hits", "misses", "blocks_written", "bytes_written", "evicted", "blocks")] == [
        1,
        0,
        4,
        4 * rec,
        1,
        3,
    ]
    d.close()
    assert d.get(keys[:1], toks[:1]) == [None] and d.contains(keys[:1]) == [False]
    # a new store on the same directory: the same blocks, the same least-recently-used order
    d2 = DiskStore(tmp_path, 3 * rec)
    assert d2.used_bytes == 3 * rec and d2.stats()["blocks"] == 3
    assert d2.get(keys, toks) == [blocks[0], None, blocks[2], blocks[3], None]
    d2.put(keys[4:], blocks[4:])  # the reads above made 0, 2, 3 recent in that order: 0 goes
    assert d2.contains(keys) == [False, False, True, True, True]
    d2.delete_all()
    assert d2.used_bytes == 0 and list(tmp_path.rglob("*.kvb")) == [] and d2.contains(keys) == [False] * 5


def _file(root: Path, key: BlockKey) -> Path:
    return Path(files.layout_path(str(root), key.hex()))


def test_disk_truncated_corrupted_and_foreign_files_are_counted_misses(tmp_path):
    keys, toks, blocks = _blocks(5)
    rec = encoded_size(blocks[0])
    d = DiskStore(tmp_path, 10 * rec)
    d.put(keys, blocks)
    os.truncate(_file(tmp_path, keys[0]), rec - 7)
    raw = bytearray(_file(tmp_path, keys[1]).read_bytes())
    raw[HEADER_SIZE + 100] ^= 0xFF
    _file(tmp_path, keys[1]).write_bytes(bytes(raw))
    shutil.copy(_file(tmp_path, keys[3]), _file(tmp_path, keys[2]))  # another block's record
    os.truncate(_file(tmp_path, keys[4]), 10 * rec + 1)  # larger than the tier: not even read
    assert d.get(keys, toks) == [None, None, None, blocks[3], None]
    s = d.stats()
    assert (s["corrupt"], s["hits"], s["misses"], s["blocks_read"], s["errors"]) == (4, 1, 4, 5, 0)
    assert s["bytes_read"] == (rec - 7) + 3 * rec + 10 * rec + 1
    # dropped: the files are gone and no longer accounted
    assert d.contains(keys) == [False, False, False, True, False] and d.used_bytes == rec
    assert sorted(p.name[:96] for p in tmp_path.rglob("*.kvb")) == [keys[3].hex()]


@pytest.mark.timeout(60)
def test_disk_entries_that_are_not_files_are_counted_misses_never_read(tmp_path):
    """What replaces a record while the engine runs need not be a file: a FIFO (opening it for
    reading blocked the tiers' thread for ever, and every request waiting on a load with it), a
    symlink to /dev/zero (read until memory ran out), a symlink to another file (its target's
    mtime was set by each touch), a directory (an I/O error at every lookup, never dropped).
    Each is a corrupt record: a counted miss, removed, written again by the next put."""
    keys, toks, blocks = _blocks(5)
    rec = encoded_size(blocks[0])
    d = DiskStore(tmp_path / "tier", 10 * rec)
    d.put(keys, blocks)
    outside = tmp_path / "outside"
    outside.write_bytes(_file(tmp_path / "tier", keys[4]).read_bytes())
    os.utime(outside, ns=(10**18, 10**18))
    paths = [_file(tmp_path / "tier", k) for k in keys[:4]]
    for p in paths:
        p.unlink()
    os.mkfifo(paths[0])
    paths[1].symlink_to("/dev/zero")
    paths[2].symlink_to(outside)
    paths[3].mkdir()
    d.touch(keys[2:3])
    assert outside.stat().st_mtime_ns == 10**18
    assert d.get(keys, toks) == [None, None, None, None, blocks[4]]
    s = d.stats()
    assert (s["corrupt"], s["hits"], s["misses"], s["errors"], s["degraded"]) == (4, 1, 4, 0, False)
    assert [os.path.lexists(p) for p in paths] == [False] * 4 and outside.read_bytes()
    assert d.contains(keys) == [False] * 4 + [True] and d.used_bytes == rec
    d.put(keys, blocks)
    assert d.get(keys, toks) == blocks and d.stats()["blocks_written"] == 9
    # a dangling symlink, unknown to a new store's index: contains says no, so only a put meets
    # it (it took it for the record, stored already: that block was a miss for good)
    paths[0].unlink()
    paths[0].symlink_to(tmp_path / "nowhere")
    d2 = DiskStore(tmp_path / "tier", 10 * rec)
    assert d2.contains(keys[:1]) == [False]
    d2.put(keys[:1], blocks[:1])
    assert not paths[0].is_symlink() and d2.get(keys[:1], toks[:1]) == blocks[:1] and d2.stats()["corrupt"] == 1


def test_disk_dir_removed_or_made_a_file_mid_run(tmp_path):
    """The directory removed while the engine runs: the next write makes it again with its
    manifest, so a restart keeps what was written since (it made ``blocks`` alone, and the next
    start took it for a corrupt index and removed every record). Replaced by a file: no call
    raises, writes fail and pause (``degraded``, where a write was taken for stored already and
    the tier never said so), and resume once the directory can be made again."""
    keys, toks, blocks = _blocks(4)
    now = [0.0]
    root = tmp_path / "tier"
    d = DiskStore(root, 1 << 20, clock=lambda: now[0], refresh_s=1e9, backoff_base_s=5.0)
    d.put(keys[:1], blocks[:1])
    shutil.rmtree(root)
    d.put(keys[1:2], blocks[1:2])
    assert d.get(keys, toks) == [None, blocks[1], None, None]
    restarted = DiskStore(root, 1 << 20)
    assert restarted.stats()["corrupt_index"] == 0 and restarted.get(keys, toks) == [None, blocks[1], None, None]
    shutil.rmtree(root)
    root.write_bytes(b"not a directory")
    d.put(keys, blocks)
    assert d.get(keys, toks) == [None] * 4
    s = d.stats()
    assert (s["degraded"], s["blocks_written"], s["skipped"], s["blocks"]) == (True, 2, 3, 0)
    root.unlink()
    d.put(keys, blocks)  # still backing off
    assert d.stats()["skipped"] == 7 and not root.exists()
    now[0] += 5.0
    d.put(keys, blocks)
    assert d.get(keys, toks) == blocks and not d.degraded
    assert DiskStore(root, 1 << 20).get(keys, toks) == blocks


def test_a_degraded_disk_tier_that_recovers_says_so_without_a_write(tmp_path):
    """``probe`` (the engine calls it when a degraded tier's stats are read): while the backoff
    runs, nothing; then one small write in the directory that ends ``degraded`` when the disk is
    back (an idle engine kept reporting the tier degraded until a block happened to be written),
    and leaves nothing a scan or a start would take for a record or a stray file."""
    keys, toks, blocks = _blocks(2)
    now = [0.0]
    root = tmp_path / "tier"
    d = DiskStore(root, 1 << 20, clock=lambda: now[0], refresh_s=1e9, backoff_base_s=5.0)
    shutil.rmtree(root)
    root.write_bytes(b"not a directory")
    d.put(keys[:1], blocks[:1])
    assert d.degraded and d.stats()["errors"] == 1
    now[0] += 5.0
    d.probe()  # the disk is still broken: another failure, a longer backoff
    assert d.degraded and d.stats()["errors"] == 2
    root.unlink()
    now[0] += 5.0
    d.probe()  # backing off still (10 s after the second failure): nothing tried
    assert d.degraded and d.stats()["errors"] == 2
    now[0] += 5.0
    d.probe()
    assert not d.degraded and d.stats()["errors"] == 2 and d.stats()["blocks_written"] == 0
    d.probe()  # not degraded: nothing
    restarted = DiskStore(root, 1 << 20)
    assert restarted.stats()["corrupt_index"] == 0 and restarted.stats()["blocks"] == 0
    d.put(keys, blocks)
    assert DiskStore(root, 1 << 20).get(keys, toks) == blocks


def test_disk_a_file_where_a_fan_out_folder_goes_is_replaced(tmp_path):
    """A file (or a symlink) at ``blocks/<xx>``: the write of a block of that folder replaces it
    with the folder (each such write failed, and every failure paused all the tier's writes)."""
    keys, toks, blocks = _blocks(3)
    now = [0.0]
    d = DiskStore(tmp_path, 1 << 20, clock=lambda: now[0])
    fans = [_file(tmp_path, k).parent for k in keys[:2]]
    fans[0].write_bytes(b"x")
    fans[1].symlink_to(tmp_path / "nowhere")
    d.put(keys, blocks)
    s = d.stats()
    assert (s["blocks_written"], s["errors"], s["skipped"], s["degraded"]) == (3, 0, 0, False)
    assert all(f.is_dir() and not f.is_symlink() for f in fans) and d.get(keys, toks) == blocks


def test_disk_unwritable_directory_is_a_clear_error(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    for bad in (afile, afile / "sub"):
        with pytest.raises(ValueError, match="disk_cache_dir .* is not a writable directory"):
            DiskStore(bad)
    with pytest.raises(ValueError, match="disk_cache_bytes"):
        DiskStore(tmp_path / "ok", -5)
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        with pytest.raises(ValueError, match="disk_cache_dir .* permission denied"):
            DiskStore(ro)
    with pytest.raises(ValueError, match="disk_cache_dir"):
        make_stores(disk_cache_dir=afile)


def test_disk_corrupt_index_means_an_empty_tier(tmp_path):
    keys, toks, blocks = _blocks(3)
    DiskStore(tmp_path).put(keys, blocks)
    manifest = tmp_path / files.MANIFEST
    assert json.loads(manifest.read_text()) == {"format": "radixkv-kv-tier", "version": 1, "fanout": 256}
    for damage in (b"{not json", b'{"format": "radixkv-kv-tier", "version": 99, "fanout": 256}', None):
        DiskStore(tmp_path).put(keys, blocks)
        if damage is None:
            manifest.unlink()  # blocks without their manifest
        else:
            manifest.write_bytes(damage)
        d = DiskStore(tmp_path)
        assert d.stats()["corrupt_index"] == 1 and d.used_bytes == 0 and d.contains(keys) == [False] * 3
        assert list(tmp_path.rglob("*.kvb")) == [] and json.loads(manifest.read_text())["version"] == 1
        d.put(keys, blocks)
        assert d.get(keys, toks) == blocks
    # blocks/ replaced by a file, and stray entries: an empty tier, then working
    shutil.rmtree(tmp_path / files.BLOCKS)
    (tmp_path / files.BLOCKS).write_text("garbage")
    d = DiskStore(tmp_path)
    assert d.stats()["corrupt_index"] == 1 and d.used_bytes == 0
    d.put(keys, blocks)
    fan = _file(tmp_path, keys[0]).parent
    (fan / "notes.txt").write_text("x")
    (fan / ("0" * 96 + ".kvb")).write_bytes(b"in the wrong fan-out folder")
    (tmp_path / files.BLOCKS / "zz").write_text("not a folder")
    d2 = DiskStore(tmp_path)
    assert d2.stats()["corrupt_index"] == 0 and d2.stats()["blocks"] == 3 and d2.get(keys, toks) == blocks


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fifo", "directory", "symlink"])
def test_disk_a_manifest_that_is_no_file_is_a_corrupt_index(tmp_path, kind):
    """The manifest replaced by a FIFO (opening it hung the engine's start for ever), an empty
    directory (the rewrite failed: a ValueError where a corrupt index starts empty) or a symlink
    to /dev/zero: a corrupt index, the tier starts empty with a manifest of its own."""
    keys, toks, blocks = _blocks(2)
    DiskStore(tmp_path).put(keys, blocks)
    manifest = tmp_path / files.MANIFEST
    manifest.unlink()
    {
        "fifo": lambda: os.mkfifo(manifest),
        "directory": manifest.mkdir,
        "symlink": lambda: manifest.symlink_to("/dev/zero"),
    }[kind]()
    d = DiskStore(tmp_path)
    assert d.stats()["corrupt_index"] == 1 and d.used_bytes == 0 and d.contains(keys) == [False] * 2
    assert not manifest.is_symlink() and json.loads(manifest.read_text())["version"] == 1
    d.put(keys, blocks)
    assert DiskStore(tmp_path).get(keys, toks) == blocks


def test_disk_never_removes_another_programs_files(tmp_path):
    """A directory with a ``blocks`` but no manifest whose content no tier writes (another
    program's, or a mistyped ``--disk-cache-dir``) is refused, and nothing in it is removed; one
    holding only a tier's records and temporary files is a tier that lost its manifest: emptied."""
    for make in (
        lambda b: (b / "ab").mkdir(parents=True) or (b / "ab" / "notes.txt").write_text("mine"),
        lambda b: b.mkdir() or (b / "readme").write_text("mine"),
        lambda b: (b / "v1").mkdir(parents=True),
        lambda b: b.write_text("mine"),
    ):
        root = tmp_path / f"user{len(list(tmp_path.iterdir()))}"
        root.mkdir()
        make(root / files.BLOCKS)
        before = sorted((p.relative_to(root), p.is_file() and p.read_text()) for p in root.rglob("*"))
        with pytest.raises(ValueError, match=r"disk_cache_dir .* is not a KV tier's directory: it has no "):
            DiskStore(root)
        assert sorted((p.relative_to(root), p.is_file() and p.read_text()) for p in root.rglob("*")) == before
    keys, toks, blocks = _blocks(2)
    root = tmp_path / "tier"
    DiskStore(root).put(keys, blocks)
    fan = _file(root, keys[0]).parent
    (fan / f".{keys[0].hex()}.123.abcd.tmp").write_bytes(b"a crashed writer's")
    (root / files.MANIFEST).unlink()
    d = DiskStore(root)
    assert d.stats()["corrupt_index"] == 1 and d.contains(keys) == [False, False]
    assert list(root.rglob("*.kvb")) == [] and list(root.rglob("*.tmp")) == []


def test_disk_dir_expands_the_users_home(tmp_path, monkeypatch):
    """``disk_cache_dir="~/kv"`` (``--disk-cache-dir=~/kv``, which the shell leaves as it is) is
    the home's ``kv``, where the engine's start-up check created it too, not a ``~`` folder in the
    working directory."""
    from types import SimpleNamespace

    from radixkv.engine.tiers import check_settings

    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    check_settings(SimpleNamespace(remote_cache_url=None, disk_cache_dir="~/kv"))
    keys, toks, blocks = _blocks(1)
    d = DiskStore("~/kv")
    d.put(keys, blocks)
    assert d.path == str(home / "kv") and _file(home / "kv", keys[0]).is_file()
    assert list(cwd.iterdir()) == [] and DiskStore(home / "kv").get(keys, toks) == blocks


def test_disk_sees_another_stores_writes_and_uses(tmp_path):
    keys, toks, blocks = _blocks(4)
    rec = encoded_size(blocks[0])
    a = DiskStore(tmp_path, 3 * rec)
    b = DiskStore(tmp_path, 3 * rec)
    b.put(keys[:1], blocks[:1])
    assert a.contains(keys[:1]) == [True] and a.get(keys[:1], toks[:1]) == blocks[:1]
    a.put(keys[1:3], blocks[1:3])
    assert a.used_bytes == 3 * rec
    b.refresh()
    assert b.used_bytes == 3 * rec and b.stats()["blocks"] == 3
    # b uses block 1 (its mtime moves); a's index still has 0 then 1 oldest; a evicts 0, keeps 1 ...
    assert b.get(keys[1:2], toks[1:2]) == blocks[1:2]
    a.get(keys[0:1], toks[0:1])  # ... after it used 0 itself: 1 looks oldest to a but b used it since
    a.put(keys[3:], blocks[3:])
    assert a.contains(keys) == [True, True, False, True]
    b.put(keys[2:3], blocks[2:3])  # written again by b: a refresh sees it
    a.refresh()
    assert a.used_bytes == 4 * rec  # the shared directory holds 4 records until the next eviction


def test_disk_two_processes_share_a_directory(tmp_path):
    size, n_seqs, per_seq = 4096, 48, 4
    keys, toks, blocks = _blocks(1, size)
    rec = encoded_size(blocks[0])
    capacity = 60 * rec  # fewer than the 192 blocks written: both processes evict meanwhile
    res = run_two_processes(
        "disk_worker", lambda w, barrier: (str(tmp_path), capacity, w, n_seqs, per_seq, size, barrier)
    )
    for r in res:
        assert r["wrong"] == [] and r["stats"]["corrupt"] == 0 and r["stats"]["errors"] == 0
        assert r["stats"]["hits"] > 0 and r["stats"]["blocks_written"] > 0 and r["stats"]["evicted"] > 0
    d = DiskStore(tmp_path, capacity)
    found = 0
    for s in range(n_seqs):
        ks, ts = keys_and_tokens(per_seq, seed=s)
        for k, t, b in zip(ks, ts, d.get(ks, ts)):
            if b is not None:
                found += 1
                assert b.tokens == t and bytes(b.payload) == payload_for(k, t, size)
    assert d.stats()["corrupt"] == 0 and found == d.stats()["blocks"] > 0
    # a process sees the other's writes at its next rescan (here: every put of per_seq blocks),
    # so the directory may exceed the capacity by the blocks of one put from each
    assert d.used_bytes <= capacity + 2 * per_seq * rec
    assert [p for p in tmp_path.rglob("*.tmp")] == []


def test_stores_are_thread_safe(tmp_path):
    import random
    import threading

    keys, toks, blocks = _blocks(24, size=2048)
    host = HostStore(10 * block_nbytes(blocks[0]))
    disk = DiskStore(tmp_path, 10 * encoded_size(blocks[0]), refresh_s=0.0)
    wrong, errors = [], []

    def work(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(300):
                i = rng.randrange(24)
                for store in (host, disk):
                    if rng.random() < 0.5:
                        store.put([keys[i]], [blocks[i]])
                    else:
                        got = store.get([keys[i]], [toks[i]])[0]
                        if got is not None and got != blocks[i]:
                            wrong.append(i)
                    store.stats()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and wrong == []
    held = [i for i, c in enumerate(host.contains(keys)) if c]
    assert host.used_bytes == len(held) * block_nbytes(blocks[0]) <= host.capacity_bytes
    on_disk = sum(f.stat().st_size for f in tmp_path.rglob("*.kvb"))
    assert disk.used_bytes == on_disk <= disk.capacity_bytes and disk.stats()["corrupt"] == 0
    assert disk.stats()["blocks"] == len(list(tmp_path.rglob("*.kvb")))


_FULL_DISK_CHILD = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, sys.argv[2])
    from tier_helpers import keys_and_tokens, make_block
    from radixkv.tiers import DiskStore
    now = [0.0]
    d = DiskStore(sys.argv[1], 1 << 30, clock=lambda: now[0], refresh_s=1e9, backoff_base_s=5.0)
    keys, toks = keys_and_tokens(40, seed=3)
    blocks = [make_block(k, t, 16384) for k, t in zip(keys, toks)]
    for k, b in zip(keys, blocks):
        d.put([k], [b])            # the 256 KiB tmpfs fills after a dozen records
    full = d.stats()
    got = d.get(keys, toks)
    ok = all(g is None or g == b for g, b in zip(got, blocks)) and sum(g is not None for g in got) == full["blocks_written"]
    d.delete_all()
    d.put(keys[-1:], blocks[-1:])  # still backing off: skipped
    now[0] = 5.0
    d.put(keys[-1:], blocks[-1:])  # the backoff passed and there is room again
    print(json.dumps({"full": full, "after": d.stats(), "reads_ok": ok}))
    """
)


def _in_mount_namespace(mnt: str) -> list[str] | None:
    """``unshare`` arguments that run a command in a private mount namespace where it may mount a
    tmpfs on ``mnt``, or None when this machine does not allow it."""
    if sys.platform != "linux" or shutil.which("unshare") is None:
        return None
    cmd = ["unshare", "-m"] if os.geteuid() == 0 else ["unshare", "-rm"]
    probe = subprocess.run([*cmd, "sh", "-c", 'mount -t tmpfs -o size=64k tmpfs "$0"', mnt], capture_output=True)
    return cmd if probe.returncode == 0 else None


def test_disk_full_never_fails_a_put():
    mnt = tempfile.mkdtemp(prefix="radixkv-full-")
    try:
        cmd = _in_mount_namespace(mnt)
        if cmd is None:
            pytest.skip("needs unshare and a tmpfs mount in a private mount namespace (a real full disk)")
        script = f'mount -t tmpfs -o size=256k tmpfs "$0" && exec "{sys.executable}" -c "$1" "$0/tier" "$2"'
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        r = subprocess.run(
            [*cmd, "sh", "-c", script, mnt, _FULL_DISK_CHILD, str(ROOT / "tests")],
            capture_output=True,
            text=True,
            env=env,
        )
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
    finally:
        os.rmdir(mnt)
    full, after = out["full"], out["after"]
    written = full["blocks_written"]
    assert 5 <= written < 40 and full["full"] == 1 and full["errors"] == 1 and full["degraded"] is True
    assert full["skipped"] == 40 - written - 1  # writes pause for the backoff after the failure
    assert out["reads_ok"] and "disk tier" in r.stderr and "No space left on device" in r.stderr
    assert (after["skipped"], after["blocks_written"], after["degraded"], after["blocks"]) == (
        full["skipped"] + 1,
        written + 1,
        False,
        1,
    )


# --- the stores against an oracle --------------------------------------------------------------


class _LRUOracle:
    def __init__(self, capacity: int) -> None:
        self.capacity, self.order = capacity, {}

    def put(self, name, size) -> None:
        if name in self.order:
            self.order[name] = self.order.pop(name)
            return
        if size > self.capacity:
            return
        while sum(self.order.values()) + size > self.capacity:
            del self.order[next(iter(self.order))]
        self.order[name] = size

    def touch(self, name) -> None:
        if name in self.order:
            self.order[name] = self.order.pop(name)


class StoresMachine(RuleBasedStateMachine):
    """A host and a disk store against an LRU oracle of exact sizes: puts, gets, corrupted files,
    restarts of the disk store."""

    N = 8

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="radixkv-tiers-sm-")
        self.keys, self.toks = keys_and_tokens(self.N, seed=11)
        self.sizes = [1000 + 700 * (i % 4) for i in range(self.N)]
        self.blocks = [make_block(k, t, s) for k, t, s in zip(self.keys, self.toks, self.sizes)]
        cap_disk = 3 * encoded_size(self.blocks[-1]) + 500
        cap_host = 3 * block_nbytes(self.blocks[-1]) + 500
        self.host, self.disk = HostStore(cap_host), DiskStore(self.dir, cap_disk)
        self.oh, self.od = _LRUOracle(cap_host), _LRUOracle(cap_disk)

    def teardown(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    @rule(i=st.integers(0, N - 1))
    def put(self, i):
        self.host.put([self.keys[i]], [self.blocks[i]])
        self.disk.put([self.keys[i]], [self.blocks[i]])
        self.oh.put(i, block_nbytes(self.blocks[i]))
        self.od.put(i, encoded_size(self.blocks[i]))

    @rule(i=st.integers(0, N - 1))
    def get(self, i):
        for store, oracle in ((self.host, self.oh), (self.disk, self.od)):
            got = store.get([self.keys[i]], [self.toks[i]])[0]
            assert (got == self.blocks[i]) if i in oracle.order else got is None
            oracle.touch(i)

    @precondition(lambda self: self.od.order)
    @rule(data=st.data())
    def corrupt_file(self, data):
        i = data.draw(st.sampled_from(sorted(self.od.order)))
        p = _file(Path(self.dir), self.keys[i])
        raw = bytearray(p.read_bytes())
        raw[data.draw(st.integers(0, len(raw) - 1))] ^= 0x10
        p.write_bytes(bytes(raw))
        assert self.disk.get([self.keys[i]], [self.toks[i]]) == [None]
        del self.od.order[i]

    @rule()
    def restart_disk(self):
        self.disk.close()
        self.disk = DiskStore(self.dir, self.od.capacity)

    @invariant()
    def accounting(self):
        for store, oracle in ((self.host, self.oh), (self.disk, self.od)):
            assert store.used_bytes == sum(oracle.order.values())
            assert store.contains(self.keys) == [i in oracle.order for i in range(self.N)]


StoresMachine.TestCase.settings = settings(
    max_examples=25, stateful_step_count=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_stores_against_lru_oracle = StoresMachine.TestCase


def test_disk_records_are_the_servers_users_alone(tmp_path):
    """A record holds a tenant's prompt token ids in the clear (and K/V that gives them back):
    the directories the tier makes are 0700 and every file in them 0600, whatever the umask
    (before: 0755 and 0644 under the usual 022, so every local user of the machine read every
    tenant's prompts from ``--disk-cache-dir``; only the manifest was 0600), also when it makes
    them again after someone removed them. A directory the operator made keeps its mode."""
    keys, toks, blocks = _blocks(3)
    root = tmp_path / "tier"
    old = os.umask(0o022)
    try:
        d = DiskStore(root, 1 << 20)
        d.put(keys[:2], blocks[:2])
        shutil.rmtree(root / "blocks")
        d.put(keys[2:], blocks[2:])
        assert d.get(keys, toks) == [None, None, blocks[2]]
        made = tmp_path / "made"
        made.mkdir(mode=0o750)
        DiskStore(made, 1 << 20).put(keys[:1], blocks[:1])
    finally:
        os.umask(old)
    modes = {p.relative_to(tmp_path).as_posix(): p.stat().st_mode & 0o777 for p in [root, *root.rglob("*")]}
    assert len([p for p in modes if p.endswith(".kvb")]) == 1 and len(modes) == 5, modes
    assert {p: m for p, m in modes.items() if m != (0o700 if (tmp_path / p).is_dir() else 0o600)} == {}
    assert made.stat().st_mode & 0o777 == 0o750
    assert {p.stat().st_mode & 0o777 for p in made.rglob("*")} == {0o700, 0o600}
