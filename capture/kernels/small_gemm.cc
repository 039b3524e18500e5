// The small GEMM's entry points (small_gemm.h): the copy compiled for ATen's CPU capability, as
// the fused kernel picks its own (capture/tape/fused/fused_kernels.cc).
#include "capture/kernels/small_gemm.h"

#include <c10/util/Exception.h>

#include "capture/kernels/cpu_features.h"

namespace torchreplay::capture::kernels::small_gemm {
namespace avx2 {
void Run(const Params& p);  // small_gemm_avx2.cc
}  // namespace avx2
namespace avx512 {
void Run(const Params& p);  // small_gemm_avx512.cc
}  // namespace avx512

void Run(const Params& p) { RunWith(AtenAvx512() ? Isa::kAvx512 : Isa::kAvx2, p); }

void RunWith(Isa isa, const Params& p) {
  TORCH_CHECK(p.m >= 0 && p.k >= 0 && p.n >= 0 && p.panel >= 0 && p.panel % 8 == 0,
              "torchreplay: the small GEMM got a negative size or a panel width not a multiple of 8");
  TORCH_CHECK(isa == Isa::kAvx512 ? AtenAvx512() : HasAvx2AndFma(), "torchreplay: the small GEMM's ",
              isa == Isa::kAvx512 ? "AVX-512 copy needs ATen running its AVX512 kernels"
                                  : "copy needs AVX2 and FMA");
#if defined(__x86_64__)
  isa == Isa::kAvx512 ? avx512::Run(p) : avx2::Run(p);
#endif
}

}  // namespace torchreplay::capture::kernels::small_gemm
