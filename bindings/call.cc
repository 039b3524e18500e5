// The Call (Note [The call path] in call.h) and its bindings.
#include "bindings/call.h"

#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <pybind11/stl.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/variable.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <stdexcept>

#include "absl/strings/str_cat.h"
#include "bindings/convert.h"
#include "guards/guard_key.h"
#include "capture/ir/caller_grad.h"
#include "replay/call_checks.h"

namespace torchreplay {
namespace {

std::atomic<int64_t> g_module_modes_epoch{0};

// t._dynamo_weak_dynamic_indices |= dims, or a copy of dims when t has none yet.
void MarkDynamic(py::handle t, const py::object& dims) {
  static PyObject* const kIndices = PyUnicode_InternFromString("_dynamo_weak_dynamic_indices");
  if (!THPVariable_Check(t.ptr())) return;
  PyObject* held = nullptr;
#if PY_VERSION_HEX >= 0x030D0000
  const int found = PyObject_GetOptionalAttr(t.ptr(), kIndices, &held);
#else
  const int found = _PyObject_LookupAttr(t.ptr(), kIndices, &held);
#endif
  if (found < 0) throw py::error_already_set();
  py::object merged = py::reinterpret_steal<py::object>(
      found ? PyNumber_InPlaceOr(held, dims.ptr()) : PySet_New(dims.ptr()));
  Py_XDECREF(held);
  if (!merged || PyObject_SetAttr(t.ptr(), kIndices, merged.ptr()) < 0) throw py::error_already_set();
}

}  // namespace

int BackwardHazards(const at::Tensor& t) {
  namespace impl = torch::autograd::impl;
  if (!t.defined() || !t.requires_grad()) return 0;
  int bits = 0;
  if (t.grad_fn()) bits |= 1;
  if (!impl::hooks(t).empty()) bits |= 2;
  if (impl::post_acc_grad_hooks(t)) bits |= 4;
  if (const std::shared_ptr<torch::autograd::Node> acc = impl::try_get_grad_accumulator(t)) {
    // (Its tensor_pre_hooks are the tensor's own hooks, bit 2.)
    if (!acc->pre_hooks().empty() || !acc->post_hooks().empty() || !acc->retains_grad_hooks().empty()) {
      bits |= 8;
    }
  }
  return bits;
}

std::string RequiresGradSinceCompiled(const std::string& graph, int i, const std::string& what) {
  return absl::StrCat(
      "torchreplay: graph '", graph, "': argument ", i, " (", what, ") requires grad, but did not when the graph "
      "was compiled: the graph computes no gradient for it, which would be silently skipped. torch.compile "
      "recompiles when torchreplay's guard sees such a change (Note [Leaves' requires_grad]); it did not here "
      "(a guard_filter_fn that drops it, or the parameter replaced by another nn.Parameter since the graph was "
      "compiled): call torch._dynamo.reset() after changing requires_grad");
}

bool RequiresGradGuard::Holds() const {
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto impl = tensors[i].lock();
    if (!impl.defined() || impl->requires_grad() != requires_grad[i]) return false;
  }
  return true;
}

std::vector<int> RequiresGradGuard::Changed() const {
  std::vector<int> changed;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto impl = tensors[i].lock();
    if (impl.defined() && impl->requires_grad() != requires_grad[i]) changed.push_back(static_cast<int>(i));
  }
  return changed;
}

namespace {

// A guard object's tp_call, as Dynamo's lambda guards call it (with the frame's locals, unread):
// True while it holds.
template <typename Guard>
PyObject* GuardCall(PyObject* self, const char* name) {
  auto* inst = reinterpret_cast<py::detail::instance*>(self);
  const Guard* guard = inst->get_value_and_holder().template value_ptr<Guard>();
  if (guard == nullptr || !inst->get_value_and_holder().holder_constructed()) {
    PyErr_Format(PyExc_TypeError, "torchreplay: this %s was not initialized", name);
    return nullptr;
  }
  PyObject* result = guard->Holds() ? Py_True : Py_False;
  Py_INCREF(result);
  return result;
}

}  // namespace

PyObject* RequiresGradGuard::TpCall(PyObject* self, PyObject* /*args*/, PyObject* /*kwargs*/) {
  return GuardCall<RequiresGradGuard>(self, "RequiresGradGuard");
}

