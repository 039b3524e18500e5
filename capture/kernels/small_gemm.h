// capture/kernels/small_gemm.h: y = bias + x w for float32 matrices of few rows (a GEMV, a recurrent cell's
// projections, a batch-1 MLP), compiled for AVX2 and for AVX-512 (small_gemm_impl.h), for numerics
// "close" (Note [Close numerics] in python/torchreplay/close_numerics/__init__.py; the op is
// torchreplay::small_gemm, small_gemm_op.cc) and, where it gives eager's bits, the bitwise tape
// (Note [Checked GEMMs] in capture/tape/checked/gemm_steps.h).
//
// Note [Small GEMMs]
// A library GEMM spends more on its set-up than on the arithmetic of a few rows: MKL takes about
// 3 us for a [1, 64] x [64, 192] product on this project's CPUs, whose 12k multiply-adds take a
// tenth of that. This kernel has no set-up: the weight is stored [K, N] once, at capture, and each
// tile of a few rows by a few vectors of columns keeps its sums in registers over the whole K
// (up to 4 rows by 64 columns with AVX2's 16 registers, up to 8 rows with AVX-512's 32). Each
// output element is one chain of fused multiply-adds over k in order, starting from the bias (or
// +0, the bias added after the chain with Params::bias_last): vector and scalar columns compute it
// alike, with the FMA's operands in the same places (Fma in simd_ops.h: where an input NaN meets a
// weight NaN, the input's is kept), so no bit depends on the tiling or on how the columns are split
// over torch's intra-op threads. MKL sums in that order for some shapes and in others elsewhere: so numerics "close"
// uses it where it timed faster than the addmm it replaces, and the bitwise tape only where a
// check at capture found eager's bits.
#pragma once

#include <cstdint>

#include "capture/kernels/post_op.h"

namespace torchreplay::capture::kernels::small_gemm {



struct Params {
  const float* x = nullptr;     // [m, k], row r at x + r * x_row, elements contiguous
  // or null, with column k of x at x_cols[k] instead, its element of row r at
  // x_cols[k] + (x_cols_from + r) * x_row (an indirect GEMM whose rows are a convolution's output
  // pixels: each tap read where it lies in the input, the output channels-last)
  const float* const* x_cols = nullptr;
  int64_t x_cols_from = 0;
  const float* w = nullptr;     // [k, n] contiguous
  // or null, with row k of w at w_rows[k] instead (an indirect GEMM: a convolution's taps read
  // from the input where they lie, Note [Small GEMMs])
  const float* const* w_rows = nullptr;
  int64_t w_row = 0;  // w's row stride, if not n
  // If not 0, w is packed in panels of this many columns (a multiple of 8): the panel of columns
  // [c, c + panel) is [k, panel] contiguous at w + c * k (the last one zero-padded), so that a
  // tile walks its weight sequentially down k (a GEMV streaming a weight from memory).
  int64_t panel = 0;
  const float* bias = nullptr;      // [n] or null: each column's sums start from it
  bool bias_last = false;           // or, if set, start from +0 and bias + sum after the last k
  const float* row_bias = nullptr;  // [m] or null: each row's sums start from it (not with bias)
  // [k] or null: x's column k multiplied by x_scale[k] first, each product rounded (x * scale, then
  // the product by w: a per-channel scale of a 1x1 convolution's input, squeeze-and-excitation's,
  // in the call); rows of x read as they are (not with x_cols)
  const float* x_scale = nullptr;
  float* y = nullptr;           // [m, n], row r at y + r * y_row, elements contiguous
  int64_t x_row = 0, y_row = 0, m = 0, k = 0, n = 0;
  PostOp post = PostOp::kNone;
};

// Whether this CPU runs the kernel (AVX2 and FMA).
bool Available();

// y = post(bias + x w) (Note [Small GEMMs]), the columns over torch's intra-op threads; the sums
// start from bias, row_bias or +0 (bias_last: from +0, then + bias). The copy compiled for
// AVX-512 where ATen runs its AVX512 kernels, else the one for AVX2.
void Run(const Params& p);

// The same with the copy for `isa`, which must be one the CPU runs (for comparing the two: they
// give the same bits).
enum class Isa : uint8_t { kAvx2, kAvx512 };
void RunWith(Isa isa, const Params& p);

}  // namespace torchreplay::capture::kernels::small_gemm
