// The ops of the small GEMM (Note [Small GEMMs] in small_gemm.h), for graphs rewritten under
// numerics "close" (Note [Close numerics] in python/torchreplay/close_numerics/__init__.py); each
// functional op allocates its result, its out= overload writes a planned buffer.
// - torchreplay::small_gemm: post_op(bias + input @ weight_kn) (capture/kernels/post_op.h: "none", "relu",
//   "hardswish", "hardsigmoid"); the weight [K, N], or packed in panels of columns (small_gemm.h's
//   Params::panel) as [panels, K, panel]. Its
//   signature is one the tape calls unboxed (Note [Typed steps]): a product without bias gets a
//   bias of zeros (the sums start from +0 either way).
// - torchreplay::small_gemm_scaled: the same of (input * scale), scale [K] a factor per column of
//   the input, each product rounded as the elementwise multiply computes it (a squeeze-and-
//   excitation scale fused into the 1x1 convolution after it; small_gemm.h's x_scale).
// - torchreplay::conv_gemm: a 1-d or 2-d convolution of one group as the product of the weight
//   [C_out, C * KH * KW] by the input's patches, each output channel's sums starting from its
//   bias, then post_op: a 1x1 convolution of stride 1 without padding reads the input's planes
//   as they are; any other reads each output row's taps through a table of row pointers (an
//   indirect GEMM, as XNNPACK's) from a zero-padded copy of the image. The result is contiguous,
//   or channels-last where `channels_last` is set (2-d only; any input layout): for NCHW, the
//   weight's rows by the taps (output channels as the GEMM's rows; the copy split into `stride`
//   phases along the row so that every tap's row is contiguous); for NHWC, an output row's pixels
//   by the weight's transpose (pixels as rows, their taps read through a table of column
//   pointers, small_gemm.h's x_cols, `stride` apart). Each element is the same chain either way,
//   the bias, then the taps in order: the two layouts hold the same bits. The copy's rows and the
//   output rows are split over torch's threads (the product's columns instead where the output
//   has too few rows: a 1-d convolution).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "capture/kernels/cpu_features.h"
#include "capture/kernels/small_gemm.h"

