"""Batch-size buckets (config.reduce_overhead.capture_sizes) in a decode-style loop.

An MLP (64 -> 128 -> 32) is called with batch sizes 1..32 in a random order, with dynamic
shapes, by:
  eager                     the model itself
  compile per-size          torch.compile + torchreplay reduce-overhead, no buckets: one capture
                            per distinct size
  compile buckets           the same with capture_sizes = [1, 2, 4, 8, 16, 32]: other sizes padded
                            up (capture_sizes_bitwise=False: the MLP's GEMMs round a padded row
                            close to eager, not bitwise, so buckets are opt-in twice for it)
  capture per-size          torchreplay.capture(dynamic=True): no Dynamo frame per call
  capture buckets           the same with capture_sizes
  inductor                  torch.compile(dynamic=True) (on CUDA, mode="reduce-overhead" too,
                            which captures one CUDA graph per distinct size)
Per mode: mean time per call over the loop, captures, replays and pool bytes. Then, per capture
size b: a padded call (n = b // 2 + 1 rows, padded to b) against a call of exactly b rows. Last,
a Python int that changes on every call (`y = sin(y) * s + 1` ten times on 64 floats, s = i + 2,
dynamic=True): eager against torchreplay, whose key does not hold s (it is bound per call).

    python -m torchreplay_bench.buckets [--rounds N] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn as nn

import torchreplay

SIZES = [1, 2, 4, 8, 16, 32]


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32)).eval()


def config(capture_sizes: Optional[List[int]] = None) -> Any:
    cfg = torchreplay.CompilerConfig()
    cfg.mode = "reduce-overhead"
    cfg.reduce_overhead.capture_sizes = capture_sizes
    cfg.reduce_overhead.capture_sizes_bitwise = False
    return cfg


def backend(capture_sizes: Optional[List[int]] = None) -> Any:
    return torchreplay.get_backend(compiler_config=config(capture_sizes))


def captured(m: nn.Module, capture_sizes: Optional[List[int]] = None) -> Any:
    step = torchreplay.capture(m, (torch.randn(8, 64),), config=config(capture_sizes), dynamic=True)

    class Stats:
        def stats(self) -> List[Dict[str, Any]]:
            return step.stats().get("traces", [step.stats()])

    return step, Stats()


def per_call_us(fn: Callable, inputs: List[torch.Tensor], repeats: int) -> float:
    """Best of `repeats` passes over `inputs`, in us per call."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for x in inputs:
            fn(x)
        best = min(best, (time.perf_counter() - t0) / len(inputs) * 1e6)
    return best


def sin_loop(x: torch.Tensor, s: int) -> torch.Tensor:
    y = x
    for _ in range(10):
        y = torch.sin(y) * s + 1
    return y


