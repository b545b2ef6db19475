"""Every route of radixkv's app (``create_app`` and the routers it includes), each with a check
of its answer: the one table both servers run, the single engine (tests/test_server.py) and Ray
Serve replicas (tests/test_ray_routing.py), so a route that answers on one and fails on the other
is a failing test. ``uncovered(app)`` names the app's routes the table lacks (a new route must
come with its row).

Each check sends a few small greedy requests and asserts values: token counts against the
tokenizer, cached tokens of a repeated prompt, streamed text against the non-streamed text, the
KV capacity and pins in ``/cache_stats``, the Prometheus counters a request moves. Where the
single engine and the replicas differ by design, :class:`Target` says which: ``/flush_cache``
and ``/reset_prefix_cache`` answer 409 ``flush_not_offered`` across replicas, stored Responses
hold no KV pin there, and the stats are the replicas' sums.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import httpx
from prometheus_client.parser import text_string_to_metric_families

import radixkv
from radixkv.chat_template import encode_chat

MODEL = "smollm2-135m"
PROMPT = (
    "A field guide entry. The red fox is a small carnivore found across the northern hemisphere; "
    "it hunts rodents at dusk and dawn, stores food in shallow caches for the winter, and raises "
    "its kits in a den that is"
)
"""Two whole 16-token blocks and more: across replicas its repeats are routed to the replica that
caches it (the router sees whole blocks)."""


@dataclass
class Target:
    """The server under test.

    Attributes:
        http: an ``httpx.Client`` on its base URL.
        tokenizer: the served model's tokenizer.
        replicas: 1 (one engine, ``radixkv serve``) or the number of Ray Serve replicas.
        capacity: KV pool tokens of each engine.
        settle: called before a follow-up that must find the earlier request's prefix cached:
            across replicas it waits until the router took in what the earlier requests left
            (their completions, the replicas' cache events), so that the follow-up is routed to
            the replica that caches it; nothing to wait for on one engine.
    """

    http: httpx.Client
    tokenizer: Any
    replicas: int = 1
    capacity: int = 16384
    settle: Callable[[], None] = lambda: None

    def ids(self, text: str = PROMPT) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def stats(self) -> dict:
        """``/cache_stats?check=1``: fresh (every replica checked and asked at once)."""
        r = self.http.get("/cache_stats", params={"check": "1"})
        assert r.status_code == 200, r.text
        return r.json()

    def max_context_len(self) -> int:
        return self.http.get("/v1/models").json()["data"][0]["max_model_len"]


def sse_data(r: httpx.Response) -> list:
    """The ``data:`` payloads of an event stream (JSON, or the raw ``[DONE]``)."""
    out = []
    for line in r.iter_lines():
        if line.startswith("data:"):
            payload = line[5:].strip()
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    return r.json()["error"]


# ------------------------------------------------------------------------------ OpenAI
def check_completions(t: Target) -> None:
    ids = t.ids()
    body = {"model": MODEL, "prompt": ids, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    first = t.http.post("/v1/completions", json=body).json()
    assert first["choices"][0]["finish_reason"] == "length"
    assert (first["usage"]["prompt_tokens"], first["usage"]["completion_tokens"]) == (len(ids), 4)
    t.settle()
    again = t.http.post("/v1/completions", json=body).json()  # all but its last token cached (same replica)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == len(ids) - 1
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    with t.http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        events = sse_data(r)
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]) == first["choices"][0]["text"]
    _check_refusals(t, body)
    _check_stream_left(t, body)


def _check_refusals(t: Target, body: dict) -> None:
    """What the engine refuses is a 400 in OpenAI's error format naming the field, streamed or
    not (before any event), the same from the replicas as from one engine."""
    vocab, ctx, n = len(t.tokenizer), t.max_context_len(), len(body["prompt"])
    too_long = "context_length_exceeded"
    cases = [
        ({"prompt": [vocab]}, "prompt", "invalid_value", f"prompt_token_ids holds {vocab}, outside the vocabulary [0, {vocab})"),
        ({"prompt": []}, "prompt", "invalid_value", "prompt must be a non-empty string, token list, or list of those"),
        ({"max_tokens": ctx}, "max_tokens", too_long, f"max_tokens={ctx} plus the {n} prompt tokens exceeds this "
         f"model's context of {ctx} tokens (at most {ctx - n} new tokens)"),
        ({"prompt": [5] * ctx}, "prompt", too_long, f"prompt has {ctx} tokens; this model's context is {ctx} tokens "
         f"(at most {ctx - 1} prompt tokens, leaving room for one generated token)"),
    ]  # fmt: skip
    for change, param, code, message in cases:
        for stream in (False, True):
            r = t.http.post("/v1/completions", json={**body, **change, "stream": stream})
            err = _error(r, 400)
            assert r.headers["content-type"] == "application/json", r.headers
            assert err == {"message": message, "type": "invalid_request_error", "param": param, "code": code}, err


def _check_stream_left(t: Target, body: dict) -> None:
    """A client that leaves a stream after two events: its request is aborted where it runs (its
    slots freed, nothing left running), counted as ``finish_reason="abort"``."""
    before = _samples(t).get(("radixkv_requests_finished_total", (("finish_reason", "abort"),)), 0)
    long = {**body, "prompt": t.ids()[:20], "max_tokens": 2000, "stream": True}
    with t.http.stream("POST", "/v1/completions", json=long) as r:
        assert r.status_code == 200
        for n, _ in enumerate(line for line in r.iter_lines() if line.startswith("data:")):
            if n == 1:
                break
    deadline = time.monotonic() + 30
    while True:  # the abort crosses to the engine (and, across replicas, to its replica) soon after
        s = t.stats()
        if s["running"] == s["waiting"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert s["running"] == s["waiting"] == 0 and s["free"] + s["evictable"] + s["pinned"] == s["capacity"], s
    after = _samples(t)[("radixkv_requests_finished_total", (("finish_reason", "abort"),))]
    assert after == before + 1


def check_chat(t: Target) -> None:
    msgs = [{"role": "user", "content": "Name three colors."}]
    body = {"model": MODEL, "messages": msgs, "max_tokens": 5, "temperature": 0}
    r = t.http.post("/v1/chat/completions", json=body).json()
    assert r["usage"]["prompt_tokens"] == len(encode_chat(t.tokenizer, msgs))
    assert r["choices"][0]["message"]["role"] == "assistant" and r["usage"]["completion_tokens"] <= 5
    with t.http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
        events = sse_data(s)
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"])
    assert text == r["choices"][0]["message"]["content"]


def _respond(t: Target, **fields: Any) -> dict:
    body = {"model": MODEL, "input": "Say hi.", "max_output_tokens": 4, "temperature": 0, **fields}
    r = t.http.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def check_responses_create(t: Target) -> None:
    first = _respond(t)
    assert first["usage"]["input_tokens"] == len(encode_chat(t.tokenizer, [{"role": "user", "content": "Say hi."}]))
    assert first["output"][0]["type"] == "message" and first["status"] in ("completed", "incomplete")
    context = first["usage"]["input_tokens"] + first["usage"]["output_tokens"]
    # the follow-up continues the stored context token for token: all of it but the last token is
    # cached (pinned on one engine; on the replica the follow-up is routed to across replicas)
    t.settle()
    follow = _respond(t, input="Again.", previous_response_id=first["id"])
    assert follow["usage"]["input_tokens_details"]["cached_tokens"] == context - 1
    with t.http.stream("POST", "/v1/responses", json={"model": MODEL, "input": "Say hi.", "stream": True,
                                                     "max_output_tokens": 4, "temperature": 0}) as r:  # fmt: skip
        events = [e for e in sse_data(r) if e != "[DONE]"]
    assert events[0]["type"] == "response.created" and events[-1]["type"] in (
        "response.completed",
        "response.incomplete",
    )
    assert events[-1]["response"]["output"][0]["content"] == first["output"][0]["content"]
    # a streamed third turn continues the follow-up as the follow-up continued the first (across
    # replicas: routed to the replica that caches the chain)
    t.settle()
    with t.http.stream("POST", "/v1/responses", json={"model": MODEL, "input": "Once more.", "stream": True,
                                                     "previous_response_id": follow["id"],
                                                     "max_output_tokens": 4, "temperature": 0}) as r:  # fmt: skip
        streamed = [e for e in sse_data(r) if e != "[DONE]"][-1]["response"]
    follow_context = follow["usage"]["input_tokens"] + follow["usage"]["output_tokens"]
    assert streamed["usage"]["input_tokens_details"]["cached_tokens"] == follow_context - 1
    assert streamed["status"] in ("completed", "incomplete") and streamed["previous_response_id"] == follow["id"]
    for rid in (first["id"], follow["id"], events[-1]["response"]["id"], streamed["id"]):
        assert t.http.delete(f"/v1/responses/{rid}").status_code == 200


def check_responses_retrieve(t: Target) -> None:
    made = _respond(t)
    got = t.http.get(f"/v1/responses/{made['id']}").json()
    assert got == made
    assert t.http.delete(f"/v1/responses/{made['id']}").status_code == 200
    assert _error(t.http.get(f"/v1/responses/{made['id']}"), 404)["code"] == "not_found"


def check_responses_input_items(t: Target) -> None:
    first = _respond(t)
    follow = _respond(t, input="Again.", previous_response_id=first["id"])
    page = t.http.get(f"/v1/responses/{follow['id']}/input_items", params={"order": "asc"}).json()
    texts = [(it["role"], it["content"][0]["text"]) for it in page["data"]]
    assert texts == [("user", "Say hi."), ("assistant", first["output"][0]["content"][0]["text"]), ("user", "Again.")]
    assert page["data"][1]["id"] == first["output"][0]["id"] and not page["has_more"]
    assert (
        _error(t.http.get(f"/v1/responses/{follow['id']}/input_items", params={"limit": 101}), 400)["param"] == "limit"
    )
    for rid in (first["id"], follow["id"]):
        assert t.http.delete(f"/v1/responses/{rid}").status_code == 200
    assert _error(t.http.get(f"/v1/responses/{first['id']}/input_items"), 404)["code"] == "not_found"


def check_responses_delete(t: Target) -> None:
    made = _respond(t, input="Name a planet.")  # a prompt no other check continues
    context = made["usage"]["input_tokens"] + made["usage"]["output_tokens"]
    # one engine pins the stored context (all but the last token, never computed); replicas pin nothing
    pinned = t.stats()["pinned"]
    assert pinned == (context - 1 if t.replicas == 1 else 0), (pinned, context, made["usage"])
    assert t.http.delete(f"/v1/responses/{made['id']}").json() == {
        "id": made["id"],
        "object": "response",
        "deleted": True,
    }
    assert t.stats()["pinned"] == 0
    assert _error(t.http.get(f"/v1/responses/{made['id']}"), 404)["code"] == "not_found"
    assert _error(t.http.delete(f"/v1/responses/{made['id']}"), 404)["code"] == "not_found"


def check_responses_cancel(t: Target) -> None:
    """OpenAI cancels only ``background`` responses, which radixkv never creates: a stored one is a
    400 (and stays as it was), an unknown id a 404."""
    made = _respond(t, input="Name a river.")
    err = _error(t.http.post(f"/v1/responses/{made['id']}/cancel"), 400)
    assert err["code"] == "invalid_request" and err["param"] == "response_id" and "background" in err["message"]
    assert t.http.get(f"/v1/responses/{made['id']}").json() == made
    assert t.http.delete(f"/v1/responses/{made['id']}").json()["deleted"] is True
    assert _error(t.http.post(f"/v1/responses/{made['id']}/cancel"), 404)["code"] == "not_found"
    assert _error(t.http.post("/v1/responses/resp_none/cancel"), 404)["code"] == "not_found"


def check_models(t: Target) -> None:
    models = t.http.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == t.http.get("/get_model_info").json()["max_context_len"]


def check_model(t: Target) -> None:
    card = t.http.get(f"/v1/models/{MODEL}").json()
    assert card["id"] == MODEL and card["max_model_len"] == t.max_context_len()
    assert _error(t.http.get("/v1/models/gpt-4"), 404)["code"] == "model_not_found"


# ------------------------------------------------------------------------------ engine routes
def check_health(t: Target) -> None:
    r = t.http.get("/health")
    want = {"status": "ok", "degraded_tiers": []}
    if t.replicas > 1:
        want["replicas"] = {"live": t.replicas, "replicas": t.replicas}
    assert r.status_code == 200 and r.json() == want, r.text


def check_cache_stats(t: Target) -> None:
    plain = t.http.get("/cache_stats").json()
    checked = t.stats()
    for s in (plain, checked):
        assert s["capacity"] == t.replicas * t.capacity and s["page_size"] == 1 and s["prefix_cache"] == "radix"
    # idle: every slot free, cached-and-evictable or pinned
    assert checked["running"] == checked["waiting"] == 0
    assert checked["free"] + checked["evictable"] + checked["pinned"] == checked["capacity"]
    rate = checked["cached_tokens"] / checked["prompt_tokens"] if checked["prompt_tokens"] else 0.0
    assert abs(checked["hit_rate"] - rate) < 1e-12


def _samples(t: Target) -> dict:
    text = t.http.get("/metrics").text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def check_metrics(t: Target) -> None:
    before = _samples(t)
    assert before[("radixkv_kv_capacity_tokens", ())] == t.replicas * t.capacity
    body = {"model": MODEL, "prompt": t.ids()[:8], "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    assert t.http.post("/v1/completions", json=body).status_code == 200
    after = _samples(t)
    key = ("radixkv_requests_total", (("endpoint", "completions"),))
    assert after[key] == before.get(key, 0) + 1
    gen = ("radixkv_generation_tokens_total", ())
    assert after[gen] == before.get(gen, 0) + 3
    prompt = ("radixkv_prompt_tokens_total", ())
    assert after[prompt] == before.get(prompt, 0) + 8


def check_flush(t: Target) -> None:
    for method in ("GET", "POST"):
        r = t.http.request(method, "/flush_cache")
        if t.replicas == 1:
            assert r.status_code == 200 and r.json()["flushed"] is True
            assert t.stats()["evictable"] == 0
        else:
            err = _error(r, 409)
            assert err["code"] == "flush_not_offered" and "across replicas" in err["message"]
    r = t.http.post("/flush_cache", params={"tiers": "true"})  # also the KV tiers the engine owns
    if t.replicas == 1:
        assert r.status_code == 200 and r.json()["flushed"] is True
    else:
        assert _error(r, 409)["code"] == "flush_not_offered"
    assert _error(t.http.post("/flush_cache", params={"timeout": "soon"}), 400)["param"] == "timeout"
    assert _error(t.http.post("/flush_cache", params={"tiers": "maybe"}), 400)["param"] == "tiers"


# ------------------------------------------------------------------------------ SGLang
def check_generate(t: Target) -> None:
    ids = t.ids()
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}}
    post = t.http.post("/generate", json=body).json()
    assert post["meta_info"]["prompt_tokens"] == len(ids) and post["meta_info"]["completion_tokens"] == 3
    assert post["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    assert post["text"] == t.tokenizer.decode(post["output_ids"])
    t.settle()
    put = t.http.put("/generate", json=body).json()
    assert put["output_ids"] == post["output_ids"] and put["meta_info"]["cached_tokens"] == len(ids) - 1


LONG = 3000
"""The ``max_new_tokens`` of a request aborted while it runs: more than the tiny model of the
replicas generates before the abort reaches its replica."""
GREEDY_LONG = {"max_new_tokens": LONG, "temperature": 0, "ignore_eos": True}


def _idle(t: Target) -> dict:
    """``/cache_stats?check=1`` once nothing runs or waits (an abort reaches a replica soon
    after): every slot free, evictable or held by a pin."""
    deadline = time.monotonic() + 30
    while True:
        s = t.stats()
        if s["running"] == s["waiting"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert s["running"] == s["waiting"] == 0 and s["free"] + s["evictable"] + s["pinned"] == s["capacity"], s
    return s


def _aborted_stream(t: Target, body: dict, abort: dict, during: Callable[[], None] = lambda: None) -> tuple:
    """Stream ``/generate`` with ``body``; after its first event run ``during()`` and post ``abort``
    to ``/abort_request`` (200, empty); the first event and the last one before ``[DONE]``."""
    with t.http.stream("POST", "/generate", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        data = (line[5:].strip() for line in r.iter_lines() if line.startswith("data:"))
        first = json.loads(next(data))
        assert first["meta_info"]["finish_reason"] is None and first["output_ids"]
        during()
        aborted = t.http.post("/abort_request", json=abort)
        assert aborted.status_code == 200 and aborted.content == b""
        rest = list(data)
    assert rest[-1] == "[DONE]"
    return first, json.loads(rest[-2])


ABORTED = {"type": "abort", "message": "the request was aborted", "status_code": None, "err_type": None}


def check_abort_request(t: Target) -> None:
    """SGLang's ``/abort_request``: the stream of the request it names ends with finish_reason
    abort and the tokens so far (the greedy continuation's first ones), its KV freed; an unknown
    or finished ``rid`` is a no-op 200; ``abort_all`` ends every stream; bad bodies are 400s."""
    ids = t.ids("An abort check, in no other check. " + PROMPT)
    body = {"input_ids": ids, "rid": "abort-me", "sampling_params": GREEDY_LONG}
    first, last = _aborted_stream(t, body, {"rid": "abort-me"})
    meta, k = last["meta_info"], len(last["output_ids"])
    assert meta["finish_reason"] == ABORTED and meta["id"] == "abort-me", meta
    assert meta["completion_tokens"] == k and len(first["output_ids"]) <= k < LONG and meta["prompt_tokens"] == len(ids)
    assert last["output_ids"][: len(first["output_ids"])] == first["output_ids"]
    _idle(t)
    greedy = {"input_ids": ids, "sampling_params": {**GREEDY_LONG, "max_new_tokens": k}}
    assert t.http.post("/generate", json=greedy).json()["output_ids"] == last["output_ids"]
    for noop in ({"rid": "abort-me"}, {"rid": "never-ran"}, {}):
        r = t.http.post("/abort_request", json=noop)
        assert r.status_code == 200 and r.content == b"", (noop, r.text)
    _, last = _aborted_stream(t, {**body, "rid": "abort-all"}, {"abort_all": True})
    assert last["meta_info"]["finish_reason"] == ABORTED and last["meta_info"]["id"] == "abort-all"
    _idle(t)
    assert _error(t.http.post("/abort_request", json={"rid": 3}), 400)["param"] == "rid"
    assert _error(t.http.post("/abort_request", json={"abort_message": "stop"}), 400)["code"] == "unsupported_parameter"
    assert _error(t.http.post("/abort_request", json={"rids": ["x"]}), 400)["code"] == "unknown_parameter"


def check_get_load(t: Target) -> None:
    """SGLang's ``/get_load``, one entry per engine: nothing while idle (the tokens held: the pins'),
    one request and at least its prompt's tokens more while a long one runs, idle again once aborted."""
    held = _idle(t)["pinned"]

    def load() -> list[dict]:
        r = t.http.get("/get_load")
        assert r.status_code == 200, r.text
        entries = r.json()
        assert [e["dp_rank"] for e in entries] == list(range(t.replicas)), entries
        return entries

    idle = load()
    assert all(e["num_reqs"] == e["num_waiting_reqs"] == 0 for e in idle) and sum(e["num_tokens"] for e in idle) == held
    ids = t.ids("A load check, in no other check. " + PROMPT)
    seen: list = []
    body = {"input_ids": ids, "rid": "load-me", "sampling_params": GREEDY_LONG}
    _, last = _aborted_stream(t, body, {"rid": "load-me"}, lambda: seen.extend(load()))
    assert sum(e["num_reqs"] for e in seen) == 1 and sum(e["num_waiting_reqs"] for e in seen) == 0, seen
    tokens = sum(e["num_tokens"] for e in seen)
    assert held + len(ids) <= tokens <= held + len(ids) + LONG, (tokens, held, len(ids))
    assert last["meta_info"]["finish_reason"] == ABORTED
    _idle(t)
    after = load()
    assert all(e["num_reqs"] == 0 for e in after) and sum(e["num_tokens"] for e in after) == held, after


def check_model_info(t: Target) -> None:
    info = t.http.get("/get_model_info").json()
    assert info == t.http.get("/model_info").json()
    assert info["model_path"] == MODEL and info["served_model_name"] == MODEL and info["is_generation"] is True
    assert Path(info["tokenizer_path"], "tokenizer_config.json").is_file()  # a local tokenizer directory
    assert info["model_type"] == "llama" and info["max_context_len"] == t.max_context_len()


def check_server_info(t: Target) -> None:
    si = t.http.get("/server_info").json()
    assert si.keys() == t.http.get("/get_server_info").json().keys()
    assert si["model_path"] == MODEL and si["page_size"] == 1 and si["max_total_num_tokens"] == t.capacity
    assert si["disable_radix_cache"] is False and si["context_length"] == t.max_context_len()
    assert si["internal_states"][0]["capacity"] == t.replicas * t.capacity
    assert si["version"] == radixkv.__version__ and si["radixkv_config"]["max_total_tokens"] == t.capacity


def check_health_generate(t: Target) -> None:
    assert t.http.get("/health_generate").status_code == 200


# ------------------------------------------------------------------------------ vLLM
def check_reset_prefix_cache(t: Target) -> None:
    r = t.http.post("/reset_prefix_cache")
    if t.replicas == 1:
        assert r.status_code == 200 and r.json()["flushed"] is True and t.stats()["evictable"] == 0
    else:
        assert _error(r, 409)["code"] == "flush_not_offered"
    err = _error(t.http.post("/reset_prefix_cache", params={"reset_running_requests": "true"}), 400)
    assert err["param"] == "reset_running_requests"


def check_version(t: Target) -> None:
    assert t.http.get("/version").json() == {"version": radixkv.__version__}


def check_tokenize(t: Target) -> None:
    r = t.http.post("/tokenize", json={"model": MODEL, "prompt": PROMPT}).json()
    assert r["tokens"] == t.tokenizer.encode(PROMPT, add_special_tokens=True) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == t.max_context_len()
    msgs = [{"role": "user", "content": "Hello there"}]
    assert t.http.post("/tokenize", json={"messages": msgs}).json()["tokens"] == encode_chat(t.tokenizer, msgs)


def check_detokenize(t: Target) -> None:
    ids = t.ids()
    assert t.http.post("/detokenize", json={"tokens": ids}).json() == {"prompt": t.tokenizer.decode(ids)}
    vocab = len(t.tokenizer)  # the model's vocabulary (the default model's and the test replicas')
    assert t.http.post("/detokenize", json={"tokens": [vocab - 1]}).status_code == 200
    assert _error(t.http.post("/detokenize", json={"tokens": [vocab]}), 400)["param"] == "tokens"


# ------------------------------------------------------------------------------ FastAPI's own
def check_openapi(t: Target) -> None:
    doc = t.http.get("/openapi.json").json()
    assert "/v1/chat/completions" in doc["paths"] and "ChatCompletionRequest" in doc["components"]["schemas"]
    # OpenAPI: "The id MUST be unique among all operations"; a route serving two methods gave both one id
    ids = [op["operationId"] for item in doc["paths"].values() for op in item.values() if "operationId" in op]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)


