// bindings/module.cc: the pybind11 module torchreplay._C.
//
// Graph construction: the Python lowering hands each argument over as a tagged tuple,
// ("v", value_id) for a graph value, ("l", [tagged...]) for a list with values in it, or
// ("c", python_constant). Calls: Engine.run takes AOTAutograd's boxed argument list, clears it
// (so inputs are freed as early as eager would free them), and returns the outputs as a list.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/Device.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Layout.h>
#include <torch/csrc/MemoryFormat.h>
#include <torch/csrc/autograd/python_variable.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <memory>
#include <string>
#include <tuple>

#include "absl/container/inlined_vector.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "capture/graph.h"
#include "capture/interpreter.h"
#include "capture/scopes.h"
#include "guards/guard_key.h"
#include "memory_pool/arena.h"
#include "replay/engine.h"

namespace py = pybind11;

namespace torchreplay {
namespace {

// A graph int that left int64 (where Python's would not): the call may be run by Python instead.
bool IsIntOverflow(const absl::Status& s) {
  return s.code() == absl::StatusCode::kOutOfRange &&
         absl::StrContains(s.message(), capture::kIntOverflow);
}

[[noreturn]] void Throw(const absl::Status& s) {
  // An op that went to Python code (a Python kernel or decomposition) and raised there leaves
  // that error set: it is the call's error, with the type and message eager gives.
  if (PyErr_Occurred() != nullptr) throw py::error_already_set();
  if (IsIntOverflow(s)) {
    PyErr_SetString(PyExc_OverflowError, std::string(s.message()).c_str());
    throw py::error_already_set();
  }
  // A kernel's error, as eager raises it (Note [Kernel errors keep their type]).
  if (const auto type = s.GetPayload(capture::kErrorType)) {
    static const std::pair<const char*, PyObject*> kBuiltins[] = {
        {"IndexError", PyExc_IndexError},   {"ValueError", PyExc_ValueError},
        {"TypeError", PyExc_TypeError},     {"NotImplementedError", PyExc_NotImplementedError},
        {"BufferError", PyExc_BufferError},
    };
    py::object exc;
    for (const auto& [name, builtin] : kBuiltins) {
      if (*type == name) exc = py::reinterpret_borrow<py::object>(builtin);
    }
    if (!exc) {  // torch's own: torch.OutOfMemoryError, torch.AcceleratorError, torch.linalg.LinAlgError
      py::object torch = py::module_::import("torch");
      exc = *type == "LinAlgError" ? torch.attr("linalg").attr("LinAlgError")
                                   : py::getattr(torch, std::string(*type).c_str(), py::none());
    }
    if (!exc.is_none()) {
      PyErr_SetString(exc.ptr(), std::string(s.message()).c_str());
      throw py::error_already_set();
    }
  }
  if (s.code() == absl::StatusCode::kInvalidArgument || s.code() == absl::StatusCode::kNotFound ||
      s.code() == absl::StatusCode::kOutOfRange) {
    throw py::value_error(std::string(s.message()));
  }
  throw std::runtime_error(std::string(s.message()));
}

template <typename T>
T Unwrap(absl::StatusOr<T> v) {
  if (!v.ok()) Throw(v.status());
  return std::move(*v);
}

// A Python int as int64, or a clear OverflowError (graphs and kernels take 64-bit integers).
int64_t ToInt64(PyObject* o) {
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
  if (overflow != 0) {
    PyErr_Format(PyExc_OverflowError,
                 "torchreplay: the Python int %S does not fit in 64 bits (graph integers are int64)",
                 o);
    throw py::error_already_set();
  }
  if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
  return static_cast<int64_t>(v);
}

c10::IValue ToIValue(py::handle obj) {
  PyObject* o = obj.ptr();
  if (o == Py_None) return {};
  if (THPVariable_Check(o)) return THPVariable_Unpack(o);
  if (PyBool_Check(o)) return o == Py_True;
  if (PyLong_Check(o)) return ToInt64(o);
  if (PyFloat_Check(o)) return PyFloat_AsDouble(o);
  if (PyUnicode_Check(o)) return obj.cast<std::string>();
  if (THPDtype_Check(o)) return reinterpret_cast<THPDtype*>(o)->scalar_type;
  if (THPDevice_Check(o)) return reinterpret_cast<THPDevice*>(o)->device;
  if (THPLayout_Check(o)) return reinterpret_cast<THPLayout*>(o)->layout;
  if (THPMemoryFormat_Check(o)) return reinterpret_cast<THPMemoryFormat*>(o)->memory_format;
  if (PyComplex_Check(o)) return c10::complex<double>(PyComplex_RealAsDouble(o), PyComplex_ImagAsDouble(o));
  if (PyList_Check(o) || PyTuple_Check(o)) {
    auto seq = py::reinterpret_borrow<py::sequence>(obj);
    bool all_int = true, all_float = true, all_bool = true, all_tensor = true, all_str = true;
    for (auto item : seq) {
      PyObject* p = item.ptr();
      const bool is_bool = PyBool_Check(p);
      all_str = all_str && PyUnicode_Check(p);
      all_bool = all_bool && is_bool;
      all_int = all_int && PyLong_Check(p) && !is_bool;
      all_float = all_float && (PyFloat_Check(p) || (PyLong_Check(p) && !is_bool));
      all_tensor = all_tensor && THPVariable_Check(p);
    }
    if (seq.size() == 0 || all_int) {
      std::vector<int64_t> v;
      for (auto item : seq) v.push_back(ToInt64(item.ptr()));
      return c10::List<int64_t>(v);
    }
    if (all_bool) {
      c10::List<bool> v;
      for (auto item : seq) v.push_back(item.ptr() == Py_True);
      return v;
    }
    if (all_float) {
      c10::List<double> v;
      for (auto item : seq) v.push_back(item.cast<double>());
      return v;
    }
    if (all_str) {
      c10::List<std::string> v;
      for (auto item : seq) v.push_back(item.cast<std::string>());
      return v;
    }
    if (all_tensor) {
      c10::List<at::Tensor> v;
      for (auto item : seq) v.push_back(THPVariable_Unpack(item.ptr()));
      return v;
    }
  }
  throw py::type_error("torchreplay: cannot use a constant of type " +
                       std::string(Py_TYPE(o)->tp_name) + " in a graph");
}

py::object FromIValue(const c10::IValue& v) {
  if (v.isTensor()) return py::reinterpret_steal<py::object>(THPVariable_Wrap(v.toTensor()));
  if (v.isNone()) return py::none();
  if (v.isInt()) return py::int_(v.toInt());
  if (v.isDouble()) return py::float_(v.toDouble());
  if (v.isBool()) return py::bool_(v.toBool());
  if (v.isTensorList()) {
    py::list l;
    for (const at::Tensor& t : v.toTensorVector()) {
      l.append(py::reinterpret_steal<py::object>(THPVariable_Wrap(t)));
    }
    return l;
  }
  throw py::type_error("torchreplay: cannot return a value of kind " + std::string(v.tagKind()));
}

capture::Arg ToArg(py::handle tagged) {
  auto t = tagged.cast<py::tuple>();
  const std::string tag = t[0].cast<std::string>();
  if (tag == "v") return capture::Arg::Ref(t[1].cast<int>());
  if (tag == "l") {
    std::vector<capture::Arg> elems;
    for (auto e : t[1]) elems.push_back(ToArg(e));
    return capture::Arg::List(std::move(elems));
  }
  return capture::Arg::Const(ToIValue(t[1]));
}

capture::ValueType ValueTypeFromName(const std::string& s) {
  if (s == "Tensor") return capture::ValueType::kTensor;
  if (s == "int") return capture::ValueType::kInt;
  if (s == "float") return capture::ValueType::kFloat;
  if (s == "bool") return capture::ValueType::kBool;
  throw py::value_error("torchreplay: unknown input type '" + s + "'");
}

// Counts the calls of nn.Module.train (torchreplay.capture wraps it): a Call whose modules'
// modes were last checked at another count checks them again (Call::modes_epoch).
std::atomic<int64_t> g_module_modes_epoch{0};
int64_t ModuleModesEpoch() { return g_module_modes_epoch.load(std::memory_order_relaxed); }

// Note [The call path]
// For an inference graph, torch.compile hands Dynamo a Call instead of AOTAutograd's runtime
// wrapper around a Python function: Dynamo's bytecode calls straight into C++ with the call's
// arguments as they are (no boxed list, no Python frame of ours). backend.py builds one only when
// that wrapper would do nothing beyond what a Call does: bump the version counters of the inputs
// the graph mutates, run with grad mode off, give outputs aliasing an input back as the input or
// an autograd view of it, drop the graph's extra outputs (intermediate bases of aliased outputs),
// and mark outputs' dynamic dims for later compiles (dynamic=True graphs). torchreplay.capture
// uses it too, with the model's parameters and buffers bound once ahead of the call's arguments.
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

// The first n values as a Python list or tuple.
template <typename Seq>
Seq FromIValues(const std::vector<c10::IValue>& values, size_t n) {
  Seq seq(n);
  for (size_t i = 0; i < n; ++i) seq[i] = FromIValue(values[i]);
  return seq;
}

struct Call {
  std::shared_ptr<replay::Engine> engine;
  std::vector<c10::IValue> bound;  // leading graph inputs, fixed when the Call is built
  std::vector<int> mutated;        // indices of call arguments the graph writes to
  int num_outputs = -1;            // outputs returned: the graph's first num_outputs (-1: all)
  py::object fallback;             // takes the call when an argument does not convert (an int
                                   // beyond 64 bits); None: the OverflowError propagates
  // What the graph was specialized on, checked every call: Python numbers (argument index,
  // value), tensor sizes, and the module's training flag.
  std::vector<std::pair<int, c10::IValue>> fixed;
  // Tensor sizes: (argument, dim, lowest, highest, group, coef, offset). A dim of a group (>= 0)
  // is coef * s + offset for the group's symbol s: dims with coef 1 and offset 0 set s (and must
  // agree), the others must equal what s gives (2 * s0, s0 + 1).
  struct SizeCheck {
    int arg, dim;
    int64_t lo, hi;
    int group;
    int64_t coef = 1, offset = 0;
  };
  std::vector<SizeCheck> sizes;
  py::object module;  // None, or the nn.Module whose .training must equal `training`
  bool training = false;
  enum class Returns { kList, kTuple, kOne } returns = Returns::kList;  // kOne: the output itself
  // Outputs that alias a call argument or another output, given back as AOTAutograd gives them:
  // the argument itself, or an autograd view of the base (._base, shared version counter).
  enum class AliasKind { kViewOfInput = 0, kInput = 1, kViewOfOutput = 2 };
  struct Alias {
    int output;
    AliasKind kind;
    int base;  // argument index (after `bound`) or output index
  };
  std::vector<Alias> aliases;
  // Outputs whose dims Dynamo should treat as dynamic when they are fed to a later compile:
  // (output, set of dims), added to the tensor's `_dynamo_weak_dynamic_indices` as AOTAutograd's
  // runtime wrapper does (maybe_mark_dynamic_helper).
  std::vector<std::pair<int, py::object>> dynamic_dims;
  // torchreplay.capture: an argument the graph writes must not share memory with another
  // argument (the trace assumed it does not).
  bool check_overlap = false;
  // Set (by torchreplay.capture's module hooks) when the model the graph was traced from has
  // changed under it (a parameter, buffer or submodule replaced): every call raises this.
  std::string stale;
  // torchreplay.capture: the graph runs inference only, so with grad mode on these bound
  // tensors (parameters, buffers an output is computed from) are refused if they require grad:
  // eager's output would track them.
  std::vector<int> grad_checked;
  std::vector<std::string> bound_names;  // for errors: what each bound tensor is in the model
  // torchreplay.capture: the modules' train/eval modes are checked in Python (the slow path)
  // whenever any module's mode may have changed since the last check (ModuleModesEpoch).
  mutable int64_t modes_epoch = -1;
  // torchreplay.capture: takes the calls this one cannot (keywords, nested arguments or outputs,
  // another argument count, a size check that fails) in Python: it flattens the arguments, checks
  // what was specialized, picks the trace for these sizes and calls `Fast` (captured.py). None:
  // such calls raise here.
  py::object slow_path;
  bool always_slow = false;  // nested arguments or outputs: every call takes the slow path

