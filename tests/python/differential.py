"""The differential harness every test compares with: a compiled function or module against eager
(or aot_eager) on identical fresh inputs, call by call, checking outputs, inputs after the call
(mutations), aliasing between outputs and inputs, parameters, buffers and grads, and that the case
really replayed (assert_exercised). Every exact comparison goes through one comparator,
bitwise_diff / assert_bitwise: bit patterns, dtype, shape, strides, device and requires_grad. A
case that is only close says so (exact=False, assert_close_not_bitwise).
"""
import copy
import math
import struct

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

from configs import backend
from torchreplay import _C
from torchreplay.lowering import lower

CALLS = 6
# reduce_overhead settings that change how outputs are handed out and when capture happens
RO_VARIANTS = {"default": {}, "clone_outputs": dict(clone_outputs=True), "warmup0": dict(warmup_iters=0)}


@pytest.fixture(autouse=True)
def recompile_limits():
    """Cases that change Python ints, modes or sizes recompile: never hit Dynamo's limit. (Autouse
    in the test files that import it.)"""
    with torch._dynamo.config.patch(cache_size_limit=64):
        yield


def engine_for(fn, example_inputs, static=(), **opts):
    """Traces fn to an ATen graph (in-place ops kept) and wraps it in an engine."""
    gm = make_fx(fn)(*example_inputs)
    return _C.Engine(lower(gm, example_inputs, static), _C.EngineOptions(**opts))


def run(engine, *inputs):
    return engine.run(list(inputs))


def total(backend, key):
    return sum(s[key] for s in backend.stats())


def gen(seed):
    return torch.Generator().manual_seed(seed)


def rn(g, *shape, dtype=torch.float32):
    return torch.randn(shape, generator=g).to(dtype)


def ri(g, lo, hi, *shape, dtype=torch.int64):
    return torch.randint(lo, hi, shape, generator=g).to(dtype)


# The one exact comparison: bits, not values. torch.equal and assert_close(rtol=0, atol=0) take
# -0.0 for 0.0, any NaN for any other and ignore strides; eager's results are promised bit for bit.

_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t):
    """t's elements as integers of the same width (bool as uint8, complex as its real and imaginary
    parts, view_as_real's last dimension): its bit patterns, same sizes. A view where one can be made,
    else a contiguous clone's."""
    t = t.detach()
    if t.layout != torch.strided:
        t = t.to_dense()
    if t.is_quantized:
        t = t.int_repr()
    t = t.resolve_conj().resolve_neg()
    if t.is_complex():
        t = torch.view_as_real(t)
    as_int = _INT_OF_WIDTH[t.element_size()]
    if t.dtype == as_int:
        return t
    try:
        return t.view(as_int)
    except RuntimeError:
        return t.contiguous().view(as_int)


def _pattern(b, width):
    return f"0x{int(b) & ((1 << 8 * width) - 1):0{2 * width}x}"


def _values(t):
    """t's values shaped as bits(t): complex as view_as_real."""
    t = t.detach()
    t = (t.to_dense() if t.layout != torch.strided else t).resolve_conj().resolve_neg()
    t = t.dequantize() if t.is_quantized else t
    return torch.view_as_real(t) if t.is_complex() else t


def _first_difference(got, want):
    """Where the first differing element is (row-major), both bit patterns and values, and how many
    elements differ; None if every element has the same bits."""
    gb, wb = bits(got), bits(want)
    ne = gb != wb
    if not bool(ne.any()):
        return None
    flat = int(ne.flatten().nonzero()[0])
    at = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), gb.shape)) if gb.dim() else ()
    where = f"{at[:-1]} {('real', 'imag')[at[-1]]}" if got.is_complex() else f"{at}"
    width = gb.element_size()
    return (f"{int(ne.sum())} of {ne.numel()} elements differ; the first at index {where}: "
            f"got {_pattern(gb[at], width)} ({_values(got)[at].item()!r}), "
            f"want {_pattern(wb[at], width)} ({_values(want)[at].item()!r})")