def check_docs(t: Target) -> None:
    for path in ("/docs", "/redoc", "/docs/oauth2-redirect"):
        r = t.http.get(path)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html"), path


ROUTES: list[tuple[str, tuple[tuple[str, str], ...], Callable[[Target], None]]] = [
    ("completions", (("POST", "/v1/completions"),), check_completions),
    ("chat", (("POST", "/v1/chat/completions"),), check_chat),
    ("responses", (("POST", "/v1/responses"),), check_responses_create),
    ("responses_get", (("GET", "/v1/responses/{response_id}"),), check_responses_retrieve),
    ("responses_delete", (("DELETE", "/v1/responses/{response_id}"),), check_responses_delete),
    ("responses_input_items", (("GET", "/v1/responses/{response_id}/input_items"),), check_responses_input_items),
    ("responses_cancel", (("POST", "/v1/responses/{response_id}/cancel"),), check_responses_cancel),
    ("models", (("GET", "/v1/models"),), check_models),
    ("model", (("GET", "/v1/models/{model_id:path}"),), check_model),
    ("health", (("GET", "/health"),), check_health),
    ("cache_stats", (("GET", "/cache_stats"),), check_cache_stats),
    ("metrics", (("GET", "/metrics"),), check_metrics),
    ("flush_cache", (("GET", "/flush_cache"), ("POST", "/flush_cache")), check_flush),
    ("generate", (("POST", "/generate"), ("PUT", "/generate")), check_generate),
    ("model_info", (("GET", "/get_model_info"), ("GET", "/model_info")), check_model_info),
    ("server_info", (("GET", "/server_info"), ("GET", "/get_server_info")), check_server_info),
    ("health_generate", (("GET", "/health_generate"),), check_health_generate),
    ("abort_request", (("POST", "/abort_request"),), check_abort_request),
    ("get_load", (("GET", "/get_load"),), check_get_load),
    ("reset_prefix_cache", (("POST", "/reset_prefix_cache"),), check_reset_prefix_cache),
    ("version", (("GET", "/version"),), check_version),
    ("tokenize", (("POST", "/tokenize"),), check_tokenize),
    ("detokenize", (("POST", "/detokenize"),), check_detokenize),
    ("openapi", (("GET", "/openapi.json"),), check_openapi),
    ("docs", (("GET", "/docs"), ("GET", "/redoc"), ("GET", "/docs/oauth2-redirect")), check_docs),
]
"""(name, the (method, path) pairs it covers, its check)."""


