// capture/tape/checked/kernel_check.h: what the recording run's checks of faster kernels share
// (Note [The shape of a check] below; the kinds: Note [Checked convolutions] in conv_steps.h,
// Note [Checked GEMMs] in gemm_steps.h, Note [Checked LSTMs] in lstm_steps.h): the check's
// skeleton (CheckNode, Decision), inputs made from a private seed, a candidate's run compared bit for bit,
// buffers of a recorded geometry, the timing of candidates; and what the chosen kernels' steps
// share: the watch of a weight they keep a copy of, the step class.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "capture/ir/graph.h"
#include "capture/ir/recording.h"
#include "capture/tape/typed_call.h"

namespace torchreplay::capture::tape::checked {

// Note [The shape of a check]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Every check of a node that has faster kernels than eager's op (CheckConvolution, CheckGemm,
// CheckLstm: a checked kind is a row of the step-kind table, its check called by CheckTapeNode)
// takes the same steps, the kind's own parts in between (CheckNode runs 1 and 2 around the
// kind's 3 and 4):
//  1. PlannedResults: the node's results can be planned buffers; else the check says nothing.
//  2. Decision::Probe: the rest runs outside Python's dispatch modes (the probe is not the model's
//     computation: the modes neither see it nor turn its errors into Python's, as for Note
//     [Checked out= kernels]); an error it raises is the node's refusal, not the capture's.
//  3. The kind refuses what its kernels do not cover (Decision::Refuse), lists its candidate
//     kernels (FixedUnderKey says which may pack a weight once) and those it did not try with why,
//     and checks each candidate bit for bit on its inputs (CompareRun, Synthetic).
//  4. Decision::KeepFastest: eager's op and the exact candidates timed round by round; the
//     fastest that beats eager's op is the node's out= variant, every candidate named in its note
//     (the plan dump, step.profile()).

// One candidate kernel of a checked node.
struct Candidate {
  std::string kernel;         // its name: the out= op's extra argument
  std::string why;            // empty: exact on every input the check tried; else why not
  std::function<void()> run;  // the kernel on the recorded inputs into a buffer of the result's geometry
  bool may_tie = false;       // kept even when not faster than eager's op (eager's own kernel, out=)
  double us = 0;              // measured by KeepFastest
};

// The records of node `n`'s results if each can be a planned buffer (a fresh CPU tensor at
// storage offset 0, present in `env`); else empty, and the check says nothing of the node.
std::vector<const ValueRecord*> PlannedResults(const Node& n, const std::vector<c10::IValue>& env,
                                               const Recording& rec);

// Whether argument `a` of node `node` is fixed under the key, so that a kernel may pack it once: a
// constant, or (through t, transpose or permute) a graph input baked into the capture that no op
// writes.
bool FixedUnderKey(const Graph& g, int node, const Arg& a, const Recording& rec);

// What a check records of node `node` under its out= op `out_name` (steps 2 to 4 of Note [The
// shape of a check]). Borrows `rec`, which must outlive it.
class Decision;

// Steps 1 and 2 of Note [The shape of a check] around the kind's `check` (steps 3 and 4, given
// the results' records and the node's Decision under `out_name`, as Decision's constructor takes
// it): false when the results cannot be planned buffers (nothing recorded), else what `check`
// returned (whether a kernel was kept).
bool CheckNode(const Graph& g, int node, const std::vector<c10::IValue>& env, Recording* rec,
               const char* out_name, bool refusal_in_notes,
               const std::function<bool(const std::vector<const ValueRecord*>& results, Decision& decision)>& check);

class Decision {
 public:
  // `refusal_in_notes`: a refusal goes to out_notes and the node's eager out= overload is still
  // checked (GEMMs); else to out_refusals and the node runs functionally.
  Decision(Recording* rec, int node, const char* out_name, bool refusal_in_notes);
  // Runs `check` (which returns whether a kernel was kept) as the probe; returns its result, or
  // false after refusing with "the check raised: ..." when it raised.
  bool Probe(const std::function<bool()>& check);
  // Records "<out_name> refused: <why>". Returns false.
  bool Refuse(const std::string& why);
  // Step 4: times `eager` (eager's op as the tape would call it, `eager_label` its name in the
  // note) and the exact `candidates`; keeps the fastest faster than eager's op (or tying it, where
  // Candidate::may_tie), recorded with a note naming each candidate and `not_tried`; else refuses.
  // `bitwise_on`: how many inputs the kind's check compared on. Returns whether one was kept.
  bool KeepFastest(const std::string& eager_label, const std::function<void()>& eager,
                   std::vector<Candidate> candidates, const std::vector<std::string>& not_tried, int bitwise_on);

