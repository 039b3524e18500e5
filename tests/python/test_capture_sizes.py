"""Batch-size buckets (Note [Capture sizes] in replay/buckets.h): with
config.reduce_overhead.capture_sizes, a batch that is not a capture size is padded up to the next
one, replayed, and sliced back; one above the largest runs eagerly. Graphs whose rows are not
independent are captured per size (python/torchreplay/capture_sizes.py)."""
import logging
import math
import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchreplay
from configs import backend
from differential import assert_bitwise, assert_close_not_bitwise, total

aten = torch.ops.aten
SIZES = [1, 2, 4, 8, 16, 32]


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32)).eval()


@torch.no_grad()
def test_a_decode_loop_over_batch_sizes_1_to_32_captures_six_and_then_only_replays():
    model = mlp()
    b = backend(capture_sizes=SIZES, capture_sizes_bitwise=False)   # addmm's padded rows are close
    c = torch.compile(model, backend=b, dynamic=True)
    rng = random.Random(0)
    order = list(range(1, 33))
    rng.shuffle(order)
    seen = set()
    for step, n in enumerate(order * 3):
        x = torch.randn(n, 64)
        y = c(x)
        assert y.shape == (n, 32)
        # Row-independent, but a GEMM over more rows may block its sums differently.
        assert_close_not_bitwise(y, model(x), 1e-5, 1e-6, f"step {step} (batch {n})")
        seen.add(next(s for s in SIZES if s >= n))
        if len(seen) == len(SIZES) and "after" not in locals():
            after = (step, total(b, "replays"), total(b, "calls"))
    assert total(b, "captures") == 6  # n == 1 is its own graph (Dynamo specializes 0 and 1)
    step, replays, calls = after
    assert total(b, "replays") - replays == total(b, "calls") - calls  # every later call replays
    assert total(b, "eager_fallbacks") == 0


@torch.no_grad()
def test_pool_is_the_largest_size_alone():
    model = mlp()
    alone = backend()
    c = torch.compile(model, backend=alone, dynamic=True)
    for _ in range(3):
        c(torch.randn(32, 64))
    torch._dynamo.reset()
    b = backend(capture_sizes=SIZES, capture_sizes_bitwise=False)
    c = torch.compile(model, backend=b, dynamic=True)
    for n in range(2, 33):
        c(torch.randn(n, 64))
        c(torch.randn(n, 64))
    assert max(s["pool_bytes"] for s in b.stats()) <= 1.1 * alone.stats()[0]["pool_bytes"]


def test_pointwise_rows_are_bitwise():
    seen = []

    def f(x, y):
        return torch.sin(x) * 2 + y, x.sum(1)

    b = backend(capture_sizes=[4, 8])
    c = torch.compile(f, backend=b, dynamic=True)
    for n in [3, 5, 3, 7, 8, 2, 6]:
        x, y = torch.randn(n, 16), torch.randn(n, 16)
        got = c(x, y)
        want = f(x, y)
        assert_bitwise(got, want, f"batch {n}")
    s = b.stats()[0]
    assert s["captures"] == 2 and s["eager_fallbacks"] == 0


def test_a_batch_above_the_largest_size_runs_eagerly_with_the_reason():
    f = lambda x: torch.relu(x) + 1
    b = backend(capture_sizes=[2, 4])
    c = torch.compile(f, backend=b, dynamic=True)
    for n in [3, 3, 3, 9, 9]:
        x = torch.randn(n, 4)
        assert_bitwise(c(x), f(x), f"batch {n}")
    s = b.stats()[0]
    assert s["eager_fallbacks"] == 2
    assert any("above the largest capture size (4)" in r for r in s["fallback_reasons"])


def test_capture_sizes_within_the_capture_limit():
    f = lambda x: x * 3
    b = backend(capture_sizes=[4, 8, 16], capture_limit=2)
    c = torch.compile(f, backend=b, dynamic=True)
    for n in [3, 3, 7, 7, 12, 12, 12]:
        x = torch.randn(n, 4)
        assert_bitwise(c(x), f(x), f"batch {n}")
    s = b.stats()[0]
    assert s["captures"] == 2 and s["eager_fallbacks"] == 3  # 16 is over the limit
    assert any("capture limit" in r for r in s["fallback_reasons"])


