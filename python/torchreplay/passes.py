"""FX passes run on the ATen graph before lowering: the user's pre pass, the built-in passes, the
user's post pass (config.post_grad_custom_pre_pass / post_grad_custom_post_pass, as in torchair).
Here: the input updates in place, the waits sunk, the dtypes the kernels give, 1-d max pooling,
PT2E's quantize ops as the ATen ops their kernels run, inference batch norms as channel affines
(batch_norms.py), export's metadata asserts dropped where they hold, exact conversions to float32;
the foreach passes are in foreach_passes.py, the view helpers they share in fx_views.py."""
from __future__ import annotations

import operator
from typing import Any, Dict, Optional, Sequence

import torch
import torch.fx

from .batch_norms import batch_norms_as_channel_affines
from .foreach_passes import decompose_foreach, reinplace_foreach_all
from .fx_views import is_view, users_closure

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


def drop_metadata_asserts(gm: torch.fx.GraphModule) -> int:
    """Note [Metadata asserts]: torch.export elides a `.to(dtype)` that changes nothing where it
    traces and leaves `_assert_tensor_metadata(x, dtype=...)` in its place: a dispatcher call per
    replay (about 0.15 µs each; 45 on a 2-layer Llama decode step) that eager never makes. Each
    asserting only a dtype, device or layout is dropped where its tensor has them in the graph
    (after the kernels' dtypes: Note [Dtypes the kernels give]): they are fixed per capture key,
    so the replay's tensor has them too. One that asserts sizes or strides (which the graph's
    fake values may not know as the kernels give them) stays, as one that does not hold."""
    count = 0
    for node in list(gm.graph.nodes):
        if node.target is not aten._assert_tensor_metadata.default:
            continue
        val = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
        want = {**dict(zip(("size", "stride", "dtype"), node.args[1:])), **node.kwargs}
        have = {"dtype": getattr(val, "dtype", None), "device": getattr(val, "device", None),
                "layout": getattr(val, "layout", None)}
        if isinstance(val, torch.Tensor) and all(v is None or (k in have and v == have[k]) for k, v in want.items()):
            gm.graph.erase_node(node)
            count += 1
    return count


_EXACT_IN_FLOAT32 = (torch.int8, torch.uint8, torch.int16, torch.bool)


@torch.library.register_fake("torchreplay::to_float32")
def _to_float32_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x, dtype=torch.float32)


def exact_conversions(gm: torch.fx.GraphModule) -> int:
    """Note [Exact conversions] (capture/tape/copy_steps.cc): a CPU `_to_copy` that only converts
    int8, uint8, int16 or bool values to float32 (every value exact there) becomes
    torchreplay::to_float32, which the tape runs into its planned buffer."""
    count = 0
    for node in gm.graph.nodes:
        if node.target is not aten._to_copy.default or len(node.args) != 1 or \
                not isinstance(node.args[0], torch.fx.Node):
            continue
        x, kw = node.args[0].meta.get("val"), node.kwargs
        if not (isinstance(x, torch.Tensor) and x.device.type == "cpu" and x.dtype in _EXACT_IN_FLOAT32 and
                x.layout == torch.strided and kw.get("dtype") == torch.float32 and
                set(kw) <= {"dtype", "layout", "device", "pin_memory", "non_blocking", "memory_format"} and
                kw.get("layout") in (None, torch.strided) and kw.get("device") in (None, x.device) and
                not kw.get("pin_memory") and not kw.get("non_blocking") and
                kw.get("memory_format") in (None, torch.preserve_format)):
            continue
        node.target, node.args, node.kwargs = torch.ops.torchreplay.to_float32.default, (node.args[0],), {}
        count += 1
    return count


def _read_after(node: torch.fx.Node, position: int, order: Dict[torch.fx.Node, int],
                skip: Sequence[torch.fx.Node]) -> bool:
    """Whether `node`'s memory is read at or after `position` (through views too), other than by
    the nodes in `skip`."""
    for user in node.users:
        if user in skip:
            continue
        if order[user] >= position or (is_view(user) and _read_after(user, position, order, skip)):
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
        if any(is_view(u) and new in users_closure(u) for u in buf.users if u is not new):
            continue  # an argument of the update is a view of the input itself
        new.target = inplace
        copy.replace_all_uses_with(new)
        graph.erase_node(copy)
        rewritten += 1
    return rewritten


