"""ENGINE-SIDE REDIS TESTS of the KV tiers (issue 36), kept apart until the merge: they join
tests/test_tiers_redis.py (the stores helper's module, one ``redis_server`` per module) there.

A real ``redis-server`` (conftest's ``redis_server`` fixture: a free 127.0.0.1 port, its own temp
dir, ``.kill()`` / ``.start()``). Two processes share one Redis on the default model: a
conversation's next turn sent to the other process reuses exactly the whole blocks the first one
wrote (this test process writes, a subprocess reads). Redis going down mid-run never fails a
request: a miss, counted, the tier degraded; back up (empty: no persistence), it stores and serves
again after its backoff (a store on a fake clock, so no test waits for time). Namespaces: another namespace never reads a block.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from tier_fakes import VOCAB, kv_engine, pool_holds_its_tokens, reference, run_all

from radixkv import LLM, SamplingParams
from radixkv.tiers import RedisStore

pytestmark = pytest.mark.timeout(600)

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
    # process A cached prompt + reply[:-1]: its whole blocks went to Redis (write-through)
    want = min((len(turn1) + len(reply) - 1) // 16, (len(turn2) - 1) // 16) * 16
    assert got["cached"] == want and got["by"] == {"device": 0, "host": 0, "disk": 0, "remote": want}
    assert want / len(turn2) > 0.8


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _prompt(seed, n):
    rng = random.Random(seed)
    return [rng.randrange(1, VOCAB) for _ in range(n)]


def test_redis_down_is_a_miss_and_back_up_it_serves_again(redis_server):
    clock = _Clock()
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
    clock.t += 2.0  # past the backoff: the next call reconnects (to an empty server: no persistence)
    rid = e.add_request(p, params)
    assert run_all(e)[rid].num_cached_tokens == 0
    assert e.kv.tiers.drain(60) and e.reset_prefix_cache()
    rid = e.add_request(p, params)
    out = run_all(e)[rid]
    assert out.cached_tokens_by_tier["remote"] == 96 and out.outputs[0].token_ids == reference(p, 4)
    assert e.cache_stats().tiers["remote"]["degraded"] is False
    pool_holds_its_tokens(e)
    e.close()


def test_namespaces_are_isolated_in_redis(redis_server):
    e = kv_engine(stores=[RedisStore(redis_server.url)])
    p = _prompt(2, 80)
    params = SamplingParams(temperature=0.0, max_tokens=2)
    e.add_request(p, params, namespace="tenant-a")
    run_all(e)
    assert e.kv.tiers.drain(60)
    other = kv_engine(stores=[RedisStore(redis_server.url)])  # another engine, same Redis
    rid = other.add_request(p, params, namespace="tenant-b")
    assert run_all(other)[rid].num_cached_tokens == 0
    rid = other.add_request(p, params, namespace="tenant-a")
    assert run_all(other)[rid].cached_tokens_by_tier["remote"] == 64
    e.close()
    other.close()
