// capture/cuda_graph.h: the CUDA backend, a captured CUDA graph.
//
// A captured CUDA graph of one guard key. Non-static inputs are copied into static placeholders
// (one batched copy per call, skipped for an input that already is its placeholder), static
// inputs are baked in (the engine checks their addresses), mutated non-static inputs are copied
// back after replay, and outputs are the graph's own tensors in the engine's private pool.
// Compiled without CUDA, CaptureCudaGraph returns FailedPrecondition and nothing else changes.
// Untested on a GPU so far: this backend has only been compiled, never run.
#pragma once

#include <ATen/core/ivalue.h>

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "capture/captured_graph.h"
#include "capture/graph.h"
#include "capture/recording.h"
#include "memory_pool/cuda_pool.h"

namespace torchreplay::capture {

// Captures `graph` for the guard key of `inputs` (the current call's inputs), recorded in
// `recording` by a warm-up run. Capture runs on a side stream into `pool`; the graph is replayed
// on the caller's current stream. Uncapturable graphs (data-dependent shapes, host reads, CPU
// tensors) are refused before capture; an op that fails during capture ends the capture, gives
// the pool back its share and returns the op's error. Nothing leaks either way.
absl::StatusOr<std::unique_ptr<CapturedGraph>> CaptureCudaGraph(
    std::shared_ptr<const Graph> graph, const Recording& recording,
    const std::vector<c10::IValue>& inputs, memory_pool::CudaPool* pool,
    const CaptureOptions& options);

}  // namespace torchreplay::capture
