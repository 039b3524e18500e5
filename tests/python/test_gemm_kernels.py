"""Matrix products on the CPU tape through the small GEMM, checked per node at capture (Note
[Checked GEMMs] in capture/tape/checked/gemm_steps.h): replays bitwise equal to eager, and the kernel each node
took is the one its recorded measurement supports.

Which shapes the small GEMM is exact for depends on the CPU's BLAS, so no test names one: each
case checks that the graph replayed with eager's bits, and that what the capture recorded per node
(the profile's kind and note) agrees with a measurement the test makes itself. The kernels' own
arithmetic (one chain of multiply-adds per element, the bias first or last) is checked directly,
against the small GEMM of numerics "close" and against the sum plus the bias."""
import re

import pytest
import torch
import torch.nn as nn

import torchreplay
from configs import backend
from differential import assert_bitwise

ADDMM = torch.ops.torchreplay.addmm.out
MM = torch.ops.torchreplay.mm.out
READS = ("small_gemm", "small_gemm_packed", "small_gemm_panels")
KERNELS = READS + tuple(r + "_bias_last" for r in READS)


def capture(model, args):
    config = torchreplay.CompilerConfig()
    config.mode = "reduce-overhead"
    return torchreplay.capture(model, args, config=config)


def gemm_rows(step, args):
    """The profile rows of the tape's matrix products, in graph order."""
    return [r for r in step.profile(*args, iterations=2)
            if r["op"] in ("aten::addmm.out", "aten::mm.out", "torchreplay::addmm.out", "torchreplay::mm.out")]


def seeded(shape, i):
    return torch.randn(shape, generator=torch.Generator().manual_seed(i))


def bits(t):
    return t.contiguous().view(torch.int32)


def test_out_ops_are_registered():
    assert "kernel" in str(ADDMM._schema) and "kernel" in str(MM._schema)


@pytest.mark.parametrize("m,k,n", [(1, 64, 192), (16, 64, 64), (5, 7, 13), (33, 300, 129), (4, 256, 200), (2, 1, 9)])
def test_kernels_compute_one_chain_from_the_bias_or_before_it(m, k, n):
    """Every read of the weight gives the same bits (in place, packed, panels; 1 and 2 threads);
    the bias first is numerics "close"'s small GEMM; the bias last is the sum from +0, then + bias."""
    x, w, bias = seeded((m, k), 1), seeded((n, k), 2), seeded((n,), 3)
    kn = w.t().contiguous()
    first = torch.ops.torchreplay.small_gemm(x, kn, bias, "none")
    from_zero = torch.ops.torchreplay.small_gemm(x, kn, torch.zeros(n), "none")
    last = from_zero + bias
    assert not torch.equal(bits(first), bits(last))  # the two orders differ on these inputs
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for kernel in KERNELS:
                mat2 = kn if kernel.startswith("small_gemm_bias") or kernel == "small_gemm" else w.t()
                out = torch.empty(m, n)
                ADDMM(bias, x, mat2, 1, 1, kernel, out=out)
                assert torch.equal(bits(out), bits(last if kernel.endswith("_bias_last") else first)), (kernel, t)
                if not kernel.endswith("_bias_last"):
                    MM(x, mat2, kernel, out=out)
                    assert torch.equal(bits(out), bits(from_zero)), (kernel, t)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(last, (x.double() @ kn.double() + bias.double()).float(), rtol=1e-5, atol=1e-5)


