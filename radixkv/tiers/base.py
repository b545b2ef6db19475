"""What every KV tier shares: the key and the block a tier stores, the :class:`PageStore` protocol
the engine side calls, and the bookkeeping each store uses (counters, backoff, throttled logs).

The unit is the 16-token block the engine already digests (:mod:`radixkv.cache.digests`), whatever
the pool's page size. A :class:`BlockKey` names it by the model's fingerprint, the namespace and
the block's chained digest; a :class:`Block` holds its 16 token ids and its K/V bytes (opaque to
the stores). docs/tiers.md ("Stores") describes the stores, their formats and faults.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Sequence, Union, runtime_checkable

from radixkv.cache.digests import BLOCK_TOKENS

__all__ = [
    "BLOCK_TOKENS",
    "DEFAULT_DISK_CACHE_BYTES",
    "Backoff",
    "Block",
    "BlockKey",
    "PageStore",
    "STAT_KEYS",
    "StoreStats",
    "ThrottledLog",
    "block_nbytes",
    "keeps_held",
]

DEFAULT_DISK_CACHE_BYTES = 8 << 30
"""``disk_cache_bytes``'s default: 8 GiB."""

_ID = 16  # bytes of a fingerprint, a namespace digest and a block digest

Buffer = Union[bytes, bytearray, memoryview]


@functools.lru_cache(maxsize=4096)
def _namespace_digest(namespace: bytes) -> bytes:
    # The same 16 bytes as radixkv.cache.digests.namespace_seed (the digest chain's start).
    return hashlib.blake2b(namespace, digest_size=_ID).digest()


@dataclass(frozen=True, slots=True)
class BlockKey:
    """Names one stored block: another model or namespace never reads it.

    Args:
        fingerprint: 16 bytes naming the model's weights, dtype, K/V dtype and quantization
            (computed by the engine side).
        namespace: the namespace's stable serialization (``radixkv.namespace.namespace_key``);
            only persistable namespaces go to the disk and remote tiers.
        digest: the block's chained digest (``radixkv.cache.digests.block_digests``, 16 bytes).

    Raises:
        ValueError: ``fingerprint`` or ``digest`` not 16 bytes, ``namespace`` not bytes.
    """

    fingerprint: bytes
    namespace: bytes
    digest: bytes

    def __post_init__(self) -> None:
        for name in ("fingerprint", "digest"):
            v = getattr(self, name)
            if not isinstance(v, bytes) or len(v) != _ID:
                raise ValueError(f"BlockKey.{name} must be {_ID} bytes, got {v!r}")
        if not isinstance(self.namespace, bytes):
            raise ValueError(f"BlockKey.namespace must be bytes, got {type(self.namespace).__name__}")

    @property
    def namespace_digest(self) -> bytes:
        """16 bytes: blake2b of ``namespace`` (equal to the digest chain's seed)."""
        return _namespace_digest(self.namespace)

    def to_bytes(self) -> bytes:
        """48 bytes: ``fingerprint + namespace_digest + digest`` (what a stored record repeats)."""
        return self.fingerprint + _namespace_digest(self.namespace) + self.digest

    def hex(self) -> str:
        """96 lowercase hex digits of :meth:`to_bytes` (a disk tier's file name)."""
        return self.to_bytes().hex()


@dataclass(frozen=True, slots=True)
class Block:
    """One 16-token block as a tier stores it, or a *tail*: the 1 to 15 tokens of a sequence
    after its last whole block (stored under a :func:`~radixkv.cache.digests.tail_digest` key).

    Args:
        tokens: 16 token ids (a tail: 1 to 15; int32 range); any sequence, kept as a tuple of ints.
        payload: the K/V of those 16 positions in the pool's storage dtype, opaque to the stores:
            ``bytes`` or any C-contiguous buffer (a ``memoryview``, a numpy array: its raw bytes
            are stored). The stores return a read-only ``memoryview`` of what they read, to avoid
            a copy (``bytes(block.payload)`` copies). ``HostStore`` keeps what ``put`` hands it:
            the caller must not change that buffer afterwards.
        meta: the engine side's layout description (opaque; dtype, layers, heads, ...).

    Raises:
        ValueError: not 1 to 16 tokens, a token outside int32, ``payload`` not a C-contiguous buffer,
            ``meta`` not bytes.
    """

    tokens: tuple[int, ...]
    payload: Buffer
    meta: bytes = b""

    def __post_init__(self) -> None:
        toks = self.tokens if type(self.tokens) is tuple else tuple(int(t) for t in self.tokens)
        if not 1 <= len(toks) <= BLOCK_TOKENS:
            raise ValueError(f"Block.tokens must hold 1 to {BLOCK_TOKENS} token ids, got {len(toks)}")
        if not all(-(1 << 31) <= t < (1 << 31) for t in toks):
            raise ValueError("Block.tokens must be int32 token ids")
        object.__setattr__(self, "tokens", toks)
        if not isinstance(self.meta, bytes):
            raise ValueError(f"Block.meta must be bytes, got {type(self.meta).__name__}")
        if not isinstance(self.payload, bytes):
            try:
                view = memoryview(self.payload)
            except TypeError:
                raise ValueError(f"Block.payload must be bytes-like, got {type(self.payload).__name__}") from None
            if not view.c_contiguous:
                raise ValueError("Block.payload must be a C-contiguous buffer")

    @property
    def payload_nbytes(self) -> int:
        """The payload's size in bytes."""
        p = self.payload
        return len(p) if isinstance(p, bytes) else memoryview(p).nbytes


def block_nbytes(block: Block) -> int:
    """What a block costs in a RAM tier, in bytes: payload + meta + 4 bytes per token id."""
    return block.payload_nbytes + len(block.meta) + 4 * len(block.tokens)


