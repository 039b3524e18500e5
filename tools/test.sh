#!/usr/bin/env bash
# Runs every test: the C++ suites (bazel test //...), the Python suites (pytest) on the Bazel
# build (the differential slice again at 1 and 3 threads), and the CMake/pip build with its own
# pytest run (tools/cmake_check.sh); then prints one summary line "N passed, M failed, K skipped".
# Extra arguments go to the pytest runs.
# First, unless TORCHREPLAY_SANITIZERS=0: the C++ suites under ASan+LSan and UBSan in one build
# (--config=sanitize), and a Python slice against that build of the extension
# (tools/asan_python.sh); 16 to 27 min from scratch on 2 cores, as measured.
set -uo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh || exit 1
mkdir -p bazel-out-reports
rm -f bazel-out-reports/pytest*.xml
sanitizers_rc=0
if [ "${TORCHREPLAY_SANITIZERS:-1}" != 0 ]; then
  bazel test --config=sanitize --noshow_progress //... 2>&1 | grep -vE "^(Loading|Analyzing|INFO: (Analyzed|Found|From))"
  [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "tools/test.sh: the C++ suites fail under ASan+UBSan"; sanitizers_rc=1; }
  tools/asan_python.sh || sanitizers_rc=1
fi
bazel test --noshow_progress //... 2>&1 | grep -vE "^(Loading|Analyzing|INFO: (Analyzed|Found|From))"
bazel_rc=${PIPESTATUS[0]}
.venv/bin/python -m pytest -q tests/python --junitxml=bazel-out-reports/pytest.xml "$@"
pytest_rc=$?
# The differential slice (every step kind, long rows, the fuzzer) again at two thread counts
# besides the machine's default: eager's kernels split, block and choose by the thread count (Note
# [Ambient state]). About 6 minutes each on 2 cores. The op database slice is not in it: its
# sample inputs are far below ATen's grain size (32768 elements), so they take one thread's path
# at any count; the long rows and one-output reductions of test_conditions.py and the fuzzer's
# are the cases that split.
threads_slice=(tests/python/test_conditions.py tests/python/test_fuzz.py tests/python/test_replay.py
               tests/python/test_fusion.py tests/python/test_differential.py tests/python/test_conv_kernels.py
               tests/python/test_gemm_kernels.py tests/python/test_lstm_kernel.py
               tests/python/test_mutation_and_aliasing.py tests/python/test_numerics.py
               tests/python/test_reduced_precision.py)
for n in 1 3; do
  echo "tools/test.sh: the differential slice at $n thread(s)"
  TORCHREPLAY_TEST_THREADS=$n .venv/bin/python -m pytest -q "${threads_slice[@]}" \
    --junitxml=bazel-out-reports/pytest-threads$n.xml "$@" || pytest_rc=1
done
tools/cmake_check.sh
cmake_rc=$?
.venv/bin/python tools/summarize_tests.py bazel-testlogs bazel-out-reports/pytest.xml \
  bazel-out-reports/pytest-threads1.xml bazel-out-reports/pytest-threads3.xml bazel-out-reports/pytest-cmake.xml
summary_rc=$?
[ $bazel_rc -eq 0 ] && [ $pytest_rc -eq 0 ] && [ $cmake_rc -eq 0 ] && [ $summary_rc -eq 0 ] && \
  [ $sanitizers_rc -eq 0 ]
