#!/usr/bin/env bash
# Builds, tests and benchmarks torchreplay on a GPU machine in one call: torch, cmake and nvcc
# there, but no Bazel and no internet. Needs third_party/debs and third_party/wheels from
# tools/fetch_gpu_deps.sh (carried along). Runs on a CPU machine too (the CUDA tests then skip).
#
#   tools/gpu_check.sh [--quick] [--cuda-only]   # logs and results under $OUT (or ./gpu_check_out)
#
# Steps: unpack Abseil/GoogleTest/Benchmark; CMake build of the _C module (CUDA backend on when
# torch has CUDA) plus the GoogleTest suites and chain_bench; ctest; pytest (the CUDA suite apart);
# the harness on --device cuda with both CUDA graph backends (PyTorch's cudagraph trees, the
# default, and torchreplay's own) and the graph-replay peers. Last, one table: every part's
# result, the CUDA tests per backend (and each failure by name), the harness's rows. --quick: the
# harness's short timing. --cuda-only: of the suite outside test_cuda.py, only the tests named
# for CUDA (CI runs the rest). Each part has a time limit (GPU_CHECK_LIMIT_S seconds, default 180;
# the build twice that), so that a lease ends with the table even when a part hangs.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu_check_out}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
log() { echo "[gpu_check] $*" >&2; }
quick=(); rest=()
for a in "$@"; do
  case $a in
    --quick) quick=(--quick) ;;
    --cuda-only) rest=(-k cuda) ;;
    *) log "unknown option $a (--quick, --cuda-only)"; exit 2 ;;
  esac
done
limit=${GPU_CHECK_LIMIT_S:-180}

