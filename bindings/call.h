// bindings/call.h: one compiled graph as a C++ callable (Note [The call path]): what every call
// does, AOTAutograd's runtime epilogue (torch.compile), and torchreplay.capture's per-call checks,
// each a typed part built from Python by name.
//
// Ownership: a Call shares its engine (the compiled function or Captured that holds the Call owns
// it, with the engine's registry holding it weakly); it holds the bound tensors (parameters,
// buffers) strongly, as the model does; the Python callables it keeps (fallback, slow path,
// hazard_check) must not hold the Call (captured.py hands a weak reference), or the cycle
// through C++ is never freed.
#pragma once

#include <pybind11/pybind11.h>
#include <ATen/core/ivalue.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "replay/engine.h"
#include "replay/call_checks.h"

namespace torchreplay {
namespace py = pybind11;

// Note [The call path]
// For an inference graph, torch.compile hands Dynamo a Call instead of AOTAutograd's runtime
// wrapper around a Python function: Dynamo's bytecode calls straight into C++ with the call's
// arguments as they are (no boxed list, no Python frame of ours). backend.py builds one only when
// that wrapper would do nothing beyond what a Call does: bump the version counters of the inputs
// the graph mutates, run with grad mode off, give outputs aliasing an input back as the input or
// an autograd view of it, drop the graph's extra outputs (intermediate bases of aliased outputs),
// and mark outputs' dynamic dims for later compiles (dynamic=True graphs): the AotEpilogue.
// torchreplay.capture uses it too, with the model's parameters and buffers bound once ahead of
// the call's arguments, and the checks of what its trace assumed: the CaptureChecks. The type's
// tp_call is the call itself (no method lookup, no pybind11 dispatch), also for Python subclasses
// (Captured), which inherit the slot.

// How outputs are returned: the list, a tuple, or the one output itself.
enum class Returns { kList, kTuple, kOne };

// An output that aliases a call argument or another output, given back as AOTAutograd gives it:
// the argument itself, an autograd view of the base (._base, shared version counter), or the
// argument detached (`return loss.detach()`: shared memory and version counter, no ._base).
enum class AliasKind { kViewOfInput, kInput, kViewOfOutput, kDetachOfInput };
struct Alias {
  int output = 0;
  AliasKind kind = AliasKind::kViewOfInput;
  int base = 0;  // argument index (after the bound inputs) or output index
};

// What AOTAutograd's runtime wrapper would do after the graph runs (torch.compile).
struct AotEpilogue {
  std::vector<Alias> aliases;
  // Outputs whose dims Dynamo should treat as dynamic when they are fed to a later compile:
  // (output, frozenset of dims), added to the tensor's `_dynamo_weak_dynamic_indices` as
  // AOTAutograd's runtime wrapper does (maybe_mark_dynamic_helper).
  std::vector<std::pair<int, py::object>> dynamic_dims;
  // Takes a call whose ints leave 64 bits (an argument, or the graph's own int arithmetic when it
  // writes no input): Python's ints have no bound. None: the OverflowError propagates.
  py::object fallback = py::none();
  // A graph with loss.backward() traced into it (Note [Traced backward] in training_guards.py): the
  // arguments its backward differentiates. One for which BackwardHazards is not 0 is handed to
  // hazard_check(argument index, tensor), which raises if the traced backward would differ from
  // eager's for it.
  std::vector<int> grad_leaves;
  py::object hazard_check = py::none();
  // A traced backward differentiates the leaves it was traced with (Note [Leaves' requires_grad]
  // in training_guards.py): an argument that is a leaf requiring grad now and was not one then, or the
  // reverse, is handed to hazard_check too. Per argument: whether it was such a leaf.
  bool leaves_fixed = false;
  std::vector<bool> leaf_mask;
  // A graph compiled with grad mode on: the arguments that are module parameters not requiring
  // grad then, with their names. One that requires grad now, with grad mode on, raises (its
  // gradient would be skipped: the outputs do not track it; Note [Leaves' requires_grad]).
  std::vector<int> frozen;
  std::vector<std::string> frozen_names;
};

// What a traced backward (Note [Traced backward]) does not do for this tensor, as bits: 1 it has
// a grad_fn (autograd's graph goes on outside the compiled graph), 2 hooks registered on it (or
// once registered: the Python dict may be empty now), 4 post-accumulate-grad hooks (likewise),
// 8 hooks on its gradient accumulator (DistributedDataParallel's; also once removed, for hooks
// registered from Python). 0 for tensors not requiring grad.
int BackwardHazards(const at::Tensor& t);

// Whether t is a leaf whose gradient a backward computes: it requires grad and has no grad_fn.
inline bool IsGradLeaf(const at::Tensor& t) { return t.defined() && t.requires_grad() && t.is_leaf(); }

// The error of a call that reaches graph `graph` with argument i (`what`) requiring grad where it
// did not when the graph was compiled (Note [Leaves' requires_grad]).
std::string RequiresGradSinceCompiled(const std::string& graph, int i, const std::string& what);

// Note [Leaves' requires_grad] (backend.py): the guard torch.compile checks on every call of a
// graph compiled with grad mode on, before the graph runs: the module parameters it takes still
// require grad as they did when it was compiled. Called as Dynamo's lambda guards are, with the
// frame's locals (unread); True while they do, False (Dynamo recompiles) once one changed. It
// holds the parameters as the graph's captures do (baked static inputs): a flag read per
// parameter, no reference count touched (a weak reference's lock cost ~35 ns a parameter).
struct RequiresGradGuard {
  // Weak: Dynamo keeps a frame's guards past torch._dynamo.reset(), and a strong reference here
  // kept every compiled training model's parameters alive. A parameter gone fails the guard.
  std::vector<c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>> tensors;
  std::vector<bool> requires_grad;  // per tensor, when the graph was compiled

