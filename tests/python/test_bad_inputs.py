"""The bad-input corpus: kinds of bad call, each through every entry point, answered with a clear
Python exception or a result equal to eager (a documented eager fallback, or the call is simply
fine) -- never a crash, a hang or a wrong answer.

Entry points:
  compile  torch.compile(model, backend=torchreplay.get_backend(compiler_config=cfg)), Dynamo first
  engine   the C++ engine called directly: _C.Engine on the graph make_fx traced (symbolic sizes
           and numbers; a module's parameters and buffers are static inputs read from it per call)
  capture  torchreplay.capture(model, example_args, config=cfg), no Dynamo

Each case builds the entry point, makes three good calls (warm-up, capture, replay), then the
kind's bad call, with the same calls made on an eager copy of the model as the reference, then
two more good calls (the entry point stays usable). The cases run in a worker subprocess, so a
crash or a hang is observed (and the worker restarted after the case), not fatal.

KINDS is the table, one line per kind: name, model, good arguments, the bad call (given the
callable and its model; it makes its own inputs, so the reference gets identical ones), and what
each entry point must do:
  EAGER        the result (outputs, plus whatever the bad call returns: mutated inputs,
               gradients) is bitwise equal to eager's, or, when eager raises, the same exception
  GRAPH        (engine only) equal to the traced graph run eagerly: what the raw engine is given
  COMPILED     equal to PyTorch's own compiled semantics, torch.compile(backend="aot_eager"), where
               eager refuses the call and functionalized graphs do not
  NotRun(why)  not run through this entry point, for the reason given
  Raises(T, s) an exception of type T whose message contains s
"""
from __future__ import annotations

import copy
import gc
import json
import math
import os
import queue
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import pytest
import torch
import torch.nn as nn

from differential import bitwise_diff

EAGER = "eager"
GRAPH = "graph"
COMPILED = "compiled"
ENTRIES = ("compile", "engine", "capture")
CASE_TIMEOUT_S = 120     # one case: builds, compiles and calls a tiny model (about 0.1 s)


@dataclass(frozen=True)
class Raises:
    types: Union[type, Tuple[type, ...]]
    fragment: str


@dataclass(frozen=True)
class NotRun:
    why: str


def R(types, fragment):  # noqa: N802 - short for the table
    return Raises(types, fragment)


# ------------------------------------------------------------------------------------ models

def f_xy(x, y):
    return torch.sin(x) * y + 1


def f_scale(x, s: float):
    return x * s + s


def f_int(x, n: int):
    return x * n + 1


def f_mut(x, y):
    x.add_(y)
    return y * 2


def f_index(x, idx):
    return x.index_select(0, idx) * 2


def f_one_hot(idx):
    return nn.functional.one_hot(idx, 5) * 2


def f_cholesky(a):
    return torch.linalg.cholesky(a) * 2


def f_inv(a):
    return torch.linalg.inv(a) * 2


def f_tensorinv(a):
    return torch.linalg.tensorinv(a, ind=1) * 2


def f_solve(a, b):
    return torch.linalg.solve(a, b) * 2


def spd(seed):
    a = t(seed, 4, 4)
    return a @ a.t() + 4 * torch.eye(4)


def f_mm(x, y):
    return torch.mm(x, y.t()) * 2


def f_cplx(z):
    return z * 2 + 1


def lin():
    return nn.Linear(3, 2).eval()


class Ema(nn.Module):
    """A buffer read by forward."""

    def __init__(self):
        super().__init__()
        self.register_buffer("avg", torch.randn(3))

    def forward(self, x):
        return x * self.avg + 1


def t(seed, *shape, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def xy(i=0):
    return (t(10 + i, 4, 3), t(20 + i, 4, 3))


# ------------------------------------------------------------------------------ bad calls

def thrice(call, *make):
    """Three calls with the same kind of arguments (the engine would capture and replay a plain
    key); outputs cloned, as a caller keeping them must."""
    from torch.utils import _pytree as pytree
    return [pytree.tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v,
                            call(*[f() for f in make])) for _ in range(3)]


