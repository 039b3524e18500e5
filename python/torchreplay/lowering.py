"""Lowering: an ATen-level FX graph (after AOTAutograd) -> the C++ torchreplay._C.Graph."""
from __future__ import annotations

import math
import operator
from typing import Optional, Any, Dict, List, Sequence

import torch
import torch.fx

from . import _C, packed

# Python arithmetic on symbolic sizes and scalars -> the C++ SymOp of the same name (graph.h).
_SYM_OPS = {
    operator.add: "add", operator.sub: "sub", operator.mul: "mul",
    operator.truediv: "truediv", operator.floordiv: "floordiv", operator.mod: "mod",
    operator.pow: "pow", torch.sym_max: "max", torch.sym_min: "min",
    operator.eq: "eq", operator.ne: "ne", operator.lt: "lt", operator.le: "le",
    operator.gt: "gt", operator.ge: "ge",
    operator.and_: "and", operator.or_: "or", operator.xor: "xor",
    operator.lshift: "lshift", operator.rshift: "rshift",
    operator.neg: "neg", operator.pos: "pos", operator.abs: "abs", abs: "abs",
    torch.sym_not: "not", torch.sym_float: "float", torch.sym_int: "trunc", math.trunc: "trunc",
    math.floor: "floor", math.ceil: "ceil", round: "round", torch._sym_sqrt: "sqrt",
}


class LoweringError(RuntimeError):
    """A node of the FX graph that the C++ graph cannot express."""


def _input_kind(val: Any) -> str:
    if isinstance(val, torch.Tensor):
        return "Tensor"
    if isinstance(val, (torch.SymBool, bool)):
        return "bool"
    if isinstance(val, (torch.SymInt, int)):
        return "int"
    if isinstance(val, (torch.SymFloat, float)):
        return "float"
    raise LoweringError(f"graph input of type {type(val).__name__} is not supported")


def op_name(target: torch._ops.OpOverload) -> str:
    """'aten::add.Tensor' for torch.ops.aten.add.Tensor."""
    overload = target._overloadname
    base = target._schema.name
    return base if overload == "default" else f"{base}.{overload}"


def lower(gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
          static_inputs: Sequence[int] = (), input_names: Optional[Sequence[str]] = None) -> "_C.Graph":
    """The graph of `gm` in the C++ IR. Its inputs are named after the placeholders, or
    `input_names` (what errors about the inputs call them)."""
    builder = _C.GraphBuilder()
    env: Dict[torch.fx.Node, Any] = {}   # node -> value id, tuple of ids, or ("c", constant)

    def tag(a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            v = env[a]
            if isinstance(v, int):
                return ("v", v)
            if isinstance(v, tuple) and v and v[0] == "c":
                return v
            raise LoweringError(f"node '{a.name}' yields several values and is used directly")
        if isinstance(a, (list, tuple)) and any(isinstance(e, torch.fx.Node) for e in a):
            return ("l", [tag(e) for e in a])
        return ("c", a)

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i, node in enumerate(placeholders):
        val = node.meta.get("val", example_inputs[i] if i < len(example_inputs) else None)
        kind = _input_kind(val)
        name = input_names[i] if input_names is not None else node.name
        if kind == "Tensor":
            env[node] = builder.add_input(name, kind, val.dtype, val.device, val.dim())
        else:
            env[node] = builder.add_input(name, kind)

    for node in gm.graph.nodes:
        if node.op == "placeholder":
            continue
        try:
            if node.op == "call_function":
                target = node.target
                if isinstance(target, torch._ops.OpOverload):
                    name, raw, raw_kwargs = op_name(target), node.args, node.kwargs
                    if target in packed.OPS:
                        name, raw, raw_kwargs = packed.lowered(node)
                    args = [tag(a) for a in raw]
                    kwargs = {k: tag(v) for k, v in raw_kwargs.items()}
                    outs: List[int] = builder.add_op(name, args, kwargs, node.name)
                    env[node] = outs[0] if len(target._schema.returns) == 1 else tuple(outs)
                elif target is operator.getitem:
                    src = env[node.args[0]]
                    index = node.args[1]
                    env[node] = src[index] if isinstance(src, tuple) else builder.add_getitem(src, index, node.name)
                elif target in _SYM_OPS:
                    args = list(node.args)
                    if target is round and len(args) == 2 and args[1] is None:
                        args.pop()  # round(x, None) is round(x)
                    env[node] = builder.add_sym(_SYM_OPS[target], [tag(a) for a in args], node.name)
                else:
                    raise LoweringError(f"'{getattr(target, '__name__', target)}' is not an ATen operator")
            elif node.op == "get_attr":
                value = getattr(gm, node.target)
                if not isinstance(value, torch.Tensor):
                    raise LoweringError(f"attribute '{node.target}' is not a tensor")
                env[node] = ("c", value)
            elif node.op == "output":
                outs = node.args[0]
                outs = outs if isinstance(outs, (list, tuple)) else (outs,)
                builder.set_outputs([tag(o) for o in outs])
            else:
                raise LoweringError(f"FX op kind '{node.op}' is not supported")
        except LoweringError as e:
            raise LoweringError(f"torchreplay cannot lower node '{node.name}' ({node.format_node()}): {e}") from None
        except (ValueError, TypeError, OverflowError) as e:
            raise LoweringError(f"torchreplay cannot lower node '{node.name}' ({node.format_node()}): {e}") from None
    builder.set_static_inputs(list(static_inputs))
    return builder.build()
