// Max pooling (Note [Max pooling] in max_pool.h) compiled with AVX-512: 16 columns a vector.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "capture/kernels/max_pool.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#include <sleef.h>

#include "capture/kernels/post_op.h"

namespace torchreplay::capture::kernels::max_pool::avx512 {
namespace {

#include "capture/kernels/simd_ops.h"
#include "capture/kernels/max_pool_impl.h"

}  // namespace

void Run(const Params& p) { Pool(p); }

}  // namespace torchreplay::capture::kernels::max_pool::avx512

#endif
