"""The patches torchreplay makes to PyTorch when it is imported, in one place: install() puts them
in, once (the package's __init__ calls it); each is idempotent (a patched function is marked
`_torchreplay` and not patched again; the hooks are registered once). What is patched, and why:

- torch.nn.Module.train (and eval, which calls it): counts the mode changes in C++
  (_C.module_modes_changed), so that every Captured checks its modules' train/eval mode on its
  next call (Captured._slow_call, _Trace.check_modes in arguments.py): a mode changes what the
  captured graph computes (_install_watchers, whose docstring says more; no Note).
- the global nn.Module registration hooks of parameters, buffers and submodules: a module a
  Captured has bound that is given a new parameter, buffer or submodule makes that Captured
  raise on every later call, as its graph still holds the old tensors (_on_registration; the
  comment at _watched below). These two at import, not at the first capture: Dynamo guards on
  the global hooks and on nn.Module.train, so installing them later would recompile every
  function torch.compile had compiled before.
- nn.Module.register_forward_hook and register_forward_pre_hook, the global ones and
  RemovableHandle.remove: the same count, so that every Captured compares the forward hooks its
  trace ran with those of the moment and traces again where they differ (_Trace.hooks_now); and
  torch.backends.mha.set_fastpath_enabled, the same count, as the switch decides whether a trace
  holds the transformer modules' fused ops (Note [Transformer fast paths] in fast_paths.py).
- torch.nn.Module.__setattr__ and torch.nn.Parameter.data: a module's number changed after a
  capture, and a folded parameter reached through .data (Note [Writes a capture would not see]).
- transformers' SDPA attention module (patched when imported): for torchreplay's own traces it
  takes eager's grouped-query branch (Note [transformers' attention as eager runs it]).
- Dynamo's TensorVariable.method_backward: turns Dynamo's own switch (trace_autograd_ops) on
  while it traces the `loss.backward()` of a frame a torchreplay backend compiles, so that the
  whole step is one graph; breaks the graph at a backward whose traced form would not be eager's
  (_left_to_autograd), and, for every backend, at one whose leaves are all outside the frame,
  which Dynamo would trace as nothing (_trace_backward_for_torchreplay; Note [Traced backward]
  in training_guards.py).
- Dynamo's OutputGraph._validate_outputs_safe_for_autograd_nodes: for torchreplay's compiles, a
  returned tensor whose autograd graph the traced backward consumed is marked (the backend returns
  it detached) instead of Dynamo tracing the frame again with a graph break there
  (_mark_consumed_outputs; Note [Returning a tensor whose backward ran] in training_guards.py).
- Dynamo's VariableBuilder.wrap_module: for torchreplay's compiles, lets Dynamo trace an nn.RNN,
  nn.GRU or nn.LSTM (its switch allow_rnn on for that module alone) where the backend can keep
  the module's results eager's bits (rnn.py); elsewhere logs once per module class why it runs
  eagerly between graphs and what replays it instead (_trace_rnns_for_torchreplay).
"""
from __future__ import annotations

import functools
import itertools
import logging
import weakref
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from . import _C, packed, rnn
from .backend import Backend, named_backend, torch_compile_config
from .config import CompilerConfig
from .subclasses import inner_tensors
from .training_guards import _CONSUMED, _hazard

logger = logging.getLogger("torchreplay")


def install() -> None:
    """Every patch of this module, once (a second call changes nothing)."""
    _trace_backward_for_torchreplay()
    _mark_consumed_outputs()
    _install_watchers()
    _trace_rnns_for_torchreplay()
    _trace_packed_modules_for_torchreplay()
    _attention_as_eager_in_transformers()


# Note [transformers' attention as eager runs it]
# transformers' SDPA attention (integrations/sdpa_attention.py, transformers 5.23) takes another
# branch while a model is compiled or exported (`not is_torchdynamo_compiling()`): for
# grouped-query attention with one query token (every decode step), eager packs the query heads
# onto the key/value heads (pack_gqa) and a traced step repeats the keys and values (repeat_kv).
# Another program, other bits: a GQA decode step traced by any backend differed from eager's in
# the last bits from its first token on (the other modules that read the flag change nothing,
# checked one by one). torchreplay promises eager's bits, and the eager branch traces as well, so
# for the traces torchreplay makes (its torch.compile backend, torchreplay.capture's export) that
# module reads the flag as False; other backends' traces and eager are untouched. The module is
# patched when imported (a finder waits for it if transformers comes later); its flag is one
# function of this module, which Dynamo evaluates once per trace (assume_constant_result).
_SDPA_MODULE = "transformers.integrations.sdpa_attention"


