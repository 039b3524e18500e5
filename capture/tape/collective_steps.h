// capture/tape/collective_steps.h: torch.distributed's collectives as kernel tape steps.
//
// Note [Collective steps]
// A collective of the graph (_c10d_functional::all_reduce, all_gather_into_tensor,
// reduce_scatter_tensor, all_to_all_single, broadcast) whose one reader is its wait_tensor runs as
// two steps of the tape:
//   - the collective step starts the collective on the process group itself (resolved once, at
//     capture, from the group's name) with the result in a planned arena buffer, and keeps the
//     work handle in a PendingWork shared with its wait step. It calls what the functional op
//     calls (Functional.cpp: a contiguous copy then allreduce / broadcast in place,
//     allgather_into_tensor_coalesced, reduce_scatter_tensor_coalesced, alltoall_base), so each
//     rank sends and receives what eager's functional op would, and gets eager's bits.
//   - the wait step, where the graph's wait_tensor is, waits on that handle, nothing else. (The
//     functional op registers its work under its result's storage for wait_tensor to find, and a
//     wait on an arena view would wait for every collective in flight on the arena's storage.)
// The steps between them run while the collective is in flight: compute that does not read the
// result overlaps with the communication. The plan keeps the result's buffer and the input's (the
// process group reads it while in flight) from being reused before the wait (tape_plan.cc). A call
// that fails between the two waits for every collective still in flight before it returns
// (DrainPending), so no later call's steps write into memory a collective still uses. Anything
// else (a complex tensor, a non-contiguous input, a collective read before or without its wait,
// arguments that change per call) runs as the functional op, as before.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "capture/tape/typed_call.h"

namespace torchreplay::capture::tape {

enum class CollectiveKind : uint8_t { kAllReduce, kAllGather, kReduceScatter, kAllToAll, kBroadcast };

// The collective an op starts, if the tape runs it as a collective step.
std::optional<CollectiveKind> CollectiveKindOf(const c10::OperatorHandle& op);
bool IsWaitTensor(const c10::OperatorHandle& op);

// The work handle of a collective between its step and its wait (per tape, per collective).
struct PendingWork;
std::shared_ptr<PendingWork> NewPendingWork();
// Waits for the work if one is in flight, swallowing its error (a call that already failed).
void DrainPending(PendingWork* pending);

// The collective step of node `args` (the node's prebuilt stack: input first, then the op's
// constant arguments), reading `input` and writing `out` (its planned buffer). Raises c10::Error
// if the group is not registered.
std::unique_ptr<TypedCall> MakeCollectiveStep(CollectiveKind kind, const std::vector<c10::IValue>& args,
                                              TensorArg input, at::Tensor out,
                                              std::shared_ptr<PendingWork> pending);
std::unique_ptr<TypedCall> MakeWaitStep(std::shared_ptr<PendingWork> pending);

}  // namespace torchreplay::capture::tape
