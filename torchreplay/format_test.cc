// The .trp format: a program survives the round trip bit for bit (its graph, constants of every
// kind, bound tensors with shared storage), and the reader turns every truncated, corrupted or
// hostile file into an error, never a crash (fuzzed: every truncation, byte flips with the stored
// checksum, byte flips with a recomputed one; ASan and UBSan run this in CI).
#include "torchreplay/format.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/_make_per_channel_quantized_tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/quantize_per_tensor.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/zeros.h>
#include <torch/headeronly/version.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <functional>
#include <cstdio>
#include <random>
#include <thread>

#include "capture/ir/interpreter.h"
#include "capture/ir/testing.h"
#include "torchreplay/torchreplay.h"

namespace torchreplay::format {
namespace {

using ::testing::HasSubstr;

using capture::testing::Op;

// w, b (bound; b a view of w's storage), cache (a bound buffer the graph writes), x, s (an int):
// y = (x @ w.t() + b) * 0.5 + 2 (a wrapped number), clamp, a constant tensor added; cache[0] = y
// row 0; a split and a getitem; s + 1 and a float; outputs y, the getitem, s + 1.
SavedProgram Program() {
  capture::GraphBuilder g;
  const auto w = g.AddInput("w", capture::ValueType::kTensor, capture::TensorSpec{at::kFloat, c10::DeviceType::CPU, 2});
  const auto b = g.AddInput("b", capture::ValueType::kTensor, capture::TensorSpec{at::kFloat, c10::DeviceType::CPU, 1});
  const auto cache = g.AddInput("cache", capture::ValueType::kTensor);
  const auto x = g.AddInput("x", capture::ValueType::kTensor, capture::TensorSpec{at::kFloat, c10::DeviceType::CPU, 2});
  const auto s = g.AddInput("s", capture::ValueType::kInt);
  const auto wt = Op(g, "aten::t", {capture::Arg::Ref(w)});
  const auto mm = Op(g, "aten::addmm", {capture::Arg::Ref(b), capture::Arg::Ref(x), capture::Arg::Ref(wt)});
  const auto half = Op(g, "aten::mul.Tensor", {capture::Arg::Ref(mm), capture::Arg::Const(0.5)});
  const auto two = Op(g, "aten::add.Tensor", {capture::Arg::Ref(half), capture::Arg::Const(int64_t{2})});
  const auto c = Op(g, "aten::clamp", {capture::Arg::Ref(two), capture::Arg::Const(-1.5), capture::Arg::Const(3.0)});
  const auto y = Op(g, "aten::add.Tensor", {capture::Arg::Ref(c), capture::Arg::Const(at::arange(4).to(at::kFloat))});
  const auto row = Op(g, "aten::select.int", {capture::Arg::Ref(y), capture::Arg::Const(int64_t{0}),
                                              capture::Arg::Const(int64_t{0})});
  const auto slot = Op(g, "aten::select.int", {capture::Arg::Ref(cache), capture::Arg::Const(int64_t{0}),
                                               capture::Arg::Const(int64_t{0})});
  Op(g, "aten::copy_", {capture::Arg::Ref(slot), capture::Arg::Ref(row)});
  const auto parts = Op(g, "aten::split_with_sizes", {capture::Arg::Ref(y), capture::Arg::Const(std::vector<int64_t>{1, 2, 1}),
                                                      capture::Arg::Const(int64_t{1})});
  auto first = g.AddGetItem(parts, 1);
  EXPECT_TRUE(first.ok());
  auto s1 = g.AddSymArith(capture::SymOp::kAdd, {capture::Arg::Ref(s), capture::Arg::Const(int64_t{1})});
  EXPECT_TRUE(s1.ok());
  const auto scaled = Op(g, "aten::mul.Scalar", {capture::Arg::Ref(*first), capture::Arg::Ref(*s1)});
  const auto cat = Op(g, "aten::cat", {capture::Arg::List({capture::Arg::Ref(scaled), capture::Arg::Ref(*first)})},
                      {{"dim", capture::Arg::Const(int64_t{0})}});
  EXPECT_TRUE(g.SetOutputs({capture::Arg::Ref(y), capture::Arg::Ref(cat), capture::Arg::Ref(*s1)}).ok());
  EXPECT_TRUE(g.SetStaticInputs({0, 1, 2}).ok());
  auto graph = g.Build();
  EXPECT_TRUE(graph.ok()) << graph.status();

  SavedProgram p;
  p.name = "test.program";
  p.graph = *graph;
  const at::Tensor storage = at::randn({4 * 3 + 4});
  p.bound = {{"parameter", "fc.weight", storage.narrow(0, 0, 12).view({4, 3})},
             {"parameter", "fc.bias", storage.narrow(0, 12, 4)},  // shares fc.weight's storage
             {"buffer", "cache", at::zeros({2, 4})}};
  p.fixed = {{1, c10::IValue(int64_t{3})}};
  p.sizes = {{0, 0, 2, 2, -1, 1, 0}, {0, 1, 3, 3, -1, 1, 0}};
  p.strides = {{0, {3, 1}}};
  p.written = {};
  p.num_outputs = 3;
  return p;
}

std::vector<c10::IValue> Interpret(const SavedProgram& p, const at::Tensor& x) {
  std::vector<c10::IValue> inputs;
  for (const BoundTensor& b : p.bound) inputs.emplace_back(b.tensor);
  inputs.emplace_back(x);
  inputs.emplace_back(int64_t{3});
  auto out = capture::Interpreter(p.graph).Run(inputs);
  EXPECT_TRUE(out.ok()) << out.status();
  return out.ok() ? *out : std::vector<c10::IValue>{};
}

std::string Bytes(const SavedProgram& p) {
  auto bytes = Serialize(p);
  EXPECT_TRUE(bytes.ok()) << bytes.status();
  return bytes.ok() ? *bytes : std::string();
}

TEST(Format, RoundTripIsBitwise) {
  const SavedProgram p = Program();
  auto back = Deserialize(Bytes(p));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->name, p.name);
  EXPECT_EQ(back->graph->ToString(), p.graph->ToString());
  ASSERT_EQ(back->bound.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(back->bound[i].kind, p.bound[i].kind);
    EXPECT_EQ(back->bound[i].name, p.bound[i].name);
    EXPECT_TRUE(at::equal(back->bound[i].tensor, p.bound[i].tensor));
    EXPECT_EQ(back->bound[i].tensor.strides(), p.bound[i].tensor.strides());
  }
  EXPECT_TRUE(back->bound[0].tensor.storage().is_alias_of(back->bound[1].tensor.storage()));
  EXPECT_FALSE(back->bound[0].tensor.storage().is_alias_of(back->bound[2].tensor.storage()));
  ASSERT_EQ(back->fixed.size(), 1u);
  EXPECT_EQ(back->fixed[0].second.toInt(), 3);
  ASSERT_EQ(back->sizes.size(), 2u);
  EXPECT_EQ(back->sizes[1].lo, 3);
  ASSERT_EQ(back->strides.size(), 1u);
  EXPECT_EQ(back->strides[0].strides, (std::vector<int64_t>{3, 1}));
  EXPECT_EQ(back->num_outputs, 3);