 private:
  Recording* rec_;
  int node_;
  const char* out_name_;
  bool refusal_in_notes_;
};

// An input of `like`'s geometry (sizes and strides) made from a private seed: normal values
// scaled by powers of two from 2^-20 to 2^20, signed zeros and subnormals; with `nonfinite`,
// infinities and NaNs of two payloads at a few places too (few enough that most outputs stay
// finite). Floating dtypes only.
at::Tensor Synthetic(const at::Tensor& like, bool nonfinite);

// A buffer of a result's recorded geometry whose storage cannot grow (so that a kernel that
// resizes its output raises instead).
at::Tensor FixedBuffer(const ValueRecord& r);

// Empty when `run` (a candidate kernel writing the buffer it is given) wrote exactly `eager`'s
// bits into a buffer of the recorded geometry `r` and left its sizes, strides and storage as they
// were; else why not, naming the input as `input`.
std::string CompareRun(const std::function<void(const at::Tensor& buffer)>& run, const at::Tensor& eager,
                       const ValueRecord& r, const char* input);
// The same for a kernel with several results: `run` writes buffers of the geometries `records`
// give, compared with `eager`'s results in order.
std::string CompareRuns(const std::function<void(const std::vector<at::Tensor>& buffers)>& run,
                        const std::vector<at::Tensor>& eager, const std::vector<const ValueRecord*>& records,
                        const char* input);

// The least time in microseconds of each of `fns` over a few rounds, each round running every one
// once (so that a burst of load on a shared machine slows all of them, not one), stopping after
// ~20 ms.
std::vector<double> MinMicros(const std::vector<std::function<void()>>& fns);

// "12.3 us", for the notes of a check.
std::string Us(double us);

// A weight a kernel keeps a copy of (packed, reordered): whether it changed since the copy was
// made, by its bytes, address and sizes, not its version counter, which fused optimizers
// (torch.optim.Adam(fused=True)) and writes through .data leave where it was. Costs a read of the
// weight per call (its bytes against a copy of them), measured with the kernel by the checks.
class WeightWatch {
 public:
  // True the first time and whenever `w` is not what the last true call saw (then remembered).
  bool Changed(const at::Tensor& w);

 private:
  at::Tensor seen_;  // a copy of the bytes (as they lie where the tensor is dense)
  const void* from_ = nullptr;
  std::vector<int64_t> sizes_, strides_;
};

// The tape's step of a checked kernel: `call.Run(a, b, bias, out)` on two tensor arguments, an
// optional bias and the node's planned buffer. `Call` is the kernel as the check chose it, with
// what it keeps between runs (a packed weight); a tape runs on one thread.
template <class Call>
class CheckedStep final : public TypedCall {
 public:
  CheckedStep(Call call, TensorArg a, TensorArg b, std::optional<TensorArg> bias, at::Tensor out)
      : call_(std::move(call)), a_(std::move(a)), b_(std::move(b)), bias_(std::move(bias)), out_(std::move(out)) {}
  void Run(c10::DispatchKeySet, const Slots& slots) const override {
    std::optional<at::Tensor> bias;
    if (bias_.has_value()) bias = bias_->get(slots);
    call_.Run(a_.get(slots), b_.get(slots), bias, out_);
  }

 private:
  Call call_;
  TensorArg a_, b_;
  std::optional<TensorArg> bias_;
  at::Tensor out_;  // the planned buffer
};

}  // namespace torchreplay::capture::tape::checked
