#!/usr/bin/env bash
# Runs every test: the C++ suites (bazel test //...) and the Python suites (pytest), then prints
# one summary line "N passed, M failed, K skipped". Extra arguments go to pytest.
set -uo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh || exit 1
mkdir -p bazel-out-reports
bazel test --noshow_progress //... 2>&1 | grep -vE "^(Loading|Analyzing|INFO: (Analyzed|Found|From))"
bazel_rc=${PIPESTATUS[0]}
.venv/bin/python -m pytest -q tests/python --junitxml=bazel-out-reports/pytest.xml "$@"
pytest_rc=$?
.venv/bin/python tools/summarize_tests.py bazel-testlogs bazel-out-reports/pytest.xml
summary_rc=$?
[ $bazel_rc -eq 0 ] && [ $pytest_rc -eq 0 ] && [ $summary_rc -eq 0 ]
