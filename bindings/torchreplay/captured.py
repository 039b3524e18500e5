"""torchreplay.capture: a model as one C++ callable, without Dynamo per call.

    step = torchreplay.capture(model, (x, pos), config=cfg)
    out = step(x, pos)         # straight into C++: the engine's guard key, then replay

This module owns capture() and what it returns, Captured: the call and its Python slow path.
torch.export traces the model once (export.py: functional ATen graph, input mutations as extra
outputs; a model with DTensors, which export cannot trace, goes through AOTAutograd's export
instead); the same passes, lowering and engine as the torch.compile path then run it. Parameters
and buffers are bound once as static inputs; the writes the model makes to buffers and inputs
are put back into the graph as in-place updates, so they land in the real tensors. What is
checked per call and what is not: docs/design.md, "torchreplay.capture".
"""
from __future__ import annotations

import copy
import inspect
import itertools
import logging
import os
import struct
import threading
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx
from torch.utils import _pytree as pytree

from . import _C
from .capture_sizes import batch_fields
from .config import CompilerConfig
from .engines import dump_graph, engine_options, new_engine
from .export import _dtensors, _Flat, trace_program
from .lowering import lower
from .passes import run_passes
from .patches import _watch

logger = logging.getLogger("torchreplay")
_capture_ids = itertools.count()
aten = torch.ops.aten


class _AsModule(torch.nn.Module):
    """A function as a module. Modules it reads from its closure or globals are its submodules,
    so that their parameters and buffers are bound, watched and grad-checked as a model's are
    (not baked into the graph as constants)."""

    def __init__(self, fn: Callable) -> None:
        super().__init__()
        self.fn = fn
        try:
            found = inspect.getclosurevars(fn)
            free = {**found.globals, **found.nonlocals}
        except (TypeError, ValueError):
            free = {}
        for name, value in free.items():
            if isinstance(value, torch.nn.Module):
                self.add_module(f"closure_{name}", value)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


def _size_checks(vals: List[Any], ranges: Dict[Any, Any]) -> Tuple[List[Any], List[Any], Dict[Any, Any]]:
    """What the graph assumes of each tensor argument's sizes, checked per call in C++: tuples
    (argument, dim, lowest, highest, group, coef, offset) for a size export specialized on
    (lowest == highest, also one given back as a SymInt of a number), a symbol's range (dims of
    one symbol share a group: equal), or an affine expression of one symbol (2 * s0 + 1: coef,
    offset). And the sizes given by any other expression, as (argument, dim, expression), which
    the Python slow path checks, with where each symbol's value is found, {symbol: (argument,
    dim)}."""
    import sympy

    big = 2 ** 63 - 1
    groups: Dict[Any, int] = {}
    plain, affine, others = [], [], []
    symbol_dims: Dict[Any, Tuple[int, int]] = {}
    for k, val in enumerate(vals):
        if val is None:
            continue
        for d, size in enumerate(val.shape):
            expr = size.node.expr if isinstance(size, torch.SymInt) else sympy.Integer(int(size))
            if expr.is_number:
                plain.append((k, d, int(expr), int(expr), -1, 1, 0))
            elif expr.is_Symbol:
                r = ranges.get(expr)
                lo = int(r.lower) if r is not None and r.lower.is_Integer else 0
                hi = int(r.upper) if r is not None and r.upper.is_Integer else big
                plain.append((k, d, lo, min(hi, big), groups.setdefault(expr, len(groups)), 1, 0))
                symbol_dims.setdefault(expr, (k, d))
            else:
                (symbol, *more) = sorted(expr.free_symbols, key=str)
                coef, offset = sympy.expand(expr).coeff(symbol), sympy.expand(expr).subs(symbol, 0)
                if not more and coef.is_Integer and offset.is_Integer and sympy.expand(expr - coef * symbol - offset) == 0:
                    affine.append((k, d, 0, big, groups.setdefault(symbol, len(groups)), int(coef), int(offset)))
                else:
                    others.append((k, d, expr))
    return plain + affine, others, symbol_dims


