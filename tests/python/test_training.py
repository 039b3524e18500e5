"""Training steps: forward and backward replayed, gradients and optimizer state equal to eager's.

Compiled with torchreplay's "reduce-overhead" mode against eager, call by call, through the
differential harness (differential.py: outputs, mutated inputs, aliasing, state, replays)."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from configs import backend
from differential import (  # noqa: F401 (recompile_limits is autouse)
    recompile_limits, RO_VARIANTS, assert_bitwise, gen, total, rn, ri, mlp, xy, step_basic, step_with, train_compare,
    TinyTokens, engine_for)


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

    train_compare(make, batch, step_with(F.cross_entropy), seed=21)


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
    def batch(i, g):
        return ri(g, 0, 10, 4, 5), ri(g, 0, 10, 4, 5)

    def step(f, m, opt, b, i):
        tok, tgt = b
        opt.zero_grad()
        loss = F.cross_entropy(f(tok).flatten(0, 1), tgt.flatten())
        loss.backward()
        opt.step()
        return loss.detach()

    train_compare(TinyTokens, batch, step, seed=31)


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


@pytest.mark.parametrize("traced", [True, False], ids=["one_graph", "broken_at_backward"])
@pytest.mark.parametrize("loss_fn", [F.mse_loss, F.l1_loss, F.smooth_l1_loss], ids=["mse", "l1", "smooth_l1"])
def test_train_whole_step_compiled_with_the_loss_and_backward_inside(loss_fn, traced):
    """The step as users write it for small models: loss and loss.backward() inside the compiled
    function, traced into one graph (the default) or, with config.trace_backward = False, broken
    at the backward by Dynamo. The forward graph's first call runs under AOTAutograd's custom-op
    aliasing check (a Python dispatch mode), which once turned the recording's probe of
    mse_loss.out into the call's error."""
    torch.manual_seed(3)
    eager = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))
    model = copy.deepcopy(eager)

    def stepper(m):
        def step(x, y):
            loss = loss_fn(m(x), y)
            loss.backward()
            return loss.detach()
        return step

    b = backend(trace_backward=traced)
    compiled = torch.compile(stepper(model), backend=b)
    reference = stepper(eager)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (eager, model)]
    for i in range(6):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(16, 32, generator=g), torch.randn(16, 4, generator=g)
        for opt in opts:
            opt.zero_grad()
        want, got = reference(x, y), compiled(x, y)
        assert_bitwise(got, want, f"step {i}: loss")
        for (n, pe), pc in zip(eager.named_parameters(), model.parameters()):
            assert_bitwise(pc.grad, pe.grad, f"step {i}: {n}.grad")
        for opt in opts:
            opt.step()
    kinds = {k.split(".")[1] for k in b.call_paths}
    assert (kinds == {"inference"}) if traced else ("training" in kinds), b.call_paths
    assert total(b, "replays") >= (4 if traced else 8)


def _training_paths(b):
    return {k: v for k, v in b.call_paths.items() if k.endswith(".training")}


def test_train_graph_is_one_direct_call_and_its_gradients_are_eager_bits():
    """Note [Training calls]: an MLP's training graph runs as a TrainingCall (forward and backward
    engines joined by a C++ autograd node), gradients bitwise over steps, replayed."""
    b = train_compare(mlp(nn.Tanh), xy, step_basic, seed=31)
    assert list(_training_paths(b).values()) == ["direct"], b.call_paths
    assert total(b, "replays") >= 8


def test_train_graph_with_batchnorm_runs_direct_and_bumps_the_stats_versions():
    """BatchNorm in train mode writes its running stats inside the graph: the TrainingCall runs it
    and bumps their version counters, as AOTAutograd's wrapper does (bitwise, stats included)."""
    def make():
        return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))

    b = train_compare(make, xy, step_basic, seed=32)
    assert list(_training_paths(b).values()) == ["direct"], b.call_paths
    torch.manual_seed(0)
    model = make()
    compiled = torch.compile(model, backend=backend())
    stats = model[1].running_mean
    before = stats._version
    F.mse_loss(compiled(torch.randn(8, 6)), torch.randn(8, 3)).backward()
    assert stats._version > before


