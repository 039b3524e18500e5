"""Note [Close numerics]'s squeeze-and-excitation pieces: a channels-last spatial mean as a small
GEMM, and a per-channel scale folded into the 1x1 convolution that reads it."""
from __future__ import annotations

import torch
import torch.fx

from . import kernels
from .kernels import small_gemm_available
from .state import Rewrite

aten = torch.ops.aten


def rewrite_spatial_means(r: Rewrite) -> None:
    """A mean over the spatial dims of a 4-d image of one sample (squeeze-and-excitation's
    pooling) as the small GEMM of a row of 1 / (H * W) by the image's pixels, [H * W, C]: a
    view of a channels-last result, read in place (a copy of any other), where that timed
    faster than eager's mean."""
    for node in list(r.graph.nodes):
        if node.op != "call_function" or node.target != aten.mean.dim or len(node.args) != 3 or node.kwargs:
            continue
        x, dims, keepdim = node.args
        val = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
        if val is None or val.dim() != 4 or val.dtype != torch.float32 or val.device.type != "cpu" or \
                not all(isinstance(s, int) for s in val.shape) or val.shape[0] != 1 or not keepdim or \
                sorted(d % 4 for d in dims) != [2, 3] or x not in r.channels_last or \
                not small_gemm_available():
            continue
        c, hw = val.shape[1], val.shape[2] * val.shape[3]
        if not _mean_faster(r, node, c, val.shape[2], val.shape[3]):
            continue
        row, zeros = torch.full((1, hw), 1.0 / hw), torch.zeros(c)
        with r.graph.inserting_before(node):
            permuted = r.graph.call_function(aten.permute.default, (x, [0, 2, 3, 1]))
            flat = r.graph.call_function(aten.reshape.default, (permuted, [hw, c]))
            mean = r.graph.call_function(torch.ops.torchreplay.small_gemm.default, (
                r.constant(row, "mean_row"), flat, r.constant(zeros, "bias"), "none"))
            view = r.graph.call_function(aten.view.default, (mean, [1, c, 1, 1]))
        view.meta["val"] = node.meta.get("val")
        r.moved(node, mean)
        node.replace_all_uses_with(view)
        r.graph.erase_node(node)
        r.counts["means_small_gemm"] += 1


def fold_channel_scales(r: Rewrite) -> None:
    """A per-channel scale of an image of one sample (squeeze-and-excitation's x * s, s [1, C,
    1, 1]) read only by a 1x1 convolution through the small GEMM moves into that product
    (torchreplay::small_gemm_scaled: the same products, each rounded as the multiply rounds
    it, without the elementwise step or its result)."""
    for node in list(r.graph.nodes):
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
        if x not in r.channels_last:
            continue
        with r.graph.inserting_before(node):
            x_rows = r.graph.call_function(aten.view.default, (
                r.graph.call_function(aten.permute.default, (x, [0, 2, 3, 1])), rows.args[1]))
            scale = r.graph.call_function(aten.view.default, (s, [vals[image].shape[1]]))
            scaled = r.graph.call_function(torch.ops.torchreplay.small_gemm_scaled.default,
                                              (x_rows, scale, *node.args[1:]))
        scaled.meta["val"] = node.meta.get("val")
        node.replace_all_uses_with(scaled)
        for n in (node, rows, permuted, mul):
            r.graph.erase_node(n)
        r.counts["scales_folded"] += 1


def _mean_faster(r: Rewrite, node: torch.fx.Node, c: int, h: int, w: int) -> bool:
    """Whether the small GEMM's mean of a channels-last [1, c, h, w] timed faster than eager's
    (the choice kept in r.choices)."""
    row, zeros = torch.full((1, h * w), 1.0 / (h * w)), torch.zeros(c)
    image = torch.randn(1, c, h, w).to(memory_format=torch.channels_last)
    pixels, out = image.permute(0, 2, 3, 1).reshape(h * w, c), torch.empty(1, c)
    with torch.no_grad():
        eager, ours = kernels.least_times([
            lambda: aten.mean.out(image, [2, 3], True, out=out.view(1, c, 1, 1)),
            lambda: torch.ops.torchreplay.small_gemm.out(row, pixels, zeros, "none", out=out)], rounds=15)
    r.chose(node, "small_gemm" if ours < eager else "mean", {"mean": eager, "small_gemm": ours})
    return ours < eager
