// The direct depthwise convolution's channels-last walk (Note [Depthwise convolutions] in
// depthwise_kernel.h), included once per instruction set by depthwise_kernel_avx2.cc and
// depthwise_pixels_avx512.cc inside their namespace (avx2, avx512), after simd_ops.h (`V`, a
// vector of kLanes floats, and its operations) and PostOf(v, post), the post-op on a vector,
// which each defines. Every element is the same chain of FMAs in both copies, whatever vector it
// is in: the two give the same bits.
// Not a header of its own: no include guard, no namespace.

// The taps of an output coordinate that fall inside the input: [lo, hi).
inline void Taps(int64_t o, int64_t stride, int64_t pad, int64_t dil, int64_t k, int64_t size, int64_t* lo,
                 int64_t* hi) {
  const int64_t start = o * stride - pad;
  *lo = 0;
  while (*lo < k && start + *lo * dil < 0) ++*lo;
  *hi = k;
  while (*hi > *lo && start + (*hi - 1) * dil >= size) --*hi;
}

// Up to kP output pixels of one output row (n, oh), consecutive from `ow`, over kV vectors of
// channels from `c`, the last masked by `m` where kMask: kP * kV independent FMA chains in flight,
// each filter vector loaded once for all the pixels. `kw_lo`/`kw_hi` are each pixel's taps in
// the row; a tap outside a pixel's is skipped for that pixel alone, so that every element is
// the same chain of FMAs as on its own.
template <int kV, int kP, bool kMask>
inline void Block(const Params& p, const float* xn, float* yrow, int64_t oh, int64_t ow, int np, int64_t kh_lo,
                  int64_t kh_hi, const int64_t* kw_lo, const int64_t* kw_hi, int64_t c, Mask m) {
  const bool bias_first = p.bias_first && p.bias != nullptr, bias_last = !p.bias_first && p.bias != nullptr;
  auto load = [&](const float* at, int v) { return kMask && v == kV - 1 ? MaskLoad(at, m) : Load(at); };
  V acc[kP][kV];
#pragma GCC unroll 8
  for (int v = 0; v < kV; ++v) {
    const V init = bias_first ? load(p.bias + c + kLanes * v, v) : Zero();
#pragma GCC unroll 8
    for (int q = 0; q < kP; ++q) acc[q][v] = init;
  }
  // Each pixel's first tap column in the input row, as an offset from the row's channel c.
  int64_t x0[kP];
  bool same_taps = np == kP;
#pragma GCC unroll 8
  for (int q = 0; q < kP; ++q) {
    x0[q] = ((ow + std::min(q, np - 1)) * p.stride[1] - p.padding[1]) * p.xs[3];
    same_taps = same_taps && kw_lo[std::min(q, np - 1)] == kw_lo[0] && kw_hi[std::min(q, np - 1)] == kw_hi[0];
  }
  int64_t j_lo = kw_lo[0], j_hi = kw_hi[0];
  for (int q = 1; q < np; ++q) j_lo = std::min(j_lo, kw_lo[q]), j_hi = std::max(j_hi, kw_hi[q]);
  const int64_t tap_step = p.dilation[1] * p.xs[3];
  auto taps = [&](auto all_taps) {
    for (int64_t i = kh_lo; i < kh_hi; ++i) {
      const float* row = xn + (oh * p.stride[0] - p.padding[0] + i * p.dilation[0]) * p.xs[2] + c;
      const float* wt = p.w_hwc + (i * p.kw + j_lo) * p.c + c;
      for (int64_t j = j_lo, jt = j_lo * tap_step; j < j_hi; ++j, jt += tap_step, wt += p.c) {
        V w[kV];
#pragma GCC unroll 8
        for (int v = 0; v < kV; ++v) w[v] = load(wt + kLanes * v, v);
#pragma GCC unroll 8
        for (int q = 0; q < kP; ++q) {
          if (!decltype(all_taps)::value && (q >= np || j < kw_lo[q] || j >= kw_hi[q])) continue;
          const float* at = row + x0[q] + jt;
#pragma GCC unroll 8
          for (int v = 0; v < kV; ++v) acc[q][v] = Fma(load(at + kLanes * v, v), w[v], acc[q][v]);
        }
      }
    }
  };
  if (same_taps) {
    taps(std::true_type());
  } else {
    taps(std::false_type());
  }
  for (int q = 0; q < np && q < kP; ++q) {
    float* y = yrow + (ow + q) * p.ys[3] + c;
#pragma GCC unroll 8
    for (int v = 0; v < kV; ++v) {
      V r = acc[q][v];
      if (bias_last) r = Add(r, load(p.bias + c + kLanes * v, v));
      r = PostOf(r, p.post);
      if (kMask && v == kV - 1) {
        MaskStore(y + kLanes * v, m, r);
      } else {
        Store(y + kLanes * v, r);
      }
    }
  }
}

