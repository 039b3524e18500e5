// Typed (unboxed) kernel tape steps (Note [Typed steps] in typed_call.h).
#include "capture/tape/typed_call.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <optional>
#include <string>
#include <tuple>

namespace torchreplay::capture::tape {
namespace {

constexpr int64_t kMaxRegionDims = 64;  // at::Tensor has at most 64 dims

struct OutArg {  // Tensor(a!) out: always a planned arena buffer
  using type = at::Tensor&;
  mutable at::Tensor value;
  at::Tensor& get(const Slots&) const { return value; }
};
template <class T, class Ref = const T&>
struct ConstArg {  // int, bool, str: constants under one guard key
  using type = Ref;
  T value;
  Ref get(const Slots&) const { return value; }
};
using IntArg = ConstArg<int64_t, int64_t>;
using BoolArg = ConstArg<bool, bool>;
using StrArg = ConstArg<std::string, c10::string_view>;
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
struct IntListArg {  // int[]: constant under one guard key
  using type = at::IntArrayRef;
  std::vector<int64_t> value;
  at::IntArrayRef get(const Slots&) const { return value; }
};
struct OptTensorArg {  // Tensor?: a constant (a bias), or none
  using type = const std::optional<at::Tensor>&;
  std::optional<at::Tensor> value;
  const std::optional<at::Tensor>& get(const Slots&) const { return value; }
};

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
  } else if constexpr (std::is_same_v<A, StrArg>) {
    if (per_call || !v.isString()) return false;
    a->value = v.toStringRef();
  } else if constexpr (std::is_same_v<A, IntListArg>) {
    if (per_call || !v.isIntList()) return false;
    a->value = v.toIntVector();
  } else if constexpr (std::is_same_v<A, OptTensorArg>) {
    if (per_call || !(v.isNone() || v.isTensor())) return false;
    if (v.isTensor()) a->value = v.toTensor();
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

// One letter per argument: T tensor, t optional tensor, S scalar, s optional scalar, I int, B bool,
// c str, l int list, L optional int list, D optional dtype, O out tensor.
std::string SignatureCode(const c10::FunctionSchema& schema) {
  std::string code;
  for (const auto& a : schema.arguments()) {
    const c10::TypePtr& t = a.type();
    if (a.is_out() && t->kind() == c10::TypeKind::TensorType) {
      code += 'O';
    } else if (t->kind() == c10::TypeKind::TensorType) {
      code += 'T';
    } else if (t->kind() == c10::TypeKind::OptionalType &&
               t->containedType(0)->kind() == c10::TypeKind::TensorType) {
      code += 't';
    } else if (t->kind() == c10::TypeKind::ListType && t->containedType(0)->kind() == c10::TypeKind::IntType) {
      code += 'l';
    } else if (t->kind() == c10::TypeKind::NumberType) {
      code += 'S';
    } else if (t->kind() == c10::TypeKind::OptionalType &&
               t->containedType(0)->kind() == c10::TypeKind::NumberType) {
      code += 's';
    } else if (t->kind() == c10::TypeKind::IntType) {
      code += 'I';
    } else if (t->kind() == c10::TypeKind::BoolType) {
      code += 'B';
    } else if (t->kind() == c10::TypeKind::StringType) {
      code += 'c';
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
  if (code == "TTTcO") return MakeTyped<T, T, T, StrArg, O>(op, args, slot_of);  // torchreplay::small_gemm
  if (code == "TTTTcO") return MakeTyped<T, T, T, T, StrArg, O>(op, args, slot_of);  // small_gemm_scaled
  if (code == "TssO") return MakeTyped<T, OptScalarArg, OptScalarArg, O>(op, args, slot_of);
  if (code == "TIBO") return MakeTyped<T, IntArg, BoolArg, O>(op, args, slot_of);
  if (code == "TLBDO") return MakeTyped<T, DimsArg, BoolArg, DtypeArg, O>(op, args, slot_of);  // sum, mean
  using Ints = IntListArg;
  if (code == "TTTtlllcO") {  // torchreplay::depthwise_conv2d
    return MakeTyped<T, T, T, OptTensorArg, Ints, Ints, Ints, StrArg, O>(op, args, slot_of);
  }
  if (code == "TTTllllcBO") {  // torchreplay::conv_gemm
    return MakeTyped<T, T, T, Ints, Ints, Ints, Ints, StrArg, BoolArg, O>(op, args, slot_of);
  }
  return nullptr;
}

namespace {

class BoxedCall final : public TypedCall {
 public:
  BoxedCall(c10::OperatorHandle op, Slots args, std::vector<int> slot_of)
      : op_(std::move(op)), args_(std::move(args)), slot_of_(std::move(slot_of)) {}
  void Run(c10::DispatchKeySet keys, const Slots& slots) const override {
    stack_.assign(args_.begin(), args_.end());
    for (size_t i = 0; i < slot_of_.size(); ++i) {
      if (slot_of_[i] >= 0) stack_[i] = slots[slot_of_[i]];
    }
    op_.redispatchBoxed(keys, &stack_);
    stack_.clear();  // keeps nothing of the call alive
  }

 private:
  c10::OperatorHandle op_;
  Slots args_;
  std::vector<int> slot_of_;
  mutable std::vector<c10::IValue> stack_;  // a tape runs on one thread
};

}  // namespace

std::unique_ptr<TypedCall> MakeBoxedCall(const c10::OperatorHandle& op, const Slots& args,
                                         const std::vector<int>& slot_of) {
  for (int s : slot_of) {
    if (s < -1) return nullptr;
  }
  return std::make_unique<BoxedCall>(op, args, slot_of);
}

namespace {

// A strided region of elements to copy (Note [Copies]): its dims, the source's and the
// destination's strides (in elements), walked in the destination's memory order (outermost
// first: a channels-last image's channels innermost, not its width), adjacent dims merged where
// both walk them as one dense run, so that the copies are as long as they can be. Each element
// goes to its own place whatever the order (a planned buffer, or a slice, does not overlap itself).
struct Region {
  std::vector<int64_t> sizes, src_strides, dst_strides;
  bool empty = false;
};

Region MakeRegion(c10::IntArrayRef sizes, c10::IntArrayRef src_strides, c10::IntArrayRef dst_strides) {
  Region r;
  std::vector<size_t> order(sizes.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return dst_strides[a] != dst_strides[b] ? dst_strides[a] > dst_strides[b] : src_strides[a] > src_strides[b];
  });
  for (size_t d : order) {
    r.empty = r.empty || sizes[d] == 0;
    if (sizes[d] == 1) continue;
    if (!r.sizes.empty() && r.src_strides.back() == sizes[d] * src_strides[d] &&
        r.dst_strides.back() == sizes[d] * dst_strides[d]) {
      r.sizes.back() *= sizes[d];
      r.src_strides.back() = src_strides[d];
      r.dst_strides.back() = dst_strides[d];
    } else {
      r.sizes.push_back(sizes[d]);
      r.src_strides.push_back(src_strides[d]);
      r.dst_strides.push_back(dst_strides[d]);
    }
  }
  return r;
}

// Copies the region's elements of `item` bytes from `src` to `dst` (each at the region's first
// element): memcpy of whole rows where the last dim is dense in both.
void CopyRegion(const Region& r, char* dst, const char* src, int64_t item) {
  if (r.empty) return;
  const int64_t rank = static_cast<int64_t>(r.sizes.size());
  if (rank == 0) {  // a single element
    std::memcpy(dst, src, item);
    return;
  }
  const int64_t last = r.sizes[rank - 1], src_last = r.src_strides[rank - 1], dst_last = r.dst_strides[rank - 1];
  const bool rows = src_last == 1 && dst_last == 1;
  int64_t count = 1;
  for (int64_t d = 0; d < rank - 1; ++d) count *= r.sizes[d];
  int64_t index[kMaxRegionDims] = {};
  TORCH_INTERNAL_ASSERT(rank <= kMaxRegionDims);
  for (int64_t k = 0; k < count; ++k) {  // every index of the dims before the last
    int64_t s = 0, o = 0;
    for (int64_t d = 0; d < rank - 1; ++d) {
      s += index[d] * r.src_strides[d];
      o += index[d] * r.dst_strides[d];
    }
    if (rows) {
      std::memcpy(dst + o * item, src + s * item, last * item);
    } else {
      for (int64_t j = 0; j < last; ++j) {
        std::memcpy(dst + (o + j * dst_last) * item, src + (s + j * src_last) * item, item);
      }
    }
    for (int64_t d = rank - 2; d >= 0 && ++index[d] == r.sizes[d]; --d) index[d] = 0;
  }
}

class CatCopies final : public TypedCall {
 public:
  // `stack`: each input is one slice of out along dim (a stack), not a block of slices (a cat).
  CatCopies(std::vector<CatInput> inputs, int64_t dim, at::Tensor out, bool stack) : out_(std::move(out)) {
    std::vector<int64_t> slice_strides = out_.strides().vec();
    if (stack) slice_strides.erase(slice_strides.begin() + dim);
    int64_t at = 0;  // where each input starts along dim
    for (CatInput& in : inputs) {
      const int64_t dst = out_.dim() == 0 ? 0 : at * out_.stride(dim);
      at += out_.dim() == 0 ? 0 : stack ? 1 : in.sizes[dim];
      blocks_.push_back({dst, MakeRegion(in.sizes, in.strides, stack ? slice_strides : out_.strides().vec())});
      inputs_.push_back(std::move(in));
    }
  }

  void Run(c10::DispatchKeySet, const Slots& slots) const override {
    char* dst = static_cast<char*>(out_.data_ptr());
    const int64_t item = static_cast<int64_t>(out_.itemsize());
    for (size_t k = 0; k < inputs_.size(); ++k) {
      const CatInput& in = inputs_[k];
      const at::Tensor& t = in.tensor.get(slots);
      CheckLayout(t, out_.scalar_type(), in.sizes, in.strides);
      CopyRegion(blocks_[k].second, dst + blocks_[k].first * item, static_cast<const char*>(t.const_data_ptr()), item);
    }
  }

 private:
  std::vector<CatInput> inputs_;
  std::vector<std::pair<int64_t, Region>> blocks_;  // where each input goes (in elements), and how
  at::Tensor out_;  // a planned buffer: its elements do not overlap
};

// self.index_copy_(dim, index, source) with one index: source's only slice along dim copied to
// self's slice at index[0], after eager's bounds check.
class IndexCopyOne final : public TypedCall {
 public:
  IndexCopyOne(CatInput self, int64_t dim, TensorArg index, CatInput source)
      : self_(std::move(self)), dim_(dim), index_(std::move(index)), source_(std::move(source)) {
    std::vector<int64_t> sizes = source_.sizes, dst = self_.strides;
    sizes.erase(sizes.begin() + dim_);
    dst.erase(dst.begin() + dim_);
    std::vector<int64_t> src = source_.strides;
    src.erase(src.begin() + dim_);
    region_ = MakeRegion(sizes, src, dst);
  }

  void Run(c10::DispatchKeySet, const Slots& slots) const override {
    const at::Tensor& self = self_.tensor.get(slots);
    const at::Tensor& source = source_.tensor.get(slots);
    CheckLayout(self, self.scalar_type(), self_.sizes, self_.strides);
    CheckLayout(source, self.scalar_type(), source_.sizes, source_.strides);
    const int64_t i = *index_.get(slots).const_data_ptr<int64_t>();
    const int64_t size = self_.sizes[dim_];
    TORCH_CHECK_INDEX(i >= 0 && i < size, "index_copy_(): index ", i, " is out of bounds for dimension ", dim_,
                      " with size ", size);
    const int64_t item = static_cast<int64_t>(self.itemsize());
    CopyRegion(region_, static_cast<char*>(self.data_ptr()) + i * self_.strides[dim_] * item,
               static_cast<const char*>(source.const_data_ptr()), item);
  }

 private:
  CatInput self_;
  int64_t dim_;
  TensorArg index_;  // int64, one element
  CatInput source_;
  Region region_;
};

// embedding(weight, indices): row indices[k] of weight copied to row k of out, after eager's
// bounds check.
class EmbeddingRows final : public TypedCall {
 public:
  EmbeddingRows(CatInput weight, TensorArg indices, at::Tensor out) : weight_(std::move(weight)), indices_(std::move(indices)), out_(std::move(out)) {
    row_ = MakeRegion({weight_.sizes[1]}, {weight_.strides[1]}, {1});
  }

  void Run(c10::DispatchKeySet, const Slots& slots) const override {
    const at::Tensor& weight = weight_.tensor.get(slots);
    CheckLayout(weight, out_.scalar_type(), weight_.sizes, weight_.strides);
    const at::Tensor& indices = indices_.get(slots);
    const int64_t* idx = indices.const_data_ptr<int64_t>();
    const int64_t n = indices.numel(), rows = weight_.sizes[0], width = weight_.sizes[1];
    const int64_t item = static_cast<int64_t>(out_.itemsize());
    const char* src = static_cast<const char*>(weight.const_data_ptr());
    char* dst = static_cast<char*>(out_.data_ptr());
    for (int64_t k = 0; k < n; ++k) {
      TORCH_CHECK_INDEX(idx[k] >= 0 && idx[k] < rows, "index out of range in self");
    }
    for (int64_t k = 0; k < n; ++k) {
      CopyRegion(row_, dst + k * width * item, src + idx[k] * weight_.strides[0] * item, item);
    }
  }

 private:
  CatInput weight_;    // 2-d
  TensorArg indices_;  // int64, contiguous
  at::Tensor out_;     // a planned buffer, contiguous: (indices..., width)
  Region row_;
};

}  // namespace

void CheckLayout(const at::Tensor& t, c10::ScalarType dtype, const std::vector<int64_t>& sizes,
                 const std::vector<int64_t>& strides) {
  TORCH_CHECK(t.scalar_type() == dtype && t.sizes() == c10::IntArrayRef(sizes) &&
                  t.strides() == c10::IntArrayRef(strides) && !t.is_conj() && !t.is_neg(),
              "torchreplay: an input of a step changed its layout since capture");
}

std::unique_ptr<TypedCall> MakeIndexCopyOne(CatInput self, int64_t dim, TensorArg index, CatInput source) {
  return std::make_unique<IndexCopyOne>(std::move(self), dim, std::move(index), std::move(source));
}

std::unique_ptr<TypedCall> MakeEmbeddingRows(CatInput weight, TensorArg indices, at::Tensor out) {
  return std::make_unique<EmbeddingRows>(std::move(weight), std::move(indices), std::move(out));
}

std::unique_ptr<TypedCall> MakeCatCopies(std::vector<CatInput> inputs, int64_t dim, at::Tensor out, bool stack) {
  return std::make_unique<CatCopies>(std::move(inputs), dim, std::move(out), stack);
}

}  // namespace torchreplay::capture::tape
