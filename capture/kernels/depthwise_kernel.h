// capture/kernels/depthwise_kernel.h: a direct depthwise convolution (one filter per channel), float32,
// compiled with ATen's AVX2 flags (depthwise_kernel_avx2.cc; its channels-last walk also with
// AVX-512, depthwise_pixels_avx512.cc), for the checked convolutions of the
// CPU tape (Note [Checked convolutions] in capture/tape/checked/conv_steps.h) and numerics "close".
//
// Note [Depthwise convolutions]
// Each output element is one chain of fused multiply-adds over the filter's taps, in the order
// of the filter's rows, then columns, taps that fall in the padding skipped (not multiplied by
// zero), starting from the bias (`bias_first`) or from +0 with the bias added last. That is how
// oneDNN's depthwise kernels accumulate, as far as their results tell: which of the two orders
// gives eager's bits, if either, the checked convolutions measure per node. The vector and scalar
// paths compute every element with the same operations (an FMA is correctly rounded), so where
// rows are cut and how the work is split over threads changes no bit; every tap is the same
// instruction with its operands in the same places, input then weight (Fma in simd_ops.h), so
// that where an input NaN meets a weight NaN every walk keeps the input's payload (as eager's
// oneDNN kernel did on the CPU we looked at; the FMA's NaN rules are the CPU's).
// Channels-last tensors are walked channel-vectorized, others along the output row.
#pragma once

#include <cstdint>

#include "capture/kernels/post_op.h"

namespace torchreplay::capture::kernels::depthwise {

struct Params {
  const float* x = nullptr;        // input, [N, C, H, W] by the strides below
  const float* w = nullptr;        // filters, [C, KH, KW] contiguous
  const float* w_hwc = nullptr;    // the same as [KH, KW, C] contiguous (channels-last walks)
  const float* bias = nullptr;     // [C] or null
  float* y = nullptr;              // output, [N, C, OH, OW] by the strides below
  int64_t n = 0, c = 0, h = 0, w_ = 0, oh = 0, ow = 0, kh = 0, kw = 0;
  int64_t stride[2] = {1, 1}, padding[2] = {0, 0}, dilation[2] = {1, 1};
  int64_t xs[4] = {0, 0, 0, 0}, ys[4] = {0, 0, 0, 0};  // element strides of n, c, h, w
  bool bias_first = true;
  PostOp post = PostOp::kNone;
};

// Whether this CPU runs the kernel (AVX2 and FMA).
bool Available();

// y = depthwise convolution of x (Note [Depthwise convolutions]), over torch's intra-op threads.
void Run(const Params& p);

}  // namespace torchreplay::capture::kernels::depthwise
