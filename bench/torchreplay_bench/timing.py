"""Timing for the harness and the benchmarks beside it: interleaved rounds of every mode, the
host time of calls that launch GPU work, and profiler traces.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, List

import torch
import torch.utils.benchmark as tbench

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
