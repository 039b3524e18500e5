// The max pooling family of steps (Note [Max pooling] in capture/kernels/max_pool.h; Note [Step
// kinds] in step_kinds.h): max_pool2d_with_indices over a float32 map eager pools plane by plane
// (contiguous, not channels-last), through torchreplay's kernel, which gives eager's values and
// indices bit for bit.
#include <ATen/ops/empty_strided.h>

#include "capture/kernels/max_pool.h"
#include "capture/tape/step_kinds.h"

namespace torchreplay::capture::tape {
namespace {

class MaxPoolStep final : public TypedCall {
 public:
  MaxPoolStep(TensorArg input, std::vector<int64_t> sizes, std::vector<int64_t> strides, at::Tensor out,
              at::Tensor indices, kernels::max_pool::Params params)
      : input_(std::move(input)), sizes_(std::move(sizes)), strides_(std::move(strides)), out_(std::move(out)),
        indices_(std::move(indices)), params_(params) {}

  void Run(c10::DispatchKeySet, const Slots& slots) const override {
    const at::Tensor& input = input_.get(slots);
    if (input_.slot >= 0) CheckLayout(input, c10::kFloat, sizes_, strides_);
    kernels::max_pool::Params p = params_;
    // Read per call: a planned buffer moves when the arena grows for another key.
    p.in = input.const_data_ptr<float>();
    p.out = out_.data_ptr<float>();
    p.indices = indices_.defined() ? indices_.data_ptr<int64_t>() : nullptr;
    kernels::max_pool::Run(p);
  }

 private:
  TensorArg input_;                       // float32, contiguous, of sizes_ and strides_
  std::vector<int64_t> sizes_, strides_;  // the recorded input's
  at::Tensor out_, indices_;              // planned buffers, contiguous; indices_ undefined where nothing reads them
  kernels::max_pool::Params params_;      // the geometry
};

// A pooling argument's (kernel, stride, padding or dilation) value for dim `d` of 2 (height,
// width): one value for both, or one each; `empty` where the list is empty (a stride's default).
bool Pick(const c10::IValue& list, int d, int64_t empty, int64_t* value) {
  if (!list.isIntList()) return false;
  const std::vector<int64_t> v = list.toIntVector();
  if (v.size() > 2) return false;
  *value = v.empty() ? empty : v[v.size() == 1 ? 0 : d];
  return true;
}

}  // namespace

bool MatchMaxPool(const Node&, const std::string& out_op, bool whole_args) {
  return whole_args && out_op == "aten::max_pool2d_with_indices.out";
}

Made MakeMaxPool(const EmitContext& ctx, const OutCall& call, const CaptureOptions&) {
  // (self, kernel_size, stride, padding, dilation, ceil_mode, out, indices)
  const Slots& args = call.args;
  if (!kernels::max_pool::Available() || args.size() != 8 || call.node.args.empty() || !args[6].isTensor() ||
      !args[7].isTensor()) {
    return {nullptr, "max pool"};
  }
  for (int k = 1; k < 8; ++k) {
    if (call.slot_of[k] >= 0) return {nullptr, "max pool"};
  }
  TensorArg input;
  std::vector<int64_t> sizes, strides;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  if (call.slot_of[0] >= 0) {
    const Arg& arg = call.node.args[0];
    if (arg.kind != Arg::Kind::kValue) return {nullptr, "max pool"};
    const ValueRecord& r = ctx.recording().values[arg.value];
    if (!r.is_tensor || r.lazy_bits) return {nullptr, "max pool"};
    input = ctx.TensorArgOf(arg.value), sizes = r.sizes, strides = r.strides, dtype = r.dtype;
  } else {
    if (!args[0].isTensor()) return {nullptr, "max pool"};
    input.value = args[0].toTensor();
    if (input.value.is_conj() || input.value.is_neg()) return {nullptr, "max pool"};
    sizes = input.value.sizes().vec(), strides = input.value.strides().vec(), dtype = input.value.scalar_type();
  }
  const at::Tensor& out = args[6].toTensor();
  const at::Tensor& indices = args[7].toTensor();
  const int64_t rank = static_cast<int64_t>(sizes.size());
  if (dtype != c10::kFloat || (rank != 3 && rank != 4) || out.scalar_type() != c10::kFloat ||
      indices.scalar_type() != c10::kLong || !out.is_contiguous() || !indices.is_contiguous() ||
      out.dim() != rank || indices.sizes() != out.sizes()) {
    return {nullptr, "max pool"};
  }
  // Where eager's kernel takes the map as planes: contiguous, and not suggested channels-last
  // (MaxPoolKernel.cpp dispatches on suggest_memory_format()).
  const at::Tensor like = at::empty_strided(sizes, strides, at::TensorOptions().dtype(dtype).device(at::kMeta));
  if (!like.is_contiguous() || like.suggest_memory_format() != at::MemoryFormat::Contiguous) return {nullptr, "max pool"};
  kernels::max_pool::Params p;
  if (!Pick(args[1], 0, 0, &p.kernel_h) || !Pick(args[1], 1, 0, &p.kernel_w) ||
      !Pick(args[2], 0, p.kernel_h, &p.stride_h) || !Pick(args[2], 1, p.kernel_w, &p.stride_w) ||
      !Pick(args[3], 0, 0, &p.pad_h) || !Pick(args[3], 1, 0, &p.pad_w) || !Pick(args[4], 0, 1, &p.dilation_h) ||
      !Pick(args[4], 1, 1, &p.dilation_w)) {
    return {nullptr, "max pool"};
  }
  p.in_h = sizes[rank - 2], p.in_w = sizes[rank - 1];
  p.out_h = out.size(-2), p.out_w = out.size(-1);
  p.planes = rank == 4 ? sizes[0] * sizes[1] : sizes[0];
  if (p.kernel_h < 1 || p.kernel_w < 1 || p.stride_h < 1 || p.stride_w < 1 || p.dilation_h < 1 ||
      p.dilation_w < 1 || p.pad_h < 0 || p.pad_w < 0 || p.in_h * p.in_w >= (int64_t{1} << 31) ||
      out.numel() == 0 || out.size(0) != sizes[0] || (rank == 4 && out.size(1) != sizes[1])) {
    return {nullptr, "max pool"};
  }
  // The indices are written where something reads them (in inference, usually nothing does).
  if (call.node.outputs.size() != 2) return {nullptr, "max pool"};
  return {std::make_unique<MaxPoolStep>(std::move(input), std::move(sizes), std::move(strides), out,
                                        ctx.Read(call.node.outputs[1]) ? indices : at::Tensor(), p),
          "max pool"};
}

}  // namespace torchreplay::capture::tape
