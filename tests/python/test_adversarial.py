"""Adversarial differential tests: torchreplay's "reduce-overhead" mode against eager PyTorch.

Every case calls the compiled function at least six times with fresh inputs (with the default
warmup_iters=1: call 1 warms up, call 2 captures, later calls replay) and compares each call's
outputs, and every mutated input, buffer, parameter and .grad, with an eager run on identical
inputs and cloned state. Bitwise (torch.equal semantics, NaNs equal) unless a case says otherwise.

Categories: 1 input mutation and aliasing, 2 fed-back outputs and views, 3 reduced precision,
4 foreach ops and optimizer steps, 5 training patterns, 6 dynamic shapes and symbolic arithmetic,
7 data-dependent ops, 8 misc numerics, 9 threads, 10 memory (many calls, captures constant, gc).
"""
import copy
import gc
import math
import threading
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils import _pytree as pytree

import torchreplay
from configs import backend

CALLS = 6
# reduce_overhead settings that change how outputs are handed out and when capture happens
RO_VARIANTS = {"default": {}, "clone_outputs": dict(clone_outputs=True), "warmup0": dict(warmup_iters=0)}


@pytest.fixture(autouse=True)
def _recompile_limits():
    """Cases that change Python ints, modes or sizes recompile: never hit Dynamo's limit."""
    with torch._dynamo.config.patch(cache_size_limit=64):
        yield


# ------------------------------------------------------------------------------------------------
# helpers


def total(backend, key):
    return sum(s[key] for s in backend.stats())


def gen(seed):
    return torch.Generator().manual_seed(seed)


def rn(g, *shape, dtype=torch.float32):
    return torch.randn(shape, generator=g).to(dtype)


def ri(g, lo, hi, *shape, dtype=torch.int64):
    return torch.randint(lo, hi, shape, generator=g).to(dtype)


def assert_same(got, want, exact=True, rtol=None, atol=None, what="output"):
    """Recursive comparison; exact means bitwise equal values (NaNs in the same places)."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{what}: got {type(got).__name__}, want a tensor"
        assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != eager's {want.dtype}"
        assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != eager's {tuple(want.shape)}"
        got, want = got.detach(), want.detach()
        if exact:
            torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True,
                                       msg=lambda m: f"{what} (bitwise): {m}")
        else:
            torch.testing.assert_close(got, want, rtol=rtol, atol=atol, equal_nan=True,
                                       msg=lambda m: f"{what}: {m}")
    elif isinstance(want, (tuple, list)):
        assert isinstance(got, (tuple, list)), f"{what}: got {type(got).__name__}, want a sequence"
        assert len(got) == len(want), f"{what}: {len(got)} values, eager has {len(want)}"
        for k, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, exact, rtol, atol, f"{what}[{k}]")
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), f"{what}: keys differ"
        for k in want:
            assert_same(got[k], want[k], exact, rtol, atol, f"{what}[{k!r}]")
    elif isinstance(want, float) and math.isnan(want):
        assert isinstance(got, float) and math.isnan(got), f"{what}: {got!r} != nan"
    else:
        assert got == want, f"{what}: {got!r} != eager's {want!r}"


def _tensors(tree):
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _sid(t):
    return t.untyped_storage().data_ptr()


def check_aliasing(got, want, args, args_ref, what):
    """An output is a view of input j exactly when eager's is (same offset and strides), an
    output eager computes fresh never shares memory with an input, and two outputs share memory
    exactly when eager's do (so writing through one shows in the other as in eager)."""
    gi, wi = _tensors(args), _tensors(args_ref)
    go, wo = _tensors(got), _tensors(want)
    for k, (g, w) in enumerate(zip(go, wo)):
        if w.numel() == 0:
            continue
        assert g.stride() == w.stride(), f"{what}: output {k} strides {g.stride()} != eager's {w.stride()}"
        w_out = [j for j, o in enumerate(wo) if j != k and o.numel() and _sid(o) == _sid(w)]
        g_out = [j for j, o in enumerate(go) if j != k and o.numel() and _sid(o) == _sid(g)]
        assert g_out == w_out, (f"{what}: output {k} shares memory with outputs {g_out}, "
                                f"eager's with {w_out}")
        w_alias = [j for j, a in enumerate(wi) if a.numel() and _sid(a) == _sid(w)]
        g_alias = [j for j, a in enumerate(gi) if a.numel() and _sid(a) == _sid(g)]
        assert g_alias == w_alias, (f"{what}: output {k} shares memory with inputs {g_alias}, "
                                    f"eager's with {w_alias}")
        if w_alias:
            assert (g.storage_offset(), g.stride()) == (w.storage_offset(), w.stride()), (
                f"{what}: output {k} is a different view of its input: offset/strides "
                f"{g.storage_offset()}/{g.stride()} vs eager's {w.storage_offset()}/{w.stride()}")


def run_diff(fn, make_inputs, *, calls=CALLS, dynamic=False, exact=True, rtol=None, atol=None,
             ro=None, ref=None, seed=0, check_alias=True, require_replay=True, eager_reason=None):
    """Compiles fn with torchreplay and compares it, call by call, with `ref` (eager fn, or
    "aot_eager") on identical fresh inputs made by make_inputs(i, generator). With eager_reason,
    the graph is expected to run eagerly, the backend saying why (a reason containing it)."""
    b = backend(**(ro or {}))
    compiled = torch.compile(fn, backend=b, dynamic=dynamic)
    if ref == "aot_eager":
        reference = torch.compile(fn, backend="aot_eager", dynamic=dynamic)
    else:
        reference = ref or fn
    for i in range(calls):
        args = make_inputs(i, gen(seed * 1000 + i))
        args_ref = make_inputs(i, gen(seed * 1000 + i))
        want = reference(*args_ref)
        got = compiled(*args)
        assert_same(got, want, exact, rtol, atol, f"call {i}: output")
        assert_same(args, args_ref, exact, rtol, atol, f"call {i}: inputs after the call")
        if check_alias:
            check_aliasing(got, want, args, args_ref, f"call {i}")
    if eager_reason is None:
        assert_exercised(b, require_replay)
    else:
        assert any(eager_reason in r for r in b.eager_graphs.values()), b.eager_graphs
    return b


def assert_state(model, eager, exact=True, rtol=None, atol=None, what="", grads=False):
    got = dict(model.named_parameters())
    got.update(model.named_buffers())
    want = dict(eager.named_parameters())
    want.update(eager.named_buffers())
    assert got.keys() == want.keys(), f"{what}: state names differ"
    for k in want:
        assert_same(got[k], want[k], exact, rtol, atol, f"{what}: {k}")
        if grads:
            gg, wg = got[k].grad, want[k].grad
            assert (gg is None) == (wg is None), f"{what}: {k}.grad is {gg} vs eager's {wg}"
            if wg is not None:
                assert_same(gg, wg, exact, rtol, atol, f"{what}: {k}.grad")


