"""Replays under the conditions users run with (Note [Ambient state] in guards/guard_key.h): the
machine's thread count and others, long rows, settings changed between capture and call (thread
count, fp32 matmul precision, default dtype, deterministic algorithms, inference mode), inputs of
other layouts, through every entry point a condition applies to: torchreplay.capture, torch.compile
and a saved program loaded by the C++ loader. Each case compares bits with eager's and checks
that the call replayed, or captured again where the condition says it must."""
import contextlib
import logging

import pytest
import torch
import torch.nn as nn

import torchreplay
from configs import backend, config
from differential import assert_bitwise, gen, rn

ENTRIES = ("capture", "compile", "loaded")


class Entry:
    """One model through one entry point: call it as the model is called; stats() sums its
    engines' counters and joins their capture logs."""

    def __init__(self, kind, model, example, tmp_path=None, dynamic=False, **ro):
        self.kind = kind
        if kind == "compile":
            self._backend = backend(**ro)
            self._fn = torch.compile(model, backend=self._backend, dynamic=dynamic or None)
        else:
            step = torchreplay.capture(model, example, config=config(**ro), dynamic=dynamic)
            if kind == "capture":
                self._fn, self._stats = step, step.stats
            else:
                torchreplay.save(step, tmp_path / "model.trp")
                program = torchreplay.load(tmp_path / "model.trp")
                self._fn = lambda *a: _single(program(*a))
                self._stats = program.stats

    def __call__(self, *args):
        return self._fn(*args)

    def stats(self):
        if self.kind != "compile":
            return self._stats()
        each = self._backend.stats()
        out = {k: sum(s[k] for s in each) for k in ("calls", "replays", "captures", "eager_fallbacks")}
        out["capture_log"] = [c for s in each for c in s["capture_log"]]
        return out

    def reasons(self):
        return [c["reason"] for c in self.stats()["capture_log"]]


def _single(out):
    return out[0] if isinstance(out, (list, tuple)) and len(out) == 1 else out


@contextlib.contextmanager
def setting(get, put, value):
    """Within: the setting `get` reads and `put` sets is `value`; put back after."""
    before = get()
    put(value)
    try:
        yield
    finally:
        put(before)


def threads(n):
    return setting(torch.get_num_threads, torch.set_num_threads, n)


class Fn(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


# One-output reductions over rows of at least GRAIN_SIZE (32768) elements take ATen's two-pass
# reduction at more than one thread (Note [Prepared sums and means]); the others are controls.
LONG_ROWS = {
    "sum over a long row": (lambda x: x.sum(1), (1, 50000), torch.float32),
    "mean over the last dim": (lambda x: x.mean(-1), (1, 50000), torch.float32),
    "sum kept": (lambda x: x.sum(-1, keepdim=True) * 2, (1, 70000), torch.float32),
    "float64 sum": (lambda x: x.sum(1), (1, 50000), torch.float64),
    "sum of a transpose": (lambda x: x.t().sum(0), (1, 50000), torch.float32),
    "per-image mean": (lambda x: x.mean((1, 2, 3)), (1, 8, 64, 64), torch.float32),
    "audio normalization": (lambda x: (x - x.mean(-1, keepdim=True)) / x.std(-1, keepdim=True), (1, 50000),
                            torch.float32),
    "a few long rows": (lambda x: x.sum(-1), (3, 40000), torch.float32),
    "short rows": (lambda x: x.mean(-1), (64, 37), torch.float32),
}


@pytest.mark.parametrize("n_threads", [1, 3])
@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("case", list(LONG_ROWS))
def test_reductions_over_long_rows_replay_eagers_bits(case, entry, n_threads, tmp_path):
    fn, shape, dtype = LONG_ROWS[case]
    g = gen(0)
    make = lambda: (rn(g, *shape, dtype=dtype) * 10,)  # noqa: E731
    with threads(n_threads), torch.no_grad():
        f = Entry(entry, Fn(fn), make(), tmp_path)
        for i in range(4):
            (x,) = make()
            assert_bitwise(f(x), fn(x), f"{case}, {entry}, {n_threads} threads, call {i}")
    assert f.stats()["replays"] >= 2, f.stats()


class Convs(nn.Module):
    """A linear layer (the checked small GEMM where it matches), a 1x1 convolution (Slow2d at one
    thread, oneDNN at more in eager), a long one-output sum."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 24)
        self.conv = nn.Conv2d(16, 64, 1)

    def forward(self, x, img, row):
        return self.fc(x), self.conv(img), row.sum(1)


def _convs_inputs(i):
    g = gen(i)
    return rn(g, 5, 16), rn(g, 1, 16, 20, 20), rn(g, 1, 50000)


@pytest.mark.parametrize("entry", ENTRIES)
def test_a_call_at_another_thread_count_captures_again(entry, tmp_path):
    """Note [Ambient state]: the thread count decides how eager reduces and which convolution and
    GEMM kernels it runs (and the checked kernels were chosen at the capture's count): a call at
    another count is another key, captured for it; back at the first count, the first capture
    replays again; each call eager's bits at its count."""
    torch.manual_seed(0)
    model = Convs().eval()
    with torch.no_grad():
        with threads(1):
            f = Entry(entry, model, _convs_inputs(0), tmp_path)
        for i, n in enumerate((1, 1, 1, 3, 3, 3, 1, 1)):
            with threads(n):
                args = _convs_inputs(i)
                for k, (got, want) in enumerate(zip(f(*args), model(*args))):
                    assert_bitwise(got, want, f"{entry}, call {i} at {n} threads, output {k}")
    s = f.stats()
    if entry == "compile":  # Dynamo guards on the thread count (GLOBAL_STATE): a graph per count
        assert f.reasons() == ["no graph yet", "no graph yet"], f.reasons()
    else:
        assert f.reasons() == ["no graph yet", "threads 1 -> 3"], f.reasons()
    assert s["replays"] >= 5 and s["eager_fallbacks"] == 0, s


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 64)).eval()


