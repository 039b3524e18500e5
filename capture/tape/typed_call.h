// capture/tape/typed_call.h: kernel tape steps called unboxed.
//
// Note [Typed steps]
// Most steps of real graphs are out= calls with one of a handful of signatures: pointwise unary,
// binary and scalar ops, clamp, softmax, mm/addmm, and numerics "close"'s small_gemm, conv_gemm
// and depthwise_conv2d. For those, capture builds a TypedCall holding the typed operator handle
// and the arguments as C++ values (int lists and an optional bias included), so replay calls the
// kernel unboxed: no IValue stack, no boxing and unboxing around the kernel. Any other step
// stays boxed. A prepared pointwise step (prepared_pointwise.h) is a TypedCall too.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>

#include <memory>
#include <vector>

namespace torchreplay::capture::tape {

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

// The call of any step, boxed: `args` is its prebuilt stack, `slot_of[i]` the per-call slot of
// argument i or -1 (nullptr if an element of a list argument is per call). For calls made rarely
// (a fused step's fallback for an in-place node, Note [In-place instructions]).
std::unique_ptr<TypedCall> MakeBoxedCall(const c10::OperatorHandle& op, const Slots& args,
                                         const std::vector<int>& slot_of);

// Note [Copies]
// Some ops only move elements, and on small tensors cost their argument checks, structured meta
// functions and boxed calls, not the moving: cat, stack, clone and the functional copy (Note
// [Concatenation as copies]), index_copy_ with one index (a KV cache written at a position) and
// embedding (rows of a table). When every tensor involved has one dtype and none is a
// conjugate or negative view (whose bytes are not its elements), the tape makes these moves
// itself: memcpy over the recorded geometry, adjacent dims merged where both sides walk them
// densely, so the bytes are eager's whichever kernel ATen would pick. Index checks raise eager's
// IndexError with eager's message before anything is written. Each tensor has the sizes and
// strides recorded under the guard key; replay raises if one has others.
//
// Raises the clear error where a per-call tensor `t` is not of the recorded dtype, sizes and
// strides (or is a conjugate or negative view) that a step's geometry was made for.
void CheckLayout(const at::Tensor& t, c10::ScalarType dtype, const std::vector<int64_t>& sizes,
                 const std::vector<int64_t>& strides);

// Note [Concatenation as copies]
// aten::cat.out: the result's slice along `dim` for each input is that input, element for
// element; clone and copy are a cat of one input; aten::stack.out (`stack`) a cat whose inputs are
// each one index along `dim`. The result is a planned buffer with its recorded strides.
struct CatInput {
  TensorArg tensor;
  std::vector<int64_t> sizes, strides;
};
std::unique_ptr<TypedCall> MakeCatCopies(std::vector<CatInput> inputs, int64_t dim, at::Tensor out,
                                         bool stack = false);

// self.index_copy_(dim, index, source) where index (int64) has one element: source's one slice
// along dim copied into self's slice at index[0].
std::unique_ptr<TypedCall> MakeIndexCopyOne(CatInput self, int64_t dim, TensorArg index, CatInput source);

// embedding(weight, indices) into `out` (contiguous, indices' shape + [width]): for a 2-d weight
// and contiguous int64 indices, row indices[k] of weight is row k of out.
std::unique_ptr<TypedCall> MakeEmbeddingRows(CatInput weight, TensorArg indices, at::Tensor out);

}  // namespace torchreplay::capture::tape
