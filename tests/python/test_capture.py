"""torchreplay.capture: the Dynamo-free entry point, against eager, with the same semantics as the
torch.compile path (input mutation, output aliasing, stale outputs, clone_outputs, fallback with
a reason, stats, profiler ranges, precapture) and clear errors for bad calls."""
import copy
import gc
import os
import sys

import pytest
import torch
import torch.nn as nn

import torchreplay
from configs import config
from differential import assert_bitwise, bitwise_diff
from fuzz_graphs import C, make_inputs, make_program
from torchreplay_bench.models import (MLP, ConvBN, CountingModel, DecodeAttention, DemoModel, ElementwiseChain,
                                      MmAbsModel, ViewOfInput)

FUZZ_GRAPHS = int(os.environ.get("TORCHREPLAY_CAPTURE_FUZZ_GRAPHS", "60"))


@pytest.fixture(autouse=True)
def _inference():
    """torchreplay.capture runs inference only: calls here are made with grad mode off, as its
    users make them (with grad mode on, a parameter requiring grad is refused:
    test_grad_mode_on_with_parameters_requiring_grad_is_refused)."""
    with torch.no_grad():
        yield




class Counting(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("count", torch.zeros(4))

    def forward(self, x):
        self.count.add_(1)
        x.mul_(2)                          # an input mutation the caller sees
        return self.lin(x) * self.count, x.view(-1)


def test_random_graphs_through_capture_bitwise_equal_to_eager():
    """The differential fuzz's graphs (as Python functions) captured and replayed: outputs and
    mutated inputs bitwise equal to eager over several calls."""
    for seed in range(FUZZ_GRAPHS):
        prog = make_program(seed, num_ops=6 + seed % 7)
        gen = torch.Generator().manual_seed(seed)
        w = torch.randn(C, C, generator=gen)
        w_ref = w.clone()
        step = torchreplay.capture(lambda x, y, w, idx, r: tuple(prog.eager([x, y, w, idx, r])),
                                   [t.clone() if isinstance(t, torch.Tensor) else t
                                    for t in make_inputs(gen, 5, w)], config=config())
        for call in range(5):
            inputs = make_inputs(gen, 5, w)
            ref = [t.clone() if isinstance(t, torch.Tensor) else t for t in inputs]
            ref[2] = w_ref
            want = prog.eager(ref)
            got = step(*inputs)
            got = got if isinstance(got, tuple) else (got,)
            assert len(got) == len(want)
            for i, (g, e) in enumerate(zip(got, want)):
                assert_bitwise(g, e, f"seed {seed} call {call} output {i}")
            for i in (0, 1, 2):
                assert_bitwise(inputs[i], ref[i], f"seed {seed} call {call} input {i}")
        assert step.stats()["replays"] >= 3, (seed, step.stats())


ZOO = {   # the models test_zoo.py runs through torch.compile: name -> (model, inputs of call i)
    "demo": (lambda: DemoModel().eval(), lambda i: (torch.randn(100, 128), 100)),
    "mm_abs": (MmAbsModel, lambda i: (torch.randn(3, 3),)),
    "mlp": (lambda: MLP().eval(), lambda i: (torch.randn(1, 64),)),
    "convbn_eval": (lambda: ConvBN().eval(), lambda i: (torch.randn(2, 3, 8, 8),)),
    "convbn_train": (lambda: ConvBN().train(), lambda i: (torch.randn(2, 3, 8, 8),)),   # BN stats written
    "counting": (CountingModel, lambda i: (torch.randn(4),)),
    "decode_attention": (lambda: DecodeAttention().eval(), lambda i: (torch.randn(1, 1, 64), torch.tensor([i]))),
    "chain64": (ElementwiseChain, lambda i: (torch.randn(16),)),
    "view_of_input": (ViewOfInput, lambda i: (torch.randn(3, 5),)),
}


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_models_through_capture(name, mode):
    """Outputs, and every buffer after every call, bitwise equal to eager."""
    torch.manual_seed(6)
    factory, make = ZOO[name]
    eager = factory()
    model = copy.deepcopy(eager)
    step = torchreplay.capture(model, make(0), config=config(mode))
    with torch.no_grad():
        for i in range(1, 6):
            torch.manual_seed(100 + i)
            inputs = make(i)
            want = eager(*copy.deepcopy(inputs))
            got = step(*inputs)
            for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
                assert_bitwise(g, w, f"{name} call {i}")
            for (b, x), (_, y) in zip(eager.named_buffers(), model.named_buffers()):
                assert_bitwise(x, y, f"{name}: buffer {b} after call {i}")
    if mode == "reduce-overhead":
        assert step.stats()["replays"] == 4


def test_buffer_and_input_mutations_land_and_views_alias():
    torch.manual_seed(0)
    eager = Counting()
    model = copy.deepcopy(eager)
    step = torchreplay.capture(model, (torch.randn(2, 4),), config=config())
    for i in range(5):
        x = torch.randn(2, 4)
        xe = x.clone()
        with torch.no_grad():
            y, v = step(x)
            ye, ve = eager(xe)
        assert_bitwise(y, ye, f"call {i}: output 0")
        assert_bitwise(x, xe, f"call {i}: x after the call")
        assert_bitwise(model.count, eager.count, f"call {i}: buffer count")
        assert v.data_ptr() == x.data_ptr()   # a view of the caller's x
        assert_bitwise(v, ve, f"call {i}: output 1")
        assert x._version > 0
    s = step.stats()
    assert s["captures"] == 1 and s["replays"] == 4   # call 1 warms up; 2 captures, then replays


def test_decode_step_with_kv_cache_written_in_place():
    torch.manual_seed(1)
    eager = DecodeAttention().eval()
    model = copy.deepcopy(eager)
    step = torchreplay.capture(model, (torch.randn(1, 1, 64), torch.tensor([0])), config=config())
    with torch.no_grad():
        for i in range(8):
            x, pos = torch.randn(1, 1, 64), torch.tensor([i])
            assert_bitwise(step(x, pos), eager(x, pos), f"call {i}: output")
            assert_bitwise(model.k_cache, eager.k_cache, f"call {i}: k_cache")
            assert_bitwise(model.v_cache, eager.v_cache, f"call {i}: v_cache")
    assert step.stats()["replays"] == 7


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_both_modes_match_eager(mode):
    torch.manual_seed(2)
    model = MLP().eval()
    step = torchreplay.capture(model, (torch.randn(1, 64),), config=config(mode))
    with torch.no_grad():
        for i in range(4):
            x = torch.randn(1, 64)
            assert_bitwise(step(x), model(x), f"call {i}")
    assert step.stats()["captures"] == (1 if mode == "reduce-overhead" else 0)


def test_kept_output_is_invalidated_unless_clone_outputs():
    model = MLP().eval()
    x = torch.randn(1, 64)
    step = torchreplay.capture(model, (x,), config=config())
    kept = [step(torch.randn(1, 64)) for _ in range(3)]
    with pytest.raises(RuntimeError, match="reused its memory"):
        kept[1].sum()
    step = torchreplay.capture(model, (x,), config=config(clone_outputs=True))
    xs = [torch.randn(1, 64) for _ in range(3)]
    kept = [step(t) for t in xs]
    with torch.no_grad():
        for i, (k, t) in enumerate(zip(kept, xs)):
            assert_bitwise(k, model(t), f"kept output {i}")


def test_python_number_is_specialized_and_checked():
    torch.manual_seed(3)
    model = DemoModel().eval()
    x = torch.randn(100, 128)
    step = torchreplay.capture(model, (x, 100), config=config())
    with torch.no_grad():
        for i in range(3):
            assert_bitwise(step(x, 100), model(x, 100), f"call {i}")
    with pytest.raises(ValueError, match="argument 1 is 7, but the graph was captured with 100"):
        step(x, 7)


def test_bad_calls_raise_clear_errors():
    step = torchreplay.capture(MLP().eval(), (torch.randn(1, 64),), config=config())
    with pytest.raises(TypeError, match="too many positional arguments"):
        step(torch.randn(1, 64), torch.randn(1, 64))
    with pytest.raises(TypeError, match="missing a required argument: 'x'"):
        step()
    with pytest.raises(ValueError, match=r"argument 0 \(x\): expected dtype Float, got Double"):
        step(torch.randn(1, 64, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"argument 0 \(x\): expected a 2-d tensor, got 1-d"):
        step(torch.randn(64))
    with pytest.raises(ValueError, match=r"argument 0 \(x\): expected a tensor, got Int"):
        step(3)


def test_dynamic_shapes_capture_per_shape_and_fall_back_with_reason():
    model = MLP().eval()
    step = torchreplay.capture(model, (torch.randn(2, 64),), config=config(capture_limit=2), dynamic=True)
    with torch.no_grad():
        for i, rows in enumerate([2, 2, 3, 3, 2, 3, 5, 5, 5]):
            x = torch.randn(rows, 64)
            assert_bitwise(step(x), model(x), f"call {i} ({rows} rows)")
    s = step.stats()
    assert s["captures"] == 2 and s["eager_fallbacks"] == 3
    assert "capture limit (2 keys) reached" in s["fallback_reasons"][0]


def test_precapture_then_only_replays():
    model = MLP().eval()
    step = torchreplay.capture(model, (torch.randn(2, 64),), config=config(), dynamic=True)
    step.precapture([(torch.randn(4, 64),), (torch.randn(2, 64),)])
    before = step.stats()
    assert before["captures"] == 2
    with torch.no_grad():
        for i, rows in enumerate([2, 4, 2]):
            x = torch.randn(rows, 64)
            assert_bitwise(step(x), model(x), f"call {i} ({rows} rows)")
    after = step.stats()
    assert after["captures"] == 2 and after["replays"] == before["replays"] + 3


def test_moved_parameter_is_recaptured():
    torch.manual_seed(4)
    model = MLP().eval()
    step = torchreplay.capture(model, (torch.randn(1, 64),), config=config())
    x = torch.randn(1, 64)
    for _ in range(3):
        step(x)
    with torch.no_grad():
        model.layers[0].weight.data = torch.randn(256, 64)   # new memory under the same Parameter
        for i in range(3):
            assert_bitwise(step(x), model(x), f"call {i} after the move")
    assert step.stats()["captures"] == 2


def test_nested_arguments_and_outputs():
    def fn(pair, scale):
        a, b = pair
        return {"sum": a + b, "prod": (a * b * scale,)}

    step = torchreplay.capture(fn, ((torch.randn(3), torch.randn(3)), 2.0), config=config())
    for i in range(3):
        a, b = torch.randn(3), torch.randn(3)
        got, want = step((a, b), 2.0), fn((a, b), 2.0)
        assert_bitwise(got, want, f"call {i}")
    with pytest.raises(TypeError, match=r"nested differently .*\(\(\*, \*\) against \(\(\*, \*\), \*\)\)"):
        step(a, b)


def test_keyword_arguments():
    def fn(x, *, bias, scale=2.0):
        return x * scale + bias

    step = torchreplay.capture(fn, (torch.randn(3),), {"bias": torch.randn(3)}, config=config())
    for i in range(3):
        x, b = torch.randn(3), torch.randn(3)
        assert_bitwise(step(x, bias=b), fn(x, bias=b), f"call {i}")
    # As Python binds them: a positional argument given by name, keywords in any order.
    model = MLP().eval()
    flat = torchreplay.capture(model, (torch.randn(1, 64),), config=config())
    rows = torch.randn(1, 64)
    assert_bitwise(flat(x=rows), model(rows), "x given by name")
    assert_bitwise(step(bias=b, x=x), fn(x, bias=b), "keywords in another order")
    with pytest.raises(TypeError, match="missing a required argument: 'bias'"):
        step(x)
    # A keyword left out takes its default, as in Python: fine where that is what was captured.
    scaled = torchreplay.capture(fn, (x,), {"bias": b, "scale": 3.0}, config=config())
    with pytest.raises(ValueError, match=r"argument 2 is 2.0, but the graph was captured with 3.0"):
        scaled(x, bias=b)
    default = torchreplay.capture(fn, (x,), {"bias": b, "scale": 2.0}, config=config())
    assert_bitwise(default(x, bias=b), fn(x, bias=b), "scale left to its default")
    with pytest.raises(TypeError, match="passes scale, not given when the model was captured"):
        step(x, bias=b, scale=3.0)
    with pytest.raises(TypeError, match="got an unexpected keyword argument 'y'"):
        flat(rows, y=rows)


def test_flat_call_runs_no_python_of_ours_and_shows_in_the_profiler():
    model = MLP().eval()
    x = torch.randn(1, 64)
    step = torchreplay.capture(model, (x,), config=config())
    for _ in range(3):
        step(x)
    files = []
    sys.setprofile(lambda frame, event, arg: files.append(frame.f_code.co_filename) if event == "call" else None)
    try:
        step(x)
    finally:
        sys.setprofile(None)
    assert files == []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            step(x)
    assert [ev.name for ev in prof.events()].count("torchreplay::replay") == 3


@pytest.mark.skipif(not torchreplay.cuda_available(), reason="needs the CUDA build and a CUDA device")
def test_capture_on_cuda_matches_eager():
    """Own CUDA graphs (opt-in): each call's new input copied into the graph's static input."""
    torch.manual_seed(5)
    model = MLP().eval().cuda()
    step = torchreplay.capture(model, (torch.randn(1, 64, device="cuda"),), config=config(cuda_graphs="torchreplay"))
    with torch.no_grad():
        for i in range(4):
            x = torch.randn(1, 64, device="cuda")
            assert_bitwise(step(x), model(x), f"call {i}")
    assert step.stats()["replays"] >= 2


def test_what_the_trace_depends_on_is_checked_per_call():
    """Shapes, shape ranges, Python numbers (by bits), train/eval and non-tensor arguments the
    export specialized on: a call that differs raises, never replays a graph traced for another
    case."""
    def scale_by_rows(x):
        return x * x.shape[0]

    step = torchreplay.capture(scale_by_rows, (torch.ones(4),), config=config())
    with pytest.raises(ValueError, match="captured for size 4 there"):
        step(torch.ones(6))

    class Branch(nn.Module):
        def forward(self, x):
            return x * 2 if x.shape[0] > 2 else x * 3

    step = torchreplay.capture(Branch(), (torch.ones(4),), config=config(), dynamic=True)
    assert_bitwise(step(torch.ones(7)), torch.full((7,), 2.0), "size 7")
    with pytest.raises(ValueError, match="sizes of at least 3"):
        step(torch.ones(2))

    step = torchreplay.capture(lambda x, s: x / s, (torch.ones(2), 0.0), config=config())
    assert_bitwise(step(torch.ones(2), 0.0), torch.full((2,), float("inf")), "x / 0.0")
    with pytest.raises(ValueError, match="argument 1 is -0.0, but the graph was captured with 0.0"):
        step(torch.ones(2), -0.0)

    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)).train()
    step = torchreplay.capture(model, (torch.randn(3, 4),), config=config())
    model.eval()
    with pytest.raises(ValueError, match="captured in train mode and is now in eval mode"):
        step(torch.randn(3, 4))

    def masked(x, mask=None, how="add"):
        y = x * 2 if mask is None else x * mask
        return y + 1 if how == "add" else y - 1

    step = torchreplay.capture(masked, (torch.ones(2), None, "add"), config=config())
    assert_bitwise(step(torch.ones(2), None, "add"), masked(torch.ones(2)), "masked(x, None, 'add')")
    with pytest.raises(ValueError, match="argument how is 'sub', but the graph was captured with 'add'"):
        step(torch.ones(2), None, "sub")


