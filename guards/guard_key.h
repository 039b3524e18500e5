// guards/guard_key.h: the shape-guard key of a call, and why two keys differ.
//
// A key covers every input: for a tensor its dtype, device, sizes, strides and storage offset; for
// a symbolic scalar its value, or only its kind for a scalar bound per call (Note [Scalars bound
// per call] in capture/ir/graph.h). One captured graph exists per key. The common case, a call with the
// same key as the previous one, is checked by Matches() without building a key or allocating.
#pragma once

#include <ATen/core/ivalue.h>
#include <c10/core/ScalarType.h>

#include <array>

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

// Note [Ambient state]
// Process and thread state that changes which kernel eager runs, or what it computes, without
// changing any input. Read from ATen's code (Context.h and the kernels that consult it); each is
// what a key does with it:
//
//   state (Python spelling)                              what eager does with it      key
//   torch.set_num_threads (at::get_num_threads)          reductions split by thread,  in the key
//                                                        MKL's and oneDNN's blocking,
//                                                        convolution choice (Slow2d
//                                                        or oneDNN); the checked
//                                                        kernels were timed and
//                                                        checked at the old count
//   fp32 precision of oneDNN's matmul, conv, rnn         bf16 or tf32 arithmetic in   in the key
//   (torch.backends.mkldnn.{matmul,conv,rnn}.            fp32 GEMMs, convolutions,
//   fp32_precision; set_float32_matmul_precision)        LSTMs
//   fp32 precision of CUDA's matmul, conv, rnn           tf32 in cuBLAS and cuDNN     in the key
//   (torch.backends.cuda.matmul.allow_tf32, cudnn's)
//   torch.backends.mkldnn.enabled                        other convolution and LSTM   in the key
//                                                        kernels
//   torch.backends.mkldnn.deterministic                  oneDNN's deterministic path  in the key
//   torch.backends.nnpack.set_flags                      NNPACK convolutions (batch   in the key
//                                                        >= 16, mkldnn off)
//   torch.backends.cpu fp16 reduction                    reduced-precision fp16 GEMM  in the key
//   (_set_cpu_allow_fp16_reduced_precision_reduction)    accumulation
//   torch.backends.cudnn.{enabled,benchmark,             which cuDNN algorithm        in the key
//   deterministic}, cuBLAS fp16/bf16 reduction and
//   fp16 accumulation
//   torch.use_deterministic_algorithms (and its          index_put_ with accumulate   in the key
//   fill_uninitialized_memory)                           sorts first; empty tensors
//                                                        filled with NaN
//   torch.set_default_dtype                              factories without a dtype    in the key
//                                                        (arange of floats,
//                                                        scalar_tensor) make others
//   torch.set_flush_denormal (the thread's FTZ/DAZ)      numbers converted per call;  in the key
//                                                        a capture converted them
//                                                        once
//   autocast (CPU or CUDA)                               casts before some ops        not in the key: a graph
//                                                                                     runs as recorded, autocast
//                                                                                     off; its casts are nodes
//   grad mode                                            nothing a graph computes     not in the key: graphs run
//                                                        (graphs run with it off)     with grad off, the caller's
//                                                                                     mode kept for outputs
//   inference mode                                       its outputs are inference    not in the key: the pool is
//                                                        tensors                      made of ordinary tensors,
//                                                                                     outputs handed out under the
//                                                                                     caller's mode
//
// A captured graph keeps the kernels chosen, the constants made and the checked kernels timed
// under the state it was captured in, so these settings are part of its key (GuardKey::settings):
// every call reads the state now (Now(), on the replay path: plain reads, and a few hash lookups
// for the fp32 precisions, only for graphs with an op that may consult them, the CUDA ones only
// for keys with CUDA inputs: Engine::reads_precision_). A call under other settings is another
// key, captured for them, the miss logged as the diff ("threads 2 -> 1"), and bounded and said
// as any key is (Note [A bounded cache]): a program that alternates two thread counts replays
// both. Autocast decides which ops a trace records (the casts it inserts), not which kernels run
// them: the engine runs every graph with autocast's dispatch keys excluded (Engine::Run), as
// AOTAutograd runs a compiled forward, so a graph computes what it recorded under any autocast
// state (a loaded program too); torch.compile recompiles (Dynamo's guards); torchreplay.capture
// refuses to trace under autocast (torch.export decomposes composite ops without autocast's casts
// inside them: export.py _refuse_autocast), so its calls under autocast run the model eagerly
// (Note [What a trace was made under]).
// What else decides which ops a trace records
// (the default dtype, attention's backend switches) is the tracer's: Note [What a trace was made
// under] in bindings/call.h. Tests: guards/guard_key_test.cc (each setting is read and named, keys differ by it);
// tests/python/test_conditions.py (in the key     with eager's bits: thread count, matmul
// precision, default dtype, deterministic algorithms, NNPACK, oneDNN deterministic and conv
// precision; inference mode; attention's switches traced again; autocast) and test_changing_keys.py (mkldnn, flush-denormal). The
// CUDA settings are read and compared as the others but were never run on a GPU.
struct Ambient {
  int threads = 1;
  c10::ScalarType default_dtype = c10::ScalarType::Float;
  // at::Float32Precision per (backend, op): oneDNN's matmul, conv, rnn; CUDA's matmul, conv, rnn
  std::array<uint8_t, 6> fp32_precision{};
  bool mkldnn = true;
  bool mkldnn_deterministic = false;
  bool nnpack = true;
  bool fp16_reduction_cpu = false;
  bool deterministic = false;        // use_deterministic_algorithms
  bool fill_uninitialized = false;   // ... and its fill of empty tensors (read only when it is on)
  bool flush_denormal = false;       // the calling thread's FTZ or DAZ bit (MXCSR on x86-64)
  // cuDNN enabled, benchmark, deterministic; cuBLAS fp16/bf16 reduction options, fp16 accumulation
  std::array<uint8_t, 6> cuda{};

