#include "memory_pool/arena.h"

#include <c10/core/CPUAllocator.h>
#include <c10/core/StorageImpl.h>

#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <numeric>

namespace torchreplay::memory_pool {

namespace {
std::atomic<int> g_fail_allocations{0};  // FailAllocationsForTesting
}  // namespace

void FailAllocationsForTesting(int n) { g_fail_allocations = std::max(n, 0); }

ArenaPlan PlanArena(const std::vector<BufferRequest>& requests, int64_t alignment) {
  ArenaPlan plan;
  const size_t n = requests.size();
  plan.offsets.assign(n, 0);
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  // Largest first; ties by earlier first use, so the result is deterministic.
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    if (requests[a].nbytes != requests[b].nbytes) return requests[a].nbytes > requests[b].nbytes;
    return requests[a].first_use < requests[b].first_use;
  });
  auto align = [&](int64_t x) { return (x + alignment - 1) / alignment * alignment; };
  std::vector<size_t> placed;  // kept sorted by offset
  for (size_t idx : order) {
    const BufferRequest& r = requests[idx];
    plan.tensor_bytes += r.nbytes;
    int64_t offset = 0;
    for (size_t p : placed) {
      const BufferRequest& q = requests[p];
      const bool live_together = r.first_use <= q.last_use && q.first_use <= r.last_use;
      if (!live_together) continue;
      const int64_t q_begin = plan.offsets[p];
      const int64_t q_end = q_begin + q.nbytes;
      if (offset + r.nbytes <= q_begin) break;  // fits in the gap before q
      offset = std::max(offset, align(q_end));
    }
    plan.offsets[idx] = offset;
    plan.arena_bytes = std::max(plan.arena_bytes, offset + r.nbytes);
    placed.insert(std::upper_bound(placed.begin(), placed.end(), idx,
                                   [&](size_t a, size_t b) { return plan.offsets[a] < plan.offsets[b]; }),
                  idx);
  }
  plan.arena_bytes = align(plan.arena_bytes);
  return plan;
}

Arena::Arena(c10::Device device) {
  c10::Allocator* alloc = c10::GetAllocator(device.type());
  storage_ = c10::Storage(c10::make_intrusive<c10::StorageImpl>(
      c10::StorageImpl::use_byte_size_t(), 0, alloc->allocate(0), alloc, /*resizable=*/false));
}

void Arena::Reserve(int64_t nbytes) {
  if (nbytes <= bytes()) return;
  if (g_fail_allocations.load(std::memory_order_relaxed) > 0 && g_fail_allocations.fetch_sub(1) > 0) {
    TORCH_CHECK_WITH(OutOfMemoryError, false, "torchreplay: allocation of ", nbytes,
                     " bytes failed (simulated by _testing_fail_allocations)");
  }
  Resize(nbytes);
}

void Arena::Shrink(int64_t nbytes) {
  if (nbytes < bytes()) Resize(nbytes);
}

c10::Storage Arena::Buffer(int64_t offset, int64_t nbytes) {
  TORCH_CHECK(offset >= 0 && nbytes >= 0 && offset + nbytes <= bytes(), "torchreplay: buffer [",
              offset, ", ", offset + nbytes, ") outside an arena of ", bytes(), " bytes");
  buffers_.erase(std::remove_if(buffers_.begin(), buffers_.end(),
                                [](const Piece& p) { return p.storage.expired(); }),
                 buffers_.end());
  auto impl = c10::make_intrusive<c10::StorageImpl>(
      c10::StorageImpl::use_byte_size_t(), nbytes,
      c10::DataPtr(static_cast<char*>(storage_.mutable_data()) + offset, storage_.device()),
      /*allocator=*/nullptr, /*resizable=*/false);
  buffers_.push_back(Piece{c10::weak_intrusive_ptr<c10::StorageImpl>(impl), offset});
  return c10::Storage(std::move(impl));
}

void Arena::Resize(int64_t nbytes) {  // a new block under the same StorageImpl; buffers repointed
  c10::StorageImpl* impl = storage_.unsafeGetStorageImpl();
  impl->set_data_ptr_noswap(impl->allocator()->allocate(nbytes));
  impl->set_nbytes(nbytes);
  char* base = static_cast<char*>(impl->mutable_data());
  auto gone = [&](const Piece& p) {
    c10::intrusive_ptr<c10::StorageImpl> piece = p.storage.lock();
    if (!piece) return true;
    piece->set_data_ptr_noswap(c10::DataPtr(base + p.offset, impl->device()));
    return false;
  };
  buffers_.erase(std::remove_if(buffers_.begin(), buffers_.end(), gone), buffers_.end());
}

bool Arena::Overlaps(const void* p, int64_t n) const {
  const auto* base = static_cast<const char*>(storage_.data());
  const auto* q = static_cast<const char*>(p);
  return base != nullptr && q < base + bytes() && q + std::max<int64_t>(n, 1) > base;
}

}  // namespace torchreplay::memory_pool