def test_keyword_arguments_in_any_order_and_dynamic_functions():
    def fn(x, *, a, b):
        return x * a + b

    x, a, b = torch.ones(2), torch.full((2,), 2.0), torch.full((2,), 3.0)
    step = torchreplay.capture(fn, (x,), {"a": a, "b": b}, config=config())
    assert_bitwise(step(x, b=b, a=a), fn(x, a=a, b=b), "keywords in another order")
    step = torchreplay.capture(lambda x: x * 2, (torch.ones(4),), config=config(), dynamic=True)
    assert_bitwise(step(torch.ones(6)), torch.full((6,), 2.0), "size 6")


def test_grad_mode_on_with_parameters_requiring_grad_is_refused():
    """Eager's output would track the parameters' gradients; a replay's cannot. Refused with the
    way out, instead of an output that silently drops the model's part of the gradient."""
    model = MLP()
    x = torch.randn(2, 64)
    step = torchreplay.capture(model, (x,), config=config())
    with torch.enable_grad():
        with pytest.raises(ValueError, match=r"parameter 'layers.0.weight' of the captured model requires grad and "
                                             r"grad mode is on.*torch.no_grad\(\)"):
            step(x)
        with torch.inference_mode():
            assert_bitwise(step(x), model(x), "under inference_mode")
        model.requires_grad_(False)   # frozen: nothing for eager to track either
        got, want = step(x), model(x)
        assert_bitwise(got, want, "frozen, grad mode on")
        assert not want.requires_grad and not got.requires_grad


