"""Note [Close numerics]'s int8 kernels (Note [PT2E's int8 kernels])."""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
import torch.fx

from ..fx_views import is_view
from ..passes import replace_with_trace
from .kernels import UNARY, conv_times, least_times, own_kernel
from .products import product_times
from .state import Rewrite

aten = torch.ops.aten

# Note [PT2E's int8 kernels]
# A model quantized by PT2E (torchao's convert_pt2e, X86InductorQuantizer) is its fp32 reference:
# each quantized convolution or linear reads `dequantize_per_tensor` of a uint8 activation and
# `dequantize_per_channel` of an int8 weight, computes in fp32, and its result (after an
# activation) is quantized again. Eager computes that, so the bitwise graph does too (Note
# [PT2E's quantize ops] in passes.py). With numerics "close" each such pattern is oneDNN's int8
# kernel instead, as Inductor lowers it with freezing on: onednn::qconv_pointwise /
# qlinear_pointwise on the uint8 activation and the weight packed once at capture
# (onednn::qconv_prepack / qlinear_prepack), the activation after it fused, and the quantize
# after that fused as its uint8 output where that is its only reader. The int8 products are
# exact sums where the reference rounds each fp32 product, and oneDNN applies the scales in
# another order: results differ from the reference by a few ulps, and a value the reference
# quantizes near a rounding boundary comes out one quantization step off (the capture's check
# reports how far, Captured.numerics, with the signal-to-noise ratio quantized models are judged
# by). Each is timed at capture against the fastest fp32 way the rewrites after it would take
# on the dequantized weight, plus the elementwise passes that way adds (a dequantize before, a
# quantize after): oneDNN's call costs tens of µs on small images, more than torchreplay's own
# kernels take for the whole product, and 1x1 and depthwise convolutions, which those kernels
# take, are not timed. Where fp32 wins, the dequantized weight is folded into a constant (the
# reference's own values) and the op is left to those rewrites. The int8 weight and its scales
# are folded either way: check_frozen guards them as any folded weight.

# The activations oneDNN fuses into each kernel (what Inductor fuses), as UNARY's post-ops.
_CONV_UNARY = {aten.relu.default, aten.hardtanh.default, aten.hardswish.default, aten.silu.default}
_LINEAR_UNARY = {aten.relu.default, aten.gelu.default}


def _is(node: Any, name: str) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and \
        node.target is getattr(getattr(torch.ops.quantized_decomposed, name, None), "default", None)


def rewrite_quantized_linears(r: Rewrite) -> None:
    """Note [PT2E's int8 kernels]: every linear of the reference pattern as oneDNN's int8 kernel,
    or fp32 on its weight dequantized once (the products' rewrites take it from there)."""
    for node in list(r.graph.nodes):
        if node.op == "call_function" and node.target in (aten.addmm.default, aten.mm.default):
            _linear(r, node)


def fake_quantize_pairs(r: Rewrite) -> None:
    """Note [PT2E's int8 kernels]: a quantize read only by dequantizes of its parameters (around
    what no int8 kernel took) as one fp32 pass, without the uint8 tensor between: the same values
    (the quantized ones are integers of [0, 255], which the uint8 round trip keeps), but a NaN
    stays NaN where the reference converts it to uint8 (a value of the range)."""
    for q in list(r.graph.nodes):
        if not _is(q, "quantize_per_tensor") or q.kwargs or not q.users or \
                not all(_activation(dq) is not None and tuple(q.args[1:]) == tuple(dq.args[1:]) for dq in q.users):
            continue
        readers = list(q.users)
        if replace_with_trace(r.gm, q, _fake_quantize):
            for dq in readers:
                dq.replace_all_uses_with(dq.args[0])
                r.graph.erase_node(dq)
            r.counts["quantize_pairs_fused"] += 1


def _fake_quantize(x: torch.Tensor, scale: float, zero: int, qmin: int, qmax: int, dtype: torch.dtype) -> torch.Tensor:
    """quantize_per_tensor then dequantize_per_tensor (torch/ao/quantization/fx/_decomposed.py)
    less the conversions to uint8 and back, and with the zero point taken out of the clamp's
    bounds instead of added and subtracted (integers below 2^24: exact in float32; a rounded sum
    above them is clamped all the same), so four ops: the same values, but a zero may keep its
    sign where the reference's is positive."""
    return torch.clamp(torch.round(x * (1.0 / scale)), qmin - zero, qmax - zero) * scale


