"""Which nodes give each row of a padded batch the bits eager gives it (Note [Rows that stay
bitwise]): measured on this machine, per node, not read off the op's name.

Note [Rows that stay bitwise]
Padding a batch to a bucket changes how many rows each kernel is given, and some kernels give a
row other bits for another row count:
- elementwise kernels with separate vector and scalar code (ATen's Loops.h: the vector loop over
  whole vectors, the scalar op for the tail) send an element through one or the other depending
  on where the flattened length (or a thread's chunk) ends, and the two may round differently
  (sigmoid, silu, exp2) or treat NaN payloads and signs, -0.0, infinities and subnormals
  differently (maximum, hardswish on NaN, floor_divide of an infinity; in bfloat16 even add).
  Which ops do depends on the CPU's vector width and ATen's build, so it is measured:
  `elementwise_rows_bitwise` runs the node's op, with the node's own scalar arguments, dtypes and
  0-dim operands, over every combination of special values (NaNs of several payloads and both
  signs, signed zeros and infinities, subnormals, the edges of the normal range, ordinary and
  random numbers) once as one contiguous tensor whose length is a multiple of 64 (every element
  through the vector loop) and once in contiguous runs of 3 (every element through the scalar
  tail, or through the vector code's partial load where the kernel has one, as ATen's vml
  kernels do), and compares the bits;
- kernels along other dims (softmax along the last dim, sums, norms, pooling, eval batch norm)
  may split their work by the outer size and the thread count: `row_wise_rows_bitwise` runs the
  node on its own inner shape with 2..b-1 rows and on the same rows padded to each bucket b (as
  replay/buckets.cc pads: copies of the last row), special values mixed in, at the thread count
  of the compile, and compares the real rows' bits;
- integer and bool results are exact on every path, and data movement within one dtype (views,
  cat, index, embedding) copies bits: neither is measured. A conversion between dtypes is
  measured as an elementwise op;
- anything else read by a batched value (GEMMs, convolutions, attention) is not measured and
  counts as close: a BLAS's blocking by row count cannot be probed for every size it will see.
Results are cached per process by what decides them (op, dtypes, scalar arguments, shapes).
tests/python/test_capture_sizes.py checks that graphs follow the measurement, and measures it
independently (prefixes of many lengths) for every elementwise op the measurement passes.
"""
from __future__ import annotations

import functools
import math
import operator
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx
from torch.utils._python_dispatch import _disable_current_modes

aten = torch.ops.aten

ROWS_MOVED = {  # data movement: elements copied, bits kept when the dtype is kept
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.expand.default,
    aten.clone.default, aten._to_copy.default, aten.alias.default, aten.detach.default,
    aten.lift_fresh_copy.default, aten.permute.default, aten.squeeze.default, aten.squeeze.dim,
    aten.squeeze.dims, aten.unsqueeze.default, aten.transpose.int, aten.t.default, aten.copy.default,
    aten.copy_.default, aten.cat.default, aten.stack.default, aten.slice.Tensor, aten.select.int,
    aten.narrow.default, aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int,
    aten.index_select.default, aten.gather.default, aten.scatter.src, aten.scatter.value,
    aten.scatter_.src, aten.scatter_.value, aten.index_copy.default, aten.index_copy_.default,
    aten.index_put.default, aten.index_put_.default, aten.slice_scatter.default,
    aten.select_scatter.default, aten.embedding.default, aten.flip.default, aten.roll.default,
    aten.constant_pad_nd.default, operator.getitem, aten.empty.memory_format, aten.zeros.default,
    aten.ones.default, aten.full.default, aten.new_empty.default, aten.new_zeros.default,
    aten.new_ones.default, aten.new_full.default, torch.ops.torchreplay.to_float32.default,
}
CONVERTS = {aten._to_copy.default, aten.copy.default, aten.copy_.default,  # measured when the dtype changes
            torch.ops.torchreplay.to_float32.default}
