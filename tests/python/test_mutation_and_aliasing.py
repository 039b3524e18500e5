"""Inputs the graph writes (in place, through views, KV caches, buffers) and outputs that alias inputs
or each other.

Compiled with torchreplay's "reduce-overhead" mode against eager, call by call, through the
differential harness (differential.py: outputs, mutated inputs, aliasing, state, replays)."""
import copy

import pytest
import torch
import torch.nn as nn

from configs import backend
from differential import (  # noqa: F401 (recompile_limits is autouse)
    recompile_limits, CALLS, RO_VARIANTS, run, total, gen, rn, ri, assert_same, run_diff,
    assert_state, run_module_diff, CounterModel)


def m_add_(x, y):
    x.add_(y)
    return x * 2


def m_mul_scalar_(x):
    x.mul_(1.5)
    return x.sum(0)


def m_copy_transposed(x, y):
    x.copy_(y.t())
    return x + 1


def m_index_put_(x, idx, v):
    x.index_put_((idx,), v)
    return x.sum(1)


def m_index_put_accumulate(x, idx, v):
    x.index_put_((idx,), v, accumulate=True)
    return x * 1


def m_slice_assign(x, y):
    x[1:] = y[1:] * 2
    return x.sum()


def m_masked_fill_(x, m):
    x.masked_fill_(m, -1.0)
    return x.cumsum(0)


def m_clamp_(x):
    x.clamp_(-0.5, 0.5)
    return x.mean(1)


def m_mutate_column_view(x):
    x[:, 0].mul_(2)
    return x.sum(1)


def m_mutate_transposed_view_return_input(x, y):
    x.t()[1].add_(y)
    return x


def m_return_input_and_new(x):
    return x, x * 2


def m_mutate_return_view(x):
    x.mul_(2)
    return x.view(-1)


def m_return_several_views(x):
    return x[0], x.t(), x[:, 1:3], x + 1


def m_two_views_same_base(a, b):
    a.add_(1)
    return a + b


def m_overlapping_views(a, b):
    a.mul_(2)
    return b.sum(0)


def m_same_tensor_twice(a, b):
    a.add_(b)
    return a * b


def m_no_output(x, y):
    x.add_(y)


def m_old_and_new(x):
    old = x.clone()
    x.mul_(2)
    return old + x


def m_index_copy_kv(cache, pos, new):
    cache.index_copy_(0, pos, new)
    return cache.sum(0) + new[0]


def m_view_chain_mutation(x, y):
    v = x.view(2, 8)[:, 2:6]
    v.sub_(y)
    return v, v.abs()


def m_index_add_(x, idx, src):
    x.index_add_(0, idx, src, alpha=0.5)
    return x


def m_scatter_(x, idx, src):
    x.scatter_(1, idx, src)
    return x.sum()


def m_unsqueeze_view_mutation(x):
    x.unsqueeze(0).mul_(3)
    return x, x.sin()


def m_int_counter(x):
    x.add_(1)
    return x * 2


def m_mutate_both_inputs(x, y):
    x.mul_(y)
    y.sub_(x)
    return x + y


def m_mutation_read_through_view_of_other(a, b):
    a[:, 1:].add_(1)     # b overlaps a's storage: later reads of b see the write
    return b * 2


def _views_same_base(i, g):
    base = rn(g, 8, 4)
    return base[:4], base[4:]


def _overlapping(i, g):
    base = rn(g, 10, 3)
    return base[:6], base[4:]


def _same_twice(i, g):
    t = rn(g, 4, 4)
    return t, t


def _overlap_2d(i, g):
    base = rn(g, 4, 6)
    return base[:, :4], base[:, 2:]


