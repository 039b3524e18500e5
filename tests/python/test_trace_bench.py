"""Trace inspection (python -m torchreplay.trace) on traces recorded here, and the harness's
--quick run end to end, including a mode that is deliberately wrong."""
import csv
import json
import os

import pytest
import torch

import torchreplay
from torchreplay import trace
from torchreplay_bench import __main__ as bench
from torchreplay_bench import modes
from torchreplay_bench.models import ElementwiseChain

STEPS = 5


def record(fn, x, path, steps=STEPS, schedule=True):
    sched = torch.profiler.schedule(wait=0, warmup=1, active=steps, repeat=1) if schedule else None
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], schedule=sched) as prof:
        for _ in range(steps + (1 if schedule else 0)):
            fn(x)
            prof.step()
    prof.export_chrome_trace(str(path))
    return str(path)


def reduce_overhead(model):
    config = torchreplay.CompilerConfig()
    config.mode = "reduce-overhead"
    return torch.compile(model, backend=torchreplay.get_backend(compiler_config=config), fullgraph=True)


@pytest.fixture
def traces(tmp_path):
    """Eager and reduce-overhead traces of an 8-op chain (sin, mul, add, relu twice)."""
    x = torch.randn(16)
    model = ElementwiseChain(8)
    compiled = reduce_overhead(ElementwiseChain(8))
    with torch.no_grad():
        for _ in range(3):  # warm-up and capture happen before the profiled steps
            compiled(x)
        return (record(model, x, tmp_path / "eager.json"),
                record(compiled, x, tmp_path / "replay.json"))


def test_summary_counts_replays_and_dispatches(traces):
    eager, replay = trace.summarize(traces[0]), trace.summarize(traces[1])
    assert eager.step_kind == replay.step_kind == "profiler steps"
    assert len(eager.steps) == len(replay.steps) == STEPS
    # Eager dispatches each of the chain's 8 ops through the dispatcher, every step.
    assert [s.aten_ops for s in eager.steps] == [8] * STEPS
    assert [s.replays for s in eager.steps] == [0] * STEPS
    # Reduce-overhead: one replay per step, no capture, and the tape's kernels are called directly.
    assert [s.replays for s in replay.steps] == [1] * STEPS
    assert [s.captures + s.warmups + s.eager_fallbacks for s in replay.steps] == [0] * STEPS
    assert [s.aten_ops for s in replay.steps] == [0] * STEPS
    for s in replay.steps:
        assert 0 < s.replay_us < s.host_us
    assert not eager.has_gpu and eager.steps[0].kernel_launches == 0


def test_without_step_markers_each_compiled_call_is_a_step(tmp_path):
    x = torch.randn(16)
    compiled = reduce_overhead(ElementwiseChain(4))
    with torch.no_grad():
        path = record(compiled, x, tmp_path / "calls.json", steps=4, schedule=False)
    t = trace.summarize(path)
    assert t.step_kind == "compiled calls" and len(t.steps) == 4
    # warmup_iters=1: call 1 warms up, call 2 captures and replays, calls 3 and 4 replay.
    assert [s.warmups for s in t.steps] == [1, 0, 0, 0]
    assert [s.captures for s in t.steps] == [0, 1, 0, 0]
    assert [s.replays for s in t.steps] == [0, 1, 1, 1]


def record_loop(fn, x, path, calls, with_stack=False, range_name=None):
    """The ordinary way: a loop of calls under torch.profiler.profile(), no schedule, no prof.step()."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_stack=with_stack) as prof:
        for _ in range(calls):
            if range_name is None:
                fn(x)
            else:
                with torch.profiler.record_function(range_name):
                    fn(x)
    prof.export_chrome_trace(str(path))
    return str(path)


def ratio_column(out):
    """{row header: the B/A column} of compare's table."""
    rows = {}
    for line in out.splitlines():
        parts = line.rsplit(None, 3)
        if len(parts) == 4 and not line.startswith(("A:", "B:", "warning:", "median")):
            rows[parts[0]] = parts[3]
    return rows


