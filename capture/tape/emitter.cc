// The CPU kernel tape's capture (see kernel_tape.h): the emitter that turns a TapePlan into a
// KernelTape's steps (capture/tape/kernel_tape_internal.h), with the arena planned.
// Over 500 lines: one Emitter walks the plan once, node by node, and each decision's step (out=,
// fused member, prepared, collective, functional, scalar) needs the same state (constants, slots,
// holders); the families themselves live in files of their own (Note [Step kinds]).
#include <ATen/EmptyTensor.h>
#include <ATen/core/List.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/TensorImpl.h>

#include <algorithm>
#include <optional>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "capture/ir/interpreter.h"
#include "capture/tape/collective_steps.h"
#include "capture/tape/checked/conv_steps.h"
#include "capture/tape/fused/fused_elementwise.h"
#include "capture/tape/kernel_tape.h"
#include "capture/tape/kernel_tape_internal.h"
#include "capture/tape/prepared_pointwise.h"
#include "capture/tape/step_kinds.h"
#include "capture/tape/tape_plan.h"
#include "capture/tape/typed_call.h"

namespace torchreplay::capture::tape {
namespace {

using internal::KernelTape;
using internal::Patch;
using internal::Step;

// A planned buffer: a tensor of the recorded geometry on a storage of its own over its bytes of
// the arena (Note [One storage per buffer]).
at::Tensor ArenaBuffer(memory_pool::Arena& arena, const ValueRecord& r, int64_t byte_offset) {
  const int64_t nbytes = static_cast<int64_t>(
      at::detail::computeStorageNbytes(r.sizes, r.strides, c10::elementSize(r.dtype)));
  auto impl = c10::make_intrusive<c10::TensorImpl>(
      arena.Buffer(byte_offset, nbytes), c10::DispatchKeySet(c10::DispatchKey::CPU),
      c10::scalarTypeToTypeMeta(r.dtype));
  impl->set_sizes_and_strides(r.sizes, r.strides, 0);
  return at::Tensor(std::move(impl));
}

// A Python number in a tensor position (`x * 1.01`) is a 0-dim double "wrapped number"; the
// TensorIterator casts it to the op's dtype on every call (a dispatch, an allocation, a copy).
// When every other tensor argument already has the float/double dtype of the result, that cast is
// fixed: do it once, at capture. The kernels read the same value either way (for
// reduced-precision dtypes some kernels read the uncast scalar, so those are left alone).
// Returns the positions of the wrapped numbers to cast.
std::vector<size_t> WrappedNumbersToPrecast(c10::ScalarType out_dtype, const Slots& args) {
  std::vector<size_t> wrapped;
  if (out_dtype != c10::kFloat && out_dtype != c10::kDouble) return wrapped;
  for (size_t i = 0; i < args.size(); ++i) {
    const c10::IValue& v = args[i];
    if (!v.isTensor() || !v.toTensor().defined()) continue;
    const at::Tensor& t = v.toTensor();
    if (t.unsafeGetTensorImpl()->is_wrapped_number()) {
      if (t.scalar_type() != out_dtype && !c10::isComplexType(t.scalar_type()) &&
          t.scalar_type() != c10::kBool) {
        wrapped.push_back(i);
      }
    } else if (t.scalar_type() != out_dtype) {
      return {};
    }
  }
  return wrapped;
}

// Turns the plan into the tape's steps, with the arena planned. Constants are known here for the
// first time: the baked inputs, the arena buffers, and what precomputed nodes give.
class Emitter final : public EmitContext {
 public:
  Emitter(const Graph& g, const Recording& rec, const TapePlan& plan,
          const std::vector<at::Tensor>& buffers, c10::Storage arena_storage, const CaptureOptions& options,
          KernelTape* tape)
      : g_(g), rec_(rec), plan_(plan), buffers_(buffers), arena_storage_(std::move(arena_storage)),
        options_(options), tape_(tape), constants_(g.values().size()) {}

