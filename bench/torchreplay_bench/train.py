"""Training steps, whole: against eager and the peers, with and without a compiled optimizer, and
where torchreplay's step spends its time.

    python -m torchreplay_bench.train [--models mlp,llama] [--rounds 7] [--seconds 6]

The step as a user writes it: the loss and `loss.backward()` inside the compiled function, returning
`loss.detach()` (or, in the "returns loss" modes, the loss itself). Models: `mlp`, the MLP 32-64-64-4 with tanh, batch 16, MSE; `llama`,
the harness's tiny Llama (transformers) on 2 sequences of 16 tokens, its own cross-entropy loss.
One thread. Modes, timed interleaved in rounds (µs per step, median of rounds):

  eager                    the step as it is
  torchreplay              torch.compile(step, backend=torchreplay), mode reduce-overhead, nothing
                           else set: loss.backward() traced into the graph, the step one graph
                           (Note [Traced backward] in training_guards.py)
  torchreplay, broken bw   the same with config.trace_backward = False: Dynamo breaks the graph at
                           the backward, which autograd runs (two graphs, the training call)
  inductor                 torch.compile(step)
  aot_eager                torch.compile(step, backend="aot_eager")
  inductor, traced bw      Inductor with Dynamo's trace_autograd_ops on while the step compiles
  ..., returns loss        the step returning `loss` itself (Note [Returning a tensor whose
                           backward ran]; Dynamo alone breaks such a step at the backward)

Every mode's gradients are compared with eager's after each of four steps (new gradients three
times, then accumulated into them, as in the timed steps; bitwise, or close for Inductor). The second table adds an Adam update (foreach) after each step, compiled with the
same backend as the step (`torch.compile(opt.step)`; eager: Adam as it is); parameters after three
updates are compared with aot_eager's (AOTAutograd's decomposition of Adam gives other bits than
eager's Adam).

Then the breakdown of torchreplay's step, each part timed on its own: Dynamo's floor for this
step (a backend whose graphs return the first call's outputs as fresh leaves, so the frames on
both sides of the break run and backward has one node), each engine run on the arguments it got
(no Dynamo, no autograd), the forward engine with its previous outputs still alive (what copying
them out of the pool costs), and the rest: the training call, its autograd node and the autograd
engine with its gradient accumulation. The same for the traced step (one frame, one graph).

Inductor's traced modes compile during the three checked steps, with the flag on; the timed calls
run with it off (Dynamo reads it only when it traces), and a recompile while timing is reported.

Last, per model, the optimizer update alone (`--optimizers`: Adam, AdamW, SGD with momentum and
with nesterov, RMSprop, Adagrad; foreach), the gradients of one backward fixed: eager's foreach
update, eager's `fused=True` update (torch.optim's fused CPU kernels; RMSprop has none),
`torch.compile(opt.step)` with torchreplay, Inductor and aot_eager. Parameters and state after
three updates are compared with aot_eager's, and torchreplay's update is reported with the number
of steps its replay runs and how many of them are fused elementwise steps. Every mode's timed
call first copies the gradients back (one `torch._foreach_copy_`: SGD's foreach nesterov adds into
them), so each row includes that copy.
"""
from __future__ import annotations

import argparse
import copy
import inspect
import sys
import types
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

import torchreplay
from torchreplay_bench.modes import RecordingBackend, fresh_dynamo
from torchreplay_bench.timing import time_interleaved

MODES = ["eager", "torchreplay", "torchreplay, broken bw", "inductor", "aot_eager", "inductor, traced bw",
         "torchreplay, returns loss", "inductor, traced bw, returns loss"]
TRACED = " traced bw"
RETURNS_LOSS = "returns loss"


def _tracing(mode: str) -> Any:
    """Dynamo's trace_autograd_ops as the mode compiles with it."""
    return torch._dynamo.config.patch(trace_autograd_ops=TRACED in mode)


