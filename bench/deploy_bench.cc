// Serving from C++ with no Python: a model saved by torchreplay.save and loaded with
// torchreplay::Load, against the same model compiled by AOTInductor and loaded with its C++ loader
// (torch::inductor::AOTIModelPackageLoader), on the same inputs, one thread: the time to load,
// and the time per call. The files come from `python -m torchreplay_bench.deploy`, which runs
// this program and prints the table:
//
//   deploy_bench --dir=DIR [google benchmark flags]   # DIR/NAME.trp and DIR/NAME.pt2 per model
//
// Models (NAME): mlp (the harness's 3-layer MLP, batch 1: one (1, 64) float argument) and
// llama_decode (the harness's tiny Llama decode step: ids (1, 1) and pos (1,), int64; each call
// writes the next position of the KV cache, cycling over 64).
#include <ATen/Parallel.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/tensor.h>
#include <benchmark/benchmark.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "torchreplay/torchreplay.h"

namespace {

std::string g_dir = "bench_out/deploy";

// The arguments of call i.
std::vector<at::Tensor> Args(const std::string& model, int64_t i) {
  if (model == "mlp") return {at::randn({1, 64})};
  return {at::tensor({i % 256}).view({1, 1}), at::tensor({i % 64})};
}

std::string Path(const std::string& model, const char* ext) { return g_dir + "/" + model + ext; }

void Load(benchmark::State& state, const std::string& model, bool ours) {
  for (auto _ : state) {
    if (ours) {
      torchreplay::Program p = torchreplay::Load(Path(model, ".trp"));
      benchmark::DoNotOptimize(p);
    } else {
      torch::inductor::AOTIModelPackageLoader loader(Path(model, ".pt2"), "model", /*run_single_threaded=*/true);
      benchmark::DoNotOptimize(loader);
    }
  }
}

void Call(benchmark::State& state, const std::string& model, bool ours) {
  std::vector<std::vector<at::Tensor>> args;
  for (int64_t i = 0; i < 64; ++i) args.push_back(Args(model, i));
  int64_t i = 0;
  if (ours) {
    torchreplay::Program p = torchreplay::Load(Path(model, ".trp"));
    auto call = [&](const std::vector<at::Tensor>& a) {
      std::vector<c10::IValue> in(a.begin(), a.end());
      return p.Run(std::move(in));
    };
    for (int k = 0; k < 3; ++k) call(args[k]);  // warm-up, capture, a replay
    for (auto _ : state) benchmark::DoNotOptimize(call(args[i++ % 64]));
    state.counters["replays"] = static_cast<double>(p.Stats().replays);
  } else {
    torch::inductor::AOTIModelPackageLoader loader(Path(model, ".pt2"), "model", /*run_single_threaded=*/true);
    for (int k = 0; k < 3; ++k) loader.run(args[k]);
    for (auto _ : state) benchmark::DoNotOptimize(loader.run(args[i++ % 64]));
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<char*> rest;
  for (int i = 0; i < argc; ++i) {
    if (std::strncmp(argv[i], "--dir=", 6) == 0) {
      g_dir = argv[i] + 6;
    } else {
      rest.push_back(argv[i]);
    }
  }
  int n = static_cast<int>(rest.size());
  benchmark::Initialize(&n, rest.data());
  at::set_num_threads(1);
  for (const std::string model : {"mlp", "llama_decode"}) {
    if (!std::ifstream(Path(model, ".trp")) || !std::ifstream(Path(model, ".pt2"))) continue;
    for (const bool ours : {true, false}) {
      const std::string who = ours ? "torchreplay" : "aotinductor";
      benchmark::RegisterBenchmark(("BM_Load/" + who + "/" + model).c_str(),
                                   [=](benchmark::State& s) { Load(s, model, ours); })
          ->Unit(benchmark::kMillisecond);
      benchmark::RegisterBenchmark(("BM_Call/" + who + "/" + model).c_str(),
                                   [=](benchmark::State& s) { Call(s, model, ours); })
          ->Unit(benchmark::kMicrosecond);
    }
  }
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
