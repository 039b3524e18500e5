// Convolutions through faster calls that compute eager's bits (Note [Checked convolutions] in
// conv_steps.h): the check the recording run makes per node, the out= op, and the tape's step.
#include "capture/tape/checked/conv_steps.h"

#include <ATen/ATen.h>
#include <ATen/native/ConvUtils.h>
#include <ATen/ops/_slow_conv2d_forward_native.h>
#include <ATen/ops/mkldnn_reorder_conv2d_weight.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <functional>
#include <limits>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "capture/kernels/cpu_features.h"
#include "capture/kernels/depthwise_kernel.h"
#include "capture/tape/checked/kernel_check.h"

namespace torchreplay::capture::tape::checked {
namespace {

constexpr char kOutName[] = "torchreplay::convolution.out";
constexpr char kSlowConv2d[] = "slow_conv2d";
constexpr char kOnednn[] = "onednn_prepacked";
constexpr char kDepthwise[] = "depthwise";                 // Note [Depthwise convolutions]: bias first
constexpr char kDepthwiseBiasLast[] = "depthwise_bias_last";  // the bias added after the taps

using PointwiseSig = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                c10::ArrayRef<int64_t>, c10::ArrayRef<int64_t>, c10::ArrayRef<int64_t>, int64_t,
                                c10::string_view, c10::List<std::optional<c10::Scalar>>,
                                std::optional<c10::string_view>);

// oneDNN's convolution as Inductor's CPU freezing calls it, resolved once.
const c10::TypedOperatorHandle<PointwiseSig>* Pointwise() {
  static const auto* op = []() -> const c10::TypedOperatorHandle<PointwiseSig>* {
    auto handle = c10::Dispatcher::singleton().findSchema({"mkldnn::_convolution_pointwise", ""});
    if (!handle.has_value() || !handle->hasKernelForDispatchKey(c10::DispatchKey::CPU)) return nullptr;
    try {
      return new c10::TypedOperatorHandle<PointwiseSig>(handle->typed<PointwiseSig>());
    } catch (const c10::Error&) {
      return nullptr;
    }
  }();
  return op;
}

// `t` with a dim of size 1 inserted at 2, as t.unsqueeze(2) makes it (eager's view4d), without a
// dispatch: the same storage, so a planned buffer's view follows the arena when it grows.
at::Tensor View4d(const at::Tensor& t) {
  std::vector<int64_t> sizes = t.sizes().vec(), strides = t.strides().vec();
  const int64_t stride = sizes[2] * strides[2];
  sizes.insert(sizes.begin() + 2, 1);
  strides.insert(strides.begin() + 2, stride);
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::TensorImpl::VIEW, c10::Storage(t.storage()),
                                                   t.key_set(), t.dtype());
  impl->set_sizes_and_strides(sizes, strides, t.storage_offset());
  return at::Tensor(std::move(impl));
}

// A convolution as the step runs it: one kernel, the 2-d parameters eager's backend gets.
class ConvCall {
 public:
  ConvCall(std::string kernel, bool one_d, std::vector<int64_t> stride, std::vector<int64_t> padding,
           std::vector<int64_t> dilation, int64_t groups)
      : kernel_(std::move(kernel)), one_d_(one_d), stride_(std::move(stride)), padding_(std::move(padding)),
        dilation_(std::move(dilation)), groups_(groups) {
    if (one_d_) {  // _convolution's view1d_as_2d
      stride_.insert(stride_.begin(), 1);
      padding_.insert(padding_.begin(), 0);
      dilation_.insert(dilation_.begin(), 1);
    }
  }

  bool onednn() const { return kernel_ == kOnednn; }
  bool depthwise() const { return kernel_ == kDepthwise || kernel_ == kDepthwiseBiasLast; }

  // out = convolution(input, weight, bias), into `out` (the result's recorded geometry).
  void Run(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
           const at::Tensor& out) const {
    // eager's _convolution makes a 1-d input contiguous, then views it (and the weight) as 2-d
    const at::Tensor x = one_d_ ? View4d(input.is_contiguous() ? input : input.contiguous()) : input;
    at::Tensor y = one_d_ ? View4d(out) : out;
    if (depthwise()) return RunDepthwise(x, one_d_ ? View4d(weight) : weight, weight, bias, y);
    if (!onednn()) {
      const at::Tensor w = one_d_ ? View4d(weight) : weight;
      at::native::slow_conv2d_forward_out_cpu(x, w, w.sizes().slice(2), bias, stride_, padding_, y);
      return;
    }
    if (packed_watch_.Changed(weight) || packed_for_ != x.sizes()) Pack(weight, x.sizes());
    y.copy_(Pointwise()->redispatch(c10::DispatchKeySet(c10::DispatchKey::CPU), x, packed_, bias, padding_, stride_,
                                    dilation_, groups_, "none", c10::List<std::optional<c10::Scalar>>(),
                                    std::nullopt));
  }

