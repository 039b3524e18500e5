// capture/kernels/ops.cc: every op torchreplay adds to PyTorch's dispatcher, declared here and
// nowhere else (torchreplay's native_functions.yaml). Each op's kernels are registered beside
// their code, with TORCH_LIBRARY_IMPL; the Python side adds fake (meta) kernels only
// (python/torchreplay/rnn.py). Linked into every build of the runtime (alwayslink), so a schema
// exists wherever one of its kernels does.
#include <torch/library.h>

#include <string>

TORCH_LIBRARY(torchreplay, m) {
  // Multi-stream scopes (capture/ir/scopes.h): markers the interpreter and the backends act on.
  m.def("scope_enter(str[] labels, str[] stream_names) -> ()");
  m.def("scope_exit() -> ()");
  m.def("record() -> Tensor");
  m.def("wait(Tensor[] records) -> ()");

  // Recurrent modules kept whole as eager runs them (Note [Recurrent modules whole] in
  // capture/ir/eager_rnn.cc). The schemas are aten's (native_functions.yaml), renamed.
  m.def("eager_lstm.input(Tensor input, Tensor[] hx, Tensor[] params, bool has_biases, int num_layers, "
        "float dropout, bool train, bool bidirectional, bool batch_first) -> (Tensor, Tensor, Tensor)");
  m.def("eager_lstm.data(Tensor data, Tensor batch_sizes, Tensor[] hx, Tensor[] params, bool has_biases, "
        "int num_layers, float dropout, bool train, bool bidirectional) -> (Tensor, Tensor, Tensor)");
  for (const char* name : {"eager_gru", "eager_rnn_tanh", "eager_rnn_relu"}) {
    const std::string input = std::string(name) +
                              ".input(Tensor input, Tensor hx, Tensor[] params, bool has_biases, int num_layers, "
                              "float dropout, bool train, bool bidirectional, bool batch_first) -> (Tensor, Tensor)";
    const std::string data = std::string(name) +
                             ".data(Tensor data, Tensor batch_sizes, Tensor hx, Tensor[] params, bool has_biases, "
                             "int num_layers, float dropout, bool train, bool bidirectional) -> (Tensor, Tensor)";
    m.def(torch::schema(input.c_str()));
    m.def(torch::schema(data.c_str()));
  }

  // A quantize_dynamic Linear while torch.export traces it (Note [Packed quantized Linears] in
  // python/torchreplay/packed.py): a fake kernel only; lowered to eager's quantized:: op.
  m.def("packed_linear(Tensor x, int handle, int out_features, bool reduce_range, bool fp16) -> Tensor");
  // Its LSTMs and GRUs, on the handle of their layers' packed cells: lowered to aten's quantized_lstm
  // and quantized_gru on them.
  m.def("packed_lstm(Tensor input, Tensor[] hx, int handle, bool has_biases, int num_layers, float dropout, "
        "bool train, bool bidirectional, bool batch_first, ScalarType dtype) -> (Tensor, Tensor, Tensor)");
  m.def("packed_gru(Tensor input, Tensor hx, int handle, bool has_biases, int num_layers, float dropout, "
        "bool train, bool bidirectional, bool batch_first) -> (Tensor, Tensor)");

  // Out= forms of ATen ops that have none, for the tape's typed steps
  // (capture/tape/prepared_pointwise.cc).
  m.def("_scaled_dot_product_flash_attention_for_cpu.out(Tensor query, Tensor key, Tensor value, "
        "float dropout_p=0., bool is_causal=False, *, Tensor? attn_mask=None, float? scale=None, "
        "Tensor(a!) output, Tensor(b!) logsumexp) -> (Tensor(a!), Tensor(b!))");
  m.def("native_layer_norm.out(Tensor input, int[] normalized_shape, Tensor? weight, Tensor? bias, float eps, *, "
        "Tensor(a!) out0, Tensor(b!) out1, Tensor(c!) out2) -> (Tensor(a!), Tensor(b!), Tensor(c!))");

  // Eager's inference batch norm as its per-channel terms and one fma per element, which the tape
  // fuses with the ops around it (Note [Batch norm as a channel affine] in
  // capture/tape/fused/fused_kernels.cc).
  m.def("batch_norm_terms(Tensor? weight, Tensor? bias, Tensor running_mean, Tensor running_var, float eps) "
        "-> (Tensor, Tensor)");
  m.def("batch_norm_terms.out(Tensor? weight, Tensor? bias, Tensor running_mean, Tensor running_var, float eps, *, "
        "Tensor(a!) alpha, Tensor(b!) beta) -> (Tensor(a!), Tensor(b!))");
  m.def("channel_affine(Tensor x, Tensor alpha, Tensor beta, Tensor? weight, Tensor? bias, Tensor running_mean, "
        "Tensor running_var, float eps) -> Tensor");
  m.def("channel_affine.out(Tensor x, Tensor alpha, Tensor beta, Tensor? weight, Tensor? bias, Tensor running_mean, "
        "Tensor running_var, float eps, *, Tensor(a!) out) -> Tensor(a!)");

  // A conversion to float32 whose every value is exact there (from int8, uint8, int16 or bool), as
  // aten::_to_copy computes it (Note [Exact conversions] in capture/tape/copy_steps.cc).
  m.def("to_float32(Tensor x) -> Tensor");
  m.def("to_float32.out(Tensor x, *, Tensor(a!) out) -> Tensor(a!)");

  // Checked kernels: ATen's op through the call chosen at capture, named by `kernel` (Note
  // [Checked convolutions], [Checked GEMMs], [Checked LSTMs] in capture/tape/).
  m.def("convolution.out(Tensor input, Tensor weight, Tensor? bias, int[] stride, int[] padding, int[] dilation, "
        "bool transposed, int[] output_padding, int groups, str kernel, *, Tensor(a!) out) -> Tensor(a!)");
  m.def("addmm.out(Tensor self, Tensor mat1, Tensor mat2, Scalar beta, Scalar alpha, str kernel, *, "
        "Tensor(a!) out) -> Tensor(a!)");
  m.def("mm.out(Tensor self, Tensor mat2, str kernel, *, Tensor(a!) out) -> Tensor(a!)");
  m.def("lstm.out(Tensor input, Tensor[] hx, Tensor[] params, bool has_biases, int num_layers, float dropout, "
        "bool train, bool bidirectional, bool batch_first, str kernel, *, Tensor(a!) output, Tensor(b!) hy, "
        "Tensor(c!) cy) -> (Tensor(a!), Tensor(b!), Tensor(c!))");

  // Numerics "close": the frozen-weight check (capture/tape/check_frozen.cc) and the hand-written
  // kernels of this package (small_gemm_op.cc, depthwise_op.cc, recurrent_op.cc).
  m.def("check_frozen(Tensor[] tensors, int[] versions, str[] names, Tensor[] copies, Tensor hashes) -> Tensor");
  m.def("content_hash(Tensor t) -> int");
  m.def("folded_data_reached() -> ()");
  m.def("small_gemm(Tensor input, Tensor weight_kn, Tensor bias, str post_op) -> Tensor");
  m.def("small_gemm.out(Tensor input, Tensor weight_kn, Tensor bias, str post_op, *, Tensor(a!) out) -> Tensor(a!)");
  m.def("small_gemm_scaled(Tensor input, Tensor scale, Tensor weight_kn, Tensor bias, str post_op) -> Tensor");
  m.def("small_gemm_scaled.out(Tensor input, Tensor scale, Tensor weight_kn, Tensor bias, str post_op, *, "
        "Tensor(a!) out) -> Tensor(a!)");
  m.def("conv_gemm(Tensor input, Tensor weight_rows, Tensor bias, int[] kernel_size, int[] stride, int[] padding, "
        "int[] dilation, str post_op, bool channels_last=False) -> Tensor");
  m.def("conv_gemm.out(Tensor input, Tensor weight_rows, Tensor bias, int[] kernel_size, int[] stride, "
        "int[] padding, int[] dilation, str post_op, bool channels_last=False, *, Tensor(a!) out) -> Tensor(a!)");
  m.def("depthwise_conv2d(Tensor input, Tensor weight, Tensor weight_hwc, Tensor? bias, int[] stride, "
        "int[] padding, int[] dilation, str post_op) -> Tensor");
  m.def("depthwise_conv2d.out(Tensor input, Tensor weight, Tensor weight_hwc, Tensor? bias, int[] stride, "
        "int[] padding, int[] dilation, str post_op, *, Tensor(a!) out) -> Tensor(a!)");
  m.def("gru_sequence(Tensor input, Tensor hx, Tensor w_ih_kn, Tensor? b_ih, Tensor w_hh_kn, Tensor? b_hh, "
        "bool batch_first) -> (Tensor, Tensor)");
  m.def("gru_sequence.out(Tensor input, Tensor hx, Tensor w_ih_kn, Tensor? b_ih, Tensor w_hh_kn, Tensor? b_hh, "
        "bool batch_first, *, Tensor(a!) out, Tensor(b!) h_n) -> (Tensor(a!), Tensor(b!))");
}
