"""bench/*.py: every script imports against the current code and its argparse answers ``--help``.

The benchmarks are not run here (they take minutes); this catches the rot that a renamed import,
a removed module or a broken parser causes, in one subprocess (a few seconds: the imports are
shared, and no script's import-time setup leaks into the test process). Flags named by the docs
are tests/test_docs_refs.py's.
"""

from __future__ import annotations

import ast
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p.stem for p in (ROOT / "bench").glob("*.py") if p.stem != "__init__")
LIBRARIES = {"results_io"}  # imported by the scripts, no command line of its own

pytestmark = pytest.mark.timeout(120)

_PROBE = r"""
import contextlib, importlib.util, inspect, io, json, os, sys, traceback
root, out = os.getcwd(), {}
base = [p for p in sys.path if p not in ("", root)]
for name in sys.argv[1:]:
    buf, row = io.StringIO(), {}
    sys.path[:] = [os.path.join(root, "bench")] + base  # as `python bench/<name>.py` starts
    try:
        spec = importlib.util.spec_from_file_location("_bench_" + name, os.path.join(root, "bench", name + ".py"))
        mod = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        row["root_on_path"] = root in sys.path
        main = getattr(mod, "main", None)
        row["main"] = main is not None
        if main is not None:
            argv0, sys.argv = sys.argv, ["bench/%s.py" % name, "--help"]
            try:
                with contextlib.redirect_stdout(buf):
                    main(["--help"]) if inspect.signature(main).parameters else main()
                row["exit"] = "returned"
            except SystemExit as e:
                row["exit"] = e.code
            finally:
                sys.argv = argv0
    except BaseException:
        row["error"] = traceback.format_exc()
    row["help"] = buf.getvalue()
    out[name] = row
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def probed() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, *SCRIPTS], cwd=ROOT, env=env, capture_output=True, text=True, timeout=100
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_bench_folder_has_its_scripts():
    # a glob that found nothing (a moved folder) would make the parametrized tests vacuous
    assert {"sim_cache", "sim_routing", "e2e_workloads", "model_speed", "results_io"} <= set(SCRIPTS)


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_imports_and_answers_help(probed, name):
    row = probed[name]
    assert "error" not in row, row.get("error")
    if name in LIBRARIES:
        assert row["main"] is False
        return
    assert row["main"], f"bench/{name}.py has no main()"
    assert row["exit"] == 0, f"bench/{name}.py --help exited {row['exit']!r}"
    assert row["help"].startswith(f"usage: {name}.py"), row["help"][:200]
    assert "--help" in row["help"]


def _project_imports_of(node: ast.AST):
    """(line, module, name or None) of the ``radixkv`` / ``bench`` imports of one statement."""
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0] in ("radixkv", "bench"):
        yield from ((node.lineno, node.module, a.name) for a in node.names)
    elif isinstance(node, ast.Import):
        yield from ((node.lineno, a.name, None) for a in node.names if a.name.split(".")[0] in ("radixkv", "bench"))


def _project_imports(path: Path):
    """Every project import in ``path``, the ones inside functions included (a script imports
    most of its heavy parts lazily)."""
    for node in ast.walk(ast.parse(path.read_text())):
        yield from _project_imports_of(node)


def test_every_lazy_project_import_in_the_scripts_resolves():
    # --help reaches only the module-level imports; the ones inside functions rot unseen
    # (sglang_bench_serving's radixkv.replay.iter_sharegpt did)
    missing, seen = [], 0
    for path in sorted((ROOT / "bench").rglob("*.py")):
        for line, module, name in _project_imports(path):
            seen += 1
            where = f"{path.relative_to(ROOT)}:{line}"
            try:
                mod = importlib.import_module(module)
            except ImportError as e:
                missing.append(f"{where}: {module} ({e})")
                continue
            if name is not None and not hasattr(mod, name):
                try:
                    importlib.import_module(f"{module}.{name}")
                except ImportError:
                    missing.append(f"{where}: {module}.{name}")
    assert seen > 50  # the walk found the scripts' imports
    assert missing == []


@pytest.mark.parametrize("name", sorted(set(SCRIPTS) - LIBRARIES))
def test_a_script_that_imports_the_project_at_load_imports_this_checkouts(probed, name):
    # python puts bench/ on sys.path, not the repository: a script that imports radixkv without
    # putting the repository first measured whichever radixkv is installed (model_speed.py did, so
    # from a second checkout sharing one venv it timed the other checkout's code)
    tree = ast.parse((ROOT / "bench" / f"{name}.py").read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    if any(True for n in top for _ in _project_imports_of(n)):
        assert probed[name]["root_on_path"], (
            f"bench/{name}.py imports radixkv without putting the repository on sys.path"
        )


def test_sim_routing_reuse_records_a_path_outside_the_repository(tmp_path):
    # --reuse /tmp/x.json crashed after the whole simulation (Path.relative_to ValueError)
    from bench.sim_routing import _shown

    outside = tmp_path / "sim_routing_x.json"
    assert _shown(outside) == str(outside)
    assert _shown(ROOT / "bench" / "results" / "x.json") == "bench/results/x.json"


def test_sglang_bench_serving_writes_its_sharegpt_subset(tmp_path):
    # it imported iter_sharegpt from radixkv.replay after the function moved to radixkv.datasets:
    # the script started its server, then died on the ImportError
    from bench.sglang_bench_serving import sharegpt_subset

    path = sharegpt_subset(tmp_path / "sharegpt_3.json", count=3)
    recs = json.loads(path.read_text())
    assert len(recs) == 3
    assert all(r["conversations"] and {"from", "value"} <= set(r["conversations"][0]) for r in recs)


def test_sglang_bench_serving_refuses_a_missing_sglang_python_before_starting_a_server(tmp_path):
    from bench.sglang_bench_serving import main

    missing = tmp_path / "no-sglang" / "python"
    with pytest.raises(SystemExit, match="--sglang-python .*no-sglang/python is not an executable"):
        main(["--sglang-python", str(missing), "--work-dir", str(tmp_path / "w")])
    assert not (tmp_path / "w").exists()


WRITES_NO_RESULT = {
    "gpu_check": "the GPU box's check: gpu_check.json and gpu_check.md into its --out folder, carried back",
    "plot": "reads bench/results/ and draws PNGs",
    "prepare_gpu_carry": "builds the GPU box's carry: measures nothing",
}
"""The scripts that write no result JSON of their own through bench/results_io.py, and why."""


def _calls_write_result(path: Path) -> bool:
    return any(
        isinstance(n, ast.Call) and getattr(n.func, "id", None) == "write_result"
        for n in ast.walk(ast.parse(path.read_text()))
    )


@pytest.mark.parametrize("name", sorted(set(SCRIPTS) - LIBRARIES - set(WRITES_NO_RESULT)))
def test_a_benchmark_writes_its_result_json_through_results_io_and_takes_out(probed, name):
    # model_speed.py and isa_decode.py (and explain_overhead.py) printed their figures and wrote no
    # file; sglang_bench_serving.py always wrote to the default path; tree_ops.py and vs_llamacpp.py
    # dumped their own JSON without the run metadata, under --json / --output
    assert _calls_write_result(ROOT / "bench" / f"{name}.py"), f"bench/{name}.py does not call write_result"
    assert "--out " in probed[name]["help"] or "--out," in probed[name]["help"], f"bench/{name}.py has no --out"
