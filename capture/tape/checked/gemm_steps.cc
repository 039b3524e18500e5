// Matrix products through the small GEMM where it computes eager's bits (Note [Checked GEMMs] in
// gemm_steps.h): the check the recording run makes per node, the out= ops, and the tape's step.
#include "capture/tape/checked/gemm_steps.h"

#include <ATen/ATen.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <ATen/MemoryOverlap.h>

#include <algorithm>
#include <cstdlib>
#include <functional>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "capture/tape/checked/kernel_check.h"
#include "capture/kernels/small_gemm.h"

namespace torchreplay::capture::tape::checked {
namespace {

constexpr char kAddmmOut[] = "torchreplay::addmm.out";
constexpr char kMmOut[] = "torchreplay::mm.out";
// How the kernel reads mat2: where it lies, a [K, N] copy, a copy in panels of kPanel columns.
constexpr char kInPlace[] = "small_gemm";
constexpr char kPacked[] = "small_gemm_packed";
constexpr char kPanels[] = "small_gemm_panels";
// and, suffixed to the name, whether the bias is added after the sum (Params::bias_last)
constexpr char kBiasLast[] = "_bias_last";
constexpr int64_t kPanel = 64;
constexpr int64_t kPanelsFrom = 128 << 10;  // bytes of weight from which panels are tried
constexpr int kRepacksToEager = 3;

enum class Read : uint8_t { kInPlace, kPacked, kPanels, kUnknown };

// The read of mat2 a kernel's name says ("small_gemm_panels_bias_last": kPanels).
Read ReadOf(c10::string_view kernel) {
  std::string s(kernel);
  if (absl::EndsWith(s, kBiasLast)) s.resize(s.size() - sizeof(kBiasLast) + 1);
  return s == kInPlace ? Read::kInPlace : s == kPacked ? Read::kPacked : s == kPanels ? Read::kPanels : Read::kUnknown;
}
bool BiasLast(c10::string_view kernel) { return absl::EndsWith(std::string(kernel), kBiasLast); }
bool KnownKernel(c10::string_view kernel) { return ReadOf(kernel) != Read::kUnknown; }

// A product as the step runs it: out = bias + mat1 mat2 (from +0 without a bias) by one kernel.
class GemmCall {
 public:
  explicit GemmCall(c10::string_view kernel) : read_(ReadOf(kernel)), bias_last_(BiasLast(kernel)) {}

  // The direct ops' checks of their arguments (the tape's step gets the ones its check took, in
  // the geometry its key guards); `name`: the op, for errors.
  static void CheckArgs(const at::Tensor& mat1, const at::Tensor& mat2, const at::Tensor& bias, const at::Tensor& out,
                        const char* name) {
    TORCH_CHECK(kernels::small_gemm::Available(), name, ": this CPU has no AVX2 and FMA");
    TORCH_CHECK(mat1.dim() == 2 && mat2.dim() == 2 && out.dim() == 2, name, ": 2-d matrices, not ", mat1.dim(),
                "-d x ", mat2.dim(), "-d into ", out.dim(), "-d");
    const int64_t m = mat1.size(0), k = mat1.size(1), n = mat2.size(1);
    TORCH_CHECK(mat1.scalar_type() == c10::kFloat && mat2.scalar_type() == c10::kFloat &&
                    out.scalar_type() == c10::kFloat && mat1.device().is_cpu() && mat2.device().is_cpu() &&
                    out.device().is_cpu(),
                name, ": float32 CPU tensors, not ", mat1.scalar_type(), " x ", mat2.scalar_type(), " into ",
                out.scalar_type());
    TORCH_CHECK(mat2.size(0) == k && out.size(0) == m && out.size(1) == n && (n <= 1 || out.stride(1) == 1), name,
                ": [M, K] x [K, N] into [M, N] with contiguous rows, not ", mat1.sizes(), " x ", mat2.sizes(),
                " into ", out.sizes());
    TORCH_CHECK(at::has_internal_overlap(out) != at::MemOverlap::Yes, name,
                ": out has elements that share memory");
    at::assert_no_overlap(out, mat1);
    at::assert_no_overlap(out, mat2);
    TORCH_CHECK(!bias.defined() || (bias.dim() == 1 && bias.size(0) == n && bias.scalar_type() == c10::kFloat &&
                                    bias.device().is_cpu()),
                name, ": the bias is float32 [", n, "]");
    if (bias.defined()) at::assert_no_overlap(out, bias);
  }

