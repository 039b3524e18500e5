"""Ranks as processes on one machine: `spawn(worker, world, out_dir, *args)` starts `world`
processes (spawned), joins them in one gloo process group over 127.0.0.1, runs
worker(rank, world, *args) on each and returns what each returned (JSON). Bounded in time: the
process group's timeout makes a lost peer an error, and ranks still running at the deadline are
killed. Used by the tensor-parallel benchmark (torchreplay_bench.tp) and the collectives tests."""
from __future__ import annotations

import datetime
import json
import os
import socket
import time
import traceback
from typing import Any, Callable, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT_S = 30   # the process group's timeout: a lost peer is an error within it


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(worker: Callable[..., Any], world: int, out_dir: str, *args: Any, deadline_s: float = 240,
          threads: int = 1) -> List[Any]:
    """Each rank's result (what worker returned, through a JSON file in out_dir). A rank that
    raises raises here with its traceback (AssertionError); ranks still running at the deadline
    are killed. `threads`: torch.set_num_threads in each rank."""
    ctx = mp.start_processes(_entry, args=(worker, world, _free_port(), str(out_dir), threads, args), nprocs=world,
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
        with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
            r = json.load(f)
        assert "error" not in r, f"rank {rank}: {r['error']}"
        results.append(r["result"])
    return results


def _entry(rank: int, worker: Callable[..., Any], world: int, port: int, out: str, threads: int, args: tuple) -> None:
    torch.set_num_threads(threads)
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


def sequence() -> int:
    """How many collectives this rank has issued on the default group."""
    return dist.group.WORLD._get_sequence_number_for_group()
