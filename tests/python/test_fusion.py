"""Fused elementwise steps (Note [Fused elementwise steps] in capture/tape/fused/fused_elementwise.h): every
fused op against eager, bit for bit, at every length around the vector blocks, in every layout
the fused kernel takes (contiguous, broadcast, rows, strided, transposed), on one and two threads,
with NaNs, infinities, signed zeros and subnormals; and each case checks that it was fused and
replayed."""
import math

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from differential import assert_bitwise
from torchreplay import _C
from torchreplay.lowering import lower

FLOATS = (torch.float32, torch.float64)

# name -> (fn, dtypes, inputs): every fused op, alone, as the ATen graph has it.
UNARY = {
    "neg": torch.neg, "abs": torch.abs, "reciprocal": torch.reciprocal, "rsqrt": torch.rsqrt,
    "sigmoid": torch.sigmoid, "silu": torch.nn.functional.silu, "exp2": torch.exp2,
    "exp": torch.exp, "log": torch.log, "sin": torch.sin, "cos": torch.cos, "tanh": torch.tanh,
    "erf": torch.erf, "sqrt": torch.sqrt, "log1p": torch.log1p, "expm1": torch.expm1,
    "relu": torch.relu, "round": torch.round,
    "pow 2": lambda x: x.pow(2), "pow 3": lambda x: x.pow(3), "pow -2": lambda x: x.pow(-2),
    "pow 0.5": lambda x: x.pow(0.5), "pow -0.5": lambda x: x.pow(-0.5), "pow -1": lambda x: x.pow(-1),
    "clamp": lambda x: x.clamp(-0.5, 0.75), "clamp min": lambda x: x.clamp(min=-0.25),
    "clamp max": lambda x: x.clamp(max=0.3), "clamp_min": lambda x: torch.clamp_min(x, 0.1),
    "clamp_max": lambda x: torch.clamp_max(x, -0.1),
    "times a number": lambda x: x * 1.01, "plus a number": lambda x: x + 0.1,
    "divided by a number": lambda x: x / 3.0, "minus a number": lambda x: x - 2.5,
}
BINARY = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div,
    "add alpha -1": lambda x, y: torch.add(x, y, alpha=-1), "sub alpha -1": lambda x, y: torch.sub(x, y, alpha=-1),
    "lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge, "eq": torch.eq, "ne": torch.ne,
    "where": lambda x, y: torch.where(x > y, x, y),
}
INT_BINARY = ("add", "sub", "mul", "lt", "le", "gt", "ge", "eq", "ne", "where")

SELECT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                 torch.int16, torch.int8, torch.uint8, torch.bool)


def special(n, dtype, seed):
    """Random values with infinities, signed zeros, subnormals, huge and tiny numbers mixed in,
    and NaNs (two payloads and a sign) for odd seeds. A fused step reruns its nodes through
    their own kernels when two NaNs meet in one element or a NaN reaches a Sleef function
    (fused::Instr::NanCheck), so only the even seeds show the fused kernel's own bits there."""
    g = torch.Generator().manual_seed(seed)
    if not dtype.is_floating_point:
        x = torch.randint(-5, 6, (n,), generator=g, dtype=dtype)
        x[::7] = torch.iinfo(dtype).max
        x[3::11] = torch.iinfo(dtype).min
        return x
    x = torch.randn(n, generator=g, dtype=torch.float64) * 3
    tiny = 1e-40 if dtype == torch.float32 else 1e-310
    values = [math.inf, -math.inf, 0.0, -0.0, tiny, -tiny, 1e30, -1e-30]
    if seed % 2:
        values += [math.nan, -math.nan]
    for k, v in enumerate(values):
        x[k::13] = v
    x = x.to(dtype)
    if n > 20 and seed % 2:  # a NaN with another payload
        bits = x.view(torch.int32 if dtype == torch.float32 else torch.int64)
        bits[20] = 0x7FC00123 if dtype == torch.float32 else 0x7FF8000000000123
    return x


def layouts(n, dtype, seed):
    """Inputs of n elements in each layout: name -> make(k) giving the k-th input."""
    def contiguous(k):
        return special(n, dtype, seed + k)

    def rows(k):  # three rows of n with a gap between them: each row its own loop, with its tail
        return special(3 * (n + 1), dtype, seed + k).view(3, n + 1)[:, :n]

    def strided(k):
        return special(2 * n, dtype, seed + k)[::2]

    def transposed(k):
        return special(n * 2, dtype, seed + k).view(n, 2).t()

    return {"contiguous": contiguous, "rows": rows, "strided": strided, "transposed": transposed}