def run_module_diff(make_model, make_inputs, *, calls=CALLS, dynamic=False, exact=True, rtol=None,
                    atol=None, ro=None, seed=0, grad=False, ref=None):
    """Compiles a deep copy of make_model() and compares outputs, inputs and every parameter and
    buffer with the eager model (or the model compiled with ref="aot_eager") after each call."""
    torch.manual_seed(seed)
    eager = make_model()
    model = copy.deepcopy(eager)
    b = backend(**(ro or {}))
    compiled = torch.compile(model, backend=b, dynamic=dynamic)
    reference = torch.compile(eager, backend="aot_eager", dynamic=dynamic) if ref == "aot_eager" else eager
    with torch.set_grad_enabled(grad):
        for i in range(calls):
            args = make_inputs(i, gen(seed * 1000 + i))
            args_ref = make_inputs(i, gen(seed * 1000 + i))
            want = reference(*args_ref)
            got = compiled(*args)
            assert_same(got, want, exact, rtol, atol, f"call {i}: output")
            assert_same(args, args_ref, exact, rtol, atol, f"call {i}: inputs after the call")
            assert_state(model, eager, exact, rtol, atol, f"call {i}")
    assert_exercised(b)
    return b


def assert_exercised(b, require_replay=True):
    """The case really ran through torchreplay (Dynamo did not hand everything back to eager)."""
    assert total(b, "calls") > 0, "torchreplay never ran: Dynamo compiled nothing"
    if require_replay:
        assert total(b, "replays") > 0, f"torchreplay never replayed: {b.stats()}"


def touch_or_documented_error(t, want, what):
    """Default config: an output kept across a later call either still holds its value or raises
    the documented error; it never silently shows other data."""
    try:
        value = t.clone()
    except RuntimeError as e:
        assert "reused its memory" in str(e), f"{what}: unexpected error {e}"
        return False
    assert_same(value, want, what=what)
    return True


# ================================================================================================
# 1. Input mutation and aliasing


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


class CounterModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        self.count += 1
        return x * self.count


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


# ================================================================================================
# 2. Fed-back outputs and views


def feedback_loop(fn, make_state, make_x, *, feed=lambda out: (out,), steps=8, ro=None, seed=0,
                  exact=True, rtol=None, atol=None):
    """state = feed(fn(*x, *state)) for fresh x each step, compiled vs eager."""
    b = backend(**(ro or {}))
    compiled = torch.compile(fn, backend=b)
    st_c, st_e = make_state(gen(seed)), make_state(gen(seed))
    with torch.no_grad():
        for i in range(steps):
            xs_c, xs_e = make_x(i, gen(seed * 1000 + i)), make_x(i, gen(seed * 1000 + i))
            out_c = compiled(*xs_c, *st_c)
            out_e = fn(*xs_e, *st_e)
            assert_same(out_c, out_e, exact, rtol, atol, f"step {i}")
            st_c, st_e = feed(out_c), feed(out_e)
    assert_exercised(b)
    return b


def _make_cell(kind):
    torch.manual_seed(5)
    if kind == "tanh_rnn_custom":
        W, U, bias = torch.randn(6, 5) * 0.5, torch.randn(5, 5) * 0.5, torch.randn(5)

        def fn(x, h):
            return torch.tanh(x @ W + h @ U + bias)
        return fn, lambda g: (rn(g, 3, 5),), lambda out: (out,)
    if kind == "rnn_cell":
        cell = nn.RNNCell(6, 5)
        return (lambda x, h: cell(x, h)), lambda g: (rn(g, 3, 5),), lambda out: (out,)
    if kind == "lstm_cell":
        cell = nn.LSTMCell(6, 5)
        return (lambda x, h, c: cell(x, (h, c))), lambda g: (rn(g, 3, 5), rn(g, 3, 5)), lambda out: tuple(out)
    cell = nn.GRUCell(6, 5)
    return (lambda x, h: cell(x, h)), lambda g: (rn(g, 3, 5),), lambda out: (out,)


@pytest.mark.parametrize("ro", list(RO_VARIANTS))
@pytest.mark.parametrize("kind", ["tanh_rnn_custom", "rnn_cell", "lstm_cell", "gru_cell"])
def test_fedback_recurrent_cell(kind, ro):
    fn, make_state, feed = _make_cell(kind)
    feedback_loop(fn, make_state, lambda i, g: (rn(g, 3, 6),), feed=feed, steps=8, ro=RO_VARIANTS[ro], seed=6)


FEED_VIEWS = {
    "block": lambda o: o[:4, :4],
    "dense_rows": lambda o: o.view(16, 4)[4:8],
    "strided": lambda o: o[::2, 1::2],
    "transposed": lambda o: o[2:6, 2:6].t(),
    "expanded": lambda o: o[3, :4].expand(4, 4),
    "offset_flat": lambda o: o.view(-1)[5:21].view(4, 4),
}


def _feed_fn(x, h):
    return torch.tanh(x + h.repeat(2, 2) * 0.75)


@pytest.mark.parametrize("ro", list(RO_VARIANTS))
@pytest.mark.parametrize("view", list(FEED_VIEWS))
def test_fedback_view_of_output(view, ro):
    take = FEED_VIEWS[view]
    feedback_loop(_feed_fn, lambda g: (rn(g, 4, 4),), lambda i, g: (rn(g, 8, 8),),
                  feed=lambda out: (take(out),), steps=8, ro=RO_VARIANTS[ro], seed=7)


class EMA(nn.Module):
    def __init__(self, return_avg=False):
        super().__init__()
        self.return_avg = return_avg
        self.register_buffer("avg", torch.zeros(4))

    def forward(self, x):
        self.avg = self.avg * 0.9 + x.mean(0)
        if self.return_avg:
            return x - self.avg, self.avg
        return x - self.avg


@pytest.mark.parametrize("return_avg", [False, True], ids=["ema_buffer_reassigned", "ema_buffer_reassigned_and_returned"])
def test_fedback_ema_buffer_reassigned_in_forward(return_avg):
    run_module_diff(lambda: EMA(return_avg), lambda i, g: (rn(g, 5, 4),), calls=8, seed=8)


def test_fedback_ema_buffer_reassigned_clone_outputs():
    run_module_diff(EMA, lambda i, g: (rn(g, 5, 4),), calls=8, seed=8, ro=dict(clone_outputs=True))