// The `vectors` (0 to 4) of channels from `c` after the groups of four, the last masked where
// kMask: np pixels from `ow` (at most 8 for one vector, else 2).
template <bool kMask>
inline void Rest(int vectors, const Params& p, const float* xn, float* yrow, int64_t oh, int64_t ow, int np,
                 int64_t kh_lo, int64_t kh_hi, const int64_t* kw_lo, const int64_t* kw_hi, int64_t c, Mask m) {
  switch (vectors) {
    case 1:
      return np > 4 ? Block<1, 8, kMask>(p, xn, yrow, oh, ow, np, kh_lo, kh_hi, kw_lo, kw_hi, c, m)
                    : Block<1, 4, kMask>(p, xn, yrow, oh, ow, np, kh_lo, kh_hi, kw_lo, kw_hi, c, m);
    case 2: return Block<2, 2, kMask>(p, xn, yrow, oh, ow, np, kh_lo, kh_hi, kw_lo, kw_hi, c, m);
    case 3: return Block<3, 2, kMask>(p, xn, yrow, oh, ow, np, kh_lo, kh_hi, kw_lo, kw_hi, c, m);
    case 4: return Block<4, 2, kMask>(p, xn, yrow, oh, ow, np, kh_lo, kh_hi, kw_lo, kw_hi, c, m);
    default: return;  // none after the groups
  }
}

// Output pixels [ow, ow_end) of row (n, oh), vectorized over channels: each group of four
// vectors of channels two pixels at a time, then the vectors after the groups (the last masked
// where the channels are not a whole number of vectors) two pixels at a time, or, where they are
// one vector, four (eight where that vector is all the channels): six to ten FMA chains in flight.
inline void PixelRow(const Params& p, int64_t n, int64_t oh, int64_t ow, int64_t ow_end) {
  int64_t kh_lo, kh_hi;
  Taps(oh, p.stride[0], p.padding[0], p.dilation[0], p.kh, p.h, &kh_lo, &kh_hi);
  const float* xn = p.x + n * p.xs[0];
  float* yrow = p.y + n * p.ys[0] + oh * p.ys[2];
  const int64_t vectors = (p.c + kLanes - 1) / kLanes;
  const bool masked = p.c % kLanes != 0;
  const Mask m = TailMask(static_cast<int>(masked ? p.c % kLanes : kLanes));
  const int64_t whole_groups = masked ? (vectors - 1) / 4 : vectors / 4;  // groups of four unmasked vectors
  const int last = static_cast<int>(vectors - 4 * whole_groups);             // 0..4 vectors after them
  constexpr int kMaxP = 8;
  for (; ow < ow_end;) {
    const int pixels = last != 1 ? 2 : whole_groups == 0 ? 8 : 4;
    const int np = static_cast<int>(std::min<int64_t>(pixels, ow_end - ow));
    int64_t kw_lo[kMaxP] = {}, kw_hi[kMaxP] = {};
    for (int q = 0; q < np; ++q) {
      Taps(ow + q, p.stride[1], p.padding[1], p.dilation[1], p.kw, p.w_, &kw_lo[q], &kw_hi[q]);
    }
    for (int64_t g = 0; g < whole_groups; ++g) {
      for (int q0 = 0; q0 < np; q0 += 2) {
        Block<4, 2, false>(p, xn, yrow, oh, ow + q0, std::min(2, np - q0), kh_lo, kh_hi, kw_lo + q0, kw_hi + q0,
                           4 * kLanes * g, m);
      }
    }
    const int64_t c = 4 * kLanes * whole_groups;
    if (masked) {
      Rest<true>(last, p, xn, yrow, oh, ow, np, kh_lo, kh_hi, kw_lo, kw_hi, c, m);
    } else {
      Rest<false>(last, p, xn, yrow, oh, ow, np, kh_lo, kh_hi, kw_lo, kw_hi, c, m);
    }
    ow += np;
  }
}

void Pixels(const Params& p) {
  const int64_t taps = std::max<int64_t>(p.kh * p.kw, 1);
  at::parallel_for(0, p.n * p.oh * p.ow, std::max<int64_t>(1, 32768 / std::max<int64_t>(p.c * taps, 1)),
                   [&](int64_t begin, int64_t end) {
                     for (int64_t k = begin; k < end;) {  // row by row
                       const int64_t row = k / p.ow, ow = k % p.ow, stop = std::min(end - k, p.ow - ow);
                       PixelRow(p, row / p.oh, row % p.oh, ow, ow + stop);
                       k += stop;
                     }
                   });
}
