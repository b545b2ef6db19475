"""Chained digests of 16-token blocks: how a cache event names the prefixes it adds or drops.

Block ``b`` of a sequence covers tokens ``[16 b, 16 b + 16)``. Its digest is
``blake2b(digest(b - 1) + int32 bytes of the block's tokens, 16 bytes)``, with ``digest(-1)`` the
digest of the namespace's stable serialization (:func:`radixkv.namespace.namespace_key`): a digest
names a block *and its whole prefix* (as vLLM's block hashes and llm-d's KV events do), whatever
the engine's page size, so consumers that never see tokens (a router) can compare what several
engines hold. :func:`tail_digest` names the partial block after a digest (the KV tiers keep
it). The same in every process and Python version for persistable namespaces (None, and
``Namespace`` values of str, bytes, int and tuples of those); a process-local namespace's digests
name it within its process only.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Hashable, Sequence

from radixkv.namespace import namespace_key

__all__ = ["BLOCK_TOKENS", "namespace_seed", "block_digests", "tail_digest"]

BLOCK_TOKENS = 16
_SIZE = 16


def namespace_seed(namespace: Hashable) -> bytes:
    """``digest(-1)``: the chain's start for ``namespace`` (a ``Namespace``, None, or any hashable
    ``Namespace.of`` accepts: ``"a"`` and ``Namespace(extra_key="a")`` seed alike)."""
    return hashlib.blake2b(namespace_key(namespace), digest_size=_SIZE).digest()


def block_digests(
    tokens: Sequence[int] | bytes, namespace: Hashable, start: int, stop: int, prev: bytes | None = None
) -> list[bytes]:
    """Digests of blocks ``start .. stop - 1`` of ``tokens`` (token ids, or their int32 bytes).

    Args:
        tokens: at least ``16 * stop`` token ids.
        namespace: the sequence's namespace (as :func:`namespace_seed`).
        start, stop: block range (``0 <= start <= stop``).
        prev: the digest of block ``start - 1`` when the caller has it (else it is recomputed
            from block 0).

    Raises:
        ValueError: the range is empty-negative or runs past ``tokens``.
    """
    raw = tokens if isinstance(tokens, (bytes, bytearray)) else array("i", tokens).tobytes()
    if not 0 <= start <= stop or len(raw) < 4 * BLOCK_TOKENS * stop:
        raise ValueError(f"block range [{start}, {stop}) outside {len(raw) // 4} tokens")
    bb = 4 * BLOCK_TOKENS
    d = prev
    first = start
    if d is None:
        d = namespace_seed(namespace)
        first = 0
    out = []
    for b in range(first, stop):
        d = hashlib.blake2b(d + raw[b * bb : (b + 1) * bb], digest_size=_SIZE).digest()
        if b >= start:
            out.append(d)
    return out


def tail_digest(parent: bytes) -> bytes:
    """The name of the *tail* after ``parent`` (16 bytes): the partial block (1 to 15 tokens)
    that follows the block whose chained digest is ``parent`` (or the namespace's seed, for a
    tail at position 0). Domain-separated from every block digest (blake2b's personalization),
    so a tail's name never equals a block's; chained like them over every earlier token and the
    namespace, so a tail is found only after exactly the tokens it was computed after."""
    return hashlib.blake2b(parent, digest_size=_SIZE, person=b"radixkv-tail").digest()
