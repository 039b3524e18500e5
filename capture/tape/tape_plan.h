// capture/tape/tape_plan.h: everything the CPU kernel tape decides about a graph under one guard key,
// decided once, before anything is built.
//
// Note [What is decided at capture]
// Under one guard key every size, stride and symbolic scalar is fixed, so the plan classifies
// each value of the graph as either
//   - constant: non-tensor values, static inputs (parameters: their address is checked by the
//     engine), planned arena buffers, and views of those (precomputed once); or
//   - per call, in a slot: non-static inputs (rebound, never copied), scalar inputs that are
//     data (Note [Scalars bound per call] in graph.h), and results of ops that must run
//     functionally (no out= variant, or an argument that changes per call);
// and each node by its Decision below. The arena requests (one buffer per out= result, with its
// lifetime in node indices) come with it, and each out= node's step family (Note [Step kinds]).
// The emitter (emitter.cc) then plans the arena and turns the plan into steps; it decides
// nothing the plan has not.
//
// Note [Why in-place ops keep their meaning]
// Non-static inputs are bound by reference, so an in-place op on an input (copy_ into a KV cache,
// a running-stats update) writes into the caller's tensor exactly as eager does; its result is the
// same value as its argument, constant or per call alike.
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "capture/ir/graph.h"
#include "capture/ir/out_variants.h"
#include "capture/ir/recording.h"
#include "memory_pool/arena.h"
#include "capture/tape/collective_steps.h"
#include "capture/tape/fused/fused_kernels.h"
#include "capture/tape/step_kinds.h"

namespace torchreplay::capture::tape {

struct TapePlan {
  enum class Decision : uint8_t {
    kScalar,      // symbolic arithmetic or a size query: its recorded value, fixed per key
    kScalarStep,  // symbolic arithmetic on scalars bound per call: a step computing it per call
    kPrecompute,  // a view of constant tensors, or made from fixed values only (arange, a cast
                  // of a constant): computed once, at capture
    kGetItem,     // an element of a list: taken once if the list is constant, else a step
    kOutVariant,  // a step writing into planned arena buffers through the op's out= overload
    kFunctional,  // a step running the op as it is (allocating its result, or in place)
    kCollective,  // a collective started into a planned buffer (Note [Collective steps])
    kWait,        // the wait of a kCollective: its result is the collective's buffer
  };
  struct NodePlan {
    Decision decision = Decision::kFunctional;
    std::optional<OutVariant> out;  // kOutVariant
    std::string why;                // kFunctional: why an out= overload was refused, if one was;
                                    // kOutVariant: what its check measured, if it says
    int group = -1;                 // kOutVariant, or kFunctional in place: its fused group, if in one
    StepKind kind = StepKind::kNone;  // kOutVariant (and kFunctional index_copy_): its step's family
                                      // (Note [Step kinds]); a group's members are its fused step
    int partner = -1;               // kCollective: its wait's node; kWait: its collective's
    std::optional<CollectiveKind> collective;  // kCollective
  };
  // A run of out= and in-place nodes computed by one fused elementwise step (Note [Fused
  // elementwise steps] in fused_elementwise.h): the step runs where the last of them is. An
  // instruction's operands are positions in its node's stack (arguments, then for out= nodes the
  // extra argument and the results).
  struct FusedGroup {
    std::vector<int> nodes;
    std::vector<fused::Instr> instrs;  // one per node
    std::vector<fused::Segment> segments;
    int64_t scratch_bytes = 0;  // what its in-place instructions save (Instr::snapshot)
  };
  struct ValuePlan {
    bool constant = false;  // else per call, in `slot`
    int slot = -1;
    bool in_arena = false;  // its memory is the arena (a planned buffer or a view of one)
    int buffer = -1;        // index into `requests`: the planned buffer this value is
    ValueId same_as = -1;   // an in-place result: the argument it is
  };

  std::vector<NodePlan> nodes;
  std::vector<ValuePlan> values;
  std::vector<std::pair<int, int>> input_slots;  // (input position, slot)
  int num_slots = 0;
  std::vector<memory_pool::BufferRequest> requests;  // ValuePlan::buffer indexes these
  std::vector<FusedGroup> groups;

  // One line per node: its decision, its step's family, for out= steps the buffers it writes (at
  // `arena`'s offsets, when given), and, when `made` is given (per node, what the emitter made
  // of it), the step it became.
  std::string ToString(const Graph& graph, const memory_pool::ArenaPlan* arena = nullptr,
                       const std::vector<std::string>* made = nullptr) const;
};

// Plans the tape of `graph` from the recording of its last warm-up run; with `fuse`, runs of
// elementwise nodes become fused groups. FailedPrecondition, with the reason, for graphs that
// cannot be replayed (CheckReplayable).
absl::StatusOr<TapePlan> PlanTape(const Graph& graph, const Recording& recording, bool fuse);

}  // namespace torchreplay::capture::tape