@contextlib.contextmanager
def _matmul_precision(how):
    before = torch.backends.mkldnn.matmul.fp32_precision, torch.get_float32_matmul_precision()
    try:
        if how == "mkldnn bf16":
            torch.backends.mkldnn.matmul.fp32_precision = "bf16"
        else:
            torch.set_float32_matmul_precision("medium")
        yield
    finally:
        torch.set_float32_matmul_precision(before[1])
        torch.backends.mkldnn.matmul.fp32_precision = before[0]


@pytest.mark.parametrize("how", ["mkldnn bf16", "set_float32_matmul_precision medium"])
@pytest.mark.parametrize("entry", ENTRIES)
def test_a_call_under_another_matmul_precision_captures_again(entry, how, tmp_path):
    """Note [Ambient state]: oneDNN's fp32 matmul precision (bf16 arithmetic in eager's GEMMs where
    the CPU has it) set after a capture: another key, captured for it, each call eager's bits;
    put back, the first capture replays again."""
    model = _mlp()
    x = torch.randn(8, 64)
    with torch.no_grad():
        f = Entry(entry, model, (x,), tmp_path)
        for i in range(3):
            assert_bitwise(f(x), model(x), f"{entry}: call {i}")
        with _matmul_precision(how):
            for i in range(3):
                assert_bitwise(f(x), model(x), f"{entry}, {how}: call {i}")
        for i in range(3):
            assert_bitwise(f(x), model(x), f"{entry}: put back, call {i}")
    if entry == "compile" and how != "mkldnn bf16":  # Dynamo guards on this one: a graph per setting
        assert f.reasons() == ["no graph yet", "no graph yet"], f.reasons()
    else:
        changes = [r for r in f.reasons() if "fp32 precision" in r]
        assert len(changes) == 1 and "mkldnn matmul fp32 precision none -> bf16" in changes[0], f.reasons()
    assert f.stats()["replays"] >= 6, f.stats()


def test_deterministic_algorithms_set_after_a_capture_capture_again():
    """Note [Ambient state]: use_deterministic_algorithms changes eager's index_put_ with
    accumulate on the CPU (it sorts the indices first): the key is captured again."""
    def fn(x, i, v):
        return x.index_put((i,), v, accumulate=True) * 1

    g = gen(0)
    x, i, v = rn(g, 64), torch.randint(0, 64, (500,), generator=g), rn(g, 500)
    step = torchreplay.capture(fn, (x, i, v), config=config())
    before = torch.are_deterministic_algorithms_enabled()
    try:
        for flag in (False, False, True, True, True, False):
            torch.use_deterministic_algorithms(flag)
            assert_bitwise(step(x, i, v), fn(x, i, v), f"deterministic {flag}")
    finally:
        torch.use_deterministic_algorithms(before)
    reasons = [c["reason"] for c in step.stats()["capture_log"]]
    assert any("deterministic algorithms off -> on" in r for r in reasons), reasons
    assert step.stats()["replays"] >= 2


