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

using V = __m512;
using Mask = __mmask16;
constexpr int kLanes = 16;
inline V Zero() { return _mm512_setzero_ps(); }
inline V Load(const float* p) { return _mm512_loadu_ps(p); }
inline void Store(float* p, V v) { _mm512_storeu_ps(p, v); }
inline V Fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V Add(V a, V b) { return _mm512_add_ps(a, b); }
// as depthwise_kernel_avx2.cc's PostOf, operand for operand
inline V PostOf(V v, PostOp post) {
  switch (post) {
    case PostOp::kNone: return v;
    case PostOp::kRelu: return _mm512_max_ps(v, _mm512_setzero_ps());
    case PostOp::kHardswish: {
      const V r = _mm512_min_ps(_mm512_max_ps(_mm512_add_ps(v, _mm512_set1_ps(3.f)), _mm512_setzero_ps()),
                                _mm512_set1_ps(6.f));
      return _mm512_div_ps(_mm512_mul_ps(v, r), _mm512_set1_ps(6.f));
    }
  }
  return v;
}
inline Mask TailMask(int left) { return static_cast<Mask>((1u << left) - 1); }
inline V MaskLoad(const float* p, Mask m) { return _mm512_maskz_loadu_ps(m, p); }
inline void MaskStore(float* p, Mask m, V v) { _mm512_mask_storeu_ps(p, m, v); }

#include "tape/depthwise_pixels_impl.h"

}  // namespace

void RunPixels(const Params& p) { Pixels(p); }

}  // namespace torchreplay::capture::depthwise::avx512

#endif
