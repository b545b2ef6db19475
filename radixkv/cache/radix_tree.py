"""Token-level radix tree from token sequences to KV slots (SGLang's RadixAttention).

Algorithm: the radix tree of Zheng et al., "SGLang: Efficient Execution of Structured Language
Model Programs" (2024), section 3: every edge holds a run of tokens and the KV slot of each of
them; a lookup walks from the root comparing whole edges, splitting an edge where a match ends
inside it; unlocked leaves are evicted least-recently-used first, and a parent whose last child
goes becomes a leaf in its turn.

Representation (docs/cache.md has the measurements behind it):

* an edge's tokens are a ``bytes`` object of int32 ids (4 bytes a token, native byte order) and
  its slots a ``bytes`` object of int64 slot indices (8 bytes a token): compact, compared with
  ``memcmp``, copied with ``memcpy``, freed in one piece;
* children are found through a dict keyed by the child's first page of tokens as ``bytes``
  (the first token when ``page_size == 1``);
* the descent runs in the C helper ``radixkv.cache._cprefix`` when it is built, else in pure
  Python (same results; see :mod:`radixkv.cache.token_keys`): ``match_walk`` reads a query's
  list of ints in place (no packed copy), compares whole edges, validates every token before it
  touches the tree, and hands back the matched slots: the node's own ``value`` bytes when one
  edge holds them all (the result tensor is a read-only view of them: an edge's bytes are never
  written, splits and evictions make new ones), else one ``bytearray`` they are copied into
  (``torch.frombuffer`` either way); ``insert_walk`` returns, with the descent, the new leaf's key
  and its slots read straight from the caller's tensor memory;
* the evictable leaves (no children, ``lock_ref == 0``) are kept, incrementally, in two ordered
  containers: a node enters when it becomes an unlocked leaf and leaves when it gets a child, is
  locked or is evicted, so eviction never scans the tree. A leaf entering with the current time
  (a new leaf, a refreshed leaf) is appended to an ``OrderedDict`` (which stays sorted because
  the clock only grows; O(1) append, move-to-end and pop-oldest); one entering with an older
  time (unlocked by ``dec_lock_ref``, or a parent whose last child was evicted) goes into a
  ``sortedcontainers.SortedList`` of ``(last_access, uid, node)``. ``evict`` takes the older of
  the two heads each time: exact LRU order;
* ``last_access`` is a logical clock bumped once per ``match_prefix`` / ``insert`` call.

Namespaces: the root has one child per namespace (an empty-key node, dropped when emptied),
keyed by the namespace as given (a :class:`~radixkv.namespace.Namespace` or None: the engine
passes ``Namespace.of``'s; any hashable works, compared by ``==``); lookups start there, so
sequences in different namespaces never share a node.
"""

from __future__ import annotations

import operator
from collections import OrderedDict
from itertools import count
from typing import Any, Callable, Iterator, Optional, Union

import numpy as np
from sortedcontainers import SortedList

from radixkv.cache import token_keys
from radixkv.cache.base import MatchResult, PeekResult, Tokens
from radixkv.cache.check import check_tree, format_tree
from radixkv.cache.evict_policy import EvictionPolicy, make_policy
from radixkv.cache.tenants import TenantLedger, check_quotas, tenant_of
from radixkv.cache.token_keys import (
    HAS_CEXT,
    SLOT_SHIFT,
    TOKEN_SHIFT,
    as_slot_array,
    pack_tokens,
    query_tokens,
    slot_tensor_address,
)
from radixkv.memory.slots import buffer_reader, empty_slots
from radixkv.namespace import Namespace

__all__ = ["RadixCache", "TreeNode", "HAS_CEXT"]

_uids = count()
_EMPTY = b""
_PEEK_SCAN = 64  # children compared token by token when a page matches none exactly (peek)
_tuple_new = tuple.__new__


def _path_key(node: "TreeNode") -> bytes:
    """The int32 token bytes from ``node``'s namespace root to the end of its edge."""
    parts = []
    while node.key:
        parts.append(node.key)
        node = node.parent
    return b"".join(reversed(parts))


def _next_tokens(node: "TreeNode", offset: int, context: int) -> tuple:
    """Up to ``context`` token ids of ``node``'s edge from token ``offset`` on, continued down the
    most recently added child of each node (read-only)."""
    out: list = []
    while node is not None and len(out) < context:
        out += np.frombuffer(node.key, dtype=np.int32)[offset : offset + context - len(out)].tolist()
        offset = 0
        node = next(reversed(node.children.values())) if node.children else None
    return tuple(out)


def _match_result(slots: Any, length: int, node: Any) -> MatchResult:
    """``MatchResult(slots, length, node)`` through ``tuple.__new__`` directly (the named
    tuple's generated ``__new__`` is a Python function; this skips that frame)."""
    return _tuple_new(MatchResult, (slots, length, node))


