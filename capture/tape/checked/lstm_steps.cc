// LSTMs through oneDNN on weights reordered once (Note [Checked LSTMs] in lstm_steps.h): the
// check the recording run makes per node, the out= op, and the tape's step.
#include "capture/tape/checked/lstm_steps.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/lstm.h>
#include <ATen/ops/mkldnn_rnn_layer_ops.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <cstdlib>
#include <functional>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "capture/ir/caller_grad.h"
#include "capture/ir/interpreter.h"
#include "capture/tape/checked/kernel_check.h"

namespace torchreplay::capture::tape::checked {
namespace {

constexpr char kOutName[] = "torchreplay::lstm.out";
constexpr char kOnednn[] = "onednn_prepacked";
constexpr int64_t kLstmMode = 2;  // ideep::rnn_kind::LSTM, as eager's mkldnn_rnn passes it

// oneDNN's weight reorder for one LSTM layer, resolved once; nullptr where it has no CPU kernel.
const c10::OperatorHandle* Reorder() {
  static const c10::OperatorHandle* op = []() -> const c10::OperatorHandle* {
    auto handle = c10::Dispatcher::singleton().findSchema({"mkldnn::_reorder_mkldnn_rnn_layer_weight", ""});
    if (!handle.has_value() || !handle->hasKernelForDispatchKey(c10::DispatchKey::CPU)) return nullptr;
    return new c10::OperatorHandle(*handle);
  }();
  return op;
}

// An LSTM as the step runs it: eager's mkldnn_rnn, layer by layer, on weights reordered once, in
// the caller's grad mode at capture (Note [The caller's grad mode]); in another, eager's op.
class LstmCall {
 public:
  LstmCall(int64_t num_layers, bool has_biases, double dropout, bool train, bool bidirectional, bool batch_first)
      : num_layers_(num_layers), stride_(has_biases ? 4 : 2), has_biases_(has_biases), train_(train),
        bidirectional_(bidirectional), batch_first_(batch_first), dropout_(dropout), grad_(CallerGradEnabled()) {}

  // (output, hy, cy) = lstm(input, (h0, c0), params), into buffers of the results' geometries.
  void Run(const at::Tensor& input, const at::Tensor& h0, const at::Tensor& c0, const std::vector<at::Tensor>& params,
           const at::Tensor& output, const at::Tensor& hy, const at::Tensor& cy) const {
    const int64_t dirs = bidirectional_ ? 2 : 1;
    TORCH_CHECK(static_cast<int64_t>(params.size()) == stride_ * num_layers_ * dirs && input.dim() == 3 &&
                    h0.dim() == 3,
                kOutName, ": expects ", stride_, " weights per layer and direction and 3-d input and states");
    if (CallerGradEnabled() != grad_) return Eager(input, h0, c0, params, output, hy, cy);
    // the layer calls below autograd, autocast and Python modes (they see oneDNN's weights), in
    // the grad mode that picks oneDNN's primitive
    c10::AutoGradMode grad_mode(grad_);
    const at::Tensor hx = h0.contiguous(), cx = c0.contiguous();
    const int64_t hidden = hx.size(2);
    Pack(params, input.sizes(), hidden);
    at::Tensor layer_input = (batch_first_ ? input.transpose(0, 1) : input).contiguous();
    std::vector<at::Tensor> outputs(dirs);
    for (int64_t layer = 0; layer < num_layers_; ++layer) {
      for (int64_t d = 0; d < dirs; ++d) {
        const int64_t i = layer * dirs + d;
        // without biases eager passes zeros of the weights' sizes, which the layer does not read
        const at::Tensor& b_ih = has_biases_ ? params[stride_ * i + 2] : packed_[2 * i];
        const at::Tensor& b_hh = has_biases_ ? params[stride_ * i + 3] : packed_[2 * i + 1];
        auto result = at::_ops::mkldnn_rnn_layer::redispatch(
            c10::DispatchKeySet(c10::DispatchKey::CPU), layer_input, packed_[2 * i], packed_[2 * i + 1], b_ih, b_hh,
            hx[i], cx[i], /*reverse=*/d > 0, /*batch_sizes=*/{}, kLstmMode, hidden, num_layers_, has_biases_,
            bidirectional_, batch_first_, train_);
        outputs[d] = std::get<0>(result);
        hy[i].copy_(std::get<1>(result));
        cy[i].copy_(std::get<2>(result));
      }
      layer_input = dirs == 1 ? outputs[0] : at::cat(outputs, -1);
    }
    output.copy_(batch_first_ ? layer_input.transpose(0, 1) : layer_input);
  }