  py::object operator()(const py::args& args, const py::kwargs& kwargs) const {
    if (!slow_path.is_none() && (always_slow || kwargs.size() != 0 || modes_epoch != ModuleModesEpoch())) {
      return slow_path(*args, **kwargs);
    }
    std::vector<c10::IValue> inputs;
    try {
      if (std::optional<py::object> done = CheckedInputs(args, kwargs, &inputs)) return *done;
    } catch (const py::value_error&) {  // another trace may hold for these sizes: Python decides
      if (slow_path.is_none()) throw;
      return slow_path(*args, **kwargs);
    } catch (const py::type_error&) {
      if (slow_path.is_none()) throw;
      return slow_path(*args, **kwargs);
    }
    return RunChecked(std::move(inputs), args);
  }

  // The type's tp_call (Note [The call path]): a call goes from the interpreter straight here,
  // with no method lookup and no pybind11 dispatch, also for Python subclasses (Captured), which
  // inherit the slot.
  static PyObject* TpCall(PyObject* self, PyObject* args, PyObject* kwargs) {
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

  // The call with the graph's own flat arguments, every check done here.
  py::object Fast(py::args args, py::kwargs kwargs) const {
    std::vector<c10::IValue> inputs;
    if (std::optional<py::object> done = CheckedInputs(args, kwargs, &inputs)) return *done;
    return RunChecked(std::move(inputs), args);
  }

  // The graph's inputs for a call, after every check (which raise ValueError or TypeError and
  // run nothing); or the call's result, when the fallback took it (an int beyond 64 bits).
  std::optional<py::object> CheckedInputs(const py::args& args, const py::kwargs& kwargs,
                                          std::vector<c10::IValue>* out) const {
    std::vector<c10::IValue>& inputs = *out;
    if (!stale.empty()) throw py::value_error(stale);
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
      if (!e.matches(PyExc_OverflowError) || fallback.is_none()) throw;
      return fallback(*args);
    }
    if (c10::GradMode::is_enabled()) {
      for (int i : grad_checked) {
        if (inputs[i].isTensor() && inputs[i].toTensor().requires_grad()) {
          throw py::value_error(absl::StrCat(
              "torchreplay: ", i < bound_names.size() ? bound_names[i] : absl::StrCat("bound input ", i),
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
    if (check_overlap) CheckOverlap(inputs);
    for (const auto& [i, want] : fixed) {
      const c10::IValue& got = inputs[bound.size() + i];
      const bool same = got.tagKind() == want.tagKind() &&
                        (got.isInt()    ? got.toInt() == want.toInt()
                         : got.isDouble() ? guards::SameFloat(got.toDouble(), want.toDouble())
                         : got.isBool()   ? got.toBool() == want.toBool()
                                          : true);
      if (!same) {
        throw py::value_error(absl::StrCat(
            "torchreplay: argument ", i, " is ", Describe(got), ", but the graph was captured with ",
            Describe(want), " there and computes with that value; capture again for another "
            "value (or capture with a tensor there)"));
      }
    }
    absl::InlinedVector<int64_t, 4> group_size;
    for (const SizeCheck& c : sizes) {
      const c10::IValue& v = inputs[bound.size() + c.arg];
      const auto& spec = engine->graph().values()[engine->graph().inputs()[bound.size() + c.arg]].spec;
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
        throw py::value_error(absl::StrCat(
            "torchreplay: argument ", c.arg, " has size ", size, " in dim ", c.dim, ", but ", why,
            " (the trace depends on it); capture again for this shape",
            c.lo == c.hi ? ", or with dynamic=True" : ""));
      }
    }
    static PyObject* const kTraining = PyUnicode_InternFromString("training");
    py::object now;
    if (!module.is_none()) {
      now = py::reinterpret_steal<py::object>(PyObject_GetAttr(module.ptr(), kTraining));
      if (!now) throw py::error_already_set();
    }
    if (now && PyObject_IsTrue(now.ptr()) != static_cast<int>(training)) {
      throw py::value_error(absl::StrCat(
          "torchreplay: the model was captured in ", training ? "train" : "eval", " mode and is now in ",
          training ? "eval" : "train", " mode (.train()/.eval() change what it computes); capture again"));
    }
    return std::nullopt;
  }

  py::object RunChecked(std::vector<c10::IValue> inputs, const py::args& args) const {
    for (int i : mutated) {
      const c10::IValue& v = inputs[bound.size() + i];
      if (v.isTensor()) v.toTensor().unsafeGetTensorImpl()->bump_version();
    }
    absl::InlinedVector<c10::IValue, 2> alias_bases;
    for (const Alias& a : aliases) {
      if (a.kind != AliasKind::kViewOfOutput) alias_bases.push_back(inputs[bound.size() + a.base]);
    }
    absl::StatusOr<std::vector<c10::IValue>> out;
    {
      py::gil_scoped_release no_gil;
      {
        c10::AutoGradMode no_grad(false);
        out = engine->Run(std::move(inputs));
      }
      if (out.ok() && !aliases.empty()) RegenerateAliases(alias_bases, *out);
    }
    if (!out.ok() && IsIntOverflow(out.status()) && !fallback.is_none() && mutated.empty()) {
      return fallback(*args);  // Python's ints have no bound: the graph run by Python gives eager's
    }
    if (!out.ok()) Throw(out.status());
    const size_t n = num_outputs < 0 ? out->size() : std::min<size_t>(num_outputs, out->size());
    py::list result = FromIValues<py::list>(*out, n);
    for (const auto& [i, dims] : dynamic_dims) {
      if (static_cast<size_t>(i) < n) MarkDynamic(result[i], dims);
    }
    if (returns == Returns::kOne && n == 1) return result[0];
    if (returns == Returns::kTuple) return py::tuple(result);
    return result;
  }

  // t._dynamo_weak_dynamic_indices |= dims, or a copy of dims when t has none yet.
  static void MarkDynamic(py::handle t, const py::object& dims) {
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

  // Raises if an argument the graph writes shares memory with another argument.
  void CheckOverlap(const std::vector<c10::IValue>& inputs) const {
    auto span = [](const at::Tensor& t) {  // bytes of its storage the tensor can reach
      int64_t hi = t.storage_offset();
      for (int64_t d = 0; d < t.dim(); ++d) hi += (t.size(d) - 1) * std::abs(t.stride(d));
      return std::make_pair(t.storage_offset() * t.itemsize(), (hi + 1) * t.itemsize());
    };
    for (int i : mutated) {
      const c10::IValue& a = inputs[bound.size() + i];
      if (!a.isTensor() || !a.toTensor().has_storage() || a.toTensor().numel() == 0) continue;
      const at::Tensor& w = a.toTensor();
      for (size_t j = bound.size(); j < inputs.size(); ++j) {
        if (static_cast<int>(j - bound.size()) == i || !inputs[j].isTensor()) continue;
        const at::Tensor& o = inputs[j].toTensor();
        if (!o.defined() || !o.has_storage() || o.numel() == 0 ||
            !o.storage().is_alias_of(w.storage())) {
          continue;
        }
        const auto [wl, wh] = span(w);
        const auto [ol, oh] = span(o);
        if (wl < oh && ol < wh) {
          throw py::value_error(absl::StrCat(
              "torchreplay: argument ", i, " is written by the graph and shares memory with argument ",
              j - bound.size(), "; the capture assumed separate tensors (pass a clone of one of them)"));
        }
      }
    }
  }

  void RegenerateAliases(const absl::InlinedVector<c10::IValue, 2>& input_bases,
                         std::vector<c10::IValue>& out) const {
    size_t k = 0;
    for (const Alias& a : aliases) {
      const c10::IValue& base_value = a.kind == AliasKind::kViewOfOutput ? out[a.base] : input_bases[k++];
      c10::IValue& o = out[a.output];
      if (!o.isTensor() || !base_value.isTensor()) continue;
      if (a.kind == AliasKind::kInput) {
        o = base_value;
        continue;
      }
      const at::Tensor& base = base_value.toTensor();
      const at::Tensor& t = o.toTensor();
      const at::Tensor typed = t.scalar_type() == base.scalar_type() ? base : base.view(t.scalar_type());
      o = typed.as_strided(t.sizes(), t.strides(), t.storage_offset());
    }
  }
};

replay::LogLevel ToLogLevel(int level) {
  if (level < 0 || level > 3) {
    throw py::value_error("torchreplay: log level must be 0 (debug), 1 (info), 2 (warning) or 3 (error)");
  }
  return static_cast<replay::LogLevel>(level);
}

py::dict StatsToDict(const replay::EngineStats& s) {
  py::dict d;
  d["calls"] = s.calls;
  d["replays"] = s.replays;
  d["captures"] = s.captures;
  d["warmups"] = s.warmups;
  d["eager_fallbacks"] = s.eager_fallbacks;
  d["misses"] = s.misses;
  d["evictions"] = s.evictions;
  d["cache_entries"] = s.cache_entries;
  d["last_miss"] = s.last_miss;
  d["pool_bytes"] = s.pool_bytes;
  d["handed_out"] = s.handed_out;
  d["errors"] = s.errors;
  d["last_error"] = s.last_error;
  py::list log;
  for (const auto& c : s.capture_log) {
    py::dict r;
    r["key"] = c.key;
    r["reason"] = c.reason;
    r["milliseconds"] = c.milliseconds;
    const capture::CaptureInfo& i = c.info;
    r["nodes"] = i.nodes;
    r["steps"] = i.steps;
    r["out_variant_steps"] = i.out_variant_steps;
    r["typed_steps"] = i.typed_steps;
    r["prepared_steps"] = i.prepared_steps;
    r["fused_steps"] = i.fused_steps;
    r["fused_nodes"] = i.fused_nodes;
    r["functional_steps"] = i.functional_steps;
    r["precomputed"] = i.precomputed;
    r["arena_bytes"] = i.arena_bytes;
    r["tensor_bytes"] = i.tensor_bytes;
    r["functional_ops"] = i.functional_ops;
    log.append(r);
  }
  d["capture_log"] = log;
  d["fallback_reasons"] = s.fallback_reasons;
  return d;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "torchreplay C++ runtime: graph IR, interpreter and replay engine";

  py::class_<capture::Graph, std::shared_ptr<capture::Graph>>(m, "Graph")
      .def("__str__", &capture::Graph::ToString)
      .def_property_readonly("num_nodes", [](const capture::Graph& g) { return g.nodes().size(); })
      .def_property_readonly("num_inputs", [](const capture::Graph& g) { return g.inputs().size(); })
      .def_property_readonly("static_inputs", &capture::Graph::static_inputs);

  py::class_<capture::GraphBuilder>(m, "GraphBuilder")
      .def(py::init<>())
      .def("add_input",
           [](capture::GraphBuilder& b, const std::string& name, const std::string& type,
              py::object dtype, py::object device, py::object dim) {
             std::optional<capture::TensorSpec> spec;
             if (!dtype.is_none()) {
               spec = capture::TensorSpec{
                   reinterpret_cast<THPDtype*>(dtype.ptr())->scalar_type,
                   reinterpret_cast<THPDevice*>(device.ptr())->device.type(), dim.cast<int64_t>()};
             }
             return b.AddInput(name, ValueTypeFromName(type), spec);
           },
           py::arg("name"), py::arg("type"), py::arg("dtype") = py::none(),
           py::arg("device") = py::none(), py::arg("dim") = py::none())
      .def("add_op",
           [](capture::GraphBuilder& b, const std::string& op, py::list args, py::dict kwargs,
              const std::string& name) {
             std::vector<capture::Arg> a;
             for (auto x : args) a.push_back(ToArg(x));
             std::vector<std::pair<std::string, capture::Arg>> kw;
             for (auto [k, v] : kwargs) kw.emplace_back(k.cast<std::string>(), ToArg(v));
             return Unwrap(b.AddOp(op, std::move(a), std::move(kw), name));
           },
           py::arg("op"), py::arg("args"), py::arg("kwargs"), py::arg("name") = "")
      .def("add_getitem",
           [](capture::GraphBuilder& b, int list, int64_t index, const std::string& name) {
             return Unwrap(b.AddGetItem(list, index, name));
           })
      .def("add_sym",
           [](capture::GraphBuilder& b, const std::string& op, py::list operands,
              const std::string& name) {
             std::vector<capture::Arg> a;
             for (auto x : operands) a.push_back(ToArg(x));
             return Unwrap(b.AddSymArith(Unwrap(capture::SymOpFromName(op)), std::move(a), name));
           })
      .def("set_outputs",
           [](capture::GraphBuilder& b, py::list outs) {
             std::vector<capture::Arg> a;
             for (auto x : outs) a.push_back(ToArg(x));
             if (auto s = b.SetOutputs(std::move(a)); !s.ok()) Throw(s);
           })
      .def("set_static_inputs",
           [](capture::GraphBuilder& b, std::vector<int> idx) {
             if (auto s = b.SetStaticInputs(std::move(idx)); !s.ok()) Throw(s);
           })
      .def("build", [](capture::GraphBuilder& b) {
        return std::const_pointer_cast<capture::Graph>(Unwrap(b.Build()));
      });

  py::class_<replay::EngineOptions> options(
      m, "EngineOptions",
      "Every setting of an engine, by name: EngineOptions(mode='reduce-overhead', warmup_iters=1, "
      "capture_limit=64, cache_limit=256, clone_outputs=False, preserve_outputs=False, name='graph', bound_inputs=0, "
      "dump_dir='', prepared_steps=True, fuse_elementwise=True, log_level=2, capture_sizes=[], "
      "batch_inputs=[], batch_size_inputs=[], batch_outputs=[]). Unset fields take the defaults, "
      "with the environment's switches (TORCHREPLAY_PREPARED_ITERATORS, TORCHREPLAY_FUSE, "
      "TORCHREPLAY_LOG_LEVEL) applied.");
  options
      .def(py::init([](py::kwargs fields) {
        py::object o = py::cast(replay::EngineOptions::Defaults());
        for (auto [key, value] : fields) {
          const std::string k = key.cast<std::string>();
          if (k.rfind("_", 0) == 0 || !py::hasattr(o, k.c_str())) {
            throw py::type_error("torchreplay: EngineOptions has no field '" + k + "'");
          }
          o.attr(k.c_str()) = value;
        }
        return o.cast<replay::EngineOptions>();
      }))
      .def_property(
          "mode",
          [](const replay::EngineOptions& o) {
            return o.mode == replay::Mode::kDefault ? "default" : "reduce-overhead";
          },
          [](replay::EngineOptions& o, const std::string& mode) {
            if (mode == "default") {
              o.mode = replay::Mode::kDefault;
            } else if (mode == "reduce-overhead") {
              o.mode = replay::Mode::kReduceOverhead;
            } else {
              throw py::value_error("torchreplay: unknown mode '" + mode + "'");
            }
          })
      .def_readwrite("clone_outputs", &replay::EngineOptions::clone_outputs)
      .def_readwrite("preserve_outputs", &replay::EngineOptions::preserve_outputs)
      .def_readwrite("name", &replay::EngineOptions::name)
      .def_readwrite("dump_dir", &replay::EngineOptions::dump_dir)
      .def_readwrite("prepared_steps", &replay::EngineOptions::prepared_steps)
      .def_readwrite("fuse_elementwise", &replay::EngineOptions::fuse_elementwise)
      .def_property(
          "capture_sizes", [](const replay::EngineOptions& o) { return o.capture_sizes; },
          [](replay::EngineOptions& o, std::vector<int64_t> sizes) {
            for (int64_t n : sizes) {
              if (n < 1) throw py::value_error("torchreplay: capture_sizes must be >= 1");
            }
            std::sort(sizes.begin(), sizes.end());
            sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());
            o.capture_sizes = std::move(sizes);
          })
      .def_readwrite("batch_inputs", &replay::EngineOptions::batch_inputs)
      .def_readwrite("batch_size_inputs", &replay::EngineOptions::batch_size_inputs)
      .def_readwrite("batch_outputs", &replay::EngineOptions::batch_outputs)
      .def_property(
          "log_level", [](const replay::EngineOptions& o) { return static_cast<int>(o.log_level); },
          [](replay::EngineOptions& o, int level) { o.log_level = ToLogLevel(level); })
      .def("__repr__", [](py::object o) {
        std::vector<std::string> parts;
        for (const char* f : {"mode", "warmup_iters", "capture_limit", "cache_limit", "clone_outputs",
                              "preserve_outputs", "name", "bound_inputs", "dump_dir",
                              "prepared_steps", "fuse_elementwise", "log_level", "capture_sizes", "batch_inputs",
                              "batch_size_inputs", "batch_outputs"}) {
          parts.push_back(absl::StrCat(f, "=", py::repr(o.attr(f)).cast<std::string>()));
        }
        return absl::StrCat("EngineOptions(", absl::StrJoin(parts, ", "), ")");
      });
  for (const auto& [name, field, least] :
       {std::tuple{"warmup_iters", &replay::EngineOptions::warmup_iters, 0},
        std::tuple{"capture_limit", &replay::EngineOptions::capture_limit, 0},
        std::tuple{"cache_limit", &replay::EngineOptions::cache_limit, 1},
        std::tuple{"bound_inputs", &replay::EngineOptions::bound_inputs, 0}}) {
    options.def_property(
        name, [field = field](const replay::EngineOptions& o) { return o.*field; },
        [name = std::string(name), field = field, least = least](replay::EngineOptions& o, int n) {
          if (n < least) {
            throw py::value_error(absl::StrCat("torchreplay: ", name, " must be >= ", least));
          }
          o.*field = n;
        });
  }

  py::class_<replay::Engine, std::shared_ptr<replay::Engine>>(m, "Engine")
      .def(py::init([](std::shared_ptr<capture::Graph> g, std::optional<replay::EngineOptions> o) {
             return std::make_shared<replay::Engine>(std::move(g),
                                                     o.value_or(replay::EngineOptions::Defaults()));
           }),
           py::arg("graph"), py::arg("options") = py::none())
      .def("run",
           [](replay::Engine& e, py::list args) {
             std::vector<c10::IValue> inputs;
             inputs.reserve(args.size());
             for (auto a : args) inputs.push_back(ToIValue(a));
             PyList_SetSlice(args.ptr(), 0, PyList_GET_SIZE(args.ptr()), nullptr);  // boxed call
             absl::StatusOr<std::vector<c10::IValue>> out;
             {
               py::gil_scoped_release no_gil;
               out = e.Run(std::move(inputs));
             }
             if (!out.ok()) Throw(out.status());
             return FromIValues<py::list>(*out, out->size());
           })
      .def("precapture",
           [](replay::Engine& e, const std::vector<py::list>& input_sets) {
             std::vector<std::vector<c10::IValue>> sets;
             for (const auto& l : input_sets) {
               std::vector<c10::IValue> inputs;
               for (auto a : l) inputs.push_back(ToIValue(a));
               sets.push_back(std::move(inputs));
             }
             absl::Status s;
             {
               py::gil_scoped_release no_gil;
               s = e.Precapture(std::move(sets));
             }
             if (!s.ok()) Throw(s);
           },
           py::arg("input_sets"),
           "Warms up and captures these inputs' keys ahead of time, largest first.")
      .def("profile",
           [](replay::Engine& e, py::list args, int iterations) {
             std::vector<c10::IValue> inputs;
             for (auto a : args) inputs.push_back(ToIValue(a));
             absl::StatusOr<std::vector<capture::StepTime>> rows;
             {
               py::gil_scoped_release no_gil;
               c10::AutoGradMode no_grad(false);
               rows = e.ProfileSteps(std::move(inputs), iterations);
             }
             if (!rows.ok()) Throw(rows.status());
             py::list out;
             for (const auto& r : *rows) {
               py::dict d;
               d["node"] = r.node;
               d["op"] = r.op;
               d["kind"] = r.kind;
               d["shapes"] = r.shapes;
               d["us"] = r.us;
               out.append(d);
             }
             return out;
           },
           py::arg("inputs"), py::arg("iterations") = 200,
           "Per step of the replay of these inputs' key (captured first if needed): node, op, kind, "
           "shapes and mean microseconds over `iterations` replays.")
      .def("stats", [](const replay::Engine& e) { return StatsToDict(e.stats()); })
      .def_property_readonly("name", [](const replay::Engine& e) { return e.options().name; })
      .def_property_readonly("options", [](const replay::Engine& e) { return e.options(); });

  py::class_<Call>(m, "Call", "One compiled graph as a C++ callable (Note [The call path]).",
                   py::custom_type_setup([](PyHeapTypeObject* type) { type->ht_type.tp_call = &Call::TpCall; }))
      .def(py::init([](std::shared_ptr<replay::Engine> engine, py::list bound, std::vector<int> mutated,
                       int num_outputs, py::object fallback, py::dict fixed, const std::string& returns,
                       const std::vector<std::tuple<int, int, int>>& aliases,
                       const std::vector<std::tuple<int, int, int64_t, int64_t, int, int64_t, int64_t>>& sizes,
                       py::object module, bool check_overlap,
                       const std::vector<std::pair<int, py::object>>& dynamic_dims,
                       std::vector<int> grad_checked, std::vector<std::string> bound_names,
                       py::object slow_path, bool always_slow) {
             Call c{std::move(engine), {}, std::move(mutated), num_outputs, std::move(fallback)};
             if (returns == "tuple") {
               c.returns = Call::Returns::kTuple;
             } else if (returns == "one") {
               c.returns = Call::Returns::kOne;
             } else if (returns != "list") {
               throw py::value_error("torchreplay: returns must be 'list', 'tuple' or 'one'");
             }
             for (auto b : bound) c.bound.push_back(ToIValue(b));
             const int n_args = static_cast<int>(c.engine->graph().inputs().size() - c.bound.size());
             for (const auto& [arg, dim, lo, hi, group, coef, offset] : sizes) {
               if (arg < 0 || arg >= n_args || dim < 0) throw py::value_error("torchreplay: size check out of range");
               c.sizes.push_back({arg, dim, lo, hi, group, coef, offset});
             }
             c.module = std::move(module);
             c.check_overlap = check_overlap;
             for (int i : grad_checked) {
               if (i < 0 || i >= static_cast<int>(c.bound.size())) throw py::value_error("torchreplay: grad_checked out of range");
             }
             c.grad_checked = std::move(grad_checked);
             c.bound_names = std::move(bound_names);
             c.slow_path = std::move(slow_path);
             c.always_slow = always_slow && !c.slow_path.is_none();
             for (const auto& [o, dims] : dynamic_dims) {
               if (o < 0) throw py::value_error("torchreplay: dynamic_dims output out of range");
               c.dynamic_dims.emplace_back(o, py::reinterpret_steal<py::object>(PyFrozenSet_New(dims.ptr())));
               if (!c.dynamic_dims.back().second) throw py::error_already_set();
             }
             if (!c.module.is_none()) c.training = c.module.attr("training").cast<bool>();
             for (const auto& [o, kind, base] : aliases) {
               if (kind < 0 || kind > 2) throw py::value_error("torchreplay: alias kind must be 0, 1 or 2");
               c.aliases.push_back({o, static_cast<Call::AliasKind>(kind), base});
             }
             for (auto [i, v] : fixed) c.fixed.emplace_back(i.cast<int>(), ToIValue(v));
             for (int i : c.mutated) {
               if (i < 0 || i >= n_args) throw py::value_error("torchreplay: mutated index out of range");
             }
             for (const auto& f : c.fixed) {
               if (f.first < 0 || f.first >= n_args) throw py::value_error("torchreplay: fixed index out of range");
             }
             return c;
           }),
           py::arg("engine"), py::arg("bound") = py::list(), py::arg("mutated") = std::vector<int>(),
           py::arg("num_outputs") = -1, py::arg("fallback") = py::none(), py::arg("fixed") = py::dict(),
           py::arg("returns") = "list",
           py::arg("aliases") = std::vector<std::tuple<int, int, int>>(),
           py::arg("sizes") = std::vector<std::tuple<int, int, int64_t, int64_t, int, int64_t, int64_t>>(),
           py::arg("module") = py::none(), py::arg("check_overlap") = false,
           py::arg("dynamic_dims") = std::vector<std::pair<int, py::object>>(),
           py::arg("grad_checked") = std::vector<int>(), py::arg("bound_names") = std::vector<std::string>(),
           py::arg("slow_path") = py::none(),
           py::arg("always_slow") = false)
      .def("_fast", &Call::Fast, "The call on the graph's flat arguments, with no slow path.")
      .def("_modes_checked", [](const Call& c, int64_t epoch) { c.modes_epoch = epoch; },
           "The modules' modes were found as captured at `epoch` (module_modes_epoch()).")
      .def("_set_stale", [](Call& c, const std::string& why) { c.stale = why; },
           "Makes every later call raise ValueError(why) (the model changed under the capture).")
      .def_property_readonly("engine", [](const Call& c) { return c.engine; });

  m.def("module_modes_changed", [] { g_module_modes_epoch.fetch_add(1, std::memory_order_relaxed); },
        "Called by nn.Module.train (wrapped by torchreplay.capture): some module's mode may have changed.");
  m.def("module_modes_epoch", &ModuleModesEpoch);
  m.def("built_with_cuda", &capture::BuiltWithCuda);
  m.def("_testing_fail_allocations", &memory_pool::FailAllocationsForTesting, py::arg("n"),
        "Test-only: the next n arena growths raise torch.OutOfMemoryError (0: off).");
  m.def("set_log_level", [](int level) { replay::SetLogLevel(ToLogLevel(level)); });
  m.def("log_level", [] { return static_cast<int>(replay::DefaultLogLevel()); });
}

}  // namespace torchreplay
