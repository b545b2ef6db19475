"""The ingress of ``radixkv serve --replicas N`` (radixkv.router.ray.RemoteLLM, and the app over
it) without a Ray cluster: the router's index and the engine deployment's handle are stand-ins.
``/health``: with every replica dead (Serve restarting them) it answers 503, with some dead
``"degraded"``, and names how many are live. A request id already running is refused as one
engine refuses it, though another replica would run it. A request that failed on its replica is
the 500 ``request_failed`` one engine answers, and no replica error reaches a client as Ray's text.
The index (in process): a reply takes its request off its replica's load at once."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import httpx
import pytest

ray_mod = pytest.importorskip("radixkv.router.ray")


class _Call:
    def __init__(self, value):
        self.value = value

    def remote(self, *args):
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(self.value() if callable(self.value) else self.value)
        return fut


class _Handle:
    """The engine deployment's handle: every request streams one unfinished output (one token
    per sample), then waits for ``release`` and finishes (``"length"``, a cold prompt)."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.calls: list[str] = []
        self.cancelled = 0

    def options(self, **_):
        return self

    @property
    def generate(self):
        return self

    def remote(self, args: dict):
        self.calls.append(args["request_id"])

        def out(finished: bool, tokens: list[int]):
            samples = [SimpleNamespace(token_ids=tokens, finish_reason="length" if finished else None)]
            outcome = SimpleNamespace(missed={"cold": len(args["token_ids"])})  # what the metrics read
            return SimpleNamespace(
                request_id=args["request_id"],
                finished=finished,
                outputs=samples * args["params"].n,
                prompt_token_ids=args["token_ids"],
                num_cached_tokens=0,
                cache_outcome=outcome,
            )

        async def stream():
            yield out(False, [1])
            await self.release.wait()
            yield out(True, [1, 2])

        return _Stream(stream(), self)


class _Stream:
    """A streaming call's response: iterated, or cancelled (the ingress aborts it)."""

    def __init__(self, agen, handle: _Handle) -> None:
        self.agen, self.handle = agen, handle

    def __aiter__(self):
        return self.agen

    def cancel(self) -> None:
        self.handle.cancelled += 1


class _Index:
    """The :class:`~radixkv.router.ray.CacheIndex` calls the ingress makes, over a mutable list
    of live replicas (each pushed the same stats)."""

    def __init__(self, live: list[str], stats: dict) -> None:
        self.live = live
        self.replica_ids = _Call(lambda: list(self.live))
        self.state = _Call(lambda: dict(replica_stats={r: stats for r in self.live}))
        self.replied = _Call(None)


def _health(app) -> tuple[int, dict]:
    async def get():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            r = await http.get("/health")
            return r.status_code, r.json()

    return asyncio.run(get())


@pytest.fixture(scope="module")
def tokenizer():
    from radixkv.models.loader import load_tokenizer

    return load_tokenizer()


def test_health_reports_dead_replicas(tokenizer):
    from radixkv.server.app import create_app
    from radixkv.server.backend import ModelFacts, sum_stats

    stats = sum_stats([]).as_dict()  # a replica's stats as it pushes them (their values do not matter here)
    index = _Index(["r0", "r1"], stats)
    facts = ModelFacts("m", None, "llama", None, len(tokenizer), 2048)
    llm = ray_mod.RemoteLLM(handle=None, tokenizer=tokenizer, facts=facts, index=index, replicas=2)
    app = create_app(llm, served_model_name="m")

    assert _health(app) == (200, {"status": "ok", "degraded_tiers": [], "replicas": {"live": 2, "replicas": 2}})
    index.live[:] = ["r1"]  # r0 died: requests go to r1, the deployment is degraded
    assert _health(app) == (200, {"status": "degraded", "degraded_tiers": [], "replicas": {"live": 1, "replicas": 2}})
    index.live[:] = []  # both died: nothing can serve until Serve restarts them
    code, body = _health(app)
    assert code == 503 and body["error"]["code"] == "engine_dead", body
    assert "no replica is registered" in body["error"]["message"] and "(0 of 2)" in body["error"]["message"], body
    index.live[:] = ["r2", "r3"]  # restarted
    assert _health(app)[0] == 200