def test_dynamic_capture_takes_every_size_including_0_and_1():
    """export specializes sizes 0 and 1; dynamic=True still takes them, each through a trace of
    its own made when first seen (as Dynamo compiles size 1 apart), bitwise equal to eager."""
    torch.manual_seed(0)
    model = MLP().eval()
    step = torchreplay.capture(model, (torch.randn(8, 64),), config=config(), dynamic=True)
    sizes = [1, 8, 3, 1, 0, 5, 1, 8, 0, 3]
    for n in sizes:
        x = torch.randn(n, 64)
        assert_bitwise(step(x), model(x), f"size {n}")
    s = step.stats()
    assert [t["calls"] for t in s["traces"]] == [5, 3, 2]    # >= 2, then 1, then 0
    assert s["calls"] == len(sizes) and s["replays"] > 0
    # A capture made with size 1 holds for larger sizes the same way.
    one = torchreplay.capture(model, (torch.randn(1, 64),), config=config(), dynamic=True)
    for n in [1, 4, 1, 4, 6]:
        x = torch.randn(n, 64)
        assert_bitwise(one(x), model(x), f"size {n}, captured with size 1")
    assert len(one.stats()["traces"]) == 2
    # Not dynamic: another size is the clear error it was.
    fixed = torchreplay.capture(model, (torch.randn(8, 64),), config=config())
    with pytest.raises(ValueError, match="captured for size 8 there"):
        fixed(torch.randn(1, 64))


def test_arguments_that_are_no_graph_values_are_specialized_and_checked():
    """dtypes, devices, layouts, memory formats and modules cannot be graph inputs: they are left
    out of the trace as None and strings are, and another value at call time is a clear error."""
    def fn(x, dtype, device, *, layout=torch.strided, distance=None, fmt=torch.contiguous_format):
        y = torch.arange(4, dtype=dtype, device=device, layout=layout) + x
        return distance(y, y.flip(0)) if distance is not None else y.contiguous(memory_format=fmt)

    pair = nn.PairwiseDistance()
    kw = {"distance": pair}
    step = torchreplay.capture(fn, (torch.randn(4), torch.float64, torch.device("cpu")), kw, config=config())
    for i in range(3):
        x = torch.randn(4)
        assert_bitwise(step(x, torch.float64, "cpu" if False else torch.device("cpu"), distance=pair),
                       fn(x, torch.float64, torch.device("cpu"), distance=pair), f"call {i}")
    assert step.stats()["replays"] == 2
    with pytest.raises(ValueError, match=r"argument dtype is torch.float32, but the graph was captured with torch.float64"):
        step(torch.randn(4), torch.float32, torch.device("cpu"), distance=pair)
    with pytest.raises(ValueError, match=r"argument distance is another PairwiseDistance object than the one the graph"):
        step(torch.randn(4), torch.float64, torch.device("cpu"), distance=nn.PairwiseDistance())


def test_a_module_argument_with_parameters_binds_them():
    scale = nn.Linear(4, 4)
    fn = lambda x, layer: layer(x).relu()  # noqa: E731
    step = torchreplay.capture(fn, (torch.randn(2, 4), scale), config=config())
    for i in range(3):
        x = torch.randn(2, 4)
        assert_bitwise(step(x, scale), fn(x, scale), f"call {i}")
    scale.weight.data = torch.randn(4, 4)   # new memory: seen, recaptured
    x = torch.randn(2, 4)
    assert_bitwise(step(x, scale), fn(x, scale), "after the weight moved")


def test_a_model_that_seeds_the_random_generator_is_refused():
    """A seed set inside the model happens once, while it is traced; the replays would draw
    other numbers than eager. Refused, and the caller's generator is left as it was."""
    def seeded(x):
        torch.manual_seed(42)
        return x + torch.rand_like(x)

    def seeded_and_restored(x):   # what PyTorch's own test wrappers do
        with torch.random.fork_rng():
            torch.manual_seed(42)
            return x + torch.rand_like(x)

    x = torch.randn(3)
    before = torch.random.get_rng_state()
    def restored(x):   # eager repeats the same numbers every call; a replay would not
        state = torch.default_generator.get_state()
        y = x + torch.rand_like(x)
        torch.default_generator.set_state(state)
        return y

    for fn in (seeded, seeded_and_restored, restored):
        with pytest.raises(ValueError, match=r"called Generator.(manual_seed|set_state) while it was traced"):
            torchreplay.capture(fn, (x,), config=config())
        assert_bitwise(torch.random.get_rng_state(), before, "the CPU generator's state")
    # Random ops drawn in the graph replay as eager draws them.
    fn = lambda x: x + torch.rand_like(x)  # noqa: E731
    step = torchreplay.capture(fn, (torch.randn(3),), config=config())
    for k in range(3):
        x = torch.randn(3)
        torch.manual_seed(k)
        got = step(x)
        torch.manual_seed(k)
        assert_bitwise(got, fn(x), f"call {k}")
    assert step.stats()["replays"] == 2    # warm-up, capture and replay, replay