 private:
  // Eager's op, in the caller's grad mode, its results copied into the buffers.
  void Eager(const at::Tensor& input, const at::Tensor& h0, const at::Tensor& c0, const std::vector<at::Tensor>& params,
             const at::Tensor& output, const at::Tensor& hy, const at::Tensor& cy) const {
    c10::AutoGradMode grad_mode(CallerGradEnabled());
    auto [y, h, c] = at::lstm(input, {h0, c0}, params, has_biases_, num_layers_, dropout_, train_, bidirectional_,
                              batch_first_);
    output.copy_(y);
    hy.copy_(h);
    cy.copy_(c);
  }

  // Reorders each layer's two weight matrices where they changed (or the input's sizes did).
  void Pack(const std::vector<at::Tensor>& params, at::IntArrayRef input_sizes, int64_t hidden) const {
    const size_t n = params.size() / stride_;  // layers x directions
    const bool resized = packed_for_ != input_sizes.vec();
    packed_.resize(2 * n);
    watches_.resize(2 * n);
    for (size_t i = 0; i < n; ++i) {
      const at::Tensor &w_ih = params[stride_ * i], &w_hh = params[stride_ * i + 1];
      const bool ih = watches_[2 * i].Changed(w_ih);
      const bool hh = watches_[2 * i + 1].Changed(w_hh);
      if (!ih && !hh && !resized) continue;
      torch::jit::Stack stack = {w_ih, w_hh, hidden, /*reverse=*/bidirectional_ && i % 2 == 1, has_biases_,
                                 batch_first_, input_sizes.vec()};
      Reorder()->callBoxed(&stack);
      const std::vector<at::Tensor> packed = stack[0].toTensorVector();
      packed_[2 * i] = packed[0];
      packed_[2 * i + 1] = packed[1];
    }
    packed_for_ = input_sizes.vec();
  }

  int64_t num_layers_, stride_;  // stride_: weights per layer and direction
  bool has_biases_, train_, bidirectional_, batch_first_;
  double dropout_;
  bool grad_;  // the caller's grad mode at capture
  // per layer and direction: the two weights in oneDNN's layout and what they were made from
  // (WeightWatch), and the input sizes they were packed for (a tape runs on one thread)
  mutable std::vector<at::Tensor> packed_;
  mutable std::vector<WeightWatch> watches_;
  mutable std::vector<int64_t> packed_for_;
};

class LstmStep final : public TypedCall {
 public:
  LstmStep(LstmCall call, TensorArg input, TensorArg h0, TensorArg c0, std::vector<at::Tensor> params,
           std::vector<at::Tensor> outs)
      : call_(std::move(call)), input_(std::move(input)), h0_(std::move(h0)), c0_(std::move(c0)),
        params_(std::move(params)), outs_(std::move(outs)) {}
  void Run(c10::DispatchKeySet, const Slots& slots) const override {
    call_.Run(input_.get(slots), h0_.get(slots), c0_.get(slots), params_, outs_[0], outs_[1], outs_[2]);
  }

