// The direct depthwise convolution (Note [Depthwise convolutions] in depthwise_kernel.h),
// compiled with AVX2 and FMA; called only where depthwise::Available(). Its channels-last walk
// (depthwise_pixels_impl.h) is also compiled for AVX-512 (depthwise_pixels_avx512.cc), run where
// ATen runs its AVX512 kernels.
#include "capture/kernels/depthwise_kernel.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "capture/kernels/cpu_features.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include <sleef.h>

namespace torchreplay::capture::kernels::depthwise {
namespace avx512 {
void RunPixels(const Params& p);  // depthwise_pixels_avx512.cc
}  // namespace avx512
namespace {

// The channels-last walk (depthwise_pixels_impl.h) with AVX2's 8 lanes.
#include "capture/kernels/simd_ops.h"
#include "capture/kernels/depthwise_pixels_impl.h"

// Channels-first: one (n, c) plane, vectorized along the output row, 8 outputs at a time, read
// from a copy of the plane whose rows have zeros on both sides (so that every load is a plain
// one: for stride 2, the even elements of 16). Where a lane's tap falls outside the input row
// (borders, the row's end), the lane keeps its accumulator (the FMA's result blended away):
// the same as skipping that tap. Over 80 lines: the padded copy and the loop nest that reads it,
// in the order they run; the copy's layout is what the loop's loads assume.
void Plane(const Params& p, int64_t n, int64_t c, std::vector<float>* scratch) {
  const float* xc = p.x + n * p.xs[0] + c * p.xs[1];
  float* yc = p.y + n * p.ys[0] + c * p.ys[1];
  const float* wc = p.w + c * p.kh * p.kw;
  const float b = p.bias != nullptr ? p.bias[c] : 0.f;
  const int64_t sw = p.stride[1], pw = p.padding[1], dw = p.dilation[1];
  // the padded copy: column iw at iw + pw, room for the last block's widest read after it
  const int64_t width = pw + p.w_ + 8 * sw + (p.kw - 1) * dw + 16;
  if (scratch->size() < static_cast<size_t>(p.h * width)) scratch->resize(static_cast<size_t>(p.h * width));
  for (int64_t i = 0; i < p.h; ++i) {
    const float* from = xc + i * p.xs[2];
    float* to = scratch->data() + i * width;
    std::fill(to, to + pw, 0.f);
    if (p.xs[3] == 1) {
      std::memcpy(to + pw, from, static_cast<size_t>(p.w_) * sizeof(float));
    } else {
      for (int64_t j = 0; j < p.w_; ++j) to[pw + j] = from[j * p.xs[3]];
    }
    std::fill(to + pw + p.w_, to + width, 0.f);
  }
  // outputs whose taps all lie inside the row: ow * sw - pw >= 0 and ow * sw - pw + (kw - 1) * dw < w
  const int64_t first = (pw + sw - 1) / sw;
  const int64_t last_in = p.w_ - 1 - (p.kw - 1) * dw + pw;  // ow * sw <= last_in
  const int64_t end = last_in < 0 ? 0 : std::min(p.ow, last_in / sw + 1);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i gather_index = _mm256_mullo_epi32(lane, _mm256_set1_epi32(static_cast<int32_t>(sw)));
  for (int64_t ow = 0; ow < p.ow; ow += 8) {
    const bool interior = ow >= first && ow + 8 <= end;
    const int64_t lanes = std::min<int64_t>(8, p.ow - ow);
    const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(lanes)), lane);
    // per tap column: the lanes whose input column is in [0, w) (the first 16 columns kept)
    auto inside_of = [&](int64_t j) {
      const __m256i col = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(ow * sw - pw + j * dw)),
                                           gather_index);
      return _mm256_castsi256_ps(_mm256_and_si256(
          _mm256_and_si256(_mm256_cmpgt_epi32(col, _mm256_set1_epi32(-1)),
                           _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(p.w_)), col)),
          live));
    };
    __m256 inside[16];
    for (int64_t j = 0; j < std::min<int64_t>(p.kw, 16) && !interior; ++j) inside[j] = inside_of(j);
    // Four output rows at a time where all their filter rows lie inside the input (four FMA
    // chains in flight), else one.
    auto load = [&](const float* at) {
      if (sw == 1) return _mm256_loadu_ps(at);
      if (sw == 2) {
        const __m256 lo = _mm256_loadu_ps(at), hi = _mm256_loadu_ps(at + 8);
        const __m256 even = _mm256_shuffle_ps(lo, hi, _MM_SHUFFLE(2, 0, 2, 0));  // a0 a2 b0 b2 a4 a6 b4 b6
        return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(even), _MM_SHUFFLE(3, 1, 2, 0)));
      }
      return _mm256_i32gather_ps(at, gather_index, 4);
    };
    auto store = [&](int64_t oh, __m256 acc) {
      if (!p.bias_first && p.bias != nullptr) acc = _mm256_add_ps(acc, _mm256_set1_ps(b));
      acc = PostOf(acc, p.post);
      float* yrow = yc + oh * p.ys[2];
      if (p.ys[3] == 1 && lanes == 8) {
        _mm256_storeu_ps(yrow + ow, acc);
      } else {
        alignas(32) float out[8];
        _mm256_store_ps(out, acc);
        for (int64_t k = 0; k < lanes; ++k) yrow[(ow + k) * p.ys[3]] = out[k];
      }
    };
    const __m256 init = p.bias_first ? _mm256_set1_ps(b) : _mm256_setzero_ps();
    for (int64_t oh = 0; oh < p.oh;) {
      int64_t kh_lo, kh_hi;
      Taps(oh, p.stride[0], p.padding[0], p.dilation[0], p.kh, p.h, &kh_lo, &kh_hi);
      int64_t lo3, hi3;
      if (oh + 4 <= p.oh && kh_lo == 0 && kh_hi == p.kh &&
          (Taps(oh + 3, p.stride[0], p.padding[0], p.dilation[0], p.kh, p.h, &lo3, &hi3), lo3 == 0 && hi3 == p.kh)) {
        __m256 acc[4] = {init, init, init, init};
        for (int64_t i = 0; i < p.kh; ++i) {
          for (int64_t j = 0; j < p.kw; ++j) {
            const __m256 wv = _mm256_set1_ps(wc[i * p.kw + j]);
            const __m256 mask = interior ? __m256() : j < 16 ? inside[j] : inside_of(j);
            for (int r = 0; r < 4; ++r) {
              const float* row =
                  scratch->data() + ((oh + r) * p.stride[0] - p.padding[0] + i * p.dilation[0]) * width;
              const __m256 fma = Fma(load(row + ow * sw + j * dw), wv, acc[r]);
              acc[r] = interior ? fma : _mm256_blendv_ps(acc[r], fma, mask);
            }
          }
        }
        for (int r = 0; r < 4; ++r) store(oh + r, acc[r]);
        oh += 4;
        continue;
      }
      __m256 acc = init;
      for (int64_t i = kh_lo; i < kh_hi; ++i) {
        const float* row = scratch->data() + (oh * p.stride[0] - p.padding[0] + i * p.dilation[0]) * width;
        for (int64_t j = 0; j < p.kw; ++j) {
          // column ow * sw - pw + j * dw, at + pw in the padded copy
          const __m256 fma = Fma(load(row + ow * sw + j * dw), _mm256_set1_ps(wc[i * p.kw + j]), acc);
          acc = interior ? fma : _mm256_blendv_ps(acc, fma, j < 16 ? inside[j] : inside_of(j));
        }
      }
      store(oh, acc);
      ++oh;
    }
  }
}

