"""config.reduce_overhead.numerics = "close" (Note [Close numerics] in
python/torchreplay/close_numerics/__init__.py): the rewritten graph replays with results within the
stated tolerance of eager's on the zoo's CNNs and an LSTM; the default stays bitwise; a folded
parameter written after the capture is a clear error; layouts stay eager's where they show."""
import pytest
import torch
import torch.nn as nn

import torchreplay
from differential import assert_bitwise
from torchreplay_bench.models import MODELS

# The stated tolerance: every output element within this fraction of the output's largest
# magnitude of eager's (the results of a folded batch norm, a packed GEMM or a fused activation
# differ from eager's in the last bits of each sum, which is what this bounds).
TOLERANCE = 1e-4


def capture(model, args, numerics=None, **kw):
    config = torchreplay.CompilerConfig()
    config.mode = "reduce-overhead"
    if numerics is not None:
        config.reduce_overhead.numerics = numerics
    return torchreplay.capture(model, args, config=config, **kw)


def assert_within(got, want):
    for g, w in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)):
        assert g.shape == w.shape and g.dtype == w.dtype
        scale = w.abs().max().item()
        err = (g.double() - w.double()).abs().max().item()
        assert err <= TOLERANCE * scale, (err, scale)


def assert_within_with_eagers_strides(step, model, make, calls=4):
    """Calls `step` and `model` on make(0), ..., make(calls - 1): results within the tolerance,
    with eager's strides; the later calls replayed."""
    for i in range(calls):
        x = make(i)
        got, want = step(*x), model(*x)
        assert_within(got, want)
        assert [t.stride() for t in got] == [t.stride() for t in want]
    assert step.stats()["replays"] >= calls - 2


def ops_of(step, args):
    return {r["op"] for r in step.profile(*args, iterations=1)}


def test_default_is_bitwise():
    assert torchreplay.CompilerConfig().reduce_overhead.numerics == "bitwise"
    with pytest.raises(ValueError, match="numerics"):
        torchreplay.CompilerConfig().reduce_overhead.numerics = "fast"
    model, make = MODELS["convnet"][0]()
    with torch.no_grad():
        step = capture(model, make(0))
        assert step.numerics == {"numerics": "bitwise"}
        for i in range(4):
            x = make(i)  # (some of the harness's models draw a new input whatever i is)
            assert_bitwise(step(*x), model(*x))
        assert step.stats()["replays"] >= 2


@pytest.mark.parametrize("name", ["mobilenet_v3_small_96", "convnet", "audio_conv1d", "lstm_step", "gru_seq16", "mlp"])
def test_zoo_within_tolerance(name):
    torch.manual_seed(0)
    model, make = MODELS[name][0]()
    with torch.no_grad():
        step = capture(model, make(0), "close")
        report = step.numerics
        assert report["numerics"] == "close", report
        assert report["max_abs_err"] <= TOLERANCE * max(
            o.abs().max().item() for o in torch.utils._pytree.tree_leaves(model(*make(0)))), report
        for i in range(5):
            x = make(i)
            assert_within(step(*x), model(*x))
        assert step.stats()["replays"] >= 3, step.stats()
        ops = ops_of(step, make(0))
    rewrites = report["rewrites"]
    products = {"aten::addmm.out", "torchreplay::small_gemm.out"}  # which one: timed at capture
    if name == "lstm_step":  # through its decomposition, not oneDNN's RNN layer
        assert not any("lstm" in op or "gru" in op or "rnn" in op for op in ops), ops
        assert ops & products, ops
    elif name == "gru_seq16":  # one call for the layer (Note [GRU steps])
        assert rewrites["grus_fused"] == 1 and ops & {"torchreplay::gru_sequence.out"}, (rewrites, ops)
        assert not ops & {"torchreplay::eager_gru.input", "aten::gru.input"}, ops
    elif name == "mlp":
        assert ops & products, ops
        assert rewrites["linears_small_gemm"] == 0 or rewrites["post_ops_fused"] > 0, rewrites
    else:
        assert rewrites["batch_norms_folded"] > 0, rewrites
        assert "aten::_native_batch_norm_legit_no_training" not in ops, ops
        convs = sum(rewrites[k] for k in ("convolutions_onednn", "convolutions_gemm", "convolutions_depthwise",
                                          "convolutions_small_gemm", "convolutions_eager"))
        assert convs == sum(isinstance(m, nn.modules.conv._ConvNd) for m in model.modules()), rewrites


def test_lstm_stays_whole_by_default():
    model, make = MODELS["lstm_step"][0]()
    with torch.no_grad():
        step = capture(model, make(0))
        for i in range(3):
            x = make(i)
            assert_bitwise(step(*x), model(*x))
        assert any("lstm" in op or "rnn" in op for op in ops_of(step, make(0)))


def test_a_folded_parameter_written_after_capture_raises():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()).eval()
    x = (torch.randn(1, 3, 12, 12),)
    with torch.no_grad():
        step = capture(model, x, "close")
        for _ in range(3):
            assert_within(step(*x), model(*x))
        model[1].running_var.mul_(2)
        with pytest.raises(RuntimeError, match=r"buffer '1\.running_var' was written after the capture.*capture the "
                                               r"model again"):
            step(*x)
        again = capture(model, x, "close")
        for _ in range(3):
            assert_within(again(*x), model(*x))
        # the bitwise default reads the parameters each call
        bitwise = capture(model, x)
        bitwise(*x)
        model[0].weight.mul_(0.5)
        for _ in range(2):
            assert_bitwise(bitwise(*x), model(*x))