@pytest.mark.parametrize("how", ["with_stack", "record_function"])
def test_ordinary_loops_compare_call_for_call(tmp_path, capsys, how):
    # Eager and torchreplay each called 6 times in a plain loop: both traces are 6 steps of one
    # call each, whether the calls are found from Python's call stack or from a range per call.
    calls, x = 6, torch.randn(16)
    compiled = reduce_overhead(ElementwiseChain(8))
    kwargs = {"with_stack": True} if how == "with_stack" else {"range_name": "call"}
    with torch.no_grad():
        for _ in range(3):
            compiled(x)
        paths = (record_loop(ElementwiseChain(8), x, tmp_path / "eager.json", calls, **kwargs),
                 record_loop(compiled, x, tmp_path / "compiled.json", calls, **kwargs))
    eager, ro = trace.summarize(paths[0]), trace.summarize(paths[1])
    if how == "with_stack":
        assert eager.unit == "top-level calls (nn.Module: ElementwiseChain_0)"
        assert ro.unit == "top-level calls (nn.Module: OptimizedModule_0)"
    else:
        assert eager.unit == ro.unit == "record_function 'call'"
    assert len(eager.steps) == len(ro.steps) == calls and eager.per_call and ro.per_call
    # Each eager step is one call: the chain's 8 ops, not the loop's 48.
    assert [s.aten_ops for s in eager.steps] == [8] * calls
    assert [s.replays for s in ro.steps] == [1] * calls
    assert [s.aten_ops + s.captures + s.warmups for s in ro.steps] == [0] * calls
    assert trace.compare_warnings(eager, ro) == []
    assert trace.main(["compare", *paths]) == 0
    out = capsys.readouterr().out
    assert f"A: {paths[0]} ({calls} steps, {eager.unit})" in out
    assert f"B: {paths[1]} ({calls} steps, {ro.unit})" in out
    assert "warning" not in out
    ratios = ratio_column(out)
    assert ratios["host us"] == f"{ro.median('host_us') / eager.median('host_us'):.2f}x"
    assert ratios["aten ops"] == "0.00x" and ratios["replays"] == "new"


def test_compare_warns_when_units_differ_or_no_call_is_found(tmp_path, capsys):
    x = torch.randn(16)
    compiled = reduce_overhead(ElementwiseChain(8))
    with torch.no_grad():
        for _ in range(3):
            compiled(x)
        plain_eager = record_loop(ElementwiseChain(8), x, tmp_path / "eager.json", 4)
        plain_compiled = record_loop(compiled, x, tmp_path / "compiled.json", 4)
        stack_eager = record_loop(ElementwiseChain(8), x, tmp_path / "eager_stack.json", 4, with_stack=True)
    # A plain eager loop shows no call: one step, the whole trace, and the summary says so.
    t = trace.summarize(plain_eager)
    assert (t.step_kind, len(t.steps), t.per_call) == ("whole trace", 1, False)
    assert t.steps[0].aten_ops == 4 * 8
    assert trace.main(["summarize", plain_eager]) == 0
    out = capsys.readouterr().out
    assert "1 step (whole trace)" in out and "warning:" in out and "no per-call unit found" in out
    # Whole trace against compiled calls: both warnings, and no ratio at all.
    assert trace.main(["compare", plain_eager, plain_compiled]) == 0
    out = capsys.readouterr().out
    assert f"A: {plain_eager} (1 step, whole trace)" in out
    assert f"B: {plain_compiled} (4 steps, compiled calls)" in out
    assert "no per-call unit found" in out
    assert "the steps are different units (A: whole trace; B: compiled calls)" in out
    assert set(ratio_column(out).values()) == {"?"}
    # Calls against compiled regions (which leave Dynamo's guard check out): also unlike units.
    warnings = trace.compare_warnings(trace.summarize(stack_eager), trace.summarize(plain_compiled))
    assert len(warnings) == 1 and "different units" in warnings[0]
    assert "top-level calls (nn.Module: ElementwiseChain_0)" in warnings[0]