// src [n][c][hw] by its strides -> dst [n][hw][c] contiguous, or back (`to_nhwc` false).
void Transpose(const float* src, const int64_t* s, float* dst, const int64_t* d, int64_t n, int64_t c, int64_t h,
               int64_t w) {
  for (int64_t a = 0; a < n; ++a) {
    for (int64_t k = 0; k < c; ++k) {
      for (int64_t i = 0; i < h; ++i) {
        const float* from = src + a * s[0] + k * s[1] + i * s[2];
        float* to = dst + a * d[0] + k * d[1] + i * d[2];
        for (int64_t j = 0; j < w; ++j) to[j * d[3]] = from[j * s[3]];
      }
    }
  }
}

// The channels-last walk in the copy for ATen's CPU capability (the same bits either way).
void ChannelsLast(const Params& p) { AtenAvx512() ? avx512::RunPixels(p) : Pixels(p); }

}  // namespace

void Run(const Params& p) {
  if (p.xs[1] == 1 && p.ys[1] == 1 && p.w_hwc != nullptr) return ChannelsLast(p);
  if (p.ow < 8 && p.w_hwc != nullptr) {
    // Short rows leave the row-vectorized walk mostly scalar, one latency-bound FMA chain at a
    // time: walk channels-last copies instead (exact moves, the same arithmetic per element).
    thread_local std::vector<float> xt, yt;
    xt.resize(static_cast<size_t>(p.n * p.c * p.h * p.w_));
    yt.resize(static_cast<size_t>(p.n * p.c * p.oh * p.ow));
    const int64_t xts[4] = {p.h * p.w_ * p.c, 1, p.w_ * p.c, p.c};
    const int64_t yts[4] = {p.oh * p.ow * p.c, 1, p.ow * p.c, p.c};
    Transpose(p.x, p.xs, xt.data(), xts, p.n, p.c, p.h, p.w_);
    Params q = p;
    q.x = xt.data(), q.y = yt.data();
    std::copy(xts, xts + 4, q.xs);
    std::copy(yts, yts + 4, q.ys);
    ChannelsLast(q);
    Transpose(yt.data(), yts, p.y, p.ys, p.n, p.c, p.oh, p.ow);
    return;
  }
  const int64_t taps = std::max<int64_t>(p.kh * p.kw, 1);
  at::parallel_for(0, p.n * p.c, std::max<int64_t>(1, 32768 / std::max<int64_t>(p.oh * p.ow * taps, 1)),
                   [&](int64_t begin, int64_t end) {
                     thread_local std::vector<float> scratch;
                     for (int64_t k = begin; k < end; ++k) Plane(p, k / p.c, k % p.c, &scratch);
                   });
}

}  // namespace torchreplay::capture::kernels::depthwise

#else  // no AVX2: Available() is false, and nothing calls Run

namespace torchreplay::capture::kernels::depthwise {
void Run(const Params&) { TORCH_CHECK(false, "torchreplay: the depthwise kernel needs AVX2 and FMA"); }
}  // namespace torchreplay::capture::kernels::depthwise

#endif