class _Specialized:
    """An argument left out of the trace (None, a string, a dtype, a module, ...), as it was at
    capture time. A call must pass the same: a value of a type with its own == (numbers of a
    NumPy array, a dataclass's fields, strings, dtypes) is compared with a copy taken at capture
    time, so that changing it in place is seen; anything else (modules, objects without ==) must
    be the very object."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self.copy: Any = None
        self.by_value = not isinstance(value, torch.nn.Module) and type(value).__eq__ is not object.__eq__
        if self.by_value:
            try:
                self.copy = copy.deepcopy(value)
            except Exception:  # noqa: BLE001 - an object that cannot be copied is compared by identity
                self.by_value = False

    def matches(self, got: Any) -> bool:
        if not self.by_value:
            return got is self.value
        try:
            if type(got).__module__ == "numpy" and hasattr(got, "shape"):
                import numpy
                return (type(got) is type(self.copy) and got.dtype == self.copy.dtype
                        and numpy.array_equal(got, self.copy))
            if type(self.copy) is float:  # bit for bit: -0.0 is not 0.0 to a graph, NaN is NaN
                return type(got) is float and struct.pack("<d", got) == struct.pack("<d", self.copy)
            return type(got) is type(self.copy) and bool(got == self.copy)
        except Exception:  # noqa: BLE001 - a value that cannot be compared is another value
            return False

    def describe(self, got: Any) -> str:
        if not self.by_value and type(got) is type(self.value) and repr(got) == repr(self.value):
            return f"another {type(got).__name__} object than the one the graph was captured with"
        return f"{got!r}, but the graph was captured with {self.copy if self.by_value else self.value!r}"


class Captured(_C.Call):
    """A model captured by torchreplay.capture; call it as the model is called. Flat positional
    arguments (tensors, Python numbers) go straight to C++; keywords, nested arguments and
    outputs, specialized arguments (None, strings, dtypes, modules, ...), a module's mode that
    may have changed and, for dynamic captures, sizes the trace does not hold for (0 and 1, which
    export specializes) take a Python path that flattens and checks them first (_slow_call)."""

    def __init__(self, engine: Any, bound: List[Any], bound_names: List[str], grad_checked: List[int],
                 mutated: List[int], fixed: Dict[int, Any], sizes: List[Any], module: Optional[torch.nn.Module],
                 trace: "_Trace", grad_owners: Sequence[Optional[torch.Tensor]] = ()) -> None:
        returns = _C.Returns.ONE if trace.out_spec.is_leaf() else _C.Returns.TUPLE
        flat_out = trace.out_spec.is_leaf() or (
            trace.out_spec.type is tuple and all(c.is_leaf() for c in trace.out_spec.children()))
        flat_in = (all(c.is_leaf() for c in trace.in_spec.children()[0].children())
                   and not trace.in_spec.children()[1].children() and not trace.constants)
        # The C++ call holds the slow path without holding this object (it would be a reference
        # cycle through C++, which the garbage collector cannot see: the model never freed).
        me = weakref.ref(self)
        checks = _C.CaptureChecks(fixed=fixed, sizes=[_C.SizeCheck(*s) for s in sizes], module=module,
                                  grad_checked=grad_checked, grad_owners=list(grad_owners), bound_names=bound_names,
                                  slow_path=lambda *a, **k: me()._slow_call(*a, **k),
                                  always_slow=not (flat_in and flat_out) or bool(trace.size_exprs))
        super().__init__(engine, bound=bound, mutated=mutated, num_outputs=trace.num_outputs, returns=returns,
                         checks=checks)
        # The engine's Python object too: torchreplay.stats() lists it while this lives.
        self._bound, self._trace, self._engine, self._bound_names = bound, trace, engine, bound_names
        self._variants: Dict[Any, "Captured"] = {}
        self._lock = threading.Lock()
        if trace.dynamic:
            self._variants[trace.size_class(trace.example)] = self

    @property
    def name(self) -> str:
        return self.engine.name

    def _engines(self) -> List[Any]:
        return [self.engine] + [v.engine for v in self._variants.values() if v is not self]

    def stats(self) -> Dict[str, Any]:
        """Calls, replays, captures, fallbacks and the capture log of this model's engine. With
        dynamic=True, a call with sizes the trace does not hold for (0 or 1 where it was traced
        with more) runs a trace of its own: counters are summed over all of them, and `traces`
        lists each one's own stats."""
        engines = self._engines()
        out = dict(engines[0].stats(), name=self.name)
        if len(engines) > 1:
            each = [dict(e.stats(), name=e.name) for e in engines]
            for k, v in out.items():
                if isinstance(v, int) and not isinstance(v, bool):
                    out[k] = sum(e[k] for e in each)
            out["traces"] = each
        return out

    def precapture(self, input_sets: Sequence[Any]) -> None:
        """Warms up and captures these argument sets' keys ahead of time, largest first (so that
        smaller keys reuse its pool memory): real calls, checked as any call is, `warmup_iters +
        1` of them per set. Each set is a tuple of positional arguments (a lone tensor counts as
        one)."""
        calls = []
        for args in input_sets:
            if isinstance(args, torch.Tensor):
                args = (args,)
            if not isinstance(args, (tuple, list)):
                raise TypeError(f"torchreplay.capture: precapture takes a list of argument tuples, got a "
                                f"{type(args).__name__} among them")
            flat = self._trace.flatten(tuple(args), {})
            calls.append((self._trace_for(flat, args, {}), flat))
        calls.sort(key=lambda c: -sum(a.nbytes for a in c[1] if isinstance(a, torch.Tensor)))
        for target, flat in calls:
            for _ in range(max(0, target.engine.options.warmup_iters) + 1):
                target._fast(*flat)

    def profile(self, *args: Any, iterations: int = 200, **kwargs: Any) -> List[Dict[str, Any]]:
        """Where a replay of these arguments' shape goes: per step of the captured tape, in order,
        its node, op, kind (prepared pointwise, typed out=, copies, boxed out=, functional, in
        place, view, ...), result shapes and mean microseconds over `iterations` replays
        (captured first if needed: these are real calls; a graph with collectives is not warmed
        up here, since other ranks would not match those calls: its shape must replay already, on
        every rank, and every rank profiles). `python -m torchreplay.bench.profile` prints it for
        the harness's models."""
        flat = self._trace.flatten(args, kwargs)
        target = self._trace_for(flat, args, kwargs)
        return target.engine.profile(list(target._bound) + flat, iterations)

    def _trace_for(self, flat: List[Any], args: Sequence[Any], kwargs: Dict[str, Any]) -> "Captured":
        """The capture whose trace holds for these sizes: this one, or (dynamic=True) one traced
        for the sizes export specialized (0, 1), made once, when first needed, under a lock (two
        threads never trace at once). Arguments of other kinds than traced (None where a tensor
        was) get no trace of their own: this capture's call raises the clear error."""
        if not self._trace.dynamic or not self._trace.same_kinds(flat):
            return self
        key = self._trace.size_class(flat)
        found = self._variants.get(key)
        if found is None:
            with self._lock:
                found = self._variants.get(key)
                if found is None:
                    logger.info("torchreplay: %s: tracing again for sizes %s (a trace holds for 0, 1 or 2 and "
                                "more, as export specializes)", self.name, key)
                    found = self._trace.recapture(args, kwargs)
                    found._variants, found._lock = self._variants, self._lock
                    self._variants[key] = found
        return found

    def _slow_call(self, *args: Any, **kwargs: Any) -> Any:
        epoch = _C.module_modes_epoch()
        self._trace.check_modes()
        flat = self._trace.flatten(args, kwargs)
        target = self._trace_for(flat, args, kwargs)
        target._trace.check_size_exprs(flat)
        outs = target._fast(*flat)
        self._modes_checked(epoch)
        spec = self._trace.out_spec
        if spec.is_leaf():
            return outs
        return pytree.tree_unflatten(list(outs), spec)


