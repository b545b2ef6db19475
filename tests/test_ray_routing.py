"""radixkv on Ray Serve (radixkv/router/ray.py): one local Ray instance (2 logical CPUs, dashboard
off), 2 replicas of a small random-weight Llama-shaped model with the default model's tokenizer,
the OpenAI app as ingress, the cache-aware request router. Through the ingress with the openai
SDK: a multi-turn replay of real ShareGPT user messages gets every next turn routed to the
replica that holds the conversation (cached tokens asserted per request), round-robin on the same
kind of replay does measurably worse, streaming works, every route of the app answers as on the
single engine (tests/route_table.py, the table tests/test_server.py runs), and a replica killed
mid-run is dropped from the router while requests go elsewhere and nothing hangs. The ingress
has API keys (every test above uses the admin key ``x``): every route asks for a key and the
admin routes for an admin's (tests/route_table.py's ``check_auth``, as on one engine), and two
tenants sending the same prompt never share a cached prefix across the router and its replicas
(their stored Responses neither). The set-up time is printed.

First, before that instance starts: ``radixkv serve --replicas 2`` as a subprocess (its own Ray
instance in its own temp dir) shut down by SIGTERM leaves no process of its Ray instance behind."""

from __future__ import annotations

import concurrent.futures
import functools
import inspect
import json
import os
import random
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from route_table import ROUTES, Target
from server_helpers import LOST_PORT, free_port, start_serving

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

pytestmark = pytest.mark.timeout(180)

TINY = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    seed=0,
)
ENGINE = dict(device="cpu", max_total_tokens=16384, max_running_requests=16, chunked_prefill_size=512)
QUOTA = 3000
KEYS = {  # the ingress's API keys: "x" (the key every other test uses) is the admin's
    "x": {"tenant": "ops", "admin": True},
    "sk-ray-alice": {"tenant": "alice", "kv_quota_tokens": QUOTA},
    "sk-ray-bob": {"tenant": "bob"},
}
ADMIN = {"Authorization": "Bearer x"}
ROOT = Path(__file__).resolve().parents[1]


def test_both_backends_implement_the_whole_engine_interface():
    """``RemoteLLM`` (replicas) and ``LocalBackend`` (one engine) have every method of
    ``EngineBackend`` with its parameters, coroutine where it is one (a method the next issue adds
    to the Protocol fails here until both implement it)."""
    from radixkv.router.ray import RemoteLLM
    from radixkv.server.backend import EngineBackend, LocalBackend

    methods = [m for m, v in vars(EngineBackend).items() if not m.startswith("_") and inspect.isfunction(v)]
    assert {"generate", "cache_stats", "model_facts", "release_pin", "reset_prefix_cache"} <= set(methods)
    for cls in (LocalBackend, RemoteLLM):
        for m in methods:
            want, got = getattr(EngineBackend, m), getattr(cls, m)
            assert list(inspect.signature(got).parameters) == list(inspect.signature(want).parameters), (cls, m)
            assert inspect.iscoroutinefunction(got) == inspect.iscoroutinefunction(want), (cls, m)


# ---------------------------------------------------------------------------- the CLI (no Ray started)
@pytest.fixture
def no_ray(monkeypatch):
    """``radixkv.router.ray.run`` without Ray: starting it fails the test, shutting it down does
    nothing (the module's cluster may be up)."""
    from radixkv.router import ray as rr

    def started(*a, **k):
        raise AssertionError("Ray was started")

    monkeypatch.setattr(rr, "start_ray", started)
    monkeypatch.setattr(rr.ray, "shutdown", lambda *a, **k: None)
    monkeypatch.setattr(rr.ray, "is_initialized", lambda: False)
    return rr


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--max-total-tokens", "0"], "max_total_tokens must be an integer >= page_size (1), got 0"),
        (["--page-size", "0"], "page_size must be an integer >= 1, got 0"),
        (["--max-running-requests", "0"], "max_running_requests must be an integer >= 1, got 0"),
    ],
)
def test_serve_replicas_refuses_a_bad_engine_setting_before_starting_ray(no_ray, capsys, flags, message):
    """A setting every replica's engine refuses stops ``radixkv serve --replicas 2`` at once with
    exit 2 and the engine's message, as ``radixkv serve`` does. Before the fix Ray and Serve
    started, each replica failed 6 times, and after ~35 s the CLI died with a traceback ending in
    "RuntimeError: Deploying application radixkv failed: Failed to update the deployments
    ['EngineReplica']" that never named the setting."""
    from radixkv.cli import main

    assert main(["serve", "--replicas", "2", *flags]) == 2
    assert capsys.readouterr().err.strip() == f"radixkv serve: {message}"


