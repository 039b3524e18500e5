// The CPU kernel tape against the interpreter (the eager reference), in C++ alone: captured on one
// input set, replayed on others at new addresses; a larger key growing the shared arena; prepared
// pointwise steps actually taken (and the same results without them); the printed plan.
#include "capture/tape/fused/fused_elementwise.h"
#include "capture/tape/kernel_tape.h"

#include <ATen/ops/arange.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/rand.h>
#include <ATen/ops/randn.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <limits>
#include <random>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "guards/guard_key.h"
#include "capture/ir/interpreter.h"
#include "capture/ir/recording.h"
#include "capture/ir/testing.h"
#include "memory_pool/arena.h"
#include "capture/tape/step_kinds.h"
#include "capture/tape/tape_plan.h"

namespace torchreplay::capture::tape {
namespace {

using ::testing::HasSubstr;

using testing::Op;

// w (static), x, acc: y = relu(x @ w.t() + 1) * 0.5 - sin(x @ w.t()); acc.add_(y) in place; the
// graph returns y, acc and y's first half from a split (a getitem of a per-call list).
std::shared_ptr<const Graph> Model() {
  GraphBuilder b;
  const ValueId w = b.AddInput("w", ValueType::kTensor);
  const ValueId x = b.AddInput("x", ValueType::kTensor);
  const ValueId acc = b.AddInput("acc", ValueType::kTensor);
  const ValueId wt = Op(b, "aten::t", {Arg::Ref(w)});
  const ValueId mm = Op(b, "aten::mm", {Arg::Ref(x), Arg::Ref(wt)});
  const ValueId h = Op(b, "aten::add.Tensor", {Arg::Ref(mm), Arg::Const(1.0)});
  const ValueId r = Op(b, "aten::relu", {Arg::Ref(h)});
  const ValueId s = Op(b, "aten::mul.Tensor", {Arg::Ref(r), Arg::Const(0.5)});
  const ValueId sn = Op(b, "aten::sin", {Arg::Ref(mm)});
  const ValueId y = Op(b, "aten::sub.Tensor", {Arg::Ref(s), Arg::Ref(sn)});
  Op(b, "aten::add_.Tensor", {Arg::Ref(acc), Arg::Ref(y)});
  const ValueId parts = Op(b, "aten::split.Tensor", {Arg::Ref(y), Arg::Const(int64_t{2})});
  auto first = b.AddGetItem(parts, 0);
  EXPECT_TRUE(first.ok());
  EXPECT_TRUE(b.SetOutputs({Arg::Ref(y), Arg::Ref(acc), Arg::Ref(*first)}).ok());
  EXPECT_TRUE(b.SetStaticInputs({0}).ok());
  auto g = b.Build();
  EXPECT_TRUE(g.ok()) << g.status();
  return *g;
}

std::vector<c10::IValue> Inputs(const at::Tensor& w, int64_t rows) {
  return {w, at::randn({rows, 8}), at::randn({rows, 16})};
}

std::vector<c10::IValue> Clone(const std::vector<c10::IValue>& in) {
  std::vector<c10::IValue> out;
  for (const auto& v : in) out.push_back(v.isTensor() ? c10::IValue(v.toTensor().clone()) : v);
  return out;
}

std::unique_ptr<CapturedGraph> Capture(const std::shared_ptr<const Graph>& g,
                                       const std::vector<c10::IValue>& inputs,
                                       memory_pool::Arena* arena, CaptureOptions options = {}) {
  Interpreter interp(g);
  Recording rec;
  auto warm = RunAndRecord(interp, Clone(inputs), &rec, CheckTapeNode);
  EXPECT_TRUE(warm.ok()) << warm.status();
  auto tape = CaptureKernelTape(g, rec, inputs, arena, options);
  EXPECT_TRUE(tape.ok()) << tape.status();
  return std::move(*tape);
}

// Replays `tape` on `inputs` and checks outputs and the mutated input against the interpreter
// run on copies of the same inputs, bitwise.
void ExpectReplayEqualsEager(CapturedGraph& tape, const std::shared_ptr<const Graph>& g,
                             const std::vector<c10::IValue>& inputs) {
  std::vector<c10::IValue> eager_in = Clone(inputs);
  auto want = Interpreter(g).Run(eager_in);
  ASSERT_TRUE(want.ok()) << want.status();
  std::vector<c10::IValue> got;
  ASSERT_TRUE(tape.Replay(inputs, &got).ok());
  ASSERT_EQ(got.size(), want->size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_TRUE(at::equal(got[i].toTensor(), (*want)[i].toTensor())) << "output " << i;
  }
  EXPECT_TRUE(at::equal(inputs[2].toTensor(), eager_in[2].toTensor())) << "acc.add_ in place";
}

// Fused elementwise steps are off unless a test is about them (fused::RunSegment needs AVX2).
CaptureOptions Unfused() {
  CaptureOptions o;
  o.fuse_elementwise = false;
  return o;
}

TEST(KernelTapeTest, ReplaysOnNewInputsBitwiseAsTheInterpreter) {
  const auto g = Model();
  const at::Tensor w = at::randn({16, 8});
  memory_pool::Arena arena;
  auto tape = Capture(g, Inputs(w, 4), &arena, Unfused());
  for (int call = 0; call < 3; ++call) ExpectReplayEqualsEager(*tape, g, Inputs(w, 4));
  const CaptureInfo& info = tape->info();
  EXPECT_EQ(info.nodes, 10);
  EXPECT_EQ(info.out_variant_steps, 6);  // mm, add, relu, mul, sin, sub write into the arena
  EXPECT_EQ(info.precomputed, 3);        // w.t() of the static w; the split of y and its [0]
  EXPECT_EQ(info.steps, 7);              // the six out= steps and acc.add_
  EXPECT_GT(info.arena_bytes, 0);
  EXPECT_LT(info.arena_bytes, info.tensor_bytes);  // liveness lets buffers share memory
  EXPECT_TRUE(tape->OutputInPool(0));
  EXPECT_FALSE(tape->OutputInPool(1));  // acc is the caller's tensor
  EXPECT_TRUE(tape->OutputInPool(2));   // a view of y's buffer
}

// Note [Fused elementwise steps]: add, relu, mul, sin and sub, one after another over one
// iteration space, and acc.add_ in place into acc (Note [In-place instructions]) are one step
// (where the CPU runs the fused kernel), bitwise as the interpreter.
TEST(KernelTapeTest, ElementwiseRunsAreOneFusedStep) {
  if (!fused::FusionAvailable()) GTEST_SKIP() << "no AVX2: nothing is fused";
  const auto g = Model();
  const at::Tensor w = at::randn({16, 8});
  memory_pool::Arena arena;
  auto tape = Capture(g, Inputs(w, 4), &arena);
  for (int call = 0; call < 3; ++call) ExpectReplayEqualsEager(*tape, g, Inputs(w, 4));
  const CaptureInfo& info = tape->info();
  EXPECT_EQ(info.fused_steps, 1);
  EXPECT_EQ(info.fused_nodes, 6);
  EXPECT_EQ(info.steps, 2);  // mm, the fused step
  Interpreter interp(g);
  Recording rec;
  ASSERT_TRUE(RunAndRecord(interp, Inputs(w, 4), &rec, CheckTapeNode).ok());
  auto plan = PlanTape(*g, rec, /*fuse=*/true);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_THAT(plan->ToString(*g), HasSubstr("aten::relu: out= fused 0 (clamp_min) aten::clamp_min.out"));
  EXPECT_THAT(plan->ToString(*g), HasSubstr("aten::add_.Tensor: functional fused 0 (add) in place"));
  // The dump: the group's last node is the fused step; the others say whose step computes them.
  auto path = tape->Dump(::testing::TempDir() + "fused_group");
  ASSERT_TRUE(path.ok()) << path.status();
  std::ifstream f(*path);
  const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  for (const absl::string_view line : absl::StrSplit(text, '\n')) {
    if (absl::StrContains(line, "aten::relu:")) EXPECT_THAT(std::string(line), HasSubstr("; step: in the fused step of "));
    if (absl::StrContains(line, "aten::add_.Tensor:")) EXPECT_THAT(std::string(line), HasSubstr("; step: fused elementwise"));
  }
  EXPECT_THAT(text, HasSubstr("; step: fused elementwise")) << text;
}

// Note [In-place instructions]: a fused group that writes an input in place, on calls where the
// kernel meets two NaNs in a mul (whose NaN eager keeps it does not promise): the step puts back
// what it overwrote, then each node of the segment runs through its own kernel; the input and
// the result end bitwise as the interpreter leaves them, NaN payloads included.
TEST(KernelTapeTest, InPlaceGroupsPutBackWhatTheyOverwroteBeforeRunningAgain) {
  if (!fused::FusionAvailable()) GTEST_SKIP() << "no AVX2: nothing is fused";
  GraphBuilder b;
  const ValueId x = b.AddInput("x", ValueType::kTensor);
  const ValueId y = b.AddInput("y", ValueType::kTensor);
  Op(b, "aten::mul_.Tensor", {Arg::Ref(x), Arg::Ref(y)});
  Op(b, "aten::add_.Scalar", {Arg::Ref(x), Arg::Const(0.5)});
  const ValueId z = Op(b, "aten::mul.Tensor", {Arg::Ref(x), Arg::Ref(y)});
  ASSERT_TRUE(b.SetOutputs({Arg::Ref(z), Arg::Ref(x)}).ok());
  auto built = b.Build();
  ASSERT_TRUE(built.ok()) << built.status();
  const std::shared_ptr<const Graph> g = *built;
  auto inputs = [](bool nans) {
    at::Tensor x = at::randn({1000}), y = at::randn({1000});
    if (nans) {  // two payloads, at the same places in both
      x.view(at::kInt).slice(0, 3, 1000, 7).fill_(0x7fc00123);
      y.view(at::kInt).slice(0, 3, 1000, 7).fill_(static_cast<int32_t>(0xffc00456));
    }
    return std::vector<c10::IValue>{x, y};
  };
  auto same_bits = [](const at::Tensor& a, const at::Tensor& b) { return at::equal(a.view(at::kInt), b.view(at::kInt)); };
  memory_pool::Arena arena;
  auto tape = Capture(g, inputs(false), &arena);
  EXPECT_EQ(tape->info().steps, 1);
  EXPECT_EQ(tape->info().fused_nodes, 3);
  for (int call = 0; call < 4; ++call) {
    const std::vector<c10::IValue> in = inputs(call % 2 == 1);
    std::vector<c10::IValue> eager_in = Clone(in);
    auto want = Interpreter(g).Run(eager_in);
    ASSERT_TRUE(want.ok()) << want.status();
    std::vector<c10::IValue> got;
    ASSERT_TRUE(tape->Replay(in, &got).ok());
    EXPECT_TRUE(same_bits(got[0].toTensor(), (*want)[0].toTensor())) << "call " << call;
    EXPECT_TRUE(same_bits(in[0].toTensor(), eager_in[0].toTensor())) << "call " << call << ": x written in place";
  }
}

// Note [Checked out= kernels] and Note [One storage per buffer]: binary_cross_entropy.out writes
// the unreduced loss into its 0-dim `out` before reducing (in the arena it wrote over its
// neighbours), so it runs functionally; linalg_qr.out picks its path by whether R shares Q's
// storage (in one arena storage it wrote Q from R, or asserted), so it keeps its out= step on
// buffers that are storages of their own. Both bitwise as the interpreter, on several inputs.
TEST(KernelTapeTest, OutKernelsThatMisuseTheirOutputsRunAsEagerDoes) {
  GraphBuilder b;
  const ValueId x = b.AddInput("x", ValueType::kTensor);
  const ValueId t = b.AddInput("t", ValueType::kTensor);
  const ValueId a = b.AddInput("a", ValueType::kTensor);
  const ValueId p = Op(b, "aten::sigmoid", {Arg::Ref(x)});
  const ValueId loss = Op(b, "aten::binary_cross_entropy", {Arg::Ref(p), Arg::Ref(t)});
  auto qr = b.AddOp("aten::linalg_qr", {Arg::Ref(a)});
  ASSERT_TRUE(qr.ok()) << qr.status();
  const ValueId q2 = Op(b, "aten::mul.Tensor", {Arg::Ref((*qr)[0]), Arg::Const(2.0)});
  ASSERT_TRUE(b.SetOutputs({Arg::Ref(loss), Arg::Ref(q2), Arg::Ref((*qr)[1])}).ok());
  auto g = b.Build();
  ASSERT_TRUE(g.ok()) << g.status();
  auto inputs = [] {
    return std::vector<c10::IValue>{at::randn({5}), at::rand({5}), at::randn({5, 2})};
  };
  memory_pool::Arena arena;
  Interpreter interp(*g);
  Recording rec;
  ASSERT_TRUE(RunAndRecord(interp, inputs(), &rec, CheckTapeNode).ok());
  auto plan = PlanTape(**g, rec, /*fuse=*/true);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const std::string text = plan->ToString(**g);
  EXPECT_THAT(text, HasSubstr("aten::binary_cross_entropy: functional (aten::binary_cross_entropy.out "
                              "refused: it raised: Trying to resize storage that is not resizable"));
  EXPECT_THAT(text, HasSubstr("aten::linalg_qr: out= aten::linalg_qr.out"));
  auto tape = CaptureKernelTape(*g, rec, inputs(), &arena, {});
  ASSERT_TRUE(tape.ok()) << tape.status();
  for (int call = 0; call < 3; ++call) {
    const std::vector<c10::IValue> in = inputs();
    auto want = interp.Run(in);
    ASSERT_TRUE(want.ok()) << want.status();
    std::vector<c10::IValue> got;
    ASSERT_TRUE((*tape)->Replay(in, &got).ok());
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_TRUE(at::equal(got[i].toTensor(), (*want)[i].toTensor())) << "output " << i;
    }
  }
}

TEST(KernelTapeTest, LargerKeyGrowsTheArenaAndTheFirstTapeStaysRight) {
  const auto g = Model();
  const at::Tensor w = at::randn({16, 8});
  memory_pool::Arena arena;
  auto small = Capture(g, Inputs(w, 2), &arena);
  ExpectReplayEqualsEager(*small, g, Inputs(w, 2));
  const int64_t before = arena.bytes();
  auto large = Capture(g, Inputs(w, 64), &arena);
  EXPECT_GT(arena.bytes(), before);
  ExpectReplayEqualsEager(*large, g, Inputs(w, 64));
  // The small key's buffers moved with the arena (and its prepared iterators are rebuilt).
  ExpectReplayEqualsEager(*small, g, Inputs(w, 2));
}

TEST(KernelTapeTest, PreparedStepsRunAndMatchTheTypedCalls) {
  const auto g = Model();
  const at::Tensor w = at::randn({16, 8});
  memory_pool::Arena with_arena, without_arena;
  auto with = Capture(g, Inputs(w, 4), &with_arena, Unfused());
  CaptureOptions off = Unfused();
  off.prepared_steps = false;
  auto without = Capture(g, Inputs(w, 4), &without_arena, off);
#if defined(__x86_64__)
  EXPECT_EQ(with->info().prepared_steps, 5);  // add, relu, mul, sin, sub (mm is typed only)
#endif
  EXPECT_EQ(without->info().prepared_steps, 0);
  EXPECT_EQ(with->info().typed_steps, without->info().typed_steps);
  const std::vector<c10::IValue> in = Inputs(w, 4);
  std::vector<c10::IValue> a, b;
  ASSERT_TRUE(with->Replay(Clone(in), &a).ok());
  ASSERT_TRUE(without->Replay(Clone(in), &b).ok());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(at::equal(a[i].toTensor(), b[i].toTensor()));
}

TEST(KernelTapeTest, PlanSaysWhatEachNodeBecomes) {
  const auto g = Model();
  Interpreter interp(g);
  Recording rec;
  // eager's mm.out on every node: whether the small GEMM gives MKL's bits (Note [Checked GEMMs])
  // is the machine's
  setenv("TORCHREPLAY_CHECKED_GEMM", "0", 1);
  ASSERT_TRUE(RunAndRecord(interp, Inputs(at::randn({16, 8}), 4), &rec, CheckTapeNode).ok());
  unsetenv("TORCHREPLAY_CHECKED_GEMM");
  auto plan = PlanTape(*g, rec, /*fuse=*/false);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const std::string text = plan->ToString(*g);
  EXPECT_THAT(text, HasSubstr("aten::t: precomputed"));
  EXPECT_THAT(text, HasSubstr("aten::mm: out= aten::mm.out [buffer 0"));
  EXPECT_THAT(text, HasSubstr("aten::relu: out= aten::clamp_min.out"));
  EXPECT_THAT(text, HasSubstr("aten::add_.Tensor: functional in place"));
  EXPECT_THAT(text, HasSubstr("getitem[0]: getitem"));
}

bool SameBits(const at::Tensor& a, const at::Tensor& b);

// Note [Step kinds]: the plan picks each out= node's family; where a family's Make finds the
// arguments other than its Match assumed, the node becomes a typed out= step (boxed where no typed
// call exists), and the dump says so.
TEST(KernelTapeTest, StepFamiliesComeFromThePlanAndTheDumpSaysWhatEachBecame) {
  GraphBuilder b;
  const ValueId x = b.AddInput("x", ValueType::kTensor);
  const ValueId d = b.AddInput("d", ValueType::kTensor);
  const ValueId same = Op(b, "aten::cat", {Arg::List({Arg::Ref(x), Arg::Ref(x)}), Arg::Const(int64_t{0})});
  // float and double: cat promotes, which copies cannot do
  const ValueId mixed = Op(b, "aten::cat", {Arg::List({Arg::Ref(x), Arg::Ref(d)}), Arg::Const(int64_t{0})});
  const ValueId sin = Op(b, "aten::sin", {Arg::Ref(same)});
  ASSERT_TRUE(b.SetOutputs({Arg::Ref(same), Arg::Ref(mixed), Arg::Ref(sin)}).ok());
  auto g = b.Build();
  ASSERT_TRUE(g.ok()) << g.status();
  const std::vector<c10::IValue> inputs = {at::randn({3, 4}), at::randn({2, 4}, at::kDouble)};
  Interpreter interp(*g);
  Recording rec;
  ASSERT_TRUE(RunAndRecord(interp, Clone(inputs), &rec, CheckTapeNode).ok());
  auto plan = PlanTape(**g, rec, /*fuse=*/false);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->nodes[0].kind, StepKind::kCopies);
  EXPECT_EQ(plan->nodes[1].kind, StepKind::kCopies);
  EXPECT_EQ(plan->nodes[2].kind, StepKind::kTypedOut);

