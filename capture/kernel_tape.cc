// The CPU kernel tape.
//
// Note [What is decided at capture]
// Under one guard key every size, stride and symbolic scalar is fixed, so capture classifies each
// value of the graph as either
//   - constant: non-tensor values, static inputs (parameters: their address is checked by the
//     engine), planned arena buffers, and views of those (precomputed once); or
//   - per call: non-static inputs (rebound, never copied), and results of ops that must run
//     functionally (no out= variant, or an argument that changes per call).
// Each remaining node becomes a Step: a prebuilt argument stack with constants filled in, a few
// patches that drop per-call values into place, and the kernel to redispatch to. Replay walks the
// steps: no Python, no schema lookups, no allocation for out= steps.
//
// Note [Why in-place ops keep their meaning]
// Non-static inputs are bound by reference, so an in-place op on an input (copy_ into a KV cache,
// a running-stats update) writes into the caller's tensor exactly as eager does; its result is the
// same value as its argument, constant or per call alike.
// Prepared pointwise steps call ATen's CPU kernel stubs. DispatchStub's inline code must be
// compiled with the CPU capability set torch itself was built with: on x86-64 that is AVX2 and
// AVX512 (the exported DispatchStubImpl::get_call_ptr takes those kernels). Elsewhere the
// prepared path is compiled out and steps stay ordinary typed calls.
#if defined(__x86_64__) && !defined(TORCHREPLAY_NO_PREPARED_STEPS)
#define TORCHREPLAY_PREPARED_STEPS 1
#ifndef HAVE_AVX512_CPU_DEFINITION
#define HAVE_AVX512_CPU_DEFINITION
#endif
#ifndef HAVE_AVX2_CPU_DEFINITION
#define HAVE_AVX2_CPU_DEFINITION
#endif
#include <ATen/TensorIterator.h>
#include <ATen/native/Activation.h>
#include <ATen/native/BinaryOps.h>
#include <ATen/native/TensorCompare.h>
#include <ATen/native/UnaryOps.h>
#include <ATen/ops/empty_strided.h>
#endif
#include <ATen/EmptyTensor.h>
#include <ATen/core/List.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/TensorImpl.h>

#include <cstdlib>
#include <mutex>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"
#include "capture/stream_graph.h"

