#!/usr/bin/env bash
# The main job: the Google Benchmark program (the 64-op chain in C++: interpreter, replay, ATen
# allocating, ATen out= calls into preallocated outputs; the MLP: replay, its kernels by hand), then eager vs torchreplay ("default",
# "reduce-overhead") vs the torch.compile peers on the built-in models (the tiny Llama decode step
# included) through the Python harness, with Dynamo's floor and the bare engine as reference rows;
# it prints a table and a per-model summary and writes JSON, CSV and a PNG plot to bench_out/ (or
# --out DIR). Last, batch-size buckets in a decode-style loop (python -m torchreplay_bench.buckets:
# capture_sizes against one capture per size, eager and Inductor; then a Python int changing
# every call, eager against torchreplay). Then tensor parallelism (python -m torchreplay_bench.tp: the
# tiny Llama step sharded over 2 ranks with DTensor, gloo on 127.0.0.1: eager, torch.compile and
# capture against the step's communication floor, and compute overlapping an all_reduce). Last,
# training steps (python -m torchreplay_bench.train: the MLP and the tiny Llama, with and without
# a compiled Adam, against eager, Inductor and aot_eager, the breakdown of torchreplay's step, and
# six optimizers' updates alone against eager's foreach and fused=True updates and Inductor's).
# Then serving from C++ (python -m torchreplay_bench.deploy: models saved by torchreplay.save and
# loaded by torchreplay::Load against AOTInductor's package and C++ loader, bench/deploy_bench.cc).
# Last, the CPU runtimes a user weighs (python -m torchreplay_bench.runtimes: eager, torchreplay
# through both entry points, AOTInductor, ONNX Runtime, OpenVINO and ExecuTorch per model, at 1
# and 2 threads; the peers are installed from tools/bench-requirements.txt when missing). Last,
# quantized models (python -m torchreplay_bench.quantized: torchao's int8 and int4 against fp32,
# Inductor with freezing and ONNX Runtime's int8).
# Arguments go to `python -m torchreplay_bench` (try --help).
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh
# The benchmark's peers, pinned, with --no-deps: each runtime dependency is pinned in the file, and
# nothing may replace torch (executorch's metadata asks for packages that would).
stamp=.venv/.torchreplay-bench-requirements
if [ ! -f "$stamp" ] || ! cmp -s tools/bench-requirements.txt "$stamp"; then
  echo "[bench] installing the CPU runtimes compared with (tools/bench-requirements.txt)" >&2
  .venv/bin/pip install -q --disable-pip-version-check --no-deps -r tools/bench-requirements.txt
  .venv/bin/python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.11.0')" \
    || { echo "[bench] torch is no longer 2.11.0 after installing tools/bench-requirements.txt" >&2; exit 1; }
  cp tools/bench-requirements.txt "$stamp"
fi
min_time=1
buckets=()
tp=()
train=()
deploy=()
runtimes=()
quantized=()
prev= help=
for a in "$@"; do
  case "$a" in -h|--help) help=1 ;; esac
  [ "$a" = "--quick" ] && min_time=0.2 && buckets+=(--rounds 5 --no-inductor) && tp+=(--rounds 2 --calls 20) && train+=(--rounds 3 --seconds 2) && deploy+=(--min-time 0.3) && runtimes+=(--quick) && quantized+=(--threads 1 --rounds 3 --seconds 0.1)
  [ "$prev" = "--out" ] && buckets+=(--out "$a") && tp+=(--out "$a") && deploy+=(--out "$a") && runtimes+=(--out "$a") && quantized+=(--out "$a")
  prev=$a
done
bazel build --noshow_progress --ui_event_filters=-info,-stdout //bench:chain_bench //bench:deploy_bench 2>&1 \
  | grep -vE "^(Loading|Analyzing|INFO|Target|  bazel-bin)" >&2 || true
echo "== Google Benchmark: bench/chain_bench.cc (64 elementwise ops on 16 floats, one thread)"
bazel-bin/bench/chain_bench --benchmark_min_time="$min_time" 2>/dev/null
echo
echo "== Python harness: python -m torchreplay_bench $*"
.venv/bin/python -m torchreplay_bench "$@"
[ -z "$help" ] || exit 0
echo
echo "== Batch-size buckets: python -m torchreplay_bench.buckets ${buckets[*]}"
.venv/bin/python -m torchreplay_bench.buckets "${buckets[@]}"
echo
echo "== Tensor parallelism: python -m torchreplay_bench.tp ${tp[*]}"
.venv/bin/python -m torchreplay_bench.tp "${tp[@]}"
echo
echo "== Training steps: python -m torchreplay_bench.train ${train[*]}"
.venv/bin/python -m torchreplay_bench.train "${train[@]}"
echo
echo "== Serving from C++: python -m torchreplay_bench.deploy ${deploy[*]}"
.venv/bin/python -m torchreplay_bench.deploy "${deploy[@]}"
echo
echo "== CPU runtimes: python -m torchreplay_bench.runtimes ${runtimes[*]}"
.venv/bin/python -m torchreplay_bench.runtimes "${runtimes[@]}"
echo
echo "== Quantized models: python -m torchreplay_bench.quantized ${quantized[*]}"
.venv/bin/python -m torchreplay_bench.quantized "${quantized[@]}"
