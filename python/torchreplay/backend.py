"""The torch.compile backend: AOTAutograd -> passes -> lowering -> a C++ Engine per graph, and
which call path each graph gets (the direct Call or the TrainingCall, built in call_paths.py, or
AOTAutograd's wrapper). The guards of training graphs and traced backwards are in
training_guards.py."""
from __future__ import annotations

import functools
import itertools
import logging
import operator
from typing import Any, Callable, Dict, List, Optional, Sequence, Set

import torch
import torch.fx
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils import _pytree as pytree

from . import rnn
from .call_paths import direct_call, training_call
from .capture_sizes import batch_fields
from .config import MODES, CompilerConfig
from .engines import dump_graph, new_engine
from .lowering import LoweringError, lower
from .passes import run_passes
from .training_guards import (_detach_consumed_outputs, _frozen_checked, _guard_attention_backends,
                              _guard_requires_grad, _lifted, _module_parameters, _raise_on_backward_of,
                              _TracedBackward)

logger = logging.getLogger("torchreplay")

_graph_ids = itertools.count()


def _static_input_indices(kind: str, example_inputs: Sequence[Any]) -> List[int]:
    """Parameters, buffers and tensors marked static, as AOTAutograd recorded them."""
    if kind == "backward":
        return []
    ctx = torch._guards.TracingContext.try_get()
    indices = []
    if ctx is not None and ctx.fw_metadata is not None:
        indices = list(ctx.fw_metadata.static_input_indices or [])
    return [i for i in indices if i < len(example_inputs) and isinstance(example_inputs[i], torch.Tensor)]


def _on_cuda(gm: torch.fx.GraphModule) -> bool:
    """Whether any of the graph's tensors is on a CUDA device (from the trace's fake values)."""
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        if any(isinstance(t, torch.Tensor) and t.is_cuda for t in (v if isinstance(v, (list, tuple)) else [v])):
            return True
    return False


def _written_inputs(gm: torch.fx.GraphModule) -> Set[int]:
    """The placeholders (by position) whose memory an op writes, as cudagraphs' find_input_mutations
    judges them (by storage), list arguments included."""
    from torch.multiprocessing.reductions import StorageWeakRef

    def storage(n: Any) -> Optional[Any]:
        v = n.meta.get("val") if isinstance(n, torch.fx.Node) else None
        return StorageWeakRef(v.untyped_storage()) if isinstance(v, torch.Tensor) else None

    by_storage: Dict[Any, Set[int]] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i, n in enumerate(placeholders):
        if (key := storage(n)) is not None:
            by_storage.setdefault(key, set()).add(i)
    written: Set[int] = set()
    for n in gm.graph.nodes:
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
            continue
        for i, formal in enumerate(n.target._schema.arguments):
            if not (formal.alias_info and formal.alias_info.is_write):
                continue
            value = n.args[i] if i < len(n.args) else n.kwargs.get(formal.name)
            for v in (value if isinstance(value, (list, tuple)) else [value]):
                if (key := storage(v)) is not None:
                    written |= by_storage.get(key, set())
    return written


def _input_names(gm: torch.fx.GraphModule) -> List[str]:
    """What each of a Dynamo graph's arguments is in the user's code (its source), for errors."""
    names = []
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            source = getattr(n.meta.get("grapharg"), "source", None)
            names.append(source.name if source is not None else str(n.target))
    return names