def test_keepalive_clone_outputs_keeps_every_output():
    fn = lambda x: (torch.sin(x) + 1, x.cumsum(0) * 2)  # noqa: E731
    compiled = torch.compile(fn, backend=backend(clone_outputs=True))
    xs = [rn(gen(i), 6, 3) for i in range(8)]
    outs = [compiled(x) for x in xs]
    for i, (x, out) in enumerate(zip(xs, outs)):
        assert_same(out, fn(x), what=f"kept output of call {i}")


def test_keepalive_clone_outputs_module_outputs_and_slices():
    torch.manual_seed(9)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh()).eval()
    compiled = torch.compile(model, backend=backend(clone_outputs=True))
    with torch.no_grad():
        xs = [rn(gen(i), 3, 4) for i in range(8)]
        kept = [compiled(x)[1:] for x in xs]
        for i, (x, k) in enumerate(zip(xs, kept)):
            assert_same(k, model(x)[1:], what=f"kept slice of call {i}")


def test_keepalive_default_config_documented_error_or_value():
    fn = lambda x: torch.exp(x) - x  # noqa: E731
    compiled = torch.compile(fn, backend=backend())
    kept = []
    for i in range(8):
        x = rn(gen(i), 7)
        out = compiled(x)
        assert_same(out, fn(x), what=f"call {i} right away")
        kept.append((out, fn(x)))
    for i, (out, want) in enumerate(kept):
        touch_or_documented_error(out, want, f"output of call {i} touched after call 7")
    # The last output has not been superseded: it must still be valid.
    assert_same(kept[-1][0], kept[-1][1], what="latest output")


def test_fedback_output_mutated_in_place_by_the_graph():
    def fn(x, h):
        h.mul_(0.5).add_(x)
        return torch.tanh(h) + 0.1

    compiled = torch.compile(fn, backend=backend())
    h_c, h_e = rn(gen(0), 5), rn(gen(0), 5)
    for i in range(8):
        x = rn(gen(100 + i), 5)
        prev_c, prev_e = h_c, h_e
        h_c = compiled(x, prev_c)
        h_e = fn(x, prev_e)
        assert_same(h_c, h_e, what=f"step {i}")
        touch_or_documented_error(prev_c, prev_e, f"step {i}: mutated fed-back input")


def test_fedback_across_two_compiled_functions():
    f1 = lambda h: torch.sin(h) * 1.5 + 0.25  # noqa: E731
    f2 = lambda y: torch.tanh(y @ y.t()) + y  # noqa: E731
    c1 = torch.compile(f1, backend=backend())
    c2 = torch.compile(f2, backend=backend())
    h_c = h_e = rn(gen(1), 4, 4)
    for i in range(8):
        h_c = c2(c1(h_c))
        h_e = f2(f1(h_e))
        assert_same(h_c, h_e, what=f"step {i}")


def test_fedback_output_passed_as_both_arguments():
    fn = lambda a, b: a * 0.5 + torch.sin(b)  # noqa: E731
    compiled = torch.compile(fn, backend=backend())
    h_c = h_e = rn(gen(2), 6)
    for i in range(8):
        h_c = compiled(h_c, h_c)
        h_e = fn(h_e, h_e)
        assert_same(h_c, h_e, what=f"step {i}")


def test_fedback_alternating_with_fresh_inputs():
    fn = lambda h: torch.cos(h) * 2 - h  # noqa: E731
    compiled = torch.compile(fn, backend=backend())
    h_c = h_e = rn(gen(3), 3, 3)
    for i in range(10):
        if i % 3 == 2:
            h_c = h_e = rn(gen(50 + i), 3, 3)
        h_c = compiled(h_c)
        h_e = fn(h_e)
        assert_same(h_c, h_e, what=f"step {i}")


def test_fedback_second_output_which_is_a_view():
    def fn(h):
        y = torch.tanh(h * 1.1 + 0.2)
        return y, y[1:]

    compiled = torch.compile(fn, backend=backend())
    h_c = h_e = rn(gen(4), 6, 3)
    for i in range(8):
        full_c, part_c = compiled(h_c)
        full_e, part_e = fn(h_e)
        assert_same((full_c, part_c), (full_e, part_e), what=f"step {i}")
        h_c = torch.cat([part_c, part_c[:1]])  # eager op on a pool view, then fed back
        h_e = torch.cat([part_e, part_e[:1]])


def test_fedback_two_outputs_one_a_view_of_the_other():
    def fn(a, b):
        y = torch.tanh(a * 0.9 + b.sum(0))
        return y, y[2:]

    compiled = torch.compile(fn, backend=backend())
    st_c = st_e = (rn(gen(0), 5, 3), rn(gen(1), 3, 3))
    for i in range(8):
        out_c, out_e = compiled(*st_c), fn(*st_e)
        assert_same(out_c, out_e, what=f"step {i}")
        st_c, st_e = out_c, out_e


def test_fedback_after_caller_writes_into_it():
    fn = lambda x, h: torch.sigmoid(h @ x) - 0.5  # noqa: E731
    compiled = torch.compile(fn, backend=backend())
    h_c = h_e = rn(gen(2), 4, 4)
    for i in range(8):
        x = rn(gen(20 + i), 4, 4)
        h_c, h_e = compiled(x, h_c), fn(x, h_e)
        assert_same(h_c, h_e, what=f"step {i}")
        h_c[0].mul_(3)
        h_e[0].mul_(3)
        h_c.t()[1].add_(1)
        h_e.t()[1].add_(1)


@pytest.mark.parametrize("dynamic", [True, False], ids=["one_graph_two_keys", "two_graphs"])
def test_fedback_across_keys_sharing_the_arena(dynamic):
    """The output of one key is read by a call of the other key, whose replay writes the same
    per-thread arena."""
    fn = lambda x, h: (x * h.mean() + 1, torch.cumsum(x, 0))  # noqa: E731
    compiled = torch.compile(fn, backend=backend(), dynamic=dynamic)
    h_c = h_e = rn(gen(3), 6)
    for i in range(10):
        x = rn(gen(30 + i), 4 if i % 2 else 7)
        out_c, out_e = compiled(x, h_c), fn(x, h_e)
        assert_same(out_c, out_e, what=f"call {i}")
        h_c, h_e = out_c[i % 2], out_e[i % 2]


def test_fedback_plain_tensor_attribute_state():
    class Stateful(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.h = torch.zeros(2, 4)

        def forward(self, x):
            self.h = torch.tanh(self.lin(x) + self.h)
            return self.h * 2

    torch.manual_seed(8)
    eager = Stateful()
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, backend=backend())
    with torch.no_grad():
        for i in range(8):
            x = rn(gen(i), 2, 4)
            assert_same(compiled(x), eager(x), what=f"call {i}")
            assert_same(model.h, eager.h, what=f"call {i}: state")


