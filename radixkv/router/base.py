"""What every routing policy shares: the request a router sees (:class:`RouteRequest`), its
:class:`Decision`, a replica's recorded load (:class:`ReplicaLoad`) and the :class:`Policy` base
class (load bookkeeping, the balance test, ``choose`` / ``finished``). Pure Python, torch-free;
the policies are in :mod:`radixkv.router.policy` and :mod:`radixkv.router.cache_events`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Optional, Sequence

from radixkv.cache.digests import BLOCK_TOKENS, block_digests
from radixkv.namespace import Namespace

__all__ = ["RouteRequest", "Decision", "ReplicaLoad", "Policy"]


@dataclass
class RouteRequest:
    """What a router knows of a request.

    Attributes:
        request_id: unique among outstanding requests.
        token_ids: the prompt's token ids.
        namespace: its prefix-cache namespace (blocks only match within one): a
            :class:`~radixkv.namespace.Namespace` or None; any hashable ``Namespace.of``
            accepts is normalized by it (so ``"a"`` routes as the engine caches
            ``namespace="a"``), and its block digests are seeded by the stable serialization
            the replicas' cache events use.
        session: a conversation key for ``session`` routing (None: the request id).
        output_tokens: expected output tokens (a load estimate; 0 when unknown).
    """

    request_id: str
    token_ids: Sequence[int]
    namespace: Optional[Namespace] = None
    session: Optional[str] = None
    output_tokens: int = 0
    _digests: Optional[list] = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.namespace = Namespace.of(self.namespace)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def digests(self) -> list[bytes]:
        """Chained digests of the whole 16-token blocks of ``token_ids[:-1]`` (the engine never
        serves a prompt's last token from the cache), computed once."""
        if self._digests is None:
            n = max(len(self.token_ids) - 1, 0) // BLOCK_TOKENS
            self._digests = block_digests(self.token_ids[: n * BLOCK_TOKENS], self.namespace, 0, n) if n else []
        return self._digests


@dataclass(frozen=True)
class Decision:
    """A routing decision: the replica, the cached prompt tokens the policy expects there (0
    when it does not know), and why (``"cache"``, ``"load"``, ``"miss"``, ``"home"``,
    ``"session"``, ``"turn"``)."""

    replica: str
    cached_tokens: int = 0
    reason: str = ""


@dataclass
class ReplicaLoad:
    """A replica's load as the router records it: outstanding requests and their estimated
    uncached prompt tokens."""

    requests: int = 0
    prefill_tokens: int = 0


class Policy:
    """Base class: replica membership, load recording, decisions (module docstring).

    Args:
        seed: seeds the policy's random choices.

    Attributes:
        loads: ``replica -> ReplicaLoad``.
        decisions: ``request_id -> replica`` of the outstanding requests.
    """

    name = "base"

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.loads: dict[str, ReplicaLoad] = {}
        self.decisions: dict[str, str] = {}
        self._out: dict[str, tuple[str, int]] = {}

    # ------------------------------------------------------------------ membership
    @property
    def replicas(self) -> list[str]:
        return list(self.loads)

    def add_replica(self, replica: str) -> None:
        """Make ``replica`` routable (idempotent)."""
        self.loads.setdefault(replica, ReplicaLoad())

    def remove_replica(self, replica: str) -> None:
        """Forget ``replica``: its load, its outstanding requests and (subclasses) its cache."""
        self.loads.pop(replica, None)
        for rid in [r for r, (rep, _) in self._out.items() if rep == replica]:
            del self._out[rid]
            self.decisions.pop(rid, None)

    # ------------------------------------------------------------------ decisions
    def choose(self, req: RouteRequest, candidates: Optional[Sequence[str]] = None, now: float = 0.0) -> Decision:
        """Pick a replica among ``candidates`` (default: all known) and record the decision.

        Raises:
            ValueError: no candidate replica.
        """
        cands = [c for c in (self.replicas if candidates is None else candidates) if c in self.loads]
        if not cands:
            raise ValueError("choose: no replica to route to")
        if req.request_id in self._out:  # a retry: undo the earlier decision first
            self.finished(req.request_id, now, expire=True)
        d = self._select(req, cands, now)
        self.record(req, d, now)
        return d

    def _select(self, req: RouteRequest, cands: list[str], now: float) -> Decision:
        raise NotImplementedError

    def record(self, req: RouteRequest, d: Decision, now: float = 0.0) -> None:
        """Count ``req`` on ``d.replica`` at once."""
        uncached = max(req.num_tokens - d.cached_tokens, 0)
        self._out[req.request_id] = (d.replica, uncached)
        self.decisions[req.request_id] = d.replica
        load = self.loads[d.replica]
        load.requests += 1
        load.prefill_tokens += uncached

    def finished(
        self, request_id: str, now: float = 0.0, expire: bool = False, output_token_ids: Optional[Sequence[int]] = None
    ) -> None:
        """``request_id`` ended (done, failed or cancelled); unknown ids are ignored. ``expire``:
        drop what the decision implied at once (a retry, a request that never ran).
        ``output_token_ids``: the tokens it generated, when known (``cache_events`` counts the
        blocks of ``prompt + output[:-1]``, what the replica caches, as soon held)."""
        got = self._out.pop(request_id, None)
        self.decisions.pop(request_id, None)
        if got is None:
            return
        rep, uncached = got
        load = self.loads.get(rep)
        if load is not None:
            load.requests -= 1
            load.prefill_tokens -= uncached

    def moved(self, req: RouteRequest, replica: str, now: float = 0.0) -> None:
        """The request went to ``replica`` instead of the chosen one (the serving layer overrode
        the choice): re-record it there."""
        if self._out.get(req.request_id, (None,))[0] == replica:
            return
        self.finished(req.request_id, now, expire=True)
        if replica in self.loads:
            self.record(req, Decision(replica, 0, "moved"), now)

    # ------------------------------------------------------------------ cache information
    def on_events(self, replica: str, batch: dict, now: float = 0.0) -> bool:
        """A batch of ``replica``'s cache events; True when a snapshot is wanted."""
        return False

    def on_snapshot(self, replica: str, snap: dict) -> None:
        """A snapshot of ``replica``'s cache."""

    def stats(self) -> dict:
        return {"policy": self.name, "loads": {r: (ld.requests, ld.prefill_tokens) for r, ld in self.loads.items()}}

    # ------------------------------------------------------------------ helpers
    def _least_loaded(self, cands: list[str]) -> str:
        best = min((self.loads[c].requests, self.loads[c].prefill_tokens) for c in cands)
        ties = [c for c in cands if (self.loads[c].requests, self.loads[c].prefill_tokens) == best]
        return ties[0] if len(ties) == 1 else self.rng.choice(ties)

    def _imbalanced(self, cands: list[str], abs_t: float, rel_t: float) -> bool:
        ls = [self.loads[c].requests for c in cands]
        hi, lo = max(ls), min(ls)
        return hi - lo > abs_t and hi > rel_t * lo
