"""LSTMs on the CPU tape through oneDNN on weights reordered once, checked per node at capture
(Note [Checked LSTMs] in capture/tape/checked/lstm_steps.h): replays bitwise equal to eager, and what the capture
recorded per node agrees with a measurement the test makes itself.

Whether the kernel is exact and faster depends on the CPU, so no test requires it to be taken:
each case checks that the graph replayed with eager's bits, and that the profile's kind and note
agree with the op run by the test on the same input."""
import re

import pytest
import torch
import torch.nn as nn

import torchreplay
from differential import assert_bitwise

OUT = torch.ops.torchreplay.lstm.out


def config():
    c = torchreplay.CompilerConfig()
    c.mode = "reduce-overhead"
    return c


CASES = {  # (module, input shape, with a state)
    "2 layers, one step": (lambda: nn.LSTM(32, 64, num_layers=2), (1, 1, 32), True),
    "one layer, 7 steps, batch 2": (lambda: nn.LSTM(16, 32), (7, 2, 16), False),
    "batch_first": (lambda: nn.LSTM(48, 96, batch_first=True), (4, 16, 48), False),
    "bidirectional, 2 layers": (lambda: nn.LSTM(16, 20, num_layers=2, bidirectional=True), (6, 3, 16), True),
    "batch_first bidirectional": (lambda: nn.LSTM(16, 20, bidirectional=True, batch_first=True), (3, 5, 16), False),
    "no biases": (lambda: nn.LSTM(16, 20, bias=False), (6, 3, 16), True),
}


