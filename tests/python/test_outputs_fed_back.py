"""Outputs kept across calls, fed back as inputs, and views of them.

Compiled with torchreplay's "reduce-overhead" mode against eager, call by call, through the
differential harness (differential.py: outputs, mutated inputs, aliasing, state, replays)."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from configs import backend
from differential import (  # noqa: F401 (recompile_limits is autouse)
    recompile_limits, RO_VARIANTS, total, gen, rn, assert_same, run_module_diff,
    assert_exercised, touch_or_documented_error, xy, step_basic, train_compare)


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
