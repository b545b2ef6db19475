"""The remote KV tier against a real ``redis-server`` (one per module: the ``redis_server`` fixture
of tests/conftest.py, started on a free 127.0.0.1 port; skipped when Redis is not installed).
No mock: the faults are the server killed and restarted, memory limits set on it, and records
damaged in it. Tests that need the shared tier end to end join this module and its server.

The engine's side (the last tests): two processes share a conversation through one Redis on the
default model (a conversation's next turn sent to the other process reuses exactly the whole
blocks the first one wrote: this test process writes, a subprocess reads); Redis going down mid-run
never fails a request (a miss, counted, the tier degraded; back up, empty: no persistence, it
stores and serves again after its backoff, on a fake clock); another namespace never reads a
block."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from tier_fakes import VOCAB, kv_engine, pool_holds_its_tokens, reference, run_all
from tier_helpers import FP, FP2, keys_and_tokens, make_block, payload_for, run_two_processes

from radixkv import LLM, SamplingParams
from radixkv.namespace import Namespace
from radixkv.tiers import encoded_size, make_stores
from radixkv.tiers.remote import DEFAULT_TTL_S, RedisStore, parse_redis_url

pytestmark = pytest.mark.timeout(180)


class FakeClock:
    """The stores' backoff clock, moved by the test (no sleeping)."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def rclient(redis_server):
    import redis

    with redis.Redis.from_url(redis_server.url) as r:
        yield r


def _blocks(n: int, seed: int, size: int = 4096, fp: bytes = FP, namespace=None):
    keys, toks = keys_and_tokens(n, seed=seed, namespace=namespace, fp=fp)
    return keys, toks, [make_block(k, t, size) for k, t in zip(keys, toks)]


def _name(k) -> str:
    return f"rkv:{k.fingerprint.hex()}:{k.namespace_digest.hex()}:{k.digest.hex()}"


def test_round_trip_contains_and_exact_counters(redis_server, rclient):
    keys, toks, blocks = _blocks(3, seed=100)
    s = RedisStore(redis_server.url)
    assert s.contains(keys) == [False] * 3 and s.get(keys, toks) == [None] * 3
    s.put(keys[:2], blocks[:2])
    assert s.contains(keys) == [True, True, False]
    assert s.get(keys, toks) == [blocks[0], blocks[1], None]
    assert rclient.get(_name(keys[0])) is not None  # the documented key format
    rec = encoded_size(blocks[0])
    st = s.stats()
    assert {k: st[k] for k in ("hits", "misses", "blocks_read", "bytes_read", "blocks_written", "bytes_written")} == {
        "hits": 2,
        "misses": 4,
        "blocks_read": 2,
        "bytes_read": 2 * rec,
        "blocks_written": 2,
        "bytes_written": 2 * rec,
    }
    assert (st["corrupt"], st["errors"], st["degraded"]) == (0, 0, False)
    # another model or namespace never reads these blocks
    other_fp, _, _ = _blocks(3, seed=100, fp=FP2)
    other_ns, ns_toks, _ = _blocks(3, seed=100, namespace="tenant-b")
    assert s.get(other_fp[:2], toks[:2]) == [None, None] and s.get(other_ns[:2], ns_toks[:2]) == [None, None]
    s.close()
    s.close()
    assert s.get(keys[:1], toks[:1]) == [None]


