// The describer of fused elementwise steps (Note [Fused elementwise steps] in
// fused_elementwise.h): whether the fused kernel computes a node as eager does, and the
// instruction that does (the op table, each form's arguments, dtypes, the TensorIterator's
// geometry).
#include "capture/tape/fused/describer.h"

#include <ATen/Dispatch.h>
#include <ATen/TensorIterator.h>
#include <ATen/Version.h>
#include <ATen/ops/empty_strided.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "absl/container/flat_hash_map.h"

namespace torchreplay::capture::tape::fused {
namespace {


using fused::Instr;
using fused::Op;

static_assert(fused::kGrainSize == at::internal::GRAIN_SIZE, "the fused kernel cuts ranges where eager does");

// How the fused kernel computes an out= overload, and what its arguments are.
enum class Form : uint8_t {
  kUnary,       // (self, out)
  kUnaryScalar, // (self, Scalar, out): pow's exponent, clamp_min's and clamp_max's bound
  kClamp,       // (self, Scalar? min, Scalar? max, out)
  kBinary,      // (self, other, out)
  kAlpha,       // (self, other, Scalar alpha, out): add, sub
  kCompare,     // (self, other, out): a bool result
  kWhere,       // (condition, self, other, out)
  kMaskedFill,  // (self, mask, Scalar value, out)
  kPointwise,   // (self, tensor1, tensor2, Scalar value, out): addcmul, addcdiv
  kScalarBase,  // (Scalar self, exponent, out): pow with a scalar base
  kChannelAffine,  // (x, alpha, beta, weight, bias, mean, var, eps, out): torchreplay::channel_affine
};
struct OpInfo {
  Op op;
  Form form;
  bool exact = false;  // vector and scalar lambdas can differ: the split must be eager's
  bool mkl = false;    // MKL's vector math (vml.h)
  bool ints = false;   // int64 too
  bool sleef = false;  // Sleef in the vector lambda (its AVX2 and AVX512 functions differ on NaNs)
  // exact: eager's kernel is the op's AVX512 one where ATen's CPU capability is AVX512
  // (ALSO_REGISTER_AVX512_DISPATCH); otherwise its AVX2 one, as REGISTER_DISPATCH leaves it there
  bool avx512 = true;
};

const OpInfo* FindOp(const std::string& name) {
  static const absl::flat_hash_map<std::string, OpInfo> kOps = {
      {"aten::neg.out", {Op::kNeg, Form::kUnary}},
      {"aten::abs.out", {Op::kAbs, Form::kUnary}},
      {"aten::round.out", {Op::kRound, Form::kUnary}},
      {"aten::reciprocal.out", {Op::kReciprocal, Form::kUnary}},
      {"aten::rsqrt.out", {Op::kRsqrt, Form::kUnary}},
      {"aten::sigmoid.out", {Op::kSigmoid, Form::kUnary, true, false, false, true}},
      {"aten::silu.out", {Op::kSilu, Form::kUnary, true, false, false, true}},
      {"aten::exp2.out", {Op::kExp2, Form::kUnary, true, false, false, true}},
      {"aten::exp.out", {Op::kExp, Form::kUnary, false, true}},
      {"aten::log.out", {Op::kLog, Form::kUnary, false, true}},
      {"aten::sin.out", {Op::kSin, Form::kUnary, false, true}},
      {"aten::cos.out", {Op::kCos, Form::kUnary, false, true}},
      {"aten::tanh.out", {Op::kTanh, Form::kUnary, false, true}},
      {"aten::erf.out", {Op::kErf, Form::kUnary, false, true}},
      {"aten::sqrt.out", {Op::kSqrt, Form::kUnary, false, true}},
      {"aten::log1p.out", {Op::kLog1p, Form::kUnary, false, false, false, true}},
      {"aten::expm1.out", {Op::kExpm1, Form::kUnary, false, false, false, true}},
      {"aten::pow.Tensor_Scalar_out", {Op::kSquare, Form::kUnaryScalar}},
      {"aten::clamp_min.out", {Op::kClampMin, Form::kUnaryScalar}},
      {"aten::clamp_max.out", {Op::kClampMax, Form::kUnaryScalar}},
      {"aten::clamp.out", {Op::kClamp, Form::kClamp}},
      {"aten::add.out", {Op::kAdd, Form::kAlpha, false, false, true}},
      {"aten::sub.out", {Op::kAdd, Form::kAlpha, false, false, true}},
      {"aten::mul.out", {Op::kMul, Form::kBinary, false, false, true}},
      {"aten::div.out", {Op::kDiv, Form::kBinary}},
      {"aten::maximum.out", {Op::kMaximum, Form::kBinary, true, false, false, false, false}},
      {"aten::clamp_min.Tensor_out", {Op::kMaximum, Form::kBinary, true, false, false, false, false}},
      {"aten::lt.Tensor_out", {Op::kLt, Form::kCompare, false, false, true}},
      {"aten::le.Tensor_out", {Op::kLe, Form::kCompare, false, false, true}},
      {"aten::gt.Tensor_out", {Op::kGt, Form::kCompare, false, false, true}},
      {"aten::ge.Tensor_out", {Op::kGe, Form::kCompare, false, false, true}},
      {"aten::eq.Tensor_out", {Op::kEq, Form::kCompare, false, false, true}},
      {"aten::ne.Tensor_out", {Op::kNe, Form::kCompare, false, false, true}},
      {"aten::where.self_out", {Op::kWhere, Form::kWhere}},
      {"aten::masked_fill.Scalar_out", {Op::kMaskedFill, Form::kMaskedFill}},
      {"aten::addcmul.out", {Op::kAddcmul, Form::kPointwise, false, false, false, true}},
      {"aten::addcdiv.out", {Op::kAddcdiv, Form::kPointwise, false, false, false, true}},
      {"aten::pow.Scalar_out", {Op::kPowScalarBase, Form::kScalarBase, true}},
      {"torchreplay::channel_affine.out", {Op::kChannelAffine, Form::kChannelAffine}},
  };
  auto it = kOps.find(name);
  return it == kOps.end() ? nullptr : &it->second;
}

// Note [In-place instructions]
// An in-place pointwise op (`exp_avg.mul_(beta)`, `param.addcdiv_(m, d)`) runs ATen's structured
// kernel of its out= overload with `out` being `self` (the .Scalar overloads wrap their number as
// the .Tensor ones take it), on the TensorIterator of the same operands: it fuses as that out=
// overload writing into its own self. What changes is that a group may now write memory it read
// before, or that was there before it ran:
//   - within a segment, every access to a tensor some instruction writes (by the storage it
//     views, its byte offset and its strides over the iteration) must be that same mapping, or a
//     new segment starts: a piece-by-piece walk would otherwise read elements another
//     instruction already overwrote, or not yet wrote;
//   - a segment's fallback (FusedStep: a segment whose inputs the kernel does not promise eager's
//     bits for is computed again by its nodes' own kernels, before the next segment runs) reruns
//     the segment from its start, so what the segment overwrites in place of memory it found
//     (the group's inputs, or what an earlier segment wrote) must be as it was: the segment's
//     first instruction writing such a tensor saves each piece of it into a scratch buffer just
//     before it writes the piece (in cache, as the kernel reads it anyway), and the fallback
//     first writes it all back (fused::Restore). Only one segment's copies are needed at a time,
//     so all segments share one scratch allocation, the size of the largest segment's (on a
//     compiled Adam, one parameter's state rather than every parameter's: it stays in the L2
//     cache). Segments that never fall back (no NanCheck) save nothing.
// The op's name in place -> its out= overload.
const char* InPlaceAsOut(const std::string& name) {
  static const absl::flat_hash_map<std::string, const char*> kInPlace = {
      {"aten::neg_", "aten::neg.out"},
      {"aten::abs_", "aten::abs.out"},
      {"aten::reciprocal_", "aten::reciprocal.out"},
      {"aten::rsqrt_", "aten::rsqrt.out"},
      {"aten::sigmoid_", "aten::sigmoid.out"},
      {"aten::silu_", "aten::silu.out"},
      {"aten::exp2_", "aten::exp2.out"},
      {"aten::exp_", "aten::exp.out"},
      {"aten::log_", "aten::log.out"},
      {"aten::sin_", "aten::sin.out"},
      {"aten::cos_", "aten::cos.out"},
      {"aten::tanh_", "aten::tanh.out"},
      {"aten::erf_", "aten::erf.out"},
      {"aten::sqrt_", "aten::sqrt.out"},
      {"aten::log1p_", "aten::log1p.out"},
      {"aten::expm1_", "aten::expm1.out"},
      {"aten::pow_.Scalar", "aten::pow.Tensor_Scalar_out"},
      {"aten::clamp_min_", "aten::clamp_min.out"},
      {"aten::clamp_min_.Tensor", "aten::clamp_min.Tensor_out"},
      {"aten::clamp_max_", "aten::clamp_max.out"},
      {"aten::clamp_", "aten::clamp.out"},
      {"aten::add_.Tensor", "aten::add.out"},
      {"aten::add_.Scalar", "aten::add.out"},
      {"aten::sub_.Tensor", "aten::sub.out"},
      {"aten::sub_.Scalar", "aten::sub.out"},
      {"aten::mul_.Tensor", "aten::mul.out"},
      {"aten::mul_.Scalar", "aten::mul.out"},
      {"aten::div_.Tensor", "aten::div.out"},
      {"aten::div_.Scalar", "aten::div.out"},
      {"aten::addcmul_", "aten::addcmul.out"},
      {"aten::addcdiv_", "aten::addcdiv.out"},
  };
  auto it = kInPlace.find(name);
  return it == kInPlace.end() ? nullptr : it->second;
}

// Elements per iteration of eager's vectorized loop, 2 * Vec::size(), for an op whose AVX512
// kernel is used where the CPU capability is AVX512 (`avx512`: sigmoid, silu, exp2 and pow are
// registered for AVX512) or whose AVX2 kernel is used there too (maximum).
int VecBlock(c10::ScalarType dtype, bool avx512) {
  static const bool capability = at::get_cpu_capability() == "AVX512";
  const int bytes = avx512 && capability ? 64 : 32;
  return 2 * bytes / static_cast<int>(c10::elementSize(dtype));
}

// A tensor operand as the recording saw it (or a constant, or a number made a wrapped tensor).
struct Operand {
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  std::vector<int64_t> sizes, strides;
  bool wrapped = false;  // a number where a Tensor goes (a 0-dim "wrapped number")
  ValueId value = -1;    // the graph value, or -1 for a constant
};

class DescriberImpl {
 public:
  DescriberImpl(const Graph& g, const Recording& rec, const TapePlan& plan) : g_(g), rec_(rec), plan_(plan) {}