  bool Holds() const;
  // The tensors whose requires_grad changed since.
  std::vector<int> Changed() const;
  static PyObject* TpCall(PyObject* self, PyObject* args, PyObject* kwargs);
};

// Note [What a trace was made under]
// Process state that decides which ops a trace records, where Note [Ambient state] is about which
// kernels run them: the default dtype (the model's factories without a dtype make tensors of it),
// scaled_dot_product_attention's backend switches (torch.nn.attention.sdpa_kernel; the CPU
// records the flash op or the math decomposition) and autocast per device (the casts it inserts
// become nodes; the engine runs a graph with autocast off; torchreplay.capture refuses to trace
// under autocast, so its calls under it run the model eagerly), and torch.backends.mha's fast-path
// switch (Note [Transformer fast paths] in fast_paths.py: a Python global, held by captured.py's
// trace state, not here; its setter makes every capture check). A graph recorded under one is
// another program than eager's under another. torchreplay.capture checks it on every call and traces again under
// another (captured.py); torch.compile's Dynamo guards the default dtype, and the backend adds
// SdpaGuard to the frames whose graph has an attention (backend.py). A loaded program's graph is
// fixed: it computes what it recorded.
struct TraceState {
  c10::ScalarType default_dtype = c10::ScalarType::Float;
  uint8_t sdpa = 0;  // a bit each: flash, memory-efficient, math, cuDNN enabled; fp16/bf16 reduction in math
  // per device (CPU, CUDA): autocast's lower-precision dtype, or Undefined when it is off
  c10::ScalarType autocast_cpu = c10::ScalarType::Undefined, autocast_cuda = c10::ScalarType::Undefined;