MUTATION_CASES = [
    pytest.param(m_add_, lambda i, g: (rn(g, 4, 5), rn(g, 4, 5)), id="add_"),
    pytest.param(m_mul_scalar_, lambda i, g: (rn(g, 4, 5),), id="mul_scalar_"),
    pytest.param(m_copy_transposed, lambda i, g: (rn(g, 5, 5), rn(g, 5, 5)), id="copy_transposed"),
    pytest.param(m_index_put_, lambda i, g: (rn(g, 6, 4), torch.randperm(6, generator=g)[:3], rn(g, 3, 4)),
                 id="index_put_"),
    pytest.param(m_index_put_accumulate, lambda i, g: (rn(g, 6, 4), ri(g, 0, 6, 5), rn(g, 5, 4)),
                 id="index_put_accumulate_duplicates"),
    pytest.param(m_slice_assign, lambda i, g: (rn(g, 5, 3), rn(g, 5, 3)), id="slice_assign"),
    pytest.param(m_masked_fill_, lambda i, g: (rn(g, 5, 3), rn(g, 5, 3) > 0), id="masked_fill_"),
    pytest.param(m_clamp_, lambda i, g: (rn(g, 4, 6),), id="clamp_"),
    pytest.param(m_mutate_column_view, lambda i, g: (rn(g, 4, 3),), id="mutate_column_view"),
    pytest.param(m_mutate_transposed_view_return_input, lambda i, g: (rn(g, 3, 4), rn(g, 3)),
                 id="mutate_transposed_view_return_input"),
    pytest.param(m_return_input_and_new, lambda i, g: (rn(g, 3, 4),), id="return_input"),
    pytest.param(m_mutate_return_view, lambda i, g: (rn(g, 3, 4),), id="mutate_then_return_view"),
    pytest.param(m_return_several_views, lambda i, g: (rn(g, 3, 4),), id="return_select_t_slice"),
    pytest.param(m_two_views_same_base, _views_same_base, id="two_views_of_one_base"),
    pytest.param(m_overlapping_views, _overlapping, id="overlapping_views_mutated"),
    pytest.param(m_same_tensor_twice, _same_twice, id="same_tensor_passed_twice"),
    pytest.param(m_no_output, lambda i, g: (rn(g, 4, 3), rn(g, 4, 3)), id="mutation_only_no_output"),
    pytest.param(m_old_and_new, lambda i, g: (rn(g, 6),), id="clone_then_mutate"),
    pytest.param(m_index_copy_kv, lambda i, g: (rn(g, 8, 4), torch.tensor([i % 8]), rn(g, 1, 4)),
                 id="index_copy_kv"),
    pytest.param(m_view_chain_mutation, lambda i, g: (rn(g, 4, 4), rn(g, 2, 4)), id="view_chain_sub_"),
    pytest.param(m_index_add_, lambda i, g: (rn(g, 5, 3), ri(g, 0, 5, 7), rn(g, 7, 3)), id="index_add_"),
    pytest.param(m_scatter_, lambda i, g: (rn(g, 4, 5), ri(g, 0, 5, 4, 2), rn(g, 4, 2)), id="scatter_"),
    pytest.param(m_unsqueeze_view_mutation, lambda i, g: (rn(g, 5),), id="unsqueeze_view_mul_"),
    pytest.param(m_int_counter, lambda i, g: (ri(g, -5, 5, 4),), id="int_tensor_add_"),
    pytest.param(m_mutate_both_inputs, lambda i, g: (rn(g, 4), rn(g, 4)), id="mutate_both_inputs"),
    pytest.param(m_mutation_read_through_view_of_other, _overlap_2d, id="write_read_through_other_view"),
]


@pytest.mark.parametrize("ro", list(RO_VARIANTS))
@pytest.mark.parametrize("fn,make_inputs", MUTATION_CASES)
def test_mutation_and_aliasing(fn, make_inputs, ro):
    with torch.no_grad():
        run_diff(fn, make_inputs, seed=1, ro=RO_VARIANTS[ro])