uint8_t TraceState::SdpaNow() {
  const at::Context& ctx = at::globalContext();
  return static_cast<uint8_t>(ctx.userEnabledFlashSDP() | ctx.userEnabledMemEfficientSDP() << 1 |
                              ctx.userEnabledMathSDP() << 2 | ctx.userEnabledCuDNNSDP() << 3 |
                              ctx.allowFP16BF16ReductionMathSDP() << 4);
}

TraceState TraceState::Now() {
  auto autocast = [](c10::DeviceType device) {
    return at::autocast::is_autocast_enabled(device) ? at::autocast::get_autocast_dtype(device)
                                                     : c10::ScalarType::Undefined;
  };
  return TraceState{c10::get_default_dtype_as_scalartype(), SdpaNow(), autocast(c10::DeviceType::CPU),
                    autocast(c10::DeviceType::CUDA)};
}

PyObject* SdpaGuard::TpCall(PyObject* self, PyObject* /*args*/, PyObject* /*kwargs*/) {
  return GuardCall<SdpaGuard>(self, "SdpaGuard");
}

void ModuleModesChanged() { g_module_modes_epoch.fetch_add(1, std::memory_order_relaxed); }
int64_t ModuleModesEpoch() { return g_module_modes_epoch.load(std::memory_order_relaxed); }

void Call::Validate() const {
  const int n_args = static_cast<int>(engine->graph().inputs().size() - bound.size());
  auto in_args = [&](int i) { return i >= 0 && i < n_args; };
  for (int i : mutated) {
    if (!in_args(i)) throw py::value_error("torchreplay: mutated index out of range");
  }
  for (int i : mutated_bound) {
    if (i < 0 || i >= static_cast<int>(bound.size())) {
      throw py::value_error("torchreplay: mutated bound index out of range");
    }
  }
  if (checks.has_value()) {
    for (const SizeCheck& c : checks->sizes) {
      if (!in_args(c.arg) || c.dim < 0) throw py::value_error("torchreplay: size check out of range");
    }
    for (const StrideCheck& c : checks->strides) {
      if (!in_args(c.arg)) throw py::value_error("torchreplay: stride check out of range");
    }
    for (int i : checks->grad_checked) {
      if (i < 0 || i >= static_cast<int>(bound.size())) {
        throw py::value_error("torchreplay: grad_checked out of range");
      }
    }
    for (const auto& f : checks->fixed) {
      if (!in_args(f.first)) throw py::value_error("torchreplay: fixed index out of range");
    }
    for (const auto& g : checks->grad_traced) {
      if (g.first < 0 || g.first >= static_cast<int>(bound.size()) || !bound[g.first].isTensor()) {
        throw py::value_error("torchreplay: grad_traced out of range");
      }
    }
  }
  if (aot.has_value()) {
    for (const auto& [o, dims] : aot->dynamic_dims) {
      if (o < 0) throw py::value_error("torchreplay: dynamic_dims output out of range");
    }
    for (int i : aot->grad_leaves) {
      if (!in_args(i)) throw py::value_error("torchreplay: grad_leaves index out of range");
    }
    for (int i : aot->frozen) {
      if (!in_args(i)) throw py::value_error("torchreplay: frozen index out of range");
    }
  }
}

bool Call::GradsAsTraced() const {
  for (const auto& [i, requires_grad] : checks->grad_traced) {
    if (bound[i].toTensor().requires_grad() != requires_grad) return false;
  }
  return true;
}

bool Call::IdentityAsTraced(const py::args& args) const {
  const auto n = static_cast<int>(args.size());
  for (const auto& [i, j] : checks->same) {
    if (j >= n || args[i].ptr() != args[j].ptr()) return false;
  }
  for (const auto& [i, j] : checks->distinct) {
    if (j < n && args[i].ptr() == args[j].ptr()) return false;
  }
  return true;
}

