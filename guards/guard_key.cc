#include "guards/guard_key.h"

#include <ATen/Context.h>
#include <ATen/Parallel.h>

#include <cstring>
#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>
#endif

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace torchreplay::guards {

bool SameFloat(double a, double b) { return std::memcmp(&a, &b, sizeof(double)) == 0; }

namespace {

// Functionality keys (no backend bits) of tensors that are not plain dense strided ones.
constexpr c10::DispatchKeySet kNotPlainKeys({
    c10::DispatchKey::Python, c10::DispatchKey::Conjugate, c10::DispatchKey::Negative,
    c10::DispatchKey::ZeroTensor, c10::DispatchKey::NestedTensor, c10::DispatchKey::Sparse,
    c10::DispatchKey::SparseCsr, c10::DispatchKey::MkldnnCPU, c10::DispatchKey::FuncTorchBatched,
    c10::DispatchKey::FuncTorchGradWrapper, c10::DispatchKey::Functionalize});

bool IsPlain(const at::Tensor& t) {
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  return !impl->key_set().has_any(kNotPlainKeys) && impl->has_storage();
}

}  // namespace

const char* NotPlain(const at::Tensor& t) {
  if (IsPlain(t)) return nullptr;
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  if (impl->is_python_dispatch()) return "a tensor subclass with __torch_dispatch__";
  if (impl->is_nested()) return "a nested tensor";
  if (impl->is_conj()) return "a lazy conjugate view (.conj())";
  if (impl->is_neg()) return "a lazy negative view";
  if (impl->layout() != c10::kStrided) return "not strided (sparse or mkldnn)";
  if (impl->_is_zerotensor()) return "a zero tensor";
  return "a wrapper tensor (functorch or functionalization) or a tensor without storage";
}

namespace {

InputGuard GuardOf(const c10::IValue& v) {
  InputGuard g;
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    g.kind = InputGuard::Kind::kTensor;
    if (!t.defined()) return g;
    if (!IsPlain(t)) {  // one key for all of them (they run eagerly): their sizes or strides
      g.kind = InputGuard::Kind::kNotPlainTensor;  // may not even be readable
      return g;
    }
    g.dtype = t.scalar_type();
    g.device = t.device();
    g.sizes.assign(t.sizes().begin(), t.sizes().end());
    g.strides.assign(t.strides().begin(), t.strides().end());
    g.storage_offset = t.storage_offset();
  } else if (v.isInt()) {
    g.kind = InputGuard::Kind::kInt;
    g.int_value = v.toInt();
  } else if (v.isDouble()) {
    g.kind = InputGuard::Kind::kFloat;
    g.float_value = v.toDouble();
  } else if (v.isBool()) {
    g.kind = InputGuard::Kind::kBool;
    g.int_value = v.toBool();
  } else if (v.isNone()) {
    g.kind = InputGuard::Kind::kNone;
  }
  return g;
}

bool SameDims(absl::Span<const int64_t> a, c10::IntArrayRef b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] != b[i]) return false;
  }
  return true;
}

bool Matches(const InputGuard& g, const c10::IValue& v) {
  switch (g.kind) {
    case InputGuard::Kind::kTensor: {
      if (!v.isTensor()) return false;
      const at::Tensor& t = v.toTensor();
      if (!t.defined()) return g.dtype == c10::ScalarType::Undefined;
      return IsPlain(t) && t.scalar_type() == g.dtype && t.device() == g.device &&
             t.storage_offset() == g.storage_offset && SameDims(g.sizes, t.sizes()) &&
             SameDims(g.strides, t.strides());
    }
    case InputGuard::Kind::kInt: return v.isInt() && (g.per_call || v.toInt() == g.int_value);
    case InputGuard::Kind::kFloat:
      return v.isDouble() && (g.per_call || SameFloat(v.toDouble(), g.float_value));
    case InputGuard::Kind::kBool:
      return v.isBool() && (g.per_call || v.toBool() == static_cast<bool>(g.int_value));
    case InputGuard::Kind::kNone: return v.isNone();
    case InputGuard::Kind::kOther: return !v.isTensor() && !v.isInt() && !v.isDouble() && !v.isBool() && !v.isNone();
    case InputGuard::Kind::kNotPlainTensor:
      return v.isTensor() && v.toTensor().defined() && !IsPlain(v.toTensor());
  }
  return false;
}

std::string Dims(absl::Span<const int64_t> d) { return absl::StrCat("(", absl::StrJoin(d, ", "), ")"); }