  // The instruction computing node `i` (an out= node), with the graph values of its operands
  // (-1 for constants); nullopt if the fused kernel does not compute it as eager does. Every
  // condition under which an op's kernel gives eager's bits, in one reading order (the op, its
  // arguments as ReadForm reads them, dtypes as ReadDtypes reads them, layouts, the vector path);
  // each is one early return.
  std::optional<Instr> Describe(int i, std::vector<ValueId>* values) const {
    const Node& n = g_.nodes()[i];
    const TapePlan::NodePlan& np = plan_.nodes[i];
    if (n.outputs.size() != 1 || n.kind != NodeKind::kOp) return std::nullopt;
    // An out= node, or an in-place one computed as its out= overload into its self (Note
    // [In-place instructions]): the stack is the node's arguments, then (out=) the extra argument
    // (relu's clamp_min bound) and the result.
    const bool in_place = np.decision == TapePlan::Decision::kFunctional && !n.args.empty() &&
                          n.args[0].kind == Arg::Kind::kValue &&
                          plan_.values[n.outputs[0]].same_as == n.args[0].value;
    if (!in_place && (np.decision != TapePlan::Decision::kOutVariant || !np.out.has_value())) return std::nullopt;
    const char* in_place_as = in_place ? InPlaceAsOut(OperatorName(*n.op)) : nullptr;
    if (in_place && in_place_as == nullptr) return std::nullopt;
    const std::string name = in_place ? in_place_as : OperatorName(np.out->op);
    const OpInfo* info = FindOp(name);
    if (info == nullptr || (info->mkl && !fused::MklAvailable())) return std::nullopt;
    const int num_args = static_cast<int>(n.args.size());
    const bool extra = !in_place && !np.out->extra_arg.isNone();
    const int out_pos = in_place ? 0 : num_args + (extra ? 1 : 0);
    const ValueRecord& out_rec = rec_.values[n.outputs[0]];
    if (!out_rec.is_tensor || out_rec.device != c10::kCPU) return std::nullopt;
    const c10::ScalarType out_dtype = out_rec.dtype;
    Instr in;
    in.op = info->op;
    FormArgs form;
    if (!ReadForm(n, np, *info, name, extra, out_dtype, &in, &form)) return std::nullopt;
    const std::vector<int>& inputs = form.inputs;  // stack positions of the tensor inputs
    const bool general_alpha = form.general_alpha;

    // The operands, with the dtype each has when the step runs (wrapped numbers are cast once
    // to a float or double result's dtype at capture: kernel_tape.cc, WrappedNumbersToPrecast).
    std::vector<Operand> ops;
    for (int a : inputs) {
      // A Scalar-typed argument (`add_.Scalar`'s other) is an operand only as a constant: the step
      // makes its wrapped number once.
      if (a < num_args && !IsTensorType(n.arg_types[a]) && n.args[a].kind == Arg::Kind::kValue &&
          !plan_.values[n.args[a].value].constant) {
        return std::nullopt;
      }
      std::optional<Operand> o = OperandOf(n, a);
      if (!o.has_value()) return std::nullopt;
      ops.push_back(*std::move(o));
    }
    bool precast = out_dtype == c10::kFloat || out_dtype == c10::kDouble;
    for (const Operand& o : ops) precast = precast && (o.wrapped || o.dtype == out_dtype);
    for (Operand& o : ops) {
      if (precast && o.wrapped && !c10::isComplexType(o.dtype) && o.dtype != c10::kBool) o.dtype = out_dtype;
    }

    if (!ReadDtypes(*info, ops, out_dtype, form, &in)) return std::nullopt;

    // The geometry the op's TensorIterator gives (built on meta tensors of the recorded shapes).
    Operand out;
    out.dtype = out_dtype, out.sizes = out_rec.sizes, out.strides = out_rec.strides;
    out.value = in_place ? n.args[0].value : n.outputs[0];
    if (in.op == Op::kChannelAffine ? !ChannelGeometry(out, ops, &in) : !Geometry(out, ops, &in)) return std::nullopt;
    // pow of a scalar base: only where eager's loop runs the scalar lambda on every element
    if (in.op == Op::kPowScalarBase && in.numel >= in.vec_block) return std::nullopt;
    if (general_alpha && in.strides[2][0] == 0) return std::nullopt;  // other a scalar within each row
    if (in.vec_block == 0) Coalesce(&in);
    in.operand[0] = out_pos;
    values->assign(1, out.value);
    for (size_t k = 0; k < inputs.size(); ++k) {
      in.operand[k + 1] = inputs[k];
      values->push_back(ops[k].value);
    }
    return in;
  }

