// capture/typed_call.h: kernel tape steps called unboxed.
//
// Note [Typed steps]
// Most steps of real graphs are out= calls with one of a handful of signatures: pointwise unary,
// binary and scalar ops, clamp, softmax, mm/addmm. For those, capture builds a TypedCall holding
// the typed operator handle and the arguments as C++ values, so replay calls the kernel unboxed:
// no IValue stack, no boxing and unboxing around the kernel. Any other step stays boxed. A
// prepared pointwise step (prepared_pointwise.h) is a TypedCall too.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>

#include <memory>
#include <vector>

namespace torchreplay::capture {

// A replay's per-call values (non-static inputs, scalar inputs bound per call, results of
// functional steps), by slot.
using Slots = std::vector<c10::IValue>;

class TypedCall {
 public:
  virtual ~TypedCall() = default;
  virtual void Run(c10::DispatchKeySet keys, const Slots& slots) const = 0;
};

// A tensor argument: a constant, or a per-call slot.
struct TensorArg {
  using type = const at::Tensor&;
  at::Tensor value;
  int slot = -1;
  const at::Tensor& get(const Slots& s) const { return slot < 0 ? value : s[slot].toTensor(); }
};

// The typed call of an out= step, or nullptr if its signature is not one of those handled (the
// step then stays boxed). `args` is the step's prebuilt stack (out= buffers last); `slot_of[i]`
// the per-call slot of argument i, or -1.
std::unique_ptr<TypedCall> MakeTypedCall(const c10::OperatorHandle& op, const Slots& args,
                                         const std::vector<int>& slot_of);

// Note [Concatenation as copies]
// aten::cat.out on small tensors costs its structured meta function (shapes, dtypes, overlap
// checks) and the boxed call, not the copying; so do clone and the functional copy. When every
// input has the result's dtype and is no conjugate or negative view (whose bytes are not its
// elements), these only move elements: the result's slice along `dim` for each
// input is that input, element for element, whichever kernel ATen picks (cat's serial kernel or
// copy_). This step makes those copies itself (memcpy, a row at a time where the last dims of
// input and result are dense), so the bytes are eager's; clone and copy are a cat of one input.
// Each input is a constant or per-call tensor with the sizes and strides recorded for it under
// the guard key; replay raises if one has others. The result is a planned buffer with its
// recorded strides.
struct CatInput {
  TensorArg tensor;
  std::vector<int64_t> sizes, strides;
};
std::unique_ptr<TypedCall> MakeCatCopies(std::vector<CatInput> inputs, int64_t dim, at::Tensor out);

}  // namespace torchreplay::capture
