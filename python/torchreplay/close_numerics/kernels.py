"""What the rewrites of Note [Close numerics] share: the ops and post-ops they fuse, the timing
they choose by (a convolution's ways among them), layout and reach tests, and whether
torchreplay's kernels run on this CPU."""
from __future__ import annotations

import functools
import time
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.fx

from .state import Rewrite

aten = torch.ops.aten


# aten op after a convolution -> oneDNN's post-op (attr, scalars from the op's args, algorithm)
UNARY = {
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
# The UNARY ops oneDNN's fp32 kernels fuse: not relu, hardtanh (relu6) and hardsigmoid, whose
# oneDNN post-ops give 0 or a bound for a NaN where eager's ops give NaN.
UNARY_KEEPING_NAN = {op: attr for op, attr in UNARY.items()
                     if op not in (aten.relu.default, aten.hardtanh.default, aten.hardsigmoid.default)}
# ops that need their input in eager's layout: views that need its strides to be viewable, and
# group norm's kernel, which raises on an input not contiguous in the layout it suggests (a 1-d
# convolution's channels-last result)
STRIDE_SENSITIVE = {aten.view.default, aten._unsafe_view.default, aten.as_strided.default,
                    aten.native_group_norm.default}
# The activations torchreplay's kernels apply before storing (post_op, capture/kernels/post_op.h).
POST_OPS = {aten.relu.default: "relu", aten.hardswish.default: "hardswish",
            aten.hardsigmoid.default: "hardsigmoid", aten.silu.default: "silu"}


def post_of(node: torch.fx.Node, ops: Any = POST_OPS, through_view: bool = False) -> Optional[torch.fx.Node]:
    """`node`'s one reader if that is an activation of `ops` on it (fused into the kernel that
    computes `node`), else None; with `through_view`, also one reading the one view of `node`
    that nothing else reads (elementwise: the same computed before the view: a transformer's
    GELU after its linear)."""
    post = next(iter(node.users)) if len(node.users) == 1 else None
    if through_view and post is not None and post.target in (aten.view.default, aten._unsafe_view.default) and \
            len(post.users) == 1:
        node, post = post, next(iter(post.users))
    if post is None or post.op != "call_function" or post.target not in ops or post.args[0] is not node:
        return None
    return post


def least_times(fns: Sequence[Any], rounds: int = 7) -> List[float]:
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


def eager_channels_last(node: torch.fx.Node) -> bool:
    """Whether eager's result of `node` (its traced value) is channels-last and not contiguous."""
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dim() == 4 and \
        val.is_contiguous(memory_format=torch.channels_last) and not val.is_contiguous()


def within_reach(padding: Sequence[int], kernel: Sequence[int], dilation: Sequence[int]) -> bool:
    """Whether no dim's padding exceeds the kernel's reach, (size - 1) * dilation: beyond it
    oneDNN's convolution crashed (capture/tape/checked/conv_steps.cc's PaddingBeyondReach), through its packed
    call and through eager's op on a channels-last input, which therefore never gets one."""
    return all(p <= (k - 1) * d for p, k, d in zip(padding, kernel, dilation))


def panels(kn: torch.Tensor, panel: int) -> torch.Tensor:
    """A [K, N] weight packed in panels of `panel` columns, [ceil(N / panel), K, panel], the last
    one zero-padded (the small GEMM's Params::panel)."""
    k, n = kn.shape
    padded = kn.new_zeros(k, (n + panel - 1) // panel * panel)
    padded[:, :n] = kn
    return padded.view(k, -1, panel).permute(1, 0, 2).contiguous()


@functools.lru_cache(maxsize=1)
def small_gemm_available() -> bool:
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
def depthwise_available() -> bool:
    """Whether torchreplay's depthwise kernel runs on this CPU (AVX2 and FMA)."""
    try:
        x = torch.zeros(1, 1, 1, 1)
        torch.ops.torchreplay.depthwise_conv2d(x, x, x.view(1, 1, 1), None, [1, 1], [0, 0], [1, 1], "none")
        return True
    except RuntimeError:
        return False


def own_kernel(r: Rewrite, x: torch.fx.Node, w: torch.Tensor, val: torch.Tensor, stride: Sequence[int],
               padding: Sequence[int], groups: int) -> Optional[str]:
    """"1x1" or "depthwise" where the convolution is one that torchreplay's own kernels take
    without timing (a 1x1 convolution on a channels-last input as its GEMM, a depthwise one),
    else None."""
    if val.dim() != 4:
        return None
    if groups == 1 and w.shape[2:] == (1, 1) and list(stride) == [1, 1] and list(padding) == [0, 0] and \
            (x in r.channels_last or val.shape[2] * val.shape[3] == 1):
        return "1x1"
    if groups > 1 and w.shape[0] == groups and w.shape[1] == 1 and val.shape[1] == groups and depthwise_available():
        return "depthwise"
    return None


def conv_times(r: Rewrite, x: torch.fx.Node, w: torch.Tensor, b: Optional[torch.Tensor], stride: Sequence[int],
               padding: Sequence[int], dilation: Sequence[int], groups: int, val: torch.Tensor,
               one_d: bool) -> Dict[str, float]:
    """The times of eager's op, oneDNN on a packed weight and (one group) torchreplay's conv_gemm
    for this convolution ("eager", "onednn", "gemm", µs), on a random input of its sizes and
    layout (oneDNN's per-call cost exceeds a small im2col GEMM's: the harness's convnet ran
    slower through it)."""
    reachable = within_reach(padding, w.shape[2:], dilation)
    layout = torch.channels_last if x in r.channels_last and not one_d and reachable else \
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
    if reachable:
        ways["onednn"] = lambda: torch.ops.mkldnn._convolution_pointwise.default(x4, packed, bias, pd, st, dl,
                                                                                 groups, "none", [], "")
    if groups == 1 and small_gemm_available() and inp.numel() > 0:
        rows = w.detach().reshape(w.shape[0], -1).contiguous()
        zeros = bias if bias is not None else torch.zeros(w.shape[0])
        ways["gemm"] = lambda: torch.ops.torchreplay.conv_gemm.default(
            inp, rows, zeros, list(w.shape[2:]), list(stride), list(padding), list(dilation), "none")
    with torch.no_grad():
        return dict(zip(ways, least_times(list(ways.values()))))
