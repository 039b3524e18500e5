// Host overhead of a 64-node chain of elementwise ops on 16-element tensors (sin, *1.01, +0.1,
// relu, repeated): the interpreter (mode "default"), the engine's replay, the same ATen calls
// allocating their results (C++ eager), and the dispatcher-path baseline: the same kernels called
// through ATen's out= API into preallocated outputs (no floor: replay skips the dispatcher and
// TensorIterator's set-up that these calls pay). Then the harness's MLP (64 -> 256 -> 256 -> 64,
// batch 1), whose time is in its kernels: the engine's replay and the same addmm/relu kernels
// called by hand into preallocated outputs, a floor for this model (any replay runs them too).
// Last, the per-call read of the settings a capture was made under (Note [Ambient state]).
// Run: bazel run //bench:chain_bench
#include <ATen/ops/add.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/relu.h>
#include <ATen/ops/clamp_min.h>
#include <ATen/ops/sin.h>
#include <benchmark/benchmark.h>

#include "capture/ir/graph.h"
#include "guards/guard_key.h"
#include "capture/ir/interpreter.h"
#include "replay/engine.h"

namespace {

using torchreplay::capture::Arg;
using torchreplay::capture::GraphBuilder;

constexpr int kNodes = 64;

std::shared_ptr<const torchreplay::capture::Graph> Chain() {
  GraphBuilder b;
  auto v = b.AddInput("x", torchreplay::capture::ValueType::kTensor);
  for (int i = 0; i < kNodes / 4; ++i) {
    v = (*b.AddOp("aten::sin", {Arg::Ref(v)}))[0];
    v = (*b.AddOp("aten::mul.Tensor", {Arg::Ref(v), Arg::Const(1.01)}))[0];
    v = (*b.AddOp("aten::add.Tensor", {Arg::Ref(v), Arg::Const(0.1)}))[0];
    v = (*b.AddOp("aten::relu", {Arg::Ref(v)}))[0];
  }
  (void)b.SetOutputs({Arg::Ref(v)});
  return *b.Build();
}

void BM_Interpreter(benchmark::State& state) {
  torchreplay::capture::Interpreter interp(Chain());
  at::Tensor x = at::randn({16});
  for (auto _ : state) benchmark::DoNotOptimize(interp.Run({x}));
  state.SetItemsProcessed(state.iterations() * kNodes);
}

void BM_Replay(benchmark::State& state) {
  torchreplay::replay::Engine engine(Chain(), {});
  at::Tensor x = at::randn({16});
  for (int i = 0; i < 3; ++i) (void)engine.Run({x});
  for (auto _ : state) benchmark::DoNotOptimize(engine.Run({x}));
  state.SetItemsProcessed(state.iterations() * kNodes);
}

void BM_AtenAllocating(benchmark::State& state) {
  at::Tensor x = at::randn({16});
  for (auto _ : state) {
    at::Tensor v = x;
    for (int i = 0; i < kNodes / 4; ++i) v = at::relu(at::add(at::mul(at::sin(v), 1.01), 0.1));
    benchmark::DoNotOptimize(v);
  }
  state.SetItemsProcessed(state.iterations() * kNodes);
}

void BM_AtenOutPreallocated(benchmark::State& state) {
  at::Tensor x = at::randn({16});
  std::vector<at::Tensor> bufs;
  for (int i = 0; i < kNodes; ++i) bufs.push_back(at::empty({16}));
  const at::Scalar a(1.01), c(0.1), zero(0.0);
  const at::Tensor wa = at::scalar_tensor(a), wc = at::scalar_tensor(c);
  for (auto _ : state) {
    const at::Tensor* v = &x;
    for (int i = 0; i < kNodes; i += 4) {
      at::sin_out(bufs[i], *v);
      at::mul_out(bufs[i + 1], bufs[i], wa);
      at::add_out(bufs[i + 2], bufs[i + 1], wc);
      at::clamp_min_out(bufs[i + 3], bufs[i + 2], zero);
      v = &bufs[i + 3];
    }
    benchmark::DoNotOptimize(bufs.back().data_ptr());
  }
  state.SetItemsProcessed(state.iterations() * kNodes);
}

// The MLP of torchreplay_bench.models as the lowered graph the engine gets: weights and biases
// are inputs (static ones: same address every call), then x.
std::shared_ptr<const torchreplay::capture::Graph> Mlp() {
  GraphBuilder b;
  std::vector<torchreplay::capture::ValueId> params;
  for (const char* name : {"w0", "b0", "w1", "b1", "w2", "b2"})
    params.push_back(b.AddInput(name, torchreplay::capture::ValueType::kTensor));
  auto v = b.AddInput("x", torchreplay::capture::ValueType::kTensor);
  for (int i = 0; i < 3; ++i) {
    auto wt = (*b.AddOp("aten::t", {Arg::Ref(params[2 * i])}))[0];
    v = (*b.AddOp("aten::addmm", {Arg::Ref(params[2 * i + 1]), Arg::Ref(v), Arg::Ref(wt)}))[0];
    if (i < 2) v = (*b.AddOp("aten::relu", {Arg::Ref(v)}))[0];
  }
  (void)b.SetOutputs({Arg::Ref(v)});
  return *b.Build();
}

std::vector<at::Tensor> MlpInputs() {
  std::vector<at::Tensor> in;
  const int64_t dims[] = {64, 256, 256, 64};
  for (int i = 0; i < 3; ++i) {
    in.push_back(at::randn({dims[i + 1], dims[i]}));
    in.push_back(at::randn({dims[i + 1]}));
  }
  in.push_back(at::randn({1, 64}));
  return in;
}

void BM_MlpReplay(benchmark::State& state) {
  torchreplay::replay::Engine engine(Mlp(), {});
  const std::vector<at::Tensor> in = MlpInputs();
  for (int i = 0; i < 3; ++i) (void)engine.Run({in.begin(), in.end()});
  for (auto _ : state) benchmark::DoNotOptimize(engine.Run({in.begin(), in.end()}));
}

void BM_MlpHandWrittenOutFloor(benchmark::State& state) {
  const std::vector<at::Tensor> in = MlpInputs();
  std::vector<at::Tensor> wt, out;
  for (int i = 0; i < 3; ++i) {
    wt.push_back(in[2 * i].t());
    out.push_back(at::empty({1, in[2 * i].size(0)}));
  }
  const at::Scalar zero(0.0);
  for (auto _ : state) {
    const at::Tensor* v = &in.back();
    for (int i = 0; i < 3; ++i) {
      at::addmm_out(out[i], in[2 * i + 1], *v, wt[i]);
      if (i < 2) at::clamp_min_out(out[i], out[i], zero);
      v = &out[i];
    }
    benchmark::DoNotOptimize(out.back().data_ptr());
  }
}

// What every call pays for Note [Ambient state]: reading the settings eager's kernels depend on,
// compared with the key's in the replays above.
// Args: a key with CUDA inputs; a graph with an op that may read the fp32 precisions.
void BM_AmbientNow(benchmark::State& state) {
  const bool cuda = state.range(0) != 0, precision = state.range(1) != 0;
  for (auto _ : state) benchmark::DoNotOptimize(torchreplay::guards::Ambient::Now(cuda, precision));
}

BENCHMARK(BM_Interpreter);
BENCHMARK(BM_Replay);
BENCHMARK(BM_AtenAllocating);
BENCHMARK(BM_AtenOutPreallocated);
BENCHMARK(BM_MlpReplay);
BENCHMARK(BM_MlpHandWrittenOutFloor);
BENCHMARK(BM_AmbientNow)->Args({0, 0})->Args({0, 1})->Args({1, 1});

}  // namespace