  // out = bias + mat1 mat2, on arguments CheckArgs would pass.
  void Run(const at::Tensor& mat1, const at::Tensor& mat2, const std::optional<at::Tensor>& bias_or_none,
           const at::Tensor& out) const {
    const at::Tensor bias = bias_or_none.has_value() ? *bias_or_none : at::Tensor();
    const int64_t m = mat1.size(0), k = mat1.size(1), n = mat2.size(1);
    if (read_ != Read::kInPlace && Pack(mat2)) {  // a weight written every call: eager's op from now on
      at::AutoDispatchBelowADInplaceOrView below_autograd;  // (the step's own kernel, as the others)
      at::Tensor y = out;
      if (bias.defined()) {
        at::addmm_out(y, bias, mat1, mat2);
      } else {
        at::mm_out(y, mat1, mat2);
      }
      return;
    }
    kernels::small_gemm::Params p;
    const at::Tensor x = k > 1 && mat1.stride(1) != 1 ? mat1.contiguous() : mat1;
    at::Tensor b;
    if (bias.defined()) {
      b = bias.contiguous();
      p.bias = b.const_data_ptr<float>();
      p.bias_last = bias_last_;
    }
    at::Tensor w;
    if (read_ == Read::kInPlace) {
      w = (n <= 1 || mat2.stride(1) == 1) && (k <= 1 || mat2.stride(0) >= n) ? mat2 : mat2.contiguous();
      p.w_row = k > 1 ? w.stride(0) : n;
    } else {
      w = packed_;
      p.panel = read_ == Read::kPanels ? kPanel : 0;
    }
    p.w = w.const_data_ptr<float>();
    p.x = x.const_data_ptr<float>(), p.x_row = m > 1 ? x.stride(0) : k;
    p.y = out.data_ptr<float>(), p.y_row = m > 1 ? out.stride(0) : n;
    p.m = m, p.k = k, p.n = n;
    if (m == 0 || n == 0) return;
    if (k == 0) {
      out.copy_(bias.defined() ? b.expand({m, n}) : at::zeros({m, n}, out.options()));
      return;
    }
    kernels::small_gemm::Run(p);
  }

 private:
  // The copy of mat2 the kernel reads, made again when mat2 changed (WeightWatch: by its bytes).
  // Returns true where mat2 changed on kRepacksToEager calls in a row (a weight an optimizer
  // writes every step: repacking each call costs more than the check measured, which saw it
  // fixed): then, and from then on, the caller runs eager's op, which gives the same bits.
  bool Pack(const at::Tensor& mat2) const {
    if (to_eager_) return true;
    if (!watch_.Changed(mat2)) {
      repacks_in_a_row_ = 0;
      return false;
    }
    if (packed_.defined() && ++repacks_in_a_row_ >= kRepacksToEager) {
      to_eager_ = true;
      packed_ = at::Tensor(), watch_ = WeightWatch();  // (neither read again)
      return true;
    }
    const at::Tensor kn = mat2.contiguous();
    if (read_ == Read::kPanels) {  // [ceil(N / panel), K, panel], the last panel zero-padded
      const int64_t k = kn.size(0), n = kn.size(1), padded = (n + kPanel - 1) / kPanel * kPanel;
      packed_ = at::constant_pad_nd(kn, {0, padded - n}).view({k, padded / kPanel, kPanel}).permute({1, 0, 2})
                    .contiguous();
    } else {
      packed_ = kn.data_ptr() == mat2.data_ptr() ? kn.clone() : kn;
    }
    return false;
  }

