"""The KV tiers through the HTTP server: usage's ``cached_tokens`` is the total of every tier,
SGLang's ``sglext`` splits pool and tiers, ``/metrics`` per tier, ``/health`` stays 200 and names a
degraded tier (a Redis nobody listens on), ``/flush_cache`` empties the pool and, with
``?tiers=true``, the tiers the engine owns; ``radixkv serve`` refuses an unwritable
``--disk-cache-dir`` at start. A tiny random model, real host and disk stores."""

from __future__ import annotations

import random
import subprocess
import sys

import httpx
import pytest
from server_helpers import Server, assert_pool_whole, serve_process, sigterm_mid_stream, wait_idle
from tier_fakes import loading_always_pays, tiny_model

from radixkv.async_llm import AsyncLLM
from radixkv.server.app import create_app

pytestmark = pytest.mark.timeout(300)

MODEL = "tiny"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("disk-tier")
    llm = AsyncLLM(
        loaded_model=tiny_model(),
        device="cpu",
        max_total_tokens=4096,
        host_cache_bytes=1 << 24,
        disk_cache_dir=str(d),
        remote_cache_url="redis://127.0.0.1:1/0",  # nobody listens: the remote tier is degraded
    )
    llm.submit(loading_always_pays).result(60)  # the counts below must not depend on timing
    server = Server(create_app(llm, served_model_name=MODEL))
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        yield llm, http, d
    server.stop()
    llm.shutdown()


