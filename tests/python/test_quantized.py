"""Quantized models as CPU users quantize them (docs/guide.md, "Quantized models"): torchao's
quantize_ configs whose eager runs on the CPU, through torchreplay.capture, torch.compile and a
saved program, compared bit for bit with the quantized model's eager, at one thread and several,
over short and long rows, with the thread count changed between capture and call."""
import copy
import pickle
import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torchao.prototype.quantization.int4 import Int4WeightOnlyOpaqueTensorConfig
from torch.ao.quantization import per_channel_dynamic_qconfig
from torchao.quantization import (Int8DynamicActivationInt8WeightConfig, Int8DynamicActivationIntxWeightConfig,
                                  Int8WeightOnlyConfig, IntxWeightOnlyConfig, quantize_)

import torchreplay
from configs import backend, config
from differential import assert_bitwise, assert_exercised, gen, rn
from test_conditions import ENTRIES, Entry, threads

CONFIGS = {   # torchao's configs with a CPU eager in torchao 0.17 (version 1 is the int8 default)
    "int8 weight-only": lambda: Int8WeightOnlyConfig(),
    "int8 weight-only v2": lambda: Int8WeightOnlyConfig(version=2),
    "int8 dynamic activation": lambda: Int8DynamicActivationInt8WeightConfig(),
    "int8 dynamic activation v2": lambda: Int8DynamicActivationInt8WeightConfig(version=2),
    "int4 weight-only (CPU packing)": lambda: Int4WeightOnlyOpaqueTensorConfig(group_size=32),
    "intx int4 weight-only": lambda: IntxWeightOnlyConfig(weight_dtype=torch.int4),
    "int8 dynamic activation, int4 weights": lambda: Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4),
}


def encoder(k):
    """Linear (no bias, as in decoders), GELU, LayerNorm, Linear over rows of k features (k =
    40960: rows past ATen's grain size, whose per-row reductions, dynamic quantization's ranges
    among them, take ATen's two-pass path at more than one thread)."""
    return nn.Sequential(nn.Linear(k, 96, bias=False), nn.GELU(), nn.LayerNorm(96), nn.Linear(96, 32)).eval()


def quantized(name, k):
    torch.manual_seed(0)
    m = encoder(k)
    with warnings.catch_warnings():   # torchao's deprecations of its version-1 tensors
        warnings.simplefilter("ignore", UserWarning)
        quantize_(m, CONFIGS[name]())
    assert is_traceable_wrapper_subclass(m[0].weight), "torchao left the weight unquantized"
    return m


@pytest.mark.parametrize("k", [64, 4096, 40960])
@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_torchao_models_replay_the_quantized_eagers_bits(name, entry, k, tmp_path):
    m = quantized(name, k)
    g = gen(1)
    with torch.no_grad():
        f = Entry(entry, copy.deepcopy(m), (rn(g, 2, 3, k),), tmp_path)
        for i, n_threads in enumerate([1, 3, 3, 1, 2]):   # changed between capture and calls
            x = rn(g, 2, 3, k)
            with threads(n_threads):
                assert_bitwise(f(x), m(x), f"{name}, {entry}, k={k}, call {i} at {n_threads} threads")
    s = f.stats()
    assert s["replays"] >= 1 and s["eager_fallbacks"] == 0, s


def compiled_like_eager(m, seed, *shape, grad=False):
    """A copy of m through torch.compile against m, on four calls of fresh inputs of `shape`:
    bitwise, and replayed. The backend."""
    b = backend()
    f = torch.compile(copy.deepcopy(m), backend=b)
    g = gen(seed)
    with torch.set_grad_enabled(grad):
        for i in range(4):
            x = rn(g, *shape)
            assert_bitwise(f(x), m(x), f"call {i}")
    assert_exercised(b)
    return b