def test_serve_replicas_refuses_more_cpus_than_its_local_ray_has(no_ray, monkeypatch, capsys):
    """``--replicas 4 --replica-cpus 1`` on a 2-CPU machine: its local Ray instance (the machine's
    CPUs) cannot schedule 4.25 CPUs of replicas and ingress, so the CLI exits 2 saying what fits.
    Before the fix Serve waited for the unschedulable replicas forever and the CLI printed nothing
    (its warnings go to the controller's log). 3 x 0.5 + 0.25 fits; with ``--ray-address`` the
    cluster's CPUs are not known here and nothing is refused."""
    rr = no_ray
    monkeypatch.setattr(rr.os, "cpu_count", lambda: 2)
    from radixkv.cli import main

    assert main(["serve", "--replicas", "4", "--replica-cpus", "1"]) == 2
    assert capsys.readouterr().err.strip() == (
        "radixkv serve: --replicas 4 x --replica-cpus 1 and the ingress's 0.25 need 4.25 Ray CPUs; the local Ray "
        "instance has 2 (this machine's): lower --replica-cpus (at most 0.4375 for 4 replicas) or --replicas, "
        "or join a cluster with --ray-address"
    )
    assert rr.local_cpus_error(3, 0.5) is None and rr.local_cpus_error(2, 0.875) is None
    with pytest.raises(AssertionError, match="Ray was started"):  # the cluster's CPUs: Serve's business
        main(["serve", "--replicas", "4", "--replica-cpus", "1", "--ray-address", "10.0.0.1:6379"])


def test_serve_replicas_refuses_a_host_that_does_not_resolve_before_starting_ray(no_ray, capsys):
    """``--host`` that does not resolve: exit 2 naming it before Ray starts, as ``radixkv serve``
    refuses it before loading the model (tests/test_cli_flags.py). Before the fix Ray, Serve and
    its controller started, then ``serve.start`` died with a 40-line traceback ending in Ray's
    "RuntimeError: Failed to bind to address 'no-such-host.invalid:30000'" (exit 1)."""
    from radixkv.cli import main

    assert main(["serve", "--replicas", "2", "--host", "no-such-host.invalid"]) == 2
    assert capsys.readouterr().err.startswith("radixkv serve: --host no-such-host.invalid: cannot resolve it: ")


def test_serve_replicas_names_a_port_in_use_before_starting_ray(no_ray, capsys):
    """A port another process listens on: exit 1 naming it before Ray starts (one engine's uvicorn
    exits 1 on it too). Before the fix Ray, Serve and its controller started, then ``serve.start``
    died with a 40-line traceback ending in Ray's "RuntimeError: Failed to bind to address
    '127.0.0.1:PORT'" (the ingress's proxy could not listen)."""
    from radixkv.cli import main

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--replicas", "2", "--port", str(port)]) == 1
    assert capsys.readouterr().err.strip() == (
        f"radixkv serve: --port {port}: cannot listen on 127.0.0.1:{port}: Address already in use"
    )


@pytest.mark.parametrize("flags", [["--router-policy", "session"], ["--replica-cpus", "1"], ["--ray-address", "auto"]])
def test_a_replicas_flag_without_replicas_is_refused(no_ray, capsys, flags):
    """A flag that only means something across replicas, given to one engine, is exit 2 naming it
    (before, ``radixkv serve --router-policy session`` served one engine and ignored it)."""
    from radixkv.cli import main

    assert main(["serve", *flags]) == 2
    assert capsys.readouterr().err.strip() == (
        f"radixkv serve: {flags[0]} applies only with --replicas N > 1 (one engine has nothing to route or place)"
    )


