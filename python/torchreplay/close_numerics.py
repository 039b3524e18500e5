"""The graph rewrite of `config.reduce_overhead.numerics = "close"` (Note [Close numerics]).

Note [Close numerics]
By default a replay computes eager's bits. With numerics "close", torchreplay.capture rewrites the
exported graph of a CPU float model the way the CPU runtimes users compare it with do
(AOTInductor's freezing passes, ONNX Runtime, OpenVINO, XNNPACK), and its results are close to
eager's instead of equal:

- batch norm (eval) folded into the convolution before it (torch.nn.utils.fusion's
  fuse_conv_bn_weights: scale the weight, shift the bias);
- convolutions through the fastest of eager's op, oneDNN on a weight reordered once
  (mkldnn::_convolution_pointwise, as Inductor's CPU freezing packs them, the unary op after it
  (relu, hardswish, hardsigmoid, sigmoid, tanh, silu, gelu, leaky_relu, hardtanh) fused as its
  post-op; its results channels-last, and they stay so through the ops between convolutions)
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
  it fused (after a 1x1 convolution's views of it too), where that is faster than the addmm
  (timed at capture); else linear layers of at most 16 rows with a large
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
the largest absolute and relative differences are kept (Captured.numerics).

Over 600 lines in one module: one rewriter, whose rewrites share what the walk learns (which
results may be channels-last, which parameters were folded, the counts and timings); split, each
part would take that state whole.
"""
from __future__ import annotations

import functools
import logging
import operator
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx
from torch.nn.utils.fusion import fuse_conv_bn_weights

from .fx_views import is_view

aten = torch.ops.aten
logger = logging.getLogger("torchreplay")

NUMERICS = ("bitwise", "close")

# aten op after a convolution -> oneDNN's post-op (attr, scalars from the op's args, algorithm)
_UNARY = {
    aten.relu.default: lambda n: ("relu", [], ""),
    aten.hardswish.default: lambda n: ("hardswish", [], ""),
    aten.hardsigmoid.default: lambda n: ("hardsigmoid", [], ""),
    aten.sigmoid.default: lambda n: ("sigmoid", [], ""),
    aten.tanh.default: lambda n: ("tanh", [], ""),
    aten.silu.default: lambda n: ("swish", [], ""),
    aten.gelu.default: lambda n: ("gelu", [], n.kwargs.get("approximate", n.args[1] if len(n.args) > 1 else "none")),
    aten.leaky_relu.default: lambda n: ("leaky_relu", [n.args[1] if len(n.args) > 1 else 0.01], ""),
    aten.hardtanh.default: lambda n: ("hardtanh", [n.args[1] if len(n.args) > 1 else -1.0,
                                                   n.args[2] if len(n.args) > 2 else 1.0], ""),
}
# views that need their input's strides to be viewable
_STRIDE_SENSITIVE = {aten.view.default, aten._unsafe_view.default, aten.as_strided.default}
# The activations torchreplay's kernels apply before storing (post_op, capture/kernels/post_op.h).
_POST_OPS = {aten.relu.default: "relu", aten.hardswish.default: "hardswish",
             aten.hardsigmoid.default: "hardsigmoid"}


def _post_of(node: torch.fx.Node) -> Optional[torch.fx.Node]:
    """`node`'s one reader if that is an activation of _POST_OPS on it (fused into the kernel
    that computes `node`), else None."""
    post = next(iter(node.users)) if len(node.users) == 1 else None
    if post is None or post.op != "call_function" or post.target not in _POST_OPS or post.args[0] is not node:
        return None
    return post