def test_a_write_into_a_padded_batch_input_reaches_the_callers_tensor():
    def f(x):
        x.mul_(2)
        return x + 1

    b = backend(capture_sizes=[4, 8])
    c = torch.compile(f, backend=b, dynamic=True)
    for n in [3, 3, 5, 5, 6]:
        x = torch.randn(n, 4)
        ref = x.clone()
        out = c(x)
        want = f(ref)
        assert_bitwise(out, want, f"batch {n}: output")
        assert_bitwise(x, ref, f"batch {n}: x after the call")
    assert b.stats()[0]["replays"] >= 2


def test_engine_precapture_captures_every_size_largest_first():
    from torch.fx.experimental.proxy_tensor import make_fx
    from torchreplay import _C
    from torchreplay.lowering import lower

    x = torch.randn(5, 8)
    gm = make_fx(lambda x: torch.tanh(x) * 2, tracing_mode="symbolic")(x)
    options = _C.EngineOptions(capture_sizes=[8, 2, 4], batch_inputs=[0], batch_outputs=[0])
    e = _C.Engine(lower(gm, [x]), options)
    e.precapture([[x]])
    s = e.stats()
    assert s["captures"] == 3
    assert [r["key"].split("(")[2].split(",")[0] for r in s["capture_log"]] == ["8", "4", "2"]
    for n in [1, 3, 5, 7]:
        x = torch.randn(n, 8)
        assert_bitwise(e.run([x])[0], torch.tanh(x) * 2, f"batch {n}")
    assert e.stats()["captures"] == 3


def test_bad_capture_sizes_are_a_clear_error():
    cfg = torchreplay.CompilerConfig()
    with pytest.raises(ValueError, match="capture_sizes"):
        cfg.reduce_overhead.capture_sizes = [0, 4]
    with pytest.raises(ValueError, match="capture_sizes"):
        torchreplay._C.EngineOptions(capture_sizes=[-1])


def calls_of(f, make, sizes, exact=True, **cfg):
    """Runs compiled f on make(n) for each n, each result bitwise eager's (exact=False: within
    float32's tolerance, for GEMMs, which may block their sums by row count); the stats."""
    torch._dynamo.reset()
    b = backend(capture_sizes=[4, 8], capture_sizes_bitwise=exact, **cfg)
    c = torch.compile(f, backend=b, dynamic=True)
    with torch.no_grad():
        for n in sizes:
            args = make(n)
            ours = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
            got, want = c(*ours), f(*args)
            got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
            if exact:
                assert_bitwise(got, want, f"batch {n}: outputs")
            else:
                assert [type(g) for g in got] == [type(w) for w in want], n
                assert_close_not_bitwise(got, want, 1e-5, 1e-6, f"batch {n}: outputs")
            assert_bitwise(ours, args, f"batch {n}: arguments after the call")  # writes into them, as eager's
    return b.stats()


# Each output row must come from the same input row alone; these break that, or use the batch
# size as a number, or write rows into a tensor that is no batch input.
MIXING = {
    "mean over the batch": lambda x: x.mean(0),
    "softmax over the batch": lambda x: torch.softmax(x, 0),
    "flip of the batch": lambda x: x.flip(0) * 2,
    "sum of everything": lambda x: x.exp().sum(),
    "batch size as a number": lambda x: x * x.shape[0],
    "batch size as an output": lambda x: (x * 2, x.shape[0] * 3),
    "batch size as a fill value": lambda x: (x + 1, torch.full((2,), x.shape[0])),
    "batch size plus one": lambda x: (x + 1, x.new_zeros(x.shape[0] + 1)),
    "flatten": lambda x: (x * 2).flatten(),
    "an output with two rows per batch element": lambda x: x.reshape(-1, 2) * 2,
    "cat along the batch": lambda x: torch.cat([x, x]) * 2,
    "slice of the batch": lambda x: x[1:] - x[:-1],
    "matmul across the batch": lambda x: x.t() @ x,
    "an output that is a view of a batch input": lambda x: x[:, 1:],
    # Another size bounds the batch rows: padding would break what the graph assumed of it.
    "a slice of the batch up to another size": (lambda x, y: x[:y.shape[0]] * 2,
                                                lambda n: (torch.randn(n, 4), torch.randn(n + 3, 2))),
    "gather from a tensor that is not batched": (lambda t, i: torch.gather(t, 1, i),
                                                 lambda n: (torch.randn(n + 2, 10), torch.randint(0, 10, (n, 2)))),
    "scatter from a tensor that is not batched": (lambda x, i, src: x.scatter(1, i, src),
                                                  lambda n: (torch.randn(n, 10), torch.randint(0, 10, (n, 2)),
                                                             torch.randn(n + 2, 2))),
}


