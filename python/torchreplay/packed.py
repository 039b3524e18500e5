"""Note [Packed quantized Linears]
torch.ao.quantization's quantize_dynamic makes each nn.Linear a
torch.ao.nn.quantized.dynamic.Linear, whose weights live packed in a TorchScript object
(LinearPackedParamsBase: fbgemm's or oneDNN's packed matrix) and whose forward is one op on it,
quantized::linear_dynamic (qint8: the activation's range found per call, an int8 GEMM) or
quantized::linear_dynamic_fp16. torch.export cannot trace such an object (it has no
__obj_flatten__), and Dynamo breaks its graph at it. Each packed object gets an integer handle
(`_objects`, held while its LinearPackedParams module holds the object, kept in the module's
`_torchreplay_handle`; made when the object is set, patches.py _on_setattr, or when first traced:
random, since a copied or unpickled module carries its original's), and
torchreplay::packed_linear stands for the module's forward on that handle: while
torchreplay.capture traces, each such module stands aside for _PackedLinear; while Dynamo traces
a frame for torchreplay's backend, the module's forward calls the op itself (patches.py
_trace_packed_linears_for_torchreplay; the handle is renewed where Dynamo meets the module and is
an attribute whose value Dynamo guards, so new weights compile again). Lowering (lowering.py)
turns the op into eager's own op on eager's own packed object, a constant of the graph. A replay
therefore runs the packed kernel eager runs, on the same packed weights: eager's bits. The op's
CPU kernel (Python: it needs the objects) runs where a traced graph runs before lowering
(capture's check of numerics "close", a graph the backend runs as traced). set_weight_bias (new
weights packed into a new object) after a capture makes the capture's calls raise (patches.py
_on_setattr). quantize_dynamic's LSTMs and GRUs are traced the same way by torchreplay.capture: the
module stands aside for _PackedRNN, whose call of the module's own forward makes its
torch.quantized_lstm / quantized_gru call torchreplay::packed_lstm / packed_gru on the handle of
the list of its layers' packed cells (CellParamsBase objects), lowered to aten's quantized_lstm /
quantized_gru on that list: eager's op on eager's cells. Not in torch.compile (Dynamo breaks its
graph at them, which then run eagerly), nor over packed sequences, nor in a .trp file (refused).
Modules with hooks, another dtype, or convert's static modules stay unsupported and are refused
by name (export._refuse_packed_weights).
"""
from __future__ import annotations

import contextlib
import secrets
import weakref
from typing import Any, Dict, Iterator, List, Tuple

import torch
from torch.ao.nn.quantized.dynamic import GRU as QuantizedGRU
from torch.ao.nn.quantized.dynamic import LSTM as QuantizedLSTM
from torch.ao.nn.quantized.dynamic import Linear as QuantizedLinear

OP = "torchreplay::packed_linear"
_objects: Dict[int, Any] = {}   # handle -> packed object, while a LinearPackedParams holds it
_owners: Dict[int, Any] = {}    # handle -> weak reference to that LinearPackedParams


def register(params: torch.nn.Module, obj: Any) -> int:
    """A new handle for `obj`, the packed object `params` (a LinearPackedParams) now holds, kept in
    params' `_torchreplay_handle` (its previous handle dropped) and in _objects while params lives.
    Random, not counted: a module copied or unpickled carries its original's handle, which must
    never be another live module's (Dynamo's guard compares the number)."""
    old = params.__dict__.get("_torchreplay_handle")
    if old is not None and _owners.get(old, lambda: None)() is params:   # not a copy's original's
        _forget(old)
    handle = secrets.randbits(62)
    _objects[handle], _owners[handle] = obj, weakref.ref(params)
    params.__dict__["_torchreplay_handle"] = handle   # no nn.Module __setattr__: nothing is watched here
    weakref.finalize(params, _forget, handle)
    return handle


def _forget(handle: int) -> None:
    _objects.pop(handle, None)
    _owners.pop(handle, None)


def handle_of(params: torch.nn.Module) -> int:
    """The handle of the packed object `params` holds now (made if it has none, or its original's:
    a copy's)."""
    handle = params.__dict__.get("_torchreplay_handle")
    if handle is None or _objects.get(handle) is not params._packed_params or _owners[handle]() is not params:
        handle = register(params, params._packed_params)
    return handle


