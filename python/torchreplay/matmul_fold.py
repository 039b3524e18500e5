"""Matmuls traced as eager runs them, whatever the parameters' requires_grad (torchreplay.capture).

Note [Matmuls folded as eager folds them]
ATen's matmul (and linear, which calls it for an input of 3 or more dims that is not contiguous)
multiplies a batch of matrices by one matrix either as one mm over the batch folded into rows
("fold") or as a bmm over the matrix expanded. LinearAlgebra.cpp's should_fold folds when the
folded view needs no copy, and also, with a copy (reshape of a non-contiguous input), whenever the
matrix requires grad, even under no_grad: a Linear's weight does, unless frozen. mm and bmm round
differently, so which one runs is part of eager's bits. torch.export's decomposition step
(run_decompositions) traces the parameters as tensors that do not require grad, so it decomposes
such a matmul as the bmm that eager runs only for frozen weights: `fc(x.permute(2, 0, 1))` differed
from eager in the last bits. torch.compile's AOTAutograd traces the real requires_grad and is right.

The decomposition also differs from eager where the batch is not contiguous but folds as a view
(a Linear on x[..., 3:11]): eager folds, the decomposition runs a bmm. So before the
decompositions, each linear or matmul whose fold depends on requires_grad (the matrix operand
requires grad in export's graph, and the batched operand cannot be folded without a copy), or
whose batch folds as a view without being contiguous, is written as eager's fold: reshape (a copy), mm or mv, _unsafe_view, and for linear its
bias added; and the parameters its matrix operand reads are returned with the requires_grad the
trace saw, which every call checks (CaptureChecks::grad_traced): a call after one changed traces
again (captured.py). torch.compile has the opposite gap: Dynamo does not guard a module
parameter's requires_grad (Note [Leaves' requires_grad] in training_guards.py), so a graph
compiled under no_grad while a weight required grad kept folding after it was frozen; the
backend's requires_grad guard covers, under no_grad, the parameters that decide such a fold
(deciding_inputs).
"""
from __future__ import annotations

import operator
from typing import Any, List, Optional, Set, Tuple

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from .fx_views import root

aten = torch.ops.aten


def _foldable_without_copy(sizes, strides) -> bool:
    """should_fold's stride test: t1.view(-1, t1.size(-1)) needs no copy."""
    return all(statically_known_true(strides[i] == strides[i + 1] * sizes[i + 1]) for i in range(len(sizes) - 2))


# The calls that are a matmul or a linear: aten's (export's graph), torch's (Dynamo's graph).
_MATMULS = {aten.matmul.default, torch.matmul, operator.matmul, "matmul", "__matmul__"}
_LINEARS = {aten.linear.default, torch._C._nn.linear, torch.nn.functional.linear}


def _val(n: Any) -> Any:
    return n.meta.get("val", n.meta.get("example_value")) if isinstance(n, torch.fx.Node) else None


def _operands(n: torch.fx.Node):
    """(tensor1, tensor2, bias, is_linear) of the matmul eager runs for this node, or None where it
    runs none that can fold (linear of a 2-D input with a bias is addmm; of a contiguous input,
    _flatten_nd_linear)."""
    if n.op not in ("call_function", "call_method") or len(n.args) < 2:
        return None
    if n.target in _MATMULS and len(n.args) == 2 and not n.kwargs:
        return n.args[0], n.args[1], None, False
    if n.target not in _LINEARS:
        return None
    x, w = n.args[0], n.args[1]
    b = n.args[2] if len(n.args) > 2 else n.kwargs.get("bias")
    xv = _val(x)
    if not isinstance(xv, torch.Tensor):
        return None
    if b is not None and (xv.dim() == 2 or xv.is_contiguous()):
        return None
    return x, w, b, True


def _sensitive(t1, t2, matrix_requires_grad: bool) -> Optional[Tuple[bool, bool]]:
    """For a matmul of fake tensors t1 @ t2: None if export's decomposition folds as eager does,
    else (whether the trace must fold, whether requires_grad decided it): the matrix operand
    requires grad (eager folds with a copy), or the batch is not contiguous but folds as a view
    (eager folds it whatever requires_grad is; the decomposition runs a bmm there)."""
    larger = t1.dim() >= t2.dim()
    big = t1 if larger else t2.mT
    small_dim = t2.dim() if larger else t1.dim()
    if not (big.dim() >= 3 and small_dim <= 2):
        return None
    without_grad = t1.dim() != 2 and (statically_known_true(big.numel() == 0) or
                                      _foldable_without_copy(big.shape, big.stride()))
    if without_grad:
        return None if big.is_contiguous() else (True, False)
    return matrix_requires_grad, True


def _size(graph: torch.fx.Graph, node: torch.fx.Node, shape, d: int):
    """Size d of node (of shape `shape`): the int, or a sym_size node for a symbolic one."""
    size = shape[d]
    if isinstance(size, int):
        return size
    return graph.call_function(aten.sym_size.int, (node, d))


