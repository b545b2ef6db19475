"""API keys and tenants: who is asking, which prefix-cache namespace they get, what they may see.

``radixkv serve --api-key KEY`` (or ``RADIXKV_API_KEY``) configures one key, whose tenant
(``"default"``) is an admin. ``--api-keys-file FILE`` configures many, from a JSON object::

    {"<key>": {"tenant": "<name>", "admin": false, "kv_quota_tokens": 20000}, ...}

A key is printable ASCII without whitespace (what an ``Authorization`` header carries).
``tenant`` is required (a non-empty printable str, at most 128 characters, no whitespace at
either end; several keys may name one tenant), ``admin`` defaults to false, ``kv_quota_tokens``
(an int >= 0; the same for every key of a tenant) is the tenant's soft KV quota
(:mod:`radixkv.cache.tenants`; absent: none). Anything else is a :class:`KeysFileError` at start
naming the file, the entry's position and the problem (never the key).

With keys configured (:class:`AuthMiddleware`), every route but ``/health`` needs
``Authorization: Bearer <key>``: 401 in OpenAI's error format (``invalid_api_key``) otherwise.
The routes that describe every tenant (:data:`ADMIN_PATHS`: ``/flush_cache``,
``/reset_prefix_cache``, ``/cache_stats``, ``/metrics``, and SGLang's ``/server_info`` /
``/get_server_info``, whose ``internal_states`` are the cache stats, and ``/get_load``, every
tenant's requests) answer 403
``permission_denied`` to a key that is not an admin's. Keys are compared in constant time
(:func:`hmac.compare_digest` over the SHA-256 digests of the presented key and of every
configured key, all of them each time); only their digests are kept (what the Ray ingress gets:
:meth:`APIKeys.to_wire`), never logged, never in a metric label.

A request's namespace is the server's to set (:func:`request_namespace`): ``Namespace(tenant of
its key, its cache_salt, its extra_key)``. A client can split its own tenant's cache with salts,
never reach another tenant's; without keys every request has the tenant None (one tenant) and
``cache_salt`` still splits. Request ids a client chooses (``/generate``'s ``rid``) are its
tenant's too (:func:`engine_request_id`): another tenant's running id neither refuses nor
reveals one's own.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

from radixkv.namespace import Namespace, check_cache_salt
from radixkv.server.openai.protocol import APIError

__all__ = [
    "ADMIN_PATHS",
    "PUBLIC_PATHS",
    "APIKeys",
    "AuthMiddleware",
    "KeysFileError",
    "Tenant",
    "engine_request_id",
    "keys_from_args",
    "request_namespace",
    "request_tenant",
]

PUBLIC_PATHS = frozenset({"/health"})
"""Routes that answer without a key."""

ADMIN_PATHS = frozenset(
    {
        "/flush_cache",
        "/reset_prefix_cache",
        "/cache_stats",
        "/metrics",
        "/server_info",
        "/get_server_info",
        "/get_load",
    }
)
"""Routes that describe (or flush) every tenant's cache: admins only."""

SINGLE_TENANT = "default"
"""The tenant of ``--api-key`` / ``RADIXKV_API_KEY``."""

_STATE_KEY = "radixkv_tenant"
_ENTRY_FIELDS = {"tenant", "admin", "kv_quota_tokens"}


class KeysFileError(ValueError):
    """The keys configuration is malformed (the message names the file, the entry and the problem)."""


@dataclass(frozen=True)
class Tenant:
    """Who a key belongs to.

    Attributes:
        name: the tenant (the ``tenant`` of its requests' namespaces, its metrics label).
        admin: may use :data:`ADMIN_PATHS`.
        kv_quota_tokens: its soft KV quota in tokens, or None.
    """

    name: str
    admin: bool = False
    kv_quota_tokens: Optional[int] = None


def _digest(key: Any) -> bytes:
    raw = key.encode("utf-8", "surrogatepass") if isinstance(key, str) else bytes(key)
    return hashlib.sha256(raw).digest()


def _check_entry(where: str, entry: Any) -> Tenant:
    """One keys-file value as a :class:`Tenant` (KeysFileError naming ``where``)."""
    if not isinstance(entry, dict):
        raise KeysFileError(f"{where}: must be an object with 'tenant' (and 'admin', 'kv_quota_tokens')")
    extra = sorted(set(entry) - _ENTRY_FIELDS)
    if extra:
        raise KeysFileError(f"{where}: unknown field(s) {extra} (allowed: {sorted(_ENTRY_FIELDS)})")
    name = entry.get("tenant")
    # NOTE: "alice " would silently be another tenant than "alice" (its own cache, quota, label)
    if not isinstance(name, str) or not name or len(name) > 128 or not name.isprintable() or name != name.strip():
        raise KeysFileError(
            f"{where}: 'tenant' must be a non-empty printable string of at most 128 characters, without "
            "whitespace at either end"
        )
    admin = entry.get("admin", False)
    if not isinstance(admin, bool):
        raise KeysFileError(f"{where}: 'admin' must be true or false, got {admin!r}")
    quota = entry.get("kv_quota_tokens")
    if quota is not None and (isinstance(quota, bool) or not isinstance(quota, int) or quota < 0):
        raise KeysFileError(f"{where}: 'kv_quota_tokens' must be an integer >= 0, got {quota!r}")
    return Tenant(name, admin, quota)


