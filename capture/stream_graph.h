// capture/stream_graph.h: a captured graph that replays without re-dispatching op by op.
//
// Two backends implement StreamGraph: the CPU kernel tape (CaptureKernelTape below) and the CUDA
// stream graph (cuda_stream_graph.h). Both are built from a Recording of one eager (warm-up) run of the graph
// under the guard key they serve, and both are replayed only with inputs of that key.
#pragma once

#include <ATen/core/ivalue.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "capture/graph.h"
#include "capture/interpreter.h"
#include "memory_pool/arena.h"

namespace torchreplay::capture {

// What one eager run showed about each value: tensor metadata, and which value's storage it
// shares (its "root": itself for a fresh tensor, or the input/value it is a view or in-place
// result of). Non-tensor values (sizes, symbolic scalars) are kept: under one guard key they are
// constants.
struct ValueRecord {
  bool is_tensor = false;
  bool is_list = false;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  c10::Device device = c10::Device(c10::DeviceType::CPU);
  std::vector<int64_t> sizes, strides;
  int64_t storage_offset = 0;
  ValueId root = -1;
  c10::IValue scalar;  // non-tensor values
};

struct Recording {
  std::vector<ValueRecord> values;
  // Per graph input: its tensor is baked into the capture (a static input whose address the
  // engine checks) rather than rebound per call. Empty: the graph's static inputs.
  std::vector<bool> baked_inputs;
  bool baked(const Graph& g, int i) const {
    return baked_inputs.empty() ? g.is_static_input(i) : baked_inputs[i];
  }
};

// Runs `interp` eagerly on `inputs` and records every value. Returns the run's outputs.
absl::StatusOr<std::vector<c10::IValue>> RunAndRecord(const Interpreter& interp,
                                                      std::vector<c10::IValue> inputs,
                                                      Recording* recording);

struct CaptureInfo {
  int nodes = 0;
  int steps = 0;              // kernel calls per replay
  int out_variant_steps = 0;  // ... of which write into planned arena buffers
  int typed_steps = 0;        // ... of those, called unboxed (no IValue stack)
  int prepared_steps = 0;     // ... of those, on a TensorIterator built once (CPU pointwise)
  int functional_steps = 0;   // ... of which allocate their result (no out= variant, or dynamic)
  int precomputed = 0;        // nodes decided once at capture (views of static tensors, sizes)
  int64_t arena_bytes = 0;    // this key's plan
  int64_t tensor_bytes = 0;   // what one buffer per planned tensor would have cost
  std::vector<std::string> functional_ops;  // ops that ran functionally, for the report
};

class StreamGraph {
 public:
  virtual ~StreamGraph() = default;
  // Replays on `inputs` (same guard key as captured) and writes the graph's outputs.
  virtual absl::Status Replay(const std::vector<c10::IValue>& inputs,
                              std::vector<c10::IValue>* outputs) = 0;
  virtual const CaptureInfo& info() const = 0;
  // True for outputs whose memory is the engine's pool (reused by the next replay).
  virtual bool OutputInPool(size_t i) const = 0;
  // For a pool output: the bytes of its storage that are its own buffer, {byte offset, bytes}
  // (shared with any other output that is a view of the same buffer). nbytes < 0: the whole
  // storage. The engine hands each buffer out as a storage of its own, as eager would.
  struct Region {
    int64_t offset = 0, nbytes = -1;
  };
  virtual Region OutputRegion(size_t i) const { return {}; }
  // Writes the captured graph in Graphviz DOT form (CUDA graphs captured with keep_graph).
  virtual absl::Status DumpDot(const std::string& path) const {
    return absl::UnimplementedError("only CUDA graphs have a DOT dump");
  }
};

// Refuses graphs that no captured graph can replay: data-dependent output shapes (nonzero, ...)
// and scalars read from tensor data on the host (item, ...). FailedPrecondition naming the node.
absl::Status CheckReplayable(const Graph& graph, const Recording& recording);

// Per value: whether a mutable op (in-place, out=, copy_) writes into its storage, by root.
std::vector<bool> MutatedRoots(const Graph& graph, const Recording& recording);

// Captures the CPU kernel tape: every kernel resolved once (redispatched below autograd), `out=`
// variants writing into buffers planned in `arena`, views of static tensors precomputed,
// constants prebuilt. `inputs` are those of the recorded run (static ones are baked in).
// Returns FailedPrecondition, with the reason, for graphs that cannot be replayed (data-dependent
// shapes or scalars).
absl::StatusOr<std::unique_ptr<StreamGraph>> CaptureKernelTape(
    std::shared_ptr<const Graph> graph, const Recording& recording,
    const std::vector<c10::IValue>& inputs, memory_pool::Arena* arena);

}  // namespace torchreplay::capture
