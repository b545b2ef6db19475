"""The engine core under combined pressure (issue: break the core): a tiny pool against n > 1
pins, chunked prefill, speculative drafts, KV tiers, session pins, aborts and flushes at once.

The model is tests/tier_fakes.KVRunner (a real KV pool whose every position's K/V encodes its
token, position and prefix hash; a forward checks each position it reads), so a slot read for
the wrong token or prefix fails the run, and greedy outputs must equal its reference exactly.

* Livelocks between hard pins (the samples ``1 .. n-1`` of an ``n > 1`` request waiting on their
  shared prompt) and the one request that could run: a partly prefilled request whose next chunk
  only fits without those pins, and an idle engine whose next waiting request only fits without
  them. Both used to step forever with nothing to run (``step()`` returned nothing,
  ``has_unfinished_requests()`` stayed True).
"""

from __future__ import annotations

import pytest
from tier_fakes import kv_engine, reference, run_all

from radixkv.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(300)


def greedy(max_tokens, n=1):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, n=n, ignore_eos=True)


def assert_idle_and_empty(eng):
    """Nothing locked, pinned or held once idle; every slot free after a flush."""
    s = eng.cache_stats()
    assert (s.protected, s.pinned) == (0, 0)
    assert s.free + s.evictable == s.capacity
    assert eng.reset_prefix_cache()
    assert eng.cache_stats().free == s.capacity


A = list(range(1, 41))
B = [(i * 7) % 60 + 1 for i in range(2, 42)]


@pytest.mark.parametrize("cache", ["radix", "none"])
def test_a_chunked_prefill_short_of_memory_for_waiting_samples_pins_finishes(cache):
    """A (n=2, 40 tokens) and C (40 tokens) in one step, C's first chunk beside A's prompt; A's
    sample 0 ends at its first token, sample 1 waits on the pinned prompt (39 slots: locked in
    the cache, or the pin's own without one). C, alone running, needs more than the pool has
    beside that pin: the pin gives way and every sample ends with the reference's tokens."""
    eng = kv_engine(64, 1, chunk=48, cache=cache)
    a = eng.add_request(A, greedy(1, n=2))
    c = eng.add_request(B, greedy(1))
    done = run_all(eng, max_steps=50)
    assert [o.token_ids for o in done[a].outputs] == [reference(A, 1)] * 2
    assert done[c].outputs[0].token_ids == reference(B, 1)
    assert_idle_and_empty(eng)


def test_an_idle_engine_whose_next_request_needs_the_waiting_samples_pins_admits_it():
    """Two n=2 requests fork (their samples 1 wait on 39 + 39 pinned slots of 128), then a
    prompt continuing A's by 50 tokens, first in lpm order (its cached prefix is the longest),
    that does not fit beside both pins while nothing runs: it is admitted all the same."""
    eng = kv_engine(128, 1, chunk=128)
    a = eng.add_request(A, greedy(1, n=2))
    b = eng.add_request(B, greedy(1, n=2))
    eng.step()
    assert eng.cache_stats().pinned == 78
    x = eng.add_request(A + [5] * 50, greedy(1))
    done = run_all(eng, max_steps=50)
    assert [o.token_ids for o in done[a].outputs] == [reference(A, 1)] * 2
    assert [o.token_ids for o in done[b].outputs] == [reference(B, 1)] * 2
    assert done[x].outputs[0].token_ids == reference(A + [5] * 50, 1)
    assert_idle_and_empty(eng)


def test_waiting_samples_hard_pin_does_not_count_against_the_session_pin_bound():
    """``max_pinned_tokens`` bounds what sessions pin: a session's 20 pinned tokens (bound 50)
    stay pinned while an ``n = 2`` request's sample 1 waits on its 59 pinned prompt tokens (at
    page_size 16 its pin lasts while it decodes). It used to be dropped (its context evictable,
    ``dropped_pins`` 1) as soon as the hard pin made the total pass the bound."""
    eng = kv_engine(256, 16, chunk=128, max_pinned_tokens=50)
    ctx = [(i * 5) % 60 + 1 for i in range(33)]
    eng.add_request(ctx, greedy(1))
    run_all(eng)
    pin = eng.pin_prefix(ctx)
    assert (pin.live, len(pin)) == (True, 32)
    a = eng.add_request(A + B[:20], greedy(4, n=2))
    pinned, done = [], {}
    while eng.has_unfinished_requests():
        done.update((o.request_id, o) for o in eng.step() if o.finished)
        eng.check_integrity()
        pinned.append(eng.cache_stats().pinned)
    assert max(pinned) == 32 + 48  # the session's 32 and sample 1's pin of 48 at once
    assert pin.live and eng.kv.dropped_pins == 0
    assert [o.token_ids for o in done[a].outputs] == [reference(A + B[:20], 4)] * 2
    eng.release_pin(pin)
    assert_idle_and_empty(eng)
