"""`TierManager`: the KV tiers below the pool (host RAM, local disk, a shared Redis), seen from the
engine: which blocks to look up and load for a request, which to write and when, what it cost.

Like the pin table and the in-batch sharing index, it keeps its own bookkeeping beside the
:class:`~radixkv.engine.kv_manager.KVManager` and moves no slot: the KV manager locks a
request's cached prefix before a lookup, copies a finished load into new slots and inserts it
into the prefix cache as if computed, and hands this class the slots whose K/V to write.

The unit is the 16-token block of :mod:`radixkv.cache.digests`; a block's key is (model
fingerprint, namespace, chained digest) (:func:`model_fingerprint`, :class:`~radixkv.tiers.BlockKey`),
so another model, dtype or namespace never reads it; the partial block after a sequence's whole
blocks is kept as a *tail* record, named by the tail digest of the block before it
(:func:`~radixkv.cache.digests.tail_digest`) and served for the prefix its tokens share with a
request's (docs/tiers.md, "Tails"). A process-local namespace (no stable
serialization) is kept in the host tier only. The stores (``radixkv.tiers``) verify every block
they return; :mod:`radixkv.engine.tier_io` checks it once more and runs all store I/O on its
thread. Write policy per tier (``EngineConfig.kv_tier_write_policy``): write-through copies a
block's K/V out when it enters the pool, write-back when the pool evicts it (the radix cache
tells which pieces it evicts; with ``prefix_cache="hash"`` every tier is write-through).
Pending writes drain at :meth:`TierManager.close` (``LLM.close``, ``AsyncLLM.shutdown``, context
exits) and at interpreter exit.
"""

from __future__ import annotations

import hashlib
import logging
import os
import weakref
from array import array
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import torch

from radixkv.cache.digests import BLOCK_TOKENS, block_digests, namespace_seed, tail_digest
from radixkv.config import TIER_MEDIA
from radixkv.engine.tier_io import (
    CostModel,
    LoadJob,
    TierCounters,
    TierIO,
    WriteJob,
    lookup_stop,
    merge_spans,
    shared_len,
)
from radixkv.memory.fit import free_memory_bytes
from radixkv.memory.kv_io import gather_rows, layout_of
from radixkv.namespace import Namespace, namespace_key
from radixkv.tiers import BlockKey
from radixkv.tiers.disk_files import DIR_MODE

__all__ = ["TierHold", "TierManager", "model_fingerprint", "build_stores", "check_budgets", "check_settings"]

logger = logging.getLogger(__name__)

SHARED_MEDIA = ("disk", "remote")
"""Tiers other processes read: a process-local namespace never goes there."""


def model_fingerprint(
    weights: bytes, compute_dtype: Any, kv_dtype: Any, quantization: Any, layout_meta: bytes, producer: bytes = b""
) -> bytes:
    """16 bytes naming what a block's K/V depends on besides its tokens: the weights
    (:func:`radixkv.models.fingerprint.weights_digest`), the compute dtype, the K/V dtype, the
    quantization, the pool's per-token layout (:class:`~radixkv.memory.kv_io.KVLayout`: dtypes
    and shapes per slot; not the page size) and what computes the K/V (:func:`kv_producer`)."""
    h = hashlib.blake2b(b"radixkv-kv-fingerprint-1", digest_size=16)
    parts = (weights, str(compute_dtype).encode(), str(kv_dtype).encode(), str(quantization).encode(), layout_meta)
    for part in (*parts, producer):
        h.update(len(part).to_bytes(8, "big") + part)
    return h.digest()


