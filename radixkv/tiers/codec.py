"""The stored form of a block (disk files, Redis values): self-describing and checked, so that a
record is loaded only for exactly the key and the tokens it was written for.

Format version 2, little-endian::

    offset  size  field
         0     4  magic b"RKVB"
         4     2  version (2; 1 is still read)
         6     2  flags (0)
         8    48  key: fingerprint, namespace digest, block digest (BlockKey.to_bytes)
        56     4  n: number of token ids (16; a tail's 1 to 15)
        60     4  m: meta length in bytes
        64     8  p: payload length in bytes
        72    4n  token ids, int32
         .     m  meta
         .     z  zero padding: the payload starts at a multiple of 64 bytes
         .     p  payload
       end    16  checksum of every byte before it: XXH3-128 (version 1: blake2b-128)

The checksum guards against damage (a torn write, a flipped bit, a truncated file), not against
whoever can write the store: it keeps a damaged record from being loaded, as the key and the
token ids keep another block's from being. XXH3 (the ``xxhash`` package) checks a 740 KB
float32 block in about 0.01 ms, blake2b in about 0.5 ms, most of a disk load's CPU time; records
of version 1 (blake2b), from before, are still read.

:func:`decode` returns None when any of them does not match: the magic, the version or flags, the
key, the token ids (against those the caller expects; a tail's caller may take any), the lengths (against the record's size),
or the checksum. :func:`why_corrupt` says which.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Callable, Optional, Sequence

import xxhash

from radixkv.tiers.base import BLOCK_TOKENS, Block, BlockKey

__all__ = [
    "ALIGN",
    "HEAD_SIZE",
    "HEADER_SIZE",
    "MAGIC",
    "VERSION",
    "decode",
    "encode",
    "encoded_size",
    "head_tokens",
    "why_corrupt",
]

MAGIC = b"RKVB"
VERSION = 2
ALIGN = 64
_HEADER = struct.Struct("<4sHH48sIIQ")
HEADER_SIZE = _HEADER.size  # 72
HEAD_SIZE = HEADER_SIZE + 4 * BLOCK_TOKENS
"""The bytes of a record's start that hold its header and token ids (:func:`head_tokens`)."""
_SUM = 16


def _blake2b(parts: Sequence) -> bytes:
    h = hashlib.blake2b(digest_size=_SUM)
    for part in parts:
        h.update(part)
    return h.digest()


def _xxh3(parts: Sequence) -> bytes:
    h = xxhash.xxh3_128()
    for part in parts:
        h.update(part)
    return h.digest()


_CHECKSUMS: dict[int, Callable[[Sequence], bytes]] = {1: _blake2b, 2: _xxh3}  # by format version


def _pad(n_tokens: int, meta_len: int) -> int:
    return -(HEADER_SIZE + 4 * n_tokens + meta_len) % ALIGN


def _token_bytes(tokens: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}i", *tokens)


def encoded_size(block: Block) -> int:
    """The length in bytes of ``encode(key, block)`` (for any key)."""
    n, m = len(block.tokens), len(block.meta)
    return HEADER_SIZE + 4 * n + m + _pad(n, m) + block.payload_nbytes + _SUM


def encode(key: BlockKey, block: Block) -> bytes:
    """The record of ``block`` stored under ``key`` (the module docstring's format).

    Returns:
        ``encoded_size(block)`` bytes.
    """
    n, m, p = len(block.tokens), len(block.meta), block.payload_nbytes
    parts = (
        _HEADER.pack(MAGIC, VERSION, 0, key.to_bytes(), n, m, p),
        _token_bytes(block.tokens),
        block.meta,
        bytes(_pad(n, m)),
        block.payload,
    )
    return b"".join((*parts, _CHECKSUMS[VERSION](parts)))


def _expected_tokens(tokens: Sequence[int]) -> bytes | None:
    try:
        return _token_bytes(tokens)
    except (struct.error, TypeError):
        return None


