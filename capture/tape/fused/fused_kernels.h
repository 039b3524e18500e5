// capture/tape/fused/fused_kernels.h: the program a fused elementwise step runs (fused_elementwise.h), as
// plain data, and the kernel that runs it. The kernel is compiled apart, once per instruction set
// ATen builds its kernels for (fused_kernels_impl.h, in fused_kernels_avx2.cc and _avx512.cc, with
// ATen's flags for each and floating-point contraction off), so that this header needs nothing of
// ATen's vector code; fused_kernels.cc runs the one for ATen's CPU capability.
#pragma once

#include <c10/core/ScalarType.h>

#include <atomic>
#include <cstdint>
#include <vector>

namespace torchreplay::capture::tape::fused {

constexpr int kMaxDims = 4;      // iteration dims after TensorIterator coalesced them
constexpr int kMaxOperands = 4;  // the output, then up to three inputs
// TensorIterator's for_each grain (at::internal::GRAIN_SIZE): tensors this large are cut into
// per-thread ranges when more than one thread runs.
constexpr int64_t kGrainSize = 32768;

// What an instruction computes, each exactly as ATen's CPU kernel of that op computes it
// (Note [Fused elementwise steps] in fused_elementwise.h says from where).
enum class Op : uint8_t {
  // One input.
  kNeg, kAbs, kReciprocal, kRsqrt, kSquare, kCube, kInverseSquare,  // pow 2, 3, -2
  kRound,                                                           // half to even
  kClampMin, kClampMax, kClamp,                                     // scalar bounds p0, p1
  kSigmoid, kSilu, kExp2,                                           // vector and scalar paths differ
  kExp, kLog, kSin, kCos, kTanh, kErf, kSqrt,                       // MKL's vector math (vml)
  kLog1p, kExpm1,                                                   // Sleef on every element
  kPowScalarBase,  // pow(p0, exponent): only where eager runs its scalar lambda on every element
  // Two inputs.
  kAdd,  // fma(alpha, b, a), alpha in p0 (sub: -alpha); integers wrap
  kMul, kDiv,
  kMaximum,  // NaN where either is (all ones on the vector path, the quiet NaN on the scalar one)
  kLt, kLe, kGt, kGe, kEq, kNe,  // bool results
  kMaskedFill,  // (self, bool mask): the value whose bits are i0 where the mask is set, else self
  // Three inputs.
  kWhere,    // bool condition first
  kAddcmul,  // (self, tensor1, tensor2): fma(p0 * tensor1, tensor2, self)
  kAddcdiv,  // (self, tensor1, tensor2): self + p0 * tensor1 / tensor2
  // (x, alpha, beta): fma(x, alpha[c], beta[c]), c = (e / i0) % channels of linear element e,
  // alpha and beta per channel (torchreplay::channel_affine: Note [Batch norm as a channel
  // affine]); inexact where alpha or beta holds a NaN
  kChannelAffine,
};

const char* OpName(Op op);

// One op over its own iteration space, described as the TensorIterator eager builds for it
// describes it: dims fastest first, strides in bytes, operand 0 the output.
struct Instr {
  Op op = Op::kNeg;
  c10::ScalarType dtype = c10::ScalarType::Float;  // of its inputs (kWhere, kMaskedFill: of the values)
  int num_inputs = 1;
  int operand[kMaxOperands] = {-1, -1, -1, -1};  // index into the step's operand table
  double p0 = 0, p1 = 0;                         // float / double parameters
  int64_t i0 = 0;  // integer parameter: kAdd's alpha on integers, kMaskedFill's value as bits,
                   // kChannelAffine's elements per channel run
  int64_t channels = 0;  // kChannelAffine's
  // Elements per iteration of eager's vectorized loop (2 * Vec::size() of the kernel eager's
  // dispatch picks), for ops whose vector and scalar paths can round an element differently;
  // 0 where every element gets the same bits either way.
  int vec_block = 0;
  // Inputs whose result this kernel cannot promise to be eager's bits for, checked as it runs
  // (RunSegment then returns false): kNanPair, two NaNs meeting in one element (which NaN's sign and
  // payload eager's compiled loops keep differs from loop to loop); kAnyNan, a NaN (Sleef's
  // AVX2 and AVX512 functions give NaNs other signs).
  enum class NanCheck : uint8_t { kNone, kNanPair, kAnyNan };
  NanCheck nan_check = NanCheck::kNone;
  // An instruction writing in place memory its segment found written before it ran (Note [In-place
  // instructions] in fused_elementwise.h): the byte offset in the step's scratch buffer from
  // which its output's elements are saved, piece by piece, just before it writes them; -1 for none.
  int64_t snapshot = -1;
  // Per operand: the chunk buffer it lives in instead of its memory (Note [Intermediates kept in
  // chunks] in fused_elementwise.h), an index below kMaxTemps; -1 for its own memory.
  int8_t temp[kMaxOperands] = {-1, -1, -1, -1};
  int ndim = 1;
  int64_t numel = 0;
  int64_t shape[kMaxDims] = {};
  int64_t strides[kMaxOperands][kMaxDims] = {};
};

// Consecutive instructions with one iteration shape: run piece by piece, every instruction on a
// piece before the next piece (Note [Fused elementwise steps]). At most kMaxSegment of them.
constexpr int kMaxSegment = 32;
// Intermediates of one program kept in per-thread chunk buffers rather than in memory.
constexpr int kMaxTemps = 16;
struct Segment {
  int first = 0, count = 0;  // into Program::instrs
};

// Runs one instruction over elements [begin, end) of a piece of `len` (fused_kernels_impl.h).
// The operands of one instruction at the first element of a piece, their inner strides, and
// where to say that an input named by the instruction's NanCheck was met.
struct Cursor {
  char* p[kMaxOperands];
  int64_t s[kMaxOperands];
  int64_t start;  // the linear index of the piece's first element
  std::atomic<bool>* inexact;
  template <class T>
  T& at(int k, int64_t i) const {
    return *reinterpret_cast<T*>(p[k] + i * s[k]);
  }
};

using Kernel = void (*)(const Instr&, const Cursor&, int64_t len, int64_t begin, int64_t end);

struct Program {
  std::vector<Instr> instrs;
  std::vector<Segment> segments;
  std::vector<Kernel> kernels;  // per instruction, set by Prepare
  // The scratch buffer's size (Instr::snapshot): each segment's saved copies lie side by side
  // from its start (a segment's are put back before the next segment runs).
  int64_t scratch_bytes = 0;
};

// Whether this CPU runs the fused kernel (ATen's CPU capability is AVX2 or AVX512).
bool FusionAvailable();

// Picks each instruction's kernel; false if one has none (the program cannot run).
bool Prepare(Program* program);

// Runs segment `segment` of `program` on the operands' data (`base[k]`: operand k's first
// element), saving what its in-place instructions overwrite into `scratch` (of
// Program::scratch_bytes). Only on CPUs with AVX2 and FMA (ATen's CPU capability AVX2 or
// AVX512). False if an instruction met an input its NanCheck names: then the segment's results
// are not promised to be eager's, and the caller puts back what it overwrote (Restore) and
// computes them again another way before running the next segment.
bool RunSegment(const Program& program, int segment, char* const* base, char* scratch);

// Writes back what RunSegment saved into `scratch`: the memory the segment's in-place
// instructions overwrote is again what it was before it ran.
void Restore(const Program& program, int segment, char* const* base, char* scratch);

// Whether the MKL vector math the kernel calls for exp, log, sin, cos, tanh, erf and sqrt is
// there (vmsExp and the others, which libtorch exports where it was built with MKL): where it is
// not, ATen computes these ops otherwise, and they are not fused.
bool MklAvailable();

// torchreplay::channel_affine's kernel over a whole tensor (Note [Batch norm as a channel
// affine] in fused_kernels.cc): out = fma(x, alpha[c], beta[c]) over `numel` elements of x and
// out, dense in one memory order, c = (e / inner) % channels of element e; the instruction's code.
// Shares the elements over torch's threads (no bit depends on how). False if alpha or beta holds
// a NaN (then `out` is not eager's: the caller runs eager's kernel).
bool ChannelAffine(float* out, const float* x, const float* alpha, const float* beta, int64_t numel, int64_t inner,
                   int64_t channels);

}  // namespace torchreplay::capture::tape::fused