def test_train_graph_returning_a_view_of_its_input_keeps_aotautograds_wrapper_with_the_reason():
    """An output aliasing an input: AOTAutograd's wrapper regenerates it, so the graph keeps the
    wrapper, the reason in call_paths; still bitwise."""
    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 3)

        def forward(self, x):
            return self.lin(x), x[:, :3]

    def step(f, m, opt, batch, i):
        x, y = batch
        opt.zero_grad()
        out, part = f(x)
        loss = F.mse_loss(out + part, y)
        loss.backward()
        opt.step()
        return loss.detach()

    b = train_compare(Head, xy, step, seed=33)
    paths = list(_training_paths(b).values())
    assert paths == ["AOTAutograd wrapper: outputs that alias inputs, other outputs or intermediates"], b.call_paths


def test_train_create_graph_gives_first_order_gradients_and_refuses_double_backward():
    """create_graph=True through a replayed training graph: the first-order gradients are eager's
    bits; a backward through them raises AOTAutograd's error for double backward, as with
    AOTAutograd's own wrapper."""
    torch.manual_seed(5)
    eager = mlp(nn.Tanh)()
    model = copy.deepcopy(eager)
    b = backend()
    compiled = torch.compile(model, backend=b)
    for i in range(3):
        x, y = xy(i, gen(40 + i))
        want = torch.autograd.grad(F.mse_loss(eager(x), y), list(eager.parameters()), create_graph=True)
        got = torch.autograd.grad(F.mse_loss(compiled(x), y), list(model.parameters()), create_graph=True)
        for k, (w, g) in enumerate(zip(want, got)):
            assert_bitwise(g, w, f"call {i}: gradient {k}")
            assert g.requires_grad
        with pytest.raises(RuntimeError, match="does not currently support double backward"):
            sum(g.sum() for g in got).backward()
    assert list(_training_paths(b).values()) == ["direct"], b.call_paths
    assert total(b, "replays") >= 1


def test_train_forward_kept_across_steps_and_backward_run_later():
    """A forward whose backward runs only a step later (its saved tensors alive while two more
    forwards replay over the same pool), and a forward abandoned by an exception: gradients and
    values stay eager's bits (Note [Training calls]: what is alive at the next forward is copied
    out of the pool first)."""
    pending = {}

    def step(f, m, opt, batch, i):
        x, y = batch
        opt.zero_grad()
        try:
            f(x * 2)
            raise KeyError("abandoned")
        except KeyError:
            pass
        loss = F.mse_loss(f(x), y)
        if id(m) in pending:
            loss = loss + pending.pop(id(m)).square().mean()
        loss.backward()
        opt.step()
        pending[id(m)] = f(x + 1)  # its backward runs in the next step, after two more forwards
        return loss.detach(), pending[id(m)].detach()

    b = train_compare(mlp(nn.Tanh), xy, step, seed=34)
    assert list(_training_paths(b).values()) == ["direct"], b.call_paths
    assert sum(s["copied_out"] for s in b.stats()) > 0  # the pending forward's saved tensors


@pytest.mark.parametrize("set_to_none", [True, False], ids=["set_to_none", "zeroed"])
def test_train_loop_copies_nothing_out_of_the_pool_until_a_forward_outlives_its_step(set_to_none):
    """zero_grad, forward, backward, optimizer step: the saved tensors are released by the
    backward and the gradients by zero_grad (or added into .grad and dropped) before the next
    replay, so no step copies anything out of the pool (stats' copied_out). A forward whose
    backward has not run when the next forward replays has its saved tensors copied out."""
    torch.manual_seed(5)
    model = mlp(nn.Tanh)()
    b = backend()
    f = torch.compile(model, backend=b)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for i in range(6):
        x, y = xy(i, gen(i))
        opt.zero_grad(set_to_none=set_to_none)
        F.mse_loss(f(x), y).backward()
        opt.step()
    assert total(b, "replays") >= 8
    assert [s["copied_out"] for s in b.stats()] == [0, 0]
    first = F.mse_loss(f(x), y)
    second = F.mse_loss(f(x + 1), y)  # the first's saved tensors are alive: copied out
    (first + second).backward()
    copied = sum(s["copied_out"] for s in b.stats())
    assert copied > 0 and sum(s["copied_out_bytes"] for s in b.stats()) >= 8 * 16 * 4  # a hidden activation


