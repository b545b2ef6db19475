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

Usage: ``python bench/prepare_gpu_carry.py`` (about 5-15 minutes on 2 cores, most of it nvcc).
On the GPU box, ``bench/gpu_check.py --carry .fi`` installs these with
``pip install --no-index --no-deps --target``. Method and measurements:
``shared/notes/flashinfer.md`` sections 2.3-2.4.
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
    ap.add_argument("--_build-in-venv", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
