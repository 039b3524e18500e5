"""Half and bfloat16 graphs (eager's per-op rounding).

Compiled with torchreplay's "reduce-overhead" mode against eager, call by call, through the
differential harness (differential.py: outputs, mutated inputs, aliasing, state, replays)."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from differential import recompile_limits, rn, run_diff  # noqa: F401 (recompile_limits is autouse)


LOWP = [torch.bfloat16, torch.float16]


def _lowp_inputs(dt, extra=None):
    def make(i, g):
        x, y = rn(g, 4, 8, dtype=dt), rn(g, 4, 8, dtype=dt)
        if extra == "0dim":
            return x, (rn(g, dtype=dt) + 2)
        if extra == "0dim_fp32":
            return x, (rn(g) + 2)
        if extra == "vec":
            return x, rn(g, 8, dtype=dt)
        if extra == "ln":
            return x, rn(g, 8, dtype=dt), rn(g, 8, dtype=dt)
        if extra == "mat":
            return x, rn(g, 8, 5, dtype=dt)
        if extra == "fp32":
            return x, rn(g, 4, 8)
        if extra == "x":
            return (x,)
        return x, y
    return make


LOWP_CASES = [
    pytest.param(lambda x, y: torch.sigmoid(x * 1.5 + y) - torch.tanh(y), None, id="pointwise"),
    pytest.param(lambda x, s: x * s, "0dim", id="mul_0dim_tensor"),
    pytest.param(lambda x, s: x / s, "0dim", id="div_0dim_tensor"),
    pytest.param(lambda x, s: (x * s, x / s), "0dim_fp32", id="mul_div_0dim_fp32_tensor"),
    pytest.param(lambda x: x * 0.1 / 3.0 + 2.5, "x", id="python_scalars"),
    pytest.param(lambda x: x / x.abs().max(), "x", id="normalize_by_absmax"),
    pytest.param(lambda x, b: x + b * x[:, :1], "vec", id="broadcast"),
    pytest.param(lambda x: (torch.softmax(x, -1), torch.log_softmax(x, 0)), "x", id="softmax"),
    pytest.param(lambda x, w, b: F.layer_norm(x, (8,), w, b), "ln", id="layer_norm"),
    pytest.param(lambda x, w: x @ w, "mat", id="matmul"),
    pytest.param(lambda x, y: ((x.float() * 2).to(x.dtype) + y, x * y.float()), "fp32", id="casts_and_promotion"),
    pytest.param(lambda x, s: (s * x, s / (x.abs() + 1), x - s, torch.maximum(x, s), x.add(s, alpha=2)), "0dim",
                 id="0dim_tensor_left_sub_max_alpha"),
    pytest.param(lambda x, y: torch.addcmul(x, y, x, value=0.5).lerp(y, 0.3), None, id="addcmul_lerp"),
    pytest.param(lambda x: (x * 3, torch.where(x > 0, x, 0.5), x.pow(2), x + True), "x", id="int_bool_scalars_where"),
    pytest.param(lambda x: (x.sum(dtype=torch.float32), x.mean(0), x.var(1), x.cumsum(1)), "x", id="reductions"),
]


@pytest.mark.parametrize("dtype", LOWP, ids=["bf16", "fp16"])
@pytest.mark.parametrize("fn,extra", LOWP_CASES)
def test_reduced_precision(fn, extra, dtype):
    with torch.no_grad():
        run_diff(fn, _lowp_inputs(dtype, extra), seed=10)


def test_reduced_precision_cpu_autocast_bf16():
    torch.manual_seed(16)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))

    def fn(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = model(x)
            return y, y.float().softmax(-1)

    with torch.no_grad():
        run_diff(fn, lambda i, g: (rn(g, 3, 8),), seed=16)
