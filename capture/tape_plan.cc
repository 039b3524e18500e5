// The kernel tape's plan (Note [What is decided at capture] in tape_plan.h).
#include "capture/tape_plan.h"

#include <ATen/EmptyTensor.h>

#include <algorithm>
#include <sstream>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "capture/fused_elementwise.h"

namespace torchreplay::capture {
namespace {

// An op whose result is a pure function of its (constant) arguments: no random numbers, no
// uninitialized memory, no side effects. Such a node with constant arguments is folded at capture.
bool Deterministic(const c10::OperatorHandle& op) {
  static const absl::flat_hash_set<std::string> kUninitialized = {
      "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty",
      "aten::new_empty_strided", "aten::empty_permuted"};
  const c10::FunctionSchema& fs = op.schema();
  if (fs.is_mutable() || kUninitialized.contains(fs.name()) ||
      op.hasTag(at::Tag::nondeterministic_seeded) || op.hasTag(at::Tag::nondeterministic_bitwise)) {
    return false;
  }
  for (const auto& a : fs.arguments()) {
    if (a.type()->kind() == c10::TypeKind::GeneratorType) return false;
    if (a.type()->kind() == c10::TypeKind::OptionalType &&
        a.type()->containedType(0)->kind() == c10::TypeKind::GeneratorType) {
      return false;
    }
  }
  return fs.name().rfind("aten::", 0) == 0;  // custom ops may keep state of their own
}

const char* DecisionName(TapePlan::Decision d) {
  switch (d) {
    case TapePlan::Decision::kScalar: return "scalar";
    case TapePlan::Decision::kScalarStep: return "scalar per call";
    case TapePlan::Decision::kPrecompute: return "precomputed";
    case TapePlan::Decision::kGetItem: return "getitem";
    case TapePlan::Decision::kOutVariant: return "out=";
    case TapePlan::Decision::kFunctional: return "functional";
  }
  return "?";
}

}  // namespace

absl::StatusOr<TapePlan> PlanTape(const Graph& g, const Recording& rec, bool fuse) {
  if (auto s = CheckReplayable(g, rec); !s.ok()) return s;
  const int num_nodes = static_cast<int>(g.nodes().size());
  TapePlan plan;
  plan.nodes.resize(num_nodes);
  plan.values.resize(g.values().size());
  auto& val = plan.values;
  auto new_slot = [&](ValueId v) {
    val[v].constant = false;
    val[v].slot = plan.num_slots++;
  };
  auto root_of = [&](ValueId v) { return rec.values[v].root_or(v); };

  const std::vector<bool> mutated = MutatedRoots(g, rec);
  std::vector<bool> is_output(g.values().size(), false);  // a graph output's storage (by root)
  for (const auto& a : g.outputs()) {
    ForEachValueUse(a, [&](ValueId v) {
      is_output[v] = true;
      is_output[root_of(v)] = true;
    });
  }
  // Liveness of each root value, in node indices: arena buffers are planned from it.
  std::vector<int> last_use(g.values().size(), -1);
  auto use = [&](ValueId v, int at) {
    last_use[root_of(v)] = std::max(last_use[root_of(v)], at);
    last_use[v] = std::max(last_use[v], at);
  };
  for (int i = 0; i < num_nodes; ++i) {
    for (const auto& a : g.nodes()[i].args) ForEachValueUse(a, [&](ValueId v) { use(v, i); });
  }
  for (const auto& a : g.outputs()) ForEachValueUse(a, [&](ValueId v) { use(v, num_nodes); });

  // Values whose contents, not just identity, are fixed under the key: scalars, sizes, and what
  // is folded from them. (Arena buffers and static inputs are constant tensors, but what they
  // hold changes from call to call.)
  std::vector<bool> fixed(g.values().size(), false);
  auto all_args = [&](const Node& n, auto pred) {
    bool all = true;
    for (const auto& a : n.args) ForEachValueUse(a, [&](ValueId v) { all = all && pred(v); });
    return all;
  };
  auto all_fixed = [&](const Node& n) { return all_args(n, [&](ValueId v) { return fixed[v]; }); };
  auto all_constant = [&](const Node& n) {
    return all_args(n, [&](ValueId v) { return val[v].constant; });
  };
  auto any_arena = [&](const Node& n) {
    return !all_args(n, [&](ValueId v) { return !val[v].in_arena; });
  };

  for (size_t i = 0; i < g.inputs().size(); ++i) {
    // Static tensors and scalars are constants; other tensors, and scalars that are data (Note
    // [Scalars bound per call]), are rebound per call.
    const ValueId v = g.inputs()[i];
    const bool per_call = rec.values[v].is_tensor ? !rec.baked(g, static_cast<int>(i))
                                                  : g.is_per_call_scalar(static_cast<int>(i));
    if (per_call) {
      new_slot(v);
      plan.input_slots.emplace_back(static_cast<int>(i), val[v].slot);
    } else {
      val[v].constant = true;
      fixed[v] = !rec.values[v].is_tensor;
    }
  }
  for (int i = 0; i < num_nodes; ++i) {
    const Node& n = g.nodes()[i];
    TapePlan::NodePlan& np = plan.nodes[i];
    if (n.kind == NodeKind::kSymArith) {
      if (all_fixed(n)) {
        np.decision = TapePlan::Decision::kScalar;
        val[n.outputs[0]].constant = fixed[n.outputs[0]] = true;
      } else {
        np.decision = TapePlan::Decision::kScalarStep;
        new_slot(n.outputs[0]);
      }
      continue;
    }
    if (n.kind == NodeKind::kGetItem) {
      np.decision = TapePlan::Decision::kGetItem;
      const ValueId list = n.args[0].value;
      val[n.outputs[0]].in_arena = val[list].in_arena;
      if (val[list].constant) {
        val[n.outputs[0]].constant = true;
      } else {
        new_slot(n.outputs[0]);
      }
      continue;
    }
    bool returns_scalar = false;
    for (ValueId o : n.outputs) {
      returns_scalar = returns_scalar || (!rec.values[o].is_tensor && !rec.values[o].is_list);
    }
    if (returns_scalar) {  // a size query (CheckReplayable refused the others): fixed per key
      np.decision = TapePlan::Decision::kScalar;
      for (ValueId o : n.outputs) val[o].constant = fixed[o] = true;
      continue;
    }
    // Which outputs are fresh tensors, and which alias an argument?
    bool all_fresh = true, any_fresh = false;
    for (ValueId o : n.outputs) {
      const bool fresh = (rec.values[o].is_tensor || rec.values[o].is_list) && rec.values[o].root == o;
      all_fresh = all_fresh && fresh;
      any_fresh = any_fresh || fresh;
    }
    const bool mutable_op = n.op->schema().is_mutable();

    if (!mutable_op && !any_fresh && all_constant(n)) {
      // A view (or list of views) of constant tensors: computed once, at capture.
      np.decision = TapePlan::Decision::kPrecompute;
      const bool from_arena = any_arena(n);
      for (ValueId o : n.outputs) {
        val[o].constant = true;
        val[o].in_arena = from_arena;
        fixed[o] = all_fixed(n) && !mutated[root_of(o)];
      }
      continue;
    }

    // An out= overload the recording checked (Note [Checked out= kernels]): its results are
    // fresh CPU tensors at storage offset 0, written exactly as the functional op writes them.
    if (!mutable_op && all_fresh) np.out = rec.out_variants[i];
    if (np.out.has_value()) {
      np.decision = TapePlan::Decision::kOutVariant;
      for (ValueId o : n.outputs) {
        const ValueRecord& r = rec.values[o];
        const int64_t nbytes = static_cast<int64_t>(
            at::detail::computeStorageNbytes(r.sizes, r.strides, c10::elementSize(r.dtype)));
        val[o].constant = val[o].in_arena = true;
        val[o].buffer = static_cast<int>(plan.requests.size());
        plan.requests.push_back(memory_pool::BufferRequest{nbytes, i, std::max(last_use[o], i)});
      }
      continue;
    }
    np.out.reset();

    // Made from constants only (arange, scalar_tensor, a cast of a constant, ...): computed
    // once, at capture, unless something writes into it later or the caller receives it.
    bool foldable = !mutable_op && all_fresh && all_fixed(n) && Deterministic(*n.op);
    for (ValueId o : n.outputs) foldable = foldable && !mutated[o] && !is_output[o];
    if (foldable) {
      np.decision = TapePlan::Decision::kPrecompute;
      for (ValueId o : n.outputs) val[o].constant = fixed[o] = true;
      continue;
    }

    // Runs as it is, every call.
    np.decision = TapePlan::Decision::kFunctional;
    np.why = rec.out_refusals[i];
    for (ValueId out : n.outputs) {
      const ValueRecord& r = rec.values[out];
      // An in-place op's result is its argument: same binding, no new slot.
      if (mutable_op && r.is_tensor && r.root != out) {
        for (const auto& a : n.args) {
          if (a.kind != Arg::Kind::kValue) continue;
          const ValueRecord& ar = rec.values[a.value];
          if (ar.root == r.root && ar.sizes == r.sizes && ar.strides == r.strides &&
              ar.storage_offset == r.storage_offset) {
            val[out] = val[a.value];
            val[out].buffer = -1;
            val[out].same_as = a.value;
            break;
          }
        }
      }
      if (val[out].same_as < 0) {
        new_slot(out);
        val[out].in_arena = !r.is_list && r.root != out && val[r.root].in_arena;
      }
    }
  }
  if (fuse) {
    plan.groups = PlanFusion(g, rec, plan);
    // A fused segment runs every instruction on a piece before the next piece, so the arena
    // buffers a group reads or writes stay live until its last node: none is reused under it.
    for (size_t k = 0; k < plan.groups.size(); ++k) {
      const int end = plan.groups[k].nodes.back();
      for (int i : plan.groups[k].nodes) {
        plan.nodes[i].group = static_cast<int>(k);
        auto extend = [&](ValueId v) {
          if (const int b = val[root_of(v)].buffer; b >= 0) {
            plan.requests[b].last_use = std::max(plan.requests[b].last_use, end);
          }
        };
        for (const auto& a : g.nodes()[i].args) ForEachValueUse(a, extend);
        for (ValueId o : g.nodes()[i].outputs) extend(o);
      }
    }
  }
  return plan;
}

std::string TapePlan::ToString(const Graph& g, const memory_pool::ArenaPlan* arena) const {
  auto name = [&](ValueId v) {
    const ValuePlan& p = values[v];
    return absl::StrCat("%", g.values()[v].name,
                        p.constant ? "" : absl::StrCat(" (slot ", p.slot, ")"));
  };
  std::ostringstream os;
  std::vector<std::string> ins;
  for (ValueId v : g.inputs()) ins.push_back(absl::StrCat(name(v), values[v].constant ? " (constant)" : ""));
  os << "tape(" << absl::StrJoin(ins, ", ") << "):\n";
  for (size_t i = 0; i < nodes.size(); ++i) {
    const Node& n = g.nodes()[i];
    std::vector<std::string> outs;
    for (ValueId v : n.outputs) outs.push_back(name(v));
    os << "  " << absl::StrJoin(outs, ", ") << " = " << NodeLabel(n) << ": "
       << DecisionName(nodes[i].decision);
    if (const int k = nodes[i].group; k >= 0) {
      const FusedGroup& group = groups[k];
      const size_t at = std::find(group.nodes.begin(), group.nodes.end(), static_cast<int>(i)) - group.nodes.begin();
      os << " fused " << k << " (" << fused::OpName(group.instrs[at].op) << ")";
    }
    if (nodes[i].out.has_value()) {
      os << " " << OperatorName(nodes[i].out->op);
      for (ValueId v : n.outputs) {
        const int b = values[v].buffer;
        os << " [buffer " << b << ": " << requests[b].nbytes << " B";
        if (arena != nullptr) os << " at " << arena->offsets[b];
        os << "]";
      }
    } else if (!n.outputs.empty() && values[n.outputs[0]].same_as >= 0) {
      os << " in place";
    } else if (!nodes[i].why.empty()) {
      os << " (" << nodes[i].why << ")";
    }
    os << "\n";
  }
  if (arena != nullptr) {
    os << "arena: " << arena->arena_bytes << " B for " << arena->tensor_bytes << " B of tensors\n";
  }
  return os.str();
}

}  // namespace torchreplay::capture