  // The constant value of `v` (valid after Emit, for values the plan made constant).
  const c10::IValue& constant(ValueId v) const { return constants_[v]; }
  // Per node, what its step is (StepTime::kind; empty for a node with no step of its own).
  std::vector<std::string> made() && { return std::move(made_); }

  // EmitContext, for the step families (Note [Step kinds]).
  const Recording& recording() const override { return rec_; }
  TensorArg TensorArgOf(ValueId v) const override {
    TensorArg a;
    if (plan_.values[v].constant) {
      a.value = constants_[v].toTensor();
    } else {
      a.slot = plan_.values[v].slot;
    }
    return a;
  }
  const at::Tensor& BufferOf(ValueId v) const override { return buffers_[plan_.values[v].buffer]; }
  bool Read(ValueId v) const override { return g_.last_use()[v] >= 0; }

  absl::Status Emit(const std::vector<c10::IValue>& inputs) {
    for (size_t i = 0; i < g_.inputs().size(); ++i) {
      if (plan_.values[g_.inputs()[i]].constant) constants_[g_.inputs()[i]] = inputs[i];
    }
    for (int i = 0; i < static_cast<int>(g_.nodes().size()); ++i) {
      const Node& n = g_.nodes()[i];
      switch (plan_.nodes[i].decision) {
        case TapePlan::Decision::kScalar:
          for (ValueId o : n.outputs) constants_[o] = rec_.values[o].scalar;
          ++tape_->info_.precomputed;
          break;
        case TapePlan::Decision::kScalarStep:
          ScalarStep(n);
          break;
        case TapePlan::Decision::kPrecompute:
          if (auto s = Precompute(n); !s.ok()) return s;
          break;
        case TapePlan::Decision::kGetItem:
          GetItem(n);
          break;
        case TapePlan::Decision::kOutVariant:
          if (plan_.nodes[i].group >= 0) {
            FusedMember(i);
          } else {
            OutVariantStep(n, *plan_.nodes[i].out, OutStack(n, *plan_.nodes[i].out));
          }
          break;
        case TapePlan::Decision::kFunctional:
          if (plan_.nodes[i].group >= 0) {
            FusedMember(i);  // in place (Note [In-place instructions])
          } else {
            FunctionalStep(n);
          }
          break;
        case TapePlan::Decision::kCollective:
          if (auto s = CollectiveStep(i); !s.ok()) return s;
          break;
        case TapePlan::Decision::kWait:
          WaitStep(i);
          break;
      }
    }
    return absl::OkStatus();
  }

 private:
  // A step's prebuilt stack from the node's args; per-call values become patches.
  void BuildArgs(const Node& n, Step* step) {
    step->name = n.name;
    for (size_t a = 0; a < n.args.size(); ++a) {
      const Arg& arg = n.args[a];
      const c10::TypePtr& type = n.arg_types[a];
      if (arg.kind == Arg::Kind::kConstant) {
        step->args.push_back(arg.constant);
      } else if (arg.kind == Arg::Kind::kValue) {
        const TapePlan::ValuePlan& v = plan_.values[arg.value];
        if (v.constant) {
          const c10::IValue& c = constants_[arg.value];
          step->args.push_back(IsTensorType(type) ? WrapNumber(c) : c);
        } else if (IsTensorType(type) && !rec_.values[arg.value].is_tensor) {
          // A scalar bound per call where a Tensor goes: a wrapped number written per call.
          step->args.push_back(Holder(v.slot, WrapNumber(rec_.values[arg.value].scalar).toTensor()));
        } else {
          step->args.emplace_back();
          step->patches.push_back(Patch{static_cast<int>(a), -1, v.slot});
        }
      } else {
        Arg resolved = arg;
        for (size_t e = 0; e < arg.elems.size(); ++e) {
          const Arg& el = arg.elems[e];
          if (el.kind != Arg::Kind::kValue) continue;
          const TapePlan::ValuePlan& v = plan_.values[el.value];
          if (v.constant) {
            resolved.elems[e] = Arg::Const(constants_[el.value]);
          } else {
            resolved.elems[e] = Arg::Const(at::Tensor());
            step->patches.push_back(Patch{static_cast<int>(a), static_cast<int>(e), v.slot});
          }
        }
        step->args.push_back(MaterializeArg(resolved, type, {}));
      }
    }
  }