  const at::Tensor x = at::randn({2, 3});
  const auto want = Interpret(p, x), got = Interpret(*back, x);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < 2; ++i) EXPECT_TRUE(at::equal(got[i].toTensor(), want[i].toTensor())) << i;
  EXPECT_EQ(got[2].toInt(), 4);
  EXPECT_TRUE(at::equal(back->bound[2].tensor, p.bound[2].tensor));  // both caches written alike
}

TEST(Format, LoadedProgramRunsAndChecksItsArguments) {
  const SavedProgram p = Program();
  const std::string path = ::testing::TempDir() + "/program.trp";
  ASSERT_TRUE(WriteFile(p, path).ok());
  torchreplay::Program program = torchreplay::Load(path);
  EXPECT_EQ(program.ArgumentNames(), (std::vector<std::string>{"x", "s"}));
  EXPECT_EQ(program.StateNames(), (std::vector<std::string>{"fc.weight", "fc.bias", "cache"}));
  const at::Tensor x = at::randn({2, 3});
  const auto want = Interpret(p, x);
  for (int call = 0; call < 3; ++call) {  // warm-up, capture, replay
    const auto got = program.Run({x, int64_t{3}});
    ASSERT_EQ(got.size(), 3u);
    EXPECT_TRUE(at::equal(got[0].toTensor(), want[0].toTensor()));
    EXPECT_TRUE(at::equal(got[1].toTensor(), want[1].toTensor()));
  }
  EXPECT_EQ(program.Stats().replays, 2);
  EXPECT_TRUE(at::equal(program.State("cache")[0], want[0].toTensor()[0]));
  program.State("cache").zero_();  // reset from C++: the program reads the same tensor
  EXPECT_EQ(program.State("cache").abs().sum().item<float>(), 0.0f);
  program.Run({x, int64_t{3}});
  EXPECT_TRUE(at::equal(program.State("cache")[0], want[0].toTensor()[0]));

  auto error = [&](std::vector<c10::IValue> args) {
    try {
      program.Run(std::move(args));
    } catch (const c10::Error& e) {
      return std::string(e.what_without_backtrace());
    }
    return std::string("no error");
  };
  EXPECT_THAT(error({x, int64_t{4}}), HasSubstr("argument 1 is 4, but the graph was captured with 3"));
  EXPECT_THAT(error({at::randn({3, 3}), int64_t{3}}), HasSubstr("argument 0 has size 3 in dim 0"));
  EXPECT_THAT(error({x}), HasSubstr("takes 2 arguments, got 1"));
  EXPECT_THROW(program.State("nope"), c10::Error);
}

