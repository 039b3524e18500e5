// The out= overload of a functional op (see out_variants.h).
#include "capture/ir/out_variants.h"

#include <mutex>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "capture/ir/graph.h"

namespace torchreplay::capture {
namespace {

// For a functional schema, the overload of the same name that takes the same arguments plus one
// keyword-only `out` tensor per return (e.g. aten::add.Tensor -> aten::add.out).
std::optional<c10::OperatorHandle> FindOutOverload(const c10::OperatorHandle& op) {
  static std::mutex mu;
  static absl::flat_hash_map<std::string, std::vector<std::string>>* overloads = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (overloads == nullptr) {
      overloads = new absl::flat_hash_map<std::string, std::vector<std::string>>();
      for (const auto& name : c10::Dispatcher::singleton().getAllOpNames()) {
        (*overloads)[name.name].push_back(name.overload_name);
      }
    }
  }
  const c10::FunctionSchema& fs = op.schema();
  if (fs.is_mutable() || fs.returns().empty()) return std::nullopt;
  for (const auto& r : fs.returns()) {
    if (r.type()->kind() != c10::TypeKind::TensorType) return std::nullopt;
  }
  auto it = overloads->find(fs.name());
  if (it == overloads->end()) return std::nullopt;
  for (const auto& ovl : it->second) {
    if (ovl == fs.overload_name()) continue;
    auto cand = c10::Dispatcher::singleton().findSchema({fs.name(), ovl});
    if (!cand.has_value()) continue;
    const auto& cs = cand->schema();
    const auto& fa = fs.arguments();
    const auto& ca = cs.arguments();
    if (ca.size() != fa.size() + fs.returns().size()) continue;
    bool ok = true;
    for (size_t i = 0; ok && i < fa.size(); ++i) {
      ok = ca[i].name() == fa[i].name() && *ca[i].type() == *fa[i].type();
    }
    for (size_t i = fa.size(); ok && i < ca.size(); ++i) {
      ok = ca[i].is_out() && ca[i].type()->kind() == c10::TypeKind::TensorType;
    }
    // An out= overload with no CPU kernel of its own is usually generated from the functional op
    // (allocate, compute, copy into out): slower than running the op functionally. Ops whose
    // steps the tape makes itself are taken all the same: clone, copy, embedding and stack are
    // copies (Note [Copies]), masked_fill a fused elementwise select (Note [Fused elementwise
    // steps]).
    const bool own = fs.name() == "aten::clone" || fs.name() == "aten::copy" || fs.name() == "aten::embedding" ||
                     fs.name() == "aten::stack" ||
                     (fs.name() == "aten::masked_fill" && fs.overload_name() == "Scalar");
    if (ok && (own || cand->hasKernelForDispatchKey(c10::DispatchKey::CPU))) return cand;
  }
  return std::nullopt;
}

}  // namespace

std::optional<OutVariant> FindOutVariant(const c10::OperatorHandle& op) {
  if (op.schema().name() == "aten::relu") {
    // ATen's relu is clamp_min(self, 0), which has an out= variant.
    if (auto clamp_min = FindOperator("aten::clamp_min.out"); clamp_min.ok()) {
      return OutVariant{*clamp_min, c10::IValue(c10::Scalar(int64_t{0}))};
    }
    return std::nullopt;
  }
  if (op.schema().name() == "aten::_scaled_dot_product_flash_attention_for_cpu") {
    // Note [Attention on planned buffers]: an out= form of torchreplay's, through ATen's kernel.
    if (auto out = FindOperator("torchreplay::_scaled_dot_product_flash_attention_for_cpu.out"); out.ok()) {
      return OutVariant{*out, c10::IValue()};
    }
    return std::nullopt;
  }
  if (op.schema().name() == "aten::native_layer_norm") {
    // Note [Layer norm on planned buffers]: ATen's out= overload has no CPU kernel; ours does.
    if (auto out = FindOperator("torchreplay::native_layer_norm.out"); out.ok()) return OutVariant{*out, c10::IValue()};
    return std::nullopt;
  }
  if (auto out = FindOutOverload(op); out.has_value()) return OutVariant{*out, c10::IValue()};
  return std::nullopt;
}

}  // namespace torchreplay::capture