def test_stats_with_no_replica_reporting_are_a_503_not_an_empty_pool(tokenizer):
    """While no replica has its stats at the index (every replica dead, or the index restarted
    and none has pushed yet), ``/cache_stats`` is the 503 ``engine_dead`` ``/health`` answers
    then, and ``/metrics`` keeps the replicas' last figures. Before the fix both answered a KV
    pool of 0 tokens (``capacity`` 0, ``radixkv_kv_capacity_tokens`` 0), which one engine never
    reports: a killed ``ray::CacheIndex`` gave ``{"capacity": 0, "free": 0, ...}`` for a second."""
    from radixkv.server.app import create_app
    from radixkv.server.backend import ModelFacts, sum_stats

    one = sum_stats([]).as_dict() | {"capacity": 4096, "free": 4096}
    index = _Index(["r0", "r1"], one)
    facts = ModelFacts("m", None, "llama", None, len(tokenizer), 2048)
    app = create_app(ray_mod.RemoteLLM(None, tokenizer, facts, index, replicas=2), served_model_name="m")

    async def get(path):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            r = await http.get(path)
            return r.status_code, r.text

    def capacity():
        code, text = asyncio.run(get("/metrics"))
        line = next(x for x in text.splitlines() if x.startswith("radixkv_kv_capacity_tokens "))
        return code, float(line.split()[1])

    assert capacity() == (200, 8192.0)
    index.live[:] = []
    code, text = asyncio.run(get("/cache_stats"))
    assert code == 503 and json.loads(text)["error"]["code"] == "engine_dead", text
    assert "no replica has reported its stats" in json.loads(text)["error"]["message"], text
    assert capacity() == (200, 8192.0)  # the last figures the replicas gave
    index.live[:] = ["r2"]
    assert json.loads(asyncio.run(get("/cache_stats"))[1])["capacity"] == 4096 and capacity() == (200, 4096.0)


def test_a_running_request_id_is_refused(tokenizer):
    from radixkv.errors import RequestError
    from radixkv.sampling_params import SamplingParams
    from radixkv.server.backend import ModelFacts

    facts = ModelFacts("m", None, "llama", None, len(tokenizer), 2048)
    handle = _Handle()
    llm = ray_mod.RemoteLLM(handle=handle, tokenizer=tokenizer, facts=facts, index=_Index(["r0"], {}), replicas=2)

    async def run():
        first = llm.generate(prompt_token_ids=[5, 6], sampling_params=SamplingParams(max_tokens=2), request_id="dup")
        assert (await first.__anext__()).finished is False
        second = llm.generate(prompt_token_ids=[5, 6], sampling_params=SamplingParams(max_tokens=2), request_id="dup")
        with pytest.raises(RequestError, match="'dup' is already running") as e:
            await second.__anext__()
        assert e.value.param == "request_id" and handle.calls == ["dup"]  # never sent to a replica
        handle.release.set()
        assert [o.finished async for o in first] == [True]
        again = llm.generate(prompt_token_ids=[5, 6], sampling_params=SamplingParams(max_tokens=2), request_id="dup")
        assert [o.finished async for o in again] == [False, True]  # it ended: the id is free again
        assert llm.num_unfinished_requests() == 0

    asyncio.run(run())


