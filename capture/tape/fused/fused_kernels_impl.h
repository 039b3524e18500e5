// The fused elementwise kernel (fused_kernels.h), included once per instruction set: by
// fused_kernels_avx2.cc, compiled with the flags of ATen's AVX2 kernels (-mavx2 -mfma -mf16c,
// CPU_CAPABILITY=AVX2), and by fused_kernels_avx512.cc, with those of its AVX512 kernels; both
// with floating-point contraction off: every fused multiply-add below is one ATen's build makes
// too, written out (Note [Fused elementwise steps]). fused_kernels.cc runs the one for ATen's CPU
// capability, so that an op ATen runs with 512-bit vectors (sigmoid, silu, exp2) runs as fast
// here; an element's bits do not depend on the vector width, only on which path eager gives it.
// TORCHREPLAY_FUSED_ISA names the namespace of this copy.
// One file on purpose (over 600 lines): it is compiled once per instruction set with that set's
// flags, and every op's functors, loops and the runner must be in the same translation unit so
// that each copy inlines them with its own vector width.
#include "capture/tape/fused/fused_kernels.h"

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/bit_cast.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

// MKL's vector math, as ATen's vml.h calls it for float and double exp, log, sin, cos, tanh, erf
// and sqrt (VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE). libtorch exports these where it was
// built with MKL; weak references stay null where it was not.
extern "C" {
#define TORCHREPLAY_VML(name)                                                              \
  void vms##name(int n, const float* a, float* r, long long mode) __attribute__((weak));  \
  void vmd##name(int n, const double* a, double* r, long long mode) __attribute__((weak));
TORCHREPLAY_VML(Exp)
TORCHREPLAY_VML(Ln)
TORCHREPLAY_VML(Sin)
TORCHREPLAY_VML(Cos)
TORCHREPLAY_VML(Tanh)
TORCHREPLAY_VML(Erf)
TORCHREPLAY_VML(Sqrt)
#undef TORCHREPLAY_VML
}

