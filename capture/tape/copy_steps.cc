// The copies family of steps (Note [Copies] in typed_call.h; Note [Step kinds] in step_kinds.h):
// cat, stack, clone, copy, embedding and an in-place index_copy_ as element copies over the
// recorded geometry, where they move elements only; and torchreplay::to_float32's kernels (Note
// [Exact conversions]).
#include <ATen/Parallel.h>
#include <ATen/TensorIterator.h>
#include <ATen/ops/empty_like.h>
#include <c10/core/WrapDimMinimal.h>
#include <c10/util/accumulate.h>
#include <torch/library.h>

#include <optional>

#include "capture/tape/step_kinds.h"

namespace torchreplay::capture::tape {
namespace {

// A tensor argument as a copy's input, when its dtype is `dtype` and it is no conjugate or
// negative view (whose elements are not its bytes): its recorded geometry, and its value (a
// constant) or slot (per call).
std::optional<CatInput> CopiedInput(const EmitContext& ctx, const Arg& arg, c10::ScalarType dtype) {
  CatInput in;
  if (arg.kind == Arg::Kind::kValue) {
    const ValueRecord& r = ctx.recording().values[arg.value];
    if (!r.is_tensor || r.dtype != dtype || r.lazy_bits) return std::nullopt;
    in.sizes = r.sizes, in.strides = r.strides;
    in.tensor = ctx.TensorArgOf(arg.value);
  } else {
    if (arg.kind != Arg::Kind::kConstant || !arg.constant.isTensor() ||
        arg.constant.toTensor().scalar_type() != dtype || arg.constant.toTensor().is_conj() ||
        arg.constant.toTensor().is_neg()) {
      return std::nullopt;
    }
    in.tensor.value = arg.constant.toTensor();
    in.sizes = in.tensor.value.sizes().vec(), in.strides = in.tensor.value.strides().vec();
  }
  return in;
}

// Note [Concatenation as copies]: aten::cat (or, with `stack`, aten::stack: input k is the
// result's index k along dim) of tensors of the result's dtype into a contiguous buffer, as
// copies; nullptr where it would do more than move elements.
std::unique_ptr<TypedCall> CatAsCopies(const EmitContext& ctx, const Node& n, bool stack) {
  const ValueRecord& out = ctx.recording().values[n.outputs[0]];
  const int64_t rank = static_cast<int64_t>(out.sizes.size());
  if (rank == 0 || n.args.size() != 2 || n.args[0].kind != Arg::Kind::kList ||
      n.args[1].kind != Arg::Kind::kConstant || !n.args[1].constant.isInt()) {
    return nullptr;
  }
  const int64_t dim = c10::maybe_wrap_dim(n.args[1].constant.toInt(), rank);
  const int64_t in_rank = stack ? rank - 1 : rank;
  std::vector<CatInput> inputs;
  for (const Arg& el : n.args[0].elems) {
    std::optional<CatInput> in = CopiedInput(ctx, el, out.dtype);
    if (!in.has_value()) return nullptr;
    if (!stack && in->sizes.size() == 1 && in->sizes[0] == 0) continue;  // a legacy empty tensor: cat skips it
    if (static_cast<int64_t>(in->sizes.size()) != in_rank) return nullptr;
    for (int64_t d = 0; d < in_rank; ++d) {
      if ((stack || d != dim) && in->sizes[d] != out.sizes[stack && d >= dim ? d + 1 : d]) return nullptr;
    }
    inputs.push_back(*std::move(in));
  }
  return MakeCatCopies(std::move(inputs), dim, ctx.BufferOf(n.outputs[0]), stack);
}

// clone(x) and copy(self, src) of src with the result's dtype and sizes: a cat of one input.
std::unique_ptr<TypedCall> CopyAsCopies(const EmitContext& ctx, const Node& n) {
  const ValueRecord& out = ctx.recording().values[n.outputs[0]];
  const bool clone = n.op->schema().name() == "aten::clone";
  const size_t from = clone ? 0 : 1;
  if (n.args.size() <= from) return nullptr;
  std::optional<CatInput> in = CopiedInput(ctx, n.args[from], out.dtype);
  if (!in.has_value() || in->sizes != out.sizes) return nullptr;
  std::vector<CatInput> inputs;
  inputs.push_back(*std::move(in));
  return MakeCatCopies(std::move(inputs), 0, ctx.BufferOf(n.outputs[0]));
}

// embedding(weight, indices) of a 2-d weight and contiguous int64 indices.
std::unique_ptr<TypedCall> EmbeddingAsCopies(const EmitContext& ctx, const Node& n) {
  if (n.args.size() < 2 || n.args[1].kind != Arg::Kind::kValue) return nullptr;
  const ValueRecord& out = ctx.recording().values[n.outputs[0]];
  const ValueRecord& indices = ctx.recording().values[n.args[1].value];
  std::optional<CatInput> weight = CopiedInput(ctx, n.args[0], out.dtype);
  if (!weight.has_value() || weight->sizes.size() != 2 || !indices.is_tensor || indices.dtype != c10::kLong ||
      !indices.contiguous() || !out.contiguous()) {
    return nullptr;
  }
  return MakeEmbeddingRows(*std::move(weight), ctx.TensorArgOf(n.args[1].value), ctx.BufferOf(n.outputs[0]));
}

// Note [Exact conversions]
// torchao's int8 weight-only eager converts each int8 weight to float32 on every call
// (`w.to(x.dtype)`, aten::_to_copy): a functional step of 2-3 µs each (an allocation and
// ATen's copy), 16 on the harness's Llama decode step. A conversion whose every value is exact in
// the result's dtype (int8, uint8, int16 and bool to float32) gives the same bits however it is
// computed. The pass `exact_conversions` (python/torchreplay/passes.py) makes such a _to_copy
// torchreplay::to_float32: its result laid out as _to_copy lays out its own (empty_like: x's
// strides where x is dense), its out= form a typed step into the planned buffer, one loop over
// the elements where x and out are dense alike, ATen's copy_ (eager's own conversion) otherwise.
// kBool: the bytes of a bool tensor, any nonzero byte 1 (as eager converts a bool tensor viewed
// from bytes).
template <class T, bool kBool = false>
__attribute__((optimize("tree-vectorize"))) void ConvertDense(const at::Tensor& x, at::Tensor& out) {
  const T* src = static_cast<const T*>(x.const_data_ptr());
  float* dst = out.mutable_data_ptr<float>();
  at::parallel_for(0, x.numel(), at::internal::GRAIN_SIZE, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) dst[i] = kBool ? static_cast<float>(src[i] != 0) : static_cast<float>(src[i]);
  });
}