class _Rewriter:
    def __init__(self, gm: torch.fx.GraphModule, bound: Sequence[Any], names: Sequence[str]) -> None:
        self.gm, self.graph = gm, gm.graph
        placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        self.value: Dict[torch.fx.Node, torch.Tensor] = {
            p: t for p, t in zip(placeholders, bound) if isinstance(t, torch.Tensor)}
        self.names: Dict[torch.fx.Node, str] = dict(zip(placeholders, names))
        self.frozen: Dict[torch.fx.Node, torch.Tensor] = {}  # placeholders folded into constants
        self.counts: Dict[str, int] = {"batch_norms_folded": 0, "convolutions_onednn": 0, "convolutions_gemm": 0,
                                       "convolutions_depthwise": 0, "convolutions_small_gemm": 0, "post_ops_fused": 0,
                                       "layout_copies": 0, "linears_transposed_once": 0, "linears_small_gemm": 0,
                                       "convolutions_eager": 0, "grus_fused": 0, "results_channels_last": 0,
                                       "means_small_gemm": 0, "scales_folded": 0}
        self.channels_last: set = set()  # results that may be channels-last where eager's are not
        self.contiguous: set = set()  # results made contiguous where eager's may be channels-last
        # (input sizes, weight sizes, {way: us}) of each timed convolution and product
        self.timings: List[Tuple[Any, ...]] = []
        self._names = 0

    def tensor(self, node: Any) -> Optional[torch.Tensor]:
        """The value of a placeholder bound to a parameter, buffer or constant, or of a get_attr."""
        if not isinstance(node, torch.fx.Node):
            return None
        if node.op == "get_attr":
            v = getattr(self.gm, node.target, None)
            return v if isinstance(v, torch.Tensor) else None
        return self.value.get(node)

    def constant(self, t: torch.Tensor, hint: str) -> torch.fx.Node:
        name = f"_close_{hint}_{self._names}"
        self._names += 1
        self.gm.register_buffer(name, t, persistent=False)
        return self.graph.get_attr(name)

    def freeze(self, *nodes: Any) -> None:
        for n in nodes:
            if isinstance(n, torch.fx.Node) and n.op == "placeholder" and n in self.value:
                self.frozen[n] = self.value[n]

    # -- batch norm folding -------------------------------------------------------------------
    def fold_batch_norms(self) -> None:
        for bn in list(self.graph.nodes):
            if bn.op != "call_function" or bn.target != aten._native_batch_norm_legit_no_training.default:
                continue
            conv = bn.args[0]
            if not (isinstance(conv, torch.fx.Node) and conv.target == aten.convolution.default and
                    len(conv.users) == 1 and not conv.args[6]):
                continue
            users = list(bn.users)
            if not all(u.target == operator.getitem and u.args[1] == 0 for u in users):
                continue
            w, b = self.tensor(conv.args[1]), self.tensor(conv.args[2]) if conv.args[2] is not None else None
            gamma, beta, mean, var = (self.tensor(a) for a in bn.args[1:5])
            if w is None or mean is None or var is None or (conv.args[2] is not None and b is None) or \
                    (bn.args[1] is not None and gamma is None) or (bn.args[2] is not None and beta is None) or \
                    w.dtype not in (torch.float32, torch.float64):
                continue
            with torch.no_grad():
                fw, fb = fuse_conv_bn_weights(w, b, mean, var, bn.args[6], gamma, beta)
            self.freeze(conv.args[1], conv.args[2], *bn.args[1:5])
            with self.graph.inserting_before(conv):
                args = list(conv.args)
                args[1] = self.constant(fw.detach(), "weight")
                args[2] = self.constant(fb.detach(), "bias")
                folded = self.graph.call_function(aten.convolution.default, tuple(args))
                folded.meta.update(conv.meta)
            for u in users:
                u.replace_all_uses_with(folded)
                self.graph.erase_node(u)
            self.graph.erase_node(bn)
            self.graph.erase_node(conv)
            self.counts["batch_norms_folded"] += 1

    # -- convolutions ---------------------------------------------------------------------------
    def rewrite_convolutions(self) -> None:
        """In graph order, so that a 1x1 convolution knows whether its input is channels-last:
        what a rewritten convolution gives, and what is computed from it by ops that keep the
        layout, is (restore_layouts makes it contiguous where it must be)."""
        erased: set = set()
        for conv in list(self.graph.nodes):
            if conv in erased or conv.op != "call_function":
                continue
            if conv.target != aten.convolution.default:
                for layout in (self.channels_last, self.contiguous):
                    if conv.target not in _STRIDE_SENSITIVE and any(a in layout for a in conv.all_input_nodes):
                        layout.add(conv)
                continue
            x, wn, bn, stride, padding, dilation, transposed, _output_padding, groups = conv.args
            w = self.tensor(wn)
            b = self.tensor(bn) if bn is not None else None
            val = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
            if transposed or w is None or (bn is not None and b is None) or val is None or \
                    val.dtype != torch.float32 or w.dtype != torch.float32 or val.device.type != "cpu" or \
                    val.dim() not in (3, 4) or not all(isinstance(s, int) for s in val.shape):
                continue
            one_d = val.dim() == 3
            if not one_d and groups == 1 and w.shape[2:] == (1, 1) and list(stride) == [1, 1] and \
                    list(padding) == [0, 0] and (x in self.channels_last or val.shape[2] * val.shape[3] == 1):
                self.freeze(wn, bn)
                self._as_gemm(conv, x, w, b, val.shape)
            elif not one_d and groups > 1 and w.shape[0] == groups and w.shape[1] == 1 and val.shape[1] == groups \
                    and _depthwise_available():
                self.freeze(wn, bn)
                post = self._depthwise(conv, x, w, b, stride, padding, dilation)
                if post is not None:
                    erased.add(post)
            elif (way := self._fastest(x, w, b, stride, padding, dilation, groups, val, one_d)) != "eager":
                self.freeze(wn, bn)
                if way == "gemm":
                    post = self._through_gemm(conv, x, w, b, stride, padding, dilation)
                else:
                    post = self._through_onednn(conv, x, w, b, stride, padding, dilation, groups, val.shape, one_d)
                if post is not None:
                    erased.add(post)
            else:  # eager's op (which the tape may run through a checked faster call)
                self.counts["convolutions_eager"] += 1
                if x in self.channels_last and not _within_reach(padding, w.shape[2:], dilation):
                    self._contiguous_input(conv, x)  # (eager's oneDNN path crashes there on channels-last)
                elif x in self.channels_last:
                    self.channels_last.add(conv)

    def _as_gemm(self, conv: torch.fx.Node, x: torch.fx.Node, w: torch.Tensor, b: Optional[torch.Tensor],
                 shape: Sequence[int]) -> None:
        n, c, h, wd = shape
        cout = w.shape[0]
        kn = w.detach().reshape(cout, c).t().contiguous()
        with self.graph.inserting_before(conv):
            wt = self.constant(kn, "weight_t")
            rows = self.graph.call_function(aten.view.default, (
                self.graph.call_function(aten.permute.default, (x, [0, 2, 3, 1])), [n * h * wd, c]))
            if b is not None:
                mm = self.graph.call_function(aten.addmm.default, (self.constant(b.detach(), "bias"), rows, wt))
            else:
                mm = self.graph.call_function(aten.mm.default, (rows, wt))
            view = self.graph.call_function(aten.view.default, (mm, [n, h, wd, cout]))
            out = self.graph.call_function(aten.permute.default, (view, [0, 3, 1, 2]))
        out.meta["val"] = conv.meta.get("val")  # its sizes, for the rewrites after it
        conv.replace_all_uses_with(out)
        self.graph.erase_node(conv)
        self._small_gemm(mm, rows, wt, kn, n * h * wd, through=out)  # or MKL's addmm, whichever timed faster
        self.channels_last.add(out)
        self.counts["convolutions_gemm"] += 1

    def _depthwise(self, conv: torch.fx.Node, x: torch.fx.Node, w: torch.Tensor, b: Optional[torch.Tensor],
                   stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int]) -> Optional[torch.fx.Node]:
        """A depthwise convolution through torchreplay's direct kernel (Note [Depthwise
        convolutions] in capture/kernels/depthwise_kernel.h), an activation of _POST_OPS after it fused;
        returns the node fused into it."""
        post = _post_of(conv)
        c, kh, kw = w.shape[0], w.shape[2], w.shape[3]
        with self.graph.inserting_before(conv):
            weight = w.detach().contiguous()
            out = self.graph.call_function(torch.ops.torchreplay.depthwise_conv2d.default, (
                x, self.constant(weight, "weight"), self.constant(weight.view(c, kh, kw).permute(1, 2, 0).contiguous(),
                                                                 "weight_hwc"),
                self.constant(b.detach(), "bias") if b is not None else None, list(stride), list(padding),
                list(dilation), _POST_OPS[post.target] if post is not None else "none"))
        return self._replace_convolution(conv, post, out, "convolutions_depthwise")

    def _fastest(self, x: torch.fx.Node, w: torch.Tensor, b: Optional[torch.Tensor], stride: Sequence[int],
                 padding: Sequence[int], dilation: Sequence[int], groups: int, val: torch.Tensor,
                 one_d: bool) -> str:
        """Which of eager's op, oneDNN on a packed weight and (one group) torchreplay's conv_gemm
        is fastest for this convolution ("eager", "onednn", "gemm"), timed on a random input of its
        sizes and layout (oneDNN's per-call cost exceeds a small im2col GEMM's: the harness's
        convnet ran slower through it)."""
        within_reach = _within_reach(padding, w.shape[2:], dilation)
        layout = torch.channels_last if x in self.channels_last and not one_d and within_reach else \
            torch.contiguous_format
        inp = torch.randn(tuple(val.shape)).contiguous(memory_format=layout)
        w4, st, pd, dl, x4 = w.detach(), list(stride), list(padding), list(dilation), inp
        if one_d:
            w4, st, pd, dl, x4 = w4.unsqueeze(2), [1] + st, [0] + pd, [1] + dl, inp.unsqueeze(2)
        packed = torch._C._nn.mkldnn_reorder_conv2d_weight(w4.contiguous().to_mkldnn(), pd, st, dl, groups,
                                                          list(x4.shape))
        bias = b.detach() if b is not None else None
        ways = {"eager": lambda: aten.convolution.default(inp, w, bias, list(stride), list(padding), list(dilation),
                                                          False, [0] * len(stride), groups)}
        if within_reach:
            ways["onednn"] = lambda: torch.ops.mkldnn._convolution_pointwise.default(x4, packed, bias, pd, st, dl,
                                                                                     groups, "none", [], "")
        if groups == 1 and _small_gemm_available() and inp.numel() > 0:
            rows = w.detach().reshape(w.shape[0], -1).contiguous()
            zeros = bias if bias is not None else torch.zeros(w.shape[0])
            ways["gemm"] = lambda: torch.ops.torchreplay.conv_gemm.default(
                inp, rows, zeros, list(w.shape[2:]), list(stride), list(padding), list(dilation), "none")
        with torch.no_grad():
            t = dict(zip(ways, _least_times(list(ways.values()))))
        self.timings.append((tuple(val.shape), tuple(w.shape), t))
        return min(t, key=t.get)

    def _contiguous_input(self, conv: torch.fx.Node, x: torch.fx.Node) -> None:
        with self.graph.inserting_before(conv):
            c = self.graph.call_function(aten.clone.default, (x,), {"memory_format": torch.contiguous_format})
        conv.replace_input_with(x, c)
        self.counts["layout_copies"] += 1

    def _through_gemm(self, conv: torch.fx.Node, x: torch.fx.Node, w: torch.Tensor, b: Optional[torch.Tensor],
                      stride: Sequence[int], padding: Sequence[int],
                      dilation: Sequence[int]) -> Optional[torch.fx.Node]:
        """The convolution as torchreplay::conv_gemm (the weight as rows, stored once), an
        activation of _POST_OPS reading only it fused; returns the node fused into it. Its result is
        channels-last (whatever its input's layout) where a depthwise or 1x1 convolution reads it
        (through ops that keep the layout): those read channels-last as it lies (mobilenet's stem:
        its first depthwise and 1x1 convolutions took 35 and 28 us on a contiguous input, 16 and 4
        channels-last); else contiguous, where the GEMM's rows are the output channels (eight
        output channels as rows of pixels fill half an AVX-512 vector)."""
        post = _post_of(conv)
        channels_last = len(w.shape) == 4 and self._read_channels_last(conv)
        self.counts["results_channels_last"] += channels_last
        with self.graph.inserting_before(conv):
            out = self.graph.call_function(torch.ops.torchreplay.conv_gemm.default, (
                x, self.constant(w.detach().reshape(w.shape[0], -1).contiguous(), "weight_rows"),
                self.constant(b.detach() if b is not None else torch.zeros(w.shape[0]), "bias"),
                list(w.shape[2:]), list(stride), list(padding), list(dilation),
                _POST_OPS[post.target] if post is not None else "none", channels_last))
        return self._replace_convolution(conv, post, out, "convolutions_small_gemm", contiguous=not channels_last)

    def _read_channels_last(self, node: torch.fx.Node) -> bool:
        """Whether a convolution that reads a channels-last input as it lies (a depthwise one, or a
        1x1 of stride 1 without padding: rewrite_convolutions' _depthwise and _as_gemm) reads
        `node`'s result, directly or through ops that keep the layout."""
        seen, todo = set(), list(node.users)
        while todo:
            user = todo.pop()
            if user in seen or user.op != "call_function" or user.target in _STRIDE_SENSITIVE:
                continue
            seen.add(user)
            if user.target != aten.convolution.default:
                todo.extend(user.users)
                continue
            w = self.tensor(user.args[1])
            stride, padding, groups = user.args[3], user.args[4], user.args[8]
            if w is not None and w.dim() == 4 and user.args[0] in seen | {node} and (
                    (groups > 1 and w.shape[0] == groups and w.shape[1] == 1) or
                    (groups == 1 and w.shape[2:] == (1, 1) and list(stride) == [1, 1] and list(padding) == [0, 0])):
                return True
        return False

    def _through_onednn(self, conv: torch.fx.Node, x: torch.fx.Node, w: torch.Tensor, b: Optional[torch.Tensor],
                        stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int], groups: int,
                        shape: Sequence[int], one_d: bool) -> Optional[torch.fx.Node]:
        """The convolution as oneDNN's, its weight packed; returns the unary node fused into it."""
        stride, padding, dilation = list(stride), list(padding), list(dilation)
        w4 = w.detach()
        in_shape = list(shape)
        if one_d:  # as a 2-d convolution over a dim of size 1, as eager's _convolution does
            stride, padding, dilation = [1] + stride, [0] + padding, [1] + dilation
            w4 = w4.unsqueeze(2)
            in_shape.insert(2, 1)
        packed = torch._C._nn.mkldnn_reorder_conv2d_weight(w4.contiguous().to_mkldnn(), padding, stride, dilation,
                                                          groups, in_shape)
        attr: Tuple[str, List[Any], str] = ("none", [], "")
        post = next(iter(conv.users)) if len(conv.users) == 1 else None
        if post is not None and post.op == "call_function" and post.target in _UNARY and post.args[0] is conv:
            attr = _UNARY[post.target](post)
        else:
            post = None
        with self.graph.inserting_before(conv):
            xin = self.graph.call_function(aten.unsqueeze.default, (x, 2)) if one_d else x
            bias = self.constant(b.detach(), "bias") if b is not None else None
            out = self.graph.call_function(torch.ops.mkldnn._convolution_pointwise.default, (
                xin, self.constant(packed, "packed"), bias, padding, stride, dilation, groups, attr[0], attr[1],
                attr[2]))
            if one_d:
                out = self.graph.call_function(aten.squeeze.dim, (out, 2))
        return self._replace_convolution(conv, post, out, "convolutions_onednn")

    def _replace_convolution(self, conv: torch.fx.Node, post: Optional[torch.fx.Node], out: torch.fx.Node,
                             count: str, contiguous: bool = False) -> Optional[torch.fx.Node]:
        """`out` in place of `conv` and of the activation `post` it fused (if any); returns `post`.
        Unless `contiguous`, `out` may be channels-last."""
        out.meta["val"] = conv.meta.get("val")  # its sizes, for the rewrites after it
        (post or conv).replace_all_uses_with(out)
        if post is not None:
            self.graph.erase_node(post)
            self.counts["post_ops_fused"] += 1
        self.graph.erase_node(conv)
        (self.contiguous if contiguous else self.channels_last).add(out)
        self.counts[count] += 1
        return post

    # -- linear layers --------------------------------------------------------------------------
    def rewrite_linears(self) -> None:
        """A product by a weight known at capture (a linear layer at batch 1, a recurrent cell's
        projections) through the small GEMM (_small_gemm) where that timed faster than the
        addmm at capture (MKL's set-up exceeds the arithmetic of a few rows; the 1x1
        convolutions' GEMMs were timed when made). Else a GEMV whose weight is 128 KB or more
        reads it from a transposed copy stored contiguous once (MKL streams it: on the zoo's
        classifier, 133 to 76 us a call, the weight not in cache); smaller weights stay in cache
        either way."""
        for node in list(self.graph.nodes):
            if node.op != "call_function" or node.target not in (aten.addmm.default, aten.mm.default) or \
                    len(node.args) != (3 if node.target == aten.addmm.default else 2) or node.kwargs:
                continue
            x, mat2 = node.args[-2:]
            val = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
            if val is None or val.dim() != 2 or val.dtype != torch.float32 or val.device.type != "cpu" or \
                    not all(isinstance(s, int) for s in val.shape) or not isinstance(mat2, torch.fx.Node):
                continue
            transposed = mat2.target == aten.t.default or \
                (mat2.target == aten.permute.default and list(mat2.args[1]) == [1, 0])
            source = mat2.args[0] if transposed else mat2
            w = self.tensor(source)
            if w is None or w.dim() != 2 or w.dtype != torch.float32 or w.device.type != "cpu":
                continue
            kn = (w.t() if transposed else w).detach()
            if self._small_gemm(node, x, source, kn, val.shape[0]):
                continue
            if not transposed or val.shape[0] > 16 or w.numel() * 4 < (128 << 10):
                continue
            self.freeze(source)
            with self.graph.inserting_before(node):
                wt = self.constant(kn.contiguous(), "weight_t")
            node.replace_input_with(mat2, wt)
            self.counts["linears_transposed_once"] += 1

    def _small_gemm(self, node: torch.fx.Node, x: torch.fx.Node, source: torch.fx.Node, kn: torch.Tensor,
                    rows: int, through: Optional[torch.fx.Node] = None) -> bool:
        """`node` (addmm or mm of `x` by the weight `kn`, [K, N], read from `source`) through the
        small GEMM if its bias is a vector and that timed faster, on the weight as it is or, if it
        is large, packed in panels of 64 columns (whichever timed fastest), an activation of
        _POST_OPS reading it (or `through`, the views of it a 1x1 convolution's result is) fused;
        returns whether it was rewritten."""
        bias = node.args[0] if node.target == aten.addmm.default else None
        n = kn.shape[1]
        if bias is not None:
            b = self.tensor(bias)
            bval = b if b is not None else bias.meta.get("val") if isinstance(bias, torch.fx.Node) else None
            if not isinstance(bval, torch.Tensor) or tuple(bval.shape) != (n,) or bval.dtype != torch.float32:
                return False
        if rows * kn.shape[0] * n > (1 << 23) or not _small_gemm_available():
            return False  # (products this large are where MKL's kernels are at their best)
        inp, vec, out = torch.randn(rows, kn.shape[0]), torch.randn(n), torch.empty(rows, n)
        weights = {"dense": kn.contiguous()}
        if kn.numel() * 4 >= (128 << 10):  # out of the core's caches: streamed, panel by panel
            weights["panels"] = _panels(kn, 64)
        ways = {"addmm": (lambda: aten.addmm.out(vec, inp, kn, out=out)) if bias is not None else
                (lambda: aten.mm.out(inp, kn, out=out))}
        for name, w in weights.items():
            ways[name] = functools.partial(torch.ops.torchreplay.small_gemm.out, inp, w, vec, "none", out=out)
        with torch.no_grad():
            t = dict(zip(ways, _least_times(list(ways.values()), rounds=15)))
        self.timings.append(((rows, kn.shape[0]), tuple(kn.shape), t))
        way = min(t, key=t.get)
        if way == "addmm":
            return False
        post = _post_of(through if through is not None else node)
        self.freeze(source)
        with self.graph.inserting_before(node):
            if bias is None:
                bias = self.constant(torch.zeros(n), "bias")
            out_node = self.graph.call_function(torch.ops.torchreplay.small_gemm.default, (
                x, self.constant(weights[way], "weight_kn"), bias, _POST_OPS[post.target] if post is not None else "none"))
        out_node.meta["val"] = node.meta.get("val")
        if post is not None:  # (elementwise: the same before the views `through` takes)
            post.replace_all_uses_with(post.args[0])
            self.graph.erase_node(post)
            self.counts["post_ops_fused"] += 1
        node.replace_all_uses_with(out_node)
        self.graph.erase_node(node)
        self.counts["linears_small_gemm"] += 1
        return True

    def rewrite_spatial_means(self) -> None:
        """A mean over the spatial dims of a 4-d image of one sample (squeeze-and-excitation's
        pooling) as the small GEMM of a row of 1 / (H * W) by the image's pixels, [H * W, C]: a
        view of a channels-last result, read in place (a copy of any other), where that timed
        faster than eager's mean."""
        for node in list(self.graph.nodes):
            if node.op != "call_function" or node.target != aten.mean.dim or len(node.args) != 3 or node.kwargs:
                continue
            x, dims, keepdim = node.args
            val = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
            if val is None or val.dim() != 4 or val.dtype != torch.float32 or val.device.type != "cpu" or \
                    not all(isinstance(s, int) for s in val.shape) or val.shape[0] != 1 or not keepdim or \
                    sorted(d % 4 for d in dims) != [2, 3] or x not in self.channels_last or \
                    not _small_gemm_available():
                continue
            c, hw = val.shape[1], val.shape[2] * val.shape[3]
            if not self._mean_faster(c, val.shape[2], val.shape[3]):
                continue
            row, zeros = torch.full((1, hw), 1.0 / hw), torch.zeros(c)
            with self.graph.inserting_before(node):
                permuted = self.graph.call_function(aten.permute.default, (x, [0, 2, 3, 1]))
                flat = self.graph.call_function(aten.reshape.default, (permuted, [hw, c]))
                mean = self.graph.call_function(torch.ops.torchreplay.small_gemm.default, (
                    self.constant(row, "mean_row"), flat, self.constant(zeros, "bias"), "none"))
                view = self.graph.call_function(aten.view.default, (mean, [1, c, 1, 1]))
            view.meta["val"] = node.meta.get("val")
            node.replace_all_uses_with(view)
            self.graph.erase_node(node)
            self.counts["means_small_gemm"] += 1

    def fold_channel_scales(self) -> None:
        """A per-channel scale of an image of one sample (squeeze-and-excitation's x * s, s [1, C,
        1, 1]) read only by a 1x1 convolution through the small GEMM moves into that product
        (torchreplay::small_gemm_scaled: the same products, each rounded as the multiply rounds
        it, without the elementwise step or its result)."""
        for node in list(self.graph.nodes):
            if node.op != "call_function" or node.target != torch.ops.torchreplay.small_gemm.default:
                continue
            rows = node.args[0]
            permuted = rows.args[0] if isinstance(rows, torch.fx.Node) and rows.target == aten.view.default else None
            mul = permuted.args[0] if isinstance(permuted, torch.fx.Node) and \
                permuted.target == aten.permute.default and list(permuted.args[1]) == [0, 2, 3, 1] else None
            if not isinstance(mul, torch.fx.Node) or mul.target != aten.mul.Tensor or \
                    any(len(n.users) != 1 for n in (rows, permuted, mul)):
                continue
            vals = [a.meta.get("val") if isinstance(a, torch.fx.Node) else None for a in mul.args]
            if not all(isinstance(v, torch.Tensor) and v.dim() == 4 and v.dtype == torch.float32 for v in vals):
                continue
            image = next((i for i in (0, 1) if vals[i].shape[0] == 1 and vals[1 - i].shape[2:] == (1, 1) and
                          vals[1 - i].shape[:2] == vals[i].shape[:2] and vals[i].shape[2:] != (1, 1)), None)
            if image is None or not all(isinstance(d, int) for d in vals[image].shape):
                continue
            x, s = mul.args[image], mul.args[1 - image]
            if x not in self.channels_last:
                continue
            with self.graph.inserting_before(node):
                x_rows = self.graph.call_function(aten.view.default, (
                    self.graph.call_function(aten.permute.default, (x, [0, 2, 3, 1])), rows.args[1]))
                scale = self.graph.call_function(aten.view.default, (s, [vals[image].shape[1]]))
                scaled = self.graph.call_function(torch.ops.torchreplay.small_gemm_scaled.default,
                                                  (x_rows, scale, *node.args[1:]))
            scaled.meta["val"] = node.meta.get("val")
            node.replace_all_uses_with(scaled)
            for n in (node, rows, permuted, mul):
                self.graph.erase_node(n)
            self.counts["scales_folded"] += 1

    def _mean_faster(self, c: int, h: int, w: int) -> bool:
        """Whether the small GEMM's mean of a channels-last [1, c, h, w] timed faster than eager's."""
        row, zeros = torch.full((1, h * w), 1.0 / (h * w)), torch.zeros(c)
        image = torch.randn(1, c, h, w).to(memory_format=torch.channels_last)
        pixels, out = image.permute(0, 2, 3, 1).reshape(h * w, c), torch.empty(1, c)
        with torch.no_grad():
            eager, ours = _least_times([
                lambda: aten.mean.out(image, [2, 3], True, out=out.view(1, c, 1, 1)),
                lambda: torch.ops.torchreplay.small_gemm.out(row, pixels, zeros, "none", out=out)], rounds=15)
        self.timings.append(((1, h * w), (h * w, c), {"mean": eager, "small_gemm": ours}))
        return ours < eager

    # -- recurrent layers ---------------------------------------------------------------------
    def rewrite_grus(self) -> None:
        """A GRU the export kept whole for it (rnn.fused_gru) as torchreplay::gru_sequence, one
        call a layer (Note [GRU steps] in capture/kernels/recurrent.h), on its weights transposed once; h_n
        the layers' last states stacked. A GRU whose weights are not known at capture stays
        eager's op."""
        for node in list(self.graph.nodes):
            if node.op != "call_function" or node.target != torch.ops.torchreplay.eager_gru.input:
                continue
            x, hx, params, has_biases, layers, _dropout, _train, bidirectional, batch_first = node.args
            per = 4 if has_biases else 2
            weights = [self.tensor(p) for p in params]
            vals = node.meta.get("val")
            if bidirectional or len(params) != per * layers or any(w is None for w in weights) or \
                    not isinstance(vals, (tuple, list)) or not all(u.target is operator.getitem for u in node.users):
                continue
            self.freeze(*(params[per * layer + i] for layer in range(layers) for i in (0, 1)))  # the weights
            states = []
            with self.graph.inserting_before(node):
                for layer in range(layers):
                    w_ih, w_hh = weights[per * layer:per * layer + 2]
                    b_ih, b_hh = params[per * layer + 2:per * (layer + 1)] if has_biases else (None, None)
                    h0 = self.graph.call_function(aten.select.int, (hx, 0, layer))
                    h0.meta["val"] = vals[1].select(0, layer)
                    seq = self.graph.call_function(torch.ops.torchreplay.gru_sequence.default, (
                        x, h0, self.constant(w_ih.detach().t().contiguous(), "w_ih_kn"), b_ih,
                        self.constant(w_hh.detach().t().contiguous(), "w_hh_kn"), b_hh, batch_first))
                    seq.meta["val"] = (vals[0], h0.meta["val"])
                    x = self.graph.call_function(operator.getitem, (seq, 0))
                    states.append(self.graph.call_function(operator.getitem, (seq, 1)))
                    x.meta["val"], states[-1].meta["val"] = seq.meta["val"]
                h_n = self.graph.call_function(aten.stack.default, (states, 0))
                h_n.meta["val"] = vals[1]
            for u in list(node.users):
                u.replace_all_uses_with(x if u.args[1] == 0 else h_n)
                self.graph.erase_node(u)
            self.graph.erase_node(node)
            self.counts["grus_fused"] += 1

    # -- layouts --------------------------------------------------------------------------------
    def restore_layouts(self) -> None:
        """Makes what may be channels-last (rewrite_convolutions marked it) contiguous where an op
        could see the layout: once, right after it, for every view of it and the outputs, so that
        outputs that are views of one result lie and share memory as eager's do (convolutions and
        elementwise ops go on reading it as it lies). At the outputs, each result takes eager's
        layout (channels-last where eager's is, from a channels-last input)."""
        for a in list(self.graph.nodes):
            if a not in self.channels_last or not self._layouts_differ(a):
                continue
            readers = [u for u in a.users if (u.op == "output" and not _channels_last(a)) or
                       (u.op == "call_function" and (u.target in _STRIDE_SENSITIVE or self._seen_as_eagers(u)))]
            if not readers:
                continue
            with self.graph.inserting_after(a):
                c = self.graph.call_function(aten.clone.default, (a,), {"memory_format": torch.contiguous_format})
            c.meta.update(a.meta)
            for u in readers:
                u.replace_input_with(a, c)
            self.counts["layout_copies"] += 1
            todo = [u for u in readers if u.op == "call_function"]
            while todo:  # views of the copy lie as eager's
                v = todo.pop()
                if v in self.channels_last and is_view(v):
                    self.channels_last.discard(v)
                    todo.extend(v.users)
        output = next(n for n in self.graph.nodes if n.op == "output")
        for a in list(output.all_input_nodes):
            if a in self.contiguous and _channels_last(a):
                with self.graph.inserting_before(output):
                    c = self.graph.call_function(aten.clone.default, (a,), {"memory_format": torch.channels_last})
                output.replace_input_with(a, c)
                self.counts["layout_copies"] += 1

    def _seen_as_eagers(self, view: torch.fx.Node) -> bool:
        """Whether `view` is a view of the model's graph (marked with its channels-last source, not
        one the rewrite made to feed its own kernels, such as a 1x1 convolution's permute) that an
        output or an op that reads strides (a `view`) reads, directly or through more such views."""
        if view not in self.channels_last or not is_view(view):
            return False
        for u in view.users:
            if u.op == "output" or (u.op == "call_function" and u.target in _STRIDE_SENSITIVE):
                return True
            if u.op == "call_function" and self._seen_as_eagers(u):
                return True
        return False

    @staticmethod
    def _layouts_differ(node: torch.fx.Node) -> bool:
        """Whether a channels-last and a contiguous tensor of this node's sizes lie differently in
        memory (not when the spatial dims are all 1). Unknown sizes: assume they do."""
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            return True
        return not all(isinstance(s, int) and s == 1 for s in val.shape[2:])

    def guard(self) -> None:
        """The first step checks that nothing folded into the graph's constants changed since."""
        if not self.frozen:
            return
        nodes = list(self.frozen)
        versions = [-1 if t.is_inference() else t._version for t in self.frozen.values()]
        # Per-channel vectors (a batch norm's statistics and affine, biases) are also compared with
        # their contents at capture on every call: a train-mode forward updates the statistics
        # without their version counters; their size keeps the comparison a small part of a call.
        # The others' contents are hashed now and compared after a folded parameter was reached
        # through .data (Note [Writes a capture would not see] in patches.py).
        small = [t.dim() <= 1 and t.is_contiguous() for t in self.frozen.values()]
        hashes = [-1] + [0 if s else torch.ops.torchreplay.content_hash(t) for s, t in zip(small, self.frozen.values())]
        first = next(n for n in self.graph.nodes if n.op != "placeholder")
        with self.graph.inserting_before(first):
            empty = self.constant(torch.empty(0), "copy") if not all(small) else None
            copies = [self.constant(t.detach().clone(), "copy") if s else empty for s, t in zip(small, self.frozen.values())]
            self.graph.call_function(torch.ops.torchreplay.check_frozen.default,
                                     (nodes, versions, [self.names.get(n, n.name) for n in nodes], copies,
                                      self.constant(torch.tensor(hashes, dtype=torch.int64), "hashes")))


