// Prepared pointwise steps (Note [Prepared pointwise steps] in prepared_pointwise.h).
// Over 500 lines: the prepared kinds (pointwise, sums and means, attention, layer norm) share
// one guard (the DispatchStub capability below) and the TypedCall plumbing around it.
//
// Prepared pointwise steps call ATen's CPU kernel stubs. DispatchStub's inline code must be
// compiled with the CPU capability set torch itself was built with: on x86-64 that is AVX2 and
// AVX512 (the exported DispatchStubImpl::get_call_ptr takes those kernels). Elsewhere the
// prepared path is compiled out and steps stay ordinary typed calls.
#if defined(__x86_64__) && !defined(TORCHREPLAY_NO_PREPARED_STEPS)
#define TORCHREPLAY_PREPARED_STEPS 1
#ifndef HAVE_AVX512_CPU_DEFINITION
#define HAVE_AVX512_CPU_DEFINITION
#endif
#ifndef HAVE_AVX2_CPU_DEFINITION
#define HAVE_AVX2_CPU_DEFINITION
#endif
#include <ATen/TensorIterator.h>
#include <ATen/native/Activation.h>
#include <ATen/native/BinaryOps.h>
#include <ATen/native/TensorCompare.h>
#include <ATen/native/ReduceOps.h>
#include <ATen/native/ReduceOpsUtils.h>
#include <ATen/native/UnaryOps.h>
#include <ATen/OpMathType.h>
#include <ATen/native/layer_norm.h>
#include <ATen/native/transformers/attention.h>
#include <ATen/ops/empty_strided.h>
#include <torch/library.h>
#endif
#include "capture/tape/prepared_pointwise.h"

#include <string>

#include "absl/container/flat_hash_map.h"
#include "capture/ir/graph.h"

namespace torchreplay::capture::tape {

#ifdef TORCHREPLAY_PREPARED_STEPS
namespace {

enum class IterKind { kUnary, kUnaryFloat, kBinary, kBinaryFloat, kComparison };
using StubCall = void (*)(at::TensorIteratorBase&, const c10::Scalar&);

struct PreparedOp {
  IterKind kind;
  StubCall call;
  bool has_scalar;     // add/sub alpha, clamp_min's min: the argument after the tensors
  bool negate_scalar;  // sub: add_stub with -alpha
};

// The op's CPU kernel stub, called on the prepared iterator (with the op's scalar, if any).
template <auto& Stub>
void StubOnly(at::TensorIteratorBase& it, const c10::Scalar&) {
  Stub(c10::kCPU, it);
}
template <auto& Stub>
void StubWithScalar(at::TensorIteratorBase& it, const c10::Scalar& s) {
  Stub(c10::kCPU, it, s);
}

const PreparedOp* FindPreparedOp(const std::string& name) {
  using namespace at::native;  // NOLINT: the stubs
  constexpr IterKind kUnary = IterKind::kUnary, kFloat = IterKind::kUnaryFloat;
  constexpr IterKind kBinary = IterKind::kBinary, kCompare = IterKind::kComparison;
  static const absl::flat_hash_map<std::string, PreparedOp> kOps = {
      {"aten::sin.out", {kFloat, &StubOnly<sin_stub>, false, false}},
      {"aten::cos.out", {kFloat, &StubOnly<cos_stub>, false, false}},
      {"aten::exp.out", {kFloat, &StubOnly<exp_stub>, false, false}},
      {"aten::log.out", {kFloat, &StubOnly<log_stub>, false, false}},
      {"aten::tanh.out", {kFloat, &StubOnly<tanh_stub>, false, false}},
      {"aten::sigmoid.out", {kFloat, &StubOnly<sigmoid_stub>, false, false}},
      {"aten::sqrt.out", {kFloat, &StubOnly<sqrt_stub>, false, false}},
      {"aten::rsqrt.out", {kFloat, &StubOnly<rsqrt_stub>, false, false}},
      {"aten::reciprocal.out", {kFloat, &StubOnly<reciprocal_stub>, false, false}},
      {"aten::erf.out", {kFloat, &StubOnly<erf_stub>, false, false}},
      {"aten::neg.out", {kUnary, &StubOnly<neg_stub>, false, false}},
      {"aten::silu.out", {kUnary, &StubOnly<silu_stub>, false, false}},
      {"aten::clamp_min.out", {kUnary, &StubWithScalar<clamp_min_scalar_stub>, true, false}},
      {"aten::add.out", {kBinary, &StubWithScalar<add_stub>, true, false}},
      {"aten::sub.out", {kBinary, &StubWithScalar<add_stub>, true, true}},
      {"aten::mul.out", {kBinary, &StubOnly<mul_stub>, false, false}},
      {"aten::div.out", {IterKind::kBinaryFloat, &StubOnly<div_true_stub>, false, false}},
      {"aten::lt.Tensor_out", {kCompare, &StubOnly<lt_stub>, false, false}},
      {"aten::le.Tensor_out", {kCompare, &StubOnly<le_stub>, false, false}},
      {"aten::gt.Tensor_out", {kCompare, &StubOnly<gt_stub>, false, false}},
      {"aten::ge.Tensor_out", {kCompare, &StubOnly<ge_stub>, false, false}},
      {"aten::eq.Tensor_out", {kCompare, &StubOnly<eq_stub>, false, false}},
      {"aten::ne.Tensor_out", {kCompare, &StubOnly<ne_stub>, false, false}},
  };
  auto it = kOps.find(name);
  return it == kOps.end() ? nullptr : &it->second;
}

// The op's own code handles complex and NaN scalars (clamp_min's NaN fills); the stub alone
// does not.
bool PreparableScalar(const c10::Scalar& s) {
  return !s.isComplex() && s.toDouble() == s.toDouble();
}

class PreparedPointwise final : public TypedCall {
 public:
  // operands: out first, then the tensor inputs (TensorIterator's operand order). `typed` is the
  // ordinary typed call, used if the iterator cannot be prepared.
  PreparedPointwise(const PreparedOp& op, std::vector<TensorArg> operands, c10::Scalar scalar,
                    int scalar_slot, std::unique_ptr<TypedCall> typed)
      : op_(op), operands_(std::move(operands)), scalar_(std::move(scalar)),
        scalar_slot_(scalar_slot), typed_(std::move(typed)) {}