def test_a_capture_runs_under_a_profiler_and_gives_it_back():
    """The generator watch (Note [Watching the random generators]) chains to the profiler already
    on the thread: cProfile sees the export's calls, and gets its place back afterwards; a seed
    set inside the model is still seen under it. A Python profile function is put back too."""
    import cProfile
    import pstats
    import sys

    def seeded(x):
        torch.manual_seed(1)
        return x + 1

    fn = lambda x: (x * 2).relu()  # noqa: E731
    x = torch.randn(5)
    profiler = cProfile.Profile()
    with profiler:
        step = torchreplay.capture(fn, (x,), config=config())
        with pytest.raises(ValueError, match=r"called Generator.manual_seed while it was traced"):
            torchreplay.capture(seeded, (x,), config=config())
        after = sys.getprofile()
    assert after is profiler          # given back
    seen = {f[2] for f in pstats.Stats(profiler).stats}
    assert "export" in seen and "seeded" in seen
    events = []
    sys.setprofile(lambda frame, event, arg: events.append(event))
    try:
        step = torchreplay.capture(fn, (x,), config=config())
        assert sys.getprofile() is not None
    finally:
        sys.setprofile(None)
    assert len(events) > 1000         # the Python profile function saw the export too
    for i in range(3):
        x = torch.randn(5)
        assert_bitwise(step(x), fn(x), f"call {i}")
    assert step.stats()["replays"] == 2    # capture and replay, replay


def test_the_generator_watch_holds_when_the_model_saves_and_restores_the_profile_function():
    """A model that saves sys.getprofile() and puts it back gets the watch back (a callable);
    seeding from C code (map, functools.partial), which no profile function sees, is caught by
    the generator's state."""
    import functools
    import sys

    def restores(x):
        old = sys.getprofile()
        sys.setprofile(None)
        y = x + 1
        sys.setprofile(old)
        return y * 2

    def restores_then_seeds(x):
        old = sys.getprofile()
        sys.setprofile(None)
        sys.setprofile(old)
        torch.manual_seed(3)
        return x + torch.rand_like(x)

    x = torch.randn(3)
    step = torchreplay.capture(restores, (x,), config=config())
    for i in range(3):
        x = torch.randn(3)
        assert_bitwise(step(x), restores(x), f"call {i}")
    assert step.stats()["replays"] == 2 and sys.getprofile() is None
    with pytest.raises(ValueError, match=r"called Generator.manual_seed while it was traced"):
        torchreplay.capture(restores_then_seeds, (x,), config=config())
    torch.manual_seed(1)
    before = torch.random.get_rng_state()
    for seeds in (lambda: list(map(torch.default_generator.manual_seed, [0])),
                  lambda: functools.partial(torch.default_generator.manual_seed, 0)()):
        fn = lambda x, seeds=seeds: (seeds(), x + torch.rand_like(x))[1]  # noqa: E731
        with pytest.raises(ValueError, match=r"seeded the CPU generator while it was traced"):
            torchreplay.capture(fn, (x,), config=config())
        assert_bitwise(torch.random.get_rng_state(), before, "the CPU generator's state")


