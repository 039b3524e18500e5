// The small GEMM (Note [Small GEMMs] in small_gemm.h) compiled with AVX-512: 16 floats a vector,
// 32 registers, so tiles of up to 8 rows. Called where ATen runs its AVX512 kernels.
#include "capture/kernels/small_gemm.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#if defined(__AVX512F__) && defined(__FMA__)
#include <immintrin.h>
#include <sleef.h>

namespace torchreplay::capture::kernels::small_gemm::avx512 {
namespace {

#include "capture/kernels/simd_ops.h"

constexpr int kMaxRows = 8;
// The sums, the weight vectors and one broadcast in the 32 registers (at most 31), at most 24 sums,
// and 8 chains for a single row.
template <int MR>
constexpr int kVectors = MR <= 2 ? 8 : MR == 3 ? 7 : MR == 4 ? 6 : MR == 5 ? 5 : MR == 6 ? 4 : 3;

// bias + sum, the bias's NaN (quieted) where it is NaN: as small_gemm_avx2.cc's AddBias
inline V AddBias(V bias, V sum) {
  const Mask nan = _mm512_cmp_ps_mask(bias, bias, _CMP_UNORD_Q);
  return _mm512_mask_blend_ps(nan, _mm512_add_ps(bias, sum), _mm512_add_ps(bias, bias));
}

#include "capture/kernels/small_gemm_impl.h"

}  // namespace

void Run(const Params& p) { Gemm(p); }

}  // namespace torchreplay::capture::kernels::small_gemm::avx512

#endif
