#!/usr/bin/env python
"""Soak: steady-state replay for many calls on the CPU, a mix of 3 keys (batch sizes), outputs
kept (some raw, held across later calls until dropped; some cloned) and dropped. Reports RSS after
warm-up and at the end, and the engine's captures, cache entries, handed-out storages and pool
bytes, which must not grow.

    .venv/bin/python tools/soak.py                      # 1,000,000 calls through torchreplay.capture
    .venv/bin/python tools/soak.py --calls 200000 --entry compile
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from typing import Any, Dict

import torch
import torch.nn as nn

BATCHES = (2, 4, 7)   # three keys (export specializes a size of 1)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 32)
        self.out = nn.Linear(32, 8)

    def forward(self, x):
        h = torch.relu(self.lin(x))
        y = self.out(h) + h[:, :8]
        return y, y.t()          # two outputs, one a view of the other


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def soak(calls: int = 1_000_000, entry: str = "capture", warmup: int = 20_000, check_every: int = 997,
         seed: int = 0) -> Dict[str, Any]:
    import torchreplay

    torch.manual_seed(seed)
    torch.set_num_threads(1)   # one intra-op thread: no OpenMP spinning against other processes
    model = Model().eval()
    cfg = torchreplay.CompilerConfig()
    cfg.mode = "reduce-overhead"
    gen = torch.Generator().manual_seed(seed)
    inputs = {b: [torch.randn(b, 16, generator=gen) for _ in range(4)] for b in BATCHES}
    with torch.no_grad():
        if entry == "capture":
            fn = torchreplay.capture(model, (inputs[BATCHES[1]][0],), config=cfg, dynamic=True)
            engines = lambda: [fn.engine]  # noqa: E731
        elif entry == "compile":
            backend = torchreplay.get_backend(compiler_config=cfg)
            fn = torch.compile(model, backend=backend, dynamic=True)
            engines = lambda: backend.engines  # noqa: E731
        else:
            raise ValueError(f"unknown entry point {entry!r}")
        want = {(b, k): tuple(t.clone() for t in model(x)) for b in BATCHES for k, x in enumerate(inputs[b])}
        kept: list = [None] * 8      # raw outputs held across later calls, then dropped
        clones: list = [None] * 8    # cloned outputs, checked when dropped
        mismatches = 0

        def run(start: int, n: int) -> None:
            nonlocal mismatches
            for i in range(start, start + n):
                b = BATCHES[(i * 7 + i // 3) % 3]        # mixed, not periodic in 3
                k = i % 4
                out = fn(inputs[b][k])
                if i % check_every == 0:
                    y, yt = out
                    w = want[(b, k)]
                    if not (torch.equal(y, w[0]) and torch.equal(yt, w[1])):
                        mismatches += 1
                if i % 5 == 0:
                    kept[i % 8] = out                    # kept raw (invalidated by a later replay)
                elif i % 11 == 0:
                    old = clones[i % 8]
                    if old is not None and not torch.equal(old[0], want[old[1]][0]):
                        mismatches += 1
                    clones[i % 8] = (out[0].clone(), (b, k))
                # else dropped

        t0 = time.perf_counter()
        run(0, warmup)
        gc.collect()
        rss0 = rss_bytes()
        s0 = [e.stats() for e in engines()]
        run(warmup, calls - warmup)
        gc.collect()
        rss1 = rss_bytes()
        seconds = time.perf_counter() - t0
        s1 = [e.stats() for e in engines()]

    def total(stats, key):
        return sum(s[key] for s in stats)

    return {
        "entry": entry, "calls": calls, "warmup_calls": warmup, "seconds": round(seconds, 1),
        "mismatches": mismatches,
        "rss_after_warmup_mb": round(rss0 / 1e6, 2), "rss_end_mb": round(rss1 / 1e6, 2),
        "rss_growth_bytes": rss1 - rss0,
        "captures": [total(s0, "captures"), total(s1, "captures")],
        "cache_entries": [total(s0, "cache_entries"), total(s1, "cache_entries")],
        "handed_out": [total(s0, "handed_out"), total(s1, "handed_out")],
        "pool_bytes": [max(s["pool_bytes"] for s in s0), max(s["pool_bytes"] for s in s1)],
        "replays": total(s1, "replays"), "eager_fallbacks": total(s1, "eager_fallbacks"),
        "errors": total(s1, "errors"),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=1_000_000)
    p.add_argument("--warmup", type=int, default=20_000)
    p.add_argument("--entry", choices=["capture", "compile"], default="capture")
    p.add_argument("--json", action="store_true", help="print the result as JSON only")
    a = p.parse_args()
    r = soak(a.calls, a.entry, a.warmup)
    if a.json:
        print(json.dumps(r))
    else:
        for k, v in r.items():
            print(f"{k:22s} {v}")
        print("(lists: [after warm-up, at the end])")
    ok = (r["mismatches"] == 0 and r["rss_growth_bytes"] < 1 << 20 and r["errors"] == 0
          and r["captures"][0] == r["captures"][1] and r["cache_entries"][0] == r["cache_entries"][1]
          and r["handed_out"][1] <= r["handed_out"][0] + 2 and r["pool_bytes"][0] == r["pool_bytes"][1])
    print("soak: " + ("PASS" if ok else "FAIL"), file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
