// The graph IR (see graph.h): values and arguments, operators found by name, printing, the
// builder's checks, and the analyses the backends read (per-call scalars, written inputs, last
// uses). Over 500 lines: the builder validates what the printers and analyses then trust.
#include "capture/ir/graph.h"

#include <ATen/core/function_schema.h>
#include <ATen/core/jit_type.h>
#include <ATen/ScalarOps.h>

#include <algorithm>
#include <sstream>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace torchreplay::capture {

const char* ValueTypeName(ValueType t) {
  switch (t) {
    case ValueType::kTensor: return "Tensor";
    case ValueType::kInt: return "int";
    case ValueType::kFloat: return "float";
    case ValueType::kBool: return "bool";
    case ValueType::kTensorList: return "Tensor[]";
    case ValueType::kNone: return "None";
  }
  return "?";
}

Arg Arg::Const(c10::IValue v) {
  Arg a;
  a.kind = Kind::kConstant;
  a.constant = std::move(v);
  return a;
}
Arg Arg::Ref(ValueId v) {
  Arg a;
  a.kind = Kind::kValue;
  a.value = v;
  return a;
}
Arg Arg::List(std::vector<Arg> elems) {
  Arg a;
  a.kind = Kind::kList;
  a.elems = std::move(elems);
  return a;
}

void ForEachValueUse(const Arg& a, const std::function<void(ValueId)>& f) {
  if (a.kind == Arg::Kind::kValue) f(a.value);
  for (const auto& e : a.elems) ForEachValueUse(e, f);
}

absl::StatusOr<SymOp> SymOpFromName(const std::string& name) {
  static const absl::flat_hash_map<std::string, SymOp> kNames = {
      {"add", SymOp::kAdd},     {"sub", SymOp::kSub},   {"mul", SymOp::kMul},
      {"truediv", SymOp::kTrueDiv}, {"floordiv", SymOp::kFloorDiv}, {"mod", SymOp::kMod},
      {"pow", SymOp::kPow},     {"max", SymOp::kMax},   {"sym_max", SymOp::kMax},
      {"min", SymOp::kMin},     {"sym_min", SymOp::kMin}, {"eq", SymOp::kEq},
      {"ne", SymOp::kNe},       {"lt", SymOp::kLt},     {"le", SymOp::kLe},
      {"gt", SymOp::kGt},       {"ge", SymOp::kGe},     {"and", SymOp::kAnd},
      {"or", SymOp::kOr},       {"xor", SymOp::kXor},   {"lshift", SymOp::kLShift},
      {"rshift", SymOp::kRShift}, {"neg", SymOp::kNeg},
      {"pos", SymOp::kPos},     {"abs", SymOp::kAbs},   {"not", SymOp::kNot},
      {"float", SymOp::kFloat}, {"trunc", SymOp::kTrunc}, {"floor", SymOp::kFloor},
      {"ceil", SymOp::kCeil},   {"round", SymOp::kRound}, {"sqrt", SymOp::kSqrt}};
  auto it = kNames.find(name);
  if (it == kNames.end()) {
    return absl::InvalidArgumentError(absl::StrCat("unsupported symbolic arithmetic '", name, "'"));
  }
  return it->second;
}

int SymOpArity(SymOp op) { return op >= SymOp::kNeg ? 1 : 2; }

const char* SymOpName(SymOp op) {
  static const char* kNames[] = {
      "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "max", "min", "eq", "ne", "lt",
      "le", "gt", "ge", "and", "or", "xor", "lshift", "rshift", "neg", "pos", "abs", "not",
      "float", "trunc", "floor", "ceil", "round", "sqrt"};
  static_assert(sizeof(kNames) / sizeof(kNames[0]) == static_cast<size_t>(SymOp::kSqrt) + 1);
  return kNames[static_cast<int>(op)];
}

std::string NodeLabel(const Node& n) {
  switch (n.kind) {
    case NodeKind::kOp: return OperatorName(*n.op);
    case NodeKind::kGetItem: return absl::StrCat("getitem[", n.index, "]");
    case NodeKind::kSymArith: return absl::StrCat("sym.", SymOpName(n.sym_op));
  }
  return "?";
}

