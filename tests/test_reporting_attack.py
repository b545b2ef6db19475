"""Reporting checked against ground truth computed independently: per-request cached tokens
against an oracle of what the tree holds, the engine's totals against the sums of the outputs,
the snapshots a stream returns, ``usage`` and ``/metrics`` through a real server (n > 1,
aborts, refused requests, flushes), and the Prometheus exposition parsed by prometheus_client.
"""

from __future__ import annotations

import json
import os
import random
import time

import httpx
import pytest
from model_helpers import tiny_loaded_model
from pacing import paced_by_the_client
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import Server, scrape
from tier_fakes import loading_always_pays

from radixkv import LLM, AsyncLLM, SamplingParams
from radixkv.server.app import create_app

pytestmark = pytest.mark.timeout(600)

RADIX = {"method": "radix", "num_speculative_tokens": 5}
MODEL = "tiny"


@pytest.fixture(scope="module")
def tiny():
    return tiny_loaded_model()


@pytest.fixture(scope="module")
def tiny_llm(tiny):
    """An AsyncLLM on the tiny random Llama with radix drafts (page 1, a 4,096-token pool)."""
    a = AsyncLLM(
        loaded_model=tiny, device="cpu", attention_backend="cpu", max_total_tokens=4096, speculative_config=RADIX
    )
    yield a
    a.shutdown()


@pytest.fixture(scope="module")
def tiny_server(tiny_llm):
    s = Server(create_app(tiny_llm, served_model_name=MODEL))
    yield s
    s.stop()


def wait_idle(llm: AsyncLLM, timeout: float = 60.0) -> None:
    """Until the engine has nothing unfinished (its slots released), polled up to ``timeout``."""
    deadline = time.monotonic() + timeout
    while in_engine(llm, lambda e: e.has_unfinished_requests()):
        assert time.monotonic() < deadline, "the engine did not go idle"


def in_engine(llm: AsyncLLM, fn):
    """``fn(engine)`` on the engine thread, after every call posted before it (aborts included)."""
    return llm.submit(fn).result(60)


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


def test_a_refused_prompt_aborts_the_other_prompts_of_its_request(tiny_server, tiny_llm):
    """A completions request whose second prompt the engine refuses is a 400, and its first prompt
    is aborted before the answer is sent (``aclose()`` of its generator, still running its first
    ``__anext__``, raised and was swallowed: the prompt ran on, its tokens counted in /metrics as
    a completed request's when it finished first)."""
    before = scrape(tiny_server)
    body = {"model": MODEL, "prompt": [[1, 2, 3], [10**6]], "max_tokens": 2000, "ignore_eos": True}
    r = httpx.post(tiny_server.base_url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    in_engine(tiny_llm, lambda e: None)  # after the calls posted before the answer
    assert tiny_llm.num_unfinished_requests() == 0  # the abort was one of them
    wait_idle(tiny_llm)
    after = scrape(tiny_server)
    for name in ("radixkv_prompt_tokens_total", "radixkv_generation_tokens_total", "radixkv_cached_tokens_total"):
        assert after[(name, ())] == before.get((name, ()), 0), name
    aborted = ("radixkv_requests_finished_total", (("finish_reason", "abort"),))
    assert after[aborted] == before.get(aborted, 0) + 1


BAD_FOR_THE_ENGINE = [  # 400s the engine refuses (the server's own checks pass)
    ("/v1/completions", "completions", {"model": MODEL, "prompt": [10**6]}, "prompt"),
    ("/v1/chat/completions", "chat", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 1000}, "n"),
    ("/v1/completions", "completions", {"model": MODEL, "prompt": "hi", "regex": "(("}, "regex"),
    ("/generate", "generate", {"input_ids": [1, 2], "sampling_params": {"regex": "(("}}, "sampling_params.regex"),
]


