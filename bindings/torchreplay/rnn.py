"""Recurrent modules (nn.LSTM, nn.GRU, nn.RNN) in traced graphs, kept to eager's bits.

aten::lstm, gru, rnn_tanh and rnn_relu are CompositeImplicitAutograd ops that a trace replaces
with PyTorch's Python decompositions. Those give eager's bits for a GRU or a plain RNN over one
row, not over several (eager's GRU cell squashes its gates in place on chunks of one tensor, the
decomposition on new ones, so the elementwise kernels split the elements between their vector
and scalar paths at other places; a batch-first RNN's input projection is another GEMM call),
and they make an LSTM two oneDNN calls that cost more than eager's one. So (Note [Recurrent
modules whole] in ir/eager_rnn.cc):

- torchreplay.capture keeps those ops whole (export_decompositions): the graph calls the aten op,
  whose C++ composite picks eager's kernels at run time; a GRU or RNN whose batch is a static 1
  decomposes (there the decomposition is eager's arithmetic, and replays as fused steps).
- torch.compile: Dynamo makes no graph of a frame that calls such a module unless its global
  switch allow_rnn is on. For frames a torchreplay backend compiles with grad disabled, the
  module is traced with the switch on for that module alone (patches.py, dynamo_traces), and the
  backend puts the same calls, where a decomposition would not be eager's, into the graph as
  torchreplay::eager_* ops (keep_whole), which AOTAutograd leaves opaque.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Dict, Optional

import torch
import torch.fx

from . import _C  # noqa: F401 (registers the torchreplay::eager_* ops)

aten = torch.ops.aten

# aten op -> its opaque torchreplay twin; the input overloads of gru, rnn_tanh and rnn_relu
# decompose where _decomposes says so.
_WHOLE = {
    aten.lstm.input: torch.ops.torchreplay.eager_lstm.input,
    aten.lstm.data: torch.ops.torchreplay.eager_lstm.data,
    aten.gru.input: torch.ops.torchreplay.eager_gru.input,
    aten.gru.data: torch.ops.torchreplay.eager_gru.data,
    aten.rnn_tanh.input: torch.ops.torchreplay.eager_rnn_tanh.input,
    aten.rnn_relu.input: torch.ops.torchreplay.eager_rnn_relu.input,
    aten.rnn_tanh.data: torch.ops.torchreplay.eager_rnn_tanh.data,
    aten.rnn_relu.data: torch.ops.torchreplay.eager_rnn_relu.data,
}
_VF_OPS = {"lstm": aten.lstm, "gru": aten.gru, "rnn_tanh": aten.rnn_tanh, "rnn_relu": aten.rnn_relu}


def _decomposes(op: Any, args: tuple) -> bool:
    """Whether PyTorch's decomposition of `op` on `args` (aten's arguments, fake or real) computes
    eager's bits: a GRU's or a plain RNN's over one row (a 3-d input whose batch is a static 1),
    an LSTM's or a packed sequence's never (see the module's docstring)."""
    if op not in (aten.gru.input, aten.rnn_tanh.input, aten.rnn_relu.input) or args[0].dim() != 3:
        return False
    batch = args[0].shape[0 if args[8] else 1]
    return isinstance(batch, int) and batch == 1


def export_decompositions(table: Dict[Any, Callable]) -> Dict[Any, Callable]:
    """`table` (export's decompositions) with the recurrent ops kept whole but where _decomposes:
    a decomposition that returns NotImplemented keeps the op in export's graph."""
    out = {op: fn for op, fn in table.items() if op not in _WHOLE}
    for op in (aten.gru.input, aten.rnn_tanh.input, aten.rnn_relu.input):
        if op in table:
            out[op] = functools.partial(_where_eager, op, table[op])
    return out


def _where_eager(op: Any, decomposition: Callable, *args: Any, **kwargs: Any) -> Any:
    return decomposition(*args, **kwargs) if not kwargs and _decomposes(op, args) else NotImplemented


def _aten_overload(fn: Any, args: tuple) -> Optional[Any]:
    """The aten overload a torch._VF recurrent call in a Dynamo graph is: `data` when its second
    argument is the packed sequence's batch_sizes (then its fourth, params, is a list)."""
    packet = next((p for name, p in _VF_OPS.items() if fn is getattr(torch._VF, name, None)), None)
    if packet is None or len(args) != 9:
        return None
    return packet.data if isinstance(args[3], (list, tuple)) else packet.input


def _needs_grad(node: torch.fx.Node) -> bool:
    value = node.meta.get("example_value")
    values = value if isinstance(value, (list, tuple)) else [value]
    return any(isinstance(v, torch.Tensor) and (v.requires_grad or v.device.type != "cpu") for v in values)


def keep_whole(gm: torch.fx.GraphModule) -> int:
    """Replaces the torch._VF recurrent calls of Dynamo's graph `gm` whose decomposition would not
    be eager's bits by their torchreplay::eager_* twins (opaque to AOTAutograd, eager's call at run
    time). Calls whose results need gradients or are not on the CPU stay (the twins have no
    autograd kernel). Returns how many were replaced."""
    replaced = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.kwargs:
            continue
        op = _aten_overload(node.target, node.args)
        if op is None or _needs_grad(node):
            continue
        example = [a.meta.get("example_value") if isinstance(a, torch.fx.Node) else a for a in node.args]
        if op in _WHOLE and not _decomposes(op, tuple(example)):
            node.target = _WHOLE[op]
            replaced += 1
    if replaced:
        gm.recompile()
    return replaced


def dynamo_traces(module: torch.nn.Module) -> Optional[str]:
    """None when Dynamo may trace the recurrent `module` for a torchreplay compile (allow_rnn on
    for it alone); else why not, for the log."""
    if torch.is_grad_enabled():
        return "grad is enabled (inference under torch.no_grad() or torch.inference_mode() is traced)"
    if module.training and module.dropout > 0:
        return "it applies dropout (training mode), whose random draws a replay would repeat"
    if any(p.device.type != "cpu" for p in module.parameters()):
        return "its parameters are not on the CPU"
    return None
