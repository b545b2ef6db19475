"""Publishing an engine's cache events to routers: batches of plain records, and snapshots.

A :class:`CacheEventPublisher` subscribes to the engine's cache events
(:class:`~radixkv.engine.events.CacheInserted`, ``CacheEvicted``, ``CacheReset``) and buffers
them as plain tuples (no engine type crosses a process; the router side,
:mod:`radixkv.router.index`, documents the same format and never imports the engine):

* ``("insert", seq, namespace, first_block, digests)``, and for blocks stored in a KV tier below
  the pool ``("insert", seq, namespace, first_block, digests, medium)`` (``medium``: ``"host"``,
  ``"disk"`` or ``"remote"``, :attr:`CacheInserted.medium <radixkv.engine.events.CacheInserted>`)
* ``("evict", seq, namespace, digests | None)``
* ``("reset", seq)``

``namespace`` is the namespace's stable serialization (bytes,
:func:`radixkv.namespace.namespace_key`; ``Namespace.from_bytes`` reads it back): the same in
every process, as the digests are, which it seeds.

:meth:`CacheEventPublisher.drain` hands the buffered records over as one batch
``{"epoch", "events", "dropped"}`` (any thread); ``epoch`` is a fresh id per publisher, so a
restarted replica is told apart. The buffer is bounded (``max_events``): on overflow the oldest
records are dropped and the next batch says ``dropped``, and the consumer resyncs from
:meth:`CacheEventPublisher.snapshot` (``{"epoch", "seq", "blocks"}``: the digests of every fully
cached block after event ``seq``), taken on the engine's driver thread, which also empties the
buffer (every buffered record is covered by it). Cost on the engine: one tuple and one deque
append per cache event under a lock (bench/events_overhead.py measures the step time).
"""

from __future__ import annotations

import threading
import uuid
from collections import deque
from typing import Any, Callable, Optional

from radixkv.engine.events import CacheEvicted, CacheInserted, CacheReset, Event, EventBus
from radixkv.namespace import namespace_key

__all__ = ["CacheEventPublisher", "cache_snapshot"]

CACHE_EVENTS = (CacheInserted, CacheEvicted, CacheReset)


def cache_snapshot(engine: Any, epoch: str = "") -> dict:
    """``{"epoch", "seq", "blocks"}`` of ``engine``'s prefix cache now (driver thread): ``blocks``
    the digests of every fully cached 16-token block, None when the cache cannot list them (hash
    blocks, no cache), ``seq`` the last cache event they include."""
    cache = engine.kv.cache
    lister = getattr(cache, "block_digests", None)
    blocks = list(lister()) if callable(lister) and cache.shares_prefixes else None
    return {"epoch": epoch, "seq": engine.kv.event_seq, "blocks": blocks}


class CacheEventPublisher:
    """Buffers an engine's cache events as plain records for :meth:`drain` (module docstring).

    Args:
        max_events: buffer bound (records); beyond it the oldest are dropped and the next batch
            is marked ``dropped``.
        epoch: the id batches carry (default: a fresh uuid).

    Attributes:
        wakeup: a ``threading.Event`` set whenever a record is buffered (a pusher waits on it).
        published: records handed out by :meth:`drain` so far; ``dropped_events``: records lost
            to overflow.
    """

    def __init__(self, max_events: int = 100_000, epoch: Optional[str] = None) -> None:
        if not isinstance(max_events, int) or max_events < 1:
            raise ValueError(f"max_events must be an int >= 1, got {max_events!r}")
        self.max_events = max_events
        self.epoch = epoch or uuid.uuid4().hex
        self.wakeup = threading.Event()
        self.published = 0
        self.dropped_events = 0
        self._buf: deque = deque()
        self._dropped = False
        self._lock = threading.Lock()

    def attach(self, bus: EventBus) -> Callable[[], None]:
        """Subscribe to ``bus``'s cache events (on the engine's driver thread, or through
        ``AsyncLLM.subscribe(publisher.on_event, CACHE_EVENTS)``); returns the unsubscribe."""
        return bus.subscribe(self.on_event, CACHE_EVENTS)

    def on_event(self, ev: Event) -> None:
        """The subscriber (driver thread): buffer one record."""
        if isinstance(ev, CacheInserted):
            rec: tuple = ("insert", ev.seq, namespace_key(ev.namespace), ev.first_block, ev.block_digests)
            if ev.medium != "device":
                rec += (ev.medium,)
        elif isinstance(ev, CacheEvicted):
            rec = ("evict", ev.seq, namespace_key(ev.namespace), ev.block_digests)
        elif isinstance(ev, CacheReset):
            rec = ("reset", ev.seq)
        else:
            return
        with self._lock:
            if len(self._buf) >= self.max_events:
                self._buf.popleft()
                self._dropped = True
                self.dropped_events += 1
            self._buf.append(rec)
        self.wakeup.set()

    def pending(self) -> int:
        """Records buffered now."""
        return len(self._buf)

    def drain(self, max_events: Optional[int] = None) -> Optional[dict]:
        """The buffered records (at most ``max_events``, oldest first) as one batch, or None when
        there is nothing to say. Any thread."""
        with self._lock:
            if not self._buf and not self._dropped:
                self.wakeup.clear()
                return None
            k = len(self._buf) if max_events is None else min(max_events, len(self._buf))
            events = [self._buf.popleft() for _ in range(k)]
            dropped, self._dropped = self._dropped, False
            if not self._buf:
                self.wakeup.clear()
        self.published += len(events)
        return {"epoch": self.epoch, "events": events, "dropped": dropped}

    def snapshot(self, engine: Any) -> dict:
        """A snapshot of ``engine``'s cache to resync from (driver thread only): every buffered
        record is covered by it and dropped, so later batches continue right after it."""
        with self._lock:
            snap = cache_snapshot(engine, self.epoch)
            self._buf.clear()
            self._dropped = False
            self.wakeup.clear()
        return snap
