"""Convolutions on the CPU tape through faster calls, checked per node at capture (Note [Checked
convolutions] in capture/tape/checked/conv_steps.h): replays bitwise equal to eager on convolutions of every
kind, and the kernel each node took is the one its recorded measurement supports.

Which shapes a kernel is exact for depends on the CPU, so no test names one: each case checks that
the graph replayed with eager's bits, and that what the capture recorded per node (the profile's
kind and note) agrees with a measurement the test makes itself on the same input."""
import os
import re

import pytest
import torch
import torch.nn as nn

import torchreplay
from differential import assert_bitwise

OUT = torch.ops.torchreplay.convolution.out
KERNELS = ("slow_conv2d", "onednn_prepacked", "depthwise", "depthwise_bias_last")


def capture(model, args):
    config = torchreplay.CompilerConfig()
    config.mode = "reduce-overhead"
    return torchreplay.capture(model, args, config=config)


def conv_rows(step, args):
    """The profile rows of the tape's convolution steps, in graph order."""
    return [r for r in step.profile(*args, iterations=2)
            if r["op"] in ("aten::convolution", "torchreplay::convolution.out")]


class Conv(nn.Module):
    def __init__(self, conv):
        super().__init__()
        self.conv = conv

    def forward(self, x):
        return self.conv(x)


# (name, module, input shape): the convolutions of the zoo's CNNs and audio stack, and the rest
CASES = [
    ("stem_s2", lambda: nn.Conv2d(3, 16, 3, stride=2, padding=1, bias=False), (1, 3, 32, 32)),
    ("depthwise3x3", lambda: nn.Conv2d(16, 16, 3, padding=1, groups=16, bias=False), (1, 16, 12, 12)),
    ("depthwise5x5_s2", lambda: nn.Conv2d(24, 24, 5, stride=2, padding=2, groups=24), (1, 24, 11, 11)),
    ("pointwise1x1", lambda: nn.Conv2d(24, 40, 1, bias=False), (1, 24, 6, 6)),
    ("pointwise1x1_bias_1x1", lambda: nn.Conv2d(32, 8, 1), (1, 32, 1, 1)),
    ("dense3x3", lambda: nn.Conv2d(8, 8, 3, padding=1), (1, 8, 16, 16)),
    ("grouped", lambda: nn.Conv2d(16, 32, 3, padding=1, groups=4), (1, 16, 8, 8)),
    ("dilated", lambda: nn.Conv2d(8, 8, 3, padding=2, dilation=2), (1, 8, 12, 12)),
    ("batch4_3x3", lambda: nn.Conv2d(4, 8, 3, padding=1), (4, 4, 10, 10)),
    ("batch3_depthwise", lambda: nn.Conv2d(8, 8, 3, padding=1, groups=8), (3, 8, 9, 9)),
    ("conv1d_stem", lambda: nn.Conv1d(1, 32, 80, stride=16), (1, 1, 4000)),
    ("conv1d_k3", lambda: nn.Conv1d(32, 64, 3), (1, 32, 14)),
    ("conv1d_batch2_nobias", lambda: nn.Conv1d(8, 8, 5, padding=2, bias=False), (2, 8, 30)),
    ("conv1d_depthwise", lambda: nn.Conv1d(16, 16, 3, padding=1, groups=16), (1, 16, 20)),
]


def inputs(shape, i):
    return (torch.randn(shape, generator=torch.Generator().manual_seed(i)),)


def test_out_op_is_registered():
    assert "kernel" in str(OUT._schema)