class ConvThenFlatten(nn.Module):
    """A convolution whose channels-last result is viewed (flatten) and returned: the rewrite makes
    it contiguous where a view or the caller would see the layout."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 6, 3, padding=1, groups=2)
        self.dw = nn.Conv2d(6, 6, 3, padding=1, groups=6)
        self.fc = nn.Linear(6 * 5 * 5, 3)

    def forward(self, x):
        y = torch.relu(self.dw(self.conv(x)))
        return self.fc(y.flatten(1)), y


def test_layouts_where_they_show():
    torch.manual_seed(0)
    model = ConvThenFlatten().eval()
    make = lambda i: (torch.randn(2, 4, 5, 5, generator=torch.Generator().manual_seed(i)),)  # noqa: E731
    with torch.no_grad():
        step = capture(model, make(0), "close")
        assert_within_with_eagers_strides(step, model, make)


def test_a_transposed_convolution_after_channels_last_results_keeps_eagers_strides(monkeypatch):
    """A convolution the rewrite leaves to eager (a transposed one) keeps a channels-last input's
    layout: marked so, its result is made contiguous at the output, and the rewrite stays."""
    from torchreplay import close_numerics
    monkeypatch.setattr(close_numerics.kernels, "least_times",
                        lambda fns, rounds=7: [1.0 if i == 1 else 9.0 for i in range(len(fns))])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.ConvTranspose2d(16, 8, 2, stride=2)).eval()
    make = lambda i: (torch.randn(1, 16, 12, 12, generator=torch.Generator().manual_seed(i)),)  # noqa: E731
    with torch.no_grad():
        step = capture(model, make(0), "close")
        assert step.numerics["numerics"] == "close", step.numerics
        assert step.numerics["rewrites"]["convolutions_onednn"] == 1, step.numerics
        assert_within_with_eagers_strides(step, model, make)


def test_dynamic_folds_batch_norms_only():
    torch.manual_seed(0)
    model, make = MODELS["convnet"][0]()
    with torch.no_grad():
        step = capture(model, make(0), "close", dynamic=True)
        assert step.numerics["rewrites"]["batch_norms_folded"] == 2
        assert step.numerics["rewrites"]["convolutions_onednn"] == 0
        for n in (1, 3):
            x = (torch.randn(n, 3, 16, 16),)
            assert_within(step(*x), model(*x))


def test_depthwise_op_matches_its_out_form():
    torch.manual_seed(0)
    x = torch.randn(2, 12, 9, 9).contiguous(memory_format=torch.channels_last)
    w = torch.randn(12, 1, 3, 3)
    b = torch.randn(12)
    w_hwc = w.view(12, 3, 3).permute(1, 2, 0).contiguous()
    try:
        y = torch.ops.torchreplay.depthwise_conv2d(x, w, w_hwc, b, [2, 2], [1, 1], [1, 1], "hardswish")
    except RuntimeError as e:
        if "AVX2" in str(e):
            pytest.skip("no AVX2 and FMA on this CPU")
        raise
    assert y.is_contiguous(memory_format=torch.channels_last)
    out = torch.empty(2, 12, 5, 5)
    torch.ops.torchreplay.depthwise_conv2d.out(x, w, w_hwc, b, [2, 2], [1, 1], [1, 1], "hardswish", out=out)
    assert_bitwise(out, y.contiguous())
    torch.testing.assert_close(y, nn.functional.hardswish(nn.functional.conv2d(x, w, b, 2, 1, 1, 12)),
                               rtol=1e-5, atol=1e-5)


def test_save_refuses_a_close_capture(tmp_path):
    model, make = MODELS["convnet"][0]()
    with torch.no_grad():
        step = capture(model, make(0), "close")
    with pytest.raises(NotImplementedError, match="numerics 'close'"):
        torchreplay.save(step, tmp_path / "m.trp")


def small_gemm(x, w_kn, b, post_op="none"):
    try:
        return torch.ops.torchreplay.small_gemm(x, w_kn, b, post_op)
    except RuntimeError as e:
        if "AVX2" in str(e):
            pytest.skip("no AVX2 and FMA on this CPU")
        raise


def test_small_gemm_bits_do_not_depend_on_tiling_or_threads():
    """Note [Small GEMMs]: each element is one FMA chain over k, whichever tile, row block, column
    vector or scalar tail computes it, on one thread or two."""
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(7, 37, generator=g), torch.randn(37, 203, generator=g), torch.randn(203, generator=g)
    y = small_gemm(x, w, b)
    want = torch.addmm(b.double(), x.double(), w.double())
    assert (y.double() - want).abs().max().item() < 1e-5 * want.abs().max().item()
    for r in range(7):  # one row at a time: the one-row tiles
        assert_bitwise(small_gemm(x[r:r + 1], w, b), y[r:r + 1])
    for c0, c1 in ((0, 8), (8, 203), (200, 203), (5, 29)):  # other column tilings, the scalar tail
        assert_bitwise(small_gemm(x, w[:, c0:c1].contiguous(), b[c0:c1].contiguous()), y[:, c0:c1].contiguous())
    from torchreplay.close_numerics.kernels import panels as _panels
    for panel in (8, 64, 96):  # the weight packed in panels of columns, the last one padded
        assert_bitwise(small_gemm(x, _panels(w, panel), b), y)
        assert_bitwise(small_gemm(x[:1], _panels(w, panel), b), y[:1])
    strided = torch.randn(7, 80, generator=g)[:, ::2][:, :37]  # rows not contiguous: copied first
    assert_bitwise(small_gemm(strided, w, b), small_gemm(strided.contiguous(), w, b))
    big = torch.randn(16, 256, generator=g), torch.randn(256, 1024, generator=g), torch.randn(1024, generator=g)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = small_gemm(*big)
        torch.set_num_threads(2)
        assert_bitwise(small_gemm(*big), one)
    finally:
        torch.set_num_threads(threads)
    out = torch.full((7, 203), float("nan"))
    torch.ops.torchreplay.small_gemm.out(x, w, b, "relu", out=out)
    assert_bitwise(out, torch.relu(y))
    nan = small_gemm(torch.full((1, 3), float("nan")), torch.randn(3, 9), torch.zeros(9), "relu")
    assert torch.isnan(nan).all()  # relu keeps NaN, as torch.relu does
    with pytest.raises(RuntimeError, match=r"small_gemm: a float32 \[M, K\] input"):
        small_gemm(x.double(), w, b)
    with pytest.raises(RuntimeError, match=r"small_gemm: bias is float32 \[203\]"):
        small_gemm(x, w, b[:5])
    with pytest.raises(RuntimeError, match=r"small_gemm: a packed weight is \[ceil\(N / panel\), K, panel\]"):
        small_gemm(x, _panels(w, 64)[:2].contiguous(), b)


def test_small_gemm_keeps_one_nan_where_an_input_nan_meets_a_weight_nan():
    """Note [Small GEMMs]: where a NaN input meets a NaN weight in one product, every tile shape
    (one to eight rows, whole vectors and the masked tail) and thread count keeps the same NaN,
    payload and all."""
    nan = lambda payload: torch.tensor([payload], dtype=torch.int32).view(torch.float32)[0]  # noqa: E731
    w = torch.full((24, 85), 0.5)
    w[3] = nan(0x7FC00003)
    payloads = set()
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 36):
                x = torch.ones(m, 24)
                x[:, 3] = nan(0x7FC00001)
                payloads |= set(small_gemm(x, w, torch.zeros(85)).view(torch.int32).flatten().tolist())
    finally:
        torch.set_num_threads(threads)
    assert len(payloads) == 1, sorted(hex(p & 0xFFFFFFFF) for p in payloads)


class TwoLinears(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(24, 40)
        self.b = nn.Linear(40, 12, bias=False)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


@pytest.mark.parametrize("small_faster", [True, False])
def test_products_of_few_rows_take_the_small_gemm_where_it_timed_faster(monkeypatch, small_faster):
    """The rewrite takes the small GEMM exactly where the capture's timing says it is faster (the
    timing forced here both ways), relu fused, a product without bias included; results within
    the tolerance, replayed; a weight written after the capture is a clear error."""
    from torchreplay import close_numerics
    small_gemm(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1))  # skips without AVX2
    # the ways in product_times' order: addmm, onednn, then the small GEMM's
    monkeypatch.setattr(close_numerics.kernels, "least_times", lambda fns, rounds=7: (
        [2.0] + [3.0] * (len(fns) - 2) + [1.0] if small_faster else [1.0] + [2.0] * (len(fns) - 1)))
    torch.manual_seed(0)
    model = TwoLinears().eval()
    make = lambda i: (torch.randn(3, 24, generator=torch.Generator().manual_seed(i)),)  # noqa: E731
    with torch.no_grad():
        step = capture(model, make(0), "close")
        for i in range(4):
            x = make(i)
            assert_within(step(*x), model(*x))
        assert step.stats()["replays"] >= 2
        ops = ops_of(step, make(0))
        rewrites = step.numerics["rewrites"]
        if small_faster:
            assert rewrites["linears_small_gemm"] == 2 and rewrites["post_ops_fused"] == 1, rewrites
            assert "torchreplay::small_gemm.out" in ops and "aten::addmm.out" not in ops, ops
            assert "aten::relu" not in ops and "aten::clamp_min.out" not in ops, ops
            model.b.weight.mul_(2)
            with pytest.raises(RuntimeError, match=r"'b\.weight' was written after the capture"):
                step(*make(0))
        else:
            assert rewrites["linears_small_gemm"] == 0 and rewrites["linears_onednn"] == 0, rewrites
            assert "torchreplay::small_gemm.out" not in ops, ops


# least_times forcing oneDNN fastest: the ways of conv_times and product_times in their order
# (eager's op or addmm, oneDNN, then torchreplay's kernels)
ONEDNN_FASTEST = lambda fns, rounds=7: [2.0, 1.0] + [3.0] * (len(fns) - 2)  # noqa: E731


class FeedForward(nn.Module):
    """A transformer's feed-forward block over a sequence: linear, GELU (after the view back to
    [batch, tokens, width]), linear."""

    def __init__(self, approximate):
        super().__init__()
        self.up, self.down, self.approximate = nn.Linear(32, 128), nn.Linear(128, 32), approximate

    def forward(self, x):
        return self.down(nn.functional.gelu(self.up(x), approximate=self.approximate))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_products_take_onednn_on_a_packed_weight_where_it_timed_faster(monkeypatch, approximate):
    """Where oneDNN's linear on a weight packed once times fastest (forced here), the products
    become it, the GELU after the first fused through its view; results within the tolerance,
    replayed; each node's choice says so; a weight written after the capture is a clear error."""
    from torchreplay import close_numerics
    if not torch.backends.mkldnn.is_available():
        pytest.skip("oneDNN is not in this build")
    monkeypatch.setattr(close_numerics.kernels, "least_times", ONEDNN_FASTEST)
    torch.manual_seed(0)
    model = FeedForward(approximate).eval()
    make = lambda i: (torch.randn(2, 40, 32, generator=torch.Generator().manual_seed(i)),)  # noqa: E731
    with torch.no_grad():
        step = capture(model, make(0), "close")
        assert_within_with_eagers_strides(step, model, make)
        ops = [r["op"] for r in step.profile(*make(0), iterations=1)]
        rewrites = step.numerics["rewrites"]
        assert rewrites["linears_onednn"] == 2 and rewrites["post_ops_fused"] == 1, rewrites
        assert ops.count("mkldnn::_linear_pointwise") == 2 and "aten::addmm.out" not in ops, ops
        assert not any("gelu" in op for op in ops), ops
        assert [c["chose"] for c in step.numerics["choices"].values()] == ["onednn", "onednn"], step.numerics
        model.up.weight.mul_(2)
        with pytest.raises(RuntimeError, match=r"'up\.weight' was written after the capture"):
            step(*make(0))


