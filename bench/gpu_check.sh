#!/usr/bin/env bash
# The one command of the GPU check, run on the H200 box from the repository root with the
# carried folder .fi (made here by `python bench/prepare_gpu_carry.py`). See docs/gpu.md.
#   device run:  command "bash bench/gpu_check.sh", carry [".fi"], timeout_s 300
# Time: the check has a 210 s budget of its own (set-up + sections with caps, JSON saved after
# each) and is killed at 225 s (SIGTERM: it saves and stops; SIGKILL 10 s later); pytest gets
# 45 s. About 2-3 minutes when all goes well, at most ~285 s, so a 300 s device call leaves room
# for a rerun within 15 minutes of device time.
# Writes into $OUT (default bench/results/tmp/gpu_check): gpu_check.json, gpu_check.md,
# gpu_check.log, pytest_gpu.log, nvidia_smi.txt (GPU + toolchain). Exit status 0 only when the
# check and the pytest step both passed (the JSON's "passed" says the same).
# Environment: RADIXKV_FI_ALLOW_JIT=1 lets FlashInfer compile missing modules (needs nvcc, ninja,
# $CUDA_HOME/lib64/stubs/libcuda.so; else FLASHINFER_DISABLE_JIT=1 makes that an error);
# RADIXKV_CHECK_BUDGET (s) changes the check's budget, RADIXKV_CHECK_KILL_S its hard limit.
set -o pipefail
OUT=${OUT:-bench/results/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
export RADIXKV_FI_SITE=${RADIXKV_FI_SITE:-/tmp/radixkv_fi_site}
# one workspace for the check and the pytest step (a JIT build, if any, lands there)
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/radixkv_fi_ws}
mkdir -p "$FLASHINFER_WORKSPACE_BASE"
if [ "${RADIXKV_FI_ALLOW_JIT:-0}" = 1 ]; then
    unset FLASHINFER_DISABLE_JIT
    jit=--allow-jit
else
    export FLASHINFER_DISABLE_JIT=1  # a missing/unloadable prebuilt module fails loudly, no silent compile
    jit=
fi
{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv
    echo "which nvcc ninja: $(command -v nvcc) $(command -v ninja)"
    nvcc --version 2>&1 | tail -n 2
    cuda_home=${CUDA_HOME:-/usr/local/cuda}
    echo "CUDA_HOME=${CUDA_HOME:-unset} (looked at $cuda_home)"
    ls -ld "$cuda_home/lib64" "$cuda_home/lib64/libcudart.so" "$cuda_home/lib64/stubs/libcuda.so" 2>&1
    echo "FLASHINFER_DISABLE_JIT=${FLASHINFER_DISABLE_JIT:-unset} FLASHINFER_WORKSPACE_BASE=$FLASHINFER_WORKSPACE_BASE"
} >"$OUT/nvidia_smi.txt" 2>&1
budget=${RADIXKV_CHECK_BUDGET:-210}
kill_s=${RADIXKV_CHECK_KILL_S:-225}
timeout -k 10 "$kill_s" python3 bench/gpu_check.py --carry .fi --out "$OUT" --budget "$budget" $jit 2>&1 |
    tee "$OUT/gpu_check.log"
rc=$?
# the unit tests of the backend, the gpu-marked ones included, against the flashinfer just installed
PYTHONPATH="$RADIXKV_FI_SITE:." timeout -k 5 45 python3 -m pytest -q -rs -p no:cacheprovider \
    tests/test_flashinfer_metadata.py 2>&1 | tee "$OUT/pytest_gpu.log"
prc=$?
# fold the pytest result into gpu_check.json / .md; its exit status is the whole check's
python3 bench/gpu_check.py --merge-pytest "$OUT/pytest_gpu.log" --pytest-rc "$prc" --check-rc "$rc" --out "$OUT"
