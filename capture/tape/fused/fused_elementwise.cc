// Fused elementwise steps (Note [Fused elementwise steps] in fused_elementwise.h): how groups and
// segments are cut (which node the kernel computes, and how: describer.h; the step is
// fused_step.cc).
#include "capture/tape/fused/fused_elementwise.h"

#include <ATen/Version.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/container/inlined_vector.h"
#include "capture/tape/fused/describer.h"

namespace torchreplay::capture::tape::fused {
namespace {

// Does node i run anything per call (a step of its own)?
bool RunsPerCall(const Graph& g, const TapePlan& plan, int i) {
  switch (plan.nodes[i].decision) {
    case TapePlan::Decision::kScalar:
    case TapePlan::Decision::kPrecompute:
      return false;
    case TapePlan::Decision::kGetItem:
      return !plan.values[g.nodes()[i].args[0].value].constant;
    default:
      return true;
  }
}

// Whether two elements of a walk over `runs` ((size, byte stride) per dim, sizes above 1) may
// share memory, `item` bytes each: taken by stride, each run must step past everything the
// smaller ones reach. Conservative: interleaved runs that never meet count as meeting.
bool MayOverlapItself(std::vector<std::pair<int64_t, int64_t>> runs, int64_t item) {
  for (auto& run : runs) run.second = std::abs(run.second);
  std::sort(runs.begin(), runs.end(), [](const auto& a, const auto& b) { return a.second < b.second; });
  int64_t reach = item;
  for (const auto& [size, stride] : runs) {
    if (stride < reach) return true;
    reach += stride * (size - 1);
  }
  return false;
}

bool SameShape(const Instr& a, const Instr& b) {
  if (a.ndim != b.ndim || a.numel != b.numel) return false;
  for (int d = 0; d < a.ndim; ++d) {
    if (a.shape[d] != b.shape[d]) return false;
  }
  return true;
}

}  // namespace

namespace {

// One operand of an instruction as memory: the storage it views (its root value), its byte
// offset there, and where the iteration's k-th element (first dim fastest) lies from there, as
// (size, stride) runs with size-1 dims dropped and runs walked as one merged: two accesses with
// equal mappings touch the same bytes for each element index, whatever dims their iterators
// were left with.
struct Access {
  ValueId root = -1;
  int64_t offset = 0;
  absl::InlinedVector<std::pair<int64_t, int64_t>, fused::kMaxDims> map;
  bool write = false;
  bool SameMapping(const Access& o) const { return offset == o.offset && map == o.map; }
};

// PlanFusion's walk over the nodes: the open group and its state, closed into `groups_` where a
// node that runs per call does not join it.
class FusionWalk {
 public:
  FusionWalk(const Graph& g, const Recording& rec, const TapePlan& plan)
      : g_(g), rec_(rec), plan_(plan), root_last_use_(g.last_use().size(), -1) {
    for (ValueId v = 0; v < static_cast<ValueId>(root_last_use_.size()); ++v) {
      const ValueId r = rec.values[v].root_or(v);
      root_last_use_[r] = std::max(root_last_use_[r], g.last_use()[v]);
    }
  }

  std::vector<TapePlan::FusedGroup> Run() {
    for (int i = 0; i < static_cast<int>(g_.nodes().size()); ++i) {
      std::vector<ValueId> values;
      std::optional<Instr> in = Describe(g_, rec_, plan_, i, &values);
      std::vector<Access> mine;
      if (in.has_value()) mine = AccessesOf(*in, values);
      // A write through a view whose elements share memory (unfold's or as_strided's overlapping
      // windows, which eager's kernel writes in its own element order): neither the piece-by-piece
      // walk nor the copies saved per element would give eager's result. The node keeps its step.
      if (!in.has_value() ||
          MayOverlapItself({mine[0].map.begin(), mine[0].map.end()},
                           static_cast<int64_t>(c10::elementSize(rec_.values[values[0]].dtype)))) {
        if (RunsPerCall(g_, plan_, i)) Close();
        continue;
      }
      Add(i, *in, values, mine);
    }
    Close();
    return std::move(groups_);
  }