namespace torchreplay::capture::tape::fused::TORCHREPLAY_FUSED_ISA {
namespace {

using at::vec::Vectorized;

constexpr long long kVmlMode = 0x00000002 | 0x00140000 | 0x00000100;
// Elements of one piece each instruction of a segment runs before the next instruction: a
// multiple of every vectorized loop's block (32 floats at most), small enough for the segment's
// operands to stay in the core's caches between instructions (8 KB a float operand), large enough
// that the per-call cost of MKL's vector math (one call per instruction and chunk) stays small.
constexpr int64_t kChunk = 2048;

using NanCheck = Instr::NanCheck;

}  // namespace


namespace {

template <class T>
bool AnyLane(const Vectorized<T>& mask) {
  T lanes[Vectorized<T>::size()];
  mask.store(lanes);
  for (T lane : lanes) {
    if (c10::bit_cast<std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>>(lane) != 0) return true;
  }
  return false;
}

// The lanes where inputs `v` (N of them) are what `check` names.
template <class T, int N>
Vectorized<T> Flagged(NanCheck check, const Vectorized<T>* v) {
  Vectorized<T> m = v[0].isnan();
  for (int k = 1; k < N; ++k) m = check == NanCheck::kNanPair ? m & v[k].isnan() : m | v[k].isnan();
  return m;
}
template <class T, int N>
bool Flagged(NanCheck check, const T* v) {
  if (check == NanCheck::kNone) return false;
  bool all = true, any = false;
  for (int k = 0; k < N; ++k) {
    all = all && std::isnan(v[k]);
    any = any || std::isnan(v[k]);
  }
  return check == NanCheck::kNanPair ? all : any;
}

// The vector body of Map over [i, stop): returns where it stopped. The NaN check and whether any
// input is broadcast are template arguments, so that the common loop (dense inputs, no check)
// carries no per-vector branch.
template <class T, int N, NanCheck kCheck, bool kBroadcast, class F>
int64_t VecLoop(const F& f, const Cursor& c, const Vectorized<T>* bcast, int64_t i, int64_t stop) {
  using Vec = Vectorized<T>;
  constexpr int64_t kSize = sizeof(T);
  Vec flagged(T(0));  // lanes with inputs the NanCheck names, seen so far
  for (; i + Vec::size() <= stop; i += Vec::size()) {
    Vec in[N];
    for (int k = 0; k < N; ++k) {
      in[k] = kBroadcast && c.s[k + 1] == 0 ? bcast[k] : Vec::loadu(c.p[k + 1] + i * kSize);
    }
    if constexpr (kCheck != NanCheck::kNone) flagged = flagged | Flagged<T, N>(kCheck, in);
    Vec r;
    if constexpr (N == 1) r = f.V(in[0]);
    if constexpr (N == 2) r = f.V(in[0], in[1]);
    if constexpr (N == 3) r = f.V(in[0], in[1], in[2]);
    r.store(c.p[0] + i * kSize);
  }
  if constexpr (kCheck != NanCheck::kNone) {
    if (AnyLane(flagged)) c.inexact->store(true, std::memory_order_relaxed);
  }
  return i;
}

// Runs elements [begin, end) of a piece of `len` elements (one vectorized_loop call in eager).
// `f.S` is the op's scalar lambda, `f.V` its vector lambda. With `block` > 0 the op's two paths
// can round an element differently, so each element takes the path eager gives it: the vector
// lambda for the first len - len % block elements when eager's loop is vectorized (every operand
// contiguous, or one input broadcast: Loops.h, VectorizedLoop2d), the scalar lambda for the rest
// and for every element of any other layout. With `block` == 0 both paths give the same bits and
// the vector lambda runs wherever the layout allows.
template <class T, int N, class F>
void Map(const F& f, const Cursor& c, int64_t len, int64_t begin, int64_t end, int block, NanCheck check) {
  using Vec = Vectorized<T>;
  constexpr int64_t kSize = sizeof(T);
  int broadcast = 0, dense = 0;
  for (int k = 1; k <= N; ++k) {
    broadcast += c.s[k] == 0;
    dense += c.s[k] == kSize;
  }
  const bool vectorized = c.s[0] == kSize && broadcast + dense == N && (block == 0 || broadcast <= 1);
  const int64_t vec_end = !vectorized ? 0 : block > 0 ? len - len % block : len;
  int64_t i = begin;
  if (i < vec_end) {
    Vec bcast[N];
    for (int k = 0; k < N; ++k) {
      if (c.s[k + 1] == 0) bcast[k] = Vec(c.at<T>(k + 1, 0));
    }
    const int64_t stop = std::min(end, vec_end);
    switch (check) {
      case NanCheck::kNone:
        i = broadcast > 0 ? VecLoop<T, N, NanCheck::kNone, true>(f, c, bcast, i, stop)
                          : VecLoop<T, N, NanCheck::kNone, false>(f, c, bcast, i, stop);
        break;
      case NanCheck::kNanPair:
        i = broadcast > 0 ? VecLoop<T, N, NanCheck::kNanPair, true>(f, c, bcast, i, stop)
                          : VecLoop<T, N, NanCheck::kNanPair, false>(f, c, bcast, i, stop);
        break;
      case NanCheck::kAnyNan:
        i = broadcast > 0 ? VecLoop<T, N, NanCheck::kAnyNan, true>(f, c, bcast, i, stop)
                          : VecLoop<T, N, NanCheck::kAnyNan, false>(f, c, bcast, i, stop);
        break;
    }
  }
  for (; i < end; ++i) {
    T in[N];
    for (int k = 0; k < N; ++k) in[k] = c.at<T>(k + 1, i);
    if (Flagged<T, N>(check, in)) c.inexact->store(true, std::memory_order_relaxed);
    if constexpr (N == 1) c.at<T>(0, i) = f.S(in[0]);
    if constexpr (N == 2) c.at<T>(0, i) = f.S(in[0], in[1]);
    if constexpr (N == 3) c.at<T>(0, i) = f.S(in[0], in[1], in[2]);
  }
}

// Unary ops whose lambdas are ATen's (UnaryOpsKernel.cpp, Activation.cpp, PowKernel.cpp,
// TensorCompareKernel.cpp).
template <class T>
struct Neg {
  static Neg Of(const Instr&) { return {}; }
  T S(T a) const { return -a; }
  Vectorized<T> V(Vectorized<T> a) const { return a.neg(); }
};
template <class T>
struct Abs {
  static Abs Of(const Instr&) { return {}; }
  T S(T a) const { return std::abs(a); }
  Vectorized<T> V(Vectorized<T> a) const { return a.abs(); }
};
template <class T>
struct Round {  // ATen's vml::vround: the vector round on every element; nearbyint's bits
  static Round Of(const Instr&) { return {}; }
  T S(T a) const { return std::nearbyint(a); }
  Vectorized<T> V(Vectorized<T> a) const { return a.round(); }
};
template <class T>
struct Reciprocal {
  static Reciprocal Of(const Instr&) { return {}; }
  T S(T a) const { return static_cast<T>(1.0) / a; }
  Vectorized<T> V(Vectorized<T> a) const { return a.reciprocal(); }
};
template <class T>
struct Rsqrt {
  static Rsqrt Of(const Instr&) { return {}; }
  T S(T a) const { return static_cast<T>(1) / std::sqrt(a); }
  Vectorized<T> V(Vectorized<T> a) const { return a.rsqrt(); }
};
template <class T>
struct Square {
  static Square Of(const Instr&) { return {}; }
  T S(T a) const { return a * a; }
  Vectorized<T> V(Vectorized<T> a) const { return a * a; }
};
template <class T>
struct Cube {
  static Cube Of(const Instr&) { return {}; }
  T S(T a) const { return a * a * a; }
  Vectorized<T> V(Vectorized<T> a) const { return a * a * a; }
};
template <class T>
struct InverseSquare {
  static InverseSquare Of(const Instr&) { return {}; }
  T S(T a) const { return static_cast<T>(1.0) / (a * a); }
  Vectorized<T> V(Vectorized<T> a) const { return (a * a).reciprocal(); }
};
template <class T>
struct ClampMin {
  static ClampMin Of(const Instr& in) { return {static_cast<T>(in.p0)}; }
  T lo;
  T S(T a) const { return std::max(a, lo); }
  Vectorized<T> V(Vectorized<T> a) const { return at::vec::clamp_min(a, Vectorized<T>(lo)); }
};
template <class T>
struct ClampMax {
  static ClampMax Of(const Instr& in) { return {static_cast<T>(in.p0)}; }
  T hi;
  T S(T a) const { return std::min(a, hi); }
  Vectorized<T> V(Vectorized<T> a) const { return at::vec::clamp_max(a, Vectorized<T>(hi)); }
};
template <class T>
struct Clamp {
  static Clamp Of(const Instr& in) { return {static_cast<T>(in.p0), static_cast<T>(in.p1)}; }
  T lo, hi;
  T S(T a) const { return std::min(std::max(a, lo), hi); }
  Vectorized<T> V(Vectorized<T> a) const {
    return at::vec::clamp(a, Vectorized<T>(lo), Vectorized<T>(hi));
  }
};
template <class T>
struct Sigmoid {
  static Sigmoid Of(const Instr&) { return {}; }
  T S(T a) const { return static_cast<T>(1) / (static_cast<T>(1) + std::exp(-a)); }
  Vectorized<T> V(Vectorized<T> a) const {
    return (Vectorized<T>(static_cast<T>(1)) + a.neg().exp()).reciprocal();
  }
};
template <class T>
struct Silu {
  static Silu Of(const Instr&) { return {}; }
  T S(T x) const { return x / (T(1) + std::exp(-x)); }
  Vectorized<T> V(Vectorized<T> x) const { return x / (Vectorized<T>(T(1)) + x.neg().exp()); }
};
template <class T>
struct Exp2 {
  static Exp2 Of(const Instr&) { return {}; }
  T S(T a) const { return std::exp2(a); }
  Vectorized<T> V(Vectorized<T> a) const { return a.exp2(); }
};
// add.out: ufunc::add is self + alpha * other, which GCC contracts into fma(alpha, other, self)
// in both lambdas of ATen's build (the vector one is vec::fmadd(other, alpha, self)).
template <class T>
struct Add {
  static Add Of(const Instr& in) { return {static_cast<T>(in.p0)}; }
  T alpha;
  T S(T a, T b) const { return std::fma(alpha, b, a); }
  Vectorized<T> V(Vectorized<T> a, Vectorized<T> b) const {
    return at::vec::fmadd(b, Vectorized<T>(alpha), a);
  }
};
template <class T>
struct Mul {
  static Mul Of(const Instr&) { return {}; }
  T S(T a, T b) const { return a * b; }
  Vectorized<T> V(Vectorized<T> a, Vectorized<T> b) const { return a * b; }
};
template <class T>
struct Div {
  static Div Of(const Instr&) { return {}; }
  T S(T a, T b) const { return a / b; }
  Vectorized<T> V(Vectorized<T> a, Vectorized<T> b) const { return a / b; }
};
// pow(Scalar base, Tensor exponent) (Pow.cpp's pow_Scalar_out: pow.Tensor_Tensor on the base as a
// wrapped number, cast to the exponent's dtype; PowKernel.cpp's pow_tensor_tensor_kernel). Its
// vector lambda is Sleef's pow: the kernel is only given iteration spaces smaller than one vector
// block, where eager runs the scalar lambda, glibc's pow, on every element.
template <class T>
struct PowScalarBase {
  static PowScalarBase Of(const Instr& in) { return {static_cast<T>(in.p0)}; }
  T base;
  T S(T e) const { return std::pow(base, e); }
  Vectorized<T> V(Vectorized<T> e) const { return Vectorized<T>(base).pow(e); }
};
// addcmul and addcdiv (PointwiseOpsKernel.cpp): self + value * tensor1 * tensor2 and
// self + value * tensor1 / tensor2, value cast to the dtype (Scalar::to). ATen's build (GCC 13,
// -mavx2 -mfma, contraction on) contracts addcmul's last multiply and the add into one fma in both
// lambdas (vmulps/vmulss, then vfmadd in libtorch_cpu.so's AVX2 loops, every layout); addcdiv
// divides between, so nothing is contracted there.
template <class T>
struct Addcmul {
  static Addcmul Of(const Instr& in) { return {static_cast<T>(in.p0)}; }
  T value;
  T S(T self, T t1, T t2) const { return std::fma(value * t1, t2, self); }
  Vectorized<T> V(Vectorized<T> self, Vectorized<T> t1, Vectorized<T> t2) const {
    return at::vec::fmadd(Vectorized<T>(value) * t1, t2, self);
  }
};
// maximum_kernel (BinaryOpsKernel.cpp), clamp_min.Tensor's too: its two lambdas differ where an
// input is a NaN (all ones, or the quiet NaN) and on zeros of both signs (the vector max keeps b,
// std::max keeps a).
template <class T>
struct Maximum {
  static Maximum Of(const Instr&) { return {}; }
  T S(T a, T b) const {
    if (a != a || b != b) return std::numeric_limits<T>::quiet_NaN();
    return std::max(a, b);
  }
  Vectorized<T> V(Vectorized<T> a, Vectorized<T> b) const { return at::vec::maximum(a, b); }
};
template <class T>
struct Addcdiv {
  static Addcdiv Of(const Instr& in) { return {static_cast<T>(in.p0)}; }
  T value;
  T S(T self, T t1, T t2) const { return self + value * t1 / t2; }
  Vectorized<T> V(Vectorized<T> self, Vectorized<T> t1, Vectorized<T> t2) const {
    return self + Vectorized<T>(value) * t1 / t2;
  }
};

// vml ops (vml.h): every element through the vector function, the tail too, so the bits of an
// element do not depend on where a loop starts or ends. Layouts other than contiguous go through
// a buffer, as UnaryOpsKernel.cpp's IMPLEMENT_ITERATOR_LAMBDA does.
// Whether input 1 of `c` holds a NaN in [begin, end).
template <class T>
bool AnyNan(const Cursor& c, int64_t begin, int64_t end) {
  using Vec = Vectorized<T>;
  int64_t i = begin;
  if (c.s[1] == sizeof(T)) {
    Vec flagged(T(0));
    for (; i + Vec::size() <= end; i += Vec::size()) flagged = flagged | Vec::loadu(c.p[1] + i * sizeof(T)).isnan();
    if (AnyLane(flagged)) return true;
  }
  for (; i < end; ++i) {
    if (std::isnan(c.at<T>(1, i))) return true;
  }
  return false;
}

template <class T, class F>
void Vml(const F& f, const Cursor& c, int64_t begin, int64_t end, NanCheck check) {
  constexpr int64_t kSize = sizeof(T);
  if (check != NanCheck::kNone && AnyNan<T>(c, begin, end)) c.inexact->store(true, std::memory_order_relaxed);
  if (c.s[0] == kSize && c.s[1] == kSize) {
    f(reinterpret_cast<T*>(c.p[0] + begin * kSize), reinterpret_cast<const T*>(c.p[1] + begin * kSize),
      end - begin);
    return;
  }
  T in[kChunk], out[kChunk];
  for (int64_t i = begin; i < end; i += kChunk) {
    const int64_t n = std::min(kChunk, end - i);
    for (int64_t j = 0; j < n; ++j) in[j] = c.at<T>(1, i + j);
    f(out, in, n);
    for (int64_t j = 0; j < n; ++j) c.at<T>(0, i + j) = out[j];
  }
}

template <class T>
using VmlFn = void (*)(int, const T*, T*, long long);

template <class T>
struct Mkl {
  VmlFn<T> fn;
  void operator()(T* out, const T* in, int64_t n) const { fn(static_cast<int>(n), in, out, kVmlMode); }
};

VmlFn<float> MklFloat(Op op) {
  switch (op) {
    case Op::kExp: return vmsExp;
    case Op::kLog: return vmsLn;
    case Op::kSin: return vmsSin;
    case Op::kCos: return vmsCos;
    case Op::kTanh: return vmsTanh;
    case Op::kErf: return vmsErf;
    case Op::kSqrt: return vmsSqrt;
    default: return nullptr;
  }
}
VmlFn<double> MklDouble(Op op) {
  switch (op) {
    case Op::kExp: return vmdExp;
    case Op::kLog: return vmdLn;
    case Op::kSin: return vmdSin;
    case Op::kCos: return vmdCos;
    case Op::kTanh: return vmdTanh;
    case Op::kErf: return vmdErf;
    case Op::kSqrt: return vmdSqrt;
    default: return nullptr;
  }
}
template <class T>
VmlFn<T> MklFn(Op op) {
  if constexpr (std::is_same_v<T, float>) {
    return MklFloat(op);
  } else {
    return MklDouble(op);
  }
}

// Note [Zeros around MKL's sqrt]
// MKL's sqrt takes every vector that holds a zero (or another special input) down a slow path
// (vssqrt_cout_rare, several times the cost of the other vectors), and an optimizer's update
// takes the square root of many exact zeros: Adam's, RMSprop's and Adagrad's state stays zero in
// the embedding rows no token reached. MKL's sqrt of +-0 is +-0, and the result of one lane does
// not depend on the other lanes of the call or on where the call starts (checked over all 2^32
// float inputs, with zeros of both signs between them, at other offsets and call lengths; the
// tests check float and double against eager). So where a chunk holds zeros, MKL runs on a copy
// with each zero replaced by 1 and the zeros are put back: every element keeps MKL's bits.
template <class T>
struct MklSqrt {
  using Bits = std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>;
  static bool IsZero(T x) { return (c10::bit_cast<Bits>(x) << 1) == 0; }  // +0 or -0 (not by DAZ)

