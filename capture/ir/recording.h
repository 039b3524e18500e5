// capture/ir/recording.h: what one eager (warm-up) run of a graph showed, and the analysis of it
// that both capture backends share.
//
// A capture is built from a Recording of the last warm-up run under the guard key it serves: per
// value, its tensor metadata and which storage it shares. From it, CheckReplayable refuses graphs
// no captured graph can replay, and MutatedRoots says which storages mutable ops write into.
#pragma once

#include <ATen/core/ivalue.h>

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "capture/ir/graph.h"
#include "capture/ir/interpreter.h"
#include "capture/ir/out_variants.h"

namespace torchreplay::capture {

// What one eager run showed about each value: tensor metadata, and which value's storage it
// shares (its "root": itself for a fresh tensor, or the input/value it is a view or in-place
// result of). Non-tensor values (sizes, symbolic scalars) are kept: under one guard key they are
// constants.
struct ValueRecord {
  bool is_tensor = false;
  bool is_list = false;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  c10::Device device = c10::Device(c10::DeviceType::CPU);
  std::vector<int64_t> sizes, strides;
  int64_t storage_offset = 0;
  bool lazy_bits = false;  // a conjugate or negative view (its data is read conjugated or negated)
  bool strided = true;     // false for sparse, mkldnn, ... tensors (no strides: never replayed)
  ValueId root = -1;
  c10::IValue scalar;  // non-tensor values

  // The value whose storage this one shares (itself when it has no root).
  ValueId root_or(ValueId self) const { return root >= 0 ? root : self; }
  // Whether its elements lie in row-major order one after another (as is_contiguous(): a dim of
  // size 1 may have any stride).
  bool contiguous() const;
};

// Note [Checked out= kernels]
// An op's out= overload is meant to write its result into `out`, but some CPU kernels use `out`
// as scratch space of another size first (binary_cross_entropy's writes the unreduced loss into
// it, then resizes it back to the reduced shape), restride or replace it, or compute other bits
// than the functional op. In the kernel tape's arena such a kernel writes over its neighbours'
// buffers. So the recording run checks every out= overload the tape could use: for each node
// whose results are fresh CPU tensors at storage offset 0, it runs the overload once more on the
// same arguments into buffers of exactly the recorded sizes and strides whose storage cannot grow
// (a resize beyond them raises), and accepts it only if the kernel raised nothing, warned of
// nothing, left every buffer's sizes, strides and storage as they were, and wrote exactly the
// bits the functional op returned. A random op is checked from the CPU generator's state the node
// started from, which is then put back where the node left it. A node whose overload fails any of
// this runs functionally, the reason in the tape's dump.
struct Recording {
  std::vector<ValueRecord> values;
  // Per node: the out= overload the CPU tape may write its results through, checked on this run
  // (Note [Checked out= kernels]); nullopt with the reason in out_refusals when the check failed,
  // nullopt with an empty reason when there was nothing to check.
  std::vector<std::optional<OutVariant>> out_variants;
  std::vector<std::string> out_refusals;
  // Per node: what the measurement behind a checked kernel found (Note [Checked convolutions]).
  std::vector<std::string> out_notes;
  // Per graph input: its tensor is baked into the capture (a static input whose address the
  // engine checks) rather than rebound per call. Empty: the graph's static inputs.
  std::vector<bool> baked_inputs;
  bool baked(const Graph& g, int i) const {
    return baked_inputs.empty() ? g.is_static_input(i) : baked_inputs[i];
  }
};

// A check the recording run makes of a node the CPU tape has a faster kernel for than its out=
// overload (Note [Checked convolutions]): called right after node `node` of `g` ran, `env` holding
// its arguments and results, it records its decision in `recording` (out_variants, out_notes,
// out_refusals) and returns true, or returns false for a node it has nothing to say about, which
// then gets the check of Note [Checked out= kernels]. The kernels live with the tape, which
// depends on this file, so the tape hands its check in (CheckTapeNode in capture/tape/kernel_tape.h).
using NodeCheck = std::function<bool(const Graph& g, int node, const std::vector<c10::IValue>& env,
                                     Recording* recording)>;

// Runs `interp` eagerly on `inputs` and records every value. Returns the run's outputs.
// `check`: the tape's check of the nodes it has faster kernels for (CheckTapeNode), which every
// recording the CPU tape may capture from must be made with; empty for none. Borrowed: the caller
// owns it, it is called only during this call, and no copy of it is kept.
absl::StatusOr<std::vector<c10::IValue>> RunAndRecord(const Interpreter& interp,
                                                      std::vector<c10::IValue> inputs,
                                                      Recording* recording, const NodeCheck& check);

// Refuses graphs that no captured graph can replay: data-dependent output shapes (nonzero, ...)
// and scalars read from tensor data on the host (item, ...). FailedPrecondition naming the node.
absl::Status CheckReplayable(const Graph& graph, const Recording& recording);

// Per value: whether a mutable op (in-place, out=, copy_) writes into its storage, by root.
std::vector<bool> MutatedRoots(const Graph& graph, const Recording& recording);

// Ops that return sizes and strides (fixed under one guard key), not data read on the host.
bool IsSizeQuery(const std::string& op_name);

}  // namespace torchreplay::capture