@torch._dynamo.assume_constant_result
def _traced_by_torchreplay() -> bool:
    """Whether the trace running now is torchreplay's: its export, or a frame Dynamo compiles for
    torchreplay's backend (called by Dynamo while tracing, outside the graph)."""
    from .export import _tracing
    if getattr(_tracing, "active", False):
        return True
    from torch._dynamo import symbolic_convert
    tx = getattr(symbolic_convert.tls, "current_tx", None)
    return tx is not None and _compiled_by(tx) is not None


def _patch_sdpa_attention(module: Any) -> None:
    flag = getattr(module, "is_torchdynamo_compiling", None)
    if flag is None or getattr(flag, "_torchreplay", False):
        return

    def is_torchdynamo_compiling() -> bool:  # the name transformers' code calls
        return flag() and not _traced_by_torchreplay()

    is_torchdynamo_compiling._torchreplay = True  # type: ignore[attr-defined]
    module.is_torchdynamo_compiling = is_torchdynamo_compiling


class _PatchOnImport:
    """A finder on sys.meta_path that patches _SDPA_MODULE once it is imported."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != _SDPA_MODULE:
            return None
        import importlib.machinery
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module: Any) -> None:
            exec_module(module)
            _patch_sdpa_attention(module)

        spec.loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


def _attention_as_eager_in_transformers() -> None:
    """Note [transformers' attention as eager runs it]."""
    import sys
    if _SDPA_MODULE in sys.modules:
        _patch_sdpa_attention(sys.modules[_SDPA_MODULE])
    elif not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())


def _compiled_by(tx: Any) -> Optional[CompilerConfig]:
    """The config of the torchreplay backend that compiles the frame `tx` traces, or None when
    another backend compiles it (torch.compile wraps a backend in _TorchCompileWrapper, and Dynamo
    in its debug wrapper: both unwrapped here)."""
    fn = getattr(getattr(tx, "output", None), "compiler_fn", None)
    if fn is None:
        return None
    wrapper = torch._dynamo.eval_frame.innermost_backend(fn)
    inner = getattr(wrapper, "compiler_fn", wrapper)
    kwargs = getattr(wrapper, "kwargs", {})
    if isinstance(inner, Backend):
        return torch_compile_config(inner.config, kwargs.get("mode"), kwargs.get("options"))
    if inner is named_backend:
        return torch_compile_config(CompilerConfig(), kwargs.get("mode"), kwargs.get("options"))
    return None


def _left_to_autograd(loss: Any, tx: Any, given: Dict[str, Any], leaves: Sequence[Any]) -> Optional[str]:
    """Why a `loss.backward()` torchreplay would trace (Note [Traced backward]) must run in
    autograd instead, seen while Dynamo traces it; None when the traced backward is eager's."""
    create_graph = given.get("create_graph")
    if create_graph is not None and not (create_graph.is_python_constant() and not create_graph.as_python_constant()):
        return "create_graph=True (the gradients must themselves require grad)"
    from torch._dynamo.variables.tensor import TensorVariable
    for var in tx.output.input_source_to_var.values():
        if isinstance(var, TensorVariable) and var.requires_grad and var.has_grad_fn:
            return (f"the argument {var.source.name if var.source else '?'} has a grad_fn: autograd's graph "
                    "goes on outside the compiled graph (a graph break before the backward, a module Dynamo "
                    "does not trace, a module backward hook)")
    # The leaves' real tensors, through their sources, as Dynamo's guards read them.
    root = tx.output.root_tx
    scope = {"L": root.f_locals, "G": root.f_globals}
    closure, cache = torch._dynamo.guards._get_closure_vars(), weakref.WeakKeyDictionary()
    for var in leaves:
        try:
            t = var.source.get_value(scope, dict(closure), cache) if var.source else None
        except Exception:  # a leaf made inside the graph: nothing of it outside
            continue
        if isinstance(t, torch.Tensor) and _hazard(t):
            return f"the leaf {var.source.name} {_hazard(t)}"
    return None