 private:
  // What an op's form reads from node `n`'s arguments (constants and values known at capture):
  // the stack positions of its tensor inputs, the instruction's op and parameters. False where
  // the fused kernel does not compute it as eager does: one case per Form, each reading its
  // arguments as that form's ATen kernel does.
  struct FormArgs {
    std::vector<int> inputs;           // stack positions of the tensor inputs
    std::optional<c10::Scalar> value;  // addcmul's, addcdiv's value, cast once the dtype is known
    bool general_alpha = false;        // add's alpha other than +-1
  };
  bool ReadForm(const Node& n, const TapePlan::NodePlan& np, const OpInfo& info, const std::string& name, bool extra,
                c10::ScalarType out_dtype, Instr* in, FormArgs* form) const {
    const int num_args = static_cast<int>(n.args.size());
    auto scalar = [&](int a) -> std::optional<c10::Scalar> {
      if (a == num_args && extra) return np.out->extra_arg.toScalar();
      if (a >= num_args) return std::nullopt;
      const Arg& arg = n.args[a];
      c10::IValue v;
      if (arg.kind == Arg::Kind::kConstant) {
        v = arg.constant;
      } else if (arg.kind == Arg::Kind::kValue && plan_.values[arg.value].constant &&
                 !rec_.values[arg.value].is_tensor) {
        v = rec_.values[arg.value].scalar;
      }
      if (!v.isScalar()) return std::nullopt;  // none, a list, or bound per call
      return v.toScalar();
    };
    auto is_none = [&](int a) {
      return a < num_args && n.args[a].kind == Arg::Kind::kConstant && n.args[a].constant.isNone();
    };
    switch (info.form) {
      case Form::kUnary:
        form->inputs = {0};
        return true;
      case Form::kUnaryScalar:
        form->inputs = {0};
        return ReadUnaryScalar(name, scalar(1), in);
      case Form::kClamp:
        form->inputs = {0};
        if ((!scalar(1).has_value() && !is_none(1)) || (!scalar(2).has_value() && !is_none(2))) return false;
        return ReadClamp(scalar(1), scalar(2), in);
      case Form::kBinary:
      case Form::kCompare:
        form->inputs = {0, 1};
        return true;
      case Form::kChannelAffine:  // the rest are the statistics eager's kernel reads where alpha or beta has a NaN
        form->inputs = {0, 1, 2};
        in->nan_check = Instr::NanCheck::kAnyNan;
        return true;
      case Form::kAlpha:
        form->inputs = {0, 1};
        return ReadAlpha(name, scalar(2), out_dtype, in, form);
      case Form::kWhere:
        form->inputs = {0, 1, 2};
        return true;
      case Form::kPointwise:
        form->inputs = {0, 1, 2};
        form->value = scalar(3);
        return form->value.has_value() && !form->value->isComplex();
      case Form::kScalarBase: {
        form->inputs = {1};
        std::optional<c10::Scalar> base = scalar(0);
        // Pow.cpp: a base of 1 fills the result with ones instead
        if (!base.has_value() || base->isComplex() || base->isBoolean() || base->toDouble() == 1.0) return false;
        in->p0 = base->toDouble();  // cast to the exponent's dtype below, as the wrapped number is
        return true;
      }
      case Form::kMaskedFill:
        form->inputs = {0, 1};
        return ReadMaskedFill(scalar(2), out_dtype, in);
    }
    return false;
  }

