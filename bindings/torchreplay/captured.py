"""torchreplay.capture: a model as one C++ callable, without Dynamo per call.

    step = torchreplay.capture(model, (x, pos), config=cfg)
    out = step(x, pos)         # straight into C++: the engine's guard key, then replay

torch.export traces the model once (functional ATen graph, input mutations as extra outputs);
the same passes, lowering and engine as the torch.compile path then run it. Parameters and buffers
are bound once as static inputs; the writes the model makes to buffers and inputs are put back
into the graph as in-place updates, so they land in the real tensors. What is checked per call and
what is not: docs/design.md, "torchreplay.capture".
"""
from __future__ import annotations

import inspect
import itertools
import logging
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.fx
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind
from torch.utils import _pytree as pytree

from . import _C
from .backend import _all_engines, _dump, engine_options
from .config import CompilerConfig
from .lowering import lower
from .passes import run_passes

logger = logging.getLogger("torchreplay")
_capture_ids = itertools.count()
aten = torch.ops.aten


class _AsModule(torch.nn.Module):
    def __init__(self, fn: Callable) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


def _decompositions(extra: Optional[Dict[Any, Callable]]) -> Any:
    """What AOTAutograd does under torch.compile: CompositeImplicitAutograd ops decompose (linear ->
    t + addmm), the rest of ATen stays; plus the caller's own decompositions."""
    from torch._export.utils import _collect_all_valid_cia_ops

    table = torch.export.default_decompositions()
    cia = _collect_all_valid_cia_ops()
    for op in list(table.keys()):
        if op not in cia:
            table.pop(op)
    for op, fn in (extra or {}).items():
        table[op] = fn
    return table


def _writes_back(ep: ExportedProgram, gm: torch.fx.GraphModule) -> int:
    """Turns the export's mutation outputs (the new value of a buffer or an input) into copy_
    nodes, so that the graph writes them itself (the reinplace pass then makes some of them
    in-place updates). Each copy_ goes right after the last read of the old value, and later
    uses of the new value read the written tensor, so that an output computed from it (x.mul_(2);
    return x.view(-1)) aliases the caller's tensor as in eager. Returns the user output count."""
    sig = ep.graph_signature
    placeholders = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    written = {}  # buffer FQN or user input name -> placeholder
    for spec in sig.input_specs:
        if spec.kind == InputKind.BUFFER:
            written[spec.target] = placeholders[spec.arg.name]
        elif spec.kind == InputKind.USER_INPUT and hasattr(spec.arg, "name"):
            written[spec.arg.name] = placeholders[spec.arg.name]
    output = next(n for n in gm.graph.nodes if n.op == "output")
    user = []
    for spec, new in zip(sig.output_specs, list(output.args[0])):
        if spec.kind == OutputKind.USER_OUTPUT:
            user.append(new)
            continue
        if spec.kind not in (OutputKind.BUFFER_MUTATION, OutputKind.USER_INPUT_MUTATION):
            raise NotImplementedError(f"torchreplay.capture: export output kind {spec.kind.name}")
        buf = written[spec.target]
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        last = max([new] + [u for u in buf.users if u.op != "output"], key=order.__getitem__)
        with gm.graph.inserting_after(last):
            copy = gm.graph.call_function(aten.copy_.default, (buf, new))
        new.replace_all_uses_with(copy, delete_user_cb=lambda u: u is not copy and u.op != "output"
                                  and order.get(u, len(order)) > order[last])
        user = [copy if u is new else u for u in user]
    output.args = (tuple(user),)
    gm.graph.lint()
    gm.recompile()
    return len(user)


def _size_checks(vals: List[Any], ranges: Dict[Any, Any]) -> List[Any]:
    """What the graph assumes of each tensor argument's sizes, as (argument, dim, lowest,
    highest, group): a size export specialized on (lowest == highest), or a symbol's range, dims
    of one symbol sharing a group (they must be equal). Sizes given by other expressions of
    symbols (2 * s0) are not checked."""
    big = 2 ** 63 - 1
    groups: Dict[Any, int] = {}
    checks = []
    for k, val in enumerate(vals):
        if val is None:
            continue
        for d, size in enumerate(val.shape):
            if not isinstance(size, torch.SymInt):
                checks.append((k, d, int(size), int(size), -1))
                continue
            expr = size.node.expr
            if not expr.is_Symbol:
                continue
            r = ranges.get(expr)
            lo = int(r.lower) if r is not None and r.lower.is_Integer else 0
            hi = int(r.upper) if r is not None and r.upper.is_Integer else big
            checks.append((k, d, lo, min(hi, big), groups.setdefault(expr, len(groups))))
    return checks