// Precapture, then calls from four threads at once (each captures its own): every result right.
TEST(Format, LoadedProgramPrecapturesAndRunsOnThreads) {
  capture::GraphBuilder g;
  const auto w = g.AddInput("w", capture::ValueType::kTensor, capture::TensorSpec{at::kFloat, c10::DeviceType::CPU, 2});
  const auto x = g.AddInput("x", capture::ValueType::kTensor, capture::TensorSpec{at::kFloat, c10::DeviceType::CPU, 2});
  const auto y = Op(g, "aten::relu", {capture::Arg::Ref(Op(g, "aten::mm", {capture::Arg::Ref(x), capture::Arg::Ref(w)}))});
  ASSERT_TRUE(g.SetOutputs({capture::Arg::Ref(y)}).ok());
  ASSERT_TRUE(g.SetStaticInputs({0}).ok());
  SavedProgram p;
  p.name = "threads";
  p.graph = *g.Build();
  p.bound = {{"parameter", "w", at::randn({8, 8})}};
  const std::string path = ::testing::TempDir() + "/threads.trp";
  ASSERT_TRUE(WriteFile(p, path).ok());
  EngineOptions options = EngineOptions::Defaults();
  options.clone_outputs = true;
  const torchreplay::Program program = torchreplay::Load(path, options);
  program.Precapture({{at::randn({4, 8})}});
  EXPECT_EQ(program.Stats().captures, 1);
  std::atomic<int> wrong{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 50; ++i) {
        const at::Tensor in = at::randn({4, 8});
        const at::Tensor got = program.Run({in})[0].toTensor();
        if (!at::equal(got, in.mm(p.bound[0].tensor).relu())) ++wrong;
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_GE(program.Stats().replays, 4 * 48);
}

TEST(Format, RefusesOtherFilesWithClearErrors) {
  const std::string good = Bytes(Program());
  auto message = [](std::string_view bytes) {
    auto p = Deserialize(bytes);
    return p.ok() ? std::string("loaded") : std::string(p.status().message());
  };
  EXPECT_THAT(message("PK\x03\x04 a zip"), HasSubstr("not a torchreplay program"));
  std::string other = good;
  other[8] = 3;  // format version 3
  EXPECT_THAT(message(other), HasSubstr("format version 3"));
  std::string torch = good;
  const size_t at = torch.find(TORCH_VERSION);
  ASSERT_NE(at, std::string::npos);
  torch[at] = '9';  // "9.11.0", with a checksum to match
  const uint64_t sum = Checksum(std::string_view(torch).substr(kHeaderBytes));
  std::memcpy(&torch[24], &sum, sizeof(sum));
  EXPECT_THAT(message(torch), HasSubstr("saved with torch 9."));
  std::string op = good;
  const size_t mm = op.find("aten::addmm", op.find("aten::addmm") + 1);  // the op, after the node's name
  op.replace(mm, 11, "aten::nopmm");
  const uint64_t sum2 = Checksum(std::string_view(op).substr(kHeaderBytes));
  std::memcpy(&op[24], &sum2, sizeof(sum2));
  EXPECT_THAT(message(op), HasSubstr("unknown operator 'aten::nopmm'"));
  EXPECT_THAT(message(good.substr(0, good.size() - 1)), HasSubstr("truncated"));
  std::string flipped = good;
  flipped[good.size() / 2] ^= 0x10;
  EXPECT_THAT(message(flipped), HasSubstr("checksum"));
  EXPECT_THROW(torchreplay::Load("/nonexistent/program.trp"), c10::Error);
}

// Graphs a hostile file could hold: ops that make views beyond their storage or reach files,
// custom ops, names that are not UTF-8. Each refused at load, naming the node and op.
TEST(Format, RefusesHostileGraphs) {
  auto load = [](const std::function<void(capture::GraphBuilder&, capture::ValueId)>& build) {
    capture::GraphBuilder g;
    const auto x = g.AddInput("x", capture::ValueType::kTensor);
    build(g, x);
    SavedProgram p;
    p.name = "hostile";
    auto graph = g.Build();
    EXPECT_TRUE(graph.ok()) << graph.status();
    p.graph = *graph;
    auto back = Deserialize(Bytes(p));
    return back.ok() ? std::string("loaded") : std::string(back.status().message());
  };
  EXPECT_THAT(load([](capture::GraphBuilder& g, capture::ValueId x) {
                const auto v = Op(g, "aten::_reshape_alias", {capture::Arg::Ref(x), capture::Arg::Const(std::vector<int64_t>{1 << 26}),
                                                            capture::Arg::Const(std::vector<int64_t>{64})});
                ASSERT_TRUE(g.SetOutputs({capture::Arg::Ref(Op(g, "aten::sum", {capture::Arg::Ref(v)}))}).ok());
              }),
              HasSubstr("calls aten::_reshape_alias, which a loaded program may not"));
  EXPECT_THAT(load([](capture::GraphBuilder& g, capture::ValueId x) {
                const auto f = Op(g, "aten::from_file", {capture::Arg::Const(std::string("/etc/passwd"))},
                                  {{"size", capture::Arg::Const(int64_t{16})}});
                ASSERT_TRUE(g.SetOutputs({capture::Arg::Ref(f), capture::Arg::Ref(x)}).ok());
              }),
              HasSubstr("calls aten::from_file"));
  EXPECT_THAT(load([](capture::GraphBuilder& g, capture::ValueId x) {
                const auto y = Op(g, "torchreplay::record", {});
                ASSERT_TRUE(g.SetOutputs({capture::Arg::Ref(y), capture::Arg::Ref(x)}).ok());
              }),
              HasSubstr("loaded"));  // torchreplay's own ops load
  EXPECT_THAT(load([](capture::GraphBuilder& g, capture::ValueId x) {
                const auto i = Op(g, "aten::zeros", {capture::Arg::Const(std::vector<int64_t>{1})},
                                  {{"dtype", capture::Arg::Const(int64_t{static_cast<int64_t>(at::kLong)})}});
                Op(g, "aten::_index_put_impl_", {capture::Arg::Ref(x), capture::Arg::List({capture::Arg::Ref(i)}),
                                                 capture::Arg::Ref(x), capture::Arg::Const(false), capture::Arg::Const(true)});
                ASSERT_TRUE(g.SetOutputs({capture::Arg::Ref(x)}).ok());
              }),
              HasSubstr("unsafe=True"));
  // A node name that is not UTF-8 (with a checksum to match): corrupted, said in plain text.
  std::string bytes = Bytes(Program());
  const size_t at = bytes.find("aten::t");
  ASSERT_NE(at, std::string::npos);
  bytes[at] = static_cast<char>(0xff);
  const uint64_t sum = Checksum(std::string_view(bytes).substr(kHeaderBytes));
  std::memcpy(&bytes[24], &sum, sizeof(sum));
  auto bad = Deserialize(bytes);
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("corrupted (node name)"));
}

