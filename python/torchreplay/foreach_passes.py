"""The graph passes of foreach ops (a compiled optimizer's): reinplace_foreach and
reinplace_foreach_all run a functional foreach op in place where the graph writes its results back
into its first list; decompose_foreach writes ATen's CPU slow path out as per-tensor ops (Note
[Foreach ops as per-tensor ops]), which the tape fuses. Run by passes.run_passes."""
from __future__ import annotations

import operator
from typing import Any, Dict, Optional, Sequence

import torch
import torch.fx

from .fx_views import is_view, root, users_closure

aten = torch.ops.aten


def _inplace_foreach(target: Any) -> Any:
    """The in-place overload of a functional foreach op (`_foreach_mul.Scalar` ->
    `_foreach_mul_.Scalar`), or None."""
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.name.startswith("aten::_foreach_") or schema.is_mutable:
        return None
    packet = getattr(torch.ops.aten, schema.name[len("aten::"):] + "_", None)
    overload = getattr(packet, target._overloadname, None) if packet is not None else None
    if overload is None or [a.name for a in overload._schema.arguments] != [a.name for a in schema.arguments]:
        return None
    return overload


def reinplace_foreach(gm: torch.fx.GraphModule) -> int:
    """`r = _foreach_op(xs, ...); ... r[i] ...` -> `_foreach_op_(xs, ...); ... xs[i] ...`.

    AOTAutograd functionalizes an optimizer's in-place foreach updates (`_foreach_mul_(exp_avg,
    beta1)`) into out-of-place ops on fresh lists, and writes the results back into the state
    with a `copy_` per tensor at the end: an allocation per tensor per op, and the copies. When
    nothing reads a tensor of `xs` after the op (only writes into it by `copy_` may follow, and
    those then copy a tensor onto itself and go), the in-place op gives the same bits (the same
    kernel) with neither. Returns how many ops were rewritten."""
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}  # erasing nodes keeps the others' order
    rewritten = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or not node.args or not isinstance(node.args[0], (list, tuple)):
            continue
        inplace = _inplace_foreach(node.target)
        xs = list(node.args[0])
        if inplace is None or not xs or not all(isinstance(x, torch.fx.Node) for x in xs) or len(set(xs)) != len(xs):
            continue
        if not all(u.op == "call_function" and u.target is operator.getitem for u in node.users):
            continue
        others = [root(a) for arg in list(node.args[1:]) + list(node.kwargs.values())
                  for a in (arg if isinstance(arg, (list, tuple)) else [arg]) if isinstance(a, torch.fx.Node)]
        results = {i: [g for g in node.users if g.args[1] == i] for i in range(len(xs))}
        if any(x in others for x in xs) or not _same_layouts(node, xs) or \
                not all(_overwritable(x, node, results[i], order) for i, x in enumerate(xs)):
            continue
        node.target = inplace
        for g in list(node.users):
            g.replace_all_uses_with(xs[g.args[1]])
            graph.erase_node(g)
        for x in xs:  # copies of a tensor onto itself
            for u in list(x.users):
                if u.op == "call_function" and u.target is aten.copy_.default and u.args[:2] == (x, x):
                    u.replace_all_uses_with(x)
                    graph.erase_node(u)
        rewritten += 1
    return rewritten


def _same_layouts(node: torch.fx.Node, xs: Sequence[torch.fx.Node]) -> bool:
    """Each result has its tensor's dtype, sizes and strides (an in-place op cannot broadcast into
    it), and is float32 or float64: for reduced precision the in-place foreach kernels round
    otherwise than the out-of-place ones (bfloat16 `_foreach_mul_` against `_foreach_mul`)."""
    vals = node.meta.get("val")
    if not isinstance(vals, (list, tuple)) or len(vals) != len(xs):
        return False
    for x, v in zip(xs, vals):
        xv = x.meta.get("val")
        if not isinstance(xv, torch.Tensor) or not isinstance(v, torch.Tensor) or \
                xv.dtype not in (torch.float32, torch.float64) or v.dtype != xv.dtype or \
                v.shape != xv.shape or v.stride() != xv.stride():
            return False
    return True


