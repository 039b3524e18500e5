// The CUDA backend (see cuda_graph.h).
//
// Note [Why at::cuda::CUDAGraph]
// Capture goes through ATen's CUDAGraph rather than the CUDA runtime directly: it enters the
// caching allocator's (and the host allocator's) private pool before cudaStreamBeginCapture, and
// registers the CUDA RNG's generator state with the graph so random ops (dropout, rand) draw
// fresh numbers on every replay exactly as PyTorch's own graphs do. What it does not do is clean
// up after a capture that fails half-way (an uncapturable op throws while the stream is
// capturing): that case is handled here, in AbortCapture.
//
// Note [Aborting a capture]
// CUDAGraph::capture_begin (ATen/cuda/CUDAGraph.cpp) puts the registered generators in capture
// mode, then begins allocating to the pool on the caching allocator and on the host allocator
// (each increments the pool's use count), then begins the stream capture. capture_end ends the
// stream capture, ends both allocations, takes the generators out of capture mode, and only then
// sets capture_ended_ (instantiate() runs after it, and may still fail), after which reset() (the
// destructor) releases both pools. So a capture that
// fails must: end the stream capture; end each allocation still recording; release each pool
// whose allocation this capture began, unless capture_ended_ is set (then the destructor
// releases it: releasing here too would drive the use count negative); and take the generator
// out of capture mode, which only a completed capture does (an empty capture on the same
// stream). All of it under CaptureMutex(), like the capture.
#include "capture/cuda/cuda_graph.h"

#include <mutex>
#include <optional>

#include "absl/strings/str_cat.h"
#include "capture/ir/interpreter.h"

#ifdef TORCHREPLAY_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <ATen/core/CachingHostAllocator.h>
#include <ATen/ops/_foreach_copy.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#endif

namespace torchreplay::capture::cuda {

absl::StatusOr<CudaCapturePlan> PlanCudaCapture(const Graph& g, const Recording& rec,
                                                const std::vector<c10::IValue>& inputs) {
  if (auto s = CheckReplayable(g, rec); !s.ok()) return s;
  for (size_t i = 0; i < g.inputs().size(); ++i) {
    // A graph declared with CUDA inputs keys every scalar; one that was not may not be captured.
    if (g.is_per_call_scalar(static_cast<int>(i))) {
      return absl::FailedPreconditionError(absl::StrCat(
          "scalar input ", i, " is bound per call, and a CUDA graph bakes scalars in (declare the "
          "graph's tensor inputs as CUDA so that scalars are guarded)"));
    }
  }
  // Work on CPU tensors would run once, at capture, and never again on replay; a graph is
  // captured on one device (cudagraph trees skip multi-device graphs as well).
  std::optional<c10::Device> device;
  ValueId first = -1;
  for (size_t v = 0; v < rec.values.size(); ++v) {
    const ValueRecord& r = rec.values[v];
    if (!r.is_tensor || r.dtype == c10::ScalarType::Undefined) continue;
    if (!r.device.is_cuda()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "value '", g.values()[v].name, "' is a CPU tensor inside a CUDA graph (", r.sizes.size(),
          "-d); CPU work is not captured"));
    }
    if (!device.has_value()) {
      device = r.device;
      first = static_cast<ValueId>(v);
    } else if (r.device != *device) {
      return absl::FailedPreconditionError(absl::StrCat(
          "value '", g.values()[v].name, "' is on ", r.device.str(), " and '", g.values()[first].name,
          "' on ", device->str(), ": a CUDA graph is captured on one device"));
    }
  }
  if (!device.has_value()) return absl::FailedPreconditionError("the graph has no CUDA tensors");

  CudaCapturePlan plan;
  plan.device = *device;
  const std::vector<bool> mutated = MutatedRoots(g, rec);
  std::vector<int> placeholder_of(inputs.size(), -1);
  for (size_t i = 0; i < inputs.size() && i < g.inputs().size(); ++i) {
    if (!inputs[i].isTensor() || !inputs[i].toTensor().defined() || rec.baked(g, static_cast<int>(i))) continue;
    const at::Tensor& t = inputs[i].toTensor();
    const bool written = mutated[g.inputs()[i]];
    for (int j : plan.placeholders) {
      if ((written || mutated[g.inputs()[j]]) && t.storage().is_alias_of(inputs[j].toTensor().storage())) {
        return absl::FailedPreconditionError(absl::StrCat(
            "inputs ", j, " and ", i, " share memory and the graph writes one of them: a CUDA graph "
            "copies each into its own placeholder, so the write would not reach the other"));
      }
    }
    placeholder_of[i] = static_cast<int>(plan.placeholders.size());
    if (written) plan.copied_back.push_back(plan.placeholders.size());
    plan.placeholders.push_back(static_cast<int>(i));
  }
  // Outputs: views of non-static inputs are rebuilt on the caller's tensors every call; anything
  // else captured is either a static tensor (or a view of one), a number, or pool memory.
  for (const Arg& a : g.outputs()) {
    CudaCapturePlan::Output o;
    if (a.kind == Arg::Kind::kValue) {
      const ValueRecord& r = rec.values[a.value];
      const ValueId root = r.root_or(a.value);
      int input_pos = -1;
      for (size_t i = 0; i < g.inputs().size(); ++i) {
        if (g.inputs()[i] == root) input_pos = static_cast<int>(i);
      }
      if (r.is_tensor && input_pos >= 0 && placeholder_of[input_pos] >= 0) {
        o.kind = CudaCapturePlan::Output::kInputView;
        o.input = input_pos;
      } else if (r.is_tensor && input_pos < 0) {
        o.kind = CudaCapturePlan::Output::kPool;
      }
    }
    plan.outputs.push_back(o);
  }
  return plan;
}

