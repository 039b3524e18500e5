// memory_pool/arena.h: the liveness-planned arena for a captured graph's intermediates and
// outputs (CPU), and the growable storage all keys of one engine share.
//
// PlanArena places buffers with known lifetimes at offsets in one block: greedy by size, largest
// first, each at the lowest aligned offset that overlaps no already-placed buffer alive at the
// same time (the approach of Static Runtime's planner and TFLite's arena planner).
//
// An Arena is one block of memory that every planned buffer of every key lives in, so when a new
// key needs more bytes the arena swaps in a larger block and repoints every buffer: N keys cost
// the largest key's bytes, not the sum.
//
// Note [One storage per buffer]
// In eager every op result has a storage of its own, and kernels rely on it: is_alias_of (the
// same storage) decides paths (linalg_qr.out writes Q from its R argument when R aliases its
// workspace), and a resize beyond a storage's bytes reallocates it. Were all buffers views of one
// storage, a kernel would see its output alias its inputs and its other outputs, and a resize
// beyond one buffer would write over its neighbours. So each buffer is a StorageImpl of its own
// over its bytes of the arena (Arena::Buffer): not resizable (a resize beyond it raises), owned
// by the tensors that view it, and repointed by the arena when its block moves.
#pragma once

#include <c10/core/Storage.h>
#include <c10/util/intrusive_ptr.h>

#include <cstdint>
#include <vector>

namespace torchreplay::memory_pool {

struct BufferRequest {
  int64_t nbytes = 0;
  int first_use = 0;  // index of the step that writes it first
  int last_use = 0;   // index of the last step that reads it (inclusive)
};

struct ArenaPlan {
  std::vector<int64_t> offsets;  // per request, in bytes
  int64_t arena_bytes = 0;       // bytes the plan needs
  int64_t tensor_bytes = 0;      // sum of the requests' sizes (what one buffer each would cost)
};

constexpr int64_t kArenaAlignment = 64;

ArenaPlan PlanArena(const std::vector<BufferRequest>& requests,
                    int64_t alignment = kArenaAlignment);

class Arena {
 public:
  explicit Arena(c10::Device device = c10::Device(c10::DeviceType::CPU));

  // Makes the arena at least `nbytes` large. Existing views stay valid (their contents do not:
  // callers only grow between runs, when nothing in the arena is live).
  void Reserve(int64_t nbytes);
  // Makes the arena `nbytes` large if it is larger, freeing the rest. Views beyond `nbytes` must
  // be gone, and nothing in the arena may be live (callers shrink between runs).
  void Shrink(int64_t nbytes);

  // A storage of its own for the arena's bytes [offset, offset + nbytes) (Note [One storage per
  // buffer]): not resizable, kept alive by its tensors, repointed whenever the arena's block moves.
  // The range must lie within bytes().
  c10::Storage Buffer(int64_t offset, int64_t nbytes);

  const c10::Storage& storage() const { return storage_; }
  int64_t bytes() const { return static_cast<int64_t>(storage_.nbytes()); }
  // True if [p, p + n) overlaps the arena's current block.
  bool Overlaps(const void* p, int64_t n) const;

 private:
  struct Piece {
    c10::weak_intrusive_ptr<c10::StorageImpl> storage;
    int64_t offset;
  };
  void Resize(int64_t nbytes);
  c10::Storage storage_;
  std::vector<Piece> buffers_;  // every Buffer() handed out, to repoint when the block moves
};

// Test-only: the next `n` arena growths fail as the allocator would when out of memory (they
// throw c10::OutOfMemoryError), so that tests can fail a capture half-way. n = 0 turns it off.
// Python: torchreplay._C._testing_fail_allocations(n). Never set outside tests.
void FailAllocationsForTesting(int n);

}  // namespace torchreplay::memory_pool
