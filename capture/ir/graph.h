// capture/ir/graph.h: the IR a lowered ATen graph is held in, and the builder that validates it.
//
// A Graph is a list of inputs, a topologically ordered list of nodes and a list of outputs over
// SSA values. A node is one of:
//   - an operator call, resolved once to a c10::OperatorHandle; its arguments are given one per
//     schema argument (defaults filled in by the builder), each a constant, a value, or a list
//     whose elements are constants or values;
//   - a getitem on a list value (ops that return Tensor[]);
//   - integer arithmetic on symbolic values (sizes, scalar inputs): add, sub, mul, floordiv, ...
// Graphs are immutable once built and shared (std::shared_ptr<const Graph>) by every engine and
// thread that runs them.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace torchreplay::capture {

using ValueId = int32_t;

enum class ValueType { kTensor, kInt, kFloat, kBool, kTensorList, kNone };
const char* ValueTypeName(ValueType t);

// What the graph expects of a tensor input; checked when a call's inputs are seen the first time
// under a new guard key, so that a wrong call gets a clear error instead of a kernel's.
struct TensorSpec {
  c10::ScalarType dtype = c10::ScalarType::Float;
  c10::DeviceType device = c10::DeviceType::CPU;
  int64_t dim = 0;
};

struct ValueInfo {
  ValueType type = ValueType::kTensor;
  std::string name;
  std::optional<TensorSpec> spec;    // inputs only, when known
};

// One argument of a node.
struct Arg {
  enum class Kind { kConstant, kValue, kList };
  Kind kind = Kind::kConstant;
  c10::IValue constant;   // kConstant
  ValueId value = -1;     // kValue
  std::vector<Arg> elems; // kList

  static Arg Const(c10::IValue v);
  static Arg Ref(ValueId v);
  static Arg List(std::vector<Arg> elems);
};

// Calls f for every value an argument refers to (list elements included).
void ForEachValueUse(const Arg& arg, const std::function<void(ValueId)>& f);

enum class NodeKind { kOp, kGetItem, kSymArith };
// Python arithmetic on symbolic sizes and scalars (int, float, bool), with Python's semantics:
// int op int stays int (except truediv), a float operand makes a float, comparisons make bools.
enum class SymOp {
  // two operands
  kAdd, kSub, kMul, kTrueDiv, kFloorDiv, kMod, kPow, kMax, kMin,
  kEq, kNe, kLt, kLe, kGt, kGe, kAnd, kOr, kXor, kLShift, kRShift,
  // one operand
  kNeg, kPos, kAbs, kNot, kFloat, kTrunc, kFloor, kCeil, kRound, kSqrt,
};
absl::StatusOr<SymOp> SymOpFromName(const std::string& name);  // "add", "truediv", "floor", ...
int SymOpArity(SymOp op);
const char* SymOpName(SymOp op);  // "add", "truediv", ... (the inverse of SymOpFromName)

struct Node {
  NodeKind kind = NodeKind::kOp;
  std::string name;                    // e.g. "addmm_1" (the FX node name), for errors and dumps
  std::optional<c10::OperatorHandle> op;
  std::vector<Arg> args;               // kOp: one per schema argument; kSymArith: its operands
  // For each kOp argument: the schema type the runtime value must be given as (Tensor arguments
  // fed a number are wrapped into a 0-dim "wrapped number" tensor, as the Python binding does).
  std::vector<c10::TypePtr> arg_types;
  SymOp sym_op = SymOp::kAdd;          // kSymArith
  int64_t index = 0;                   // kGetItem: the list element taken
  std::vector<ValueId> outputs;
};

class Graph {
 public:
  const std::vector<ValueInfo>& values() const { return values_; }
  const std::vector<ValueId>& inputs() const { return inputs_; }
  const std::vector<Node>& nodes() const { return nodes_; }
  const std::vector<Arg>& outputs() const { return outputs_; }
  // Inputs (by position) whose tensors keep their address across calls: parameters, buffers,
  // tensors marked static. Replay bakes their addresses in.
  const std::vector<int>& static_inputs() const { return static_inputs_; }
  bool is_static_input(int i) const { return i < static_mask_.size() && static_mask_[i]; }
  // Scalar inputs that are data, not shape: bound per call, not in the guard key (Note [Scalars
  // bound per call]). Per input position.
  const std::vector<bool>& per_call_scalars() const { return per_call_scalars_; }
  bool is_per_call_scalar(int i) const { return per_call_scalars_[i]; }
  // Per input position: an op may write it. An op writing a value that is not an input (which
  // may be a view of one) counts as writing every input.
  const std::vector<bool>& written_inputs() const { return written_inputs_; }
  // Per value: the index of the last node reading it, nodes().size() for a graph output, -1 if
  // nothing reads it (liveness: the interpreter frees after it, the tape plans buffers by it).
  const std::vector<int>& last_use() const { return last_use_; }
  // Whether a node is a collective of torch.distributed (_c10d_functional::*, c10d::*): every rank
  // must issue it once per call (Note [Collectives] in replay/engine.h).
  bool communicates() const { return communicates_; }