# ------------------------------------------------------------------------------ API keys
PUBLIC = {"health"}
"""Rows answered without a key when the server has API keys."""
ADMIN = {"cache_stats", "metrics", "flush_cache", "reset_prefix_cache", "server_info", "get_load"}
"""Rows only an admin key may use (403 for a tenant key): they describe every tenant's cache."""


def check_auth(anonymous: httpx.Client, tenant: dict, admin: dict) -> None:
    """Every row's routes on a server with API keys: without a key 401 ``invalid_api_key`` (but
    :data:`PUBLIC`), with a tenant's key 403 ``permission_denied`` on :data:`ADMIN` and neither
    401 nor 403 elsewhere, with an admin's key neither anywhere (``tenant`` / ``admin``: the
    ``Authorization`` headers of such keys; request bodies are empty, so a route may answer 400)."""
    for name, pairs, _ in ROUTES:
        for method, path in pairs:
            url = path.replace("{response_id}", "resp_none").replace("{model_id:path}", MODEL)
            plain = anonymous.request(method, url)
            if name in PUBLIC:
                assert plain.status_code == 200, (method, url, plain.text)
                continue
            assert plain.status_code == 401 and _error(plain, 401)["code"] == "invalid_api_key", (method, url)
            as_tenant = anonymous.request(method, url, headers=tenant)
            if name in ADMIN:
                assert _error(as_tenant, 403)["code"] == "permission_denied", (method, url)
            else:
                assert as_tenant.status_code not in (401, 403), (method, url, as_tenant.text)
            assert anonymous.request(method, url, headers=admin).status_code not in (401, 403), (method, url)


def uncovered(app: Any) -> set[tuple[str, str]]:
    """The ``(method, path)`` pairs of ``app``'s routes no row of :data:`ROUTES` covers (HEAD,
    which Starlette adds to every GET, aside)."""
    served = {(m, r.path) for r in app.routes for m in (getattr(r, "methods", None) or ()) if m != "HEAD"}
    covered = {pair for _, pairs, _ in ROUTES for pair in pairs}
    return served - covered
