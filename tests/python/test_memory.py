"""Memory over many calls: captures stay constant, outputs are freed, nothing leaks.

Compiled with torchreplay's "reduce-overhead" mode against eager, call by call, through the
differential harness (differential.py: outputs, mutated inputs, aliasing, state, replays)."""
import gc
import weakref

import pytest
import torch
import torch.nn as nn

from configs import backend
from differential import (  # noqa: F401 (recompile_limits is autouse)
    recompile_limits, RO_VARIANTS, total, gen, rn, assert_same, mlp, xy, step_basic,
    train_compare, CounterModel)


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


@pytest.mark.parametrize("grad", [False, True])   # grad: a training graph and its requires_grad guard
def test_memory_deleting_compiled_model_frees_engines_and_parameters(grad):
    torch.manual_seed(82)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)).eval()
    b = backend()
    compiled = torch.compile(model, backend=b)
    with torch.set_grad_enabled(grad):
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


def test_memory_an_engine_freed_under_a_python_dispatch_mode_keeps_its_outputs():
    """An engine may be freed anywhere the last reference goes: here inside a FakeTensorMode (the
    garbage collector can drop it in the middle of Dynamo's trace). Its outputs still alive are
    copied out without dispatching to the mode (which once raised inside the destructor and
    aborted the process), and keep their values."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    fn = lambda x: torch.tanh(x) * 3  # noqa: E731
    b = backend()
    compiled = torch.compile(fn, backend=b)
    for i in range(4):
        last = compiled(rn(gen(i), 64))
    assert total(b, "replays") >= 2
    kept = last.clone()
    engines = _engine_refs(b)
    with FakeTensorMode():
        del compiled, b
        torch._dynamo.reset()
        gc.collect()
        assert all(r() is None for r in engines)
    assert_same(last, kept, what="an output of an engine freed under FakeTensorMode")