def capture_and_compare(fn, inputs_for_call, calls=4, fuse_expected=True):
    """Captures fn on an engine, calls it `calls` times on fresh inputs, compares every result with
    eager (assert_bitwise); returns the engine's capture log."""
    example = inputs_for_call(0)
    engine = _C.Engine(lower(make_fx(fn)(*example), example, ()), _C.EngineOptions(capture_limit=1000))
    for k in range(calls):
        args = inputs_for_call(k)
        want = fn(*args)  # same layouts: a clone of a strided tensor would be contiguous
        got = engine.run(list(args))[0]
        assert_bitwise(got, want, f"call {k}")
    stats = engine.stats()
    assert stats["replays"] == calls - 1, stats  # the first call warms up, the second captures and replays
    log = stats["capture_log"][-1]
    if fuse_expected:
        assert log["fused_nodes"] >= 1 and log["steps"] == log["fused_steps"], log
    return log


LENGTHS = [1, 2, 7, 8, 15, 16, 17, 31, 32, 33, 47, 63, 64, 65, 100, 513, 1037, 2049]


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("name", list(UNARY))
def test_every_unary_op_is_fused_bitwise_at_every_length_and_layout(name, dtype):
    op = UNARY[name]
    fn = lambda x: op(x)  # noqa: E731
    for n in LENGTHS:
        for layout, make in layouts(n, dtype, seed=n).items():
            try:
                capture_and_compare(fn, lambda k: (make(k),))
            except AssertionError as e:
                raise AssertionError(f"{name} {dtype} n={n} {layout}: {e}") from None


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_round_takes_halves_to_even_as_eager_in_a_fake_quantize_chain(dtype, threads):
    """PT2E's quantize then dequantize in fp32 (Note [PT2E's quantize ops] in passes.py): halves,
    their neighbours one ulp away and values past the clamp, over short and long rows."""
    def fake_quantize(x):
        return (torch.clamp(torch.round(x * (1.0 / 0.25)) + 3, 0, 255) - 3) * 0.25

    def inputs(n, k):
        halves = (torch.arange(n, dtype=torch.float64) - n // 2 + 0.5).to(dtype) * 0.25
        x = halves.clone()
        x[k % 3::3] = torch.nextafter(halves[k % 3::3], torch.tensor(math.inf, dtype=dtype))
        x[(k + 1) % 3::7] = special(n, dtype, 2 * k)[(k + 1) % 3::7]
        return (x,)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for n in (7, 64, 1037, 70000):
            log = capture_and_compare(fake_quantize, lambda k: inputs(n, k))
            assert log["fused_nodes"] == 6, log
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("dtype", FLOATS + (torch.int64,), ids=str)
@pytest.mark.parametrize("name", list(BINARY))
def test_every_binary_op_is_fused_bitwise_with_broadcasts(name, dtype):
    if dtype == torch.int64 and name not in INT_BINARY:
        pytest.skip("computed in float by eager (a cast the fused kernel does not make)")
    op = BINARY[name]
    fn = lambda x, y: op(x, y)  # noqa: E731
    for n in LENGTHS:
        shapes = {
            "same layout": lambda k: (special(n, dtype, k), special(n, dtype, 100 + k)),
            "a 0-dim operand": lambda k: (special(n, dtype, k), special(1, dtype, 100 + k)[0].clone()),
            "0-dim first": lambda k: (special(1, dtype, k)[0].clone(), special(n, dtype, 100 + k)),
            "rows broadcast": lambda k: (special(3 * n, dtype, k).view(3, n), special(n, dtype, 100 + k)),
            "column broadcast": lambda k: (special(3 * n, dtype, k).view(n, 3), special(n, dtype, 100 + k).view(n, 1)),
            "strided and transposed": lambda k: (special(2 * n, dtype, k)[::2], special(2 * n, dtype, 100 + k).view(n, 2).t()[0]),
        }
        for layout, make in shapes.items():
            try:
                capture_and_compare(fn, make)
            except AssertionError as e:
                raise AssertionError(f"{name} {dtype} n={n} {layout}: {e}") from None


def signed_zeros_and_nans(n, dtype, seed):
    """Pairs (x, y) where maximum's two lambdas disagree: +0 against -0 both ways, NaNs of either
    sign in either operand, beside random values."""
    g = torch.Generator().manual_seed(seed)
    x, y = (torch.randn(n, generator=g, dtype=torch.float64).to(dtype) for _ in range(2))
    x[0::5], y[0::5] = 0.0, -0.0
    x[1::5], y[1::5] = -0.0, 0.0
    x[2::7], y[3::7] = math.nan, -math.nan
    return x, y


MAXIMUM = {"maximum": torch.maximum, "clamp_min tensor": torch.clamp_min,
           "clamp_min_ tensor": lambda x, y: x.clamp_min_(y) * 1}


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("name", list(MAXIMUM))
def test_maximum_takes_the_path_eager_gives_each_element(name, dtype):
    """maximum_kernel (maximum, clamp_min with a tensor bound, amsgrad's update): its vector lambda
    keeps y of +0 and -0 and makes a NaN all ones, its scalar lambda keeps x and gives the quiet
    NaN, so each element takes eager's path, in the blocks of the AVX2 kernel eager runs where
    the CPU capability is AVX512 too; at every length, broadcast, strided and in place."""
    op = MAXIMUM[name]
    for n in LENGTHS:
        shapes = {
            "same layout": lambda k: signed_zeros_and_nans(n, dtype, k),
            "a 0-dim bound": lambda k: (signed_zeros_and_nans(n, dtype, k)[0], torch.tensor(-0.0, dtype=dtype)),
            "rows broadcast": lambda k: (signed_zeros_and_nans(3 * n, dtype, k)[0].view(3, n),
                                         signed_zeros_and_nans(n, dtype, 50 + k)[1]),
            "strided": lambda k: tuple(t[::2] for t in signed_zeros_and_nans(2 * n, dtype, k)),
        }
        for layout, make in shapes.items():
            try:
                log = capture_in_place_and_compare(op, make)
            except AssertionError as e:
                raise AssertionError(f"{name} {dtype} n={n} {layout}: {e}") from None
            assert log["steps"] == log["fused_steps"] == 1, (name, layout, log)


@pytest.mark.parametrize("dtype", SELECT_DTYPES, ids=str)
def test_selects_move_bits_in_every_dtype(dtype):
    """where and masked_fill move elements as they are, of any dtype of up to 8 bytes."""
    def make(n, seed):
        if dtype == torch.bool:
            return torch.rand(n, generator=torch.Generator().manual_seed(seed)) > 0.5
        return special(n, torch.float64 if dtype.is_floating_point else torch.int64, seed).to(dtype)
    fill = True if dtype == torch.bool else -3 if not dtype.is_floating_point else float("-inf")
    fill = 3 if dtype == torch.uint8 else fill
    fn = lambda x, y, m: (torch.where(m, x, y), x.masked_fill(m, fill), y.masked_fill(m[0], fill))  # noqa: E731
    for n in (1, 7, 33, 100):
        def inputs(k):
            mask = torch.rand(n, generator=torch.Generator().manual_seed(k)) > 0.5
            return make(n, k), make(n, 50 + k), mask
        example = inputs(0)
        engine = _C.Engine(lower(make_fx(fn)(*example), example, ()), _C.EngineOptions())
        for k in range(4):
            args = inputs(k)
            for got, want in zip(engine.run(list(args)), fn(*args)):  # run() empties its list
                assert_bitwise(got, want, f"n={n} call {k}")
        log = engine.stats()["capture_log"][-1]
        assert log["fused_nodes"] == 3, log  # m[0], a view of an argument, is a step between them


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("name", ["sigmoid", "silu", "exp2", "exp", "relu"])
def test_large_tensors_are_cut_where_eager_cuts_them_on_each_thread_count(name, threads):
    """Above TensorIterator's grain (32768 elements), eager splits a range per thread and each
    thread's range has its own scalar tail: the fused kernel cuts the same ranges. Below it the
    fused step still shares a long piece out over the threads (Note [Fused steps on ATen's
    threads]), each element keeping its place in the piece."""
    op = UNARY[name]
    fn = lambda x: op(op(x) * 0.5)  # noqa: E731
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for n in (4099, 20011, 32767, 32768, 40010, 65571, 1 << 20):
            capture_and_compare(fn, lambda k: (special(n, torch.float32, n + k),))
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("threads", [1, 2])
def test_strided_iteration_spaces_are_walked_row_by_row_from_any_start(threads):
    """A three-dim strided iteration space above the grain: on two threads each range starts in
    the middle of a row and of the dims above it; the kernel walks every row from there."""
    fn = lambda x: torch.sigmoid(x.permute(2, 0, 1) * 0.5 + 1).neg()  # noqa: E731
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for shape in [(23, 29, 31), (37, 41, 29), (5, 3000, 7), (3, 9000, 1)]:
            n = shape[0] * shape[1] * shape[2]
            log = capture_and_compare(fn, lambda k: (special(n, torch.float32, k).view(shape),),
                                      fuse_expected=False)
            assert log["fused_nodes"] == 4 and log["fused_steps"] == 1, log  # the permute of the input: a view step
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("threads", [1, 2])
def test_many_short_rows_are_bitwise_whichever_way_the_step_takes(threads):
    """A channels-last map times a per-channel scale (a squeeze-excitation's): 576 rows of 16, so
    the step times the fused kernel against the ops over its first runs and keeps the faster
    (Note [A fused step no slower than its ops]); every call eager's bits, before and after."""
    fn = lambda x, s: x * torch.nn.functional.hardsigmoid(s) + 1  # noqa: E731
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        log = capture_and_compare(fn, lambda k: (special(16 * 24 * 24, torch.float32, k).view(1, 24, 24, 16)
                                                 .permute(0, 3, 1, 2), special(16, torch.float32, 50 + k)
                                                 .view(1, 16, 1, 1)), calls=16, fuse_expected=False)
        assert log["fused_steps"] == 1, log
    finally:
        torch.set_num_threads(saved)


CHAINS = {
    "rms norm tail": lambda x, w: w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)),
    "swiglu": lambda x, w: torch.nn.functional.silu(x) * w,
    "rotary": lambda x, w: x * torch.cos(w) + torch.cat([-x[..., 4:], x[..., :4]], -1) * torch.sin(w),
    "gelu by hand": lambda x, w: 0.5 * x * (1 + torch.tanh(0.79788456 * (x + 0.044715 * x.pow(3)))),
    "masked": lambda x, w: torch.where(x > w, torch.exp(x - w), w) / (w * w + 1),
    "transposed read of an intermediate": lambda x, w: ((x * 2).t() + w.t()).t() * (x * 2),
    "long chain": lambda x, w: torch.sigmoid(torch.sigmoid(x * w + 1) - x).clamp(0.1, 0.9).log() * 3,
}


