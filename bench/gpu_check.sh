#!/usr/bin/env bash
# The prepared GPU check (one H200; fits in 9 minutes): the CUDA tests, then bench/gpu_check.py's
# single-GPU calls of a 1.2B Llama-shape model in bf16 against transformers, with the cost
# model's prediction for h200:1x1 beside each, then bench/kernel_check.py's GEMMs, fused attention
# and bandwidth of two GPT layers against the cost model's kernel times. Writes
# $OUT/gpu_report.json, $OUT/kernel_report.json and their logs.
#
# The device machine has torch, transformers, pytest and CUDA but no package index: what else the
# code imports (pydantic) comes as wheels from bench/wheels, which `bench/gpu_check.sh --wheels`
# downloads here first (run it on a machine with the index; carry bench/wheels to the device):
#
#   bash bench/gpu_check.sh --wheels          # here (2.8 MB of wheels)
#   bash bench/gpu_check.sh                   # there: the device tool's run with
#                                             #   command "bash bench/gpu_check.sh", carry ["bench/wheels"],
#                                             #   timeout_s 570; $OUT (set there) receives the reports
#
# Then commit $OUT/gpu_report.json and $OUT/kernel_report.json under bench/results/ and calibrate
# the torch framework from them (planner profile on CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=bench/wheels
if [[ "${1:-}" == "--wheels" ]]; then
    # The device's Python (3.12, x86-64) takes these; pydantic-core is a compiled wheel.
    python3 -m pip download -q --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
        --implementation cp -d "$WHEELS" "pydantic==2.14.4"
    ls "$WHEELS"
    exit 0
fi
OUT="${OUT:-out/gpu}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import pydantic" 2>/dev/null || python3 -m pip install -q --no-index --find-links "$WHEELS" pydantic
python3 - <<'PY'
import torch, transformers
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(), "transformers", transformers.__version__)
PY
# The CUDA tests (they skip on a machine without a GPU), then the measurements.
set +e
timeout 180 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_runtime_cuda.py 2>&1 | tee "$OUT/gpu_tests.log"
tests=${PIPESTATUS[0]}
timeout 270 python3 bench/gpu_check.py --out "$OUT/gpu_report.json" 2>&1 | tee "$OUT/gpu_check.log"
bench=${PIPESTATUS[0]}
timeout 120 python3 bench/kernel_check.py --out "$OUT/kernel_report.json" 2>&1 | tee "$OUT/kernel_check.log"
kernels=${PIPESTATUS[0]}
echo "tests exit $tests, bench exit $bench, kernels exit $kernels"
exit $(( tests != 0 || bench != 0 || kernels != 0 ))