@pytest.mark.parametrize("ret", ["slice", "transpose", "strided", "unsqueeze"])
def test_fedback_graph_returns_a_view(ret):
    views = {"slice": lambda y: y[1:5], "transpose": lambda y: y[:4].t(),
             "strided": lambda y: y[::2], "unsqueeze": lambda y: y[:4].unsqueeze(0)[0]}

    def fn(x, h):
        y = torch.cat([torch.tanh(h * 0.8 + x), h[:1]])      # (5, 4) from (4, 4)
        return views[ret](y) if ret != "strided" else views[ret](torch.cat([y, y[:3]]))

    compiled = torch.compile(fn, backend=backend())
    h_c = h_e = rn(gen(4), 4, 4)
    for i in range(8):
        x = rn(gen(40 + i), 4, 4)
        h_c, h_e = compiled(x, h_c), fn(x, h_e)
        assert_same(h_c, h_e, what=f"step {i}")
        assert h_c.stride() == h_e.stride(), f"step {i}: strides {h_c.stride()} vs {h_e.stride()}"


def _with_graph_break(x, h):
    a = torch.sin(x) + h * 0.5
    torch._dynamo.graph_break()
    b = torch.tanh(a @ h.t()) + h
    return b, a


def test_fedback_through_a_graph_break():
    """Two engines per call: the second reads the first's outputs and its own previous one."""
    b = backend()
    compiled = torch.compile(_with_graph_break, backend=b)
    h_c = h_e = rn(gen(5), 3, 3)
    for i in range(8):
        x = rn(gen(50 + i), 3, 3)
        (h_c, a_c), (h_e, a_e) = compiled(x, h_c), _with_graph_break(x, h_e)
        assert_same((h_c, a_c), (h_e, a_e), what=f"step {i}")
    assert len(b.stats()) == 2 and total(b, "replays") >= 10


def test_train_through_a_graph_break():
    class Broken(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 3)

        def forward(self, x):
            y = F.gelu(self.a(x))
            torch._dynamo.graph_break()
            return self.b(y)

    train_compare(Broken, xy, step_basic, seed=34)


def test_fedback_dynamic_sizes():
    fn = lambda x, h: torch.tanh(x + h * (h.shape[0] // 2))  # noqa: E731
    compiled = torch.compile(fn, backend=backend(), dynamic=True)
    for n in (5, 7, 5):
        h_c = h_e = rn(gen(n), n, 3)
        for i in range(5):
            x = rn(gen(100 * n + i), n, 3)
            h_c, h_e = compiled(x, h_c), fn(x, h_e)
            assert_same(h_c, h_e, what=f"size {n} step {i}")


# ================================================================================================
# 3. Reduced precision

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


# ================================================================================================
# 4. foreach ops and optimizer steps


class ForeachModel(nn.Module):
    def __init__(self, op, target):
        super().__init__()
        self.op = op
        if target == "buffers":
            for k in range(3):
                self.register_buffer(f"t{k}", torch.randn(4))
        else:
            for k in range(3):
                setattr(self, f"t{k}", nn.Parameter(torch.randn(4)))

    def forward(self, x):
        ts = [self.t0, self.t1, self.t2]
        with torch.no_grad():
            if self.op == "add_scalar":
                torch._foreach_add_(ts, 1.0)
            elif self.op == "mul_scalar":
                torch._foreach_mul_(ts, 0.9)
            elif self.op == "add_list":
                torch._foreach_add_(ts, [x[0], x[1], x[2]], alpha=0.5)
            elif self.op == "addcmul":
                torch._foreach_addcmul_(ts, [x[0], x[1], x[2]], [x[2], x[1], x[0]], value=0.5)
            else:  # lerp toward x
                torch._foreach_lerp_(ts, [x[0], x[1], x[2]], 0.25)
        return x * torch.stack(ts)


@pytest.mark.parametrize("target", ["buffers", "parameters"])
@pytest.mark.parametrize("op", ["add_scalar", "mul_scalar", "add_list", "addcmul", "lerp"])
def test_foreach_in_forward(op, target):
    run_module_diff(lambda: ForeachModel(op, target), lambda i, g: (rn(g, 3, 4),), calls=7, seed=12)


def test_foreach_on_input_lists():
    def fn(a, b, c, x):
        torch._foreach_add_([a, b, c], [x, x * 2, x * 3])
        torch._foreach_mul_([a, b, c], 0.5)
        return a + b + c

    run_diff(fn, lambda i, g: tuple(rn(g, 5) for _ in range(4)), seed=13)


def test_foreach_functional_outputs():
    def fn(a, b):
        outs = torch._foreach_addcmul([a, b], [a.flip(0), b.t().reshape(3, 2)], [a * a, b], value=2.0)
        return torch._foreach_sqrt(torch._foreach_abs(outs))

    run_diff(fn, lambda i, g: (rn(g, 6), rn(g, 3, 2)), seed=14)


OPT_CASES = [
    pytest.param(torch.optim.SGD, dict(lr=0.1), id="sgd"),
    pytest.param(torch.optim.SGD, dict(lr=0.1, momentum=0.9), id="sgd_momentum"),
    pytest.param(torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True), id="sgd_nesterov"),
    pytest.param(torch.optim.SGD, dict(lr=0.05, momentum=0.8, dampening=0.1, weight_decay=0.01),
                 id="sgd_weight_decay_dampening"),
    pytest.param(torch.optim.Adam, dict(lr=0.01), id="adam"),
    pytest.param(torch.optim.Adam, dict(lr=0.01, weight_decay=0.1, amsgrad=True), id="adam_wd_amsgrad"),
    pytest.param(torch.optim.AdamW, dict(lr=0.01, weight_decay=0.05), id="adamw"),
]


def _opt_state_tensors(opt):
    return [v for st in opt.state.values() for _, v in sorted(st.items()) if isinstance(v, torch.Tensor)]


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "for_loop"])
@pytest.mark.parametrize("opt_cls,kwargs", OPT_CASES)
def test_compiled_optimizer_step(opt_cls, kwargs, foreach):
    """opt.step() compiled with torchreplay, against the step compiled with aot_eager (bitwise) and
    the same optimizer run eagerly (bitwise for foreach SGD; otherwise close: the compiled
    single-tensor SGD and Adam steps are functionalized / compute bias corrections on tensors,
    which changes the last bits under aot_eager too)."""
    torch.manual_seed(15)
    shapes = [(5, 4), (4,), (3, 2, 2)]
    init = [torch.randn(s) for s in shapes]
    sets = [[nn.Parameter(t.clone()) for t in init] for _ in range(3)]   # replay, eager, aot_eager
    opts = [opt_cls(ps, foreach=foreach, **kwargs) for ps in sets]
    b = backend()

    def step_replay():
        opts[0].step()

    def step_aot():
        opts[2].step()

    steps = [torch.compile(step_replay, backend=b), opts[1].step,
             torch.compile(step_aot, backend="aot_eager")]
    bitwise_vs_eager = opt_cls is torch.optim.SGD and foreach
    for i in range(7):
        g = gen(1000 + i)
        grads = [rn(g, *s) for s in shapes]
        for ps in sets:
            for p, gr in zip(ps, grads):
                p.grad = gr.clone()
        for st in steps:
            st()
        for k, (p_c, p_e, p_a) in enumerate(zip(*sets)):
            assert_same(p_c, p_a, what=f"step {i}: param {k} vs aot_eager")
            if bitwise_vs_eager:
                assert_same(p_c, p_e, what=f"step {i}: param {k} vs eager")
            else:
                assert_same(p_c, p_e, exact=False, rtol=1e-5, atol=1e-6, what=f"step {i}: param {k} vs eager")
        assert_same(_opt_state_tensors(opts[0]), _opt_state_tensors(opts[2]), what=f"step {i}: optimizer state")
    assert total(b, "replays") >= 3


