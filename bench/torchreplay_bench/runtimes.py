"""The CPU runtimes a user weighs, side by side with torchreplay: per model and thread count,
eager, torchreplay.capture (bitwise, and with numerics "close"), torch.compile + torchreplay,
AOTInductor, ONNX Runtime, OpenVINO and ExecuTorch (XNNPACK), each built, checked against eager
(the largest absolute and relative errors of the modes that are close, not bitwise) and timed in
one process.

    python -m torchreplay_bench.runtimes [--models mlp,lstm_step] [--modes eager,onnxruntime]
                                         [--threads 1,2] [--rounds 7] [--quick] [--out DIR]

Per model and thread count every mode is built from a fresh copy of the model (build time: making
the runnable and its first call), checked against eager over three calls ("bitwise", "close (max
abs err, max rel err)" within the harness's tolerance, rtol 1e-4 and atol 1e-5, or "WRONG (why)"),
then the modes that gave eager's outputs are timed interleaved as the harness times them (each of
--rounds rounds times every mode once; the median over rounds, µs per call) with the ratio to
eager. A mode that fails to build or run gets a row that says why. A torchreplay mode close to
eager but not bitwise is also checked against the traced graph run eagerly (the exported program,
or aot_eager through torch.compile), and a torch.compile mode in which Dynamo made no graph says
so. torch.set_num_threads and each runtime's own thread settings follow the thread count:

- ONNX Runtime: torch.onnx.export(dynamo=True); intra-op threads = the count, one inter-op thread,
  ORT_SEQUENTIAL, ORT_ENABLE_ALL; IO binding, with input and output buffers bound once (each call
  copies its inputs into them);
- OpenVINO: openvino.convert_model; INFERENCE_NUM_THREADS = the count, PERFORMANCE_HINT LATENCY,
  NUM_STREAMS 1, INFERENCE_PRECISION_HINT f32 (without it CPUs with AMX may run bf16); an infer
  request with its input and output tensors bound once on shared memory;
- ExecuTorch: torch.export, to_edge_transform_and_lower with the XnnpackPartitioner,
  to_executorch, run through executorch.runtime; its thread pool reset to the count.

The peers are benchmark-only packages: tools/bench-requirements.txt (tools/bench.sh installs
them). Writes DIR/runtimes.json; --markdown also prints the tables as Markdown.

Over 500 lines in one module: each runtime's build (export, conversion, binding its buffers) is a
function of its own, and all share the one check, timing loop and table a fair comparison needs.
"""
from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import platform
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch.utils import _pytree as pytree

from torchreplay_bench.modes import compile_for, fresh_dynamo, same
from torchreplay_bench.timing import time_interleaved
from torchreplay_bench.models import MODELS as ALL_MODELS
from torchreplay_bench.peers import PEER_CLASSES, executorch_threads, quiet

MODES = {
    "eager": "eager PyTorch",
    "torchreplay-capture": "torchreplay.capture, config mode reduce-overhead (torch.export once, then each "
                           "call straight into C++)",
    "torchreplay-capture-close": "torchreplay.capture with config.reduce_overhead.numerics = \"close\" (the graph "
                                 "rewritten as CPU runtimes do: batch norms folded, packed weights, fused "
                                 "activations, channels-last, LSTM decomposed; outputs close to eager's)",
    "torchreplay-reduce-overhead": "torch.compile with torchreplay.get_backend, config mode reduce-overhead",
    "aotinductor": "AOTInductor: torch.export, aoti_compile_and_package, aoti_load_package(...).loader.run",
    "onnxruntime": "ONNX Runtime: torch.onnx.export(dynamo=True), InferenceSession (CPU), IO binding",
    "openvino": "OpenVINO: openvino.convert_model, compile_model CPU (latency, f32), bound infer request",
    "executorch": "ExecuTorch: XNNPACK partitioner, executorch.runtime",
}
SHORT = {"eager": "eager", "torchreplay-capture": "capture", "torchreplay-capture-close": "capture close",
         "torchreplay-reduce-overhead": "compile+tr",
         "aotinductor": "AOTInductor", "onnxruntime": "ONNX Runtime", "openvino": "OpenVINO",
         "executorch": "ExecuTorch"}
PEERS = {"onnxruntime": ("onnxruntime", "onnx", "onnxscript"), "openvino": ("openvino",),
         "executorch": ("executorch", "torchao")}  # mode -> the packages it needs
