// replay/engine.h: the engine behind one compiled graph: the warm-up -> capture -> replay
// machine, its options and stats. Its parts, one file each: the bounded per-thread key cache
// (key_cache.h), the hand-out of pool outputs (handout.h), batch-size buckets (buckets.h).
//
// Per call: guard key of the inputs -> (miss) warm-up eager run(s), then capture a CapturedGraph
// for the key -> (hit) bind inputs, replay, hand out outputs. The semantics it keeps
// (docs/design.md):
//   - replay equals eager; one captured graph per key, at most `capture_limit` keys, after which
//     new keys run eagerly and that is logged once;
//   - memory is bounded under any stream of keys: at most `cache_limit` keys are held, the least
//     recently used evicted (a captured one releases its share of the pool); calls whose key is
//     new are counted with the latest key diff, and a graph whose key changes on every call is
//     logged once (Note [A bounded cache]);
//   - static inputs are baked in; if one moves, the key is recaptured, never replayed stale;
//   - non-static inputs are rebound per call on the CPU (copied into placeholders on CUDA, and
//     copied back when mutated), so in-place ops on them reach the caller's tensors;
//   - outputs in the pool alias it; the next replay reuses that memory, so earlier outputs still
//     alive are first copied out (when the call reads them, or with `preserve_outputs`) or else
//     invalidated, raising a clear error when touched (or are clones, with `clone_outputs`);
//     outputs that alias inputs are views of the caller's tensors (Note [Handed-out outputs]);
//   - every key of the engine shares one pool, sized by the largest.
//   - a graph with collectives issues each of them exactly once per call on every path (Note
//     [Collectives]).
// Captured state, pools included, is per thread (like Static Runtime's per-thread runtimes):
// threads calling one engine never see each other's pool reused under them.
//
// Ownership: the engine shares the graph (read-only) and owns, per thread that called it, the
// pool (Arena, CudaPool), the key cache with every captured graph, and the hand-out record; the
// caller owns the outputs (Note [Handed-out outputs]). Destroying the engine copies out every
// output still alive, then frees the pools.
//
// Note [Collectives]
// A graph may hold torch.distributed's collectives (_c10d_functional::all_reduce, ... and their
// wait_tensor; Graph::communicates()). Ranks run their engines independently: one may warm up a
// new key while another replays, falls back to eager or recaptures, and each collective pairs
// with the same collective on the other ranks, so every path must issue each collective of the
// graph exactly once per call, in the graph's order. On the CPU every path does: a warm-up or
// eager call runs the graph once through the interpreter; capture plans the tape from the
// previous warm-up's recording and runs nothing of it (collectives are never folded: only aten
// ops are, tape_plan.cc); the capture call and every later call replay the tape once, each
// collective a step at its place, its wait at the graph's wait_tensor (Note [Collective steps]
// in capture/tape/collective_steps.h; the sink_waits pass moves a wait down to its result's first
// reader, and never a collective).
// tests/python/test_collectives.py pins this with ranks at different stages (counted by the
// process group's sequence number). CUDA: capturing NCCL collectives into a CUDA graph needs every
// rank to capture and launch the same graphs in the same order; until that is built and run on a
// GPU, a CUDA graph that communicates is not captured: each call runs it through the interpreter,
// the reason in the stats' fallback reasons (untested: no GPU run yet).
#pragma once

#include <ATen/core/ivalue.h>

#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "capture/ir/captured_graph.h"
#include "capture/ir/graph.h"
#include "capture/ir/interpreter.h"
#include "replay/buckets.h"
#include "replay/handout.h"
#include "replay/key_cache.h"
#include "replay/options.h"

namespace torchreplay::replay {

class Engine {
 public:
  Engine(std::shared_ptr<const capture::Graph> graph, EngineOptions options);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Runs one call. Errors: bad inputs (arity, dtype, device, rank) and kernel failures.
  absl::StatusOr<std::vector<c10::IValue>> Run(std::vector<c10::IValue> inputs);

  // Warms up and captures the keys of `input_sets` ahead of time, largest first (by tensor
  // bytes), so that on CUDA the smaller keys reuse the largest one's pool memory. Each set runs
  // warmup_iters + 1 times, like that many real calls (mutations included). With capture_sizes,
  // each set is first resized to every capture size (its batch rows cut, or padded with copies
  // of its last row). The one implementation of precapture: torchreplay.precapture comes here too.
  absl::Status Precapture(std::vector<std::vector<c10::IValue>> input_sets);

