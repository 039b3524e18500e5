// replay/handout.h: the outputs a replay hands out of the pool, and the one place that decides
// what becomes of them when the pool is reused (Note [Handed-out outputs]).
//
// Ownership: a Handout belongs to one thread's engine state; it keeps only weak references to the
// storages it made (the caller owns the tensors), so an output the caller dropped costs nothing.
#pragma once

#include <ATen/core/ivalue.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/intrusive_ptr.h>

#include <atomic>
#include <string>
#include <vector>

#include "capture/ir/captured_graph.h"
#include "memory_pool/arena.h"

namespace torchreplay::replay {

// How many handed-out storages were still alive when their pool was reused or went away, and so
// were copied out of it (clone_outputs' copies not counted), and their bytes: an engine's count
// over all its threads (EngineStats).
struct CopyCounts {
  std::atomic<int64_t> storages{0}, bytes{0};
};

// Note [Handed-out outputs]
// A replay hands its pool outputs out through storages of their own, one per pool buffer (each
// a new StorageImpl over the buffer's bytes, Note [One storage per buffer]; an empty buffer, which
// may start where another one does, shares with no other), aliasing the pool:
// the caller sees what eager would give (a tensor at offset 0 of its own storage, views of one
// buffer sharing it), so an output fed back as the next input has the same guard key as a fresh
// tensor. As in eager, a value returned twice is one tensor (a training forward returns an output
// the backward reads both as the output and as a saved tensor), and the outputs of one buffer
// share one version counter, as views of one base do: autograd's saved tensors check that counter,
// so an in-place change of an output before the backward raises as in eager instead of going
// unseen (a saved tensor with a counter of its own). Before the pool is reused (the next capture or replay of any key on this thread, a
// padded call, an eviction that shrinks the pool, a profile), every handed-out storage still
// alive is
//   - copied out, given memory of its own with the same bytes, if this call reads it (an output
//     fed back: h = f(x, h)) or the engine preserves outputs (training: autograd's saved
//     activations and gradients); or else
//   - invalidated: its data released, so that touching it raises the engine's message.
// Either way no replay writes under a tensor the caller can still read. The copy happens only
// for outputs kept alive, and only once. When the pool goes away (the engine, or an eviction
// shrinking it), every handed-out storage still alive is copied out.
class Handout {
 public:
  // `preserve`: outputs still alive are always copied out, never invalidated.
  // `invalidated_message`: what touching an invalidated output raises.
  // `counts`: where copies out are counted; owned by the engine, outlives the Handout.
  Handout(bool preserve, std::string invalidated_message, CopyCounts* counts)
      : preserve_(preserve), invalidated_message_(std::move(invalidated_message)), counts_(counts) {}

  // Wraps every pool output of `outs` (CapturedGraph::OutputInPool) in a storage of its own, one
  // per pool buffer, and tracks it until the next Release. With `clone`, the storage is copied
  // out at once instead (one copy per buffer: outputs that alias each other still do).
  void HandOut(const capture::CapturedGraph& graph, bool clone, std::vector<c10::IValue>& outs);

  // The pool is about to be reused by a call reading `inputs`: each tracked storage still alive
  // is copied out if `inputs` read it (or with `preserve`), else invalidated.
  void Release(const std::vector<c10::IValue>& inputs) { ReleaseAll(&inputs); }
  // The pool is about to be freed or shrunk: each tracked storage still alive is copied out.
  void CopyAllOut() { ReleaseAll(nullptr); }

  // Storages tracked now; readable from any thread (stats).
  int64_t size() const { return size_.load(std::memory_order_relaxed); }

 private:
  void ReleaseAll(const std::vector<c10::IValue>* inputs);

  const bool preserve_;
  const std::string invalidated_message_;
  CopyCounts* const counts_;
  std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> handed_out_;
  std::atomic<int64_t> size_{0};
};

// Whether v is a tensor whose storage a Handout made and has not copied out yet: memory of some
// engine's pool, which that engine may move away (copy out) or reuse under it. Such a tensor is
// never baked into a capture as a static input (Note [Static inputs handed out of a pool]).
bool InAPool(const c10::IValue& v);

// An input whose memory lies in `arena` and is not a handed-out output (memory shared through
// NumPy or DLPack) would be overwritten while the replay reads it: such inputs are replaced by
// copies of the same geometry (the guard key still holds).
void CopyInputsOutOf(const memory_pool::Arena& arena, std::vector<c10::IValue>& inputs);

}  // namespace torchreplay::replay
