#!/bin/bash
# A Python slice of the test suite against an AddressSanitizer (and UBSan) build of the extension.
#
#   tools/asan_python.sh [pytest args...]   (default: replay semantics, changing keys, capture
#                                            sizes, faults, the op database slice, and 300 fuzz
#                                            graphs)
#   tools/asan_python.sh --python SCRIPT [args...]   a Python program instead of pytest, e.g. the
#                                            whole op database sweep (tests/python/opdb_sweep.py)
#
# Builds //bindings:_C.so with --config=sanitize (ASan and UBSan, the build CI's C++ suites use),
# stages it beside a copy of the Python package, and runs pytest with gcc's ASan runtime preloaded
# (Python and torch are not instrumented; their allocations are intercepted all the same; libstdc++
# is preloaded too, so that ASan finds the real __cxa_throw). It checks memory errors (use after
# free, overflows, double frees) and undefined behaviour: any stops the run and fails the script; the summary says whether
# its stack reaches the extension. Leaks are left to the C++ suites under LeakSanitizer (bazel test
# --config=sanitize) and to the RSS-measuring tests: at exit Python keeps thousands of objects
# LeakSanitizer calls leaks (5,000 reports on test_replay.py alone, none through the extension), and
# torch, built without frame pointers, cuts the stacks that would tell ours apart.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || tools/setup.sh

bazel build --config=sanitize --noshow_progress --ui_event_filters=-info,-stdout //bindings:_C.so
bin=$(bazel info --config=sanitize bazel-bin 2>/dev/null)
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
cp -r python/torchreplay "$stage/"
rm -f "$stage"/torchreplay/_C*.so
suffix=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
install -m 755 "$bin/bindings/_C.so" "$stage/torchreplay/_C$suffix"

run=(-m pytest -q -p no:cacheprovider -k "not rss and not memory_flat and not hundred_thousand and not leak_nothing")
if [ "${1:-}" = --python ]; then
  shift
  run=()
elif [ $# -eq 0 ]; then
  set -- tests/python/test_replay.py tests/python/test_changing_keys.py \
         tests/python/test_capture_sizes.py tests/python/test_faults.py tests/python/test_opdb.py \
         tests/python/test_fuzz.py
fi
log="$stage/asan.log"
rc=0
# Tests that measure RSS are left out: ASan's quarantine and shadow memory make RSS meaningless.
ASAN_OPTIONS="detect_leaks=0:alloc_dealloc_mismatch=0:detect_odr_violation=0:log_path=$log" \
UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:log_path=$log" \
LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so.6)" \
TORCHREPLAY_FUZZ_GRAPHS="${TORCHREPLAY_FUZZ_GRAPHS:-300}" PYTHONPATH="$stage" \
  .venv/bin/python "${run[@]}" "$@" || rc=$?

# One log per process. A report is an ASan error or a UBSan runtime error; it is ours if a frame
# of its stack is in the extension (our functions, or pybind11 and absl code inlined in _C.so).
read -r reports ours < <(cat "$log".* 2>/dev/null | awk '
  /^==[0-9]+==ERROR: AddressSanitizer|runtime error:/ { flush(); inside = 1; block = "" }
  inside { block = block "\n" $0 }
  function flush() {
    if (inside) { total++; if (block ~ /torchreplay/) { mine++; print block > "/dev/stderr" } }
    inside = 0
  }
  END { flush(); print total + 0, mine + 0 }')
echo "asan_python: exit $rc; sanitizer reports: $reports, of them in torchreplay's code: $ours"
[ "$rc" -eq 0 ] && [ "$ours" -eq 0 ]
