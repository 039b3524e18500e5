// The small GEMM (Note [Small GEMMs] in small_gemm.h), compiled with AVX2 and FMA; called only
// where small_gemm::Available().
#include "tape/small_gemm.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace torchreplay::capture::small_gemm {
namespace {

constexpr int kLanes = 8;
constexpr int kMaxRows = 4;
// Vectors of columns per tile for a tile of MR rows: at most 12 sums in registers, and 8 chains
// for a single row, enough to keep both FMA pipes busy through the FMA's latency.
template <int MR>
constexpr int kVectors = MR == 1 ? 8 : MR == 2 ? 6 : MR == 3 ? 4 : 3;

// Rows [r0, r0 + MR) by columns [c0, c0 + NV * 8).
template <int MR, int NV>
inline void Tile(const Params& p, int64_t r0, int64_t c0) {
  __m256 acc[MR][NV];
  for (int v = 0; v < NV; ++v) {
    const __m256 b = p.bias != nullptr ? _mm256_loadu_ps(p.bias + c0 + v * kLanes) : _mm256_setzero_ps();
    for (int r = 0; r < MR; ++r) acc[r][v] = b;
  }
  const float* x = p.x + r0 * p.x_row;
  const float* w = p.w + c0;
  for (int64_t k = 0; k < p.k; ++k, w += p.n) {
    __m256 wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = _mm256_loadu_ps(w + v * kLanes);
    for (int r = 0; r < MR; ++r) {
      const __m256 xr = _mm256_broadcast_ss(x + r * p.x_row + k);
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm256_fmadd_ps(xr, wv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    float* y = p.y + (r0 + r) * p.y_row + c0;
    for (int v = 0; v < NV; ++v) {
      // max(0, NaN) is NaN: the second operand is returned where either is NaN, as torch.relu keeps it
      const __m256 out = p.post == PostOp::kRelu ? _mm256_max_ps(_mm256_setzero_ps(), acc[r][v]) : acc[r][v];
      _mm256_storeu_ps(y + v * kLanes, out);
    }
  }
}

// The last vectors of a row block, fewer than a whole tile: a tile of exactly that many.
template <int MR, int NV>
inline void Rest(const Params& p, int64_t r0, int64_t c0, int64_t vectors) {
  if constexpr (NV > 0) {
    if (vectors == NV) return Tile<MR, NV>(p, r0, c0);
    Rest<MR, NV - 1>(p, r0, c0, vectors);
  }
}

// Rows [r0, r0 + MR) by the column vectors [v0, v1).
template <int MR>
void Block(const Params& p, int64_t r0, int64_t v0, int64_t v1) {
  constexpr int NV = kVectors<MR>;
  int64_t v = v0;
  for (; v + NV <= v1; v += NV) Tile<MR, NV>(p, r0, v * kLanes);
  Rest<MR, NV - 1>(p, r0, v * kLanes, v1 - v);
}

void Rows(const Params& p, int64_t v0, int64_t v1) {
  int64_t r = 0;
  for (; r + kMaxRows <= p.m; r += kMaxRows) Block<kMaxRows>(p, r, v0, v1);
  switch (p.m - r) {
    case 3: return Block<3>(p, r, v0, v1);
    case 2: return Block<2>(p, r, v0, v1);
    case 1: return Block<1>(p, r, v0, v1);
    default: return;
  }
}

}  // namespace

void Run(const Params& p) {
  TORCH_CHECK(p.m >= 0 && p.k >= 0 && p.n >= 0, "torchreplay: the small GEMM got a negative size");
  const int64_t vectors = p.n / kLanes;
  // Each task at least ~32k multiply-adds, so that small products run inline, on no thread.
  const int64_t grain = std::max<int64_t>(kVectors<1>, 32768 / std::max<int64_t>(p.m * p.k * kLanes, 1));
  at::parallel_for(0, vectors, grain, [&](int64_t v0, int64_t v1) { Rows(p, v0, v1); });
  // The last n % 8 columns: the same chain per element, as scalars (an FMA is correctly rounded).
  for (int64_t r = 0; r < p.m; ++r) {
    for (int64_t c = vectors * kLanes; c < p.n; ++c) {
      float acc = p.bias != nullptr ? p.bias[c] : 0.f;
      for (int64_t k = 0; k < p.k; ++k) acc = std::fma(p.x[r * p.x_row + k], p.w[k * p.n + c], acc);
      p.y[r * p.y_row + c] = p.post == PostOp::kRelu ? std::max(acc, 0.f) : acc;
    }
  }
}

}  // namespace torchreplay::capture::small_gemm

#else  // no AVX2: Available() is false, and nothing calls Run

namespace torchreplay::capture::small_gemm {
void Run(const Params&) { TORCH_CHECK(false, "torchreplay: the small GEMM needs AVX2 and FMA"); }
}  // namespace torchreplay::capture::small_gemm

#endif
