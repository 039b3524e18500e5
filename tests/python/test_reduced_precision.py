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


class _MixedNorm(nn.Module):
    """A norm whose input is half or bfloat16 and whose weights are float32: ATen's CPU kernels
    then give their saved statistics (mean, rstd) in float32, where the fake kernels say the input's
    dtype (Note [Dtypes the kernels give] in python/torchreplay/passes.py)."""

    def __init__(self, kind, dtype):
        super().__init__()
        torch.manual_seed(31)
        self.kind, self.dtype = kind, dtype
        self.fc = nn.Linear(8, 8)
        if kind == "weight_norm":  # all half: the kernel gives the norms in float32
            self.norm = nn.utils.weight_norm(nn.Linear(8, 8)).to(dtype)
            return
        self.norm = {"layer_norm": nn.LayerNorm(8), "group_norm": nn.GroupNorm(2, 8),
                     "batch_norm": nn.BatchNorm1d(8), "autocast": nn.LayerNorm(8)}[kind]
        with torch.no_grad():  # weights away from 1 and 0, so their gradients show
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.uniform_(-0.5, 0.5)

    def forward(self, x):
        if self.kind == "autocast":  # Linear -> LayerNorm under CPU autocast
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.norm(self.fc(x)) * 2
        h = self.fc(x).to(self.dtype)
        return self.norm(h.view(4, 8, 1) if self.kind == "group_norm" else h) * 2


MIXED_NORMS = [("layer_norm", torch.bfloat16), ("layer_norm", torch.float16), ("group_norm", torch.bfloat16),
               ("batch_norm", torch.bfloat16), ("autocast", torch.float32), ("weight_norm", torch.float16)]


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
@pytest.mark.parametrize("kind,dtype", MIXED_NORMS, ids=[f"{k}-{str(d)[6:]}" for k, d in MIXED_NORMS])
def test_training_through_a_norm_of_mixed_dtypes_is_eagers(kind, dtype, mode):
    """Training through a reduced-precision norm with float32 weights (or a half weight norm): the
    backward graph takes the forward's float32 statistics (it used to refuse them: "expected dtype
    BFloat16, got Float"). Output, input gradient, parameter gradients and buffers bitwise equal to
    eager's, every step."""
    from configs import backend
    from differential import assert_bitwise, gen, total
    eager, model = _MixedNorm(kind, dtype), _MixedNorm(kind, dtype)   # seeded alike
    b = backend(mode=mode)
    compiled = torch.compile(model, backend=b)
    for step in range(4):
        g = gen(step)
        x = rn(g, 4, 8).requires_grad_()
        x_ref = x.detach().clone().requires_grad_()
        out, want = compiled(x), eager(x_ref)
        loss, loss_ref = out.float().square().mean(), want.float().square().mean()
        loss.backward()
        loss_ref.backward()
        assert_bitwise(out, want, f"step {step}: output")
        assert_bitwise(x.grad, x_ref.grad, f"step {step}: x.grad")
        for (name, p), p_ref in zip(model.named_parameters(), eager.parameters()):
            assert_bitwise(p.grad, p_ref.grad, f"step {step}: {name}.grad")
            p.grad = p_ref.grad = None
        for (name, t), t_ref in zip(model.named_buffers(), eager.buffers()):
            assert_bitwise(t, t_ref, f"step {step}: buffer {name}")
    assert not b.eager_graphs, b.eager_graphs
    assert total(b, "calls") >= 8   # forward and backward graphs, every step
    if mode == "reduce-overhead":
        assert total(b, "replays") >= 4, b.stats()