@pytest.mark.parametrize("name,make,shape", CASES, ids=[c[0] for c in CASES])
def test_bitwise_and_recorded_choice(name, make, shape):
    torch.manual_seed(0)
    model = Conv(make()).eval()
    with torch.no_grad():
        step = capture(model, inputs(shape, 0))
        for i in range(4):
            x = inputs(shape, i)
            assert_bitwise(step(*x), model(*x))
        assert step.stats()["replays"] >= 2, step.stats()
        x = inputs(shape, 7)
        (row,) = conv_rows(step, x)
        conv = model.conv
        w, b = conv.weight, conv.bias
        eager = conv(x[0])
        kind, note = row["kind"], row["note"]
        if kind.startswith("checked conv"):
            kernel = re.match(r"checked conv \((\w+)\)", kind).group(1)
            assert kernel in KERNELS
            assert row["op"] == "torchreplay::convolution.out"
            assert note.startswith(f"{kernel} ") and f"bitwise on {3 if b is None else 4} inputs" in note, note
            # the test's own run of that kernel on this input gives eager's bits too
            out = torch.empty_like(eager)
            OUT(x[0], w, b, list(conv.stride), list(conv.padding), list(conv.dilation), False,
                [0] * len(conv.stride), conv.groups, kernel, out=out)
            assert_bitwise(out, eager)
        else:
            assert kind == "functional" and row["op"] == "aten::convolution", row
            assert note.startswith("torchreplay::convolution.out refused: "), note
        # every kernel the note says was exact on the recorded input is exact here too; every
        # kernel it says wrote other bits on the recorded input does so on that input
        recorded = inputs(shape, 0)[0]
        for kernel in KERNELS:
            said = re.search(r"(?<![\w])" + kernel +
                             r"(?: [\d.]+ us, bitwise|: exact|: other bits than eager's on the recorded input)", note)
            if said is None:
                continue
            out = torch.empty_like(eager)
            OUT(recorded, w, b, list(conv.stride), list(conv.padding), list(conv.dilation), False,
                [0] * len(conv.stride), conv.groups, kernel, out=out)
            want = conv(recorded)
            same = torch.equal(out.view(torch.int32), want.view(torch.int32))
            assert same == ("other bits" not in said.group(0)), (kernel, note)


def test_slow_conv2d_only_where_eager_uses_it():
    """slow_conv2d is eager's Slow2d kernel: taken for no node whose backend eager picks otherwise."""
    for name, make, shape in CASES:
        torch.manual_seed(0)
        model = Conv(make()).eval()
        x = inputs(shape, 0)
        c = model.conv
        backend = str(torch._C._select_conv_backend(x[0], c.weight, c.bias, list(c.stride), list(c.padding),
                                                    list(c.dilation), False, [0] * len(c.stride), c.groups, None))
        with torch.no_grad():
            (row,) = conv_rows(capture(model, x), x)
        if row["kind"] == "checked conv (slow_conv2d)":
            assert backend.endswith("Slow2d"), (name, backend)
        if not backend.endswith("Slow2d"):
            assert f"slow_conv2d: eager's backend is {backend.split('.')[-1]}" in row["note"], (name, row["note"])


