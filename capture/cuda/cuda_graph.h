// capture/cuda/cuda_graph.h: the CUDA backend, a captured CUDA graph.
//
// A captured CUDA graph of one guard key. Non-static inputs are copied into static placeholders
// (one batched copy per call, skipped for an input that already is its placeholder), static
// inputs are baked in (the engine checks their addresses), mutated non-static inputs are copied
// back after replay, and outputs are the graph's own tensors in the engine's private pool.
// What a capture will do is decided on the host first (PlanCudaCapture, unit-tested without a
// GPU in cuda_plan_test.cc); the capture itself follows PyTorch's CUDAGraph usage (Notes in
// memory_pool/cuda_pool.h and cuda_graph.cc). Compiled without CUDA, CaptureCudaGraph returns
// FailedPrecondition and nothing else changes.
// Untested on a GPU so far: this backend has only been compiled, never run. It is used only where
// a caller opts in (EngineOptions::cuda_graphs; in Python config.reduce_overhead.cuda_graphs =
// "torchreplay"); by default torch.compile's CUDA graphs are PyTorch's cudagraph trees.
#pragma once

#include <ATen/core/ivalue.h>

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "capture/ir/captured_graph.h"
#include "capture/ir/graph.h"
#include "capture/ir/recording.h"
#include "memory_pool/cuda_pool.h"

namespace torchreplay::capture::cuda {

// What capturing `graph` for the key of `inputs` would do, from the recording of its last warm-up
// run; host-only. Errors (FailedPrecondition, naming the value or input): graphs no CUDA graph can
// replay (CheckReplayable), per-call scalars, CPU tensors inside the graph, tensors on two devices,
// no CUDA tensor at all, and two non-static inputs sharing memory (each would get its own
// placeholder, and a write through one would not reach the other).
struct CudaCapturePlan {
  c10::Device device{c10::DeviceType::CUDA, 0};
  std::vector<int> placeholders;    // inputs (by position) copied into a static placeholder per call
  std::vector<size_t> copied_back;  // placeholders (by index above) the graph writes: copied back
  struct Output {
    // kPool: a tensor in the pool (handed out as the engine's pool outputs are); kInputView: a
    // view of a non-static input, rebuilt on the caller's tensor each call; kConstant: the value
    // captured (a static input or a view of one, a number).
    enum Kind { kPool, kInputView, kConstant } kind = kConstant;
    int input = -1;  // kInputView
  };
  std::vector<Output> outputs;
};
absl::StatusOr<CudaCapturePlan> PlanCudaCapture(const Graph& graph, const Recording& recording,
                                                const std::vector<c10::IValue>& inputs);

// Captures `graph` for the guard key of `inputs` (the current call's inputs), recorded in
// `recording` by a warm-up run. Capture runs on this thread's capture stream into `pool`, one
// capture at a time in the process; the graph is replayed on the caller's current stream. Graphs
// PlanCudaCapture refuses are refused before capture; an op that fails during capture ends the
// capture, gives both allocators' pools back this capture's share, takes the RNG out of capture
// mode and returns the op's error. Nothing leaks either way.
absl::StatusOr<std::unique_ptr<CapturedGraph>> CaptureCudaGraph(
    std::shared_ptr<const Graph> graph, const Recording& recording,
    const std::vector<c10::IValue>& inputs, memory_pool::CudaPool* pool,
    const CaptureOptions& options);

}  // namespace torchreplay::capture::cuda
