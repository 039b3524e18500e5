// capture/tape/checked/gemm_steps.h: matrix products on the CPU tape through the small GEMM (Note [Small GEMMs] in
// capture/kernels/small_gemm.h) where it computes eager's bits, chosen per node at capture by measurement (Note
// [Checked GEMMs]).
//
// Note [Checked GEMMs]
// Eager's aten::addmm and aten::mm on float32 CPU tensors call MKL's sgemm, whose set-up costs
// more than the arithmetic of a product of few rows (a transformer layer's linears on 16 tokens:
// 4-6 us each, of which the multiply-adds take about one). For some shapes MKL's kernel sums each
// output element as the small GEMM does (one chain of fused multiply-adds over k in order, from
// the bias), and there the small GEMM gives eager's bits; for others (a GEMV of one row, a long
// k split in blocks) it does not. So it is measured per node on the recording run, as the
// checked convolutions are (Note [Checked convolutions] in conv_steps.h):
//   - an addmm with beta = alpha = 1 and a 1-d bias, or an mm, of float32 [M, K] x [K, N] with
//     the result's rows contiguous;
//   - kernels: "small_gemm" reads mat2 in place where its rows are contiguous; "small_gemm_packed"
//     (and, for weights of 128 KB or more, "small_gemm_panels": packed in panels of 64 columns)
//     reads a [K, N] copy of mat2 made at capture, for a mat2 that is the transpose of a linear
//     layer's weight (a view of a graph input baked into the capture, or of a constant, that the
//     graph does not write). For addmm each also with the suffix "_bias_last": the sums start
//     from +0 and the bias is added after them, which is what MKL computed where it was measured
//     (the bias first gave other bits: a BERT layer's linears agreed with the bias first only
//     because their biases were zeros);
//   - a candidate is taken only if it computes exactly eager's bits, compared as integers, on
//     the recording's input, on two inputs of the same geometry made from a private seed (many
//     magnitudes, signed zeros, subnormals; infinities and NaNs) and on a seeded mat1, mat2 and
//     bias together, and for addmm NaNs in the input and the bias at once (which NaN survives is
//     the order of the last add), into a buffer of the recorded geometry; then only if it timed faster than
//     eager's out= op; of those, the fastest.
// The note of each node (kernel, times, why the others were refused) is in the tape's dump and in
// Captured.profile's "note". A packed copy is remade when mat2's bytes change (WeightWatch in
// kernel_check.h: by its bytes, since fused optimizers and writes through .data leave its version
// counter where it was); a weight that changed on three calls in a row (one an optimizer writes
// every step, in a training step's forward) makes the step call eager's op from then on, which
// the check's timing of a fixed weight did not account for (MLP 32-64-64-4 + Adam step: 183.7 us
// repacking, 168.6 so, 170.1 without checked GEMMs). MKL's order was measured at the capture's
// thread count. Not taken: K = 1 (eager's product over one k is the plain multiply, whose -0.0 a
// sum from +0 loses); one row or one column (MKL's GEMV: a [1, 8] x [8, 4] product gave the small
// GEMM's bits on the check's buffers and other bits on the tape's, whose alignment differs).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "capture/ir/graph.h"
#include "capture/ir/recording.h"
#include "capture/tape/typed_call.h"

namespace torchreplay::capture::tape::checked {

// Whether node n is an aten::addmm or aten::mm (the nodes the check is for).
bool IsGemm(const Node& n);

// Note [Checked GEMMs]: measures GEMM node `node` of `g`, which has just run with `env` holding
// its arguments and result. Returns true when a kernel was taken, recorded in `rec`'s
// out_variants[node] (torchreplay::addmm.out or torchreplay::mm.out, the kernel's name the extra
// argument) and out_notes[node]; else false, with why in out_notes[node], and the node gets
// eager's out= overload as any other (Note [Checked out= kernels]).
bool CheckGemm(const Graph& g, int node, const std::vector<c10::IValue>& env, Recording* rec);

// The step of a torchreplay::addmm.out or mm.out node: `args` its out= stack (addmm: self, mat1,
// mat2, beta, alpha, kernel, out; mm: self, mat2, kernel, out), `slot_of` each argument's
// per-call slot or -1. nullptr where the arguments are not what the check took (the step then
// calls the op boxed, which packs mat2 on every call).
std::unique_ptr<TypedCall> MakeGemmStep(const Slots& args, const std::vector<int>& slot_of);

// For profiles: "checked gemm (small_gemm_packed_bias_last)", ...
std::string GemmStepKind(const Slots& args);

}  // namespace torchreplay::capture::tape::checked