MODELS = ["mlp", "convnet", "mobilenet_v3_small_96", "audio_conv1d", "lstm_step", "gru_seq16", "bert_encoder",
          "llama_decode", "attention_decode", "embedding_bag"]
QUICK_MODELS = ["mlp", "lstm_step", "attention_decode"]
# ExecuTorch's lowering resets torch.compile's caches: it is built first, torch.compile's modes last.
BUILD_ORDER = ["eager", "executorch", "onnxruntime", "openvino", "aotinductor", "torchreplay-capture",
               "torchreplay-capture-close", "torchreplay-reduce-overhead"]
CHECK_CALLS = 3
INSTALL_HINT = "pip install --no-deps -r tools/bench-requirements.txt, or run tools/bench.sh"


def missing_packages(mode: str) -> List[str]:
    return [p for p in PEERS.get(mode, ()) if importlib.util.find_spec(p) is None]


def build(mode: str, model: torch.nn.Module, example_inputs: tuple, threads: int) -> Callable:
    if mode in PEER_CLASSES:
        return PEER_CLASSES[mode](model, example_inputs, threads)
    if mode == "torchreplay-reduce-overhead":  # compile_for's, keeping the backend for its stats
        import torchreplay
        config = torchreplay.CompilerConfig()
        config.mode = "reduce-overhead"
        backend = torchreplay.get_backend(compiler_config=config)
        compiled = torch.compile(model, backend=backend)
        compiled.torchreplay_backend = backend
        return compiled
    fn = compile_for(mode, model, list(example_inputs))
    if fn is None:
        raise RuntimeError(f"the harness has no {mode} version of this model")
    return fn


def _leaves(out: Any) -> List[Any]:
    return pytree.tree_leaves(out)


def compare(got: Any, want: Any) -> Dict[str, Any]:
    """Flattened outputs against eager's: bitwise, close (the harness's allclose) or not, with the
    largest absolute error and the largest relative error |got - want| / |want| per element, where
    elements below a thousandth of the output's largest magnitude count as that thousandth."""
    g, w = _leaves(got), _leaves(want)
    if len(g) != len(w):
        return {"close": False, "bitwise": False, "why": f"{len(g)} outputs, eager gives {len(w)}"}
    abs_err = rel_err = 0.0
    close = bitwise = True
    for i, (a, b) in enumerate(zip(g, w)):
        if not isinstance(b, torch.Tensor):
            ok = a == b
            close, bitwise = close and ok, bitwise and ok
            continue
        if not isinstance(a, torch.Tensor):
            a = torch.as_tensor(a)
        if a.shape != b.shape:
            return {"close": False, "bitwise": False,
                    "why": f"output {i} has shape {tuple(a.shape)}, eager's {tuple(b.shape)}"}
        if a.dtype != b.dtype:
            a = a.to(b.dtype)
        c, e = same(a, b)
        close, bitwise = close and bool(c), bitwise and bool(e)
        if b.is_floating_point() and b.numel():
            d = (a.double() - b.double()).abs()
            if not torch.isfinite(d).all():
                abs_err = rel_err = float("inf")
            else:
                abs_err = max(abs_err, d.max().item())
                mag = b.double().abs()
                floor = max(mag.max().item() * 1e-3, torch.finfo(b.dtype).tiny)
                rel_err = max(rel_err, (d / mag.clamp_min(floor)).max().item())
        elif not e:
            abs_err = max(abs_err, (a.double() - b.double()).abs().max().item())
    return {"close": close, "bitwise": bitwise, "abs_err": abs_err, "rel_err": rel_err}


def _written_buffers(model: torch.nn.Module, run: Callable[[], Any]) -> List[str]:
    """The names of the buffers `run` changes."""
    before = {n: b.clone() for n, b in model.named_buffers()}
    run()
    return [n for n, b in model.named_buffers() if n in before and not torch.equal(before[n], b)]