py::object Call::operator()(const py::args& args, const py::kwargs& kwargs) const {
  const bool slow = checks.has_value() && !checks->slow_path.is_none();
  if (slow && (checks->always_slow || kwargs.size() != 0 || checks->modes_epoch != ModuleModesEpoch() ||
               checks->traced != TraceState::Now() || !GradsAsTraced() || !IdentityAsTraced(args))) {
    return checks->slow_path(*args, **kwargs);
  }
  std::vector<c10::IValue> inputs;
  try {
    if (std::optional<py::object> done = CheckedInputs(args, kwargs, &inputs)) return *done;
  } catch (const py::value_error&) {  // another trace may hold for these sizes: Python decides
    if (!slow) throw;
    return checks->slow_path(*args, **kwargs);
  } catch (const py::type_error&) {
    if (!slow) throw;
    return checks->slow_path(*args, **kwargs);
  }
  return RunChecked(std::move(inputs), args);
}

PyObject* Call::TpCall(PyObject* self, PyObject* args, PyObject* kwargs) {
  auto* inst = reinterpret_cast<py::detail::instance*>(self);
  const Call* call = inst->get_value_and_holder().value_ptr<Call>();
  if (call == nullptr || !inst->get_value_and_holder().holder_constructed()) {
    PyErr_SetString(PyExc_TypeError, "torchreplay: this Call was not initialized (its __init__ did not run)");
    return nullptr;
  }
  try {
    static const py::kwargs& kNoKeywords = *new py::kwargs();  // never freed: outlives Python
    const py::args a = py::reinterpret_borrow<py::args>(args);
    py::object out = kwargs == nullptr ? (*call)(a, kNoKeywords)
                                       : (*call)(a, py::reinterpret_borrow<py::kwargs>(kwargs));
    return out.release().ptr();
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (...) {
    py::detail::try_translate_exceptions();
  }
  return nullptr;
}

py::object Call::Fast(const py::args& args, const py::kwargs& kwargs) const {
  std::vector<c10::IValue> inputs;
  if (std::optional<py::object> done = CheckedInputs(args, kwargs, &inputs)) return *done;
  return RunChecked(std::move(inputs), args);
}

std::optional<py::object> Call::CheckedInputs(const py::args& args, const py::kwargs& kwargs,
                                              std::vector<c10::IValue>* out) const {
  std::vector<c10::IValue>& inputs = *out;
  if (checks.has_value() && !checks->stale.empty()) throw py::value_error(checks->stale);
  if (kwargs.size() != 0) {
    throw py::type_error(absl::StrCat("torchreplay: graph '", engine->options().name,
                                      "' takes positional arguments only"));
  }
  const size_t n_args = engine->graph().inputs().size() - bound.size();
  if (args.size() != n_args) {
    throw py::type_error(absl::StrCat("torchreplay: graph '", engine->options().name, "' takes ",
                                      n_args, " arguments, got ", args.size()));
  }
  inputs.reserve(bound.size() + args.size());
  inputs.insert(inputs.end(), bound.begin(), bound.end());
  try {
    for (auto a : args) inputs.push_back(ToIValue(a));
  } catch (py::error_already_set& e) {
    if (!e.matches(PyExc_OverflowError) || !aot.has_value() || aot->fallback.is_none()) throw;
    return aot->fallback(*args);
  }
  if (checks.has_value()) Check(inputs);
  if (aot.has_value()) {
    if (aot->leaves_fixed) {
      for (size_t i = 0; i < args.size(); ++i) {
        const c10::IValue& v = inputs[bound.size() + i];
        if (v.isTensor() && IsGradLeaf(v.toTensor()) != aot->leaf_mask[i]) {
          aot->hazard_check(i, args[i]);
          throw std::runtime_error(absl::StrCat("torchreplay: graph '", engine->options().name, "': argument ", i,
                                                " is not the leaf it was when its backward was traced"));
        }
      }
    }
    if (!aot->frozen.empty() && c10::GradMode::is_enabled()) {
      for (size_t k = 0; k < aot->frozen.size(); ++k) {
        const c10::IValue& v = inputs[bound.size() + aot->frozen[k]];
        if (v.isTensor() && v.toTensor().defined() && v.toTensor().requires_grad()) {
          throw std::runtime_error(
              RequiresGradSinceCompiled(engine->options().name, aot->frozen[k], aot->frozen_names[k]));
        }
      }
    }
    for (int i : aot->grad_leaves) {
      const c10::IValue& v = inputs[bound.size() + i];
      if (v.isTensor() && BackwardHazards(v.toTensor()) != 0) aot->hazard_check(i, args[i]);
    }
  }
  return std::nullopt;
}

namespace {
// What bound tensor `i` is in the model, for errors.
std::string BoundName(const CaptureChecks& c, size_t i) {
  return i < c.bound_names.size() ? c.bound_names[i] : absl::StrCat("bound input ", i);
}
}  // namespace

void Call::Check(const std::vector<c10::IValue>& inputs) const {
  const CaptureChecks& c = *checks;
  for (size_t i = 0; i < c.bound_sizes.size() && i < inputs.size(); ++i) {
    if (inputs[i].isTensor() && inputs[i].toTensor().sizes() != c10::IntArrayRef(c.bound_sizes[i])) {
      throw py::value_error(absl::StrCat(
          "torchreplay: ", BoundName(c, i), " of the captured model has sizes ", c10::str(inputs[i].toTensor().sizes()), ", not the ",
          c10::str(c10::IntArrayRef(c.bound_sizes[i])), " graph '", engine->options().name,
          "' was traced with (its data was replaced since); capture the model again"));
    }
  }
  if (c10::GradMode::is_enabled()) {
    for (int i : c.grad_checked) {
      const bool owned = i < static_cast<int>(c.grad_owners.size()) && c.grad_owners[i].defined();
      if (owned ? c.grad_owners[i].requires_grad() : inputs[i].isTensor() && inputs[i].toTensor().requires_grad()) {
        throw py::value_error(absl::StrCat(
            "torchreplay: ", BoundName(c, i),
            " of the captured model requires grad and grad mode is on, but graph '",
            engine->options().name, "' runs inference only (its outputs would not track gradients "
            "as eager's do); call it under torch.no_grad() or torch.inference_mode(), or freeze "
            "the parameters (requires_grad_(False)); torch.compile trains"));
      }
    }
    for (size_t i = bound.size(); i < inputs.size(); ++i) {
      if (inputs[i].isTensor() && inputs[i].toTensor().requires_grad()) {
        throw py::value_error(absl::StrCat(
            "torchreplay: argument ", i - bound.size(), " requires grad, but graph '",
            engine->options().name, "' runs inference only (its outputs do not track gradients); "
            "call it under torch.no_grad() or pass a detached tensor (torch.compile trains)"));
      }
    }
  }
  for (const absl::Status& s : {replay::CheckOverlap(mutated, bound.size(), inputs),
                                 replay::CheckFixed(c.fixed, bound.size(), inputs),
                                 replay::CheckSizes(c.sizes, engine->graph(), bound.size(), inputs),
                                 replay::CheckStrides(c.strides, bound.size(), inputs)}) {
    if (!s.ok()) throw py::value_error(std::string(s.message()));
  }
  static PyObject* const kTraining = PyUnicode_InternFromString("training");
  if (!c.module.is_none()) {
    py::object now = py::reinterpret_steal<py::object>(PyObject_GetAttr(c.module.ptr(), kTraining));
    if (!now) throw py::error_already_set();
    if (PyObject_IsTrue(now.ptr()) != static_cast<int>(c.training)) {
      throw py::value_error(absl::StrCat(
          "torchreplay: the model was captured in ", c.training ? "train" : "eval", " mode and is now in ",
          c.training ? "eval" : "train", " mode (.train()/.eval() change what it computes); capture again"));
    }
  }
}

py::object Call::RunChecked(std::vector<c10::IValue> inputs, const py::args& args) const {
  for (int i : mutated) {
    const c10::IValue& v = inputs[bound.size() + i];
    if (v.isTensor()) v.toTensor().unsafeGetTensorImpl()->bump_version();
  }
  for (int i : mutated_bound) {
    if (inputs[i].isTensor()) inputs[i].toTensor().unsafeGetTensorImpl()->bump_version();
  }
  absl::InlinedVector<c10::IValue, 2> alias_bases;
  const bool aliases = aot.has_value() && !aot->aliases.empty();
  if (aliases) {
    for (const Alias& a : aot->aliases) {
      if (a.kind != AliasKind::kViewOfOutput) alias_bases.push_back(inputs[bound.size() + a.base]);
    }
  }
  absl::StatusOr<std::vector<c10::IValue>> out;
  {
    py::gil_scoped_release no_gil;
    {
      CallerGradScope no_grad;  // Note [The caller's grad mode]
      out = engine->Run(std::move(inputs));
    }
    if (out.ok() && aliases) RegenerateAliases(alias_bases, *out);
  }
  if (!out.ok() && IsIntOverflow(out.status()) && aot.has_value() && !aot->fallback.is_none() &&
      mutated.empty()) {
    return aot->fallback(*args);  // Python's ints have no bound: the graph run by Python gives eager's
  }
  if (!out.ok()) Throw(out.status());
  const size_t n = num_outputs < 0 ? out->size() : std::min<size_t>(num_outputs, out->size());
  py::list result = FromIValues<py::list>(*out, n);
  if (aot.has_value()) {
    for (const auto& [i, dims] : aot->dynamic_dims) {
      if (static_cast<size_t>(i) < n) MarkDynamic(result[i], dims);
    }
  }
  if (returns == Returns::kOne && n == 1) return result[0];
  if (returns == Returns::kTuple) return py::tuple(result);
  return result;
}

void Call::RegenerateAliases(const absl::InlinedVector<c10::IValue, 2>& input_bases,
                             std::vector<c10::IValue>& out) const {
  size_t k = 0;
  for (const Alias& a : aot->aliases) {
    const c10::IValue& base_value = a.kind == AliasKind::kViewOfOutput ? out[a.base] : input_bases[k++];
    c10::IValue& o = out[a.output];
    if (!o.isTensor() || !base_value.isTensor()) continue;
    if (a.kind == AliasKind::kInput) {
      o = base_value;
      continue;
    }
    if (a.kind == AliasKind::kDetachOfInput) {
      o = base_value.toTensor().detach();
      continue;
    }
    const at::Tensor& base = base_value.toTensor();
    const at::Tensor& t = o.toTensor();
    const at::Tensor typed = t.scalar_type() == base.scalar_type() ? base : base.view(t.scalar_type());
    o = typed.as_strided(t.sizes(), t.strides(), t.storage_offset());
  }
}

// Over 80 lines: the Python class of a Call, every method and property bound in one place, as
// pybind11 declares a class.
void BindCall(py::module_& m) {
  py::enum_<Returns>(m, "Returns", "How a Call returns the graph's outputs.")
      .value("LIST", Returns::kList)
      .value("TUPLE", Returns::kTuple)
      .value("ONE", Returns::kOne, "the one output itself");
  py::enum_<AliasKind>(m, "AliasKind", "What an output aliases (AOTAutograd's output types).")
      .value("VIEW_OF_INPUT", AliasKind::kViewOfInput)
      .value("INPUT", AliasKind::kInput)
      .value("VIEW_OF_OUTPUT", AliasKind::kViewOfOutput)
      .value("DETACH_OF_INPUT", AliasKind::kDetachOfInput);
  py::class_<Alias>(m, "Alias", "An output given back as its base argument or an autograd view of it.")
      .def(py::init([](int output, AliasKind kind, int base) { return Alias{output, kind, base}; }),
           py::arg("output"), py::arg("kind"), py::arg("base"))
      .def_readonly("output", &Alias::output)
      .def_readonly("kind", &Alias::kind)
      .def_readonly("base", &Alias::base);
  py::class_<AotEpilogue>(m, "AotEpilogue", "What AOTAutograd's runtime wrapper does after the graph.")
      .def(py::init([](std::vector<Alias> aliases, const std::vector<std::pair<int, py::object>>& dynamic_dims,
                       py::object fallback, std::vector<int> grad_leaves, py::object hazard_check,
                       bool leaves_fixed, std::vector<int> frozen, std::vector<std::string> frozen_names) {
             AotEpilogue e{std::move(aliases), {}, std::move(fallback), std::move(grad_leaves),
                           std::move(hazard_check), leaves_fixed, {}, std::move(frozen), std::move(frozen_names)};
             if (e.frozen_names.size() != e.frozen.size()) {
               throw py::value_error("torchreplay: frozen and frozen_names differ in length");
             }
             if ((!e.grad_leaves.empty() || e.leaves_fixed) && e.hazard_check.is_none()) {
               throw py::value_error("torchreplay: grad_leaves need a hazard_check");
             }
             for (const auto& [o, dims] : dynamic_dims) {
               e.dynamic_dims.emplace_back(o, py::reinterpret_steal<py::object>(PyFrozenSet_New(dims.ptr())));
               if (!e.dynamic_dims.back().second) throw py::error_already_set();
             }
             return e;
           }),
           py::arg("aliases") = std::vector<Alias>(),
           py::arg("dynamic_dims") = std::vector<std::pair<int, py::object>>(),
           py::arg("fallback") = py::none(), py::arg("grad_leaves") = std::vector<int>(),
           py::arg("hazard_check") = py::none(), py::arg("leaves_fixed") = false,
           py::arg("frozen") = std::vector<int>(), py::arg("frozen_names") = std::vector<std::string>());
  py::class_<SizeCheck>(m, "SizeCheck", "A size of a tensor argument the trace assumed.")
      .def(py::init([](int arg, int dim, int64_t lo, int64_t hi, int group, int64_t coef, int64_t offset) {
             return SizeCheck{arg, dim, lo, hi, group, coef, offset};
           }),
           py::arg("arg"), py::arg("dim"), py::arg("lo"), py::arg("hi"), py::arg("group") = -1,
           py::arg("coef") = 1, py::arg("offset") = 0);
  py::class_<StrideCheck>(m, "StrideCheck", "The strides of a tensor argument the trace assumed ([]: contiguous).")
      .def(py::init([](int arg, std::vector<int64_t> strides) { return StrideCheck{arg, std::move(strides)}; }),
           py::arg("arg"), py::arg("strides"));
  py::class_<CaptureChecks>(m, "CaptureChecks", "What torchreplay.capture's trace assumed, checked per call.")
      .def(py::init([](py::dict fixed, std::vector<SizeCheck> sizes, std::vector<StrideCheck> strides, py::object module,
                       std::vector<int> grad_checked, std::vector<std::optional<at::Tensor>> grad_owners,
                       std::vector<std::string> bound_names, py::object slow_path, bool always_slow,
                       std::vector<std::pair<int, bool>> grad_traced, std::vector<std::pair<int, int>> same,
                       std::vector<std::pair<int, int>> distinct) {
             CaptureChecks c;
             for (auto [i, v] : fixed) c.fixed.emplace_back(i.cast<int>(), ToIValue(v));
             c.sizes = std::move(sizes);
             c.strides = std::move(strides);
             c.module = std::move(module);
             if (!c.module.is_none()) c.training = c.module.attr("training").cast<bool>();
             c.grad_checked = std::move(grad_checked);
             for (auto& t : grad_owners) c.grad_owners.push_back(t.has_value() ? *std::move(t) : at::Tensor());
             c.bound_names = std::move(bound_names);
             c.slow_path = std::move(slow_path);
             c.always_slow = always_slow && !c.slow_path.is_none();
             c.grad_traced = std::move(grad_traced);
             c.same = std::move(same);
             c.distinct = std::move(distinct);
             return c;
           }),
           py::arg("fixed") = py::dict(), py::arg("sizes") = std::vector<SizeCheck>(),
           py::arg("strides") = std::vector<StrideCheck>(), py::arg("module") = py::none(), py::arg("grad_checked") = std::vector<int>(),
           py::arg("grad_owners") = std::vector<std::optional<at::Tensor>>(),
           py::arg("bound_names") = std::vector<std::string>(), py::arg("slow_path") = py::none(),
           py::arg("always_slow") = false, py::arg("grad_traced") = std::vector<std::pair<int, bool>>(),
           py::arg("same") = std::vector<std::pair<int, int>>(), py::arg("distinct") = std::vector<std::pair<int, int>>());

  py::class_<Call>(m, "Call", "One compiled graph as a C++ callable (Note [The call path]).",
                   py::custom_type_setup([](PyHeapTypeObject* type) { type->ht_type.tp_call = &Call::TpCall; }))
      .def(py::init([](std::shared_ptr<replay::Engine> engine, py::list bound, std::vector<int> mutated,
                       std::vector<int> mutated_bound, int num_outputs, Returns returns,
                       std::optional<AotEpilogue> aot, std::optional<CaptureChecks> checks) {
             Call c{std::move(engine), {}, std::move(mutated), std::move(mutated_bound), num_outputs, returns,
                    std::move(aot), std::move(checks)};
             for (auto b : bound) c.bound.push_back(ToIValue(b));
             if (c.checks.has_value()) {
               for (const c10::IValue& b : c.bound) {
                 c.checks->bound_sizes.push_back(b.isTensor() ? b.toTensor().sizes().vec() : std::vector<int64_t>());
               }
             }
             c.Validate();
             if (c.aot.has_value() && c.aot->leaves_fixed) {
               c.aot->leaf_mask.assign(c.engine->graph().inputs().size() - c.bound.size(), false);
               for (int i : c.aot->grad_leaves) c.aot->leaf_mask[i] = true;
             }
             return c;
           }),
           py::arg("engine"), py::arg("bound") = py::list(), py::arg("mutated") = std::vector<int>(),
           py::arg("mutated_bound") = std::vector<int>(), py::arg("num_outputs") = -1, py::arg("returns") = Returns::kList, py::arg("aot") = py::none(),
           py::arg("checks") = py::none())
      .def("_fast", &Call::Fast, "The call on the graph's flat arguments, with no slow path.")
      .def("_modes_checked",
           [](const Call& c, int64_t epoch) {
             if (c.checks.has_value()) c.checks->modes_epoch = epoch;
           },
           "The modules' modes were found as captured at `epoch` (module_modes_epoch()).")
      .def("_set_stale",
           [](Call& c, const std::string& why) {
             if (!c.checks.has_value()) throw py::value_error("torchreplay: only a capture's Call goes stale");
             c.checks->stale = why;
           },
           "Makes every later call raise ValueError(why) (the model changed under the capture).")
      .def_property_readonly("engine", [](const Call& c) { return c.engine; });

  py::class_<RequiresGradGuard>(m, "RequiresGradGuard",
                                "Dynamo's guard on the requires_grad of a graph's module parameters (Note [Leaves' "
                                "requires_grad]): called with anything, True while each requires grad as when built.",
                                py::custom_type_setup([](PyHeapTypeObject* type) {
                                  type->ht_type.tp_call = &RequiresGradGuard::TpCall;
                                }))
      .def(py::init([](const std::vector<at::Tensor>& tensors) {
             RequiresGradGuard g;
             for (const at::Tensor& t : tensors) {
               if (!t.defined()) throw py::value_error("torchreplay: RequiresGradGuard of an undefined tensor");
               g.tensors.emplace_back(t.getIntrusivePtr());
               g.requires_grad.push_back(t.requires_grad());
             }
             return g;
           }),
           py::arg("tensors"))
      .def("changed", &RequiresGradGuard::Changed, "Indices of the tensors whose requires_grad changed since.")
      .def_property_readonly("requires_grad", [](const RequiresGradGuard& g) { return g.requires_grad; });
  py::class_<SdpaGuard>(m, "SdpaGuard",
                        "Dynamo's guard on scaled_dot_product_attention's backend switches (Note [What a trace was "
                        "made under]): called with anything, True while they are as when built.",
                        py::custom_type_setup([](PyHeapTypeObject* type) { type->ht_type.tp_call = &SdpaGuard::TpCall; }))
      .def(py::init<>());
  m.def("sdpa_switches", &TraceState::SdpaNow,
        "scaled_dot_product_attention's backend switches now, a bit each (Note [What a trace was made under]).");
  m.def("is_grad_leaf", &IsGradLeaf, py::arg("tensor"),
        "Whether a backward computes this tensor's gradient as a leaf's: it requires grad, no grad_fn.");
  m.def("backward_hazards", &BackwardHazards, py::arg("tensor"),
        "What a traced backward does not do for this tensor, as bits: 1 a grad_fn, 2 hooks (maybe "
        "removed since), 4 post-accumulate-grad hooks (likewise), 8 hooks on its gradient accumulator.");
  m.def("module_modes_changed", &ModuleModesChanged,
        "Called by nn.Module.train (wrapped by torchreplay.capture): some module's mode may have changed.");
  m.def("module_modes_epoch", &ModuleModesEpoch);
}

}  // namespace torchreplay
