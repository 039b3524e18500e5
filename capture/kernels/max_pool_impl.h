// capture/kernels/max_pool_impl.h: the max pooling walk (Note [Max pooling] in max_pool.h), for the
// instruction set the including file is compiled for. Included inside each copy's namespace,
// after capture/kernels/simd_ops.h: no include guard, no namespace.

#if defined(__AVX512F__)
using VI = __m512i;  // kLanes int32 indices
// Where eager's loop takes `v` over the maximum `m` so far: v > m, or v is NaN.
inline Mask Takes(V v, V m) { return _mm512_cmp_ps_mask(v, m, _CMP_GT_OQ) | _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q); }
inline V Take(Mask k, V v, V m) { return _mm512_mask_mov_ps(m, k, v); }
inline VI TakeIndex(Mask k, VI v, VI m) { return _mm512_mask_mov_epi32(m, k, v); }
// first, first + step, ..., one per lane
inline VI Indices(int32_t first, int32_t step) {
  return _mm512_add_epi32(_mm512_set1_epi32(first),
                          _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                             _mm512_set1_epi32(step)));
}
inline VI AddIndex(VI v, int32_t d) { return _mm512_add_epi32(v, _mm512_set1_epi32(d)); }
inline void StoreIndices(int64_t* p, VI v) {
  _mm512_storeu_si512(p, _mm512_cvtepi32_epi64(_mm512_castsi512_si256(v)));
  _mm512_storeu_si512(p + 8, _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(v, 1)));
}
// p[0], p[2], ..., p[2 * kLanes - 2]; reads p[0, 2 * kLanes)
inline V Evens(const float* p) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  return _mm512_permutex2var_ps(Load(p), even, Load(p + kLanes));
}
#else
using VI = __m256i;
inline Mask Takes(V v, V m) {
  return _mm256_castps_si256(_mm256_or_ps(_mm256_cmp_ps(v, m, _CMP_GT_OQ), _mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}
inline V Take(Mask k, V v, V m) { return _mm256_blendv_ps(m, v, _mm256_castsi256_ps(k)); }
inline VI TakeIndex(Mask k, VI v, VI m) {
  return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(m), _mm256_castsi256_ps(v), _mm256_castsi256_ps(k)));
}
inline VI Indices(int32_t first, int32_t step) {
  return _mm256_add_epi32(_mm256_set1_epi32(first),
                          _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(step)));
}
inline VI AddIndex(VI v, int32_t d) { return _mm256_add_epi32(v, _mm256_set1_epi32(d)); }
inline void StoreIndices(int64_t* p, VI v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_cvtepi32_epi64(_mm256_castsi256_si128(v)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + 4), _mm256_cvtepi32_epi64(_mm256_extracti128_si256(v, 1)));
}
inline V Evens(const float* p) {
  // [a0 a2 b0 b2 | a4 a6 b4 b6], then its 64-bit pairs reordered to [a0 a2 a4 a6 b0 b2 b4 b6]
  const __m256 s = _mm256_shuffle_ps(Load(p), Load(p + kLanes), 0x88);
  return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(s), 0xD8));
}
#endif

// One output element as eager's cpu_max_pool computes it: rows [h0, h1) and columns [w0, w1) of
// the plane, `dh` and `dw` apart, row by row.
inline void PoolOne(const Params& p, const float* plane, int64_t h0, int64_t h1, int64_t w0, int64_t w1, float* out,
                    int64_t* index) {
  float max = -std::numeric_limits<float>::infinity();
  int64_t at = h0 * p.in_w + w0;
  for (int64_t h = h0; h < h1; h += p.dilation_h) {
    for (int64_t w = w0; w < w1; w += p.dilation_w) {
      const float v = plane[h * p.in_w + w];
      if (v > max || std::isnan(v)) {
        max = v;
        at = h * p.in_w + w;
      }
    }
  }
  *out = max;
  if (index != nullptr) *index = at;
}

// Elements a vector of kLanes columns reads from one row of its windows, at most (wider windows
// take the scalar loop).
constexpr int64_t kMaxRead = 8 * kLanes;

