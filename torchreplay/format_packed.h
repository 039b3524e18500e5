// torchreplay/format_packed.h: how a .trp file holds packed quantized weights (values of tags
// kPackedLinear and kPackedCells, format.cc): written unpacked, packed again by the reader. Apart
// from format.cc because they are the values that are objects built by ATen's own ops rather than
// data.
#pragma once

#include <ATen/core/class_type.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/function.h>
#include <ATen/core/ivalue.h>
#include <ATen/native/quantized/PackedParams.h>
#include <ATen/ops/_make_per_channel_quantized_tensor.h>
#include <ATen/ops/_make_per_tensor_quantized_tensor.h>
#include <ATen/ops/int_repr.h>
#include <torch/custom_class_detail.h>

#include <exception>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "torchreplay/format_io.h"

namespace torchreplay::format {

// How a packed weight is stored.
enum class PackedWeight : uint8_t { kFp16, kPerTensor, kPerChannel };

// quantize_dynamic's packed weights (qint8 or fp16), whatever engine packed them.
inline bool IsPackedLinear(const c10::IValue& v) {
  return v.isObject() &&
         v.toObjectRef().type()->name()->qualifiedName() == "__torch__.torch.classes.quantized.LinearPackedParamsBase";
}

// Packed quantized weights (quantize_dynamic's Linears: Note [Packed quantized Linears] in
// python/torchreplay/packed.py), as their unpacked weight and bias: a kind (PackedWeight), the
// weight (fp32 for fp16 packing, else the int8 values), the quantization's scale and zero point
// (per tensor) or scales, zero points and axis (per channel), whether a bias follows, the bias. The
// reader packs them again with ATen's prepack, the op that packed them, on this machine's engine.
template <class IO>
void PackedLinearFields(IO& io, c10::IValue& v) {
  at::Tensor weight, scales, zero_points, bias;
  double scale = 0;
  int64_t zero_point = 0, axis = 0;
  uint8_t kind = 0;
  if (IO::kWriting) {
    auto [w, b] = v.toCustomClass<LinearPackedParamsBase>()->unpack();
    if (b.has_value()) bias = *b;
    if (!w.is_quantized()) {
      kind = static_cast<uint8_t>(PackedWeight::kFp16), weight = w;
    } else if (w.qscheme() == at::kPerTensorAffine && w.scalar_type() == at::kQInt8) {
      kind = static_cast<uint8_t>(PackedWeight::kPerTensor), weight = at::int_repr(w);
      scale = w.q_scale(), zero_point = w.q_zero_point();
    } else if (w.qscheme() == at::kPerChannelAffine && w.scalar_type() == at::kQInt8) {
      kind = static_cast<uint8_t>(PackedWeight::kPerChannel), weight = at::int_repr(w);
      scales = w.q_per_channel_scales(), zero_points = w.q_per_channel_zero_points(), axis = w.q_per_channel_axis();
    } else {
      throw Unsupported{absl::StrCat("packed weights quantized as ", c10::toString(w.qscheme()))};
    }
  }
  io.template Num<uint8_t>(kind, "packed weights kind", 0, 2, "unknown packed weights kind");
  io.Tensor(weight);
  const auto how = static_cast<PackedWeight>(kind);
  if (how == PackedWeight::kPerTensor) {
    io.template Num<double>(scale, "packed weights scale");
    io.template Num<int64_t>(zero_point, "packed weights zero point");
  } else if (how == PackedWeight::kPerChannel) {
    io.Tensor(scales);
    io.Tensor(zero_points);
    io.template Num<int64_t>(axis, "packed weights axis", 0, 1, "a packed weights axis is out of range");
  }
  uint8_t has_bias = bias.defined();
  io.template Num<uint8_t>(has_bias, "packed weights bias", 0, 1, "a packed weights bias flag is out of range");
  if (has_bias) io.Tensor(bias);
  if (IO::kWriting) return;
  io.Check(weight.dim() == 2 && weight.scalar_type() == (how == PackedWeight::kFp16 ? at::kFloat : at::kChar),
           "packed weights that are no 2-d weight of their kind");
  io.Check(!bias.defined() || (bias.dim() == 1 && bias.scalar_type() == at::kFloat),
           "packed weights with a bias that is no 1-d float tensor");
  if (how == PackedWeight::kPerChannel) {
    io.Check(scales.dim() == 1 && scales.scalar_type() == at::kDouble && zero_points.dim() == 1 &&
                 zero_points.scalar_type() == at::kLong && scales.numel() == weight.size(axis) &&
                 zero_points.numel() == weight.size(axis),
             "packed weights whose scales or zero points do not match them");
  }
  try {
    at::Tensor w = how == PackedWeight::kFp16      ? weight
                   : how == PackedWeight::kPerTensor ? at::_make_per_tensor_quantized_tensor(weight, scale, zero_point)
                                                     : at::_make_per_channel_quantized_tensor(weight, scales, zero_points, axis);
    torch::jit::Stack stack{w, bias.defined() ? c10::IValue(bias) : c10::IValue()};
    c10::Dispatcher::singleton()
        .findSchemaOrThrow(how == PackedWeight::kFp16 ? "quantized::linear_prepack_fp16" : "quantized::linear_prepack", "")
        .callBoxed(stack);
    v = std::move(stack.at(0));
  } catch (const std::exception&) {  // c10::Error, and the range errors of ATen's conversions
    io.Check(false, "packed weights that ATen does not pack");
  }
}

inline constexpr char kCellClass[] = "__torch__.torch.classes.rnn.CellParamsBase";

// quantize_dynamic's LSTMs' and GRUs' packed cells: a list of rnn.CellParamsBase objects (the
// argument `params` of aten::quantized_lstm / quantized_gru).
inline bool IsPackedCells(const c10::IValue& v) {
  if (!v.isList()) return false;
  const auto cls = v.toListRef().empty() ? nullptr : v.toList().elementType()->cast<c10::ClassType>();
  return cls != nullptr && cls->name()->qualifiedName() == kCellClass;
}

// One packed cell (Note [Packed quantized Linears] in python/torchreplay/packed.py), as the state
// its class's __getstate__ gives: its kind ("quantized_dynamic": int8 weights with fp32 biases
// beside them; "quantized_fp16": the biases inside the packed weights), the biases, whether its
// activations' range is reduced (int8 only), and its two packed Linears (input and hidden), each
// as PackedLinearFields. The reader makes the cell again with the class's __setstate__, the way
// torch.load does, from checked fields.
template <class IO>
void PackedCellFields(IO& io, c10::IValue& cell) {
  std::string kind;
  std::vector<at::Tensor> biases;
  std::vector<c10::IValue> linears;
  uint8_t reduce_range = 0;
  if (IO::kWriting) {
    const c10::IValue state = cell.toObjectRef().type()->getMethod("__getstate__")({cell});
    const auto& fields = state.toTupleRef().elements();
    kind = fields[0].toStringRef();
    if ((kind != "quantized_dynamic" && kind != "quantized_fp16") || !fields[2].toDoubleList().empty()) {
      throw Unsupported{absl::StrCat("packed recurrent cells of kind ", kind)};
    }
    biases = fields[1].toTensorVector();
    if (kind == "quantized_dynamic") reduce_range = fields[3].toIntVector().at(0) != 0;
    for (const c10::IValue& l : fields[4].toListRef()) linears.push_back(l);
  }
  io.Str(kind, "packed cell kind");
  const bool int8 = kind == "quantized_dynamic";
  io.Check(int8 || kind == "quantized_fp16", "unknown packed cell kind");
  io.Count(biases, "packed cell biases", sizeof(uint32_t));
  io.Check(biases.size() == (int8 ? 2u : 0u), "a packed cell with another number of biases than its kind has");
  for (at::Tensor& b : biases) io.Tensor(b);
  if (int8) io.template Num<uint8_t>(reduce_range, "packed cell reduce_range", 0, 1, "a reduce_range out of range");
  io.Count(linears, "packed cell weights");
  io.Check(linears.size() == 2, "a packed cell without its two packed weights");
  for (c10::IValue& l : linears) PackedLinearFields(io, l);
  if (IO::kWriting) return;
  const c10::ClassTypePtr cls = torch::getCustomClass(kCellClass);
  io.Check(cls != nullptr, "packed recurrent cells, a class this LibTorch does not have");
  try {
    c10::List<c10::intrusive_ptr<LinearPackedParamsBase>> packed;
    for (size_t i = 0; i < linears.size(); ++i) {
      auto linear = linears[i].toCustomClass<LinearPackedParamsBase>();
      packed.push_back(linear);
      if (!int8) continue;
      const at::Tensor& b = biases[i];
      io.Check(b.dim() == 1 && b.scalar_type() == at::kFloat && b.numel() == std::get<0>(linear->unpack()).size(0),
               "a packed cell whose biases do not match its weights");
    }
    auto object = c10::ivalue::Object::create(c10::StrongTypePtr(nullptr, cls), cls->numAttributes());
    const c10::IValue state = c10::ivalue::Tuple::create(
        {c10::IValue(kind), c10::IValue(c10::List<at::Tensor>(biases)), c10::IValue(c10::List<double>()),
         c10::IValue(c10::List<int64_t>(int8 ? std::vector<int64_t>{reduce_range} : std::vector<int64_t>{})),
         c10::IValue(packed)});
    cls->getMethod("__setstate__")({c10::IValue(object), state});
    cell = c10::IValue(std::move(object));
  } catch (const c10::Error&) {
    io.Check(false, "a packed cell that ATen does not make");
  }
}

// The list of an LSTM's or GRU's cells: their count, then each cell.
template <class IO>
void PackedCellsFields(IO& io, c10::IValue& v) {
  std::vector<c10::IValue> cells = IO::kWriting ? v.toList().vec() : std::vector<c10::IValue>();
  io.Count(cells, "packed cells");
  io.Check(!cells.empty(), "an empty list of packed cells");
  for (c10::IValue& cell : cells) PackedCellFields(io, cell);
  if (IO::kWriting) return;
  c10::impl::GenericList list(torch::getCustomClass(kCellClass));
  for (c10::IValue& cell : cells) list.push_back(std::move(cell));
  v = c10::IValue(std::move(list));
}

}  // namespace torchreplay::format