def test_metrics_count_aborts_and_missed_token_causes(tokenizer):
    """The app's metrics hear what one engine's events tell them: a request its client left
    counts ``finish_reason="abort"`` per sample, and a finished request's cache outcome counts
    ``radixkv_missed_prompt_tokens_total{cause}``."""
    from radixkv.sampling_params import SamplingParams
    from radixkv.server.backend import ModelFacts
    from radixkv.server.metrics import ServerMetrics

    facts = ModelFacts("m", None, "llama", None, len(tokenizer), 2048)
    handle = _Handle()
    llm = ray_mod.RemoteLLM(handle=handle, tokenizer=tokenizer, facts=facts, index=_Index(["r0"], {}), replicas=2)
    metrics = ServerMetrics()
    llm.subscribe(metrics.on_event)

    async def run():
        left = llm.generate(prompt_token_ids=[5, 6, 7], sampling_params=SamplingParams(n=2), request_id="a")
        await left.__anext__()
        await left.aclose()  # the client went away after one output
        handle.release.set()
        done = llm.generate(prompt_token_ids=[5, 6, 7], sampling_params=SamplingParams(), request_id="b")
        assert [o.finished async for o in done] == [False, True]

    asyncio.run(run())
    text = metrics.render().decode()
    assert 'radixkv_requests_finished_total{finish_reason="abort"} 2.0' in text, text
    assert 'radixkv_requests_finished_total{finish_reason="length"} 1.0' in text, text
    assert 'radixkv_missed_prompt_tokens_total{cause="cold"} 3.0' in text, text
    assert "radixkv_prompt_tokens_total 3.0" in text, text


def test_a_restarted_index_learns_its_replicas_from_their_pushes():
    """The index actor restarts empty (``max_restarts=-1``): a replica it does not know
    registers again with its next push (which carries its info) and is asked for a snapshot,
    so routing sees both replicas again; a replica the index saw die stays removed."""
    from radixkv.namespace import Namespace

    index = ray_mod.CacheIndex.__ray_metadata__.modified_class()  # the actor's class, in process
    info = dict(epoch=7, actor_name="a0", pid=1)
    stats = {"capacity": 64}
    assert index.push("r0", None, stats) is False and index.replica_ids() == []  # no info: ignored
    assert index.push("r0", None, stats, info) is True  # registered: send a snapshot
    assert index.push("r1", None, stats, dict(info, actor_name="a1")) is True
    assert index.replica_ids() == ["r0", "r1"] and index.state()["replicas"]["r1"]["actor_name"] == "a1"
    assert index.push("r0", None, stats, info) is False  # known now: no snapshot wanted
    ns = ray_mod.wire_namespace(Namespace.of(None))
    picks = {index.route(f"k{i}", dict(token_ids=[i] * 40, namespace=ns), ["r0", "r1"]) for i in range(8)}
    assert picks == {"r0", "r1"}  # routed by the policy again, not all to the first candidate
    assert index.remove("r1") is True
    assert index.push("r1", None, stats, info) is False and index.replica_ids() == ["r0"]  # died: stays out


def test_a_replica_serve_cannot_route_to_yet_is_not_asked_for_its_stats():
    """A replica registers with the index from its constructor, seconds before Serve's request
    router can send it a call (a replacement for a killed replica: a check fanned out over
    ``replica_ids`` then had one replica nobody answered for, a 503). ``replica_ids`` is the
    registered replicas the request router said it can reach (all of them until it said)."""
    index = ray_mod.CacheIndex.__ray_metadata__.modified_class()
    info = dict(epoch=1, actor_name="a0", pid=1)
    for r in ("r0", "r1"):
        assert index.push(r, None, {"capacity": 64}, info) is True
    assert index.replica_ids("ingress") == ["r0", "r1"]  # the router has not said: every registered one
    index.routable("ingress", ["r0", "r9"])  # r1 starting; r9 not registered yet
    index.routable("driver", ["r0", "r1"])  # another process's router learned of r1 first
    assert index.replica_ids("ingress") == ["r0"] and index.replica_ids("driver") == ["r0", "r1"]
    index.routable("ingress", ["r0", "r1", "r9"])
    assert index.replica_ids("ingress") == ["r0", "r1"] and index.replica_ids() == ["r0", "r1"]
    assert index.remove("r0") is True and index.replica_ids("ingress") == ["r1"]


