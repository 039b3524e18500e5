// The fused kernel's entry points (fused_kernels.h): each runs the copy compiled for ATen's CPU
// capability (fused_kernels_impl.h), as ATen's DispatchStub picks its own kernels.
#include "capture/tape/fused/fused_kernels.h"

#include "capture/kernels/cpu_features.h"

namespace torchreplay::capture::tape::fused {
namespace avx2 {
bool Prepare(Program* program);
bool RunSegment(const Program& program, int segment, char* const* base, char* scratch);
void Restore(const Program& program, int segment, char* const* base, char* scratch);
bool MklAvailable();
}  // namespace avx2
namespace avx512 {
bool Prepare(Program* program);
bool RunSegment(const Program& program, int segment, char* const* base, char* scratch);
void Restore(const Program& program, int segment, char* const* base, char* scratch);
bool MklAvailable();
}  // namespace avx512

bool Prepare(Program* program) { return kernels::AtenAvx512() ? avx512::Prepare(program) : avx2::Prepare(program); }
bool RunSegment(const Program& program, int segment, char* const* base, char* scratch) {
  return kernels::AtenAvx512() ? avx512::RunSegment(program, segment, base, scratch)
                      : avx2::RunSegment(program, segment, base, scratch);
}
void Restore(const Program& program, int segment, char* const* base, char* scratch) {
  kernels::AtenAvx512() ? avx512::Restore(program, segment, base, scratch) : avx2::Restore(program, segment, base, scratch);
}
bool MklAvailable() { return avx2::MklAvailable(); }

const char* OpName(Op op) {
  switch (op) {
    case Op::kNeg: return "neg";
    case Op::kAbs: return "abs";
    case Op::kRound: return "round";
    case Op::kReciprocal: return "reciprocal";
    case Op::kRsqrt: return "rsqrt";
    case Op::kSquare: return "pow 2";
    case Op::kCube: return "pow 3";
    case Op::kInverseSquare: return "pow -2";
    case Op::kClampMin: return "clamp_min";
    case Op::kClampMax: return "clamp_max";
    case Op::kClamp: return "clamp";
    case Op::kSigmoid: return "sigmoid";
    case Op::kSilu: return "silu";
    case Op::kExp2: return "exp2";
    case Op::kExp: return "exp";
    case Op::kLog: return "log";
    case Op::kSin: return "sin";
    case Op::kCos: return "cos";
    case Op::kTanh: return "tanh";
    case Op::kErf: return "erf";
    case Op::kSqrt: return "sqrt";
    case Op::kLog1p: return "log1p";
    case Op::kExpm1: return "expm1";
    case Op::kAdd: return "add";
    case Op::kMul: return "mul";
    case Op::kDiv: return "div";
    case Op::kMaximum: return "maximum";
    case Op::kLt: return "lt";
    case Op::kLe: return "le";
    case Op::kGt: return "gt";
    case Op::kGe: return "ge";
    case Op::kEq: return "eq";
    case Op::kNe: return "ne";
    case Op::kMaskedFill: return "masked_fill";
    case Op::kWhere: return "where";
    case Op::kPowScalarBase: return "pow scalar base";
    case Op::kAddcmul: return "addcmul";
    case Op::kAddcdiv: return "addcdiv";
  }
  return "?";
}

}  // namespace torchreplay::capture::tape::fused