def kv_producer(runner: Any) -> bytes:
    """What computes a block's K/V bits besides the weights and dtypes: the device type (with a
    GPU's compute capability), the attention backend (layer l's attention output feeds layer l+1's
    K/V), and whether the native CPU kernels run the forward (their bits are the same on every ISA
    and row count, but not torch's). Two engines that differ here compute other bits for the same
    tokens, so they never load each other's blocks (a loaded block must be the bits this engine
    would compute: greedy outputs identical with and without tiers)."""
    dev = getattr(runner, "device", None)
    kind = str(getattr(dev, "type", dev))
    if kind == "cuda":
        import torch

        kind += ":sm%d%d" % torch.cuda.get_device_capability(dev)
    backend = getattr(getattr(runner, "attn_backend", None), "name", None)
    native = (getattr(runner, "row_exact", None), getattr(runner, "decode_step", None) is not None)
    return f"{kind}/{backend}/{native}".encode()


def check_budgets(cfg: Any, token_bytes: int, meta: bytes = b"") -> None:
    """Refuse a host or disk tier whose budget holds no block: a block is stored as its record,
    ``BLOCK_TOKENS`` tokens of ``token_bytes`` bytes of K/V each (the pool's) with its token ids
    and layout ``meta`` (the host tier's :func:`~radixkv.tiers.block_nbytes`; on disk the codec's
    :func:`~radixkv.tiers.encoded_size`, header, padding and checksum included). A smaller budget
    would reject every write: a tier that never holds anything, silently.

    Raises:
        ValueError: naming ``host_cache_bytes`` / ``disk_cache_bytes`` and one block's bytes there.
    """
    from radixkv.tiers import Block, block_nbytes, encoded_size

    block = BLOCK_TOKENS * token_bytes
    sample = Block((0,) * BLOCK_TOKENS, bytes(block), meta)
    budgets = [("host_cache_bytes", cfg.host_cache_bytes, block_nbytes(sample))] if cfg.host_cache_bytes else []
    if cfg.disk_cache_dir is not None:
        budgets.append(("disk_cache_bytes", cfg.disk_cache_bytes, encoded_size(sample)))
    for name, budget, need in budgets:
        if budget < need:
            raise ValueError(
                f"{name} {budget} holds no block: one block of this model is {need} bytes in that tier "
                f"({BLOCK_TOKENS} tokens x {token_bytes} bytes of K/V and {need - block} of its record); "
                "give at least that"
            )


def check_settings(cfg: Any) -> None:
    """Refuse a ``host_cache_bytes`` past the host memory available (``MemAvailable``), a
    malformed ``remote_cache_url`` or an unwritable ``disk_cache_dir`` at once (the engine calls
    it before it loads the model; the stores check the last two again when built).

    Raises:
        ValueError: naming the field and what is wrong.
    """
    free = free_memory_bytes("cpu")
    host = getattr(cfg, "host_cache_bytes", None)
    if host and free is not None and host > free:
        raise ValueError(
            f"host_cache_bytes {host} is more than the {free} bytes of host memory available "
            "(the host tier would fill it until the process is killed); give less"
        )
    if cfg.remote_cache_url is not None:
        from radixkv.tiers import parse_redis_url

        parse_redis_url(cfg.remote_cache_url)
    if cfg.disk_cache_dir is not None:
        path = os.path.abspath(os.path.expanduser(cfg.disk_cache_dir))
        try:
            os.makedirs(path, mode=DIR_MODE, exist_ok=True)
        except OSError as e:
            raise ValueError(f"disk_cache_dir {cfg.disk_cache_dir!r} is not a writable directory: {e}") from None
        if not os.access(path, os.W_OK | os.X_OK):
            raise ValueError(f"disk_cache_dir {cfg.disk_cache_dir!r} is not a writable directory: permission denied")


def build_stores(cfg: Any, fingerprint: bytes) -> list:
    """The stores ``cfg`` configures (``host_cache_bytes``, ``disk_cache_dir`` +
    ``disk_cache_bytes``, ``remote_cache_url``), in tier order; [] when none (no import then).
    ``fingerprint``: the model's (a remote store's ``delete_all`` deletes only its keys).

    Raises:
        ValueError: an unwritable ``disk_cache_dir`` or a malformed ``remote_cache_url`` (the
            stores name the field).
    """
    if not cfg.kv_tiers:
        return []
    from radixkv.tiers import make_stores

    return make_stores(
        cfg.host_cache_bytes,
        cfg.disk_cache_dir,
        cfg.disk_cache_bytes,
        cfg.remote_cache_url,
        fingerprint=fingerprint,
    )


