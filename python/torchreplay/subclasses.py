"""Tensor subclasses that AOTAutograd and torch.export trace through (torchao's quantized
weights): the plain tensors one holds, as both flatten it."""
from __future__ import annotations

from typing import List, Tuple

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


def inner_tensors(t: torch.Tensor) -> List[Tuple[Tuple[str, ...], torch.Tensor]]:
    """The plain tensors `t` holds, each with its attribute path from `t`, in the order
    __tensor_flatten__ gives them, depth first: the order of the graph's inputs for `t`."""
    out: List[Tuple[Tuple[str, ...], torch.Tensor]] = []

    def walk(x: torch.Tensor, path: Tuple[str, ...]) -> None:
        for attr in x.__tensor_flatten__()[0]:
            inner = getattr(x, attr)
            if is_traceable_wrapper_subclass(inner):
                walk(inner, path + (attr,))
            else:
                out.append((path + (attr,), inner))
    walk(t, ())
    return out