def test_serve_replicas_names_why_its_replicas_did_not_start(no_ray, monkeypatch, capsys):
    """A replica that fails in its constructor (here a model file that does not exist, found only
    where the replica loads it): Serve gives up on the deployment and the CLI exits 1 naming the
    replica's exception, Serve's status message's last line (not Ray's traceback, nor a bare
    "Failed to update the deployments")."""
    from types import SimpleNamespace

    rr = no_ray
    trace = (
        "The deployment failed to start 6 times in a row. See controller logs for details. Error:\n"
        "ray::ServeReplica:radixkv:EngineReplica.initialize_and_get_metadata() (pid=10885, ip=192.0.2.2)\n"
        '  File "radixkv/models/loader.py", line 194, in resolve_hf_dir\n'
        "FileNotFoundError: model '/nonexistent/m.gguf' not found\n"
    )
    deployments = {
        "EngineReplica": SimpleNamespace(status="DeploymentStatus.DEPLOY_FAILED", message=trace),
        "Ingress": SimpleNamespace(status="DeploymentStatus.UPDATING", message=""),
    }
    status = SimpleNamespace(applications={"radixkv": SimpleNamespace(deployments=deployments)})
    monkeypatch.setattr(rr.serve, "status", lambda: status)

    def serve_forever(*a, **k):
        try:
            raise RuntimeError("Deploying application radixkv failed: Failed to update the deployments")
        except RuntimeError as exc:
            raise rr.DeployFailed(rr._deploy_error(exc)) from None

    monkeypatch.setattr(rr, "_serve_forever", serve_forever)
    from radixkv.cli import main

    assert main(["serve", "--replicas", "2", "--model", "/nonexistent/m.gguf"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == (
        "radixkv serve: the replicas did not start: EngineReplica: "
        "FileNotFoundError: model '/nonexistent/m.gguf' not found"
    )


# ---------------------------------------------------------------------------- SIGTERM (its own Ray)
SERVE_TINY = """
import functools, sys
from radixkv.router import ray as rr
rr.build_app = functools.partial(rr.build_app, random_model=%r)  # the test's tiny model, no weights to load
from radixkv.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _belongs(pid: int, tmpdir: str, sid: int) -> bool:
    """Whether live process ``pid`` is of the Ray instance in ``tmpdir`` started in session
    ``sid``: in that session, or with ``RAY_TMPDIR=tmpdir`` in its environment, or with a file
    open under ``tmpdir`` (Ray's agents rename themselves, which may overwrite their environment,
    and its workers start sessions of their own, but every one keeps its log files open)."""
    try:
        if Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z":
            return False  # a zombie: nothing runs
        if os.getsid(pid) == sid or f"RAY_TMPDIR={tmpdir}".encode() in Path(f"/proc/{pid}/environ").read_bytes():
            return True
        fds = Path(f"/proc/{pid}/fd")
        return any(os.readlink(fd).startswith(tmpdir + "/") for fd in fds.iterdir())
    except (OSError, IndexError):
        return False


def _ray_processes(tmpdir: str, sid: int) -> dict[int, str]:
    """pid -> command line of every live process of that Ray instance (:func:`_belongs`)."""
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != os.getpid() and _belongs(int(d), tmpdir, sid):
            try:
                out[int(d)] = Path(f"/proc/{d}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                pass
    return out


def test_sigterm_shuts_the_whole_deployment_down(tmp_path):
    """``radixkv serve --replicas 2`` (its own Ray instance), SIGTERM as kill, systemd and docker
    send it: the process exits 0 and no process of its Ray instance survives, Ray's
    DashboardAgent and RuntimeEnvAgent included (they ignore SIGTERM; before the fix they stayed)."""
    tmpdir = tempfile.mkdtemp(prefix="rkv", dir="/tmp")  # short: Ray's socket paths live under it
    env = dict(os.environ, RAY_TMPDIR=tmpdir, PYTHONPATH=str(ROOT), RAY_SERVE_LOG_TO_STDERR="0")
    cmd = [sys.executable, "-c", SERVE_TINY % (TINY,), "serve", "--replicas", "2", "--max-total-tokens", "4096"]
    log_path = tmp_path / "serve.log"
    t0 = time.perf_counter()
    proc = None
    try:
        # on a free port, again on another if Serve's proxy lost it while Ray started (start_serving)
        _, proc = start_serving(cmd, env, log_path, 150, ready="/get_model_info", start_new_session=True)
        up = time.perf_counter() - t0
        running = _ray_processes(tmpdir, proc.pid)
        names = " ".join(running.values())
        assert "DashboardAgent" in names and "RuntimeEnvAgent" in names and "EngineReplica" in names, running
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(120)
        # Ray's processes exit with their raylet; wait for the last (bounded), then none may be left
        deadline = time.monotonic() + 30
        while _ray_processes(tmpdir, proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = _ray_processes(tmpdir, proc.pid)
        assert left == {} and rc == 0, (rc, left, log_path.read_text()[-2000:])
        print(f"\nserve --replicas 2: up in {up:.1f}s, SIGTERM to no process left {time.perf_counter() - t0 - up:.1f}s")
    finally:  # nothing of it may outlive the test (a stray would load the machine for the rest of CI)
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(30)
        for pid in _ray_processes(tmpdir, -1 if proc is None else proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(tmpdir, ignore_errors=True)


# ---------------------------------------------------------------------------- the module's cluster
def _serve_start() -> int:
    """``serve.start`` on a free port; its port. The port is free when picked and Serve's proxy
    binds it once Serve's controller started (seconds on a loaded machine, while Ray's processes
    take ports of their own): a proxy that lost it fails ``serve.start`` ("Failed to bind to
    address"); then again on another port (3 tries), after ``serve.shutdown`` (the controller
    would otherwise keep the first port)."""
    for attempt in range(3):
        port = free_port()
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            return port
        except ray.exceptions.RayTaskError as exc:
            if not any(m in str(exc).lower() for m in LOST_PORT) or attempt == 2:
                raise
            serve.shutdown()
    raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def cluster():
    # start_ray sets OMP_NUM_THREADS=1 and the like in this process's environment (for Ray's
    # workers), ray.init a few more (RAY_*, PYTHONBREAKPOINT): put back at teardown, or the
    # subprocesses of every later module (radixkv serve) inherit them
    saved = dict(os.environ)
    try:
        yield from _cluster()
    finally:
        for name in set(os.environ) - set(saved):
            del os.environ[name]
        os.environ.update(saved)


def _cluster():
    from radixkv.router import ray as rr

    t0 = time.perf_counter()
    os.environ.setdefault("RAY_SERVE_LOG_TO_STDERR", "0")
    rr.start_ray(num_cpus=2)
    port = _serve_start()
    from radixkv.server.auth import APIKeys

    keys = APIKeys.from_mapping(KEYS)
    app = rr.build_app(
        replicas=2, engine_kwargs=ENGINE, random_model=TINY, replica_cpus=0.5, ingress_cpus=0.25, api_keys=keys
    )
    serve.run(app, name="radixkv", route_prefix="/")
    index = rr.get_index()
    setup_s = time.perf_counter() - t0
    print(f"\nRay set-up (ray.init + serve.start + 2 replicas + ingress): {setup_s:.1f}s")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=60)
    try:
        yield dict(client=client, index=index, setup_s=setup_s, base_url=f"http://127.0.0.1:{port}")
    finally:
        serve.shutdown()
        ray.shutdown()


def _conversations(tok, n: int, turns: int, skip: int) -> list[list[list[int]]]:
    """Per conversation, the token ids each turn adds: ChatML blocks of the real ShareGPT user
    message and the dataset's reply (history as the dataset has it), then the generation prompt."""
    from radixkv.datasets import load_conversations

    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    system = enc("<|im_start|>system\nYou are a helpful AI assistant named SmolLM.<|im_end|>\n")
    out = []
    for conv in load_conversations(n, turns, max_user_chars=400, skip=skip):
        adds = []
        for t, user in enumerate(conv):
            block = (system if t == 0 else []) + enc(f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n")
            adds.append(block)
        out.append(adds)
    return out


def _replay(client, index, tok, convs, reply="Understood; here is the next part."):
    """Turn by turn, all conversations at once per turn; returns per request (conv, turn, prompt
    ids, cached tokens, request id). Each request is sent once the router has settled
    (:func:`_settle`): what it routes by is what the earlier requests left, however late their
    completion callbacks and cache events reach the index on a loaded machine."""
    reply_ids = tok.encode(reply + "<|im_end|>\n", add_special_tokens=False)
    prompts = [[] for _ in convs]
    rows = []
    for t in range(len(convs[0])):
        for c, adds in enumerate(convs):
            if t > 0:
                prompts[c] = prompts[c] + reply_ids  # the history carries the dataset-style reply
            prompts[c] = prompts[c] + adds[t]

        def one(c, t=t):
            _settle(index)
            r = client.completions.create(model="smollm2-135m", prompt=prompts[c], max_tokens=4, temperature=0)
            return c, t, list(prompts[c]), r.usage.prompt_tokens_details.cached_tokens, r.id

        rows.extend(one(c) for c in range(len(convs)))  # in order: round-robin alternates a conversation's turns
    return rows


def prompt_key(ids):
    from radixkv.router.ray import prompt_key as key

    return key(ids)


@functools.lru_cache(maxsize=1)
def _tokenizer():
    from transformers import AutoTokenizer

    from radixkv.models.loader import resolve_hf_dir

    return AutoTokenizer.from_pretrained(str(resolve_hf_dir("smollm2-135m")), local_files_only=True)


def test_next_turns_follow_the_conversation_and_round_robin_does_worse(cluster):
    client, index = cluster["client"], cluster["index"]
    tok = _tokenizer()
    convs = _conversations(tok, 3, 3, skip=0)
    rows = _replay(client, index, tok, convs)
    log = {d["prompt"]: d for d in ray.get(index.decisions.remote())}
    by_conv: dict[int, list] = {}
    for c, t, prompt, cached, rid in rows:
        by_conv.setdefault(c, []).append((t, prompt, cached, rid))
    for c, turns in by_conv.items():
        turns.sort()
        homes = {log[prompt_key(p)]["replica"] for _, p, _, _ in turns}
        assert len(homes) == 1, f"conversation {c} moved between replicas: {homes}"
        for (t, prompt, cached, _rid), (_, prev, _, _) in zip(turns[1:], turns[:-1]):
            # the whole previous prompt was cached on that replica (its reply differs from the
            # dataset's, so the match ends right after the previous prompt)
            assert cached == len(prev), (c, t, cached, len(prev))
            assert log[prompt_key(prompt)]["cached"] == len(prev) // 16 * 16  # the router saw it exactly
    aware = sum(r[3] for r in rows if r[1] > 0)
    # the ingress told the index every reply (what each replica caches of it) as it ended; the
    # ingress's call is fire-and-forget, so the last one may still be on its way: polled
    deadline = time.monotonic() + 60
    while ray.get(index.state.remote())["replies"] < len(rows) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.get(index.state.remote())["replies"] == len(rows)

    ray.get(index.set_policy.remote("round_robin"))
    try:
        rr_rows = _replay(client, index, tok, _conversations(tok, 3, 3, skip=3))
    finally:
        ray.get(index.set_policy.remote("cache_events"))
    rr_cached = sum(r[3] for r in rr_rows if r[1] > 0)
    rr_prompt = sum(len(r[2]) for r in rr_rows if r[1] > 0)
    aware_prompt = sum(len(r[2]) for r in rows if r[1] > 0)
    print(
        f"\ncached share of turns 2+: cache_events {aware / aware_prompt:.3f}, round_robin {rr_cached / rr_prompt:.3f}"
    )
    assert rr_cached / rr_prompt < 0.6 * aware / aware_prompt


def test_streaming_chat_through_the_ingress(cluster):
    client = cluster["client"]
    chunks = list(
        client.chat.completions.create(
            model="smollm2-135m",
            messages=[{"role": "user", "content": "Name three prime numbers."}],
            max_tokens=6,
            temperature=0,
            stream=True,
        )
    )
    assert len(chunks) >= 3 and chunks[-1].choices[0].finish_reason == "length"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    with pytest.raises(openai.BadRequestError) as e:  # the engine's refusal reaches the client as a 400
        client.completions.create(model="smollm2-135m", prompt=[1, 2, 3], max_tokens=100_000)
    assert "max_tokens" in str(e.value)
    # no flush across replicas: a 409 that says so (not "requests are unfinished")
    r = httpx.post(str(client.base_url).replace("/v1/", "/flush_cache"), headers=ADMIN, timeout=30)
    assert r.status_code == 409 and r.json()["error"]["code"] == "flush_not_offered"
    assert "across replicas" in r.json()["error"]["message"]


@pytest.mark.parametrize("check", [c for _, _, c in ROUTES], ids=[name for name, _, _ in ROUTES])
def test_every_route_answers_on_the_replicas(cluster, check):
    """The single engine's route table (tests/route_table.py) through the ingress: the same
    answers, the stats summed over both replicas, the flushes 409 ``flush_not_offered``."""
    with httpx.Client(base_url=cluster["base_url"], headers=ADMIN, timeout=120) as http:
        settle = functools.partial(_settle, cluster["index"])  # each follow-up routed by what the router took in
        check(Target(http, _tokenizer(), replicas=2, capacity=ENGINE["max_total_tokens"], settle=settle))


def _router_loads(index, deadline_s: float = 60.0) -> dict:
    """The index's recorded load per replica once every request it routed was reported complete
    (Serve's completion callbacks arrive asynchronously: polled up to ``deadline_s``)."""
    deadline = time.monotonic() + deadline_s
    while True:
        loads = {r: tuple(v) for r, v in ray.get(index.state.remote())["loads"].items()}
        if all(v == (0, 0) for v in loads.values()) or time.monotonic() > deadline:
            return loads
        time.sleep(0.1)


def test_the_router_holds_no_load_once_idle(cluster):
    """After the route table (streams read to the end, a stream its client left, engine refusals,
    streamed and not), the router counts no outstanding request and no queued prefill token on
    any replica: a request that ended any way is taken off its replica's load."""
    loads = _router_loads(cluster["index"])
    assert len(loads) == 2 and all(v == (0, 0) for v in loads.values()), loads


def test_the_ingress_router_tells_the_index_which_replicas_it_reaches(cluster):
    """The ingress's request router (keyed by its actor's id; a driver's by node and pid) says
    which replicas it can send calls to: the fan-outs (``/cache_stats?check=1``, ``/get_load``,
    ``/health``'s live count) ask exactly those, never one still starting."""
    index = cluster["index"]
    state = ray.get(index.state.remote())
    everyone = sorted(state["replicas"])
    ingress = [k for k, v in state["routable"].items() if ":" not in k and v == everyone]
    assert len(everyone) == 2 and ingress, state["routable"]

    def live() -> int:
        r = httpx.get(cluster["base_url"] + "/health", headers=ADMIN, timeout=60)
        return r.json()["replicas"]["live"]

    # the ingress asks with its router's key: told that it reaches one, /health counts one (the
    # router says again what it reaches now and then: tried a few times)
    seen = []
    for _ in range(5):
        for k in ingress:
            ray.get(index.routable.remote(k, everyone[:1]))
        seen.append(live())
        if seen[-1] == 1:
            break
    for k in ingress:
        ray.get(index.routable.remote(k, everyone))
    assert seen[-1] == 1 and live() == 2, seen


def test_a_new_deployment_gets_the_policy_it_asks_for(cluster):
    """``build_app(policy=...)`` on a cluster where the (detached) index actor already exists,
    as a second ``radixkv serve --replicas --ray-address`` finds the one an earlier deployment
    left: the index routes by the policy asked for. Before the fix ``get_if_exists`` handed back
    the old actor and its old policy (``--router-policy`` silently ignored)."""
    from radixkv.router import ray as rr

    index = cluster["index"]
    assert ray.get(index.state.remote())["policy"] == "cache_events"
    try:
        rr.build_app(replicas=2, engine_kwargs=ENGINE, random_model=TINY, policy="round_robin")
        assert ray.get(index.state.remote())["policy"] == "round_robin"
    finally:
        ray.get(index.set_policy.remote("cache_events"))


def _views_mirror_replicas(index, deadline_s: float = 60.0) -> dict:
    """Per live replica ``(router's view, the replica's cache)`` once the view caught up with the
    replica's last cache event (events are pushed as they happen: polled up to ``deadline_s``);
    each asked through the deployment, as the ingress asks every replica (who answered checked)."""
    handle = serve.get_deployment_handle("EngineReplica", app_name="radixkv")
    out, deadline = {}, time.monotonic() + deadline_s
    for r in ray.get(index.replica_ids.remote()):
        while True:
            got = handle.cache_blocks.remote({"replica": r}).result()
            view = ray.get(index.view.remote(r))
            if got["replica"] == r and view["seq"] == got["seq"] or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        out[r] = (view, got)
    return out


def _settle(index, deadline_s: float = 60.0) -> None:
    """Until the router counts no outstanding request on any replica (every completion callback
    arrived) and, under ``cache_events``, its view of each replica applied that replica's last
    cache event. A sequential client's next request otherwise races them: a late completion
    leaves the last request's load on its replica (an outstanding request on a hot prefix costs
    hundreds of tokens, so a conversation's next turn moves), a late event batch leaves blocks
    the replica just evicted in the view (the router expects them cached)."""
    loads = _router_loads(index, deadline_s)
    assert all(v == (0, 0) for v in loads.values()), loads
    if ray.get(index.state.remote())["policy"] == "cache_events":
        for r, (view, got) in _views_mirror_replicas(index, deadline_s).items():
            assert view["seq"] == got["seq"], (r, view["seq"], got["seq"])


def test_the_router_mirrors_each_replica_through_evictions(cluster):
    """More distinct 3,000-token prompts than both pools hold (every replica evicts): once idle,
    the router's view of each replica holds exactly the blocks its cache holds (events pushed
    as they happen, resyncs by snapshot). Then, with no finished request counted as held
    (``pending_ttl`` 0), a prompt routed again is expected cached as whole blocks of what its
    replica really serves from the cache, evicted or not."""
    client, index = cluster["client"], cluster["index"]
    rng = random.Random(5)
    prompts = [[rng.randrange(300, 40000) for _ in range(3000)] for _ in range(14)]
    ray.get(index.set_policy.remote("cache_events", {"pending_ttl": 0.0}))
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as ex:
            list(ex.map(lambda p: client.completions.create(model="smollm2-135m", prompt=p, max_tokens=2), prompts))
        for r, (view, got) in _views_mirror_replicas(index).items():
            assert view["seq"] == got["seq"] and view["synced"], (r, view["seq"], got["seq"])
            assert set(view["blocks"]) == set(got["blocks"]) and got["blocks"], r
        with httpx.Client(base_url=cluster["base_url"], headers=ADMIN, timeout=60) as http:
            assert http.get("/cache_stats", params={"check": "1"}).json()["evicted_tokens"] > 0  # fresh
        for p in prompts[:3]:  # the earliest: evicted wholly or in part
            _settle(index)  # the previous repeat's evictions are in the view it routes by
            cached = client.completions.create(model="smollm2-135m", prompt=p, max_tokens=2)
            cached = cached.usage.prompt_tokens_details.cached_tokens
            expect = {d["prompt"]: d for d in ray.get(index.decisions.remote())}[prompt_key(p)]["cached"]
            assert expect == cached // 16 * 16, (expect, cached)
    finally:
        ray.get(index.set_policy.remote("cache_events"))


def test_the_sglang_frontend_connects_to_the_replicas(cluster):
    """The first requests SGLang's frontend sent when it connected (``RuntimeEndpoint`` reads
    ``/get_model_info``, then the program flushes and reads ``/server_info``; recorded in
    tests/fixtures/sglang_frontend/traffic.json) answer on the replicas with the recorded shapes;
    the flush is the replicas' 409 ``flush_not_offered``."""
    from test_native_protocols import FIXTURES, _same_shape

    traffic = json.loads((FIXTURES / "traffic.json").read_text())
    assert [ex["path"] for ex in traffic[:3]] == ["/get_model_info", "/flush_cache", "/server_info"]
    with httpx.Client(base_url=cluster["base_url"], headers=ADMIN, timeout=120) as http:
        for ex in traffic[:3]:
            r = http.request(ex["method"], ex["path"], json=ex["request"])
            if ex["path"] == "/flush_cache":
                assert r.status_code == 409 and r.json()["error"]["code"] == "flush_not_offered"
            else:
                assert r.status_code == ex["status"] == 200, r.text
                _same_shape(ex["response"], r.json(), ex["path"])


def test_keys_and_tenants_on_the_replicas(cluster):
    """The ingress's API keys: every route's 401 / 403 as on one engine (route_table.check_auth);
    alice's repeated prompt hits on the replica the router sends it to, bob's identical prompt
    reuses nothing of it (the router's view and every replica's cache are per namespace), bob's
    own repeat hits; alice's stored Response is a 404 to bob; each replica applies alice's quota."""
    from route_table import check_auth

    base = cluster["base_url"]
    with httpx.Client(base_url=base, timeout=120) as anonymous:
        check_auth(anonymous, {"Authorization": "Bearer sk-ray-bob"}, ADMIN)

    def tenant(key):
        return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=60)

    alice, bob = tenant("sk-ray-alice"), tenant("sk-ray-bob")
    tok = _tokenizer()
    prompt = _conversations(tok, 1, 1, skip=8)[0][0]  # a real ShareGPT first turn

    def cached(c, **kw):
        r = c.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=2, temperature=0, **kw)
        return r.usage.prompt_tokens_details.cached_tokens

    n = len(prompt)
    assert [cached(alice), cached(alice), cached(bob), cached(bob)] == [0, n - 1, 0, n - 1]
    assert [cached(bob, extra_body={"cache_salt": "s"}), cached(alice)] == [0, n - 1]
    made = alice.responses.create(model="smollm2-135m", input="Hello there.", max_output_tokens=2, temperature=0)
    with pytest.raises(openai.NotFoundError):
        bob.responses.retrieve(made.id)
    assert alice.responses.retrieve(made.id).id == made.id
    with httpx.Client(base_url=base, headers=ADMIN, timeout=120) as ops:
        tenants = ops.get("/cache_stats", params={"check": "1"}).json()["tenants"]
    assert tenants["alice"]["quota"] == 2 * QUOTA and tenants["bob"]["quota"] is None  # per replica, summed
    assert tenants["alice"]["cached"] >= n and tenants["bob"]["cached"] >= 2 * n  # bob: unsalted and salted


