"""The call paths a compiled graph gets from the backend (Note [The call path] in bindings/call.h):
the direct Call of an inference graph, with AOTAutograd's runtime epilogue in C++, and the
TrainingCall joining a forward and a backward engine (Note [Training calls] in
bindings/training.h). Each returns the call, or why the graph keeps AOTAutograd's own wrapper.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Union

import torch
from torch._functorch._aot_autograd.schemas import OutputType, PlainTensorMeta
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from . import _C
from .subclasses import inner_tensors
from .training_guards import _TracedBackward

_PLAIN_OUTPUTS = (OutputType.non_alias, OutputType.unsafe_view_alias, OutputType.custom_function_view)
# Ops whose result shares its input's memory but is no view of it in eager (._base is None): the
# Call would regenerate them as views, so their graphs keep AOTAutograd's wrapper.
_NOT_VIEWS = (torch.ops.aten.detach.default, torch.ops.aten.alias.default)


def direct_call(aot_fn: Callable, engine: Any, ctx: Any, num_graph_inputs: int, producers: List[Any],
                 example_inputs: Sequence[Any], lifted: Sequence[torch.Tensor] = (),
                 traced: Optional[_TracedBackward] = None, frozen: Sequence[Any] = (),
                 returned: Sequence[Any] = ()) -> Union[Any, str]:
    """The engine as a C++ callable for Dynamo (Note [The call path] in bindings/call.h), or
    why not: AOTAutograd's runtime wrapper has work a Call does not do. `lifted`: the tensors
    AOTAutograd puts ahead of the arguments, bound in the Call; `traced`: the checks of a traced
    backward, made per call (Note [Traced backward]); `frozen`: (argument, name) of the module
    parameters that did not require grad when it was compiled with grad mode on (Note [Leaves'
    requires_grad]); `returned`: the example values of what Dynamo's graph returns."""
    meta = ctx.fw_metadata if ctx is not None else None
    if meta is None:
        return "no AOTAutograd metadata"
    flat = None
    if any(is_traceable_wrapper_subclass(x) for x in example_inputs):  # Note [Tensor-subclass arguments]
        flat = _Flattened(example_inputs, frozen)
        if any(is_traceable_wrapper_subclass(v) for v in returned):
            return "tensor-subclass outputs"
        if flat.why is not None or traced is not None:
            return flat.why or "tensor-subclass inputs with a traced backward"
        example_inputs, frozen = flat.inputs, flat.frozen
    n_bound = len(lifted)
    if num_graph_inputs != n_bound + len(example_inputs) or len(meta.input_info) != num_graph_inputs:
        return "AOTAutograd changed the inputs (duplicated or merged)"
    if any(isinstance(x, (list, tuple, dict)) for x in example_inputs):
        return "nested inputs"
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
        if o.output_type in (OutputType.is_input, OutputType.alias_of_input) and o.base_idx < n_bound:
            return "outputs that alias a lifted tensor"
        if producers[i] is torch.ops.aten.detach.default and o.output_type == OutputType.alias_of_input:
            aliases.append(_C.Alias(i, _C.AliasKind.DETACH_OF_INPUT, o.base_idx - n_bound))  # `return loss.detach()`
            continue
        if producers[i] in _NOT_VIEWS:
            return "outputs that alias an input without being views of it (alias, or detach of a view)"
        if o.output_type == OutputType.is_input:
            aliases.append(_C.Alias(i, _C.AliasKind.INPUT, o.base_idx - n_bound))
        elif o.output_type == OutputType.alias_of_input:
            aliases.append(_C.Alias(i, _C.AliasKind.VIEW_OF_INPUT, o.base_idx - n_bound))
        elif o.output_type == OutputType.alias_of_intermediate_base_is_user_output:
            aliases.append(_C.Alias(i, _C.AliasKind.VIEW_OF_OUTPUT, o.base_idx))
        else:  # alias_of_intermediate(_save_as_output): the base is an extra output at the end
            aliases.append(_C.Alias(i, _C.AliasKind.VIEW_OF_OUTPUT, meta.num_outputs + o.base_idx))
    written = list(meta.mutated_graph_handled_indices_seen_by_autograd)
    mutated = [i - n_bound for i in written if i >= n_bound]
    if flat is not None and flat.inner & ({i - n_bound for i in written} |
                                          {a.base for a in aliases if a.kind != _C.AliasKind.VIEW_OF_OUTPUT}):
        return "a tensor subclass's inner tensors written or returned"
    # Outputs with dynamic dims get them in `_dynamo_weak_dynamic_indices`, as the wrapper does.
    dynamic_dims = [(i, o.dynamic_dims) for i, o in enumerate(meta.output_info) if o.dynamic_dims]
    call = _C.Call(engine, bound=list(lifted), mutated=mutated, mutated_bound=[i for i in written if i < n_bound],
                   num_outputs=meta.num_outputs,
                   aot=_C.AotEpilogue(aliases=aliases, dynamic_dims=dynamic_dims,
                                      fallback=None if flat else traced.wrap(aot_fn) if traced else aot_fn,
                                      grad_leaves=traced.leaves if traced else [],
                                      hazard_check=traced.check if traced else None,
                                      leaves_fixed=bool(traced and traced.traces_backward),
                                      frozen=[i for i, _ in frozen], frozen_names=[n for _, n in frozen]))
    return flat.call(call, aot_fn) if flat else call


