#!/usr/bin/env bash
# One call on the GPU machine: install, run every GPU test (and the processor comparisons, which
# need the torchvision that machine has), run the quick benchmarks, print a table. On a machine
# of two GPUs or more (nvidia-h200-x2) the tests and the benchmarks run side by side.
# Usage (from the repo root, on the device): bash benchmarks/run_gpu.sh [pytest -k expression]
# BENCHMARKS picks benchmarks (default: all six; "" for none); BENCH_FLAGS="" runs them in full;
# a -k expression that matches nothing runs the benchmarks alone.
# WHEELS names folders of carried wheels installed first (default: .whl .whlnv: PyAV, pebble and pytest-xdist, which the
# video tests and the package need there and the machine lacks, e.g. `pip download --no-deps
# --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 -d .whl av==18.1.0
# pebble==5.2.3 pytest-xdist==3.8.0 execnet==2.1.2`, and in .whlnv pynvvideocodec==2.2.4 for the NVDEC
# tests; flashinfer and its needs); e.g. WHEELS=".whl .whl523" with a transformers wheel
# in .whl523 runs the suite on that transformers. Logs are named by the transformers version, so several runs can share $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
wheels=$(for dir in ${WHEELS:-.whl .whlnv}; do ls "$dir"/*.whl 2>/dev/null; done)
if [ -n "$wheels" ]; then
  site=$(mktemp -d)
  # shellcheck disable=SC2086
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" $wheels \
    && export PYTHONPATH=$site:${PYTHONPATH:-} TVM_FFI_DISABLE_TORCH_C_DLPACK=1
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
  || { cat "$OUT/install.log"; exit 1; }
version=$(python3 -c "import transformers; print(transformers.__version__)")
python3 - <<'PY'
import torch, transformers
print(f"device {torch.cuda.get_device_name()} | torch {torch.__version__} | transformers {transformers.__version__}")
PY
log="$OUT/gpu_tests-transformers-$version.log"
# With pytest-xdist carried (in .whl), the tests run in TEST_WORKERS processes sharing the GPU
# (small models, mostly bound by the host). The fidelity tests (two copies of a real-size model
# each, 35 GB) run one after another in one of them. Measured on an H100, 2026-11-28: six workers
# ran the suite in 7 minutes but ran 11 tests out of memory; four with the fidelity tests in one
# worker did not end within 555 s (that worker's 6 tests take most of it). So run it in two calls:
# `bash benchmarks/run_gpu.sh "not fidelity_targets"`, then `BENCHMARKS="" bash benchmarks/run_gpu.sh
# "fidelity_targets"`.
# TEST_DIST=load lets the fidelity tests run side by side where the card holds several (an H200's
# 139 GB holds three): `TEST_WORKERS=3 TEST_DIST=load`.
# TEST_LIMIT_S stops the tests with a Ctrl-C in time for pytest to print what failed.
workers=()
python3 -c "import xdist" 2>/dev/null && workers=(-n "${TEST_WORKERS:-4}" --dist "${TEST_DIST:-loadgroup}")
# Workers sharing one GPU can fail a test for memory another worker holds (12 on one H200 failed 5 of
# 283 so, 2026-11-29): where tests failed, the failed ones run again in RETRY_WORKERS (default 2;
# "" for none), and that run's outcome is the call's (both logs kept), so one call tells a real
# failure from a crowded card.
run_tests() {
  timeout -s INT "${TEST_LIMIT_S:-3600}" python3 -m pytest -q -m "gpu or torchvision" -s -rfEs --durations=15 \
    "${workers[@]}" ${1:+-k "$1"} tests/ 2>&1 | tee "$log"
  local rc=${PIPESTATUS[0]}
  if [ "$rc" = 1 ] && [ -n "${RETRY_WORKERS-2}" ]; then
    local again=()
    [ ${#workers[@]} -gt 0 ] && again=(-n "${RETRY_WORKERS:-2}")
    echo "== the failed tests again, in ${RETRY_WORKERS:-2} workers (a crowded card, or real?)"
    timeout -s INT "${RETRY_LIMIT_S:-300}" python3 -m pytest -q -m "gpu or torchvision" -s -rfEs --lf \
      "${again[@]}" ${1:+-k "$1"} tests/ 2>&1 | tee "$log.retry"
    rc=${PIPESTATUS[0]}
  fi
  return "$rc"
}
run_benchmarks() {
  for bench in ${BENCHMARKS-bench_encoder.py bench_encoder_pages.py bench_decode.py bench_caption.py bench_fidelity.py bench_kernels.py}; do
    python3 "benchmarks/$bench" ${BENCH_FLAGS---quick} --json "$OUT/${bench%.py}.json" >"$OUT/${bench%.py}.log" 2>&1
  done
}
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -ge 2 ]; then
  # Two GPUs or more: the benchmarks run on the last GPU while the tests run on the others (each
  # xdist worker takes one in turn: tests/conftest.py), so one call takes the longer of the two
  # (their logs say which GPU ran what).
  test_gpus=$(seq -s, 0 $((gpus - 2)))
  echo "tests on GPUs $test_gpus, benchmarks on GPU $((gpus - 1)) at the same time"
  (export CUDA_VISIBLE_DEVICES=$((gpus - 1)); run_benchmarks) &
  CUDA_VISIBLE_DEVICES=$test_gpus run_tests "${1:-}"
  tests_rc=$?
  wait
else
  run_tests "${1:-}"
  tests_rc=$?
  run_benchmarks
fi
echo
echo "== summary (transformers $version) =="
grep -E "passed|failed|error" "$log" | tail -1
[ -f "$log.retry" ] && { printf "the failed ones again: "; grep -E "passed|failed|error" "$log.retry" | tail -1; }
for bench in ${BENCHMARKS-bench_encoder.py bench_encoder_pages.py bench_decode.py bench_caption.py bench_fidelity.py bench_kernels.py}; do
  echo "-- $bench"; grep -E "^\||vision tower|get_image_features|ours alone|graphs:|decode step|setup|fidelity,|missed:" "$OUT/${bench%.py}.log" \
    || tail -5 "$OUT/${bench%.py}.log"
done
exit "$tests_rc"