def _mlp() -> Tuple[torch.nn.Module, tuple, Callable[..., torch.Tensor]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, 4))
    g = torch.Generator().manual_seed(1)
    return model, (torch.randn(16, 32, generator=g), torch.randn(16, 4, generator=g)), \
        lambda m, x, y: F.mse_loss(m(x), y)


def _llama() -> Tuple[torch.nn.Module, tuple, Callable[..., torch.Tensor]]:
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: WPS433

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg).train()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    return model, (ids,), lambda m, ids: m(input_ids=ids, labels=ids, use_cache=False).loss


OPTIMIZERS = {"adam": (torch.optim.Adam, dict(lr=1e-3)),
              "adamw": (torch.optim.AdamW, dict(lr=1e-3, weight_decay=0.01)),
              "sgd_momentum": (torch.optim.SGD, dict(lr=1e-2, momentum=0.9)),
              "sgd_nesterov": (torch.optim.SGD, dict(lr=1e-2, momentum=0.9, nesterov=True)),
              "rmsprop": (torch.optim.RMSprop, dict(lr=1e-3)),
              "adagrad": (torch.optim.Adagrad, dict(lr=1e-2))}
UPDATE_MODES = ["eager, foreach", "eager, fused", "torchreplay", "inductor", "aot_eager"]

MODELS = {"mlp": (_mlp, "MLP 32-64-64-4, tanh, batch 16, MSE"),
          "llama": (_llama, "tiny Llama (transformers), 2 x 16 tokens, cross-entropy")}


def _stepper(model: torch.nn.Module, loss_fn: Callable[..., torch.Tensor],
             returns_loss: bool = False) -> Callable[..., torch.Tensor]:
    def step(*inputs: Any) -> torch.Tensor:
        loss = loss_fn(model, *inputs)
        loss.backward()
        return loss if returns_loss else loss.detach()
    # Each step has a code object of its own: Dynamo caches per code object, so steps sharing one
    # would check each other's guards first, and a backend equal to another's (Inductor with and
    # without the traced backward) would reuse its graphs.
    return types.FunctionType(step.__code__.replace(), step.__globals__, step.__name__, step.__defaults__,
                              step.__closure__)


def _floor_backend(gm: torch.fx.GraphModule, example_inputs: List[Any]) -> Callable:
    """Dynamo's frames and nothing else: the first call's outputs, as fresh leaves requiring grad
    where they did, on every call."""
    first: List[Any] = []

    def run(*args: Any) -> Any:
        if not first:
            out = gm(*args)
            first.extend(out if isinstance(out, (list, tuple)) else [out])
        return [o.detach().requires_grad_(o.requires_grad) if isinstance(o, torch.Tensor) else o for o in first]
    return run


def _interleaved(fns: Dict[str, Callable[[], Any]], rounds: int, seconds: float) -> Dict[str, float]:
    """µs per call of each, median over rounds, timed interleaved with grad mode on; a graph
    compiled while timing (traced modes would trace it without their flag) is reported."""
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    timed = {k: v["median_us"] for k, v in time_interleaved(fns, rounds, seconds, grad=True).items()}
    if torch._dynamo.utils.counters["stats"]["unique_graphs"] != graphs:
        print("  (a graph was compiled while timing: a traced mode's later graphs had no traced backward)")
    return timed


def _agreement(got: List[torch.Tensor], want: List[torch.Tensor]) -> str:
    if all(torch.equal(u, v) for u, v in zip(got, want)):
        return "bitwise"
    return "close" if all(torch.allclose(u, v, rtol=1e-3, atol=1e-5) for u, v in zip(got, want)) else "WRONG"


def _worst(a: str, b: str) -> str:
    return min(a, b, key=["WRONG", "close", "bitwise"].index)


def _backend(mode: str) -> Any:
    if mode.startswith("torchreplay"):
        cfg = torchreplay.CompilerConfig()
        cfg.mode = "reduce-overhead"
        cfg.trace_backward = "broken bw" not in mode
        return torchreplay.get_backend(compiler_config=cfg)
    return {"inductor": "inductor", "aot_eager": "aot_eager"}.get(mode.split(",")[0])