@pytest.mark.parametrize("case", [
    ((2, 5, 9, 11), (7, 5, 3, 2), [1, 1], [1, 0], [1, 2]),  # stride 1: one phase
    ((1, 3, 16, 16), (8, 3, 3, 3), [2, 2], [1, 1], [1, 1]),  # strided: two phases per row
    ((2, 4, 13, 17), (6, 4, 3, 3), [2, 3], [1, 2], [2, 2]),  # three phases, taps two apart
    ((1, 16, 6, 6), (12, 16, 1, 1), [1, 1], [0, 0], [1, 1]),  # 1x1: the planes themselves
    ((1, 1, 400), (9, 1, 20), [4], [3], [1]),  # 1-d, four phases
    ((2, 6, 37), (5, 6, 3), [1], [2], [2]),  # 1-d, stride 1
])
def test_conv_gemm_is_the_small_gemm_of_the_patches(case):
    """Each way torchreplay::conv_gemm reads the patches computes what the small GEMM computes on
    the patches torch's unfold copies out, bit for bit (the same FMA chain per element, the bias
    first), and that is close to eager's convolution; channels-last inputs and results (the
    pixels as the GEMM's rows), relu and 2 threads change no bit."""
    xs, ws, stride, padding, dilation = case
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(xs, generator=g), torch.randn(ws, generator=g), torch.randn(ws[0], generator=g)
    rows = w.reshape(ws[0], -1).contiguous()
    small_gemm(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1))  # skips without AVX2
    conv_gemm = torch.ops.torchreplay.conv_gemm
    got = conv_gemm(x, rows, b, list(ws[2:]), stride, padding, dilation, "none")
    one_d = len(xs) == 3
    x4 = x.unsqueeze(2) if one_d else x
    k4 = [1] + list(ws[2:]) if one_d else list(ws[2:])
    lift = (lambda v, pad: [pad] + v) if one_d else (lambda v, pad: v)
    patches = nn.functional.unfold(x4, k4, dilation=lift(dilation, 1), padding=lift(padding, 0),
                                   stride=lift(stride, 1))  # [N, C * kernel, P]
    for i in range(xs[0]):
        want = small_gemm(patches[i].t().contiguous(), rows.t().contiguous(), b).t()
        assert_bitwise(got[i].reshape(ws[0], -1), want.contiguous())
    conv = nn.functional.conv1d if one_d else nn.functional.conv2d
    ref = conv(x.double(), w.double(), b.double(), stride, padding, dilation)
    assert got.shape == ref.shape and got.is_contiguous()
    assert (got.double() - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    layouts = [False]
    if not one_d:
        cl = x.contiguous(memory_format=torch.channels_last)
        assert_bitwise(conv_gemm(cl, rows, b, list(ws[2:]), stride, padding, dilation, "none"), got)
        layouts.append(True)
        want_cl = got.contiguous(memory_format=torch.channels_last)
        for inp in (x, cl):
            assert_bitwise(conv_gemm(inp, rows, b, list(ws[2:]), stride, padding, dilation, "none", True), want_cl)
    else:
        with pytest.raises(RuntimeError, match="conv_gemm: a channels-last result is 4-d"):
            conv_gemm(x, rows, b, list(ws[2:]), stride, padding, dilation, "none", True)
    for channels_last in layouts:
        fmt = torch.channels_last if channels_last else torch.contiguous_format
        out = torch.full_like(got, float("nan")).contiguous(memory_format=fmt)
        conv_gemm.out(x, rows, b, list(ws[2:]), stride, padding, dilation, "relu", channels_last, out=out)
        assert_bitwise(out, torch.relu(got).contiguous(memory_format=fmt))
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(2)
            assert_bitwise(conv_gemm(x, rows, b, list(ws[2:]), stride, padding, dilation, "none", channels_last),
                           got.contiguous(memory_format=fmt))
        finally:
            torch.set_num_threads(threads)
    if not one_d:  # an out of the other layout is refused, not written as if it were one
        with pytest.raises(RuntimeError, match="conv_gemm: out is a channels-last float32"):
            conv_gemm.out(x, rows, b, list(ws[2:]), stride, padding, dilation, "none", True, out=torch.empty_like(got))
    with pytest.raises(RuntimeError, match="conv_gemm: the weight has"):
        conv_gemm(x, rows[:, 1:].contiguous(), b, list(ws[2:]), stride, padding, dilation, "none")


class ConvRelu(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 6, 3, padding=1)
        self.bn = nn.BatchNorm2d(6)
        self.conv1d = nn.Conv1d(6, 5, 3)

    def forward(self, x):
        y = torch.relu(self.bn(self.conv(x)))
        return self.conv1d(y.flatten(2)), y


def test_convolutions_take_conv_gemm_where_it_timed_fastest(monkeypatch):
    """With the capture's timing forced to pick it, every convolution of one group becomes
    torchreplay::conv_gemm, its relu fused, the outputs laid out as eager's; results within the
    tolerance, replayed; a folded weight written after the capture is a clear error."""
    from torchreplay import close_numerics
    small_gemm(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1))  # skips without AVX2
    # the last way timed (conv_gemm, the small GEMM) the fastest
    monkeypatch.setattr(close_numerics.kernels, "least_times", lambda fns, rounds=7: list(range(len(fns), 0, -1)))
    torch.manual_seed(0)
    model = ConvRelu().eval()
    make = lambda i: (torch.randn(2, 4, 7, 7, generator=torch.Generator().manual_seed(i)),)  # noqa: E731
    with torch.no_grad():
        step = capture(model, make(0), "close")
        assert_within_with_eagers_strides(step, model, make)
        rewrites = step.numerics["rewrites"]
        assert rewrites["convolutions_small_gemm"] == 2 and rewrites["post_ops_fused"] == 1, rewrites
        ops = ops_of(step, make(0))
        assert "torchreplay::conv_gemm.out" in ops and not any("convolution" in op for op in ops), ops
        model.conv.weight.mul_(2)
        with pytest.raises(RuntimeError, match=r"'conv\.weight' was written after the capture"):
            step(*make(0))