SETTINGS = {  # Note [Ambient state]: (what the capture log names, the setting changed)
    "nnpack off": ("nnpack on -> off", lambda: torch.backends.nnpack.flags(enabled=False)),
    "mkldnn deterministic": ("mkldnn deterministic off -> on",
                             lambda: torch.backends.mkldnn.flags(enabled=True, deterministic=True)),
    "mkldnn conv bf16": ("mkldnn conv fp32 precision none -> bf16",
                         lambda: torch.backends.mkldnn.flags(enabled=True, fp32_precision="bf16")),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_a_call_under_another_backend_setting_captures_again(setting):
    """Note [Ambient state]: NNPACK, oneDNN's deterministic mode and oneDNN's fp32 convolution
    precision decide which convolution kernel eager runs: a call under another setting captures
    the key again, eager's bits under each, and the capture log names the change."""
    named, flags = SETTINGS[setting]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 8, 3)).eval()
    x = torch.randn(16, 8, 10, 10)  # batch 16: NNPACK's threshold
    with torch.no_grad():
        step = torchreplay.capture(model, (x,), config=config())
        for i in range(2):
            assert_bitwise(step(x), model(x), f"before, call {i}")
        with flags():
            for i in range(3):
                assert_bitwise(step(x), model(x), f"{setting}, call {i}")
    reasons = [c["reason"] for c in step.stats()["capture_log"]]
    assert any(named in r for r in reasons), reasons
    assert step.stats()["replays"] >= 3, step.stats()


class Factories(nn.Module):
    """Tensors made without a dtype: the default dtype decides theirs."""

    def forward(self, x):
        return x + torch.ones(3) + torch.tensor([1.0, 2.0, 3.0]) + torch.arange(3.0) * 0.1


def default_dtype(dtype):
    return setting(torch.get_default_dtype, torch.set_default_dtype, dtype)


@pytest.mark.parametrize("entry", ENTRIES)
def test_a_call_under_another_default_dtype(entry, tmp_path):
    """torch.set_default_dtype after a capture: torchreplay.capture traces the model again under it
    (as torch.compile, whose Dynamo guards on it, compiles again), eager's dtype and bits; a loaded
    program (its graph fixed) captures again, giving what its graph gives run op by op."""
    model = Factories()
    x = torch.randn(3)
    f = Entry(entry, model, (x,), tmp_path)
    reference = model
    if entry == "loaded":
        program = torchreplay.load(tmp_path / "model.trp", config("default"))
        reference = lambda *a: program(*a)[0]  # noqa: E731
    for dtype in (torch.float32, torch.float64, torch.float64, torch.float64, torch.float32):
        with default_dtype(dtype):
            want = reference(x)
            if entry != "loaded":
                assert want.dtype == dtype
            for i in range(2):
                assert_bitwise(f(x), want, f"{entry}, default dtype {dtype}, call {i}")
    assert f.stats()["replays"] >= 3, f.stats()
    if entry == "loaded":
        assert "default dtype Float -> Double" in f.reasons(), f.reasons()