@pytest.mark.parametrize("name", list(CHAINS))
@pytest.mark.parametrize("n", [8, 37, 64, 2000])
def test_chains_over_one_iteration_space_are_fused_and_bitwise(name, n):
    fn = CHAINS[name]
    log = capture_and_compare(fn, lambda k: (special(n * 8, torch.float32, k).view(n, 8),
                                             special(8, torch.float32, 50 + k).expand(n, 8).clone()),
                              fuse_expected=False)
    assert log["fused_nodes"] >= 2, log


def test_a_chain_walked_in_pieces_reads_what_it_wrote():
    """A segment runs every instruction on a piece before the next piece; an intermediate read
    in another element order than it was written (a transposed view) starts a new segment."""
    fn = lambda x, y: ((x * 2) + 1).t() * y + (x * 2).t()  # noqa: E731
    capture_and_compare(fn, lambda k: (special(64 * 64, torch.float32, k).view(64, 64),
                                       special(64 * 64, torch.float32, 9 + k).view(64, 64)))


def _returned(x, y):
    a = torch.sigmoid(x) * y
    return torch.tanh(a), a


def _read_after(x, y):
    a = torch.sigmoid(x) * y
    return torch.tanh(a) + a.sum()


def _long_chain(x, y):
    for _ in range(4):
        x = torch.tanh(torch.sigmoid(x) * y) + y
    return x