def test_a_reply_takes_its_request_off_its_replicas_load():
    """The ingress's ``replied`` (sent before the client has its answer) ends the request's load
    on its replica; Serve's completion callback (at the replica stream's end, after the ingress
    answered) may reach the index after the client's next request. Three conversations sharing
    a system block (a hot prefix, where each outstanding request costs 300 tokens), one request
    at a time, with no completion callback before the next route: every next turn stays on the
    replica that caches its conversation. Before the fix the last request still counted on its
    replica and a conversation's next turn moved to the other one (its cache lost)."""
    import random

    from radixkv.namespace import Namespace

    index = ray_mod.CacheIndex.__ray_metadata__.modified_class()  # the actor's class, in process
    for r in ("r0", "r1"):
        index.push(r, None, {"capacity": 4096}, dict(epoch=1, actor_name=r, pid=1))
    ns = ray_mod.wire_namespace(Namespace.of(None))
    rng = random.Random(0)
    system = [rng.randrange(100, 40000) for _ in range(16)]
    prompts = [list(system) for _ in range(3)]
    homes: dict[int, set] = {}
    late = []  # Serve's completion callbacks, arriving after the next request's route
    for turn in range(3):
        for c in range(3):
            prompts[c] += [rng.randrange(100, 40000) for _ in range(rng.randrange(10, 60))]
            rid, key = f"req-{c}-{turn}", f"key-{c}-{turn}"
            homes.setdefault(c, set()).add(
                index.route(key, dict(request_id=rid, token_ids=prompts[c], namespace=ns), ["r0", "r1"])
            )
            for k in late:
                index.completed(k)
            late = [key]
            output = [rng.randrange(100, 40000) for _ in range(4)]
            index.replied(rid, output)
            assert index.state()["loads"] == {"r0": (0, 0), "r1": (0, 0)}, (c, turn)
            prompts[c] += output[:-1] + [
                rng.randrange(100, 40000) for _ in range(5)
            ]  # the reply as the client keeps it
    assert all(len(h) == 1 for h in homes.values()), homes
    for k in late:
        index.completed(k)  # the callback after the reply: nothing counted twice
    assert index.state()["loads"] == {"r0": (0, 0), "r1": (0, 0)}


def test_an_unavailable_index_is_a_503_not_a_500(tokenizer):
    """While the index actor restarts, ``/health`` and ``/cache_stats`` answer 503
    (``engine_dead``, naming the index), not an internal error."""
    from ray.exceptions import ActorUnavailableError

    from radixkv.server.app import create_app
    from radixkv.server.backend import ModelFacts

    def unavailable():
        raise ActorUnavailableError("The actor is temporarily unavailable", b"\0" * 16)

    index = _Index([], {})
    index.replica_ids = index.state = _Call(unavailable)
    facts = ModelFacts("m", None, "llama", None, len(tokenizer), 2048)
    app = create_app(ray_mod.RemoteLLM(None, tokenizer, facts, index, replicas=2), served_model_name="m")
    code, body = _health(app)
    assert code == 503 and body["error"]["code"] == "engine_dead", body
    assert "cache index is unavailable" in body["error"]["message"], body


def test_a_request_that_cannot_go_on_names_no_internals(tokenizer):
    """A replica died under unseeded sampling with n=2 after output was delivered: the request
    ends with an ``EngineDeadError`` saying why, and never Ray's error text (the actor's pid,
    node IP, names), which goes to the log."""
    from ray.exceptions import ActorDiedError

    from radixkv.async_llm import EngineDeadError
    from radixkv.sampling_params import SamplingParams
    from radixkv.server.backend import ModelFacts

    class Dying(_Handle):
        def remote(self, args: dict):
            async def stream():
                yield SimpleNamespace(finished=False, outputs=[SimpleNamespace(token_ids=[1])] * 2)
                err = ActorDiedError()
                err.error_msg = "The actor died. pid: 4242 ip: 10.1.2.3 name: SERVE_REPLICA::x"
                raise err

            return _Stream(stream(), self)

    facts = ModelFacts("m", None, "llama", None, len(tokenizer), 2048)
    llm = ray_mod.RemoteLLM(handle=Dying(), tokenizer=tokenizer, facts=facts, index=_Index(["r0"], {}), replicas=2)

    async def run():
        params = SamplingParams(n=2, temperature=1.0, max_tokens=8)
        gen = llm.generate(prompt_token_ids=[5, 6], sampling_params=params, request_id="s")
        assert (await gen.__anext__()).finished is False
        with pytest.raises(EngineDeadError) as e:
            await gen.__anext__()
        return str(e.value)

    msg = asyncio.run(run())
    assert msg.startswith("the replica serving s died after 2 output tokens: unseeded sampling with n=2"), msg
    assert "10.1.2.3" not in msg and "4242" not in msg and "SERVE_REPLICA" not in msg, msg