  // The calling thread's state now. `cuda`: also the CUDA settings (a key on CPU tensors only
  // leaves them unread, as its kernels do); `precision`: also the fp32 precisions (a graph with no
  // GEMM, convolution or recurrent op leaves them unread). What is unread stays at its default.
  static Ambient Now(bool cuda = true, bool precision = true);
  bool operator==(const Ambient& o) const;
  bool operator!=(const Ambient& o) const { return !(*this == o); }
  // One clause per setting that differs: "threads 1 -> 2",
  // "torch.backends.mkldnn.enabled True -> False", "flush denormal off -> on"
  static std::string Diff(const Ambient& old, const Ambient& now);

  template <typename H>
  friend H AbslHashValue(H h, const Ambient& a) {
    return H::combine(std::move(h), a.threads, a.default_dtype, a.fp32_precision, a.mkldnn, a.mkldnn_deterministic,
                      a.nnpack, a.fp16_reduction_cpu, a.deterministic, a.fill_uninitialized, a.flush_denormal, a.cuda);
  }
};

class GuardKey {
 public:
  GuardKey() = default;
  // `per_call[i]` set: input i's value, if a scalar, is bound per call and only its kind is
  // guarded (Graph::per_call_scalars). Empty: every value is guarded.
  static GuardKey FromInputs(const std::vector<c10::IValue>& inputs,
                             const std::vector<bool>& per_call = {});

  // True iff FromInputs(inputs, the same per_call) has this key's inputs; allocation-free.
  bool Matches(const std::vector<c10::IValue>& inputs) const;

  const std::vector<InputGuard>& inputs() const { return inputs_; }
  std::string ToString() const;  // "(f32[100, 128]/[128, 1]+0 cpu, int=3, float=*)"

  // The settings eager's kernels read, part of the key (Note [Ambient state]).
  void set_settings(const Ambient& now) { settings_ = now; }
  const Ambient& settings() const { return settings_; }

  bool operator==(const GuardKey& o) const { return inputs_ == o.inputs_ && settings_ == o.settings_; }
  template <typename H>
  friend H AbslHashValue(H h, const GuardKey& k) {
    return H::combine(std::move(h), k.inputs_, k.settings_);
  }

 private:
  std::vector<InputGuard> inputs_;
  Ambient settings_;
};


// Why `now` is not `old`, one clause per differing input:
// "input 2: sizes (100, 128) -> (64, 128); input 4: value 3 -> 5".
std::string Diff(const GuardKey& old, const GuardKey& now);

}  // namespace torchreplay::guards
