// capture/cuda_stream_graph.h: the CUDA StreamGraph backend.
//
// A captured CUDA graph of one guard key. Non-static inputs are copied into static placeholders
// (one batched copy per call, skipped for an input that already is its placeholder), static
// inputs are baked in (the engine checks their addresses), mutated non-static inputs are copied
// back after replay, and outputs are the graph's own tensors in the engine's private pool.
// Compiled without CUDA, CaptureCudaGraph returns FailedPrecondition and nothing else changes.
#pragma once

#include <ATen/core/ivalue.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "capture/interpreter.h"
#include "capture/stream_graph.h"

namespace torchreplay::capture {

// One engine's private memory pool on one device, shared by all its keys (the caching
// allocator's MempoolId). Zero until the first capture asks for one.
struct CudaPool {
  uint64_t id_first = 0, id_second = 0;
};

struct CudaCaptureOptions {
  bool keep_graph = false;  // keep the cudaGraph_t so DumpDot can print it
};

// Captures `interp`'s graph for the guard key of `inputs` (the current call's inputs), recorded
// in `recording` by a warm-up run. Capture runs on a side stream into `pool`; the graph is
// replayed on the caller's current stream. Uncapturable graphs (data-dependent shapes, host
// reads, CPU tensors) are refused before capture; an op that fails during capture ends the
// capture, gives the pool back its share and returns the op's error. Nothing leaks either way.
absl::StatusOr<std::unique_ptr<StreamGraph>> CaptureCudaGraph(const Interpreter& interp,
                                                              const Recording& recording,
                                                              const std::vector<c10::IValue>& inputs,
                                                              CudaPool* pool,
                                                              const CudaCaptureOptions& options);

// Bytes the caching allocator holds on `device` (0 without CUDA).
int64_t CudaReservedBytes(c10::Device device);

}  // namespace torchreplay::capture
