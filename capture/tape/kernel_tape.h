// capture/tape/kernel_tape.h: the CPU backend, a tape of kernel calls.
//
// A capture plans the graph once (tape_plan.h), plans the arena from the plan's buffer requests,
// then emits one Step per node that runs per call: a prebuilt argument stack with constants
// filled in, the few per-call values patched in by slot, and the kernel to redispatch to
// (called unboxed where it can be: typed_call.h, prepared_pointwise.h). Replay walks the steps:
// no Python, no schema lookups, no allocation for out= steps.
#pragma once

#include <ATen/core/ivalue.h>

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "capture/ir/captured_graph.h"
#include "capture/ir/graph.h"
#include "capture/ir/recording.h"
#include "memory_pool/arena.h"

namespace torchreplay::capture::tape {

// Captures the tape of `graph` for the guard key of `inputs`, the inputs of the recorded warm-up
// run (static ones are baked in). Its out= buffers are views of `arena`, grown if this key needs
// more. FailedPrecondition, with the reason, for graphs that cannot be replayed.
absl::StatusOr<std::unique_ptr<CapturedGraph>> CaptureKernelTape(
    std::shared_ptr<const Graph> graph, const Recording& recording,
    const std::vector<c10::IValue>& inputs, memory_pool::Arena* arena,
    const CaptureOptions& options);

// The tape's check of the nodes it has faster kernels for, made by the recording run
// (RunAndRecord's `check`): measures a convolution (Note [Checked convolutions]) and returns true,
// or a matrix product (Note [Checked GEMMs]) and returns whether a kernel was taken; false for any
// other node (which then gets Note [Checked out= kernels]'s check). Every recording the tape may capture from is made with it.
bool CheckTapeNode(const Graph& g, int node, const std::vector<c10::IValue>& env, Recording* rec);

}  // namespace torchreplay::capture::tape