  void operator()(T* out, const T* in, int64_t n) const {
    for (int64_t b = 0; b < n; b += kChunk) Chunk(out + b, in + b, std::min(kChunk, n - b));
  }

 private:
  static void Chunk(T* out, const T* in, int64_t n) {
    Bits least = ~Bits(0);  // a minimum the compiler vectorizes: zero where some input is +-0
    for (int64_t i = 0; i < n; ++i) least = std::min<Bits>(least, c10::bit_cast<Bits>(in[i]) << 1);
    const VmlFn<T> fn = MklFn<T>(Op::kSqrt);
    if (least != 0) {
      fn(static_cast<int>(n), in, out, kVmlMode);
      return;
    }
    thread_local std::vector<T> buffer(kChunk);  // per thread, made once
    T* copy = buffer.data();
    for (int64_t i = 0; i < n; ++i) copy[i] = IsZero(in[i]) ? T(1) : in[i];
    fn(static_cast<int>(n), copy, copy, kVmlMode);
    for (int64_t i = 0; i < n; ++i) out[i] = IsZero(in[i]) ? in[i] : copy[i];  // `out` may be `in`
  }
};

// log1p and expm1 are not MKL's in vml.h: Sleef through vec::map, on every element.
template <class T>
struct SleefMap {
  bool log1p;
  void operator()(T* out, const T* in, int64_t n) const {
    if (log1p) {
      at::vec::map([](Vectorized<T> x) { return x.log1p(); }, out, in, n);
    } else {
      at::vec::map([](Vectorized<T> x) { return x.expm1(); }, out, in, n);
    }
  }
};

// Integer add and mul wrap as ATen's do (their overflow is two's complement in practice).
void AddInt(const Cursor& c, int64_t alpha, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    c.at<int64_t>(0, i) = static_cast<int64_t>(static_cast<uint64_t>(c.at<int64_t>(1, i)) +
                                               static_cast<uint64_t>(alpha) *
                                                   static_cast<uint64_t>(c.at<int64_t>(2, i)));
  }
}
void MulInt(const Cursor& c, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    c.at<int64_t>(0, i) = static_cast<int64_t>(static_cast<uint64_t>(c.at<int64_t>(1, i)) *
                                               static_cast<uint64_t>(c.at<int64_t>(2, i)));
  }
}

