"""The guards of training graphs and traced backwards under torch.compile, which backend.py
puts around the graphs it compiles: the requires_grad of a graph's leaves (Note [Leaves'
requires_grad]: the Dynamo guard, the checks where AOTAutograd's wrapper stays), attention's
backend switches (Note [What a trace was made under] in bindings/call.h), what a traced
backward would not do as eager's (Note [Traced backward]: _hazard, _TracedBackward), and a
returned tensor whose backward the graph ran (Note [Returning a tensor whose backward ran])."""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

import torch
import torch.fx

from . import _C
from .matmul_fold import deciding_inputs


def _lifted(gm: torch.fx.GraphModule) -> List[torch.Tensor]:
    """The tensors AOTAutograd puts ahead of Dynamo's arguments (aot_module_simplified): the
    graph module's parameters and buffers, as Dynamo installed them (a compiled optimizer's state,
    free tensors a function reads), in AOTAutograd's order."""
    state = dict(gm.named_parameters(remove_duplicate=False))
    state.update(gm.named_buffers(remove_duplicate=False))
    return list(state.values())



# Note [Leaves' requires_grad]
# A graph computes gradients for the inputs that required grad when it was compiled: AOTAutograd's
# backward graph has none for the others, and a traced backward (Note [Traced backward])
# differentiates and accumulates exactly the leaves it was traced with. Dynamo guards an input's
# requires_grad, but skips the tensor guards of an nn.Module whose __dict__ is unchanged (its
# recursive dict tags, skip_tensor_guards_with_matching_dict_tags, PyTorch 2.11): a parameter
# frozen when the step was compiled and unfrozen later (progressive unfreezing), or the reverse,
# kept the old graph, and its gradient was silently never computed (or still written). So for a
# graph compiled with grad mode on, the backend adds a guard of its own to the frame's guards
# (`_guard_requires_grad`): a root lambda guard, `_C.RequiresGradGuard`, that checks in C++ that
# each nn.Parameter the graph takes from a module (not their .grad, which training replaces every
# step) requires grad as it did; when one changed Dynamo recompiles, and the new graph computes
# the gradients eager would. A graph compiled with grad mode off gets the guard too, on the
# parameters whose requires_grad decided how a matmul was folded (Note [Matmuls folded as eager
# folds them] in matmul_fold.py). It costs one C++ call per frame call and a flag read per parameter
# (0.08 µs for the MLP's 6 parameters, 0.10 µs for the tiny Llama's 21) and leaves the module
# guards' dict-tag fast path as it is (turning the tag skip off instead costs the tiny Llama's
# step ~20 µs of guards). Should such a call still reach a graph (a guard_filter_fn that drops the
# guard; a parameter replaced by another nn.Parameter since compiling, which the guard does not
# hold, once Dynamo's own guards have passed the new one), the call raises, naming the input: a
# training graph when an input requires grad that did not (TrainingSpec.compiled_requires_grad;
# `_frozen_checked` where AOT's wrapper stays), an inference graph when a module parameter that
# did not requires grad (AotEpilogue.frozen), a traced backward when its leaves are not the ones
# it was traced with (AotEpilogue.leaves_fixed; `_TracedBackward.wrap` where AOT's wrapper stays).
_UNSEEN = ("torch.compile recompiles when torchreplay's guard sees such a change (Note [Leaves' requires_grad]); "
           "it did not here (a guard_filter_fn that drops it, or the parameter replaced by another nn.Parameter "
           "since the graph was compiled): call torch._dynamo.reset() after changing requires_grad")


def _module_parameters(gm: torch.fx.GraphModule) -> List[Any]:
    """(argument index, name, parameter): the real nn.Parameters a Dynamo graph takes from
    nn.Modules (Note [Leaves' requires_grad]): its arguments found in a module, and those
    installed in the graph module (index -1). Not their .grad or other tensors: those are
    replaced as training goes, and a guard holding them would fail at every step."""
    from torch._dynamo.source import is_from_unspecialized_nn_module_source

    found = []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i, n in enumerate(placeholders):
        arg = n.meta.get("grapharg")
        source = getattr(arg, "source", None)
        if source is not None and is_from_unspecialized_nn_module_source(source) and \
                isinstance(example := arg.example, torch.nn.Parameter):
            found.append((i, source.name, example))
    found.extend((-1, name, p) for name, p in gm.named_parameters(remove_duplicate=False))
    return found