  memory_pool::Arena arena;
  auto tape = Capture(*g, inputs, &arena, Unfused());
  const std::string stem = ::testing::TempDir() + "step_kinds";
  auto path = tape->Dump(stem);
  ASSERT_TRUE(path.ok()) << path.status();
  std::ifstream f(*path);
  const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const std::vector<std::string> lines = absl::StrSplit(text, '\n');
  ASSERT_GE(lines.size(), 4u) << text;
  EXPECT_THAT(lines[1], HasSubstr("family: copies; step: copies")) << text;
  // no typed signature takes cat's list: the out= overload, boxed
  EXPECT_THAT(lines[2], HasSubstr("family: copies; step: boxed out=")) << text;
#if defined(__x86_64__)
  EXPECT_THAT(lines[3], HasSubstr("family: typed out=; step: prepared pointwise")) << text;
#endif
  for (int call = 0; call < 2; ++call) {
    const std::vector<c10::IValue> in = {at::randn({3, 4}), at::randn({2, 4}, at::kDouble)};
    auto want = Interpreter(*g).Run(Clone(in));
    ASSERT_TRUE(want.ok()) << want.status();
    std::vector<c10::IValue> got;
    ASSERT_TRUE(tape->Replay(in, &got).ok());
    for (size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(SameBits(got[i].toTensor(), (*want)[i].toTensor())) << i;
  }
}

// x, s (float), k (int): s and k reach kernels only as data (a wrapped number where a Tensor
// goes, add's alpha, clamp_min's min, lerp's weight, leaky_relu's slope, a boxed step's fill),
// also through symbolic arithmetic (k * 2, s + 1.5) computed per call.
std::shared_ptr<const Graph> ScalarModel() {
  GraphBuilder b;
  const ValueId x = b.AddInput("x", ValueType::kTensor);
  const ValueId s = b.AddInput("s", ValueType::kFloat);
  const ValueId k = b.AddInput("k", ValueType::kInt);
  const ValueId m = Op(b, "aten::mul.Tensor", {Arg::Ref(x), Arg::Ref(s)});
  const ValueId a = Op(b, "aten::add.Tensor", {Arg::Ref(m), Arg::Ref(x)}, {{"alpha", Arg::Ref(s)}});
  const ValueId c = Op(b, "aten::clamp_min", {Arg::Ref(a), Arg::Ref(s)});
  const ValueId mk = Op(b, "aten::mul.Tensor", {Arg::Ref(c), Arg::Ref(k)});
  const ValueId l = Op(b, "aten::lerp.Scalar", {Arg::Ref(mk), Arg::Ref(x), Arg::Ref(s)});
  const ValueId r = Op(b, "aten::leaky_relu", {Arg::Ref(l), Arg::Ref(s)});
  const ValueId f = Op(b, "aten::fill.Scalar", {Arg::Ref(x), Arg::Ref(k)});
  auto k2 = b.AddSymArith(SymOp::kMul, {Arg::Ref(k), Arg::Const(int64_t{2})});
  auto s2 = b.AddSymArith(SymOp::kAdd, {Arg::Ref(s), Arg::Const(1.5)});
  EXPECT_TRUE(k2.ok() && s2.ok());
  const ValueId q = Op(b, "aten::mul.Tensor", {Arg::Ref(r), Arg::Ref(*k2)});
  const ValueId z = Op(b, "aten::add.Tensor", {Arg::Ref(q), Arg::Ref(*s2)});
  EXPECT_TRUE(b.SetOutputs({Arg::Ref(z), Arg::Ref(f), Arg::Ref(s)}).ok());
  auto g = b.Build();
  EXPECT_TRUE(g.ok()) << g.status();
  return *g;
}

bool SameBits(const at::Tensor& a, const at::Tensor& b) {
  return a.sizes() == b.sizes() && a.dtype() == b.dtype() &&
         at::equal(a.contiguous().view(at::kByte), b.contiguous().view(at::kByte));
}

TEST(KernelTapeTest, ScalarInputsAreReadPerCallBitwiseAsTheInterpreter) {
  const auto g = ScalarModel();
  EXPECT_TRUE(g->is_per_call_scalar(1));
  EXPECT_TRUE(g->is_per_call_scalar(2));
  for (const bool prepared : {true, false}) {
    SCOPED_TRACE(prepared ? "prepared steps" : "typed steps only");
    CaptureOptions options = Unfused();
    options.prepared_steps = prepared;
    memory_pool::Arena arena;
    auto tape = Capture(g, {at::randn({4, 8}), 0.5, int64_t{3}}, &arena, options);
    const CaptureInfo& info = tape->info();
    EXPECT_EQ(info.steps, 11);  // nothing folded: every step reads s or k (two compute k*2, s+1.5)
#if defined(__x86_64__)
    // mul, add (alpha s), clamp_min (s), mul (k), mul (k*2), add (s+1.5)
    EXPECT_EQ(info.prepared_steps, prepared ? 6 : 0);
#endif
    EXPECT_GE(info.typed_steps, 7);
    std::mt19937 gen(prepared ? 1 : 2);
    std::uniform_real_distribution<double> real(-4.0, 4.0);
    std::uniform_int_distribution<int64_t> integer(-1000, 1000);
    for (int call = 0; call < 1000; ++call) {
      double v = real(gen);
      if (call % 97 == 0) v = std::numeric_limits<double>::quiet_NaN();  // clamp_min's NaN
      if (call % 89 == 0) v = -0.0;
      std::vector<c10::IValue> in = {at::randn({4, 8}), v, integer(gen)};
      auto want = Interpreter(g).Run(Clone(in));
      ASSERT_TRUE(want.ok()) << want.status();
      std::vector<c10::IValue> got;
      ASSERT_TRUE(tape->Replay(in, &got).ok());
      for (int o = 0; o < 2; ++o) {
        ASSERT_TRUE(SameBits(got[o].toTensor(), (*want)[o].toTensor()))
            << "call " << call << " s=" << v << " output " << o;
      }
      EXPECT_TRUE(guards::SameFloat(got[2].toDouble(), v));  // a scalar returned as it came
    }
  }
}

TEST(KernelTapeTest, ScalarsThatDecideShapesStayInTheKey) {
  GraphBuilder b;
  const ValueId x = b.AddInput("x", ValueType::kTensor);
  const ValueId n = b.AddInput("n", ValueType::kInt);
  const ValueId e = b.AddInput("e", ValueType::kInt);
  const ValueId s = b.AddInput("s", ValueType::kInt);
  const ValueId p = b.AddInput("p", ValueType::kInt);
  auto p1 = b.AddSymArith(SymOp::kAdd, {Arg::Ref(p), Arg::Const(int64_t{1})});
  ASSERT_TRUE(p1.ok());
  auto v = b.AddOp("aten::view",
                   {Arg::Ref(x), Arg::List({Arg::Ref(n), Arg::Ref(*p1), Arg::Const(int64_t{-1})})});
  ASSERT_TRUE(v.ok()) << v.status();
  auto r = b.AddOp("aten::arange", {Arg::Ref(e)});
  ASSERT_TRUE(r.ok()) << r.status();
  auto squared = b.AddSymArith(SymOp::kPow, {Arg::Ref(s), Arg::Const(int64_t{2})});
  ASSERT_TRUE(squared.ok());
  auto m = b.AddOp("aten::mul.Tensor", {Arg::Ref((*v)[0]), Arg::Ref(*squared)});
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_TRUE(b.SetOutputs({Arg::Ref((*m)[0]), Arg::Ref((*r)[0])}).ok());
  auto g = *b.Build();
  EXPECT_FALSE(g->is_per_call_scalar(1));  // a size in a list
  EXPECT_FALSE(g->is_per_call_scalar(2));  // arange's end decides its length
  EXPECT_FALSE(g->is_per_call_scalar(3));  // pow: an int or a float, by the values
  EXPECT_FALSE(g->is_per_call_scalar(4));  // arithmetic that ends in a size
  const std::vector<c10::IValue> in = {at::randn({4, 6}), int64_t{2}, int64_t{5}, int64_t{3},
                                       int64_t{1}};
  const guards::GuardKey key = guards::GuardKey::FromInputs(in, g->per_call_scalars());
  for (size_t i = 1; i < in.size(); ++i) {
    std::vector<c10::IValue> changed = in;
    changed[i] = in[i].toInt() + 1;
    EXPECT_FALSE(key.Matches(changed)) << "input " << i;
  }
  EXPECT_TRUE(key.Matches(in));
}

TEST(KernelTapeTest, DataDependentShapesAreRefusedWithTheNode) {
  GraphBuilder b;
  const ValueId x = b.AddInput("x", ValueType::kTensor);
  auto nz = b.AddOp("aten::nonzero", {Arg::Ref(x)}, {}, "nz");
  ASSERT_TRUE(nz.ok());
  ASSERT_TRUE(b.SetOutputs({Arg::Ref((*nz)[0])}).ok());
  auto g = *b.Build();
  Interpreter interp(g);
  Recording rec;
  std::vector<c10::IValue> in = {at::randn({5})};
  ASSERT_TRUE(RunAndRecord(interp, in, &rec, CheckTapeNode).ok());
  memory_pool::Arena arena;
  auto tape = CaptureKernelTape(g, rec, in, &arena, {});
  ASSERT_FALSE(tape.ok());
  EXPECT_EQ(tape.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(tape.status().message()), HasSubstr("node 'nz' (aten::nonzero)"));
}

TEST(KernelTapeTest, AKernelErrorKeepsItsTypeThroughReplayAndContext) {
  GraphBuilder b;
  const ValueId x = b.AddInput("x", ValueType::kTensor);
  const ValueId idx = b.AddInput("idx", ValueType::kTensor);
  const ValueId sel = Op(b, "aten::index_select", {Arg::Ref(x), Arg::Const(int64_t{0}), Arg::Ref(idx)});
  ASSERT_TRUE(b.SetOutputs({Arg::Ref(sel)}).ok());
  auto g = *b.Build();
  const at::Tensor good = at::arange(2), bad = at::arange(7, 9);
  memory_pool::Arena arena;
  auto tape = Capture(g, {at::randn({5, 3}), good}, &arena);
  std::vector<c10::IValue> out;
  const absl::Status replayed = tape->Replay({at::randn({5, 3}), bad}, &out);
  auto interpreted = Interpreter(g).Run({at::randn({5, 3}), bad});
  for (const absl::Status& s :
       std::vector<absl::Status>{replayed, interpreted.status(), WithContext(replayed, "graph 'g': ")}) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
    EXPECT_THAT(std::string(s.message()), HasSubstr("index out of range in self"));
    EXPECT_THAT(std::string(s.message()), HasSubstr("node 'aten::index_select' failed"));
    EXPECT_EQ(s.GetPayload(kErrorType).value_or(absl::Cord("none")), "IndexError") << s;
  }
  // A plain c10::Error (RuntimeError in Python) carries no type.
  EXPECT_FALSE(KernelError(c10::Error(std::string("boom")), "").GetPayload(kErrorType).has_value());
}

}  // namespace
}  // namespace torchreplay::capture::tape