def _complete(http, ids):
    body = {"model": MODEL, "prompt": ids, "max_tokens": 4, "temperature": 0, "return_cached_tokens_details": True}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_cached_tokens_count_every_tier_and_flushes(setup):
    llm, http, d = setup
    ids = [random.Random(3).randrange(100, 40000) for _ in range(100)]
    first = _complete(http, ids)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    wait_idle(llm)
    # NOTE: the I/O thread takes a lookup before a queued write: the first request's blocks must be
    # on disk before they are asked for again
    assert llm.engine.kv.tiers.drain(timeout=60)
    assert http.post("/flush_cache").json()["flushed"] is True  # the pool only
    again = _complete(http, ids)
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    # 6 blocks and 3 tokens of the tail after them from the disk tier
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 99
    assert again["sglext"] == {"cached_tokens_details": {"device": 0, "host": 99}}
    stats = http.get("/cache_stats").json()
    assert stats["cached_tokens_by_tier"]["disk"] == 99 and stats["tiers"]["disk"]["served_tokens"] == 99
    assert stats["tiers"]["disk"]["tail_tokens"] == 3
    text = http.get("/metrics").text
    assert 'radixkv_kv_tier_served_tokens_total{tier="disk"} 99.0' in text
    assert 'radixkv_cached_tokens_by_tier_total{tier="disk"} 99.0' in text
    assert 'radixkv_kv_tier_load_latency_seconds_count{tier="disk"}' in text
    assert 'radixkv_kv_tier_degraded{tier="remote"} 1.0' in text
    wait_idle(llm)
    assert http.post("/flush_cache?tiers=true").json() == {
        "flushed": True,
        "message": "the prefix cache and the KV tiers it owns were flushed",
    }
    assert stats_tier(http, "disk")["used_bytes"] == 0
    third = _complete(http, ids)
    assert third["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    wait_idle(llm)
    assert_pool_whole(llm)


def stats_tier(http, tier):
    return http.get("/cache_stats").json()["tiers"][tier]


def test_health_stays_200_and_names_the_degraded_tier(setup):
    _, http, _ = setup
    r = http.get("/health")
    assert r.status_code == 200 and r.json() == {"status": "degraded", "degraded_tiers": ["remote"]}


def test_flush_cache_tiers_must_be_a_boolean(setup):
    _, http, _ = setup
    r = http.post("/flush_cache?tiers=maybe")
    assert r.status_code == 400 and r.json()["error"]["param"] == "tiers"
    # ?tiers=true&tiers=false flushed the pool only (the last value won) and answered 200
    r = http.post("/flush_cache?tiers=true&tiers=false")
    assert r.status_code == 400 and r.json()["error"] == {
        "message": "query parameter tiers given more than once",
        "type": "invalid_request_error",
        "param": "tiers",
        "code": "invalid_value",
    }


def test_serve_refuses_an_unwritable_disk_dir(tmp_path):
    f = tmp_path / "a-file"
    f.write_text("x")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "radixkv",
            "serve",
            "--device",
            "cpu",
            "--disk-cache-dir",
            str(f / "sub"),
            "--port",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert r.returncode == 2 and "disk_cache_dir" in r.stderr.splitlines()[-1], r.stderr[-2000:]


def test_serve_sigterm_ends_the_stream_in_flight_exits_0_and_keeps_the_disk_tier(tmp_path):
    """``radixkv serve`` (default model, a disk tier) gets SIGTERM while a stream runs: the stream
    ends whole (its ``[DONE]``), the server exits with status 0, as on Ctrl-C and as ``serve
    --replicas`` on SIGTERM, and a restart on the same directory serves every prompt token but
    the last from the disk tier. It exited -15 (143 in a shell: docker stop, systemd and
    Kubernetes stops read as failures): uvicorn re-raised the SIGTERM after its graceful
    shutdown, under the default handler, which killed the process."""
    args = ["--device", "cpu", "--max-total-tokens", "2048", "--disk-cache-dir", tmp_path / "kv", "--log-level",
            "warning"]  # fmt: skip
    prompt = " ".join(f"w{i}" for i in range(60))

    def completion(base):
        body = {"model": "smollm2-135m", "prompt": prompt, "max_tokens": 1, "temperature": 0}
        r = httpx.post(base + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["usage"]

    with serve_process(args, tmp_path / "serve.log") as (base, proc):
        n = completion(base)["prompt_tokens"]
        body = {"model": "smollm2-135m", "prompt": "Once upon a time", "max_tokens": 8, "stream": True,
                "temperature": 0, "ignore_eos": True}  # fmt: skip
        assert sigterm_mid_stream(base, proc, body, tmp_path / "serve.log")[0] == "length"
    with serve_process(args, tmp_path / "serve2.log") as (base, proc):
        assert completion(base)["prompt_tokens_details"] == {"cached_tokens": n - 1}


def test_serve_flags_reach_every_replica_as_engine_fields():
    import argparse

    from radixkv.server.cli import add_arguments, engine_kwargs_from_args

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    args = ap.parse_args(
        ["--replicas", "2", "--remote-cache-url", "redis://10.0.0.5:6379/1", "--host-cache-bytes", "2GiB"]
        + ["--disk-cache-dir", "/tmp/kv", "--disk-cache-bytes", "500MB", "--kv-tier-write-policy", "host=write_through"]
    )
    kw = engine_kwargs_from_args(args)  # what radixkv.router.ray.build_app hands every replica
    assert kw["remote_cache_url"] == "redis://10.0.0.5:6379/1" and kw["host_cache_bytes"] == 2 << 30
    assert kw["disk_cache_dir"] == "/tmp/kv" and kw["disk_cache_bytes"] == 500_000_000
    assert kw["kv_tier_write_policy"] == {"host": "write_through"}
    with pytest.raises(SystemExit):
        ap.parse_args(["--host-cache-bytes", "lots"])


def test_write_policy_flag_takes_the_json_form_and_refuses_a_tier_named_twice():
    # docs/tiers.md gives {"host": "write_back"} for the flag too: it was read as one policy for
    # every tier ("host must be one of ..., got '{...}'"); disk=write_back,disk=write_through kept the last
    import argparse

    from radixkv.server.cli import add_arguments, engine_kwargs_from_args

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    base = ["--host-cache-bytes", "1MB", "--disk-cache-dir", "/tmp/kv", "--kv-tier-write-policy"]
    args = ap.parse_args(base + ['{"host": "write_through", "disk": "write_back"}'])
    assert engine_kwargs_from_args(args)["kv_tier_write_policy"] == {"host": "write_through", "disk": "write_back"}
    for bad, why in [
        ("disk=write_back,disk=write_through", "kv_tier_write_policy: tier 'disk' named twice"),
        ('{"host": ', """kv_tier_write_policy: '{"host": ' is not a JSON object"""),
        ('{"host"}', """kv_tier_write_policy: '{"host"}' is not a JSON object"""),
    ]:
        with pytest.raises(ValueError) as e:
            engine_kwargs_from_args(ap.parse_args(base + [bad]))
        assert str(e.value).startswith(why), str(e.value)


@pytest.mark.parametrize(
    "argv, why",
    [
        (["--replicas", "0"], "argument --replicas: must be >= 1, got 0"),
        (["--replicas", "two"], "argument --replicas: must be an integer, got 'two'"),
        (["--replica-cpus", "-1"], "argument --replica-cpus: must be >= 0, got -1"),
    ],
)
def test_replica_flags_are_checked_before_anything_starts(argv, why, capsys):
    import argparse

    from radixkv.server.cli import add_arguments

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    with pytest.raises(SystemExit) as exc:
        ap.parse_args(argv)
    assert exc.value.code == 2 and why in capsys.readouterr().err
    assert ap.parse_args(["--replicas", "2", "--replica-cpus", "0"]).replicas == 2


def test_tenants_of_api_keys_are_isolated_in_the_tiers(tmp_path):
    """Through the server with API keys: a restart on the same disk directory serves tenant A's
    prompt from the disk tier in full, and tenant B's identical prompt (or A's with a cache_salt)
    not at all: the server-set namespace (tenant, salt) keys every tier block."""
    from radixkv.server.auth import APIKeys

    keys = APIKeys.from_mapping({"sk-a": {"tenant": "A"}, "sk-b": {"tenant": "B"}})
    ids = [random.Random(4).randrange(100, 40000) for _ in range(100)]

    def serve():
        llm = AsyncLLM(loaded_model=tiny_model(), device="cpu", max_total_tokens=4096, disk_cache_dir=str(tmp_path))
        llm.submit(loading_always_pays).result(60)  # the tail is loaded too, not by timing
        return llm, Server(create_app(llm, served_model_name=MODEL, api_keys=keys))

    def cached(server, key, **extra):
        body = {"model": MODEL, "prompt": ids, "max_tokens": 4, "temperature": 0, **extra}
        r = httpx.post(f"{server.base_url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    llm, server = serve()
    assert cached(server, "sk-a") == 0
    server.stop()
    llm.shutdown()  # drains the disk tier's writes
    llm, server = serve()
    try:
        assert cached(server, "sk-b") == 0
        assert cached(server, "sk-a", cache_salt="s1") == 0
        assert cached(server, "sk-a") == 99  # every token below the last prompt token, from disk
        wait_idle(llm)
        assert llm.cache_stats().cached_tokens_by_tier["disk"] == 99
    finally:
        server.stop()
        llm.shutdown()


def test_server_info_never_shows_the_redis_password():
    """``/server_info`` (open without API keys) shows the resolved config: ``remote_cache_url``
    with its password as ``***`` (the password would let any client write forged blocks into the
    tier every engine reads, and read every tenant's K/V)."""
    llm = AsyncLLM(
        loaded_model=tiny_model(),
        device="cpu",
        max_total_tokens=256,
        remote_cache_url="redis://u1:s3cr3t@127.0.0.1:1/2",
    )
    server = Server(create_app(llm, served_model_name=MODEL))
    try:
        for route in ("/server_info", "/get_server_info"):
            r = httpx.get(server.base_url + route)
            assert r.status_code == 200 and "s3cr3t" not in r.text, route
            assert r.json()["radixkv_config"]["remote_cache_url"] == "redis://u1:***@127.0.0.1:1/2"
    finally:
        server.stop()
        llm.shutdown()
