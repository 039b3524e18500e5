"""What a torchreplay.capture trace assumed of the arguments of a call, and how a call's arguments
map onto its graph (_Trace): the structure of the arguments and outputs, keywords and defaults
bound as Python binds them, the arguments specialized at capture time (_Specialized: None,
strings, dtypes, modules, ... compared per call), the sizes the graph assumes (_size_checks:
checked per call in C++, the rest here), the modules' train/eval modes, and what errors call each
argument (_argument_names, _describe). Captured (captured.py) calls into this on its Python slow
path."""
from __future__ import annotations

import copy
import inspect
import struct
import weakref
from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch
from torch._prims_common import is_non_overlapping_and_dense_or_false
from torch.utils import _pytree as pytree

from . import _C


def trace_state() -> Tuple[Any, ...]:
    """What decides which ops a trace records, now (Note [What a trace was made under] in
    bindings/call.h, TraceState there): the default dtype (factories without one), attention's
    backend switches, autocast's dtype on the CPU and on CUDA (None: off; its casts become nodes),
    and whether the transformer modules' fast path is on (Note [Transformer fast paths]; a Python
    switch, which patches.py tells every capture of when set)."""
    return (torch.get_default_dtype(), _C.sdpa_switches(),
            *(torch.get_autocast_dtype(d) if torch.is_autocast_enabled(d) else None for d in ("cpu", "cuda")),
            torch.backends.mha.get_fastpath_enabled())


# Note [Arguments passed twice]
# A trace sees which arguments are one tensor object: export gives the graph one placeholder for
# both (the other unread), and a model may branch on `is` (MultiheadAttention takes its fused
# path for `query is key is value`). A call must pass the same pattern: the pairs that were one
# object must be one, and distinct tensors alike at the trace (one dtype, sizes and strides: the
# ones a call could pass as one) must be distinct, checked per call on the Python objects
# (CaptureChecks same and distinct, bindings/call.cc); another pattern takes the slow path, which
# traces again for it (captured.py _trace_for). The distinct pairs are capped (_DISTINCT_PAIRS,
# in argument order): a model with more alike arguments (many KV caches) called with two of them
# as one object beyond the cap runs its trace's program.
_DISTINCT_PAIRS = 64


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


class _Trace:
    """How a capture's calls map to its graph: the structure of the arguments and outputs, the
    arguments specialized at capture time, the modules' modes, and how to trace again for other
    sizes."""

    def __init__(self, model: Any, module: torch.nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any],
                 in_spec: Any, constants: Dict[int, Any], names: List[str], dynamic: bool,
                 again: Callable[..., Any]) -> None:
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
        self.made_under = trace_state()
        self.hooks = self.hooks_now()
        # (bound input, requires_grad) of the parameters that decided a matmul's trace (matmul_fold.py)
        self.grad_traced: List[Tuple[int, bool]] = []
        self._again = again

    def state(self) -> Tuple[Any, ...]:
        """What the trace was made under besides the arguments: trace_state() then, the forward
        hooks then, and the requires_grad of the parameters that decided how a matmul was traced."""
        return (*self.made_under, self.hooks, tuple(g for _, g in self.grad_traced))

    def hooks_now(self) -> Tuple[Tuple[int, ...], ...]:
        """The forward hooks and pre-hooks the trace's modules and every module (the global ones)
        have now, by handle: the trace ran those it was made with, as eager's call runs those of
        the moment (patches.py tells every capture when one is added or removed)."""
        from torch.nn.modules import module as nn_module
        modules = [m for m in (ref() for ref, _, _ in self.modes) if m is not None]
        return (tuple(nn_module._global_forward_pre_hooks), tuple(nn_module._global_forward_hooks),
                *(keys for m in modules for keys in (tuple(m._forward_pre_hooks), tuple(m._forward_hooks))))

    def recapture(self, args: Sequence[Any], kwargs: Dict[str, Any], dynamic: bool = True) -> Any:
        return self._again(tuple(args), kwargs, dynamic)

    @staticmethod
    def size_class(flat: Sequence[Any]) -> Tuple[Tuple[int, ...], ...]:
        """Each tensor's sizes as export specializes them: 0, 1, or 2 for any larger size."""
        return tuple(tuple(min(int(d), 2) for d in a.shape) for a in flat if isinstance(a, torch.Tensor))

    def layout(self, flat: Sequence[Any]) -> Tuple[Any, ...]:
        """Each tensor's strides as the trace depends on them (Note [Traced strides] in
        replay/call_checks.cc): in the dims of more than one element in the trace's example (the
        call's other sizes are the size check's to refuse); for a dynamic trace, whose strides
        follow the sizes, None where contiguous, else its dims in the order of their strides, the
        broadcast ones (stride 0) and whether it is dense."""
        def of(a: torch.Tensor, example: torch.Tensor) -> Any:
            if not self.dynamic:
                return tuple(s if n > 1 else None for n, s in zip(example.shape, a.stride()))
            if a.is_contiguous():
                return None
            return (tuple(sorted(range(a.dim()), key=lambda d: -a.stride(d))), tuple(s == 0 for s in a.stride()),
                    is_non_overlapping_and_dense_or_false(a))
        return tuple(of(a, e) for a, e in zip(flat, self.example) if isinstance(a, torch.Tensor))

    @staticmethod
    def identity(flat: Sequence[Any]) -> Tuple[int, ...]:
        """Note [Arguments passed twice]: per argument, the first argument that is the same
        object (itself if none)."""
        first: Dict[int, int] = {}
        return tuple(first.setdefault(id(a), k) if isinstance(a, torch.Tensor) else k for k, a in enumerate(flat))

    def identity_checks(self) -> Tuple[List[Tuple[int, int]], List[Tuple[int, int]]]:
        """The per-call checks of Note [Arguments passed twice]: (pairs of arguments that must be
        one object, pairs that must not be: distinct tensors of one dtype, sizes and strides at
        the trace, at most _DISTINCT_PAIRS)."""
        groups = self.identity(self.example)
        same = [(g, k) for k, g in enumerate(groups) if g != k]
        heads = [(k, a) for k, a in enumerate(self.example) if isinstance(a, torch.Tensor) and groups[k] == k]
        distinct = [(i, j) for n, (i, a) in enumerate(heads) for j, b in heads[n + 1:]
                    if (a.dtype, a.shape, a.stride()) == (b.dtype, b.shape, b.stride())]
        return same, distinct[:_DISTINCT_PAIRS]

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
