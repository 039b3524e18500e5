"""Which graphs batch-size buckets apply to (config.reduce_overhead.capture_sizes; Note [Capture
sizes] in replay/buckets.h), decided once per graph when it is compiled.

A padded call is right only if every output row is computed from the same input row alone: rows
must be independent. That is checked here on the ATen graph, op by op, instead of taken on
trust: the batch is a symbol s that is the leading size of some inputs; a value is *batched* when
its leading size is c * s (c rows per batch element, one after another, c a number or another
size: a linear over (n, L, d) runs on a (n * L, d) view) and s is in none of its other sizes or strides. Every op that reads a
batched value, or s itself, must be one of:

- a pointwise op (torch.Tag.pointwise) whose batched operands have the result's rank;
- an op along named dims (softmax, reductions, cat, index_select, slice, index_copy, scatter,
  ...) none of which is 0 (a slice of all of dim 0 is fine), also in place into a batched value;
  `x[:, i] = v` (index_put with one 1-d index, not on dim 0, and v of x's rank);
- a view or copy that keeps dim 0 where it is (view, reshape, expand, permute, clone, ...);
- a matrix product whose batched operand is the left one (mm, addmm);
- an op batched in dim 0 by definition, on its batched operands (bmm, embedding's indices,
  convolution's input, layer norm, eval-mode batch norm, pooling, attention);
- `copy_` of a batched value into a batched input (an input update);

and give only batched results, with as many rows per element as its batched operands (views and
reshapes may regroup them). s may be used only as the leading size (c * s) of a new shape; graph
inputs and outputs are padded and sliced only where their dim 0 is s itself.

torch.export gives every input dim a symbol of its own unless its fake kernels tie two together,
and some kernels need sizes equal that their fake kernels do not check: index_copy_ of x (s0, ...)
into a per-row cache (s1, T, ...) needs s0 == s1, which nothing in the graph says. So the leading
symbols of the two operands such an op copies rows between (index_copy, slice_scatter,
select_scatter, index_put's values of the result's rank: _SAME_ROWS) are first tried as one
batch s (each put for s; at run time a call is padded only when all its batch inputs have the
same dim 0, the others run unpadded under their own key: replay/buckets.cc), then each alone.
Alone, such an op between a batched value and one that is not is refused: its kernel needs the
two dim 0s equal, and padding would give it one and not the other. Anything
else (a reduction over the batch, the batch size used as a number, a write into a tensor that is
not a batch input, an output sized 2*s) refuses buckets for the graph, with the node in the log:
its calls are captured per size instead, as without capture_sizes.
"""
from __future__ import annotations

import logging
import operator
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.fx

from . import row_bits
from .config import CompilerConfig

logger = logging.getLogger("torchreplay")
aten = torch.ops.aten

_ALONG_DIMS = {  # ops whose `dim`/`dims` argument says which dims they mix
    aten._softmax.default, aten._log_softmax.default, aten.softmax.int, aten.log_softmax.int,
    aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default, aten.max.dim,
    aten.min.dim, aten.argmax.default, aten.argmin.default, aten.var.correction, aten.std.correction,
    aten.var_mean.correction, aten.prod.dim_int, aten.logsumexp.default, aten.any.dim, aten.any.dims,
    aten.all.dim, aten.cumsum.default, aten.cumprod.default, aten.linalg_vector_norm.default,
    aten.index_select.default, aten.gather.default, aten.cat.default, aten.stack.default,
    aten.slice.Tensor, aten.select.int, aten.narrow.default, aten.split.Tensor,
    aten.split_with_sizes.default, aten.unbind.int, aten.unsqueeze.default, aten.squeeze.dim,
    aten.squeeze.dims, aten.flip.default, aten.roll.default, aten.sort.default, aten.topk.default,
    aten.transpose.int, aten.index_copy.default, aten.index_copy_.default, aten.scatter.src,
    aten.scatter.value, aten.scatter_add.default, aten.scatter_.src, aten.scatter_.value,
    aten.slice_scatter.default, aten.select_scatter.default,
}
_WHOLE_SLICE = {aten.slice.Tensor, aten.slice_scatter.default}  # dim 0 from its start, step 1: all of it
# Ops whose index may be shorter than the tensor it indexes in every dim, dim 0 too: padding the
# index's rows but not the tensor's would break that, so every tensor operand must be batched.
_ALL_BATCHED = {aten.gather.default, aten.scatter.src, aten.scatter.value, aten.scatter_add.default,
                aten.scatter_.src, aten.scatter_.value}
