"""vLLM-style automatic prefix caching (chained block hashes), behind the
:class:`~radixkv.cache.base.PrefixCache` protocol so the engine can swap it for the radix tree.

:class:`HashBlockCache` follows vLLM's automatic prefix caching (vLLM docs, "Automatic Prefix
Caching" design; Kwon et al., "Efficient Memory Management for Large Language Model Serving with
PagedAttention", SOSP 2023):

* only *full* blocks of ``page_size`` tokens are cached;
* block ``i``'s key is ``H(key[i-1], tokens[i*B:(i+1)*B], extra_keys)`` with ``extra_keys`` holding
  the namespace, so a key identifies the block *and its whole prefix*; ``H`` is SHA-256 over a
  stable byte serialization by default (the tokens as int64 little-endian, the namespace as
  :func:`radixkv.namespace.namespace_key`; a process-local namespace's keys are ``(namespace,
  digest)`` pairs, so it is isolated by ``==`` as in the tree); ``hash_algo="builtin"`` uses
  Python's 64-bit ``hash``, faster but with a small collision risk, as vLLM's ``builtin`` option;
* a lookup hashes the prompt's full blocks in order and stops at the first miss;
* every cached block has a reference count (``lock_ref``: running requests using it); blocks whose
  count drops to zero stay cached in an LRU *free queue* and are evicted lazily, least recently
  freed first. A request's blocks are released tail first, so a chain's tail leaves before its
  head. Any unreferenced block can go, also one whose descendants stay cached: those become
  unreachable (a lookup stops at the missing parent) until the parent's key is cached again.

The differences from the token-level radix tree are the point of comparing them: the hash cache
never shares a partial block (a prompt that diverges inside a block re-computes that whole block),
and eviction is per block, not per leaf.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any, Hashable, Optional, Sequence

import numpy as np

from radixkv.cache.base import MatchResult, PeekResult, Tokens
from radixkv.cache.tenants import TenantLedger, check_quotas, tenant_of
from radixkv.memory.slots import as_int64, empty_slots, is_tensor, slot_array
from radixkv.namespace import Namespace, namespace_key

__all__ = ["HashBlockCache", "BlockChain", "as_token_array"]

_ROOT_SHA = b"\x00" * 32


def as_token_array(tokens: Tokens) -> np.ndarray:
    """``tokens`` as a 1-D int64 numpy array (ValueError if it is not 1-D integer data)."""
    if is_tensor(tokens):
        arr = tokens.detach().cpu().numpy()
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            raise ValueError(f"tokens must be a 1-D integer tensor, got shape {tuple(arr.shape)} dtype {tokens.dtype}")
        return arr.astype(np.int64, copy=False)
    arr = np.asarray(tokens if len(tokens) else [], dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be a 1-D sequence of ints, got shape {arr.shape}")
    return arr


class _Block:
    """One cached full block: its key, its parent's key (:func:`_root_key` for a first block),
    the first of its ``page_size`` contiguous slots, its reference count, whether it is still
    the table entry for its key, its tenant and its place in the free queues (``stamp``: they
    are ordered by it)."""

    __slots__ = ("key", "parent", "start", "ref", "live", "tenant", "stamp")

    def __init__(self, key: Hashable, parent: Hashable, start: int, tenant: Optional[str]) -> None:
        self.key = key
        self.parent = parent
        self.start = start
        self.ref = 0
        self.live = True
        self.tenant = tenant
        self.stamp = 0


def _root_key(namespace: Namespace | None) -> tuple:
    """The parent key of a namespace's first blocks, in :attr:`HashBlockCache._kids` (a tuple
    starting with None, so it never equals a block key: an int, bytes, or ``(Namespace, bytes)``).
    Any hashable ``Namespace.of`` accepts (``"a"`` and ``Namespace(extra_key="a")`` alike)."""
    return (None, Namespace.of(namespace))


class BlockChain:
    """The handle :meth:`HashBlockCache.match_prefix` returns as ``MatchResult.node``: the matched
    blocks, root first (empty when nothing matched). Locking it pins every block in the chain."""

    __slots__ = ("blocks",)

    def __init__(self, blocks: tuple) -> None:
        self.blocks = blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def __repr__(self) -> str:
        return f"BlockChain({len(self.blocks)} blocks)"


class HashBlockCache:
    """Automatic prefix caching with chained block hashes (see the module docstring).

    Args:
        page_size: tokens per block (``>= 1``); a block's slots are one page of the engine's
            :class:`~radixkv.memory.allocator.SlotAllocator` (contiguous, ascending).
        hash_algo: ``"sha256"`` (default; collision-safe, stable across processes) or
            ``"builtin"`` (Python ``hash`` of a tuple; faster, 64-bit).

    ``tenant_quotas`` (tenant -> ``kv_quota_tokens``, :mod:`radixkv.cache.tenants`): soft quotas;
    :meth:`evict` first takes the least recently freed blocks of tenants above their quota, until
    they are within it, then the free queue's head as usual. Cached tokens are counted per tenant
    either way (:meth:`tenant_sizes`).

    Sizes (``evictable_size`` etc.) are in tokens (= slots). Slots are 1-D int64 slot arrays
    (:func:`radixkv.memory.slots.slot_array`). Raises ``ValueError`` for a bad ``page_size``/``hash_algo``, malformed ``tokens`` or
    ``slots``, ``len(slots) != len(tokens)``, a block whose slots are not one contiguous page, a
    negative ``num_tokens``, ``dec_lock_ref`` below zero and bad ``tenant_quotas``; ``RuntimeError``
    for ``reset`` while blocks are locked.
    """

    shares_prefixes = True

    def __init__(self, page_size: int = 16, hash_algo: str = "sha256", tenant_quotas: Optional[dict] = None) -> None:
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
        if hash_algo not in ("sha256", "builtin"):
            raise ValueError(f"hash_algo must be 'sha256' or 'builtin', got {hash_algo!r}")
        self.page_size = page_size
        self.hash_algo = hash_algo
        self._offsets = np.arange(page_size, dtype=np.int64)
        self._table: dict[Hashable, _Block] = {}
        # Unreferenced cached blocks, least recently freed first (vLLM's free block queue).
        self._free: OrderedDict[int, _Block] = OrderedDict()
        self._num_blocks = 0  # table entries + retired (replaced) blocks not yet evicted
        self._num_locked = 0  # blocks with ref > 0
        self._kids: dict[Hashable, int] = {}  # parent key -> live table entries under it (for peek)
        self.tenants = TenantLedger(tenant_quotas)
        """Cached tokens per tenant and the quotas (:class:`~radixkv.cache.tenants.TenantLedger`)."""
        # the free queue of each tenant with a quota (the same order: ascending stamps)
        self._tfree: dict[str, OrderedDict] = {t: OrderedDict() for t in self.tenants.quotas}
        self._back = 0  # the stamp of the last block queued at the tail
        self._front = 0  # the stamp of the last block queued at the head

    # ------------------------------------------------------------------ the free queues
    def _queue(self, blk: _Block, front: bool = False) -> None:
        """``blk`` (unreferenced) joins the free queue and its tenant's: at the tail, or the head."""
        if front:
            self._front -= 1
            blk.stamp = self._front
        else:
            self._back += 1
            blk.stamp = self._back
        for q in (self._free, self._tfree.get(blk.tenant)) if self._tfree else (self._free,):
            if q is not None:
                q[id(blk)] = blk
                if front:
                    q.move_to_end(id(blk), last=False)

    def _dequeue(self, blk: _Block) -> None:
        """``blk`` leaves the free queues (it is referenced, or evicted)."""
        del self._free[id(blk)]
        if self._tfree:
            q = self._tfree.get(blk.tenant)
            if q is not None:
                del q[id(blk)]

    def _drop(self, blk: _Block) -> None:
        """Forget the evicted ``blk`` (already out of the free queues)."""
        if blk.live:
            del self._table[blk.key]
            blk.live = False
            left = self._kids[blk.parent] - 1
            if left:
                self._kids[blk.parent] = left
            else:
                del self._kids[blk.parent]
        self._num_blocks -= 1
        self.tenants.add(blk.tenant, -self.page_size)

    # ------------------------------------------------------------------ hashing
    def block_keys(self, tokens: Tokens, namespace: Namespace | None = None) -> list:
        """Chained keys of the full blocks of ``tokens`` (``len(tokens) // page_size`` of them).
        ``namespace``: a ``Namespace``, None, or any hashable ``Namespace.of`` accepts (``"a"``
        and ``Namespace(extra_key="a")`` give the same keys)."""
        ns = Namespace.of(namespace)
        arr = as_token_array(tokens)
        n = len(arr) // self.page_size
        if n == 0:
            return []
        blocks = arr[: n * self.page_size].reshape(n, self.page_size)
        keys = []
        if self.hash_algo == "builtin":
            parent: Hashable = None
            for row in blocks.tolist():
                parent = hash((parent, tuple(row), ns))
                keys.append(parent)
            return keys
        extra = namespace_key(ns)
        parent_b = _ROOT_SHA
        for row in blocks.astype("<i8"):
            h = hashlib.sha256(parent_b)
            h.update(row.tobytes())
            h.update(extra)
            parent_b = h.digest()
            keys.append(parent_b)
        if ns is not None and not ns.persistable:
            return [(ns, k) for k in keys]  # its bytes are not unique: == isolates it
        return keys

    # ------------------------------------------------------------------ protocol
    def _slots_of(self, blocks: Sequence[_Block]) -> Any:
        if not blocks:
            return empty_slots()
        starts = np.fromiter((b.start for b in blocks), dtype=np.int64, count=len(blocks))
        return slot_array((starts[:, None] + self._offsets).reshape(-1))

    def match_prefix(self, tokens: Tokens, namespace: Namespace | None = None) -> MatchResult:
        """Longest cached run of leading full blocks of ``tokens`` (stops at the first miss).

        Returns ``MatchResult(slots [length] int64, length (multiple of page_size), node)`` with
        ``node`` a :class:`BlockChain` of the matched blocks. Does not change LRU order (a block's
        place in the free queue is set when it is released, as in vLLM)."""
        found = []
        table = self._table
        for key in self.block_keys(tokens, namespace):
            blk = table.get(key)
            if blk is None:
                break
            found.append(blk)
        return MatchResult(self._slots_of(found), len(found) * self.page_size, BlockChain(tuple(found)))

    def peek(self, tokens: Tokens, namespace: Namespace | None = None, context: int = 8) -> PeekResult:
        """Read-only look at ``tokens``' cached blocks (the protocol's ``peek``): ``length`` as
        :meth:`match_prefix` (which changes nothing either); ``token_length == length`` (a block
        cache cannot look inside a block); ``next_tokens`` is empty (blocks keep no tokens);
        ``diverged`` is True when another cached block follows the last matched one."""
        keys = self.block_keys(tokens, namespace)
        table = self._table
        found = 0
        while found < len(keys) and keys[found] in table:
            found += 1
        diverged = False
        if found < len(keys):
            parent = keys[found - 1] if found else _root_key(namespace)
            diverged = self._kids.get(parent, 0) > 0
        length = found * self.page_size
        return PeekResult(length, length, (), diverged)

    def insert(self, tokens: Tokens, slots: Any, namespace: Namespace | None = None) -> int:
        """Cache the full blocks of ``tokens`` whose KV lives in ``slots`` (``len(slots) ==
        len(tokens)``).

        Returns the number of leading tokens whose blocks were already cached: the cache keeps
        its own slots for those and the caller frees its duplicates among ``slots[:returned]``.
        For every later full block the cache takes ownership of the caller's slots (the new
        blocks start unreferenced, i.e. evictable, and join the free queue tail first). The caller keeps (and frees) the partial tail
        ``slots[len(tokens)//page_size*page_size:]``. A block key found again *after* a missing
        block belongs to an orphan (its parent was evicted, so nothing can lock it): the caller's
        block replaces it as the table entry and the orphan is moved to the front of the free
        queue, to be returned by the next :meth:`evict`.
        """
        arr = as_token_array(tokens)
        sl = as_int64(slots)
        if len(sl) != len(arr):
            raise ValueError(f"len(slots) must equal len(tokens) ({len(arr)}), got {len(sl)}")
        keys = self.block_keys(arr, namespace)
        if not keys:
            return 0
        ps = self.page_size
        pages = sl[: len(keys) * ps].reshape(len(keys), ps)
        starts = pages[:, 0]
        if ps > 1:
            ok = (pages - starts[:, None] == self._offsets).all(axis=1)
            if not ok.all():
                i = int(np.argmin(ok))
                raise ValueError(
                    f"slots of block {i} (tokens {i * ps}..{(i + 1) * ps - 1}) must "
                    f"be one page: {ps} contiguous ascending slots"
                )
        starts_l = starts.tolist()
        table, kids = self._table, self._kids
        tenant = tenant_of(Namespace.of(namespace))
        prefix_blocks = 0
        n = len(keys)
        while prefix_blocks < n and keys[prefix_blocks] in table:
            prefix_blocks += 1
        # New blocks join the free queue tail first (as vLLM frees a finished request's blocks),
        # so under pressure a chain loses its tail before its head.
        for i in range(n - 1, prefix_blocks - 1, -1):
            key = keys[i]
            parent = keys[i - 1] if i else _root_key(namespace)
            old = table.get(key)
            if old is not None:  # an orphan (unreferenced): retire it, to be evicted first
                old.live = False
                if old.ref == 0:
                    self._dequeue(old)
                    self._queue(old, front=True)
            else:
                kids[parent] = kids.get(parent, 0) + 1
            blk = _Block(key, parent, starts_l[i], tenant)
            table[key] = blk
            self._queue(blk)
            self._num_blocks += 1  # a retired orphan keeps its count until evicted
        if n > prefix_blocks:
            self.tenants.add(tenant, (n - prefix_blocks) * ps)
        return prefix_blocks * ps

    def inc_lock_ref(self, node: BlockChain) -> None:
        """Pin every block of ``node`` (ref += 1; a block leaving ref 0 leaves the free queue)."""
        for blk in node.blocks:
            if blk.ref == 0:
                self._dequeue(blk)
                self._num_locked += 1
            blk.ref += 1

    def dec_lock_ref(self, node: BlockChain) -> None:
        """Unpin every block of ``node``; blocks reaching ref 0 join the free queue's tail, the
        chain's last block first (so tails are evicted before heads). ValueError below zero."""
        for blk in node.blocks:
            if blk.ref <= 0:
                raise ValueError("dec_lock_ref on a block whose lock_ref is already 0")
        for blk in reversed(node.blocks):
            blk.ref -= 1
            if blk.ref == 0:
                self._queue(blk)
                self._num_locked -= 1

    def evict(self, num_tokens: int) -> Any:
        """Evict unreferenced blocks, least recently freed first, until at least ``num_tokens``
        slots are freed or none is left; returns their slots (1-D int64) for the allocator."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        out: list = []
        freed = self._evict_over_quota(num_tokens, out) if self._tfree else 0
        free = self._free
        while freed < num_tokens and free:
            blk = next(iter(free.values()))
            self._dequeue(blk)
            self._drop(blk)
            out.append(blk)
            freed += self.page_size
        return self._slots_of(out)

    def _evict_over_quota(self, num_tokens: int, out: list) -> int:
        """``evict``'s first phase: while tenants are above their quota, the least recently freed
        block among theirs, until ``num_tokens`` are freed or none of them has an unreferenced
        block left; returns the tokens freed (the blocks appended to ``out``)."""
        freed = 0
        while freed < num_tokens:
            best = None
            for tenant, _ in self.tenants.over_quota():
                q = self._tfree[tenant]
                if q:
                    head = next(iter(q.values()))
                    if best is None or head.stamp < best.stamp:
                        best = head
            if best is None:
                break
            self._dequeue(best)
            self._drop(best)
            out.append(best)
            freed += self.page_size
        return freed

    def evictable_size(self) -> int:
        """Tokens in unreferenced cached blocks (what :meth:`evict` can free)."""
        return len(self._free) * self.page_size

    def protected_size(self) -> int:
        """Tokens in cached blocks locked by at least one request."""
        return self._num_locked * self.page_size

    def total_size(self) -> int:
        """Tokens (= slots) the cache holds."""
        return self._num_blocks * self.page_size

    def reset(self) -> Any:
        """Drop everything; returns all slots the cache held. RuntimeError if any block is locked."""
        if self._num_locked:
            raise RuntimeError(f"reset() while {self._num_locked} blocks are locked")
        out = self._slots_of(list(self._free.values()))
        self._table.clear()
        self._free.clear()
        self._kids.clear()
        self._num_blocks = 0
        self.tenants.clear()
        for q in self._tfree.values():
            q.clear()
        return out

    def tenant_sizes(self) -> dict:
        """Tokens cached per tenant (``Namespace.tenant``; None: namespaces without a tenant),
        referenced blocks included; tenants with none are absent. O(tenants)."""
        return self.tenants.sizes()

    def tenant_count(self, tenant: str) -> int:
        """Tokens cached in ``tenant``'s namespaces (O(1))."""
        return self.tenants.tokens.get(tenant, 0)

    def take_changed_tenants(self) -> set:
        """The named tenants whose cached tokens changed since the last call (O(them))."""
        return self.tenants.take_changed()

    def set_tenant_quotas(self, quotas: Optional[dict]) -> None:
        """Replace the tenants' soft quotas (tenant -> ``kv_quota_tokens``; None: none); O(free
        blocks). Raises ValueError for bad quotas (nothing is changed then)."""
        self.tenants.quotas = check_quotas(quotas)
        self._tfree = {t: OrderedDict() for t in self.tenants.quotas}
        for blk in self._free.values():  # in queue order, so each tenant's queue keeps it
            q = self._tfree.get(blk.tenant)
            if q is not None:
                q[id(blk)] = blk

    def check_integrity(self) -> None:
        """Raise AssertionError if the table, free queue, counters or slot ownership disagree."""
        ps = self.page_size
        live = list(self._table.values())
        retired = [b for b in self._free.values() if not b.live]
        for k, b in self._table.items():
            if b.key != k or not b.live:
                raise AssertionError("table entry does not match its block")
        for b in self._free.values():
            if b.ref != 0:
                raise AssertionError("free queue holds a referenced block")
        locked = sum(1 for b in live if b.ref > 0)
        if any(b.ref < 0 for b in live):
            raise AssertionError("negative lock_ref")
        if sum(1 for b in live if b.ref == 0) + len(retired) != len(self._free):
            raise AssertionError("an unreferenced block is missing from the free queue")
        if locked != self._num_locked or len(live) + len(retired) != self._num_blocks:
            raise AssertionError("block counters disagree with the table")
        if self.evictable_size() + self.protected_size() != self.total_size():
            raise AssertionError("evictable + protected != total")
        starts = [b.start for b in live] + [b.start for b in retired]
        if ps > 1 and any(s % ps for s in starts):
            raise AssertionError("a block does not start on a page boundary")
        if len(set(starts)) != len(starts):
            raise AssertionError("a slot is owned by two cached blocks")
        kids: dict = {}
        for b in live:
            kids[b.parent] = kids.get(b.parent, 0) + 1
        if kids != self._kids:
            raise AssertionError("child counts (for peek) disagree with the table")
        self._check_tenants()

    def _check_tenants(self) -> None:
        """The per-tenant counts and free queues of :meth:`check_integrity` (AssertionError)."""
        stamps = [b.stamp for b in self._free.values()]
        if stamps != sorted(stamps):
            raise AssertionError("the free queue is out of stamp order")
        for t, q in self._tfree.items():
            if list(q.values()) != [b for b in self._free.values() if b.tenant == t]:
                raise AssertionError(f"the free queue of tenant {t!r} disagrees with the free queue")
        counts: dict = {}
        for b in list(self._table.values()) + [b for b in self._free.values() if not b.live]:
            counts[b.tenant] = counts.get(b.tenant, 0) + self.page_size
        if counts != self.tenants.tokens:
            raise AssertionError(f"tokens per tenant {self.tenants.tokens}, recounted {counts}")
