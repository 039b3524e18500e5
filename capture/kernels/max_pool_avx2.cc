// Max pooling (Note [Max pooling] in max_pool.h) compiled with AVX2 and FMA: 8 columns a vector.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <iterator>
#include <limits>

#include "capture/kernels/max_pool.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include <sleef.h>

#include "capture/kernels/post_op.h"

namespace torchreplay::capture::kernels::max_pool::avx2 {
namespace {

#include "capture/kernels/simd_ops.h"
#include "capture/kernels/max_pool_impl.h"

}  // namespace

void Run(const Params& p) { Pool(p); }

}  // namespace torchreplay::capture::kernels::max_pool::avx2

#endif