def _fold(graph: torch.fx.Graph, n: torch.fx.Node, tensor1: torch.fx.Node, tensor2: torch.fx.Node,
          bias: Optional[torch.fx.Node], linear: bool) -> torch.fx.Node:
    """Eager's folded matmul (_matmul_impl's should_fold branch) of tensor1 @ tensor2, inserted
    before n; for a linear, tensor2 is the weight, multiplied as its transpose, and the bias is
    added after (linear's output.add_(bias))."""
    v1, v2 = tensor1.meta["val"], tensor2.meta["val"]
    call = graph.call_function
    with graph.inserting_before(n):
        if linear:
            tensor2, v2 = call(aten.t.default, (tensor2,)), v2.t()
        transpose = v2.dim() > v1.dim()
        if transpose:
            t1, s1 = call(aten.transpose.int, (tensor2, -2, -1)), v2.mT.shape
            t2 = call(aten.t.default, (tensor1,)) if v1.dim() == 2 else tensor1
            t2_shape = v1.t().shape if v1.dim() == 2 else v1.shape
        else:
            t1, s1, t2, t2_shape = tensor1, v1.shape, tensor2, v2.shape
        dims = [_size(graph, t1, s1, d) for d in range(len(s1))]
        output_shape = dims[:-1]
        folded = call(aten.reshape.default, (t1, [-1, dims[-1]]))
        if len(t2_shape) == 2:
            cols = _size(graph, t2, t2_shape, 1)
            out = call(aten._unsafe_view.default, (call(aten.mm.default, (folded, t2)), output_shape + [cols]))
            if transpose:
                out = call(aten.clone.default, (call(aten.transpose.int, (out, -2, -1)),),
                           {"memory_format": torch.contiguous_format})
        else:
            out = call(aten._unsafe_view.default, (call(aten.mv.default, (folded, t2)), output_shape))
        if bias is not None:
            out = call(aten.add.Tensor, (out, bias))
    return out


def _deciding(gm: torch.fx.GraphModule):
    """Each node whose fold depends on requires_grad: (node, operands, must fold, the placeholder
    its matrix operand is read from, or None)."""
    placeholders = {}   # the storage of each placeholder's fake tensor -> the placeholder
    for p in gm.graph.find_nodes(op="placeholder"):
        if isinstance(_val(p), torch.Tensor) and not is_traceable_wrapper_subclass(_val(p)):
            placeholders.setdefault(StorageWeakRef(_val(p).untyped_storage()), p)
    for n in list(gm.graph.nodes):
        ops = _operands(n)
        if ops is None:
            continue
        t1, t2, bias, is_linear = ops
        v1, v2 = _val(t1), _val(t2)
        if not isinstance(v1, torch.Tensor) or not isinstance(v2, torch.Tensor):
            continue
        if is_traceable_wrapper_subclass(v1) or is_traceable_wrapper_subclass(v2):
            continue  # the subclass's own matmul runs (torchao's quantized weights), not ATen's fold
        if is_linear:
            v2 = v2.t()
        matrix = t2 if v1.dim() >= v2.dim() else t1
        start = root(matrix)
        if start.op != "placeholder":  # a view the chain does not follow (an item of a split)
            start = placeholders.get(StorageWeakRef(_val(matrix).untyped_storage()), start)
        # a view of a parameter requires grad as the parameter does, also one made under no_grad
        # (eager's split of MultiheadAttention's in_proj_weight), where export's fake one does not
        requires_grad = _val(matrix).requires_grad or (start.op == "placeholder" and _val(start).requires_grad)
        decision = _sensitive(v1, v2, requires_grad)
        if decision is None:
            continue
        fold, by_grad = decision
        yield n, ops, fold, start if by_grad and start.op == "placeholder" else None


def deciding_inputs(gm: torch.fx.GraphModule) -> Set[int]:
    """The placeholders (by position) of a graph (Dynamo's) whose requires_grad decides how one of
    its matmuls folds: a guard on them recompiles when one changes (training_guards.py)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return {placeholders.index(p) for _, _, _, p in _deciding(gm) if p is not None}


def fold_as_eager(gm: torch.fx.GraphModule) -> List[torch.fx.Node]:
    """Note [Matmuls folded as eager folds them]: rewrites export's graph (before its
    decompositions) in place; returns the placeholders whose requires_grad decided a fold."""
    decided: Set[torch.fx.Node] = set()
    changed = False
    for n, (t1, t2, bias, is_linear), fold, start in _deciding(gm):
        if start is not None:
            decided.add(start)
        if not fold:
            continue
        out = _fold(gm.graph, n, t1, t2, bias, linear=is_linear)
        n.replace_all_uses_with(out)
        gm.graph.erase_node(n)
        changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()
    return sorted(decided, key=lambda p: list(gm.graph.nodes).index(p))
