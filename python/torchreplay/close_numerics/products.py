"""Note [Close numerics]'s products by a weight known at capture: linear layers and 1x1
convolutions through MKL's addmm, the small GEMM, oneDNN's linear on a packed weight or a
transposed copy, whichever timed faster."""
from __future__ import annotations

import functools
from typing import Dict, Optional, Tuple

import torch
import torch.fx

from . import kernels
from .kernels import POST_OPS, UNARY_KEEPING_NAN, panels, post_of, small_gemm_available
from .state import Rewrite

aten = torch.ops.aten


def rewrite_linears(r: Rewrite) -> None:
    """A product by a weight known at capture (a linear layer, a recurrent cell's projections)
    through the small GEMM or oneDNN's linear on a packed weight where one timed faster than
    the addmm at capture (fastest_product: MKL's set-up exceeds the arithmetic of a few rows;
    oneDNN's packed weight saves MKL's packing of it on every call of many rows; the 1x1
    convolutions' GEMMs were timed when made). Else a GEMV whose weight is 128 KB or more
    reads it from a transposed copy stored contiguous once (MKL streams it: on the zoo's
    classifier, 133 to 76 us a call, the weight not in cache); smaller weights stay in cache
    either way."""
    for node in list(r.graph.nodes):
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
        w = r.tensor(source)
        if w is None or w.dim() != 2 or w.dtype != torch.float32 or w.device.type != "cpu":
            continue
        kn = (w.t() if transposed else w).detach()
        if fastest_product(r, node, x, source, kn, val.shape[0]):
            continue
        if not transposed or val.shape[0] > 16 or w.numel() * 4 < (128 << 10):
            continue
        r.freeze(source)
        with r.graph.inserting_before(node):
            wt = r.constant(kn.contiguous(), "weight_t")
        node.replace_input_with(mat2, wt)
        r.counts["linears_transposed_once"] += 1


def fastest_product(r: Rewrite, node: torch.fx.Node, x: torch.fx.Node, source: torch.fx.Node, kn: torch.Tensor,
                    rows: int, through: Optional[torch.fx.Node] = None) -> bool:
    """`node` (addmm or mm of `x` by the weight `kn`, [K, N], read from `source`), if its bias
    is a vector, through whichever way of product_times timed fastest: MKL's addmm as it is, the
    small GEMM on the weight as it is or in panels of 64 columns, or oneDNN's linear on the
    weight packed once; an activation reading it (or `through`, the views of it a 1x1
    convolution's result is) fused into the kernel where it takes one (the small GEMM's
    POST_OPS; oneDNN's UNARY_KEEPING_NAN, also through one view: a transformer's GELU after its
    linear).
    Returns whether it was rewritten."""
    bias = node.args[0] if node.target == aten.addmm.default else None
    n = kn.shape[1]
    if bias is not None:
        b = r.tensor(bias)
        bval = b if b is not None else bias.meta.get("val") if isinstance(bias, torch.fx.Node) else None
        if not isinstance(bval, torch.Tensor) or tuple(bval.shape) != (n,) or bval.dtype != torch.float32:
            return False
    t, weights = product_times(kn, rows, bias is not None)
    way = min(t, key=t.get)
    r.chose(node, way, t)
    if way == "addmm":
        return False
    r.freeze(source)
    if way == "onednn":
        post = post_of(through if through is not None else node, UNARY_KEEPING_NAN, through_view=True)
        attr = UNARY_KEEPING_NAN[post.target](post) if post is not None else ("none", [], "")
        with r.graph.inserting_before(node):
            out_node = r.graph.call_function(torch.ops.mkldnn._linear_pointwise.default, (
                x, r.constant(weights[way], "linear_packed"), bias, attr[0], attr[1], attr[2] or None))
        count = "linears_onednn"
    else:
        post = post_of(through if through is not None else node)
        with r.graph.inserting_before(node):
            out_node = r.graph.call_function(torch.ops.torchreplay.small_gemm.default, (
                x, r.constant(weights[way], "weight_kn"), bias if bias is not None else r.constant(torch.zeros(n), "bias"),
                POST_OPS[post.target] if post is not None else "none"))
        count = "linears_small_gemm"
    out_node.meta["val"] = node.meta.get("val")
    if post is not None:  # (elementwise: the same before the views `through` takes)
        post.replace_all_uses_with(post.args[0])
        r.graph.erase_node(post)
        r.counts["post_ops_fused"] += 1
    node.replace_all_uses_with(out_node)
    r.moved(node, out_node)
    r.graph.erase_node(node)
    r.counts[count] += 1
    return True


def _small(rows: int, kn: torch.Tensor) -> bool:
    """Whether the small GEMM runs here and is worth timing for this product (larger ones are
    where MKL's kernels are at their best)."""
    return rows * kn.shape[0] * kn.shape[1] <= (1 << 23) and small_gemm_available()


def product_times(kn: torch.Tensor, rows: int, bias: bool) -> Tuple[Dict[str, float], Dict[str, torch.Tensor]]:
    """The times (µs, on random rows) of the ways to multiply `rows` rows by `kn` ([K, N]), with
    a bias vector or not: MKL's addmm (or mm); where _small, the small GEMM on the weight as it
    is ("dense") or, if it is large, packed in panels of 64 columns ("panels"); where oneDNN runs,
    its linear on the weight packed once for these rows ("onednn"); and each way's weight."""
    n = kn.shape[1]
    inp, vec, out = torch.randn(rows, kn.shape[0]), torch.randn(n), torch.empty(rows, n)
    weights = {}
    ways = {"addmm": (lambda: aten.addmm.out(vec, inp, kn, out=out)) if bias else
            (lambda: aten.mm.out(inp, kn, out=out))}
    if torch.backends.mkldnn.is_available():
        weights["onednn"] = torch.ops.mkldnn._reorder_linear_weight(kn.t().contiguous(), rows)
        ways["onednn"] = functools.partial(torch.ops.mkldnn._linear_pointwise.default, inp, weights["onednn"],
                                           vec if bias else None, "none", [], None)
    small = _small(rows, kn)
    if small:
        weights["dense"] = kn.contiguous()
        if kn.numel() * 4 >= (128 << 10):  # out of the core's caches: streamed, panel by panel
            weights["panels"] = panels(kn, 64)
    for name in ("dense", "panels"):
        if name in weights:
            ways[name] = functools.partial(torch.ops.torchreplay.small_gemm.out, inp, weights[name], vec, "none",
                                           out=out)
    with torch.no_grad():  # (a large product's rounds take milliseconds: fewer of them)
        return dict(zip(ways, kernels.least_times(list(ways.values()), rounds=15 if small else 5))), weights
