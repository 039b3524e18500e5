// The recording run's shared check helpers (capture/tape/checked/kernel_check.h).
#include "capture/tape/checked/kernel_check.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include <c10/core/impl/LocalDispatchKeySet.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace torchreplay::capture::tape::checked {
namespace {

// The same elements as integers of their width, so that equal() compares bits.
at::Tensor BitsOf(const at::Tensor& t) {
  return t.element_size() == 4 ? t.view(c10::kInt) : t.element_size() == 8 ? t.view(c10::kLong) : at::Tensor();
}

// Whether a and b have the same sizes and the same bits, element by element (4- and 8-byte
// dtypes; false for others).
bool SameBits(const at::Tensor& a, const at::Tensor& b) {
  const at::Tensor x = BitsOf(a), y = BitsOf(b);
  return x.defined() && y.defined() && a.sizes() == b.sizes() && x.equal(y);
}

}  // namespace

std::vector<const ValueRecord*> PlannedResults(const Node& n, const std::vector<c10::IValue>& env,
                                               const Recording& rec) {
  std::vector<const ValueRecord*> records;
  for (ValueId o : n.outputs) {
    const ValueRecord& r = rec.values[o];
    if (!r.is_tensor || r.root != o || !r.device.is_cpu() || r.storage_offset != 0 || !r.strided ||
        !env[o].isTensor() || !env[o].toTensor().defined()) {
      return {};
    }
    records.push_back(&r);
  }
  return records;
}

bool FixedUnderKey(const Graph& g, int node, const Arg& a, const Recording& rec) {
  if (a.kind == Arg::Kind::kConstant) return true;
  if (a.kind != Arg::Kind::kValue) return false;
  ValueId v = a.value;
  for (int depth = 0; depth < 4; ++depth) {
    int producer = node - 1;
    while (producer >= 0 && std::find(g.nodes()[producer].outputs.begin(), g.nodes()[producer].outputs.end(), v) ==
                                g.nodes()[producer].outputs.end()) {
      --producer;
    }
    if (producer < 0) {
      const auto in = std::find(g.inputs().begin(), g.inputs().end(), v);
      if (in == g.inputs().end()) return false;
      const int i = static_cast<int>(in - g.inputs().begin());
      return rec.baked(g, i) && !(i < static_cast<int>(g.written_inputs().size()) && g.written_inputs()[i]);
    }
    const Node& p = g.nodes()[producer];
    if (p.kind != NodeKind::kOp || p.args.empty()) return false;
    const std::string name = p.op->schema().name();
    if (name != "aten::t" && name != "aten::transpose" && name != "aten::permute") return false;
    if (p.args[0].kind == Arg::Kind::kConstant) return true;
    if (p.args[0].kind != Arg::Kind::kValue) return false;
    v = p.args[0].value;
    node = producer;
  }
  return false;
}

bool CheckNode(const Graph& g, int node, const std::vector<c10::IValue>& env, Recording* rec,
               const char* out_name, bool refusal_in_notes,
               const std::function<bool(const std::vector<const ValueRecord*>& results, Decision& decision)>& check) {
  const std::vector<const ValueRecord*> results = PlannedResults(g.nodes()[node], env, *rec);
  if (results.empty()) return false;
  Decision decision(rec, node, out_name, refusal_in_notes);
  return decision.Probe([&] { return check(results, decision); });
}

Decision::Decision(Recording* rec, int node, const char* out_name, bool refusal_in_notes)
    : rec_(rec), node_(node), out_name_(out_name), refusal_in_notes_(refusal_in_notes) {}

bool Decision::Refuse(const std::string& why) {
  (refusal_in_notes_ ? rec_->out_notes : rec_->out_refusals)[node_] = absl::StrCat(out_name_, " refused: ", why);
  return false;
}

bool Decision::Probe(const std::function<bool()>& check) {
  try {
    c10::impl::ExcludeDispatchKeyGuard no_python(
        c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot}));
    return check();
  } catch (const c10::Error& e) {
    return Refuse(absl::StrCat("the check raised: ", e.what_without_backtrace()));
  }
}

bool Decision::KeepFastest(const std::string& eager_label, const std::function<void()>& eager,
                           std::vector<Candidate> candidates, const std::vector<std::string>& not_tried,
                           int bitwise_on) {
  std::vector<std::function<void()>> runs = {eager};
  std::vector<size_t> timed;  // indices into candidates
  for (size_t k = 0; k < candidates.size(); ++k) {
    if (!candidates[k].why.empty()) continue;
    timed.push_back(k);
    runs.push_back(candidates[k].run);
  }
  const std::vector<double> us = MinMicros(runs);
  int best = -1;
  for (size_t j = 0; j < timed.size(); ++j) {
    Candidate& c = candidates[timed[j]];
    c.us = us[j + 1];
    if (!c.may_tie && c.us >= us[0]) {
      c.why = absl::StrCat("exact, but not faster than eager's op (", Us(c.us), ")");
    } else if (best < 0 || c.us < candidates[best].us) {
      best = static_cast<int>(timed[j]);
    }
  }
  std::vector<std::string> notes;
  for (size_t k = 0; k < candidates.size(); ++k) {
    if (static_cast<int>(k) == best) continue;
    const Candidate& c = candidates[k];
    notes.push_back(c.why.empty() ? absl::StrCat(c.kernel, ": exact, ", Us(c.us), ", slower")
                                  : absl::StrCat(c.kernel, ": ", c.why));
  }
  notes.insert(notes.end(), not_tried.begin(), not_tried.end());
  const std::string eager_note = absl::StrCat(eager_label, " ", Us(us[0]));
  if (best < 0) return Refuse(absl::StrCat(eager_note, "; ", absl::StrJoin(notes, "; ")));
  auto op = FindOperator(out_name_);
  if (!op.ok()) return Refuse(std::string(op.status().message()));
  rec_->out_variants[node_] = OutVariant{*op, c10::IValue(candidates[best].kernel)};
  rec_->out_notes[node_] = absl::StrCat(candidates[best].kernel, " ", Us(candidates[best].us), ", bitwise on ",
                                        bitwise_on, " inputs; ", eager_note, notes.empty() ? "" : "; ",
                                        absl::StrJoin(notes, "; "));
  return true;
}

