"""Typed engine events and the bus that delivers them.

The engine emits what happens to requests and to the prefix cache; metrics, tests, the hit-rate
explainer and a router subscribe instead of patching the engine. Every event is a frozen
dataclass. Delivery is synchronous, on the thread that drives the engine (inside
``Engine.step()`` and the engine's own methods), in emission order; a subscriber must be quick
and must not call back into the engine. A subscriber that raises is logged and counted in
:attr:`EventBus.errors`; the engine goes on.

Events:

* :class:`RequestAdmitted`: a sample got its first ``req_to_token`` row, with its cache outcome
  (``num_cached_tokens``: prompt tokens it did not compute, served from the prefix cache or
  borrowed from a request computing them in the same forward, ``num_shared_tokens`` of them;
  0 for samples ``index > 0`` and for re-admissions after a retraction, which are not counted
  again; ``cache_outcome``: why the match stopped, :mod:`radixkv.cache.outcome`).
* :class:`StepFinished`: one forward pass ran: which samples it carried, how many new tokens each,
  which of them sampled, which requests were retracted while planning it, and which samples
  sampled from another row's logits without a row of their own (in-batch sharing).
* :class:`RequestFinished`: a user request (all its ``n`` samples) finished or was aborted.
* :class:`CacheInserted` / :class:`CacheEvicted` / :class:`CacheReset`: tokens entered or left
  the prefix cache (``CacheInserted.medium``: the pool, ``"device"``, or a KV tier the blocks
  were stored in), with a per-engine sequence number ``seq`` (one counter for the three, no
  gaps), the namespace (a :class:`~radixkv.namespace.Namespace`, or None: the shared default;
  every event carries it as the engine normalized it), and the chained digests of the 16-token blocks that became fully cached
  or stopped being so (:mod:`radixkv.cache.digests`; the same whatever the page size).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

from radixkv.namespace import Namespace

__all__ = [
    "Event",
    "RequestAdmitted",
    "StepFinished",
    "RequestFinished",
    "CacheInserted",
    "CacheEvicted",
    "CacheReset",
    "EventBus",
]

logger = logging.getLogger(__name__)


class Event:
    """Base class of every engine event."""

    __slots__ = ()


@dataclass(frozen=True, slots=True)
class RequestAdmitted(Event):
    """A sample was admitted (got a ``req_to_token`` row).

    Attributes:
        request_id: the user request's id; ``index``: the sample (``0 .. n-1``).
        step: the engine step (``Engine.num_steps`` at the step that admitted it).
        num_prompt_tokens: tokens of the prompt.
        num_cached_tokens: prompt tokens it does not compute (served from the prefix cache, or
            borrowed from a request that computes them in the same forward), counted at the
            first admission of sample 0 only (0 otherwise).
        prefix_len: tokens whose K/V it reuses now (the cached or shared prefix), also on
            re-admission.
        readmission: True when it was retracted before.
        namespace: its prefix-cache namespace (``Namespace.of`` of what it was submitted with).
        cache_outcome: why its prefix match stopped
            (:class:`~radixkv.cache.outcome.CacheOutcome`: cause, missed tokens per cause), on
            the first admission of sample 0 when the engine records outcomes; else None.
        num_shared_tokens: of ``prefix_len``, the tokens borrowed from requests computing them
            in the same forward (in-batch prefix sharing; they were not cached when it was
            admitted). ``prefix_len - num_shared_tokens`` came from the prefix cache (or a pin).
    """

    request_id: str
    index: int
    step: int
    num_prompt_tokens: int
    num_cached_tokens: int
    prefix_len: int
    readmission: bool
    namespace: Optional[Namespace]
    cache_outcome: Any = None
    num_shared_tokens: int = 0


@dataclass(frozen=True, slots=True)
class StepFinished(Event):
    """One forward pass ran.

    Attributes:
        step: the engine step number (1 for the first forward).
        samples: ``(request_id, index)`` of each row of the batch, in batch order.
        extend_lens: new tokens of each row (1 for a decode; ``1 + k`` for a decode that
            verifies ``k`` draft tokens).
        sampled: whether each row sampled a token (decodes and last prefill chunks).
        prefill_tokens: new tokens of the rows that were prefilling (not decoding).
        retracted: ``(request_id, index)`` of the samples retracted while planning this step.
        riders: ``(request_id, index)`` of the samples that sampled a token in this step from
            another row's logits, with no row of their own (in-batch sharing: that row computed
            their whole sequence, e.g. an identical prompt). With the rows whose ``sampled`` is
            True they are every sample that got a token in this step.
        draft_lens: draft tokens each row verified (speculative decoding; all 0 when off). The
            tokens themselves are never in an event: only the sampled ones enter a request.
    """

    step: int
    samples: tuple[tuple[str, int], ...]
    extend_lens: tuple[int, ...]
    sampled: tuple[bool, ...]
    prefill_tokens: int
    retracted: tuple[tuple[str, int], ...]
    riders: tuple[tuple[str, int], ...] = ()
    draft_lens: tuple[int, ...] = ()

    @property
    def num_reqs(self) -> int:
        """Rows in the batch."""
        return len(self.samples)

    @property
    def tokens_for(self) -> tuple[tuple[str, int], ...]:
        """``(request_id, index)`` of every sample that got a token in this step: the sampling
        rows in batch order, then the riders."""
        return tuple(s for s, ok in zip(self.samples, self.sampled) if ok) + self.riders


@dataclass(frozen=True, slots=True)
class RequestFinished(Event):
    """A user request ended: every sample finished, or it was aborted.

    Attributes:
        request_id: its id; ``step``: the engine step it ended in.
        finish_reasons: each sample's reason (``"stop"``, ``"length"``, ``"abort"``, ``"error"``).
        num_prompt_tokens, num_output_tokens (all samples), num_cached_tokens.
        namespace: its prefix-cache namespace (its ``tenant`` keys the server's per-tenant
            metrics).
    """

    request_id: str
    step: int
    finish_reasons: tuple[str, ...]
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    namespace: Optional[Namespace] = None


@dataclass(frozen=True, slots=True)
class CacheInserted(Event):
    """Tokens entered the prefix cache, or blocks were stored in a KV tier below it.

    Attributes:
        seq: per-engine sequence number of cache events (1, 2, ...; no gaps).
        namespace: the namespace of the inserted sequence.
        num_tokens: tokens newly cached (whole pages; for a tier, 16 per block).
        first_block: index of the first 16-token block in ``block_digests`` (block ``b`` covers
            tokens ``[16 b, 16 b + 16)`` of the sequence).
        block_digests: chained digests of the blocks that became fully cached, in order.
        medium: where they are held: ``"device"`` (the KV pool; also blocks loaded into it from
            a tier) or a KV tier, ``"host"``, ``"disk"``, ``"remote"`` (the blocks are stored
            there now; vLLM's ``BlockStored.medium``). A tier's own evictions are not announced.
    """

    seq: int
    namespace: Optional[Namespace]
    num_tokens: int
    first_block: int
    block_digests: tuple[bytes, ...]
    medium: str = "device"


@dataclass(frozen=True, slots=True)
class CacheEvicted(Event):
    """Tokens left the prefix cache (evicted to make room).

    Attributes:
        seq: as in :class:`CacheInserted`.
        namespace: the namespace they belonged to.
        num_tokens: tokens freed.
        block_digests: chained digests of the 16-token blocks that stopped being fully cached,
            or None when the policy cannot tell (hash blocks); a consumer then treats the
            namespace as unknown and resyncs.
    """

    seq: int
    namespace: Optional[Namespace]
    num_tokens: int
    block_digests: Optional[tuple[bytes, ...]]


@dataclass(frozen=True, slots=True)
class CacheReset(Event):
    """The prefix cache was emptied (``reset_prefix_cache``); ``num_tokens`` were freed."""

    seq: int
    num_tokens: int


Subscriber = Callable[[Event], None]


class EventBus:
    """Synchronous publish/subscribe of engine events (module docstring).

    Attributes:
        errors: exceptions raised by subscribers so far (each was logged).
    """

    def __init__(self) -> None:
        self._subs: list[tuple[Subscriber, Optional[tuple[type, ...]]]] = []
        self._wanted: set[type] = set()
        self._all = False
        self.errors = 0

    def subscribe(self, fn: Subscriber, kinds: Optional[tuple[type, ...]] = None) -> Callable[[], None]:
        """Call ``fn(event)`` for every event (or only those of the classes in ``kinds``).

        Returns:
            A function that unsubscribes ``fn`` (idempotent).

        Raises:
            ValueError: ``fn`` is not callable, or ``kinds`` names a class that is not an Event.
        """
        if not callable(fn):
            raise ValueError(f"subscribe: fn must be callable, got {type(fn).__name__}")
        if kinds is not None:
            kinds = tuple(kinds)
            bad = [k for k in kinds if not (isinstance(k, type) and issubclass(k, Event))]
            if bad:
                raise ValueError(f"subscribe: kinds must be Event classes, got {bad!r}")
        entry = (fn, kinds)
        # NOTE: the list is replaced, never changed in place: a subscriber that (un)subscribes
        # inside its callback must not shift the list emit() is iterating
        self._subs = [*self._subs, entry]
        self._refresh()

        def unsubscribe() -> None:
            if entry in self._subs:
                self._subs = [e for e in self._subs if e is not entry]
                self._refresh()

        return unsubscribe

    def _refresh(self) -> None:
        self._all = any(k is None for _, k in self._subs)
        self._wanted = {c for _, k in self._subs if k for c in k}

    def wants(self, kind: type) -> bool:
        """True when some subscriber would receive events of class ``kind`` (emitters skip
        building events nobody receives)."""
        return self._all or kind in self._wanted

    def emit(self, event: Event) -> None:
        """Deliver ``event`` to its subscribers, in subscription order."""
        for fn, kinds in self._subs:
            if kinds is None or isinstance(event, kinds):
                try:
                    fn(event)
                except Exception:  # noqa: BLE001 - an observer must not stop the engine
                    self.errors += 1
                    logger.exception("event subscriber %r failed on %r", fn, event)
