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

// One output pixel, vectorized over channels, four vectors of channels at a time (four
// independent FMA chains in flight), then one at a time.
inline void Pixel(const Params& p, int64_t n, int64_t oh, int64_t ow) {
  int64_t kh_lo, kh_hi, kw_lo, kw_hi;
  Taps(oh, p.stride[0], p.padding[0], p.dilation[0], p.kh, p.h, &kh_lo, &kh_hi);
  Taps(ow, p.stride[1], p.padding[1], p.dilation[1], p.kw, p.w_, &kw_lo, &kw_hi);
  const float* xn = p.x + n * p.xs[0];
  float* y = p.y + n * p.ys[0] + oh * p.ys[2] + ow * p.ys[3];
  const bool bias_first = p.bias_first && p.bias != nullptr, bias_last = !p.bias_first && p.bias != nullptr;
  int64_t c = 0;
  for (; c + 4 * kLanes <= p.c; c += 4 * kLanes) {
    V acc[4];
    for (int v = 0; v < 4; ++v) acc[v] = bias_first ? Load(p.bias + c + kLanes * v) : Zero();
    for (int64_t i = kh_lo; i < kh_hi; ++i) {
      const float* row = xn + (oh * p.stride[0] - p.padding[0] + i * p.dilation[0]) * p.xs[2] + c;
      for (int64_t j = kw_lo; j < kw_hi; ++j) {
        const float* at = row + (ow * p.stride[1] - p.padding[1] + j * p.dilation[1]) * p.xs[3];
        const float* wt = p.w_hwc + (i * p.kw + j) * p.c + c;
        for (int v = 0; v < 4; ++v) acc[v] = Fma(Load(at + kLanes * v), Load(wt + kLanes * v), acc[v]);
      }
    }
    for (int v = 0; v < 4; ++v) {
      if (bias_last) acc[v] = Add(acc[v], Load(p.bias + c + kLanes * v));
      Store(y + c + kLanes * v, PostOf(acc[v], p.post));
    }
  }
  for (; c + kLanes <= p.c; c += kLanes) {
    V acc = bias_first ? Load(p.bias + c) : Zero();
    for (int64_t i = kh_lo; i < kh_hi; ++i) {
      const float* row = xn + (oh * p.stride[0] - p.padding[0] + i * p.dilation[0]) * p.xs[2] + c;
      for (int64_t j = kw_lo; j < kw_hi; ++j) {
        const V v = Load(row + (ow * p.stride[1] - p.padding[1] + j * p.dilation[1]) * p.xs[3]);
        acc = Fma(v, Load(p.w_hwc + (i * p.kw + j) * p.c + c), acc);
      }
    }
    if (bias_last) acc = Add(acc, Load(p.bias + c));
    Store(y + c, PostOf(acc, p.post));
  }
  if (c < p.c) {  // the channels past the last whole vector: one vector, its lanes past p.c masked off
    const Mask m = TailMask(static_cast<int>(p.c - c));
    V acc = bias_first ? MaskLoad(p.bias + c, m) : Zero();
    for (int64_t i = kh_lo; i < kh_hi; ++i) {
      const float* row = xn + (oh * p.stride[0] - p.padding[0] + i * p.dilation[0]) * p.xs[2] + c;
      for (int64_t j = kw_lo; j < kw_hi; ++j) {
        const V v = MaskLoad(row + (ow * p.stride[1] - p.padding[1] + j * p.dilation[1]) * p.xs[3], m);
        acc = Fma(v, MaskLoad(p.w_hwc + (i * p.kw + j) * p.c + c, m), acc);
      }
    }
    if (bias_last) acc = Add(acc, MaskLoad(p.bias + c, m));
    MaskStore(y + c, m, PostOf(acc, p.post));
  }
}

void Pixels(const Params& p) {
  const int64_t taps = std::max<int64_t>(p.kh * p.kw, 1);
  at::parallel_for(0, p.n * p.oh * p.ow, std::max<int64_t>(1, 32768 / std::max<int64_t>(p.c * taps, 1)),
                   [&](int64_t begin, int64_t end) {
                     for (int64_t k = begin; k < end; ++k) Pixel(p, k / (p.oh * p.ow), (k / p.ow) % p.oh, k % p.ow);
                   });
}
