"""Eager vs torchreplay vs the torch.compile peers, per model: time per call, speedup vs eager,
compile/capture time; correctness checked against eager before timing.

    python -m torchreplay.bench [--device cpu|cuda] [--models mlp,demo] [--modes eager,replay]
                                [--quick] [--out DIR] [--trace]
Writes DIR/results.json, DIR/results.csv and DIR/speedup.png; with --trace, also one
torch.profiler trace per model and mode in DIR/traces (see python -m torchreplay.trace).
"""
from __future__ import annotations

import argparse
import copy
import csv
import json
import os
import platform
import sys
import time
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.utils.benchmark as tbench

import torchreplay
from torchreplay.bench.models import MODELS

MODES = {
    "eager": "eager PyTorch",
    "torchreplay-default": "torchreplay, mode default (C++ interpreter)",
    "torchreplay-reduce-overhead": "torchreplay, mode reduce-overhead (capture + replay)",
    "dynamo-eager": "torch.compile(backend='eager'): Dynamo alone, the per-call floor of any backend",
    "aot_eager": "torch.compile(backend='aot_eager')",
    "inductor": "torch.compile() (Inductor)",
    "cuda-graph-by-hand": "torch.cuda.CUDAGraph captured once, replayed from Python with the input copy",
    "cudagraphs": "torch.compile(backend='cudagraphs')",
    "inductor-reduce-overhead": "torch.compile(mode='reduce-overhead')",
}
CUDA_ONLY = {"cuda-graph-by-hand", "cudagraphs", "inductor-reduce-overhead"}
_CUSTOM: Dict[str, Callable[[torch.nn.Module], Callable]] = {}


def register_mode(name: str, description: str, compile_fn: Callable[[torch.nn.Module], Callable],
                  cuda_only: bool = False) -> None:
    """Adds a mode to the harness: compile_fn(model) returns the callable to time (e.g. your own
    torch.compile backend). Selected with --modes like the built-in ones."""
    MODES[name] = description
    _CUSTOM[name] = compile_fn
    if cuda_only:
        CUDA_ONLY.add(name)