  // Human-readable listing: one line per input, node and output.
  std::string ToString() const;

 private:
  friend class GraphBuilder;
  std::vector<ValueInfo> values_;
  std::vector<ValueId> inputs_;
  std::vector<Node> nodes_;
  std::vector<Arg> outputs_;
  std::vector<int> static_inputs_;
  std::vector<bool> static_mask_;
  // Facts decided once at Build(), read by the interpreter, the tape planner and the engine.
  std::vector<bool> per_call_scalars_;
  std::vector<bool> written_inputs_;
  std::vector<int> last_use_;
  bool communicates_ = false;
};

// Note [Scalars bound per call]
// A scalar input (int, float, bool: a SymInt or SymFloat under dynamic=True, a number Dynamo
// passes in) that reaches kernels only as data (a Scalar or float argument, or a number where
// a Tensor goes, which becomes a wrapped-number tensor) changes no size, stride or dtype when its
// value changes: only its kind (int, float, bool) does. Such an input is bound per call:
//   - the guard key holds its kind, not its value (guards::GuardKey), so a step counter or a
//     sampling temperature passed every call does not make a new key per call;
//   - the CPU tape gives it a slot: Scalar arguments read it per call (typed and prepared steps
//     too), and a number where a Tensor goes is a wrapped-number tensor made once at capture that
//     replay writes the value into before the steps run (kernel_tape.cc).
// Symbolic arithmetic on such a scalar (s + 1, 1 / t) whose result is itself only data runs per
// call too, as a tape step. A scalar that reaches a size, dim or list argument, arange/range
// (whose Scalar arguments decide the length), or pow/max/min (whose result kind depends on the
// values) stays in the key, its value fixed per captured graph. Graphs with a CUDA tensor input keep every scalar in the key: a CUDA graph bakes host
// scalars into its kernels' launches.

// Builds a Graph node by node; every call validates and returns a clear status on bad input
// (unknown operator, wrong arity or argument kind, a value used before it is defined).
class GraphBuilder {
 public:
  GraphBuilder();

  ValueId AddInput(std::string name, ValueType type, std::optional<TensorSpec> spec = {});

  // `op` is "namespace::name.overload" ("aten::addmm", "aten::sub.Tensor"). Positional args come
  // first, then keyword args by schema name; missing trailing arguments take schema defaults.
  absl::StatusOr<std::vector<ValueId>> AddOp(
      const std::string& op, std::vector<Arg> args,
      std::vector<std::pair<std::string, Arg>> kwargs = {}, std::string name = "");
  absl::StatusOr<ValueId> AddGetItem(ValueId list, int64_t index, std::string name = "");
  absl::StatusOr<ValueId> AddSymArith(SymOp op, std::vector<Arg> operands, std::string name = "");

  absl::Status SetOutputs(std::vector<Arg> outputs);
  absl::Status SetStaticInputs(std::vector<int> input_positions);

  // Finishes the graph. The builder is left empty.
  absl::StatusOr<std::shared_ptr<const Graph>> Build();

 private:
  absl::Status CheckArg(const Arg& arg, const std::string& where) const;
  ValueId NewValue(ValueType type, std::string name);

  std::unique_ptr<Graph> graph_;
  bool outputs_set_ = false;
};

// What a node does, for listings: "aten::addmm", "getitem[1]", "sym.floordiv".
std::string NodeLabel(const Node& n);

// Resolves "ns::name.overload" to an operator handle, or a clear NotFound status.
absl::StatusOr<c10::OperatorHandle> FindOperator(const std::string& qualified_name);

// "aten::add.Tensor"-style name of an operator.
std::string OperatorName(const c10::OperatorHandle& op);

// True for the schema types Tensor and Tensor?.
bool IsTensorType(const c10::TypePtr& type);

// A number (int, float, bool, complex) given where a Tensor is expected becomes a 0-dim "wrapped
// number" tensor, exactly as torch's own argument parsing does, so that type promotion matches
// eager. Any other value is returned as it is.
c10::IValue WrapNumber(const c10::IValue& v);

}  // namespace torchreplay::capture
