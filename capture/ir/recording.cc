// The recording of a warm-up run and the analysis both backends share (see recording.h).
#include "capture/ir/recording.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/ops/view_as_real.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>

#include <mutex>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"

namespace torchreplay::capture {

bool ValueRecord::contiguous() const {
  int64_t expected = 1;
  for (int64_t d = static_cast<int64_t>(sizes.size()) - 1; d >= 0; --d) {
    if (sizes[d] == 1) continue;
    if (strides[d] != expected) return false;
    expected *= sizes[d];
  }
  return true;
}

namespace {

void RecordTensor(const at::Tensor& t, ValueRecord* r) {
  r->is_tensor = true;
  if (!t.defined()) return;
  r->dtype = t.scalar_type();
  r->device = t.device();
  r->strided = t.layout() == c10::kStrided;
  if (!r->strided) return;
  r->sizes.assign(t.sizes().begin(), t.sizes().end());
  r->strides.assign(t.strides().begin(), t.strides().end());
  r->storage_offset = t.storage_offset();
  r->lazy_bits = t.is_conj() || t.is_neg();
}

bool HasDataDependentShape(const std::string& name) {
  static const absl::flat_hash_set<std::string> kOps = {
      "aten::nonzero", "aten::masked_select", "aten::unique", "aten::_unique", "aten::_unique2",
      "aten::unique_dim", "aten::unique_consecutive", "aten::unique_dim_consecutive",
      "aten::repeat_interleave", "aten::bincount", "aten::argwhere", "aten::nonzero_numpy"};
  return kOps.contains(name);
}

// The same tensor's elements as integers of the same width, so that equal() compares bits (NaN
// payloads and -0.0 included). Undefined for element types it cannot view.
at::Tensor BitsOf(const at::Tensor& t) {
  switch (t.element_size()) {
    case 1: return t.view(c10::kByte);
    case 2: return t.view(c10::kShort);
    case 4: return t.view(c10::kInt);
    case 8: return t.view(c10::kLong);
    case 16: return t.is_complex() ? at::view_as_real(t).view(c10::kLong) : at::Tensor();
    default: return at::Tensor();
  }
}

// Counts the warnings raised while it is installed, and swallows them.
class CountingWarningHandler : public c10::WarningHandler {
 public:
  void process(const c10::Warning&) override { ++count; }
  int count = 0;
};

// Note [Checked out= kernels]: runs `out`, the out= overload of node `n`, on the node's arguments
// into buffers of the recorded geometry. Empty when it may be used, else why not.
std::string CheckOutVariant(const Node& n, const OutVariant& out, const std::vector<c10::IValue>& env,
                            const std::vector<ValueRecord>& values,
                            const std::optional<at::Tensor>& rng_before) {
  torch::jit::Stack stack;
  for (size_t a = 0; a < n.args.size(); ++a) {
    stack.push_back(MaterializeArg(n.args[a], n.arg_types[a], env));
    if (stack.back().isGenerator()) return "it takes a generator of its own";
  }
  if (!out.extra_arg.isNone()) stack.push_back(out.extra_arg);
  std::vector<at::Tensor> buffers;
  std::vector<const c10::StorageImpl*> storages;
  for (ValueId o : n.outputs) {
    const ValueRecord& r = values[o];
    at::Tensor b = at::empty_strided(r.sizes, r.strides, at::TensorOptions().dtype(r.dtype));
    b.storage().unsafeGetStorageImpl()->set_resizable(false);
    storages.push_back(b.storage().unsafeGetStorageImpl());
    buffers.push_back(b);
    stack.push_back(std::move(b));
  }
  std::string why;
  {
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    at::Tensor rng_after;
    if (rng_before.has_value()) {
      std::lock_guard<std::mutex> lock(gen.mutex());
      rng_after = gen.get_state();
      gen.set_state(*rng_before);
    }
    CountingWarningHandler warnings;
    try {
      c10::WarningUtils::WarningHandlerGuard guard(&warnings);
      // The probe is not the model's computation: Python dispatch modes (AOTAutograd's check of a
      // training graph's first call, a user's) neither see it nor turn its errors into Python's.
      c10::impl::ExcludeDispatchKeyGuard no_python(
          c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot}));
      out.op.callBoxed(&stack);
    } catch (const c10::Error& e) {
      why = absl::StrCat("it raised: ", e.what_without_backtrace());
    }
    if (rng_before.has_value()) {
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(rng_after);
    }
    if (why.empty() && warnings.count > 0) why = "it warned";
  }
  if (!why.empty()) return why;
  for (size_t k = 0; k < buffers.size(); ++k) {
    const at::Tensor& b = buffers[k];
    const ValueRecord& r = values[n.outputs[k]];
    if (b.sizes() != c10::IntArrayRef(r.sizes) || b.strides() != c10::IntArrayRef(r.strides) ||
        b.storage_offset() != 0 || b.storage().unsafeGetStorageImpl() != storages[k]) {
      return "it resized, restrided or replaced its output";
    }
    const at::Tensor mine = BitsOf(b), eager = BitsOf(env[n.outputs[k]].toTensor());
    if (!mine.defined() || !eager.defined()) return "its result's bits cannot be compared";
    if (!mine.equal(eager)) return "it wrote other bits than the functional op";
  }
  return "";
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
                                                      Recording* recording, const NodeCheck& check) {
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
  recording->out_variants.assign(g.nodes().size(), std::nullopt);
  recording->out_refusals.assign(g.nodes().size(), "");
  recording->out_notes.assign(g.nodes().size(), "");
  std::optional<OutVariant> candidate;   // the running node's out= overload, if it has one
  std::optional<at::Tensor> rng_before;  // for a random node: the CPU generator's state before it
  Interpreter::Observer observer;
  observer.before = [&](int node, const std::vector<c10::IValue>&) {
    const Node& n = g.nodes()[node];
    candidate.reset();
    rng_before.reset();
    if (n.kind != NodeKind::kOp || n.op->schema().is_mutable()) return;
    candidate = FindOutVariant(*n.op);
    if (candidate.has_value() && n.op->hasTag(at::Tag::nondeterministic_seeded)) {
      at::Generator gen = at::detail::getDefaultCPUGenerator();
      std::lock_guard<std::mutex> lock(gen.mutex());
      rng_before = gen.get_state();
    }
  };
  observer.after = [&](int node, const std::vector<c10::IValue>& env) {
    const Node& n = g.nodes()[node];
    for (ValueId v : n.outputs) record(v, env[v]);
    if (check && check(g, node, env, recording)) return;
    if (!candidate.has_value()) return;
    for (ValueId o : n.outputs) {  // fresh CPU tensors at offset 0: what an arena buffer can be
      const ValueRecord& r = recording->values[o];
      if (!r.is_tensor || r.root != o || !env[o].toTensor().defined() || !r.device.is_cpu() ||
          r.storage_offset != 0) {
        return;
      }
    }
    std::string why = CheckOutVariant(n, *candidate, env, recording->values, rng_before);
    if (why.empty()) {
      recording->out_variants[node] = std::move(candidate);
    } else {
      recording->out_refusals[node] = absl::StrCat(OperatorName(candidate->op), " refused: ", why);
    }
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
      if (rec.values[o].is_tensor && !rec.values[o].strided) {
        return absl::FailedPreconditionError(absl::StrCat("node '", n.name, "' (", OperatorName(*n.op),
                                                          ") makes a sparse or other non-strided tensor"));
      }
      if (!rec.values[o].is_tensor && !rec.values[o].is_list && !IsSizeQuery(base)) {
        return absl::FailedPreconditionError(absl::StrCat("node '", n.name, "' (", OperatorName(*n.op),
                                                          ") reads a value from tensor data on the host"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace torchreplay::capture
