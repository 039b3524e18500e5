#!/usr/bin/env bash
# Installs what torchreplay needs on a Debian 12 machine and builds it; idempotent, and quiet when
# everything is already in place. Run from anywhere; used by tools/test.sh and tools/bench.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
log() { echo "[setup] $*" >&2; }

APT_PACKAGES=(bazel-bootstrap bazel-platforms bazel-rules-java g++ cmake ninja-build libabsl-dev libgtest-dev libgmock-dev
              libbenchmark-dev python3-venv)
missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  log "installing Debian packages: ${missing[*]}"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  log "creating .venv"
  "$PY" -m venv .venv
fi
stamp=.venv/.torchreplay-requirements
if [ ! -f "$stamp" ] || ! cmp -s tools/requirements.txt "$stamp"; then
  log "installing Python packages (torch is large: the first time takes a few minutes)"
  .venv/bin/pip install -q --disable-pip-version-check -r tools/requirements.txt
  cp tools/requirements.txt "$stamp"
fi

# The extension module, built by Bazel and placed next to the package.
bazel build --noshow_progress --ui_event_filters=-info,-stdout //bindings:_C.so 2>&1 \
  | grep -vE "^(Loading|Analyzing|INFO|Target|  bazel-bin)" >&2 || true
[ -f bazel-bin/bindings/_C.so ] || { log "build failed"; exit 1; }
suffix=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
if ! cmp -s bazel-bin/bindings/_C.so "python/torchreplay/_C$suffix"; then
  install -m 755 bazel-bin/bindings/_C.so "python/torchreplay/_C$suffix"
fi
site=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
printf "%s\n" "$ROOT/python" "$ROOT/bench" > "$site/torchreplay.pth"  # the package, and the benchmark harness beside it