KILL_CASES = [  # (sampling fields, what must happen when the request is in flight on the killed replica)
    (dict(temperature=0, logprobs=1), "continued"),
    (dict(temperature=0), "continued"),
    (dict(temperature=0), "continued"),
    (dict(temperature=0), "continued"),
    (dict(temperature=0.9, seed=11), "replayed"),
    (dict(temperature=1.0, n=2), "refused"),  # unseeded samples cannot be resumed exactly once streamed
]


def _stream(client, prompt, fields, max_tokens, chunks):
    """A streaming completion: per choice its text, plus logprob tokens / values, usage, or the
    error; ``chunks[0]`` counts the chunks received so far."""
    res = dict(kind="ok", texts={}, lp_tokens=[], lp_values=[], usage=None, error=None)
    try:
        stream = client.completions.create(
            model="smollm2-135m",
            prompt=prompt,
            max_tokens=max_tokens,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
            **fields,
        )
        for ch in stream:
            if ch.usage is not None:
                res["usage"] = ch.usage.completion_tokens
            for c in ch.choices:
                res["texts"][c.index] = res["texts"].get(c.index, "") + c.text
                if c.logprobs is not None:
                    res["lp_tokens"] += c.logprobs.tokens
                    res["lp_values"] += c.logprobs.token_logprobs
            chunks[0] += 1
    except openai.APIError as exc:
        res.update(kind="error", error=str(exc))
    res["t_end"] = time.monotonic()
    return res


