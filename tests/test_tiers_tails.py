"""Tail records of the KV tiers: the partial block (1 to 15 tokens) after a sequence's whole
16-token blocks, stored under the tail digest of the block before it and served for the prefix
its tokens share with a request's next tokens (docs/tiers.md, "How it works").

Over the real ``HostStore`` and ``DiskStore`` (Redis: tests/test_tiers_redis.py) and the fake
model of tier_fakes.KVRunner, whose forward fails on K/V loaded for other tokens, positions or
prefixes, and whose pool check (``pool_holds_its_tokens``) proves every cached slot holds exactly
the K/V computing it gives.
"""

from __future__ import annotations

import os
import random

import pytest
from tier_fakes import VOCAB, kv_engine, pool_holds_its_tokens, reference, run_all
from tier_helpers import FP, FP2, keys_and_tokens, payload_for

from radixkv.cache.digests import namespace_seed, tail_digest
from radixkv.namespace import Namespace, namespace_key
from radixkv.sampling_params import SamplingParams
from radixkv.tiers import Block, BlockKey, DiskStore, HostStore, block_nbytes, encoded_size
from radixkv.tiers import disk_files as files

pytestmark = pytest.mark.timeout(300)


def _tail(keys, tokens, r, seed=0):
    """The key of the tail after the blocks ``keys`` and an ``r``-token tail block."""
    key = BlockKey(FP, keys[0].namespace, tail_digest(keys[-1].digest))
    toks = tuple((seed * 13 + 7 * i) % 49152 for i in range(r))
    return key, Block(toks, payload_for(key, toks, 64 * r), b"meta")


@pytest.mark.parametrize("medium", ["host", "disk"])
def test_a_tail_record_round_trips_is_replaced_and_counts_in_the_budget(tmp_path, medium):
    store = HostStore(1 << 20) if medium == "host" else DiskStore(str(tmp_path), 1 << 20)
    size = block_nbytes if medium == "host" else encoded_size
    keys, toks = keys_and_tokens(2)
    key, tail = _tail(keys, toks, 5)
    store.put([key], [tail], replace=True)
    assert store.used_bytes == size(tail)
    got = store.get([key], [None])[0]  # any tokens: the record's are returned
    assert got.tokens == tail.tokens and bytes(got.payload) == bytes(tail.payload) and got.meta == b"meta"
    assert store.get([key], [tail.tokens])[0].tokens == tail.tokens  # exact tokens still checked
    _, longer = _tail(keys, toks, 12, seed=1)
    store.put([key], [longer])  # without replace: the held record stays
    assert store.get([key], [None])[0].tokens == tail.tokens
    store.put([key], [longer], replace=True)  # the last writer wins
    assert store.get([key], [None])[0].tokens == longer.tokens and store.used_bytes == size(longer)
    start = Block(longer.tokens[:7], bytes(longer.payload)[: 64 * 7], b"meta")
    store.put([key], [start], replace=True)  # the held tail starts with all its tokens: kept
    assert store.get([key], [None])[0].tokens == longer.tokens and store.used_bytes == size(longer)
    s = store.stats()
    assert (s["blocks"], s["corrupt"], s["blocks_written"]) == (1, 0, 2)
    assert store.get([BlockKey(FP2, key.namespace, key.digest)], [None]) == [None]  # another model's key
    if medium == "disk":  # a new process over the directory reads it too
        again = DiskStore(str(tmp_path), 1 << 20)
        assert again.get([key], [None])[0].tokens == longer.tokens and again.used_bytes == size(longer)


