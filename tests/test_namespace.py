"""The prefix-cache namespace (radixkv/namespace.py) and its threading through the stack: value
semantics, normalization (None, ``Namespace()``, plain hashables), the stable serialization
(golden bytes, the same in another process), the digest chain seed, exact cached-token counts
through the engine (fake runner of test_scheduler.py) for the radix tree and the hash cache,
in-batch sharing, pins, cache events and the router's index, SGLang's ``cache_salt`` /
``extra_key``, stored Responses, and process-local namespaces."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_scheduler import make_engine, run_all

import radixkv
from radixkv.cache import HashBlockCache, RadixCache
from radixkv.cache.digests import BLOCK_TOKENS, block_digests, namespace_seed
from radixkv.engine import CacheInserted, RequestAdmitted
from radixkv.engine.publish import CacheEventPublisher
from radixkv.errors import RequestError
from radixkv.namespace import Namespace, namespace_key
from radixkv.router.base import RouteRequest
from radixkv.router.index import CacheView
from radixkv.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [1 + (5 * i) % 60 for i in range(40)]  # 40 tokens: two whole 16-token blocks of the first 39


def sp(n=2):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def cached(eng, prompt=PROMPT, ns=None) -> int:
    rid = eng.add_request(prompt, sp(), namespace=ns)
    return run_all(eng)[rid].num_cached_tokens


# ------------------------------------------------------------------------------ the value


def test_equal_hashable_frozen_and_picklable():
    a, b = Namespace("acme", "s1", ("k", 7)), Namespace(tenant="acme", salt="s1", extra_key=("k", 7))
    assert a == b and hash(a) == hash(b) and {a: 1}[b] == 1
    assert a != Namespace("acme", "s1", ("k", 8)) and a != Namespace("other", "s1", ("k", 7))
    # the same string in different fields is a different namespace (no concatenation anywhere)
    spellings = [Namespace(tenant="a"), Namespace(salt="a"), Namespace(extra_key="a")]
    assert len(set(spellings)) == 3 and len({ns.to_bytes() for ns in spellings}) == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.tenant = "x"
    back = pickle.loads(pickle.dumps(a))
    assert back == a and hash(back) == hash(a) and back.to_bytes() == a.to_bytes()


def test_normalization_of_what_the_python_api_accepts():
    assert radixkv.Namespace is Namespace
    assert Namespace.of(None) is None
    assert Namespace.of(Namespace()) is None  # the shared default has one spelling below the API
    ns = Namespace(tenant="t")
    assert Namespace.of(ns) is ns
    assert Namespace.of("a") == Namespace(extra_key="a")
    assert Namespace.of(("salt", 7)) == Namespace(extra_key=("salt", 7))
    assert Namespace.of(True) == Namespace.of(1) and namespace_key(True) == namespace_key(1)
    assert namespace_key(None) == namespace_key(Namespace()) == Namespace().to_bytes() == b"\x01NNN"
    assert namespace_key("a") == Namespace(extra_key="a").to_bytes()


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda: Namespace(tenant=3), "tenant must be a str or None, got int"),
        (lambda: Namespace(salt=b"x"), "salt must be a str or None, got bytes"),
        (lambda: Namespace.of([1, 2]), "namespace must be hashable, got list"),
        (lambda: Namespace.of(("a", [1])), "namespace must be hashable, got tuple"),
    ],
)
def test_bad_namespaces_are_request_errors_naming_the_field(make, words):
    with pytest.raises(RequestError, match=words) as e:
        make()
    assert e.value.param == "namespace"


# ------------------------------------------------------------------- stable serialization

GOLDEN = [
    (Namespace(), b"\x01NNN"),
    (Namespace(extra_key="a"), b"\x01NNS\x00\x00\x00\x01a"),
    (Namespace(tenant="acme", salt="s1"), b"\x01S\x00\x00\x00\x04acmeS\x00\x00\x00\x02s1N"),
    (Namespace(extra_key=0), b"\x01NNI\x00\x00\x00\x01\x00"),
    (Namespace(extra_key=-1), b"\x01NNI\x00\x00\x00\x01\xff"),
    (Namespace(extra_key=255), b"\x01NNI\x00\x00\x00\x02\x00\xff"),
    (Namespace(extra_key=b"\x00k"), b"\x01NNB\x00\x00\x00\x02\x00k"),
    (Namespace(extra_key="é"), b"\x01NNS\x00\x00\x00\x02\xc3\xa9"),
    (
        Namespace(salt="x", extra_key=("salt", 7, ())),
        b"\x01NS\x00\x00\x00\x01xT\x00\x00\x00\x03S\x00\x00\x00\x04saltI\x00\x00\x00\x01\x07T\x00\x00\x00\x00",
    ),
]


@pytest.mark.parametrize("ns, data", GOLDEN)
def test_golden_bytes_and_their_inverse(ns, data):
    assert ns.persistable and ns.to_bytes() == data
    assert Namespace.from_bytes(data) == Namespace.of(ns)  # Namespace() reads back as None


@pytest.mark.parametrize(
    "data", [b"", b"\x02NNN", b"\x01NN", b"\x01NNNN", b"\x01NNS\x00\x00\x00\x05ab", b"\x01NNX", b"\x01INN"]
)
def test_from_bytes_refuses_what_to_bytes_never_writes(data):
    with pytest.raises(ValueError):
        Namespace.from_bytes(data)


def test_the_same_bytes_and_seeds_in_another_process():
    """Neither ``hash()`` (salted per process) nor ``repr`` of arbitrary objects: a subprocess
    with another hash seed serializes and seeds every namespace alike."""
    source = '[None, "a", ("salt", 7), Namespace(tenant="acme", salt="s1", extra_key=(1, b"x"))]'
    values = eval(source)
    code = (
        "from radixkv.namespace import Namespace, namespace_key\n"
        "from radixkv.cache.digests import namespace_seed\n"
        f"for v in {source}:\n"
        "    print(namespace_key(v).hex(), namespace_seed(v).hex())\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr
    here = [f"{namespace_key(v).hex()} {namespace_seed(v).hex()}" for v in values]
    assert r.stdout.split("\n")[: len(values)] == here


def test_digest_chain_seeded_by_the_stable_serialization():
    assert namespace_seed(None) == hashlib.blake2b(b"\x01NNN", digest_size=16).digest()
    assert namespace_seed(None).hex() == "7a327cfd412a3d237f02c2c24b4dc7fb"
    assert block_digests(list(range(16)), None, 0, 1)[0].hex() == "9b7b0312be5a60cb616ca2c15ab0073b"
    ns = Namespace(tenant="acme", salt="s1")
    assert block_digests(list(range(32)), ns, 0, 2)[1].hex() == "a78e32c0dda852ef26fc973d70fe2f30"
    # one namespace, two spellings, one chain; other namespaces another
    assert namespace_seed("a") == namespace_seed(Namespace(extra_key="a"))
    assert len({namespace_seed(v) for v in (None, "a", Namespace(salt="a"), Namespace(tenant="a"))}) == 4


# ------------------------------------------------------------------------------ the engine


@pytest.mark.parametrize("cache", ["radix", "hash"])
def test_engine_shares_exactly_within_a_namespace(cache):
    eng = make_engine(capacity=512, cache=cache)
    n = len(PROMPT)
    assert cached(eng, ns="a") == 0
    assert cached(eng, ns="a") == n - 1  # all but the last prompt token
    assert cached(eng, ns="b") == 0
    assert cached(eng, ns=Namespace(extra_key="a")) == n - 1  # the same namespace as "a"
    assert cached(eng, ns=Namespace(salt="a")) == 0
    assert cached(eng, ns=None) == 0
    assert cached(eng, ns=Namespace()) == n - 1  # the shared default, spelled otherwise
    eng.check_integrity()
    if cache == "radix":
        roots = set(eng.kv.cache.root.children)
        assert roots == {None, Namespace(extra_key="a"), Namespace(extra_key="b"), Namespace(salt="a")}


def test_events_carry_the_normalized_namespace():
    eng = make_engine(capacity=512)
    seen = []
    eng.events.subscribe(seen.append, (RequestAdmitted, CacheInserted))
    cached(eng, ns="a")
    cached(eng, ns=Namespace())
    admitted = [e.namespace for e in seen if isinstance(e, RequestAdmitted)]
    inserted = {e.namespace for e in seen if isinstance(e, CacheInserted)}
    assert admitted == [Namespace(extra_key="a"), None]
    assert inserted == {Namespace(extra_key="a"), None}


def test_in_batch_sharing_stays_inside_a_namespace():
    eng = make_engine(capacity=512)
    got = []
    eng.events.subscribe(got.append, (RequestAdmitted,))
    for ns in ("a", "b", "a"):  # admitted in one step
        eng.add_request(PROMPT, sp(), namespace=ns)
    run_all(eng)
    shared = [(e.namespace.extra_key, e.num_cached_tokens, e.num_shared_tokens) for e in got]
    # the second "a" rides on the first's row (the whole identical prompt, computed in the same
    # forward); "b" borrows nothing from it
    assert shared == [("a", 0, 0), ("b", 0, 0), ("a", len(PROMPT), len(PROMPT))]


def test_pins_are_per_namespace():
    eng = make_engine(capacity=512)
    cached(eng, ns="a")
    assert eng.pin_prefix(PROMPT, "b") is None
    assert eng.pin_prefix(PROMPT, None) is None
    pin = eng.pin_prefix(PROMPT, Namespace(extra_key="a"))
    assert pin is not None and len(pin) == len(PROMPT)
    eng.release_pin(pin)
    eng.check_integrity()


def test_outcome_names_the_default_namespace_as_the_other_one():
    eng = make_engine(capacity=512)
    cached(eng, ns=None)
    rid = eng.add_request(PROMPT, sp(), namespace="bob")
    o = run_all(eng)[rid].cache_outcome
    assert o.cause == "namespace" and o.other_namespace is None
    assert o.missed == {"namespace": len(PROMPT) - 1, "full": 1}
    assert eng.explain(PROMPT, "bob").missed == {"full": 1}  # now cached in bob's namespace too


def test_explain_normalizes_like_add_request():
    eng = make_engine(capacity=512)
    cached(eng, ns="a")
    assert eng.explain(PROMPT, Namespace(extra_key="a")).num_cached_tokens == len(PROMPT) - 1
    assert eng.explain(PROMPT, "b").num_cached_tokens == 0
    with pytest.raises(RequestError) as e:
        eng.add_request(PROMPT, sp(), namespace={"a": 1})
    assert e.value.param == "namespace"


# ---------------------------------------------------------------- events -> router index


def test_router_index_matches_by_namespace():
    eng = make_engine(capacity=512)
    pub = CacheEventPublisher()
    pub.attach(eng.events)
    cached(eng, ns=Namespace(tenant="acme", salt="s1"))
    batch = pub.drain()
    inserts = [r for r in batch["events"] if r[0] == "insert"]
    assert inserts and all(r[2] == b"\x01S\x00\x00\x00\x04acmeS\x00\x00\x00\x02s1N" for r in inserts)
    assert Namespace.from_bytes(inserts[0][2]) == Namespace(tenant="acme", salt="s1")
    view = CacheView()
    assert view.apply(batch) is False
    blocks = (len(PROMPT) - 1) // BLOCK_TOKENS
    for ns, want in [
        (Namespace(tenant="acme", salt="s1"), blocks),
        (Namespace(tenant="acme"), 0),
        (Namespace(salt="s1"), 0),
        (None, 0),
    ]:
        assert view.prefix_blocks(RouteRequest("r", PROMPT, ns).digests()) == want, ns
    # a plain hashable routes as the engine caches it
    cached(eng, ns="a")
    view.apply(pub.drain())
    rq = RouteRequest("r", PROMPT, "a")
    assert rq.namespace == Namespace(extra_key="a") and view.prefix_blocks(rq.digests()) == blocks


# --------------------------------------------------------------------------- the server


def test_sglang_salt_and_extra_key_are_fields_not_a_string():
    from radixkv.server.openai.protocol import APIError
    from radixkv.server.sglang.protocol import GenerateRequest

    def ns(tenant=None, **kw):
        return GenerateRequest(text="x", **kw).namespace(tenant)

    assert ns() is None and ns(extra_key="") is None
    # radixkv's salt rule (issue 37): "" or more than 128 characters is a 400 naming cache_salt
    for bad in ("", "s" * 129):
        with pytest.raises(APIError) as e:
            ns(cache_salt=bad)
        assert e.value.param == "cache_salt" and e.value.status_code == 400
    assert ns(cache_salt="s" * 128) == Namespace(salt="s" * 128)
    assert ns("t", cache_salt="s") == Namespace(tenant="t", salt="s")  # the API key's tenant
    assert ns(cache_salt="s") == Namespace(salt="s")
    assert ns(extra_key="k") == Namespace(extra_key="k")
    assert ns(cache_salt="s", extra_key="k") == Namespace(salt="s", extra_key="k")
    # "a\0b" + "c" and "a" + "b\0c" joined with NUL were one namespace; as fields they are two
    assert ns(cache_salt="a\x00b", extra_key="c") != ns(cache_salt="a", extra_key="b\x00c")


def test_a_stored_response_continues_only_in_its_namespace():
    from radixkv.server.openai.params import ModelNames
    from radixkv.server.openai.protocol import APIError
    from radixkv.server.openai.responses import Responses, StoredResponse
    from radixkv.server.openai.responses_protocol import ResponsesRequest

    handler = Responses(client=None, models=ModelNames("m"))
    handler.store.put("resp_1", StoredResponse({}, [], None, [], [1, 2], namespace=Namespace(tenant="t")), None)
    req = ResponsesRequest(model="m", input="more", previous_response_id="resp_1")
    with pytest.raises(APIError) as e:
        asyncio.run(handler.create(req, None, namespace=None))
    assert e.value.code == "previous_response_not_found" and e.value.param == "previous_response_id"


def test_ray_transport_serializes_the_namespace():
    ray_mod = pytest.importorskip("radixkv.router.ray")
    for ns in (None, Namespace(tenant="t", salt="s", extra_key=(1, "k"))):
        data = ray_mod.wire_namespace(ns)
        assert isinstance(data, bytes) and ray_mod.read_namespace(data) == ns
    assert ray_mod.wire_namespace("a") == Namespace(extra_key="a").to_bytes()
    assert ray_mod.read_namespace(None) is None
    with pytest.raises(RequestError):
        ray_mod.wire_namespace(1.5)


# -------------------------------------------------------------- process-local namespaces


class _Tag:
    """Hashable by identity, every instance with the same ``repr``: equal reprs, unequal values."""

    def __repr__(self) -> str:
        return "Tag"


def test_process_local_namespaces_work_in_process_but_do_not_persist():
    ns = Namespace.of(1.5)
    assert not ns.persistable and namespace_key(1.5)[0] == 0xFF
    with pytest.raises(RequestError, match="no stable serialization") as e:
        ns.to_bytes()
    assert e.value.param == "namespace"
    eng = make_engine(capacity=512)
    assert cached(eng, ns=1.5) == 0
    assert cached(eng, ns=1.5) == len(PROMPT) - 1
    assert cached(eng, ns=2.5) == 0


@pytest.mark.parametrize("cache_cls", [RadixCache, HashBlockCache])
def test_equal_reprs_never_share_a_cache(cache_cls):
    a, b = _Tag(), _Tag()
    assert namespace_key(a) == namespace_key(b)  # their digests collide (documented) ...
    c = cache_cls(4)
    toks = list(range(1, 13))
    assert c.insert(toks, np.arange(12, dtype=np.int64), Namespace.of(a)) == 0
    assert c.match_prefix(toks, Namespace.of(b)).length == 0  # ... their cache entries never
    assert c.match_prefix(toks, Namespace.of(a)).length == 12


def test_the_tree_refuses_a_second_spelling_of_the_default():
    t = RadixCache(1)
    t.insert([1, 2], np.arange(2, dtype=np.int64), None)
    t.check_integrity()
    t.insert([1, 2], np.arange(2, 4, dtype=np.int64), Namespace())
    with pytest.raises(RuntimeError, match="Namespace\\(\\) root"):
        t.check_integrity()
