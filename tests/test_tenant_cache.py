"""Tenants below the server (issue 37): the caches' per-tenant accounting and soft quotas (radix
tree and hash blocks; the radix tree's stateful oracle is tests/test_cache_stateful.py's tenant
machine), the engine's per-tenant stats, the scheduler's side channel (the longest-prefix-first
order and in-batch sharing compare a request only with what its own namespace holds: another
tenant's cache changes neither the admission order nor ``cached_tokens`` of a tenant's requests),
and the Python API's ``cache_salt`` (prompt dict, ``SamplingParams``) and ``LLM(namespace=)``.
The engine runs the fake model of tests/test_scheduler.py (exact token-level references)."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest
from random_drive import assert_outputs
from test_scheduler import FakeRunner, greedy, make_engine, reference, run_all

from radixkv import LLM, AsyncLLM, SamplingParams
from radixkv.cache import HashBlockCache, RadixCache
from radixkv.config import EngineConfig
from radixkv.engine import RequestAdmitted
from radixkv.engine.stats import tenant_row
from radixkv.errors import RequestError
from radixkv.namespace import Namespace, check_cache_salt, with_salt

A, A2, B, F = Namespace(tenant="a"), Namespace(tenant="a", salt="s"), Namespace(tenant="b"), Namespace(tenant="f")


def _slots(start: int, n: int) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int64)


# ---------------------------------------------------------------------------- caches
@pytest.mark.parametrize("kind", ["radix", "hash"])
def test_a_tenant_above_its_quota_loses_its_own_pages_first(kind):
    """The victim's prefix is the least recently used, but the flooding tenant is above its quota:
    its own least recently used pages go first, exactly down to its quota; then plain LRU."""
    ps = 4
    c = RadixCache(ps, tenant_quotas={"f": 16}) if kind == "radix" else HashBlockCache(ps, tenant_quotas={"f": 16})
    victim = list(range(100, 132))
    c.insert(victim, _slots(0, 32), B)  # oldest
    floods = [[1000 * (i + 1) + t for t in range(16)] for i in range(4)]
    for i, toks in enumerate(floods):  # 64 tokens of f, over two of its namespaces (one tenant)
        c.insert(toks, _slots(32 + 16 * i, 16), F if i % 2 else Namespace(tenant="f", salt="x"))
    assert c.tenant_sizes() == {"b": 32, "f": 64}
    # f is 48 over: its 40 least recently used tokens go (the third prompt's tail pages first),
    # none of b's
    freed = sorted(c.evict(40).tolist())
    assert freed == list(range(32, 64)) + list(range(72, 80)) and c.tenant_sizes() == {"b": 32, "f": 24}
    # f is 8 over: the rest of its third prompt, then plain LRU: the tail page of b's prefix
    freed = sorted(c.evict(12).tolist())
    assert freed == [28, 29, 30, 31] + list(range(64, 72)) and c.tenant_sizes() == {"b": 28, "f": 16}
    c.check_integrity()
    assert c.match_prefix(victim, A).length == 0 and c.match_prefix(floods[3], F).length == 16


@pytest.mark.parametrize("kind", ["radix", "hash"])
def test_the_quota_phase_frees_only_a_tenants_excess_then_plain_lru(kind):
    """f is 16 over its quota and asks for 24: the quota phase takes exactly f's 16 excess tokens
    (its tail pages), the other 8 go by LRU order, from b's older prefix, not from f."""
    ps = 4
    c = RadixCache(ps, tenant_quotas={"f": 16}) if kind == "radix" else HashBlockCache(ps, tenant_quotas={"f": 16})
    c.insert(list(range(100, 132)), _slots(0, 32), B)  # oldest
    c.insert(list(range(200, 232)), _slots(32, 32), F)
    assert c.tenant_sizes() == {"b": 32, "f": 32}
    freed = sorted(c.evict(24).tolist())
    assert freed == list(range(24, 32)) + list(range(48, 64))
    assert c.tenant_sizes() == {"b": 24, "f": 16}
    c.check_integrity()
    assert c.match_prefix(list(range(200, 232)), F).length == 16
    assert c.match_prefix(list(range(100, 132)), B).length == 24


