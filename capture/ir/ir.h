// capture/ir/: the graph IR and what runs it, the layer both capture backends (capture/tape,
// capture/cuda) build on.
//
//   graph.h           the IR (inputs, nodes, outputs over SSA values) and its validating builder
//   interpreter.h     runs a Graph op by op through the dispatcher: the eager reference, warm-ups
//   recording.h       what a warm-up run showed (Recording, RunAndRecord) and the analysis both
//                     backends share (CheckReplayable, MutatedRoots)
//   out_variants.h    the out= overload of a functional op
//   captured_graph.h  CapturedGraph, the interface of a graph captured under one guard key
//   capture_info.h    the plain structs a capture is described by (no Abseil: public C++ API)
//   scopes.h          the multi-stream scope ops (torchreplay::scope_enter, ...)
//   eager_rnn.cc      torchreplay::eager_lstm and kin: recurrent modules kept whole in traced graphs
//                     (Note [Recurrent modules whole]); registrations only, no header
//   caller_grad.h     the caller's grad mode while a graph runs with grad off (Note [The
//                     caller's grad mode]), which those ops run in
//   testing.h         what the C++ tests share to build graphs (//capture/ir:testing, testonly)
//
// Namespace torchreplay::capture. The schemas of its ops are declared in capture/kernels/ops.cc
// with every other torchreplay:: op. Depends on ATen, Abseil, memory_pool and those declarations
// only; never on capture/tape or capture/cuda: what a backend adds to the recording run it hands
// in (RunAndRecord's `check`).
#pragma once

#include "capture/ir/caller_grad.h"
#include "capture/ir/capture_info.h"
#include "capture/ir/captured_graph.h"
#include "capture/ir/graph.h"
#include "capture/ir/interpreter.h"
#include "capture/ir/out_variants.h"
#include "capture/ir/recording.h"
#include "capture/ir/scopes.h"
