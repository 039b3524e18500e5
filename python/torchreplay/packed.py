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
_on_setattr). quantize_dynamic's LSTMs and GRUs are traced the same way, through both entry points:
their forward (rnn_forward; in capture the module stands aside for _PackedRNN, in Dynamo's frames
the patched forward calls it) is torchreplay::packed_lstm / packed_gru on the handle of the list of
its layers' packed cells (CellParamsBase objects), lowered to aten's quantized_lstm /
quantized_gru on that list: eager's op on eager's cells. Their handle is dropped when the cells
are replaced (set_weight_bias, a cell's `param` set: patches.py), so Dynamo's guard on it fails
and the next call compiles with the new ones. A .trp file holds each cell as its state (its
biases, its two packed Linears unpacked) and makes it again on load (torchreplay/format_packed.h).
Not over packed sequences (refused in capture; Dynamo runs the module eagerly). Modules with
hooks, another dtype, or convert's static modules stay unsupported and are refused by name
(export._refuse_packed_weights).
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
from torch.ao.nn.quantized.dynamic.modules.rnn import PackedParameter
from torch.ao.nn.quantized.dynamic.modules.rnn import RNNBase as QuantizedRNNBase

OP = "torchreplay::packed_linear"
RNNS = (QuantizedLSTM, QuantizedGRU)
_objects: Dict[int, Any] = {}   # handle -> packed object (or cells), while its module holds it
_owners: Dict[int, Any] = {}    # handle -> weak reference to that module


def register(params: torch.nn.Module, obj: Any) -> int:
    """A new handle for `obj`, the packed object `params` (a LinearPackedParams, or an LSTM's or
    GRU's list of cells) now holds, kept in params' `_torchreplay_handle` (its previous handle
    dropped) and in _objects while params lives. Random, not counted: a module copied or unpickled
    carries its original's handle, which must never be another live module's (Dynamo's guard
    compares the number)."""
    drop_handle(params)
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


def drop_handle(m: torch.nn.Module) -> None:
    """`m`'s packed objects are being replaced: its handle dropped (a guard on it fails, and the
    next trace makes a new one), and forgotten unless it is a copy's original's."""
    handle = m.__dict__.pop("_torchreplay_handle", None)
    if handle is not None and _owners.get(handle, lambda: None)() is m:
        _forget(handle)


def cells_changed(changed: torch.nn.Module) -> None:
    """`changed` (a quantize_dynamic LSTM or GRU, its list of cells, or one of its cells, a
    PackedParameter) is given other cells: drop_handle for it and for every LSTM or GRU holding it."""
    if type(changed) in RNNS:
        drop_handle(changed)
    for owner in list(_owners.values()):
        m = owner()
        if type(m) in RNNS and "_all_weight_values" in m._modules:
            cells = m._modules["_all_weight_values"]
            if cells is changed or any(p is changed for p in cells):
                drop_handle(m)


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
    return torch.quantized_lstm(input, hx, _held(handle), has_biases, num_layers, dropout, train, bidirectional,
                                batch_first, dtype=dtype, use_dynamic=True)


@torch.library.impl("torchreplay::packed_gru", "cpu")
def _packed_gru_cpu(input, hx, handle, has_biases, num_layers, dropout, train, bidirectional, batch_first):
    return torch.quantized_gru(input, hx, _held(handle), has_biases, num_layers, dropout, train, bidirectional,
                               batch_first)


def rnn_standing_in(m: torch.nn.Module) -> bool:
    """Whether `m` is a quantize_dynamic LSTM or GRU traced as torchreplay::packed_lstm / packed_gru."""
    return type(m) in RNNS and not (m._forward_hooks or m._forward_pre_hooks)


def rnn_forward(m: torch.nn.Module, input: Any, hx: Any, handle: int) -> Any:
    """A quantize_dynamic LSTM's or GRU's forward (its forward_tensor and forward_impl), its
    torch.quantized_lstm / quantized_gru call torchreplay::packed_lstm / packed_gru on the handle
    of its cells. One code for both entry points: torchreplay.capture's _PackedRNN and the forward
    Dynamo traces for torchreplay's backend (patches.py _trace_packed_modules_for_torchreplay)."""
    if not isinstance(input, torch.Tensor):
        raise NotImplementedError(f"torchreplay: a quantize_dynamic {m.mode} over a packed sequence cannot be traced; "
                                  "pass padded tensors, or run the model eagerly")
    lstm = type(m) is QuantizedLSTM
    if hx is None:
        zeros = torch.zeros(m.num_layers * (2 if m.bidirectional else 1), input.size(0 if m.batch_first else 1),
                            m.hidden_size, dtype=input.dtype, device=input.device)
        hx = (zeros, zeros) if lstm else zeros
    m.check_forward_args(input, hx, None)
    rest = (m.bias, m.num_layers, float(m.dropout), m.training, m.bidirectional, m.batch_first)
    if lstm:
        output, h, c = torch.ops.torchreplay.packed_lstm(input, list(hx), handle, *rest, m.dtype)
        return output, (h, c)
    output, h = torch.ops.torchreplay.packed_gru(input, hx, handle, *rest)
    return output, h


class _PackedRNN(torch.nn.Module):
    """A quantize_dynamic LSTM or GRU as torch.export traces it (rnn_forward on its cells' handle)."""

    def __init__(self, m: torch.nn.Module) -> None:
        super().__init__()
        self.__dict__["rnn"] = m   # not a submodule: export would meet its packed cells
        self.handle = cells_handle(m)

    def forward(self, input: Any, hx: Any = None) -> Any:
        return rnn_forward(self.rnn, input, hx, self.handle)


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
                elif rnn_standing_in(child):
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
