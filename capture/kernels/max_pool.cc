// Max pooling's entry points (max_pool.h): the copy for ATen's CPU capability, as the small GEMM
// picks its own (no bit depends on which: Note [Max pooling]).
#include "capture/kernels/max_pool.h"

#include <c10/util/Exception.h>

#include "capture/kernels/cpu_features.h"

namespace torchreplay::capture::kernels::max_pool {
namespace avx2 {
void Run(const Params& p);  // max_pool_avx2.cc
}  // namespace avx2
namespace avx512 {
void Run(const Params& p);  // max_pool_avx512.cc
}  // namespace avx512

bool Available() { return HasAvx2AndFma(); }

void Run(const Params& p) {
  TORCH_CHECK(Available(), "torchreplay: max pooling's kernel needs AVX2 and FMA");
  TORCH_CHECK(p.in_h * p.in_w < (int64_t{1} << 31), "torchreplay: max pooling's kernel takes planes of under 2^31 elements");
#if defined(__x86_64__)
  AtenAvx512() ? avx512::Run(p) : avx2::Run(p);
#endif
}

}  // namespace torchreplay::capture::kernels::max_pool