class ConvLinearNorm(nn.Module):
    """What CPU autocast casts to bfloat16 (a convolution, a Linear over a long row), keeps in
    float32 (layer norm) and leaves alone (ReLU, flatten)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.fc = nn.Linear(8 * 30 * 30, 16)
        self.norm = nn.LayerNorm(16)

    def forward(self, x):
        return self.norm(self.fc(torch.relu(self.conv(x)).flatten(1)))


@pytest.mark.parametrize("made_under", ["autocast off", "autocast bfloat16"])
@pytest.mark.parametrize("entry", ENTRIES)
def test_a_call_under_another_autocast_state(entry, made_under, tmp_path):
    """Autocast turned on or off after a capture or compile (Note [Ambient state]): torch.compile
    recompiles, eager's dtype and bits under each state; torchreplay.capture refuses to be made
    under autocast (torch.export's trace under it is not eager's program) and, made without it,
    runs the model eagerly under it, eager's bits, replaying again without; a loaded program (its
    graph fixed) computes what it recorded under any state, autocast off inside it."""
    torch.manual_seed(0)
    model = ConvLinearNorm().eval()
    x = torch.randn(2, 3, 32, 32)
    on = made_under != "autocast off"
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=on):
            if on and entry != "compile":
                with pytest.raises(NotImplementedError, match="a trace under autocast"):
                    Entry(entry, model, (x,), tmp_path)
                return
            f = Entry(entry, model, (x,), tmp_path)
            recorded = model(x)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not on):
            assert not torch.equal(model(x), recorded)  # autocast changes this model's bits
        for i, cast in enumerate((on, on, not on, not on, not on, on, not on, on)):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cast):
                want = recorded if entry == "loaded" else model(x)
                got = f(x)
            assert_bitwise(got, want, f"{entry} made under {made_under}, call {i} with autocast {cast}")
    stats = f.stats()
    assert stats["eager_fallbacks"] == (4 if entry == "capture" else 0), stats  # capture: those under autocast
    # compile: each state warmed up, captured and replayed; capture: the 4 calls without autocast;
    # loaded: one key, every call
    assert stats["replays"] == {"compile": 6, "capture": 3, "loaded": 7}[entry], stats


class Einsum(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 20)

    def forward(self, x):
        return torch.einsum("bi,bj->bij", self.fc(x), x)


@pytest.mark.parametrize("module", ["lstm", "gru", "rnn", "lstm cell", "einsum", "bilinear"])
@pytest.mark.parametrize("where", ["around the call", "inside forward"])
def test_models_torch_export_traces_otherwise_under_autocast(module, where, replay_log):
    """torch.export decomposes composite ops under autocast without autocast's casts on the ops
    inside them (an LSTM's results come out float32 where eager's are bfloat16; einsum's and
    bilinear's products): a capture under autocast, around the call or inside forward, raises the
    clear error; one made without it and called under autocast runs the model eagerly then,
    eager's bits, said once, and replays again without."""
    torch.manual_seed(0)
    make = {"lstm": lambda: nn.LSTM(16, 20, num_layers=2, batch_first=True),
            "gru": lambda: nn.GRU(16, 20, num_layers=2, batch_first=True),
            "rnn": lambda: nn.RNN(16, 20, num_layers=2, batch_first=True),
            "lstm cell": lambda: nn.LSTMCell(16, 20), "einsum": Einsum, "bilinear": lambda: nn.Bilinear(16, 16, 20)}

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = make[module]()
            self.fc = nn.Linear(20, 4)

        def forward(self, x, inside: bool = False):
            with torch.autocast("cpu", dtype=torch.bfloat16) if inside else contextlib.nullcontext():
                y = self.inner(x, x) if module == "bilinear" else self.inner(x)
                y = y[0] if isinstance(y, tuple) else y
            return self.fc(y.flatten(1)[:, :20].float())

    model = Model().eval()
    x = torch.randn(3, 5, 16) if module in ("lstm", "gru", "rnn") else torch.randn(3, 16)
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=where == "around the call"), \
                pytest.raises(NotImplementedError, match="under autocast|enters autocast"):
            torchreplay.capture(model, (x, where == "inside forward"))
        step = torchreplay.capture(model, (x,))
        with replay_log.at_level(logging.WARNING, logger="torchreplay"):
            for i, cast in enumerate((False, False, True, True, False)):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cast):
                    assert_bitwise(step(x), model(x), f"call {i}, autocast {cast}")
    assert step.stats()["replays"] == 2, step.stats()
    said = [r for r in replay_log.records if "run the model eagerly" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in replay_log.records]


@pytest.mark.parametrize("entry", ["capture", "compile"])
def test_forward_hooks_added_and_removed_after_a_capture(entry, replay_log):
    """A forward hook or pre-hook added after a capture (on the model, a submodule, or every module)
    or removed after it changes what eager's call computes: torchreplay.capture traces again for
    the hooks of the moment (said once per new set), eager's bits every call; torch.compile sees
    them where Dynamo guards on hooks (skip_nnmodule_hook_guards off: Dynamo's default skips them
    for every backend)."""
    from torch.nn.modules import module as nn_module
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8)).eval()
    x = torch.randn(3, 64)
    model[0].register_forward_hook(lambda m, i, o: o * 2)   # there at capture: traced
    with torch.no_grad(), replay_log.at_level(logging.INFO, logger="torchreplay"):
        if entry == "compile":
            torch._dynamo.config.skip_nnmodule_hook_guards = False
        f = Entry(entry, model, (x,))
        hooks = [lambda: model[2].register_forward_hook(lambda m, i, o: o - 5),
                 lambda: model.register_forward_pre_hook(lambda m, args: (args[0].flip(0),)),
                 lambda: nn_module.register_module_forward_hook(lambda m, i, o: o + 1 if isinstance(m, nn.ReLU) else o)]
        for k, add in enumerate(hooks):
            for i in range(3):
                assert_bitwise(f(x), model(x), f"{entry}: before hook {k}, call {i}")
            handle = add()
            try:
                for i in range(3):
                    assert_bitwise(f(x), model(x), f"{entry}: with hook {k}, call {i}")
            finally:
                handle.remove()
        assert_bitwise(f(x), model(x), f"{entry}: every later hook removed")
    assert f.stats()["replays"] >= 10, f.stats()
    if entry == "capture":
        said = [r for r in replay_log.records if "forward hooks were added or removed" in r.getMessage()]
        assert len(said) == 3, [r.getMessage() for r in said]


