"""The KV tiers' I/O thread: it looks blocks up in the stores and loads them into a staging buffer,
and writes blocks gathered from the pool to the stores, off the engine thread.

The engine thread hands it :class:`LoadJob` s (a request's next blocks, in order) and
:class:`WriteJob` s (blocks already copied out of the pool, so the pool's slots are free to be
reused at once); loads go first (a request waits for them), writes after. A load asks the stores
in tier order which blocks they hold (``contains``), keeps the longest leading run that some tier
holds and that is cheaper to load than to recompute (:class:`CostModel`), fetches it (``get``:
each store verifies its bytes; here the tokens, the layout and the length are checked once more,
and a block that fails any check ends the run) into one ``uint8`` tensor
``[16 * blocks, token_bytes]`` (pinned when the pool is on a GPU); when every block the tiers
hold was loaded, the tail after them (the partial block a sequence ended with, docs/tiers.md
"Tails") is read from the first tier whose record shares ``c > 0`` tokens with the request's next
ones, and its first ``c`` rows follow. A load asking for a block (or tail) that a queued write is
about to put waits for that write (the writes before it run first): a block evicted from the
pool, or just computed, is served by the tier it is being written to, not recomputed. A write
puts the blocks a store does not hold yet, and its tail over whatever tail the store holds
there. A store's failure is a miss (counted), never an
exception here.

Nothing here touches the pool, the cache or a request: the KV manager installs a finished load
(the only code that moves slots) and the tier manager emits the events of finished writes.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np
import torch

from radixkv.cache.digests import BLOCK_TOKENS
from radixkv.tiers import Block

__all__ = [
    "LATENCY_BUCKETS",
    "LOOKUP_WAIT_MAX_S",
    "LOOKUP_WAIT_STEPS",
    "CostModel",
    "LoadJob",
    "TierCounters",
    "TierIO",
    "WriteJob",
    "lookup_stop",
    "merge_spans",
    "shared_len",
]

logger = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
"""Upper bounds (seconds) of the load-latency histogram of each tier (one ``get`` call)."""

LOOKUP_WAIT_STEPS = 0.5
"""The most a step waits for a lookup it started, as a fraction of the average step's wall time
(:meth:`CostModel.lookup_wait_s`)."""

LOOKUP_WAIT_MAX_S = 0.05
"""The most a step waits for a lookup it started, in seconds, however long the steps take."""


def shared_len(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading token ids ``a`` and ``b`` share (a tail's record against a request's
    next tokens: at most 16 each, so a Python loop)."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def lookup_stop(known: int, limit: int) -> int:
    """The block index a lookup of positions below ``limit`` stops before, for a request that
    knows its first ``known`` token ids: every whole block below ``limit`` and, when ``limit``
    falls inside a block whose 16 tokens the request knows, that block too (its digest names it;
    only its tokens below ``limit`` are served). A prompt of 32 tokens may reuse 31: blocks 0 and
    1, the second used for 15 of its tokens."""
    stop = limit // BLOCK_TOKENS
    return stop + 1 if limit % BLOCK_TOKENS and known >= BLOCK_TOKENS * (stop + 1) else stop


def merge_spans(start: int, blocks: Sequence[tuple]) -> List[tuple]:
    """``(lo, hi, medium)`` spans of the positions at and after ``start`` that ``blocks`` serve:
    ``blocks`` are consecutive ``(lo, hi, medium)`` (a block's positions, a tail's last), each
    clipped to ``start`` and to the previous one's end, empty ones dropped, neighbours of one
    medium merged (``explain``'s dry run and the simulator's tiers count spans so)."""
    spans: List[tuple] = []
    for lo, hi, m in blocks:
        lo = max(lo, start, spans[-1][1] if spans else 0)
        if hi <= lo:
            continue
        if spans and spans[-1][2] == m and spans[-1][1] == lo:
            spans[-1] = (spans[-1][0], hi, m)
        else:
            spans.append((lo, hi, m))
    return spans


@dataclass(eq=False)
class LoadJob:
    """One request's lookup and load (module docstring).

    Attributes:
        keys, tokens: the ``BlockKey`` and the 16 token ids of blocks ``first, first + 1, ...``.
        first: index of the first block (block ``b`` covers tokens ``[16 b, 16 b + 16)``).
        stores: the stores to look in, in tier order.
        rows: (set by the I/O thread) ``uint8 [16 * n, token_bytes]``, the K/V of the ``n``
            leading blocks loaded (``n`` may be 0).
        media: (I/O thread) the tier each loaded block came from.
        done, cancelled: finished by the I/O thread / given up by the engine thread.
        owner: what the engine side waits on it for (a request).
        tail_keys: ``tail_keys[i]``: the key of the tail after block ``first + i - 1`` (after
            the ``i`` leading blocks; ``len(keys) + 1`` of them, or none: no tail looked up).
        ahead: the request's token ids from position ``16 first`` up to its limit: a tail
            serves the prefix its tokens share with them.
        tail_medium: (I/O thread) the tier the tail came from (its rows follow the blocks' in
            ``rows``), or None.
    """

    keys: list
    tokens: list
    first: int
    stores: list
    owner: Any = None
    tail_keys: list = field(default_factory=list)
    ahead: tuple = ()
    rows: Optional[torch.Tensor] = None
    media: List[str] = field(default_factory=list)
    tail_medium: Optional[str] = None
    done: bool = False
    cancelled: bool = False


@dataclass(eq=False)
class WriteJob:
    """Blocks copied out of the pool for the stores (module docstring).

    Attributes:
        namespace: their namespace (events); keys, tokens, digests: per block, in order from
            block ``first``; rows: ``uint8 [16 * n + len(tail_tokens), token_bytes]`` on the
            CPU; stores: where to put them; stored: (I/O thread) the media that hold all the
            blocks afterwards. tail_key, tail_tokens: the tail after the last block (1 to 15
            tokens, its rows last in ``rows``; written over any tail held there), or None / ().
            touch_keys: the blocks before them that the pool already held (the head of their
            sequence): marked used in each store that can (``touch``) before the puts.
    """

    namespace: Any
    keys: list
    tokens: list
    digests: list
    first: int
    rows: torch.Tensor
    stores: list
    stored: List[str] = field(default_factory=list)
    tail_key: Any = None
    tail_tokens: tuple = ()
    touch_keys: list = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return int(self.rows.numel())


class TierCounters:
    """What the engine side counts per tier (beside the store's own ``stats()``): blocks looked
    up (``lookups``), ``found``, ``loaded``, ``load_rejected`` (wrong tokens, layout or length
    after the store's checks; tails included) or ``load_skipped`` (found but dearer to load than
    to recompute), tails loaded (``tails_loaded``) and the tokens of them used (``tail_tokens``),
    blocks whose write was dropped (``write_dropped``: the backlog was full), blocks queued
    or being written now (``write_pending``: a gauge; 0 once the writes have landed), prompt tokens
    served to requests (``served_tokens``), and the load-latency histogram
    (:data:`LATENCY_BUCKETS`, one observation per ``get`` call). Updated under the I/O lock."""

    __slots__ = (
        "lookups",
        "found",
        "loaded",
        "load_rejected",
        "load_skipped",
        "tails_loaded",
        "tail_tokens",
        "write_dropped",
        "write_pending",
        "served_tokens",
        "buckets",
        "lat_sum",
    )

    def __init__(self) -> None:
        self.lookups = self.found = self.loaded = self.load_rejected = self.load_skipped = 0
        self.write_dropped = self.served_tokens = self.tails_loaded = self.tail_tokens = 0
        self.write_pending = 0
        self.buckets = [0] * (len(LATENCY_BUCKETS) + 1)
        self.lat_sum = 0.0

    def observe(self, seconds: float) -> None:
        i = next((k for k, b in enumerate(LATENCY_BUCKETS) if seconds <= b), len(LATENCY_BUCKETS))
        self.buckets[i] += 1
        self.lat_sum += seconds

    def as_dict(self) -> Dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__slots__ if k not in ("buckets", "lat_sum")}
        d["load_latency"] = {"buckets": list(LATENCY_BUCKETS), "counts": list(self.buckets), "sum": self.lat_sum}
        return d


class CostModel:
    """Running averages (EWMA, weight ``alpha``) of the seconds to load one block from each tier
    and to prefill one token; :meth:`best_run` picks how many leading blocks of a run to load.

    Before a tier's first load its cost counts as 0 (load: that measures it); before the first
    prefill is measured every run is loaded. A tier whose cost kept ``reprobe_blocks`` blocks in a
    row from loading counts as 0 once more, so the next load measures it again: an estimate made
    in a slow moment (a reconnect, a burst of other work on the cores) would otherwise stop every
    load from that tier, and with them every new measurement.
    """

    def __init__(self, alpha: float = 0.2, reprobe_blocks: int = 64) -> None:
        self.alpha = alpha
        self.reprobe_blocks = reprobe_blocks
        self.block_s: Dict[str, float] = {}
        self.prefill_token_s: Optional[float] = None
        self.step_s: Optional[float] = None
        self._steps = 0
        self.skipped: Dict[str, int] = {}  # blocks a tier's cost kept from loading since it was measured
        self._lock = threading.Lock()

    def _ewma(self, old: Optional[float], x: float) -> float:
        return x if old is None else (1 - self.alpha) * old + self.alpha * x

    def note_load(self, medium: str, seconds: float, blocks: float) -> None:
        """``blocks`` records came from ``medium`` in ``seconds`` (fetch, checks and staging; a
        tail counts as one: its fetch costs a record's round trip whatever its length)."""
        if blocks > 0:
            with self._lock:
                self.block_s[medium] = self._ewma(self.block_s.get(medium), seconds / blocks)
                self.skipped[medium] = 0

    def note_prefill(self, seconds: float, tokens: int) -> None:
        """A forward computed ``tokens`` prompt tokens in ``seconds``."""
        if tokens > 0 and seconds > 0:
            with self._lock:
                self.prefill_token_s = self._ewma(self.prefill_token_s, seconds / tokens)

    def note_step(self, seconds: float) -> None:
        """A step that ran a forward took ``seconds`` (forward and sampling, wall clock). The
        first step is not counted: it pays for warm-up (allocations, lazy compilation)."""
        if seconds > 0:
            with self._lock:
                self._steps += 1
                if self._steps > 1:
                    self.step_s = self._ewma(self.step_s, seconds)

    def lookup_wait_s(self) -> float:
        """How long a step may wait for a lookup it has just started before it runs without it:
        half a step (``step_s``), at most :data:`LOOKUP_WAIT_MAX_S`; 0 before a step is measured.
        A load done in time is admitted in this step instead of the next, saving its request a
        whole step for at most half of one for the others; a slower one (a Redis round trip, a
        cold disk) is installed at a later step as before."""
        return 0.0 if self.step_s is None else min(LOOKUP_WAIT_STEPS * self.step_s, LOOKUP_WAIT_MAX_S)

    def token_s(self, medium: str) -> Optional[float]:
        """Seconds per token to load from ``medium`` (None: not measured yet)."""
        b = self.block_s.get(medium)
        return None if b is None else b / BLOCK_TOKENS

    def saves(self, medium: str) -> bool:
        """Whether fetching one record (a tail) from ``medium`` costs less than recomputing 16
        tokens (the most a tail serves); a False counts as one skipped block."""
        if self.prefill_token_s is None or self.skipped.get(medium, 0) >= self.reprobe_blocks:
            return True
        if BLOCK_TOKENS * self.prefill_token_s > self.block_s.get(medium, 0.0):
            return True
        with self._lock:  # a tail not fetched counts toward the re-measuring, as a block would
            self.skipped[medium] = self.skipped.get(medium, 0) + 1
        return False

    def best_run(self, media: List[str]) -> int:
        """How many leading blocks of a run held in ``media`` (per block) to load: the prefix
        that saves the most time against recomputing it (0 when none saves any)."""
        if self.prefill_token_s is None:
            return len(media)
        gain = BLOCK_TOKENS * self.prefill_token_s
        with self._lock:
            stale = {m for m in media if self.skipped.get(m, 0) >= self.reprobe_blocks}
            best = acc = 0.0
            k = 0
            for i, m in enumerate(media):
                acc += gain - (0.0 if m in stale else self.block_s.get(m, 0.0))
                if acc > best:
                    best, k = acc, i + 1
            for m in media[k:]:
                self.skipped[m] = self.skipped.get(m, 0) + 1
        return k


class TierIO:
    """The I/O thread (module docstring).

    Args:
        meta: the pool's layout name (a loaded block must carry exactly it).
        token_bytes: bytes of one token's K/V in the pool.
        costs: the :class:`CostModel` it measures loads into and decides with.
        counters: a :class:`TierCounters` per medium.
        pin_memory: stage loads in pinned host memory (a GPU pool).
        max_pending_bytes: bound on the bytes of queued writes; a write beyond it is dropped
            (counted in ``write_dropped``).

    Attributes:
        on_load_done: called (on the I/O thread, no lock held) after each finished load, e.g. to
            wake an engine driver waiting for it; None: nobody.
    """

    def __init__(
        self,
        meta: bytes,
        token_bytes: int,
        costs: CostModel,
        counters: Dict[str, TierCounters],
        pin_memory: bool = False,
        max_pending_bytes: int = 1 << 30,
    ) -> None:
        self.meta = meta
        self.token_bytes = token_bytes
        self.costs = costs
        self.counters = counters
        self.pin_memory = pin_memory
        self.max_pending_bytes = max_pending_bytes
        self.pending_bytes = 0
        self._cv = threading.Condition()
        self._loads: deque = deque()
        self._writes: deque = deque()
        self._probes: deque = deque()  # stores to probe (their optional probe()), each at most once
        self._done_loads: List[LoadJob] = []
        self._done_writes: List[WriteJob] = []
        self._queued: Dict[tuple, int] = {}  # (block key, medium) -> its queued writes, until written
        self._queued_tails: Dict[tuple, list] = {}  # (tail key, medium) -> the queued tails' tokens
        self._busy = False
        self._closed = False
        self.on_load_done: Optional[Callable[[], None]] = None
        self._current: Any = None  # the job the thread runs (a fork's child runs it again)
        self._thread = threading.Thread(target=self._run, name="radixkv-kv-tiers", daemon=True)
        self._thread.start()
        _LIVE.add(self)

    def _after_fork(self) -> None:
        """In a forked child (``os.register_at_fork``): a fork copies only the thread that forked,
        so the child's copy has no I/O thread and its loads, writes and ``close`` waited forever.
        Start the child's own, over the queue as copied (the job the parent's thread was running
        queued again at its head, if the fork did not wait for it to end) and a fresh lock."""
        self._cv = threading.Condition()
        job, self._current, self._busy = self._current, None, False
        if isinstance(job, LoadJob):
            self._loads.appendleft(job)
        elif isinstance(job, WriteJob):
            self._writes.appendleft(job)
        if not self._closed:
            self._thread = threading.Thread(target=self._run, name="radixkv-kv-tiers", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ engine thread
    def submit_load(self, job: LoadJob) -> None:
        with self._cv:
            self._loads.append(job)
            self._cv.notify_all()

    def submit_write(self, job: WriteJob) -> bool:
        """Queue ``job``; False (dropped, counted) when the backlog is over ``max_pending_bytes``
        or the thread is closed."""
        with self._cv:
            if self._closed or self.pending_bytes + job.nbytes > self.max_pending_bytes:
                for s in job.stores:
                    self.counters[s.medium].write_dropped += len(job.keys)
                return False
            self.pending_bytes += job.nbytes
            self._count_pending(job, 1)
            self._mark_queued(job, 1)
            self._writes.append(job)
            self._cv.notify_all()
        return True

    def _count_pending(self, job: WriteJob, sign: int) -> None:
        """``write_pending`` of ``job``'s tiers, up (queued) or down (done); under the I/O lock."""
        n = len(job.keys) + (job.tail_key is not None)
        for s in job.stores:
            self.counters[s.medium].write_pending += sign * n

    def _mark_queued(self, job: WriteJob, sign: int) -> None:
        """Count ``job``'s blocks (and its tail, with its tokens) as queued for its media, or no
        longer; under the I/O lock."""
        for s in job.stores:
            for k in job.keys:
                n = self._queued.get((k, s.medium), 0) + sign
                if n:
                    self._queued[(k, s.medium)] = n
                else:
                    del self._queued[(k, s.medium)]
            if job.tail_key is not None:
                tails = self._queued_tails.setdefault((job.tail_key, s.medium), [])
                if sign > 0:
                    tails.append(job.tail_tokens)
                else:
                    tails.remove(job.tail_tokens)
                if not tails:
                    del self._queued_tails[(job.tail_key, s.medium)]

    def queued(self, key: Any, medium: str, want: Sequence[int] = ()) -> bool:
        """Whether a write of block ``key`` to ``medium`` is queued or being written (it is held
        there once this turns False); with ``want`` (token ids), whether a write of a tail under
        ``key`` sharing a first token with ``want`` is."""
        with self._cv:
            return self._queued_for(key, medium, want)

    def _queued_for(self, key: Any, medium: str, want: Sequence[int]) -> bool:
        if not want:
            return (key, medium) in self._queued
        return any(shared_len(t, want) for t in self._queued_tails.get((key, medium), ()))

    def _waits_for_writes(self, job: LoadJob) -> bool:
        """Whether a block ``job`` asks for, or a tail it could use, is still queued for a write
        (under the I/O lock)."""
        if not (self._queued or self._queued_tails):
            return False
        media = [s.medium for s in job.stores]
        b = BLOCK_TOKENS
        wants = [job.ahead[b * i : b * (i + 1)] for i in range(len(job.tail_keys))]
        return any(self._queued_for(k, m, ()) for k in job.keys for m in media) or any(
            self._queued_for(k, m, w) for k, w in zip(job.tail_keys, wants) if w for m in media
        )

    def submit_probe(self, store: Any) -> None:
        """Queue one ``store.probe()`` (a degraded store trying its backend again) unless one is
        queued for it already; run after the queued loads and writes."""
        with self._cv:
            if self._closed or any(p is store for p in self._probes):
                return
            self._probes.append(store)
            self._cv.notify_all()

    def wait_loads(self, jobs: Sequence[LoadJob], timeout: float) -> None:
        """Block the calling (engine) thread until every one of ``jobs`` is done or cancelled, or
        ``timeout`` seconds have passed (the I/O lock is released meanwhile)."""
        if jobs and timeout > 0:
            with self._cv:
                self._cv.wait_for(lambda: all(j.done or j.cancelled for j in jobs), timeout)

    def cancel_load(self, job: LoadJob) -> None:
        """Give up ``job`` (engine thread): not run if still queued, and dropped with the K/V it
        loaded if done (a finished load otherwise waits for the engine's next step, which an idle
        engine never runs)."""
        with self._cv:
            job.cancelled = True
            if job.done:
                self._done_loads = [j for j in self._done_loads if j is not job]

    def take_done(self) -> tuple:
        """``(loads, writes)`` finished since the last call."""
        with self._cv:
            loads, self._done_loads = self._done_loads, []
            writes, self._done_writes = self._done_writes, []
        return loads, writes

    def has_done_loads(self) -> bool:
        """Whether a finished load waits to be taken (:meth:`take_done`)."""
        return bool(self._done_loads)

    def idle(self) -> bool:
        with self._cv:
            return not (self._loads or self._writes or self._probes or self._busy)

    def drain(self, timeout: Optional[float] = None) -> bool:
        """Wait until every queued job has run (True), or ``timeout`` seconds passed (False)."""
        with self._cv:
            return self._cv.wait_for(lambda: not (self._loads or self._writes or self._probes or self._busy), timeout)

    def close(self, timeout: Optional[float] = None) -> bool:
        """Drain the writes (loads still queued are dropped), then stop the thread; idempotent.
        Returns whether everything queued was written. ``timeout`` bounds the whole of it (the
        drain and the thread's stop together). Called on the I/O thread itself (a garbage
        collection there finalizing its TierManager) it only stops it, after the queue."""
        if threading.current_thread() is self._thread:
            with self._cv:
                self._closed = True
                self._cv.notify_all()
            return False
        with self._cv:
            for job in self._loads:
                job.cancelled = True
            self._loads.clear()
        deadline = None if timeout is None else time.monotonic() + timeout
        drained = self.drain(timeout)
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return drained

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._closed or self._loads or self._writes or self._probes)
                if self._closed and not (self._loads or self._writes):
                    return
                if self._loads and not (self._writes and self._waits_for_writes(self._loads[0])):
                    job = self._loads.popleft()
                elif self._writes:  # a load waiting for queued writes runs after them
                    job = self._writes.popleft()
                else:
                    job = self._probes[0]  # left queued while it runs: no second probe of it
                self._busy = True
                self._current = job
            if not isinstance(job, (LoadJob, WriteJob)):
                self._probe(job)
                continue
            try:
                if isinstance(job, LoadJob):
                    if not job.cancelled:
                        self._load(job)
                else:
                    self._write(job)
            except Exception:  # noqa: BLE001 - a failing tier is a miss; the thread goes on
                logger.exception("KV tier I/O failed")
            with self._cv:
                self._busy, self._current = False, None
                if isinstance(job, LoadJob):
                    job.done = True
                    if not job.cancelled:
                        self._done_loads.append(job)
                else:
                    self.pending_bytes -= job.nbytes
                    self._count_pending(job, -1)
                    self._mark_queued(job, -1)
                    # NOTE: the stores hold copies now; a done write waits for the engine's next
                    # step (its events), which an idle engine never runs: keep no K/V with it
                    job.rows = job.rows.new_empty((0, *job.rows.shape[1:]))
                    self._done_writes.append(job)
                self._cv.notify_all()
            if isinstance(job, LoadJob) and self.on_load_done is not None:
                self.on_load_done()

    def _where(self, job: LoadJob) -> list:
        """The first store holding each block of ``job`` (None: none does)."""
        n = len(job.keys)
        where: list = [None] * n
        for store in job.stores:
            idx = [i for i in range(n) if where[i] is None]
            if not idx:
                break
            try:
                present = list(store.contains([job.keys[i] for i in idx]))
            except Exception:  # noqa: BLE001 - a store that fails is a miss
                logger.exception("KV tier %s: contains failed", store.medium)
                present = [False] * len(idx)
            c = self.counters[store.medium]
            with self._cv:
                c.lookups += len(idx)
                c.found += sum(bool(p) for p in present)
            for i, p in zip(idx, present):
                if p:
                    where[i] = store
        return where

    def _get(self, store: Any, job: LoadJob, idx: List[int]) -> list:
        """``store.get`` of blocks ``idx`` of ``job``, each checked (tokens, layout, length):
        the block, or None (missed, failed or rejected); timed and counted."""
        t0 = time.perf_counter()
        try:
            got = list(store.get([job.keys[i] for i in idx], [job.tokens[i] for i in idx]))
        except Exception:  # noqa: BLE001 - a store that fails is a miss
            logger.exception("KV tier %s: get failed", store.medium)
            got = [None] * len(idx)
        size = BLOCK_TOKENS * self.token_bytes
        out, bad = [], []
        for i, b in zip(idx, got):
            if b is not None and (
                tuple(b.tokens) != tuple(job.tokens[i])
                or bytes(b.meta) != self.meta
                or memoryview(b.payload).nbytes != size
            ):
                b = None
                bad.append(job.keys[i])
            out.append(b)
        dt = time.perf_counter() - t0
        ok = sum(b is not None for b in out)
        self.costs.note_load(store.medium, dt, ok)
        c = self.counters[store.medium]
        with self._cv:
            c.observe(dt)
            c.loaded += ok
            c.load_rejected += len(bad)
        _drop(store, bad)
        return out

    def _fetch(self, job: LoadJob, where: list, k: int) -> list:
        """Blocks ``0 .. k-1`` of ``job`` as ``(block, medium)``, None where no store gave it:
        each from the first store holding it, else (it failed there) from the stores after."""
        rank = {id(s): r for r, s in enumerate(job.stores)}
        got: list = [None] * k
        for r, store in enumerate(job.stores):
            idx = [i for i in range(k) if got[i] is None and rank[id(where[i])] <= r]
            if idx:
                for i, b in zip(idx, self._get(store, job, idx)):
                    if b is not None:
                        got[i] = (b, store.medium)
        return got

    def _probe(self, store: Any) -> None:
        try:
            store.probe()
        except Exception:  # noqa: BLE001 - a probe that fails leaves the store degraded
            logger.exception("KV tier probe failed")
        with self._cv:
            self._probes.popleft()
            self._busy, self._current = False, None
            self._cv.notify_all()

    def _load(self, job: LoadJob) -> None:
        where = self._where(job)
        run = next((i for i, s in enumerate(where) if s is None), len(where))
        k = self.costs.best_run([s.medium for s in where[:run]])
        for s in where[k:run]:
            with self._cv:
                self.counters[s.medium].load_skipped += 1
        got = self._fetch(job, where, k) if k else []
        n = next((i for i, g in enumerate(got) if g is None), len(got))
        tail = self._tail(job, n) if n == run else None
        c = 0 if tail is None else tail[1]
        tb = self.token_bytes
        rows = torch.empty((BLOCK_TOKENS * n + c, tb), dtype=torch.uint8, pin_memory=self.pin_memory and n + c > 0)
        view = rows.numpy()
        for i in range(n):
            block = got[i][0]
            view[BLOCK_TOKENS * i : BLOCK_TOKENS * (i + 1)] = np.frombuffer(block.payload, np.uint8).reshape(
                BLOCK_TOKENS, tb
            )
        if tail is not None:
            view[BLOCK_TOKENS * n :] = np.frombuffer(tail[0].payload, np.uint8).reshape(-1, tb)[:c]
            job.tail_medium = tail[2]
        job.rows, job.media = rows, [g[1] for g in got[:n]]

    def _tail(self, job: LoadJob, n: int) -> Optional[tuple]:
        """``(block, c, medium)``: the tail after the ``n`` leading blocks of ``job`` from the
        first tier (where loading saves time) whose record shares ``c > 0`` leading tokens with
        the request's next ones, checked (layout, length); None when no tier has one."""
        want = tuple(job.ahead[BLOCK_TOKENS * n : BLOCK_TOKENS * (n + 1)])
        if n >= len(job.tail_keys) or not want:
            return None
        for store in job.stores:
            if not self.costs.saves(store.medium):
                continue
            t0 = time.perf_counter()
            try:
                b = store.get([job.tail_keys[n]], [None])[0]
            except Exception:  # noqa: BLE001 - a store that fails is a miss
                logger.exception("KV tier %s: get failed", store.medium)
                b = None
            if b is None:
                continue
            r = len(b.tokens)
            c = shared_len(b.tokens, want)
            ok = bytes(b.meta) == self.meta and memoryview(b.payload).nbytes == r * self.token_bytes
            dt = time.perf_counter() - t0
            counters = self.counters[store.medium]
            with self._cv:
                counters.observe(dt)
                counters.load_rejected += not ok
                counters.tails_loaded += ok and c > 0
                counters.tail_tokens += c if ok else 0
            if ok:
                self.costs.note_load(store.medium, dt, 1)
                if c:
                    return b, c, store.medium
            else:
                _drop(store, [job.tail_keys[n]])
        return None

    def _write(self, job: WriteJob) -> None:
        """Put ``job`` in each store, deepest first (the tail, then the blocks from the last):
        a lookup reads a sequence from its first block on, so the blocks written last, the most
        recently used, must be its head; the head the pool held is marked used before the puts
        (so they do not evict it) and after (so it stays more recent than what they added)."""
        view = job.rows.numpy()
        n = len(job.keys)
        for store in job.stores:
            try:
                touch = getattr(store, "touch", None)
                head = job.touch_keys[::-1]  # deepest first too: block 0 the most recent
                if head and touch is not None:
                    touch(head)  # NOTE: before the puts evict: the head is in use
                if job.tail_key is not None:
                    tail = Block(job.tail_tokens, view[BLOCK_TOKENS * n :].tobytes(), self.meta)
                    store.put([job.tail_key], [tail], replace=True)
                present = list(store.contains(job.keys)) if n else []
                idx = [i for i in reversed(range(n)) if not present[i]]
                if idx:
                    blocks = [
                        Block(
                            tuple(job.tokens[i]), view[BLOCK_TOKENS * i : BLOCK_TOKENS * (i + 1)].tobytes(), self.meta
                        )
                        for i in idx
                    ]
                    store.put([job.keys[i] for i in idx], blocks)
                if head and touch is not None and (idx or job.tail_key is not None):
                    touch(head)
                job.stored.append(store.medium)
            except Exception:  # noqa: BLE001 - a store that fails loses the write (counted by it)
                logger.exception("KV tier %s: put failed", store.medium)


def _drop(store: Any, keys: list) -> None:
    """Have ``store`` remove the records of ``keys``, which it returned but the engine refused
    (tokens, layout or length: a forged or damaged record that passed the store's checks): a miss,
    dropped and counted (``load_rejected``), so that the write of the block computed instead
    stores a good one (kept, each read renewed it and each write skipped the key it held). A
    store without ``drop`` keeps them."""
    drop = getattr(store, "drop", None)
    if keys and drop is not None:
        try:
            drop(keys)
        except Exception:  # noqa: BLE001 - a store that fails keeps them (a miss each time)
            logger.exception("KV tier %s: drop failed", store.medium)


_LIVE: "weakref.WeakSet[TierIO]" = weakref.WeakSet()  # every TierIO, for a fork's child to restart
_FORKING: List[TierIO] = []  # the TierIOs held across a fork (their locks taken, no job running)
_FORK_WAIT_S = 10.0  # how long a fork waits for each I/O thread's job in progress


def _before_fork() -> None:
    """Take every TierIO's lock once its thread is between two jobs, so the child's copy holds no
    lock of a store (a disk write's) that a job in progress held: the child's restarted thread
    waited on it forever."""
    _FORKING[:] = list(_LIVE)
    for io in _FORKING:
        io._cv.acquire()
        io._cv.wait_for(lambda io=io: not io._busy, _FORK_WAIT_S)


def _after_fork_in_parent() -> None:
    for io in _FORKING:
        io._cv.release()
    _FORKING.clear()


def _after_fork_in_child() -> None:
    for io in _FORKING:
        io._cv.release()
        io._after_fork()
    _FORKING.clear()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)
