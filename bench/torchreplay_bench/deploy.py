"""Serving from C++ with no Python: torchreplay.save + torchreplay::Load against AOTInductor's
package and its C++ loader, on the same models and inputs, one thread.

    python -m torchreplay_bench.deploy [--out bench_out] [--min-time 1]

For mlp and llama_decode (the harness's models): the model captured and saved (.trp), and
exported, compiled and packaged by AOTInductor (.pt2), each build timed; both files loaded in
Python as a check (the loaded program against the capture, bitwise; AOTInductor against eager);
then bench/deploy_bench (Google Benchmark, C++: torchreplay::Load and AOTIModelPackageLoader) times
loading each file and a call of each, and the table compares them.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings
from typing import List, Optional

import torch

import torchreplay
from torchreplay_bench.models import MODELS

BIN = os.path.join(os.path.dirname(__file__), "..", "..", "bazel-bin", "bench", "deploy_bench")
NAMES = ["mlp", "llama_decode"]


def build(name: str, out: str) -> dict:
    factory, _ = MODELS[name]
    torch.manual_seed(0)
    model, make_inputs = factory()
    torch.manual_seed(0)
    reference, _ = factory()
    config = torchreplay.CompilerConfig()
    config.mode = "reduce-overhead"
    args = make_inputs(0)
    with torch.no_grad():
        t0 = time.perf_counter()
        torchreplay.save(torchreplay.capture(model, args, config=config), os.path.join(out, f"{name}.trp"))
        ours_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        ep = torch.export.export(reference, tuple(args))
        torch._inductor.aoti_compile_and_package(ep, package_path=os.path.join(out, f"{name}.pt2"))
        aoti_s = time.perf_counter() - t0
        # Checks, on fresh copies: the loaded program against a capture of the same model (bitwise)
        # and against eager; AOTInductor's package against eager.
        torch.manual_seed(0)
        fresh, _ = factory()
        torch.manual_seed(0)
        eager, _ = factory()
        step = torchreplay.capture(fresh, args, config=config)
        program = torchreplay.load(os.path.join(out, f"{name}.trp"))
        aoti = torch._inductor.aoti_load_package(os.path.join(out, f"{name}.pt2"))
        ours_check, aoti_check = "bitwise", "bitwise"
        for i in range(4):
            a = make_inputs(i)
            want, got, theirs, base = step(*a), program(*a)[0], aoti(*a), eager(*a)
            if not torch.equal(got, want):
                ours_check = "WRONG (differs from torchreplay.capture)"
            if not torch.equal(got, base) and ours_check == "bitwise":
                ours_check = "bitwise vs capture, close vs eager" if torch.allclose(got, base, 1e-5, 1e-6) else "WRONG"
            if not torch.equal(theirs, base):
                aoti_check = "close vs eager" if torch.allclose(theirs, base, 1e-4, 1e-5) else "WRONG"
    return {"ours_build_s": ours_s, "aoti_build_s": aoti_s, "ours_check": ours_check, "aoti_check": aoti_check}


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench_out")
    p.add_argument("--min-time", default="1")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    # torch.export's own use of a deprecated pytree API (nothing a caller can change)
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
    out = os.path.join(args.out, "deploy")
    os.makedirs(out, exist_ok=True)
    if not os.path.exists(BIN):
        print(f"torchreplay_bench.deploy: {BIN} is not built (bazel build //bench:deploy_bench)", file=sys.stderr)
        return 1
    builds = {name: build(name, out) for name in NAMES if name != "llama_decode" or _has_transformers()}
    run = subprocess.run([BIN, f"--dir={out}", f"--benchmark_min_time={args.min_time}", "--benchmark_format=json"],
                         capture_output=True, text=True, check=True)
    rows = {b["name"]: b for b in json.loads(run.stdout)["benchmarks"]}

    def t(kind: str, who: str, name: str) -> float:
        return rows[f"BM_{kind}/{who}/{name}"]["real_time"]

    print("serving from C++ (bench/deploy_bench.cc, one thread): torchreplay.save + torchreplay::Load against "
          "AOTInductor (aoti_compile_and_package + AOTIModelPackageLoader), same inputs")
    print(f"  {'model':<14}{'runtime':<13}{'build s':>9}{'load ms':>10}{'us/call':>10}{'vs AOTI':>9}  check")
    for name, b in builds.items():
        ours, theirs = t("Call", "torchreplay", name), t("Call", "aotinductor", name)
        print(f"  {name:<14}{'torchreplay':<13}{b['ours_build_s']:>9.2f}{t('Load', 'torchreplay', name):>10.2f}"
              f"{ours:>10.1f}{theirs / ours:>8.2f}x  {b['ours_check']}")
        print(f"  {name:<14}{'aotinductor':<13}{b['aoti_build_s']:>9.2f}{t('Load', 'aotinductor', name):>10.2f}"
              f"{theirs:>10.1f}{1.0:>8.2f}x  {b['aoti_check']}")
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump({"builds": builds, "benchmarks": list(rows.values())}, f, indent=2)
    return 0


def _has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
        return True
    except ImportError:
        return False


if __name__ == "__main__":
    sys.exit(main())
