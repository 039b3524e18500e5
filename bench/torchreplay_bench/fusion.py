"""Fused elementwise steps against the ATen ops they replace, by size and thread count.

A chain of 16 elementwise ops on float32 (sigmoid, tanh, mul and add, four times: the kinds a
model's activations and residuals are made of) at sizes from 1k to 4M elements, with 1 and 2
threads: eager (each op one ATen call, split over the threads as ATen splits it) against
`torchreplay.capture` (one fused step). Rounds interleave the two; the median per call is kept.
Each row also checks that the replay's output is bitwise eager's.

    python -m torchreplay_bench.fusion [--sizes 1024,16384,...] [--threads 1,2] [--rounds N]
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, Dict, List

import torch
import torch.nn as nn

import torchreplay

SIZES = [1 << 10, 1 << 14, 1 << 18, 1 << 20, 1 << 22]


class Chain(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for _ in range(4):
            x = torch.sigmoid(x) * y
            x = torch.tanh(x) + y
        return x


def _time(f: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        f()
    return (time.perf_counter() - start) / calls * 1e6


def measure(size: int, threads: int, rounds: int) -> Dict[str, float]:
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(size)
    x, y = torch.randn(size, generator=g), torch.randn(size, generator=g)
    model = Chain()
    cfg = torchreplay.CompilerConfig()
    cfg.mode = "reduce-overhead"
    step = torchreplay.capture(model, (x, y), config=cfg)
    for _ in range(3):
        got = step(x, y)
    want = model(x, y)
    bitwise = bool(torch.equal(got.view(torch.int32), want.view(torch.int32)))
    assert step.stats()["replays"] > 0, step.stats()
    calls = max(3, min(2000, (1 << 22) // size))
    times: Dict[str, List[float]] = {"eager": [], "torchreplay": []}
    with torch.no_grad():
        for _ in range(rounds):
            times["eager"].append(_time(lambda: model(x, y), calls))
            times["torchreplay"].append(_time(lambda: step(x, y), calls))
    eager, ours = statistics.median(times["eager"]), statistics.median(times["torchreplay"])
    return {"size": size, "threads": threads, "eager_us": eager, "torchreplay_us": ours,
            "speedup": eager / ours, "bitwise": bitwise}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default=",".join(map(str, SIZES)))
    p.add_argument("--threads", default="1,2")
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args()
    before = torch.get_num_threads()
    print(f"{'elements':>10} {'threads':>7} {'eager us':>11} {'fused us':>11} {'vs eager':>9}  check")
    try:
        for threads in map(int, args.threads.split(",")):
            for size in map(int, args.sizes.split(",")):
                r = measure(size, threads, args.rounds)
                print(f"{r['size']:>10} {r['threads']:>7} {r['eager_us']:>11.1f} {r['torchreplay_us']:>11.1f} "
                      f"{r['speedup']:>8.2f}x  {'bitwise' if r['bitwise'] else 'WRONG'}")
    finally:
        torch.set_num_threads(before)


if __name__ == "__main__":
    main()
