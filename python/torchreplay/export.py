"""How torchreplay.capture traces a model into the graph it lowers (trace_program): torch.export
(non-strict) of the model called on the flat leaves of its arguments (_Flat), decomposed as
AOTAutograd decomposes under torch.compile (_decompositions), the writes to buffers and inputs put
back into the graph as copy_ nodes (_writes_back); or, for a model with DTensors, which export
cannot trace, AOTAutograd's export (_trace_subclassed). One trace at a time in a process, with the
random generators watched (random_state.py); a trace that fails where two inputs share memory is
refused with an error that says what to do (Note [Inputs that share memory]). What the trace gives
capture() is a _Program: the graph, the tensors bound into it and what errors call them."""
from __future__ import annotations

import contextlib
import functools
import itertools
import sys
import threading
import warnings
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.fx
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from . import packed, rnn
from .fast_paths import eager_fast_paths
from .matmul_fold import fold_as_eager
from .random_state import _RandomStateWatch
from .subclasses import inner_tensors

aten = torch.ops.aten
_TRACE_LOCK = threading.Lock()   # one torch.export trace at a time in a process
_tracing = threading.local()     # .active while this thread traces (nested captures are refused)


class _Flat(torch.nn.Module):
    """What torch.export traces: the model called on the flat leaves of its arguments that are
    graph inputs (tensors, Python numbers), the others (None, strings, dtypes, devices, modules,
    ...) put back in their places as they were at capture time. Modules among them are
    submodules, so that their parameters and buffers are bound as the model's are."""

    def __init__(self, model: torch.nn.Module, spec: Any, constants: Dict[int, Any], n: int) -> None:
        super().__init__()
        self.model = model
        for i, v in constants.items():
            if isinstance(v, torch.nn.Module):
                self.add_module(f"argument{i}", v)
        self._spec, self._constants, self._n = spec, constants, n

    def forward(self, *leaves: Any) -> Any:
        it = iter(leaves)
        flat = [self._constants[i] if i in self._constants else next(it) for i in range(self._n)]
        args, kwargs = pytree.tree_unflatten(flat, self._spec)
        return self.model(*args, **kwargs)


class _Program(NamedTuple):
    """A traced model, as capture() uses it: the graph (bound inputs first, then one per flat
    argument leaf), the bound tensors and what errors call them, the leaves the graph writes, the
    user outputs, their structure, and the size ranges of a dynamic trace."""
    gm: torch.fx.GraphModule
    bound: List[Any]
    bound_names: List[str]
    mutated: List[int]
    num_outputs: int
    out_spec: Any
    ranges: Dict[Any, Any]
    grad_owners: List[Optional[torch.Tensor]]  # per bound tensor: whose requires_grad stands for it
    # (bound input, requires_grad then) of the parameters whose requires_grad decided how a matmul
    # was traced (Note [Matmuls folded as eager folds them])
    grad_traced: List[Tuple[int, bool]] = []


def trace_program(traced: _Flat, leaves: Tuple[Any, ...], *, subclassed: bool, dynamic: bool,
                  decompositions: Optional[Dict[Any, Callable]], leaf_names: Sequence[str],
                  close: bool) -> _Program:
    """`traced` traced on `leaves`, one trace at a time in the process: through torch.export
    (_trace_exported), or, with DTensors (`subclassed`), through AOTAutograd's export
    (_trace_subclassed). `leaf_names`: what errors call the leaves; `close`: numerics "close"."""
    if getattr(_tracing, "active", False):
        raise RuntimeError("torchreplay.capture: called while another capture is tracing its model (from inside "
                           "that model's forward?); torch.export does not nest: capture the inner model first, "
                           "outside, and call the result from the outer one")
    with _TRACE_LOCK, warnings.catch_warnings():  # one trace at a time: torch.export keeps global state
        # torch.export's own use of a deprecated pytree API (nothing a caller can change)
        warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
        _tracing.active = True
        hooks = torch.nn.modules.module._global_buffer_registration_hooks
        before = set(hooks)
        try:
            with packed.packed_as_ops(traced):   # Note [Packed quantized Linears]
                _refuse_packed_weights(traced)
                if subclassed:
                    if dynamic:
                        raise NotImplementedError("torchreplay.capture: dynamic=True with DTensors (tensor "
                                                  "parallelism) is not supported; capture once per shape")
                    program = _trace_subclassed(traced, leaves, decompositions)
                else:
                    program = _trace_exported(traced, leaves, dynamic, decompositions, leaf_names, close=close)
            return program
        finally:
            _tracing.active = False
            # torch 2.11's export leaves its buffer-assignment hook behind when a trace fails: every
            # later Dynamo frame that assigns a buffer would break its graph at it
            for key in [k for k in hooks if k not in before]:
                del hooks[key]


