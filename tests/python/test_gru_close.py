"""Numerics "close" on GRUs: each layer one call of torchreplay::gru_sequence (Note [GRU steps] in
capture/kernels/recurrent.h), within the stated tolerance of eager's nn.GRU, with eager's strides, replayed;
the op itself against eager's GRU; what is not fused stays decomposed and close."""
import pytest
import torch
import torch.nn as nn

from differential import assert_bitwise
from test_close_numerics import assert_within, assert_within_with_eagers_strides, capture


class GRUModel(nn.Module):
    def __init__(self, d, hidden, **kw):
        super().__init__()
        self.gru = nn.GRU(d, hidden, **kw)
        for p in self.gru.parameters():  # biases too: non-zero, of the weights' scale
            nn.init.uniform_(p, -0.5, 0.5)

    def forward(self, x, h=None):
        return self.gru(x, h)


def _layer0_weights(gru):
    """Layer 0's weights as torchreplay::gru_sequence takes them: transposed, and the biases."""
    w_ih, w_hh = gru.weight_ih_l0.detach(), gru.weight_hh_l0.detach()
    b_ih = gru.bias_ih_l0.detach() if gru.bias else None
    b_hh = gru.bias_hh_l0.detach() if gru.bias else None
    return w_ih.t().contiguous(), b_ih, w_hh.t().contiguous(), b_hh


@pytest.mark.parametrize("steps,batch,d,hidden,batch_first,bias", [
    (16, 1, 32, 64, True, True), (5, 3, 7, 13, False, True), (1, 1, 1, 8, False, False), (9, 2, 16, 20, True, False),
    (3, 4, 5, 8, False, True)])
def test_gru_sequence_op_is_eagers_gru_within_tolerance(steps, batch, d, hidden, batch_first, bias):
    torch.manual_seed(0)
    model = GRUModel(d, hidden, batch_first=batch_first, bias=bias).eval()
    x = torch.randn((batch, steps, d) if batch_first else (steps, batch, d))
    h0 = torch.randn(1, batch, hidden)
    with torch.no_grad():
        want, want_h = model(x, h0)
        w_ih_kn, b_ih, w_hh_kn, b_hh = _layer0_weights(model.gru)
        got, got_h = torch.ops.torchreplay.gru_sequence(x, h0[0], w_ih_kn, b_ih, w_hh_kn, b_hh, batch_first)
        assert got.stride() == want.stride() and got.shape == want.shape
        assert_within((got, got_h), (want, want_h[0]))
        # the out= overload into strided buffers (the tape's planned ones), the same values
        out = torch.full((want.shape[0], want.shape[1], 2 * hidden), float("nan"))[..., ::2]
        h_n = torch.empty(batch, hidden)
        torch.ops.torchreplay.gru_sequence.out(x, h0[0], w_ih_kn, b_ih, w_hh_kn, b_hh, batch_first, out=out, h_n=h_n)
        assert_bitwise(out.contiguous(), got.contiguous(), strides=False)
        assert_bitwise(h_n, got_h)


def test_gru_sequence_op_bad_arguments():
    x, h, w_ih, w_hh = torch.randn(4, 1, 8), torch.randn(1, 16), torch.randn(8, 48), torch.randn(16, 48)
    op = torch.ops.torchreplay.gru_sequence
    with pytest.raises(RuntimeError, match="sizes do not agree"):
        op(x, h, torch.randn(9, 48), None, w_hh, None, False)
    with pytest.raises(RuntimeError, match="float32"):
        op(x.double(), h.double(), w_ih.double(), None, w_hh.double(), None, False)
    with pytest.raises(RuntimeError, match="bias is float32"):
        op(x, h, w_ih, torch.randn(47), w_hh, None, False)
    with pytest.raises(RuntimeError, match="out is float32"):
        op.out(x, h, w_ih, None, w_hh, None, False, out=torch.empty(4, 1, 15), h_n=torch.empty(1, 16))


@pytest.mark.parametrize("layers,batch,batch_first,bias", [(1, 1, True, True), (2, 1, False, True),
                                                            (1, 3, False, False), (2, 2, True, True)])
def test_gru_captured_close_is_one_call_a_layer(layers, batch, batch_first, bias):
    torch.manual_seed(0)
    model = GRUModel(12, 24, num_layers=layers, batch_first=batch_first, bias=bias).eval()

    def make(i):
        g = torch.Generator().manual_seed(i)
        return (torch.randn((batch, 10, 12) if batch_first else (10, batch, 12), generator=g),
                torch.randn(layers, batch, 24, generator=g))
    with torch.no_grad():
        step = capture(model, make(0), "close")
        assert step.numerics["rewrites"]["grus_fused"] == 1, step.numerics
        assert_within_with_eagers_strides(step, model, make)
        rows = [r for r in step.profile(*make(0), iterations=1) if "gru" in r["op"]]
    assert [r["op"] for r in rows] == ["torchreplay::gru_sequence.out"] * layers, rows


def test_gru_not_fused_stays_close():
    """A bidirectional GRU is not one the op runs: decomposed, as before, and close."""
    torch.manual_seed(0)
    model = GRUModel(8, 16, bidirectional=True).eval()
    make = lambda i: (torch.randn(6, 1, 8, generator=torch.Generator().manual_seed(i)),)  # noqa: E731
    with torch.no_grad():
        step = capture(model, make(0), "close")
        assert step.numerics["rewrites"]["grus_fused"] == 0, step.numerics
        assert_within_with_eagers_strides(step, model, make)


def test_gru_weight_written_after_capture_raises():
    torch.manual_seed(0)
    model = GRUModel(8, 16).eval()
    x = (torch.randn(6, 1, 8),)
    with torch.no_grad():
        step = capture(model, x, "close")
        assert step.numerics["rewrites"]["grus_fused"] == 1
        step(*x)
        model.gru.weight_hh_l0.mul_(2)
        with pytest.raises(RuntimeError, match=r"'gru\.weight_hh_l0' was written after the capture"):
            step(*x)