def _frozen_checked(fn: Callable, name: str, gm: torch.fx.GraphModule) -> Callable:
    """fn, for a training graph that keeps AOTAutograd's wrapper, raising when a module parameter
    that did not require grad when it was compiled requires grad now (its gradient would be
    skipped): where no guard saw the change (Note [Leaves' requires_grad])."""
    frozen = [(i, what) for i, what, p in _module_parameters(gm) if i >= 0 and not p.requires_grad]
    if not frozen:
        return fn

    def checked(*args: Any) -> Any:
        if torch.is_grad_enabled():
            for i, what in frozen:
                if args[i].requires_grad:
                    raise RuntimeError(
                        f"torchreplay: graph '{name}': argument {i} ({what}) requires grad, but did not when the "
                        "graph was compiled: the graph computes no gradient for it, which would be silently "
                        f"skipped. {_UNSEEN}")
        return fn(*args)
    return checked


def _add_frame_guard(guard: Any, kind: str, code: str) -> bool:
    """Adds `guard` (a callable taking the frame's locals) to the guards of the frame Dynamo is
    compiling, of guard type `kind` (what a guard_filter_fn sees), shown as `code` in its guard
    dumps; False where there is no frame."""
    ctx = torch._guards.TracingContext.try_get()
    if ctx is None:
        return False
    try:
        from torch._dynamo.source import GlobalStateSource
        from torch._guards import Guard
    except ImportError:
        return False

    def create(builder: Any, g: Any) -> None:
        builder.guard_manager.root.add_lambda_guard(guard, [code], g.user_stack)

    create.__name__ = kind  # Dynamo's guard type is its create function's name
    ctx.guards_context.dynamo_guards.add(Guard(GlobalStateSource(), create))
    return True


def _guard_requires_grad(gm: torch.fx.GraphModule, name: str) -> Optional[Any]:
    """Adds the frame's guard on the requires_grad of the module parameters graph `name` takes (Note
    [Leaves' requires_grad]); the guard, or None where there is none to add."""
    # grad mode off: an inference graph, whose parameters' requires_grad matters only where it
    # decided how a matmul folds (Note [Matmuls folded as eager folds them])
    deciding = None if torch.is_grad_enabled() else deciding_inputs(gm)
    params = [(what, p) for i, what, p in _module_parameters(gm) if deciding is None or i in deciding]
    if not params:
        return None
    guard = _C.RequiresGradGuard([p for _, p in params])
    shown = ", ".join(f"{n}.requires_grad == {p.requires_grad}" for n, p in params[:6])
    code = (f"torchreplay {name}: {shown}{', ...' if len(params) > 6 else ''} "
            f"({len(params)} module parameters, as compiled)")
    return guard if _add_frame_guard(guard, "TORCHREPLAY_REQUIRES_GRAD", code) else None


_ATTENTION = {torch._C._nn.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention}


def _guard_attention_backends(gm: torch.fx.GraphModule, name: str) -> Optional[Any]:
    """For a graph with scaled_dot_product_attention, adds the frame's guard on its backend
    switches, which decided what the graph recorded for it (Note [What a trace was made under] in
    bindings/call.h); the guard, or None where there is none to add."""
    if not any(n.op == "call_function" and n.target in _ATTENTION for n in gm.graph.nodes):
        return None
    guard = _C.SdpaGuard()
    code = f"torchreplay {name}: scaled_dot_product_attention's backend switches as compiled"
    return guard if _add_frame_guard(guard, "TORCHREPLAY_SDPA", code) else None


