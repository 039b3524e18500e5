// memory_pool/ordinary_tensors.h: the guard under which an engine makes the tensors it keeps.
#pragma once

#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>

#include <optional>

namespace torchreplay::memory_pool {

// Note [A pool of ordinary tensors]
// A tensor made under torch.inference_mode() is an inference tensor, and no op may write one
// outside inference mode ("Inplace update to inference tensor outside InferenceMode"). An engine
// keeps what it makes at capture (pool buffers, constants, staging of padded batches, CUDA
// placeholders) and writes it on every later call, under whatever mode that call runs: so they
// are made as ordinary tensors even when the capture runs in inference mode. This guard, held
// while they are made, leaves inference mode and keeps grad mode as it was (InferenceMode(false)
// alone would turn grad mode on). Outputs are handed out under the caller's mode (replay/handout.cc
// makes each output's TensorImpl then), so a call in inference mode gets inference tensors, as
// eager does.
class OrdinaryTensors {
 public:
  OrdinaryTensors() {
    if (c10::InferenceMode::is_enabled()) {
      off_.emplace(false);
      grad_.emplace(false);  // inference mode had grad off
    }
  }

 private:
  std::optional<c10::InferenceMode> off_;
  std::optional<c10::AutoGradMode> grad_;
};

}  // namespace torchreplay::memory_pool