def test_gpu_activity_is_measured_from_correlated_launches():
    # A hand-made CUDA-shaped trace: two launches 10 us apart, kernels of 5 us each.
    events = [
        {"ph": "X", "cat": "cpu_op", "name": "ProfilerStep#1", "ts": 0, "dur": 100, "pid": 1, "tid": 1},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 10, "dur": 3, "pid": 1, "tid": 1,
         "args": {"correlation": 7}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 20, "dur": 3, "pid": 1, "tid": 1,
         "args": {"correlation": 8}},
        {"ph": "X", "cat": "kernel", "name": "k1", "ts": 30, "dur": 5, "pid": 0, "tid": 7, "args": {"correlation": 7}},
        {"ph": "X", "cat": "kernel", "name": "k2", "ts": 45, "dur": 5, "pid": 0, "tid": 7, "args": {"correlation": 8}},
        {"ph": "X", "cat": "kernel", "name": "k3", "ts": 48, "dur": 4, "pid": 0, "tid": 7, "args": {"correlation": 8}},
    ]
    s = trace.summarize_events(events).steps[0]
    assert (s.kernel_launches, s.graph_launches, s.gpu_kernels) == (1, 1, 3)
    assert s.gpu_busy_us == pytest.approx(5 + 7)
    assert s.gpu_idle_us == pytest.approx(10) and s.gpu_max_gap_us == pytest.approx(10)


