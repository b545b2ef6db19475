"""Speculative decoding under attack (engine level): memory pressure against pins and chunked
prefills, aborts and cancels in the middle of drafting, failures inside a verify round, and the
config at its bounds. Fast: the fake runner of test_spec_decode (page-table reading, next token a
hash of the last three) and the tiny random Llama."""

from __future__ import annotations

import asyncio

import pytest
from model_helpers import tiny_loaded_model
from pacing import paced_by_the_client
from test_spec_decode import (
    NGRAM,
    RADIX,
    _cached_paths,
    _prompts,
    both_ways,
    drive,
    fake_engine,
    greedy,
    local_reference,
    tiny_engine,
    tokens,
)

from radixkv import AsyncLLM
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


def test_a_request_failing_inside_a_verify_round_ends_alone_and_frees_its_drafts():
    """Its output processing raises on a token sampled in verify round >= 1: only it ends
    ("error"), its tentative slots are freed that step, the cache holds only verified tokens (each
    slot the K/V of its path's token), and the request beside it is exact."""
    eng = fake_engine(NGRAM, capacity=256, page_size=4)
    bad, good = _cycle(12), _cycle(14)[2:]
    a = eng.add_request(bad, greedy(30))
    b = eng.add_request(good, greedy(30))
    g, update, raised = eng._groups[a], eng._groups[a].update, []

    def update_raising(r, *args):
        if len(r.output_token_ids) == 9:
            raised.append(len(eng.kv.drafts))  # requests holding tentative slots: inside a verify
            raise RuntimeError("detokenizer broke")
        return update(r, *args)

    g.update = update_raising
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            done[out.request_id] = out
        eng.check_integrity()
        for toks, slots in _cached_paths(eng.cache):
            assert [eng.runner.kv[s] for s in slots] == [(t, i) for i, t in enumerate(toks)]
            full = [p + local_reference(p, 30) for p in (bad, good)]
            assert any(f[: len(toks)] == toks for f in full), toks
    assert raised and raised[0] > 0
    assert done[a].outputs[0].finish_reason == "error" and "detokenizer broke" in done[a].error
    assert done[a].outputs[0].token_ids == local_reference(bad, 8)
    assert done[b].outputs[0].token_ids == local_reference(good, 30)
    s = eng.cache_stats()
    assert s["free"] + s["evictable"] == s["capacity"] and s["protected"] == 0
    assert eng.num_failed_requests == 1


# ---------------------------------------------------------------------- the tiny model
@pytest.fixture(scope="module")
def tiny():
    return tiny_loaded_model(seed=0)


def test_async_cancel_mid_draft_stream_and_flush_between_requests(tiny):
    """An AsyncLLM stream drafted from the tree (every chunk several tokens) is cancelled after its
    second chunk, racing the engine thread's next verify; then a flush of the prefix cache and a
    run of the same prompt: the engine ends with every slot free or cached, no tentative slot, and
    the outputs exact."""
    prompt = _prompts()[0]
    params = greedy(48, ignore_eos=True)
    (ref,) = drive(tiny_engine(tiny, None, page_size=16), [(prompt, params)])
    eng = tiny_engine(tiny, dict(RADIX, adaptive=False), page_size=16)

    async def run():
        llm = AsyncLLM(engine=eng)
        try:
            first = await llm.generate_batch([(prompt, params, None)])
            seen = []
            agen = llm.generate({"prompt_token_ids": prompt}, params)
            # NOTE: paced, so that the second chunk comes before the end on a loaded machine (the 48
            # tokens took a few steps: a slow consumer got them all in its first chunk); let go
            # before the cancel, so the engine's next verify races it
            with paced_by_the_client(llm, lead=1) as read:
                async for out in agen:
                    seen.append(list(out.outputs[0].token_ids))
                    read()
                    if len(seen) == 2:
                        break
            await agen.aclose()
            flushed = await llm.reset_prefix_cache()
            again = await llm.generate_batch([(prompt, params, None)])
            return first[0], seen, flushed, again[0]
        finally:
            llm.shutdown()

    first, seen, flushed, again = asyncio.run(run())
    assert first.outputs[0].token_ids == ref.outputs[0].token_ids == again.outputs[0].token_ids
    assert seen[1] == ref.outputs[0].token_ids[: len(seen[1])] and len(seen[1]) > 2
    assert flushed is True
    eng.check_integrity()
    s = eng.cache_stats()
    assert s["free"] + s["evictable"] == s["capacity"] and s["protected"] == 0 and s["running"] == 0
    assert len(eng.kv.drafts) == 0