class Captured(_C.Call):
    """A model captured by torchreplay.capture; call it like the model. Positional arguments,
    flat (tensors and Python numbers) go straight to C++; nested ones are flattened first."""

    def __init__(self, engine: Any, bound: List[Any], mutated: List[int], fixed: Dict[int, Any],
                 sizes: List[Any], module: Optional[torch.nn.Module], constants: Dict[int, Any],
                 in_spec: Any, out_spec: Any, num_outputs: int) -> None:
        returns = "one" if out_spec.is_leaf() else "tuple"
        super().__init__(engine, bound=bound, mutated=mutated, num_outputs=num_outputs, fixed=fixed,
                         returns=returns, sizes=sizes, module=module, check_overlap=True)
        self._bound, self._in_spec, self._out_spec = bound, in_spec, out_spec
        self._constants = constants
        self._kwarg_names = dict.fromkeys(in_spec.children()[1].context or [])
        self._flat_out = out_spec.is_leaf() or (
            out_spec.type is tuple and all(c.is_leaf() for c in out_spec.children()))

    @property
    def name(self) -> str:
        return self.engine.name

    def stats(self) -> Dict[str, Any]:
        """Calls, replays, captures, fallbacks and the capture log of this model's engine."""
        return dict(self.engine.stats(), name=self.engine.name)

    def precapture(self, input_sets: Sequence[Sequence[Any]]) -> None:
        """Warms up and captures these argument sets' keys ahead of time, largest first."""
        self.engine.precapture([list(self._bound) + self._flatten(args, {}) for args in input_sets])

    def _flatten(self, args: Sequence[Any], kwargs: Dict[str, Any]) -> List[Any]:
        if kwargs.keys() == self._kwarg_names.keys():  # keywords in any order, as Python allows
            kwargs = {k: kwargs[k] for k in self._kwarg_names}
        flat, spec = pytree.tree_flatten((tuple(args), kwargs))
        if spec != self._in_spec:
            raise TypeError(f"torchreplay.capture: the model was captured with arguments structured as "
                            f"{self._in_spec}; this call's are {spec}".replace("\n", ""))
        for i, want in self._constants.items():
            if flat[i] is not want and flat[i] != want:
                raise ValueError(f"torchreplay: argument {i} is {flat[i]!r}, but the graph was captured with "
                                 f"{want!r} there; capture again for another value")
        return [a for i, a in enumerate(flat) if i not in self._constants] if self._constants else flat


# Modules whose parameters, buffers and submodules a Captured has bound: assigning a new one
# (model.weight = nn.Parameter(...), model.buf = t, model.sub = ...) makes those Captureds raise
# on every later call, as their graph still holds the old tensors. Conversions that go through
# Module._apply (.to(), .half(), .double()) change parameters through .data, which the engine
# sees (new memory, or a dtype it refuses), but replace buffers without a hook.
_watched: "weakref.WeakKeyDictionary[torch.nn.Module, weakref.WeakSet]" = weakref.WeakKeyDictionary()
_hooks: List[Any] = []


def _on_registration(module: torch.nn.Module, name: str, value: Any) -> None:
    if torch.compiler.is_compiling():
        # Dynamo traces global hooks into the frames it compiles: reading _watched there would
        # make it guard on the weak dictionary's keys, which garbage collection changes under it
        # (a guard that fails to build). The modules it traces are not torchreplay.capture's.
        return None
    captures = _watched.get(module)
    if not captures:
        return None
    what = "submodule" if isinstance(value, torch.nn.Module) else "parameter" if isinstance(
        value, torch.nn.Parameter) else "buffer"
    for c in list(captures):
        c._set_stale(f"torchreplay: {what} '{name}' of {type(module).__name__} was replaced after the model was "
                     f"captured as {c.name!r} (its graph holds the old tensors); capture the model again")
    return None


def _watch(module: torch.nn.Module, captured: Captured) -> None:
    if not _hooks:
        from torch.nn.modules import module as nn_module
        _hooks.extend([nn_module.register_module_parameter_registration_hook(_on_registration),
                       nn_module.register_module_buffer_registration_hook(_on_registration),
                       nn_module.register_module_module_registration_hook(_on_registration)])
    for m in module.modules():
        _watched.setdefault(m, weakref.WeakSet()).add(captured)


def _nested_call(captured: Captured) -> Callable:
    """For nested arguments or outputs: flatten, call, unflatten (the only per-call Python)."""
    call = super(Captured, captured).__call__  # the C++ call

    def step(*args: Any, **kwargs: Any) -> Any:
        outs = call(*captured._flatten(args, kwargs))
        if captured._out_spec.is_leaf():
            outs = [outs]
        return pytree.tree_unflatten(list(outs), captured._out_spec)

    step.captured = captured  # type: ignore[attr-defined]
    step.stats = captured.stats  # type: ignore[attr-defined]
    step.precapture = captured.precapture  # type: ignore[attr-defined]
    return step


