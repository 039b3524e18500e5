"""The torch.compile backend: AOTAutograd -> passes -> lowering -> a C++ Engine per graph."""
from __future__ import annotations

import functools
import itertools
import logging
import operator
import os
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import torch
import torch.fx
from torch._dynamo.backends.common import aot_autograd
from torch._functorch._aot_autograd.schemas import OutputType
from torch._functorch.aot_autograd import make_boxed_func
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from . import _C
from .capture_sizes import batch_fields
from .config import CompilerConfig
from .lowering import LoweringError, lower
from .passes import run_passes

logger = logging.getLogger("torchreplay")

_graph_ids = itertools.count()
_all_engines: "weakref.WeakSet[Any]" = weakref.WeakSet()


def _static_input_indices(kind: str, example_inputs: Sequence[Any]) -> List[int]:
    """Parameters, buffers and tensors marked static, as AOTAutograd recorded them."""
    if kind == "backward":
        return []
    ctx = torch._guards.TracingContext.try_get()
    indices = []
    if ctx is not None and ctx.fw_metadata is not None:
        indices = list(ctx.fw_metadata.static_input_indices or [])
    return [i for i in indices if i < len(example_inputs) and isinstance(example_inputs[i], torch.Tensor)]


_PLAIN_OUTPUTS = (OutputType.non_alias, OutputType.unsafe_view_alias, OutputType.custom_function_view)
# Ops whose result shares its input's memory but is no view of it in eager (._base is None): the
# Call would regenerate them as views, so their graphs keep AOTAutograd's wrapper.
_NOT_VIEWS = (torch.ops.aten.detach.default, torch.ops.aten.alias.default)


def engine_options(config: CompilerConfig, name: str, **fields: Any) -> Any:
    """The C++ engine's options for one graph compiled with `config` (plus `fields`)."""
    ro, dump = config.reduce_overhead, config.debug.graph_dump
    return _C.EngineOptions(mode=config.mode, warmup_iters=ro.warmup_iters, capture_limit=ro.capture_limit,
                            cache_limit=ro.cache_limit, clone_outputs=ro.clone_outputs, name=name,
                            dump_dir=os.path.abspath(dump.path) if dump.type in ("txt", "dot") else "",
                            **fields)


def _direct_call(aot_fn: Callable, engine: Any, ctx: Any, num_graph_inputs: int, producers: List[Any],
                 example_inputs: Sequence[Any]) -> Union[Any, str]:
    """The engine as a C++ callable for Dynamo (Note [The call path] in bindings/module.cc), or
    why not: AOTAutograd's runtime wrapper has work a Call does not do."""
    meta = ctx.fw_metadata if ctx is not None else None
    if meta is None:
        return "no AOTAutograd metadata"
    if num_graph_inputs != len(example_inputs):
        return "AOTAutograd changed the inputs (duplicated, merged or lifted)"
    if any(isinstance(x, (list, tuple, dict)) or is_traceable_wrapper_subclass(x) for x in example_inputs):
        return "nested or tensor-subclass inputs"
    if meta.num_mutated_inp_runtime_indices:
        return "input mutations applied outside the graph"
    if meta.tokens or torch._functorch.config.functionalize_rng_ops:
        return "effect tokens or functionalized RNG"
    if meta.grad_enabled_mutation is not None:
        return "a grad-mode change to restore"
    # Outputs that alias an input or another output: the Call regenerates them as AOT's wrapper
    # does, as autograd views of their base (the engine's are plain aliases).
    aliases = []
    for i, o in enumerate(meta.output_info):
        if o.output_type in _PLAIN_OUTPUTS:
            continue
        if producers[i] in _NOT_VIEWS:
            return "outputs that alias an input without being views of it (detach, alias)"
        if o.output_type == OutputType.is_input:
            aliases.append((i, 1, o.base_idx))
        elif o.output_type == OutputType.alias_of_input:
            aliases.append((i, 0, o.base_idx))
        elif o.output_type == OutputType.alias_of_intermediate_base_is_user_output:
            aliases.append((i, 2, o.base_idx))
        else:  # alias_of_intermediate(_save_as_output): the base is an extra output at the end
            aliases.append((i, 2, meta.num_outputs + o.base_idx))
    mutated = list(meta.mutated_graph_handled_indices_seen_by_autograd)
    # Outputs with dynamic dims get them in `_dynamo_weak_dynamic_indices`, as the wrapper does.
    dynamic_dims = [(i, o.dynamic_dims) for i, o in enumerate(meta.output_info) if o.dynamic_dims]
    return _C.Call(engine, mutated=mutated, num_outputs=meta.num_outputs, fallback=aot_fn, aliases=aliases,
                   dynamic_dims=dynamic_dims)


