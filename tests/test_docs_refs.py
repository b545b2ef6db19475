"""The docs' references resolve: links between docs, repository paths, the architecture map.

Over README.md and every docs/*.md:

* **Links.** A relative Markdown link ``[text](target)`` names a file that exists (relative to the
  doc), and its ``#anchor``, if any, is one of the target's headings (GitHub's slugs).
* **Repository paths.** Every ``tests/...``, ``bench/...``, ``radixkv/...``, ``csrc/...`` or
  ``docs/...`` path a doc names exists (a path ending in ``/`` or naming a prefix of files, such
  as ``bench/results/``, may be a folder). ``bench/results/`` files are tests/test_docs.py's.
* **Module map.** docs/architecture.md's module table names every module of ``radixkv/`` (a row
  may name several: ``a.py``, ``x/{a,b}.py``, ``x/*``, ``(+ b.py)`` beside ``x/a.py``) and no
  module that does not exist.
* **Command flags.** Every ``--flag`` given to ``radixkv serve|replay|plan|explain`` or to
  ``python bench/x.py`` in a doc is one that command defines (a renamed or removed flag fails).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
REPO_PATH = re.compile(r"(?<![\w./~-])(?:tests|bench|radixkv|csrc|docs)/[\w./-]*[\w/]")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, markup and punctuation dropped, spaces -> '-'."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    return {slug(h) for h in HEADING.findall(doc.read_text())}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_relative_links_resolve(doc):
    bad = []
    for target in LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # a URL
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading #{anchor}")
    assert bad == [], f"{doc.name}: " + "; ".join(bad)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_named_repository_paths_exist(doc):
    bad = []
    for path in sorted(set(REPO_PATH.findall(doc.read_text()))):
        if path.startswith("bench/results/") and path != "bench/results/":
            continue
        if not (ROOT / path).exists() and not any(ROOT.glob(path + "*")):
            bad.append(path)
    assert bad == [], f"{doc.name} names paths that do not exist: {bad}"


def map_names() -> set[str]:
    """The module names of the first column of docs/architecture.md's module table."""
    names = set()
    for line in (ROOT / "docs" / "architecture.md").read_text().splitlines():
        if not line.startswith("| `"):
            continue
        for span in re.findall(r"`([^`]+)`", line.split("|")[1]):
            m = re.fullmatch(r"(.*)\{(.*)\}(.*)", span)
            names.update([m.group(1) + x + m.group(3) for x in m.group(2).split(",")] if m else [span])
    return {n.removeprefix("radixkv/") for n in names}


def test_module_map_names_every_module_and_only_real_ones():
    names = map_names()
    modules = sorted(str(p.relative_to(ROOT / "radixkv")) for p in (ROOT / "radixkv").rglob("*.py"))
    modules = [m for m in modules if not m.endswith("__init__.py")]
    folders = {n.rpartition("/")[0] for n in names if "/" in n}

    def covered(mod: str) -> bool:
        folder, _, name = mod.rpartition("/")
        return (
            mod in names
            or any(n.endswith("/*") and mod.startswith(n[:-1]) for n in names)
            or (folder in folders and name in names)  # "(+ check.py)" beside a module of its folder
        )

    assert [m for m in modules if not covered(m)] == []
    repo_level = ("bench/", "csrc/")
    missing = [
        n
        for n in names
        if "*" not in n
        and not (ROOT / n).exists()
        and not (ROOT / "radixkv" / n).exists()
        and not any((ROOT / "radixkv").glob("*/" + n))
        and not n.startswith(repo_level)
    ]
    assert missing == []


def test_the_checkers_catch_what_they_should():
    assert slug("KV tiers: the cache survives `eviction`, restarts") == "kv-tiers-the-cache-survives-eviction-restarts"
    assert LINK.findall("see [a](docs/x.md#y) and [b](https://e.com)") == ["docs/x.md#y", "https://e.com"]
    assert REPO_PATH.findall("run `bench/tiers_io.py` and tests/test_x.py, not a/tests/y") == [
        "bench/tiers_io.py",
        "tests/test_x.py",
    ]


PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_python_blocks_compile_and_import_what_exists(doc):
    """Every ```python block is valid Python, and every ``from radixkv... import`` in it imports."""
    bad = []
    for i, block in enumerate(PYTHON_BLOCK.findall(doc.read_text())):
        try:
            compile(block, f"{doc.name} block {i}", "exec")
        except SyntaxError as e:
            bad.append(f"block {i}: {e}")
        for line in re.findall(r"^from radixkv\S* import .+$", block, re.M):
            try:
                exec(line, {})
            except ImportError as e:
                bad.append(f"block {i}: {line}: {e}")
    assert bad == [], f"{doc.name}: " + "; ".join(bad)


def test_module_map_names_every_benchmark_script():
    row = next(
        ln for ln in (ROOT / "docs" / "architecture.md").read_text().splitlines() if ln.startswith("| `bench/` |")
    )
    scripts = sorted(
        p.name for p in (ROOT / "bench").iterdir() if p.suffix in (".py", ".sh") and p.name != "__init__.py"
    )
    assert [s for s in scripts if f"`{s}`" not in row] == []


COMMAND = re.compile(r"radixkv (serve|replay|plan|explain)\b([^`\n|]*)")
BENCH_COMMAND = re.compile(r"python (bench/[\w/]+\.py)\b([^`\n|#]*)")
FLAG = re.compile(r"(?<![\w-])--[a-z][\w-]*")


def cli_flags() -> dict[str, set[str]]:
    """Every option string of each ``radixkv`` subcommand, from the parsers the console script builds."""
    import argparse

    from radixkv import replay
    from radixkv.obs import cli as obs_cli
    from radixkv.server import cli as server_cli

    out = {}
    for name, add in [
        ("serve", server_cli.add_arguments),
        ("replay", replay.add_arguments),
        ("explain", obs_cli.add_explain_arguments),
        ("plan", obs_cli.add_plan_arguments),
    ]:
        p = argparse.ArgumentParser()
        add(p)
        out[name] = set(p._option_string_actions)
    return out


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_flag_a_doc_gives_a_command_exists(doc):
    """``radixkv serve|replay|plan|explain --flag`` and ``python bench/x.py --flag`` in a doc (a
    command line continued with a backslash included) name a flag the command defines."""
    text = doc.read_text().replace("\\\n", " ")
    flags = cli_flags()
    bad = [
        f"radixkv {m.group(1)} {f}"
        for m in COMMAND.finditer(text)
        for f in FLAG.findall(m.group(2))
        if f not in flags[m.group(1)]
    ]
    for m in BENCH_COMMAND.finditer(text):
        source = (ROOT / m.group(1)).read_text()
        bad += [
            f"{m.group(1)} {f}" for f in FLAG.findall(m.group(2)) if f'"{f}"' not in source and f"'{f}'" not in source
        ]
    assert bad == [], f"{doc.name} gives flags its commands do not define: {bad}"


def test_the_flag_checker_reads_commands_as_a_user_types_them():
    text = "run `radixkv plan --list --kv-dtype fp8` or\npython bench/sim_cache.py --workloads gsp \\\n  --fractions 0.1 # --x"
    text = text.replace("\\\n", " ")
    assert [(m.group(1), FLAG.findall(m.group(2))) for m in COMMAND.finditer(text)] == [
        ("plan", ["--list", "--kv-dtype"])
    ]
    assert [FLAG.findall(m.group(2)) for m in BENCH_COMMAND.finditer(text)] == [["--workloads", "--fractions"]]
    assert "--kv-dtype" in cli_flags()["plan"] and "--bogus" not in cli_flags()["serve"]