def _float_bits(x):
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _waited(t):
    """A functional collective's eager result is an AsyncCollectiveTensor, which waits on first
    use: its value is the waited tensor (a compiled graph returns that tensor)."""
    return t.trigger_wait() if type(t).__name__ == "AsyncCollectiveTensor" else t


def _layout(t):
    """The strides that address elements: those of dimensions longer than 1."""
    return [t.stride(d) for d in range(t.dim()) if t.shape[d] > 1]


def _tensor_difference(got, want, what, strides, requires_grad):
    if not isinstance(got, torch.Tensor):
        return f"{what}: got {type(got).__name__}, want a tensor"
    got, want = _waited(got), _waited(want)
    if type(got) is not type(want):
        return f"{what}: type {type(got).__name__}, want {type(want).__name__}"
    if got.is_nested != want.is_nested:
        return f"{what}: is_nested {got.is_nested}, want {want.is_nested}"
    shape = (lambda t: t.dim()) if want.is_nested else (lambda t: tuple(t.shape))  # jagged sizes: per tensor
    for name, g, w in (("dtype", got.dtype, want.dtype), ("shape", shape(got), shape(want)),
                       ("device", got.device, want.device), ("layout", got.layout, want.layout)):
        if g != w:
            return f"{what}: {name} {g}, want {w}"
    if requires_grad and got.requires_grad != want.requires_grad:
        return f"{what}: requires_grad {got.requires_grad}, want {want.requires_grad}"
    if got.is_nested:   # component by component
        return bitwise_diff(list(got.unbind()), list(want.unbind()), what, strides=strides, requires_grad=False)
    if got.is_meta:
        return None
    if got.is_quantized:
        qg, qw = (got.q_scale(), got.q_zero_point()), (want.q_scale(), want.q_zero_point())
        if qg != qw:
            return f"{what}: quantization (scale, zero point) {qg}, want {qw}"
    if strides and got.layout == torch.strided and _layout(got) != _layout(want):
        return f"{what}: strides {got.stride()}, want {want.stride()} (sizes {tuple(got.shape)})"
    first = _first_difference(got, want)
    return None if first is None else f"{what} ({got.dtype}{tuple(got.shape)}): {first}"


def bitwise_diff(got, want, what="output", *, strides=True, requires_grad=True):
    """None if got is want bit for bit, else where and how it first differs. Trees of sequences and
    dicts are walked; a tensor must match in type, dtype, shape, device, layout, requires_grad (off
    with requires_grad=False, for a reference that is not an autograd output), the strides of its
    dimensions longer than 1 (off with strides=False, where a layout is not promised) and every
    element's bit pattern: -0.0 is not 0.0, and a NaN equals only a NaN of the same bits. Numbers
    match in type and, floats, in bits."""
    if isinstance(want, torch.Tensor):
        return _tensor_difference(got, want, what, strides, requires_grad)
    if isinstance(want, (tuple, list)):
        if not isinstance(got, (tuple, list)):
            return f"{what}: got {type(got).__name__}, want a sequence"
        if len(got) != len(want):
            return f"{what}: {len(got)} values, want {len(want)}"
        for k, (g, w) in enumerate(zip(got, want)):
            d = bitwise_diff(g, w, f"{what}[{k}]", strides=strides, requires_grad=requires_grad)
            if d is not None:
                return d
        return None
    if isinstance(want, dict):
        if not isinstance(got, dict) or list(got.keys()) != list(want.keys()):
            return f"{what}: keys {list(got.keys()) if isinstance(got, dict) else type(got).__name__}, want {list(want.keys())}"
        for k in want:
            d = bitwise_diff(got[k], want[k], f"{what}[{k!r}]", strides=strides, requires_grad=requires_grad)
            if d is not None:
                return d
        return None
    if isinstance(want, (bool, int, float, complex)) and type(got) is not type(want):
        return f"{what}: {got!r} (a {type(got).__name__}), want {want!r} (a {type(want).__name__})"
    if isinstance(want, float):
        if _float_bits(got) != _float_bits(want):
            return f"{what}: {got!r} ({_float_bits(got) & (2**64 - 1):#018x}), want {want!r} ({_float_bits(want) & (2**64 - 1):#018x})"
        return None
    if isinstance(want, complex):
        return bitwise_diff([got.real, got.imag], [want.real, want.imag], what)
    if got != want:
        return f"{what}: {got!r}, want {want!r}"
    return None