def _check(key: BlockKey, view: memoryview, tokens: Optional[Sequence[int]]) -> tuple[str | None, slice, slice]:
    """(why the record is corrupt or None, the meta's slice, the payload's slice)."""
    none = slice(0, 0)
    if len(view) < HEADER_SIZE + _SUM:
        return "length: shorter than a header", none, none
    magic, version, flags, kb, n, m, p = _HEADER.unpack_from(view)
    if magic != MAGIC:
        return "magic", none, none
    if version not in _CHECKSUMS or flags != 0:
        return f"version: {version} (flags {flags}), expected one of {sorted(_CHECKSUMS)}", none, none
    if kb != key.to_bytes():
        return "key: the record is another block's", none, none
    meta_at = HEADER_SIZE + 4 * n
    pay_at = meta_at + m + _pad(n, m)
    if pay_at + p + _SUM != len(view):
        return f"length: header says {pay_at + p + _SUM} bytes, record has {len(view)}", none, none
    if tokens is None:
        if not 1 <= n <= BLOCK_TOKENS:
            return f"tokens: {n} token ids, expected 1 to {BLOCK_TOKENS}", none, none
    elif n != len(tokens) or view[HEADER_SIZE:meta_at] != _expected_tokens(tokens):
        return "tokens: not the expected token ids", none, none
    if _CHECKSUMS[version]((view[:-_SUM],)) != view[-_SUM:]:
        return "checksum", none, none
    return None, slice(meta_at, meta_at + m), slice(pay_at, pay_at + p)


def head_tokens(key: BlockKey, head: bytes | bytearray | memoryview) -> tuple[int, ...] | None:
    """The token ids the record starting with ``head`` (its first :data:`HEAD_SIZE` bytes or
    more) holds, read from its header, or None when that is not a header of ``key``'s record.
    Unverified (no checksum: the rest is not read): what a tail's write consults to keep a longer
    tail of the same tokens (docs/tiers.md, "Tails"), never what a load trusts."""
    view = memoryview(head).cast("B")
    if len(view) < HEADER_SIZE:
        return None
    magic, version, flags, kb, n, _, _ = _HEADER.unpack_from(view)
    if magic != MAGIC or version not in _CHECKSUMS or flags or kb != key.to_bytes() or not 1 <= n <= BLOCK_TOKENS:
        return None
    if len(view) < HEADER_SIZE + 4 * n:
        return None
    return struct.unpack_from(f"<{n}i", view, HEADER_SIZE)


def why_corrupt(key: BlockKey, data: bytes | bytearray | memoryview, tokens: Optional[Sequence[int]]) -> str | None:
    """Why ``data`` is not the record of ``key`` for ``tokens`` (``"magic"``, ``"version: ..."``,
    ``"key: ..."``, ``"tokens: ..."``, ``"length: ..."``, ``"checksum"``), or None when it is."""
    return _check(key, memoryview(data).cast("B"), tokens)[0]


def decode(key: BlockKey, data: bytes | bytearray | memoryview, tokens: Optional[Sequence[int]]) -> Block | None:
    """The block ``data`` holds, or None when it is not exactly the record of ``key`` for ``tokens``.

    Args:
        key: the key the caller asked for.
        data: a record as :func:`encode` wrote it (any bytes-like object).
        tokens: the token ids the caller expects the block to hold (16; a tail's 1 to 15), or
            None: any 1 to 16 (a tail's caller compares them itself); the record's are returned.

    Returns:
        A :class:`Block` whose ``payload`` is a read-only ``memoryview`` into ``data`` (no copy),
        or None (module docstring; :func:`why_corrupt` says why).
    """
    view = memoryview(data).cast("B").toreadonly()
    why, meta, payload = _check(key, view, tokens)
    if why is not None:
        return None
    if tokens is None:
        tokens = struct.unpack_from(f"<{(meta.start - HEADER_SIZE) // 4}i", view, HEADER_SIZE)
    return Block(tokens=tuple(tokens), payload=view[payload], meta=bytes(view[meta]))