@dataclass(eq=False)
class TierHold:
    """A waiting request's tier state (``Request.tier``), owned by the KV manager.

    Attributes:
        job: its :class:`~radixkv.engine.tier_io.LoadJob` from the lookup until it is installed
            (or given up).
        node: the cache node the KV manager locked for it once its load was installed (until it
            is admitted), else None.
        held: tokens of that install (counted in :attr:`TierManager.held_tokens`).
        start: tokens of its prefix in the pool at the lookup, then the end of what was
            installed (fewer in the pool later: looked up again).
        limit: the most tokens it may reuse (page-floored).
        spans: ``(lo, hi, medium)`` of the positions installed from the tiers.
    """

    job: Optional[LoadJob] = None
    node: Any = None
    held: int = 0
    start: int = 0
    limit: int = 0
    spans: List[tuple] = field(default_factory=list)

    def by_tier(self, upto: int) -> Dict[str, int]:
        """Tokens of ``[0, upto)`` installed from each tier."""
        out: Dict[str, int] = {}
        for lo, hi, m in self.spans:
            n = min(hi, upto) - lo
            if n > 0:
                out[m] = out.get(m, 0) + n
        return out


def _close_stores(io: TierIO, stores: Sequence[Any], timeout: Optional[float]) -> bool:
    """Drain ``io``'s queued writes, stop its thread and close ``stores`` (idempotent; not the
    stores while writes are still queued after ``timeout``: False then): what
    :meth:`TierManager.close` does, and what runs when a TierManager is garbage collected or the
    interpreter exits without it closed (``weakref.finalize``: it holds no TierManager, so an
    engine dropped without ``close()`` is freed, its queued writes finished first)."""
    done = io.close(timeout)
    if not done:  # writes still queued: the stores stay open for them (a later close closes them)
        return False
    for s in stores:
        try:
            s.close()
        except Exception:  # noqa: BLE001 - closing: report, go on with the others
            logger.exception("closing the %s KV tier failed", s.medium)
    return done


