"""What a router knows of one replica's prefix cache, from its cache events (plain data).

The wire format (produced by :mod:`radixkv.engine.publish` on the replica; nothing here imports
the engine):

* a **batch** is ``{"epoch": str, "events": [record, ...], "dropped": bool}``: ``epoch`` names one
  engine instance (a restarted replica has a new one), ``dropped`` says the publisher's buffer
  overflowed and lost events (the consumer must resync);
* a **record** is a tuple, in ``seq`` order, ``seq`` numbering every cache event of the engine
  from 1 without gaps (:mod:`radixkv.engine.events`):
  ``("insert", seq, namespace, first_block, digests)`` (blocks that became fully cached),
  ``("insert", seq, namespace, first_block, digests, medium)`` (blocks stored in a KV tier below
  the pool: ``"host"`` or ``"disk"`` of that replica, or the ``"remote"`` tier all replicas
  share; docs/tiers.md),
  ``("evict", seq, namespace, digests | None)`` (blocks that stopped being so; None: the engine's
  cache cannot tell, e.g. hash blocks -> resync), ``("reset", seq)`` (the cache was emptied);
  ``namespace`` is the namespace's stable serialization (bytes,
  :func:`radixkv.namespace.namespace_key`), carried for consumers that group by it; the view
  needs only the digests, which it seeds;
* a **snapshot** is ``{"epoch": str, "seq": int, "blocks": [digest, ...] | None}``: every fully
  cached 16-token block of the engine's tree after its event ``seq`` (None: the cache cannot list
  them; the view then stays empty and unsynced).

Digests are the chained 16-token block digests of :mod:`radixkv.cache.digests`: a digest names
a block and its whole prefix in its namespace, so the longest cached prefix of a request is the
longest run of its leading block digests found in the view.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Iterable, Optional

__all__ = ["CacheView"]


class CacheView:
    """One replica's fully cached blocks, mirrored from its events.

    Args:
        max_tiered: how many digests of blocks stored in KV tiers to remember (least recently
            stored forgotten first: the tiers evict without telling).

    Attributes:
        epoch: the engine instance the view follows (None before its first batch).
        seq: the last event applied (0: none).
        blocks: the set of block digests held (in the replica's pool).
        tiered: digests of blocks stored in the replica's KV tiers (insertion order), by medium:
            ``{"host": OrderedDict, ...}``; a consumer merges the shared ``"remote"`` ones of every
            replica. A new epoch (the replica restarted) forgets its ``"host"`` ones.
        synced: False after a gap, an unknown eviction or a new epoch that did not start at
            ``seq`` 1, until a snapshot is loaded (the blocks then are a stale guess).
        resyncs: snapshots loaded so far.
    """

    __slots__ = ("epoch", "seq", "blocks", "synced", "resyncs", "tiered", "max_tiered")

    def __init__(self, max_tiered: int = 1 << 18) -> None:
        self.epoch: Optional[str] = None
        self.seq = 0
        self.blocks: set[bytes] = set()
        self.synced = True
        self.resyncs = 0
        self.tiered: dict[str, OrderedDict] = {}
        self.max_tiered = max_tiered

    def __contains__(self, digest: bytes) -> bool:
        return digest in self.blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def apply(self, batch: dict) -> bool:
        """Apply one batch; returns True when the consumer must ask for a snapshot (a gap, lost
        events, an eviction that names no blocks, or a new epoch not starting at seq 1).

        Raises:
            ValueError: a record of an unknown kind.
        """
        events: Iterable[Any] = batch.get("events", ())
        epoch = batch.get("epoch")
        if epoch != self.epoch:
            self.epoch, self.seq, self.blocks, self.synced = epoch, 0, set(), True
            self._new_process()
        if batch.get("dropped"):
            self.synced = False
        if not self.synced:
            return True
        for ev in events:
            kind, seq = ev[0], ev[1]
            if seq <= self.seq:
                continue  # already covered (by a snapshot taken after it)
            if seq != self.seq + 1:
                self.synced = False
                return True
            self.seq = seq
            if kind == "insert" and len(ev) > 5:
                self._store(ev[5], ev[4])
            elif kind == "insert":
                self.blocks.update(ev[4])
            elif kind == "evict":
                if ev[3] is None:
                    self.synced = False
                    return True
                self.blocks.difference_update(ev[3])
            elif kind == "reset":
                self.blocks.clear()
            else:
                raise ValueError(f"unknown cache event record {kind!r}")
        return False

    def _store(self, medium: str, digests: Iterable[bytes]) -> None:
        held = self.tiered.setdefault(medium, OrderedDict())
        for d in digests:
            held[d] = None
            held.move_to_end(d)
        while len(held) > self.max_tiered:
            held.popitem(last=False)

    def _new_process(self) -> None:
        """Another engine instance (a new epoch): its host RAM tier starts empty (its disk
        directory and the remote tier keep what was stored)."""
        self.tiered.pop("host", None)

    def load_snapshot(self, snap: dict) -> None:
        """Replace the view by a snapshot (then later batches continue from ``snap["seq"]``)."""
        if snap.get("epoch") != self.epoch:
            self._new_process()
        self.epoch = snap.get("epoch")
        self.seq = int(snap["seq"])
        blocks = snap.get("blocks")
        self.blocks = set(blocks) if blocks is not None else set()
        self.synced = blocks is not None
        self.resyncs += 1

    def prefix_blocks(self, digests: list[bytes], extra: Optional[dict] = None) -> int:
        """Leading blocks of ``digests`` held (in the view, or in ``extra``, a digest-keyed
        mapping of blocks expected soon)."""
        n = 0
        blocks = self.blocks
        for d in digests:
            if d in blocks or (extra is not None and d in extra):
                n += 1
            else:
                break
        return n
