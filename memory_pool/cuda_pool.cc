// The CUDA pool, its placeholders and byte accounting (see cuda_pool.h).
#include "memory_pool/cuda_pool.h"

#include <ATen/EmptyTensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>

#ifdef TORCHREPLAY_WITH_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace torchreplay::memory_pool {

std::pair<uint64_t, uint64_t> CudaPool::id() {
#ifdef TORCHREPLAY_WITH_CUDA
  if (id_.first == 0 && id_.second == 0) {
    const at::cuda::MempoolId_t made = at::cuda::graph_pool_handle();
    id_ = {made.first, made.second};
  }
#endif
  return id_;
}

at::Tensor CudaPool::Placeholder(const at::Tensor& like) {
  // Elements up to the last one the view reaches (not the caller's whole storage).
  const int64_t itemsize = std::max<int64_t>(1, like.element_size());
  const int64_t span = like.storage_offset() +
      static_cast<int64_t>(at::detail::computeStorageNbytes(like.sizes(), like.strides(), itemsize)) /
          itemsize;
  at::Tensor base = at::empty({std::max<int64_t>(span, 1)}, like.options());
  at::Tensor placeholder = base.as_strided(like.sizes(), like.strides(), like.storage_offset());
  placeholder.copy_(like);
  return placeholder;
}

int64_t CudaReservedBytes(c10::Device device) {
#ifdef TORCHREPLAY_WITH_CUDA
  if (!device.is_cuda()) return 0;
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
  return stats.reserved_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)].current;
#else
  (void)device;
  return 0;
#endif
}

}  // namespace torchreplay::memory_pool