def test_a_capture_from_inside_a_model_being_captured_is_a_clear_error():
    """In a process of its own: an exception out of a model's forward leaves torch.export's state
    behind (later torch.compile calls recompile)."""
    import subprocess
    import sys

    code = (
        "import torch, torchreplay\n"
        "cfg = torchreplay.CompilerConfig(); cfg.mode = 'reduce-overhead'\n"
        "inner = lambda x: x * 2\n"
        "outer = lambda x: torchreplay.capture(inner, (x,), config=cfg)(x) + 1\n"
        "try:\n"
        "    torchreplay.capture(outer, (torch.randn(3),), config=cfg)\n"
        "except RuntimeError as e:\n"
        "    print('refused:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "refused: torchreplay.capture: called while another capture is tracing" in out.stdout, out.stdout
    assert "torch.export does not nest" in out.stdout


def test_a_replay_is_profiled_step_by_step():
    """Captured.profile: one row per tape step, in order, saying what each step is; the steps of
    the MLP are its three GEMMs (typed) and two relus (fused elementwise steps of one clamp_min
    each), each timed."""
    model = MLP().eval()
    x = torch.randn(1, 64)
    step = torchreplay.capture(model, (x,), config=config())
    rows = step.profile(x, iterations=20)
    assert [(r["op"], r["kind"]) for r in rows] == [
        ("aten::addmm.out", "typed out="), ("fused: clamp_min", "fused elementwise"),
        ("aten::addmm.out", "typed out="), ("fused: clamp_min", "fused elementwise"),
        ("aten::addmm.out", "typed out=")]
    assert [r["node"] for r in rows] == ["addmm", "fused(relu)", "addmm_1", "fused(relu_1)", "addmm_2"]
    assert rows[0]["shapes"] == "Float[1, 256]" and all(r["us"] > 0 for r in rows)
    assert_bitwise(step(x), model(x), "after profiling")   # the engine goes on as before
    # A key that runs eagerly has no tape to profile.
    eager = torchreplay.capture(lambda t: t[t > 0] * 2, (torch.randn(8),), config=config())
    with pytest.raises(RuntimeError, match="this key is not replayed: .*data-dependent output shape"):
        eager.profile(torch.randn(8))


def test_sizes_the_trace_specialized_are_checked_with_dynamic_too():
    """dynamic=True traces every dim as a symbol, but export fixes the ones the model branches on
    or slices a buffer by: another size there is a clear error, not the other branch's result."""
    class Branch(nn.Module):
        def forward(self, x):
            return x * 2 if x.shape[1] == 4 else x * 3

    step = torchreplay.capture(Branch(), (torch.randn(3, 4),), config=config(), dynamic=True)
    assert_bitwise(step(torch.ones(5, 4)), torch.full((5, 4), 2.0), "5 rows")
    with pytest.raises(ValueError, match="argument 0 has size 5 in dim 1, but the graph was captured for size 4"):
        step(torch.randn(3, 5))

    class Accumulate(nn.Module):   # acc[:B]: the batch is bounded by the buffer
        def __init__(self):
            super().__init__()
            self.register_buffer("acc", torch.zeros(2, 4))

        def forward(self, x):
            self.acc[: x.shape[0]].add_(x)
            return self.acc[: x.shape[0]] * 1

    model, ref = Accumulate(), Accumulate()
    step = torchreplay.capture(model, (torch.ones(2, 4),), config=config(), dynamic=True)
    for n in (2, 1, 2, 1):
        x = torch.randn(n, 4)
        assert_bitwise(step(x), ref(x), f"{n} rows: output")
        assert_bitwise(model.acc, ref.acc, f"{n} rows: buffer acc")


def test_modes_of_submodules_and_module_arguments_are_checked():
    """A submodule switched to train mode (MC dropout) or a module argument's mode: a clear
    error, not a replay of what eval mode computed; switched back, the capture replays again."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)).eval()
    x = torch.randn(3, 4)
    step = torchreplay.capture(model, (x,), config=config())
    assert_bitwise(step(x), model(x), "eval mode")
    model[1].train()
    with pytest.raises(ValueError, match=r"submodule '1' \(Dropout\) was captured in eval mode and is now in train"):
        step(x)
    model[1].eval()
    assert_bitwise(step(x), model(x), "back in eval mode")
    drop = nn.Dropout(0.5).eval()
    by_argument = torchreplay.capture(lambda t, d: d(t) + 1, (x, drop), config=config())
    drop.train()
    with pytest.raises(ValueError, match="the model .Dropout. was captured in eval mode"):
        by_argument(x, drop)


def test_modules_an_argument_or_a_closure_holds_are_bound_and_watched():
    lin = nn.Linear(4, 4).requires_grad_(False)
    x = torch.randn(2, 4)
    through_closure = torchreplay.capture(lambda t: lin(t).relu(), (x,), config=config())
    by_argument = torchreplay.capture(lambda t, layer: layer(t).relu(), (x, lin), config=config())
    lin.weight.data = torch.randn(4, 4)   # new memory: both recapture around it
    assert_bitwise(through_closure(x), lin(x).relu(), "through a closure")
    assert_bitwise(by_argument(x, lin), lin(x).relu(), "by argument")
    lin.requires_grad_(True)
    with torch.enable_grad(), pytest.raises(ValueError, match="parameter 'closure_lin.weight' .* requires grad"):
        through_closure(x)
    lin.weight = nn.Parameter(torch.randn(4, 4))   # a new Parameter object: the graph holds the old one
    with pytest.raises(ValueError, match="parameter 'weight' of Linear was replaced"):
        by_argument(x, lin)


def test_a_parameter_set_to_none_is_refused():
    """`layer.bias = None` registers no parameter (no registration hook runs): the graph would
    replay a bias the model no longer has, so its calls raise, naming what changed."""
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).eval()
    x = torch.randn(2, 4)
    with torch.no_grad():
        step = torchreplay.capture(model, (x,), config=config())
        assert_bitwise(step(x), model(x))
        model[0].bias = None
        with pytest.raises(ValueError, match="parameter 'bias' of Linear was replaced"):
            step(x)


def test_parameters_given_data_of_other_sizes_are_traced_again():
    """`p.data = t` of other sizes keeps the Parameter object, but the trace read its sizes: the
    capture traces again, giving eager's result, or eager's error where eager refuses the sizes (a
    batch norm's running_mean shorter than its channels; replayed, it would read past its end)."""
    x = torch.randn(2, 4)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).eval()
    with torch.no_grad():
        step = torchreplay.capture(model, (x,), config=config())
        assert_bitwise(step(x), model(x))
        model[1].running_mean.data = torch.rand(2)
        with pytest.raises(RuntimeError, match="running_mean should contain 4 elements not 2"):
            model(x)
        with pytest.raises(RuntimeError, match="running_mean should contain 4 elements not 2"):
            step(x)
        model[1].running_mean.data = torch.zeros(4)   # the traced sizes again: the first trace
        assert_bitwise(step(x), model(x), "sizes as traced")
        lin = nn.Linear(4, 4)
        wide = torchreplay.capture(lin, (x,), config=config())
        assert_bitwise(wide(x), lin(x))
        lin.weight.data, lin.bias.data = torch.randn(6, 4), torch.randn(6)
        for call in range(3):
            assert_bitwise(wide(x), lin(x), f"a wider layer, call {call}")
        assert wide.stats()["replays"] >= 2  # the trace made for the wider layer's


def test_specialized_arguments_are_compared_by_value_where_they_have_one():
    import dataclasses

    import numpy as np

    @dataclasses.dataclass
    class Opts:
        scale: float

    def fn(x, opts, table):
        return x * opts.scale + float(table.sum())

    opts, table = Opts(2.0), np.arange(3.0)
    step = torchreplay.capture(fn, (torch.ones(2), opts, table), config=config())
    assert_bitwise(step(torch.ones(2), Opts(2.0), np.arange(3.0)), fn(torch.ones(2), opts, table), "equal values")
    opts.scale = 7.0   # changed in place after capture: seen
    with pytest.raises(ValueError, match=r"argument opts is .*Opts\(scale=7.0\), but the graph was captured with "
                                         r".*Opts\(scale=2.0\)"):
        step(torch.ones(2), opts, table)


def test_grad_mode_refuses_only_parameters_an_output_would_track():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = nn.Linear(4, 4).requires_grad_(False), nn.Linear(4, 4)
            self.scale = nn.Parameter(torch.ones(4))

        def forward(self, x):
            return self.used(x) * self.scale.detach()

    model, x = Model(), torch.randn(2, 4)
    step = torchreplay.capture(model, (x,), config=config())
    with torch.enable_grad():
        got, want = step(x), model(x)
    assert_bitwise(got, want, "grad mode on")
    assert not want.requires_grad and not got.requires_grad


def test_calls_in_other_forms_python_accepts():
    """Dict entries in another order, a lone tensor in precapture, None where a dynamic capture
    had a tensor (a clear error, no new trace)."""
    fn = lambda x, opts: x * opts["a"] + opts["b"]  # noqa: E731
    step = torchreplay.capture(fn, (torch.randn(3), {"a": torch.randn(3), "b": torch.randn(3)}), config=config())
    x, a, b = torch.randn(3), torch.randn(3), torch.randn(3)
    assert_bitwise(step(x, {"b": b, "a": a}), fn(x, {"a": a, "b": b}), "dict entries in another order")
    dyn = torchreplay.capture(lambda t, mask=None: t if mask is None else t * mask, (torch.randn(3, 4),),
                              {"mask": torch.ones(3, 4)}, config=config(), dynamic=True)
    with pytest.raises(ValueError, match=r"input 1 \(mask\): expected a tensor, got None"):
        dyn(torch.randn(3, 4), mask=None)
    assert "traces" not in dyn.stats()
    mlp = MLP().eval()
    flat = torchreplay.capture(mlp, (torch.randn(2, 64),), config=config(), dynamic=True)
    flat.precapture([torch.randn(4, 64), (torch.randn(1, 64),)])
    assert flat.stats()["captures"] == 2


def test_a_captured_model_is_freed_with_its_last_reference():
    import gc
    import weakref as wr

    model = MLP().eval()
    step = torchreplay.capture(model, (torch.randn(1, 64),), config=config(), dynamic=True)
    step(torch.randn(1, 64))
    gone, model_gone = wr.ref(step), wr.ref(model)
    del step, model
    gc.collect()
    assert gone() is None and model_gone() is None


def test_one_trace_per_size_class_when_threads_first_meet_it_together():
    import threading

    model = MLP().eval()
    step = torchreplay.capture(model, (torch.randn(4, 64),), config=config(), dynamic=True)
    xs = [torch.randn(1 if i % 2 == 0 else 3, 64) for i in range(20)]
    want = [model(x) for x in xs]
    wrong = []

    def work():
        with torch.no_grad():
            found = (bitwise_diff(step(x), w, f"call {i}") for i, (x, w) in enumerate(zip(xs, want)))
            wrong.extend(d for d in found if d is not None)

    threads = [threading.Thread(target=work) for _ in range(3)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert wrong == [] and len(step.stats()["traces"]) == 2


def test_a_capture_does_not_recompile_what_torch_compile_compiled_before():
    """Dynamo guards on the global module hooks and nn.Module.train, which torchreplay.capture
    relies on: they are installed when torchreplay is imported, so a capture made later does not
    make functions compiled earlier recompile."""
    from torch._dynamo.testing import CompileCounter

    class Keeps(nn.Module):  # assigns a submodule in forward: Dynamo guards on the hooks that calls
        def __init__(self):
            super().__init__()
            self.act = nn.ReLU()

        def forward(self, x):
            self.act = self.act
            return self.act(x * 2)

    counter = CompileCounter()
    compiled = torch.compile(Keeps(), backend=counter)
    x = torch.randn(2, 4)
    compiled(x)
    with torch.no_grad():
        step = torchreplay.capture(nn.Linear(4, 3).eval(), (x,), config=config())
        step(x)
    nn.Linear(2, 2).train()
    compiled(x)
    assert counter.frame_count == 1


def test_stats_list_a_captured_models_engine_while_it_lives():
    f = torchreplay.capture(lambda x: x.tan() - 1, (torch.randn(2),), config=config())
    f(torch.randn(2))
    assert [s["name"] for s in torchreplay.stats()].count(f.name) == 1
    name = f.name
    del f
    gc.collect()
    assert name not in [s["name"] for s in torchreplay.stats()]


class _SharedBuffers(nn.Module):
    """Two buffers over one memory (`b` a view of `a`), one written in forward."""

    def __init__(self, view):
        super().__init__()
        t = torch.arange(12.0).reshape(4, 3)
        self.register_buffer("a", t)
        self.register_buffer("b", t[1:] if view == "slice" else t.view(12))

    def forward(self, x):
        self.a[0].add_(x)
        return self.b * 2 + self.a.sum()


class _ReadsBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("a", torch.arange(3.0))

    def forward(self, x):
        return x * 2 + self.a[-x.shape[0]:]


def _written_shared(a, b):
    a.add_(1)
    return b * 2


@pytest.mark.parametrize("view", ["slice", "view"])
def test_buffers_sharing_memory_one_written_is_a_clear_error(view):
    """torch.export cannot trace a write into memory two of a model's inputs share (it failed with
    "expected compiled_fn to be GraphModule, got <class 'function'>"): a clear error names the
    buffers and says what to do. torch.compile takes such a model (AOTAutograd gives its graph
    their common base): bitwise eager's, replayed."""
    model = _SharedBuffers(view)
    with pytest.raises(NotImplementedError,
                       match=r"buffer 'a' and buffer 'b' share memory, and the model writes buffer 'a'.*"
                             r"torch\.compile\(model, backend=torchreplay\.get_backend"):
        torchreplay.capture(model, (torch.ones(3),), config=config())
    torch._dynamo.reset()
    eager, model = _SharedBuffers(view), _SharedBuffers(view)
    b = torchreplay.get_backend(compiler_config=config())
    compiled = torch.compile(model, backend=b)
    for i in range(4):
        x = torch.randn(3)
        got, want = compiled(x), eager(x)
        assert_bitwise(got, want, f"call {i}: output")
        assert_bitwise(model.a, eager.a, f"call {i}: buffer a")
        assert_bitwise(model.b, eager.b, f"call {i}: buffer b")
        assert model.b.untyped_storage().data_ptr() == model.a.untyped_storage().data_ptr()
    assert sum(s["replays"] for s in b.stats()) >= 2, b.stats()


def test_arguments_sharing_memory_one_written_are_a_clear_error():
    """The same for arguments (and an argument over a buffer's memory), which the message calls by
    their names; inputs that share memory without a write, or share a storage without
    overlapping, capture as before."""
    t = torch.zeros(4, 3)
    with pytest.raises(NotImplementedError, match=r"argument 'a' and argument 'b' share memory, and the "
                                                  r"model writes argument 'a'"):
        torchreplay.capture(_written_shared, (t, t[1:]), config=config())
    with pytest.raises(NotImplementedError, match=r"argument 'a' and argument 'b' are the same memory, and the "
                                                  r"model writes it"):
        torchreplay.capture(_written_shared, (t, t), config=config())
    model = Counting()
    with pytest.raises(NotImplementedError, match=r"buffer 'count' and argument 'x' share memory, and the model "
                                                  r"writes buffer 'count' and argument 'x'"):
        torchreplay.capture(model, (model.count.view(1, 4),), config=config())
    reader = _ReadsBuffer()   # an argument that views a whole buffer, read only: export fails too
    with pytest.raises(NotImplementedError, match=r"buffer 'a' and argument 'x' are the same memory; torch.export"):
        torchreplay.capture(reader, (reader.a[:],), config=config())
    over = torchreplay.capture(reader, (reader.a[1:],), config=config())   # part of it: traces
    assert_bitwise(over(reader.a[1:]), reader(reader.a[1:]), "an argument over part of a buffer")
    reads = torchreplay.capture(lambda a, b: a[1:] * b, (t, t[1:]), config=config())
    assert_bitwise(reads(t, t[1:]), t[1:] * t[1:], "arguments sharing memory, read only")
    u, u_ref = torch.zeros(4, 3), torch.zeros(4, 3)
    apart = torchreplay.capture(_written_shared, (u[:2], u[2:]), config=config())
    for i in range(3):
        assert_bitwise(apart(u[:2], u[2:]), _written_shared(u_ref[:2], u_ref[2:]), f"call {i}: output")
        assert_bitwise(u, u_ref, f"call {i}: the arguments' memory after the call")
    assert apart.stats()["replays"] == 2


RECURRENT = {  # (module, input shape (T, B, I), with a state)
    "lstm 2 layers, one step": (lambda: nn.LSTM(32, 64, num_layers=2), (1, 1, 32), True),
    "lstm batch_first": (lambda: nn.LSTM(48, 96, batch_first=True), (4, 16, 48), False),
    "lstm bidirectional": (lambda: nn.LSTM(20, 40, bidirectional=True), (5, 3, 20), False),
    "lstm projections": (lambda: nn.LSTM(16, 32, proj_size=8), (6, 2, 16), False),
    "gru 2 layers, 16 steps": (lambda: nn.GRU(32, 64, num_layers=2), (16, 1, 32), True),
    "gru batch 3, hidden 20": (lambda: nn.GRU(32, 20), (7, 3, 32), True),
    "gru batch_first bidirectional, batch 8": (lambda: nn.GRU(16, 20, bidirectional=True, batch_first=True),
                                               (5, 8, 16), False),
    "rnn relu": (lambda: nn.RNN(16, 32, nonlinearity="relu"), (7, 2, 16), False),
    "rnn tanh, 2 layers, batch 3": (lambda: nn.RNN(16, 20, num_layers=2), (7, 3, 16), True),
    "rnn tanh batch_first, batch 3": (lambda: nn.RNN(16, 20, batch_first=True), (2, 3, 16), False),
    "rnn tanh bidirectional, batch 1": (lambda: nn.RNN(16, 20, bidirectional=True), (9, 1, 16), True),
}


@pytest.mark.parametrize("entry", ["capture", "torch.compile"])
@pytest.mark.parametrize("name", list(RECURRENT))
def test_recurrent_modules_are_eagers_bits(name, entry):
    """nn.LSTM, nn.GRU and nn.RNN on the CPU, inference, through both entry points: PyTorch's
    decompositions of these ops are not always eager's bits (an LSTM's oneDNN kernel; a GRU or RNN
    over several rows: "gru batch 3, hidden 20" and "rnn tanh batch_first, batch 3" differ
    decomposed), so they stay whole but over one row (Note [Recurrent modules whole])."""
    make, shape, stateful = RECURRENT[name]
    torch.manual_seed(0)
    model = make().eval()
    layers = model.num_layers * (2 if model.bidirectional else 1)
    hidden = model.proj_size or model.hidden_size

    def args(seed):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(*shape, generator=g)
        if model.batch_first:
            x = x.transpose(0, 1).contiguous()
        if not stateful:
            return (x,)
        h = torch.randn(layers, shape[1], hidden, generator=g)
        return (x, (h, torch.randn(layers, shape[1], model.hidden_size, generator=g))) if isinstance(model, nn.LSTM) \
            else (x, h)
    with torch.no_grad():
        if entry == "capture":
            step = torchreplay.capture(model, args(0), config=config())
        else:
            torch._dynamo.reset()
            backend = torchreplay.get_backend(compiler_config=config())
            step = torch.compile(model, backend=backend)
        for i in range(4):
            assert_bitwise(step(*args(i)), model(*args(i)), f"call {i}")
    stats = step.stats() if entry == "capture" else backend.stats()[0]  # [0]: Dynamo made a graph
    assert stats["replays"] >= 2


@pytest.mark.parametrize("entry", ["capture", "torch.compile"])
@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn"])
def test_recurrent_states_read_inside_the_graph_are_eagers(kind, entry):
    """The states a recurrent module returns, read by later ops of the same graph (a head on the
    last layer's state; the module called again on its own state): their sizes in the trace are
    the op's (PyTorch's Python decomposition of an LSTM gives other sizes under a trace)."""
    make = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn": nn.RNN}[kind]

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn, self.head = make(16, 16, num_layers=2, batch_first=True), nn.Linear(16, 5)

        def forward(self, x):
            y, state = self.rnn(x)
            z, state = self.rnn(y, state)
            h = state[0] if kind == "lstm" else state
            return self.head(h[-1]), z

    torch.manual_seed(0)
    model = Model().eval()
    x = [torch.randn(4, 7, 16, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    backend = torchreplay.get_backend(compiler_config=config())
    with torch.no_grad():
        step = torchreplay.capture(model, (x[0],), config=config()) if entry == "capture" else \
            torch.compile(model, backend=backend)
        for i in range(4):
            assert_bitwise(step(x[i]), model(x[i]), f"call {i}")
    assert (step.stats()["replays"] if entry == "capture" else [s["replays"] for s in backend.stats()]) in (3, [3])


@pytest.mark.parametrize("entry, case", [(e, c) for e in ("capture", "torch.compile") for c in (
    "dynamic=True", "a strided input over one row", "dropout in training, one row", "autocast")] + [
    ("torch.compile", "a second batch size")])
def test_recurrent_modules_where_a_decomposition_would_not_be_eagers(entry, case):
    """A GRU and an RNN where PyTorch's decomposition is not eager's arithmetic or Dynamo's
    trace cannot keep the op (Note [Recurrent modules whole]): each call eager's bits (a capture
    under autocast refused by name)."""
    torch.manual_seed(0)
    train = case.startswith("dropout")
    models = [nn.GRU(16, 20, num_layers=2, dropout=0.5 if train else 0.0, batch_first=True),
              nn.RNN(16, 20, num_layers=2, dropout=0.5 if train else 0.0, batch_first=True)]
    shapes = {"a second batch size": [(3, 5), (4, 5), (4, 5)], "dynamic=True": [(3, 5), (4, 5), (2, 5), (4, 5)],
              "a strided input over one row": [(1, 7)] * 3, "dropout in training, one row": [(1, 5)] * 3,
              "autocast": [(3, 5)] * 3}[case]

    def arg(i, batch, length):
        g = torch.Generator().manual_seed(i)
        if case == "a strided input over one row":
            return (torch.randn(batch, length, 32, generator=g)[..., :16],)
        return (torch.randn(batch, length, 16, generator=g),)
    for model in models:
        model.train(train)
        args = [arg(i, *shape) for i, shape in enumerate(shapes)]
        torch._dynamo.reset()
        backend = torchreplay.get_backend(compiler_config=config())
        if entry == "capture" and case == "autocast":  # eager's kernels cast inside: refused (rnn._twin)
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), \
                    pytest.raises(NotImplementedError, match="a trace under autocast"):
                torchreplay.capture(model, args[0], config=config())
            continue
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=case == "autocast"):
            step = torch.compile(model, backend=backend, dynamic=True if case == "dynamic=True" else None) \
                if entry == "torch.compile" \
                else torchreplay.capture(model, args[0], config=config(), dynamic=case == "dynamic=True")
            for i, a in enumerate(args):
                torch.manual_seed(i)
                got = step(*a)
                torch.manual_seed(i)
                assert_bitwise(got, model(*a), f"{type(model).__name__}, call {i}")
        replays = step.stats()["replays"] if entry == "capture" else sum(s["replays"] for s in backend.stats())
        # the repeated shapes replay; through torch.compile, dropout and autocast run eagerly by design
        eager = entry == "torch.compile" and case in ("dropout in training, one row", "autocast")
        assert replays == (0 if eager else 1 if case in ("dynamic=True", "a second batch size") else 2), replays


@pytest.mark.parametrize("make", [lambda: nn.GRU(6, 5), lambda: nn.RNN(6, 5)], ids=["gru", "rnn"])
def test_a_recurrent_module_over_one_row_with_a_strided_state_is_eagers(make):
    """Over one row a GRU or RNN decomposes, but not with a strided state: the decomposition's
    first step then splits vector and scalar elements elsewhere than eager's composite."""
    torch.manual_seed(0)
    model = make().eval()

    def args(i):
        g = torch.Generator().manual_seed(i)
        return torch.randn(4, 1, 6, generator=g), torch.randn(1, 1, 10, generator=g)[..., ::2]
    with torch.no_grad():
        step = torchreplay.capture(model, args(0), config=config())
        for i in range(3):
            assert_bitwise(step(*args(i)), model(*args(i)), f"call {i}")
    assert step.stats()["replays"] == 2


@pytest.mark.parametrize("inside", ["torch.enable_grad()", "torch.autocast"])
def test_a_recurrent_call_the_twins_cannot_stand_for_runs_its_graph_eagerly(inside):
    """Compiled under no_grad, the module then called inside torch.enable_grad() or an autocast
    region of the same frame: the twins have neither an autograd kernel nor casts, and PyTorch's
    decomposition of an LSTM gives its states other sizes, so the graph runs eagerly (logged in
    backend.eager_graphs): eager's bits, eager's gradients."""
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.LSTM(16, 20, num_layers=2, proj_size=4, batch_first=True)

        def forward(self, x):
            self.rnn.flatten_parameters()
            ctx = torch.enable_grad() if inside == "torch.enable_grad()" else \
                torch.autocast("cpu", dtype=torch.bfloat16)
            with ctx:
                return self.rnn(x)

    torch.manual_seed(0)
    model = Model().eval()
    backend = torchreplay.get_backend(compiler_config=config())
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        for i in range(3):
            x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(i))
            got, want = compiled(x), model(x)
            assert_bitwise(got, want, f"call {i}")
            if inside == "torch.enable_grad()":
                with torch.enable_grad():
                    grads = [torch.autograd.grad(o[0].sum(), model.rnn.weight_hh_l0)[0] for o in (got, want)]
                assert_bitwise(grads[0], grads[1], f"call {i}: gradient")
    assert list(backend.eager_graphs.values()) == [
        "its lstm call needs gradients, runs under autocast or not on the CPU, where torchreplay cannot keep it "
        "eager's bits"]


def test_a_recurrent_module_on_a_packed_sequence_runs_eagerly_under_torch_compile():
    """pack_padded_sequence -> GRU -> pad_packed_sequence: Dynamo skips the frame (traced, its
    pad_packed_sequence fails in Dynamo on the fake batch sizes), which runs eagerly, eager's bits."""
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.GRU(16, 20, batch_first=True)

        def forward(self, x, lengths):
            out, h = self.rnn(pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False))
            return pad_packed_sequence(out, batch_first=True)[0], h

    torch.manual_seed(0)
    model = Model().eval()
    compiled = torch.compile(model, backend=torchreplay.get_backend(compiler_config=config()))
    lengths = torch.tensor([6, 3, 5, 1])
    with torch.no_grad():
        for i in range(3):
            x = torch.randn(4, 6, 16, generator=torch.Generator().manual_seed(i))
            assert_bitwise(compiled(x, lengths), model(x, lengths), f"call {i}")



