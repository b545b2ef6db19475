"""The prefix-cache namespace: requests share cached prefixes only within one.

:class:`Namespace` is one frozen, hashable value with three fields:

* ``tenant``: who owns the cached entries (a str; the server will set it from an API key);
* ``salt``: a cache salt (a str: SGLang's and vLLM's ``cache_salt``): only requests that know it
  share what it caches;
* ``extra_key``: SGLang's ``extra_key``, and whatever hashable the Python API's ``namespace=``
  argument gets (``namespace="a"`` is ``Namespace(extra_key="a")``).

``None`` is the shared default namespace (every request that names none). ``Namespace()`` (every
field None) is that same namespace: :meth:`Namespace.of` turns it into None, so two spellings
never split the cache. ``Namespace.of`` normalizes at the API boundary (``Engine.add_request``,
``pin_prefix``, ``explain``, the cache simulator, the router's ``RouteRequest``, the server's
protocols); below it everything holds ``Namespace | None`` and keys its dicts, compares and
hashes by it. Nothing builds a namespace by concatenating strings.

**Stable serialization.** :meth:`Namespace.to_bytes` gives the same bytes in every process and
every Python version (neither ``repr`` nor ``hash()``); :func:`namespace_key` is the same for any
namespace, None included. It keys what outlives a process or crosses one: the chain seed of the
block digests (:mod:`radixkv.cache.digests`) that cache events carry to routers, the namespace of
requests sent to another process, the stored KV blocks of a later tier. Format (version 1): the
byte ``0x01``, then ``tenant``, ``salt``, ``extra_key``, each encoded as

* None: ``b"N"``;
* an int (a bool as its int: ``True == 1``): ``b"I"``, a 4-byte big-endian length, the
  shortest big-endian two's complement bytes;
* a str: ``b"S"``, the length, its UTF-8 bytes (lone surrogates passed through);
* bytes: ``b"B"``, the length, the bytes;
* a tuple: ``b"T"``, the item count, each item encoded so.

**Process-local namespaces.** Any other hashable (a float, a frozenset, an object) keeps working
as a namespace in one process, isolated exactly by ``==`` and ``hash`` in the tree, the hash
cache, in-batch sharing and pins, as before. It has no stable serialization: ``persistable`` is
False, :meth:`to_bytes` raises, and :func:`namespace_key` gives a process-local form (the byte
``0xff``, then the ``repr`` of the fields): its block digests name it within one process only.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field
from typing import Any, Hashable, Optional

from radixkv.errors import RequestError

__all__ = ["Namespace", "namespace_key", "check_cache_salt", "with_salt", "MAX_CACHE_SALT_CHARS"]

MAX_CACHE_SALT_CHARS = 128
"""The longest ``cache_salt`` accepted (characters): radixkv's rule for every API that takes one
(and the longest ``extra_key`` ``/generate`` takes)."""

_VERSION = 1
_LOCAL = 0xFF
_LEN = struct.Struct(">I")


def _encode(value: Any, out: bytearray) -> bool:
    """Append ``value``'s stable encoding to ``out``; False when it has none (``out`` is then
    partly written and must be dropped)."""
    if value is None:
        out += b"N"
    elif isinstance(value, int):
        v = int(value)
        raw = v.to_bytes((v.bit_length() + 8) // 8, "big", signed=True)
        out += b"I" + _LEN.pack(len(raw)) + raw
    elif isinstance(value, str):
        raw = value.encode("utf-8", "surrogatepass")
        out += b"S" + _LEN.pack(len(raw)) + raw
    elif isinstance(value, bytes):
        out += b"B" + _LEN.pack(len(value)) + value
    elif isinstance(value, tuple):
        out += b"T" + _LEN.pack(len(value))
        return all(_encode(v, out) for v in value)
    else:
        return False
    return True


def _decode(data: bytes, pos: int) -> tuple[Any, int]:
    """The value encoded at ``data[pos:]`` and the position after it (ValueError if malformed)."""
    tag = data[pos : pos + 1]
    if tag == b"N":
        return None, pos + 1
    if tag not in (b"I", b"S", b"B", b"T") or pos + 5 > len(data):
        raise ValueError(f"namespace bytes: bad value at offset {pos}")
    (n,) = _LEN.unpack_from(data, pos + 1)
    pos += 5
    if tag == b"T":
        items = []
        for _ in range(n):
            item, pos = _decode(data, pos)
            items.append(item)
        return tuple(items), pos
    if pos + n > len(data):
        raise ValueError(f"namespace bytes: value at offset {pos - 5} runs past the end")
    raw = bytes(data[pos : pos + n])
    if tag == b"I":
        return int.from_bytes(raw, "big", signed=True), pos + n
    if tag == b"S":
        return raw.decode("utf-8", "surrogatepass"), pos + n
    return raw, pos + n


@dataclass(frozen=True, slots=True, repr=False)
class Namespace:
    """A prefix-cache namespace (module docstring): equal namespaces share cached prefixes.

    Args:
        tenant: the owner of the cached entries, or None.
        salt: a cache salt, or None.
        extra_key: None, or any hashable; persistable when it is a str, bytes, an int (a bool)
            or a tuple of those.

    Raises:
        RequestError: (param ``namespace``) ``tenant`` or ``salt`` not a str or None,
            ``extra_key`` not hashable.

    ``repr`` / ``str`` show a short digest of the salt, never the salt itself.
    """

    tenant: Optional[str] = None
    salt: Optional[str] = None
    extra_key: Hashable = None
    _key: bytes = field(default=b"", init=False, compare=False)
    _hash: int = field(default=0, init=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("tenant", "salt"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, str):
                raise RequestError(f"namespace {name} must be a str or None, got {type(v).__name__}", "namespace")
        fields = (self.tenant, self.salt, self.extra_key)
        try:
            h = hash(fields)
        except TypeError:
            raise RequestError(
                f"namespace must be hashable, got {type(self.extra_key).__name__} (use a str, int, bytes or a "
                "tuple of those)",
                "namespace",
            ) from None
        out = bytearray([_VERSION])
        if not all(_encode(v, out) for v in fields):
            out = bytearray([_LOCAL]) + repr(fields).encode("utf-8", "backslashreplace")
        object.__setattr__(self, "_key", bytes(out))
        object.__setattr__(self, "_hash", h)

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple:
        return (Namespace, (self.tenant, self.salt, self.extra_key))

    def __repr__(self) -> str:
        parts = []
        if self.tenant is not None:
            parts.append(f"tenant={self.tenant!r}")
        if self.salt is not None:
            tag = hashlib.blake2b(self.salt.encode("utf-8", "surrogatepass"), digest_size=4).hexdigest()
            parts.append(f"salt=#{tag}")
        if self.extra_key is not None:
            parts.append(f"extra_key={self.extra_key!r}")
        return f"Namespace({', '.join(parts)})"

    __str__ = __repr__

    @classmethod
    def of(cls, value: Any) -> Optional["Namespace"]:
        """``value`` as a namespace: None and ``Namespace()`` -> None (the shared default), a
        Namespace -> itself, any other hashable -> ``Namespace(extra_key=value)``.

        Raises:
            RequestError: (param ``namespace``) ``value`` is not hashable.
        """
        if value is None:
            return None
        if isinstance(value, Namespace):
            return None if value.is_default else value
        return cls(extra_key=value)

    @property
    def is_default(self) -> bool:
        """Every field None: the shared default namespace (``Namespace.of`` gives None)."""
        return self.tenant is None and self.salt is None and self.extra_key is None

    @property
    def persistable(self) -> bool:
        """Whether :meth:`to_bytes` can serialize it (module docstring)."""
        return self._key[0] == _VERSION

    def to_bytes(self) -> bytes:
        """The stable serialization (module docstring; ``Namespace()`` gives ``b"\\x01NNN"``).

        Raises:
            RequestError: (param ``namespace``) ``extra_key`` holds a value other than None, str,
                bytes, int or tuples of those (a process-local namespace).
        """
        if not self.persistable:
            raise RequestError(
                f"namespace {self!r} has no stable serialization: extra_key must be None, a str, bytes, an int "
                "or a tuple of those",
                "namespace",
            )
        return self._key

    @classmethod
    def from_bytes(cls, data: bytes) -> Optional["Namespace"]:
        """The namespace :meth:`to_bytes` (or :func:`namespace_key`) serialized: None for the
        shared default.

        Raises:
            ValueError: ``data`` is not a version-1 serialization.
        """
        data = bytes(data)
        if data[:1] != bytes([_VERSION]):
            raise ValueError(f"namespace bytes must start with version byte 0x01, got {data[:1]!r}")
        pos, fields = 1, []
        for _ in range(3):
            v, pos = _decode(data, pos)
            fields.append(v)
        if pos != len(data):
            raise ValueError(f"namespace bytes: {len(data) - pos} trailing bytes")
        tenant, salt, extra_key = fields
        return cls.of(cls(tenant, salt, extra_key))


_DEFAULT_KEY = Namespace()._key


def namespace_key(namespace: Any) -> bytes:
    """The bytes naming ``namespace`` (None, a :class:`Namespace`, or any hashable the Python
    API accepts, normalized by :meth:`Namespace.of`) in digests and hash keys:
    ``Namespace.to_bytes()`` when persistable (None: ``Namespace().to_bytes()``), else the
    process-local form (first byte ``0xff``, never equal to a stable one).

    Raises:
        RequestError: (param ``namespace``) ``namespace`` is not hashable.
    """
    ns = Namespace.of(namespace)
    return _DEFAULT_KEY if ns is None else ns._key


def check_cache_salt(value: Any, param: str = "cache_salt") -> Optional[str]:
    """``value`` as a cache salt: None (no salt), or a non-empty str of at most
    :data:`MAX_CACHE_SALT_CHARS` characters (radixkv's rule on every API that takes
    ``cache_salt``: the server's bodies, the prompt dict, ``SamplingParams``).

    Raises:
        RequestError: (param ``param``) anything else; the message never repeats the salt.
    """
    if value is None:
        return None
    if not isinstance(value, str):
        raise RequestError(f"{param} must be a string, got {type(value).__name__}", param)
    if not value or len(value) > MAX_CACHE_SALT_CHARS:
        raise RequestError(
            f"{param} must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters, got {len(value)} characters",
            param,
        )
    return value


def with_salt(namespace: Any, salt: Optional[str]) -> Optional[Namespace]:
    """``Namespace.of(namespace)`` with ``salt`` as its salt (the same namespace when ``salt`` is
    None or already its salt): how a request's ``cache_salt`` joins the namespace its API gives
    it (an ``LLM``'s ``namespace=``, the server's tenant).

    Raises:
        RequestError: (param ``cache_salt``) a bad salt (:func:`check_cache_salt`), or the
            namespace already holds another salt (two salts given for one request).
    """
    ns = Namespace.of(namespace)
    salt = check_cache_salt(salt)
    if salt is None or (ns is not None and ns.salt == salt):
        return ns
    if ns is None:
        return Namespace(salt=salt)
    if ns.salt is not None:
        raise RequestError("cache_salt differs from the salt the request's namespace already has", "cache_salt")
    return Namespace(ns.tenant, salt, ns.extra_key)
