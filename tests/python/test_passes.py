"""The built-in FX passes, on hand-built ATen graphs: what they rewrite, what they must leave."""
import pytest
import torch
import torch.fx

import torchreplay

from differential import assert_bitwise
from torchreplay.passes import reinplace_input_updates

aten = torch.ops.aten


def kv_graph(read_old_after_update: bool, view_before: bool = False) -> torch.fx.GraphModule:
    g = torch.fx.Graph()
    buf, x, i = g.placeholder("buf"), g.placeholder("x"), g.placeholder("i")
    view = g.call_function(aten.t.default, (buf,)) if view_before else None
    new = g.call_function(aten.index_copy.default, (buf, 0, i, x))
    out = g.call_function(aten.mul.Tensor, (new, 2))
    if read_old_after_update:
        out = g.call_function(aten.add.Tensor, (out, buf))           # the old value, after the update
    if view is not None:
        out = g.call_function(aten.add.Tensor, (out, g.call_function(aten.t.default, (view,))))
    g.call_function(aten.copy_.default, (buf, new))
    g.output((out,))
    return torch.fx.GraphModule(torch.nn.Module(), g)


def run(gm, buf):
    x, i = torch.arange(8.0).view(2, 4), torch.tensor([3, 1])
    out = gm(buf, x, i)[0]
    return out, buf


def test_update_then_copy_back_becomes_in_place():
    gm = kv_graph(read_old_after_update=False)
    want_out, want_buf = run(gm, torch.ones(5, 4))
    assert reinplace_input_updates(gm) == 1
    gm.recompile()
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert aten.index_copy_.default in targets and aten.copy_.default not in targets
    got_out, got_buf = run(gm, torch.ones(5, 4))
    assert_bitwise(got_out, want_out)
    assert_bitwise(got_buf, want_buf)


def test_left_alone_when_the_old_value_is_read_after_the_update():
    for kwargs in ({"read_old_after_update": True}, {"read_old_after_update": False, "view_before": True}):
        gm = kv_graph(**kwargs)
        want_out, want_buf = run(gm, torch.ones(5, 4))
        assert reinplace_input_updates(gm) == 0, kwargs
        gm.recompile()
        got_out, got_buf = run(gm, torch.ones(5, 4))
        assert_bitwise(got_out, want_out)
        assert_bitwise(got_buf, want_buf)


@pytest.mark.parametrize("entry", ["capture", "compile"])
@pytest.mark.parametrize("pool", [torch.nn.MaxPool1d(4), torch.nn.MaxPool1d(3, stride=2, padding=1, ceil_mode=True),
                                  torch.nn.MaxPool1d(2, dilation=2)])
def test_a_1d_max_pool_without_indices_replays_as_eagers_max_pool1d(entry, pool):
    """restore_max_pool1d: export and AOTAutograd write a 1-d max pooling as a 2-d one with
    indices, whose kernel keeps a transposed input's layout and makes a bfloat16 NaN's payload the
    canonical one; eager without gradients runs max_pool1d, contiguous, NaN bits kept. The replay
    gives eager's bits and strides, NaNs included, and runs no pooling with indices."""
    config = torchreplay.CompilerConfig()
    config.mode = "reduce-overhead"
    torch._dynamo.reset()
    fn = lambda x: pool(x) * 1  # noqa: E731  (a node after it: the pooling's result is not the input)
    make = lambda i, dtype: torch.randn(2, 23, 5, generator=torch.Generator().manual_seed(i)).to(dtype).transpose(1, 2)  # noqa: E731,E501
    for dtype in (torch.float32, torch.bfloat16):
        with torch.no_grad():
            backend = torchreplay.get_backend(compiler_config=config)
            step = torchreplay.capture(fn, (make(0, dtype),), config=config) if entry == "capture" else \
                torch.compile(fn, backend=backend, dynamic=False)
            for i in range(4):
                x = make(i, dtype)
                x.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)[0, 1, 3 + i] = -1  # a NaN, payload all ones
                assert_bitwise(step(x), fn(x))
        assert (step.stats() if entry == "capture" else backend.stats()[0])["replays"] >= 2
        if entry == "capture":
            ops = {r["op"] for r in step.profile(make(0, dtype), iterations=1)}
            assert "aten::max_pool1d" in ops and not any("with_indices" in op for op in ops), ops
        torch._dynamo.reset()


