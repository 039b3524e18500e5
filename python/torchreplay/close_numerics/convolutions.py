"""Note [Close numerics]'s convolutions: batch norms folded, then each convolution through the
fastest of eager's op, oneDNN on a packed weight, conv_gemm, the depthwise kernel, or a 1x1
convolution as its GEMM."""
from __future__ import annotations

import operator
from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.fx
from torch.nn.utils.fusion import fuse_conv_bn_weights

from .kernels import POST_OPS, STRIDE_SENSITIVE, UNARY_KEEPING_NAN, conv_times, own_kernel, post_of, within_reach
from .products import fastest_product
from .quantized import int8_convolution, int8_weight
from .state import Rewrite

aten = torch.ops.aten


def fold_batch_norms(r: Rewrite) -> None:
    for bn in list(r.graph.nodes):
        if bn.op != "call_function" or bn.target != aten._native_batch_norm_legit_no_training.default:
            continue
        conv = bn.args[0]
        if not (isinstance(conv, torch.fx.Node) and conv.target == aten.convolution.default and
                len(conv.users) == 1 and not conv.args[6]):
            continue
        users = list(bn.users)
        if not all(u.target == operator.getitem and u.args[1] == 0 for u in users):
            continue
        w, b = r.tensor(conv.args[1]), r.tensor(conv.args[2]) if conv.args[2] is not None else None
        gamma, beta, mean, var = (r.tensor(a) for a in bn.args[1:5])
        if w is None or mean is None or var is None or (conv.args[2] is not None and b is None) or \
                (bn.args[1] is not None and gamma is None) or (bn.args[2] is not None and beta is None) or \
                w.dtype not in (torch.float32, torch.float64):
            continue
        with torch.no_grad():
            fw, fb = fuse_conv_bn_weights(w, b, mean, var, bn.args[6], gamma, beta)
        r.freeze(conv.args[1], conv.args[2], *bn.args[1:5])
        with r.graph.inserting_before(conv):
            args = list(conv.args)
            args[1] = r.constant(fw.detach(), "weight")
            args[2] = r.constant(fb.detach(), "bias")
            folded = r.graph.call_function(aten.convolution.default, tuple(args))
            folded.meta.update(conv.meta)
        for u in users:
            u.replace_all_uses_with(folded)
            r.graph.erase_node(u)
        r.graph.erase_node(bn)
        r.graph.erase_node(conv)
        r.counts["batch_norms_folded"] += 1


def rewrite_convolutions(r: Rewrite) -> None:
    """In graph order, so that a 1x1 convolution knows whether its input is channels-last:
    what a rewritten convolution gives, and what is computed from it by ops that keep the
    layout, is (restore_layouts makes it contiguous where it must be)."""
    erased: set = set()
    for conv in list(r.graph.nodes):
        if conv in erased or conv.op != "call_function":
            continue
        if conv.target != aten.convolution.default:
            for layout in (r.channels_last, r.contiguous):
                if conv.target not in STRIDE_SENSITIVE and any(a in layout for a in conv.all_input_nodes):
                    layout.add(conv)
            continue
        if int8_convolution(r, conv):  # Note [PT2E's int8 kernels]; else its weight is dequantized once
            continue
        x, wn, bn, stride, padding, dilation, transposed, _output_padding, groups = conv.args
        w = r.tensor(wn)
        b = r.tensor(bn) if bn is not None else None
        val = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
        if transposed or w is None or (bn is not None and b is None) or val is None or \
                val.dtype != torch.float32 or w.dtype != torch.float32 or val.device.type != "cpu" or \
                val.dim() not in (3, 4) or not all(isinstance(s, int) for s in val.shape):
            if x in r.channels_last:  # eager's op (a transposed one too) keeps a channels-last input's layout
                r.channels_last.add(conv)
            continue
        one_d = val.dim() == 3
        kernel = own_kernel(r, x, w, val, stride, padding, groups)
        if kernel == "1x1":
            r.freeze(wn, bn)
            _as_gemm(r, conv, x, w, b, val.shape)
        elif kernel == "depthwise":
            r.freeze(wn, bn)
            r.chose(conv, "depthwise")
            post = _depthwise(r, conv, x, w, b, stride, padding, dilation)
            if post is not None:
                erased.add(post)
        elif (way := _fastest(r, conv, x, w, b, stride, padding, dilation, groups, val, one_d)) != "eager":
            r.freeze(wn, bn)
            if way == "gemm":
                post = _through_gemm(r, conv, x, w, b, stride, padding, dilation)
            else:
                post = _through_onednn(r, conv, x, w, b, stride, padding, dilation, groups, val.shape, one_d)
            if post is not None:
                erased.add(post)
        else:  # eager's op (which the tape may run through a checked faster call)
            r.counts["convolutions_eager"] += 1
            if x in r.channels_last and not within_reach(padding, w.shape[2:], dilation):
                _contiguous_input(r, conv, x)  # (eager's oneDNN path crashes there on channels-last)
            elif x in r.channels_last:
                r.channels_last.add(conv)


