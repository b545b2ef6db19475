"""Per-request cache outcomes (radixkv/cache/outcome.py, radixkv/engine/outcome.py) on the
fake-runner engine of test_scheduler.py: every cause, exact segments that sum to the missed
tokens, the outcome on RequestOutput and RequestAdmitted, the Prometheus counter, and
``LLM.explain``'s dry run (the cache is left exactly as it was)."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_cache_peek import _state
from test_scheduler import VOCAB, make_engine, run_all

from radixkv.cache.outcome import CAUSES, CacheOutcome
from radixkv.engine import RequestAdmitted
from radixkv.namespace import Namespace
from radixkv.sampling_params import SamplingParams
from radixkv.server.metrics import ServerMetrics

pytestmark = pytest.mark.timeout(120)

SYS = [1 + (7 * i) % (VOCAB - 1) for i in range(40)]


def sp(n=3):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def run_one(eng, prompt, ns=None, n=3) -> CacheOutcome:
    rid = eng.add_request(prompt, sp(n), namespace=ns)
    out = run_all(eng)[rid]
    o = out.cache_outcome
    check(o, out.num_cached_tokens, len(prompt))
    return o


def check(o: CacheOutcome, cached: int, n: int) -> None:
    """Segments cover [cached, n) in order and the causes sum exactly to the missed tokens."""
    assert o.num_cached_tokens == cached and o.num_prompt_tokens == n
    pos = cached
    for a, b, c in o.segments:
        assert a == pos and b > a and c in CAUSES
        pos = b
    assert pos == n
    assert sum(o.missed.values()) == n - cached == o.num_missed_tokens
    assert o.segments[-1] == (n - 1, n, "full")  # the last prompt token is always computed


def test_cold_full_diverged_and_the_cached_neighbour():
    eng = make_engine(capacity=512)
    a = run_one(eng, SYS + [5, 6, 7])
    assert a.cause == "cold" and a.segments == ((0, 42, "cold"), (42, 43, "full"))
    b = run_one(eng, SYS + [5, 6, 7])
    assert b.cause == "full" and b.num_cached_tokens == 42 and b.segments == ((42, 43, "full"),)
    c = run_one(eng, SYS[:20] + [9] * 10 + SYS[30:])
    assert (c.cause, c.num_cached_tokens, c.diverge_pos) == ("diverged", 20, 20)
    assert c.cached_next == tuple(SYS[20:28]) and c.missed == {"diverged": 19, "full": 1}
    # a prompt that ends inside a cached sequence: full
    assert run_one(eng, SYS[:30]).cause == "full"


def test_page_floor_to_the_token():
    eng = make_engine(capacity=512, page_size=4)
    run_one(eng, SYS + [5, 6, 7])
    o = run_one(eng, SYS[:22] + [60] * 10)
    assert o.num_cached_tokens == 20 and o.token_match == 22 and o.diverge_pos == 22
    assert o.segments == ((20, 22, "page_floor"), (22, 31, "diverged"), (31, 32, "full"))
    # everything but the unaligned tail cached: full, the tail is page_floor
    o = run_one(eng, SYS[:31])
    assert o.cause == "full" and o.segments == ((28, 30, "page_floor"), (30, 31, "full"))


def test_what_full_means_is_said_for_each_prompt():
    """``full`` is the cause of a prompt that misses nothing the cache could give: its words say
    which case (all but the last token cached, every whole page cached, or nothing to look up),
    and the explanation's first line prints them beside the cause."""
    from radixkv.engine.outcome import explain_text

    eng = make_engine(capacity=512, page_size=4)
    run_one(eng, SYS + [5, 6, 7])
    cases = {
        "one token": (SYS[:1], "a one-token prompt: nothing to look up, its only token is always computed"),
        "no page": (
            SYS[:4],
            "no whole page before the last prompt token to look up; the last token is always computed",
        ),
        "pages": (
            SYS[:31],
            "every whole page before the last prompt token cached; the partial page and the last token computed",
        ),
        "all": (SYS[:29], "every token cached but the last one, which is always computed"),
    }
    for name, (prompt, words) in cases.items():
        o = eng.explain(prompt)
        assert o.cause == "full" and o.cause_meaning == words, name
        assert str(explain_text(o, prompt, None)).startswith(f"cause full ({words}): {o.num_cached_tokens} of "), name
    assert [eng.explain(p).num_cached_tokens for p in (SYS[:1], SYS[:4], SYS[:31], SYS[:29])] == [0, 0, 28, 28]
    cold = eng.explain([9] * 12)
    assert cold.cause == "cold" and cold.cause_meaning == "never seen (or evicted longer ago than the record reaches)"


