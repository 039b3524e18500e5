// The kernel tape's plan (Note [What is decided at capture] in tape_plan.h).
#include "capture/tape/tape_plan.h"

#include <ATen/EmptyTensor.h>

#include <algorithm>
#include <sstream>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "capture/tape/fused/fused_elementwise.h"

namespace torchreplay::capture::tape {
namespace {

// An op whose result's bytes are unspecified (under torch.use_deterministic_algorithms with
// fill_uninitialized_memory, eager fills them with NaN or the largest integer, per call).
bool Uninitialized(const c10::OperatorHandle& op) {
  static const absl::flat_hash_set<std::string> kUninitialized = {
      "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty",
      "aten::new_empty_strided", "aten::empty_permuted"};
  return kUninitialized.contains(op.schema().name());
}

// An op whose result is a pure function of its (constant) arguments: no random numbers, no
// uninitialized memory, no side effects. Such a node with constant arguments is folded at capture.
bool Deterministic(const c10::OperatorHandle& op) {
  const c10::FunctionSchema& fs = op.schema();
  if (fs.is_mutable() || Uninitialized(op) ||
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

// Note [Metadata-only ops]
// empty_like, ones_like, zeros_like, full_like and the new_* factories read nothing of their
// tensor argument but its sizes, strides, dtype and device, which are fixed per key. A traced
// backward makes them every step (each new .grad is copy(empty_like(param), grad), the loss's
// seed is ones_like(loss)), and as functional steps each cost an allocation and a boxed call per
// replay. With their other arguments fixed, and their result neither written nor received by
// the caller, they are computed once, at capture, like any fold: the emitter calls the op on a
// stand-in of the recorded metadata where the tensor is a per-call value (Emitter::Precompute).
// empty_like and new_empty only where nothing reads their bytes, each use being the `self` of a
// functional aten::copy (which takes only its shape): eager's bytes there are unspecified, or,
// with deterministic algorithms and fill_uninitialized_memory, filled per call, which a buffer
// made once at capture would not follow when the setting changes later.
bool MetadataOnly(const c10::OperatorHandle& op) {
  static const absl::flat_hash_set<std::string> kLike = {
      "aten::empty_like", "aten::ones_like", "aten::zeros_like", "aten::full_like",
      "aten::new_empty",  "aten::new_zeros", "aten::new_ones",   "aten::new_full",
      "aten::new_empty_strided"};
  return kLike.contains(op.schema().name());
}

const char* DecisionName(TapePlan::Decision d) {
  switch (d) {
    case TapePlan::Decision::kScalar: return "scalar";
    case TapePlan::Decision::kScalarStep: return "scalar per call";
    case TapePlan::Decision::kPrecompute: return "precomputed";
    case TapePlan::Decision::kGetItem: return "getitem";
    case TapePlan::Decision::kOutVariant: return "out=";
    case TapePlan::Decision::kFunctional: return "functional";
    case TapePlan::Decision::kCollective: return "collective";
    case TapePlan::Decision::kWait: return "wait";
  }
  return "?";
}

// PlanTape's concerns, one method each: liveness of the recorded values, the class of each input
// (constant or rebound per call), the decision per node (and folding), and the fused groups.
class Planner {
 public:
  Planner(const Graph& g, const Recording& rec)
      : g_(g), rec_(rec), val_(plan_.values), mutated_(MutatedRoots(g, rec)),
        is_output_(g.values().size(), false), fixed_(g.values().size(), false) {
    plan_.nodes.resize(g.nodes().size());
    plan_.values.resize(g.values().size());
  }

  TapePlan Plan(bool fuse) && {
    Liveness();
    ClassifyInputs();
    for (int i = 0; i < static_cast<int>(g_.nodes().size()); ++i) Decide(i);
    if (fuse) Fuse();
    return std::move(plan_);
  }

 private:
  ValueId root_of(ValueId v) const { return rec_.values[v].root_or(v); }

  void NewSlot(ValueId v) {
    val_[v].constant = false;
    val_[v].slot = plan_.num_slots++;
  }

  template <typename Pred>
  bool AllArgs(const Node& n, Pred pred) const {
    bool all = true;
    for (const auto& a : n.args) ForEachValueUse(a, [&](ValueId v) { all = all && pred(v); });
    return all;
  }
  bool AllFixed(const Node& n) const { return AllArgs(n, [&](ValueId v) { return fixed_[v]; }); }
  bool AllConstant(const Node& n) const { return AllArgs(n, [&](ValueId v) { return val_[v].constant; }); }
  bool AnyArena(const Node& n) const { return !AllArgs(n, [&](ValueId v) { return !val_[v].in_arena; }); }

  // Which storages the caller receives, and the last use of each root value, in node indices:
  // arena buffers are planned from it (a view keeps its root alive).
  void Liveness() {
    for (const auto& a : g_.outputs()) {
      ForEachValueUse(a, [&](ValueId v) {
        is_output_[v] = true;
        is_output_[root_of(v)] = true;
      });
    }
    last_use_ = g_.last_use();
    for (ValueId v = 0; v < static_cast<ValueId>(last_use_.size()); ++v) {
      last_use_[root_of(v)] = std::max(last_use_[root_of(v)], g_.last_use()[v]);
    }
  }

  // Static tensors and scalars are constants; other tensors, and scalars that are data (Note
  // [Scalars bound per call]), are rebound per call.
  void ClassifyInputs() {
    for (size_t i = 0; i < g_.inputs().size(); ++i) {
      const ValueId v = g_.inputs()[i];
      const bool per_call = rec_.values[v].is_tensor ? !rec_.baked(g_, static_cast<int>(i))
                                                     : g_.is_per_call_scalar(static_cast<int>(i));
      if (per_call) {
        NewSlot(v);
        plan_.input_slots.emplace_back(static_cast<int>(i), val_[v].slot);
      } else {
        val_[v].constant = true;
        fixed_[v] = !rec_.values[v].is_tensor;
      }
    }
  }

  void Decide(int i) {
    const Node& n = g_.nodes()[i];
    TapePlan::NodePlan& np = plan_.nodes[i];
    if (n.kind == NodeKind::kSymArith) {
      if (AllFixed(n)) {
        np.decision = TapePlan::Decision::kScalar;
        val_[n.outputs[0]].constant = fixed_[n.outputs[0]] = true;
      } else {
        np.decision = TapePlan::Decision::kScalarStep;
        NewSlot(n.outputs[0]);
      }
      return;
    }
    if (const auto c = waits_.find(i); c != waits_.end()) return Wait(i, c->second);
    if (n.kind == NodeKind::kGetItem) {
      np.decision = TapePlan::Decision::kGetItem;
      const ValueId list = n.args[0].value;
      val_[n.outputs[0]].in_arena = val_[list].in_arena;
      if (val_[list].constant) {
        val_[n.outputs[0]].constant = true;
      } else {
        NewSlot(n.outputs[0]);
      }
      return;
    }
    bool returns_scalar = false;
    for (ValueId o : n.outputs) {
      returns_scalar = returns_scalar || (!rec_.values[o].is_tensor && !rec_.values[o].is_list);
    }
    if (returns_scalar) {  // a size query (CheckReplayable refused the others): fixed per key
      np.decision = TapePlan::Decision::kScalar;
      for (ValueId o : n.outputs) val_[o].constant = fixed_[o] = true;
      return;
    }
    // Which outputs are fresh tensors, and which alias an argument?
    bool all_fresh = true, any_fresh = false;
    for (ValueId o : n.outputs) {
      const bool fresh = (rec_.values[o].is_tensor || rec_.values[o].is_list) && rec_.values[o].root == o;
      all_fresh = all_fresh && fresh;
      any_fresh = any_fresh || fresh;
    }
    const bool mutable_op = n.op->schema().is_mutable();

    if (!mutable_op && !any_fresh && !n.outputs.empty() && AllConstant(n)) {
      // A view (or list of views) of constant tensors: computed once, at capture. (An op with no
      // outputs is no view: a check such as _linalg_check_errors runs every call.)
      np.decision = TapePlan::Decision::kPrecompute;
      const bool from_arena = AnyArena(n);
      for (ValueId o : n.outputs) {
        val_[o].constant = true;
        val_[o].in_arena = from_arena;
        fixed_[o] = AllFixed(n) && !mutated_[root_of(o)];
      }
      return;
    }

    if (Collective(i)) return;
    // Made from fixed values only (a mask from arange and the sizes): once, at capture, even
    // where an out= step could compute it every call.
    if (!mutable_op && all_fresh && Fold(i)) return;
    // An out= overload the recording checked (Note [Checked out= kernels]): its results are
    // fresh CPU tensors at storage offset 0, written exactly as the functional op writes them.
    if (!mutable_op && all_fresh) np.out = rec_.out_variants[i];
    if (np.out.has_value()) {
      np.decision = TapePlan::Decision::kOutVariant;
      np.why = rec_.out_notes[i];
      np.kind = MatchOutFamily(n, OperatorName(np.out->op), WholeArgs(n));
      for (ValueId o : n.outputs) {
        const ValueRecord& r = rec_.values[o];
        const int64_t nbytes = static_cast<int64_t>(
            at::detail::computeStorageNbytes(r.sizes, r.strides, c10::elementSize(r.dtype)));
        val_[o].constant = val_[o].in_arena = true;
        val_[o].buffer = static_cast<int>(plan_.requests.size());
        plan_.requests.push_back(memory_pool::BufferRequest{nbytes, i, std::max(last_use_[o], i)});
      }
      return;
    }
    np.out.reset();
    if (MatchIndexCopy(n)) np.kind = StepKind::kCopies;
    Functional(i, mutable_op);
  }

  // Made from constants only (arange, scalar_tensor, a cast of a constant, ...), or from the
  // metadata of tensors (Note [Metadata-only ops]): computed once, at capture, unless something
  // writes into it later or the caller receives it.
  bool Fold(int i) {
    const Node& n = g_.nodes()[i];
    bool foldable = MetadataOnly(*n.op)
                        ? AllArgs(n, [&](ValueId v) { return fixed_[v] || rec_.values[v].is_tensor; })
                        : AllFixed(n) && Deterministic(*n.op);
    for (ValueId o : n.outputs) foldable = foldable && !mutated_[o] && !is_output_[o];
    if (foldable && Uninitialized(*n.op)) {
      for (ValueId o : n.outputs) foldable = foldable && OnlyShapeRead(i, o);
    }
    if (!foldable) return false;
    plan_.nodes[i].decision = TapePlan::Decision::kPrecompute;
    for (ValueId o : n.outputs) val_[o].constant = fixed_[o] = true;
    return true;
  }

  // Whether every use of `v` (made by node `at`) is as the `self` of a functional aten::copy,
  // which reads only its shape (Note [Metadata-only ops]).
  bool OnlyShapeRead(int at, ValueId v) const {
    static const c10::OperatorName kCopy("aten::copy", "");
    for (int j = at + 1; j <= last_use_[v]; ++j) {
      const Node& n = g_.nodes()[j];
      for (size_t k = 0; k < n.args.size(); ++k) {
        bool used = false;
        ForEachValueUse(n.args[k], [&](ValueId u) { used = used || root_of(u) == v; });
        if (!used) continue;
        if (!n.op.has_value() || n.op->schema().operator_name() != kCopy || k != 0 ||
            n.args[0].kind != Arg::Kind::kValue || n.args[0].value != v) {
          return false;
        }
      }
    }
    return true;
  }

  // Note [Collective steps]: a collective of one real tensor, its other arguments fixed,
  // whose result only its wait_tensor reads. The result is a planned buffer, and the buffers of
  // the input and the result live until the wait.
  bool Collective(int i) {
    const Node& n = g_.nodes()[i];
    const std::optional<CollectiveKind> kind = CollectiveKindOf(*n.op);
    if (!kind.has_value() || n.outputs.size() != 1 || n.args.empty() || n.args[0].kind != Arg::Kind::kValue) {
      return false;
    }
    const ValueId in = n.args[0].value, out = n.outputs[0];
    const ValueRecord& r = rec_.values[in];
    // all_reduce and broadcast copy their input into the result first; the others read it as it is
    const bool copies = *kind == CollectiveKind::kAllReduce || *kind == CollectiveKind::kBroadcast;
    if (!r.is_tensor || c10::isComplexType(r.dtype) || (!copies && !r.contiguous()) || rec_.values[out].root != out ||
        !rec_.values[out].contiguous()) {
      return false;
    }
    for (const auto& a : g_.outputs()) {  // returned unwaited
      bool returned = false;
      ForEachValueUse(a, [&](ValueId v) { returned = returned || v == out; });
      if (returned) return false;
    }
    for (size_t a = 1; a < n.args.size(); ++a) {
      bool fixed = true;
      ForEachValueUse(n.args[a], [&](ValueId v) { fixed = fixed && fixed_[v]; });
      if (!fixed) return false;
    }
    int wait = -1, readers = 0;
    for (int j = i + 1; j < static_cast<int>(g_.nodes().size()); ++j) {
      const Node& m = g_.nodes()[j];
      bool reads = false;
      for (const auto& a : m.args) ForEachValueUse(a, [&](ValueId v) { reads = reads || v == out; });
      if (!reads) continue;
      ++readers;
      if (m.kind == NodeKind::kOp && IsWaitTensor(*m.op) && m.outputs.size() == 1) wait = j;
    }
    if (readers != 1 || wait < 0) return false;
    TapePlan::NodePlan& np = plan_.nodes[i];
    np.decision = TapePlan::Decision::kCollective;
    np.collective = kind;
    np.partner = wait;
    waits_[wait] = i;
    const ValueRecord& o = rec_.values[out];
    const int64_t nbytes = static_cast<int64_t>(
        at::detail::computeStorageNbytes(o.sizes, o.strides, c10::elementSize(o.dtype)));
    const int end = std::max({last_use_[out], last_use_[g_.nodes()[wait].outputs[0]], wait});
    val_[out].constant = val_[out].in_arena = true;
    val_[out].buffer = static_cast<int>(plan_.requests.size());
    plan_.requests.push_back(memory_pool::BufferRequest{nbytes, i, end});
    if (const int b = val_[root_of(in)].buffer; b >= 0) {
      plan_.requests[b].last_use = std::max(plan_.requests[b].last_use, wait);
    }
    return true;
  }

  // The wait of collective c: its result is the collective's buffer.
  void Wait(int i, int c) {
    const ValueId out = g_.nodes()[i].outputs[0], in = g_.nodes()[c].outputs[0];
    plan_.nodes[i].decision = TapePlan::Decision::kWait;
    plan_.nodes[i].partner = c;
    val_[out] = val_[in];
    val_[out].buffer = -1;
    val_[out].same_as = in;
  }

  // Runs as it is, every call.
  void Functional(int i, bool mutable_op) {
    const Node& n = g_.nodes()[i];
    plan_.nodes[i].decision = TapePlan::Decision::kFunctional;
    plan_.nodes[i].why = rec_.out_refusals[i];
    for (ValueId out : n.outputs) {
      const ValueRecord& r = rec_.values[out];
      // An in-place op's result is its argument: same binding, no new slot.
      if (mutable_op && r.is_tensor && r.root != out) {
        for (const auto& a : n.args) {
          if (a.kind != Arg::Kind::kValue) continue;
          const ValueRecord& ar = rec_.values[a.value];
          if (ar.root == r.root && ar.sizes == r.sizes && ar.strides == r.strides &&
              ar.storage_offset == r.storage_offset) {
            val_[out] = val_[a.value];
            val_[out].buffer = -1;
            val_[out].same_as = a.value;
            break;
          }
        }
      }
      if (val_[out].same_as < 0) {
        NewSlot(out);
        val_[out].in_arena = !r.is_list && r.root != out && val_[r.root].in_arena;
      }
    }
  }

  // Whether no list argument of n has an element computed per call (its step's stack is then
  // whole at capture: Note [Step kinds]).
  bool WholeArgs(const Node& n) const {
    for (const Arg& a : n.args) {
      for (const Arg& el : a.elems) {
        if (el.kind == Arg::Kind::kValue && !val_[el.value].constant) return false;
      }
    }
    return true;
  }

  // A fused segment runs every instruction on a piece before the next piece, so the arena
  // buffers a group reads or writes stay live until its last node: none is reused under it. The
  // exception: an intermediate the kernel keeps in chunks (Note [Intermediates kept in chunks])
  // never touches its buffer there; only the nodes' own calls, one after another, write and read
  // it, so it keeps the liveness it has without fusion and its memory is reused as theirs is.
  void Fuse() {
    plan_.groups = fused::PlanFusion(g_, rec_, plan_);
    for (size_t k = 0; k < plan_.groups.size(); ++k) {
      const TapePlan::FusedGroup& group = plan_.groups[k];
      const int end = group.nodes.back();
      absl::flat_hash_set<ValueId> kept;
      for (size_t j = 0; j < group.nodes.size(); ++j) {
        if (group.instrs[j].temp[0] >= 0) kept.insert(root_of(g_.nodes()[group.nodes[j]].outputs[0]));
      }
      for (int i : group.nodes) {
        plan_.nodes[i].group = static_cast<int>(k);
        auto extend = [&](ValueId v) {
          if (const int b = val_[root_of(v)].buffer; b >= 0 && !kept.contains(root_of(v))) {
            plan_.requests[b].last_use = std::max(plan_.requests[b].last_use, end);
          }
        };
        for (const auto& a : g_.nodes()[i].args) ForEachValueUse(a, extend);
        for (ValueId o : g_.nodes()[i].outputs) extend(o);
      }
    }
  }

  const Graph& g_;
  const Recording& rec_;
  TapePlan plan_;
  std::vector<TapePlan::ValuePlan>& val_;
  const std::vector<bool> mutated_;
  std::vector<bool> is_output_;  // a graph output's storage (by root)
  std::vector<int> last_use_;
  absl::flat_hash_map<int, int> waits_;  // wait node -> its kCollective node
  // Values whose contents, not just identity, are fixed under the key: scalars, sizes, and what
  // is folded from them. (Arena buffers and static inputs are constant tensors, but what they
  // hold changes from call to call.)
  std::vector<bool> fixed_;
};

}  // namespace

absl::StatusOr<TapePlan> PlanTape(const Graph& g, const Recording& rec, bool fuse) {
  if (auto s = CheckReplayable(g, rec); !s.ok()) return s;
  return Planner(g, rec).Plan(fuse);
}

std::string TapePlan::ToString(const Graph& g, const memory_pool::ArenaPlan* arena,
                               const std::vector<std::string>* made) const {
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
      if (nodes[i].out->extra_arg.isString()) os << " " << nodes[i].out->extra_arg.toStringRef();
      if (!nodes[i].why.empty()) os << " (" << nodes[i].why << ")";
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
    if (nodes[i].kind != StepKind::kNone && nodes[i].group < 0) os << "; family: " << StepKindName(nodes[i].kind);
    if (made != nullptr && !(*made)[i].empty()) os << "; step: " << (*made)[i];
    os << "\n";
  }
  if (arena != nullptr) {
    os << "arena: " << arena->arena_bytes << " B for " << arena->tensor_bytes << " B of tensors\n";
  }
  return os.str();
}

}  // namespace torchreplay::capture::tape
