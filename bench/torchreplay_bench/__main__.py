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

Over 700 lines in one module: the harness's one command, whose modes (a builder each), checks,
interleaved timing, reference rows and summary share each model's state; the other benchmarks are
modules of their own (train, fusion, runtimes, deploy, tp, buckets). The reference modes
(Exported, ConvBound, the floors) are the part to move into a module of their own.
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
from torchreplay.backend import _lifted
from torchreplay_bench.models import HARNESS_MODELS, MODELS, out_by_hand

MODES = {
    "eager": "eager PyTorch",
    "torchreplay-default": "torchreplay, mode default (C++ interpreter)",
    "torchreplay-reduce-overhead": "torchreplay, mode reduce-overhead (capture + replay)",
    "torchreplay-capture": "torchreplay.capture (reduce-overhead): torch.export once, then each call "
                           "straight into C++, no Dynamo",
    "out-by-hand": "the model hand-written as out= ATen calls into preallocated buffers, from Python "
                   "(mlp, demo only): a dispatcher-path baseline, the same kernels through ATen's out= API",
    "engine": "torchreplay's engines (reduce-overhead) called directly from Python on recorded inputs "
              "(checked against each graph run eagerly)",
    "floor+engine": "dynamo-floor's compiled model then the engines, back to back (no torchreplay code "
                    "between them): what the two cost together",
    "dynamo-floor": "torch.compile with a backend returning the outputs of its first call: what Dynamo "
                    "alone costs per call, the floor under any backend (outputs stale, not checked)",
    "dynamo-eager": "torch.compile(backend='eager'): Dynamo, then the FX graph run by Python",
    "aot_eager": "torch.compile(backend='aot_eager')",
    "inductor": "torch.compile() (Inductor)",
    "inductor-cpp-wrapper": "torch.compile(options={'cpp_wrapper': True}): Inductor's wrapper as one C++ function",
    "aotinductor": "AOTInductor: torch.export, aoti_compile_and_package, then aoti_load_package(...).loader.run "
                   "on the tensors (no Python wrapper, no Dynamo; only --aoti-models, its C++ compile is slow)",
    "nativert": "NativeRT: torch.export, package_pt2, then torch._C._nativert.PyModelRunner on the tensors",
    "conv-bound": "the convolution steps of torchreplay.capture's tape alone, timed step by step "
                  "(Captured.profile; models with convolutions): the floor under any replay bitwise equal to "
                  "eager, which must run eager's convolutions (Inductor's give other bits)",
    "torchreplay-own-cuda-graphs": "torchreplay reduce-overhead with its own CUDA graphs "
                                   "(cuda_graphs='torchreplay', untested before this run) instead of "
                                   "PyTorch's cudagraph trees (the default)",
    "torchreplay-capture-own-cuda-graphs": "torchreplay.capture with its own CUDA graphs (cuda_graphs='torchreplay'; "
                                           "by default capture runs CUDA op by op)",
    "cuda-graph-by-hand": "torch.cuda.CUDAGraph captured once, replayed from Python with the input copy",
    "cudagraphs": "torch.compile(backend='cudagraphs')",
    "inductor-reduce-overhead": "torch.compile(mode='reduce-overhead')",
}
CUDA_ONLY = {"cuda-graph-by-hand", "cudagraphs", "inductor-reduce-overhead", "torchreplay-own-cuda-graphs",
             "torchreplay-capture-own-cuda-graphs"}
NOT_CHECKED = {"dynamo-floor": "floor (not checked)"}  # mode -> what its check column says
# Rows that are references, not what a user would pick: drawn apart in the plot.
REFERENCES = {"conv-bound", "dynamo-floor", "engine", "floor+engine", "out-by-hand", "cuda-graph-by-hand", "dynamo-eager",
              "aot_eager", "torchreplay-default"}
AOTI_MODELS = ["chain64", "attention_decode", "llama_decode"]  # --aoti-models by default
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