def test_bad_arguments_raise():
    x, w, bias = torch.randn(4, 8), torch.randn(8, 6), torch.randn(6)
    out = torch.empty(4, 6)
    with pytest.raises(RuntimeError, match="no kernel 'mkl'"):
        ADDMM(bias, x, w, 1, 1, "mkl", out=out)
    with pytest.raises(RuntimeError, match="beta and alpha are 1"):
        ADDMM(bias, x, w, 2, 1, "small_gemm", out=out)
    with pytest.raises(RuntimeError, match=r"\[M, K\] x \[K, N\]"):
        MM(x, torch.randn(7, 6), "small_gemm", out=out)
    with pytest.raises(RuntimeError, match="float32 CPU tensors, not Double"):
        MM(x.double(), w.double(), "small_gemm", out=out.double())
    with pytest.raises(RuntimeError, match="bias is float32"):
        ADDMM(torch.randn(5), x, w, 1, 1, "small_gemm", out=out)
    with pytest.raises(RuntimeError, match=r"mm\.out: 2-d matrices, not 1-d"):
        MM(torch.randn(8), w, "small_gemm", out=out)
    with pytest.raises(RuntimeError, match=r"mm\.out: no bias to add last"):
        MM(x, w, "small_gemm_bias_last", out=out)
    with pytest.raises(RuntimeError, match="share memory"):
        MM(x, w, "small_gemm", out=torch.empty(1, 6).expand(4, 6))
    with pytest.raises(RuntimeError, match="refer to a single memory location"):
        buf = torch.empty(4, 8)
        MM(buf, torch.randn(8, 8), "small_gemm", out=buf)


class Linear(nn.Module):
    def __init__(self, k, n, bias=True):
        super().__init__()
        self.fc = nn.Linear(k, n, bias=bias)
        if bias:
            nn.init.normal_(self.fc.bias)  # non-zero: a zero bias hides the order of the bias

    def forward(self, x):
        return self.fc(x)


class TimesParameter(nn.Module):
    """x @ W with W stored [K, N]: an mm reading its weight in place."""
    def __init__(self, k, n):
        super().__init__()
        self.w = nn.Parameter(torch.randn(k, n))

    def forward(self, x):
        return x @ self.w


class Product(nn.Module):
    """x @ y of two inputs: mat2 bound per call (no packed copy)."""
    def forward(self, x, y):
        return x @ y


# (name, module, input shapes)
CASES = [
    ("linear_16x64x64", lambda: Linear(64, 64), [(16, 64)]),
    ("linear_16x64x128", lambda: Linear(64, 128), [(16, 64)]),
    ("linear_gemv", lambda: Linear(64, 192), [(1, 64)]),
    ("linear_4x33x7", lambda: Linear(33, 7), [(4, 33)]),
    ("linear_no_bias", lambda: Linear(64, 48, bias=False), [(16, 64)]),
    ("linear_large_weight", lambda: Linear(256, 200), [(8, 256)]),
    ("linear_3d_input", lambda: Linear(32, 32), [(2, 8, 32)]),
    ("times_parameter", lambda: TimesParameter(64, 40), [(16, 64)]),
    ("product_of_inputs", lambda: Product(), [(12, 24), (24, 20)]),
]


def _inputs(shapes, i):
    return tuple(seeded(s, 10 * i + j) for j, s in enumerate(shapes))


def _own_run(kernel, args):
    """The test's own call of a kernel on a product's arguments."""
    out = torch.empty(args[-2].shape[0], args[-1].shape[1])
    if len(args) == 3:
        ADDMM(*args, 1, 1, kernel, out=out)
    else:
        MM(*args, kernel, out=out)
    return out


@pytest.mark.parametrize("name,make,shapes", CASES, ids=[c[0] for c in CASES])
def test_bitwise_and_recorded_choice(name, make, shapes):
    torch.manual_seed(0)
    model = make().eval()
    with torch.no_grad():
        step = capture(model, _inputs(shapes, 0))
        for i in range(4):
            x = _inputs(shapes, i)
            assert_bitwise(step(*x), model(*x))
        assert step.stats()["replays"] >= 2, step.stats()
        (row,) = gemm_rows(step, _inputs(shapes, 7))
    kind, note = row["kind"], row["note"]
    recorded = _inputs(shapes, 0)
    x2 = recorded[0].reshape(-1, recorded[0].shape[-1])
    if isinstance(model, Linear):
        w = model.fc.weight.detach().t()
        args = (model.fc.bias.detach(), x2, w) if model.fc.bias is not None else (x2, w)
    elif isinstance(model, TimesParameter):
        args = (x2, model.w.detach())
    else:
        args = recorded
    want = torch.addmm(*args) if len(args) == 3 else torch.mm(*args)
    if kind.startswith("checked gemm"):
        kernel = re.match(r"checked gemm \((\w+)\)", kind).group(1)
        assert kernel in KERNELS
        assert row["op"] in ("torchreplay::addmm.out", "torchreplay::mm.out"), row
        assert note.startswith(f"{kernel} ") and re.search(r"bitwise on [45] inputs", note), note
    else:
        assert kind == "typed out=" and row["op"] in ("aten::addmm.out", "aten::mm.out"), row
        assert re.match(r"torchreplay::(addmm|mm)\.out refused: ", note), note
    # every kernel the note says was exact (taken, or exact but slower) gives eager's bits on the
    # recorded input here too; every kernel it says wrote other bits on it does so here
    for kernel in KERNELS:
        said = re.search(r"(?<![\w])" + kernel +
                         r"(?: [\d.]+ us, bitwise|: exact|: other bits than eager's on the recorded input)", note)
        if said is None:
            continue
        same = torch.equal(bits(_own_run(kernel, args)), bits(want))
        assert same == ("other bits" not in said.group(0)), (kernel, note)
    if name == "product_of_inputs":  # mat2 bound per call: never a packed copy
        assert "small_gemm_packed: mat2 is computed or bound per call" in note or kind == "checked gemm (small_gemm)", note