def test_mutation_input_aliases_a_mutated_buffer():
    """The caller passes the module's own buffer (or a view of it) as the input that forward
    adds into that buffer."""
    class Acc(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("buf", torch.ones(6))

        def forward(self, x):
            self.buf.add_(x)
            return self.buf * 2

    eager, model = Acc(), Acc()
    compiled = torch.compile(model, backend=backend())
    with torch.no_grad():
        for i in range(CALLS):
            if i % 2:
                got, want = compiled(model.buf.view(-1)), eager(eager.buf.view(-1))
            else:
                got, want = compiled(model.buf), eager(eager.buf)
            assert_same(got, want, what=f"call {i}")
            assert_same(model.buf, eager.buf, what=f"call {i}: buffer")


def test_mutation_through_out_argument():
    def fn(x, y, z):
        torch.mul(x, y, out=z)
        torch.add(z, 1, out=x)
        return z.sum(0)

    with torch.no_grad():
        run_diff(fn, lambda i, g: (rn(g, 3, 4), rn(g, 3, 4), rn(g, 3, 4)), seed=2)


def test_mutation_kv_slice_write_python_int_position():
    def fn(cache, new, pos):
        cache[:, pos:pos + 1] = new
        return cache[:, :pos + 1].mean(1)

    positions = [1, 2, 1, 2, 1, 2, 3, 3, 3]
    run_diff(fn, lambda i, g: (rn(g, 3, 6), rn(g, 3, 1), positions[i]), calls=len(positions), seed=2)


class RunningMean(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("rm", torch.zeros(4))

    def forward(self, x):
        self.rm.mul_(0.9).add_(x.mean(0), alpha=0.1)
        return x - self.rm


class KVCacheModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(4, 4)
        self.register_buffer("k", torch.zeros(8, 4))
        self.register_buffer("v", torch.zeros(8, 4))

    def forward(self, x, pos):
        self.k.index_copy_(0, pos, x * 2)
        self.v.index_copy_(0, pos, x.sin())
        att = torch.softmax(self.q(x) @ self.k.t(), -1)
        return att @ self.v


class SliceCacheModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("cache", torch.zeros(6, 4))

    def forward(self, x, pos: int):
        self.cache[pos] = x
        return self.cache.sum(0) * 2


MODULE_MUTATION_CASES = [   # (model, inputs, reference: eager, or aot_eager where AOT changes bits)
    pytest.param(CounterModel, lambda i, g: (rn(g, 4),), None, id="counter_buffer"),
    # mul_(0.9).add_(m, alpha=0.1) is functionalized into ops whose rounding differs from eager's
    pytest.param(RunningMean, lambda i, g: (rn(g, 5, 4),), "aot_eager", id="running_mean_buffer"),
    pytest.param(lambda: nn.BatchNorm1d(4).train(), lambda i, g: (rn(g, 8, 4),), None, id="batchnorm1d_train"),
    pytest.param(lambda: nn.BatchNorm2d(3).train(), lambda i, g: (rn(g, 2, 3, 4, 4),), None, id="batchnorm2d_train"),
    pytest.param(lambda: nn.BatchNorm1d(4, momentum=0.3, affine=False).train(), lambda i, g: (rn(g, 6, 4),), None,
                 id="batchnorm1d_no_affine_momentum"),
    pytest.param(KVCacheModel, lambda i, g: (rn(g, 1, 4), torch.tensor([i % 8])), None, id="kv_cache_index_copy"),
    pytest.param(SliceCacheModel, lambda i, g: (rn(g, 4), [0, 1, 0, 1, 2, 0, 1, 2][i]), None,
                 id="kv_cache_python_int_slot"),
]


@pytest.mark.parametrize("warmup_iters", [1, 0, 2], ids=["warmup1", "warmup0", "warmup2"])
@pytest.mark.parametrize("make_model,make_inputs,ref", MODULE_MUTATION_CASES)
def test_buffer_mutation(make_model, make_inputs, ref, warmup_iters):
    """Buffers mutated once per call, whatever the number of warm-up runs (an extra run during
    capture would apply the mutation twice)."""
    b = run_module_diff(make_model, make_inputs, calls=8, seed=3, ref=ref, ro=dict(warmup_iters=warmup_iters))
    assert total(b, "replays") >= 2


def test_batchnorm_train_mode_with_grad_updates_stats_and_grads():
    torch.manual_seed(4)
    eager = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU())
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, backend=backend())
    for i in range(CALLS):
        x = rn(gen(i), 8, 4)
        for m in (eager, model):
            m.zero_grad(set_to_none=True)
        want = eager(x)
        want.square().sum().backward()
        got = compiled(x)
        assert_same(got, want, what=f"call {i}")
        got.square().sum().backward()
        assert_state(model, eager, what=f"call {i}", grads=True)


class ScaledLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))
        self.register_buffer("shift", torch.zeros(4))

    def forward(self, x):
        return x @ (self.w * 2).t() + self.shift.exp()


STATIC_CHANGES = {   # applied to both models (no_grad) before some calls
    "param_add_": lambda m, i: m.w.add_(0.1 * i),
    "buffer_fill_": lambda m, i: m.shift.fill_(0.01 * i),
    "param_data_reassigned": lambda m, i: setattr(m.w, "data", m.w.data * 1.5 + i),
    "param_replaced": lambda m, i: setattr(m, "w", nn.Parameter(m.w.detach() * 0.5 + i)),
    "buffer_reassigned": lambda m, i: setattr(m, "shift", m.shift + 1),
    "load_state_dict": lambda m, i: m.load_state_dict({"w": torch.full((4, 4), 0.1 * i),
                                                       "shift": torch.full((4,), -0.1 * i)}),
}


@pytest.mark.parametrize("change", list(STATIC_CHANGES))
def test_static_inputs_changed_between_calls(change):
    """Parameters and buffers are baked in at capture: changes between calls (in place, moved,
    replaced) must still be seen, never a stale or folded value."""
    torch.manual_seed(5)
    eager = ScaledLinear()
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, backend=backend())
    with torch.no_grad():
        for i in range(9):
            if i in (3, 5, 6, 8):
                STATIC_CHANGES[change](eager, i)
                STATIC_CHANGES[change](model, i)
            x = rn(gen(i), 3, 4)
            assert_same(compiled(x), eager(x), what=f"call {i}")
            assert_state(model, eager, what=f"call {i}")


class ReturnsState(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 4))
        self.register_buffer("buf", torch.zeros(4))

    def forward(self, x):
        return x @ self.w.t(), self.w.t(), self.buf


def _caller_mutation_case(kind):
    """(callable to compile, make inputs, index of the output the caller writes to, module or None)"""
    if kind == "folded_constant":
        return (lambda x: (x + 1, torch.arange(4.0) * 2)), lambda i, g: (rn(g, 4),), 1, None
    if kind == "intermediate":
        return (lambda x: (x.sin(), x.cos())), lambda i, g: (rn(g, 5),), 0, None
    if kind == "view_of_other_output":
        def fn(x):
            y = x * 2
            return y, y.t()
        return fn, lambda i, g: (rn(g, 3, 3),), 0, None
    if kind == "input_alias":
        return (lambda x: (x.view(-1), x * 2)), lambda i, g: (rn(g, 2, 3),), 0, None
    if kind == "parameter_view":
        return None, lambda i, g: (rn(g, 2, 4),), 1, ReturnsState
    return None, lambda i, g: (rn(g, 2, 4),), 2, ReturnsState   # "buffer_returned"


@pytest.mark.parametrize("ro", list(RO_VARIANTS))
@pytest.mark.parametrize("kind", ["folded_constant", "intermediate", "view_of_other_output", "input_alias",
                                  "parameter_view", "buffer_returned"])
def test_caller_writes_into_outputs_between_calls(kind, ro):
    """The caller writes into an output after each call (as eager code may): what the write
    reaches (other outputs, inputs, parameters) and the next calls' results must match eager."""
    fn, make, k, model_cls = _caller_mutation_case(kind)
    torch.manual_seed(6)
    if model_cls is not None:
        eager = model_cls()
        model = copy.deepcopy(eager)
        compiled, reference = torch.compile(model, backend=backend(**RO_VARIANTS[ro])), eager
    else:
        compiled, reference = torch.compile(fn, backend=backend(**RO_VARIANTS[ro])), fn
    with torch.no_grad():
        for i in range(7):
            args, args_ref = make(i, gen(i)), make(i, gen(i))
            got, want = compiled(*args), reference(*args_ref)
            assert_same(got, want, what=f"call {i}")
            got[k].add_(100 + i)
            want[k].add_(100 + i)
            assert_same(got, want, what=f"call {i}: outputs after the caller's write")
            assert_same(args, args_ref, what=f"call {i}: inputs after the caller's write")
            if model_cls is not None:
                assert_state(model, eager, what=f"call {i}: state after the caller's write")
