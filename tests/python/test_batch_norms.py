"""Inference batch norms as channel affines (Note [Batch norm as a channel affine] in
capture/tape/fused/fused_kernels.cc): a float32 map's eval-mode batch norm replays as
torchreplay::batch_norm_terms and a channel affine the fused step computes with the ops after it,
bit for bit eager's (values and strides), for NCHW and channels-last maps, planes with and without
a vector tail, 1-d, 2-d and 3-d norms, with and without affine parameters, special values in the
map and in the parameters, statistics changed between calls, at 1 and 3 threads; through
torchreplay.capture, torch.compile and a loaded program."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchreplay
from configs import config
from differential import assert_bitwise
from test_conditions import threads as at_threads
from torchreplay.batch_norms import exact_here

NAN_A, NAN_B = 0x7FC01234, -0x3FFA99   # two quiet NaNs' bits, the second negative


class Block(nn.Module):
    """conv -> batch norm -> activation, and a second batch norm into a residual add."""

    def __init__(self, dims=2, channels=16, act="silu", affine=True):
        super().__init__()
        conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dims]
        norm = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}[dims]
        self.conv = conv(3, channels, 3, padding=1)
        self.bn, self.bn2 = norm(channels, affine=affine), norm(channels, affine=affine)
        self.act = {"silu": F.silu, "relu": F.relu, "none": lambda y: y}[act]
        g = torch.Generator().manual_seed(dims * 7 + channels)
        for bn in (self.bn, self.bn2):
            bn.running_mean.copy_(torch.randn(channels, generator=g))
            bn.running_var.copy_(torch.rand(channels, generator=g) * 2 + 0.1)
            if affine:
                bn.weight.data.copy_(torch.randn(channels, generator=g))
                bn.bias.data.copy_(torch.randn(channels, generator=g))

    def forward(self, x):
        y = self.act(self.bn(self.conv(x)))
        return self.bn2(y) + y


def capture(model, args):
    return torchreplay.capture(model, args, config=config())


def affine_steps(step, args):
    return [r["op"] for r in step.profile(*args, iterations=2) if "channel affine" in r["op"]]


def with_specials(x):
    """x with NaNs of two payloads, infinities, signed zeros, a subnormal and huge values."""
    y = x.contiguous().clone()
    bits = y.view(-1).view(torch.int32)
    values = [NAN_A, NAN_B, float("inf"), float("-inf"), 0.0, -0.0, 1e-40, 3e38, -3e38]
    for k, v in enumerate(values):
        bits[k * 7] = v if isinstance(v, int) else torch.tensor([v]).view(torch.int32).item()
    return torch.empty_like(x).copy_(y)  # x's layout


# (dims, input shape, channels last): planes with and without a vector tail, long rows
SHAPES = [
    (2, (2, 3, 37, 41), False),
    (2, (1, 3, 16, 16), False),
    (2, (2, 3, 37, 41), True),
    (2, (1, 3, 128, 130), False),    # past the grain: cut over threads as eager cuts it
    (1, (2, 3, 301), False),
    (3, (1, 3, 5, 6, 7), False),
    (3, (1, 3, 5, 6, 7), True),
]


def _input(shape, channels_last, seed):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)
    return x


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
                    reason="the rewrite needs a CPU with AVX2 and FMA")
def test_torch_s_batch_norm_is_the_fma_torchreplay_computes():
    """torch 2.11's CPU build contracts its batch norm's multiply-adds (Note [Batch norm as a
    channel affine]): the check every rewrite waits on passes, so the tests below run the rewrite."""
    assert exact_here()


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("act", ["silu", "relu", "none"])
@pytest.mark.parametrize("case", SHAPES, ids=lambda c: f"{'x'.join(map(str, c[1]))}{'_cl' if c[2] else ''}")
def test_batch_norm_replays_eager_bits(case, act, threads):
    dims, shape, channels_last = case
    model = Block(dims, 16 if dims != 3 else 5, act).eval()
    if channels_last:
        model = model.to(memory_format=torch.channels_last if dims == 2 else torch.channels_last_3d)
    with at_threads(threads), torch.no_grad():
        step = capture(model, (_input(shape, channels_last, 0),))
        for seed in range(3):
            x = _input(shape, channels_last, seed)
            assert_bitwise(step(x), model(x), f"seed {seed}")
        with at_threads(1 if threads > 1 else 2):  # the thread count changed after the capture
            assert_bitwise(step(x), model(x), "threads changed")
        if exact_here():
            assert len(affine_steps(step, (x,))) == 2
        assert step.stats()["replays"] >= 2


@pytest.mark.parametrize("affine", [True, False])
def test_special_values_in_the_map_and_the_parameters(affine):
    """NaNs of other payloads meeting in one element (the map's and a parameter's), infinities,
    zero variances: eager's bits, which NaN's payload included."""
    model = Block(2, 8, "silu", affine).eval()
    for bn in (model.bn, model.bn2):
        bn.running_var[0], bn.running_var[1] = 0.0, float("nan")
        bn.running_mean[2] = float("inf")
        if affine:
            bn.weight.data[3:5] = torch.tensor([NAN_A, NAN_B], dtype=torch.int32).view(torch.float32)
            bn.bias.data[5] = torch.tensor([NAN_B], dtype=torch.int32).view(torch.float32)
            bn.bias.data[6] = -0.0
    for channels_last in (False, True):
        m = model.to(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
        with torch.no_grad():
            # the NaNs of the map reach the batch norm through the convolution: a map of its own
            norm = nn.Sequential(m.bn, nn.SiLU())
            x = with_specials(_input((2, 8, 9, 11), channels_last, 0))
            step = capture(norm, (x,))
            for seed in range(3):
                x = with_specials(_input((2, 8, 9, 11), channels_last, seed))
                assert_bitwise(step(x), norm(x), f"channels_last={channels_last} seed {seed}")
            if exact_here():
                assert affine_steps(step, (x,)) == ["fused: channel affine silu"]
            assert step.stats()["replays"] >= 2


def test_statistics_changed_between_calls_are_seen():
    """The terms are computed per call: running statistics and parameters written in place (a
    fine-tuning step, load_state_dict) change the next replay as they change eager's result."""
    model = Block(2, 8).eval()
    x = _input((1, 3, 20, 20), False, 0)
    with torch.no_grad():
        step = capture(model, (x,))
        assert_bitwise(step(x), model(x))
        model.bn.running_var.mul_(3.0)
        model.bn.running_mean.add_(0.5)
        model.bn2.weight.data.neg_()
        assert_bitwise(step(x), model(x), "after the statistics changed")
        model.load_state_dict(Block(2, 8).state_dict())
        assert_bitwise(step(x), model(x), "after load_state_dict")
        assert step.stats()["replays"] >= 2


