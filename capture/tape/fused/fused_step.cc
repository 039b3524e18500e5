// The fused elementwise step (Note [Fused elementwise steps] in fused_elementwise.h; Note [A fused
// step no slower than its ops] below): one TypedCall running a group's program through the
// fused kernel, or its nodes' own calls.
#include <chrono>
#include <cstdlib>
#include <limits>
#include <string>

#include "capture/tape/fused/fused_elementwise.h"

namespace torchreplay::capture::tape::fused {
namespace {

// t.data_ptr() for the dense CPU tensors a fused step reads and writes, without its checks
// (which a step would pay for every operand of every call).
char* DataOf(const at::Tensor& t) {
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  return static_cast<char*>(impl->storage().unsafeGetStorageImpl()->mutable_data()) +
         impl->storage_offset() * static_cast<int64_t>(impl->itemsize());
}

class FusedStep final : public TypedCall {
 public:
  FusedStep(fused::Program program, std::vector<TensorArg> operands,
            std::vector<std::unique_ptr<TypedCall>> exact, c10::Storage arena)
      : program_(std::move(program)), operands_(std::move(operands)), exact_(std::move(exact)),
        arena_(std::move(arena)), base_(operands_.size()),
        scratch_(static_cast<size_t>(program_.scratch_bytes)) {
    // Where each operand's data is found per call: a per-call tensor's own; an arena buffer at its
    // offset in the arena's block, which moves when the arena grows; any other constant (a
    // parameter, whose moving recaptures the key; a wrapped number) where it is now.
    const char* block = static_cast<const char*>(arena_.data());
    for (const TensorArg& a : operands_) {
      Where w;
      if (a.slot >= 0) {
        w.slot = a.slot;
      } else {
        char* p = DataOf(a.value);
        if (block != nullptr && p >= block && p < block + arena_.nbytes()) {
          w.arena_offset = p - block;
        } else {
          w.fixed = p;
        }
      }
      where_.push_back(w);
    }
  }

  void Run(c10::DispatchKeySet keys, const Slots& slots) const override {
    if (mode_ == Mode::kOps) {
      for (const auto& call : exact_) call->Run(keys, slots);
      return;
    }
    if (mode_ == Mode::kFused) {
      RunFused(keys, slots);
      return;
    }
    // Mode::kTrial (Note [A fused step no slower than its ops]): the two ways in turn, timed.
    const bool ops = trials_ % 2 == 1;
    const auto start = std::chrono::steady_clock::now();
    if (ops) {
      for (const auto& call : exact_) call->Run(keys, slots);
    } else {
      RunFused(keys, slots);
    }
    const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    double& best = ops ? best_ops_ : best_fused_;
    if (trials_ >= 2 * kSettle) best = std::min(best, took);
    if (++trials_ == 2 * (kSettle + kTrials)) mode_ = best_fused_ <= best_ops_ ? Mode::kFused : Mode::kOps;
  }

 private:
  void RunFused(c10::DispatchKeySet keys, const Slots& slots) const {
    char* block = static_cast<char*>(arena_.unsafeGetStorageImpl()->mutable_data());
    for (size_t k = 0; k < where_.size(); ++k) {
      const Where& w = where_[k];
      base_[k] = w.slot >= 0 ? DataOf(slots[w.slot].toTensor()) : w.fixed != nullptr ? w.fixed : block + w.arena_offset;
    }
    for (int s = 0; s < static_cast<int>(program_.segments.size()); ++s) {
      if (fused::RunSegment(program_, s, base_.data(), scratch_.data())) continue;
      // Inputs the kernel does not promise eager's bits for (two NaNs meeting, a NaN into Sleef):
      // the segment's nodes again, each through its own kernel. What the segment wrote in place
      // over memory it found is put back first (Note [In-place instructions]); everything else it
      // reads it wrote itself before reading, or earlier segments wrote as eager would.
      fused::Restore(program_, s, base_.data(), scratch_.data());
      const fused::Segment& seg = program_.segments[s];
      for (int j = seg.first; j < seg.first + seg.count; ++j) exact_[j]->Run(keys, slots);
    }
  }

  // Note [A fused step no slower than its ops]
  // One pass over the data instead of one per op saves memory traffic and dispatch, but the
  // fused kernel walks eager's pieces in chunks of kChunk elements, and on large tensors eager's
  // kernels, each over its whole range (MKL's vector math in one call, 512-bit loops where ATen
  // has them), can be faster. The bits are the same either way (every instruction is eager's
  // arithmetic on eager's split), so a group with much work (kTimedWork element-ops), or with
  // many short rows (kTimedRows rows over its instructions: the kernel pays its set-up per row,
  // eager's loops once per call; a channels-last map times a per-channel scale is 576 rows of 16
  // at 24x24), runs both ways in turn over its first runs and keeps the faster: the first
  // 2 * kSettle runs are not counted (caches, pages and threads still settling make them slower,
  // unevenly), then the best time of each way over kTrials runs decides. Other groups always
  // fuse. The "ops" way is each node's own step as the tape would make it unfused (a prepared
  // iterator where there is one).
  enum class Mode : uint8_t { kTrial, kFused, kOps };
  static constexpr int64_t kTimedWork = int64_t{1} << 18;
  static constexpr int64_t kTimedRows = 256;
  static constexpr int kSettle = 2;
  static constexpr int kTrials = 4;

  static Mode FirstMode(const fused::Program& program) {
    // TORCHREPLAY_FUSED_WAY=fused or =ops: that way always (read at each capture, for comparisons)
    const char* env = std::getenv("TORCHREPLAY_FUSED_WAY");
    if (env != nullptr && std::string(env) == "fused") return Mode::kFused;
    if (env != nullptr && std::string(env) == "ops") return Mode::kOps;
    int64_t work = 0, rows = 0;
    for (const fused::Instr& in : program.instrs) {
      work += in.numel;
      rows += in.shape[0] > 0 ? in.numel / in.shape[0] : 0;
    }
    return work >= kTimedWork || rows >= kTimedRows ? Mode::kTrial : Mode::kFused;
  }

  struct Where {
    int slot = -1;
    char* fixed = nullptr;
    int64_t arena_offset = 0;
  };
  fused::Program program_;
  std::vector<TensorArg> operands_;  // held: the step's constants stay alive with it
  std::vector<std::unique_ptr<TypedCall>> exact_;
  c10::Storage arena_;
  std::vector<Where> where_;
  mutable std::vector<char*> base_;  // a tape runs on one thread
  mutable Mode mode_ = FirstMode(program_);
  mutable int trials_ = 0;
  mutable double best_fused_ = std::numeric_limits<double>::infinity();
  mutable double best_ops_ = std::numeric_limits<double>::infinity();
  mutable std::vector<char> scratch_;  // what in-place instructions overwrite (Program::scratch_bytes)
};

}  // namespace

std::unique_ptr<TypedCall> MakeFusedStep(fused::Program program, std::vector<TensorArg> operands,
                                         std::vector<std::unique_ptr<TypedCall>> exact, c10::Storage arena) {
  if (!fused::Prepare(&program)) return nullptr;
  return std::make_unique<FusedStep>(std::move(program), std::move(operands), std::move(exact), std::move(arena));
}

}  // namespace torchreplay::capture::tape::fused
