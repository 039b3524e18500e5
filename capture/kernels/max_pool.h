// capture/kernels/max_pool.h: max pooling of float32 planes (NCHW, CHW), eager's results, values
// and indices, bit for bit, several times faster than eager's kernel for planes.
//
// Note [Max pooling]
// Eager's max_pool2d over a contiguous (not channels-last) float tensor runs cpu_max_pool
// (aten/src/ATen/native/cpu/MaxPoolKernel.cpp): one scalar loop per output element, over its
// window row by row, taking an element where `val > maxval || isnan(val)`, from maxval = -inf and
// the window's first element's index. On squeezenet's 96x109x109 map that takes 9 ms on one of
// this project's cores, more than all its convolutions' time at two threads.
// This kernel walks the same windows in the same order with the same rule, for a vector of
// neighbouring output columns at once (one lane each): a lane takes an element where it is
// greater than the lane's maximum or NaN, as eager's loop does, so each output gets eager's value
// (the last NaN of its window, else its first greatest element: -0 or +0 as eager finds them)
// and eager's index. Columns whose window leaves the row (padding, ceil_mode), the columns left
// after the last whole vector, and strides other than 1 and 2 take the scalar loop, eager's own.
// No bit depends on the instruction set or on how the planes are shared over threads: every
// output is computed alone.
#pragma once

#include <cstdint>

namespace torchreplay::capture::kernels::max_pool {

// `planes` planes of in_h x in_w contiguous floats, each pooled to out_h x out_w (values to
// `out`, the index of each within its plane to `indices` unless it is null, both contiguous). The window geometry is
// max_pool2d's: kernel, stride, padding and dilation per dimension, all valid for these sizes.
struct Params {
  const float* in = nullptr;
  float* out = nullptr;
  int64_t* indices = nullptr;
  int64_t planes = 0, in_h = 0, in_w = 0, out_h = 0, out_w = 0;
  int64_t kernel_h = 1, kernel_w = 1, stride_h = 1, stride_w = 1, pad_h = 0, pad_w = 0, dilation_h = 1,
          dilation_w = 1;
};

// Whether this CPU runs the kernel (AVX2 and FMA).
bool Available();

// Pools on torch's intra-op threads. Requires Available() and in_h * in_w < 2^31.
void Run(const Params& p);

}  // namespace torchreplay::capture::kernels::max_pool