@pytest.mark.parametrize("threads", [1, 2])
def test_kernels_post_ops_are_eagers_ops_after_them(threads):
    """post_op "relu", "hardswish" and "hardsigmoid" of the small GEMM and conv_gemm give
    torch.relu's, hardswish's and hardsigmoid's bits of the result without it ("silu" within 4
    ulps of silu's), NaN where eager's is
    and infinities included (NaN payloads aside: ATen's vectorized kernels make a NaN all ones),
    over whole vectors and masked tails; a name of no post-op raises, naming it (the depthwise
    kernel's too)."""

    def assert_bitwise_but_nan_payloads(got, want):
        assert torch.equal(got.isnan(), want.isnan()) and got.isnan().any()
        assert_bitwise(got.nan_to_num(0.0, float("inf"), float("-inf")), want.nan_to_num(0.0, float("inf"),
                                                                                          float("-inf")))

    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(9, 37, generator=g) * 4, torch.randn(37, 203, generator=g), torch.randn(203, generator=g)
    x[1, 3], x[2, 5], x[4, 0] = float("nan"), float("inf"), float("-inf")
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        plain = small_gemm(x, w, b)
        ximg, rows = torch.randn(1, 3, 11, 13, generator=g) * 4, torch.randn(20, 27, generator=g)
        ximg[0, 1, 4, 4] = float("nan")
        conv = torch.ops.torchreplay.conv_gemm
        for post, eager in (("relu", torch.relu), ("hardswish", nn.functional.hardswish),
                            ("hardsigmoid", nn.functional.hardsigmoid)):
            assert_bitwise_but_nan_payloads(small_gemm(x, w, b, post), eager(plain))
            for channels_last in (False, True):
                args = (ximg, rows, b[:20].contiguous(), [3, 3], [2, 2], [1, 1], [1, 1])
                assert_bitwise_but_nan_payloads(conv(*args, post, channels_last),
                                                eager(conv(*args, "none", channels_last)))
        # silu: ATen's vectorized x / (1 + exp(-x)) with Sleef's exp on every element, where eager's
        # scalar tail calls std::exp: within 4 ulps of eager's, NaN where eager's is
        got, want = small_gemm(x, w, b, "silu"), nn.functional.silu(plain)
        assert torch.equal(got.isnan(), want.isnan()) and got.isnan().any()
        finite = ~want.isnan()
        ulps = (got[finite].view(torch.int32).long() - want[finite].view(torch.int32).long()).abs()
        assert int(ulps.max()) <= 4, int(ulps.max())
    finally:
        torch.set_num_threads(saved)
    names = 'post_op is "none", "relu", "hardswish", "hardsigmoid" or "silu"'
    with pytest.raises(RuntimeError, match=f'small_gemm: {names}, not "gelu"'):
        small_gemm(x, w, b, "gelu")
    with pytest.raises(RuntimeError, match=f'conv_gemm: {names}, not "relu6"'):
        torch.ops.torchreplay.conv_gemm(ximg, rows, b[:20].contiguous(), [3, 3], [2, 2], [1, 1], [1, 1], "relu6")
    dw = torch.randn(3, 1, 3, 3)
    with pytest.raises(RuntimeError, match=f'depthwise_conv2d: {names}, not ""'):
        torch.ops.torchreplay.depthwise_conv2d(ximg, dw, dw.view(3, 3, 3).permute(1, 2, 0).contiguous(), None,
                                               [1, 1], [1, 1], [1, 1], "")


