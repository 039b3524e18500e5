// The engine in C++ alone: one capture per guard key, the capture limit, a static input that
// moves, outputs kept across calls (invalidated, or cloned), the dump of a captured key, a kernel
// that fails in a replay (the call's tensors dropped), an allocation that fails in a capture.
#include "replay/engine.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/randn.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>

#include "memory_pool/arena.h"

namespace torchreplay::replay {
namespace {

using ::testing::HasSubstr;

// w (static), x: relu(x @ w) + 1.
std::shared_ptr<const capture::Graph> Model() {
  capture::GraphBuilder b;
  const auto w = b.AddInput("w", capture::ValueType::kTensor);
  const auto x = b.AddInput("x", capture::ValueType::kTensor);
  auto mm = b.AddOp("aten::mm", {capture::Arg::Ref(x), capture::Arg::Ref(w)});
  auto r = b.AddOp("aten::relu", {capture::Arg::Ref((*mm)[0])});
  auto y = b.AddOp("aten::add.Tensor", {capture::Arg::Ref((*r)[0]), capture::Arg::Const(1.0)});
  EXPECT_TRUE(b.SetOutputs({capture::Arg::Ref((*y)[0])}).ok());
  EXPECT_TRUE(b.SetStaticInputs({0}).ok());
  return *b.Build();
}

at::Tensor Eager(const at::Tensor& w, const at::Tensor& x) { return x.mm(w).relu().add(1.0); }

at::Tensor RunOne(Engine& e, const at::Tensor& w, const at::Tensor& x) {
  auto out = e.Run({w, x});
  EXPECT_TRUE(out.ok()) << out.status();
  return (*out)[0].toTensor();
}

EngineOptions Options() {
  EngineOptions o = EngineOptions::Defaults();
  o.name = "model";
  return o;
}

TEST(EngineTest, OneCapturePerKeyThenReplays) {
  Engine e(Model(), Options());
  const at::Tensor w = at::randn({8, 8});
  for (int64_t rows : {2, 2, 2, 5, 5, 2, 5}) {
    const at::Tensor x = at::randn({rows, 8});
    EXPECT_TRUE(at::equal(RunOne(e, w, x), Eager(w, x)));
  }
  const EngineStats s = e.stats();
  EXPECT_EQ(s.calls, 7);
  EXPECT_EQ(s.warmups, 2);   // one per key (warmup_iters = 1)
  EXPECT_EQ(s.captures, 2);  // one per key
  EXPECT_EQ(s.replays, 5);
  ASSERT_EQ(s.capture_log.size(), 2u);
  EXPECT_EQ(s.capture_log[0].reason, "no graph yet");
  EXPECT_THAT(s.capture_log[1].reason, HasSubstr("input 1"));  // the key diff names x
}

TEST(EngineTest, KeysBeyondTheCaptureLimitRunEagerlyWithTheReason) {
  EngineOptions o = Options();
  o.capture_limit = 1;
  Engine e(Model(), o);
  const at::Tensor w = at::randn({8, 8});
  for (int call = 0; call < 3; ++call) {
    for (int64_t rows : {2, 3}) {
      const at::Tensor x = at::randn({rows, 8});
      EXPECT_TRUE(at::equal(RunOne(e, w, x), Eager(w, x)));
    }
  }
  const EngineStats s = e.stats();
  EXPECT_EQ(s.captures, 1);
  EXPECT_EQ(s.eager_fallbacks, 3);
  ASSERT_EQ(s.fallback_reasons.size(), 1u);  // logged once
  EXPECT_THAT(s.fallback_reasons[0], HasSubstr("capture limit (1 keys) reached"));
}

TEST(EngineTest, StaticInputThatMovesIsRecapturedNeverReplayedStale) {
  Engine e(Model(), Options());
  const at::Tensor x = at::randn({2, 8});
  at::Tensor w = at::randn({8, 8});
  for (int call = 0; call < 3; ++call) EXPECT_TRUE(at::equal(RunOne(e, w, x), Eager(w, x)));
  w = at::randn({8, 8});  // same key, new address and values
  for (int call = 0; call < 3; ++call) EXPECT_TRUE(at::equal(RunOne(e, w, x), Eager(w, x)));
  const EngineStats s = e.stats();
  EXPECT_EQ(s.captures, 2);
  EXPECT_THAT(s.capture_log.back().reason, HasSubstr("static input 0 (w) moved"));
}

TEST(EngineTest, KeptOutputIsInvalidatedByTheNextReplayUnlessCloned) {
  const at::Tensor w = at::randn({8, 8});
  const at::Tensor x1 = at::randn({2, 8}), x2 = at::randn({2, 8});
  {
    Engine e(Model(), Options());
    RunOne(e, w, x1);  // warm-up
    at::Tensor kept = RunOne(e, w, x1);
    RunOne(e, w, x2);
    try {
      (void)kept.sum();
      ADD_FAILURE() << "a stale output was readable";
    } catch (const c10::Error& err) {
      EXPECT_THAT(err.what(), HasSubstr("a later replay has reused its memory"));
    }
  }
  EngineOptions o = Options();
  o.clone_outputs = true;
  Engine e(Model(), o);
  RunOne(e, w, x1);
  at::Tensor kept = RunOne(e, w, x1);
  RunOne(e, w, x2);
  EXPECT_TRUE(at::equal(kept, Eager(w, x1)));
}

// x, idx: index_select(x, 0, idx) * 2, or with `list` x[idx] (aten::index, the index in a list
// argument) * 2. The kernel raises for an index out of range.
std::shared_ptr<const capture::Graph> Gather(bool list) {
  capture::GraphBuilder b;
  const auto x = b.AddInput("x", capture::ValueType::kTensor);
  const auto idx = b.AddInput("idx", capture::ValueType::kTensor);
  auto g = list ? b.AddOp("aten::index.Tensor",
                          {capture::Arg::Ref(x), capture::Arg::List({capture::Arg::Ref(idx)})})
                : b.AddOp("aten::index_select", {capture::Arg::Ref(x), capture::Arg::Const(int64_t{0}),
                                                 capture::Arg::Ref(idx)});
  EXPECT_TRUE(g.ok()) << g.status();
  auto y = b.AddOp("aten::mul.Tensor", {capture::Arg::Ref((*g)[0]), capture::Arg::Const(2.0)});
  EXPECT_TRUE(b.SetOutputs({capture::Arg::Ref((*y)[0])}).ok());
  return *b.Build();
}

at::Tensor Index(int64_t a, int64_t b) {
  at::Tensor t = at::empty({2}, at::kLong);
  t.data_ptr<int64_t>()[0] = a;
  t.data_ptr<int64_t>()[1] = b;
  return t;
}

TEST(EngineTest, KernelFailureDuringReplayIsAnErrorAndTheNextCallReplays) {
  Engine e(Gather(/*list=*/false), Options());
  const at::Tensor x = at::randn({5, 3});
  auto check = [&](const at::Tensor& idx) {
    auto out = e.Run({x, idx});
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_TRUE(at::equal((*out)[0].toTensor(), x.index_select(0, idx).mul(2.0)));
  };
  for (int64_t i = 0; i < 3; ++i) check(Index(i, 4));
  for (int64_t k = 0; k < 2; ++k) {
    auto bad = e.Run({x, Index(1, 9 + k)});  // same key: the replay's kernel raises
    ASSERT_FALSE(bad.ok());
    EXPECT_THAT(bad.status().message(), HasSubstr("index out of range"));
    check(Index(k, 3));
  }
  const EngineStats s = e.stats();
  EXPECT_EQ(s.errors, 2);
  EXPECT_THAT(s.last_error, HasSubstr("index out of range"));
  EXPECT_EQ(s.captures, 1);
  EXPECT_EQ(s.replays, 4);  // the two failed replays are not counted
  EXPECT_EQ(s.eager_fallbacks, 0);
  EXPECT_EQ(s.cache_entries, 1);
  EXPECT_EQ(s.handed_out, 1);  // the latest replay's output
}

TEST(EngineTest, AllocationFailureDuringCaptureRunsTheKeyEagerlyWithTheReason) {
  Engine e(Model(), Options());
  const at::Tensor w = at::randn({8, 8});
  memory_pool::FailAllocationsForTesting(1);  // the first capture's arena growth fails
  for (int call = 0; call < 4; ++call) {
    const at::Tensor x = at::randn({3, 8});
    EXPECT_TRUE(at::equal(RunOne(e, w, x), Eager(w, x)));
  }
  memory_pool::FailAllocationsForTesting(0);
  const EngineStats s = e.stats();
  EXPECT_EQ(s.captures, 0);
  EXPECT_EQ(s.eager_fallbacks, 3);  // the call that tried to capture, and the two after it
  EXPECT_EQ(s.errors, 0);
  EXPECT_EQ(s.pool_bytes, 0);
  ASSERT_EQ(s.fallback_reasons.size(), 1u);
  EXPECT_THAT(s.fallback_reasons[0], HasSubstr("capture failed"));
  EXPECT_THAT(s.fallback_reasons[0], HasSubstr("simulated by _testing_fail_allocations"));
}

TEST(EngineTest, FailedReplayKeepsNoneOfTheCallsTensorsAlive) {
  for (bool list : {false, true}) {  // with list: the failing step's own list argument holds idx
    Engine e(Gather(list), Options());
    const at::Tensor x = at::randn({5, 3});
    for (int64_t i = 0; i < 3; ++i) ASSERT_TRUE(e.Run({x, Index(i, 1)}).ok());
    const at::Tensor bad_x = at::randn({5, 3});
    const at::Tensor bad_idx = Index(7, 1);
    ASSERT_FALSE(e.Run({bad_x, bad_idx}).ok());
    EXPECT_EQ(bad_x.use_count(), 1) << "list " << list;
    EXPECT_EQ(bad_idx.use_count(), 1) << "list " << list;
    auto out = e.Run({x, Index(3, 4)});
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_TRUE(at::equal((*out)[0].toTensor(), x.index_select(0, Index(3, 4)).mul(2.0)));
  }
}

TEST(EngineTest, DumpDirGetsEachCapturedKeysPlan) {
  EngineOptions o = Options();
  o.dump_dir = ::testing::TempDir();
  Engine e(Model(), o);
  const at::Tensor w = at::randn({8, 8});
  for (int call = 0; call < 2; ++call) RunOne(e, w, at::randn({2, 8}));
  std::ifstream f(o.dump_dir + "/torchreplay_model.key0.txt");
  ASSERT_TRUE(f.good());
  std::stringstream text;
  text << f.rdbuf();
  // Each node with the step it became (which GEMM kernel: timed at capture, so not asserted).
  EXPECT_THAT(text.str(), HasSubstr("%aten::mm = aten::mm: out= "));
  EXPECT_THAT(text.str(), HasSubstr("%aten::relu = aten::relu: out= "));
  EXPECT_THAT(text.str(), HasSubstr("arena: "));
}

// A fake environment for EngineOptions::FromEnvironment.
std::map<std::string, std::string> g_env;
const char* FakeGetEnv(const char* name) {
  auto it = g_env.find(name);
  return it == g_env.end() ? nullptr : it->second.c_str();
}

TEST(EngineTest, SwitchesComeFromTheEnvironment) {
  g_env = {};
  EngineOptions o = EngineOptions::FromEnvironment(&FakeGetEnv);
  EXPECT_TRUE(o.prepared_steps);
  EXPECT_TRUE(o.fuse_elementwise);
  EXPECT_EQ(o.log_level, LogLevel::kWarning);
  g_env = {{"TORCHREPLAY_FUSE", "0"}, {"TORCHREPLAY_LOG_LEVEL", "1"}};
  o = EngineOptions::FromEnvironment(&FakeGetEnv);
  EXPECT_TRUE(o.prepared_steps);
  EXPECT_FALSE(o.fuse_elementwise);
  EXPECT_EQ(o.log_level, LogLevel::kInfo);
  g_env = {{"TORCHREPLAY_PREPARED_ITERATORS", "0"}, {"TORCHREPLAY_FUSE", "1"},
           {"TORCHREPLAY_LOG_LEVEL", "7"}};
  o = EngineOptions::FromEnvironment(&FakeGetEnv);
  EXPECT_FALSE(o.prepared_steps);
  EXPECT_TRUE(o.fuse_elementwise);
  EXPECT_EQ(o.log_level, LogLevel::kError);  // clamped
}

TEST(EngineTest, SetLogLevelSetsTheLevelOfEnginesMadeAfterwards) {
  const LogLevel before = DefaultLogLevel();
  SetLogLevel(LogLevel::kError);
  EXPECT_EQ(EngineOptions::Defaults().log_level, LogLevel::kError);
  SetLogLevel(LogLevel::kDebug);
  EXPECT_EQ(EngineOptions::Defaults().log_level, LogLevel::kDebug);
  SetLogLevel(before);
}

std::vector<std::pair<LogLevel, std::string>> g_logged;
void KeepLogged(LogLevel level, const std::string& message) { g_logged.emplace_back(level, message); }

TEST(EngineTest, MessagesAtOrAboveTheEnginesLevelGoToTheSink) {
  g_logged.clear();
  SetLogSink(&KeepLogged);
  EngineOptions o = Options();
  o.capture_limit = 1;
  o.log_level = LogLevel::kInfo;
  Engine e(Model(), o);
  const at::Tensor w = at::randn({8, 8});
  for (int64_t rows : {2, 2, 3}) RunOne(e, w, at::randn({rows, 8}));  // capture, then over the limit
  o.log_level = LogLevel::kError;
  Engine quiet(Model(), o);
  for (int64_t rows : {2, 2, 3}) RunOne(quiet, w, at::randn({rows, 8}));
  SetLogSink(nullptr);
  ASSERT_EQ(g_logged.size(), 2u);
  EXPECT_EQ(g_logged[0].first, LogLevel::kInfo);
  EXPECT_THAT(g_logged[0].second, HasSubstr("graph 'model': captured key"));
  EXPECT_EQ(g_logged[1].first, LogLevel::kWarning);
  EXPECT_THAT(g_logged[1].second, HasSubstr("capture limit (1 keys) reached"));
}

}  // namespace
}  // namespace torchreplay::replay