class _Trace:
    """How a capture's calls map to its graph: the structure of the arguments and outputs, the
    arguments specialized at capture time, the modules' modes, and how to trace again for other
    sizes."""

    def __init__(self, model: Any, module: torch.nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any],
                 in_spec: Any, constants: Dict[int, Any], names: List[str], dynamic: bool,
                 again: Callable[..., "Captured"]) -> None:
        self.model, self.module, self.in_spec, self.dynamic = model, module, in_spec, dynamic
        self.constants = {i: _Specialized(v) for i, v in constants.items()}
        self.names = names  # per flat leaf, what errors call it
        self.n_positional = len(args)
        self.kwarg_names = list(kwargs)
        self.example: List[Any] = []
        self.out_spec: Any = None
        self.num_outputs = 0
        self.size_exprs: List[Any] = []    # (argument, dim, sympy expression of symbols)
        self.symbol_dims: Dict[Any, Tuple[int, int]] = {}  # symbol -> (argument, dim) giving its value
        # Every module the graph reads (the model's, a module argument's), with its mode then.
        modules = [module] + [c.value for c in self.constants.values() if isinstance(c.value, torch.nn.Module)]
        self.modes = [(weakref.ref(m), name, m.training) for top in modules for name, m in top.named_modules()]
        self._again = again

    def recapture(self, args: Sequence[Any], kwargs: Dict[str, Any]) -> "Captured":
        return self._again(tuple(args), kwargs)

    @staticmethod
    def size_class(flat: Sequence[Any]) -> Tuple[Tuple[int, ...], ...]:
        """Each tensor's sizes as export specializes them: 0, 1, or 2 for any larger size."""
        return tuple(tuple(min(int(d), 2) for d in a.shape) for a in flat if isinstance(a, torch.Tensor))

    def same_kinds(self, flat: Sequence[Any]) -> bool:
        """The call's graph arguments are tensors of the traced ranks and numbers where the trace
        had them: only sizes may differ."""
        def kind(a: Any) -> Any:
            return ("tensor", a.dim()) if isinstance(a, torch.Tensor) else type(a)
        return len(flat) == len(self.example) and all(kind(a) == kind(b) for a, b in zip(flat, self.example))

    def check_modes(self) -> None:
        """Raises if a module's train/eval mode is not what it was at capture time."""
        for ref, name, training in self.modes:
            m = ref()
            if m is not None and m.training != training:
                what = f"submodule '{name}'" if name else "the model"
                raise ValueError(f"torchreplay: {what} ({type(m).__name__}) was captured in "
                                 f"{'train' if training else 'eval'} mode and is now in "
                                 f"{'train' if m.training else 'eval'} mode (.train()/.eval() change what it "
                                 "computes); capture again")

    def check_size_exprs(self, flat: Sequence[Any]) -> None:
        """The sizes that are no affine expression of one symbol (s0 * s1, s0 // 2), checked here."""
        if not self.size_exprs:
            return
        values = {sym: flat[k].shape[d] for sym, (k, d) in self.symbol_dims.items()}
        for k, d, expr in self.size_exprs:
            want = expr.subs(values)
            if want.is_number and int(want) != flat[k].shape[d]:
                raise ValueError(f"torchreplay: argument {k} has size {flat[k].shape[d]} in dim {d}, but the "
                                 f"graph needs {int(want)} there ({expr}); capture again for this shape")

    def flatten(self, args: Sequence[Any], kwargs: Dict[str, Any]) -> List[Any]:
        """The graph's flat arguments for a call, with clear errors where it cannot take them."""
        if len(args) != self.n_positional or kwargs.keys() != set(self.kwarg_names):
            args, kwargs = self._rebind(args, kwargs)
        kwargs = {k: kwargs[k] for k in self.kwarg_names}  # keywords in any order, as Python allows
        try:  # in the captured structure: dict entries matched by key, in any order
            flat = self.in_spec.flatten_up_to((tuple(args), kwargs))
        except (ValueError, TypeError, KeyError):
            flat = None
        if flat is None or any(not pytree.tree_structure(a).is_leaf() for a in flat):
            raise TypeError(f"torchreplay.capture: the arguments of this call are nested differently from the "
                            f"ones the model was captured with ({_describe(pytree.tree_structure((tuple(args), kwargs)))} "
                            f"against {_describe(self.in_spec)})")
        for i, want in self.constants.items():
            if not want.matches(flat[i]):
                raise ValueError(f"torchreplay: argument {self.names[i]} is {want.describe(flat[i])} there; "
                                 "capture again for another value")
        return [a for i, a in enumerate(flat) if i not in self.constants]

    def _rebind(self, args: Sequence[Any], kwargs: Dict[str, Any]) -> Tuple[Sequence[Any], Dict[str, Any]]:
        """A call that names or places arguments otherwise than the capture did (a keyword given
        by position, a positional one by name, a keyword left at its default), put in the
        captured layout, as Python binds it."""
        forward = self.module.forward if self.model is self.module else self.model
        try:
            sig = inspect.signature(forward)
            bound = sig.bind(*args, **kwargs)
        except (TypeError, ValueError) as e:
            raise TypeError(f"torchreplay.capture: {e}") from None
        got = bound.arguments
        names = [p.name for p in sig.parameters.values()
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][:self.n_positional]
        positional = [p.name for p in sig.parameters.values() if p.kind == p.VAR_POSITIONAL]
        if len(names) < self.n_positional and positional and positional[0] in got:
            extra = list(got.get(positional[0], ()))
        else:
            extra = []
        for n in names:  # a positional argument left at its default: as Python fills it in
            if n not in got and sig.parameters[n].default is not inspect.Parameter.empty:
                got[n] = sig.parameters[n].default
        want_positional = len(names) + len(extra)
        if want_positional != self.n_positional or any(n not in got for n in names):
            missing = [n for n in names if n not in got]
            raise TypeError(f"torchreplay.capture: the model was captured with {self.n_positional} positional "
                            f"arguments" + (f"; this call leaves out {', '.join(missing)}" if missing else ""))
        new_args = [got[n] for n in names] + extra
        var_kw = next((p.name for p in sig.parameters.values() if p.kind == p.VAR_KEYWORD), None)
        named = dict(got.get(var_kw, {})) if var_kw else {}
        named.update({k: v for k, v in got.items() if k not in names and k != var_kw and k not in positional})
        for k in self.kwarg_names:  # a keyword left at its default: as Python fills it in
            p = sig.parameters.get(k)
            if k not in named and p is not None and p.default is not inspect.Parameter.empty:
                named[k] = p.default
        missing = [k for k in self.kwarg_names if k not in named]
        extra_kw = [k for k in named if k not in self.kwarg_names]
        if missing or extra_kw:
            parts = []
            if missing:
                parts.append(f"leaves out keyword argument(s) {', '.join(missing)}, given when the model was captured")
            if extra_kw:
                parts.append(f"passes {', '.join(extra_kw)}, not given when the model was captured "
                             "(the trace did not see it: capture with it)")
            raise TypeError("torchreplay.capture: this call " + "; it ".join(parts))
        return new_args, named


