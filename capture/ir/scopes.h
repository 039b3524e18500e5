// capture/ir/scopes.h: multi-stream scopes inside a graph.
//
// Four ops, usable from a custom FX pass the way torchair's passes use torch.ops.air.*:
//   torchreplay::scope_enter(str[] labels, str[] stream_names) -> ()
//       the ops up to the matching scope_exit run on the named side stream, which first waits
//       for the work already queued on the stream it forks from;
//   torchreplay::scope_exit() -> ()
//       back to the stream that was current at scope_enter (no join: the branches stay parallel);
//   torchreplay::record() -> Tensor
//       an event recorded on the current stream, as a token;
//   torchreplay::wait(Tensor[] records) -> ()
//       the current stream waits for those events.
// During a CUDA capture the fork and the waits become edges of the captured graph, so work
// inside a scope is a parallel branch. On the CPU everything runs in program order, so the ops
// keep their ordering meaning and do nothing else.
//
// The ops take no tensor that says which device they are for, so whoever runs a graph on CUDA
// opens a ScopeRun for it: inside one, the ops act on that device's streams; outside, they are
// CPU no-ops. Closing the ScopeRun joins every side stream it forked back into the stream that
// was current when it opened, so a run never ends with work left on a side stream (a capture
// must not, and eager callers would otherwise read unfinished outputs). Side streams are one per
// name, device and thread, reused by every run. A value made on a side stream may be read on
// another: the interpreter keeps every value of a run with scopes until the ScopeRun has joined
// (instead of record_stream per value), so the caching allocator never hands its block to the
// next allocation on that side stream while another stream still reads it.
#pragma once

#include <c10/core/Device.h>

#include <memory>

namespace torchreplay::capture {

class ScopeRun {
 public:
  explicit ScopeRun(c10::Device device);
  ~ScopeRun();
  ScopeRun(const ScopeRun&) = delete;
  ScopeRun& operator=(const ScopeRun&) = delete;

  struct State;

 private:
  std::unique_ptr<State> state_;
  State* previous_ = nullptr;
};

// True when the build has the CUDA side of the scopes (and of capture).
bool BuiltWithCuda();

}  // namespace torchreplay::capture