def check_text(results: List[Dict[str, Any]], written: List[str], keeps_state: Optional[bool] = None,
               runtime: str = "") -> Tuple[str, bool]:
    """The check column and whether the mode gave eager's outputs (bitwise or close) on every call.
    `written`: the buffers eager's calls wrote; `keeps_state`: whether the runtime's model keeps
    any state between calls (None: unknown)."""
    bad = [i for i, r in enumerate(results) if not r["close"]]
    if not bad:
        if all(r["bitwise"] for r in results):
            return "bitwise", True
        a = max(r["abs_err"] for r in results)
        rel = max(r["rel_err"] for r in results)
        return f"close (max abs err {a:.2g}, max rel err {rel:.2g})", True
    first = results[bad[0]]
    if "why" in first:
        why = first["why"]
    else:
        why = f"max abs err {max(results[i]['abs_err'] for i in bad):.3g}, max rel err " \
              f"{max(results[i]['rel_err'] for i in bad):.3g}"
    calls = ", ".join(str(i + 1) for i in bad)
    text = f"call{'s' if len(bad) > 1 else ''} {calls} of {len(results)} " \
           f"{'differ' if len(bad) > 1 else 'differs'} from eager: {why}"
    if bad[0] > 0 and written:
        names = ", ".join(written[:4]) + (", ..." if len(written) > 4 else "")
        if keeps_state is False:
            text += (f"; the model writes its buffers ({names}) each call and later calls read them, but "
                     f"{runtime}'s model keeps no state between calls: the writes are dropped")
        else:
            text += f"; the model writes its buffers ({names}) each call and later calls read them"
    return f"WRONG ({text})", False


def traced_check(mode: str, model: torch.nn.Module, make_inputs: Callable[[int], tuple], seen: List[Any]) -> str:
    """Where a torchreplay mode is close to eager but not bitwise: its outputs against the traced
    graph run eagerly, the reference torchreplay keeps bitwise where tracing or decompositions
    change the arithmetic: torch.export's program with capture's decompositions (capture), or
    torch.compile with backend aot_eager (through torch.compile); each on a fresh copy."""
    if mode == "torchreplay-capture":
        from torchreplay.export import _decompositions
        ep = torch.export.export(copy.deepcopy(model), tuple(make_inputs(0)))
        traced, name = ep.run_decompositions(_decompositions(None)).module(), "the exported program's"
    else:
        traced, name = torch.compile(copy.deepcopy(model), backend="aot_eager"), "aot_eager's"
    exact = all(compare(got, traced(*copy.deepcopy(make_inputs(i))))["bitwise"] for i, got in enumerate(seen))
    return f"; bitwise equal to {name}" if exact else f"; not bitwise equal to {name} either"


def graphs_note(fn: Any, model: torch.nn.Module) -> str:
    """Through torch.compile: a note where Dynamo made no graph, so that the model ran eagerly."""
    backend = getattr(fn, "torchreplay_backend", None)
    if backend is None or backend.stats():
        return ""
    rnn = any(isinstance(m, torch.nn.RNNBase) for m in model.modules())
    return "; Dynamo made no graph, the model ran eagerly" + (
        " (torch.nn.LSTM and GRU: traced for torchreplay with grad disabled only)" if rnn else "")


def prepare(model_name: str, mode: str, threads: int) -> Tuple[Dict[str, Any], Optional[Callable[[], None]]]:
    """Builds and checks one mode of one model: (row, step) where step() is one timed call, or
    None when the mode failed, was wrong or is not installed (the row says why)."""
    row: Dict[str, Any] = {"model": model_name, "mode": mode, "threads": threads}
    missing = missing_packages(mode)
    if missing:
        row.update(status="not installed", check=f"not installed: {', '.join(missing)} ({INSTALL_HINT})")
        return row, None
    factory, _ = ALL_MODELS[model_name]
    torch.manual_seed(0)
    model, make_inputs = factory()
    reference = copy.deepcopy(model)
    phase, log = "build", []
    try:
        with torch.no_grad(), quiet(log):
            t0 = time.perf_counter()
            fn = build(mode, copy.deepcopy(model), make_inputs(0), threads)
            results, seen, written = [], [], []
            for i in range(CHECK_CALLS):
                inputs = make_inputs(i)
                phase = "build" if i == 0 else "run"
                got = fn(*copy.deepcopy(inputs))
                if i == 0:
                    row["build_s"] = time.perf_counter() - t0
                box: List[Any] = []
                for name in _written_buffers(reference, lambda: box.append(reference(*copy.deepcopy(inputs)))):
                    written += [name] if name not in written else []
                results.append(compare(got, box[0]))
                seen.append(pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, got))
            row["check"], ok = check_text(results, written, getattr(fn, "keeps_state", None), SHORT[mode])
            row["bitwise"] = all(r["bitwise"] for r in results)
            if ok and not row["bitwise"] and mode.startswith("torchreplay-") and not mode.endswith("-close"):
                phase = "check"
                row["check"] += traced_check(mode, model, make_inputs, seen)
            row["check"] += graphs_note(fn, model)
    except Exception as e:  # noqa: BLE001 - a mode that fails says why in its row
        msg = str(e).strip().splitlines()
        row.update(status="failed", error=f"{type(e).__name__}: {msg[0] if msg else ''}"[:300])
        missing_ops = sorted({line.split("Missing operator:")[1].split("]")[-1].strip()
                              for line in log if "Missing operator:" in line})
        if missing_ops:  # ExecuTorch names the operators its runtime lacks in its log only
            row["error"] += f" (no kernel in the runtime for {', '.join(missing_ops)})"
        row["check"] = f"failed to {phase}: {row['error']}"
        tail = [line for line in log if line.strip()][-5:]
        if tail:
            print("\n".join(f"    {line[:300]}" for line in tail), file=sys.stderr)
        return row, None
    row["status"] = "ok" if ok else "wrong"
    if not ok:
        return row, None
    inputs = make_inputs(CHECK_CALLS)
    return row, lambda: fn(*inputs)