  static TraceState Now();
  static uint8_t SdpaNow();
  bool operator==(const TraceState& o) const {
    return default_dtype == o.default_dtype && sdpa == o.sdpa && autocast_cpu == o.autocast_cpu &&
           autocast_cuda == o.autocast_cuda;
  }
  bool operator!=(const TraceState& o) const { return !(*this == o); }
};

// Dynamo's guard on the SDPA switches of a frame whose graph has an attention (Note [What a trace
// was made under]): called with anything, True while they are as when built.
struct SdpaGuard {
  uint8_t sdpa = TraceState::SdpaNow();
  bool Holds() const { return sdpa == TraceState::SdpaNow(); }
  static PyObject* TpCall(PyObject* self, PyObject* args, PyObject* kwargs);
};

using replay::SizeCheck;
using replay::StrideCheck;

// What torchreplay.capture's trace assumed, checked every call before anything runs (ValueError or
// TypeError), plus the way to its Python slow path.
struct CaptureChecks {
  std::vector<std::pair<int, c10::IValue>> fixed;  // Python numbers: (argument, value)
  std::vector<SizeCheck> sizes;
  std::vector<StrideCheck> strides;  // a call with others takes the slow path, which traces again
  py::object module = py::none();  // None, or the nn.Module whose .training must equal `training`
  bool training = false;
  // Bound tensors (parameters, buffers an output is computed from) refused if they require grad
  // while grad mode is on: the graph runs inference only, and eager's output would track them.
  std::vector<int> grad_checked;
  // Per bound tensor, the tensor whose requires_grad stands for it (a DTensor parameter for its
  // local shard, which never requires grad); undefined: the bound tensor itself.
  std::vector<at::Tensor> grad_owners;
  std::vector<std::string> bound_names;  // for errors: what each bound tensor is in the model
  // Per bound input, the sizes of its tensor when the Call was built (empty for other values): a
  // parameter given data of other sizes since (`p.data = t`) is refused, since the trace read them.
  std::vector<std::vector<int64_t>> bound_sizes;
  // Takes the calls the fast path cannot (keywords, nested arguments or outputs, another argument
  // count, a size check that fails) in Python: it flattens the arguments, checks what was
  // specialized, picks the trace for these sizes and calls Call::Fast (captured.py).
  py::object slow_path = py::none();
  bool always_slow = false;  // nested arguments or outputs: every call takes the slow path
  // Set (by the module hooks) when the model changed under the capture: every call raises it.
  std::string stale;
  // The modules' modes were last checked (in Python) at this count of nn.Module.train calls.
  mutable int64_t modes_epoch = -1;
  // What the trace was made under: a call under another state takes the slow path, which traces
  // again under it (Note [What a trace was made under]).
  TraceState traced = TraceState::Now();
  // (bound input, requires_grad then) of the parameters whose requires_grad decided how a matmul
  // was traced (Note [Matmuls folded as eager folds them]): a call after one changed takes the
  // slow path, which traces again.
  std::vector<std::pair<int, bool>> grad_traced;
  // Pairs of arguments that were one tensor object at the trace, and pairs that were distinct
  // (Note [Arguments passed twice] in arguments.py): a call that differs takes the slow path.
  std::vector<std::pair<int, int>> same, distinct;
};

struct Call {
  std::shared_ptr<replay::Engine> engine;
  std::vector<c10::IValue> bound;  // leading graph inputs, fixed when the Call is built
  std::vector<int> mutated;        // call arguments the graph writes: their versions are bumped
  std::vector<int> mutated_bound;  // bound inputs the graph writes (an optimizer's state): the same
  int num_outputs = -1;            // outputs returned: the graph's first num_outputs (-1: all)
  Returns returns = Returns::kList;
  std::optional<AotEpilogue> aot;       // torch.compile
  std::optional<CaptureChecks> checks;  // torchreplay.capture

  // Checks what the Call was built from against its engine's graph: ValueError if out of range.
  void Validate() const;

  py::object operator()(const py::args& args, const py::kwargs& kwargs) const;
  // The call with the graph's own flat arguments, every check done here (no slow path).
  py::object Fast(const py::args& args, const py::kwargs& kwargs) const;
  static PyObject* TpCall(PyObject* self, PyObject* args, PyObject* kwargs);

 private:
  // The graph's inputs for a call, after every check (which raise ValueError or TypeError and
  // run nothing); or the call's result, when the fallback took it (an int beyond 64 bits).
  std::optional<py::object> CheckedInputs(const py::args& args, const py::kwargs& kwargs,
                                          std::vector<c10::IValue>* inputs) const;
  // torchreplay.capture's checks of the converted inputs.
  void Check(const std::vector<c10::IValue>& inputs) const;
  // The parameters of checks->grad_traced require grad as when traced.
  bool GradsAsTraced() const;
  bool IdentityAsTraced(const py::args& args) const;
  py::object RunChecked(std::vector<c10::IValue> inputs, const py::args& args) const;
  void RegenerateAliases(const absl::InlinedVector<c10::IValue, 2>& input_bases,
                         std::vector<c10::IValue>& out) const;
};

// Counts the calls of nn.Module.train (torchreplay.capture wraps it): a Call whose modules'
// modes were last checked at another count checks them again (CaptureChecks::modes_epoch).
void ModuleModesChanged();
int64_t ModuleModesEpoch();

// Registers Returns, AliasKind, Alias, AotEpilogue, SizeCheck, CaptureChecks, Call and
// RequiresGradGuard.
void BindCall(py::module_& m);

}  // namespace torchreplay