# ================================================================================================
# 5. Training patterns


def train_compare(make_model, make_batch, step, *, steps=6, seed=0, lr=0.05, exact=True, rtol=None,
                  atol=None, ro=None):
    """Runs step(callable, module, optimizer, batch, i) with the eager model and with the compiled
    copy; compares what it returns, the batch (and its .grad), parameters, grads and buffers."""
    torch.manual_seed(seed)
    eager = make_model()
    model = copy.deepcopy(eager)
    b = backend(**(ro or {}))
    compiled = torch.compile(model, backend=b)
    opt_e = torch.optim.SGD(eager.parameters(), lr=lr, momentum=0.5)
    opt_c = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.5)
    for i in range(steps):
        batch_e, batch_c = make_batch(i, gen(seed * 1000 + i)), make_batch(i, gen(seed * 1000 + i))
        want = step(eager, eager, opt_e, batch_e, i)
        got = step(compiled, model, opt_c, batch_c, i)
        assert_same(got, want, exact, rtol, atol, f"step {i}: returned values")
        assert_same(batch_c, batch_e, exact, rtol, atol, f"step {i}: batch")
        for k, (tc, te) in enumerate(zip(_tensors(batch_c), _tensors(batch_e))):
            assert (tc.grad is None) == (te.grad is None), f"step {i}: batch tensor {k}.grad presence"
            if te.grad is not None:
                assert_same(tc.grad, te.grad, exact, rtol, atol, f"step {i}: batch tensor {k}.grad")
        assert_state(model, eager, exact, rtol, atol, f"step {i}", grads=True)
    assert_exercised(b)
    return b


def mlp(act=nn.ReLU):
    return lambda: nn.Sequential(nn.Linear(6, 16), act(), nn.Linear(16, 3))


def xy(i, g):
    return rn(g, 8, 6), rn(g, 8, 3)


def step_basic(f, m, opt, batch, i):
    x, y = batch
    opt.zero_grad()
    loss = F.mse_loss(f(x), y)
    loss.backward()
    opt.step()
    return loss.detach()


@pytest.mark.parametrize("act", [nn.ReLU, nn.GELU, nn.Tanh, nn.SiLU], ids=["relu", "gelu", "tanh", "silu"])
def test_train_mlp_steps(act):
    b = train_compare(mlp(act), xy, step_basic, seed=20)
    assert total(b, "replays") >= 6


def test_train_small_convnet():
    def make():
        return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(4, 4, 3), nn.Flatten(), nn.Linear(16, 3))

    def batch(i, g):
        return rn(g, 2, 2, 8, 8), ri(g, 0, 3, 2)

    def step(f, m, opt, b, i):
        x, y = b
        opt.zero_grad()
        loss = F.cross_entropy(f(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    train_compare(make, batch, step, seed=21)


@pytest.mark.parametrize("ro", list(RO_VARIANTS))
@pytest.mark.parametrize("accum", [2, 3])
def test_train_gradient_accumulation(accum, ro):
    def batch(i, g):
        return [xy(i, g) for _ in range(accum)]

    def step(f, m, opt, micro, i):
        opt.zero_grad()
        losses = []
        for x, y in micro:
            loss = F.mse_loss(f(x), y) / accum
            loss.backward()
            losses.append(loss.detach())
        opt.step()
        return losses

    train_compare(mlp(), batch, step, seed=22, ro=RO_VARIANTS[ro])


@pytest.mark.parametrize("ro", list(RO_VARIANTS))
def test_train_two_forwards_one_backward(ro):
    def batch(i, g):
        return xy(i, g) + xy(i, g)

    def step(f, m, opt, b, i):
        x1, y1, x2, y2 = b
        opt.zero_grad()
        loss = F.mse_loss(f(x1), y1) + F.mse_loss(f(x2), y2)
        loss.backward()
        opt.step()
        return loss.detach()

    train_compare(mlp(), batch, step, seed=23, ro=RO_VARIANTS[ro])


def test_train_bptt_rnn_cell_three_steps_one_backward():
    def batch(i, g):
        return rn(g, 3, 3, 4), rn(g, 3, 5)

    def step(f, m, opt, b, i):
        xs, target = b
        opt.zero_grad()
        h = torch.zeros(3, 5)
        for t in range(3):
            h = f(xs[t], h)
        loss = F.mse_loss(h, target)
        loss.backward()
        opt.step()
        return loss.detach()

    train_compare(lambda: nn.RNNCell(4, 5), batch, step, seed=24)


def test_train_retain_graph_double_backward_of_sum():
    def step(f, m, opt, b, i):
        x, y = b
        opt.zero_grad()
        loss = (f(x) * y).sum()
        loss.backward(retain_graph=True)
        loss.backward()
        opt.step()
        return loss.detach()

    train_compare(mlp(), xy, step, seed=25)


def test_train_no_grad_inference_interleaved():
    def batch(i, g):
        return xy(i, g) + (rn(g, 5, 6),)

    def step(f, m, opt, b, i):
        x, y, x_eval = b
        with torch.no_grad():
            before = f(x_eval)
            before = before.clone()
        opt.zero_grad()
        loss = F.mse_loss(f(x), y)
        loss.backward()
        opt.step()
        with torch.no_grad():
            after = f(x_eval)
        return before, loss.detach(), after

    train_compare(mlp(), batch, step, seed=26)


def test_train_detach_inside_loss():
    def step(f, m, opt, b, i):
        x, y = b
        opt.zero_grad()
        out = f(x)
        loss = ((out - out.detach().mean(0)) ** 2).mean() + F.mse_loss(out, y)
        loss.backward()
        opt.step()
        return loss.detach(), out.detach()

    train_compare(mlp(), xy, step, seed=27)


def test_train_input_requires_grad():
    def batch(i, g):
        x, y = xy(i, g)
        return x.requires_grad_(), y

    def step(f, m, opt, b, i):
        x, y = b
        opt.zero_grad()
        loss = F.mse_loss(f(x), y) + x.pow(2).mean()
        loss.backward()
        opt.step()
        return loss.detach()

    train_compare(mlp(nn.Tanh), batch, step, seed=28)


def test_train_autograd_grad_wrt_input_only():
    def batch(i, g):
        return (rn(g, 8, 6).requires_grad_(),)

    def step(f, m, opt, b, i):
        (x,) = b
        out = f(x)
        (gx,) = torch.autograd.grad(out.square().sum(), x)
        return out.detach(), gx

    train_compare(mlp(nn.SiLU), batch, step, seed=29)


def test_train_eval_train_switching_with_batchnorm():
    def make():
        return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.0), nn.Linear(8, 3))

    def batch(i, g):
        return xy(i, g) + (rn(g, 4, 6),)

    def step(f, m, opt, b, i):
        x, y, x_eval = b
        m.train()
        opt.zero_grad()
        loss = F.mse_loss(f(x), y)
        loss.backward()
        opt.step()
        m.eval()
        with torch.no_grad():
            ev = f(x_eval)
        m.train()
        return loss.detach(), ev

    train_compare(make, batch, step, seed=30)