def _trace_backward_for_torchreplay() -> None:
    """Note [Traced backward]: Dynamo traces `loss.backward()` into the graph only with its own
    switch, torch._dynamo.config.trace_autograd_ops, which is global and off by default. This
    turns it on while Dynamo traces the backward of a frame a torchreplay backend compiles (with
    config.trace_backward, the default), for that backward only: other backends and frames are
    unchanged. A backward whose traced form would not be eager's breaks the graph there instead,
    so that autograd runs it (_left_to_autograd), as without the switch. And with the switch on,
    whoever compiles, Dynamo (2.11) traces the backward of a tensor whose leaves are all outside
    its frame (a graph break between the loss and the backward: `print(loss.item())`) as nothing,
    and no graph shows it: this makes Dynamo break the graph there instead."""
    try:
        from torch._dynamo.exc import unimplemented
        from torch._dynamo.variables.tensor import TensorVariable
    except ImportError:
        return
    original = TensorVariable.method_backward
    if getattr(original, "_torchreplay", False) or not hasattr(TensorVariable, "_collect_backward_inputs"):
        return

    def method_backward(self: Any, tx: Any, *args: Any, **kwargs: Any) -> Any:
        given = dict(zip(("gradient", "retain_graph", "create_graph", "inputs"), args), **kwargs)
        switch = torch._dynamo.config.trace_autograd_ops
        config = None if switch else _compiled_by(tx)
        ours = config is not None and config.trace_backward
        if not (switch or ours):
            return original(self, tx, *args, **kwargs)   # Dynamo breaks the graph here
        leaves = []
        if given.get("inputs") is None and (self.requires_grad or self.has_grad_fn):
            leaves = self._collect_backward_inputs(itertools.chain(tx.output.leaf_var_creation_order,
                                                                   tx.output.input_source_to_var.values()))
            if not leaves:
                unimplemented(
                    gb_type="Tensor.backward() with every leaf outside the graph",
                    context=f"call_method {self} backward",
                    explanation="The tensor's autograd graph reaches its leaves only through tensors "
                                "computed before a graph break, where a traced backward would do nothing; "
                                "torchreplay breaks the graph here so that autograd runs it.",
                    hints=["Remove the graph break between the loss and loss.backward() to trace the "
                           "backward into the graph."])
        if not ours:
            return original(self, tx, *args, **kwargs)
        why = _left_to_autograd(self, tx, given, leaves)
        if why:
            unimplemented(
                gb_type="Tensor.backward() left to autograd by torchreplay",
                context=why,
                explanation=f"torchreplay traces loss.backward() into the graph, but not this one: {why}. "
                            "Autograd runs it, as with other backends.",
                hints=["Set config.trace_backward = False to break every such graph at its backward."])
        with torch._dynamo.config.patch(trace_autograd_ops=True):
            return original(self, tx, *args, **kwargs)

    method_backward._torchreplay = True  # type: ignore[attr-defined]
    TensorVariable.method_backward = method_backward


def _mark_consumed_outputs() -> None:
    """Note [Returning a tensor whose backward ran]: for torchreplay's compiles, Dynamo's check of
    returned tensors whose autograd graph a traced backward consumed marks them instead of
    tracing the frame again with a graph break."""
    try:
        from torch._dynamo.output_graph import OutputGraph, collect_reachable_grad_fns
        from torch._dynamo.variables.tensor import TensorVariable
    except ImportError:
        return
    original = OutputGraph._validate_outputs_safe_for_autograd_nodes
    if getattr(original, "_torchreplay", False):
        return

    def validate(self: Any, rv: Any, tx: Any) -> None:
        config = _compiled_by(tx) if self.autograd_grad_consumed_grad_fns else None
        if config is None or not config.trace_backward:
            return original(self, rv, tx)
        for var in rv:
            if isinstance(var, TensorVariable) and var.requires_grad:
                node = var.as_proxy().node
                fake = node.meta.get("example_value")
                if isinstance(fake, torch.Tensor) and fake.grad_fn is not None and \
                        collect_reachable_grad_fns([(fake, None)]) & self.autograd_grad_consumed_grad_fns:
                    node.meta[_CONSUMED] = True

    validate._torchreplay = True  # type: ignore[attr-defined]
    OutputGraph._validate_outputs_safe_for_autograd_nodes = validate