@pytest.mark.parametrize("name", list(CONFIGS))
def test_compiled_quantized_graphs_skip_aotautograds_wrapper(name):
    """Note [Tensor-subclass arguments]: the graph's call flattens the quantized weights itself."""
    b = compiled_like_eager(quantized(name, 64), 2, 5, 64)
    assert list(b.call_paths.values()) == ["direct"], b.call_paths


def test_a_quantized_weight_replaced_or_written_after_compiling_is_the_one_used():
    m = quantized("int8 dynamic activation v2", 64)
    b = backend()
    f = torch.compile(m, backend=b)
    x = rn(gen(3), 5, 64)
    with torch.no_grad():
        for _ in range(3):
            assert_bitwise(f(x), m(x), "before")
        m[0].weight = quantized("int8 dynamic activation v2", 64)[0].weight   # torch.manual_seed(0) again:
        m[0].weight.qdata.neg_()                                              # other values, then written
        assert_bitwise(f(x), m(x), "another weight")
        m[3].weight.qdata.zero_()
        assert_bitwise(f(x), m(x), "a weight written in place")
    assert_exercised(b)


def test_a_captured_quantized_weights_inner_tensor_set_or_replaced():
    """An inner tensor given other memory (set_) is read as a plain parameter's is; one replaced by
    another object is refused: the graph holds the old one."""
    m = quantized("int8 dynamic activation v2", 64)
    x = rn(gen(9), 5, 64)
    with torch.no_grad():
        step = torchreplay.capture(m, (x,), config=config())
        for _ in range(3):
            assert_bitwise(step(x), m(x), "before")
        m[0].weight.qdata.set_(-m[0].weight.qdata)
        assert_bitwise(step(x), m(x), "set_")
        assert step.stats()["replays"] >= 2, step.stats()
        m[3].weight.qdata = m[3].weight.qdata.clone()
        with pytest.raises(ValueError, match="inner tensor 'qdata' of a Int8Tensor parameter was replaced"):
            step(x)


def test_a_quantized_model_called_with_grad_mode_on_replays_eagers_bits():
    """The biases still require grad: a training graph, its weights flattened by AOTAutograd."""
    compiled_like_eager(quantized("int8 dynamic activation", 64), 4, 5, 64, grad=True)


