"""Training steps with loss.backward() traced into the graph (Note [Traced backward] in
backend.py): the whole step replays as one graph, gradients bitwise eager's. Every test runs under
torchreplay's default (config.trace_backward: the backward traced for its compiles only, what
Dynamo's traced backward would get wrong left to autograd as it is traced) and under Dynamo's own
global switch (trace_autograd_ops: the same cases refused with an error); per call, a hazard that
came after the trace is refused under both."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchreplay
from configs import backend
from differential import TinyTokens, assert_bitwise, gen, mlp, rn, ri, total


@pytest.fixture(autouse=True, params=["default", "switch"])
def regime(request):
    """"default": torchreplay traces the backward of its own compiles (config.trace_backward);
    "switch": Dynamo's global trace_autograd_ops is on."""
    if request.param == "switch":
        with torch._dynamo.config.patch(trace_autograd_ops=True):
            yield request.param
    else:
        yield request.param


def _convnet():
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(4, 4, 3),
                         nn.Flatten(), nn.Linear(16, 3))


def _batchnorm():
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


# (model, batch(g), loss)
MODELS = {
    "mlp_tanh": (mlp(nn.Tanh), lambda g: (rn(g, 8, 6), rn(g, 8, 3)), F.mse_loss),
    "convnet": (_convnet, lambda g: (rn(g, 2, 2, 8, 8), ri(g, 0, 3, 2)), F.cross_entropy),
    "embedding_layernorm": (lambda: nn.Sequential(TinyTokens(), nn.Flatten(0, 1)), lambda g: (ri(g, 0, 10, 4, 5), ri(g, 0, 10, 20)), F.cross_entropy),
    "batchnorm": (_batchnorm, lambda g: (rn(g, 8, 6), rn(g, 8, 3)), F.mse_loss),
}


def _stepper(model, loss_fn):
    def step(x, y):
        loss = loss_fn(model(x), y)
        loss.backward()
        return loss.detach()
    return step


def _assert_grads_equal(got, want, what):
    """got's gradients and buffers are want's, bit for bit."""
    for (name, pw), pg in zip(want.named_parameters(), got.parameters()):
        assert (pg.grad is None) == (pw.grad is None), (what, name)
        if pw.grad is not None:
            assert_bitwise(pg.grad, pw.grad, f"step {what}: {name}.grad")
    for (name, bw), bg in zip(want.named_buffers(), got.buffers()):
        assert_bitwise(bg, bw, f"step {what}: buffer {name}")


def _compiled(make, loss_fn, seed=0):
    torch.manual_seed(seed)
    eager = make()
    model = copy.deepcopy(eager)
    b = backend()
    return eager, model, b, torch.compile(_stepper(model, loss_fn), backend=b)


@pytest.mark.parametrize("name", list(MODELS))
def test_whole_step_is_one_direct_graph_with_eager_gradients(name):
    """Gradient accumulation over two micro-batches: new gradients (after
    zero_grad(set_to_none=True)), then accumulated into .grad, then an SGD update: losses,
    gradients and buffers bitwise eager's every step, no graph break, both graphs called directly
    and replayed (the accumulating one takes the gradients the other handed out of its pool)."""
    make, batch, loss_fn = MODELS[name]
    eager, model, b, compiled = _compiled(make, loss_fn)
    reference = _stepper(eager, loss_fn)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (eager, model)]
    breaks = torch._dynamo.utils.counters["graph_break"].copy()
    for i in range(10):
        x, y = batch(gen(i))
        if i % 2 == 0:
            for opt in opts:
                opt.zero_grad()
        kept = [p.grad for p in model.parameters()]
        assert_bitwise(compiled(x, y), reference(x, y), f"step {i}: loss")
        _assert_grads_equal(model, eager, i)
        if i % 2 == 1:  # accumulated in place, as AccumulateGrad does
            assert all(k is p.grad for k, p in zip(kept, model.parameters())), i
            for opt in opts:
                opt.step()
    assert torch._dynamo.utils.counters["graph_break"] == breaks
    assert set(b.call_paths.values()) == {"direct"} and len(b.call_paths) == 2, b.call_paths
    assert [s["replays"] >= 2 for s in b.stats()] == [True, True]