def make_args(model, shape, stateful, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    if not stateful:
        return (x,)
    layers = model.num_layers * (2 if model.bidirectional else 1)
    batch = shape[0] if model.batch_first else shape[1]
    return (x, (torch.randn(layers, batch, model.hidden_size, generator=g),
                torch.randn(layers, batch, model.hidden_size, generator=g)))


def lstm_row(step, args):
    (row,) = [r for r in step.profile(*args, iterations=2) if "lstm" in r["op"]]
    return row


def run_out(model, args):
    """The op the step runs, called by the test: (output, hy, cy) into fresh buffers."""
    x = args[0]
    state = args[1] if len(args) > 1 else None
    want = model(*args)
    h, c = state if state is not None else (torch.zeros_like(want[1][0]), torch.zeros_like(want[1][1]))
    out = (torch.empty_like(want[0]), torch.empty_like(want[1][0]), torch.empty_like(want[1][1]))
    OUT(x, [h, c], model._flat_weights, model.bias, model.num_layers, float(model.dropout), model.training,
        model.bidirectional, model.batch_first, "onednn_prepacked", output=out[0], hy=out[1], cy=out[2])
    return out, (want[0], want[1][0], want[1][1])


@pytest.mark.parametrize("name", list(CASES))
def test_bitwise_and_recorded_choice(name):
    make, shape, stateful = CASES[name]
    torch.manual_seed(0)
    model = make().eval()
    with torch.no_grad():
        step = torchreplay.capture(model, make_args(model, shape, stateful, 0), config=config())
        for i in range(4):
            args = make_args(model, shape, stateful, i)
            assert_bitwise(step(*args), model(*args), f"call {i}")
        assert step.stats()["replays"] >= 2, step.stats()
        args = make_args(model, shape, stateful, 7)
        row = lstm_row(step, args)
        if row["kind"] == "checked lstm (onednn_prepacked)":
            assert row["op"] == "torchreplay::lstm.out"
            assert row["note"].startswith("onednn_prepacked ") and "bitwise on 3 inputs" in row["note"], row
            got, want = run_out(model, args)  # the test's own run of the op gives eager's bits too
            assert_bitwise(got, want)
        else:
            assert row["kind"] == "functional" and row["op"] == "torchreplay::eager_lstm.input", row
            # refused for its bits, or, exact, for its time against eager's op (timed at capture)
            assert re.match(r"torchreplay::lstm\.out refused: (eager's op [\d.]+ us; )?onednn_prepacked: ",
                            row["note"]), row


def test_projections_are_refused_and_stay_eagers():
    torch.manual_seed(0)
    model = nn.LSTM(16, 32, proj_size=8).eval()
    x = (torch.randn(6, 2, 16),)
    with torch.no_grad():
        step = torchreplay.capture(model, x, config=config())
        for _ in range(3):
            assert_bitwise(step(*x), model(*x))
        row = lstm_row(step, x)
    assert row["kind"] == "functional" and row["note"] == "torchreplay::lstm.out refused: projections (proj_size)"
    assert step.stats()["replays"] >= 2


@pytest.mark.parametrize("how", ["no_grad", "data", "adam_fused"])
def test_weights_written_after_capture_are_seen(how):
    """The reordered weights are copies: written in place (also through .data and a fused
    optimizer, which leave the version counter where it was), every later call is eager's bits."""
    torch.manual_seed(0)
    model = nn.LSTM(16, 24, num_layers=2).eval()
    x = (torch.randn(3, 2, 16),)
    with torch.no_grad():
        step = torchreplay.capture(model, x, config=config())
        assert_bitwise(step(*x), model(*x))
    for i in range(3):
        if how == "no_grad":
            with torch.no_grad():
                model.weight_hh_l1.mul_(0.75)
        elif how == "data":
            model.weight_ih_l0.data.mul_(-1.5)
        else:
            opt = torch.optim.Adam(model.parameters(), lr=0.1, fused=True)
            with torch.enable_grad():
                model.train()
                model(*x)[0].square().sum().backward()
                model.eval()
            opt.step()
            opt.zero_grad()
        with torch.no_grad():
            assert_bitwise(step(*x), model(*x), f"after write {i}")
    assert step.stats()["replays"] >= 3, step.stats()


def test_through_torch_compile_bitwise():
    """A one-step LSTM through torch.compile, whose parameters are baked into the capture: eager's
    bits, the graph's one node an out= step (the checked kernel) or eager's functional op."""
    torch.manual_seed(0)
    model = nn.LSTM(32, 64, num_layers=2).eval()
    backend = torchreplay.get_backend(compiler_config=config())
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        for i in range(4):
            args = make_args(model, (1, 1, 32), True, i)
            assert_bitwise(compiled(*args), model(*args), f"call {i}")
    (stats,) = backend.stats()
    assert stats["replays"] >= 2, stats
    (log,) = stats["capture_log"]
    assert log["steps"] == 1 and log["out_variant_steps"] + log["functional_steps"] == 1, log


def test_switched_off(monkeypatch):
    monkeypatch.setenv("TORCHREPLAY_CHECKED_LSTM", "0")
    torch.manual_seed(0)
    model = nn.LSTM(16, 20).eval()
    x = (torch.randn(2, 1, 16),)
    with torch.no_grad():
        step = torchreplay.capture(model, x, config=config())
        for _ in range(3):
            assert_bitwise(step(*x), model(*x))
        row = lstm_row(step, x)
    assert row["kind"] == "functional" and row["note"] == ""


def test_a_frozen_lstm_called_with_grad_mode_on_is_eagers():
    """Eager's oneDNN LSTM runs its training primitive whenever grad mode is on, even with nothing
    requiring grad, and its bits differ from the inference primitive's (Note [The caller's grad
    mode] in capture/ir/caller_grad.h): a frozen model called without no_grad replays those bits, and the
    same capture called under no_grad replays the other's."""
    torch.manual_seed(0)
    model = nn.LSTM(8, 12, num_layers=2).eval().requires_grad_(False)
    x = (torch.randn(5, 3, 8),)
    step = torchreplay.capture(model, x, config=config())
    for i in range(3):
        assert_bitwise(step(*x), model(*x), f"grad on, call {i}")
    with torch.no_grad():
        for i in range(3):
            assert_bitwise(step(*x), model(*x), f"no_grad, call {i}")
    for i in range(2):
        assert_bitwise(step(*x), model(*x), f"grad on again, call {i}")
    assert step.stats()["replays"] >= 5, step.stats()


def test_a_dispatch_mode_checking_arguments_sees_no_onednn_weights():
    """The layer calls run below Python dispatch modes: a user's mode that reads every argument
    (a NaN check) works around a replay as around eager's call."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class NanCheck(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            for a in tree_leaves((args, kwargs)):
                if isinstance(a, torch.Tensor) and a.is_floating_point():
                    assert not torch.isnan(a).any(), func
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model = nn.LSTM(8, 12).eval()
    x = (torch.randn(5, 3, 8),)
    with torch.no_grad():
        step = torchreplay.capture(model, x, config=config())
        for _ in range(3):
            step(*x)
        with NanCheck():
            got = step(*x)
        assert_bitwise(got, model(*x))
    assert step.stats()["replays"] >= 3, step.stats()  # the call under the mode replayed too
