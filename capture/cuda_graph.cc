// The CUDA backend (see cuda_graph.h).
//
// Note [Why at::cuda::CUDAGraph]
// Capture goes through ATen's CUDAGraph rather than the CUDA runtime directly: it enters the
// caching allocator's private pool before cudaStreamBeginCapture, and registers the CUDA RNG's
// generator state with the graph so random ops (dropout, rand) draw fresh numbers on every replay
// exactly as PyTorch's own graphs do. What it does not do is clean up after a capture that fails
// half-way (an uncapturable op throws while the stream is capturing): that case is handled here,
// in AbortCapture, so the stream leaves capture mode, the pool's use count is given back and the
// RNG state leaves capture mode too.
#include "capture/cuda_graph.h"

#include "absl/strings/str_cat.h"

#ifdef TORCHREPLAY_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <ATen/ops/_foreach_copy.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include "capture/interpreter.h"
#endif

namespace torchreplay::capture {

#ifndef TORCHREPLAY_WITH_CUDA

absl::StatusOr<std::unique_ptr<CapturedGraph>> CaptureCudaGraph(
    std::shared_ptr<const Graph>, const Recording&, const std::vector<c10::IValue>&,
    memory_pool::CudaPool*, const CaptureOptions&) {
  return absl::FailedPreconditionError("torchreplay was built without CUDA");
}

#else

namespace {

using c10::cuda::CUDAStream;

class CudaGraph final : public CapturedGraph {
 public:
  absl::Status Replay(const std::vector<c10::IValue>& inputs,
                      std::vector<c10::IValue>* outputs) override;
  const CaptureInfo& info() const override { return info_; }
  bool OutputInPool(size_t i) const override { return outputs_[i].kind == Out::kPool; }
  absl::StatusOr<std::string> Dump(const std::string& path_stem) const override;

  struct Out {
    enum Kind { kPool, kInputView, kConstant } kind = kConstant;
    c10::IValue value;  // kPool: the captured tensor; kConstant: the value
    int input = -1;     // kInputView: a view of this caller's input
    std::vector<int64_t> sizes, strides;
    int64_t storage_offset = 0;
  };

