// capture/tape/kernel_tape_internal.h: what the tape's two halves share, and nothing else includes:
// the Step a node becomes and the KernelTape that holds them. capture/tape/emitter.cc (capture) fills a
// KernelTape from a TapePlan; capture/tape/kernel_tape.cc (replay) runs its steps. The members are
// public to those two files alone: the emitter writes the steps, holders and counters directly.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>
#include <ATen/core/stack.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "absl/status/statusor.h"
#include "capture/ir/captured_graph.h"
#include "capture/ir/graph.h"
#include "capture/tape/collective_steps.h"
#include "capture/tape/typed_call.h"

namespace torchreplay::capture::tape::internal {

struct Patch {
  int arg = 0;    // position in the stack
  int elem = -1;  // element of a list argument, or -1 for the whole argument
  int slot = 0;   // per-call value
};

struct Step {
  enum class Kind : uint8_t { kCall, kGetItem, kSymArith };
  Kind kind = Kind::kCall;
  std::optional<c10::OperatorHandle> op;  // kCall
  std::vector<c10::IValue> args;          // prebuilt stack (kSymArith: the operands)
  absl::InlinedVector<Patch, 4> patches;
  absl::InlinedVector<int, 2> out_slots;  // per return: slot to store it in, or -1
  int64_t index = 0;                      // kGetItem
  SymOp sym_op = SymOp::kAdd;             // kSymArith
  std::vector<at::Tensor> holders;        // kSymArith: wrapped numbers of its result (ScalarWrite)
  std::unique_ptr<TypedCall> typed;       // set for typed out= steps (Note [Typed steps])
  std::string name;                       // the node, for errors
  std::string op_name;                    // for profiles: the kernel it calls (StepTime::op)
  std::string kind_name;                  // for profiles: what the step is (StepTime::kind)
  std::string shapes;                     // for profiles: its results' dtypes and sizes
  std::string note;                       // for profiles: why its node runs this kernel (StepTime::note)
};

class KernelTape final : public CapturedGraph {
 public:
  absl::Status Replay(const std::vector<c10::IValue>& inputs,
                      std::vector<c10::IValue>* outputs) override;
  absl::StatusOr<std::vector<StepTime>> ProfileReplay(const std::vector<c10::IValue>& inputs,
                                                      int iterations) override;
  const CaptureInfo& info() const override { return info_; }
  bool OutputInPool(size_t i) const override { return output_in_pool_[i]; }
  absl::StatusOr<std::string> Dump(const std::string& path_stem) const override;
  // Drops this call's tensors from the slots and the stack, and from the list arguments of
  // `failed`, a step that raised before it could drop them itself.
  void DropCallValues(Step* failed = nullptr);
  // The replay itself; `after_step(i)` runs after step i (a no-op but for profiles).
  template <class AfterStep>
  absl::Status Run(const std::vector<c10::IValue>& inputs, std::vector<c10::IValue>* outputs,
                   AfterStep after_step);

  CaptureInfo info_;
  std::string listing_;  // the plan, printed
  std::vector<Step> steps_;
  std::vector<std::pair<int, int>> input_slots_;  // (input position, slot)
  // Scalar inputs bound per call that go where a Tensor goes: the wrapped-number tensor the steps
  // hold, written with the input's value before the steps run (Note [Scalars bound per call]).
  // Results of kSymArith steps are written by the step (Step::holders).
  struct ScalarWrite {
    int slot = 0;
    at::Tensor holder;  // 0-dim, CPU; double, float, int64 or bool
  };
  std::vector<ScalarWrite> scalar_writes_;
  struct Output {
    c10::IValue constant;  // when slot < 0
    int slot = -1;
    int input = -1;   // the graph input it views, if any (Note [Outputs that view an input])
    int itself = -1;  // the graph input it is (through in-place results), if any: the call's own
  };
  // Gives each output that views an input that input's version counter.
  void ShareVersionCounters(const std::vector<c10::IValue>& inputs, std::vector<c10::IValue>* outputs) const;
  std::vector<Output> outputs_;
  bool views_inputs_ = false;  // some output views an input (Output::input)
  std::vector<bool> output_in_pool_;
  std::vector<c10::IValue> slots_;
  // Per collective step: its work while in flight (Note [Collective steps]); a failed call waits
  // for them before it returns.
  std::vector<std::shared_ptr<PendingWork>> pending_;
  torch::jit::Stack stack_;
  c10::DispatchKeySet keys_{c10::DispatchKey::CPU};
};

// The number `v` (int, float or bool), converted to T the way a cast of its wrapped-number
// tensor converts it.

}  // namespace torchreplay::capture::tape::internal
