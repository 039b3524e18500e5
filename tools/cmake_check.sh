#!/usr/bin/env bash
# Builds torchreplay the way GPU users install it (pip + setup.py driving CMake, no Bazel) and
# runs the replay semantics suite, the fused elementwise suite (its kernel is compiled with flags
# of its own), the CUDA suite (which skips without a GPU) and the saved-program suite against that
# build; the last runs examples/replay_saved built from the installed CMake package. Used by tools/test.sh so the CMake path cannot rot. Writes bazel-out-reports/pytest-cmake.xml.
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
# The C++ API as a LibTorch project consumes it: libtorchreplay.so installed with its CMake package,
# and examples/ built against it by find_package(torchreplay); test_saved.py runs that example.
generator=(); command -v ninja >/dev/null && generator=(-G Ninja)
echo "[cmake] the CMake package (find_package(torchreplay)) and examples/replay_saved built against it" >&2
cmake -S . -B "$work/package" "${generator[@]}" -DPython_EXECUTABLE="$PWD/.venv/bin/python" -DTORCHREPLAY_CUDA=OFF >/dev/null
cmake --build "$work/package" --target torchreplay -j "$(nproc)" >/dev/null
cmake --install "$work/package" --prefix "$work/prefix" >/dev/null
cmake -S examples -B "$work/example" "${generator[@]}" -DCMAKE_PREFIX_PATH="$work/prefix" >/dev/null
cmake --build "$work/example" >/dev/null
TORCHREPLAY_EXAMPLE_BIN="$work/example/replay_saved" PYTHONPATH="$work/site" .venv/bin/python -m pytest -q \
  -p no:cacheprovider tests/python/test_replay.py tests/python/test_fusion.py tests/python/test_cuda.py \
  tests/python/test_saved.py --junitxml=bazel-out-reports/pytest-cmake.xml "$@"
