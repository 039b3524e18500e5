"""Collectives inside captured graphs, on real process groups: gloo over 127.0.0.1, 2 and 3 ranks
as processes (spawned, bounded in time, always torn down). Every case compares each rank's replay
with the same rank's eager run bit for bit, checks that replays happened, and counts the
collectives each call issues (the process group's sequence number) against eager's count: ranks
must never disagree on how many collectives a call makes, whatever stage each is at."""
import json
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from differential import bitwise_diff
from torchreplay_bench import ranks
from torchreplay_bench.ranks import spawn
from torchreplay_bench.ranks import sequence as _seq


def _cases(world):
    import torch.distributed._functional_collectives as fc
    g = dist.group.WORLD
    cases = {f"all_reduce {op}": (lambda op: lambda x: fc.all_reduce(x * 2, op, g).relu() + 1)(op)
             for op in ("sum", "product", "min", "max")}
    cases.update({
        "all_gather dim 0": lambda x: fc.all_gather_tensor(x + 1, 0, g) * 3,
        "all_gather dim 1": lambda x: fc.all_gather_tensor(x.t().contiguous(), 1, g).sin(),
        "reduce_scatter dim 0": lambda x: fc.reduce_scatter_tensor(x.repeat(world, 1).cos(), "sum", 0, g),
        "reduce_scatter dim 1": lambda x: fc.reduce_scatter_tensor(x.repeat(1, world), "sum", 1, g) - 1,
        "all_to_all_single": lambda x: fc.all_to_all_single(x.repeat(world, 1) * 1.5, None, None, g) + 1,
        "broadcast": lambda x: fc.broadcast(x * 4, 0, g).exp(),
        "two collectives, compute between": lambda x: fc.all_reduce(x, "sum", g) @ fc.all_reduce(x.t(), "max", g),
        "all_reduce of values made from sizes": lambda x: x + fc.all_reduce(
            torch.arange(x.numel(), dtype=x.dtype).view_as(x), "sum", g),
        "dist.all_reduce": _plain_all_reduce,
        "dist.all_reduce into the input": _all_reduce_into_input,
    })
    return cases


def _plain_all_reduce(x):
    y = x * 2
    dist.all_reduce(y)
    return y + 1


def _all_reduce_into_input(x):
    dist.all_reduce(x)
    return x * 2


# Dynamo makes no graph of these in torch 2.11 (it runs them eagerly): torch.compile has nothing
# of ours to check there.
NO_DYNAMO_GRAPH = {"all_gather dim 1", "reduce_scatter dim 1"}


def _compare_cases(rank, world, stages, names, modes):
    """The cases `names` (all if empty) through both entry points and `modes`; per call: bitwise
    vs eager, the collectives issued vs eager's. `stages` picks this rank's warm-up and capture
    limit."""
    import torchreplay

    warmup, limit = stages[rank % len(stages)]
    out = {}
    for name, fn in _cases(world).items():
        if names and name not in names:
            continue
        for entry in ("compile", "capture"):
            if entry == "compile" and name in NO_DYNAMO_GRAPH:
                continue
            for mode in modes:
                cfg = torchreplay.CompilerConfig()
                cfg.mode = mode
                cfg.reduce_overhead.warmup_iters = warmup
                cfg.reduce_overhead.capture_limit = limit
                torch._dynamo.reset()
                make = lambda k, n=4: torch.randn(n, n, generator=torch.Generator().manual_seed(100 * rank + k))  # noqa: E731
                # two shapes, alternating: two keys per rank
                calls = [make(k, 4 if k % 2 == 0 else 6) for k in range(6)]
                if entry == "capture":
                    f = torchreplay.capture(fn, (calls[0].clone(),), config=cfg, dynamic=True)
                    stats = lambda: [f.stats()]  # noqa: E731
                else:
                    backend = torchreplay.get_backend(compiler_config=cfg)
                    f = torch.compile(fn, backend=backend, dynamic=False)
                    stats = backend.stats
                difference, issued, expected = None, [], []
                for k, x in enumerate(calls):
                    s0 = _seq()
                    want = fn(x.clone())
                    s1 = _seq()
                    got = f(x.clone())
                    s2 = _seq()
                    difference = difference or bitwise_diff(got, want, f"call {k}")
                    expected.append(s1 - s0)
                    issued.append(s2 - s1)
                out[f"{name} | {entry} | {mode}"] = {
                    "bitwise": difference is None, "difference": difference, "issued": issued, "expected": expected,
                    "replays": sum(s["replays"] for s in stats()),
                    # per capture: the collectives that ran as steps of their own (Note [Collective steps])
                    "collective_steps": [c["collective_steps"] for s in stats() for c in s["capture_log"]]}
    return out