def _least_times(fns: Sequence[Any], rounds: int = 7) -> List[float]:
    """The least time of each of `fns` in microseconds, over rounds that run every one once."""
    best = [float("inf")] * len(fns)
    for f in fns:
        f()
    for _ in range(rounds):
        for k, f in enumerate(fns):
            t0 = time.perf_counter()
            f()
            best[k] = min(best[k], (time.perf_counter() - t0) * 1e6)
    return best


def _channels_last(node: torch.fx.Node) -> bool:
    """Whether eager's result of `node` (its traced value) is channels-last and not contiguous."""
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dim() == 4 and \
        val.is_contiguous(memory_format=torch.channels_last) and not val.is_contiguous()


def _within_reach(padding: Sequence[int], kernel: Sequence[int], dilation: Sequence[int]) -> bool:
    """Whether no dim's padding exceeds the kernel's reach, (size - 1) * dilation: beyond it
    oneDNN's convolution crashed (capture/tape/checked/conv_steps.cc's PaddingBeyondReach), through its packed
    call and through eager's op on a channels-last input, which therefore never gets one."""
    return all(p <= (k - 1) * d for p, k, d in zip(padding, kernel, dilation))


def _panels(kn: torch.Tensor, panel: int) -> torch.Tensor:
    """A [K, N] weight packed in panels of `panel` columns, [ceil(N / panel), K, panel], the last
    one zero-padded (the small GEMM's Params::panel)."""
    k, n = kn.shape
    padded = kn.new_zeros(k, (n + panel - 1) // panel * panel)
    padded[:, :n] = kn
    return padded.view(k, -1, panel).permute(1, 0, 2).contiguous()


@functools.lru_cache(maxsize=1)
def _small_gemm_available() -> bool:
    """Whether torchreplay's small GEMM runs on this CPU (AVX2 and FMA): a real call, outside any
    trace's modes (rnn.fused_gru asks while torch.export traces)."""
    from torch.utils._python_dispatch import _disable_current_modes
    try:
        with _disable_current_modes():
            torch.ops.torchreplay.small_gemm(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1), "none")
        return True
    except RuntimeError:
        return False


