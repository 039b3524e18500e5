"""Numerics: NaN, infinities, -0.0, integer edge cases, type promotion, reductions.

Compiled with torchreplay's "reduce-overhead" mode against eager, call by call, through the
differential harness (differential.py: outputs, mutated inputs, aliasing, state, replays)."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from configs import backend
from differential import (  # noqa: F401 (recompile_limits is autouse)
    recompile_limits, CALLS, run, gen, rn, ri, assert_same, run_diff)


def _with_nonfinite(i, g):
    x = rn(g, 4, 5)
    x[0, 1] = float("nan")
    x[1, 2] = float("inf")
    x[2, 3] = -float("inf")
    x[3, (i % 5)] = float("nan")
    return (x,)


def _softmax_masked(x, m):
    return torch.softmax(x.masked_fill(m, -float("inf")), -1)


def _softmax_masked_inputs(i, g):
    m = rn(g, 4, 5) > 0.3
    m[i % 4] = True              # one row entirely masked: NaN
    return rn(g, 4, 5), m


def _cplx(g, *shape):
    return torch.complex(rn(g, *shape), rn(g, *shape))


MISC_CASES = [
    pytest.param(lambda z: z * 2j, lambda i, g: (_cplx(g, 5),), id="complex_times_2j"),
    pytest.param(lambda z: (z * (1.5 - 0.5j), z / (2 + 1j)), lambda i, g: (_cplx(g, 5),), id="complex_scalar_mul_div"),
    pytest.param(lambda z: z.abs() + z.angle(), lambda i, g: (_cplx(g, 3, 3),), id="complex_abs_angle"),
    pytest.param(lambda z: torch.view_as_real(z * z), lambda i, g: (_cplx(g, 4),), id="complex_view_as_real"),
    pytest.param(lambda z, w: z * w.conj() + z.exp(), lambda i, g: (_cplx(g, 4), _cplx(g, 4)), id="complex_mul_conj"),
    pytest.param(lambda z: z * 1.5 + 2, lambda i, g: (_cplx(g, 4),), id="complex_real_scalars"),
    pytest.param(lambda a, b: (a // b, torch.div(a, b, rounding_mode="floor"), torch.div(a, b, rounding_mode="trunc")),
                 lambda i, g: (ri(g, -20, 20, 12), ri(g, 1, 5, 12) * (1 - 2 * ri(g, 0, 2, 12))), id="int_floor_div_negatives"),
    pytest.param(lambda a, b: (a % b, torch.remainder(a, -3), torch.fmod(a, b), a % 4),
                 lambda i, g: (ri(g, -20, 20, 12), ri(g, 1, 5, 12) * (1 - 2 * ri(g, 0, 2, 12))), id="int_remainder_negatives"),
    pytest.param(lambda x, y: (x // y, x % y, torch.fmod(x, y)), lambda i, g: (rn(g, 8) * 5, rn(g, 8)),
                 id="float_floor_div_remainder"),
    pytest.param(lambda a: a * (2 ** 40) + (2 ** 62), lambda i, g: (ri(g, -3, 4, 6),), id="int64_large_python_ints"),
    pytest.param(lambda a, b, c: ((a & b) | ~c, (a ^ b).sum(), torch.where(c, a.float(), b.float()), a.logical_and(c).any()),
                 lambda i, g: tuple(rn(g, 6) > 0 for _ in range(3)), id="bool_logic"),
    pytest.param(lambda x: (x * 0, torch.maximum(x, x.flip(0)), x.clamp(-1, 1), torch.nan_to_num(x), torch.relu(x),
                            x.amax(1), x.sum(0), torch.sigmoid(x)), _with_nonfinite, id="nan_inf_propagation"),
    pytest.param(_softmax_masked, _softmax_masked_inputs, id="softmax_fully_masked_row"),
    pytest.param(lambda x: (x + 1, x.sum(0), x.mean(), torch.cat([x, x]), x.amax(1)),
                 lambda i, g: (rn(g, 0, 4),), id="empty_tensor_reductions"),
    pytest.param(lambda x, w: x @ w + 1, lambda i, g: (rn(g, 0, 4), rn(g, 4, 3)), id="empty_matmul"),
    pytest.param(lambda a, b: a * b + a.exp(), lambda i, g: (rn(g), rn(g)), id="zero_dim_tensors"),
    pytest.param(lambda a, x: x * a - a, lambda i, g: (rn(g), rn(g, 3, 2)), id="zero_dim_times_vector"),
    pytest.param(lambda x: (x.sin() + 1, x.t() * 2, x.sum(1)), lambda i, g: (rn(g, 5, 6).t(),), id="transposed_input"),
    pytest.param(lambda x: (x * 2 + 1, x.cumsum(1)), lambda i, g: (rn(g, 10, 9)[::2, ::3],), id="stepped_slice_input"),
    pytest.param(lambda x: x * 2 + x.sum(0), lambda i, g: (rn(g, 1, 4).expand(5, 4),), id="expanded_stride0_input"),
    pytest.param(lambda x: x.exp() - x, lambda i, g: (rn(g, 40)[7:31].view(4, 6),), id="storage_offset_input"),
    pytest.param(lambda a, b: (a + b, a * 3, a - b), lambda i, g: (ri(g, 0, 256, 8, dtype=torch.uint8), ri(g, 0, 256, 8, dtype=torch.uint8)),
                 id="uint8_wraparound"),
    pytest.param(lambda a: ((a << 3) ^ (a >> 1), a & 0xFF, ~a), lambda i, g: (ri(g, -1000, 1000, 8, dtype=torch.int32),),
                 id="int32_bit_ops"),
    pytest.param(lambda x: (x.exp().log1p(), x * 1.1 + 3), lambda i, g: (rn(g, 6, dtype=torch.float64),), id="float64"),
    pytest.param(lambda x: (torch.max(x, 1), torch.min(x, 0), torch.sort(x, 1), torch.topk(x, 2)),
                 lambda i, g: (rn(g, 4, 5),), id="indices_outputs"),
    pytest.param(lambda a, b: (a.cumsum(0), a.prod(1), a @ b), lambda i, g: (ri(g, -3, 4, 3, 3), ri(g, -3, 4, 3, 2)),
                 id="int_cumsum_prod_matmul"),
]


@pytest.mark.parametrize("fn,make_inputs", MISC_CASES)
def test_misc_numerics(fn, make_inputs):
    with torch.no_grad():
        run_diff(fn, make_inputs, seed=60)


def test_misc_random_ops_follow_the_global_generator():
    """Same seed, same draws: dropout masks and rand_like as eager, and the generator advanced
    as far as eager's (fresh draws on every replay, never a captured constant)."""
    fn = lambda x: (F.dropout(x, 0.5, training=True), torch.rand_like(x) + x, torch.randn(3))  # noqa: E731
    compiled = torch.compile(fn, backend=backend())
    for i in range(CALLS):
        x = rn(gen(i), 4, 5)
        torch.manual_seed(100 + i)
        want = fn(x)
        after_e = torch.rand(2)
        torch.manual_seed(100 + i)
        got = compiled(x)
        after_c = torch.rand(2)
        assert_same(got, want, what=f"call {i}")
        assert_same(after_c, after_e, what=f"call {i}: next draw after the call")