namespace torchreplay::capture::kernels {
namespace {

constexpr const char* kName = "torchreplay::small_gemm";

// input [M, K]; weight_kn [K, N] (copied where not contiguous: a spatial mean's image in a layout
// other than the channels-last the rewrite expected; the same values, so the same sums), or packed
// in panels as [P, K, panel] contiguous (N = bias's size, P = ceil(N / panel)); bias [N].
at::Tensor& ScaledOut(const at::Tensor& input, const float* scale, const at::Tensor& weight,
                      const at::Tensor& bias, c10::string_view post_op, at::Tensor& out) {
  TORCH_CHECK(small_gemm::Available(), kName, ": this CPU has no AVX2 and FMA");
  const bool packed = weight.dim() == 3;
  const at::Tensor weight_kn = packed ? weight : weight.contiguous();
  TORCH_CHECK(input.dim() == 2 && (weight_kn.dim() == 2 || packed) && input.scalar_type() == c10::kFloat &&
                  weight_kn.scalar_type() == c10::kFloat && weight_kn.is_contiguous() &&
                  input.size(1) == weight_kn.size(packed ? 1 : 0) && input.device().is_cpu() &&
                  weight_kn.device().is_cpu(),
              kName, ": a float32 [M, K] input and a contiguous float32 [K, N] (or [panels, K, panel]) weight on "
              "the CPU, not ", input.sizes(), " ", input.scalar_type(), " and ", weight_kn.sizes(), " ",
              weight_kn.scalar_type());
  const int64_t m = input.size(0), k = input.size(1), n = packed ? bias.size(0) : weight_kn.size(1);
  TORCH_CHECK(bias.dim() == 1 && bias.size(0) == n && bias.scalar_type() == c10::kFloat && bias.device().is_cpu(),
              kName, ": bias is float32 [", n, "], not ", bias.sizes(), " ", bias.scalar_type());
  TORCH_CHECK(!packed || (weight_kn.size(2) % 8 == 0 && weight_kn.size(2) > 0 &&
                          weight_kn.size(0) == (n + weight_kn.size(2) - 1) / weight_kn.size(2)),
              kName, ": a packed weight is [ceil(N / panel), K, panel] with panel a multiple of 8, not ",
              weight_kn.sizes(), " for N = ", n);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == m && out.size(1) == n && out.scalar_type() == c10::kFloat &&
                  (n <= 1 || out.stride(1) == 1),
              kName, ": out is [", m, ", ", n, "] float32 with contiguous rows, not ", out.sizes(), " ",
              out.scalar_type());
  small_gemm::Params p;
  const at::Tensor b = bias.contiguous();
  at::Tensor x = input;
  p.bias = b.const_data_ptr<float>();
  if (k > 1 && x.stride(1) != 1) x = x.contiguous();
  p.x = x.const_data_ptr<float>(), p.x_row = x.stride(0);
  p.w = weight_kn.const_data_ptr<float>();
  p.panel = packed ? weight_kn.size(2) : 0;
  p.y = out.data_ptr<float>(), p.y_row = out.stride(0);
  p.m = m, p.k = k, p.n = n;
  p.post = PostOpOf(post_op, kName);
  p.x_scale = scale;
  small_gemm::Run(p);
  return out;
}

at::Tensor& SmallGemmOut(const at::Tensor& input, const at::Tensor& weight_kn, const at::Tensor& bias,
                         c10::string_view post_op, at::Tensor& out) {
  return ScaledOut(input, nullptr, weight_kn, bias, post_op, out);
}

at::Tensor& SmallGemmScaledOut(const at::Tensor& input, const at::Tensor& scale, const at::Tensor& weight_kn,
                               const at::Tensor& bias, c10::string_view post_op, at::Tensor& out) {
  TORCH_CHECK(input.dim() == 2 && scale.dim() == 1 && scale.size(0) == input.size(1) &&
                  scale.scalar_type() == c10::kFloat && scale.device().is_cpu(),
              "torchreplay::small_gemm_scaled: scale is a float32 [K] for a [M, K] input, not ", scale.sizes(), " ",
              scale.scalar_type(), " for ", input.sizes());
  const at::Tensor s = scale.contiguous();
  return ScaledOut(input, s.const_data_ptr<float>(), weight_kn, bias, post_op, out);
}

at::Tensor SmallGemmScaled(const at::Tensor& input, const at::Tensor& scale, const at::Tensor& weight_kn,
                           const at::Tensor& bias, c10::string_view post_op) {
  TORCH_CHECK(input.dim() == 2 && (weight_kn.dim() == 2 || weight_kn.dim() == 3) && bias.dim() == 1, kName,
              ": a 2-d input, a 2-d (or packed 3-d) weight and a 1-d bias, not ", input.sizes(), ", ",
              weight_kn.sizes(), " and ", bias.sizes());
  at::Tensor out = at::empty({input.size(0), weight_kn.dim() == 3 ? bias.size(0) : weight_kn.size(1)},
                             input.options());
  return SmallGemmScaledOut(input, scale, weight_kn, bias, post_op, out);
}

at::Tensor SmallGemm(const at::Tensor& input, const at::Tensor& weight_kn, const at::Tensor& bias,
                     c10::string_view post_op) {
  TORCH_CHECK(input.dim() == 2 && (weight_kn.dim() == 2 || weight_kn.dim() == 3) && bias.dim() == 1, kName,
              ": a 2-d input, a 2-d (or packed 3-d) weight and a 1-d bias, not ", input.sizes(), ", ",
              weight_kn.sizes(), " and ", bias.sizes());
  at::Tensor out = at::empty({input.size(0), weight_kn.dim() == 3 ? bias.size(0) : weight_kn.size(1)},
                             input.options());
  return SmallGemmOut(input, weight_kn, bias, post_op, out);
}

// One size, stride, padding and dilation per spatial dim, [H, W] or [W] (1-d: H is 1).
struct Window {
  int64_t size[2] = {1, 1}, stride[2] = {1, 1}, padding[2] = {0, 0}, dilation[2] = {1, 1};
};

constexpr const char* kConvName = "torchreplay::conv_gemm";

// The output's size along spatial dim d, 0 where the kernel does not fit in the padded input.
int64_t OutSize(const Window& w, int d, int64_t in) {
  const int64_t room = in + 2 * w.padding[d] - w.dilation[d] * (w.size[d] - 1) - 1;
  return room < 0 ? 0 : room / w.stride[d] + 1;
}

// One image's sizes: channels, height and width in and out, the GEMM's K and C_out, and the
// input's strides along C, H and W (H's 0 for a 1-d input).
struct Geometry {
  int64_t c, h, w, oh, ow, k, cout;
  int64_t xs[3];
};

// Image `x`'s zero-padded copy for ConvImage, split into `phases` phases along the row: phase q
// holds padded columns q, q + phases, ...; planes of `plane` floats, rows of `wq`. In a
// thread_local buffer of the calling thread, valid until its next call.
float* PaddedPhases(const float* x, const Window& win, const Geometry& geo, int64_t phases, int64_t wq,
                    int64_t plane) {
  const int64_t c = geo.c, h = geo.h, w = geo.w;
  const int64_t* xs = geo.xs;
  const int64_t hp = h + 2 * win.padding[0], wp = w + 2 * win.padding[1];
  const int64_t pad_top = win.padding[0], pad_left = win.padding[1];
  // Of phase q: its first input column z0 (every phases-th after it, `count` of them),
  // at column `first`: input column z is padded column z + pad_left, column
  // (z + pad_left) / phases of phase (z + pad_left) % phases.
  struct Phase {
    int64_t z0, first, count;
  };
  thread_local std::vector<Phase> phase_of;
  phase_of.clear();
  for (int64_t q = 0; q < phases; ++q) {
    const int64_t z0 = ((q - pad_left) % phases + phases) % phases;
    phase_of.push_back({z0, (z0 + pad_left) / phases, z0 < w ? (w - z0 + phases - 1) / phases : 0});
  }
  thread_local std::vector<float> padded;
  padded.resize(static_cast<size_t>(phases * c * plane));
  // (a thread_local named inside a task is that thread's own: the tasks get pointers)
  float* const base = padded.data();
  const Phase* const phase = phase_of.data();
  const int64_t step = phases * xs[2];  // between one phase's input columns
  // Padded row pr of plane ci, all its phases, per item; the rows over torch's threads.
  at::parallel_for(0, c * hp, std::max<int64_t>(1, 16384 / wp), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t ci = i / hp, pr = i - ci * hp, r = pr - pad_top;
      for (int64_t q = 0; q < phases; ++q) {
        float* to = base + (q * c + ci) * plane + pr * wq;
        if (r < 0 || r >= h) {  // the padding rows above and below, zeros
          std::fill(to, to + wq, 0.f);
          continue;
        }
        const Phase& f = phase[q];
        const float* from = x + ci * xs[0] + r * xs[1] + f.z0 * xs[2];
        std::fill(to, to + f.first, 0.f);
        if (step == 1) {
          std::copy(from, from + f.count, to + f.first);
        } else {
          for (int64_t j = 0; j < f.count; ++j) to[f.first + j] = from[j * step];
        }
        std::fill(to + f.first + f.count, to + wq, 0.f);
      }
    }
  });
  return base;
}