def replace_weight(m):
    m.weight = nn.Parameter(t(7, *m.weight.shape), requires_grad=False)


def resize_linear(m):
    m.weight = nn.Parameter(t(7, 5, 3), requires_grad=False)
    m.bias = nn.Parameter(t(8, 5), requires_grad=False)


def swap_weight_data(m):
    m.weight.data = t(7, *m.weight.shape)


def resize_weight_data(m):
    m.weight.data = t(7, 5, 3)
    m.bias.data = t(8, 5)


def update_weight_in_place(m):
    with torch.no_grad():
        m.weight.add_(1)


def replace_buffer(m):
    m.avg = t(7, 3)


def stale_output(call, m):
    """An output kept across the next call, then passed back in."""
    first = call(t(1, 4, 3), t(2, 4, 3))
    call(t(3, 4, 3), t(4, 4, 3))
    return call(first[0] if isinstance(first, list) else first, t(5, 4, 3))


def fed_back(call, m):
    """The output of the previous call (a view of the pool) as the next input."""
    out = call(t(1, 4, 3), t(2, 4, 3))
    return call(out[0] if isinstance(out, list) else out, t(3, 4, 3))


def after_dynamo_reset(call, m):
    """Everything torchreplay built for the compile path dropped and collected, then called."""
    torch._dynamo.reset()
    gc.collect()
    return call(t(1, 4, 3), t(2, 4, 3))


def with_grad(call, m):
    """An input that requires grad under grad mode; returns the output and the input's grad."""
    x = t(1, 4, 3).requires_grad_()
    with torch.enable_grad():
        out = call(x, t(2, 4, 3))
        out = out[0] if isinstance(out, list) else out
        out.sum().backward()
    return out.detach(), x.grad


def internal_overlap(seed):
    return t(seed, 4).as_strided((4, 3), (1, 0))


def partial_overlap(call, m):
    base = t(1, 5, 3)
    return call(base[0:4], base[1:5]), base


def two_tensor(seed):
    from torch.testing._internal.two_tensor import TwoTensor
    return TwoTensor(t(seed, 4, 3), t(seed + 1, 4, 3))


def numpy_flipped(seed):
    return t(seed, 4, 3).numpy()[::-1]


def vmapped(call, m):
    y = t(2, 4, 3)
    return torch.vmap(lambda a: (lambda r: r[0] if isinstance(r, list) else r)(call(a, y)))(t(1, 2, 4, 3))


def quantized(seed):
    return torch.quantize_per_tensor(t(seed, 4, 3), 0.1, 0, torch.qint8)


def nested(seed, layout=torch.strided):
    return torch.nested.nested_tensor([t(seed + i, 3) for i in range(4)], layout=layout)


def set_mode(mode):
    def act(call, m):
        getattr(m, mode)()
        return call(t(1, 4, 3))
    return act


def then_call(change, seed_shape=(4, 3)):
    def act(call, m):
        change(m)
        return call(t(1, *seed_shape))
    return act


@dataclass
class Kind:
    name: str
    model: Callable[[], Any]
    good: Callable[[int], tuple]
    bad: Callable[[Callable, Any], Any]
    expect: Dict[str, Any]
    usable_after: bool = True   # good calls after the bad one must work and equal eager


