"""Scalars that change every call, and keys that never repeat: scalars that are data are bound per
call (one capture, then replays, bitwise equal to eager); scalars that decide shapes stay in the
guard key; the per-thread cache is bounded (LRU eviction, the pool shrunk, RSS flat) and says
why calls miss (Note [Scalars bound per call] in capture/ir/graph.h, Note [A bounded cache] in
replay/key_cache.h)."""
import logging
import random

import pytest
import torch
import torch.nn as nn

from configs import backend
from differential import assert_bitwise, engine_for


def counts(stats):
    return {k: stats[k] for k in ("calls", "replays", "captures", "warmups", "misses")}


def sin_loop(x, s):
    y = x
    for _ in range(10):
        y = torch.sin(y) * s + 1
    return y


@pytest.mark.parametrize("values", ["int", "float"])
def test_a_scalar_that_changes_every_call_is_captured_once_and_replayed(values):
    b = backend()
    c = torch.compile(sin_loop, backend=b, dynamic=True)
    x = torch.randn(64)
    rng = random.Random(0)
    for i in range(300):
        s = i + 2 if values == "int" else rng.uniform(-3.0, 3.0)
        assert_bitwise(c(x, s), sin_loop(x, s), f"i={i}, s={s}")
    (stats,) = b.stats()
    assert counts(stats) == {"calls": 300, "replays": 299, "captures": 1, "warmups": 1, "misses": 1}
    assert "=*" in stats["capture_log"][0]["key"]  # the scalar's kind is guarded, not its value


def test_arithmetic_on_a_changing_scalar_runs_per_call():
    def f(x, pos, temperature):
        return torch.softmax(x * (pos + 1) / temperature, dim=-1) - pos // 3

    b = backend()
    c = torch.compile(f, backend=b, dynamic=True)
    x = torch.randn(4, 16)
    rng = random.Random(1)
    for pos in range(2, 200):
        t = rng.uniform(0.1, 2.0)
        assert_bitwise(c(x, pos, t), f(x, pos, t), f"pos={pos}, t={t}")
    (stats,) = b.stats()
    assert stats["captures"] == 1 and stats["replays"] == 197


