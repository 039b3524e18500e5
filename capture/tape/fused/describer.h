// capture/tape/fused/describer.h: which nodes the fused kernel computes as eager does, and the
// instruction that computes each (Note [Fused elementwise steps] in fused_elementwise.h).
#pragma once

#include <optional>
#include <vector>

#include "capture/ir/graph.h"
#include "capture/ir/recording.h"
#include "capture/tape/fused/fused_kernels.h"
#include "capture/tape/tape_plan.h"

namespace torchreplay::capture::tape::fused {

// The instruction computing node `node` of `g` (an out= node, or an in-place one computed as its
// out= overload: Note [In-place instructions] in describer.cc), with the graph values of its
// operands in `values` (-1 for constants); nullopt if the fused kernel does not compute it as
// eager does: every condition under which an op's kernel gives eager's bits (the op, its
// arguments, dtypes, layouts, the vector path). `rec` and `plan` are the recording and plan of
// `g`; nothing is kept.
std::optional<Instr> Describe(const Graph& g, const Recording& rec, const TapePlan& plan, int node,
                              std::vector<ValueId>* values);

}  // namespace torchreplay::capture::tape::fused
