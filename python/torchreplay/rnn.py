"""Recurrent modules (nn.LSTM, nn.GRU, nn.RNN) in traced graphs, kept to eager's bits.

aten::lstm, gru, rnn_tanh and rnn_relu are CompositeImplicitAutograd ops that a trace replaces
with PyTorch's Python decompositions. Those give eager's bits for a GRU or a plain RNN over one
row, not over several (eager's GRU cell squashes its gates in place on chunks of one tensor, the
decomposition on new ones, so the elementwise kernels split the elements between their vector
and scalar paths at other places; a batch-first RNN's input projection is another GEMM call),
and they make an LSTM two oneDNN calls that cost more than eager's one. So (Note [Recurrent
modules whole] in capture/ir/eager_rnn.cc):

- torchreplay.capture keeps those ops whole as torchreplay::eager_* ops (whole_in_trace while
  export traces, export_decompositions after): at run time the aten op, whose C++ composite picks
  eager's kernels; a GRU or RNN over one row decomposes (there the decomposition is eager's
  arithmetic, and replays as fused steps).
- torch.compile: Dynamo makes no graph of a frame that calls such a module unless its global
  switch allow_rnn is on. For frames a torchreplay backend compiles with grad disabled, the
  module is traced with the switch on for that module alone (patches.py, dynamo_traces), and the
  backend puts the same calls, where a decomposition would not be eager's, into the graph as
  torchreplay::eager_* ops (keep_whole), which AOTAutograd leaves opaque.
"""
from __future__ import annotations

import contextlib
import functools
import operator
from typing import Any, Callable, Dict, Iterator, Optional

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor

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


def _fake_output(input: torch.Tensor, hx: torch.Tensor, bidirectional: bool, batch_first: bool) -> torch.Tensor:
    """The sequence output of aten's RNN ops: [T, B, directions * hx's last size], made
    contiguous and then transposed for batch_first; a packed sequence's data [N, that size]."""
    width = (2 if bidirectional else 1) * hx.shape[-1]
    if input.dim() == 2:
        return input.new_empty((input.shape[0], width))
    out = input.new_empty((input.shape[1], input.shape[0], width) if batch_first else
                          (input.shape[0], input.shape[1], width))
    return out.transpose(0, 1) if batch_first else out


def _register_fakes() -> None:
    """Sizes and strides of the torchreplay::eager_* ops under a trace (symbolic sizes too), as
    the CPU run gives them (the kernels are eager's, capture/ir/eager_rnn.cc); and of numerics "close"'s
    torchreplay::gru_sequence."""
    def lstm_input(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first):
        return _fake_output(input, hx[0], bidirectional, batch_first), hx[0].new_empty(hx[0].shape), \
            hx[1].new_empty(hx[1].shape)

    def lstm_data(data, batch_sizes, hx, params, has_biases, num_layers, dropout, train, bidirectional):
        return _fake_output(data, hx[0], bidirectional, False), hx[0].new_empty(hx[0].shape), \
            hx[1].new_empty(hx[1].shape)

    def rnn_input(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first):
        return _fake_output(input, hx, bidirectional, batch_first), hx.new_empty(hx.shape)

    def rnn_data(data, batch_sizes, hx, params, has_biases, num_layers, dropout, train, bidirectional):
        return _fake_output(data, hx, bidirectional, False), hx.new_empty(hx.shape)

    torch.library.register_fake("torchreplay::eager_lstm.input")(lstm_input)
    torch.library.register_fake("torchreplay::eager_lstm.data")(lstm_data)
    for name in ("eager_gru", "eager_rnn_tanh", "eager_rnn_relu"):
        torch.library.register_fake(f"torchreplay::{name}.input")(rnn_input)
        torch.library.register_fake(f"torchreplay::{name}.data")(rnn_data)

    def gru_sequence(input, hx, w_ih_kn, b_ih, w_hh_kn, b_hh, batch_first):  # capture/kernels/recurrent_op.cc
        return _fake_output(input, hx, False, batch_first), hx.new_empty(hx.shape)

    torch.library.register_fake("torchreplay::gru_sequence")(gru_sequence)


_register_fakes()