def measure(model_name: str, modes: List[str], threads: int, rounds: int, seconds: float) -> List[Dict[str, Any]]:
    """Every mode of one model at one thread count: built and checked, then timed interleaved."""
    torch.set_num_threads(threads)
    with quiet([]):
        executorch_threads(threads)
    fresh_dynamo(len(modes))
    rows: Dict[str, Dict[str, Any]] = {}
    steps: Dict[str, Callable[[], None]] = {}
    for mode in sorted(modes, key=BUILD_ORDER.index):
        rows[mode], step = prepare(model_name, mode, threads)
        if step is not None:
            steps[mode] = step
        r = rows[mode]
        build = f" ({r['build_s']:.2f} s)" if "build_s" in r else ""
        print(f"{threads} thread{'s' if threads > 1 else ''} {model_name} {mode}: {r['check'][:160]}{build}",
              file=sys.stderr, flush=True)
    load = os.getloadavg()[0]  # the 1-minute load average as the timing starts (this process counts)
    for mode, timing in time_interleaved(steps, rounds, seconds * rounds).items():
        rows[mode].update(timing)
    for r in rows.values():
        r["load"] = load
    eager = rows.get("eager", {}).get("median_us")
    for r in rows.values():
        if eager and "median_us" in r:
            r["vs_eager"] = eager / r["median_us"]
    return [rows[m] for m in modes]


def render(rows: List[Dict[str, Any]]) -> str:
    """One line per thread count, model and mode."""
    lines = [f"{'threads':>7}  {'model':<22}{'mode':<30}{'us/call':>10}{'iqr':>8}{'vs eager':>10}{'build s':>9}  check"]
    for r in rows:
        us = f"{r['median_us']:.1f}" if "median_us" in r else "-"
        iqr = f"{r['iqr_us']:.1f}" if "iqr_us" in r else "-"
        ratio = f"{r['vs_eager']:.2f}x" if "vs_eager" in r else "-"
        build = f"{r['build_s']:.2f}" if "build_s" in r else "-"
        lines.append(f"{r['threads']:>7}  {r['model']:<22}{r['mode']:<30}{us:>10}{iqr:>8}{ratio:>10}{build:>9}  "
                     f"{r['check']}")
    return "\n".join(lines)


def render_markdown(rows: List[Dict[str, Any]], modes: List[str]) -> str:
    """Per thread count, a model x mode table of µs per call (ratio to eager) and the checks."""
    out = []
    for threads in sorted({r["threads"] for r in rows}):
        mine = [r for r in rows if r["threads"] == threads]
        models = list(dict.fromkeys(r["model"] for r in mine))
        out.append(f"{threads} thread{'s' if threads > 1 else ''}, µs per call (ratio to eager; bold: the fastest "
                   "row giving eager's outputs):\n")
        out.append("| model | " + " | ".join(SHORT[m] for m in modes) + " |")
        out.append("|---" * (len(modes) + 1) + "|")
        for model in models:
            by_mode = {r["mode"]: r for r in mine if r["model"] == model}
            timed = [r["median_us"] for r in by_mode.values() if "median_us" in r]
            best = min(timed) if timed else None
            cells = []
            for m in modes:
                r = by_mode.get(m)
                if r is None:
                    cells.append("")
                elif "median_us" in r:
                    us = f"{r['median_us']:.1f}"
                    us = f"**{us}**" if r["median_us"] == best else us
                    cells.append(us if m == "eager" else f"{us} ({r['vs_eager']:.2f}x)")
                else:
                    cells.append({"wrong": "WRONG", "failed": "failed"}.get(r.get("status"), "-"))
            out.append(f"| {model} | " + " | ".join(cells) + " |")
        out.append("")
    out.append("Checks and build times (s), per model and mode:\n")
    out.append("| threads | model | mode | build s | check |")
    out.append("|---|---|---|---|---|")
    for r in rows:
        build = f"{r['build_s']:.2f}" if "build_s" in r else "-"
        out.append(f"| {r['threads']} | {r['model']} | {SHORT[r['mode']]} | {build} | {r['check']} |")
    return "\n".join(out)


