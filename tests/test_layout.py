"""The package's structure, checked from its source (docs/architecture.md states the rules):

* no import cycle between radixkv's modules, function-local imports included;
* ``radixkv.cache`` (the trees, the allocator) imports and works with torch unavailable;
* only the KV manager moves slots: calls the allocator's ``alloc`` / ``free``, takes or returns
  ``req_to_token`` rows, writes ``req_to_token``, locks or unlocks a prefix cache's path, evicts
  from it or resets it (its helpers, the pin table and the in-batch sharing index, ask it to);
* no test replaces ``Engine.step`` (the event bus serves observers instead).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "radixkv"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PKG.rglob("*.py")}


def _imports(path: Path, mod: str, known: set[str]) -> set[str]:
    """radixkv modules ``path`` imports anywhere in it (top level or inside functions)."""
    tree = ast.parse(path.read_text())
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        for n in names:
            while n and n not in known:
                n = n.rpartition(".")[0]
            if n and n != mod:
                out.add(n)
    return out


def test_no_import_cycle_in_the_package():
    mods = _modules()
    graph = {m: _imports(p, m, set(mods)) for m, p in mods.items()}
    # A package's __init__ is imported on the way to its modules; edges into an __init__ from
    # its own submodules are not cycles of the code (they are what `import pkg.sub` does).
    for m in graph:
        graph[m] = {d for d in graph[m] if not m.startswith(d + ".")}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycle = stack[stack.index(d) :] + [d]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert graph["radixkv.cache.radix_tree"] and "radixkv.cache.check" in graph["radixkv.cache.radix_tree"]


def test_cache_package_imports_and_works_without_torch():
    code = """
import sys
sys.modules["torch"] = None  # `import torch` raises ImportError from here on
import radixkv.cache as c
from radixkv.cache import RadixCache, HashBlockCache, NoPrefixCache, SlotAllocator
assert "torch" not in [m for m in sys.modules if sys.modules[m] is not None and m.split(".")[0] == "torch"]
a = SlotAllocator(64, 4)
t = RadixCache(4)
s = a.alloc(8)
assert type(s).__module__ == "numpy" and s.tolist() == list(range(8))
assert t.insert(list(range(1, 9)), s) == 0
m = t.match_prefix([1, 2, 3, 4, 5, 6, 7, 9])
assert (m.length, m.slots.tolist()) == (4, [0, 1, 2, 3])
freed = t.evict(8)
a.free(freed)
assert sorted(freed.tolist()) == list(range(8)) and a.available_size() == 64
h = HashBlockCache(4)
assert h.insert(list(range(8)), a.alloc(8)) == 0 and h.match_prefix(list(range(8))).length == 8
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


_SLOT_OWNER = "radixkv/engine/kv_manager.py"
_DEFINITIONS = {"radixkv/memory/allocator.py", "radixkv/memory/kv_pool.py"}


def _slot_moves(path: Path) -> list[str]:
    """Calls in ``path`` that move slots or rows: ``<x>.alloc(...)`` / ``<x>.free(...)`` on an
    allocator or req_to_token pool, ``<x>.write(...)`` on a req_to_token pool, assignments into
    ``req_to_token[...]``, and ``<x>.inc_lock_ref`` / ``dec_lock_ref`` / ``evict`` / ``reset``
    on a prefix cache (what a lock holds, or eviction frees, is slots too)."""
    src = path.read_text()
    found = []
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = ast.get_source_segment(src, node.func.value) or ""
            meth = node.func.attr
            if meth in ("alloc", "free") and ("allocator" in owner or "req_to_token" in owner):
                found.append(f"{path.name}:{node.lineno} {owner}.{meth}")
            if meth == "write" and "req_to_token" in owner:
                found.append(f"{path.name}:{node.lineno} {owner}.write")
            if meth in ("inc_lock_ref", "dec_lock_ref", "evict", "reset") and "cache" in owner:
                found.append(f"{path.name}:{node.lineno} {owner}.{meth}")
        if isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Subscript) and "req_to_token" in (ast.get_source_segment(src, t.value) or ""):
                    found.append(f"{path.name}:{node.lineno} write into req_to_token")
    return found


def test_only_the_kv_manager_moves_slots():
    moves = {}
    for p in PKG.rglob("*.py"):
        rel = p.relative_to(ROOT).as_posix()
        if rel in _DEFINITIONS:
            continue
        found = _slot_moves(p)
        if found:
            moves[rel] = found
    assert set(moves) == {_SLOT_OWNER}, moves
    # the checker sees what it must: the KV manager's own hand-overs
    kinds = " ".join(moves[_SLOT_OWNER])
    for what in (
        "allocator.alloc",
        "allocator.free",
        "req_to_token_pool.write",
        "req_to_token_pool.alloc",
        "cache.inc_lock_ref",
        "cache.dec_lock_ref",
        "cache.evict",
    ):
        assert what in kinds, what


def test_no_test_replaces_engine_step():
    offenders = []
    for p in (ROOT / "tests").glob("*.py"):
        tree = ast.parse(p.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    if isinstance(t, ast.Attribute) and t.attr == "step":
                        offenders.append(f"{p.name}:{node.lineno}")
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "setattr":
                args = node.args
                if len(args) >= 2 and isinstance(args[1], ast.Constant) and args[1].value == "step":
                    offenders.append(f"{p.name}:{node.lineno}")
    assert offenders == []