@torch.library.register_fake(OP)
def _packed_linear_fake(x: torch.Tensor, handle: int, out_features: int, reduce_range: bool,
                        fp16: bool) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features), dtype=torch.float32)


@torch.library.impl(OP, "cpu")
def _packed_linear_cpu(x: torch.Tensor, handle: int, out_features: int, reduce_range: bool,
                       fp16: bool) -> torch.Tensor:
    obj = _objects.get(handle)
    if obj is None:
        raise RuntimeError(f"{OP}: no packed weights of handle {handle} (their module is gone)")
    if fp16:
        return torch.ops.quantized.linear_dynamic_fp16(x, obj)
    return torch.ops.quantized.linear_dynamic(x, obj, reduce_range)


def call(m: torch.nn.Module, x: torch.Tensor, handle: int) -> torch.Tensor:
    """A quantize_dynamic Linear's forward (reduce_range as its version decides, the output in the
    input's dtype) as torchreplay::packed_linear on its packed object's handle."""
    reduce_range = not (m.version is None or m.version < 4)
    y = torch.ops.torchreplay.packed_linear(x, handle, m.out_features, reduce_range,
                                            m._packed_params.dtype == torch.float16)
    return y.to(x.dtype)


def standing_in(m: torch.nn.Module) -> bool:
    """Whether `m` is a quantize_dynamic Linear traced as torchreplay::packed_linear."""
    return (type(m) is QuantizedLinear and m._packed_params.dtype in (torch.qint8, torch.float16)
            and not (m._forward_hooks or m._forward_pre_hooks))


def _cells(m: torch.nn.Module) -> List[Any]:
    return [p.param for p in m._all_weight_values]


def cells_handle(m: torch.nn.Module) -> int:
    """The handle of the list of packed cells a quantize_dynamic LSTM or GRU holds now (made if
    it has none, or its cells changed, or it is a copy)."""
    handle, cells = m.__dict__.get("_torchreplay_handle"), _cells(m)
    held = _objects.get(handle) if handle is not None else None
    if held is None or _owners[handle]() is not m or len(held) != len(cells) or \
            any(a is not b for a, b in zip(held, cells)):
        handle = register(m, cells)
    return handle


@torch.library.register_fake("torchreplay::packed_lstm")
def _packed_lstm_fake(input, hx, handle, has_biases, num_layers, dropout, train, bidirectional, batch_first, dtype):
    from .rnn import _fake_output
    return (_fake_output(input, hx[0], bidirectional, batch_first), hx[0].new_empty(hx[0].shape),
            hx[1].new_empty(hx[1].shape))


@torch.library.register_fake("torchreplay::packed_gru")
def _packed_gru_fake(input, hx, handle, has_biases, num_layers, dropout, train, bidirectional, batch_first):
    from .rnn import _fake_output
    return _fake_output(input, hx, bidirectional, batch_first), hx.new_empty(hx.shape)


def _held(handle: int) -> List[Any]:
    cells = _objects.get(handle)
    if cells is None:
        raise RuntimeError(f"torchreplay: no packed cells of handle {handle} (their module is gone)")
    return cells


@torch.library.impl("torchreplay::packed_lstm", "cpu")
def _packed_lstm_cpu(input, hx, handle, has_biases, num_layers, dropout, train, bidirectional, batch_first, dtype):
    return _QUANTIZED["lstm"](input, hx, _held(handle), has_biases, num_layers, dropout, train, bidirectional,
                              batch_first, dtype=dtype, use_dynamic=True)


@torch.library.impl("torchreplay::packed_gru", "cpu")
def _packed_gru_cpu(input, hx, handle, has_biases, num_layers, dropout, train, bidirectional, batch_first):
    return _QUANTIZED["gru"](input, hx, _held(handle), has_biases, num_layers, dropout, train, bidirectional,
                             batch_first)


_QUANTIZED = {"lstm": torch.quantized_lstm, "gru": torch.quantized_gru}


