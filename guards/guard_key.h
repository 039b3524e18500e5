// guards/guard_key.h: the shape-guard key of a call, and why two keys differ.
//
// A key covers every input: for a tensor its dtype, device, sizes, strides and storage offset; for
// a symbolic scalar its value, or only its kind for a scalar bound per call (Note [Scalars bound
// per call] in ir/graph.h). One captured graph exists per key. The common case, a call with the
// same key as the previous one, is checked by Matches() without building a key or allocating.
#pragma once

#include <ATen/core/ivalue.h>
#include <c10/core/ScalarType.h>

#include <string>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "absl/hash/hash.h"

namespace torchreplay::guards {

// Floats are the same value when their bits are: -0.0 is not 0.0 (x / -0.0 is -inf), and a NaN
// is the same NaN (so a NaN scalar keeps its key instead of missing it every call).
bool SameFloat(double a, double b);

// Why a tensor cannot be guarded and replayed as a plain dense strided tensor, or nullptr when it
// can: sparse, nested, mkldnn, a subclass with __torch_dispatch__ (or a functorch/functional
// wrapper), a lazy conjugate or negative view (.conj(), ._neg_view()), a zero tensor. What such
// tensors mean lives in dispatch keys that a captured kernel, called below them, would skip: the
// engine runs calls with one eagerly. Their guard is kNotPlainTensor (sizes and strides unread).
const char* NotPlain(const at::Tensor& t);

struct InputGuard {
  enum class Kind : uint8_t { kTensor, kInt, kFloat, kBool, kNone, kOther, kNotPlainTensor };
  Kind kind = Kind::kOther;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  c10::Device device = c10::Device(c10::DeviceType::CPU);
  absl::InlinedVector<int64_t, 4> sizes;
  absl::InlinedVector<int64_t, 4> strides;
  int64_t storage_offset = 0;
  int64_t int_value = 0;     // kInt, kBool
  double float_value = 0.0;  // kFloat
  bool per_call = false;     // kInt, kFloat, kBool: the value is bound per call, not guarded

  bool is_scalar() const { return kind == Kind::kInt || kind == Kind::kFloat || kind == Kind::kBool; }
  bool operator==(const InputGuard& o) const;
  template <typename H>
  friend H AbslHashValue(H h, const InputGuard& g) {
    h = H::combine(std::move(h), g.kind, g.dtype, g.device.type(), g.device.index(),
                   g.storage_offset, g.int_value, g.per_call);
    h = H::combine_contiguous(std::move(h), g.sizes.data(), g.sizes.size());
    return H::combine_contiguous(std::move(h), g.strides.data(), g.strides.size());
  }
};

class GuardKey {
 public:
  GuardKey() = default;
  // `per_call[i]` set: input i's value, if a scalar, is bound per call and only its kind is
  // guarded (Graph::per_call_scalars). Empty: every value is guarded.
  static GuardKey FromInputs(const std::vector<c10::IValue>& inputs,
                             const std::vector<bool>& per_call = {});

  // True iff FromInputs(inputs, the same per_call) == *this; allocation-free.
  bool Matches(const std::vector<c10::IValue>& inputs) const;

  const std::vector<InputGuard>& inputs() const { return inputs_; }
  std::string ToString() const;  // "(f32[100, 128]/[128, 1]+0 cpu, int=3, float=*)"

  bool operator==(const GuardKey& o) const { return inputs_ == o.inputs_; }
  template <typename H>
  friend H AbslHashValue(H h, const GuardKey& k) {
    return H::combine(std::move(h), k.inputs_);
  }

 private:
  std::vector<InputGuard> inputs_;
};

// Note [Ambient state]
// Some settings change which kernels eager runs, and so its results, without changing any input:
// autocast on the CPU or CUDA (its ops cast to a lower precision first),
// torch.backends.mkldnn.enabled (convolutions and LSTMs then run other kernels), and
// torch.set_flush_denormal (the calling thread's flush-to-zero and denormals-are-zero modes: a
// number a capture converted once, `x * 1e-40`'s, is converted under the mode of the capture,
// where eager converts it per call). A captured graph keeps the kernels chosen and the constants
// made under the state its key was first seen in (Entry::ambient). A call under another mkldnn
// or flush-denormal setting captures the key again; a call under another autocast state runs
// eagerly (the interpreter dispatches each op as eager does: a capture made under it would call
// kernels below autocast), logged once per engine.
struct Ambient {
  bool mkldnn = true;
  bool flush_denormal = false;  // the calling thread's FTZ or DAZ bit (MXCSR on x86-64)
  // per device (CPU, CUDA): autocast's lower-precision dtype, or Undefined when it is off
  c10::ScalarType autocast_cpu = c10::ScalarType::Undefined, autocast_cuda = c10::ScalarType::Undefined;

  static Ambient Now();
  bool SameAutocast(const Ambient& o) const { return autocast_cpu == o.autocast_cpu && autocast_cuda == o.autocast_cuda; }
  bool operator==(const Ambient& o) const {
    return mkldnn == o.mkldnn && flush_denormal == o.flush_denormal && SameAutocast(o);
  }
  bool operator!=(const Ambient& o) const { return !(*this == o); }
  // "autocast (cpu) off -> bfloat16", "torch.backends.mkldnn.enabled True -> False",
  // "flush denormal off -> on"
  static std::string Diff(const Ambient& old, const Ambient& now);
};

// Why `now` is not `old`, one clause per differing input:
// "input 2: sizes (100, 128) -> (64, 128); input 4: value 3 -> 5".
std::string Diff(const GuardKey& old, const GuardKey& now);

}  // namespace torchreplay::guards
