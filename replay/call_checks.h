// replay/call_checks.h: what a call checks, all of it listed in Note [What a call checks] below;
// defined here, what a captured trace assumed of its call's arguments, checked before anything
// runs, for torchreplay.capture's Call (bindings/call.h) and for a program loaded from a file
// (torchreplay/torchreplay.h) alike. Errors are InvalidArgument with the message a user sees
// (Python raises them as ValueError).
//
// Note [What a call checks]
// Every check between a call and its replay, in the order a call meets them, and where each
// lives. A failed check does one of four things: raises (the message names what to do), traces
// or compiles again, captures the key again, or runs eagerly (logged once, counted in stats()).
//
// Before the engine, torch.compile:
//  1. Dynamo's guards on the frame (shapes, the model's attributes, grad mode), and two of ours:
//     requires_grad of the parameters a matmul fold or a leaf depends on (Note [Leaves'
//     requires_grad], RequiresGradGuard) and the attention backend switches (Note [What a trace
//     was made under], SdpaGuard), both in bindings/call.cc: compile again.
// Before the engine, torchreplay.capture (Call::operator(), bindings/call.cc; Python's slow path
// in python/torchreplay/captured.py):
//  2. keyword arguments, a module's train/eval flag flipped since (patches.py), the default dtype,
//     attention switches or autocast state (TraceState), a folded parameter's requires_grad (matmul_fold.py),
//     arguments that are one tensor object where the trace's were not or the reverse (Note
//     [Arguments passed twice] in arguments.py):
//     the Python path, which binds the arguments through the trace's structure (arguments.py
//     _Trace) and traces again where the trace does not hold (_trace_for).
//  3. stale: a bound tensor replaced (or a parameter set to None), or a module number changed
//     since capture (patches.py): raise until set back.
//  4. arity and argument kinds (ToIValue; an int beyond 64 bits runs the graph in Python).
//  5. CaptureChecks (Call::Check): bound tensors' sizes as traced (a parameter given data of
//     other sizes: the Python path traces again, _trace_for), grad mode against requires_grad of bound tensors and
//     arguments (inference graphs raise), no overlap with a written argument, the numbers and
//     sizes and strides the trace assumed (this file's CheckOverlap, CheckFixed, CheckSizes,
//     CheckStrides; also run for
//     programs loaded from a .trp file, torchreplay/program.cc), the model's training flag.
//  6. AOTAutograd's epilogue checks (torch.compile's traced backward): leaves as traced, frozen
//     parameters still frozen, backward hazards (Note [Traced backward]).
// In the engine (replay/engine.cc):
//  7. Engine::Run: autocast off inside (Note [Ambient state]); mode "default" runs the
//     interpreter; a batch that is not a capture size is padded (replay/buckets.h).
//  8. the key (guards/guard_key.h: dtypes, shapes, strides, devices, a scalar's kind, the settings
//     eager's kernels read: Note [Ambient state]), found in the thread's KeyCache
//     (replay/key_cache.h); a new key is checked once (Engine::CheckInputs) and admitted under
//     capture_limit, or runs eagerly.
//  9. the key's fallback reason, if its capture was refused: run eagerly.
// 10. static inputs' addresses: one that moved captures again, then is rebound per call; one
//     handed out of a pool is rebound (Note [Static inputs handed out of a pool]).
// Then warm-up, capture or replay. Inside a replay of numerics "close", torchreplay::check_frozen
// compares the folded weights' versions and contents (capture/tape/check_frozen.cc).
#pragma once

#include <ATen/core/ivalue.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "capture/ir/graph.h"

namespace torchreplay::replay {

// A size of a tensor argument the trace assumed: dim `dim` of argument `arg` lies in [lo, hi];
// within a group (>= 0) it is coef * s + offset for the group's symbol s: dims with coef 1 and
// offset 0 set s (and must agree), the others must equal what s gives (2 * s0, s0 + 1).
struct SizeCheck {
  int arg = 0, dim = 0;
  int64_t lo = 0, hi = 0;
  int group = -1;
  int64_t coef = 1, offset = 0;
};

// `inputs` is a call's graph inputs: `bound` bound tensors first, then the arguments (the indices
// below count arguments, after the bound tensors).

// Numbers the trace specialized on: (argument, value), compared bit for bit for floats.
absl::Status CheckFixed(const std::vector<std::pair<int, c10::IValue>>& fixed, size_t bound,
                        const std::vector<c10::IValue>& inputs);
// The sizes the trace assumed; an argument whose rank differs from the graph's is left to the
// engine's own input check.
absl::Status CheckSizes(const std::vector<SizeCheck>& sizes, const capture::Graph& graph, size_t bound,
                        const std::vector<c10::IValue>& inputs);
// An argument the graph writes must not share memory with another argument.
absl::Status CheckOverlap(const std::vector<int>& written, size_t bound, const std::vector<c10::IValue>& inputs);

// The strides the trace assumed of tensor argument `arg` (Note [Traced strides]): `strides` in
// every dim of more than one element (a static trace), or, with `strides` empty, contiguity (a
// dynamic trace made on a contiguous tensor).
struct StrideCheck {
  int arg = 0;
  std::vector<int64_t> strides;
};
absl::Status CheckStrides(const std::vector<StrideCheck>& strides, size_t bound,
                          const std::vector<c10::IValue>& inputs);

// A number as Python prints it (2, 2.0, -0.0, True); other values by kind.
std::string Describe(const c10::IValue& v);

}  // namespace torchreplay::replay