def _argument_names(module: torch.nn.Module, model: Any, flat: Sequence[Any], in_spec: Any) -> List[str]:
    """What errors call each flat argument: the model's parameter name with the path into a
    nested argument ('x', 'cache[0]', "opts['scale']"); 'args[i]' where no name is known."""
    forward = module.forward if module is model else model
    try:
        params = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):
        params = []
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    paths, _ = pytree.tree_flatten_with_path(pytree.tree_unflatten(list(flat), in_spec))
    names = []
    for path, _ in paths:
        where, index = path[0].idx, path[1]  # (args, kwargs), then the argument
        if where == 0:
            k = index.idx
            name = positional[k] if k < len(positional) else f"args[{k}]"
        else:
            name = str(index.key)
        names.append(name + "".join(str(p) for p in path[2:]))
    return names


def _graph_inputs_tracked(gm: torch.fx.GraphModule, n_bound: int) -> List[int]:
    """The bound inputs (parameters, buffers) an output of the graph is computed from through ops
    autograd would track (not detach, not into integer results): if one requires grad, eager's
    output would too."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"][:n_bound]
    reaches: Dict[torch.fx.Node, set] = {p: {i} for i, p in enumerate(placeholders)}
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if n.target is aten.detach.default:
            continue
        val = n.meta.get("val")
        vals = val if isinstance(val, (list, tuple)) else [val]
        if not any(isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex()) for v in vals):
            continue
        found = set().union(*(reaches.get(a, set()) for a in n.all_input_nodes))
        if found:
            reaches[n] = found
    output = next(n for n in gm.graph.nodes if n.op == "output")
    tracked = set()
    for o in pytree.tree_leaves(output.args[0]):
        if isinstance(o, torch.fx.Node):
            v = o.meta.get("val")
            if isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex()):
                tracked |= reaches.get(o, set())
    return sorted(tracked)


def _describe(spec: Any) -> str:
    """A TreeSpec as the structure of a call's arguments: (x, (h, c), mask=...)."""
    def show(s: Any) -> str:
        if s.is_leaf():
            return "*"
        kids = [show(c) for c in s.children()]
        if s.type is dict:
            return "{" + ", ".join(f"{k}: {v}" for k, v in zip(s.context, kids)) + "}"
        if s.type is list:
            return "[" + ", ".join(kids) + "]"
        return "(" + ", ".join(kids) + ("," if len(kids) == 1 else "") + ")"
    try:
        args, kwargs = spec.children()
        inner = [show(c) for c in args.children()] + [f"{k}={show(c)}" for k, c in zip(kwargs.context or [], kwargs.children())]
        return "(" + ", ".join(inner) + ")"
    except Exception:  # noqa: BLE001 - not an (args, kwargs) spec
        return show(spec)