LAYOUTS = {   # (n, 6) tensors of other strides; a trace is made on one of them
    "contiguous": lambda g, n: torch.randn(n, 6, generator=g),
    "transposed": lambda g, n: torch.randn(6, n, generator=g).t(),
    "columns of a wider tensor": lambda g, n: torch.randn(n, 10, generator=g)[:, 2:8],
    "one column broadcast": lambda g, n: torch.randn(n, 1, generator=g).expand(n, 6),
}
W = torch.randn(6, 4, generator=torch.Generator().manual_seed(7))


def by_layout(x, s):
    """What torch.export decides by the example's strides: reshape as a view or a copy (the output
    then aliases the argument or not), contiguous() as nothing or a copy before the matmul."""
    return x.reshape(-1) * s, x.contiguous() @ W, x.reshape(2, -1)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("traced", list(LAYOUTS))
def test_arguments_of_other_strides_get_a_trace_of_their_own(traced, dynamic):
    """Note [Traced strides] (replay/call_checks.cc): a call whose argument has other strides than
    the trace's example gets a trace made for them (eager's values, strides and aliasing, as
    torch.compile's stride guards recompile), then replays; back on the traced strides the first
    trace replays again. Dynamic: one trace per layout over rows of 8 and 12."""
    g = torch.Generator().manual_seed(0)
    step = torchreplay.capture(by_layout, (LAYOUTS[traced](g, 8), 3), dynamic=dynamic)
    order = list(LAYOUTS) + [traced]
    for layout in order:
        for call, n in enumerate([8, 8, 12, 12] if dynamic else [8, 8, 8]):
            x = LAYOUTS[layout](g, n)
            with torch.no_grad():
                got, want = step(x, 3), by_layout(x, 3)
            for i, (a, b) in enumerate(zip(got, want)):
                assert_bitwise(a, b, f"{layout}, call {call}, output {i}")
                assert (a.data_ptr() == x.data_ptr()) == (b.data_ptr() == x.data_ptr()), f"{layout}: output {i} aliasing"
    s = step.stats()
    assert len(s["traces"]) == len(LAYOUTS), s
    assert all(t["replays"] >= 1 for t in s["traces"]), s


