// replay/buckets.h: batch-size buckets (Note [Capture sizes]): which calls are padded, to which
// capture size, and how a padded call's inputs are made and its outputs cut back.
//
// Ownership: Buckets is immutable after construction (one per engine, shared by its threads);
// the staging tensors a padded call writes are the caller's (per thread, reused across calls).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace torchreplay::replay {

// Note [Capture sizes]
// Serving loops see a new batch size on most steps; capturing each one costs a capture per size
// and a key per size in the cache. With capture_sizes (vLLM's name; torchair's "gears"), only
// those batch sizes are captured: a call with n rows, n not a capture size, is padded up to the
// next one b (its batch inputs copied into per-thread staging tensors of b rows in the caller's
// dim order, rows n.. copies of row n - 1, so padding raises nothing a real row does not (an
// integer division by a zero row would); its batch-size inputs set to b), replayed under b's
// key, and its batch outputs narrowed back to n rows (views of the pool, as any output). A batch
// output that aliases a staging tensor is cloned (the staging is reused by the next call); batch
// inputs an op writes are copied back (rows 0..n), so writes reach the caller's tensor. Rows must
// be independent (each output row a function of the same input row): torch.compile's backend
// checks that on the graph before it sets the batch fields (python/torchreplay/capture_sizes.py);
// for an engine built by hand it is the caller's promise. A batch above the largest capture size
// runs eagerly, with that reason. A call whose batch inputs are not all dense (a strided slice,
// an expanded tensor) is not padded but run under its own key: the dense staging copy could send
// a kernel down another path than eager's (a strided reduction sums in another order). Nor is a
// call whose batch inputs do not all have the same dim 0: torch.export may give two inputs a
// batch symbol each that an op ties together (index_copy_ of x into a per-row cache), which the
// check takes as one batch; a call that breaks the tie runs unpadded, and fails as eager does.
// All sizes share one pool, sized by the largest (PlanArena per key, one arena per thread).
class Buckets {
 public:
  // `sizes` ascending (empty: off); `batch_inputs`: tensor inputs whose dim 0 is the batch;
  // `batch_size_inputs`: int inputs holding the batch size; `batch_outputs`: outputs whose dim 0
  // is the batch; `written`: per input, an op may write it (Graph::written_inputs).
  Buckets(std::vector<int64_t> sizes, std::vector<int> batch_inputs,
          std::vector<int> batch_size_inputs, std::vector<int> batch_outputs,
          std::vector<bool> written);

  bool enabled() const { return !sizes_.empty(); }
  const std::vector<int64_t>& sizes() const { return sizes_; }

  // The batch size of a call (dim 0 of the first batch input), or -1 if it has none.
  int64_t BatchSize(const std::vector<c10::IValue>& inputs) const;

  // The capture size a call with batch `n` is padded to, when it is padded: n is not a capture
  // size and every batch input is dense (no gaps, no broadcast dims) with n rows (others run
  // unpadded under their own key). 0: not padded. -1: padded, but n is above the largest
  // capture size.
  int64_t PadTo(const std::vector<c10::IValue>& inputs, int64_t n) const;

  // `inputs` with their batch (n rows) resized to `size`: cut, or padded with copies of the last
  // row (zeros for an empty batch) into `staging` (per batch input, reused) when given, else into
  // new tensors.
  std::vector<c10::IValue> Resized(const std::vector<c10::IValue>& inputs, int64_t n, int64_t size,
                                   std::vector<at::Tensor>* staging) const;

  // After a padded replay: written batch inputs get their first n rows back from `staging`, and
  // each batch output of `size` rows is cut to its first n (cloned if it aliases the staging).
  void CutBack(std::vector<c10::IValue>& inputs, int64_t n, int64_t size,
               const std::vector<at::Tensor>& staging, std::vector<c10::IValue>& outputs) const;

 private:
  const std::vector<int64_t> sizes_;
  const std::vector<int> batch_inputs_, batch_size_inputs_, batch_outputs_;
  const std::vector<bool> written_;
};

}  // namespace torchreplay::replay