def _check(results, stages):
    for rank, per_rank in enumerate(results):
        warmup, limit = stages[rank % len(stages)]
        for case, r in per_rank.items():
            assert r["bitwise"], (rank, case, r)
            assert r["issued"] == r["expected"] and min(r["expected"]) >= 1, (rank, case, r)
            if "reduce-overhead" in case and limit > 0:
                # two keys of 3 calls each: warmed up, captured (the capture call replays), replayed
                assert r["replays"] == min(2, limit) * (3 - max(warmup, 1)), (rank, case, r)
                want = 2 if case.startswith("two collectives") else 1
                assert r["collective_steps"] == [want] * min(2, limit), (rank, case, r)
            else:
                assert r["replays"] == 0, (rank, case, r)   # mode default, or over the capture limit: eager


def test_every_collective_replays_bitwise_on_two_ranks(tmp_path):
    stages = [(1, 64)]
    results = spawn(_compare_cases, 2, tmp_path, stages, [], ["reduce-overhead", "default"])
    _check(results, stages)
    assert len(results[0]) == 2 * 2 * len(_cases(2)) - 2 * len(NO_DYNAMO_GRAPH)


def test_ranks_at_different_stages_issue_the_same_collectives_on_three_ranks(tmp_path):
    """Rank 0 captures on a key's first call, rank 1 after two warm-ups, rank 2 never (capture
    limit 0: every call falls back to eager): each call still issues every collective of the
    graph exactly once, on every rank."""
    stages = [(0, 64), (2, 64), (1, 0)]
    names = ["all_reduce sum", "all_gather dim 0", "two collectives, compute between", "dist.all_reduce into the input"]
    results = spawn(_compare_cases, 3, tmp_path, stages, names, ["reduce-overhead"])
    _check(results, stages)
    assert len(results[2]) == 2 * len(names)