def capture(model: Callable, example_args: Sequence[Any], example_kwargs: Optional[Dict[str, Any]] = None, *,
            config: Optional[CompilerConfig] = None, dynamic: bool = False,
            decompositions: Optional[Dict[Any, Callable]] = None) -> Captured:
    """Traces model(*example_args, **example_kwargs) once with torch.export and returns a callable that replays it
    (config.mode "reduce-overhead") or runs it op by op in C++ ("default"), with no Dynamo frame
    per call. dynamic=True lets every tensor dimension take any size (one capture per shape; sizes
    0 and 1, which export specializes, get a trace of their own when first seen); otherwise other
    shapes are a clear error from the engine's input check or a new key. Inference only: with grad
    mode on, a parameter an output is computed from that requires grad is refused per call. A
    model with DTensor parameters (tensor parallelism) is traced through AOTAutograd instead of
    torch.export (Dynamo once, here), one shape per capture."""
    config = config if config is not None else CompilerConfig()
    module = model if isinstance(model, torch.nn.Module) else _AsModule(model)
    args = tuple(example_args)
    kwargs = dict(example_kwargs or {})
    flat_args, in_spec = pytree.tree_flatten((args, kwargs))
    subclassed = _dtensors(module, [a for a in flat_args if isinstance(a, torch.Tensor)])
    # Arguments that are no graph values (None, strings, dtypes, devices, layouts, modules, other
    # objects) are specialized: left out of the trace, put back in place by _Flat, checked per call.
    # So are Python numbers of a DTensor model (AOTAutograd's export makes them no graph inputs).
    values = torch.Tensor if subclassed else (torch.Tensor, bool, int, float)
    constants = {i: a for i, a in enumerate(flat_args) if not isinstance(a, values)}
    leaves = tuple(a for i, a in enumerate(flat_args) if i not in constants)
    traced = _Flat(module, in_spec, constants, len(flat_args))
    names = _argument_names(module, model, flat_args, in_spec)
    program = trace_program(traced, leaves, subclassed=subclassed, dynamic=dynamic, decompositions=decompositions,
                            leaf_names=[f"argument '{n}'" for i, n in enumerate(names) if i not in constants],
                            close=config.reduce_overhead.numerics == "close")
    gm, bound, bound_names = program.gm, program.bound, program.bound_names
    numerics = {"numerics": config.reduce_overhead.numerics}
    if config.reduce_overhead.numerics == "close":
        if subclassed:
            numerics["not_rewritten"] = "DTensor models keep the bitwise graph"
        else:
            gm, numerics = _rewrite_close(gm, bound, bound_names, leaves, dynamic)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    example = [n.meta.get("val") for n in placeholders]
    run_passes(gm, example, config)
    if len(placeholders) != len(bound) + len(leaves):
        raise AssertionError("torchreplay.capture: graph inputs and signature disagree")
    user = list(zip(leaves, placeholders[len(bound):]))
    # Python numbers and tensor sizes export specialized on: checked per call, since the graph
    # computes with them (x * x.shape[0]).
    fixed = {k: a for k, (a, n) in enumerate(user)
             if isinstance(a, (bool, int, float)) and not isinstance(n.meta.get("val"), torch.SymInt)}
    sizes, size_exprs, symbol_dims = _size_checks(
        [n.meta["val"] if isinstance(a, torch.Tensor) else None for a, n in user], program.ranges)

    name = f"c{next(_capture_ids)}.{type(module).__name__ if module is model else getattr(model, '__name__', 'fn')}"
    batch = batch_fields(gm, config, name) if dynamic else {}
    input_names = [b.split("'")[1] if "'" in b else b for b in bound_names] + \
        [n for i, n in enumerate(names) if i not in constants]
    with torch._subclasses.fake_tensor.unset_fake_temporarily():
        graph = lower(gm, [n.meta.get("val") for n in placeholders], list(range(len(bound))), input_names)
    dump_graph(config, name, gm, graph)
    engine = new_engine(graph, config, name, bound_inputs=len(bound), **batch)
    trace = _Trace(model, module, args, kwargs, in_spec, constants, names, dynamic,
                   lambda a, k: capture(model, a, k, config=config, dynamic=True, decompositions=decompositions))
    trace.example, trace.out_spec, trace.num_outputs = list(leaves), program.out_spec, program.num_outputs
    trace.size_exprs, trace.symbol_dims = size_exprs, symbol_dims
    captured = Captured(engine, bound, bound_names, _graph_inputs_tracked(gm, len(bound)), program.mutated, fixed, sizes,
                        model if isinstance(model, torch.nn.Module) else None, trace, program.grad_owners)
    captured.numerics = numerics
    for m in [module] + [v for v in constants.values() if isinstance(v, torch.nn.Module)]:
        _watch(m, captured)
    logger.debug("torchreplay: captured %s (%d nodes, %d bound inputs)", name, graph.num_nodes, len(bound))
    return captured