std::string Describe(const InputGuard& g) {
  switch (g.kind) {
    case InputGuard::Kind::kTensor:
      return absl::StrCat(c10::toString(g.dtype), Dims(g.sizes), "/", Dims(g.strides), "+",
                          g.storage_offset, " ", g.device.str());
    case InputGuard::Kind::kInt: return g.per_call ? "int=*" : absl::StrCat("int=", g.int_value);
    case InputGuard::Kind::kFloat:
      return g.per_call ? "float=*" : absl::StrCat("float=", g.float_value);
    case InputGuard::Kind::kBool:
      return g.per_call ? "bool=*" : absl::StrCat("bool=", g.int_value ? "True" : "False");
    case InputGuard::Kind::kNone: return "None";
    case InputGuard::Kind::kOther: return "other";
    case InputGuard::Kind::kNotPlainTensor: return "tensor (not plain)";
  }
  return "?";
}

}  // namespace

bool InputGuard::operator==(const InputGuard& o) const {
  return kind == o.kind && dtype == o.dtype && device == o.device && sizes == o.sizes &&
         strides == o.strides && storage_offset == o.storage_offset && int_value == o.int_value &&
         SameFloat(float_value, o.float_value) && per_call == o.per_call;
}

GuardKey GuardKey::FromInputs(const std::vector<c10::IValue>& inputs,
                              const std::vector<bool>& per_call) {
  GuardKey k;
  k.inputs_.reserve(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    InputGuard g = GuardOf(inputs[i]);
    if (g.is_scalar() && i < per_call.size() && per_call[i]) {
      g.per_call = true;
      g.int_value = 0;
      g.float_value = 0.0;
    }
    k.inputs_.push_back(std::move(g));
  }
  return k;
}

bool GuardKey::Matches(const std::vector<c10::IValue>& inputs) const {
  if (inputs.size() != inputs_.size()) return false;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!guards::Matches(inputs_[i], inputs[i])) return false;
  }
  return true;
}

std::string GuardKey::ToString() const {
  std::vector<std::string> parts;
  for (const auto& g : inputs_) parts.push_back(Describe(g));
  return absl::StrCat("(", absl::StrJoin(parts, ", "), ")");
}

std::string Diff(const GuardKey& old, const GuardKey& now) {
  const auto& a = old.inputs();
  const auto& b = now.inputs();
  if (a.size() != b.size()) {
    return absl::StrCat("number of inputs ", a.size(), " -> ", b.size());
  }
  std::vector<std::string> clauses;
  for (size_t i = 0; i < a.size(); ++i) {
    const InputGuard& x = a[i];
    const InputGuard& y = b[i];
    if (x == y) continue;
    std::vector<std::string> what;
    if (x.kind != y.kind) {
      what.push_back(absl::StrCat("kind ", Describe(x), " -> ", Describe(y)));
    } else if (x.kind == InputGuard::Kind::kTensor) {
      if (x.dtype != y.dtype) what.push_back(absl::StrCat("dtype ", c10::toString(x.dtype), " -> ", c10::toString(y.dtype)));
      if (x.device != y.device) what.push_back(absl::StrCat("device ", x.device.str(), " -> ", y.device.str()));
      if (x.sizes != y.sizes) what.push_back(absl::StrCat("sizes ", Dims(x.sizes), " -> ", Dims(y.sizes)));
      if (x.strides != y.strides) what.push_back(absl::StrCat("strides ", Dims(x.strides), " -> ", Dims(y.strides)));
      if (x.storage_offset != y.storage_offset) {
        what.push_back(absl::StrCat("storage offset ", x.storage_offset, " -> ", y.storage_offset));
      }
    } else {
      what.push_back(absl::StrCat("value ", Describe(x), " -> ", Describe(y)));
    }
    clauses.push_back(absl::StrCat("input ", i, ": ", absl::StrJoin(what, ", ")));
  }
  if (old.settings() != now.settings()) clauses.push_back(Ambient::Diff(old.settings(), now.settings()));
  return clauses.empty() ? "same key" : absl::StrJoin(clauses, "; ");
}