def _as_gemm(r: Rewrite, conv: torch.fx.Node, x: torch.fx.Node, w: torch.Tensor, b: Optional[torch.Tensor],
             shape: Sequence[int]) -> None:
    n, c, h, wd = shape
    cout = w.shape[0]
    kn = w.detach().reshape(cout, c).t().contiguous()
    with r.graph.inserting_before(conv):
        wt = r.constant(kn, "weight_t")
        rows = r.graph.call_function(aten.view.default, (
            r.graph.call_function(aten.permute.default, (x, [0, 2, 3, 1])), [n * h * wd, c]))
        if b is not None:
            mm = r.graph.call_function(aten.addmm.default, (r.constant(b.detach(), "bias"), rows, wt))
        else:
            mm = r.graph.call_function(aten.mm.default, (rows, wt))
        view = r.graph.call_function(aten.view.default, (mm, [n, h, wd, cout]))
        out = r.graph.call_function(aten.permute.default, (view, [0, 3, 1, 2]))
    out.meta["val"] = conv.meta.get("val")  # its sizes, for the rewrites after it
    conv.replace_all_uses_with(out)
    r.graph.erase_node(conv)
    fastest_product(r, mm, rows, wt, kn, n * h * wd, through=out)  # (or MKL's addmm as it is)
    r.channels_last.add(out)
    r.counts["convolutions_gemm"] += 1


def _depthwise(r: Rewrite, conv: torch.fx.Node, x: torch.fx.Node, w: torch.Tensor, b: Optional[torch.Tensor],
               stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int]) -> Optional[torch.fx.Node]:
    """A depthwise convolution through torchreplay's direct kernel (Note [Depthwise
    convolutions] in capture/kernels/depthwise_kernel.h), an activation of POST_OPS after it fused;
    returns the node fused into it."""
    post = post_of(conv)
    c, kh, kw = w.shape[0], w.shape[2], w.shape[3]
    with r.graph.inserting_before(conv):
        weight = w.detach().contiguous()
        out = r.graph.call_function(torch.ops.torchreplay.depthwise_conv2d.default, (
            x, r.constant(weight, "weight"), r.constant(weight.view(c, kh, kw).permute(1, 2, 0).contiguous(),
                                                             "weight_hwc"),
            r.constant(b.detach(), "bias") if b is not None else None, list(stride), list(padding),
            list(dilation), POST_OPS[post.target] if post is not None else "none"))
    return _replace_convolution(r, conv, post, out, "convolutions_depthwise")


def _fastest(r: Rewrite, conv: torch.fx.Node, x: torch.fx.Node, w: torch.Tensor, b: Optional[torch.Tensor],
             stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int], groups: int,
             val: torch.Tensor, one_d: bool) -> str:
    """Which way of conv_times is fastest for this convolution (the choice kept in r.choices)."""
    t = conv_times(r, x, w, b, stride, padding, dilation, groups, val, one_d)
    way = min(t, key=t.get)
    r.chose(conv, way, t)
    return way


def _contiguous_input(r: Rewrite, conv: torch.fx.Node, x: torch.fx.Node) -> None:
    with r.graph.inserting_before(conv):
        c = r.graph.call_function(aten.clone.default, (x,), {"memory_format": torch.contiguous_format})
    conv.replace_input_with(x, c)
    r.counts["layout_copies"] += 1