 private:
  // The accesses of instruction `in`'s tensor operands (`values`: each operand's value, -1 for a
  // constant or a number), its output's first.
  std::vector<Access> AccessesOf(const Instr& in, const std::vector<ValueId>& values) const {
    std::vector<Access> mine;
    for (int k = 0; k <= in.num_inputs; ++k) {
      const ValueId v = values[k];
      if (v < 0 || !rec_.values[v].is_tensor) continue;  // a constant or a number: read only
      Access a;
      a.root = rec_.values[v].root_or(v);
      a.offset = rec_.values[v].storage_offset * static_cast<int64_t>(c10::elementSize(rec_.values[v].dtype));
      for (int d = 0; d < in.ndim; ++d) {
        const int64_t size = in.shape[d], stride = in.strides[k][d];
        if (size == 1) continue;
        if (!a.map.empty() && a.map.back().first * a.map.back().second == stride) {
          a.map.back().first *= size;
        } else {
          a.map.emplace_back(size, stride);
        }
      }
      a.write = k == 0;
      mine.push_back(a);
    }
    return mine;
  }

  // Node `i` joins the open group, in the open segment or a new one.
  void Add(int i, Instr in, const std::vector<ValueId>& values, const std::vector<Access>& mine) {
    const bool in_place = plan_.nodes[i].decision == TapePlan::Decision::kFunctional;
    bool same_segment = !group_.instrs.empty() && SameShape(group_.instrs.back(), in) &&
                        group_.segments.back().count < fused::kMaxSegment;
    for (const Access& a : mine) {
      for (const Access& e : accesses_) {
        if (e.root == a.root && (e.write || a.write) && !e.SameMapping(a)) same_segment = false;
      }
    }
    if (!same_segment) {
      group_.segments.push_back(fused::Segment{static_cast<int>(group_.instrs.size()), 0});
      accesses_.clear();
      segment_wrote_.clear();
    }
    // Every access of a root written in a segment has one mapping, so the saved copy covers it.
    // (Marked here; LayOutSnapshots lays the copies out.)
    const bool first_write = segment_wrote_.insert(mine[0].root).second;
    if (in_place && first_write) in.snapshot = 0;
    if (!in_place) fresh_.insert(mine[0].root);
    group_.nodes.push_back(i);
    group_.instrs.push_back(in);
    operand_values_.emplace_back();
    operand_values_.back().fill(-1);
    for (int k = 0; k <= in.num_inputs && k < static_cast<int>(values.size()); ++k) {
      operand_values_.back()[k] = values[k];
    }
    ++group_.segments.back().count;
    accesses_.insert(accesses_.end(), mine.begin(), mine.end());
  }

  void Close() {
    LayOutSnapshots();
    if (!group_.nodes.empty()) {
      AssignChunkBuffers(RootsKeptInChunks());
      groups_.push_back(std::move(group_));
    }
    group_ = TapePlan::FusedGroup();
    operand_values_.clear();
    accesses_.clear();
    fresh_.clear();
    segment_wrote_.clear();
  }

  // The saved copies of a segment that may fall back (a NanCheck) side by side from the start of
  // the scratch buffer; a segment that never falls back saves nothing.
  void LayOutSnapshots() {
    for (const fused::Segment& seg : group_.segments) {
      bool falls_back = false;
      for (int j = seg.first; j < seg.first + seg.count; ++j) {
        falls_back = falls_back || group_.instrs[j].nan_check != Instr::NanCheck::kNone;
      }
      int64_t end = 0;
      for (int j = seg.first; j < seg.first + seg.count; ++j) {
        Instr& in = group_.instrs[j];
        if (in.snapshot < 0) continue;
        in.snapshot = falls_back ? end : -1;
        if (falls_back) end += (in.numel * static_cast<int64_t>(c10::elementSize(in.dtype)) + 63) / 64 * 64;
      }
      group_.scratch_bytes = std::max(group_.scratch_bytes, end);
    }
  }