// Output columns [ow, ow + n) of row `oh` (n <= kLanes), whose windows lie inside the rows, one
// lane each, with eager's rule; rows [h0, h1) of the plane.
void PoolColumns(const Params& p, const float* plane, int64_t h0, int64_t h1, int64_t ow, int64_t n, float* out,
                 int64_t* indices) {
  const int64_t span_w = (p.kernel_w - 1) * p.dilation_w;
  const int64_t read = span_w + p.stride_w * kLanes;  // elements the loads of a row read
  const int64_t w0 = ow * p.stride_w - p.pad_w;
  // A vector of columns near the row's end reads past it (its last lanes, or one element past the
  // last lane's window with a stride of 2): those rows are read from a copy whose elements past the
  // row's end are zeros, and only the n lanes are stored.
  const bool direct = n == kLanes && w0 + read <= p.in_w;
  const int64_t copied = std::min(read, p.in_w - w0);
  alignas(64) float copy[kMaxRead + 2 * kLanes];
  if (!direct) std::fill(copy + copied, std::end(copy), 0.f);
  V max = Set(-std::numeric_limits<float>::infinity());
  VI at = Indices(static_cast<int32_t>(h0 * p.in_w + w0), static_cast<int32_t>(p.stride_w));
  for (int64_t h = h0; h < h1; h += p.dilation_h) {
    const float* row = plane + h * p.in_w + w0;
    if (!direct) {
      std::copy(row, row + copied, copy);
      row = copy;
    }
    const VI index = Indices(static_cast<int32_t>(h * p.in_w + w0), static_cast<int32_t>(p.stride_w));
    for (int64_t k = 0; k <= span_w; k += p.dilation_w) {
      const V v = p.stride_w == 1 ? Load(row + k) : Evens(row + k);
      const Mask take = Takes(v, max);
      max = Take(take, v, max);
      at = TakeIndex(take, AddIndex(index, static_cast<int32_t>(k)), at);
    }
  }
  if (n == kLanes) {
    Store(out + ow, max);
    if (indices != nullptr) StoreIndices(indices + ow, at);
    return;
  }
  MaskStore(out + ow, TailMask(static_cast<int>(n)), max);
  if (indices == nullptr) return;
  alignas(64) int64_t lanes[kLanes];
  StoreIndices(lanes, at);
  std::copy(lanes, lanes + n, indices + ow);
}

// Output row `oh` of one plane.
void PoolRow(const Params& p, const float* plane, int64_t oh, float* out, int64_t* indices) {
  int64_t h0 = oh * p.stride_h - p.pad_h;
  const int64_t h1 = std::min(h0 + (p.kernel_h - 1) * p.dilation_h + 1, p.in_h);
  while (h0 < 0) h0 += p.dilation_h;
  const int64_t span_w = (p.kernel_w - 1) * p.dilation_w;  // a window's last column from its first
  // The columns the vectors take, [lo, hi): those whose windows lie inside the row; none for
  // strides other than 1 and 2 or windows too wide. The others take eager's scalar loop.
  int64_t lo = p.out_w, hi = p.out_w;
  if ((p.stride_w == 1 || p.stride_w == 2) && span_w + p.stride_w * kLanes <= kMaxRead &&
      p.in_w - 1 - span_w + p.pad_w >= 0) {
    lo = std::min(p.out_w, (p.pad_w + p.stride_w - 1) / p.stride_w);
    hi = std::max(lo, std::min(p.out_w, (p.in_w - 1 - span_w + p.pad_w) / p.stride_w + 1));
  }
  const auto scalar = [&](int64_t c) {
    int64_t w0 = c * p.stride_w - p.pad_w;
    const int64_t w1 = std::min(w0 + span_w + 1, p.in_w);
    while (w0 < 0) w0 += p.dilation_w;
    PoolOne(p, plane, h0, h1, w0, w1, out + c, indices == nullptr ? nullptr : indices + c);
  };
  for (int64_t c = 0; c < lo; ++c) scalar(c);
  for (int64_t c = lo; c < hi; c += kLanes) {
    PoolColumns(p, plane, h0, h1, c, std::min<int64_t>(kLanes, hi - c), out, indices);
  }
  for (int64_t c = hi; c < p.out_w; ++c) scalar(c);
}

void Pool(const Params& p) {
  const int64_t rows = p.planes * p.out_h;
  // Rows of at least ~32k window elements a task: small maps stay on the calling thread.
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, p.out_w * p.kernel_h * p.kernel_w));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t plane = r / p.out_h, oh = r % p.out_h;
      PoolRow(p, p.in + plane * p.in_h * p.in_w, oh, p.out + r * p.out_w,
              p.indices == nullptr ? nullptr : p.indices + r * p.out_w);
    }
  });
}