 private:
  // Note [Depthwise convolutions]: x, w4 and y as 4-d tensors; `weight` the weight as the graph
  // has it (which a channels-last filter copy follows).
  void RunDepthwise(const at::Tensor& x, const at::Tensor& w4, const at::Tensor& weight,
                    const std::optional<at::Tensor>& bias, at::Tensor& y) const {
    TORCH_CHECK(x.scalar_type() == c10::kFloat && y.scalar_type() == c10::kFloat && w4.size(1) == 1 &&
                    w4.size(0) == x.size(1) && y.size(1) == x.size(1) && groups_ == x.size(1),
                kOutName, ": ", kernel_, " is for float32 convolutions with one filter per channel");
    const at::Tensor w = w4.is_contiguous() ? w4 : w4.contiguous();
    at::Tensor b;
    kernels::depthwise::Params p;
    if (bias.has_value() && bias->defined()) {
      b = bias->is_contiguous() ? *bias : bias->contiguous();
      p.bias = b.const_data_ptr<float>();
    }
    p.x = x.const_data_ptr<float>();
    p.w = w.const_data_ptr<float>();
    p.y = y.data_ptr<float>();
    p.n = x.size(0), p.c = x.size(1), p.h = x.size(2), p.w_ = x.size(3);
    p.oh = y.size(2), p.ow = y.size(3), p.kh = w.size(2), p.kw = w.size(3);
    for (int d = 0; d < 2; ++d) {
      p.stride[d] = stride_[d], p.padding[d] = padding_[d], p.dilation[d] = dilation_[d];
    }
    for (int d = 0; d < 4; ++d) p.xs[d] = x.stride(d), p.ys[d] = y.stride(d);
    {  // the filters as [KH, KW, C], for walks over channels (channels-last, or short rows)
      if (w_hwc_watch_.Changed(weight)) w_hwc_ = w.view({p.c, p.kh, p.kw}).permute({1, 2, 0}).contiguous();
      p.w_hwc = w_hwc_.const_data_ptr<float>();
    }
    p.bias_first = kernel_ == kDepthwise;
    kernels::depthwise::Run(p);
  }

  void Pack(const at::Tensor& weight, at::IntArrayRef input_sizes) const {
    const at::Tensor w = (one_d_ ? View4d(weight) : weight).contiguous();
    packed_ = at::mkldnn_reorder_conv2d_weight(w.to_mkldnn(), padding_, stride_, dilation_, groups_, input_sizes);
    packed_for_ = input_sizes.vec();
  }

  std::string kernel_;
  bool one_d_;
  std::vector<int64_t> stride_, padding_, dilation_;
  int64_t groups_;
  // onednn_prepacked: the weight in oneDNN's layout, what it was made from (WeightWatch) and the
  // input sizes it was packed for (a tape runs on one thread)
  mutable at::Tensor packed_;
  mutable WeightWatch packed_watch_;
  mutable std::vector<int64_t> packed_for_;
  // depthwise on channels-last tensors: the filters as [KH, KW, C], and what they were made from
  mutable at::Tensor w_hwc_;
  mutable WeightWatch w_hwc_watch_;
};

// aten::convolution's arguments, as one run had them.
struct ConvArgs {
  at::Tensor input, weight;
  std::optional<at::Tensor> bias;
  std::vector<int64_t> stride, padding, dilation, output_padding;
  bool transposed = false;
  int64_t groups = 1;
};

// Whether some dim's padding exceeds the kernel's reach, (size - 1) * dilation, so that outputs
// see padding only: oneDNN 3.x's brgemm convolution segfaulted there with a stride over 1 (a
// channels-last Conv2d(3, 16, (1, 3), stride=(3, 2), padding=(4, 5), dilation=(1, 2)) on [2, 3, 8,
// 1], eager PyTorch 2.11 too), so the oneDNN candidate is not tried.
bool PaddingBeyondReach(const ConvArgs& a) {
  for (size_t d = 0; d < a.padding.size(); ++d) {
    const int64_t size = a.weight.size(static_cast<int64_t>(d) + 2);
    if (a.padding[d] > (size - 1) * a.dilation[d]) return true;
  }
  return false;
}

