"""In-batch prefix sharing on the fake-runner engine of test_scheduler.py: requests waiting at the
same time compute a shared, uncached prefix once, and the sharers run on top of it in the same
step (issue 17). Exact prefill counts against the trie of all prompts, first-token steps from the
engine's events, aborts of the request that computes the shared prefix, and a randomized sweep
over caches, page sizes, chunk sizes, policies, n > 1, aborts and small pools with the slot
invariants checked after every step."""

from __future__ import annotations

import random

import pytest
from random_drive import assert_outputs, random_drive
from test_scheduler import VOCAB, assert_no_leak, greedy, make_engine, reference, run_all

from radixkv.engine import RequestAdmitted, StepFinished

pytestmark = pytest.mark.timeout(300)


def trie_tokens(prompts) -> int:
    """Distinct tokens of the trie of ``prompts`` (the physical limit of prefill tokens)."""
    root: dict = {}
    n = 0
    for p in prompts:
        node = root
        for t in p:
            if t not in node:
                node[t] = {}
                n += 1
            node = node[t]
    return n


def lcp(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class Recorder:
    """Admissions and, per sample, the step that gave it its first token (from StepFinished)."""

    def __init__(self, eng):
        self.admitted: list[RequestAdmitted] = []
        self.steps: list[StepFinished] = []
        self.first_token: dict[str, int] = {}
        eng.events.subscribe(self._on, (RequestAdmitted, StepFinished))

    def _on(self, ev):
        if isinstance(ev, RequestAdmitted):
            self.admitted.append(ev)
        else:
            self.steps.append(ev)
            for rid, idx in ev.tokens_for:
                if idx == 0:
                    self.first_token.setdefault(rid, ev.step)


def fan_out(rng, shared_len=40, n=4):
    system = [rng.randrange(1, VOCAB) for _ in range(shared_len)]
    firsts = rng.sample(range(1, VOCAB), n)  # distinct first suffix tokens: pairwise lcp == shared_len
    return system, [system + [f] + [rng.randrange(1, VOCAB) for _ in range(rng.randrange(2, 9))] for f in firsts]


@pytest.mark.parametrize("cache", ["radix", "hash"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_fan_out_computes_the_shared_prefix_once_in_one_step(cache, page_size):
    system, prompts = fan_out(random.Random(0), shared_len=42)
    eng = make_engine(page_size=page_size, cache=cache, chunk=512)
    rec = Recorder(eng)
    ids = [eng.add_request(p, greedy(5)) for p in prompts]
    done = run_all(eng)
    for rid, p in zip(ids, prompts):
        assert done[rid].outputs[0].token_ids == reference(p, 5)
    shared = len(system) // page_size * page_size  # the shared prefix, floored to whole pages
    expect = len(prompts[0]) + sum(len(p) - shared for p in prompts[1:])
    assert eng.cache_stats()["prefill_tokens"] == expect
    if page_size == 1:
        assert expect == trie_tokens(prompts) == len(system) + sum(len(p) - len(system) for p in prompts)
    # all four admitted and sampled in the first step; the sharers borrowed the computer's rows
    assert {rec.first_token[r] for r in ids} == {1}
    assert [(e.request_id, e.num_shared_tokens, e.num_cached_tokens) for e in rec.admitted] == [(ids[0], 0, 0)] + [
        (r, shared, shared) for r in ids[1:]
    ]
    assert [done[r].num_cached_tokens for r in ids] == [0, shared, shared, shared]
    assert eng.cache_stats()["cached_tokens"] == 3 * shared
    assert_no_leak(eng)


def test_without_in_batch_sharing_everyone_computes_everything():
    """The issue's symptom, kept reachable as the comparison baseline (in_batch_prefix_sharing=False)."""
    system, prompts = fan_out(random.Random(1))
    eng = make_engine(chunk=512)
    eng.kv.in_batch_sharing = False
    ids = [eng.add_request(p, greedy(3)) for p in prompts]
    done = run_all(eng)
    assert [done[r].num_cached_tokens for r in ids] == [0, 0, 0, 0]
    assert eng.cache_stats()["prefill_tokens"] == sum(len(p) for p in prompts)
    assert_no_leak(eng)


@pytest.mark.parametrize("page_size", [1, 4])
def test_identical_prompts_and_prefixes_ride_on_one_row(page_size):
    """A prompt another row computes entirely (an identical one, or a prefix of a longer one that
    ends on a page boundary) computes nothing: it samples from that row's logits."""
    rng = random.Random(2)
    base = [rng.randrange(1, VOCAB) for _ in range(24)]
    long = base + [rng.randrange(1, VOCAB) for _ in range(9)]
    prompts = [long, list(long), base, list(base), long[:16]]
    eng = make_engine(page_size=page_size, chunk=512)
    rec = Recorder(eng)
    ids = [eng.add_request(p, greedy(4)) for p in prompts]
    done = run_all(eng)
    for rid, p in zip(ids, prompts):
        assert done[rid].outputs[0].token_ids == reference(p, 4)
    # a copy that does not end on a page boundary cannot share the computer's partial last page:
    # it borrows the whole pages and computes the rest
    ride = [len(p) % page_size == 0 for p in prompts[1:]]
    own = [0 if r else len(p) - (len(p) - 1) // page_size * page_size for p, r in zip(prompts[1:], ride)]
    assert eng.cache_stats()["prefill_tokens"] == len(long) + sum(own)
    if page_size == 1:
        assert len(long) == trie_tokens(prompts) and all(ride)
    riders = [s for st in rec.steps for s in st.riders]
    assert sorted(r for r, _ in riders) == sorted(r for r, ok in zip(ids[1:], ride) if ok)
    assert {rec.first_token[r] for r in ids} == {1}
    assert [done[r].num_cached_tokens for r in ids] == [0] + [len(p) - o for p, o in zip(prompts[1:], own)]
    assert_no_leak(eng)


def test_sharers_join_the_last_chunk_of_a_chunked_prefix():
    """A request arriving while the shared prefix is mid-way through chunked prefill waits for it
    (it would otherwise compute it again) and runs on top of the last chunk, in the same step."""
    rng = random.Random(3)
    system, prompts = fan_out(rng, shared_len=70)
    eng = make_engine(chunk=32)
    rec = Recorder(eng)
    first = eng.add_request(prompts[0], greedy(4))
    eng.step()  # chunk 1 of 3
    eng.check_integrity()
    later = [eng.add_request(p, greedy(4)) for p in prompts[1:]]
    done = run_all(eng)
    for rid, p in zip([first] + later, prompts):
        assert done[rid].outputs[0].token_ids == reference(p, 4)
    assert eng.cache_stats()["prefill_tokens"] == trie_tokens(prompts)
    last_chunk = rec.first_token[first]
    assert last_chunk == -(-len(prompts[0]) // 32)
    assert all(rec.first_token[r] in (last_chunk, last_chunk + 1) for r in later)
    shared = {e.request_id: (e.prefix_len, e.num_shared_tokens) for e in rec.admitted}
    # the computer's first two chunks were cached when they were admitted; the rest was in flight
    for r in later:
        assert shared[r][0] == len(system)
    assert sum(shared[r][1] for r in later) > 0
    assert_no_leak(eng)


@pytest.mark.parametrize("when", ["mid_chunk", "same_step"])
def test_aborting_the_computer_leaves_the_sharers_their_prefix(when):
    rng = random.Random(4)
    system, prompts = fan_out(rng, shared_len=70)
    eng = make_engine(chunk=32 if when == "mid_chunk" else 512)
    ids = [eng.add_request(p, greedy(6)) for p in prompts]
    eng.step()
    eng.check_integrity()
    eng.abort_request(ids[0])  # it computed (part of) the shared prefix
    done = run_all(eng)
    assert done[ids[0]].outputs[0].finish_reason == "abort"
    for rid, p in zip(ids[1:], prompts[1:]):
        assert done[rid].outputs[0].token_ids == reference(p, 6)
    # nothing was computed twice: what the aborted request computed stayed cached for the others
    assert eng.cache_stats()["prefill_tokens"] <= trie_tokens(prompts)
    assert_no_leak(eng)


def test_lpm_puts_the_sharers_right_after_their_computer():
    """Two groups and unrelated prompts under a small budget: the sharers of the admitted row are
    admitted next (longest reusable prefix, in-flight included), so each group's first tokens
    come in one step or the next."""
    rng = random.Random(5)
    groups = [fan_out(rng, shared_len=30, n=3)[1] for _ in range(2)]
    unrelated = [[rng.randrange(1, VOCAB) for _ in range(20)] for _ in range(3)]
    order = [groups[0][0], unrelated[0], groups[1][0], unrelated[1], groups[0][1], groups[1][1], unrelated[2]]
    order += [groups[0][2], groups[1][2]]
    eng = make_engine(chunk=90, max_running=16)
    rec = Recorder(eng)
    ids = [eng.add_request(p, greedy(3)) for p in order]
    done = run_all(eng)
    for rid, p in zip(ids, order):
        assert done[rid].outputs[0].token_ids == reference(p, 3)
    assert eng.cache_stats()["prefill_tokens"] == trie_tokens(order)
    for g in groups:
        steps = [rec.first_token[ids[order.index(p)]] for p in g]
        assert max(steps) - min(steps) <= 1, steps
    assert_no_leak(eng)


def random_forest(rng, n, page_size):
    """Prompts over a random trie: shared stems, branches, exact duplicates and prefixes."""
    stems = [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(3, 40))] for _ in range(rng.randrange(1, 4))]
    out = []
    for _ in range(n):
        r = rng.random()
        if out and r < 0.1:
            out.append(list(rng.choice(out)))  # sent twice
        elif out and r < 0.2:
            p = rng.choice(out)
            out.append(p[: rng.randrange(1, len(p) + 1)])  # a prefix of another prompt
        else:
            s = rng.choice(stems)
            cut = rng.randrange(1, len(s) + 1)
            out.append(s[:cut] + [rng.randrange(1, VOCAB) for _ in range(rng.randrange(0, 15))])
    return out


@pytest.mark.parametrize("seed", range(12))
def test_random_forests_exact_limit_and_invariants(seed):
    """All prompts submitted at once into a pool that holds them: at page_size 1 with room for
    all of them in one step, prefill tokens equal the trie's distinct tokens exactly; with a
    small budget (chunks, waiting for rows) at most each prompt's last token is computed again
    (a prompt ending where another row computed in an earlier step has no logits left to share).
    Outputs equal the reference and the slot invariants hold after every step."""
    rng = random.Random(100 + seed)
    cache = ["radix", "hash"][seed % 2]
    page_size = [1, 1, 4][seed % 3]
    roomy = seed % 4 < 2
    prompts = random_forest(rng, rng.randrange(4, 14), page_size)
    eng = make_engine(
        capacity=2048,
        page_size=page_size,
        cache=cache,
        chunk=1024 if roomy else rng.choice([8, 16, 40]),
        max_running=16 if roomy else rng.choice([2, 4]),
        policy=rng.choice(["lpm", "fcfs"]),
    )
    ids = [eng.add_request(p, greedy(rng.randrange(1, 6), n=rng.choice([1, 1, 2]))) for p in prompts]
    params = {rid: eng._groups[rid].params for rid in ids}
    done = run_all(eng)
    for rid, p in zip(ids, prompts):
        for c in done[rid].outputs:
            assert c.token_ids == reference(p, params[rid].max_tokens)
    prefill = eng.cache_stats()["prefill_tokens"]
    extra_samples = sum((params[r].n - 1) * len(p) for r, p in zip(ids, prompts))  # n > 1: at most L - B each
    distinct = trie_tokens(prompts)
    if page_size == 1:
        assert prefill - distinct <= len(prompts) + extra_samples
        if roomy and all(params[r].n == 1 for r in ids):
            assert prefill == distinct
    else:
        assert prefill <= distinct + len(prompts) * page_size + extra_samples
    assert_no_leak(eng)


@pytest.mark.parametrize("seed", range(8))
def test_random_arrivals_aborts_and_tiny_pools(seed):
    """Random arrivals of branching prompts with aborts, n > 1, retraction and eviction: after
    every step each slot is owned once, nothing borrowed outlives its forward, and every request
    not aborted equals the reference."""
    rng = random.Random(200 + seed)
    cache = ["radix", "hash", "none"][seed % 3]
    page_size = [1, 4][seed // 3 % 2]
    eng = make_engine(
        capacity=rng.choice([96, 160, 256]),
        page_size=page_size,
        cache=cache,
        chunk=rng.choice([8, 24, 64]),
        max_running=rng.choice([2, 4, 8]),
        policy=rng.choice(["lpm", "fcfs"]),
    )
    forest = random_forest(rng, 40, page_size)

    def arrive(_step):
        if not (forest and rng.random() < 0.5):
            return
        for _ in range(rng.randrange(1, 4)):  # several at once: they wait together
            if not forest:
                break
            p = forest.pop()[:60]
            mt = rng.randrange(1, 10)
            yield eng.add_request(p, greedy(mt, n=rng.choice([1, 1, 2]))), reference(p, mt)

    assert_outputs(*random_drive(eng, rng, arrive, lambda _s: bool(forest), steps=500, abort_p=0.06))
    assert_no_leak(eng)