// One image `x` into `y`: each output row as an indirect GEMM over a zero-padded copy of the
// image (`p` the GEMM's parameters, `weight_kn` the weight's [K, C_out] transpose for NHWC). For
// NCHW the copy is split into `stride` phases along the row, so that each tap's output pixels lie
// side by side, a vector: tap (c, i, j) of output row r reads, of plane c, padded row
// r * stride + i * dilation, phase (j * dilation) % stride, from column (j * dilation) / stride on.
// For NHWC, where each pixel's tap is broadcast alone, one phase: the pixels `stride` apart.
void ConvImage(const float* x, float* y, const Window& win, const Geometry& geo, bool nhwc,
               const small_gemm::Params& p, const float* weight_kn) {
  const int64_t c = geo.c, oh = geo.oh, ow = geo.ow, k = geo.k, cout = geo.cout;
  const int64_t s = win.stride[1], phases = nhwc ? 1 : s;
  const int64_t hp = geo.h + 2 * win.padding[0], wp = geo.w + 2 * win.padding[1];
  const int64_t wq = (wp + phases - 1) / phases, plane = hp * wq;  // one phase's row and plane
  float* const base = PaddedPhases(x, win, geo, phases, wq, plane);
  // where each tap of output row 0 starts; output row r reads r * stride rows further
  thread_local std::vector<int64_t> taps;
  taps.clear();
  for (int64_t ci = 0; ci < c; ++ci) {
    for (int64_t a = 0; a < win.size[0]; ++a) {
      for (int64_t j = 0; j < win.size[1]; ++j) {
        const int64_t col = j * win.dilation[1];
        taps.push_back(((col % phases) * c + ci) * plane + a * win.dilation[0] * wq + col / phases);
      }
    }
  }
  const int64_t* const tap = taps.data();
  small_gemm::Params q = p;
  if (nhwc) {  // output row r: [ow pixels, K taps] x [K, C_out], each tap's pixels s apart
    q.x = nullptr, q.x_row = s, q.row_bias = nullptr, q.bias = p.row_bias;
    q.w = weight_kn, q.m = ow, q.n = cout, q.y_row = cout;
  } else {
    q.n = ow;
  }
  // Output rows [r0, r1), each row's product through Run: inline inside a parallel region.
  auto output_rows = [&](int64_t r0, int64_t r1) {
    std::vector<const float*> rows(static_cast<size_t>(k));
    small_gemm::Params t = q;
    (nhwc ? t.x_cols : t.w_rows) = rows.data();
    for (int64_t r = r0; r < r1; ++r) {
      const float* start = base + r * win.stride[0] * wq;
      for (int64_t j = 0; j < k; ++j) rows[j] = start + tap[j];
      t.y = y + r * (nhwc ? ow * cout : ow);
      small_gemm::Run(t);
    }
  };
  // Rows over torch's threads where there are enough of them (each task ~32k multiply-adds
  // or more); else one at a time, each row's columns split inside Run (a 1-d convolution).
  if (oh >= 2 * at::get_num_threads()) {
    at::parallel_for(0, oh, std::max<int64_t>(1, 32768 / std::max<int64_t>(ow * cout * k, 1)), output_rows);
  } else {
    output_rows(0, oh);
  }
}