ConvArgs ArgsOf(const Node& n, const std::vector<c10::IValue>& env) {
  std::vector<c10::IValue> v;
  for (size_t a = 0; a < n.args.size(); ++a) v.push_back(MaterializeArg(n.args[a], n.arg_types[a], env));
  ConvArgs c;
  c.input = v[0].toTensor();
  c.weight = v[1].toTensor();
  if (v[2].isTensor() && v[2].toTensor().defined()) c.bias = v[2].toTensor();
  c.stride = v[3].toIntVector();
  c.padding = v[4].toIntVector();
  c.dilation = v[5].toIntVector();
  c.transposed = v[6].toBool();
  c.output_padding = v[7].toIntVector();
  c.groups = v[8].toInt();
  return c;
}

// Empty when `call` computes eager's bits on the recorded input and the two synthetic ones and,
// with a bias, on the second synthetic input with a bias of negative NaNs (its positive NaNs meet
// them: which NaN a sum keeps is the order of its last add), into a buffer of the recorded
// geometry left as it was; else why not.
std::string CheckCall(const Node& n, const ConvCall& call, const ConvArgs& a, const at::Tensor& result,
                      const ValueRecord& r, const std::vector<c10::IValue>& env) {
  const char* inputs[] = {"the recorded input", "an input with signed zeros and subnormals",
                          "an input with infinities and NaNs", "NaNs in the input and the bias"};
  for (int k = 0; k < (a.bias.has_value() ? 4 : 3); ++k) {
    at::Tensor input = a.input, eager = result;
    std::optional<at::Tensor> bias = a.bias;
    if (k > 0) {
      input = Synthetic(a.input, k >= 2);
      torch::jit::Stack stack;
      for (size_t i = 0; i < n.args.size(); ++i) stack.push_back(MaterializeArg(n.args[i], n.arg_types[i], env));
      stack[0] = input;
      if (k == 3) {
        bias = at::full_like(*a.bias, -std::numeric_limits<float>::quiet_NaN());
        stack[2] = *bias;
      }
      n.op->callBoxed(&stack);
      eager = stack[0].toTensor();
    }
    const std::string why =
        CompareRun([&](const at::Tensor& buffer) { call.Run(input, a.weight, bias, buffer); }, eager, r, inputs[k]);
    if (!why.empty()) return why;
  }
  return "";
}

bool KnownKernel(c10::string_view k) {
  return k == kSlowConv2d || k == kOnednn || k == kDepthwise || k == kDepthwiseBiasLast;
}

const char* BackendName(at::native::ConvBackend b) {
  static const char* const kNames[] = {
      "CudaDepthwise2d", "CudaDepthwise3d", "Cudnn", "CudnnTranspose", "Empty", "Miopen", "MiopenDepthwise",
      "MiopenTranspose", "Mkldnn", "MkldnnTranspose", "MkldnnEmpty", "NnpackSpatial", "Overrideable", "Slow2d",
      "Slow3d", "SlowDilated2d", "SlowDilated3d", "SlowTranspose2d", "SlowTranspose3d", "Winograd3x3Depthwise",
      "Xnnpack2d", "Mps", "MpsTranspose"};
  const auto i = static_cast<size_t>(b);
  return i < sizeof(kNames) / sizeof(kNames[0]) ? kNames[i] : "unknown";
}

}  // namespace

bool IsConvolution(const Node& n) {
  // TORCHREPLAY_CHECKED_CONV=0: eager's op everywhere (read at each capture, for comparisons)
  const char* env = std::getenv("TORCHREPLAY_CHECKED_CONV");
  if (env != nullptr && std::string(env) == "0") return false;
  return n.kind == NodeKind::kOp && n.op->schema().name() == "aten::convolution" &&
         n.op->schema().overload_name().empty() && n.outputs.size() == 1 && n.args.size() == 9;
}