  // The wrapped-number tensor that holds slot's scalar per call with `like`'s dtype (and, until
  // the first replay writes it, value): one per slot and dtype, shared by the steps, written by
  // whatever gives the slot its value (the input binding, or a kSymArith step).
  at::Tensor Holder(int slot, const at::Tensor& like) {
    for (const auto& [s, h] : holders_) {
      if (s == slot && h.scalar_type() == like.scalar_type()) return h;
    }
    holders_.emplace_back(slot, like);
    auto step = sym_step_of_slot_.find(slot);
    if (step != sym_step_of_slot_.end()) {
      tape_->steps_[step->second].holders.push_back(like);
    } else {
      tape_->scalar_writes_.push_back({slot, like});
    }
    return like;
  }

  // A wrapped number cast to `dtype`; a holder's cast is the holder of that dtype.
  at::Tensor Cast(const at::Tensor& wrapped, c10::ScalarType dtype) {
    at::Tensor cast = wrapped.to(dtype);
    cast.unsafeGetTensorImpl()->set_wrapped_number(true);
    for (const auto& [slot, h] : holders_) {
      if (h.is_same(wrapped)) return Holder(slot, cast);
    }
    return cast;
  }

  void ScalarStep(const Node& n) {
    Step step;
    step.kind = Step::Kind::kSymArith;
    step.sym_op = n.sym_op;
    step.name = n.name;
    for (size_t a = 0; a < n.args.size(); ++a) {
      const Arg& arg = n.args[a];
      if (arg.kind == Arg::Kind::kValue && !plan_.values[arg.value].constant) {
        step.args.emplace_back();
        step.patches.push_back(Patch{static_cast<int>(a), -1, plan_.values[arg.value].slot});
      } else {
        step.args.push_back(arg.kind == Arg::Kind::kValue ? constants_[arg.value] : arg.constant);
      }
    }
    const int slot = plan_.values[n.outputs[0]].slot;
    step.out_slots.push_back(slot);
    sym_step_of_slot_[slot] = static_cast<int>(tape_->steps_.size());
    Push(std::move(step), n, "scalar");
  }

  absl::Status Precompute(const Node& n) {
    Step probe;
    BuildArgs(n, &probe);
    // A per-call tensor of a metadata-only op (Note [Metadata-only ops]): a stand-in with its
    // recorded sizes, strides and dtype (the tape is the CPU's).
    for (const Patch& p : probe.patches) {
      if (p.elem >= 0) return absl::InternalError(absl::StrCat("node '", n.name, "': a list folded"));
      const ValueRecord& r = rec_.values[n.args[p.arg].value];
      probe.args[p.arg] = at::Tensor(at::detail::empty_strided_cpu(r.sizes, r.strides, r.dtype));
    }
    try {
      n.op->callBoxed(&probe.args);
    } catch (const c10::Error& e) {
      return KernelError(e, absl::StrCat("node '", n.name, "' failed at capture: "));
    }
    for (size_t o = 0; o < n.outputs.size(); ++o) constants_[n.outputs[o]] = probe.args[o];
    ++tape_->info_.precomputed;
    return absl::OkStatus();
  }

  void GetItem(const Node& n) {
    const ValueId list = n.args[0].value;
    if (plan_.values[list].constant) {
      constants_[n.outputs[0]] = constants_[list].toList().get(n.index);
      ++tape_->info_.precomputed;
      return;
    }
    Step step;
    step.kind = Step::Kind::kGetItem;
    step.name = n.name;
    step.index = n.index;
    step.patches.push_back(Patch{0, -1, plan_.values[list].slot});
    step.out_slots.push_back(plan_.values[n.outputs[0]].slot);
    Push(std::move(step), n, "getitem");
  }