class TreeNode:
    """One edge of the tree and the node it leads to.

    Attributes:
        key: the edge's token ids as an int32 buffer (``bytes``; empty for the root and the
            namespace roots).
        value: the edge's KV slots as an int64 buffer (``bytes``, native byte order, 8 bytes
            a token: ``len(value) == 2 * len(key)``); :meth:`slots` decodes it.
        children: child nodes keyed by their first page of tokens (``bytes``).
        parent: the parent node; ``None`` for the root and for nodes no longer in a tree.
        lock_ref: number of live locks whose path passes through this node.
        last_access: logical time of the last match/insert that walked through this node.
        namespace: the namespace this node belongs to (its namespace root's key).
        lru: where the node sits in the evictable-leaf set: ``None`` (not in it), ``True`` (in
            the OrderedDict of current-time entries) or its ``SortedList`` entry tuple.
        hits: match / insert calls that walked through this node (kept only under an eviction
            policy that uses it, else 0).
        tq: the evictable-leaf set of its tenant when that tenant has a quota (a ``SortedList``
            of ``(last_access, uid, node)``), else None; ``tentry``: its entry there, or None.
    """

    __slots__ = (
        "key", "value", "children", "parent", "lock_ref", "last_access", "uid", "namespace", "lru", "hits", "tq",
        "tentry",
    )  # fmt: skip

    def __init__(
        self,
        key: bytes,
        value: bytes,
        parent: Optional["TreeNode"],
        namespace: Namespace | None,
        last_access: int,
        tq: Optional[SortedList] = None,
    ) -> None:
        self.key = key
        self.value = value
        self.children: dict = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = last_access
        self.uid = next(_uids)
        self.namespace = namespace
        self.lru: Any = None
        self.hits = 0
        self.tq = tq
        self.tentry: Any = None

    def tokens(self) -> list:
        """The edge's token ids as a list of int."""
        return np.frombuffer(self.key, dtype=np.int32).tolist()

    def slots(self) -> list:
        """The edge's KV slot indices as a list of int."""
        return np.frombuffer(self.value, dtype=np.int64).tolist()

    def __repr__(self) -> str:
        return (
            f"TreeNode(uid={self.uid}, len={len(self.key) >> TOKEN_SHIFT}, lock_ref={self.lock_ref}, "
            f"last_access={self.last_access}, children={len(self.children)})"
        )