def test_a_replica_killed_mid_run_is_dropped_and_its_requests_go_on_elsewhere(cluster):
    client, index = cluster["client"], cluster["index"]
    tok = _tokenizer()
    conv = _conversations(tok, 1, 1, skip=6)[0][0]
    client.completions.create(model="smollm2-135m", prompt=conv, max_tokens=2, temperature=0)
    log = {d["prompt"]: d for d in ray.get(index.decisions.remote())}
    victim = log[prompt_key(conv)]["replica"]
    # its blocks reach the router from the replica's pusher thread (events pushed as they happen): polled
    deadline = time.monotonic() + 60
    while (state := ray.get(index.state.remote()))["blocks"].get(victim, 0) == 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert state["blocks"][victim] > 0
    actor = ray.get_actor(state["replicas"][victim]["actor_name"], namespace="serve")
    prompts = [conv + [i + 1] for i in range(len(KILL_CASES))]
    max_tokens = 600

    chunks = [[0] for _ in KILL_CASES]
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(KILL_CASES)) as ex:
        futs = [ex.submit(_stream, client, p, f, max_tokens, c) for p, (f, _), c in zip(prompts, KILL_CASES, chunks)]
        # kill once every request has streamed output, or one is a quarter through (on a loaded
        # machine a request may start late): waits on the streams' outputs, not on a fixed sleep
        deadline = time.monotonic() + 90
        while not (all(c[0] for c in chunks) or max(c[0] for c in chunks) >= max_tokens // 4):
            assert time.monotonic() < deadline and not any(f.done() for f in futs), chunks
            time.sleep(0.01)
        t_kill, at_kill = time.monotonic(), [c[0] for c in chunks]
        ray.kill(actor, no_restart=True)
        results = [f.result(timeout=120) for f in futs]
    assert time.perf_counter() - t0 < 150  # nothing hung

    log = ray.get(index.decisions.remote())
    first: dict = {}
    for d in log:  # a replay's decision comes later under the same prompt
        first.setdefault(d["prompt"], d["replica"])
    resumes = [d for d in log if "-resume" in str(d["request_id"])]
    in_flight = [first[prompt_key(p)] == victim and r["t_end"] > t_kill for p, r in zip(prompts, results)]
    assert sum(in_flight) >= 2, f"the kill hit only {sum(in_flight)} requests in flight on {victim}"
    print(
        f"\nkill: {sum(in_flight)} requests in flight on the killed replica (chunks at the kill: {at_kill}), "
        f"{len(resumes)} resumed elsewhere, "
        f"outcomes {[r['kind'] for r in results]}, {time.perf_counter() - t0:.1f}s"
    )
    # where each resume went: its routing attempt's last decision (a resume routed before Serve
    # dropped the dead replica from its candidates may first be chosen there; Serve's probe of
    # the dead actor fails and the same attempt is routed again, among the live ones)
    went = {d["key"]: d["replica"] for d in resumes}
    assert went and victim not in went.values(), resumes
    for (fields, expect), r, hit in zip(KILL_CASES, results, in_flight):
        if hit and expect == "refused":
            assert r["kind"] == "error" and "cannot be resumed exactly" in r["error"], r
        else:
            assert r["kind"] == "ok", (fields, r["error"])
            assert r["usage"] == max_tokens * fields.get("n", 1)

    # the resumed requests gave what an uninterrupted run gives (same weights on every replica)
    def reference(p, fields):
        return client.completions.create(
            model="smollm2-135m", prompt=p, max_tokens=max_tokens, extra_body={"ignore_eos": True}, **fields
        )

    cases = [(f, p, r) for (f, expect), p, r in zip(KILL_CASES, prompts, results) if expect != "refused"]
    with concurrent.futures.ThreadPoolExecutor(len(cases)) as ex:
        refs = list(ex.map(lambda c: reference(c[1], c[0]), cases))
    for (fields, _p, r), ref in zip(cases, refs):
        assert r["texts"] == {0: ref.choices[0].text}, fields
        if fields.get("logprobs"):
            assert r["lp_tokens"] == ref.choices[0].logprobs.tokens
            assert r["lp_values"] == pytest.approx(ref.choices[0].logprobs.token_logprobs, abs=1e-4)

    deadline = time.time() + 60
    while time.time() < deadline and victim not in ray.get(index.state.remote())["removed"]:
        time.sleep(0.2)
    state = ray.get(index.state.remote())
    assert victim in state["removed"] and victim not in state["blocks"] and victim not in state["loads"]
    # the conversation's next turn goes elsewhere and is served
    nxt = client.completions.create(model="smollm2-135m", prompt=conv + [5, 6], max_tokens=2, temperature=0)
    log = {d["prompt"]: d for d in ray.get(index.decisions.remote())}
    assert log[prompt_key(conv + [5, 6])]["replica"] != victim and nxt.choices[0].finish_reason == "length"

    # nothing is left running or holding slots on the replicas serving now (the resumed and
    # replayed requests, the one that ended with an error), every slot is owned once, and the
    # router's count of outstanding requests is back to zero everywhere (Serve's completion
    # callbacks reach the index asynchronously: polled)
    loads = _router_loads(index)
    assert all(v == (0, 0) for v in loads.values()), loads
    deadline = time.monotonic() + 60
    with httpx.Client(base_url=cluster["base_url"], headers=ADMIN, timeout=60) as http:
        while True:  # an abort reaches the engine thread just after its replica's call returned
            r = http.get("/cache_stats", params={"check": "1"})
            assert r.status_code == 200, r.text
            s = r.json()
            if s["running"] == s["waiting"] == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    assert s["running"] == s["waiting"] == 0 and s["free"] + s["evictable"] + s["pinned"] == s["capacity"], s