  // The instruction's dtype, vector path, NaN check and parameters from its operands' dtypes
  // (`ops`), its result's and what ReadForm read. False where the fused kernel does not compute
  // it as eager does.
  static bool ReadDtypes(const OpInfo& info, const std::vector<Operand>& ops, c10::ScalarType out_dtype,
                         const FormArgs& form, Instr* in) {
    // Dtypes: no operand is cast by the op's TensorIterator. Selects move any element of at
    // most 8 bytes as it is; arithmetic is in float or double (or int64 where ATen's integer
    // arithmetic is exact).
    const bool select = info.form == Form::kWhere || info.form == Form::kMaskedFill;
    const int mask = info.form == Form::kWhere ? 0 : info.form == Form::kMaskedFill ? 1 : -1;
    const c10::ScalarType compute = info.form == Form::kWhere ? ops[1].dtype : ops[0].dtype;
    const bool floating = compute == c10::kFloat || compute == c10::kDouble;
    if (select ? c10::isComplexType(compute) || c10::elementSize(compute) > 8
               : !floating && !(info.ints && compute == c10::kLong)) {
      return false;
    }
    for (size_t k = 0; k < ops.size(); ++k) {
      if (ops[k].dtype != (static_cast<int>(k) == mask ? c10::kBool : compute)) return false;
    }
    if (out_dtype != (info.form == Form::kCompare ? c10::kBool : compute)) return false;
    in->dtype = compute;
    in->num_inputs = static_cast<int>(ops.size());
    in->vec_block = info.exact ? VecBlock(compute, info.avx512) : 0;
    if (floating && (in->op == Op::kAdd || in->op == Op::kMul || in->op == Op::kDiv)) {
      in->nan_check = Instr::NanCheck::kNanPair;
    } else if (floating && info.sleef) {
      // Sleef's NaNs; addcmul and addcdiv: with three inputs two NaNs can meet in one element
      in->nan_check = Instr::NanCheck::kAnyNan;
    }
    if (form.value.has_value()) {  // addcmul_cpu_kernel: value.to<scalar_t>(), which raises where it overflows
      try {
        in->p0 = compute == c10::kFloat ? static_cast<double>(form.value->to<float>()) : form.value->to<double>();
      } catch (const c10::Error&) {
        return false;
      }
    }
    if (form.general_alpha && compute == c10::kFloat) {
      // ufunc add: alpha.to<float>(), which raises where it overflows
      if (std::abs(in->p0) > static_cast<double>(std::numeric_limits<float>::max())) return false;
    }
    if (in->op == Op::kPowScalarBase) {
      if (!floating) return false;
      in->p0 = compute == c10::kFloat ? static_cast<double>(static_cast<float>(in->p0)) : in->p0;
    }
    return true;
  }

