// Collective steps of the kernel tape (Note [Collective steps] in collective_steps.h).
#include "capture/tape/collective_steps.h"

#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <utility>

namespace torchreplay::capture::tape {

struct PendingWork {
  c10::intrusive_ptr<c10d::Work> work;
};

std::shared_ptr<PendingWork> NewPendingWork() { return std::make_shared<PendingWork>(); }

void DrainPending(PendingWork* pending) {
  if (!pending->work) return;
  c10::intrusive_ptr<c10d::Work> work = std::move(pending->work);
  try {
    work->wait();
  } catch (...) {  // NOLINT(bugprone-empty-catch): the call has failed already, with its own error
  }
}

std::optional<CollectiveKind> CollectiveKindOf(const c10::OperatorHandle& op) {
  const c10::OperatorName& name = op.operator_name();
  if (name.overload_name != "" || name.name.rfind("_c10d_functional::", 0) != 0) return std::nullopt;
  const std::string what = name.name.substr(sizeof("_c10d_functional::") - 1);
  if (what == "all_reduce") return CollectiveKind::kAllReduce;
  if (what == "all_gather_into_tensor") return CollectiveKind::kAllGather;
  if (what == "reduce_scatter_tensor") return CollectiveKind::kReduceScatter;
  if (what == "all_to_all_single") return CollectiveKind::kAllToAll;
  if (what == "broadcast") return CollectiveKind::kBroadcast;
  return std::nullopt;
}

bool IsWaitTensor(const c10::OperatorHandle& op) {
  return op.operator_name().name == "_c10d_functional::wait_tensor";
}

namespace {

c10d::ReduceOp ReduceOpOf(const std::string& name) {
  using T = c10d::ReduceOp::RedOpType;
  static const std::pair<const char*, T> kOps[] = {{"sum", T::SUM},   {"avg", T::AVG},   {"product", T::PRODUCT},
                                                   {"min", T::MIN},   {"max", T::MAX},   {"band", T::BAND},
                                                   {"bor", T::BOR},   {"bxor", T::BXOR}};
  for (const auto& [n, t] : kOps) {
    if (name == n) return c10d::ReduceOp(t);
  }
  TORCH_CHECK(false, "torchreplay: unknown reduce op '", name, "' of a collective");
}

// The group argument: a group's name (torch 2.11), or the group itself (later versions).
c10::intrusive_ptr<c10d::ProcessGroup> GroupOf(const c10::IValue& v) {
  if (v.isString()) return c10d::resolve_process_group(v.toStringRef());
  return v.toCustomClass<c10d::ProcessGroup>();
}

std::vector<int64_t> Ints(const c10::IValue& v) {
  std::vector<int64_t> out;
  for (const c10::IValue& e : v.toListRef()) out.push_back(e.toInt());
  return out;
}

class CollectiveStep final : public TypedCall {
 public:
  CollectiveStep(CollectiveKind kind, const std::vector<c10::IValue>& args, TensorArg input, at::Tensor out,
                 std::shared_ptr<PendingWork> pending)
      : kind_(kind), group_(GroupOf(args.back())), input_(std::move(input)), outs_{std::move(out)},
        pending_(std::move(pending)) {
    switch (kind_) {
      case CollectiveKind::kAllReduce:
      case CollectiveKind::kReduceScatter: reduce_op_ = ReduceOpOf(args[1].toStringRef()); break;
      case CollectiveKind::kAllToAll:
        out_splits_ = Ints(args[1]);
        in_splits_ = Ints(args[2]);
        break;
      case CollectiveKind::kBroadcast: src_ = args[1].toInt(); break;
      case CollectiveKind::kAllGather: break;
    }
  }

  void Run(c10::DispatchKeySet /*keys*/, const Slots& slots) const override {
    TORCH_CHECK(!pending_->work, "torchreplay: a collective step started again before its wait");
    const at::Tensor& in = input_.get(slots);
    std::vector<at::Tensor>& outs = outs_;
    switch (kind_) {
      case CollectiveKind::kAllReduce: {
        outs[0].copy_(in);
        c10d::AllreduceOptions opts;
        opts.reduceOp = reduce_op_;
        pending_->work = group_->allreduce(outs, opts);
        break;
      }
      case CollectiveKind::kBroadcast: {
        outs[0].copy_(in);
        c10d::BroadcastOptions opts;
        opts.rootRank = src_;
        pending_->work = group_->broadcast(outs, opts);
        break;
      }
      case CollectiveKind::kAllGather: {
        TORCH_CHECK(in.is_contiguous(), "torchreplay: the input of an all_gather is not contiguous");
        std::vector<at::Tensor> ins{in};
        pending_->work = group_->allgather_into_tensor_coalesced(outs, ins);
        break;
      }
      case CollectiveKind::kReduceScatter: {
        TORCH_CHECK(in.is_contiguous(), "torchreplay: the input of a reduce_scatter is not contiguous");
        std::vector<at::Tensor> ins{in};
        c10d::ReduceScatterOptions opts;
        opts.reduceOp = reduce_op_;
        pending_->work = group_->reduce_scatter_tensor_coalesced(outs, ins, opts);
        break;
      }
      case CollectiveKind::kAllToAll: {
        TORCH_CHECK(in.is_contiguous(), "torchreplay: the input of an all_to_all is not contiguous");
        at::Tensor source = in;
        pending_->work = group_->alltoall_base(outs[0], source, out_splits_, in_splits_);
        break;
      }
    }
  }

 private:
  CollectiveKind kind_;
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  TensorArg input_;
  mutable std::vector<at::Tensor> outs_;  // the planned buffer (the group's calls take a mutable vector)
  std::shared_ptr<PendingWork> pending_;
  c10d::ReduceOp reduce_op_;
  mutable std::vector<int64_t> out_splits_, in_splits_;  // (taken by mutable reference)
  int64_t src_ = 0;
};

class WaitStep final : public TypedCall {
 public:
  explicit WaitStep(std::shared_ptr<PendingWork> pending) : pending_(std::move(pending)) {}

  void Run(c10::DispatchKeySet /*keys*/, const Slots& /*slots*/) const override {
    TORCH_CHECK(pending_->work, "torchreplay: a wait step without its collective in flight");
    c10::intrusive_ptr<c10d::Work> work = std::move(pending_->work);
    work->wait();
  }

 private:
  std::shared_ptr<PendingWork> pending_;
};

}  // namespace

std::unique_ptr<TypedCall> MakeCollectiveStep(CollectiveKind kind, const std::vector<c10::IValue>& args,
                                              TensorArg input, at::Tensor out,
                                              std::shared_ptr<PendingWork> pending) {
  return std::make_unique<CollectiveStep>(kind, args, std::move(input), std::move(out), std::move(pending));
}

std::unique_ptr<TypedCall> MakeWaitStep(std::shared_ptr<PendingWork> pending) {
  return std::make_unique<WaitStep>(std::move(pending));
}

}  // namespace torchreplay::capture::tape