class Mobile(nn.Module):
    """A mobile network's block and head: 1x1 convolutions followed by hardswish and relu (the
    views of their GEMM between), a linear followed by hardswish, one by hardsigmoid (an
    excitation's gate)."""

    def __init__(self):
        super().__init__()
        self.expand = nn.Conv2d(8, 32, 1)
        self.squeeze = nn.Conv2d(32, 16, 1)
        self.head = nn.Linear(16, 40)
        self.gate = nn.Linear(16, 16)

    def forward(self, x):
        y = torch.relu(self.squeeze(nn.functional.hardswish(self.expand(x))))
        m = y.mean((2, 3))
        return nn.functional.hardswish(self.head(m)), y, nn.functional.hardsigmoid(self.gate(m))


def test_activations_after_small_gemms_are_fused(monkeypatch):
    """With the small GEMM timed fastest, the hardswish, relu and hardsigmoid after the 1x1
    convolutions and the linears run inside it (conv_gemm or the small GEMM): no activation op is
    left in the replay, the results within the tolerance with eager's strides, replayed."""
    from torchreplay import close_numerics
    small_gemm(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1))  # skips without AVX2
    monkeypatch.setattr(close_numerics.kernels, "least_times", lambda fns, rounds=7: list(range(len(fns), 0, -1)))
    torch.manual_seed(0)
    model = Mobile().eval()
    make = lambda i: (torch.randn(1, 8, 5, 6, generator=torch.Generator().manual_seed(i)).contiguous(  # noqa: E731
        memory_format=torch.channels_last),)
    with torch.no_grad():
        step = capture(model, make(0), "close")
        assert_within_with_eagers_strides(step, model, make)
    rewrites = step.numerics["rewrites"]
    # the first convolution through conv_gemm (its input, a placeholder, is not known channels-last),
    # the second and the linears through the small GEMM
    assert rewrites["convolutions_small_gemm"] == 1 and rewrites["linears_small_gemm"] == 3, rewrites
    assert rewrites["post_ops_fused"] == 4, rewrites
    ops = ops_of(step, make(0))
    assert not any(a in op for op in ops for a in ("hardswish", "relu", "hardsigmoid", "fused")), ops