def test_quotas_set_later_refile_the_tree_and_count_every_namespace_of_a_tenant():
    c = RadixCache(1)
    c.insert(list(range(10)), _slots(0, 10), A)
    c.insert(list(range(10)), _slots(10, 10), A2)  # the same tokens under a salt: another namespace
    c.insert(list(range(50, 60)), _slots(20, 10), B)
    m = c.match_prefix(list(range(5)), A)
    c.inc_lock_ref(m.node)  # locked tokens count toward the tenant too
    assert c.tenant_sizes() == {"a": 20, "b": 10}
    c.set_tenant_quotas({"a": 12})
    c.check_integrity()
    c.match_prefix(list(range(50, 60)), B)  # b is now the most recently used
    assert len(c.evict(9)) == 9 and c.tenant_sizes() == {"a": 11, "b": 10}  # only a's unlocked tail pages
    c.check_integrity()
    with pytest.raises(ValueError, match="kv_quota_tokens of tenant 'a'"):
        c.set_tenant_quotas({"a": -1})
    with pytest.raises(ValueError):
        RadixCache(1, tenant_quotas={"": 3})
    c.dec_lock_ref(m.node)
    c.reset()
    assert c.tenant_sizes() == {}


def test_the_engine_reports_each_tenant():
    cfg = EngineConfig(device="cpu", max_total_tokens=256, tenant_kv_quota_tokens={"a": 40})
    from radixkv.engine import Engine

    eng = Engine(cfg, model_runner=FakeRunner(256, 1), tokenizer=None, eos_token_ids=[])
    # a tenant with a quota is listed before its first request (each replica of serve --replicas lists
    # it, so the summed quota does not depend on where the router sent its traffic)
    assert eng.cache_stats().tenants == {"a": dict(cached=0, quota=40, prompt_tokens=0, cached_tokens=0, hit_rate=0.0)}
    prompt = list(range(1, 30))
    for ns in (A, A, A2, B, None):
        eng.add_request(prompt, greedy(3), namespace=ns)
        run_all(eng)
    t = eng.cache_stats().tenants
    # each run caches its 29 prompt tokens + 2 computed output tokens; a's two namespaces add up
    assert t == {
        "a": dict(cached=62, quota=40, prompt_tokens=87, cached_tokens=28, hit_rate=28 / 87),
        "b": dict(cached=31, quota=None, prompt_tokens=29, cached_tokens=0, hit_rate=0.0),
    }
    with pytest.raises(ValueError, match="tenant_kv_quota_tokens"):
        EngineConfig(tenant_kv_quota_tokens={"a": True}).resolve()


def _tenants_recomputed(eng, counts) -> dict:
    """``cache_stats().tenants`` from scratch: the cache's sizes, the quotas, and ``counts`` (tenant
    -> [prompt tokens, cached tokens], summed from first admissions' RequestAdmitted events)."""
    sizes, quotas = eng.kv.cache.tenant_sizes(), eng.config.tenant_kv_quota_tokens or {}
    names = sorted({t for t in sizes if t is not None} | set(counts) | set(quotas))
    return {t: tenant_row(sizes.get(t, 0), quotas.get(t), *counts.get(t, (0, 0))) for t in names}


def _count_admissions(counts):
    def on(e):
        if e.index == 0 and not e.readmission and e.namespace is not None and e.namespace.tenant is not None:
            c = counts.setdefault(e.namespace.tenant, [0, 0])
            c[0], c[1] = c[0] + e.num_prompt_tokens, c[1] + e.num_cached_tokens

    return on