def test_misc_inference_mode():
    fn = lambda x, y: (torch.relu(x) @ y, x.sum(0))  # noqa: E731
    compiled = torch.compile(fn, backend=backend())
    with torch.inference_mode():
        for i in range(CALLS):
            x, y = rn(gen(i), 3, 4), rn(gen(50 + i), 4, 2)
            got, want = compiled(x, y), fn(x, y)
            assert_same(got, want, what=f"call {i}")
            assert [t.is_inference() for t in got] == [t.is_inference() for t in want], f"call {i}"


@pytest.mark.parametrize("fn,make_inputs", [
    pytest.param(lambda x, s: (x * s, s * x + 1), lambda i, g: (rn(g, 4), ri(g, -3, 4)), id="float_times_0dim_int64"),
    pytest.param(lambda a, s: (a * s, a / s, a + s), lambda i, g: (ri(g, -5, 5, 4), rn(g) + 3), id="int_times_0dim_float"),
    pytest.param(lambda b, s: (b * s, b + s, b & (s > 0)), lambda i, g: (rn(g, 4) > 0, ri(g, -3, 4)), id="bool_and_0dim_int"),
    pytest.param(lambda x: (x * 2, x.shape[0] + 1, x.dtype), lambda i, g: (rn(g, 3),), id="non_tensor_outputs"),
])
def test_misc_type_promotion_and_outputs(fn, make_inputs):
    with torch.no_grad():
        run_diff(fn, make_inputs, seed=63)


def test_misc_error_during_a_call_then_recovery():
    """A call that raises (index out of range) leaves the engine usable: later calls are right."""
    fn = lambda x, idx: x.index_select(0, idx) * 2  # noqa: E731
    compiled = torch.compile(fn, backend=backend())
    x = rn(gen(0), 5, 3)
    for i in range(10):
        idx = torch.tensor([i % 5, (i + 2) % 5])
        if i in (4, 7):
            idx = torch.tensor([1, 9])
            with pytest.raises(IndexError):
                fn(x, idx)
            with pytest.raises(IndexError):
                compiled(x, idx)
            continue
        assert_same(compiled(x, idx), fn(x, idx), what=f"call {i}")