def _overwritable(x: torch.fx.Node, op: torch.fx.Node, results: Sequence[torch.fx.Node],
                  order: Dict[torch.fx.Node, int]) -> bool:
    """Whether `op` may write x in place, its result `results` (the getitems taking it) becoming
    x: x is a fresh tensor (no view of anything), or a graph input the graph writes this very
    result back into (`copy_(x, result)`: the caller's tensor ends up holding it anyway; any other
    input is the caller's, which the graph must leave as it is); no view of x is taken; and after
    `op` nothing reads x and nothing writes it before the last read of the result (through views
    too)."""
    readers = [u for r in results for u in [r, *users_closure(r)]]
    last_read = len(order) if any(u.op == "output" for u in readers) else \
        max((order[u] for u in readers), default=order[op])
    if x.op == "call_function":
        producer = x.args[0] if x.target is operator.getitem else x
        if not isinstance(producer, torch.fx.Node) or is_view(producer) or \
                getattr(producer.target, "_schema", None) is None or producer.target._schema.is_mutable:
            return False
    elif x.op != "placeholder" or not any(
            u.op == "call_function" and u.target is aten.copy_.default and u.args[0] is x and u.args[1] in results
            for u in x.users):
        return False
    if any(is_view(u) for u in x.users):
        return False  # a view of x, taken before op or after, would read what op writes
    for u in x.users:
        if u is op or order[u] < order[op]:
            continue
        if u.op == "call_function" and u.target is aten.copy_.default and u.args[0] is x and \
                (u.args[1] in results or order[u] > last_read):
            continue  # the write-back of the result itself, or a write after its last read
        return False
    return True


def reinplace_foreach_all(gm: torch.fx.GraphModule) -> int:
    """reinplace_foreach until it rewrites nothing more: rewriting one op can make an earlier one
    rewritable (Adam's `_foreach_mul(exp_avg_sqs, beta2)` is written back into the state only once
    the `_foreach_addcmul` after it runs in place on its result). Returns how many were rewritten."""
    total = 0
    while True:
        n = reinplace_foreach(gm)
        total += n
        if n == 0:
            return total


# Note [Foreach ops as per-tensor ops]
# On the CPU every foreach op is ATen's slow path (ForeachOpsKernels.cpp, torch 2.11): a loop
# calling one ATen op per tensor, `t.add_(scalar)` for `_foreach_add_.Scalar`, `t1.add(t2, alpha)`
# for `_foreach_add.List`, `at::pow(scalar, t)` for `_foreach_pow.ScalarAndTensor`, and so on.
# decompose_foreach writes that loop out in the graph: each CPU foreach op becomes the per-tensor
# ops its slow path calls, the same overloads with the same scalar arguments, in place where the
# slow path is in place, and each getitem of a functional foreach op's result becomes the
# per-tensor node it takes (the table is _PER_TENSOR; `_foreach_maximum` and `_foreach_minimum`
# are clamp_min and clamp_max there). The bits are the slow path's by construction: the same
# kernels run on the same tensors in the same order. Foreach ops on other devices (CUDA has fused
# kernels of its own), the `.Tensor` overloads of addcmul and addcdiv (their scalars are read from
# a tensor at run time), and ops whose results are used other than through getitems stay as they
# are.
#
# The per-tensor ops then come op by op: all tensors' first op, then all tensors' second op. For
# the kernel tape to fuse each tensor's chain (Note [Fused elementwise steps]), the nodes of a
# region (consecutive nodes made by this decomposition) are put in order of tensor index, keeping
# each index's own order: the chain of the first tensor of the lists, then the second's. That is
# safe when no two indices interact: no node of one index reads a value a node of another index
# made, and no tensor (by the storage its views start from) that a node of one index writes is
# read or written by a node of another index. Then every node sees the same values and memory as
# before, and the nodes after the region the same final state. It is not applied to a region
# where either fails: lists that share a tensor (`_foreach_add_([a, a], 1)`, a view of one
# tensor in another's place), or an op reading another index's result; that region keeps the
# graph's order, op by op.
def _bound(node: torch.fx.Node) -> Optional[Dict[str, Any]]:
    """node's arguments by schema name, defaults filled in; None where they do not bind."""
    schema = node.target._schema
    bound: Dict[str, Any] = {}
    for k, a in enumerate(schema.arguments):
        if k < len(node.args):
            bound[a.name] = node.args[k]
        elif a.name in node.kwargs:
            bound[a.name] = node.kwargs[a.name]
        elif a.has_default_value():
            bound[a.name] = a.default_value
        else:
            return None
    return bound


