"""foreach ops and optimizer steps inside compiled functions.

Compiled with torchreplay's "reduce-overhead" mode against eager, call by call, through the
differential harness (differential.py: outputs, mutated inputs, aliasing, state, replays)."""
import operator

import pytest
import torch
import torch.nn as nn

import torchreplay
from configs import backend, config
from differential import (  # noqa: F401 (recompile_limits is autouse)
    recompile_limits, run, total, gen, rn, assert_same, assert_bitwise, run_diff, run_module_diff)


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
        for k, (p_c, p_a) in enumerate(zip(sets[0], sets[2])):  # written only where the optimizer writes them
            assert_same(p_c.grad, p_a.grad, what=f"step {i}: grad {k} vs aot_eager")
    assert total(b, "replays") >= 3
    # The optimizer's state and parameters are tensors AOTAutograd lifts ahead of Dynamo's
    # arguments: bound in the direct Call (Note [The call path]), not a reason for the wrapper.
    assert b.call_paths and all(v == "direct" for v in b.call_paths.values()), b.call_paths


def test_compiled_optimizer_step_bumps_the_versions_of_what_it_writes():
    """A compiled step writes the parameters and the optimizer's state in place: their version
    counters move as eager's do, so autograd sees a parameter changed after it was saved."""
    torch.manual_seed(16)
    lin = nn.Linear(4, 3)
    opt = torch.optim.Adam(lin.parameters(), lr=0.01, foreach=True)
    b = backend()
    step = torch.compile(lambda: opt.step(), backend=b)
    for _ in range(4):
        lin(torch.randn(2, 4)).sum().backward()
        versions = [lin.weight._version] + [t._version for t in _opt_state_tensors(opt)]
        step()
        now = [lin.weight._version] + [t._version for t in _opt_state_tensors(opt)]
        assert all(n > v for n, v in zip(now, versions) if v or n), (versions, now)
        opt.zero_grad()
    lin(torch.randn(2, 4)).sum().backward()
    out = lin(torch.randn(2, 4, requires_grad=True))
    step()  # the weight saved for out's backward is written: eager's error, not stale gradients
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()
    assert all(v == "direct" for v in b.call_paths.values()), b.call_paths
    assert total(b, "replays") >= 2


def test_foreach_results_run_in_place_only_where_nothing_else_sees_it():
    """foreach_passes.reinplace_foreach: an out-of-place foreach op runs in place on its first list when
    nothing reads those tensors afterwards and they are fresh, or inputs the graph writes that
    very result back into. Inputs only read stay as they were; inputs updated end as eager's."""
    from torchreplay.foreach_passes import reinplace_foreach

    def f(xs, state):
        ys = torch._foreach_add(xs, 1.0)          # xs are the caller's, only read: not in place
        zs = torch._foreach_mul(ys, 2.0)          # ys fresh, read by nothing after: in place
        torch._foreach_mul_(state, 0.5)           # an update of the caller's tensors
        torch._foreach_add_(state, zs)
        return [z.sum() for z in zs]

    def inputs(i):
        g = gen(300 + i)
        return [rn(g, 3), rn(g, 2, 2)], [rn(g, 3), rn(g, 2, 2)]

    b = backend()
    compiled = torch.compile(f, backend=b)
    for i in range(4):
        xs, state = inputs(i)
        xs_e, state_e = [t.clone() for t in xs], [t.clone() for t in state]
        want = f(xs_e, state_e)
        got = compiled(xs, state)
        assert_same(got, want, what=f"call {i}: outputs")
        assert_same(xs, xs_e, what=f"call {i}: inputs only read")
        assert_same(state, state_e, what=f"call {i}: updated inputs")
    assert total(b, "replays") >= 2
    g = torch.fx.Graph()
    a, c = g.placeholder("a"), g.placeholder("c")
    added = g.call_function(torch.ops.aten._foreach_add.Scalar, ([a, c], 1.0))
    got = [g.call_function(operator.getitem, (added, k)) for k in range(2)]
    mul = g.call_function(torch.ops.aten._foreach_mul.Scalar, (got, 2.0))
    g.output([g.call_function(operator.getitem, (mul, k)) for k in range(2)])
    for n, v in [(a, torch.zeros(3)), (c, torch.zeros(2, 2))] + list(zip(got, [torch.zeros(3), torch.zeros(2, 2)])):
        n.meta["val"] = v
    added.meta["val"] = mul.meta["val"] = [torch.zeros(3), torch.zeros(2, 2)]
    module = torch.fx.GraphModule(torch.nn.Module(), g)
    assert reinplace_foreach(module) == 1  # the mul on fresh tensors, not the add on the inputs
    assert added.target is torch.ops.aten._foreach_add.Scalar and mul.target is torch.ops.aten._foreach_mul_.Scalar