_ELEMENTWISE = {aten.floor_divide.default, aten.leaky_relu.default, aten.hardswish.default}  # no pointwise tag
ROW_WISE = {  # along other dims: measured on the node's shape
    aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default, aten.max.dim,
    aten.min.dim, aten.argmax.default, aten.argmin.default, aten.var.correction, aten.std.correction,
    aten.var_mean.correction, aten.any.dim, aten.any.dims, aten.all.dim, aten.cumsum.default,
    aten.sort.default, aten.topk.default, aten.native_layer_norm.default,
    aten._native_batch_norm_legit_no_training.default, aten.avg_pool2d.default,
    aten.max_pool2d_with_indices.default, aten._adaptive_avg_pool2d.default, aten._softmax.default,
    aten._log_softmax.default, aten.softmax.int, aten.log_softmax.int,
}


def is_elementwise(target: Any) -> bool:
    return target in _ELEMENTWISE or torch.Tag.pointwise in getattr(target, "tags", ())


def _bits(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.bool:
        return t
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def same_bits(a: Any, b: Any) -> bool:
    """Equal results, tensors compared bit for bit (NaN payloads and signs, -0.0)."""
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same_bits(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and \
            bool(torch.equal(_bits(a), _bits(b)))
    return a == b


_NAN_BITS = {  # quiet and signalling NaNs of several payloads, both signs
    torch.float32: [0x7FC00000, -0x00400000, 0x7FC00001, 0x7F800001, 0x7FFFFFFF, -0x003EDCBB],
    torch.float64: [0x7FF8000000000000, -0x0008000000000000, 0x7FF8000000000001, 0x7FF0000000000001,
                    -0x0007EDCBA9876543],
    torch.float16: [0x7E00, -0x0200, 0x7E01, 0x7C01, 0x7FFF],
    torch.bfloat16: [0x7FC0, -0x0040, 0x7FC1, 0x7F81, 0x7FFF],
}
_TAILS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 15, 16, 17, 24, 31, 32, 33, 48, 63)  # after a 64-element body
_INT_OF = {torch.float32: torch.int32, torch.float64: torch.int64, torch.float16: torch.int16,
           torch.bfloat16: torch.int16}
_NUMBERS = [0.0, -0.0, math.inf, -math.inf, 5e-324, -5e-324, 1e-45, -1e-40, 1.2e-38, 2.3e-308, 1e-8,
            6e-5, 0.3, 0.5, -0.5, 1.0, -1.0, 2.0, 3.0, -2.5, 10.0, 88.7, -103.0, 709.0, 65504.0, 1e4,
            1e30, -1e38, 3e38, 1e300]
# Fewer for ops of two and three operands, whose every combination is run: each keeps the signed
# zeros, infinities, a subnormal, ordinary numbers and NaNs of two payloads and both signs.
_FEWER = {2: ([0.0, -0.0, math.inf, -math.inf, 1e-45, -5e-324, 1.2e-38, 0.3, -0.5, 1.0, 2.0, 3.0, -2.5,
               88.7, 1e30, 3e38], 4, 4),
          3: ([0.0, -0.0, math.inf, -math.inf, 1e-45, 0.3, 1.0, -2.5, 1e30], 2, 3)}


@functools.lru_cache(maxsize=None)
def special_values(dtype: torch.dtype, device: str = "cpu", operands: int = 1) -> torch.Tensor:
    """The values a measurement runs every element through, in `dtype`, for an op of this many
    operands (every combination is run: the more operands, the fewer values)."""
    if dtype == torch.bool:
        return torch.tensor([False, True], device=device)
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        return torch.tensor(sorted({0, 1, 2, 7, info.max, info.min, -1 if info.min else 3, -7 if info.min else 100}),
                            dtype=dtype, device=device)
    numbers, randoms, nans = _FEWER.get(operands, (_NUMBERS, 10, 6))
    g = torch.Generator().manual_seed(0)
    v = torch.tensor(numbers + (torch.randn(randoms, generator=g, dtype=torch.float64) * 4).tolist(),
                     dtype=torch.float64).to(dtype)
    if dtype in _NAN_BITS:
        v = torch.cat([v, torch.tensor(_NAN_BITS[dtype][:nans], dtype=_INT_OF[dtype]).view(dtype)])
    return v.to(device)


def _hashable(v: Any) -> Any:
    return tuple(_hashable(e) for e in v) if isinstance(v, (list, tuple)) else v


def _operand_kinds(args: Sequence[Tuple[str, Any]]) -> Optional[Tuple[Tuple[str, str, Any], ...]]:
    """Per schema argument: (name, "array", dtype) for a tensor operand of rank >= 1, (name,
    "scalar", dtype) for a 0-dim one, (name, "const", value) for a constant; None when a value
    is only known at run time."""
    kinds = []
    for name, a in args:
        if isinstance(a, torch.fx.Node):
            v = a.meta.get("val")
            if not isinstance(v, torch.Tensor):
                return None  # a SymInt/SymFloat: its value is not known here
            kinds.append((name, "array" if v.dim() else "scalar", v.dtype))
        elif isinstance(a, (list, tuple)) and any(isinstance(e, torch.fx.Node) for e in a):
            return None
        else:
            kinds.append((name, "const", _hashable(a)))
    return tuple(kinds)


def elementwise_rows_bitwise(n: torch.fx.Node, args: Sequence[Tuple[str, Any]], device: str) -> bool:
    """An elementwise node gives every element the same bits through the vector loop as through
    the scalar tail, over all combinations of special values (Note [Rows that stay bitwise])."""
    kinds = _operand_kinds(args)
    return kinds is not None and _measure_elementwise(n.target, kinds, device)


def _measured(f):
    """Runs a measurement on real tensors: outside the fake and proxy modes of the compile that
    asks, without autograd; cached per process."""
    cached = functools.lru_cache(maxsize=None)(f)

    @functools.wraps(f)
    def run(*args):
        with _disable_current_modes(), torch.no_grad():
            return cached(*args)
    return run


def _call(target: Any, values: Dict[str, Any]) -> Tuple[torch.Tensor, ...]:
    """target on its arguments by schema name, the kwarg-only ones as keywords; its results."""
    args, kwargs = [], {}
    for a in target._schema.arguments:
        if a.name in values:
            if a.kwarg_only:
                kwargs[a.name] = values[a.name]
            else:
                args.append(values[a.name])
    return _results(target(*args, **kwargs))


def _results(r: Any) -> Tuple[torch.Tensor, ...]:
    return tuple(r) if isinstance(r, (list, tuple)) else (r,)


@_measured
def _measure_elementwise(target: Any, kinds: Tuple[Tuple[str, str, Any], ...], device: str) -> bool:
    arrays = [(name, dtype) for name, kind, dtype in kinds if kind == "array"]
    scalars = [(name, dtype) for name, kind, dtype in kinds if kind == "scalar"]
    if not arrays:
        return True
    operands = min(len(arrays) + len(scalars), 3)
    grids = torch.meshgrid(*[special_values(dtype, device, operands) for _, dtype in arrays], indexing="ij")
    flat = [grid.reshape(-1) for grid in grids]
    count = flat[0].numel()
    length = -(-count // 64) * 64
    # every element through the vector loop: one contiguous run, a multiple of 64 long
    whole = {name: f.repeat(length // count + 1)[:length] for (name, _), f in zip(arrays, flat)}
    # every element in tails of many lengths (a tail may take the scalar op, a partial vector,
    # or a vector and then the scalar op): calls of 64 + t elements, the values in the last t
    runs = []
    for t in _TAILS:
        starts = range(0, count, t)
        for name, f in zip((name for name, _ in arrays), flat):
            rows = f.repeat(t // count + 2)[: len(starts) * t].view(len(starts), t)
            runs.append((t, name, torch.cat([whole[name][:64].expand(len(starts), 64), rows], 1)))
    consts = {name: v for name, kind, v in kinds if kind == "const"}
    for choice in _product([special_values(dtype, device, 3) for _, dtype in scalars]):
        picked = dict(zip((name for name, _ in scalars), choice))

        def call(operands):
            values = {name: operands.get(name, picked.get(name, consts.get(name))) for name, _, _ in kinds}
            if target._schema.is_mutable:   # in place: into a copy of its first operand
                first = target._schema.arguments[0].name
                values[first] = values[first].clone()
            return _call(target, values)
        try:
            want = [r[:count] for r in call(whole)]
            for t in _TAILS:
                rows = {name: r for u, name, r in runs if u == t}
                got = [torch.stack(r) for r in zip(*(call({name: r[k] for name, r in rows.items()})
                                                     for k in range(next(iter(rows.values())).shape[0])))]
                if not all(same_bits(w, g[:, 64:].reshape(-1)[:count]) for w, g in zip(want, got)):
                    return False
        except (RuntimeError, NotImplementedError):   # not for these dtypes
            return False
    return True


def _product(options: List[torch.Tensor]) -> List[Tuple[torch.Tensor, ...]]:
    out: List[Tuple[torch.Tensor, ...]] = [()]
    for values in options:
        out = [p + (values[i],) for p in out for i in range(values.numel())]
    return out


_INNER_SIZES = (1, 3, 7, 17, 33)   # a dynamic inner size: measured at these and at its example value
_MAX_ELEMENTS = 1 << 22            # larger batches are not measured (and count as close)


def row_wise_rows_bitwise(args: Sequence[Tuple[str, Any]], target: Any, batched: Sequence[str],
                          sizes: Sequence[int], device: str) -> bool:
    """A node along other dims gives the real rows of a batch padded to each bucket the bits of
    the unpadded batch (Note [Rows that stay bitwise]), at the example sizes of its other dims
    and, where they are dynamic, at a few more. batched: its batched operands' names."""
    shapes, dynamic = [], False
    for name, a in args:
        if isinstance(a, torch.fx.Node):
            v = a.meta.get("val")
            if not isinstance(v, torch.Tensor):
                return False
            dims = []
            for d in (v.shape[1:] if name in batched else v.shape):
                if isinstance(d, torch.SymInt):
                    if d.node.hint is None or not d.node.expr.is_Symbol:
                        return False   # no example value, or a size computed from others
                    dims.append(("dynamic", int(d.node.hint)))
                    dynamic = True
                else:
                    dims.append(int(d))
            shapes.append((name, "batched" if name in batched else "tensor", (v.dtype, tuple(dims))))
        elif isinstance(a, (list, tuple)) and any(isinstance(e, torch.fx.Node) for e in a):
            return False
        else:
            shapes.append((name, "const", _hashable(a)))
    key = (target, tuple(shapes), tuple(sorted(set(sizes))), torch.get_num_threads(), device)
    return all(_measure_row_wise(*key, inner) for inner in ((None,) + _INNER_SIZES if dynamic else (None,)))


@_measured
def _measure_row_wise(target: Any, shapes: Tuple[Any, ...], sizes: Tuple[int, ...], threads: int,
                      device: str, inner: Optional[int]) -> bool:
    g = torch.Generator().manual_seed(0)

    def shape(dims):   # a dynamic dim at its example value, or at `inner`
        return tuple(d if isinstance(d, int) else (d[1] if inner is None else inner) for d in dims)

    def values(dtype, dims):
        count = math.prod(dims)
        if not dtype.is_floating_point:
            return torch.randint(0, 2, dims, generator=g).to(dtype).to(device)
        v = torch.randn(count, generator=g, dtype=torch.float64).to(dtype)
        special = special_values(dtype)
        where = torch.rand(count, generator=g) < 0.2
        v[where] = special[torch.randint(0, special.numel(), (int(where.sum()),), generator=g)]
        return v.view(dims).to(device)

    fixed = {name: values(spec[0], shape(spec[1])) for name, kind, spec in shapes if kind == "tensor"}
    fixed.update({name: spec for name, kind, spec in shapes if kind == "const"})
    row = max((math.prod(shape(spec[1])) for _, kind, spec in shapes if kind == "batched"), default=1)
    if row * max(sizes) > _MAX_ELEMENTS:
        return False
    previous = 1
    for b in sizes:
        for rows in sorted({previous + 1, (previous + b) // 2, b - 1}):
            if not 2 <= rows < b:
                continue
            real = {name: values(spec[0], (rows,) + shape(spec[1])) for name, kind, spec in shapes if kind == "batched"}
            padded = {name: torch.cat([t, t[-1:].expand(b - rows, *t.shape[1:])]) for name, t in real.items()}
            try:
                want = _call(target, {name: real.get(name, fixed.get(name)) for name, _, _ in shapes})
                got = _call(target, {name: padded.get(name, fixed.get(name)) for name, _, _ in shapes})
            except (RuntimeError, NotImplementedError):   # not for these dtypes or sizes
                return False
            for w, p in zip(want, got):
                if isinstance(w, torch.Tensor) and w.dim() and w.shape[0] == rows:
                    p = p[:rows]
                if not same_bits(w, p):
                    return False
        previous = b
    return True
