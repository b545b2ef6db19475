"""The docs' figures point at committed results, and no doc names a development machine's paths.

Checked over README.md and every docs/*.md:

* **Result files.** Every ``bench/results/...`` path a doc cites names one file, exactly (no glob,
  brace list or ``...`` abbreviation), and that file is committed in the repository. The bare
  directory ``bench/results/`` may be named. A result not produced yet is named as pending,
  without a path. Links to other docs are not checked here.
* **Absolute machine paths.** The rule:

  - Paths under a machine's own roots, ``/work/``, ``/home/``, ``/Users/``, ``/root/``,
    ``/mnt/``, ``/scratch/``, are refused everywhere, code included: no user has them.
  - ``/tmp/...`` and ``~/...`` are allowed only inside code (a fenced block or an inline code
    span), where they are a documented default (``~/.cache/radixkv``, an environment variable's
    default under ``/tmp``) or an example a user runs; in prose they would be one machine's paths.

  A path is only recognised at the start of a word (not inside a URL such as
  ``https://host/home/...``).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

RESULT = re.compile(r"bench/results/[^\s`'\")\]>|,;]*")
NOT_CONCRETE = re.compile(r"[*?{}\[\]]|\.\.\.|\.\.$")
START = r"(?<![\w.:/~-])"
MACHINE_ROOT = re.compile(START + r"/(?:work|home|Users|root|mnt|scratch)/")
USER_PATH = re.compile(START + r"(?:/tmp/|~/)")
FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.S | re.M)
INLINE = re.compile(r"(`+)(?!`).+?(?<!`)\1(?!`)", re.S)


def committed() -> set[str]:
    out = subprocess.run(
        ["git", "ls-files", "bench/results"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    return set(out.split())


def cited_results(text: str) -> list[str]:
    """Every ``bench/results/...`` path in ``text``, trailing sentence punctuation removed."""
    return [m.group(0).rstrip(".:") for m in RESULT.finditer(text)]


def prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code spans (each replaced by a space)."""
    return INLINE.sub(" ", FENCE.sub(" ", text))


def line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_cited_result_file_is_committed(doc):
    text = doc.read_text()
    files = committed()
    bad = []
    for path in cited_results(text):
        if path == "bench/results/":
            continue
        if NOT_CONCRETE.search(path):
            bad.append(f"{path}: not one concrete file")
        elif path not in files:
            bad.append(f"{path}: not committed")
    assert bad == [], f"{doc.name}: " + "; ".join(bad)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_no_doc_names_an_absolute_machine_path(doc):
    text = doc.read_text()
    bad = [f"line {line_of(text, m.start())}: {m.group(0)}" for m in MACHINE_ROOT.finditer(text)]
    outside_code = prose(text)
    bad += [f"{m.group(0)} in prose" for m in USER_PATH.finditer(outside_code)]
    assert bad == [], f"{doc.name}: " + "; ".join(bad)


def test_the_rules_catch_what_they_should():
    assert cited_results("see `bench/results/a_1.json`, and bench/results/b.txt.") == [
        "bench/results/a_1.json",
        "bench/results/b.txt",
    ]
    assert NOT_CONCRETE.search("bench/results/x_*.json") and NOT_CONCRETE.search("bench/results/x.{json,txt}")
    assert NOT_CONCRETE.search("bench/results/..._x.json") and not NOT_CONCRETE.search("bench/results/x.json")
    assert MACHINE_ROOT.search("run /work/llama-build/x") and MACHINE_ROOT.search("`/home/me/x`")
    assert not MACHINE_ROOT.search("https://example.com/home/x") and not MACHINE_ROOT.search("a/work/b")
    assert USER_PATH.findall(prose("lock /tmp/cpu.lock and ~/x")) == ["/tmp/", "~/"]
    assert USER_PATH.findall(prose("default `~/.cache/radixkv`, `/tmp/x`\n```bash\nls /tmp/y\n```\n")) == []