  void Run(c10::DispatchKeySet keys, const Slots& slots) const override {
    if (state_ == State::kUnprepared) {
      // First replay: every per-call operand has its value now.
      state_ = Build(slots) ? State::kPrepared : State::kTyped;
    }
    if (state_ == State::kTyped) return typed_->Run(keys, slots);
    if (scalar_slot_ >= 0) {  // a scalar input bound per call
      scalar_ = slots[scalar_slot_].toScalar();
      if (!PreparableScalar(scalar_)) return typed_->Run(keys, slots);
      if (op_.negate_scalar) scalar_ = -scalar_;
    }
    for (size_t i = 0; i < operands_.size(); ++i) {
      if (operands_[i].slot < 0 && operands_[i].value.data_ptr() != built_ptrs_[i]) {
        // The arena moved (a larger key grew it): same geometry, rebuild once.
        if (!Build(slots)) {
          state_ = State::kTyped;
          return typed_->Run(keys, slots);
        }
        break;
      }
    }
    for (size_t i = 0; i < operands_.size(); ++i) {
      if (operands_[i].slot >= 0) {
        iter_->unsafe_replace_operand(static_cast<int64_t>(i),
                                      slots[operands_[i].slot].toTensor().data_ptr());
      }
    }
    op_.call(*iter_, scalar_);
    if (iter_->ntensors() != static_cast<int>(operands_.size())) {
      // Some kernels rewrite the iterator they are given (reduced-precision mul/div/add read a
      // CPU scalar operand's value and remove it): this call was right, but the iterator can
      // no longer be reused. Later calls take the typed call.
      state_ = State::kTyped;
      iter_.reset();
      standins_.clear();
    }
  }

