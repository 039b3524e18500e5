"""Eager vs torchreplay vs the torch.compile peers, per model: time per call, speedup vs eager,
compile/capture time; correctness checked against eager before timing; the modes of a model timed
interleaved (each of --rounds rounds times every mode once; the median over rounds). Reference rows:
dynamo-floor (what Dynamo alone costs per call) and engine (torchreplay's C++ engines called
directly); conv-bound (the convolutions of the captured tape alone, on models with convolutions:
the floor under a replay bitwise equal to eager); a summary per model then splits torchreplay's
time through torch.compile into the two and what the torch.compile path adds on top. One thread
unless --threads says otherwise.

    python -m torchreplay_bench [--device cpu|cuda] [--models mlp,demo] [--modes eager,replay]
                                [--quick] [--threads N] [--out DIR] [--trace]
Writes DIR/results.json, DIR/results.csv and DIR/per_call.png; with --trace, also one
torch.profiler trace per model and mode in DIR/traces (see python -m torchreplay.trace).

The command's parts: modes.py (what each mode builds, and the check against eager before
timing), timing.py (interleaved rounds, host time, traces), report.py (the tables, the summary and
the plot). The other benchmarks are modules of their own (train, fusion, runtimes, deploy, tp,
buckets, generate).
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import sys
import time
from typing import Any, Callable, Dict, List, Optional

import torch

from torchreplay_bench.models import HARNESS_MODELS, MODELS
from torchreplay_bench.modes import AOTI_MODELS, CUDA_ONLY, MODES, fresh_dynamo, prepare
from torchreplay_bench.report import (plot, render_host_ratios, render_summary, render_table, render_trace_table,
                                      summarize)
from torchreplay_bench.timing import TRACE_STEPS, host_overhead_us, record_trace, time_interleaved


def main(argv: Optional[List[str]] = None) -> int:
    # Over 80 lines: the flags of every harness mode and the tables they print; each mode's work is
    # a function of its own, this only wires flags to them.
    p = argparse.ArgumentParser(prog="python -m torchreplay_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--models", default=",".join(HARNESS_MODELS),
                   help="comma-separated (default: " + ",".join(HARNESS_MODELS) + "), of " + ", ".join(MODELS))
    p.add_argument("--modes", default=None, help="comma-separated: " + ", ".join(MODES))
    p.add_argument("--quick", action="store_true",
                   help="short timings, no Inductor, AOTInductor or NativeRT (under a minute on CPU)")
    p.add_argument("--aoti-models", default=",".join(AOTI_MODELS),
                   help="models timed with AOTInductor (its C++ compile takes 5-30 s a model)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads for every mode (default 1)")
    p.add_argument("--rounds", type=int, default=7,
                   help="timing rounds per model: each times every mode once; the median is reported")
    p.add_argument("--out", default="bench_out", help="directory for results.json, results.csv, per_call.png")
    p.add_argument("--trace", action="store_true",
                   help=f"also record a torch.profiler trace of {TRACE_STEPS} steps per model and mode into "
                        "OUT/traces (read them with python -m torchreplay.trace)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    if args.device == "cuda" and not torch.cuda.is_available():
        print("torchreplay_bench: --device cuda, but no CUDA device is available", file=sys.stderr)
        return 2
    if args.modes:
        modes = args.modes.split(",")
    else:
        modes = [m for m in MODES if args.device == "cuda" or m not in CUDA_ONLY]
        if args.quick:
            modes = [m for m in modes if not m.startswith("inductor") and m not in ("aotinductor", "nativert")]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        p.error(f"unknown modes {unknown}")
    models = []
    for name in args.models.split(","):
        if name not in MODELS:
            p.error(f"unknown model {name}")
        if name == "llama_decode":
            try:
                import transformers  # noqa: F401
            except ImportError:
                print("torchreplay_bench: skipping llama_decode (transformers is not installed)", file=sys.stderr)
                continue
        models.append(name)
    os.makedirs(args.out, exist_ok=True)
    trace_dir = os.path.join(args.out, "traces") if args.trace else None
    if trace_dir:
        os.makedirs(trace_dir, exist_ok=True)

    rows: List[Dict[str, Any]] = []
    aoti = set(args.aoti_models.split(",")) if args.aoti_models else set()
    min_run_time = 0.3 if args.quick else 1.5
    for model_name in models:
        # Every mode of a model compiled and checked, then timed interleaved (time_interleaved).
        fresh_dynamo(len(modes))
        steps: Dict[str, Callable[[], None]] = {}
        model_rows: Dict[str, Dict[str, Any]] = {}
        for mode in modes:
            if mode == "aotinductor" and model_name not in aoti:
                continue
            try:
                prepared = prepare(model_name, mode, args.device)
                if prepared is None:
                    continue  # no version of this model in this mode
                model_rows[mode], step = prepared
                if step is not None:
                    steps[mode] = step
            except Exception as e:  # a mode that fails is reported, not fatal
                model_rows[mode] = {"model": model_name, "mode": mode, "correct": False,
                                    "error": f"{type(e).__name__}: {e}"[:300]}
            print(f"{model_name} {mode}: {model_rows[mode].get('check', model_rows[mode].get('error', ''))[:120]}",
                  file=sys.stderr, flush=True)
        for mode, timing in time_interleaved(steps, args.rounds, min_run_time * len(steps)).items():
            model_rows[mode].update(timing)
            with torch.no_grad():
                if args.device == "cuda":
                    model_rows[mode]["host_us"] = host_overhead_us(steps[mode])
                if trace_dir is not None:
                    model_rows[mode].update(record_trace(steps[mode], args.device,
                                                         os.path.join(trace_dir, f"{model_name}.{mode}.json")))
        rows.extend(model_rows.values())
        steps.clear()
    for r in rows:
        base = next((b for b in rows if b["model"] == r["model"] and b["mode"] == "eager"), None)
        if base and "median_us" in r and "median_us" in base:
            r["speedup"] = base["median_us"] / r["median_us"]

    print(render_table(rows, models, modes, args.device))
    summary = summarize(rows, models)
    if summary:
        print(render_summary(summary))
    if args.device == "cuda":
        print(render_host_ratios(rows, models))
    if trace_dir:
        print(render_trace_table(rows))
    meta = {"device": args.device, "torch": torch.__version__, "python": platform.python_version(),
            "machine": platform.machine(), "threads": torch.get_num_threads(),
            "date": time.strftime("%Y-%m-%d"), "modes": {m: MODES[m] for m in modes}}
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"meta": meta, "results": rows, "summary": summary}, f, indent=2)
    fields = ["model", "mode", "correct", "bitwise", "check", "graphs", "median_us", "iqr_us", "runs", "rounds", "speedup",
              "compile_s", "host_us", "error",
              "trace", "trace_host_us", "trace_replays", "trace_aten_ops", "trace_kernel_launches",
              "trace_graph_launches"]
    with open(os.path.join(args.out, "results.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    plot(rows, os.path.join(args.out, "per_call.png"))
    print(f"wrote {args.out}/results.json, results.csv, per_call.png" + (", traces/" if trace_dir else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
