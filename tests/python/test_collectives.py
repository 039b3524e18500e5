"""Collectives inside captured graphs, on real process groups: gloo over 127.0.0.1, 2 and 3 ranks
as processes (spawned, bounded in time, always torn down). Every case compares each rank's replay
with the same rank's eager run bit for bit, checks that replays happened, and counts the
collectives each call issues (the process group's sequence number) against eager's count: ranks
must never disagree on how many collectives a call makes, whatever stage each is at."""
import datetime
import json
import os
import socket
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT_S = 30   # the process group's timeout: a lost peer is an error within it


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(worker, world, tmp_path, *args, deadline_s=240):
    """Runs worker(rank, world, *args) on `world` processes joined in one gloo group; returns each
    rank's JSON result (what the worker returned). A rank that raises fails the test with its
    traceback; ranks still running at the deadline are killed."""
    ctx = mp.start_processes(_entry, args=(worker, world, _free_port(), str(tmp_path), args), nprocs=world,
                             join=False, start_method="spawn")
    end = time.monotonic() + deadline_s
    try:
        while not ctx.join(timeout=max(1.0, end - time.monotonic())):
            if time.monotonic() > end:
                raise AssertionError(f"ranks still running after {deadline_s} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    results = []
    for rank in range(world):
        with open(os.path.join(tmp_path, f"rank{rank}.json")) as f:
            r = json.load(f)
        assert "error" not in r, f"rank {rank}: {r['error']}"
        results.append(r["result"])
    return results


def _entry(rank, worker, world, port, out, args):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    try:
        record = {"result": worker(rank, world, *args)}
    except BaseException:  # noqa: BLE001 - reported to the parent
        record = {"error": traceback.format_exc()}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    if "error" not in record:
        dist.barrier()
    dist.destroy_process_group()


def _seq():
    return dist.group.WORLD._get_sequence_number_for_group()


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
                bitwise, issued, expected = True, [], []
                for x in calls:
                    s0 = _seq()
                    want = fn(x.clone())
                    s1 = _seq()
                    got = f(x.clone())
                    s2 = _seq()
                    bitwise = bitwise and torch.equal(got, want)
                    expected.append(s1 - s0)
                    issued.append(s2 - s1)
                out[f"{name} | {entry} | {mode}"] = {"bitwise": bitwise, "issued": issued, "expected": expected,
                                                     "replays": sum(s["replays"] for s in stats())}
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
    """A Colwise -> Rowwise MLP (DTensor): through torch.compile, bitwise per rank, replayed, one
    all_reduce a call; through torchreplay.capture, the clear error."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    import torchreplay

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    model = parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    cfg = torchreplay.CompilerConfig()
    cfg.mode = "reduce-overhead"
    backend = torchreplay.get_backend(compiler_config=cfg)
    compiled = torch.compile(model, backend=backend)
    bitwise, issued, expected = True, [], []
    with torch.no_grad():
        for k in range(4):
            x = torch.randn(3, 16, generator=torch.Generator().manual_seed(k))  # the same on every rank
            s0 = _seq()
            want = model(x)
            s1 = _seq()
            got = compiled(x)
            bitwise = bitwise and torch.equal(got, want)
            expected.append(s1 - s0)
            issued.append(_seq() - s1)
        try:
            torchreplay.capture(model, (x,), config=cfg)
            refused = ""
        except NotImplementedError as e:
            refused = str(e)
    return {"bitwise": bitwise, "issued": issued, "expected": expected,
            "replays": sum(s["replays"] for s in backend.stats()), "refused": refused}


def test_a_tensor_parallel_dtensor_mlp_replays_through_torch_compile(tmp_path):
    for rank, r in enumerate(spawn(_tensor_parallel_mlp, 2, tmp_path)):
        assert r["bitwise"] and r["replays"] == 3, (rank, r)
        assert r["issued"] == r["expected"] and min(r["expected"]) >= 1, (rank, r)
        assert "parameter '0.weight' is a DTensor" in r["refused"] and "torch.compile(model" in r["refused"], r


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
    ctx = mp.start_processes(_entry, args=(_lose_a_rank, world, _free_port(), str(tmp_path), ()), nprocs=world,
                             join=False, start_method="spawn")
    end = time.monotonic() + TIMEOUT_S + 120
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
        assert result["error"] and result["seconds"] < TIMEOUT_S + 5, result


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
