// replay/key_cache.h: one thread's guard keys and what the engine holds for each (Entry), bounded
// and least-recently-used first out (Note [A bounded cache]), with the misses that made them.
//
// Ownership: a KeyCache belongs to one thread's engine state and owns its entries; an entry owns
// its warm-up recording and its captured graph (whose buffers live in the thread's pool). Entry
// pointers stay valid until the entry is evicted (handed back to the caller by Insert).
#pragma once

#include <ATen/core/ivalue.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "guards/guard_key.h"
#include "capture/ir/captured_graph.h"
#include "capture/ir/recording.h"

namespace torchreplay::replay {

// Everything the engine holds for one guard key on one thread.
struct Entry {
  guards::GuardKey key;
  bool cuda = false;         // an input is a CUDA tensor: the CUDA settings are part of the key
  std::string reason;  // why this key needs a capture
  int eager_runs = 0;
  std::optional<capture::Recording> recording;           // of the latest warm-up run
  std::unique_ptr<capture::CapturedGraph> graph;         // set: the key replays
  std::vector<std::pair<int, const void*>> static_ptrs;  // baked-in addresses
  std::vector<bool> baked;                               // inputs baked in (static, not moving)
  std::vector<int> moves;                                // per input: times its address moved
  std::string fallback_reason;                           // set: this key runs eagerly
  bool admitted = false;                                 // counts against capture_limit
  uint64_t last_used = 0;                                // KeyCache's clock when last looked up
};

// Note [A bounded cache]
// Every key a thread has seen would otherwise stay in its cache with its warm-up recording, so a
// stream of new keys (a position or step counter that decides a shape, a new batch size each
// call) would grow memory without bound. A thread holds at most cache_limit keys; a new key
// beyond that evicts the least recently looked-up one (never the key being run). An evicted key
// that comes back is a new key again: warmed up and captured anew, or run eagerly past the
// capture limit. Evicting a captured key frees its captured graph, frees its admission under
// capture_limit (so a later key may capture), and shrinks the CPU arena to the largest need of
// the captured keys left (outputs still handed out from it are copied out first, as when the
// engine goes). Misses are counted with their key diff; when kChurn calls in a row miss, the
// inputs that changed on each of them are logged once: such a graph never replays.
class KeyCache {
 public:
  static constexpr int kChurn = 8;

  explicit KeyCache(int limit) : limit_(limit < 1 ? 1 : limit) {}

  // The previous call's entry if `inputs` and the settings now match its key (checked without
  // allocating), else null. Every call asks this first: inline, on the replay path.
  Entry* Last(const std::vector<c10::IValue>& inputs, bool precision) {
    if (last_ == nullptr || !last_->key.Matches(inputs)) return nullptr;
    if (last_->key.settings() != guards::Ambient::Now(last_->cuda, precision)) return nullptr;
    miss_streak_ = 0;
    return last_;
  }
  // The held entry of `key`, now the most recently used and the previous call's; null if none.
  Entry* Find(const guards::GuardKey& key);

  // A call whose key is not held.
  struct Miss {
    std::string diff;           // from the previous call's key ("no graph yet" at first)
    bool churn = false;         // this call is the kChurn-th miss in a row, or later
    std::vector<int> churning;  // ... then: the inputs that changed on each of them
  };
  Miss NoteMiss(const guards::GuardKey& key);

  // Holds `entry` for `key` as the most recently used and the previous call's entry, evicting the
  // least recently used others beyond the limit: they are returned (their admissions given up).
  Entry* Insert(guards::GuardKey key, std::unique_ptr<Entry> entry,
                std::vector<std::unique_ptr<Entry>>* evicted);

  // The largest arena need of the captured keys held.
  int64_t LargestArenaNeed() const;

  // Keys held that may capture (admitted under capture_limit).
  int admitted = 0;

  // Keys held; readable from any thread (stats).
  int64_t size() const { return size_.load(std::memory_order_relaxed); }

 private:
  const int limit_;
  absl::flat_hash_map<guards::GuardKey, std::unique_ptr<Entry>> entries_;
  guards::GuardKey last_key_;
  Entry* last_ = nullptr;
  uint64_t tick_ = 0;  // lookups so far: the recency clock
  // Consecutive misses, and per input how many of them changed it.
  int miss_streak_ = 0;
  std::vector<int> changed_in_streak_;
  std::atomic<int64_t> size_{0};
};

}  // namespace torchreplay::replay