_INDEX_PUT = {aten.index_put.default, aten.index_put_.default}
# Ops along other dims that copy rows of one operand into another: their kernels need the two
# dim 0s equal, which their fake kernels do not check, so torch.export may give the two a symbol
# each (module docstring). index_put's values only when they have the result's rank.
_SAME_ROWS = {aten.index_copy.default: ("self", "source"), aten.index_copy_.default: ("self", "source"),
              aten.slice_scatter.default: ("self", "src"), aten.select_scatter.default: ("self", "src"),
              aten.index_put.default: ("self", "values"), aten.index_put_.default: ("self", "values")}
_RESHAPES = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}  # may regroup rows
_KEEP_DIM_0 = {  # views and copies: fine when the result's dim 0 is the batch (checked after)
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.expand.default,
    aten.clone.default, aten._to_copy.default, aten.alias.default, aten.detach.default,
    aten.lift_fresh_copy.default, aten.permute.default, aten.squeeze.default, torch.ops.torchreplay.to_float32.default,
}
_LEFT_OPERAND = {aten.mm.default: 0, aten.addmm.default: 1}  # rows of this operand give rows
_BATCHED_AT = {  # ops batched in dim 0 by definition: the operands that may be batched
    aten.bmm.default: (0, 1), aten.baddbmm.default: (0, 1, 2), aten.embedding.default: (1,),
    aten.convolution.default: (0,), aten.native_layer_norm.default: (0,),
    aten._native_batch_norm_legit_no_training.default: (0,), aten.avg_pool2d.default: (0,),
    aten.max_pool2d_with_indices.default: (0,), aten._adaptive_avg_pool2d.default: (0,),
    aten._scaled_dot_product_flash_attention_for_cpu.default: (0, 1, 2, 5),
    aten._scaled_dot_product_efficient_attention.default: (0, 1, 2, 3),
    aten._scaled_dot_product_flash_attention.default: (0, 1, 2),
}
_FACTORIES = {aten.empty.memory_format, aten.zeros.default, aten.ones.default, aten.full.default,
              aten.new_empty.default, aten.new_zeros.default, aten.new_ones.default,
              aten.new_full.default}


def _rows_bitwise(n: torch.fx.Node, args: List[Tuple[str, Any]], batched: List[str], sizes: List[int]) -> bool:
    """Node n gives each row the same bits whatever the row count: Note [Rows that stay bitwise]
    (row_bits.py), measured on this machine."""
    target = n.target
    out = n.meta.get("val")
    out0 = next((o for o in (out if isinstance(out, (list, tuple)) else [out]) if isinstance(o, torch.Tensor)), None)
    if out0 is None:
        return target in row_bits.ROWS_MOVED
    ins = [a.meta["val"] for _, a in args if isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]
    converts = any(t.dtype != out0.dtype for t in ins)
    if target in row_bits.ROWS_MOVED and not (converts and target in row_bits.CONVERTS):
        return True
    if not any(t.is_floating_point() or t.is_complex() for t in ins + [out0]):
        return True   # integer and bool arithmetic is exact on every path
    device = out0.device.type
    if row_bits.is_elementwise(target) or target in row_bits.CONVERTS:
        return row_bits.elementwise_rows_bitwise(n, args, device)
    if target in row_bits.ROW_WISE:
        return row_bits.row_wise_rows_bitwise(args, target, batched, sizes, device)
    return False   # GEMMs, convolutions, attention: not measured, close


_SIZE_ARGS = ("size", "shape")
_SIZE_QUERIES = {aten.sym_size.int, aten.sym_stride.int, aten.sym_numel.default,
                 aten.sym_storage_offset.default}