def _table(title: str, timed: Dict[str, float], checks: Dict[str, str]) -> None:
    print(title)
    print(f"  {'mode':<24}{'µs':>10}{'vs eager':>10}  check")
    for mode, us in timed.items():
        print(f"  {mode:<24}{us:>10.1f}{timed['eager'] / us:>9.2f}x  {checks.get(mode, 'reference')}")



def bench_model(name: str, rounds: int, seconds: float) -> bool:
    factory, desc = MODELS[name]
    fresh_dynamo(12)
    model0, inputs, loss_fn = factory()
    backends = {m: _backend(m) for m in MODES}
    models = {m: copy.deepcopy(model0) for m in MODES}
    steps = {m: _stepper(models[m], loss_fn) if backends[m] is None
             else torch.compile(_stepper(models[m], loss_fn, RETURNS_LOSS in m), backend=backends[m]) for m in MODES}
    checks: Dict[str, str] = {}
    for i in range(4):  # new gradients three times, then accumulated (as the timed steps do)
        for m in models.values():
            if i < 3:
                m.zero_grad(set_to_none=True)
        for mode, s in steps.items():
            with _tracing(mode):
                s(*inputs)
        want = [p.grad for p in models["eager"].parameters()]
        for mode in MODES[1:]:
            got = _agreement([p.grad for p in models[mode].parameters()], want)
            checks[mode] = _worst(checks.get(mode, "bitwise"), got)
    timed = _interleaved({m: (lambda s=s: s(*inputs)) for m, s in steps.items()}, rounds, seconds)
    for mode in MODES[1:]:
        checks[mode] += " gradients"
        if mode.startswith("torchreplay"):
            checks[mode] += f"; call paths: {', '.join(backends[mode].call_paths.values())}"
    _table(f"{name}: training step ({desc}; backward inside; one thread), µs per step", timed, checks)

    # With a compiled Adam update after each step.
    opt_models = {m: copy.deepcopy(model0) for m in MODES}
    opts = {m: torch.optim.Adam(opt_models[m].parameters(), lr=1e-3, foreach=True) for m in MODES}
    opt_steps = {m: opts[m].step if backends[m] is None else torch.compile(opts[m].step, backend=_backend(m))
                 for m in MODES}
    train = {m: _stepper(opt_models[m], loss_fn) if backends[m] is None
             else torch.compile(_stepper(opt_models[m], loss_fn, RETURNS_LOSS in m), backend=_backend(m))
             for m in MODES}

    def update(m: str) -> None:
        opts[m].zero_grad(set_to_none=True)
        train[m](*inputs)
        opt_steps[m]()

    for _ in range(3):
        for m in MODES:
            with _tracing(m):
                update(m)
    want = [p.detach() for p in opt_models["aot_eager"].parameters()]
    opt_checks = {m: f"{_agreement([p.detach() for p in opt_models[m].parameters()], want)} vs aot_eager"
                  for m in MODES if m != "aot_eager"}
    opt_checks["aot_eager"] = "reference for the parameters"
    timed_opt = _interleaved({m: (lambda m=m: update(m)) for m in MODES}, rounds, seconds)
    print()
    _table(f"{name}: training step + Adam (foreach) compiled with the same backend, µs per step", timed_opt,
           {m: f"parameters after 3 updates {c}" for m, c in opt_checks.items()})
    _breakdown(model0, inputs, loss_fn, rounds, seconds, traced=False)
    _breakdown(model0, inputs, loss_fn, rounds, seconds, traced=True)
    return all("WRONG" not in c for c in list(checks.values()) + list(opt_checks.values()))