# Modules whose parameters, buffers and submodules a Captured has bound: assigning a new one
# (model.weight = nn.Parameter(...), model.buf = t, model.sub = ...) makes those Captureds raise
# on every later call, as their graph still holds the old tensors. Conversions that go through
# Module._apply (.to(), .half(), .double()) change parameters through .data, which the engine
# sees (new memory, or a dtype it refuses), but replace buffers without a hook.
_watched: "weakref.WeakKeyDictionary[torch.nn.Module, weakref.WeakSet]" = weakref.WeakKeyDictionary()
_hooks: List[Any] = []


def _trace_rnns_for_torchreplay() -> None:
    """Dynamo (2.11) breaks the graph at an nn.RNN, nn.GRU or nn.LSTM unless its global switch
    torch._dynamo.config.allow_rnn is on: the module runs eagerly between graphs, and a model that
    is mostly such a module runs slower under torch.compile than eagerly (Dynamo's frame costs
    more than its graphs save). For frames a torchreplay backend compiles, the module is traced
    with the switch on for it alone where rnn.dynamo_traces allows (grad disabled, no dropout
    drawn, on the CPU): the backend then keeps its calls eager's bits (rnn.keep_whole, Note
    [Recurrent modules whole]). Elsewhere this says in torchreplay's log, once per module class,
    at WARNING, why not and what replays such a model whole: torchreplay.capture, bitwise."""
    try:
        from torch._dynamo.variables.builder import VariableBuilder
    except ImportError:
        return
    original = VariableBuilder.wrap_module
    if getattr(original, "_torchreplay", False):
        return
    told: set = set()

    def wrap_module(self: Any, value: torch.nn.Module) -> Any:
        if packed.standing_in(value) and _compiled_by(self.tx) is not None:
            packed.handle_of(value._packed_params)   # Note [Packed quantized Linears]
        elif packed.rnn_standing_in(value) and _compiled_by(self.tx) is not None:
            packed.cells_handle(value)
        if (not isinstance(value, (torch.nn.RNN, torch.nn.GRU, torch.nn.LSTM)) or torch._dynamo.config.allow_rnn
                or _compiled_by(self.tx) is None):
            return original(self, value)
        why = rnn.dynamo_traces(value)
        if why is None:
            with torch._dynamo.config.patch(allow_rnn=True):
                traced = original(self, value)
            traced._torchreplay_rnn = True  # marked for call_function below
            return traced
        kind = type(value)
        if kind not in told:
            told.add(kind)
            logger.warning(
                "torchreplay: Dynamo does not trace this %s: %s. It runs eagerly between the compiled graphs, and "
                "Dynamo's frame can make the call slower than eager. torchreplay.capture(model, example_args) "
                "replays such a model whole, bitwise.", kind.__name__, why)
        return original(self, value)

    wrap_module._torchreplay = True  # type: ignore[attr-defined]
    VariableBuilder.wrap_module = wrap_module
    _break_at_packed_sequences()


def _trace_packed_modules_for_torchreplay() -> None:
    """Dynamo breaks its graph at a quantize_dynamic Linear, LSTM or GRU (its packed weights are
    TorchScript objects it cannot trace), which then runs eagerly between graphs: slower than the
    model's eager. In frames a torchreplay backend compiles, such a module's forward is
    torchreplay::packed_linear (packed_lstm, packed_gru) on the handle of its packed object (its
    cells) instead (Note [Packed quantized Linears] in packed.py), which the backend lowers to
    eager's own op on that object. Modules with hooks or of another dtype, a packed sequence, and
    other backends' frames, are untouched. The handle is made or renewed where Dynamo meets the
    module (wrap_module) and read as an attribute, its value guarded: new weights compile again."""
    linear = packed.QuantizedLinear.forward
    if getattr(linear, "_torchreplay", False):
        return

    def linear_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() and _traced_by_torchreplay() and packed.standing_in(self):
            return packed.call(self, x, self._packed_params._torchreplay_handle)
        return linear(self, x)

    def rnn_forward(original: Any) -> Any:
        def forward(self: Any, input: Any, hx: Any = None) -> Any:
            if (torch.compiler.is_compiling() and isinstance(input, torch.Tensor) and _traced_by_torchreplay()
                    and packed.rnn_standing_in(self)):
                return packed.rnn_forward(self, input, hx, self._torchreplay_handle)
            return original(self, input, hx)
        return forward

    setstate = packed.QuantizedRNNBase.__setstate__

    def rnn_setstate(self: Any, state: Any) -> None:   # a copy (deepcopy, pickle) gets a handle of its own
        setstate(self, state)
        self.__dict__.pop("_torchreplay_handle", None)

    packed.QuantizedRNNBase.__setstate__ = rnn_setstate  # type: ignore[method-assign]
    for cls, forward in ((packed.QuantizedLinear, linear_forward),
                         (packed.QuantizedLSTM, rnn_forward(packed.QuantizedLSTM.forward)),
                         (packed.QuantizedGRU, rnn_forward(packed.QuantizedGRU.forward))):
        forward._torchreplay = True  # type: ignore[attr-defined]
        forward.__doc__ = cls.forward.__doc__
        cls.forward = forward  # type: ignore[method-assign]


