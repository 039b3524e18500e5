// Batch-size buckets (Note [Capture sizes] in buckets.h).
#include "replay/buckets.h"

#include <ATen/ExpandUtils.h>
#include <ATen/ops/empty_strided.h>
#include <c10/core/TensorImpl.h>

#include <algorithm>
#include <cstring>

#include "memory_pool/ordinary_tensors.h"

namespace torchreplay::replay {

Buckets::Buckets(std::vector<int64_t> sizes, std::vector<int> batch_inputs,
                 std::vector<int> batch_size_inputs, std::vector<int> batch_outputs,
                 std::vector<bool> written)
    : sizes_(std::move(sizes)), batch_inputs_(std::move(batch_inputs)),
      batch_size_inputs_(std::move(batch_size_inputs)), batch_outputs_(std::move(batch_outputs)),
      written_(std::move(written)) {}

int64_t Buckets::BatchSize(const std::vector<c10::IValue>& inputs) const {
  for (int i : batch_inputs_) {
    if (i < static_cast<int>(inputs.size()) && inputs[i].isTensor() &&
        inputs[i].toTensor().defined() && inputs[i].toTensor().dim() > 0) {
      return inputs[i].toTensor().size(0);
    }
  }
  return -1;
}

int64_t Buckets::PadTo(const std::vector<c10::IValue>& inputs, int64_t n) const {
  if (n < 0 || std::binary_search(sizes_.begin(), sizes_.end(), n)) return 0;
  // Only dense calls are padded: the staging copy is dense, and a kernel may take another path
  // (and round otherwise) on a dense tensor than on the caller's strided or expanded one. And only
  // calls whose batch inputs all have n rows: the batch may be several symbols that an op ties
  // together (capture_sizes.py), which a call may break (eager's error then comes unpadded).
  for (int i : batch_inputs_) {
    if (i >= static_cast<int>(inputs.size()) || !inputs[i].isTensor() || !inputs[i].toTensor().defined()) continue;
    const at::Tensor& t = inputs[i].toTensor();
    if (t.dim() == 0 || t.size(0) != n || !t.is_non_overlapping_and_dense()) return 0;
  }
  const auto bucket = std::lower_bound(sizes_.begin(), sizes_.end(), n);
  return bucket == sizes_.end() ? -1 : *bucket;
}

std::vector<c10::IValue> Buckets::Resized(const std::vector<c10::IValue>& inputs, int64_t n,
                                          int64_t size, std::vector<at::Tensor>* staging) const {
  std::vector<c10::IValue> out = inputs;
  const size_t num = batch_inputs_.size();
  if (staging != nullptr) staging->resize(num);
  for (size_t k = 0; k < num; ++k) {
    const int i = batch_inputs_[k];
    if (i >= static_cast<int>(inputs.size()) || !inputs[i].isTensor()) continue;
    const at::Tensor& t = inputs[i].toTensor();
    if (!t.defined() || t.dim() == 0 || t.size(0) != n) continue;  // CheckInputs or the key says
    std::vector<int64_t> sizes = t.sizes().vec();
    sizes[0] = size;
    at::Tensor fresh;
    at::Tensor& s = staging != nullptr ? (*staging)[k] : fresh;
    // Dense, in the caller's dim order (a channels-last batch stays channels-last).
    const std::vector<int64_t> strides = at::infer_dense_strides(sizes, t.strides());
    if (!s.defined() || s.sizes() != c10::IntArrayRef(sizes) || s.strides() != c10::IntArrayRef(strides) ||
        s.dtype() != t.dtype() || s.device() != t.device()) {
      const memory_pool::OrdinaryTensors ordinary;  // Note [A pool of ordinary tensors]
      s = at::empty_strided(sizes, strides, t.options());
    }
    const int64_t rows = std::min(n, size);
    if (s.is_cpu() && t.is_contiguous() && s.is_contiguous()) {  // no dispatch on the fast path
      const size_t row_bytes = s.numel() == 0 ? 0 : s.nbytes() / size;
      char* dst = static_cast<char*>(s.data_ptr());
      std::memcpy(dst, t.const_data_ptr(), rows * row_bytes);
      for (int64_t r = rows; r < size; ++r) {
        if (rows > 0) std::memcpy(dst + r * row_bytes, dst + (rows - 1) * row_bytes, row_bytes);
        else std::memset(dst + r * row_bytes, 0, row_bytes);
      }
    } else {
      s.narrow(0, 0, rows).copy_(t.narrow(0, 0, rows));
      if (size > rows) {
        at::Tensor pad = s.narrow(0, rows, size - rows);
        rows > 0 ? pad.copy_(t.narrow(0, rows - 1, 1).expand_as(pad)) : pad.zero_();
      }
    }
    out[i] = s;
  }
  for (int i : batch_size_inputs_) {
    if (i < static_cast<int>(out.size()) && out[i].isInt() && out[i].toInt() == n) out[i] = size;
  }
  return out;
}

void Buckets::CutBack(std::vector<c10::IValue>& inputs, int64_t n, int64_t size,
                      const std::vector<at::Tensor>& staging, std::vector<c10::IValue>& outputs) const {
  for (size_t k = 0; k < staging.size(); ++k) {
    const int i = batch_inputs_[k];
    if (staging[k].defined() && written_[i] && inputs[i].isTensor()) {
      inputs[i].toTensor().copy_(staging[k].narrow(0, 0, n));
    }
  }
  for (int o : batch_outputs_) {
    if (o >= static_cast<int>(outputs.size()) || !outputs[o].isTensor()) continue;
    const at::Tensor& t = outputs[o].toTensor();
    if (!t.defined() || t.dim() == 0 || t.size(0) != size) continue;
    // Its first n rows, as a tensor of its own over the same memory (no dispatch).
    auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(t.storage()), t.key_set(), t.dtype());
    std::vector<int64_t> rows = t.sizes().vec();
    rows[0] = n;
    impl->set_sizes_and_strides(rows, t.strides(), t.storage_offset());
    at::Tensor narrowed(std::move(impl));
    for (const at::Tensor& s : staging) {
      if (s.defined() && t.is_alias_of(s)) narrowed = narrowed.clone();
    }
    outputs[o] = std::move(narrowed);
  }
}

}  // namespace torchreplay::replay