def _dump(config: CompilerConfig, name: str, gm: torch.fx.GraphModule, graph: Optional[Any]) -> None:
    kind = config.debug.graph_dump.type
    if kind is None:
        return
    directory = config.debug.graph_dump.path
    os.makedirs(directory, exist_ok=True)
    if kind == "dot":
        # The IR as text and as a DOT graph. With "txt" or "dot", each captured key follows at
        # capture time (written by the engine): torchreplay_{name}.keyK.txt, the CPU tape's plan,
        # or torchreplay_{name}.keyK.dot, the CUDA graph.
        with open(os.path.join(directory, f"torchreplay_{name}.txt"), "w") as f:
            f.write(str(graph) if graph is not None else str(gm.graph))
    path = os.path.join(directory, f"torchreplay_{name}.{kind}")
    with open(path, "w") as f:
        if kind == "txt":
            f.write(str(graph) if graph is not None else str(gm.graph))
        elif kind == "dot":
            f.write(_fx_to_dot(gm, name))
        else:  # "py": the ATen graph as runnable Python
            f.write(f"# torchreplay graph {name}, mode {config.mode!r}\n")
            f.write("import torch\nfrom math import inf, nan\nfrom torch import device\n")
            f.write(gm.code)
    logger.info("torchreplay: dumped graph %s to %s", name, path)


def _fx_to_dot(gm: torch.fx.GraphModule, name: str) -> str:
    """The ATen graph in Graphviz DOT: one box per node, an edge per use."""
    def q(s: str) -> str:
        return '"' + s.replace('"', '\\"') + '"'

    lines = [f"digraph {q('torchreplay_' + name)} {{", "  node [shape=box, fontname=monospace];"]
    for node in gm.graph.nodes:
        label = node.name if node.op in ("placeholder", "output") else f"{node.name}\\n{node.target}"
        lines.append(f"  {q(node.name)} [label={q(label)}];")
        for user in node.users:
            lines.append(f"  {q(node.name)} -> {q(user.name)};")
    lines.append("}")
    return "\n".join(lines) + "\n"


class Backend:
    """A torch.compile backend; one instance per CompilerConfig. Callable as
    backend(gm, example_inputs). Keeps the engines it created, for stats(), and in eager_graphs
    the graphs that run eagerly (cannot be lowered, or were given an int beyond 64 bits) and why."""

    def __init__(self, config: Optional[CompilerConfig] = None,
                 custom_decompositions: Optional[Dict[Any, Callable]] = None) -> None:
        self.config = config if config is not None else CompilerConfig()
        self.decompositions = dict(custom_decompositions or {})
        self.engines: List[Any] = []
        self.eager_graphs: Dict[str, str] = {}  # graph name -> why it runs eagerly
        # inference graph name -> "direct" (Dynamo calls the C++ engine) or why it is not
        self.call_paths: Dict[str, str] = {}

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **_: Any) -> Any:
        graph_id = next(_graph_ids)
        built: Dict[str, Any] = {}
        compiler = functools.partial(self._compile, graph_id=graph_id, built=built)
        autocast = torch._C._is_any_autocast_enabled()
        aot_fn = aot_autograd(
            fw_compiler=functools.partial(compiler, kind="forward"),
            bw_compiler=functools.partial(compiler, kind="backward"),
            inference_compiler=functools.partial(compiler, kind="inference"),
            decompositions=self.decompositions,
            keep_inference_input_mutations=self.config.keep_inference_input_mutations,
        )(gm, example_inputs)
        if "inference" not in built:
            return aot_fn  # a training graph, or a graph that runs eagerly
        call = "autocast is on" if autocast else _direct_call(aot_fn, *built["inference"], example_inputs)
        name = f"g{graph_id}.inference"
        if isinstance(call, str):
            logger.info("torchreplay: %s is called through AOTAutograd's runtime wrapper: %s", name, call)
            self.call_paths[name] = f"AOTAutograd wrapper: {call}"
            return aot_fn
        self.call_paths[name] = "direct"
        return call

    def _compile(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *,
                 graph_id: int, kind: str, built: Dict[str, Any]) -> Callable:
        config = self.config
        name = f"g{graph_id}.{kind}"
        run_passes(gm, example_inputs, config)
        if config.debug.run_eagerly:
            _dump(config, name, gm, None)
            logger.info("torchreplay: %s runs eagerly (debug.run_eagerly)", name)
            return make_boxed_func(gm.forward)
        try:
            with unset_fake_temporarily():  # constants must be real tensors
                graph = lower(gm, example_inputs, _static_input_indices(kind, example_inputs))
        except LoweringError as e:  # e.g. torch.cond, a constant beyond int64: eager, logged
            _dump(config, name, gm, None)
            logger.warning("torchreplay: %s runs eagerly: %s", name, e)
            self.eager_graphs[name] = str(e)
            return make_boxed_func(gm.forward)
        _dump(config, name, gm, graph)
        # Training graphs preserve outputs still alive at the next call (autograd keeps saved
        # activations and gradients); inference outputs kept across calls are invalidated.
        batch = batch_fields(gm, config, name) if kind == "inference" else {}
        engine = _C.Engine(graph, engine_options(config, name, preserve_outputs=kind != "inference", **batch))
        self.engines.append(engine)
        _all_engines.add(engine)
        logger.debug("torchreplay: compiled %s (%d nodes, static inputs %s) in mode %s",
                     name, graph.num_nodes, graph.static_inputs, config.mode)
        if kind == "inference":
            outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
            producers = [getattr(o, "target", None) for o in outputs]
            built[kind] = (engine, torch._guards.TracingContext.try_get(), len(example_inputs), producers)
        run = engine.run
        forward = gm.forward
        # Int arithmetic inside the graph can leave int64 where Python's ints would not: such a
        # call is run by Python instead (Note [Scalars bound per call] in capture/graph.h), on a
        # copy of its arguments, since the engine consumes them. Inference graphs only (training
        # graphs free their saved tensors as the run goes), and not when the graph writes into its
        # inputs (the run may have written some already): those raise the OverflowError.
        mutable = any(isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable
                      for n in gm.graph.nodes)
        rerun = kind == "inference" and not mutable and any(n.op == "call_function" and not isinstance(n.target, torch._ops.OpOverload)
                                    and n.target is not operator.getitem for n in gm.graph.nodes)

        def call(args: List[Any]) -> List[Any]:
            saved = list(args) if rerun else None
            try:
                return run(args)
            except OverflowError as e:
                if args:  # a Python int beyond int64: nothing ran
                    saved = args
                elif saved is None:
                    raise
                if name not in self.eager_graphs:
                    logger.warning("torchreplay: %s runs eagerly when its ints leave 64 bits: %s", name, e)
                    self.eager_graphs[name] = str(e)
                return forward(*saved)

        call._boxed_call = True  # type: ignore[attr-defined]
        call.engine = engine  # type: ignore[attr-defined]
        return call

    def stats(self) -> List[Dict[str, Any]]:
        """Per engine (graph) of this backend: calls, replays, captures, fallbacks, capture log."""
        return [dict(e.stats(), name=e.name) for e in self.engines]


