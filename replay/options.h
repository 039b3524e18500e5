// replay/options.h: an engine's settings (EngineOptions), what it reports (EngineStats) and where
// its log goes (SetLogLevel, SetLogSink), apart from the engine so that the public C++ API
// (torchreplay/torchreplay.h) can use them without the engine's own dependencies.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "capture/ir/capture_info.h"

namespace torchreplay::replay {

enum class Mode { kDefault, kReduceOverhead };

enum class LogLevel : int { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

// Every setting of an engine, fixed when it is made. Engine users start from Defaults().
struct EngineOptions {
  // kDefault runs the graph op by op in C++ (no capture); kReduceOverhead captures and replays.
  Mode mode = Mode::kReduceOverhead;
  // Eager runs of a new key before it is captured (the last one records what capture needs).
  int warmup_iters = 1;
  // Keys captured per engine and thread; calls with further new keys run eagerly.
  int capture_limit = 64;
  // Keys held per engine and thread (captured, warming up or running eagerly), at least 1; the
  // least recently used is evicted beyond it.
  int cache_limit = 256;
  // Hand out copies of pool outputs instead of views (no invalidation; one copy per pool
  // buffer, so outputs that alias each other, y and y.t(), still do).
  bool clone_outputs = false;
  // Pool outputs still alive when the pool is next reused are copied out, never invalidated
  // (what autograd keeps: activations saved for backward, gradients). Set for training graphs.
  bool preserve_outputs = false;
  // Name used in logs, stats and errors (e.g. "forward", "backward").
  std::string name = "graph";
  // Leading inputs the caller binds once (torchreplay.capture: parameters, buffers); input errors
  // then name the others "argument i", as the user passed them.
  int bound_inputs = 0;
  // When set, each capture writes what it captured to DIR/torchreplay_NAME.keyK: the tape's
  // plan as .txt (CPU), the CUDA graph as .dot.
  std::string dump_dir;
  // CUDA keys: capture them into torchreplay's own CUDA graphs (capture/cuda/cuda_graph.h), which have
  // never run on a GPU: untested, opt-in, logged as such at the first capture. false: CUDA keys
  // run op by op in C++, with this reason in the stats (torch.compile's CUDA graphs then come from
  // PyTorch's cudagraph trees around the engine: python/torchreplay/backend.py).
  bool cuda_graphs = false;
  // CPU: pointwise steps on a TensorIterator built once (Note [Prepared pointwise steps]).
  bool prepared_steps = true;
  // CPU: runs of elementwise nodes as one step computing each element as eager does (Note
  // [Fused elementwise steps]).
  bool fuse_elementwise = true;
  // Messages below this level are not logged.
  LogLevel log_level = LogLevel::kWarning;
  // Batch-size buckets (Note [Capture sizes]): the batch sizes captured, ascending. A call whose
  // batch is not one of them is padded up to the next, replayed, and its batch outputs sliced
  // back; one above the largest runs eagerly. Empty: off.
  std::vector<int64_t> capture_sizes;
  std::vector<int> batch_inputs;       // tensor inputs whose dim 0 is the batch
  std::vector<int> batch_size_inputs;  // int inputs holding the batch size
  std::vector<int> batch_outputs;      // outputs whose dim 0 is the batch

  // The defaults with the environment's switches applied (FromEnvironment of the process's
  // environment, read once per process); log_level is DefaultLogLevel().
  static EngineOptions Defaults();
  // The defaults with the switches `getenv` gives: TORCHREPLAY_PREPARED_ITERATORS=0 turns
  // prepared steps off, TORCHREPLAY_FUSE=0 fused elementwise steps, TORCHREPLAY_LOG_LEVEL=0..3
  // sets log_level (clamped).
  static EngineOptions FromEnvironment(const char* (*getenv)(const char* name));
};

struct CaptureRecord {
  std::string key;     // the guard key captured
  std::string reason;  // why: "no graph yet", the key diff, or a moved static input
  double milliseconds = 0;
  capture::CaptureInfo info;  // steps, arena bytes, functional ops
};

struct EngineStats {
  int64_t calls = 0, replays = 0, captures = 0, warmups = 0, eager_fallbacks = 0;
  int64_t misses = 0;      // calls whose key was not held (new, or evicted): each ran eagerly
  std::string last_miss;   // why the latest miss had a new key: the key diff
  int64_t evictions = 0;   // keys dropped by the cache_limit
  int64_t errors = 0;      // calls that raised (bad inputs, a kernel that failed)
  std::string last_error;  // the latest of them
  // What the engine holds now, all threads together: keys, pool storages handed out by the
  // latest replays (tracked until the next), and the largest pool of any thread.
  int64_t cache_entries = 0, handed_out = 0, pool_bytes = 0;
  // Pool outputs still alive when their pool was reused (or freed), copied out of it instead of
  // invalidated (fed back, preserve_outputs), since the engine was built: storages and bytes.
  int64_t copied_out = 0, copied_out_bytes = 0;
  // The latest captures and fallbacks (at most kLogLength each; the counts above are complete).
  std::vector<CaptureRecord> capture_log;
  std::vector<std::string> fallback_reasons;
  static constexpr size_t kLogLength = 64;
};

// The log level engines made from now on get (EngineOptions::Defaults), and the current one.
void SetLogLevel(LogLevel level);
LogLevel DefaultLogLevel();

// Where engines' messages go (those at or above their options' log_level): "graph 'NAME': ...".
// Without a sink (a C++ program), stderr as "[torchreplay W] graph ...". The Python module
// installs one handing them to Python's "torchreplay" logger (Note [One log]). The sink is
// called with no engine lock held, from the calling thread.
using LogSink = void (*)(LogLevel level, const std::string& message);
void SetLogSink(LogSink sink);

// Hands `line` to the sink, or writes it to stderr without one (what Engine::Log does with a
// message at or above its engine's log_level).
void EmitLog(LogLevel level, const std::string& line);

}  // namespace torchreplay::replay
