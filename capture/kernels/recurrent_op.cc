// torchreplay::gru_sequence: one GRU layer over a sequence in one call (Note [GRU steps] in
// recurrent.h), for graphs rewritten under numerics "close" (Note [Close numerics]); its out=
// overload writes the tape's planned buffers.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <vector>

#include "capture/kernels/recurrent.h"
#include "capture/kernels/small_gemm.h"

namespace torchreplay::capture::kernels {
namespace {

constexpr const char* kName = "torchreplay::gru_sequence";

bool FloatCpu(const at::Tensor& t) { return t.scalar_type() == c10::kFloat && t.device().is_cpu(); }

// input [T, B, D] ([B, T, D] if batch_first), hx [B, H], w_ih_kn [D, 3H] and w_hh_kn [H, 3H]
// contiguous (the layer's weights transposed), b_ih and b_hh [3H] or None. Writes every step's h
// into `out` ([T, B, H], or [B, T, H] if batch_first) and h_T into `h_n` ([B, H]).
void GruSequenceInto(const at::Tensor& input, const at::Tensor& hx, const at::Tensor& w_ih_kn,
                     const std::optional<at::Tensor>& b_ih, const at::Tensor& w_hh_kn,
                     const std::optional<at::Tensor>& b_hh, bool batch_first, const at::Tensor& out,
                     const at::Tensor& h_n) {
  TORCH_CHECK(small_gemm::Available(), kName, ": this CPU has no AVX2 and FMA");
  TORCH_CHECK(input.dim() == 3 && hx.dim() == 2 && w_ih_kn.dim() == 2 && w_hh_kn.dim() == 2 && FloatCpu(input) &&
                  FloatCpu(hx) && FloatCpu(w_ih_kn) && FloatCpu(w_hh_kn) && w_ih_kn.is_contiguous() &&
                  w_hh_kn.is_contiguous(),
              kName, ": float32 CPU tensors: a 3-d input, a [B, H] state and contiguous [D, 3H] and [H, 3H] weights");
  const at::Tensor x = batch_first ? input.transpose(0, 1) : input;  // [T, B, D]
  const int64_t steps = x.size(0), batch = x.size(1), d = x.size(2), hidden = hx.size(1);
  TORCH_CHECK(hx.size(0) == batch && w_ih_kn.size(0) == d && w_ih_kn.size(1) == 3 * hidden &&
                  w_hh_kn.size(0) == hidden && w_hh_kn.size(1) == 3 * hidden,
              kName, ": sizes do not agree: input ", input.sizes(), ", hx ", hx.sizes(), ", w_ih_kn ",
              w_ih_kn.sizes(), ", w_hh_kn ", w_hh_kn.sizes());
  const at::Tensor seq = batch_first ? out.transpose(0, 1) : out;
  TORCH_CHECK(FloatCpu(out) && FloatCpu(h_n) && seq.sizes() == at::IntArrayRef({steps, batch, hidden}) &&
                  h_n.sizes() == hx.sizes(),
              kName, ": out is float32 ", batch_first ? "[B, T, H]" : "[T, B, H]", " and h_n float32 [B, H], not ",
              out.sizes(), " and ", h_n.sizes());
  at::Tensor biases[2];
  const std::optional<at::Tensor>* given[2] = {&b_ih, &b_hh};
  for (int i = 0; i < 2; ++i) {
    if (!given[i]->has_value() || !(*given[i])->defined()) continue;
    const at::Tensor& b = **given[i];
    TORCH_CHECK(b.dim() == 1 && b.size(0) == 3 * hidden && FloatCpu(b), kName, ": a bias is float32 [3H], not ",
                b.sizes());
    biases[i] = b.contiguous();
  }
  if (steps == 0 || batch == 0 || hidden == 0) {
    h_n.copy_(hx);
    return;
  }
  // the steps' h contiguous, [T, B, H]: `out` itself where it lies so
  const at::Tensor h = seq.is_contiguous() ? seq : at::empty({steps, batch, hidden}, out.options());
  const at::Tensor h0 = hx.contiguous(), rows = x.contiguous();
  // scratch: every step's input projection, then one step's hidden product (a tape runs on one thread)
  thread_local std::vector<float> scratch;
  scratch.resize(static_cast<size_t>((steps + 1) * batch * 3 * hidden));
  small_gemm::Params proj;
  proj.x = rows.const_data_ptr<float>(), proj.x_row = d;
  proj.w = w_ih_kn.const_data_ptr<float>();
  proj.bias = biases[0].defined() ? biases[0].const_data_ptr<float>() : nullptr;
  proj.y = scratch.data(), proj.y_row = 3 * hidden;
  proj.m = steps * batch, proj.k = d, proj.n = 3 * hidden;
  small_gemm::Run(proj);
  recurrent::GruParams p;
  p.gi = scratch.data(), p.h0 = h0.const_data_ptr<float>();
  p.w_hh = w_hh_kn.const_data_ptr<float>();
  p.b_hh = biases[1].defined() ? biases[1].const_data_ptr<float>() : nullptr;
  p.out = h.data_ptr<float>(), p.gh = scratch.data() + steps * batch * 3 * hidden;
  p.t = steps, p.b = batch, p.h = hidden;
  recurrent::GruSteps(p);
  if (!h.is_same(seq)) seq.copy_(h);
  h_n.copy_(h.select(0, steps - 1));
}

// The result as eager's GRU returns it: [T, B, H] contiguous, transposed for batch_first.
std::tuple<at::Tensor, at::Tensor> GruSequence(const at::Tensor& input, const at::Tensor& hx,
                                               const at::Tensor& w_ih_kn, const std::optional<at::Tensor>& b_ih,
                                               const at::Tensor& w_hh_kn, const std::optional<at::Tensor>& b_hh,
                                               bool batch_first) {
  TORCH_CHECK(input.dim() == 3 && hx.dim() == 2, kName, ": a 3-d input and a [B, H] state, not ", input.sizes(),
              " and ", hx.sizes());
  const int64_t steps = input.size(batch_first ? 1 : 0), batch = input.size(batch_first ? 0 : 1);
  at::Tensor seq = at::empty({steps, batch, hx.size(1)}, input.options());
  at::Tensor out = batch_first ? seq.transpose(0, 1) : seq;
  at::Tensor h_n = at::empty(hx.sizes(), input.options());
  GruSequenceInto(input, hx, w_ih_kn, b_ih, w_hh_kn, b_hh, batch_first, out, h_n);
  return {out, h_n};
}

std::tuple<at::Tensor&, at::Tensor&> GruSequenceOut(const at::Tensor& input, const at::Tensor& hx,
                                                    const at::Tensor& w_ih_kn, const std::optional<at::Tensor>& b_ih,
                                                    const at::Tensor& w_hh_kn, const std::optional<at::Tensor>& b_hh,
                                                    bool batch_first, at::Tensor& out, at::Tensor& h_n) {
  GruSequenceInto(input, hx, w_ih_kn, b_ih, w_hh_kn, b_hh, batch_first, out, h_n);
  return {out, h_n};
}

}  // namespace

TORCH_LIBRARY_IMPL(torchreplay, CPU, m) {
  m.impl("gru_sequence", &GruSequence);
  m.impl("gru_sequence.out", &GruSequenceOut);
}

}  // namespace torchreplay::capture::kernels
