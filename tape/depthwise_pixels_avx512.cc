// The direct depthwise convolution's channels-last walk (depthwise_pixels_impl.h) compiled with
// AVX-512: 16 channels a vector. Called by depthwise_kernel_avx2.cc where ATen runs its AVX512
// kernels.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

#include "tape/depthwise_kernel.h"

#if defined(__AVX512F__) && defined(__FMA__)
#include <immintrin.h>

namespace torchreplay::capture::depthwise::avx512 {
namespace {

#include "tape/simd_ops.h"
// as depthwise_kernel_avx2.cc's PostOf, operand for operand
inline V PostOf(V v, PostOp post) {
  switch (post) {
    case PostOp::kNone: return v;
    case PostOp::kRelu: return _mm512_max_ps(_mm512_setzero_ps(), v);  // v where v is NaN, as torch.relu
    case PostOp::kHardswish: {
      const V r = _mm512_min_ps(_mm512_max_ps(_mm512_add_ps(v, _mm512_set1_ps(3.f)), _mm512_setzero_ps()),
                                _mm512_set1_ps(6.f));
      return _mm512_div_ps(_mm512_mul_ps(v, r), _mm512_set1_ps(6.f));
    }
  }
  return v;
}

#include "tape/depthwise_pixels_impl.h"

}  // namespace

void RunPixels(const Params& p) { Pixels(p); }

}  // namespace torchreplay::capture::depthwise::avx512

#endif