def _break_at_packed_sequences() -> None:
    """A traced RNN module called on a PackedSequence: Dynamo skips the frame, which then runs
    eagerly, as it does where it does not trace the module. (Traced, or with a graph break at the
    call, the frame's later pad_packed_sequence fails in Dynamo on the fake batch_sizes.)"""
    from torch._dynamo.exc import SkipFrame
    from torch._dynamo.variables.nn_module import NNModuleVariable, UnspecializedNNModuleVariable
    from torch.nn.utils.rnn import PackedSequence

    def packed(var: Any) -> bool:
        try:
            return issubclass(var.python_type(), PackedSequence)
        except (NotImplementedError, TypeError):
            return False

    for cls in (NNModuleVariable, UnspecializedNNModuleVariable):
        original = cls.call_function
        if getattr(original, "_torchreplay", False):
            continue

        def call_function(self: Any, tx: Any, args: Any, kwargs: Any, _original: Any = original) -> Any:
            if getattr(self, "_torchreplay_rnn", False) and any(packed(a) for a in [*args, *kwargs.values()]):
                raise SkipFrame("torchreplay: an RNN module on a PackedSequence runs eagerly")
            return _original(self, tx, args, kwargs)

        call_function._torchreplay = True  # type: ignore[attr-defined]
        cls.call_function = call_function


def _on_registration(module: torch.nn.Module, name: str, value: Any) -> None:
    if torch.compiler.is_compiling():
        # Dynamo traces global hooks into the frames it compiles: reading _watched there would
        # make it guard on the weak dictionary's keys, which garbage collection changes under it
        # (a guard that fails to build). The modules it traces are not torchreplay.capture's.
        return None
    if (name == "_all_weight_values" and type(module) in packed.RNNS) or type(value) is packed.PackedParameter:
        packed.cells_changed(module)   # set_weight_bias, a cell put in: Dynamo's guard on the handle fails
    captures = _watched.get(module)
    if not captures:
        return None
    what = "submodule" if isinstance(value, torch.nn.Module) else "parameter" if isinstance(
        value, torch.nn.Parameter) or (value is None and name in module._parameters) else "buffer"
    for c in list(captures):
        _stale(c, ("replaced",), f"torchreplay: {what} '{name}' of {type(module).__name__} was replaced after the model "
                                 f"was captured as {c.name!r} (its graph holds the old tensors); capture the model again")
    return None


# Per Captured, why its calls raise: replaced tensors (for good), module numbers that differ from
# the capture's (until set back), in the order they happened.
_stale_reasons: "weakref.WeakKeyDictionary[Any, Dict[Any, str]]" = weakref.WeakKeyDictionary()


def _stale(c: Any, key: Any, why: Optional[str]) -> None:
    """Sets (or, with why None, clears) one reason for c's calls to raise; they raise the first."""
    reasons = _stale_reasons.setdefault(c, {})
    if why is None:
        reasons.pop(key, None)
    elif key != ("replaced",) or key not in reasons:
        reasons[key] = why
    c._set_stale(next(iter(reasons.values()), ""))


def _watch(module: torch.nn.Module, captured: Any) -> None:
    """`captured` (a Captured of captured.py, typed Any here: captured.py imports this module)
    checks its calls against module's numbers from now on, and against the inner tensors of its
    tensor-subclass parameters (_watch_inner)."""
    for m in module.modules():
        _watched.setdefault(m, weakref.WeakSet()).add(captured)
        _numbers.setdefault(m, weakref.WeakKeyDictionary())[captured] = {
            k: v for k, v in vars(m).items() if type(v) in _NUMBERS and k not in _UNREAD and not k.startswith("_")}
        for p in m._parameters.values():
            if is_traceable_wrapper_subclass(p):
                _watch_inner(p, captured)


