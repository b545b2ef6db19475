#!/usr/bin/env python3
"""Prepare the files the GPU check carries to a machine without network (``.fi/``).

The H200 box has Python 3.12, torch 2.11 (CUDA 13.0), nvcc and ninja, but no flashinfer and no
network. This script, run on any x86-64 Linux machine with pip access (no GPU needed):

1. downloads ``flashinfer-python`` (pure-Python wheel) and ``apache-tvm-ffi`` (binary, one wheel
   for the local Python to build with, one cp312 manylinux wheel to carry) with ``pip download``;
2. trims the flashinfer wheel: drops the kernel sources of features radixkv never calls
   (``data/csrc/<subdirs>``, ``data/cutlass``, ``data/spdlog``). What stays is enough to
   JIT-compile the FA2 prefill / decode modules on the GPU box as a fallback;
3. creates a build venv (on top of the project's venv through a ``.pth`` file), installs the
   trimmed wheel, tvm-ffi and the CUDA 13.0 compiler wheels (``nvidia-cuda-nvcc`` & co.), and
   ahead-of-time compiles the FA2 batch-prefill module (equal K/V strides; also used by
   tensor-core decode) and the CUDA-core batch-decode module for ``sm_90a``, for every
   (dtype, head_dim) asked for;
4. puts the compiled ``.so`` files into the trimmed wheel under ``flashinfer/data/aot/<name>/``,
   where FlashInfer looks before it would JIT-compile, and writes ``.fi/manifest.json`` with
   the exact versions, module names and sizes.

Output (``--out``, default ``.fi`` in the repository root, listed in .gitignore)::

    .fi/wheels/flashinfer_python-<ver>-py3-none-any.whl   trimmed, with the AOT modules inside
    .fi/wheels/apache_tvm_ffi-<ver>-cp312-...whl
    .fi/manifest.json

5. verifies the result (:func:`verify_carry`): the manifest lists, and the flashinfer wheel holds,
   the AOT modules the GPU check needs (``REQUIRED_MODULES``: bf16 decode head_dim 64, FA2 prefill
   head_dim 64 and 128), the wheels on disk match the manifest, and ``.fi`` plus the working tree
   that a device call sends (tracked + untracked-not-ignored files) stay under the 64 MiB a call
   carries. Any problem is printed and the script exits with status 2.

Usage: ``python bench/prepare_gpu_carry.py`` (about 5-15 minutes on 2 cores, most of it nvcc);
``python bench/prepare_gpu_carry.py --check-only`` runs only step 5 on an existing ``.fi``
(seconds). On the GPU box, ``bench/gpu_check.py --carry .fi`` runs the same verification (without
the tree size) and installs the wheels with ``pip install --no-index --no-deps --target``.
Method and measurements: ``shared/notes/flashinfer.md`` sections 2.3-2.4.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

FLASHINFER_VERSION = "0.7.2.post1"
TVM_FFI_VERSION = "0.1.15.post2"
# CUDA 13.0 toolchain as pip wheels (match the H200 image's nvcc 13.0 / torch cu130).
CUDA_WHEELS = [
    "nvidia-cuda-nvcc==13.0.88",
    "nvidia-cuda-runtime==13.0.96",
    "nvidia-cuda-cccl==13.0.85",
    "nvidia-cuda-crt==13.0.88",
    "nvidia-nvvm==13.0.88",
]
CUDA_ARCH = "9.0a"
TARGET_PLATFORMS = [
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
]
# Wheel members not needed for FA2 attention (neither JIT nor AOT); see notes section 2.3.
_DROP = re.compile(r"^flashinfer/data/(csrc/[^/]+/|cutlass/|spdlog/)")

REPO = Path(__file__).resolve().parents[1]
# What one device call carries at most: the working tree plus the carried paths (device README).
CARRY_LIMIT_BYTES = 64 * 2**20
# The AOT modules bench/gpu_check.py needs, as (kind, head_dim, dtype): CUDA-core decode of the
# 9/3 x 64 shape (GQA group 3 < 4), FA2 prefill for 9/3 x 64 and 32/8 x 128 (the latter also
# serves the tensor-core decode of 32/8 x 128, group 4). Anything missing is JIT-compiled on the
# box only if FLASHINFER_DISABLE_JIT is unset (nvcc, ninja and $CUDA_HOME/lib64 needed there).
REQUIRED_MODULES = (("decode", 64, "bf16"), ("prefill", 64, "bf16"), ("prefill", 128, "bf16"))
_KIND_IN_MANIFEST = {"decode": "decode", "prefill": "prefill_fa2"}


def _run(cmd: list[str], **kw) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kw)


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def repack_wheel(src: Path, dst: Path, extra: dict[str, bytes] | None = None) -> dict:
    """Rewrite wheel ``src`` to ``dst`` without the members matching ``_DROP``, adding
    ``extra`` (archive name -> bytes), and regenerate RECORD. Returns size statistics."""
    extra = dict(extra or {})
    dropped = 0
    record_name = None
    lines: list[str] = []
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_suffix(".tmp")
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            name = info.filename
            if name.endswith(".dist-info/RECORD"):
                record_name = name
                continue
            if _DROP.match(name) or name in extra:
                dropped += 1
                continue
            data = zin.read(info)
            zout.writestr(info, data)
            if not name.endswith("/"):
                lines.append(_record_line(name, data))
        for name, data in sorted(extra.items()):
            zout.writestr(name, data)
            lines.append(_record_line(name, data))
        if record_name is None:
            raise ValueError(f"{src}: no .dist-info/RECORD member")
        lines.append(f"{record_name},,")
        zout.writestr(record_name, "\n".join(lines) + "\n")
    tmp.replace(dst)
    return {"dropped_members": dropped, "bytes": dst.stat().st_size}


def _pip_download(pip: list[str], spec: str, dest: Path, target: bool) -> Path:
    cmd = pip + ["download", "--no-deps", "-q", "-d", str(dest), spec]
    if target:
        cmd += ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"]
        for p in TARGET_PLATFORMS:
            cmd += ["--platform", p]
    _run(cmd)
    name = spec.split("==")[0].replace("-", "_")
    ver = spec.split("==")[1]
    hits = sorted(dest.glob(f"{name}-{ver}-*.whl"))
    if target:
        hits = [h for h in hits if "cp312" in h.name or "py3-none" in h.name or "abi3" in h.name]
    if not hits:
        raise FileNotFoundError(f"no wheel for {spec} in {dest}")
    return hits[-1]


def _module_specs(dtypes: list[str], modules: list[tuple[str, int]]):
    """JIT specs of the modules radixkv's FlashInfer backend loads (built inside the venv).

    ``modules``: ``("decode", head_dim)`` is the CUDA-core batch-decode module (GQA group < 4);
    ``("prefill", head_dim)`` the FA2 batch-prefill module with equal K/V strides, which also
    serves tensor-core decode (group >= 4)."""
    import torch
    from flashinfer.jit.attention import modules as m

    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}
    specs = []
    for d in dtypes:
        for kind, hd in modules:
            args = (dt[d], dt[d], dt[d], torch.int32, hd, hd, 0, False, False)
            if kind == "decode":
                specs.append(("decode", d, hd, m.gen_batch_decode_module(*args)))
            else:
                specs.append(("prefill_fa2", d, hd, m._gen_batch_prefill_primary_module("fa2", *args, False)))
    return specs


def build_modules(out: Path, dtypes: list[str], modules: list[tuple[str, int]]) -> None:
    """Runs inside the build venv: compile each module, copy its .so into ``out/aot``."""
    import flashinfer

    records = []
    for kind, d, hd, spec in _module_specs(dtypes, modules):
        t0 = time.time()
        spec.build(verbose=False)
        so = spec.jit_library_path
        dst = out / "aot" / spec.name / f"{spec.name}.so"
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(so, dst)
        records.append(
            {
                "kind": kind,
                "dtype": d,
                "head_dim": hd,
                "name": spec.name,
                "bytes": dst.stat().st_size,
                "build_s": round(time.time() - t0, 1),
            }
        )
        print(f"built {spec.name} ({dst.stat().st_size} B, {time.time() - t0:.0f} s)", flush=True)
    (out / "aot" / "modules.json").write_text(
        json.dumps({"flashinfer": flashinfer.__version__, "modules": records}, indent=1)
    )


def _cuda_home(build: Path, site: Path) -> Path:
    """A CUDA_HOME made of symlinks into the pip CUDA wheels, plus a stub libcuda.so."""
    cu = site / "nvidia" / "cu13"
    home = build / "cuda_home"
    (home / "lib64" / "stubs").mkdir(parents=True, exist_ok=True)
    for sub in ("bin", "include", "nvvm"):
        link = home / sub
        if not link.exists():
            link.symlink_to(cu / sub)
    rt = home / "lib64" / "libcudart.so"
    if not rt.exists():
        rt.symlink_to(cu / "lib" / "libcudart.so.13")
    stub = home / "lib64" / "stubs" / "libcuda.so"
    if not stub.exists():
        _run(["gcc", "-shared", "-o", str(stub), "-x", "c", "/dev/null"])
    return home


def working_tree_bytes(repo: Path) -> tuple[int, str]:
    """Bytes of what a device call sends from ``repo`` besides the carried paths: tracked and
    untracked-not-ignored files (``git ls-files -co --exclude-standard``; a ``shared/`` folder
    inside the checkout is included by the same rule). Returns ``(bytes, method)``; without git
    (or outside a checkout) every file below ``repo`` except ``.git`` and ignored build folders is
    counted, and ``method`` says so."""
    try:
        out = subprocess.run(
            ["git", "-C", str(repo), "ls-files", "-z", "-co", "--exclude-standard"],
            capture_output=True,
            check=True,
            timeout=60,
        ).stdout
        total = 0
        for name in out.decode(errors="surrogateescape").split("\0"):
            p = repo / name
            if name and os.path.lexists(p):
                total += os.lstat(p).st_size
        return total, "git ls-files -co --exclude-standard"
    except (OSError, subprocess.SubprocessError):
        skip = {".git", ".venv", ".fi", ".whl", ".gl", "build", "__pycache__", ".hypothesis", ".pytest_cache"}
        total = 0
        for root, dirs, files in os.walk(repo):
            dirs[:] = [d for d in dirs if d not in skip]
            total += sum(os.lstat(os.path.join(root, f)).st_size for f in files)
        return total, "os.walk (no git; approximate)"


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def verify_carry(
    fi: Path,
    tree_bytes: int | None = None,
    limit_bytes: int = CARRY_LIMIT_BYTES,
    required=REQUIRED_MODULES,
) -> dict:
    """Check a carry folder made by this script; returns ``{"ok", "problems", ...}`` (never raises).

    * ``fi/manifest.json`` parses and lists an AOT module for every ``required`` (kind, head_dim,
      dtype) (``kind`` "prefill" is recorded as "prefill_fa2");
    * ``fi/wheels`` holds one flashinfer wheel and one cp312 apache-tvm-ffi wheel, with the names
      and sizes the manifest gives, and the flashinfer wheel contains every listed module at
      ``flashinfer/data/aot/<name>/<name>.so`` (non-empty);
    * when ``tree_bytes`` is given: the bytes of ``fi`` plus ``tree_bytes`` stay below
      ``limit_bytes`` (what one device call carries).
    """
    problems: list[str] = []
    res: dict = {"carry": str(fi), "required": [f"{k}:{hd}:{dt}" for k, hd, dt in required]}
    man_path = fi / "manifest.json"
    if not fi.is_dir():
        problems.append(f"{fi} does not exist (run bench/prepare_gpu_carry.py)")
    elif not man_path.is_file():
        problems.append(f"{man_path} is missing (run bench/prepare_gpu_carry.py)")
    man = None
    if man_path.is_file():
        try:
            man = json.loads(man_path.read_text())
        except ValueError as exc:
            problems.append(f"{man_path} is not valid JSON: {exc}")
    wheels_dir = fi / "wheels"
    on_disk = {p.name: p.stat().st_size for p in sorted(wheels_dir.glob("*.whl"))} if wheels_dir.is_dir() else {}
    res["wheels"] = on_disk
    fi_wheels = [n for n in on_disk if n.startswith("flashinfer_python-")]
    tvm_wheels = [n for n in on_disk if n.startswith("apache_tvm_ffi-")]
    if fi.is_dir():
        if len(fi_wheels) != 1:
            problems.append(f"expected one flashinfer_python wheel in {wheels_dir}, found {fi_wheels}")
        if len(tvm_wheels) != 1 or "cp312" not in tvm_wheels[0]:
            problems.append(f"expected one cp312 apache_tvm_ffi wheel in {wheels_dir}, found {tvm_wheels}")
    modules = []
    if isinstance(man, dict):
        listed = man.get("wheels") or {}
        for name, size in listed.items():
            if name not in on_disk:
                problems.append(f"manifest lists {name}, not in {wheels_dir}")
            elif on_disk[name] != size:
                problems.append(f"{name}: {on_disk[name]} B on disk, {size} B in the manifest")
        for name in on_disk:
            if name not in listed:
                problems.append(f"{wheels_dir / name} is not in the manifest")
        modules = [m for m in man.get("aot_modules") or [] if isinstance(m, dict)]
        for kind, hd, dt in required:
            want = _KIND_IN_MANIFEST[kind]
            if not any(m.get("kind") == want and m.get("head_dim") == hd and m.get("dtype") == dt for m in modules):
                problems.append(f"manifest lists no {kind} module for head_dim {hd} {dt} (rebuild with --modules)")
    short = {v: k for k, v in _KIND_IN_MANIFEST.items()}
    res["modules"] = [
        f"{short.get(m.get('kind'), m.get('kind'))}:{m.get('head_dim')}:{m.get('dtype')}" for m in modules
    ]
    if len(fi_wheels) == 1 and modules:
        try:
            with zipfile.ZipFile(wheels_dir / fi_wheels[0]) as z:
                sizes = {i.filename: i.file_size for i in z.infolist()}
        except (OSError, zipfile.BadZipFile) as exc:
            problems.append(f"{fi_wheels[0]} does not open as a zip: {exc}")
            sizes = {}
        for m in modules:
            member = f"flashinfer/data/aot/{m.get('name')}/{m.get('name')}.so"
            if sizes and not sizes.get(member):
                problems.append(f"{fi_wheels[0]} lacks {member} (or it is empty)")
    res["fi_bytes"] = _dir_bytes(fi) if fi.is_dir() else 0
    res["limit_bytes"] = limit_bytes
    if tree_bytes is not None:
        res["tree_bytes"] = tree_bytes
        res["total_bytes"] = res["fi_bytes"] + tree_bytes
        if res["total_bytes"] >= limit_bytes:
            problems.append(
                f"{fi} ({res['fi_bytes'] / 2**20:.1f} MiB) + working tree ({tree_bytes / 2**20:.1f} MiB) = "
                f"{res['total_bytes'] / 2**20:.1f} MiB, not under the {limit_bytes / 2**20:.0f} MiB a device call carries"
            )
    res["problems"] = problems
    res["ok"] = not problems
    return res


def _report(res: dict) -> int:
    """Print the verification; 0 when it passed, 2 otherwise."""

    def mib(n: int) -> str:
        return f"{n / 2**20:.1f} MiB"

    sizes = f".fi {mib(res['fi_bytes'])}"
    if "tree_bytes" in res:
        sizes += f" + tree {mib(res['tree_bytes'])} = {mib(res['total_bytes'])} (limit {mib(res['limit_bytes'])})"
    print(f"carry check: modules {res['modules']} (need {res['required']}); {sizes}", flush=True)
    if res["ok"]:
        print("carry check: OK", flush=True)
        return 0
    print("CARRY CHECK FAILED:", file=sys.stderr)
    for p in res["problems"]:
        print(f"  - {p}", file=sys.stderr)
    return 2


def check_carry(fi: Path, repo: Path = REPO, limit_bytes: int = CARRY_LIMIT_BYTES, required=REQUIRED_MODULES) -> int:
    """:func:`verify_carry` with the working tree of ``repo`` counted; prints and returns 0 / 2."""
    tree, method = working_tree_bytes(repo)
    res = verify_carry(fi, tree, limit_bytes, required)
    res["tree_method"] = method
    return _report(res)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / ".fi")
    ap.add_argument("--build-dir", type=Path, default=Path.home() / ".cache" / "radixkv-fi-build")
    ap.add_argument("--dtypes", default="bf16", help="comma list of bf16,fp16")
    ap.add_argument(
        "--modules",
        default="decode:64,prefill:64,prefill:128",
        help="comma list of decode:<head_dim> / prefill:<head_dim> (default: what the "
        "SmolLM2 shape (9/3 x 64, CUDA-core decode) and the 32/8 x 128 shape "
        "(tensor-core decode) use; anything else is JIT-compiled on the GPU box)",
    )
    ap.add_argument(
        "--no-aot", action="store_true", help="carry the trimmed wheel only (the GPU box then JIT-compiles)"
    )
    ap.add_argument("--jobs", default=os.environ.get("MAX_JOBS", "2"))
    ap.add_argument(
        "--check-only", action="store_true", help="only verify an existing --out (manifest, modules, 64 MiB limit)"
    )
    ap.add_argument("--limit-mib", type=float, default=CARRY_LIMIT_BYTES / 2**20, help=argparse.SUPPRESS)
    ap.add_argument("--_build-in-venv", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    limit = int(a.limit_mib * 2**20)
    if a.check_only:
        return check_carry(a.out, REPO, limit)
    dtypes = a.dtypes.split(",")
    modules = []
    for item in a.modules.split(","):
        kind, _, hd = item.partition(":")
        if kind not in ("decode", "prefill") or not hd.isdigit():
            raise ValueError(f"--modules: {item!r} is not decode:<head_dim> or prefill:<head_dim>")
        modules.append((kind, int(hd)))
    for d in dtypes:
        if d not in ("bf16", "fp16"):
            raise ValueError(f"--dtypes: {d!r} is not one of bf16, fp16")

    if a._build_in_venv:
        build_modules(a.out, dtypes, modules)
        return 0

    build, out = a.build_dir, a.out
    dl = build / "dl"
    dl.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip"]
    fi_whl = _pip_download(pip, f"flashinfer-python=={FLASHINFER_VERSION}", dl, target=False)
    tvm_312 = _pip_download(pip, f"apache-tvm-ffi=={TVM_FFI_VERSION}", dl, target=True)

    trimmed = build / "trimmed" / fi_whl.name
    stats = repack_wheel(fi_whl, trimmed)
    print(f"trimmed {fi_whl.name}: {fi_whl.stat().st_size} -> {stats['bytes']} B", flush=True)

    modules: dict = {"modules": []}
    extra: dict[str, bytes] = {}
    if not a.no_aot:
        venv = build / "venv"
        py = venv / "bin" / "python"
        if not py.exists():
            _run([sys.executable, "-m", "venv", str(venv)])
        site = Path(
            subprocess.check_output(
                [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
            ).strip()
        )
        # Reuse the project's venv (torch, jinja2, numpy, requests ...) underneath.
        import sysconfig

        (site / "radixkv_base_venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
        probe = subprocess.run(
            [
                str(py),
                "-c",
                "import flashinfer, tvm_ffi, sys; "
                f"sys.exit(flashinfer.__version__ != {FLASHINFER_VERSION!r} or tvm_ffi.__version__ != {TVM_FFI_VERSION!r})",
            ],
            capture_output=True,
        )
        if probe.returncode != 0 or not (site / "nvidia" / "cu13" / "bin" / "nvcc").exists():
            # (re)installing changes header mtimes, which makes ninja rebuild: only when needed
            _run(
                [
                    str(py),
                    "-m",
                    "pip",
                    "install",
                    "-q",
                    "--no-deps",
                    "--force-reinstall",
                    str(trimmed),
                    f"apache-tvm-ffi=={TVM_FFI_VERSION}",
                    "nvidia-ml-py",
                    *CUDA_WHEELS,
                ]
            )
        env = dict(os.environ)
        home = _cuda_home(build, site)
        env.update(
            {
                "CUDA_HOME": str(home),
                "CUDA_PATH": str(home),
                "PATH": f"{home / 'bin'}:{env.get('PATH', '')}",
                "FLASHINFER_CUDA_ARCH_LIST": CUDA_ARCH,
                "FLASHINFER_WORKSPACE_BASE": str(build / "ws"),
                "MAX_JOBS": str(a.jobs),
                "LD_LIBRARY_PATH": f"{site / 'nvidia' / 'cu13' / 'lib'}:{env.get('LD_LIBRARY_PATH', '')}",
            }
        )
        stage = build / "stage"
        shutil.rmtree(stage, ignore_errors=True)
        _run(
            [str(py), __file__, "--_build-in-venv", "--out", str(stage), "--dtypes", a.dtypes, "--modules", a.modules],
            env=env,
        )
        modules = json.loads((stage / "aot" / "modules.json").read_text())
        for rec in modules["modules"]:
            so = stage / "aot" / rec["name"] / f"{rec['name']}.so"
            extra[f"flashinfer/data/aot/{rec['name']}/{rec['name']}.so"] = so.read_bytes()

    wheels = out / "wheels"
    shutil.rmtree(wheels, ignore_errors=True)
    wheels.mkdir(parents=True)
    final = repack_wheel(fi_whl, wheels / fi_whl.name, extra)
    shutil.copy2(tvm_312, wheels / tvm_312.name)
    manifest = {
        "flashinfer_python": FLASHINFER_VERSION,
        "apache_tvm_ffi": TVM_FFI_VERSION,
        "cuda_wheels": CUDA_WHEELS if not a.no_aot else [],
        "cuda_arch": CUDA_ARCH,
        "trim": _DROP.pattern,
        "wheels": {p.name: p.stat().st_size for p in sorted(wheels.iterdir())},
        "total_bytes": sum(p.stat().st_size for p in wheels.iterdir()),
        "aot_modules": modules["modules"],
        "original_flashinfer_wheel_bytes": fi_whl.stat().st_size,
        "dropped_members": final["dropped_members"],
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(json.dumps({k: manifest[k] for k in ("wheels", "total_bytes")}, indent=1))
    if a.no_aot:
        print("--no-aot: the GPU box must JIT-compile every module (unset FLASHINFER_DISABLE_JIT there)")
        return check_carry(out, REPO, limit, required=())
    return check_carry(out, REPO, limit)


if __name__ == "__main__":
    sys.exit(main())