// Dtypes of every plain kind round-trip (uint16, float8 included).
TEST(Format, EveryPlainDtypeRoundTrips) {
  for (const at::ScalarType t : {at::kByte, at::kBool, at::kHalf, at::kBFloat16, at::kComplexFloat, at::kUInt16,
                                 at::kUInt64, at::kFloat8_e4m3fn, at::kFloat8_e5m2}) {
    SavedProgram p = Program();
    p.bound[2].tensor = at::randn({2, 4}).mul(10).to(t);
    auto back = Deserialize(Bytes(p));
    ASSERT_TRUE(back.ok()) << c10::toString(t) << ": " << back.status();
    EXPECT_EQ(back->bound[2].tensor.scalar_type(), t);
    EXPECT_TRUE(at::equal(back->bound[2].tensor.view(at::kByte), p.bound[2].tensor.view(at::kByte))) << c10::toString(t);
  }
}

TEST(Format, RefusesWhatItCannotHold) {
  SavedProgram p = Program();
  p.bound[0].tensor = p.bound[0].tensor.to_sparse();
  auto bytes = Serialize(p);
  ASSERT_FALSE(bytes.ok());
  EXPECT_THAT(std::string(bytes.status().message()), HasSubstr("plain strided CPU tensor"));
}

// quantize_dynamic's Linear (Note [Packed quantized Linears] in python/torchreplay/packed.py):
// quantized::linear_dynamic on packed weights, per channel and fp16, with and without a bias.
SavedProgram PackedLinear(bool fp16, bool bias) {
  const at::Tensor w = at::randn({5, 3});
  const at::Tensor scales = w.abs().amax(1).to(at::kDouble).div(127);
  at::Tensor weight = fp16 ? w
                           : at::_make_per_channel_quantized_tensor(
                                 w.div(scales.to(at::kFloat).unsqueeze(1)).round().to(at::kChar), scales,
                                 at::zeros({5}, at::kLong), 0);
  torch::jit::Stack stack{weight, bias ? c10::IValue(at::randn({5})) : c10::IValue()};
  c10::Dispatcher::singleton()
      .findSchemaOrThrow(fp16 ? "quantized::linear_prepack_fp16" : "quantized::linear_prepack", "")
      .callBoxed(stack);
  capture::GraphBuilder g;
  const auto x = g.AddInput("x", capture::ValueType::kTensor, capture::TensorSpec{at::kFloat, c10::DeviceType::CPU, 2});
  const auto y = fp16 ? Op(g, "quantized::linear_dynamic_fp16", {capture::Arg::Ref(x), capture::Arg::Const(stack[0])})
                      : Op(g, "quantized::linear_dynamic", {capture::Arg::Ref(x), capture::Arg::Const(stack[0]),
                                                            capture::Arg::Const(true)});
  EXPECT_TRUE(g.SetOutputs({capture::Arg::Ref(y)}).ok());
  auto graph = g.Build();
  EXPECT_TRUE(graph.ok()) << graph.status();
  SavedProgram p;
  p.name = "test.packed";
  p.graph = *graph;
  return p;
}