def test_a_flush_forgets_the_finished_text_the_drafter_kept(tiny):
    """``reset_prefix_cache`` emptied the pool and the tiers but not the drafter's suffix index,
    so after a flush (the way docs/security.md hands a tenant name to a new customer) a
    regeneration of the former tenant's answer was drafted from it: 32 of 40 tokens accepted
    where a fresh engine accepts 3, its timing revealing text that ran before the flush."""
    prompt = _prompts()[1]  # nothing repeats inside it: only the tree or the suffix index could draft
    params = greedy(40, ignore_eos=True)
    eng = tiny_engine(tiny, RADIX)
    eng.add_request(prompt, params, namespace="acme")
    drive(eng)
    assert eng.reset_prefix_cache(tiers=True)
    assert eng.spec.suffix.size == 0
    eng.add_request(prompt, params, namespace="acme", request_id="after")
    done = {o.request_id: o for o in _run(eng)}
    (fresh,) = drive(tiny_engine(tiny, RADIX), [(prompt, params)])
    after = done["after"]
    assert after.num_cached_tokens == 0 and after.outputs[0].token_ids == fresh.outputs[0].token_ids
    assert (after.metrics.spec_draft_tokens, after.metrics.spec_accepted_tokens) == (
        fresh.metrics.spec_draft_tokens,
        fresh.metrics.spec_accepted_tokens,
    )


def _run(eng, check=False):
    """Step until idle (``check``: the integrity check after every step); every final output."""
    outs = []
    while eng.has_unfinished_requests():
        outs += [o for o in eng.step() if o.finished]
        if check:
            eng.check_integrity()
    return outs


@pytest.mark.parametrize("where", ["_draft", "_forced_len"])
def test_a_request_whose_drafting_raises_ends_alone(monkeypatch, where):
    """Its drafting raises (as its grammar matcher may while a draft is walked through it): the
    exception went out of ``Engine.step`` and stopped every request (AsyncLLM's engine thread
    died: the server answered EngineDeadError to all); now only that request ends, with
    finish_reason "error", as when its row's sampling raises, and the others are exact."""
    from radixkv.spec.drafter import Drafter

    marked = 6
    real = getattr(Drafter, where)

    def draft(self, r, *args):
        if r.prompt_token_ids[0] == marked and len(r.output_token_ids) >= 3:
            raise RuntimeError("injected matcher fault while drafting")
        return real(self, r, *args)

    monkeypatch.setattr(Drafter, where, draft)
    eng = fake_engine(NGRAM, capacity=256, page_size=4)
    good = [p for p in (_cycle(14), _cycle(15)[1:]) if p[0] != marked]
    bad = [marked] + _cycle(12)
    ids = [eng.add_request(p, greedy(24)) for p in (good[0], bad, good[-1])]
    done = {o.request_id: o for o in _run(eng, check=True)}
    assert done[ids[1]].outputs[0].finish_reason == "error" and "injected" in done[ids[1]].error
    got = done[ids[1]].outputs[0].token_ids
    assert 3 <= len(got) < 24 and got == local_reference(bad, len(got))
    assert [done[i].outputs[0].token_ids for i in (ids[0], ids[2])] == [
        local_reference(good[0], 24),
        local_reference(good[-1], 24),
    ]
    assert eng.num_failed_requests == 1 and eng.cache_stats()["spec_accepted_tokens"] > 0
    s = eng.cache_stats()
    assert s["free"] + s["evictable"] == s["capacity"] and s["protected"] == 0


BOUNDS = {
    # every key at an end of its range: 1-token lookups, 16-token drafts, no step budget to speak of
    "k16_lookup1": dict(
        method="radix",
        num_speculative_tokens=16,
        prompt_lookup_min=1,
        prompt_lookup_max=1,
        adaptive=False,
        max_draft_tokens_per_step=1 << 20,
        suffix_index_tokens=1,
    ),
    # one draft token a step for all requests, longest lookups, the cheapest draft row
    "k1_budget1": dict(
        method="radix",
        num_speculative_tokens=1,
        prompt_lookup_min=64,
        prompt_lookup_max=256,
        draft_row_cost=1e-9,
        max_draft_tokens_per_step=1,
    ),
    "ngram_cost1": dict(method="ngram", num_speculative_tokens=16, draft_row_cost=1.0, suffix_index_tokens=0),
}


@pytest.mark.parametrize("name", sorted(BOUNDS))
def test_config_at_its_bounds_keeps_outputs_exact(tiny, name):
    """Each key of speculative_config at an end of its range, drafts crossing 16-token pages in a
    pool that retracts: greedy outputs identical to no speculation, every slot free or cached."""
    base, spec, eng = both_ways(
        tiny,
        greedy(40, ignore_eos=True),
        prompts=_prompts() * 2,
        rounds=2,
        spec=BOUNDS[name],
        page_size=16,
        max_total_tokens=320,
    )
    assert tokens(spec) == tokens(base)
    s = eng.cache_stats()
    assert s["free"] + s["evictable"] == s["capacity"] and s["protected"] == 0
    assert s["spec_draft_tokens"] > 0 or name == "ngram_cost1"  # a row costing a whole step never pays