def floor_backend(gm: torch.fx.GraphModule, example_inputs: List[Any]) -> Callable:
    """A torch.compile backend whose compiled function runs the graph on its first call and then
    returns those same outputs on every call: Dynamo's own per-call cost and nothing else."""
    outputs: List[Any] = []

    def run(*args: Any) -> Any:
        if not outputs:
            outputs.append(gm(*args))
        return outputs[0]

    return run


def _tensors(out: Any) -> List[torch.Tensor]:
    return [o for o in (out if isinstance(out, (list, tuple)) else [out]) if isinstance(o, torch.Tensor)]


class RecordingBackend(torchreplay.Backend):
    """The torchreplay backend, recording for the latest call each graph it ran: the engine's run
    (or the graph's eager fallback), the argument list it got, the FX graph and its outputs.
    Training graphs keep AOTAutograd's wrapper, which calls each engine from Python."""

    direct_training = False

    def __init__(self, config: torchreplay.CompilerConfig) -> None:
        super().__init__(config)
        self.calls: List[tuple] = []
        self._built: Optional[tuple] = None

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Callable:
        compiled = super().__call__(gm, example_inputs, **kwargs)
        built, self._built = self._built, None
        lifted = _lifted(gm)  # bound in the direct Call, ahead of Dynamo's arguments

        def call(*args: Any) -> Any:
            n = len(self.calls)
            out = compiled(*args)
            if len(self.calls) == n and built:  # the engine was called without AOTAutograd's wrapper
                self.calls.append((built[0], lifted + list(args), built[1], _tensors(out)))
            return out

        return call

    def _compile(self, gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Callable:
        compiled = super()._compile(gm, example_inputs, **kwargs)
        engine = getattr(compiled, "engine", None)
        run = engine.run if engine is not None else compiled
        self._built = (run, gm)

        def call(args: List[Any]) -> Any:
            saved = list(args)  # a copy: the boxed call clears its list
            out = compiled(args)
            self.calls.append((run, saved, gm, _tensors(out)))
            return out

        call._boxed_call = True  # type: ignore[attr-defined]
        return call


class EngineDirect:
    """Mode "engine": the model compiled with torchreplay (reduce-overhead) for the warm-up and
    check calls; step() then runs the engines the latest call went through, in order, each on
    the argument list it got: the C++ path without Dynamo and AOTAutograd."""

    def __init__(self, model: torch.nn.Module) -> None:
        config = torchreplay.CompilerConfig()
        config.mode = "reduce-overhead"
        self.backend = RecordingBackend(config)
        self.compiled = torch.compile(model, backend=self.backend)

    def __call__(self, *inputs: Any) -> Any:
        self.backend.calls.clear()
        out = self.compiled(*inputs)
        # An engine's outputs live in its pool until its next run: a later graph's argument that
        # shares their memory is copied, so that step() can run the engines again and again.
        pooled = set()
        for _, args, _, outs in self.backend.calls:
            args[:] = [x.clone() if isinstance(x, torch.Tensor) and x.untyped_storage().data_ptr() in pooled else x
                       for x in args]
            pooled.update(o.untyped_storage().data_ptr() for o in outs)
            outs.clear()
        return out

    def step(self) -> None:
        for run, args, _, _ in self.backend.calls:
            run(list(args))

    def check(self) -> tuple:
        """(close, bitwise) of each engine's outputs against its FX graph run eagerly on copies of
        the same arguments."""
        ok, bitwise = True, True
        for run, args, gm, _ in self.backend.calls:
            want = gm(*[x.clone() if isinstance(x, torch.Tensor) else x for x in args])
            close, exact = same(list(run(list(args))), list(want))
            ok, bitwise = ok and close, bitwise and exact
        return ok, bitwise


class FloorThenEngine(EngineDirect):
    """Mode "floor+engine": dynamo-floor's compiled model, then the engines as in mode "engine",
    back to back with nothing of torchreplay between them: what Dynamo's frame and the C++ path
    cost together (more than their sum: each evicts the other's caches)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.floor = torch.compile(copy.deepcopy(model), backend=floor_backend)
        super().__init__(model)

    def __call__(self, *inputs: Any) -> Any:
        self.inputs = inputs
        self.floor(*inputs)
        return super().__call__(*inputs)

    def step(self) -> None:
        self.floor(*self.inputs)
        super().step()


class Exported:
    """A model exported once and run by an ahead-of-time runtime on its tensor arguments (Python
    numbers are specialized by the export, as torchreplay.capture does): AOTInductor's loader or
    NativeRT's runner. Outputs put back in the model's structure."""

    def __init__(self, runtime: str, model: torch.nn.Module, example_inputs: List[Any]) -> None:
        from torch.utils import _pytree as pytree
        import tempfile

        self._tensors = [i for i, x in enumerate(example_inputs) if isinstance(x, torch.Tensor)]
        ep = torch.export.export(model, tuple(example_inputs))
        self._out_spec, self._unflatten = ep.call_spec.out_spec, pytree.tree_unflatten
        path = os.path.join(tempfile.mkdtemp(prefix="torchreplay-bench-"), f"{runtime}.pt2")
        if runtime == "aotinductor":
            runner = torch._inductor.aoti_load_package(
                torch._inductor.aoti_compile_and_package(ep, package_path=path), run_single_threaded=True)
            self._run = runner.loader.run   # runner(...) re-parses the in/out specs per call
        else:
            from torch._C._nativert import PyModelRunner
            from torch.export.pt2_archive._package import package_pt2
            package_pt2(path, exported_programs={"forward": ep.run_decompositions({})})
            runner = PyModelRunner(path, "forward")
            self._run = lambda tensors: runner.run_with_flat_inputs_and_outputs(*tensors)

    def __call__(self, *args: Any) -> Any:
        outs = self._run([args[i] for i in self._tensors])
        outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
        return self._unflatten(outs, self._out_spec)


class ConvBound:
    """Mode "conv-bound": the model captured with torchreplay.capture (called for the checks), timed
    as the sum of its tape's convolution steps alone (Captured.profile over a block of replays)."""

    # Eager's convolution ops, and the checked kernels the tape may run in their place
    # (Note [Checked convolutions]).
    OPS = ("aten::convolution", "aten::_convolution", "aten::mkldnn_convolution", "torchreplay::convolution")

    def __init__(self, model: torch.nn.Module, example_inputs: List[Any]) -> None:
        self.captured = compile_for("torchreplay-capture", model, example_inputs)
        self.steps = sum(1 for s in self.captured.profile(*example_inputs, iterations=1) if self._conv(s))

    def _conv(self, step: Dict[str, Any]) -> bool:
        return step["op"].split("(")[0].split(".")[0] in self.OPS

    def __call__(self, *inputs: Any) -> Any:
        return self.captured(*inputs)

    def time_us(self, inputs: List[Any], seconds: float) -> float:
        """The convolution steps' mean microseconds per replay, over replays lasting about `seconds`."""
        t0 = time.perf_counter()
        self.captured.profile(*inputs, iterations=1)
        once = time.perf_counter() - t0
        steps = self.captured.profile(*inputs, iterations=max(1, int(seconds / max(once, 1e-9))))
        return sum(s["us"] for s in steps if self._conv(s))


def fresh_dynamo(num_modes: int) -> None:
    """Before a model's modes are compiled: an empty Dynamo cache, and room for every mode. Each
    torch.compile mode of a model compiles the same code objects (its forward, and code models
    share: transformers' forward decorators, torchvision's blocks), which hold one cache entry per
    backend; past the recompile limit a frame runs eagerly."""
    torch._dynamo.reset()
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * num_modes)