def _decomposes(op: Any, args: tuple, close: bool = False) -> bool:
    """Whether PyTorch's decomposition of `op` on `args` (aten's arguments, fake or real) computes
    eager's bits: a GRU's or a plain RNN's over one row (a contiguous 3-d input whose batch is a
    static 1, a contiguous state), without dropout drawn (the decomposition never applies it) and outside autocast;
    an LSTM's or a packed sequence's never (see the module's docstring). With `close` (numerics
    "close", Note [Close numerics]): every call decomposes but a GRU the rewrite runs as
    torchreplay::gru_sequence (fused_gru)."""
    if close:
        return not fused_gru(op, args)
    if op not in (aten.gru.input, aten.rnn_tanh.input, aten.rnn_relu.input):
        return False
    input, hx, dropout, train, batch_first = args[0], args[1], args[5], args[6], args[8]
    if input.dim() != 3 or not input.is_contiguous() or not hx.is_contiguous() or (train and dropout > 0) \
            or torch._C._is_any_autocast_enabled():
        return False
    batch = input.shape[0 if batch_first else 1]
    return isinstance(batch, int) and batch == 1


def fused_gru(op: Any, args: tuple) -> bool:
    """Whether numerics "close" runs this recurrent call as torchreplay::gru_sequence, one call a
    layer (Note [GRU steps] in capture/kernels/recurrent.h): a float32 CPU GRU over a 3-d input, one
    direction, no dropout drawn, outside autocast, on a CPU with AVX2 and FMA."""
    if op is not aten.gru.input or len(args) != 9:
        return False
    input, hx, dropout, train, bidirectional = args[0], args[1], args[5], args[6], args[7]
    from .close_numerics.kernels import small_gemm_available  # (the op runs where the small GEMM does)
    return input.dim() == 3 and input.dtype == torch.float32 and hx.dtype == torch.float32 and \
        input.device.type == "cpu" and not bidirectional and not (train and dropout > 0) and \
        not torch._C._is_any_autocast_enabled() and small_gemm_available()


def export_decompositions(table: Dict[Any, Callable], close: bool = False) -> Dict[Any, Callable]:
    """`table` (export's decompositions) with each recurrent op decomposed where _decomposes,
    else into its torchreplay::eager_* twin (whose sizes under the trace are the op's)."""
    out = {op: fn for op, fn in table.items() if op not in _WHOLE}
    for op, twin in _WHOLE.items():
        out[op] = functools.partial(_where_eager, op, table.get(op), twin, close)
    return out


def _where_eager(op: Any, decomposition: Optional[Callable], twin: Any, close: bool, *args: Any, **kwargs: Any) -> Any:
    if decomposition is not None and not kwargs and len(args) == 9 and _decomposes(op, args, close):
        return _states_as_given(args, decomposition(*args, **kwargs))
    return twin(*args, **kwargs)


def _states_as_given(args: tuple, out: Any) -> Any:
    """The decomposition's results with its final states shaped as the op gives them, those of the
    initial states it was given: PyTorch's decomposition of a multi-layer LSTM returns (layers, 1,
    batch, hidden) states where aten.lstm returns (layers, batch, hidden)."""
    given = args[1] if isinstance(args[1], (list, tuple)) else [args[1]]
    if not isinstance(out, (list, tuple)) or len(out) != len(given) + 1 or \
            not all(isinstance(h, torch.Tensor) for h in given):
        return out
    states = [s if s.shape == h.shape else s.reshape(h.shape) for s, h in zip(out[1:], given)]
    return type(out)([out[0], *states])


def _overload(packet: Any, args: tuple) -> Optional[Any]:
    """Which overload of the aten op `packet` a torch._VF call with `args` is: `data` when its
    second argument is a packed sequence's batch_sizes (then its fourth, params, is a list)."""
    if len(args) != 9:
        return None
    return packet.data if isinstance(args[3], (list, tuple)) else packet.input


def _aten_overload(fn: Any, args: tuple) -> Optional[Any]:
    """The aten overload a torch._VF recurrent call in a Dynamo graph is."""
    packet = next((p for name, p in _VF_OPS.items() if fn is getattr(torch._VF, name, None)), None)
    return None if packet is None else _overload(packet, args)