 private:
  // Builds the iterator the way the op's meta function does. False if an operand would need a
  // dtype cast (the iterator would hold a copy made now) or the op's checks fail.
  bool Build(const Slots& slots) const {
    // The iterator borrows its operands. A per-call tensor is gone after the call, so it is built
    // on a stand-in of the same geometry (its own small buffer), whose data pointer each call
    // then replaces; constants are held by the step itself.
    const at::Tensor& out = operands_[0].value;
    if (out.numel() > kMaxPreparedNumel) return false;  // bounds the stand-ins' memory
    std::vector<const at::Tensor*> ops(operands_.size());
    standins_.assign(operands_.size(), at::Tensor());
    for (size_t i = 0; i < operands_.size(); ++i) {
      if (operands_[i].slot >= 0) {
        const at::Tensor& t = slots[operands_[i].slot].toTensor();
        standins_[i] = at::empty_strided(t.sizes(), t.strides(), t.options());
        ops[i] = &standins_[i];
      } else {
        ops[i] = &operands_[i].value;
      }
    }
    try {
      iter_ = std::make_unique<at::TensorIterator>();
      switch (op_.kind) {
        case IterKind::kUnary:
          iter_->build_borrowing_unary_op(out, *ops[1]);
          break;
        case IterKind::kUnaryFloat:
          iter_->build_borrowing_unary_float_op(out, *ops[1]);
          break;
        case IterKind::kBinary:
          iter_->build_borrowing_binary_op(out, *ops[1], *ops[2]);
          break;
        case IterKind::kBinaryFloat:
          iter_->build_borrowing_binary_float_op(out, *ops[1], *ops[2]);
          break;
        case IterKind::kComparison:
          iter_->build_borrowing_comparison_op(out, *ops[1], *ops[2]);
          break;
      }
    } catch (const c10::Error&) {
      return false;
    }
    built_ptrs_.clear();
    for (size_t i = 0; i < operands_.size(); ++i) {
      if (ops[i]->scalar_type() != iter_->dtype(static_cast<int64_t>(i))) return false;
      built_ptrs_.push_back(operands_[i].slot < 0 ? ops[i]->data_ptr() : nullptr);
    }
    return true;
  }

  static constexpr int64_t kMaxPreparedNumel = 1 << 16;

  enum class State { kUnprepared, kPrepared, kTyped };
  const PreparedOp& op_;
  std::vector<TensorArg> operands_;
  mutable c10::Scalar scalar_;
  int scalar_slot_ = -1;
  std::unique_ptr<TypedCall> typed_;
  mutable State state_ = State::kUnprepared;
  mutable std::unique_ptr<at::TensorIterator> iter_;
  mutable std::vector<at::Tensor> standins_;
  mutable std::vector<void*> built_ptrs_;
};

// Note [Prepared sums and means]: sum.IntList_out and mean.out in float32 and float64 as ATen's
// CPU code computes them (ReduceOps.cpp: sum_out builds the reduction iterator with
// make_reduction_from_out_ty and calls sum_stub; mean_out on the CPU is that sum, then div_ by
// the number of elements reduced, an IEEE division of each result), with the iterator built once.
// A per-call input is built on a stand-in whose data pointer each call replaces; that is safe only
// where the kernel reads the iterator's pointers. TensorIteratorBase::parallel_reduce does not
// when the result is one element and the iterator holds GRAIN_SIZE elements or more: at more than
// one thread it takes two_pass_reduction, which builds a new iterator over iter.input(0), the
// stand-in tensor itself (TensorIteratorReduce.cpp), and sums the stand-in's bytes. Such a
// reduction (a sum over one long row) keeps the typed call, which builds its iterator per call;
// at that length building it is a small part of the call.
class PreparedReduction final : public TypedCall {
 public:
  PreparedReduction(TensorArg input, at::Tensor out, std::optional<std::vector<int64_t>> dims, bool keepdim,
                    bool mean, std::unique_ptr<TypedCall> typed)
      : input_(std::move(input)), out_(std::move(out)), dims_(std::move(dims)), keepdim_(keepdim),
        mean_(mean), typed_(std::move(typed)) {}

  void Run(c10::DispatchKeySet keys, const Slots& slots) const override {
    const at::Tensor& in = input_.get(slots);
    if (state_ == State::kUnprepared || out_.data_ptr() != built_out_ ||
        (input_.slot < 0 && in.data_ptr() != built_in_)) {
      state_ = Build(in) ? State::kPrepared : State::kTyped;  // first call, or the arena moved
    }
    if (state_ == State::kTyped) return typed_->Run(keys, slots);
    if (input_.slot >= 0) iter_->unsafe_replace_operand(1, in.data_ptr());
    at::native::sum_stub(c10::kCPU, *iter_);
    if (mean_) {
      AT_DISPATCH_FLOATING_TYPES(out_.scalar_type(), "torchreplay_mean", [&] {
        scalar_t* o = out_.data_ptr<scalar_t>();
        const scalar_t n = static_cast<scalar_t>(count_);
        for (int64_t i = 0, e = out_.numel(); i < e; ++i) o[i] = o[i] / n;
      });
    }
  }

