#include "capture/interpreter.h"

#include <ATen/core/List.h>
#include <ATen/core/jit_type.h>
#include <c10/util/Exception.h>

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace torchreplay::capture {
namespace {

c10::TypePtr ListElementType(const c10::TypePtr& type) {
  c10::TypePtr t = type;
  if (t->kind() == c10::TypeKind::OptionalType) t = t->castRaw<c10::OptionalType>()->getElementType();
  if (t->kind() == c10::TypeKind::ListType) return t->castRaw<c10::ListType>()->getElementType();
  return c10::AnyType::get();
}

}  // namespace

int64_t EvalSymArith(SymOp op, int64_t a, int64_t b) {
  switch (op) {
    case SymOp::kAdd: return a + b;
    case SymOp::kSub: return a - b;
    case SymOp::kMul: return a * b;
    case SymOp::kFloorDiv: {  // Python semantics: rounds toward negative infinity
      int64_t q = a / b;
      return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
    }
    case SymOp::kMod: {  // Python semantics: the result takes the divisor's sign
      int64_t r = a % b;
      return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
    }
    case SymOp::kNeg: return -a;
    case SymOp::kMax: return std::max(a, b);
    case SymOp::kMin: return std::min(a, b);
  }
  return 0;
}

c10::IValue MaterializeArg(const Arg& arg, const c10::TypePtr& type,
                           const std::vector<c10::IValue>& env) {
  switch (arg.kind) {
    case Arg::Kind::kConstant: return arg.constant;
    case Arg::Kind::kValue: {
      const c10::IValue& v = env[arg.value];
      if (IsTensorType(type) && (v.isInt() || v.isDouble() || v.isBool())) return WrapNumber(v);
      return v;
    }
    case Arg::Kind::kList: {
      c10::impl::GenericList list(ListElementType(type));
      list.reserve(arg.elems.size());
      for (const auto& e : arg.elems) {
        list.push_back(e.kind == Arg::Kind::kValue ? env[e.value] : e.constant);
      }
      return list;
    }
  }
  return {};
}

absl::Status CheckInputs(const Graph& graph, const std::vector<c10::IValue>& inputs) {
  const auto& ids = graph.inputs();
  if (inputs.size() != ids.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("expected ", ids.size(), " inputs, got ", inputs.size()));
  }
  for (size_t i = 0; i < ids.size(); ++i) {
    const ValueInfo& info = graph.values()[ids[i]];
    const c10::IValue& v = inputs[i];
    const std::string where = absl::StrCat("input ", i, " (", info.name, ")");
    switch (info.type) {
      case ValueType::kTensor: {
        if (!v.isTensor()) {
          return absl::InvalidArgumentError(
              absl::StrCat(where, ": expected a tensor, got ", v.tagKind()));
        }
        const at::Tensor& t = v.toTensor();
        if (!t.defined()) return absl::InvalidArgumentError(absl::StrCat(where, ": undefined tensor"));
        if (info.spec) {
          if (t.scalar_type() != info.spec->dtype) {
            return absl::InvalidArgumentError(absl::StrCat(where, ": expected dtype ",
                c10::toString(info.spec->dtype), ", got ", c10::toString(t.scalar_type())));
          }
          if (t.device().type() != info.spec->device) {
            return absl::InvalidArgumentError(absl::StrCat(where, ": expected a ",
                c10::DeviceTypeName(info.spec->device, true), " tensor, got one on ",
                t.device().str()));
          }
          if (t.dim() != info.spec->dim) {
            return absl::InvalidArgumentError(absl::StrCat(where, ": expected a ", info.spec->dim,
                "-d tensor, got ", t.dim(), "-d"));
          }
        }
        break;
      }
      case ValueType::kInt:
        if (!v.isInt()) {
          return absl::InvalidArgumentError(absl::StrCat(where, ": expected an int, got ", v.tagKind()));
        }
        break;
      case ValueType::kFloat:
        if (!v.isDouble() && !v.isInt()) {
          return absl::InvalidArgumentError(absl::StrCat(where, ": expected a float, got ", v.tagKind()));
        }
        break;
      case ValueType::kBool:
        if (!v.isBool()) {
          return absl::InvalidArgumentError(absl::StrCat(where, ": expected a bool, got ", v.tagKind()));
        }
        break;
      default:
        break;
    }
  }
  return absl::OkStatus();
}

