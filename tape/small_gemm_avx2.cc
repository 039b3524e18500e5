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

// bias + sum where both may be NaN: the bias's NaN (quieted), as MKL's C + A B keeps C's. Not
// _mm256_add_ps(bias, sum) alone: the compiler takes addition as commutative and may swap the
// operands, and addps keeps its first operand's NaN.
inline __m256 AddBias(__m256 bias, __m256 sum) {
  const __m256 nan = _mm256_cmp_ps(bias, bias, _CMP_UNORD_Q);
  return _mm256_blendv_ps(_mm256_add_ps(bias, sum), _mm256_add_ps(bias, bias), nan);
}
constexpr int kMaxRows = 4;
// Vectors of columns per tile for a tile of MR rows: at most 12 sums in registers, and 8 chains
// for a single row, enough to keep both FMA pipes busy through the FMA's latency.
template <int MR>
constexpr int kVectors = MR == 1 ? 8 : MR == 2 ? 6 : MR == 3 ? 4 : 3;

// Rows [r0, r0 + MR) by columns [c0, c0 + NV * 8), the sums in named registers a<row><vector>:
// with them in an array, GCC kept every sum in memory too, a store per FMA, at half the speed.
// The macros below expand over rows 0-3 and vectors 0-7; `if constexpr` drops what the tile has
// not.
#define TORCHREPLAY_VECTORS(M, r) M(r, 0) M(r, 1) M(r, 2) M(r, 3) M(r, 4) M(r, 5) M(r, 6) M(r, 7)
#define TORCHREPLAY_TILE(M) TORCHREPLAY_VECTORS(M, 0) TORCHREPLAY_VECTORS(M, 1) TORCHREPLAY_VECTORS(M, 2) \
  TORCHREPLAY_VECTORS(M, 3)