def test_gradients_and_losses_kept_across_steps_stay_as_eager_left_them():
    """The new gradients are outputs of the graph, in its pool: kept past the next step (here in a
    list, with set_to_none between steps), they are copied out, not overwritten or invalidated."""
    make, batch, loss_fn = MODELS["mlp_tanh"]
    eager, model, b, compiled = _compiled(make, loss_fn)
    reference = _stepper(eager, loss_fn)
    kept_eager, kept = [], []
    for i in range(5):
        x, y = batch(gen(i))
        for m in (eager, model):
            m.zero_grad(set_to_none=True)
        kept_eager.append((reference(x, y), [p.grad for p in eager.parameters()]))
        kept.append((compiled(x, y), [p.grad for p in model.parameters()]))
    for i, ((loss_e, grads_e), (loss, grads)) in enumerate(zip(kept_eager, kept)):
        assert_bitwise(loss, loss_e, f"step {i}: loss")
        assert_bitwise(grads, grads_e, f"step {i}: gradients")
    assert total(b, "replays") >= 3
    assert total(b, "copied_out") >= 5  # a step's loss and four gradients, at the next step


def test_frozen_layer_backward_of_a_nonscalar_and_two_backwards_with_retain_graph():
    torch.manual_seed(0)
    eager = mlp()()
    eager[0].weight.requires_grad_(False)
    model = copy.deepcopy(eager)
    b = backend()

    def stepper(m):
        def step(x, gout):
            out = m(x)
            out.backward(gout, retain_graph=True)
            out.backward(gout * 2)
            return out.detach()
        return step
    compiled, reference = torch.compile(stepper(model), backend=b), stepper(eager)
    for i in range(5):
        for m in (eager, model):
            m.zero_grad()
        x, gout = rn(gen(i), 8, 6), rn(gen(i + 50), 8, 3)
        assert_bitwise(compiled(x, gout), reference(x, gout), f"step {i}: output")
        _assert_grads_equal(model, eager, i)
    assert model[0].weight.grad is None
    assert total(b, "replays") >= 3


def test_a_graph_break_after_the_backward_stays_right_and_one_graph_holds_the_backward():
    """A graph break after the backward (a print of loss.item() does the same) while the loss is
    still needed after it: the graph before the break returns the loss whose backward it traced
    (Note [Returning a tensor whose backward ran]), so the step runs as two inference graphs, the
    backward in the first; the gradients are eager's. (Dynamo alone would not trace that backward
    and would break at it, leaving the backward to autograd.)"""
    make, batch, loss_fn = MODELS["mlp_tanh"]
    eager, model, b, _ = _compiled(make, loss_fn)

    def stepper(m):
        def step(x, y):
            loss = loss_fn(m(x), y)
            loss.backward()
            torch._dynamo.graph_break()
            return loss.detach()
        return step
    compiled, reference = torch.compile(stepper(model), backend=b), stepper(eager)
    for i in range(5):
        for m in (eager, model):
            m.zero_grad()
        x, y = batch(gen(i))
        assert_bitwise(compiled(x, y), reference(x, y), f"step {i}: loss")
        _assert_grads_equal(model, eager, i)
    assert sorted(k.split(".")[1] for k in b.call_paths) == ["inference", "inference"], b.call_paths
    assert total(b, "replays") >= 6


def _refused(compiled, *args, match):
    with pytest.raises(Exception, match=match) as info:
        compiled(*args)
    assert "config.trace_backward = False" in str(info.value)


def _refused_or_left_to_autograd(regime, case, add=None, steps=3):
    """A backward Dynamo's traced form would get wrong, seen when the step is traced: under the
    switch, refused with an error matching `case["match"]`; under torchreplay's default, the graph
    breaks at the backward and autograd runs it (a training graph), gradients bitwise eager's.
    `add(model)` changes each model the same way before the first call."""
    eager, model, b, compiled, reference, batch = (case[k] for k in ("eager", "model", "b", "compiled", "reference",
                                                                     "batch"))
    kept = [add(m) for m in (eager, model)] if add else []  # noqa: F841 (keeps hooks alive)
    if regime == "switch":
        _refused(compiled, *batch(gen(0)), match=case["match"])
        return
    for i in range(steps):
        for m in (eager, model):
            m.zero_grad(set_to_none=True)
        x, y = batch(gen(i))
        assert_bitwise(compiled(x, y), reference(x, y), f"step {i}: loss")
        _assert_grads_equal(model, eager, i)
    assert any(k.endswith(".training") for k in b.call_paths), b.call_paths