def compile_for(mode: str, model: torch.nn.Module, example_inputs: List[Any]) -> Optional[Callable]:
    """The callable to time for this mode, or None where the mode has no version of the model."""
    if mode in ("aotinductor", "nativert"):
        return Exported(mode, model, example_inputs)
    if mode == "conv-bound":
        if not any(isinstance(m, torch.nn.modules.conv._ConvNd) for m in model.modules()):
            return None
        bound = ConvBound(model, example_inputs)
        return bound if bound.steps else None
    if mode == "inductor-cpp-wrapper":
        return torch.compile(model, options={"cpp_wrapper": True})
    if mode in ("torchreplay-capture", "torchreplay-capture-own-cuda-graphs", "torchreplay-capture-close"):
        config = torchreplay.CompilerConfig()
        config.mode = "reduce-overhead"
        if mode.endswith("own-cuda-graphs"):
            config.reduce_overhead.cuda_graphs = "torchreplay"
        if mode.endswith("-close"):
            config.reduce_overhead.numerics = "close"
        return torchreplay.capture(model, example_inputs, config=config)
    if mode == "torchreplay-own-cuda-graphs":
        config = torchreplay.CompilerConfig.from_options({"mode": "reduce-overhead", "cuda_graphs": "torchreplay"})
        return torch.compile(model, backend=torchreplay.get_backend(compiler_config=config))
    if mode == "out-by-hand":
        return out_by_hand(model)
    if mode == "cuda-graph-by-hand":
        return GraphByHand(model)
    if mode == "engine":
        return EngineDirect(model)
    if mode == "floor+engine":
        return FloorThenEngine(model)
    if mode == "dynamo-floor":
        return torch.compile(model, backend=floor_backend)
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
    if not isinstance(a, torch.Tensor):
        return a == b, a == b
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


