"""python -m torchreplay_bench.runtimes end to end on the MLP, at 1 and 2 threads, few rounds: the
table's rows are well formed, the torchreplay rows bitwise equal to eager, and each CPU runtime
compared with (ONNX Runtime, OpenVINO, ExecuTorch) built, close to eager and timed where its
packages are installed (tools/bench-requirements.txt, which tools/bench.sh installs)."""
import importlib.util
import json
import re
import subprocess
import sys

import pytest
import torch

from torchreplay_bench import runtimes
from torchreplay_bench.timing import time_interleaved

MODES = ["eager", "torchreplay-capture", "torchreplay-reduce-overhead", "onnxruntime", "openvino", "executorch"]
THREADS = [1, 2]
CHECK = re.compile(r"bitwise|close \(max abs err \S+, max rel err \S+\)|WRONG \(.+\)|failed to (build|run|check): .+"
                   r"|not installed: .+")
ROW = re.compile(r"^\s*(?P<threads>\d+)  (?P<model>\S+)\s+(?P<mode>\S+)\s+(?P<us>\d+\.\d|-)\s+(?P<iqr>\d+\.\d|-)"
                 r"\s+(?P<ratio>\d+\.\d\dx|-)\s+(?P<build>\d+\.\d\d|-)  (?P<check>.+)$")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One run of the module in a process of its own (it sets torch's and ExecuTorch's threads):
    the table's rows parsed from stdout, and the JSON's rows."""
    out = tmp_path_factory.mktemp("runtimes")
    proc = subprocess.run([sys.executable, "-m", "torchreplay_bench.runtimes", "--models", "mlp",
                           "--modes", ",".join(MODES), "--threads", ",".join(map(str, THREADS)), "--rounds", "2",
                           "--seconds", "0.02", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("threads"))
    table = [line for line in lines[start + 1:] if line.strip() and not line.startswith("wrote ")]
    with open(out / "runtimes.json") as f:
        data = json.load(f)
    return table, data


def test_every_row_is_well_formed(run):
    table, data = run
    assert len(table) == len(MODES) * len(THREADS), table
    seen = set()
    for line in table:
        m = ROW.match(line)
        assert m, f"malformed row: {line!r}"
        assert CHECK.fullmatch(m["check"]), f"unknown check: {line!r}"
        assert m["model"] == "mlp" and m["mode"] in MODES and int(m["threads"]) in THREADS, line
        timed = m["us"] != "-"
        assert timed == (m["ratio"] != "-") == (m["iqr"] != "-"), line
        # only a mode that gave eager's outputs is timed
        assert timed == m["check"].startswith(("bitwise", "close")), line
        seen.add((int(m["threads"]), m["mode"]))
    assert seen == {(t, mode) for t in THREADS for mode in MODES}
    rows = {(r["threads"], r["mode"]): r for r in data["results"]}
    assert set(rows) == seen
    assert data["meta"]["threads"] == THREADS and len(data["meta"]["load_before"]) == 3
    for line in table:
        m = ROW.match(line)
        r = rows[(int(m["threads"]), m["mode"])]
        assert r["check"] == m["check"]
        if "median_us" in r:
            assert m["us"] == f"{r['median_us']:.1f}" and r["vs_eager"] > 0 and r["build_s"] >= 0, r


@pytest.mark.parametrize("threads", THREADS)
def test_torchreplay_rows_are_bitwise_and_timed(run, threads):
    rows = {(r["threads"], r["mode"]): r for r in run[1]["results"]}
    for mode in ("eager", "torchreplay-capture", "torchreplay-reduce-overhead"):
        r = rows[(threads, mode)]
        assert r["check"] == "bitwise" and r["bitwise"] and r["median_us"] > 0, r
    assert rows[(threads, "eager")]["vs_eager"] == 1.0


@pytest.mark.parametrize("mode", ["onnxruntime", "openvino", "executorch"])
def test_each_installed_runtime_is_close_to_eager_and_timed(run, mode):
    missing = [p for p in runtimes.PEERS[mode] if importlib.util.find_spec(p) is None]
    if missing:
        pytest.skip(f"{mode}'s row not checked: {', '.join(missing)} not installed "
                    "(tools/bench-requirements.txt; tools/bench.sh installs it)")
    rows = {(r["threads"], r["mode"]): r for r in run[1]["results"]}
    for threads in THREADS:
        r = rows[(threads, mode)]
        assert r["status"] == "ok" and r["check"].startswith(("bitwise", "close (")), r
        assert r["median_us"] > 0 and r["build_s"] > 0, r


@pytest.mark.parametrize("name", ["audio_conv1d", "lstm_step", "gru_seq16", "embedding_bag"])
def test_the_added_models_capture_bitwise(name):
    """The models the comparison adds to the zoo, through torchreplay.capture and the module's own
    check: bitwise equal to eager, or (the LSTM, whose export decomposes the fused cell) to the
    exported program run eagerly."""
    row, step = runtimes.prepare(name, "torchreplay-capture", threads=1)
    assert step is not None and row["status"] == "ok", row
    assert row["check"] == "bitwise" or row["check"].endswith("; bitwise equal to the exported program's"), row
    with torch.no_grad():  # as the harness times it
        step()


@pytest.mark.parametrize("threads", THREADS)
def test_every_mode_is_timed_on_the_threads_set(threads):
    """The rows at two threads time torch's modes on two threads, as the runtimes beside them
    run on theirs (torch.utils.benchmark.Timer alone sets torch to one thread while it times)."""
    seen = []
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        time_interleaved({"probe": lambda: seen.append(torch.get_num_threads())}, rounds=2, min_run_time=0.002)
    finally:
        torch.set_num_threads(before)
    assert seen and set(seen) == {threads}, sorted(set(seen))