  // The stack of n's out= step: its arguments (wrapped numbers precast), the out= overload's
  // extra argument, then its results' planned buffers, which become their values' constants.
  Step OutStack(const Node& n, const OutVariant& out) {
    Step step;
    step.op = out.op;
    BuildArgs(n, &step);
    if (!out.extra_arg.isNone()) step.args.push_back(out.extra_arg);
    const c10::ScalarType dtype = rec_.values[n.outputs[0]].dtype;
    for (size_t a : WrappedNumbersToPrecast(dtype, step.args)) {
      step.args[a] = Cast(step.args[a].toTensor(), dtype);
    }
    for (ValueId o : n.outputs) {
      constants_[o] = buffers_[plan_.values[o].buffer];
      step.args.push_back(constants_[o]);
    }
    step.out_slots.assign(n.outputs.size(), -1);
    return step;
  }

  // The stack of an in-place node of a fused group: its arguments, wrapped numbers precast as
  // for out= steps; its result is its self.
  Step InPlaceStack(const Node& n) {
    Step step;
    step.op = *n.op;
    BuildArgs(n, &step);
    const c10::ScalarType dtype = rec_.values[n.outputs[0]].dtype;
    for (size_t a : WrappedNumbersToPrecast(dtype, step.args)) {
      step.args[a] = Cast(step.args[a].toTensor(), dtype);
    }
    const TapePlan::ValuePlan& v = plan_.values[n.outputs[0]];
    if (v.constant) constants_[n.outputs[0]] = constants_[v.same_as];
    step.out_slots.assign(1, -1);
    return step;
  }

  // A node of a fused group (Note [Fused elementwise steps]): its stack is kept until the
  // group's last node, where the group's one step is made.
  void FusedMember(int i) {
    const TapePlan::FusedGroup& group = plan_.groups[plan_.nodes[i].group];
    const TapePlan::NodePlan& np = plan_.nodes[i];
    group_stacks_.push_back(np.decision == TapePlan::Decision::kOutVariant ? OutStack(g_.nodes()[i], *np.out)
                                                                           : InPlaceStack(g_.nodes()[i]));
    if (i != group.nodes.back()) return;
    std::vector<Step> stacks = std::move(group_stacks_);
    group_stacks_.clear();
    if (std::unique_ptr<TypedCall> fused = FusedStep(group, stacks); fused != nullptr) {
      Step step;
      step.typed = std::move(fused);
      std::vector<std::string> names, ops;
      for (size_t j = 0; j < group.nodes.size(); ++j) {
        names.push_back(g_.nodes()[group.nodes[j]].name);
        ops.push_back(fused::OpName(group.instrs[j].op));
      }
      step.name = absl::StrCat("fused(", absl::StrJoin(names, ", "), ")");
      step.op_name = absl::StrCat("fused: ", absl::StrJoin(ops, " "));
      ++tape_->info_.out_variant_steps;
      ++tape_->info_.typed_steps;
      ++tape_->info_.fused_steps;
      tape_->info_.fused_nodes += static_cast<int>(group.nodes.size());
      Push(std::move(step), g_.nodes()[i], "fused elementwise");
      for (int m : group.nodes) {
        if (m != i) made_[m] = absl::StrCat("in the fused step of ", g_.nodes()[i].name);
      }
      int kept = 0;  // Note [Intermediates kept in chunks]: each written once, as an instruction's result
      for (const fused::Instr& in : group.instrs) kept += in.temp[0] >= 0;
      if (kept > 0) tape_->steps_.back().note = absl::StrCat(kept, " intermediates kept in chunks by the fused kernel");
      return;
    }
    for (size_t j = 0; j < group.nodes.size(); ++j) {
      const int m = group.nodes[j];
      if (plan_.nodes[m].decision == TapePlan::Decision::kOutVariant) {
        OutVariantStep(g_.nodes()[m], *plan_.nodes[m].out, std::move(stacks[j]));
      } else {
        FunctionalStep(g_.nodes()[m]);
      }
    }
  }