@pytest.mark.parametrize("damage", ["flip", "truncate", "tokens"])
def test_a_corrupt_or_truncated_tail_file_is_a_counted_miss(tmp_path, damage):
    store = DiskStore(str(tmp_path), 1 << 20)
    keys, toks = keys_and_tokens(1)
    key, tail = _tail(keys, toks, 9)
    store.put([key], [tail], replace=True)
    path = files.layout_path(str(tmp_path), key.hex())
    data = bytearray(open(path, "rb").read())
    if damage == "flip":
        data[len(data) // 2] ^= 1
    elif damage == "truncate":
        data = data[: len(data) - 40]
    else:
        data[56:60] = (17).to_bytes(4, "little")  # 17 token ids: no tail holds that many
    open(path, "wb").write(bytes(data))
    assert store.get([key], [None]) == [None]
    assert store.stats()["corrupt"] == 1 and not os.path.exists(path)


def greedy(n=6):
    return SamplingParams(temperature=0.0, max_tokens=n)


def prompt(seed, n):
    rng = random.Random(seed)
    return [rng.randrange(1, VOCAB) for _ in range(n)]


def generate(engine, p, n=6, namespace=None):
    rid = engine.add_request(p, greedy(n), namespace=namespace)
    out = run_all(engine)[rid]
    pool_holds_its_tokens(engine)  # every cached slot holds exactly the K/V computing it gives
    assert out.outputs[0].token_ids == reference(p, n)  # greedy output: the computed one
    return out


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_next_turn_on_a_new_engine_reuses_the_whole_previous_sequence(tmp_path, page_size):
    """Turn 2 (turn 1's prompt, its reply, a new message) on a fresh engine over turn 1's disk
    directory gets all of turn 1's cached sequence from disk: prompt + reply but its last token,
    45 + 5 tokens (3 blocks and a 2-token tail), page-floored (pages of 4: 48, no tail)."""
    p1 = prompt(1, 45)
    first = kv_engine(page_size=page_size, stores=[DiskStore(str(tmp_path))])
    reply = generate(first, p1).outputs[0].token_ids
    assert first.close()
    p2 = p1 + reply + prompt(2, 20)
    e = kv_engine(page_size=page_size, stores=[DiskStore(str(tmp_path))])
    out = generate(e, p2)
    want = (45 + 6 - 1) // page_size * page_size  # the KV of the reply's last token was never computed
    assert out.num_cached_tokens == want
    assert out.cached_tokens_by_tier == {"device": 0, "host": 0, "disk": want, "remote": 0}
    t = e.cache_stats().tiers["disk"]
    assert (t["loaded"], t["tails_loaded"], t["tail_tokens"], t["corrupt"]) == (3, int(want == 50), want - 48, 0)
    # the same turn without tiers: the same output (generate checks it against the reference)
    assert generate(kv_engine(page_size=page_size), p2).num_cached_tokens == 0


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_resent_prompt_ending_on_a_block_boundary_reuses_all_but_its_last_token(tmp_path, page_size):
    """A prompt of 32 or 48 tokens (whole blocks, no tail) sent again to a new engine over the
    first's disk directory reuses every token below its last: the last whole block, which the
    request knows all of, is loaded too and used for its first 15 tokens (page-floored); explain
    names the same span. A 33-token prompt (a 1-token tail) reuses 32."""
    for n in (32, 48, 33):
        d = str(tmp_path / f"{n}-{page_size}")
        p = prompt(40 + n, n)
        first = kv_engine(page_size=page_size, stores=[DiskStore(d)])
        generate(first, p)
        assert first.close()
        e = kv_engine(page_size=page_size, stores=[DiskStore(d)])
        want = (n - 1) // page_size * page_size
        assert e.explain(p).tier_spans == ((0, want, "disk"),), n
        out = generate(e, p)
        assert out.num_cached_tokens == want, n
        assert out.cached_tokens_by_tier == {"device": 0, "host": 0, "disk": want, "remote": 0}, n
        t = e.cache_stats().tiers["disk"]
        assert (t["loaded"], t["tails_loaded"]) == ((n - 1) // 16 + (n % 16 == 0), 0), n
        e.close()


def test_a_tail_that_diverges_serves_exactly_the_common_prefix(tmp_path):
    for c in (0, 1, 5, 12):
        d = str(tmp_path / str(c))  # NOTE: each request writes its own tail there (the last writer wins)
        p1 = prompt(3, 40)
        first = kv_engine(stores=[DiskStore(d)])
        seq = p1 + generate(first, p1).outputs[0].token_ids[:-1]  # 45 computed: 2 blocks, a 13-token tail
        assert first.close()
        nxt = (seq[32 + c] % (VOCAB - 1)) + 1  # another token than the sequence's at 32 + c
        p = seq[: 32 + c] + [nxt] + prompt(4 + c, 10)
        e = kv_engine(stores=[DiskStore(d)])
        out = generate(e, p)
        assert out.cached_tokens_by_tier["disk"] == 32 + c, c
        assert e.cache_stats().tiers["disk"]["tail_tokens"] == c
        e.close()


def test_a_corrupt_tail_is_a_miss_and_the_blocks_before_it_still_serve(tmp_path):
    p1 = prompt(5, 40)
    first = kv_engine(stores=[DiskStore(str(tmp_path))])
    generate(first, p1)
    assert first.close()
    fp = first.kv.tiers.fingerprint
    parent = first.kv.tiers._keys(None, p1, 1, 2)[2][0]  # block 1's digest
    path = files.layout_path(str(tmp_path), BlockKey(fp, namespace_key(None), tail_digest(parent)).hex())
    data = bytearray(open(path, "rb").read())
    data[-1] ^= 0x80
    open(path, "wb").write(bytes(data))
    e = kv_engine(stores=[DiskStore(str(tmp_path))])
    out = generate(e, p1)
    t = e.cache_stats().tiers["disk"]
    assert out.cached_tokens_by_tier["disk"] == 32 and (t["corrupt"], t["tails_loaded"]) == (1, 0)


def test_tails_are_isolated_by_namespace_and_model(tmp_path):
    """A 12-token prompt (14 computed with its reply) is a tail only, under the namespace's seed:
    another namespace never reads it (another model: its fingerprint is in the key, see
    test_a_tail_record_round_trips_is_replaced_and_counts_in_the_budget)."""
    p = prompt(6, 12)
    first = kv_engine(stores=[DiskStore(str(tmp_path))])
    generate(first, p, 3, namespace=Namespace(tenant="A"))
    assert first.close()
    seed = tail_digest(namespace_seed(Namespace(tenant="A")))
    assert os.path.exists(
        files.layout_path(
            str(tmp_path), BlockKey(first.kv.tiers.fingerprint, namespace_key(Namespace(tenant="A")), seed).hex()
        )
    )
    e = kv_engine(stores=[DiskStore(str(tmp_path))])
    for ns in (Namespace(tenant="B"), Namespace(tenant="A", salt="s"), None):
        assert generate(e, p, 3, namespace=ns).num_cached_tokens == 0, ns
    assert e.reset_prefix_cache()
    a = generate(e, p, 3, namespace=Namespace(tenant="A"))
    assert a.cached_tokens_by_tier["disk"] == 11 and e.cache_stats().tiers["disk"]["corrupt"] == 0


def test_explain_includes_the_tail_span(tmp_path):
    p1 = prompt(7, 40)
    first = kv_engine(stores=[DiskStore(str(tmp_path))])
    reply = generate(first, p1).outputs[0].token_ids
    assert first.close()
    e = kv_engine(stores=[DiskStore(str(tmp_path))])
    p2 = p1 + reply + prompt(8, 4)
    assert e.explain(p2).tier_spans == ((0, 45, "disk"),)
    assert e.explain(p1[:35]).tier_spans == ((0, 34, "disk"),)  # the tail, up to the last token
    assert e.cache_stats().tiers["disk"]["loaded"] == 0  # a dry run


@pytest.mark.parametrize("page_size", [1, 4])
def test_explain_tier_spans_end_where_the_load_ends_on_a_page(tmp_path, page_size):
    """A prompt that leaves a stored tail mid-page (position 38 of the tail 32..44) loads only up
    to its last page boundary (36 at page_size 4: installs are page-floored), and explain's
    tier_spans say exactly what it then takes from the tier. They used to end where the prompt
    left the tail ((0, 38) named, 36 loaded: explain over-reported what the tier would serve)."""
    p1 = prompt(7, 40)
    first = kv_engine(page_size=page_size, stores=[DiskStore(str(tmp_path))])
    reply = generate(first, p1).outputs[0].token_ids  # blocks 0..31 and a tail from 32 on
    assert first.close()
    seq = p1 + reply
    p3 = seq[:38] + [seq[38] % (VOCAB - 1) + 1] + prompt(8, 4)  # leaves the tail at 38
    e = kv_engine(page_size=page_size, stores=[DiskStore(str(tmp_path))])
    want = 38 // page_size * page_size
    assert e.explain(p3).tier_spans == ((0, want, "disk"),)
    out = generate(e, p3)
    assert out.num_cached_tokens == want and out.cached_tokens_by_tier["disk"] == want
