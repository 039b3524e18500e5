// One thread's bounded key cache (Note [A bounded cache] in key_cache.h).
#include "replay/key_cache.h"

#include <algorithm>

namespace torchreplay::replay {

Entry* KeyCache::Find(const guards::GuardKey& key) {
  auto it = entries_.find(key);
  if (it == entries_.end()) return nullptr;
  last_key_ = key;
  it->second->last_used = ++tick_;
  miss_streak_ = 0;
  last_ = it->second.get();
  return last_;
}

KeyCache::Miss KeyCache::NoteMiss(const guards::GuardKey& key) {
  Miss miss;
  miss.diff = entries_.empty() ? "no graph yet" : guards::Diff(last_key_, key);
  const std::vector<guards::InputGuard>& now = key.inputs();
  const std::vector<guards::InputGuard>& before = last_key_.inputs();  // empty at first
  if (miss_streak_++ == 0) changed_in_streak_.assign(now.size(), 0);
  for (size_t i = 0; i < now.size() && before.size() == now.size(); ++i) {
    changed_in_streak_[i] += !(before[i] == now[i]);
  }
  if (miss_streak_ < kChurn) return miss;
  miss.churn = true;
  for (size_t i = 0; i < now.size(); ++i) {
    // The first call of the streak has nothing before it to differ from.
    if (changed_in_streak_[i] >= kChurn - 1) miss.churning.push_back(static_cast<int>(i));
  }
  return miss;
}

Entry* KeyCache::Insert(guards::GuardKey key, std::unique_ptr<Entry> entry,
                        std::vector<std::unique_ptr<Entry>>* evicted) {
  Entry* e = entry.get();
  e->key = key;
  e->last_used = ++tick_;
  entries_.emplace(key, std::move(entry));
  last_key_ = std::move(key);
  last_ = e;
  while (static_cast<int>(entries_.size()) > limit_) {
    auto victim = entries_.end();
    for (auto it = entries_.begin(); it != entries_.end(); ++it) {
      if (it->second.get() == e) continue;
      if (victim == entries_.end() || it->second->last_used < victim->second->last_used) victim = it;
    }
    admitted -= victim->second->admitted;
    evicted->push_back(std::move(victim->second));
    entries_.erase(victim);
  }
  size_.store(static_cast<int64_t>(entries_.size()), std::memory_order_relaxed);
  return e;
}

int64_t KeyCache::LargestArenaNeed() const {
  int64_t need = 0;
  for (const auto& [key, entry] : entries_) {
    if (entry->graph != nullptr) need = std::max(need, entry->graph->info().arena_bytes);
  }
  return need;
}

}  // namespace torchreplay::replay