def _activation(node: Any) -> Optional[Tuple[Any, float, int]]:
    """(uint8 tensor, scale, zero point) if `node` dequantizes a uint8 activation per tensor."""
    if not _is(node, "dequantize_per_tensor") or len(node.args) != 6 or node.kwargs:
        return None
    xq, scale, zero, qmin, qmax, dtype = node.args
    if not isinstance(scale, float) or not isinstance(zero, int) or (qmin, qmax, dtype) != (0, 255, torch.uint8):
        return None
    return xq, scale, zero


def _weight(r: Rewrite, node: Any) -> Optional[Tuple[Tuple[Any, ...], torch.Tensor, torch.Tensor]]:
    """((nodes to freeze), int8 weight, scales) if `node` dequantizes a weight known at capture
    per output channel, symmetric (oneDNN's int8 weights have no zero points)."""
    if not _is(node, "dequantize_per_channel") or len(node.args) != 7 or node.kwargs:
        return None
    wn, sn, zn, axis, qmin, qmax, dtype = node.args
    w, s, z = r.tensor(wn), r.tensor(sn), r.tensor(zn)
    if w is None or s is None or z is None or (axis, qmin, qmax, dtype) != (0, -128, 127, torch.int8) or \
            bool(z.ne(0).any()):
        return None
    return (wn, sn, zn), w, s


def int8_weight(r: Rewrite, node: Any) -> Optional[torch.Tensor]:
    """The int8 weight `node` dequantizes as _weight matches it, else None."""
    weight = _weight(r, node)
    return weight[1] if weight is not None else None


def _post_and_output(node: torch.fx.Node, unary: set) -> Tuple[Any, Any, Any]:
    """The activation fused after `node` (or None), its oneDNN post-op, and the quantize_per_tensor
    to uint8 that is the only reader of what that gives (or None): fused as the kernel's output."""
    post = next(iter(node.users)) if len(node.users) == 1 else None
    if post is None or post.op != "call_function" or post.target not in unary or post.args[0] is not node:
        post = None
    attr = UNARY[post.target](post) if post is not None else ("none", [], "")
    last = post or node
    q = next(iter(last.users)) if len(last.users) == 1 else None
    if not (_is(q, "quantize_per_tensor") and len(q.args) == 6 and not q.kwargs and q.args[0] is last and
            isinstance(q.args[1], float) and isinstance(q.args[2], int) and tuple(q.args[3:]) == (0, 255, torch.uint8)):
        q = None
    return post, attr, q


def _passes(xq: torch.Tensor, q: Any) -> float:
    """The time of the elementwise passes the fp32 way adds around its op, where the int8 kernel
    reads the uint8 activation and (`q`) gives the uint8 result: a dequantize and a quantize,
    timed as the conversions they end in."""
    x = xq.float()
    return sum(least_times([lambda: xq.float()] + ([lambda: x.to(torch.uint8)] if q is not None else [])))


def _int8_faster(r: Rewrite, node: torch.fx.Node, int8: Any, fp32_us: float) -> bool:
    """Whether the call `int8` times at most `fp32_us`, the fp32 way's time (the choice kept in
    r.choices: the fp32 way's own choice, made after, adds its times)."""
    int8_us = least_times([int8])[0]
    r.chose(node, "int8" if int8_us <= fp32_us else "fp32", {"int8": int8_us, "fp32": fp32_us})
    return int8_us <= fp32_us


def _output(q: Any) -> Tuple[float, int, torch.dtype]:
    """The kernel's output scale, zero point and dtype: `q`'s uint8, or fp32."""
    return (q.args[1], q.args[2], torch.uint8) if q is not None else (1.0, 0, torch.float32)


