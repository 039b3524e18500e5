// The table of step families (Note [Step kinds] in step_kinds.h).
#include "capture/tape/step_kinds.h"

#include "capture/tape/checked/conv_steps.h"
#include "capture/tape/checked/gemm_steps.h"
#include "capture/tape/checked/lstm_steps.h"
#include "capture/tape/prepared_pointwise.h"

namespace torchreplay::capture::tape {
namespace {

bool MatchAttention(const Node&, const std::string& out_op, bool whole_args) {
  return whole_args && out_op == "torchreplay::_scaled_dot_product_flash_attention_for_cpu.out";
}
Made MakeAttention(const EmitContext&, const OutCall& call, const CaptureOptions&) {
  return {MakeFlashAttention(call.args, call.slot_of), "prepared attention"};
}

bool MatchLayerNorm(const Node&, const std::string& out_op, bool whole_args) {
  return whole_args && out_op == "torchreplay::native_layer_norm.out";
}
Made MakeLayerNormStep(const EmitContext&, const OutCall& call, const CaptureOptions&) {
  return {MakeLayerNorm(call.args, call.slot_of), "prepared layer norm"};
}

bool MatchConvolution(const Node&, const std::string& out_op, bool whole_args) {
  return whole_args && out_op == "torchreplay::convolution.out";  // Note [Checked convolutions]
}
Made MakeConvolution(const EmitContext&, const OutCall& call, const CaptureOptions&) {
  return {checked::MakeConvolutionStep(call.args, call.slot_of), checked::ConvolutionStepKind(call.args)};
}

bool MatchGemm(const Node&, const std::string& out_op, bool whole_args) {
  return whole_args && (out_op == "torchreplay::addmm.out" || out_op == "torchreplay::mm.out");  // Note [Checked GEMMs]
}
Made MakeGemm(const EmitContext&, const OutCall& call, const CaptureOptions&) {
  return {checked::MakeGemmStep(call.args, call.slot_of), checked::GemmStepKind(call.args)};
}

bool MatchLstm(const Node&, const std::string& out_op, bool) {
  return out_op == "torchreplay::lstm.out";  // Note [Checked LSTMs]: its states are list elements
}
Made MakeLstm(const EmitContext&, const OutCall& call, const CaptureOptions&) {
  return {checked::MakeLstmStep(call.args, call.slot_of, call.elem_slots), "checked lstm (onednn_prepacked)"};
}

bool MatchTypedOut(const Node&, const std::string&, bool whole_args) { return whole_args; }
Made MakeTypedOut(const EmitContext&, const OutCall& call, const CaptureOptions& options) {
  if (!call.whole_args) return {nullptr, "boxed out="};
  Made made{MakeTypedCall(call.op, call.args, call.slot_of), "typed out="};
  if (made.call == nullptr) made.what = "boxed out=";
  if (options.prepared_steps && made.call != nullptr) {
    const TypedCall* plain = made.call.get();
    made.call = MakePrepared(call.op, call.args, call.slot_of, std::move(made.call));
    made.prepared = made.call.get() != plain;
    const std::string name = OperatorName(call.op);
    const bool reduction = name == "aten::sum.IntList_out" || name == "aten::mean.out";
    if (made.prepared) made.what = reduction ? "prepared reduction" : "prepared pointwise";
  }
  return made;
}

// In the order the plan asks them; kTypedOut last, taking whatever none before it took.
constexpr StepFamily kOutFamilies[] = {
    {StepKind::kCopies, &MatchCopies, &MakeCopies},
    {StepKind::kAttention, &MatchAttention, &MakeAttention},
    {StepKind::kLayerNorm, &MatchLayerNorm, &MakeLayerNormStep},
    {StepKind::kConvolution, &MatchConvolution, &MakeConvolution},
    {StepKind::kGemm, &MatchGemm, &MakeGemm},
    {StepKind::kLstm, &MatchLstm, &MakeLstm},
    {StepKind::kMaxPool, &MatchMaxPool, &MakeMaxPool},
    {StepKind::kTypedOut, &MatchTypedOut, &MakeTypedOut},
};

}  // namespace

const char* StepKindName(StepKind kind) {
  switch (kind) {
    case StepKind::kNone: return "";
    case StepKind::kCopies: return "copies";
    case StepKind::kAttention: return "prepared attention";
    case StepKind::kLayerNorm: return "prepared layer norm";
    case StepKind::kConvolution: return "checked conv";
    case StepKind::kGemm: return "checked gemm";
    case StepKind::kLstm: return "checked lstm";
    case StepKind::kMaxPool: return "max pool";
    case StepKind::kTypedOut: return "typed out=";
  }
  return "?";
}

StepKind MatchOutFamily(const Node& n, const std::string& out_op, bool whole_args) {
  for (const StepFamily& f : kOutFamilies) {
    if (f.match(n, out_op, whole_args)) return f.kind;
  }
  return StepKind::kNone;  // a list argument with a per-call element: the op boxed
}

Made MakeOutStep(StepKind kind, const EmitContext& ctx, const OutCall& call, const CaptureOptions& options) {
  for (const StepFamily& f : kOutFamilies) {
    if (f.kind != kind) continue;
    Made made = f.make(ctx, call, options);
    if (made.call != nullptr || kind == StepKind::kTypedOut) return made;
    return MakeTypedOut(ctx, call, options);  // the arguments are not what its Match assumed
  }
  return Made{nullptr, "boxed out="};
}

}  // namespace torchreplay::capture::tape
