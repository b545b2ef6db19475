"""The one writer of the benchmarks' result JSON (``bench/results/<kind>_<UTC time>.json``).

Every result file starts with the same run metadata, then the script's own fields:

- ``kind``: the benchmark's name (also the file name's prefix);
- ``created``: UTC time, ISO 8601 to the second;
- ``argv``: the script's arguments;
- ``seconds``: wall time since ``started`` (when given);
- ``machine``: ``platform``, ``cpus``, ``python`` and whatever the script adds (torch version,
  device, threads).

    from bench.results_io import write_result

    path = write_result("sim_cache", {"workloads": results}, args.out, started=t0, machine={"torch": torch.__version__})
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

RESULTS = Path(__file__).resolve().parent / "results"


def machine_info(**extra: Any) -> dict:
    """``platform``, ``cpus`` (``os.cpu_count()``), ``python`` (version), then ``extra``."""
    return dict(platform=platform.platform(), cpus=os.cpu_count(), python=platform.python_version(), **extra)


def write_result(
    kind: str,
    fields: dict,
    out: Union[str, Path, None] = None,
    *,
    argv: Optional[Sequence[str]] = None,
    started: Optional[float] = None,
    machine: Optional[dict] = None,
    default: Optional[Callable[[Any], Any]] = None,
) -> Path:
    """Write the run metadata (module docstring) and ``fields`` as indented JSON; returns the path.

    Args:
        kind: the benchmark's name, e.g. ``"sim_cache"``.
        fields: the script's results; a key equal to a metadata key replaces it.
        out: the file to write; None: ``bench/results/<kind>_<UTC %Y%m%dT%H%M%SZ>.json``. Its
            folder is created when missing.
        argv: the arguments to record (None: ``sys.argv[1:]``).
        started: ``time.time()`` at the run's start, for ``seconds`` (None: no ``seconds``).
        machine: extra ``machine`` entries (torch version, device, threads ...).
        default: ``json.dumps``'s ``default`` for values JSON cannot hold (e.g. ``str``).

    Raises:
        TypeError: a value JSON cannot hold and ``default`` does not convert.
    """
    now = datetime.now(timezone.utc)
    meta: dict = dict(kind=kind, created=now.isoformat(timespec="seconds"))
    meta["argv"] = list(sys.argv[1:] if argv is None else argv)
    if started is not None:
        meta["seconds"] = round(time.time() - started, 1)
    meta["machine"] = machine_info(**(machine or {}))
    text = json.dumps({**meta, **fields}, indent=1, default=default) + "\n"
    path = Path(out) if out else RESULTS / f"{kind}_{now:%Y%m%dT%H%M%SZ}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path
