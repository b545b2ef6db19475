"""Tenants through one real ``radixkv serve --api-keys-file`` (a subprocess: the default model on
CPU, a 2,048-token KV pool) and the ``openai`` SDK: 401 without a valid key (``/health`` open),
403 on the admin routes for a tenant key, a cache namespace per tenant (A's repeated prompt hits,
B's identical prompt reuses 0 tokens and B's own repeat hits), salts that split a tenant's own
cache and never reach another tenant's, ``cache_salt`` validation on every endpoint, stored
Responses that belong to their tenant (another tenant's id answers as an unknown one), per-tenant
metrics without keys in them, the request log's tenant, and soft quotas: a tenant flooding 10x
its quota leaves another tenant's hot prefix cached (exact ``cached_tokens``), while a tenant
without a quota flooding as much evicts it (the control); a tenant's share of the queue: its
extra request is a 429 ``queue_full`` while another tenant's is accepted and served. Also the start-up errors of the keys
flags (both at once, a malformed file) and the keys file's parser."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from server_helpers import serve_process

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.timeout(900)

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m"
CAPACITY = 2048
QUOTA = 400
KEYS = {
    "sk-ops-7f3a9c": {"tenant": "ops", "admin": True},
    "sk-alice-51d2e0": {"tenant": "alice"},
    "sk-alice-second": {"tenant": "alice"},
    "sk-bob-9c0b11": {"tenant": "bob"},
    "sk-flood-4e77aa": {"tenant": "flood", "kv_quota_tokens": QUOTA},
    "sk-victim-0aa1b3": {"tenant": "victim"},
    "sk-greedy-c3d4e5": {"tenant": "greedy"},
}
KEY = {v["tenant"]: k for k, v in reversed(list(KEYS.items()))}  # tenant -> its first key
SYSTEM = (
    "You are the support assistant of a small bicycle shop in Utrecht. Answer briefly and politely. "
    "Opening hours are nine to six on weekdays and ten to four on Saturdays; repairs take two days; "
    "we sell city bikes, cargo bikes and electric bikes, and we rent them by the day or the week."
)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """``python -m radixkv serve --api-keys-file`` on a free port; its base URL, log and trace. One
    request runs at a time and one of each tenant may wait (the other tests send one at a time)."""
    d = tmp_path_factory.mktemp("tenants")
    (d / "keys.json").write_text(json.dumps(KEYS))
    trace, log = d / "trace.jsonl", d / "serve.log"
    args = ["--api-keys-file", d / "keys.json", "--max-total-tokens", CAPACITY, "--log-requests", trace,
            "--log-level", "info", "--max-running-requests", 1, "--max-queued-requests-per-tenant", 1]  # fmt: skip
    with serve_process(args, log) as (base, proc):
        yield dict(base=base, log=log, trace=trace, proc=proc)


def client(served, tenant: str | None = None, key: str | None = None):
    return openai.OpenAI(base_url=served["base"] + "/v1", api_key=key or KEY[tenant], max_retries=0, timeout=300)


def http(served, tenant: str | None = None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {KEY[tenant]}"} if tenant else {}
    return httpx.Client(base_url=served["base"], headers=headers, timeout=300)


def chat(served, tenant: str, question: str, salt: str | None = None, key: str | None = None):
    """A greedy 2-token chat completion of ``tenant``: ``(prompt tokens, cached tokens)``."""
    extra = {"cache_salt": salt} if salt is not None else None
    r = client(served, tenant, key).chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        max_tokens=2,
        temperature=0,
        extra_body=extra,
    )
    return r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens


def stats(served) -> dict:
    with http(served, "ops") as h:
        r = h.get("/cache_stats", params={"check": "1"})
    assert r.status_code == 200, r.text
    return r.json()


def flush(served) -> None:
    with http(served, "ops") as h:
        assert h.post("/flush_cache", params={"timeout": "30"}).status_code == 200


# ---------------------------------------------------------------------------- 401 / 403
def test_every_route_but_health_needs_a_key_and_admin_routes_an_admin(served):
    from route_table import check_auth

    with http(served) as anonymous:
        assert anonymous.get("/health").status_code == 200
        check_auth(anonymous, {"Authorization": f"Bearer {KEY['bob']}"}, {"Authorization": f"Bearer {KEY['ops']}"})
    for bad in ("sk-nope", KEY["bob"] + "x", KEY["bob"][:-1]):
        with pytest.raises(openai.AuthenticationError) as e:
            client(served, key=bad).models.list()
        assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    r = httpx.get(served["base"] + "/v1/models", headers={"Authorization": f"Basic {KEY['bob']}"})
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert [m.id for m in client(served, "bob").models.list().data] == [MODEL]
    with http(served, "bob") as bob:
        for method, path in (("GET", "/metrics"), ("GET", "/cache_stats"), ("POST", "/flush_cache"),
                             ("POST", "/reset_prefix_cache"), ("GET", "/server_info")):  # fmt: skip
            r = bob.request(method, path)
            assert r.status_code == 403 and r.json()["error"]["code"] == "permission_denied", (path, r.text)
    with http(served, "ops") as ops:
        assert ops.get("/metrics").status_code == 200 and ops.get("/cache_stats").status_code == 200


# ---------------------------------------------------------------------------- namespaces
def test_a_tenant_hits_its_own_cache_and_never_another_tenants(served):
    flush(served)
    before = stats(served)["tenants"].get("alice", {"prompt_tokens": 0, "cached_tokens": 0})
    n, c = chat(served, "alice", "Do you repair tandems?")
    assert c == 0
    assert chat(served, "alice", "Do you repair tandems?") == (n, n - 1)  # A's repeat hits
    assert chat(served, "alice", "Do you repair tandems?", key="sk-alice-second") == (n, n - 1)  # any key of A
    assert chat(served, "bob", "Do you repair tandems?") == (n, 0)  # B's identical prompt: nothing of A's
    assert chat(served, "bob", "Do you repair tandems?") == (n, n - 1)  # B's own repeat hits
    s = stats(served)
    assert s["tenants"]["alice"]["cached"] == s["tenants"]["bob"]["cached"] == n + 1  # prompt + first output token
    a = s["tenants"]["alice"]
    assert a["prompt_tokens"] - before["prompt_tokens"] == 3 * n
    assert a["cached_tokens"] - before["cached_tokens"] == 2 * (n - 1)


def test_salts_split_a_tenant_and_never_reach_another(served):
    flush(served)
    q = "Can I rent a cargo bike for a week?"
    n, _ = chat(served, "alice", q)
    assert chat(served, "alice", q, salt="s1") == (n, 0)  # one tenant: with a salt, a cache of its own
    assert chat(served, "alice", q, salt="s1") == (n, n - 1)
    assert chat(served, "alice", q, salt="s2") == (n, 0)
    assert chat(served, "alice", q) == (n, n - 1)  # without one, still its unsalted cache
    # B sends A's salt: it reaches B's salted namespace, never A's
    assert chat(served, "bob", q, salt="s1") == (n, 0)
    assert chat(served, "bob", q, salt="s1") == (n, n - 1)
    assert chat(served, "bob", q) == (n, 0)


def test_cache_salt_is_validated_on_every_endpoint(served):
    bodies = {
        "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
        "/v1/completions": {"model": MODEL, "prompt": "hi", "max_tokens": 1},
        "/v1/responses": {"model": MODEL, "input": "hi", "max_output_tokens": 1, "store": False},
        "/generate": {"text": "hi", "sampling_params": {"max_new_tokens": 1}},
    }
    with http(served, "bob") as bob:
        for path, body in bodies.items():
            for bad in ("", "x" * 129, 7, ["s"]):
                r = bob.post(path, json={**body, "cache_salt": bad})
                assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", (path, bad, r.text)
            ok = bob.post(path, json={**body, "cache_salt": "x" * 128})
            assert ok.status_code == 200, (path, ok.text)
        # /generate: SGLang's salt and extra_key under the tenant, a field each
        gen = {"input_ids": list(range(1000, 1040)), "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
        first = bob.post("/generate", json={**gen, "cache_salt": "g", "extra_key": "k"}).json()["meta_info"]
        again = bob.post("/generate", json={**gen, "cache_salt": "g", "extra_key": "k"}).json()["meta_info"]
        assert (first["cached_tokens"], again["cached_tokens"]) == (0, 39)
    with http(served, "alice") as alice:
        other = alice.post("/generate", json={**gen, "cache_salt": "g", "extra_key": "k"}).json()["meta_info"]
    assert other["cached_tokens"] == 0


# ---------------------------------------------------------------------------- Responses
def test_stored_responses_belong_to_their_tenant(served):
    a, b = client(served, "alice"), client(served, "bob")
    made = a.responses.create(model=MODEL, input="Name one fruit.", max_output_tokens=4, temperature=0)
    assert a.responses.retrieve(made.id).id == made.id
    unknown = "resp_" + "0" * 32
    with http(served, "bob") as bob:
        for method in ("GET", "DELETE"):
            theirs, none = (
                bob.request(method, f"/v1/responses/{made.id}"),
                bob.request(method, f"/v1/responses/{unknown}"),
            )
            assert theirs.status_code == none.status_code == 404
            assert theirs.json()["error"]["code"] == none.json()["error"]["code"] == "not_found"
        body = {"model": MODEL, "input": "And a vegetable?", "max_output_tokens": 2, "store": False}
        theirs = bob.post("/v1/responses", json={**body, "previous_response_id": made.id})
        none = bob.post("/v1/responses", json={**body, "previous_response_id": unknown})
    # another tenant's id is answered exactly as an id that never existed (404, as GET and DELETE)
    assert theirs.status_code == none.status_code == 404
    assert theirs.json()["error"]["code"] == none.json()["error"]["code"] == "previous_response_not_found"
    with pytest.raises(openai.NotFoundError):
        b.responses.retrieve(made.id)
    # the owner still has it, continues it (its context cached: all but the last token) and deletes it
    follow = a.responses.create(
        model=MODEL, input="And a vegetable?", previous_response_id=made.id, max_output_tokens=2, temperature=0
    )
    context = made.usage.input_tokens + made.usage.output_tokens
    assert follow.usage.input_tokens_details.cached_tokens == context - 1
    salted = a.responses.create(  # the same tenant under a salt: allowed, in the salt's own namespace
        model=MODEL, input="And a nut?", previous_response_id=made.id, max_output_tokens=2, temperature=0,
        extra_body={"cache_salt": "other"}, store=False,
    )  # fmt: skip
    assert salted.usage.input_tokens_details.cached_tokens == 0
    a.responses.delete(made.id)
    a.responses.delete(follow.id)


# ---------------------------------------------------------------------------- metrics and logs
def test_abort_request_reaches_only_the_callers_own_requests(served):
    """SGLang's ``/abort_request`` with keys: a ``rid`` is the caller's own (bob naming alice's
    ``rid`` is the no-op of an unknown one), a tenant's ``abort_all`` aborts only its own
    ``/generate`` requests (an admin's, every request: the route table's, without keys);
    ``/get_load`` (admin only) counts them."""
    body = {"text": "Count slowly:", "rid": "shared", "stream": True,
            "sampling_params": {"max_new_tokens": 1000, "temperature": 0, "ignore_eos": True}}  # fmt: skip
    with http(served, "alice") as alice, http(served, "bob") as bob, http(served, "ops") as ops:
        with alice.stream("POST", "/generate", json=body) as r:
            assert r.status_code == 200
            data = (line[5:].strip() for line in r.iter_lines() if line.startswith("data:"))
            assert json.loads(next(data))["meta_info"]["finish_reason"] is None
            for abort in ({"rid": "shared"}, {"abort_all": True}):
                done = bob.post("/abort_request", json=abort)
                assert done.status_code == 200 and done.content == b""
            assert bob.get("/get_load").status_code == 403
            assert [e["num_reqs"] for e in ops.get("/get_load").json()] == [1]  # alice's runs on
            assert alice.post("/abort_request", json={"abort_all": True}).status_code == 200  # her own
            rest = list(data)
        assert rest[-1] == "[DONE]"
        meta = json.loads(rest[-2])["meta_info"]
        assert meta["finish_reason"]["type"] == "abort" and meta["id"] == "shared"
        assert meta["completion_tokens"] < 1000
        assert [e["num_reqs"] for e in ops.get("/get_load").json()] == [0]


def test_abort_request_of_a_waiting_non_streamed_generate(served):
    """One request runs at a time here: a second ``/generate`` waits; ``/abort_request`` of it
    answers its (non-streamed) client SGLang's body, finish_reason abort and no token, and the
    running one goes on until aborted in turn."""
    sp = {"max_new_tokens": 1000, "temperature": 0, "ignore_eos": True}
    answers: list = []
    with http(served, "alice") as alice, http(served, "ops") as ops:
        with alice.stream("POST", "/generate", json={"text": "Count:", "rid": "runs", "stream": True,
                                                     "sampling_params": sp}) as r:  # fmt: skip
            data = (line[5:].strip() for line in r.iter_lines() if line.startswith("data:"))
            assert json.loads(next(data))["meta_info"]["finish_reason"] is None
            waiting = threading.Thread(target=lambda: answers.append(
                alice.post("/generate", json={"text": "Wait:", "rid": "waits", "sampling_params": sp})))  # fmt: skip
            waiting.start()
            deadline = time.monotonic() + 60
            while ops.get("/get_load").json()[0]["num_waiting_reqs"] != 1:
                assert time.monotonic() < deadline, "the second request never waited"
                time.sleep(0.05)
            assert ops.get("/get_load").json()[0]["num_reqs"] == 2
            assert alice.post("/abort_request", json={"rid": "waits"}).status_code == 200
            waiting.join(60)
            assert [e["num_reqs"] for e in ops.get("/get_load").json()] == [1]  # the running one goes on
            assert alice.post("/abort_request", json={"rid": "runs"}).status_code == 200
            last = json.loads([d for d in data][-2])
    (answer,) = answers
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["output_ids"] == [] and body["text"] == "" and body["meta_info"]["completion_tokens"] == 0
    assert body["meta_info"]["finish_reason"]["type"] == "abort" and body["meta_info"]["id"] == "waits"
    assert last["meta_info"]["finish_reason"]["type"] == "abort" and 0 < last["meta_info"]["completion_tokens"] < 1000


def test_metrics_are_per_tenant_and_never_show_a_key(served):
    with http(served, "ops") as ops:
        text = ops.get("/metrics").text
    for key in KEYS:
        assert key not in text
    assert 'radixkv_tenant_prompt_tokens_total{tenant="alice"}' in text
    s = stats(served)["tenants"]["alice"]
    line = next(x for x in text.splitlines() if x.startswith('radixkv_tenant_cache_hit_rate{tenant="alice"}'))
    assert float(line.split()[-1]) == pytest.approx(s["hit_rate"])
    log = served["log"].read_text()
    assert not [k for k in KEYS if k in log]
    lines = [json.loads(x) for x in served["trace"].read_text().splitlines()]
    assert lines and all(x["tenant"] in {"alice", "bob", "ops", "victim", "flood", "greedy"} for x in lines)
    assert any(x["tenant"] == "bob" and x.get("cache_salt") == "s1" for x in lines)
    assert not [k for k in KEYS if k in served["trace"].read_text()]


# ---------------------------------------------------------------------------- quotas
def _flood(served, tenant: str, seed: int, tokens: int = 10 * QUOTA, size: int = 200) -> None:
    """``tenant`` sends unique 200-token prompts (random ids), ``tokens`` in all, one at a time."""
    rng = random.Random(seed)
    c = client(served, tenant)
    for _ in range(tokens // size):
        ids = [rng.randrange(1000, 40000) for _ in range(size)]
        r = c.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0)
        assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_a_flood_over_its_quota_leaves_another_tenants_hot_prefix(served):
    flush(served)
    q = "What are your opening hours on Saturday?"
    n, c = chat(served, "victim", q)
    assert c == 0 and stats(served)["tenants"]["victim"]["cached"] == n + 1
    evicted = stats(served)["evicted_tokens"]
    _flood(served, "flood", seed=1)  # 10x its quota through a 2,048-token pool
    s = stats(served)
    assert s["evicted_tokens"] - evicted >= 10 * QUOTA - CAPACITY  # the pool had to evict
    assert s["tenants"]["victim"]["cached"] == n + 1  # every page of the victim's prefix is still there
    assert s["tenants"]["flood"]["cached"] > QUOTA  # soft: above its quota while nobody needs the room
    assert chat(served, "victim", q) == (n, n - 1)  # exact: all but the last prompt token
    with http(served, "ops") as ops:
        assert 'radixkv_tenant_kv_quota_tokens{tenant="flood"} 400.0' in ops.get("/metrics").text
    # the control: a tenant without a quota flooding as much evicts the victim's prefix (LRU)
    _flood(served, "greedy", seed=2)
    assert stats(served)["tenants"].get("victim", {}).get("cached", 0) < n
    n2, c2 = chat(served, "victim", q)
    assert n2 == n and c2 < n - 1


# ---------------------------------------------------------------------------- queue shares
def _waiting(served, n: int, timeout: float = 120.0) -> None:
    """Until exactly ``n`` requests wait for admission (``/cache_stats``' ``waiting``)."""
    deadline = time.monotonic() + timeout
    while stats(served)["waiting"] != n:
        assert time.monotonic() < deadline, f"never {n} waiting requests"
        time.sleep(0.02)


def test_a_tenants_share_of_the_queue_refuses_only_that_tenant(served):
    """One running request at a time, one waiting request per tenant (the fixture): bob's long
    stream runs and his second request waits, so his third is a 429 ``queue_full`` naming
    ``max_queued_requests_per_tenant``; alice's request is still accepted, and once bob's stream
    is closed (aborted) both waiting requests complete."""
    bob, alice = client(served, "bob"), client(served, "alice")
    done: dict = {}

    def send(name: str, c, prompt: str) -> None:
        done[name] = c.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)

    long = bob.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=2000, temperature=0,
                                  stream=True, extra_body={"ignore_eos": True})  # fmt: skip
    threads = []
    try:
        next(iter(long))  # bob's first request runs (its first output came)
        threads.append(threading.Thread(target=send, args=("bob", bob, "Name a colour.")))
        threads[-1].start()
        _waiting(served, 1)  # bob's second waits
        with pytest.raises(openai.RateLimitError) as e:
            bob.completions.create(model=MODEL, prompt="Name a fruit.", max_tokens=2)
        assert e.value.status_code == 429 and e.value.body["code"] == "queue_full"
        assert "1 requests of tenant 'bob' wait" in e.value.body["message"]
        assert "max_queued_requests_per_tenant is 1" in e.value.body["message"]
        threads.append(threading.Thread(target=send, args=("alice", alice, "Name a tree.")))
        threads[-1].start()
        _waiting(served, 2)  # alice's is accepted beside bob's waiting one
    finally:
        long.close()  # the client goes away: bob's first request is aborted
        for t in threads:
            t.join(timeout=300)
    assert done["alice"].usage.completion_tokens == done["bob"].usage.completion_tokens == 2
    s = stats(served)
    assert (s["running"], s["waiting"]) == (0, 0)