def test_a_hook_registered_anew_every_call_is_traced_a_bounded_number_of_times(replay_log):
    """A hook registered and removed around every call is a new set of hooks each time: the
    capture traces again for at most 8 of them, then runs the model eagerly, said once; every call
    eager's bits, the hook's effects included."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)).eval()
    x = torch.randn(5, 16)
    with torch.no_grad(), replay_log.at_level(logging.WARNING, logger="torchreplay"):
        step = torchreplay.capture(model, (x,))
        for i in range(14):
            handle = model[1].register_forward_hook(lambda m, a, o, i=i: o * (i + 2))
            try:
                assert_bitwise(step(x), model(x), f"call {i}")
            finally:
                handle.remove()
        for i in range(3):
            assert_bitwise(step(x), model(x), f"hooks removed, call {i}")
    s = step.stats()
    assert len(s["traces"]) == 9, s   # the capture and 8 traces made again
    assert s["calls"] == 17 and s["eager_fallbacks"] == 6 and s["replays"] == 2, s
    assert any("forward hooks changed too often" in r for r in s["fallback_reasons"]), s
    said = [r for r in replay_log.records if "forward hooks changed 8 times" in r.getMessage()]
    assert len(said) == 1


class Permuted(nn.Module):
    def __init__(self, bias):
        super().__init__()
        self.fc = nn.Linear(8, 12, bias=bias)

    def forward(self, x):
        return self.fc(x.permute(2, 0, 1))


class Matmuls(nn.Module):
    """Products by a parameter whose fold (one mm over the batch, or a bmm) depends on whether the
    parameter requires grad: batch @ matrix, batch @ vector, matrix @ batch."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 12))
        self.v = nn.Parameter(torch.randn(8))
        self.m = nn.Parameter(torch.randn(5, 6))

    def forward(self, x):
        xp = x.permute(2, 0, 1)
        return xp @ self.w, xp @ self.v, self.m @ x.permute(0, 2, 1)[:, :6, :]


class SplitWeight(nn.Module):
    """A Linear by a piece of a parameter split in forward, as MultiheadAttention's cross attention
    splits in_proj_weight: under no_grad the piece requires grad as the parameter does."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(20, 8))
        self.b = nn.Parameter(torch.randn(20))

    def forward(self, x):
        (_, w), (_, b) = self.w.split([8, 12]), self.b.split([8, 12])
        return nn.functional.linear(x.permute(2, 0, 1), w, b)


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("make", ["linear", "linear without bias", "matmuls", "split weight"])
def test_products_by_parameters_on_permuted_inputs_fold_as_eager(make, entry, tmp_path):
    """Note [Matmuls folded as eager folds them]: eager folds such a product into one mm (a copy of
    the input first) while the parameter requires grad, even under no_grad, and runs a bmm once it
    is frozen; each call eager's bits, and changing requires_grad after the capture traces again."""
    torch.manual_seed(0)
    model = {"matmuls": Matmuls, "split weight": SplitWeight}.get(make, lambda: Permuted(bias=make == "linear"))()
    x = torch.randn(2, 8, 6)
    with torch.no_grad():
        f = Entry(entry, model, (x,), tmp_path)
        grads = (True, False, True) if entry != "loaded" else (True,)  # a loaded program: its trace's weights
        for requires_grad in grads:
            model.requires_grad_(requires_grad)
            for i in range(3):
                got, want = f(x), model(x)
                got, want = (got, want) if isinstance(want, tuple) else ((got,), (want,))
                for k, (g_, w_) in enumerate(zip(got, want)):
                    assert_bitwise(g_, w_, f"{make}, {entry}, requires_grad={requires_grad}, call {i}, output {k}")
    assert f.stats()["replays"] >= 2 * len(grads), f.stats()