class APIKeys:
    """The configured keys, by digest (module docstring).

    Args:
        entries: ``(SHA-256 digest of a key, its tenant)`` pairs.

    Raises:
        KeysFileError: no entry, a digest twice, or two quotas for one tenant.
    """

    def __init__(self, entries: Sequence[tuple[bytes, Tenant]], source: str = "api keys") -> None:
        if not entries:
            raise KeysFileError(f"{source}: no keys (an empty configuration would lock every route)")
        quotas: dict[str, Optional[int]] = {}
        digests = set()
        for i, (d, t) in enumerate(entries, 1):
            if d in digests:
                raise KeysFileError(f"{source}: entry {i} (tenant {t.name!r}) repeats an earlier key")
            digests.add(d)
            if quotas.setdefault(t.name, t.kv_quota_tokens) != t.kv_quota_tokens:
                raise KeysFileError(
                    f"{source}: entry {i}: tenant {t.name!r} has two kv_quota_tokens "
                    f"({quotas[t.name]!r} and {t.kv_quota_tokens!r}); give every key of a tenant the same"
                )
        self._entries = [(bytes(d), t) for d, t in entries]

    @classmethod
    def single(cls, key: str, source: str = "--api-key") -> "APIKeys":
        """One key, of the admin tenant ``"default"`` (``--api-key`` / ``RADIXKV_API_KEY``)."""
        _check_key(key, source)
        return cls([(_digest(key), Tenant(SINGLE_TENANT, admin=True))], source)

    @classmethod
    def from_mapping(cls, data: Any, source: str = "api keys") -> "APIKeys":
        """Keys from the keys file's JSON object (module docstring). Raises KeysFileError."""
        if not isinstance(data, dict):
            raise KeysFileError(f"{source}: must be a JSON object mapping each key to its tenant")
        entries = []
        for i, (key, entry) in enumerate(data.items(), 1):
            where = f"{source}: entry {i}"
            _check_key(key, where)
            entries.append((_digest(key), _check_entry(where, entry)))
        return cls(entries, source)

    @classmethod
    def from_file(cls, path: str) -> "APIKeys":
        """Keys from ``--api-keys-file``. Raises KeysFileError (unreadable, not JSON, a key twice,
        a malformed entry)."""
        source = f"--api-keys-file {path}"

        def pairs(items: list) -> dict:
            seen: dict = {}
            for i, (k, v) in enumerate(items, 1):
                if k in seen:
                    raise KeysFileError(f"{source}: entry {i} repeats an earlier key")
                seen[k] = v
            return seen

        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f, object_pairs_hook=pairs)
        except OSError as exc:
            raise KeysFileError(f"{source}: cannot read it: {exc.strerror or exc}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise KeysFileError(f"{source}: not valid JSON: {exc}") from None
        return cls.from_mapping(data, source)

    def lookup(self, key: Optional[str]) -> Optional[Tenant]:
        """The tenant of ``key`` (None: no such key). Constant time in the key: its digest is
        compared with every configured digest (:func:`hmac.compare_digest`), none skipped."""
        if key is None:
            return None
        d = _digest(key)
        found = None
        for digest, tenant in self._entries:
            if hmac.compare_digest(d, digest) and found is None:
                found = tenant
        return found

    def tenants(self) -> dict[str, Tenant]:
        """Tenant name -> a :class:`Tenant` of it (admin when any of its keys is)."""
        out: dict[str, Tenant] = {}
        for _, t in self._entries:
            if t.name not in out or t.admin:
                out[t.name] = t
        return out

    def quotas(self) -> dict[str, int]:
        """Tenant -> ``kv_quota_tokens`` of the tenants with one (``EngineConfig.tenant_kv_quota_tokens``)."""
        return {t.name: t.kv_quota_tokens for _, t in self._entries if t.kv_quota_tokens is not None}

    def to_wire(self) -> list:
        """The configuration without the keys (digests in hex, tenants as dicts): what crosses to
        the Ray ingress (:meth:`from_wire`)."""
        return [
            (d.hex(), dict(name=t.name, admin=t.admin, kv_quota_tokens=t.kv_quota_tokens)) for d, t in self._entries
        ]

    @classmethod
    def from_wire(cls, wire: list) -> "APIKeys":
        return cls([(bytes.fromhex(d), Tenant(**t)) for d, t in wire])

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:  # never the keys, nor their digests
        return f"APIKeys({len(self._entries)} keys, tenants {sorted(self.tenants())})"


def _check_key(key: Any, where: str) -> None:
    # NOTE: printable ASCII only: a header's bytes reach the server as latin-1 (and the openai
    # SDK sends ASCII only), so a key with another character could never authenticate
    if not isinstance(key, str) or not key or any(not "!" <= c <= "~" for c in key):
        raise KeysFileError(
            f"{where}: a key must be a non-empty string of printable ASCII characters, without whitespace"
        )


def keys_from_args(api_key: Optional[str], api_keys_file: Optional[str], env: Mapping[str, str] = os.environ):
    """The :class:`APIKeys` of ``radixkv serve``'s ``--api-key`` / ``RADIXKV_API_KEY`` /
    ``--api-keys-file`` (None: no keys, no authentication).

    Raises:
        KeysFileError: both a key and a keys file, an empty key, or a malformed file.
    """
    source = "--api-key"
    if api_key is None and env.get("RADIXKV_API_KEY") is not None:
        api_key, source = env["RADIXKV_API_KEY"], "RADIXKV_API_KEY"
    if api_key is not None and api_keys_file is not None:
        raise KeysFileError(f"give {source} or --api-keys-file, not both (one key, or a file of keys with tenants)")
    if api_keys_file is not None:
        return APIKeys.from_file(api_keys_file)
    if api_key is not None:
        return APIKeys.single(api_key, source)
    return None


# ---------------------------------------------------------------------------- the request side
def _bearer(scope: dict) -> Optional[str]:
    """The key of ``Authorization: Bearer <key>`` (None when absent or another scheme)."""
    for name, value in scope.get("headers") or ():
        if name == b"authorization":
            scheme, _, key = value.decode("latin-1").strip().partition(" ")
            return key.strip() if scheme.lower() == "bearer" and key.strip() else None
    return None


class AuthMiddleware:
    """Pure ASGI middleware (module docstring): 401 / 403 in OpenAI's error format, else the
    request goes on with its :class:`Tenant` in ``scope["state"]`` (:func:`request_tenant`). A
    websocket is checked alike and refused with a close (code 1008, the reason the error's code).

    Args:
        app: the ASGI app.
        keys: the configured :class:`APIKeys`.
        on_error: called with the status of every refusal (the app's error counter).
    """

    def __init__(self, app: Callable, keys: APIKeys, on_error: Optional[Callable[[int], None]] = None) -> None:
        self.app = app
        self.keys = keys
        self.on_error = on_error

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> Any:
        # NOTE: websockets too: a websocket route added later must not be the way around the keys
        if scope.get("type") not in ("http", "websocket") or scope.get("path") in PUBLIC_PATHS:
            return await self.app(scope, receive, send)
        key = _bearer(scope)
        tenant = self.keys.lookup(key)
        if tenant is None:
            why = (
                "invalid API key" if key is not None else "missing API key: send the header Authorization: Bearer <key>"
            )
            return await self._refuse(scope, send, APIError(why, None, status_code=401, code="invalid_api_key"))
        if scope.get("path") in ADMIN_PATHS and not tenant.admin:
            err = APIError(
                f"{scope.get('path')} describes every tenant's cache: it needs an admin key",
                None,
                status_code=403,
                code="permission_denied",
            )
            return await self._refuse(scope, send, err)
        state = scope.get("state")
        scope["state"] = dict(state or {}, **{_STATE_KEY: tenant})
        return await self.app(scope, receive, send)

    async def _refuse(self, scope: dict, send: Callable, err: APIError) -> None:
        if self.on_error is not None:
            self.on_error(err.status_code)
        if scope.get("type") == "websocket":  # closed before it is accepted: the server answers 403
            return await send({"type": "websocket.close", "code": 1008, "reason": err.code})
        body = json.dumps(err.to_dict()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if err.status_code == 401:
            headers.append((b"www-authenticate", b"Bearer"))
        await send({"type": "http.response.start", "status": err.status_code, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def request_tenant(request: Any) -> Optional[Tenant]:
    """The :class:`Tenant` of a request (a Starlette ``Request`` or an ASGI scope) that passed
    :class:`AuthMiddleware`; None without keys."""
    scope = request if isinstance(request, dict) else request.scope
    return (scope.get("state") or {}).get(_STATE_KEY)


def request_namespace(request: Any, cache_salt: Optional[str] = None, extra_key: Any = None) -> Optional[Namespace]:
    """The prefix-cache namespace of a request, set here and only here: ``Namespace(its key's
    tenant, cache_salt, extra_key)`` (``Namespace.of``: None when all three are None).

    Raises:
        APIError: 400 naming ``cache_salt`` when it is not a non-empty str of at most 128 characters.
    """
    tenant = request_tenant(request)
    try:
        salt = check_cache_salt(cache_salt)
    except ValueError as exc:
        raise APIError(str(exc), "cache_salt") from None
    return Namespace.of(Namespace(tenant.name if tenant is not None else None, salt, extra_key))


def engine_request_id(request: Any, rid: str) -> str:
    """The engine request id of a client-chosen request id (``/generate``'s ``rid``): ``rid``
    itself without keys; with keys ``t<len>:<tenant>:<rid>`` (the length makes it injective, as a
    tenant name may hold ``:``), so the ids of running requests, unique in the engine, are unique
    per tenant: one tenant's running ``rid`` neither refuses another tenant's request with the
    same ``rid`` nor tells that tenant it runs (nor, across replicas, mixes their routing)."""
    tenant = request_tenant(request)
    return rid if tenant is None else f"t{len(tenant.name)}:{tenant.name}:{rid}"