def test_foreach_in_place_only_where_it_gives_the_same_bits():
    """Where an in-place foreach op would not give the functional op's bits, the functional op
    stays: a tensor a view was taken of (the view reads it after), a result that broadcasts
    (NAdam's 0-dim factors times the parameters), bfloat16 (the in-place kernels round
    otherwise). Bitwise against eager, or against aot_eager for the optimizers."""
    def viewed(a, c):
        t = a * 2
        v = t.view(-1)
        r = torch._foreach_add([t], [c])
        return r[0], v.sum()

    b = backend()
    compiled = torch.compile(viewed, backend=b)
    for i in range(3):
        a, c = torch.ones(4) + i, torch.full((4,), 10.0)
        assert_same(compiled(a, c), viewed(a, c), what=f"call {i}")
    assert total(b, "replays") >= 1

    for opt_cls, dtype, kwargs in [(torch.optim.NAdam, torch.float32, {}), (torch.optim.Adam, torch.bfloat16, {}),
                                   (torch.optim.AdamW, torch.bfloat16, dict(weight_decay=0.1))]:
        torch.manual_seed(17)
        init = [torch.randn(5, 6).to(dtype), torch.randn(5).to(dtype)]
        sets = [[nn.Parameter(t.clone()) for t in init] for _ in range(2)]
        opts = [opt_cls(ps, lr=0.01, foreach=True, **kwargs) for ps in sets]
        b = backend()
        steps = [torch.compile(opts[0].step, backend=b), torch.compile(opts[1].step, backend="aot_eager")]
        for i in range(3):
            grads = [torch.randn(t.shape).to(dtype) for t in init]
            for ps in sets:
                for p, gr in zip(ps, grads):
                    p.grad = gr.clone()
            for st in steps:
                st()
            for k, (p_c, p_a) in enumerate(zip(*sets)):
                assert_same(p_c, p_a, what=f"{opt_cls.__name__} {dtype} step {i}: param {k}")
            assert_same(_opt_state_tensors(opts[0]), _opt_state_tensors(opts[1]),
                        what=f"{opt_cls.__name__} {dtype} step {i}: state")
        assert total(b, "replays") >= 1, opt_cls