class Stem(nn.Module):
    """A mobile network's stem: a strided convolution, then a depthwise and a 1x1 one."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, stride=2, padding=1)
        self.dw = nn.Conv2d(16, 16, 3, padding=1, groups=16)
        self.pw = nn.Conv2d(16, 24, 1)

    def forward(self, x):
        return self.pw(self.dw(nn.functional.hardswish(self.conv(x))))


@pytest.mark.parametrize("threads", [1, 2])
def test_conv_gemm_gives_channels_last_where_a_depthwise_reads_it(monkeypatch, threads):
    """conv_gemm's result is channels-last where a depthwise convolution reads it (through the
    hardswish), contiguous where none does (ConvRelu: a 3x3 and a 1-d convolution read it); the
    outputs within the tolerance, with eager's strides, replayed; conv_gemm and depthwise_conv2d
    called unboxed (Note [Typed steps])."""
    from torchreplay import close_numerics
    small_gemm(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1))  # skips without AVX2
    monkeypatch.setattr(close_numerics.kernels, "least_times", lambda fns, rounds=7: list(range(len(fns), 0, -1)))
    torch.manual_seed(0)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        for model, shape, want in ((Stem().eval(), (1, 3, 20, 22), 1), (ConvRelu().eval(), (2, 4, 7, 7), 0)):
            make = lambda i: (torch.randn(shape, generator=torch.Generator().manual_seed(i)),)  # noqa: E731
            with torch.no_grad():
                step = capture(model, make(0), "close")
                assert_within_with_eagers_strides(step, model, make)
                kinds = {r["op"]: r["kind"] for r in step.profile(*make(0), iterations=1)}
            rewrites = step.numerics["rewrites"]
            assert rewrites["results_channels_last"] == want and rewrites["convolutions_small_gemm"] >= 1, rewrites
            convs = [op for op in kinds if op.startswith(("torchreplay::conv_gemm", "torchreplay::depthwise"))]
            assert len(convs) == 1 + want and all(kinds[op] == "typed out=" for op in convs), kinds
    finally:
        torch.set_num_threads(saved)


def test_conv_gemm_refuses_what_has_no_output():
    small_gemm(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1))  # skips without AVX2
    conv_gemm = torch.ops.torchreplay.conv_gemm
    w, b = torch.randn(2, 7), torch.randn(2)
    with pytest.raises(RuntimeError, match="conv_gemm: the kernel is larger than the padded input"):
        conv_gemm(torch.randn(1, 1, 5), w, b, [7], [3], [0], [1], "none")  # (5 - 7) // 3 rounds to 0 in C++
    with pytest.raises(RuntimeError, match="conv_gemm: an input without channels or samples"):
        conv_gemm(torch.randn(1, 1, 0), w, b, [7], [1], [4], [1], "none")


class PaddedBeyondReach(nn.Module):
    """The second convolution's padding exceeds its kernel's reach: oneDNN's convolution crashed
    on that geometry (PyTorch 2.11's eager op too, on a channels-last input)."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(4, 3, 3, padding=1)
        self.c2 = nn.Conv2d(3, 16, (1, 3), stride=(3, 2), padding=(4, 5), dilation=(1, 2))

    def forward(self, x):
        return self.c2(self.c1(x))


@pytest.mark.parametrize("numerics", ["bitwise", "close"])
def test_padding_beyond_the_kernels_reach_never_reaches_onednn(monkeypatch, numerics):
    """Neither the tape's checked convolutions nor the close rewrite try oneDNN there, and the
    close rewrite gives eager's op a contiguous input after a oneDNN convolution (forced here);
    before, the capture crashed the process."""
    from torchreplay import close_numerics
    monkeypatch.setattr(close_numerics.kernels, "least_times",
                        lambda fns, rounds=7: [2.0, 1.0, 3.0] if len(fns) == 3 else [1.0, 2.0])
    torch.manual_seed(0)
    model = PaddedBeyondReach().eval()
    make = lambda i: (torch.randn(2, 4, 8, 1, generator=torch.Generator().manual_seed(i)),)  # noqa: E731
    with torch.no_grad():
        step = capture(model, make(0), numerics)
        if numerics == "bitwise":
            for i in range(3):
                assert_bitwise(step(*make(i)), model(*make(i)))
            assert step.stats()["replays"] >= 1
        else:
            rewrites = step.numerics["rewrites"]
            assert rewrites["convolutions_onednn"] == 1 and rewrites["convolutions_eager"] == 1, rewrites
            assert rewrites["layout_copies"] >= 1, rewrites
            assert_within_with_eagers_strides(step, model, make, calls=3)


@pytest.mark.parametrize("way", ["onednn", "gemm"])
def test_a_channels_last_input_gives_eagers_channels_last_outputs(monkeypatch, way):
    """Eager's convolutions of a channels-last input give channels-last results: the rewritten
    graph's outputs have eager's strides whichever way its convolutions took (oneDNN's results are
    channels-last, conv_gemm's contiguous; forced here)."""
    from torchreplay import close_numerics
    order = [2.0, 1.0, 3.0] if way == "onednn" else [3.0, 2.0, 1.0]
    monkeypatch.setattr(close_numerics.kernels, "least_times", lambda fns, rounds=7: order if len(fns) == 3 else [2.0, 1.0])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(4, 6, 3, padding=1), nn.ReLU(), nn.Conv2d(6, 5, 3, padding=1)).eval()
    make = lambda i: (torch.randn(2, 4, 9, 9, generator=torch.Generator().manual_seed(i))  # noqa: E731
                      .contiguous(memory_format=torch.channels_last),)
    with torch.no_grad():
        step = capture(model, make(0), "close")
        assert step.numerics["rewrites"]["convolutions_onednn" if way == "onednn" else "convolutions_small_gemm"] == 2
        assert_within_with_eagers_strides(step, model, make)



class SqueezeExcite(nn.Module):
    """A depthwise block with squeeze-and-excitation, as in MobileNetV3, and a mean over an input."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(8, 16, 3, padding=1)
        self.dw = nn.Conv2d(16, 16, 3, padding=1, groups=16)
        self.fc1, self.fc2 = nn.Conv2d(16, 4, 1), nn.Conv2d(4, 16, 1)
        self.out = nn.Conv2d(16, 8, 1)

    def forward(self, x):
        y = nn.functional.hardswish(self.dw(torch.relu(self.stem(x))))
        s = nn.functional.hardsigmoid(self.fc2(torch.relu(self.fc1(y.mean((2, 3), keepdim=True)))))
        return self.out(y * s), x.mean((-1, -2), keepdim=True)


def squeeze_excite_ops(monkeypatch, last_fastest):
    """Captures SqueezeExcite under "close" with every timing forced (the last way the fastest, or
    the first), checks its results within the tolerance with eager's strides, replayed; returns
    the capture and its steps' ops."""
    from torchreplay import close_numerics
    small_gemm(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1))  # skips without AVX2
    monkeypatch.setattr(close_numerics.kernels, "least_times", lambda fns, rounds=7: [
        float(len(fns) - i) if last_fastest else float(i + 1) for i in range(len(fns))])
    torch.manual_seed(0)
    model = SqueezeExcite().eval()
    make = lambda i: (torch.randn(1, 8, 10, 10, generator=torch.Generator().manual_seed(i)),)  # noqa: E731
    with torch.no_grad():
        step = capture(model, make(0), "close")
        assert_within_with_eagers_strides(step, model, make)
        return step, [r["op"] for r in step.profile(*make(0), iterations=1)]


