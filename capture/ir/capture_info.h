// capture/ir/capture_info.h: the plain structs a capture is described by (what it was asked to do,
// what it made, a replay's step times); no dependency beyond ATen's headers, so that the public C++
// API (torchreplay/torchreplay.h) can show them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace torchreplay::capture {

struct CaptureOptions {
  // CPU: pointwise steps on a TensorIterator built once (Note [Prepared pointwise steps]).
  bool prepared_steps = true;
  // CPU: runs of elementwise nodes as one step (Note [Fused elementwise steps]).
  bool fuse_elementwise = true;
  // CUDA: keep the cudaGraph_t so that Dump can write it as DOT.
  bool keep_graph = false;
};

struct CaptureInfo {
  int nodes = 0;
  int steps = 0;              // kernel calls per replay
  int out_variant_steps = 0;  // ... of which write into planned arena buffers
  int typed_steps = 0;        // ... of those, called unboxed (no IValue stack)
  int prepared_steps = 0;     // ... of those, on a TensorIterator built once (CPU pointwise)
  int fused_steps = 0;        // ... of those, fused elementwise steps (CPU)
  int fused_nodes = 0;        // nodes those fused steps compute
  int collective_steps = 0;   // ... of which start a collective (Note [Collective steps])
  int functional_steps = 0;   // ... of which allocate their result (no out= variant, or dynamic)
  int precomputed = 0;        // nodes decided once at capture (views of static tensors, sizes)
  int64_t arena_bytes = 0;    // this key's plan
  int64_t tensor_bytes = 0;   // what one buffer per planned tensor would have cost
  std::vector<std::string> functional_ops;  // ops that ran functionally, for the report
};

// One step of a replay, timed (CapturedGraph::ProfileReplay).
struct StepTime {
  std::string node;    // the graph node it runs ("addmm_1")
  std::string op;      // the kernel it calls ("aten::addmm.out")
  std::string kind;    // "fused elementwise", "prepared pointwise", "prepared reduction", "prepared attention",
                       // "prepared layer norm", "typed out=", "copies", "boxed out=", "collective", "wait",
                       // "functional", "in place", "view", "getitem", "scalar"
  std::string shapes;  // its results ("Float[1, 64]")
  double us = 0;       // mean time per replay
  std::string note;    // why its node runs this kernel: what a check measured (Note [Checked
                       // convolutions]), or why a faster kernel was refused; often empty
};

}  // namespace torchreplay::capture