# Foreach ops as the per-tensor ops of their slow path, ordered by tensor and fused (Note [Foreach
# ops as per-tensor ops] in passes.py, Note [In-place instructions] in capture/tape/fused/fused_elementwise.cc).
FUSED_OPT_CASES = [
    pytest.param(torch.optim.Adam, dict(lr=0.01), id="adam"),
    pytest.param(torch.optim.AdamW, dict(lr=0.01, weight_decay=0.05), id="adamw"),
    pytest.param(torch.optim.Adam, dict(lr=0.01, amsgrad=True), id="adam_amsgrad"),
    pytest.param(torch.optim.SGD, dict(lr=0.1, momentum=0.9), id="sgd_momentum"),
    pytest.param(torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True), id="sgd_nesterov"),
    pytest.param(torch.optim.RMSprop, dict(lr=0.01), id="rmsprop"),
    pytest.param(torch.optim.Adagrad, dict(lr=0.01), id="adagrad"),
    pytest.param(torch.optim.Adamax, dict(lr=0.01), id="adamax"),
    pytest.param(torch.optim.NAdam, dict(lr=0.01), id="nadam"),
    pytest.param(torch.optim.Adadelta, dict(lr=1.0), id="adadelta"),
]
PARAM_SETS = {
    "mlp": [(64, 32), (64,), (64, 64), (64,), (4, 64), (4,)],  # the MLP 32-64-64-4
    "odd sizes": [(1,), (7,), (33,), (1031,), (), (5, 3)],
    # An embedding and a bias whose gradients are zero in the rows no token reaches: the state
    # stays zero there (Note [Zeros around MKL's sqrt]).
    "embedding rows": [(300, 16), (16,)],
}


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("params", list(PARAM_SETS))
@pytest.mark.parametrize("opt_cls,kwargs", FUSED_OPT_CASES)
def test_compiled_foreach_optimizer_update_is_one_fused_step_bitwise(opt_cls, kwargs, params, threads, tmp_path):
    """A compiled foreach optimizer step on the CPU: its foreach ops become per-tensor ops, each
    parameter's chain one after the other, and the whole update one fused elementwise step.
    Parameters and state after each of 20 steps bitwise equal to the step compiled with aot_eager
    (the foreach ops' slow path run eagerly), on one and two threads."""
    shapes = PARAM_SETS[params]
    torch.manual_seed(21)
    init = [torch.randn(s) for s in shapes]
    sets = [[nn.Parameter(t.clone()) for t in init] for _ in range(2)]  # replay, aot_eager
    opts = [opt_cls(ps, foreach=True, **kwargs) for ps in sets]
    cfg = config()
    cfg.debug.graph_dump.type, cfg.debug.graph_dump.path = "txt", str(tmp_path)
    b = torchreplay.get_backend(compiler_config=cfg)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        steps = [torch.compile(opts[0].step, backend=b), torch.compile(opts[1].step, backend="aot_eager")]
        for i in range(20):
            g = gen(2000 + i)
            grads = [rn(g, *s) for s in shapes]
            if params == "embedding rows":
                grads[0][(torch.arange(300) % 3 != 0) | (torch.arange(300) < 2 * i)] = 0.0
            for ps in sets:
                for p, gr in zip(ps, grads):
                    p.grad = gr.clone()
            for st in steps:
                st()
            for k, (p_c, p_a) in enumerate(zip(*sets)):
                assert_bitwise(p_c, p_a, f"step {i}: param {k}")
            assert_bitwise(_opt_state_tensors(opts[0]), _opt_state_tensors(opts[1]), f"step {i}: optimizer state")
    finally:
        torch.set_num_threads(saved)
    assert total(b, "replays") >= 15
    logs = [log for s in b.stats() for log in s["capture_log"]]
    assert logs and all(log["steps"] == log["fused_steps"] == 1 for log in logs), logs
    dumps = sorted(tmp_path.glob("*.key*.txt"))
    assert dumps and not any("_foreach_" in d.read_text() for d in dumps), [d.read_text() for d in dumps]


def test_foreach_ops_become_the_per_tensor_ops_of_their_slow_path():
    """decompose_foreach writes out ATen's CPU slow path: for each tensor the op it calls (same
    overload, same scalars, in place where it is), getitems replaced; the graph then gives the
    foreach ops' bits."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from torchreplay.foreach_passes import decompose_foreach

    def fn(a, b, c, s):
        xs, ys, zs = [a, b], [b, c], [c, a]
        r = torch._foreach_add(xs, ys, alpha=0.5)                # add.Tensor, alpha
        r = torch._foreach_mul(r, 1.5)                           # mul.Scalar
        r = torch._foreach_addcdiv(r, ys, zs, [0.25, -2.0])      # addcdiv, value per tensor
        r = torch._foreach_maximum(r, 0.1)                       # clamp_min
        r = torch._foreach_lerp(r, zs, 0.3)                      # lerp.Scalar
        p = torch._foreach_pow(0.9, [s, s.neg()])                 # pow.Scalar
        q = torch._foreach_div(r, s)                             # div.Tensor of a 0-dim tensor
        w = [a.clone(), b.clone()]
        torch._foreach_sub_(w, 1)                                # sub_.Scalar
        torch._foreach_addcmul_(w, ys, zs, value=0.01)           # addcmul_
        torch._foreach_sqrt_(w)                                  # sqrt_
        torch._foreach_mul_(w, q)                                # mul_.Tensor
        return list(r) + list(p) + list(q) + w

    g = gen(31)
    args = (rn(g, 5), rn(g, 5), rn(g, 5), rn(g))
    gm = make_fx(fn)(*args)
    assert decompose_foreach(gm) == 11
    gm.recompile()
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert not any("_foreach_" in str(t) for t in targets), targets
    aten = torch.ops.aten
    for t in (aten.add.Tensor, aten.mul.Scalar, aten.addcdiv.default, aten.clamp_min.default, aten.lerp.Scalar,
              aten.pow.Scalar, aten.div.Tensor, aten.sub_.Scalar, aten.addcmul_.default, aten.sqrt_.default,
              aten.mul_.Tensor):
        assert targets.count(t) == 2, (t, targets)
    for k in range(3):
        g = gen(40 + k)
        args = (rn(g, 5), rn(g, 5), rn(g, 5), rn(g))
        assert_bitwise(gm(*args), fn(*args), f"call {k}")


def _order(fn, *args):
    from torch.fx.experimental.proxy_tensor import make_fx
    from torchreplay.foreach_passes import decompose_foreach

    gm = make_fx(fn)(*args)
    decompose_foreach(gm)
    return [(n.target._schema.name.split("::")[1], n.args[0].name) for n in gm.graph.nodes
            if n.op == "call_function" and n.target._schema.is_mutable]


def test_per_tensor_chains_are_ordered_by_tensor_only_where_no_tensor_is_shared():
    """Each tensor's chain comes whole, in order, where no index reads what another writes; lists
    that share a tensor keep the graph's order, op by op. Bitwise either way."""
    def independent(a, b, c, d):
        torch._foreach_mul_([a, b], 0.5)
        torch._foreach_add_([a, b], [c, d])
        return a + b

    def shared(a, b, c, d):
        torch._foreach_mul_([a, b], 0.5)
        torch._foreach_add_([a, b], [b, c])  # index 0 reads b, which index 1 writes
        return a + b

    def repeated(a, b, c, d):
        torch._foreach_mul_([a, a], 0.5)     # one tensor at both indices
        torch._foreach_add_([a, a], [c, d])
        return a + b

    g = gen(50)
    args = [rn(g, 6) for _ in range(4)]
    assert _order(independent, *args) == [("mul_", "a_1"), ("add_", "a_1"), ("mul_", "b_1"), ("add_", "b_1")]
    assert _order(shared, *args) == [("mul_", "a_1"), ("mul_", "b_1"), ("add_", "a_1"), ("add_", "b_1")]
    assert _order(repeated, *args) == [("mul_", "a_1"), ("mul_", "a_1"), ("add_", "a_1"), ("add_", "a_1")]
    for fn in (independent, shared):
        run_diff(fn, lambda i, g: tuple(rn(g, 6) for _ in range(4)), seed=51)
    # A tensor twice in one list: AOTAutograd's functional graph already differs from eager there
    # (aot_eager too); the replay gives the graph's bits.
    b = backend()
    compiled, reference = torch.compile(repeated, backend=b), torch.compile(repeated, backend="aot_eager")
    for k in range(4):
        g = gen(60 + k)
        args = [rn(g, 6) for _ in range(4)]
        mine = [t.clone() for t in args]
        assert_bitwise(compiled(*mine), reference(*args), f"call {k}")
        assert_bitwise(mine, args, f"call {k}: inputs")
    assert total(b, "replays") >= 2