  // The fused step of `group` from its nodes' stacks; nullptr if an operand is not what the plan
  // described (then each node keeps its own step).
  std::unique_ptr<TypedCall> FusedStep(const TapePlan::FusedGroup& group, const std::vector<Step>& stacks) {
    fused::Program program;
    program.segments = group.segments;
    program.scratch_bytes = group.scratch_bytes;
    std::vector<TensorArg> operands;
    // Each node's own typed call: the step runs them instead when the kernel meets an input it
    // does not promise eager's bits for (fused::Instr::NanCheck).
    std::vector<std::unique_ptr<TypedCall>> exact;
    auto index_of = [&](const TensorArg& a) {
      for (size_t k = 0; k < operands.size(); ++k) {
        if (a.slot >= 0 ? operands[k].slot == a.slot
                        : operands[k].slot < 0 && operands[k].value.is_same(a.value)) {
          return static_cast<int>(k);
        }
      }
      operands.push_back(a);
      return static_cast<int>(operands.size()) - 1;
    };
    for (size_t j = 0; j < group.nodes.size(); ++j) {
      fused::Instr in = group.instrs[j];
      const Step& stack = stacks[j];
      std::vector<int> slot_of(stack.args.size(), -1);
      for (const Patch& p : stack.patches) slot_of[p.arg] = p.elem < 0 ? p.slot : -2;
      const bool in_place = plan_.nodes[group.nodes[j]].decision != TapePlan::Decision::kOutVariant;
      exact.push_back(in_place ? nullptr : MakeTypedCall(*stack.op, stack.args, slot_of));
      if (exact.back() != nullptr && options_.prepared_steps) {  // the faster of the two ways to call it
        exact.back() = MakePrepared(*stack.op, stack.args, slot_of, std::move(exact.back()));
      }
      if (exact.back() == nullptr) exact.back() = MakeBoxedCall(*stack.op, stack.args, slot_of);  // in place, pow.Scalar_out
      if (exact.back() == nullptr) return nullptr;
      for (int k = 0; k <= in.num_inputs; ++k) {
        const int pos = in.operand[k];
        TensorArg a;
        for (const Patch& p : stack.patches) {
          if (p.arg == pos) a.slot = p.elem < 0 ? p.slot : -2;
        }
        if (a.slot == -2) return nullptr;
        if (a.slot < 0) {
          if (pos >= static_cast<int>(stack.args.size())) return nullptr;
          const c10::IValue& arg = stack.args[pos];
          if (arg.isTensor()) {
            a.value = arg.toTensor();
          } else if (k > 0 && arg.isScalar() && !arg.isComplexDouble()) {
            // a Scalar-typed operand (add_.Scalar's other): its wrapped number, as the op makes it
            a.value = Cast(WrapNumber(arg).toTensor(), in.dtype);
          } else {
            return nullptr;
          }
          const bool is_bool = k == 0   ? in.op >= fused::Op::kLt && in.op <= fused::Op::kNe
                               : k == 1 ? in.op == fused::Op::kWhere
                                        : k == 2 && in.op == fused::Op::kMaskedFill;
          if (!a.value.defined() || a.value.scalar_type() != (is_bool ? c10::kBool : in.dtype)) return nullptr;
        }
        in.operand[k] = index_of(a);
      }
      program.instrs.push_back(in);
    }
    return fused::MakeFusedStep(std::move(program), std::move(operands), std::move(exact), arena_storage_);
  }

  // Note [Step kinds]: the step of the family the plan chose.
  void OutVariantStep(const Node& n, const OutVariant& out, Step step) {
    std::vector<int> slot_of(step.args.size(), -1);
    std::vector<ElemSlot> elem_slots;
    for (const Patch& p : step.patches) {
      if (p.elem < 0) {
        slot_of[p.arg] = p.slot;
      } else {
        elem_slots.push_back({p.arg, p.elem, p.slot});
      }
    }
    const StepKind kind = plan_.nodes[&n - g_.nodes().data()].kind;
    Made made = MakeOutStep(kind, *this, OutCall{n, out.op, step.args, slot_of, elem_slots.empty(), elem_slots},
                            options_);
    step.typed = std::move(made.call);
    tape_->info_.prepared_steps += made.prepared;
    tape_->info_.typed_steps += step.typed != nullptr;
    ++tape_->info_.out_variant_steps;
    step.op_name = OperatorName(out.op);
    Push(std::move(step), n, std::move(made.what));
  }