def _dequantized_once(r: Rewrite, reader: Optional[torch.fx.Node], wdq: torch.fx.Node, frozen: Tuple[Any, ...],
                      dequantized: torch.Tensor) -> None:
    """The reference's dequantized weight `wdq` as a constant in `reader` (in every reader if None),
    for the fp32 rewrites; the tensors it came from frozen."""
    r.freeze(*frozen)
    with r.graph.inserting_before(reader or wdq):
        c = r.constant(dequantized, "dequantized_weight")
    c.meta["val"] = wdq.meta.get("val")
    if reader is None:
        wdq.replace_all_uses_with(c)
    else:
        reader.replace_input_with(wdq, c)
    r.counts["weights_dequantized_once"] += 1


# Note [PT2E's weights dequantized once]
# The reference graph dequantizes each int8 weight (dequantize_per_channel of a constant int8
# tensor and its scales) on every call, as eager does: most of a replay's time on a CNN. Its
# result depends on the constants alone, and the op is elementwise (a conversion, a subtraction
# and a multiplication per element, each rounded once), so computing it once at capture with
# eager's own kernel gives the bits every call would. In both numerics each such op becomes a
# constant holding its result; the int8 weight, scales and zero points are folded as any folded
# weight: check_frozen raises, saying to capture again, if one is written after the capture.
# Under bitwise numerics their contents are compared with their hashes at capture on every call
# (a write through .data, or to an inference tensor, moves no version counter): one read of the
# int8 bytes a call (mobilenet_v3_small's 2.5 MB).
# Only dequantizes are folded under bitwise numerics: a PT2E model's int8 weights are buffers
# nothing trains, where a parameter a training loop updates between evaluations would make every
# capture of it raise.
def dequantize_weights_once(r: Rewrite) -> None:
    """Note [PT2E's weights dequantized once]: each dequantize of constants only as its result."""
    ops = {getattr(torch.ops.quantized_decomposed, name).default
           for name in ("dequantize_per_channel", "dequantize_per_tensor")
           if hasattr(torch.ops, "quantized_decomposed") and hasattr(torch.ops.quantized_decomposed, name)}
    for node in list(r.graph.nodes):
        if node.op != "call_function" or node.target not in ops:
            continue
        sources = [a for a in node.args if isinstance(a, torch.fx.Node)]
        values = [r.tensor(a) for a in sources]
        if not node.users or _returned(node) or not sources or node.kwargs or \
                any(v is None or v.requires_grad for v in values):
            continue  # (no users: one an int8 rewrite replaced; returned: the caller could write it)
        value = dict(zip(sources, values))
        with torch.no_grad():
            result = node.target(*[value[a] if isinstance(a, torch.fx.Node) else a for a in node.args])
        _dequantized_once(r, None, node, tuple(sources), result)
        r.graph.erase_node(node)


def _returned(node: torch.fx.Node) -> bool:
    """Whether `node`'s tensor, or a view of it, is an output of the graph."""
    return any(u.op == "output" or (u.op == "call_function" and is_view(u) and _returned(u)) for u in node.users)


