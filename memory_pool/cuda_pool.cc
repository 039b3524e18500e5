// The CUDA pool, its placeholders, capture streams and byte accounting (see cuda_pool.h).
#include "memory_pool/cuda_pool.h"

#include <ATen/EmptyTensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>

#include "memory_pool/ordinary_tensors.h"

#ifdef TORCHREPLAY_WITH_CUDA
#include <ATen/cuda/CUDAContextLight.h>
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace torchreplay::memory_pool {

std::mutex& CaptureMutex() {
  static std::mutex* mu = new std::mutex();  // never destroyed: graphs may outlive statics
  return *mu;
}

#ifdef TORCHREPLAY_WITH_CUDA

c10::Stream OwnStream(c10::DeviceIndex device) {
  // Not from PyTorch's round-robin pool, which a user's torch.cuda.Stream() may share: work
  // another thread queued there would join a thread-local capture.
  c10::cuda::CUDAGuard device_guard(device);
  cudaStream_t raw = nullptr;
  C10_CUDA_CHECK(cudaStreamCreateWithFlags(&raw, cudaStreamNonBlocking));  // kept for the process
  const c10::cuda::CUDAStream stream = c10::cuda::getStreamFromExternal(raw, device);
  c10::cuda::CUDAStreamGuard stream_guard(stream);
  // cuBLAS(Lt) allocate a workspace per (handle, stream) at first use on a stream: made here,
  // outside any capture, instead of inside the first capture into its private pool.
  (void)at::cuda::getCurrentCUDABlasHandle();
  (void)at::cuda::getCurrentCUDABlasLtHandle();
  (void)at::cuda::getCUDABlasLtWorkspace();
  return stream.unwrap();
}

c10::Stream CaptureStream(c10::DeviceIndex device) {
  // cudagraph_trees keeps one stream per tree manager (one per device and thread): the caching
  // allocator reuses a freed block only on its stream, so every key must capture on the same one.
  thread_local std::map<c10::DeviceIndex, c10::Stream> streams;
  auto it = streams.find(device);
  if (it == streams.end()) it = streams.emplace(device, OwnStream(device)).first;
  return it->second;
}

struct CudaPool::KeepAlive {
  at::cuda::MempoolId_t id;
  at::cuda::CUDAGraph graph;  // empty, captured into the pool: holds it (Note [The pool outlives its graphs])
};

CudaPool::CudaPool() = default;

CudaPool::~CudaPool() = default;  // Note [One capture at a time]: no lock to destroy

void CudaPool::OrderStreams(c10::DeviceIndex device) {
  const c10::cuda::CUDAStream now = c10::cuda::getCurrentCUDAStream(device);
  auto it = last_stream_.find(device);
  if (it == last_stream_.end()) {
    last_stream_.emplace(device, now.unwrap());
    return;
  }
  if (it->second == now.unwrap()) return;
  at::cuda::CUDAEvent switched;
  switched.record(c10::cuda::CUDAStream(c10::cuda::CUDAStream::UNCHECKED, it->second));
  switched.block(now);
  it->second = now.unwrap();
}

std::pair<uint64_t, uint64_t> CudaPool::id(c10::DeviceIndex device) {
  auto it = pools_.find(device);
  if (it == pools_.end()) {
    auto keep = std::make_unique<KeepAlive>();
    keep->id = at::cuda::graph_pool_handle();
    c10::cuda::CUDAGuard device_guard(device);
    c10::cuda::CUDAStreamGuard stream_guard(c10::cuda::CUDAStream(c10::cuda::CUDAStream::UNCHECKED,
                                                                  CaptureStream(device)));
    struct Quiet : c10::WarningHandler {
      void process(const c10::Warning&) override {}
    } quiet;  // capture_end warns that the graph is empty, as it is meant to be
    c10::WarningUtils::WarningHandlerGuard warnings(&quiet);
    keep->graph.capture_begin(keep->id, cudaStreamCaptureModeThreadLocal);
    keep->graph.capture_end();
    it = pools_.emplace(device, std::move(keep)).first;
  }
  return {it->second->id.first, it->second->id.second};
}

#else

c10::Stream OwnStream(c10::DeviceIndex device) {
  (void)device;
  TORCH_CHECK(false, "torchreplay was built without CUDA");
}

c10::Stream CaptureStream(c10::DeviceIndex device) { return OwnStream(device); }

struct CudaPool::KeepAlive {};
CudaPool::CudaPool() = default;
CudaPool::~CudaPool() = default;
void CudaPool::OrderStreams(c10::DeviceIndex device) { (void)device; }

std::pair<uint64_t, uint64_t> CudaPool::id(c10::DeviceIndex device) {
  (void)device;
  return {0, 0};
}

#endif

at::Tensor CudaPool::Placeholder(const at::Tensor& like) {
  // Elements up to the last one the view reaches (not the caller's whole storage).
  const int64_t itemsize = std::max<int64_t>(1, like.element_size());
  const int64_t span = like.storage_offset() +
      static_cast<int64_t>(at::detail::computeStorageNbytes(like.sizes(), like.strides(), itemsize)) /
          itemsize;
  const OrdinaryTensors ordinary;  // Note [A pool of ordinary tensors]
  at::Tensor base = at::empty({std::max<int64_t>(span, 1)}, like.options());
  at::Tensor placeholder = base.as_strided(like.sizes(), like.strides(), like.storage_offset());
  DistinctElements(placeholder).copy_(DistinctElements(like));
  return placeholder;
}

bool CudaPool::Expanded(const at::Tensor& t) {
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.stride(d) == 0 && t.size(d) > 1) return true;
  }
  return false;
}

at::Tensor CudaPool::DistinctElements(const at::Tensor& t) {
  at::Tensor out = t;
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.stride(d) == 0 && t.size(d) > 1) out = out.narrow(d, 0, 1);
  }
  return out;
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
