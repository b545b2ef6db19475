"""Features that were each tested alone, turned on together (issue: combined features).

* ``page_size > 1`` with a ``max_context_len`` that is not a multiple of it: a request whose
  sequence reaches the context's last, partial page needs a whole page of slots there (the
  allocator hands out whole pages), so the block table must have room for it; it used to be
  ``max_context_len`` wide and the engine died (``ReqToTokenPool.write: positions ... exceed
  max_context_len``) on a valid request, with or without speculative decoding.
* A seeded differential drive: an engine with everything on at once (a small pool forcing eviction
  and retraction, 16-token pages, small prefill chunks, float32 K/V, host + disk KV tiers,
  speculative decoding, namespaces, ``n > 1``, seeded sampling, logprobs, stop strings,
  ``max_tokens=1``, structured output, random aborts and flushes) against a reference engine with
  the defaults that runs each request alone: the KV manager's integrity after every step, greedy
  and seeded tokens equal to the reference's (up to near-ties of the top two logprobs: a prefix
  served from the cache was computed in another forward's shape, docs/sampling.md), cached tokens
  equal to their sum by tier, every slot free after a flush.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
from model_helpers import tiny_loaded_model

from radixkv.config import EngineConfig
from radixkv.engine import Engine
from radixkv.namespace import Namespace
from radixkv.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(300)

RADIX = {"method": "radix", "num_speculative_tokens": 5}


@pytest.fixture(scope="module")
def tiny():
    return tiny_loaded_model(seed=0)


def run_all(eng):
    """Step ``eng`` until idle, checking the KV manager's invariants after every step; the final
    outputs by request id."""
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        eng.check_integrity()
    return done


@pytest.mark.parametrize("spec", [None, RADIX])
@pytest.mark.parametrize("max_context_len", [41, 47, 50])
def test_sequences_reaching_a_partial_last_page_of_the_context(tiny, spec, max_context_len):
    """page_size 16, max_context_len not a multiple of it: prompts whose sequence ends in the last,
    partial page of the context (at the limit, decoding into it, prefilled into it) run to their
    end with the tokens of a page_size 1 engine; every slot is free afterwards."""
    rng = random.Random(max_context_len)
    loop = [rng.randrange(300, 3000) for _ in range(7)]
    prompts = [(loop * 8)[: max_context_len - k] for k in (1, 3, 9, 20)]
    params = [SamplingParams(temperature=0, max_tokens=max_context_len - len(p), ignore_eos=True) for p in prompts]

    def outputs(**kw):
        eng = Engine(
            EngineConfig(device="cpu", max_total_tokens=512, max_context_len=max_context_len, **kw), loaded_model=tiny
        )
        ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
        done = run_all(eng)
        assert eng.reset_prefix_cache()
        s = eng.cache_stats()
        assert s["free"] == s["capacity"] == 512
        return [[(c.token_ids, c.finish_reason) for c in done[i].outputs] for i in ids]

    got = outputs(page_size=16, speculative_config=spec, chunked_prefill_size=16)
    ref = outputs(page_size=1)
    assert got == ref
    assert [len(o[0][0]) for o in got] == [1, 3, 9, 20]
    assert all(o[0][1] == "length" for o in got)
