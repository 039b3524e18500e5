// The arena planner (no two buffers alive at the same time overlap; reuse makes the arena smaller
// than the sum) and the arena's buffers (storages of their own that follow it and cannot grow).
#include <ATen/ops/empty.h>
#include <gtest/gtest.h>

#include <random>

#include "memory_pool/arena.h"

namespace torchreplay {
namespace {

TEST(ArenaPlanTest, BuffersAliveTogetherNeverOverlap) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<memory_pool::BufferRequest> req;
    const int n = 1 + rng() % 30;
    for (int i = 0; i < n; ++i) {
      int a = rng() % 40, b = rng() % 40;
      req.push_back({static_cast<int64_t>(rng() % 5000), std::min(a, b), std::max(a, b)});
    }
    auto plan = memory_pool::PlanArena(req);
    for (int i = 0; i < n; ++i) {
      EXPECT_EQ(plan.offsets[i] % memory_pool::kArenaAlignment, 0);
      EXPECT_LE(plan.offsets[i] + req[i].nbytes, plan.arena_bytes);
      for (int j = i + 1; j < n; ++j) {
        const bool live = req[i].first_use <= req[j].last_use && req[j].first_use <= req[i].last_use;
        const bool overlap = plan.offsets[i] < plan.offsets[j] + req[j].nbytes &&
                             plan.offsets[j] < plan.offsets[i] + req[i].nbytes;
        EXPECT_FALSE(live && overlap && req[i].nbytes > 0 && req[j].nbytes > 0)
            << "trial " << trial << ": buffers " << i << " and " << j;
      }
    }
  }
}

TEST(ArenaPlanTest, ChainReusesMemory) {
  // A chain: each buffer is read only by the next step, so two slots suffice.
  std::vector<memory_pool::BufferRequest> req;
  for (int i = 0; i < 10; ++i) req.push_back({1024, i, i + 1});
  auto plan = memory_pool::PlanArena(req);
  EXPECT_EQ(plan.tensor_bytes, 10 * 1024);
  EXPECT_EQ(plan.arena_bytes, 2 * 1024);
}

TEST(ArenaTest, GrowingKeepsViewsOnTheSameStorage) {
  memory_pool::Arena arena;
  arena.Reserve(256);
  const c10::StorageImpl* impl = arena.storage().unsafeGetStorageImpl();
  arena.Reserve(4096);
  EXPECT_EQ(arena.storage().unsafeGetStorageImpl(), impl);
  EXPECT_EQ(arena.bytes(), 4096);
  EXPECT_TRUE(arena.Overlaps(static_cast<const char*>(arena.storage().data()) + 100, 8));
  int outside = 0;
  EXPECT_FALSE(arena.Overlaps(&outside, sizeof(outside)));
}

TEST(ArenaTest, EachBufferIsAStorageOfItsOwnThatFollowsTheArenaAndCannotGrow) {
  memory_pool::Arena arena;
  arena.Reserve(256);
  c10::Storage a = arena.Buffer(0, 64);
  c10::Storage b = arena.Buffer(64, 128);
  EXPECT_FALSE(a.is_alias_of(b));
  EXPECT_FALSE(a.resizable());
  EXPECT_EQ(b.nbytes(), 128u);
  EXPECT_EQ(static_cast<const char*>(b.data()), static_cast<const char*>(arena.storage().data()) + 64);
  {
    c10::Storage dropped = arena.Buffer(128, 64);  // gone before the arena moves
  }
  arena.Reserve(1 << 20);  // a new block: both buffers repointed into it
  EXPECT_EQ(static_cast<const char*>(a.data()), static_cast<const char*>(arena.storage().data()));
  EXPECT_EQ(static_cast<const char*>(b.data()), static_cast<const char*>(arena.storage().data()) + 64);
  // A resize beyond a buffer raises instead of writing over its neighbour.
  at::Tensor t = at::empty({0}, at::kFloat).set_(a, 0, {16}, {1});
  EXPECT_THROW(t.resize_({17}), c10::Error);
  EXPECT_THROW(arena.Buffer(200 << 20, 8), c10::Error);
}
}  // namespace
}  // namespace torchreplay