def test_a_tail_record_round_trips_is_replaced_and_a_corrupt_one_is_a_miss(redis_server, rclient):
    """A tail (1 to 15 tokens, docs/tiers.md "How it works") under its tail digest: read back with
    any tokens (the record's returned), overwritten by the last writer, isolated by model and
    namespace, and a truncated one is a counted miss, deleted."""
    from radixkv.cache.digests import tail_digest
    from radixkv.tiers import Block, BlockKey

    keys, _, _ = _blocks(2, seed=150)
    key = BlockKey(FP, keys[0].namespace, tail_digest(keys[-1].digest))
    short, long = (Block(tuple(range(1, 1 + r)), payload_for(key, (r,), 64 * r), b"m") for r in (5, 12))
    s = RedisStore(redis_server.url)
    s.put([key], [short], replace=True)
    got = s.get([key], [None])[0]
    assert got.tokens == short.tokens and bytes(got.payload) == short.payload
    assert s.get([key], [short.tokens]) == [short] and s.get([key], [long.tokens]) == [None]  # exact: checked
    s.put([key], [short], replace=True)  # the exact check dropped it (corrupt for those tokens): again
    s.put([key], [long], replace=True)
    assert s.get([key], [None])[0].tokens == long.tokens  # the last writer wins
    s.put([key], [short], replace=True)  # the held tail starts with all its tokens: kept (one GETRANGE)
    assert s.get([key], [None])[0].tokens == long.tokens and s.stats()["blocks_written"] == 3
    other = Block((1, 2, 99), payload_for(key, (3,), 64 * 3), b"m")
    s.put([key], [other], replace=True)  # another continuation: the last writer wins
    assert s.get([key], [None])[0].tokens == other.tokens
    assert s.get([BlockKey(FP2, key.namespace, key.digest)], [None]) == [None]
    assert s.get([BlockKey(FP, b"\x01other", key.digest)], [None]) == [None]
    rclient.set(_name(key), rclient.get(_name(key))[:-3])
    before = s.stats()["corrupt"]
    assert s.get([key], [None]) == [None] and s.stats()["corrupt"] == before + 1 and not rclient.exists(_name(key))


def test_ttl_is_set_and_refreshed_by_reads(redis_server, rclient):
    """The store's TTL on a write, set again by a read. The windows are wall-clock: a key is
    shortened to 300 s (never to a few seconds, which a stalled CI machine outlives: the read
    then misses) and a TTL over 300 s is one the read set again."""
    keys, toks, blocks = _blocks(2, seed=200)
    s = RedisStore(redis_server.url, ttl_s=600)
    s.put(keys, blocks)
    assert 300 < rclient.ttl(_name(keys[0])) <= 600
    rclient.expire(_name(keys[0]), 300)
    assert s.get(keys[:1], toks[:1]) == blocks[:1]
    assert 300 < rclient.ttl(_name(keys[0])) <= 600  # GETEX refreshed it
    old_server = RedisStore(redis_server.url, ttl_s=600)
    old_server._getex = False  # what a server older than 6.2 gets: GET + EXPIRE
    rclient.expire(_name(keys[1]), 300)
    assert old_server.get(keys, toks) == blocks and 300 < rclient.ttl(_name(keys[1])) <= 600
    forever = RedisStore(redis_server.url, ttl_s=0)
    k3, t3, b3 = _blocks(1, seed=201)
    forever.put(k3, b3)
    assert rclient.ttl(_name(k3[0])) == -1 and forever.get(k3, t3) == b3
    default = RedisStore(redis_server.url)
    k4, _, b4 = _blocks(1, seed=202)
    default.put(k4, b4)
    assert default.ttl_s == DEFAULT_TTL_S == 86400 and DEFAULT_TTL_S - 600 < rclient.ttl(_name(k4[0])) <= DEFAULT_TTL_S


def test_corrupt_records_are_counted_misses_and_deleted(redis_server, rclient):
    keys, toks, blocks = _blocks(4, seed=300)
    s = RedisStore(redis_server.url)
    s.put(keys, blocks)
    good = rclient.get(_name(keys[3]))
    rclient.set(_name(keys[0]), good[:-1])  # truncated
    rclient.set(_name(keys[1]), good[:100] + bytes([good[100] ^ 1]) + good[101:])  # flipped bit (its key part)
    rclient.set(_name(keys[2]), good)  # another block's record
    assert s.get(keys, toks) == [None, None, None, blocks[3]]
    st = s.stats()
    assert (st["corrupt"], st["hits"], st["misses"], st["blocks_read"], st["errors"]) == (3, 1, 3, 4, 0)
    assert [rclient.exists(_name(k)) for k in keys] == [0, 0, 0, 1]