@functools.lru_cache(maxsize=1)
def _depthwise_available() -> bool:
    """Whether torchreplay's depthwise kernel runs on this CPU (AVX2 and FMA)."""
    try:
        x = torch.zeros(1, 1, 1, 1)
        torch.ops.torchreplay.depthwise_conv2d(x, x, x.view(1, 1, 1), None, [1, 1], [0, 0], [1, 1], "none")
        return True
    except RuntimeError:
        return False


def rewrite(gm: torch.fx.GraphModule, bound: Sequence[Any], names: Sequence[str], dynamic: bool) -> Dict[str, int]:
    """Note [Close numerics]: rewrites `gm` (an exported graph whose first placeholders are the
    `bound` tensors, which errors call `names`) in place; returns what it did."""
    r = _Rewriter(gm, bound, names)
    r.fold_batch_norms()
    if not dynamic:
        r.rewrite_convolutions()
        r.rewrite_linears()
        r.rewrite_grus()
        r.rewrite_spatial_means()
        r.fold_channel_scales()
        r.restore_layouts()
    r.guard()
    gm.graph.eliminate_dead_code()
    used = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    for name in [b for b, _ in gm.named_buffers() if b.startswith("_close_") and b not in used]:
        delattr(gm, name)  # a constant a later rewrite replaced (a 1x1 convolution's GEMM weight)
    gm.graph.lint()
    gm.recompile()
    return r.counts


