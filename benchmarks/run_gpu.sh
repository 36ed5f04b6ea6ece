#!/usr/bin/env bash
# One call on the GPU machine: install, run every GPU test, run the quick benchmarks, print a table.
# Usage (from the repo root, on the device): bash benchmarks/run_gpu.sh [pytest -k expression]
# BENCHMARKS picks benchmarks (default: both; "" for none); BENCH_FLAGS="" runs them in full;
# a -k expression that matches nothing runs the benchmarks alone.
# Carried wheels in .whl/ (flashinfer and its needs) are installed first when present.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-} TVM_FFI_DISABLE_TORCH_C_DLPACK=1
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
  || { cat "$OUT/install.log"; exit 1; }
python3 - <<'PY'
import torch, transformers
print(f"device {torch.cuda.get_device_name()} | torch {torch.__version__} | transformers {transformers.__version__}")
PY
python3 -m pytest -q -m gpu -s -rs ${1:+-k "$1"} tests/ 2>&1 | tee "$OUT/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}
for bench in ${BENCHMARKS-bench_encoder.py bench_caption.py}; do
  python3 "benchmarks/$bench" ${BENCH_FLAGS---quick} --json "$OUT/${bench%.py}.json" 2>&1 | tee "$OUT/${bench%.py}.log"
done
echo
echo "== summary =="
grep -E "passed|failed|error" "$OUT/gpu_tests.log" | tail -1
for bench in ${BENCHMARKS-bench_encoder.py bench_caption.py}; do
  echo "-- $bench"; grep -A40 "^| workload" "$OUT/${bench%.py}.log" || tail -5 "$OUT/${bench%.py}.log"
done
exit "$tests_rc"
