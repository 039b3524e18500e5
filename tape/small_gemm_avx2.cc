// The small GEMM (Note [Small GEMMs] in small_gemm.h) compiled with AVX2 and FMA: 8 floats a
// vector, 16 registers. Called only where small_gemm::Available().
#include "tape/small_gemm.h"

#include <ATen/Parallel.h>

#include <algorithm>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace torchreplay::capture::small_gemm::avx2 {
namespace {

using V = __m256;
using Mask = __m256i;
constexpr int kLanes = 8;
constexpr int kMaxRows = 4;
// At most 12 sums in registers, and 8 chains for a single row, enough to keep both FMA pipes busy
// through the FMA's latency.
template <int MR>
constexpr int kVectors = MR == 1 ? 8 : MR == 2 ? 6 : MR == 3 ? 4 : 3;

inline V Zero() { return _mm256_setzero_ps(); }
inline V Load(const float* p) { return _mm256_loadu_ps(p); }
inline V Broadcast(const float* p) { return _mm256_broadcast_ss(p); }
inline V Fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
// bias + sum where both may be NaN: the bias's NaN (quieted), as MKL's C + A B keeps C's. Not
// _mm256_add_ps(bias, sum) alone: the compiler takes addition as commutative and may swap the
// operands, and addps keeps its first operand's NaN.
inline V AddBias(V bias, V sum) {
  const V nan = _mm256_cmp_ps(bias, bias, _CMP_UNORD_Q);
  return _mm256_blendv_ps(_mm256_add_ps(bias, sum), _mm256_add_ps(bias, bias), nan);
}
// max(0, NaN) is NaN (maxps returns its second operand where either is NaN), as torch.relu keeps it
inline V Relu(V v) { return _mm256_max_ps(_mm256_setzero_ps(), v); }
inline void Store(float* p, V v) { _mm256_storeu_ps(p, v); }
inline Mask TailMask(int left) {
  alignas(32) int32_t lanes[kLanes];
  for (int i = 0; i < kLanes; ++i) lanes[i] = i < left ? -1 : 0;
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(lanes));
}
inline V MaskLoad(const float* p, Mask m) { return _mm256_maskload_ps(p, m); }
inline void MaskStore(float* p, Mask m, V v) { _mm256_maskstore_ps(p, m, v); }

#include "tape/small_gemm_impl.h"

}  // namespace

void Run(const Params& p) { Gemm(p); }

}  // namespace torchreplay::capture::small_gemm::avx2

#endif
