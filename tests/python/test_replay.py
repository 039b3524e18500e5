"""Named tests, one surprising behaviour each, of the reduce-overhead engine's semantics."""
import re
import threading

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import torchreplay
from configs import backend, config
from differential import assert_bitwise, bitwise_diff, engine_for, run
from torchreplay import _C
from torchreplay.lowering import lower


def test_one_capture_per_key_and_keys_come_back():
    e = engine_for(lambda x: torch.relu(x) * 2, [torch.randn(4, 4)])
    for shape in [(4, 4), (4, 4), (8, 4), (8, 4), (4, 4), (8, 4), (4, 4)]:
        x = torch.randn(shape)
        assert_bitwise(run(e, x)[0], torch.relu(x) * 2)
    s = e.stats()
    assert s["captures"] == 2 and s["warmups"] == 2 and s["replays"] == 5
    reasons = [c["reason"] for c in s["capture_log"]]
    assert reasons[0] == "no graph yet"
    assert "input 0: sizes (4, 4) -> (8, 4)" in reasons[1]


@pytest.mark.parametrize("name", ["cholesky", "inv", "solve"])
def test_an_op_without_outputs_runs_every_replay(name):
    """A graph's check that returns nothing (make_fx writes linalg.cholesky as linalg_cholesky_ex,
    then _linalg_check_errors on its info) is a step of every replay, not folded at capture: the
    good calls replay eager's bits, a bad matrix raises eager's error."""
    fns = {"cholesky": lambda a, b: torch.linalg.cholesky(a) * 2,
           "inv": lambda a, b: torch.linalg.inv(a) * 2,
           "solve": lambda a, b: torch.linalg.solve(a, b) * 2}
    fn = fns[name]
    spd = lambda i: torch.eye(4) * (2 + i) + 0.5  # noqa: E731
    b = torch.randn(4, 2)
    e = engine_for(fn, [spd(0), b])
    for i in range(3):
        assert_bitwise(run(e, spd(i), b)[0], fn(spd(i), b), f"{name}, call {i}")
    s = e.stats()
    assert s["replays"] == 2 and s["eager_fallbacks"] == 0, s
    bad = -torch.eye(4) if name == "cholesky" else torch.zeros(4, 4)
    with pytest.raises(torch.linalg.LinAlgError):
        fn(bad, b)
    with pytest.raises(torch.linalg.LinAlgError):
        run(e, bad, b)
    assert_bitwise(run(e, spd(1), b)[0], fn(spd(1), b), f"{name}, after the bad call")


def test_strides_and_offsets_are_part_of_the_key():
    e = engine_for(lambda x: x + 1, [torch.randn(4, 4)])
    base = torch.randn(4, 4)
    shifted = torch.randn(20)[4:].view(4, 4)   # same sizes and strides, storage offset 4
    for x in [base, base, base.t(), base.t(), shifted, shifted]:
        assert_bitwise(run(e, x)[0], x + 1)
    assert e.stats()["captures"] == 3


def test_capture_limit_then_eager_fallback_logged_once():
    e = engine_for(lambda x: x * 3, [torch.randn(2)], capture_limit=2, warmup_iters=0)
    for n in [2, 3, 4, 5, 4, 5, 2]:
        x = torch.randn(n)
        assert_bitwise(run(e, x)[0], x * 3)
    s = e.stats()
    assert s["captures"] == 2
    assert s["eager_fallbacks"] == 4            # sizes 4, 5, 4, 5 run eagerly
    assert len(s["fallback_reasons"]) == 1      # logged once
    assert "capture limit (2 keys) reached" in s["fallback_reasons"][0]


def test_static_input_moved_is_recaptured_never_stale():
    w = torch.randn(4, 4)
    e = engine_for(lambda x, w: x @ w.t(), [torch.randn(2, 4), w], static=[1])
    x = torch.randn(2, 4)
    for _ in range(3):
        assert_bitwise(run(e, x, w)[0], x @ w.t())
    w2 = torch.randn(4, 4)                     # same key, new address
    assert_bitwise(run(e, x, w2)[0], x @ w2.t())
    assert_bitwise(run(e, x, w2)[0], x @ w2.t())
    s = e.stats()
    assert any("static input 1 (w_1) moved" in c["reason"] for c in s["capture_log"])
    w.copy_(torch.randn(4, 4))                 # in-place update of a static input is seen too
    assert_bitwise(run(e, x, w)[0], x @ w.t())


def test_copy_into_input_and_index_copy_kv_cache():
    def step(cache, pos, new, x):
        cache.index_copy_(0, pos, new)
        x.copy_(x * 2)
        return cache.sum(0)

    cache = torch.zeros(6, 3)
    e = engine_for(step, [cache.clone(), torch.tensor([0]), torch.randn(1, 3), torch.randn(3)])
    ref_cache = torch.zeros(6, 3)
    for i in range(6):
        pos, new, x = torch.tensor([i]), torch.randn(1, 3), torch.randn(3)
        x_ref = x.clone()
        out = run(e, cache, pos, new, x)[0]
        want = step(ref_cache, pos, new, x_ref)
        assert_bitwise(out, want)
        assert_bitwise(cache, ref_cache)
        assert_bitwise(x, x_ref)


