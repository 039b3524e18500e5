"""What running a model's kernels does to Dynamo's per-call cost right after them.

    python -m torchreplay_bench.interference [MODEL] [--calls N]

Through torch.compile a call costs Dynamo's frame (the `dynamo-floor` of the harness: guards,
frame, a backend returning stale outputs) and then the compiled graph; the two back to back cost
more than their sum. This times, for a model of the zoo (default gpt_neox), the floor alone and
the floor in alternation with another call: torchreplay's engine on the model, the model run
eagerly, a 200x200 matmul, a 4 MB in-place sweep, a tiny captured function and nothing, each pair
timed per half (µs, mean of N pairs). One thread, torch.no_grad().
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from typing import Callable, List, Optional

import torch

import torchreplay
from torchreplay_bench.modes import compile_for, fresh_dynamo
from torchreplay_bench.zoo_models import MODELS


def pairs(floor: Callable[[], None], other: Callable[[], None], calls: int) -> tuple:
    """(floor µs, other µs) when the two alternate, and other's µs alone."""
    for _ in range(50):
        floor(), other()
    first = second = alone = 0.0
    clock = time.perf_counter
    for _ in range(calls):
        t0 = clock()
        floor()
        t1 = clock()
        other()
        first, second = first + t1 - t0, second + clock() - t1
    for _ in range(calls):
        t0 = clock()
        other()
        alone += clock() - t0
    return first / calls * 1e6, second / calls * 1e6, alone / calls * 1e6


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m torchreplay_bench.interference", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default="gpt_neox", help=f"of {', '.join(MODELS)}")
    p.add_argument("--calls", type=int, default=1500)
    a = p.parse_args(argv)
    if a.model not in MODELS:
        p.error(f"unknown model {a.model}")
    torch.set_num_threads(1)
    fresh_dynamo(2)
    torch.manual_seed(0)
    model, make_inputs = MODELS[a.model]()
    x = make_inputs(0)
    with torch.no_grad():
        floor_fn = compile_for("dynamo-floor", copy.deepcopy(model), list(x))
        engine = compile_for("engine", copy.deepcopy(model), list(x))
        engine(*x)
        a_, b_, out = torch.randn(200, 200), torch.randn(200, 200), torch.empty(200, 200)
        big, small = torch.randn(1 << 20), torch.randn(16)
        tiny = torchreplay.capture(lambda t: t + 1, (small,))
        others = {
            "torchreplay's engine": engine.step,
            "the model, eager": lambda: model(*x),
            "a 200x200 matmul": lambda: torch.mm(a_, b_, out=out),
            "a 4 MB in-place add": lambda: big.add_(1.0),
            "a tiny captured function": lambda: tiny(small),
            "nothing": lambda: None,
        }
        print(f"{a.model}: dynamo-floor in alternation with another call (us per call)")
        print(f"  {'other call':<26}{'floor':>9}{'other':>9}{'other alone':>13}")
        for name, other in others.items():
            floor, second, alone = pairs(lambda: floor_fn(*x), other, a.calls)
            print(f"  {name:<26}{floor:>9.1f}{second:>9.1f}{alone:>13.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