@pytest.mark.parametrize("cache", ["radix", "hash"])
def test_per_tenant_rows_kept_incrementally_match_a_recount(cache):
    """Tenants come and go from the cache (evictions under quotas and a small pool, a reset): after
    every step the engine's incremental rows equal a recount from scratch."""
    cfg = EngineConfig(device="cpu", max_total_tokens=96, page_size=2, prefix_cache=cache,
                       tenant_kv_quota_tokens={"t1": 8, "t9": 4})  # fmt: skip
    from radixkv.engine import Engine

    eng = Engine(cfg, model_runner=FakeRunner(96, 2), tokenizer=None, eos_token_ids=[])
    counts: dict = {}
    eng.events.subscribe(_count_admissions(counts), (RequestAdmitted,))
    rng = np.random.default_rng(7)
    for rnd in range(3):
        for i in range(12):
            t = int(rng.integers(0, 6))
            ns = None if t == 5 else Namespace(tenant=f"t{t}", salt="s" if i % 3 else None)
            eng.add_request([3 + t, 4, *rng.integers(5, 9, int(rng.integers(2, 12))).tolist()], greedy(3), namespace=ns)
        while eng.has_unfinished_requests():
            eng.step()
            assert eng.cache_stats().tenants == _tenants_recomputed(eng, counts)
        assert eng.kv.evicted_tokens > 0
        if rnd == 1:
            assert eng.reset_prefix_cache() and eng.cache_stats().tenants == _tenants_recomputed(eng, counts)
    assert set(eng.cache_stats().tenants) == {"t0", "t1", "t2", "t3", "t4", "t9"}


def test_async_llm_steps_never_walk_every_tenant(monkeypatch):
    """With many tenants, AsyncLLM published every step's stats with a row per tenant ever seen
    (0.27 s a step at 100k tenants): a step now costs what its own tenants changed. The rows are
    built when read, and read exactly as before."""
    import radixkv.engine.engine as engine_mod
    import radixkv.engine.stats as stats_mod
    from radixkv.engine import Engine

    eng = Engine(EngineConfig(device="cpu", max_total_tokens=2048, max_running_requests=64),
                 model_runner=FakeRunner(2048, 1, 64), tokenizer=None, eos_token_ids=[])  # fmt: skip
    counts: dict = {}
    eng.events.subscribe(_count_admissions(counts), (RequestAdmitted,))
    n = 300
    for i in range(n):
        eng.add_request([3 + i % 40, 5, 7], greedy(1), namespace=Namespace(tenant=f"t{i:03d}"))
    run_all(eng, check_every_step=False)
    rows_built = [0]

    def counted(*a):
        rows_built[0] += 1
        return tenant_row(*a)

    monkeypatch.setattr(stats_mod, "tenant_row", counted)
    monkeypatch.setattr(engine_mod, "tenant_row", counted, raising=False)

    async def main():
        alm = AsyncLLM(engine=eng)
        try:
            built_before = rows_built[0]
            final = None
            async for out in alm.generate(list(range(20, 40)), greedy(8), namespace=Namespace(tenant="t007")):
                final = out
            during = rows_built[0] - built_before
            return final, during, alm.cache_stats().tenants, rows_built[0] - built_before - during
        finally:
            alm.shutdown()

    final, during, tenants, on_read = asyncio.run(main())
    assert final.outputs[0].token_ids == reference(list(range(20, 40)), 8)
    assert during == 0 and on_read == n  # 8 steps: none walked the tenants; one read: one row each
    assert tenants == _tenants_recomputed(eng, counts) and len(tenants) == n
    assert tenants["t007"]["prompt_tokens"] == 3 + 20


# ---------------------------------------------------------------------------- side channels
def _admission_order(eng, batch) -> tuple[list, list]:
    """Submit ``batch`` (``(name, tokens, namespace)``) at once; the order the scheduler admits
    them and each one's cached tokens."""
    got = []
    off = eng.events.subscribe(got.append, (RequestAdmitted,))
    rids = {eng.add_request(toks, greedy(2), request_id=name, namespace=ns): name for name, toks, ns in batch}
    done = run_all(eng)
    off()
    return [e.request_id for e in got if e.index == 0], [done[r].num_cached_tokens for r in rids]


@pytest.mark.parametrize("in_batch", [True, False])
def test_longest_prefix_first_ranks_a_request_only_by_its_own_namespace(in_batch):
    """B submits fillers and a probe together (the probe last): its admission order and cached
    tokens are the same whether or not tenant A has the probe's prefix cached; only B's own
    cache moves the probe to the front (the control)."""
    secret = [1 + (3 * i) % 50 for i in range(48)]
    probe = secret + [55, 56]
    fillers = [[60 + i] + [2 + (i * 7 + t) % 40 for t in range(47)] for i in range(3)]
    batch = [(f"fill{i}", f, B) for i, f in enumerate(fillers)] + [("probe", probe, B)]

    def engine(cached_by):
        eng = make_engine(capacity=1024, chunk=512, in_batch=in_batch)
        if cached_by is not None:
            eng.add_request(secret, greedy(2), namespace=cached_by)
            run_all(eng)
        return eng

    cold = _admission_order(engine(None), batch)
    assert cold == (["fill0", "fill1", "fill2", "probe"], [0, 0, 0, 0])  # ties keep queue order
    assert _admission_order(engine(A), batch) == cold  # A's cache changes nothing B sees
    assert _admission_order(engine(Namespace(tenant="b", salt="x")), batch) == cold  # nor B's other salt
    own = _admission_order(engine(B), batch)  # the control: B's own cache
    assert own == (["probe", "fill0", "fill1", "fill2"], [0, 0, 0, len(secret)])