@pytest.mark.parametrize("cache", ["radix", "hash"])
def test_evicted_is_told_apart_from_cold(cache):
    ps = 1 if cache == "radix" else 16
    eng = make_engine(capacity=96, page_size=ps, cache=cache)
    a = [1 + (3 * i) % 60 for i in range(60)]
    b = [2 + (5 * i) % 60 for i in range(60)]
    run_one(eng, a)
    held = eng.cache.total_size()
    run_one(eng, b)  # evicts a's tail
    evicted = eng.cache_stats()["evicted_tokens"]
    assert 0 < evicted < held
    o = run_one(eng, a)
    # both free a's tail pages, as many as b needed: radix to the token (a keeps the rest of its
    # leaf), hash whole 16-token blocks, so its first two stayed
    assert o.num_cached_tokens == (held - evicted if cache == "radix" else 32) and o.cause == "evicted"
    assert o.segments[0] == (o.num_cached_tokens, 48, "evicted")  # up to a's last full 16-token block
    fresh = run_one(eng, [3 + (11 * i) % 60 for i in range(60)])
    assert fresh.cause == "cold" and "evicted" not in fresh.missed
    eng.check_integrity()


def test_namespace_in_flight_and_disabled():
    eng = make_engine(capacity=512)
    run_one(eng, SYS + [5], ns="alice")
    o = run_one(eng, SYS + [5], ns="bob")
    assert (
        o.cause == "namespace"
        and o.other_namespace == Namespace(extra_key="alice")
        and o.missed == {"namespace": 40, "full": 1}
    )
    # two requests admitted in the same step: the second needs what the first is computing.
    # With in-batch prefix sharing it borrows those tokens (a hit: "full"); without, they are
    # "in_flight" (being computed by a concurrent request, not yet cached).
    for in_batch in (False, True):
        eng = make_engine(capacity=512, chunk=64, in_batch=in_batch)
        seen = []
        eng.events.subscribe(seen.append, (RequestAdmitted,))
        r1 = eng.add_request(SYS + [5], sp())
        r2 = eng.add_request(SYS + [6], sp())
        outs = run_all(eng)
        o2 = outs[r2].cache_outcome
        assert outs[r1].cache_outcome.cause == "cold"
        if in_batch:
            assert o2.cause == "full" and o2.segments == ((40, 41, "full"),) and outs[r2].num_cached_tokens == 40
            assert [e.num_shared_tokens for e in seen if e.index == 0] == [0, 40]
        else:
            assert o2.cause == "in_flight" and o2.segments == ((0, 40, "in_flight"), (40, 41, "full"))
            assert outs[r2].num_cached_tokens == 0
        assert [e.cache_outcome for e in seen if e.index == 0] == [outs[r1].cache_outcome, o2]
    off = make_engine(capacity=512, cache="none")
    run_one(off, SYS)
    o = run_one(off, SYS)
    assert o.cause == "disabled" and o.missed == {"disabled": 39, "full": 1}