  // Note [Intermediates kept in chunks]: the open group's roots that qualify: written first, by
  // an out= instruction (fresh memory), accessed as themselves (no view) with unit inner stride,
  // in one segment only, and read by nothing after the group.
  absl::flat_hash_set<ValueId> RootsKeptInChunks() const {
    struct Use {
      int segment = -1;
      bool qualifies = true;
    };
    absl::flat_hash_map<ValueId, Use> uses;
    for (int s = 0; s < static_cast<int>(group_.segments.size()); ++s) {
      const fused::Segment& seg = group_.segments[s];
      for (int j = seg.first; j < seg.first + seg.count; ++j) {
        const fused::Instr& in = group_.instrs[j];
        for (int k = 0; k <= in.num_inputs; ++k) {
          const ValueId v = operand_values_[j][k];
          if (v < 0 || !rec_.values[v].is_tensor) continue;
          const ValueId r = rec_.values[v].root_or(v);
          auto [it, first] = uses.try_emplace(r);
          Use& u = it->second;
          const bool out_write = k == 0 && fresh_.contains(r) && in.snapshot < 0;
          const int64_t size = static_cast<int64_t>(c10::elementSize(rec_.values[v].dtype));
          u.qualifies = u.qualifies && (first ? out_write : k > 0) && v == r && (u.segment < 0 || u.segment == s) &&
                        (in.strides[k][0] == size || in.shape[0] == 1) && root_last_use_[r] <= group_.nodes.back();
          u.segment = s;
        }
      }
    }
    absl::flat_hash_set<ValueId> kept;
    for (const auto& [root, use] : uses) {
      if (use.qualifies) kept.insert(root);
    }
    return kept;
  }

  // Chunk buffers by liveness: a value of `kept` takes a free one at the instruction that writes
  // it (never one an input of that instruction holds) and frees it after the last instruction
  // reading it, so a chain of any length cycles through two or three buffers that stay in the L1
  // cache.
  void AssignChunkBuffers(const absl::flat_hash_set<ValueId>& kept) {
    absl::flat_hash_map<ValueId, int> last_read;
    for (int j = 0; j < static_cast<int>(group_.instrs.size()); ++j) {
      for (int k = 0; k <= group_.instrs[j].num_inputs; ++k) {
        const ValueId v = operand_values_[j][k];
        if (v >= 0 && kept.contains(v)) last_read[v] = j;
      }
    }
    absl::flat_hash_map<ValueId, int> temp;
    std::vector<int> free_temps;
    int made = 0;
    for (int j = 0; j < static_cast<int>(group_.instrs.size()); ++j) {
      fused::Instr& in = group_.instrs[j];
      const ValueId out = operand_values_[j][0];
      if (out >= 0 && last_read.contains(out) && !temp.contains(out)) {
        if (!free_temps.empty()) {
          temp.emplace(out, free_temps.back());
          free_temps.pop_back();
        } else if (made < fused::kMaxTemps) {
          temp.emplace(out, made++);
        }
      }
      for (int k = 0; k <= in.num_inputs; ++k) {
        if (auto it = temp.find(operand_values_[j][k]); it != temp.end()) in.temp[k] = static_cast<int8_t>(it->second);
      }
      for (int k = 0; k <= in.num_inputs; ++k) {
        const ValueId v = operand_values_[j][k];
        if (auto it = temp.find(v); it != temp.end() && last_read[v] == j) {
          free_temps.push_back(it->second);
          temp.erase(it);
        }
      }
    }
  }

  const Graph& g_;
  const Recording& rec_;
  const TapePlan& plan_;
  std::vector<TapePlan::FusedGroup> groups_;
  TapePlan::FusedGroup group_;  // the open group
  // Every access of the open segment. A segment runs every instruction on a piece before the next
  // piece, so memory some instruction of it writes must be accessed by all of them in the mapping
  // it is written in: a transposed read of an intermediate, a view of it, or an in-place write of
  // what an instruction read otherwise would see elements another piece has not written yet, or
  // already overwrote. Such an instruction starts a new segment.
  std::vector<Access> accesses_;
  // Of the open group: the roots its out= instructions wrote (planned buffers, fresh). Of the open
  // segment: the roots it wrote, by out= or after saving what was there (Note [In-place
  // instructions]): an in-place write of another root saves it first.
  absl::flat_hash_set<ValueId> fresh_;
  absl::flat_hash_set<ValueId> segment_wrote_;
  // Per instruction of the open group: each operand's value (-1 for a constant or a number).
  std::vector<std::array<ValueId, fused::kMaxOperands>> operand_values_;
  // Per root: the last node reading it or a view of it (nodes().size() for a graph output).
  std::vector<int> root_last_use_;
};

}  // namespace

std::vector<TapePlan::FusedGroup> PlanFusion(const Graph& g, const Recording& rec, const TapePlan& plan) {
  if (!FusionAvailable()) return {};
  return FusionWalk(g, rec, plan).Run();
}

}  // namespace torchreplay::capture::tape::fused
