// The small GEMM (Note [Small GEMMs] in small_gemm.h) compiled with AVX2 and FMA: 8 floats a
// vector, 16 registers. Called only where small_gemm::Available().
#include "capture/kernels/small_gemm.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include <sleef.h>

namespace torchreplay::capture::kernels::small_gemm::avx2 {
namespace {

#include "capture/kernels/simd_ops.h"

constexpr int kMaxRows = 4;
// At most 12 sums in registers, and 8 chains for a single row, enough to keep both FMA pipes busy
// through the FMA's latency.
template <int MR>
constexpr int kVectors = MR == 1 ? 8 : MR == 2 ? 6 : MR == 3 ? 4 : 3;

// bias + sum where both may be NaN: the bias's NaN (quieted), as MKL's C + A B keeps C's. Not
// _mm256_add_ps(bias, sum) alone: the compiler takes addition as commutative and may swap the
// operands, and addps keeps its first operand's NaN.
inline V AddBias(V bias, V sum) {
  const V nan = _mm256_cmp_ps(bias, bias, _CMP_UNORD_Q);
  return _mm256_blendv_ps(_mm256_add_ps(bias, sum), _mm256_add_ps(bias, bias), nan);
}

#include "capture/kernels/small_gemm_impl.h"

}  // namespace

void Run(const Params& p) { Gemm(p); }

}  // namespace torchreplay::capture::kernels::small_gemm::avx2

#endif