def folded(gm: torch.fx.GraphModule, bound: Sequence[Any]) -> List[torch.Tensor]:
    """The bound tensors the rewritten `gm` folded into its constants (check_frozen's)."""
    placeholders = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    check = next((n for n in gm.graph.nodes if n.target is torch.ops.torchreplay.check_frozen.default), None)
    if check is None:
        return []
    return [bound[placeholders[n]] for n in check.args[0] if placeholders.get(n, len(bound)) < len(bound)]


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
    over the floating tensors of two outputs, NaNs where both agree ignored."""
    from torch.utils import _pytree as pytree
    abs_err = rel_err = 0.0
    for g, w in zip(pytree.tree_leaves(got), pytree.tree_leaves(want)):
        if not (isinstance(g, torch.Tensor) and isinstance(w, torch.Tensor) and w.is_floating_point()):
            continue
        g, w = g.detach().double(), w.detach().double()
        same = (g == w) | (torch.isnan(g) & torch.isnan(w))
        d = torch.where(same, torch.zeros_like(g), (g - w).abs())
        if d.numel():
            abs_err = max(abs_err, float(d.max()))
            nz = w != 0
            if bool(nz.any()):
                rel_err = max(rel_err, float((d[nz] / w[nz].abs()).max()))
    return {"max_abs_err": abs_err, "max_rel_err": rel_err}
