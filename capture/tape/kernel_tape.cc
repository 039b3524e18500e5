// The CPU kernel tape's replay (see kernel_tape.h): the steps a capture made (capture/tape/emitter.cc)
// run per call, profiled, dumped.
#include "capture/tape/kernel_tape.h"

#include <ATen/core/List.h>
#include <c10/core/TensorImpl.h>

#include <algorithm>
#include <chrono>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "capture/tape/checked/conv_steps.h"
#include "capture/tape/checked/gemm_steps.h"
#include "capture/tape/kernel_tape_internal.h"
#include "capture/tape/checked/lstm_steps.h"

namespace torchreplay::capture::tape {
namespace internal {
namespace {

template <class T>
T NumberAs(const c10::IValue& v) {
  if (v.isDouble()) return static_cast<T>(v.toDouble());
  if (v.isInt()) return static_cast<T>(v.toInt());
  return static_cast<T>(v.toBool());
}

void WriteNumber(const c10::IValue& v, at::Tensor* holder) {
  void* p = holder->data_ptr();
  switch (holder->scalar_type()) {
    case c10::kDouble: *static_cast<double*>(p) = NumberAs<double>(v); break;
    case c10::kFloat: *static_cast<float*>(p) = NumberAs<float>(v); break;
    case c10::kLong: *static_cast<int64_t*>(p) = NumberAs<int64_t>(v); break;
    case c10::kBool: *static_cast<bool*>(p) = NumberAs<bool>(v); break;
    default: holder->fill_(v.toScalar());
  }
}

}  // namespace

absl::Status KernelTape::Replay(const std::vector<c10::IValue>& inputs,
                                std::vector<c10::IValue>* outputs) {
  return Run(inputs, outputs, [](size_t) {});
}

absl::StatusOr<std::vector<StepTime>> KernelTape::ProfileReplay(const std::vector<c10::IValue>& inputs,
                                                                int iterations) {
  using Clock = std::chrono::steady_clock;
  std::vector<Clock::duration> spent(steps_.size(), Clock::duration::zero());
  std::vector<c10::IValue> outputs;
  for (int it = 0; it < iterations; ++it) {
    Clock::time_point last = Clock::now();
    absl::Status s = Run(inputs, &outputs, [&](size_t i) {
      const Clock::time_point now = Clock::now();
      spent[i] += now - last;
      last = now;
    });
    outputs.clear();
    if (!s.ok()) return s;
  }
  std::vector<StepTime> rows;
  for (size_t i = 0; i < steps_.size(); ++i) {
    const Step& s = steps_[i];
    rows.push_back(StepTime{s.name, s.op_name, s.kind_name, s.shapes,
                            std::chrono::duration<double, std::micro>(spent[i]).count() /
                                std::max(iterations, 1), s.note});
  }
  return rows;
}

template <class AfterStep>
absl::Status KernelTape::Run(const std::vector<c10::IValue>& inputs,
                             std::vector<c10::IValue>* outputs, AfterStep after_step) {
  for (const auto& [pos, slot] : input_slots_) slots_[slot] = inputs[pos];
  for (ScalarWrite& w : scalar_writes_) WriteNumber(slots_[w.slot], &w.holder);
  absl::Status status;
  Step* current = nullptr;
  try {
    for (size_t i = 0; i < steps_.size(); after_step(i++)) {
      Step& s = steps_[i];
      current = &s;
      if (s.kind == Step::Kind::kGetItem) {
        slots_[s.out_slots[0]] = slots_[s.patches[0].slot].toList().get(s.index);
        continue;
      }
      if (s.kind == Step::Kind::kSymArith) {
        c10::IValue operands[2] = {s.args[0], s.args.size() > 1 ? s.args[1] : c10::IValue()};
        for (const Patch& p : s.patches) operands[p.arg] = slots_[p.slot];
        absl::StatusOr<c10::IValue> r = EvalSymArith(s.sym_op, operands[0], operands[1]);
        if (!r.ok()) {  // an int overflow or a division by zero, as the interpreter reports it
          status = WithContext(r.status(), absl::StrCat("node '", s.name, "': "));
          break;
        }
        c10::IValue& out = slots_[s.out_slots[0]];
        out = *std::move(r);
        for (at::Tensor& h : s.holders) WriteNumber(out, &h);
        continue;
      }
      if (s.typed != nullptr) {
        s.typed->Run(keys_, slots_);
        continue;
      }
      stack_.assign(s.args.begin(), s.args.end());
      for (const Patch& p : s.patches) {
        if (p.elem < 0) {
          stack_[p.arg] = slots_[p.slot];
        } else {
          stack_[p.arg].toList().set(p.elem, slots_[p.slot]);
        }
      }
      s.op->redispatchBoxed(keys_, &stack_);
      for (size_t r = 0; r < s.out_slots.size(); ++r) {
        if (s.out_slots[r] >= 0) slots_[s.out_slots[r]] = std::move(stack_[r]);
      }
      // A list argument is shared with the prebuilt stack: drop this call's tensors from it, as
      // the slots are dropped below, so the step does not keep them alive until the next call.
      for (const Patch& p : s.patches) {
        if (p.elem >= 0) s.args[p.arg].toList().set(p.elem, c10::IValue(at::Tensor()));
      }
    }
  } catch (const c10::Error& e) {
    status = KernelError(e, absl::StrCat("node '", current->name, "' failed in replay: "));
  } catch (...) {
    DropCallValues(current);
    throw;
  }
  if (status.ok()) {
    outputs->clear();
    for (const Output& o : outputs_) {
      outputs->push_back(o.itself >= 0 ? inputs[o.itself] : o.slot < 0 ? o.constant : slots_[o.slot]);
    }
    if (views_inputs_) ShareVersionCounters(inputs, outputs);
    current = nullptr;
  }
  // A failed call drops its tensors (inputs, intermediates, list arguments) as a successful one
  // does, instead of keeping them alive until the next call.
  DropCallValues(current);
  return status;
}

// Note [Outputs that view an input]
// In eager a view shares its base's version counter, so an in-place change of an input after the
// call shows in every output that views it, and autograd's check of its saved tensors sees it (a
// backward that reads such a view raises "modified by an inplace operation"). The tape
// redispatches below autograd, where some view kernels (view, alias, _unsafe_view) make a plain
// TensorImpl over the input's storage with a version counter of its own: an output that is one
// (a view of an input that a training graph saves for its backward) would let such a change pass
// unseen and the backward read the changed values. So each output whose recorded root is a graph
// input gets that input's counter on every call, as the interpreter's (eager's) views have. An
// output that is a graph input itself (through in-place results) is the call's own tensor, never
// the one a capture baked in: a parameter saved for the backward, replaced by another
// nn.Parameter over the same memory, is still the one the caller changes. Outputs in the pool
// share their buffer's counter instead (Note [Handed-out outputs], replay/handout.h).
void KernelTape::ShareVersionCounters(const std::vector<c10::IValue>& inputs,
                                      std::vector<c10::IValue>* outputs) const {
  for (size_t i = 0; i < outputs_.size(); ++i) {
    const int j = outputs_[i].input;
    if (j < 0 || j >= static_cast<int>(inputs.size()) || !inputs[j].isTensor() || !(*outputs)[i].isTensor()) continue;
    c10::TensorImpl* out = (*outputs)[i].toTensor().unsafeGetTensorImpl();
    c10::TensorImpl* in = inputs[j].toTensor().unsafeGetTensorImpl();
    if (out == nullptr || in == nullptr || out == in || out->is_inference() || in->is_inference()) continue;
    out->set_version_counter(in->version_counter());
  }
}

void KernelTape::DropCallValues(Step* failed) {
  if (failed != nullptr) {
    for (const Patch& p : failed->patches) {
      if (p.elem >= 0) failed->args[p.arg].toList().set(p.elem, c10::IValue(at::Tensor()));
    }
  }
  for (auto& v : slots_) v = c10::IValue();
  stack_.clear();
  for (auto& p : pending_) DrainPending(p.get());
}

absl::StatusOr<std::string> KernelTape::Dump(const std::string& path_stem) const {
  const std::string path = path_stem + ".txt";
  std::ofstream f(path);
  f << listing_;
  if (!f) return absl::InternalError(absl::StrCat("cannot write ", path));
  return path;
}

}  // namespace internal

bool CheckTapeNode(const Graph& g, int node, const std::vector<c10::IValue>& env, Recording* rec) {
  if (checked::IsConvolution(g.nodes()[node])) {
    checked::CheckConvolution(g, node, env, rec);
    return true;
  }
  if (checked::IsCheckedLstm(g.nodes()[node])) {
    checked::CheckLstm(g, node, env, rec);
    return true;
  }
  return checked::IsGemm(g.nodes()[node]) && checked::CheckGemm(g, node, env, rec);
}

}  // namespace torchreplay::capture::tape
