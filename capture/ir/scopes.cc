// The torchreplay::scope_* ops and ScopeRun (see scopes.h).
#include "capture/ir/scopes.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/TensorImpl.h>
#include <torch/library.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "memory_pool/cuda_pool.h"

#ifdef TORCHREPLAY_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace torchreplay::capture {

#ifdef TORCHREPLAY_WITH_CUDA
struct ScopeRun::State {
  c10::Device device;
  c10::cuda::CUDAStream origin;
  absl::flat_hash_map<std::string, c10::cuda::CUDAStream> side;  // by stream name
  std::vector<c10::cuda::CUDAStream> stack;                      // streams to return to
  absl::flat_hash_map<const c10::TensorImpl*, std::shared_ptr<at::cuda::CUDAEvent>> events;
};
#else
struct ScopeRun::State {
  c10::Device device;
};
#endif

namespace {

thread_local ScopeRun::State* g_run = nullptr;  // the innermost open ScopeRun on this thread

#ifdef TORCHREPLAY_WITH_CUDA
// The side stream named `name` on `device` for this thread: the same stream on every run, so that
// blocks freed on it are reused by the next run (and the next key's capture) rather than never
// (the caching allocator reuses a block only on its stream).
c10::cuda::CUDAStream SideStream(c10::DeviceIndex device, const std::string& name) {
  thread_local std::map<std::pair<c10::DeviceIndex, std::string>, c10::cuda::CUDAStream> streams;
  auto it = streams.find({device, name});
  if (it == streams.end()) {
    const c10::cuda::CUDAStream stream(c10::cuda::CUDAStream::UNCHECKED, memory_pool::OwnStream(device));
    it = streams.emplace(std::make_pair(device, name), stream).first;
  }
  return it->second;
}

// `to` waits for the work queued so far on `from` (an edge of the graph during capture).
void Join(c10::cuda::CUDAStream from, c10::cuda::CUDAStream to) {
  if (from == to) return;
  at::cuda::CUDAEvent event;
  event.record(from);
  event.block(to);
}
#endif

void ScopeEnter(std::vector<std::string> labels, std::vector<std::string> stream_names) {
  TORCH_CHECK(!stream_names.empty(), "torchreplay::scope_enter: stream_names is empty");
  (void)labels;
#ifdef TORCHREPLAY_WITH_CUDA
  ScopeRun::State* s = g_run;
  if (s == nullptr) return;  // CPU: program order already holds
  const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(s->device.index());
  auto it = s->side.find(stream_names[0]);
  if (it == s->side.end()) {
    it = s->side.emplace(stream_names[0], SideStream(s->device.index(), stream_names[0])).first;
  }
  Join(current, it->second);  // the fork
  s->stack.push_back(current);
  c10::cuda::setCurrentCUDAStream(it->second);
#endif
}

void ScopeExit() {
#ifdef TORCHREPLAY_WITH_CUDA
  ScopeRun::State* s = g_run;
  if (s == nullptr) return;
  TORCH_CHECK(!s->stack.empty(), "torchreplay::scope_exit without a matching scope_enter");
  c10::cuda::setCurrentCUDAStream(s->stack.back());
  s->stack.pop_back();
#endif
}

at::Tensor Record() {
#ifdef TORCHREPLAY_WITH_CUDA
  // The token lives on the run's device: a CUDA graph holds no CPU tensor (its capture refuses one).
  at::Tensor token = at::empty({0}, g_run != nullptr ? at::TensorOptions().device(g_run->device) : at::TensorOptions());
  if (ScopeRun::State* s = g_run) {
    auto event = std::make_shared<at::cuda::CUDAEvent>();
    event->record(c10::cuda::getCurrentCUDAStream(s->device.index()));
    s->events[token.unsafeGetTensorImpl()] = std::move(event);
  }
#else
  at::Tensor token = at::empty({0});
#endif
  return token;
}

void Wait(std::vector<at::Tensor> records) {
#ifdef TORCHREPLAY_WITH_CUDA
  ScopeRun::State* s = g_run;
  if (s == nullptr) return;
  const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(s->device.index());
  for (const at::Tensor& r : records) {
    auto it = s->events.find(r.unsafeGetTensorImpl());
    TORCH_CHECK(it != s->events.end(),
                "torchreplay::wait: the token was not made by torchreplay::record in this run");
    it->second->block(current);
  }
#else
  (void)records;
#endif
}

}  // namespace

ScopeRun::ScopeRun(c10::Device device) : previous_(g_run) {
#ifdef TORCHREPLAY_WITH_CUDA
  if (device.is_cuda()) {
    state_.reset(new State{device, c10::cuda::getCurrentCUDAStream(device.index()), {}, {}, {}});
    g_run = state_.get();
  }
#else
  (void)device;
#endif
}

ScopeRun::~ScopeRun() {
#ifdef TORCHREPLAY_WITH_CUDA
  if (state_ != nullptr) {
    // Back on the origin stream, after everything the side streams were given.
    g_run = previous_;
    try {
      c10::cuda::setCurrentCUDAStream(state_->origin);
      for (const auto& [name, stream] : state_->side) Join(stream, state_->origin);
    } catch (const c10::Error& e) {
      // A failed capture has already invalidated the streams; the capture reports that error.
    }
  }
#endif
}

bool BuiltWithCuda() {
#ifdef TORCHREPLAY_WITH_CUDA
  return true;
#else
  return false;
#endif
}

// One kernel for every dispatch key: the ops take no tensor that names a device (declared in
// capture/kernels/ops.cc).
TORCH_LIBRARY_IMPL(torchreplay, CatchAll, m) {
  m.impl("scope_enter", &ScopeEnter);
  m.impl("scope_exit", &ScopeExit);
  m.impl("record", &Record);
  m.impl("wait", &Wait);
}

}  // namespace torchreplay::capture