def _rewrite_close(gm: torch.fx.GraphModule, bound: List[Any], bound_names: List[str], leaves: Tuple[Any, ...],
                   dynamic: bool) -> Tuple[torch.fx.GraphModule, Dict[str, Any]]:
    """Note [Close numerics]: the graph rewritten, checked by running it and the bitwise graph on
    the example inputs (unless the graph writes its inputs: the run would change them), with what
    was done and how far the results are apart; the bitwise graph if the rewritten one fails."""
    from . import close_numerics

    reference = copy.deepcopy(gm)
    try:
        counts = close_numerics.rewrite(gm, bound, bound_names, dynamic)
    except Exception as e:  # noqa: BLE001 - any failure keeps the bitwise graph
        logger.warning("torchreplay.capture: numerics 'close': the rewrite failed (%s: %s); the graph stays bitwise",
                       type(e).__name__, e)
        return reference, {"numerics": "bitwise", "not_rewritten": f"{type(e).__name__}: {e}"}
    report: Dict[str, Any] = {"numerics": "close", "rewrites": counts}
    writes = any(n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and
                 n.target._schema.is_mutable and n.target != torch.ops.torchreplay.check_frozen.default
                 for n in gm.graph.nodes)
    if writes:
        report["checked"] = "not run at capture: the graph writes its inputs"
        return gm, report
    inputs = list(bound) + list(leaves)
    try:
        with torch.no_grad():
            want = reference(*inputs)
            got = gm(*inputs)
    except Exception as e:  # noqa: BLE001
        logger.warning("torchreplay.capture: numerics 'close': the rewritten graph failed on the example inputs "
                       "(%s: %s); the graph stays bitwise", type(e).__name__, e)
        return reference, {"numerics": "bitwise", "not_rewritten": f"{type(e).__name__}: {e}"}
    report.update(close_numerics.difference(got, want))
    report["checked"] = "on the example inputs, against the bitwise graph"
    logger.info("torchreplay.capture: numerics 'close': %s; on the example inputs max abs err %.3g, max rel err %.3g",
                counts, report["max_abs_err"], report["max_rel_err"])
    return gm, report


