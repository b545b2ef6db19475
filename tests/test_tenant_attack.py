"""Tenants attacked through one real ``radixkv serve --api-keys-file`` (a subprocess: the default
model on CPU, a host and a disk KV tier, speculative decoding from the radix tree): what a hostile
tenant can learn about, or do to, another tenant's requests, and what an operator's keys
configuration may hold.

* ``/generate``'s client-chosen ``rid``: one tenant's running ``rid`` neither refuses another
  tenant's request with the same ``rid`` (a denial, and an oracle of which ids another tenant
  runs) nor changes anything of it; a tenant's own duplicate is a 400 naming ``rid``.
* the KV tiers: a prompt one tenant left in the host / disk tier (the pool flushed) is never
  served to another tenant, while the owner's repeat is served from the tier (the control).
* speculative decoding: another tenant's identical, finished generation changes neither the
  drafts nor the accepted tokens of a request (equal to a fresh tenant's), while the owner's
  repeat accepts more (the control).
* stored Responses: one tenant's flood of stored responses never deletes or unpins another
  tenant's (the store's bounds are per tenant).
* the keys file: a key outside printable ASCII (a header cannot carry it, so it could never
  authenticate) and a tenant name with whitespace at either end (silently another tenant) stop
  the server at start.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
from server_helpers import serve_process

pytestmark = pytest.mark.timeout(900)

MODEL = "smollm2-135m"
KEYS = {
    "sk-ops-51a0": {"tenant": "ops", "admin": True},
    "sk-alice-77e1": {"tenant": "alice"},
    "sk-bob-0c9d": {"tenant": "bob"},
    "sk-carol-3b2f": {"tenant": "carol"},
    "sk-dave-9e4a": {"tenant": "dave"},
    "sk-erin-6d1c": {"tenant": "erin"},
    "sk-frank-28b7": {"tenant": "frank"},
}
KEY = {v["tenant"]: k for k, v in KEYS.items()}
SECRET = (
    "Board memo, strictly confidential: the merger with Globex closes on the fourteenth of March at "
    "forty-two dollars a share; the press release goes out the following Monday at nine."
)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """``python -m radixkv serve --api-keys-file`` with KV tiers and radix drafts; its base URL."""
    d = tmp_path_factory.mktemp("tenant_attack")
    (d / "keys.json").write_text(json.dumps(KEYS))
    args = ["--api-keys-file", d / "keys.json", "--max-total-tokens", "4096", "--host-cache-bytes", "64MiB",
            "--disk-cache-dir", d / "disk", "--speculative-config", '{"method": "radix", "num_speculative_tokens": 4}']  # fmt: skip
    with serve_process(args, d / "serve.log") as (base, _):
        yield base


def http(base: str, tenant: str) -> httpx.Client:
    return httpx.Client(base_url=base, headers={"Authorization": f"Bearer {KEY[tenant]}"}, timeout=300)


def complete(base: str, tenant: str, prompt: str, max_tokens: int = 2) -> dict:
    """A greedy completion of ``tenant``: its JSON."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    with http(base, tenant) as h:
        r = h.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def cached(base: str, tenant: str, prompt: str) -> tuple[int, int]:
    u = complete(base, tenant, prompt)["usage"]
    return u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"]


def admin(base: str, method: str, path: str, **kw) -> dict:
    with http(base, "ops") as h:
        r = h.request(method, path, **kw)
    assert r.status_code == 200, r.text
    return r.json()


