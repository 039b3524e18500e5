// capture/ir/captured_graph.h: a graph captured under one guard key, replayed without dispatching
// op by op; the interface both backends implement.
//
// Two backends, one shape: each is a factory taking (graph, recording of the last warm-up run,
// that run's inputs, the pool it allocates from, CaptureOptions) and returning a CapturedGraph.
//   - CPU: the kernel tape (kernel_tape.h), allocating from a memory_pool::Arena;
//   - CUDA: a CUDA graph (cuda_graph.h), allocating from a memory_pool::CudaPool.
// A CapturedGraph is replayed only with inputs of the key it was captured for.
#pragma once

#include <ATen/core/ivalue.h>

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "capture/ir/capture_info.h"

namespace torchreplay::capture {

class CapturedGraph {
 public:
  virtual ~CapturedGraph() = default;
  // Replays on `inputs` (same guard key as captured) and writes the graph's outputs.
  virtual absl::Status Replay(const std::vector<c10::IValue>& inputs,
                              std::vector<c10::IValue>* outputs) = 0;
  virtual const CaptureInfo& info() const = 0;
  // Replays `iterations` times, timing each step (the clock's own cost, ~20 ns a step, included);
  // per step, in order. Unimplemented where steps cannot be timed on the host (CUDA).
  virtual absl::StatusOr<std::vector<StepTime>> ProfileReplay(const std::vector<c10::IValue>& inputs,
                                                              int iterations) {
    return absl::UnimplementedError("per-step profiles are for the CPU kernel tape");
  }
  // True for outputs whose memory is the engine's pool (reused by the next replay). Their
  // storage is their pool buffer alone (Note [One storage per buffer] in memory_pool/arena.h;
  // a CUDA pool block on CUDA), shared with any other output that is a view of the same buffer.
  virtual bool OutputInPool(size_t i) const = 0;
  // Writes what was captured to `path_stem` + an extension, and returns the file's path: the
  // tape's plan as text (.txt) on the CPU, the CUDA graph as Graphviz DOT (.dot, keep_graph).
  virtual absl::StatusOr<std::string> Dump(const std::string& path_stem) const = 0;
};

}  // namespace torchreplay::capture
