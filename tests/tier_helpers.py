"""Blocks, keys and worker processes shared by the KV tier tests (tests/test_tiers_*.py).

Keys are real: ``radixkv.cache.digests.block_digests`` of a deterministic token sequence in a
namespace; a block's payload is a deterministic function of its key and tokens, so any process
can check that what it read is exactly what was written for those tokens.
"""

from __future__ import annotations

import hashlib

from radixkv.cache.digests import block_digests
from radixkv.namespace import Namespace, namespace_key
from radixkv.tiers import Block, BlockKey

FP = hashlib.blake2b(b"smollm2-135m float32 kv=float32", digest_size=16).digest()
FP2 = hashlib.blake2b(b"another model", digest_size=16).digest()


def seq_tokens(n_blocks: int, seed: int = 0) -> list[int]:
    """``16 * n_blocks`` token ids of sequence ``seed``."""
    return [(seed * 7919 + i * 31) % 49152 for i in range(16 * n_blocks)]


def keys_and_tokens(n_blocks: int, seed: int = 0, namespace=None, fp: bytes = FP) -> tuple[list, list]:
    """The keys (real chained digests) and 16-token tuples of the blocks of sequence ``seed``."""
    toks = seq_tokens(n_blocks, seed)
    ns = Namespace.of(namespace)
    digests = block_digests(toks, ns, 0, n_blocks)
    keys = [BlockKey(fp, namespace_key(ns), d) for d in digests]
    return keys, [tuple(toks[16 * b : 16 * b + 16]) for b in range(n_blocks)]


def payload_for(key: BlockKey, tokens, size: int) -> bytes:
    """A deterministic ``size``-byte payload of ``key`` and ``tokens``."""
    seed = key.to_bytes() + bytes(str(tuple(tokens)), "ascii")
    return hashlib.shake_256(seed).digest(size)


def make_block(key: BlockKey, tokens, size: int = 4096, meta: bytes = b"f32 L30 H3 D64") -> Block:
    """The block every process writes for ``key`` / ``tokens``."""
    return Block(tokens=tuple(tokens), payload=payload_for(key, tokens, size), meta=meta)


def disk_worker(path: str, capacity: int, wid: int, n_seqs: int, blocks_per_seq: int, size: int, barrier) -> dict:
    """One process sharing ``path``: writes every sequence (overlapping the other workers'),
    reads them all back after the barrier; returns its stats and any wrong block it read."""
    from radixkv.tiers import DiskStore

    store = DiskStore(path, capacity, refresh_s=0.0)
    wrong = []
    order = list(range(n_seqs))[wid::2] + list(range(n_seqs))[1 - wid :: 2]
    barrier.wait()  # both start writing together
    for s in order:
        keys, toks = keys_and_tokens(blocks_per_seq, seed=s)
        store.put(keys, [make_block(k, t, size) for k, t in zip(keys, toks)])
        for k, t, b in zip(keys, toks, store.get(keys, toks)):
            if b is not None and (b.tokens != t or bytes(b.payload) != payload_for(k, t, size)):
                wrong.append((s, k.hex()))
    barrier.wait()
    for s in range(n_seqs):
        keys, toks = keys_and_tokens(blocks_per_seq, seed=s)
        for k, t, b in zip(keys, toks, store.get(keys, toks)):
            if b is not None and (b.tokens != t or bytes(b.payload) != payload_for(k, t, size)):
                wrong.append((s, k.hex()))
    return {"wrong": wrong, "stats": store.stats()}


def redis_worker(url: str, wid: int, n_seqs: int, blocks_per_seq: int, size: int, barrier) -> dict:
    """One engine process on a shared Redis: writes its half of the sequences, then (after the
    barrier) reads every sequence; returns how many blocks it found and any wrong one."""
    from radixkv.tiers import RedisStore

    store = RedisStore(url)
    for s in range(wid, n_seqs, 2):
        keys, toks = keys_and_tokens(blocks_per_seq, seed=s)
        store.put(keys, [make_block(k, t, size) for k, t in zip(keys, toks)])
    barrier.wait()
    found, wrong = 0, []
    for s in range(n_seqs):
        keys, toks = keys_and_tokens(blocks_per_seq, seed=s)
        for k, t, b in zip(keys, toks, store.get(keys, toks)):
            if b is None:
                continue
            found += 1
            if b.tokens != t or bytes(b.payload) != payload_for(k, t, size):
                wrong.append((s, k.hex()))
    stats = store.stats()
    store.close()
    return {"found": found, "wrong": wrong, "stats": stats}


def _proc_main(fn_name: str, args: tuple, results) -> None:
    results.put((args[2] if fn_name == "disk_worker" else args[1], globals()[fn_name](*args)))


def run_two_processes(fn_name: str, make_args) -> list[dict]:
    """Run ``fn_name`` (``disk_worker`` / ``redis_worker``) in two spawned processes at once;
    ``make_args(wid, barrier)`` gives each one's arguments; returns their results by worker id."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(2, timeout=120), ctx.Queue()
    procs = [ctx.Process(target=_proc_main, args=(fn_name, make_args(w, barrier), results)) for w in (0, 1)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=180) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0, p.exitcode
    return [got[0], got[1]]
