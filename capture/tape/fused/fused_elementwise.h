// capture/tape/fused/fused_elementwise.h: runs of elementwise nodes as one kernel tape step, computed as
// eager computes them.
//
// Note [Fused elementwise steps]
// A run of consecutive out= pointwise nodes and in-place pointwise nodes (`x.mul_(0.9)`, computed
// as their out= overload writing into their self: Note [In-place instructions] in
// describer.cc; nodes that run nothing per call, such as views of planned buffers, may sit
// between them) becomes one step: a small program of instructions, one per node, run by one
// kernel (fused_kernels.h) with no dispatch, no TensorIterator and no per-op call in between. Consecutive instructions over the same iteration space form a segment,
// walked piece by piece (at most 2048 elements of a row), every instruction on a piece before the
// next piece, so that a chain over a large tensor reads and writes it once from memory, not once
// per op. The results are eager's, bit for bit, because each instruction does what the op's
// ATen CPU kernel does to each element:
//   - the geometry is the op's own: a TensorIterator is built at capture over the recorded
//     operands (on the meta device), and its coalesced shape and strides are what the kernel
//     walks, rows and all (torchreplay::channel_affine, an inference batch norm's elementwise
//     part, has no iterator: it is walked in memory order as one row, each element's channel
//     found from its index: Note [Batch norm as a channel affine] in fused_kernels.cc);
//   - the arithmetic is the op's own lambdas (UnaryOpsKernel.cpp, BinaryOpsKernel.cpp,
//     Activation.cpp, PowKernel.cpp, TensorCompareKernel.cpp, PointwiseOpsKernel.cpp and the
//     ufunc add.h of torch 2.11), with ATen's at::vec types and the Sleef functions libtorch
//     exports; exp, log, sin, cos, tanh, erf and sqrt in float and double call MKL's vector math
//     (vmsExp, ...) exactly as ATen's vml.h does. The kernel is compiled as ATen's AVX2 kernels
//     are (-mavx2 -mfma), with contraction off: the multiply-adds torch's build contracts here,
//     add's self + alpha * other and addcmul's self + value * t1 * t2 (read off libtorch_cpu.so's
//     AVX2 loops, and pinned by the tests), are written as the fmas they became. add with an alpha
//     other than +-1 fuses only where `other` is not a scalar within each row: there the compiled
//     tail rounds alpha * other first for some elements;
//   - where an op's vector and scalar lambdas can give an element different bits (sigmoid, silu,
//     exp2: Sleef in one, glibc in the other; maximum, and clamp_min with a tensor bound, which is
//     maximum's kernel: NaNs and signed zeros), each element takes the path eager gives it. Eager
//     runs the vector lambda on the first n - n % (2 * Vec::size()) elements of each row (each
//     vectorized_loop call: Loops.h) when every operand is contiguous or one input is broadcast,
//     the scalar lambda on the rest and on every element of any other layout; Vec::size() is
//     that of the kernel DispatchStub picks (sigmoid, silu and exp2 have AVX512 kernels, used
//     where ATen's CPU capability is AVX512; maximum's AVX2 kernel runs there too), and rows are
//     cut where at::parallel_for cuts the range when a
//     tensor reaches the grain size on more than one thread. The kernel cuts its pieces at the
//     same places and splits each the same way. Every other fused op gives the same bits on both
//     paths (IEEE arithmetic in the same order, selects, comparisons, MKL or Sleef on every
//     element), so any split is eager's.
// What is not fused (the node keeps its own step): other ops; dtypes other than float32 and
// float64 (int64 for add, sub, mul and comparisons; where moves any 4- or 8-byte value); an
// operand of another dtype than the op computes in (eager would cast it first); a Scalar
// argument bound per call; NaN clamp bounds (eager fills); pow exponents other than 2, 3, -2,
// 0.5, -0.5, -1; pow of a scalar base over a vector block or more of elements (its vector lambda
// is Sleef's pow: only the 0-dim and short cases, where eager runs glibc's pow on each element,
// fuse) or of base 1 (eager fills); empty results; iteration spaces of more than four dims; a
// write through a view whose elements may share memory (unfold's or as_strided's overlapping
// windows: eager writes them in its own element order); a CPU without AVX2, or a libtorch built
// without MKL for the MKL ops. Differential tests pin every fused op against eager for every
// dtype, length, layout, thread count and special value (tests/python/test_fusion.py).
// TORCHREPLAY_FUSE=0 (EngineOptions::fuse_elementwise) turns fusion off.
//
// Note [Intermediates kept in chunks]
// An intermediate that nothing after the group reads need not reach memory: the fused kernel keeps
// it in a buffer of one chunk (kChunk elements, one per thread, made once), written by its
// instruction and read by the next ones of the same segment while it is in the L1 cache, so a
// chain over a large tensor writes its results only. It qualifies when it is a fresh out= result
// (a planned buffer, not a view, not written in place), written before it is read, accessed with
// unit inner stride, by one segment only, and read by no node after the group's last one (views
// of it included; graph outputs never qualify). Its planned buffer stays: the per-node calls the
// step may run instead (a NaN the kernel does not promise bits for, Note [A fused step no slower
// than its ops]) write it. Addresses and strides are otherwise the ones the op's iterator gives, so
// every element takes the path and the bits it took before. The chunk buffers are reused by
// liveness (a chain of any length needs two or three; kMaxTemps at once at most), and since the
// kernel never touches the planned buffer, the plan gives it the liveness it has without fusion
// (TapePlan's Fuse), so the per-node calls reuse memory as the unfused tape does. The profile's
// note of the step says how many intermediates are kept.
#pragma once

#include <memory>
#include <optional>
#include <vector>

#include "capture/ir/graph.h"
#include "capture/ir/recording.h"
#include "capture/tape/fused/fused_kernels.h"
#include "capture/tape/tape_plan.h"
#include "capture/tape/typed_call.h"

namespace torchreplay::capture::tape::fused {

// The fusion groups of `plan` (Note [Fused elementwise steps]): each a run of out= nodes with
// nothing run per call between them, each node described by the instruction that computes it.
// An instruction's operands are positions in the node's out= step stack (its arguments, the
// out= overload's extra argument if any, then its results).
std::vector<TapePlan::FusedGroup> PlanFusion(const Graph& graph, const Recording& recording,
                                             const TapePlan& plan);

// The step running `program` on `operands` (instructions' operands index into it). `exact` holds
// the group's nodes' own calls, in order: a segment's run instead, after the kernel, on a call
// whose inputs it does not promise eager's bits for (fused::RunSegment returned false). `arena`
// is the storage of the arena the step's planned buffers lie in (their data moves with its
// block). nullptr if the kernel has no code for an instruction.
std::unique_ptr<TypedCall> MakeFusedStep(fused::Program program, std::vector<TensorArg> operands,
                                         std::vector<std::unique_ptr<TypedCall>> exact, c10::Storage arena);

}  // namespace torchreplay::capture::tape::fused
