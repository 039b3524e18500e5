"""Note [Packed quantized Linears]
torch.ao.quantization's quantize_dynamic makes each nn.Linear a
torch.ao.nn.quantized.dynamic.Linear, whose weights live packed in a TorchScript object
(LinearPackedParamsBase: fbgemm's or oneDNN's packed matrix) and whose forward is one op on it,
quantized::linear_dynamic (qint8: the activation's range found per call, an int8 GEMM) or
quantized::linear_dynamic_fp16. torch.export cannot trace such an object (it has no
__obj_flatten__), so while torchreplay.capture traces, each such module stands aside for
_PackedLinear, whose forward is torchreplay::packed_linear on an integer handle, with a fake
kernel for its shape; the trace keeps handle -> object (export._Program.packed), and lowering
(lowering.py) turns the op into eager's own op on eager's own packed object, a constant of the
graph. The op's CPU kernel (Python: it needs the objects) runs only while capture checks the
traced graph by running it (numerics "close", within `live`). A replay therefore runs the packed kernel eager runs,
on the same packed weights: eager's bits. The object is the module's: set_weight_bias (which
packs new weights into a new object) after a capture makes the capture's calls raise (patches.py
_on_setattr). Modules with hooks, another dtype, or quantized modules of other kinds (LSTM, GRU,
convert's static ones) stay unsupported and are refused by name (export._refuse_packed_weights).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Dict, Iterator, List, Tuple

import torch

OP = "torchreplay::packed_linear"
_live = threading.local()   # .objects: the handles' objects of the graph this thread's capture checks


@torch.library.register_fake(OP)
def _packed_linear_fake(x: torch.Tensor, handle: int, out_features: int, reduce_range: bool,
                        fp16: bool) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features), dtype=torch.float32)


@torch.library.impl(OP, "cpu")
def _packed_linear_cpu(x: torch.Tensor, handle: int, out_features: int, reduce_range: bool,
                       fp16: bool) -> torch.Tensor:
    obj = (getattr(_live, "objects", None) or {}).get(handle)
    if obj is None:
        raise RuntimeError(f"{OP} runs only while torchreplay.capture checks the graph it traced")
    if fp16:
        return torch.ops.quantized.linear_dynamic_fp16(x, obj)
    return torch.ops.quantized.linear_dynamic(x, obj, reduce_range)


@contextlib.contextmanager
def live(objects: Dict[int, Any]) -> Iterator[None]:
    """Within: this thread's runs of torchreplay::packed_linear use `objects`."""
    before = getattr(_live, "objects", None)
    _live.objects = objects
    try:
        yield
    finally:
        _live.objects = before


def _quantized_linear() -> Any:
    from torch.ao.nn.quantized.dynamic import Linear
    return Linear


def standing_in(m: torch.nn.Module) -> bool:
    """Whether `m` is a module _PackedLinear stands in for while tracing."""
    return (type(m) is _quantized_linear() and m._packed_params.dtype in (torch.qint8, torch.float16)
            and not (m._forward_hooks or m._forward_pre_hooks))


class _PackedLinear(torch.nn.Module):
    """A quantize_dynamic Linear as torch.export traces it: its forward (reduce_range as its
    version decides, the output in the input's dtype) on the handle of its packed object."""

    def __init__(self, m: torch.nn.Module, handle: int) -> None:
        super().__init__()
        self.handle, self.out_features = handle, m.out_features
        self.reduce_range = not (m.version is None or m.version < 4)
        self.fp16 = m._packed_params.dtype == torch.float16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.torchreplay.packed_linear(x, self.handle, self.out_features, self.reduce_range, self.fp16)
        return y.to(x.dtype)


@contextlib.contextmanager
def packed_as_ops(root: torch.nn.Module) -> Iterator[Dict[int, Any]]:
    """Within: every quantize_dynamic Linear under `root` replaced by its _PackedLinear (in its
    parent's _modules directly: no registration hook fires, nothing is kept); yields handle ->
    packed object. Put back on exit."""
    objects: Dict[int, Any] = {}
    swapped: List[Tuple[torch.nn.Module, str, torch.nn.Module]] = []
    try:
        for parent in list(root.modules()):
            for name, child in list(parent._modules.items()):
                if child is not None and standing_in(child):
                    objects[len(objects)] = child._packed_params._packed_params
                    parent._modules[name] = _PackedLinear(child, len(objects) - 1)
                    swapped.append((parent, name, child))
        yield objects
    finally:
        for parent, name, child in reversed(swapped):
            parent._modules[name] = child


def lowered(node: torch.fx.Node, objects: Dict[int, Any]) -> Tuple[str, List[Any]]:
    """The op and arguments a torchreplay::packed_linear node lowers to: eager's op on eager's
    packed object, a constant."""
    x, handle, _, reduce_range, fp16 = node.args
    if handle not in objects:
        raise ValueError(f"packed weights {handle} are not the traced module's")
    if fp16:
        return "quantized::linear_dynamic_fp16", [x, objects[handle]]
    return "quantized::linear_dynamic", [x, objects[handle], reduce_range]
