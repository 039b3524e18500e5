"""Where did my step's host time go, and did replay happen?

Reads Chrome traces exported by torch.profiler (``prof.export_chrome_trace(path)``) and reports,
per step, host time, the time inside torchreplay's ranges, ATen op dispatches, kernel launches
and, on CUDA, GPU busy time and idle gaps.

    python -m torchreplay.trace summarize TRACE.json [--json]
    python -m torchreplay.trace compare A.json B.json

A step is one call, so that two traces compare call for call. It is found, in this order:

- ``ProfilerStep#N`` ranges ("profiler steps": a profiler schedule and ``prof.step()`` per call);
- the outermost ``torch.profiler.record_function`` ranges of one name ("record_function 'NAME'");
- with ``with_stack=True``, each call that the loop under the profiler makes ("top-level calls":
  the Python calls made by the frame that entered the profiler, those with an operator event in
  them: ATen ops, torchreplay's or Dynamo's ranges; the most expensive callee when there are
  several);
- each compiled call (``Torch-Compiled Region``; "compiled calls": one call of a compiled function
  is several regions when Dynamo broke its graph, and Dynamo's guard check is outside them);
- else the whole trace is one step ("whole trace"), which is no per-call unit: the summary warns.

``compare`` shows each side's step count and unit, and warns, leaving out the ratios, when the
units differ or either side has no per-call unit. A plain eager loop under
``torch.profiler.profile()`` records no per-call unit: add ``with_stack=True``, a
``record_function`` range per call, or a schedule with ``prof.step()``.
"""
from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import statistics
import sys
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

RANGES = {
    "replay": "torchreplay::replay",
    "capture": "torchreplay::capture",
    "warmup": "torchreplay::warmup",
    "eager_fallback": "torchreplay::eager_fallback",
}
KERNEL_LAUNCHES = {"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                   "cudaLaunchCooperativeKernel", "cudaLaunchCooperativeKernelMultiDevice"}
GRAPH_LAUNCHES = {"cudaGraphLaunch", "cuGraphLaunch"}
HOST_CATEGORIES = {"cpu_op", "user_annotation", "cuda_runtime", "cuda_driver", "python_function"}
GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}


@dataclasses.dataclass
class StepSummary:
    name: str
    host_us: float
    replay_us: float = 0.0
    capture_us: float = 0.0
    warmup_us: float = 0.0
    eager_fallback_us: float = 0.0
    replays: int = 0
    captures: int = 0
    warmups: int = 0
    eager_fallbacks: int = 0
    aten_ops: int = 0        # ATen ops dispatched by the program (not nested in another op)
    aten_ops_all: int = 0    # ... including those that ops dispatch internally
    kernel_launches: int = 0  # cudaLaunchKernel and friends
    graph_launches: int = 0   # cudaGraphLaunch
    gpu_kernels: int = 0      # GPU activity (kernels, copies, memsets) launched from this step
    gpu_busy_us: float = 0.0  # union of that activity
    gpu_idle_us: float = 0.0  # gaps between it, first start to last end
    gpu_max_gap_us: float = 0.0


@dataclasses.dataclass
class TraceSummary:
    path: str
    step_kind: str  # one of PER_CALL_KINDS, or "whole trace"
    step_label: str  # the record_function range's name, or the top-level call ("" otherwise)
    steps: List[StepSummary]
    has_gpu: bool

    @property
    def per_call(self) -> bool:
        return self.step_kind in PER_CALL_KINDS

    @property
    def unit(self) -> str:
        """The step unit as headers show it, e.g. "top-level calls (nn.Module: MLP_0)"."""
        if self.step_kind == "record_function":
            return f"record_function {self.step_label!r}"
        return f"{self.step_kind} ({self.step_label})" if self.step_label else self.step_kind

    def warnings(self) -> List[str]:
        if self.per_call:
            return []
        return [f"{self.path or 'trace'}: no per-call unit found (no ProfilerStep#N, record_function "
                f"range, Python call stack or compiled region): the whole trace is one step. Record "
                f"with with_stack=True, a record_function range per call, or a schedule and prof.step()."]

    def median(self, field: str) -> float:
        values = [getattr(s, field) for s in self.steps]
        return statistics.median(values) if values else 0.0


