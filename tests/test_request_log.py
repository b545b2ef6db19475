"""``radixkv serve --log-requests``: a real server on 127.0.0.1 called with the ``openai`` SDK logs
every completions / chat body in the trace format, and ``radixkv explain`` of that trace gives
exactly the missed tokens per cause the server counted in ``/metrics``.

The engine runs over a runner without a model (tests/obs_helpers.py) with the default model's
tokenizer: which prompt tokens are cached does not depend on the outputs here (single-turn
prompts sent one after the other)."""

from __future__ import annotations

import os

import httpx
import openai
import pytest
from obs_helpers import null_engine
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import Server

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from radixkv.async_llm import AsyncLLM  # noqa: E402
from radixkv.obs.explain import explain_trace  # noqa: E402
from radixkv.obs.trace import read_trace, tokenize_trace  # noqa: E402
from radixkv.server.app import create_app  # noqa: E402

pytestmark = pytest.mark.timeout(300)

SYSTEM = "You are a support agent of a bike shop. Today is {day}. Answer in one sentence, politely and precisely."


def test_logged_trace_explains_what_the_server_counted(default_model, tmp_path):
    tok = default_model.tokenizer
    log = tmp_path / "requests.jsonl"
    llm = AsyncLLM(engine=null_engine(tok, capacity=32768))
    server = Server(create_app(llm, served_model_name="smollm2-135m", log_requests=str(log)))
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        sent = []
        for day, q in [("Monday", "Do you repair brakes?"), ("Tuesday", "Do you sell helmets?"),
                       ("Tuesday", "Are you open on Sunday?"), ("Friday", "Do you repair brakes?")]:  # fmt: skip
            messages = [{"role": "system", "content": SYSTEM.format(day=day)}, {"role": "user", "content": q}]
            r = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=2)
            sent.append((messages, r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens))
        forged = {"model": "smollm2-135m", "messages": messages, "max_tokens": 2, "tenant": "alice"}
        bad = httpx.post(server.base_url + "/v1/chat/completions", json=forged, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tenant", bad.text  # never ran: not logged
        c = client.completions.create(model="smollm2-135m", prompt="Bikes are", max_tokens=2)
        metrics = httpx.get(server.base_url + "/metrics", timeout=60).text
    finally:
        server.stop()
        llm.shutdown()
    bodies = read_trace(log)
    assert len(bodies) == 5 and bodies[-1]["prompt"] == "Bikes are" and bodies[0]["max_tokens"] == 2
    assert [b["messages"] for b in bodies[:4]] == [m for m, _, _ in sent]
    reqs = tokenize_trace(bodies, tok)
    assert [len(r.tokens) for r in reqs] == [n for _, n, _ in sent] + [c.usage.prompt_tokens]
    rep = explain_trace(reqs, tok, capacity=32768, sweep=())
    assert rep["cached_tokens"] == sum(k for _, _, k in sent) + c.usage.prompt_tokens_details.cached_tokens
    counted = {
        s.labels["cause"]: int(s.value)
        for fam in text_string_to_metric_families(metrics)
        if fam.name == "radixkv_missed_prompt_tokens"
        for s in fam.samples
        if s.name.endswith("_total")
    }
    assert counted == rep["missed_by_cause"] and counted.get("diverged", 0) > 0