class GraphByHand:
    """The floor for CUDA replay from Python: the model captured once into a torch.cuda.CUDAGraph
    (after warm-up on a side stream); each call copies its tensor inputs into the static ones
    and replays. Valid for one input shape, like the benchmark uses it."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.graph = model, None

    def __call__(self, *inputs: Any) -> Any:
        if self.graph is None:
            self.static = [x.clone() if isinstance(x, torch.Tensor) else x for x in inputs]
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self.model(*[x.clone() if isinstance(x, torch.Tensor) else x for x in inputs])
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.out = self.model(*self.static)
        for dst, src in zip(self.static, inputs):
            if isinstance(dst, torch.Tensor):
                dst.copy_(src)
        self.graph.replay()
        return self.out


def compile_for(mode: str, model: torch.nn.Module) -> Callable:
    if mode == "cuda-graph-by-hand":
        return GraphByHand(model)
    if mode in _CUSTOM:
        return _CUSTOM[mode](model)
    if mode == "eager":
        return model
    if mode.startswith("torchreplay-"):
        config = torchreplay.CompilerConfig()
        config.mode = mode[len("torchreplay-"):]
        return torch.compile(model, backend=torchreplay.get_backend(compiler_config=config))
    if mode == "dynamo-eager":
        return torch.compile(model, backend="eager")
    if mode == "aot_eager":
        return torch.compile(model, backend="aot_eager")
    if mode == "inductor":
        return torch.compile(model)
    if mode == "cudagraphs":
        return torch.compile(model, backend="cudagraphs")
    if mode == "inductor-reduce-overhead":
        return torch.compile(model, mode="reduce-overhead")
    raise ValueError(f"unknown mode {mode}")


def to_device(x: Any, device: str) -> Any:
    return x.to(device) if isinstance(x, torch.Tensor) else x


def same(a: Any, b: Any) -> tuple:
    """(close, bitwise) of two outputs."""
    if isinstance(a, (tuple, list)):
        pairs = [same(x, y) for x, y in zip(a, b)]
        return all(p[0] for p in pairs), all(p[1] for p in pairs)
    close = a.shape == b.shape and torch.allclose(a, b, rtol=1e-4, atol=1e-5)
    return close, close and torch.equal(a, b)


TRACE_STEPS = 5


def host_overhead_us(call: Callable[[], Any], calls: int = 400, sync_every: int = 8) -> float:
    """Median host time of one call that launches GPU work, without waiting for the GPU: each
    call is timed alone, and the GPU is caught up (untimed) every few calls so the launch queue
    never fills up and blocks the host."""
    times = []
    torch.cuda.synchronize()
    for i in range(calls):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
        if i % sync_every == sync_every - 1:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    times.sort()
    return times[len(times) // 2] * 1e6


def record_trace(call: Callable[[], None], device: str, path: str) -> Dict[str, Any]:
    """Profiles TRACE_STEPS calls (one profiler step each) into a Chrome trace at `path` and
    returns the medians torchreplay.trace reports for it."""
    from torchreplay import trace

    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    schedule = torch.profiler.schedule(wait=0, warmup=1, active=TRACE_STEPS, repeat=1)
    with torch.profiler.profile(activities=activities, schedule=schedule) as prof:
        for _ in range(TRACE_STEPS + 1):
            call()
            prof.step()
    prof.export_chrome_trace(path)
    t = trace.summarize(path)
    fields = ["host_us", "replays", "aten_ops", "kernel_launches", "graph_launches"]
    return {"trace": path, **{f"trace_{k}": t.median(k) for k in fields}}


def measure(model_name: str, mode: str, device: str, min_run_time: float,
            trace_dir: Optional[str] = None) -> Dict[str, Any]:
    factory, _desc = MODELS[model_name]
    torch.manual_seed(0)
    model, make_inputs = factory()
    model = model.to(device)
    reference = copy.deepcopy(model)
    fn = compile_for(mode, copy.deepcopy(model))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    row: Dict[str, Any] = {"model": model_name, "mode": mode}
    with torch.no_grad():
        # Warm-up: compile, warm-up runs, capture. Checked against eager on the same inputs.
        t0 = time.perf_counter()
        ok, bitwise = True, True
        for i in range(3):
            inputs = [to_device(x, device) for x in make_inputs(i)]
            want = reference(*copy.deepcopy(inputs))
            got = fn(*inputs)
            close, exact = same(got, want)
            ok, bitwise = ok and close, bitwise and exact
        sync()
        row["compile_s"] = time.perf_counter() - t0
        row["correct"], row["bitwise"] = ok, bitwise
        if not ok:
            return row
        inputs = [to_device(x, device) for x in make_inputs(3)]

        def call() -> None:
            fn(*inputs)
            sync()

        timer = tbench.Timer(stmt="call()", globals={"call": call})
        m = timer.blocked_autorange(min_run_time=min_run_time)
        row["median_us"] = m.median * 1e6
        row["iqr_us"] = m.iqr * 1e6
        row["runs"] = len(m.times)
        if device == "cuda":
            row["host_us"] = host_overhead_us(lambda: fn(*inputs))
        if trace_dir is not None:
            row.update(record_trace(call, device, os.path.join(trace_dir, f"{model_name}.{mode}.json")))
    return row


def plot(rows: List[Dict[str, Any]], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows}, key=list(MODELS).index)
    modes = [m for m in MODES if m != "eager" and any(r["mode"] == m for r in rows)]
    fig, ax = plt.subplots(figsize=(1.6 + 1.5 * len(models), 4))
    width = 0.8 / max(1, len(modes))
    for j, mode in enumerate(modes):
        ys = [next((r.get("speedup", 0) for r in rows if r["model"] == m and r["mode"] == mode), 0) for m in models]
        ax.bar([i + j * width for i in range(len(models))], ys, width, label=mode)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([i + width * (len(modes) - 1) / 2 for i in range(len(models))], models)
    ax.set_ylabel("speedup vs eager (x)")
    ax.set_title("time per call, speedup over eager")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m torchreplay.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--models", default=",".join(m for m in MODELS), help="comma-separated: " + ", ".join(MODELS))
    p.add_argument("--modes", default=None, help="comma-separated: " + ", ".join(MODES))
    p.add_argument("--quick", action="store_true", help="short timings, no Inductor (under a minute on CPU)")
    p.add_argument("--out", default="bench_out", help="directory for results.json, results.csv, speedup.png")
    p.add_argument("--trace", action="store_true",
                   help=f"also record a torch.profiler trace of {TRACE_STEPS} steps per model and mode into "
                        "OUT/traces (read them with python -m torchreplay.trace)")
    args = p.parse_args(argv)

    if args.device == "cuda" and not torch.cuda.is_available():
        print("torchreplay.bench: --device cuda, but no CUDA device is available", file=sys.stderr)
        return 2
    if args.modes:
        modes = args.modes.split(",")
    else:
        modes = [m for m in MODES if args.device == "cuda" or m not in CUDA_ONLY]
        if args.quick:
            modes = [m for m in modes if not m.startswith("inductor")]
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
                print("torchreplay.bench: skipping llama_decode (transformers is not installed)", file=sys.stderr)
                continue
        models.append(name)
    os.makedirs(args.out, exist_ok=True)
    trace_dir = os.path.join(args.out, "traces") if args.trace else None
    if trace_dir:
        os.makedirs(trace_dir, exist_ok=True)

    from tqdm import tqdm

    rows: List[Dict[str, Any]] = []
    jobs = [(m, mode) for m in models for mode in modes]
    min_run_time = 0.3 if args.quick else 1.5
    for model_name, mode in tqdm(jobs, desc="compile, capture, time", unit="run", file=sys.stderr):
        torch._dynamo.reset()
        try:
            rows.append(measure(model_name, mode, args.device, min_run_time, trace_dir))
        except Exception as e:  # a mode that fails is reported, not fatal
            rows.append({"model": model_name, "mode": mode, "correct": False, "error": f"{type(e).__name__}: {e}"[:300]})
    for r in rows:
        base = next((b for b in rows if b["model"] == r["model"] and b["mode"] == "eager"), None)
        if base and "median_us" in r and "median_us" in base:
            r["speedup"] = base["median_us"] / r["median_us"]

    print(render_table(rows, models, modes, args.device))
    if args.device == "cuda":
        print(render_host_ratios(rows, models))
    if trace_dir:
        print(render_trace_table(rows))
    meta = {"device": args.device, "torch": torch.__version__, "python": platform.python_version(),
            "machine": platform.machine(), "threads": torch.get_num_threads(),
            "date": time.strftime("%Y-%m-%d"), "modes": {m: MODES[m] for m in modes}}
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"meta": meta, "results": rows}, f, indent=2)
    fields = ["model", "mode", "correct", "bitwise", "median_us", "iqr_us", "runs", "speedup", "compile_s",
              "host_us", "error",
              "trace", "trace_host_us", "trace_replays", "trace_aten_ops", "trace_kernel_launches",
              "trace_graph_launches"]
    with open(os.path.join(args.out, "results.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    plot(rows, os.path.join(args.out, "speedup.png"))
    print(f"wrote {args.out}/results.json, results.csv, speedup.png" + (", traces/" if trace_dir else ""))
    return 0


def render_table(rows: List[Dict[str, Any]], models: List[str], modes: List[str], device: str) -> str:
    host = device == "cuda"
    where = torch.cuda.get_device_name() if host else f"{torch.get_num_threads()} threads"
    lines = [f"torchreplay benchmark: device {device} ({where}), torch {torch.__version__}",
             f"{'model':<18}{'mode':<30}{'us/call':>10}{'iqr':>8}{'vs eager':>10}{'compile s':>11}"
             + (f"{'host us':>10}" if host else "") + "  check"]
    for m in models:
        for mode in modes:
            r = next((x for x in rows if x["model"] == m and x["mode"] == mode), None)
            if r is None:
                continue
            if not r.get("correct"):
                why = r.get("error", "output differs from eager")
                lines.append(f"{m:<18}{mode:<30}{'WRONG':>10}{'':>8}{'':>10}{r.get('compile_s', 0):>11.2f}  {why}")
                continue
            check = "bitwise" if r["bitwise"] else "close"
            lines.append(f"{m:<18}{mode:<30}{r['median_us']:>10.1f}{r['iqr_us']:>8.1f}"
                         f"{r.get('speedup', 0):>9.2f}x{r['compile_s']:>11.2f}"
                         + (f"{r.get('host_us', 0):>10.1f}" if host else "") + f"  {check}")
    return "\n".join(lines)


def render_host_ratios(rows: List[Dict[str, Any]], models: List[str]) -> str:
    """Host time per call of torchreplay against the graph-replay peers (CUDA)."""
    def host(model: str, mode: str) -> Optional[float]:
        r = next((x for x in rows if x["model"] == model and x["mode"] == mode), None)
        return r.get("host_us") if r and r.get("correct") else None

    lines = ["host time per call, torchreplay reduce-overhead against (lower is better for torchreplay):",
             f"{'model':<18}{'x by-hand replay':>18}{'cudagraphs / it':>17}{'inductor-ro / it':>18}"]
    for m in models:
        ours = host(m, "torchreplay-reduce-overhead")
        if not ours:
            continue
        cells = []
        for mode, ratio in (("cuda-graph-by-hand", lambda o: ours / o), ("cudagraphs", lambda o: o / ours),
                            ("inductor-reduce-overhead", lambda o: o / ours)):
            other = host(m, mode)
            cells.append(f"{ratio(other):.2f}x" if other else "-")
        lines.append(f"{m:<18}{cells[0]:>18}{cells[1]:>17}{cells[2]:>18}")
    return "\n".join(lines)


def render_trace_table(rows: List[Dict[str, Any]]) -> str:
    lines = [f"profiler traces (median per step; python -m torchreplay.trace summarize FILE for the rest)",
             f"{'model':<18}{'mode':<30}{'host us':>10}{'replays':>9}{'aten ops':>10}{'launches':>10}{'graph launches':>16}  file"]
    for r in rows:
        if "trace" not in r:
            continue
        lines.append(f"{r['model']:<18}{r['mode']:<30}{r['trace_host_us']:>10.1f}{r['trace_replays']:>9.0f}"
                     f"{r['trace_aten_ops']:>10.0f}{r['trace_kernel_launches']:>10.0f}{r['trace_graph_launches']:>16.0f}"
                     f"  {r['trace']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