# ---------------------------------------------------------------------------- start-up errors
def _serve_fails(*args: str, env_key: str | None = None) -> str:
    e = dict(os.environ, PYTHONPATH=str(ROOT))
    e.pop("RADIXKV_API_KEY", None)
    if env_key is not None:
        e["RADIXKV_API_KEY"] = env_key
    p = subprocess.run([sys.executable, "-m", "radixkv", "serve", "--port", "1", *args], env=e,
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    return p.stderr


def test_bad_keys_configuration_is_a_clear_error_at_start(tmp_path):
    f = tmp_path / "keys.json"
    f.write_text(json.dumps({"sk-1": {"tenant": "a"}}))
    err = _serve_fails("--api-key", "sk-2", "--api-keys-file", str(f))
    assert "not both" in err and "sk-2" not in err
    err = _serve_fails("--api-keys-file", str(f), env_key="sk-env")
    assert "RADIXKV_API_KEY" in err and "sk-env" not in err
    f.write_text(json.dumps({"sk-1": {"tenant": "a", "kv_quota_tokens": "lots"}}))
    err = _serve_fails("--api-keys-file", str(f))
    assert "entry 1" in err and "kv_quota_tokens" in err and "sk-1" not in err


def test_the_keys_file_parser(tmp_path):
    from radixkv.server.auth import APIKeys, KeysFileError, keys_from_args

    f = tmp_path / "k.json"
    cases = [
        ("[]", "must be a JSON object"),
        ("{", "not valid JSON"),
        ("{}", "no keys"),
        ('{"k1": {"tenant": "a"}, "k1": {"tenant": "b"}}', "entry 2 repeats an earlier key"),
        ('{"k1": {"tenant": ""}}', "entry 1: 'tenant'"),
        ('{"k1": {"tenant": "a", "admin": "yes"}}', "'admin' must be true or false"),
        ('{"k1": {"tenant": "a", "kv_quota_tokens": -1}}', "'kv_quota_tokens' must be an integer >= 0"),
        ('{"k1": {"tenant": "a", "quota": 5}}', "unknown field(s) ['quota']"),
        ('{"k1": {"tenant": "a"}, "k2": {"tenant": "a", "kv_quota_tokens": 5}}', "tenant 'a' has two kv_quota_tokens"),
        ('{"has space": {"tenant": "a"}}', "without whitespace"),
        ('{"k1": "a"}', "must be an object"),
    ]
    for text, msg in cases:
        f.write_text(text)
        with pytest.raises(KeysFileError) as e:
            APIKeys.from_file(str(f))
        assert msg in str(e.value) and str(f) in str(e.value), (text, str(e.value))
        assert "k1" not in str(e.value).replace(str(f), "")
    with pytest.raises(KeysFileError, match="cannot read it"):
        APIKeys.from_file(str(tmp_path / "missing.json"))
    f.write_text('{"k1": {"tenant": "a", "admin": true}, "k2": {"tenant": "b", "kv_quota_tokens": 9}}')
    keys = APIKeys.from_file(str(f))
    assert keys.lookup("k1") == keys.tenants()["a"] and keys.lookup("k1").admin
    assert keys.lookup("k2").name == "b" and keys.lookup("k3") is None and keys.lookup(None) is None
    assert keys.quotas() == {"b": 9} and "k1" not in repr(keys) and "k2" not in repr(keys)
    wire = keys.to_wire()
    assert "k1" not in json.dumps(wire) and APIKeys.from_wire(wire).lookup("k2").name == "b"
    assert keys_from_args(None, None, env={}) is None
    one = keys_from_args(None, None, env={"RADIXKV_API_KEY": "sk-env"})
    assert one.lookup("sk-env").admin and one.lookup("sk-env").name == "default"
    with pytest.raises(KeysFileError, match="without whitespace"):
        keys_from_args("", None, env={})


def test_the_route_table_knows_the_admin_routes():
    from route_table import ADMIN, ROUTES

    from radixkv.server.auth import ADMIN_PATHS

    assert {p for name, pairs, _ in ROUTES if name in ADMIN for _, p in pairs} == ADMIN_PATHS