namespace torchreplay::capture {
namespace {

// ---------------------------------------------------------------- recording

void RecordTensor(const at::Tensor& t, ValueRecord* r) {
  r->is_tensor = true;
  if (!t.defined()) return;
  r->dtype = t.scalar_type();
  r->device = t.device();
  r->sizes.assign(t.sizes().begin(), t.sizes().end());
  r->strides.assign(t.strides().begin(), t.strides().end());
  r->storage_offset = t.storage_offset();
}

// ---------------------------------------------------------------- out= variants

// For a functional schema, the overload of the same name that takes the same arguments plus one
// keyword-only `out` tensor per return (e.g. aten::add.Tensor -> aten::add.out).
std::optional<c10::OperatorHandle> FindOutVariant(const c10::OperatorHandle& op) {
  static std::mutex mu;
  static absl::flat_hash_map<std::string, std::vector<std::string>>* overloads = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (overloads == nullptr) {
      overloads = new absl::flat_hash_map<std::string, std::vector<std::string>>();
      for (const auto& name : c10::Dispatcher::singleton().getAllOpNames()) {
        (*overloads)[name.name].push_back(name.overload_name);
      }
    }
  }
  const c10::FunctionSchema& fs = op.schema();
  if (fs.is_mutable() || fs.returns().empty()) return std::nullopt;
  for (const auto& r : fs.returns()) {
    if (r.type()->kind() != c10::TypeKind::TensorType) return std::nullopt;
  }
  auto it = overloads->find(fs.name());
  if (it == overloads->end()) return std::nullopt;
  for (const auto& ovl : it->second) {
    if (ovl == fs.overload_name()) continue;
    auto cand = c10::Dispatcher::singleton().findSchema({fs.name(), ovl});
    if (!cand.has_value()) continue;
    const auto& cs = cand->schema();
    const auto& fa = fs.arguments();
    const auto& ca = cs.arguments();
    if (ca.size() != fa.size() + fs.returns().size()) continue;
    bool ok = true;
    for (size_t i = 0; ok && i < fa.size(); ++i) {
      ok = ca[i].name() == fa[i].name() && *ca[i].type() == *fa[i].type();
    }
    for (size_t i = fa.size(); ok && i < ca.size(); ++i) {
      ok = ca[i].is_out() && ca[i].type()->kind() == c10::TypeKind::TensorType;
    }
    // An out= overload with no CPU kernel of its own is usually generated from the functional op
    // (allocate, compute, copy into out): slower than running the op functionally.
    if (ok && cand->hasKernelForDispatchKey(c10::DispatchKey::CPU)) return cand;
  }
  return std::nullopt;
}

bool IsSizeQuery(const std::string& name) {
  static const absl::flat_hash_set<std::string> kSizeOps = {
      "aten::sym_size", "aten::sym_stride", "aten::sym_numel", "aten::sym_storage_offset",
      "aten::size", "aten::stride", "aten::numel", "aten::dim"};
  return kSizeOps.contains(name);
}

bool HasDataDependentShape(const std::string& name) {
  static const absl::flat_hash_set<std::string> kOps = {
      "aten::nonzero", "aten::masked_select", "aten::unique", "aten::_unique", "aten::_unique2",
      "aten::unique_dim", "aten::unique_consecutive", "aten::unique_dim_consecutive",
      "aten::repeat_interleave", "aten::bincount", "aten::argwhere", "aten::nonzero_numpy"};
  return kOps.contains(name);
}

// ---------------------------------------------------------------- typed steps
//
// Note [Typed steps]
// Most steps of real graphs are out= calls with one of a handful of signatures: pointwise unary,
// binary and scalar ops, clamp, softmax, mm/addmm. For those, capture builds a TypedCall holding
// the typed operator handle and the arguments as C++ values, so replay calls the kernel unboxed:
// no IValue stack, no boxing and unboxing around the kernel. Any other step stays boxed.

using Slots = std::vector<c10::IValue>;

struct TensorArg {  // const Tensor&: constant, or a per-call slot
  using type = const at::Tensor&;
  at::Tensor value;
  int slot = -1;
  const at::Tensor& get(const Slots& s) const { return slot < 0 ? value : s[slot].toTensor(); }
};
struct OutArg {  // Tensor(a!) out: always a planned arena buffer
  using type = at::Tensor&;
  mutable at::Tensor value;
  at::Tensor& get(const Slots&) const { return value; }
};
template <class T, class Ref = const T&>
struct ConstArg {  // Scalar, Scalar?, int, bool: constants under one guard key
  using type = Ref;
  T value;
  Ref get(const Slots&) const { return value; }
};
using ScalarArg = ConstArg<c10::Scalar>;
using OptScalarArg = ConstArg<std::optional<c10::Scalar>>;
using IntArg = ConstArg<int64_t, int64_t>;
using BoolArg = ConstArg<bool, bool>;

class FastCall {
 public:
  virtual ~FastCall() = default;
  virtual void Run(c10::DispatchKeySet keys, const Slots& slots) const = 0;
};

template <class... A>
class TypedCall final : public FastCall {
 public:
  using Sig = at::Tensor&(typename A::type...);
  TypedCall(c10::TypedOperatorHandle<Sig> op, std::tuple<A...> args)
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
    if (per_call || !v.isScalar()) return false;
    a->value = v.toScalar();
  } else if constexpr (std::is_same_v<A, OptScalarArg>) {
    if (per_call || !(v.isNone() || v.isScalar())) return false;
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
std::unique_ptr<FastCall> MakeTyped(const c10::OperatorHandle& op, const Slots& args,
                                    const std::vector<int>& slot_of) {
  std::tuple<A...> held;
  bool ok = std::apply(
      [&](A&... a) {
        int i = 0;
        return (... && (i++, FillArg(args[i - 1], slot_of[i - 1] >= 0, slot_of[i - 1], &a)));
      },
      held);
  if (!ok) return nullptr;
  using Sig = typename TypedCall<A...>::Sig;
  try {
    return std::make_unique<TypedCall<A...>>(op.typed<Sig>(), std::move(held));
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

// ---------------------------------------------------------------- prepared pointwise steps
//
// Note [Prepared pointwise steps]
// What is left of a typed out= call on small tensors is mostly ATen building a TensorIterator:
// shapes, strides, dtypes, overlap checks, all fixed under one guard key. For the commonest
// structured pointwise ops (unary float ops, neg, silu, add/sub/mul/div, comparisons, clamp_min:
// relu) the step
// builds the TensorIterator once, the way the op's meta function does, and replay calls the op's
// own CPU kernel stub on it: the same kernel on the same iterator, so results are bitwise those
// of the op. Per-call tensors (same geometry under the key) are swapped in by data pointer; if a
// constant tensor moved (the arena grew for a larger key) the iterator is rebuilt. Only used when
// no operand needs a dtype cast (the iterator would hold a copy made at build time).

#ifdef TORCHREPLAY_PREPARED_STEPS
enum class IterKind { kUnary, kUnaryFloat, kBinary, kBinaryFloat, kComparison };
using StubCall = void (*)(at::TensorIteratorBase&, const c10::Scalar&);

struct PreparedOp {
  IterKind kind;
  StubCall call;
  bool has_scalar;     // add/sub alpha, clamp_min's min: the argument after the tensors
  bool negate_scalar;  // sub: add_stub with -alpha
};

// The op's CPU kernel stub, called on the prepared iterator (with the op's scalar, if any).
template <auto& Stub>
void StubOnly(at::TensorIteratorBase& it, const c10::Scalar&) {
  Stub(c10::kCPU, it);
}
template <auto& Stub>
void StubWithScalar(at::TensorIteratorBase& it, const c10::Scalar& s) {
  Stub(c10::kCPU, it, s);
}

const PreparedOp* FindPreparedOp(const std::string& name) {
  using namespace at::native;  // NOLINT: the stubs
  constexpr IterKind kUnary = IterKind::kUnary, kFloat = IterKind::kUnaryFloat;
  constexpr IterKind kBinary = IterKind::kBinary, kCompare = IterKind::kComparison;
  static const absl::flat_hash_map<std::string, PreparedOp> kOps = {
      {"aten::sin.out", {kFloat, &StubOnly<sin_stub>, false, false}},
      {"aten::cos.out", {kFloat, &StubOnly<cos_stub>, false, false}},
      {"aten::exp.out", {kFloat, &StubOnly<exp_stub>, false, false}},
      {"aten::log.out", {kFloat, &StubOnly<log_stub>, false, false}},
      {"aten::tanh.out", {kFloat, &StubOnly<tanh_stub>, false, false}},
      {"aten::sigmoid.out", {kFloat, &StubOnly<sigmoid_stub>, false, false}},
      {"aten::sqrt.out", {kFloat, &StubOnly<sqrt_stub>, false, false}},
      {"aten::rsqrt.out", {kFloat, &StubOnly<rsqrt_stub>, false, false}},
      {"aten::reciprocal.out", {kFloat, &StubOnly<reciprocal_stub>, false, false}},
      {"aten::erf.out", {kFloat, &StubOnly<erf_stub>, false, false}},
      {"aten::neg.out", {kUnary, &StubOnly<neg_stub>, false, false}},
      {"aten::silu.out", {kUnary, &StubOnly<silu_stub>, false, false}},
      {"aten::clamp_min.out", {kUnary, &StubWithScalar<clamp_min_scalar_stub>, true, false}},
      {"aten::add.out", {kBinary, &StubWithScalar<add_stub>, true, false}},
      {"aten::sub.out", {kBinary, &StubWithScalar<add_stub>, true, true}},
      {"aten::mul.out", {kBinary, &StubOnly<mul_stub>, false, false}},
      {"aten::div.out", {IterKind::kBinaryFloat, &StubOnly<div_true_stub>, false, false}},
      {"aten::lt.Tensor_out", {kCompare, &StubOnly<lt_stub>, false, false}},
      {"aten::le.Tensor_out", {kCompare, &StubOnly<le_stub>, false, false}},
      {"aten::gt.Tensor_out", {kCompare, &StubOnly<gt_stub>, false, false}},
      {"aten::ge.Tensor_out", {kCompare, &StubOnly<ge_stub>, false, false}},
      {"aten::eq.Tensor_out", {kCompare, &StubOnly<eq_stub>, false, false}},
      {"aten::ne.Tensor_out", {kCompare, &StubOnly<ne_stub>, false, false}},
  };
  auto it = kOps.find(name);
  return it == kOps.end() ? nullptr : &it->second;
}

bool PreparedStepsEnabled() {
  static const bool enabled = [] {
    const char* env = std::getenv("TORCHREPLAY_PREPARED_ITERATORS");
    return env == nullptr || std::string(env) != "0";
  }();
  return enabled;
}

class PreparedPointwise final : public FastCall {
 public:
  // operands: out first, then the tensor inputs (TensorIterator's operand order). `typed` is the
  // ordinary typed call, used if the iterator cannot be prepared.
  PreparedPointwise(const PreparedOp& op, std::vector<TensorArg> operands, c10::Scalar scalar,
                    std::unique_ptr<FastCall> typed)
      : op_(op), operands_(std::move(operands)), scalar_(std::move(scalar)), typed_(std::move(typed)) {}

  void Run(c10::DispatchKeySet keys, const Slots& slots) const override {
    if (state_ == State::kUnprepared) {
      // First replay: every per-call operand has its value now.
      state_ = Build(slots) ? State::kPrepared : State::kTyped;
    }
    if (state_ == State::kTyped) return typed_->Run(keys, slots);
    for (size_t i = 0; i < operands_.size(); ++i) {
      if (operands_[i].slot < 0 && operands_[i].value.data_ptr() != built_ptrs_[i]) {
        // The arena moved (a larger key grew it): same geometry, rebuild once.
        if (!Build(slots)) {
          state_ = State::kTyped;
          return typed_->Run(keys, slots);
        }
        break;
      }
    }
    for (size_t i = 0; i < operands_.size(); ++i) {
      if (operands_[i].slot >= 0) {
        iter_->unsafe_replace_operand(static_cast<int64_t>(i),
                                      slots[operands_[i].slot].toTensor().data_ptr());
      }
    }
    op_.call(*iter_, scalar_);
    if (iter_->ntensors() != static_cast<int>(operands_.size())) {
      // Some kernels rewrite the iterator they are given (reduced-precision mul/div/add read a
      // CPU scalar operand's value and remove it): this call was right, but the iterator can
      // no longer be reused. Later calls take the typed call.
      state_ = State::kTyped;
      iter_.reset();
      standins_.clear();
    }
  }

 private:
  // Builds the iterator the way the op's meta function does. False if an operand would need a
  // dtype cast (the iterator would hold a copy made now) or the op's checks fail.
  bool Build(const Slots& slots) const {
    // The iterator borrows its operands. A per-call tensor is gone after the call, so it is built
    // on a stand-in of the same geometry (its own small buffer), whose data pointer each call
    // then replaces; constants are held by the step itself.
    const at::Tensor& out = operands_[0].value;
    if (out.numel() > kMaxPreparedNumel) return false;  // bounds the stand-ins' memory
    std::vector<const at::Tensor*> ops(operands_.size());
    standins_.assign(operands_.size(), at::Tensor());
    for (size_t i = 0; i < operands_.size(); ++i) {
      if (operands_[i].slot >= 0) {
        const at::Tensor& t = slots[operands_[i].slot].toTensor();
        standins_[i] = at::empty_strided(t.sizes(), t.strides(), t.options());
        ops[i] = &standins_[i];
      } else {
        ops[i] = &operands_[i].value;
      }
    }
    try {
      iter_ = std::make_unique<at::TensorIterator>();
      switch (op_.kind) {
        case IterKind::kUnary:
          iter_->build_borrowing_unary_op(out, *ops[1]);
          break;
        case IterKind::kUnaryFloat:
          iter_->build_borrowing_unary_float_op(out, *ops[1]);
          break;
        case IterKind::kBinary:
          iter_->build_borrowing_binary_op(out, *ops[1], *ops[2]);
          break;
        case IterKind::kBinaryFloat:
          iter_->build_borrowing_binary_float_op(out, *ops[1], *ops[2]);
          break;
        case IterKind::kComparison:
          iter_->build_borrowing_comparison_op(out, *ops[1], *ops[2]);
          break;
      }
    } catch (const c10::Error&) {
      return false;
    }
    built_ptrs_.clear();
    for (size_t i = 0; i < operands_.size(); ++i) {
      if (ops[i]->scalar_type() != iter_->dtype(static_cast<int64_t>(i))) return false;
      built_ptrs_.push_back(operands_[i].slot < 0 ? ops[i]->data_ptr() : nullptr);
    }
    return true;
  }

  static constexpr int64_t kMaxPreparedNumel = 1 << 16;

  enum class State { kUnprepared, kPrepared, kTyped };
  const PreparedOp& op_;
  std::vector<TensorArg> operands_;
  c10::Scalar scalar_;
  std::unique_ptr<FastCall> typed_;
  mutable State state_ = State::kUnprepared;
  mutable std::unique_ptr<at::TensorIterator> iter_;
  mutable std::vector<at::Tensor> standins_;
  mutable std::vector<void*> built_ptrs_;
};

// `args` follow the out= schema: tensor inputs, [scalar], out.
std::unique_ptr<FastCall> MakePrepared(const c10::OperatorHandle& op, const Slots& args,
                                       const std::vector<int>& slot_of,
                                       std::unique_ptr<FastCall> typed) {
  if (!PreparedStepsEnabled() || typed == nullptr) return typed;
  const PreparedOp* prepared = FindPreparedOp(OperatorName(op));
  if (prepared == nullptr) return typed;
  const size_t num_inputs = prepared->kind == IterKind::kBinary ||
                                    prepared->kind == IterKind::kBinaryFloat ||
                                    prepared->kind == IterKind::kComparison
                                ? 2
                                : 1;
  if (args.size() != num_inputs + (prepared->has_scalar ? 1 : 0) + 1) return typed;
  if (!args.back().isTensor() || slot_of.back() >= 0) return typed;
  std::vector<TensorArg> operands(1);
  operands[0].value = args.back().toTensor();
  for (size_t i = 0; i < num_inputs; ++i) {
    TensorArg a;
    if (slot_of[i] >= 0) {
      a.slot = slot_of[i];
    } else if (args[i].isTensor() && args[i].toTensor().defined()) {
      a.value = args[i].toTensor();
    } else {
      return typed;
    }
    operands.push_back(std::move(a));
  }
  c10::Scalar scalar;
  if (prepared->has_scalar) {
    if (!args[num_inputs].isScalar()) return typed;
    scalar = args[num_inputs].toScalar();
    if (scalar.isComplex() || scalar.toDouble() != scalar.toDouble()) return typed;  // NaN: fill_
    if (prepared->negate_scalar) scalar = -scalar;
  }
  return std::make_unique<PreparedPointwise>(*prepared, std::move(operands), std::move(scalar),
                                             std::move(typed));
}
#else
std::unique_ptr<FastCall> MakePrepared(const c10::OperatorHandle&, const Slots&,
                                       const std::vector<int>&, std::unique_ptr<FastCall> typed) {
  return typed;
}
#endif  // TORCHREPLAY_PREPARED_STEPS

std::unique_ptr<FastCall> MakeFastCall(const c10::OperatorHandle& op, const Slots& args,
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

// A Python number in a tensor position (`x * 1.01`) is a 0-dim double "wrapped number"; the
// TensorIterator casts it to the op's dtype on every call (a dispatch, an allocation, a copy).
// When every other tensor argument already has the float/double dtype of the result, that cast is
// fixed: do it once here. The kernels read the same value either way (for reduced-precision
// dtypes some kernels read the uncast scalar, so those are left alone).
void PrecastWrappedNumbers(c10::ScalarType out_dtype, Slots* args) {
  if (out_dtype != c10::kFloat && out_dtype != c10::kDouble) return;
  std::vector<size_t> wrapped;
  for (size_t i = 0; i < args->size(); ++i) {
    const c10::IValue& v = (*args)[i];
    if (!v.isTensor() || !v.toTensor().defined()) continue;
    const at::Tensor& t = v.toTensor();
    if (t.unsafeGetTensorImpl()->is_wrapped_number()) {
      if (t.scalar_type() != out_dtype && !c10::isComplexType(t.scalar_type()) &&
          t.scalar_type() != c10::kBool) {
        wrapped.push_back(i);
      }
    } else if (t.scalar_type() != out_dtype) {
      return;
    }
  }
  for (size_t i : wrapped) {
    at::Tensor cast = (*args)[i].toTensor().to(out_dtype);
    cast.unsafeGetTensorImpl()->set_wrapped_number(true);
    (*args)[i] = cast;
  }
}

// An op whose result is a pure function of its (constant) arguments: no random numbers, no
// uninitialized memory, no side effects. Such a node with constant arguments is folded at capture.
bool Deterministic(const c10::OperatorHandle& op) {
  static const absl::flat_hash_set<std::string> kUninitialized = {
      "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty",
      "aten::new_empty_strided", "aten::empty_permuted"};
  const c10::FunctionSchema& fs = op.schema();
  if (fs.is_mutable() || kUninitialized.contains(fs.name()) ||
      op.hasTag(at::Tag::nondeterministic_seeded) || op.hasTag(at::Tag::nondeterministic_bitwise)) {
    return false;
  }
  for (const auto& a : fs.arguments()) {
    if (a.type()->kind() == c10::TypeKind::GeneratorType) return false;
    if (a.type()->kind() == c10::TypeKind::OptionalType &&
        a.type()->containedType(0)->kind() == c10::TypeKind::GeneratorType) {
      return false;
    }
  }
  return fs.name().rfind("aten::", 0) == 0;  // custom ops may keep state of their own
}

// ---------------------------------------------------------------- the tape

struct Patch {
  int arg = 0;    // position in the stack
  int elem = -1;  // element of a list argument, or -1 for the whole argument
  int slot = 0;   // per-call value
};

struct Step {
  enum class Kind : uint8_t { kCall, kGetItem };
  Kind kind = Kind::kCall;
  c10::OperatorHandle op;
  std::vector<c10::IValue> args;  // prebuilt stack
  absl::InlinedVector<Patch, 4> patches;
  absl::InlinedVector<int, 2> out_slots;  // per return: slot to store it in, or -1
  int64_t index = 0;                      // kGetItem
  std::unique_ptr<FastCall> fast;         // set for typed out= steps (Note [Typed steps])
  explicit Step(c10::OperatorHandle h) : op(std::move(h)) {}
};

// How a value is known during replay.
struct Binding {
  bool constant = false;
  c10::IValue value;  // constant
  int slot = -1;      // per call
};

class KernelTape final : public StreamGraph {
 public:
  absl::Status Replay(const std::vector<c10::IValue>& inputs,
                      std::vector<c10::IValue>* outputs) override;
  const CaptureInfo& info() const override { return info_; }
  bool OutputInPool(size_t i) const override { return output_in_pool_[i]; }
  Region OutputRegion(size_t i) const override { return output_region_[i]; }

  CaptureInfo info_;
  std::vector<Step> steps_;
  std::vector<std::pair<int, int>> input_slots_;  // (input position, slot)
  std::vector<Binding> outputs_;
  std::vector<bool> output_in_pool_;
  std::vector<Region> output_region_;  // pool outputs: their root buffer in the arena
  std::vector<c10::IValue> slots_;
  torch::jit::Stack stack_;
  c10::DispatchKeySet keys_{c10::DispatchKey::CPU};
};

absl::Status KernelTape::Replay(const std::vector<c10::IValue>& inputs,
                                std::vector<c10::IValue>* outputs) {
  for (const auto& [pos, slot] : input_slots_) slots_[slot] = inputs[pos];
  try {
    for (Step& s : steps_) {
      if (s.kind == Step::Kind::kGetItem) {
        slots_[s.out_slots[0]] = slots_[s.patches[0].slot].toList().get(s.index);
        continue;
      }
      if (s.fast != nullptr) {
        s.fast->Run(keys_, slots_);
        continue;
      }
      stack_.assign(s.args.begin(), s.args.end());
      for (const Patch& p : s.patches) {
        if (p.elem < 0) {
          stack_[p.arg] = slots_[p.slot];
        } else {
          stack_[p.arg].toList().set(p.elem, slots_[p.slot]);
        }
      }
      s.op.redispatchBoxed(keys_, &stack_);
      for (size_t r = 0; r < s.out_slots.size(); ++r) {
        if (s.out_slots[r] >= 0) slots_[s.out_slots[r]] = std::move(stack_[r]);
      }
      // A list argument is shared with the prebuilt stack: drop this call's tensors from it, as
      // the slots are dropped below, so the step does not keep them alive until the next call.
      for (const Patch& p : s.patches) {
        if (p.elem >= 0) s.args[p.arg].toList().set(p.elem, c10::IValue(at::Tensor()));
      }
    }
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("replay failed: ", e.what_without_backtrace()));
  }
  outputs->clear();
  for (const Binding& b : outputs_) {
    outputs->push_back(b.constant ? b.value : slots_[b.slot]);
  }
  for (auto& v : slots_) v = c10::IValue();
  stack_.clear();
  return absl::OkStatus();
}

at::Tensor ArenaView(const memory_pool::Arena& arena, const ValueRecord& r, int64_t byte_offset) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(
      c10::Storage(arena.storage()), c10::DispatchKeySet(c10::DispatchKey::CPU),
      c10::scalarTypeToTypeMeta(r.dtype));
  impl->set_sizes_and_strides(r.sizes, r.strides, byte_offset / c10::elementSize(r.dtype));
  return at::Tensor(std::move(impl));
}

}  // namespace

absl::StatusOr<std::vector<c10::IValue>> RunAndRecord(const Interpreter& interp,
                                                      std::vector<c10::IValue> inputs,
                                                      Recording* recording) {
  const Graph& g = interp.graph();
  recording->values.assign(g.values().size(), ValueRecord{});
  absl::flat_hash_map<const c10::StorageImpl*, ValueId> owner;
  auto record = [&](ValueId id, const c10::IValue& v) {
    ValueRecord& r = recording->values[id];
    if (v.isTensor()) {
      RecordTensor(v.toTensor(), &r);
      r.root = id;
      if (v.toTensor().defined() && v.toTensor().has_storage()) {
        auto [it, inserted] = owner.emplace(v.toTensor().storage().unsafeGetStorageImpl(), id);
        r.root = it->second;
      }
    } else if (v.isTensorList()) {
      // A list is a view (split, unbind) if every element shares an earlier value's storage;
      // otherwise it is fresh (a _foreach_ result) and owns its elements' storages.
      r.is_list = true;
      r.root = id;
      const c10::List<at::Tensor> list = v.toTensorList();
      bool all_views = true;
      for (const at::Tensor& t : list) {
        if (!t.defined() || !t.has_storage()) continue;
        auto it = owner.find(t.storage().unsafeGetStorageImpl());
        all_views = all_views && it != owner.end();
        if (all_views && r.root == id) r.root = it->second;
      }
      if (!all_views) {
        r.root = id;
        for (const at::Tensor& t : list) {
          if (t.defined() && t.has_storage()) owner.emplace(t.storage().unsafeGetStorageImpl(), id);
        }
      }
    } else {
      r.scalar = v;
    }
  };
  for (size_t i = 0; i < g.inputs().size() && i < inputs.size(); ++i) record(g.inputs()[i], inputs[i]);
  Interpreter::Observer observer = [&](int node, const std::vector<c10::IValue>& env) {
    for (ValueId v : g.nodes()[node].outputs) record(v, env[v]);
  };
  return interp.Run(std::move(inputs), &observer);
}

std::vector<bool> MutatedRoots(const Graph& g, const Recording& rec) {
  std::vector<bool> mutated(g.values().size(), false);
  for (const Node& n : g.nodes()) {
    if (n.kind != NodeKind::kOp || !n.op->schema().is_mutable()) continue;
    const auto& args = n.op->schema().arguments();
    for (size_t a = 0; a < n.args.size() && a < args.size(); ++a) {
      const auto* alias = args[a].alias_info();
      if (alias == nullptr || !alias->isWrite()) continue;
      ForEachValueUse(n.args[a], [&](ValueId v) {
        mutated[rec.values[v].root >= 0 ? rec.values[v].root : v] = true;
      });
    }
  }
  return mutated;
}

absl::Status CheckReplayable(const Graph& g, const Recording& rec) {
  for (const Node& n : g.nodes()) {
    if (n.kind != NodeKind::kOp) continue;
    const std::string base = n.op->schema().name();
    bool mask_index = false;  // x[mask]: as many rows as the mask has true elements
    if (base == "aten::index" && n.args.size() > 1) {
      ForEachValueUse(n.args[1], [&](ValueId v) {
        const c10::ScalarType t = rec.values[v].dtype;
        mask_index = mask_index || t == c10::kBool || t == c10::kByte;
      });
    }
    if (HasDataDependentShape(base) || mask_index) {
      return absl::FailedPreconditionError(absl::StrCat(
          "node '", n.name, "' (", OperatorName(*n.op), ") has a data-dependent output shape"));
    }
    for (ValueId o : n.outputs) {
      if (!rec.values[o].is_tensor && !rec.values[o].is_list && !IsSizeQuery(base)) {
        return absl::FailedPreconditionError(absl::StrCat("node '", n.name, "' (", OperatorName(*n.op),
                                                          ") reads a value from tensor data on the host"));
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<StreamGraph>> CaptureKernelTape(
    std::shared_ptr<const Graph> graph, const Recording& rec,
    const std::vector<c10::IValue>& inputs, memory_pool::Arena* arena) {
  const Graph& g = *graph;
  if (auto s = CheckReplayable(g, rec); !s.ok()) return s;
  auto tape = std::make_unique<KernelTape>();
  const int num_nodes = static_cast<int>(g.nodes().size());
  tape->info_.nodes = num_nodes;
  std::vector<Binding> bind(g.values().size());
  int num_slots = 0;
  std::vector<bool> in_arena(g.values().size(), false);  // value's memory is the arena
  auto new_slot = [&](ValueId v) {
    bind[v].constant = false;
    bind[v].slot = num_slots++;
  };
  auto set_const = [&](ValueId v, c10::IValue c) {
    bind[v].constant = true;
    bind[v].value = std::move(c);
  };

  const std::vector<bool> mutated = MutatedRoots(g, rec);
  std::vector<bool> is_output(g.values().size(), false);  // a graph output's storage (by root)
  for (const auto& a : g.outputs()) {
    ForEachValueUse(a, [&](ValueId v) {
      is_output[v] = true;
      if (rec.values[v].root >= 0) is_output[rec.values[v].root] = true;
    });
  }

  // Liveness of each root value, in node indices: arena buffers are planned from it.
  std::vector<int> last_use(g.values().size(), -1);
  auto use = [&](ValueId v, int at) {
    ValueId root = rec.values[v].root >= 0 ? rec.values[v].root : v;
    last_use[root] = std::max(last_use[root], at);
    last_use[v] = std::max(last_use[v], at);
  };
  for (int i = 0; i < num_nodes; ++i) {
    for (const auto& a : g.nodes()[i].args) ForEachValueUse(a, [&](ValueId v) { use(v, i); });
  }
  for (const auto& a : g.outputs()) ForEachValueUse(a, [&](ValueId v) { use(v, num_nodes); });

  // Builds a step's prebuilt stack from node args; per-call values become patches.
  auto build_args = [&](const Node& n, Step* step) {
    for (size_t a = 0; a < n.args.size(); ++a) {
      const Arg& arg = n.args[a];
      const c10::TypePtr& type = n.arg_types[a];
      if (arg.kind == Arg::Kind::kConstant) {
        step->args.push_back(arg.constant);
      } else if (arg.kind == Arg::Kind::kValue) {
        const Binding& b = bind[arg.value];
        if (b.constant) {
          step->args.push_back(IsTensorType(type) ? WrapNumber(b.value) : b.value);
        } else {
          step->args.emplace_back();
          step->patches.push_back(Patch{static_cast<int>(a), -1, b.slot});
        }
      } else {
        Arg resolved = arg;
        for (size_t e = 0; e < arg.elems.size(); ++e) {
          const Arg& el = arg.elems[e];
          if (el.kind != Arg::Kind::kValue) continue;
          const Binding& b = bind[el.value];
          if (b.constant) {
            resolved.elems[e] = Arg::Const(b.value);
          } else {
            resolved.elems[e] = Arg::Const(at::Tensor());
            step->patches.push_back(Patch{static_cast<int>(a), static_cast<int>(e), b.slot});
          }
        }
        step->args.push_back(MaterializeArg(resolved, type, {}));
      }
    }
  };
  // Values whose contents, not just identity, are fixed under the key: scalars, sizes, and what
  // is folded from them. (Arena buffers and static inputs are constant tensors, but what they
  // hold changes from call to call.)
  std::vector<bool> fixed(g.values().size(), false);
  auto all_fixed = [&](const Node& n) {
    bool all = true;
    for (const auto& a : n.args) ForEachValueUse(a, [&](ValueId v) { all = all && fixed[v]; });
    return all;
  };
  auto all_constant = [&](const Node& n) {
    bool all = true;
    for (const auto& a : n.args) ForEachValueUse(a, [&](ValueId v) { all = all && bind[v].constant; });
    return all;
  };
  auto arena_of_args = [&](const Node& n) {
    bool any = false;
    for (const auto& a : n.args) ForEachValueUse(a, [&](ValueId v) { any = any || in_arena[v]; });
    return any;
  };

  // Runs node `n` once, now, and binds its outputs as constants (in pass 1, only binds them).
  auto precompute = [&](const Node& n, bool build) -> absl::Status {
    if (!build) {
      for (ValueId o : n.outputs) set_const(o, c10::IValue());
      return absl::OkStatus();
    }
    Step probe(*n.op);
    build_args(n, &probe);
    try {
      n.op->callBoxed(&probe.args);
    } catch (const c10::Error& e) {
      return absl::InternalError(absl::StrCat("node '", n.name, "' failed at capture: ",
                                              e.what_without_backtrace()));
    }
    for (size_t o = 0; o < n.outputs.size(); ++o) set_const(n.outputs[o], probe.args[o]);
    ++tape->info_.precomputed;
    return absl::OkStatus();
  };

  // Two passes over the same walk. The first decides how each value is bound and collects the
  // arena requests; the second, with the arena planned, builds the steps and precomputes views.
  std::vector<memory_pool::BufferRequest> requests;
  std::vector<ValueId> request_values;
  absl::flat_hash_map<ValueId, at::Tensor> buffers;
  auto walk = [&](bool build) -> absl::Status {
    num_slots = 0;
    std::fill(bind.begin(), bind.end(), Binding{});
    std::fill(fixed.begin(), fixed.end(), false);
    tape->input_slots_.clear();
    for (size_t i = 0; i < g.inputs().size(); ++i) {
      // Static tensors and scalars are constants; other tensors are rebound per call.
      const ValueId v = g.inputs()[i];
      if (inputs[i].isTensor() && !rec.baked(g, static_cast<int>(i))) {
        new_slot(v);
        tape->input_slots_.emplace_back(static_cast<int>(i), bind[v].slot);
      } else {
        set_const(v, inputs[i]);
        fixed[v] = !inputs[i].isTensor();
      }
    }
    for (int i = 0; i < num_nodes; ++i) {
      const Node& n = g.nodes()[i];
      if (n.kind == NodeKind::kSymArith) {
        set_const(n.outputs[0], rec.values[n.outputs[0]].scalar);
        fixed[n.outputs[0]] = true;
        tape->info_.precomputed += build;
        continue;
      }
      if (n.kind == NodeKind::kGetItem) {
        const ValueId list = n.args[0].value;
        in_arena[n.outputs[0]] = in_arena[list];
        if (bind[list].constant) {
          set_const(n.outputs[0], build ? bind[list].value.toList().get(n.index) : c10::IValue());
          tape->info_.precomputed += build;
        } else {
          new_slot(n.outputs[0]);
          if (build) {
            Step step(*FindOperator("aten::alias"));
            step.kind = Step::Kind::kGetItem;
            step.index = n.index;
            step.patches.push_back(Patch{0, -1, bind[list].slot});
            step.out_slots.push_back(bind[n.outputs[0]].slot);
            tape->steps_.push_back(std::move(step));
          }
        }
        continue;
      }
      const std::string name = OperatorName(*n.op);
      const std::string base = n.op->schema().name();
      bool returns_scalar = false;
      for (ValueId o : n.outputs) {
        returns_scalar = returns_scalar || (!rec.values[o].is_tensor && !rec.values[o].is_list);
      }
      if (returns_scalar) {  // a size query (CheckReplayable refused the others): fixed per key
        for (ValueId o : n.outputs) {
          set_const(o, rec.values[o].scalar);
          fixed[o] = true;
        }
        tape->info_.precomputed += build;
        continue;
      }
      // Which outputs are fresh tensors, and which alias an argument?
      bool all_fresh = true, any_fresh = false;
      for (ValueId o : n.outputs) {
        const bool fresh = (rec.values[o].is_tensor || rec.values[o].is_list) && rec.values[o].root == o;
        all_fresh = all_fresh && fresh;
        any_fresh = any_fresh || fresh;
      }
      const bool mutable_op = n.op->schema().is_mutable();

      if (!mutable_op && !any_fresh && all_constant(n)) {
        // A view (or list of views) of constant tensors: computed once, here.
        const bool from_arena = arena_of_args(n);
        if (auto st = precompute(n, build); !st.ok()) return st;
        for (ValueId o : n.outputs) {
          in_arena[o] = from_arena;
          fixed[o] = all_fixed(n) && !mutated[rec.values[o].root >= 0 ? rec.values[o].root : o];
        }
        continue;
      }

      std::optional<c10::OperatorHandle> out_op;
      c10::IValue extra_arg;  // appended before the out= buffers (relu -> clamp_min.out)
      if (!mutable_op && all_fresh && base != "aten::relu") out_op = FindOutVariant(*n.op);
      if (all_fresh && base == "aten::relu") {
        // ATen's relu is clamp_min(self, 0), which has an out= variant.
        if (auto clamp_min = FindOperator("aten::clamp_min.out"); clamp_min.ok()) {
          out_op = *clamp_min;
          extra_arg = c10::IValue(c10::Scalar(int64_t{0}));
        }
      }
      bool plannable = out_op.has_value();
      for (ValueId o : n.outputs) {
        plannable = plannable && rec.values[o].storage_offset == 0 && rec.values[o].device.is_cpu();
      }
      if (plannable) {
        Step step(*out_op);
        if (build) build_args(n, &step);
        if (build && !extra_arg.isNone()) step.args.push_back(extra_arg);
        if (build) PrecastWrappedNumbers(rec.values[n.outputs[0]].dtype, &step.args);
        for (ValueId o : n.outputs) {
          const ValueRecord& r = rec.values[o];
          if (!build) {
            const int64_t nbytes = static_cast<int64_t>(
                at::detail::computeStorageNbytes(r.sizes, r.strides, c10::elementSize(r.dtype)));
            requests.push_back(memory_pool::BufferRequest{nbytes, i, std::max(last_use[o], i)});
            request_values.push_back(o);
          }
          in_arena[o] = true;
          set_const(o, build ? c10::IValue(buffers.at(o)) : c10::IValue());
          if (build) step.args.push_back(buffers.at(o));
        }
        if (build) {
          step.out_slots.assign(n.outputs.size(), -1);
          std::vector<int> slot_of(step.args.size(), -1);
          bool whole_args = true;
          for (const Patch& p : step.patches) {
            slot_of[p.arg] = p.slot;
            whole_args = whole_args && p.elem < 0;
          }
          if (whole_args) {
            std::unique_ptr<FastCall> typed = MakeFastCall(step.op, step.args, slot_of);
            const FastCall* plain = typed.get();
            step.fast = MakePrepared(step.op, step.args, slot_of, std::move(typed));
            tape->info_.prepared_steps += step.fast != nullptr && step.fast.get() != plain;
          }
          tape->info_.typed_steps += step.fast != nullptr;
          tape->steps_.push_back(std::move(step));
          ++tape->info_.out_variant_steps;
        }
        continue;
      }

      // Made from constants only (arange, scalar_tensor, a cast of a constant, ...): computed
      // once, here, unless something writes into it later or the caller receives it.
      bool foldable = !mutable_op && all_fresh && all_fixed(n) && Deterministic(*n.op);
      for (ValueId o : n.outputs) foldable = foldable && !mutated[o] && !is_output[o];
      if (foldable) {
        if (auto st = precompute(n, build); !st.ok()) return st;
        for (ValueId o : n.outputs) fixed[o] = true;
        continue;
      }

      // Runs as it is, every call.
      Step step(*n.op);
      if (build) build_args(n, &step);
      for (ValueId out : n.outputs) {
        const ValueRecord& r = rec.values[out];
        // An in-place op's result is its argument: same binding, no new slot.
        std::optional<ValueId> same_as;
        if (mutable_op && r.is_tensor && r.root != out) {
          for (const auto& a : n.args) {
            const ValueRecord& ar = a.kind == Arg::Kind::kValue ? rec.values[a.value] : r;
            if (a.kind == Arg::Kind::kValue && ar.root == r.root && ar.sizes == r.sizes &&
                ar.strides == r.strides && ar.storage_offset == r.storage_offset) {
              same_as = a.value;
              break;
            }
          }
        }
        if (same_as.has_value()) {
          bind[out] = bind[*same_as];
          in_arena[out] = in_arena[*same_as];
          step.out_slots.push_back(-1);
        } else {
          new_slot(out);
          in_arena[out] = !r.is_list && r.root != out && in_arena[r.root];
          step.out_slots.push_back(bind[out].slot);
        }
      }
      if (build) {
        if (any_fresh) {
          ++tape->info_.functional_steps;
          tape->info_.functional_ops.push_back(name);
        }
        tape->steps_.push_back(std::move(step));
      }
    }
    return absl::OkStatus();
  };

  if (auto s = walk(/*build=*/false); !s.ok()) return s;
  const memory_pool::ArenaPlan plan = memory_pool::PlanArena(requests);
  arena->Reserve(plan.arena_bytes);
  tape->info_.arena_bytes = plan.arena_bytes;
  tape->info_.tensor_bytes = plan.tensor_bytes;
  for (size_t k = 0; k < requests.size(); ++k) {
    buffers[request_values[k]] = ArenaView(*arena, rec.values[request_values[k]], plan.offsets[k]);
  }
  if (auto s = walk(/*build=*/true); !s.ok()) return s;
  tape->info_.steps = static_cast<int>(tape->steps_.size());
  tape->slots_.resize(num_slots);
  for (const auto& a : g.outputs()) {
    Binding b;
    bool pool = false;
    StreamGraph::Region region;
    if (a.kind == Arg::Kind::kValue) {
      b = bind[a.value];
      pool = in_arena[a.value];
      const ValueId root = rec.values[a.value].root;
      if (auto it = buffers.find(root); pool && root >= 0 && it != buffers.end()) {
        const at::Tensor& buf = it->second;
        region.offset = buf.storage_offset() * static_cast<int64_t>(buf.itemsize());
        region.nbytes = static_cast<int64_t>(at::detail::computeStorageNbytes(
            buf.sizes(), buf.strides(), buf.itemsize()));
      }
    } else {
      b.constant = true;
      b.value = a.constant;
    }
    tape->outputs_.push_back(std::move(b));
    tape->output_in_pool_.push_back(pool);
    tape->output_region_.push_back(region);
  }
  return std::unique_ptr<StreamGraph>(std::move(tape));
}

}  // namespace torchreplay::capture
