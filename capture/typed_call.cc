// Typed (unboxed) kernel tape steps (Note [Typed steps] in typed_call.h).
#include "capture/typed_call.h"

#include <cstring>
#include <optional>
#include <string>
#include <tuple>

namespace torchreplay::capture {
namespace {

struct OutArg {  // Tensor(a!) out: always a planned arena buffer
  using type = at::Tensor&;
  mutable at::Tensor value;
  at::Tensor& get(const Slots&) const { return value; }
};
template <class T, class Ref = const T&>
struct ConstArg {  // int, bool: constants under one guard key
  using type = Ref;
  T value;
  Ref get(const Slots&) const { return value; }
};
using IntArg = ConstArg<int64_t, int64_t>;
using BoolArg = ConstArg<bool, bool>;
template <class T>
struct NumberArg {  // Scalar, Scalar?: a constant, or a scalar input bound per call
  using type = const T&;
  mutable T value;  // a tape runs on one thread
  int slot = -1;
  const T& get(const Slots& s) const {
    if (slot >= 0) value = s[slot].toScalar();
    return value;
  }
};
using ScalarArg = NumberArg<c10::Scalar>;
using OptScalarArg = NumberArg<std::optional<c10::Scalar>>;

template <class... A>
class TypedOpCall final : public TypedCall {
 public:
  using Sig = at::Tensor&(typename A::type...);
  TypedOpCall(c10::TypedOperatorHandle<Sig> op, std::tuple<A...> args)
      : op_(std::move(op)), args_(std::move(args)) {}
  void Run(c10::DispatchKeySet keys, const Slots& slots) const override {
    std::apply([&](const A&... a) { op_.redispatch(keys, a.get(slots)...); }, args_);
  }

 private:
  c10::TypedOperatorHandle<Sig> op_;
  std::tuple<A...> args_;
};

template <class A>
bool FillArg(const c10::IValue& v, bool per_call, int slot, A* a) {
  if constexpr (std::is_same_v<A, TensorArg>) {
    if (per_call) return (a->slot = slot), true;
    if (!v.isTensor()) return false;
    a->value = v.toTensor();
  } else if constexpr (std::is_same_v<A, OutArg>) {
    if (per_call || !v.isTensor()) return false;
    a->value = v.toTensor();
  } else if constexpr (std::is_same_v<A, ScalarArg>) {
    if (per_call) return (a->slot = slot), true;
    if (!v.isScalar()) return false;
    a->value = v.toScalar();
  } else if constexpr (std::is_same_v<A, OptScalarArg>) {
    if (per_call) return (a->slot = slot), true;
    if (!(v.isNone() || v.isScalar())) return false;
    a->value = v.isNone() ? std::nullopt : std::optional<c10::Scalar>(v.toScalar());
  } else if constexpr (std::is_same_v<A, IntArg>) {
    if (per_call || !v.isInt()) return false;
    a->value = v.toInt();
  } else {
    if (per_call || !v.isBool()) return false;
    a->value = v.toBool();
  }
  return true;
}

// `args` is a step's prebuilt stack; `slot_of[i]` the per-call slot of argument i, or -1.
template <class... A>
std::unique_ptr<TypedCall> MakeTyped(const c10::OperatorHandle& op, const Slots& args,
                                    const std::vector<int>& slot_of) {
  std::tuple<A...> held;
  bool ok = std::apply(
      [&](A&... a) {
        int i = 0;
        return (... && (i++, FillArg(args[i - 1], slot_of[i - 1] >= 0, slot_of[i - 1], &a)));
      },
      held);
  if (!ok) return nullptr;
  using Sig = typename TypedOpCall<A...>::Sig;
  try {
    return std::make_unique<TypedOpCall<A...>>(op.typed<Sig>(), std::move(held));
  } catch (const c10::Error&) {  // the kernel's registered C++ signature differs: stay boxed
    return nullptr;
  }
}

// One letter per argument: T tensor, S scalar, s optional scalar, I int, B bool, O out tensor.
std::string SignatureCode(const c10::FunctionSchema& schema) {
  std::string code;
  for (const auto& a : schema.arguments()) {
    const c10::TypePtr& t = a.type();
    if (a.is_out() && t->kind() == c10::TypeKind::TensorType) {
      code += 'O';
    } else if (t->kind() == c10::TypeKind::TensorType) {
      code += 'T';
    } else if (t->kind() == c10::TypeKind::NumberType) {
      code += 'S';
    } else if (t->kind() == c10::TypeKind::OptionalType &&
               t->containedType(0)->kind() == c10::TypeKind::NumberType) {
      code += 's';
    } else if (t->kind() == c10::TypeKind::IntType) {
      code += 'I';
    } else if (t->kind() == c10::TypeKind::BoolType) {
      code += 'B';
    } else {
      code += '?';
    }
  }
  return code;
}

}  // namespace

std::unique_ptr<TypedCall> MakeTypedCall(const c10::OperatorHandle& op, const Slots& args,
                                         const std::vector<int>& slot_of) {
  if (op.schema().returns().size() != 1) return nullptr;
  const std::string code = SignatureCode(op.schema());
  using T = TensorArg;
  using S = ScalarArg;
  using O = OutArg;
  if (code == "TO") return MakeTyped<T, O>(op, args, slot_of);
  if (code == "TTO") return MakeTyped<T, T, O>(op, args, slot_of);
  if (code == "TSO") return MakeTyped<T, S, O>(op, args, slot_of);
  if (code == "TTSO") return MakeTyped<T, T, S, O>(op, args, slot_of);
  if (code == "TSSO") return MakeTyped<T, S, S, O>(op, args, slot_of);
  if (code == "TTTO") return MakeTyped<T, T, T, O>(op, args, slot_of);
  if (code == "TTTSO") return MakeTyped<T, T, T, S, O>(op, args, slot_of);
  if (code == "TTTSSO") return MakeTyped<T, T, T, S, S, O>(op, args, slot_of);
  if (code == "TssO") return MakeTyped<T, OptScalarArg, OptScalarArg, O>(op, args, slot_of);
  if (code == "TIBO") return MakeTyped<T, IntArg, BoolArg, O>(op, args, slot_of);
  return nullptr;
}

namespace {

class CatCopies final : public TypedCall {
 public:
  CatCopies(std::vector<CatInput> inputs, int64_t dim, at::Tensor out)
      : inputs_(std::move(inputs)), dim_(dim), out_(std::move(out)) {}

