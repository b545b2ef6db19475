"""`RedisStore`: the shared tier, a Redis or Valkey server that engines on any machine read and
write (the ``redis`` PyPI client, imported here only). docs/tiers.md ("Redis") has the policy.

Keys are ``<prefix>:<fingerprint hex>:<namespace digest hex>:<block digest hex>`` (prefix
``rkv``), values the codec's records. Reads are one round trip (pipelined ``GET``, or ``GETEX``
refreshing the TTL of what is read; a key holding another type is a corrupt record), writes one pipelined ``SET ... EX ttl``. Every failure of
the server (down, refusing, out of memory) is a miss or a dropped write, counted, logged with
backoff; no call is tried again until the backoff passes, then the next call reconnects.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Optional, Sequence

from radixkv.tiers.base import Backoff, Block, BlockKey, StoreStats, ThrottledLog, keeps_held
from radixkv.tiers.codec import HEAD_SIZE, decode, encode, head_tokens, why_corrupt
from radixkv.tiers.redis_url import RedisURL, parse_redis_url

__all__ = ["DEFAULT_TTL_S", "RedisStore", "RedisURL", "parse_redis_url"]

logger = logging.getLogger(__name__)

DEFAULT_TTL_S = 86400
"""The records' time to live when ``ttl_s`` is None: a day, refreshed by each read."""


def _client(u: RedisURL, timeout_s: float) -> Any:
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    kwargs: dict[str, Any] = dict(
        host=u.host,
        port=u.port,
        db=u.db,
        username=u.username,
        password=u.password,
        socket_timeout=u.socket_timeout or timeout_s,
        socket_connect_timeout=u.socket_connect_timeout or u.socket_timeout or timeout_s,
        retry=Retry(NoBackoff(), 0),  # NOTE: the store's own backoff decides when to try again
        health_check_interval=0,
    )
    if u.scheme == "rediss":
        kwargs["ssl"] = True
        for k, v in u.query:
            kwargs[k] = v.lower() in ("1", "true", "yes") if k == "ssl_check_hostname" else v
    return redis.Redis(**kwargs)


def _errors() -> tuple[type[BaseException], ...]:
    import redis

    return (redis.RedisError, OSError)


def _refusal() -> type[BaseException]:
    """What the server answers a command it refuses (out of memory, a read-only replica, an ACL
    without the command): an error of that command, not of the server or the connection."""
    from redis.exceptions import ResponseError

    return ResponseError


_FAIL = object()
_WRONG = object()  # a key holding another type than a string (WRONGTYPE): a corrupt record


def _read_only(v: Any) -> bool:
    from redis.exceptions import ReadOnlyError

    return isinstance(v, ReadOnlyError)


def _wrong_type(v: Any) -> bool:
    from redis.exceptions import ResponseError

    return isinstance(v, ResponseError) and str(v).startswith("WRONGTYPE")