def _decompositions(extra: Optional[Dict[Any, Callable]], close: bool = False) -> Any:
    """What AOTAutograd does under torch.compile: CompositeImplicitAutograd ops decompose (linear ->
    t + addmm), the rest of ATen stays; plus the caller's own decompositions. The recurrent ops
    decompose only where that gives eager's bits (rnn.py); with `close` (numerics "close", Note
    [Close numerics]) everywhere but a GRU the rewrite fuses."""
    table = dict(_cia_decompositions(close))
    for op, fn in (extra or {}).items():
        table[op] = fn
    return table


@functools.lru_cache(maxsize=2)
def _cia_decompositions(close: bool) -> Dict[Any, Callable]:
    """export's default decompositions of the CompositeImplicitAutograd ops (made once: 0.1 s)."""
    from torch._export.utils import _collect_all_valid_cia_ops

    cia = _collect_all_valid_cia_ops()
    table = {op: fn for op, fn in torch.export.default_decompositions().items()
             if op in cia and op not in _CHECKS_VALUES}
    return rnn.export_decompositions(table, close)


# CompositeImplicitAutograd ops whose eager call raises on bad values (a class out of range, a
# matrix not positive-definite or singular: their _ex op's info checked) where their decompositions
# go on with a wrong result: kept whole, eager's call with its checks runs at each replay.
_CHECKS_VALUES = {aten.one_hot.default, aten.linalg_cholesky.default, aten.linalg_inv.default,
                  aten.inverse.default, aten.linalg_solve.default, aten.linalg_lu_factor.default,
                  aten.linalg_ldl_factor.default, aten.linalg_tensorinv.default}


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


def _inner_tensor(traced: torch.nn.Module, target: str, ep: Any) -> torch.Tensor:
    """A tensor-subclass parameter (torchao's quantized weights) is exported as its inner tensors,
    parametrizations the module's own names do not hold ("<module>.parametrizations.<name>.original<k>":
    the k-th tensor of the parameter flattened through __tensor_flatten__). The module's own inner
    tensor where it is found, so that a capture reads what the parameter holds at each call (a
    `set_` on it included), else the exported program's."""
    exported = ep.state_dict[target]
    prefix, _, rest = target.partition(".parametrizations.")
    name, _, k = rest.partition(".original")
    try:
        param = getattr(traced.get_submodule(prefix), name)
    except AttributeError:
        return exported
    if not is_traceable_wrapper_subclass(param) or not k.isdigit():
        return exported
    leaves = [t for _, t in inner_tensors(param)]
    inner = leaves[int(k)] if int(k) < len(leaves) else None
    same = inner is not None and (inner.shape, inner.stride(), inner.dtype, inner.data_ptr()) == \
        (exported.shape, exported.stride(), exported.dtype, exported.data_ptr())
    return inner if same else exported


def _bound_name(kind: str, target: str) -> str:
    fqn = target[len("model."):] if target.startswith("model.") else target
    return f"{kind} '{fqn}'"


def _unviewed(leaves: Tuple[Any, ...]) -> Tuple[Any, ...]:
    """The arguments with views traced as the tensors they are, not through their bases: torch
    2.11's run_decompositions fails a dynamic trace of a slice's columns in the guard it builds
    from the base ('NoneType' object has no attribute 'size'). detach() keeps storage, strides and
    offset."""
    return tuple(a.detach() if isinstance(a, torch.Tensor) and a._base is not None and not a.requires_grad else a
                 for a in leaves)


