"""FX passes run on the ATen graph before lowering: the user's pre pass, the built-in passes, the
user's post pass (config.post_grad_custom_pre_pass / post_grad_custom_post_pass, as in torchair).

Over 600 lines, not split yet: the foreach passes (reinplace_foreach, reinplace_foreach_all,
decompose_foreach) share the view and root helpers (_is_view, _root, _users_closure) with the
input-update and wait passes; the cut is the foreach passes into a module of their own with those
helpers in a third."""
from __future__ import annotations

import operator
from typing import Any, Dict, Optional, Sequence

import torch
import torch.fx

aten = torch.ops.aten

# Functional "update" ops AOTAutograd leaves for in-place writes into graph inputs, and the
# in-place op that does the same write without copying the whole input.
_INPLACE_OF = {
    aten.index_copy.default: aten.index_copy_.default,
    aten.index_put.default: aten.index_put_.default,
    aten.index_add.default: aten.index_add_.default,
    aten.scatter.src: aten.scatter_.src,
    aten.scatter.value: aten.scatter_.value,
    aten.masked_fill.Scalar: aten.masked_fill_.Scalar,
}


def remove_dead_code(gm: torch.fx.GraphModule) -> None:
    """Drops pure nodes whose results are unused (mutating ops are kept: FX sees them impure)."""
    gm.graph.eliminate_dead_code()


