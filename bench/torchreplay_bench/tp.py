"""Tensor parallelism: the harness's tiny Llama decode step sharded over ranks with DTensor.

    python -m torchreplay_bench.tp [--world 2] [--rounds 7] [--calls 40] [--out bench_out] [--deadline 900]

Each rank is a process (gloo over 127.0.0.1, one thread; torchreplay_bench.ranks). It builds the
harness's tiny Llama decode step (models.py, same seed on every rank) and shards it with
PyTorch's parallel styles: attention's q/k/v and the MLP's gate/up column-wise, o_proj and
down_proj row-wise, so a step makes two all_reduces a layer. Then, per rank:

  eager       the DTensor model as it is
  compile     torch.compile(backend=torchreplay), mode reduce-overhead
  capture     torchreplay.capture, mode reduce-overhead
  comm-floor  reference: the step's collectives alone (recorded from an eager step: same ops,
              sizes and order), captured, each waited for before the next starts as in the step

Every mode but the floor is checked bit for bit against eager on the same rank over three calls
(the tiny Llama's grouped-query attention traced as eager runs it: Note [transformers' attention
as eager runs it] in torchreplay/patches.py). Every mode must issue eager's collectives per call (the process group's sequence number). Modes
are timed one call each in turn, rounds x calls times, every rank running the same calls in
lockstep. The loopback's latency varies tenfold from call to call on a small machine (the floor's
10th percentile and 90th lie ten times apart), which swamps a step's compute in the median; the
table shows rank 0's 10th percentile per mode (the calls whose communication was fast), what each
adds over the floor's, and the median.

Then overlap: an all_reduce of 64 floats and a chain of 64x64 matmuls that does not read it,
captured alone and together (the wait sinks below the chain: torchreplay.passes.sink_waits). The
step with both takes less than the two apart when the chain runs while the all_reduce is in
flight. The other ranks join each all_reduce 2 ms late (they sleep first), so that rank 0's
collective is in flight that long, and compute nothing: gloo progresses a collective on threads
of its own, which need a core, and with two ranks on two cores both computing none is left (the
last row shows that case).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from torchreplay_bench.ranks import sequence, spawn

MODES = ["eager", "compile", "capture", "comm-floor"]
CHAIN = 160     # matmuls in the overlap step's compute
LATE_S = 0.002  # how late the other ranks join the overlap step's all_reduce


def _shard(model: torch.nn.Module) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}
    for layer in model.model.layers:
        parallelize_module(layer, mesh, plan)


def _tp_llama():
    from torchreplay_bench.models import _llama_decode

    torch.manual_seed(0)
    return _llama_decode(shard=_shard)


_COLLECTIVES = {"all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "broadcast"}


class _Collectives(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the functional collectives a call issues: (op, input, other arguments)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: List[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "_c10d_functional" and func.__name__.split(".")[0] in _COLLECTIVES:
            self.calls.append((func, torch.zeros_like(args[0]), args[1:]))
        return func(*args, **(kwargs or {}))


def _floor(step: Callable[[], Any], cfg: Any) -> Callable[[], Any]:
    """The collectives of one call of `step` as a captured graph of their own: the same ops,
    sizes and order, each fed the one before's result where the sizes allow (so that it waits for
    it, as the step does), nothing else."""
    import torchreplay

    rec = _Collectives()
    with rec:
        step()
    calls = rec.calls
    wait = torch.ops._c10d_functional.wait_tensor.default

    def collectives(*bufs: torch.Tensor) -> torch.Tensor:
        prev = None
        for (func, _, rest), b in zip(calls, bufs):
            if prev is not None and prev.shape == b.shape and prev.dtype == b.dtype:
                b = prev
            prev = wait(func(b, *rest))
        return prev

    bufs = tuple(b for _, b, _ in calls)
    captured = torchreplay.capture(collectives, bufs, config=cfg)

    def floor() -> Any:
        return captured(*bufs)
    floor.count = len(calls)  # type: ignore[attr-defined]
    return floor


def _timed(fn: Callable[[], Any], calls: int) -> List[float]:
    """µs of each of `calls` calls, started together on every rank (the collectives keep them in
    lockstep after that)."""
    dist.barrier()
    clock, out = time.perf_counter, []
    for _ in range(calls):
        t0 = clock()
        fn()
        out.append((clock() - t0) * 1e6)
    return out


def _bitwise(got: Any, want: Any) -> bool:
    """Bit for bit: dtype, shape, the strides of dimensions longer than 1 and every element's bit
    pattern (-0.0 is not 0.0; NaNs by their bits), where torch.equal compares values."""
    if not (isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor) and got.dtype == want.dtype
            and got.shape == want.shape):
        return False
    if [got.stride(d) for d in range(got.dim()) if got.shape[d] > 1] != \
            [want.stride(d) for d in range(want.dim()) if want.shape[d] > 1]:
        return False
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[got.element_size()]
    return torch.equal(got.detach().contiguous().view(as_int), want.detach().contiguous().view(as_int))


def _checked(run: Callable[..., Any], eager: Callable[..., Any], inputs: List[tuple]) -> Dict[str, Any]:
    """Bitwise against eager on the same inputs, and the collectives each call issues against
    eager's."""
    bitwise, issued, expected = True, [], []
    for args in inputs:
        s0 = sequence()
        want = eager(*args)
        s1 = sequence()
        got = run(*args)
        issued.append(sequence() - s1)
        expected.append(s1 - s0)
        bitwise = bitwise and _bitwise(got, want)
    return {"bitwise": bitwise, "collectives_match": issued == expected, "collectives": expected[-1]}


