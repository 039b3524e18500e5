// capture/kernels/post_op.h: the pointwise op a kernel of numerics "close" applies to each result before
// storing it (the small GEMM and conv_gemm, small_gemm.h; the depthwise convolution,
// depthwise_kernel.h), by the name its op's schema takes (`str post_op`). Each instruction set's
// vector form is simd_ops.h's PostOf, with eager's arithmetic: relu keeps NaN, hardswish is
// x * min(max(x + 3, 0), 6) / 6, hardsigmoid min(max(x + 3, 0), 6) / 6 and silu x / (1 + exp(-x))
// with Sleef's exp, as ATen's vectorized kernels compute them (NaN where eager's is; ATen's makes
// its NaNs all ones, PostOf keeps x's payload).
#pragma once
#include <c10/util/Exception.h>
#include <c10/util/string_view.h>

#include <cstdint>

namespace torchreplay::capture::kernels {

enum class PostOp : uint8_t { kNone, kRelu, kHardswish, kHardsigmoid, kSilu };

// The post-op named "none", "relu", "hardswish", "hardsigmoid" or "silu"; any other name raises,
// naming `op`.
inline PostOp PostOpOf(c10::string_view name, const char* op) {
  if (name == "none") return PostOp::kNone;
  if (name == "relu") return PostOp::kRelu;
  if (name == "hardswish") return PostOp::kHardswish;
  if (name == "hardsigmoid") return PostOp::kHardsigmoid;
  if (name == "silu") return PostOp::kSilu;
  TORCH_CHECK(false, op, ": post_op is \"none\", \"relu\", \"hardswish\", \"hardsigmoid\" or \"silu\", not \"", name,
              "\"");
}

}  // namespace torchreplay::capture::kernels