def kinds() -> List[Kind]:
    # Over 80 lines: a table of bad inputs, one entry each.
    x = lambda s=1: t(s, 4, 3)  # noqa: E731
    one_x = lambda i: (t(10 + i, 4, 3),)  # noqa: E731
    all_eager = {e: EAGER for e in ENTRIES}
    K = Kind
    return [
        # ---- arity and keywords
        K("too_few_args", lambda: f_xy, xy, lambda c, m: c(x()),
          {"compile": EAGER, "engine": R(ValueError, "expected 2 inputs, got 1"),
           "capture": R(TypeError, "missing a required argument: 'y'")}),
        K("too_many_args", lambda: f_xy, xy, lambda c, m: c(x(), x(2), x(3)),
          {"compile": EAGER, "engine": R(ValueError, "expected 2 inputs, got 3"),
           "capture": R(TypeError, "too many positional arguments")}),
        K("unknown_keyword", lambda: f_xy, xy, lambda c, m: c(x(), x(2), z=1),
          {"compile": EAGER, "engine": R(TypeError, "incompatible function arguments"),
           "capture": R(TypeError, "got an unexpected keyword argument 'z'")}),
        # ---- not a tensor where a tensor was
        K("none_for_tensor", lambda: f_xy, xy, lambda c, m: c(None, x()),
          {"compile": EAGER, "engine": R(ValueError, "input 0 (x_1): expected a tensor, got None"),
           "capture": R(ValueError, "input 0 (x): expected a tensor, got None")}),
        K("string_for_tensor", lambda: f_xy, xy, lambda c, m: c("x", x()),
          {"compile": EAGER, "engine": R(ValueError, "expected a tensor, got String"),
           "capture": R(ValueError, "expected a tensor, got String")}),
        K("list_for_tensor", lambda: f_xy, xy, lambda c, m: c([[1.0, 2.0, 3.0]] * 4, x()),
          {"compile": EAGER, "engine": R(TypeError, "cannot use a constant of type list"),
           "capture": R(TypeError, "nested differently from the ones the model was captured with")}),
        K("negative_stride_numpy_array", lambda: f_xy, xy, lambda c, m: c(numpy_flipped(1), x()),
          {"compile": EAGER, "engine": R(TypeError, "cannot use a constant of type numpy.ndarray"),
           "capture": R(TypeError, "cannot use a constant of type numpy.ndarray")}),
        K("number_for_tensor", lambda: f_xy, xy, lambda c, m: c(2.0, x()),
          {"compile": EAGER, "engine": R(ValueError, "expected a tensor, got Double"),
           "capture": R(ValueError, "expected a tensor, got Double")}),
        # ---- scalars of the wrong kind or value
        K("tensor_for_float", lambda: f_scale, lambda i: (t(10 + i, 4, 3), 0.5),
          lambda c, m: c(x(), torch.tensor(0.5)),
          {"compile": EAGER, "engine": R(ValueError, "input 1 (s_1): expected a float, got Tensor"),
           "capture": R(ValueError, "argument 1 is Tensor, but the graph was captured with 0.5")}),
        K("float_for_int", lambda: f_int, lambda i: (t(10 + i, 4, 3), 3), lambda c, m: c(x(), 2.5),
          {"compile": EAGER, "engine": R(ValueError, "input 1 (n_1): expected an int, got Double"),
           "capture": R(ValueError, "argument 1 is 2.5, but the graph was captured with 3")}),
        K("int_for_float", lambda: f_scale, lambda i: (t(10 + i, 4, 3), 0.5), lambda c, m: c(x(), 2),
          {"compile": EAGER, "engine": GRAPH,   # make_fx specializes Python floats
           "capture": R(ValueError, "argument 1 is 2, but the graph was captured with 0.5")}),
        K("bool_for_int", lambda: f_int, lambda i: (t(10 + i, 4, 3), 3), lambda c, m: c(x(), True),
          {"compile": EAGER, "engine": R(ValueError, "expected an int, got Bool"),
           "capture": R(ValueError, "argument 1 is True, but the graph was captured with 3")}),
        K("int_beyond_64_bits", lambda: f_int, lambda i: (t(10 + i, 4, 3), 3), lambda c, m: c(x(), 2 ** 70),
          {"compile": EAGER, "engine": R(OverflowError, "does not fit in 64 bits"),
           "capture": R(OverflowError, "does not fit in 64 bits")}),
        K("nan_and_inf_values", lambda: f_xy, xy,
          lambda c, m: c(torch.tensor([[math.nan, math.inf, -math.inf]] * 4), x()), all_eager),
        # ---- dtype, device, rank
        K("wrong_dtype_float64", lambda: f_xy, xy, lambda c, m: c(x().double(), x(2)),
          {"compile": EAGER, "engine": R(ValueError, "input 0 (x_1): expected dtype Float, got Double"),
           "capture": R(ValueError, "input 0 (x): expected dtype Float, got Double")}),
        K("wrong_dtype_int64", lambda: f_xy, xy, lambda c, m: c(x().long(), x(2)),
          {"compile": EAGER, "engine": R(ValueError, "expected dtype Float, got Long"),
           "capture": R(ValueError, "expected dtype Float, got Long")}),
        K("wrong_dtype_bool", lambda: f_xy, xy, lambda c, m: c(x() > 0, x(2)),
          {"compile": EAGER, "engine": R(ValueError, "expected dtype Float, got Bool"),
           "capture": R(ValueError, "expected dtype Float, got Bool")}),
        K("model_converted_to_float64", lambda: lin(), one_x,
          lambda c, m: (m.double(), c(x().double()))[1],
          {"compile": EAGER, "engine": R(ValueError, "expected dtype Float, got Double"),
           "capture": R(ValueError, "expected dtype Float, got Double")}, usable_after=False),
        K("meta_device", lambda: f_xy, xy, lambda c, m: c(x().to("meta"), x(2).to("meta")),
          {"compile": EAGER, "engine": R(ValueError, "expected a cpu tensor, got one on meta"),
           "capture": R(ValueError, "expected a cpu tensor, got one on meta")}),
        K("rank_higher", lambda: f_xy, xy, lambda c, m: c(x()[None], x(2)),
          {"compile": EAGER, "engine": R(ValueError, "expected a 2-d tensor, got 3-d"),
           "capture": R(ValueError, "expected a 2-d tensor, got 3-d")}),
        K("rank_zero", lambda: f_xy, xy, lambda c, m: c(torch.tensor(1.5), x(2)),
          {"compile": EAGER, "engine": R(ValueError, "expected a 2-d tensor, got 0-d"),
           "capture": R(ValueError, "expected a 2-d tensor, got 0-d")}),
        # ---- sizes
        K("zero_size", lambda: f_xy, xy, lambda c, m: c(t(1, 0, 3), t(2, 0, 3)),
          {"compile": EAGER, "engine": EAGER,
           "capture": R(ValueError, "has size 0 in dim 0, but the graph was captured for size 4")}),
        K("huge_expanded_size", lambda: f_xy, xy,
          lambda c, m: c(t(1, 1, 3).expand(2 ** 40, 3), t(2, 1, 3)),
          {"compile": EAGER, "engine": EAGER,
           "capture": R(ValueError, "has size 1099511627776 in dim 0")}),
        K("size_product_overflows", lambda: f_xy, xy,
          lambda c, m: c(t(1, 1, 1).expand(2 ** 40, 2 ** 21), t(2, 1, 1)),
          {"compile": EAGER, "engine": EAGER, "capture": R(ValueError, "in dim 0")}),
        # ---- layouts and views
        K("non_contiguous_transposed", lambda: f_xy, xy, lambda c, m: c(t(1, 3, 4).t(), x(2)), all_eager),
        K("storage_offset_slice", lambda: f_xy, xy, lambda c, m: c(t(1, 6, 3)[2:], x(2)), all_eager),
        K("expanded_stride_0", lambda: f_xy, xy, lambda c, m: c(t(1, 1, 3).expand(4, 3), x(2)), all_eager),
        K("overlapping_view", lambda: f_xy, xy, lambda c, m: c(internal_overlap(1), x(2)), all_eager),
        K("expanded_input_written_in_place", lambda: f_mut, xy,
          lambda c, m: c(t(1, 1, 3).expand(4, 3), x(2)), all_eager),
        K("overlapping_input_written_in_place", lambda: f_mut, xy,
          lambda c, m: c(internal_overlap(1), x(2)), all_eager),
        K("inputs_partially_overlap_one_written", lambda: f_mut, xy, partial_overlap,
          {"compile": COMPILED, "engine": EAGER, "capture": R(ValueError, "shares memory with argument 1")}),
        K("same_tensor_twice", lambda: f_xy, xy, lambda c, m: (lambda a: c(a, a))(x()), all_eager),
        K("same_tensor_twice_one_written", lambda: f_mut, xy,
          lambda c, m: (lambda a: (c(a, a), a))(x()),   # capture: traced again for one tensor, which
          all_eager),                                       # export refuses: run eagerly, said once
        K("output_fed_back_as_input", lambda: f_xy, xy, fed_back, all_eager),
        K("stale_output_as_input", lambda: f_xy, xy, stale_output,
          {"compile": R(RuntimeError, "a later replay has reused its memory"),
           "engine": R(RuntimeError, "a later replay has reused its memory"),
           "capture": R(RuntimeError, "a later replay has reused its memory")}),
        K("conjugate_view_complex", lambda: f_cplx, lambda i: (t(10 + i, 4, 3, dtype=torch.complex64),),
          lambda c, m: thrice(c, lambda: t(1, 4, 3, dtype=torch.complex64).conj()), all_eager),
        K("negative_view", lambda: f_xy, xy, lambda c, m: thrice(c, lambda: x()._neg_view(), x),
          all_eager),
        # ---- tensors of other kinds (the engine runs calls with them eagerly, the reason in its stats)
        K("sparse_coo", lambda: f_xy, xy, lambda c, m: c(x().to_sparse(), x(2)), all_eager),
        K("sparse_coo_supported_op", lambda: f_mm, xy, lambda c, m: thrice(c, lambda: x().to_sparse(), x),
          all_eager),
        K("mkldnn", lambda: f_xy, xy, lambda c, m: c(x().to_mkldnn(), x(2)), all_eager),
        K("quantized", lambda: f_xy, xy, lambda c, m: c(quantized(1), x(2)),
          {"compile": EAGER, "engine": R(ValueError, "expected dtype Float, got QInt8"),
           "capture": R(ValueError, "expected dtype Float, got QInt8")}),
        K("nested_strided_layout", lambda: f_xy, xy, lambda c, m: c(nested(1), x(2)),
          {"compile": NotRun("Dynamo's guards abort the process on it (std::terminate in "
                             "sym_strides_custom), with backend='eager' too: PyTorch's, not ours"),
           "engine": EAGER, "capture": EAGER}),
        K("nested_jagged_layout", lambda: f_xy, xy, lambda c, m: c(nested(1, torch.jagged), x(2)),
          {"compile": R(Exception, "Constraints violated"),   # Dynamo's, with backend="eager" too
           "engine": EAGER,
           "capture": R(RuntimeError, "NestedTensor does not support directly calling torch.ops.aten.size")}),
        K("tensor_subclass", lambda: f_xy, xy, lambda c, m: thrice(c, lambda: two_tensor(1), x),
          all_eager),
        K("functorch_vmap_batched", lambda: f_xy, xy, vmapped, all_eager),
        # ---- the model changing under the capture
        K("parameter_replaced", lin, one_x, then_call(replace_weight),
          {"compile": EAGER, "engine": EAGER, "capture": R(ValueError, "replaced")}, usable_after=False),
        K("parameter_resized", lin, one_x, then_call(resize_linear),
          {"compile": EAGER, "engine": EAGER, "capture": R(ValueError, "replaced")}, usable_after=False),
        K("parameter_data_swapped", lin, one_x, then_call(swap_weight_data), all_eager),
        K("parameter_data_resized", lin, one_x, then_call(resize_weight_data), all_eager, usable_after=False),
        K("parameter_updated_in_place", lin, one_x, then_call(update_weight_in_place), all_eager),
        K("buffer_replaced", Ema, one_x, then_call(replace_buffer, (4, 3)),
          {"compile": EAGER, "engine": EAGER, "capture": R(ValueError, "replaced")}, usable_after=False),
        K("train_eval_flipped", lambda: nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.5)).eval(), one_x,
          lambda c, m: (m.train(), torch.manual_seed(0), c(t(1, 4, 3)))[2],
          {"compile": EAGER, "engine": GRAPH, "capture": R(ValueError, "captured in eval mode")},
          usable_after=False),
        # ---- autograd and lifetime
        K("requires_grad_flipped", lambda: f_xy, xy, with_grad,
          {"compile": EAGER, "engine": R(RuntimeError, "does not require grad"),
           "capture": R(ValueError, "argument 0 requires grad, but graph")}),
        K("index_out_of_range", lambda: f_index, lambda i: (t(10 + i, 5, 3), torch.tensor([i % 5, 1])),
          lambda c, m: c(t(1, 5, 3), torch.tensor([1, 9])),
          {"compile": R(IndexError, "index out of range in self"),
           "engine": R(IndexError, "out of range"),
           "capture": R(IndexError, "out of range")}),
        # ---- values eager's op refuses (their decompositions would go on): Note at export.py's _CHECKS_VALUES
        K("one_hot_class_out_of_range", lambda: f_one_hot, lambda i: (torch.tensor([i % 5, 1, 4]),),
          lambda c, m: c(torch.tensor([1, 7, 2])),
          {"compile": COMPILED, "engine": GRAPH,
           "capture": R(RuntimeError, "Class values must be smaller than num_classes")}),
        K("one_hot_negative_class", lambda: f_one_hot, lambda i: (torch.tensor([i % 5, 1, 4]),),
          lambda c, m: c(torch.tensor([1, -1, 2])),
          {"compile": COMPILED, "engine": GRAPH,
           "capture": R(RuntimeError, "Class values must be non-negative")}),
        K("cholesky_not_positive_definite", lambda: f_cholesky, lambda i: (spd(10 + i),),
          lambda c, m: c(-spd(1)),
          {"compile": COMPILED, "engine": GRAPH, "capture": R(torch.linalg.LinAlgError, "not positive-definite")}),
        K("inverse_of_a_singular_matrix", lambda: f_inv, lambda i: (spd(10 + i),),
          lambda c, m: c(torch.zeros(4, 4)),
          {"compile": COMPILED, "engine": GRAPH, "capture": R(torch.linalg.LinAlgError, "singular")}),
        K("tensorinv_of_a_singular_matrix", lambda: f_tensorinv, lambda i: (spd(10 + i),),
          lambda c, m: c(torch.zeros(4, 4)),
          {"compile": COMPILED, "engine": GRAPH, "capture": R(torch.linalg.LinAlgError, "singular")}),
        K("solve_with_a_singular_matrix", lambda: f_solve, lambda i: (spd(10 + i), t(20 + i, 4, 2)),
          lambda c, m: c(torch.zeros(4, 4), t(1, 4, 2)),
          {"compile": COMPILED, "engine": GRAPH, "capture": R(torch.linalg.LinAlgError, "singular")}),
        K("called_after_dynamo_reset_and_gc", lambda: f_xy, xy, after_dynamo_reset, all_eager),
    ]


