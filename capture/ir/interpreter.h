// capture/ir/interpreter.h: runs a Graph op by op through the dispatcher (boxed calls).
//
// This is the "default" mode's executor, the eager reference every replay is compared with, and
// the warm-up run that records what a capture needs to know.
#pragma once

#include <ATen/core/ivalue.h>

#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "capture/ir/graph.h"

namespace torchreplay::capture {

// Checks a call's inputs against the graph: count, kind, and for tensors dtype, device and rank.
// With `bound` > 0 the first `bound` inputs are fixed by the caller (torchreplay.capture's
// parameters), and errors name the others as "argument i", counted after them.
absl::Status CheckInputs(const Graph& graph, const std::vector<c10::IValue>& inputs, int bound = 0);

// The runtime value of `arg` for a parameter of schema type `type`, looked up in `env`.
c10::IValue MaterializeArg(const Arg& arg, const c10::TypePtr& type,
                           const std::vector<c10::IValue>& env);

// Evaluates symbolic arithmetic with Python's semantics (`b` is ignored by one-operand ops).
// InvalidArgument for division by zero and for operands that are not int, float or bool;
// OutOfRange of type OverflowError (ErrorType) when an int result leaves int64 (Python's ints
// have no bound).
absl::StatusOr<c10::IValue> EvalSymArith(SymOp op, const c10::IValue& a, const c10::IValue& b = {});

// Note [Kernel errors keep their type]
// Eager raises a kernel's c10 error as the Python exception torch maps its class to
// (c10::IndexError: IndexError, c10::NotImplementedError: NotImplementedError, ...). A c10 error
// caught while a graph runs becomes an Internal status that keeps that name in the payload
// kErrorType, and WithContext prefixes a status's message keeping its payloads, so the binding
// raises what eager raises (bindings/module.cc, Throw).
inline constexpr char kErrorType[] = "torchreplay/python-error-type";
absl::Status KernelError(const c10::Error& e, absl::string_view context);
absl::Status WithContext(const absl::Status& s, absl::string_view prefix);
// The Python exception `s` stands for ("IndexError", "OverflowError", ...), or "" for none.
std::string ErrorType(const absl::Status& s);
// KernelError's inverse for C++ callers (a loaded program's Run): throws the c10::Error subclass
// whose name `s` keeps, with its message; returns when it keeps none.
void ThrowKernelError(const absl::Status& s);

class Interpreter {
 public:
  // Called before and after each node (either may be empty) with the node's index and the
  // environment (values by id).
  struct Observer {
    std::function<void(int node, const std::vector<c10::IValue>& env)> before, after;
  };

  explicit Interpreter(std::shared_ptr<const Graph> graph);

  // Runs the graph on `inputs` (by position). Values are freed after their last use unless an
  // observer is given, or the graph has multi-stream scopes and runs on CUDA (scopes.h), in which
  // case every value stays alive until the run ends. The run is in
  // a ScopeRun of the inputs' CUDA device, if any (scopes.h): the one place scopes are opened.
  absl::StatusOr<std::vector<c10::IValue>> Run(std::vector<c10::IValue> inputs,
                                               const Observer* observer = nullptr) const;

  const Graph& graph() const { return *graph_; }

  // The device of the first CUDA tensor among `inputs`, else nullopt.
  static std::optional<c10::Device> CudaDevice(const std::vector<c10::IValue>& inputs);

 private:
  std::shared_ptr<const Graph> graph_;
  std::vector<std::vector<ValueId>> free_after_;  // per node: values whose last use it is
  bool scoped_ = false;  // has multi-stream scopes: on CUDA, values are held until the run ends
};

}  // namespace torchreplay::capture