def prepare(model_name: str, mode: str, device: str) -> Optional[tuple]:
    """Compiles `model_name` in `mode` and checks it against eager on three calls: (row, step),
    where step() runs one timed call; (row, None) when the check failed; None where the mode has
    no version of the model."""
    factory, _desc = MODELS[model_name]
    torch.manual_seed(0)
    model, make_inputs = factory()
    model = model.to(device)
    reference = copy.deepcopy(model)
    t0 = time.perf_counter()
    with torch.no_grad():
        fn = compile_for(mode, copy.deepcopy(model), [to_device(x, device) for x in make_inputs(0)])
    if fn is None:
        return None
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    row: Dict[str, Any] = {"model": model_name, "mode": mode}
    with torch.no_grad():
        # Warm-up: compile, warm-up runs, capture. Checked against eager on the same inputs.
        ok, bitwise = True, True
        for i in range(3):
            inputs = [to_device(x, device) for x in make_inputs(i)]
            want = reference(*copy.deepcopy(inputs))
            got = fn(*inputs)
            if mode not in NOT_CHECKED:
                close, exact = same(got, want)
                ok, bitwise = ok and close, bitwise and exact
        sync()
        row["compile_s"] = time.perf_counter() - t0
        if isinstance(fn, EngineDirect):
            row["graphs"] = len(fn.backend.calls)
            if ok:
                ok, bitwise = fn.check()
                if not ok:
                    row["error"] = "an engine's outputs differ from its FX graph run eagerly"
    if mode in NOT_CHECKED:
        row["correct"], row["bitwise"], row["check"] = None, None, NOT_CHECKED[mode]
    else:
        row["correct"], row["bitwise"] = ok, bitwise
        row["check"] = "bitwise" if bitwise else "close" if ok else "WRONG"
    if row.get("graphs", 1) > 1:
        row["check"] += f", {row['graphs']} graphs"
    if not ok:
        return row, None
    inputs = [to_device(x, device) for x in make_inputs(3)]
    call = fn.step if isinstance(fn, EngineDirect) else lambda: fn(*inputs)

    def step() -> None:
        call()
        sync()

    if isinstance(fn, ConvBound):
        step.time_us = lambda seconds: fn.time_us(inputs, seconds)  # type: ignore[attr-defined]
    return row, step


