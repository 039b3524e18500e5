// torchreplay::check_frozen: the first step of a graph whose constants were computed from
// parameters and buffers at capture (numerics "close": Note [Close numerics] in
// python/torchreplay/close_numerics.py). It raises when one of them was written since, instead
// of letting the replay compute with what it held before.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <string>

namespace torchreplay::capture {
namespace {

// (Tensor[] tensors, int[] versions, str[] names) -> Tensor: versions[i] is tensors[i]'s version
// counter at capture (-1: an inference tensor, which has none). It returns an empty tensor that
// nothing reads: a result made on every call keeps the tape from running it once, at capture (as
// it would an op of constant arguments that returns nothing).
void CheckFrozen(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  const size_t n = stack->size();
  const c10::ArrayRef<c10::IValue> tensors = (*stack)[n - 3].toListRef();
  const c10::ArrayRef<c10::IValue> versions = (*stack)[n - 2].toListRef();
  const c10::ArrayRef<c10::IValue> names = (*stack)[n - 1].toListRef();
  TORCH_CHECK(tensors.size() == versions.size() && names.size() == versions.size(),
              "torchreplay::check_frozen: lists of different lengths");
  for (size_t i = 0; i < tensors.size(); ++i) {
    const int64_t version = versions[i].toInt();
    if (version < 0) continue;
    c10::TensorImpl* t = tensors[i].toTensor().unsafeGetTensorImpl();
    if (t == nullptr || t->is_inference()) continue;
    TORCH_CHECK(t->version_counter().current_version() == version, "torchreplay: ", names[i].toStringRef(),
                " was written after the capture (config.reduce_overhead.numerics = \"close\" folded it into the "
                "graph's constants, which do not see the change); capture the model again");
  }
  torch::jit::drop(*stack, 3);
  stack->emplace_back(at::empty({0}, at::TensorOptions().dtype(c10::kFloat)));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(torchreplay, m) {
  m.def("check_frozen(Tensor[] tensors, int[] versions, str[] names) -> Tensor");
}

TORCH_LIBRARY_IMPL(torchreplay, CompositeExplicitAutograd, m) {
  m.impl("check_frozen", torch::CppFunction::makeFromBoxedFunction<&CheckFrozen>());
}

}  // namespace torchreplay::capture