def test_a_non_streamed_request_restarts_where_a_stream_could_not_go_on(tokenizer):
    """Unseeded sampling with n=2 whose replica died after some output: streamed, it ends with
    an error (above); held (a non-streamed answer, :meth:`EngineClient.collect`), its client has
    none of that output, so it restarts on another replica and finishes."""
    from ray.exceptions import ActorDiedError

    from radixkv.sampling_params import SamplingParams
    from radixkv.server.backend import ModelFacts

    class DiesOnce(_Handle):
        def remote(self, args: dict):
            self.calls.append(args["request_id"])
            first = len(self.calls) == 1

            async def stream():
                yield SimpleNamespace(finished=False, outputs=[SimpleNamespace(token_ids=[1])] * 2)
                if first:
                    raise ActorDiedError()
                yield SimpleNamespace(finished=True, outputs=[SimpleNamespace(token_ids=[3, 4])] * 2)

            return _Stream(stream(), self)

    facts = ModelFacts("m", None, "llama", None, len(tokenizer), 2048)
    handle = DiesOnce()
    llm = ray_mod.RemoteLLM(handle=handle, tokenizer=tokenizer, facts=facts, index=None, replicas=2)

    async def run():
        params = SamplingParams(n=2, temperature=1.0, max_tokens=2)
        gen = llm.generate(prompt_token_ids=[5, 6], sampling_params=params, request_id="h")
        assert (await gen.__anext__()).finished is False
        llm.hold_partials("h")
        return [o async for o in gen]

    rest = asyncio.run(run())
    assert handle.calls == ["h", "h-resume1"]
    assert [o.finished for o in rest] == [False, True] and list(rest[-1].outputs[0].token_ids) == [3, 4]


def _failing_app(tokenizer, error: BaseException):
    """The app over a replica whose stream yields one output, then raises ``error`` as the
    ingress receives it from Ray."""
    from radixkv.server.app import create_app
    from radixkv.server.backend import ModelFacts

    class Failing(_Handle):
        def remote(self, args: dict):
            async def stream():
                yield SimpleNamespace(finished=False, outputs=[SimpleNamespace(token_ids=[1])])
                raise error

            return _Stream(stream(), self)

    facts = ModelFacts("m", None, "llama", None, len(tokenizer), 2048)
    llm = ray_mod.RemoteLLM(handle=Failing(), tokenizer=tokenizer, facts=facts, index=_Index(["r0"], {}), replicas=2)
    return create_app(llm, served_model_name="m")


def _complete(app) -> tuple[int, dict]:
    async def post():  # as uvicorn answers: Starlette re-raises an unhandled error after its 500
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            r = await http.post("/v1/completions", json={"model": "m", "prompt": [5, 6], "max_tokens": 4})
            return r.status_code, r.json()

    return asyncio.run(post())


def test_a_request_that_failed_on_its_replica_is_a_500_request_failed(tokenizer):
    """One request's sampling raised on its replica (``RequestFailed``): Ray pickles the error
    to the ingress, which answers as one engine does, 500 ``request_failed`` naming the request
    and the engine's error. Before the fix ``RequestFailed`` could not be unpickled (its
    constructor takes the output, pickle passed the message): the client got Ray's
    ``UnserializableException`` as a 500 ``internal_error`` quoting the replica's traceback,
    pid and IP."""
    import pickle

    from ray.exceptions import RayTaskError

    from radixkv.errors import RequestFailed
    from radixkv.outputs import RequestOutput

    out = RequestOutput("cmpl-1-0", None, [5, 6], [], True, 0, None, error="IndexError('injected')")
    sent = pickle.loads(pickle.dumps(RequestFailed(out)))  # what crosses Ray
    assert type(sent) is RequestFailed and sent.request_id == "cmpl-1-0" and sent.output.error == out.error
    assert str(sent) == "request cmpl-1-0 failed in the engine: IndexError('injected')"
    wrapped = RayTaskError("generate", "Traceback ... pid=4242 ip=10.1.2.3", sent).as_instanceof_cause()
    code, body = _complete(_failing_app(tokenizer, wrapped))
    assert code == 500 and body["error"]["code"] == "request_failed", body
    assert body["error"]["message"] == "request cmpl-1-0 failed in the engine: IndexError('injected')", body