Interpreter::Interpreter(std::shared_ptr<const Graph> graph) : graph_(std::move(graph)) {
  const auto& nodes = graph_->nodes();
  std::vector<int> last_use(graph_->values().size(), -1);
  for (int i = 0; i < static_cast<int>(nodes.size()); ++i) {
    for (const auto& a : nodes[i].args) ForEachValueUse(a, [&](ValueId v) { last_use[v] = i; });
  }
  for (const auto& a : graph_->outputs()) {
    ForEachValueUse(a, [&](ValueId v) { last_use[v] = static_cast<int>(nodes.size()); });
  }
  free_after_.resize(nodes.size());
  for (ValueId v = 0; v < static_cast<ValueId>(last_use.size()); ++v) {
    if (last_use[v] >= 0 && last_use[v] < static_cast<int>(nodes.size())) {
      free_after_[last_use[v]].push_back(v);
    }
  }
}

absl::StatusOr<std::vector<c10::IValue>> Interpreter::Run(std::vector<c10::IValue> inputs,
                                                          const Observer* observer) const {
  const Graph& g = *graph_;
  std::vector<c10::IValue> env(g.values().size());
  for (size_t i = 0; i < inputs.size() && i < g.inputs().size(); ++i) {
    env[g.inputs()[i]] = std::move(inputs[i]);
  }
  torch::jit::Stack stack;
  const auto& nodes = g.nodes();
  for (int i = 0; i < static_cast<int>(nodes.size()); ++i) {
    const Node& n = nodes[i];
    try {
      switch (n.kind) {
        case NodeKind::kOp: {
          stack.clear();
          for (size_t a = 0; a < n.args.size(); ++a) {
            stack.push_back(MaterializeArg(n.args[a], n.arg_types[a], env));
          }
          n.op->callBoxed(&stack);
          if (stack.size() != n.outputs.size()) {
            return absl::InternalError(absl::StrCat("node '", n.name, "' returned ", stack.size(),
                                                    " values, expected ", n.outputs.size()));
          }
          for (size_t o = 0; o < n.outputs.size(); ++o) env[n.outputs[o]] = std::move(stack[o]);
          break;
        }
        case NodeKind::kGetItem: {
          const auto list = env[n.args[0].value].toList();
          if (n.index < 0 || n.index >= static_cast<int64_t>(list.size())) {
            return absl::OutOfRangeError(absl::StrCat("node '", n.name, "': index ", n.index,
                                                      " out of range for a list of ", list.size()));
          }
          env[n.outputs[0]] = list.get(n.index);
          break;
        }
        case NodeKind::kSymArith: {
          auto operand = [&](const Arg& a) {
            return a.kind == Arg::Kind::kValue ? env[a.value].toInt() : a.constant.toInt();
          };
          const int64_t x = operand(n.args[0]);
          const int64_t y = n.args.size() > 1 ? operand(n.args[1]) : 0;
          if ((n.sym_op == SymOp::kFloorDiv || n.sym_op == SymOp::kMod) && y == 0) {
            return absl::InvalidArgumentError(absl::StrCat("node '", n.name, "': division by zero"));
          }
          env[n.outputs[0]] = EvalSymArith(n.sym_op, x, y);
          break;
        }
      }
    } catch (const c10::Error& e) {
      return absl::InternalError(
          absl::StrCat("node '", n.name, "' failed: ", e.what_without_backtrace()));
    } catch (const std::exception& e) {
      return absl::InternalError(absl::StrCat("node '", n.name, "' failed: ", e.what()));
    }
    if (observer != nullptr) {
      (*observer)(i, env);
    } else {
      for (ValueId v : free_after_[i]) env[v] = c10::IValue();
    }
  }
  std::vector<c10::IValue> outs;
  outs.reserve(g.outputs().size());
  for (const auto& a : g.outputs()) {
    outs.push_back(a.kind == Arg::Kind::kValue ? env[a.value] : a.constant);
  }
  return outs;
}

}  // namespace torchreplay::capture