KEPT = {  # name -> (fn, intermediates the fused kernel keeps in chunks)
    "chain": (lambda x, y: torch.tanh(torch.sigmoid(x) * y) + y, 3),
    "a chain of sixteen": (_long_chain, 15),
    "an intermediate also returned": (_returned, 1),
    "an intermediate read after the group": (_read_after, 1),
}


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("name", list(KEPT))
def test_intermediates_nothing_else_reads_stay_in_chunks(name, threads):
    """Note [Intermediates kept in chunks]: only intermediates no later node and no output reads
    skip memory; the results stay eager's bits on every path (odd seeds take the per-node calls)."""
    fn, kept = KEPT[name]
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        n = 3 * 65536 + 37  # above the grain: cut per thread as eager cuts it
        inputs = lambda k: (special(n, torch.float32, k), special(n, torch.float32, 40 + k))  # noqa: E731
        example = inputs(0)
        engine = _C.Engine(lower(make_fx(fn)(*example), example, ()), _C.EngineOptions(capture_limit=1000))
        for k in range(6):
            want = fn(*inputs(k))
            got = engine.run(list(inputs(k)))
            for g, w in zip(got, want if isinstance(want, tuple) else (want,)):
                assert_bitwise(g, w, f"call {k}")
        assert engine.stats()["replays"] == 5, engine.stats()
        notes = [s["note"] for s in engine.profile(list(inputs(0)), 1) if s["kind"] == "fused elementwise"]
        assert notes[0] == f"{kept} intermediates kept in chunks by the fused kernel", notes
    finally:
        torch.set_num_threads(saved)