#ifndef TORCHREPLAY_WITH_CUDA

absl::StatusOr<std::unique_ptr<CapturedGraph>> CaptureCudaGraph(
    std::shared_ptr<const Graph>, const Recording&, const std::vector<c10::IValue>&,
    memory_pool::CudaPool*, const CaptureOptions&) {
  return absl::FailedPreconditionError("torchreplay was built without CUDA");
}

#else

namespace {

using c10::cuda::CUDAStream;

// ATen's CUDAGraph, with the one fact AbortCapture needs (Note [Aborting a capture]).
class AtenGraph final : public at::cuda::CUDAGraph {
 public:
  using at::cuda::CUDAGraph::CUDAGraph;
  bool capture_ended() const { return capture_ended_; }
};

class CudaGraph final : public CapturedGraph {
 public:
  absl::Status Replay(const std::vector<c10::IValue>& inputs,
                      std::vector<c10::IValue>* outputs) override;
  const CaptureInfo& info() const override { return info_; }
  bool OutputInPool(size_t i) const override { return outputs_[i].kind == kPool; }
  absl::StatusOr<std::string> Dump(const std::string& path_stem) const override;

  struct Out {
    CudaCapturePlan::Output::Kind kind = CudaCapturePlan::Output::kConstant;
    c10::IValue value;  // kPool: the captured tensor; kConstant: the value
    int input = -1;     // kInputView: a view of this caller's input
    std::vector<int64_t> sizes, strides;
    int64_t storage_offset = 0;
  };
  static constexpr auto kPool = CudaCapturePlan::Output::kPool;
  static constexpr auto kInputView = CudaCapturePlan::Output::kInputView;