def _rank(rank: int, world: int, rounds: int, calls: int) -> Dict[str, Any]:
    import torch.distributed._functional_collectives as fc
    import torchreplay

    cfg = torchreplay.CompilerConfig()
    cfg.mode = "reduce-overhead"
    out: Dict[str, Any] = {"modes": {}, "overlap": {}}
    with torch.no_grad():
        # Each a model of its own (a static KV cache each), built alike on every rank.
        models = {m: _tp_llama() for m in ("reference", "eager", "compile", "capture")}
        reference, make_inputs = models["reference"]
        backend = torchreplay.get_backend(compiler_config=cfg)
        runs = {"eager": models["eager"][0],
                "compile": torch.compile(models["compile"][0], backend=backend),
                "capture": torchreplay.capture(models["capture"][0], make_inputs(0), config=cfg)}
        inputs = [make_inputs(i) for i in range(3)]
        for mode, run in runs.items():
            out["modes"][mode] = _checked(run, reference, inputs)
        replays = {"compile": lambda: sum(s["replays"] for s in backend.stats()),
                   "capture": lambda: runs["capture"].stats()["replays"]}
        x = make_inputs(3)
        steps = {mode: (lambda r=run: r(*x)) for mode, run in runs.items()}
        steps["comm-floor"] = _floor(steps["eager"], cfg)
        out["modes"]["comm-floor"] = {"collectives": steps["comm-floor"].count}
        before = {m: f() for m, f in replays.items()}
        # One call of each mode in turn (every mode makes the step's collectives, which keep the
        # ranks in lockstep): drift in the loopback's latency reaches every mode alike.
        times: Dict[str, List[float]] = {m: [] for m in steps}
        dist.barrier()
        clock = time.perf_counter
        for _ in range(rounds * calls):
            for mode, step in steps.items():
                t0 = clock()
                step()
                times[mode].append((clock() - t0) * 1e6)
        for mode, ts in times.items():
            q = statistics.quantiles(ts, n=10)
            out["modes"][mode].update(us=statistics.median(ts), p10_us=q[0], p90_us=q[-1])
        for mode, f in replays.items():
            out["modes"][mode]["replays"] = f() - before[mode]

        out["overlap"] = _overlap(rank, rounds, calls, cfg)
    return out