  Read read_;
  bool bias_last_;
  // the packed kernels' copy of mat2, and what it was made from (a tape runs on one thread)
  mutable at::Tensor packed_;
  mutable WeightWatch watch_;
  mutable int repacks_in_a_row_ = 0;
  mutable bool to_eager_ = false;
};

bool IsOne(const c10::IValue& v) {
  return (v.isInt() && v.toInt() == 1) || (v.isDouble() && v.toDouble() == 1.0) ||
         (v.isScalar() && v.toScalar().isIntegral(false) && v.toScalar().toLong() == 1);
}

// Empty when `call` computes eager's bits, into a buffer of the recorded geometry left as it was,
// on: the recorded mat1; two seeded mat1s; seeded mat1, mat2 and bias together; and, for addmm,
// NaNs in mat1 and in the bias at once (which NaN a sum keeps is the order of its last add).
// Else why not.
std::string CheckCall(const Node& n, bool addmm, const GemmCall& call, const std::vector<c10::IValue>& args,
                      const at::Tensor& result, const ValueRecord& r) {
  const char* inputs[] = {"the recorded input", "an input with signed zeros and subnormals",
                          "an input with infinities and NaNs", "a seeded input, weight and bias",
                          "NaNs in the input and the bias"};
  const int x_at = addmm ? 1 : 0, w_at = addmm ? 2 : 1;
  for (int k = 0; k < (addmm ? 5 : 4); ++k) {
    torch::jit::Stack stack = args;
    at::Tensor eager = result;
    if (k > 0) {
      stack[x_at] = Synthetic(args[x_at].toTensor(), k == 2 || k == 4);
      if (k == 3) {
        stack[w_at] = Synthetic(args[w_at].toTensor(), false);
        if (addmm) stack[0] = Synthetic(args[0].toTensor(), false);
      }
      if (k == 4) stack[0] = Synthetic(args[0].toTensor(), true);
      torch::jit::Stack run = stack;
      n.op->callBoxed(&run);
      eager = run[0].toTensor();
    }
    GemmCall fresh = call;  // a packed kernel packs this round's mat2
    const std::string why = CompareRun(
        [&](const at::Tensor& buffer) {
          fresh.Run(stack[x_at].toTensor(), stack[w_at].toTensor(), addmm ? stack[0].toTensor() : at::Tensor(),
                    buffer);
        },
        eager, r, inputs[k]);
    if (!why.empty()) return why;
  }
  return "";
}

// Why this product is not one the small GEMM can take, or empty.
std::string Unfit(bool addmm, const std::vector<c10::IValue>& v, const at::Tensor& result) {
  const at::Tensor& mat1 = v[addmm ? 1 : 0].toTensor();
  const at::Tensor& mat2 = v[addmm ? 2 : 1].toTensor();
  for (const at::Tensor& t : {mat1, mat2, result}) {
    if (t.scalar_type() != c10::kFloat) return absl::StrCat("dtype ", c10::toString(t.scalar_type()), " (float32 only)");
    if (t.layout() != c10::kStrided || t.is_conj() || t.is_neg() || !t.device().is_cpu() || t.dim() != 2) {
      return "a matrix that is not plain dense CPU memory";
    }
  }
  if (mat1.numel() == 0 || result.numel() == 0) return "an empty product";
  // (eager's product over one k is the plain multiply, whose -0.0 a sum from +0 turns into +0)
  if (mat1.size(1) < 2) return "K = 1";
  // (a product of one row or one column is MKL's GEMV, whose order followed the operands'
  // alignment: exact on the check's buffers, other bits on the tape's)
  if (result.size(0) < 2 || result.size(1) < 2) return "one row or one column (MKL's GEMV)";
  if (result.stride(1) != 1) return "a result whose rows are not contiguous";
  if (addmm) {
    if (!v[0].isTensor()) return "a bias that is not a tensor";
    const at::Tensor& bias = v[0].toTensor();
    if (bias.scalar_type() != c10::kFloat || bias.dim() != 1 || bias.size(0) != result.size(1)) {
      return "a bias that is not float32 [N]";
    }
    if (!IsOne(v[3]) || !IsOne(v[4])) return "beta or alpha other than 1";
  }
  return "";
}

}  // namespace

bool IsGemm(const Node& n) {
  // TORCHREPLAY_CHECKED_GEMM=0: eager's op everywhere (read at each capture, for comparisons)
  const char* env = std::getenv("TORCHREPLAY_CHECKED_GEMM");
  if (env != nullptr && std::string(env) == "0") return false;
  if (n.kind != NodeKind::kOp || n.outputs.size() != 1 || !n.op->schema().overload_name().empty()) return false;
  const std::string& name = n.op->schema().name();
  return (name == "aten::addmm" && n.args.size() == 5) || (name == "aten::mm" && n.args.size() == 2);
}

// Note [The shape of a check], its third step Note [Checked GEMMs]'s.
bool CheckGemm(const Graph& g, int node, const std::vector<c10::IValue>& env, Recording* rec) {
  const Node& n = g.nodes()[node];
  const bool addmm = n.op->schema().name() == "aten::addmm";
  // a refusal is the note of the node's eager out= step
  return CheckNode(g, node, env, rec, addmm ? kAddmmOut : kMmOut, /*refusal_in_notes=*/true,
                   [&](const std::vector<const ValueRecord*>& results, Decision& decision) {
    if (!kernels::small_gemm::Available()) return decision.Refuse("this CPU has no AVX2 and FMA");
    std::vector<c10::IValue> args;
    for (size_t a = 0; a < n.args.size(); ++a) args.push_back(MaterializeArg(n.args[a], n.arg_types[a], env));
    for (int a : addmm ? std::vector<int>{0, 1, 2} : std::vector<int>{0, 1}) {
      if (!args[a].isTensor() || !args[a].toTensor().defined()) return decision.Refuse("an argument that is not a tensor");
    }
    const at::Tensor& result = env[n.outputs[0]].toTensor();
    if (std::string why = Unfit(addmm, args, result); !why.empty()) return decision.Refuse(why);
    const at::Tensor& mat1 = args[addmm ? 1 : 0].toTensor();
    const at::Tensor& mat2 = args[addmm ? 2 : 1].toTensor();
    const at::Tensor bias = addmm ? args[0].toTensor() : at::Tensor();
    std::vector<std::string> kernels, not_tried;
    if (mat2.stride(1) == 1) kernels.push_back(kInPlace);
    if (!FixedUnderKey(g, node, n.args[addmm ? 2 : 1], *rec)) {
      not_tried.push_back(absl::StrCat(kPacked, ": mat2 is computed or bound per call"));
    } else {
      kernels.push_back(kPacked);
      if (mat2.size(0) * mat2.size(1) * 4 >= kPanelsFrom) kernels.push_back(kPanels);
    }
    if (kernels.empty()) return decision.Refuse(absl::StrJoin(not_tried, "; "));
    if (addmm) {  // the bias first or last: MKL's sgemm adds C after the sum, measured per node
      for (size_t i = 0, end = kernels.size(); i < end; ++i) kernels.push_back(kernels[i] + kBiasLast);
    }
    at::Tensor eager_buffer = FixedBuffer(*results[0]), buffer = FixedBuffer(*results[0]);
    std::vector<Candidate> candidates;
    for (const std::string& kernel : kernels) {
      auto call = std::make_shared<GemmCall>(kernel);
      candidates.push_back({kernel, CheckCall(n, addmm, *call, args, result, *results[0]),
                            [&, call] { call->Run(mat1, mat2, bias, buffer); }});
    }
    return decision.KeepFastest(
        "eager's op",
        [&] {  // eager's out= op, what the tape would call
          if (addmm) {
            at::addmm_out(eager_buffer, bias, mat1, mat2);
          } else {
            at::mm_out(eager_buffer, mat1, mat2);
          }
        },
        std::move(candidates), not_tried, addmm ? 5 : 4);
  });
}

namespace {

void CheckKernel(c10::string_view kernel) {
  TORCH_CHECK(KnownKernel(kernel), kAddmmOut, ": no kernel '", kernel, "' (", kInPlace, ", ", kPacked, ", ", kPanels,
              ", each with or without the suffix ", kBiasLast, ")");
}

// The out= ops, boxed: the kernel named by `kernel`, packing mat2 on each call (the tape's step
// packs it once).
at::Tensor& AddmmOut(const at::Tensor& self, const at::Tensor& mat1, const at::Tensor& mat2, const c10::Scalar& beta,
                     const c10::Scalar& alpha, c10::string_view kernel, at::Tensor& out) {
  CheckKernel(kernel);
  TORCH_CHECK(!beta.isComplex() && !alpha.isComplex() && beta.toDouble() == 1 && alpha.toDouble() == 1, kAddmmOut,
              ": beta and alpha are 1");
  GemmCall::CheckArgs(mat1, mat2, self, out, kAddmmOut);
  GemmCall(kernel).Run(mat1, mat2, self, out);
  return out;
}

at::Tensor& MmOut(const at::Tensor& self, const at::Tensor& mat2, c10::string_view kernel, at::Tensor& out) {
  CheckKernel(kernel);
  TORCH_CHECK(!BiasLast(kernel), kMmOut, ": no bias to add last ('", kernel, "')");
  GemmCall::CheckArgs(self, mat2, at::Tensor(), out, kMmOut);
  GemmCall(kernel).Run(self, mat2, std::nullopt, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(torchreplay, CPU, m) {
  m.impl("addmm.out", &AddmmOut);
  m.impl("mm.out", &MmOut);
}

std::unique_ptr<TypedCall> MakeGemmStep(const Slots& args, const std::vector<int>& slot_of) {
  const bool addmm = args.size() == 7;
  if ((args.size() != 7 && args.size() != 4) || slot_of.size() != args.size()) return nullptr;
  const size_t kernel_at = args.size() - 2;
  for (size_t k = addmm ? 3 : 2; k < args.size(); ++k) {
    if (slot_of[k] >= 0) return nullptr;
  }
  if (!args[kernel_at].isString() || !args.back().isTensor() || !KnownKernel(args[kernel_at].toStringRef())) {
    return nullptr;
  }
  if (addmm && (!IsOne(args[3]) || !IsOne(args[4]))) return nullptr;
  const std::string kernel = args[kernel_at].toStringRef();
  auto tensor = [&](size_t k) -> std::optional<TensorArg> {
    if (slot_of[k] >= 0) return TensorArg{at::Tensor(), slot_of[k]};
    if (args[k].isTensor() && args[k].toTensor().defined()) return TensorArg{args[k].toTensor(), -1};
    return std::nullopt;
  };
  const size_t x_at = addmm ? 1 : 0, w_at = addmm ? 2 : 1;
  std::optional<TensorArg> mat1 = tensor(x_at), mat2 = tensor(w_at), bias;
  if (addmm) bias = tensor(0);
  if (!mat1.has_value() || !mat2.has_value() || (addmm && !bias.has_value())) return nullptr;
  if (ReadOf(kernel) != Read::kInPlace && mat2->slot >= 0) return nullptr;  // a packed copy is of a fixed mat2
  return std::make_unique<CheckedStep<GemmCall>>(GemmCall(kernel), *std::move(mat1), *std::move(mat2), std::move(bias),
                                    args.back().toTensor());
}

std::string GemmStepKind(const Slots& args) {
  const bool named = args.size() >= 2 && args[args.size() - 2].isString();
  return absl::StrCat("checked gemm (", named ? args[args.size() - 2].toStringRef() : "?", ")");
}

}  // namespace torchreplay::capture::tape::checked