@pytest.mark.parametrize("ttl_s", [None, 0])
def test_a_key_of_another_type_is_a_corrupt_record_not_a_server_failure(redis_server, rclient, ttl_s):
    """A key of a block's name holding a list or a hash (another program, an operator's typo):
    that block is a counted miss and the key is unlinked; the other blocks of the same call are
    served and the tier neither errs nor backs off (it was: WRONGTYPE failed the whole call, the
    tier went degraded and paused every read for its backoff, again at each lookup of that key)."""
    keys, toks, blocks = _blocks(3, seed=330 + (ttl_s or 0))
    s = RedisStore(redis_server.url, ttl_s=ttl_s, clock=FakeClock())
    s.put(keys, blocks)
    rclient.delete(_name(keys[1]), _name(keys[2]))
    rclient.rpush(_name(keys[1]), b"not a record")
    rclient.hset(_name(keys[2]), "f", b"v")
    assert s.get(keys, toks) == [blocks[0], None, None]
    st = s.stats()
    assert (st["corrupt"], st["errors"], st["hits"], st["misses"], st["degraded"]) == (2, 0, 1, 2, False)
    assert [rclient.exists(_name(k)) for k in keys] == [1, 0, 0]
    assert s.contains(keys) == [True, False, False]  # so the engine writes them again
    s.put(keys[1:], blocks[1:])
    assert s.get(keys, toks) == blocks and s.stats()["errors"] == 0


def test_server_killed_then_restarted_misses_then_recovers(redis_server):
    keys, toks, blocks = _blocks(2, seed=400)
    clock = FakeClock()
    s = RedisStore(redis_server.url, clock=clock, backoff_base_s=2.0, backoff_max_s=8.0)
    s.put(keys[:1], blocks[:1])
    assert s.get(keys[:1], toks[:1]) == blocks[:1] and not s.degraded
    redis_server.kill()
    try:
        assert s.get(keys, toks) == [None, None]  # one attempt: fails, counted
        assert s.degraded and s.stats()["errors"] == 1
        s.put(keys, blocks)  # backing off: nothing tried
        assert s.contains(keys) == [False, False] and s.get(keys, toks) == [None, None]
        s.delete_all()
        st = s.stats()
        assert (st["errors"], st["skipped"], st["misses"], st["degraded"]) == (1, 2, 4, True)
        clock.t += 2.0  # the backoff passed: one more attempt fails, the delay doubles to 4 s
        assert s.get(keys[:1], toks[:1]) == [None] and s.stats()["errors"] == 2
        clock.t += 2.0
        assert s.get(keys[:1], toks[:1]) == [None] and s.stats()["errors"] == 2  # still backing off
    finally:
        redis_server.start()
    assert s.get(keys[:1], toks[:1]) == [None] and s.degraded  # recovers only after the backoff
    clock.t += 2.0
    assert s.get(keys[:1], toks[:1]) == [None]  # reconnected: the restarted server is empty
    assert not s.degraded and s.stats()["errors"] == 2
    s.put(keys, blocks)
    assert s.get(keys, toks) == blocks