def test_a_request_of_another_tenant_in_the_same_forward_is_no_one_to_share_with():
    """A and B send the same prompt in one step: B's row borrows nothing of A's (no rider, no
    borrowed prefix), and B's outputs are the reference's."""
    prompt = list(range(1, 41))
    eng = make_engine(capacity=512, chunk=512)
    got = []
    eng.events.subscribe(got.append, (RequestAdmitted,))
    ra = eng.add_request(prompt, greedy(4), namespace=A)
    rb = eng.add_request(prompt, greedy(4), namespace=B)
    rb2 = eng.add_request(prompt, greedy(4), namespace=B)
    done = run_all(eng)
    shared = {e.request_id: (e.num_cached_tokens, e.num_shared_tokens) for e in got}
    assert shared == {ra: (0, 0), rb: (0, 0), rb2: (40, 40)}  # only B's twin rides on B's row
    assert all(done[r].outputs[0].token_ids == reference(prompt, 4) for r in (ra, rb, rb2))


# ---------------------------------------------------------------------------- fairness
@pytest.mark.parametrize("policy", ["lpm", "fcfs"])
def test_admission_takes_the_tenants_in_turn(policy):
    """Tenant f's burst of six prompts comes first, then b's two and a's one, while one prompt's
    budget fits per step (chunk 48): admission takes the tenants in turn (f, b, a, f, b, f, ...),
    not f's whole burst before b's and a's; each request's outputs are the reference's."""
    prompts = {f"f{i}": [40 + i] + [1 + (i * 7 + t) % 39 for t in range(47)] for i in range(6)}
    prompts.update({f"b{i}": [50 + i] + [1 + (i * 5 + t) % 30 for t in range(47)] for i in range(2)})
    prompts["a0"] = [60] + [2 + t % 20 for t in range(47)]
    tenant = {"f": F, "b": B, "a": A}
    batch = [(name, toks, tenant[name[0]]) for name, toks in prompts.items()]
    eng = make_engine(capacity=2048, chunk=48, policy=policy)
    order, cached = _admission_order(eng, batch)
    assert order == ["f0", "b0", "a0", "f1", "b1", "f2", "f3", "f4", "f5"] and cached == [0] * 9
    eng.check_integrity()


def test_the_tenants_turns_keep_each_tenants_own_longest_prefix_first():
    """With in-batch sharing, "lpm" re-ranks after each admission among the requests of the
    tenant whose turn it is: b's request on top of b's cached prefix goes first among b's, and f's
    burst still waits for b's turn."""
    shared = [7 + t % 30 for t in range(40)]
    eng = make_engine(capacity=2048, chunk=48)
    eng.add_request(shared + [60], greedy(2), namespace=B)
    run_all(eng)
    batch = [(f"f{i}", [40 + i] + [1 + (i * 7 + t) % 39 for t in range(47)], F) for i in range(3)]
    batch += [("b_new", [51] + [1 + t % 33 for t in range(47)], B), ("b_hit", shared + [61, 62], B)]
    order, cached = _admission_order(eng, batch)
    assert order == ["b_hit", "f0", "b_new", "f1", "f2"]
    assert cached == [0, 0, 0, 0, len(shared)]
    eng.check_integrity()


