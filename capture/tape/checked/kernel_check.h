// capture/tape/checked/kernel_check.h: what the recording run's checks of faster kernels share (Note [Checked
// convolutions] in conv_steps.h, Note [Checked GEMMs] in gemm_steps.h): inputs made from a private
// seed, a candidate's run compared bit for bit, buffers of a recorded geometry, the timing of
// candidates; and what the chosen kernels' steps share: the watch of a weight they keep a copy of,
// the step class.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "capture/ir/recording.h"
#include "capture/tape/typed_call.h"

namespace torchreplay::capture {

// An input of `like`'s geometry (sizes and strides) made from a private seed: normal values
// scaled by powers of two from 2^-20 to 2^20, signed zeros and subnormals; with `nonfinite`,
// infinities and NaNs of two payloads at a few places too (few enough that most outputs stay
// finite). Floating dtypes only.
at::Tensor Synthetic(const at::Tensor& like, bool nonfinite);

// A buffer of a result's recorded geometry whose storage cannot grow (so that a kernel that
// resizes its output raises instead).
at::Tensor FixedBuffer(const ValueRecord& r);

// Empty when `run` (a candidate kernel writing the buffer it is given) wrote exactly `eager`'s
// bits into a buffer of the recorded geometry `r` and left its sizes, strides and storage as they
// were; else why not, naming the input as `input`.
std::string CompareRun(const std::function<void(const at::Tensor& buffer)>& run, const at::Tensor& eager,
                       const ValueRecord& r, const char* input);
// The same for a kernel with several results: `run` writes buffers of the geometries `records`
// give, compared with `eager`'s results in order.
std::string CompareRuns(const std::function<void(const std::vector<at::Tensor>& buffers)>& run,
                        const std::vector<at::Tensor>& eager, const std::vector<const ValueRecord*>& records,
                        const char* input);

// The least time in microseconds of each of `fns` over a few rounds, each round running every one
// once (so that a burst of load on a shared machine slows all of them, not one), stopping after
// ~20 ms.
std::vector<double> MinMicros(const std::vector<std::function<void()>>& fns);

// "12.3 us", for the notes of a check.
std::string Us(double us);

// A weight a kernel keeps a copy of (packed, reordered): whether it changed since the copy was
// made, by its bytes, address and sizes, not its version counter, which fused optimizers
// (torch.optim.Adam(fused=True)) and writes through .data leave where it was. Costs a read of the
// weight per call (its bytes against a copy of them), measured with the kernel by the checks.
class WeightWatch {
 public:
  // True the first time and whenever `w` is not what the last true call saw (then remembered).
  bool Changed(const at::Tensor& w);

 private:
  at::Tensor seen_;  // a copy of the bytes (as they lie where the tensor is dense)
  const void* from_ = nullptr;
  std::vector<int64_t> sizes_, strides_;
};

// The tape's step of a checked kernel: `call.Run(a, b, bias, out)` on two tensor arguments, an
// optional bias and the node's planned buffer. `Call` is the kernel as the check chose it, with
// what it keeps between runs (a packed weight); a tape runs on one thread.
template <class Call>
class CheckedStep final : public TypedCall {
 public:
  CheckedStep(Call call, TensorArg a, TensorArg b, std::optional<TensorArg> bias, at::Tensor out)
      : call_(std::move(call)), a_(std::move(a)), b_(std::move(b)), bias_(std::move(bias)), out_(std::move(out)) {}
  void Run(c10::DispatchKeySet, const Slots& slots) const override {
    std::optional<at::Tensor> bias;
    if (bias_.has_value()) bias = bias_->get(slots);
    call_.Run(a_.get(slots), b_.get(slots), bias, out_);
  }

 private:
  Call call_;
  TensorArg a_, b_;
  std::optional<TensorArg> bias_;
  at::Tensor out_;  // the planned buffer
};

}  // namespace torchreplay::capture
