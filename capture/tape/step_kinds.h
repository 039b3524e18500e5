// capture/tape/step_kinds.h: the kinds of step a node of the CPU kernel tape can become, as a table of
// families.
//
// Note [Step kinds]
// An out= node (and an in-place index_copy_) becomes one kind of step, and the choice is the
// plan's: PlanTape asks each family's Match in table order and records the first kind that
// matches in NodePlan::kind; the emitter calls that family's Make and decides nothing itself.
// Matches look at what the plan knows (the node, its out= overload, whether any list argument has
// a per-call element); a Make builds the step from the node's prebuilt stack and may still find
// the arguments other than its Match assumed (a layout a copy cannot move, a weight that is not
// constant): it returns nullptr and the node becomes a typed out= step, as if no family had
// matched. The per-key dump (TapePlan::ToString) prints each node's planned kind and, where the
// emitter made something else, what it became. A new kind of step is a row of kOutFamilies
// (step_kinds.cc) with its Match and Make in the family's own file.
//
// Ownership: a family's Make returns the step it made (the caller owns it); the EmitContext and
// OutCall it is given are the emitter's, valid during the call only.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "capture/ir/capture_info.h"
#include "capture/ir/graph.h"
#include "capture/ir/recording.h"
#include "capture/tape/typed_call.h"

namespace torchreplay::capture::tape {

enum class StepKind : uint8_t {
  kNone,         // no family: a step of its Decision (scalar, getitem, functional, collective, ...)
  kCopies,       // cat, clone, copy, embedding, index_copy_ as copies (Note [Copies])
  kAttention,    // flash attention on prepared buffers (prepared_pointwise.h)
  kLayerNorm,    // layer norm on prepared buffers (prepared_pointwise.h)
  kConvolution,  // a checked convolution kernel (Note [Checked convolutions])
  kGemm,         // a checked matrix product kernel (Note [Checked GEMMs])
  kLstm,         // a checked LSTM kernel (Note [Checked LSTMs])
  kMaxPool,      // max pooling of planes, eager's bits (Note [Max pooling])
  kTypedOut,     // the out= overload, unboxed; on a prepared iterator where it has one
};
const char* StepKindName(StepKind kind);

// What the emitter knows of values, for a family's Make.
class EmitContext {
 public:
  virtual const Recording& recording() const = 0;
  // A tensor value as a step argument: its constant, or its per-call slot.
  virtual TensorArg TensorArgOf(ValueId v) const = 0;
  // The planned arena buffer of an out= result.
  virtual const at::Tensor& BufferOf(ValueId v) const = 0;
  // Whether a node or the graph's outputs read value `v` (a result nothing reads need not be
  // written).
  virtual bool Read(ValueId v) const = 0;

 protected:
  ~EmitContext() = default;
};

// A per-call element of a list argument: element `elem` of argument `arg` is slot `slot`.
struct ElemSlot {
  int arg, elem, slot;
};

// One out= node's step as the emitter prebuilt it.
struct OutCall {
  const Node& node;
  const c10::OperatorHandle& op;    // the out= overload
  const Slots& args;                // the arguments (constants in place), the extra argument, the results' buffers
  const std::vector<int>& slot_of;  // per argument: its per-call slot, or -1
  bool whole_args;                  // no list argument has a per-call element (else slot_of is not set for it)
  const std::vector<ElemSlot>& elem_slots;  // the per-call elements of list arguments
};

struct Made {
  std::unique_ptr<TypedCall> call;  // nullptr: the arguments are not what Match assumed
  std::string what;                 // for profiles: what the step is
  bool prepared = false;            // on an iterator built once (CaptureInfo::prepared_steps)
};

struct StepFamily {
  StepKind kind;
  // Called by the plan: whether this family makes out= node `n`, whose out= overload is `out_op`
  // (`whole_args`: no list argument has a per-call element).
  bool (*match)(const Node& n, const std::string& out_op, bool whole_args);
  // Called by the emitter.
  Made (*make)(const EmitContext& ctx, const OutCall& call, const CaptureOptions& options);
};

// The first family whose Match takes out= node `n`: kTypedOut when no other does.
StepKind MatchOutFamily(const Node& n, const std::string& out_op, bool whole_args);
// The step of `kind` for `call`; a typed out= step where that family's Make declines; a
// `call` of Made nullptr only where no typed call exists (the tape then calls the op boxed).
Made MakeOutStep(StepKind kind, const EmitContext& ctx, const OutCall& call, const CaptureOptions& options);

// The copies family (copy_steps.cc), also for an in-place index_copy_ node (its Match and Make).
bool MatchCopies(const Node& n, const std::string& out_op, bool whole_args);
Made MakeCopies(const EmitContext& ctx, const OutCall& call, const CaptureOptions& options);
bool MatchIndexCopy(const Node& n);
std::unique_ptr<TypedCall> MakeIndexCopy(const EmitContext& ctx, const Node& n);

// The max pooling family (pool_steps.cc).
bool MatchMaxPool(const Node& n, const std::string& out_op, bool whole_args);
Made MakeMaxPool(const EmitContext& ctx, const OutCall& call, const CaptureOptions& options);

}  // namespace torchreplay::capture::tape