template <int MR, int NV>
inline void Tile(const Params& p, int64_t r0, int64_t c0) {
  static_assert(MR <= 4 && NV <= 8);
  const int64_t k_end = p.k, w_row = p.w_row > 0 ? p.w_row : p.n, x_row = p.x_row;
  const float* x = p.x + r0 * x_row;
  const float* const* rows = p.w_rows;
  const float* w = p.w + c0;
  const float* bias = p.bias != nullptr ? p.bias + c0 : nullptr;
#define DECLARE(r, v) __m256 a##r##v = _mm256_setzero_ps();
  TORCHREPLAY_TILE(DECLARE)
#undef DECLARE
  if (bias != nullptr && !p.bias_last) {
#define START(r, v) \
  if constexpr (r < MR && v < NV) a##r##v = _mm256_loadu_ps(bias + v * kLanes);
    TORCHREPLAY_TILE(START)
#undef START
  } else if (p.row_bias != nullptr) {
#define START(r, v) \
  if constexpr (r < MR && v < NV) a##r##v = _mm256_broadcast_ss(p.row_bias + r0 + r);
    TORCHREPLAY_TILE(START)
#undef START
  }
  for (int64_t k = 0; k < k_end; ++k) {
    const float* wk = rows != nullptr ? rows[k] + c0 : w + k * w_row;
    __m256 w0, w1, w2, w3, w4, w5, w6, w7;
#define LOAD_W(v) \
  if constexpr (v < NV) w##v = _mm256_loadu_ps(wk + v * kLanes);
    LOAD_W(0) LOAD_W(1) LOAD_W(2) LOAD_W(3) LOAD_W(4) LOAD_W(5) LOAD_W(6) LOAD_W(7)
#undef LOAD_W
    // row by row: each row's x[k] broadcast just before its multiply-adds, so that one is held at
    // a time beside the sums and the weight vectors (all of them at once spilled sums)
#define MULTIPLY_ADD_ROW(r)                                                         \
  if constexpr (r < MR) {                                                           \
    const __m256 xr = _mm256_broadcast_ss(x + r * x_row + k);                       \
    MULTIPLY_ADD(r, 0) MULTIPLY_ADD(r, 1) MULTIPLY_ADD(r, 2) MULTIPLY_ADD(r, 3)     \
    MULTIPLY_ADD(r, 4) MULTIPLY_ADD(r, 5) MULTIPLY_ADD(r, 6) MULTIPLY_ADD(r, 7)     \
  }
#define MULTIPLY_ADD(r, v) \
  if constexpr (v < NV) a##r##v = _mm256_fmadd_ps(xr, w##v, a##r##v);
    MULTIPLY_ADD_ROW(0) MULTIPLY_ADD_ROW(1) MULTIPLY_ADD_ROW(2) MULTIPLY_ADD_ROW(3)
#undef MULTIPLY_ADD
#undef MULTIPLY_ADD_ROW
  }
  if (bias != nullptr && p.bias_last) {  // the sum, then the bias (AddBias)
#define ADD_BIAS(r, v) \
  if constexpr (r < MR && v < NV) a##r##v = AddBias(_mm256_loadu_ps(bias + v * kLanes), a##r##v);
    TORCHREPLAY_TILE(ADD_BIAS)
#undef ADD_BIAS
  }
  // max(0, NaN) is NaN (the second operand is returned where either is NaN), as torch.relu keeps it
  const bool relu = p.post == PostOp::kRelu;
  float* y = p.y + r0 * p.y_row + c0;
#define STORE(r, v)                                                                                          \
  if constexpr (r < MR && v < NV)                                                                            \
    _mm256_storeu_ps(y + r * p.y_row + v * kLanes, relu ? _mm256_max_ps(_mm256_setzero_ps(), a##r##v) : a##r##v);
  TORCHREPLAY_TILE(STORE)
#undef STORE
}
#undef TORCHREPLAY_TILE
#undef TORCHREPLAY_VECTORS

// The last vectors of a row block, fewer than a whole tile: a tile of exactly that many.
template <int MR, int NV>
inline void Rest(const Params& p, int64_t r0, int64_t c0, int64_t vectors) {
  if constexpr (NV > 0) {
    if (vectors == NV) return Tile<MR, NV>(p, r0, c0);
    Rest<MR, NV - 1>(p, r0, c0, vectors);
  }
}

// Rows [r0, r0 + MR) by the last n % 8 columns, from c0: one vector, its lanes past n masked off.
template <int MR>
void TailTile(const Params& p, int64_t r0, int64_t c0, __m256i mask) {
  const int64_t k_end = p.k, w_row = p.w_row > 0 ? p.w_row : p.n, x_row = p.x_row;
  const float* x = p.x + r0 * x_row;
  const float* const* rows = p.w_rows;
  const float* w = p.w + c0;
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  if (p.bias != nullptr && !p.bias_last) {
    a0 = a1 = a2 = a3 = _mm256_maskload_ps(p.bias + c0, mask);
  } else if (p.row_bias != nullptr) {
#define START(r) \
  if constexpr (r < MR) a##r = _mm256_broadcast_ss(p.row_bias + r0 + r);
    START(0) START(1) START(2) START(3)
#undef START
  }
  for (int64_t k = 0; k < k_end; ++k) {
    const float* wk = rows != nullptr ? rows[k] + c0 : w + k * w_row;
    const __m256 wv = _mm256_maskload_ps(wk, mask);
#define MULTIPLY_ADD(r) \
  if constexpr (r < MR) a##r = _mm256_fmadd_ps(_mm256_broadcast_ss(x + r * x_row + k), wv, a##r);
    MULTIPLY_ADD(0) MULTIPLY_ADD(1) MULTIPLY_ADD(2) MULTIPLY_ADD(3)
#undef MULTIPLY_ADD
  }
  if (p.bias != nullptr && p.bias_last) {
    const __m256 b = _mm256_maskload_ps(p.bias + c0, mask);
    a0 = AddBias(b, a0), a1 = AddBias(b, a1), a2 = AddBias(b, a2), a3 = AddBias(b, a3);
  }
  const bool relu = p.post == PostOp::kRelu;
  float* y = p.y + r0 * p.y_row + c0;
#define STORE(r) \
  if constexpr (r < MR)  \
    _mm256_maskstore_ps(y + r * p.y_row, mask, relu ? _mm256_max_ps(_mm256_setzero_ps(), a##r) : a##r);
  STORE(0) STORE(1) STORE(2) STORE(3)
#undef STORE
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

// The last n % 8 columns of every row.
void TailRows(const Params& p) {
  const int64_t c0 = p.n / kLanes * kLanes, left = p.n - c0;
  if (left == 0) return;
  alignas(32) int32_t lanes[kLanes];
  for (int i = 0; i < kLanes; ++i) lanes[i] = i < left ? -1 : 0;
  const __m256i mask = _mm256_load_si256(reinterpret_cast<const __m256i*>(lanes));
  int64_t r = 0;
  for (; r + kMaxRows <= p.m; r += kMaxRows) TailTile<kMaxRows>(p, r, c0, mask);
  switch (p.m - r) {
    case 3: return TailTile<3>(p, r, c0, mask);
    case 2: return TailTile<2>(p, r, c0, mask);
    case 1: return TailTile<1>(p, r, c0, mask);
    default: return;
  }
}

}  // namespace

void Run(const Params& p) {
  TORCH_CHECK(p.m >= 0 && p.k >= 0 && p.n >= 0 && p.panel >= 0 && p.panel % kLanes == 0,
              "torchreplay: the small GEMM got a negative size or a panel width not a multiple of 8");
  if (p.panel > 0) {  // each panel a product of its own, its rows p.panel apart
    const int64_t panels = (p.n + p.panel - 1) / p.panel;
    const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(p.m * p.k * p.panel, 1));
    at::parallel_for(0, panels, grain, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        Params q = p;
        const int64_t c0 = i * p.panel;
        q.panel = 0, q.w = p.w + c0 * p.k, q.w_row = p.panel, q.n = std::min(p.panel, p.n - c0), q.y = p.y + c0;
        if (p.bias != nullptr) q.bias = p.bias + c0;
        Rows(q, 0, q.n / kLanes);
        TailRows(q);
      }
    });
    return;
  }
  const int64_t vectors = p.n / kLanes;
  if (p.m >= 4 * kMaxRows) {  // many rows (a 1x1 convolution's pixels): blocks of rows per task
    const int64_t blocks = (p.m + kMaxRows - 1) / kMaxRows;
    const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(kMaxRows * p.k * p.n, 1));
    at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
      Params q = p;
      const int64_t r0 = b0 * kMaxRows;
      q.m = std::min(p.m, b1 * kMaxRows) - r0, q.x = p.x + r0 * p.x_row, q.y = p.y + r0 * p.y_row;
      if (p.row_bias != nullptr) q.row_bias = p.row_bias + r0;
      Rows(q, 0, vectors);
      TailRows(q);
    });
    return;
  }
  // Each task at least ~32k multiply-adds, so that small products run inline, on no thread.
  const int64_t grain = std::max<int64_t>(kVectors<1>, 32768 / std::max<int64_t>(p.m * p.k * kLanes, 1));
  at::parallel_for(0, vectors, grain, [&](int64_t v0, int64_t v1) { Rows(p, v0, v1); });
  TailRows(p);  // the same chain per element, the lanes past n masked off
}

}  // namespace torchreplay::capture::small_gemm

#else  // no AVX2: Available() is false, and nothing calls Run

namespace torchreplay::capture::small_gemm {
void Run(const Params&) { TORCH_CHECK(false, "torchreplay: the small GEMM needs AVX2 and FMA"); }
}  // namespace torchreplay::capture::small_gemm

#endif
