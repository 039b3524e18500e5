// bindings/training.h: a training graph's forward and backward engines joined by a C++ autograd
// node (Note [Training calls]).
//
// Ownership: a TrainingCall shares both engines (backend.py's compiled function owns it); each
// forward call makes a ReplayBackward node that shares the backward engine and the call's spec
// and holds the tensors the backward reads until autograd runs or drops it.
#pragma once

#include <pybind11/pybind11.h>
#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <vector>

#include "replay/engine.h"

namespace torchreplay {
namespace py = pybind11;

// Note [Training calls]
// For a training graph, AOTAutograd's runtime wrapper is a Python autograd.Function: each call
// runs Python around the forward engine (save_for_backward, mark_non_differentiable) and each
// backward Python around the backward engine (the tangents' prologue, the gradients' epilogue).
// When the wrapper has nothing else to do (call_paths.py `training_call`: plain tensor inputs and
// outputs, no input mutations, no aliased outputs, no saved symints, no RNG or effect tokens, no
// subclasses; anything else keeps the wrapper, the reason in `call_paths`), torch.compile hands
// Dynamo a TrainingCall instead, which does the same in C++:
//   - forward: runs the forward engine with grad mode off (bumping the version counters of the
//     inputs the graph writes, BatchNorm's running stats); its returns are the user outputs, then
//     the tensors the backward reads (AOTAutograd's order: those saved with a version check, then
//     those without). If grad mode is on and an input requires grad, it makes a ReplayBackward
//     node whose next edges are the inputs' gradient edges, sets it as the grad_fn of the outputs
//     that require grad (the others stay non-differentiable, as mark_non_differentiable leaves
//     them), and saves the tensors as autograd.Function's save_for_backward does (SavedVariable:
//     an in-place change before the backward is eager's error; an output saved without a cycle).
//     That check reads the saved tensor's version counter, which must be the one the caller's
//     in-place op bumps: an output the backward reads is handed out as the same tensor as the
//     saved one, views of one buffer share a counter (Note [Handed-out outputs]), and views of an
//     input share the input's (Note [Outputs that view an input], capture/tape/kernel_tape.cc).
//   - backward (ReplayBackward::apply, no Python): the tangents of the outputs that require grad,
//     zeros for those autograd gives none (autograd.Function materializes them), each made to
//     the layout the backward graph was traced with (as `coerce_to_expected_memory_format`); then
//     the backward engine on (saved tensors, tangents); its results are the gradients of the
//     forward's inputs, in order. The saved tensors are released when autograd releases the node
//     (after a backward without retain_graph), so the pool's memory they are in is free for the
//     next forward; tensors still alive at the next forward (a backward not yet run, gradient
//     accumulation over several forwards) are copied out of the pool first (preserve_outputs).
//   - a backward with create_graph=True gives gradients whose grad_fn raises AOTAutograd's own
//     error for double backward when a backward goes through them, as AOTAutograd's do.
//   - an input that requires grad now but did not when the graph was compiled would get no
//     gradient (the backward graph has none for it): Dynamo recompiles such a call first (Note
//     [Leaves' requires_grad] in training_guards.py); should one reach the call anyway, it raises,
//     naming the input. One that no longer requires grad has no gradient edge: autograd drops
//     its gradient, as it drops autograd.Function's.
struct TrainingSpec {
  int num_inputs = 0;
  std::vector<int> mutated;                 // inputs the graph writes (buffers): versions bumped
  int num_outputs = 0;                      // user outputs: the forward's first returns
  std::vector<bool> output_requires_grad;  // per user output
  // Forward returns saved for the backward: [saved_begin, saved_vc_end) with a version check,
  // [saved_vc_end, saved_end) without.
  int saved_begin = 0, saved_vc_end = 0, saved_end = 0;
  // Per user output that requires grad, in order: the tangent's traced layout (empty sizes: any
  // layout contiguous in memory format `contiguous`).
  std::vector<std::vector<int64_t>> tangent_sizes, tangent_strides;
  // Per input: whether it required grad when the graph was compiled (the backward computes no
  // gradient for the others), and what it is, for errors (Note [Leaves' requires_grad] in
  // backend.py). Empty: unchecked.
  std::vector<bool> compiled_requires_grad;
  std::vector<std::string> input_names;
};

struct TrainingCall {
  std::shared_ptr<replay::Engine> forward, backward;
  std::shared_ptr<const TrainingSpec> spec;

  py::object operator()(const py::args& args) const;
};

// Registers TrainingCall.
void BindTraining(py::module_& m);

}  // namespace torchreplay