@pytest.mark.parametrize("f, edge", [
    pytest.param(lambda x, s: x * (s // -1), -2**63, id="floordiv_min_by_minus_one"),
    pytest.param(lambda x, s: x * (s % -1), -2**63, id="mod_min_by_minus_one"),
    pytest.param(lambda x, s: x * (-s), -2**63, id="neg_min"),
    pytest.param(lambda x, s: x * abs(s), -2**63, id="abs_min"),
    pytest.param(lambda x, s: x * (s / 3), 2**54 + 3, id="truediv_beyond_2_53"),
    pytest.param(lambda x, s: x * (s / -7), -(2**62) - 1, id="truediv_negative"),
    pytest.param(lambda x, s: x * (s * s), 3037000500, id="mul_beyond_int64"),
    pytest.param(lambda x, s: x * (s + s), 2**62, id="add_beyond_int64"),
])
def test_int_arithmetic_at_the_edges_of_int64_is_python_s(f, edge):
    # Python's ints have no bound and int / int rounds once: a result beyond int64 runs the
    # graph in Python (as eager), one within it replays, exactly.
    b = backend()
    c = torch.compile(f, backend=b, dynamic=True)
    x = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    for s in [3, 5, 7, edge, 11, edge]:
        assert_bitwise(c(x, s), f(x, s), f"s={s}")
    assert b.stats()[0]["replays"] >= 2


class DemoModel(nn.Module):
    """A parameter, a buffer, a tensor input and a scalar input."""

    def __init__(self):
        super().__init__()
        self.register_buffer("running_mean", torch.randn(64))
        self.linear1 = nn.Linear(128, 64)

    def forward(self, x, scale_factor):
        return (self.linear1(x) - self.running_mean) * scale_factor


@pytest.mark.parametrize("scale_of", [lambda i: 100 + 7 * i, lambda i: 0.5 + 0.37 * i], ids=["int", "float"])
def test_the_demo_model_with_a_new_scale_factor_every_call_replays(scale_of):
    torch.manual_seed(0)
    model = DemoModel()
    b = backend()
    c = torch.compile(model, dynamic=True, fullgraph=True, backend=b)
    x = torch.randn(100, 128)
    with torch.no_grad():
        for i in range(100):
            scale = scale_of(i)
            assert_bitwise(c(x, scale), model(x, scale), f"i={i}")
    (stats,) = b.stats()
    assert stats["captures"] == 1 and stats["replays"] == 99


def test_a_scalar_that_decides_a_shape_stays_in_the_key():
    def f(x, n):
        return x[:n] * 2 + torch.arange(n)

    b = backend()
    c = torch.compile(f, backend=b, dynamic=True)
    x = torch.randn(16)
    for n in [3, 5, 3, 5, 3, 5, 3]:
        assert_bitwise(c(x, n), f(x, n))
    (stats,) = b.stats()
    assert stats["captures"] == 2 and stats["replays"] == 5
    assert "int=3" in stats["capture_log"][0]["key"]


def test_a_float_scalar_of_a_half_graph_is_bitwise_eager():
    # Reduced-precision kernels read the wrapped number's own (double) value: it is not cast.
    f = lambda x, s: (x * s + s) / s
    b = backend()
    c = torch.compile(f, backend=b, dynamic=True)
    x = torch.randn(32).half()
    for s in [0.1, 1.7, -3.3, 1e-3, 65504.0, 2.5]:
        assert_bitwise(c(x, s), f(x, s), f"s={s}")
    assert b.stats()[0]["replays"] >= 4


def test_lru_eviction_order_and_misses_with_the_key_diff():
    e = engine_for(lambda x: torch.relu(x) * 2, [torch.randn(4)], cache_limit=2, warmup_iters=0)
    a, b_, c = torch.randn(4), torch.randn(5), torch.randn(6)
    for x in [a, b_, a, c]:  # c evicts b (a was used after b)
        assert_bitwise(e.run([x])[0], torch.relu(x) * 2)
    s = e.stats()
    assert (s["misses"], s["evictions"], s["cache_entries"]) == (3, 1, 2)
    assert "sizes (4) -> (6)" in s["last_miss"]
    e.run([a])  # still held
    assert e.stats()["misses"] == 3
    e.run([b_])  # evicted: a new key again, captured anew
    s = e.stats()
    assert (s["misses"], s["evictions"], s["captures"]) == (4, 2, 4)


def test_evicting_the_largest_key_shrinks_the_pool_and_keeps_its_outputs():
    e = engine_for(lambda x: torch.sin(x) + 1, [torch.randn(4)], cache_limit=1, warmup_iters=0)
    big = torch.randn(100_000)
    out_big = e.run([big])[0]
    pool_big = e.stats()["pool_bytes"]
    assert pool_big >= big.nbytes
    small = torch.randn(10)
    assert_bitwise(e.run([small])[0], torch.sin(small) + 1)
    s = e.stats()
    assert s["evictions"] == 1 and s["pool_bytes"] < 1024 < pool_big
    assert_bitwise(out_big, torch.sin(big) + 1)  # copied out of the freed pool, not lost


def test_an_evicted_key_frees_its_place_under_the_capture_limit():
    e = engine_for(lambda x: x * 3, [torch.randn(4)], cache_limit=2, capture_limit=1, warmup_iters=0)
    for n in [1, 2, 3, 3, 3]:  # 1 captured; 2 over the limit; 3 evicts 1, then may capture
        x = torch.randn(n)
        assert_bitwise(e.run([x])[0], x * 3)
    s = e.stats()
    assert s["captures"] == 2 and s["replays"] == 2 and s["eager_fallbacks"] == 1


def test_a_graph_whose_key_changes_every_call_is_logged_once(replay_log):
    e = engine_for(lambda x: x + 1, [torch.randn(4)])
    base = torch.randn(64)
    for i in range(20):
        e.run([base[i:i + 4]])
    churn = [r for r in replay_log.records if "each had a new guard key" in r.getMessage()]
    assert len(churn) == 1 and churn[0].levelno == logging.WARNING and churn[0].name == "torchreplay"
    assert "input 0 (" in churn[0].getMessage() and "storage offset" in churn[0].getMessage()
    s = e.stats()
    assert s["misses"] == 20 and s["replays"] == 0


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_a_hundred_thousand_new_keys_keep_memory_flat():
    e = engine_for(lambda x: torch.relu(x) * 2 + x, [torch.randn(8)], log_level=3)
    base = torch.randn(100_008)
    for i in range(2_000):  # allocator and interpreter warm
        e.run([base[:8]])
    before = rss_bytes()
    for i in range(1, 100_001):
        e.run([base[i:i + 8]])  # a new storage offset, a new key, every call
    grown = rss_bytes() - before
    s = e.stats()
    assert s["misses"] == 100_001 and s["cache_entries"] == 256
    assert s["evictions"] == 100_001 - 256 and s["replays"] == 1_999
    assert grown < 5 * 2**20, f"RSS grew {grown / 2**20:.1f} MB"


def test_a_scalar_changing_every_call_replays_every_timed_call():
    from torchreplay_bench.buckets import scalar_loop

    eager, ours = scalar_loop(50)   # outputs checked bitwise inside
    assert ours["captures"] == 1 and ours["replays"] >= 7 * 50


class ConvNet(nn.Module):
    """Convolutions whose kernels eager picks by torch.backends.mkldnn.enabled, and a linear layer."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(8, 16, 3, padding=1)
        self.b = nn.Conv2d(16, 16, 3, padding=1, groups=16)
        self.fc = nn.Linear(16 * 8 * 8, 10)

    def forward(self, x):
        return self.fc(self.b(torch.relu(self.a(x))).flatten(1))


def test_a_call_under_another_mkldnn_setting_captures_again_with_eagers_bits():
    """Note [Ambient state]: torch.backends.mkldnn.enabled changes which kernels eager runs (and
    the checked kernels a capture took for its convolutions): a call under the other setting is
    another key, captured for it, each call eager's bits; back under the first, its capture
    replays."""
    import torchreplay
    torch.manual_seed(0)
    model = ConvNet().eval()
    x = torch.randn(1, 8, 8, 8)
    config = torchreplay.CompilerConfig()
    config.mode = "reduce-overhead"
    with torch.no_grad():
        step = torchreplay.capture(model, (x,), config=config)
        for enabled in (True, False, False, False, True, True):
            with torch.backends.mkldnn.flags(enabled=enabled):
                assert_bitwise(step(x), model(x), f"mkldnn enabled={enabled}")
    stats = step.stats()
    # warm-up (True); warm-up, capture (False), replay; capture (True), replay
    assert (stats["warmups"], stats["captures"], stats["replays"], stats["eager_fallbacks"]) == (2, 2, 4, 0), stats
    reasons = [c["reason"] for c in stats["capture_log"]]
    assert reasons == ["torch.backends.mkldnn.enabled True -> False", "no graph yet"], reasons  # the first key last


def test_a_call_under_another_flush_denormal_setting_captures_again_with_eagers_bits():
    """Note [Ambient state]: a number a capture converted once (`1e-40 - x`, `x * 1e-40`, a where's
    fill) is converted under the thread's flush-denormal mode, which eager applies per call: a call
    under the other mode is another key, captured for it, each call eager's bits, both ways."""
    import torchreplay
    aten = torch.ops.aten

    def fn(x, m):
        a = (1e-40 - x) * 1e20 + aten.mul.Scalar(x, 1e-40) * 1e20
        return a, torch.where(m, x, 1e-40), (x * 1e-40) * 1e20

    config = torchreplay.CompilerConfig()
    config.mode = "reduce-overhead"
    b = torchreplay.get_backend(compiler_config=config)
    step = torch.compile(fn, backend=b)
    x, m = torch.tensor([0.0, 1.0, -2.0, 3e-39]), torch.tensor([True, False, False, True])
    try:
        for flush in (True, True, True, False, False, True, True):
            torch.set_flush_denormal(flush)
            got, want = step(x, m), fn(x, m)
            for k, (g, w) in enumerate(zip(got, want)):
                assert_bitwise(g, w, f"flush denormal {flush}: output {k}")
    finally:
        torch.set_flush_denormal(False)
    (stats,) = b.stats()
    assert stats["replays"] >= 3 and stats["eager_fallbacks"] == 0, stats
    reasons = [c["reason"] for c in stats["capture_log"][1:]]
    assert reasons == ["flush denormal on -> off"], reasons
