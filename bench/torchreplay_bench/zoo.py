"""Model zoo benchmark: tiny random-weight transformers architectures and torchvision CNNs, each
through eager, torchreplay (torch.compile, reduce-overhead), torchreplay.capture and Inductor.

    python -m torchreplay_bench.zoo [--models llama,resnet18] [--modes eager,inductor]
                                    [--rounds 7] [--out DIR]

Per model every mode is compiled (compile time reported), checked against eager on fresh inputs
(bitwise or close), then timed interleaved: each round times every mode once (a block of calls
each), and the median over rounds is reported, so that the machine's drift hits every mode alike.
One thread, torch.no_grad(). Writes DIR/zoo.json and prints a table with each mode's ratio to eager
and torchreplay's to Inductor. transformers (in tools/requirements.txt) and torchvision are needed.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional

import torch

from torchreplay_bench.modes import compile_for, fresh_dynamo, same
from torchreplay_bench.zoo_models import MODELS

MODES = ["eager", "torchreplay-reduce-overhead", "torchreplay-capture", "inductor", "conv-bound"]


def _time_block(fn: Callable[..., Any], inputs: tuple, seconds: float) -> float:
    """Microseconds per call over a block of calls lasting about `seconds`."""
    n, t0 = 0, time.perf_counter()
    while True:
        fn(*inputs)
        n += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds:
            return elapsed / n * 1e6


def measure(name: str, modes: List[str], rounds: int, seconds: float) -> Dict[str, Any]:
    fresh_dynamo(len(modes))
    torch.manual_seed(0)
    model, make_inputs = MODELS[name]()
    reference = copy.deepcopy(model)
    row: Dict[str, Any] = {"model": name, "modes": {}}
    fns: Dict[str, Callable] = {}
    for mode in modes:
        entry: Dict[str, Any] = {}
        row["modes"][mode] = entry
        t0 = time.perf_counter()
        try:
            fn = compile_for(mode, copy.deepcopy(model), list(make_inputs(0)))
            if fn is None:  # no version of this model in this mode (conv-bound of a transformer)
                del row["modes"][mode]
                continue
            ok = bitwise = True
            for i in range(4):
                inputs = make_inputs(i)
                close, exact = same(fn(*inputs), reference(*inputs))
                ok, bitwise = ok and close, bitwise and exact
            entry["compile_s"] = time.perf_counter() - t0
            entry["check"] = "bitwise" if bitwise else "close" if ok else "WRONG"
            if ok:
                fns[mode] = fn
        except Exception as e:  # noqa: BLE001 - a mode that fails for a model says why
            entry["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
    inputs = make_inputs(5)
    times: Dict[str, List[float]] = {m: [] for m in fns}
    for _ in range(rounds):
        for mode, fn in fns.items():
            timed = fn.time_us(inputs, seconds) if hasattr(fn, "time_us") else _time_block(fn, inputs, seconds)
            times[mode].append(timed)
    for mode, ts in times.items():
        row["modes"][mode]["us"] = statistics.median(ts)
    return row


def render(rows: List[Dict[str, Any]], modes: List[str]) -> str:
    head = f"{'model':<20}" + "".join(f"{m:>30}" for m in modes) + \
        f"{'ours / Inductor':>18}{'capture / Inductor':>20}{'conv-bound / Inductor':>23}"
    lines = [head]
    for r in rows:
        eager = r["modes"].get("eager", {}).get("us")
        cells = []
        for m in modes:
            e = r["modes"].get(m, {})
            if "us" in e:
                ratio = f" ({eager / e['us']:.2f}x)" if eager else ""
                cells.append(f"{e['us']:.1f}{ratio} {e['check']}")
            else:
                cells.append(e.get("error", e.get("check", "-"))[:28])
        ind = r["modes"].get("inductor", {}).get("us")
        ours = r["modes"].get("torchreplay-reduce-overhead", {}).get("us")
        cap = r["modes"].get("torchreplay-capture", {}).get("us")
        vs = f"{ind / ours:.2f}x" if ind and ours else "-"
        vs_cap = f"{ind / cap:.2f}x" if ind and cap else "-"
        bound = r["modes"].get("conv-bound", {}).get("us")
        vs_bound = f"{ind / bound:.2f}x" if ind and bound else "-"
        lines.append(f"{r['model']:<20}" + "".join(f"{c:>30}" for c in cells) + f"{vs:>18}{vs_cap:>20}{vs_bound:>23}")
    lines.append("(us per call, median over rounds; (x) = eager / mode; ours / Inductor = Inductor's time / "
                 "torchreplay's through torch.compile, above 1 where torchreplay is faster; conv-bound = the "
                 "convolution steps of capture's tape alone, the floor under a replay bitwise equal to eager: "
                 "conv-bound / Inductor below 1 where Inductor's whole model takes less than eager's "
                 "convolutions)")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m torchreplay_bench.zoo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated, of " + ", ".join(MODELS))
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--seconds", type=float, default=0.2, help="length of each timed block")
    p.add_argument("--out", default="bench_out")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    names = a.models.split(",")
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        p.error(f"unknown models {unknown}")
    modes = a.modes.split(",")
    rows = []
    with torch.no_grad():
        for name in names:
            rows.append(measure(name, modes, a.rounds, a.seconds))
            print(render(rows[-1:], modes).splitlines()[1], flush=True, file=sys.stderr)
    print(render(rows, modes))
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "zoo.json"), "w") as f:
        json.dump({"threads": torch.get_num_threads(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
