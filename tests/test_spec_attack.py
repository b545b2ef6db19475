"""Speculative decoding under attack (engine level): memory pressure against pins and chunked
prefills, aborts and cancels in the middle of drafting, failures inside a verify round, and the
config at its bounds. Fast: the fake runner of test_spec_decode (page-table reading, next token a
hash of the last three) and the tiny random Llama."""

from __future__ import annotations

import pytest
from test_spec_decode import NGRAM, fake_engine, greedy, local_reference

from radixkv.engine import StepFinished

pytestmark = pytest.mark.timeout(300)


def _cycle(n: int) -> list:
    """``n`` tokens from the fake model's own periodic trajectory: prompt lookup drafts them right."""
    return local_reference([1, 2, 3], 200 + n)[200:]


def _pin_and_chunks(spec):
    """A soft pin, a decoding request ``a`` and, once it decodes, a 30-token prompt ``b`` in
    chunks of 8 on a pool of 87 slots (tight at ``b``'s last chunk). Returns (requests holding
    tentative draft slots at each pin drop, ``b``'s prefill chunks, draft tokens, outputs)."""
    eng = fake_engine(spec, capacity=87, page_size=1, chunk=8)
    cached = [1, 4, 2, 6, 5, 3, 3, 1, 6, 2, 4, 5, 5, 2, 1, 6, 3, 4, 2, 2]
    eng.add_request(cached, greedy(1))
    while eng.has_unfinished_requests():
        eng.step()
    pin = eng.pin_prefix(cached)
    assert eng.kv.pinned_size() == 20
    drops = []
    drop = eng.kv.pins.drop
    eng.kv.pins.drop = lambda p: (drops.append(len(eng.kv.drafts)), drop(p))[1]
    a = eng.add_request(_cycle(20), greedy(20))
    for _ in range(3):
        eng.step()
    b = eng.add_request(_B, greedy(2))
    steps = []
    eng.events.subscribe(lambda ev: steps.append((ev.samples, ev.extend_lens, ev.draft_lens)), (StepFinished,))
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            done[out.request_id] = out
        eng.check_integrity()
    eng.release_pin(pin)
    chunks = [e for s, lens, _ in steps for (rid, _i), e in zip(s, lens) if rid == b][:4]
    drafted = sum(sum(d) for _, _, d in steps)
    return drops, chunks, drafted, [done[a].outputs[0].token_ids, done[b].outputs[0].token_ids]


_B = [(i * 7) % 6 + 1 for i in range(30)]


def test_a_draft_never_costs_a_soft_pin_or_a_running_chunked_prefill():
    """A decoding request's tentative draft slots were reserved before the running chunked
    prefill's next chunk, so on a tight pool the chunk's ``yield_pins`` dropped a session's soft
    pin to make room (the docs promise a pin never gives way to a draft): a guess cost a pin."""
    drops, chunks, drafted, outs = _pin_and_chunks(NGRAM)
    assert outs == [local_reference(_cycle(20), 20), local_reference(_B, 2)]
    assert drafted > 0
    assert drops == [0] * len(drops), drops  # no pin dropped while a draft held slots
    # b's chunks are those without speculation (one token of b is cached: 29 = 8 + 8 + 8 + 5)
    _, chunks_off, _, _ = _pin_and_chunks(None)
    assert chunks == chunks_off == [8, 8, 8, 5]
