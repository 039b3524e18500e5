// The recording of a warm-up run and the analysis both backends share (see recording.h).
#include "capture/recording.h"

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"

namespace torchreplay::capture {
namespace {

void RecordTensor(const at::Tensor& t, ValueRecord* r) {
  r->is_tensor = true;
  if (!t.defined()) return;
  r->dtype = t.scalar_type();
  r->device = t.device();
  r->sizes.assign(t.sizes().begin(), t.sizes().end());
  r->strides.assign(t.strides().begin(), t.strides().end());
  r->storage_offset = t.storage_offset();
}

bool HasDataDependentShape(const std::string& name) {
  static const absl::flat_hash_set<std::string> kOps = {
      "aten::nonzero", "aten::masked_select", "aten::unique", "aten::_unique", "aten::_unique2",
      "aten::unique_dim", "aten::unique_consecutive", "aten::unique_dim_consecutive",
      "aten::repeat_interleave", "aten::bincount", "aten::argwhere", "aten::nonzero_numpy"};
  return kOps.contains(name);
}

}  // namespace

bool IsSizeQuery(const std::string& name) {
  static const absl::flat_hash_set<std::string> kSizeOps = {
      "aten::sym_size", "aten::sym_stride", "aten::sym_numel", "aten::sym_storage_offset",
      "aten::size", "aten::stride", "aten::numel", "aten::dim"};
  return kSizeOps.contains(name);
}

absl::StatusOr<std::vector<c10::IValue>> RunAndRecord(const Interpreter& interp,
                                                      std::vector<c10::IValue> inputs,
                                                      Recording* recording) {
  const Graph& g = interp.graph();
  recording->values.assign(g.values().size(), ValueRecord{});
  absl::flat_hash_map<const c10::StorageImpl*, ValueId> owner;
  auto record = [&](ValueId id, const c10::IValue& v) {
    ValueRecord& r = recording->values[id];
    if (v.isTensor()) {
      RecordTensor(v.toTensor(), &r);
      r.root = id;
      if (v.toTensor().defined() && v.toTensor().has_storage()) {
        auto [it, inserted] = owner.emplace(v.toTensor().storage().unsafeGetStorageImpl(), id);
        r.root = it->second;
      }
    } else if (v.isTensorList()) {
      // A list is a view (split, unbind) if every element shares an earlier value's storage;
      // otherwise it is fresh (a _foreach_ result) and owns its elements' storages.
      r.is_list = true;
      r.root = id;
      const c10::List<at::Tensor> list = v.toTensorList();
      bool all_views = true;
      for (const at::Tensor& t : list) {
        if (!t.defined() || !t.has_storage()) continue;
        auto it = owner.find(t.storage().unsafeGetStorageImpl());
        all_views = all_views && it != owner.end();
        if (all_views && r.root == id) r.root = it->second;
      }
      if (!all_views) {
        r.root = id;
        for (const at::Tensor& t : list) {
          if (t.defined() && t.has_storage()) owner.emplace(t.storage().unsafeGetStorageImpl(), id);
        }
      }
    } else {
      r.scalar = v;
    }
  };
  for (size_t i = 0; i < g.inputs().size() && i < inputs.size(); ++i) record(g.inputs()[i], inputs[i]);
  Interpreter::Observer observer = [&](int node, const std::vector<c10::IValue>& env) {
    for (ValueId v : g.nodes()[node].outputs) record(v, env[v]);
  };
  return interp.Run(std::move(inputs), &observer);
}

std::vector<bool> MutatedRoots(const Graph& g, const Recording& rec) {
  std::vector<bool> mutated(g.values().size(), false);
  for (const Node& n : g.nodes()) {
    if (n.kind != NodeKind::kOp || !n.op->schema().is_mutable()) continue;
    const auto& args = n.op->schema().arguments();
    for (size_t a = 0; a < n.args.size() && a < args.size(); ++a) {
      const auto* alias = args[a].alias_info();
      if (alias == nullptr || !alias->isWrite()) continue;
      ForEachValueUse(n.args[a], [&](ValueId v) {
        mutated[rec.values[v].root_or(v)] = true;
      });
    }
  }
  return mutated;
}

absl::Status CheckReplayable(const Graph& g, const Recording& rec) {
  for (const Node& n : g.nodes()) {
    if (n.kind != NodeKind::kOp) continue;
    const std::string base = n.op->schema().name();
    bool mask_index = false;  // x[mask]: as many rows as the mask has true elements
    if (base == "aten::index" && n.args.size() > 1) {
      ForEachValueUse(n.args[1], [&](ValueId v) {
        const c10::ScalarType t = rec.values[v].dtype;
        mask_index = mask_index || t == c10::kBool || t == c10::kByte;
      });
    }
    if (HasDataDependentShape(base) || mask_index) {
      return absl::FailedPreconditionError(absl::StrCat(
          "node '", n.name, "' (", OperatorName(*n.op), ") has a data-dependent output shape"));
    }
    for (ValueId o : n.outputs) {
      if (!rec.values[o].is_tensor && !rec.values[o].is_list && !IsSizeQuery(base)) {
        return absl::FailedPreconditionError(absl::StrCat("node '", n.name, "' (", OperatorName(*n.op),
                                                          ") reads a value from tensor data on the host"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace torchreplay::capture