def test_redispatching_overloads_become_what_eager_runs_and_fuse():
    """rsub(x, other, alpha) is eager's sub(other, x, alpha), add/sub/mul/div.Scalar their .Tensor
    overloads on the number (as_redispatched): the graph holds none of them, its steps are one
    fused step, and the results are eager's bits, infinities and NaNs too."""
    from differential import run_diff
    from test_fusion import special

    def fn(x, y):
        a = 1.0 - x                      # rsub.Scalar
        b = torch.rsub(y, x, alpha=3)    # rsub.Tensor: x - 3 * y
        c = torch.rsub(x, 2.5, alpha=0.5)
        d = aten.add.Scalar(aten.mul.Scalar(a, 0.3), 1.5)
        e = aten.div.Scalar(aten.sub.Scalar(b, 0.25), 7.0)
        return (d * e + c).exp()

    b = run_diff(fn, lambda i, g: (special(37, torch.float32, i), special(37, torch.float32, 10 + i)))
    logs = [log for s in b.stats() for log in s["capture_log"]]
    assert logs and all(log["steps"] == log["fused_steps"] == 1 and log["fused_nodes"] == 10 for log in logs), logs


def test_redispatched_rsub_keeps_an_alpha_given_by_position():
    from torchreplay.passes import as_redispatched

    g = torch.fx.Graph()
    x = g.placeholder("x")
    g.output((g.call_function(aten.rsub.Scalar, (x, 2.0, 0.25)),))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    assert as_redispatched(gm) == 1
    gm.recompile()
    (node,) = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert node.target == aten.sub.Tensor and node.args == (2.0, x) and node.kwargs == {"alpha": 0.25}
    t = torch.randn(9)
    assert_bitwise(gm(t)[0], torch.rsub(t, 2.0, alpha=0.25))


def test_redispatch_leaves_an_other_given_by_keyword():
    from torchreplay.passes import as_redispatched

    g = torch.fx.Graph()
    x = g.placeholder("x")
    g.output((g.call_function(aten.mul.Scalar, (x,), {"other": 3.0}),))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    assert as_redispatched(gm) == 0
    t = torch.randn(5)
    assert_bitwise(gm(t)[0], t * 3.0)