def _breakdown(model0: torch.nn.Module, inputs: tuple, loss_fn: Callable[..., torch.Tensor], rounds: int,
               seconds: float, traced: bool) -> None:
    """Each part of torchreplay's step timed on its own (interleaved). The engines' arguments come
    from a copy of the step compiled with a recording backend, which keeps AOTAutograd's wrapper
    (Python-visible engine calls): the engines' own work is the same either way. `traced`: the
    step compiled with loss.backward() traced into it (the default), else broken at it."""
    cfg = torchreplay.CompilerConfig()
    cfg.mode = "reduce-overhead"
    cfg.trace_backward = traced
    recording = RecordingBackend(cfg)
    recorded = torch.compile(_stepper(copy.deepcopy(model0), loss_fn), backend=recording)
    for _ in range(3):
        recorded(*inputs)
    recording.calls.clear()
    recorded(*inputs)
    runs = []  # (engine name, run, arguments): the step's graphs in order
    for run, args, _, _ in recording.calls:
        args = [t.detach().clone() if isinstance(t, torch.Tensor) else t for t in args]
        runs.append((getattr(getattr(run, "__self__", None), "name", "an eager graph"), run, args))
    direct = _backend("torchreplay" if traced else "torchreplay, broken bw")
    step = torch.compile(_stepper(copy.deepcopy(model0), loss_fn), backend=direct)
    floor_step = torch.compile(_stepper(copy.deepcopy(model0), loss_fn), backend=_floor_backend)
    eager = copy.deepcopy(model0)
    with _tracing(TRACED if traced else ""):  # the floor's backend is not torchreplay: Dynamo's flag
        for s in (step, floor_step):
            for _ in range(3):
                s(*inputs)
    kept: List[Any] = []
    parts: Dict[str, Callable[[], Any]] = {
        "eager forward + loss": lambda: loss_fn(eager, *inputs),
        "eager step": lambda s=_stepper(eager, loss_fn): s(*inputs),
        "torchreplay step": lambda: step(*inputs),
        "dynamo floor": lambda: floor_step(*inputs),
    }
    for name, run, args in runs:
        parts[name] = lambda r=run, a_=args: kept.clear() or r(list(a_))
    forward = next((name for name, _, _ in runs if name.endswith(".forward")), None)
    if forward is not None:
        fw_run, fw_args = next((r, a_) for n, r, a_ in runs if n == forward)
        parts[forward + ", outputs kept"] = lambda: kept.__setitem__(slice(None), fw_run(list(fw_args)))
    us = _interleaved(parts, rounds, seconds)
    kept.clear()
    engines = sum(us[name] for name, _, _ in runs)
    copies = us[forward + ", outputs kept"] - us[forward] if forward is not None else 0.0
    rows = [("eager: forward + loss", us["eager forward + loss"]),
            ("eager: backward (the step less the forward)", us["eager step"] - us["eager forward + loss"]),
            ("torchreplay step" + (", traced backward" if traced else ""), us["torchreplay step"]),
            ("  Dynamo's floor (" + ("its one frame" if traced else "the frames on both sides of the break") + ")",
             us["dynamo floor"])]
    rows += [(f"  engine {name} (replay)", us[name]) for name, _, _ in runs]
    rest = us["torchreplay step"] - us["dynamo floor"] - engines - copies
    if traced:
        rows.append(("  the rest: the direct call and its checks", rest))
    else:
        rows += [("  copying out the forward's outputs kept alive", copies),
                 ("  the rest: training call, autograd node and engine, accumulation", rest)]
    print()
    print(f"Breakdown (µs per step, each part timed on its own; call paths: "
          f"{', '.join(f'{k} {v}' for k, v in direct.call_paths.items())}):")
    for name, v in rows:
        print(f"  {name:<66}{v:>9.1f}")