# Note [Traced backward]
# Dynamo traces `loss.backward()` inside a compiled function into the forward's graph:
# torch.autograd.grad of the loss with respect to the leaves it reaches, then each gradient
# accumulated into `.grad` under no_grad (a new `.grad` as an output, or the old one written in
# place). It does so under its global `torch._dynamo.config.trace_autograd_ops` (off by default),
# and, for the frames a torchreplay backend compiles with config.trace_backward (the default),
# while it traces their backward (_trace_backward_for_torchreplay in patches.py). None of such a
# graph's outputs require grad, so AOTAutograd hands it over as an inference graph and the whole
# step (forward, backward, accumulation) replays as one graph through a direct call: no graph
# break, no autograd engine, no AccumulateGrad nodes, no copies of saved activations. Its
# gradients are eager's, bitwise (tests/python/test_traced_backward.py).
# Dynamo's traced backward (PyTorch 2.11) differs from eager's where autograd's graph holds more
# than the compiled graph sees. For torchreplay's own tracing, those are seen while Dynamo traces
# the backward and left to autograd (the graph breaks at the backward: _left_to_autograd in
# patches.py); under Dynamo's global switch the backend refuses them with an error (running the
# traced graph eagerly is just as wrong), when the graph is compiled and again on every call (the
# leaves' checks are bits read in C++, BackwardHazards; Python only when one is set):
#   - an argument that requires grad and has a grad_fn, in a graph that computes values requiring
#     grad: the backward stops at it, or, when the graph has no leaf of its own (a graph break
#     inside the model's forward, a module with backward hooks), Dynamo drops the backward
#     altogether and the gradients are silently lost. Under the switch refused for every such
#     graph, also a forward piece whose backward runs outside, at compile time only (per call,
#     only the leaves of a graph with a traced backward are checked); a graph that only reads or
#     detaches such an argument is not refused. Where the backward itself is after the break (the
#     loss's leaves all before it), Dynamo would trace it as nothing in a graph that shows
#     nothing: `_trace_backward_for_torchreplay` makes Dynamo break the graph at that backward
#     instead (for every backend), so autograd runs it;
#   - a leaf Dynamo installed in the graph module instead of passing it: refused (unchecked);
#   - hooks on a leaf the backward differentiates (register_hook, post-accumulate-grad hooks, hooks
#     on its gradient accumulator: DistributedDataParallel's): the traced backward does not run
#     them. Hooks added after the trace, which no guard sees, are refused per call either way;
#   - create_graph=True: the gradients would not require grad as eager's do;
#   - leaves other than those it was traced with (a parameter frozen or unfrozen since): Dynamo
#     recompiles the step first (Note [Leaves' requires_grad]); a call that still comes is refused.
# Outputs still alive at the next call (new gradients held by .grad, losses a loop keeps) are
# copied out of the pool first (preserve_outputs), as a training graph's are.
_NOT_TRACED = ("Set config.trace_backward = False (or, where you set it, torch._dynamo.config.trace_autograd_ops "
               "= False) for this function: its backward then runs in autograd")


def _hazard(t: torch.Tensor) -> Optional[str]:
    """What of tensor t a traced backward would not do as eager's backward does (bits read in
    C++: BackwardHazards), or None."""
    bits = _C.backward_hazards(t)
    return ("has a grad_fn: autograd's graph goes on outside this compiled graph (a graph break "
            "before the backward: in the code, in a module Dynamo does not trace such as nn.LSTM, or "
            "at a module with backward hooks), where Dynamo's traced backward does not reach, or "
            "drops the backward altogether" if bits & 1 else
            "has hooks (register_hook) that the traced backward does not run" if bits & 2 and t._backward_hooks else
            "has post-accumulate-grad hooks that the traced backward does not run"
            if bits & 4 and t._post_accumulate_grad_hooks else
            "has hooks on its gradient accumulator (DistributedDataParallel's, or registered on its "
            "AccumulateGrad node) that the traced backward does not run" if bits & 8 else None)


class _TracedBackward:
    """The checks of a graph with a traced backward, or compiled with Dynamo's trace_autograd_ops
    on (Note [Traced backward]).
    `leaves`: the arguments its backward differentiates (those requiring grad), checked per call."""

    def __init__(self, name: str, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> None:
        self.name = name
        self.names = [str(n.target) for n in gm.graph.nodes if n.op == "placeholder"]
        grads = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.autograd.grad]
        if any(n.kwargs.get("create_graph") or (len(n.args) > 4 and n.args[4]) for n in grads):
            raise RuntimeError(f"torchreplay: graph {name} traces a backward with create_graph=True: its "
                               f"gradients would not require grad as eager's do. {_NOT_TRACED}")
        self.traces_backward = bool(grads)
        if grads and any(t.requires_grad for t in _lifted(gm)):
            raise RuntimeError(f"torchreplay: graph {name} traces a backward that differentiates a tensor "
                               "Dynamo installed in the graph module instead of passing it (its hooks would go "
                               f"unchecked). {_NOT_TRACED}")
        tensors = [(i, x) for i, x in enumerate(example_inputs) if isinstance(x, torch.Tensor)]
        self.leaves = [i for i, x in tensors if x.requires_grad and x.grad_fn is None] if grads else []
        self.leaf_set = set(self.leaves)
        # Whether the graph extends autograd's graph (computes a value that requires grad): a graph
        # that only reads or detaches an argument with a grad_fn (`loss.detach()` after a graph
        # break) cannot have dropped its backward.
        extends = any(n.op in ("call_function", "call_method", "call_module") and
                      isinstance(v := n.meta.get("example_value"), torch.Tensor) and v.requires_grad
                      for n in gm.graph.nodes)
        for i, x in tensors:
            if extends and x.requires_grad and x.grad_fn is not None:
                self.check(i, x)
        for i in self.leaves:
            self.check(i, example_inputs[i])

    def check(self, i: int, t: torch.Tensor) -> None:
        """Raises if the traced backward would not be eager's for argument i."""
        if self.traces_backward and isinstance(t, torch.Tensor) and _C.is_grad_leaf(t) != (i in self.leaf_set):
            raise RuntimeError(
                f"torchreplay: graph {self.name} was traced with loss.backward() inside when its argument {i} "
                f"({self.names[i] if i < len(self.names) else '?'}) "
                f"{'was a leaf requiring grad; it no longer requires grad, and its .grad would still be written' if i in self.leaf_set else 'did not require grad; it does now, and its .grad would not be computed'}"
                f". {_UNSEEN}")
        why = _hazard(t)
        if why:
            raise RuntimeError(
                f"torchreplay: graph {self.name} was traced with loss.backward() inside, but its argument {i} "
                f"({self.names[i] if i < len(self.names) else '?'}) {why}; gradients would differ from "
                f"eager's. {_NOT_TRACED}")

    def wrap(self, fn: Callable) -> Callable:
        """fn with the per-call checks, for the calls that keep AOTAutograd's wrapper."""
        if not self.traces_backward:
            return fn
        leaves, leaf_set, check, hazards, is_leaf = self.leaves, self.leaf_set, self.check, _C.backward_hazards, \
            _C.is_grad_leaf

        def checked(*args: Any) -> Any:
            for i, a in enumerate(args):
                if isinstance(a, torch.Tensor) and is_leaf(a) != (i in leaf_set):
                    check(i, a)
            for i in leaves:
                if hazards(args[i]):
                    check(i, args[i])
            return fn(*args)
        return checked


