"""Note [Close numerics]'s layouts: channels-last results made contiguous where an op could see
the layout, and eager's layout at the outputs."""
from __future__ import annotations

import torch
import torch.fx

from ..fx_views import is_view
from .kernels import STRIDE_SENSITIVE, eager_channels_last
from .state import Rewrite

aten = torch.ops.aten


def restore_layouts(r: Rewrite) -> None:
    """Makes what may be channels-last (rewrite_convolutions marked it) contiguous where an op
    could see the layout: once, right after it, for every view of it and the outputs, so that
    outputs that are views of one result lie and share memory as eager's do (convolutions and
    elementwise ops go on reading it as it lies). At the outputs, each result takes eager's
    layout (channels-last where eager's is, from a channels-last input)."""
    for a in list(r.graph.nodes):
        if a not in r.channels_last or not _layouts_differ(a):
            continue
        readers = [u for u in a.users if (u.op == "output" and not eager_channels_last(a)) or
                   (u.op == "call_function" and (u.target in STRIDE_SENSITIVE or _seen_as_eagers(r, u)))]
        if not readers:
            continue
        with r.graph.inserting_after(a):
            c = r.graph.call_function(aten.clone.default, (a,), {"memory_format": torch.contiguous_format})
        c.meta.update(a.meta)
        for u in readers:
            u.replace_input_with(a, c)
        r.counts["layout_copies"] += 1
        todo = [u for u in readers if u.op == "call_function"]
        while todo:  # views of the copy lie as eager's
            v = todo.pop()
            if v in r.channels_last and is_view(v):
                r.channels_last.discard(v)
                todo.extend(v.users)
    output = next(n for n in r.graph.nodes if n.op == "output")
    for a in list(output.all_input_nodes):
        if a in r.contiguous and eager_channels_last(a):
            with r.graph.inserting_before(output):
                c = r.graph.call_function(aten.clone.default, (a,), {"memory_format": torch.channels_last})
            output.replace_input_with(a, c)
            r.counts["layout_copies"] += 1


def _seen_as_eagers(r: Rewrite, view: torch.fx.Node) -> bool:
    """Whether `view` is a view of the model's graph (marked with its channels-last source, not
    one the rewrite made to feed its own kernels, such as a 1x1 convolution's permute) that an
    output or an op that reads strides (a `view`) reads, directly or through more such views."""
    if view not in r.channels_last or not is_view(view):
        return False
    for u in view.users:
        if u.op == "output" or (u.op == "call_function" and u.target in STRIDE_SENSITIVE):
            return True
        if u.op == "call_function" and _seen_as_eagers(r, u):
            return True
    return False


def _layouts_differ(node: torch.fx.Node) -> bool:
    """Whether a channels-last and a contiguous tensor of this node's sizes lie differently in
    memory (not when the spatial dims are all 1). Unknown sizes: assume they do."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return True
    return not all(isinstance(s, int) and s == 1 for s in val.shape[2:])