def _dequantize(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return torch.ops.quantized_decomposed.dequantize_per_channel.default(
        w, s, torch.zeros_like(s, dtype=torch.int64), 0, -128, 127, torch.int8)


def _replace(r: Rewrite, node: torch.fx.Node, post: Any, q: Any, out: torch.fx.Node, count: str) -> None:
    last = q or post or node
    out.meta["val"] = last.meta.get("val")
    r.moved(node, out)
    last.replace_all_uses_with(out)
    for dead in (q, post, node):
        if dead is not None:
            r.graph.erase_node(dead)
    r.counts["post_ops_fused"] += post is not None
    r.counts[count] += 1


def int8_convolution(r: Rewrite, conv: torch.fx.Node) -> bool:
    """Note [PT2E's int8 kernels]: a convolution of the reference pattern as oneDNN's int8 kernel
    where that timed faster than the fastest fp32 way (one of torchreplay's own kernels, which
    take 1x1 and depthwise convolutions, is); else its weight dequantized once, for the fp32
    rewrites. Whether it became the int8 kernel."""
    x, wdq, bias, stride, padding, dilation, transposed, _output_padding, groups = conv.args
    act, weight = _activation(x), _weight(r, wdq)
    val = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
    if act is None or weight is None or transposed or val is None or val.dim() != 4 or \
            not all(isinstance(s, int) for s in val.shape):
        return False
    (xq, sx, zx), (frozen, w, s) = act, weight
    stride, padding, dilation = list(stride), list(padding), list(dilation)
    dequantized, b = _dequantize(w, s), r.tensor(bias)
    if bias is not None and b is None:
        return False
    if own_kernel(r, x, dequantized, val, stride, padding, groups) is None:
        packed = torch.ops.onednn.qconv_prepack(w, s, sx, zx, stride, padding, dilation, groups, list(val.shape))
        post, attr, q = _post_and_output(conv, _CONV_UNARY)
        layout = torch.channels_last if x in r.channels_last else torch.contiguous_format
        xq_example = torch.randint(0, 256, val.shape, dtype=torch.uint8).contiguous(memory_format=layout)
        zeros = torch.zeros_like(s, dtype=torch.int64)
        fp32 = min(conv_times(r, x, dequantized, b, stride, padding, dilation, groups, val, False).values()) + \
            _passes(xq_example, q)
        if _int8_faster(r, conv, lambda: torch.ops.onednn.qconv_pointwise.default(
                xq_example, sx, zx, packed, s, zeros, b, stride, padding, dilation, groups, 1.0, 0, torch.float32,
                attr[0], attr[1], attr[2] or ""), fp32):
            r.freeze(*frozen)
            with r.graph.inserting_before(conv):
                out = r.graph.call_function(torch.ops.onednn.qconv_pointwise.default, (
                    xq, sx, zx, r.constant(packed, "qconv_weight"), r.constant(s.detach().clone(), "qconv_scales"),
                    r.constant(zeros, "qconv_zeros"), bias, stride, padding, dilation, groups,
                    *_output(q), attr[0], attr[1], attr[2] or ""))
            _replace(r, conv, post, q, out, "convolutions_int8")
            r.channels_last.add(out)  # oneDNN's result is channels-last
            return True
    _dequantized_once(r, conv, wdq, frozen, dequantized)
    return False


def _linear(r: Rewrite, mm: torch.fx.Node) -> None:
    bias, x, wt = (mm.args if mm.target == aten.addmm.default else (None, *mm.args))
    if mm.kwargs or not (isinstance(wt, torch.fx.Node) and wt.target == aten.t.default):
        return
    view = None
    if isinstance(x, torch.fx.Node) and x.target == aten.view.default and _activation(x.args[0]) is not None:
        view, x = x, x.args[0]
    act, weight = _activation(x), _weight(r, wt.args[0])
    val = (view or x).meta.get("val") if isinstance(x, torch.fx.Node) else None
    if act is None or weight is None or val is None or val.dim() != 2 or \
            not all(isinstance(s, int) for s in val.shape):
        return
    (xq, sx, zx), (frozen, w, s) = act, weight
    dequantized, b = _dequantize(w, s), r.tensor(bias)
    if bias is not None and b is None:
        return
    packed = torch.ops.onednn.qlinear_prepack(w, list(val.shape))
    post, attr, q = _post_and_output(mm, _LINEAR_UNARY)
    xq_example = torch.randint(0, 256, val.shape, dtype=torch.uint8)
    zeros = torch.zeros_like(s, dtype=torch.int64)
    fp32 = min(product_times(dequantized.t(), val.shape[0], b is not None)[0].values()) + _passes(xq_example, q)
    if not _int8_faster(r, mm, lambda: torch.ops.onednn.qlinear_pointwise.default(
            xq_example, sx, zx, packed, s, zeros, b, 1.0, 0, torch.float32, attr[0], attr[1], attr[2] or "none"),
            fp32):
        _dequantized_once(r, wt, wt.args[0], frozen, dequantized)
        return
    r.freeze(*frozen)
    with r.graph.inserting_before(mm):
        xin = r.graph.call_function(aten.view.default, (xq, view.args[1])) if view is not None else xq
        out = r.graph.call_function(torch.ops.onednn.qlinear_pointwise.default, (
            xin, sx, zx, r.constant(packed, "qlinear_weight"), r.constant(s.detach().clone(), "qlinear_scales"),
            r.constant(zeros, "qlinear_zeros"), bias, *_output(q), attr[0], attr[1], attr[2] or "none"))
    _replace(r, mm, post, q, out, "linears_int8")