def save(captured: Captured, path: Any) -> None:
    """Writes a torchreplay.capture result to `path` as a .trp file (Note [The .trp format] in
    torchreplay/format.h): its graph, weights and buffers, and what its trace assumed, for
    torchreplay::Load in a C++ program (torchreplay/torchreplay.h) with no Python. The C++ program
    takes the call's arguments flattened (Program::ArgumentNames) and returns the outputs flattened.
    Only the capture's own trace is saved: with dynamic=True, sizes it does not hold for (0 and 1
    where it was traced with more) are refused by the loaded program. CPU programs only."""
    if not isinstance(captured, Captured):
        raise TypeError(f"torchreplay.save: want what torchreplay.capture returned, got {type(captured).__name__}")
    if getattr(captured, "numerics", {}).get("numerics") == "close":
        raise NotImplementedError("torchreplay.save: this capture was rewritten for numerics 'close' (weights folded "
                                  "and packed at capture, some in oneDNN's layout, which a .trp file does not hold); "
                                  "save a capture made with the default numerics 'bitwise'")
    if captured._trace.size_exprs:
        raise NotImplementedError("torchreplay.save: the trace relates its sizes by expressions only Python checks "
                                  f"({', '.join(map(str, captured._trace.size_exprs))}); capture with dynamic=False")
    kinds, names = [], []
    for described in captured._bound_names:  # "parameter 'fc.weight'"
        kind, _, name = described.partition(" ")
        kinds.append(kind)
        names.append(name.strip("'"))
    _C.save_program(captured, os.fspath(path), kinds, names)


def load(path: Any, config: Optional[CompilerConfig] = None) -> Any:
    """A .trp file loaded by the C++ loader, exactly as torchreplay::Load in a C++ program loads
    it, callable from Python with the flattened arguments (to check a file before shipping it).
    `config`: the engine's settings (default: reduce-overhead)."""
    options = engine_options(config, "graph") if config is not None else None
    return _C.load_program(os.fspath(path), options)
