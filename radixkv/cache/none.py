"""``prefix_cache="none"``: the prefix-cache protocol with nothing ever cached."""

from __future__ import annotations

from typing import Any, Optional

from radixkv.cache.base import MatchResult, PeekResult, Tokens
from radixkv.cache.hash_cache import as_token_array
from radixkv.cache.tenants import check_quotas
from radixkv.memory.slots import as_int64, empty_slots
from radixkv.namespace import Namespace

__all__ = ["NoPrefixCache"]


class NoPrefixCache:
    """Prefix caching off: nothing is ever cached, so no request reuses another's KV.

    ``shares_prefixes`` is False: the KV manager never hands a running request's pages over
    (there is nothing to share them with). ``match_prefix`` always returns an empty match
    (``length`` 0, ``node`` None); so does ``peek``. ``insert(tokens, slots)`` caches nothing and returns
    ``len(tokens) // page_size * page_size``, i.e. it reports every whole page as "already
    cached", so the caller frees all of those slots as duplicates and the unaligned tail as usual:
    every slot goes back to the allocator. Locking, eviction and reset are no-ops
    (``evict``/``reset`` return an empty slot array), all sizes are 0.

    Raises:
        ValueError: a bad ``page_size``, malformed ``tokens``/``slots``, ``len(slots) !=
            len(tokens)`` or a negative ``num_tokens``.
    """

    shares_prefixes = False

    def __init__(self, page_size: int = 1) -> None:
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
        self.page_size = page_size

    def match_prefix(self, tokens: Tokens, namespace: Namespace | None = None) -> MatchResult:
        as_token_array(tokens)
        return MatchResult(empty_slots(), 0, None)

    def peek(self, tokens: Tokens, namespace: Namespace | None = None, context: int = 8) -> PeekResult:
        as_token_array(tokens)
        return PeekResult(0, 0, (), False)

    def insert(self, tokens: Tokens, slots: Any, namespace: Namespace | None = None) -> int:
        arr = as_token_array(tokens)
        sl = as_int64(slots)
        if len(sl) != len(arr):
            raise ValueError(f"len(slots) must equal len(tokens) ({len(arr)}), got {len(sl)}")
        return len(arr) // self.page_size * self.page_size

    def inc_lock_ref(self, node: Any) -> None:
        return None

    def dec_lock_ref(self, node: Any) -> None:
        return None

    def evict(self, num_tokens: int) -> Any:
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return empty_slots()

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def total_size(self) -> int:
        return 0

    def reset(self) -> Any:
        return empty_slots()

    def check_integrity(self) -> None:
        return None

    def tenant_sizes(self) -> dict:
        return {}

    def tenant_count(self, tenant: str) -> int:
        return 0

    def take_changed_tenants(self) -> set:
        return set()

    def set_tenant_quotas(self, quotas: Optional[dict]) -> None:
        check_quotas(quotas)  # nothing is ever cached, so no quota ever applies