namespace {

// The type of a symbolic arithmetic result, from its operands' types (Python's rules).
ValueType SymResultType(SymOp op, const std::vector<ValueType>& operands) {
  const bool any_float = std::count(operands.begin(), operands.end(), ValueType::kFloat) > 0;
  const bool all_bool = std::count(operands.begin(), operands.end(), ValueType::kBool) ==
                        static_cast<std::ptrdiff_t>(operands.size());
  switch (op) {
    case SymOp::kEq: case SymOp::kNe: case SymOp::kLt: case SymOp::kLe: case SymOp::kGt:
    case SymOp::kGe: case SymOp::kNot:
      return ValueType::kBool;
    case SymOp::kAnd: case SymOp::kOr: case SymOp::kXor:
      return all_bool ? ValueType::kBool : ValueType::kInt;
    case SymOp::kTrueDiv: case SymOp::kFloat: case SymOp::kSqrt:
      return ValueType::kFloat;
    case SymOp::kTrunc: case SymOp::kFloor: case SymOp::kCeil: case SymOp::kRound:
      return ValueType::kInt;
    default:
      return any_float ? ValueType::kFloat : ValueType::kInt;
  }
}

}  // namespace

absl::StatusOr<c10::OperatorHandle> FindOperator(const std::string& qualified_name) {
  std::string name = qualified_name, overload;
  const auto ns = name.find("::");
  const auto dot = name.find('.', ns == std::string::npos ? 0 : ns + 2);
  if (ns == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("operator name '", qualified_name, "' has no namespace (want ns::name)"));
  }
  if (dot != std::string::npos) {
    overload = name.substr(dot + 1);
    name = name.substr(0, dot);
  }
  if (overload == "default") overload = "";
  auto handle = c10::Dispatcher::singleton().findSchema({name, overload});
  if (!handle.has_value()) {
    return absl::NotFoundError(absl::StrCat("unknown operator '", qualified_name, "'"));
  }
  return *handle;
}

std::string OperatorName(const c10::OperatorHandle& op) {
  const auto& n = op.operator_name();
  return n.overload_name.empty() ? n.name : absl::StrCat(n.name, ".", n.overload_name);
}

bool IsTensorType(const c10::TypePtr& t) {
  if (t->kind() == c10::TypeKind::TensorType) return true;
  return t->kind() == c10::TypeKind::OptionalType &&
         t->castRaw<c10::OptionalType>()->getElementType()->kind() == c10::TypeKind::TensorType;
}

c10::IValue WrapNumber(const c10::IValue& v) {
  if (!(v.isInt() || v.isDouble() || v.isBool() || v.isComplexDouble())) return v;
  at::Tensor t = at::scalar_to_tensor(v.toScalar());
  t.unsafeGetTensorImpl()->set_wrapped_number(true);
  return t;
}