@pytest.mark.parametrize("ours_faster", [True, False])
def test_spatial_means_of_channels_last_results_take_the_small_gemm_where_it_timed_faster(monkeypatch, ours_faster):
    """A squeeze-and-excitation mean of a result the rewrite made channels-last becomes the small
    GEMM of a row of 1 / (H * W) by its pixels where the capture's timing says so (forced here both
    ways); the mean of the input (contiguous) stays eager's; results within the tolerance."""
    from torchreplay import close_numerics
    monkeypatch.setattr(close_numerics.images, "_mean_faster", lambda r, node, c, h, w: ours_faster)
    # every other timing: the last way the fastest, so that the convolutions' rewrites give the
    # channels-last result the mean reads
    step, ops = squeeze_excite_ops(monkeypatch, last_fastest=True)
    assert step.numerics["rewrites"]["means_small_gemm"] == (1 if ours_faster else 0)
    assert ops.count("aten::mean.out") == (1 if ours_faster else 2), ops


def test_small_gemm_takes_a_weight_in_any_layout():
    """A spatial mean's image that is not channels-last at run time reaches the small GEMM as a
    [H * W, C] view with strides (1, H * W): copied, the same sums as from a contiguous weight
    (efficientnet_b0 at 224x224 under close numerics fell back to bitwise on it)."""
    small_gemm(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1))  # skips without AVX2
    g = torch.Generator().manual_seed(3)
    image = torch.randn(1, 32, 12, 12, generator=g)               # NCHW
    flat = image.permute(0, 2, 3, 1).reshape(144, 32)             # a view, strides (1, 144)
    assert flat.stride() == (1, 144)
    row, bias = torch.full((1, 144), 1.0 / 144), torch.zeros(32)
    got = small_gemm(row, flat, bias)
    want = small_gemm(row, flat.contiguous(), bias)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert torch.allclose(got.view(1, 32, 1, 1), image.mean((2, 3), keepdim=True), atol=1e-6)


@pytest.mark.parametrize("rows", [1, 9, 36, 144])
def test_small_gemm_scaled_is_the_small_gemm_of_the_scaled_input(rows):
    """torchreplay::small_gemm_scaled(x, s, w, b) gives the bits of small_gemm(x * s, w, b): each
    product rounded as the multiply rounds it, with few rows (scaled once) and many (per task), K
    not a multiple of a vector, on one thread or two, NaNs and infinities included."""
    small_gemm(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1))  # skips without AVX2
    g = torch.Generator().manual_seed(rows)
    x, s = torch.randn(rows, 45, generator=g), torch.rand(45, generator=g)
    w, b = torch.randn(45, 40, generator=g), torch.randn(40, generator=g)
    x[0, 3], x[-1, 44], s[7] = float("nan"), float("inf"), float("-inf")
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            got = torch.ops.torchreplay.small_gemm_scaled(x, s, w, b, "hardswish")
            assert_bitwise(got, small_gemm(x * s, w, b, "hardswish"), f"{t} threads")
    finally:
        torch.set_num_threads(threads)
    strided = torch.randn(90, generator=g)[::2]  # a scale that is not contiguous: copied first
    assert_bitwise(torch.ops.torchreplay.small_gemm_scaled(x, strided, w, b, "none"), small_gemm(x * strided, w, b))
    with pytest.raises(RuntimeError, match=r"small_gemm_scaled: scale is a float32 \[K\]"):
        torch.ops.torchreplay.small_gemm_scaled(x, s[:5], w, b, "none")


@pytest.mark.parametrize("ours_faster", [True, False])
def test_a_squeeze_excitation_scale_folds_into_the_small_gemm_after_it(monkeypatch, ours_faster):
    """The scale x * s of a channels-last image read only by a 1x1 convolution through the small
    GEMM moves into that product (small_gemm_scaled): no elementwise step left for it; results
    within the tolerance, with eager's strides, replayed. (Where the 1x1 convolution stays MKL's
    addmm, the product is not the small GEMM's and the scale stays.)"""
    step, ops = squeeze_excite_ops(monkeypatch, last_fastest=ours_faster)
    folded = step.numerics["rewrites"]["scales_folded"]
    assert folded == (1 if "torchreplay::small_gemm_scaled.out" in ops else 0), (folded, ops)
    if ours_faster:
        assert folded == 1 and not any(op.startswith("fused: mul") for op in ops), ops


def test_group_norm_after_a_rewritten_1d_convolution_reads_eagers_layout(monkeypatch):
    """wav2vec 2.0's front end: a Conv1d whose rewritten result is channels-last (oneDNN's, forced
    here), then GroupNorm, whose kernel raises on an input not contiguous in its layout: the
    rewrite gives it eager's layout (the capture had fallen back to bitwise)."""
    from torchreplay.close_numerics import convolutions
    way = "onednn"
    monkeypatch.setattr(convolutions, "_fastest", lambda *a, **k: way)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(1, 32, 10, stride=5, bias=False), nn.GroupNorm(32, 32), nn.GELU(),
                          nn.Conv1d(32, 32, 3, stride=2, bias=False), nn.GELU()).eval()
    make = lambda i: (torch.randn(1, 1, 400, generator=torch.Generator().manual_seed(i)),)  # noqa: E731
    with torch.no_grad():
        step = capture(model, make(0), "close")
        assert step.numerics["numerics"] == "close", step.numerics
        assert step.numerics["rewrites"]["convolutions_" + way] >= 1, step.numerics
        assert_within_with_eagers_strides(step, model, make)


