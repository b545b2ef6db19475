"""radixkv on Ray Serve: N engine replicas, the OpenAI app as ingress, cache-aware routing.

The only module that imports ray (extra ``radixkv[ray]``). Parts:

* :class:`EngineReplica` (a Serve deployment): one :class:`~radixkv.async_llm.AsyncLLM` engine
  per replica, torch on one thread; ``generate`` streams ``RequestOutput`` objects. A
  :class:`~radixkv.engine.publish.CacheEventPublisher` buffers its cache events and a pusher
  thread sends them in batches to the :class:`CacheIndex` as they happen (and its
  ``cache_stats`` once a second), answering a resync request with a snapshot.
* :class:`CacheIndex` (one named Ray actor): holds the routing policy
  (:mod:`radixkv.router.policy`: the replicas' exact cache views and the load the routers
  recorded). Every routing decision is made and recorded here at once, so a second turn sent
  right after the first is routed on it, without waiting for Serve's polled routing stats.
* :class:`CacheAwareRequestRouter` (a ``ray.serve.request_router.RequestRouter``, configured
  through ``RequestRouterConfig``): asks the index for the replica, offers only it for the first
  :data:`AFFINE_ATTEMPTS` attempts (a queue-length probe that times out on a loaded machine
  would otherwise send the request to the next rank), then ranks it first and the rest after it, reports where each request went and when it completed, and
  drops a replica that died (``on_replica_actor_died``, or gone from ``update_replicas``).
* :class:`Ingress`: :func:`radixkv.server.app.create_app` over :class:`RemoteLLM`, the
  :class:`~radixkv.server.backend.EngineBackend` of the engine deployment, so every route, error
  format and streaming path is the single-engine server's (model facts from a replica,
  ``cache_stats`` summed over the replicas, ``/cache_stats?check=1`` checked on every replica
  through calls the router sends to the replica they name, no pins for stored Responses). A
  request whose replica dies before its first output is restarted on another replica; one that
  dies mid-stream goes on there as a continuation or a replay (:mod:`radixkv.router.resume`), or
  ends with an error where that cannot be exact; nothing waits on a dead replica.

Entry points: :func:`build_app` (a Serve application), :func:`run` (a local Ray instance + the
app, what ``radixkv serve --replicas N`` calls; Ctrl-C and SIGTERM both shut it all down).
docs/routing.md shows a Ray cluster deployment.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, AsyncIterator, Callable, Optional, Sequence

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from radixkv.namespace import Namespace
from radixkv.outputs import ended_early
from radixkv.router.policy import RouteRequest, make_policy

logger = logging.getLogger(__name__)

__all__ = [
    "INDEX_NAME",
    "NAMESPACE",
    "CacheIndex",
    "CacheAwareRequestRouter",
    "EngineReplica",
    "Ingress",
    "RemoteLLM",
    "build_app",
    "drop_index",
    "get_index",
    "prompt_key",
    "run",
]

INDEX_NAME = "radixkv-cache-index"
NAMESPACE = "radixkv"
ROUTER_PATH = "radixkv.router.ray:CacheAwareRequestRouter"
INGRESS_CPUS = 0.25
"""Ray logical CPUs of the ingress (``build_app``'s default, what ``serve --replicas`` uses)."""
AFFINE_ATTEMPTS = 3
"""Routing attempts of one request that offer Serve only the policy's replica."""
MAX_RESUMES = 3
"""How many times one request goes on elsewhere after its replica died."""
WORKER_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "RADIXKV_TORCH_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


# ---------------------------------------------------------------------------- the index actor
@ray.remote(num_cpus=0, max_restarts=-1)
class CacheIndex:
    """The routing policy and what it knows (module docstring). Methods run one at a time.

    Args:
        policy: a name of :data:`radixkv.router.policy.POLICIES`.
        policy_kwargs: its options.
        log_size: routing decisions kept for :meth:`decisions`.
    """

    def __init__(self, policy: str = "cache_events", policy_kwargs: Optional[dict] = None, log_size: int = 10000):
        self._policy_args = (policy, dict(policy_kwargs or {}))
        self.policy = make_policy(policy, **self._policy_args[1])
        self.replicas: dict[str, dict] = {}
        self.stats: dict[str, dict] = {}
        self.removed: list[str] = []
        self._routable: dict[str, set[str]] = {}  # router_key() -> the replicas that router can reach
        self._requests: dict[str, RouteRequest] = {}  # internal id -> request
        self._keys: dict[str, str] = {}  # the request's own id -> its last routing key
        self._log: list[dict] = []
        self._log_size = log_size

    def set_policy(self, policy: str, policy_kwargs: Optional[dict] = None) -> None:
        """Switch the policy (the replicas' cache views start over from snapshots)."""
        self._policy_args = (policy, dict(policy_kwargs or {}))
        self.policy = make_policy(policy, **self._policy_args[1])
        for r in self.replicas:
            self.policy.add_replica(r)
            self.replicas[r]["resync"] = True
        self._requests.clear()

    # -- replicas
    def register(self, replica: str, info: dict) -> None:
        """A replica started (or restarted: a new epoch starts its view over)."""
        self.replicas[replica] = dict(info, resync=False)
        self.policy.add_replica(replica)

    def routable(self, router: str, replicas: Sequence[str]) -> None:
        """The replicas the request router of process ``router`` (:func:`router_key`) can send
        calls to now (it says so on every change). NOTE: a replica registers here from its
        constructor, seconds before Serve marks it running, and each process's router learns it
        at its own time; until then a call naming it is answered by another replica."""
        self._routable[router] = set(replicas)

    def remove(self, replica: str) -> bool:
        """Forget a dead or removed replica: its cache view, its load, its requests."""
        known = replica in self.replicas or replica in self.policy.loads
        self.replicas.pop(replica, None)
        self.stats.pop(replica, None)
        self.policy.remove_replica(replica)
        for k in [k for k, v in self._requests.items() if self.policy.decisions.get(v.request_id) is None]:
            self._requests.pop(k, None)
        if known:
            self.removed.append(replica)
        return known

    def push(
        self, replica: str, batch: Optional[dict], stats: Optional[dict] = None, info: Optional[dict] = None
    ) -> bool:
        """A replica's batch of cache events (and its stats); True: send a snapshot. ``info``
        (:meth:`register`'s) registers a replica this index does not know (it restarted empty)."""
        if replica not in self.replicas:
            if info is None or replica in self.removed:
                return False  # removed (died): later pushes of a zombie are ignored
            self.register(replica, info)  # NOTE: its view starts from the snapshot asked for
            if stats is not None:
                self.stats[replica] = stats
            return True
        if stats is not None:
            self.stats[replica] = stats
        want = False
        if batch is not None:
            want = self.policy.on_events(replica, batch, time.monotonic())
        if self.replicas[replica].pop("resync", False):
            want = True
        return want

    def snapshot(self, replica: str, snap: dict) -> None:
        if replica in self.replicas:
            self.policy.on_snapshot(replica, snap)

    # -- routing
    def route(self, key: str, request: dict, candidates: Sequence[str]) -> str:
        """Choose among ``candidates`` for ``request`` (``request_id``, ``token_ids``,
        ``namespace`` (:func:`wire_namespace`'s bytes), ``session``) and record the decision at once; ``key`` is the serving
        layer's id of this routing attempt."""
        for c in candidates:
            if c not in self.policy.loads and c in self.replicas:
                self.policy.add_replica(c)
        cands = [c for c in candidates if c in self.policy.loads]
        if not cands:  # none registered yet: any candidate
            return candidates[0]
        ns = read_namespace(request.get("namespace"))
        rq = RouteRequest(key, request["token_ids"], ns, request.get("session"))
        d = self.policy.choose(rq, cands, time.monotonic())
        self._requests[key] = rq
        if request.get("request_id") is not None:
            self._keys[request["request_id"]] = key
            if len(self._keys) > self._log_size:
                del self._keys[next(iter(self._keys))]
        self._log.append(
            dict(
                request_id=request.get("request_id"),
                key=key,
                prompt=prompt_key(request["token_ids"]),
                replica=d.replica,
                cached=d.cached_tokens,
                reason=d.reason,
            )
        )
        if len(self._log) > self._log_size:
            del self._log[: len(self._log) - self._log_size]
        return d.replica

    def routed(self, key: str, replica: str) -> None:
        rq = self._requests.get(key)
        if rq is not None and self.policy.decisions.get(key) != replica:
            self.policy.moved(rq, replica, time.monotonic())
            for d in reversed(self._log[-64:]):
                if d.get("key") == key:
                    d["replica"] = replica
                    break

    def completed(self, key: str) -> None:
        self._requests.pop(key, None)
        self.policy.finished(key, time.monotonic())

    def replied(self, request_id: str, output_token_ids: Sequence[int]) -> None:
        """The ingress saw ``request_id`` end with ``output_token_ids`` (before or after Serve's
        completion callback): its replica will cache ``prompt + output[:-1]``
        (:meth:`radixkv.router.policy.CacheEvents.replied`), and the request is off its
        replica's load now.

        NOTE: the ingress sends this before its client's response ends; Serve's completion
        callback comes at the end of the replica's stream, which may reach this index after the
        client's next request (a conversation's next turn then saw its replica still busy with the
        last one and, on a hot prefix, moved away from its cache). The callback's
        :meth:`completed` that follows finds nothing left to release."""
        key = self._keys.pop(request_id, None)
        if key is None:
            return
        if hasattr(self.policy, "replied"):
            self.policy.replied(key, output_token_ids)
        self.completed(key)

    # -- inspection
    def replica_ids(self, router: Optional[str] = None) -> list[str]:
        """The replicas registered and not removed; with ``router``, those of them that router
        can reach (:meth:`routable`; all registered ones while it has not said, e.g. after this
        index restarted)."""
        reach = self._routable.get(router) if router is not None else None
        if reach is None:
            return list(self.replicas)
        return [r for r in self.replicas if r in reach]

    def view(self, replica: str) -> Optional[dict]:
        """The policy's view of ``replica``'s cache (``cache_events``): ``{"seq": the last event
        applied, "synced", "blocks": the digests it holds}``; None for another policy or replica."""
        v = getattr(self.policy, "views", {}).get(replica)
        return None if v is None else dict(seq=v.seq, synced=v.synced, blocks=sorted(v.blocks))

    def decisions(self) -> list[dict]:
        """The last routing decisions: ``request_id``, ``replica``, ``cached`` (expected cached
        tokens) and ``reason``."""
        return list(self._log)

    def state(self) -> dict:
        out = self.policy.stats()
        out.update(replicas={r: {k: v for k, v in i.items() if k != "resync"} for r, i in self.replicas.items()})
        out.update(removed=list(self.removed), replica_stats=dict(self.stats))
        out.update(routable={k: sorted(v) for k, v in self._routable.items()})
        return out


def wire_namespace(namespace: Any) -> bytes:
    """A request's namespace as it crosses processes (the ``namespace`` of request dicts): its
    stable serialization (``Namespace().to_bytes()`` for None).

    Raises:
        RequestError: (param ``namespace``) a process-local namespace (no stable form).
    """
    ns = Namespace.of(namespace)
    return (ns if ns is not None else Namespace()).to_bytes()


def read_namespace(data: Optional[bytes]) -> Optional[Namespace]:
    """The namespace :func:`wire_namespace` serialized (None: absent or the shared default)."""
    return None if data is None else Namespace.from_bytes(data)


def prompt_key(token_ids: Sequence[int]) -> str:
    """A short digest of a prompt's token ids (how :meth:`CacheIndex.decisions` names prompts)."""
    import hashlib
    from array import array

    return hashlib.blake2b(array("q", list(token_ids)).tobytes(), digest_size=8).hexdigest()


def drop_index() -> bool:
    """Kill the index actor, if there is one (a deployment that ended, or was killed, left it on
    a cluster joined with ``--ray-address``: detached, it outlives its driver); True if there was."""
    try:
        ray.kill(get_index())  # no restart
    except ValueError:  # none
        return False
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the name is free once the actor is gone
        try:
            get_index()
        except ValueError:
            break
        time.sleep(0.05)
    return True


def get_index(create: bool = False, policy: str = "cache_events", policy_kwargs: Optional[dict] = None):
    """The index actor (created, detached, when ``create`` and missing)."""
    if create:
        return CacheIndex.options(name=INDEX_NAME, namespace=NAMESPACE, get_if_exists=True, lifetime="detached").remote(
            policy, policy_kwargs
        )
    return ray.get_actor(INDEX_NAME, namespace=NAMESPACE)


# ---------------------------------------------------------------------------- the request router
ROUTABLE_RESEND_S = 5.0  # a request router tells the index what it reaches at least this often when busy


def router_key() -> str:
    """This process's name for its request router in :meth:`CacheIndex.routable`: its actor's
    id (the ingress), else its node and pid (a driver)."""
    if not ray.is_initialized():  # NOTE: get_runtime_context() would start a local Ray
        return f"local:{os.getpid()}"
    ctx = ray.get_runtime_context()
    return ctx.get_actor_id() or f"{ctx.get_node_id()}:{os.getpid()}"


class CacheAwareRequestRouter(FIFOMixin, RequestRouter):
    """Ray Serve request router asking the :class:`CacheIndex` (module docstring).

    ``request_router_kwargs``: ``index_name`` / ``index_namespace`` of the index actor.
    """

    def initialize_state(self, index_name: str = INDEX_NAME, index_namespace: str = NAMESPACE, **_: Any) -> None:
        self._index_name, self._index_ns = index_name, index_namespace
        self._index = None
        self._said = float("-inf")  # when this router last told the index what it reaches
        self._tries: dict[str, int] = {}  # routing attempts per request not yet routed

    def _idx(self):
        if self._index is None:
            self._index = ray.get_actor(self._index_name, namespace=self._index_ns)
            self._said = float("-inf")
        if time.monotonic() - self._said > ROUTABLE_RESEND_S:
            # NOTE: said again from time to time: an index that restarted (empty) learns it
            # without waiting for the next change of replicas
            self._say_routable()
        return self._index

    def _say_routable(self) -> None:
        self._said = time.monotonic()
        self._index.routable.remote(router_key(), [r.unique_id for r in self._replica_id_set])

    @staticmethod
    def _route_args(pending_request: Optional[PendingRequest]) -> Optional[dict]:
        if pending_request is None or not pending_request.args:
            return None
        a = pending_request.args[0]
        return a if isinstance(a, dict) and "token_ids" in a else None

    @staticmethod
    def _pinned(pending_request: Optional[PendingRequest]) -> Optional[str]:
        """The replica a call names (``{"replica": id}``: :meth:`RemoteLLM._on_every_replica`)."""
        if pending_request is None or not pending_request.args:
            return None
        a = pending_request.args[0]
        return a.get("replica") if isinstance(a, dict) and "token_ids" not in a else None

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: Optional[PendingRequest] = None
    ) -> list[list[RunningReplica]]:
        pinned = self._pinned(pending_request)
        if pinned is not None:  # that replica (gone: any, and the caller sees who answered)
            named = [r for r in candidate_replicas if r.replica_id.unique_id == pinned]
            return [named or candidate_replicas]
        args = self._route_args(pending_request)
        if args is None or not candidate_replicas:
            return [candidate_replicas]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        key = pending_request.metadata.internal_request_id
        try:
            rid = await self._idx().route.remote(key, args, list(by_id))
        except Exception:  # noqa: BLE001 - the index restarting: fall back to any replica
            logger.exception("cache index unavailable; routing without it")
            self._index = None
            return [candidate_replicas]
        chosen = by_id.get(rid)
        if chosen is None:
            return [candidate_replicas]
        # Serve probes the chosen replica's queue length with a short deadline; on a loaded
        # machine a probe times out and Serve would take the next rank. The first attempts
        # offer only the chosen replica (Serve backs off and asks again), later ones the rest too.
        tries = self._tries[key] = self._tries.get(key, 0) + 1
        if len(self._tries) > 100_000:  # requests cancelled before routing
            self._tries.clear()
        if tries <= AFFINE_ATTEMPTS:
            return [[chosen]]
        return [[chosen], [r for r in candidate_replicas if r is not chosen]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        self._tries.pop(pending_request.metadata.internal_request_id, None)
        if self._route_args(pending_request) is not None:
            self._idx().routed.remote(pending_request.metadata.internal_request_id, replica_id.unique_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        try:
            self._idx().completed.remote(internal_request_id)
        except Exception:  # noqa: BLE001
            self._index = None

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._idx().remove.remote(replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        old = set(self._replica_id_set)
        super().update_replicas(replicas)
        try:  # NOTE: an exception here would stop Serve's updates of every router of this process
            idx = self._idx()
            for gone in old - set(self._replica_id_set):
                idx.remove.remote(gone.unique_id)
            self._say_routable()
        except Exception:  # noqa: BLE001 - the index restarting: told again through _idx()
            logger.exception("cache index unavailable; replica update not passed on")
            self._index = None


# ---------------------------------------------------------------------------- the engine replicas
def _load(engine_kwargs: dict, random_model: Optional[dict]):
    """An Engine: the configured model, or (``random_model``: LlamaConfig fields + ``seed``) a
    random-weight Llama-shaped model with the default model's tokenizer (tests)."""
    from radixkv.config import EngineConfig
    from radixkv.engine import Engine

    loaded = None
    if random_model is not None:
        from transformers import AutoTokenizer, LlamaConfig

        from radixkv.models.loader import LoadedModel, build_model, resolve_hf_dir

        spec = dict(random_model)
        seed = spec.pop("seed", 0)
        hf_dir = resolve_hf_dir("smollm2-135m")
        tok = AutoTokenizer.from_pretrained(str(hf_dir), local_files_only=True)
        cfg = LlamaConfig(**spec)
        loaded = LoadedModel(build_model(cfg, seed=seed), cfg, tok, "random-llama", hf_dir)
    return Engine(EngineConfig(**engine_kwargs), loaded_model=loaded)


class EngineReplica:
    """One engine per replica (module docstring).

    Args:
        engine_kwargs: :class:`~radixkv.config.EngineConfig` fields.
        random_model: build a random-weight Llama-shaped model (tests) instead of loading.
        push_interval: seconds between stats pushes (events go at once).
    """

    def __init__(self, engine_kwargs: dict, random_model: Optional[dict] = None, push_interval: float = 1.0):
        import torch

        from radixkv.async_llm import AsyncLLM
        from radixkv.engine.publish import CACHE_EVENTS, CacheEventPublisher
        from radixkv.server.backend import LocalBackend

        torch.set_num_threads(int(os.environ.get("RADIXKV_TORCH_THREADS", "1")))
        self.llm = AsyncLLM(engine=_load(engine_kwargs, random_model))
        self.backend = LocalBackend(self.llm)
        self.publisher = CacheEventPublisher()
        self.llm.subscribe(self.publisher.on_event, CACHE_EVENTS)
        ctx = serve.get_replica_context()
        self.replica_id = ctx.replica_id.unique_id
        self._index = get_index()
        info = dict(epoch=self.publisher.epoch, actor_name=ray.get_runtime_context().get_actor_name(), pid=os.getpid())
        ray.get(self._index.register.remote(self.replica_id, info))
        # its stats at once (not a push interval later): a replica counted live always has stats to sum
        ray.get(self._index.push.remote(self.replica_id, None, self._stats(), info))
        self._info = info  # every push carries it: an index that restarted learns this replica
        self._stop = threading.Event()
        self._interval = push_interval
        self._pusher = threading.Thread(target=self._push_loop, name="radixkv-event-pusher", daemon=True)
        self._pusher.start()

    def _push_loop(self) -> None:
        loop = asyncio.new_event_loop()
        last_stats = 0.0
        while not self._stop.is_set():
            self.publisher.wakeup.wait(self._interval)
            try:
                batch = self.publisher.drain()
                stats = None
                if time.monotonic() - last_stats >= self._interval:
                    stats = self._stats()
                    last_stats = time.monotonic()
                if batch is None and stats is None:
                    continue
                if ray.get(self._index.push.remote(self.replica_id, batch, stats, self._info), timeout=30):
                    snap = loop.run_until_complete(self.llm.call_in_engine_thread(self.publisher.snapshot))
                    ray.get(self._index.snapshot.remote(self.replica_id, snap), timeout=30)
            except Exception:  # noqa: BLE001 - keep publishing; the index resyncs on a gap
                if self._stop.is_set() or not self.llm.is_running:
                    break
                logger.exception("pushing cache events failed")
                time.sleep(0.5)
        loop.close()

    def _stats(self) -> dict:
        """The stats pushed to the index: ``cache_stats()`` and ``unfinished``."""
        stats = self.llm.cache_stats().as_dict()  # AsyncLLM: plain snapshot methods
        stats["unfinished"] = self.llm.num_unfinished_requests()
        return stats

    def info(self) -> dict:
        """``replica_id``, ``max_context_len``, ``epoch``, ``actor_name`` and ``facts`` (the
        model's :class:`~radixkv.server.backend.ModelFacts` as a dict)."""
        return dict(
            replica_id=self.replica_id,
            max_context_len=self.llm.max_context_len,
            epoch=self.publisher.epoch,
            actor_name=ray.get_runtime_context().get_actor_name(),
            facts=self.backend.model_facts().as_dict(),
        )

    async def generate(self, args: dict) -> AsyncIterator[Any]:
        """Stream the request's ``RequestOutput`` snapshots (``args``: ``request_id``, ``prompt``,
        ``token_ids``, ``params`` (SamplingParams), ``namespace``: :func:`wire_namespace`'s bytes)."""
        from radixkv.async_llm import EngineDeadError

        gen = self.llm.generate(
            args.get("prompt"),
            args["params"],
            args["request_id"],
            prompt_token_ids=args["token_ids"],
            namespace=read_namespace(args.get("namespace")),
        )
        try:
            async for out in gen:
                yield out
        except EngineDeadError:
            # NOTE: this replica serves nothing more: the index stops routing to it before the
            # ingress hears of it (and sends the request on elsewhere); Serve replaces it once its
            # health checks fail
            await self._leave_index()
            raise
        finally:
            await gen.aclose()  # a cancelled stream aborts the request in the engine

    async def _leave_index(self) -> None:
        """Ask the index to route nothing more here (the engine has stopped)."""
        try:
            await asyncio.wait_for(self._index.remove.remote(self.replica_id), 10)
        except Exception:  # noqa: BLE001 - the index restarting: Serve's health check removes it
            logger.exception("could not leave the cache index")

    async def cache_stats(self) -> dict:
        return self.llm.cache_stats().as_dict()

    async def check_integrity(self, args: dict) -> dict:
        """The engine's integrity check (every slot owned once; an ``AssertionError`` when not),
        then its stats: ``{"replica": this replica's id, "stats": EngineStats.as_dict()}``
        (``args``: ``{"replica": the id the caller meant}``, which the router routes by)."""
        stats = await self.backend.cache_stats(check=True)
        return dict(replica=self.replica_id, stats=stats.as_dict())

    async def abort_requests(self, args: dict) -> dict:
        """Abort this replica's unfinished requests of ``args["ids"]`` (also as resumed here,
        ``<id>-resume<k>``), or with ``ids`` None every one whose id starts with ``args["prefix"]``
        (:meth:`RemoteLLM.abort_requests`); ``{"replica": this replica's id, "aborted": how many}``."""
        ids, prefix = args.get("ids"), args.get("prefix", "")
        running = await self.llm.unfinished_request_ids()
        if ids is None:
            hit = [r for r in running if r.startswith(prefix)]
        else:
            want = set(ids)
            hit = [r for r in running if r in want or r.rpartition("-resume")[0] in want]
        await self.llm.abort(hit)
        return dict(replica=self.replica_id, aborted=len(hit))

    async def load(self, args: dict) -> dict:
        """``{"replica": this replica's id, "stats": its EngineStats.as_dict() now}`` (``/get_load``)."""
        stats = await self.llm.call_in_engine_thread(lambda e: e.cache_stats(tenants=False))
        return dict(replica=self.replica_id, stats=stats.as_dict())

    async def cache_blocks(self, args: dict) -> dict:
        """What the router's view of this replica mirrors: ``{"replica": this replica's id, "seq":
        its last cache event, "blocks": the digests of its fully cached blocks}`` (``args``:
        ``{"replica": the id the caller meant}``, which the router routes by)."""
        from radixkv.engine.publish import cache_snapshot

        snap = await self.llm.call_in_engine_thread(lambda e: cache_snapshot(e, self.publisher.epoch))
        return dict(replica=self.replica_id, seq=snap["seq"], blocks=snap["blocks"])

    def check_health(self) -> None:
        if not self.llm.is_running:
            raise RuntimeError(f"engine stopped: {self.llm.dead_error!r}")

    def __del__(self) -> None:
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()
            self.llm.shutdown(timeout=5)


# ---------------------------------------------------------------------------- the ingress
class RemoteLLM:
    """The :class:`~radixkv.server.backend.EngineBackend` of the engine deployment, over its
    handle (module docstring): what :func:`radixkv.server.app.create_app` serves on replicas.

    Args:
        handle: the engine deployment's handle.
        tokenizer: the model's tokenizer (loaded by the ingress).
        facts: a replica's :class:`~radixkv.server.backend.ModelFacts` (every replica serves
            the same model and config).
        index: the :class:`CacheIndex` actor.
        replicas: the replicas deployed (``/health`` is degraded while fewer are live).
    """

    def __init__(self, handle: Any, tokenizer: Any, facts: Any, index: Any, replicas: int = 1) -> None:
        self.handle = handle
        self.replicas = int(replicas)
        self.tokenizer = tokenizer
        self.facts = facts
        self.max_context_len = int(facts.max_context_len)
        self.index = index
        self.is_running = True
        self.dead_error = None
        self._subs: list[tuple[Callable, Optional[tuple]]] = []
        self._open = 0
        self._running: set[str] = set()  # request ids of the open streams (one ingress replica)
        self._held: set[str] = set()  # of those, the ones whose client gets only the final output

    def model_facts(self) -> Any:
        """The replicas' :class:`~radixkv.server.backend.ModelFacts` (read from one at start)."""
        return self.facts

    async def generate(
        self,
        prompt: Any = None,
        sampling_params: Any = None,
        request_id: Optional[str] = None,
        *,
        prompt_token_ids: Optional[Sequence[int]] = None,
        namespace: Any = None,
        on_finish: Optional[Callable[[Any, Any], None]] = None,
        routing_key: Optional[str] = None,
    ) -> AsyncIterator[Any]:
        """As :meth:`radixkv.async_llm.AsyncLLM.generate`. ``on_finish(pins, final output)``
        (not for an aborted or failed request, as on one engine) runs here, on the ingress, before the final output is delivered, with
        :data:`~radixkv.server.backend.NO_PINS` (the replicas' KV cannot be pinned from the
        ingress; a stored Response keeps its context tokens and its follow-up is routed to the
        replica that caches them). A ``request_id`` already running here is refused (a
        ``RequestError`` naming it, as one engine refuses it), whichever replica runs it.
        ``routing_key`` (a client's ``prompt_cache_key`` / ``user``) is the conversation key of
        the ``session`` policy, kept apart per tenant (another tenant's key never moves yours)."""
        import uuid

        from radixkv.errors import RequestError
        from radixkv.sampling_params import SamplingParams
        from radixkv.server.backend import NO_PINS

        if prompt_token_ids is not None:
            ids, text = list(prompt_token_ids), prompt if isinstance(prompt, str) else None
        elif isinstance(prompt, str):
            ids, text = list(self.tokenizer.encode(prompt, add_special_tokens=False)), prompt
        else:
            ids, text = list(prompt or ()), None
        args = dict(
            request_id=request_id or f"req-{uuid.uuid4().hex}",
            prompt=text,
            token_ids=ids,
            params=sampling_params if sampling_params is not None else SamplingParams(),
            namespace=wire_namespace(namespace),
            session=None
            if routing_key is None
            else repr((getattr(Namespace.of(namespace), "tenant", None), routing_key)),
        )
        if args["request_id"] in self._running:
            raise RequestError(f"request_id {args['request_id']!r} is already running", "request_id")
        self._running.add(args["request_id"])
        self._open += 1
        last = None  # the last output yielded to the consumer
        try:
            async for out in self._resuming(args):
                last = out
                if out.finished and on_finish is not None and not ended_early(out):  # as one engine
                    on_finish(NO_PINS, out)
                yield out
        except (GeneratorExit, asyncio.CancelledError):  # the consumer left: the replica aborts it
            if last is None or not last.finished:
                self._emit_finished(last, Namespace.of(namespace), args["request_id"], args["params"].n)
            raise
        finally:
            self._open -= 1
            self._running.discard(args["request_id"])
            self._held.discard(args["request_id"])
            if last is not None and last.finished:
                self._emit_finished(last, Namespace.of(namespace))
                if len(last.outputs) == 1 and self.index is not None:
                    try:  # what the replica caches of it, for the router at once
                        self.index.replied.remote(args["request_id"], list(last.outputs[0].token_ids))
                    except Exception:  # noqa: BLE001 - the index restarting: its events will tell
                        logger.debug("cache index unavailable for the reply", exc_info=True)

    async def _resuming(self, args: dict) -> AsyncIterator[Any]:
        """The request's outputs; when its replica dies, the request goes on elsewhere
        (:mod:`radixkv.router.resume`: restarted, continued or replayed), at most
        :data:`MAX_RESUMES` times; an :class:`EngineDeadError` where that cannot be exact."""
        from ray.exceptions import (
            ActorDiedError,
            ActorUnavailableError,
            RayActorError,
            RayTaskError,
            UnserializableException,
        )
        from ray.serve.exceptions import BackPressureError

        from radixkv.async_llm import EngineDeadError
        from radixkv.errors import QueueFullError
        from radixkv.router.resume import Replayer, ResumeError, Stitcher, continuation, resume_plan

        died = (ActorDiedError, ActorUnavailableError, RayActorError)
        params, rid = args["params"], args["request_id"]
        delivered = None
        call, fix = args, None
        for attempt in range(MAX_RESUMES + 1):
            gen = self.handle.options(stream=True).generate.remote(call)
            ended = False  # the replica's stream ended (or died): nothing to cancel
            try:
                async for raw in gen:
                    ended = raw.finished
                    out = fix.take(raw) if fix is not None else raw
                    if out is None:
                        continue
                    delivered = out
                    yield out
                    if out.finished:
                        return
                ended = True
                return
            except ResumeError as exc:
                raise EngineDeadError(f"{rid} could not be resumed exactly after its replica died: {exc}") from None
            except BackPressureError as exc:  # Serve's queue for the replicas is full: as one engine's
                ended = True
                limit = exc.args[1] if len(exc.args) > 1 else "max_queued_requests"  # (queued, max, ...)
                raise QueueFullError(
                    f"the waiting queue is full ({limit} requests wait for a replica); retry later"
                ) from None
            except UnserializableException as exc:  # the replica's own error, which cannot be rebuilt here
                ended = True
                logger.error("the replica serving %s raised an error the ingress cannot read: %s", rid, exc)
                raise RuntimeError(f"{rid} failed on its replica (its error is in the ingress's log)") from None
            except (ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError) as exc:
                ended = True
                cause = exc.cause if isinstance(getattr(exc, "cause", None), BaseException) else exc
                if isinstance(exc, RayTaskError) and not isinstance(cause, (*died, EngineDeadError)):
                    raise cause from None  # the engine's own error (e.g. a RequestError)
                # NOTE: an EngineDeadError is a replica whose engine stopped: as good as dead
                plan, why = resume_plan(params, delivered)
                n_out = 0 if delivered is None else sum(len(o.token_ids) for o in delivered.outputs)
                if plan is None and rid in self._held:  # the client has nothing a new sample contradicts
                    plan, why, delivered = "restart", f"restarted ({why}; its client has none of it)", None
                if plan is None or attempt == MAX_RESUMES:
                    why = why if plan is None else f"{MAX_RESUMES} resumes failed"
                    # NOTE: Ray's error (actor id, pid, node IP) goes to the log, never to the client
                    logger.warning("the replica serving %s died: %s", rid, exc)
                    raise EngineDeadError(f"the replica serving {rid} died after {n_out} output tokens: {why}") from exc
                logger.warning("the replica serving %s died after %d output tokens: %s", rid, n_out, why)
                call = dict(args, request_id=f"{rid}-resume{attempt + 1}")
                if plan == "restart":
                    fix = None
                elif plan == "continue":
                    ids, cont = continuation(args["token_ids"], params, delivered)
                    call.update(prompt=None, token_ids=ids, params=cont)
                    fix = Stitcher(delivered, params, self.tokenizer)
                else:
                    fix = Replayer(delivered)
                await asyncio.sleep(0.1 * attempt)  # let Serve mark the replica dead
            finally:
                if not ended:  # the consumer left, or the seam's stop check ended it: abort it there
                    gen.cancel()

    def _emit_finished(
        self, out: Any, namespace: Optional[Namespace], aborted: Optional[str] = None, n: int = 1
    ) -> None:
        """What one engine's events tell the app's metrics of a request that ended: its
        ``RequestAdmitted`` with the cache outcome (when the replica recorded one), then its
        ``RequestFinished``, rebuilt from ``out`` (its final output). With ``aborted`` (the request
        id) the consumer left: ``out`` is the last output it got (None: none) and each of the
        ``n`` samples not finished then ends ``"abort"``, as one engine reports an abort."""
        if not self._subs:
            return
        from radixkv.engine.events import RequestAdmitted, RequestFinished

        outs = list(out.outputs) if out is not None else []
        if aborted is not None:
            reasons = tuple(str(o.finish_reason or "abort") for o in outs) + ("abort",) * (n - len(outs))
            rid, outcome = aborted, None
        else:
            reasons, rid, outcome = tuple(str(o.finish_reason) for o in outs), out.request_id, out.cache_outcome
        prompt = len(out.prompt_token_ids or ()) if out is not None else 0
        cached = int(out.num_cached_tokens or 0) if out is not None else 0
        evs = [] if outcome is None else [RequestAdmitted(rid, 0, 0, prompt, cached, cached, False, namespace, outcome)]
        evs.append(RequestFinished(rid, 0, reasons, prompt, sum(len(o.token_ids) for o in outs), cached, namespace))
        for ev in evs:
            for fn, kinds in self._subs:
                if kinds is None or isinstance(ev, kinds):
                    try:
                        fn(ev)
                    except Exception:  # noqa: BLE001
                        logger.exception("subscriber failed")

    def subscribe(self, fn: Callable, kinds: Optional[tuple] = None) -> Callable[[], None]:
        """``RequestAdmitted`` (with the cache outcome) and ``RequestFinished`` events, rebuilt
        at the ingress from each request's final output (or, for an abort, its last output)."""
        entry = (fn, tuple(kinds) if kinds is not None else None)
        self._subs = [*self._subs, entry]  # NOTE: replaced, never changed in place (EventBus.subscribe)

        def unsubscribe() -> None:
            self._subs = [e for e in self._subs if e is not entry]

        return unsubscribe

    async def cache_stats(self, check: bool = False) -> Any:
        """The replicas' ``cache_stats`` summed (ratios recomputed): as each last reported it to
        the index actor (once a second), or with ``check`` as each returned it right after its
        integrity check (run on every replica; an ``AssertionError`` when one fails). An
        :class:`EngineDeadError` (503) while the index holds no replica's stats (every replica
        dead, or the index restarted and none has pushed yet): the sum of none is no KV pool."""
        from radixkv.async_llm import EngineDeadError
        from radixkv.server.backend import sum_stats

        if check:
            per = [r["stats"] for r in await self._on_every_replica("check_integrity")]
        else:
            per = list((await self._ask_index("state"))["replica_stats"].values())
        if not per:
            raise EngineDeadError(
                f"no replica has reported its stats (0 of {self.replicas} live, or the router's cache index "
                "restarted; Ray Serve restarts them)"
            )
        return sum_stats(per)

    async def abort_requests(self, request_ids: Optional[Sequence[str]] = None, prefix: str = "") -> None:
        """As :meth:`EngineBackend.abort_requests <radixkv.server.backend.EngineBackend.abort_requests>`:
        asked of every replica (a request runs on one, maybe resumed under another id there); ids
        no stream of this ingress has open are a no-op without asking any."""
        if request_ids is not None:
            request_ids = [r for r in request_ids if r in self._running]
            if not request_ids:
                return
        await self._on_every_replica("abort_requests", extra=dict(ids=request_ids, prefix=prefix))

    async def load(self) -> list[dict[str, int]]:
        """Each live replica's load, asked of it now (:func:`~radixkv.server.backend.engine_load`)."""
        from radixkv.server.backend import engine_load

        return [engine_load(i, r["stats"]) for i, r in enumerate(await self._on_every_replica("load"))]

    async def _on_every_replica(self, method: str, tries: int = 3, extra: Optional[dict] = None) -> list[dict]:
        """Call the replica deployment's ``method`` once on each registered replica this
        process's request router reaches (:meth:`CacheIndex.replica_ids`; the call names it:
        :meth:`CacheAwareRequestRouter.choose_replicas`); each answers
        ``{"replica": its id, ...}``. A replica another one answered for is asked again, up to
        ``tries`` rounds. ``extra``: more arguments of the call (beside ``replica``).

        Raises:
            EngineDeadError: a registered replica never answered (it died, or is not routable).
            Exception: the replica's own error (e.g. the ``AssertionError`` of a failed check).
        """
        from ray.exceptions import RayTaskError

        from radixkv.async_llm import EngineDeadError

        # NOTE: who answered is checked because Serve's FIFO matching (FIFOMixin) may hand the
        # replica chosen for one request to an older pending one.
        want = set(await self._ask_index("replica_ids", router_key()))
        got: dict[str, dict] = {}
        for attempt in range(tries):
            for r in sorted(want - set(got)):
                try:
                    res = await getattr(self.handle, method).remote({**(extra or {}), "replica": r})
                except RayTaskError as exc:
                    cause = getattr(exc, "cause", None)
                    raise (cause if isinstance(cause, BaseException) else exc) from None
                got.setdefault(res["replica"], res)
            if want <= set(got):
                break
            await asyncio.sleep(0.05 * 2**attempt)  # Serve's view of the replicas may be changing
            want &= set(await self._ask_index("replica_ids", router_key()))  # the dead are removed
        missing = sorted(want - set(got))
        if missing:
            raise EngineDeadError(f"{method}: replicas {missing} did not answer")
        return [got[r] for r in sorted(got)]

    async def replica_health(self) -> dict[str, int]:
        """``{"live": replicas registered with the index, not seen dead and reachable by this
        process's request router (a replica starting is not live yet), "replicas": deployed}``."""
        return dict(live=len(await self._ask_index("replica_ids", router_key())), replicas=self.replicas)

    async def _ask_index(self, method: str, *args: Any) -> Any:
        """The index actor's ``method(*args)``; an :class:`EngineDeadError` (503) while the actor is
        down or restarting (Ray restarts it; requests are routed without it meanwhile)."""
        from ray.exceptions import ActorUnavailableError, RayActorError

        from radixkv.async_llm import EngineDeadError

        try:
            return await getattr(self.index, method).remote(*args)
        except (ActorUnavailableError, RayActorError) as exc:
            raise EngineDeadError(f"the router's cache index is unavailable (restarting): {exc}") from None

    def hold_partials(self, request_id: str) -> None:
        """``request_id``'s client gets only its final output: a resume that would be an error
        restarts it instead (:meth:`_resuming`)."""
        if request_id in self._running:
            self._held.add(request_id)

    async def release_pin(self, pin: Any) -> None:
        """No pins across replicas (:data:`~radixkv.server.backend.NO_PINS`): a no-op."""
        return None

    #: why ``/flush_cache`` and ``/reset_prefix_cache`` refuse here (the serving layer answers 409)
    flush_refused = (
        "the prefix cache is not flushed across replicas (radixkv serve --replicas): each replica's "
        "cache is its own and the router mirrors it; restart the deployment to start cold"
    )

    async def reset_prefix_cache(self, tiers: bool = False) -> bool:
        """Not offered across replicas (:attr:`flush_refused`): always False (``tiers`` too)."""
        return False

    def num_unfinished_requests(self) -> int:
        """Requests this front end has open (a plain method, as on ``AsyncLLM``)."""
        return self._open

    def shutdown(self, timeout: Optional[float] = None) -> None:
        self.is_running = False


class Ingress:
    """The OpenAI app (:func:`radixkv.server.app.create_app`) over :class:`RemoteLLM`, behind the
    same API keys as one engine's (``api_keys``: :meth:`APIKeys.to_wire
    <radixkv.server.auth.APIKeys.to_wire>`, the keys' digests and tenants, never the keys);
    ``replicas``: the engine deployment's replica count (``/health``)."""

    async def __init__(
        self,
        engine_handle: Any,
        served_model_name: str,
        model: str = "smollm2-135m",
        api_keys: Optional[list] = None,
        replicas: int = 1,
        max_request_bytes: Optional[int] = None,
    ) -> None:
        from transformers import AutoTokenizer

        from radixkv.models.loader import resolve_hf_dir
        from radixkv.server.backend import ModelFacts

        self.engine = engine_handle
        self.served_model_name = served_model_name
        self.model = model  # accepted as ``model`` too, as one engine accepts its --model
        self.api_keys = api_keys
        self.max_request_bytes = max_request_bytes  # None: create_app's default
        info = await engine_handle.info.remote()
        tok = AutoTokenizer.from_pretrained(str(resolve_hf_dir(model)), local_files_only=True)
        self.llm = RemoteLLM(engine_handle, tok, ModelFacts.from_dict(info["facts"]), get_index(), replicas)

    def __serve_build_asgi_app__(self):
        from radixkv.server.app import create_app
        from radixkv.server.auth import APIKeys

        keys = APIKeys.from_wire(self.api_keys) if self.api_keys is not None else None
        limit = {} if self.max_request_bytes is None else {"max_request_bytes": self.max_request_bytes}
        return create_app(
            self.llm, served_model_name=self.served_model_name, model_aliases=(self.model,), api_keys=keys, **limit
        )


def build_app(
    replicas: int = 2,
    engine_kwargs: Optional[dict] = None,
    served_model_name: str = "smollm2-135m",
    model: str = "smollm2-135m",
    policy: str = "cache_events",
    policy_kwargs: Optional[dict] = None,
    replica_cpus: float = 0.5,
    ingress_cpus: float = INGRESS_CPUS,
    random_model: Optional[dict] = None,
    max_ongoing_requests: int = 256,
    api_keys: Any = None,
    max_request_bytes: Optional[int] = None,
):
    """The Serve application: ``replicas`` x :class:`EngineReplica` behind the cache-aware
    request router, :class:`Ingress` in front. Creates the index actor (needs ``ray.init``).

    Args:
        engine_kwargs: EngineConfig fields of every replica (``model`` defaults to ``model``).
        policy, policy_kwargs: the routing policy (:func:`radixkv.router.policy.make_policy`).
        replica_cpus, ingress_cpus: logical CPUs each (fractions let 2 replicas and the ingress
            schedule on a 2-core machine).
        random_model: see :class:`EngineReplica`.
        api_keys: the ingress's :class:`~radixkv.server.auth.APIKeys` (None: no keys); their
            quotas become every replica's ``tenant_kv_quota_tokens`` unless ``engine_kwargs``
            sets it (each replica applies the quota to its own cache).
        max_request_bytes: the ingress's request-body limit (``--max-request-bytes``; None: the
            server's default, 32 MiB).
    """
    ekw = dict(engine_kwargs or {})
    if api_keys is not None and api_keys.quotas():
        ekw.setdefault("tenant_kv_quota_tokens", api_keys.quotas())
    ekw.setdefault("model", model)
    ekw.setdefault("device", "cpu")
    index = get_index(create=True, policy=policy, policy_kwargs=policy_kwargs)
    # NOTE: an index that already existed (detached: a cluster outlives a deployment) keeps the
    # policy it was created with unless told
    ray.get(index.set_policy.remote(policy, policy_kwargs))
    engine_dep = serve.deployment(
        EngineReplica, **engine_deployment_options(replicas, replica_cpus, max_ongoing_requests, ekw)
    )
    ingress_dep = serve.deployment(
        serve.ingress()(Ingress),
        name="Ingress",
        num_replicas=1,
        max_ongoing_requests=4 * max_ongoing_requests,
        ray_actor_options={"num_cpus": ingress_cpus},
    )
    wire = api_keys.to_wire() if api_keys is not None else None
    engines = engine_dep.bind(ekw, random_model)
    return ingress_dep.bind(engines, served_model_name, model, wire, replicas, max_request_bytes)


def engine_deployment_options(replicas: int, replica_cpus: float, max_ongoing_requests: int, ekw: dict) -> dict:
    """The :class:`EngineReplica` deployment's Serve options. Serve hands a replica at most
    ``max_ongoing_requests`` at once and queues the rest at the ingress's handle, where the
    engines' own ``max_queued_requests`` bound never sees them; so that bound (``radixkv serve``'s
    ``--max-queued-requests``, 1024) is Serve's ``max_queued_requests`` on the handle: beyond it a
    request is refused at once (:class:`~radixkv.errors.QueueFullError`, HTTP 429), as one engine
    refuses it, instead of waiting in an unbounded queue."""
    queued = ekw.get("max_queued_requests")
    return dict(
        name="EngineReplica",
        num_replicas=replicas,
        max_ongoing_requests=max_ongoing_requests,
        max_queued_requests=-1 if queued is None else queued,
        ray_actor_options={"num_cpus": replica_cpus},
        request_router_config=RequestRouterConfig(request_router_class=ROUTER_PATH),
        health_check_period_s=2,
        health_check_timeout_s=10,
        graceful_shutdown_timeout_s=5,
    )


def start_ray(num_cpus: Optional[float] = None, address: Optional[str] = None) -> None:
    """``ray.init`` for radixkv: a local instance with ``num_cpus`` logical CPUs (default: the
    machine's), dashboard off, or ``address`` of a running cluster."""
    if ray.is_initialized():
        return
    # the workers inherit these (a runtime_env would keep them off the prestarted workers)
    os.environ.update(WORKER_ENV)
    if address:
        ray.init(address=address, namespace=NAMESPACE)
    else:
        ray.init(
            num_cpus=num_cpus or os.cpu_count(),
            include_dashboard=False,
            namespace=NAMESPACE,
            configure_logging=False,
            log_to_driver=False,
        )


class _Stop(KeyboardInterrupt):
    """SIGTERM, raised where the main thread is: it ends ``radixkv serve --replicas`` as Ctrl-C does."""


def _raise_stop(signum: int, frame: Any) -> None:
    raise _Stop(f"signal {signum}")


def _serve_forever(args: Any, engine_kwargs: dict, served_model_name: str, api_keys: Any = None) -> None:
    """Start Ray, deploy the app and block (until a signal interrupts it)."""
    start_ray(address=getattr(args, "ray_address", None))
    # after ray.init, which installs its own SIGTERM handler (a bare sys.exit that leaves the
    # deployment and Ray's agents running)
    signal.signal(signal.SIGTERM, _raise_stop)
    serve.start(http_options={"host": args.host, "port": args.port})
    # an index without its app is a killed deployment's (its replicas and views are gone); a
    # running app's is kept (its replicas use it while Serve replaces them)
    if "radixkv" not in serve.status().applications and drop_index():
        logger.warning("replaced the cache index a previous deployment left on the cluster")
    app = build_app(
        replicas=args.replicas,
        engine_kwargs=replica_engine_kwargs(engine_kwargs),
        served_model_name=served_model_name,
        model=args.model,
        policy=args.router_policy,
        replica_cpus=args.replica_cpus,
        api_keys=api_keys,
        max_request_bytes=getattr(args, "max_request_bytes", None),
    )
    try:
        serve.run(app, name="radixkv", route_prefix="/", blocking=False)
    except RuntimeError as exc:  # Serve gave up on a deployment: say why its replicas failed
        raise DeployFailed(_deploy_error(exc)) from None
    print(
        f"radixkv: serving {served_model_name!r} on {args.replicas} replicas ({args.router_policy} routing) at "
        f"http://{args.host}:{args.port}/v1",
        flush=True,
    )
    while True:
        time.sleep(3600)


def replica_engine_kwargs(engine_kwargs: dict) -> dict:
    """The ``EngineConfig`` fields every replica gets: ``engine_kwargs`` with ``device`` ``auto``
    as ``cpu`` (a replica is given Ray CPUs, no GPU)."""
    ekw = dict(engine_kwargs)
    ekw["device"] = "cpu" if ekw.get("device", "auto") == "auto" else ekw["device"]
    return ekw


def replica_config_error(engine_kwargs: dict) -> Optional[str]:
    """Why every replica would refuse ``engine_kwargs`` (the ``ValueError`` of its
    ``EngineConfig``, naming the field), found before Ray starts; None when they are valid."""
    from radixkv.config import EngineConfig

    try:
        EngineConfig(**replica_engine_kwargs(engine_kwargs)).resolve()  # the checks that need no model
    except ValueError as exc:
        return str(exc)
    return None


def local_cpus_error(replicas: int, replica_cpus: float, cpus: Optional[int] = None) -> Optional[str]:
    """Why a local Ray instance of ``cpus`` logical CPUs (default: the machine's, what
    :func:`start_ray` gives it) cannot schedule ``replicas`` x ``replica_cpus`` and the ingress
    (Serve would wait for them forever, saying nothing); None when it can."""
    cpus = (os.cpu_count() or 1) if cpus is None else cpus
    need = replicas * replica_cpus + INGRESS_CPUS
    if need <= cpus + 1e-9:
        return None
    fit = (cpus - INGRESS_CPUS) / replicas
    return (
        f"--replicas {replicas} x --replica-cpus {replica_cpus:g} and the ingress's {INGRESS_CPUS:g} need "
        f"{need:g} Ray CPUs; the local Ray instance has {cpus} (this machine's): lower --replica-cpus "
        f"(at most {fit:g} for {replicas} replicas) or --replicas, or join a cluster with --ray-address"
    )


class DeployFailed(RuntimeError):
    """Serve could not start the application (a replica's or the ingress's constructor raised)."""


def _deploy_error(exc: BaseException) -> str:
    """What Serve says of a failed deployment: each failed deployment's last error line."""
    why = []
    try:
        app = serve.status().applications.get("radixkv")
        for name, dep in (app.deployments if app is not None else {}).items():
            lines = [ln.strip() for ln in str(dep.message or "").splitlines() if ln.strip()]
            if lines and ("FAIL" in str(dep.status) or "UNHEALTHY" in str(dep.status)):
                why.append(f"{name}: {lines[-1]}")  # the constructor's exception (the traceback is Ray's log)
    except Exception:  # noqa: BLE001 - Serve's status unavailable: its own message
        logger.debug("serve.status failed", exc_info=True)
    return "; ".join(why) or str(exc)


def run(args: Any, engine_kwargs: dict, served_model_name: str, api_keys: Any = None) -> int:
    """``radixkv serve --replicas N`` (``args``: its parsed flags): start Ray, deploy, serve until
    Ctrl-C (SIGINT) or SIGTERM (what ``kill``, systemd and docker send); either one shuts the whole
    deployment down: Serve's actors, then the local Ray instance with every process it started
    (``ray.shutdown``; a cluster joined with ``--ray-address`` keeps running, Serve on it shut down).
    ``api_keys``: the ingress's :class:`~radixkv.server.auth.APIKeys` (None: no keys)."""
    # NOTE: this process's own log (the replicas and Serve write theirs to Ray's session logs)
    level = str(getattr(args, "log_level", "info")).upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    bad = replica_config_error(engine_kwargs)
    if bad is None and not getattr(args, "ray_address", None):
        bad = local_cpus_error(args.replicas, args.replica_cpus)
    if bad is not None:  # every replica would refuse it: say so before starting Ray
        print(f"radixkv serve: {bad}", file=sys.stderr)
        return 2
    if not getattr(args, "ray_address", None):  # a local instance: Serve's proxy listens on this machine
        from radixkv.server.cli import listen_error

        bad = listen_error(args.host, args.port)
        if bad is not None:  # the proxy would fail once Ray started, in a traceback (exit 1, as uvicorn's)
            print(f"radixkv serve: {bad}", file=sys.stderr)
            return 1
    signal.signal(signal.SIGTERM, _raise_stop)
    try:
        _serve_forever(args, engine_kwargs, served_model_name, api_keys)
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (_Stop)
        pass
    except DeployFailed as exc:
        print(f"radixkv serve: the replicas did not start: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM does not cut the shutdown short
        if ray.is_initialized():
            serve.shutdown()
            drop_index()  # detached: on a cluster joined with --ray-address it would outlive us
        ray.shutdown()
    return 0
