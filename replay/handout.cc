// The hand-out of pool outputs (Note [Handed-out outputs] in handout.h).
#include "replay/handout.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/TensorImpl.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <algorithm>
#include <cstring>
#include <exception>

#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"

namespace torchreplay::replay {
namespace {

at::Tensor BytesOf(const c10::StorageImpl& s) {
  return at::from_blob(const_cast<void*>(s.data()), {static_cast<int64_t>(s.nbytes())},
                       at::TensorOptions().dtype(at::kByte).device(s.device()));
}

// Moves a handed-out storage to memory of its own, keeping its bytes (all its views follow).
// This runs wherever the pool is next reused or freed: also when the cyclic garbage collector
// drops an engine in the middle of a trace, with a Python dispatch mode (FakeTensorMode) on the
// thread. So the CPU copy is a memcpy into the CPU allocator's memory, and the CUDA copy runs with
// the Python dispatch keys excluded.
void CopyOut(c10::StorageImpl& s) {
  const size_t n = s.nbytes();
  if (s.device().is_cpu()) {
    c10::DataPtr fresh = c10::GetCPUAllocator()->allocate(n);
    if (n != 0) std::memcpy(fresh.get(), s.data(), n);
    s.set_data_ptr_noswap(std::move(fresh));
    return;
  }
  c10::impl::ExcludeDispatchKeyGuard no_python(
      c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot}));
  at::Tensor fresh = at::empty({static_cast<int64_t>(n)}, at::TensorOptions().dtype(at::kByte).device(s.device()));
  fresh.copy_(BytesOf(s));
  s.set_data_ptr_noswap(fresh.storage().unsafeGetStorageImpl()->set_data_ptr(c10::DataPtr()));
}

// The deleter of the storages a Handout makes: it marks them (InAPool). With no context it is
// never called (they own nothing).
void PoolMemory(void*) {}

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

void Handout::HandOut(const capture::CapturedGraph& graph, bool clone,
                      std::vector<c10::IValue>& outs) {
  // `made` holds this call's storages, one per pool buffer, for the outputs that share it, with
  // the first tensor handed out over it, whose version counter they share (if of the same pool
  // StorageImpl: two empty buffers may start at one address). `given`: each pool tensor handed out
  // (alive while a later output still holds it: compared by address only) and its output.
  struct Made {
    const char* base;
    const c10::StorageImpl* pool;
    c10::intrusive_ptr<c10::StorageImpl> storage;
    c10::TensorImpl* first;
  };
  absl::InlinedVector<Made, 4> made;
  absl::InlinedVector<std::pair<const c10::TensorImpl*, size_t>, 8> given;
  for (size_t i = 0; i < outs.size(); ++i) {
    if (!graph.OutputInPool(i) || !outs[i].isTensor() || !outs[i].toTensor().defined()) continue;
    const at::Tensor& t = outs[i].toTensor();
    const c10::StorageImpl* pool = t.storage().unsafeGetStorageImpl();
    const char* base = static_cast<const char*>(pool->data());
    // An empty buffer holds no bytes, so the planner may place it at any offset, a live buffer's
    // included: it shares a storage only with outputs of its own pool StorageImpl, and no other
    // output shares its empty storage (a 0-dim output over it read past its end).
    auto same = std::find_if(made.begin(), made.end(), [&](const Made& m) {
      return m.base == base && (m.pool == pool || (m.storage->nbytes() > 0 && pool->nbytes() > 0));
    });
    if (same != made.end()) {
      // The same value returned twice (an output the backward also saves): the same tensor.
      auto again = std::find_if(given.begin(), given.end(),
                                [&](const auto& g) { return g.first == t.unsafeGetTensorImpl(); });
      if (again != given.end()) {
        outs[i] = outs[again->second];
        continue;
      }
    } else {
      auto storage = c10::make_intrusive<c10::StorageImpl>(
          c10::StorageImpl::use_byte_size_t(), pool->nbytes(),
          c10::DataPtr(const_cast<char*>(base), /*ctx=*/nullptr, &PoolMemory, t.device()), nullptr,
          /*resizable=*/false);
      if (clone) {
        CopyOut(*storage);
      } else {
        handed_out_.emplace_back(storage);
        size_.store(static_cast<int64_t>(handed_out_.size()), std::memory_order_relaxed);
      }
      made.push_back(Made{base, pool, std::move(storage), nullptr});
      same = made.end() - 1;
    }
    auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(same->storage), t.key_set(), t.dtype());
    impl->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
    if (same->first == nullptr) {
      same->first = impl.get();
    } else if (same->pool == pool) {  // views of one buffer: one version counter, as eager's views
      impl->set_version_counter(same->first->version_counter());
    }
    given.emplace_back(t.unsafeGetTensorImpl(), i);
    outs[i] = at::Tensor(std::move(impl));
  }
}

void Handout::ReleaseAll(const std::vector<c10::IValue>* inputs) {
  for (auto& weak : handed_out_) {
    auto strong = weak.lock();
    if (!strong) continue;
    if (inputs != nullptr && !preserve_ && !ReadBy(*inputs, strong.get())) {
      strong->release_data_and_set_meta_custom_data_ptr_error_msg_(invalidated_message_);
      continue;
    }
    try {
      CopyOut(*strong);
      counts_->storages.fetch_add(1, std::memory_order_relaxed);
      counts_->bytes.fetch_add(static_cast<int64_t>(strong->nbytes()), std::memory_order_relaxed);
    } catch (const std::exception& e) {  // out of memory: then the output cannot stay readable
      strong->release_data_and_set_meta_custom_data_ptr_error_msg_(
          absl::StrCat(invalidated_message_, " (It could not be copied out of the pool: ", e.what(), ")"));
    }
  }
  handed_out_.clear();
  size_.store(0, std::memory_order_relaxed);
}

bool InAPool(const c10::IValue& v) {
  if (!v.isTensor()) return false;
  const at::Tensor& t = v.toTensor();
  // Without checks: an invalidated storage (its data released, its DataPtr still ours) would throw.
  return t.defined() && t.has_storage() &&
         t.storage().unsafeGetStorageImpl()->_mutable_data_ptr_no_checks().get_deleter() == &PoolMemory;
}

void CopyInputsOutOf(const memory_pool::Arena& arena, std::vector<c10::IValue>& inputs) {
  for (auto& v : inputs) {
    if (!v.isTensor()) continue;
    const at::Tensor& t = v.toTensor();
    if (t.defined() && t.has_storage() &&
        arena.Overlaps(t.storage().data(), static_cast<int64_t>(t.storage().nbytes()))) {
      at::Tensor bytes = BytesOf(*t.storage().unsafeGetStorageImpl()).clone();
      v = at::empty({0}, t.options()).set_(bytes.storage(), t.storage_offset(), t.sizes(), t.strides());
    }
  }
}

}  // namespace torchreplay::replay