at::Tensor Synthetic(const at::Tensor& like, bool nonfinite) {
  at::Tensor t = at::empty_strided(like.sizes(), like.strides(), like.options());
  const int64_t numel = like.numel();
  at::Tensor flat = at::empty({numel}, like.options());
  std::mt19937_64 rng(nonfinite ? 0x7e57c0de : 0x5eed);
  std::normal_distribution<double> normal;
  std::uniform_int_distribution<int> exponent(-20, 20);
  AT_DISPATCH_FLOATING_TYPES(like.scalar_type(), "torchreplay_synthetic", [&] {
    scalar_t* p = flat.data_ptr<scalar_t>();
    for (int64_t i = 0; i < numel; ++i) p[i] = static_cast<scalar_t>(std::ldexp(normal(rng), exponent(rng)));
    const scalar_t specials[] = {scalar_t(-0.0), scalar_t(0.0), std::numeric_limits<scalar_t>::denorm_min(),
                                 -std::numeric_limits<scalar_t>::denorm_min()};
    const scalar_t nonfinites[] = {std::numeric_limits<scalar_t>::infinity(),
                                   -std::numeric_limits<scalar_t>::infinity(),
                                   std::numeric_limits<scalar_t>::quiet_NaN(), -std::numeric_limits<scalar_t>::quiet_NaN()};
    for (int64_t i = 3; i < numel; i += 13) p[i] = specials[(i / 13) % 4];
    if (nonfinite) {
      const int64_t every = std::max<int64_t>(numel / 4, 1);
      for (int64_t i = every / 2, k = 0; i < numel; i += every, ++k) p[i] = nonfinites[k % 4];
    }
  });
  t.copy_(flat.view(like.sizes()));
  return t;
}

std::vector<double> MinMicros(const std::vector<std::function<void()>>& fns) {
  std::vector<double> best(fns.size(), std::numeric_limits<double>::infinity());
  double spent = 0;
  for (int r = 0; r < 7 && (r < 3 || spent < 20000); ++r) {
    for (size_t k = 0; k < fns.size(); ++k) {
      const auto t0 = std::chrono::steady_clock::now();
      fns[k]();
      const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
      best[k] = std::min(best[k], us);
      spent += us;
    }
  }
  return best;
}

at::Tensor FixedBuffer(const ValueRecord& r) {
  at::Tensor b = at::empty_strided(r.sizes, r.strides, at::TensorOptions().dtype(r.dtype));
  b.storage().unsafeGetStorageImpl()->set_resizable(false);
  return b;
}

std::string Us(double us) { return absl::StrFormat("%.1f us", us); }

std::string CompareRuns(const std::function<void(const std::vector<at::Tensor>& buffers)>& run,
                        const std::vector<at::Tensor>& eager, const std::vector<const ValueRecord*>& records,
                        const char* input) {
  std::vector<at::Tensor> buffers;
  std::vector<const c10::StorageImpl*> storages;
  for (const ValueRecord* r : records) {
    buffers.push_back(FixedBuffer(*r));
    storages.push_back(buffers.back().storage().unsafeGetStorageImpl());
  }
  try {
    run(buffers);
  } catch (const c10::Error& e) {
    return absl::StrCat("it raised on ", input, ": ", e.what_without_backtrace());
  }
  for (size_t k = 0; k < buffers.size(); ++k) {
    const ValueRecord& r = *records[k];
    if (buffers[k].sizes() != c10::IntArrayRef(r.sizes) || buffers[k].strides() != c10::IntArrayRef(r.strides) ||
        buffers[k].storage().unsafeGetStorageImpl() != storages[k]) {
      return "it resized or restrided its output";
    }
    if (!SameBits(buffers[k], eager[k])) return absl::StrCat("other bits than eager's on ", input);
  }
  return "";
}

std::string CompareRun(const std::function<void(const at::Tensor& buffer)>& run, const at::Tensor& eager,
                       const ValueRecord& r, const char* input) {
  return CompareRuns([&](const std::vector<at::Tensor>& buffers) { run(buffers[0]); }, {eager}, {&r}, input);
}

bool WeightWatch::Changed(const at::Tensor& w) {
  // A dense tensor's elements fill one block from its first one, in whatever order its strides
  // say (a linear layer's transposed weight): its bytes are compared where they lie, no copy.
  const at::Tensor dense = w.is_non_overlapping_and_dense() ? w : w.contiguous();
  const size_t nbytes = static_cast<size_t>(dense.numel()) * dense.element_size();
  if (seen_.defined() && w.const_data_ptr() == from_ && w.sizes() == sizes_ && w.strides() == strides_ &&
      static_cast<size_t>(seen_.numel()) == nbytes && std::memcmp(dense.const_data_ptr(), seen_.const_data_ptr(), nbytes) == 0) {
    return false;
  }
  seen_ = at::empty({static_cast<int64_t>(nbytes)}, at::TensorOptions().dtype(at::kByte));
  std::memcpy(seen_.mutable_data_ptr(), dense.const_data_ptr(), nbytes);
  from_ = w.const_data_ptr();
  sizes_ = w.sizes().vec(), strides_ = w.strides().vec();
  return true;
}

}  // namespace torchreplay::capture::tape::checked