# Note [Tensor-subclass arguments]
# A tensor subclass that AOTAutograd traces through (torchao's quantized weights: int8 data and
# scales in one Parameter) reaches the graph as its inner tensors: AOTAutograd's runtime wrapper
# flattens every such argument on every call, calling __tensor_flatten__ down each subclass,
# which costs more than the whole replay of a small quantized model. The direct call flattens
# along the attribute paths found at compile time instead: per call, one getattr per inner
# tensor and a type check of each. Dynamo guards each subclass argument's type and flatten
# metadata, so the paths hold while the graph does; a call where an inner tensor's type differs
# nonetheless goes through AOTAutograd's wrapper. Nothing is held from the example arguments (a
# graph outlives its model in Dynamo's cache). Graphs that write or return inner tensors, traced
# backwards and subclasses with symbolic sizes keep the wrapper (the reason in Backend.call_paths).
class _Flattened:
    """The plan to flatten one graph's arguments. inputs: the example arguments flattened;
    inner: the flat positions of inner tensors; frozen: (flat position, name) of frozen plain
    arguments (frozen subclass arguments: their requires_grad checked per call); why: the reason
    the plan cannot be made, or None."""

    def __init__(self, example_inputs: Sequence[Any], frozen: Sequence[Any]):
        self.inputs: List[Any] = []
        self.inner = set()
        self.why: Optional[str] = None
        self._plain: List[Any] = []     # (argument, flat position)
        self._nested: List[Any] = []    # (argument, [(flat position, attribute path, type)])
        self._watched: List[Any] = []   # (argument, name): subclass arguments frozen at compile time
        frozen_at = dict(frozen)
        self.frozen = []
        for i, x in enumerate(example_inputs):
            if not is_traceable_wrapper_subclass(x):
                if i in frozen_at:
                    self.frozen.append((len(self.inputs), frozen_at[i]))
                self._plain.append((i, len(self.inputs)))
                self.inputs.append(x)
                continue
            if i in frozen_at:
                self._watched.append((i, frozen_at[i]))
            leaves: List[Any] = []
            for path, inner in [((), x)] + inner_tensors(x):
                if any(isinstance(d, torch.SymInt) for d in (*inner.shape, *inner.stride())):
                    self.why = "tensor-subclass inputs with symbolic sizes"
                if path:
                    self.inner.add(len(self.inputs))
                    leaves.append((len(self.inputs), path, type(inner)))
                    self.inputs.append(inner)
            self._nested.append((i, leaves))

    def call(self, call: Any, aot_fn: Callable) -> Callable:
        """`call` over the flattened arguments, as Dynamo calls a graph (positional arguments)."""
        plain, nested, watched, size = self._plain, self._nested, self._watched, len(self.inputs)
        is_grad_enabled = torch.is_grad_enabled

        def flattened(*args: Any) -> Any:
            flat = [None] * size
            for i, j in plain:
                flat[j] = args[i]
            for i, leaves in nested:
                for j, path, kind in leaves:
                    t = args[i]
                    for attr in path:
                        t = getattr(t, attr)
                    if type(t) is not kind:
                        return aot_fn(*args)
                    flat[j] = t
            if watched and is_grad_enabled():
                for i, what in watched:
                    if args[i].requires_grad:
                        raise RuntimeError(
                            f"torchreplay: argument {i} ({what}) requires grad, but did not when the graph was "
                            "compiled: the graph computes no gradient for it, which would be silently skipped; "
                            "call torch._dynamo.reset() after changing requires_grad")
            return call(*flat)
        return flattened