class Backend:
    """A torch.compile backend; one instance per CompilerConfig. Callable as
    backend(gm, example_inputs). Keeps the engines it created, for stats(), and in eager_graphs
    the graphs that run eagerly (cannot be lowered, or were given an int beyond 64 bits) and why."""

    direct_training = True  # training graphs as a TrainingCall where they can be (False: AOTAutograd's wrapper)

    def __init__(self, config: Optional[CompilerConfig] = None,
                 custom_decompositions: Optional[Dict[Any, Callable]] = None) -> None:
        self.config = config if config is not None else CompilerConfig()
        self.decompositions = dict(custom_decompositions or {})
        self.engines: List[Any] = []
        self.eager_graphs: Dict[str, str] = {}  # graph name -> why it runs eagerly
        # graph name ("g0.inference", "g1.training") -> "direct" (Dynamo calls the C++ engines,
        # Note [The call path], Note [Training calls]) or why it is not
        self.call_paths: Dict[str, str] = {}
        # graph name -> who replays its CUDA graphs, or why nothing does (Note [CUDA graphs])
        self.cuda_graphs: Dict[str, str] = {}
        self._cuda_graph_calls: Dict[str, List[int]] = {}
        self._backward_hint_logged = False  # the hint at a graph broken at loss.backward(), once
        self._whole_rnn_hint_logged = False  # the hint at a graph that is one recurrent call kept whole, once
        self._variants: Dict[str, "Backend"] = {}  # per torch.compile mode and options (Note [torch.compile's mode])
        if self.config.reduce_overhead.numerics != "bitwise":
            logger.warning("torchreplay: config.reduce_overhead.numerics = %r applies to torchreplay.capture; "
                           "torch.compile's graphs stay bitwise", self.config.reduce_overhead.numerics)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], mode: Optional[str] = None,
                 options: Optional[Dict[str, Any]] = None) -> Any:
        config = torch_compile_config(self.config, mode, options)  # Note [torch.compile's mode]
        if config is not self.config:
            return self._variant(mode, options, config)(gm, example_inputs)
        consumed = _detach_consumed_outputs(gm)
        why = rnn.keep_whole(gm)
        if why is None:
            whole = rnn.whole_only(gm)
            if whole and not self._whole_rnn_hint_logged:
                self._whole_rnn_hint_logged = True
                lstm = whole == "lstm"  # Note [Checked LSTMs]: its capture may take a faster kernel
                logger.log(
                    logging.INFO if lstm else logging.WARNING,
                    "torchreplay: a compiled graph is only the %s call of a recurrent module, kept whole to keep "
                    "eager's bits (Note [Recurrent modules whole]): its replay is eager's one call%s, and Dynamo's "
                    "frame around the module can cost more than eager's Python, a slowdown. "
                    "torchreplay.capture(model, example_args) replays it without Dynamo's frame, bitwise; with "
                    "config.reduce_overhead.numerics = \"close\" decomposed and fused.", whole,
                    " unless the capture's check takes oneDNN's layers on weights reordered once (Note [Checked "
                    "LSTMs])" if lstm else "")
            fn = self._compile_graph(gm, example_inputs)
        else:  # Note [Recurrent modules whole]
            name = f"g{next(_graph_ids)}"
            logger.warning("torchreplay: %s runs eagerly: %s", name, why)
            self.eager_graphs[name] = why
            fn = gm.forward
        return _raise_on_backward_of(fn, consumed) if consumed else fn

    def _variant(self, mode: Optional[str], options: Optional[Dict[str, Any]], config: CompilerConfig) -> "Backend":
        """This backend with torch.compile's mode and options applied: made once per spelling, its
        engines and graphs listed in this one's stats()."""
        key = repr((mode, sorted((options or {}).items())))
        variant = self._variants.get(key)
        if variant is None:
            variant = Backend(config, self.decompositions)
            variant.engines, variant.eager_graphs = self.engines, self.eager_graphs
            variant.call_paths, variant.cuda_graphs = self.call_paths, self.cuda_graphs
            self._variants[key] = variant
        return variant

    def _compile_graph(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        graph_id = next(_graph_ids)
        built: Dict[str, Any] = {}
        _guard_requires_grad(gm, f"g{graph_id}")
        _guard_attention_backends(gm, f"g{graph_id}")
        traces = any(n.target is torch.autograd.grad for n in gm.graph.nodes if n.op == "call_function")
        traced = _TracedBackward(f"g{graph_id}", gm, example_inputs) \
            if traces or torch._dynamo.config.trace_autograd_ops else None
        reason = getattr(gm, "compile_subgraph_reason", None)
        if traced is None and not self._backward_hint_logged and reason is not None and reason.graph_break \
                and "backward()" in reason.reason:
            self._backward_hint_logged = True
            logger.info("torchreplay: g%d ends where Dynamo broke the graph at loss.backward() (%s); the "
                        "backward runs in autograd and the step replays as two graphs (Note [Traced backward]; "
                        "docs/guide.md, Training steps)", graph_id,
                        "config.trace_backward is False" if not self.config.trace_backward else
                        reason.reason.splitlines()[0][:300])
        built["preserve_outputs"] = bool(traced and traced.traces_backward)
        compiler = functools.partial(self._compile, graph_id=graph_id, built=built)
        autocast = torch._C._is_any_autocast_enabled()
        # The backward is compiled with the forward (not at the first backward), so that a
        # training graph's call can join both engines (Note [Training calls]).
        with torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
            aot_fn = aot_autograd(
                fw_compiler=functools.partial(compiler, kind="forward"),
                bw_compiler=functools.partial(compiler, kind="backward"),
                inference_compiler=functools.partial(compiler, kind="inference"),
                decompositions=self.decompositions,
                keep_inference_input_mutations=self.config.keep_inference_input_mutations,
            )(gm, example_inputs)
        if built.get("trees"):  # Note [CUDA graphs]: the trees' wrapper is the call
            for kind in ("inference", "forward"):
                if kind in built:
                    self.call_paths[f"g{graph_id}.{'training' if kind == 'forward' else kind}"] = \
                        "AOTAutograd wrapper: CUDA graphs by PyTorch's cudagraph trees (config.reduce_overhead.cuda_graphs)"
            if "forward" in built:
                aot_fn = _frozen_checked(aot_fn, f"g{graph_id}.training", gm)
            return traced.wrap(aot_fn) if traced else aot_fn
        if "forward" in built and "backward" in built:
            name = f"g{graph_id}.training"
            call = "autocast is on" if autocast else \
                "the backend keeps AOTAutograd's wrapper" if not self.direct_training else \
                "a traced backward in a graph with outputs requiring grad" if traced and traced.traces_backward else \
                training_call(*built["forward"], *built["backward"], example_inputs, _input_names(gm))
        elif "inference" in built:
            name = f"g{graph_id}.inference"
            frozen = [(i, what) for i, what, p in _module_parameters(gm) if i >= 0 and not p.requires_grad] \
                if torch.is_grad_enabled() and not (traced and traced.traces_backward) else []
            returned = next(n for n in gm.graph.nodes if n.op == "output").args[0]
            call = "autocast is on" if autocast else direct_call(
                aot_fn, *built["inference"], example_inputs, _lifted(gm), traced, frozen,
                [n.meta.get("example_value") for n in pytree.tree_leaves(returned) if isinstance(n, torch.fx.Node)])
        else:
            return traced.wrap(aot_fn) if traced else aot_fn  # a graph that runs eagerly
        if isinstance(call, str):
            logger.info("torchreplay: %s is called through AOTAutograd's runtime wrapper: %s", name, call)
            self.call_paths[name] = f"AOTAutograd wrapper: {call}"
            if "forward" in built:
                aot_fn = _frozen_checked(aot_fn, name, gm)
            return traced.wrap(aot_fn) if traced else aot_fn
        self.call_paths[name] = "direct"
        return call

    def _compile(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *,
                 graph_id: int, kind: str, built: Dict[str, Any]) -> Callable:
        # Over 80 lines on purpose: the passes, the training guards and the call path chosen for
        # one graph, in the order they apply, read top to bottom; each piece needs all of config,
        # gm and built.
        config = self.config
        name = f"g{graph_id}.{kind}"
        # A backward's inputs saved by its forward (named as the forward's nodes) in the dtypes
        # the forward's kernels give them (Note [Dtypes the kernels give] in passes.py).
        run_passes(gm, example_inputs, config, built.get("saved_dtypes") if kind == "backward" else None)
        if kind == "forward":
            returned = next(n for n in gm.graph.nodes if n.op == "output").args[0]
            built["saved_dtypes"] = {o.name: o.meta["val"].dtype for o in returned
                                     if isinstance(o, torch.fx.Node) and isinstance(o.meta.get("val"), torch.Tensor)}
        if config.debug.run_eagerly:
            dump_graph(config, name, gm, None)
            logger.info("torchreplay: %s runs eagerly (debug.run_eagerly)", name)
            return make_boxed_func(gm.forward)
        try:
            with unset_fake_temporarily():  # constants must be real tensors
                graph = lower(gm, example_inputs, _static_input_indices(kind, example_inputs))
        except LoweringError as e:  # e.g. torch.cond, a constant beyond int64: eager, logged
            dump_graph(config, name, gm, None)
            logger.warning("torchreplay: %s runs eagerly: %s", name, e)
            self.eager_graphs[name] = str(e)
            return make_boxed_func(gm.forward)
        dump_graph(config, name, gm, graph)
        # Training graphs preserve outputs still alive at the next call (autograd keeps saved
        # activations and gradients), and so do graphs with a traced backward (their gradients);
        # other inference outputs kept across calls are invalidated. A traced backward's batch is
        # not padded (capture_sizes): its gradients sum over the rows.
        traced_backward = built["preserve_outputs"]
        batch = batch_fields(gm, config, name) if kind == "inference" and not traced_backward else {}
        cuda_graphs = config.mode == "reduce-overhead" and _on_cuda(gm)
        trees = cuda_graphs and config.reduce_overhead.cuda_graphs == "cudagraph_trees"
        if trees:  # Note [CUDA graphs]: the engine runs op by op; the trees capture and replay it
            batch["mode"] = "default"
        engine = new_engine(graph, config, name, preserve_outputs=kind != "inference" or traced_backward,
                            **batch)
        self.engines.append(engine)
        logger.debug("torchreplay: compiled %s (%d nodes, static inputs %s) in mode %s",
                     name, graph.num_nodes, graph.static_inputs, config.mode)
        outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        if kind == "inference":
            producers = [getattr(o, "target", None) for o in outputs]
            built[kind] = (engine, torch._guards.TracingContext.try_get(), len(example_inputs), producers)
        elif kind == "forward":  # the user outputs' nodes (None: an input, returned as it is)
            ctx = torch._guards.TracingContext.try_get()
            meta = ctx.fw_metadata if ctx is not None else None
            users = outputs[:meta.num_outputs] if meta is not None else []
            producers = [o if isinstance(o, torch.fx.Node) and o.op != "placeholder" else None for o in users]
            built[kind] = (engine, ctx, len(example_inputs), producers, len(outputs))
        else:
            built[kind] = (engine, len(outputs))
        run = engine.run
        forward = gm.forward
        # Int arithmetic inside the graph can leave int64 where Python's ints would not: such a
        # call is run by Python instead (Note [Scalars bound per call] in capture/ir/graph.h), on a
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
        if trees:
            built["trees"] = True
            return self._cudagraph_trees(call, gm, example_inputs, kind, name, built)
        if cuda_graphs:
            self.cuda_graphs[name] = "torchreplay's own (tried on one H100 only)"
        return call

    def _cudagraph_trees(self, call: Callable, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], kind: str,
                         name: str, built: Dict[str, Any]) -> Callable:
        """`call` (the engine, op by op) inside PyTorch's CUDA graph trees, as torch.compile's
        backend="cudagraphs" wraps its graphs (torch/_dynamo/backends/cudagraphs.py); graphs the
        trees skip run op by op, the reason in cuda_graphs (Note [CUDA graphs])."""
        from torch._dynamo.backends.cudagraphs import get_device_index, get_device_node_mapping, get_stack_traces
        from torch._inductor.cudagraph_trees import cudagraphify_impl, get_manager
        from torch._inductor.cudagraph_utils import (check_multiple_devices_or_any_cpu_nodes,
                                                     format_default_skip_message, get_mutation_stack_trace,
                                                     get_placeholder_info)
        from torch._inductor.utils import count_tangents, get_first_incompatible_cudagraph_node

        if kind == "backward" and built.get("trees_skipped_forward"):
            self.cuda_graphs[name] = "not captured (run op by op): its forward was not captured"
            return call  # as backward_cudagraphs does when the forward was skipped
        static = list(range(count_tangents(gm))) if kind == "backward" else \
            _static_input_indices(kind, example_inputs)
        written = _written_inputs(gm)
        placeholders = get_placeholder_info(gm.graph)
        # check_for_skip's parts (its own mutation finder cannot read the list arguments of the
        # foreach ops reinplace_foreach makes in place)
        skip = None
        if written - set(static) and not torch._dynamo.config.cudagraph_backend_support_input_mutation:
            skip = get_mutation_stack_trace(placeholders, written - set(static))
        skip = skip or check_multiple_devices_or_any_cpu_nodes(get_device_node_mapping(gm))
        if not skip and (node := get_first_incompatible_cudagraph_node(gm)) is not None:
            skip = format_default_skip_message(f"incompatible op ({node.name})")
        if skip:
            self.cuda_graphs[name] = f"not captured (run op by op): {skip}"
            logger.info("torchreplay: %s: cudagraph trees skip it: %s", name, skip)
            if kind != "backward":
                built["trees_skipped_forward"] = True
                return call
            device = get_device_index(gm)

            def backward(args: List[Any]) -> Any:  # [Backward Generation Handling] in cudagraphs.py
                manager = get_manager(device, create_if_none_exists=False)  # made by the forward's first call
                if manager is not None:
                    manager.set_to_running_backward()
                return call(args)
            backward._boxed_call = True  # type: ignore[attr-defined]
            return backward
        trees = cudagraphify_impl(call, list(example_inputs), static, device_index=get_device_index(gm),
                                  is_backward=kind == "backward", is_inference=kind == "inference",
                                  stack_traces=get_stack_traces(gm), placeholders=placeholders,
                                  mutated_input_idxs=written)
        self.cuda_graphs[name] = "PyTorch's cudagraph trees"
        calls = self._cuda_graph_calls.setdefault(name, [0])
        profiled = torch._C._autograd._profiler_enabled
        label = f"torchreplay::cudagraph_trees ({name})"

        def run(args: List[Any]) -> Any:
            calls[0] += 1
            if profiled():
                with torch.profiler.record_function(label):
                    return trees(args)
            return trees(args)
        run._boxed_call = True  # type: ignore[attr-defined]
        run.engine = call.engine  # type: ignore[attr-defined]
        return run

    def stats(self) -> List[Dict[str, Any]]:
        """Per engine (graph) of this backend: calls, replays, captures, fallbacks, capture log."""
        out = []
        for e in self.engines:
            entry = dict(e.stats(), name=e.name)
            if e.name in self.cuda_graphs:
                entry["cuda_graphs"] = self.cuda_graphs[e.name]
                entry["cuda_graph_calls"] = self._cuda_graph_calls.get(e.name, [0])[0]
            out.append(entry)
        return out


