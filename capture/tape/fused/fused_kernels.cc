// The fused kernel's entry points (fused_kernels.h): each runs the copy compiled for ATen's CPU
// capability (fused_kernels_impl.h), as ATen's DispatchStub picks its own kernels; and the two
// ops of an inference batch norm the tape fuses (Note [Batch norm as a channel affine]).
#include "capture/tape/fused/fused_kernels.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/_native_batch_norm_legit_no_training.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <tuple>

#include "capture/kernels/cpu_features.h"

namespace torchreplay::capture::tape::fused {
namespace avx2 {
bool Prepare(Program* program);
bool RunSegment(const Program& program, int segment, char* const* base, char* scratch);
void Restore(const Program& program, int segment, char* const* base, char* scratch);
bool MklAvailable();
bool ChannelAffine(float* out, const float* x, const float* alpha, const float* beta, int64_t numel, int64_t inner,
                   int64_t channels);
}  // namespace avx2
namespace avx512 {
bool Prepare(Program* program);
bool RunSegment(const Program& program, int segment, char* const* base, char* scratch);
void Restore(const Program& program, int segment, char* const* base, char* scratch);
bool MklAvailable();
bool ChannelAffine(float* out, const float* x, const float* alpha, const float* beta, int64_t numel, int64_t inner,
                   int64_t channels);
}  // namespace avx512

bool FusionAvailable() {
  static const bool available = [] {
    const std::string capability = at::get_cpu_capability();
    return capability == "AVX2" || capability == "AVX512";
  }();
  return available;
}

bool Prepare(Program* program) { return kernels::AtenAvx512() ? avx512::Prepare(program) : avx2::Prepare(program); }
bool RunSegment(const Program& program, int segment, char* const* base, char* scratch) {
  return kernels::AtenAvx512() ? avx512::RunSegment(program, segment, base, scratch)
                      : avx2::RunSegment(program, segment, base, scratch);
}
void Restore(const Program& program, int segment, char* const* base, char* scratch) {
  kernels::AtenAvx512() ? avx512::Restore(program, segment, base, scratch) : avx2::Restore(program, segment, base, scratch);
}
bool MklAvailable() { return avx2::MklAvailable(); }
bool ChannelAffine(float* out, const float* x, const float* alpha, const float* beta, int64_t numel, int64_t inner,
                   int64_t channels) {
  return kernels::AtenAvx512() ? avx512::ChannelAffine(out, x, alpha, beta, numel, inner, channels)
                               : avx2::ChannelAffine(out, x, alpha, beta, numel, inner, channels);
}

const char* OpName(Op op) {
  switch (op) {
    case Op::kNeg: return "neg";
    case Op::kAbs: return "abs";
    case Op::kRound: return "round";
    case Op::kReciprocal: return "reciprocal";
    case Op::kRsqrt: return "rsqrt";
    case Op::kSquare: return "pow 2";
    case Op::kCube: return "pow 3";
    case Op::kInverseSquare: return "pow -2";
    case Op::kClampMin: return "clamp_min";
    case Op::kClampMax: return "clamp_max";
    case Op::kClamp: return "clamp";
    case Op::kSigmoid: return "sigmoid";
    case Op::kSilu: return "silu";
    case Op::kExp2: return "exp2";
    case Op::kExp: return "exp";
    case Op::kLog: return "log";
    case Op::kSin: return "sin";
    case Op::kCos: return "cos";
    case Op::kTanh: return "tanh";
    case Op::kErf: return "erf";
    case Op::kSqrt: return "sqrt";
    case Op::kLog1p: return "log1p";
    case Op::kExpm1: return "expm1";
    case Op::kAdd: return "add";
    case Op::kMul: return "mul";
    case Op::kDiv: return "div";
    case Op::kMaximum: return "maximum";
    case Op::kLt: return "lt";
    case Op::kLe: return "le";
    case Op::kGt: return "gt";
    case Op::kGe: return "ge";
    case Op::kEq: return "eq";
    case Op::kNe: return "ne";
    case Op::kMaskedFill: return "masked_fill";
    case Op::kWhere: return "where";
    case Op::kPowScalarBase: return "pow scalar base";
    case Op::kAddcmul: return "addcmul";
    case Op::kAddcdiv: return "addcdiv";
    case Op::kChannelAffine: return "channel affine";
  }
  return "?";
}

// Note [Batch norm as a channel affine]
// Eager's batch norm in inference (`_native_batch_norm_legit_no_training` on a float32 map, dense
// NCHW or channels last, parameters dense and float32) computes per channel
//   alpha = (1 / sqrt(var + eps)) * weight,   beta = bias - mean * alpha
// and then out = x * alpha + beta per element (batch_norm_kernel.cpp), each rounded as float;
// ATen's AVX2 build contracts both `- mean * alpha` and `* alpha + beta` into one fma (checked on
// the machine before any graph is rewritten: torchreplay/batch_norms.py). A graph rewrite
// (python/torchreplay/batch_norms.py) makes such a node these two ops:
//   - torchreplay::batch_norm_terms: alpha and beta, computed per call as eager does (the
//     running statistics and the affine parameters can change between calls);
//   - torchreplay::channel_affine: fma(x, alpha[c], beta[c]) per element, which is eager's result
//     bit for bit (an fma rounds once, however it is computed). The fused elementwise step
//     computes it (Op::kChannelAffine) over the map in memory order, so that the activation after
//     a batch norm (silu, relu, a residual add) runs in the same pass instead of reading the map
//     again.
// The op's own kernel is the instruction's code over the whole tensor, so the tape's per-node
// calls and the fused step give the same bits. Where alpha or beta holds a NaN (a NaN weight,
// statistic or bias), which NaN eager's compiled fma keeps where it meets another in x depends on
// how the compiler laid out its loop (the plane loop keeps x's, the channels-last loop alpha's):
// the instruction then reports its segment inexact, the step runs the nodes' own calls, and the
// op computes that tensor with eager's kernel, whose arguments it takes for this. The same holds
// for parameters swapped after the capture for ones eager's dense kernel does not take (a strided
// view, another dtype or length: eager then computes ((x - mean) * invstd) * weight + bias, or
// raises): batch_norm_terms gives NaN terms for them. The result is laid out as eager lays out
// its own (empty_like(x, Contiguous or ChannelsLast as x is dense): x's memory order).
namespace {

int64_t ChannelRun(const at::Tensor& x) {
  const int64_t n = x.size(0), c = x.size(1);
  if (x.is_contiguous()) return n * c == 0 ? 1 : x.numel() / (n * c);
  TORCH_CHECK(x.is_contiguous(at::MemoryFormat::ChannelsLast) || x.is_contiguous(at::MemoryFormat::ChannelsLast3d),
              "torchreplay::channel_affine: x must be contiguous or channels last");
  return 1;
}

// The layout of eager's result on its dense path (batch_norm_cpu, suggest_memory_format_contig).
at::MemoryFormat EagerFormat(const at::Tensor& x) {
  return x.is_contiguous()                                 ? at::MemoryFormat::Contiguous
         : x.is_contiguous(at::MemoryFormat::ChannelsLast3d) ? at::MemoryFormat::ChannelsLast3d
                                                             : at::MemoryFormat::ChannelsLast;
}

// Whether `t` lays out `x`'s elements in the same memory order, densely: equal strides on every dim
// of more than one element (eager's result, empty_like(x, EagerFormat(x)), may give the others
// other strides).
bool SameDenseOrder(const at::Tensor& t, const at::Tensor& x) {
  if (t.sizes() != x.sizes() || !t.is_non_overlapping_and_dense()) return false;
  for (int64_t d = 0; d < x.dim(); ++d) {
    if (x.size(d) > 1 && t.stride(d) != x.stride(d)) return false;
  }
  return true;
}

// One float32 per channel of a map with `channels` channels, dense.
bool PerChannel(const at::Tensor& t, int64_t channels) {
  return t.scalar_type() == at::kFloat && t.dim() == 1 && t.numel() == channels && t.is_contiguous();
}

at::Tensor& ChannelAffineOut(const at::Tensor& x, const at::Tensor& alpha, const at::Tensor& beta,
                             const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                             const at::Tensor& mean, const at::Tensor& var, double eps, at::Tensor& out) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat && x.dim() >= 2,
              "torchreplay::channel_affine takes a float32 map");
  const int64_t inner = ChannelRun(x);
  if (!SameDenseOrder(out, x)) out.resize_(x.sizes(), EagerFormat(x));
  TORCH_CHECK(SameDenseOrder(out, x), "torchreplay::channel_affine: out must lay out x's elements as x does");
  // ATen's kernels of another capability than AVX2's or AVX512's (ATEN_CPU_CAPABILITY=default, as a
  // loaded program may run under) are not compiled with fmas: eager's kernel computes them
  const bool terms = FusionAvailable() && PerChannel(alpha, x.size(1)) && PerChannel(beta, x.size(1));
  if (x.numel() > 0 && (!terms || !ChannelAffine(out.data_ptr<float>(), x.const_data_ptr<float>(),
                                                 alpha.const_data_ptr<float>(), beta.const_data_ptr<float>(),
                                                 x.numel(), inner, x.size(1)))) {
    // NaN terms (batch_norm_terms' word for parameters eager's dense kernel does not take) or
    // other terms than one per channel: eager's kernel, its result or its error
    out.copy_(std::get<0>(at::_native_batch_norm_legit_no_training(x, weight, bias, mean, var, 0.0, eps)));
  }
  return out;
}