@pytest.mark.parametrize("tier_load", [True, False])
def test_a_request_waiting_for_the_kv_tiers_keeps_its_tenants_turn(tier_load):
    """Two rows: c0 then f0 are admitted, c1 waits (c's turn: admitted before f). f1 arrives and,
    with ``tier_load``, waits a step for its blocks from the KV tiers (the scheduler skips it).
    When c0 finishes, c's turn comes first either way: f1 waits in the queue, so f is no new
    tenant (first in turn); with the tier load f was forgotten and f1 went before c1."""
    eng = make_engine(capacity=2048, chunk=48, max_running=2)
    C = Namespace(tenant="c")
    got, loading = [], set()
    eng.events.subscribe(got.append, (RequestAdmitted,))
    eng.kv.tier_waiting = lambda r: r.request_id in loading  # as KVManager's: a tier load under way
    prompt = {n: [60 + i] + [1 + (i * 7 + t) % 39 for t in range(47)] for i, n in enumerate(("c0", "f0", "c1", "f1"))}
    tokens = {"c0": 3, "f0": 8, "c1": 2, "f1": 2}
    for name, ns in (("c0", C), ("f0", F), ("c1", C)):
        eng.add_request(prompt[name], greedy(tokens[name]), request_id=name, namespace=ns)
    outs = eng.step() + eng.step()  # c0, then f0 (f: a new tenant): both rows taken, c1 waits
    if tier_load:
        loading.add("f1")
    eng.add_request(prompt["f1"], greedy(tokens["f1"]), request_id="f1", namespace=F)
    outs += eng.step()  # no row free: nothing admitted (f1's blocks on their way); c0 finishes
    loading.clear()
    done = {o.request_id: o for o in outs if o.finished} | run_all(eng)
    assert [e.request_id for e in got] == ["c0", "f0", "c1", "f1"]
    assert {n: done[n].outputs[0].token_ids for n in done} == {n: reference(prompt[n], k) for n, k in tokens.items()}
    eng.check_integrity()


def test_a_tenant_share_of_the_queue_refuses_only_that_tenant():
    """``max_queued_requests_per_tenant`` 2: a's third waiting request is refused (a
    QueueFullError naming the field and the tenant) while b's and the tenant-less requests are
    still accepted; a request that finishes or is aborted gives its place back."""
    from radixkv.errors import QueueFullError

    eng = make_engine(capacity=512, chunk=48)
    eng.config.max_queued_requests_per_tenant = 2
    p = greedy(2)
    for ns in (A, A2, B, B, None, None):  # A2: another salt of tenant a
        eng.add_request([5, 6, 7], p, namespace=ns)
    with pytest.raises(QueueFullError) as info:
        eng.add_request([5, 6, 8], p, namespace=A)
    assert info.value.param == "max_queued_requests_per_tenant"
    msg = str(info.value)
    assert "2 requests of tenant 'a' wait" in msg and "max_queued_requests_per_tenant is 2" in msg
    with pytest.raises(QueueFullError, match="2 requests without a tenant wait"):
        eng.add_request([5, 6, 8], p)
    eng.abort_request(eng.add_request([9], p, namespace=Namespace(tenant="c")))
    run_all(eng)
    assert eng._unfinished_by_tenant == {}
    rid = eng.add_request([5, 6, 9], p, namespace=A)  # accepted again
    eng.add_request([5, 6, 10], p, namespace=A)
    eng.abort_request(rid)
    eng.step()
    eng.add_request([5, 6, 11], p, namespace=A)  # the aborted one's place
    run_all(eng)
    assert eng._unfinished_by_tenant == {}
    eng.check_integrity()
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="max_queued_requests_per_tenant must be None or an integer >= 1"):
            EngineConfig(max_queued_requests_per_tenant=bad).resolve()