# ------------------------------------------------------------------------- the worker side

def _config():
    import torchreplay
    cfg = torchreplay.CompilerConfig()
    cfg.mode = "reduce-overhead"
    return cfg


def _state(model):
    return [*model.parameters(), *model.buffers()]


def _build(entry: str, model: Any, example: tuple) -> Tuple[Callable, Optional[Callable]]:
    """(the entry point's callable, for the engine: the traced graph run eagerly)."""
    import torchreplay
    from torch.fx.experimental.proxy_tensor import make_fx
    from torchreplay import _C
    from torchreplay.lowering import lower

    if entry == "compile":
        return torch.compile(model, backend=torchreplay.get_backend(compiler_config=_config())), None
    if entry == "capture":
        return torchreplay.capture(model, example, config=_config()), None
    if isinstance(model, nn.Module):
        names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
        k = len(names)

        def flat(*a):
            return torch.func.functional_call(model, dict(zip(names, a[:k])), a[k:])

        state = _state(model)
        gm = make_fx(flat, tracing_mode="symbolic")(*state, *example)
        engine = _C.Engine(lower(gm, [*state, *example], list(range(k))))
        return ((lambda *a, **kw: engine.run([*_state(model), *a], **kw)),
                (lambda *a: gm(*_state(model), *a)))
    gm = make_fx(model, tracing_mode="symbolic")(*example)
    engine = _C.Engine(lower(gm, list(example), []))
    return (lambda *a, **kw: engine.run(list(a), **kw)), gm