namespace {

ValueType ReturnType(const c10::TypePtr& t) {
  switch (t->kind()) {
    case c10::TypeKind::TensorType: return ValueType::kTensor;
    case c10::TypeKind::IntType:
    case c10::TypeKind::SymIntType: return ValueType::kInt;
    case c10::TypeKind::FloatType:
    case c10::TypeKind::SymFloatType: return ValueType::kFloat;
    case c10::TypeKind::BoolType:
    case c10::TypeKind::SymBoolType: return ValueType::kBool;
    case c10::TypeKind::ListType:
      if (t->castRaw<c10::ListType>()->getElementType()->kind() == c10::TypeKind::TensorType) {
        return ValueType::kTensorList;
      }
      return ValueType::kNone;
    case c10::TypeKind::OptionalType:
      return ReturnType(t->castRaw<c10::OptionalType>()->getElementType());
    default: return ValueType::kNone;
  }
}

c10::IValue WrapNumberIfTensor(const c10::TypePtr& type, c10::IValue v) {
  return IsTensorType(type) ? WrapNumber(v) : v;
}

std::string ArgToString(const Graph& g, const Arg& a) {
  switch (a.kind) {
    case Arg::Kind::kValue: return absl::StrCat("%", g.values()[a.value].name);
    case Arg::Kind::kList: {
      std::vector<std::string> parts;
      for (const auto& e : a.elems) parts.push_back(ArgToString(g, e));
      return absl::StrCat("[", absl::StrJoin(parts, ", "), "]");
    }
    case Arg::Kind::kConstant: {
      if (a.constant.isTensor()) {
        const auto& t = a.constant.toTensor();
        if (t.dim() == 0 && t.is_cpu()) {  // read directly: no dispatch (fake modes may be on)
          switch (t.scalar_type()) {
            case at::kLong: return absl::StrCat(*t.const_data_ptr<int64_t>());
            case at::kDouble: return absl::StrCat(*t.const_data_ptr<double>());
            case at::kFloat: return absl::StrCat(*t.const_data_ptr<float>());
            case at::kBool: return *t.const_data_ptr<bool>() ? "True" : "False";
            default: break;
          }
        }
        return absl::StrCat("tensor<", c10::toString(t.scalar_type()), "[",
                            absl::StrJoin(t.sizes(), ","), "]>");
      }
      std::ostringstream os;
      os << a.constant;
      return os.str();
    }
  }
  return "?";
}

}  // namespace

std::string Graph::ToString() const {
  std::ostringstream os;
  std::vector<std::string> ins;
  for (size_t i = 0; i < inputs_.size(); ++i) {
    const auto& v = values_[inputs_[i]];
    std::string s = absl::StrCat("%", v.name, ": ", ValueTypeName(v.type));
    if (v.spec) {
      absl::StrAppend(&s, " ", c10::toString(v.spec->dtype), " ", v.spec->dim, "-d ",
                      c10::DeviceTypeName(v.spec->device, /*lower_case=*/true));
    }
    if (is_static_input(static_cast<int>(i))) absl::StrAppend(&s, " static");
    ins.push_back(std::move(s));
  }
  os << "graph(" << absl::StrJoin(ins, ", ") << "):\n";
  for (const auto& n : nodes_) {
    std::vector<std::string> outs;
    for (ValueId v : n.outputs) outs.push_back(absl::StrCat("%", values_[v].name));
    std::vector<std::string> args;
    for (const auto& a : n.args) args.push_back(ArgToString(*this, a));
    os << "  " << absl::StrJoin(outs, ", ") << " = " << NodeLabel(n) << "("
       << absl::StrJoin(args, ", ") << ")\n";
  }
  std::vector<std::string> outs;
  for (const auto& a : outputs_) outs.push_back(ArgToString(*this, a));
  os << "  return (" << absl::StrJoin(outs, ", ") << ")\n";
  return os.str();
}

GraphBuilder::GraphBuilder() : graph_(std::make_unique<Graph>()) {}

ValueId GraphBuilder::NewValue(ValueType type, std::string name) {
  ValueId id = static_cast<ValueId>(graph_->values_.size());
  if (name.empty()) name = absl::StrCat("v", id);
  graph_->values_.push_back(ValueInfo{type, std::move(name), std::nullopt});
  return id;
}

ValueId GraphBuilder::AddInput(std::string name, ValueType type, std::optional<TensorSpec> spec) {
  ValueId id = NewValue(type, std::move(name));
  graph_->values_[id].spec = spec;
  graph_->inputs_.push_back(id);
  return id;
}