@pytest.mark.parametrize("seed", range(2))
def test_tenants_salts_aborts_forks_and_retractions_keep_the_counts_and_outputs(seed):
    """Random arrivals of tenants, salts, requests without a tenant and other namespaces, n > 1,
    aborts and a pool small enough to retract, under a share of 2: a request is refused exactly
    when 2 or more of its tenant's wait, the per-tenant counts match the unfinished requests after every
    step (``check_integrity``) and end empty, and every request not aborted equals the reference."""
    from radixkv.cache.tenants import tenant_of
    from radixkv.errors import QueueFullError

    rng = random.Random(seed)
    spaces = [None, A, A2, B, Namespace(salt="x"), "other", Namespace(tenant="c", extra_key="k")]
    eng = make_engine(capacity=64, page_size=[1, 4][seed], chunk=24, max_running=4, policy=["lpm", "fcfs"][seed])
    eng.config.max_queued_requests_per_tenant = 2
    stems = [[rng.randrange(1, 64) for _ in range(rng.randrange(3, 30))] for _ in range(3)]
    expected, aborted, done, refused = {}, set(), {}, 0
    for _ in range(600):
        for ns in [rng.choice(spaces) for _ in range(rng.randrange(3))] if len(expected) + refused < 60 else []:
            t, running = tenant_of(ns), {r.request_id for r in eng.scheduler.running}
            queued = sum(tenant_of(g.namespace) == t and g.request_id not in running for g in eng._groups.values())
            prompt, mt = rng.choice(stems)[: rng.randrange(1, 30)] + [rng.randrange(1, 64)], rng.randrange(1, 16)
            try:
                expected[eng.add_request(prompt, greedy(mt, n=rng.choice([1, 2])), namespace=ns)] = reference(
                    prompt, mt
                )
            except QueueFullError:
                refused += 1
                assert queued >= 2  # more than 2 when retracted requests went back to the queue
            else:
                assert queued < 2
        if expected and rng.random() < 0.08:
            rid = rng.choice(sorted(expected))
            eng.abort_request(rid)
            aborted.add(rid)
        done.update((o.request_id, o) for o in eng.step() if o.finished)
        eng.check_integrity()
        if len(expected) + refused >= 60 and not eng.has_unfinished_requests():
            break
    assert refused > 0 and eng.cache_stats()["num_retractions"] > 0 and eng._unfinished_by_tenant == {}
    assert_outputs(expected, aborted, done)
    eng._unfinished_by_tenant["a"] = 1  # a leaked count is caught
    with pytest.raises(AssertionError, match="per-tenant counts"):
        eng.check_integrity()


# ---------------------------------------------------------------------------- Python API
def _llm(**kw) -> LLM:
    return LLM(model_runner=FakeRunner(512, 1), tokenizer=None, eos_token_ids=[], device="cpu",
               max_total_tokens=512, **kw)  # fmt: skip


def _cached(llm, prompt, params=None) -> int:
    return llm.generate(prompt, params or greedy(2), use_tqdm=False)[0].num_cached_tokens


def test_cache_salt_in_the_prompt_dict_or_sampling_params_splits_the_cache():
    llm = _llm()
    ids = list(range(1, 25))
    assert _cached(llm, {"prompt_token_ids": ids, "cache_salt": "s"}) == 0
    assert _cached(llm, {"prompt_token_ids": ids, "cache_salt": "s"}) == len(ids) - 1
    assert _cached(llm, {"prompt_token_ids": ids}) == 0  # no salt: another namespace
    assert _cached(llm, ids, greedy(2, cache_salt="s")) == len(ids) - 1  # SamplingParams: the same salt
    assert _cached(llm, {"prompt_token_ids": ids, "cache_salt": "s"}, greedy(2, cache_salt="s")) == len(ids) - 1
    with pytest.raises(ValueError) as e:  # both given and different
        _cached(llm, {"prompt_token_ids": ids, "cache_salt": "s"}, greedy(2, cache_salt="t"))
    assert e.value.param == "cache_salt"
    for bad in ("", "x" * 129, 5):
        with pytest.raises(RequestError) as e:
            _cached(llm, {"prompt_token_ids": ids, "cache_salt": bad})
        assert e.value.param == "cache_salt"
        with pytest.raises(RequestError) as e:
            SamplingParams(cache_salt=bad)
        assert e.value.param == "cache_salt"
    assert check_cache_salt("x" * 128) == "x" * 128
    assert with_salt(A, "s") == A2 and with_salt(None, None) is None and with_salt(A2, "s") == A2
    with pytest.raises(RequestError, match="differs"):
        with_salt(A2, "t")