namespace {

// Why the checked kernels do not cover convolution `a` with result `result`; empty when they do.
std::string Unfit(const ConvArgs& a, const at::Tensor& result) {
  const c10::ScalarType dtype = a.input.scalar_type();
  if (a.transposed) return "a transposed convolution";
  if ((dtype != c10::kFloat && dtype != c10::kDouble) || a.weight.scalar_type() != dtype ||
      (a.bias.has_value() && a.bias->scalar_type() != dtype) || result.scalar_type() != dtype) {
    return absl::StrCat("dtype ", c10::toString(dtype), " (float32 and float64 are checked)");
  }
  if (a.input.dim() != 3 && a.input.dim() != 4) return absl::StrCat(a.input.dim() - 2, "-d");
  if (a.input.layout() != c10::kStrided || a.weight.layout() != c10::kStrided || a.input.is_conj() ||
      a.input.is_neg() || a.weight.is_neg() || a.input.numel() == 0 || result.numel() == 0) {
    return "an input that is not plain dense memory, or empty";
  }
  return "";
}

// The kernels worth trying on convolution `a` (eager's backend `backend`, its weight fixed under
// the key or not), in Note [Checked convolutions]'s order; those not tried in `not_tried`, with why.
std::vector<std::string> CandidateKernels(const ConvArgs& a, at::native::ConvBackend backend, bool weight_fixed,
                                          std::vector<std::string>* not_tried) {
  const c10::ScalarType dtype = a.input.scalar_type();
  std::vector<std::string> kernels;
  if (backend == at::native::ConvBackend::Slow2d) {
    kernels.push_back(kSlowConv2d);
  } else {
    not_tried->push_back(absl::StrCat(kSlowConv2d, ": eager's backend is ", BackendName(backend)));
  }
  if (dtype != c10::kFloat) {
    not_tried->push_back(absl::StrCat(kOnednn, ": float32 only"));
  } else if (Pointwise() == nullptr) {
    not_tried->push_back(absl::StrCat(kOnednn, ": mkldnn::_convolution_pointwise has no CPU kernel here"));
  } else if (!weight_fixed) {
    not_tried->push_back(absl::StrCat(kOnednn, ": the weight is computed or bound per call"));
  } else if (PaddingBeyondReach(a)) {
    not_tried->push_back(absl::StrCat(kOnednn, ": padding beyond the kernel's reach (oneDNN's convolution crashed "
                                               "on such a geometry)"));
  } else {
    kernels.push_back(kOnednn);
  }
  const bool one_filter_per_channel = a.groups > 1 && a.weight.size(0) == a.groups && a.weight.size(1) == 1 &&
                                      a.input.size(1) == a.groups;
  if (one_filter_per_channel && dtype != c10::kFloat) {
    not_tried->push_back(absl::StrCat(kDepthwise, ": float32 only"));
  } else if (one_filter_per_channel && !kernels::depthwise::Available()) {
    not_tried->push_back(absl::StrCat(kDepthwise, ": this CPU has no AVX2 and FMA"));
  } else if (one_filter_per_channel) {
    kernels.push_back(kDepthwise);
    if (a.bias.has_value()) kernels.push_back(kDepthwiseBiasLast);
  }
  return kernels;
}

}  // namespace

// Note [The shape of a check], its third step Note [Checked convolutions]'s.
void CheckConvolution(const Graph& g, int node, const std::vector<c10::IValue>& env, Recording* rec) {
  const Node& n = g.nodes()[node];
  CheckNode(g, node, env, rec, kOutName, /*refusal_in_notes=*/false,
                   [&](const std::vector<const ValueRecord*>& results, Decision& decision) {
    const ConvArgs a = ArgsOf(n, env);
    const at::Tensor& result = env[n.outputs[0]].toTensor();
    if (std::string why = Unfit(a, result); !why.empty()) return decision.Refuse(why);
    const at::native::ConvBackend backend = at::native::select_conv_backend(
        a.input, a.weight, a.bias, c10::fromIntArrayRefSlow(a.stride), c10::fromIntArrayRefSlow(a.padding),
        c10::fromIntArrayRefSlow(a.dilation), a.transposed, c10::fromIntArrayRefSlow(a.output_padding),
        c10::SymInt(a.groups), std::nullopt);
    std::vector<std::string> not_tried;
    const std::vector<std::string> kernels =
        CandidateKernels(a, backend, FixedUnderKey(g, node, n.args[1], *rec), &not_tried);
    const at::Tensor buffer = FixedBuffer(*results[0]);
    std::vector<std::shared_ptr<ConvCall>> calls;
    std::vector<Candidate> candidates;
    for (const std::string& kernel : kernels) {
      auto call = std::make_shared<ConvCall>(kernel, a.input.dim() == 3, a.stride, a.padding, a.dilation, a.groups);
      candidates.push_back({kernel, CheckCall(n, *call, a, result, *results[0], env),
                            [&, call] { call->Run(a.input, a.weight, a.bias, buffer); },
                            /*may_tie=*/kernel == kSlowConv2d});  // eager's kernel with less around it
    }
    torch::jit::Stack args;
    for (size_t i = 0; i < n.args.size(); ++i) args.push_back(MaterializeArg(n.args[i], n.arg_types[i], env));
    return decision.KeepFastest(
        absl::StrCat("eager's op (backend ", BackendName(backend), ")"),
        [&] {
          torch::jit::Stack stack = args;
          n.op->callBoxed(&stack);
        },
        std::move(candidates), not_tried, a.bias ? 4 : 3);
  });
}

