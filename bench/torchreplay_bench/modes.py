"""The harness's modes: what each one builds from a model (a torch.compile backend, a capture,
an exported program, a reference floor), and `prepare`, which builds a model in a mode and checks
it against eager before it is timed. `register_mode` adds one of your own.
"""
from __future__ import annotations

import copy
import os
import time
from typing import Any, Callable, Dict, List, Optional

import torch

import torchreplay
from torchreplay.backend import _lifted
from torchreplay_bench.models import MODELS, out_by_hand

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