_FOREACH_UNARY = (
    "abs", "acos", "asin", "atan", "ceil", "cos", "cosh", "erf", "erfc", "exp", "expm1", "floor", "frac",
    "lgamma", "log", "log10", "log1p", "log2", "neg", "reciprocal", "round", "rsqrt", "sigmoid", "sign", "sin",
    "sinh", "sqrt", "tan", "tanh", "trunc")
# (foreach name, foreach overload) -> (per-tensor op, its functional overload, its in-place overload)
_PER_TENSOR: Dict[tuple, tuple] = {}
for _op in ("add", "sub", "mul", "div"):
    for _ovl in ("Scalar", "ScalarList"):
        _PER_TENSOR[(_op, _ovl)] = (_op, "Scalar", "Scalar")
    _PER_TENSOR[(_op, "List")] = (_op, "Tensor", "Tensor")
    _PER_TENSOR[(_op, "Tensor")] = (_op, "Tensor", "Tensor")
for _op, _to in (("clamp_min", "clamp_min"), ("clamp_max", "clamp_max"), ("maximum", "clamp_min"),
                 ("minimum", "clamp_max")):
    for _ovl in ("Scalar", "ScalarList"):
        _PER_TENSOR[(_op, _ovl)] = (_to, "default", "default")
    _PER_TENSOR[(_op, "List")] = (_to, "Tensor", "Tensor")
for _ovl in ("Scalar", "ScalarList"):
    _PER_TENSOR[("pow", _ovl)] = ("pow", "Tensor_Scalar", "Scalar")
    _PER_TENSOR[("lerp", _ovl)] = ("lerp", "Scalar", "Scalar")
    _PER_TENSOR[("addcmul", _ovl)] = ("addcmul", "default", "default")
    _PER_TENSOR[("addcdiv", _ovl)] = ("addcdiv", "default", "default")
_PER_TENSOR[("pow", "List")] = ("pow", "Tensor_Tensor", "Tensor")
_PER_TENSOR[("pow", "ScalarAndTensor")] = ("pow", "Scalar", None)
_PER_TENSOR[("lerp", "List")] = ("lerp", "Tensor", "Tensor")
_PER_TENSOR[("copy", "default")] = (None, None, ("copy", "default"))
_PER_TENSOR[("zero", "default")] = (None, None, ("zero", "default"))
for _op in _FOREACH_UNARY:
    _PER_TENSOR[(_op, "default")] = (_op, "default", "default")
# Keyword-only arguments of the per-tensor ops (the slow path passes them all).
_KEYWORD = {"alpha": "alpha", "value": "value"}
_POINTWISE = (aten.addcmul.default, aten.addcmul_.default, aten.addcdiv.default, aten.addcdiv_.default)


