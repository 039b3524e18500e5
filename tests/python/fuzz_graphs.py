"""Random ATen programs for differential testing: each program is built once as a C++ graph and
run eagerly op by op through torch.ops (the reference), with the same inputs.

A program's values are float32 tensors of shape (r, C), where r is a symbolic int input that
changes between calls; ops that change shape are paired so every value comes back to (r, C). C is
8, or for long-row programs thousands of columns (a row of at least 64k elements, or values of
between one and two of ATen's grains, GRAIN_SIZE: split over threads), where the products by the
(C, C) weight are left out.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Tuple

import torch

from differential import bitwise_diff
from torchreplay import _C

C = 8   # columns
K = 2   # rows touched by index ops; every r used is > K


@dataclass
class Program:
    builder_ops: List[Tuple[str, list, dict]] = field(default_factory=list)
    ops_used: set = field(default_factory=set)
    graph: Any = None
    eager: Callable = None  # inputs -> (outputs, inputs after the call)


class _Gen:
    """Emits each op to the C++ builder and records a closure for the eager reference."""

    def __init__(self, rng: random.Random, device: str = "cpu", cols: int = C):
        self.rng = rng
        self.C = cols  # columns
        self.b = _C.GraphBuilder()
        self.steps: List[Callable[[Dict[int, Any]], None]] = []
        self.ops_used: set = set()
        self.x = self.b.add_input("x", "Tensor", torch.float32, torch.device(device), 2)
        self.y = self.b.add_input("y", "Tensor", torch.float32, torch.device(device), 2)
        self.w = self.b.add_input("w", "Tensor", torch.float32, torch.device(device), 2)
        self.idx = self.b.add_input("idx", "Tensor", torch.int64, torch.device(device), 1)
        self.r = self.b.add_input("r", "int")
        self.pool = [self.x, self.y]   # (r, C) float values
        self.mutated_input = False

    # -- emission helpers
    def op(self, name: str, *args: Any, **kwargs: Any) -> int:
        outs = self.b.add_op(name, [self._tag(a) for a in args], {k: self._tag(v) for k, v in kwargs.items()})
        base, _, overload = name.partition(".")
        packet = getattr(getattr(torch.ops, base.split("::")[0]), base.split("::")[1])
        fn = getattr(packet, overload or "default")
        out_id = outs[0]
        self.ops_used.add(name)

        def step(env: Dict[int, Any], fn=fn, args=args, kwargs=kwargs, out_id=out_id) -> None:
            env[out_id] = fn(*[self._val(a, env) for a in args], **{k: self._val(v, env) for k, v in kwargs.items()})

        self.steps.append(step)
        return out_id

    def sym_mul(self, a: Any, c: int) -> int:
        out = self.b.add_sym("mul", [self._tag(a), ("c", c)], "")

        def step(env: Dict[int, Any], a=a, out=out) -> None:
            env[out] = self._val(a, env) * c

        self.steps.append(step)
        return out

    @staticmethod
    def _tag(a: Any) -> Any:
        if isinstance(a, _Ref):
            return ("v", a.id)
        if isinstance(a, list) and any(isinstance(e, _Ref) for e in a):
            return ("l", [_Gen._tag(e) for e in a])
        return ("c", a)

    @staticmethod
    def _val(a: Any, env: Dict[int, Any]) -> Any:
        if isinstance(a, _Ref):
            return env[a.id]
        if isinstance(a, list):
            return [_Gen._val(e, env) for e in a]
        return a

    def pick(self) -> "_Ref":
        return _Ref(self.rng.choice(self.pool))

    def add(self, v: int) -> None:
        self.pool.append(v)


@dataclass(frozen=True)
class _Ref:
    id: int


def _emit_random_op(g: _Gen) -> None:
    # Over 80 lines: one branch per op family the fuzzer draws from, side by side on purpose.
    rng = g.rng
    a, b = g.pick(), g.pick()
    R = _Ref
    cols = g.C
    choice = rng.randrange(37)
    if cols != C and choice in (11, 12, 13):  # no (C, C) weight for long rows
        choice = 36
    if choice == 0:
        g.add(g.op(rng.choice(["aten::relu", "aten::sigmoid", "aten::tanh", "aten::neg", "aten::abs"]), a))
    elif choice == 1:
        g.add(g.op(rng.choice(["aten::exp", "aten::sin", "aten::cos", "aten::sqrt", "aten::reciprocal", "aten::log"]), a))
    elif choice == 2:
        g.add(g.op("aten::add.Tensor", a, b, alpha=rng.choice([1, 2, -0.5])))
    elif choice == 3:
        g.add(g.op(rng.choice(["aten::sub.Tensor", "aten::mul.Tensor", "aten::div.Tensor",
                               "aten::maximum", "aten::minimum", "aten::atan2"]), a, b))
    elif choice == 4:
        g.add(g.op("aten::mul.Tensor", a, rng.choice([0.5, 3, -2.0])))
    elif choice == 5:
        g.add(g.op("aten::add.Scalar", a, rng.choice([1, 0.25]), alpha=2))
    elif choice == 6:
        g.add(g.op("aten::clamp", a, -0.5, 0.5))
    elif choice == 7:
        g.add(g.op("aten::pow.Tensor_Scalar", a, 2))
    elif choice == 8:   # reduction, broadcast back
        red = g.op(rng.choice(["aten::sum.dim_IntList", "aten::mean.dim", "aten::amax"]), a, [1], True)
        g.add(g.op("aten::sub.Tensor", b, R(red)))
    elif choice == 9:
        g.add(g.op(rng.choice(["aten::_softmax", "aten::_log_softmax"]), a, 1, False))
    elif choice == 10:
        g.add(g.op("aten::cumsum", a, 0))
    elif choice == 11:   # matmul with the static weight
        g.add(g.op("aten::mm", a, R(g.w)))
    elif choice == 12:
        g.add(g.op("aten::addmm", b, a, R(g.w), beta=1, alpha=0.5))
    elif choice == 13:   # a @ (a.t() @ b): views of per-call values
        t = g.op("aten::t", a)
        small = g.op("aten::mm", R(t), b)
        g.add(g.op("aten::mm", a, R(small)))
    elif choice == 14:   # view through a symbolic size and back
        n = g.sym_mul(R(g.r), cols)
        dense = g.op("aten::clone", a, memory_format=torch.contiguous_format)
        flat = g.op("aten::view", R(dense), [R(n)])
        g.add(g.op("aten::view", R(flat), [R(g.r), cols]))
    elif choice == 15:   # expand a column through the symbolic size
        col = g.op("aten::sum.dim_IntList", a, [1], True)
        g.add(g.op("aten::expand", R(col), [R(g.r), cols]))
    elif choice == 16:   # slices and cat
        h = rng.randrange(1, cols)
        left = g.op("aten::slice.Tensor", a, 1, 0, h)
        right = g.op("aten::slice.Tensor", b, 1, h, cols)
        g.add(g.op("aten::cat", [R(left), R(right)], 1))
    elif choice == 17:
        st = g.op("aten::stack", [a, b], 0)
        g.add(g.op("aten::sum.dim_IntList", R(st), [0]))
    elif choice == 18:   # transpose and back, contiguous copy in between
        tr = g.op("aten::transpose.int", a, 0, 1)
        cl = g.op("aten::clone", R(tr), memory_format=torch.contiguous_format)
        g.add(g.op("aten::transpose.int", R(cl), 0, 1))
    elif choice == 19:   # in-place on a fresh copy
        c = g.op("aten::clone", a)
        g.op(rng.choice(["aten::add_.Tensor", "aten::mul_.Tensor"]), R(c), b)
        g.op("aten::relu_", R(c))
        g.add(c)
    elif choice == 20:   # index_copy_ into a copy (a KV-cache write)
        c = g.op("aten::clone", a)
        rows = g.op("aten::index_select", b, 0, R(g.idx))
        g.op("aten::index_copy_", R(c), 0, R(g.idx), R(rows))
        g.add(c)
    elif choice == 21:   # index / index_put with an optional-tensor list
        rows = g.op("aten::index.Tensor", b, [R(g.idx)])
        g.add(g.op("aten::index_put", a, [R(g.idx)], R(rows), False))
    elif choice == 22:
        cond = g.op("aten::gt.Tensor", a, b)
        g.add(g.op("aten::where.self", R(cond), a, b))
    elif choice == 23:
        cond = g.op("aten::lt.Scalar", a, 0.0)
        g.add(g.op("aten::masked_fill.Scalar", b, R(cond), 1.5))
    elif choice == 24:
        g.add(g.op("aten::addcmul", a, b, g.pick(), value=0.5))
    elif choice == 25:
        g.add(g.op("aten::lerp.Scalar", a, b, 0.25))
    elif choice == 26:   # dtype round trip
        d = g.op("aten::_to_copy", a, dtype=torch.float64)
        d2 = g.op("aten::mul.Tensor", R(d), 1.0 / 3.0)
        g.add(g.op("aten::_to_copy", R(d2), dtype=torch.float32))
    elif choice == 27:   # unsqueeze / squeeze
        u = g.op("aten::unsqueeze", a, 0)
        s = g.op("aten::exp", R(u))
        g.add(g.op("aten::squeeze.dim", R(s), 0))
    elif choice == 28:   # select a row and broadcast it back
        row = g.op("aten::select.int", a, 0, 0)
        g.add(g.op("aten::add.Tensor", b, R(row)))
    elif choice == 30:   # a view of a value, next to the value: outputs may alias each other
        v = g.op("aten::view", a, [R(g.r), cols]) if a.id not in (g.x, g.y) else g.op("aten::alias", a)
        g.add(v)
    elif choice == 31:   # in-place through a view of an intermediate
        c = g.op("aten::clone", a)
        tr = g.op("aten::transpose.int", R(c), 0, 1)
        g.op(rng.choice(["aten::mul_.Tensor", "aten::sub_.Tensor"]), R(tr), 0.5 if rng.random() < 0.5 else 2)
        g.add(c)
    elif choice == 32:   # mixed dtypes: an int32 copy promoted back against a float
        i = g.op("aten::_to_copy", a, dtype=rng.choice([torch.int32, torch.int64]))
        g.add(g.op(rng.choice(["aten::mul.Tensor", "aten::add.Tensor"]), b, R(i)))
    elif choice == 33:   # a Python scalar computed from the symbolic size
        g.add(g.op(rng.choice(["aten::mul.Tensor", "aten::add.Tensor"]), a, R(g.sym_mul(R(g.r), 1))))
    elif choice == 34:   # float64 and float16 intermediates
        d = g.op("aten::_to_copy", a, dtype=rng.choice([torch.float64, torch.float16]))
        e = g.op(rng.choice(["aten::sin", "aten::relu", "aten::neg"]), R(d))
        g.add(g.op("aten::_to_copy", R(e), dtype=torch.float32))
    elif choice == 35:   # in-place on a slice of an input (a view of the caller's tensor)
        if not g.mutated_input:
            g.mutated_input = True
            h = rng.randrange(1, cols)
            part = g.op("aten::slice.Tensor", R(g.y), 1, 0, h)
            g.op("aten::mul_.Tensor", R(part), 0.5)
            g.add(g.op("aten::slice_scatter", R(g.y), R(part), 1, 0, h) if rng.random() < 0.5 else g.y)
        else:
            g.add(g.op("aten::sigmoid", a))
    elif choice == 36:   # a reduction to one element (ATen's two-pass one over long rows), broadcast back
        red = g.op(rng.choice(["aten::sum.dim_IntList", "aten::mean.dim"]), a, [0, 1], True)
        g.add(g.op("aten::sub.Tensor", b, R(red)))
    else:                 # mutate an input in place (the caller must see it)
        if not g.mutated_input:
            g.mutated_input = True
            g.op("aten::add_.Tensor", R(g.x), a if a.id != g.x else b, alpha=0.5)
        else:
            g.add(g.op("aten::tanh", a))


def make_program(seed: int, num_ops: int = 8, device: str = "cpu", cols: int = C) -> Program:
    rng = random.Random(seed)
    g = _Gen(rng, device, cols)
    for _ in range(num_ops):
        _emit_random_op(g)
    candidates = g.pool[2:] or g.pool
    outs = rng.sample(candidates, k=min(len(candidates), rng.randint(1, 3)))
    tagged = [("v", o) for o in outs]
    if rng.random() < 0.3:   # a view of an input as an output
        t = g.op("aten::t", _Ref(g.y))
        tagged.append(("v", t))
        outs.append(t)
    if rng.random() < 0.2:
        tagged.append(("c", None))
        outs.append(None)
    g.b.set_outputs(tagged)
    g.b.set_static_inputs([2])
    prog = Program(graph=g.b.build(), ops_used=g.ops_used)
    input_ids = [g.x, g.y, g.w, g.idx, g.r]
    steps = list(g.steps)

    def eager(inputs: List[Any]) -> List[Any]:
        env = dict(zip(input_ids, inputs))
        for s in steps:
            s(env)
        return [None if o is None else env[o] for o in outs]

    prog.eager = eager
    return prog


def make_inputs(rng: torch.Generator, r: int, w: torch.Tensor, device: str = "cpu", cols: int = C,
                permuted: bool = False) -> List[Any]:
    """The inputs of a call with r rows; `permuted`: x a transposed view (strides (1, r))."""
    x = torch.randn(cols, r, generator=rng).t() if permuted else torch.randn(r, cols, generator=rng)
    x = x.to(device)
    y = torch.randn(r, cols, generator=rng).to(device)
    idx = torch.randperm(r, generator=rng)[:K].to(device)
    return [x, y, w, idx, r]


def bitwise_equal(a: Any, b: Any) -> bool:
    """a is b bit for bit (differential.bitwise_diff: dtype, shape, strides, every element's bits)."""
    return bitwise_diff(a, b) is None
