"""config.reduce_overhead.numerics = "close" (Note [Close numerics] in
bindings/torchreplay/close_numerics.py): the rewritten graph replays with results within the
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


@pytest.mark.parametrize("name", ["mobilenet_v3_small_96", "convnet", "audio_conv1d", "lstm_step"])
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
    if name == "lstm_step":  # through its decomposition, not oneDNN's RNN layer
        assert not any("lstm" in op or "rnn" in op for op in ops), ops
        assert "aten::addmm.out" in ops
    else:
        assert rewrites["batch_norms_folded"] > 0, rewrites
        assert "aten::_native_batch_norm_legit_no_training" not in ops, ops
        convs = sum(rewrites[k] for k in ("convolutions_onednn", "convolutions_gemm", "convolutions_depthwise",
                                          "convolutions_eager"))
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
        for i in range(4):
            x = make(i)
            got, want = step(*x), model(*x)
            assert_within(got, want)
            assert [t.stride() for t in got] == [t.stride() for t in want]
        assert step.stats()["replays"] >= 2


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