@contextlib.contextmanager
def _cells_as_handle(handle: int) -> Iterator[None]:
    """Within: torch.quantized_lstm and quantized_gru, given exactly the cells of `handle`, call
    torchreplay::packed_lstm / packed_gru on it (a packed sequence is refused)."""
    cells = _held(handle)
    def lstm(input, hx, params, *rest, dtype=None, use_dynamic=False):
        if not isinstance(hx, (list, tuple)) or list(params) != cells:
            raise NotImplementedError("torchreplay.capture: a quantize_dynamic LSTM over a packed sequence cannot "
                                      "be traced; pass padded tensors, or run the model eagerly")
        return torch.ops.torchreplay.packed_lstm(input, list(hx), handle, *rest, dtype)

    def gru(input, hx, params, *rest):
        if not isinstance(params, (list, tuple)) or list(params) != cells:
            raise NotImplementedError("torchreplay.capture: a quantize_dynamic GRU over a packed sequence cannot "
                                      "be traced; pass padded tensors, or run the model eagerly")
        return torch.ops.torchreplay.packed_gru(input, hx, handle, *rest)

    torch.quantized_lstm, torch.quantized_gru = lstm, gru
    try:
        yield
    finally:
        torch.quantized_lstm, torch.quantized_gru = _QUANTIZED["lstm"], _QUANTIZED["gru"]


class _PackedRNN(torch.nn.Module):
    """A quantize_dynamic LSTM or GRU as torch.export traces it: the module's own forward, its
    quantized op on its cells' handle."""

    def __init__(self, m: torch.nn.Module) -> None:
        super().__init__()
        self.__dict__["rnn"] = m   # not a submodule: export would meet its packed cells
        self.handle = cells_handle(m)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with _cells_as_handle(self.handle):
            return self.rnn(*args, **kwargs)


class _PackedLinear(torch.nn.Module):
    """A quantize_dynamic Linear as torch.export traces it (`call` on its handle)."""

    def __init__(self, m: torch.nn.Module) -> None:
        super().__init__()
        self.__dict__["linear"] = m   # not a submodule: export would meet its packed object
        self.handle = handle_of(m._packed_params)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return call(self.linear, x, self.handle)


@contextlib.contextmanager
def packed_as_ops(root: torch.nn.Module) -> Iterator[None]:
    """Within: every quantize_dynamic Linear under `root` replaced by its _PackedLinear (in its
    parent's _modules directly: no registration hook fires, nothing is kept). Put back on exit."""
    swapped: List[Tuple[torch.nn.Module, str, torch.nn.Module]] = []
    try:
        for parent in list(root.modules()):
            for name, child in list(parent._modules.items()):
                if child is not None and standing_in(child):
                    parent._modules[name] = _PackedLinear(child)
                    swapped.append((parent, name, child))
                elif type(child) in (QuantizedLSTM, QuantizedGRU) and not (child._forward_hooks or
                                                                           child._forward_pre_hooks):
                    parent._modules[name] = _PackedRNN(child)
                    swapped.append((parent, name, child))
        yield
    finally:
        for parent, name, child in reversed(swapped):
            parent._modules[name] = child


def lowered(node: torch.fx.Node) -> Tuple[str, List[Any], Dict[str, Any]]:
    """The op and arguments a torchreplay::packed_linear, packed_lstm or packed_gru node lowers to:
    eager's op on eager's packed object or cells, a constant."""
    if node.target is torch.ops.torchreplay.packed_lstm.default:
        input, hx, handle, *rest, dtype = node.args
        return "aten::quantized_lstm.input", [input, hx, _held(handle), *rest], {"dtype": dtype, "use_dynamic": True}
    if node.target is torch.ops.torchreplay.packed_gru.default:
        input, hx, handle, *rest = node.args
        return "aten::quantized_gru.input", [input, hx, _held(handle), *rest], {}
    x, handle, _, reduce_range, fp16 = node.args
    if handle not in _objects:
        raise ValueError(f"no packed weights of handle {handle} (their module is gone)")
    if fp16:
        return "quantized::linear_dynamic_fp16", [x, _objects[handle]], {}
    return "quantized::linear_dynamic", [x, _objects[handle], reduce_range], {}


OPS = (torch.ops.torchreplay.packed_linear.default, torch.ops.torchreplay.packed_lstm.default,
       torch.ops.torchreplay.packed_gru.default)