def _through_gemm(r: Rewrite, conv: torch.fx.Node, x: torch.fx.Node, w: torch.Tensor, b: Optional[torch.Tensor],
                  stride: Sequence[int], padding: Sequence[int],
                  dilation: Sequence[int]) -> Optional[torch.fx.Node]:
    """The convolution as torchreplay::conv_gemm (the weight as rows, stored once), an
    activation of POST_OPS reading only it fused; returns the node fused into it. Its result is
    channels-last (whatever its input's layout) where a depthwise or 1x1 convolution reads it
    (through ops that keep the layout): those read channels-last as it lies (mobilenet's stem:
    its first depthwise and 1x1 convolutions took 35 and 28 us on a contiguous input, 16 and 4
    channels-last); else contiguous, where the GEMM's rows are the output channels (eight
    output channels as rows of pixels fill half an AVX-512 vector)."""
    post = post_of(conv)
    channels_last = len(w.shape) == 4 and _read_channels_last(r, conv)
    r.counts["results_channels_last"] += channels_last
    with r.graph.inserting_before(conv):
        out = r.graph.call_function(torch.ops.torchreplay.conv_gemm.default, (
            x, r.constant(w.detach().reshape(w.shape[0], -1).contiguous(), "weight_rows"),
            r.constant(b.detach() if b is not None else torch.zeros(w.shape[0]), "bias"),
            list(w.shape[2:]), list(stride), list(padding), list(dilation),
            POST_OPS[post.target] if post is not None else "none", channels_last))
    return _replace_convolution(r, conv, post, out, "convolutions_small_gemm", contiguous=not channels_last)


def _read_channels_last(r: Rewrite, node: torch.fx.Node) -> bool:
    """Whether a convolution that reads a channels-last input as it lies (a depthwise one, or a
    1x1 of stride 1 without padding: rewrite_convolutions' _depthwise and _as_gemm) reads
    `node`'s result, directly or through ops that keep the layout."""
    seen, todo = set(), list(node.users)
    while todo:
        user = todo.pop()
        if user in seen or user.op != "call_function" or user.target in STRIDE_SENSITIVE:
            continue
        seen.add(user)
        if user.target != aten.convolution.default:
            todo.extend(user.users)
            continue
        w = r.tensor(user.args[1])
        w = w if w is not None else int8_weight(r, user.args[1])  # (to be dequantized once)
        stride, padding, groups = user.args[3], user.args[4], user.args[8]
        if w is not None and w.dim() == 4 and user.args[0] in seen | {node} and (
                (groups > 1 and w.shape[0] == groups and w.shape[1] == 1) or
                (groups == 1 and w.shape[2:] == (1, 1) and list(stride) == [1, 1] and list(padding) == [0, 0])):
            return True
    return False


def _through_onednn(r: Rewrite, conv: torch.fx.Node, x: torch.fx.Node, w: torch.Tensor, b: Optional[torch.Tensor],
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
    post = post_of(conv, UNARY_KEEPING_NAN)
    attr: Tuple[str, List[Any], str] = UNARY_KEEPING_NAN[post.target](post) if post is not None else ("none", [], "")
    with r.graph.inserting_before(conv):
        xin = r.graph.call_function(aten.unsqueeze.default, (x, 2)) if one_d else x
        bias = r.constant(b.detach(), "bias") if b is not None else None
        out = r.graph.call_function(torch.ops.mkldnn._convolution_pointwise.default, (
            xin, r.constant(packed, "packed"), bias, padding, stride, dilation, groups, attr[0], attr[1],
            attr[2]))
        if one_d:
            out = r.graph.call_function(aten.squeeze.dim, (out, 2))
    post = _replace_convolution(r, conv, post, out, "convolutions_onednn")
    if one_d:
        r.moved(out, out.args[0])  # (the choice is the convolution's, not its squeeze's)
    return post


def _replace_convolution(r: Rewrite, conv: torch.fx.Node, post: Optional[torch.fx.Node], out: torch.fx.Node,
                         count: str, contiguous: bool = False) -> Optional[torch.fx.Node]:
    """`out` in place of `conv` and of the activation `post` it fused (if any); returns `post`.
    Unless `contiguous`, `out` may be channels-last."""
    out.meta["val"] = conv.meta.get("val")  # its sizes, for the rewrites after it
    r.moved(conv, out)
    (post or conv).replace_all_uses_with(out)
    if post is not None:
        r.graph.erase_node(post)
        r.counts["post_ops_fused"] += 1
    r.graph.erase_node(conv)
    (r.contiguous if contiguous else r.channels_last).add(out)
    r.counts[count] += 1
    return post