def test_url_timeouts_reach_the_client():
    """``?socket_timeout=`` / ``?socket_connect_timeout=`` replace ``timeout_s`` (2 s before, whatever
    the URL said: a URL option was refused). A listener that never answers: the start is a miss."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)  # accepts the connection, never answers a command
        port = sock.getsockname()[1]
        s = RedisStore(f"redis://127.0.0.1:{port}/0?socket_timeout=0.2", timeout_s=30.0)
        assert s.degraded and s.stats()["errors"] == 1
        kw = s._redis.connection_pool.connection_kwargs
        assert (kw["socket_timeout"], kw["socket_connect_timeout"]) == (0.2, 0.2)
        s.close()
    s = RedisStore(f"redis://127.0.0.1:{port}/0?socket_connect_timeout=0.5", timeout_s=7.0)
    kw = s._redis.connection_pool.connection_kwargs
    assert (kw["socket_timeout"], kw["socket_connect_timeout"]) == (7.0, 0.5)
    s.close()


def test_unreachable_at_start_is_degraded_not_an_error(redis_server):
    import socket

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    keys, toks, blocks = _blocks(1, seed=500)
    s = RedisStore(f"redis://127.0.0.1:{port}/0", timeout_s=1.0)
    assert s.degraded and s.stats()["errors"] == 1
    s.put(keys, blocks)
    assert s.get(keys, toks) == [None] and s.stats()["skipped"] == 1


@pytest.mark.parametrize(
    "url, why",
    [
        ("http://localhost:6379/0", "scheme 'http'"),
        ("localhost:6379", "scheme 'localhost'"),
        ("redis://", "no host"),
        ("redis://:pw@:6379/0", "no host"),
        ("redis://localhost:99999/0", "Port out of range"),
        ("redis://localhost:0/0", "port 0 is not 1 to 65535"),
        ("redis://localhost:port/0", "Port could not be cast"),
        ("redis://localhost:6379/zero", "database 'zero'"),
        ("redis://localhost:6379/0?ssl_cert_reqs=none", "not allowed"),
        ("rediss://localhost:6379/0?timeout=3", "not allowed"),
        ("redis://localhost/0#x", "fragment"),
        ("redis://localhost/0?socket_timeout=0", "socket_timeout='0' is not a number of seconds"),
        ("redis://localhost/0?socket_timeout=nan", "socket_timeout='nan'"),
        ("redis://localhost/0?socket_connect_timeout=-1", "socket_connect_timeout='-1'"),
        ("redis://localhost/0?socket_timeout=1&socket_timeout=2", "socket_timeout given twice"),
        ("redis://local host:6379/0", "host 'local host'"),
        ("redis://cache..internal/0", "host 'cache..internal'"),
        ("redis://ca$he/0", "host 'ca$he'"),
        ("", "not a URL"),
    ],
)
def test_malformed_url_is_a_clear_error(url, why):
    with pytest.raises(ValueError, match="remote_cache_url") as e:
        RedisStore(url)
    assert why in str(e.value)
    with pytest.raises(ValueError, match="remote_cache_url"):
        make_stores(remote_cache_url=url)


def test_url_forms_and_password_never_shown():
    u = parse_redis_url("redis://alice:s3cret@cache.internal:7000/3")
    assert (u.scheme, u.host, u.port, u.db, u.username, u.password) == (
        "redis",
        "cache.internal",
        7000,
        3,
        "alice",
        "s3cret",
    )
    assert "s3cret" not in repr(u) and u.redacted() == "redis://alice:***@cache.internal:7000/3"
    assert parse_redis_url("redis://localhost").port == 6379 and parse_redis_url("redis://localhost").db == 0
    assert parse_redis_url("redis://[::1]:6380/1").redacted() == "redis://[::1]:6380/1"
    assert [parse_redis_url(f"redis://{h}/0").host for h in ("10.0.0.7", "redis_1", "cache.internal.")] == [
        "10.0.0.7",
        "redis_1",
        "cache.internal.",
    ]
    t = parse_redis_url("rediss://:pw@h:6380/0?ssl_cert_reqs=none")
    assert (t.scheme, t.password, t.query) == ("rediss", "pw", (("ssl_cert_reqs", "none"),))
    o = parse_redis_url("rediss://h/0?socket_timeout=0.25&ssl_cert_reqs=none&socket_connect_timeout=3")
    assert (o.socket_timeout, o.socket_connect_timeout, o.query) == (0.25, 3.0, (("ssl_cert_reqs", "none"),))
    with pytest.raises(ValueError) as e:
        parse_redis_url("redis://u:s3cret@host:1/x")
    assert "s3cret" not in str(e.value) and "***" in str(e.value)


def test_two_processes_share_blocks(redis_server):
    size, n_seqs, per_seq = 8192, 8, 3
    res = run_two_processes("redis_worker", lambda w, barrier: (redis_server.url, w, n_seqs, per_seq, size, barrier))
    for r in res:
        # each found every block, its own and the other process's, exactly as written
        assert r["wrong"] == [] and r["found"] == n_seqs * per_seq
        assert r["stats"]["blocks_written"] == n_seqs * per_seq // 2 and r["stats"]["corrupt"] == 0
    s = RedisStore(redis_server.url)
    for seq in range(n_seqs):
        keys, toks = keys_and_tokens(per_seq, seed=seq)
        got = s.get(keys, toks)
        assert all(bytes(b.payload) == payload_for(k, t, size) for k, t, b in zip(keys, toks, got))


def test_delete_all_only_this_stores_fingerprints(redis_server, rclient):
    a = RedisStore(redis_server.url, fingerprint=FP2)
    mine, _, blocks = _blocks(3, seed=600, fp=FP2)
    theirs, ttoks, tblocks = _blocks(3, seed=600)
    a.put(mine, blocks)
    RedisStore(redis_server.url).put(theirs, tblocks)
    rclient.set("unrelated:key", b"x")
    fresh = RedisStore(redis_server.url, fingerprint=FP2)  # knows FP2 from its constructor only
    fresh.delete_all()
    assert a.contains(mine) == [False] * 3
    assert RedisStore(redis_server.url).get(theirs, ttoks) == tblocks and rclient.get("unrelated:key") == b"x"
    rclient.delete("unrelated:key")


def test_memory_policy_allkeys_lru_evicts_and_noeviction_fails_softly(redis_server, rclient):
    rclient.flushdb()
    keys, toks, blocks = _blocks(40, seed=700, size=262144)
    try:
        rclient.config_set("maxmemory", str(4 << 20))
        rclient.config_set("maxmemory-policy", "allkeys-lru")
        s = RedisStore(redis_server.url)
        for i in range(0, 40, 4):
            s.put(keys[i : i + 4], blocks[i : i + 4])
        st = s.stats()
        assert (st["blocks_written"], st["errors"], st["degraded"]) == (40, 0, False)
        got = s.get(keys, toks)
        assert 0 < sum(b is not None for b in got) < 40  # the oldest were evicted: misses, not errors
        assert all(b is None or b == blocks[i] for i, b in enumerate(got)) and s.stats()["corrupt"] == 0
        rclient.config_set("maxmemory-policy", "noeviction")
        more, _, mblocks = _blocks(40, seed=701, size=262144)
        s.put(more, mblocks)  # out of memory: counted, never raised
        st2 = s.stats()
        assert st2["errors"] == 1 and st2["degraded"] and st2["blocks_written"] < 80
    finally:
        rclient.config_set("maxmemory", "0")
        rclient.config_set("maxmemory-policy", "noeviction")
        rclient.flushdb()


def test_a_read_only_replica_pauses_writes_only(redis_server, rclient):
    """The tier's server turned into a read-only replica (a failover demoted it, or the URL names
    a replica): its writes are refused (READONLY) and pause on their own backoff while the blocks
    it holds are still read (a refused write paused every read too, and every read was refused
    anyway: GETEX sets the TTL, a write to a replica; the tier served nothing it held)."""
    from redis_fixture import _free_port

    rclient.flushdb()
    keys, toks, blocks = _blocks(4, seed=740)
    clock = FakeClock()
    s = RedisStore(redis_server.url, clock=clock, backoff_base_s=2.0, backoff_max_s=8.0)
    s.put(keys[:2], blocks[:2])
    try:
        rclient.replicaof("127.0.0.1", _free_port())  # a master that never answers: stale reads go on
        s.put(keys[2:], blocks[2:])
        st = s.stats()
        assert (st["errors"], st["degraded"], st["blocks_written"]) == (1, True, 2)
        assert s.get(keys, toks) == blocks[:2] + [None, None]  # GETEX refused there: GET
        s.touch(keys)  # write-through marks its head used: EXPIRE refused there, nothing to mark
        s.put(keys[2:], blocks[2:])
        assert s.stats()["skipped"] == 2 and s.stats()["errors"] == 1
        assert s.get(keys, toks) == blocks[:2] + [None, None]
    finally:
        rclient.replicaof("NO", "ONE")
    clock.t += 2.0
    s.put(keys[2:], blocks[2:])
    assert not s.degraded and s.get(keys, toks) == blocks
    rclient.flushdb()


def test_touch_refreshes_the_ttl_of_held_keys_only(redis_server, rclient):
    """``touch`` (write-through marks the head the pool held): the TTL of each held key back to
    the store's, a missing key left missing, nothing counted as read."""
    keys, toks, blocks = _blocks(2, seed=720)
    s = RedisStore(redis_server.url, ttl_s=1000)
    s.put(keys[:1], blocks[:1])
    rclient.expire(_name(keys[0]), 500)  # not a few seconds: a stalled CI machine would outlive it
    s.touch(keys)
    assert rclient.ttl(_name(keys[0])) > 500 and rclient.exists(_name(keys[1])) == 0
    st = s.stats()
    assert (st["blocks_read"], st["errors"], st["degraded"]) == (0, 0, False)
    assert s.get(keys, toks) == [blocks[0], None]