def sink_waits(gm: torch.fx.GraphModule) -> int:
    """Moves the wait of each collective down to the first node that reads its result.

    A trace puts `wait_tensor` right after its collective, so nothing could run while the
    collective is in flight. Moved down, the nodes between run meanwhile: compute overlaps with
    communication (Note [Collective steps] in capture/tape/collective_steps.h). The collectives are
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


# Note [PT2E's quantize ops]
# A model quantized by PT2E (torchao's convert_pt2e) computes its int8 arithmetic in fp32 through
# the quantized_decomposed ops (quantize_per_tensor, dequantize_per_channel, ...). torch defines
# them in Python only (torch/ao/quantization/fx/_decomposed.py, CompositeExplicitAutograd): each
# is a few ATen ops on its tensors. Kept as they are, every one would call back into Python at
# each replay; instead each is traced (make_fx, on the node's fake values) into the ATen ops its
# kernel runs and put in its place: eager's ops on eager's operands, so the same bits, and the
# tape fuses them as any elementwise ops. numerics "close" lowers the patterns around
# convolutions and linears to int8 kernels first (close_numerics/quantized.py).
def inline_quantize_ops(gm: torch.fx.GraphModule) -> int:
    """Note [PT2E's quantize ops]: each quantized_decomposed op as the ATen ops of its kernel.
    Returns how many it inlined; one whose trace fails stays an op (its Python kernel per call)."""
    count = 0
    for node in list(gm.graph.nodes):
        op = node.target
        if node.op != "call_function" or not isinstance(op, torch._ops.OpOverload) or \
                op.namespace != "quantized_decomposed":
            continue
        from torch.ao.quantization.fx import _decomposed  # (loaded already: it defines these ops)
        name = op._schema.name.split("::")[1] + ("" if op._overloadname == "default" else "_" + op._overloadname)
        kernel = getattr(_decomposed, name, None)
        count += kernel is not None and replace_with_trace(gm, node, kernel)
    return count


def replace_with_trace(gm: torch.fx.GraphModule, node: torch.fx.Node, fn: Any) -> bool:
    """`node` replaced by the ATen ops fn(*node.args, **node.kwargs) runs, traced (make_fx) on
    the fake values of the nodes among its arguments; whether it was (not where the trace fails,
    makes constants of its own or reads a tensor's value)."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.utils import _pytree as pytree
    inputs = [a for a in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(a, torch.fx.Node)]
    if not all(isinstance(a.meta.get("val"), torch.Tensor) for a in inputs):
        return False

    def call(*values: Any) -> Any:
        bound = dict(zip(inputs, values))
        args, kwargs = torch.fx.map_arg((node.args, node.kwargs), lambda a: bound[a])
        return fn(*args, **kwargs)
    try:
        traced = make_fx(call, tracing_mode="real")(*[a.meta["val"] for a in inputs])
    except Exception:  # noqa: BLE001 - the node stays as it is
        return False
    if any(n.op == "get_attr" or (n.op == "call_function" and (not isinstance(n.target, torch._ops.OpOverload) or
                                                                 n.target == aten._local_scalar_dense.default))
           for n in traced.graph.nodes):
        return False  # (a read of a tensor's value, `scale.item()`: the lowering has no Python float arithmetic)
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    with gm.graph.inserting_before(node):
        out = gm.graph.graph_copy(traced.graph, dict(zip(placeholders, inputs)))
    node.replace_all_uses_with(out)
    gm.graph.erase_node(node)
    return True


# Ops whose ATen implementation only redispatches (BinaryOps.cpp), as the overload they call:
# rsub.Tensor is at::sub with its operands swapped, rsub.Scalar wraps its number first; add, sub,
# mul and div's .Scalar overloads call their .Tensor ones on the number wrapped as a 0-dim tensor
# (which a number in a Tensor position is here too).
_REDISPATCHES = {aten.rsub.Tensor: aten.sub.Tensor, aten.rsub.Scalar: aten.sub.Tensor,
                 aten.add.Scalar: aten.add.Tensor, aten.sub.Scalar: aten.sub.Tensor,
                 aten.mul.Scalar: aten.mul.Tensor, aten.div.Scalar: aten.div.Tensor}


def as_redispatched(gm: torch.fx.GraphModule) -> int:
    """Each op of _REDISPATCHES as the overload eager's implementation calls: the same kernel on
    the same operands, which the fused elementwise step computes where the op itself would be a
    step of its own (AdamW's `1 - lr * weight_decay` with a tensor learning rate, Adadelta's
    `square_avg + eps`). Returns how many it rewrote."""
    count = 0
    for node in gm.graph.nodes:
        target = _REDISPATCHES.get(node.target) if node.op == "call_function" else None
        if target is None or len(node.args) < 2:  # `other` by keyword: left as it is
            continue
        x, other, *alpha = node.args
        swap = node.target in (aten.rsub.Tensor, aten.rsub.Scalar)
        node.target = target
        node.args = (other, x) if swap else (x, other)
        node.kwargs = {**node.kwargs, **({"alpha": alpha[0]} if alpha else {})}
        count += 1
    return count


BUILTIN_PASSES = (drop_metadata_asserts, exact_conversions, inline_quantize_ops, reinplace_input_updates,
                  reinplace_foreach_all, decompose_foreach, restore_max_pool1d, batch_norms_as_channel_affines,
                  as_redispatched, remove_dead_code, sink_waits)


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