def _replays_bitwise(model, first, later):
    """Captures `model` on `first`, calls it once there (the check runs on the first call), then
    on each of `later`: bitwise eager's, replayed."""
    with torch.no_grad():
        step = capture(model, first)
        assert_bitwise(step(*first), model(*first))
        for args in later:
            assert_bitwise(step(*args), model(*args))
        assert step.stats()["replays"] >= len(later)
    return step


def test_weight_changed_in_place_is_seen():
    """A packed copy follows in-place writes of the weight (load_state_dict, no_grad updates)."""
    torch.manual_seed(0)
    model = Linear(64, 64).eval()
    x = (seeded((16, 64), 0),)
    step = _replays_bitwise(model, x, [x, x])
    with torch.no_grad():
        model.fc.weight.mul_(-1.5)
        assert_bitwise(step(*x), model(*x))
        model.load_state_dict({k: torch.randn_like(v) for k, v in model.state_dict().items()})
        for i in range(3):
            assert_bitwise(step(*_inputs([(16, 64)], i)), model(*_inputs([(16, 64)], i)))
        assert step.stats()["replays"] >= 5


def test_through_torch_compile():
    """The compiled entry point's graphs take the same checked kernels and replay eager's bits."""
    torch.manual_seed(0)
    model = nn.Sequential(Linear(64, 128), nn.GELU(), Linear(128, 64)).eval()
    b = backend()
    compiled = torch.compile(model, backend=b)
    with torch.no_grad():
        for i in range(5):
            x = seeded((16, 64), i)
            assert_bitwise(compiled(x), model(x))
    assert sum(s["replays"] for s in b.stats()) >= 3, b.stats()


def test_switched_off(monkeypatch):
    monkeypatch.setenv("TORCHREPLAY_CHECKED_GEMM", "0")
    torch.manual_seed(0)
    model = Linear(64, 64).eval()
    x = (seeded((16, 64), 0),)
    step = _replays_bitwise(model, x, [x, x])
    with torch.no_grad():
        (row,) = gemm_rows(step, x)
    assert row["kind"] == "typed out=" and row["note"] == "", row


def test_one_k_keeps_eagers_negative_zeros():
    """Over one k eager's product is the plain multiply (0 * -w = -0.0); a sum from +0 is +0."""
    torch.manual_seed(0)
    model = Linear(1, 9, bias=False).eval()
    step = _replays_bitwise(model, (seeded((3, 1), 0),), [(torch.zeros(3, 1),), (-torch.zeros(3, 1),)])
    (row,) = gemm_rows(step, (seeded((3, 1), 1),))
    assert row["kind"] == "typed out=" and "K = 1" in row["note"], row


def test_nan_in_input_and_bias_keeps_eagers_payload():
    torch.manual_seed(0)
    model = Linear(8, 16).eval()
    x = seeded((16, 8), 0)
    with torch.no_grad():
        step = capture(model, (x,))
        step(x)
        model.fc.bias[0] = torch.tensor(0x7FC00004, dtype=torch.int32).view(torch.float32)
        y = x.clone()
        y[0, 0] = torch.tensor(0x7FC00003, dtype=torch.int32).view(torch.float32)
        for _ in range(2):
            assert_bitwise(step(y), model(y))
        assert step.stats()["replays"] >= 2, step.stats()


