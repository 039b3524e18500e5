// The small GEMM's two copies (AVX2, AVX-512) against one chain of std::fma per output element
// (Note [Small GEMMs]), bit for bit, over shapes that cut every tile, tail and row block, each read
// of the weight (in place, in panels, by row pointers) and of x (in place, by column pointers),
// each start of the sums, each post-op, and one and two threads.
#include "capture/kernels/small_gemm.h"

#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "capture/kernels/cpu_features.h"

namespace torchreplay::capture::kernels::small_gemm {
namespace {

enum class Start { kZero, kBias, kBiasLast, kRowBias };
enum class Read { kInPlace, kPanels, kRows };

struct Case {
  int64_t m, k, n;
  Start start;
  Read read;
  PostOp post;
  bool x_cols = false;  // x read through column pointers, its rows 2 apart (Params::x_cols)
};

std::string Name(const Case& c) {
  return "m=" + std::to_string(c.m) + " k=" + std::to_string(c.k) + " n=" + std::to_string(c.n) +
         " start=" + std::to_string(static_cast<int>(c.start)) + " read=" + std::to_string(static_cast<int>(c.read)) +
         " post=" + std::to_string(static_cast<int>(c.post)) + " x_cols=" + std::to_string(c.x_cols);
}

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

// Inputs for a case, in the layouts Params names: x [m, k] rows k + 3 apart (or, read through
// column pointers, column k at xt + k * (2 * m + 5), its rows 2 apart), w [k, n], y rows n + 2
// apart.
struct Operands {
  std::vector<float> x, xt, w, packed, bias, row_bias;
  std::vector<const float*> rows, cols;
  int64_t x_row, y_row;

  Operands(const Case& c, uint32_t seed) : x_row(c.k + 3), y_row(c.n + 2) {
    std::mt19937 gen(seed);
    std::normal_distribution<float> normal;
    x.resize(c.m * x_row);
    w.resize(c.k * c.n);
    bias.resize(c.n);
    row_bias.resize(c.m);
    for (float& v : x) v = normal(gen);
    for (float& v : w) v = normal(gen);
    for (float& v : bias) v = normal(gen);
    for (float& v : row_bias) v = normal(gen);
    xt.assign(c.k * (2 * c.m + 5), 0.0f);
    for (int64_t kk = 0; kk < c.k; ++kk) {
      for (int64_t r = 0; r < c.m; ++r) xt[kk * (2 * c.m + 5) + 2 * r] = x[r * x_row + kk];
      cols.push_back(xt.data() + kk * (2 * c.m + 5));
    }
    constexpr int64_t kPanel = 64;
    const int64_t panels = (c.n + kPanel - 1) / kPanel;
    packed.assign(panels * c.k * kPanel, 0.0f);
    for (int64_t kk = 0; kk < c.k; ++kk) {
      for (int64_t col = 0; col < c.n; ++col) {
        packed[(col / kPanel) * c.k * kPanel + kk * kPanel + col % kPanel] = w[kk * c.n + col];
      }
      rows.push_back(w.data() + kk * c.n);
    }
  }

  Params For(const Case& c, float* y) const {
    Params p;
    p.x = x.data(), p.x_row = x_row, p.y = y, p.y_row = y_row, p.m = c.m, p.k = c.k, p.n = c.n;
    p.w = c.read == Read::kPanels ? packed.data() : w.data();
    p.panel = c.read == Read::kPanels ? 64 : 0;
    if (c.read == Read::kRows) p.w_rows = rows.data();
    if (c.x_cols) p.x = nullptr, p.x_cols = cols.data(), p.x_row = 2;
    if (c.start == Start::kBias || c.start == Start::kBiasLast) p.bias = bias.data();
    p.bias_last = c.start == Start::kBiasLast;
    if (c.start == Start::kRowBias) p.row_bias = row_bias.data();
    p.post = c.post;
    return p;
  }