def assert_bitwise(got, want, what="output", *, strides=True, requires_grad=True):
    """Asserts bitwise_diff(got, want) finds nothing: the exact comparison every test makes."""
    d = bitwise_diff(got, want, what, strides=strides, requires_grad=requires_grad)
    assert d is None, d


def assert_close_not_bitwise(got, want, rtol, atol, what="output"):
    """A tolerance comparison, for results that are not promised bit for bit (a runtime that is not
    bitwise, a reduction order that differs): dtypes and shapes equal, values within rtol/atol."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{what}: got {type(got).__name__}, want a tensor"
        assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, want {want.dtype}"
        assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)}, want {tuple(want.shape)}"
        torch.testing.assert_close(got.detach(), want.detach(), rtol=rtol, atol=atol, equal_nan=True,
                                   msg=lambda m: f"{what} (close, rtol={rtol}, atol={atol}): {m}")
    elif isinstance(want, (tuple, list)):
        assert isinstance(got, (tuple, list)) and len(got) == len(want), f"{what}: {got!r} vs {want!r}"
        for k, (g, w) in enumerate(zip(got, want)):
            assert_close_not_bitwise(g, w, rtol, atol, f"{what}[{k}]")
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), f"{what}: keys differ"
        for k in want:
            assert_close_not_bitwise(got[k], want[k], rtol, atol, f"{what}[{k!r}]")
    elif isinstance(want, float) and math.isnan(want):
        assert isinstance(got, float) and math.isnan(got), f"{what}: {got!r} != nan"
    else:
        assert got == want, f"{what}: {got!r}, want {want!r}"


def assert_same(got, want, exact=True, rtol=None, atol=None, what="output"):
    """got against the reference want: bit for bit (assert_bitwise) unless exact=False, then within
    rtol/atol (assert_close_not_bitwise)."""
    if exact:
        assert_bitwise(got, want, what)
    else:
        assert_close_not_bitwise(got, want, rtol, atol, what)


def snapshot(t):
    """A copy of t that keeps its sizes, strides, storage offset and requires_grad (clone() makes
    an overlapping or non-dense tensor contiguous): a pool output's values and layout as the call
    handed them out, before the next call reuses the pool."""
    if (type(t) is not torch.Tensor or t.layout != torch.strided or t.is_nested or t.is_meta
            or t.is_quantized):
        return t.detach().clone()
    d = t.detach()
    copy_ = torch.empty(0, dtype=t.dtype, device=t.device)
    copy_.set_(d.untyped_storage().clone(), d.storage_offset(), d.size(), d.stride())
    if t.is_conj():
        copy_ = copy_.conj()
    if t.is_neg():
        copy_ = torch._neg_view(copy_)
    if t.requires_grad:
        copy_.requires_grad_(True)
    return copy_


def _tensors(tree):
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _sid(t):
    return t.untyped_storage().data_ptr()


def check_aliasing(got, want, args, args_ref, what):
    """An output is a view of input j exactly when eager's is (same offset and strides), an
    output eager computes fresh never shares memory with an input, and two outputs share memory
    exactly when eager's do (so writing through one shows in the other as in eager)."""
    gi, wi = _tensors(args), _tensors(args_ref)
    go, wo = _tensors(got), _tensors(want)
    for k, (g, w) in enumerate(zip(go, wo)):
        if w.numel() == 0:
            continue
        assert _layout(g) == _layout(w), f"{what}: output {k} strides {g.stride()} != eager's {w.stride()}"
        w_out = [j for j, o in enumerate(wo) if j != k and o.numel() and _sid(o) == _sid(w)]
        g_out = [j for j, o in enumerate(go) if j != k and o.numel() and _sid(o) == _sid(g)]
        assert g_out == w_out, (f"{what}: output {k} shares memory with outputs {g_out}, "
                                f"eager's with {w_out}")
        w_alias = [j for j, a in enumerate(wi) if a.numel() and _sid(a) == _sid(w)]
        g_alias = [j for j, a in enumerate(gi) if a.numel() and _sid(a) == _sid(g)]
        assert g_alias == w_alias, (f"{what}: output {k} shares memory with inputs {g_alias}, "
                                    f"eager's with {w_alias}")
        if w_alias:
            assert (g.storage_offset(), g.stride()) == (w.storage_offset(), w.stride()), (
                f"{what}: output {k} is a different view of its input: offset/strides "
                f"{g.storage_offset()}/{g.stride()} vs eager's {w.storage_offset()}/{w.stride()}")


