// Max pooling (Note [Max pooling] in max_pool.h) compiled with AVX-512: 16 columns a vector.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <iterator>
#include <limits>

#include "capture/kernels/max_pool.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#include <sleef.h>

#include "capture/kernels/post_op.h"

namespace torchreplay::capture::kernels::max_pool::avx512 {
namespace {

#include "capture/kernels/simd_ops.h"

// GCC 12 warns that the placeholder operands of _mm512_castsi512_si256 and _mm512_cvtepi32_epi64
// (_mm256_undefined_*) may be used uninitialized once they are inlined here: not so (as
// depthwise_pixels_avx512.cc).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include "capture/kernels/max_pool_impl.h"
#pragma GCC diagnostic pop

}  // namespace

void Run(const Params& p) { Pool(p); }

}  // namespace torchreplay::capture::kernels::max_pool::avx512

#endif
