// replay/trace_checks.h: what a captured trace assumed of its call's arguments, checked before
// anything runs, for torchreplay.capture's Call (bindings/call.h) and for a program loaded from a
// file (torchreplay/torchreplay.h) alike. Errors are InvalidArgument with the message a user
// sees (Python raises them as ValueError).
#pragma once

#include <ATen/core/ivalue.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "capture/ir/graph.h"

namespace torchreplay::replay {

// A size of a tensor argument the trace assumed: dim `dim` of argument `arg` lies in [lo, hi];
// within a group (>= 0) it is coef * s + offset for the group's symbol s: dims with coef 1 and
// offset 0 set s (and must agree), the others must equal what s gives (2 * s0, s0 + 1).
struct SizeCheck {
  int arg = 0, dim = 0;
  int64_t lo = 0, hi = 0;
  int group = -1;
  int64_t coef = 1, offset = 0;
};

// `inputs` is a call's graph inputs: `bound` bound tensors first, then the arguments (the indices
// below count arguments, after the bound tensors).

// Numbers the trace specialized on: (argument, value), compared bit for bit for floats.
absl::Status CheckFixed(const std::vector<std::pair<int, c10::IValue>>& fixed, size_t bound,
                        const std::vector<c10::IValue>& inputs);
// The sizes the trace assumed; an argument whose rank differs from the graph's is left to the
// engine's own input check.
absl::Status CheckSizes(const std::vector<SizeCheck>& sizes, const capture::Graph& graph, size_t bound,
                        const std::vector<c10::IValue>& inputs);
// An argument the graph writes must not share memory with another argument.
absl::Status CheckOverlap(const std::vector<int>& written, size_t bound, const std::vector<c10::IValue>& inputs);

// A number as Python prints it (2, 2.0, -0.0, True); other values by kind.
std::string Describe(const c10::IValue& v);

}  // namespace torchreplay::replay
