// The small GEMM's kernel (Note [Small GEMMs] in small_gemm.h), included once per instruction set
// by small_gemm_avx2.cc and small_gemm_avx512.cc inside their namespace (avx2, avx512), after
// simd_ops.h (`V`, a vector of kLanes floats, its operations and PostOf, the post-op) and what
// each defines for it: AddBias(bias, sum) (bias + sum, the bias's NaN kept where both are NaN);
// kMaxRows (rows per tile, at most 8) and kVectors<MR> (vectors of columns per tile of MR rows:
// its sums, its weight vectors and one broadcast in registers).
// Every output element is the same chain of multiply-adds whatever V is: the two copies give the
// same bits, and where the rows and columns are cut changes none.
// Not a header of its own: no include guard, no namespace.

// Rows [r0, r0 + MR) by columns [c0, c0 + NV * kLanes), the sums in named registers
// a<row><vector>: with them in an array, GCC kept every sum in memory too, a store per FMA, at half
// the speed. The macros below expand over rows 0-7 and vectors 0-7; `if constexpr` drops what the
// tile has not.
#define TORCHREPLAY_VECTORS(M, r) M(r, 0) M(r, 1) M(r, 2) M(r, 3) M(r, 4) M(r, 5) M(r, 6) M(r, 7)
#define TORCHREPLAY_TILE(M) TORCHREPLAY_VECTORS(M, 0) TORCHREPLAY_VECTORS(M, 1) TORCHREPLAY_VECTORS(M, 2) \
  TORCHREPLAY_VECTORS(M, 3) TORCHREPLAY_VECTORS(M, 4) TORCHREPLAY_VECTORS(M, 5) TORCHREPLAY_VECTORS(M, 6)   \
  TORCHREPLAY_VECTORS(M, 7)