def _is_view(node: torch.fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return bool(schema and schema.returns and schema.returns[0].alias_info is not None
                and not schema.returns[0].alias_info.is_write)


def _read_after(node: torch.fx.Node, position: int, order: Dict[torch.fx.Node, int],
                skip: Sequence[torch.fx.Node]) -> bool:
    """Whether `node`'s memory is read at or after `position` (through views too), other than by
    the nodes in `skip`."""
    for user in node.users:
        if user in skip:
            continue
        if order[user] >= position or (_is_view(user) and _read_after(user, position, order, skip)):
            return True
    return False


def reinplace_input_updates(gm: torch.fx.GraphModule) -> int:
    """`new = index_copy(buf, ...); ...; copy_(buf, new)` -> `index_copy_(buf, ...)`.

    With keep_inference_input_mutations, AOTAutograd expresses a write into an input (a KV cache
    updated in place, a buffer) as a functional op that copies the whole input, and a copy_ back
    at the end: two full copies per call. When nothing reads the input's old value after the
    functional op, the in-place op does the same write and both copies go. Returns how many were
    rewritten."""
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    rewritten = 0
    for copy in list(graph.nodes):
        if copy.op != "call_function" or copy.target is not aten.copy_.default or len(copy.args) != 2:
            continue
        buf, new = copy.args
        if not isinstance(buf, torch.fx.Node) or buf.op != "placeholder" or not isinstance(new, torch.fx.Node):
            continue
        inplace = _INPLACE_OF.get(new.target)
        if inplace is None or not new.args or new.args[0] is not buf or order[new] > order[copy]:
            continue
        if any(a is buf for a in list(new.args[1:]) + list(new.kwargs.values())):
            continue
        if _read_after(buf, order[new], order, skip=(new, copy)):
            continue  # the old value is still needed after the update
        if any(_is_view(u) and new in _users_closure(u) for u in buf.users if u is not new):
            continue  # an argument of the update is a view of the input itself
        new.target = inplace
        copy.replace_all_uses_with(new)
        graph.erase_node(copy)
        rewritten += 1
    return rewritten


def _users_closure(node: torch.fx.Node) -> set:
    seen, todo = set(), [node]
    while todo:
        for u in todo.pop().users:
            if u not in seen:
                seen.add(u)
                todo.append(u)
    return seen


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
        others = [_root(a) for arg in list(node.args[1:]) + list(node.kwargs.values())
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


def _root(n: torch.fx.Node) -> torch.fx.Node:
    """The tensor a chain of views starts from."""
    while _is_view(n) and n.args and isinstance(n.args[0], torch.fx.Node):
        n = n.args[0]
    return n


def _overwritable(x: torch.fx.Node, op: torch.fx.Node, results: Sequence[torch.fx.Node],
                  order: Dict[torch.fx.Node, int]) -> bool:
    """Whether `op` may write x in place, its result `results` (the getitems taking it) becoming
    x: x is a fresh tensor (no view of anything), or a graph input the graph writes this very
    result back into (`copy_(x, result)`: the caller's tensor ends up holding it anyway; any other
    input is the caller's, which the graph must leave as it is); no view of x is taken; and after
    `op` nothing reads x and nothing writes it before the last read of the result (through views
    too)."""
    readers = [u for r in results for u in [r, *_users_closure(r)]]
    last_read = len(order) if any(u.op == "output" for u in readers) else \
        max((order[u] for u in readers), default=order[op])
    if x.op == "call_function":
        producer = x.args[0] if x.target is operator.getitem else x
        if not isinstance(producer, torch.fx.Node) or _is_view(producer) or \
                getattr(producer.target, "_schema", None) is None or producer.target._schema.is_mutable:
            return False
    elif x.op != "placeholder" or not any(
            u.op == "call_function" and u.target is aten.copy_.default and u.args[0] is x and u.args[1] in results
            for u in x.users):
        return False
    if any(_is_view(u) for u in x.users):
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
                touched.setdefault(_root(a), set()).add(i)
            for w in _written(n):
                written.setdefault(_root(w), set()).add(i)
        for root, writers in written.items():
            if len(writers | touched.get(root, set())) > 1:
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


def sink_waits(gm: torch.fx.GraphModule) -> int:
    """Moves the wait of each collective down to the first node that reads its result.

    A trace puts `wait_tensor` right after its collective, so nothing could run while the
    collective is in flight. Moved down, the nodes between run meanwhile: compute overlaps with
    communication (Note [Collective steps] in tape/collective_steps.h). The collectives are
    issued where they were, in the same order on every rank; only waits move. A wait stops before
    any node that writes memory (the process group may still be reading the collective's input)
    and before the output. Returns how many waits moved."""
    wait = getattr(getattr(torch.ops, "_c10d_functional", None), "wait_tensor", None)
    if wait is None:
        return 0
    moved = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not wait.default:
            continue
        at = node.next
        while at.op == "call_function" and node not in at.all_input_nodes:
            schema = getattr(at.target, "_schema", None)
            if schema is None or schema.is_mutable:
                break
            at = at.next
        if at is not node.next:
            at.prepend(node)
            moved += 1
    return moved


# Note [Dtypes the kernels give]
# The graph's values carry what the fake kernels said of them when it was traced (node.meta
# "val"), and the lowering takes each input's dtype from it (the engine checks a call's inputs
# against it). For the ops below that is not what ATen's kernels give when an operand is half or
# bfloat16 (PyTorch 2.11, found by running each op of the op database and these ops with mixed
# dtypes against its fake kernel, tests/python/test_reduced_precision.py):
#   - norms of a half or bfloat16 input with float32 weights or running statistics (layer norm,
#     group norm, batch norm in each of its forms; CPU autocast's Linear -> LayerNorm makes one):
#     the CPU kernels give the saved mean and rstd in float32, the fake kernels the input's dtype;
#   - the functional batch norms with half or bfloat16 running statistics: the kernels give the
#     new statistics in their dtype, the fake kernels in float32;
#   - group norm's backward with float32 weights: the kernel gives the input's gradient in the
#     input's dtype, the fake kernel in float32;
#   - _weight_norm_interface of half tensors: the kernel gives the norms in float32.
# A training graph saves the forward's statistics for its backward, whose inputs then refused
# the kernel's float32 ("expected dtype BFloat16, got Float") where eager trains. So for these ops
# the dtypes are asked of the kernel itself: it is run once, here, on zeros of the example sizes
# with the operands' dtypes, on their device, and the graph follows what it gives, down through
# the nodes that read its results (their fake kernels run again on the new values). A backward
# graph's inputs saved by its forward take the dtypes the forward's graph gives them (the backend
# passes them, by name). Nothing a kernel computes changes: only what the graph says of it.
_KERNEL_DTYPES = {
    aten.native_layer_norm.default, aten.native_group_norm.default, aten.native_group_norm_backward.default,
    aten.native_batch_norm.default, aten._native_batch_norm_legit.default, aten._native_batch_norm_legit.no_stats,
    aten._native_batch_norm_legit_no_training.default, aten._native_batch_norm_legit_functional.default,
    aten._batch_norm_with_update.default, aten._batch_norm_with_update_functional.default,
    aten._batch_norm_no_update.default, aten._weight_norm_interface.default,
}
_REDUCED = (torch.float16, torch.bfloat16)


def _dtypes(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.dtype
    return [_dtypes(e) for e in v] if isinstance(v, (list, tuple)) else None


def _with_dtypes(val: Any, dtypes: Any) -> Any:
    """The fake value `val` (a tensor or a sequence of them) with these dtypes."""
    if isinstance(val, torch.Tensor):
        if val.dtype == dtypes or not hasattr(val, "fake_mode"):
            return val
        with val.fake_mode:
            return torch.empty_strided(val.shape, val.stride(), dtype=dtypes, device=val.device)
    if isinstance(val, (list, tuple)):
        return type(val)(_with_dtypes(v, d) for v, d in zip(val, dtypes))
    return val


def _kernel_dtypes(node: torch.fx.Node) -> Any:
    """The dtypes node's op gives when its kernel runs on operands of the graph's dtypes (zeros
    of the example sizes, on their device), or None when it cannot be run so."""
    from torch.fx.experimental.symbolic_shapes import has_hint, size_hint
    from torch.utils._python_dispatch import _disable_current_modes

    def real(a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            a = a.meta.get("val")
        if isinstance(a, torch.Tensor):
            if not all(has_hint(d) for d in a.shape):
                raise ValueError("a size without a hint")
            return torch.zeros([size_hint(d) for d in a.shape], dtype=a.dtype, device=a.device)
        if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return size_hint(a) if isinstance(a, torch.SymInt) else a.node.hint
        if isinstance(a, (list, tuple)):
            return type(a)(real(e) for e in a)
        return a

    try:
        with _disable_current_modes(), torch.no_grad(), torch.autocast("cpu", enabled=False):
            out = node.target(*real(node.args), **real(node.kwargs))
    except Exception:  # the fake value stays: no worse than before
        return None
    return _dtypes(out)


def _fake_rerun(node: torch.fx.Node) -> Any:
    """node's value from its fake kernel, run again on its operands' values (None if it fails)."""
    def val(a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            return a.meta.get("val")
        return type(a)(val(e) for e in a) if isinstance(a, (list, tuple)) else a

    old = node.meta.get("val")
    mode = next((t.fake_mode for t in _leaves(old) if hasattr(t, "fake_mode")), None)
    try:
        if node.target is operator.getitem:
            return val(node.args[0])[node.args[1]]
        if mode is None or not isinstance(node.target, torch._ops.OpOverload):
            return None
        with mode:
            return node.target(*val(node.args), **val(node.kwargs))
    except Exception:
        return None


def _leaves(v: Any) -> list:
    return [e for x in v for e in _leaves(x)] if isinstance(v, (list, tuple)) else [v]


def follow_kernel_dtypes(gm: torch.fx.GraphModule, input_dtypes: Optional[Dict[str, torch.dtype]] = None) -> int:
    """Note [Dtypes the kernels give]: the graph's values get the dtypes the kernels give them,
    where the fake kernels said otherwise; `input_dtypes`: the dtypes of placeholders by name (a
    backward's saved tensors, as its forward gives them). Returns how many values changed."""
    changed: set = set()
    for node in gm.graph.nodes:
        old = node.meta.get("val")
        if node.op == "placeholder":
            want = (input_dtypes or {}).get(node.name)
            new = _with_dtypes(old, want) if isinstance(old, torch.Tensor) and want is not None else old
        elif node.op != "call_function":
            continue
        elif node.target in _KERNEL_DTYPES and any(
                isinstance(v, torch.Tensor) and v.dtype in _REDUCED for a in node.all_input_nodes
                for v in _leaves(a.meta.get("val"))):
            want = _kernel_dtypes(node)
            new = _with_dtypes(old, want) if want is not None and _dtypes(old) is not None and \
                len(_leaves(want)) == len(_leaves(_dtypes(old))) else old
        elif any(a in changed for a in node.all_input_nodes):
            new = _fake_rerun(node)
            if new is None or _dtypes(new) is None or _dtypes(new) == _dtypes(old):
                continue
        else:
            continue
        if _dtypes(new) != _dtypes(old):
            node.meta["val"] = new
            changed.add(node)
    return len(changed)


def restore_max_pool1d(gm: torch.fx.GraphModule) -> int:
    """A 1-d max pooling, which export and AOTAutograd write as a 2-d one with indices over an
    unsqueezed input, back as aten::max_pool1d where the indices go unused: what eager runs
    without gradients (max_pool1d_impl, no indices computed), with eager's result strides (the 2-d kernel keeps a transposed
    input's layout, eager's gives a contiguous result) and eager's NaN bits (the 2-d kernel makes
    a bfloat16 NaN's payload the canonical one). Returns how many it rewrote."""
    count = 0
    for pool in list(gm.graph.nodes):
        if pool.op != "call_function" or pool.target != aten.max_pool2d_with_indices.default or pool.kwargs:
            continue
        x, kernel, stride, padding, dilation, ceil = (list(pool.args) + [None] * 6)[:6]
        users = list(pool.users)
        if not (isinstance(x, torch.fx.Node) and x.target == aten.unsqueeze.default and x.args[1] in (-2, 2) and
                len(users) == 1 and users[0].target == operator.getitem and users[0].args[1] == 0 and
                len(users[0].users) == 1):
            continue
        squeeze = next(iter(users[0].users))
        dims = squeeze.args[1] if squeeze.target == aten.squeeze.dims else \
            [squeeze.args[1]] if squeeze.target == aten.squeeze.dim else None
        val = x.args[0].meta.get("val") if isinstance(x.args[0], torch.fx.Node) else None
        if dims is None or list(dims) not in ([-2], [2]) or not isinstance(val, torch.Tensor) or val.dim() != 3:
            continue
        if list(kernel)[0] != 1 or (stride and list(stride)[0] != 1) or (padding and list(padding)[0] != 0) or \
                (dilation and list(dilation)[0] != 1):
            continue
        last = lambda v, default: [v[-1]] if v else [default]  # noqa: E731
        with gm.graph.inserting_before(squeeze):
            out = gm.graph.call_function(aten.max_pool1d.default, (
                x.args[0], [kernel[-1]], last(stride, kernel[-1]), last(padding, 0), last(dilation, 1), bool(ceil)))
        out.meta["val"] = squeeze.meta.get("val")
        squeeze.replace_all_uses_with(out)
        for dead in (squeeze, users[0], pool):
            gm.graph.erase_node(dead)
        count += 1
    return count


BUILTIN_PASSES = (reinplace_input_updates, reinplace_foreach_all, decompose_foreach, restore_max_pool1d,
                  remove_dead_code, sink_waits)


def run_passes(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], config: Any,
               input_dtypes: Optional[Dict[str, torch.dtype]] = None) -> None:
    """The passes, in order: the graph's dtypes made the kernels' (Note [Dtypes the kernels give];
    `input_dtypes` by placeholder name), the user's pre pass, the built-in passes, the user's post
    pass."""
    follow_kernel_dtypes(gm, input_dtypes)
    if config.post_grad_custom_pre_pass is not None:
        config.post_grad_custom_pre_pass(gm, example_inputs, config)
    for p in BUILTIN_PASSES:
        p(gm)
    if config.post_grad_custom_post_pass is not None:
        config.post_grad_custom_post_pass(gm, example_inputs, config)
    gm.graph.lint()
    gm.recompile()