def test_a_server_out_of_memory_pauses_writes_only(redis_server, rclient, caplog):
    """``noeviction`` at ``maxmemory``: a refused write pauses writes on their own backoff while
    reads go on; a read's success neither ends the pause (``degraded`` stays, no write is tried
    before the backoff) nor logs a recovery (the log and ``/health`` used to flap between a failed
    write and the next successful read, every half second)."""
    rclient.flushdb()
    keys, toks, blocks = _blocks(20, seed=710, size=262144)
    clock = FakeClock()
    s = RedisStore(redis_server.url, clock=clock, backoff_base_s=2.0, backoff_max_s=8.0)
    s.put(keys[:2], blocks[:2])
    try:
        rclient.config_set("maxmemory-policy", "noeviction")
        rclient.config_set("maxmemory", str(int(rclient.info("memory")["used_memory"]) + (1 << 19)))
        s.put(keys[2:], blocks[2:])  # fills the server, then refused: out of memory
        st = s.stats()
        assert st["errors"] == 1 and st["degraded"]
        written = st["blocks_written"]
        assert 2 <= written < 20
        with caplog.at_level("WARNING", logger="radixkv.tiers.remote"):
            assert s.get(keys[:2], toks[:2]) == blocks[:2]  # reads go on
            assert s.degraded and s.stats()["errors"] == 1
            s.put(keys[2:], blocks[2:])  # writes still paused: skipped, not tried
            assert s.stats()["skipped"] == 18 and s.stats()["errors"] == 1
            clock.t += 2.0
            s.put(keys[2:], blocks[2:])  # tried again: refused, the delay doubles to 4 s
            assert s.stats()["errors"] == 2 and s.degraded
            clock.t += 2.0
            assert s.get(keys[:1], toks[:1]) == blocks[:1]
            s.put(keys[2:3], blocks[2:3])
            assert s.stats()["errors"] == 2 and s.stats()["skipped"] == 19
        assert not any("recovered" in r.getMessage() for r in caplog.records), caplog.text
        rclient.config_set("maxmemory", "0")
        clock.t += 2.0
        s.put(keys[2:], blocks[2:])  # room again: written, the tier recovers
        assert not s.degraded and s.get(keys, toks) == blocks
    finally:
        rclient.config_set("maxmemory", "0")
        rclient.config_set("maxmemory-policy", "noeviction")
        rclient.flushdb()