 private:
  LstmCall call_;
  TensorArg input_, h0_, c0_;
  std::vector<at::Tensor> params_;  // baked
  std::vector<at::Tensor> outs_;    // the planned buffers: output, hy, cy
};

// torchreplay::lstm.out, boxed: reorders the weights on each call (the tape's step, once).
std::tuple<at::Tensor&, at::Tensor&, at::Tensor&> LstmOut(const at::Tensor& input, at::TensorList hx,
                                                          at::TensorList params, bool has_biases, int64_t num_layers,
                                                          double dropout, bool train, bool bidirectional,
                                                          bool batch_first, c10::string_view kernel,
                                                          at::Tensor& output, at::Tensor& hy, at::Tensor& cy) {
  TORCH_CHECK(kernel == kOnednn && Reorder() != nullptr && hx.size() == 2 && !(train && dropout != 0), kOutName,
              ": no kernel '", kernel, "' for this LSTM");
  LstmCall(num_layers, has_biases, dropout, train, bidirectional, batch_first)
      .Run(input, hx[0], hx[1], params.vec(), output, hy, cy);
  return {output, hy, cy};
}

}  // namespace

bool IsCheckedLstm(const Node& n) {
  // TORCHREPLAY_CHECKED_LSTM=0: eager's op everywhere (read at each capture, for comparisons)
  const char* env = std::getenv("TORCHREPLAY_CHECKED_LSTM");
  if (env != nullptr && std::string(env) == "0") return false;
  return n.kind == NodeKind::kOp && n.op->schema().name() == "torchreplay::eager_lstm" &&
         n.op->schema().overload_name() == "input" && n.outputs.size() == 3 && n.args.size() == 9;
}

namespace {

// Why the checked kernel does not cover this LSTM (its boxed arguments `args`, its results
// `results`); empty when it does.
std::string Unfit(const torch::jit::Stack& args, const std::vector<at::Tensor>& results) {
  const at::Tensor input = args[0].toTensor();
  const std::vector<at::Tensor> hx = args[1].toTensorVector(), params = args[2].toTensorVector();
  const bool has_biases = args[3].toBool(), train = args[6].toBool(), bidirectional = args[7].toBool();
  if (Reorder() == nullptr) return "mkldnn::_reorder_mkldnn_rnn_layer_weight has no CPU kernel here";
  bool float32 = input.scalar_type() == c10::kFloat;
  for (const auto& list : {hx, params, results}) {
    for (const at::Tensor& t : list) float32 = float32 && t.scalar_type() == c10::kFloat && t.layout() == c10::kStrided;
  }
  if (!float32) return "not all float32 dense tensors (float32 is checked)";
  if (static_cast<int64_t>(params.size()) != (has_biases ? 4 : 2) * args[4].toInt() * (bidirectional ? 2 : 1) ||
      hx.size() != 2) {
    return "projections (proj_size)";
  }
  if (train && args[5].toDouble() != 0) return "dropout drawn (train with dropout)";
  if (input.dim() != 3 || input.numel() == 0 || hx[0].dim() != 3) return "an empty or unbatched input";
  return "";
}

// Empty when `call` computes eager's bits (node `n`'s, on its boxed arguments `args`, its results
// `results` of the geometries `records`) on the recorded input and states and on two synthetic
// ones; else why not.
std::string CheckCall(const Node& n, const LstmCall& call, const torch::jit::Stack& args,
                      const std::vector<at::Tensor>& results, const std::vector<const ValueRecord*>& records) {
  const std::vector<at::Tensor> hx = args[1].toTensorVector(), params = args[2].toTensorVector();
  const char* names[] = {"the recorded input and states", "an input and states with signed zeros and subnormals",
                         "an input and states with infinities and NaNs"};
  for (int k = 0; k < 3; ++k) {
    at::Tensor x = args[0].toTensor(), h = hx[0], c = hx[1];
    std::vector<at::Tensor> eager = results;
    if (k > 0) {
      x = Synthetic(x, k == 2), h = Synthetic(hx[0], k == 2), c = Synthetic(hx[1], k == 2);
      torch::jit::Stack stack = args;
      stack[0] = x;
      stack[1] = c10::List<at::Tensor>({h, c});
      n.op->callBoxed(&stack);
      eager = {stack[0].toTensor(), stack[1].toTensor(), stack[2].toTensor()};
    }
    const std::string why = CompareRuns(
        [&](const std::vector<at::Tensor>& b) { call.Run(x, h, c, params, b[0], b[1], b[2]); }, eager, records,
        names[k]);
    if (!why.empty()) return why;
  }
  return "";
}

}  // namespace

// Note [The shape of a check], its third step Note [Checked LSTMs]'s.
void CheckLstm(const Graph& g, int node, const std::vector<c10::IValue>& env, Recording* rec) {
  const Node& n = g.nodes()[node];
  CheckNode(g, node, env, rec, kOutName, /*refusal_in_notes=*/false,
                   [&](const std::vector<const ValueRecord*>& records, Decision& decision) {
    const auto& schema = n.op->schema().arguments();
    torch::jit::Stack args;
    for (size_t a = 0; a < n.args.size(); ++a) args.push_back(MaterializeArg(n.args[a], schema[a].type(), env));
    std::vector<at::Tensor> results;
    for (ValueId o : n.outputs) results.push_back(env[o].toTensor());
    if (std::string why = Unfit(args, results); !why.empty()) return decision.Refuse(why);
    // Are the weights fixed under the key (baked inputs or constants), so that they can be packed once?
    bool fixed = n.args[2].kind == Arg::Kind::kList;
    for (const Arg& w : n.args[2].elems) fixed = fixed && FixedUnderKey(g, node, w, *rec);
    if (!fixed) return decision.Refuse(absl::StrCat(kOnednn, ": the weights are computed or bound per call"));
    const auto call = std::make_shared<LstmCall>(args[4].toInt(), args[3].toBool(), args[5].toDouble(),
                                                 args[6].toBool(), args[7].toBool(), args[8].toBool());
    if (std::string why = CheckCall(n, *call, args, results, records); !why.empty()) {
      return decision.Refuse(absl::StrCat(kOnednn, ": ", why));
    }
    const at::Tensor input = args[0].toTensor();
    const std::vector<at::Tensor> hx = args[1].toTensorVector(), params = args[2].toTensorVector();
    std::vector<at::Tensor> buffers;
    for (const ValueRecord* r : records) buffers.push_back(FixedBuffer(*r));
    return decision.KeepFastest(
        "eager's op",
        [&] {
          torch::jit::Stack stack = args;
          n.op->callBoxed(&stack);
        },
        {{kOnednn, "", [&] { call->Run(input, hx[0], hx[1], params, buffers[0], buffers[1], buffers[2]); }}}, {}, 3);
  });
}

TORCH_LIBRARY_IMPL(torchreplay, CPU, m) { m.impl("lstm.out", &LstmOut); }

std::unique_ptr<TypedCall> MakeLstmStep(const Slots& args, const std::vector<int>& slot_of,
                                        const std::vector<ElemSlot>& elem_slots) {
  if (args.size() != 13 || slot_of.size() != 13 || Reorder() == nullptr) return nullptr;
  for (int k = 1; k < 13; ++k) {
    if (slot_of[k] >= 0) return nullptr;
  }
  if (!args[1].isTensorList() || !args[2].isTensorList() || args[1].toTensorList().size() != 2 || !args[3].isBool() ||
      !args[4].isInt() ||
      !args[6].isBool() || !args[7].isBool() || !args[8].isBool() || !args[9].isString() ||
      args[9].toStringRef() != kOnednn) {
    return nullptr;
  }
  std::optional<TensorArg> states[2];
  for (const ElemSlot& e : elem_slots) {
    if (e.arg != 1 || e.elem < 0 || e.elem > 1) return nullptr;  // a weight bound per call
    states[e.elem] = TensorArg{at::Tensor(), e.slot};
  }
  for (int e = 0; e < 2; ++e) {
    if (!states[e].has_value()) states[e] = TensorArg{args[1].toTensorList().get(e), -1};
  }
  TensorArg input = slot_of[0] >= 0 ? TensorArg{at::Tensor(), slot_of[0]} : TensorArg{args[0].toTensor(), -1};
  if (!args[5].isDouble()) return nullptr;
  LstmCall call(args[4].toInt(), args[3].toBool(), args[5].toDouble(), args[6].toBool(), args[7].toBool(),
                args[8].toBool());
  return std::make_unique<LstmStep>(std::move(call), std::move(input), *std::move(states[0]), *std::move(states[1]),
                                    args[2].toTensorVector(),
                                    std::vector<at::Tensor>{args[10].toTensor(), args[11].toTensor(),
                                                            args[12].toTensor()});
}

}  // namespace torchreplay::capture::tape::checked