def test_kept_intermediates_reuse_memory_as_the_unfused_tape_does():
    """The planned buffers of intermediates kept in chunks take their unfused liveness: a chain
    of sixteen needs no more arena than its unfused tape, and both ways of the step (the kernel,
    and the per-node calls it runs on NaN inputs, odd seeds) give eager's bits."""
    n = 4096 + 3
    inputs = lambda k: (special(n, torch.float32, k), special(n, torch.float32, 20 + k))  # noqa: E731
    example = inputs(0)
    graph = lower(make_fx(_long_chain)(*example), example, ())
    on, off = (_C.Engine(graph, _C.EngineOptions(fuse_elementwise=f)) for f in (True, False))
    for k in range(4):
        want = _long_chain(*inputs(k))
        assert_bitwise(on.run(list(inputs(k)))[0], want, f"fused, call {k}")
        assert_bitwise(off.run(list(inputs(k)))[0], want, f"unfused, call {k}")
    assert on.stats()["replays"] == 3 and off.stats()["replays"] == 3
    fused, unfused = on.stats()["capture_log"][-1], off.stats()["capture_log"][-1]
    assert fused["fused_nodes"] == 16 and unfused["fused_nodes"] == 0, (fused, unfused)
    # sixteen separate buffers would be 16 * n * 4 bytes; the unfused tape reuses two or three
    assert fused["arena_bytes"] <= unfused["arena_bytes"] < 8 * n * 4, (fused, unfused)


def test_fusion_off_gives_the_same_bits_and_no_fused_steps():
    fn = CHAINS["rms norm tail"]
    example = (torch.randn(4, 64), torch.randn(64))
    graph = lower(make_fx(fn)(*example), example, ())
    on, off = (_C.Engine(graph, _C.EngineOptions(fuse_elementwise=f)) for f in (True, False))
    for _ in range(3):
        args = [torch.randn(4, 64), torch.randn(64)]
        assert_bitwise(on.run(list(args))[0], off.run(list(args))[0], "fused against unfused")  # run() empties its list
    assert on.stats()["capture_log"][-1]["fused_nodes"] == 5
    assert off.stats()["capture_log"][-1]["fused_nodes"] == 0


def test_ops_that_are_not_fused_keep_their_own_steps_and_stay_exact():
    """A dtype cast inside the op (float * int), a NaN clamp bound, a generic pow exponent and an
    op the kernel does not compute all run as their own steps."""
    fn = lambda x, i: (x * i, x.clamp(min=float("nan")), x.pow(1.3), torch.nn.functional.gelu(x), x.sin())  # noqa: E731
    example = (torch.randn(33), torch.arange(33))
    engine = _C.Engine(lower(make_fx(fn)(*example), example, ()), _C.EngineOptions())
    for _ in range(3):
        args = [torch.randn(33), torch.arange(33)]
        for got, want in zip(engine.run(list(args)), fn(*args)):  # run() empties its list
            assert_bitwise(got, want)
    log = engine.stats()["capture_log"][-1]
    assert log["fused_nodes"] == 1 and log["steps"] == 5, log