// Comparisons give exact answers on either path; written to a bool result.
template <class T>
void Compare(Op op, const Cursor& c, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    const T a = c.at<T>(1, i), b = c.at<T>(2, i);
    bool r = false;
    switch (op) {
      case Op::kLt: r = a < b; break;
      case Op::kLe: r = a <= b; break;
      case Op::kGt: r = a > b; break;
      case Op::kGe: r = a >= b; break;
      case Op::kEq: r = a == b; break;
      case Op::kNe: r = a != b; break;
      default: break;
    }
    c.at<bool>(0, i) = r;
  }
}

// where and masked_fill: selects, their bits moved as they are (NaN payloads included).
template <class Bits>
void Where(const Cursor& c, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    c.at<Bits>(0, i) = c.at<bool>(1, i) ? c.at<Bits>(2, i) : c.at<Bits>(3, i);
  }
}
template <class Bits>
void MaskedFill(const Cursor& c, int64_t value, int64_t begin, int64_t end) {
  Bits v;
  std::memcpy(&v, &value, sizeof(Bits));  // little-endian: the value's bytes come first
  for (int64_t i = begin; i < end; ++i) c.at<Bits>(0, i) = c.at<bool>(2, i) ? v : c.at<Bits>(1, i);
}

// Every op, as a kernel for one instruction over [begin, end) of a piece of `len` elements.
template <class T, class F, int N>
void MapKernel(const Instr& in, const Cursor& c, int64_t len, int64_t begin, int64_t end) {
  Map<T, N>(F::Of(in), c, len, begin, end, in.vec_block, in.nan_check);
}
template <class T>
void MklKernel(const Instr& in, const Cursor& c, int64_t, int64_t begin, int64_t end) {
  Vml<T>(Mkl<T>{MklFn<T>(in.op)}, c, begin, end, in.nan_check);
}
template <class T>
void MklSqrtKernel(const Instr& in, const Cursor& c, int64_t, int64_t begin, int64_t end) {
  Vml<T>(MklSqrt<T>{}, c, begin, end, in.nan_check);
}
template <class T, bool kLog1p>
void SleefKernel(const Instr& in, const Cursor& c, int64_t, int64_t begin, int64_t end) {
  Vml<T>(SleefMap<T>{kLog1p}, c, begin, end, in.nan_check);
}
template <class T>
void CompareKernel(const Instr& in, const Cursor& c, int64_t, int64_t begin, int64_t end) {
  Compare<T>(in.op, c, begin, end);
}
template <class Bits>
void WhereKernel(const Instr&, const Cursor& c, int64_t, int64_t begin, int64_t end) {
  Where<Bits>(c, begin, end);
}
template <class Bits>
void MaskedFillKernel(const Instr& in, const Cursor& c, int64_t, int64_t begin, int64_t end) {
  MaskedFill<Bits>(c, in.i0, begin, end);
}
// torchreplay::channel_affine over `n` elements of x and out from linear element `first`: one fma
// per element (eager's batch norm, contracted by ATen's build: Note [Batch norm as a channel
// affine]), over runs of one channel (a plane) or of consecutive channels (channels last), with
// eager's partial vectors for a run's tail. False if a NaN was met in alpha or beta: which NaN a
// compiled fma keeps where two meet depends on how the compiler laid out eager's loop, so the
// caller then computes the tensor with eager's kernel instead.
template <class T>
bool ChannelAffineRun(T* out, const T* x, const T* alpha, const T* beta, int64_t first, int64_t n, int64_t inner,
                      int64_t channels) {
  using Vec = Vectorized<T>;
  int64_t c = (first / inner) % channels;
  if (inner == 1) {  // consecutive elements, consecutive channels
    Vec nan(T(0));
    for (int64_t i = 0; i < n; c = 0) {
      const int64_t run = std::min(n - i, channels - c);
      for (int64_t j = 0; j < run; j += Vec::size()) {
        const int64_t k = std::min<int64_t>(Vec::size(), run - j);
        const Vec a = Vec::loadu(alpha + c + j, k), b = Vec::loadu(beta + c + j, k);
        nan = nan | a.isnan() | b.isnan();
        at::vec::fmadd(Vec::loadu(x + i + j, k), a, b).store(out + i + j, k);
      }
      i += run;
    }
    return !AnyLane(nan);
  }
  for (int64_t i = 0, pos = first % inner; i < n; pos = 0, c = c + 1 == channels ? 0 : c + 1) {  // a plane's run
    if (std::isnan(alpha[c]) || std::isnan(beta[c])) return false;
    const int64_t run = std::min(n - i, inner - pos);
    const Vec a(alpha[c]), b(beta[c]);
    int64_t j = 0;
    for (; j + Vec::size() <= run; j += Vec::size()) at::vec::fmadd(Vec::loadu(x + i + j), a, b).store(out + i + j);
    if (j < run) at::vec::fmadd(Vec::loadu(x + i + j, run - j), a, b).store(out + i + j, run - j);
    i += run;
  }
  return true;
}
void ChannelAffineKernel(const Instr& in, const Cursor& c, int64_t, int64_t begin, int64_t end) {
  if (!ChannelAffineRun<float>(reinterpret_cast<float*>(c.p[0]) + begin,
                               reinterpret_cast<const float*>(c.p[1]) + begin, reinterpret_cast<const float*>(c.p[2]),
                               reinterpret_cast<const float*>(c.p[3]), c.start + begin, end - begin, in.i0,
                               in.channels)) {
    c.inexact->store(true, std::memory_order_relaxed);
  }
}
void AddIntKernel(const Instr& in, const Cursor& c, int64_t, int64_t begin, int64_t end) {
  AddInt(c, in.i0, begin, end);
}
void MulIntKernel(const Instr&, const Cursor& c, int64_t, int64_t begin, int64_t end) { MulInt(c, begin, end); }