def bench_optimizers(name: str, optimizers: List[str], rounds: int, seconds: float) -> bool:
    """The update alone for each optimizer, on the model's parameters with one backward's gradients.
    False where torchreplay's parameters and state are not aot_eager's bits after updates that
    replayed, or a mode's are wrong."""
    factory, _ = MODELS[name]
    model0, inputs, loss_fn = factory()
    loss_fn(model0, *inputs).backward()
    grads = [p.grad.detach().clone() for p in model0.parameters()]
    ok = True
    print(f"{name}: optimizer update alone ({sum(g.numel() for g in grads)} parameters in {len(grads)} tensors; "
          "one thread; the gradients copied back first), µs per update")
    print(f"  {'optimizer':<14}" + "".join(f"{m:>16}" for m in UPDATE_MODES) + "  check")
    for opt_name in optimizers:
        opt_cls, kwargs = OPTIMIZERS[opt_name]
        fresh_dynamo(len(UPDATE_MODES))
        has_fused = "fused" in inspect.signature(opt_cls.__init__).parameters
        modes = [m for m in UPDATE_MODES if m != "eager, fused" or has_fused]
        params = {m: [torch.nn.Parameter(p.detach().clone()) for p in model0.parameters()] for m in modes}
        for ps in params.values():
            for p, g in zip(ps, grads):
                p.grad = g.clone()
        opts = {m: opt_cls(params[m], **kwargs, **(dict(fused=True) if m == "eager, fused" else dict(foreach=True)))
                for m in modes}
        backends = {m: _backend(m) for m in modes if not m.startswith("eager")}
        compiled = {m: torch.compile(opts[m].step, backend=backends[m]) if m in backends else opts[m].step
                    for m in modes}

        def update(m: str) -> None:  # SGD's foreach nesterov adds into the gradients: restored first
            torch._foreach_copy_([p.grad for p in params[m]], grads)
            compiled[m]()

        steps = {m: (lambda m=m: update(m)) for m in modes}
        for _ in range(3):
            for s in steps.values():
                s()

        def state(m: str) -> List[torch.Tensor]:
            return [p.detach() for p in params[m]] + [v for st in opts[m].state.values()
                                                        for _, v in sorted(st.items()) if isinstance(v, torch.Tensor)]
        want = state("aot_eager")
        checks = {m: _agreement(state(m), want) for m in modes if m != "aot_eager"}
        stats = backends["torchreplay"].stats()
        replays = sum(st["replays"] for st in stats)  # checked: the bits compared are a replay's
        ok = ok and checks["torchreplay"] == "bitwise" and replays > 0 and "WRONG" not in checks.values()
        timed = _interleaved(steps, rounds, seconds)
        cells = "".join(f"{timed[m]:>16.1f}" if m in timed else f"{'(none)':>16}" for m in UPDATE_MODES)
        steps_note = ", ".join(f"{log['steps']} steps, {log['fused_steps']} fused" for st in stats
                               for log in st["capture_log"])
        print(f"  {opt_name:<14}{cells}  torchreplay {checks['torchreplay']} vs aot_eager ({steps_note}), "
              f"{replays} replays; "
              f"inductor {checks['inductor']}, eager {checks['eager, foreach']}"
              + (f", fused {checks['eager, fused']}" if "eager, fused" in checks else ""))
    return ok


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m torchreplay_bench.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated: " + ", ".join(MODELS))
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--seconds", type=float, default=6.0, help="per mode and table, over all rounds")
    p.add_argument("--optimizers", default=",".join(OPTIMIZERS),
                   help="the updates timed alone, comma-separated (or none): " + ", ".join(OPTIMIZERS))
    a = p.parse_args(argv)
    models = a.models.split(",")
    optimizers = [o for o in a.optimizers.split(",") if o and o != "none"]
    for what, names, known in (("model", models, MODELS), ("optimizer", optimizers, OPTIMIZERS)):
        if any(n not in known for n in names):
            p.error(f"unknown {what} in {','.join(names)}")
    torch.set_num_threads(1)
    ok = True
    for i, name in enumerate(models):
        if i:
            print()
        ok = bench_model(name, a.rounds, a.seconds) and ok
        if optimizers:
            print()
            ok = bench_optimizers(name, optimizers, a.rounds, a.seconds) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