def _outcome(fn: Callable[[], Any]) -> Tuple[str, Any]:
    try:
        return "ok", fn()
    except Exception as e:  # noqa: BLE001 - the outcome is what we compare
        return "raise", e


def _leaves(v: Any) -> List[Any]:
    from torch.utils import _pytree as pytree
    return pytree.tree_leaves(v)


def _same(a: Any, b: Any) -> Optional[str]:
    """None if a is eager's b bit for bit (differential.bitwise_diff), else why not."""
    la, lb = _leaves(a), _leaves(b)
    if len(la) != len(lb):
        return f"{len(la)} values against eager's {len(lb)}"
    for i, (p, q) in enumerate(zip(la, lb)):
        why = bitwise_diff(p, q, f"value {i}")
        if why is not None:
            return why
    return None


def _describe(o: Tuple[str, Any]) -> str:
    kind, v = o
    if kind == "raise":
        return f"raised {type(v).__name__}: {str(v).splitlines()[0][:300] if str(v) else ''}"
    return "returned " + ", ".join(
        f"{x.dtype}{tuple(x.shape)}" if isinstance(x, torch.Tensor) else repr(x) for x in _leaves(v))[:300]


def _judge(expect: Any, got: Tuple[str, Any], want: Tuple[str, Any]) -> Optional[str]:
    """None if `got` is what `expect` allows, else why not."""
    if isinstance(expect, Raises):
        if got[0] != "raise":
            return f"expected {expect}, but it {_describe(got)}"
        if not isinstance(got[1], expect.types) or expect.fragment.lower() not in str(got[1]).lower():
            return f"expected {expect}, but it {_describe(got)}"
        return None
    if want[0] == "raise":
        if got[0] == "raise" and isinstance(got[1], type(want[1])):
            return None
        return f"eager {_describe(want)}, but it {_describe(got)}"
    if got[0] == "raise":
        return f"eager {_describe(want)}, but it {_describe(got)}"
    why = _same(got[1], want[1])
    return None if why is None else f"wrong answer: {why}"


