// The host-only half of the CUDA backend, without a GPU: what PlanCudaCapture decides for a
// recording (which inputs get placeholders and are copied back, what each output is, which graphs
// are refused and why) and the placeholders of expanded inputs. The recordings are of CPU runs
// whose tensor values are then marked as on a CUDA device, as a run there would have recorded
// them: the plan reads devices from the recording only.
#include "capture/cuda/cuda_graph.h"

#include <ATen/ops/equal.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/zeros.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "capture/ir/interpreter.h"
#include "capture/ir/recording.h"
#include "capture/ir/testing.h"
#include "memory_pool/cuda_pool.h"

namespace torchreplay::capture::cuda {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using Kind = CudaCapturePlan::Output::Kind;

using testing::Op;

// w (static), x, acc: y = x @ w.t(); acc.add_(y); returns y (pool), acc (the caller's), x.t() (a
// view of a non-static input), w.t() (a view of a static input), x.size(0) (a number).
std::shared_ptr<const Graph> Model() {
  GraphBuilder b;
  const ValueId w = b.AddInput("w", ValueType::kTensor);
  const ValueId x = b.AddInput("x", ValueType::kTensor);
  const ValueId acc = b.AddInput("acc", ValueType::kTensor);
  const ValueId wt = Op(b, "aten::t", {Arg::Ref(w)});
  const ValueId y = Op(b, "aten::mm", {Arg::Ref(x), Arg::Ref(wt)});
  Op(b, "aten::add_.Tensor", {Arg::Ref(acc), Arg::Ref(y)});
  const ValueId xt = Op(b, "aten::t", {Arg::Ref(x)});
  const ValueId rows = Op(b, "aten::size.int", {Arg::Ref(x), Arg::Const(int64_t{0})});
  EXPECT_TRUE(b.SetOutputs({Arg::Ref(y), Arg::Ref(acc), Arg::Ref(xt), Arg::Ref(wt), Arg::Ref(rows)}).ok());
  EXPECT_TRUE(b.SetStaticInputs({0}).ok());
  auto g = b.Build();
  EXPECT_TRUE(g.ok()) << g.status();
  return *g;
}

// The recording of a run on `inputs`, every tensor value then marked as on `device`.
Recording RecordAs(const std::shared_ptr<const Graph>& g, const std::vector<c10::IValue>& inputs,
                   c10::Device device = c10::Device(c10::DeviceType::CUDA, 0)) {
  Interpreter interp(g);
  Recording rec;
  std::vector<c10::IValue> copy;
  for (const auto& v : inputs) copy.push_back(v.isTensor() ? c10::IValue(v.toTensor().clone()) : v);
  auto run = RunAndRecord(interp, copy, &rec, /*check=*/{});  // no node the CPU tape checks
  EXPECT_TRUE(run.ok()) << run.status();
  for (ValueRecord& r : rec.values) {
    if (r.is_tensor) r.device = device;
  }
  return rec;
}

std::vector<c10::IValue> Inputs() { return {at::randn({4, 8}), at::randn({2, 8}), at::zeros({2, 4})}; }

TEST(CudaPlan, PlaceholdersCopiesBackAndOutputs) {
  const auto g = Model();
  const auto inputs = Inputs();
  auto plan = PlanCudaCapture(*g, RecordAs(g, inputs), inputs);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->device, c10::Device(c10::DeviceType::CUDA, 0));
  EXPECT_THAT(plan->placeholders, ElementsAre(1, 2));  // the static weight is baked in
  EXPECT_THAT(plan->copied_back, ElementsAre(1));       // acc (placeholder 1) is written
  ASSERT_EQ(plan->outputs.size(), 5u);
  EXPECT_EQ(plan->outputs[0].kind, Kind::kPool);
  EXPECT_EQ(plan->outputs[1].kind, Kind::kInputView);
  EXPECT_EQ(plan->outputs[1].input, 2);
  EXPECT_EQ(plan->outputs[2].kind, Kind::kInputView);
  EXPECT_EQ(plan->outputs[2].input, 1);
  EXPECT_EQ(plan->outputs[3].kind, Kind::kConstant);  // a view of the baked weight
  EXPECT_EQ(plan->outputs[4].kind, Kind::kConstant);  // a number under this key
}

TEST(CudaPlan, OnTheRecordedDevice) {
  const auto g = Model();
  const auto inputs = Inputs();
  auto plan = PlanCudaCapture(*g, RecordAs(g, inputs, c10::Device(c10::DeviceType::CUDA, 1)), inputs);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->device, c10::Device(c10::DeviceType::CUDA, 1));
}

