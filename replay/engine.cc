// The engine: the whole warm-up -> capture -> replay life of a compiled graph, its three states
// marked where they happen (WARM-UP, CAPTURE, REPLAY), plus the eager fallback.
#include "replay/engine.h"

#include <ATen/ExpandUtils.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/ops/from_blob.h>
#include <ATen/record_function.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/intrusive_ptr.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <optional>

#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "capture/cuda_graph.h"
#include "capture/kernel_tape.h"
#include "capture/recording.h"
#include "guards/guard_key.h"
#include "memory_pool/arena.h"
#include "memory_pool/cuda_pool.h"

namespace torchreplay::replay {

// ---------------------------------------------------------------- options and logging

namespace {
LogLevel LogLevelFromEnvironment() {
  const char* env = std::getenv("TORCHREPLAY_LOG_LEVEL");
  const int level = env != nullptr ? std::atoi(env) : static_cast<int>(LogLevel::kWarning);
  return static_cast<LogLevel>(std::min(std::max(level, 0), 3));
}
std::atomic<LogLevel> g_default_log_level{LogLevelFromEnvironment()};
}  // namespace

void SetLogLevel(LogLevel level) { g_default_log_level = level; }
LogLevel DefaultLogLevel() { return g_default_log_level; }

EngineOptions EngineOptions::Defaults() {
  auto on_unless_zero = [](const char* name) {
    const char* env = std::getenv(name);
    return env == nullptr || std::string(env) != "0";
  };
  static const bool prepared_steps = on_unless_zero("TORCHREPLAY_PREPARED_ITERATORS");
  static const bool fuse_elementwise = on_unless_zero("TORCHREPLAY_FUSE");
  EngineOptions o;
  o.prepared_steps = prepared_steps;
  o.fuse_elementwise = fuse_elementwise;
  o.log_level = g_default_log_level;
  return o;
}

void Engine::Log(LogLevel level, const std::string& message) const {
  if (level < options_.log_level) return;
  static const char* kTags = "DIWE";
  std::cerr << "[torchreplay " << kTags[static_cast<int>(level)] << "] graph '" << options_.name
            << "': " << message << std::endl;
}

// ---------------------------------------------------------------- state

struct Engine::Entry {
  guards::GuardKey key;
  std::string reason;  // why this key needs a capture
  int eager_runs = 0;
  std::optional<capture::Recording> recording;
  std::unique_ptr<capture::CapturedGraph> graph;
  std::vector<std::pair<int, const void*>> static_ptrs;  // baked-in addresses
  std::vector<bool> baked;                               // inputs baked in (static, not moving)
  std::vector<int> moves;                                // per input: times its address moved
  std::string fallback_reason;                           // set: this key runs eagerly
  bool admitted = false;                                 // counts against capture_limit
  uint64_t last_used = 0;                                // ThreadState::tick when last looked up
};

struct Engine::ThreadState {
  memory_pool::Arena arena;         // CPU keys
  memory_pool::CudaPool cuda_pool;  // CUDA keys: one private pool for all of them
  absl::flat_hash_map<guards::GuardKey, std::unique_ptr<Entry>> cache;
  guards::GuardKey last_key;
  Entry* last = nullptr;
  int captured = 0;                // captures done (recaptures of a key included)
  int admitted = 0;                // keys held that may capture: at most capture_limit
  bool limit_logged = false;
  uint64_t tick = 0;               // lookups so far: the cache's recency clock
  // Consecutive misses, and per input how many of them changed it (Note [A bounded cache]).
  int miss_streak = 0;
  std::vector<int> changed_in_streak;
  // Storages handed out by the last replay that alias the pool (Note [Handed-out outputs]).
  std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> handed_out;
  // Per capture size: the padded batch inputs (Note [Capture sizes]).
  absl::flat_hash_map<int64_t, std::vector<at::Tensor>> staging;
  // cache.size() and handed_out.size(), written by this thread, read by stats() from any.
  std::atomic<int64_t> cache_size{0}, handed_out_size{0};
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

Engine::Engine(std::shared_ptr<const capture::Graph> graph, EngineOptions options)
    : id_(next_engine_id++), graph_(std::move(graph)), options_(std::move(options)),
      interpreter_(graph_) {
  // The inputs a padded call copies back: those an op writes directly, or every input when an
  // op writes something else (which may be a view of one).
  const auto& ins = graph_->inputs();
  written_.assign(ins.size(), false);
  for (const capture::Node& n : graph_->nodes()) {
    if (!n.op.has_value()) continue;
    const auto& args = n.op->schema().arguments();
    for (size_t a = 0; a < args.size() && a < n.args.size(); ++a) {
      if (args[a].alias_info() == nullptr || !args[a].alias_info()->isWrite()) continue;
      const auto in = n.args[a].kind == capture::Arg::Kind::kValue
                          ? std::find(ins.begin(), ins.end(), n.args[a].value) : ins.end();
      if (in != ins.end()) {
        written_[in - ins.begin()] = true;
      } else {
        written_.assign(ins.size(), true);
      }
    }
  }
  invalidated_msg_ = absl::StrCat(
      "torchreplay: this tensor is an output of the replayed graph '", options_.name,
      "', and a later replay has reused its memory. Clone outputs you keep across calls "
      "(out.clone()), or set config.reduce_overhead.clone_outputs = True.");
}

Engine::~Engine() {
  absl::MutexLock lock(&mu_);
  // The pool is freed; outputs the caller still holds keep their values (as in eager).
  for (auto& [id, ts] : threads_) ReleaseOutputs(*ts, {}, /*copy_all=*/true);
}

Engine::ThreadState& Engine::StateForThisThread() {
  for (const StateSlot& s : state_cache) {
    if (s.engine_id == id_) return *static_cast<ThreadState*>(s.state);
  }
  ThreadState* ts;
  {
    absl::MutexLock lock(&mu_);
    auto& slot = threads_[std::this_thread::get_id()];
    if (slot == nullptr) slot = std::make_unique<ThreadState>();
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
  absl::MutexLock lock(&mu_);
  for (const auto& [id, ts] : threads_) {
    s.pool_bytes = std::max(s.pool_bytes, ts->arena.bytes() + ts->cuda_pool.bytes());
    s.cache_entries += ts->cache_size.load(std::memory_order_relaxed);
    s.handed_out += ts->handed_out_size.load(std::memory_order_relaxed);
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

// Note [A bounded cache]
// Every key a thread has seen would otherwise stay in its cache with its warm-up recording, so a
// stream of new keys (a position or step counter that decides a shape, a new batch size each
// call) would grow memory without bound. A thread holds at most cache_limit keys; a new key
// beyond that evicts the least recently looked-up one (never the key being run). An evicted key
// that comes back is a new key again: warmed up and captured anew, or run eagerly past the
// capture limit. Evicting a captured key frees its captured graph, frees its admission under
// capture_limit (so a later key may capture), and shrinks the CPU arena to the largest need of
// the captured keys left (outputs still handed out from it are copied out first, as when the
// engine goes). Misses are counted with their key diff; when 8 calls in a row miss, the inputs
// that changed on each of them are logged once: such a graph never replays.

std::string Engine::NoteMiss(ThreadState& ts, const guards::GuardKey& key) {
  ++misses_;
  std::string diff = ts.cache.empty() ? "no graph yet" : guards::Diff(ts.last_key, key);
  {
    absl::MutexLock lock(&mu_);
    last_miss_ = diff;
  }
  const std::vector<guards::InputGuard>& now = key.inputs();
  const std::vector<guards::InputGuard>& before = ts.last_key.inputs();  // empty at first
  if (ts.miss_streak++ == 0) ts.changed_in_streak.assign(now.size(), 0);
  for (size_t i = 0; i < now.size() && before.size() == now.size(); ++i) {
    ts.changed_in_streak[i] += !(before[i] == now[i]);
  }
  constexpr int kChurn = 8;
  if (ts.miss_streak < kChurn || churn_logged_.exchange(true)) return diff;
  std::vector<std::string> changing;
  for (size_t i = 0; i < now.size(); ++i) {
    if (ts.changed_in_streak[i] < kChurn - 1) continue;  // the first call has nothing before it
    changing.push_back(absl::StrCat(now[i].is_scalar() ? "scalar " : "", "input ", i, " (",
                                    graph_->values()[graph_->inputs()[i]].name, ")"));
  }
  Log(LogLevel::kWarning,
      absl::StrCat("the last ", kChurn, " calls each had a new guard key",
                   changing.empty() ? "" : absl::StrCat(" (", absl::StrJoin(changing, ", "),
                                                        " changed on each)"),
                   ", so each ran eagerly; a graph whose key changes on every call never "
                   "replays. Latest change: ", diff, ". A scalar that decides a shape is guarded by "
                   "its value; config.reduce_overhead.capture_sizes pads batch sizes to a few."));
  return diff;
}

void Engine::Evict(ThreadState& ts, const Entry* keep) {
  auto victim = ts.cache.end();
  for (auto it = ts.cache.begin(); it != ts.cache.end(); ++it) {
    if (it->second.get() == keep) continue;
    if (victim == ts.cache.end() || it->second->last_used < victim->second->last_used) victim = it;
  }
  if (victim == ts.cache.end()) return;
  const Entry& e = *victim->second;
  ts.admitted -= e.admitted;
  if (ts.last == &e) ts.last = nullptr;
  const bool captured = e.graph != nullptr;
  ts.cache.erase(victim);
  ts.cache_size.store(static_cast<int64_t>(ts.cache.size()), std::memory_order_relaxed);
  ++evictions_;
  if (!captured) return;
  int64_t need = 0;
  for (const auto& [key, entry] : ts.cache) {
    if (entry->graph != nullptr) need = std::max(need, entry->graph->info().arena_bytes);
  }
  if (need < ts.arena.bytes()) {
    ReleaseOutputs(ts, {}, /*copy_all=*/true);  // handed-out outputs may live in what goes
    ts.arena.Shrink(need);
  }
}

absl::StatusOr<Engine::Entry*> Engine::Lookup(ThreadState& ts,
                                              const std::vector<c10::IValue>& inputs) {
  guards::GuardKey key = guards::GuardKey::FromInputs(inputs, graph_->per_call_scalars());
  auto it = ts.cache.find(key);
  if (it != ts.cache.end()) {
    ts.last_key = key;
    it->second->last_used = ++ts.tick;
    ts.miss_streak = 0;
    return it->second.get();
  }
  if (auto s = CheckInputs(inputs); !s.ok()) return s;
  auto entry = std::make_unique<Entry>();
  entry->reason = NoteMiss(ts, key);
  entry->key = key;
  entry->last_used = ++ts.tick;
  for (int i = 0; i < static_cast<int>(inputs.size()); ++i) {
    entry->baked.push_back(graph_->is_static_input(i));
  }
  entry->moves.assign(inputs.size(), 0);
  Entry* e = entry.get();
  ts.cache.emplace(key, std::move(entry));
  ts.cache_size.store(static_cast<int64_t>(ts.cache.size()), std::memory_order_relaxed);
  ts.last_key = std::move(key);
  while (static_cast<int>(ts.cache.size()) > std::max(1, options_.cache_limit)) Evict(ts, e);
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
  if (ts.admitted < options_.capture_limit) {
    ++ts.admitted;
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

// Note [Handed-out outputs]
// A replay hands its pool outputs out through storages of their own, one per pool buffer (each
// a new StorageImpl over the buffer's bytes, Note [One storage per buffer]), aliasing the pool: the caller sees what eager would give (a
// tensor at offset 0 of its own storage, views of one buffer sharing it), so an output fed back
// as the next input has the same guard key as a fresh tensor. Before the pool is reused (the
// next capture or replay of any key on this thread), every handed-out storage still alive is
//   - copied out, given memory of its own with the same bytes, if this call reads it (an output
//     fed back: h = f(x, h)) or the engine preserves outputs (training: autograd's saved
//     activations and gradients); or else
//   - invalidated: its data released, so that touching it raises invalidated_msg_.
// Either way no replay writes under a tensor the caller can still read. The copy happens only
// for outputs kept alive, and only once. When the engine (and its pool) goes away, every
// handed-out storage still alive is copied out.

namespace {

at::Tensor BytesOf(const c10::StorageImpl& s) {
  return at::from_blob(const_cast<void*>(s.data()), {static_cast<int64_t>(s.nbytes())},
                       at::TensorOptions().dtype(at::kByte).device(s.device()));
}

// Moves a handed-out storage to memory of its own, keeping its bytes (all its views follow).
void CopyOut(c10::StorageImpl& s) {
  at::Tensor fresh = at::empty({static_cast<int64_t>(s.nbytes())},
                               at::TensorOptions().dtype(at::kByte).device(s.device()));
  fresh.copy_(BytesOf(s));
  s.set_data_ptr_noswap(fresh.storage().unsafeGetStorageImpl()->set_data_ptr(c10::DataPtr()));
}

bool ReadBy(const std::vector<c10::IValue>& inputs, const c10::StorageImpl* s) {
  for (const auto& v : inputs) {
    if (v.isTensor() && v.toTensor().defined() && v.toTensor().has_storage() &&
        v.toTensor().storage().unsafeGetStorageImpl() == s) {
      return true;
    }
  }
  return false;
}

}  // namespace

void Engine::ReleaseOutputs(ThreadState& ts, const std::vector<c10::IValue>& inputs,
                            bool copy_all) {
  for (auto& weak : ts.handed_out) {
    auto strong = weak.lock();
    if (!strong) continue;
    if (copy_all || options_.preserve_outputs || ReadBy(inputs, strong.get())) {
      CopyOut(*strong);
    } else {
      strong->release_data_and_set_meta_custom_data_ptr_error_msg_(invalidated_msg_);
    }
  }
  ts.handed_out.clear();
  ts.handed_out_size.store(0, std::memory_order_relaxed);
}

// CAPTURE: build the CapturedGraph for this key from the recording of its last warm-up run.
absl::Status Engine::Capture(ThreadState& ts, Entry& e, const std::vector<c10::IValue>& inputs) {
  RECORD_FUNCTION("torchreplay::capture", std::vector<c10::IValue>());
  ReleaseOutputs(ts, inputs);  // the pool may grow, and replays below will reuse it
  const auto t0 = std::chrono::steady_clock::now();
  const bool cuda = capture::Interpreter::CudaDevice(inputs).has_value();
  capture::CaptureOptions options;
  options.prepared_steps = options_.prepared_steps;
  options.fuse_elementwise = options_.fuse_elementwise;
  options.keep_graph = !options_.dump_dir.empty();
  absl::StatusOr<std::unique_ptr<capture::CapturedGraph>> graph;
  try {  // an allocation that fails half-way (out of memory) fails the capture, not the call
    graph = cuda ? capture::CaptureCudaGraph(graph_, *e.recording, inputs, &ts.cuda_pool, options)
                 : capture::CaptureKernelTape(graph_, *e.recording, inputs, &ts.arena, options);
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

// REPLAY: bind inputs, replay, hand out outputs.
absl::StatusOr<std::vector<c10::IValue>> Engine::Replay(ThreadState& ts, Entry& e,
                                                        std::vector<c10::IValue>& inputs) {
  RECORD_FUNCTION("torchreplay::replay", std::vector<c10::IValue>());
  ReleaseOutputs(ts, inputs);
  // An input still in the pool that is not a handed-out output (memory shared through NumPy or
  // DLPack) would be overwritten while it is read: the replay reads a copy (same geometry, so
  // the key still holds).
  for (auto& v : inputs) {
    if (!v.isTensor()) continue;
    const at::Tensor& t = v.toTensor();
    if (t.defined() && t.has_storage() &&
        ts.arena.Overlaps(t.storage().data(), static_cast<int64_t>(t.storage().nbytes()))) {
      at::Tensor bytes = BytesOf(*t.storage().unsafeGetStorageImpl()).clone();
      v = at::empty({0}, t.options()).set_(bytes.storage(), t.storage_offset(), t.sizes(), t.strides());
    }
  }
  std::vector<c10::IValue> outs;
  auto s = e.graph->Replay(inputs, &outs);
  if (!s.ok()) {
    return capture::WithContext(s, absl::StrCat("graph '", options_.name, "': "));
  }
  ++replays_;
  // Pool outputs are handed out through storages of their own, one per pool buffer (Note
  // [Handed-out outputs]); `made` holds this call's, for outputs that share a buffer.
  absl::InlinedVector<std::pair<const char*, c10::intrusive_ptr<c10::StorageImpl>>, 4> made;
  for (size_t i = 0; i < outs.size(); ++i) {
    if (!e.graph->OutputInPool(i) || !outs[i].isTensor() || !outs[i].toTensor().defined()) continue;
    const at::Tensor& t = outs[i].toTensor();
    const c10::StorageImpl* pool = t.storage().unsafeGetStorageImpl();
    const char* base = static_cast<const char*>(pool->data());
    auto same = std::find_if(made.begin(), made.end(), [&](const auto& m) { return m.first == base; });
    if (same == made.end()) {
      auto storage = c10::make_intrusive<c10::StorageImpl>(
          c10::StorageImpl::use_byte_size_t(), pool->nbytes(),
          c10::DataPtr(const_cast<char*>(base), t.device()), nullptr, /*resizable=*/false);
      if (options_.clone_outputs) {
        CopyOut(*storage);  // a copy per buffer: outputs that alias each other still do
      } else {
        ts.handed_out.emplace_back(storage);
        ts.handed_out_size.store(static_cast<int64_t>(ts.handed_out.size()), std::memory_order_relaxed);
      }
      made.emplace_back(base, std::move(storage));
      same = made.end() - 1;
    }
    auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(same->second), t.key_set(), t.dtype());
    impl->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
    outs[i] = at::Tensor(std::move(impl));
  }
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
  if (!options_.capture_sizes.empty()) {
    std::vector<std::vector<c10::IValue>> sized;
    for (const auto& inputs : input_sets) {
      const int64_t n = BatchSize(inputs);
      if (n < 0) return absl::InvalidArgumentError("precapture: an input set has no batch input");
      for (int64_t size : options_.capture_sizes) sized.push_back(Resized(inputs, n, size, nullptr));
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
  for (int k = 0; k <= std::max(0, options_.warmup_iters); ++k) {
    if (auto out = RunKeyed(inputs); !out.ok()) return out.status();
  }
  ThreadState& ts = StateForThisThread();
  absl::StatusOr<Entry*> e = Lookup(ts, inputs);
  if (!e.ok()) return e.status();
  if ((*e)->graph == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "graph '", options_.name, "': this key is not replayed: ",
        (*e)->fallback_reason.empty() ? "it is not captured yet" : (*e)->fallback_reason));
  }
  ReleaseOutputs(ts, inputs, /*copy_all=*/true);
  return (*e)->graph->ProfileReplay(inputs, iterations);
}

// Note [Capture sizes]
// Serving loops see a new batch size on most steps; capturing each one costs a capture per size
// and a key per size in the cache. With capture_sizes (vLLM's name; torchair's "gears"), only
// those batch sizes are captured: a call with n rows, n not a capture size, is padded up to the
// next one b (its batch inputs copied into per-thread staging tensors of b rows in the caller's
// dim order, rows n.. copies of row n - 1, so padding raises nothing a real row does not (an
// integer division by a zero row would); its batch-size inputs set to b), replayed under b's
// key, and its batch outputs narrowed back to n rows (views of the pool, as any output). A batch
// output that aliases a staging tensor is cloned (the staging is reused by the next call); batch
// inputs an op writes are copied back (rows 0..n), so writes reach the caller's tensor. Rows must
// be independent (each output row a function of the same input row): torch.compile's backend
// checks that on the graph before it sets the batch fields (bindings/torchreplay/capture_sizes.py);
// for an engine built by hand it is the caller's promise. A batch above the largest capture size
// runs eagerly, with that reason. A call whose batch inputs are not all dense (a strided slice,
// an expanded tensor) is not padded but run under its own key: the dense staging copy could send
// a kernel down another path than eager's (a strided reduction sums in another order).
// All sizes share one pool, sized by the largest (PlanArena per key, one arena per thread).

int64_t Engine::BatchSize(const std::vector<c10::IValue>& inputs) const {
  for (int i : options_.batch_inputs) {
    if (i < static_cast<int>(inputs.size()) && inputs[i].isTensor() &&
        inputs[i].toTensor().defined() && inputs[i].toTensor().dim() > 0) {
      return inputs[i].toTensor().size(0);
    }
  }
  return -1;
}

bool Engine::BatchInputsDense(const std::vector<c10::IValue>& inputs) const {
  for (int i : options_.batch_inputs) {
    if (i < static_cast<int>(inputs.size()) && inputs[i].isTensor() && inputs[i].toTensor().defined() &&
        !inputs[i].toTensor().is_non_overlapping_and_dense()) {
      return false;
    }
  }
  return true;
}

std::vector<c10::IValue> Engine::Resized(const std::vector<c10::IValue>& inputs, int64_t n,
                                         int64_t size, std::vector<at::Tensor>* staging) const {
  std::vector<c10::IValue> out = inputs;
  const size_t num = options_.batch_inputs.size();
  if (staging != nullptr) staging->resize(num);
  for (size_t k = 0; k < num; ++k) {
    const int i = options_.batch_inputs[k];
    if (i >= static_cast<int>(inputs.size()) || !inputs[i].isTensor()) continue;
    const at::Tensor& t = inputs[i].toTensor();
    if (!t.defined() || t.dim() == 0 || t.size(0) != n) continue;  // CheckInputs or the key says
    std::vector<int64_t> sizes = t.sizes().vec();
    sizes[0] = size;
    at::Tensor fresh;
    at::Tensor& s = staging != nullptr ? (*staging)[k] : fresh;
    // Dense, in the caller's dim order (a channels-last batch stays channels-last).
    const std::vector<int64_t> strides = at::infer_dense_strides(sizes, t.strides());
    if (!s.defined() || s.sizes() != c10::IntArrayRef(sizes) || s.strides() != c10::IntArrayRef(strides) ||
        s.dtype() != t.dtype() || s.device() != t.device()) {
      s = at::empty_strided(sizes, strides, t.options());
    }
    const int64_t rows = std::min(n, size);
    if (s.is_cpu() && t.is_contiguous() && s.is_contiguous()) {  // no dispatch on the fast path
      const size_t row_bytes = s.numel() == 0 ? 0 : s.nbytes() / size;
      char* dst = static_cast<char*>(s.data_ptr());
      std::memcpy(dst, t.const_data_ptr(), rows * row_bytes);
      for (int64_t r = rows; r < size; ++r) {
        if (rows > 0) std::memcpy(dst + r * row_bytes, dst + (rows - 1) * row_bytes, row_bytes);
        else std::memset(dst + r * row_bytes, 0, row_bytes);
      }
    } else {
      s.narrow(0, 0, rows).copy_(t.narrow(0, 0, rows));
      if (size > rows) {
        at::Tensor pad = s.narrow(0, rows, size - rows);
        rows > 0 ? pad.copy_(t.narrow(0, rows - 1, 1).expand_as(pad)) : pad.zero_();
      }
    }
    out[i] = s;
  }
  for (int i : options_.batch_size_inputs) {
    if (i < static_cast<int>(out.size()) && out[i].isInt() && out[i].toInt() == n) out[i] = size;
  }
  return out;
}

absl::StatusOr<std::vector<c10::IValue>> Engine::RunPadded(std::vector<c10::IValue> inputs,
                                                           int64_t n) {
  const auto& sizes = options_.capture_sizes;
  const auto bucket = std::lower_bound(sizes.begin(), sizes.end(), n);
  if (bucket == sizes.end()) {
    RECORD_FUNCTION("torchreplay::eager_fallback", std::vector<c10::IValue>());
    if (!oversize_logged_.exchange(true)) {
      std::string reason = absl::StrCat("batch size ", n, " is above the largest capture size (",
                                        sizes.back(), "); such calls run eagerly");
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
  ReleaseOutputs(ts, inputs);
  std::vector<at::Tensor>& staging = ts.staging[*bucket];
  absl::StatusOr<std::vector<c10::IValue>> out =
      RunKeyed(Resized(inputs, n, *bucket, &staging));
  if (!out.ok()) return out;
  for (size_t k = 0; k < staging.size(); ++k) {
    const int i = options_.batch_inputs[k];
    if (staging[k].defined() && written_[i] && inputs[i].isTensor()) {
      inputs[i].toTensor().copy_(staging[k].narrow(0, 0, n));
    }
  }
  for (int o : options_.batch_outputs) {
    if (o >= static_cast<int>(out->size()) || !(*out)[o].isTensor()) continue;
    const at::Tensor& t = (*out)[o].toTensor();
    if (!t.defined() || t.dim() == 0 || t.size(0) != *bucket) continue;
    // Its first n rows, as a tensor of its own over the same memory (no dispatch).
    auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(t.storage()), t.key_set(), t.dtype());
    std::vector<int64_t> rows = t.sizes().vec();
    rows[0] = n;
    impl->set_sizes_and_strides(rows, t.strides(), t.storage_offset());
    at::Tensor narrowed(std::move(impl));
    for (const at::Tensor& s : staging) {
      if (s.defined() && t.is_alias_of(s)) narrowed = narrowed.clone();
    }
    (*out)[o] = std::move(narrowed);
  }
  return out;
}

absl::StatusOr<std::vector<c10::IValue>> Engine::Run(std::vector<c10::IValue> inputs) {
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
  if (!options_.capture_sizes.empty()) {
    const int64_t n = BatchSize(inputs);
    if (n >= 0 && !std::binary_search(options_.capture_sizes.begin(), options_.capture_sizes.end(), n) &&
        BatchInputsDense(inputs)) {
      return RunPadded(std::move(inputs), n);
    }
  }
  return RunKeyed(std::move(inputs));
}

absl::StatusOr<std::vector<c10::IValue>> Engine::RunKeyed(std::vector<c10::IValue> inputs) {
  ThreadState& ts = StateForThisThread();
  Entry* e = nullptr;
  if (ts.last != nullptr && ts.last->key.Matches(inputs)) {
    e = ts.last;  // the common case: same key as the previous call, checked without allocating
    ts.miss_streak = 0;
  } else {
    auto found = Lookup(ts, inputs);
    if (!found.ok()) return found.status();
    e = *found;
    ts.last = e;
  }
  if (!e->fallback_reason.empty()) {
    RECORD_FUNCTION("torchreplay::eager_fallback", std::vector<c10::IValue>());
    ++eager_fallbacks_;
    return RunEager(inputs);
  }
  if (e->graph != nullptr) {
    for (const auto& [i, ptr] : e->static_ptrs) {
      const void* now = inputs[i].toTensor().const_data_ptr();
      if (now != ptr) {
        // Never replay with a stale address: recapture this key around the new one. A static
        // input that keeps moving (a buffer reassigned in forward: self.avg = self.avg * 0.9 + ..)
        // is rebound per call from its second move on, instead of recaptured every call.
        const bool rebind = ++e->moves[i] >= 2;
        e->baked[i] = !rebind;
        e->reason = absl::StrCat("static input ", i, " (", graph_->values()[graph_->inputs()[i]].name,
                                 ") moved", rebind ? "; it is rebound per call from now on" : "");
        e->graph.reset();
        e->eager_runs = 0;
        --ts.captured;
        break;
      }
    }
  }
  if (e->graph == nullptr) {
    if (e->eager_runs < options_.warmup_iters || !e->recording.has_value()) {
      // WARM-UP: run eagerly, recording what capture needs.
      RECORD_FUNCTION("torchreplay::warmup", std::vector<c10::IValue>());
      ++warmups_;
      e->recording.emplace();
      e->recording->baked_inputs = e->baked;
      absl::StatusOr<std::vector<c10::IValue>> out =
          capture::RunAndRecord(interpreter_, inputs, &*e->recording);
      if (!out.ok()) {
        e->recording.reset();
        return capture::WithContext(out.status(), absl::StrCat("graph '", options_.name, "': "));
      }
      ++e->eager_runs;
      if (options_.warmup_iters <= 0) {
        if (auto s = Capture(ts, *e, inputs); !s.ok()) Fallback(*e, std::string(s.message()));
      }
      return out;
    }
    if (auto s = Capture(ts, *e, inputs); !s.ok()) {
      Fallback(*e, std::string(s.message()));
      RECORD_FUNCTION("torchreplay::eager_fallback", std::vector<c10::IValue>());
      ++eager_fallbacks_;
      return RunEager(inputs);
    }
  }
  return Replay(ts, *e, inputs);
}

}  // namespace torchreplay::replay
