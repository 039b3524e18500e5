"""torchreplay.capture: a model as one C++ callable, without Dynamo per call.

    step = torchreplay.capture(model, (x, pos), config=cfg)
    out = step(x, pos)         # straight into C++: the engine's guard key, then replay

This module owns capture() and what it returns, Captured: the call and its Python slow path (how
a call's arguments map onto the graph, and what is checked of them there: arguments.py).
torch.export traces the model once (export.py: functional ATen graph, input mutations as extra
outputs; a model with DTensors, which export cannot trace, goes through AOTAutograd's export
instead); the same passes, lowering and engine as the torch.compile path then run it. Parameters
and buffers are bound once as static inputs; the writes the model makes to buffers and inputs
are put back into the graph as in-place updates, so they land in the real tensors. What is
checked per call and what is not: Note [What a call checks] in replay/call_checks.h. Saving a capture as a
.trp file: saved.py.
"""
from __future__ import annotations

import copy
import inspect
import itertools
import logging
import threading
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx
from torch.utils import _pytree as pytree

from . import _C
from .arguments import _argument_names, _size_checks, _Trace, trace_state
from .capture_sizes import batch_fields
from .config import CompilerConfig
from .engines import dump_graph, new_engine
from .export import _dtensors, _Flat, trace_program
from .lowering import lower
from .passes import run_passes
from .patches import _watch, watch_folded

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


