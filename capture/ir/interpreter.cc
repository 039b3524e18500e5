#include "capture/ir/interpreter.h"

#include <ATen/core/List.h>
#include <ATen/core/jit_type.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "capture/ir/scopes.h"

namespace torchreplay::capture {
namespace {

c10::TypePtr ListElementType(const c10::TypePtr& type) {
  c10::TypePtr t = type;
  if (t->kind() == c10::TypeKind::OptionalType) t = t->castRaw<c10::OptionalType>()->getElementType();
  if (t->kind() == c10::TypeKind::ListType) return t->castRaw<c10::ListType>()->getElementType();
  return c10::AnyType::get();
}

}  // namespace

absl::Status KernelError(const c10::Error& e, absl::string_view context) {
  // The classes torch's HANDLE_TH_ERRORS maps to a Python exception other than RuntimeError,
  // subclasses first; the binding turns the name back into the exception.
  const char* type = dynamic_cast<const c10::IndexError*>(&e)            ? "IndexError"
                     : dynamic_cast<const c10::ValueError*>(&e)          ? "ValueError"
                     : dynamic_cast<const c10::TypeError*>(&e)           ? "TypeError"
                     : dynamic_cast<const c10::NotImplementedError*>(&e) ? "NotImplementedError"
                     : dynamic_cast<const c10::BufferError*>(&e)         ? "BufferError"
                     : dynamic_cast<const c10::LinAlgError*>(&e)         ? "LinAlgError"
                     : dynamic_cast<const c10::OutOfMemoryError*>(&e)    ? "OutOfMemoryError"
                     : dynamic_cast<const c10::AcceleratorError*>(&e)    ? "AcceleratorError"
                                                                         : nullptr;
  absl::Status s = absl::InternalError(absl::StrCat(context, e.what_without_backtrace()));
  if (type != nullptr) s.SetPayload(kErrorType, absl::Cord(type));
  return s;
}

absl::Status WithContext(const absl::Status& s, absl::string_view prefix) {
  absl::Status out(s.code(), absl::StrCat(prefix, s.message()));
  s.ForEachPayload([&](absl::string_view url, const absl::Cord& payload) { out.SetPayload(url, payload); });
  return out;
}

std::string ErrorType(const absl::Status& s) {
  const auto type = s.GetPayload(kErrorType);
  return type.has_value() ? std::string(*type) : std::string();
}

void ThrowKernelError(const absl::Status& s) {
  const std::string type = ErrorType(s), message(s.message());
  TORCH_CHECK_INDEX(type != "IndexError", message);
  TORCH_CHECK_VALUE(type != "ValueError", message);
  TORCH_CHECK_TYPE(type != "TypeError", message);
  TORCH_CHECK_NOT_IMPLEMENTED(type != "NotImplementedError", message);
  TORCH_CHECK_BUFFER(type != "BufferError", message);
  TORCH_CHECK_LINALG(type != "LinAlgError", message);
  TORCH_CHECK_WITH(OutOfMemoryError, type != "OutOfMemoryError", message);
}

namespace {

int64_t FloorDivInt(int64_t a, int64_t b) {  // Python: rounds toward negative infinity
  const int64_t q = a / b;
  return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}
int64_t ModInt(int64_t a, int64_t b) {  // Python: the result takes the divisor's sign
  const int64_t r = a % b;
  return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}
// Python's float divmod (Objects/floatobject.c), so that // and % on floats match it exactly.
std::pair<double, double> DivModFloat(double a, double b) {
  double mod = std::fmod(a, b);
  double div = (a - mod) / b;
  if (mod != 0) {
    if ((b < 0) != (mod < 0)) {
      mod += b;
      div -= 1.0;
    }
  } else {
    mod = std::copysign(0.0, b);
  }
  double floordiv;
  if (div != 0) {
    floordiv = std::floor(div);
    if (div - floordiv > 0.5) floordiv += 1.0;
  } else {
    floordiv = std::copysign(0.0, a / b);
  }
  return {floordiv, mod};
}
int64_t AsInt(const c10::IValue& v) { return v.isBool() ? v.toBool() : v.toInt(); }

int BitLength(unsigned __int128 x) {
  const uint64_t hi = static_cast<uint64_t>(x >> 64), lo = static_cast<uint64_t>(x);
  if (hi != 0) return 128 - __builtin_clzll(hi);
  return lo == 0 ? 0 : 64 - __builtin_clzll(lo);
}

// int / int as Python computes it: the exact quotient rounded once to the nearest double (a
// double division of the operands rounds them first when they are beyond 2**53). The quotient
// is taken with at least 55 bits and a sticky bit for any remainder, so that converting it to
// double rounds as the exact value would (CPython's long_true_divide does the same).
double TrueDivInt(int64_t a, int64_t b) {
  constexpr int64_t kExact = int64_t{1} << 53;
  if (a >= -kExact && a <= kExact && b >= -kExact && b <= kExact) {
    return static_cast<double>(a) / static_cast<double>(b);
  }
  const bool negative = (a < 0) != (b < 0);
  const unsigned __int128 ua = a < 0 ? -static_cast<unsigned __int128>(a) : a;
  const unsigned __int128 ub = b < 0 ? -static_cast<unsigned __int128>(b) : b;
  const int shift = std::max(0, 55 + BitLength(ub) - BitLength(ua));
  const unsigned __int128 num = ua << shift;
  uint64_t q = static_cast<uint64_t>(num / ub);
  if (num % ub != 0) q |= 1;
  const double r = std::ldexp(static_cast<double>(q), -shift);
  return negative ? -r : r;
}
double AsDouble(const c10::IValue& v) { return v.isDouble() ? v.toDouble() : AsInt(v); }

}  // namespace

// Over 80 lines: one case per SymOp, each with Python's own rule for ints and floats, side by side.
absl::StatusOr<c10::IValue> EvalSymArith(SymOp op, const c10::IValue& a, const c10::IValue& b) {
  for (const c10::IValue* v : {&a, &b}) {
    if (v == &b && SymOpArity(op) == 1) break;
    if (!v->isInt() && !v->isDouble() && !v->isBool()) {
      return absl::InvalidArgumentError(
          absl::StrCat("symbolic arithmetic on a ", v->tagKind(), " (want int, float or bool)"));
    }
  }
  const bool is_float = a.isDouble() || (SymOpArity(op) == 2 && b.isDouble());
  const bool divides = op == SymOp::kTrueDiv || op == SymOp::kFloorDiv || op == SymOp::kMod;
  if (divides && AsDouble(b) == 0) return absl::InvalidArgumentError("division by zero");
  int64_t r = 0;
  // Reads r after `overflow` is computed (the call's arguments have no order between them).
  auto Checked = [&r](bool overflow) -> absl::StatusOr<c10::IValue> {
    if (overflow) {
      absl::Status s = absl::OutOfRangeError("integer overflow: the result does not fit in 64 bits");
      s.SetPayload(kErrorType, absl::Cord("OverflowError"));
      return s;
    }
    return c10::IValue(r);
  };
  switch (op) {
    case SymOp::kAdd:
      if (is_float) return AsDouble(a) + AsDouble(b);
      return Checked(__builtin_add_overflow(AsInt(a), AsInt(b), &r));
    case SymOp::kSub:
      if (is_float) return AsDouble(a) - AsDouble(b);
      return Checked(__builtin_sub_overflow(AsInt(a), AsInt(b), &r));
    case SymOp::kMul:
      if (is_float) return AsDouble(a) * AsDouble(b);
      return Checked(__builtin_mul_overflow(AsInt(a), AsInt(b), &r));
    case SymOp::kTrueDiv:
      return is_float ? AsDouble(a) / AsDouble(b) : TrueDivInt(AsInt(a), AsInt(b));
    case SymOp::kFloorDiv:
      if (is_float) return DivModFloat(AsDouble(a), AsDouble(b)).first;
      if (AsInt(b) == -1) return Checked(__builtin_sub_overflow(int64_t{0}, AsInt(a), &r));
      return FloorDivInt(AsInt(a), AsInt(b));
    case SymOp::kMod:
      if (is_float) return DivModFloat(AsDouble(a), AsDouble(b)).second;
      if (AsInt(b) == -1) return int64_t{0};  // (INT64_MIN % -1 traps in C++)
      return ModInt(AsInt(a), AsInt(b));
    case SymOp::kPow: {
      if (is_float || AsInt(b) < 0) return std::pow(AsDouble(a), AsDouble(b));
      // Python ints have no bound; graph ints are int64, so an overflow is an error, not a wrap.
      int64_t base = AsInt(a);
      bool overflow = false;
      r = 1;
      for (int64_t e = AsInt(b); e > 0 && !overflow; e >>= 1) {
        if (e & 1) overflow |= __builtin_mul_overflow(r, base, &r);
        if (e > 1) overflow |= __builtin_mul_overflow(base, base, &base);
      }
      return Checked(overflow);
    }
    case SymOp::kMax: case SymOp::kMin: {
      const bool first = (op == SymOp::kMax) == (AsDouble(a) >= AsDouble(b));
      const c10::IValue& pick = first ? a : b;
      return is_float ? c10::IValue(AsDouble(pick)) : c10::IValue(AsInt(pick));
    }
    case SymOp::kEq: return AsDouble(a) == AsDouble(b) && (is_float || AsInt(a) == AsInt(b));
    case SymOp::kNe: return !(AsDouble(a) == AsDouble(b) && (is_float || AsInt(a) == AsInt(b)));
    case SymOp::kLt: return is_float ? AsDouble(a) < AsDouble(b) : AsInt(a) < AsInt(b);
    case SymOp::kLe: return is_float ? AsDouble(a) <= AsDouble(b) : AsInt(a) <= AsInt(b);
    case SymOp::kGt: return is_float ? AsDouble(a) > AsDouble(b) : AsInt(a) > AsInt(b);
    case SymOp::kGe: return is_float ? AsDouble(a) >= AsDouble(b) : AsInt(a) >= AsInt(b);
    case SymOp::kAnd: case SymOp::kOr: case SymOp::kXor: {
      if (is_float) return absl::InvalidArgumentError("bitwise operation on a float");
      const int64_t x = AsInt(a), y = AsInt(b);
      const int64_t bits = op == SymOp::kAnd ? (x & y) : op == SymOp::kOr ? (x | y) : (x ^ y);
      if (a.isBool() && b.isBool()) return bits != 0;
      return bits;
    }
    case SymOp::kLShift: case SymOp::kRShift: {
      if (is_float) return absl::InvalidArgumentError("shift of a float");
      const int64_t x = AsInt(a), n = AsInt(b);
      if (n < 0) return absl::InvalidArgumentError("negative shift count");
      if (op == SymOp::kRShift) return n >= 64 ? (x < 0 ? -1 : 0) : (x >> n);
      if (x == 0) return int64_t{0};
      return Checked(n >= 63 || __builtin_mul_overflow(x, int64_t{1} << n, &r));
    }
    case SymOp::kNeg:
      if (is_float) return -AsDouble(a);
      return Checked(__builtin_sub_overflow(int64_t{0}, AsInt(a), &r));
    case SymOp::kPos: return is_float ? c10::IValue(AsDouble(a)) : c10::IValue(AsInt(a));
    case SymOp::kAbs:
      if (is_float) return std::fabs(AsDouble(a));
      if (AsInt(a) >= 0) return AsInt(a);
      return Checked(__builtin_sub_overflow(int64_t{0}, AsInt(a), &r));
    case SymOp::kNot: return AsDouble(a) == 0;
    case SymOp::kFloat: return AsDouble(a);
    case SymOp::kTrunc: return is_float ? static_cast<int64_t>(std::trunc(AsDouble(a))) : AsInt(a);
    case SymOp::kFloor: return is_float ? static_cast<int64_t>(std::floor(AsDouble(a))) : AsInt(a);
    case SymOp::kCeil: return is_float ? static_cast<int64_t>(std::ceil(AsDouble(a))) : AsInt(a);
    case SymOp::kRound: return is_float ? static_cast<int64_t>(std::nearbyint(AsDouble(a))) : AsInt(a);
    case SymOp::kSqrt: return std::sqrt(AsDouble(a));
  }
  return absl::InternalError("unknown symbolic arithmetic");
}

c10::IValue MaterializeArg(const Arg& arg, const c10::TypePtr& type,
                           const std::vector<c10::IValue>& env) {
  switch (arg.kind) {
    case Arg::Kind::kConstant: return arg.constant;
    case Arg::Kind::kValue: {
      const c10::IValue& v = env[arg.value];
      return IsTensorType(type) ? WrapNumber(v) : v;
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

absl::Status CheckInputs(const Graph& graph, const std::vector<c10::IValue>& inputs, int bound) {
  const auto& ids = graph.inputs();
  if (inputs.size() != ids.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("expected ", ids.size(), " inputs, got ", inputs.size()));
  }
  for (size_t i = 0; i < ids.size(); ++i) {
    const ValueInfo& info = graph.values()[ids[i]];
    const c10::IValue& v = inputs[i];
    const int k = static_cast<int>(i);
    const std::string where =
        bound == 0 ? absl::StrCat("input ", k, " (", info.name, ")")
        : k < bound ? absl::StrCat("bound input ", k, " (", info.name, ")")
                    : absl::StrCat("argument ", k - bound, " (", info.name, ")");
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
  const std::vector<int>& last_use = graph_->last_use();
  free_after_.resize(nodes.size());
  for (ValueId v = 0; v < static_cast<ValueId>(last_use.size()); ++v) {
    if (last_use[v] >= 0 && last_use[v] < static_cast<int>(nodes.size())) {
      free_after_[last_use[v]].push_back(v);
    }
  }
  for (const Node& n : nodes) {
    scoped_ = scoped_ || (n.kind == NodeKind::kOp && n.op->schema().name() == "torchreplay::scope_enter");
  }
}

std::optional<c10::Device> Interpreter::CudaDevice(const std::vector<c10::IValue>& inputs) {
  for (const auto& v : inputs) {
    if (v.isTensor() && v.toTensor().defined() && v.toTensor().is_cuda()) return v.toTensor().device();
  }
  return std::nullopt;
}

absl::StatusOr<std::vector<c10::IValue>> Interpreter::Run(std::vector<c10::IValue> inputs,
                                                          const Observer* observer) const {
  const Graph& g = *graph_;
  std::vector<c10::IValue> env(g.values().size());  // outlives the ScopeRun: see scopes.h
  const std::optional<c10::Device> cuda = CudaDevice(inputs);
  ScopeRun scopes(cuda.value_or(c10::Device(c10::DeviceType::CPU)));
  const bool hold = scoped_ && cuda.has_value();
  for (size_t i = 0; i < inputs.size() && i < g.inputs().size(); ++i) {
    env[g.inputs()[i]] = std::move(inputs[i]);
  }
  torch::jit::Stack stack;
  const auto& nodes = g.nodes();
  for (int i = 0; i < static_cast<int>(nodes.size()); ++i) {
    const Node& n = nodes[i];
    if (observer != nullptr && observer->before) observer->before(i, env);
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
          auto operand = [&](size_t k) {
            if (k >= n.args.size()) return c10::IValue();
            return n.args[k].kind == Arg::Kind::kValue ? env[n.args[k].value] : n.args[k].constant;
          };
          auto r = EvalSymArith(n.sym_op, operand(0), operand(1));
          if (!r.ok()) {
            return WithContext(r.status(), absl::StrCat("node '", n.name, "': "));
          }
          env[n.outputs[0]] = *std::move(r);
          break;
        }
      }
    } catch (const c10::Error& e) {
      return KernelError(e, absl::StrCat("node '", n.name, "' failed: "));
    } catch (const std::exception& e) {
      return absl::InternalError(absl::StrCat("node '", n.name, "' failed: ", e.what()));
    }
    if (observer != nullptr) {
      if (observer->after) observer->after(i, env);
    } else if (!hold) {
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