  // Form::kUnaryScalar's scalar `s` (pow's exponent: the op it is eager's kernel for).
  static bool ReadUnaryScalar(const std::string& name, const std::optional<c10::Scalar>& s, Instr* in) {
    if (!s.has_value() || s->isComplex()) return false;
    const double v = s->toDouble();
    if (name == "aten::pow.Tensor_Scalar_out") {  // Pow.cpp, PowKernel.cpp
      if (v == 2.0) in->op = Op::kSquare;
      else if (v == 3.0) in->op = Op::kCube;
      else if (v == -2.0) in->op = Op::kInverseSquare;
      else if (v == 0.5 && fused::MklAvailable()) in->op = Op::kSqrt;
      else if (v == -0.5) in->op = Op::kRsqrt;
      else if (v == -1.0) in->op = Op::kReciprocal;
      else return false;
    } else {
      if (std::isnan(v)) return false;  // clamp_min/clamp_max fill with a NaN bound
      in->p0 = v;
    }
    return true;
  }

  // Form::kClamp's bounds (either may be none).
  static bool ReadClamp(const std::optional<c10::Scalar>& lo, const std::optional<c10::Scalar>& hi, Instr* in) {
    if ((lo.has_value() && (lo->isComplex() || std::isnan(lo->toDouble()))) ||
        (hi.has_value() && (hi->isComplex() || std::isnan(hi->toDouble())))) {
      return false;
    }
    if (lo.has_value() && hi.has_value()) {
      in->p0 = lo->toDouble(), in->p1 = hi->toDouble();
    } else if (lo.has_value()) {
      in->op = Op::kClampMin, in->p0 = lo->toDouble();
    } else if (hi.has_value()) {
      in->op = Op::kClampMax, in->p0 = hi->toDouble();
    } else {
      return false;
    }
    return true;
  }