# Note [Returning a tensor whose backward ran]
# `loss.backward(); return loss` is how a training step is naturally written. Dynamo (2.11)
# refuses to return from a traced graph a tensor whose autograd graph the traced backward consumed
# (a later backward through it would have to raise as eager's does): it traces the frame again
# with a graph break at the backward, and the step is two graphs. For torchreplay's compiles
# such outputs are marked instead (_mark_consumed_outputs, patches.py) and returned detached from
# the graph (_detach_consumed_outputs), which stays one inference graph; after each call the
# backend gives each of them a grad_fn that raises eager's error on a backward through it
# (DelayedError), so the tensor is what eager returns: requires_grad, not a leaf, its backward
# refused.
_CONSUMED = "torchreplay_backward_ran"
_BACKWARD_TWICE = (
    "Trying to backward through the graph a second time (or directly access saved tensors after they have "
    "already been freed). Saved intermediate values of the graph are freed when you call .backward() or "
    "autograd.grad(). Specify retain_graph=True if you need to backward through the graph a second time or "
    "if you need to access saved tensors after calling backward.")


def _detach_consumed_outputs(gm: torch.fx.GraphModule) -> List[int]:
    """The graph's outputs marked by _mark_consumed_outputs (patches.py), returned detached (in
    place in gm)."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    outs = list(output.args[0]) if isinstance(output.args[0], (list, tuple)) else [output.args[0]]
    consumed = [k for k, o in enumerate(outs) if isinstance(o, torch.fx.Node) and o.meta.get(_CONSUMED)]
    for k in consumed:
        with gm.graph.inserting_before(output):
            detached = gm.graph.call_method("detach", (outs[k],))
        value = outs[k].meta["example_value"]
        with value.fake_mode:
            detached.meta["example_value"] = value.detach()
        outs[k] = detached
    if consumed:
        output.args = (type(output.args[0])(outs) if isinstance(output.args[0], (list, tuple)) else outs[0],)
        gm.recompile()
    return consumed


def _raise_on_backward_of(fn: Callable, consumed: Sequence[int]) -> Callable:
    """fn, its outputs at `consumed` given a grad_fn that raises eager's error on a backward."""
    refuse = torch._C._functions.DelayedError(_BACKWARD_TWICE, 1)

    def call(*args: Any) -> Any:
        outs = list(fn(*args))
        for k in consumed:
            alias = outs[k].detach()
            alias.requires_grad_(True)
            outs[k] = refuse(alias)
        return outs
    return call



# Note [CUDA graphs]
# Neither CUDA path has run on a GPU here. By default (config.reduce_overhead.cuda_graphs =
# "cudagraph_trees") a graph whose tensors are on CUDA gets an engine in mode default (op by op in
# C++), wrapped in PyTorch's CUDA graph trees as torch.compile(backend="cudagraphs") wraps its
# graphs (torch/_dynamo/backends/cudagraphs.py): the trees warm up, record and replay it in their
# pools, with their static-input and liveness checks. Graphs they skip (CPU ops, two devices,
# inputs written that are not static) run op by op, the reason in stats()'s "cuda_graphs", as
# there: a skipped forward's backward runs plain, a skipped backward of a captured forward tells
# the trees it ran (set_to_running_backward). The call stays AOTAutograd's wrapper. "torchreplay" selects the engine's own CUDA graphs
# (EngineOptions.cuda_graphs, capture/cuda/cuda_graph.h): untested, logged as such.