def test_cli_summarize_and_compare(traces, capsys):
    assert trace.main(["summarize", traces[1]]) == 0
    out = capsys.readouterr().out
    assert f"{STEPS} steps (profiler steps)" in out and f"replay ran in {STEPS} of {STEPS} steps" in out
    assert trace.main(["summarize", traces[1], "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [s["replays"] for s in data["steps"]] == [1] * STEPS
    assert trace.main(["compare", *traces]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0] + (" " + line.split()[1] if line.startswith("aten ops") else ""): line.split()
             for line in out.splitlines() if line.strip()}
    assert lines["aten ops"][2:4] == ["8", "0"]
    assert lines["replays"][1:3] == ["0", "1"]
    assert trace.main(["summarize", "/nonexistent.json"]) == 2


def test_harness_quick_run_writes_results_and_flags_a_wrong_mode(tmp_path, capsys):
    def off_by_one(model):
        def backend(gm, example_inputs):
            return lambda *args: [o + 1 for o in gm(*args)]
        return torch.compile(model, backend=backend)

    modes.register_mode("off-by-one", "a deliberately wrong backend", off_by_one)
    try:
        rc = bench.main(["--quick", "--models", "chain64", "--modes", "eager,torchreplay-reduce-overhead,off-by-one",
                         "--out", str(tmp_path), "--trace"])
    finally:
        modes.MODES.pop("off-by-one")
        modes._CUSTOM.pop("off-by-one")
    assert rc == 0
    out = capsys.readouterr().out
    table = {}
    for line in out.split("profiler traces")[0].splitlines():
        if line.startswith("chain64"):
            table[tuple(line.split()[:2])] = line
    assert "WRONG" in table[("chain64", "off-by-one")]
    assert "bitwise" in table[("chain64", "torchreplay-reduce-overhead")]
    results = {r["mode"]: r for r in json.load(open(tmp_path / "results.json"))["results"]}
    assert results["off-by-one"]["correct"] is False and "median_us" not in results["off-by-one"]
    ro = results["torchreplay-reduce-overhead"]
    assert ro["correct"] and ro["bitwise"] and ro["median_us"] > 0
    assert ro["speedup"] == pytest.approx(results["eager"]["median_us"] / ro["median_us"])
    assert ro["trace_replays"] == 1 and results["eager"]["trace_aten_ops"] == 64
    assert os.path.exists(ro["trace"])
    with open(tmp_path / "results.csv") as f:
        assert {r["mode"] for r in csv.DictReader(f)} == set(results)
    with open(tmp_path / "per_call.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_harness_floor_and_engine_rows_and_summary(tmp_path, capsys):
    class TwoGraphs(torch.nn.Module):
        def forward(self, x):
            x = torch.sin(x) + 1
            torch._dynamo.graph_break()
            return torch.cos(x) * 2

    bench.MODELS["two_graphs"] = (lambda: (TwoGraphs(), lambda i: (torch.randn(8),)), "one graph break")
    try:
        rc = bench.main(["--quick", "--models", "chain64,two_graphs", "--modes",
                         "eager,torchreplay-reduce-overhead,engine,dynamo-floor", "--out", str(tmp_path)])
    finally:
        bench.MODELS.pop("two_graphs")
    assert rc == 0
    out, err = capsys.readouterr()
    data = json.load(open(tmp_path / "results.json"))
    results = {(r["model"], r["mode"]): r for r in data["results"]}
    floor = results[("chain64", "dynamo-floor")]
    assert floor["correct"] is None and floor["check"] == "floor (not checked)" and floor["median_us"] > 0
    assert any(line.startswith("chain64") and "floor (not checked)" in line for line in out.splitlines())
    engine = results[("chain64", "engine")]
    assert engine["correct"] and engine["bitwise"] and engine["graphs"] == 1 and engine["median_us"] > 0
    two = results[("two_graphs", "engine")]
    assert two["correct"] and two["graphs"] == 2 and two["check"] == "bitwise, 2 graphs"
    summary = {s["model"]: s for s in data["summary"]}
    s = summary["chain64"]
    assert s["ours_us"] == results[("chain64", "torchreplay-reduce-overhead")]["median_us"]
    assert s["added_us"] == pytest.approx(s["ours_us"] - s["dynamo_floor_us"] - s["engine_us"])
    assert s["ours_vs_eager"] == pytest.approx(s["eager_us"] / s["ours_us"])
    assert "where torchreplay reduce-overhead's time goes" in out
    # one plain line per model and mode as each is compiled and checked, no progress bar
    assert "two_graphs dynamo-floor: floor (not checked)" in err and "it/s" not in err and "run/s" not in err


def test_harness_times_the_ahead_of_time_peers(tmp_path, capsys):
    """AOTInductor (its loader, no Python wrapper) and NativeRT as modes: built, checked against
    eager (close or bitwise, said per row), timed; AOTInductor only on --aoti-models."""
    rc = bench.main(["--quick", "--models", "chain64,mlp", "--modes", "eager,aotinductor,nativert",
                     "--aoti-models", "chain64", "--out", str(tmp_path)])
    assert rc == 0
    results = {(r["model"], r["mode"]): r for r in json.load(open(tmp_path / "results.json"))["results"]}
    for key in [("chain64", "aotinductor"), ("chain64", "nativert"), ("mlp", "nativert")]:
        r = results[key]
        assert r["correct"] and r["median_us"] > 0 and r["compile_s"] > 0, r
        assert r["check"] in ("bitwise", "close"), r
    assert ("mlp", "aotinductor") not in results


def test_harness_conv_bound_times_the_convolutions_of_the_tape(tmp_path):
    """The conv-bound reference: the captured convnet, checked like the capture, timed as its tape's
    convolution steps alone; a model without convolutions has no such row."""
    rc = bench.main(["--quick", "--models", "convnet,mlp", "--modes", "eager,torchreplay-capture,conv-bound",
                     "--out", str(tmp_path)])
    assert rc == 0
    results = {(r["model"], r["mode"]): r for r in json.load(open(tmp_path / "results.json"))["results"]}
    bound = results[("convnet", "conv-bound")]
    assert bound["bitwise"] and bound["median_us"] > 0, bound
    assert ("mlp", "conv-bound") not in results and ("mlp", "torchreplay-capture") in results
    model, make_inputs = bench.MODELS["convnet"][0]()
    convs = sum(isinstance(m, torch.nn.Conv2d) for m in model.modules())
    assert convs > 0 and modes.ConvBound(model, list(make_inputs(0))).steps == convs