@pytest.mark.parametrize("path,endpoint,body,param", BAD_FOR_THE_ENGINE, ids=lambda v: str(v)[:24])
def test_a_request_the_engine_refuses_is_not_counted_as_accepted(tiny_server, tiny_llm, path, endpoint, body, param):
    """radixkv_requests_total counts accepted requests: one the engine refuses (400) counts only
    in radixkv_request_errors_total, as one the server refuses itself (it counted in both)."""
    before = scrape(tiny_server)
    r = httpx.post(tiny_server.base_url + path, json=body, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["param"] == param
    wait_idle(tiny_llm)
    after = scrape(tiny_server)
    moved = {k: after[k] - before.get(k, 0) for k in after if k[0].endswith("_total") and after[k] != before.get(k, 0)}
    assert moved == {("radixkv_request_errors_total", (("status", "400"),)): 1.0}


def test_a_failed_request_is_not_counted_as_completed(tiny_server, tiny_llm, monkeypatch):
    """A request whose sampling raises gets a 500 and no usage: /metrics counts its choice under
    finish_reason "error" and none of its tokens (it counted them as a completed request's)."""
    from radixkv.sampling import processors

    real = processors.apply_logit_bias

    def faulty(x, rows, bias_ids, bias_vals):
        if any(7 in t.tolist() for t in bias_ids):
            raise IndexError("injected logit_bias fault")
        return real(x, rows, bias_ids, bias_vals)

    monkeypatch.setattr(processors, "apply_logit_bias", faulty)
    before = scrape(tiny_server)
    body = {"model": MODEL, "prompt": list(range(600, 640)), "max_tokens": 8, "logit_bias": {"7": 0.5}}
    r = httpx.post(tiny_server.base_url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 500 and r.json()["error"]["code"] == "request_failed"
    wait_idle(tiny_llm)
    after = scrape(tiny_server)
    moved = {k: after[k] - before.get(k, 0) for k in after if k[0].endswith("_total") and after[k] != before.get(k, 0)}
    assert moved == {
        ("radixkv_requests_total", (("endpoint", "completions"),)): 1.0,
        ("radixkv_request_errors_total", (("status", "500"),)): 1.0,
        ("radixkv_requests_finished_total", (("finish_reason", "error"),)): 1.0,
    }


def test_an_error_inside_a_started_stream_counts_as_a_500(tiny_server, tiny_llm, monkeypatch):
    """A request that fails after its stream's headers went out (HTTP 200, the error as an in-band
    event) counts in ``radixkv_request_errors_total{status="500"}`` as the internal error it
    reports; before, only errors answered with an error status counted."""
    from radixkv.sampling import processors

    real, calls = processors.apply_logit_bias, []

    def faulty(x, rows, bias_ids, bias_vals):
        if any(7 in t.tolist() for t in bias_ids):
            calls.append(1)
            if len(calls) >= 3:  # from its third token on: the first chunks are sent
                raise IndexError("injected logit_bias fault")
        return real(x, rows, bias_ids, bias_vals)

    monkeypatch.setattr(processors, "apply_logit_bias", faulty)
    before = scrape(tiny_server)
    body = {"model": MODEL, "prompt": list(range(700, 740)), "max_tokens": 8, "logit_bias": {"7": 0.5}, "stream": True}
    r = httpx.post(tiny_server.base_url + "/v1/completions", json=body, timeout=120)
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert r.status_code == 200 and events[-1]["error"]["code"] == "internal_error", r.text
    assert any(e.get("choices") for e in events[:-1])  # tokens were streamed before the error
    wait_idle(tiny_llm)
    after = scrape(tiny_server)
    moved = {k: after[k] - before.get(k, 0) for k in after if k[0].endswith("_total") and after[k] != before.get(k, 0)}
    assert moved[("radixkv_request_errors_total", (("status", "500"),))] == 1.0, moved
    assert moved[("radixkv_requests_finished_total", (("finish_reason", "error"),))] == 1.0, moved


def test_replicas_stats_keep_the_latency_buckets_and_the_shared_tier_size(tiny):
    """Summed over replicas (``--replicas N``), a tier's load-latency histogram keeps its bucket
    bounds (they were added too: with 2 replicas /metrics' ``le`` labels were twice the real
    bounds) and the remote tier all replicas share counts its capacity once (it was N times)."""
    from radixkv.engine.tier_io import LATENCY_BUCKETS
    from radixkv.server.backend import sum_stats
    from radixkv.server.metrics import ServerMetrics

    llm = LLM(
        loaded_model=tiny, device="cpu", attention_backend="cpu", page_size=16, max_total_tokens=64,
        host_cache_bytes=1 << 22,
    )  # fmt: skip
    loading_always_pays(llm.engine)  # the second round loads (not by timing)
    prompts = [list(range(1000 + 100 * i, 1048 + 100 * i)) for i in range(3)]
    for _ in range(2):  # the second round loads what the small pool evicted to the host tier
        llm.generate(
            prompt_token_ids=prompts, sampling_params=SamplingParams(temperature=0, max_tokens=2), use_tqdm=False
        )
        # the evictions' write-backs reached the host tier (a lookup does not wait for a queued write)
        assert llm.engine.kv.tiers.drain(60)
    one = llm.cache_stats().as_dict()
    host = one["tiers"]["host"]
    assert host["loaded"] > 0 and sum(host["load_latency"]["counts"]) > 0
    one["tiers"]["remote"] = {"hits": 2, "used_bytes": 0, "capacity_bytes": 1 << 30, "degraded": False}
    both = sum_stats([one, one])
    lat = both.tiers["host"]["load_latency"]
    assert lat["buckets"] == list(LATENCY_BUCKETS)
    assert lat["counts"] == [2 * c for c in host["load_latency"]["counts"]]
    assert both.tiers["remote"]["capacity_bytes"] == 1 << 30 and both.tiers["remote"]["hits"] == 4
    assert both.tiers["host"]["capacity_bytes"] == 2 * host["capacity_bytes"]  # each replica's own
    m = ServerMetrics()
    m.update_engine(both)
    fam = next(
        f for f in text_string_to_metric_families(m.render().decode()) if f.name.endswith("load_latency_seconds")
    )
    bounds = [s.labels["le"] for s in fam.samples if s.name.endswith("_bucket") and s.labels["tier"] == "host"]
    assert [float(b) for b in bounds] == [*LATENCY_BUCKETS, float("inf")]


def test_each_prompt_of_a_request_observes_its_own_time_to_first_token(monkeypatch):
    """A request of several prompts observes each prompt's own TTFT (and its latency when its
    first output is its last): each observed the time until every prompt had one."""
    import asyncio
    from types import SimpleNamespace

    from radixkv.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from radixkv.server import engine_client
    from radixkv.server.metrics import ServerMetrics

    class Clock:  # engine_client's ``time``: perf_counter moves only when a prompt gets its output
        now = 100.0

        @classmethod
        def perf_counter(cls):
            return cls.now

    class Backend:
        def model_facts(self):  # the engine's static facts: no max_queued_requests bound
            return SimpleNamespace(config={})

        def generate(self, text, params, rid, prompt_token_ids, namespace=None, on_finish=None, routing_key=None):
            async def gen():
                Clock.now += 1.0 if rid.endswith("-0") else 5.0  # prompt 0 after 1 s, prompt 1 after 5 more
                c = CompletionOutput(0, "x", [5], "length")
                yield RequestOutput(rid, text, prompt_token_ids, [c], True, 0, RequestMetrics(arrival_time=0.0))

            return gen()

    monkeypatch.setattr(engine_client, "time", Clock)
    metrics = ServerMetrics()
    client = engine_client.EngineClient(Backend(), metrics)
    prompts = [(None, [1, 2]), (None, [3, 4])]
    run = asyncio.run(client.start("completions", prompts, SamplingParams(max_tokens=1), "prompt"))
    assert [o.finished for o in run.firsts] == [True, True]
    got = {s.name: s.value for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples}
    for name in ("radixkv_time_to_first_token_seconds", "radixkv_e2e_request_latency_seconds"):
        assert (got[name + "_count"], got[name + "_sum"]) == (2.0, 1.0 + 6.0), name


def test_a_generation_of_zero_new_tokens_counts_none(tiny_server, tiny_llm):
    """SGLang's ``max_new_tokens: 0`` (its frontend's ``select`` sends it for every choice): the
    engine samples one token and drops it; /metrics counts the prompt and no generated token, as
    ``meta_info.completion_tokens`` says (it counted 1 per prompt)."""
    before = scrape(tiny_server)
    prompts = [list(range(700, 740)), list(range(800, 830))]
    body = {"input_ids": prompts, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True}
    r = httpx.post(tiny_server.base_url + "/generate", json=body, timeout=120)
    assert r.status_code == 200 and [x["meta_info"]["completion_tokens"] for x in r.json()] == [0, 0]
    body = {"input_ids": prompts[0] + [5], "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}
    assert (
        httpx.post(tiny_server.base_url + "/generate", json=body, timeout=120).json()["meta_info"]["completion_tokens"]
        == 3
    )
    wait_idle(tiny_llm)
    after = scrape(tiny_server)
    gen, prompt = ("radixkv_generation_tokens_total", ()), ("radixkv_prompt_tokens_total", ())
    assert after[gen] - before.get(gen, 0) == 3
    assert after[prompt] - before.get(prompt, 0) == 40 + 30 + 41
    assert not tiny_server.server.config.app.state.metrics._hidden  # nothing left behind


# ---------------------------------------------------------------------- what held: the invariants


def _lcp(a, b) -> int:
    return len(os.path.commonprefix([list(a), list(b)]))


@pytest.mark.parametrize("page_size,spec", [(1, None), (16, RADIX)])
def test_cached_tokens_equal_an_oracle_of_what_the_tree_holds(tiny, page_size, spec):
    """Requests one at a time (n 1 or 2, sampled): each one's num_cached_tokens is the longest
    common prefix with any sequence computed before (prompt + output but its last token), capped
    at its prompt - 1 and floored to the page; its tiers' split sums to it."""
    llm = LLM(loaded_model=tiny, device="cpu", attention_backend="cpu", page_size=page_size, speculative_config=spec)
    rng = random.Random(page_size)
    seqs: list = []
    for i in range(20):
        if seqs and rng.random() < 0.7:
            src = rng.choice(seqs)
            prompt = src[: rng.randrange(1, len(src) + 1)] + [rng.randrange(100, 5000) for _ in range(rng.randrange(4))]
        else:
            prompt = [rng.randrange(100, 5000) for _ in range(rng.randrange(2, 60))]
        prompt = prompt if len(prompt) >= 2 else prompt + [7, 8]
        expected = min(max([_lcp(prompt, s) for s in seqs] + [0]), len(prompt) - 1) // page_size * page_size
        params = SamplingParams(temperature=1.0, seed=i, max_tokens=rng.randrange(1, 12), n=rng.choice([1, 2]))
        out = llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)[0]
        assert out.num_cached_tokens == expected, i
        assert out.cached_tokens_by_tier == {"device": expected, "host": 0, "disk": 0, "remote": 0}
        seqs += [(prompt + c.token_ids)[:-1] for c in out.outputs]


CONFIGS = {
    "chunked page 16": dict(page_size=16, chunked_prefill_size=32),
    "small pool + tiers": dict(page_size=16, max_total_tokens=512, chunked_prefill_size=64, host_cache_bytes=1 << 22),
    "drafts, preempted": dict(page_size=1, max_total_tokens=640, chunked_prefill_size=48, speculative_config=RADIX),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_engine_totals_are_the_sums_of_what_requests_report(tiny, tmp_path, name):
    """Batches sharing prefixes (n 1-2, repeats): the engine's totals equal the sums over the
    outputs (prompt, cached, by tier, generated, drafts), prefill tokens are the prompt tokens not
    cached (without retractions), each outcome's causes sum to its missed tokens, and the pool is
    idle after."""
    cfg = dict(CONFIGS[name])
    if "host_cache_bytes" in cfg:
        cfg["disk_cache_dir"] = str(tmp_path)
    llm = LLM(loaded_model=tiny, device="cpu", attention_backend="cpu", **cfg)
    if llm.engine.kv.tiers is not None:
        loading_always_pays(llm.engine)  # what the tiers serve (asserted below) must not depend on timing
    rng = random.Random(len(name))
    base = [rng.randrange(100, 5000) for _ in range(120)]
    outs, rounds = [], []
    for k in range(4):  # the last round repeats the first (evicted from a small pool since)
        prompts = [
            base[: rng.randrange(10, 120)] + [rng.randrange(100, 5000) for _ in range(rng.randrange(1, 30))]
            for _ in range(8)
        ]
        prompts = rounds[0] if k == 3 else prompts + rng.sample(prompts, 2)
        rounds.append(prompts)
        params = [
            SamplingParams(
                temperature=0.7, seed=i, max_tokens=rng.randrange(20, 90), n=rng.choice([1, 1, 2]), ignore_eos=True
            )
            for i in range(len(prompts))
        ]
        s0 = llm.cache_stats()
        batch = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        s1 = llm.cache_stats()
        if s1["num_retractions"] == s0["num_retractions"] and all(p.n == 1 for p in params):
            assert s1["prefill_tokens"] - s0["prefill_tokens"] == sum(
                len(o.prompt_token_ids) - o.num_cached_tokens for o in batch
            )
        outs += batch
    s = llm.cache_stats()
    assert s["prompt_tokens"] == sum(len(o.prompt_token_ids) for o in outs)
    assert s["cached_tokens"] == sum(o.num_cached_tokens for o in outs)
    assert s["generated_tokens"] == sum(len(c.token_ids) for o in outs for c in o.outputs)
    for m in ("device", "host", "disk", "remote"):
        assert s["cached_tokens_by_tier"][m] == sum(o.cached_tokens_by_tier[m] for o in outs), m
    assert s["spec_draft_tokens"] == sum(o.metrics.spec_draft_tokens for o in outs)
    assert s["spec_accepted_tokens"] == sum(o.metrics.spec_accepted_tokens for o in outs)
    for o in outs:
        assert sum(o.cached_tokens_by_tier.values()) == o.num_cached_tokens <= len(o.prompt_token_ids)
        assert sum(o.cache_outcome.missed.values()) == len(o.prompt_token_ids) - o.num_cached_tokens
    for m, t in s["tiers"].items():
        assert t["served_tokens"] == s["cached_tokens_by_tier"][m]
    assert (s["running"], s["waiting"], s["in_use"], s["pinned"], s["protected"]) == (0, 0, 0, 0, 0)
    assert s["free"] + s["evictable"] == s["capacity"]
    if name == "drafts, preempted":
        assert s["num_retractions"] > 0 and s["spec_accepted_tokens"] > 0
    if name == "small pool + tiers":
        assert s["cached_tokens_by_tier"]["host"] + s["cached_tokens_by_tier"]["disk"] > 0, s["cached_tokens_by_tier"]


def _post(server, path: str, body: dict) -> dict:
    r = httpx.post(server.base_url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _stream_usage(server, path: str, body: dict, stop_after: int | None = None, on_chunk=lambda: None):
    """The usage of a streamed request (None when it was left after ``stop_after`` chunks);
    ``on_chunk()`` is called as each chunk is read."""
    chunks = []
    with httpx.stream("POST", server.base_url + path, json={**body, "stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
                on_chunk()
                if stop_after is not None and len(chunks) >= stop_after:
                    return None  # leaving closes the connection mid-stream: an abort
    assert all(c["usage"] is None for c in chunks[:-1]) and chunks[-1]["choices"] == []
    return chunks[-1]["usage"]


def _check_exposition(text: str) -> None:
    """Every sample non-negative; each histogram's buckets cumulative, ``+Inf`` equal to its count."""
    for fam in text_string_to_metric_families(text):
        assert all(s.value >= 0 for s in fam.samples), fam.name
        if fam.type != "histogram":
            continue
        series: dict = {}
        for s in fam.samples:
            key = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
            series.setdefault(key, []).append(s)
        for samples in series.values():
            buckets = [(float(s.labels["le"]), s.value) for s in samples if s.name.endswith("_bucket")]
            count = next(s.value for s in samples if s.name.endswith("_count"))
            assert buckets == sorted(buckets) and buckets[-1] == (float("inf"), count), fam.name


def test_usage_and_metrics_agree_through_the_server(tiny_server, tiny_llm, tiny, monkeypatch):
    """n > 1 chat (non-streamed and streamed with usage), two identical prompts in one request (the
    second computes nothing), aborted streams: /metrics moves by exactly the usage the clients
    got, the missed causes sum to the uncached prompt tokens, the gauges are back to idle and the
    exposition is valid."""
    assert httpx.post(tiny_server.base_url + "/flush_cache", timeout=60).json()["flushed"] is True
    before = scrape(tiny_server)
    rng = random.Random(11)
    words = " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "omega"]) for _ in range(40))
    messages = [{"role": "system", "content": words}, {"role": "user", "content": "Name three colors."}]
    rendered = tiny.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_len = len(tiny.tokenizer.encode(rendered, add_special_tokens=False))
    chat = {"model": MODEL, "messages": messages, "max_tokens": 20, "n": 3, "temperature": 0.9, "seed": 1}
    usages = [_post(tiny_server, "/v1/chat/completions", chat)["usage"] for _ in range(2)]
    usages.append(
        _stream_usage(tiny_server, "/v1/chat/completions", {**chat, "stream_options": {"include_usage": True}})
    )
    assert [u["prompt_tokens"] for u in usages] == [prompt_len] * 3
    assert [u["prompt_tokens_details"]["cached_tokens"] for u in usages] == [0, prompt_len - 1, prompt_len - 1]
    assert usages[2] == usages[1] and usages[1]["completion_tokens"] == 60
    ids = [rng.randrange(100, 5000) for _ in range(48)]
    twice = _post(
        tiny_server, "/v1/completions", {"model": MODEL, "prompt": [ids, ids], "max_tokens": 5, "temperature": 0}
    )
    usages.append(twice["usage"])
    assert twice["usage"]["prompt_tokens_details"]["cached_tokens"] == 48  # 0 + the whole prompt (a rider)
    assert twice["choices"][0]["text"] == twice["choices"][1]["text"]
    long = {"model": MODEL, "prompt": ids + [1], "max_tokens": 500, "ignore_eos": True, "n": 2}
    with paced_by_the_client(tiny_llm, monkeypatch=monkeypatch) as read:  # the abort lands long before the 500th token
        assert _stream_usage(tiny_server, "/v1/completions", long, stop_after=3, on_chunk=read) is None
    wait_idle(tiny_llm)
    text = httpx.get(tiny_server.base_url + "/metrics", timeout=60).text
    _check_exposition(text)
    after = scrape(tiny_server)

    def moved(name, labels=()):
        return after.get((name, labels), 0) - before.get((name, labels), 0)

    assert moved("radixkv_prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert moved("radixkv_cached_tokens_total") == sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert moved("radixkv_generation_tokens_total") == sum(u["completion_tokens"] for u in usages)
    missed = sum(moved(k[0], k[1]) for k in after if k[0] == "radixkv_missed_prompt_tokens_total")
    assert missed == moved("radixkv_prompt_tokens_total") - moved("radixkv_cached_tokens_total")
    assert moved("radixkv_requests_finished_total", (("finish_reason", "abort"),)) == 2  # per choice
    assert moved("radixkv_requests_finished_total", (("finish_reason", "length"),)) == 3 * 3 + 2
    assert moved("radixkv_time_to_first_token_seconds_count") == 3 + 2 + 1
    assert moved("radixkv_e2e_request_latency_seconds_count") == 3 + 2
    idle = {k[0]: v for k, v in after.items() if not k[1]}
    assert idle["radixkv_num_requests_running"] == idle["radixkv_num_requests_waiting"] == 0
    assert idle["radixkv_kv_protected_tokens"] == 0
    assert idle["radixkv_kv_free_tokens"] + idle["radixkv_kv_evictable_tokens"] == idle["radixkv_kv_capacity_tokens"]