def get_backend(*, compiler_config: Optional[CompilerConfig] = None,
                custom_decompositions: Optional[Dict[Any, Callable]] = None) -> Backend:
    """The backend to hand to torch.compile(model, backend=...)."""
    return Backend(compiler_config, custom_decompositions)


def named_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
                  options: Optional[Dict[str, Any]] = None, **_: Any) -> Any:
    """torch.compile(model, backend="torchreplay", options={...})."""
    return Backend(CompilerConfig.from_options(options))(gm, example_inputs)


def precapture(fn: Callable, input_sets: Sequence[Sequence[Any]]) -> None:
    """Warms up and captures a compiled model for shapes known ahead, largest first (by tensor
    bytes), so that on CUDA (untested) the smaller shapes reuse the largest one's pool memory.

    How many runs make a capture is the engine's to decide (config.reduce_overhead.warmup_iters
    warm-ups, then capture). A model from torchreplay.capture goes straight to its engine's
    precapture. A torch.compile'd model's engines sit behind Dynamo's guards and AOTAutograd's
    wrapper, which only a call of the model passes (and the first call compiles), so each input set
    is called until a call runs no warm-up in any engine: warmup_iters + 1 calls for a new shape,
    the last of them the capture (one more, a replay, when warmup_iters is 0), none past that for a
    shape already captured. These are real calls: in-place updates (KV caches, BN statistics)
    happen once per call. Compile with dynamic=True (or mark dynamic dims) so that all shapes share
    one graph and one pool."""
    from .captured import Captured

    target = fn if isinstance(fn, Captured) else getattr(fn, "captured", None)
    if isinstance(target, Captured):
        target.precapture(input_sets)
        return

    def nbytes(inputs: Sequence[Any]) -> int:
        return sum(t.numel() * t.element_size() for t in inputs if isinstance(t, torch.Tensor))

    def warmups() -> Dict[int, int]:
        return {id(e): e.stats()["warmups"] for e in list(_all_engines)}

    for inputs in sorted(input_sets, key=nbytes, reverse=True):
        while True:
            before = warmups()
            fn(*inputs)
            if all(n == before.get(k, 0) for k, n in warmups().items()):
                break


def stats() -> List[Dict[str, Any]]:
    """Stats of every live engine in the process."""
    return [dict(e.stats(), name=e.name) for e in list(_all_engines)]