def test_llm_namespace_is_a_tenant_in_process():
    """``LLM(namespace=Namespace(tenant=...))`` is every request's namespace: what the server's
    API key gives; a prompt's cache_salt joins it, and a call's own namespace replaces it."""
    llm = _llm(namespace=Namespace(tenant="a"))
    ids = list(range(1, 25))
    assert _cached(llm, ids) == 0 and _cached(llm, ids) == len(ids) - 1
    hit = len(ids) - 1  # a dry run: all but the last token would come from the cache
    assert llm.explain(prompt_token_ids=ids).outcome.num_cached_tokens == hit
    assert llm.explain(prompt_token_ids=ids, namespace=B).outcome.num_cached_tokens == 0
    # an explicit Namespace() is the shared default namespace, not this LLM's
    assert llm.explain(prompt_token_ids=ids, namespace=Namespace()).outcome.num_cached_tokens == 0
    assert _cached(llm, {"prompt_token_ids": ids, "cache_salt": "s"}) == 0  # Namespace(tenant="a", salt="s")
    assert llm.explain(prompt_token_ids=ids, namespace=A2).outcome.num_cached_tokens == hit
    assert llm.engine.cache_stats().tenants["a"]["cached"] == 2 * (len(ids) + 1)
    with llm.session(ids) as s:
        assert s.namespace == A
    out = llm.generate_batch([(ids, greedy(2), B)])[0]  # a call's own namespace
    assert out.num_cached_tokens == 0


def test_async_llm_namespace_and_prompt_salt():
    async def main():
        async with AsyncLLM(model_runner=FakeRunner(512, 1), tokenizer=None, eos_token_ids=[], device="cpu",
                            max_total_tokens=512, namespace=B) as alm:  # fmt: skip
            ids = list(range(3, 30))

            async def cached(prompt, **kw):
                final = None
                async for out in alm.generate(prompt, greedy(2), **kw):
                    final = out
                return final.num_cached_tokens

            got = [await cached(ids), await cached(ids), await cached(ids, namespace=A)]
            got += [await cached({"prompt_token_ids": ids, "cache_salt": "z"}), await cached(ids, namespace=A)]
            return got, alm.cache_stats().tenants

    got, tenants = asyncio.run(main())
    assert got == [0, 26, 0, 0, 26]
    assert set(tenants) == {"a", "b"} and tenants["b"]["cached"] == 2 * 28


def test_lifetime_counters_of_the_least_recently_admitted_tenants_are_forgotten(monkeypatch):
    """At most TENANT_COUNTERS_KEPT tenants keep their counters (a tenant per end user must not grow
    the engine without bound): the least recently admitted beyond it loses them; a tenant still
    holding cached tokens stays listed with counters from 0, one holding none is dropped."""
    import radixkv.engine.engine as engine_mod
    from radixkv.engine import Engine

    monkeypatch.setattr(engine_mod, "TENANT_COUNTERS_KEPT", 2)
    cfg = EngineConfig(device="cpu", max_total_tokens=256)
    eng = Engine(cfg, model_runner=FakeRunner(256, 1), tokenizer=None, eos_token_ids=[])
    counts: dict = {}
    eng.events.subscribe(_count_admissions(counts), (RequestAdmitted,))
    for name in ("t0", "t1", "t0", "t2"):  # t1 is now the least recently admitted
        eng.add_request(list(range(1, 30)), greedy(3), namespace=Namespace(tenant=name))
        run_all(eng)
    t = eng.cache_stats().tenants
    assert t["t0"] == tenant_row(31, None, 58, 28) and t["t2"] == tenant_row(31, None, 29, 0)
    assert t["t1"] == tenant_row(31, None, 0, 0)  # its pages are still cached: listed, counters forgotten
    assert eng.reset_prefix_cache()
    assert set(eng.cache_stats().tenants) == {"t0", "t2"}
    eng.add_request(list(range(1, 30)), greedy(3), namespace=Namespace(tenant="t1"))
    run_all(eng)
    t = eng.cache_stats().tenants  # t1 back, from 0; t0 (now least recent) forgotten and holds nothing
    assert set(t) == {"t1", "t2"} and t["t1"] == tenant_row(31, None, 29, 0) and counts["t1"] == [58, 0]
    for i in range(20):  # no reader of cache_stats() meanwhile (an LLM, a bare Engine)
        eng.add_request(list(range(1, 30)), greedy(3), namespace=Namespace(tenant=f"n{i}"))
        run_all(eng)
        assert len(eng._tenants_changed) <= 2 * 2 + 1 and len(eng._tenant_counts) <= 2