def test_a_model_of_convolutions_replays_bitwise():
    """Convolutions, batch norms and activations as the zoo's CNNs chain them, channels-last input too."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(16), nn.Hardswish(),
        nn.Conv2d(16, 16, 3, padding=1, groups=16, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 24, 1, bias=False), nn.BatchNorm2d(24),
        nn.Conv2d(24, 24, 5, stride=2, padding=2, groups=24), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Conv2d(24, 8, 1), nn.ReLU(), nn.Conv2d(8, 24, 1), nn.Hardsigmoid(),
    ).eval()
    for memory_format in (torch.contiguous_format, torch.channels_last):
        def make(i):
            return inputs((2, 3, 24, 24), i)[0].contiguous(memory_format=memory_format)
        with torch.no_grad():
            step = capture(model, (make(0),))
            for i in range(4):
                assert_bitwise(step(make(i)), model(make(i)))
            assert step.stats()["replays"] >= 2
            rows = conv_rows(step, (make(5),))
        assert len(rows) == 6
        for r in rows:
            assert r["note"], r


def test_weight_changed_in_place_is_seen():
    """A packed weight follows in-place writes of the weight (load_state_dict, no_grad updates)."""
    torch.manual_seed(0)
    model = Conv(nn.Conv2d(16, 16, 3, padding=1, groups=16)).eval()
    x = inputs((1, 16, 12, 12), 0)
    with torch.no_grad():
        step = capture(model, x)
        for _ in range(3):
            assert_bitwise(step(*x), model(*x))
        model.conv.weight.mul_(-1.5)
        assert_bitwise(step(*x), model(*x))
        model.load_state_dict({k: torch.randn_like(v) for k, v in model.state_dict().items()})
        for i in range(3):
            assert_bitwise(step(*inputs((1, 16, 12, 12), i)), model(*inputs((1, 16, 12, 12), i)))
        version = model.conv.weight._version
        model.conv.weight.data.mul_(0.5)  # (its version counter does not move: fused optimizers alike)
        assert model.conv.weight._version == version
        assert_bitwise(step(*x), model(*x))
        assert step.stats()["replays"] >= 6


@pytest.mark.parametrize("channels_last", [False, True])
def test_nans_in_the_input_and_a_bias_written_later_keep_eagers_nan(channels_last):
    """Where an input's NaN meets a bias's NaN of the other sign, eager's sum keeps one of them;
    the checked kernel keeps the same one (the check's round with a bias of NaNs), also for a bias
    that turned NaN after the capture."""
    torch.manual_seed(0)
    model = Conv(nn.Conv2d(16, 16, 3, padding=1, groups=16)).eval()
    x = torch.randn(1, 16, 12, 12)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        step = capture(model, (x,))
        for _ in range(3):
            assert_bitwise(step(x), model(x))
        model.conv.bias[::2] = -float("nan")
        x = x.clone()
        x[0, :, 5, 5] = float("nan")
        got, want = step(x), model(x)
        assert want.isnan().any() and want.view(torch.int32).lt(0).any() and want.view(torch.int32).gt(0).any()
        assert_bitwise(got, want)
    assert step.stats()["replays"] == 3, step.stats()  # every call after the first


def test_switched_off(monkeypatch):
    monkeypatch.setenv("TORCHREPLAY_CHECKED_CONV", "0")
    torch.manual_seed(0)
    model = Conv(nn.Conv2d(8, 8, 3, padding=1)).eval()
    x = inputs((1, 8, 16, 16), 0)
    with torch.no_grad():
        step = capture(model, x)
        for _ in range(3):
            assert_bitwise(step(*x), model(*x))
        (row,) = conv_rows(step, x)
    assert row["kind"] == "functional" and row["note"] == ""


def test_dump_names_each_kernel(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=2, dilation=2)).eval()
    config = torchreplay.CompilerConfig()
    config.mode = "reduce-overhead"
    config.debug.graph_dump.type = "txt"
    config.debug.graph_dump.path = str(tmp_path)
    x = inputs((1, 3, 10, 10), 0)
    with torch.no_grad():
        step = torchreplay.capture(model, x, config=config)
        for _ in range(3):
            step(*x)
    (dump,) = [p for p in os.listdir(tmp_path) if p.endswith(".key0.txt")]
    lines = [ln for ln in open(tmp_path / dump) if "convolution" in ln]
    assert len(lines) == 2, lines
    for ln in lines:
        assert (any(f"torchreplay::convolution.out {k} ({k} " in ln for k in KERNELS) or
                "functional (torchreplay::convolution.out refused: " in ln), ln
    # the dilated one: eager's backend is SlowDilated2d, which no checked kernel replaces by slow_conv2d
    assert "slow_conv2d: eager's backend is SlowDilated2d" in lines[1], lines[1]



@pytest.mark.parametrize("shape,k,stride,pad,dil", [
    ((1, 16, 48, 48), 3, 2, 1, 1), ((1, 88, 12, 12), 3, 1, 1, 1), ((2, 24, 11, 13), 5, 2, 2, 1),
    ((1, 576, 3, 3), 5, 1, 2, 1), ((1, 9, 20, 7), 3, 1, 2, 2), ((1, 40, 17, 33), 3, 3, 0, 1),
    ((1, 8, 1, 50), (1, 7), 1, (0, 3), 1), ((2, 32, 7, 7), 3, 1, 1, 1), ((1, 48, 9, 10), 3, 1, 1, 1),
    ((1, 60, 6, 6), 5, 1, 2, 1), ((1, 80, 5, 9), 3, 2, 1, 1)])
def test_depthwise_kernel_paths_agree(shape, k, stride, pad, dil):
    """Note [Depthwise convolutions]: every path of the direct kernel (row-vectorized, border
    lanes blended, channels-last, the channels-last walk of short rows; one thread or two) gives
    each element the same FMA chain, so the same bits; and the result is a convolution (close to
    F.conv2d)."""
    kh, kw = (k, k) if isinstance(k, int) else k
    ph, pw = (pad, pad) if isinstance(pad, int) else pad
    c = shape[1]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=g)
    x.view(-1)[::7] = -0.0
    w = torch.randn(c, 1, kh, kw, generator=g)
    b = torch.randn(c, generator=g)
    want = torch.nn.functional.conv2d(x, w, b, stride, (ph, pw), dil, c)
    for kernel in ("depthwise", "depthwise_bias_last"):
        results = []
        for memory_format in (torch.contiguous_format, torch.channels_last):
            for threads in (1, 2):
                before = torch.get_num_threads()
                torch.set_num_threads(threads)
                try:
                    out = torch.empty_like(want, memory_format=memory_format)
                    try:
                        OUT(x.contiguous(memory_format=memory_format), w, b, [stride, stride], [ph, pw], [dil, dil],
                            False, [0, 0], c, kernel, out=out)
                    except RuntimeError as e:
                        if "AVX2" in str(e):
                            pytest.skip("no AVX2 and FMA on this CPU")
                        raise
                finally:
                    torch.set_num_threads(before)
                results.append(out.contiguous())
        for r in results[1:]:
            assert_bitwise(r, results[0], kernel)
        torch.testing.assert_close(results[0], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("c", [8, 24, 88])
def test_depthwise_walks_keep_one_nan_where_an_input_nan_meets_a_weight_nan(c):
    """Note [Depthwise convolutions]: where a NaN input meets a NaN weight in one tap, every walk
    (channels-first, channels-last in blocks full or cut short by the row's end or by the
    threads' split) keeps the same NaN, payload and all."""
    nan = lambda payload: torch.tensor([payload], dtype=torch.int32).view(torch.float32)[0]  # noqa: E731
    x = torch.ones(1, c, 61, 62)
    x[:, :, 30, 24] = nan(0x7FC00001)
    x[:, :, 5, 61] = nan(0x7FC00005)
    w = torch.full((c, 1, 1, 2), 0.5)
    w[..., 0] = nan(0x7FC00003)
    hwc = w.reshape(c, 1, 2).permute(1, 2, 0).contiguous()
    results = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for memory_format in (torch.contiguous_format, torch.channels_last):
                for width in (62, 9):  # the row's end cuts the last block short
                    try:
                        out = torch.ops.torchreplay.depthwise_conv2d(
                            x[..., :width].contiguous(memory_format=memory_format), w, hwc, None, [1, 1], [0, 0],
                            [1, 1], "none")
                    except RuntimeError as e:
                        if "AVX2" in str(e):
                            pytest.skip("no AVX2 and FMA on this CPU")
                        raise
                    results.append((width, out.contiguous()))
    finally:
        torch.set_num_threads(before)
    for width in (62, 9):
        outs = [r for w_, r in results if w_ == width]
        for r in outs[1:]:
            assert_bitwise(r, outs[0], f"width {width}")
    assert_bitwise(results[1][1][..., :8].contiguous(), results[0][1][..., :8].contiguous(), "a block cut short")
    assert bool(results[0][1][:, :, 30, 24].isnan().all()) and bool(results[0][1][:, :, 5, 60].isnan().all())


@pytest.mark.parametrize("post_op,eager", [("relu", torch.relu), ("hardswish", torch.nn.functional.hardswish),
                                           ("hardsigmoid", torch.nn.functional.hardsigmoid)])
@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
def test_depthwise_post_op_keeps_nans_as_eager(post_op, eager, memory_format):
    """Numerics "close"'s depthwise kernel with its post-op fused: a NaN in the input stays NaN in
    every output it reaches, as eager's activation after the convolution keeps it (not 0),
    on each walk (channels-first, channels-last) and in the lanes past the last whole vector."""
    for c in (3, 20, 88):
        g = torch.Generator().manual_seed(c)
        x = torch.randn(1, c, 7, 7, generator=g)
        x[0, :, 3, 3] = float("nan")
        w, b = torch.randn(c, 1, 3, 3, generator=g), torch.randn(c, generator=g)
        hwc = w.view(c, 3, 3).permute(1, 2, 0).contiguous()
        try:
            got = torch.ops.torchreplay.depthwise_conv2d(x.contiguous(memory_format=memory_format), w, hwc, b,
                                                         [1, 1], [1, 1], [1, 1], post_op)
        except RuntimeError as e:
            if "AVX2" in str(e):
                pytest.skip("no AVX2 and FMA on this CPU")
            raise
        want = eager(torch.nn.functional.conv2d(x, w, b, 1, 1, 1, c))
        assert torch.equal(got.isnan(), want.isnan()), (c, int(got.isnan().sum()), int(want.isnan().sum()))
        assert int(want.isnan().sum()) == 9 * c  # the 3x3 outputs around the NaN, every channel
        torch.testing.assert_close(got.nan_to_num(), want.nan_to_num(), rtol=1e-5, atol=1e-5)
