// torchreplay::check_frozen: the first step of a graph whose constants were computed from
// parameters and buffers at capture (numerics "close": Note [Close numerics] in
// bindings/torchreplay/close_numerics.py). It raises when one of them was written since, instead
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
  std::vector<std::string> names;
  for (const c10::IValue& name : stack->back().toListRef()) names.push_back(name.toStringRef());
  const std::vector<int64_t> versions = (*stack)[stack->size() - 2].toIntVector();
  const c10::List<at::Tensor> tensors = (*stack)[stack->size() - 3].toTensorList();
  TORCH_CHECK(tensors.size() == versions.size() && names.size() == versions.size(),
              "torchreplay::check_frozen: lists of different lengths");
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor t = tensors.get(i);
    if (versions[i] < 0 || !t.defined() || t.is_inference()) continue;
    TORCH_CHECK(t.unsafeGetTensorImpl()->version_counter().current_version() == versions[i], "torchreplay: ",
                names[i], " was written after the capture (config.reduce_overhead.numerics = \"close\" folded it "
                "into the graph's constants, which do not see the change); capture the model again");
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
