// torchreplay::depthwise_conv2d: the direct depthwise convolution (Note [Depthwise convolutions] in
// depthwise_kernel.h) as an op, with an activation fused, for graphs rewritten under numerics
// "close" (Note [Close numerics] in python/torchreplay/close_numerics/__init__.py). The functional op
// allocates its result in the input's memory format; its out= overload writes a planned buffer.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "capture/kernels/cpu_features.h"
#include "capture/kernels/depthwise_kernel.h"

namespace torchreplay::capture::kernels {
namespace {

// input [N, C, H, W]; weight [C, 1, KH, KW] and the same as weight_hwc [KH, KW, C], contiguous.
at::Tensor& DepthwiseOut(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& weight_hwc,
                         const std::optional<at::Tensor>& bias, at::IntArrayRef stride, at::IntArrayRef padding,
                         at::IntArrayRef dilation, c10::string_view post_op, at::Tensor& out) {
  TORCH_CHECK(depthwise::Available(), "torchreplay::depthwise_conv2d: this CPU has no AVX2 and FMA");
  TORCH_CHECK(input.dim() == 4 && weight.dim() == 4 && input.scalar_type() == c10::kFloat &&
                  weight.scalar_type() == c10::kFloat && weight.is_contiguous() && weight_hwc.is_contiguous() &&
                  weight.size(1) == 1 && weight.size(0) == input.size(1) && weight_hwc.dim() == 3 &&
                  weight_hwc.size(2) == input.size(1) && stride.size() == 2 && padding.size() == 2 &&
                  dilation.size() == 2,
              "torchreplay::depthwise_conv2d: a float32 [N, C, H, W] input, a contiguous [C, 1, KH, KW] weight and "
              "its [KH, KW, C] copy");
  const int64_t oh = (input.size(2) + 2 * padding[0] - dilation[0] * (weight.size(2) - 1) - 1) / stride[0] + 1;
  const int64_t ow = (input.size(3) + 2 * padding[1] - dilation[1] * (weight.size(3) - 1) - 1) / stride[1] + 1;
  TORCH_CHECK(oh > 0 && ow > 0, "torchreplay::depthwise_conv2d: an empty output");
  TORCH_CHECK(out.sizes() == at::IntArrayRef({input.size(0), input.size(1), oh, ow}) &&
                  out.scalar_type() == c10::kFloat,
              "torchreplay::depthwise_conv2d: out has other sizes or dtype than the result");
  at::Tensor b;
  depthwise::Params p;
  if (bias.has_value() && bias->defined()) {
    b = bias->contiguous();
    p.bias = b.const_data_ptr<float>();
  }
  p.x = input.const_data_ptr<float>();
  p.w = weight.const_data_ptr<float>();
  p.w_hwc = weight_hwc.const_data_ptr<float>();
  p.y = out.data_ptr<float>();
  p.n = input.size(0), p.c = input.size(1), p.h = input.size(2), p.w_ = input.size(3);
  p.oh = oh, p.ow = ow, p.kh = weight.size(2), p.kw = weight.size(3);
  for (int d = 0; d < 2; ++d) p.stride[d] = stride[d], p.padding[d] = padding[d], p.dilation[d] = dilation[d];
  for (int d = 0; d < 4; ++d) p.xs[d] = input.stride(d), p.ys[d] = out.stride(d);
  p.post = PostOpOf(post_op, "torchreplay::depthwise_conv2d");
  depthwise::Run(p);
  return out;
}

at::Tensor Depthwise(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& weight_hwc,
                     const std::optional<at::Tensor>& bias, at::IntArrayRef stride, at::IntArrayRef padding,
                     at::IntArrayRef dilation, c10::string_view post_op) {
  TORCH_CHECK(input.dim() == 4 && weight.dim() == 4 && stride.size() == 2 && padding.size() == 2 &&
                  dilation.size() == 2,
              "torchreplay::depthwise_conv2d: 4-d input and weight, 2-d stride, padding and dilation");
  const int64_t oh = (input.size(2) + 2 * padding[0] - dilation[0] * (weight.size(2) - 1) - 1) / stride[0] + 1;
  const int64_t ow = (input.size(3) + 2 * padding[1] - dilation[1] * (weight.size(3) - 1) - 1) / stride[1] + 1;
  at::Tensor out = at::empty({input.size(0), input.size(1), std::max<int64_t>(oh, 0), std::max<int64_t>(ow, 0)},
                             input.options().memory_format(input.suggest_memory_format()));
  return DepthwiseOut(input, weight, weight_hwc, bias, stride, padding, dilation, post_op, out);
}

}  // namespace

namespace depthwise {
bool Available() { return HasAvx2AndFma(); }
}  // namespace depthwise

TORCH_LIBRARY_IMPL(torchreplay, CPU, m) {
  m.impl("depthwise_conv2d", &Depthwise);
  m.impl("depthwise_conv2d.out", &DepthwiseOut);
}

}  // namespace torchreplay::capture::kernels