@pytest.mark.parametrize("how", ["adam_fused", "sgd_fused", "data"])
def test_weight_written_without_its_version_counter_is_seen(how):
    """Fused optimizers and writes through .data leave the version counter where it was: the
    packed copy follows the weight's bytes."""
    torch.manual_seed(0)
    model = Linear(33, 65).eval()
    x = (seeded((16, 33), 0),)
    with torch.no_grad():
        step = capture(model, x)
        assert_bitwise(step(*x), model(*x))
    version = model.fc.weight._version
    if how == "data":
        model.fc.weight.data.mul_(-2)
    else:
        opt = (torch.optim.Adam if how == "adam_fused" else torch.optim.SGD)(model.parameters(), lr=0.1, fused=True)
        model(*x).square().sum().backward()
        opt.step()
    assert model.fc.weight._version == version  # the premise: the counter did not move
    with torch.no_grad():
        for _ in range(2):
            assert_bitwise(step(*x), model(*x))
    assert step.stats()["replays"] >= 2, step.stats()


def test_weight_written_every_call_stays_bitwise():
    """A weight written before every call (training between evaluations): each call eager's bits,
    through the repacked copy at first and eager's op once repacking every call (Note [Checked GEMMs])."""
    torch.manual_seed(0)
    model = Linear(64, 64).eval()
    x = (seeded((16, 64), 0),)
    with torch.no_grad():
        step = capture(model, x)
        step(*x)
        for i in range(8):
            model.fc.weight.data.mul_(1.0 + i / 64)  # (by .data: the counter does not move)
            assert_bitwise(step(*x), model(*x))
        for _ in range(2):  # and fixed again
            assert_bitwise(step(*x), model(*x))
        assert step.stats()["replays"] >= 10, step.stats()


def test_training_steps_through_torch_compile_stay_bitwise():
    """A training step compiled with the backend: the forward's weights change every step (packed
    copies remade, then eager's op); the loss and the parameters step after step those of the same
    step compiled with aot_eager (eager's kernels on the same graph; a compiled optimizer's
    arithmetic is not eager's opt.step())."""
    torch.manual_seed(0)
    model = nn.Sequential(Linear(32, 64), nn.Tanh(), Linear(64, 16))
    twin = nn.Sequential(Linear(32, 64), nn.Tanh(), Linear(64, 16))
    twin.load_state_dict(model.state_dict())
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, twin)]
    b = backend()

    def step(m, opt, x):
        opt.zero_grad()
        loss = m(x).square().mean()
        loss.backward()
        opt.step()
        return loss.detach()

    compiled = torch.compile(step, backend=b)
    reference = torch.compile(step, backend="aot_eager")
    for i in range(8):
        x = seeded((16, 32), i)
        assert_bitwise(compiled(model, opts[0], x), reference(twin, opts[1], x))
        for p, q in zip(model.parameters(), twin.parameters()):
            assert_bitwise(p, q)
    assert sum(s["replays"] for s in b.stats()) >= 5, b.stats()


def test_bias_last_keeps_the_bias_nan_where_the_sum_is_nan_too():
    """bias + sum with NaNs in both: the bias's NaN, as MKL's C + A B keeps C's (the kernel's
    operand order, which a compiler free to swap an addition's operands must not decide)."""
    x, w, bias = seeded((16, 64), 1), seeded((64, 48), 2), seeded((48,), 3)
    nan = lambda payload: torch.tensor(payload, dtype=torch.int32).view(torch.float32)  # noqa: E731
    x[0, 5], x[3, 0] = nan(0x7FC00003), nan(-0x3FFFFD)  # 0xFFC00003
    bias[3], bias[7] = nan(0x7FC00004), nan(0x7FC00005)
    out = torch.empty(16, 48)
    for kernel in ("small_gemm_bias_last", "small_gemm_packed_bias_last", "small_gemm_panels_bias_last"):
        ADDMM(bias, x, w, 1, 1, kernel, out=out)
        for col in (3, 7):
            assert torch.equal(bits(out[:, col]), bits(bias[col].expand(16))), (kernel, col)
        assert torch.isnan(out[0]).all() and torch.isnan(out[3]).all(), kernel