def _trace_exported(traced: "_Flat", leaves: Tuple[Any, ...], dynamic: bool,
                    decompositions: Optional[Dict[Any, Callable]], leaf_names: Sequence[str],
                    close: bool = False) -> _Program:
    """torch.export's trace (non-strict), decomposed; the writes to buffers and inputs put back
    into the graph (_writes_back). `leaf_names`: what errors call the arguments."""
    dynamic_shapes = None
    if dynamic:  # every dimension of every tensor (one entry: forward's *leaves)
        dynamic_shapes = (tuple({d: torch.export.Dim.AUTO for d in range(a.dim())} if isinstance(a, torch.Tensor)
                                else None for a in leaves),)
    state = dict(traced.named_parameters(remove_duplicate=False))
    buffers = dict(traced.named_buffers(remove_duplicate=False))
    state.update(buffers)
    # every input as errors call it, for Note [Inputs that share memory]
    inputs = [(_bound_name("buffer" if k in buffers else "parameter", k), t) for k, t in state.items()] + \
        [(n, a) for n, a in zip(leaf_names, leaves) if isinstance(a, torch.Tensor)]
    if torch._C._is_any_autocast_enabled():
        _refuse_autocast("a trace under autocast (the capture made, or called, under it)")
    try:
        with _RandomStateWatch() as rng, torch.no_grad(), \
                rnn.whole_in_trace(close), eager_fast_paths():
            ep = torch.export.export(traced, _unviewed(leaves) if dynamic else leaves, dynamic_shapes=dynamic_shapes,
                                     strict=False)
    except Exception as e:
        _refuse_shared_memory(inputs, (), e)
        _refuse_value_branch(e)
        raise
    if any(n.target is torch.ops.higher_order.wrap_with_autocast for n in ep.graph.nodes):
        _refuse_autocast("the model's forward enters autocast")
    rng.check()
    targets = {spec.arg.name: spec.target for spec in ep.graph_signature.input_specs if hasattr(spec.arg, "name")}
    decided = {targets[p.name]: p.meta["val"].requires_grad for p in fold_as_eager(ep.graph_module)}
    try:
        with torch.no_grad():
            ep = ep.run_decompositions(_decompositions(decompositions, close))
    except Exception as e:
        _refuse_shared_memory(inputs, _written_by(ep, leaves, leaf_names), e)
        raise
    gm = ep.graph_module
    num_outputs = _writes_back(ep, gm)
    bound: List[Any] = []
    bound_names: List[str] = []  # as the caller knows them: "parameter 'fc1.weight'"
    user_specs = []
    for spec in ep.graph_signature.input_specs:
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            bound.append(state[spec.target] if spec.target in state else _inner_tensor(traced, spec.target, ep))
            bound_names.append(_bound_name(spec.kind.name.lower(), spec.target))
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            bound.append(ep.constants[spec.target])
            bound_names.append(f"constant '{spec.target}'")
        elif spec.kind == InputKind.USER_INPUT:
            user_specs.append(spec)
        else:
            raise NotImplementedError(f"torchreplay.capture: export input kind {spec.kind.name}")
    if len(user_specs) != len(leaves):
        raise AssertionError("torchreplay.capture: graph inputs and signature disagree")
    mutated_names = {s.target for s in ep.graph_signature.output_specs if s.kind == OutputKind.USER_INPUT_MUTATION}
    mutated = [k for k, spec in enumerate(user_specs) if spec.arg.name in mutated_names]
    bound_targets = [spec.target for spec in ep.graph_signature.input_specs
                     if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)]
    grad_traced = [(i, decided[t]) for i, t in enumerate(bound_targets) if t in decided]
    return _Program(gm, bound, bound_names, mutated, num_outputs, ep.call_spec.out_spec, ep.range_constraints,
                    [None] * len(bound), grad_traced)


