"""Eager's inference batch norm as its per-channel terms and one fma per element, which the tape
fuses with the ops after it (Note [Batch norm as a channel affine] in
capture/tape/fused/fused_kernels.cc): the graph rewrite, run by passes.run_passes, and the check
that the two ops give eager's bits on this machine, made once per process before any graph is
rewritten."""
from __future__ import annotations

import functools
import logging
import operator
from typing import Any, List, Optional, Union

import torch
import torch.fx

aten = torch.ops.aten
logger = logging.getLogger("torchreplay")


@torch.library.register_fake("torchreplay::batch_norm_terms")
def _terms_fake(weight: Any, bias: Any, mean: torch.Tensor, var: torch.Tensor, eps: float) -> Any:
    return torch.empty_like(mean), torch.empty_like(mean)


@torch.library.register_fake("torchreplay::channel_affine")
def _channel_affine_fake(x: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor, weight: Any, bias: Any,
                         mean: torch.Tensor, var: torch.Tensor, eps: float) -> torch.Tensor:
    return aten._native_batch_norm_legit_no_training(x, weight, bias, mean, var, 0.0, eps)[0]  # its result's fake


def _layout_ok(x: torch.Tensor) -> bool:
    """A float32 map of concrete sizes, more than one element per channel, dense NCHW or channels
    last: where eager's batch norm runs batch_norm_cpu_contiguous_impl or _channels_last_impl
    (its planes of one element are left to eager: their result's strides are ambiguous)."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() < 3 or \
            not all(isinstance(s, int) for s in x.shape) or x.numel() == 0:
        return False
    if x.numel() // (x.shape[0] * x.shape[1]) <= 1:
        return False
    return x.is_contiguous() or (x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last)) or \
        (x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d))


def _param_ok(p: Any, channels: int) -> bool:
    if p is None:
        return True
    v = p.meta.get("val") if isinstance(p, torch.fx.Node) else None
    return isinstance(v, torch.Tensor) and v.dtype == torch.float32 and v.device.type == "cpu" and v.dim() == 1 and \
        v.shape[0] == channels and v.is_contiguous()


def _specials(t: torch.Tensor, values: List[Union[int, float]]) -> None:
    """The first elements of float32 `t` set to `values` (ints: bit patterns, NaN payloads kept)."""
    bits = [v if isinstance(v, int) else torch.tensor([v], dtype=torch.float32).view(torch.int32).item()
            for v in values]
    t.view(-1).view(torch.int32)[:len(bits)] = torch.tensor(bits, dtype=torch.int64).to(torch.int32)


@functools.lru_cache(maxsize=None)
def exact_here() -> bool:
    """Whether torchreplay's two ops give eager's batch norm bit for bit here (Note [Batch norm as
    a channel affine]): on every path of eager's kernel (planes with and without a vector tail,
    channels last with and without one, 3-d and 5-d maps), with special values in the map and in
    the parameters (NaN parameters: eager's kernel then runs), with and without affine
    parameters. Made once per process; False where the CPU has no AVX2 and FMA."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return False
    with torch._subclasses.fake_tensor.unset_fake_temporarily(), torch.no_grad():  # a backend's trace may be on
        return _probe()


def _probe() -> bool:
    g = torch.Generator().manual_seed(0)
    nan_a, nan_b = 0x7FC01234, 0xFFC00567 - (1 << 32)  # two quiet NaNs' bits, of both signs
    cases = [((2, 5, 7, 9), None), ((1, 16, 8, 8), None), ((2, 5, 7, 9), torch.channels_last),
             ((1, 40, 3, 3), torch.channels_last), ((1, 19, 33), None), ((2, 3, 2, 3, 5), None),
             ((2, 3, 2, 3, 5), torch.channels_last_3d), ((1, 3, 8, 8), "hwc")]
    for shape, fmt in cases:
        x = torch.randn(shape, generator=g, dtype=torch.float32) * 4
        _specials(x, [nan_a, nan_b, float("inf"), -float("inf"), 0.0, -0.0, 1e-40, 3e38, -3e38])
        if fmt == "hwc":  # one HWC image unsqueezed: channels last, the batch's stride not the canonical one
            x = x[0].permute(1, 2, 0).contiguous().permute(2, 0, 1).unsqueeze(0)
        elif fmt is not None:
            x = x.contiguous(memory_format=fmt)
        c = shape[1]
        w, b = torch.randn(c, generator=g, dtype=torch.float32), torch.randn(c, generator=g, dtype=torch.float32)
        mean = torch.randn(c, generator=g, dtype=torch.float32)
        var = torch.rand(c, generator=g, dtype=torch.float32) * 3
        _specials(w, [nan_b, 0.0, float("inf")])
        _specials(b, [-0.0, nan_a, 0.0])
        _specials(var, [0.0, 1e-30, float("nan")])
        for weight, bias in ((w, b), (None, None), (w, None)):
            for eps in (1e-5, 1e-3):
                want = aten._native_batch_norm_legit_no_training(x, weight, bias, mean, var, 0.1, eps)[0]
                alpha, beta = torch.ops.torchreplay.batch_norm_terms(weight, bias, mean, var, eps)
                got = torch.ops.torchreplay.channel_affine(x, alpha, beta, weight, bias, mean, var, eps)
                if got.stride() != want.stride() or not torch.equal(got.view(torch.int32), want.view(torch.int32)):
                    logger.info("torchreplay: batch norms keep eager's kernel here: torchreplay::channel_affine "
                                "differs from it on a %s map (Note [Batch norm as a channel affine])",
                                "x".join(map(str, shape)))
                    return False
    return True


def batch_norms_as_channel_affines(gm: torch.fx.GraphModule) -> int:
    """Note [Batch norm as a channel affine]: each inference batch norm whose result alone is read,
    on a map eager runs its dense kernels for, as torchreplay::batch_norm_terms and
    torchreplay::channel_affine, where exact_here(). Returns how many it rewrote."""
    count = 0
    for bn in list(gm.graph.nodes):
        if bn.op != "call_function" or bn.target != aten._native_batch_norm_legit_no_training.default or \
                bn.kwargs or len(bn.args) != 7:
            continue
        x, weight, bias, mean, var, _, eps = bn.args
        users = list(bn.users)
        xv: Optional[torch.Tensor] = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
        if not users or any(u.target != operator.getitem or u.args[1] != 0 for u in users) or \
                not isinstance(xv, torch.Tensor) or not _layout_ok(xv):
            continue
        out = users[0].meta.get("val")
        if not isinstance(out, torch.Tensor) or not isinstance(mean, torch.fx.Node) or \
                not isinstance(var, torch.fx.Node) or not all(_param_ok(p, xv.shape[1]) for p in (weight, bias, mean, var)):
            continue
        if not exact_here():
            return count
        with gm.graph.inserting_before(bn):
            terms = gm.graph.call_function(torch.ops.torchreplay.batch_norm_terms.default,
                                           (weight, bias, mean, var, eps))
            alpha = gm.graph.call_function(operator.getitem, (terms, 0))
            beta = gm.graph.call_function(operator.getitem, (terms, 1))
            affine = gm.graph.call_function(torch.ops.torchreplay.channel_affine.default,
                                            (x, alpha, beta, weight, bias, mean, var, eps))
        mv = mean.meta["val"]
        terms.meta["val"] = (torch.empty_like(mv), torch.empty_like(mv))
        alpha.meta["val"], beta.meta["val"] = terms.meta["val"]
        affine.meta["val"] = out
        for u in users:
            u.replace_all_uses_with(affine)
            gm.graph.erase_node(u)
        gm.graph.erase_node(bn)
        count += 1
    return count