def _kernel_dtype_cases():
    """(name, fn, args) per op of Note [Dtypes the kernels give], in the dtypes where its fake
    kernel and its CPU kernel disagree."""
    aten = torch.ops.aten
    bf, h, f = torch.bfloat16, torch.float16, torch.float32
    x, xh = torch.randn(4, 6, 8, dtype=bf), torch.randn(4, 6, 8, dtype=h)
    w6, w8, s6 = torch.rand(6) + 0.5, torch.rand(8) + 0.5, torch.rand(6, dtype=bf) + 0.5
    rm, rv = torch.zeros(6), torch.ones(6)
    _, mean, rstd = aten.native_group_norm(x, w6, w6, 4, 6, 8, 2, 1e-5)
    return [
        ("native_layer_norm", lambda x, w: aten.native_layer_norm(x, [8], w, w, 1e-5), (x, w8)),
        ("native_layer_norm half", lambda x, w: aten.native_layer_norm(x, [8], w, w, 1e-5), (xh, w8)),
        ("native_group_norm", lambda x, w: aten.native_group_norm(x, w, w, 4, 6, 8, 2, 1e-5), (x, w6)),
        ("native_group_norm_backward", lambda g, x, m, r, w: aten.native_group_norm_backward(
            g, x, m, r, w, 4, 6, 8, 2, [True, True, True]), (torch.randn_like(x), x, mean, rstd, w6)),
        ("native_batch_norm", lambda x, w, m, v: aten.native_batch_norm(x, w, w, m, v, True, 0.1, 1e-5),
         (x, w6, rm, rv)),
        ("_native_batch_norm_legit", lambda x, w, m, v: aten._native_batch_norm_legit(x, w, w, m, v, True, 0.1, 1e-5),
         (x, w6, rm, rv)),
        ("_native_batch_norm_legit no_stats", lambda x, w: aten._native_batch_norm_legit.no_stats(
            x, w, w, True, 0.1, 1e-5), (x, w6)),
        ("_native_batch_norm_legit_no_training", lambda x, w, m, v: aten._native_batch_norm_legit_no_training(
            x, w, w, m, v, 0.1, 1e-5), (x, w6, rm, rv)),
        ("_native_batch_norm_legit_functional", lambda x, w, m, v: aten._native_batch_norm_legit_functional(
            x, w, w, m, v, True, 0.1, 1e-5), (x, w6, rm, rv)),
        ("_native_batch_norm_legit_functional bf16 stats", lambda x, w, m, v: aten._native_batch_norm_legit_functional(
            x, w, w, m, v, True, 0.1, 1e-5), (x, s6, s6 * 0, s6)),
        ("_batch_norm_with_update", lambda x, w, m, v: aten._batch_norm_with_update(x, w, w, m, v, 0.1, 1e-5),
         (x, w6, rm, rv)),
        ("_batch_norm_with_update_functional", lambda x, w, m, v: aten._batch_norm_with_update_functional(
            x, w, w, m, v, 0.1, 1e-5), (x, w6, rm, rv)),
        ("_batch_norm_with_update_functional bf16 stats", lambda x, w, m, v: aten._batch_norm_with_update_functional(
            x, w, w, m, v, 0.1, 1e-5), (x, s6, s6 * 0, s6)),
        ("_batch_norm_no_update", lambda x, w, m, v: aten._batch_norm_no_update(x, w, w, m, v, 0.1, 1e-5),
         (x, w6, rm, rv)),
        ("_weight_norm_interface", lambda v, g: aten._weight_norm_interface(v, g, 0),
         (torch.randn(4, 5, dtype=h), torch.rand(4, 1, dtype=h) + 0.5)),
    ]


@pytest.mark.parametrize("name,fn,args", _kernel_dtype_cases(), ids=[c[0] for c in _kernel_dtype_cases()])
def test_the_graph_says_the_dtypes_the_cpu_kernels_give(name, fn, args):
    """Note [Dtypes the kernels give]: each of these ops' fake kernel says other dtypes than its CPU
    kernel gives; after the pass, every value of the traced graph (the op's results and what reads
    them) has the kernel's dtype, and the placeholders given dtypes by name take them."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.utils import _pytree as pytree

    from torchreplay.passes import follow_kernel_dtypes

    def dtypes(tree):
        return [t.dtype if isinstance(t, torch.Tensor) else None for t in pytree.tree_leaves(tree)]

    def traced(*a):
        out = fn(*[t.clone() for t in a])
        return [o.clone() for o in out if isinstance(o, torch.Tensor)]   # read the results

    want = dtypes(traced(*args))
    gm = make_fx(traced, tracing_mode="fake")(*args)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    before = dtypes([o.meta["val"] for o in output.args[0]])
    assert before != want, (before, want)   # the fake kernel disagrees: the case shows the class
    assert follow_kernel_dtypes(gm) > 0
    assert dtypes([o.meta["val"] for o in output.args[0]]) == want
    # A graph reading these results as inputs (a backward) takes the dtypes it is given.
    placeholder = next(n for n in gm.graph.nodes if n.op == "placeholder")
    other = torch.float32 if placeholder.meta["val"].dtype != torch.float32 else torch.float64
    follow_kernel_dtypes(gm, {placeholder.name: other})
    assert placeholder.meta["val"].dtype == other
    assert all(u.meta["val"].dtype == other for u in placeholder.users if u.target is torch.ops.aten.clone.default)
