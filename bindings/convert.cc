// Conversions between Python and IValues, and statuses raised as Python exceptions.
#include "bindings/convert.h"

#include <torch/csrc/Device.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Layout.h>
#include <torch/csrc/MemoryFormat.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/api/object.h>

#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "capture/ir/interpreter.h"

namespace torchreplay {

bool IsIntOverflow(const absl::Status& s) { return capture::ErrorType(s) == "OverflowError"; }

[[noreturn]] void Throw(const absl::Status& s) {
  // An op that went to Python code (a Python kernel or decomposition) and raised there leaves
  // that error set: it is the call's error, with the type and message eager gives.
  if (PyErr_Occurred() != nullptr) throw py::error_already_set();
  // A kernel's error, as eager raises it (Note [Kernel errors keep their type]).
  if (const std::string type = capture::ErrorType(s); !type.empty()) {
    static const std::pair<const char*, PyObject*> kBuiltins[] = {
        {"OverflowError", PyExc_OverflowError},
        {"IndexError", PyExc_IndexError},   {"ValueError", PyExc_ValueError},
        {"TypeError", PyExc_TypeError},     {"NotImplementedError", PyExc_NotImplementedError},
        {"BufferError", PyExc_BufferError},
    };
    py::object exc;
    for (const auto& [name, builtin] : kBuiltins) {
      if (type == name) exc = py::reinterpret_borrow<py::object>(builtin);
    }
    if (!exc) {  // torch's own: torch.OutOfMemoryError, torch.AcceleratorError, torch.linalg.LinAlgError
      py::object torch = py::module_::import("torch");
      exc = type == "LinAlgError" ? torch.attr("linalg").attr("LinAlgError")
                                  : py::getattr(torch, type.c_str(), py::none());
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
  // A TorchScript object (packed quantized weights: Note [Packed quantized Linears] in packed.py).
  if (py::isinstance<torch::jit::Object>(obj)) return obj.cast<torch::jit::Object>()._ivalue();
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
    // TorchScript objects of one class (a quantized LSTM's packed cells), as a list of that class
    bool all_object = true;
    for (auto item : seq) all_object = all_object && py::isinstance<torch::jit::Object>(item);
    if (all_object) {
      c10::impl::GenericList v(seq[0].cast<torch::jit::Object>()._ivalue()->type());
      for (auto item : seq) {
        auto object = item.cast<torch::jit::Object>()._ivalue();
        if (!object->type()->isSubtypeOf(*v.elementType())) break;
        v.push_back(std::move(object));
      }
      if (v.size() == seq.size()) return v;
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

}  // namespace torchreplay