at::Tensor& ConvGemmOut(const at::Tensor& input, const at::Tensor& weight_rows, const at::Tensor& bias,
                        at::IntArrayRef kernel_size, at::IntArrayRef stride, at::IntArrayRef padding,
                        at::IntArrayRef dilation, c10::string_view post_op, bool channels_last,
                        at::Tensor& out) {
  TORCH_CHECK(small_gemm::Available(), kConvName, ": this CPU has no AVX2 and FMA");
  const int64_t dims = input.dim() - 2;
  TORCH_CHECK((dims == 1 || dims == 2) && input.scalar_type() == c10::kFloat && input.device().is_cpu() &&
                  weight_rows.dim() == 2 && weight_rows.scalar_type() == c10::kFloat && weight_rows.is_contiguous() &&
                  static_cast<int64_t>(kernel_size.size()) == dims && static_cast<int64_t>(stride.size()) == dims &&
                  static_cast<int64_t>(padding.size()) == dims && static_cast<int64_t>(dilation.size()) == dims,
              kConvName, ": a float32 [N, C, W] or [N, C, H, W] input, a contiguous float32 [C_out, C * kernel] "
              "weight and one kernel size, stride, padding and dilation per spatial dim");
  Window win;
  for (int64_t d = 0; d < dims; ++d) {
    const int e = static_cast<int>(d + 2 - dims);
    win.size[e] = kernel_size[d], win.stride[e] = stride[d], win.padding[e] = padding[d];
    win.dilation[e] = dilation[d];
    TORCH_CHECK(win.size[e] > 0 && win.stride[e] > 0 && win.padding[e] >= 0 && win.dilation[e] > 0, kConvName,
                ": a positive kernel size, stride and dilation, and no negative padding");
  }
  const int64_t n = input.size(0), c = input.size(1), h = dims == 2 ? input.size(2) : 1, w = input.size(-1);
  const int64_t oh = OutSize(win, 0, h), ow = OutSize(win, 1, w);
  const int64_t k = c * win.size[0] * win.size[1], cout = weight_rows.size(0);
  TORCH_CHECK(c > 0 && h > 0 && w > 0, kConvName, ": an input without channels or samples, ", input.sizes());
  TORCH_CHECK(oh > 0 && ow > 0, kConvName, ": the kernel is larger than the padded input ", input.sizes());
  TORCH_CHECK(weight_rows.size(1) == k, kConvName, ": the weight has ", weight_rows.size(1),
              " columns, not C * kernel = ", k);
  TORCH_CHECK(bias.dim() == 1 && bias.size(0) == cout && bias.scalar_type() == c10::kFloat && bias.device().is_cpu(),
              kConvName, ": bias is float32 [", cout, "], not ", bias.sizes(), " ", bias.scalar_type());
  std::vector<int64_t> sizes = {n, cout, oh, ow};
  if (dims == 1) sizes.erase(sizes.begin() + 2);
  TORCH_CHECK(!channels_last || dims == 2, kConvName, ": a channels-last result is 4-d, and this input is ",
              input.sizes());
  const at::MemoryFormat format = channels_last ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
  TORCH_CHECK(out.sizes() == at::IntArrayRef(sizes) && out.scalar_type() == c10::kFloat && out.is_contiguous(format),
              kConvName, ": out is a ", channels_last ? "channels-last" : "contiguous", " float32 ",
              at::IntArrayRef(sizes), ", not ", out.sizes(), " ", out.scalar_type(), " of strides ", out.strides());
  const bool nhwc = channels_last && !out.is_contiguous();  // (else both layouts are one)
  const at::Tensor b = bias.contiguous();
  const int64_t xs[3] = {input.stride(1), dims == 2 ? input.stride(2) : 0, input.stride(-1)};
  small_gemm::Params p;
  p.x = weight_rows.const_data_ptr<float>(), p.x_row = k;
  p.row_bias = b.const_data_ptr<float>();
  p.m = cout, p.k = k, p.y_row = oh * ow;
  p.post = PostOpOf(post_op, kConvName);
  // NHWC: the weight's transpose [K, C_out], the GEMM's right side (K * C_out moves a call)
  thread_local std::vector<float> weight_kn;
  if (nhwc) {
    weight_kn.resize(static_cast<size_t>(k * cout));
    const float* wr = weight_rows.const_data_ptr<float>();
    for (int64_t co = 0; co < cout; ++co) {
      for (int64_t t = 0; t < k; ++t) weight_kn[t * cout + co] = wr[co * k + t];
    }
  }
  const Geometry geo{c, h, w, oh, ow, k, cout, {xs[0], xs[1], xs[2]}};
  const bool one_by_one = !nhwc && win.size[0] == 1 && win.size[1] == 1 && win.stride[0] == 1 && win.stride[1] == 1 &&
                          win.padding[0] == 0 && win.padding[1] == 0 && xs[2] == 1 && (dims == 1 || xs[1] == w) &&
                          (c == 1 || xs[0] == h * w);
  for (int64_t i = 0; i < n; ++i) {
    const float* x = input.const_data_ptr<float>() + i * input.stride(0);
    float* y = out.data_ptr<float>() + i * out.stride(0);
    if (one_by_one) {  // the input's planes are the patches
      p.w = x, p.n = oh * ow, p.y = y;
      small_gemm::Run(p);
    } else {
      ConvImage(x, y, win, geo, nhwc, p, weight_kn.data());
    }
  }
  return out;
}