// `good` with one byte changed at random `iterations` times (the checksum made right): each is an
// error or a program, which runs on `inputs()` to an error or a result, never a crash.
void ExpectCorruptionsHarmless(const std::string& good, std::mt19937_64& rng, int iterations,
                               const std::function<std::vector<c10::IValue>()>& inputs) {
  for (int i = 0; i < iterations; ++i) {
    std::string bytes = good;
    const size_t at = kHeaderBytes + rng() % (bytes.size() - kHeaderBytes);
    bytes[at] = static_cast<char>(bytes[at] ^ (1 + rng() % 255));
    const uint64_t sum = Checksum(std::string_view(bytes).substr(kHeaderBytes));
    std::memcpy(&bytes[24], &sum, sizeof(sum));
    absl::StatusOr<SavedProgram> hostile;
    try {
      hostile = Deserialize(bytes);
    } catch (const std::exception& e) {
      ADD_FAILURE() << "iteration " << i << ", byte " << at << " changed: Deserialize threw " << e.what();
      return;
    }
    if (!hostile.ok()) continue;
    try {
      (void)capture::Interpreter(hostile->graph).Run(inputs());
    } catch (const std::exception& e) {
      ADD_FAILURE() << "iteration " << i << " byte " << at << ": " << e.what();
      return;
    }
  }
}