 private:
  bool Build(const at::Tensor& in) const {
    const c10::ScalarType t = out_.scalar_type();
    if ((t != c10::kFloat && t != c10::kDouble) || in.scalar_type() != t || !out_.is_contiguous() ||
        out_.numel() == 0 || in.numel() == 0 || out_.numel() > (1 << 16)) {
      return false;
    }
    count_ = 1;
    if (!dims_.has_value() || dims_->empty() || in.dim() == 0) {
      count_ = in.numel();
    } else {
      for (int64_t d : *dims_) count_ *= in.size(c10::maybe_wrap_dim(d, in.dim()));
    }
    if (count_ > (int64_t{1} << 24)) return false;  // the int-to-float conversion stays exact
    // The iterator borrows its operands: a per-call input is built on a stand-in of its geometry.
    standin_ = input_.slot >= 0 ? at::empty_strided(in.sizes(), in.strides(), in.options()) : in;
    try {
      at::OptionalIntArrayRef dims = dims_.has_value() ? at::OptionalIntArrayRef(*dims_) : at::OptionalIntArrayRef();
      iter_ = std::make_unique<at::TensorIterator>(
          at::meta::make_reduction_from_out_ty(standin_, out_, dims, keepdim_, t));
    } catch (const c10::Error&) {
      return false;
    }
    if (iter_->numel() == 0 || iter_->ntensors() != 2 || iter_->data_ptr(1) != standin_.data_ptr()) return false;
    if (input_.slot >= 0 && iter_->output(0).numel() == 1 && iter_->numel() >= at::internal::GRAIN_SIZE) return false;
    built_out_ = out_.data_ptr();
    built_in_ = in.data_ptr();
    return true;
  }

  enum class State { kUnprepared, kPrepared, kTyped };
  TensorArg input_;
  at::Tensor out_;
  std::optional<std::vector<int64_t>> dims_;
  bool keepdim_, mean_;
  std::unique_ptr<TypedCall> typed_;
  mutable State state_ = State::kUnprepared;
  mutable std::unique_ptr<at::TensorIterator> iter_;
  mutable at::Tensor standin_;
  mutable int64_t count_ = 1;
  mutable void* built_out_ = nullptr;
  mutable void* built_in_ = nullptr;
};

// Note [Attention on planned buffers]: aten::_scaled_dot_product_flash_attention_for_cpu
// allocates its two results and calls flash_attention_kernel on them (attention.cpp: the output
// as empty_like(query).transpose(1, 2), the logsumexp as an empty (batch, q_len, heads) tensor of
// the op-math dtype) and hands out their transposes. Its out= form, registered below as
// torchreplay::_scaled_dot_product_flash_attention_for_cpu.out, writes into the buffers of the
// results' recorded geometry through the same stub: the kernel sees exactly the tensors eager gives
// it, so the bits are eager's (the recording checks them for each key, Note [Checked out=
// kernels]); the tape calls the stub directly, with no dispatch and no allocation of its own.
void FlashAttentionInto(const at::Tensor& output, const at::Tensor& logsumexp, const at::Tensor& q,
                        const at::Tensor& k, const at::Tensor& v, double dropout_p, bool is_causal,
                        const std::optional<at::Tensor>& mask, std::optional<double> scale) {
  at::native::flash_attention_kernel(c10::kCPU, output.transpose(1, 2), logsumexp.transpose(1, 2), q, k, v,
                                     dropout_p, is_causal, mask, scale);
}

std::tuple<at::Tensor&, at::Tensor&> FlashAttentionOut(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                       double dropout_p, bool is_causal,
                                                       const std::optional<at::Tensor>& mask,
                                                       std::optional<double> scale, at::Tensor& output,
                                                       at::Tensor& logsumexp) {
  const c10::ScalarType dtype = q.scalar_type();  // attention.cpp's checks
  TORCH_CHECK(c10::isFloatingType(dtype) && q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && dropout_p == 0.0 &&
                  q.size(3) == v.size(3) && k.size(3) == v.size(3) &&
                  (!mask.has_value() || mask->scalar_type() == at::kFloat || mask->scalar_type() == dtype) &&
                  (!mask.has_value() || mask->dim() == 2 || mask->dim() == 4),
              "torchreplay::_scaled_dot_product_flash_attention_for_cpu.out: arguments "
              "aten::_scaled_dot_product_flash_attention_for_cpu refuses");
  TORCH_CHECK(output.sizes() == q.sizes() && logsumexp.dim() == 3 && logsumexp.size(0) == q.size(0) &&
                  logsumexp.size(1) == q.size(1) && logsumexp.size(2) == q.size(2) &&
                  logsumexp.scalar_type() == at::toOpMathType(dtype) && output.scalar_type() == dtype,
              "torchreplay::_scaled_dot_product_flash_attention_for_cpu.out: outputs of other sizes or dtypes "
              "than the op's");
  FlashAttentionInto(output, logsumexp, q, k, v, dropout_p, is_causal, mask, scale);
  return {output, logsumexp};
}

class FlashAttentionStep final : public TypedCall {
 public:
  FlashAttentionStep(TensorArg q, TensorArg k, TensorArg v, double dropout_p, bool is_causal,
                     std::optional<TensorArg> mask, std::optional<double> scale, at::Tensor output,
                     at::Tensor logsumexp)
      : q_(std::move(q)), k_(std::move(k)), v_(std::move(v)), dropout_p_(dropout_p), is_causal_(is_causal),
        mask_(std::move(mask)), scale_(scale), output_(std::move(output)), logsumexp_(std::move(logsumexp)) {}

