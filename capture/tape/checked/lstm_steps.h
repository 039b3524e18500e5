// capture/tape/checked/lstm_steps.h: LSTMs on the CPU tape through oneDNN on weights reordered once, taken per
// node at capture where they compute eager's bits (Note [Checked LSTMs]).
//
// Note [Checked LSTMs]
// Eager's aten::lstm on float32 CPU tensors runs oneDNN's LSTM (at::native::mkldnn_rnn): per
// layer and direction one aten::mkldnn_rnn_layer call, which reorders both plain weight matrices
// into the primitive's layout, adds the two biases and runs the primitive. On a one-step decode
// most of its time is that set-up. The recording run tries "onednn_prepacked" per
// torchreplay::eager_lstm.input node (Note [Recurrent modules whole]): the same layer calls, with
// the arguments eager's mkldnn_rnn gives them (a batch-first input transposed and made
// contiguous, layer outputs concatenated over directions, states stacked), on weights reordered
// once (mkldnn::_reorder_mkldnn_rnn_layer_weight, the op Inductor's CPU freezing uses), the
// results copied into the planned buffers. Tried only for float32 with no dropout drawn, where
// every weight is fixed under the key (a baked parameter or a constant), without projections
// (proj_size). Taken only if it writes eager's bits, compared as integers, on the
// recorded input and states and on two sets made from a private seed (one with infinities and
// NaNs), into buffers of the recorded geometries, and is faster than eager's op by the least of
// a few interleaved runs; else the node runs eager's op, the reason in the dump and in
// Captured.profile's "note". The step runs the layer calls in the caller's grad mode at capture,
// which picks oneDNN's primitive as in eager (Note [The caller's grad mode] in capture/ir/caller_grad.h),
// below autograd, autocast and Python dispatch modes (the calls see oneDNN's weights); a call
// made in the other grad mode runs eager's op. The reordered weights are copies: the step compares each weight's bytes with those it
// reordered (WeightWatch in kernel_check.h) and reorders again when they differ.
// TORCHREPLAY_CHECKED_LSTM=0 keeps eager's op everywhere.
#pragma once

#include <memory>
#include <vector>

#include "capture/ir/graph.h"
#include "capture/ir/recording.h"
#include "capture/tape/step_kinds.h"
#include "capture/tape/typed_call.h"

namespace torchreplay::capture::tape::checked {

// Whether node n is a torchreplay::eager_lstm.input (the node the check is for).
bool IsCheckedLstm(const Node& n);

// Note [Checked LSTMs]: measures node `node` of `g`, which has just run with `env` holding its
// arguments and results, and records the decision in `rec`: out_variants[node]
// (torchreplay::lstm.out) and out_notes[node] when the kernel was taken, else out_refusals[node].
void CheckLstm(const Graph& g, int node, const std::vector<c10::IValue>& env, Recording* rec);

// The step of a torchreplay::lstm.out node: `args` is its out= stack (input, hx, params,
// has_biases, num_layers, dropout, train, bidirectional, batch_first, output, hy, cy), `slot_of`
// the per-call slot of each whole argument or -1, `elem_slots` the per-call list elements.
// nullptr where the arguments are not what the check took (the step then calls the op boxed,
// which reorders the weights on every call).
std::unique_ptr<TypedCall> MakeLstmStep(const Slots& args, const std::vector<int>& slot_of,
                                        const std::vector<ElemSlot>& elem_slots);

}  // namespace torchreplay::capture::tape::checked