def run_case(kind: Kind, entry: str) -> Optional[str]:
    """None if the case passes, else what went wrong."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = kind.model()
    ref = copy.deepcopy(model) if isinstance(model, nn.Module) else model
    expect = kind.expect[entry]
    if isinstance(expect, NotRun):
        return None
    call, graph = _build(entry, model, kind.good(0))
    if expect == COMPILED:
        ref = torch.compile(ref, backend="aot_eager")
    for i in range(3):
        why = _same(call(*kind.good(i)), ref(*kind.good(i)))
        if why is not None:
            return f"good call {i} before the bad one: {why}"
    if expect == GRAPH:
        ref_model = copy.deepcopy(model)
        want = _outcome(lambda: kind.bad(graph, ref_model))
    else:
        want = _outcome(lambda: kind.bad(ref, ref))
    got = _outcome(lambda: kind.bad(call, model))
    why = _judge(expect, got, want)
    if why is not None:
        return why
    if kind.usable_after:
        for i in range(3, 5):
            o = _outcome(lambda: call(*kind.good(i)))
            if o[0] == "raise":
                return f"good call after the bad one {_describe(o)}"
            why = _same(o[1], ref(*kind.good(i)))
            if why is not None:
                return f"good call after the bad one: {why}"
    return None


def _worker(case_ids: List[str]) -> None:
    import warnings
    import torchreplay  # noqa: F401

    warnings.filterwarnings("ignore")
    torchreplay.set_log_level(3)
    table = {k.name: k for k in kinds()}
    out = sys.stdout
    for cid in case_ids:
        name, entry = cid.rsplit(":", 1)
        print("START " + cid, file=out, flush=True)
        try:
            with torch.no_grad():
                why = run_case(table[name], entry)
        except Exception:  # noqa: BLE001 - a failure of the case itself (e.g. the entry point did not build)
            why = "error: " + traceback.format_exc()[-1500:]
        print("RESULT " + json.dumps({"case": cid, "why": why}), file=out, flush=True)


# --------------------------------------------------------------------------- the test side

def run_cases(case_ids: List[str], timeout_s: float = CASE_TIMEOUT_S) -> Dict[str, Optional[str]]:
    """Runs the cases in worker subprocesses: case id -> None (passed) or what went wrong. A case
    that crashes the worker or runs past timeout_s is recorded as such; the next worker goes on
    after it."""
    import torchreplay
    env = dict(os.environ)
    paths = [os.path.dirname(os.path.dirname(torchreplay.__file__)), os.path.dirname(__file__)]
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")])
    results: Dict[str, Optional[str]] = {}
    todo = list(case_ids)
    while todo:
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", *todo],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        lines: "queue.Queue[Optional[str]]" = queue.Queue()
        err: List[str] = []
        threading.Thread(target=lambda: [lines.put(ln) for ln in proc.stdout] + [lines.put(None)],
                         daemon=True).start()
        threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True).start()
        current = None
        while True:
            try:
                line = lines.get(timeout=timeout_s)
            except queue.Empty:
                proc.kill()
                results[current or todo[0]] = f"hang: no result after {timeout_s} s"
                break
            if line is None:   # the worker ended
                proc.wait()
                if current is not None:
                    time.sleep(0.2)
                    tail = "".join(err)[-1500:]
                    results[current] = f"crash: worker exited with {proc.returncode}: {tail}"
                break
            if line.startswith("START "):
                current = line[6:].strip()
            elif line.startswith("RESULT "):
                r = json.loads(line[7:])
                results[r["case"]] = r["why"]
                current = None
        proc.stdout.close()
        proc.stderr.close()
        todo = [c for c in todo if c not in results]
    return results


KIND_NAMES = [k.name for k in kinds()]


@pytest.fixture(scope="module")
def results():
    return run_cases([f"{k}:{e}" for k in KIND_NAMES for e in ENTRIES])


def test_corpus_has_at_least_30_kinds():
    assert len(KIND_NAMES) >= 30 and len(set(KIND_NAMES)) == len(KIND_NAMES)


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_bad_input(kind, results):
    failed = {e: results[f"{kind}:{e}"] for e in ENTRIES if results[f"{kind}:{e}"] is not None}
    assert failed == {}, "\n".join(f"{e}: {why}" for e, why in failed.items())


def test_runner_observes_a_crash_and_goes_on():
    """The harness itself: a worker that dies mid-case is reported as a crash, and the cases after
    it still run."""
    r = run_cases(["__crash__:engine", "too_few_args:engine"])
    assert r["__crash__:engine"] is not None and r["__crash__:engine"].startswith("crash"), r
    assert r["too_few_args:engine"] is None, r


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    if "__crash__:engine" in sys.argv[2:3]:
        print("START __crash__:engine", flush=True)
        os.abort()
    _worker(sys.argv[2:])
elif __name__ == "__main__":   # the table by hand: python tests/python/test_bad_inputs.py [kind ...]
    names = sys.argv[1:] or KIND_NAMES
    res = run_cases([f"{k}:{e}" for k in names for e in ENTRIES])
    table = {k.name: k for k in kinds()}
    for k in names:
        for e in ENTRIES:
            why = res[f"{k}:{e}"]
            status = "not run" if isinstance(table[k].expect[e], NotRun) else "ok" if why is None else "FAIL: " + why.splitlines()[0][:300]
            print(f"{k:40s} {e:8s} {status}")
    bad = sum(w is not None for w in res.values())
    not_run = sum(isinstance(table[k].expect[e], NotRun) for k in names for e in ENTRIES)
    print(f"{len(names)} kinds, {len(res)} cases ({not_run} not run, see NotRun), "
          f"{len(res) - bad - not_run} passed, {bad} failed")