def compare_call(compiled, reference, make_inputs, i, seed, exact, rtol, atol):
    """Call i of a differential run: both sides on identical fresh inputs (make_inputs(i, a
    generator seeded from seed and i)); outputs and the inputs after the call compared."""
    args = make_inputs(i, gen(seed * 1000 + i))
    args_ref = make_inputs(i, gen(seed * 1000 + i))
    want = reference(*args_ref)
    got = compiled(*args)
    assert_same(got, want, exact, rtol, atol, f"call {i}: output")
    assert_same(args, args_ref, exact, rtol, atol, f"call {i}: inputs after the call")
    return got, want, args, args_ref


def run_diff(fn, make_inputs, *, calls=CALLS, dynamic=False, exact=True, rtol=None, atol=None,
             ro=None, ref=None, seed=0, check_alias=True, require_replay=True, eager_reason=None):
    """Compiles fn with torchreplay and compares it, call by call, with `ref` (eager fn, or
    "aot_eager") on identical fresh inputs made by make_inputs(i, generator). With eager_reason,
    the graph is expected to run eagerly, the backend saying why (a reason containing it)."""
    b = backend(**(ro or {}))
    compiled = torch.compile(fn, backend=b, dynamic=dynamic)
    if ref == "aot_eager":
        reference = torch.compile(fn, backend="aot_eager", dynamic=dynamic)
    else:
        reference = ref or fn
    for i in range(calls):
        got, want, args, args_ref = compare_call(compiled, reference, make_inputs, i, seed, exact, rtol, atol)
        if check_alias:
            check_aliasing(got, want, args, args_ref, f"call {i}")
    if eager_reason is None:
        assert_exercised(b, require_replay)
    else:
        assert any(eager_reason in r for r in b.eager_graphs.values()), b.eager_graphs
    return b


def assert_state(model, eager, exact=True, rtol=None, atol=None, what="", grads=False):
    got = dict(model.named_parameters())
    got.update(model.named_buffers())
    want = dict(eager.named_parameters())
    want.update(eager.named_buffers())
    assert got.keys() == want.keys(), f"{what}: state names differ"
    for k in want:
        assert_same(got[k], want[k], exact, rtol, atol, f"{what}: {k}")
        if grads:
            gg, wg = got[k].grad, want[k].grad
            assert (gg is None) == (wg is None), f"{what}: {k}.grad is {gg} vs eager's {wg}"
            if wg is not None:
                assert_same(gg, wg, exact, rtol, atol, f"{what}: {k}.grad")