def test_capture_without_a_config_replays():
    """torchreplay.capture(model, args) replays (mode "reduce-overhead"); a config whose mode is
    "default" runs the graph op by op, never capturing."""
    torch.manual_seed(0)
    model = MLP().eval()
    x = torch.randn(2, 64)
    with torch.no_grad():
        for cfg, replays in ((None, True), (config(mode="default"), False)):
            step = torchreplay.capture(model, (x,), config=cfg)
            for i in range(4):
                assert_bitwise(step(x), model(x), f"config {cfg}: call {i}")
            s = step.stats()
            assert (s["captures"], s["replays"]) == ((1, 3) if replays else (0, 0)), s


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no bias"])
def test_a_linear_on_columns_of_a_wider_tensor_folds_as_eager(bias, dynamic):
    """Note [Matmuls folded as eager folds them]: a 3-d batch that is not contiguous but folds as a
    view (x[..., 3:11]) is one mm in eager; export's decomposition would run a bmm (other bits).
    Traced on such a tensor, or traced contiguous and called with one."""
    torch.manual_seed(0)
    fc = nn.Linear(8, 3, bias=bias).eval()
    g = torch.Generator().manual_seed(1)
    for example in (torch.randn(4, 2, 8), torch.randn(4, 2, 16)[:, :, 3:11]):
        step = torchreplay.capture(fc, (example,), dynamic=dynamic)
        with torch.no_grad():
            for i in range(3):
                x = torch.randn(4, 2, 16, generator=g)[:, :, 3:11]
                assert_bitwise(step(x), fc(x), f"call {i}")
        assert step.stats()["replays"] >= 2, step.stats()