def capture(model: Callable, example_args: Sequence[Any], example_kwargs: Optional[Dict[str, Any]] = None, *,
            config: Optional[CompilerConfig] = None, dynamic: bool = False,
            decompositions: Optional[Dict[Any, Callable]] = None) -> Any:
    """Traces model(*example_args, **example_kwargs) once with torch.export and returns a callable that replays it
    (config.mode "reduce-overhead") or runs it op by op in C++ ("default"), with no Dynamo frame
    per call. dynamic=True lets every tensor dimension change (one capture per shape);
    otherwise other shapes are a clear error from the engine's input check or a new key."""
    config = config if config is not None else CompilerConfig()
    module = model if isinstance(model, torch.nn.Module) else _AsModule(model)
    args = tuple(example_args)
    kwargs = dict(example_kwargs or {})
    dynamic_shapes = None
    if dynamic:  # every dimension of every tensor, by forward's parameter names
        bound_args = inspect.signature(module.forward).bind(*args, **kwargs).arguments
        dynamic_shapes = {k: pytree.tree_map(
            lambda a: {d: torch.export.Dim.AUTO for d in range(a.dim())} if isinstance(a, torch.Tensor) else None,
            v) for k, v in bound_args.items()}
    with torch.no_grad():
        ep = torch.export.export(module, args, kwargs, dynamic_shapes=dynamic_shapes, strict=False)
        ep = ep.run_decompositions(_decompositions(decompositions))
    gm = ep.graph_module
    num_outputs = _writes_back(ep, gm)
    sig = ep.graph_signature
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    example = [n.meta.get("val") for n in placeholders]
    run_passes(gm, example, config)

    # Bound inputs: the module's own parameters, buffers and constants, in the graph's order.
    state = dict(module.named_parameters(remove_duplicate=False))
    state.update(module.named_buffers(remove_duplicate=False))
    bound: List[Any] = []
    user_specs = []
    for spec in sig.input_specs:
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            bound.append(state[spec.target])
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            bound.append(ep.constants[spec.target])
        elif spec.kind == InputKind.USER_INPUT:
            user_specs.append(spec)
        else:
            raise NotImplementedError(f"torchreplay.capture: export input kind {spec.kind.name}")
    flat_args, in_spec = pytree.tree_flatten((args, kwargs))
    if len(bound) + len(user_specs) != len(placeholders) or len(user_specs) != len(flat_args):
        raise AssertionError("torchreplay.capture: graph inputs and signature disagree")
    # Arguments that are neither tensors nor numbers (None, strings): export specialized on them
    # and the graph does not read them; they leave the graph and are checked in Python per call.
    constants = {i: a for i, a in enumerate(flat_args)
                 if not isinstance(a, (torch.Tensor, bool, int, float, torch.SymInt))}
    for i in constants:
        node = placeholders[len(bound) + i]
        if node.users:
            raise NotImplementedError(f"torchreplay.capture: argument {i} ({type(flat_args[i]).__name__}) is read "
                                      "by the graph; pass tensors or Python numbers")
        gm.graph.erase_node(node)
    gm.recompile()
    kept = [i for i in range(len(flat_args)) if i not in constants]
    placeholders = placeholders[:len(bound)] + [placeholders[len(bound) + i] for i in kept]
    example = [n.meta.get("val") for n in placeholders]
    user = [(flat_args[i], placeholders[len(bound) + k], user_specs[i]) for k, i in enumerate(kept)]
    # Python numbers and tensor sizes export specialized on: checked per call, since the graph
    # computes with them (x * x.shape[0]).
    fixed = {k: a for k, (a, n, _) in enumerate(user)
             if isinstance(a, (bool, int, float)) and not isinstance(n.meta.get("val"), torch.SymInt)}
    sizes = _size_checks([n.meta["val"] if isinstance(a, torch.Tensor) else None for a, n, _ in user],
                         ep.range_constraints)
    mutated_names = {s.target for s in sig.output_specs if s.kind == OutputKind.USER_INPUT_MUTATION}
    mutated = [k for k, (_, _, spec) in enumerate(user) if spec.arg.name in mutated_names]

    name = f"c{next(_capture_ids)}.{type(module).__name__ if module is model else getattr(model, '__name__', 'fn')}"
    with torch._subclasses.fake_tensor.unset_fake_temporarily():
        graph = lower(gm, example, list(range(len(bound))))
    _dump(config, name, gm, graph)
    engine = _C.Engine(graph, engine_options(config, name, bound_inputs=len(bound)))
    _all_engines.add(engine)
    captured = Captured(engine, bound, mutated, fixed, sizes, model if isinstance(model, torch.nn.Module) else None,
                        constants, in_spec, ep.call_spec.out_spec, num_outputs)
    if isinstance(model, torch.nn.Module):
        _watch(model, captured)
    flat_in = (all(c.is_leaf() for c in in_spec.children()[0].children()) and not in_spec.children()[1].children()
               and not constants)
    logger.debug("torchreplay: captured %s (%d nodes, %d bound inputs)", name, graph.num_nodes, len(bound))
    return captured if flat_in and captured._flat_out else _nested_call(captured)
