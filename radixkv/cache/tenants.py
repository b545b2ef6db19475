"""Per-tenant bookkeeping of a prefix cache: cached tokens per tenant and soft quotas.

A tenant is the ``tenant`` field of a :class:`~radixkv.namespace.Namespace` (the server sets it
from the API key; None for the shared default and for every namespace without one). One tenant
spans all its namespaces (its salts and extra keys). :class:`TenantLedger` counts, per tenant,
the tokens the cache holds in its namespaces (evictable and protected alike: a pinned or locked
prefix counts), kept up to date by the cache at every insert, eviction and reset (never a scan).

Quotas are soft: ``kv_quota_tokens`` caps nothing at insert time (a prompt longer than its quota
still runs and is cached); when the pool must evict, a tenant above its quota loses its least
recently used pages first, until it is back within it, and only then does the cache's normal
policy pick among everyone's pages (``RadixCache.evict``, ``HashBlockCache.evict``). So a tenant
flooding the cache with unique prompts evicts its own pages, not another tenant's prefixes while
that tenant stays within its quota.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping, Optional

from radixkv.namespace import Namespace

__all__ = ["TenantLedger", "tenant_of", "check_quotas"]


def tenant_of(namespace: Any) -> Optional[str]:
    """The tenant of a namespace as a cache holds it (a :class:`Namespace`, None, or any other
    hashable the Python API passed through, which has none)."""
    return namespace.tenant if type(namespace) is Namespace else None


def check_quotas(quotas: Optional[Mapping[str, int]]) -> dict[str, int]:
    """``quotas`` (tenant name -> kv_quota_tokens) checked and copied; None is no quota.

    Raises:
        ValueError: not a mapping, a tenant that is not a non-empty str, or a quota that is not
            an int >= 0 (naming the tenant).
    """
    if quotas is None:
        return {}
    if not isinstance(quotas, Mapping):
        raise ValueError(f"tenant quotas must map tenant names to token counts, got {type(quotas).__name__}")
    out: dict[str, int] = {}
    for tenant, q in quotas.items():
        if not isinstance(tenant, str) or not tenant:
            raise ValueError(f"tenant quotas: a tenant name must be a non-empty str, got {tenant!r}")
        if isinstance(q, bool) or not isinstance(q, int) or q < 0:
            raise ValueError(f"tenant quotas: kv_quota_tokens of tenant {tenant!r} must be an int >= 0, got {q!r}")
        out[tenant] = q
    return out


class TenantLedger:
    """Cached tokens per tenant and the tenants' quotas (module docstring).

    Attributes:
        tokens: tenant -> tokens cached in its namespaces (tenants with none are absent; the
            shared default and namespaces without a tenant are under None).
        quotas: tenant -> kv_quota_tokens (tenants without a quota are absent).
        changed: the named tenants whose count changed since :meth:`take_changed` (the engine's
            per-tenant stats follow them instead of walking every tenant).
    """

    __slots__ = ("tokens", "quotas", "changed")

    def __init__(self, quotas: Optional[Mapping[str, int]] = None) -> None:
        self.tokens: dict[Optional[str], int] = {}
        self.quotas: dict[str, int] = check_quotas(quotas)
        self.changed: set[str] = set()

    def add(self, tenant: Optional[str], n: int) -> None:
        """``n`` more (or, negative, fewer) cached tokens of ``tenant``."""
        if tenant is not None:
            self.changed.add(tenant)
        v = self.tokens.get(tenant, 0) + n
        if v:
            self.tokens[tenant] = v
        else:
            self.tokens.pop(tenant, None)

    def over(self, tenant: Optional[str]) -> int:
        """Tokens ``tenant`` holds beyond its quota (<= 0: within it, or no quota)."""
        q = self.quotas.get(tenant) if tenant is not None else None
        return 0 if q is None else self.tokens.get(tenant, 0) - q

    def over_quota(self) -> Iterator[tuple[str, int]]:
        """``(tenant, tokens beyond its quota)`` of every tenant above its quota."""
        for tenant, q in self.quotas.items():
            over = self.tokens.get(tenant, 0) - q
            if over > 0:
                yield tenant, over

    def clear(self) -> None:
        """The cache was emptied."""
        self.changed.update(t for t in self.tokens if t is not None)
        self.tokens.clear()

    def take_changed(self) -> set[str]:
        """:attr:`changed`, emptied."""
        out, self.changed = self.changed, set()
        return out

    def sizes(self) -> dict[Optional[str], int]:
        """A copy of :attr:`tokens`."""
        return dict(self.tokens)
