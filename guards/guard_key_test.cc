// Guard keys: they match without rebuilding, floats by their bits, their diffs say which input
// changed how, and the ambient state (Note [Ambient state]) sees and names each setting it lists.
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/ops/randn.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <functional>
#include <limits>

#include "absl/container/flat_hash_set.h"
#include "guards/guard_key.h"

namespace torchreplay {
namespace {

using ::testing::HasSubstr;

TEST(GuardKeyTest, MatchesExactlyTheInputsItWasBuiltFrom) {
  at::Tensor x = at::randn({4, 3});
  std::vector<c10::IValue> in = {x, int64_t{5}, 0.5};
  guards::GuardKey k = guards::GuardKey::FromInputs(in);
  EXPECT_TRUE(k.Matches(in));
  EXPECT_TRUE(k.Matches({at::randn({4, 3}), int64_t{5}, 0.5}));   // new data, same key
  EXPECT_FALSE(k.Matches({x.t().contiguous().t(), int64_t{5}, 0.5}));  // other strides
  EXPECT_FALSE(k.Matches({x, int64_t{6}, 0.5}));
  EXPECT_FALSE(k.Matches({x.to(at::kDouble), int64_t{5}, 0.5}));
  EXPECT_FALSE(k.Matches({x, int64_t{5}}));
  EXPECT_EQ(k, guards::GuardKey::FromInputs({at::randn({4, 3}), int64_t{5}, 0.5}));
  absl::flat_hash_set<guards::GuardKey> set = {k, guards::GuardKey::FromInputs({x, int64_t{6}, 0.5})};
  EXPECT_EQ(set.size(), 2u);
  EXPECT_TRUE(set.contains(guards::GuardKey::FromInputs(in)));
}

TEST(GuardKeyTest, FloatsMatchByBits) {
  // A scalar baked into a capture: -0.0 must not replay a graph built for 0.0 (x / s flips the
  // sign of inf), and a NaN must keep its key rather than miss it on every call.
  const double nan = std::numeric_limits<double>::quiet_NaN();
  guards::GuardKey zero = guards::GuardKey::FromInputs({0.0});
  EXPECT_FALSE(zero.Matches({-0.0}));
  EXPECT_FALSE(zero == guards::GuardKey::FromInputs({-0.0}));
  guards::GuardKey k = guards::GuardKey::FromInputs({nan});
  EXPECT_TRUE(k.Matches({nan}));
  EXPECT_EQ(k, guards::GuardKey::FromInputs({nan}));
}

TEST(GuardKeyTest, DiffSaysWhichInputChangedHow) {
  auto a = guards::GuardKey::FromInputs({at::randn({100, 128}), int64_t{3}});
  auto b = guards::GuardKey::FromInputs({at::randn({64, 128}), int64_t{5}});
  const std::string d = guards::Diff(a, b);
  EXPECT_THAT(d, HasSubstr("input 0: sizes (100, 128) -> (64, 128)"));
  EXPECT_THAT(d, HasSubstr("input 1: value int=3 -> int=5"));
  EXPECT_EQ(guards::Diff(a, a), "same key");
}

// Note [Ambient state]: each setting the Note lists, changed through ATen's own setter, makes
// Now() differ from before and Diff() name it; put back, Now() equals before again.
TEST(AmbientTest, EachListedSettingIsSeenAndNamed) {
  at::Context& ctx = at::globalContext();
  using B = at::Float32Backend;
  using Op = at::Float32Op;
  auto precision = [&](B b, Op op, const char* p) {
    const at::Float32Precision old = ctx.float32Precision(b, op);
    return std::function<void()>([&ctx, b, op, p, old, set = true]() mutable {
      ctx.setFloat32Precision(b, op, set ? at::str2precision(p) : old);
      set = !set;
    });
  };
  auto toggle = [](auto get, auto set) {
    return std::function<void()>([get, set]() { set(!get()); });
  };
  struct Case {
    const char* named;
    std::function<void()> flip;  // called twice: change, then put back
  };
  const int threads = at::get_num_threads();
  std::vector<Case> cases = {
      {"threads", [threads, set = true]() mutable {
         at::set_num_threads(set ? threads + 1 : threads);
         set = !set;
       }},
      {"default dtype", [set = true]() mutable {
         c10::set_default_dtype(c10::scalarTypeToTypeMeta(set ? at::kDouble : at::kFloat));
         set = !set;
       }},
      {"mkldnn matmul fp32 precision", precision(B::MKLDNN, Op::MATMUL, "bf16")},
      {"mkldnn conv fp32 precision", precision(B::MKLDNN, Op::CONV, "bf16")},
      {"mkldnn rnn fp32 precision", precision(B::MKLDNN, Op::RNN, "bf16")},
      {"cuda matmul fp32 precision", precision(B::CUDA, Op::MATMUL, "tf32")},
      {"cuda conv fp32 precision", precision(B::CUDA, Op::CONV, "ieee")},
      {"cuda rnn fp32 precision", precision(B::CUDA, Op::RNN, "ieee")},
      {"torch.backends.mkldnn.enabled", toggle([&] { return ctx.userEnabledMkldnn(); },
                                               [&](bool b) { ctx.setUserEnabledMkldnn(b); })},
      {"mkldnn deterministic", toggle([&] { return ctx.deterministicMkldnn(); },
                                      [&](bool b) { ctx.setDeterministicMkldnn(b); })},
      {"nnpack", toggle([&] { return ctx.userEnabledNNPACK(); }, [&](bool b) { ctx.setUserEnabledNNPACK(b); })},
      {"cpu fp16 reduced-precision reduction",
       toggle([&] { return ctx.allowFP16ReductionCPU(); }, [&](bool b) { ctx.setAllowFP16ReductionCPU(b); })},
      {"deterministic algorithms", toggle([&] { return ctx.deterministicAlgorithms(); },
                                          [&](bool b) { ctx.setDeterministicAlgorithms(b, false); })},
      {"cudnn enabled", toggle([&] { return ctx.userEnabledCuDNN(); }, [&](bool b) { ctx.setUserEnabledCuDNN(b); })},
      {"cudnn benchmark", toggle([&] { return ctx.benchmarkCuDNN(); }, [&](bool b) { ctx.setBenchmarkCuDNN(b); })},
      {"cudnn deterministic",
       toggle([&] { return ctx.deterministicCuDNN(); }, [&](bool b) { ctx.setDeterministicCuDNN(b); })},
      {"cublas fp16 accumulation", toggle([&] { return ctx.allowFP16AccumulationCuBLAS(); },
                                          [&](bool b) { ctx.setAllowFP16AccumulationCuBLAS(b); })},
  };
  const guards::Ambient before = guards::Ambient::Now();
  for (Case& c : cases) {
    try {
      c.flip();
    } catch (const c10::Error&) {  // a setting this CPU refuses (fp16 reduction without fp16 arithmetic)
      continue;
    }
    const guards::Ambient changed = guards::Ambient::Now();
    c.flip();
    EXPECT_NE(changed, before) << c.named;
    EXPECT_THAT(guards::Ambient::Diff(before, changed), HasSubstr(c.named));
    EXPECT_EQ(guards::Ambient::Now(), before) << c.named << ": not put back";
  }
  EXPECT_EQ(guards::Ambient::Diff(before, guards::Ambient::Now()), "the same");
  // A key on CPU tensors leaves the CUDA settings unread.
  const guards::Ambient cpu = guards::Ambient::Now(/*cuda=*/false);
  ctx.setUserEnabledCuDNN(!ctx.userEnabledCuDNN());
  EXPECT_EQ(guards::Ambient::Now(/*cuda=*/false), cpu);
  EXPECT_NE(guards::Ambient::Now(/*cuda=*/true), before);
  ctx.setUserEnabledCuDNN(!ctx.userEnabledCuDNN());
}

// Keys of the same inputs under other settings differ, by those settings alone.
TEST(AmbientTest, SettingsArePartOfTheKey) {
  const std::vector<c10::IValue> inputs = {at::randn({2, 3})};
  guards::GuardKey one = guards::GuardKey::FromInputs(inputs), two = one;
  guards::Ambient a = guards::Ambient::Now(false);
  one.set_settings(a);
  a.threads += 1;
  two.set_settings(a);
  EXPECT_FALSE(one == two);
  EXPECT_NE(absl::Hash<guards::GuardKey>()(one), absl::Hash<guards::GuardKey>()(two));
  EXPECT_THAT(guards::Diff(one, two), HasSubstr("threads"));
  EXPECT_TRUE(two.Matches(inputs));
}
}  // namespace
}  // namespace torchreplay