// The packed weights are written unpacked and packed again on load: the loaded program computes
// the same bits; corrupted files are errors or programs, never crashes.
TEST(Format, PackedQuantizedLinearsRoundTrip) {
  std::mt19937_64 rng(11);
  for (const bool fp16 : {false, true}) {
    for (const bool bias : {false, true}) {
      const SavedProgram p = PackedLinear(fp16, bias);
      const std::string good = Bytes(p);
      auto back = Deserialize(good);
      ASSERT_TRUE(back.ok()) << back.status();
      const at::Tensor x = at::randn({4, 3});
      const std::vector<c10::IValue> inputs{x};
      auto want = capture::Interpreter(p.graph).Run(inputs), got = capture::Interpreter(back->graph).Run(inputs);
      ASSERT_TRUE(want.ok() && got.ok());
      EXPECT_TRUE(at::equal((*got)[0].toTensor(), (*want)[0].toTensor())) << "fp16 " << fp16 << ", bias " << bias;
      ExpectCorruptionsHarmless(good, rng, 2000, [] { return std::vector<c10::IValue>{at::randn({4, 3})}; });
    }
  }
}

// quantize_dynamic's LSTM and GRU (Note [Packed quantized Linears]): aten::quantized_lstm /
// quantized_gru on a list of packed cells (rnn.CellParamsBase), int8 and fp16, made by ATen's ops.
SavedProgram PackedCells(bool lstm, bool fp16) {
  const int64_t gates = (lstm ? 4 : 3) * 5;
  auto linear = [&](int64_t in) {
    const at::Tensor w = at::randn({gates, in});
    const at::Tensor weight = fp16 ? w : at::quantize_per_tensor(w, 0.02, 0, at::kQInt8);
    torch::jit::Stack stack{weight, fp16 ? c10::IValue(at::randn({gates})) : c10::IValue()};
    c10::Dispatcher::singleton()
        .findSchemaOrThrow(fp16 ? "quantized::linear_prepack_fp16" : "quantized::linear_prepack", "")
        .callBoxed(stack);
    return stack[0];
  };
  torch::jit::Stack cell{linear(3), linear(5)};
  if (!fp16) cell.insert(cell.end(), {at::randn({gates}), at::randn({gates}), false});
  c10::Dispatcher::singleton()
      .findSchemaOrThrow(fp16 ? "quantized::make_quantized_cell_params_fp16" : "quantized::make_quantized_cell_params_dynamic", "")
      .callBoxed(cell);
  c10::impl::GenericList cells(cell[0].type());
  cells.push_back(cell[0]);
  capture::GraphBuilder g;
  const capture::TensorSpec spec{at::kFloat, c10::DeviceType::CPU, 3};
  const auto x = g.AddInput("x", capture::ValueType::kTensor, spec);
  const auto h = g.AddInput("h", capture::ValueType::kTensor, spec);
  std::vector<capture::Arg> hx{capture::Arg::Ref(h)};
  if (lstm) hx.push_back(capture::Arg::Ref(h));
  std::vector<capture::Arg> args{capture::Arg::Ref(x), capture::Arg::List(hx), capture::Arg::Const(cells),
                                 capture::Arg::Const(true), capture::Arg::Const(int64_t{1}), capture::Arg::Const(0.0),
                                 capture::Arg::Const(false), capture::Arg::Const(false), capture::Arg::Const(false)};
  if (!lstm) args[1] = capture::Arg::Ref(h);
  std::vector<std::pair<std::string, capture::Arg>> kwargs;
  if (lstm) {
    kwargs = {{"dtype", capture::Arg::Const(fp16 ? at::kHalf : at::kQInt8)}, {"use_dynamic", capture::Arg::Const(true)}};
  }
  const auto y = Op(g, lstm ? "aten::quantized_lstm.input" : "aten::quantized_gru.input", args, kwargs);
  EXPECT_TRUE(g.SetOutputs({capture::Arg::Ref(y)}).ok());
  auto graph = g.Build();
  EXPECT_TRUE(graph.ok()) << graph.status();
  SavedProgram p;
  p.name = "test.cells";
  p.graph = *graph;
  return p;
}