def test_metadata_asserts_that_hold_by_the_graph_are_dropped_the_others_kept():
    """Note [Metadata asserts] (passes.drop_metadata_asserts): a dtype, device or layout assert the
    graph's value satisfies goes; one of another dtype, or of sizes or strides, stays."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torchreplay.passes import drop_metadata_asserts
    g = torch.fx.Graph()
    x = g.placeholder("x")
    with FakeTensorMode():
        x.meta["val"] = torch.empty(2, 3)
    asserts = [g.call_function(aten._assert_tensor_metadata.default, args, kwargs) for args, kwargs in [
        ((x, None, None, torch.float32), {}),                               # holds: dropped
        ((x,), {"dtype": torch.float32, "device": torch.device("cpu")}),    # holds: dropped
        ((x,), {"layout": torch.strided}),                                  # holds: dropped
        ((x, None, None, torch.float64), {}),                               # another dtype: kept
        ((x, [2, 3]), {}),                                                  # sizes: kept
        ((x, None, [3, 1]), {"dtype": torch.float32}),                      # strides: kept
    ]]
    g.output((x,))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    assert drop_metadata_asserts(gm) == 3
    left = [n for n in gm.graph.nodes if n.target is aten._assert_tensor_metadata.default]
    assert [n.name for n in left] == [a.name for a in asserts[3:]]


@pytest.mark.parametrize("n_threads", [1, 3])
def test_a_captured_models_no_op_casts_leave_no_assert_steps(n_threads):
    """A model whose `.to(torch.float32)` changes nothing (an RMS norm's, as transformers writes
    it): export leaves a metadata assert per cast, the capture runs none, the results are eager's."""
    from test_conditions import threads

    class Norm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.rand(64) + 0.5)

        def forward(self, x, ids):
            h = x.to(torch.float32)
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
            return (self.weight * h.to(x.dtype)).to(torch.float32), ids.to(torch.int64) + 1

    m = Norm()
    g = torch.Generator().manual_seed(0)
    args = (torch.randn(3, 64, generator=g), torch.arange(3))
    with torch.no_grad(), threads(n_threads):
        step = torchreplay.capture(m, args)
        for i in range(3):
            x = (torch.randn(3, 64, generator=g), torch.arange(3) * i)
            assert_bitwise(step(*x), m(*x), f"call {i}")
        ops = [p["op"] for p in step.profile(*args)]
    assert step.stats()["replays"] >= 2, step.stats()
    assert not any("assert" in op for op in ops), ops


class _Converts(torch.nn.Module):
    """Integer and bool tensors converted to float32 (as torchao's int8 weight-only eager converts
    its weights): a buffer, an argument, a transposed and a sliced view, a row past ATen's grain."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.register_buffer("w8", torch.randint(-128, 128, (48, 40), dtype=torch.int8, generator=g))
        self.register_buffer("u8", torch.randint(0, 256, (3, 5, 7), dtype=torch.uint8, generator=g))
        self.register_buffer("big", torch.randint(-2 ** 15, 2 ** 15, (40000,), dtype=torch.int16, generator=g))

    def forward(self, x, mask, ids, flags):
        a = x @ self.w8.to(torch.float32) * 0.5
        b = self.w8.t().to(torch.float32)[:4] + self.u8.to(torch.float32).sum()
        c = self.w8[:, ::3].to(torch.float32)          # not dense: ATen's copy
        d = mask.to(torch.float32) * self.big.to(torch.float32)[:mask.numel()].view(mask.shape)
        return a, b, c, d, ids.to(torch.float32), flags.view(torch.bool).to(torch.float32)   # bytes 2-255: 1


@pytest.mark.parametrize("entry", ["capture", "compile", "loaded"])
def test_exact_conversions_to_float32_replay_eagers_bits(entry, tmp_path):
    """Note [Exact conversions]: `.to(torch.float32)` of int8, uint8, int16 and bool tensors runs
    torchreplay::to_float32 into the planned buffer: eager's values and strides, dense and
    transposed operands through its loop, a sliced one through ATen's copy, bool tensors viewed
    from bytes other than 0 and 1, at 1 and 3 threads."""
    from test_conditions import Entry, threads
    m = _Converts()
    g = torch.Generator().manual_seed(2)

    def inputs():
        return (torch.randn(2, 48, generator=g), torch.rand(6, 8, generator=g) > 0.5,
                torch.randint(-100, 100, (5,), dtype=torch.int8, generator=g),
                torch.randint(0, 256, (9, 7), dtype=torch.uint8, generator=g))

    with torch.no_grad():
        f = Entry(entry, m, inputs(), tmp_path)
        for i, n_threads in enumerate([1, 3, 3, 1]):
            x = inputs()
            with threads(n_threads):
                assert_bitwise(list(f(*x)), list(m(*x)), f"{entry}, call {i} at {n_threads} threads")
    s = f.stats()
    assert s["replays"] >= 2 and s["eager_fallbacks"] == 0, s
    ops = [op for c in s["capture_log"] for op in c.get("functional_ops", [])]
    assert "aten::_to_copy" not in ops, ops   # every conversion ran as a step into its buffer
