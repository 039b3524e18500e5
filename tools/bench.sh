#!/usr/bin/env bash
# The main job: eager vs torchreplay ("default", "reduce-overhead") vs torch.compile peers on the
# built-in models; prints a table and writes JSON, CSV and a PNG plot to bench_out/. Arguments go
# to `python -m torchreplay.bench` (try --help).
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh
exec .venv/bin/python -m torchreplay.bench "$@"
