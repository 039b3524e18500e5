// capture/ir/caller_grad.h: the grad mode of the caller of a graph that runs with grad mode off.
//
// Note [The caller's grad mode]
// The bindings run an engine's graph with grad mode off: a replay records no autograd graph (the
// calls that need one take other paths). One kernel's arithmetic depends on the mode all the
// same: eager's oneDNN LSTM (aten::mkldnn_rnn_layer) runs its training primitive whenever grad mode
// is on, even where nothing requires grad (a frozen model called without torch.no_grad()), and
// its bits differ from the inference primitive's. So the bindings keep the caller's mode here
// while they turn it off (CallerGradScope), and the recurrent ops (capture/ir/eager_rnn.cc) and their
// checked kernel (Note [Checked LSTMs] in capture/tape/checked/lstm_steps.h) run with it. Outside a scope (a
// graph run by the C++ API directly) the caller's mode is the current one.
#pragma once

#include <c10/core/GradMode.h>

#include <cstdint>

namespace torchreplay {
namespace caller_grad_internal {
inline thread_local int8_t caller = -1;  // -1: no scope open on this thread
}  // namespace caller_grad_internal

inline bool CallerGradEnabled() {
  const int8_t c = caller_grad_internal::caller;
  return c < 0 ? c10::GradMode::is_enabled() : c == 1;
}

// Keeps the current grad mode as the caller's, then turns grad mode off, for the scope's life.
class CallerGradScope {
 public:
  CallerGradScope() : prev_(caller_grad_internal::caller), off_((caller_grad_internal::caller = Now(), false)) {}
  ~CallerGradScope() { caller_grad_internal::caller = prev_; }
  CallerGradScope(const CallerGradScope&) = delete;
  CallerGradScope& operator=(const CallerGradScope&) = delete;

 private:
  static int8_t Now() { return c10::GradMode::is_enabled() ? 1 : 0; }
  int8_t prev_;
  c10::AutoGradMode off_;
};

}  // namespace torchreplay