  CaptureInfo info_;
  c10::Device device_{c10::DeviceType::CUDA, 0};
  std::unique_ptr<AtenGraph> graph_;
  bool kept_graph_ = false;
  struct Placeholder {
    int input;          // position
    at::Tensor tensor;  // the static copy the graph reads
    bool expanded;      // stride-0 dims: only the distinct elements are copied
  };
  std::vector<Placeholder> placeholders_;
  std::vector<size_t> copied_back_;  // placeholders the graph mutates
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
    for (const Placeholder& p : placeholders_) {
      const at::Tensor& t = inputs[p.input].toTensor();
      if (t.const_data_ptr() == p.tensor.const_data_ptr()) continue;  // already the placeholder
      dst_.push_back(p.expanded ? memory_pool::CudaPool::DistinctElements(p.tensor) : p.tensor);
      src_.push_back(p.expanded ? memory_pool::CudaPool::DistinctElements(t) : t);
    }
    if (!dst_.empty()) at::_foreach_copy_(dst_, src_);
    graph_->replay();
    if (!copied_back_.empty()) {
      dst_.clear();
      src_.clear();
      for (size_t k : copied_back_) {
        const Placeholder& p = placeholders_[k];
        const at::Tensor& caller = inputs[p.input].toTensor();
        if (caller.const_data_ptr() == p.tensor.const_data_ptr()) continue;
        dst_.push_back(caller);
        src_.push_back(p.tensor);
      }
      if (!dst_.empty()) at::_foreach_copy_(dst_, src_);
    }
    outputs->clear();
    for (const Out& o : outputs_) {
      if (o.kind == kInputView) {
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

// Note [Aborting a capture]. `begun`: capture_begin returned (so both allocations were begun).
void AbortCapture(AtenGraph& graph, bool begun, CUDAStream stream, c10::DeviceIndex device,
                  at::cuda::MempoolId_t pool) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream.stream(), &status) == cudaSuccess &&
      status != cudaStreamCaptureStatusNone) {
    cudaGraph_t partial = nullptr;
    (void)cudaStreamEndCapture(stream.stream(), &partial);
    if (partial != nullptr) (void)cudaGraphDestroy(partial);
  }
  (void)cudaGetLastError();  // capture errors are not sticky; clear the last-error slot
  auto ended = [](auto&& end) {
    try {
      end();
      return true;
    } catch (const c10::Error&) {  // not recording: never begun, or capture_end ended it
      return false;
    }
  };
  const bool device_ended = ended([&] { c10::cuda::CUDACachingAllocator::endAllocateToPool(device, pool); });
  const bool host_ended = ended([&] { at::getHostAllocator(at::kCUDA)->end_allocate_to_pool(pool); });
  if (!graph.capture_ended()) {  // else the graph's reset() releases both
    if (begun || device_ended) {
      try {
        c10::cuda::CUDACachingAllocator::releasePool(device, pool);
      } catch (const c10::Error&) {
      }
    }
    if (begun || host_ended) {
      try {
        at::getHostAllocator(at::kCUDA)->release_pool(pool);
      } catch (const c10::Error&) {
      }
    }
  }
  // capture_begin put the registered RNG states (the default generator's always) in capture
  // mode, and only a successful capture_end takes them out of it; left so, every later eager
  // random op would fail. An empty capture on the same stream runs the pair once more (it
  // allocates nothing, so it cannot fail half-way itself; its "empty graph" warning is dropped).
  struct Quiet : c10::WarningHandler {
    void process(const c10::Warning&) override {}
  } quiet;
  c10::WarningUtils::WarningHandlerGuard warnings(&quiet);
  try {
    at::cuda::CUDAGraph reset_rng;
    reset_rng.capture_begin({0, 0}, cudaStreamCaptureModeThreadLocal);
    reset_rng.capture_end();
  } catch (const c10::Error&) {
  }
}

}  // namespace