def _tensor_parallel_mlp(rank, world):
    """A Colwise -> Rowwise MLP (DTensor) through both entry points: bitwise per rank, replayed,
    one all_reduce a call, run as a collective step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    import torchreplay

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    model = parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    cfg = torchreplay.CompilerConfig()
    cfg.mode = "reduce-overhead"
    out = {}
    with torch.no_grad():
        x = torch.randn(3, 16, generator=torch.Generator().manual_seed(0))  # the same on every rank
        for entry in ("compile", "capture"):
            if entry == "compile":
                backend = torchreplay.get_backend(compiler_config=cfg)
                run, stats = torch.compile(model, backend=backend), backend.stats
            else:
                captured = torchreplay.capture(model, (x,), config=cfg)
                run, stats = captured, lambda: [captured.stats()]  # noqa: E731
            difference, issued, expected = None, [], []
            for k in range(4):
                x = torch.randn(3, 16, generator=torch.Generator().manual_seed(k))
                s0 = _seq()
                want = model(x)
                s1 = _seq()
                got = run(x)
                difference = difference or bitwise_diff(got, want, f"call {k}")
                expected.append(s1 - s0)
                issued.append(_seq() - s1)
            out[entry] = {"bitwise": difference is None, "difference": difference, "issued": issued, "expected": expected,
                          "replays": sum(s["replays"] for s in stats()),
                          "collective_steps": [c["collective_steps"] for s in stats() for c in s["capture_log"]]}
    # With grad mode on, eager's output tracks the DTensor parameters: the capture (inference only)
    # refuses, naming the parameter, though its local shard does not require grad.
    try:
        captured(x)
        out["grad"] = "not refused"
    except ValueError as e:
        out["grad"] = str(e)
    return out


def test_a_tensor_parallel_dtensor_mlp_replays_through_both_entry_points(tmp_path):
    for rank, per_entry in enumerate(spawn(_tensor_parallel_mlp, 2, tmp_path)):
        assert "parameter '0.weight' (its _local_tensor)" in per_entry.pop("grad"), per_entry
        for entry, r in per_entry.items():
            assert r["bitwise"] and r["replays"] == 3 and r["collective_steps"] == [1], (rank, entry, r)
            assert r["issued"] == r["expected"] and min(r["expected"]) >= 1, (rank, entry, r)


def _dtensor_edges(rank, world):
    """A DTensor model with a Python number argument (specialized: bitwise, replayed), one that
    reads a plain tensor attribute (a clear error), and profile() of a graph with collectives
    whose key does not replay yet (a clear error, no collective issued)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    import torchreplay

    class Shifted(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)
            self.table = torch.arange(16.0)

        def forward(self, x, shift, use_table=False):
            y = self.down(self.up(x).relu()) + shift
            return y * self.table if use_table else y

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = parallelize_module(Shifted(), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    cfg = torchreplay.CompilerConfig()
    cfg.mode = "reduce-overhead"
    out = {}
    with torch.no_grad():
        x = torch.randn(3, 16, generator=torch.Generator().manual_seed(0))
        f = torchreplay.capture(model, (x, 0.5), config=cfg)
        out["difference"] = next((d for d in (bitwise_diff(f(x + k, 0.5), model(x + k, 0.5), f"call {k}")
                                              for k in range(4)) if d is not None), None)
        out["bitwise"] = out["difference"] is None
        out["replays"] = f.stats()["replays"]
        try:
            f(x, -0.5)
            out["other shift"] = "accepted"
        except ValueError as e:
            out["other shift"] = str(e)
        try:
            torchreplay.capture(model, (x, 0.5, True), config=cfg)
            out["attribute"] = "captured"
        except NotImplementedError as e:
            out["attribute"] = str(e)
        s0 = _seq()
        try:
            f.profile(x[:2], 0.5, iterations=3)   # another shape: not captured on this rank
            out["profile"] = "profiled"
        except RuntimeError as e:
            out["profile"] = str(e)
        out["profile collectives"] = _seq() - s0
    return out


def test_dtensor_capture_edges(tmp_path):
    for rank, r in enumerate(spawn(_dtensor_edges, 2, tmp_path)):
        assert r["bitwise"] and r["replays"] == 3, (rank, r)
        assert "captured with 0.5" in r["other shift"], (rank, r)
        assert "register it as a buffer" in r["attribute"], (rank, r)
        assert "profiled without warm-up calls" in r["profile"] and r["profile collectives"] == 0, (rank, r)


def _fail_in_flight(rank, world):
    """A call that fails while its collective is in flight (an index out of range between the
    all_reduce and its wait), then calls that succeed: as eager on every call."""
    import torch.distributed._functional_collectives as fc
    import torchreplay

    cfg = torchreplay.CompilerConfig()
    cfg.mode = "reduce-overhead"
    table = torch.randn(8, 4)
    fn = lambda x, i: fc.all_reduce(x * 2, "sum", dist.group.WORLD) + torch.index_select(table, 0, i).sum()  # noqa: E731
    x, good, bad = torch.randn(4), torch.tensor([1, 5]), torch.tensor([1, 9])
    f = torchreplay.capture(fn, (x, good), config=cfg)
    calls = []
    for k in range(6):
        i = bad if k == 3 else good
        got = []
        for run in (fn, f):
            s0 = _seq()
            try:
                got.append(run(x + k, i))
            except (IndexError, RuntimeError) as e:
                got.append(type(e).__name__)
            got.append(_seq() - s0)
        calls.append({"failed": isinstance(got[0], str), "both_failed": isinstance(got[0], str) == isinstance(got[2], str),
                      "difference": None if isinstance(got[0], str) else bitwise_diff(got[2], got[0], f"call {k}"),
                      "issued": [got[1], got[3]]})
    stats = f.stats()
    return {"calls": calls, "replays": stats["replays"], "collective_steps": stats["capture_log"][0]["collective_steps"]}


def test_a_call_that_fails_with_a_collective_in_flight_leaves_the_next_calls_right(tmp_path):
    for rank, r in enumerate(spawn(_fail_in_flight, 2, tmp_path)):
        assert [c["failed"] for c in r["calls"]] == [False, False, False, True, False, False], (rank, r)
        assert all(c["both_failed"] and c["difference"] is None and c["issued"] == [1, 1] for c in r["calls"]), (rank, r)
        assert r["replays"] >= 3 and r["collective_steps"] == 1, (rank, r)


def _lose_a_rank(rank, world):
    import torch.distributed._functional_collectives as fc
    import torchreplay

    cfg = torchreplay.CompilerConfig()
    cfg.mode = "reduce-overhead"
    fn = lambda x: fc.all_reduce(x * 2, "sum", dist.group.WORLD) + 1  # noqa: E731
    f = torchreplay.capture(fn, (torch.ones(4),), config=cfg)
    for _ in range(3):
        f(torch.ones(4))
    assert f.stats()["replays"] >= 1
    if rank == 1:
        os._exit(0)   # dies between two calls, as a killed process does
    t0 = time.monotonic()
    try:
        f(torch.ones(4))
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"[:500], "seconds": time.monotonic() - t0}
    return {"error": None, "seconds": time.monotonic() - t0}


def test_a_rank_that_dies_makes_the_others_fail_with_an_error_not_hang(tmp_path):
    world = 2
    ctx = mp.start_processes(ranks._entry, args=(_lose_a_rank, world, ranks._free_port(), str(tmp_path), 1, ()),
                             nprocs=world, join=False, start_method="spawn")
    end = time.monotonic() + ranks.TIMEOUT_S + 120
    for p in ctx.processes:
        p.join(timeout=max(1.0, end - time.monotonic()))
    alive = [p.pid for p in ctx.processes if p.is_alive()]
    for p in ctx.processes:
        if p.is_alive():
            p.kill()
    assert not alive, "a rank hung after its peer died"
    with open(tmp_path / "rank0.json") as f:
        r = json.load(f)
    # The barrier after the worker fails too (its peer is gone): the worker's own result is what counts.
    result = r.get("result") or {}
    assert "error" in r or result.get("error"), r
    if "result" in r:
        assert result["error"] and result["seconds"] < ranks.TIMEOUT_S + 5, result


def test_a_graph_knows_it_communicates():
    """Graph.communicates, which keeps a CUDA graph with collectives from being captured (Note
    [Collectives]); lowered on a fake process group, which communicates nothing."""
    import torch.distributed._functional_collectives as fc
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torchreplay.lowering import lower

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        x = torch.randn(4)
        for fn, communicates in [(lambda t: fc.all_reduce(t * 2, "sum", dist.group.WORLD) + 1, True),
                                 (lambda t: t * 2 + 1, False)]:
            assert lower(make_fx(fn)(x), [x], ()).communicates is communicates
    finally:
        dist.destroy_process_group()


def test_the_tensor_parallel_report_checks_every_mode_against_eager():
    """Every mode of the TP report (the tiny Llama's attention traced as eager runs it) is checked
    against eager on every rank; a mode differing on one rank, or issuing other collectives, is a
    failure named with its rank."""
    from torchreplay_bench import tp

    def rank(compile_ok=True, capture_ok=True, collectives_ok=True):
        timing = dict(us=100.0, p10_us=90.0, p90_us=110.0)
        modes = {"eager": dict(bitwise=True, collectives_match=True, collectives=4, **timing),
                 "compile": dict(bitwise=compile_ok, collectives_match=collectives_ok, collectives=4,
                                 replays=3, **timing),
                 "capture": dict(bitwise=capture_ok, collectives_match=True, collectives=4, replays=3, **timing),
                 "comm-floor": dict(collectives=4, us=50.0, p10_us=40.0, p90_us=60.0)}
        overlap = {k: dict(bitwise=True, us=10.0, replays=3) for k in
                   ("communication", "compute", "both", "both, every rank computing", "both, eager")}
        return {"modes": modes, "overlap": overlap}

    table = tp._table([rank(), rank()], 2)
    row = {line.split()[0]: line for line in table.splitlines() if line.startswith("  ")}
    assert row["compile"].endswith("bitwise vs eager on every rank, 3 replays"), table
    assert row["capture"].endswith("bitwise vs eager on every rank, 3 replays"), table
    assert tp._failures([rank(), rank()]) == []
    assert tp._failures([rank(), rank(compile_ok=False)]) == ["rank 1: compile vs eager"]
    assert tp._failures([rank(capture_ok=False), rank()]) == ["rank 0: capture vs eager"]
    assert tp._failures([rank(collectives_ok=False), rank()]) == ["rank 0: compile vs eager"]
    assert "WRONG vs eager" in tp._table([rank(), rank(capture_ok=False)], 2)
    assert "WRONG collectives" in tp._table([rank(collectives_ok=False), rank()], 2)