absl::Status GraphBuilder::CheckArg(const Arg& arg, const std::string& where) const {
  switch (arg.kind) {
    case Arg::Kind::kConstant: return absl::OkStatus();
    case Arg::Kind::kValue:
      if (arg.value < 0 || arg.value >= static_cast<ValueId>(graph_->values_.size())) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ": refers to value %", arg.value, ", which is not defined"));
      }
      return absl::OkStatus();
    case Arg::Kind::kList:
      for (const auto& e : arg.elems) {
        if (e.kind == Arg::Kind::kList) {
          return absl::InvalidArgumentError(absl::StrCat(where, ": nested lists are not supported"));
        }
        if (auto s = CheckArg(e, where); !s.ok()) return s;
      }
      return absl::OkStatus();
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<ValueId>> GraphBuilder::AddOp(
    const std::string& op_name, std::vector<Arg> args,
    std::vector<std::pair<std::string, Arg>> kwargs, std::string name) {
  auto op = FindOperator(op_name);
  if (!op.ok()) return op.status();
  const c10::FunctionSchema& schema = op->schema();
  const auto& formals = schema.arguments();
  const std::string where = absl::StrCat("node '", name.empty() ? op_name : name, "' (", op_name, ")");
  if (args.size() > formals.size()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": takes at most ", formals.size(),
                                                   " arguments, got ", args.size()));
  }
  std::vector<std::optional<Arg>> slots(formals.size());
  for (size_t i = 0; i < args.size(); ++i) {
    if (formals[i].kwarg_only()) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": argument '", formals[i].name(), "' is keyword-only but given by position"));
    }
    slots[i] = std::move(args[i]);
  }
  for (auto& [key, value] : kwargs) {
    auto idx = schema.argumentIndexWithName(key);
    if (!idx.has_value()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": has no argument named '", key, "'"));
    }
    if (slots[*idx].has_value()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": argument '", key, "' given twice"));
    }
    slots[*idx] = std::move(value);
  }
  Node node;
  node.kind = NodeKind::kOp;
  node.op = *op;
  node.name = name.empty() ? op_name : name;
  for (size_t i = 0; i < formals.size(); ++i) {
    const auto& formal = formals[i];
    if (!slots[i].has_value()) {
      if (!formal.default_value().has_value()) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ": missing required argument '", formal.name(), "'"));
      }
      slots[i] = Arg::Const(*formal.default_value());
    }
    Arg& a = *slots[i];
    if (auto s = CheckArg(a, where); !s.ok()) return s;
    if (a.kind == Arg::Kind::kValue &&
        graph_->values_[a.value].type == ValueType::kTensorList &&
        formal.type()->kind() != c10::TypeKind::ListType) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": argument '", formal.name(), "' expects ", formal.type()->str(),
          " but is given a tensor list"));
    }
    if (a.kind == Arg::Kind::kConstant) a.constant = WrapNumberIfTensor(formal.type(), a.constant);
    if (a.kind == Arg::Kind::kConstant && a.constant.isList() && formal.type()->kind() == c10::TypeKind::ListType) {
      // a list of numbers (or an empty one, which Python gives as ints) where a Scalar[] or
      // Scalar?[] goes: a list of that element type, which the op's kernel unboxes
      const c10::TypePtr elem = formal.type()->containedType(0);
      const c10::TypePtr base = elem->kind() == c10::TypeKind::OptionalType ? elem->containedType(0) : elem;
      if (base->kind() == c10::TypeKind::NumberType && *a.constant.toList().elementType() != *elem) {
        c10::impl::GenericList list(elem);
        for (const c10::IValue& e : a.constant.toListRef()) list.push_back(e);
        a.constant = std::move(list);
      }
    }
    node.arg_types.push_back(formal.type());
    node.args.push_back(std::move(a));
  }
  const auto& returns = schema.returns();
  for (size_t i = 0; i < returns.size(); ++i) {
    std::string out_name = returns.size() == 1 ? node.name : absl::StrCat(node.name, "_", i);
    node.outputs.push_back(NewValue(ReturnType(returns[i].type()), std::move(out_name)));
  }
  std::vector<ValueId> outs = node.outputs;
  graph_->nodes_.push_back(std::move(node));
  return outs;
}

absl::StatusOr<ValueId> GraphBuilder::AddGetItem(ValueId list, int64_t index, std::string name) {
  if (list < 0 || list >= static_cast<ValueId>(graph_->values_.size())) {
    return absl::InvalidArgumentError(absl::StrCat("getitem: value %", list, " is not defined"));
  }
  if (graph_->values_[list].type != ValueType::kTensorList) {
    return absl::InvalidArgumentError(absl::StrCat("getitem: value %", graph_->values_[list].name,
                                                   " is not a tensor list"));
  }
  Node node;
  node.kind = NodeKind::kGetItem;
  node.name = name.empty() ? absl::StrCat(graph_->values_[list].name, "_", index) : name;
  node.args.push_back(Arg::Ref(list));
  node.index = index;
  node.outputs.push_back(
      NewValue(ValueType::kTensor, node.name));
  ValueId out = node.outputs[0];
  graph_->nodes_.push_back(std::move(node));
  return out;
}

