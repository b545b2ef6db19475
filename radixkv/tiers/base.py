"""PLACEHOLDER (replaced by the stores helper's module at merge): `BlockKey`, `Block`, `PageStore`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

__all__ = ["BlockKey", "Block", "PageStore"]


@dataclass(frozen=True)
class BlockKey:
    """(model fingerprint, namespace key, chained block digest): 16, any, 16 bytes."""

    fingerprint: bytes
    namespace: bytes
    digest: bytes

    def to_bytes(self) -> bytes:
        return self.fingerprint + len(self.namespace).to_bytes(4, "big") + self.namespace + self.digest

    def hex(self) -> str:
        return self.to_bytes().hex()


@dataclass(frozen=True)
class Block:
    """16 token ids, their K/V payload (opaque bytes) and the engine's layout description."""

    tokens: tuple
    payload: bytes
    meta: bytes = b""


@runtime_checkable
class PageStore(Protocol):
    medium: str
    capacity_bytes: int
    used_bytes: int

    def contains(self, keys: Sequence[BlockKey]) -> list: ...

    def get(self, keys: Sequence[BlockKey], tokens: Sequence[tuple]) -> list: ...

    def put(self, keys: Sequence[BlockKey], blocks: Sequence[Block]) -> None: ...

    def delete_all(self) -> None: ...

    def stats(self) -> dict: ...

    def close(self) -> None: ...