def run_module_diff(make_model, make_inputs, *, calls=CALLS, dynamic=False, exact=True, rtol=None,
                    atol=None, ro=None, seed=0, grad=False, ref=None):
    """Compiles a deep copy of make_model() and compares outputs, inputs and every parameter and
    buffer with the eager model (or the model compiled with ref="aot_eager") after each call."""
    torch.manual_seed(seed)
    eager = make_model()
    model = copy.deepcopy(eager)
    b = backend(**(ro or {}))
    compiled = torch.compile(model, backend=b, dynamic=dynamic)
    reference = torch.compile(eager, backend="aot_eager", dynamic=dynamic) if ref == "aot_eager" else eager
    with torch.set_grad_enabled(grad):
        for i in range(calls):
            compare_call(compiled, reference, make_inputs, i, seed, exact, rtol, atol)
            assert_state(model, eager, exact, rtol, atol, f"call {i}")
    assert_exercised(b)
    return b


def assert_exercised(b, require_replay=True):
    """The case really ran through torchreplay (Dynamo did not hand everything back to eager)."""
    assert total(b, "calls") > 0, "torchreplay never ran: Dynamo compiled nothing"
    if require_replay:
        assert total(b, "replays") > 0, f"torchreplay never replayed: {b.stats()}"


def touch_or_documented_error(t, want, what):
    """Default config: an output kept across a later call either still holds its value or raises
    the documented error; it never silently shows other data."""
    try:
        value = t.clone()
    except RuntimeError as e:
        assert "reused its memory" in str(e), f"{what}: unexpected error {e}"
        return False
    assert_same(value, want, what=what)
    return True


# Shared cases: a training step, a counter module.


class TinyTokens(nn.Module):
    """Embedding, LayerNorm, GELU and a linear head over 10 tokens: logits (batch, tokens, 10)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.ln = nn.LayerNorm(8)
        self.out = nn.Linear(8, 10)

    def forward(self, tok):
        return self.out(F.gelu(self.ln(self.emb(tok))))


def mlp(act=nn.ReLU):
    return lambda: nn.Sequential(nn.Linear(6, 16), act(), nn.Linear(16, 3))


def xy(i, g):
    return rn(g, 8, 6), rn(g, 8, 3)


def step_with(loss_fn):
    """A training step: zero the grads, loss_fn(f(x), y), backward, optimizer step; the loss."""
    def step(f, m, opt, batch, i):
        x, y = batch
        opt.zero_grad()
        loss = loss_fn(f(x), y)
        loss.backward()
        opt.step()
        return loss.detach()
    return step


step_basic = step_with(F.mse_loss)


def train_compare(make_model, make_batch, step, *, steps=6, seed=0, lr=0.05, exact=True, rtol=None,
                  atol=None, ro=None):
    """Runs step(callable, module, optimizer, batch, i) with the eager model and with the compiled
    copy; compares what it returns, the batch (and its .grad), parameters, grads and buffers."""
    torch.manual_seed(seed)
    eager = make_model()
    model = copy.deepcopy(eager)
    b = backend(**(ro or {}))
    compiled = torch.compile(model, backend=b)
    opt_e = torch.optim.SGD(eager.parameters(), lr=lr, momentum=0.5)
    opt_c = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.5)
    for i in range(steps):
        batch_e, batch_c = make_batch(i, gen(seed * 1000 + i)), make_batch(i, gen(seed * 1000 + i))
        want = step(eager, eager, opt_e, batch_e, i)
        got = step(compiled, model, opt_c, batch_c, i)
        assert_same(got, want, exact, rtol, atol, f"step {i}: returned values")
        assert_same(batch_c, batch_e, exact, rtol, atol, f"step {i}: batch")
        for k, (tc, te) in enumerate(zip(_tensors(batch_c), _tensors(batch_e))):
            assert (tc.grad is None) == (te.grad is None), f"step {i}: batch tensor {k}.grad presence"
            if te.grad is not None:
                assert_same(tc.grad, te.grad, exact, rtol, atol, f"step {i}: batch tensor {k}.grad")
        assert_state(model, eager, exact, rtol, atol, f"step {i}", grads=True)
    assert_exercised(b)
    return b


class CounterModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        self.count += 1
        return x * self.count