class Chooser(nn.Module):
    """A convolution the rewrite times (3x3), a depthwise one it always takes, a 1x1 one and a
    linear it times against MKL."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.dw = nn.Conv2d(16, 16, 3, padding=1, groups=16)
        self.pw = nn.Conv2d(16, 24, 1)
        self.fc = nn.Linear(24, 10)

    def forward(self, x):
        x = self.pw(torch.relu(self.dw(torch.relu(self.conv(x)))))
        return self.fc(x.mean((2, 3)))


# The op a step runs for each way the rewrite can choose.
OPS_OF_WAY = {"gemm": "torchreplay::conv_gemm.out", "onednn": "mkldnn::_convolution_pointwise",
              "eager": "convolution", "dense": "torchreplay::small_gemm.out",
              "panels": "torchreplay::small_gemm.out", "addmm": "aten::addmm.out", "mm": "aten::mm.out",
              "depthwise": "torchreplay::depthwise_conv2d.out"}


def test_the_kernel_chosen_per_node_is_the_fastest_timed_and_shows_in_the_profile_and_dump(tmp_path):
    torch.manual_seed(0)
    model = Chooser().eval()
    x = torch.randn(1, 3, 20, 20)
    config = torchreplay.CompilerConfig()
    config.mode = "reduce-overhead"
    config.reduce_overhead.numerics = "close"
    config.debug.graph_dump.type = "txt"
    config.debug.graph_dump.path = str(tmp_path)
    with torch.no_grad():
        step = torchreplay.capture(model, (x,), config=config)
        assert_within(step(x), model(x))
        rows = {r["node"]: r for r in step.profile(x, iterations=2)}
    choices = step.numerics["choices"]
    timed = {n: c for n, c in choices.items() if c["times"]}
    assert "depthwise" in [c["chose"] for c in choices.values()], choices
    assert len(timed) >= 3, choices  # the 3x3 convolution, the 1x1 one's GEMM, the linear
    for node, c in choices.items():
        if c["times"]:
            assert c["chose"] == min(c["times"], key=c["times"].get), (node, c)
        assert node in rows, (node, sorted(rows))
        assert OPS_OF_WAY[c["chose"]] in rows[node]["op"], (node, c, rows[node]["op"])
        assert rows[node]["choice"].startswith(c["chose"] + " ("), rows[node]
    assert all("choice" not in r for n, r in rows.items() if n not in choices)
    dump = next(p for p in tmp_path.iterdir() if p.name.endswith(".txt") and ".key" not in p.name).read_text()
    for node, c in choices.items():
        assert f"#   {node}: {c['chose']} (" in dump, dump[-2000:]
    assert step.stats()["replays"] >= 1


def test_a_1d_convolution_s_choice_is_on_its_oned_nn_step(monkeypatch):
    """A 1-d convolution through oneDNN (forced fastest here) runs as a 2-d one between an
    unsqueeze and a squeeze: the choice is shown on the convolution's step, not the squeeze's."""
    from torchreplay import close_numerics
    monkeypatch.setattr(close_numerics.kernels, "least_times", ONEDNN_FASTEST)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(8, 16, 5, stride=2), nn.GELU()).eval()
    x = torch.randn(1, 8, 60)
    with torch.no_grad():
        step = capture(model, (x,), "close")
        assert_within(step(x), model(x))
        rows = step.profile(x, iterations=2)
    chosen = [r for r in rows if "choice" in r]
    assert [(r["op"], r["choice"].split(" ")[0]) for r in chosen] == [("mkldnn::_convolution_pointwise", "onednn")], rows


@pytest.mark.parametrize("act", [nn.ReLU, nn.ReLU6, nn.Hardsigmoid, nn.Hardtanh, nn.GELU], ids=lambda a: a.__name__)
@pytest.mark.parametrize("layer", ["linear", "conv"])
def test_a_nan_stays_nan_through_onednn_and_its_activation(monkeypatch, act, layer):
    """oneDNN's relu, clip and hardsigmoid post-ops give 0 or a bound for a NaN, eager's ops NaN:
    those stay ops of their own after oneDNN's kernels (forced fastest here), so every NaN of
    eager's result is one of the replay's; the others are fused."""
    from torchreplay import close_numerics
    monkeypatch.setattr(close_numerics.kernels, "least_times", ONEDNN_FASTEST)
    torch.manual_seed(0)
    if layer == "linear":
        model, x = nn.Sequential(nn.Linear(8, 6), act()).eval(), torch.randn(4, 8)
    else:
        model, x = nn.Sequential(nn.Conv2d(3, 6, 3), act()).eval(), torch.randn(1, 3, 9, 9)
    with torch.no_grad():
        step = capture(model, (x,), "close")
        x = x.clone()
        x.view(-1)[[0, 5]] = float("nan")
        x.view(-1)[7] = float("inf")
        for _ in range(3):
            got, want = step(x), model(x)
        assert step.stats()["replays"] >= 1
    assert torch.equal(got.isnan(), want.isnan()) and want.isnan().any(), (got, want)
    fine = ~want.isnan()
    assert torch.allclose(got[fine], want[fine], rtol=1e-4, atol=1e-5)
    rewrites = step.numerics["rewrites"]
    assert rewrites["linears_onednn" if layer == "linear" else "convolutions_onednn"] == 1, rewrites
    assert rewrites["post_ops_fused"] == (1 if act is nn.GELU else 0), rewrites


class Decaying(nn.Module):
    """A weight the forward itself writes: no weight known at capture."""

    def __init__(self):
        super().__init__()
        self.register_buffer("w", torch.randn(32, 64))

    def forward(self, x):
        y = nn.functional.linear(x, self.w)
        self.w.mul_(0.5)
        return y


def test_a_weight_the_forward_writes_is_not_folded(monkeypatch):
    from torchreplay import close_numerics
    monkeypatch.setattr(close_numerics.kernels, "least_times", ONEDNN_FASTEST)
    torch.manual_seed(0)
    model, reference = Decaying(), Decaying()
    reference.w.copy_(model.w)
    x = torch.randn(8, 64)
    with torch.no_grad():
        step = capture(model, (x,), "close")
        for i in range(3):
            assert_bitwise(step(x), reference(x), f"call {i}")
        assert step.stats()["replays"] >= 1
    assert step.numerics["rewrites"]["linears_onednn"] == 0 and not step.numerics["choices"], step.numerics
    assert_bitwise(model.w, reference.w)


def test_a_model_made_under_inference_mode_sees_writes_to_its_folded_weights(caplog):
    """Inference tensors move no version counter: their contents are compared on every call,
    which the capture says once."""
    torch.manual_seed(0)
    with torch.inference_mode():
        model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8)).eval()
        x = torch.randn(8, 64)
        with caplog.at_level("WARNING", logger="torchreplay"):
            step = capture(model, (x,), "close")
        assert any("inference tensors" in r.getMessage() for r in caplog.records), caplog.text
        assert_within(step(x), model(x))
        if step.numerics["rewrites"]["linears_small_gemm"] + step.numerics["rewrites"]["linears_onednn"] == 0:
            pytest.skip("no weight was folded here (addmm timed fastest)")
        model[0].weight.mul_(2)
        with pytest.raises(RuntimeError, match=r"'0\.weight' was written after the capture"):
            step(x)