  // Form::kAlpha's alpha (add's, sub's).
  static bool ReadAlpha(const std::string& name, const std::optional<c10::Scalar>& alpha, c10::ScalarType out_dtype,
                        Instr* in, FormArgs* form) {
    if (!alpha.has_value() || alpha->isComplex()) return false;
    const bool sub = name == "aten::sub.out";  // BinaryOps.cpp: add_stub with -alpha
    if (alpha->isIntegral(false)) {
      const int64_t a = alpha->toLong();
      in->i0 = sub ? static_cast<int64_t>(0ULL - static_cast<uint64_t>(a)) : a;
      in->p0 = sub ? -static_cast<double>(a) : static_cast<double>(a);
    } else {
      in->p0 = sub ? -alpha->toDouble() : alpha->toDouble();
      if (out_dtype == c10::kLong) return false;
    }
    // self + alpha * other: with alpha = +-1 every rounding of it is the sum's. Other alphas
    // are one fma (the Add instruction) on every path of eager's loops but one: `other`
    // broadcast along the rows (a scalar within each row, Loops.h's S = 2), where the
    // compiler hoisted alpha * other out of the loop in parts of the row's tail (two
    // roundings, element by element as it vectorized them). Checked on the geometry below.
    form->general_alpha = out_dtype != c10::kLong && in->p0 != 1.0 && in->p0 != -1.0;
    return !(form->general_alpha && !std::isfinite(in->p0));
  }