// Over 80 lines: the capture in the order CUDA requires it (the inputs' placeholders, one capture
// at a time, the pool, the side stream ordered after the caller's, the graph's run under capture,
// its outputs), a failure at any point undone by AbortCapture; split, every piece would take the
// capture's stream, pool and guards whole. Untested on a GPU since 2026-11-28.
absl::StatusOr<std::unique_ptr<CapturedGraph>> CaptureCudaGraph(
    std::shared_ptr<const Graph> graph, const Recording& rec,
    const std::vector<c10::IValue>& inputs, memory_pool::CudaPool* pool,
    const CaptureOptions& options) {
  const Interpreter interp(graph);
  const Graph& g = *graph;
  absl::StatusOr<CudaCapturePlan> plan = PlanCudaCapture(g, rec, inputs);
  if (!plan.ok()) return plan.status();
  const c10::Device device = plan->device;

  auto out = std::make_unique<CudaGraph>();
  out->device_ = device;
  out->info_.nodes = static_cast<int>(g.nodes().size());
  out->copied_back_ = plan->copied_back;
  try {
    c10::cuda::CUDAGuard device_guard(device);
    // Placeholders: same sizes, strides and storage offset as the key's inputs.
    std::vector<c10::IValue> capture_inputs = inputs;
    for (int i : plan->placeholders) {
      const at::Tensor& t = inputs[i].toTensor();
      at::Tensor placeholder = memory_pool::CudaPool::Placeholder(t);
      out->placeholders_.push_back({i, placeholder, memory_pool::CudaPool::Expanded(t)});
      capture_inputs[i] = placeholder;
    }

    std::lock_guard<std::mutex> one_capture(memory_pool::CaptureMutex());  // Note [One capture at a time]
    const auto [id_first, id_second] = pool->id(device.index());
    const at::cuda::MempoolId_t pool_id{id_first, id_second};
    const int64_t reserved_before = memory_pool::CudaReservedBytes(device);
    const CUDAStream caller = c10::cuda::getCurrentCUDAStream(device.index());
    const CUDAStream side(CUDAStream::UNCHECKED, memory_pool::CaptureStream(device.index()));
    {
      at::cuda::CUDAEvent ready;
      ready.record(caller);
      ready.block(side);
    }
    std::vector<c10::IValue> results;
    {
      c10::cuda::CUDAStreamGuard stream_guard(side);
      out->graph_ = std::make_unique<AtenGraph>(options.keep_graph);
      out->kept_graph_ = options.keep_graph;
      absl::Status run_status;
      bool begun = false;
      try {
        out->graph_->capture_begin(pool_id, cudaStreamCaptureModeThreadLocal);
        begun = true;
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
      } catch (const std::exception& e) {  // e.g. std::bad_alloc: the capture is undone all the same
        run_status = absl::FailedPreconditionError(absl::StrCat("capture failed: ", e.what()));
      } catch (...) {
        run_status = absl::FailedPreconditionError("capture failed: an exception of unknown type");
      }
      if (!run_status.ok()) {
        results.clear();  // pool blocks go back before the pool's share is released
        AbortCapture(*out->graph_, begun, side, device.index(), pool_id);
        out->graph_.reset();
        return absl::FailedPreconditionError(absl::StrCat("CUDA capture: ", run_status.message()));
      }
    }
    {
      at::cuda::CUDAEvent done;
      done.record(side);
      done.block(caller);
    }
    out->info_.arena_bytes = memory_pool::CudaReservedBytes(device) - reserved_before;
    pool->AddCapturedBytes(out->info_.arena_bytes);

    for (size_t k = 0; k < g.outputs().size(); ++k) {
      const CudaCapturePlan::Output& planned = plan->outputs[k];
      CudaGraph::Out o;
      o.kind = planned.kind;
      if (planned.kind == CudaGraph::kInputView) {
        const ValueRecord& r = rec.values[g.outputs()[k].value];
        o.input = planned.input;
        o.sizes = r.sizes;
        o.strides = r.strides;
        o.storage_offset = r.storage_offset;
      } else {
        o.value = g.outputs()[k].kind == Arg::Kind::kValue ? results[k] : g.outputs()[k].constant;
      }
      if (o.kind == CudaGraph::kPool && o.value.isTensor()) {
        out->info_.tensor_bytes += static_cast<int64_t>(o.value.toTensor().storage().nbytes());
      }
      out->outputs_.push_back(std::move(o));
    }
    out->info_.steps = out->info_.nodes;
  } catch (const c10::Error& e) {
    return absl::FailedPreconditionError(
        absl::StrCat("CUDA capture: ", e.what_without_backtrace()));
  }
  return std::unique_ptr<CapturedGraph>(std::move(out));
}

#endif  // TORCHREPLAY_WITH_CUDA

}  // namespace torchreplay::capture::cuda
