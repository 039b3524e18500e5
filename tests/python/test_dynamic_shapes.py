"""Dynamic shapes and symbolic arithmetic.

Compiled with torchreplay's "reduce-overhead" mode against eager, call by call, through the
differential harness (differential.py: outputs, mutated inputs, aliasing, state, replays)."""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from differential import (  # noqa: F401 (recompile_limits is autouse)
    recompile_limits, total, rn, ri, run_diff, run_module_diff)


DYN_SIZES = [5, 7, 5, 9, 7, 5, 9, 7, 5, 9]


def _dyn_x(cols=3):
    return lambda i, g: (rn(g, DYN_SIZES[i], cols),)


DYN_CASES = [
    pytest.param(lambda x: x * (x.shape[0] / 2), _dyn_x(), id="truediv_of_shape"),
    pytest.param(lambda x: x ** (x.shape[0] // 2), _dyn_x(), id="pow_floordiv_of_shape"),
    pytest.param(lambda x: x * x.shape[0] ** 2, _dyn_x(), id="shape_squared"),
    pytest.param(lambda x: x * float(x.shape[0]), _dyn_x(), id="float_of_shape"),
    pytest.param(lambda x: x / (x.shape[0] // 3), _dyn_x(), id="int_floordiv_divisor"),
    pytest.param(lambda x: x.abs() ** (1 / x.shape[0]), _dyn_x(), id="pow_reciprocal_of_shape"),
    pytest.param(lambda x: x / math.sqrt(x.shape[0]), _dyn_x(), id="math_sqrt_of_shape"),
    pytest.param(lambda x: x * (x.shape[0] / x.shape[1]),
                 lambda i, g: (rn(g, DYN_SIZES[i], DYN_SIZES[-1 - i] + 1),), id="ratio_of_two_dims"),
    pytest.param(lambda a, b: a[:min(a.shape[0], b.shape[0])] * max(a.shape[0], b.shape[0]),
                 lambda i, g: (rn(g, DYN_SIZES[i], 3), rn(g, DYN_SIZES[-1 - i] + 1, 3)), id="min_max_of_shapes"),
    pytest.param(lambda x: x.reshape(x.shape[0] * 3, 2).sum(1), _dyn_x(6), id="reshape_computed_sizes"),
    pytest.param(lambda x: x * torch.arange(x.shape[0], dtype=x.dtype)[:, None], _dyn_x(), id="arange_n"),
    pytest.param(lambda x: (torch.arange(x.shape[0]) % 3) * 2 + x,
                 lambda i, g: (ri(g, -9, 9, DYN_SIZES[i]),), id="arange_int_mod"),
    pytest.param(lambda x: x - x.mean(0, keepdim=True), _dyn_x(), id="mean_over_dynamic_dim"),
    pytest.param(lambda x: x.sum() / x.numel(), _dyn_x(), id="sum_over_numel"),
    pytest.param(lambda x: torch.cat([x, x.new_zeros(x.shape[0] % 3 + 1, x.shape[1])]), _dyn_x(),
                 id="cat_with_computed_zeros"),
    pytest.param(lambda x: x[: x.shape[0] // 2] + x[x.shape[0] - x.shape[0] // 2:], _dyn_x(), id="computed_slices"),
    pytest.param(lambda x: torch.full((x.shape[0],), x.shape[0] * x.shape[1] / 3.0) + x.sum(1), _dyn_x(),
                 id="full_with_symbolic_float_fill"),
    pytest.param(lambda x, k: x * k + k // 2, lambda i, g: (rn(g, 4), [3, 5, 3, 7, 5, 3, 7, 5][i]),
                 id="python_int_argument"),
    pytest.param(lambda x, s: x * s - s ** 2, lambda i, g: (rn(g, 4), [0.5, 1.25, 0.5, 2.0, 1.25, 0.5][i]),
                 id="python_float_argument"),
    pytest.param(lambda x: (x.bfloat16() * (x.shape[0] / 3), x.half() / x.shape[0]), _dyn_x(),
                 id="reduced_precision_times_symbolic"),
    pytest.param(lambda x: (x * 2, x.shape[0] // 2, x.shape[0] * 1.5), _dyn_x(), id="int_and_float_outputs"),
    pytest.param(lambda x: x.t().contiguous().view(-1)[: x.shape[0]], _dyn_x(), id="transpose_flatten_slice"),
    pytest.param(lambda x, k: x[:k] * (x.shape[0] - k),
                 lambda i, g: (rn(g, DYN_SIZES[i], 2), [2, 3, 4, 2, 3, 4, 2, 3, 4, 2][i]), id="int_arg_and_shape"),
]


@pytest.mark.parametrize("fn,make_inputs", DYN_CASES)
def test_dynamic_shapes(fn, make_inputs, request):
    calls = {"python_int_argument": 8, "python_float_argument": 6}.get(request.node.callspec.id, len(DYN_SIZES))
    with torch.no_grad():
        run_diff(fn, make_inputs, calls=calls, dynamic=True, seed=40)


SYM_INT_OPS = [
    pytest.param(lambda x, k: x * (k >> 1), id="rshift"),
    pytest.param(lambda x, k: x * (k << 2), id="lshift"),
    pytest.param(lambda x, k: x * round(k / 3), id="round_of_truediv"),
    pytest.param(lambda x, k: x * (k & 6) + (k | 1) - (k ^ 5), id="bitand_bitor_xor"),
    pytest.param(lambda x, k: x * ((-k) % 4) + ((-k) // 4), id="negative_mod_floordiv"),
    pytest.param(lambda x, k: x * abs(k - 6) + min(k, 6) - max(k, 6), id="abs_min_max"),
    pytest.param(lambda x, k: x * math.floor(k / 3) + math.ceil(k / 3) + math.trunc(-k / 3), id="floor_ceil_trunc"),
    pytest.param(lambda x, k: x * math.exp(k / 10) + math.log(k) + math.sin(k), id="math_exp_log_sin"),
    pytest.param(lambda x, k: x * ((k / 2) % 1.5) + (k / 2) // 1.5, id="float_mod_floordiv"),
    pytest.param(lambda x, k: x * ((k > 6) * 3) + (k == 7), id="bool_arithmetic"),
    pytest.param(lambda x, k: x * (k ** -1) + 1.5 ** k, id="negative_and_float_pow"),
    pytest.param(lambda x, k: x + torch.arange(k, k + 3) + torch.full((3,), k // 2), id="factories_with_symint"),
]


@pytest.mark.parametrize("fn", SYM_INT_OPS)
def test_dynamic_symbolic_int_arithmetic(fn):
    ks = [5, 7, 5, 7, 9, 5, 9, 7, 9]
    with torch.no_grad():
        run_diff(fn, lambda i, g: (rn(g, 3), ks[i]), calls=len(ks), dynamic=True, seed=45)


def test_dynamic_mutation_by_shape():
    def fn(x):
        x.add_(x.shape[0])
        return x * 2

    run_diff(fn, _dyn_x(), calls=len(DYN_SIZES), dynamic=True, seed=41)


@pytest.mark.parametrize("fn", [
    pytest.param(lambda x: x * (x.shape[0] / 2) + torch.arange(x.shape[0])[:, None], id="truediv_and_arange"),
    pytest.param(lambda x: F.softmax(x, 0) * x.shape[0], id="softmax_times_shape"),
])
def test_dynamic_mark_dynamic(fn):
    def make(i, g):
        x = rn(g, DYN_SIZES[i], 4)
        torch._dynamo.mark_dynamic(x, 0)
        return (x,)

    with torch.no_grad():
        run_diff(fn, make, calls=len(DYN_SIZES), dynamic=None, seed=42)


def test_dynamic_false_recompiles_per_size():
    fn = lambda x: torch.relu(x) * x.shape[0] / 4  # noqa: E731
    b = run_diff(fn, _dyn_x(), calls=len(DYN_SIZES), dynamic=False, seed=43)
    assert total(b, "replays") >= 3


def test_dynamic_module_two_dims_coming_back():
    torch.manual_seed(44)
    sizes = [(3, 5), (6, 7), (3, 5), (6, 7), (3, 5), (9, 5), (6, 7), (9, 5), (3, 5)]
    with torch.no_grad():
        run_module_diff(lambda: nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.GELU()),
                        lambda i, g: (rn(g, *sizes[i], 4),), calls=len(sizes), dynamic=True, seed=44)