def test_an_error_the_ingress_cannot_read_names_no_internals(tokenizer):
    """A replica's error that Ray cannot rebuild at the ingress (``UnserializableException``,
    whose text is the replica's traceback with its pid, IP and actor id) is a 500 that names
    the request and none of that, which goes to the log."""
    from ray.exceptions import UnserializableException

    trace = "ray::EngineReplica.generate() (pid=4242, ip=10.1.2.3, actor_id=abc)\nTraceback: ..."
    code, body = _complete(_failing_app(tokenizer, UnserializableException(trace)))
    assert code == 500 and body["error"]["code"] == "internal_error", body
    msg = body["error"]["message"]
    assert "failed on its replica" in msg and "4242" not in msg and "10.1.2.3" not in msg, msg


def _replies_app(tokenizer, monkeypatch, **ingress_kw):
    """The ingress app (served name ``foo``, ``--model`` ``smollm2-135m``) over a handle that
    answers every request with one finished output of two tokens."""
    from radixkv.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from radixkv.server.backend import ModelFacts

    facts = ModelFacts("smollm2-135m", None, "llama", None, len(tokenizer), 2048)

    class Replies(_Handle):
        def remote(self, args: dict):
            sample = CompletionOutput(0, tokenizer.decode([7, 8]), [7, 8], "length")
            out = RequestOutput(args["request_id"], None, args["token_ids"], [sample], True, 0, RequestMetrics(0.0))

            async def stream():
                yield out

            return _Stream(stream(), self)

    handle = Replies()
    handle.info = _Call({"facts": facts.as_dict()})
    monkeypatch.setattr(ray_mod, "get_index", lambda *a, **k: _Index(["r0"], {}))
    ingress = object.__new__(ray_mod.Ingress)
    asyncio.run(ingress.__init__(handle, "foo", "smollm2-135m", **ingress_kw))
    return ingress.__serve_build_asgi_app__()


def _post(app, content: bytes) -> tuple[int, dict]:
    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            r = await http.post("/v1/completions", content=content, headers={"Content-Type": "application/json"})
            return r.status_code, r.json()

    return asyncio.run(run())


def test_the_ingress_accepts_the_model_names_one_engine_accepts(tokenizer, monkeypatch):
    """``radixkv serve --replicas 2 --served-model-name foo`` answers ``model: "foo"`` and the
    ``--model`` name, as ``radixkv serve`` does (``model_aliases``); any other name is OpenAI's
    404 ``model_not_found`` (a 400 until the 404 fix). Before the fix the ingress accepted only
    ``foo``: a client sending the ``--model`` name got 400 ``model_not_found`` from the replicas
    and 200 from one engine."""
    app = _replies_app(tokenizer, monkeypatch)

    def post(model):
        return _post(app, json.dumps({"model": model, "prompt": [5, 6], "max_tokens": 2}).encode())

    assert [post(m)[0] for m in ("foo", "smollm2-135m")] == [200, 200]
    code, body = post("gpt-4")
    assert code == 404 and body["error"]["code"] == "model_not_found" and body["error"]["param"] == "model", body


def test_the_ingress_takes_max_request_bytes_as_one_engine_does(tokenizer, monkeypatch):
    """``radixkv serve --replicas N --max-request-bytes B``: the ingress app refuses a body over
    ``B`` with the 413 one engine gives (it took no limit before); unset, the 32 MiB default."""
    body = json.dumps({"model": "foo", "prompt": [5, 6], "max_tokens": 2}).encode()
    small = _replies_app(tokenizer, monkeypatch, max_request_bytes=len(body))
    assert _post(small, body)[0] == 200
    code, err = _post(small, body[:-1] + b" }")
    assert (code, err["error"]["code"]) == (413, "request_too_large") and f"limit of {len(body)} bytes" in str(err)
    default = _replies_app(tokenizer, monkeypatch)
    from radixkv.server.body import BodyLimitMiddleware

    assert [m.kwargs["max_bytes"] for m in default.user_middleware if m.cls is BodyLimitMiddleware] == [32 << 20]


