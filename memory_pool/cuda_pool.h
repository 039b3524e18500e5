// memory_pool/cuda_pool.h: the CUDA side of an engine's memory: one private pool of the caching
// allocator per device shared by all the keys captured on a thread, the static placeholders
// captured graphs read their inputs from, the bytes captures added, and what every capture in the
// process shares: one capture stream per device and thread, and one capture at a time.
//
// Every CUDA graph of one engine and thread allocates from the same private pool (the caching
// allocator's MempoolId), on the same capture stream, so keys captured one after the other reuse
// each other's freed blocks (the caching allocator reuses a free block only on the stream that
// allocated it): N keys cost about the largest key's bytes when the largest is captured first
// (precapture orders them so). Compiled without CUDA, nothing here is ever used but the byte
// count. Untested on a GPU so far.
//
// Note [The pool outlives its graphs]
// The caching allocator frees a private pool once no graph holds it, and a later capture into
// that id then fails an internal assert (`use_count > 0`). A pool must therefore live as long as
// the engine's thread state, not as long as its last captured key (a static input moved, an
// eviction, a failed first capture would each end it). As PyTorch's CUDA graph trees do ("Keeps
// Memory Pool Alive", torch/_inductor/cudagraph_trees.py, CUDAGraphTreeManager.__init__), the
// pool's first use captures an empty graph into it on the capture stream, held by the CudaPool;
// the pool goes when the CudaPool goes, after every graph captured into it (ThreadState declares
// the pool before the key cache, so the cache is destroyed first).
//
// Note [One capture at a time]
// "Only one capture may be underway at a time in the process" (torch/cuda/graphs.py): capture
// mode is process-wide state of the default CUDA generator and of the caching allocator's
// pools. Every capture and abort holds CaptureMutex(). Destroying a graph does not: it may happen
// with the GIL held (Python drops an engine) while another thread's capture runs a Python op that
// waits for the GIL, or on the capturing thread itself (garbage collected during the capture);
// CUDAGraph::reset destroys under a relaxed capture mode, and the allocator's pool release takes
// the allocator's own lock.
//
// Note [Replays ordered across streams]
// All keys of a thread replay into one pool, on the caller's current stream. When that stream
// changes between calls, the new stream first waits for everything queued so far on the previous
// one (its replays, the copies out of the pool, the caller's reads of the outputs): an event
// recorded on the previous stream at the switch (OrderStreams, before the engine touches the pool).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Stream.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <utility>

namespace torchreplay::memory_pool {

// Held around every capture and every destruction of a captured graph (Note [One capture at a
// time]).
std::mutex& CaptureMutex();

// A new stream of torchreplay's own on `device` (not from PyTorch's stream pool, which a user's
// streams share), kept for the process, with cuBLAS and cuBLASLt set up on it so that their
// per-stream workspaces are allocated before, not inside, a capture (as cudagraph trees warm up on
// their stream first). Capture streams and multi-stream scopes' side streams are made so.
c10::Stream OwnStream(c10::DeviceIndex device);

// This thread's capture stream for `device`: an OwnStream, the same on every call from this thread.
c10::Stream CaptureStream(c10::DeviceIndex device);

class CudaPool {
 public:
  CudaPool();
  ~CudaPool();
  CudaPool(const CudaPool&) = delete;
  CudaPool& operator=(const CudaPool&) = delete;

  // The pool's id on `device` (at::cuda::MempoolId_t), made on first use and kept alive by an
  // empty graph (Note [The pool outlives its graphs]). Call with CaptureMutex() held.
  std::pair<uint64_t, uint64_t> id(c10::DeviceIndex device);

  // A static tensor with the geometry of `like` (sizes, strides, storage offset; storage only
  // as long as the view reaches) and its values: where a captured graph reads a non-static
  // input from, the call's input being copied in before each replay.
  static at::Tensor Placeholder(const at::Tensor& like);

  // The part of `t` holding distinct elements: every expanded dimension (stride 0, size > 1)
  // narrowed to its first index. Copying into a placeholder copies this slice, since a copy into
  // a tensor whose elements overlap is refused (cudagraph_trees' index_expanded_dims).
  static at::Tensor DistinctElements(const at::Tensor& t);
  static bool Expanded(const at::Tensor& t);

  // Note [Replays ordered across streams]: called before the engine touches the pool on `device`.
  void OrderStreams(c10::DeviceIndex device);

  // Bytes captures added to the caching allocator's reserve on this pool's behalf.
  void AddCapturedBytes(int64_t nbytes) { bytes_ += nbytes > 0 ? nbytes : 0; }
  int64_t bytes() const { return bytes_; }

 private:
  struct KeepAlive;  // the pool's id and the empty graph holding it, per device
  std::map<c10::DeviceIndex, std::unique_ptr<KeepAlive>> pools_;
  std::map<c10::DeviceIndex, c10::Stream> last_stream_;  // the stream of the latest replay, per device
  int64_t bytes_ = 0;
};

// Bytes the caching allocator holds on `device` (0 for other devices, or without CUDA).
int64_t CudaReservedBytes(c10::Device device);

}  // namespace torchreplay::memory_pool