def test_arguments_whose_trace_fails_run_the_model_eagerly(replay_log):
    """A model that views its argument flat, called with a transposed one: eager raises (view), and
    so does torch.export tracing again for those strides; such calls run the model eagerly, so the
    error is eager's own, said once; contiguous calls still replay."""
    class Flat(nn.Module):
        def forward(self, x):
            return x.view(-1) * 2

    model = Flat()
    hooks = dict(torch.nn.modules.module._global_buffer_registration_hooks)
    with torch.no_grad():
        step = torchreplay.capture(model, (torch.randn(4, 6),))
        y = torch.randn(6, 4).t()
        with pytest.raises(RuntimeError) as eager:
            model(y)
        for _ in range(2):
            with pytest.raises(RuntimeError) as got:
                step(y)
            assert str(got.value) == str(eager.value)
        for i in range(3):
            x = torch.randn(4, 6)
            assert_bitwise(step(x), model(x), f"call {i}")
    said = [r.getMessage() for r in replay_log.records if "run the model eagerly" in r.getMessage()]
    assert len(said) == 1, said
    assert step.stats()["replays"] == 2, step.stats()
    # the failed trace left no hook behind (torch.export's buffer hook: later frames would break)
    assert dict(torch.nn.modules.module._global_buffer_registration_hooks) == hooks