def test_a_training_batch_norm_keeps_eager_s_op():
    """Training-mode batch norms compute their statistics: not rewritten, eager's bits and running
    statistics."""
    model, ref = Block(2, 8).train(), Block(2, 8).train()
    ref.load_state_dict(model.state_dict())
    step = capture(model, (_input((2, 3, 12, 12), False, 0),))
    for seed in range(3):
        x = _input((2, 3, 12, 12), False, seed)
        with torch.no_grad():
            assert_bitwise(step(x), ref(x), f"seed {seed}")
    assert_bitwise(model.bn.running_var, ref.bn.running_var, "running_var")
    assert step.stats()["replays"] >= 2
    assert affine_steps(step, (x,)) == []


def test_batch_norm_through_torch_compile_replays_bitwise():
    exact_here.cache_clear()  # the check then runs inside the backend, under its fake mode
    model = Block(2, 16).eval()
    compiled = torch.compile(model, backend="torchreplay", mode="reduce-overhead")
    seen = {s["name"] for s in torchreplay.stats()}
    with torch.no_grad():
        for seed in range(4):
            x = _input((2, 3, 23, 29), False, seed)
            assert_bitwise(compiled(x), model(x), f"seed {seed}")
    assert sum(s["replays"] for s in torchreplay.stats() if s["name"] not in seen) >= 2


def test_a_training_step_through_an_eval_batch_norm_keeps_eager_s_gradients():
    """A frozen batch norm in a compiled training step (fine-tuning with the statistics kept): the
    loss and the gradients as eager computes them (the step is one graph: docs/guide.md)."""
    model, ref = Block(2, 8).eval(), Block(2, 8).eval()
    ref.load_state_dict(model.state_dict())

    def step(m, x):
        loss = m(x).square().mean()
        loss.backward()
        return loss

    compiled = torch.compile(step, backend="torchreplay", mode="reduce-overhead")
    seen = {s["name"] for s in torchreplay.stats()}
    for seed in range(4):
        x = _input((1, 3, 14, 14), False, seed)
        assert_bitwise(compiled(model, x), step(ref, x), f"loss, seed {seed}")
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_bitwise(p.grad, q.grad, name)
    assert sum(s["replays"] for s in torchreplay.stats() if s["name"] not in seen) >= 2


def test_a_loaded_program_replays_the_same_bits(tmp_path):
    model = Block(2, 16).eval()
    x = _input((1, 3, 30, 31), False, 0)
    with torch.no_grad():
        torchreplay.save(capture(model, (x,)), tmp_path / "bn.trp")
        program = torchreplay.load(tmp_path / "bn.trp")
        for seed in range(3):
            x = _input((1, 3, 30, 31), False, seed)
            assert_bitwise(program(x)[0], model(x), f"seed {seed}")
        assert program.stats()["replays"] >= 2


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512",
                    reason="the AVX2 copy is the one this CPU runs already")