  void FunctionalStep(const Node& n) {
    Step step;
    step.op = *n.op;
    BuildArgs(n, &step);
    bool any_fresh = false, in_place = false;
    for (ValueId o : n.outputs) {
      const TapePlan::ValuePlan& v = plan_.values[o];
      if (v.same_as >= 0) {  // in place: the result is its argument
        if (v.constant) constants_[o] = constants_[v.same_as];
        step.out_slots.push_back(-1);
        in_place = true;
      } else {
        step.out_slots.push_back(v.slot);
      }
      any_fresh = any_fresh || rec_.values[o].root == o;
    }
    step.op_name = OperatorName(*n.op);
    if (plan_.nodes[&n - g_.nodes().data()].kind == StepKind::kCopies) {
      if ((step.typed = MakeIndexCopy(*this, n)) != nullptr) return Push(std::move(step), n, "copies");
    }
    if (any_fresh) {
      ++tape_->info_.functional_steps;
      tape_->info_.functional_ops.push_back(OperatorName(*n.op));
    }
    in_place = in_place || n.op->schema().is_mutable();  // also a write with no result (_foreach_add_)
    Push(std::move(step), n, any_fresh ? "functional" : in_place ? "in place" : "view");
  }

  // Note [Collective steps]: the collective into its planned buffer, its work handle shared with
  // its wait's step.
  absl::Status CollectiveStep(int i) {
    const Node& n = g_.nodes()[i];
    Step step;
    BuildArgs(n, &step);
    const ValueId out = n.outputs[0];
    constants_[out] = buffers_[plan_.values[out].buffer];
    std::shared_ptr<PendingWork> pending = NewPendingWork();
    try {
      step.typed = MakeCollectiveStep(*plan_.nodes[i].collective, step.args, TensorArgOf(n.args[0].value),
                                      constants_[out].toTensor(), pending);
    } catch (const c10::Error& e) {
      return KernelError(e, absl::StrCat("node '", n.name, "' failed at capture: "));
    }
    pending_of_wait_[plan_.nodes[i].partner] = pending;
    tape_->pending_.push_back(std::move(pending));
    step.args.clear();
    step.patches.clear();
    step.op_name = OperatorName(*n.op);
    ++tape_->info_.collective_steps;
    Push(std::move(step), n, "collective");
    return absl::OkStatus();
  }

  void WaitStep(int i) {
    const Node& n = g_.nodes()[i];
    Step step;
    step.name = n.name;
    step.typed = MakeWaitStep(pending_of_wait_.at(i));
    constants_[n.outputs[0]] = constants_[n.args[0].value];
    step.op_name = OperatorName(*n.op);
    Push(std::move(step), n, "wait");
  }

  // Appends `step`, described for profiles: `kind` and the dtypes and sizes of n's results.
  void Push(Step step, const Node& n, std::string kind) {
    made_[&n - g_.nodes().data()] = kind;
    step.kind_name = std::move(kind);
    std::vector<std::string> shapes;
    for (ValueId o : n.outputs) {
      const ValueRecord& r = rec_.values[o];
      shapes.push_back(r.is_list     ? std::string("list")
                       : !r.is_tensor ? std::string(r.scalar.tagKind())
                                      : absl::StrCat(c10::toString(r.dtype), "[", absl::StrJoin(r.sizes, ", "), "]"));
    }
    step.shapes = absl::StrJoin(shapes, ", ");
    step.note = plan_.nodes[&n - g_.nodes().data()].why;
    tape_->steps_.push_back(std::move(step));
  }

