"""Reporting checked against ground truth computed independently: per-request cached tokens
against an oracle of what the tree holds, the engine's totals against the sums of the outputs,
the snapshots a stream returns, ``usage`` and ``/metrics`` through a real server (n > 1,
aborts, refused requests, flushes), and the Prometheus exposition parsed by prometheus_client.
"""

from __future__ import annotations

import time

import httpx
import pytest
from model_helpers import tiny_loaded_model
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import Server

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


def scrape(server) -> dict:
    """GET /metrics parsed with prometheus_client's parser: {(sample name, labels): value}."""
    text = httpx.get(server.base_url + "/metrics", timeout=60).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


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
    prompts = [list(range(1000 + 100 * i, 1048 + 100 * i)) for i in range(3)]
    for _ in range(2):  # the second round loads what the small pool evicted to the host tier
        llm.generate(
            prompt_token_ids=prompts, sampling_params=SamplingParams(temperature=0, max_tokens=2), use_tqdm=False
        )
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

    from radixkv.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from radixkv.server import engine_client
    from radixkv.server.metrics import ServerMetrics

    class Clock:  # engine_client's ``time``: perf_counter moves only when a prompt gets its output
        now = 100.0

        @classmethod
        def perf_counter(cls):
            return cls.now

    class Backend:
        def generate(self, text, params, rid, prompt_token_ids, namespace=None, on_finish=None):
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