def test_train_layernorm_embedding_cross_entropy():
    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 8)
            self.ln = nn.LayerNorm(8)
            self.out = nn.Linear(8, 10)

        def forward(self, tok):
            return self.out(F.gelu(self.ln(self.emb(tok))))

    def batch(i, g):
        return ri(g, 0, 10, 4, 5), ri(g, 0, 10, 4, 5)

    def step(f, m, opt, b, i):
        tok, tgt = b
        opt.zero_grad()
        loss = F.cross_entropy(f(tok).flatten(0, 1), tgt.flatten())
        loss.backward()
        opt.step()
        return loss.detach()

    train_compare(Tiny, batch, step, seed=31)


def test_train_frozen_first_layer_and_nonscalar_backward():
    def make():
        m = mlp()()
        m[0].weight.requires_grad_(False)
        return m

    def batch(i, g):
        return rn(g, 8, 6), rn(g, 8, 3)

    def step(f, m, opt, b, i):
        x, gout = b
        opt.zero_grad()
        out = f(x)
        out.backward(gout)
        opt.step()
        return out.detach()

    train_compare(make, batch, step, seed=32)


def test_train_output_used_in_two_losses():
    def step(f, m, opt, b, i):
        x, y = b
        opt.zero_grad()
        out = f(x)
        loss = out.sum() * 0.01 + F.mse_loss(out, y) + out.abs().max()
        loss.backward()
        opt.step()
        return loss.detach()

    train_compare(mlp(nn.GELU), xy, step, seed=33)


# ================================================================================================
# 6. Dynamic shapes and symbolic arithmetic

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


# ================================================================================================
# 7. Data-dependent ops


def _dd_unique(x):
    return torch.unique(x)


def _dd_mutation_then_mask(x):
    x.add_(0.5)
    return x[x > 0.5]


def _dd_item_slice(x, k):
    n = k.item()
    torch._check_is_size(n)
    torch._check(n <= x.shape[0])
    return x[:n] * 2


DD_CASES = [
    pytest.param(lambda x: x[x > 0] * 2, lambda i, g: (rn(g, 12),), id="bool_mask_index"),
    pytest.param(lambda x: torch.nonzero(x > 0.3), lambda i, g: (rn(g, 4, 3),), id="nonzero"),
    pytest.param(_dd_unique, lambda i, g: (ri(g, 0, 6, 12),), id="unique"),
    pytest.param(lambda x: torch.unique(x, return_counts=True), lambda i, g: (ri(g, 0, 6, 12),), id="unique_counts"),
    pytest.param(lambda x, m: torch.masked_select(x, m) + 1, lambda i, g: (rn(g, 3, 4), rn(g, 3, 4) > 0),
                 id="masked_select"),
    pytest.param(lambda x, r: torch.repeat_interleave(x, r, dim=0), lambda i, g: (rn(g, 4, 2), ri(g, 0, 4, 4)),
                 id="repeat_interleave_tensor_repeats"),
    pytest.param(lambda x: torch.where(x > 0), lambda i, g: (rn(g, 3, 4),), id="where_one_arg"),
    pytest.param(lambda x: torch.bincount(x), lambda i, g: (ri(g, 0, 7, 10),), id="bincount"),
    pytest.param(lambda x, w: torch.bincount(x, w, minlength=6), lambda i, g: (ri(g, 0, 8, 10), rn(g, 10)),
                 id="bincount_weights_minlength"),
    pytest.param(lambda x: torch.argwhere(x < 0) * 2, lambda i, g: (rn(g, 3, 3),), id="argwhere"),
    pytest.param(lambda x: x[torch.nonzero(x[:, 0] > 0)[:, 0]].sum(0), lambda i, g: (rn(g, 6, 3),),
                 id="nonzero_then_gather"),
    pytest.param(lambda x: (x[x > 0] ** 2).sum() + x.sum(), lambda i, g: (rn(g, 10),), id="mask_then_reduce"),
    pytest.param(_dd_mutation_then_mask, lambda i, g: (rn(g, 10),), id="mutation_then_mask"),
    pytest.param(lambda x: torch.unique_consecutive(x), lambda i, g: (ri(g, 0, 3, 12),), id="unique_consecutive"),
    # (x * t.item() is rewritten by Dynamo into tensor ops: no host read, no fallback expected)
    pytest.param(lambda x: x * x.sum().item(), lambda i, g: (rn(g, 5),), id="item_scalar_folded_into_tensor_ops"),
    pytest.param(_dd_item_slice, lambda i, g: (rn(g, 6), torch.tensor(i % 4 + 1)), id="item_as_size"),
]


@pytest.mark.parametrize("fn,make_inputs", DD_CASES)
def test_data_dependent(fn, make_inputs, request):
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True, capture_scalar_outputs=True):
        with torch.no_grad():
            b = run_diff(fn, make_inputs, calls=CALLS, seed=50, require_replay=False)
    s = b.stats()
    assert s, "nothing was compiled"
    if "folded" not in request.node.callspec.id:   # documented: data-dependent graphs run eagerly, with a reason
        assert total(b, "eager_fallbacks") > 0 and any(x["fallback_reasons"] for x in s), s