def keeps_held(held: Optional[Sequence[int]], new: Sequence[int]) -> bool:
    """Whether a ``put(..., replace=True)`` of a record of tokens ``new`` keeps the one held under
    its key, of tokens ``held`` (None: none): when ``held`` starts with all of ``new``, it serves
    every request ``new`` would, and more (a tail: a shorter one of the same sequence, such as a
    write-back of the rest of a path whose end was evicted first, replaced the longer one)."""
    return held is not None and len(held) >= len(new) and tuple(held[: len(new)]) == tuple(new)


@runtime_checkable
class PageStore(Protocol):
    """A KV tier below the pool (host RAM, local disk, a shared Redis): the engine side's only view.

    ``get`` and ``put`` never raise for a backend's failure (Redis down, disk full or failing, a
    corrupt record): each is a miss or a dropped write, counted in :meth:`stats` and logged with
    backoff. Methods may be called from the engine's I/O thread while another thread reads
    :meth:`stats`.
    """

    medium: str
    """``"host"``, ``"disk"`` or ``"remote"``."""

    @property
    def capacity_bytes(self) -> int:
        """The tier's byte budget (a Redis store: advisory, the server's ``maxmemory`` rules)."""
        ...

    @property
    def used_bytes(self) -> int:
        """Bytes the tier holds now, as this store accounts them (docs/tiers.md, "Stores")."""
        ...

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Whether each key is stored (cheap; may be optimistic: a later ``get`` may miss)."""
        ...

    def get(self, keys: Sequence[BlockKey], tokens: Sequence[Optional[Sequence[int]]]) -> list[Block | None]:
        """The block of each key, verified against the ``tokens`` the caller expects, or None.
        ``tokens[i]`` None: any token ids (a tail, whose caller keeps the prefix it shares with
        its own tokens): the record's are returned; the key, lengths and checksum are checked."""
        ...

    def put(self, keys: Sequence[BlockKey], blocks: Sequence[Block], replace: bool = False) -> None:
        """Store each block under its key, evicting the tier's least recently used to fit. A key
        already held is only marked used, or with ``replace`` overwritten (tails: the last writer
        wins) unless the held record's tokens start with all of the new one's (:func:`keeps_held`:
        only marked used)."""
        ...

    def delete_all(self) -> None:
        """Drop every block this store owns (a Redis store: only its fingerprints' keys)."""
        ...

    def stats(self) -> dict[str, int | bool]:
        """Counters (:data:`STAT_KEYS`) and ``degraded``."""
        ...

    def close(self) -> None:
        """Flush pending writes and release resources; idempotent."""
        ...


STAT_KEYS = (
    "hits",
    "misses",
    "blocks_read",
    "blocks_written",
    "bytes_read",
    "bytes_written",
    "corrupt",
    "errors",
    "evicted",
    "rejected",
    "skipped",
)
"""The counters every store reports (docs/tiers.md, "Stores", defines each)."""


class StoreStats:
    """Thread-safe counters of one store (:data:`STAT_KEYS`, plus any ``extra`` names)."""

    def __init__(self, extra: Sequence[str] = ()) -> None:
        self._lock = threading.Lock()
        self._c = dict.fromkeys((*STAT_KEYS, *extra), 0)

    def add(self, **counts: int) -> None:
        """Add to the named counters (KeyError for an unknown name)."""
        with self._lock:
            for k, v in counts.items():
                if k not in self._c:
                    raise KeyError(k)
                self._c[k] += v

    def snapshot(self) -> dict[str, int]:
        """A copy of every counter."""
        with self._lock:
            return dict(self._c)


class Backoff:
    """Exponential backoff of a failing backend: after a failure no attempt until the delay
    passes; each further failure doubles the delay up to ``max_s``; a success resets it.

    Args:
        base_s: the first delay, seconds.
        max_s: the largest delay, seconds.
        clock: the time source (seconds; tests pass their own).
    """

    def __init__(self, base_s: float, max_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.base_s, self.max_s, self.clock = base_s, max_s, clock
        self.failures = 0
        self._until = float("-inf")

    @property
    def failing(self) -> bool:
        """The last attempt failed (and none succeeded since)."""
        return self.failures > 0

    def ready(self) -> bool:
        """Whether an attempt may be made now."""
        return self.clock() >= self._until

    def failed(self) -> float:
        """Record a failure; returns the delay until the next attempt."""
        delay = min(self.max_s, self.base_s * (2 ** min(self.failures, 60)))
        self.failures += 1
        self._until = self.clock() + delay
        return delay

    def succeeded(self) -> bool:
        """Record a success; returns whether the backend was failing until now."""
        was = self.failures > 0
        self.failures = 0
        self._until = float("-inf")
        return was


class ThrottledLog:
    """Warnings of a repeating failure, logged with backoff: the 1st, 2nd, 4th, 8th ... of a run
    of consecutive failures, and once when it recovers."""

    def __init__(self, logger: logging.Logger, what: str) -> None:
        self.logger, self.what = logger, what
        self._run = 0

    def failure(self, err: BaseException, detail: str = "") -> None:
        """Count one failure of the run; log it when the run's length is a power of two."""
        self._run += 1
        if self._run & (self._run - 1) == 0:
            more = f" ({self._run} failures in a row)" if self._run > 1 else ""
            self.logger.warning("%s failed%s: %s%s", self.what, more, err, f"; {detail}" if detail else "")

    def recovered(self) -> None:
        """End the run (logged when there was one)."""
        if self._run:
            self.logger.warning("%s recovered after %d failures", self.what, self._run)
        self._run = 0