def batch_fields(gm: torch.fx.GraphModule, config: CompilerConfig, name: str) -> Dict[str, Any]:
    """The engine's capture-size fields for an inference graph when capture_sizes is set: batch
    inputs and outputs (leading size s) and batch-size inputs (ints equal to s). Empty (buckets
    off, logged with why) when no leading symbol of the inputs passes the row check above."""
    sizes = config.reduce_overhead.capture_sizes
    if not sizes:
        return {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    candidates = []
    for p in placeholders:
        s = _leading_symbol(p.meta.get("val"))
        if s is not None and s not in candidates:
            candidates.append(s)
    why = "no input has a dynamic leading dimension"
    tries: List[Tuple[Any, ...]] = []  # batches to try: symbols an op ties as one, then each alone
    try:
        groups = _tied(gm, candidates)
    except Exception:  # a graph it does not understand: each symbol alone, which refuses such ops
        groups = []
    for s in candidates:
        tries += [g for g in groups if g[0] == s] + [(s,)]
    for batch in tries:
        symbol = batch[0]
        try:
            found = _check(gm, symbol, list(sizes), {s: symbol for s in batch[1:]})
        except Exception as e:  # a graph this check does not understand: no buckets, not a failure
            found = f"the row check failed: {type(e).__name__}: {e}"
        if isinstance(found, tuple):
            fields, close = found
            if not close:
                return dict(capture_sizes=list(sizes), **fields)
            ops = ", ".join(close)
            if not config.reduce_overhead.capture_sizes_bitwise:
                logger.info("torchreplay: %s pads batches to capture_sizes; its padded rows are close to eager, "
                            "not bitwise (%s give a row other bits for another row count), as "
                            "capture_sizes_bitwise=False allows", name, ops)
                return dict(capture_sizes=list(sizes), **fields)
            found = (f"padded rows would be close to eager, not bitwise: {ops} give a row other bits for another "
                     "row count (Note [Rows that stay bitwise]); set config.reduce_overhead.capture_sizes_bitwise = "
                     "False to pad anyway")
        if batch is tries[0]:
            why = found if len(batch) == 1 else f"{', '.join(map(str, batch))} as one batch: {found}"
    logger.warning("torchreplay: capture_sizes do not apply to %s (%s); its batch sizes are "
                   "captured one by one", name, why)
    return {}


def _leading_symbol(v: Any) -> Any:
    if isinstance(v, torch.Tensor) and v.dim() > 0 and isinstance(v.shape[0], torch.SymInt):
        expr = v.shape[0].node.expr
        return expr if expr.is_Symbol else None
    return None


def _expr(v: Any, same: Optional[Dict[Any, Any]] = None) -> Any:
    """v's expression, the symbols tied to the batch (`same`: symbol -> the batch's) put as it."""
    expr = v.node.expr
    return expr.xreplace(same) if same else expr


def _has(v: Any, symbol: Any, same: Optional[Dict[Any, Any]] = None) -> bool:
    return isinstance(v, torch.SymInt) and symbol in _expr(v, same).free_symbols


def _tied(gm: torch.fx.GraphModule, candidates: List[Any]) -> List[Tuple[Any, ...]]:
    """Groups of two or more of the candidate batch symbols that an op of _SAME_ROWS ties: the
    leading sizes of the two operands it copies rows between (index_copy_ of x (s0, d) into a
    cache (s1, T, d)), which its kernel needs equal and the graph does not say are (module
    docstring). In candidate order."""
    parent = {s: s for s in candidates}

    def root(s: Any) -> Any:
        while parent[s] is not s:
            s = parent[s]
        return s

    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target not in _SAME_ROWS:
            continue
        named = dict(_named_args(n))
        vals = [named[k].meta.get("val") if isinstance(named[k], torch.fx.Node) else None for k in _SAME_ROWS[n.target]]
        if not all(isinstance(v, torch.Tensor) and v.dim() == vals[0].dim() > 0 for v in vals):
            continue  # index_put's values broadcast over the rows
        leading = {root(s) for v in vals if isinstance(v.shape[0], torch.SymInt)
                   for s in v.shape[0].node.expr.free_symbols if s in parent}
        leading = sorted(leading, key=candidates.index)
        for s in leading[1:]:
            parent[s] = leading[0]
    groups: Dict[Any, List[Any]] = {}
    for s in candidates:
        groups.setdefault(root(s), []).append(s)
    return [tuple(g) for g in groups.values() if len(g) > 1]


_OTHER = object()  # a value that involves the batch symbol other than as rows of dim 0


def _rows_per_element(expr: Any, symbol: Any) -> Any:
    """c when expr is c * symbol with c free of it (a number or another size), else _OTHER."""
    c, rest = expr.as_independent(symbol, as_Add=False)
    return c if rest == symbol and c.is_positive is not False else _OTHER


def _check(gm: torch.fx.GraphModule, symbol: Any, sizes: List[int],
           same: Optional[Dict[Any, Any]] = None) -> Any:
    """The fields for batch symbol `symbol`, or why its rows are not independent (and which
    nodes' padded rows would be close, not bitwise, for buckets of these sizes). `same`: other
    symbols taken as this one (symbols an op ties together, module docstring).
    Over 80 lines: one walk over the graph's nodes whose cases all read and extend the same
    per-node row counts."""
    # node -> rows of its dim 0 per batch element (c when its dim 0 is c * s: a linear over
    # (n, L, d) runs on (n * L, d), each element owning L rows in a row), None when it does not
    # involve s
    batched: Dict[torch.fx.Node, Any] = {}
    uses_symbol: Dict[torch.fx.Node, bool] = {}  # node -> an int holding s (or made from it)
    close: List[torch.fx.Node] = []  # nodes whose padded rows are close, not bitwise

    def rows(v: Any) -> Any:
        """As `batched` for a value; _OTHER when it involves s another way."""
        if isinstance(v, (list, tuple)):
            each = [rows(e) for e in v]
            factors = {r for r in each if r is not None}
            return _OTHER if _OTHER in factors or len(factors) > 1 else (factors.pop() if factors else None)
        if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return _OTHER if symbol in _expr(v, same).free_symbols else None
        if not isinstance(v, torch.Tensor):
            return None
        rest = list(v.shape[1:]) + (list(v.stride()) if v.layout == torch.strided else [])
        if any(_has(d, symbol, same) for d in rest):
            return _OTHER
        if v.dim() == 0 or not _has(v.shape[0], symbol, same):
            return None
        return _rows_per_element(_expr(v.shape[0], same), symbol)

    index = {p: i for i, p in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        r = rows(val)
        if n.op == "placeholder":
            if isinstance(val, torch.Tensor) and not (r is None or r == 1):
                return f"input {n.name} has the batch {symbol} in a size or stride other than dim 0"
            if isinstance(val, torch.SymInt) and r is _OTHER and _expr(val, same) != symbol:
                return f"input {n.name} is {val.node.expr}, computed from the batch size"  # set as it is
            batched[n], uses_symbol[n] = (None, True) if r is _OTHER else (r, False)
            continue
        if n.op == "output":
            for o in n.args[0]:
                if isinstance(o, torch.fx.Node) and uses_symbol.get(o):
                    return f"output {o.name} is computed from the batch size"
                if isinstance(o, torch.fx.Node) and batched.get(o) is not None and batched[o] != 1:
                    return f"output {o.name} has {batched[o]} rows per batch element"
                if isinstance(o, torch.fx.Node) and _view_of_batch_input(o, batched):
                    # handed back as a view of the caller's tensor, in the padded input's geometry
                    return f"output {o.name} is a view of a batch input"
            continue
        reads_batch = any(batched.get(a) is not None for a in n.all_input_nodes)
        reads_symbol = [a for a in n.all_input_nodes if uses_symbol.get(a)]
        target = n.target
        scalar = not isinstance(val, (torch.Tensor, list, tuple))
        if target is operator.getitem or (scalar and (target in _SIZE_QUERIES or target is aten._assert_scalar.default
                                                      or not isinstance(target, torch._ops.OpOverload))):
            # A result taken apart; sizes, Python arithmetic on them (s * 4, s >= 2) and runtime
            # asserts on them: tracked here, checked where they are used.
            if not scalar and r is _OTHER:
                return f"node {n.name} has the batch {symbol} in a size or stride other than dim 0"
            batched[n] = None if scalar else r
            uses_symbol[n] = scalar and (r is _OTHER or bool(reads_symbol))
            continue
        if not isinstance(target, torch._ops.OpOverload):
            if reads_batch or reads_symbol:
                return f"node {n.name} ({target}) is not known to keep rows independent"
            batched[n], uses_symbol[n] = None, False
            continue
        if not reads_batch and not reads_symbol:
            batched[n], uses_symbol[n] = None, False
            if r is not None:
                return f"node {n.name} makes a value sized by the batch {symbol} from nothing batched"
            continue
        named = _named_args(n)
        why = _row_wise(n, named, batched, uses_symbol, symbol, same)
        if why:
            return f"node {n.name} ({target}) {why}"
        if reads_batch and not _rows_bitwise(n, named, [k for k, a in named if isinstance(a, torch.fx.Node)
                                                         and batched.get(a) is not None], sizes):
            close.append(n)
        outs = val if isinstance(val, (list, tuple)) else [val]
        if target in _BATCHED_AT:  # their side results (batch norm's saved stats, seeds) may be free
            outs = [o for k, o in enumerate(outs) if k == 0 or rows(o) is not None]
        out_rows = {rows(o) for o in outs if isinstance(o, torch.Tensor)}
        if len(out_rows) != 1 or None in out_rows or _OTHER in out_rows:
            return f"node {n.name} ({target}) gives a result whose dim 0 is not the batch"
        in_rows = {batched[a] for a in n.all_input_nodes if batched.get(a) is not None}
        if target not in _RESHAPES and not in_rows <= out_rows:
            return f"node {n.name} ({target}) regroups the rows of batch elements"
        batched[n], uses_symbol[n] = out_rows.pop(), False

    ins = [p.meta.get("val") for p in index]
    outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    fields = dict(batch_inputs=[i for i, p in enumerate(index) if batched[p] is not None],
                  batch_size_inputs=[i for i, v in enumerate(ins)
                                     if isinstance(v, torch.SymInt) and _expr(v, same) == symbol],
                  batch_outputs=[i for i, o in enumerate(outputs)
                                 if isinstance(o, torch.fx.Node) and batched.get(o) is not None])
    return fields, sorted({str(n.target) for n in close})


def _view_of_batch_input(node: torch.fx.Node, batched: Dict[torch.fx.Node, Any]) -> bool:
    """node is a view (not the tensor itself) of a batched graph input."""
    view = False
    while node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        returns = node.target._schema.returns
        alias = returns[0].alias_info if returns else None
        if alias is None or not node.args or not isinstance(node.args[0], torch.fx.Node):
            return False
        view = view or not alias.is_write   # x.mul_(2) is x itself; x[:, 1:] is a view of it
        node = node.args[0]
    return view and node.op == "placeholder" and batched.get(node) is not None


def _named_args(n: torch.fx.Node) -> List[Tuple[str, Any]]:
    """(name, value) per schema argument of an op node, defaults filled in."""
    schema = n.target._schema.arguments
    named = [(schema[i].name, a) for i, a in enumerate(n.args)]
    for arg in schema[len(n.args):]:
        if arg.name in n.kwargs:
            named.append((arg.name, n.kwargs[arg.name]))
        elif arg.has_default_value():
            named.append((arg.name, arg.default_value))
    return named


def _row_wise(n: torch.fx.Node, args: List[Tuple[str, Any]], batched: Dict[torch.fx.Node, Any],
              uses_symbol: Dict[torch.fx.Node, bool], symbol: Any,
              same: Optional[Dict[Any, Any]] = None) -> Optional[str]:
    """None when node n keeps rows independent, else why not."""
    target = n.target
    out = n.meta.get("val")
    out0 = out[0] if isinstance(out, (list, tuple)) else out
    rank = out0.dim() if isinstance(out0, torch.Tensor) else 0

    def is_batched(a: Any) -> bool:
        return isinstance(a, torch.fx.Node) and batched.get(a) is not None

    # The batch size may only be the leading size of a new shape.
    for name, a in args:
        elems = a if isinstance(a, (list, tuple)) else [a]
        for k, e in enumerate(elems):
            if isinstance(e, torch.fx.Node) and uses_symbol.get(e):
                v = e.meta.get("val")
                whole = isinstance(v, torch.SymInt) and _rows_per_element(_expr(v, same), symbol) is not _OTHER
                if not (name in _SIZE_ARGS and k == 0 and whole and isinstance(a, (list, tuple))):
                    return "uses the batch size as a number"
    if target is aten.copy_.default:
        return None if all(is_batched(a) for _, a in args[:2]) else "writes into a tensor that is not batched"
    if target._schema.is_mutable and (target not in _ALONG_DIMS and target not in _INDEX_PUT
                                      or not is_batched(args[0][1])):
        return "writes in place into something other than a batched value along its other dims"
    if target in _INDEX_PUT:  # x[:, i] = v: one 1-d index, not on dim 0 and not batched
        indices = args[1][1]
        given = [i for i in indices if i is not None]
        if not indices or indices[0] is not None or len(given) != 1 or is_batched(given[0]) or \
                given[0].meta["val"].dim() != 1:
            return "indexes the batch dim, or more than one dim"
        values = dict(args)["values"]
        if is_batched(values) and values.meta["val"].dim() != args[0][1].meta["val"].dim():
            return "broadcasts the batch into another dim"
        v = values.meta.get("val") if isinstance(values, torch.fx.Node) else None
        if not is_batched(values) and isinstance(v, torch.Tensor) and v.dim() == rank and \
                isinstance(v.shape[0], torch.SymInt):  # rows sized otherwise, which the kernel needs equal
            return "writes rows of a value that is not batched into the batch's rows"
        return None
    if row_bits.is_elementwise(target) or target is aten.copy.default:
        for _, a in args:
            if is_batched(a) and a.meta["val"].dim() != rank:
                return "broadcasts the batch into another dim"
        return None
    if target in _SAME_ROWS:  # the kernel needs both dim 0s equal: both batched, or neither
        named = dict(args)
        if len({is_batched(named[k]) for k in _SAME_ROWS[target]}) != 1:
            return "copies rows between a batched value and one that is not (of another batch size)"
    if target in _ALONG_DIMS:
        first = next((a for _, a in args if isinstance(a, torch.fx.Node) or isinstance(a, (list, tuple))), None)
        first = first[0] if isinstance(first, (list, tuple)) else first
        in_rank = first.meta["val"].dim() if isinstance(first, torch.fx.Node) else rank
        dims = [a for name, a in args if name in ("dim", "dims", "dim0", "dim1")]
        if not dims or any(d is None or d == [] for d in dims):
            return "reduces over every dim, the batch's too"
        flat = [d for a in dims for d in (a if isinstance(a, (list, tuple)) else [a])]
        norm_rank = rank if target is aten.unsqueeze.default else in_rank
        if target in _ALL_BATCHED and any(isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)
                                          and not is_batched(a) for _, a in args):
            return "indexes a tensor that is not batched with a batched index, or the other way"
        named = dict(args)
        if target in _WHOLE_SLICE and named.get("start") in (0, None) and named.get("step") == 1 \
                and (named.get("end") is None or isinstance(named.get("end"), int) and named["end"] >= 2**62):
            flat = [d for d in flat if d != 0]  # all of dim 0 (the result's dim 0 is checked to be s)
        if any(not isinstance(d, int) or d % max(norm_rank, 1) == 0 for d in flat):
            return "works along dim 0, the batch (or a dim only known at run time)"
        return None
    if target in _KEEP_DIM_0:
        if target is aten.permute.default and args[1][1][0] % rank != 0:
            return "moves the batch off dim 0"
        return None
    if target in _LEFT_OPERAND or target in _BATCHED_AT:
        allowed = (_LEFT_OPERAND[target],) if target in _LEFT_OPERAND else _BATCHED_AT[target]
        if any(is_batched(a) and i not in allowed for i, (_, a) in enumerate(args)):
            return "mixes rows of a batched operand"
        return None
    if target in _FACTORIES:
        return None
    return "is not known to keep rows independent"