def test_misc_dtype_changes_between_calls():
    fn = lambda x: (x * 1.1 + 2, x.sum())  # noqa: E731
    dtypes = [torch.float32, torch.float64, torch.float32, torch.int32, torch.float64, torch.int32,
              torch.float32, torch.int32, torch.float64]
    with torch.no_grad():
        run_diff(fn, lambda i, g: ((rn(g, 5) * 4).to(dtypes[i]),), calls=len(dtypes), seed=64)


def test_misc_int64_overflow_wraps_like_eager():
    fn = lambda a: (a * (2 ** 62), a + (2 ** 63 - 1), -a * (2 ** 63 - 1))  # noqa: E731
    with torch.no_grad():
        run_diff(fn, lambda i, g: (ri(g, -3, 4, 6),), seed=65)


def _mha():
    torch.manual_seed(66)
    mha = nn.MultiheadAttention(8, 2, batch_first=True).eval()
    return lambda x: mha(x, x, x)


COMPOSITE_CASES = [   # AOTAutograd decomposes these (eager differs in the last bits): bitwise vs aot_eager
    pytest.param(lambda: (lambda x: F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False)),
                 lambda i, g: (rn(g, 1, 2, 4, 4),), id="interpolate_bilinear"),
    pytest.param(_mha, lambda i, g: (rn(g, 2, 3, 8),), id="multihead_attention_eval"),
    pytest.param(lambda: (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
                 lambda i, g: tuple(rn(g, 1, 2, 4, 8) for _ in range(3)), id="sdpa_causal"),
    pytest.param(lambda: (lambda i, o, w: F.embedding_bag(i, w, o, mode="mean")),
                 lambda i, g: (ri(g, 0, 10, 8), torch.tensor([0, 3, 5]), rn(g, 10, 4)), id="embedding_bag"),
    pytest.param(lambda: (lambda x: (x.as_strided((3, 3), (1, 2), 1) * 2, x.unfold(0, 3, 2).sum(-1))),
                 lambda i, g: (rn(g, 9),), id="as_strided_unfold"),
    pytest.param(lambda: (lambda x: F.max_pool2d(x, 2, return_indices=True)), lambda i, g: (rn(g, 1, 2, 4, 4),),
                 id="max_pool_with_indices"),
]


@pytest.mark.parametrize("make_fn,make_inputs", COMPOSITE_CASES)
def test_misc_composite_ops_vs_aot_eager(make_fn, make_inputs):
    with torch.no_grad():
        run_diff(make_fn(), make_inputs, ref="aot_eager", seed=66)


def test_misc_torch_cond_runs_eagerly_with_a_reason():
    """Control flow (a subgraph operator) is not captured: the graph runs eagerly, logged."""
    fn = lambda x: torch.cond(x.sum() > 0, lambda y: y.sin(), lambda y: y.cos() - 1, (x,))  # noqa: E731
    with torch.no_grad():
        run_diff(fn, lambda i, g: (rn(g, 4),), ref="aot_eager", seed=66, eager_reason="cannot lower")


def test_misc_channels_last_conv():
    torch.manual_seed(61)
    conv = nn.Conv2d(3, 4, 3, padding=1)

    def fn(x):
        return F.relu(conv(x)) + x.mean(1, keepdim=True)

    def make(i, g):
        return (rn(g, 2, 3, 6, 6).contiguous(memory_format=torch.channels_last),)

    with torch.no_grad():
        run_diff(fn, make, seed=61)


BIG_INT_FNS = {
    "mod_of_big_int": lambda x, k: x * (k % 1000),             # only k itself is beyond int64
    "floordiv_by_2_pow_64": lambda x, k: x + k // 2 ** 64,     # the graph also holds the constant 2**64
}


@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic", "static"])
@pytest.mark.parametrize("kind", list(BIG_INT_FNS))
def test_misc_python_int_beyond_int64_argument(kind, dynamic):
    """Eager computes on a Python int of any size; only a small result meets a tensor."""
    fn = BIG_INT_FNS[kind]
    ks = [2 ** 64 + 3, 2 ** 64 + 5, 2 ** 64 + 3, 2 ** 64 + 5, 2 ** 64 + 3, 2 ** 64 + 5, 2 ** 64 + 3]
    # A graph that holds such an int (2**64) or is given one at run time runs eagerly, logged.
    reason = None if not dynamic else "64 bits" if kind == "mod_of_big_int" else "cannot lower"
    with torch.no_grad():
        run_diff(fn, lambda i, g: (rn(g, 4), ks[i]), calls=len(ks), dynamic=dynamic, seed=62,
                 eager_reason=reason)