# A tensor-subclass parameter (torchao's quantized weights) is bound as its inner tensors: one of
# them replaced by another (`weight.qdata = t`) would leave the capture reading the old one. Per
# subclass object (by id: a subclass's __hash__ may go through its __torch_function__), the
# captures bound to it; the subclass type's __setattr__ is wrapped once to tell them.
_inner_watched: Dict[int, Tuple[Any, "weakref.WeakSet[Any]"]] = {}
_setattr_wrapped: Set[type] = set()


def _watch_inner(t: torch.Tensor, captured: Any) -> None:
    entry = _inner_watched.get(id(t))
    if entry is None or entry[0]() is not t:
        key = id(t)
        entry = (weakref.ref(t, lambda _: _inner_watched.pop(key, None)), weakref.WeakSet())
        _inner_watched[key] = entry
    entry[1].add(captured)
    cls = type(t)
    if cls not in _setattr_wrapped:
        _setattr_wrapped.add(cls)
        original = cls.__setattr__

        def watched_setattr(self: Any, name: str, value: Any) -> None:
            original(self, name, value)
            if not _inner_watched or torch.compiler.is_compiling():
                return
            held = _inner_watched.get(id(self))
            if held is None or held[0]() is not self or name not in self.__tensor_flatten__()[0]:
                return
            for c in list(held[1]):
                _stale(c, ("replaced",), f"torchreplay: the inner tensor '{name}' of a {cls.__name__} parameter was "
                                         f"replaced after the model was captured as {c.name!r} (its graph holds the "
                                         "old tensor); capture the model again")
        cls.__setattr__ = watched_setattr
    for attr in {path[0] for path, _ in inner_tensors(t) if len(path) > 1}:  # subclasses inside
        _watch_inner(getattr(t, attr), captured)


# Note [Writes a capture would not see]
# A trace keeps what it read of a model as it was then: a module's numbers (a batch norm's eps, a
# LeakyReLU's slope: constants of the graph), and, with numerics "close", the parameters and
# buffers it folded or packed (Note [Close numerics]; torchreplay::check_frozen checks their
# version counters per call, and the contents of per-channel vectors). What those checks miss is
# watched here, for the modules and parameters of live captures only:
# - a parameter or buffer set to None (`layer.bias = None`: register_parameter calls no
#   registration hook for None): the captures bound to the module raise, as for a replaced one;
# - a module attribute that held a number (int, float, bool) at capture set to another value
#   (`training`, whose mode is checked per call, and `inplace`, which changes no result, aside):
#   the captures bound to the module raise on every call until it is set back (_on_setattr; both
#   numerics). Whether the trace read it is not known here: one it did not read raises too;
# - a parameter folded by a "close" capture reached through .data (an alias with a version
#   counter of its own), read or written, or given new data (`p.data = t`): check_frozen compares
#   the folded tensors' contents with their hashes at capture on the next call, and raises only
#   if they changed (a read, or `model.to()` giving the same data, changes nothing).
# Not seen under "close": writes through an alias taken before the capture, through a NumPy or
# DLPack view, or through the untyped storage, and a buffer's (a PT2E model's int8 weights) through
# .data; capture again after one. The bitwise numerics' one fold compares its tensors' whole
# contents on every call instead (Note [PT2E's weights dequantized once]): it sees them all.
_NUMBERS = (int, float, bool)
_UNREAD = ("training", "inplace")
# per module, per Captured bound to it: its numbers when captured
_numbers: "weakref.WeakKeyDictionary[torch.nn.Module, weakref.WeakKeyDictionary]" = weakref.WeakKeyDictionary()
_FOLDED = "_torchreplay_folded"  # set on a parameter a "close" capture folded
_DATA = torch._C.TensorBase.data


def watch_folded(tensors: Sequence[Any]) -> None:
    """The parameters among `tensors` were folded into a "close" capture's constants."""
    for t in tensors:
        if isinstance(t, torch.nn.Parameter):
            setattr(t, _FOLDED, True)


