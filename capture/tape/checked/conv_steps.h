// capture/tape/checked/conv_steps.h: convolutions on the CPU tape through faster calls that compute eager's
// bits, chosen per node at capture by measurement (Note [Checked convolutions]).
//
// Note [Checked convolutions]
// Eager's aten::convolution on the CPU picks a backend per call (at::native::select_conv_backend)
// and, through a chain of dispatched ops (convolution, _convolution, thnn_conv2d or
// mkldnn_convolution, ...), runs it: for oneDNN (backend Mkldnn) with the plain weight reordered
// into oneDNN's layout on every call; for the GEMM path (backend Slow2d: im2col, then one MKL
// GEMM per image) with a bias copy and the layers' checks. Two faster calls can compute the same
// bits, and the recording run measures for each node whether they do:
//   - "slow_conv2d": eager's own Slow2d kernel (slow_conv2d_forward_out_cpu) called directly into
//     the planned buffer, on the views eager makes (a 1-d convolution runs as a 2-d one over a
//     dim of size 1, as _convolution does); only where eager's backend is Slow2d;
//   - "onednn_prepacked": oneDNN's convolution (mkldnn::_convolution_pointwise, the op Inductor's
//     CPU freezing uses) on the weight reordered once, at capture
//     (mkldnn_reorder_conv2d_weight), its channels-last result copied into the planned buffer;
//     float32 only, and only where the weight is constant under the key (a baked parameter or a
//     constant), and no dim's padding exceeds the kernel's reach (oneDNN's
//     convolution crashed on such a geometry: PaddingBeyondReach in conv_steps.cc).
// A candidate is taken only if it computes exactly eager's bits, compared as integers, on the
// recording run's own input and on two inputs of the same geometry made from a private seed (one
// with values of many magnitudes, signed zeros and subnormals; one with infinities and NaNs added,
// and that one again with a bias of NaNs, whose sign differs from some of the input's: the NaN a
// sum keeps is the order of its last add), writes its result into a buffer of the recorded geometry
// without resizing it, and raises nothing; of those that pass, the faster is taken, by the minimum
// of a few timed runs on the recording's input, and "onednn_prepacked" only if faster than eager's
// op ("slow_conv2d" is eager's kernel with less around it). Which kernel each node took, with the
// times, and why the others were refused, is in the tape's dump and in Captured.profile's "note". A
// node with no such kernel runs eager's op as it is.
// A prepacked weight (and the depthwise kernel's channels-last copy of the filters) is a copy: the
// step compares the weight's bytes with those it packed (WeightWatch in kernel_check.h: not its
// version counter, which fused optimizers and writes through .data leave where it was) and packs
// again when they differ. A weight that moves is recaptured by the engine. The packed copy lives
// as long as the key's capture (per thread).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "capture/ir/graph.h"
#include "capture/ir/recording.h"
#include "capture/tape/typed_call.h"

namespace torchreplay::capture::tape::checked {

// Whether node n is an aten::convolution (the node the check is for).
bool IsConvolution(const Node& n);

// Note [Checked convolutions]: measures convolution node `node` of `g`, which has just run with
// `env` holding its arguments and result, and records the decision in `rec`: out_variants[node]
// (torchreplay::convolution.out with the kernel's name as its extra argument) and out_notes[node]
// when a kernel was taken, else out_refusals[node].
void CheckConvolution(const Graph& g, int node, const std::vector<c10::IValue>& env, Recording* rec);

// The step of a torchreplay::convolution.out node: `args` is its out= stack (input, weight,
// bias, stride, padding, dilation, transposed, output_padding, groups, kernel, out), `slot_of`
// the per-call slot of each argument or -1. nullptr where the arguments are not what the check
// took (the step then calls the op boxed, which packs the weight on every call).
std::unique_ptr<TypedCall> MakeConvolutionStep(const Slots& args, const std::vector<int>& slot_of);

// What such a step is, for profiles: "checked conv (slow_conv2d)", "checked conv (onednn_prepacked)".
const char* ConvolutionStepKind(const Slots& args);

}  // namespace torchreplay::capture::tape::checked