def scalar_loop(calls: int) -> List[Dict[str, Any]]:
    """Eager against torchreplay on sin_loop with s new on every call; outputs checked bitwise."""
    x = torch.randn(64)
    torch._dynamo.reset()
    b = backend()
    compiled = torch.compile(sin_loop, backend=b, dynamic=True)
    rows = []
    for name, fn in [("eager", sin_loop), ("torchreplay", compiled)]:
        for i in range(3):
            assert torch.equal(fn(x, i + 2), sin_loop(x, i + 2))
        best = float("inf")
        for _ in range(7):
            t0 = time.perf_counter()
            for i in range(calls):
                fn(x, i + 5)
            best = min(best, (time.perf_counter() - t0) / calls * 1e6)
        rows.append({"mode": name, "us_per_call": best, "calls": calls})
    (stats,) = b.stats()
    rows[1].update(captures=stats["captures"], replays=stats["replays"])
    return rows


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m torchreplay_bench.buckets", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=20, help="passes over sizes 1..32 per timing")
    p.add_argument("--no-inductor", action="store_true")
    p.add_argument("--out", default="bench_out")
    args = p.parse_args(argv)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    m = model()
    rng = random.Random(0)
    order = list(range(1, 33))
    loop: List[torch.Tensor] = []
    for _ in range(args.rounds):
        rng.shuffle(order)
        loop += [torch.randn(n, 64) for n in order]
    warm = [torch.randn(n, 64) for n in range(1, 33)] * 2

    modes: Dict[str, Callable[[], Any]] = {
        "eager": lambda: (m, None),
        "compile per-size": lambda: (lambda b: (torch.compile(m, backend=b, dynamic=True), b))(backend()),
        "compile buckets": lambda: (lambda b: (torch.compile(m, backend=b, dynamic=True), b))(backend(SIZES)),
        "capture per-size": lambda: captured(m),
        "capture buckets": lambda: captured(m, SIZES),
    }
    if not args.no_inductor:
        modes["inductor"] = lambda: (torch.compile(m, dynamic=True), None)
    rows = []
    with torch.no_grad():
        for name, make in modes.items():
            torch._dynamo.reset()
            fn, b = make()
            for x in warm:
                torch.testing.assert_close(fn(x), m(x), rtol=1e-5, atol=1e-6)
            us = per_call_us(fn, loop, 7)
            row: Dict[str, Any] = {"mode": name, "us_per_call": us}
            if b is not None:
                stats = b.stats()
                row.update(captures=sum(s["captures"] for s in stats),
                           replays=sum(s["replays"] for s in stats), calls=sum(s["calls"] for s in stats),
                           pool_bytes=max(s["pool_bytes"] for s in stats))
            rows.append(row)

        # Padded against exact, per capture size, on the bucketed model.
        torch._dynamo.reset()
        b = backend(SIZES)
        fn = torch.compile(m, backend=b, dynamic=True)
        padded_rows = []
        for size in SIZES[1:]:
            n = size // 2 + 1
            exact = [torch.randn(size, 64) for _ in range(200)]
            padded = [torch.randn(n, 64) for _ in range(200)]
            for x in exact[:3] + padded[:3]:
                fn(x)
            t_exact = t_padded = float("inf")
            for _ in range(7):  # interleaved, best of each: the machine's noise hits both alike
                t_exact = min(t_exact, per_call_us(fn, exact, 1))
                t_padded = min(t_padded, per_call_us(fn, padded, 1))
            padded_rows.append({"size": size, "rows": n, "exact_us": t_exact, "padded_us": t_padded,
                                "ratio": t_padded / t_exact})

        scalar_rows = scalar_loop(args.rounds * 160)

    eager = rows[0]["us_per_call"]
    print(f"batch sizes 1..32 in random order, {len(loop)} calls per pass, MLP 64-128-32, CPU")
    print(f"{'mode':<22}{'us/call':>9}{'vs eager':>10}{'captures':>10}{'replays':>9}{'calls':>8}{'pool KiB':>10}")
    for r in rows:
        print(f"{r['mode']:<22}{r['us_per_call']:>9.1f}{eager / r['us_per_call']:>9.2f}x"
              f"{r.get('captures', '-'):>10}{r.get('replays', '-'):>9}{r.get('calls', '-'):>8}"
              f"{(r['pool_bytes'] / 1024 if 'pool_bytes' in r else '-'):>10}")
    print(f"\n{'capture size':>12}{'rows':>6}{'exact us':>10}{'padded us':>11}{'padded/exact':>14}")
    for r in padded_rows:
        print(f"{r['size']:>12}{r['rows']:>6}{r['exact_us']:>10.1f}{r['padded_us']:>11.1f}{r['ratio']:>13.2f}x")
    print(f"\na Python int changing every call, {scalar_rows[0]['calls']} calls")
    for r in scalar_rows:
        print(f"{r['mode']:<22}{r['us_per_call']:>9.1f}{scalar_rows[0]['us_per_call'] / r['us_per_call']:>9.2f}x"
              f"{r.get('captures', '-'):>10}{r.get('replays', '-'):>9}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "buckets.json"), "w") as f:
        json.dump({"modes": rows, "padded": padded_rows, "scalar": scalar_rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
