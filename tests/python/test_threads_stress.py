"""Thread stress: 8 threads x 10,000 calls on one compiled model, each thread with inputs of its own
(three batch sizes among them, so three keys per thread), every result compared with eager: no
mismatch, no deadlock, no exception.

The first call of a torch.compile'd model must not come from several threads at once: Dynamo and
AOTAutograd trace it then, and concurrent traces fail inside PyTorch ("Detected that you are using
FX to symbolically trace a dynamo-optimized function", with backend="aot_eager" too). Make one call
first (per shape that will recompile), or use torchreplay.capture, which traces before any thread
calls. Both are what these tests do."""
import threading

import pytest
import torch
import torch.nn as nn

import torchreplay
from configs import backend, config
from differential import bitwise_diff

THREADS = 8
CALLS = 10_000
BATCHES = (2, 3, 5)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 8)

    def forward(self, x):
        return self.b(torch.relu(self.a(x))) * 0.5 + x[:, :8]


@pytest.mark.parametrize("entry", ["compile", "capture"])
def test_8_threads_x_10000_calls_equal_eager(entry):
    torch.manual_seed(0)
    model = MLP().eval()
    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        # Per thread: 4 inputs of its batch size; their eager results are computed in the thread
        # (BLAS may block a matmul differently on another thread: eager differs in the last bit).
        data = []
        for t in range(THREADS):
            g = torch.Generator().manual_seed(100 + t)
            data.append([torch.randn(BATCHES[t % 3], 16, generator=g) for _ in range(4)])
        with torch.no_grad():
            if entry == "compile":
                b = backend()
                fn = torch.compile(model, backend=b, dynamic=True)
                fn(data[0][0])            # the first call, on this thread (see the docstring)
                engines = lambda: b.engines  # noqa: E731
            else:
                fn = torchreplay.capture(model, (data[0][0],), config=config(), dynamic=True)
                engines = lambda: [fn.engine]  # noqa: E731
        errors, mismatches, done = [], [0] * THREADS, [0] * THREADS
        start = threading.Barrier(THREADS)

        def work(t):
            try:
                # One intra-op thread here too (a new thread starts with OpenMP's default): BLAS
                # blocks a matmul differently with another thread count, and eager with it.
                torch.set_num_threads(1)
                start.wait()
                with torch.no_grad():
                    mine = [(x, model(x)) for x in data[t]]
                    for i in range(CALLS):
                        x, want = mine[i % 4]
                        if bitwise_diff(fn(x), want) is not None:
                            mismatches[t] += 1
                        done[t] += 1
            except BaseException as e:  # noqa: BLE001
                errors.append(f"thread {t}: {type(e).__name__}: {e}")

        workers = [threading.Thread(target=work, args=(t,)) for t in range(THREADS)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(timeout=300)
        assert not any(w.is_alive() for w in workers), "a thread hung"
    finally:
        torch.set_num_threads(threads_before)
    assert errors == [], errors
    assert done == [CALLS] * THREADS and mismatches == [0] * THREADS, (done, mismatches)
    stats = [e.stats() for e in engines()]

    assert sum(s["errors"] for s in stats) == 0 and sum(s["eager_fallbacks"] for s in stats) == 0
    assert sum(s["replays"] for s in stats) >= THREADS * (CALLS - 2)
    # Captured state is per thread: one capture per key and thread.
    assert sum(s["captures"] for s in stats) == THREADS
    # ... and one key per thread (the compile path's first call, on this thread, warmed one up).
    assert sum(s["cache_entries"] for s in stats) == THREADS + (entry == "compile")