# ---------------------------------------------------------------- the engine over the shared tier
ROOT = Path(__file__).resolve().parents[1]

_READ = textwrap.dedent(
    """
    import json, sys
    from radixkv import LLM, SamplingParams
    llm = LLM(device="cpu", max_total_tokens=4096, remote_cache_url=sys.argv[1])
    out = llm.generate(prompt_token_ids=[json.loads(sys.argv[2])],
                       sampling_params=SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    print(json.dumps(dict(cached=out.num_cached_tokens, by=out.cached_tokens_by_tier, tokens=out.outputs[0].token_ids)))
    """
)


@pytest.mark.timeout(600)
def test_two_processes_share_a_conversation_through_redis(redis_server, default_model):
    tok = default_model.tokenizer
    turn1 = tok.encode("Tell me about the rivers of Europe and the cities along them. " * 6)
    with LLM(loaded_model=default_model, device="cpu", max_total_tokens=4096, remote_cache_url=redis_server.url) as a:
        first = a.generate(
            prompt_token_ids=[turn1], sampling_params=SamplingParams(temperature=0, max_tokens=24), use_tqdm=False
        )[0]
    reply = first.outputs[0].token_ids
    turn2 = turn1 + reply + tok.encode(" And which one is the longest?")
    r = subprocess.run(
        [sys.executable, "-c", _READ, redis_server.url, json.dumps(turn2)],
        capture_output=True,
        text=True,
        timeout=400,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    # process A cached prompt + reply[:-1]: its whole blocks and the tail after them went to Redis
    # (write-through); B reuses all of it
    want = len(turn1) + len(reply) - 1
    assert got["cached"] == want and got["by"] == {"device": 0, "host": 0, "disk": 0, "remote": want}
    assert want / len(turn2) > 0.8


def _prompt(seed, n):
    rng = random.Random(seed)
    return [rng.randrange(1, VOCAB) for _ in range(n)]


@pytest.mark.timeout(600)
def test_redis_down_is_a_miss_and_back_up_it_serves_again(redis_server):
    clock = FakeClock()
    store = RedisStore(redis_server.url, backoff_base_s=1.0, backoff_max_s=1.0, clock=clock)
    e = kv_engine(stores=[store])
    p = _prompt(1, 100)
    params = SamplingParams(temperature=0.0, max_tokens=4)
    rid = e.add_request(p, params)
    assert run_all(e)[rid].outputs[0].token_ids == reference(p, 4)
    assert e.kv.tiers.drain(60)
    assert e.reset_prefix_cache()
    redis_server.kill()
    try:
        rid = e.add_request(p, params)
        out = run_all(e)[rid]
        assert out.num_cached_tokens == 0 and out.outputs[0].token_ids == reference(p, 4)
        s = e.cache_stats().tiers["remote"]
        assert s["degraded"] is True and s["errors"] >= 1
        assert e.reset_prefix_cache()
    finally:
        redis_server.start()
    # no request uses the tier: reading the stats queues a probe (a PING on the I/O thread), which
    # waits for the backoff, then ends the degraded state (the /health of an idle replica)
    assert e.cache_stats().tiers["remote"]["degraded"] is True
    assert e.kv.tiers.drain(60) and e.cache_stats().tiers["remote"]["degraded"] is True
    clock.t += 2.0  # past the backoff: a probe reconnects (to an empty server: no persistence)
    assert e.kv.tiers.drain(60)
    e.cache_stats()  # still degraded unless the probe queued before the clock moved ran after it
    assert e.kv.tiers.drain(60) and e.cache_stats().tiers["remote"]["degraded"] is False
    rid = e.add_request(p, params)
    assert run_all(e)[rid].num_cached_tokens == 0
    assert e.kv.tiers.drain(60) and e.reset_prefix_cache()
    rid = e.add_request(p, params)
    out = run_all(e)[rid]
    assert out.cached_tokens_by_tier["remote"] == 99 and out.outputs[0].token_ids == reference(p, 4)
    assert e.cache_stats().tiers["remote"]["degraded"] is False
    pool_holds_its_tokens(e)
    e.close()


@pytest.mark.timeout(600)
def test_tenants_are_isolated_in_redis(redis_server):
    """Another engine on the same Redis serves tenant A's prompt entirely from it, and tenant B's
    identical prompt (or A's with a salt, or the same name as an extra_key) not at all: keys hold
    the namespace's stable bytes (tenant, salt, extra_key)."""
    e = kv_engine(stores=[RedisStore(redis_server.url)])
    p = _prompt(2, 80)
    params = SamplingParams(temperature=0.0, max_tokens=2)
    e.add_request(p, params, namespace=Namespace(tenant="A"))
    run_all(e)
    assert e.kv.tiers.drain(60)
    other = kv_engine(stores=[RedisStore(redis_server.url)])  # another engine, same Redis
    for ns in (Namespace(tenant="B"), Namespace(tenant="A", salt="s"), Namespace(extra_key="A")):
        rid = other.add_request(p, params, namespace=ns)
        out = run_all(other)[rid]
        assert out.num_cached_tokens == 0 and sum(out.cached_tokens_by_tier.values()) == 0, ns
    rid = other.add_request(p, params, namespace=Namespace(tenant="A"))
    out = run_all(other)[rid]
    assert out.num_cached_tokens == 79 and out.cached_tokens_by_tier["remote"] == 79  # all but its last token
    assert out.outputs[0].token_ids == reference(p, 2)
    e.close()
    other.close()


@pytest.mark.timeout(600)
def test_an_idle_async_engines_stats_reads_see_redis_come_back(redis_server):
    """The server's /health, /metrics and /cache_stats read ``AsyncLLM.cache_stats()``, a snapshot
    the engine thread publishes: with KV tiers each read also posts a refresh, whose stats queue
    the degraded tier's probe, so an engine that runs nothing reports the recovery."""
    import asyncio
    import queue

    from radixkv.async_llm import AsyncLLM

    clock = FakeClock()
    store = RedisStore(redis_server.url, backoff_base_s=1.0, backoff_max_s=1.0, clock=clock)
    engine = kv_engine(stores=[store])
    computed: queue.Queue = queue.Queue()  # every stats the engine computes, in order
    own = engine.cache_stats

    def counted(**kw):
        s = own(**kw)
        computed.put(s)
        return s

    engine.cache_stats = counted
    alm = AsyncLLM(engine=engine)
    p = _prompt(2, 40)
    params = SamplingParams(temperature=0.0, max_tokens=2)

    async def one():
        async for o in alm.generate(prompt_token_ids=p, sampling_params=params):
            last = o
        return last

    redis_server.kill()
    try:
        assert asyncio.run(one()).outputs[0].token_ids == reference(p, 2)
        assert alm.submit(lambda e: e.kv.tiers.drain(60)).result(60)
        assert alm.cache_stats().tiers["remote"]["degraded"] is True
    finally:
        redis_server.start()
    assert alm.submit(lambda e: None).result(60) is None  # every refresh posted so far has run
    assert engine.kv.tiers.drain(60)  # and the probes their stats queued (inside the backoff: no PING)
    clock.t += 2.0  # past the backoff
    assert store.stats()["degraded"] is True  # nothing has probed since
    while not computed.empty():
        computed.get_nowait()
    alm.cache_stats()  # posts a refresh: the engine thread computes the stats, which queue a probe
    assert computed.get(timeout=60).tiers["remote"]["degraded"] is True
    assert engine.kv.tiers.drain(60) and store.stats()["degraded"] is False  # the PING answered
    alm.cache_stats()  # the next read's refresh reports it
    assert computed.get(timeout=60).tiers["remote"]["degraded"] is False
    alm.shutdown()


@pytest.mark.timeout(600)
def test_a_block_of_another_layout_is_unlinked_so_a_good_one_replaces_it(redis_server):
    """A record under the right key whose layout is not the pool's (it passes the store's own
    checks) is a rejected load, unlinked from Redis: the block computed instead is written there
    (it stayed, its TTL renewed by each read, each write skipping the key it held)."""
    from radixkv.tiers import Block

    store = RedisStore(redis_server.url)
    e = kv_engine(stores=[store])
    p = _prompt(3, 40)
    params = SamplingParams(temperature=0.0, max_tokens=2)
    tiers = e.kv.tiers
    keys, toks, _, _, _ = tiers._keys(None, p, 0, 1)
    store.put(keys, [Block(toks[0], bytes(16 * tiers.layout.token_bytes), b"another layout")])
    rid = e.add_request(p, params)
    assert run_all(e)[rid].num_cached_tokens == 0
    assert e.cache_stats().tiers["remote"]["load_rejected"] == 1 and e.kv.tiers.drain(60)
    assert store.get(keys, toks)[0].meta == tiers.layout.meta  # the computed block replaced it
    assert e.reset_prefix_cache()
    rid = e.add_request(p, params)
    out = run_all(e)[rid]
    assert out.cached_tokens_by_tier["remote"] == 39 and out.outputs[0].token_ids == reference(p, 2)
    e.close()