# ---------------------------------------------------------------------------- /generate's rid
def test_a_running_rid_of_one_tenant_is_free_for_another(served):
    long = {"text": "Once upon a time", "rid": "job-1", "stream": True,
            "sampling_params": {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}}  # fmt: skip
    short = {"text": "Hello", "rid": "job-1", "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    with http(served, "alice") as alice:
        with alice.stream("POST", "/generate", json=long) as stream:
            assert stream.status_code == 200
            data = (line[5:].strip() for line in stream.iter_lines() if line.startswith("data:"))
            events = (json.loads(d) for d in data if d != "[DONE]")
            first = next(events)
            assert first["meta_info"]["id"] == "job-1" and first["meta_info"]["finish_reason"] is None
            with http(served, "bob") as bob:  # alice's job-1 runs now
                theirs = bob.post("/generate", json=short)
            # bob's job-1 is his own: it runs (no oracle of alice's ids, no denial) and answers as his
            assert theirs.status_code == 200, theirs.text
            assert theirs.json()["meta_info"]["id"] == "job-1"
            assert theirs.json()["meta_info"]["completion_tokens"] == 2
            again = alice.post("/generate", json=short)  # alice's own duplicate: refused, naming rid
            assert again.status_code == 400, again.text
            err = again.json()["error"]
            assert err["param"] == "rid" and err["message"] == "rid 'job-1' is already running"
            last = list(events)[-1]  # alice's goes on to its end
            assert last["meta_info"]["id"] == "job-1" and last["meta_info"]["completion_tokens"] == 400
        done = alice.post("/generate", json=short)  # finished: the id is alice's to use again
    assert done.status_code == 200 and done.json()["meta_info"]["id"] == "job-1"


def test_a_batch_of_rids_is_scoped_to_its_tenant(served):
    body = {"text": ["One", "Two"], "rid": ["b-1", "b-2"], "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    for tenant in ("alice", "bob"):
        with http(served, tenant) as h:
            r = h.post("/generate", json=body)
        assert r.status_code == 200, r.text
        assert [x["meta_info"]["id"] for x in r.json()] == ["b-1", "b-2"]


# ---------------------------------------------------------------------------- KV tiers
def writes_landed(base: str, timeout: float = 60.0) -> None:
    """Until the server's tiers hold every write queued so far (``write_pending`` 0 in each): the
    I/O thread takes a lookup before a queued write, so a repeat sent sooner may miss its own blocks."""
    deadline = time.monotonic() + timeout
    while any(t["write_pending"] for t in admin(base, "GET", "/cache_stats")["tiers"].values()):
        assert time.monotonic() < deadline, "KV tier writes still pending"
        time.sleep(0.05)


def test_the_kv_tiers_never_serve_another_tenants_prompt(served):
    n, c = cached(served, "carol", SECRET)
    assert c == 0
    writes_landed(served)
    admin(served, "POST", "/flush_cache", params={"timeout": "30"})  # the pool only: the tiers keep it
    assert admin(served, "GET", "/cache_stats")["cached"] == 0
    # dave sends carol's prompt, token for token: nothing of carol's from host memory or disk
    assert cached(served, "dave", SECRET) == (n, 0)
    admin(served, "POST", "/flush_cache", params={"timeout": "30"})
    writes_landed(served)
    # carol's repeat is served from the tier: all but its last token (whole blocks and the tail)
    n2, c2 = cached(served, "carol", SECRET)
    assert (n2, c2) == (n, n - 1)


# ---------------------------------------------------------------------------- speculative drafts
def _spec(base: str) -> tuple[int, int]:
    s = admin(base, "GET", "/cache_stats")
    return s["spec_draft_tokens"], s["spec_accepted_tokens"]


def _drafted(base: str, tenant: str, prompt: str) -> tuple[list[int], int, int]:
    """``tenant``'s greedy 48-token completion of ``prompt``: its text, drafts and accepted tokens."""
    d0, a0 = _spec(base)
    text = complete(base, tenant, prompt, max_tokens=48)["choices"][0]["text"]
    d1, a1 = _spec(base)
    return text, d1 - d0, a1 - a0


def test_speculative_drafts_never_come_from_another_tenants_text(served):
    prompt = "The three laws of thermodynamics, explained for a curious ten-year-old:"
    mine = _drafted(served, "alice", prompt)
    admin(served, "POST", "/flush_cache", params={"timeout": "30"})
    # erin and frank (two tenants that sent nothing yet) draft exactly alike, though alice's finished
    # sequence is in the suffix index and the tiers when erin asks, and erin's too when frank asks
    theirs = _drafted(served, "erin", prompt)
    fresh = _drafted(served, "frank", prompt)
    assert theirs[0] == fresh[0] == mine[0]
    assert theirs[1:] == fresh[1:]
    again = _drafted(served, "alice", prompt)  # the flush forgot alice's earlier text as well
    twice = _drafted(served, "alice", prompt)  # the control: alice's own repeat drafts her text
    assert again[0] == twice[0] == mine[0] and twice[2] > theirs[2]


# ---------------------------------------------------------------------------- keys configuration
def test_a_key_must_be_printable_ascii(tmp_path):
    from radixkv.server.auth import APIKeys, KeysFileError, keys_from_args

    f = tmp_path / "keys.json"
    for bad in ("sk-\u00fc", "sk-\u2603", "sk-\u00a0x", "sk-\u200bx"):
        f.write_text(json.dumps({bad: {"tenant": "a"}}, ensure_ascii=False), encoding="utf-8")
        with pytest.raises(KeysFileError) as e:
            APIKeys.from_file(str(f))
        assert "printable ASCII" in str(e.value) and "entry 1" in str(e.value) and bad not in str(e.value)
        with pytest.raises(KeysFileError, match="--api-key: .*printable ASCII"):
            keys_from_args(bad, None, env={})
    keys = APIKeys.from_mapping({"sk-~!#$%&'()*+,-./:;<=>?@[]^_`{|}": {"tenant": "\u00e9quipe \u2603"}})
    assert keys.lookup("sk-~!#$%&'()*+,-./:;<=>?@[]^_`{|}").name == "\u00e9quipe \u2603"  # tenants may be unicode


# ---------------------------------------------------------------------------- stored Responses
def test_one_tenants_stored_responses_never_push_out_anothers():
    from radixkv.namespace import Namespace
    from radixkv.server.openai.responses import ResponseStore, StoredResponse

    class Pins:
        released: list = []

        def release_pin(self, pin) -> None:
            self.released.append(pin)

    store, pins = ResponseStore(max_stored=3, max_pinned=2), Pins()

    def put(rid: str, tenant: str | None) -> None:
        ns = Namespace(tenant=tenant) if tenant is not None else None
        store.put(rid, StoredResponse({}, [], None, [], [1, 2], pin=f"pin-{rid}", namespace=ns), pins)

    put("b1", "bob")
    put("b2", "bob")
    put("n1", None)
    for i in range(10):  # alice floods the store: she loses her own oldest responses and pins
        put(f"a{i}", "alice")
    assert [rid for rid in store._items if rid[0] == "a"] == ["a7", "a8", "a9"]
    assert pins.released == ["pin-a0", "pin-a1", "pin-a2", "pin-a3", "pin-a4", "pin-a5", "pin-a6", "pin-a7"]
    for rid, tenant in (("b1", "bob"), ("b2", "bob"), ("n1", None)):
        assert store.get(rid, tenant).pin == f"pin-{rid}"  # bob's (and the keyless) kept, still pinned
    put("b3", "bob")  # bob's own bound: his least recently used loses its pin, nothing of alice's
    assert pins.released[8:] == ["pin-b1"] and store.get("a9", "alice").pin == "pin-a9"


def test_stored_responses_are_bounded_in_bytes_per_tenant():
    """The store bounded each tenant's responses by count only (10,000), so one tenant's few big
    ones (a 20 MB ``user`` echoed in each stored body) held the server's memory; each tenant's
    responses are now also bounded in bytes (its least recently used go, its newest always stays),
    and another tenant's are untouched."""
    from radixkv.namespace import Namespace
    from radixkv.server.openai.responses import ResponseStore, StoredResponse, stored_size

    class Pins:
        def release_pin(self, pin) -> None:
            pass

    store = ResponseStore(max_stored_bytes=1000)

    def put(rid: str, tenant: str, text: str) -> StoredResponse:
        item = StoredResponse({"user": text}, [], None, [], [1, 2, 3], namespace=Namespace(tenant=tenant))
        store.put(rid, item, Pins())
        return item

    bob = put("b1", "bob", "x" * 300)
    assert bob.nbytes == stored_size(bob) == len('[{"user": "' + "x" * 300 + '"}, [], [], [], null]') + 3 * 36
    for i in range(5):
        put(f"a{i}", "alice", "y" * 300)  # about 420 bytes each: two fit in 1000
    assert sorted(store._items) == ["a3", "a4", "b1"]
    put("a5", "alice", "z" * 5000)  # alone over the bound: kept, the older ones go
    assert sorted(store._items) == ["a5", "b1"] and store.get("b1", "bob") is bob
    assert store.pop("a5", "alice") is not None and store._bytes == {"bob": bob.nbytes}


def test_a_tenant_name_with_surrounding_whitespace_is_refused(tmp_path):
    """``"alice "`` for one of alice's keys would silently be another tenant (another cache, quota
    and metrics label): refused at start, naming the entry."""
    from radixkv.server.auth import APIKeys, KeysFileError

    f = tmp_path / "keys.json"
    for bad in ("alice ", " alice", " ", "\u3000alice"):
        f.write_text(json.dumps({"k0": {"tenant": "alice"}, "k1": {"tenant": bad}}), encoding="utf-8")
        with pytest.raises(KeysFileError) as e:
            APIKeys.from_file(str(f))
        assert "entry 2: 'tenant'" in str(e.value) and "whitespace" in str(e.value), str(e.value)
    assert APIKeys.from_mapping({"k1": {"tenant": "a b"}}).lookup("k1").name == "a b"  # inside: allowed


def test_a_websocket_needs_a_key_too():
    """The app has no websocket route today; one added later (a realtime API) must not be the way
    around the keys: the middleware refuses a websocket without a valid key (a close, 1008, before
    the app sees it) and passes one with a key on, with its tenant."""
    import asyncio

    from radixkv.server.auth import APIKeys, AuthMiddleware, request_tenant

    seen: list = []

    async def app(scope, receive, send):
        seen.append(request_tenant(scope))

    keys = APIKeys.from_mapping({"sk-a": {"tenant": "alice"}})
    errors: list = []
    mw = AuthMiddleware(app, keys, on_error=errors.append)

    def connect(headers: list) -> list:
        sent: list = []

        async def send(message):
            sent.append(message)

        async def receive():
            return {"type": "websocket.connect"}

        scope = {"type": "websocket", "path": "/v1/realtime", "headers": headers}
        asyncio.run(mw(scope, receive, send))
        return sent

    assert connect([]) == [{"type": "websocket.close", "code": 1008, "reason": "invalid_api_key"}]
    assert connect([(b"authorization", b"Bearer sk-b")])[0]["code"] == 1008
    assert seen == [] and errors == [401, 401]
    assert connect([(b"authorization", b"Bearer sk-a")]) == [] and [t.name for t in seen] == ["alice"]