// The cells are written as their state and made again on load: the loaded program computes the
// same bits; corrupted files are errors or programs, never crashes.
TEST(Format, PackedQuantizedCellsRoundTrip) {
  std::mt19937_64 rng(13);
  for (const bool lstm : {true, false}) {
    for (const bool fp16 : {false, true}) {
      const SavedProgram p = PackedCells(lstm, fp16);
      const std::string good = Bytes(p);
      auto back = Deserialize(good);
      ASSERT_TRUE(back.ok()) << back.status();
      const std::vector<c10::IValue> inputs{at::randn({4, 2, 3}), at::randn({1, 2, 5})};
      auto want = capture::Interpreter(p.graph).Run(inputs), got = capture::Interpreter(back->graph).Run(inputs);
      ASSERT_TRUE(want.ok() && got.ok()) << want.status() << got.status();
      EXPECT_TRUE(at::equal((*got)[0].toTensor(), (*want)[0].toTensor())) << "lstm " << lstm << ", fp16 " << fp16;
      ExpectCorruptionsHarmless(good, rng, 1000, [] {
        return std::vector<c10::IValue>{at::randn({4, 2, 3}), at::randn({1, 2, 5})};
      });
    }
  }
}

// Every prefix of a file, and random corruption: an error or a program, never a crash; a program
// that loads from hostile bytes is run once (an error is fine).
TEST(Format, Fuzz) {
  const std::string good = Bytes(Program());
  for (size_t n = 0; n < good.size(); ++n) {
    EXPECT_FALSE(Deserialize(std::string_view(good).substr(0, n)).ok()) << n;
  }
  std::mt19937_64 rng(7);
  int loaded = 0;
  for (int i = 0; i < 20000; ++i) {
    std::string bytes = good;
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int f = 0; f < flips; ++f) {
      const size_t at = kHeaderBytes + rng() % (bytes.size() - kHeaderBytes);
      bytes[at] = static_cast<char>(rng() % 3 == 0 ? ~bytes[at] : bytes[at] ^ (1 + rng() % 255));
    }
    if (i % 2 == 0) {  // hostile: a checksum that matches
      const uint64_t sum = Checksum(std::string_view(bytes).substr(kHeaderBytes));
      std::memcpy(&bytes[24], &sum, sizeof(sum));
    }
    auto p = Deserialize(bytes);
    if (i % 2 == 1) EXPECT_FALSE(p.ok());
    if (!p.ok()) continue;
    ++loaded;
    std::vector<c10::IValue> inputs;
    for (const BoundTensor& b : p->bound) inputs.emplace_back(b.tensor);
    inputs.emplace_back(at::randn({2, 3}));
    inputs.emplace_back(int64_t{3});
    if (inputs.size() == p->graph->inputs().size()) (void)capture::Interpreter(p->graph).Run(inputs);
  }
  EXPECT_GT(loaded, 0);  // some corruptions (of tensor bytes) load, and were run
}

}  // namespace
}  // namespace torchreplay::format