at::Tensor ConvGemm(const at::Tensor& input, const at::Tensor& weight_rows, const at::Tensor& bias,
                    at::IntArrayRef kernel_size, at::IntArrayRef stride, at::IntArrayRef padding,
                    at::IntArrayRef dilation, c10::string_view post_op, bool channels_last) {
  const int64_t dims = input.dim() - 2;
  TORCH_CHECK((dims == 1 || dims == 2) && static_cast<int64_t>(kernel_size.size()) == dims &&
                  static_cast<int64_t>(stride.size()) == dims && static_cast<int64_t>(padding.size()) == dims &&
                  static_cast<int64_t>(dilation.size()) == dims && weight_rows.dim() == 2,
              kConvName, ": a [N, C, W] or [N, C, H, W] input, a 2-d weight and one kernel size, stride, padding "
              "and dilation per spatial dim");
  std::vector<int64_t> sizes = {input.size(0), weight_rows.size(0)};
  for (int64_t d = 0; d < dims; ++d) {
    Window win;
    win.size[0] = kernel_size[d], win.stride[0] = stride[d], win.padding[0] = padding[d], win.dilation[0] = dilation[d];
    TORCH_CHECK(stride[d] > 0, kConvName, ": a positive stride");
    sizes.push_back(std::max<int64_t>(OutSize(win, 0, input.size(d + 2)), 0));
  }
  at::Tensor out = at::empty(sizes, input.options().memory_format(
                                         channels_last && dims == 2 ? at::MemoryFormat::ChannelsLast
                                                                    : at::MemoryFormat::Contiguous));
  return ConvGemmOut(input, weight_rows, bias, kernel_size, stride, padding, dilation, post_op, channels_last, out);
}

}  // namespace

namespace small_gemm {
bool Available() { return HasAvx2AndFma(); }
}  // namespace small_gemm

TORCH_LIBRARY_IMPL(torchreplay, CPU, m) {
  m.impl("small_gemm", &SmallGemm);
  m.impl("small_gemm.out", &SmallGemmOut);
  m.impl("small_gemm_scaled", &SmallGemmScaled);
  m.impl("small_gemm_scaled.out", &SmallGemmScaledOut);
  m.impl("conv_gemm", &ConvGemm);
  m.impl("conv_gemm.out", &ConvGemmOut);
}

}  // namespace torchreplay::capture::kernels
