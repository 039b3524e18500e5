// tape/kernel_check.h: what the recording run's checks of faster kernels share (Note [Checked
// convolutions] in conv_steps.h, Note [Checked GEMMs] in gemm_steps.h): inputs made from a private
// seed, a comparison of bits, buffers of a recorded geometry, and the timing of candidates.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <string>
#include <vector>

#include "ir/recording.h"

namespace torchreplay::capture {

// An input of `like`'s geometry (sizes and strides) made from a private seed: normal values
// scaled by powers of two from 2^-20 to 2^20, signed zeros and subnormals; with `nonfinite`,
// infinities and NaNs of two payloads at a few places too (few enough that most outputs stay
// finite). Floating dtypes only.
at::Tensor Synthetic(const at::Tensor& like, bool nonfinite);

// Whether a and b have the same sizes and the same bits, element by element (4- and 8-byte
// dtypes; false for others).
bool SameBits(const at::Tensor& a, const at::Tensor& b);

// A buffer of a result's recorded geometry whose storage cannot grow (so that a kernel that
// resizes its output raises instead).
at::Tensor FixedBuffer(const ValueRecord& r);

// The least time in microseconds of each of `fns` over a few rounds, each round running every one
// once (so that a burst of load on a shared machine slows all of them, not one), stopping after
// ~20 ms.
std::vector<double> MinMicros(const std::vector<std::function<void()>>& fns);

// "12.3 us", for the notes of a check.
std::string Us(double us);

}  // namespace torchreplay::capture
