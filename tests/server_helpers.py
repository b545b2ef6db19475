"""Helpers of the server test modules: uvicorn serving an app on a free loopback port in a thread
of the test process (so the engine can be inspected directly), ``radixkv serve`` as a process
(:func:`serve_process`), and the pool checks every module runs after its requests."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

from radixkv.async_llm import AsyncLLM


class Server:
    """uvicorn serving ``app`` on 127.0.0.1 in a daemon thread; ``base_url`` without a path."""

    def __init__(self, app):
        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            assert time.time() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.05)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(30)


ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (free when asked)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LOST_PORT = ("address already in use", "failed to bind to address")
"""What a server that lost its port says (lower case): uvicorn's bind and ``radixkv serve``'s own
check (``address already in use``), Ray Serve's proxy (``Failed to bind to address``)."""


def start_serving(
    cmd: list, env: dict, log: Path, timeout: float, ready: str = "/health", **popen: Any
) -> tuple[str, subprocess.Popen]:
    """``cmd`` plus ``--port P`` on a free port, until ``ready`` (a path) answers 200. The port is
    free when asked and the server binds it only after loading the model (or starting Ray): another
    process may take it meanwhile, and the server exits saying so (:data:`LOST_PORT`); then again
    on another port (3 tries). ``popen``: more ``subprocess.Popen`` arguments."""
    import httpx

    for attempt in range(3):
        port = free_port()
        with open(log, "w") as out:
            proc = subprocess.Popen([*cmd, "--port", str(port)], env=env, stdout=out, stderr=subprocess.STDOUT, **popen)
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout
        try:
            while proc.poll() is None:
                try:
                    if httpx.get(base + ready, timeout=5).status_code == 200:
                        return base, proc
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, "radixkv serve did not come up: " + log.read_text()[-3000:]
                time.sleep(0.5)  # NOTE: a child process's start-up has no event to wait on but its port
        except BaseException:
            _stop(proc)
            raise
        text = log.read_text()
        if not any(m in text.lower() for m in LOST_PORT) or attempt == 2:
            raise AssertionError(text[-3000:])
    raise AssertionError("unreachable")


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 60 s."""
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(30)


@contextlib.contextmanager
def serve_process(args: list, log: Path, timeout: float = 300.0) -> Iterator[tuple[str, subprocess.Popen]]:
    """``python -m radixkv serve *args --port P`` (this checkout's code, no model hub, no
    ``RADIXKV_API_KEY`` from the environment) logging to ``log``; yields (base URL, process)
    once ``/health`` answers 200 (:func:`start_serving`), and stops it (SIGTERM, then SIGKILL)
    on exit."""
    cmd = [sys.executable, "-m", "radixkv", "serve", *map(str, args)]
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    env.pop("RADIXKV_API_KEY", None)
    base, proc = start_serving(cmd, env, log, timeout)
    try:
        yield base, proc
    finally:
        _stop(proc)


def sigterm_mid_stream(base: str, proc: subprocess.Popen, body: dict, log: Path) -> tuple[str, int]:
    """Stream a completion ``body`` from the server at ``base``, SIGTERM ``proc`` once its first
    chunk came, read the rest: assert it ended with ``[DONE]`` and the process with status 0;
    ``(the last choice's finish_reason, chunks after the signal, [DONE] left out)``."""
    import json
    import signal

    import httpx

    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: ")) != "data: [DONE]"
        proc.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    assert proc.wait(60) == 0, log.read_text()[-3000:]
    return json.loads(rest[-2][6:])["choices"][0]["finish_reason"], len(rest) - 1


def scrape(server) -> dict:
    """GET /metrics of ``server`` (its ``base_url``) parsed with prometheus_client's parser:
    ``{(sample name, sorted label pairs): value}``."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.base_url + "/metrics", timeout=60).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def wait_idle(llm: AsyncLLM, timeout: float = 60.0) -> None:
    """Until no request is unfinished (an abort is applied at the engine's next step)."""
    deadline = time.time() + timeout
    while llm.num_unfinished_requests() or asyncio.run(
        llm.call_in_engine_thread(lambda e: e.has_unfinished_requests())
    ):
        assert time.time() < deadline, "requests still unfinished"
        time.sleep(0.05)


def assert_pool_whole(llm: AsyncLLM) -> dict:
    """Every slot owned once, and free + evictable == capacity with nothing protected."""
    wait_idle(llm)
    asyncio.run(llm.call_in_engine_thread(lambda e: e.check_integrity()))
    stats = llm.get_cache_stats()
    assert stats["free"] + stats["evictable"] == stats["capacity"], stats
    assert stats["protected"] == 0, stats
    assert llm.num_unfinished_requests() == 0
    return stats


def new_async_llm(loaded_model, max_total_tokens: int = 16384, **config) -> AsyncLLM:
    """An :class:`AsyncLLM` over an engine of the session's loaded default model (CPU, page 1)."""
    from radixkv.config import EngineConfig
    from radixkv.engine import Engine

    cfg = EngineConfig(model="smollm2-135m", device="cpu", page_size=1, max_total_tokens=max_total_tokens, **config)
    return AsyncLLM(engine=Engine(cfg, loaded_model=loaded_model))


def abort_all_once_running(server) -> None:
    """``POST /abort_request`` ``abort_all`` once ``/get_load`` shows a request in ``server``'s
    engine (polled with a deadline)."""
    import httpx

    deadline = time.monotonic() + 300
    while httpx.get(server.base_url + "/get_load", timeout=60).json()[0]["num_reqs"] == 0:
        assert time.monotonic() < deadline, "the request never reached the engine"
        time.sleep(0.01)
    assert httpx.post(server.base_url + "/abort_request", json={"abort_all": True}, timeout=60).status_code == 200
