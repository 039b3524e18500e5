// torchreplay::small_gemm: bias + input @ weight_kn, relu'd if asked, through the small GEMM (Note
// [Small GEMMs] in small_gemm.h), for graphs rewritten under numerics "close" (Note [Close
// numerics] in bindings/torchreplay/close_numerics.py). The functional op allocates its result;
// its out= overload writes a planned buffer, and its signature is one the tape calls unboxed
// (Note [Typed steps]): a product without bias gets a bias of zeros (the sums start from +0
// either way).
#include <ATen/ATen.h>
#include <torch/library.h>

#include "tape/small_gemm.h"

namespace torchreplay::capture {
namespace {

constexpr const char* kName = "torchreplay::small_gemm";

// input [M, K]; weight_kn [K, N] contiguous; bias [N].
at::Tensor& SmallGemmOut(const at::Tensor& input, const at::Tensor& weight_kn, const at::Tensor& bias, bool relu,
                         at::Tensor& out) {
  TORCH_CHECK(small_gemm::Available(), kName, ": this CPU has no AVX2 and FMA");
  TORCH_CHECK(input.dim() == 2 && weight_kn.dim() == 2 && input.scalar_type() == c10::kFloat &&
                  weight_kn.scalar_type() == c10::kFloat && weight_kn.is_contiguous() &&
                  input.size(1) == weight_kn.size(0) && input.device().is_cpu() && weight_kn.device().is_cpu(),
              kName, ": a float32 [M, K] input and a contiguous float32 [K, N] weight on the CPU, not ",
              input.sizes(), " ", input.scalar_type(), " and ", weight_kn.sizes(), " ", weight_kn.scalar_type());
  const int64_t m = input.size(0), k = input.size(1), n = weight_kn.size(1);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == m && out.size(1) == n && out.scalar_type() == c10::kFloat &&
                  (n <= 1 || out.stride(1) == 1),
              kName, ": out is [", m, ", ", n, "] float32 with contiguous rows, not ", out.sizes(), " ",
              out.scalar_type());
  small_gemm::Params p;
  TORCH_CHECK(bias.dim() == 1 && bias.size(0) == n && bias.scalar_type() == c10::kFloat && bias.device().is_cpu(),
              kName, ": bias is float32 [", n, "], not ", bias.sizes(), " ", bias.scalar_type());
  const at::Tensor b = bias.contiguous();
  at::Tensor x = input;
  p.bias = b.const_data_ptr<float>();
  if (k > 1 && x.stride(1) != 1) x = x.contiguous();
  p.x = x.const_data_ptr<float>(), p.x_row = x.stride(0);
  p.w = weight_kn.const_data_ptr<float>();
  p.y = out.data_ptr<float>(), p.y_row = out.stride(0);
  p.m = m, p.k = k, p.n = n;
  p.post = relu ? small_gemm::PostOp::kRelu : small_gemm::PostOp::kNone;
  small_gemm::Run(p);
  return out;
}

at::Tensor SmallGemm(const at::Tensor& input, const at::Tensor& weight_kn, const at::Tensor& bias, bool relu) {
  TORCH_CHECK(input.dim() == 2 && weight_kn.dim() == 2, kName, ": a 2-d input and weight, not ", input.sizes(),
              " and ", weight_kn.sizes());
  at::Tensor out = at::empty({input.size(0), weight_kn.size(1)}, input.options());
  return SmallGemmOut(input, weight_kn, bias, relu, out);
}

}  // namespace

namespace small_gemm {
bool Available() {
#if defined(__x86_64__)
  static const bool available = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return available;
#else
  return false;
#endif
}
}  // namespace small_gemm

TORCH_LIBRARY_FRAGMENT(torchreplay, m) {
  m.def("small_gemm(Tensor input, Tensor weight_kn, Tensor bias, bool relu) -> Tensor");
  m.def("small_gemm.out(Tensor input, Tensor weight_kn, Tensor bias, bool relu, *, Tensor(a!) out) -> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(torchreplay, CPU, m) {
  m.impl("small_gemm", &SmallGemm);
  m.impl("small_gemm.out", &SmallGemmOut);
}

}  // namespace torchreplay::capture