def test_data_dependent_with_backward():
    def fn(x):
        return (x[x > 0] ** 2).sum() + x.sin().sum()

    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        compiled = torch.compile(fn, backend=backend())
        for i in range(CALLS):
            x_c = rn(gen(i), 8).requires_grad_()
            x_e = x_c.detach().clone().requires_grad_()
            got, want = compiled(x_c), fn(x_e)
            assert_same(got, want, what=f"call {i}")
            got.backward()
            want.backward()
            assert_same(x_c.grad, x_e.grad, what=f"call {i}: x.grad")


# ================================================================================================
# 8. Misc numerics


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


# ================================================================================================
# 9. Threads


def run_threads(n, work, timeout=120):
    errors = []
    barrier = threading.Barrier(n)

    def target(t):
        try:
            barrier.wait()
            work(t)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(f"thread {t}: {type(e).__name__}: {str(e)[:400]}")

    threads = [threading.Thread(target=target, args=(t,)) for t in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout)
    assert not any(th.is_alive() for th in threads), "a thread hung"
    assert errors == [], errors


def _thread_setup(kind):
    """(compiled, reference, make_inputs(t, i, g), stateful) for a kind of workload."""
    torch.manual_seed(70)
    b = backend()
    if kind == "pointwise":
        fn = lambda x, y: torch.sigmoid(x) * y - torch.tanh(x * y)  # noqa: E731
        return torch.compile(fn, backend=b), fn, lambda t, i, g: (rn(g, 6, 5), rn(g, 6, 5)), b
    if kind == "mlp":
        model = nn.Sequential(nn.Linear(5, 16), nn.GELU(), nn.Linear(16, 5)).eval()
        return torch.compile(model, backend=b), model, lambda t, i, g: (rn(g, 3, 5),), b
    if kind == "input_mutation":
        def fn(x, y):
            x.mul_(2).add_(y)
            return x.sum(0)
        return torch.compile(fn, backend=b), fn, lambda t, i, g: (rn(g, 4, 5), rn(g, 4, 5)), b
    if kind == "dynamic_sizes":
        fn = lambda x: x * (x.shape[0] // 2) + x.sum(0)  # noqa: E731
        return (torch.compile(fn, backend=b, dynamic=True), fn,
                lambda t, i, g: (rn(g, 4 + 2 * t + (i % 2) * 3, 3),), b)
    raise ValueError(kind)


@pytest.mark.parametrize("n_threads", [2, 4])
@pytest.mark.parametrize("kind", ["pointwise", "mlp", "input_mutation", "dynamic_sizes"])
def test_threads_concurrent_calls(kind, n_threads):
    compiled, ref, make, b = _thread_setup(kind)
    with torch.no_grad():
        compiled(*make(0, 0, gen(0)))         # compile on this thread

    def work(t):
        with torch.no_grad():
            for i in range(25):
                args = make(t, i, gen(10000 * t + i))
                args_ref = make(t, i, gen(10000 * t + i))
                want = ref(*args_ref)
                got = compiled(*args)
                assert_same(got, want, what=f"thread {t} call {i}")
                assert_same(args, args_ref, what=f"thread {t} call {i}: inputs")

    run_threads(n_threads, work)
    assert total(b, "replays") >= n_threads * 20


@pytest.mark.parametrize("n_threads", [2, 3])
def test_threads_concurrent_fedback_recurrence(n_threads):
    torch.manual_seed(71)
    cell = nn.GRUCell(4, 6)
    compiled = torch.compile(cell, backend=backend())
    with torch.no_grad():
        compiled(torch.randn(2, 4), torch.randn(2, 6))

    def work(t):
        with torch.no_grad():
            h_c = h_e = rn(gen(t), 2, 6)
            for i in range(20):
                x = rn(gen(100 * t + i), 2, 4)
                h_c, h_e = compiled(x, h_c), cell(x, h_e)
                assert_same(h_c, h_e, what=f"thread {t} step {i}")

    run_threads(n_threads, work)


def test_threads_sequential_calls_from_different_threads():
    fn = lambda x: torch.cos(x) * 3 + x.sum()  # noqa: E731
    b = backend()
    compiled = torch.compile(fn, backend=b)
    for i in range(8):
        result = {}

        def one():
            x = rn(gen(i), 5)
            result["got"], result["want"] = compiled(x).clone(), fn(x)

        th = threading.Thread(target=one)
        th.start()
        th.join()
        assert "got" in result, f"call {i} in its own thread failed"
        assert_same(result["got"], result["want"], what=f"call {i} (thread {i})")


def test_threads_one_thread_per_phase_module():
    """Warm-up, capture and replays each from a different thread, then again on the main one."""
    torch.manual_seed(72)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).eval()
    compiled = torch.compile(model, backend=backend())
    with torch.no_grad():
        for i in range(6):
            errors = []

            def one():
                try:
                    with torch.no_grad():
                        for k in range(3):
                            x = rn(gen(10 * i + k), 3, 4)
                            assert_same(compiled(x), model(x), what=f"thread {i} call {k}")
                except BaseException as e:  # noqa: BLE001
                    errors.append(repr(e)[:400])

            th = threading.Thread(target=one)
            th.start()
            th.join()
            assert errors == []
        for k in range(4):
            x = rn(gen(99 + k), 3, 4)
            assert_same(compiled(x), model(x), what=f"main call {k}")


def test_threads_other_thread_does_not_invalidate_my_output():
    """Captured state is per thread: replays on another thread never reuse this thread's pool."""
    fn = lambda x: torch.sin(x) * 2  # noqa: E731
    compiled = torch.compile(fn, backend=backend())
    for i in range(3):
        compiled(rn(gen(i), 6))
    x = rn(gen(7), 6)
    mine = compiled(x)                     # a replay output in this thread's pool

    def other(t):
        for k in range(10):
            y = rn(gen(500 + k), 6)
            assert_same(compiled(y), fn(y), what=f"other thread call {k}")

    run_threads(1, other)
    assert_same(mine, fn(x), what="main thread's output after another thread's replays")


def test_threads_concurrent_clone_outputs_keepalive():
    fn = lambda x: torch.exp(-x * x) + x  # noqa: E731
    compiled = torch.compile(fn, backend=backend(clone_outputs=True))
    compiled(torch.randn(5))

    def work(t):
        xs = [rn(gen(100 * t + i), 5) for i in range(15)]
        outs = [compiled(x) for x in xs]
        for i, (x, o) in enumerate(zip(xs, outs)):
            assert_same(o, fn(x), what=f"thread {t} kept output {i}")

    run_threads(3, work)


def test_threads_concurrent_calls_several_static_graphs():
    """Three graphs (one per size, compiled on this thread: Dynamo's own compilation is not
    thread-safe) called concurrently, each thread warming up and capturing its own state."""
    fn = lambda x: torch.relu(x) - x.mean()  # noqa: E731
    compiled = torch.compile(fn, backend=backend(), dynamic=False)
    for n in (4, 5, 6):
        compiled(torch.randn(n))

    def work(t):
        for i in range(12):
            x = rn(gen(100 * t + i), 4 + (t + i) % 3)
            assert_same(compiled(x), fn(x), what=f"thread {t} call {i}")

    run_threads(3, work)


