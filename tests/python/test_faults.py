"""Faults in the middle of a replay, through every entry point (torch.compile, the engine called
directly, torchreplay.capture): a kernel that fails during replay, an allocation that fails during
capture (simulated by the test-only hook _C._testing_fail_allocations), KeyboardInterrupt between
and during calls. After each: the entry point stays usable, results equal eager, the stats say what
happened, and nothing is left behind (cache entries, handed-out storages, pool bytes, the caller's
tensors, RSS)."""
import gc
import random
import signal
import threading
import _thread
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import torchreplay
from configs import backend, config
from differential import assert_bitwise
from torchreplay import _C
from torchreplay.lowering import lower

ENTRIES = ["compile", "engine", "capture"]


def build(entry, fn, example, dynamic=False):
    """(callable, engine) for fn through the entry point; the callable returns what fn returns.
    dynamic: one graph (and engine) for every shape."""
    if entry == "compile":
        b = backend()
        compiled = torch.compile(fn, backend=b, dynamic=dynamic or None)
        compiled(*example)   # compiles; the engine exists from here on
        return compiled, b.engines[0]
    if entry == "capture":
        step = torchreplay.capture(fn, example, config=config(), dynamic=dynamic)
        return step, step.engine
    state = [*fn.parameters(), *fn.buffers()] if isinstance(fn, nn.Module) else []
    if state:
        names = [n for n, _ in fn.named_parameters()] + [n for n, _ in fn.named_buffers()]
        traced = lambda *a: torch.func.functional_call(fn, dict(zip(names, a[:len(state)])), a[len(state):])  # noqa: E731
    else:
        traced = fn
    gm = make_fx(traced, tracing_mode="symbolic")(*state, *example)
    engine = _C.Engine(lower(gm, [*state, *example], list(range(len(state)))))
    return (lambda *a: engine.run([*state, *a])[0]), engine


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)

    def forward(self, idx):
        return F.embedding(idx, self.emb.weight) * 2


@pytest.mark.parametrize("op", ["index_select", "embedding"])
@pytest.mark.parametrize("entry", ENTRIES)
def test_kernel_failure_during_replay_raises_and_next_call_works(entry, op):
    if op == "index_select":
        x = torch.randn(5, 3)
        fn = lambda x, idx: x.index_select(0, idx) * 2  # noqa: E731
        args = lambda idx: (x, idx)  # noqa: E731
    else:
        torch.manual_seed(0)
        model = Embed().eval()
        fn = model
        args = lambda idx: (idx,)  # noqa: E731
    with torch.no_grad():
        call, engine = build(entry, fn, args(torch.tensor([0, 1])))
        for i in range(4):
            idx = torch.tensor([i % 5, (i + 2) % 5])
            assert_bitwise(call(*args(idx)), fn(*args(idx)))
        before = engine.stats()
        assert before["replays"] >= 2 and before["errors"] == 0
        for k in range(3):
            bad = torch.tensor([1, 11 + k])     # same key: the replay's kernel fails
            with pytest.raises(IndexError, match="index out of range"):
                fn(*args(bad))
            with pytest.raises(IndexError, match="index out of range"):  # eager's type
                call(*args(bad))
            for i in range(3):
                idx = torch.tensor([(i + k) % 5, 4])
                assert_bitwise(call(*args(idx)), fn(*args(idx)))
        after = engine.stats()
    assert after["errors"] == 3 and "index out of range" in after["last_error"]
    assert after["captures"] == before["captures"] and after["eager_fallbacks"] == 0
    assert after["replays"] == before["replays"] + 9
    for k in ("pool_bytes", "cache_entries"):
        assert after[k] == before[k], k
    assert after["handed_out"] <= 1


@pytest.mark.parametrize("where", ["before_list", "in_list"])
def test_failed_replay_keeps_none_of_the_callers_tensors_alive(where):
    x = torch.randn(5, 3)
    if where == "before_list":   # the failing step runs before a step with a list argument
        fn = lambda x, idx: torch.cat([x.index_select(0, idx), x[:2]]) * 2  # noqa: E731
    else:                        # the failing step's own list argument holds the index
        fn = lambda x, idx: torch.ops.aten.index.Tensor(x, [idx]) * 2  # noqa: E731
    call, engine = build("engine", fn, (x, torch.tensor([0, 1])))
    for i in range(3):
        call(x, torch.tensor([i, 1]))
    bad_x, bad_idx = torch.randn(5, 3), torch.tensor([7, 1])
    refs = [weakref.ref(bad_x), weakref.ref(bad_idx)]
    with pytest.raises(IndexError, match="index out of range|out of bounds"):  # eager's type too
        fn(bad_x, bad_idx)
    with pytest.raises(IndexError, match="index out of range|out of bounds"):
        call(bad_x, bad_idx)
    del bad_x, bad_idx
    gc.collect()
    assert [r() for r in refs] == [None, None], "a failed replay kept an input alive"
    assert_bitwise(call(x, torch.tensor([3, 4])), fn(x, torch.tensor([3, 4])))


