// capture/kernels/simd_ops.h: the vector operations shared by the kernels written with intrinsics (the
// small GEMM, small_gemm_impl.h; the depthwise convolution's channels-last walk,
// depthwise_pixels_impl.h), for the instruction set the including file is compiled for: AVX-512
// where __AVX512F__ is defined, else AVX2 and FMA. `V` is a vector of kLanes floats; a Mask
// selects lanes.
// Included inside each copy's namespace, after <immintrin.h>, <sleef.h> and capture/kernels/post_op.h:
// no include guard, no namespace.
#if defined(__AVX512F__)
using V = __m512;
using Mask = __mmask16;
constexpr int kLanes = 16;
inline V Zero() { return _mm512_setzero_ps(); }
inline V Load(const float* p) { return _mm512_loadu_ps(p); }
inline V Broadcast(const float* p) { return _mm512_set1_ps(*p); }
inline void Store(float* p, V v) { _mm512_storeu_ps(p, v); }
inline V Add(V a, V b) { return _mm512_add_ps(a, b); }
inline Mask TailMask(int left) { return static_cast<Mask>((1u << left) - 1); }  // the first `left` lanes
inline V MaskLoad(const float* p, Mask m) { return _mm512_maskz_loadu_ps(m, p); }  // 0 in the other lanes
inline void MaskStore(float* p, Mask m, V v) { _mm512_mask_storeu_ps(p, m, v); }
inline V Max(V a, V b) { return _mm512_max_ps(a, b); }  // b where either is NaN
inline V Min(V a, V b) { return _mm512_min_ps(a, b); }  // b where either is NaN
inline V Mul(V a, V b) { return _mm512_mul_ps(a, b); }
inline V Div(V a, V b) { return _mm512_div_ps(a, b); }
inline V Set(float f) { return _mm512_set1_ps(f); }
inline V Neg(V v) { return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v), _mm512_set1_epi32(INT32_MIN))); }
inline V Exp(V v) { return Sleef_expf16_u10(v); }  // Vectorized<float>::exp's
#else
using V = __m256;
using Mask = __m256i;
constexpr int kLanes = 8;
inline V Zero() { return _mm256_setzero_ps(); }
inline V Load(const float* p) { return _mm256_loadu_ps(p); }
inline V Broadcast(const float* p) { return _mm256_broadcast_ss(p); }
inline void Store(float* p, V v) { _mm256_storeu_ps(p, v); }
inline V Add(V a, V b) { return _mm256_add_ps(a, b); }
inline Mask TailMask(int left) {
  alignas(32) int32_t lanes[kLanes];
  for (int i = 0; i < kLanes; ++i) lanes[i] = i < left ? -1 : 0;
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(lanes));
}
inline V MaskLoad(const float* p, Mask m) { return _mm256_maskload_ps(p, m); }
inline void MaskStore(float* p, Mask m, V v) { _mm256_maskstore_ps(p, m, v); }
inline V Max(V a, V b) { return _mm256_max_ps(a, b); }  // b where either is NaN
inline V Min(V a, V b) { return _mm256_min_ps(a, b); }  // b where either is NaN
inline V Mul(V a, V b) { return _mm256_mul_ps(a, b); }
inline V Div(V a, V b) { return _mm256_div_ps(a, b); }
inline V Set(float f) { return _mm256_set1_ps(f); }
inline V Neg(V v) { return _mm256_xor_ps(v, _mm256_set1_ps(-0.f)); }
inline V Exp(V v) { return Sleef_expf8_u10(v); }  // Vectorized<float>::exp's
#endif

// acc + a * b, rounded once, as the instruction vfmadd231ps acc, a, b: the operands' places pinned.
// Where NaNs meet in one element, which one's payload the result keeps follows those places, and
// the compiler would otherwise swap the product's operands from one instantiation to the next (a
// tile shape, a block of pixels): pinned, a kernel's bits, NaNs included, do not depend on how
// its work is cut.
inline V Fma(V a, V b, V acc) {
  asm("vfmadd231ps %2, %1, %0" : "+v"(acc) : "v"(a), "vm"(b));
  return acc;
}

// The post-op (capture/kernels/post_op.h) on a vector, operand for operand as eager's: relu max(0, v) keeps
// NaN (and -0) as torch.relu; hardswish v * min(max(v + 3, 0), 6) / 6, NaN kept (v times 0);
// hardsigmoid min(6, max(0, v + 3)) / 6, NaN kept (the second operand of each); silu
// v / (1 + exp(-v)), ATen's vectorized silu.
inline V PostOf(V v, PostOp post) {
  switch (post) {
    case PostOp::kNone: return v;
    case PostOp::kRelu: return Max(Zero(), v);
    case PostOp::kHardswish: return Div(Mul(v, Min(Max(Add(v, Set(3.f)), Zero()), Set(6.f))), Set(6.f));
    case PostOp::kHardsigmoid: return Div(Min(Set(6.f), Max(Zero(), Add(v, Set(3.f)))), Set(6.f));
    case PostOp::kSilu: return Div(v, Add(Set(1.f), Exp(Neg(v))));
  }
  return v;
}