@pytest.mark.parametrize("keep", [True, False])
def test_buffer_mutation_with_keep_inference_input_mutations(keep):
    class BN(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = torch.nn.BatchNorm1d(4)

        def forward(self, x):
            return self.bn(x)

    eager, model = BN().train(), BN().train()
    config = torchreplay.CompilerConfig()
    config.mode = "reduce-overhead"
    config.keep_inference_input_mutations = keep
    compiled = torch.compile(model, backend=torchreplay.get_backend(compiler_config=config))
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(8, 4)
            assert_bitwise(compiled(x), eager(x))
            assert_bitwise(model.bn.running_mean, eager.bn.running_mean)
            assert_bitwise(model.bn.running_var, eager.bn.running_var)
            assert model.bn.num_batches_tracked == eager.bn.num_batches_tracked


def test_stale_output_raises_after_next_replay():
    e = engine_for(lambda x: torch.sin(x) + 1, [torch.randn(5)])
    run(e, torch.randn(5))                     # warm-up: an eager output, never invalidated
    first = run(e, torch.randn(5))[0]          # replay: lives in the pool
    kept = first.clone()
    second_x = torch.randn(5)
    second = run(e, second_x)[0]
    assert_bitwise(second, torch.sin(second_x) + 1)
    with pytest.raises(RuntimeError, match="a later replay has reused its memory"):
        first.sum()
    with pytest.raises(RuntimeError, match="clone_outputs"):
        print(first)
    assert not torch.equal(kept, second)       # it really would have shown new data


def test_clone_outputs_keeps_every_output_valid():
    e = engine_for(lambda x: torch.sin(x) + 1, [torch.randn(5)], clone_outputs=True)
    xs = [torch.randn(5) for _ in range(4)]
    outs = [run(e, x)[0] for x in xs]
    for x, o in zip(xs, outs):
        assert_bitwise(o, torch.sin(x) + 1)


def test_output_fed_back_as_input():
    e = engine_for(lambda h: torch.tanh(h * 0.5 + 1), [torch.randn(6)])
    h = torch.randn(6)
    h_ref = h.clone()
    for _ in range(5):
        h = run(e, h)[0]
        h_ref = torch.tanh(h_ref * 0.5 + 1)
        assert_bitwise(h, h_ref)


def test_output_aliasing_input_is_a_view_of_the_callers_tensor():
    e = engine_for(lambda x: (x.view(-1), x * 2), [torch.randn(2, 3)])
    for _ in range(3):
        x = torch.randn(2, 3)
        flat, doubled = run(e, x)
        assert flat.data_ptr() == x.data_ptr()
        assert_bitwise(doubled, x * 2)


def test_bad_inputs_get_clear_errors():
    e = engine_for(lambda x: x + 1, [torch.randn(2, 2)])
    with pytest.raises(ValueError, match="expected 1 inputs, got 2"):
        run(e, torch.randn(2, 2), torch.randn(2, 2))
    with pytest.raises(ValueError, match="expected dtype Float, got Long"):
        run(e, torch.ones(2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="expected a 2-d tensor, got 3-d"):
        run(e, torch.randn(1, 2, 2))
    assert_bitwise(run(e, torch.ones(2, 2))[0], torch.full((2, 2), 2.0))


def test_data_dependent_graph_falls_back_with_reason():
    e = engine_for(lambda x: torch.nonzero(x > 0).float().sum(), [torch.randn(6)])
    for _ in range(3):
        x = torch.randn(6)
        assert_bitwise(run(e, x)[0], torch.nonzero(x > 0).float().sum())
    s = e.stats()
    assert s["captures"] == 0 and s["eager_fallbacks"] >= 1
    assert "data-dependent output shape" in s["fallback_reasons"][0]


def test_boolean_mask_indexing_falls_back_with_reason():
    # x[x > 0] has as many rows as x has positive elements: not fixed by the guard key.
    e = engine_for(lambda x: x[x > 0] * 2, [torch.randn(8)])
    for _ in range(4):
        x = torch.randn(8)
        assert_bitwise(run(e, x)[0], x[x > 0] * 2)
    s = e.stats()
    assert s["captures"] == 0 and "aten::index.Tensor" in s["fallback_reasons"][0]
    assert "data-dependent output shape" in s["fallback_reasons"][0]


def test_precapture_captures_every_key_ahead():
    e = engine_for(lambda x: torch.relu(x) + 1, [torch.randn(4, 8)])
    e.precapture([[torch.randn(n, 8)] for n in (2, 8, 4)])
    s = e.stats()
    assert s["captures"] == 3
    assert [c["key"].split(")")[0] for c in s["capture_log"]] == [
        "(Float(8, 8", "(Float(4, 8", "(Float(2, 8"]   # largest first
    calls = s["calls"]
    for n in (2, 4, 8):
        x = torch.randn(n, 8)
        assert_bitwise(run(e, x)[0], torch.relu(x) + 1)
    assert e.stats()["replays"] == s["replays"] + 3 and e.stats()["captures"] == 3
    assert e.stats()["calls"] == calls + 3


def test_pool_shared_by_keys_costs_about_the_largest():
    e = engine_for(lambda x: torch.relu(x @ x.t()).sum(0) + 1, [torch.randn(64, 16)])
    sizes = [64, 32, 16, 8]
    alone = []
    for n in sizes:
        single = engine_for(lambda x: torch.relu(x @ x.t()).sum(0) + 1, [torch.randn(n, 16)])
        for _ in range(2):
            run(single, torch.randn(n, 16))
        alone.append(single.stats()["pool_bytes"])
        for _ in range(2):
            run(e, torch.randn(n, 16))
    assert e.stats()["captures"] == 4
    assert e.stats()["pool_bytes"] <= 1.1 * max(alone) < 0.9 * sum(alone)


def test_threads_calling_one_compiled_model():
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16)).eval()
    config = torchreplay.CompilerConfig()
    config.mode = "reduce-overhead"
    backend = torchreplay.get_backend(compiler_config=config)
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        compiled(torch.randn(4, 16))           # compile once, on this thread
    errors = []

    def worker(seed):
        g = torch.Generator().manual_seed(seed)
        try:
            with torch.no_grad():
                for _ in range(50):
                    x = torch.randn(4, 16, generator=g)
                    d = bitwise_diff(compiled(x), model(x))
                    if d is not None:
                        errors.append(f"thread {seed}: {d}")
        except Exception as ex:  # noqa: BLE001 - reported below
            errors.append(f"thread {seed}: {ex!r}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sum(s["replays"] for s in backend.stats()) >= 4 * 45


def test_profiler_shows_replay_ranges():
    e = engine_for(lambda x: torch.relu(x) + 1, [torch.randn(8)])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            run(e, torch.randn(8))
    names = [ev.name for ev in prof.events()]
    assert names.count("torchreplay::warmup") == 1
    assert names.count("torchreplay::capture") == 1
    assert names.count("torchreplay::replay") == 4


TYPED_CASES = [   # one op per typed-step signature (Note [Typed steps] in capture/tape/typed_call.h)
    ("TO", lambda x, y, z: torch.sin(x)),
    ("TTO", lambda x, y, z: x * y),
    ("TSO", lambda x, y, z: torch.nn.functional.leaky_relu(x, 0.1)),
    ("TTSO", lambda x, y, z: torch.add(x, y, alpha=2)),
    ("TSSO", lambda x, y, z: torch.nn.functional.hardtanh(x, -0.5, 0.5)),
    ("TTTO", lambda x, y, z: torch.where(z > 0, x, y)),
    ("TTTSO", lambda x, y, z: torch.addcmul(x, y, z, value=0.5)),
    ("TTTSSO", lambda x, y, z: torch.addmm(x, y, z.t(), beta=0.5, alpha=2)),
    ("TssO", lambda x, y, z: torch.clamp(x, -0.5, 0.5)),
    ("TIBO", lambda x, y, z: torch.softmax(x, 1)),
    ("relu as clamp_min", lambda x, y, z: torch.relu(x)),
    ("prepared unary float", lambda x, y, z: torch.rsqrt(x.abs() + 1) + torch.sqrt(y.abs()) * torch.erf(z)),
    ("prepared silu, reciprocal", lambda x, y, z: torch.nn.functional.silu(x) - torch.reciprocal(y)),
    ("prepared comparisons", lambda x, y, z: (x > y) & (y <= z) | (x == z) | (x != y).logical_not()),
]


@pytest.mark.parametrize("sig,fn", TYPED_CASES, ids=[c[0] for c in TYPED_CASES])
def test_typed_steps_are_used_and_bitwise_equal(sig, fn):
    # Fusion off: most of these ops are fused elementwise steps otherwise (test_fusion.py), and
    # the typed and prepared steps are what an op the fused kernel does not compute gets.
    e = engine_for(fn, [torch.randn(6, 6) for _ in range(3)], fuse_elementwise=False)
    for _ in range(4):
        x, y, z = (torch.randn(6, 6) for _ in range(3))
        got = run(e, x, y, z)[0]
        want = fn(x, y, z)
        assert_bitwise(got, want)
    log = e.stats()["capture_log"]
    assert len(log) == 1 and log[0]["functional_steps"] == 0
    assert log[0]["typed_steps"] == log[0]["out_variant_steps"] >= 1, log[0]
    if sig.startswith("prepared") or sig in ("TO", "TTO", "TTSO", "relu as clamp_min"):
        assert log[0]["prepared_steps"] >= 1, log[0]


def test_python_number_arguments_keep_eager_type_promotion():
    # float64 tensor * 1.1 and int tensor + 2: the cast-once path must leave results identical.
    for x in (torch.randn(5, dtype=torch.float64), torch.randint(-5, 5, (5,)), torch.randn(5)):
        e = engine_for(lambda x: (x * 1.1 + 2) - 0.25, [x])
        for _ in range(3):
            got = run(e, x)[0]
            want = (x * 1.1 + 2) - 0.25
            assert_bitwise(got, want)


def test_small_key_first_then_larger_key_grows_the_arena_and_both_stay_exact():
    # The second key needs a larger arena, which moves every buffer of the first key: its prepared
    # kernels must follow (Note [Prepared pointwise steps]).
    fn = lambda x, y: torch.relu(torch.sin(x) * 1.01 + y) - torch.tanh(y) / 3  # noqa: E731
    e = engine_for(fn, [torch.randn(2, 4), torch.randn(2, 4)])
    for n in [2, 2, 2, 256, 256, 2, 256, 2, 2]:
        x, y = torch.randn(n, 4), torch.randn(n, 4)
        assert_bitwise(run(e, x, y)[0], fn(x, y), f"n={n}")
    s = e.stats()
    assert s["captures"] == 2 and s["capture_log"][1]["arena_bytes"] > s["capture_log"][0]["arena_bytes"]


def test_per_call_operands_with_strides_and_offsets():
    fn = lambda x, y: (x + y) * torch.sigmoid(x) - torch.neg(y)  # noqa: E731
    e = engine_for(fn, [torch.randn(6, 5), torch.randn(6, 5)])
    base = torch.randn(40, 8)
    for _ in range(3):
        x = torch.randn(5, 6).t()               # transposed
        y = base[3:9, 1:6]                      # offset, row stride 8
        assert_bitwise(run(e, x, y)[0], fn(x, y))
        base.normal_()


def test_values_made_from_constants_are_folded_once_and_random_ones_are_not():
    def fn(x):
        pos = torch.arange(x.shape[0], dtype=torch.float32)           # constant under the key
        scale = torch.scalar_tensor(0.5)
        noise = torch.rand(x.shape[0])                                # random: never folded
        return x * pos[:, None] * scale, noise

    e = engine_for(fn, [torch.randn(4, 3)])
    noises = []
    for _ in range(4):
        x = torch.randn(4, 3)
        out, noise = run(e, x)
        assert_bitwise(out, x * torch.arange(4.0)[:, None] * 0.5)
        noises.append(noise.clone())
    assert not torch.equal(noises[-1], noises[-2])
    log = e.stats()["capture_log"][0]
    assert "aten::rand" in log["functional_ops"] and "aten::arange" not in log["functional_ops"]


def test_values_made_from_constants_with_out_overloads_are_folded_too():
    """A causal mask made from sizes alone (arange, cumsum, comparisons: ops with out= overloads,
    as transformers builds its masks) is computed once at capture, not by a step every call."""
    def fn(x):
        pos = torch.arange(x.shape[-1]).cumsum(0)
        mask = pos[None, :] <= pos[:, None]
        return x.masked_fill(~mask, 0.0) * 2

    cfg = config()
    cfg.mode = "reduce-overhead"
    step = torchreplay.capture(fn, (torch.randn(6, 6),), config=cfg)
    for _ in range(3):
        x = torch.randn(6, 6)
        assert_bitwise(step(x), fn(x))
    assert step.stats()["replays"] == 2
    ops = [r["op"] for r in step.profile(torch.randn(6, 6), iterations=2)]
    assert len(ops) == 1 and ops[0].startswith("fused:"), ops     # masked_fill and mul: one step
    log = step.stats()["capture_log"][0]
    assert log["precomputed"] >= 5, log


def test_a_constant_written_in_place_later_is_not_folded():
    def fn(x):
        acc = torch.zeros(3)
        acc.add_(x.sum(0))          # per-call data written into what started as a constant
        return acc * 2

    e = engine_for(fn, [torch.randn(4, 3)])
    for _ in range(4):
        x = torch.randn(4, 3)
        assert_bitwise(run(e, x)[0], x.sum(0) * 2)


def test_like_ops_of_per_call_tensors_are_made_once_unless_written_or_returned():
    """Note [Metadata-only ops]: ones_like, empty_like, zeros_like, full_like and new_* read only
    their tensor argument's metadata, so those of per-call tensors are made once at capture (a
    traced backward's loss seed and new gradients are such); not one written in place or
    returned."""
    def fn(x):
        seed = torch.ones_like(x.sum())                                 # made once
        twice = torch.full_like(x, 2.0) * x + torch.zeros_like(x)       # both made once
        grad = torch.empty_like(x).copy_(x.t().t() * 3)                 # written in place
        acc = torch.zeros_like(x)
        acc.add_(x)                                                     # written in place
        mine = x.new_zeros(x.shape)                                     # returned
        return x.sum() * seed, twice, grad, acc * 1, mine

    e = engine_for(fn, [torch.randn(4, 3)])
    mine = []
    for _ in range(4):
        x = torch.randn(4, 3)
        got, want = run(e, x), fn(x)
        for g, w in zip(got, want):
            assert_bitwise(g, w)
        got[4].add_(1)                      # the caller owns what it receives
        mine.append(got[4])
    assert e.stats()["replays"] == 3
    assert all(m.eq(1).all() for m in mine) and mine[-1].data_ptr() != mine[-2].data_ptr()
    functional = e.stats()["capture_log"][0]["functional_ops"]
    assert [functional.count(op) for op in ("aten::ones_like", "aten::empty_like", "aten::zeros_like",
                                            "aten::new_zeros", "aten::full_like")] == [0, 1, 1, 1, 0], functional


def test_empty_like_whose_bytes_are_read_runs_every_call():
    """Note [Metadata-only ops]: an empty_like read by something other than a functional copy is
    not made once at capture: with deterministic algorithms (fill_uninitialized_memory, on by
    default), turned on after capture, eager fills it per call and the replay must too (another
    key, captured under the new setting, Note [Ambient state], and replays that)."""
    def fn(x):
        return torch.where(x > 0, x, torch.empty_like(x)), torch.empty_like(x).copy_(x) * 2

    e = engine_for(fn, [torch.randn(3, 4)])
    for _ in range(3):
        run(e, torch.randn(3, 4))
    before = e.stats()["replays"]
    torch.use_deterministic_algorithms(True)
    try:
        for _ in range(3):
            x = torch.randn(3, 4)
            got, want = run(e, x), fn(x)
            assert want[0][x <= 0].isnan().all()
            for g, w in zip(got, want):
                assert_bitwise(g, w)
    finally:
        torch.use_deterministic_algorithms(False)
    log = e.stats()["capture_log"]
    assert e.stats()["replays"] == before + 2 and "deterministic algorithms off -> on" in log[-1]["reason"], log
    assert all(c["functional_ops"].count("aten::empty_like") >= 1 for c in log)


# ---- through torch.compile: behaviours that once went wrong

@pytest.mark.parametrize("kind", ["parameter", "buffer"])
def test_foreach_update_of_a_static_tensor_runs_every_call(kind):
    # A _foreach_ op returns a list of fresh tensors: never folded into a constant at capture.
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            if kind == "parameter":
                self.w = torch.nn.Parameter(torch.zeros(3), requires_grad=False)
            else:
                self.register_buffer("w", torch.zeros(3))

        def forward(self, x):
            torch._foreach_add_([self.w], 1.0)
            return x + self.w

    c = torch.compile(M(), backend=backend())
    assert [c(torch.zeros(3))[0].item() for _ in range(6)] == [1, 2, 3, 4, 5, 6]


def test_non_dense_view_of_an_output_fed_back():
    f = lambda h: torch.cat([torch.tanh(h) * 0.5, h], dim=1)
    b = backend()
    c = torch.compile(f, backend=b)
    h = h_ref = torch.randn(4, 8)
    for _ in range(6):
        out, ref = c(h), f(h_ref)
        assert_bitwise(out, ref)
        h, h_ref = out[:, :8], ref[:, :8]
    # At most the contiguous key and the strided one (Dynamo may compile each as a graph).
    assert sum(s["captures"] for s in b.stats()) <= 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("op", ["mul", "div", "add"])
def test_reduced_precision_binary_op_with_a_0dim_tensor(dtype, op):
    # ATen's reduced-precision kernels remove a CPU-scalar operand from the iterator they get.
    fn = getattr(torch, op)
    c = torch.compile(lambda x, s: fn(x, s), backend=backend())
    for _ in range(8):
        x, s = torch.randn(4, 8, dtype=dtype), torch.randn((), dtype=dtype) + 2
        assert_bitwise(c(x, s), fn(x, s))
    y = torch.randn(4, 8, dtype=dtype)
    c2 = torch.compile(lambda y: y / y.abs().max(), backend=backend())
    for _ in range(6):
        y = torch.randn(4, 8, dtype=dtype)
        assert_bitwise(c2(y), y / y.abs().max())


def test_output_fed_back_costs_one_capture_and_stays_exact():
    b = backend()
    c = torch.compile(lambda x, h: torch.tanh(x + h), backend=b)
    h = h_ref = torch.zeros(4)
    for _ in range(8):
        x = torch.randn(4)
        h, h_ref = c(x, h), torch.tanh(x + h_ref)
        assert_bitwise(h, h_ref)
    assert b.stats()[0]["captures"] == 1


def test_lstm_cell_state_fed_back():
    torch.manual_seed(0)
    cell = torch.nn.LSTMCell(6, 5)
    c = torch.compile(cell, backend=backend())
    with torch.no_grad():
        state = ref = (torch.zeros(3, 5), torch.zeros(3, 5))
        for _ in range(6):
            x = torch.randn(3, 6)
            state, ref = c(x, state), cell(x, ref)
            assert_bitwise(state, ref)


def test_an_output_kept_by_a_later_input_is_copied_out_not_invalidated():
    # The call that reads an earlier output copies it out of the pool before reusing the pool.
    e = engine_for(lambda x, h: torch.tanh(x + h), [torch.randn(4), torch.randn(4)])
    run(e, torch.randn(4), torch.randn(4))
    h = run(e, torch.randn(4), torch.randn(4))[0]      # capture + replay: h is in the pool
    kept = h.clone()
    x = torch.randn(4)
    out = run(e, x, h)[0]
    assert_bitwise(h, kept)                          # still readable, and unchanged
    assert_bitwise(out, torch.tanh(x + kept))
    assert h.storage_offset() == 0 and out.storage_offset() == 0


def test_gradient_accumulation_and_two_forwards_one_backward():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    ref = __import__("copy").deepcopy(model)
    c = torch.compile(model, backend=backend())
    for _ in range(3):
        for _ in range(2):                               # two backward passes per step
            x = torch.randn(3, 4)
            c(x).sum().backward()
            ref(x).sum().backward()
        x1, x2 = torch.randn(3, 4), torch.randn(3, 4)    # two forwards, one backward
        (c(x1).sum() + c(x2).sum()).backward()
        (ref(x1).sum() + ref(x2).sum()).backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            assert_bitwise(p.grad, q.grad)


def test_symbolic_float_arithmetic_on_sizes():
    f = lambda x: x * (x.shape[0] / 2) + x ** (x.shape[0] // 2) - float(x.shape[0]) ** 0.5
    c = torch.compile(f, backend=backend(), dynamic=True)
    for n in (3, 4, 5, 6, 4, 3):
        x = torch.randn(n)
        assert_bitwise(c(x), f(x), f"n={n}")


@pytest.mark.parametrize("fn", [
    lambda x: x[x > 0] * 2,
    lambda x: torch.nonzero(x).float(),
    lambda x: torch.unique(x.round()),
    lambda x: torch.masked_select(x, x < 0),
    lambda x: torch.repeat_interleave(x, (x > 0).long() + 1),
    lambda x: torch.where(x > 0)[0],
    lambda x: torch.bincount((x.abs() * 3).long()),
], ids=["mask", "nonzero", "unique", "masked_select", "repeat_interleave", "where", "bincount"])
@torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True)
def test_data_dependent_ops_run_eagerly_with_a_reason(fn):
    b = backend()
    c = torch.compile(fn, backend=b)
    for _ in range(4):
        x = torch.randn(10)
        assert_bitwise(c(x), fn(x))
    stats = b.stats()
    assert sum(s["eager_fallbacks"] for s in stats) >= 1
    assert any("data-dependent" in r for s in stats for r in s["fallback_reasons"])


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_complex_python_scalars(mode):
    cfg = torchreplay.CompilerConfig()
    cfg.mode = mode
    f = lambda z: z * 2j + (1 - 0.5j)
    c = torch.compile(f, backend=torchreplay.get_backend(compiler_config=cfg))
    for _ in range(4):
        z = torch.randn(4, dtype=torch.complex64)
        assert_bitwise(c(z), f(z))


def test_an_int_beyond_64_bits_is_a_clear_overflow_error():
    gm = make_fx(lambda x, n: x * n)(torch.ones(2), 3)
    e = _C.Engine(lower(gm, [torch.ones(2), 3]))
    with pytest.raises(OverflowError, match="does not fit in 64 bits"):
        run(e, torch.ones(2), 2 ** 70)
    assert_bitwise(run(e, torch.ones(2), 3)[0], torch.full((2,), 3.0))


def test_buffer_reassigned_in_forward_is_exact_and_rebound_not_recaptured_every_call():
    class EMA(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.register_buffer("avg", torch.zeros(4))

        def forward(self, x):
            y = self.lin(x)
            self.avg = self.avg * 0.9 + y.mean(0) * 0.1
            return y - self.avg

    torch.manual_seed(0)
    model = EMA()
    ref = __import__("copy").deepcopy(model)
    b = backend()
    c = torch.compile(model, backend=b)
    with torch.no_grad():
        for _ in range(10):
            x = torch.randn(3, 4)
            assert_bitwise(c(x), ref(x))
            assert_bitwise(model.avg, ref.avg)
    # The buffer is the previous replay's output, handed out of the pool, at the second capture:
    # rebound per call from then on (Note [Static inputs handed out of a pool]), not recaptured.
    (s,) = b.stats()
    assert s["captures"] == 2 and s["replays"] == 8
    assert "handed out of a pool; it is rebound per call" in s["capture_log"][-1]["reason"]


CATS = {  # each a cat, stack or clone the tape makes as copies (Note [Concatenation as copies])
    "contiguous along dim 0": lambda x, y: torch.cat([x * 2, y]),
    "contiguous along the last dim": lambda x, y: torch.cat([x, y + 1], -1),
    "halves of a row swapped (rotary embedding)": lambda x, y: torch.cat([-x[..., 2:], x[..., :2]], -1),
    "a transposed input": lambda x, y: torch.cat([x.t().contiguous().t(), y], 1),
    "strided rows and a legacy empty tensor": lambda x, y: torch.cat([x[::2], torch.empty(0), y[1::2]]),
    "three inputs along dim 1 of a 3-d view": lambda x, y: torch.cat([x.view(2, 2, 3), y.view(2, 2, 3), x.view(2, 2, 3)], 1),
    "an input of the graph itself": lambda x, y: torch.cat([x, y], 0),
    "clone of an expanded view (repeat_kv)": lambda x, y: x[:, None].expand(4, 2, 3).reshape(8, 3) * 2,
    "clone keeping a transposed layout": lambda x, y: (x * 2).t().clone() + y.t(),
    "clone of a single element": lambda x, y: x[1, 2].clone() * y,
    "stack along dim 0": lambda x, y: torch.stack([x * 2, y]),
    "stack along the last dim of strided rows": lambda x, y: torch.stack([x[::2], y[1::2] + 1, x[1::2]], -1),
    "stack along dim 1 of a transposed input": lambda x, y: torch.stack([x.t(), y.t() * 3], 1),
    "stack of scalars": lambda x, y: torch.stack([x[0, 0] * 2, y[1, 1], x.sum()]),
    # channels-last images along their channels (squeezenet's fire modules): copied in the
    # result's memory order, channels innermost
    "channels-last images along dim 1": lambda x, y: torch.cat(
        [(x * 2).view(1, 3, 2, 2).contiguous(memory_format=torch.channels_last),
         y.view(1, 3, 2, 2).contiguous(memory_format=torch.channels_last)], 1),
    "a channels-last and a contiguous image along dim 1": lambda x, y: torch.cat(
        [(x * 2).view(1, 3, 2, 2).contiguous(memory_format=torch.channels_last), y.view(1, 3, 2, 2) + 1], 1),
}


@pytest.mark.parametrize("name", list(CATS))
def test_cat_is_replayed_as_copies_bitwise(name):
    fn = CATS[name]
    with torch.no_grad():
        step = torchreplay.capture(fn, (torch.randn(4, 3), torch.randn(4, 3)), config=config())
        for _ in range(4):
            x, y = torch.randn(4, 3), torch.randn(4, 3)
            got, want = step(x, y), fn(x, y)
            assert_bitwise(got, want)
        kinds = {r["op"]: r["kind"] for r in step.profile(x, y, iterations=2)}
    copies = [k for op, k in kinds.items() if op in ("aten::cat.out", "aten::clone.out", "aten::stack.out")]
    assert copies and set(copies) == {"copies"}, kinds


@pytest.mark.parametrize("entry", ["compile", "capture"])
@pytest.mark.parametrize("clone_outputs", [False, True])
def test_an_empty_output_and_one_planned_at_its_offset_each_get_their_bytes(entry, clone_outputs):
    """An empty buffer holds no bytes, so the arena places it where a live one is: cholesky_ex of
    an empty matrix gives an empty L and a 0-dim info at one offset. Handed out as one storage
    (grouped by address), info got L's empty one and read past its end: garbage, not eager's 0."""
    fns = {"cholesky_ex": lambda a: torch.linalg.cholesky_ex(a),
           "inv_ex": lambda a: torch.linalg.inv_ex(a),
           "an empty slice and a sum": lambda a: (a[:0] * 2, a.sum())}
    for name, fn in fns.items():
        torch._dynamo.reset()
        b = backend(clone_outputs=clone_outputs)
        step = (torch.compile(fn, backend=b) if entry == "compile" else
                torchreplay.capture(fn, (torch.randn(0, 0),), config=config(clone_outputs=clone_outputs)))
        for i in range(4):
            a = torch.randn(0, 0)
            got, want = step(a), fn(a)
            assert_bitwise(list(got), list(want), f"{name} call {i}")
            for k, t in enumerate(got):   # every element within its storage
                last = t.storage_offset() + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
                assert t.numel() == 0 or t.untyped_storage().nbytes() >= (last + 1) * t.element_size(), (
                    name, i, k, t.untyped_storage().nbytes())
        assert (step.stats() if entry == "capture" else b.stats()[0])["replays"] == 3, name


def test_conjugate_and_negative_views_are_not_copied_as_bytes():
    """z.conj() is a view whose elements are not its bytes (the conjugation is a bit read by the
    kernels): a cat or clone of it must conjugate, so it stays ATen's kernel, not copies."""
    fn = lambda z, w: (torch.cat([z.conj(), w]), w.conj().clone() * 1, z * w.conj())  # noqa: E731
    make = lambda: (torch.randn(3, dtype=torch.complex64), torch.randn(3, dtype=torch.complex64))  # noqa: E731
    with torch.no_grad():
        step = torchreplay.capture(fn, make(), config=config())
        for _ in range(4):
            z, w = make()
            assert_bitwise(step(z, w), fn(z, w))
    assert step.stats()["replays"] == 3


REDUCTIONS = {  # each a sum or mean the tape runs on an iterator built once (Note [Prepared sums and means])
    "mean over the last dim, kept": lambda x: x.mean(-1, keepdim=True) * 1,
    "sum over two dims": lambda x: x.sum((0, 2)) + 1,
    "mean over every dim": lambda x: x.mean((0, 1, 2)) + 0,
    "sum of a transposed view": lambda x: x.transpose(0, 1).sum(1) * 2,
    "mean of a strided slice": lambda x: x[:, ::2].mean(1) - 1,
    "rms norm": lambda x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", list(REDUCTIONS))
def test_sums_and_means_replay_on_a_prepared_iterator_bitwise(name, dtype):
    fn = REDUCTIONS[name]
    make = lambda: torch.randn(5, 6, 37, dtype=dtype) * 10  # noqa: E731
    with torch.no_grad():
        step = torchreplay.capture(fn, (make(),), config=config())
        for _ in range(4):
            x = make()
            got, want = step(x), fn(x)
            assert_bitwise(got, want)
        kinds = {r["op"]: r["kind"] for r in step.profile(x, iterations=2)}
    reductions = [k for op, k in kinds.items() if op in ("aten::mean.out", "aten::sum.IntList_out")]
    assert reductions and set(reductions) == {"prepared reduction"}, kinds


class _Cache(torch.nn.Module):
    """A KV cache written at a position (index_copy_) and read through an embedding table."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(11, 6)
        self.register_buffer("cache", torch.zeros(2, 3, 8, 6))

    def forward(self, ids, pos):
        x = self.emb(ids)                              # (3, 6)
        self.cache.index_copy_(2, pos, x.view(1, 3, 1, 6).expand(2, 3, 1, 6) * 2)
        return self.cache.sum(2) + x


def test_index_copy_and_embedding_are_copies_with_eager_errors():
    """Note [Copies]: a KV cache written at a position and an embedding lookup are element moves,
    bitwise as eager, and an index out of range raises eager's IndexError with eager's message,
    leaving the cache as eager leaves it."""
    model, ref = _Cache(), _Cache()
    ref.load_state_dict(model.state_dict())
    make = lambda i: (torch.tensor([i % 11, (3 * i) % 11, 10]), torch.tensor([i % 8]))  # noqa: E731
    with torch.no_grad():
        step = torchreplay.capture(model, make(0), config=config())
        for i in range(12):
            got, want = step(*make(i)), ref(*make(i))
            assert_bitwise(got, want)
            assert_bitwise(model.cache, ref.cache)
        kinds = {r["op"]: r["kind"] for r in step.profile(*make(3), iterations=2)}
        ref(*make(3))  # profile() ran the step twice more: so does the reference
        ref(*make(3))
        assert kinds["aten::index_copy_"] == "copies" and kinds["aten::embedding.out"] == "copies", kinds
        for bad, message in [((torch.tensor([0, 1, 11]), torch.tensor([2])), "index out of range in self"),
                             ((torch.tensor([0, 1, 2]), torch.tensor([8])),
                              "index_copy_(): index 8 is out of bounds for dimension 2 with size 8"),
                             ((torch.tensor([0, 1, 2]), torch.tensor([-1])),
                              "index_copy_(): index -1 is out of bounds for dimension 2 with size 8")]:
            with pytest.raises(IndexError) as eager_error:
                ref(*bad)
            with pytest.raises(IndexError, match=re.escape(message)):
                step(*bad)
            assert message in str(eager_error.value)
            assert_bitwise(model.cache, ref.cache)
        assert_bitwise(step(*make(5)), ref(*make(5)))  # the engine goes on


ATTENTION = {  # q, k, v (batch, heads, length, dim), as models call it
    "decode step": lambda q, k, v, m: torch.nn.functional.scaled_dot_product_attention(q[:, :, -1:], k, v),
    "causal": lambda q, k, v, m: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
    "boolean mask": lambda q, k, v, m: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m),
    "additive mask and scale": lambda q, k, v, m: torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=torch.where(m, 0.0, -1e4).to(q.dtype), scale=0.3),
    "heads from a projection": lambda q, k, v, m: torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2).contiguous().transpose(1, 2), k, v) * 2,
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(ATTENTION))
def test_attention_runs_on_planned_buffers_bitwise(name, dtype):
    """Note [Attention on planned buffers]: flash attention on the CPU writes into planned buffers
    through ATen's own kernel stub, bitwise as eager, and the views of its results cost nothing."""
    fn = ATTENTION[name]
    make = lambda: (torch.randn(1, 4, 9, 16, dtype=dtype), torch.randn(1, 4, 9, 16, dtype=dtype),  # noqa: E731
                    torch.randn(1, 4, 9, 16, dtype=dtype), torch.rand(9, 9) > 0.3)
    with torch.no_grad():
        step = torchreplay.capture(fn, make(), config=config())
        for _ in range(4):
            args = make()
            got, want = step(*args), fn(*args)
            assert_bitwise(got, want)
        rows = step.profile(*args, iterations=2)
    at = [i for i, r in enumerate(rows) if "scaled_dot_product" in r["op"]]
    assert len(at) == 1 and rows[at[0]]["kind"] == "prepared attention", rows
    assert all(r["kind"] != "view" for r in rows[at[0]:]), rows  # views of its results are precomputed


LAYER_NORMS = {  # (module or function, input shape, runs on planned buffers)
    "affine": (lambda: torch.nn.LayerNorm(16), (3, 5, 16), True),
    "no affine": (lambda: torch.nn.LayerNorm(16, elementwise_affine=False), (3, 5, 16), True),
    "weight, no bias": (lambda: torch.nn.LayerNorm(16, bias=False), (7, 16), True),
    "two normalized dims": (lambda: torch.nn.LayerNorm([5, 16]), (3, 5, 16), True),
    "one row": (lambda: torch.nn.LayerNorm(16), (1, 16), True),
    "no rows": (lambda: torch.nn.LayerNorm(16), (0, 16), True),
    "non-contiguous input": (lambda: (lambda x: torch.nn.functional.layer_norm(x.transpose(0, 1), (16,))),
                             (3, 5, 16), False),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", list(LAYER_NORMS))
def test_layer_norm_runs_on_planned_buffers_bitwise(name, dtype):
    """Note [Layer norm on planned buffers]: native_layer_norm writes into planned buffers through
    ATen's own kernel stub, bitwise as eager, with its statistics too; a non-contiguous input (which
    eager copies first) runs functionally, bitwise all the same."""
    make_model, shape, planned = LAYER_NORMS[name]
    torch.manual_seed(0)
    model = make_model()
    if isinstance(model, torch.nn.Module):
        model = model.to(dtype)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_()
    fn = lambda x: torch.ops.aten.native_layer_norm(  # noqa: E731
        x, list(model.normalized_shape), model.weight, model.bias, model.eps) if isinstance(
        model, torch.nn.Module) else (model(x),)
    make = lambda: torch.randn(*shape).mul(3).add(1).to(dtype)  # noqa: E731
    with torch.no_grad():
        step = torchreplay.capture(fn, (make(),), config=config())
        for _ in range(4):
            x = make()
            got, want = step(x), fn(x)
            assert len(got) == len(want)
            for g, w in zip(got, want):
                assert_bitwise(g, w, f"name={name}")
        kinds = [r["kind"] for r in step.profile(make(), iterations=2)]
    assert step.stats()["replays"] >= 3
    assert ("prepared layer norm" in kinds) == planned, kinds
