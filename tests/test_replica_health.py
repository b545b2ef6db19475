"""``/health`` of ``radixkv serve --replicas N`` (radixkv.router.ray.RemoteLLM behind the app),
without a Ray cluster: the router's index is a stand-in that lists the live replicas. With all
of them dead (Serve restarting them) the route answers 503, with some dead ``"degraded"``, and
it names how many are live; one engine's answer has no ``replicas``."""

from __future__ import annotations

import asyncio

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


class _Index:
    """The :class:`~radixkv.router.ray.CacheIndex` calls the ingress makes, over a mutable list
    of live replicas (each pushed the same stats)."""

    def __init__(self, live: list[str], stats: dict) -> None:
        self.live = live
        self.replica_ids = _Call(lambda: list(self.live))
        self.state = _Call(lambda: dict(replica_stats={r: stats for r in self.live}))


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
    assert "0 of 2 live" in body["error"]["message"], body
    index.live[:] = ["r2", "r3"]  # restarted
    assert _health(app)[0] == 200