absl::StatusOr<ValueId> GraphBuilder::AddSymArith(SymOp op, std::vector<Arg> operands,
                                                  std::string name) {
  const size_t want = SymOpArity(op);
  if (operands.size() != want) {
    return absl::InvalidArgumentError(absl::StrCat("symbolic arithmetic '", name, "' takes ", want,
                                                   " operands, got ", operands.size()));
  }
  std::vector<ValueType> types;
  for (const auto& a : operands) {
    if (auto s = CheckArg(a, absl::StrCat("node '", name, "'")); !s.ok()) return s;
    ValueType t = ValueType::kNone;
    if (a.kind == Arg::Kind::kConstant) {
      t = a.constant.isInt() ? ValueType::kInt
          : a.constant.isDouble() ? ValueType::kFloat
          : a.constant.isBool() ? ValueType::kBool
                                : ValueType::kNone;
    } else if (a.kind == Arg::Kind::kValue) {
      t = graph_->values_[a.value].type;
    }
    if (t != ValueType::kInt && t != ValueType::kFloat && t != ValueType::kBool) {
      return absl::InvalidArgumentError(absl::StrCat(
          "node '", name, "': symbolic arithmetic takes ints, floats and bools only"));
    }
    types.push_back(t);
  }
  Node node;
  node.kind = NodeKind::kSymArith;
  node.sym_op = op;
  node.name = name.empty() ? absl::StrCat("sym", graph_->nodes_.size()) : name;
  node.args = std::move(operands);
  node.outputs.push_back(
      NewValue(SymResultType(op, types), node.name));
  ValueId out = node.outputs[0];
  graph_->nodes_.push_back(std::move(node));
  return out;
}

absl::Status GraphBuilder::SetOutputs(std::vector<Arg> outputs) {
  for (const auto& a : outputs) {
    if (auto s = CheckArg(a, "graph output"); !s.ok()) return s;
  }
  graph_->outputs_ = std::move(outputs);
  outputs_set_ = true;
  return absl::OkStatus();
}

absl::Status GraphBuilder::SetStaticInputs(std::vector<int> positions) {
  const int n = static_cast<int>(graph_->inputs_.size());
  graph_->static_mask_.assign(n, false);
  for (int p : positions) {
    if (p < 0 || p >= n) {
      return absl::InvalidArgumentError(
          absl::StrCat("static input index ", p, " is out of range (graph has ", n, " inputs)"));
    }
    if (graph_->values_[graph_->inputs_[p]].type != ValueType::kTensor) {
      return absl::InvalidArgumentError(
          absl::StrCat("static input ", p, " is not a tensor input"));
    }
    graph_->static_mask_[p] = true;
  }
  graph_->static_inputs_ = std::move(positions);
  return absl::OkStatus();
}

