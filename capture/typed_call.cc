// Typed (unboxed) kernel tape steps (Note [Typed steps] in typed_call.h).
#include "capture/typed_call.h"

#include <algorithm>
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
struct DimsArg {  // int[]?: constant under one guard key
  using type = at::OptionalIntArrayRef;
  std::optional<std::vector<int64_t>> value;
  at::OptionalIntArrayRef get(const Slots&) const {
    return value.has_value() ? at::OptionalIntArrayRef(*value) : at::OptionalIntArrayRef();
  }
};
using DtypeArg = ConstArg<std::optional<c10::ScalarType>, std::optional<c10::ScalarType>>;  // ScalarType?

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
  } else if constexpr (std::is_same_v<A, DimsArg>) {
    if (per_call || !(v.isNone() || v.isIntList())) return false;
    if (v.isIntList()) a->value = v.toIntVector();
  } else if constexpr (std::is_same_v<A, DtypeArg>) {
    if (per_call || !(v.isNone() || v.isInt())) return false;
    if (v.isInt()) a->value = static_cast<c10::ScalarType>(v.toInt());
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

// One letter per argument: T tensor, S scalar, s optional scalar, I int, B bool, L optional int
// list, D optional dtype, O out tensor.
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
    } else if (t->kind() == c10::TypeKind::OptionalType && t->containedType(0)->kind() == c10::TypeKind::ListType &&
               t->containedType(0)->containedType(0)->kind() == c10::TypeKind::IntType) {
      code += 'L';
    } else if (t->kind() == c10::TypeKind::OptionalType && a.name() == "dtype" &&
               (t->containedType(0)->kind() == c10::TypeKind::ScalarTypeType ||
                t->containedType(0)->kind() == c10::TypeKind::IntType)) {  // ScalarType? (an int at run time)
      code += 'D';
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
  if (code == "TLBDO") return MakeTyped<T, DimsArg, BoolArg, DtypeArg, O>(op, args, slot_of);  // sum, mean
  return nullptr;
}

namespace {

class CatCopies final : public TypedCall {
 public:
  CatCopies(std::vector<CatInput> inputs, int64_t dim, at::Tensor out) : out_(std::move(out)) {
    int64_t at = 0;  // where each input starts along dim
    for (CatInput& in : inputs) {
      Block b;
      b.dst = out_.dim() == 0 ? 0 : at * out_.stride(dim);
      // The input's dims with its strides and the result's, adjacent dims merged where both
      // tensors walk them as one (a dense run), so the copies are as long as they can be.
      for (int64_t d = 0; d < out_.dim(); ++d) {
        if (in.sizes[d] == 1) continue;
        if (!b.sizes.empty() && b.in_strides.back() == in.sizes[d] * in.strides[d] &&
            b.out_strides.back() == in.sizes[d] * out_.stride(d)) {
          b.sizes.back() *= in.sizes[d];
          b.in_strides.back() = in.strides[d];
          b.out_strides.back() = out_.stride(d);
        } else {
          b.sizes.push_back(in.sizes[d]);
          b.in_strides.push_back(in.strides[d]);
          b.out_strides.push_back(out_.stride(d));
        }
      }
      b.empty = std::any_of(in.sizes.begin(), in.sizes.end(), [](int64_t s) { return s == 0; });
      at += out_.dim() == 0 ? 0 : in.sizes[dim];
      blocks_.push_back(std::move(b));
      inputs_.push_back(std::move(in));
    }
  }

  void Run(c10::DispatchKeySet, const Slots& slots) const override {
    char* dst = static_cast<char*>(out_.data_ptr());
    const int64_t item = static_cast<int64_t>(out_.itemsize());
    std::vector<int64_t> index;
    for (size_t k = 0; k < inputs_.size(); ++k) {
      const CatInput& in = inputs_[k];
      const Block& b = blocks_[k];
      const at::Tensor& t = in.tensor.get(slots);
      TORCH_CHECK(t.scalar_type() == out_.scalar_type() && t.sizes() == c10::IntArrayRef(in.sizes) &&
                      t.strides() == c10::IntArrayRef(in.strides) && !t.is_conj() && !t.is_neg(),
                  "torchreplay: an input of a concatenation changed its layout since capture");
      if (b.empty) continue;
      const char* src = static_cast<const char*>(t.const_data_ptr());
      const int64_t rank = static_cast<int64_t>(b.sizes.size());
      if (rank == 0) {  // a single element
        std::memcpy(dst + b.dst * item, src, item);
        continue;
      }
      const int64_t last = b.sizes[rank - 1], in_last = b.in_strides[rank - 1], out_last = b.out_strides[rank - 1];
      const bool rows = in_last == 1 && out_last == 1;
      index.assign(rank, 0);
      int64_t count = 1;
      for (int64_t d = 0; d < rank - 1; ++d) count *= b.sizes[d];
      for (int64_t r = 0; r < count; ++r) {  // every index of the dims before the last
        int64_t s = 0, o = b.dst;
        for (int64_t d = 0; d < rank - 1; ++d) {
          s += index[d] * b.in_strides[d];
          o += index[d] * b.out_strides[d];
        }
        if (rows) {
          std::memcpy(dst + o * item, src + s * item, last * item);
        } else {
          for (int64_t j = 0; j < last; ++j) {
            std::memcpy(dst + (o + j * out_last) * item, src + (s + j * in_last) * item, item);
          }
        }
        for (int64_t d = rank - 2; d >= 0 && ++index[d] == b.sizes[d]; --d) index[d] = 0;
      }
    }
  }

 private:
  struct Block {  // where an input goes in the result, its dims merged
    int64_t dst = 0;  // in elements
    std::vector<int64_t> sizes, in_strides, out_strides;
    bool empty = false;
  };
  std::vector<CatInput> inputs_;
  std::vector<Block> blocks_;
  at::Tensor out_;  // a planned buffer: its elements do not overlap
};

}  // namespace

std::unique_ptr<TypedCall> MakeCatCopies(std::vector<CatInput> inputs, int64_t dim, at::Tensor out) {
  return std::make_unique<CatCopies>(std::move(inputs), dim, std::move(out));
}

}  // namespace torchreplay::capture