def test_a_replica_whose_engine_stopped_leaves_the_index_and_its_requests_go_on(tokenizer):
    """A replica whose engine stopped (``EngineDeadError``; its actor lives on until Serve's
    health checks replace it) is a dead replica: it asks the index to route nothing more to it
    before its error leaves it, and the ingress sends its greedy request on elsewhere as a
    continuation, the client seeing one uninterrupted stream. Before the fix the request ended
    with a 503 ``engine_dead`` and the index kept routing there (a conversation's next turns
    followed their cache to it) until Serve replaced it."""
    from ray.exceptions import RayTaskError

    from radixkv.async_llm import EngineDeadError
    from radixkv.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from radixkv.sampling_params import SamplingParams
    from radixkv.server.backend import ModelFacts

    removed: list[str] = []

    def output(rid, prompt, tokens, finished):
        sample = CompletionOutput(0, tokenizer.decode(tokens), tokens, "length" if finished else None)
        return RequestOutput(rid, None, prompt, [sample], finished, 0, RequestMetrics(0.0))

    class DeadEngine:  # the replica's AsyncLLM after its engine thread stopped mid-request
        def generate(self, prompt, params, request_id, **k):
            async def stream():
                yield output(request_id, [5, 6], [7], False)
                raise EngineDeadError("the engine thread has stopped: RuntimeError('CUDA error')")

            return stream()

    replica = object.__new__(ray_mod.EngineReplica)
    replica.llm, replica.replica_id = DeadEngine(), "r0"
    replica._index = SimpleNamespace(remove=_Call(lambda: removed.append("r0")))

    class Handle(_Handle):  # r0 (the replica above, its error as Ray delivers it), then r1
        def remote(self, args: dict):
            self.calls.append(args["request_id"])
            if len(self.calls) > 1:
                return _Stream(_outputs(args), self)

            async def stream():
                try:
                    async for out in replica.generate(args):
                        yield out
                except EngineDeadError as exc:
                    raise RayTaskError("generate", "Traceback ...", exc).as_instanceof_cause() from None

            return _Stream(stream(), self)

    def _outputs(args):  # the continuation: prompt + [7], 3 tokens more
        async def stream():
            assert args["token_ids"] == [5, 6, 7] and args["params"].max_tokens == 3
            yield output(args["request_id"], [5, 6, 7], [8, 9, 10], True)

        return stream()

    facts = ModelFacts("m", None, "llama", None, len(tokenizer), 2048)
    handle = Handle()
    llm = ray_mod.RemoteLLM(handle=handle, tokenizer=tokenizer, facts=facts, index=None, replicas=2)

    async def run():
        params = SamplingParams(temperature=0, max_tokens=4)
        return [o async for o in llm.generate(prompt_token_ids=[5, 6], sampling_params=params, request_id="g")]

    outs = asyncio.run(run())
    assert removed == ["r0"] and handle.calls == ["g", "g-resume1"]
    assert outs[-1].finished and list(outs[-1].outputs[0].token_ids) == [7, 8, 9, 10]