def time_interleaved(steps: Dict[str, Callable[[], None]], rounds: int, min_run_time: float,
                     grad: bool = False) -> Dict[str, Dict[str, Any]]:
    """Each round times every mode once (a block of calls of about min_run_time / rounds each),
    so that the machine's drift reaches every mode alike; per mode the median over rounds and
    the spread between its quartiles (us). Grad mode off, unless `grad` (training steps). Every
    mode runs on the threads torch has when this is called (torch.utils.benchmark.Timer would
    otherwise set torch to one thread while it times)."""
    threads = torch.get_num_threads()
    times: Dict[str, List[float]] = {mode: [] for mode in steps}
    runs: Dict[str, int] = {mode: 0 for mode in steps}
    with torch.enable_grad() if grad else torch.no_grad():
        for _ in range(rounds):
            for mode, step in steps.items():
                if hasattr(step, "time_us"):  # a reference timed its own way (ConvBound)
                    times[mode].append(step.time_us(min_run_time / rounds))
                    runs[mode] += 1
                    continue
                m = tbench.Timer(stmt="step()", globals={"step": step}, num_threads=threads).blocked_autorange(
                    min_run_time=min_run_time / rounds)
                times[mode].append(m.median * 1e6)
                runs[mode] += len(m.times)
    out = {}
    for mode, ts in times.items():
        ts.sort()
        q = lambda f: ts[min(len(ts) - 1, int(f * len(ts)))]  # noqa: E731
        out[mode] = {"median_us": ts[len(ts) // 2], "iqr_us": q(0.75) - q(0.25), "runs": runs[mode], "rounds": rounds}
    return out


def plot(rows: List[Dict[str, Any]], path: str) -> None:
    """Time per call on a log axis: on the left what a user picks between (eager, torchreplay
    through torch.compile and capture, Inductor, AOTInductor, ...), on the right the reference
    rows (Dynamo's floor, the bare engine, ...), hatched: they are no product to pick."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows}, key=list(MODELS).index)
    timed = [m for m in MODES if any(r["mode"] == m and "median_us" in r for r in rows)]
    panels = [("what to pick between", [m for m in timed if m not in REFERENCES]),
              ("references (not products)", [m for m in timed if m in REFERENCES])]
    panels = [(title, modes) for title, modes in panels if modes]
    fig, axes = plt.subplots(1, len(panels), figsize=(2 + 2.2 * len(models) * len(panels), 4.5), squeeze=False)
    for ax, (title, modes) in zip(axes[0], panels):
        width = 0.8 / max(1, len(modes))
        for j, mode in enumerate(modes):
            ys = [next((r["median_us"] for r in rows if r["model"] == m and r["mode"] == mode and "median_us" in r),
                       float("nan")) for m in models]
            ax.bar([i + j * width for i in range(len(models))], ys, width, label=mode,
                   hatch="//" if mode in REFERENCES else None)
        ax.set_yscale("log")
        ax.set_xticks([i + width * (len(modes) - 1) / 2 for i in range(len(models))], models, fontsize=7)
        ax.set_ylabel("us per call (log scale, lower is better)")
        ax.set_title(title)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


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


def render_table(rows: List[Dict[str, Any]], models: List[str], modes: List[str], device: str) -> str:
    host = device == "cuda"
    where = torch.cuda.get_device_name() if host else f"{torch.get_num_threads()} threads"
    lines = [f"torchreplay benchmark: device {device} ({where}), torch {torch.__version__}",
             f"{'model':<18}{'mode':<38}{'us/call':>10}{'iqr':>8}{'vs eager':>10}{'compile s':>11}"
             + (f"{'host us':>10}" if host else "") + "  check"]
    for m in models:
        for mode in modes:
            r = next((x for x in rows if x["model"] == m and x["mode"] == mode), None)
            if r is None:
                continue
            if "median_us" not in r:
                why = r.get("error", "output differs from eager")
                lines.append(f"{m:<18}{mode:<38}{'WRONG':>10}{'':>8}{'':>10}{r.get('compile_s', 0):>11.2f}  {why}")
                continue
            check = r.get("check") or ("bitwise" if r["bitwise"] else "close")
            lines.append(f"{m:<18}{mode:<38}{r['median_us']:>10.1f}{r['iqr_us']:>8.1f}"
                         f"{r.get('speedup', 0):>9.2f}x{r['compile_s']:>11.2f}"
                         + (f"{r.get('host_us', 0):>10.1f}" if host else "") + f"  {check}")
    return "\n".join(lines)


def summarize(rows: List[Dict[str, Any]], models: List[str]) -> List[Dict[str, Any]]:
    """Per model: eager, dynamo-floor, engine and torchreplay reduce-overhead through torch.compile
    (us per call), what the torch.compile path adds (ours - floor - engine) and ours vs eager."""
    def us(model: str, mode: str) -> Optional[float]:
        r = next((x for x in rows if x["model"] == model and x["mode"] == mode), None)
        return r.get("median_us") if r else None

    out = []
    for m in models:
        eager, floor, engine, both, ours, captured, by_hand = (
            us(m, mode) for mode in ("eager", "dynamo-floor", "engine", "floor+engine",
                                     "torchreplay-reduce-overhead", "torchreplay-capture", "out-by-hand"))
        if ours is None:
            continue
        out.append({"model": m, "eager_us": eager, "dynamo_floor_us": floor, "engine_us": engine, "ours_us": ours,
                    "added_us": ours - floor - engine if floor is not None and engine is not None else None,
                    "floor_then_engine_us": both, "added_over_back_to_back_us": ours - both if both else None,
                    "ours_vs_eager": eager / ours if eager is not None else None,
                    "capture_us": captured, "out_by_hand_us": by_hand,
                    "capture_vs_eager": eager / captured if eager is not None and captured else None})
    return out


def render_summary(summary: List[Dict[str, Any]]) -> str:
    def cell(v: Optional[float], fmt: str = "{:.1f}") -> str:
        return "-" if v is None else fmt.format(v)

    lines = ["where torchreplay reduce-overhead's time goes, us per call (ours: through torch.compile; "
             "added = ours - floor - engine; back to back: floor then engine, nothing of ours between; "
             "capture: torchreplay.capture, no Dynamo)",
             f"{'model':<18}{'eager':>9}{'dynamo-floor':>14}{'engine':>9}{'ours':>9}{'added':>9}{'ours vs eager':>15}"
             f"{'back to back':>14}{'ours - it':>11}{'capture':>9}{'capture vs eager':>18}{'out= by hand':>14}"]
    for s in summary:
        lines.append(f"{s['model']:<18}{cell(s['eager_us']):>9}{cell(s['dynamo_floor_us']):>14}{cell(s['engine_us']):>9}"
                     f"{cell(s['ours_us']):>9}{cell(s['added_us']):>9}{cell(s['ours_vs_eager'], '{:.2f}x'):>15}"
                     f"{cell(s.get('floor_then_engine_us')):>14}{cell(s.get('added_over_back_to_back_us')):>11}"
                     f"{cell(s.get('capture_us')):>9}{cell(s.get('capture_vs_eager'), '{:.2f}x'):>18}"
                     f"{cell(s.get('out_by_hand_us')):>14}")
    return "\n".join(lines)


def render_host_ratios(rows: List[Dict[str, Any]], models: List[str]) -> str:
    """Host time per call of torchreplay against the graph-replay peers (CUDA)."""
    def host(model: str, mode: str) -> Optional[float]:
        r = next((x for x in rows if x["model"] == model and x["mode"] == mode), None)
        return r.get("host_us") if r and r.get("correct") else None

    lines = ["host time per call, torchreplay reduce-overhead (PyTorch's cudagraph trees around the engine) "
             "against (lower is better for torchreplay); own graphs: torchreplay's own CUDA graphs / it",
             f"{'model':<18}{'x by-hand replay':>18}{'cudagraphs / it':>17}{'inductor-ro / it':>18}"
             f"{'own graphs / it':>17}"]
    for m in models:
        ours = host(m, "torchreplay-reduce-overhead")
        if not ours:
            continue
        cells = []
        for mode, ratio in (("cuda-graph-by-hand", lambda o: ours / o), ("cudagraphs", lambda o: o / ours),
                            ("inductor-reduce-overhead", lambda o: o / ours),
                            ("torchreplay-own-cuda-graphs", lambda o: o / ours)):
            other = host(m, mode)
            cells.append(f"{ratio(other):.2f}x" if other else "-")
        lines.append(f"{m:<18}{cells[0]:>18}{cells[1]:>17}{cells[2]:>18}{cells[3]:>17}")
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
