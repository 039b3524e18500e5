// capture/kernels/recurrent.h: a GRU layer's steps in one call, for numerics "close" (Note [Close numerics]
// in python/torchreplay/close_numerics/__init__.py; the op is torchreplay::gru_sequence, recurrent_op.cc),
// compiled with AVX2 and FMA (recurrent_avx2.cc).
//
// Note [GRU steps]
// Decomposed, a GRU over T steps is 2T steps of the tape (the hidden projection, a small GEMM, and
// its gates, a fused elementwise step), each paying a step's call around well under a
// microsecond of arithmetic; ONNX Runtime and OpenVINO run the layer as one kernel. Here one call
// runs the layer: the input projections of every step come in computed (one small GEMM over all
// T * B rows, bias b_ih included); each step computes gh = b_hh + h W_hh (the small GEMM, W_hh
// stored [H, 3H]) into a scratch row, then, 8 lanes at a time:
//   r = sigmoid(gi_r + gh_r), z = sigmoid(gi_z + gh_z), n = tanh(gi_n + r * gh_n),
//   h' = n + z * (h - n)
// with tanh the rational approximation Eigen uses for float (within 4e-7 of torch.tanh) and
// sigmoid(x) = (1 + tanh(x / 2)) / 2 (within 2.4e-7, absolute), cheaper than Sleef's exp and tanh,
// which eager's kernels call (a step of H = 64, one row: 1.12 us with Sleef's, 0.77 with these).
// Eager's GRU cell up to those errors and rounding ((1 - z) * n + z * h there): close, not bitwise.
#pragma once

#include <cstdint>

namespace torchreplay::capture::kernels::recurrent {

struct GruParams {
  const float* gi = nullptr;    // [T, B, 3H]: each step's input projection (+ b_ih), gates r, z, n
  const float* h0 = nullptr;    // [B, H]
  const float* w_hh = nullptr;  // [H, 3H] contiguous (W_hh transposed)
  const float* b_hh = nullptr;  // [3H] or null
  float* out = nullptr;         // [T, B, H] contiguous: every step's h
  float* gh = nullptr;          // [B, 3H] scratch
  int64_t t = 0, b = 0, h = 0;
};

// Runs the T steps (Note [GRU steps]); out's last row is h_T. Only where small_gemm::Available()
// (AVX2 and FMA), as the small GEMM it calls.
void GruSteps(const GruParams& p);

}  // namespace torchreplay::capture::kernels::recurrent