def test_outcome_off_and_n_greater_than_one():
    from test_scheduler import FakeRunner

    from radixkv.config import EngineConfig
    from radixkv.engine import Engine

    cfg = EngineConfig(device="cpu", max_total_tokens=256, cache_outcome=False, chunked_prefill_size=64)
    eng = Engine(cfg, model_runner=FakeRunner(256, 1), tokenizer=None, eos_token_ids=[])
    rid = eng.add_request(SYS, sp())
    assert run_all(eng)[rid].cache_outcome is None
    eng = make_engine(capacity=512)
    seen = []
    eng.events.subscribe(seen.append, (RequestAdmitted,))
    rid = eng.add_request(SYS, SamplingParams(max_tokens=2, n=3, temperature=0.8, seed=1))
    out = run_all(eng)[rid]
    assert out.cache_outcome.cause == "cold"
    assert [e.cache_outcome is not None for e in seen] == [True, False, False]  # sample 0 only


def test_missed_tokens_counter_sums_the_outcomes():
    from radixkv.engine import RequestFinished

    eng = make_engine(capacity=96)
    metrics = ServerMetrics()
    eng.events.subscribe(metrics.on_event, (RequestAdmitted, RequestFinished))
    outcomes = []
    for p in (SYS, SYS, SYS[:20] + [3] * 30, [5] * 50, SYS):
        outcomes.append(run_one(eng, p))
    # an aborted request counts in none of the token counters (its client saw no usage)
    rid = eng.add_request([7] * 30, sp())
    eng.step()
    eng.abort_request(rid)
    run_all(eng)
    want: dict = {}
    for o in outcomes:
        for c, n in o.missed.items():
            want[c] = want.get(c, 0) + n
    got, totals = {}, {}
    for fam in text_string_to_metric_families(metrics.render().decode()):
        for s in fam.samples:
            if fam.name == "radixkv_missed_prompt_tokens" and s.name.endswith("_total"):
                got[s.labels["cause"]] = int(s.value)
            elif s.name in ("radixkv_prompt_tokens_total", "radixkv_cached_tokens_total"):
                totals[s.name] = int(s.value)
    assert got == want and len(want) >= 3 and not metrics._outcomes
    assert sum(got.values()) == totals["radixkv_prompt_tokens_total"] - totals["radixkv_cached_tokens_total"]


def test_llm_explain_is_a_dry_run_that_predicts_the_outcome(default_model):
    from obs_helpers import NullRunner

    from radixkv.llm import LLM

    tok = default_model.tokenizer
    llm = LLM(model_runner=NullRunner(len(tok)), tokenizer=tok, eos_token_ids=[], max_total_tokens=4096, device="cpu")
    system = {"role": "system", "content": "You are a terse assistant. The current time is 10:42:07 UTC."}
    first = [system, {"role": "user", "content": "Name a prime number."}]
    llm.chat(first, sp(2), use_tqdm=False)
    later = [dict(system, content=system["content"].replace("10:42:07", "10:43:55")), first[1]]
    before = _state(llm.engine.cache)
    ex = llm.explain(later)
    assert _state(llm.engine.cache) == before  # nothing split, refreshed, locked
    assert ex.cause == "diverged" and "10:4" in ex.before and ex.prompt_side.startswith("3:55")
    assert ex.cached_side.startswith("2:07")
    out = llm.chat(later, sp(2), use_tqdm=False)[0]
    assert out.cache_outcome == ex.outcome  # the dry run predicted the admission exactly
    assert "cause diverged" in str(ex)
    from radixkv.errors import RequestError

    bad = [
        (dict(), "prompt"),
        (dict(prompt=""), "prompt"),
        (dict(prompt=123), "prompt"),
        (dict(prompt_token_ids="abc"), "prompt_token_ids"),
        (dict(prompt_token_ids=[-5, 3]), "prompt_token_ids"),
        (dict(prompt_token_ids=[10**9]), "prompt_token_ids"),
        (dict(prompt="x", context=-1), "context"),
    ]
    for kwargs, param in bad:
        with pytest.raises(RequestError) as err:
            llm.explain(**kwargs)
        assert err.value.param == param, (kwargs, err.value)
    assert llm.explain(prompt_token_ids=tok.encode("hello there")).outcome.cause == "cold"
