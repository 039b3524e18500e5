// A GRU layer's steps in one call (Note [GRU steps] in recurrent.h), with AVX2 and FMA through
// ATen's Vectorized<float> (flags in capture/tape/BUILD).
#include "capture/kernels/recurrent.h"

#include <ATen/cpu/vec/vec.h>
#include <c10/util/Exception.h>

#include <algorithm>

#include "capture/kernels/small_gemm.h"

namespace torchreplay::capture::kernels::recurrent {

#if defined(__AVX2__) && defined(__FMA__)

namespace {

using at::vec::Vectorized;
using Vec = Vectorized<float>;

// tanh as Eigen computes it for float: a 13/6 rational function of x clamped to +-7.90531111
// (where tanh rounds to +-1); within 4e-7 of torch.tanh over [-12, 12]. NaN stays NaN.
Vec Tanh(Vec x) {
  x = at::vec::clamp(x, Vec(-7.90531110763549805f), Vec(7.90531110763549805f));
  const Vec x2 = x * x;
  Vec p(-2.76076847742355e-16f);
  for (float c : {2.00018790482477e-13f, -8.60467152213735e-11f, 5.12229709037114e-08f, 1.48572235717979e-05f,
                  6.37261928875436e-04f, 4.89352455891786e-03f}) {
    p = at::vec::fmadd(p, x2, Vec(c));
  }
  Vec q(1.19825839466702e-06f);
  for (float c : {1.18534705686654e-04f, 2.26843463243900e-03f, 4.89352518554385e-03f}) q = at::vec::fmadd(q, x2, Vec(c));
  return p * x / q;
}

// sigmoid(x) = (1 + tanh(x / 2)) / 2: within 2.4e-7 of torch.sigmoid (absolute; relatively less
// close where sigmoid is below ~1e-6).
Vec Sigmoid(Vec x) { return at::vec::fmadd(Vec(0.5f), Tanh(Vec(0.5f) * x), Vec(0.5f)); }

// One row's gates: h_next = n + z * (h - n), `count` lanes (a whole vector, or the last few).
void Gates(const float* gi, const float* gh, const float* h, float* h_next, int64_t hidden, int64_t j,
           int count) {
  auto load = [&](const float* p) { return Vec::loadu(p + j, count); };
  const Vec r = Sigmoid(load(gi) + load(gh));
  const Vec z = Sigmoid(load(gi + hidden) + load(gh + hidden));
  const Vec n = Tanh(load(gi + 2 * hidden) + r * load(gh + 2 * hidden));
  const Vec next = at::vec::fmadd(z, load(h) - n, n);
  next.store(h_next + j, count);
}

}  // namespace

void GruSteps(const GruParams& p) {
  TORCH_CHECK(p.t >= 0 && p.b >= 0 && p.h >= 0, "torchreplay: GRU steps got a negative size");
  const int64_t hidden = p.h, gates = 3 * hidden;
  small_gemm::Params q;
  q.w = p.w_hh, q.bias = p.b_hh, q.y = p.gh, q.y_row = gates;
  q.m = p.b, q.k = hidden, q.n = gates, q.x_row = hidden;
  for (int64_t t = 0; t < p.t; ++t) {
    const float* h = t == 0 ? p.h0 : p.out + (t - 1) * p.b * hidden;
    float* h_next = p.out + t * p.b * hidden;
    q.x = h;
    small_gemm::Run(q);
    for (int64_t b = 0; b < p.b; ++b) {
      const float* gi = p.gi + (t * p.b + b) * gates;
      const float* gh = p.gh + b * gates;
      int64_t j = 0;
      for (; j + Vec::size() <= hidden; j += Vec::size()) {
        Gates(gi, gh, h + b * hidden, h_next + b * hidden, hidden, j, Vec::size());
      }
      if (j < hidden) Gates(gi, gh, h + b * hidden, h_next + b * hidden, hidden, j, static_cast<int>(hidden - j));
    }
  }
}

#else  // no AVX2: small_gemm::Available() is false, and nothing calls GruSteps

void GruSteps(const GruParams&) { TORCH_CHECK(false, "torchreplay: the GRU steps need AVX2 and FMA"); }

#endif

}  // namespace torchreplay::capture::kernels::recurrent