template <template <class> class K>
Kernel ByWidth(size_t width) {
  switch (width) {
    case 1: return &K<uint8_t>::Run;
    case 2: return &K<uint16_t>::Run;
    case 4: return &K<uint32_t>::Run;
    default: return &K<uint64_t>::Run;
  }
}
template <class Bits>
struct WhereOf {
  static void Run(const Instr& in, const Cursor& c, int64_t len, int64_t b, int64_t e) { WhereKernel<Bits>(in, c, len, b, e); }
};
template <class Bits>
struct MaskedFillOf {
  static void Run(const Instr& in, const Cursor& c, int64_t len, int64_t b, int64_t e) { MaskedFillKernel<Bits>(in, c, len, b, e); }
};

template <class T>
Kernel FloatingKernel(Op op) {
  switch (op) {
    case Op::kNeg: return &MapKernel<T, Neg<T>, 1>;
    case Op::kAbs: return &MapKernel<T, Abs<T>, 1>;
    case Op::kRound: return &MapKernel<T, Round<T>, 1>;
    case Op::kReciprocal: return &MapKernel<T, Reciprocal<T>, 1>;
    case Op::kRsqrt: return &MapKernel<T, Rsqrt<T>, 1>;
    case Op::kSquare: return &MapKernel<T, Square<T>, 1>;
    case Op::kCube: return &MapKernel<T, Cube<T>, 1>;
    case Op::kInverseSquare: return &MapKernel<T, InverseSquare<T>, 1>;
    case Op::kClampMin: return &MapKernel<T, ClampMin<T>, 1>;
    case Op::kClampMax: return &MapKernel<T, ClampMax<T>, 1>;
    case Op::kClamp: return &MapKernel<T, Clamp<T>, 1>;
    case Op::kSigmoid: return &MapKernel<T, Sigmoid<T>, 1>;
    case Op::kSilu: return &MapKernel<T, Silu<T>, 1>;
    case Op::kExp2: return &MapKernel<T, Exp2<T>, 1>;
    case Op::kExp:
    case Op::kLog:
    case Op::kSin:
    case Op::kCos:
    case Op::kTanh:
    case Op::kErf: return &MklKernel<T>;
    case Op::kSqrt: return &MklSqrtKernel<T>;
    case Op::kLog1p: return &SleefKernel<T, true>;
    case Op::kExpm1: return &SleefKernel<T, false>;
    case Op::kAdd: return &MapKernel<T, Add<T>, 2>;
    case Op::kMul: return &MapKernel<T, Mul<T>, 2>;
    case Op::kDiv: return &MapKernel<T, Div<T>, 2>;
    case Op::kMaximum: return &MapKernel<T, Maximum<T>, 2>;
    case Op::kPowScalarBase: return &MapKernel<T, PowScalarBase<T>, 1>;
    case Op::kAddcmul: return &MapKernel<T, Addcmul<T>, 3>;
    case Op::kAddcdiv: return &MapKernel<T, Addcdiv<T>, 3>;
    default: return nullptr;
  }
}

