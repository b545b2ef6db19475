"""KV tiers on real models: greedy outputs identical with and without tiers (a tiny random model
and the default model, with blocks loaded back from host and disk), and a restart: a new process
on the same ``disk_cache_dir`` reuses exactly the whole blocks the first one computed, which wrote
them and just returned (the writes drain at interpreter exit)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from tier_fakes import tiny_model

from radixkv import LLM, SamplingParams

pytestmark = pytest.mark.timeout(900)

ROOT = Path(__file__).resolve().parents[1]


def _turns(llm, convs, params):
    """Replay ``convs`` (lists of user messages) turn by turn; the outputs of every request."""
    hist = [[] for _ in convs]
    outs = []
    for t in range(max(len(c) for c in convs)):
        active = [i for i, c in enumerate(convs) if t < len(c)]
        for i in active:
            hist[i].append({"role": "user", "content": convs[i][t]})
        res = llm.chat([hist[i] for i in active], params, use_tqdm=False)
        for i, o in zip(active, res):
            hist[i].append({"role": "assistant", "content": o.outputs[0].text})
            outs.append(o)
    return outs


def _convs(seed, n, turns, words=40):
    rng = random.Random(seed)
    vocab = "alpha beta gamma delta river stone cloud paper music orange window garden".split()
    return [[" ".join(rng.choice(vocab) for _ in range(words)) for _ in range(turns)] for _ in range(n)]


@pytest.mark.parametrize("page_size", [1, 16])
def test_tiny_model_outputs_identical_with_tiers(tmp_path, page_size):
    lm = tiny_model()
    convs = _convs(1, 4, 3)
    params = SamplingParams(temperature=0, max_tokens=12)
    plain = _turns(LLM(loaded_model=lm, device="cpu", max_total_tokens=8192, page_size=page_size), convs, params)
    # a pool far smaller than the working set: turns come back from the host tier (evicted) or disk
    tiered_llm = LLM(
        loaded_model=lm,
        device="cpu",
        max_total_tokens=384,
        page_size=page_size,
        host_cache_bytes=1 << 20,
        disk_cache_dir=str(tmp_path),
    )
    tiered = _turns(tiered_llm, convs, params)
    assert [o.outputs[0].token_ids for o in tiered] == [o.outputs[0].token_ids for o in plain]
    s = tiered_llm.cache_stats()
    assert s.cached_tokens_by_tier["host"] + s.cached_tokens_by_tier["disk"] > 0
    assert s.cached_tokens == sum(s.cached_tokens_by_tier.values())
    tiered_llm.engine.check_integrity()
    tiered_llm.close()


def test_default_model_outputs_identical_with_tiers(default_model, tmp_path):
    convs = _convs(2, 3, 3, words=30)
    params = SamplingParams(temperature=0, max_tokens=16)
    plain_llm = LLM(loaded_model=default_model, device="cpu", max_total_tokens=8192)
    plain = _turns(plain_llm, convs, params)
    llm = LLM(
        loaded_model=default_model,
        device="cpu",
        max_total_tokens=400,
        host_cache_bytes=64 << 20,
        disk_cache_dir=str(tmp_path),
    )
    tiered = _turns(llm, convs, params)
    assert [o.outputs[0].token_ids for o in tiered] == [o.outputs[0].token_ids for o in plain]
    by = llm.cache_stats().cached_tokens_by_tier
    assert by["host"] + by["disk"] > 0
    # the tiers keep what the small pool evicted: more reuse than the same small pool without
    small = _turns(LLM(loaded_model=default_model, device="cpu", max_total_tokens=400), convs, params)
    assert sum(o.num_cached_tokens for o in tiered) > sum(o.num_cached_tokens for o in small)
    llm.close()


_RESTART = textwrap.dedent(
    """
    import json, sys
    from radixkv import LLM, SamplingParams
    llm = LLM(device="cpu", max_total_tokens=4096, disk_cache_dir=sys.argv[1])
    ids = json.loads(sys.argv[2])
    out = llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(temperature=0, max_tokens=8),
                       use_tqdm=False)[0]
    print(json.dumps(dict(cached=out.num_cached_tokens, by=out.cached_tokens_by_tier, tokens=out.outputs[0].token_ids)))
    # no close(): the writes queued for the disk tier drain at interpreter exit
    """
)


def test_restart_on_the_same_disk_dir_reuses_exact_blocks(tmp_path, default_model):
    ids = default_model.tokenizer.encode("The history of the printing press, told in detail. " * 12)
    ids = ids[:150]

    def run() -> dict:
        r = subprocess.run(
            [sys.executable, "-c", _RESTART, str(tmp_path / "kv"), json.dumps(ids)],
            capture_output=True,
            text=True,
            timeout=400,
            cwd=ROOT,
        )
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    first, second = run(), run()
    assert first["cached"] == 0
    want = (len(ids) - 1) // 16 * 16  # every whole block below the last prompt token
    assert second["cached"] == want and second["by"] == {"device": 0, "host": 0, "disk": want, "remote": 0}
    assert second["tokens"] == first["tokens"]