def _overlap(rank: int, rounds: int, calls: int, cfg: Any) -> Dict[str, Any]:
    """Rank 0's step: an all_reduce, then compute that does not read it, alone and together. The
    other ranks join each all_reduce LATE_S late (they sleep first), so rank 0's collective is in
    flight at least that long, and do no compute of their own (on this machine a rank computing
    leaves no core to the other's gloo threads), except in the row where every rank computes."""
    import torch.distributed._functional_collectives as fc
    import torchreplay

    g = dist.group.WORLD
    gen = torch.Generator().manual_seed(1)
    a, w = torch.randn(64, generator=gen), torch.randn(64, 64, generator=gen) / 8

    def chain(w: torch.Tensor) -> torch.Tensor:
        y = w
        for _ in range(CHAIN):
            y = torch.tanh(y @ w)
        return y

    comm = (lambda a: fc.all_reduce(a, "sum", g) + 1, (a,))
    compute = (lambda w: chain(w) + 1, (w,))
    both = (lambda a, w: fc.all_reduce(a, "sum", g) + chain(w).sum(), (a, w))
    lead = rank == 0
    rows = {  # row -> what this rank runs: (function, arguments, late), or None
        "communication": (*comm, not lead),
        "compute": (*compute, False) if lead else None,
        "both": (*both, False) if lead else (*comm, True),
        "both, every rank computing": (*both, False),
    }
    out: Dict[str, Any] = {}
    steps: Dict[str, Callable[[], Any]] = {}
    for name, row in rows.items():
        if row is None:
            out[name], steps[name] = {"bitwise": True}, lambda: None
            continue
        fn, args, late = row
        captured = torchreplay.capture(fn, args, config=cfg)
        out[name] = _checked(captured, fn, [args] * 3)
        out[name]["replays_before"] = captured.stats()["replays"]
        steps[name] = _late(lambda c=captured, a_=args: c(*a_), late)
        out[name]["stats"] = captured.stats
    eager = both if lead else comm
    steps["both, eager"] = _late(lambda: eager[0](*eager[1]), not lead)
    times: Dict[str, List[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            times[name] += _timed(step, calls)
    for name, ts in times.items():
        row = out.setdefault(name, {})
        row["us"] = statistics.median(ts)
        if "stats" in row:
            row["replays"] = row.pop("stats")()["replays"] - row.pop("replays_before")
    return out


def _late(step: Callable[[], Any], late: bool) -> Callable[[], Any]:
    if not late:
        return step

    def late_step() -> Any:
        time.sleep(LATE_S)
        return step()
    return late_step


def _table(results: List[Dict[str, Any]], world: int) -> str:
    r = results[0]["modes"]
    floor = r["comm-floor"]["p10_us"]
    eager_over = r["eager"]["p10_us"] - floor
    lines = [f"Tensor-parallel tiny Llama decode step, {world} ranks (gloo, 127.0.0.1, one thread each), "
             f"{r['comm-floor']['collectives']} collectives a step; rank 0, µs per step over all calls: the 10th "
             "percentile (calls whose communication was fast) and the median",
             f"  {'mode':<12}{'p10':>10}{'median':>10}{'p10 over floor':>16}{'of eager':>10}  check"]
    for mode in MODES:
        m = r[mode]
        over = m["p10_us"] - floor
        if mode == "comm-floor":
            check = "reference for the communication"
        else:
            bitwise = all(x["modes"][mode]["bitwise"] for x in results)
            collectives = all(x["modes"][mode]["collectives_match"] for x in results)
            check = ("bitwise vs eager on every rank" if bitwise else "WRONG vs eager") + \
                ("" if collectives else ", WRONG collectives") + \
                (f", {m['replays']} replays" if "replays" in m else "")
        share = f"{over / eager_over:>10.3f}" if mode != "comm-floor" and eager_over > 0 else f"{'':>10}"
        lines.append(f"  {mode:<12}{m['p10_us']:>10.1f}{m['us']:>10.1f}{over:>16.1f}{share}  {check}")
    ov = results[0]["overlap"]
    apart = ov["communication"]["us"] + ov["compute"]["us"]
    ok = all(v["bitwise"] for x in results for v in x["overlap"].values() if "bitwise" in v)
    late = f"the other ranks join each all_reduce {LATE_S * 1e3:g} ms late and compute nothing"
    lines += ["", f"Overlap: rank 0's step, µs per call (torchreplay.capture; {'bitwise' if ok else 'WRONG'} vs eager on every "
              f"rank; {ov['both']['replays']} replays of both); {late}, but in the last row",
              f"  all_reduce of 64 floats alone          {ov['communication']['us']:>9.1f}",
              f"  {CHAIN} matmuls 64x64 + tanh alone         {ov['compute']['us']:>9.1f}",
              f"  the two apart (sum)                    {apart:>9.1f}",
              f"  both in one step                       {ov['both']['us']:>9.1f}   (hidden: "
              f"{apart - ov['both']['us']:.1f})",
              f"  both in one step, eager                {ov['both, eager']['us']:>9.1f}",
              f"  both, every rank computing, none late  {ov['both, every rank computing']['us']:>9.1f}"]
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m torchreplay_bench.tp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2, help="ranks (processes)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=40, help="calls per mode per round")
    p.add_argument("--out", default="bench_out", help="directory for tp.json")
    p.add_argument("--deadline", type=float, default=900, help="seconds before the ranks are killed")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        results = spawn(_rank, a.world, tmp, a.rounds, a.calls, deadline_s=a.deadline)
    print(_table(results, a.world))
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "tp.json"), "w") as f:
        json.dump({"world": a.world, "rounds": a.rounds, "calls": a.calls, "ranks": results}, f, indent=1)
    return 1 if _failures(results) else 0


def _failures(results: List[Dict[str, Any]]) -> List[str]:
    """The modes and overlap rows that differ from their reference or issue other collectives
    than eager, on some rank."""
    wrong = [f"rank {rank}: {m} vs eager" for rank, x in enumerate(results) for m, v in x["modes"].items()
             if m != "comm-floor" and not (v["bitwise"] and v["collectives_match"])]
    wrong += [f"rank {rank}: overlap {k}" for rank, x in enumerate(results) for k, v in x["overlap"].items()
              if not v.get("bitwise", True)]
    return wrong


if __name__ == "__main__":
    sys.exit(main())