def _parameter_data_get(self: torch.nn.Parameter) -> torch.Tensor:
    if not torch.compiler.is_compiling() and self.__dict__.get(_FOLDED):  # in this order: no guard in Dynamo
        torch.ops.torchreplay.folded_data_reached()
    return _DATA.__get__(self)


def _parameter_data_set(self: torch.nn.Parameter, value: torch.Tensor) -> None:
    _DATA.__set__(self, value)
    if not torch.compiler.is_compiling() and self.__dict__.get(_FOLDED):
        torch.ops.torchreplay.folded_data_reached()


def _on_setattr(module: torch.nn.Module, name: str, value: Any) -> None:
    if isinstance(value, torch.ScriptObject):  # packed weights (Note [Packed quantized Linears] in packed.py)
        if name == "_packed_params":
            packed.register(module, value)
        elif name == "param" and type(module) is packed.PackedParameter:   # a cell given another (load_state_dict)
            packed.cells_changed(module)
        for c in list(_watched.get(module, ())):
            _stale(c, ("replaced",), f"torchreplay: the packed weights '{name}' of {type(module).__name__} were "
                                     f"replaced after the model was captured as {c.name!r} (its graph holds the old "
                                     "ones); capture the model again")
    for c, held in list(_numbers.get(module, {}).items()):
        if name not in held:
            continue
        same = type(value) in _NUMBERS and value == held[name]
        _stale(c, (id(module), name), None if same else
               f"torchreplay: attribute '{name}' of {type(module).__name__} was {held[name]!r} when the model was "
               f"captured as {c.name!r} and is now {value!r} (the trace keeps the values it read); set it back or "
               "capture the model again")


def _install_watchers() -> None:
    """Once, when torchreplay is imported: the module registration hooks (_on_registration) and
    nn.Module.train (and eval, which calls it) telling every Captured to check its modules' modes
    on its next call (Captured._slow_call, _Trace.check_modes). At import, not at the first
    capture: Dynamo guards on the global hooks and on nn.Module.train, so installing them later
    would recompile every function torch.compile had compiled before."""
    if not _hooks:
        from torch.nn.modules import module as nn_module
        _hooks.extend([nn_module.register_module_parameter_registration_hook(_on_registration),
                       nn_module.register_module_buffer_registration_hook(_on_registration),
                       nn_module.register_module_module_registration_hook(_on_registration)])
    if getattr(torch.nn.Module.train, "_torchreplay", False):
        return
    train, setattr_ = torch.nn.Module.train, torch.nn.Module.__setattr__

    def watched_train(self: torch.nn.Module, mode: bool = True) -> torch.nn.Module:
        out = train(self, mode)
        _C.module_modes_changed()
        return out

    def watched_setattr(self: torch.nn.Module, name: str, value: Any) -> None:
        setattr_(self, name, value)
        if torch.compiler.is_compiling():  # first: Dynamo guards on nothing here
            return
        if value is None and _watched and (name in self._parameters or name in self._buffers):
            _on_registration(self, name, None)  # register_parameter(name, None) calls no registration hook
        if _numbers or isinstance(value, torch.ScriptObject):
            _on_setattr(self, name, value)

    def watched(fn: Any) -> Any:  # a forward hook added or removed, the transformer fast path switched:
        # each Captured checks what its trace was made under (_Trace.state) on its next call
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            out = fn(*args, **kwargs)
            if not torch.compiler.is_compiling():
                _C.module_modes_changed()
            return out
        return call

    from torch.nn.modules import module as nn_module
    for owner, name in ((torch.nn.Module, "register_forward_hook"), (torch.nn.Module, "register_forward_pre_hook"),
                        (torch.utils.hooks.RemovableHandle, "remove"),
                        (nn_module, "register_module_forward_hook"), (nn_module, "register_module_forward_pre_hook"),
                        (torch.backends.mha, "set_fastpath_enabled")):
        setattr(owner, name, watched(getattr(owner, name)))
    watched_train._torchreplay = True  # type: ignore[attr-defined]
    watched_train.__doc__ = train.__doc__
    torch.nn.Module.train = watched_train  # type: ignore[method-assign]
    watched_setattr.__doc__ = setattr_.__doc__
    torch.nn.Module.__setattr__ = watched_setattr  # type: ignore[method-assign]
    torch.nn.Parameter.data = property(_parameter_data_get, _parameter_data_set,  # type: ignore[method-assign]
                                       doc=_DATA.__doc__)
