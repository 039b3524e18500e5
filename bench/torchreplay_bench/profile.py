"""Where a replay's time goes, step by step, for the harness's models.

    python -m torchreplay_bench.profile [MODEL ...] [--iterations N] [--top K] [--numerics close] [--json PATH]

Each model (default: all of torchreplay_bench.models.MODELS) is captured with torchreplay.capture
(reduce-overhead, one thread; numerics "bitwise" unless --numerics says "close") and its captured
tape replayed N times with every step timed (Captured.profile). Printed per model: the whole replay
(a plain call, timed apart), the sum over steps by kind (prepared pointwise, typed out=, boxed out=,
functional, in place, view, getitem, scalar), and the K slowest steps with their node, op and result
shapes, and under "close" the kernel the rewrite chose for the node with the times it chose from. The per-step clock costs
~20 ns a step, so the sum over steps runs above a plain replay by about that much per step.
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from typing import Any, Dict, List, Optional

import torch

import torchreplay
from torchreplay_bench.models import MODELS


def replay_us(step: Any, args: Any, iterations: int) -> float:
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(iterations):
            step(*args)
        best = min(best, (time.perf_counter() - t0) / iterations * 1e6)
    return best


def profile_model(name: str, iterations: int, numerics: str = "bitwise") -> Dict[str, Any]:
    model, make_inputs = MODELS[name][0]()
    args = make_inputs(0)
    config = torchreplay.CompilerConfig()
    config.mode = "reduce-overhead"
    config.reduce_overhead.numerics = numerics
    with torch.no_grad():
        step = torchreplay.capture(model, args, config=config)
        steps = step.profile(*args, iterations=iterations)
        whole = replay_us(step, args, iterations)
    by_kind: Dict[str, List[float]] = collections.defaultdict(list)
    for s in steps:
        by_kind[s["kind"]].append(s["us"])
    return {"model": name, "replay_us": whole, "steps": steps,
            "by_kind": {k: {"steps": len(v), "us": sum(v)} for k, v in by_kind.items()}}


def render(result: Dict[str, Any], top: int) -> str:
    steps = result["steps"]
    total = sum(s["us"] for s in steps)
    lines = [f"== {result['model']}: replay {result['replay_us']:.1f} us per call (plain); "
             f"{len(steps)} steps, {total:.1f} us summed step by step",
             f"  {'kind':<20}{'steps':>6}{'us':>9}{'share':>8}"]
    for kind, v in sorted(result["by_kind"].items(), key=lambda kv: -kv[1]["us"]):
        lines.append(f"  {kind:<20}{v['steps']:>6}{v['us']:>9.2f}{v['us'] / max(total, 1e-9):>7.0%}")
    lines.append("  slowest steps:")
    lines.append(f"  {'us':>8}  {'kind':<20}{'op':<44} {'node':<24} shapes")
    for s in sorted(steps, key=lambda s: -s["us"])[:top]:
        lines.append(f"  {s['us']:>8.2f}  {s['kind']:<20}{s['op'][:44]:<44} {s['node'][:24]:<24} {s['shapes']}"
                     + (f"\n  {'':>8}  chose {s['choice']}" if "choice" in s else ""))
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m torchreplay_bench.profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models", nargs="*", default=list(MODELS), help=f"of {', '.join(MODELS)}")
    p.add_argument("--iterations", type=int, default=500)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--numerics", choices=["bitwise", "close"], default="bitwise")
    p.add_argument("--json", help="write every step of every model here")
    a = p.parse_args(argv)
    unknown = [m for m in a.models if m not in MODELS]
    if unknown:
        p.error(f"unknown model(s) {', '.join(unknown)}; known: {', '.join(MODELS)}")
    torch.set_num_threads(1)
    results = []
    for name in a.models:
        results.append(profile_model(name, a.iterations, a.numerics))
        print(render(results[-1], a.top), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