namespace {

// torchreplay::convolution.out, boxed: the kernel named by `kernel`, packing the weight on each call
// (the tape's step packs it once).
at::Tensor& ConvolutionOut(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                           at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, bool transposed,
                           at::IntArrayRef output_padding, int64_t groups, c10::string_view kernel, at::Tensor& out) {
  TORCH_CHECK(!transposed && KnownKernel(kernel) && (input.dim() == 3 || input.dim() == 4), kOutName,
              ": no kernel '", kernel, "' for this convolution");
  TORCH_CHECK(kernel != kOnednn || Pointwise() != nullptr, kOutName, ": no oneDNN convolution here");
  TORCH_CHECK(kernel == kOnednn || kernel == kSlowConv2d || kernels::depthwise::Available(), kOutName,
              ": the depthwise kernel needs AVX2 and FMA");
  ConvCall(std::string(kernel), input.dim() == 3, stride.vec(), padding.vec(), dilation.vec(), groups)
      .Run(input, weight, bias, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(torchreplay, CPU, m) { m.impl("convolution.out", &ConvolutionOut); }

std::unique_ptr<TypedCall> MakeConvolutionStep(const Slots& args, const std::vector<int>& slot_of) {
  if (args.size() != 11 || slot_of.size() != 11) return nullptr;
  for (int k : {3, 4, 5, 6, 7, 8, 9, 10}) {
    if (slot_of[k] >= 0) return nullptr;
  }
  if (!args[3].isIntList() || !args[4].isIntList() || !args[5].isIntList() || !args[6].isBool() ||
      args[6].toBool() || !args[8].isInt() || !args[9].isString() || !args[10].isTensor()) {
    return nullptr;
  }
  const std::string kernel = args[9].toStringRef();
  if (!KnownKernel(kernel) || (kernel == kOnednn && (Pointwise() == nullptr || slot_of[1] >= 0)) ||
      ((kernel == kDepthwise || kernel == kDepthwiseBiasLast) && !kernels::depthwise::Available())) {
    return nullptr;
  }
  const at::Tensor& out = args[10].toTensor();
  auto tensor = [&](int k) -> std::optional<TensorArg> {
    if (slot_of[k] >= 0) return TensorArg{at::Tensor(), slot_of[k]};
    if (args[k].isTensor()) return TensorArg{args[k].toTensor(), -1};
    return std::nullopt;
  };
  std::optional<TensorArg> input = tensor(0), weight = tensor(1), bias = tensor(2);
  if (!input.has_value() || !weight.has_value() || (!bias.has_value() && !args[2].isNone())) return nullptr;
  if (bias.has_value() && bias->slot < 0 && !bias->value.defined()) bias.reset();
  ConvCall call(kernel, out.dim() == 3, args[3].toIntVector(), args[4].toIntVector(), args[5].toIntVector(),
                args[8].toInt());
  return std::make_unique<CheckedStep<ConvCall>>(std::move(call), *std::move(input), *std::move(weight), std::move(bias),
                                           out);
}

const char* ConvolutionStepKind(const Slots& args) {
  const std::string kernel = args.size() == 11 && args[9].isString() ? args[9].toStringRef() : "";
  return kernel == kOnednn               ? "checked conv (onednn_prepacked)"
         : kernel == kDepthwise         ? "checked conv (depthwise)"
         : kernel == kDepthwiseBiasLast ? "checked conv (depthwise_bias_last)"
                                        : "checked conv (slow_conv2d)";
}

}  // namespace torchreplay::capture::tape::checked
