"""Reporting checked against ground truth computed independently: per-request cached tokens
against an oracle of what the tree holds, the engine's totals against the sums of the outputs,
the snapshots a stream returns, ``usage`` and ``/metrics`` through a real server (n > 1,
aborts, refused requests, flushes), and the Prometheus exposition parsed by prometheus_client.
"""

from __future__ import annotations

import pytest
from model_helpers import tiny_loaded_model

from radixkv import LLM, SamplingParams

pytestmark = pytest.mark.timeout(600)

RADIX = {"method": "radix", "num_speculative_tokens": 5}


@pytest.fixture(scope="module")
def tiny():
    return tiny_loaded_model()


def test_a_streamed_snapshot_keeps_its_own_metrics(tiny):
    """Every step's RequestOutput is a snapshot: its metrics (spec counts, finish time) stay what
    they were when it was returned (they were the group's live object: an early snapshot showed
    the final spec_accepted_tokens and a finished_time while unfinished)."""
    llm = LLM(loaded_model=tiny, device="cpu", attention_backend="cpu", speculative_config=RADIX)
    prompt = list(range(200, 260))
    params = SamplingParams(temperature=0, max_tokens=30)
    llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)  # drafts for the repeat
    eng = llm.engine
    eng.add_request(prompt, params)
    seen = []  # (snapshot, its accepted tokens and finish time when returned)
    while not (seen and seen[-1][0].finished):
        for o in eng.step():
            seen.append((o, o.metrics.spec_accepted_tokens, o.metrics.finished_time))
    assert len(seen) >= 3 and seen[-1][1] > seen[0][1]  # several snapshots, drafts accepted
    for o, accepted, finished_time in seen:
        assert (o.metrics.spec_accepted_tokens, o.metrics.finished_time) == (accepted, finished_time)
        assert (finished_time is None) == (not o.finished)
    assert len({id(o.metrics) for o, _, _ in seen}) == len(seen)