def versions() -> Dict[str, Optional[str]]:
    from importlib.metadata import PackageNotFoundError, version
    out: Dict[str, Optional[str]] = {}
    for p in ("torch", "onnxruntime", "onnx", "onnxscript", "openvino", "executorch", "torchao", "transformers",
              "torchvision"):
        try:
            out[p] = version(p)
        except PackageNotFoundError:
            out[p] = None
    return out


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m torchreplay_bench.runtimes", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=None, help="comma-separated (default: " + ",".join(MODELS) + "; --quick: "
                   + ",".join(QUICK_MODELS) + "), of " + ", ".join(ALL_MODELS))
    p.add_argument("--modes", default=None, help="comma-separated, of " + ", ".join(MODES)
                   + " (default: all; --quick: all but aotinductor, whose C++ compile takes 5-30 s a model)")
    p.add_argument("--threads", default=None, help="comma-separated thread counts (default 1,2; --quick: 1)")
    p.add_argument("--rounds", type=int, default=None, help="timing rounds (default 7; --quick: 3)")
    p.add_argument("--seconds", type=float, default=None,
                   help="length of each mode's timed block per round (default 0.2; --quick: 0.05)")
    p.add_argument("--quick", action="store_true", help="a short run: three models, one thread, three rounds")
    p.add_argument("--out", default="bench_out", help="directory for runtimes.json")
    p.add_argument("--markdown", action="store_true", help="also print the tables as Markdown")
    a = p.parse_args(argv)
    models = (a.models or ",".join(QUICK_MODELS if a.quick else MODELS)).split(",")
    if a.modes:
        modes = a.modes.split(",")
    else:
        modes = [m for m in MODES if not (a.quick and m == "aotinductor")]
    threads = [int(t) for t in (a.threads or ("1" if a.quick else "1,2")).split(",")]
    rounds = a.rounds or (3 if a.quick else 7)
    seconds = a.seconds or (0.05 if a.quick else 0.2)
    for name in models:
        if name not in ALL_MODELS:
            p.error(f"unknown model {name}")
    for mode in modes:
        if mode not in MODES:
            p.error(f"unknown mode {mode}")
    if "eager" not in modes:
        modes.insert(0, "eager")  # every check and ratio is against it
    modes = [m for m in MODES if m in modes]

    load_before = os.getloadavg()
    started = time.strftime("%Y-%m-%d %H:%M")
    rows: List[Dict[str, Any]] = []
    for t in threads:
        for name in models:
            rows.extend(measure(name, modes, t, rounds, seconds))
    load_after = os.getloadavg()
    loads = [r["load"] for r in rows if "load" in r]
    print(f"CPU runtimes against torchreplay, torch {torch.__version__}, {os.cpu_count()} cores, "
          f"load average {load_before[0]:.2f} before, {min(loads, default=0):.2f}-{max(loads, default=0):.2f} "
          f"as each model's timing started, {load_after[0]:.2f} after; median of {rounds} interleaved rounds, "
          f"µs per call")
    print(render(rows))
    if a.markdown:
        print()
        print(render_markdown(rows, modes))
    meta = {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
            "cores": os.cpu_count(), "date": started, "threads": threads, "rounds": rounds, "seconds": seconds,
            "load_before": load_before, "load_after": load_after,
            "load_as_timing_started": [min(loads, default=0), max(loads, default=0)], "versions": versions(),
            "modes": {m: MODES[m] for m in modes}, "command": " ".join(["python -m torchreplay_bench.runtimes"]
                                                                        + (argv if argv is not None else sys.argv[1:]))}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "runtimes.json"), "w") as f:
        json.dump({"meta": meta, "results": rows}, f, indent=2)
    print(f"wrote {a.out}/runtimes.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