def _per_tensor_op(node: torch.fx.Node) -> Optional[tuple]:
    """(per-tensor OpOverload, in place) for a foreach node, or None."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.name.startswith("aten::_foreach_"):
        return None
    name = schema.name[len("aten::_foreach_"):]
    inplace = schema.is_mutable
    if inplace:
        name = name[:-1] if name.endswith("_") else name
    entry = _PER_TENSOR.get((name, node.target._overloadname))
    if entry is None:
        return None
    if entry[0] is None:  # copy_, zero_: in place only
        if not inplace:
            return None
        op, ovl = entry[2]
        packet = getattr(aten, op + "_")
    else:
        op, functional, in_place = entry
        if inplace and in_place is None:
            return None
        packet = getattr(aten, op + "_" if inplace else op, None)
        ovl = in_place if inplace else functional
    target = getattr(packet, ovl, None) if packet is not None else None
    return (target, inplace) if target is not None else None


def _on_cpu(v: Any) -> bool:
    if isinstance(v, torch.fx.Node):
        v = v.meta.get("val")
    return isinstance(v, torch.Tensor) and v.device.type == "cpu"


def decompose_foreach(gm: torch.fx.GraphModule) -> int:
    """Note [Foreach ops as per-tensor ops]: each CPU foreach op becomes the per-tensor ATen ops its
    slow path calls, and the per-tensor nodes of a region are put in order of tensor index where
    no index reads another's values or memory it writes. Returns how many foreach ops became
    per-tensor ops."""
    graph = gm.graph
    index_of: Dict[torch.fx.Node, int] = {}
    decomposed = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        found = _per_tensor_op(node)
        bound = _bound(node) if found is not None else None
        if found is None or bound is None:
            continue
        target, inplace = found
        schema = node.target._schema
        lists = [a.name for a in schema.arguments if isinstance(bound[a.name], (list, tuple))]
        tensor_lists = [a.name for a in schema.arguments
                        if a.type.kind() == "ListType" and a.type.getElementType().kind() in ("TensorType",)]
        if not lists or not tensor_lists:
            continue
        length = len(bound[lists[0]])
        if length == 0 or any(len(bound[k]) != length for k in lists):
            continue
        tensors = [t for k in tensor_lists for t in bound[k]]
        tensors += [bound[a.name] for a in schema.arguments
                    if a.type.kind() == "TensorType" and isinstance(bound[a.name], torch.fx.Node)]
        if not all(_on_cpu(t) for t in tensors):
            continue
        vals = node.meta.get("val")
        if not inplace and (not isinstance(vals, (list, tuple)) or len(vals) != length or not all(
                u.op == "call_function" and u.target is operator.getitem and isinstance(u.args[1], int)
                for u in node.users)):
            continue
        made = []
        with graph.inserting_before(node):
            for i in range(length):
                args, kwargs = [], {}
                for a in schema.arguments:
                    v = bound[a.name]
                    v = v[i] if a.name in lists else v
                    if a.name in _KEYWORD:
                        kwargs[_KEYWORD[a.name]] = v
                    elif a.name == "scalars" and target in _POINTWISE:  # addcmul's, addcdiv's value
                        kwargs["value"] = v
                    else:
                        args.append(v)
                new = graph.call_function(target, tuple(args), kwargs)
                self_arg = args[0] if args else None
                if inplace:
                    if isinstance(self_arg, torch.fx.Node) and "val" in self_arg.meta:
                        new.meta["val"] = self_arg.meta["val"]
                else:
                    new.meta["val"] = vals[i]
                index_of[new] = i
                made.append(new)
        for u in list(node.users):
            u.replace_all_uses_with(made[u.args[1]])
            graph.erase_node(u)
        graph.erase_node(node)
        decomposed += 1
    _order_by_index(graph, index_of)
    return decomposed


def _written(node: torch.fx.Node) -> list:
    """The tensor arguments node writes (through its schema's alias annotations)."""
    schema = node.target._schema
    out = []
    for k, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            v = node.args[k] if k < len(node.args) else node.kwargs.get(a.name)
            if isinstance(v, torch.fx.Node):
                out.append(v)
    return out


def _order_by_index(graph: torch.fx.Graph, index_of: Dict[torch.fx.Node, int]) -> int:
    """Note [Foreach ops as per-tensor ops]: each region of per-tensor nodes in order of tensor
    index where that is safe. Returns how many regions were reordered."""
    regions, run = [], []
    for node in graph.nodes:
        if node in index_of:
            run.append(node)
            continue
        if run:
            regions.append(run)
        run = []
    if run:
        regions.append(run)
    reordered = 0
    for region in regions:
        if len({index_of[n] for n in region}) < 2:
            continue
        members = set(region)
        touched: Dict[torch.fx.Node, set] = {}  # root -> indices that read or write it
        written: Dict[torch.fx.Node, set] = {}  # root -> indices that write it
        safe = True
        for n in region:
            i = index_of[n]
            for a in n.all_input_nodes:
                if a in members and index_of[a] != i:
                    safe = False
                touched.setdefault(root(a), set()).add(i)
            for w in _written(n):
                written.setdefault(root(w), set()).add(i)
        for base, writers in written.items():
            if len(writers | touched.get(base, set())) > 1:
                safe = False
        if not safe:
            continue
        order = {n: k for k, n in enumerate(region)}
        at = region[0].prev
        for n in sorted(region, key=lambda n: (index_of[n], order[n])):
            at.append(n)
            at = n
        reordered += 1
    return reordered
