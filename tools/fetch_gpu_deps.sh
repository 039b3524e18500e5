#!/usr/bin/env bash
# Downloads what tools/gpu_check.sh needs on a GPU machine that has torch, cmake and nvcc but no
# internet and no Bazel: Debian's Abseil, GoogleTest and Google Benchmark packages (unpacked there
# with dpkg -x) and pure-Python wheels for pytest, tqdm and expecttest (which torch's op database imports). Run here (with network), then carry
# third_party/debs and third_party/wheels with the working tree.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p third_party/debs third_party/wheels
(cd third_party/debs && apt-get download libabsl-dev libabsl20220623 libgtest-dev libgmock-dev \
   libbenchmark-dev libbenchmark1debian >/dev/null)
.venv/bin/pip download -q --disable-pip-version-check --only-binary=:all: --python-version 3.12 \
  --no-deps -d third_party/wheels pytest pluggy iniconfig packaging tqdm expecttest
ls third_party/debs third_party/wheels
