"""Debug helpers of :class:`~radixkv.cache.radix_tree.RadixCache`: the full invariant check
and the readable dump (kept apart so the tree module holds only the data structure)."""

from __future__ import annotations

from typing import Any

import numpy as np

from radixkv.cache.tenants import tenant_of
from radixkv.namespace import Namespace

__all__ = ["check_tree", "format_tree"]


def check_tree(tree: Any) -> None:
    """Implements :meth:`RadixCache.check_integrity` (raises RuntimeError)."""

    def fail(msg: str) -> None:
        raise RuntimeError(f"RadixCache integrity: {msg}")

    ps = tree.page_size
    pb = tree._page_bytes
    policy = tree._policy
    if policy is not None and tree._lru_new:
        fail("policy mode keeps every evictable leaf in the SortedList")
    total = protected = 0
    leaves = set()
    seen_slots = []
    per_tenant: dict = {}
    tenant_leaves: dict = {t: set() for t in tree._tenant_leaves}
    for ns, ns_root in tree.root.children.items():
        if ns_root.parent is not tree.root or ns_root.key or ns_root.namespace != ns:
            fail(f"bad namespace root for {ns!r}")
        if not ns_root.children and ns_root.lock_ref == 0:
            fail(f"empty namespace root {ns!r} kept")
        if isinstance(ns, Namespace) and ns.is_default:
            fail("a Namespace() root beside None's: the default namespace is None (Namespace.of)")
    for node in tree._iter_nodes():
        if node.parent is not tree.root:
            if not node.key or len(node.key) % pb:
                fail(f"edge of {len(node.key)} bytes, not a positive multiple of {ps} int32 tokens: {node!r}")
            if type(node.value) is not bytes or len(node.value) != 2 * len(node.key):
                fail(f"{len(node.value)} slot bytes for {len(node.key) // 4} tokens (need 8 a token): {node!r}")
            if node.namespace != node.parent.namespace:
                fail(f"namespace differs from its parent's: {node!r}")
            if node.last_access > node.parent.last_access:
                fail(f"last_access newer than its parent's: {node!r}")
            if tree._counts_hits and node.parent.key and node.hits > node.parent.hits:
                fail(f"more hits than its parent: {node!r}")
            tenant = tenant_of(node.namespace)
            if node.key:
                per_tenant[tenant] = per_tenant.get(tenant, 0) + (len(node.key) >> 2)
            if node.tq is not tree._tenant_leaves.get(tenant):
                fail(f"node filed under another tenant's leaf set: {node!r}")
            if not node.children and node.lock_ref == 0:
                leaves.add(node.uid)
                if node.tq is not None:
                    if node.tentry != (node.last_access, node.uid, node) or node.tentry not in node.tq:
                        fail(f"evictable leaf of a tenant with a quota missing from its leaf set: {node!r}")
                    tenant_leaves[tenant].add(node.uid)
                e = node.lru
                if policy is None:
                    ok = (
                        e is True
                        and tree._lru_new.get(node.uid) is node
                        or (e == (node.last_access, node.uid, node) and e in tree._lru_old)
                    )
                else:  # a policy's priority may depend on its state when the leaf was filed
                    ok = type(e) is tuple and e[1] == node.uid and e[2] is node and e in tree._lru_old
                if not ok:
                    fail(f"evictable leaf with a missing or bad LRU entry: {node!r}")
            elif node.lru is not None or node.tentry is not None:
                fail(f"non-evictable node in the LRU set: {node!r}")
        if node.lock_ref < 0:
            fail(f"negative lock_ref: {node!r}")
        if node.lock_ref < sum(c.lock_ref for c in node.children.values()):
            fail(f"lock_ref below the sum of its children's: {node!r}")
        for ck, child in node.children.items():
            if child.parent is not node or ck != child.key[:pb]:
                fail(f"bad child link to {child!r}")
        total += len(node.key) >> 2
        if node.lock_ref > 0:
            protected += len(node.key) >> 2
        seen_slots.append(np.frombuffer(node.value, dtype=np.int64))
    in_set = [e[1] for e in tree._lru_old] + list(tree._lru_new)
    if set(in_set) != leaves or len(in_set) != len(leaves):
        fail(f"LRU set has {len(in_set)} entries, expected {len(leaves)}")
    times = [n.last_access for n in tree._lru_new.values()]
    if times != sorted(times):
        fail("the OrderedDict of evictable leaves is out of last_access order")
    for t, tl in tree._tenant_leaves.items():
        if {e[1] for e in tl} != tenant_leaves[t] or len(tl) != len(tenant_leaves[t]):
            fail(f"leaf set of tenant {t!r} has {len(tl)} entries, expected {len(tenant_leaves[t])}")
    if per_tenant != tree.tenants.tokens:
        fail(f"tokens per tenant {tree.tenants.tokens}, recomputed {per_tenant}")
    if total != tree._total or protected != tree._protected:
        fail(f"sizes total={tree._total} protected={tree._protected}, recomputed total={total} protected={protected}")
    all_slots = np.sort(np.concatenate(seen_slots)) if seen_slots else np.empty(0, np.int64)
    if (all_slots[1:] == all_slots[:-1]).any():
        fail("a slot is held by two tree positions")


def _slot_text(slots: list, max_tokens: int) -> str:
    """``a..b`` for an ascending run of consecutive slots, else the first ``max_tokens``."""
    if slots == list(range(slots[0], slots[0] + len(slots))):
        return f"{slots[0]}..{slots[-1]}"
    return "[" + " ".join(map(str, slots[:max_tokens])) + (" ...]" if len(slots) > max_tokens else "]")


def format_tree(tree: Any, max_tokens: int = 8) -> str:
    """Implements :meth:`RadixCache.pretty_print` (iterative: any depth)."""
    lines = [
        f"RadixCache(page_size={tree.page_size}, total={tree._total}, "
        f"protected={tree._protected}, evictable={tree.evictable_size()}, "
        f"evictable_leaves={len(tree._lru_new) + len(tree._lru_old)})"
    ]

    def children(node: Any) -> list:
        return sorted(node.children.values(), key=lambda c: c.tokens()[:1])

    for ns, ns_root in tree.root.children.items():
        lines.append(f"namespace {ns!r}: lock_ref={ns_root.lock_ref}")
        stack = [(c, 1) for c in reversed(children(ns_root))]
        while stack:
            node, depth = stack.pop()
            toks = node.tokens()
            text = " ".join(map(str, toks[:max_tokens])) + (" ..." if len(toks) > max_tokens else "")
            lines.append(
                f"{'  ' * depth}[{text}] len={len(toks)} "
                f"slots={_slot_text(node.slots(), max_tokens)} "
                f"lock_ref={node.lock_ref} t={node.last_access}"
            )
            stack.extend((c, depth + 1) for c in reversed(children(node)))
    return "\n".join(lines)