// The kernel of an instruction; nullptr for one it has none for.
Kernel KernelOf(const Instr& in) {
  switch (in.op) {
    case Op::kLt:
    case Op::kLe:
    case Op::kGt:
    case Op::kGe:
    case Op::kEq:
    case Op::kNe:
      switch (in.dtype) {
        case c10::kFloat: return &CompareKernel<float>;
        case c10::kDouble: return &CompareKernel<double>;
        case c10::kLong: return &CompareKernel<int64_t>;
        default: return nullptr;
      }
    case Op::kWhere: return ByWidth<WhereOf>(c10::elementSize(in.dtype));
    case Op::kMaskedFill: return ByWidth<MaskedFillOf>(c10::elementSize(in.dtype));
    case Op::kChannelAffine: return in.dtype == c10::kFloat ? &ChannelAffineKernel : nullptr;
    default: break;
  }
  switch (in.dtype) {
    case c10::kFloat: return FloatingKernel<float>(in.op);
    case c10::kDouble: return FloatingKernel<double>(in.op);
    case c10::kLong: return in.op == Op::kAdd ? &AddIntKernel : in.op == Op::kMul ? &MulIntKernel : nullptr;
    default: return nullptr;
  }
}

// Where element `start` (first dim fastest) of an iteration space lies: its column and its row's
// index in dims 1.. (divisions: once per walk, not per row; Row::Next steps to the next row).
struct Row {
  int64_t col = 0;
  int64_t index[kMaxDims] = {};