class _Residual(nn.Module):
    """A MobileNet-like block: convolution, ReLU6, a 1x1 convolution added to its input, a
    classifier over the pooled image."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU6())
        self.conv = nn.Conv2d(16, 16, 1)
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        y = self.stem(x)
        y = y + self.conv(y)
        return self.head(y.mean((2, 3)))


PT2E = {   # model, example input shape (batch 1)
    "convnet": (lambda: nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1),
                                      nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10)),
                (3, 16, 16)),
    "residual": (_Residual, (3, 24, 24)),
    "mlp over tokens": (lambda: nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)), (7, 64)),
}


def pt2e(name, long=False, dynamic_activations=False):
    """The model through PT2E static quantization (torchao's prepare_pt2e / convert_pt2e with
    X86InductorQuantizer, calibrated on random inputs): its eager is the reference graph,
    dequantize, fp32 op, quantize. Exported strict: with torch 2.11's non-strict export the
    quantizer finds no module to annotate and leaves the model fp32, silently."""
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
    from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
        X86InductorQuantizer, get_default_x86_inductor_quantization_config)
    make, shape = PT2E[name]
    if long:   # images of 96x96, 300 tokens: rows past ATen's grain size
        shape = (shape[0], 96, 96) if len(shape) == 3 else (300, shape[1])
    torch.manual_seed(0)
    g = gen(5)
    with torch.no_grad():
        exported = torch.export.export(make().eval(), (rn(g, 1, *shape),), strict=True).module()
        quantizer = X86InductorQuantizer().set_global(
            get_default_x86_inductor_quantization_config(is_dynamic=dynamic_activations))
        prepared = prepare_pt2e(exported, quantizer)
        for _ in range(4):
            prepared(rn(g, 1, *shape))
        q = convert_pt2e(prepared)
    ops = [n.target for n in q.graph.nodes if n.op == "call_function"]
    assert torch.ops.quantized_decomposed.dequantize_per_channel.default in ops, "PT2E left the model fp32"
    return q, shape


@pytest.mark.parametrize("size", ["short", "long"])
@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("name", list(PT2E))
def test_pt2e_static_int8_replays_its_reference_bitwise(name, entry, size, tmp_path):
    """Note [PT2E's quantize ops] (passes.py): the quantize ops replay as the ATen ops of their
    kernels, bitwise to the reference eager, at 1, 3 and 2 threads changed between calls, over
    short and long rows."""
    q, shape = pt2e(name, long=size == "long")
    g = gen(6)
    with torch.no_grad():
        f = Entry(entry, q, (rn(g, 1, *shape),), tmp_path)
        for i, n_threads in enumerate([1, 1, 3, 3, 1, 2, 2]):
            x = rn(g, 1, *shape)
            with threads(n_threads):
                assert_bitwise(f(x), q(x), f"{name}, {entry}, call {i} at {n_threads} threads")
    s = f.stats()
    assert s["replays"] >= 3 and s["eager_fallbacks"] == 0, s


@pytest.mark.parametrize("entry", ENTRIES)
def test_pt2e_dynamic_int8_replays_its_reference_bitwise(entry, tmp_path):
    """Activations quantized per call (choose_qparams, then the .tensor overloads, which read the
    scale with .item()): those ops stay ops (their Python kernels), the rest replays, bitwise; a
    program holding them is not saved (a loaded program calls no Python), said at the save."""
    q, shape = pt2e("mlp over tokens", dynamic_activations=True)
    assert any(n.target == torch.ops.quantized_decomposed.choose_qparams.tensor for n in q.graph.nodes)
    g = gen(9)
    with torch.no_grad():
        if entry == "loaded":
            with pytest.raises(ValueError, match="calling quantized_decomposed::choose_qparams.tensor .ops outside"):
                Entry(entry, q, (rn(g, 1, *shape),), tmp_path)
            return
        f = Entry(entry, q, (rn(g, 1, *shape),), tmp_path)
        for i, n_threads in enumerate([1, 1, 3, 3, 2]):
            x = rn(g, 1, *shape) * (i + 1)
            with threads(n_threads):
                assert_bitwise(f(x), q(x), f"{entry}, call {i} at {n_threads} threads")
    s = f.stats()
    assert s["replays"] >= 2 and s["eager_fallbacks"] == 0, s


def sqnr(got, want):
    """Signal to quantization noise, in dB, of `got` against `want`."""
    noise = (got.double() - want.double()).pow(2).sum()
    return float("inf") if noise == 0 else float(10 * torch.log10(want.double().pow(2).sum() / noise))


@pytest.mark.parametrize("n_threads", [1, 3])
@pytest.mark.parametrize("name", list(PT2E))
def test_pt2e_under_close_numerics_runs_int8_kernels_close_to_the_reference(name, n_threads):
    """Note [PT2E's int8 kernels] (close_numerics/quantized.py): each quantized convolution and
    linear through oneDNN's int8 kernel or, where timed faster, fp32 on its weight dequantized
    once; on inputs other than the capture's the results keep eager's strides and stay within
    the int8 arithmetic's distance of the reference (SQNR), and the capture reports that."""
    q, shape = pt2e(name)
    g = gen(7)
    with torch.no_grad(), threads(n_threads):
        step = torchreplay.capture(q, (rn(g, 1, *shape),), config=config(numerics="close"))
        counts = step.numerics["rewrites"]
        assert step.numerics["numerics"] == "close", step.numerics
        assert counts["convolutions_int8"] + counts["linears_int8"] + counts["weights_dequantized_once"] >= 2, counts
        assert step.numerics["sqnr_db"] >= 30, step.numerics
        for i in range(4):
            x = rn(g, 1, *shape)
            got, want = step(x), q(x)
            assert got.stride() == want.stride() and got.dtype == want.dtype, (got.stride(), want.stride())
            assert sqnr(got, want) >= 30, f"{name}, call {i}: {sqnr(got, want):.1f} dB"
    assert step.stats()["replays"] >= 2, step.stats()


@pytest.mark.parametrize("write", ["in place", ".data"])
@pytest.mark.parametrize("numerics", ["bitwise", "close"])
def test_pt2e_int8_weights_are_folded_and_a_write_after_the_capture_raises(numerics, write):
    """Note [PT2E's weights dequantized once] (bitwise: every int8 weight dequantized once, at
    capture) and Note [PT2E's int8 kernels] (close: packed for oneDNN, or dequantized once): the
    int8 weights and their scales are folded, and a write to them after the capture raises,
    saying to capture again."""
    q, shape = pt2e("convnet")
    weights = sum(n.target == torch.ops.quantized_decomposed.dequantize_per_channel.default for n in q.graph.nodes)
    g = gen(8)
    with torch.no_grad():
        step = torchreplay.capture(q, (rn(g, 1, *shape),), config=config(numerics=numerics))
        x = rn(g, 1, *shape)
        if numerics == "bitwise":
            assert step.numerics["folded"] == {"weights_dequantized_once": weights}, step.numerics
            for n_threads in (1, 1, 1, 1, 2, 2, 2, 2):   # changed after the capture
                with threads(n_threads):
                    assert_bitwise(step(x), q(x), f"the folded capture at {n_threads} threads")
            assert step.stats()["replays"] >= 2, step.stats()
        else:
            r = step.numerics["rewrites"]
            assert r["convolutions_int8"] + r["linears_int8"] + r["weights_dequantized_once"] == weights, r
            assert sqnr(step(x), q(x)) >= 30
        weight = next(t for name, t in q.named_buffers() if t.dtype == torch.int8)
        if write == ".data" and numerics == "close":
            pytest.skip("close numerics compares a large buffer's contents only after a folded parameter's .data")
        (weight.data if write == ".data" else weight).neg_()   # .data: no version counter moves
        with pytest.raises(RuntimeError, match="buffer '_frozen_param0' was written after the capture.*capture the "
                                               "model again"):
            step(x)


def test_a_dequantized_weight_the_model_returns_is_not_folded():
    """Note [PT2E's weights dequantized once]: a dequantize whose result is an output stays an op
    (a folded constant handed out would be shared by every call, and a caller could write it)."""
    dequantize = torch.ops.quantized_decomposed.dequantize_per_channel.default

    class Returns(nn.Module):
        def __init__(self):
            super().__init__()
            g = gen(3)
            self.register_buffer("w", torch.randint(-128, 128, (8, 16), dtype=torch.int8, generator=g))
            self.register_buffer("s", torch.rand(8, generator=g) * 0.01 + 0.001)
            self.register_buffer("z", torch.zeros(8, dtype=torch.int64))

        def forward(self, x):
            wd = dequantize(self.w, self.s, self.z, 0, -128, 127, torch.int8)
            return x @ wd.t(), wd.t()

    m = Returns()
    with torch.no_grad():
        step = torchreplay.capture(m, (torch.randn(4, 16),))
        assert "folded" not in step.numerics, step.numerics
        x = rn(gen(4), 4, 16)
        for _ in range(3):
            first = step(x)[1]
        assert step.stats()["replays"] >= 1, step.stats()
        first.zero_()   # the caller's to write: the next call's results are eager's
        assert_bitwise(step(x), m(x), "after the caller wrote a returned weight")


QUANTIZE_DYNAMIC = {   # quantize_dynamic's Linears: (qconfig spec, dtype)
    "qint8 per tensor": ({nn.Linear}, torch.qint8),
    "qint8 per channel": ({nn.Linear: per_channel_dynamic_qconfig}, torch.qint8),
    "float16": ({nn.Linear}, torch.float16),
}


def _quantize_dynamic(model, spec=(nn.Linear, nn.LSTM), dtype=torch.qint8):
    with warnings.catch_warnings():   # deprecated in favour of torchao
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(model, set(spec) if isinstance(spec, tuple) else spec, dtype=dtype)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("k", [64, 4096, 40960])
@pytest.mark.parametrize("entry", ["capture", "loaded"])
@pytest.mark.parametrize("flavour", list(QUANTIZE_DYNAMIC))
def test_quantize_dynamic_linears_replay_eagers_bits(flavour, entry, k, dynamic, tmp_path):
    """Note [Packed quantized Linears] (packed.py): each packed Linear replays as eager's own op on
    eager's own packed weights, a saved program packs them again on load; bitwise to the quantized
    eager at 1, 3 and 2 threads changed between calls, over rows past ATen's grain size (the
    activation's range is a reduction over the whole input), 3-d inputs, other row counts when
    dynamic."""
    torch.manual_seed(0)
    m = _quantize_dynamic(encoder(k), *QUANTIZE_DYNAMIC[flavour])
    g = gen(1)
    with torch.no_grad():
        f = Entry(entry, m, (rn(g, 2, 3, k),), tmp_path, dynamic=dynamic)
        for i, n_threads in enumerate([1, 3, 3, 1, 2, 2]):
            x = rn(g, 2, 3 + (i // 2 if dynamic else 0), k)
            with threads(n_threads):
                assert_bitwise(f(x), m(x), f"{flavour}, {entry}, k={k}, call {i} at {n_threads} threads")
    s = f.stats()
    assert s["replays"] >= 1 and s["eager_fallbacks"] == 0, s


def test_quantize_dynamic_linears_under_close_numerics_stay_eagers_op():
    """Numerics "close" checks its rewrite by running the traced graph (the packed op's CPU
    kernel); the packed Linears stay eager's op."""
    torch.manual_seed(0)
    m = _quantize_dynamic(encoder(64), {nn.Linear})
    g = gen(5)
    with torch.no_grad():
        step = torchreplay.capture(m, (rn(g, 3, 64),), config=config(numerics="close"))
        assert step.numerics["numerics"] == "close", step.numerics
        for i in range(3):
            x = rn(g, 3, 64)
            assert (step(x) - m(x)).abs().max() <= 1e-5, f"call {i}"
    assert step.stats()["replays"] == 2, step.stats()


class _Recurrent(nn.Module):
    """A 2-layer LSTM or GRU with a Linear head, as quantize_dynamic users write it."""

    def __init__(self, kind, **kw):
        super().__init__()
        self.rnn = getattr(nn, kind)(16, 32, 2, **kw)
        self.head = nn.Linear(64 if kw.get("bidirectional") else 32, 4)

    def forward(self, x, state=None):
        y, state = self.rnn(x, state)
        return self.head(y), state


def _flat(out):
    return torch.utils._pytree.tree_leaves(out)


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("dtype", [torch.qint8, torch.float16], ids=["qint8", "float16"])
@pytest.mark.parametrize("layout", ["sequence first", "batch first", "bidirectional"])
@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_quantize_dynamic_lstms_and_grus_replay_eagers_bits(kind, layout, dtype, entry, tmp_path):
    """Note [Packed quantized Linears]: a quantize_dynamic LSTM or GRU replays as aten's
    quantized_lstm / quantized_gru on eager's packed cells, through torchreplay.capture,
    torch.compile (the whole model one graph) and a saved program (the cells made again on load):
    bitwise to the quantized eager at 1, 3 and 2 threads changed between calls, with and without
    a state given, short and long sequences (dynamic), outputs' strides included."""
    torch.manual_seed(0)
    kw = {"batch first": {"batch_first": True}, "bidirectional": {"bidirectional": True}}.get(layout, {})
    m = _quantize_dynamic(_Recurrent(kind, **kw).eval(), {nn.LSTM, nn.GRU, nn.Linear}, dtype)
    g = gen(3)
    directions = 2 if layout == "bidirectional" else 1
    with torch.no_grad():
        step = Entry(entry, m, (rn(g, 5, 3, 16),), tmp_path)
        long = Entry(entry, m, (rn(g, 300, 3, 16),), tmp_path, dynamic=True)
        for i, n_threads in enumerate([1, 3, 3, 1, 2, 2]):
            with threads(n_threads):
                x = rn(g, 5, 3, 16)
                assert_bitwise(_flat(step(x)), _flat(m(x)), f"{kind}, {layout}, call {i} at {n_threads} threads")
        for i in range(4):   # each length's first call warms up, its second replays
            x = rn(g, 300 + 40 * (i // 2), 3, 16)
            assert_bitwise(_flat(long(x)), _flat(m(x)), f"{kind}, {layout}, {x.shape[0]} steps, call {i}")
        x = rn(g, 5, 3, 16)
        batch = 5 if layout == "batch first" else 3
        h = rn(g, 2 * directions, batch, 32)
        state = (h, rn(g, 2 * directions, batch, 32)) if kind == "LSTM" else h
        given = Entry(entry, m, (x, state), tmp_path)
        args = _flat((x, state)) if entry == "loaded" else (x, state)   # a program takes its arguments flattened
        for i in range(3):
            assert_bitwise(_flat(given(*args)), _flat(m(x, state)), f"{kind}, {layout}, state given, call {i}")
    for s in (step.stats(), long.stats(), given.stats()):
        assert s["replays"] >= 2 and s["eager_fallbacks"] == 0, s
        ops = [op for c in s["capture_log"] for op in c.get("functional_ops", [])]
        assert f"aten::quantized_{kind.lower()}.input" in ops or entry != "compile", ops   # not run between graphs
    if entry == "compile":
        assert [step.stats()["calls"], given.stats()["calls"]] == [6, 3]   # one graph a call: no break


def test_quantize_dynamic_lstm_weights_set_after_compiling_are_the_ones_used():
    """A packed LSTM's handle (Dynamo guards its value) is dropped when its cells are replaced
    (set_weight_bias, a cell given another, a cell put in the list): the next call compiles again
    with the new cells. A copy (its handle dropped by unpickling) given other weights by
    load_state_dict compiles with its own."""
    from torch.ao.nn.quantized.dynamic.modules.rnn import PackedParameter
    torch.manual_seed(0)
    m = _quantize_dynamic(_Recurrent("LSTM").eval(), {nn.LSTM, nn.Linear})
    donors = [_quantize_dynamic(_Recurrent("LSTM").eval(), {nn.LSTM}) for _ in range(3)]
    b = backend()
    f = torch.compile(m, backend=b)
    g = gen(6)
    with torch.no_grad():
        for step in range(4):
            if step == 1:
                m.rnn.set_weight_bias(donors[0].rnn.get_weight() | donors[0].rnn.get_bias())
            if step == 2:   # the second layer's cell alone
                m.rnn._all_weight_values[1].param = donors[1].rnn._all_weight_values[1].param
            if step == 3:
                m.rnn._all_weight_values[0] = PackedParameter(donors[2].rnn._all_weight_values[0].param)
            for i in range(2):
                x = rn(g, 5, 3, 16)
                assert_bitwise(_flat(f(x)), _flat(m(x)), f"step {step}, call {i}")
        for copied in (copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
            copied.rnn.load_state_dict(donors[2].rnn.state_dict())   # other cells
            compiled = torch.compile(copied, backend=b)   # Dynamo's cache of the same code and backend
            for i in range(2):
                x = rn(g, 5, 3, 16)
                assert_bitwise(_flat(compiled(x)), _flat(copied(x)), f"the copy, call {i}")
                assert_bitwise(_flat(f(x)), _flat(m(x)), f"the first model, call {i}")
    assert_exercised(b)
    assert len(b.stats()) == 6   # a graph for each set of cells


def test_quantize_dynamic_modules_other_than_linears_are_refused_with_what_works():
    torch.manual_seed(0)
    q = _quantize_dynamic(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LSTM(16, 16)).eval())
    q[2].register_forward_hook(lambda m, a, o: o)
    with pytest.raises(NotImplementedError, match=r"'2' is a torch.ao.quantization module .* takes quantize_dynamic's "
                                                  r"Linears, LSTMs and GRUs but not .* Int8DynamicActivationInt8Weig"):
        torchreplay.capture(q, (rn(gen(7), 3, 8),), config=config())
    assert type(q[0]).__name__ == "Linear" and q[0]._get_name() == "DynamicQuantizedLinear"   # put back


def test_quantize_dynamic_weights_set_after_a_capture_make_it_raise():
    """set_weight_bias packs new weights into a new object: the capture holds the old one, so its
    calls raise until captured again."""
    torch.manual_seed(0)
    m = _quantize_dynamic(encoder(64), {nn.Linear})
    x = rn(gen(2), 3, 64)
    with torch.no_grad():
        step = torchreplay.capture(m, (x,))
        assert_bitwise(step(x), m(x))
        m[3].set_weight_bias(m[3].weight(), None)
        with pytest.raises(ValueError, match=r"packed weights '_packed_params' of LinearPackedParams were replaced .* "
                                             "capture the model again"):
            step(x)
        assert_bitwise(torchreplay.capture(m, (x,))(x), m(x))


class _NormThenLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln, self.fc = nn.LayerNorm(8), nn.Linear(8, 16)

    def forward(self, x):
        return self.fc(self.ln(x * 2 + 1)).relu() * 3


@pytest.mark.parametrize("flavour", list(QUANTIZE_DYNAMIC))
def test_quantize_dynamic_linears_through_torch_compile_are_one_graph(flavour):
    """Note [Packed quantized Linears]: in frames torchreplay's backend compiles, each packed
    Linear is traced as one op on its packed object (Dynamo would break its graph there): the
    whole model one graph, replayed, eager's bits."""
    torch.manual_seed(0)
    m = _quantize_dynamic(encoder(64), *QUANTIZE_DYNAMIC[flavour])
    (stats,) = compiled_like_eager(m, 8, 3, 64).stats()
    ops = stats["capture_log"][0]["functional_ops"]
    assert sum(op.startswith("quantized::linear_dynamic") for op in ops) == 2, ops


def test_quantize_dynamic_weights_set_or_copied_after_compiling_are_the_ones_used(tmp_path):
    """A packed Linear's handle is a module attribute Dynamo guards: new weights (set_weight_bias),
    a copy given other weights, a model saved and loaded, each compile again with their own."""
    torch.manual_seed(0)
    m = _quantize_dynamic(encoder(64), {nn.Linear})
    b = backend()
    f = torch.compile(m, backend=b)
    g = gen(4)
    with torch.no_grad():
        for step in range(3):
            if step == 1:
                m[0].set_weight_bias(torch.quantize_per_tensor(rn(g, 96, 64), 0.05, 0, torch.qint8), None)
            for i in range(2):
                x = rn(g, 3, 64)
                assert_bitwise(f(x), m(x), f"step {step}, call {i}")
        other = copy.deepcopy(m)
        other[3].set_weight_bias(torch.quantize_per_tensor(rn(g, 32, 96), 0.05, 0, torch.qint8), other[3].bias())
        torch.save(other, tmp_path / "m.pt")
        loaded = torch.load(tmp_path / "m.pt", weights_only=False)
        for model in (copy.deepcopy(m), other, loaded):
            each = backend()
            compiled = torch.compile(model, backend=each)
            for i in range(2):
                x = rn(g, 3, 64)
                assert_bitwise(compiled(x), model(x), f"{i}")
                assert_bitwise(f(x), m(x), f"{i}: the first model")
            assert_exercised(each)
    assert_exercised(b)