# Note [torch.compile's mode]
# torch.compile(model, backend=..., mode=..., options=...) hands the backend its `mode` (only when
# it is not "default") and `options` as keyword arguments, for a named backend and a backend object
# alike (torch's _TorchCompileWrapper). Users migrating from Inductor write
# mode="reduce-overhead" (transformers' CompileConfig too): it sets config.mode, on top of the
# backend's config and under `options` (flat names, CompilerConfig._OPTION_PATHS); a backend object
# keeps its own config and compiles such calls with a variant of it that shares its stats.
# Inductor's "max-autotune" modes ask for autotuned generated kernels, which torchreplay has none
# of: refused, saying what to use. `dynamic` and `fullgraph` are Dynamo's and never reach a backend.
_AUTOTUNE_MODES = ("max-autotune", "max-autotune-no-cudagraphs")


def torch_compile_config(config: CompilerConfig, mode: Optional[str] = None,
                         options: Optional[Dict[str, Any]] = None) -> CompilerConfig:
    """The config a compile runs with: `config`, with torch.compile's `options` and `mode` applied
    (Note [torch.compile's mode]); `config` itself when they change nothing."""
    if mode in _AUTOTUNE_MODES:
        raise ValueError(
            f"torchreplay: torch.compile mode {mode!r} asks Inductor to autotune the kernels it generates; "
            "torchreplay generates none (it calls eager's kernels, and with mode='reduce-overhead' checks and "
            "times faster ones per node at capture): use mode='reduce-overhead' (capture and replay) or "
            "mode='default' (the graph run op by op in C++), or backend='inductor' to autotune")
    if mode is not None and mode not in MODES:
        raise ValueError(f"torchreplay: unknown torch.compile mode {mode!r}; torchreplay takes {MODES}")
    if not options and (mode is None or mode == config.mode):
        return config
    out = config.with_options(options)
    if mode is not None:
        out.mode = mode
    return out


def get_backend(*, compiler_config: Optional[CompilerConfig] = None,
                custom_decompositions: Optional[Dict[Any, Callable]] = None) -> Backend:
    """The backend to hand to torch.compile(model, backend=...)."""
    return Backend(compiler_config, custom_decompositions)


def named_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
                  mode: Optional[str] = None, options: Optional[Dict[str, Any]] = None) -> Any:
    """torch.compile(model, backend="torchreplay", mode=..., options={...}) (Note [torch.compile's
    mode])."""
    return Backend(torch_compile_config(CompilerConfig(), mode, options))(gm, example_inputs)