def load(path: str) -> List[Dict[str, Any]]:
    """The trace's complete ("X") events."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "ts" in e and "dur" in e]


def _end(e: Dict[str, Any]) -> float:
    return float(e["ts"]) + float(e["dur"])


def _outermost(events: Iterable[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Events not nested inside another of the same list (per thread)."""
    out: List[Dict[str, Any]] = []
    open_until: Dict[Any, float] = {}
    for e in sorted(events, key=lambda e: (float(e["ts"]), -float(e["dur"]))):
        key = (e.get("pid"), e.get("tid"))
        if float(e["ts"]) < open_until.get(key, float("-inf")):
            continue
        out.append(e)
        open_until[key] = _end(e)
    return out


# Ranges that the profiler, Dynamo and torchreplay record themselves: not a user's per-call range.
_INTERNAL_RANGES = ("ProfilerStep#", "torchreplay::", "Torch-Compiled Region", "TorchDynamo",
                    "Pregraph bytecode", "CompiledFunction", "## ", "PyTorch Profiler")
_PROFILER_FRAMES = ("torch/profiler/", "torch/autograd/profiler")
PER_CALL_KINDS = ("profiler steps", "record_function", "top-level calls", "compiled calls")


def _inside(outer: Dict[str, Any], events: Iterable[Dict[str, Any]]) -> List[Dict[str, Any]]:
    t0, t1 = float(outer["ts"]), _end(outer)
    return [e for e in events if e is not outer and t0 <= float(e["ts"]) and _end(e) <= t1]


def _top_level_calls(events: Sequence[Dict[str, Any]]) -> Tuple[str, List[Dict[str, Any]]]:
    """With with_stack=True: the calls made by the frame that entered the profiler (the loop),
    those with an operator event in them (cpu_op), of the callee with the most time in them.
    The label is the outermost nn.Module inside (e.g. "nn.Module: MLP_0"), else the callee."""
    python = [e for e in events if e.get("cat") == "python_function"]
    entered = [e for e in python if any(f in str(e["name"]) for f in _PROFILER_FRAMES)]
    if not entered:
        return "", []
    first = min(entered, key=lambda e: (float(e["ts"]), -float(e["dur"])))
    thread = (first.get("pid"), first.get("tid"))
    same_thread = [e for e in python if (e.get("pid"), e.get("tid")) == thread]
    enclosing = [e for e in same_thread if e is not first and float(e["ts"]) <= float(first["ts"])
                 and _end(first) <= _end(e)]
    if not enclosing:
        return "", []
    loop = min(enclosing, key=lambda e: float(e["dur"]))  # the innermost frame around the profiler
    work = [e for e in events if e.get("cat") == "cpu_op"]
    callees: Dict[str, List[Dict[str, Any]]] = {}
    for call in _outermost(_inside(loop, same_thread)):
        if any(f in str(call["name"]) for f in _PROFILER_FRAMES) or not _inside(call, work):
            continue
        callees.setdefault(str(call["name"]), []).append(call)
    if not callees:
        return "", []
    calls = max(callees.values(), key=lambda c: sum(float(e["dur"]) for e in c))
    modules = [e for e in _inside(calls[0], same_thread) if str(e["name"]).startswith("nn.Module: ")]
    label = str(_outermost(modules)[0]["name"]) if modules else str(calls[0]["name"])
    return label, calls


def find_steps(events: Sequence[Dict[str, Any]]) -> Tuple[str, str, List[Dict[str, Any]]]:
    """(kind, label, step events): one step per call where the trace shows calls (module doc)."""
    host = [e for e in events if e.get("cat") in HOST_CATEGORIES]
    marked = [e for e in host if str(e["name"]).startswith("ProfilerStep#")]
    if marked:
        return "profiler steps", "", _outermost(marked)
    ranges: Dict[str, List[Dict[str, Any]]] = {}
    for e in _outermost(e for e in host if e.get("cat") != "python_function"):  # not inside an op
        if e.get("cat") == "user_annotation" and not str(e["name"]).startswith(_INTERNAL_RANGES):
            ranges.setdefault(str(e["name"]), []).append(e)
    if ranges:
        name, steps = max(ranges.items(), key=lambda kv: sum(float(e["dur"]) for e in kv[1]))
        return "record_function", name, steps
    label, calls = _top_level_calls(host)
    if calls:
        return "top-level calls", label, calls
    compiled = [e for e in host if str(e["name"]).startswith("Torch-Compiled Region")]
    if compiled:
        return "compiled calls", "", _outermost(compiled)
    if not host:
        return "whole trace", "", []
    start = min(float(e["ts"]) for e in host)
    end = max(_end(e) for e in host)
    return "whole trace", "", [{"name": "trace", "ts": start, "dur": end - start}]


