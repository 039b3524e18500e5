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
_on_setattr). Modules with hooks, another dtype, or quantized modules of other kinds (LSTM, GRU,
convert's static ones) stay unsupported and are refused by name (export._refuse_packed_weights).
"""
from __future__ import annotations

import contextlib
import secrets
import weakref
from typing import Any, Dict, Iterator, List, Tuple

import torch
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
        yield
    finally:
        for parent, name, child in reversed(swapped):
            parent._modules[name] = child


def lowered(node: torch.fx.Node) -> Tuple[str, List[Any]]:
    """The op and arguments a torchreplay::packed_linear node lowers to: eager's op on eager's
    packed object, a constant."""
    x, handle, _, reduce_range, fp16 = node.args
    if handle not in _objects:
        raise ValueError(f"no packed weights of handle {handle} (their module is gone)")
    if fp16:
        return "quantized::linear_dynamic_fp16", [x, _objects[handle]]
    return "quantized::linear_dynamic", [x, _objects[handle], reduce_range]