  Row(const Instr& shape, int64_t start) : col(start % shape.shape[0]) {
    for (int64_t d = 1, rest = start / shape.shape[0]; d < shape.ndim; ++d) {
      index[d] = rest % shape.shape[d];
      rest /= shape.shape[d];
    }
  }
  void Next(const Instr& shape) {  // to column 0 of the next row
    col = 0;
    for (int64_t d = 1; d < shape.ndim && ++index[d] == shape.shape[d]; ++d) index[d] = 0;
  }
};

// Byte offsets of the element at `row` of an instruction's iteration space in each of its operands.
void OffsetsAt(const Instr& in, const Row& row, int64_t* offsets) {
  for (int k = 0; k <= in.num_inputs; ++k) {
    offsets[k] = row.col * in.strides[k][0];
    for (int d = 1; d < in.ndim; ++d) offsets[k] += row.index[d] * in.strides[k][d];
  }
}

// Copies elements [from, to) of a piece from `src` (stride `src_stride` bytes) to `dst` (stride
// `dst_stride`), `size` bytes each.
void CopyElements(char* dst, int64_t dst_stride, const char* src, int64_t src_stride, int64_t size, int64_t from,
                  int64_t to) {
  if (dst_stride == size && src_stride == size) {
    std::memcpy(dst + from * size, src + from * size, (to - from) * size);
    return;
  }
  for (int64_t i = from; i < to; ++i) std::memcpy(dst + i * dst_stride, src + i * src_stride, size);
}

// Elements [from, to) of the piece that starts at linear index `start` (first dim fastest; `row`
// is where it lies) and is `len` long: one row's run, as TensorIterator's serial_for_each hands it
// to a kernel's loop, which is one vectorized_loop call with its own scalar tail. `from` is a
// multiple of kChunk (so of every vector block), so each element takes the path it takes in the
// whole piece.
void RunPiece(const Program& program, const Segment& seg, char* const* base, char* scratch, int64_t start,
              const Row& row, int64_t len, int64_t from, int64_t to, std::atomic<bool>* inexact) {
  Cursor c[kMaxSegment];
  for (int j = 0; j < seg.count; ++j) {
    const Instr& in = program.instrs[seg.first + j];  // every instruction of a segment has one shape
    int64_t offsets[kMaxOperands];
    OffsetsAt(in, row, offsets);
    for (int k = 0; k <= in.num_inputs; ++k) {
      c[j].p[k] = base[in.operand[k]] + offsets[k];
      c[j].s[k] = in.strides[k][0];
    }
    c[j].start = start;
    c[j].inexact = inexact;
  }
  // The segment's intermediates kept in chunks (Note [Intermediates kept in chunks]): element i of
  // the chunk starting at `from` is at byte (i - from) * size of the operand's buffer. Per thread,
  // made once (not on the stack: threads a caller makes may have small stacks).
  thread_local std::vector<double> temp_store(static_cast<size_t>(kMaxTemps * kChunk));
  const auto temp = [&](int t) { return reinterpret_cast<uintptr_t>(temp_store.data() + t * kChunk); };
  for (; from < to; from += kChunk) {
    const int64_t end = std::min(to, from + kChunk);
    for (int j = 0; j < seg.count; ++j) {
      const Instr& in = program.instrs[seg.first + j];
      for (int k = 0; k <= in.num_inputs; ++k) {
        if (in.temp[k] >= 0) {
          c[j].p[k] = reinterpret_cast<char*>(temp(in.temp[k]) - from * c[j].s[k]);
        }
      }
      if (in.snapshot >= 0) {  // what this instruction overwrites, saved at its linear position
        const int64_t size = static_cast<int64_t>(c10::elementSize(in.dtype));
        CopyElements(scratch + in.snapshot + start * size, size, c[j].p[0], c[j].s[0], size, from, end);
      }
      program.kernels[seg.first + j](in, c[j], len, from, end);
    }
  }
}

// Calls f(start, row, len) for each piece eager's loop over elements [b, e) makes: a row's run,
// cut where the range begins or ends; `row` is where `start` lies.
template <class F>
void ForEachPiece(const Instr& shape, int64_t b, int64_t e, const F& f) {
  const int64_t row_len = shape.shape[0];
  Row row(shape, b);
  for (int64_t i = b; i < e;) {
    const int64_t len = std::min(e - i, row_len - row.col);
    f(i, row, len);
    i += len;
    row.Next(shape);
  }
}

// The ranges eager's kernel loops run over: TensorIterator::for_each is serial below the grain
// or on one thread, else at::parallel_for cuts [0, numel) as ParallelOpenMP.h's invoke_parallel
// does (min(threads, numel / grain) chunks of ceil(numel / chunks) elements).
std::vector<std::pair<int64_t, int64_t>> EagerRanges(int64_t numel, int threads) {
  if (numel < kGrainSize || threads == 1) return {{0, numel}};
  const int64_t chunks = std::min<int64_t>(threads, (numel + kGrainSize - 1) / kGrainSize);
  const int64_t size = (numel + chunks - 1) / chunks;
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (int64_t b = 0; b < numel; b += size) ranges.emplace_back(b, std::min(numel, b + size));
  return ranges;
}

