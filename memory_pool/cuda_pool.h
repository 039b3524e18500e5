// memory_pool/cuda_pool.h: the CUDA side of an engine's memory: one private pool of the caching
// allocator shared by all the keys captured on a thread, the static placeholders captured graphs
// read their inputs from, and the bytes captures added.
//
// Every CUDA graph of one engine and thread allocates from the same private pool (the caching
// allocator's MempoolId), so keys captured one after the other reuse each other's freed blocks:
// N keys cost about the largest key's bytes when the largest is captured first (precapture
// orders them so). Compiled without CUDA, nothing here is ever used but the byte count.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <utility>

namespace torchreplay::memory_pool {

class CudaPool {
 public:
  // The pool's id (at::cuda::MempoolId_t), made on first use.
  std::pair<uint64_t, uint64_t> id();

  // A static tensor with the geometry of `like` (sizes, strides, storage offset; storage only
  // as long as the view reaches) and its values: where a captured graph reads a non-static
  // input from, the call's input being copied in before each replay.
  static at::Tensor Placeholder(const at::Tensor& like);

  // Bytes captures added to the caching allocator's reserve on this pool's behalf.
  void AddCapturedBytes(int64_t nbytes) { bytes_ += nbytes > 0 ? nbytes : 0; }
  int64_t bytes() const { return bytes_; }

 private:
  std::pair<uint64_t, uint64_t> id_{0, 0};
  int64_t bytes_ = 0;
};

// Bytes the caching allocator holds on `device` (0 for other devices, or without CUDA).
int64_t CudaReservedBytes(c10::Device device);

}  // namespace torchreplay::memory_pool