Ambient Ambient::Now(bool cuda, bool precision) {
  at::Context& ctx = at::globalContext();
  Ambient a;
  a.threads = at::get_num_threads();
  a.default_dtype = c10::get_default_dtype_as_scalartype();
  using B = at::Float32Backend;
  using Op = at::Float32Op;
  constexpr std::pair<B, Op> kPrecisions[6] = {{B::MKLDNN, Op::MATMUL}, {B::MKLDNN, Op::CONV}, {B::MKLDNN, Op::RNN},
                                               {B::CUDA, Op::MATMUL},   {B::CUDA, Op::CONV},   {B::CUDA, Op::RNN}};
  for (int i = 0; i < (!precision ? 0 : cuda ? 6 : 3); ++i) {
    a.fp32_precision[i] = static_cast<uint8_t>(ctx.float32Precision(kPrecisions[i].first, kPrecisions[i].second));
  }
  a.mkldnn = ctx.userEnabledMkldnn();
  a.mkldnn_deterministic = ctx.deterministicMkldnn();
  a.nnpack = ctx.userEnabledNNPACK();
  a.fp16_reduction_cpu = ctx.allowFP16ReductionCPU();
  a.deterministic = ctx.deterministicAlgorithms();
  a.fill_uninitialized = a.deterministic && ctx.deterministicFillUninitializedMemory();
#if defined(__x86_64__) || defined(_M_X64)
  a.flush_denormal = (_mm_getcsr() & 0x8040) != 0;  // FTZ (bit 15) or DAZ (bit 6): set_flush_denormal
#endif
  if (cuda) {
    a.cuda = {ctx.userEnabledCuDNN(),
              ctx.benchmarkCuDNN(),
              ctx.deterministicCuDNN(),
              static_cast<uint8_t>(ctx.allowFP16ReductionCuBLAS()),
              static_cast<uint8_t>(ctx.allowBF16ReductionCuBLAS()),
              ctx.allowFP16AccumulationCuBLAS()};
  }
  return a;
}

bool Ambient::operator==(const Ambient& o) const {
  return threads == o.threads && default_dtype == o.default_dtype && fp32_precision == o.fp32_precision &&
         mkldnn == o.mkldnn && mkldnn_deterministic == o.mkldnn_deterministic && nnpack == o.nnpack &&
         fp16_reduction_cpu == o.fp16_reduction_cpu && deterministic == o.deterministic &&
         fill_uninitialized == o.fill_uninitialized && flush_denormal == o.flush_denormal && cuda == o.cuda;
}

std::string Ambient::Diff(const Ambient& old, const Ambient& now) {
  auto dtype = [](c10::ScalarType t) -> std::string {
    return t == c10::ScalarType::Undefined ? "off" : c10::toString(t);
  };
  auto on = [](bool b) -> std::string { return b ? "on" : "off"; };
  std::vector<std::string> clauses;
  auto differs = [&](const auto& a, const auto& b, absl::string_view what, const auto& say) {
    if (a != b) clauses.push_back(absl::StrCat(what, " ", say(a), " -> ", say(b)));
  };
  differs(old.threads, now.threads, "threads", [](int n) { return absl::StrCat(n); });
  differs(old.default_dtype, now.default_dtype, "default dtype", dtype);
  constexpr const char* kPrecisionNames[6] = {"mkldnn matmul", "mkldnn conv", "mkldnn rnn",
                                              "cuda matmul",   "cuda conv",   "cuda rnn"};
  for (int i = 0; i < 6; ++i) {
    differs(old.fp32_precision[i], now.fp32_precision[i], absl::StrCat(kPrecisionNames[i], " fp32 precision"),
            [](uint8_t p) { return at::precision2str(static_cast<at::Float32Precision>(p)); });
  }
  differs(old.mkldnn, now.mkldnn, "torch.backends.mkldnn.enabled", [](bool b) -> std::string {
    return b ? "True" : "False";
  });
  differs(old.mkldnn_deterministic, now.mkldnn_deterministic, "mkldnn deterministic", on);
  differs(old.nnpack, now.nnpack, "nnpack", on);
  differs(old.fp16_reduction_cpu, now.fp16_reduction_cpu, "cpu fp16 reduced-precision reduction", on);
  differs(old.deterministic, now.deterministic, "deterministic algorithms", on);
  differs(old.fill_uninitialized, now.fill_uninitialized, "deterministic fill of uninitialized memory", on);
  differs(old.flush_denormal, now.flush_denormal, "flush denormal", on);
  constexpr const char* kCudaNames[6] = {"cudnn enabled", "cudnn benchmark", "cudnn deterministic",
                                         "cublas fp16 reduction", "cublas bf16 reduction",
                                         "cublas fp16 accumulation"};
  for (int i = 0; i < 6; ++i) {
    differs(old.cuda[i], now.cuda[i], kCudaNames[i], [](uint8_t v) { return absl::StrCat(v); });
  }
  return clauses.empty() ? "the same" : absl::StrJoin(clauses, "; ");
}

}  // namespace torchreplay::guards
