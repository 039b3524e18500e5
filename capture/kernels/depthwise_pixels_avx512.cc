// The direct depthwise convolution's channels-last walk (depthwise_pixels_impl.h) compiled with
// AVX-512: 16 channels a vector. Called by depthwise_kernel_avx2.cc where ATen runs its AVX512
// kernels.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "capture/kernels/depthwise_kernel.h"

#if defined(__AVX512F__) && defined(__FMA__)
#include <immintrin.h>
#include <sleef.h>

namespace torchreplay::capture::kernels::depthwise::avx512 {
namespace {

#include "capture/kernels/simd_ops.h"

// GCC 12 warns that _mm512_max_ps's and _mm512_min_ps's own placeholder operand
// (_mm512_undefined_ps) may be used uninitialized once they are inlined here: not so.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include "capture/kernels/depthwise_pixels_impl.h"
#pragma GCC diagnostic pop

}  // namespace

void RunPixels(const Params& p) { Pixels(p); }

}  // namespace torchreplay::capture::kernels::depthwise::avx512

#endif
