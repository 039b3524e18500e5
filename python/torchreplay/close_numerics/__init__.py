"""The graph rewrite of `config.reduce_overhead.numerics = "close"` (Note [Close numerics]).

Note [Close numerics]
By default a replay computes eager's bits. With numerics "close", torchreplay.capture rewrites the
exported graph of a CPU float model the way the CPU runtimes users compare it with do
(AOTInductor's freezing passes, ONNX Runtime, OpenVINO, XNNPACK), and its results are close to
eager's instead of equal:

- PT2E's int8 patterns (a convolution or linear of dequantized uint8 activations and int8
  weights, the activation after it, the quantize after that) through oneDNN's int8 kernels on
  weights packed once (Note [PT2E's int8 kernels] in quantized.py);
- batch norm (eval) folded into the convolution before it (torch.nn.utils.fusion's
  fuse_conv_bn_weights: scale the weight, shift the bias);
- convolutions through the fastest of eager's op, oneDNN on a weight reordered once
  (mkldnn::_convolution_pointwise, as Inductor's CPU freezing packs them, the unary op after it
  (hardswish, sigmoid, tanh, silu, gelu, leaky_relu: not relu, hardtanh or hardsigmoid, whose
  oneDNN forms turn a NaN into a number) fused as its post-op; its results channels-last, and
  they stay so through the ops between convolutions)
  and, for one group, torchreplay's conv_gemm (the small GEMM of the weight by the input's
  patches, read in place, relu, hardswish or hardsigmoid fused; its results channels-last where
  a depthwise or 1x1 convolution reads them, else contiguous),
  timed at capture;
- 1x1 convolutions (stride 1, no padding, one group) on a channels-last input as the GEMM they
  are, addmm over the pixels (MKL), without oneDNN's per-call cost; depthwise convolutions
  through torchreplay's direct kernel (torchreplay::depthwise_conv2d, Note [Depthwise
  convolutions] in capture/kernels/depthwise_kernel.h) with relu, hardswish or hardsigmoid fused;
- products by a weight known at capture (linear layers at batch 1, a recurrent cell's
  projections, the 1x1 convolutions above) through torchreplay's small GEMM
  (torchreplay::small_gemm, Note [Small GEMMs] in capture/kernels/small_gemm.h) on the weight stored [K, N]
  once, or packed in panels of 64 columns if it is large, a relu, hardswish or hardsigmoid after
  it fused (after a 1x1 convolution's views of it too), or, of any size, through oneDNN's
  linear on the weight packed once (mkldnn::_linear_pointwise, an activation after it or after
  a view of it fused), where one of those is faster than the addmm (timed at capture); else
  linear layers of at most 16 rows with a large
  weight read from a transposed copy stored contiguous once;
- the spatial mean of a channels-last image of one sample (squeeze-and-excitation's pooling) as
  the small GEMM of a row of 1 / (H * W) by its pixels, read in place, where that timed faster
  than eager's mean;
- a per-channel scale of such an image (squeeze-and-excitation's) read only by a 1x1 convolution
  through the small GEMM, folded into that product (torchreplay::small_gemm_scaled, the same
  rounded products without the elementwise step);
- a GRU layer as one call, torchreplay::gru_sequence (Note [GRU steps] in capture/kernels/recurrent.h: the
  input projections one small GEMM, then each step's hidden product and gates in the same call);
  LSTM and RNN through export's decomposition (products and pointwise ops, which the tape fuses)
  instead of the whole op.

Channels-last results are made contiguous again only where an op could see the layout: before a
`view` (unless the two layouts coincide) and at the graph's outputs (eager's strides).

The folded and packed weights are constants of the graph, computed from the parameters at
capture: a parameter or buffer they came from that changes afterwards would not be seen, so the
graph's first step checks their version counters (torchreplay::check_frozen) and raises, saying
to capture again. A write that leaves the counter where it was (a fused optimizer,
torch.optim.Adam(fused=True); a write through .data) is not seen: capture again after one. Convolutions with symbolic sizes (dynamic=True) keep eager's op (their batch
norms are still folded). The rewrite is checked at capture by running both graphs on the example
inputs: if the rewritten one fails, the capture keeps the bitwise graph and logs why; otherwise
the largest absolute and relative differences are kept (Captured.numerics). Every node whose
kernel the rewrite chose is listed in Captured.numerics["choices"] by node name, with the way it
took and the microseconds of each way timed at capture; `Captured.profile` gives each such step's
choice beside its replay time, and the graph dump (config.debug.graph_dump) lists them.

The rewrite is a package around one state object, `state.Rewrite` (the graph, what was folded
and must be guarded, which results may be channels-last, the counts and choices); each module
is a family of rewrites taking it, in the order `rewrite` runs them: convolutions.py (batch
norms folded first; PT2E's int8 convolutions decided on the way, quantized.py), quantized.py's
linears, products.py, recurrent.py, images.py, layouts.py, then quantized.py's quantize pairs;
kernels.py holds what they share.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx

from .convolutions import fold_batch_norms, rewrite_convolutions
from .images import fold_channel_scales, rewrite_spatial_means
from .layouts import restore_layouts
from .products import rewrite_linears
from .quantized import dequantize_weights_once, fake_quantize_pairs, rewrite_quantized_linears
from .recurrent import rewrite_grus
from .state import Rewrite

NUMERICS = ("bitwise", "close")


def rewrite(gm: torch.fx.GraphModule, bound: Sequence[Any], names: Sequence[str],
            dynamic: bool) -> Tuple[Dict[str, int], Dict[str, Dict[str, Any]]]:
    """Note [Close numerics]: rewrites `gm` (an exported graph whose first placeholders are the
    `bound` tensors, which errors call `names`) in place; returns what it did (the counts) and
    the choices it made, by node name (Rewrite.choices)."""
    r = Rewrite(gm, bound, names)
    fold_batch_norms(r)
    if not dynamic:
        rewrite_convolutions(r)  # (PT2E's int8 convolutions among them)
        rewrite_quantized_linears(r)
        rewrite_linears(r)
        rewrite_grus(r)
        rewrite_spatial_means(r)
        fold_channel_scales(r)
        restore_layouts(r)
        fake_quantize_pairs(r)  # (elementwise: the layouts stay as restore_layouts left them)
    dequantize_weights_once(r)  # (those the int8 rewrites left)
    r.guard()
    gm.graph.eliminate_dead_code()
    used = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    for name in [b for b, _ in gm.named_buffers() if b.startswith("_close_") and b not in used]:
        delattr(gm, name)  # a constant a later rewrite replaced (a 1x1 convolution's GEMM weight)
    gm.graph.lint()
    gm.recompile()
    return r.counts, r.choices_by_name()


def choice_text(choice: Dict[str, Any]) -> str:
    """One choice of Rewrite.choices in words: "onednn (onednn 41.2 µs, gemm 55.0 µs, eager 60.1 µs)",
    fastest first; "depthwise (not timed)" for a kernel taken without timing."""
    times = sorted(choice["times"].items(), key=lambda kv: kv[1])
    return f"{choice['chose']} ({', '.join(f'{way} {us:.1f} µs' for way, us in times) or 'not timed'})"


def folded(gm: torch.fx.GraphModule, bound: Sequence[Any]) -> List[torch.Tensor]:
    """The bound tensors the rewritten `gm` folded into its constants (check_frozen's)."""
    placeholders = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    check = next((n for n in gm.graph.nodes if n.target is torch.ops.torchreplay.check_frozen.default), None)
    if check is None:
        return []
    return [bound[placeholders[n]] for n in check.args[0] if placeholders.get(n, len(bound)) < len(bound)]


def fold_bitwise(gm: torch.fx.GraphModule, bound: Sequence[Any], names: Sequence[str]) -> Dict[str, int]:
    """What numerics "bitwise" folds: Note [PT2E's weights dequantized once], guarded as the
    close rewrite's folds are; returns the counts of what it folded (none: `gm` as it was)."""
    r = Rewrite(gm, bound, names)
    dequantize_weights_once(r)
    folded_counts = {k: v for k, v in r.counts.items() if v}
    if folded_counts:
        r.guard(every_call=True)
        gm.graph.lint()
        gm.recompile()
    return folded_counts


def layout_difference(got: Any, want: Any) -> Optional[str]:
    """Where the rewritten graph's outputs differ from the bitwise graph's other than in values:
    structure, shape, dtype, strides, or which outputs share memory; None where they do not."""
    from torch.utils import _pytree as pytree
    g_leaves, g_spec = pytree.tree_flatten(got)
    w_leaves, w_spec = pytree.tree_flatten(want)
    if g_spec != w_spec:
        return f"outputs of another structure ({g_spec} where eager's are {w_spec})"
    tensors = [(i, g, w) for i, (g, w) in enumerate(zip(g_leaves, w_leaves)) if isinstance(w, torch.Tensor)]
    for i, g, w in tensors:
        if not isinstance(g, torch.Tensor) or (g.shape, g.dtype, g.stride()) != (w.shape, w.dtype, w.stride()):
            what = (tuple(g.shape), g.dtype, g.stride()) if isinstance(g, torch.Tensor) else type(g).__name__
            return f"output {i} is {what} where eager's is {(tuple(w.shape), w.dtype, w.stride())}"

    def shared(t: torch.Tensor, u: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() == u.untyped_storage().data_ptr() and t.numel() > 0 and u.numel() > 0
    for k, (i, g, w) in enumerate(tensors):
        for j, g2, w2 in tensors[k + 1:]:
            if shared(g, g2) != shared(w, w2):
                return f"outputs {i} and {j} {'share' if shared(g, g2) else 'do not share'} memory where eager's " \
                       f"{'do' if shared(w, w2) else 'do not'}"
    return None


def difference(got: Any, want: Any) -> Dict[str, float]:
    """The largest absolute and relative (|got - want| / |want|, where want is not 0) differences
    over the floating tensors of two outputs, NaNs where both agree ignored, and the signal to
    noise ratio of all of them in dB (what quantized models are judged by; inf where equal)."""
    from torch.utils import _pytree as pytree
    abs_err = rel_err = signal = noise = 0.0
    for g, w in zip(pytree.tree_leaves(got), pytree.tree_leaves(want)):
        if not (isinstance(g, torch.Tensor) and isinstance(w, torch.Tensor) and w.is_floating_point()):
            continue
        g, w = g.detach().double(), w.detach().double()
        same = (g == w) | (torch.isnan(g) & torch.isnan(w))
        d = torch.where(same, torch.zeros_like(g), (g - w).abs())
        if d.numel():
            abs_err = max(abs_err, float(d.max()))
            signal += float(w[~torch.isnan(w)].pow(2).sum())
            noise += float(d.pow(2).sum())
            nz = w != 0
            if bool(nz.any()):
                rel_err = max(rel_err, float((d[nz] / w[nz].abs()).max()))
    sqnr = math.inf if noise == 0 else 10 * math.log10(signal / noise) if signal > 0 else -math.inf
    return {"max_abs_err": abs_err, "max_rel_err": rel_err, "sqnr_db": sqnr}