# In-place ops, addcmul, addcdiv and pow of a scalar base (Note [In-place instructions] in
# capture/tape/fused/fused_elementwise.cc): what an optimizer's update is made of once its foreach ops are
# per-tensor ops (Note [Foreach ops as per-tensor ops] in foreach_passes.py).
aten = torch.ops.aten


def copy_like(t):
    """A copy with t's sizes and strides (a clone of a strided tensor would be contiguous)."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype).copy_(t)


def capture_in_place_and_compare(fn, inputs_for_call, calls=4, threads=None):
    """fn writes some of its inputs in place: eager and the engine each get their own copies of a
    call's inputs (same layouts), and the inputs after the call are compared as well as the
    results. Returns the capture log."""
    saved = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        example = [copy_like(t) for t in inputs_for_call(0)]
        graph = make_fx(fn)(*[copy_like(t) for t in example])
        engine = _C.Engine(lower(graph, example, ()), _C.EngineOptions(capture_limit=1000))
        for k in range(calls):
            args = inputs_for_call(k)
            mine = [copy_like(t) for t in args]
            want = fn(*args)
            got = engine.run(list(mine))
            assert_bitwise(got[0], want, f"call {k}: result")
            for j, (m, a) in enumerate(zip(mine, args)):
                assert_bitwise(m, a, f"call {k}: input {j} written in place")
        stats = engine.stats()
    finally:
        torch.set_num_threads(saved)
    assert stats["replays"] == calls - 1, stats
    return stats["capture_log"][-1]


POINTWISE = {
    "addcmul": lambda s, a, b, v: torch.addcmul(s, a, b, value=v),
    "addcdiv": lambda s, a, b, v: torch.addcdiv(s, a, b, value=v),
    "addcmul_": lambda s, a, b, v: s.addcmul_(a, b, value=v) * 1,
    "addcdiv_": lambda s, a, b, v: s.addcdiv_(a, b, value=v) * 1,
}


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("name", list(POINTWISE))
def test_addcmul_and_addcdiv_are_fused_bitwise_in_every_layout(name, dtype):
    """self + value * t1 * t2 with eager's fma (ATen's build contracts the last multiply and the
    add in both lambdas), self + value * t1 / t2 with none; value cast to the dtype first
    (0.001 is not a float). Every length around the vector blocks, each layout, broadcast
    operands, values with infinities, signed zeros, subnormals and NaNs."""
    op = POINTWISE[name]
    for value in (0.001, -0.5, 1, 3.0000001):
        fn = lambda s, a, b: op(s, a, b, value)  # noqa: E731
        for n in LENGTHS:
            shapes = {layout: (lambda k, make=make: (make(k), make(20 + k), make(40 + k)))
                      for layout, make in layouts(n, dtype, seed=n).items()}
            shapes["0-dim divisor"] = lambda k: (special(n, dtype, k), special(n, dtype, 20 + k),
                                                 special(1, dtype, 40 + k)[0].clone())
            shapes["row broadcast"] = lambda k: (special(3 * n, dtype, k).view(3, n), special(n, dtype, 20 + k),
                                                 special(3 * n, dtype, 40 + k).view(3, n))
            for layout, make in shapes.items():
                try:
                    capture_in_place_and_compare(fn, make)
                except AssertionError as e:
                    raise AssertionError(f"{name} value={value} {dtype} n={n} {layout}: {e}") from None


def in_place_chain(x, y, z):
    """Every in-place op the fused kernel computes, on two inputs written in place and one read."""
    aten.add_.Scalar(x, 0.25)
    aten.mul_.Scalar(x, 0.9)
    aten.sub_.Scalar(y, 1.5)
    aten.div_.Scalar(y, 3.0)
    x.mul_(y)  # two NaNs meet here on odd seeds: the step puts x and y back and runs the nodes
    y.add_(z, alpha=-1)
    x.sub_(z)
    x.addcmul_(y, z, value=0.01)
    y.addcdiv_(x, z, value=-0.5)
    y.div_(z)
    x.neg_()
    y.abs_()
    y.sqrt_()
    x.clamp_(-3.0, 3.0)
    x.exp_()
    y.reciprocal_()
    x.rsqrt_()
    y.clamp_min_(0.5)
    x.tanh_()
    y.pow_(2)
    x.sigmoid_()
    y.log_()
    return x + y


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_in_place_ops_fuse_into_their_self_and_write_what_eager_writes(dtype):
    """In-place ops are their out= overloads writing into self: one step for the whole chain, the
    inputs it writes bitwise eager's, also on the calls where the kernel meets NaN pairs and the
    nodes run again from what the step saved before overwriting them."""
    for n in LENGTHS:
        for layout, make in layouts(n, dtype, seed=n).items():
            try:
                log = capture_in_place_and_compare(in_place_chain, lambda k: (make(k), make(30 + k), make(60 + k)))
            except AssertionError as e:
                raise AssertionError(f"{dtype} n={n} {layout}: {e}") from None
            assert log["steps"] == 1 and log["fused_nodes"] == 23, (layout, n, log)


@pytest.mark.parametrize("threads", [1, 2])
def test_in_place_chains_over_large_tensors_on_each_thread_count(threads):
    """Above the grain the pieces are shared out over the threads: each saves what it overwrites,
    and a call that falls back puts every piece back before the nodes run again."""
    for n in (4099, 40010, 65571):
        log = capture_in_place_and_compare(in_place_chain, lambda k: tuple(special(n, torch.float32, 7 * k + j)
                                                                           for j in range(3)), threads=threads)
        assert log["steps"] == 1, log


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_square_roots_of_zeros_keep_mkls_bits(dtype, threads):
    """Note [Zeros around MKL's sqrt]: a chunk holding zeros goes to MKL with them replaced and put
    back. Chunks of zeros only, of zeros of both signs scattered among values whose MKL square
    root is not the correctly rounded one and among special values, and of no zeros at all; out
    of place and in place (the result overwriting the input), strided too: eager's bits."""
    n = 3 * 2048 + 517

    def make(k):
        g = torch.Generator().manual_seed(k)
        x = torch.rand(n, generator=g, dtype=torch.float64).to(dtype) * 10.0 ** (k % 5)
        x[:2100] = 0.0
        x[2100:2400:3] = -0.0
        x[2400:2600] = special(200, dtype, seed=k).abs()  # infinities, subnormals, huge, tiny
        x[4096 + 7:4096 + 900:11] = 0.0  # the last chunk (from 6144) has none
        return x

    def out_of_place(x):
        return torch.sqrt(x) * 1.5

    def in_place(x):
        return x.sqrt_() * 1.5

    def strided(x):
        return torch.sqrt(x[::3]) + 1.0

    for fn in (out_of_place, strided, in_place):
        log = capture_in_place_and_compare(fn, lambda k: (make(k),), threads=threads)
        assert log["fused_steps"] == 1 and log["fused_nodes"] == 2, (fn.__name__, log)


def test_an_in_place_write_after_a_transposed_read_starts_a_segment():
    """A segment walks its instructions piece by piece: an in-place write of memory an earlier
    instruction of it read in another element order would overwrite elements that read has not
    reached yet. The write starts a new segment (the step stays one)."""
    def fn(x, w):
        z = x * 1.5
        t = z.t() * w        # reads z transposed
        z.mul_(3.0)          # then writes z in place
        return t + z
    for n in (8, 33, 64):
        log = capture_in_place_and_compare(fn, lambda k: (special(n * n, torch.float32, k).view(n, n),
                                                          special(n * n, torch.float32, 9 + k).view(n, n)))
        assert log["steps"] == 1 and log["fused_nodes"] == 4, log


def test_a_segment_that_falls_back_runs_its_nodes_on_what_earlier_segments_wrote():
    """A segment whose NanCheck fires runs its own nodes again, not the group's: it first puts
    back what it wrote in place, also where an earlier segment of the group made that memory
    (z here: written by the first segment, read transposed by the second, multiplied in place by
    the third, where NaNs of z and w meet on odd calls)."""
    def fn(x, w):
        z = x * 1.5
        t = z.t() * w
        z.mul_(w)
        return t + z
    for n in (8, 33, 64):
        log = capture_in_place_and_compare(fn, lambda k: (special(n * n, torch.float32, k).view(n, n),
                                                          special(n * n, torch.float32, 4 + k).view(n, n)),
                                           calls=6)
        assert log["steps"] == 1 and log["fused_nodes"] == 4, log


def test_writes_through_views_whose_elements_share_memory_keep_their_own_steps():
    """Eager writes overlapping windows (unfold, as_strided with strides below the window) in its
    own element order, each op over all elements before the next: a walk piece by piece, or a copy
    saved per element (the later saves of a shared location hold values already written), would
    not give its result. Those writes are not fused; the rest of the function still is."""
    def unfolded(x, y):
        x.unfold(0, 4, 1).mul_(y)
        return x * 1
    def unfolded_inputs(k):
        x, y = special(20, torch.float32, 2 * k), special(68, torch.float32, 2 * k + 1).view(17, 4)
        if k % 2:  # two NaNs meet in the last element: the step would put back and run again
            x[19], y[16, 3] = math.nan, -math.nan
        return x, y
    def windows(buf, y):
        v = buf.as_strided((6, 40), (1, 1))
        v.mul_(1.5)
        v.add_(y)
        return buf * 1
    cases = ((unfolded, unfolded_inputs),
             (windows, lambda k: (special(45, torch.float32, k), special(240, torch.float32, 2 + k).view(6, 40))))
    for fn, make in cases:
        for threads in (1, 2):
            log = capture_in_place_and_compare(fn, make, calls=5, threads=threads)
            assert log["fused_nodes"] == 1, (fn.__name__, log)  # the result's `* 1` only


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_pow_of_a_scalar_base_is_fused_where_eager_runs_its_scalar_lambda(dtype):
    """pow(Scalar, Tensor) is glibc's pow on each element where eager's loop has fewer elements
    than one vector block (the 0-dim step counts of Adam's bias corrections): fused there. Longer
    exponents keep their own step; every length is bitwise eager's."""
    for base in (0.9, 0.999, 2, -1.5, 0.0):
        fn = lambda e: torch.pow(base, e)  # noqa: E731
        for n in (0, 1, 2, 7, 15, 16, 17, 31, 32, 33, 100):
            def make(k):
                e = special(max(n, 1), dtype, k) if k % 2 else torch.arange(1, max(n, 1) + 1, dtype=dtype) + 97 * k
                return (e[0].clone(),) if n == 0 else (e,)
            log = capture_and_compare(fn, make, fuse_expected=False)
            if n <= 1:
                assert log["fused_nodes"] == 1, log


ALPHAS = {
    "add alpha 0.3": lambda x, y: torch.add(x, y, alpha=0.3),
    "add alpha -2.5": lambda x, y: torch.add(x, y, alpha=-2.5),
    "add alpha 3": lambda x, y: torch.add(x, y, alpha=3),
    "sub alpha 1e-3": lambda x, y: torch.sub(x, y, alpha=1e-3),
    "add_ alpha -0.1": lambda x, y: x.add_(y, alpha=-0.1) * 1,
}


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("name", list(ALPHAS))
def test_add_with_any_alpha_is_one_fma_unless_other_is_a_scalar_within_rows(name, dtype):
    """self + alpha * other is fma(alpha, other, self) on every path of eager's loops except where
    other is broadcast along the rows (a 0-dim other, a column): there parts of each row's tail
    round alpha * other first. Fused everywhere else; bitwise everywhere."""
    op = ALPHAS[name]
    fn = lambda x, y: op(x, y)  # noqa: E731
    for n in LENGTHS:
        shapes = {
            "same layout": (True, lambda k: (special(n, dtype, k), special(n, dtype, 100 + k))),
            "0-dim first": (True, lambda k: (special(1, dtype, k)[0].clone(), special(n, dtype, 100 + k))),
            "rows broadcast": (True, lambda k: (special(3 * n, dtype, k).view(3, n), special(n, dtype, 100 + k))),
            "strided and transposed": (True, lambda k: (special(2 * n, dtype, k)[::2],
                                                        special(2 * n, dtype, 100 + k).view(n, 2).t()[0])),
            "a 0-dim operand": (False, lambda k: (special(n, dtype, k), special(1, dtype, 100 + k)[0].clone())),
            "column broadcast": (False, lambda k: (special(3 * n, dtype, k).view(n, 3),
                                                   special(n, dtype, 100 + k).view(n, 1))),
        }
        if name.startswith("add_"):
            shapes = {k: v for k, v in shapes.items() if k not in ("0-dim first", "rows broadcast")}  # self is written
        for layout, (fused, make) in shapes.items():
            try:
                log = capture_in_place_and_compare(fn, make)
            except AssertionError as e:
                raise AssertionError(f"{name} {dtype} n={n} {layout}: {e}") from None
            if fused:
                assert log["steps"] == log["fused_steps"] == 1, (name, layout, n, log)