def _accumulator_hook(p):
    """A hook on p's AccumulateGrad node (as DistributedDataParallel registers its own); the node
    returned, since p holds it weakly (dropped, eager forgets the hook too)."""
    node = p.view_as(p).grad_fn.next_functions[0][0]
    node.register_prehook(lambda g: g)
    return node


# hook name -> (add it to a parameter, returning what keeps it; the error's words)
HOOKS = {
    "register_hook": (lambda p: p.register_hook(lambda g: g * 2), "hooks \\(register_hook\\)"),
    "post_accumulate": (lambda p: p.register_post_accumulate_grad_hook(lambda t: None), "post-accumulate-grad hooks"),
    "accumulator": (_accumulator_hook, "gradient accumulator"),
}


def _case(name="mlp_tanh", stepper=None, match=None):
    make, batch, loss_fn = MODELS[name]
    eager, model, b, compiled = _compiled(make, loss_fn)
    if stepper is not None:
        compiled = torch.compile(stepper(model, loss_fn), backend=b)
    return dict(eager=eager, model=model, b=b, compiled=compiled, batch=batch, match=match,
                reference=(stepper or _stepper)(eager, loss_fn))


@pytest.mark.parametrize("hook", list(HOOKS))
def test_hooks_on_a_parameter_are_refused_when_compiled(hook, regime):
    """Dynamo's traced backward does not run hooks (eager's gradients would differ, or hooks a
    user counts on, DistributedDataParallel's, would not run): refused naming the parameter, or,
    by default, left to autograd."""
    add, why = HOOKS[hook]
    _refused_or_left_to_autograd(regime, _case(match=why), add=lambda m: add(m[2].bias))


@pytest.mark.parametrize("hook", list(HOOKS))
def test_hooks_added_after_compiling_are_refused_per_call(hook):
    """The checks are made every call (in C++ while nothing is set): a hook added after the graph
    was compiled and replayed raises at the next call, and nothing ran (the gradients stay)."""
    add, why = HOOKS[hook]
    make, batch, loss_fn = MODELS["mlp_tanh"]
    _, model, b, compiled = _compiled(make, loss_fn)
    for i in range(4):
        compiled(*batch(gen(i)))
    assert total(b, "replays") >= 2
    before = [p.grad.clone() for p in model.parameters()]
    handle = add(model[2].bias)
    with pytest.raises(RuntimeError, match=why):
        compiled(*batch(gen(4)))
    assert_bitwise([p.grad for p in model.parameters()], before, "gradients after the refused call")
    if hook != "accumulator":  # a removed hook leaves an empty dict behind: the call goes on
        handle.remove()
        bias = model[2].bias
        node = bias.view_as(bias).grad_fn.next_functions[0][0]  # noqa: F841 (its accumulator alive)
        compiled(*batch(gen(5)))
        assert total(b, "replays") >= 3


