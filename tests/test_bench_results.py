"""bench/results_io.py: the one writer of the benchmarks' result JSON (run metadata first, then
the script's fields; the default path under bench/results/)."""

from __future__ import annotations

import json
import os
import platform
import re
import time

from bench import results_io
from bench.results_io import write_result


def test_write_result_puts_the_run_metadata_before_the_fields(tmp_path):
    out = tmp_path / "sub" / "r.json"
    t0 = time.time() - 2.0
    path = write_result(
        "demo", {"rows": [1, 2], "model": "m"}, out, argv=["--x", "1"], started=t0, machine={"torch": "9.9"}
    )
    assert path == out
    data = json.loads(out.read_text())
    assert list(data) == ["kind", "created", "argv", "seconds", "machine", "rows", "model"]
    assert data["kind"] == "demo" and data["argv"] == ["--x", "1"] and data["rows"] == [1, 2]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", data["created"])
    assert 2.0 <= data["seconds"] < 60
    assert data["machine"] == {
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": "9.9",
    }


def test_write_result_default_path_and_converter(tmp_path, monkeypatch):
    monkeypatch.setattr(results_io, "RESULTS", tmp_path / "results")
    path = write_result("demo_kind", {"where": tmp_path}, default=str)
    assert path.parent == tmp_path / "results"
    assert re.fullmatch(r"demo_kind_\d{8}T\d{6}Z\.json", path.name)
    data = json.loads(path.read_text())
    assert data["where"] == str(tmp_path) and "seconds" not in data
    assert data["created"].replace("-", "").replace(":", "")[:15] == path.name[10:25]
