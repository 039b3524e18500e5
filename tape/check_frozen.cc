// torchreplay::check_frozen: the first step of a graph whose constants were computed from
// parameters and buffers at capture (numerics "close": Note [Close numerics] in
// python/torchreplay/close_numerics.py). It raises when one of them was written since, instead
// of letting the replay compute with what it held before.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstring>
#include <string>

namespace torchreplay::capture {
namespace {

// (Tensor[] tensors, int[] versions, str[] names, Tensor[] copies) -> Tensor: versions[i] is
// tensors[i]'s version counter at capture (-1: an inference tensor, which has none); copies[i], if
// defined and not empty, its contents then, compared byte for byte: a write that leaves the counter
// where it was (the running statistics a batch norm's train-mode forward updates inside its
// kernel; a write through .data) changes them. It returns an empty tensor that nothing reads: a
// result made on every call keeps the tape from running it once, at capture (as it would an op of
// constant arguments that returns nothing).
void CheckFrozen(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  const size_t n = stack->size();
  const c10::ArrayRef<c10::IValue> tensors = (*stack)[n - 4].toListRef();
  const c10::ArrayRef<c10::IValue> versions = (*stack)[n - 3].toListRef();
  const c10::ArrayRef<c10::IValue> names = (*stack)[n - 2].toListRef();
  const c10::ArrayRef<c10::IValue> copies = (*stack)[n - 1].toListRef();
  TORCH_CHECK(tensors.size() == versions.size() && names.size() == versions.size() &&
                  (copies.empty() || copies.size() == versions.size()),
              "torchreplay::check_frozen: lists of different lengths");
  auto written = [&](size_t i) {
    TORCH_CHECK(false, "torchreplay: ", names[i].toStringRef(),
                " was written after the capture (config.reduce_overhead.numerics = \"close\" folded it into the "
                "graph's constants, which do not see the change); capture the model again");
  };
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i].toTensor();
    c10::TensorImpl* impl = t.unsafeGetTensorImpl();
    if (impl == nullptr) continue;
    const int64_t version = versions[i].toInt();
    if (version >= 0 && !impl->is_inference() && impl->version_counter().current_version() != version) written(i);
    if (copies.empty()) continue;
    const at::Tensor& copy = copies[i].toTensor();
    if (!copy.defined() || copy.numel() == 0) continue;
    if (!t.is_contiguous() || t.sizes() != copy.sizes() || t.scalar_type() != copy.scalar_type() ||
        std::memcmp(t.const_data_ptr(), copy.const_data_ptr(), copy.nbytes()) != 0) {
      written(i);
    }
  }
  torch::jit::drop(*stack, 4);
  stack->emplace_back(at::empty({0}, at::TensorOptions().dtype(c10::kFloat)));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(torchreplay, m) {
  m.def("check_frozen(Tensor[] tensors, int[] versions, str[] names, Tensor[] copies) -> Tensor");
}

TORCH_LIBRARY_IMPL(torchreplay, CompositeExplicitAutograd, m) {
  m.impl("check_frozen", torch::CppFunction::makeFromBoxedFunction<&CheckFrozen>());
}

}  // namespace torchreplay::capture
