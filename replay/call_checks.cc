// What a captured trace assumed, checked per call (Note [What a call checks] in call_checks.h).
#include "replay/call_checks.h"

#include <cmath>
#include <cstdlib>
#include <limits>

#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "guards/guard_key.h"

namespace torchreplay::replay {

std::string Describe(const c10::IValue& v) {
  if (v.isInt()) return absl::StrCat(v.toInt());
  if (v.isDouble()) {  // as Python prints it: 2.0, -0.0, 0.5
    const double d = v.toDouble();
    std::string text = absl::StrCat(d);
    if (std::isfinite(d) && text.find_first_of(".e") == std::string::npos) text += ".0";
    return text;
  }
  if (v.isBool()) return v.toBool() ? "True" : "False";
  return v.tagKind();
}

absl::Status CheckFixed(const std::vector<std::pair<int, c10::IValue>>& fixed, size_t bound,
                        const std::vector<c10::IValue>& inputs) {
  for (const auto& [i, want] : fixed) {
    const c10::IValue& got = inputs[bound + i];
    const bool same = got.tagKind() == want.tagKind() &&
                      (got.isInt()      ? got.toInt() == want.toInt()
                       : got.isDouble() ? guards::SameFloat(got.toDouble(), want.toDouble())
                       : got.isBool()   ? got.toBool() == want.toBool()
                                        : true);
    if (!same) {
      return absl::InvalidArgumentError(absl::StrCat(
          "torchreplay: argument ", i, " is ", Describe(got), ", but the graph was captured with ",
          Describe(want), " there and computes with that value; capture again for another "
          "value (or capture with a tensor there)"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckSizes(const std::vector<SizeCheck>& sizes, const capture::Graph& graph, size_t bound,
                        const std::vector<c10::IValue>& inputs) {
  absl::InlinedVector<int64_t, 4> group_size;
  for (const SizeCheck& c : sizes) {
    const c10::IValue& v = inputs[bound + c.arg];
    const auto& spec = graph.values()[graph.inputs()[bound + c.arg]].spec;
    if (!v.isTensor() || !spec || v.toTensor().dim() != spec->dim) continue;  // the engine says what
    const int64_t size = v.toTensor().size(c.dim);
    std::string why;
    if (c.lo == c.hi && size != c.lo) {
      why = absl::StrCat("the graph was captured for size ", c.lo, " there");
    } else if (size < c.lo || size > c.hi) {
      why = c.hi == std::numeric_limits<int64_t>::max()
                ? absl::StrCat("the graph holds for sizes of at least ", c.lo, " there")
                : absl::StrCat("the graph holds for sizes ", c.lo, " to ", c.hi, " there");
    } else if (c.group >= 0) {
      if (static_cast<int>(group_size.size()) <= c.group) group_size.resize(c.group + 1, -1);
      int64_t& symbol = group_size[c.group];
      if (c.coef == 1 && c.offset == 0) {
        if (symbol >= 0 && symbol != size) {
          why = absl::StrCat("the graph needs it equal to size ", symbol, " of another dim");
        }
        symbol = size;
      } else if (symbol >= 0 && size != c.coef * symbol + c.offset) {
        why = absl::StrCat("the graph needs it to be ", c.coef * symbol + c.offset, " (", c.coef, " * ", symbol,
                           c.offset == 0 ? "" : absl::StrCat(" + ", c.offset), ", from another dim)");
      }
    }
    if (!why.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "torchreplay: argument ", c.arg, " has size ", size, " in dim ", c.dim, ", but ", why,
          " (the trace depends on it); capture again for this shape",
          c.lo == c.hi ? " (or with dynamic=True, unless the model's code made the trace specialize this size, "
                         "as a loop over it does)"
                       : ""));
    }
  }
  return absl::OkStatus();
}
// Note [Traced strides]
// torch.export decides some ops by the example's strides: reshape traces as a view where the
// strides allow one and as a copy where not, contiguous() and the like trace as nothing on a
// tensor already so, and a kernel fed other strides may add in another order. A graph traced on
// one layout is another program on another (a view that fails, or other bits), so a call whose
// tensor has other strides (in a dim of more than one element; a dynamic trace: contiguity) fails
// this check: torchreplay.capture traces again for that layout (captured.py _trace_for), a loaded
// program raises. torch.compile's own guards recompile there.
absl::Status CheckStrides(const std::vector<StrideCheck>& strides, size_t bound,
                          const std::vector<c10::IValue>& inputs) {
  for (const StrideCheck& c : strides) {
    const c10::IValue& v = inputs[bound + c.arg];
    if (!v.isTensor()) continue;  // the engine says what
    const at::Tensor& t = v.toTensor();
    bool same = true;
    if (c.strides.empty()) {
      same = t.is_contiguous();
    } else if (t.dim() == static_cast<int64_t>(c.strides.size())) {
      for (int64_t d = 0; d < t.dim() && same; ++d) same = t.size(d) <= 1 || t.stride(d) == c.strides[d];
    }
    if (!same) {
      return absl::InvalidArgumentError(absl::StrCat(
          "torchreplay: argument ", c.arg, " has strides (", absl::StrJoin(t.strides(), ", "), "), but the graph was traced ",
          c.strides.empty() ? "on a contiguous tensor" : absl::StrCat("for strides (", absl::StrJoin(c.strides, ", "), ")"),
          " and what it computes depends on them (Note [Traced strides]); pass a tensor of those strides "
          "(.contiguous()) or capture again with one of these"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckOverlap(const std::vector<int>& written, size_t bound, const std::vector<c10::IValue>& inputs) {
  auto span = [](const at::Tensor& t) {  // bytes of its storage the tensor can reach
    int64_t hi = t.storage_offset();
    for (int64_t d = 0; d < t.dim(); ++d) hi += (t.size(d) - 1) * std::abs(t.stride(d));
    return std::make_pair(t.storage_offset() * t.itemsize(), (hi + 1) * t.itemsize());
  };
  for (int i : written) {
    const c10::IValue& a = inputs[bound + i];
    if (!a.isTensor() || !a.toTensor().has_storage() || a.toTensor().numel() == 0) continue;
    const at::Tensor& w = a.toTensor();
    for (size_t j = bound; j < inputs.size(); ++j) {
      if (static_cast<int>(j - bound) == i || !inputs[j].isTensor()) continue;
      const at::Tensor& o = inputs[j].toTensor();
      if (!o.defined() || !o.has_storage() || o.numel() == 0 || !o.storage().is_alias_of(w.storage())) {
        continue;
      }
      const auto [wl, wh] = span(w);
      const auto [ol, oh] = span(o);
      if (wl < oh && ol < wh) {
        return absl::InvalidArgumentError(absl::StrCat(
            "torchreplay: argument ", i, " is written by the graph and shares memory with argument ",
            j - bound, "; the capture assumed separate tensors (pass a clone of one of them)"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace torchreplay::replay
