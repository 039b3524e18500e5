// torchreplay::eager_lstm, eager_gru, eager_rnn_tanh, eager_rnn_relu: aten::lstm, gru, rnn_tanh
// and rnn_relu under other names, each forwarding its stack to the aten op unchanged.
//
// Note [Recurrent modules whole]
// aten::lstm and its kin are CompositeImplicitAutograd: a trace (AOTAutograd under
// torch.compile, torch.export) replaces them with Python decompositions, whose results are not
// always eager's bits. Eager's GRU cell, for one, adds and squashes its gates in place on chunks of
// a [batch, 3 * hidden] tensor; the decomposition computes them into new contiguous tensors, so
// with more than one row the elementwise kernels split the elements between their vector and
// scalar paths at other places (GRU(32, 20) at batch 3 differs in the last bits), and its LSTM is
// two oneDNN calls where eager's one aten::lstm costs less. An op of another name is opaque to
// those decompositions: in a graph it stays one node, and at run time it is eager's own call of
// the aten op (its C++ composite then picks eager's kernels). python/torchreplay/rnn.py puts
// these ops into both entry points' graphs (torch.compile: keep_whole; torchreplay.capture:
// whole_in_trace and export_decompositions) and says where a decomposition may stay. No autograd
// kernel: a graph whose recurrent call needs gradients runs eagerly instead (keep_whole). The aten
// op runs in the caller's grad mode (Note [The caller's grad mode] in capture/ir/caller_grad.h), on which
// eager's oneDNN LSTM picks its primitive.
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>


#include "capture/ir/caller_grad.h"

namespace torchreplay::capture {
namespace {

// Below PyTorch's Python dispatcher, which a trace turns on: it would run the aten op's Python
// decomposition (whose LSTM hands back states of other sizes than the op's) instead of eager's.
template <const char* kName, const char* kOverload>
void CallAten(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow(kName, kOverload);
  c10::impl::ExcludeDispatchKeyGuard no_python_dispatcher(c10::DispatchKey::PythonDispatcher);
  c10::AutoGradMode callers(CallerGradEnabled());
  op.callBoxed(stack);
}

constexpr char kLstm[] = "aten::lstm";
constexpr char kGru[] = "aten::gru";
constexpr char kRnnTanh[] = "aten::rnn_tanh";
constexpr char kRnnRelu[] = "aten::rnn_relu";
constexpr char kInput[] = "input";
constexpr char kData[] = "data";

}  // namespace

// The CPU and CUDA kernels run the aten op; sizes under a trace come from the fake kernels of
// python/torchreplay/rnn.py (symbolic sizes included).
static void RegisterKernels(torch::Library& m) {
  m.impl("eager_lstm.input", torch::CppFunction::makeFromBoxedFunction<&CallAten<kLstm, kInput>>());
  m.impl("eager_lstm.data", torch::CppFunction::makeFromBoxedFunction<&CallAten<kLstm, kData>>());
  m.impl("eager_gru.input", torch::CppFunction::makeFromBoxedFunction<&CallAten<kGru, kInput>>());
  m.impl("eager_gru.data", torch::CppFunction::makeFromBoxedFunction<&CallAten<kGru, kData>>());
  m.impl("eager_rnn_tanh.input", torch::CppFunction::makeFromBoxedFunction<&CallAten<kRnnTanh, kInput>>());
  m.impl("eager_rnn_tanh.data", torch::CppFunction::makeFromBoxedFunction<&CallAten<kRnnTanh, kData>>());
  m.impl("eager_rnn_relu.input", torch::CppFunction::makeFromBoxedFunction<&CallAten<kRnnRelu, kInput>>());
  m.impl("eager_rnn_relu.data", torch::CppFunction::makeFromBoxedFunction<&CallAten<kRnnRelu, kData>>());
}

TORCH_LIBRARY_IMPL(torchreplay, CPU, m) { RegisterKernels(m); }
TORCH_LIBRARY_IMPL(torchreplay, CUDA, m) { RegisterKernels(m); }

}  // namespace torchreplay::capture