  void Run(c10::DispatchKeySet, const Slots& slots) const override {
    std::optional<at::Tensor> mask;
    if (mask_.has_value()) mask = mask_->get(slots);
    FlashAttentionInto(output_, logsumexp_, q_.get(slots), k_.get(slots), v_.get(slots), dropout_p_, is_causal_,
                       mask, scale_);
  }

 private:
  TensorArg q_, k_, v_;
  double dropout_p_;
  bool is_causal_;
  std::optional<TensorArg> mask_;
  std::optional<double> scale_;
  at::Tensor output_, logsumexp_;  // planned buffers, the results' recorded geometry
};

// Note [Layer norm on planned buffers]: aten::native_layer_norm (layer_norm_cpu) runs
// LayerNormKernel on the input and the parameters (made contiguous) into empty_like(input) and two
// (M,) statistics of the parameters' dtype, and hands the statistics out as views shaped like the
// input with the normalized dims 1. ATen's out= overload has no CPU kernel of its own (allocate,
// compute, copy); torchreplay::native_layer_norm.out, registered below, calls the same stub on the
// buffers of the results' recorded geometry: the same kernel on the same data, so eager's bits
// (checked on the recording run, Note [Checked out= kernels]). Taken where the input and the
// parameters are contiguous and of one dtype; elsewhere the op runs functionally.
std::pair<int64_t, int64_t> LayerNormChecked(const at::Tensor& input, at::IntArrayRef normalized_shape,
                                             const at::Tensor& weight, const at::Tensor& bias, const at::Tensor& out,
                                             const at::Tensor& mean, const at::Tensor& rstd) {
  const auto ours = [&](const at::Tensor& t) {
    return !t.defined() || (t.is_contiguous() && t.scalar_type() == input.scalar_type());
  };
  TORCH_CHECK(input.is_contiguous() && ours(weight) && ours(bias),
              "torchreplay::native_layer_norm.out: a non-contiguous input, or parameters of another dtype or "
              "layout than the input (aten::native_layer_norm takes those)");
  const auto [M, N] = at::native::_check_layer_norm_inputs(input, normalized_shape, weight, bias);
  TORCH_CHECK(out.sizes() == input.sizes() && out.is_contiguous() && out.scalar_type() == input.scalar_type() &&
                  mean.numel() == M && rstd.numel() == M && mean.is_contiguous() && rstd.is_contiguous() &&
                  mean.scalar_type() == input.scalar_type() && rstd.scalar_type() == input.scalar_type(),
              "torchreplay::native_layer_norm.out: outputs of other sizes, layouts or dtypes than the op's");
  return {M, N};
}

std::tuple<at::Tensor&, at::Tensor&, at::Tensor&> LayerNormOut(const at::Tensor& input, at::IntArrayRef normalized_shape,
                                                               const std::optional<at::Tensor>& weight,
                                                               const std::optional<at::Tensor>& bias, double eps,
                                                               at::Tensor& out, at::Tensor& mean, at::Tensor& rstd) {
  const at::Tensor w = weight.value_or(at::Tensor()), b = bias.value_or(at::Tensor());
  const auto [M, N] = LayerNormChecked(input, normalized_shape, w, b, out, mean, rstd);
  at::Tensor mean_m = mean.view({M}), rstd_m = rstd.view({M});
  at::native::LayerNormKernel(c10::kCPU, input, w, b, M, N, eps, &out, &mean_m, &rstd_m);
  return {out, mean, rstd};
}

class LayerNormStep final : public TypedCall {
 public:
  LayerNormStep(TensorArg input, TensorArg weight, TensorArg bias, int64_t M, int64_t N, double eps, at::Tensor out,
                at::Tensor mean, at::Tensor rstd)
      : input_(std::move(input)), weight_(std::move(weight)), bias_(std::move(bias)), M_(M), N_(N), eps_(eps),
        out_(std::move(out)), mean_(mean.view({M})), rstd_(rstd.view({M})) {}