class RedisStore:
    """Blocks in a Redis / Valkey server shared by every engine that names it.

    Args:
        url: ``remote_cache_url`` (:func:`parse_redis_url`).
        capacity_bytes: advisory (reported by :meth:`stats`): the server's ``maxmemory`` with
            ``maxmemory-policy allkeys-lru`` bounds the shared tier (docs/tiers.md, "Redis").
        ttl_s: each record's time to live in seconds, refreshed by every read that finds it;
            None: :data:`DEFAULT_TTL_S`; 0: no expiry.
        fingerprint: this engine's model fingerprint (16 bytes): :meth:`delete_all` deletes its
            keys (besides those of every fingerprint this store has seen).
        prefix: the keys' first part (letters, digits, ``_``, ``-``, ``.``).
        timeout_s: connect and socket timeout of each call, seconds, where ``url`` names none
            (``?socket_timeout=``, ``?socket_connect_timeout=``).
        backoff_base_s, backoff_max_s: the backoff after a failure (doubling up to the max).
        clock: the monotonic time source of the backoff (tests pass their own).

    Raises:
        ValueError: a malformed ``url`` (naming ``remote_cache_url``), a bad ``ttl_s``,
            ``capacity_bytes``, ``fingerprint`` or ``prefix``. An unreachable server is no error:
            the store starts ``degraded`` and tries again after the backoff.
    """

    medium = "remote"

    def __init__(
        self,
        url: str,
        capacity_bytes: Optional[int] = None,
        ttl_s: Optional[int] = None,
        *,
        fingerprint: Optional[bytes] = None,
        prefix: str = "rkv",
        timeout_s: float = 2.0,
        backoff_base_s: float = 0.5,
        backoff_max_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.url = parse_redis_url(url)
        _check_args(capacity_bytes, ttl_s, fingerprint, prefix)
        self._capacity = capacity_bytes or 0
        self.ttl_s = DEFAULT_TTL_S if ttl_s is None else ttl_s
        self._prefix = prefix
        self._fingerprints: set[bytes] = {fingerprint} if fingerprint else set()
        self._lock = threading.Lock()
        self._backoff = Backoff(backoff_base_s, backoff_max_s, clock)
        self._log = ThrottledLog(logger, f"remote tier {self.url.redacted()}")
        # NOTE: a server out of memory (noeviction) refuses writes but still serves reads: writes
        # back off on their own, so a read's success neither ends their pause nor flaps the log
        self._write_backoff = Backoff(backoff_base_s, backoff_max_s, clock)
        self._write_log = ThrottledLog(logger, f"remote tier {self.url.redacted()}: write")
        self._stats = StoreStats()
        self._closed = False
        self._errors, self._refused = _errors(), _refusal()
        self._redis = _client(self.url, timeout_s)
        info = self.server_info()
        if info:
            _log_policy(info, self.ttl_s, self.url)
        # GETEX (a read refreshing the TTL) needs Redis >= 6.2 (any Valkey); older: GET + EXPIRE
        self._getex = _version(info.get("redis_version", "")) >= (6, 2)

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        """0: not tracked per engine (:meth:`server_info` has the server's ``used_memory``)."""
        return 0

    @property
    def degraded(self) -> bool:
        """The last call to the server failed (none succeeded since), or the last write was
        refused (out of memory, a read-only replica; no write succeeded since)."""
        return self._backoff.failing or self._write_backoff.failing

    def _name(self, key: BlockKey) -> str:
        return f"{self._prefix}:{key.fingerprint.hex()}:{key.namespace_digest.hex()}:{key.digest.hex()}"

    def _names(self, keys: Sequence[BlockKey]) -> list[str]:
        fps = {k.fingerprint for k in keys}
        if not fps <= self._fingerprints:
            with self._lock:
                self._fingerprints |= fps
        return [self._name(k) for k in keys]

    def _call(self, fn: Callable[[Any], Any], write: bool = False) -> Any:
        """``fn(client)``, or ``_FAIL`` when closed, backing off, or it failed (counted, logged).
        A ``write`` the server refuses (out of memory, read-only) pauses writes only (their own backoff)."""
        with self._lock:
            if self._closed or not self._backoff.ready():
                return _FAIL
        try:
            result = fn(self._redis)
            failure = next((r for r in result if isinstance(r, Exception)), None) if isinstance(result, list) else None
        except self._errors as e:
            result, failure = _FAIL, e
        # NOTE: a write the server refuses (out of memory, a read-only replica after a failover)
        # pauses writes only: reads still work there
        full = write and isinstance(failure, self._refused)
        writes_ok = False
        with self._lock:
            if failure is not None and not full:
                delay = self._backoff.failed()
            else:
                recovered = self._backoff.succeeded()  # the server answered
                if full:
                    delay = self._write_backoff.failed()
                else:
                    writes_ok = write and self._write_backoff.succeeded()
        if failure is not None:
            self._stats.add(errors=1)
            log = self._write_log if full else self._log
            log.failure(
                failure, f"writes paused {delay:g} s (the server refused them)" if full else f"no call for {delay:g} s"
            )
        if failure is None or full:
            if recovered:
                self._log.recovered()
            if writes_ok:
                self._write_log.recovered()
        return result

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Whether each key exists now (one round trip; all False while the server fails)."""
        names = self._names(keys)

        def exists(r: Any) -> list:
            p = r.pipeline(transaction=False)
            for n in names:
                p.exists(n)
            return p.execute(raise_on_error=False)

        res = self._call(exists) if names else []
        return [False] * len(names) if res is _FAIL else [r == 1 for r in res]

    def get(self, keys: Sequence[BlockKey], tokens: Sequence[Optional[Sequence[int]]]) -> list[Block | None]:
        """Each key's block, verified against ``tokens[i]`` (None: any token ids; one round
        trip); a missing or corrupt record, or a failing server, is None (corrupt records are
        deleted)."""
        if len(keys) != len(tokens):
            raise ValueError(f"get: {len(keys)} keys but {len(tokens)} token blocks")
        names = self._names(keys)
        ttl = self.ttl_s

        def fetch(r: Any) -> list:
            p = r.pipeline(transaction=False)
            for n in names:
                if not ttl:
                    p.get(n)
                elif self._getex:
                    p.getex(n, ex=ttl)
                else:
                    p.get(n).expire(n, ttl)
            res = p.execute(raise_on_error=False)
            vals = res if ttl == 0 or self._getex else res[::2]
            stale = [i for i, v in enumerate(vals) if _read_only(v)]
            if stale:  # a read-only replica refuses GETEX (it sets the TTL): read without it
                q = r.pipeline(transaction=False)
                for i in stale:
                    q.get(names[i])
                for i, v in zip(stale, q.execute(raise_on_error=False)):
                    vals[i] = v
            # NOTE: a key holding another type (a list, a hash) is that key's damage, not the
            # server's failure: a corrupt record, not a reason to back off from every key
            return [_WRONG if _wrong_type(v) else v for v in vals]

        vals = self._call(fetch) if names else []
        out: list[Block | None] = [None] * len(names)
        if vals is not _FAIL:
            bad = []
            for i, (key, toks, v) in enumerate(zip(keys, tokens, vals)):
                if v is None or isinstance(v, Exception):
                    continue
                if v is _WRONG:
                    bad.append(names[i])
                    logger.warning("remote tier: dropped corrupt record %s (not a string value)", names[i])
                    continue
                self._stats.add(blocks_read=1, bytes_read=len(v))
                out[i] = decode(key, v, toks)
                if out[i] is None:
                    bad.append(names[i])
                    logger.warning("remote tier: dropped corrupt record %s (%s)", names[i], why_corrupt(key, v, toks))
            if bad:
                self._stats.add(corrupt=len(bad))
                self._call(lambda r: r.unlink(*bad))
        hits = sum(b is not None for b in out)
        self._stats.add(hits=hits, misses=len(out) - hits)
        return out

    def put(self, keys: Sequence[BlockKey], blocks: Sequence[Block], replace: bool = False) -> None:
        """Write each block (one pipelined round trip of ``SET ... EX ttl``: a held key is always
        overwritten; with ``replace``, first one of ``GETRANGE``: not one whose held record's
        tokens start with all of the block's, ``keeps_held``); never raises for the server's failures (``errors``;
        while backing off the blocks are ``skipped``)."""
        if len(keys) != len(blocks):
            raise ValueError(f"put: {len(keys)} keys but {len(blocks)} blocks")
        if not keys or self._closed:
            return
        with self._lock:
            backing_off = not (self._backoff.ready() and self._write_backoff.ready())
        if backing_off:
            self._stats.add(skipped=len(keys))
            return
        if replace:
            keys, blocks = self._not_kept(keys, blocks)
            if not keys:
                return
        records = list(zip(self._names(keys), (encode(k, b) for k, b in zip(keys, blocks))))
        ttl = self.ttl_s or None

        def store(r: Any) -> list:
            p = r.pipeline(transaction=False)
            for n, data in records:
                p.set(n, data, ex=ttl)
            return p.execute(raise_on_error=False)

        res = self._call(store, write=True)
        if res is _FAIL:
            return
        done = [d for (_, d), ok in zip(records, res) if ok is True]
        self._stats.add(blocks_written=len(done), bytes_written=sum(map(len, done)))

    def _not_kept(self, keys: Sequence[BlockKey], blocks: Sequence[Block]) -> tuple[list, list]:
        """The ``(keys, blocks)`` a ``replace`` writes: not those whose held record's tokens
        start with all of the block's (``keeps_held``: marked used instead). One round trip of
        ``GETRANGE`` (the records' headers and token ids); a failure writes them all."""
        names = self._names(keys)

        def heads(r: Any) -> list:
            p = r.pipeline(transaction=False)
            for n in names:
                p.getrange(n, 0, HEAD_SIZE - 1)
            # NOTE: a key of another type (WRONGTYPE) is that key's damage: SET replaces it
            return [None if _wrong_type(v) else v for v in p.execute(raise_on_error=False)]

        got = self._call(heads)
        if got is _FAIL:
            return list(keys), list(blocks)
        kept = [isinstance(h, bytes) and keeps_held(head_tokens(k, h), b.tokens) for k, b, h in zip(keys, blocks, got)]
        self.touch([k for k, keep in zip(keys, kept) if keep])
        return [k for k, keep in zip(keys, kept) if not keep], [b for b, keep in zip(blocks, kept) if not keep]

    def drop(self, keys: Sequence[BlockKey]) -> None:
        """``UNLINK`` each key (a record the engine side refused after this store's checks: its
        layout or length is not the pool's), so that a later ``put`` stores a new one (one round
        trip; never raises for the server)."""
        if keys and not self._closed:
            names = self._names(keys)
            self._call(lambda r: r.unlink(*names))

    def touch(self, keys: Sequence[BlockKey]) -> None:
        """Mark each key used now: ``TOUCH`` (the server's LRU clock) and, with a TTL, ``EXPIRE``
        (one pipelined round trip; a missing key stays missing; never raises for the server)."""
        if not keys or self._closed:
            return
        names = self._names(keys)
        ttl = self.ttl_s

        def mark(r: Any) -> list:
            p = r.pipeline(transaction=False)
            p.touch(*names)
            for n in names if ttl else ():
                p.expire(n, ttl)
            # NOTE: a read-only replica refuses EXPIRE: nothing to mark there, no failure
            return [v for v in p.execute(raise_on_error=False) if not _read_only(v)]

        self._call(mark)

    def delete_all(self) -> None:
        """Delete every key of this store's fingerprints (the constructor's and those it has
        seen): ``SCAN MATCH <prefix>:<fingerprint>:*`` then ``UNLINK`` in batches. Other models'
        and other prefixes' keys stay. Never raises for the server's failures."""
        with self._lock:
            patterns = [f"{self._prefix}:{fp.hex()}:*" for fp in sorted(self._fingerprints)]

        def wipe(r: Any) -> int:
            n = 0
            for pattern in patterns:
                batch: list = []
                for name in r.scan_iter(match=pattern, count=1000):
                    batch.append(name)
                    if len(batch) == 1000:
                        n += r.unlink(*batch)
                        batch = []
                if batch:
                    n += r.unlink(*batch)
            return n

        if patterns:
            self._call(wipe)

    def server_info(self) -> dict[str, Any]:
        """The server's ``redis_version``, ``used_memory``, ``maxmemory`` and ``maxmemory_policy``
        (``INFO``), or {} when it cannot be asked (a failure, counted)."""
        info = self._call(lambda r: {**r.info("server"), **r.info("memory")})
        if info is _FAIL:
            return {}
        keys = ("redis_version", "used_memory", "maxmemory", "maxmemory_policy")
        return {k: info[k] for k in keys if k in info}

    def probe(self) -> None:
        """While degraded, one ``PING`` once the backoff allows (a success ends ``degraded``), so
        a tier that recovers says so without a request having to call it; otherwise nothing.
        Blocks for at most the client's timeout: call it off the engine thread."""
        if self.degraded:
            self._call(lambda r: [r.ping()])

    def stats(self) -> dict[str, int | bool]:
        """Counters (docs/tiers.md "Stores"), ``blocks`` and ``used_bytes`` (0: not tracked),
        ``capacity_bytes`` (advisory), ``degraded``."""
        return {
            **self._stats.snapshot(),
            "blocks": 0,
            "used_bytes": 0,
            "capacity_bytes": self._capacity,
            "degraded": self.degraded,
        }

    def close(self) -> None:
        """Close the connections; later calls miss and write nothing. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._redis.close()
        except self._errors:
            pass


def _check_args(capacity_bytes: Any, ttl_s: Any, fingerprint: Any, prefix: Any) -> None:
    def bad_int(v: Any) -> bool:
        return v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0)

    if bad_int(capacity_bytes):
        raise ValueError(f"capacity_bytes must be None or an integer >= 0, got {capacity_bytes!r}")
    if bad_int(ttl_s):
        raise ValueError(f"ttl_s must be None (a day), 0 (no expiry) or an integer >= 1, got {ttl_s!r}")
    if fingerprint is not None and (not isinstance(fingerprint, bytes) or len(fingerprint) != 16):
        raise ValueError(f"fingerprint must be 16 bytes, got {fingerprint!r}")
    if not isinstance(prefix, str) or not prefix or not all(c.isalnum() or c in "_-." for c in prefix):
        raise ValueError(f"prefix must be letters, digits, '_', '-' or '.', got {prefix!r}")


def _version(text: str) -> tuple[int, ...]:
    """``"7.0.15"`` -> (7, 0); unknown -> a version new enough for every command used."""
    try:
        return tuple(int(x) for x in text.split(".")[:2])
    except ValueError:
        return (99,)


def _log_policy(info: dict, ttl_s: int, url: RedisURL) -> None:
    """Warn when the server's memory is unbounded or full writes would fail (docs/tiers.md "Redis")."""
    policy, maxmemory = info.get("maxmemory_policy"), info.get("maxmemory", 0)
    if not maxmemory and not ttl_s:
        logger.warning(
            "remote tier %s: no maxmemory and no TTL: the shared tier grows without bound "
            "(set maxmemory and maxmemory-policy allkeys-lru)",
            url.redacted(),
        )
    elif maxmemory and policy == "noeviction":
        logger.warning(
            "remote tier %s: maxmemory-policy noeviction: writes fail once maxmemory is reached "
            "(set maxmemory-policy allkeys-lru)",
            url.redacted(),
        )