@pytest.mark.parametrize("entry", ENTRIES)
def test_captured_under_inference_mode_and_called_outside_it(entry, tmp_path):
    """Note [A pool of ordinary tensors]: what a capture keeps is made as ordinary tensors, so a
    capture made in inference mode replays under no_grad (eager's bits, no 'inference tensor'
    error), and its outputs are inference tensors exactly when the call is in inference mode."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 24), nn.ReLU(), nn.Linear(24, 8)).eval()
    model.requires_grad_(False)
    x = torch.randn(5, 16)
    with torch.inference_mode():
        f = Entry(entry, model, (x,), tmp_path)
        for _ in range(3):
            out = f(x)
        assert out.is_inference()
    for mode in (torch.no_grad, torch.inference_mode, torch.enable_grad, torch.no_grad):
        with mode():
            for i in range(2):
                got, want = f(x), model(x)
                assert_bitwise(got, want, f"{entry} under {mode.__name__}, call {i}")
                assert got.is_inference() == want.is_inference(), mode
    assert f.stats()["replays"] >= 6, f.stats()


def _close(model, example):
    return torchreplay.capture(model, example, config=config(numerics="close"))


def _conv_bn():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU()).eval()
    with torch.no_grad():
        m[1].running_mean.normal_()
        m[1].running_var.uniform_(0.5, 2)
    return m


def test_close_refuses_a_call_after_a_train_mode_forward_updated_the_statistics():
    """Note [Close numerics]: a train-mode forward updates a batch norm's running statistics
    inside its kernel, with no version counter bumped: the per-channel vectors a capture folded
    are compared with their contents at capture, and the call raises instead of computing with
    the old statistics."""
    m = _conv_bn()
    x = torch.randn(1, 3, 16, 16)
    with torch.no_grad():
        step = _close(m, (x,))
        for _ in range(3):
            torch.testing.assert_close(step(x), m(x), rtol=1e-4, atol=1e-5)
        assert step.numerics["numerics"] == "close" and step.numerics["rewrites"]["batch_norms_folded"] == 1
        m.train()
        m(torch.randn(4, 3, 16, 16))
        m.eval()
        with pytest.raises(RuntimeError, match="running_mean' was written after the capture"):
            step(x)


@pytest.mark.parametrize("write", ["data in place", "data assigned", "attribute"])
@pytest.mark.parametrize("numerics", ["bitwise", "close"])
def test_writes_the_version_counters_miss_are_refused(numerics, write):
    """Note [Writes a capture would not see]: a folded weight written through .data (close) and a
    module's number changed after the capture (both numerics) make later calls raise; the bitwise
    graph reads weights as they are, so a write through .data gives eager's bits there. A read of
    .data changes nothing."""
    m = _conv_bn()
    x = torch.randn(1, 3, 16, 16)
    with torch.no_grad():
        step = torchreplay.capture(m, (x,), config=config(numerics=numerics))
        for _ in range(3):
            step(x)
        assert m[0].weight.data.abs().sum() > 0  # a read
        step(x)
        if write == "data in place":
            m[0].weight.data.mul_(2)
        elif write == "data assigned":
            m[0].weight.data = m[0].weight.detach() * 2
        else:
            m[1].eps = 0.5
        if numerics == "bitwise" and write != "attribute":
            assert_bitwise(step(x), m(x))
        else:
            with pytest.raises((RuntimeError, ValueError), match="eps' of BatchNorm2d was 1e-05|0.weight' was written"):
                step(x)
        if write == "attribute":  # set back: the capture holds again
            m[1].eps = 1e-5
            got = step(x)
            if numerics == "bitwise":
                assert_bitwise(got, m(x))


def test_what_changes_nothing_is_not_refused():
    """Note [Writes a capture would not see]: reading a folded weight's .data, training steps that
    clamp weights through .data between forward and backward (autograd sees no write), a module
    moved to where it is, and a number set and set back leave a "close" capture working."""
    m = _conv_bn()
    x = torch.randn(1, 3, 16, 16)
    with torch.no_grad():
        step = _close(m, (x,))
        want = step(x)
    trained = _conv_bn().train()
    for p in trained.parameters():  # an eager model trained beside the capture: its parameters are not folded
        p.data.clamp_(-1, 1)
    trained(torch.randn(2, 3, 16, 16)).sum().backward()
    with torch.no_grad():
        assert m[0].weight.data.abs().sum() > 0
        m.to("cpu")
        m.to(torch.float32)
        m[1].momentum = 0.2
        m[1].momentum = 0.1
        for _ in range(3):
            assert_bitwise(step(x), want)
    m.train()
    out = m(torch.randn(2, 3, 16, 16))
    for p in m.parameters():
        p.data.clamp_(-1, 1)  # between forward and backward: .data's alias has a counter of its own
    out.sum().backward()
    m.eval()
    with torch.no_grad(), pytest.raises(RuntimeError, match="was written after the capture"):
        step(x)  # the train-mode forward moved the statistics


def test_close_lstm_states_have_eagers_shapes():
    """A multi-layer LSTM under numerics "close" runs PyTorch's decomposition, whose final states
    came out (layers, 1, batch, hidden): they are eager's (layers, batch, hidden)."""
    torch.manual_seed(0)
    lstm = nn.LSTM(8, 16, num_layers=2, batch_first=True).eval()
    x = torch.randn(3, 5, 8)
    with torch.no_grad():
        step = _close(lstm, (x,))
        for _ in range(3):
            got, want = step(x), lstm(x)
    assert step.numerics["numerics"] == "close", step.numerics
    for g, w in zip((got[0], *got[1]), (want[0], *want[1])):
        assert (g.shape, g.stride()) == (w.shape, w.stride())
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    assert step.stats()["replays"] >= 2


