#!/usr/bin/env bash
# Builds torchreplay the way GPU users install it (pip + setup.py driving CMake, no Bazel) and
# runs the replay semantics suite, the fused elementwise suite (its kernel is compiled with flags
# of its own) and the CUDA suite (which skips without a GPU) against that
# build. Used by tools/test.sh so the CMake path cannot rot. Writes bazel-out-reports/pytest-cmake.xml.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "[cmake] pip wheel --no-build-isolation . (CMake build of torchreplay._C)" >&2
.venv/bin/pip wheel --no-build-isolation --no-deps --disable-pip-version-check -q . -w "$work/wheel" >&2
mkdir -p "$work/site" bazel-out-reports
(cd "$work/site" && python3 -m zipfile -e "$work"/wheel/torchreplay-*.whl .)
PYTHONPATH="$work/site" .venv/bin/python - <<PY
import torchreplay, torchreplay._C as C
assert torchreplay.__file__.startswith("$work/site"), torchreplay.__file__
print("[cmake] using", C.__file__, "(CUDA backend compiled in: %s)" % C.built_with_cuda())
PY
PYTHONPATH="$work/site" .venv/bin/python -m pytest -q -p no:cacheprovider tests/python/test_replay.py tests/python/test_fusion.py \
  tests/python/test_cuda.py --junitxml=bazel-out-reports/pytest-cmake.xml "$@"
