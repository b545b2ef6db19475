"""KV tiers below the pool (docs/tiers.md): keys, blocks and the stores' protocol.

PLACEHOLDER of the engine-integration branch (w2-tierengine): the stores helper's package
(``radixkv/tiers/`` with ``HostStore``, ``DiskStore``, ``RedisStore`` and the codec) replaces it
at merge; only the names of the contract (tiers_contract.md) are defined here.
"""

from radixkv.tiers.base import Block, BlockKey, PageStore

__all__ = ["Block", "BlockKey", "PageStore"]