@pytest.mark.parametrize("opt_cls", [torch.optim.Adam, torch.optim.AdamW], ids=["adam", "adamw"])
def test_learning_rate_as_a_tensor_changed_by_a_scheduler_replays_one_graph(opt_cls):
    """The learning rate a scheduler changes every step, as a tensor (`capturable=True`): one
    graph, replayed on every call with the new rate, parameters and state bitwise aot_eager's
    after each step (a float rate would make Dynamo recompile per value, for every backend)."""
    shapes = [(64, 32), (64,), (300, 16)]
    torch.manual_seed(23)
    init = [torch.randn(s) for s in shapes]
    sets = [[nn.Parameter(t.clone()) for t in init] for _ in range(2)]  # replay, aot_eager
    opts = [opt_cls(ps, lr=torch.tensor(0.01), foreach=True, capturable=True) for ps in sets]
    scheds = [torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=10) for o in opts]
    b = backend()
    steps = [torch.compile(opts[0].step, backend=b), torch.compile(opts[1].step, backend="aot_eager")]
    rates = set()
    for i in range(12):
        g = gen(3000 + i)
        grads = [rn(g, *s) for s in shapes]
        grads[2][1::2] = 0.0  # embedding rows no token reached
        for ps in sets:
            for p, gr in zip(ps, grads):
                p.grad = gr.clone()
        for st, sc in zip(steps, scheds):
            st()
            sc.step()
        rates.add(float(opts[0].param_groups[0]["lr"]))
        assert_bitwise([p.detach() for p in sets[0]], [p.detach() for p in sets[1]], f"step {i}: parameters")
        assert_bitwise(_opt_state_tensors(opts[0]), _opt_state_tensors(opts[1]), f"step {i}: optimizer state")
    stats = b.stats()
    assert len(rates) >= 10 and len(stats) == 1, (rates, stats)
    assert stats[0]["replays"] >= 10, stats
    logs = stats[0]["capture_log"]
    assert len(logs) == 1 and logs[0]["steps"] == logs[0]["fused_steps"] == 1, logs