  CaptureInfo info_;
  c10::Device device_{c10::DeviceType::CUDA, 0};
  std::unique_ptr<at::cuda::CUDAGraph> graph_;
  bool kept_graph_ = false;
  std::vector<std::pair<int, at::Tensor>> placeholders_;  // (input position, static copy)
  std::vector<size_t> copied_back_;                       // placeholders the graph mutates
  std::vector<Out> outputs_;
  // Per-call scratch for the batched copies (no allocation once sized).
  std::vector<at::Tensor> dst_, src_;
};

absl::Status CudaGraph::Replay(const std::vector<c10::IValue>& inputs,
                                     std::vector<c10::IValue>* outputs) {
  try {
    c10::cuda::CUDAGuard guard(device_);
    dst_.clear();
    src_.clear();
    for (const auto& [pos, placeholder] : placeholders_) {
      const at::Tensor& t = inputs[pos].toTensor();
      if (t.data_ptr() == placeholder.data_ptr()) continue;  // already the placeholder
      dst_.push_back(placeholder);
      src_.push_back(t);
    }
    if (!dst_.empty()) at::_foreach_copy_(dst_, src_);
    graph_->replay();
    if (!copied_back_.empty()) {
      dst_.clear();
      src_.clear();
      for (size_t k : copied_back_) {
        const at::Tensor& caller = inputs[placeholders_[k].first].toTensor();
        if (caller.data_ptr() == placeholders_[k].second.data_ptr()) continue;
        dst_.push_back(caller);
        src_.push_back(placeholders_[k].second);
      }
      if (!dst_.empty()) at::_foreach_copy_(dst_, src_);
    }
    outputs->clear();
    for (const Out& o : outputs_) {
      if (o.kind == Out::kInputView) {
        outputs->push_back(inputs[o.input].toTensor().as_strided(o.sizes, o.strides, o.storage_offset));
      } else {
        outputs->push_back(o.value);
      }
    }
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("CUDA graph replay failed: ", e.what_without_backtrace()));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> CudaGraph::Dump(const std::string& path_stem) const {
  if (!kept_graph_) {
    return absl::FailedPreconditionError("the graph was captured without keep_graph");
  }
  const std::string path = path_stem + ".dot";
  const cudaError_t err = cudaGraphDebugDotPrint(graph_->raw_cuda_graph(), path.c_str(),
                                                 cudaGraphDebugDotFlagsVerbose);
  if (err != cudaSuccess) {
    return absl::InternalError(absl::StrCat("cudaGraphDebugDotPrint: ", cudaGetErrorString(err)));
  }
  return path;
}

// A capture failed while `stream` may still be capturing: leave capture mode, stop routing
// allocations to the pool and give back this capture's share of it.
void AbortCapture(CUDAStream stream, c10::DeviceIndex device, at::cuda::MempoolId_t pool) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream.stream(), &status) == cudaSuccess &&
      status != cudaStreamCaptureStatusNone) {
    cudaGraph_t partial = nullptr;
    (void)cudaStreamEndCapture(stream.stream(), &partial);
    if (partial != nullptr) (void)cudaGraphDestroy(partial);
  }
  (void)cudaGetLastError();  // capture errors are not sticky; clear the last-error slot
  try {
    c10::cuda::CUDACachingAllocator::endAllocateToPool(device, pool);
  } catch (const c10::Error&) {
    // capture_end got as far as ending the allocation itself
  }
  try {
    c10::cuda::CUDACachingAllocator::releasePool(device, pool);
  } catch (const c10::Error&) {
  }
  // capture_begin put the registered RNG states (the default generator's always) in capture
  // mode, and only a successful capture_end takes them out of it; left so, every later eager
  // random op would fail. A trivial capture on the same (side) stream runs the pair once more.
  try {
    at::cuda::CUDAGraph reset_rng;
    reset_rng.capture_begin({0, 0}, cudaStreamCaptureModeThreadLocal);
    at::empty({1}, at::TensorOptions().dtype(at::kFloat).device(c10::Device(c10::kCUDA, device))).zero_();
    reset_rng.capture_end();
  } catch (const c10::Error&) {
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<CapturedGraph>> CaptureCudaGraph(
    std::shared_ptr<const Graph> graph, const Recording& rec,
    const std::vector<c10::IValue>& inputs, memory_pool::CudaPool* pool,
    const CaptureOptions& options) {
  const Interpreter interp(graph);
  const Graph& g = *graph;
  if (auto s = CheckReplayable(g, rec); !s.ok()) return s;
  for (size_t i = 0; i < g.inputs().size(); ++i) {
    // A graph declared with CUDA inputs keys every scalar; one that was not may not be captured.
    if (g.is_per_call_scalar(static_cast<int>(i))) {
      return absl::FailedPreconditionError(absl::StrCat(
          "scalar input ", i, " is bound per call, and a CUDA graph bakes scalars in (declare the "
          "graph's tensor inputs as CUDA so that scalars are guarded)"));
    }
  }
  // Work on CPU tensors would run once, at capture, and never again on replay.
  std::optional<c10::Device> device;
  for (size_t v = 0; v < rec.values.size(); ++v) {
    const ValueRecord& r = rec.values[v];
    if (!r.is_tensor || r.dtype == c10::ScalarType::Undefined) continue;
    if (r.device.is_cuda()) {
      if (!device.has_value()) device = r.device;
      continue;
    }
    return absl::FailedPreconditionError(absl::StrCat(
        "value '", g.values()[v].name, "' is a CPU tensor inside a CUDA graph (",
        r.sizes.size(), "-d); CPU work is not captured"));
  }
  if (!device.has_value()) return absl::FailedPreconditionError("the graph has no CUDA tensors");

  auto out = std::make_unique<CudaGraph>();
  out->device_ = *device;
  out->info_.nodes = static_cast<int>(g.nodes().size());
  const std::vector<bool> mutated = MutatedRoots(g, rec);
  try {
    c10::cuda::CUDAGuard device_guard(*device);
    const auto [id_first, id_second] = pool->id();
    const at::cuda::MempoolId_t pool_id{id_first, id_second};

    // Placeholders: same sizes, strides and storage offset as the key's inputs.
    std::vector<c10::IValue> capture_inputs = inputs;
    std::vector<int> placeholder_of(inputs.size(), -1);
    for (size_t i = 0; i < inputs.size(); ++i) {
      if (!inputs[i].isTensor() || rec.baked(g, static_cast<int>(i))) continue;
      at::Tensor placeholder = memory_pool::CudaPool::Placeholder(inputs[i].toTensor());
      placeholder_of[i] = static_cast<int>(out->placeholders_.size());
      out->placeholders_.emplace_back(static_cast<int>(i), placeholder);
      capture_inputs[i] = placeholder;
      if (mutated[g.inputs()[i]]) out->copied_back_.push_back(out->placeholders_.size() - 1);
    }

    const int64_t reserved_before = memory_pool::CudaReservedBytes(*device);
    const CUDAStream caller = c10::cuda::getCurrentCUDAStream(device->index());
    const CUDAStream side = c10::cuda::getStreamFromPool(false, device->index());
    {
      at::cuda::CUDAEvent ready;
      ready.record(caller);
      ready.block(side);
    }
    std::vector<c10::IValue> results;
    {
      c10::cuda::CUDAStreamGuard stream_guard(side);
      out->graph_ = std::make_unique<at::cuda::CUDAGraph>(options.keep_graph);
      out->kept_graph_ = options.keep_graph;
      out->graph_->capture_begin(pool_id, cudaStreamCaptureModeThreadLocal);
      absl::Status run_status;
      try {
        auto run = interp.Run(capture_inputs);  // in a ScopeRun of its device
        if (run.ok()) {
          results = std::move(*run);
        } else {
          run_status = run.status();
        }
        if (run_status.ok()) out->graph_->capture_end();
      } catch (const c10::Error& e) {
        run_status = absl::FailedPreconditionError(
            absl::StrCat("capture failed: ", e.what_without_backtrace()));
      }
      if (!run_status.ok()) {
        results.clear();  // pool blocks go back before the pool's share is released
        AbortCapture(side, device->index(), pool_id);
        out->graph_.reset();
        return absl::FailedPreconditionError(absl::StrCat("CUDA capture: ", run_status.message()));
      }
    }
    {
      at::cuda::CUDAEvent done;
      done.record(side);
      done.block(caller);
    }
    out->info_.arena_bytes = memory_pool::CudaReservedBytes(*device) - reserved_before;
    pool->AddCapturedBytes(out->info_.arena_bytes);

    // Outputs: views of non-static inputs are rebuilt on the caller's tensors every call;
    // anything else captured is either a static tensor (or a view of one) or pool memory.
    for (size_t k = 0; k < g.outputs().size(); ++k) {
      const Arg& a = g.outputs()[k];
      CudaGraph::Out o;
      if (a.kind != Arg::Kind::kValue) {
        o.value = a.constant;
        out->outputs_.push_back(std::move(o));
        continue;
      }
      const ValueRecord& r = rec.values[a.value];
      const ValueId root = r.root >= 0 ? r.root : a.value;
      int input_pos = -1;
      for (size_t i = 0; i < g.inputs().size(); ++i) {
        if (g.inputs()[i] == root) input_pos = static_cast<int>(i);
      }
      o.value = results[k];
      if (r.is_tensor && input_pos >= 0 && placeholder_of[input_pos] >= 0) {
        o.kind = CudaGraph::Out::kInputView;
        o.input = input_pos;
        o.sizes = r.sizes;
        o.strides = r.strides;
        o.storage_offset = r.storage_offset;
        o.value = c10::IValue();
      } else if (r.is_tensor && input_pos < 0) {
        o.kind = CudaGraph::Out::kPool;
      }
      out->outputs_.push_back(std::move(o));
    }
    out->info_.steps = out->info_.nodes;
    for (const auto& o : out->outputs_) {
      if (o.kind == CudaGraph::Out::kPool && o.value.isTensor()) {
        out->info_.tensor_bytes += static_cast<int64_t>(o.value.toTensor().storage().nbytes());
      }
    }
  } catch (const c10::Error& e) {
    return absl::FailedPreconditionError(
        absl::StrCat("CUDA capture: ", e.what_without_backtrace()));
  }
  return std::unique_ptr<CapturedGraph>(std::move(out));
}

#endif  // TORCHREPLAY_WITH_CUDA

}  // namespace torchreplay::capture
