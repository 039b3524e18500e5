#!/usr/bin/env bash
# Builds, tests and benchmarks torchreplay on a GPU machine in one call: torch, cmake and nvcc
# there, but no Bazel and no internet. Needs third_party/debs and third_party/wheels from
# tools/fetch_gpu_deps.sh (carried along). Runs on a CPU machine too (the CUDA tests then skip).
#
#   tools/gpu_check.sh [--quick]        # logs and results under $OUT (or ./gpu_check_out)
#
# Steps: unpack Abseil/GoogleTest/Benchmark; CMake build of the _C module (CUDA backend on when
# torch has CUDA) plus the GoogleTest suites and chain_bench; ctest; pytest (the CUDA suite
# included); the harness on --device cuda with the graph-replay peers; a short table last.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu_check_out}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
log() { echo "[gpu_check] $*" >&2; }

deps=/tmp/torchreplay_deps
mkdir -p "$deps"
for f in third_party/debs/*.deb; do dpkg -x "$f" "$deps"; done
libdir=$(dirname "$(find "$deps" -name 'libabsl_base.so*' | head -1)")
cmakedir=$(dirname "$libdir")/cmake
[ -d "$cmakedir" ] || cmakedir="$libdir/cmake"
export LD_LIBRARY_PATH="$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
if ! "$PY" -c "import pytest, tqdm" 2>/dev/null; then
  "$PY" -m pip install -q --no-index --find-links third_party/wheels pytest tqdm >&2 || true
fi

cuda=AUTO
"$PY" -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)" && cuda=ON
log "device: $("$PY" -c "import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device')"), torch $("$PY" -c "import torch; print(torch.__version__)")"
t0=$(date +%s)
generator=(); command -v ninja >/dev/null && generator=(-G Ninja)
cmake -S . -B build-gpu "${generator[@]}" -DPython_EXECUTABLE="$("$PY" -c "import sys; print(sys.executable)")" \
  -DCMAKE_PREFIX_PATH="$deps/usr" -Dabsl_DIR="$cmakedir/absl" -DGTest_DIR="$cmakedir/GTest" \
  -Dbenchmark_DIR="$cmakedir/benchmark" -DTORCHREPLAY_BUILD_TESTS=ON -DTORCHREPLAY_CUDA=$cuda \
  -DTORCHREPLAY_OUTPUT_DIR="$ROOT/bindings/torchreplay" >"$OUT/cmake.log" 2>&1 \
  && cmake --build build-gpu -j "$(nproc)" >>"$OUT/cmake.log" 2>&1
build_rc=$?
build_s=$(( $(date +%s) - t0 ))
if [ $build_rc -ne 0 ]; then
  tail -40 "$OUT/cmake.log"
  log "build failed (log: $OUT/cmake.log)"
  exit 1
fi
export PYTHONPATH="$ROOT/bindings${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import torchreplay; print('[gpu_check] module', torchreplay._C.__file__, 'CUDA backend', torchreplay._C.built_with_cuda(), 'usable', torchreplay.cuda_available())" >&2

(cd build-gpu && ctest --output-on-failure) >"$OUT/ctest.log" 2>&1
ctest_rc=$?
ctest_line=$(grep -E "tests passed|tests failed" "$OUT/ctest.log" | tail -1)

"$PY" -m pytest -q -rs tests/python -p no:cacheprovider --junitxml="$OUT/pytest.xml" >"$OUT/pytest.log" 2>&1
pytest_rc=$?
pytest_line=$(tail -1 "$OUT/pytest.log")
cuda_line=$("$PY" -m pytest -q -p no:cacheprovider tests/python/test_cuda.py 2>&1 | tail -1)

./build-gpu/chain_bench --benchmark_min_time=0.3 >"$OUT/chain_bench.log" 2>&1

device=cpu; [ "$cuda" = ON ] && device=cuda
quick=(--quick); [ "${1:-}" = "--full" ] && quick=()
"$PY" -m torchreplay.bench --device $device "${quick[@]}" --models mlp,demo,attention_decode,chain64 \
  --out "$OUT/bench" >"$OUT/bench.log" 2>"$OUT/bench.err"
bench_rc=$?

echo
echo "================ torchreplay gpu_check ($(date -u +%Y-%m-%d), $(uname -m)) ================"
sed -n '/^torchreplay benchmark/,$p' "$OUT/bench.log"
[ $bench_rc -eq 0 ] || { echo "bench failed:"; tail -5 "$OUT/bench.err"; }
grep -E "^BM_" "$OUT/chain_bench.log" | awk '{printf "chain_bench %-26s %10s %s\n", $1, $2, $3}'
echo "build (cmake, CUDA $cuda): ${build_s}s; ctest: ${ctest_line:-see ctest.log}"
echo "pytest all: $pytest_line"
echo "pytest CUDA suite: $cuda_line"
[ $ctest_rc -eq 0 ] && [ $pytest_rc -eq 0 ] && [ $bench_rc -eq 0 ]