@pytest.mark.parametrize("name", list(MIXING))
def test_a_graph_whose_rows_mix_is_captured_per_size_and_right(name, replay_log):
    with replay_log.at_level(logging.WARNING, logger="torchreplay"):
        f, make = MIXING[name] if isinstance(MIXING[name], tuple) else (MIXING[name], lambda n: (torch.randn(n, 4),))
        s = calls_of(f, make, [3, 3, 3, 2, 2, 2])
    assert sum(e["captures"] for e in s) == 2 and sum(e["cache_entries"] for e in s) == 2, s  # keys 3 and 2, not 4
    assert "capture_sizes do not apply" in replay_log.text


def test_a_cache_written_at_batch_indices_is_not_padded():
    def step(slots, kv, cache):
        cache.index_copy_(0, slots, kv)   # padded rows would write cache rows
        return kv * 2

    cache = torch.full((10, 4), 7.0)
    s = calls_of(step, lambda n: (torch.arange(5, 5 + n), torch.randn(n, 4), cache), [3, 3, 3, 2, 2, 2])
    assert sum(e["captures"] for e in s) == 2
    assert_bitwise(cache[0], torch.full((4,), 7.0), "cache row 0")


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.c1, self.bn = nn.Conv2d(4, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.c2, self.fc, self.ln = nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.Linear(16, 10), nn.LayerNorm(10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn(self.c1(x))), 2)
        x = F.adaptive_avg_pool2d(F.gelu(self.c2(x)), 1).flatten(1)
        return torch.softmax(self.ln(self.fc(x)), -1)


