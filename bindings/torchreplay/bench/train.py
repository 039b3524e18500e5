"""A training step, whole: where its time goes, against eager and the peers.

    python -m torchreplay.bench.train [--rounds 7] [--seconds 6]

The step as a user writes it for a small model: `loss = mse_loss(model(x), y); loss.backward()`
inside the compiled function (Dynamo breaks the graph at backward), the MLP 32-64-64-4 with tanh,
batch 16, one thread. Modes, timed interleaved in rounds (µs per step, median of rounds):

  eager          the step as it is
  torchreplay    torch.compile(step, backend=torchreplay), mode reduce-overhead
  inductor       torch.compile(step)
  aot_eager      torch.compile(step, backend="aot_eager")

Every mode's gradients are compared with eager's after each of three steps (bitwise, or close
for Inductor). Then the breakdown of the torchreplay step, each part timed on its own:

  eager forward + loss, eager backward (the step less the forward)
  Dynamo's floor for this step: a backend whose graph returns the first call's loss as a fresh
    leaf, so the frames on both sides of the break run and backward has one node
  forward engine, backward engine: each engine run on the arguments it got (no Dynamo, no
    AOTAutograd, no autograd engine)
  forward engine with the previous run's outputs still alive (the saved activations and the
    loss autograd keeps): what copying them out of the pool costs
  AOTAutograd and autograd: the step less all of the above
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

import torchreplay
from torchreplay.bench.__main__ import RecordingBackend, fresh_dynamo


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
                               torch.nn.Linear(64, 4))


def _stepper(model: torch.nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(model(x), y)
        loss.backward()
        return loss.detach()
    return step


def _floor_backend(gm: torch.fx.GraphModule, example_inputs: List[Any]) -> Callable:
    """Dynamo's frames and nothing else: the first call's outputs, as fresh leaves requiring grad
    where they did, on every call."""
    first: List[Any] = []

    def run(*args: Any) -> Any:
        if not first:
            first.extend(gm(*args))
        return [o.detach().requires_grad_(o.requires_grad) if isinstance(o, torch.Tensor) else o for o in first]
    return run


def _interleaved(fns: Dict[str, Callable[[], Any]], rounds: int, seconds: float) -> Dict[str, float]:
    """µs per call of each, median over rounds; every round times each once (a block of calls of
    about seconds / rounds), so the machine's drift reaches all alike. Grad mode on."""
    times: Dict[str, List[float]] = {k: [] for k in fns}
    per = seconds / rounds
    for _ in range(rounds):
        for name, fn in fns.items():
            n, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < per:
                fn()
                n += 1
            times[name].append((time.perf_counter() - t0) / n * 1e6)
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m torchreplay.bench.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--seconds", type=float, default=6.0, help="per mode, over all rounds")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    fresh_dynamo(5)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 32, generator=g), torch.randn(16, 4, generator=g)
    cfg = torchreplay.CompilerConfig()
    cfg.mode = "reduce-overhead"
    backends = {"eager": None, "torchreplay": torchreplay.get_backend(compiler_config=cfg), "inductor": "inductor",
                "aot_eager": "aot_eager"}
    models = {m: _mlp() for m in backends}
    steps = {m: _stepper(models[m]) if b is None else torch.compile(_stepper(models[m]), backend=b)
             for m, b in backends.items()}
    checks: Dict[str, str] = {}
    for i in range(3):
        for m in models.values():
            m.zero_grad(set_to_none=True)
        for s in steps.values():
            s(x, y)
        for mode, m in models.items():
            if mode == "eager":
                continue
            pairs = [(p.grad, q.grad) for p, q in zip(m.parameters(), models["eager"].parameters())]
            exact = all(torch.equal(u, v) for u, v in pairs)
            close = all(torch.allclose(u, v, rtol=1e-4, atol=1e-5) for u, v in pairs)
            checks[mode] = min(checks.get(mode, "bitwise"), "bitwise" if exact else "close" if close else "WRONG",
                               key=["WRONG", "close", "bitwise"].index)
    timed = _interleaved({m: (lambda s=s: s(x, y)) for m, s in steps.items()}, a.rounds, a.seconds)
    eager_us = timed["eager"]
    print(f"Training step (MLP 32-64-64-4, tanh, batch 16, MSE, backward inside; one thread), µs per step")
    print(f"  {'mode':<14}{'µs':>9}{'vs eager':>10}  gradients")
    for mode, us in timed.items():
        print(f"  {mode:<14}{us:>9.1f}{eager_us / us:>9.2f}x  {checks.get(mode, 'reference')}")

    # The breakdown of the torchreplay step: the same step compiled again, each engine's run
    # recorded (the recording costs Python per call: this copy is not timed whole).
    recording = RecordingBackend(cfg)
    recorded = torch.compile(_stepper(_mlp()), backend=recording)
    for _ in range(3):
        recorded(x, y)
    recording.calls.clear()
    recorded(x, y)
    runs = []  # (engine name, run, arguments): the step's graphs in order
    for run, args, _, _ in recording.calls:
        args = [t.detach().clone() if isinstance(t, torch.Tensor) else t for t in args]
        runs.append((getattr(getattr(run, "__self__", None), "name", "eager graph"), run, args))
    model = models["eager"]
    floor_step = torch.compile(_stepper(_mlp()), backend=_floor_backend)
    kept: List[Any] = []
    parts: Dict[str, Callable[[], Any]] = {
        "eager forward + loss": lambda: F.mse_loss(model(x), y),
        "eager step": lambda: steps["eager"](x, y),
        "torchreplay step": lambda: steps["torchreplay"](x, y),
        "dynamo floor": lambda: floor_step(x, y),
    }
    for name, run, args in runs:
        parts[name] = lambda r=run, a_=args: kept.clear() or r(list(a_))
    forward = next((name for name, _, _ in runs if name.endswith(".forward")), None)
    if forward is not None:
        run, args = next((r, a_) for n, r, a_ in runs if n == forward)
        parts[forward + ", outputs kept"] = lambda: kept.__setitem__(slice(None), run(list(args)))
    us = _interleaved(parts, a.rounds, a.seconds)
    kept.clear()
    engines = sum(us[name] for name, _, _ in runs)
    copies = us[forward + ", outputs kept"] - us[forward] if forward is not None else 0.0
    print()
    print("Breakdown (µs per step, each part timed on its own, interleaved):")
    rows = [("eager: forward + loss", us["eager forward + loss"]),
            ("eager: backward (the step less the forward)", us["eager step"] - us["eager forward + loss"]),
            ("torchreplay step", us["torchreplay step"]),
            ("  Dynamo's floor (the frames on both sides of the break)", us["dynamo floor"])]
    rows += [(f"  engine {name} (replay)", us[name]) for name, _, _ in runs]
    rows += [("  copying out the forward's outputs kept alive", copies),
             ("  AOTAutograd's wrappers and the autograd engine (the rest)",
              us["torchreplay step"] - us["dynamo floor"] - engines - copies)]
    for name, v in rows:
        print(f"  {name:<62}{v:>9.1f}")
    return 0 if all(c != "WRONG" for c in checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