def _union(intervals: List[Tuple[float, float]]) -> Tuple[float, float, float]:
    """(busy, idle between first start and last end, largest gap)."""
    busy = idle = max_gap = 0.0
    cur_start: Optional[float] = None
    cur_end = 0.0
    for s, e in sorted(intervals):
        if cur_start is None:
            cur_start, cur_end = s, e
        elif s > cur_end:
            busy += cur_end - cur_start
            gap = s - cur_end
            idle += gap
            max_gap = max(max_gap, gap)
            cur_start, cur_end = s, e
        else:
            cur_end = max(cur_end, e)
    if cur_start is not None:
        busy += cur_end - cur_start
    return busy, idle, max_gap


def summarize_events(events: Sequence[Dict[str, Any]], path: str = "") -> TraceSummary:
    kind, label, steps = find_steps(events)
    host = sorted((e for e in events if e.get("cat") in HOST_CATEGORIES), key=lambda e: float(e["ts"]))
    gpu_by_correlation: Dict[Any, List[Dict[str, Any]]] = {}
    for e in events:
        if e.get("cat") in GPU_CATEGORIES:
            corr = (e.get("args") or {}).get("correlation")
            gpu_by_correlation.setdefault(corr, []).append(e)
    summaries = []
    for i, step in enumerate(steps):
        t0, t1 = float(step["ts"]), _end(step)
        inside = [e for e in host if t0 <= float(e["ts"]) and _end(e) <= t1 and e is not step]
        name = str(step["name"]) if kind in ("profiler steps", "whole trace") else f"call {i + 1}"
        s = StepSummary(name=name, host_us=float(step["dur"]))
        for field, range_name in RANGES.items():
            ranges = _outermost(e for e in inside if e["name"] == range_name)
            setattr(s, f"{field}_us", sum(float(e["dur"]) for e in ranges))
            setattr(s, field + "s", len(ranges))   # replays, captures, warmups, eager_fallbacks
        aten = [e for e in inside if e.get("cat") == "cpu_op" and str(e["name"]).startswith("aten::")]
        s.aten_ops_all = len(aten)
        s.aten_ops = len(_outermost(aten))
        launches = [e for e in inside if e["name"] in KERNEL_LAUNCHES or e["name"] in GRAPH_LAUNCHES]
        s.kernel_launches = sum(e["name"] in KERNEL_LAUNCHES for e in launches)
        s.graph_launches = sum(e["name"] in GRAPH_LAUNCHES for e in launches)
        gpu = [g for e in launches for g in gpu_by_correlation.get((e.get("args") or {}).get("correlation"), [])]
        s.gpu_kernels = len(gpu)
        s.gpu_busy_us, s.gpu_idle_us, s.gpu_max_gap_us = _union([(float(g["ts"]), _end(g)) for g in gpu])
        summaries.append(s)
    has_gpu = any(e.get("cat") in GPU_CATEGORIES for e in events)
    return TraceSummary(path=path, step_kind=kind, step_label=label, steps=summaries, has_gpu=has_gpu)


def summarize(path: str) -> TraceSummary:
    return summarize_events(load(path), path)


# ------------------------------------------------------------------------------------- output

_COLUMNS = [  # (field, header, format)
    ("host_us", "host us", "{:.1f}"),
    ("replays", "replays", "{}"),
    ("replay_us", "replay us", "{:.1f}"),
    ("captures", "captures", "{}"),
    ("capture_us", "capture us", "{:.1f}"),
    ("warmups", "warmups", "{}"),
    ("eager_fallbacks", "fallbacks", "{}"),
    ("aten_ops", "aten ops", "{}"),
    ("aten_ops_all", "(nested)", "{}"),
    ("kernel_launches", "launches", "{}"),
    ("graph_launches", "graph launches", "{}"),
]
_GPU_COLUMNS = [
    ("gpu_kernels", "gpu ops", "{}"),
    ("gpu_busy_us", "gpu busy us", "{:.1f}"),
    ("gpu_idle_us", "gpu idle us", "{:.1f}"),
    ("gpu_max_gap_us", "max gap us", "{:.1f}"),
]