def training_call(fw_engine: Any, ctx: Any, num_graph_inputs: int, producers: List[Any], fw_returns: int,
                   bw_engine: Any, bw_returns: int, example_inputs: Sequence[Any],
                   names: Sequence[str] = ()) -> Union[Any, str]:
    """The forward and backward engines joined by a C++ autograd node (Note [Training calls] in
    bindings/training.h), or why not: AOTAutograd's autograd.Function has work it does not do."""
    meta = ctx.fw_metadata if ctx is not None else None
    if meta is None:
        return "no AOTAutograd metadata"
    if num_graph_inputs != len(example_inputs) or bw_returns != len(example_inputs):
        return "AOTAutograd changed the inputs (duplicated, merged or lifted)"
    if not all(isinstance(x, torch.Tensor) and not is_traceable_wrapper_subclass(x) for x in example_inputs):
        return "inputs other than plain tensors (sizes, numbers, subclasses)"
    if meta.num_mutated_inp_runtime_indices or meta.indices_of_inputs_that_requires_grad_with_mutations_in_bw:
        return "input mutations"
    if meta.tokens or meta.num_backward_tokens or meta.is_rng_op_functionalized or \
            torch._functorch.config.functionalize_rng_ops:
        return "effect tokens or functionalized RNG"
    if meta.grad_enabled_mutation is not None:
        return "a grad-mode change to restore"
    if meta.num_intermediate_bases or meta.num_outputs_aliased or meta.num_unsafe_view_outputs:
        return "outputs that alias inputs, other outputs or intermediates"
    if meta.num_symints_saved_for_bw or meta.num_opaque_objects_saved_for_bw or meta.dynamic_saved_tensors_idxs:
        return "sizes or objects saved for the backward"
    if meta.num_forward_returns != meta.num_outputs:
        return "forward returns other than outputs and saved tensors"
    outs = meta.output_info
    if any(o.output_type != OutputType.non_alias or not issubclass(o.raw_type, torch.Tensor) or o.dynamic_dims
           for o in outs):
        return "outputs that are no plain tensors"
    if len(set(producers)) != len(producers) or any(p is None for p in producers):
        return "an output returned twice, or an input returned"
    returns = range(fw_returns)
    vc, no_vc = returns[meta.tensors_saved_for_backwards_with_vc_check_slice], \
        returns[meta.tensors_saved_for_backwards_no_vc_check_slice]
    begin = meta.num_outputs
    vc_end = vc.stop if len(vc) else begin
    end = no_vc.stop if len(no_vc) else vc_end
    if (len(vc) and vc.start != begin) or (len(no_vc) and no_vc.start != vc_end) or end != fw_returns:
        return "the forward's returns are not (outputs, saved tensors)"
    if len(meta.subclass_tangent_meta) != sum(o.requires_grad for o in outs):
        return "tangents other than the outputs' gradients"
    sizes, strides = [], []
    for m in meta.subclass_tangent_meta:  # per output that requires grad: the layout traced
        fmt = m.memory_format if isinstance(m, PlainTensorMeta) else None
        if fmt is None:
            return "tangents of subclasses"
        if fmt.memory_format is not None:
            if fmt.memory_format != torch.contiguous_format:
                return "tangents expected in a memory format other than contiguous"
            sizes.append([]), strides.append([])
        elif all(isinstance(v, int) for v in list(fmt.size) + list(fmt.stride)):
            sizes.append(list(fmt.size)), strides.append(list(fmt.stride))
        else:
            return "tangents of symbolic sizes"
    spec = _C.TrainingSpec(num_inputs=len(example_inputs),
                           mutated=list(meta.mutated_graph_handled_indices_seen_by_autograd),
                           output_requires_grad=[o.requires_grad for o in outs],
                           saved_begin=begin, saved_vc_end=vc_end, saved_end=end, tangent_sizes=sizes,
                           tangent_strides=strides,
                           compiled_requires_grad=[bool(x.requires_grad) for x in example_inputs],
                           input_names=list(names))
    return _C.TrainingCall(fw_engine, bw_engine, spec)
