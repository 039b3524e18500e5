// The IR and the interpreter: graphs built in C++ agree exactly with direct ATen calls, and bad
// graphs are rejected with a status naming what is wrong.
#include <ATen/ops/addmm.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/relu.h>
#include <ATen/ops/split.h>
#include <ATen/ops/sub.h>
#include <ATen/ops/sum.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <limits>

#include "capture/ir/graph.h"
#include "capture/ir/interpreter.h"

namespace torchreplay::capture {
namespace {

using ::testing::HasSubstr;

TEST(GraphTest, LinearSubScaleMatchesAten) {
  // DemoModel (torchreplay_bench.models) after AOTAutograd: t, addmm, sub, mul by a scalar input.
  GraphBuilder b;
  ValueId w = b.AddInput("w", ValueType::kTensor, TensorSpec{at::kFloat, c10::DeviceType::CPU, 2});
  ValueId bias = b.AddInput("bias", ValueType::kTensor);
  ValueId x = b.AddInput("x", ValueType::kTensor);
  ValueId mean = b.AddInput("mean", ValueType::kTensor);
  ValueId scale = b.AddInput("scale", ValueType::kInt);
  auto t = b.AddOp("aten::t", {Arg::Ref(w)});
  ASSERT_TRUE(t.ok()) << t.status();
  auto mm = b.AddOp("aten::addmm", {Arg::Ref(bias), Arg::Ref(x), Arg::Ref((*t)[0])});
  ASSERT_TRUE(mm.ok()) << mm.status();
  auto sub = b.AddOp("aten::sub.Tensor", {Arg::Ref((*mm)[0]), Arg::Ref(mean)});
  ASSERT_TRUE(sub.ok());
  auto mul = b.AddOp("aten::mul.Tensor", {Arg::Ref((*sub)[0]), Arg::Ref(scale)});
  ASSERT_TRUE(mul.ok()) << mul.status();
  ASSERT_TRUE(b.SetOutputs({Arg::Ref((*mul)[0])}).ok());
  ASSERT_TRUE(b.SetStaticInputs({0, 1, 3}).ok());
  auto g = b.Build();
  ASSERT_TRUE(g.ok());
  EXPECT_THAT((*g)->ToString(), HasSubstr("aten::addmm"));

  Interpreter interp(*g);
  for (int64_t rows : {3, 7}) {
    at::Tensor W = at::randn({4, 5}), B = at::randn({4}), X = at::randn({rows, 5}),
               M = at::randn({4});
    auto out = interp.Run({W, B, X, M, int64_t{3}});
    ASSERT_TRUE(out.ok()) << out.status();
    at::Tensor want = at::mul(at::sub(at::addmm(B, X, W.t()), M), 3);
    ASSERT_EQ(out->size(), 1u);
    EXPECT_TRUE(at::equal((*out)[0].toTensor(), want));
    EXPECT_EQ((*out)[0].toTensor().scalar_type(), at::kFloat);  // int scalar did not promote
  }
}

TEST(GraphTest, ListOutputsGetItemCatAndSymArith) {
  GraphBuilder b;
  ValueId x = b.AddInput("x", ValueType::kTensor);
  ValueId n = b.AddInput("n", ValueType::kInt);
  auto half = b.AddSymArith(SymOp::kFloorDiv, {Arg::Ref(n), Arg::Const(int64_t{2})}, "half");
  ASSERT_TRUE(half.ok());
  auto parts = b.AddOp("aten::split.Tensor", {Arg::Ref(x), Arg::Ref(*half)});
  ASSERT_TRUE(parts.ok()) << parts.status();
  auto p0 = b.AddGetItem((*parts)[0], 0);
  auto p1 = b.AddGetItem((*parts)[0], 1);
  ASSERT_TRUE(p0.ok() && p1.ok());
  auto r = b.AddOp("aten::relu", {Arg::Ref(*p1)});
  auto c = b.AddOp("aten::cat", {Arg::List({Arg::Ref((*r)[0]), Arg::Ref(*p0)})},
                   {{"dim", Arg::Const(int64_t{0})}});
  ASSERT_TRUE(c.ok()) << c.status();
  auto s = b.AddOp("aten::sum.dim_IntList",
                   {Arg::Ref((*c)[0]), Arg::List({Arg::Const(int64_t{1})})});
  ASSERT_TRUE(s.ok()) << s.status();
  ASSERT_TRUE(b.SetOutputs({Arg::Ref((*s)[0]), Arg::Ref(*half), Arg::Const(c10::IValue())}).ok());
  auto g = b.Build();
  ASSERT_TRUE(g.ok());
  const std::string listing = (*g)->ToString();
  EXPECT_THAT(listing, HasSubstr("%half = sym.floordiv(%n, 2)"));
  EXPECT_THAT(listing, HasSubstr("getitem[1]("));
  for (SymOp op : {SymOp::kAdd, SymOp::kTrueDiv, SymOp::kRShift, SymOp::kSqrt}) {
    auto back = SymOpFromName(SymOpName(op));
    ASSERT_TRUE(back.ok());
    EXPECT_EQ(*back, op) << SymOpName(op);
  }
  Interpreter interp(*g);
  at::Tensor X = at::randn({6, 3});
  auto out = interp.Run({X, int64_t{6}});
  ASSERT_TRUE(out.ok()) << out.status();
  auto split = at::split(X, 3);
  at::Tensor want = at::sum(at::cat({at::relu(split[1]), split[0]}, 0), {1});
  EXPECT_TRUE(at::equal((*out)[0].toTensor(), want));
  EXPECT_EQ((*out)[1].toInt(), 3);
  EXPECT_TRUE((*out)[2].isNone());
}

c10::IValue Eval(SymOp op, c10::IValue a, c10::IValue b = {}) {
  auto r = EvalSymArith(op, a, b);
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? *r : c10::IValue();
}

TEST(GraphTest, FloorDivAndModFollowPython) {
  EXPECT_EQ(Eval(SymOp::kFloorDiv, -7, 2).toInt(), -4);
  EXPECT_EQ(Eval(SymOp::kFloorDiv, 7, 2).toInt(), 3);
  EXPECT_EQ(Eval(SymOp::kMod, -7, 3).toInt(), 2);
  EXPECT_EQ(Eval(SymOp::kMod, 7, -3).toInt(), -2);
  EXPECT_EQ(Eval(SymOp::kFloorDiv, -7.5, 2).toDouble(), -4.0);   // -7.5 // 2
  EXPECT_EQ(Eval(SymOp::kMod, -7.5, 2).toDouble(), 0.5);         // -7.5 % 2
  EXPECT_EQ(Eval(SymOp::kMod, 7.5, -2).toDouble(), -0.5);        // 7.5 % -2
}

TEST(GraphTest, SymArithKeepsPythonTypes) {
  EXPECT_TRUE(Eval(SymOp::kTrueDiv, 6, 4).isDouble());
  EXPECT_EQ(Eval(SymOp::kTrueDiv, 6, 4).toDouble(), 1.5);
  EXPECT_EQ(Eval(SymOp::kPow, 3, 4).toInt(), 81);
  EXPECT_EQ(Eval(SymOp::kPow, 2, -1).toDouble(), 0.5);           // int ** negative int is a float
  EXPECT_EQ(Eval(SymOp::kPow, 2.0, 3).toDouble(), 8.0);
  EXPECT_TRUE(Eval(SymOp::kGe, 3, 3).toBool());
  EXPECT_FALSE(Eval(SymOp::kLt, 3.5, 3).toBool());
  EXPECT_TRUE(Eval(SymOp::kEq, 2, 2.0).toBool());
  EXPECT_TRUE(Eval(SymOp::kAnd, true, true).isBool());
  EXPECT_EQ(Eval(SymOp::kAnd, 6, 3).toInt(), 2);
  EXPECT_EQ(Eval(SymOp::kFloor, -2.5).toInt(), -3);
  EXPECT_EQ(Eval(SymOp::kCeil, 2.1).toInt(), 3);
  EXPECT_EQ(Eval(SymOp::kRound, 2.5).toInt(), 2);                // round half to even, like Python
  EXPECT_EQ(Eval(SymOp::kTrunc, -2.7).toInt(), -2);
  EXPECT_EQ(Eval(SymOp::kMax, 3, 2.5).toDouble(), 3.0);
  EXPECT_TRUE(Eval(SymOp::kFloat, 3).isDouble());
  EXPECT_FALSE(EvalSymArith(SymOp::kTrueDiv, 1, 0).ok());         // ZeroDivisionError in Python
  EXPECT_FALSE(EvalSymArith(SymOp::kMod, 1.0, 0.0).ok());
}

TEST(GraphTest, SymIntShiftsAndOverflowAreChecked) {
  EXPECT_EQ(Eval(SymOp::kLShift, 3, 4).toInt(), 48);
  EXPECT_EQ(Eval(SymOp::kRShift, -9, 1).toInt(), -5);             // floor, like Python
  EXPECT_EQ(Eval(SymOp::kRShift, -9, 200).toInt(), -1);
  EXPECT_EQ(Eval(SymOp::kLShift, true, 2).toInt(), 4);
  EXPECT_EQ(Eval(SymOp::kPow, -3, 39).toInt(), -4052555153018976267);  // largest that fits
  EXPECT_FALSE(EvalSymArith(SymOp::kLShift, 1, -1).ok());         // negative shift count
  // Python ints are unbounded; graph ints are not: an overflow is an error, never a wrap.
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  EXPECT_EQ(EvalSymArith(SymOp::kAdd, kMax, 1).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(EvalSymArith(SymOp::kMul, kMax / 2, 3).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(EvalSymArith(SymOp::kPow, 3, 40).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(EvalSymArith(SymOp::kLShift, 1, 63).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(Eval(SymOp::kLShift, 1, 62).toInt(), int64_t{1} << 62);
}

TEST(GraphTest, UnknownOperatorIsNotFound) {
  GraphBuilder b;
  ValueId x = b.AddInput("x", ValueType::kTensor);
  auto r = b.AddOp("aten::definitely_not_an_op", {Arg::Ref(x)});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("aten::definitely_not_an_op"));
}

TEST(GraphTest, WrongArityAndBadKeywordAreRejected) {
  GraphBuilder b;
  ValueId x = b.AddInput("x", ValueType::kTensor);
  auto too_many = b.AddOp("aten::relu", {Arg::Ref(x), Arg::Ref(x)}, {}, "r");
  ASSERT_FALSE(too_many.ok());
  EXPECT_THAT(std::string(too_many.status().message()), HasSubstr("at most 1"));
  auto missing = b.AddOp("aten::mm", {Arg::Ref(x)}, {}, "m");
  ASSERT_FALSE(missing.ok());
  EXPECT_THAT(std::string(missing.status().message()), HasSubstr("missing required argument 'mat2'"));
  auto bad_kw = b.AddOp("aten::relu", {Arg::Ref(x)}, {{"nope", Arg::Const(1)}});
  ASSERT_FALSE(bad_kw.ok());
  EXPECT_THAT(std::string(bad_kw.status().message()), HasSubstr("no argument named 'nope'"));
}

TEST(GraphTest, DanglingValueIsRejected) {
  GraphBuilder b;
  b.AddInput("x", ValueType::kTensor);
  auto r = b.AddOp("aten::relu", {Arg::Ref(42)});
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("not defined"));
  EXPECT_FALSE(b.SetOutputs({Arg::Ref(7)}).ok());
  EXPECT_FALSE(b.SetStaticInputs({3}).ok());
}

TEST(GraphTest, BadCallInputsGetClearErrors) {
  GraphBuilder b;
  ValueId x = b.AddInput("x", ValueType::kTensor, TensorSpec{at::kFloat, c10::DeviceType::CPU, 2});
  auto r = b.AddOp("aten::relu", {Arg::Ref(x)});
  ASSERT_TRUE(b.SetOutputs({Arg::Ref((*r)[0])}).ok());
  auto g = *b.Build();
  EXPECT_THAT(std::string(CheckInputs(*g, {}).message()), HasSubstr("expected 1 inputs, got 0"));
  EXPECT_THAT(std::string(CheckInputs(*g, {at::randn({2, 2}).to(at::kDouble)}).message()),
              HasSubstr("expected dtype Float, got Double"));
  EXPECT_THAT(std::string(CheckInputs(*g, {at::randn({2})}).message()),
              HasSubstr("expected a 2-d tensor, got 1-d"));
  EXPECT_THAT(std::string(CheckInputs(*g, {int64_t{1}}).message()), HasSubstr("expected a tensor"));
  EXPECT_TRUE(CheckInputs(*g, {at::randn({2, 2})}).ok());
}

TEST(GraphTest, KernelErrorsNameTheNode) {
  GraphBuilder b;
  ValueId x = b.AddInput("x", ValueType::kTensor);
  ValueId y = b.AddInput("y", ValueType::kTensor);
  auto r = b.AddOp("aten::mm", {Arg::Ref(x), Arg::Ref(y)}, {}, "mm_1");
  ASSERT_TRUE(b.SetOutputs({Arg::Ref((*r)[0])}).ok());
  Interpreter interp(*b.Build());
  auto out = interp.Run({at::randn({2, 3}), at::randn({4, 5})});
  ASSERT_FALSE(out.ok());
  EXPECT_THAT(std::string(out.status().message()), HasSubstr("node 'mm_1' failed"));
}

}  // namespace
}  // namespace torchreplay::capture
