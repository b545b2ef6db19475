#!/usr/bin/env bash
# The one command of the GPU check, run on the H200 box from the repository root with the
# carried folder .fi (made here by `python bench/prepare_gpu_carry.py`). See docs/gpu.md.
#   device run:  command "bash bench/gpu_check.sh", carry [".fi"], timeout_s 420
# Writes into $OUT (default bench/results/tmp/gpu_check): gpu_check.json, gpu_check.md,
# gpu_check.log, pytest_gpu.log, nvidia_smi.txt. Exit status: the check's (0 = passed).
set -o pipefail
OUT=${OUT:-bench/results/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
export RADIXKV_FI_SITE=${RADIXKV_FI_SITE:-/tmp/radixkv_fi_site}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv \
    >"$OUT/nvidia_smi.txt" 2>&1
timeout 330 python3 bench/gpu_check.py --carry .fi --out "$OUT" 2>&1 | tee "$OUT/gpu_check.log"
rc=$?
# the gpu-marked unit tests, against the flashinfer the check just installed
PYTHONPATH="$RADIXKV_FI_SITE:." timeout 60 python3 -m pytest -q -p no:cacheprovider \
    tests/test_flashinfer_metadata.py 2>&1 | tee "$OUT/pytest_gpu.log"
exit $rc