def _fmt(fmt: str, v: float) -> str:
    return fmt.format(v) if fmt == "{:.1f}" else ("{:.0f}".format(v) if float(v).is_integer() else f"{v:.1f}")


def _steps(t: TraceSummary) -> str:
    return f"{len(t.steps)} step{'' if len(t.steps) == 1 else 's'}"


def render_summary(t: TraceSummary) -> str:
    cols = _COLUMNS + (_GPU_COLUMNS if t.has_gpu else [])
    width = max([len("median")] + [len(s.name) for s in t.steps]) + 2
    lines = [f"{t.path or 'trace'}: {_steps(t)} ({t.unit}), {'CPU and GPU' if t.has_gpu else 'CPU only'}"]
    lines += [f"warning: {w}" for w in t.warnings()]
    lines += ["step".ljust(width) + "".join(h.rjust(max(len(h), 8) + 2) for _, h, _ in cols)]
    for s in t.steps:
        lines.append(s.name.ljust(width) + "".join(
            _fmt(f, getattr(s, k)).rjust(max(len(h), 8) + 2) for k, h, f in cols))
    if t.steps:
        lines.append("median".ljust(width) + "".join(
            _fmt(f, t.median(k)).rjust(max(len(h), 8) + 2) for k, h, f in cols))
    replayed = sum(1 for s in t.steps if s.replays)
    fallbacks = sum(s.eager_fallbacks for s in t.steps)
    lines.append(f"replay ran in {replayed} of {len(t.steps)} steps; {fallbacks} eager fallbacks; "
                 f"median host time outside torchreplay's ranges "
                 f"{statistics.median([s.host_us - s.replay_us - s.capture_us - s.warmup_us - s.eager_fallback_us for s in t.steps] or [0]):.1f} us")
    return "\n".join(lines)


def compare_warnings(a: TraceSummary, b: TraceSummary, names: Tuple[str, str] = ("A", "B")) -> List[str]:
    """Why the two traces' steps do not compare one for one (empty when they do)."""
    out = a.warnings() + b.warnings()
    if a.step_kind != b.step_kind:
        out.append(f"the steps are different units ({names[0]}: {a.unit}; {names[1]}: {b.unit}): "
                   f"their medians do not compare, so no ratios are shown.")
    elif out:
        out.append("no ratios are shown.")
    return out


def render_compare(a: TraceSummary, b: TraceSummary, names: Tuple[str, str] = ("A", "B")) -> str:
    cols = _COLUMNS + (_GPU_COLUMNS if (a.has_gpu or b.has_gpu) else [])
    lines = [f"{names[0]}: {a.path} ({_steps(a)}, {a.unit})",
             f"{names[1]}: {b.path} ({_steps(b)}, {b.unit})"]
    warnings = compare_warnings(a, b, names)
    lines += [f"warning: {w}" for w in warnings]
    lines.append(f"{'median per step':<18}{names[0]:>14}{names[1]:>14}{names[1] + '/' + names[0]:>10}")
    for key, header, fmt in cols:
        va, vb = a.median(key), b.median(key)
        if warnings:
            ratio = "?"
        else:
            ratio = f"{vb / va:.2f}x" if va else ("-" if not vb else "new")
        lines.append(f"{header:<18}{_fmt(fmt, va):>14}{_fmt(fmt, vb):>14}{ratio:>10}")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m torchreplay.trace", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("summarize", help="per step: host time, torchreplay ranges, dispatches, launches")
    s.add_argument("trace")
    s.add_argument("--json", action="store_true", help="print the summary as JSON")
    c = sub.add_parser("compare", help="two traces side by side (e.g. eager vs reduce-overhead)")
    c.add_argument("a")
    c.add_argument("b")
    args = p.parse_args(argv)
    try:
        if args.command == "summarize":
            t = summarize(args.trace)
            if args.json:
                print(json.dumps({"path": t.path, "step_kind": t.step_kind, "step_label": t.step_label,
                                  "per_call": t.per_call, "has_gpu": t.has_gpu,
                                  "steps": [dataclasses.asdict(x) for x in t.steps]}, indent=2))
            else:
                print(render_summary(t))
        else:
            print(render_compare(summarize(args.a), summarize(args.b)))
    except (OSError, ValueError, KeyError) as e:
        print(f"torchreplay.trace: cannot read trace: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