  void Run(c10::DispatchKeySet, const Slots& slots) const override {
    char* dst = static_cast<char*>(out_.data_ptr());
    const int64_t item = static_cast<int64_t>(out_.itemsize());
    const int64_t rank = out_.dim();
    int64_t at = 0;  // where this input starts along dim
    std::vector<int64_t> index;
    for (const CatInput& in : inputs_) {
      const at::Tensor& t = in.tensor.get(slots);
      TORCH_CHECK(t.scalar_type() == out_.scalar_type() && t.sizes() == c10::IntArrayRef(in.sizes) &&
                      t.strides() == c10::IntArrayRef(in.strides) && !t.is_conj() && !t.is_neg(),
                  "torchreplay: an input of a concatenation changed its layout since capture");
      const char* src = static_cast<const char*>(t.const_data_ptr());
      const int64_t last = in.sizes[rank - 1], out_last = out_.stride(rank - 1);
      const bool rows = in.strides[rank - 1] == 1 && out_last == 1;
      index.assign(rank, 0);
      const int64_t count = t.numel() / std::max<int64_t>(last, 1);
      for (int64_t k = 0; k < count && last > 0; ++k) {  // every index of the dims before the last
        int64_t s = 0, d = dim_ == rank - 1 ? at * out_last : 0;
        for (int64_t i = 0; i < rank - 1; ++i) {
          s += index[i] * in.strides[i];
          d += (index[i] + (i == dim_ ? at : 0)) * out_.stride(i);
        }
        if (rows) {
          std::memcpy(dst + d * item, src + s * item, last * item);
        } else {
          for (int64_t j = 0; j < last; ++j) {
            std::memcpy(dst + (d + j * out_last) * item, src + (s + j * in.strides[rank - 1]) * item, item);
          }
        }
        for (int64_t i = rank - 2; i >= 0 && ++index[i] == in.sizes[i]; --i) index[i] = 0;
      }
      at += in.sizes[dim_];
    }
  }

 private:
  std::vector<CatInput> inputs_;
  int64_t dim_;
  at::Tensor out_;  // a planned buffer: its elements do not overlap
};

}  // namespace

std::unique_ptr<TypedCall> MakeCatCopies(std::vector<CatInput> inputs, int64_t dim, at::Tensor out) {
  return std::make_unique<CatCopies>(std::move(inputs), dim, std::move(out));
}

}  // namespace torchreplay::capture