class ConvViews(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(16, 32, 3, padding=1)
        self.d = nn.Conv2d(32, 32, 3, padding=1, groups=32)
        self.p = nn.Conv2d(32, 32, 1)

    def forward(self, x):
        y = torch.relu(self.c(x))
        z = self.d(y)
        w = self.p(z)
        return y, y[:, :4], y.flatten(1), z.permute(0, 2, 3, 1), w, w[0]


@pytest.mark.parametrize("batch", [1, 2])
def test_close_outputs_that_are_views_keep_eagers_strides_and_sharing(batch):
    """Results the rewrite leaves channels-last are made contiguous once, before the model's views
    of them (not the rewrite's own, which read them as they lie), so outputs that are views of one
    result have eager's strides and share its memory as eager's do; the capture's own check
    compares layouts and sharing, not only values."""
    torch.manual_seed(0)
    m = ConvViews().eval()
    x = torch.randn(batch, 16, 24, 24)
    with torch.no_grad():
        step = _close(m, (x,))
        for _ in range(3):
            got, want = step(x), m(x)
    assert step.numerics["numerics"] == "close", step.numerics
    for k, (g, w) in enumerate(zip(got, want)):
        assert (g.shape, g.stride()) == (w.shape, w.stride()), k
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)

    def sharing(outs):
        return [[a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() for b in outs] for a in outs]
    assert sharing(got) == sharing(want)
    assert step.stats()["replays"] >= 2


class EveryKind(nn.Module):
    """A step of every kind the CPU tape has (but collectives), on short and long rows."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.ln = nn.LayerNorm(16)
        self.conv = nn.Conv2d(4, 8, 3, padding=1)
        self.lstm = nn.LSTM(16, 16, batch_first=True)
        self.w = nn.Parameter(torch.randn(16, 16))
        self.register_buffer("state", torch.zeros(4, 16))
        self.bn, self.bn1 = nn.BatchNorm2d(4), nn.BatchNorm1d(4)
        for bn in (self.bn, self.bn1):
            bn.running_mean.normal_(), bn.running_var.uniform_(0.5, 2), bn.weight.data.normal_()

    def forward(self, x, img, q, seq, row):
        self.state.add_(x)                                          # in place (an input written)
        fused = (x.sin() * 2 + 1).relu()                            # fused elementwise
        return (torch.cat([fused, torch.cumsum(x, 1)], 1),          # copies, boxed out=
                x.sum(-1) + x.mean(-1), row.sum(1), row.mean(-1),   # prepared reductions, one a long row
                nn.functional.scaled_dot_product_attention(q, q, q),  # prepared attention
                self.fc(self.ln(x)), x @ self.w,                    # prepared layer norm, typed out=, checked gemm
                self.conv(img), self.lstm(seq)[0],                  # checked conv, checked lstm
                torch.sort(x, 1)[0], torch.atan2(x, fused),         # functional, typed out=
                x.permute(1, 0), (row * 0.5).sin().exp(),           # view; a long elementwise row
                nn.functional.max_pool2d(img, 3, 2, ceil_mode=True),  # max pool
                nn.functional.silu(self.bn(img)),                   # batch norm terms, channel affine
                self.bn1(row.view(1, 4, -1)).relu())                # (a long row)


EVERY_KIND = {"fused elementwise", "typed out=", "boxed out=", "copies", "prepared pointwise", "prepared reduction",
              "prepared attention", "prepared layer norm", "checked conv", "checked gemm", "checked lstm",
              "max pool", "functional", "in place", "view"}


def test_every_step_kind_replays_eagers_bits_at_the_sessions_thread_count():
    """Every step kind of the CPU tape (collectives aside: tests/python/test_collectives.py) in one
    model and, for prepared pointwise steps (what ops the fused kernel does not take get), one
    graph with fusion off, on short rows and rows of 65536 elements (ATen splits those over
    threads): eager's bits at whatever thread count the session runs (CI runs this file at 1, 2
    and 3 threads: tools/test.sh)."""
    from differential import engine_for
    torch.manual_seed(0)
    model = EveryKind().eval()
    reference = EveryKind().eval()
    reference.load_state_dict(model.state_dict())
    g = gen(0)
    make = lambda: (rn(g, 4, 16), rn(g, 1, 4, 8, 8), rn(g, 1, 2, 5, 8), rn(g, 2, 3, 16), rn(g, 1, 1 << 16))  # noqa: E731
    kinds = set()
    with torch.no_grad():
        step = torchreplay.capture(model, make(), config=config())
        for i in range(4):
            args = make()
            for k, (got, want) in enumerate(zip(step(*args), reference(*args))):
                assert_bitwise(got, want, f"call {i}, output {k}, {torch.get_num_threads()} threads")
        kinds |= {r["kind"].split(" (")[0] for r in step.profile(*args, iterations=1)}
        assert step.stats()["replays"] >= 3

        def pointwise(x, y):
            return torch.rsqrt(x.abs() + 1) * torch.erf(y), (x > y) | (x == 0), torch.nn.functional.silu(x)
        xs = [rn(g, 1, 1 << 16), rn(g, 1, 1 << 16)]
        engine = engine_for(pointwise, xs, fuse_elementwise=False)
        for i in range(3):
            xs = [rn(g, 1, 1 << 16), rn(g, 1, 1 << 16)]
            for k, (got, want) in enumerate(zip(engine.run(list(xs)), pointwise(*xs))):
                assert_bitwise(got, want, f"fusion off, call {i}, output {k}")
        kinds |= {r["kind"].split(" (")[0] for r in engine.profile(xs, 1)}
    assert kinds >= EVERY_KIND, EVERY_KIND - kinds


@pytest.mark.parametrize("entry", ["capture", "compile"])
def test_attention_backend_switches_decide_what_is_traced(entry, tmp_path):
    """Note [What a trace was made under]: sdpa_kernel() decides what a trace records for
    scaled_dot_product_attention (the flash op or the math decomposition on the CPU): a call under
    other switches traces again (capture) or recompiles (torch.compile, through the backend's
    guard), each call eager's bits."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def attention(q, k, v):
        return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True) * 1

    g = gen(0)
    make = lambda: tuple(rn(g, 2, 4, 16, 8) for _ in range(3))  # noqa: E731
    f = Entry(entry, Fn(attention), make(), tmp_path)
    with torch.no_grad():
        for backends in ([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH], [SDPBackend.MATH], None):
            with sdpa_kernel(backends) if backends else contextlib.nullcontext():
                for i in range(3):
                    args = make()
                    assert_bitwise(f(*args), attention(*args), f"{entry}, {backends}, call {i}")
    s = f.stats()
    assert s["captures"] >= 2 and s["replays"] >= 4, s