class AttentionBlock(nn.Module):
    """Pre-norm causal self-attention: its linears run on (n * L, d) views of (n, L, d)."""

    def __init__(self, d=32, heads=4):
        super().__init__()
        torch.manual_seed(0)
        self.heads, self.qkv, self.o, self.ln = heads, nn.Linear(d, 3 * d), nn.Linear(d, d), nn.LayerNorm(d)

    def forward(self, x):
        n, length, d = x.shape
        q, k, v = (t.view(n, length, self.heads, d // self.heads).transpose(1, 2)
                   for t in self.qkv(self.ln(x)).split(d, -1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(y.transpose(1, 2).reshape(n, length, d))


ROW_WISE = {  # (f, make(n)): kept bucketed, results bitwise eager's (models: within tolerance)
    "an attention block (rows of n * L)": (AttentionBlock().eval(), lambda n: (torch.randn(n, 9, 32),)),
    "pointwise ops whose rows stay bitwise": (lambda x, y: (torch.sin(x) * 2 + y, torch.tanh(x).clamp(-0.5, 0.5)),
                                              lambda n: (torch.randn(n, 16), torch.randn(n, 16))),
    "a conv net (batch norm, pooling, flatten, layer norm)": (ConvNet().eval(), lambda n: (torch.randn(n, 4, 16, 16),)),
    "softmax and sums along rows": (lambda x: torch.softmax(x, -1) + x.sum(1, keepdim=True),
                                    lambda n: (torch.randn(n, 8),)),
    "views keeping the batch first": (lambda x: x.view(x.shape[0], 2, 4).permute(0, 2, 1).reshape(x.shape[0], -1) * 2,
                                      lambda n: (torch.randn(n, 8),)),
    "layer norm": (lambda x: F.layer_norm(x, (8,)), lambda n: (torch.randn(n, 8),)),
    "embedding": (lambda i, w: F.embedding(i, w) * 2, lambda n: (torch.randint(0, 10, (n, 9)), torch.randn(10, 4))),
    "integer division by a batch input": (lambda x, y: (x // y, x % y),
                                          lambda n: (torch.randint(-50, 50, (n, 4)), torch.randint(1, 9, (n, 4)))),
    "a per-row cache written at a position": (
        lambda x, pos, cache: (cache.__setitem__((slice(None), pos), x.unsqueeze(1)), cache.sum(1))[1],
        lambda n: (torch.randn(n, 4), torch.tensor([2]), torch.randn(n, 6, 4))),
    "a per-row cache written by index_copy_": (
        lambda x, pos, cache: (cache.index_copy_(1, pos, x.unsqueeze(1)), cache * 2)[1],
        lambda n: (torch.randn(n, 4), torch.tensor([4]), torch.randn(n, 6, 4))),
}


@pytest.mark.parametrize("name", list(ROW_WISE))
def test_a_graph_whose_rows_are_independent_is_padded_and_bitwise(name):
    f, make = ROW_WISE[name]
    exact = not isinstance(f, nn.Module)   # the models' GEMMs and convolutions: close (capture_sizes_bitwise=False)
    s = calls_of(f, make, [3, 3, 3, 2, 2, 5, 6, 7], exact=exact)
    # sizes 3 and 2 pad to 4, sizes 5, 6 and 7 to 8: two keys, each captured, later calls replayed
    assert sum(e["captures"] for e in s) == 2 and sum(e["cache_entries"] for e in s) == 2, s
    assert sum(e["eager_fallbacks"] for e in s) == 0 and sum(e["replays"] for e in s) == 6, s


def test_a_channels_last_batch_stays_channels_last_when_padded():
    f = lambda x: x * 2  # noqa: E731
    make = lambda n: (torch.randn(n, 3, 5, 5).to(memory_format=torch.channels_last),)  # noqa: E731
    calls_of(f, make, [5, 5, 6])
    b = backend(capture_sizes=[4, 8])
    c = torch.compile(f, backend=b, dynamic=True)
    for n in [5, 5, 6]:
        (x,) = make(n)
        assert c(x).stride() == f(x).stride() == (75, 1, 15, 3)
    assert b.stats()[0]["replays"] >= 1


def test_a_row_broadcast_across_columns_by_index_put_is_not_padded(replay_log):
    def f(x, v):
        x = x.clone()
        x[:, torch.tensor([0, 2])] = v  # v[j] goes to column j of every row: v's n is not rows
        return x

    with replay_log.at_level(logging.WARNING, logger="torchreplay"):
        calls_of(f, lambda n: (torch.zeros(n, 3), torch.arange(n, dtype=torch.float32) + 1), [2, 2, 2])
    assert "capture_sizes do not apply" in replay_log.text


@torch.no_grad()
def test_outputs_fed_back_into_a_padded_call_stay_readable():
    def step(x, h):
        return torch.tanh(x + h)

    def bump(y):
        y.add_(1)
        return y * 2

    b = backend(capture_sizes=[4, 8])
    c, c_bump = torch.compile(step, backend=b, dynamic=True), torch.compile(bump, backend=b, dynamic=True)
    x = torch.randn(3, 4)
    h, h_ref = torch.zeros(3, 4), torch.zeros(3, 4)
    y, y_ref = torch.ones(3, 2), torch.ones(3, 2)
    for i in range(4):
        prev, h, h_ref = h, c(x, h), step(x, h_ref)
        assert_bitwise(h, h_ref, f"call {i}: h")
        assert torch.isfinite(prev).all()  # prev: this call's input, still valid
        y, y_ref = c_bump(y), bump(y_ref)
        assert_bitwise(y, y_ref, f"call {i}: y")
    assert sum(s["replays"] for s in b.stats()) >= 4


# Elementwise ops whose padded rows a graph may hold: the measurement (row_bits.py) decides.
ELEMENTWISE = [
    aten.mul.Tensor, aten.div.Tensor, aten.add.Tensor, aten.sub.Tensor, aten.maximum.default,
    aten.minimum.default, aten.fmod.Tensor, aten.remainder.Tensor, aten.atan2.default,
    aten.floor_divide.default, aten.pow.Tensor_Tensor, aten.copysign.Tensor, aten.where.self,
    aten.neg.default, aten.abs.default, aten.relu.default, aten.sqrt.default, aten.rsqrt.default,
    aten.reciprocal.default, aten.exp.default, aten.exp2.default, aten.log.default, aten.sin.default,
    aten.tanh.default, aten.erf.default, aten.sigmoid.default, aten.silu.default, aten.gelu.default,
    aten.hardswish.default, aten.hardtanh.default, aten.leaky_relu.default, aten.round.default,
    aten.floor.default, aten.clamp.default, aten.eq.Tensor, aten.lt.Tensor, aten.isnan.default,
]


def test_elementwise_rows_follow_an_independent_measurement():
    """row_bits measures each elementwise node: one contiguous run through the vector loop
    against runs of 3 through the tail, over every combination of special values (NaN payloads
    and signs, signed zeros, infinities, subnormals). Where it finds an op bitwise, the question
    asked another way must find no difference either: prefixes of many lengths of the same
    values, rotated so that each value ends a prefix somewhere, give the whole call's bits.
    Which ops pass depends on the CPU and is not asserted."""
    from torchreplay import row_bits
    checked = bitwise = 0
    for op in ELEMENTWISE:
        tensors = [a for a in op._schema.arguments if str(a.type) == "Tensor" and not a.kwarg_only]
        for dtype in (torch.float32, torch.float64, torch.bfloat16):
            for zero_dim_last in ((False, True) if len(tensors) == 2 else (False,)):
                kinds = tuple((a.name, "scalar" if zero_dim_last and k == len(tensors) - 1 else "array", dtype)
                              for k, a in enumerate(tensors))
                checked += 1
                if not row_bits._measure_elementwise(op, kinds, "cpu"):
                    continue
                bitwise += 1
                arrays = [k for k in kinds if k[1] == "array"]
                grids = torch.meshgrid(*[row_bits.special_values(dtype, "cpu", min(len(kinds), 3)) for _ in arrays],
                                       indexing="ij")
                flat = [g.reshape(-1) for g in grids]
                count = flat[0].numel()
                for s in (row_bits.special_values(dtype, "cpu", 3) if zero_dim_last else [None]):
                    for shift in range(0, count, 29):
                        args = [f.roll(shift) for f in flat] + ([s] if s is not None else [])
                        whole = op(*args)
                        for m in (1, 2, 5, 7, 16, 17, 31, 33, 65, 127, count - 1):
                            part = op(*[a[:m] if a.dim() else a for a in args])
                            assert_bitwise(part, whole[:m], f"{op} {kinds}, shift {shift}: the first {m} elements")
    assert checked >= 80 and bitwise >= 1


def _special_batch(n, seed=0, width=6):
    """n rows of special values: infinities, NaNs of several payloads and signs, signed zeros,
    subnormals, as the rows of a batch, in an order drawn from seed."""
    from torchreplay import row_bits
    v = row_bits.special_values(torch.float32)
    v = v[torch.randperm(v.numel(), generator=torch.Generator().manual_seed(seed))]
    return v.repeat(n * width // v.numel() + 1)[: n * width].view(n, width)


@torch.no_grad()
@pytest.mark.parametrize("name", ["floor_divide", "hardswish", "along rows"])
def test_nan_bits_survive_padding_through_both_entry_points(name):
    """A padded batch's real rows carry eager's bits, NaN payloads and signs included: `inf //
    0.3` and hardswish of a NaN give other NaN bits through the vector loop than through the
    scalar tail on some CPUs, and padding moves rows between the two. Such a graph is captured
    per size unless the measurement finds its ops bitwise; either way every call is eager's."""
    f = {"floor_divide": lambda x: x // 0.3, "hardswish": F.hardswish,
         "along rows": lambda x: (torch.softmax(x, -1), x.sum(1), F.layer_norm(x, (6,)), x.amax(1))}[name]

    class M(nn.Module):
        def forward(self, x):
            return f(x)

    b = backend(capture_sizes=[1, 2, 4, 8])
    c = torch.compile(f, backend=b, dynamic=True)
    cfg = torchreplay.CompilerConfig()
    cfg.mode = "reduce-overhead"
    cfg.reduce_overhead.capture_sizes = [1, 2, 4, 8]
    step = torchreplay.capture(M(), (_special_batch(8),), config=cfg, dynamic=True)
    for seed, n in enumerate((5, 6, 7) * 6 + (8, 8)):
        x = _special_batch(n, seed)
        want = f(x)
        for entry, got in (("torch.compile", c(x.clone())), ("torchreplay.capture", step(x.clone()))):
            assert_bitwise(got, want, f"{name} through {entry}, batch {n} (seed {seed})")
    assert total(b, "replays") > 0 and step.stats()["replays"] > 0


@torch.no_grad()
def test_padding_that_would_change_bits_is_refused_unless_allowed(replay_log, monkeypatch):
    """An op measured to give padded rows other bits (here silu, whatever this CPU measures)
    keeps its graph's sizes captured one by one, bitwise; capture_sizes_bitwise=False pads them."""
    from torchreplay import row_bits
    measure = row_bits._measure_elementwise
    monkeypatch.setattr(row_bits, "_measure_elementwise",
                        lambda op, *a: op is not aten.silu.default and measure(op, *a))
    x = torch.randn(5, 4)
    for bitwise in (True, False):
        torch._dynamo.reset()
        b = backend(capture_sizes=[1, 2, 4, 8], capture_sizes_bitwise=bitwise)
        c = torch.compile(F.silu, backend=b, dynamic=True)
        with replay_log.at_level(logging.INFO, logger="torchreplay"):
            for n in (5, 6, 7, 5, 6, 7):
                x = torch.randn(n, 4)
                got = c(x)
                if bitwise:
                    assert_bitwise(got, F.silu(x), f"batch {n}")
                else:   # float32's default tolerances of torch.testing.assert_close
                    assert_close_not_bitwise(got, F.silu(x), 1.3e-6, 1e-5, f"batch {n}, padded")
        assert b.stats()[0]["cache_entries"] == (3 if bitwise else 1)
    assert "aten.silu.default give a row other bits" in replay_log.text
    assert "capture_sizes_bitwise = False to pad anyway" in replay_log.text
    assert "its padded rows are close to eager, not bitwise (aten.silu.default" in replay_log.text


@torch.no_grad()
def test_buckets_through_torchreplay_capture():
    """The Dynamo-free entry pads as torch.compile does: sizes 2..32 in random order make five
    captures (2, 4, 8, 16, 32; size 1 is a trace of its own), then every call replays."""
    model = mlp()
    cfg = torchreplay.CompilerConfig()
    cfg.mode = "reduce-overhead"
    cfg.reduce_overhead.capture_sizes = SIZES
    cfg.reduce_overhead.capture_sizes_bitwise = False
    step = torchreplay.capture(model, (torch.randn(8, 64),), config=cfg, dynamic=True)
    order = list(range(1, 33))
    random.Random(0).shuffle(order)
    for n in order * 3:
        x = torch.randn(n, 64)
        got = step(x)
        assert got.shape == (n, 32)
        assert_close_not_bitwise(got, model(x), 1e-5, 1e-6, f"batch {n}")
        if n == 1:
            assert_bitwise(got, model(x), "batch 1")   # its own trace, not padded
    s = step.stats()
    assert s["captures"] == 6 and s["eager_fallbacks"] == 0
    assert [t["captures"] for t in s["traces"]] == [5, 1]
    calls, replays = s["calls"], s["replays"]
    for n in order:
        step(torch.randn(n, 64))
    assert step.stats()["replays"] - replays == step.stats()["calls"] - calls == 32


def test_calls_with_a_batch_input_that_is_not_dense_are_not_padded():
    """A strided or expanded batch input would be padded into a dense copy, and a kernel may take
    another path (and round otherwise) on it: x[:, ::2].sum(1) summed in another order. Such
    calls run under their own key, bitwise; dense calls of the same graph are still padded."""
    f = lambda x, y: (x.sum(1), (y.add_(1) * 2).mean(1))  # noqa: E731
    makes = {"strided": lambda n: torch.randn(n, 74)[:, ::2], "expanded": lambda n: torch.randn(n, 1).expand(n, 37),
             "dense": lambda n: torch.randn(n, 37)}
    for name, make in makes.items():
        torch._dynamo.reset()
        b = backend(capture_sizes=[4, 8])
        c = torch.compile(f, backend=b, dynamic=True)
        with torch.no_grad():
            for n in [3, 3, 3, 2, 2, 2]:
                x, y = make(n), torch.randn(n, 4)
                y_ref = y.clone()
                got, want = c(x, y), f(x, y_ref)
                assert_bitwise(got, want, f"{name}, batch {n}: outputs")
                assert_bitwise(y, y_ref, f"{name}, batch {n}: y after the call")
        s = b.stats()[0]
        assert s["cache_entries"] == (1 if name == "dense" else 2), (name, s)   # dense: 3 and 2 padded to 4


class _CacheWrite(nn.Module):
    """A decode step writing each row's new entry into its row of a KV cache passed in."""

    def forward(self, x, pos, cache):
        cache.index_copy_(1, pos, x[:, None] * 2)
        return cache * 3


def _capture_with_buckets(model, example):
    cfg = torchreplay.CompilerConfig()
    cfg.mode = "reduce-overhead"
    cfg.reduce_overhead.capture_sizes = [1, 2, 4, 8]
    return torchreplay.capture(model, example, config=cfg, dynamic=True)


def _cache_call(n, seed, rows=None):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, 4, generator=g), torch.tensor([seed % 6]),
            torch.randn(n if rows is None else rows, 6, 4, generator=g))


@torch.no_grad()
def test_capture_pads_together_two_batch_symbols_that_an_op_ties():
    """torch.export gives x (B, d) and the per-row cache (B, T, d) that index_copy_ writes it into
    a batch symbol each: the graph says nothing of their being equal, only the kernel requires it.
    Padding one and not the other made every batch off the bucket list fail ("Source/destination
    tensor must have same slice shapes"); the two are one batch (Note [Capture sizes]): padded
    together, replayed from the bucket's capture, bitwise eager's, and a call where they differ is
    not padded and raises eager's own error."""
    model = _CacheWrite()
    step = _capture_with_buckets(model, _cache_call(4, 0))
    for i, n in enumerate([3, 5, 6, 7, 3, 5, 6, 7, 3, 4]):
        args, ref = _cache_call(n, i), _cache_call(n, i)
        got, want = step(*args), model(*ref)
        assert_bitwise(got, want, f"call {i} (batch {n})")
        assert_bitwise(args[2], ref[2], f"call {i} (batch {n}): the cache")
    s = step.stats()
    # 3 padded to 4, 5, 6 and 7 to 8: two keys (4 and 8), each warmed up once, then captured
    # (a capture replays too) and replayed
    assert s["captures"] == 2 and s["cache_entries"] == 2 and s["eager_fallbacks"] == 0 and s["errors"] == 0, s
    assert s["warmups"] == 2 and s["replays"] == 10 - 2, s
    with pytest.raises(RuntimeError) as eager_error:
        model(*_cache_call(3, 0, rows=5))
    with pytest.raises(RuntimeError) as ours:
        step(*_cache_call(3, 0, rows=5))
    assert str(eager_error.value) in str(ours.value), (ours.value, eager_error.value)
    args, ref = _cache_call(5, 1), _cache_call(5, 1)
    assert_bitwise(step(*args), model(*ref), "after the error")


@torch.no_grad()
def test_a_cache_written_from_rows_of_another_batch_size_is_not_padded_alone(replay_log):
    """When the two batch symbols cannot be one batch (here x's rows are also summed over), the
    cache's symbol alone is refused too: its rows are written from x's, which padding would not
    give it. Every size is captured on its own, with the reason logged, and right."""
    class WriteAndSum(nn.Module):
        def forward(self, x, pos, cache):
            cache.index_copy_(1, pos, x[:, None] * 2)
            return cache * 3, x.sum(0)

    model = WriteAndSum()
    with replay_log.at_level(logging.WARNING, logger="torchreplay"):
        step = _capture_with_buckets(model, _cache_call(4, 0))
    assert "capture_sizes do not apply" in replay_log.text
    for i, n in enumerate([3, 3, 3, 5, 5, 5]):
        args, ref = _cache_call(n, i), _cache_call(n, i)
        assert_bitwise(step(*args), model(*ref), f"call {i} (batch {n})")
        assert_bitwise(args[2], ref[2], f"call {i}: the cache")
    s = step.stats()
    assert s["captures"] == 2 and s["cache_entries"] == 2 and s["replays"] == 4 and s["errors"] == 0, s  # keys 3, 5
