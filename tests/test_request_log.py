"""``radixkv serve --log-requests``: a real server on 127.0.0.1 called with the ``openai`` SDK logs
every completions / chat body in the trace format, and ``radixkv explain`` of that trace gives
exactly the missed tokens per cause the server counted in ``/metrics``; requests the server refused
are not in it.

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


class _Lines:
    """The request log's file, in memory: the bodies written, in order."""

    def __init__(self):
        self.bodies = []

    def write(self, body):
        self.bodies.append(body)


async def _post_through(mw, body: dict, path: str) -> None:
    """``body`` POSTed to ``path`` through the middleware ``mw`` (its answer dropped)."""
    import json

    async def receive():
        return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}

    async def send(message):
        pass

    await mw({"type": "http", "method": "POST", "path": path}, receive, send)


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
        with pytest.raises(openai.BadRequestError):  # refused by the engine's limits: never ran, not logged
            client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=10**6)
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


def test_lines_keep_the_read_order_and_only_accepted_requests_are_logged():
    """The middleware over a fake app: a body waits for the ones read before it; an error answer
    drops its body; a request that ends without an answer (its client left) is logged."""
    import asyncio
    import json

    from radixkv.server.request_log import RequestLogMiddleware

    gates, read = {}, {}

    async def app(scope, receive, send):
        body = json.loads((await receive())["body"])
        read[body["id"]].set()
        await gates[body["id"]].wait()
        if body.get("leave"):
            return  # no answer: as when the client went away mid-request
        await send({"type": "http.response.start", "status": body["status"], "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def main():
        lines = _Lines()
        mw = RequestLogMiddleware(app, lines)
        bodies = [
            {"id": 0, "status": 200},
            {"id": 1, "status": 400},
            {"id": 2, "leave": True},
            {"id": 3, "status": 200},
        ]
        for b in bodies:
            gates[b["id"]], read[b["id"]] = asyncio.Event(), asyncio.Event()

        async def call(b):
            await _post_through(mw, b, "/v1/chat/completions")

        tasks = []
        for b in bodies:  # read in this order
            tasks.append(asyncio.create_task(call(b)))
            await read[b["id"]].wait()
        for i in (3, 1, 2):  # answered out of order: nothing may be written before 0 is
            gates[i].set()
            await tasks[i]
            assert lines.bodies == []
        gates[0].set()
        await tasks[0]
        return [b["id"] for b in lines.bodies]

    assert asyncio.run(main()) == [0, 2, 3]


def test_a_new_request_log_is_the_servers_users_alone(tmp_path):
    """The request log holds every tenant's prompts: a file it creates is 0600 whatever the umask
    (before: 0644 under the usual 022, readable by every local user); an existing file keeps its
    mode (the operator's) and is appended to."""
    from radixkv.obs.trace import TraceWriter

    old = os.umask(0o022)
    try:
        with TraceWriter(tmp_path / "logs" / "requests.jsonl") as w:
            w.write({"prompt": "alice's secret", "tenant": "alice"})
        kept = tmp_path / "kept.jsonl"
        kept.write_text('{"prompt":"x"}\n')
        kept.chmod(0o640)
        with TraceWriter(kept) as w:
            w.write({"prompt": "y"})
    finally:
        os.umask(old)
    assert (tmp_path / "logs" / "requests.jsonl").stat().st_mode & 0o777 == 0o600
    assert kept.stat().st_mode & 0o777 == 0o640
    assert [b["prompt"] for b in read_trace(kept)] == ["x", "y"]


def test_a_refused_body_is_not_kept_while_an_earlier_request_runs():
    """A body waits for the requests read before it, but one the app refused (never logged) is
    let go at once: before, it stayed in memory until every earlier request finished, so a client
    holding one long request open could pile refused bodies up without bound (through radixkv serve,
    twenty 21 MB bodies answered 400 beside one 600-token completion grew the server by 700 MiB,
    given back only when the completion ended)."""
    import asyncio
    import json

    from radixkv.server.request_log import RequestLogMiddleware

    gate = asyncio.Event

    async def main():
        lines, head_read, head_go = _Lines(), gate(), gate()

        async def app(scope, receive, send):
            body = json.loads((await receive())["body"])
            if body["id"] == 0:
                head_read.set()
                await head_go.wait()
            await send({"type": "http.response.start", "status": body["status"], "headers": []})
            await send({"type": "http.response.body", "body": b""})

        mw = RequestLogMiddleware(app, lines)

        async def call(b):
            await _post_through(mw, b, "/v1/completions")

        head = asyncio.create_task(call({"id": 0, "status": 200}))
        await head_read.wait()
        for i in range(1, 4):
            await call({"id": i, "status": 400, "junk": "y" * 1000})
        await call({"id": 4, "status": 200})
        kept = [e.body["id"] if e.body is not None else None for e in mw._pending]
        head_go.set()
        await head
        return kept, [b["id"] for b in lines.bodies]

    kept, logged = asyncio.run(main())
    assert kept == [0, None, None, None, 4]  # the refused bodies are gone; the order still holds
    assert logged == [0, 4]