class TierManager:
    """The tiers of one engine (module docstring).

    Args:
        stores: :class:`~radixkv.tiers.PageStore` s (at most one per medium), any order.
        pool: the engine's KV pool (blocks are gathered from it here; the KV manager scatters).
        fingerprint: :func:`model_fingerprint` of the engine's model and pool.
        write_policy: ``{medium: "write_through" | "write_back"}``.
        write_back_ok: the prefix cache reports what it evicts (else write-back tiers are written
            through).
        max_pending_bytes: bound on the bytes of writes queued for the I/O thread.

    Attributes:
        costs: the :class:`~radixkv.engine.tier_io.CostModel` (load vs prefill per token).
        held_tokens: tokens installed from the tiers and locked for waiting requests.
    """

    def __init__(
        self,
        stores: Sequence[Any],
        pool: Any,
        fingerprint: bytes,
        write_policy: Dict[str, str],
        *,
        write_back_ok: bool = True,
        max_pending_bytes: int = 1 << 30,
    ) -> None:
        order = {m: i for i, m in enumerate(TIER_MEDIA)}
        self.stores = sorted(stores, key=lambda s: order.get(s.medium, len(order)))
        media = [s.medium for s in self.stores]
        if len(set(media)) != len(media) or any(m not in order for m in media):
            raise ValueError(f"KV tiers: one store per medium of {TIER_MEDIA}, got {media}")
        self.pool = pool
        self.layout = layout_of(pool)
        self.fingerprint = fingerprint
        back = {m for m, p in write_policy.items() if p == "write_back"} if write_back_ok else set()
        self.through = [s for s in self.stores if s.medium not in back]
        self.back = [s for s in self.stores if s.medium in back]
        self.costs = CostModel()
        self.counters = {s.medium: TierCounters() for s in self.stores}
        pin = torch.device(getattr(pool, "device", "cpu")).type == "cuda"
        self.io = TierIO(self.layout.meta, self.layout.token_bytes, self.costs, self.counters, pin, max_pending_bytes)
        self.held_tokens = 0
        self._closed = False
        # the close when this manager is collected, or at the interpreter's exit (whichever first)
        self._finalizer = weakref.finalize(self, _close_stores, self.io, tuple(self.stores), 60.0)

    @property
    def media(self) -> tuple:
        """The tiers, in lookup order."""
        return tuple(s.medium for s in self.stores)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (nothing is written or loaded since)."""
        return self._closed

    @property
    def writes_back(self) -> bool:
        """Whether some tier is written when the pool evicts."""
        return bool(self.back)

    def _stores_for(self, namespace: Optional[Namespace], stores: Sequence[Any]) -> list:
        """``stores`` a block of ``namespace`` may go to (a process-local one: host only)."""
        if namespace is None or namespace.persistable:
            return list(stores)
        return [s for s in stores if s.medium not in SHARED_MEDIA]

    def _keys(self, namespace: Optional[Namespace], tokens: Any, first: int, stop: int) -> tuple:
        """``(keys, token tuples, digests, tail keys, head digests)`` of blocks ``[first, stop)``
        of ``tokens`` (ids, or their int32 bytes); ``tail keys[i]``: the key of the tail after
        block ``first + i - 1`` (``stop - first + 1`` of them); ``head digests``: those of blocks
        ``[0, first)`` (the chain is computed from block 0 either way)."""
        if isinstance(tokens, (bytes, bytearray)):
            tokens = array("i", tokens)
        ns = namespace_key(namespace)
        every = block_digests(tokens, namespace, 0, stop)
        digests = every[first:]
        keys = [BlockKey(self.fingerprint, ns, d) for d in digests]
        toks = [tuple(tokens[b * BLOCK_TOKENS : (b + 1) * BLOCK_TOKENS]) for b in range(first, stop)]
        before = every[first - 1] if first else namespace_seed(namespace)
        tails = [BlockKey(self.fingerprint, ns, tail_digest(d)) for d in [before] + digests]
        return keys, toks, digests, tails, every[:first]

    # ------------------------------------------------------------------ loads
    def plan(
        self, namespace: Optional[Namespace], tokens: Sequence[int], start: int, limit: int, owner: Any = None
    ) -> Optional[LoadJob]:
        """Start looking up the blocks after the ``start`` tokens the pool holds, up to position
        ``limit`` (page-floored by the caller; the block ``limit`` falls in too when ``tokens``
        has all of it: :func:`~radixkv.engine.tier_io.lookup_stop`), then the tail after the
        last of them the tiers hold, for ``owner``: a :class:`LoadJob` submitted to the I/O
        thread, or None when no tier can serve a token there (the local tiers hold neither the
        first block nor the tail before it, and no write of them is queued; with a remote tier
        the I/O thread always asks)."""
        first, stop = start // BLOCK_TOKENS, lookup_stop(len(tokens), limit)
        stores = self._stores_for(namespace, self.stores)
        if self._closed or limit <= start or not stores:
            return None
        keys, toks, _, tails, _ = self._keys(namespace, tokens, first, stop)
        ahead = tuple(tokens[BLOCK_TOKENS * first : limit])
        if all(s.medium != "remote" for s in stores):
            probe = [(k, ()) for k in keys[:1]] + [(tails[0], ahead[:BLOCK_TOKENS])]
            if not any(self.io.queued(k, s.medium, w) or _contains_one(s, k) for s in stores for k, w in probe):
                for s in stores:
                    self.counters[s.medium].lookups += len(keys[:1])
                return None
        job = LoadJob(keys, toks, first, stores, owner, tail_keys=tails, ahead=ahead)
        self.io.submit_load(job)
        return job

    def take_finished(self) -> tuple:
        """``(loads, writes)``: the :class:`LoadJob` s and :class:`WriteJob` s the I/O thread
        finished since the last call (cancelled loads excluded)."""
        return self.io.take_done()

    def served(self, spans: Dict[str, int]) -> None:
        """Count tokens the tiers served to a request at its first admission."""
        for m, n in spans.items():
            if m in self.counters:
                self.counters[m].served_tokens += n

    # ------------------------------------------------------------------ writes
    def write(
        self,
        policy: str,
        namespace: Optional[Namespace],
        tokens: Sequence[int],
        first: int,
        stop: int,
        slots: Any,
        skip: Sequence[str] = (),
        tail: int = 0,
        touch_own: bool = False,
    ) -> bool:
        """Copy the K/V of blocks ``[first, stop)`` of ``tokens`` and of the ``tail`` (0 to 15)
        tokens after them (their pool ``slots``, one per token of ``[16 first, 16 stop +
        tail)``) out of the pool now and queue their write to the tiers with ``policy``
        ("write_through" or "write_back"), except the media in ``skip``. The tail is stored
        under the key of the tail after block ``stop - 1``, replacing the one held there.
        Written through, the blocks before ``first`` (the head the pool held) are marked used
        in the stores: a head the pool keeps is never read back from a tier, and would
        otherwise be the first block each tier evicts, with it every block under it.
        ``touch_own``: the blocks a store holds already are marked used too (deepest first), not
        only skipped. False when the write was dropped (the backlog over its bound, or closed)."""
        if self._closed or (stop <= first and not tail):
            return not self._closed
        stores = self.through if policy == "write_through" else self.back
        stores = [s for s in self._stores_for(namespace, stores) if s.medium not in skip]
        if not stores:
            return True
        if isinstance(tokens, (bytes, bytearray)):
            tokens = array("i", tokens)
        rows = gather_rows(self.pool, slots)
        keys, toks, digests, tails, head = self._keys(namespace, tokens, first, stop)
        job = WriteJob(namespace, keys, toks, digests, first, rows, stores)
        if tail:
            end = BLOCK_TOKENS * stop
            job.tail_key, job.tail_tokens = tails[-1], tuple(tokens[end : end + tail])
        if first and policy == "write_through":
            ns = namespace_key(namespace)
            job.touch_keys = [BlockKey(self.fingerprint, ns, d) for d in head]
        if touch_own:
            job.touch_keys = job.touch_keys + list(keys)
        return self.io.submit_write(job)

    # ------------------------------------------------------------------ inspection
    def where(
        self, namespace: Optional[Namespace], tokens: Sequence[int], start: int, limit: int, page_size: int = 1
    ) -> List[tuple]:
        """``(lo, hi, medium)`` spans of the positions after ``start`` that the tiers hold now
        (the first tier holding each block; up to the first block none holds, ``limit`` at most;
        then the part of the tail after those blocks that the first tier holding one shares with
        ``tokens``), ending on a ``page_size`` boundary as a load is installed. Asks the stores on
        this thread (``explain``: a dry run, nothing loaded; a tail is read to compare its tokens)."""
        first, stop = start // BLOCK_TOKENS, lookup_stop(len(tokens), limit)
        stores = self._stores_for(namespace, self.stores)
        if limit <= start or not stores:
            return []
        keys, _, _, tails, _ = self._keys(namespace, tokens, first, stop)
        where: list = [None] * len(keys)
        for s in stores:
            idx = [i for i, w in enumerate(where) if w is None]
            try:
                present = list(s.contains([keys[i] for i in idx])) if idx else []
            except Exception:  # noqa: BLE001 - a failing tier holds nothing
                present = [False] * len(idx)
            for i, p in zip(idx, present):
                if p:
                    where[i] = s.medium
        run = next((i for i, m in enumerate(where) if m is None), len(where))
        at = BLOCK_TOKENS * (first + run)
        b = BLOCK_TOKENS
        found = [(b * (first + i), min(limit, b * (first + i + 1)), m) for i, m in enumerate(where[:run])]
        c, m = _peek_tail(stores, tails[run], tokens[at:limit])
        if c:
            found.append((at, at + c, m))
        end = (found[-1][1] if found else 0) // page_size * page_size  # what an install keeps
        return merge_spans(start, [(lo, min(hi, end), m) for lo, hi, m in found])

    def stats(self) -> Dict[str, Dict[str, Any]]:
        """Per tier: the store's ``stats()`` (hits, misses, blocks / bytes read and written,
        corrupt, errors, degraded), the engine side's counters (:class:`TierCounters`), its
        ``used_bytes`` / ``capacity_bytes`` and the cost model's seconds per token to load from
        it and to prefill (None until measured). A degraded store with a ``probe`` method (the
        remote one) gets one queued on the I/O thread, so a later call sees it recover without a
        request having to use it (``/health`` of an idle replica)."""
        out: Dict[str, Dict[str, Any]] = {}
        for s in self.stores:
            try:
                d = dict(s.stats())
            except Exception:  # noqa: BLE001 - a failing store still reports the engine's counts
                d = {"degraded": True}
            if d.get("degraded") and hasattr(s, "probe"):
                self.io.submit_probe(s)
            d.update(self.counters[s.medium].as_dict())
            d["used_bytes"] = int(getattr(s, "used_bytes", 0))
            d["capacity_bytes"] = int(getattr(s, "capacity_bytes", 0) or 0)
            d["load_s_per_token"] = self.costs.token_s(s.medium)
            d["prefill_s_per_token"] = self.costs.prefill_token_s
            d["write_policy"] = "write_back" if s in self.back else "write_through"
            out[s.medium] = d
        return out

    def degraded(self) -> List[str]:
        """The tiers whose store says it is degraded (e.g. Redis unreachable)."""
        return [m for m, d in self.stats().items() if d.get("degraded")]

    # ------------------------------------------------------------------ lifetime
    def drain(self, timeout: Optional[float] = None) -> bool:
        """Wait until every queued write has reached its stores (True) or ``timeout`` s passed."""
        return self.io.drain(timeout)

    def delete_all(self, remote: bool = False) -> None:
        """Empty the tiers this engine owns (host, disk; the shared remote tier only with
        ``remote``), after the queued writes (so none lands after)."""
        self.io.drain()
        for s in self.stores:
            if s.medium != "remote" or remote:
                s.delete_all()

    def close(self, timeout: Optional[float] = None) -> bool:
        """Drain the queued writes, stop the I/O thread and close the stores; idempotent.
        Returns whether every queued write was done. A call while another thread closes waits
        for the same drain (``timeout``): the interpreter's exit after an ``AsyncLLM.shutdown``
        that timed out while its engine thread drained returned at once, and the daemon I/O thread
        died with the writes still queued. A close that times out leaves the stores open for the
        writes still queued (closed, they dropped them); a later close, or the finalizer at
        collection or exit, closes them."""
        self._closed = True
        return _close_stores(self.io, self.stores, timeout)


def _peek_tail(stores: Sequence[Any], key: BlockKey, want: Sequence[int]) -> tuple:
    """``(c, medium)``: the tokens the first store's tail under ``key`` shares with ``want``
    (``(0, None)``: none shares any)."""
    want = tuple(want[:BLOCK_TOKENS])
    for s in stores if want else ():
        try:
            b = s.get([key], [None])[0]
        except Exception:  # noqa: BLE001 - a failing tier holds nothing
            b = None
        if b is not None:
            c = shared_len(b.tokens, want)
            if c:
                return c, s.medium
    return 0, None


def _contains_one(store: Any, key: BlockKey) -> bool:
    try:
        return bool(list(store.contains([key]))[0])
    except Exception:  # noqa: BLE001 - a failing tier holds nothing
        return False