class RadixCache:
    """Radix tree over token sequences mapping every cached token to its KV slot.

    Implements :class:`radixkv.cache.base.PrefixCache`. It owns no KV memory: slots come from
    the caller's :class:`~radixkv.memory.allocator.SlotAllocator` through :meth:`insert` and go
    back through the tensors returned by :meth:`evict` and :meth:`reset`. Not thread-safe.

    Args:
        page_size: tokens per KV page (int >= 1). With ``page_size > 1`` every edge holds a whole
            number of pages, matches are floored to whole pages and only whole pages are
            inserted.
        eviction_policy: which evictable leaf goes first: ``"lru"`` (the default: least recently
            used) or a name / object of :mod:`radixkv.cache.evict_policy` (``"lfu"``,
            ``"gdf"``, ``"reuse-odds"``). Whatever the policy, a leaf is freed tail first, page by
            page.
        tenant_quotas: tenant name -> ``kv_quota_tokens`` (soft quotas, :mod:`radixkv.cache.tenants`):
            when :meth:`evict` must free pages, tenants above their quota lose their least
            recently used leaves' tail pages first (down to the quota), then the policy picks.
            The tree counts the tokens of every tenant (:meth:`tenant_sizes`) either way.

    Raises:
        ValueError: ``page_size`` is not an int >= 1, an unknown ``eviction_policy``, or bad
            ``tenant_quotas``.
    """

    shares_prefixes = True

    def __init__(
        self,
        page_size: int = 1,
        eviction_policy: Union[str, EvictionPolicy] = "lru",
        tenant_quotas: Optional[dict] = None,
    ) -> None:
        if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
            raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
        self.page_size = page_size
        self.tenants = TenantLedger(tenant_quotas)
        """Cached tokens per tenant and the quotas (:class:`~radixkv.cache.tenants.TenantLedger`)."""
        self._policy = make_policy(eviction_policy)
        if self._policy is not None:
            self._policy.bind(page_size)
        self._counts_hits = self._policy is not None and self._policy.counts_hits
        self.eviction_policy = "lru" if self._policy is None else self._policy.name
        self._page_bytes = page_size << TOKEN_SHIFT
        self._read_slots = buffer_reader()
        self.evict_listener: Optional[Callable[[Optional[Namespace], bytes, int], None]] = None
        """Called as ``listener(namespace, path, start)`` for every node :meth:`evict` frees, before
        it is unlinked: ``path`` the int32 token bytes from the namespace root to the node's end,
        ``start`` the position of the node's first token (the engine's KV manager turns this into
        cache events). None: no call."""
        self._clock = 0
        self._init_state()

    def _init_state(self) -> None:
        self.root = TreeNode(b"", _EMPTY, None, None, 0)
        self._lru_new: OrderedDict = OrderedDict()  # uid -> node, oldest first
        self._lru_old: SortedList = SortedList()  # (last_access or policy priority, uid, node)
        self._total = 0
        self._protected = 0
        self.tenants.clear()
        # the evictable leaves of each tenant with a quota, least recently used first
        self._tenant_leaves: dict = {t: SortedList() for t in self.tenants.quotas}
        if self._policy is not None:
            self._policy.reset()

    # ------------------------------------------------------------------ evictable-leaf set

    def _lru_add(self, node: TreeNode) -> None:
        if self._policy is not None:
            self._pq_add(node, self._policy.priority(node))
        elif node.last_access == self._clock:
            self._lru_new[node.uid] = node
            node.lru = True
        else:
            node.lru = (node.last_access, node.uid, node)
            self._lru_old.add(node.lru)
        if node.tq is not None:
            self._tq_add(node)

    def _lru_remove(self, node: TreeNode) -> None:
        if node.lru is True:
            del self._lru_new[node.uid]
        else:
            self._lru_old.remove(node.lru)
        node.lru = None
        if node.tentry is not None:
            self._tq_drop(node)

    @staticmethod
    def _tq_add(node: TreeNode) -> None:
        """Files the evictable leaf ``node`` in its tenant's leaf set (a tenant with a quota)."""
        node.tentry = (node.last_access, node.uid, node)
        node.tq.add(node.tentry)

    @staticmethod
    def _tq_drop(node: TreeNode) -> None:
        node.tq.remove(node.tentry)
        node.tentry = None

    def _pq_add(self, node: TreeNode, priority: Any) -> None:
        """Files ``node`` under a policy's ``priority`` (policy mode: every entry is in the
        SortedList)."""
        node.lru = (priority, node.uid, node)
        self._lru_old.add(node.lru)

    def _count_hits(self, node: TreeNode) -> None:
        """One more hit on every node from ``node`` up to its namespace root (policy mode)."""
        while node.key:
            node.hits += 1
            node = node.parent

    def _lru_refresh(self, node: TreeNode, reuse: bool = True) -> None:
        """Re-files an evictable leaf whose last_access was just set to the current clock
        (``reuse``: a match reached it, which a policy is told of)."""
        if node.lru is True:
            self._lru_new.move_to_end(node.uid)
        elif self._policy is not None:
            self._lru_old.remove(node.lru)
            if reuse:
                self._policy.reused(node.lru[0], node)
            self._pq_add(node, self._policy.priority(node))
        else:
            self._lru_old.remove(node.lru)
            self._lru_new[node.uid] = node
            node.lru = True
        if node.tentry is not None:
            self._tq_drop(node)
            self._tq_add(node)

    # ------------------------------------------------------------------ lookup / insertion

    def _split(self, node: TreeNode, m: int, upper_value: Optional[bytes] = None) -> TreeNode:
        """Cuts ``node``'s edge after ``m`` tokens; returns the new upper node.

        ``node`` keeps the lower part, its children, lock_ref, last_access and LRU entry, so
        handles to it stay valid and still cover the same tokens. Both parts get new ``key`` /
        ``value`` bytes (the old ones are never changed: a slot view of them stays as it was);
        ``upper_value``, when given, is the upper part's value already cut (``bytes`` of the
        first ``m`` slots).
        """
        pb = self._page_bytes
        parent = node.parent
        key = node.key
        value = node.value
        if upper_value is None:
            upper_value = value[: m << SLOT_SHIFT]
        upper = TreeNode(key[: m << TOKEN_SHIFT], upper_value, parent, node.namespace, node.last_access, node.tq)
        upper.lock_ref = node.lock_ref
        upper.hits = node.hits
        parent.children[key[:pb]] = upper
        node.key = key = key[m << TOKEN_SHIFT :]
        node.value = value[m << SLOT_SHIFT :]
        node.parent = upper
        upper.children[key[:pb]] = node
        return upper

    def match_prefix(self, tokens: Tokens, namespace: Namespace | None = None) -> MatchResult:
        """Finds the longest cached prefix of ``tokens`` in ``namespace``.

        When the match ends inside an edge the edge is split there (at a page boundary), so
        ``.node`` always ends exactly at ``.length``. The last-access time of the matched path,
        and only of it, is refreshed.

        Args:
            tokens: token ids (list/tuple/array of int, or 1-D integer tensor), each in the
                int32 range.
            namespace: a ``Namespace`` or None (the shared default); only sequences inserted
                with an equal namespace match.

        Returns:
            :class:`MatchResult`: ``slots`` (1-D int64 CPU tensor of ``length`` slots),
            ``length`` (``len(tokens)`` floored to ``page_size`` at most, a multiple of it) and
            ``node`` (the tree root when nothing matched; locking the root is a no-op).

            ``slots`` is read-only and never changes: when one edge holds the whole match it is
            a view of that node's slot bytes (no copy; a 32k-token hit reads 256 KB less),
            else of a fresh buffer. The tree never writes into an edge's slot bytes (a split,
            an insert, an eviction or :meth:`reset` makes new ones), so a held ``slots`` keeps
            its values after any later call, and keeps those bytes alive (8 bytes a token)
            while it lives. Do not write into it (torch has no read-only tensors; writing
            would change the cache's own record of those slots): ``.clone()`` it first.

        Raises:
            ValueError: ``tokens`` is not 1-D integer or holds an id outside int32.
        """
        q = query_tokens(tokens)
        ns_root = self.root.children.get(namespace)
        if ns_root is None:
            if type(q) is not bytes:
                pack_tokens(q)  # validates the ids
            return _match_result(empty_slots(), 0, self.root)
        self._clock = tick = self._clock + 1
        try:
            node, pos, buf, child, m = token_keys.match_walk(ns_root, q, self.page_size, tick)
        except token_keys.NotAnInt:  # numpy integers etc. in a list: convert, then walk
            q = token_keys.int_tokens_for_retry(q)
            node, pos, buf, child, m = token_keys.match_walk(ns_root, q, self.page_size, tick)
        if child is not None:  # buf: the split's upper slots when they are all of the match
            node = self._split(child, m, buf if pos == 0 else None)
            node.last_access = tick
            pos += m
        if pos == 0:
            return _match_result(empty_slots(), 0, self.root)
        ns_root.last_access = tick
        if self._counts_hits:
            self._count_hits(node)
        lru = node.lru
        if lru is True and node.tentry is None:  # the common case of _lru_refresh, inlined
            self._lru_new.move_to_end(node.uid)
        elif lru is not None:
            self._lru_refresh(node)
        # buf: the pos matched int64 slots, the node's own immutable value bytes when one edge
        # holds them all (shared, not copied), else a fresh bytearray; the tensor is a view of it
        return _match_result(self._read_slots(buf), pos, node)

    def peek(self, tokens: Tokens, namespace: Namespace | None = None, context: int = 8) -> PeekResult:
        """Read-only look at the cached prefix of ``tokens`` (the protocol's ``peek``).

        The same descent as :meth:`match_prefix` but nothing changes: no edge is split, no
        last-access time is refreshed (eviction order is untouched), nothing is locked. Beyond
        the page-floored match it measures, to the token, how far the nearest cached sequence
        agrees with ``tokens`` (also inside an edge or a page) and what that sequence holds
        next. Cost: O(matched length) plus, when ``page_size > 1`` and the next page of
        ``tokens`` starts no child, a token comparison with at most 64 children.

        Args:
            tokens: token ids (as for :meth:`match_prefix`).
            namespace: the namespace to look in.
            context: how many of the cached neighbour's next tokens to return (>= 0).

        Returns:
            :class:`~radixkv.cache.base.PeekResult`: ``length`` equals what ``match_prefix``
            would return now; ``token_length >= length``; ``next_tokens`` follows the most
            recently added child where the cached sequences branch.

        Raises:
            ValueError: ``tokens`` is not 1-D integer or holds an id outside int32.
        """
        kb = pack_tokens(tokens)
        total = len(kb) >> TOKEN_SHIFT
        ps = self.page_size
        floored = total - total % ps
        ns_root = self.root.children.get(namespace)
        if ns_root is None or total == 0:
            return PeekResult(0, 0, (), False)
        pb = self._page_bytes
        cpl = token_keys.common_prefix_len
        node, pos = ns_root, 0
        while True:
            child = node.children.get(kb[pos << TOKEN_SHIFT : (pos << TOKEN_SHIFT) + pb]) if pos + ps <= total else None
            if child is not None:
                c = cpl(child.key, kb, pos, total)
                if c << TOKEN_SHIFT == len(child.key):
                    node, pos = child, pos + c
                    continue
                length = pos + min(c, floored - pos) // ps * ps
                return PeekResult(length, pos + c, _next_tokens(child, c, context), pos + c < total)
            # no child starts with the next page: how far does one agree inside it?
            best, best_c = None, 0
            if node.children:
                best = next(reversed(node.children.values()))  # the most recently added child
                if ps > 1 and pos < total:
                    for k, cand in enumerate(node.children.values()):
                        if k == _PEEK_SCAN:
                            break
                        c = cpl(cand.key, kb, pos, total)
                        if c > best_c:
                            best, best_c = cand, c
            nxt = _next_tokens(best, best_c, context) if best is not None else ()
            end = pos + best_c
            return PeekResult(pos, end, nxt, best is not None and end < total)

    def cached_slots(self, tokens: Tokens, namespace: Namespace | None = None) -> Any:
        """The slots of the longest cached prefix of ``tokens`` (page-floored, as
        :meth:`match_prefix` would return them), read-only: nothing is split, refreshed or
        locked, so the eviction order is untouched (the KV tiers read the K/V of evicted blocks'
        cached heads with it). 1-D int64 slot array (a copy)."""
        kb = pack_tokens(tokens)
        total = len(kb) >> TOKEN_SHIFT
        ps, pb = self.page_size, self._page_bytes
        node, pos, parts = self.root.children.get(namespace), 0, []
        while node is not None and pos + ps <= total:
            child = node.children.get(kb[pos << TOKEN_SHIFT : (pos << TOKEN_SHIFT) + pb])
            if child is None:
                break
            c = token_keys.common_prefix_len(child.key, kb, pos, total) // ps * ps
            parts.append(child.value[: c << SLOT_SHIFT])
            pos += c
            node = child if c << TOKEN_SHIFT == len(child.key) else None
        return self._read_slots(bytearray().join(parts)) if parts else empty_slots()

    def insert(self, tokens: Tokens, slots: Any, namespace: Namespace | None = None) -> int:
        """Caches ``tokens`` with their KV ``slots`` in ``namespace``.

        Ownership rule: with ``p`` the return value and ``n = len(tokens)`` floored to a
        multiple of ``page_size``, the tree takes ownership of ``slots[p:n]``. The caller keeps
        (and must free) ``slots[:p]`` (duplicates of slots the tree already holds for those
        positions; the tree keeps its own) and ``slots[n:]`` (the unaligned tail). The path to
        the sequence is refreshed; if it ends inside an edge that edge is split, so a later
        ``match_prefix(tokens)`` returns a node ending exactly at ``n``.

        Args:
            tokens: token ids (list/tuple/array of int, or 1-D integer tensor), int32 range.
            slots: 1-D integer CPU tensor (or sequence), the KV slot of every token;
                ``len(slots) == len(tokens)``. They come from the caller's allocator: the tree
                does not check that they are unique, non-negative or allocated
                (:meth:`check_integrity` finds a slot held twice).
            namespace: a ``Namespace`` or None (as for :meth:`match_prefix`).

        Returns:
            ``p``, the number of leading tokens that were already cached (a multiple of
            ``page_size``, at most ``n``).

        Raises:
            ValueError: ``tokens`` and ``slots`` differ in length, either is not 1-D integer,
                ``slots`` is not on the CPU, or a token id is outside int32.
        """
        q = query_tokens(tokens)
        n = len(q) if type(q) is not bytes else len(q) >> TOKEN_SHIFT
        addr = slot_tensor_address(slots)
        if addr >= 0:  # a contiguous int64 CPU tensor: its slots are read in place
            value = None
            nslots = slots.shape[0]
        else:
            value = as_slot_array(slots)
            nslots = len(value)
        if n != nslots:
            raise ValueError(f"tokens and slots must have the same length, got len(tokens)={n} and len(slots)={nslots}")
        ps = self.page_size
        if n < ps:
            if type(q) is not bytes:
                pack_tokens(q)  # validates the ids
            return 0
        self._clock = tick = self._clock + 1
        ns_root = self.root.children.get(namespace)
        new_ns = ns_root is None
        if new_ns:
            ns_root = TreeNode(b"", _EMPTY, self.root, namespace, tick, self._tenant_leaves.get(tenant_of(namespace)))
        try:
            node, pos, child, m, tail_key, new = token_keys.insert_walk(ns_root, q, ps, tick, addr)
        except token_keys.NotAnInt:  # numpy integers etc. in a list: convert, then walk
            q = token_keys.int_tokens_for_retry(q)
            node, pos, child, m, tail_key, new = token_keys.insert_walk(ns_root, q, ps, tick, addr)
        if new_ns:  # only once the ids are known to be valid
            self.root.children[namespace] = ns_root
        ns_root.last_access = tick
        if child is not None:
            node = self._split(child, m)
            node.last_access = tick
            pos += m
        if tail_key:
            if new is None:
                new = value[pos : pos + (len(tail_key) >> TOKEN_SHIFT)].tobytes()
            leaf = TreeNode(tail_key, new, node, namespace, tick, ns_root.tq)
            node.children[tail_key[: self._page_bytes]] = leaf
            added = len(tail_key) >> TOKEN_SHIFT
            self._total += added
            self.tenants.add(tenant_of(namespace), added)
            if node.lru is not None:
                self._lru_remove(node)
            if self._policy is None:
                self._lru_new[leaf.uid] = leaf
                leaf.lru = True
                if leaf.tq is not None:
                    self._tq_add(leaf)
            else:
                if self._counts_hits:
                    self._count_hits(leaf)
                self._policy.inserted(leaf)
                self._lru_add(leaf)
        else:
            if self._counts_hits:
                self._count_hits(node)
            if node.lru is not None:
                self._lru_refresh(node, reuse=False)
        return pos

    # ------------------------------------------------------------------ locking

    def _check_live(self, node: TreeNode) -> None:
        if not isinstance(node, TreeNode):
            raise ValueError(f"node must be a TreeNode from match_prefix, got {type(node).__name__}")
        top = node
        while top.parent is not None:
            top = top.parent
        if top is not self.root:
            raise ValueError(
                "node is not in this tree (it was evicted, the cache was reset, or it comes from another cache)"
            )

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Pins the path from ``node`` to the root: its tokens become protected (not evictable).

        Raises:
            ValueError: ``node`` is not a live node of this tree.
        """
        self._check_live(node)
        while node.parent is not None:
            if node.lock_ref == 0:
                self._protected += len(node.key) >> TOKEN_SHIFT
                if node.lru is not None:
                    self._lru_remove(node)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Unpins the path from ``node`` to the root (undoes one :meth:`inc_lock_ref`).

        Raises:
            ValueError: ``node`` is not a live node of this tree.
            RuntimeError: unbalanced call: a node on the path has ``lock_ref == 0`` (nothing is
                changed then).
        """
        self._check_live(node)
        n = node
        while n.parent is not None:
            if n.lock_ref <= 0:
                raise RuntimeError(f"dec_lock_ref without a matching inc_lock_ref on {n!r}")
            n = n.parent
        while node.parent is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._protected -= len(node.key) >> TOKEN_SHIFT
                if not node.children and node.key:
                    self._lru_add(node)
            node = node.parent

    # ------------------------------------------------------------------ eviction

    def evict(self, num_tokens: int) -> Any:
        """Frees cached pages, least recently used leaf first, tail first, until ``num_tokens``
        (rounded up to whole pages) are freed.

        Page-granular: when the leaf at the head of the eviction order is longer than what is
        still needed, it is split at the last page boundary that frees enough and only its tail
        goes; the kept head stays cached (a leaf again, with the same last-access time, so it
        stays at the head of the order). A parent whose last child is evicted becomes a leaf and
        competes (by its own last-access time, or its policy priority) in the same call. Stops
        early when nothing evictable is left. Exactly ``min(ceil(num_tokens / page_size) *
        page_size, evictable_size())`` tokens are freed. :attr:`evict_listener` hears of every
        freed piece (a whole node, or the tail of a split one).

        Quotas (``tenant_quotas``): first, while a tenant holds more than its quota, the least
        recently used evictable leaf of such tenants loses tail pages (at most its tenant's excess,
        in whole pages); what is still needed then goes by the policy above.

        Args:
            num_tokens: tokens to free (int >= 0).

        Returns:
            1-D int64 slot array of the freed slots (empty if none), for the caller to return to
            its allocator.

        Raises:
            ValueError: ``num_tokens`` is not an int >= 0.
        """
        try:
            if isinstance(num_tokens, bool):
                raise TypeError
            num_tokens = operator.index(num_tokens)
        except TypeError:
            raise ValueError(f"num_tokens must be an int >= 0, got {num_tokens!r}") from None
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
        if num_tokens >= self._total - self._protected and self._policy is None:
            return self._evict_every_unlocked()
        freed: list = []
        done = self._evict_over_quota(num_tokens, freed) if self._tenant_leaves else 0
        new, old = self._lru_new, self._lru_old
        while done < num_tokens and (new or old):
            if old:
                if new:
                    head = next(iter(new.values()))
                    take_old = old[0][:2] < (head.last_access, head.uid)
                else:
                    take_old = True
            else:
                take_old = False
            if take_old:
                entry = old.pop(0)
                node = entry[2]
            else:
                entry = None
                node = new.popitem(last=False)[1]
            node.lru = None
            if node.tentry is not None:
                self._tq_drop(node)
            done += self._free_leaf(node, entry, num_tokens - done, freed)
        if not freed:
            return empty_slots()
        return self._read_slots(bytearray().join(freed))

    def _evict_over_quota(self, num_tokens: int, freed: list) -> int:
        """``evict``'s first phase: while tenants are above their quota (:attr:`tenants`), the least
        recently used evictable leaf among theirs loses tail pages (at most what brings its tenant
        back to its quota, rounded up to whole pages), until ``num_tokens`` are freed or no tenant
        above its quota has an evictable leaf. Returns the tokens freed (appended to ``freed``)."""
        done = 0
        leaves = self._tenant_leaves
        while done < num_tokens:
            best = most = None
            for tenant, over in self.tenants.over_quota():
                tl = leaves[tenant]
                if tl and (best is None or tl[0][:2] < best[:2]):
                    best, most = tl[0], over
            if best is None:
                break
            node = best[2]
            entry = node.lru
            self._lru_remove(node)
            done += self._free_leaf(node, entry, min(num_tokens - done, most), freed)
        return done

    def _free_leaf(self, node: TreeNode, entry: Any, want: int, freed: list) -> int:
        """Frees ``node`` (an evictable leaf already taken out of the leaf sets; ``entry``: its
        policy entry) or, when it is longer than ``want`` tokens rounded up to pages, only its tail
        pages; the kept head, or a parent left without children, becomes an evictable leaf.
        Appends the freed slot bytes to ``freed``; returns how many tokens they are."""
        size = len(node.key) >> TOKEN_SHIFT
        kept = None
        if want < size:  # free only the tail pages still needed
            cut = -(-want // self.page_size) * self.page_size
            if cut < size:
                kept = self._split(node, size - cut)  # node keeps the tail, kept the head
                size = cut
        policy = self._policy
        if policy is not None:
            policy.freed(entry[0], node)
        listener = self.evict_listener
        if listener is not None:
            path = _path_key(node)
            listener(node.namespace, path, (len(path) - len(node.key)) >> TOKEN_SHIFT)
        freed.append(node.value)
        self._total -= size
        self.tenants.add(tenant_of(node.namespace), -size)
        parent = node.parent
        del parent.children[node.key[: self._page_bytes]]
        node.parent = None
        if not parent.children and parent.lock_ref == 0:
            if parent.key:
                if parent is kept and policy is not None:  # the kept head keeps its place
                    self._pq_add(kept, entry[0])
                    if kept.tq is not None:
                        self._tq_add(kept)
                else:
                    self._lru_add(parent)
            else:  # an emptied namespace root
                del self.root.children[parent.namespace]
                parent.parent = None
        return size

    def _evict_every_unlocked(self) -> Any:
        """``evict`` of everything evictable (LRU; the order does not matter then): cuts every
        unlocked subtree off the locked part of the tree in one walk over the evicted nodes (and
        the locked ones above them), instead of popping leaves one by one. A node with
        ``lock_ref == 0`` has no locked descendant, so its whole subtree goes."""
        listener = self.evict_listener
        values = []
        for namespace, ns_root in list(self.root.children.items()):
            first = len(values)
            above = [ns_root]  # locked nodes whose children are looked at
            while above:
                node = above.pop()
                kids = node.children
                for k in [k for k, c in kids.items() if c.lock_ref == 0]:
                    top = kids.pop(k)
                    if listener is None:  # the common case: no paths to build
                        todo = [top]
                        while todo:
                            x = todo.pop()
                            if x.children:
                                todo.extend(x.children.values())
                            values.append(x.value)
                            x.parent = None
                            x.lru = None
                        continue
                    todo = [(top, _path_key(node))]
                    while todo:
                        x, prefix = todo.pop()
                        path = prefix + x.key
                        listener(namespace, path, len(prefix) >> TOKEN_SHIFT)
                        todo.extend((c, path) for c in x.children.values())
                        values.append(x.value)
                        x.parent = None
                        x.lru = None
                above.extend(kids.values())
            self.tenants.add(tenant_of(namespace), -(sum(map(len, values[first:])) >> SLOT_SHIFT))
            if not ns_root.children and ns_root.lock_ref == 0:
                del self.root.children[namespace]
                ns_root.parent = None
        self._lru_new.clear()
        self._lru_old.clear()
        for tl in self._tenant_leaves.values():  # every evictable leaf is gone
            for e in tl:
                e[2].tentry = None
            tl.clear()
        joined = bytearray().join(values)
        self._total -= len(joined) >> SLOT_SHIFT  # one int64 slot per token
        if not values:
            return empty_slots()
        return self._read_slots(joined)

    def reset(self) -> Any:
        """Empties the tree; returns every slot it held (1-D int64 CPU tensor) for the caller to
        free. Nodes handed out before become invalid.

        Raises:
            RuntimeError: some node is locked (nothing is changed then).
        """
        if any(ns.lock_ref for ns in self.root.children.values()):
            raise RuntimeError(f"reset() while nodes are locked (protected_size={self._protected})")
        values = []
        for node in self._iter_nodes():
            values.append(node.value)
            node.parent = None
            node.lru = None
        self._init_state()
        values = bytearray().join(values)
        if not values:
            return empty_slots()
        return self._read_slots(values)

    # ------------------------------------------------------------------ sizes and checks

    def tenant_sizes(self) -> dict:
        """Tokens cached per tenant (``Namespace.tenant``; None: namespaces without a tenant),
        evictable and protected alike; tenants with none are absent. O(tenants)."""
        return self.tenants.sizes()

    def tenant_count(self, tenant: str) -> int:
        """Tokens cached in ``tenant``'s namespaces (O(1))."""
        return self.tenants.tokens.get(tenant, 0)

    def take_changed_tenants(self) -> set:
        """The named tenants whose cached tokens changed since the last call (O(them))."""
        return self.tenants.take_changed()

    def set_tenant_quotas(self, quotas: Optional[dict]) -> None:
        """Replace the tenants' soft quotas (tenant -> ``kv_quota_tokens``; None: none). Refiles
        every node once (O(tree size)): meant for configuration, not for the request path.

        Raises:
            ValueError: bad quotas (nothing is changed then).
        """
        self.tenants.quotas = check_quotas(quotas)
        self._tenant_leaves = {t: SortedList() for t in self.tenants.quotas}
        for ns, ns_root in self.root.children.items():
            tq = self._tenant_leaves.get(tenant_of(ns))
            stack = [ns_root]
            while stack:
                node = stack.pop()
                node.tq, node.tentry = tq, None
                if tq is not None and node.lru is not None:
                    self._tq_add(node)
                stack.extend(node.children.values())

    def evictable_size(self) -> int:
        """Cached tokens with ``lock_ref == 0`` (leaves now, inner nodes after their subtree)."""
        return self._total - self._protected

    def protected_size(self) -> int:
        """Cached tokens on a locked path."""
        return self._protected

    def total_size(self) -> int:
        """All cached tokens (``evictable_size() + protected_size()``)."""
        return self._total

    def num_nodes(self) -> int:
        """Nodes holding tokens (neither the root nor namespace roots)."""
        return sum(1 for n in self._iter_nodes() if n.key)

    def _iter_nodes(self) -> Iterator[TreeNode]:
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def cached_paths(self) -> Iterator[tuple]:
        """Every node as ``(namespace, path, slots, start, leaf)``, each after every node that
        continues it (children before their parent: the KV tiers write the pool's blocks at close
        so, deepest first, for a sequence's head to be what a tier keeps longest): ``path`` the
        int32 token bytes from its namespace root to the end of its edge, ``slots`` the int64
        slot bytes of all of ``path``'s positions, ``start`` the position of its edge's first
        token, ``leaf`` whether no node continues it. Read-only (nothing split, refreshed or
        locked); O(tree size x depth) bytes copied, O(depth x width) held."""
        stack = [(n, b"", b"", False) for n in self.root.children.values()]
        while stack:
            node, path, slots, seen = stack.pop()
            if seen:  # its children are done
                yield node.namespace, path, slots, len(path) - len(node.key) >> TOKEN_SHIFT, not node.children
                continue
            path, slots = path + node.key, slots + node.value
            stack.append((node, path, slots, True))
            stack.extend((c, path, slots, False) for c in node.children.values())

    def block_digests(self) -> list:
        """The chained digests (:mod:`radixkv.cache.digests`) of every fully cached 16-token
        block, all namespaces: what a consumer of the cache events holds after all of them (a
        router's snapshot to resync from). O(tree size)."""
        from radixkv.cache.digests import BLOCK_TOKENS, block_digests

        out: list = []
        stack = [(ns_root, b"", None) for ns_root in self.root.children.values()]
        while stack:
            node, path, prev = stack.pop()
            path = path + node.key
            end = len(path) >> TOKEN_SHIFT
            first, stop = (end - (len(node.key) >> TOKEN_SHIFT)) // BLOCK_TOKENS, end // BLOCK_TOKENS
            last = prev
            if stop > first:
                ds = block_digests(path, node.namespace, first, stop, prev if first else None)
                out.extend(ds)
                last = ds[-1]
            for c in node.children.values():  # ``last``: the digest of block ``stop - 1``
                stack.append((c, path, last))
        return out

    def check_integrity(self) -> None:
        """Verifies every invariant with a full walk (for tests; O(tree size)).

        Checks: parent/child links and child keys; edge lengths (non-empty, whole pages, one
        int64 slot per token); no slot held twice; ``lock_ref >= 0`` and a parent's lock_ref at
        least the sum of its children's; a child never accessed later than its parent; the two
        LRU containers hold exactly the unlocked leaves (the OrderedDict in last_access order);
        the size counters.

        Raises:
            RuntimeError: naming the first broken invariant.
        """
        check_tree(self)

    def pretty_print(self, max_tokens: int = 8) -> str:
        """Readable dump: a header with the sizes, then one line per node, indented by depth,
        with its first ``max_tokens`` tokens, slot range, lock_ref and last_access."""
        return format_tree(self, max_tokens)