  // What Note [Small GEMMs] says each element is.
  std::vector<float> Expected(const Case& c) const {
    std::vector<float> y(c.m * y_row, 0.0f);
    for (int64_t r = 0; r < c.m; ++r) {
      for (int64_t col = 0; col < c.n; ++col) {
        float acc = c.start == Start::kBias ? bias[col] : c.start == Start::kRowBias ? row_bias[r] : 0.0f;
        for (int64_t kk = 0; kk < c.k; ++kk) acc = std::fma(x[r * x_row + kk], w[kk * c.n + col], acc);
        if (c.start == Start::kBiasLast) acc = bias[col] + acc;
        if (c.post == PostOp::kRelu) acc = 0.0f > acc ? 0.0f : acc;  // maxps(0, acc): acc where NaN, -0 kept
        if (c.post == PostOp::kHardswish) {  // acc * min(max(acc + 3, 0), 6) / 6, maxps's and minps's order
          const float up = acc + 3.0f, lo = up > 0.0f ? up : 0.0f;
          acc = acc * (lo < 6.0f ? lo : 6.0f) / 6.0f;
        }
        if (c.post == PostOp::kHardsigmoid) {  // min(6, max(0, acc + 3)) / 6: NaN kept
          const float up = acc + 3.0f, lo = 0.0f > up ? 0.0f : up;
          acc = (6.0f < lo ? 6.0f : lo) / 6.0f;
        }
        y[r * y_row + col] = acc;
      }
    }
    return y;
  }
};

std::vector<Isa> Copies() {
  std::vector<Isa> isas;
  if (HasAvx2AndFma()) isas.push_back(Isa::kAvx2);
  if (AtenAvx512()) isas.push_back(Isa::kAvx512);
  return isas;
}

std::vector<float> RunCopy(Isa isa, const Case& c, const Operands& ops) {
  std::vector<float> y(c.m * ops.y_row, 0.0f);  // the gaps between rows stay 0
  RunWith(isa, ops.For(c, y.data()));
  return y;
}

void ExpectSameBits(const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size());
  int64_t differ = 0, first = -1;
  for (size_t i = 0; i < got.size(); ++i) {
    if (Bits(got[i]) != Bits(want[i])) {
      if (first < 0) first = static_cast<int64_t>(i);
      ++differ;
    }
  }
  EXPECT_EQ(differ, 0) << what << ": first at " << first << " (" << (first >= 0 ? got[first] : 0.0f) << " vs "
                       << (first >= 0 ? want[first] : 0.0f) << ")";
}

TEST(SmallGemm, EachCopyIsOneFmaChainPerElement) {
  const auto isas = Copies();
  if (isas.empty()) GTEST_SKIP() << "this CPU has no AVX2 and FMA";
  std::vector<Case> cases;
  for (int64_t m : {1, 2, 3, 4, 5, 7, 8, 9, 12, 17, 33, 70}) {
    for (int64_t n : {1, 7, 8, 15, 16, 17, 24, 40, 64, 100, 129, 200}) {
      for (int64_t k : {1, 13, 64}) {
        const int i = static_cast<int>(cases.size());
        cases.push_back({m, k, n, static_cast<Start>(i % 4), static_cast<Read>((i / 4) % 3),
                         static_cast<PostOp>(i % 7 < 3 ? i % 7 + 1 : 0), i % 3 == 1});
      }
    }
  }
  const int threads = at::get_num_threads();
  for (int t : {1, 2}) {
    at::set_num_threads(t);
    for (const Case& c : cases) {
      const Operands ops(c, static_cast<uint32_t>(c.m * 1000 + c.n * 10 + c.k));
      const auto want = ops.Expected(c);
      for (Isa isa : isas) {
        ExpectSameBits(RunCopy(isa, c, ops), want,
                       Name(c) + (isa == Isa::kAvx512 ? " avx512" : " avx2") + " threads=" + std::to_string(t));
      }
    }
  }
  at::set_num_threads(threads);
}

// NaNs of two payloads meeting in one chain (an input's and the bias's): which one an FMA keeps
// depends on the operand order the compiler gave it, so no reference is exact; the two copies
// must agree with each other, and each element is NaN exactly where the reference's is.
TEST(SmallGemm, CopiesAgreeOnNans) {
  const auto isas = Copies();
  if (isas.size() < 2) GTEST_SKIP() << "one copy runs on this CPU";
  const float nan_a = std::numeric_limits<float>::quiet_NaN();
  float nan_b;
  const uint32_t payload = 0x7fc01234u;
  std::memcpy(&nan_b, &payload, sizeof nan_b);
  for (Start start : {Start::kBias, Start::kBiasLast}) {
    for (Read read : {Read::kInPlace, Read::kPanels}) {
      const Case c{9, 13, 40, start, read, start == Start::kBias ? PostOp::kRelu : PostOp::kNone};
      Operands ops(c, 7);
      ops.x[2 * ops.x_row + 5] = nan_a;
      ops.x[8 * ops.x_row + 0] = -nan_a;
      ops.bias[3] = nan_b;
      ops.bias[17] = -nan_b;
      const auto want = ops.Expected(c);
      const auto two = RunCopy(Isa::kAvx2, c, ops), sixteen = RunCopy(Isa::kAvx512, c, ops);
      ExpectSameBits(sixteen, two, Name(c) + " avx512 vs avx2");
      for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(std::isnan(two[i]), std::isnan(want[i])) << i;
    }
  }
}

TEST(SmallGemm, BadSizesRaise) {
  if (!HasAvx2AndFma()) GTEST_SKIP() << "this CPU has no AVX2 and FMA";
  Params p;
  p.m = -1;
  EXPECT_THROW(small_gemm::Run(p), c10::Error);
  p.m = 1, p.panel = 12;
  EXPECT_THROW(small_gemm::Run(p), c10::Error);
}

}  // namespace
}  // namespace torchreplay::capture::kernels::small_gemm