  void Run(c10::DispatchKeySet, const Slots& slots) const override {
    const at::Tensor& x = input_.get(slots);
    TORCH_CHECK(x.is_contiguous(), "torchreplay: a layer norm's input is no longer contiguous");
    at::native::LayerNormKernel(c10::kCPU, x, weight_.get(slots), bias_.get(slots), M_, N_, eps_, &out_, &mean_,
                                &rstd_);
  }

 private:
  TensorArg input_, weight_, bias_;  // a None weight or bias: an undefined constant, as ATen takes it
  int64_t M_, N_;
  double eps_;
  mutable at::Tensor out_, mean_, rstd_;  // planned buffers; the statistics as (M,) views
};

}  // namespace

TORCH_LIBRARY_IMPL(torchreplay, CPU, m) {
  m.impl("_scaled_dot_product_flash_attention_for_cpu.out", &FlashAttentionOut);
  m.impl("native_layer_norm.out", &LayerNormOut);
}

std::unique_ptr<TypedCall> MakeFlashAttention(const Slots& args, const std::vector<int>& slot_of) {
  // (query, key, value, dropout_p, is_causal, attn_mask, scale, output, logsumexp)
  if (args.size() != 9 || slot_of[3] >= 0 || slot_of[4] >= 0 || slot_of[6] >= 0 || slot_of[7] >= 0 ||
      slot_of[8] >= 0 || !args[3].isDouble() || !args[4].isBool() || !(args[6].isNone() || args[6].isDouble()) ||
      !args[7].isTensor() || !args[8].isTensor()) {
    return nullptr;
  }
  TensorArg qkv[3];
  for (int i = 0; i < 3; ++i) {
    if (slot_of[i] >= 0) {
      qkv[i].slot = slot_of[i];
    } else if (args[i].isTensor()) {
      qkv[i].value = args[i].toTensor();
    } else {
      return nullptr;
    }
  }
  std::optional<TensorArg> mask;
  if (slot_of[5] >= 0) {
    mask = TensorArg{at::Tensor(), slot_of[5]};
  } else if (args[5].isTensor()) {
    mask = TensorArg{args[5].toTensor(), -1};
  } else if (!args[5].isNone()) {
    return nullptr;
  }
  std::optional<double> scale;
  if (args[6].isDouble()) scale = args[6].toDouble();
  return std::make_unique<FlashAttentionStep>(qkv[0], qkv[1], qkv[2], args[3].toDouble(), args[4].toBool(),
                                              std::move(mask), scale, args[7].toTensor(), args[8].toTensor());
}

std::unique_ptr<TypedCall> MakeLayerNorm(const Slots& args, const std::vector<int>& slot_of) {
  // (input, normalized_shape, weight, bias, eps, out0, out1, out2)
  if (args.size() != 8 || slot_of[1] >= 0 || slot_of[4] >= 0 || slot_of[5] >= 0 || slot_of[6] >= 0 ||
      slot_of[7] >= 0 || !args[1].isIntList() || !args[4].isDouble() || !args[5].isTensor() || !args[6].isTensor() ||
      !args[7].isTensor() || (slot_of[0] < 0 && !args[0].isTensor())) {
    return nullptr;
  }
  TensorArg input{slot_of[0] >= 0 ? at::Tensor() : args[0].toTensor(), slot_of[0]};
  TensorArg params[2];  // weight, bias
  for (int k = 0; k < 2; ++k) {
    const int a = 2 + k;
    if (slot_of[a] < 0 && !args[a].isTensor() && !args[a].isNone()) return nullptr;
    params[k] = TensorArg{slot_of[a] < 0 && args[a].isTensor() ? args[a].toTensor() : at::Tensor(), slot_of[a]};
  }
  const at::Tensor& out = args[5].toTensor();
  const std::vector<int64_t> normalized = args[1].toIntVector();
  const int64_t axis = out.dim() - static_cast<int64_t>(normalized.size());
  if (axis < 0) return nullptr;
  const int64_t M = c10::multiply_integers(out.sizes().begin(), out.sizes().begin() + axis);
  const int64_t N = c10::multiply_integers(normalized);
  return std::make_unique<LayerNormStep>(std::move(input), std::move(params[0]), std::move(params[1]), M, N,
                                         args[4].toDouble(), out, args[6].toTensor(), args[7].toTensor());
}

std::unique_ptr<TypedCall> MakePrepared(const c10::OperatorHandle& op, const Slots& args,
                                        const std::vector<int>& slot_of,
                                        std::unique_ptr<TypedCall> typed) {
  if (typed == nullptr) return typed;
  const std::string name = OperatorName(op);
  if (name == "aten::sum.IntList_out" || name == "aten::mean.out") {
    // (self, dim, keepdim, dtype, out): dtype none or the result's, out a planned buffer.
    if (args.size() != 5 || slot_of[1] >= 0 || slot_of[2] >= 0 || slot_of[3] >= 0 || slot_of[4] >= 0 ||
        !args[4].isTensor() || !args[2].isBool() || !(args[1].isNone() || args[1].isIntList()) ||
        !(args[3].isNone() || (args[3].isInt() && args[3].toInt() == static_cast<int64_t>(
                                                       args[4].toTensor().scalar_type())))) {
      return typed;
    }
    TensorArg input;
    if (slot_of[0] >= 0) {
      input.slot = slot_of[0];
    } else if (args[0].isTensor()) {
      input.value = args[0].toTensor();
    } else {
      return typed;
    }
    std::optional<std::vector<int64_t>> dims;
    if (args[1].isIntList()) dims = args[1].toIntVector();
    return std::make_unique<PreparedReduction>(std::move(input), args[4].toTensor(), std::move(dims),
                                               args[2].toBool(), name == "aten::mean.out", std::move(typed));
  }
  const PreparedOp* prepared = FindPreparedOp(name);
  if (prepared == nullptr) return typed;
  const size_t num_inputs = prepared->kind == IterKind::kBinary ||
                                    prepared->kind == IterKind::kBinaryFloat ||
                                    prepared->kind == IterKind::kComparison
                                ? 2
                                : 1;
  if (args.size() != num_inputs + (prepared->has_scalar ? 1 : 0) + 1) return typed;
  if (!args.back().isTensor() || slot_of.back() >= 0) return typed;
  std::vector<TensorArg> operands(1);
  operands[0].value = args.back().toTensor();
  for (size_t i = 0; i < num_inputs; ++i) {
    TensorArg a;
    if (slot_of[i] >= 0) {
      a.slot = slot_of[i];
    } else if (args[i].isTensor() && args[i].toTensor().defined()) {
      a.value = args[i].toTensor();
    } else {
      return typed;
    }
    operands.push_back(std::move(a));
  }
  c10::Scalar scalar;
  int scalar_slot = -1;
  if (prepared->has_scalar) {
    if (slot_of[num_inputs] >= 0) {
      scalar_slot = slot_of[num_inputs];
    } else {
      if (!args[num_inputs].isScalar()) return typed;
      scalar = args[num_inputs].toScalar();
      if (!PreparableScalar(scalar)) return typed;
      if (prepared->negate_scalar) scalar = -scalar;
    }
  }
  return std::make_unique<PreparedPointwise>(*prepared, std::move(operands), std::move(scalar),
                                             scalar_slot, std::move(typed));
}
#else
std::unique_ptr<TypedCall> MakePrepared(const c10::OperatorHandle&, const Slots&,
                                        const std::vector<int>&, std::unique_ptr<TypedCall> typed) {
  return typed;
}
std::unique_ptr<TypedCall> MakeFlashAttention(const Slots&, const std::vector<int>&) { return nullptr; }
std::unique_ptr<TypedCall> MakeLayerNorm(const Slots&, const std::vector<int>&) { return nullptr; }
#endif  // TORCHREPLAY_PREPARED_STEPS

}  // namespace torchreplay::capture::tape