deps=/tmp/torchreplay_deps
mkdir -p "$deps"
for f in third_party/debs/*.deb; do dpkg -x "$f" "$deps"; done
libdir=$(dirname "$(find "$deps" -name 'libabsl_base.so*' | head -1)")
cmakedir=$(dirname "$libdir")/cmake
[ -d "$cmakedir" ] || cmakedir="$libdir/cmake"
export LD_LIBRARY_PATH="$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
if ! "$PY" -c "import pytest, tqdm, expecttest" 2>/dev/null; then
  "$PY" -m pip install -q --no-index --find-links third_party/wheels pytest tqdm expecttest >&2 || true
fi
# A test that crashes the process must not hide the others' results: with pytest-xdist, each
# crashed worker is reported as that test's failure and replaced.
workers=(); "$PY" -c "import xdist" 2>/dev/null && workers=(-n 2)

cuda=AUTO
"$PY" -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)" && cuda=ON
log "device: $("$PY" -c "import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device')"), torch $("$PY" -c "import torch; print(torch.__version__)")"
t0=$(date +%s)
generator=(); command -v ninja >/dev/null && generator=(-G Ninja)
cmake -S . -B build-gpu "${generator[@]}" -DPython_EXECUTABLE="$("$PY" -c "import sys; print(sys.executable)")" \
  -DCMAKE_PREFIX_PATH="$deps/usr" -Dabsl_DIR="$cmakedir/absl" -DGTest_DIR="$cmakedir/GTest" \
  -Dbenchmark_DIR="$cmakedir/benchmark" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTORCHREPLAY_BUILD_TESTS=ON -DTORCHREPLAY_CUDA=$cuda \
  -DTORCHREPLAY_OUTPUT_DIR="$ROOT/python/torchreplay" >"$OUT/cmake.log" 2>&1 \
  && timeout $((2 * limit)) cmake --build build-gpu -j "$(nproc)" >>"$OUT/cmake.log" 2>&1
build_rc=$?
build_s=$(( $(date +%s) - t0 ))
if [ $build_rc -ne 0 ]; then
  tail -40 "$OUT/cmake.log"
  log "build failed (log: $OUT/cmake.log)"
  exit 1
fi
export PYTHONPATH="$ROOT/python:$ROOT/bench${PYTHONPATH:+:$PYTHONPATH}"  # the package and the harness
"$PY" -c "import torchreplay; print('[gpu_check] module', torchreplay._C.__file__, 'CUDA backend', torchreplay._C.built_with_cuda(), 'usable', torchreplay.cuda_available())" >&2

(cd build-gpu && timeout "$limit" ctest --output-on-failure) >"$OUT/ctest.log" 2>&1
ctest_rc=$?
ctest_line=$(grep -E "tests passed|tests failed" "$OUT/ctest.log" | tail -1)

# The CUDA suite once, by backend (test_cuda.py: the trees tests name cudagraph_trees), the rest apart.
timeout "$limit" "$PY" -m pytest -q -rs "${workers[@]}" tests/python --deselect tests/python/test_cuda.py "${rest[@]}" -p no:cacheprovider \
  --junitxml="$OUT/pytest.xml" >"$OUT/pytest.log" 2>&1
pytest_rc=$?
timeout "$limit" "$PY" -m pytest -q -rA "${workers[@]}" -p no:cacheprovider tests/python/test_cuda.py --junitxml="$OUT/pytest-cuda.xml" \
  >"$OUT/pytest-cuda.log" 2>&1
cuda_rc=$?
# Each test that crashed its process, again alone under cuda-gdb (it debugs host code too) for
# the native backtrace (the build has debug info): crash-NAME.log, its top frames in the table.
crashed=$(grep -oh "crashed while running '[^']*'" "$OUT/pytest.log" "$OUT/pytest-cuda.log" | cut -d"'" -f2 | sort -u)
if command -v cuda-gdb >/dev/null; then
  for t in $crashed; do
    timeout 120 cuda-gdb -batch -ex run -ex bt --args "$PY" -m pytest -q -p no:cacheprovider "$t" \
      >"$OUT/crash-${t##*::}.log" 2>&1
  done
fi

timeout "$limit" ./build-gpu/chain_bench --benchmark_min_time=0.3 >"$OUT/chain_bench.log" 2>&1

device=cpu; [ "$cuda" = ON ] && device=cuda
modes=eager,torchreplay-reduce-overhead,torchreplay-capture,inductor,cudagraphs
[ "$device" = cuda ] && modes=$modes,torchreplay-own-cuda-graphs,torchreplay-capture-own-cuda-graphs,inductor-reduce-overhead,cuda-graph-by-hand
timeout "$limit" "$PY" -m torchreplay_bench --device $device "${quick[@]}" --models mlp,demo,attention_decode,chain64 \
  --modes "$modes" --out "$OUT/bench" >"$OUT/bench.log" 2>"$OUT/bench.err"
bench_rc=$?

# One table: every part's result, the CUDA tests by backend, then the harness's rows.
"$PY" - "$OUT" "$build_s" "$cuda" "$ctest_line" <<'PY'
import json, os, re, sys
import xml.etree.ElementTree as ET
import torch
out, build_s, cuda, ctest = sys.argv[1:5]
rows = [("build", f"cmake, CUDA {cuda}", f"ok in {build_s} s"), ("C++ suites", "ctest", ctest or "see ctest.log")]
def junit(path):
    if not os.path.exists(path):
        return []
    cases = []
    for c in ET.parse(path).getroot().iter("testcase"):
        state = "failed" if c.find("failure") is not None or c.find("error") is not None else \
            "skipped" if c.find("skipped") is not None else "passed"
        cases.append((c.get("name"), state))
    return cases
def count(cases):
    n = {k: sum(1 for _, s in cases if s == k) for k in ("passed", "failed", "skipped")}
    return f"{n['passed']} passed, {n['failed']} failed, {n['skipped']} skipped"
rows.append(("pytest", "everything but test_cuda.py", count(junit(os.path.join(out, "pytest.xml")))))
cuda_cases = junit(os.path.join(out, "pytest-cuda.xml"))
trees = [c for c in cuda_cases if "cudagraph_trees" in c[0]]
own = [c for c in cuda_cases if "cudagraph_trees" not in c[0]]
rows.append(("CUDA tests", "PyTorch's cudagraph trees (default)", count(trees)))
rows.append(("CUDA tests", "torchreplay's own CUDA graphs", count(own)))
for name, state in cuda_cases:
    if state == "failed":
        rows.append(("  failed", name, "see pytest-cuda.log"))
for log in sorted(f for f in os.listdir(out) if f.startswith("crash-")):
    text = open(os.path.join(out, log), errors="replace").read()
    signal = text.find("received signal")
    frames = [l for l in text[signal:].splitlines() if re.match(r"#\d+ ", l)][:8] if signal >= 0 else []
    rows.append(("  crashed", log[6:-4], "native frames:" if frames else "no signal under cuda-gdb (see " + log + ")"))
    rows.extend(("", "", f[:150]) for f in frames)
try:
    results = json.load(open(os.path.join(out, "bench", "results.json")))["results"]
except (OSError, ValueError):
    results = []
    rows.append(("harness", "no results", "see bench.err"))
for r in results:
    if "median_us" in r:
        what = f"{r['median_us']:.1f} us/call, {r.get('speedup', 0):.2f}x eager" + \
            (f", host {r['host_us']:.1f} us" if r.get("host_us") else "") + f", {r.get('check') or ('bitwise' if r.get('bitwise') else 'close')}"
    else:
        what = "WRONG: " + str(r.get("error", "output differs from eager"))[:80]
    rows.append((f"harness {r['model']}", r["mode"], what))
dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
print(f"\n================ torchreplay gpu_check: {dev}, torch {torch.__version__} ================")
for part, what, result in rows:
    print(f"{part:<26}{what:<40}{result}")
PY
grep -E "^BM_" "$OUT/chain_bench.log" | awk '{printf "chain_bench %-26s %10s %s\n", $1, $2, $3}'
[ $bench_rc -eq 0 ] || { echo "bench failed:"; tail -5 "$OUT/bench.err"; }
[ $ctest_rc -eq 0 ] && [ $pytest_rc -eq 0 ] && [ $cuda_rc -eq 0 ] && [ $bench_rc -eq 0 ]