# ================================================================================================
# 10. Memory


def _loop(compiled, ref, make, n, check_every=1):
    for i in range(n):
        args = make(i, gen(i))
        got = compiled(*args)
        if i % check_every == 0 or i == n - 1:
            assert_same(got, ref(*make(i, gen(i))), what=f"call {i}")
        del got


@pytest.mark.parametrize("ro", list(RO_VARIANTS))
def test_memory_many_calls_pointwise_captures_constant(ro):
    fn = lambda x: torch.tanh(x) * 2 + x  # noqa: E731
    b = backend(**RO_VARIANTS[ro])
    compiled = torch.compile(fn, backend=b)
    _loop(compiled, fn, lambda i, g: (rn(g, 8, 8),), 20)
    s0 = b.stats()
    _loop(compiled, fn, lambda i, g: (rn(g, 8, 8),), 200)
    s1 = b.stats()
    assert total(b, "captures") == 1 and s1[0]["pool_bytes"] == s0[0]["pool_bytes"]
    assert total(b, "replays") >= 218 and total(b, "eager_fallbacks") == 0


@pytest.mark.parametrize("ro", list(RO_VARIANTS))
def test_memory_many_calls_mlp_module(ro):
    torch.manual_seed(80)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8)).eval()
    b = backend(**RO_VARIANTS[ro])
    compiled = torch.compile(model, backend=b)
    with torch.no_grad():
        _loop(compiled, model, lambda i, g: (rn(g, 4, 8),), 200)
    assert total(b, "captures") == 1 and total(b, "replays") >= 198


def test_memory_many_calls_buffer_mutation():
    model, eager = CounterModel(), CounterModel()
    b = backend()
    compiled = torch.compile(model, backend=b)
    with torch.no_grad():
        for i in range(200):
            x = rn(gen(i), 4)
            assert_same(compiled(x), eager(x), what=f"call {i}")
    assert model.count.item() == 200 == eager.count.item()
    assert total(b, "captures") == 1


@pytest.mark.parametrize("ro", list(RO_VARIANTS))
def test_memory_many_calls_fedback_recurrence(ro):
    fn = lambda h, x: torch.tanh(h * 0.9 + x)  # noqa: E731
    b = backend(**RO_VARIANTS[ro])
    compiled = torch.compile(fn, backend=b)
    h_c = h_e = torch.zeros(16)
    for i in range(200):
        x = rn(gen(i), 16)
        h_c, h_e = compiled(h_c, x), fn(h_e, x)
        assert_same(h_c, h_e, what=f"step {i}")
    assert total(b, "captures") <= 2


def test_memory_alternating_sizes_dynamic_two_keys():
    fn = lambda x: torch.relu(x) @ x.t()  # noqa: E731
    b = backend()
    compiled = torch.compile(fn, backend=b, dynamic=True)
    _loop(compiled, fn, lambda i, g: (rn(g, 4 if i % 2 else 6, 3),), 200)
    assert total(b, "captures") == 2


def test_memory_many_training_steps_captures_constant():
    b = train_compare(mlp(), xy, step_basic, steps=60, seed=81)
    assert total(b, "captures") == 2   # one forward, one backward graph


def test_memory_keep_many_outputs_with_clone_outputs():
    fn = lambda x: x.cumsum(0) + 1  # noqa: E731
    b = backend(clone_outputs=True)
    compiled = torch.compile(fn, backend=b)
    xs = [rn(gen(i), 12) for i in range(200)]
    outs = [compiled(x) for x in xs]
    for i in range(0, 200, 7):
        assert_same(outs[i], fn(xs[i]), what=f"kept output {i}")
    assert total(b, "captures") == 1


def test_memory_capture_limit_bounds_captures():
    fn = lambda x: x.sin() * 2  # noqa: E731
    b = backend(capture_limit=3)
    compiled = torch.compile(fn, backend=b, dynamic=True)
    sizes = [3, 4, 5, 6, 7, 8]
    _loop(compiled, fn, lambda i, g: (rn(g, sizes[i % len(sizes)]),), 60)
    assert total(b, "captures") == 3 and total(b, "eager_fallbacks") > 0


def test_memory_many_calls_data_dependent_fallback():
    fn = lambda x: x[x > 0].sum() + x.mean()  # noqa: E731
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        b = backend()
        compiled = torch.compile(fn, backend=b)
        _loop(compiled, fn, lambda i, g: (rn(g, 20),), 100)
    assert total(b, "captures") == 0 and total(b, "eager_fallbacks") >= 98


def test_memory_python_float_changing_every_call():
    """A float argument that changes every call (a schedule): every result right, whatever is
    captured; captures never exceed capture_limit."""
    fn = lambda x, t: torch.sin(x * t) + t  # noqa: E731
    b = backend(capture_limit=8)
    compiled = torch.compile(fn, backend=b)
    for i in range(80):
        t = 0.01 * (i % 40)     # each value comes twice: warm-up, then capture or eager
        x = rn(gen(i), 6)
        assert_same(compiled(x, t), fn(x, t), what=f"call {i} (t={t})")
    assert total(b, "captures") <= 8 * max(1, len(b.stats()))


def _engine_refs(backend):
    return [weakref.ref(e) for e in backend.engines]


def test_memory_deleting_compiled_model_frees_engines_and_parameters():
    torch.manual_seed(82)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)).eval()
    b = backend()
    compiled = torch.compile(model, backend=b)
    with torch.no_grad():
        _loop(compiled, model, lambda i, g: (rn(g, 2, 8),), 8)
    engines = _engine_refs(b)
    param = weakref.ref(model[0].weight)
    assert engines and all(r() is not None for r in engines)
    del compiled, model, b
    torch._dynamo.reset()
    gc.collect()
    assert all(r() is None for r in engines), "an engine outlived its model and backend"
    assert param() is None, "a parameter outlived its model (held by a captured graph)"


def test_memory_deleting_compiled_function_frees_pool_outputs():
    fn = lambda x: torch.exp(x) + 1  # noqa: E731
    b = backend()
    compiled = torch.compile(fn, backend=b)
    last = None
    for i in range(8):
        x = rn(gen(i), 32)
        last = compiled(x)
        assert_same(last, fn(x), what=f"call {i}")
    kept = last.clone()
    engines = _engine_refs(b)
    del compiled, b
    torch._dynamo.reset()
    gc.collect()
    # The latest output was never superseded: it stays readable after the engine is gone.
    assert_same(last, kept, what="latest output after deleting the compiled function")
    assert all(r() is None for r in engines)
