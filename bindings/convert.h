// bindings/convert.h: Python values to and from IValues, statuses to Python exceptions: what
// every binding of torchreplay._C shares.
#pragma once

#include <pybind11/pybind11.h>
#include <ATen/core/ivalue.h>

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace torchreplay {
namespace py = pybind11;

// An int of the graph that left int64 (where Python's would not): the call may be run by Python
// instead (an error of type OverflowError, capture/ir/interpreter.h).
bool IsIntOverflow(const absl::Status& s);

// Raises `s` as Python would raise it: an error Python code set, the exception eager raises for
// a kernel's error (Note [Kernel errors keep their type]), ValueError for bad arguments, else
// RuntimeError.
[[noreturn]] void Throw(const absl::Status& s);

template <typename T>
T Unwrap(absl::StatusOr<T> v) {
  if (!v.ok()) Throw(v.status());
  return std::move(*v);
}

// A Python int as int64, or a clear OverflowError (graphs and kernels take 64-bit integers).
int64_t ToInt64(PyObject* o);

// A Python value as an IValue: None, tensors, bools, ints, floats, strings, dtypes, devices,
// layouts, memory formats, complex numbers, and lists of one kind of them. TypeError otherwise.
c10::IValue ToIValue(py::handle obj);

// An IValue as a Python value (tensors, None, numbers, lists of tensors).
py::object FromIValue(const c10::IValue& v);

// The first n values as a Python list or tuple.
template <typename Seq>
Seq FromIValues(const std::vector<c10::IValue>& values, size_t n) {
  Seq seq(n);
  for (size_t i = 0; i < n; ++i) seq[i] = FromIValue(values[i]);
  return seq;
}


}  // namespace torchreplay