# Note [Inputs that share memory]
# Two of a model's inputs (buffers, parameters, arguments) may be views of one memory: buffers
# registered as a tensor and a slice or view of it, an argument passed twice or over a buffer's
# memory. When the model writes one of them where the other overlaps it, torch.export (2.11)
# cannot trace it: its decomposition step (AOTAutograd's export) has no graph for inputs that
# alias and are written ("expected compiled_fn to be GraphModule, got <class 'function'>"), and
# an argument over a buffer's memory fails in its fake tensors where written, or where it views the
# whole buffer (a view of it with its very sizes) even when only read. torch.compile takes such a model
# (AOTAutograd's runtime wrapper gives the graph their common base; bitwise eager's, replayed:
# tests/python/test_capture.py). So a trace that fails where two inputs overlap (in their
# elements' bytes, not only their storage: disjoint slices of one tensor trace) is refused with
# an error naming them and the one written (found in export's graph before its decompositions,
# when there is one), saying what to do, and quoting export's error (should the overlap not be
# its cause). Inputs that overlap where the trace does not fail (arguments read, not written)
# trace as any others; later calls that overlap a written argument are refused per call
# (replay/call_checks.h).
def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a and b may share an element: one storage and intersecting byte ranges."""
    if a.layout != torch.strided or b.layout != torch.strided or a.device != b.device or \
            a.numel() == 0 or b.numel() == 0:
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False

    def span(t: torch.Tensor) -> Tuple[int, int]:
        start = t.storage_offset() * t.element_size()
        last = sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if n > 1)
        return start, start + (last + 1) * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def _written_by(ep: ExportedProgram, leaves: Sequence[Any], leaf_names: Sequence[str]) -> List[str]:
    """The names (as _trace_exported's `inputs` give them) of the inputs that export's graph (before
    its decompositions: in-place ops on views of its inputs) writes."""
    from .fx_views import root as root_of
    placeholders = [n for n in ep.graph.nodes if n.op == "placeholder"]
    named = {}
    buffers = set(ep.graph_signature.buffers)
    leaf = iter(zip(leaf_names, leaves))
    for n, spec in zip(placeholders, ep.graph_signature.input_specs):
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            named[n] = _bound_name("buffer" if spec.target in buffers else "parameter", spec.target)
        elif spec.kind == InputKind.USER_INPUT:
            named[n] = next(leaf, ("", None))[0]
    written = []
    for n in ep.graph.nodes:
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
            continue
        for formal, a in zip(n.target._schema.arguments, n.args):
            if formal.alias_info is not None and formal.alias_info.is_write and isinstance(a, torch.fx.Node):
                root = root_of(a)
                if root in named and named[root] not in written:
                    written.append(named[root])
    return written


def _refuse_shared_memory(inputs: Sequence[Tuple[str, Any]], written: Sequence[str], error: Exception) -> None:
    """Raises the error of Note [Inputs that share memory] for the trace's `error` if two of
    `inputs` ((name, tensor)) overlap: a pair with one of them `written` first."""
    pairs = [(name, other, t is u or (t.storage_offset(), t.shape, t.stride()) == (u.storage_offset(), u.shape, u.stride()))
             for i, (name, t) in enumerate(inputs) for other, u in inputs[i + 1:] if _overlap(t, u)]
    if not pairs:
        return
    pairs.sort(key=lambda p: p[0] not in written and p[1] not in written)
    name, other, same = pairs[0]
    which = [n for n in (name, other) if n in written]
    what = f"{name} and {other} are the same memory" if same else f"{name} and {other} share memory"
    writes = f", and the model writes {'it' if same else ' and '.join(which)}" if which else ""
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    raise NotImplementedError(
        f"torchreplay.capture: {what}{writes}; torch.export cannot trace inputs that overlap where one is written "
        f"(nor an argument that views a whole buffer), and failed with {type(error).__name__}: {first}. Compile the "
        "model instead: torch.compile(model, backend=torchreplay.get_backend(...)) takes it (AOTAutograd gives "
        "the graph their common base); or keep one of them and take the other as a view of it inside forward, "
        "or give each memory of its own (clone). Note [Inputs that share memory] in export.py") from error


def _refuse_value_branch(error: Exception) -> None:
    """A trace that failed where the model's Python reads a tensor's value to decide what to
    compute (export's GuardOnDataDependentSymNode): refused naming the line, with what to do."""
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
    if not isinstance(error, GuardOnDataDependentSymNode):
        return
    import traceback
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if "site-packages/torch/" not in f.filename or "/torch/nn/" in f.filename]
    where = f" at {frames[-1].filename}:{frames[-1].lineno} ({frames[-1].line})" if frames else ""
    raise NotImplementedError(
        f"torchreplay.capture: the model reads a tensor's value to decide what to compute{where}, which torch.export "
        "cannot trace; give that decision as an argument (nn.Transformer's and nn.TransformerEncoder's is_causal and "
        "tgt_is_causal with a mask, F.one_hot's num_classes), or use torch.compile(model, backend='torchreplay'), "
        "which breaks its graph there") from error


def _refuse_autocast(where: str) -> None:
    """Note [Ambient state] (guards/guard_key.h): torch.export (torch 2.11) decomposes composite
    ops under autocast without autocast's casts on the ops inside them (einsum, tensordot,
    bilinear, nll_loss, the RNN cells and modules), so a trace under autocast is not eager's
    program, and a graph runs with autocast off: refused by name. torch.compile traces autocast as
    eager runs it."""
    raise NotImplementedError(
        f"torchreplay.capture: {where}; torch.export decomposes composite ops (einsum, bilinear, "
        "nll_loss, recurrent modules, ...) without autocast's casts, so such a trace would not compute eager's "
        "results: capture the model without autocast (a capture called under autocast runs the model eagerly), "
        "or use torch.compile(model, backend='torchreplay'), which traces autocast as eager runs it")


def _refuse_packed_weights(module: torch.nn.Module) -> None:
    """torch.ao.quantization's quantized modules other than quantize_dynamic's Linears, LSTMs and
    GRUs (Note [Packed quantized Linears]: convert's static modules, those with hooks) hold their weights
    packed in TorchScript objects that torch.export cannot trace (it fails with "does not have a
    field with name '__obj_flatten__'"): refused up front, with what works instead."""
    found = [name for name, m in module.named_modules() if type(m).__module__.startswith("torch.ao.nn.quantized")
              and any(isinstance(v, torch.ScriptObject) for sub in m.modules() for v in vars(sub).values())]
    found = [n.removeprefix("model.") for n in found if not any(n.startswith(p + ".") for p in found)]
    if found:
        raise NotImplementedError(
            f"torchreplay.capture: {', '.join(repr(n) for n in found[:3])}{' and others' if len(found) > 3 else ''} "
            f"{'is a torch.ao.quantization module' if len(found) == 1 else 'are torch.ao.quantization modules'} "
            "(quantize_dynamic's or convert's) whose packed weights torch.export cannot trace; "
            "torchreplay.capture takes quantize_dynamic's Linears, LSTMs and GRUs but not these modules yet "
            "(convert's static modules, quantized modules with hooks). torchao's quantize_ with "
            "Int8DynamicActivationInt8WeightConfig quantizes Linears to int8 with activations quantized per "
            "call, as quantize_dynamic does (per row and channel rather than per tensor), and is captured and "
            "replayed bitwise (docs/guide.md, \"Quantized models\"); torch.compile runs these modules "
            "eagerly between its graphs.")


def _dtensors(module: torch.nn.Module, leaves: Sequence[Any]) -> bool:
    """Whether a parameter, buffer or tensor argument is a DTensor (tensor parallelism)."""
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    if dtensor is None:  # nobody made a DTensor in this process
        return False
    values = itertools.chain(leaves, module.parameters(), module.buffers())
    return any(isinstance(v, dtensor) for v in values)


def _trace_subclassed(traced: "_Flat", leaves: Tuple[Any, ...],
                      decompositions: Optional[Dict[Any, Callable]]) -> _Program:
    """A model with DTensors, which torch.export (torch 2.11) cannot trace: AOTAutograd's export
    with descriptors (Dynamo once, at capture) traces its local computation, the subclasses taken
    apart as under torch.compile: the graph reads each DTensor parameter's local shard and holds
    the collectives its redistributions make. Each graph input's descriptor says what it is: a
    parameter or buffer (or the local tensor of one), or the i-th argument leaf."""
    from torch._functorch._aot_autograd import descriptors as d
    from torch._functorch.aot_autograd import aot_export_joint_with_descriptors

    with _RandomStateWatch(calls=False) as rng, torch.no_grad(), contextlib.ExitStack() as stack:
        # writes into buffers and arguments stay in the graph (copy_ into the input), as under torch.compile
        try:
            joint = aot_export_joint_with_descriptors(stack, traced, leaves, keep_inference_input_mutations=True,
                                                      decompositions=_decompositions(decompositions))
        except AssertionError as e:
            if "FakeTensor" not in str(e):
                raise
            raise NotImplementedError(
                "torchreplay.capture: this DTensor model reads a tensor that is neither a parameter, a buffer "
                "nor an argument (a plain attribute, or a global), which its trace through AOTAutograd cannot "
                "take; register it as a buffer (module.register_buffer), or compile the model: "
                "torch.compile(model, backend=torchreplay.get_backend(...))") from None
    rng.check()
    # AOTAutograd's RNG tracker keeps the trace's fake mode (and its converted copies of the
    # parameters) alive after the trace: it would outlive the capture.
    from torch._decomp.decompositions_for_rng import PhiloxStateTracker
    PhiloxStateTracker.reset()
    gm = joint.graph_module
    state = dict(traced.named_parameters(remove_duplicate=False))
    state.update(traced.named_buffers(remove_duplicate=False))

    def tensor_of(desc: Any) -> Tuple[Any, str, Any]:
        """The tensor a graph input is, what errors call it, and the parameter or buffer it is of."""
        if isinstance(desc, d.SubclassGetAttrAOTInput):
            value, name, owner = tensor_of(desc.base)
            return getattr(value, desc.attr), f"{name} (its {desc.attr})", owner
        if isinstance(desc, (d.ParamAOTInput, d.BufferAOTInput)):
            kind = "parameter" if isinstance(desc, d.ParamAOTInput) else "buffer"
            return state[desc.target], _bound_name(kind, desc.target), state[desc.target]
        raise NotImplementedError(f"torchreplay.capture: a DTensor model's graph input of kind {type(desc).__name__} "
                                  "is not supported (DTensor arguments are not: pass local tensors, and make "
                                  "DTensors inside the model, as the parallel styles' input hooks do)")

    bound: List[Any] = []
    bound_names: List[str] = []
    grad_owners: List[Optional[torch.Tensor]] = []
    plain = []
    written = {n.args[0] for n in gm.graph.nodes if n.op == "call_function" and n.target is aten.copy_.default}
    mutated = []
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        desc = n.meta.get("desc")
        if isinstance(desc, d.PlainAOTInput):
            if n in written:
                mutated.append(len(plain))
            plain.append(desc.idx)
        elif plain:
            raise NotImplementedError("torchreplay.capture: a bound input after the arguments in a DTensor "
                                      "model's graph")
        else:
            value, name, owner = tensor_of(desc)
            bound.append(value)
            bound_names.append(name)
            grad_owners.append(owner if owner is not value else None)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    if plain != list(range(len(leaves))) or \
            not all(isinstance(o, d.PlainAOTOutput) for o in output.meta.get("desc", [])):
        raise NotImplementedError(
            "torchreplay.capture: this DTensor model returns DTensors, which a capture does not support; "
            "return local tensors (to_local(), or the parallel styles' use_local_output=True), or compile "
            "it: torch.compile(model, backend=torchreplay.get_backend(...))")
    return _Program(gm, bound, bound_names, mutated, len(output.args[0]), joint.out_spec, {}, grad_owners)