class _VFInTrace:
    """torch._VF as nn.RNN's modules see it while torch.export traces (whole_in_trace): the
    recurrent calls on fake tensors become their torchreplay::eager_* twins where _decomposes says
    no, so that the trace computes the op's sizes (PyTorch's Python decomposition of an LSTM gives
    states of other sizes, which the module's next call refuses)."""

    def __init__(self, vf: Any, close: bool) -> None:
        self._vf, self._close = vf, close

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._vf, name)
        packet = _VF_OPS.get(name)
        if packet is None:
            return fn

        def call(*args: Any) -> Any:
            op = _overload(packet, args)
            if op is None or not isinstance(args[0], FakeTensor) or _decomposes(op, args, self._close):
                return fn(*args)
            return _WHOLE[op](*args)
        return call


@contextlib.contextmanager
def whole_in_trace(close: bool = False) -> Iterator[None]:
    """While torch.export traces a model for torchreplay.capture (one trace at a time in the
    process, export.py): nn.RNN, nn.GRU and nn.LSTM call torchreplay's twins (_VFInTrace), where
    _decomposes(..., close) says no."""
    from torch.nn.modules import rnn as modules
    original = modules._VF
    modules._VF = _VFInTrace(original, close)
    try:
        yield
    finally:
        modules._VF = original


def keep_whole(gm: torch.fx.GraphModule) -> Optional[str]:
    """Replaces the torch._VF recurrent calls of Dynamo's graph `gm` whose decomposition would not
    be eager's bits by their torchreplay::eager_* twins (opaque to AOTAutograd, eager's call at
    run time). None when every recurrent call is a twin or decomposes as eager computes; else why
    the graph must run eagerly (Dynamo's graph run as it is calls torch._VF as eager does): a call
    whose results need gradients (the twins have no autograd kernel, and PyTorch's decomposition
    of an LSTM gives its states other sizes), inside an autocast region of the graph (the twins do
    not cast), or not on the CPU."""
    autocast = any(n.op == "call_function" and n.target is torch.amp._enter_autocast for n in gm.graph.nodes)
    replaced = 0
    for node in gm.graph.nodes:
        op = _aten_overload(node.target, node.args) if node.op == "call_function" and not node.kwargs else None
        if op is None:
            continue
        value = node.meta.get("example_value")
        values = value if isinstance(value, (list, tuple)) else [value]
        if any(isinstance(v, torch.Tensor) and (v.requires_grad or v.device.type != "cpu") for v in values) \
                or autocast:
            return (f"its {op.overloadpacket.__name__} call needs gradients, runs under autocast or not on the "
                    "CPU, where torchreplay cannot keep it eager's bits")
        example = [a.meta.get("example_value") if isinstance(a, torch.fx.Node) else a for a in node.args]
        if not _decomposes(op, tuple(example)):
            node.target = _WHOLE[op]
            replaced += 1
    if replaced:
        gm.recompile()
    return None


def whole_only(gm: torch.fx.GraphModule) -> Optional[str]:
    """The recurrent op's name when keep_whole left Dynamo's graph `gm` nothing to compute but
    twins (and getitems of their results); else None. A replay of such a graph is eager's one call
    (an LSTM's through oneDNN's layers on weights reordered once where the capture's check takes
    them, Note [Checked LSTMs]) with nothing saved around it, so the compiled call can cost
    Dynamo's frame more than eager's Python."""
    twins = set(_WHOLE.values())
    names = set()
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in twins:
            names.add(node.target._schema.name.split("::")[1][len("eager_"):])
        elif node.target is not operator.getitem:
            return None
    return " and ".join(sorted(names)) or None


def dynamo_traces(module: torch.nn.Module) -> Optional[str]:
    """None when Dynamo may trace the recurrent `module` for a torchreplay compile (allow_rnn on
    for it alone); else why not, for the log."""
    if torch.is_grad_enabled():
        return "grad is enabled (inference under torch.no_grad() or torch.inference_mode() is traced)"
    if torch._C._is_any_autocast_enabled():
        return "autocast is on"
    if module.training and module.dropout > 0:
        return "it applies dropout (training mode), whose random draws a replay would repeat"
    if any(p.device.type != "cpu" for p in module.parameters()):
        return "its parameters are not on the CPU"
    return None