at::Tensor& ToFloat32Out(const at::Tensor& x, at::Tensor& out) {
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.sizes() == x.sizes() && out.device() == x.device(),
              "torchreplay::to_float32: out must be float32 with x's sizes and device");
  const bool dense = x.strides() == out.strides() && x.is_non_overlapping_and_dense();
  switch (dense ? x.scalar_type() : c10::ScalarType::Undefined) {
    case at::kChar:
      ConvertDense<int8_t>(x, out);
      break;
    case at::kByte:
      ConvertDense<uint8_t>(x, out);
      break;
    case at::kBool:
      ConvertDense<uint8_t, true>(x, out);
      break;
    case at::kShort:
      ConvertDense<int16_t>(x, out);
      break;
    default:
      out.copy_(x);
  }
  return out;
}

at::Tensor ToFloat32(const at::Tensor& x) {
  at::Tensor out = at::empty_like(x, x.options().dtype(at::kFloat));
  return ToFloat32Out(x, out);
}

}  // namespace

TORCH_LIBRARY_IMPL(torchreplay, CPU, m) {
  m.impl("to_float32", &ToFloat32);
  m.impl("to_float32.out", &ToFloat32Out);
}

bool MatchCopies(const Node&, const std::string& out_op, bool) {
  return out_op == "aten::cat.out" || out_op == "aten::clone.out" || out_op == "aten::copy.out" ||
         out_op == "aten::embedding.out" || out_op == "aten::stack.out";
}

Made MakeCopies(const EmitContext& ctx, const OutCall& call, const CaptureOptions&) {
  const std::string op = OperatorName(call.op);
  const Node& n = call.node;
  return {op == "aten::cat.out" || op == "aten::stack.out" ? CatAsCopies(ctx, n, op == "aten::stack.out")
          : op == "aten::embedding.out"                    ? EmbeddingAsCopies(ctx, n)
                                        : CopyAsCopies(ctx, n),
          "copies"};
}

bool MatchIndexCopy(const Node& n) { return OperatorName(*n.op) == "aten::index_copy_"; }

// self.index_copy_(dim, index, source) with one int64 index, all of one dtype.
std::unique_ptr<TypedCall> MakeIndexCopy(const EmitContext& ctx, const Node& n) {
  if (n.args.size() != 4 || n.args[1].kind != Arg::Kind::kConstant || !n.args[1].constant.isInt() ||
      n.args[2].kind != Arg::Kind::kValue || n.args[0].kind != Arg::Kind::kValue) {
    return nullptr;
  }
  const ValueRecord& self = ctx.recording().values[n.args[0].value];
  const ValueRecord& index = ctx.recording().values[n.args[2].value];
  if (!self.is_tensor || self.sizes.empty() || !index.is_tensor || index.dtype != c10::kLong ||
      c10::multiply_integers(index.sizes) != 1) {
    return nullptr;
  }
  const int64_t dim = c10::maybe_wrap_dim(n.args[1].constant.toInt(), static_cast<int64_t>(self.sizes.size()));
  std::optional<CatInput> dst = CopiedInput(ctx, n.args[0], self.dtype), src = CopiedInput(ctx, n.args[3], self.dtype);
  if (!dst.has_value() || !src.has_value() || src->sizes.size() != dst->sizes.size() || src->sizes[dim] != 1) {
    return nullptr;
  }
  for (size_t d = 0; d < src->sizes.size(); ++d) {
    if (static_cast<int64_t>(d) != dim && src->sizes[d] != dst->sizes[d]) return nullptr;
  }
  return MakeIndexCopyOne(*std::move(dst), dim, ctx.TensorArgOf(n.args[2].value), *std::move(src));
}

}  // namespace torchreplay::capture::tape