  const Graph& g_;
  const Recording& rec_;
  const TapePlan& plan_;
  const std::vector<at::Tensor>& buffers_;
  c10::Storage arena_storage_;  // the arena's block, where buffers_ lie
  const CaptureOptions& options_;
  KernelTape* tape_;
  std::vector<c10::IValue> constants_;  // per value, once known
  std::vector<std::pair<int, at::Tensor>> holders_;  // (slot, wrapped number): see Holder
  absl::flat_hash_map<int, int> sym_step_of_slot_;   // slot -> the kSymArith step giving it
  std::vector<Step> group_stacks_;  // the stacks of the open fused group's nodes so far
  std::vector<std::string> made_ = std::vector<std::string>(g_.nodes().size());  // see made()
  absl::flat_hash_map<int, std::shared_ptr<PendingWork>> pending_of_wait_;  // wait node -> its work
};

}  // namespace

absl::StatusOr<std::unique_ptr<CapturedGraph>> CaptureKernelTape(
    std::shared_ptr<const Graph> graph, const Recording& rec,
    const std::vector<c10::IValue>& inputs, memory_pool::Arena* arena,
    const CaptureOptions& options) {
  const Graph& g = *graph;
  absl::StatusOr<TapePlan> plan = PlanTape(g, rec, options.fuse_elementwise);
  if (!plan.ok()) return plan.status();
  const memory_pool::ArenaPlan arena_plan = memory_pool::PlanArena(plan->requests);
  arena->Reserve(arena_plan.arena_bytes);
  std::vector<at::Tensor> buffers(plan->requests.size());  // per request, in the arena
  for (size_t v = 0; v < plan->values.size(); ++v) {
    if (const int b = plan->values[v].buffer; b >= 0) {
      buffers[b] = ArenaBuffer(*arena, rec.values[v], arena_plan.offsets[b]);
    }
  }

  auto tape = std::make_unique<KernelTape>();
  tape->info_.nodes = static_cast<int>(g.nodes().size());
  tape->info_.arena_bytes = arena_plan.arena_bytes;
  tape->info_.tensor_bytes = arena_plan.tensor_bytes;
  tape->input_slots_ = plan->input_slots;
  Emitter emitter(g, rec, *plan, buffers, arena->storage(), options, tape.get());
  if (auto s = emitter.Emit(inputs); !s.ok()) return s;
  tape->info_.steps = static_cast<int>(tape->steps_.size());
  tape->slots_.resize(plan->num_slots);
  for (const auto& a : g.outputs()) {
    KernelTape::Output out;
    bool pool = false;
    if (a.kind == Arg::Kind::kValue) {
      const TapePlan::ValuePlan& v = plan->values[a.value];
      if (v.constant) {
        out.constant = emitter.constant(a.value);
      } else {
        out.slot = v.slot;
      }
      pool = v.in_arena;
      // The value itself, through in-place results: an input returned as it is keeps its counter.
      ValueId self = a.value;
      while (plan->values[self].same_as >= 0) self = plan->values[self].same_as;
      const ValueId root = rec.values[a.value].root_or(a.value);
      const auto itself = std::find(g.inputs().begin(), g.inputs().end(), self);
      const bool is_input = itself != g.inputs().end();
      if (is_input && !pool && rec.values[a.value].is_tensor) out.itself = static_cast<int>(itself - g.inputs().begin());
      if (!pool && rec.values[a.value].is_tensor && !rec.values[a.value].is_list && root != a.value && !is_input) {
        const auto in = std::find(g.inputs().begin(), g.inputs().end(), root);
        if (in != g.inputs().end()) {
          out.input = static_cast<int>(in - g.inputs().begin());
          tape->views_inputs_ = true;
        }
      }
    } else {
      out.constant = a.constant;
    }
    tape->outputs_.push_back(std::move(out));
    tape->output_in_pool_.push_back(pool);
  }
  const std::vector<std::string> made = std::move(emitter).made();
  tape->listing_ = plan->ToString(g, &arena_plan, &made);
  return std::unique_ptr<CapturedGraph>(std::move(tape));
}

}  // namespace torchreplay::capture::tape
