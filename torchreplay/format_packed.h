// torchreplay/format_packed.h: how a .trp file holds packed quantized weights (a value of tag
// kPackedLinear, format.cc): written unpacked, packed again by the reader. Apart from format.cc
// because it is the one value that is an object built by ATen's own op rather than data.
#pragma once

#include <ATen/core/class_type.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>
#include <ATen/native/quantized/PackedParams.h>
#include <ATen/ops/_make_per_channel_quantized_tensor.h>
#include <ATen/ops/_make_per_tensor_quantized_tensor.h>
#include <ATen/ops/int_repr.h>

#include <exception>
#include <utility>

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

}  // namespace torchreplay::format
