// The engine: the whole warm-up -> capture -> replay life of a compiled graph, its three states
// marked where they happen (WARM-UP, CAPTURE, REPLAY), plus the eager fallback.
// One class whose states and per-call checks share its key cache and its per-thread state
// (ThreadState, private to this file); keys, buckets, hand-out, options and the log, and the
// checks of what a trace assumed live in files of their own (Note [What a call checks]).
#include "replay/engine.h"

#include <ATen/record_function.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <algorithm>
#include <array>
#include <chrono>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "capture/cuda/cuda_graph.h"
#include "memory_pool/arena.h"
#include "memory_pool/cuda_pool.h"
#include "memory_pool/ordinary_tensors.h"
#include "replay/handout.h"
#include "capture/tape/kernel_tape.h"

namespace torchreplay::replay {

// ---------------------------------------------------------------- logging

void Engine::Log(LogLevel level, const std::string& message) const {
  if (level >= options_.log_level) EmitLog(level, absl::StrCat("graph '", options_.name, "': ", message));
}

// ---------------------------------------------------------------- state

struct Engine::ThreadState {
  ThreadState(int cache_limit, bool preserve_outputs, std::string invalidated_message, CopyCounts* copies)
      : keys(cache_limit), handout(preserve_outputs, std::move(invalidated_message), copies) {}
  memory_pool::Arena arena;         // CPU keys
  memory_pool::CudaPool cuda_pool;  // CUDA keys: one private pool for all of them
  KeyCache keys;
  Handout handout;                  // what the latest replay handed out of the pool
  int captured = 0;                 // captures done (recaptures of a key included)
  bool limit_logged = false;
  // Per capture size: the padded batch inputs (Note [Capture sizes]).
  absl::flat_hash_map<int64_t, std::vector<at::Tensor>> staging;
};

// Note [Per-thread state lookup]
// Every call needs this thread's ThreadState. The engine's map (under mu_) owns them; a small
// thread_local cache keyed by engine id finds them without the mutex on the fast path. Ids are
// never reused, so an entry of a destroyed engine can never match; a ThreadState lives as long as
// its engine, so a matching entry is always valid.
namespace {
std::atomic<uint64_t> next_engine_id{1};
struct StateSlot {
  uint64_t engine_id = 0;
  void* state = nullptr;
};
thread_local std::array<StateSlot, 8> state_cache;
thread_local unsigned state_cache_next = 0;
}  // namespace

namespace {

// Whether an op of the graph may consult the fp32 precision settings: any op outside aten (ours,
// custom ops), and any aten op whose name says it multiplies matrices, convolves or recurs (the
// kernels that read Float32Op::MATMUL, CONV and RNN). Conservative: a name it misses would have
// to compute a product without any of these words.
bool ReadsPrecision(const capture::Graph& graph) {
  static constexpr absl::string_view kWords[] = {"mm", "mv", "matmul", "linear", "dot", "conv", "lstm", "gru",
                                                 "rnn", "mkldnn", "einsum", "tensordot", "attention", "linalg",
                                                 "bilinear", "cdist", "kron", "inner", "outer", "ger"};
  for (const capture::Node& n : graph.nodes()) {
    if (!n.op.has_value()) continue;
    const std::string name = capture::OperatorName(*n.op);
    if (!absl::StartsWith(name, "aten::")) return true;
    for (absl::string_view w : kWords) {
      if (absl::StrContains(name, w)) return true;
    }
  }
  return false;
}

}  // namespace

Engine::Engine(std::shared_ptr<const capture::Graph> graph, EngineOptions options)
    : id_(next_engine_id++), graph_(std::move(graph)), options_(std::move(options)),
      interpreter_(graph_),
      buckets_(options_.capture_sizes, options_.batch_inputs, options_.batch_size_inputs,
               options_.batch_outputs, graph_->written_inputs()) {
  reads_precision_ = ReadsPrecision(*graph_);
  invalidated_msg_ = absl::StrCat(
      "torchreplay: this tensor is an output of the replayed graph '", options_.name,
      "', and a later replay has reused its memory. Clone outputs you keep across calls "
      "(out.clone()), or set config.reduce_overhead.clone_outputs = True.");
}

Engine::~Engine() {
  absl::MutexLock lock(&mu_);
  // The pool is freed; outputs the caller still holds keep their values (as in eager).
  for (auto& [id, ts] : threads_) ts->handout.CopyAllOut();
}

Engine::ThreadState& Engine::StateForThisThread() {
  for (const StateSlot& s : state_cache) {
    if (s.engine_id == id_) return *static_cast<ThreadState*>(s.state);
  }
  ThreadState* ts;
  {
    absl::MutexLock lock(&mu_);
    auto& slot = threads_[std::this_thread::get_id()];
    if (slot == nullptr) {
      slot = std::make_unique<ThreadState>(options_.cache_limit, options_.preserve_outputs,
                                           invalidated_msg_, &copies_);
    }
    ts = slot.get();
  }
  state_cache[state_cache_next++ % state_cache.size()] = {id_, ts};
  return *ts;
}

EngineStats Engine::stats() const {
  EngineStats s;
  s.calls = calls_;
  s.replays = replays_;
  s.captures = captures_;
  s.warmups = warmups_;
  s.eager_fallbacks = eager_fallbacks_;
  s.misses = misses_;
  s.evictions = evictions_;
  s.copied_out = copies_.storages.load(std::memory_order_relaxed);
  s.copied_out_bytes = copies_.bytes.load(std::memory_order_relaxed);
  absl::MutexLock lock(&mu_);
  for (const auto& [id, ts] : threads_) {
    s.pool_bytes = std::max(s.pool_bytes, ts->arena.bytes() + ts->cuda_pool.bytes());
    s.cache_entries += ts->keys.size();
    s.handed_out += ts->handout.size();
  }
  s.errors = errors_;
  s.last_error = last_error_;
  s.capture_log = capture_log_;
  s.fallback_reasons = fallback_reasons_;
  s.last_miss = last_miss_;
  return s;
}

namespace {
template <class T>
void AppendBounded(std::vector<T>* log, T item) {
  if (log->size() >= EngineStats::kLogLength) log->erase(log->begin());
  log->push_back(std::move(item));
}
}  // namespace

void Engine::Fallback(Entry& e, std::string reason) {
  Log(LogLevel::kWarning, absl::StrCat("key ", e.key.ToString(), " runs eagerly: ", reason));
  e.fallback_reason = reason;
  e.recording.reset();
  absl::MutexLock lock(&mu_);
  AppendBounded(&fallback_reasons_, std::move(reason));
}

std::string Engine::NoteMiss(ThreadState& ts, const guards::GuardKey& key) {
  ++misses_;
  KeyCache::Miss miss = ts.keys.NoteMiss(key);
  {
    absl::MutexLock lock(&mu_);
    last_miss_ = miss.diff;
  }
  if (!miss.churn || churn_logged_.exchange(true)) return miss.diff;
  std::vector<std::string> changing;
  for (int i : miss.churning) {
    changing.push_back(absl::StrCat(key.inputs()[i].is_scalar() ? "scalar " : "", "input ", i, " (",
                                    graph_->values()[graph_->inputs()[i]].name, ")"));
  }
  Log(LogLevel::kWarning,
      absl::StrCat("the last ", KeyCache::kChurn, " calls each had a new guard key",
                   changing.empty() ? "" : absl::StrCat(" (", absl::StrJoin(changing, ", "),
                                                        " changed on each)"),
                   ", so each ran eagerly; a graph whose key changes on every call never "
                   "replays. Latest change: ", miss.diff, ". A scalar that decides a shape is guarded by "
                   "its value; config.reduce_overhead.capture_sizes pads batch sizes to a few."));
  return miss.diff;
}

absl::StatusOr<Entry*> Engine::Lookup(ThreadState& ts, const std::vector<c10::IValue>& inputs) {
  guards::GuardKey key = guards::GuardKey::FromInputs(inputs, graph_->per_call_scalars());
  const bool cuda = capture::Interpreter::CudaDevice(inputs).has_value();
  key.set_settings(guards::Ambient::Now(cuda, reads_precision_));
  if (Entry* held = ts.keys.Find(key)) return held;
  if (auto s = CheckInputs(inputs); !s.ok()) return s;
  auto entry = std::make_unique<Entry>();
  entry->reason = NoteMiss(ts, key);
  for (int i = 0; i < static_cast<int>(inputs.size()); ++i) {
    entry->baked.push_back(graph_->is_static_input(i));
  }
  entry->moves.assign(inputs.size(), 0);
  entry->cuda = cuda;
  std::vector<std::unique_ptr<Entry>> evicted;
  Entry* e = ts.keys.Insert(std::move(key), std::move(entry), &evicted);
  evictions_ += static_cast<int64_t>(evicted.size());
  const bool any_captured = std::any_of(evicted.begin(), evicted.end(),
                                        [](const auto& v) { return v->graph != nullptr; });
  evicted.clear();  // their captured graphs go before the pool shrinks
  if (any_captured) {  // the arena shrinks to what the captured keys left need
    const int64_t need = ts.keys.LargestArenaNeed();
    if (need < ts.arena.bytes()) {
      ts.handout.CopyAllOut();  // handed-out outputs may live in what goes
      ts.arena.Shrink(need);
    }
  }
  // A tensor that is not plain dense strided memory (a lazy conjugate or negative view, sparse,
  // nested, a subclass or wrapper) means what its dispatch keys make of it, and a captured kernel
  // runs below them: calls with one run eagerly (the guard gives all of them one key per input).
  const std::vector<guards::InputGuard>& guards = e->key.inputs();
  for (size_t i = 0; i < guards.size(); ++i) {
    if (guards[i].kind != guards::InputGuard::Kind::kNotPlainTensor) continue;
    Fallback(*e, absl::StrCat("input ", i, " is ", guards::NotPlain(inputs[i].toTensor()),
                              "; calls with such inputs run eagerly"));
    return e;
  }
  // Keys are admitted when first seen, not when captured: several new keys can be warming up
  // at once, and all of them together must stay within the limit.
  if (ts.keys.admitted < options_.capture_limit) {
    ++ts.keys.admitted;
    e->admitted = true;
  } else {
    std::string reason = absl::StrCat("capture limit (", options_.capture_limit,
                                      " keys) reached; new key: ", e->reason);
    if (!ts.limit_logged) {
      ts.limit_logged = true;
      Fallback(*e, std::move(reason));
    } else {
      e->fallback_reason = std::move(reason);  // logged once already
    }
  }
  return e;
}

absl::Status Engine::CheckInputs(const std::vector<c10::IValue>& inputs) const {
  absl::Status s = capture::CheckInputs(*graph_, inputs, options_.bound_inputs);
  if (s.ok()) return s;
  return absl::InvalidArgumentError(absl::StrCat("graph '", options_.name, "': ", s.message()));
}

absl::StatusOr<std::vector<c10::IValue>> Engine::RunEager(const std::vector<c10::IValue>& inputs) {
  auto out = interpreter_.Run(inputs);
  if (!out.ok()) {
    return capture::WithContext(out.status(), absl::StrCat("graph '", options_.name, "': "));
  }
  return out;
}

// CAPTURE: build the CapturedGraph for this key from the recording of its last warm-up run.
absl::Status Engine::Capture(ThreadState& ts, Entry& e, const std::vector<c10::IValue>& inputs) {
  RECORD_FUNCTION("torchreplay::capture", std::vector<c10::IValue>());
  const std::optional<c10::Device> device = capture::Interpreter::CudaDevice(inputs);
  const bool cuda = device.has_value();
  if (cuda && options_.cuda_graphs) ts.cuda_pool.OrderStreams(device->index());  // before the pool is touched
  ts.handout.Release(inputs);  // the pool may grow, and replays below will reuse it
  const memory_pool::OrdinaryTensors ordinary;  // Note [A pool of ordinary tensors]
  const auto t0 = std::chrono::steady_clock::now();
  capture::CaptureOptions options;
  options.prepared_steps = options_.prepared_steps;
  options.fuse_elementwise = options_.fuse_elementwise;
  options.keep_graph = !options_.dump_dir.empty();
  if (cuda && graph_->communicates()) {  // Note [Collectives]
    return absl::FailedPreconditionError(
        "the graph has collectives, which a CUDA graph captures only when every rank captures and "
        "replays the same graphs in the same order (not built yet): it runs eagerly");
  }
  if (cuda && !options_.cuda_graphs) {
    return absl::FailedPreconditionError(
        "torchreplay's own CUDA graphs are opt-in (tried on one GPU, an H100, only), so CUDA keys "
        "run op by op; torch.compile's reduce-overhead mode wraps PyTorch's cudagraph trees around "
        "the engine instead (config.reduce_overhead.cuda_graphs = 'cudagraph_trees', the default); "
        "opt in with 'torchreplay' (EngineOptions.cuda_graphs = True)");
  }
  if (cuda && !cuda_logged_.exchange(true)) {
    Log(LogLevel::kWarning,
        "capturing with torchreplay's own CUDA graphs (EngineOptions.cuda_graphs), tried on one "
        "GPU (an H100) only");
  }
  absl::StatusOr<std::unique_ptr<capture::CapturedGraph>> graph;
  try {  // an allocation that fails half-way (out of memory) fails the capture, not the call
    graph = cuda ? capture::cuda::CaptureCudaGraph(graph_, *e.recording, inputs, &ts.cuda_pool, options)
                 : capture::tape::CaptureKernelTape(graph_, *e.recording, inputs, &ts.arena, options);
  } catch (const c10::Error& err) {
    graph = absl::InternalError(absl::StrCat("capture failed: ", err.what_without_backtrace()));
  }
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  e.recording.reset();
  if (!graph.ok()) return graph.status();
  e.graph = std::move(*graph);
  if (!options_.dump_dir.empty()) {
    const std::string stem =
        absl::StrCat(options_.dump_dir, "/torchreplay_", options_.name, ".key", ts.captured);
    if (auto path = e.graph->Dump(stem); path.ok()) {
      Log(LogLevel::kInfo, absl::StrCat("wrote the captured graph to ", *path));
    } else {
      Log(LogLevel::kWarning, absl::StrCat("no dump of the captured graph: ", path.status().message()));
    }
  }
  e.static_ptrs.clear();
  for (int i : graph_->static_inputs()) {
    if (inputs[i].isTensor() && e.baked[i]) {
      e.static_ptrs.emplace_back(i, inputs[i].toTensor().const_data_ptr());
    }
  }
  ++ts.captured;
  ++captures_;
  const capture::CaptureInfo& info = e.graph->info();
  CaptureRecord rec{e.key.ToString(), e.reason, ms, info};
  Log(LogLevel::kInfo, absl::StrCat("captured key ", rec.key, " (", rec.reason,
                      "): ", info.nodes, " nodes -> ", info.steps, " steps (",
                      info.out_variant_steps, " out= (", info.typed_steps, " typed, ",
                      info.prepared_steps, " prepared, ", info.fused_steps, " fused of ", info.fused_nodes,
                      " nodes), ", info.functional_steps, " functional, ",
                      info.precomputed, " precomputed), arena ", info.arena_bytes, " B for ",
                      info.tensor_bytes, " B of tensors, pool ", ts.arena.bytes(), " B, ", ms,
                      " ms"));
  absl::MutexLock lock(&mu_);
  AppendBounded(&capture_log_, std::move(rec));
  return absl::OkStatus();
}

void Engine::OrderCudaStreams(ThreadState& ts, const std::vector<c10::IValue>& inputs) {
  if (const auto device = capture::Interpreter::CudaDevice(inputs)) ts.cuda_pool.OrderStreams(device->index());
}

// REPLAY: bind inputs, replay, hand out outputs.
absl::StatusOr<std::vector<c10::IValue>> Engine::Replay(ThreadState& ts, Entry& e,
                                                        std::vector<c10::IValue>& inputs) {
  RECORD_FUNCTION("torchreplay::replay", std::vector<c10::IValue>());
  if (options_.cuda_graphs) OrderCudaStreams(ts, inputs);
  ts.handout.Release(inputs);
  CopyInputsOutOf(ts.arena, inputs);
  std::vector<c10::IValue> outs;
  auto s = e.graph->Replay(inputs, &outs);
  if (!s.ok()) {
    return capture::WithContext(s, absl::StrCat("graph '", options_.name, "': "));
  }
  ++replays_;
  ts.handout.HandOut(*e.graph, options_.clone_outputs, outs);
  return outs;
}

absl::Status Engine::Precapture(std::vector<std::vector<c10::IValue>> input_sets) {
  auto bytes = [](const std::vector<c10::IValue>& inputs) {
    int64_t n = 0;
    for (const auto& v : inputs) {
      if (v.isTensor() && v.toTensor().defined()) n += static_cast<int64_t>(v.toTensor().nbytes());
    }
    return n;
  };
  if (buckets_.enabled()) {
    std::vector<std::vector<c10::IValue>> sized;
    for (const auto& inputs : input_sets) {
      const int64_t n = buckets_.BatchSize(inputs);
      if (n < 0) return absl::InvalidArgumentError("precapture: an input set has no batch input");
      for (int64_t size : buckets_.sizes()) sized.push_back(buckets_.Resized(inputs, n, size, nullptr));
    }
    input_sets = std::move(sized);
  }
  std::stable_sort(input_sets.begin(), input_sets.end(),
                   [&](const auto& a, const auto& b) { return bytes(a) > bytes(b); });
  for (auto& inputs : input_sets) {
    for (int k = 0; k <= std::max(0, options_.warmup_iters); ++k) {
      if (auto out = Run(inputs); !out.ok()) return out.status();
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<capture::StepTime>> Engine::ProfileSteps(std::vector<c10::IValue> inputs,
                                                                    int iterations) {
  // Note [Collectives]: the warm-up calls below would issue this graph's collectives as many times
  // as this rank's stage needs, which other ranks may not match; a graph that communicates is
  // profiled only where its key replays already, and then every rank replays `iterations` times.
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);  // as Run
  const bool communicates = graph_->communicates();
  for (int k = 0; !communicates && k <= std::max(0, options_.warmup_iters); ++k) {
    if (auto out = RunKeyed(inputs); !out.ok()) return out.status();
  }
  ThreadState& ts = StateForThisThread();
  absl::StatusOr<Entry*> e = Lookup(ts, inputs);
  if (!e.ok()) return e.status();
  if ((*e)->graph == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "graph '", options_.name, "': this key is not replayed: ",
        (*e)->fallback_reason.empty() ? "it is not captured yet" : (*e)->fallback_reason,
        communicates ? " (a graph with collectives is profiled without warm-up calls, which could pair with "
                       "other ranks' collectives: call it on every rank until it replays, then profile on "
                       "every rank)"
                     : ""));
  }
  ts.handout.CopyAllOut();
  return (*e)->graph->ProfileReplay(inputs, iterations);
}

absl::StatusOr<std::vector<c10::IValue>> Engine::RunPadded(std::vector<c10::IValue> inputs,
                                                           int64_t n, int64_t size) {
  if (size < 0) {  // above the largest capture size
    RECORD_FUNCTION("torchreplay::eager_fallback", std::vector<c10::IValue>());
    if (!oversize_logged_.exchange(true)) {
      std::string reason = absl::StrCat("batch size ", n, " is above the largest capture size (",
                                        buckets_.sizes().back(), "); such calls run eagerly");
      Log(LogLevel::kWarning, reason);
      absl::MutexLock lock(&mu_);
      AppendBounded(&fallback_reasons_, std::move(reason));
    }
    ++eager_fallbacks_;
    if (auto s = CheckInputs(inputs); !s.ok()) return s;
    return RunEager(inputs);
  }
  ThreadState& ts = StateForThisThread();
  // The replay sees the staging tensors, not the caller's: outputs of earlier calls fed back in
  // are recognised here, before the pool is reused.
  ts.handout.Release(inputs);
  std::vector<at::Tensor>& staging = ts.staging[size];
  absl::StatusOr<std::vector<c10::IValue>> out =
      RunKeyed(buckets_.Resized(inputs, n, size, &staging));
  if (out.ok()) buckets_.CutBack(inputs, n, size, staging, *out);
  return out;
}

absl::StatusOr<std::vector<c10::IValue>> Engine::Run(std::vector<c10::IValue> inputs) {
  // Note [Ambient state]: the graph runs as recorded, autocast off (as AOTAutograd runs a compiled
  // forward): a cast it needs is one of its nodes.
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  absl::StatusOr<std::vector<c10::IValue>> out;
  try {
    out = RunOnce(inputs);
  } catch (const c10::Error& e) {  // not from a kernel (those are caught where they run): e.g. an
    // allocation for an output copied out of the pool
    out = capture::KernelError(e, absl::StrCat("graph '", options_.name, "': "));
  } catch (const std::exception& e) {
    out = absl::InternalError(absl::StrCat("graph '", options_.name, "': ", e.what()));
  }
  if (!out.ok()) {
    ++errors_;
    absl::MutexLock lock(&mu_);
    last_error_ = std::string(out.status().message());
  }
  return out;
}

absl::StatusOr<std::vector<c10::IValue>> Engine::RunOnce(std::vector<c10::IValue>& inputs) {
  ++calls_;
  if (options_.mode == Mode::kDefault) {
    if (auto s = CheckInputs(inputs); !s.ok()) return s;
    return RunEager(inputs);
  }
  if (buckets_.enabled()) {
    const int64_t n = buckets_.BatchSize(inputs);
    if (const int64_t size = buckets_.PadTo(inputs, n); size != 0) {
      return RunPadded(std::move(inputs), n, size);
    }
  }
  return RunKeyed(std::move(inputs));
}

absl::StatusOr<std::vector<c10::IValue>> Engine::RunKeyed(std::vector<c10::IValue> inputs) {
  // Note [What a call checks] (replay/call_checks.h): the key, then what its capture assumed.
  ThreadState& ts = StateForThisThread();
  Entry* e = ts.keys.Last(inputs, reads_precision_);  // the common case: the previous call's key
  if (e == nullptr) {
    auto found = Lookup(ts, inputs);
    if (!found.ok()) return found.status();
    e = *found;
  }
  if (!e->fallback_reason.empty()) return RunEagerFallback(inputs);
  if (e->graph != nullptr) CheckStaticAddresses(ts, *e, inputs);
  if (e->graph == nullptr) {
    UnbakePooledStatics(*e, inputs);
    if (e->eager_runs < options_.warmup_iters || !e->recording.has_value()) return WarmUp(ts, *e, inputs);
    // CAPTURE from the last warm-up's recording; this call replays what was captured.
    if (auto s = Capture(ts, *e, inputs); !s.ok()) {
      Fallback(*e, std::string(s.message()));
      return RunEagerFallback(inputs);
    }
  }
  // REPLAY
  return Replay(ts, *e, inputs);
}

absl::StatusOr<std::vector<c10::IValue>> Engine::RunEagerFallback(const std::vector<c10::IValue>& inputs) {
  RECORD_FUNCTION("torchreplay::eager_fallback", std::vector<c10::IValue>());
  ++eager_fallbacks_;
  return RunEager(inputs);
}

void Engine::CheckStaticAddresses(ThreadState& ts, Entry& e, const std::vector<c10::IValue>& inputs) {
  // Never replay with a stale address: recapture this key around the new ones. A static input
  // that keeps moving (a buffer reassigned in forward: self.avg = self.avg * 0.9 + ..; the new
  // KV cache of each generate) is rebound per call from its second move on, instead of
  // recaptured every call. All that moved count at once: one capture for a whole new cache.
  std::vector<std::string> moved;
  bool rebound = false;
  for (const auto& [i, ptr] : e.static_ptrs) {
    if (inputs[i].toTensor().const_data_ptr() == ptr) continue;
    const bool rebind = ++e.moves[i] >= 2;
    e.baked[i] = !rebind;
    rebound = rebound || rebind;
    moved.push_back(absl::StrCat(i, " (", graph_->values()[graph_->inputs()[i]].name, ")"));
  }
  if (moved.empty()) return;
  e.reason = absl::StrCat(moved.size() == 1 ? "static input " : "static inputs ", absl::StrJoin(moved, ", "),
                          " moved", rebound ? "; rebound per call from now on" : "");
  e.graph.reset();
  e.eager_runs = 0;
  --ts.captured;
}

void Engine::UnbakePooledStatics(Entry& e, const std::vector<c10::IValue>& inputs) {
  // Note [Static inputs handed out of a pool]
  // A static input (a parameter's .grad, which Dynamo marks static) may be an output some
  // engine handed out of its pool: the gradients a training graph's backward or a traced
  // backward gave. Baked into a capture, it would be held alive by it, copied out of that pool
  // at the pool's next replay (moving the baked tensor's memory), and the next output handed
  // out at the same address would pass the address check while the replay read and wrote the
  // moved tensor. Such an input is rebound per call instead, before anything is recorded.
  for (int i : graph_->static_inputs()) {
    if (e.baked[i] && InAPool(inputs[i])) {
      e.baked[i] = false;
      e.recording.reset();
      e.eager_runs = 0;
      e.reason = absl::StrCat("static input ", i, " (", graph_->values()[graph_->inputs()[i]].name,
                              ") is an output handed out of a pool; it is rebound per call");
    }
  }
}

absl::StatusOr<std::vector<c10::IValue>> Engine::WarmUp(ThreadState& ts, Entry& e,
                                                        const std::vector<c10::IValue>& inputs) {
  // WARM-UP: run eagerly, recording what capture needs.
  RECORD_FUNCTION("torchreplay::warmup", std::vector<c10::IValue>());
  ++warmups_;
  e.recording.emplace();
  e.recording->baked_inputs = e.baked;
  absl::StatusOr<std::vector<c10::IValue>> out =
      capture::RunAndRecord(interpreter_, inputs, &*e.recording, capture::tape::CheckTapeNode);
  if (!out.ok()) {
    e.recording.reset();
    return capture::WithContext(out.status(), absl::StrCat("graph '", options_.name, "': "));
  }
  ++e.eager_runs;
  if (options_.warmup_iters > 0) return out;
  // CAPTURE with warmup_iters 0: from this call's own recording, right after it; the call's
  // outputs are the warm-up run's, and the next call replays.
  if (auto s = Capture(ts, e, inputs); !s.ok()) Fallback(e, std::string(s.message()));
  return out;
}

}  // namespace torchreplay::replay