TEST(CudaPlan, RefusesCpuTensorsTwoDevicesAndNoDevice) {
  const auto g = Model();
  const auto inputs = Inputs();
  Recording rec = RecordAs(g, inputs);
  rec.values[g->inputs()[1]].device = c10::Device(c10::DeviceType::CPU);
  auto cpu = PlanCudaCapture(*g, rec, inputs);
  ASSERT_FALSE(cpu.ok());
  EXPECT_THAT(std::string(cpu.status().message()), HasSubstr("'x' is a CPU tensor inside a CUDA graph"));

  rec = RecordAs(g, inputs);
  rec.values[g->inputs()[2]].device = c10::Device(c10::DeviceType::CUDA, 1);
  auto two = PlanCudaCapture(*g, rec, inputs);
  ASSERT_FALSE(two.ok());
  EXPECT_THAT(std::string(two.status().message()), HasSubstr("'acc' is on cuda:1 and 'w' on cuda:0"));

  auto none = PlanCudaCapture(*g, RecordAs(g, inputs, c10::Device(c10::DeviceType::CPU)), inputs);
  ASSERT_FALSE(none.ok());
  EXPECT_THAT(std::string(none.status().message()), HasSubstr("CPU tensor inside a CUDA graph"));
}

TEST(CudaPlan, RefusesHostReads) {
  GraphBuilder b;
  const ValueId x = b.AddInput("x", ValueType::kTensor);
  const ValueId s = Op(b, "aten::sum", {Arg::Ref(x)});
  const ValueId v = Op(b, "aten::item", {Arg::Ref(s)});
  const ValueId y = Op(b, "aten::mul.Scalar", {Arg::Ref(x), Arg::Ref(v)});
  ASSERT_TRUE(b.SetOutputs({Arg::Ref(y)}).ok());
  auto g = b.Build();
  ASSERT_TRUE(g.ok()) << g.status();
  const std::vector<c10::IValue> inputs = {at::randn({4})};
  auto plan = PlanCudaCapture(**g, RecordAs(*g, inputs), inputs);
  ASSERT_FALSE(plan.ok());
  EXPECT_THAT(std::string(plan.status().message()), HasSubstr("reads a value from tensor data on the host"));
}

// x and a view of x as two inputs: a CUDA graph gives each its own placeholder, so a write through
// one would not reach the other. Refused when the graph writes either; read-only sharing is fine.
TEST(CudaPlan, InputsSharingMemory) {
  for (const bool writes : {false, true}) {
    GraphBuilder b;
    const ValueId x = b.AddInput("x", ValueType::kTensor);
    const ValueId v = b.AddInput("v", ValueType::kTensor);
    if (writes) Op(b, "aten::mul_.Scalar", {Arg::Ref(v), Arg::Const(2.0)});
    const ValueId y = Op(b, "aten::add.Tensor", {Arg::Ref(x), Arg::Const(1.0)});
    ASSERT_TRUE(b.SetOutputs({Arg::Ref(y)}).ok());
    auto g = b.Build();
    ASSERT_TRUE(g.ok()) << g.status();
    const at::Tensor base = at::randn({4, 4});
    const std::vector<c10::IValue> inputs = {base, base.narrow(0, 1, 2)};
    auto plan = PlanCudaCapture(**g, RecordAs(*g, inputs), inputs);
    if (writes) {
      ASSERT_FALSE(plan.ok());
      EXPECT_THAT(std::string(plan.status().message()), HasSubstr("inputs 0 and 1 share memory"));
    } else {
      ASSERT_TRUE(plan.ok()) << plan.status();
      EXPECT_THAT(plan->placeholders, ElementsAre(0, 1));
      EXPECT_TRUE(plan->copied_back.empty());
    }
  }
}

// An expanded (stride-0) input: its placeholder has the same geometry and values, and only its
// distinct elements are copied (a copy into overlapping elements is refused by ATen).
TEST(CudaPlan, ExpandedInputPlaceholder) {
  const at::Tensor row = at::randn({1, 3});
  const at::Tensor expanded = row.expand({4, 3});
  EXPECT_TRUE(memory_pool::CudaPool::Expanded(expanded));
  EXPECT_FALSE(memory_pool::CudaPool::Expanded(row));
  const at::Tensor p = memory_pool::CudaPool::Placeholder(expanded);
  EXPECT_EQ(p.sizes(), expanded.sizes());
  EXPECT_EQ(p.strides(), expanded.strides());
  EXPECT_TRUE(at::equal(p, expanded));
  EXPECT_EQ(memory_pool::CudaPool::DistinctElements(p).sizes(), row.sizes());
  // A later call's values land in the placeholder through the distinct elements.
  const at::Tensor next = at::randn({1, 3}).expand({4, 3});
  memory_pool::CudaPool::DistinctElements(p).copy_(memory_pool::CudaPool::DistinctElements(next));
  EXPECT_TRUE(at::equal(p, next));
}

}  // namespace
}  // namespace torchreplay::capture::cuda
