"""Differential fuzz: random ATen graphs replayed by the engine are bitwise equal to running the
same ops eagerly, over several calls with fresh inputs and a shape change back and forth, at the
session's thread count (CI runs this file at 1, 2 and 3 threads: tools/test.sh). One graph in ten
has long rows (fuzz_graphs.py), one in three takes its first input as a transposed view, and one
in four warms up and captures under torch.inference_mode() and replays outside it (one more in
four the other way round).

CI runs TORCHREPLAY_FUZZ_GRAPHS graphs (default 1000); set it higher for a longer run, e.g.
TORCHREPLAY_FUZZ_GRAPHS=20000 tools/test.sh -k fuzz.
"""
import os

import pytest
import torch

from differential import assert_bitwise, bitwise_diff
from fuzz_graphs import C, make_inputs, make_program
from torchreplay import _C

NUM_GRAPHS = int(os.environ.get("TORCHREPLAY_FUZZ_GRAPHS", "1000"))
CHUNKS = 10
ROWS = [5, 5, 3, 5, 3, 3]   # shape change back and forth
LONG_COLS = (12000, 65600)  # 3 or 5 rows: one to two grains of 32768 elements; rows over 64k elements


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_random_graphs_replay_bitwise_equal_to_eager(chunk):
    per_chunk = (NUM_GRAPHS + CHUNKS - 1) // CHUNKS
    for seed in range(chunk * per_chunk, min(NUM_GRAPHS, (chunk + 1) * per_chunk)):
        cols = LONG_COLS[seed // 10 % 2] if seed % 10 == 7 else C
        permuted = seed % 3 == 2
        inference = {1: (True, False), 3: (False, True)}.get(seed % 4, (False, False))  # capture, replay
        prog = make_program(seed, num_ops=6 + seed % 7, cols=cols)
        engine = _C.Engine(prog.graph, _C.EngineOptions(warmup_iters=seed % 2, name=f"fuzz{seed}"))
        gen = torch.Generator().manual_seed(seed)
        w = torch.randn(C, C, generator=gen)
        w_ref = w.clone()
        for call, r in enumerate(ROWS):
            inputs = make_inputs(gen, r, w, cols=cols, permuted=permuted)
            ref_inputs = [t.clone() if isinstance(t, torch.Tensor) else t for t in inputs]
            ref_inputs[2] = w_ref
            with torch.inference_mode(inference[call >= 3]):  # calls 0-2 warm up and capture key 5
                want = prog.eager(ref_inputs)
                got = engine.run(list(inputs))
            assert len(got) == len(want)
            for i, (g, e) in enumerate(zip(got, want)):
                d = bitwise_diff(g, e, f"seed {seed} call {call} output {i}")
                assert d is None, f"{d}\n{prog.graph}"
            for i in (0, 1):   # inputs the graph may mutate
                assert_bitwise(inputs[i], ref_inputs[i], f"seed {seed} call {call} input {i}")
        stats = engine.stats()
        assert stats["captures"] == 2, (seed, stats)    # one per shape key
        assert stats["eager_fallbacks"] == 0, (seed, stats["fallback_reasons"])
        # Keys 5 and 3 each: one eager (recording) run, then capture; the other 4 calls replay.
        assert (stats["warmups"], stats["replays"]) == (2, 4), (seed, stats)


def test_fuzz_covers_at_least_30_ops():
    ops = set()
    for seed in range(300):
        ops |= make_program(seed, num_ops=6 + seed % 7).ops_used
    assert len(ops) >= 30, sorted(ops)