// kCols: x read through p.x_cols, a template argument so that neither read's loop over k tests
// which read it is.
template <int MR, int NV, bool kCols>
inline void TileOf(const Params& p, int64_t r0, int64_t c0) {
  static_assert(MR <= 8 && NV <= 8);
  const int64_t k_end = p.k, w_row = p.w_row > 0 ? p.w_row : p.n, x_row = p.x_row;
  const float* x = kCols ? nullptr : p.x + r0 * x_row;
  const int64_t col_at = (p.x_cols_from + r0) * x_row;
  const float* const* rows = p.w_rows;
  const float* w = p.w + c0;
  const float* bias = p.bias != nullptr ? p.bias + c0 : nullptr;
#define DECLARE(r, v) [[maybe_unused]] V a##r##v = Zero();
  TORCHREPLAY_TILE(DECLARE)
#undef DECLARE
  if (bias != nullptr && !p.bias_last) {
#define START(r, v) \
  if constexpr (r < MR && v < NV) a##r##v = Load(bias + v * kLanes);
    TORCHREPLAY_TILE(START)
#undef START
  } else if (p.row_bias != nullptr) {
#define START(r, v) \
  if constexpr (r < MR && v < NV) a##r##v = Broadcast(p.row_bias + r0 + r);
    TORCHREPLAY_TILE(START)
#undef START
  }
  for (int64_t k = 0; k < k_end; ++k) {
    const float* wk = rows != nullptr ? rows[k] + c0 : w + k * w_row;
    const float* xk = kCols ? p.x_cols[k] + col_at : x + k;  // row r at xk + r * x_row
    [[maybe_unused]] V w0, w1, w2, w3, w4, w5, w6, w7;
#define LOAD_W(v) \
  if constexpr (v < NV) w##v = Load(wk + v * kLanes);
    LOAD_W(0) LOAD_W(1) LOAD_W(2) LOAD_W(3) LOAD_W(4) LOAD_W(5) LOAD_W(6) LOAD_W(7)
#undef LOAD_W
    // row by row: each row's x[k] broadcast just before its multiply-adds, so that one is held at
    // a time beside the sums and the weight vectors (all of them at once spilled sums)
#define MULTIPLY_ADD_ROW(r)                                                     \
  if constexpr (r < MR) {                                                       \
    const V xr = Broadcast(xk + r * x_row);                                     \
    MULTIPLY_ADD(r, 0) MULTIPLY_ADD(r, 1) MULTIPLY_ADD(r, 2) MULTIPLY_ADD(r, 3) \
    MULTIPLY_ADD(r, 4) MULTIPLY_ADD(r, 5) MULTIPLY_ADD(r, 6) MULTIPLY_ADD(r, 7) \
  }
#define MULTIPLY_ADD(r, v) \
  if constexpr (v < NV) a##r##v = Fma(xr, w##v, a##r##v);
    MULTIPLY_ADD_ROW(0) MULTIPLY_ADD_ROW(1) MULTIPLY_ADD_ROW(2) MULTIPLY_ADD_ROW(3)
    MULTIPLY_ADD_ROW(4) MULTIPLY_ADD_ROW(5) MULTIPLY_ADD_ROW(6) MULTIPLY_ADD_ROW(7)
#undef MULTIPLY_ADD
#undef MULTIPLY_ADD_ROW
  }
  if (bias != nullptr && p.bias_last) {  // the sum, then the bias (AddBias)
#define ADD_BIAS(r, v) \
  if constexpr (r < MR && v < NV) a##r##v = AddBias(Load(bias + v * kLanes), a##r##v);
    TORCHREPLAY_TILE(ADD_BIAS)
#undef ADD_BIAS
  }
  const PostOp post = p.post;
  float* y = p.y + r0 * p.y_row + c0;
#define STORE(r, v) \
  if constexpr (r < MR && v < NV) Store(y + r * p.y_row + v * kLanes, PostOf(a##r##v, post));
  TORCHREPLAY_TILE(STORE)
#undef STORE
}
#undef TORCHREPLAY_TILE
#undef TORCHREPLAY_VECTORS

template <int MR, int NV>
inline void Tile(const Params& p, int64_t r0, int64_t c0) {
  p.x_cols != nullptr ? TileOf<MR, NV, true>(p, r0, c0) : TileOf<MR, NV, false>(p, r0, c0);
}

// The last vectors of a row block, fewer than a whole tile: a tile of exactly that many.
template <int MR, int NV>
inline void Rest(const Params& p, int64_t r0, int64_t c0, int64_t vectors) {
  if constexpr (NV > 0) {
    if (vectors == NV) return Tile<MR, NV>(p, r0, c0);
    Rest<MR, NV - 1>(p, r0, c0, vectors);
  }
}

// Rows [r0, r0 + MR) by the last n % kLanes columns, from c0: one vector, its lanes past n masked
// off.
template <int MR, bool kCols>
void TailTileOf(const Params& p, int64_t r0, int64_t c0, Mask mask) {
  const int64_t k_end = p.k, w_row = p.w_row > 0 ? p.w_row : p.n, x_row = p.x_row;
  const float* x = kCols ? nullptr : p.x + r0 * x_row;
  const int64_t col_at = (p.x_cols_from + r0) * x_row;
  const float* const* rows = p.w_rows;
  const float* w = p.w + c0;
#define EACH_ROW(M) M(0) M(1) M(2) M(3) M(4) M(5) M(6) M(7)
#define DECLARE(r) [[maybe_unused]] V a##r = Zero();
  EACH_ROW(DECLARE)
#undef DECLARE
  if (p.bias != nullptr && !p.bias_last) {
    const V b = MaskLoad(p.bias + c0, mask);
#define START(r) \
  if constexpr (r < MR) a##r = b;
    EACH_ROW(START)
#undef START
  } else if (p.row_bias != nullptr) {
#define START(r) \
  if constexpr (r < MR) a##r = Broadcast(p.row_bias + r0 + r);
    EACH_ROW(START)
#undef START
  }
  for (int64_t k = 0; k < k_end; ++k) {
    const float* wk = rows != nullptr ? rows[k] + c0 : w + k * w_row;
    const V wv = MaskLoad(wk, mask);
    const float* xk = kCols ? p.x_cols[k] + col_at : x + k;
#define MULTIPLY_ADD(r) \
  if constexpr (r < MR) a##r = Fma(Broadcast(xk + r * x_row), wv, a##r);
    EACH_ROW(MULTIPLY_ADD)
#undef MULTIPLY_ADD
  }
  if (p.bias != nullptr && p.bias_last) {
    const V b = MaskLoad(p.bias + c0, mask);
#define ADD_BIAS(r) \
  if constexpr (r < MR) a##r = AddBias(b, a##r);
    EACH_ROW(ADD_BIAS)
#undef ADD_BIAS
  }
  const PostOp post = p.post;
  float* y = p.y + r0 * p.y_row + c0;
#define STORE(r) \
  if constexpr (r < MR) MaskStore(y + r * p.y_row, mask, PostOf(a##r, post));
  EACH_ROW(STORE)
#undef STORE
#undef EACH_ROW
}

template <int MR>
void TailTile(const Params& p, int64_t r0, int64_t c0, Mask mask) {
  p.x_cols != nullptr ? TailTileOf<MR, true>(p, r0, c0, mask) : TailTileOf<MR, false>(p, r0, c0, mask);
}

// Rows [r0, r0 + MR) by the column vectors [v0, v1).
template <int MR>
void Block(const Params& p, int64_t r0, int64_t v0, int64_t v1) {
  constexpr int NV = kVectors<MR>;
  int64_t v = v0;
  for (; v + NV <= v1; v += NV) Tile<MR, NV>(p, r0, v * kLanes);
  Rest<MR, NV - 1>(p, r0, v * kLanes, v1 - v);
}

// The last `left` rows (fewer than kMaxRows), from r0: one block (or tail tile) of exactly that many.
template <int MR>
void LastRows(const Params& p, int64_t r0, int64_t left, int64_t v0, int64_t v1, const Mask* tail) {
  if constexpr (MR > 0) {
    if (left != MR) return LastRows<MR - 1>(p, r0, left, v0, v1, tail);
    tail != nullptr ? TailTile<MR>(p, r0, v0 * kLanes, *tail) : Block<MR>(p, r0, v0, v1);
  }
}

void Rows(const Params& p, int64_t v0, int64_t v1) {
  int64_t r = 0;
  for (; r + kMaxRows <= p.m; r += kMaxRows) Block<kMaxRows>(p, r, v0, v1);
  LastRows<kMaxRows - 1>(p, r, p.m - r, v0, v1, nullptr);
}

// The last n % kLanes columns of every row.
void TailRows(const Params& p) {
  const int64_t v = p.n / kLanes, left = p.n - v * kLanes;
  if (left == 0) return;
  const Mask mask = TailMask(static_cast<int>(left));
  int64_t r = 0;
  for (; r + kMaxRows <= p.m; r += kMaxRows) TailTile<kMaxRows>(p, r, v * kLanes, mask);
  LastRows<kMaxRows - 1>(p, r, p.m - r, v, v, &mask);
}

// Rows [r0, r0 + m) of p.x times p.x_scale, into this thread's buffer: the x a product with
// x_scale reads (each element one multiply, as the elementwise op it replaces computes it).
const float* ScaledRows(const Params& p, int64_t r0, int64_t m) {
  thread_local std::vector<float> buffer;
  if (buffer.size() < static_cast<size_t>(m * p.k)) buffer.resize(m * p.k);
  const int64_t whole = p.k / kLanes * kLanes;
  const Mask mask = TailMask(static_cast<int>(p.k - whole));
  for (int64_t r = 0; r < m; ++r) {
    const float* x = p.x + (r0 + r) * p.x_row;
    float* y = buffer.data() + r * p.k;
    int64_t c = 0;
    for (; c < whole; c += kLanes) Store(y + c, Mul(Load(x + c), Load(p.x_scale + c)));
    if (c < p.k) MaskStore(y + c, mask, Mul(MaskLoad(x + c, mask), MaskLoad(p.x_scale + c, mask)));
  }
  return buffer.data();
}

void Gemm(const Params& p) {
  if (p.x_scale != nullptr && p.m < 4 * kMaxRows) {  // (with many rows, per task below)
    Params q = p;
    q.x = ScaledRows(p, 0, p.m), q.x_row = p.k, q.x_scale = nullptr;
    return Gemm(q);
  }
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
      q.m = std::min(p.m, b1 * kMaxRows) - r0, q.y = p.y + r0 * p.y_row;
      if (p.x_cols != nullptr) {
        q.x_cols_from = p.x_cols_from + r0;
      } else if (p.x_scale != nullptr) {
        q.x = ScaledRows(p, r0, q.m), q.x_row = p.k, q.x_scale = nullptr;
      } else {
        q.x = p.x + r0 * p.x_row;
      }
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
