"""Eager's fast paths of nn.MultiheadAttention, nn.TransformerEncoderLayer and
nn.TransformerEncoder in torchreplay.capture's traces.

Note [Transformer fast paths]
In eval, with gradients off (or parameters that need none) and torch.backends.mha's fast path on,
eager runs these modules as one fused ATen op each: aten::_native_multi_head_attention and
aten::_transformer_encoder_layer_fwd, whose bits differ from the op-by-op "slow path" in the last
places (4.8e-7 on an encoder layer of width 32). Their forwards take the slow path whenever an
argument "has a torch function" or make_fx/export traces, which holds for every trace: a capture
would record the slow path, another program than eager's. While torch.export traces a model for
torchreplay.capture (one trace at a time, export.py), those checks, asked from these modules'
forwards alone, answer as eager would for the tensors they stand for: fake and functional tensors
count as the plain tensors they trace, and tracing itself is not a reason. The graph then holds
eager's fused op, which the engine runs as eager does (its kernel, eager's bits).

nn.TransformerEncoder in eval given a src_key_padding_mask (and no src mask, gradients off) goes
further in eager: when the mask is left-aligned (a property of its values, asked on every call),
it runs its layers on a nested tensor and pads the result with zeros, which no graph can hold.
Where eager's other checks pass, such a trace is refused with what to do (enable_nested_tensor=
False keeps every layer's fused op, in a graph), whatever the example mask's alignment. torch.compile's
Dynamo traces the slow path for every backend (backend="eager" too); its graphs compute that.
"""
from __future__ import annotations

import contextlib
import sys
import threading
from typing import Any, Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.nn.modules import activation, transformer

# the types that stand for plain tensors under export's trace
_PLAIN = (torch.Tensor, torch.nn.Parameter, torch.nn.Buffer, FakeTensor, FunctionalTensor)


def _from_forwards() -> bool:
    """Whether the caller's caller is one of the three forwards (whose checks are asked), in the
    thread that traces (another thread's eager call is answered as before)."""
    return threading.get_ident() == _tracing_thread and sys._getframe(2).f_code in _FORWARDS


_tracing_thread = None


_FORWARDS = {activation.MultiheadAttention.forward.__code__,
             transformer.TransformerEncoderLayer.forward.__code__,
             transformer.TransformerEncoder.forward.__code__}


class NestedEncoder(NotImplementedError):
    """A trace of nn.TransformerEncoder where eager would run nested tensors."""

    def __init__(self) -> None:
        super().__init__(
            "torchreplay.capture: nn.TransformerEncoder in eval with a src_key_padding_mask runs its layers on a "
            "nested tensor in eager (when the mask is left-aligned, a property of its values) and gives zeros at "
            "the padded positions, which a graph cannot compute as eager does; build it with "
            "enable_nested_tensor=False (each layer's fused op is kept, eager's bits), or call it eagerly. "
            "Note [Transformer fast paths] in fast_paths.py")


@contextlib.contextmanager
def eager_fast_paths() -> Iterator[None]:
    """Note [Transformer fast paths]: while torch.export traces for torchreplay.capture."""
    global _tracing_thread
    _tracing_thread = threading.get_ident()
    has_torch_function = torch.overrides.has_torch_function
    is_compiling = torch.compiler.is_compiling
    make_fx_tracing = activation._is_make_fx_tracing
    left_aligned, from_mask = torch._nested_tensor_from_mask_left_aligned, torch._nested_tensor_from_mask

    def has_torch_function_as_eager(args: Any) -> bool:
        if _from_forwards():
            return any(a is not None and type(a) not in _PLAIN for a in args) and has_torch_function(args)
        return has_torch_function(args)

    def is_compiling_as_eager() -> bool:
        return False if _from_forwards() else is_compiling()

    def left_aligned_as_any(*args: Any, **kwargs: Any) -> Any:
        # a property of the mask's values, which a trace does not hold: taken as left-aligned,
        # so that the refusal below comes where eager would nest such a mask, after its other checks
        return True if _from_forwards() else left_aligned(*args, **kwargs)

    def nested(*args: Any, **kwargs: Any) -> Any:
        if _from_forwards():
            raise NestedEncoder()
        return from_mask(*args, **kwargs)

    torch.overrides.has_torch_function = has_torch_function_as_eager
    torch.compiler.is_compiling = is_compiling_as_eager
    activation._is_make_fx_tracing = lambda: False  # called from MultiheadAttention.forward alone
    torch._nested_tensor_from_mask_left_aligned = left_aligned_as_any
    torch._nested_tensor_from_mask = nested
    try:
        yield
    finally:
        torch.overrides.has_torch_function = has_torch_function
        torch.compiler.is_compiling = is_compiling
        activation._is_make_fx_tracing = make_fx_tracing
        torch._nested_tensor_from_mask_left_aligned, torch._nested_tensor_from_mask = left_aligned, from_mask
        _tracing_thread = None


@torch.library.register_fake("aten::_transformer_encoder_layer_fwd")
def _encoder_layer_sizes(src: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """The sizes of the fused encoder layer under a trace with symbolic sizes (PyTorch registers
    none; fake tensors run the CPU kernel on static ones): a new contiguous tensor of src's."""
    return src.new_empty(src.shape)