def test_the_avx2_copy_replays_the_same_bits():
    """The kernel's AVX2 copy, which CPUs without AVX-512 run: this file's differential cases at one
    thread in a process whose ATen runs its AVX2 kernels (ATEN_CPU_CAPABILITY=avx2)."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                          "(replays_eager_bits and silu and 1-) or special_values"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and " passed" in run.stdout and "skipped" not in run.stdout.splitlines()[-1], \
        run.stdout[-3000:] + run.stderr[-3000:]


# Maps dense in memory whose size-1 dims have other strides than their format's own: eager's
# result is made in the map's format (batch_norm_cpu), not with the map's strides.
ODD_STRIDES = [
    lambda: torch.rand(8, 8, 3).permute(2, 0, 1).unsqueeze(0),           # one HWC image as NCHW
    lambda: torch.randn(245).as_strided((1, 5, 7, 7), (1, 49, 7, 1)),
    lambda: torch.randn(98).as_strided((2, 1, 7, 7), (49, 1, 7, 1)),
    lambda: torch.randn(70).as_strided((2, 5, 1, 7), (35, 1, 1, 5)),     # channels last, H of 1
]


@pytest.mark.parametrize("entry", ["capture", "compile"])
@pytest.mark.parametrize("make", ODD_STRIDES, ids=["hwc_image", "batch_stride", "one_channel", "cl_one_row"])
def test_the_result_has_eager_s_strides_where_the_map_s_are_odd(make, entry):
    x = make()
    model = nn.BatchNorm2d(x.shape[1]).eval()
    model.running_var.uniform_(0.5, 2)
    step = capture(model, (x,)) if entry == "capture" else \
        torch.compile(model, backend="torchreplay", mode="reduce-overhead")
    seen = {s["name"] for s in torchreplay.stats()}
    with torch.no_grad():
        for _ in range(3):
            assert_bitwise(step(x), model(x))
    if entry == "capture":
        assert step.stats()["replays"] >= 2
    else:
        assert sum(s["replays"] for s in torchreplay.stats() if s["name"] not in seen) >= 2


def test_parameters_swapped_for_strided_views_run_eager_s_kernel():
    """Eager's dense kernel takes dense parameters only; a strided view swapped in after the capture
    makes eager compute another formula, and the replay computes that one too."""
    model = nn.Sequential(nn.BatchNorm2d(4), nn.SiLU()).eval()
    x = torch.randn(2, 4, 6, 6)
    with torch.no_grad():
        step = capture(model, (x,))
        assert_bitwise(step(x), model(x))
        model[0].weight.data = torch.randn(8)[::2]
        for call in range(3):
            assert_bitwise(step(x), model(x), f"a strided weight, call {call}")
        model[0].running_var.data = (torch.rand(8) + 1)[::2]
        for call in range(3):
            assert_bitwise(step(x), model(x), f"a strided running_var, call {call}")
        assert step.stats()["replays"] >= 2


def test_the_check_holds_under_another_default_dtype():
    """The check made once per process builds its own float32 tensors: a float64 default dtype
    (set for the rest of a program) neither breaks it nor changes its answer."""
    before = exact_here()
    exact_here.cache_clear()
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        model = Block(2, 8).float().eval()
        x = _input((1, 3, 12, 12), False, 0).float()
        with torch.no_grad():
            step = capture(model, (x,))
            for seed in range(3):
                x = _input((1, 3, 12, 12), False, seed).float()
                assert_bitwise(step(x), model(x), f"seed {seed}")
            assert step.stats()["replays"] >= 2
        assert exact_here() == before
    finally:
        torch.set_default_dtype(old)


def test_a_loaded_program_under_another_capability_runs_eager_s_kernel(tmp_path):
    """ATen's kernels for ATEN_CPU_CAPABILITY=default are compiled without fmas: a program saved
    where the rewrite holds and loaded in such a process computes its batch norms with eager's
    kernel there (the check made at capture does not run for a loaded program)."""
    import os
    import subprocess
    import sys
    model = Block(2, 8).eval()
    x = _input((2, 3, 9, 13), False, 0) * 5
    with torch.no_grad():
        torchreplay.save(capture(model, (x,)), tmp_path / "bn.trp")
    torch.save({"model": model.state_dict(), "x": x}, tmp_path / "inputs.pt")
    script = f"""
import sys, torch
sys.path[:0] = {[os.path.dirname(__file__)]!r}
import torchreplay
from test_batch_norms import Block
from differential import assert_bitwise
saved = torch.load({str(tmp_path / "inputs.pt")!r})
model = Block(2, 8).eval()
model.load_state_dict(saved["model"])
program = torchreplay.load({str(tmp_path / "bn.trp")!r})
with torch.no_grad():
    for _ in range(3):
        assert_bitwise(program(saved["x"])[0], model(saved["x"]))
    assert program.stats()["replays"] >= 2, program.stats()
print(torch.backends.cpu.get_cpu_capability(), "bitwise")
"""
    run = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, ATEN_CPU_CAPABILITY="default"),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("DEFAULT bitwise"), run.stdout[-2000:] + run.stderr[-3000:]