def test_train_sparse_embedding_gradients_run_eagerly_with_the_reason():
    """nn.Embedding(sparse=True) gives a sparse gradient, which no captured graph replays: the
    backward graph runs eagerly, with the reason in the stats; gradients stay eager's."""
    def make():
        return nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Flatten(), nn.Linear(12, 3))

    def batch(i, g):
        return ri(g, 0, 10, 8, 3), rn(g, 8, 3)

    def step(f, m, opt, b, i):
        x, y = b
        opt.zero_grad()
        loss = F.mse_loss(f(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    b = train_compare(make, batch, step, seed=35)
    reasons = [r for s in b.stats() for r in s["fallback_reasons"]]
    assert any("sparse" in r for r in reasons), reasons


def test_train_gradients_read_and_scaled_by_other_compiled_functions_stay_current():
    """The gradients a training graph's backward hands out (Dynamo marks a parameter's .grad a
    static input) are read by a compiled grad-norm and scaled in place by a compiled function,
    with zero_grad(set_to_none=True) between steps: each call sees this step's gradients. Such an
    input was baked into the capture once, moved out of the pool at the next backward, and a
    later gradient at the same address passed the address check (Note [Static inputs handed out
    of a pool])."""
    torch.manual_seed(6)
    eager = mlp(nn.Tanh)()
    model = copy.deepcopy(eager)
    b = backend()
    forward = torch.compile(model, backend=b)

    @torch.compile(backend=b)
    def grad_norm(m):
        return torch.stack([p.grad.norm() for p in m.parameters()]).norm()

    @torch.compile(backend=b)
    def halve(m):
        for p in m.parameters():
            p.grad.mul_(0.5)

    for i in range(6):
        x, y = xy(i, gen(i))
        for m, f in ((eager, eager), (model, forward)):
            m.zero_grad(set_to_none=True)
            F.mse_loss(f(x), y).backward()
        want = torch.stack([p.grad.norm() for p in eager.parameters()]).norm()
        assert_bitwise(grad_norm(model), want, f"step {i}: grad norm")
        halve(model)
        for p in eager.parameters():
            p.grad.mul_(0.5)
        for (n, pe), pm in zip(eager.named_parameters(), model.parameters()):
            assert_bitwise(pm.grad, pe.grad, f"step {i}: {n}.grad")
    assert all(s["replays"] >= 2 for s in b.stats()), b.stats()


class _SigmoidHead(nn.Module):
    """sigmoid's backward reads its result: the graph saves its own output for the backward."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 4)

    def forward(self, x):
        return torch.sigmoid(self.lin(x))


class _FlattenedInput(nn.Module):
    """The linear's weight gradient reads x.view(...): the graph saves a view of its input."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 4)

    def forward(self, x):
        return torch.tanh(self.lin(x.view(-1, 6)))


class _RightWeight(nn.Module):
    """x @ w: the input's gradient reads w, a parameter the graph saves as it is."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 4))

    def forward(self, x):
        return torch.tanh(x @ self.w)


def _replace_w(m):
    m.w = nn.Parameter(m.w.data)  # another nn.Parameter over the same memory: no new capture


def _scale_w(m):
    with torch.no_grad():
        m.w.mul_(2)


# (model, input shape, whether the input requires grad, what is done before the forward, the
# in-place change made between the forward and the backward)
_CHANGED_BEFORE_BACKWARD = {
    "output_mul_": (_SigmoidHead, (8, 6), False, None, lambda m, x, out: out.mul_(2)),
    "output_row_zero_": (_SigmoidHead, (8, 6), False, None, lambda m, x, out: out[0].zero_()),
    "input_under_a_saved_view": (_FlattenedInput, (8, 2, 3), False, None, lambda m, x, out: x.mul_(2)),
    "replaced_parameter": (_RightWeight, (8, 6), True, _replace_w, lambda m, x, out: _scale_w(m)),
}


@pytest.mark.parametrize("path", ["direct", "wrapper"])
@pytest.mark.parametrize("ro", list(RO_VARIANTS))
@pytest.mark.parametrize("case", list(_CHANGED_BEFORE_BACKWARD))
def test_train_tensor_saved_for_backward_changed_in_place_raises_on_every_call(case, ro, path):
    """A tensor the backward reads (the graph's own output, a view of its input, a parameter
    replaced by another over the same memory) changed in place between the forward and the
    backward: eager and aot_eager raise autograd's error on every call, and so must warm-up,
    capture and replay (Note [Handed-out outputs]: outputs of one value are one tensor, outputs of
    one buffer share its version counter; Note [Outputs that view an input]), through the
    TrainingCall and through AOTAutograd's wrapper, with and without clone_outputs. A call with no
    change gives eager's gradient bits."""
    make, shape, x_grad, before, change = _CHANGED_BEFORE_BACKWARD[case]
    torch.manual_seed(7)
    eager = make()
    model, reference = copy.deepcopy(eager), copy.deepcopy(eager)
    b = backend(**RO_VARIANTS[ro])
    b.direct_training = path == "direct"
    runs = [("eager", eager, eager), ("aot_eager", reference, torch.compile(reference, backend="aot_eager")),
            ("torchreplay", model, torch.compile(model, backend=b))]
    for i in range(5):
        for what, m, f in runs:
            x = rn(gen(60 + i), *shape).requires_grad_(x_grad)
            m.zero_grad(set_to_none=True)
            if before is not None:
                before(m)
            out = f(x)
            change(m, x, out)
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                out.sum().backward()
            assert all(p.grad is None for p in m.parameters()) and x.grad is None, (what, i)
        grads = []
        for what, m, f in runs:
            m.zero_grad(set_to_none=True)
            x = rn(gen(80 + i), *shape).requires_grad_(x_grad)
            f(x).sum().backward()
            grads.append([p.grad for p in m.parameters()] + [x.grad])
        for k, (want, got) in enumerate(zip(grads[0], grads[2])):
            assert (got is None) == (want is None), (i, k)
            if want is not None:
                assert_bitwise(got, want, f"call {i}: gradient {k}")
    assert b.call_paths and all((p == "direct") == (path == "direct") for p in _training_paths(b).values()), \
        b.call_paths
    replays = {s["name"].split(".")[-1]: s["replays"] for s in b.stats()}
    assert replays["forward"] >= 7 and replays["backward"] >= 3, replays


@pytest.mark.parametrize("clone", [False, True], ids=["views", "clone_outputs"])
def test_outputs_share_version_counters_as_eager_views_do(clone):
    """What autograd's saved-tensor check reads, at the engine: a value returned twice is one
    tensor, outputs that view one buffer share its version counter, and an output that views an
    input shares the input's (as eager's views do), on every call: warm-up, capture and replay."""
    def fn(x, w):
        s = torch.sigmoid(x @ w)
        return s, s, s.t(), x.view(-1), w.t()

    x, w = torch.randn(3, 4), torch.randn(4, 4)
    engine = engine_for(fn, [x, w], mode="reduce-overhead", clone_outputs=clone)
    for i in range(4):
        x, w = torch.randn(3, 4), torch.randn(4, 4)
        s, again, st, xv, wt = engine.run([x, w])
        want = fn(x, w)
        for k, (g, e) in enumerate(zip((s, again, st, xv, wt), want)):
            assert_bitwise(g, e, f"call {i}: output {k}")
        before = (again._version, st._version, xv._version, wt._version)
        s.mul_(2)
        x.add_(1)
        w.add_(1)
        for k, (what, t) in enumerate((("s again", again), ("s.t()", st), ("x.view(-1)", xv), ("w.t()", wt))):
            assert t._version == before[k] + 1, (i, what)
        assert again is s, i
    assert engine.stats()["replays"] >= 2


# requires_grad of the first layer's parameters, call by call: unfrozen after compiling
# (progressive unfreezing), and frozen then unfrozen again.
_REQUIRES_GRAD_SCHEDULES = {
    "unfrozen": [False, False, False, True, True, True, True],
    "frozen_then_unfrozen": [True, True, True, False, False, False, True, True, True],
}


def _mse_stepper(model, forward):
    def step(x, y):
        loss = F.mse_loss(forward(x), y)
        loss.backward()
        return loss.detach()
    return step


@pytest.mark.parametrize("compiled_part", ["step", "module", "first_layer"])
@pytest.mark.parametrize("schedule", list(_REQUIRES_GRAD_SCHEDULES))
def test_train_parameter_unfrozen_after_compiling_gets_its_gradient(schedule, compiled_part):
    """A layer frozen (requires_grad_(False)) when the graph was compiled and unfrozen later, and
    the reverse: Dynamo skips the tensor guards of a module whose __dict__ is unchanged, so
    without more the graph compiled for the old requires_grad kept running and the new leaves'
    .grad stayed None (Note [Leaves' requires_grad] in training_guards.py: the graph recompiles). Losses
    and every .grad eager's bits, call by call; the step compiled, the module, or the first layer
    alone (an inference graph while it is frozen); replayed."""
    torch.manual_seed(9)
    eager = mlp(nn.Tanh)()
    model = copy.deepcopy(eager)
    b = backend()
    forward = torch.compile(model, backend=b) if compiled_part == "module" else \
        nn.Sequential(torch.compile(model[0], backend=b), *model[1:]) if compiled_part == "first_layer" else model
    compiled = torch.compile(_mse_stepper(model, model), backend=b) if compiled_part == "step" else \
        _mse_stepper(model, forward)
    reference = _mse_stepper(eager, eager)
    for i, requires_grad in enumerate(_REQUIRES_GRAD_SCHEDULES[schedule]):
        for m in (eager, model):
            m[0].requires_grad_(requires_grad)
            m.zero_grad(set_to_none=True)
        x, y = xy(i, gen(90 + i))
        assert_bitwise(compiled(x, y), reference(x, y), f"call {i}: loss")
        for (name, pe), pm in zip(eager.named_parameters(), model.parameters()):
            assert (pm.grad is None) == (pe.grad is None), (i, name, requires_grad)
            if pe.grad is not None:
                assert_bitwise(pm.grad, pe.grad, f"call {i}: {name}.grad")
    assert total(b, "replays") >= 4, b.stats()


def _without_requires_grad_guard(entries):
    """A guard_filter_fn that drops torchreplay's guard on the module tensors' requires_grad."""
    return [e.guard_type != "TORCHREPLAY_REQUIRES_GRAD" for e in entries]


@pytest.mark.parametrize("path", ["direct", "wrapper", "inference"])
def test_train_parameter_unfrozen_where_no_guard_sees_it_raises_naming_it(path):
    """Should a call reach the graph with a parameter unfrozen since compiling (here the frame's
    guard_filter_fn drops torchreplay's requires_grad guard), it raises, naming the parameter,
    instead of skipping its gradient (Note [Leaves' requires_grad]): a training graph through the
    TrainingCall and through AOTAutograd's wrapper, and an inference graph (a frozen layer)."""
    torch.manual_seed(9)
    model = mlp(nn.Tanh)()
    frozen = model[0].weight if path != "inference" else model[0]
    frozen.requires_grad_(False)
    b = backend(trace_backward=False)   # the training graph's calls (the traced step's: test_traced_backward.py)
    b.direct_training = path == "direct"
    compiled = torch.compile(_mse_stepper(model, model) if path != "inference" else model[0], backend=b,
                             options={"guard_filter_fn": _without_requires_grad_guard})
    for i in range(3):
        compiled(*xy(i, gen(i))) if path != "inference" else compiled(xy(i, gen(i))[0])
    want = "direct" if path != "wrapper" else "AOTAutograd wrapper: the backend keeps AOTAutograd's wrapper"
    paths = b.call_paths if path == "inference" else _training_paths(b)
    assert set(paths.values()) == {want} and total(b, "replays") >= 2, (b.call_paths, b.stats())
    frozen.requires_grad_(True)
    name = r"_parameters\['weight'\]" if path != "inference" else r"_parameters\['(weight|bias)'\]"
    with pytest.raises(RuntimeError, match=rf"argument \d+ \(.*{name}\) requires grad, but did not when the graph "
                                           r"was compiled: the graph computes no gradient for it"):
        compiled(*xy(3, gen(3))) if path != "inference" else compiled(xy(3, gen(3))[0])
    assert model[0].weight.grad is None