at::Tensor ChannelAffineOp(const at::Tensor& x, const at::Tensor& alpha, const at::Tensor& beta,
                           const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                           const at::Tensor& mean, const at::Tensor& var, double eps) {
  at::Tensor out = at::empty_like(x, EagerFormat(x));  // as eager's batch norm makes its result
  return ChannelAffineOut(x, alpha, beta, weight, bias, mean, var, eps, out);
}

std::tuple<at::Tensor&, at::Tensor&> BatchNormTermsOut(const std::optional<at::Tensor>& weight,
                                                       const std::optional<at::Tensor>& bias, const at::Tensor& mean,
                                                       const at::Tensor& var, double eps, at::Tensor& alpha,
                                                       at::Tensor& beta) {
  const int64_t c = mean.numel();
  alpha.resize_({c});
  beta.resize_({c});
  TORCH_CHECK(PerChannel(alpha, c) && PerChannel(beta, c), "torchreplay::batch_norm_terms: alpha and beta must be float32");
  const bool has_w = weight.has_value() && weight->defined(), has_b = bias.has_value() && bias->defined();
  if (!PerChannel(mean, c) || !PerChannel(var, c) || (has_w && !PerChannel(*weight, c)) ||
      (has_b && !PerChannel(*bias, c))) {
    // parameters eager's dense kernel does not take (batch_norm_cpu_transform_input_template then
    // computes another formula, or raises): NaN terms, on which channel_affine runs eager's kernel
    alpha.fill_(std::numeric_limits<float>::quiet_NaN());
    beta.fill_(std::numeric_limits<float>::quiet_NaN());
    return {alpha, beta};
  }
  const float* m = mean.const_data_ptr<float>();
  const float* v = var.const_data_ptr<float>();
  const float* w = has_w ? weight->const_data_ptr<float>() : nullptr;
  const float* b = has_b ? bias->const_data_ptr<float>() : nullptr;
  float* a = alpha.data_ptr<float>();
  float* o = beta.data_ptr<float>();
  for (int64_t i = 0; i < c; ++i) {  // batch_norm_cpu_collect_linear_and_constant_terms, not training
    const float invstd = 1 / std::sqrt(v[i] + static_cast<float>(eps));
    a[i] = invstd * (w != nullptr ? w[i] : 1.0f);
    o[i] = std::fma(-m[i], a[i], b != nullptr ? b[i] : 0.0f);
  }
  return {alpha, beta};
}

std::tuple<at::Tensor, at::Tensor> BatchNormTerms(const std::optional<at::Tensor>& weight,
                                                  const std::optional<at::Tensor>& bias, const at::Tensor& mean,
                                                  const at::Tensor& var, double eps) {
  at::Tensor alpha = at::empty({0}, mean.options().dtype(at::kFloat));
  at::Tensor beta = at::empty({0}, mean.options().dtype(at::kFloat));
  BatchNormTermsOut(weight, bias, mean, var, eps, alpha, beta);
  return {alpha, beta};
}

}  // namespace

TORCH_LIBRARY_IMPL(torchreplay, CPU, m) {
  m.impl("channel_affine", &ChannelAffineOp);
  m.impl("channel_affine.out", &ChannelAffineOut);
  m.impl("batch_norm_terms", &BatchNormTerms);
  m.impl("batch_norm_terms.out", &BatchNormTermsOut);
}

}  // namespace torchreplay::capture::tape::fused
