"""`remote_cache_url`: the Redis / Valkey URL, checked before any connection (no ``redis``
import): ``redis://[user:password@]host[:port][/db]`` or ``rediss://`` (TLS)."""

from __future__ import annotations

import ipaddress
import re
import urllib.parse
from dataclasses import dataclass
from typing import Optional

__all__ = ["RedisURL", "parse_redis_url"]

_HOST = re.compile(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*\.?")
_QUERY = {"ssl_cert_reqs", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_check_hostname"}
_TIMEOUTS = ("socket_timeout", "socket_connect_timeout")  # redis-py's URL names, seconds


@dataclass(frozen=True)
class RedisURL:
    """A checked ``remote_cache_url`` (``password`` never shown by ``repr``)."""

    scheme: str
    host: str
    port: int
    db: int
    username: Optional[str]
    password: Optional[str]
    query: tuple[tuple[str, str], ...] = ()
    """The TLS options (``rediss://`` only)."""
    socket_timeout: Optional[float] = None
    """Seconds a call may wait for the server (``?socket_timeout=``); None: the store's default."""
    socket_connect_timeout: Optional[float] = None
    """Seconds a connection may take (``?socket_connect_timeout=``); None: ``socket_timeout``."""

    def __repr__(self) -> str:
        return f"RedisURL({self.redacted()!r})"

    def redacted(self) -> str:
        """The URL with the password replaced by ``***``."""
        auth = ""
        if self.username or self.password:
            auth = f"{self.username or ''}{':***' if self.password else ''}@"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{auth}{host}:{self.port}/{self.db}"


def _bad(url: str, why: str) -> ValueError:
    shown = url
    try:
        parts = urllib.parse.urlsplit(url)
        if parts.password:
            shown = url.replace(f":{parts.password}@", ":***@")
    except ValueError:
        pass
    return ValueError(
        f"remote_cache_url {shown!r}: {why} (expected redis://[user:password@]host:port/db or rediss://...)"
    )


def _valid_host(host: str) -> bool:
    """A DNS name (letters, digits, ``-``, ``_``, dots) or an IPv4 / IPv6 address."""
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return _HOST.fullmatch(host) is not None


def parse_redis_url(url: str) -> RedisURL:
    """Check ``remote_cache_url``: ``redis://[user:password@]host[:port][/db]`` or ``rediss://``
    (TLS; query options ``ssl_cert_reqs``, ``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile``,
    ``ssl_check_hostname``). Port 6379 and db 0 by default. Either scheme takes
    ``socket_timeout`` and ``socket_connect_timeout`` (seconds, > 0 and <= 3600), as redis-py's URLs.

    Raises:
        ValueError: naming ``remote_cache_url`` and what is wrong (the password never shown).
    """
    if not isinstance(url, str) or not url:
        raise _bad(str(url), "not a URL string")
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise _bad(url, str(e)) from None
    if parts.scheme not in ("redis", "rediss"):
        raise _bad(url, f"scheme {parts.scheme!r} is not redis or rediss")
    if port == 0:
        raise _bad(url, "port 0 is not 1 to 65535")
    if not parts.hostname:
        raise _bad(url, "no host")
    if not _valid_host(parts.hostname):
        raise _bad(url, f"host {parts.hostname!r} is not a host name or an IP address")
    path = parts.path.strip("/")
    if path and not path.isdigit():
        raise _bad(url, f"database {path!r} is not a number")
    if parts.fragment:
        raise _bad(url, "a fragment is not allowed")
    query = tuple(urllib.parse.parse_qsl(parts.query, keep_blank_values=True, strict_parsing=False))
    timeouts = _timeouts(url, query)
    query = tuple((k, v) for k, v in query if k not in _TIMEOUTS)
    unknown = sorted({k for k, _ in query} - _QUERY)
    if unknown or (query and parts.scheme != "rediss"):
        raise _bad(
            url,
            f"query options {unknown or [k for k, _ in query]} not allowed (rediss:// takes {sorted(_QUERY)}; "
            f"either scheme {list(_TIMEOUTS)})",
        )
    return RedisURL(
        scheme=parts.scheme,
        host=parts.hostname,
        port=6379 if port is None else port,
        db=int(path or 0),
        username=urllib.parse.unquote(parts.username) if parts.username else None,
        password=urllib.parse.unquote(parts.password) if parts.password else None,
        query=query,
        **timeouts,
    )


def _timeouts(url: str, query: tuple[tuple[str, str], ...]) -> dict[str, float]:
    """The ``socket_timeout`` / ``socket_connect_timeout`` options of ``query``, in seconds."""
    out: dict[str, float] = {}
    for k, v in query:
        if k not in _TIMEOUTS:
            continue
        if k in out:
            raise _bad(url, f"{k} given twice")
        try:
            t = float(v)
        except ValueError:
            t = float("nan")
        if not 0 < t <= 3600:  # NOTE: also refuses nan and inf
            raise _bad(url, f"{k}={v!r} is not a number of seconds > 0 and <= 3600")
        out[k] = t
    return out