@pytest.mark.parametrize("rows", [(1, 50000), (64, 37)], ids=["long row", "short rows"])
def test_thread_counts_alternating_call_by_call_replay_each(rows, replay_log):
    """Note [Ambient state]: the settings are part of the key, so two thread counts alternating
    call by call are two keys, each captured once and replayed at its count with eager's bits; a
    count new on every call is a new key every call, each run eagerly and said once."""
    model = Fn(lambda x: x.sum(1) * 2)
    x = torch.randn(*rows)
    with torch.no_grad():
        step = torchreplay.capture(model, (x,), config=config())
        for i in range(12):
            with threads(1 + i % 2):
                assert_bitwise(step(x), model(x), f"call {i} at {1 + i % 2} threads")
        s = step.stats()
        assert (s["captures"], s["replays"], s["eager_fallbacks"], s["cache_entries"]) == (2, 10, 0, 2), s
        for i in range(10):
            with threads(3 + i):
                assert_bitwise(step(x), model(x), f"call at {3 + i} threads")
    s = step.stats()
    assert s["captures"] == 2 and s["last_miss"] == "threads 11 -> 12", s
    said = [r.getMessage() for r in replay_log.records if "calls each had a new guard key" in r.getMessage()]
    assert len(said) == 1 and "threads" in said[0], said


def test_each_capture_holds_the_numbers_it_was_made_with():
    """Note [Writes a capture would not see]: two captures of one module made under two values of
    a number: each holds while the module has its own value, and raises under the other."""
    m = _conv_bn()
    x = torch.randn(1, 3, 16, 16)
    with torch.no_grad():
        first = torchreplay.capture(m, (x,), config=config())
        m[1].eps = 0.5
        second = torchreplay.capture(m, (x,), config=config())
        for eps, holds, raises in ((0.5, second, first), (1e-5, first, second)):
            m[1].eps = eps
            for _ in range(3):
                assert_bitwise(holds(x), m(x), f"eps {eps}")
            with pytest.raises(ValueError, match="attribute 'eps' of BatchNorm2d was"):
                raises(x)