  // Form::kMaskedFill's value, as masked_fill_kernel casts it: value.to<scalar_t>(), which raises
  // where it overflows.
  static bool ReadMaskedFill(const std::optional<c10::Scalar>& value, c10::ScalarType out_dtype, Instr* in) {
    if (!value.has_value() || c10::isComplexType(out_dtype) || c10::elementSize(out_dtype) > 8) return false;
    try {
      AT_DISPATCH_ALL_TYPES_AND3(c10::kHalf, c10::kBFloat16, c10::kBool, out_dtype, "torchreplay_masked_fill", [&] {
        const scalar_t v = value->to<scalar_t>();
        std::memcpy(&in->i0, &v, sizeof(v));
      });
    } catch (const c10::Error&) {
      return false;
    }
    return true;
  }

  // Argument `a` of `n` as a tensor operand: a value the recording saw, or a constant.
  std::optional<Operand> OperandOf(const Node& n, int a) const {
    if (a >= static_cast<int>(n.args.size())) return std::nullopt;
    const Arg& arg = n.args[a];
    Operand o;
    if (arg.kind == Arg::Kind::kValue) {
      const ValueRecord& r = rec_.values[arg.value];
      o.value = arg.value;
      if (r.is_tensor) {
        if (r.lazy_bits || r.device != c10::kCPU) return std::nullopt;
        o.dtype = r.dtype, o.sizes = r.sizes, o.strides = r.strides;
        return o;
      }
      if (r.is_list || !r.scalar.isScalar()) return std::nullopt;
      // A number where a Tensor goes: a wrapped number (a holder written per call, or a constant).
      const at::Tensor t = WrapNumber(r.scalar).toTensor();
      o.dtype = t.scalar_type(), o.wrapped = true;
      return o;
    }
    if (arg.kind != Arg::Kind::kConstant) return std::nullopt;
    const c10::IValue v = WrapNumber(arg.constant);
    if (!v.isTensor() || !v.toTensor().defined()) return std::nullopt;
    const at::Tensor& t = v.toTensor();
    if (t.device() != c10::kCPU || t.is_conj() || t.is_neg() || t.layout() != c10::kStrided) return std::nullopt;
    o.dtype = t.scalar_type(), o.sizes = t.sizes().vec(), o.strides = t.strides().vec();
    o.wrapped = t.unsafeGetTensorImpl()->is_wrapped_number();
    return o;
  }

  // Merges adjacent dims that every operand walks as one (TensorIterator's own rule), for ops
  // whose every element gets the same bits on the vector and the scalar path: there, where rows
  // are cut changes nothing, and one instruction then walks the same memory in the same element
  // order as another over the same tensors whose iterator was coalesced further (`x.mul_(0.9)`,
  // a 0-dim operand beside it, keeps eager's two dims; `x.add_(y)` has one).
  static void Coalesce(Instr* in) {
    int n = 1;  // dims kept so far
    for (int d = 1; d < in->ndim; ++d) {
      const int64_t prev = in->shape[n - 1], cur = in->shape[d];
      bool merge = true;
      for (int k = 0; merge && prev != 1 && cur != 1 && k <= in->num_inputs; ++k) {
        merge = prev * in->strides[k][n - 1] == in->strides[k][d];
      }
      if (merge) {
        for (int k = 0; prev == 1 && k <= in->num_inputs; ++k) in->strides[k][n - 1] = in->strides[k][d];
        in->shape[n - 1] = prev * cur;
      } else {
        in->shape[n] = cur;
        for (int k = 0; k <= in->num_inputs; ++k) in->strides[k][n] = in->strides[k][d];
        ++n;
      }
    }
    for (int d = n; d < fused::kMaxDims; ++d) {
      in->shape[d] = 1;
      for (int k = 0; k <= in->num_inputs; ++k) in->strides[k][d] = 0;
    }
    in->ndim = n;
  }