// Note [Fused steps on ATen's threads]
// Eager runs each op of a chain over all threads (ATen's vml ops from 2048 elements on, the
// others from 32768), so a fused step on one thread loses to it on large tensors however much
// memory traffic it saves. The step is cut over the threads too, without changing any element's
// bits: the pieces are the ones eager's loops see (EagerRanges, then rows), each element keeps
// its place in its piece (vector body or scalar tail), and only the work is shared out: whole
// pieces, or parts of a long piece at multiples of kChunk. Work items of about equal size go to
// at::parallel_for; below kParallelWork element-ops the step stays on the calling thread.
constexpr int64_t kParallelWork = 32768;

// A share of a segment's work: whole pieces over elements [b, e), or elements [b, e) of the one
// piece at `start`, `len` long.
struct Item {
  bool whole;
  int64_t b, e, start, len;
};

void WalkSegment(const Program& program, const Segment& seg, char* const* base, char* scratch,
                 std::atomic<bool>* inexact) {
  const Instr& shape = program.instrs[seg.first];
  const int threads = at::get_num_threads();
  const auto ranges = EagerRanges(shape.numel, threads);
  const auto run_whole = [&](int64_t b, int64_t e) {
    ForEachPiece(shape, b, e, [&](int64_t start, const Row& row, int64_t len) {
      RunPiece(program, seg, base, scratch, start, row, len, 0, len, inexact);
    });
  };
  if (threads == 1 || shape.numel * seg.count < kParallelWork || at::in_parallel_region()) {
    for (const auto& [b, e] : ranges) run_whole(b, e);
    return;
  }
  // About four items per thread, each at least kChunk elements.
  const int64_t target = std::max<int64_t>(kChunk, shape.numel / (4 * threads) / kChunk * kChunk);
  std::vector<Item> items;
  for (const auto& [b, e] : ranges) {
    int64_t group = b;  // whole pieces not yet in an item: [group, start)
    ForEachPiece(shape, b, e, [&](int64_t start, const Row&, int64_t len) {
      if (len < target) {
        if (start + len - group >= target) {
          items.push_back({true, group, start + len, 0, 0});
          group = start + len;
        }
        return;
      }
      if (group < start) items.push_back({true, group, start, 0, 0});
      for (int64_t from = 0; from < len; from += target) {
        items.push_back({false, from, std::min(len, from + target), start, len});
      }
      group = start + len;
    });
    if (group < e) items.push_back({true, group, e, 0, 0});  // never across eager's ranges
  }
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t b, int64_t e) {
    for (int64_t k = b; k < e; ++k) {
      const Item& it = items[k];
      if (it.whole) {
        run_whole(it.b, it.e);
      } else {
        RunPiece(program, seg, base, scratch, it.start, Row(shape, it.start), it.len, it.b, it.e, inexact);
      }
    }
  });
}

}  // namespace


bool RunSegment(const Program& program, int segment, char* const* base, char* scratch) {
  std::atomic<bool> inexact{false};
  WalkSegment(program, program.segments[segment], base, scratch, &inexact);
  return !inexact.load(std::memory_order_relaxed);
}

void Restore(const Program& program, int segment, char* const* base, char* scratch) {
  const Segment& seg = program.segments[segment];
  for (int j = seg.first; j < seg.first + seg.count; ++j) {
    const Instr& in = program.instrs[j];
    if (in.snapshot < 0) continue;
    const int64_t size = static_cast<int64_t>(c10::elementSize(in.dtype));
    ForEachPiece(in, 0, in.numel, [&](int64_t start, const Row& row, int64_t len) {
      int64_t offsets[kMaxOperands];
      OffsetsAt(in, row, offsets);
      CopyElements(base[in.operand[0]] + offsets[0], in.strides[0][0], scratch + in.snapshot + start * size, size,
                   size, 0, len);
    });
  }
}

bool Prepare(Program* program) {
  program->kernels.clear();
  for (const Instr& in : program->instrs) {
    program->kernels.push_back(KernelOf(in));
    if (program->kernels.back() == nullptr) return false;
  }
  return true;
}

bool ChannelAffine(float* out, const float* x, const float* alpha, const float* beta, int64_t numel, int64_t inner,
                   int64_t channels) {
  std::atomic<bool> exact{true};
  at::parallel_for(0, numel, kGrainSize, [&](int64_t b, int64_t e) {
    if (!ChannelAffineRun<float>(out + b, x + b, alpha, beta, b, e - b, inner, channels)) {
      exact.store(false, std::memory_order_relaxed);
    }
  });
  return exact.load(std::memory_order_relaxed);
}

bool MklAvailable() {
  return vmsExp != nullptr && vmsLn != nullptr && vmsSin != nullptr && vmsCos != nullptr &&
         vmsTanh != nullptr && vmsErf != nullptr && vmsSqrt != nullptr && vmdExp != nullptr &&
         vmdLn != nullptr && vmdSin != nullptr && vmdCos != nullptr && vmdTanh != nullptr &&
         vmdErf != nullptr && vmdSqrt != nullptr;
}

}  // namespace torchreplay::capture::tape::fused::TORCHREPLAY_FUSED_ISA