def test_session_routing_keys_on_prompt_cache_key_per_tenant(tokenizer):
    """``--router-policy session`` on replicas hashes the client's conversation key: OpenAI's
    ``prompt_cache_key`` (else ``user``) reaches the router as the request's ``session``, kept
    apart per tenant; before, the ingress never passed one, so every request was hashed on its
    own random id and one conversation's turns scattered over the replicas."""
    from radixkv.namespace import Namespace
    from radixkv.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from radixkv.server.app import create_app
    from radixkv.server.backend import ModelFacts

    class Handle(_Handle):
        def __init__(self) -> None:
            super().__init__()
            self.sessions: list = []

        def remote(self, args: dict):
            self.sessions.append(args["session"])

            async def stream():
                sample = CompletionOutput(0, tokenizer.decode([28]), [28], "length")
                yield RequestOutput(args["request_id"], None, args["token_ids"], [sample], True, 0, RequestMetrics(0.0))

            return _Stream(stream(), self)

    facts = ModelFacts("m", None, "llama", None, len(tokenizer), 2048)
    handle = Handle()
    llm = ray_mod.RemoteLLM(handle=handle, tokenizer=tokenizer, facts=facts, index=None, replicas=2)
    app = create_app(llm, served_model_name="m")
    chat = dict(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2)

    async def post():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            for extra in ({"prompt_cache_key": "conv-7"}, {"user": "u1"}, {"prompt_cache_key": "k", "user": "u1"}, {}):
                assert (await http.post("/v1/chat/completions", json=dict(chat, **extra))).status_code == 200
            body = dict(model="m", prompt="hi", max_tokens=2, user="u2")
            assert (await http.post("/v1/completions", json=body)).status_code == 200
            body = dict(model="m", input="hi", max_output_tokens=2, prompt_cache_key="conv-8", store=False)
            assert (await http.post("/v1/responses", json=body)).status_code == 200

    asyncio.run(post())
    assert handle.sessions == [repr((None, k)) for k in ("conv-7", "u1", "k")] + [None] + [
        repr((None, "u2")),
        repr((None, "conv-8")),
    ]

    index = ray_mod.CacheIndex.__ray_metadata__.modified_class("session")
    for r in ("r0", "r1", "r2", "r3"):
        index.push(r, None, {"capacity": 64}, dict(epoch=1, actor_name=r, pid=1))
    ns = ray_mod.wire_namespace(Namespace.of(None))
    cands = ["r0", "r1", "r2", "r3"]

    def route(i: int, session) -> str:
        return index.route(f"q{i}", dict(token_ids=[i] * 20, namespace=ns, session=session), cands)

    for key in ("conv-1", "conv-2", "conv-3"):  # every turn of a conversation on one replica
        assert len({route(i, repr((None, key))) for i in range(12)}) == 1
    assert len({route(i, None) for i in range(12)}) > 1  # no key: spread by request id
    homes = {t: {route(i, repr((t, "same-key"))) for i in range(3)} for t in ("alice", "bob", "carol", "dan", "eve")}
    assert len({next(iter(h)) for h in homes.values()}) > 1 and all(len(h) == 1 for h in homes.values())


def test_a_full_replica_queue_is_a_429_as_on_one_engine(tokenizer):
    """Serve queues what the replicas cannot take yet at the ingress's handle, where the engines'
    ``max_queued_requests`` never sees it: that bound is the handle's (Serve's
    ``max_queued_requests``), and Serve's refusal is the 429 ``queue_full`` one engine answers,
    not an unbounded queue (or Serve's 503)."""
    from ray.serve.exceptions import BackPressureError

    from radixkv.server.app import create_app
    from radixkv.server.backend import ModelFacts

    opts = ray_mod.engine_deployment_options(2, 0.5, 256, dict(max_queued_requests=1024))
    assert opts["max_queued_requests"] == 1024 and opts["max_ongoing_requests"] == 256
    assert ray_mod.engine_deployment_options(2, 0.5, 256, {})["max_queued_requests"] == -1  # no bound set: none

    class Full(_Handle):
        def remote(self, args: dict):
            self.calls.append(args["request_id"])

            async def stream():
                raise BackPressureError(num_queued_requests=1024, max_queued_requests=1024)
                yield  # an async generator

            return _Stream(stream(), self)

    facts = ModelFacts("m", None, "llama", None, len(tokenizer), 2048)
    handle = Full()
    llm = ray_mod.RemoteLLM(handle=handle, tokenizer=tokenizer, facts=facts, index=None, replicas=2)
    app = create_app(llm, served_model_name="m")

    async def post():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            body = dict(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
            return await http.post("/v1/chat/completions", json=body)

    r = asyncio.run(post())
    assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full", r.text
    assert "1024 requests wait for a replica" in r.json()["error"]["message"] and len(handle.calls) == 1
    assert llm.num_unfinished_requests() == 0