def _shapes(bound: Sequence[Any]) -> Tuple[Any, ...]:
    """The sizes of the bound tensors (None for other bound values)."""
    return tuple(tuple(b.shape) if isinstance(b, torch.Tensor) else None for b in bound)


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
        # Note [Traced strides]: a dynamic trace made on a tensor that is not contiguous has no
        # check for it here; its calls all take the slow path, which picks the trace by layout.
        tensors = [(k, a) for k, a in enumerate(trace.example) if isinstance(a, torch.Tensor)]
        strides = [_C.StrideCheck(k, [] if trace.dynamic else list(a.stride())) for k, a in tensors
                   if not trace.dynamic or a.is_contiguous()]
        same, distinct = trace.identity_checks()   # Note [Arguments passed twice]
        checks = _C.CaptureChecks(fixed=fixed, sizes=[_C.SizeCheck(*s) for s in sizes], strides=strides, module=module,
                                  grad_checked=grad_checked, grad_owners=list(grad_owners), bound_names=bound_names,
                                  slow_path=lambda *a, **k: me()._slow_call(*a, **k),
                                  always_slow=not (flat_in and flat_out) or bool(trace.size_exprs)
                                  or len(strides) < len(tensors),
                                  grad_traced=trace.grad_traced, same=same, distinct=distinct)
        super().__init__(engine, bound=bound, mutated=mutated, num_outputs=trace.num_outputs, returns=returns,
                         checks=checks)
        # The engine's Python object too: torchreplay.stats() lists it while this lives.
        self._bound, self._trace, self._engine, self._bound_names = bound, trace, engine, bound_names
        self._bound_shapes = _shapes(bound)  # the trace read them (a parameter given other data since: traced again)
        self._variants: Dict[Any, Any] = {}   # key -> the Captured traced for it, or _Eager
        self._lock = threading.Lock()
        self._eager_calls: Dict[str, int] = {}  # why -> calls run eagerly by _slow_call (_Eager)
        self._hooks_said = False
        if trace.dynamic:
            self._variants[(trace.size_class(trace.example), trace.state(), trace.layout(trace.example),
                            trace.identity(trace.example), self._bound_shapes)] = self

    @property
    def name(self) -> str:
        return self.engine.name

    def _engines(self) -> List[Any]:
        return [self.engine] + [v.engine for v in self._variants.values() if v is not self and not isinstance(v, _Eager)]

    def stats(self) -> Dict[str, Any]:
        """Calls, replays, captures, fallbacks and the capture log of this model's engine. With
        dynamic=True, a call with sizes the trace does not hold for (0 or 1 where it was traced
        with more) runs a trace of its own: counters are summed over all of them, and `traces`
        lists each one's own stats. Calls that ran the model eagerly from Python (arguments whose
        trace failed, calls under autocast, hooks changed too often) count as calls and
        eager_fallbacks, their reasons in fallback_reasons."""
        engines = self._engines()
        out = dict(engines[0].stats(), name=self.name)
        if len(engines) > 1:
            each = [dict(e.stats(), name=e.name) for e in engines]
            for k, v in out.items():
                if isinstance(v, int) and not isinstance(v, bool):
                    out[k] = sum(e[k] for e in each)
            out["traces"] = each
        with self._lock:
            eager = dict(self._eager_calls)
        if eager:
            out["calls"] += sum(eager.values())
            out["eager_fallbacks"] += sum(eager.values())
            out["fallback_reasons"] = list(out["fallback_reasons"]) + [r for r in eager if r not in out["fallback_reasons"]]
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
        every rank, and every rank profiles). Under numerics "close", a step whose kernel the
        rewrite chose also has "choice": the way it took and the µs of each way timed at capture
        (numerics["choices"]). `python -m torchreplay_bench.profile` prints it for the harness's
        models."""
        from .close_numerics import choice_text
        flat = self._trace.flatten(args, kwargs)
        target = self._trace_for(flat, args, kwargs)
        rows = target.engine.profile(list(target._bound) + flat, iterations)
        choices = getattr(target, "numerics", {}).get("choices", {})
        for row in rows:
            if row["node"] in choices:
                row["choice"] = choice_text(choices[row["node"]])
        return rows

    def _trace_for(self, flat: List[Any], args: Sequence[Any], kwargs: Dict[str, Any]) -> "Captured":
        """The capture whose trace holds for these arguments and what it was made under: this one,
        or one traced for them, made once, when first needed, under a lock (two threads never
        trace at once): for arguments of other strides (Note [Traced strides] in
        replay/call_checks.cc); (dynamic=True) for the sizes export specialized (0, 1); under
        another default dtype, attention backend switches, autocast state or transformer fast
        path switch (Note [What a trace was made under]) or forward hooks
        or requires_grad of a parameter that decided a matmul's fold (matmul_fold.py), or
        parameters and buffers given data of other sizes (`p.data = t`: their Call refuses them). Arguments
        of other kinds than traced (None where a tensor was), or other sizes than a static trace's,
        get no trace of their own: this capture's call raises the clear error. Where tracing again
        fails (torch.export's error: a view the new strides do not allow), the arguments' kind
        runs the model eagerly (_Eager: eager's result, or eager's error), said once."""
        state = (*trace_state(), self._trace.hooks_now(),
                 tuple(self._bound[i].requires_grad for i, _ in self._trace.grad_traced))
        if not self._trace.same_kinds(flat) or (not self._trace.dynamic and any(
                isinstance(a, torch.Tensor) and a.shape != e.shape for a, e in zip(flat, self._trace.example))):
            return self   # other sizes than a static trace's: its call raises the clear error
        layout, traced = self._trace.layout(flat), self._trace.layout(self._trace.example)
        identity = self._trace.identity(flat)
        same_identity = identity == self._trace.identity(self._trace.example)
        shapes = _shapes(self._bound)
        if not self._trace.dynamic and state == self._trace.state() and layout == traced and same_identity and \
                shapes == self._bound_shapes:
            return self
        key = (self._trace.size_class(flat) if self._trace.dynamic else None, state, layout, identity, shapes)
        found = self._variants.get(key)
        if found is None:
            with self._lock:
                found = self._variants.get(key)
                if found is None:
                    if not same_identity:
                        logger.info("torchreplay: %s: tracing again for arguments passed as one tensor otherwise "
                                    "(Note [Arguments passed twice]): %s (traced with %s)", self.name, identity,
                                    self._trace.identity(self._trace.example))
                    elif shapes != self._bound_shapes:
                        logger.info("torchreplay: %s: tracing again: parameters or buffers were given data of other "
                                    "sizes since the capture", self.name)
                    elif layout != traced:
                        logger.info("torchreplay: %s: tracing again for arguments of other strides (Note [Traced "
                                    "strides]): %s (traced with %s)", self.name, layout, traced)
                    elif state[-2] != self._trace.hooks:
                        if sum(k[1][-2] != self._trace.hooks for k in self._variants) >= _HOOK_SETS:
                            # a hook registered anew every call: bounded, said once
                            if not self._hooks_said:
                                self._hooks_said = True
                                logger.warning("torchreplay: %s: forward hooks changed %d times since the capture; "
                                               "calls under further hooks run the model eagerly (register a hook "
                                               "once, or capture again)", self.name, _HOOK_SETS)
                            return _HOOKS_CHANGED
                        logger.warning("torchreplay: %s: tracing again: forward hooks were added or removed since "
                                       "the capture (its fast call path holds for the hooks it was made with: "
                                       "capture again for that)", self.name)
                    elif state != self._trace.state():
                        logger.info("torchreplay: %s: tracing again under the default dtype %s, attention switches "
                                    "%s, autocast %s (cpu) and %s (cuda), transformer fast path %s and parameters "
                                    "requiring grad %s (traced under %s)", self.name, *state[:-2], state[-1],
                                    self._trace.state())
                    else:
                        logger.info("torchreplay: %s: tracing again for sizes %s (a trace holds for 0, 1 or 2 "
                                    "and more, as export specializes)", self.name, key[0])
                    try:
                        found = self._trace.recapture(args, kwargs, dynamic=self._trace.dynamic)
                        found._variants, found._lock = self._variants, self._lock
                    except Exception as e:  # noqa: BLE001 - any trace failure: the model's eager, said once
                        found = _Eager(f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}")
                        logger.warning("torchreplay: %s: tracing again for these arguments failed (%s); calls like "
                                       "them run the model eagerly", self.name, found.reason)
                    self._variants[key] = found
        return found

    def _slow_call(self, *args: Any, **kwargs: Any) -> Any:
        epoch = _C.module_modes_epoch()
        self._trace.check_modes()
        flat = self._trace.flatten(args, kwargs)
        target = self._trace_for(flat, args, kwargs)
        if isinstance(target, _Eager):
            if not torch.compiler.is_compiling():   # not another capture's trace through this one
                with self._lock:
                    self._eager_calls[target.reason] = self._eager_calls.get(target.reason, 0) + 1
            return self._trace.model(*args, **kwargs)
        target._trace.check_size_exprs(flat)
        outs = target._fast(*flat)
        if target is self:   # else the calls take this path until modes, hooks and the rest hold again
            self._modes_checked(epoch)
        spec = self._trace.out_spec
        if spec.is_leaf():
            return outs
        return pytree.tree_unflatten(list(outs), spec)


_HOOK_SETS = 8  # traces made again for other forward hooks, per capture


class _Eager:
    """The arguments' kind whose trace failed (Captured._trace_for): its calls run the model."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __getattr__(self, name: str) -> Any:   # precapture and profile reach for a capture's parts
        raise RuntimeError(f"torchreplay: these arguments run the model eagerly: tracing them failed ({self.reason})")


_HOOKS_CHANGED = _Eager("forward hooks changed too often since the capture")


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


def capture(model: Callable, example_args: Sequence[Any], example_kwargs: Optional[Dict[str, Any]] = None, *,
            config: Optional[CompilerConfig] = None, dynamic: bool = False,
            decompositions: Optional[Dict[Any, Callable]] = None) -> Captured:
    """Traces model(*example_args, **example_kwargs) once with torch.export and returns a callable that replays it
    (config.mode "reduce-overhead", what a call without a config gets) or runs it op by op in C++
    (a config whose mode is "default"), with no Dynamo frame per call. dynamic=True lets every
    tensor dimension take any size (one capture per shape; sizes 0 and 1, which export
    specializes, get a trace of their own when first seen); arguments of other strides than the
    example's get a trace of their own (Note [Traced strides]); otherwise other
    shapes are a clear error from the engine's input check or a new key. Inference only: with grad
    mode on, a parameter an output is computed from that requires grad is refused per call. A
    model with DTensor parameters (tensor parallelism) is traced through AOTAutograd instead of
    torch.export (Dynamo once, here), one shape per capture."""
    if config is None:
        config = CompilerConfig()
        config.mode = "reduce-overhead"
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
    grad_checked = _graph_inputs_tracked(gm, len(bound))  # (the graph's as eager runs it: before any fold)
    if config.reduce_overhead.numerics == "close":
        if subclassed:
            numerics["not_rewritten"] = "DTensor models keep the bitwise graph"
        else:
            gm, numerics = _rewrite_close(gm, bound, bound_names, leaves, dynamic)
    elif not subclassed:
        from .close_numerics import fold_bitwise
        folds = fold_bitwise(gm, bound, bound_names)
        if folds:
            numerics["folded"] = folds
    if not subclassed:
        from .close_numerics import folded
        watch_folded(folded(gm, bound))  # Note [Writes a capture would not see]
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
    dump_graph(config, name, gm, graph, numerics.get("choices"))
    engine = new_engine(graph, config, name, bound_inputs=len(bound), **batch)
    trace = _Trace(model, module, args, kwargs, in_spec, constants, names, dynamic,
                   lambda a, k, dyn: capture(model, a, k, config=config, dynamic=dyn, decompositions=decompositions))
    trace.example, trace.out_spec, trace.num_outputs = list(leaves), program.out_spec, program.num_outputs
    trace.size_exprs, trace.symbol_dims = size_exprs, symbol_dims
    trace.grad_traced = program.grad_traced
    captured = Captured(engine, bound, bound_names, grad_checked, program.mutated, fixed, sizes,
                        model if isinstance(model, torch.nn.Module) else None, trace, program.grad_owners)
    captured.numerics = numerics
    if any(trace.hooks):
        logger.warning("torchreplay: %s: the model's forward hooks were traced: what they do to outputs replays, "
                       "while what they do in Python (counting calls, keeping activations) ran once, at the trace, "
                       "on fake tensors", name)
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
        counts, choices = close_numerics.rewrite(gm, bound, bound_names, dynamic)
    except Exception as e:  # noqa: BLE001 - any failure keeps the bitwise graph
        logger.warning("torchreplay.capture: numerics 'close': the rewrite failed (%s: %s); the graph stays bitwise",
                       type(e).__name__, e)
        return reference, {"numerics": "bitwise", "not_rewritten": f"{type(e).__name__}: {e}"}
    report: Dict[str, Any] = {"numerics": "close", "rewrites": counts, "choices": choices}
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
    layout = close_numerics.layout_difference(got, want)
    if layout is not None:
        logger.warning("torchreplay.capture: numerics 'close': the rewritten graph gives %s; the graph stays bitwise",
                       layout)
        return reference, {"numerics": "bitwise", "not_rewritten": layout}
    report.update(close_numerics.difference(got, want))
    report["checked"] = "on the example inputs, against the bitwise graph"
    logger.info("torchreplay.capture: numerics 'close': %s; on the example inputs max abs err %.3g, max rel err %.3g",
                counts, report["max_abs_err"], report["max_rel_err"])
    return gm, report