  static at::Tensor Meta(const Operand& o) {
    return at::empty_strided(o.sizes, o.strides, at::TensorOptions().dtype(o.dtype).device(c10::kMeta));
  }

  // Fills `in`'s shape and strides from a TensorIterator over `out` and `ops`, as the op's own
  // iterator is built (the same operands in the same order: same dims, same order, same
  // coalescing). False for empty or over-dimensioned iteration spaces.
  static bool Geometry(const Operand& out, const std::vector<Operand>& ops, Instr* in) {
    try {
      at::TensorIteratorConfig config;
      config.set_check_mem_overlap(false).check_all_same_dtype(false).resize_outputs(false);
      config.add_owned_output(Meta(out));
      for (const Operand& o : ops) config.add_owned_const_input(Meta(o));
      at::TensorIterator iter = config.build();
      if (iter.numel() <= 0 || iter.ndim() > fused::kMaxDims) return false;
      in->numel = iter.numel();
      in->ndim = std::max<int>(1, static_cast<int>(iter.ndim()));
      for (int d = 0; d < fused::kMaxDims; ++d) in->shape[d] = d < iter.ndim() ? iter.shape()[d] : 1;
      for (int k = 0; k < iter.ntensors(); ++k) {
        for (int d = 0; d < fused::kMaxDims; ++d) {
          // A 0-dim iteration (every operand one element) is one row of one element; the
          // kernel's scalar lambda takes it, as eager's does.
          in->strides[k][d] = d < iter.ndim() ? iter.strides(k)[d]
                              : d == 0        ? static_cast<int64_t>(iter.element_size(k))
                                              : 0;
        }
      }
    } catch (const c10::Error&) {
      return false;
    }
    return true;
  }

  // torchreplay::channel_affine's iteration (Note [Batch norm as a channel affine] in
  // fused_kernels.cc): x and out over the same dense memory, NCHW or channels last, walked in
  // memory order as one row; alpha and beta one value per channel, found by each element's linear
  // index (stride 0 here).
  static bool ChannelGeometry(const Operand& out, const std::vector<Operand>& ops, Instr* in) {
    const Operand& x = ops[0];
    if (x.dtype != c10::kFloat || x.sizes.size() < 2 || x.sizes != out.sizes) return false;
    for (size_t d = 0; d < x.sizes.size(); ++d) {  // one memory order (eager's result is made in x's format)
      if (x.sizes[d] > 1 && x.strides[d] != out.strides[d]) return false;
    }
    for (int k = 1; k <= 2; ++k) {
      if (ops[k].sizes != std::vector<int64_t>{x.sizes[1]} || ops[k].strides != std::vector<int64_t>{1}) return false;
    }
    const at::Tensor meta = Meta(x);
    const int64_t numel = meta.numel(), n = x.sizes[0], c = x.sizes[1];
    if (numel <= 0) return false;
    if (meta.is_contiguous()) {
      in->i0 = numel / (n * c);
    } else if (meta.is_contiguous(at::MemoryFormat::ChannelsLast) ||
               meta.is_contiguous(at::MemoryFormat::ChannelsLast3d)) {
      in->i0 = 1;
    } else {
      return false;
    }
    in->channels = c;
    in->numel = numel;
    in->ndim = 1;
    in->shape[0] = numel;
    const int64_t size = static_cast<int64_t>(c10::elementSize(x.dtype));
    in->strides[0][0] = size, in->strides[1][0] = size, in->strides[2][0] = 0, in->strides[3][0] = 0;
    return true;
  }

  const Graph& g_;
  const Recording& rec_;
  const TapePlan& plan_;
};

}  // namespace

std::optional<Instr> Describe(const Graph& g, const Recording& rec, const TapePlan& plan, int node,
                              std::vector<ValueId>* values) {
  return DescriberImpl(g, rec, plan).Describe(node, values);
}

}  // namespace torchreplay::capture::tape::fused
