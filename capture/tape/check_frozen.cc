// torchreplay::check_frozen: the first step of a graph whose constants were computed from
// parameters and buffers at capture (numerics "close": Note [Close numerics] in
// python/torchreplay/close_numerics/__init__.py; either numerics: Note [PT2E's weights dequantized
// once] in close_numerics/quantized.py). It raises when one of them was written since, instead
// of letting the replay compute with what it held before.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <atomic>
#include <cstring>
#include <limits>
#include <string>

#include "absl/hash/hash.h"
#include "absl/strings/string_view.h"

namespace torchreplay::capture::tape {
namespace {

// Bumped whenever a parameter folded by a "close" capture is reached through .data (its getter or
// setter, python/torchreplay/patches.py): the contents of the folded tensors may have changed
// without their version counters.
std::atomic<int64_t> g_data_epoch{0};

// The contents of t as one number (absl's hash of its bytes; a contiguous copy's if it is not).
int64_t ContentHash(const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  const auto* bytes = static_cast<const char*>(c.const_data_ptr());
  return static_cast<int64_t>(absl::HashOf(absl::string_view(bytes, c.nbytes()), c.scalar_type()));
}

// (Tensor[] tensors, int[] versions, str[] names, Tensor[] copies, Tensor hashes) -> Tensor:
// - versions[i] is tensors[i]'s version counter at capture (-1: an inference tensor, which has
//   none): an in-place write bumps it;
// - copies[i], if not empty, its contents then, compared byte for byte on every call (per-channel
//   vectors: the running statistics a batch norm's train-mode forward updates inside its kernel,
//   with no counter bumped);
// - the others' contents are hashed at capture (hashes[1 + i], ContentHash) and compared again on
//   the first call after a folded parameter was reached through .data (hashes[0]: g_data_epoch
//   when they were last compared, written here), whose alias has a counter of its own; or on
//   every call where hashes[0] is kEveryCall (the bitwise numerics' fold: Note [PT2E's weights
//   dequantized once], which no .data watch covers).
// It returns an empty tensor that nothing reads: a result made on every call keeps the tape from
// running it once, at capture (as it would an op of constant arguments that returns nothing).
constexpr int64_t kEveryCall = std::numeric_limits<int64_t>::min();  // (an epoch never is)

void CheckFrozen(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  const size_t n = stack->size();
  const c10::ArrayRef<c10::IValue> tensors = (*stack)[n - 5].toListRef();
  const c10::ArrayRef<c10::IValue> versions = (*stack)[n - 4].toListRef();
  const c10::ArrayRef<c10::IValue> names = (*stack)[n - 3].toListRef();
  const c10::ArrayRef<c10::IValue> copies = (*stack)[n - 2].toListRef();
  const at::Tensor hashes = (*stack)[n - 1].toTensor();
  TORCH_CHECK(tensors.size() == versions.size() && names.size() == versions.size() &&
                  copies.size() == versions.size() && hashes.scalar_type() == at::kLong &&
                  hashes.is_contiguous() && hashes.numel() == static_cast<int64_t>(versions.size()) + 1,
              "torchreplay::check_frozen: lists of different lengths");
  auto written = [&](size_t i) {
    TORCH_CHECK(false, "torchreplay: ", names[i].toStringRef(),
                " was written after the capture, which folded it into the graph's constants (numerics \"close\" "
                "folds weights; either numerics folds a PT2E model's dequantized int8 weights), which do not see "
                "the change; capture the model again");
  };
  int64_t* hash = hashes.data_ptr<int64_t>();
  const int64_t epoch = g_data_epoch.load(std::memory_order_relaxed);
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i].toTensor();
    c10::TensorImpl* impl = t.unsafeGetTensorImpl();
    if (impl == nullptr) continue;
    const int64_t version = versions[i].toInt();
    if (version >= 0 && !impl->is_inference() && impl->version_counter().current_version() != version) written(i);
    const at::Tensor& copy = copies[i].toTensor();
    if (copy.numel() > 0) {
      if (!t.is_contiguous() || t.sizes() != copy.sizes() || t.scalar_type() != copy.scalar_type() ||
          std::memcmp(t.const_data_ptr(), copy.const_data_ptr(), copy.nbytes()) != 0) {
        written(i);
      }
    } else if (epoch != hash[0] && ContentHash(t) != hash[1 + i]) {
      written(i);
    }
  }
  if (hash[0] != kEveryCall) hash[0] = epoch;
  torch::jit::drop(*stack, 5);
  stack->emplace_back(at::empty({0}, at::TensorOptions().dtype(c10::kFloat)));
}

}  // namespace

// For the capture: the hash check_frozen compares; a folded parameter reached through .data.
TORCH_LIBRARY_IMPL(torchreplay, CatchAll, m) {
  m.impl("content_hash", &ContentHash);
  m.impl("folded_data_reached", [] { g_data_epoch.fetch_add(1, std::memory_order_relaxed); });
}

TORCH_LIBRARY_IMPL(torchreplay, CompositeExplicitAutograd, m) {
  m.impl("check_frozen", torch::CppFunction::makeFromBoxedFunction<&CheckFrozen>());
}

}  // namespace torchreplay::capture::tape