@pytest.mark.parametrize("entry", ENTRIES)
def test_allocation_failure_during_capture_falls_back_eagerly_with_the_reason(entry):
    fn = lambda x, y: torch.tanh(x @ y) + x.sum()  # noqa: E731
    mk = lambda n, s: (torch.randn(n, 4, generator=torch.Generator().manual_seed(s)),  # noqa: E731
                       torch.randn(4, 4, generator=torch.Generator().manual_seed(s + 1)))
    with torch.no_grad():
        call, engine = build(entry, fn, mk(3, 0), dynamic=True)   # compile: key (3, 4) warmed up
        try:
            _C._testing_fail_allocations(1)         # the capture of key (3, 4) fails half-way
            for i in range(5):
                assert_bitwise(call(*mk(3, i)), fn(*mk(3, i)), f"i={i}")
        finally:
            _C._testing_fail_allocations(0)
        s = engine.stats()
        assert s["captures"] == 0 and s["eager_fallbacks"] >= 3 and s["errors"] == 0, s
        assert s["pool_bytes"] == 0, s
        assert any("simulated by _testing_fail_allocations" in r for r in s["fallback_reasons"]), s
        # Another key captures and replays normally, into a pool of its own size.
        for i in range(4):
            assert_bitwise(call(*mk(6, i)), fn(*mk(6, i)))
        for i in range(3):
            assert_bitwise(call(*mk(3, i)), fn(*mk(3, i)))
        s = engine.stats()
    assert s["captures"] == 1 and s["replays"] >= 2 and s["pool_bytes"] > 0, s
    assert s["cache_entries"] == 2 and s["handed_out"] <= 1, s


def test_allocation_failure_hook_is_off_by_default_and_counts_down():
    fn = lambda x: x * 2 + 1  # noqa: E731
    call, engine = build("engine", fn, (torch.randn(4),))
    _C._testing_fail_allocations(0)
    for n in range(2, 6):               # each new size: warm-up, capture (grows the arena)
        for _ in range(2):
            x = torch.randn(n * 100)
            assert_bitwise(call(x), fn(x))
    assert engine.stats()["captures"] == 4


@pytest.fixture
def sigint_raises():
    """Python's own SIGINT handler for the test: a process started in the background by a
    non-interactive shell ignores SIGINT, and then _thread.interrupt_main() does nothing."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("entry", ENTRIES)
def test_keyboard_interrupt_during_and_between_calls(entry, sigint_raises):
    fn = lambda x, y: torch.sigmoid(x) * y - x.mean()  # noqa: E731
    gen = torch.Generator().manual_seed(0)
    inputs = [(torch.randn(8, 8, generator=gen), torch.randn(8, 8, generator=gen)) for _ in range(16)]
    rng = random.Random(0)
    with torch.no_grad():
        call, engine = build(entry, fn, inputs[0])
        for i in range(3):
            call(*inputs[i])
        before = engine.stats()
        interrupted = 0
        for round_ in range(20):
            timer = threading.Timer(rng.uniform(0.0005, 0.004), _thread.interrupt_main)
            try:
                try:
                    timer.start()   # on a busy machine the interrupt can land in here already
                    for i in range(20000):
                        out = call(*inputs[i % 16])
                        if i % 7 == 0:
                            assert_bitwise(out.clone(), fn(*inputs[i % 16]), f"round_={round_}, i={i}")
                finally:
                    timer.join()
                for _ in range(1000):   # an interrupt sent but not yet seen lands here
                    pass
            except KeyboardInterrupt:
                interrupted += 1
            for i in range(4):               # usable and right straight after
                assert_bitwise(call(*inputs[i]), fn(*inputs[i]), f"round_={round_}, i={i}")
        after = engine.stats()
    assert interrupted >= 10   # most land in our loop (torch may handle a few itself)
    assert after["errors"] == 0 and after["captures"] == before["captures"] == 1
    assert after["eager_fallbacks"] == 0
    for k in ("pool_bytes", "cache_entries"):
        assert after[k] == before[k], k
    assert after["handed_out"] <= 1


@pytest.mark.parametrize("entry", ENTRIES)
def test_many_failing_calls_leak_nothing(entry):
    """20,000 calls, every other one failing in its replay's kernel: RSS, pool, cache and
    handed-out storages stay flat."""
    x = torch.randn(64, 16)
    fn = lambda x, idx: x.index_select(0, idx) * 2  # noqa: E731
    good, bad = torch.tensor([1, 2, 3]), torch.tensor([1, 2, 99])
    with torch.no_grad():
        call, engine = build(entry, fn, (x, good))

        def loop(n):
            for _ in range(n):
                call(x, good)
                try:
                    call(x, bad)
                except IndexError:
                    pass

        loop(2000)                            # warm-up: allocator and caches settle
        gc.collect()
        s0, rss0 = engine.stats(), rss_bytes()
        loop(10000)
        gc.collect()
        s1, rss1 = engine.stats(), rss_bytes()
        assert_bitwise(call(x, good), fn(x, good))
    assert s1["errors"] - s0["errors"] == 10000
    for k in ("pool_bytes", "cache_entries", "captures"):
        assert s1[k] == s0[k], k
    assert s1["handed_out"] <= 1
    # 10,000 failed calls: a leak of 100 bytes each would be 1 MB.
    assert rss1 - rss0 < 1 << 20, f"RSS grew by {(rss1 - rss0) / 1e6:.2f} MB"


def test_an_error_raised_in_python_code_an_op_went_to_keeps_its_type_and_message():
    f = lambda x, s: x & s  # bitwise_and has no Half kernel: raised where the op's Python path runs
    x = torch.randn(4).half()
    with pytest.raises(NotImplementedError) as eager:
        f(x, 1)
    c = torch.compile(f, backend=backend(), dynamic=True)
    with pytest.raises(NotImplementedError) as ours:
        c(x, 1)
    assert str(eager.value) in str(ours.value)
    y = torch.arange(4)
    assert_bitwise(c(y, 6), f(y, 6))  # usable after