class _Broken(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = self.a(x)
        torch._dynamo.graph_break()
        return self.b(h.tanh())


def test_a_graph_break_inside_the_forward_is_refused(regime):
    """Dynamo's traced backward drops the backward of a graph whose leaves are all before a graph
    break (the gradients silently lost, PyTorch 2.11): the graph after the break is refused, or,
    by default, its backward left to autograd."""
    MODELS["broken"] = (_Broken, lambda g: (rn(g, 4, 6), rn(g, 4, 3)), F.mse_loss)
    try:
        _refused_or_left_to_autograd(regime, _case("broken", match="has a grad_fn"))
    finally:
        del MODELS["broken"]


def test_a_module_backward_hook_is_refused(regime):
    _refused_or_left_to_autograd(regime, _case(match="has a grad_fn"),
                                 add=lambda m: m[0].register_full_backward_hook(lambda mod, gi, go: None))


def test_create_graph_is_refused(regime):
    def stepper(m, loss_fn):
        def step(x, y):
            loss = loss_fn(m(x), y)
            loss.backward(create_graph=True)
            return loss.detach()
        return step
    _refused_or_left_to_autograd(regime, _case(stepper=stepper, match="create_graph=True"))


def test_a_forward_after_the_traced_backward_keeps_aotautograds_wrapper_and_its_checks(regime):
    """A step that runs the model again after the backward returns an output that requires grad:
    AOTAutograd builds a training graph around the traced backward, which keeps its wrapper (the
    reason in call_paths) and the per-call checks; gradients bitwise eager's, also after a
    backward through the returned output. (`return loss` itself makes Dynamo break the graph at
    the backward: the backward consumed the loss's graph.)"""
    make, batch, loss_fn = MODELS["mlp_tanh"]
    eager, model, b, _ = _compiled(make, loss_fn)

    def stepper(m):
        def step(x, y):
            loss = loss_fn(m(x), y)
            loss.backward()
            return m(x)
        return step
    compiled, reference = torch.compile(stepper(model), backend=b), stepper(eager)
    for i in range(4):
        for m in (eager, model):
            m.zero_grad()
        x, y = batch(gen(i))
        got, want = compiled(x, y), reference(x, y)
        assert_bitwise(got, want, f"step {i}: output")
        assert got.requires_grad, i
        _assert_grads_equal(model, eager, i)
        got.sum().backward()
        want.sum().backward()
        _assert_grads_equal(model, eager, i)
    assert list(b.call_paths.values()) == \
        ["AOTAutograd wrapper: a traced backward in a graph with outputs requiring grad"], b.call_paths
    assert total(b, "replays") >= 4
    for m in (eager, model):
        m.zero_grad()
    handle = model[0].weight.register_hook(lambda g: g)  # noqa: F841
    with pytest.raises(RuntimeError, match="register_hook"):  # no guard sees it: refused per call
        compiled(*batch(gen(9)))


def test_clipping_and_the_optimizer_inside_the_step_match_aot_eager():
    """clip_grad_norm_ and optimizer.step() after the backward inside the compiled step (Dynamo
    breaks the graph at the optimizer; the clipping's graphs read the gradients the traced step
    handed out): losses, gradients and parameters bitwise those of the same step compiled with
    backend="aot_eager", every step (and eager's, for SGD with momentum in foreach form)."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    models = [copy.deepcopy(base) for _ in range(3)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, foreach=True) for m in models]

    def stepper(m, opt):
        def step(x, y):
            loss = F.mse_loss(m(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.1)
            opt.step()
            return loss.detach()
        return step
    b = backend()
    steps = [stepper(models[0], opts[0]), torch.compile(stepper(models[1], opts[1]), backend="aot_eager"),
             torch.compile(stepper(models[2], opts[2]), backend=b)]
    for i in range(6):
        x, y = rn(gen(i), 8, 6), rn(gen(i + 50), 8, 3)
        for opt in opts:
            opt.zero_grad()
        losses = [s(x, y) for s in steps]
        for m, loss in zip(models[1:], losses[1:]):
            assert_bitwise(loss, losses[0], f"step {i}: loss")
            _assert_grads_equal(m, models[0], i)
            assert_bitwise(list(m.parameters()), list(models[0].parameters()), f"step {i}: parameters")
    assert total(b, "replays") >= 8


def test_a_step_broken_at_the_backward_logs_why_once(replay_log, regime):
    """With config.trace_backward = False (and the switch off), Dynamo breaks the graph at
    loss.backward(), as with other backends: the backend says once, at INFO, why the step is two
    graphs."""
    if regime == "switch":
        pytest.skip("the switch traces the backward whatever the config says")
    make, batch, loss_fn = MODELS["mlp_tanh"]
    replay_log.set_level("INFO", logger="torchreplay")
    torch.manual_seed(0)
    model = make()
    cfg = torchreplay.CompilerConfig()
    cfg.mode = "reduce-overhead"
    cfg.trace_backward = False
    b = torchreplay.get_backend(compiler_config=cfg)
    compiled = torch.compile(_stepper(model, loss_fn), backend=b)
    for i in range(3):
        compiled(*batch(gen(i)))
    hints = [r for r in replay_log.records if "config.trace_backward is False" in r.getMessage()]
    assert len(hints) == 1, [r.getMessage() for r in replay_log.records]
    assert any(k.endswith(".training") for k in b.call_paths)


@pytest.mark.parametrize("compiler", ["torchreplay", "aot_eager"])
def test_a_graph_break_between_the_loss_and_its_backward_runs_the_backward_in_autograd(compiler):
    """A graph break between the loss and `loss.backward()` (here torch._dynamo.graph_break(); a
    print of loss.item() does the same): the frame after the break holds the loss but none of its
    leaves, and Dynamo (2.11) would trace the backward as nothing (no gradients at all, with any
    backend). torchreplay makes Dynamo break the graph at that backward instead, so autograd runs
    it: gradients eager's."""
    make, batch, loss_fn = MODELS["mlp_tanh"]
    eager, model, b, _ = _compiled(make, loss_fn)

    def stepper(m):
        def step(x, y):
            loss = loss_fn(m(x), y)
            torch._dynamo.graph_break()
            loss.backward()
            return loss.detach()
        return step
    compiled = torch.compile(stepper(model), backend=b if compiler == "torchreplay" else compiler)
    reference = stepper(eager)
    for i in range(5):
        for m in (eager, model):
            m.zero_grad(set_to_none=True)
        x, y = batch(gen(i))
        assert_bitwise(compiled(x, y), reference(x, y), f"step {i}: loss")
        _assert_grads_equal(model, eager, i)
    if compiler == "torchreplay":
        assert total(b, "replays") >= 3


@pytest.mark.parametrize("setting", ["inline_inbuilt_nn_modules", "install_free_tensors"])
def test_parameters_installed_in_the_graph_module_run_the_backward_in_autograd(setting):
    """With inline_inbuilt_nn_modules off (or install_free_tensors on), Dynamo installs the
    parameters in the graph module instead of passing them, finds no leaf for the backward and
    would trace it as nothing; the graph breaks at the backward instead (as after a graph break
    between the loss and its backward): gradients eager's."""
    make, batch, loss_fn = MODELS["mlp_tanh"]
    with torch._dynamo.config.patch(**{setting: setting == "install_free_tensors"}):
        eager, model, b, compiled = _compiled(make, loss_fn)
        reference = _stepper(eager, loss_fn)
        for i in range(4):
            for m in (eager, model):
                m.zero_grad(set_to_none=True)
            x, y = batch(gen(i))
            assert_bitwise(compiled(x, y), reference(x, y), f"step {i}: loss")
            _assert_grads_equal(model, eager, i)
    assert total(b, "replays") >= 2


@pytest.mark.parametrize("schedule", ["unfrozen", "frozen_then_unfrozen"])
def test_a_parameter_unfrozen_or_frozen_after_compiling_recompiles(schedule):
    """requires_grad_ flipped on a parameter after the step was traced: the traced backward
    differentiates the leaves that required grad when Dynamo traced it, and Dynamo skips the
    tensor guards of a module whose __dict__ is unchanged, so the step kept its old leaves (a new
    leaf's .grad stayed None; a frozen one's was still written). The graph recompiles for the new
    leaves (Note [Leaves' requires_grad] in training_guards.py): losses and every .grad eager's bits, call
    by call, each leaf set replayed as one direct graph."""
    flags = {"unfrozen": [False, False, False, True, True, True, True],
             "frozen_then_unfrozen": [True, True, True, False, False, False, True, True, True]}[schedule]
    make, batch, loss_fn = MODELS["mlp_tanh"]
    eager, model, b, compiled = _compiled(make, loss_fn)
    reference = _stepper(eager, loss_fn)
    for i, requires_grad in enumerate(flags):
        for m in (eager, model):
            m[0].weight.requires_grad_(requires_grad)
            m.zero_grad(set_to_none=True)
        x, y = batch(gen(i))
        want, got = reference(x, y), compiled(x, y)
        assert_bitwise(got, want, f"step {i}: loss")
        for (name, pw), pg in zip(eager.named_parameters(), model.parameters()):
            assert (pg.grad is None) == (pw.grad is None), (i, name, requires_grad)
            if pw.grad is not None:
                assert_bitwise(pg.grad, pw.grad, f"step {i}: {name}.grad")
    assert set(b.call_paths.values()) == {"direct"}, b.call_paths
    assert total(b, "replays") >= 4, b.stats()


def _without_parameter_guards(entries):
    """A guard_filter_fn that drops torchreplay's requires_grad guard and the parameters' tensor guards."""
    return [not (e.guard_type == "TORCHREPLAY_REQUIRES_GRAD" or (e.guard_type == "TENSOR_MATCH" and "_parameters" in e.name))
            for e in entries]


@pytest.mark.parametrize("frozen_first", [True, False], ids=["unfrozen", "frozen"])
def test_a_leaf_changed_where_no_guard_sees_it_is_refused_naming_it(frozen_first):
    """Should a call reach the traced graph with a parameter's requires_grad flipped since it was
    traced (here the frame's guard_filter_fn drops torchreplay's requires_grad guard and Dynamo's
    tensor guards on the parameters), the call is refused, naming the argument, before anything
    runs (Note [Leaves' requires_grad])."""
    make, batch, loss_fn = MODELS["mlp_tanh"]
    torch.manual_seed(0)
    model = make()
    model[0].weight.requires_grad_(not frozen_first)
    b = backend()
    compiled = torch.compile(_stepper(model, loss_fn), backend=b,
                             options={"guard_filter_fn": _without_parameter_guards})
    for i in range(3):
        model.zero_grad(set_to_none=True)
        compiled(*batch(gen(i)))
    assert set(b.call_paths.values()) == {"direct"} and total(b, "replays") >= 2, (b.call_paths, b.stats())
    model.zero_grad(set_to_none=True)
    model[0].weight.requires_grad_(frozen_first)
    why = "did not require grad; it does now" if frozen_first else "no longer requires grad"
    with pytest.raises(RuntimeError, match=rf"argument \d+ \(.*weight.*\) (was a leaf requiring grad; it )?{why}"):
        compiled(*batch(gen(3)))
    assert all(p.grad is None for p in model.parameters())


def test_returning_the_loss_is_one_graph_and_its_backward_raises_as_eagers(regime):
    """`loss.backward(); return loss`, as steps are naturally written (Note [Returning a tensor
    whose backward ran]): one graph, called directly; the loss bitwise eager's and, like eager's,
    requiring grad, not a leaf, its backward refused with eager's error; gradients eager's."""
    def stepper(m, loss_fn):
        def step(x, y):
            loss = loss_fn(m(x), y)
            loss.backward()
            return loss
        return step
    case = _case(stepper=stepper)
    eager, model, b, compiled, reference, batch = (case[k] for k in ("eager", "model", "b", "compiled", "reference",
                                                                     "batch"))
    breaks = torch._dynamo.utils.counters["graph_break"].copy()
    for i in range(5):
        for m in (eager, model):
            m.zero_grad()
        x, y = batch(gen(i))
        got, want = compiled(x, y), reference(x, y)
        assert_bitwise(got, want, f"step {i}: loss")
        assert (got.requires_grad, got.is_leaf) == (want.requires_grad, want.is_leaf) == (True, False), i
        _assert_grads_equal(model, eager, i)
    errors = []
    for t in (want, got):
        with pytest.raises(RuntimeError) as info:
            t.backward()
        errors.append(str(info.value))
    assert errors[0] == errors[1] and "backward through the graph a second time" in errors[0]
    assert torch._dynamo.utils.counters["graph_break"] == breaks
    assert b.call_paths == {next(iter(b.call_paths)): "direct"} and len(b.call_paths) == 1, b.call_paths
    assert total(b, "replays") >= 3


def test_other_backends_keep_dynamos_own_setting(regime):
    """torchreplay traces the backward of its own compiles only: the same step compiled with
    aot_eager is still broken at loss.backward() (unless Dynamo's global switch is on)."""
    make, batch, loss_fn = MODELS["mlp_tanh"]
    torch.manual_seed(0)
    compiled = torch.compile(_stepper(make(), loss_fn), backend="aot_eager")
    before = sum(torch._dynamo.utils.counters["graph_break"].values())
    compiled(*batch(gen(0)))
    broke = sum(torch._dynamo.utils.counters["graph_break"].values()) > before
    assert broke == (regime == "default")