namespace {

// A schema argument type through which a scalar reaches a kernel as data (Note [Scalars bound
// per call]): Scalar, float, or Tensor (a wrapped number), optional or not.
bool TakesDataScalar(const c10::TypePtr& type) {
  const c10::TypePtr& t = type->kind() == c10::TypeKind::OptionalType ? type->containedType(0) : type;
  return t->kind() == c10::TypeKind::NumberType || t->kind() == c10::TypeKind::FloatType ||
         t->kind() == c10::TypeKind::TensorType;
}

std::vector<bool> PerCallScalars(const Graph& g) {
  const size_t n = g.inputs().size();
  std::vector<bool> per_call(n, false);
  for (ValueId v : g.inputs()) {
    const ValueInfo& info = g.values()[v];
    if (info.spec.has_value() && info.spec->device != c10::DeviceType::CPU) return per_call;
  }
  // Whether each value reaches kernels only as data, from its uses: nodes last to first, so a
  // symbolic result is decided before its operands. pow, max and min are left out: the kind of
  // their result (int or float) depends on the values.
  std::vector<bool> data(g.values().size(), true);
  auto keyed = [&](ValueId v) { data[v] = false; };
  for (auto it = g.nodes().rbegin(); it != g.nodes().rend(); ++it) {
    const Node& node = *it;
    if (node.kind == NodeKind::kSymArith) {
      const bool per_call_result = data[node.outputs[0]] && node.sym_op != SymOp::kPow &&
                                   node.sym_op != SymOp::kMax && node.sym_op != SymOp::kMin;
      if (!per_call_result) {
        for (const Arg& arg : node.args) ForEachValueUse(arg, keyed);
      }
      continue;
    }
    const bool shapes_from_scalars = node.kind == NodeKind::kOp &&
                                     (node.op->schema().name() == "aten::arange" ||
                                      node.op->schema().name() == "aten::range");
    for (size_t a = 0; a < node.args.size(); ++a) {
      const Arg& arg = node.args[a];
      if (arg.kind == Arg::Kind::kValue && node.kind == NodeKind::kOp && !shapes_from_scalars &&
          TakesDataScalar(node.arg_types[a])) {
        continue;
      }
      ForEachValueUse(arg, keyed);
    }
  }
  for (size_t i = 0; i < n; ++i) {
    const ValueId v = g.inputs()[i];
    const ValueType t = g.values()[v].type;
    per_call[i] = data[v] && (t == ValueType::kInt || t == ValueType::kFloat || t == ValueType::kBool);
  }
  return per_call;
}

std::vector<bool> WrittenInputs(const Graph& g) {
  const auto& ins = g.inputs();
  std::vector<bool> written(ins.size(), false);
  for (const Node& n : g.nodes()) {
    if (!n.op.has_value()) continue;
    const auto& args = n.op->schema().arguments();
    for (size_t a = 0; a < args.size() && a < n.args.size(); ++a) {
      if (args[a].alias_info() == nullptr || !args[a].alias_info()->isWrite()) continue;
      const auto in = n.args[a].kind == Arg::Kind::kValue
                          ? std::find(ins.begin(), ins.end(), n.args[a].value) : ins.end();
      if (in != ins.end()) {
        written[in - ins.begin()] = true;
      } else {
        written.assign(ins.size(), true);
      }
    }
  }
  return written;
}

std::vector<int> LastUse(const Graph& g) {
  const auto& nodes = g.nodes();
  std::vector<int> last_use(g.values().size(), -1);
  for (int i = 0; i < static_cast<int>(nodes.size()); ++i) {
    for (const auto& a : nodes[i].args) ForEachValueUse(a, [&](ValueId v) { last_use[v] = i; });
  }
  for (const auto& a : g.outputs()) {
    ForEachValueUse(a, [&](ValueId v) { last_use[v] = static_cast<int>(nodes.size()); });
  }
  return last_use;
}

}  // namespace

absl::StatusOr<std::shared_ptr<const Graph>> GraphBuilder::Build() {
  if (!outputs_set_) return absl::FailedPreconditionError("graph has no outputs set");
  graph_->static_mask_.resize(graph_->inputs_.size(), false);
  graph_->per_call_scalars_ = PerCallScalars(*graph_);
  graph_->written_inputs_ = WrittenInputs(*graph_);
  graph_->last_use_ = LastUse(*graph_);
  for (const Node& n : graph_->nodes_) {
    if (n.kind != NodeKind::kOp) continue;
    const std::string& name = n.op->schema().name();
    graph_->communicates_ = graph_->communicates_ || name.rfind("_c10d_functional::", 0) == 0 ||
                            name.rfind("c10d::", 0) == 0;
  }
  std::shared_ptr<const Graph> g(std::move(graph_));
  graph_ = std::make_unique<Graph>();
  outputs_set_ = false;
  return g;
}

}  // namespace torchreplay::capture