  // Where a replay's time goes: runs `inputs` until their key is captured (warm-up, capture, as
  // calls would), then replays it `iterations` times timing every step (CapturedGraph::
  // ProfileReplay). FailedPrecondition if the key runs eagerly (the reason says why). Outputs
  // handed out earlier on this thread are copied out first, as for any replay.
  absl::StatusOr<std::vector<capture::StepTime>> ProfileSteps(std::vector<c10::IValue> inputs,
                                                              int iterations);

  EngineStats stats() const;
  const capture::Graph& graph() const { return *graph_; }
  const std::shared_ptr<const capture::Graph>& shared_graph() const { return graph_; }
  const EngineOptions& options() const { return options_; }

 private:
  struct ThreadState;

  ThreadState& StateForThisThread();
  // Run, with errors as statuses: mode, capture sizes, then RunKeyed.
  absl::StatusOr<std::vector<c10::IValue>> RunOnce(std::vector<c10::IValue>& inputs);
  // A call whose batch size n is not a capture size: padded to `size`, replayed, cut back.
  absl::StatusOr<std::vector<c10::IValue>> RunPadded(std::vector<c10::IValue> inputs, int64_t n,
                                                     int64_t size);
  // Run after the mode and capture-size decisions: one key, its checks (Note [What a call
  // checks] in call_checks.h), then warm-up / capture / replay.
  absl::StatusOr<std::vector<c10::IValue>> RunKeyed(std::vector<c10::IValue> inputs);
  // An eager run counted as a fallback (a key refused).
  absl::StatusOr<std::vector<c10::IValue>> RunEagerFallback(const std::vector<c10::IValue>& inputs);
  // A captured key whose static inputs moved: its capture dropped, the inputs rebound per call
  // from their second move.
  void CheckStaticAddresses(ThreadState& ts, Entry& e, const std::vector<c10::IValue>& inputs);
  // Note [Static inputs handed out of a pool]: such inputs are rebound, not baked.
  void UnbakePooledStatics(Entry& e, const std::vector<c10::IValue>& inputs);
  // A warm-up run, recording what capture needs (and, with warmup_iters 0, the capture itself).
  absl::StatusOr<std::vector<c10::IValue>> WarmUp(ThreadState& ts, Entry& e, const std::vector<c10::IValue>& inputs);
  // The entry of the inputs' key under the settings now: held, or new (checked, admitted under
  // capture_limit or not).
  absl::StatusOr<Entry*> Lookup(ThreadState& ts, const std::vector<c10::IValue>& inputs);
  // Arity, kinds, dtypes, devices and ranks, checked when a call's key is new: InvalidArgument
  // naming the graph and the input.
  absl::Status CheckInputs(const std::vector<c10::IValue>& inputs) const;
  absl::StatusOr<std::vector<c10::IValue>> RunEager(const std::vector<c10::IValue>& inputs);
  absl::Status Capture(ThreadState& ts, Entry& e, const std::vector<c10::IValue>& inputs);
  absl::StatusOr<std::vector<c10::IValue>> Replay(ThreadState& ts, Entry& e,
                                                  std::vector<c10::IValue>& inputs);
  void Fallback(Entry& e, std::string reason);
  // CUDA keys: Note [Replays ordered across streams] (memory_pool/cuda_pool.h).
  void OrderCudaStreams(ThreadState& ts, const std::vector<c10::IValue>& inputs);
  // Counts a call whose key is not held, logs once a graph whose key keeps changing, and returns
  // why the key is new (the diff from the previous call's key).
  std::string NoteMiss(ThreadState& ts, const guards::GuardKey& key);
  void Log(LogLevel level, const std::string& message) const;

  const uint64_t id_;  // unique in the process (Note [Per-thread state lookup])
  std::shared_ptr<const capture::Graph> graph_;
  EngineOptions options_;
  capture::Interpreter interpreter_;
  const Buckets buckets_;
  std::string invalidated_msg_;

  std::atomic<int64_t> calls_{0}, replays_{0}, captures_{0}, warmups_{0}, eager_fallbacks_{0},
      misses_{0}, evictions_{0};
  CopyCounts copies_;  // outputs copied out of the pools (before threads_: their Handouts point here)
  std::atomic<bool> churn_logged_{false}, oversize_logged_{false}, cuda_logged_{false};
  // Whether an op of the graph may consult the fp32 precision settings (Note [Ambient state]):
  // if not, calls leave them unread.
  bool reads_precision_ = true;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::thread::id, std::unique_ptr<ThreadState>> threads_ ABSL_GUARDED_BY(mu_);
  std::vector<CaptureRecord> capture_log_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> fallback_reasons_ ABSL_GUARDED_BY(mu_);
  std::string last_miss_ ABSL_GUARDED_BY(mu_);
  std::atomic<int64_t> errors_{0};
  std::string last_error_ ABSL_GUARDED_BY(mu_);
};

}  // namespace torchreplay::replay
