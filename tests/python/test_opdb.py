"""PyTorch's op database as a differential test, in a slice that fits CI (the whole sweep, one
command with a summary table: .venv/bin/python tests/python/opdb_sweep.py). Each case runs an op's
sample inputs through torch.compile (reduce-overhead) and torchreplay.capture, warm-up, capture and
replays on fresh inputs, and compares outputs and written arguments with eager bit for bit
(opdb_sweep.py says how). No case may be wrong or an error; one that replays nothing must say why."""
import pytest
import torch
import torch.nn.functional as F

import opdb_sweep
import torchreplay
from configs import backend, config
from differential import assert_bitwise

# Ops that were wrong, raised, or could not be captured, and an even spread of the rest.
REGRESSIONS = ["nn.functional.binary_cross_entropy", "linalg.qr", "qr", "arange", "linspace", "logspace",
               "nn.functional.triplet_margin_with_distance_loss", "masked_select", "rand_like", "bernoulli",
               "full", "zeros_like", "nn.functional.silu", "sigmoid", "norm", "addcdiv", "empty_like",
               "nn.functional.interpolate", "std_mean", "max_pool2d_with_indices_backward", "index_put",
               "scatter_reduce", "nn.functional.embedding", "cumsum", "sort"]
SPREAD = 29   # every SPREAD-th op of the database besides
DTYPES = ["float32", "bfloat16", "int64"]


def _slice():
    db = opdb_sweep.op_db()
    names = set(REGRESSIONS) | {op.name for op in db[::SPREAD]}
    return [op for op in db if op.name in names]


OPS = _slice()


@pytest.fixture(scope="module", autouse=True)
def _quiet():
    import logging
    logger = logging.getLogger("torchreplay")
    saved = torch.get_num_threads(), logger.level, torchreplay._C.log_level()
    opdb_sweep.logging_off()
    yield
    torch.set_num_threads(saved[0])
    logger.setLevel(saved[1])
    torchreplay._C.set_log_level(saved[2])


@pytest.mark.parametrize("op", OPS, ids=lambda op: op.name + (f".{op.variant_test_name}" if op.variant_test_name else ""))
def test_op_database_slice(op):
    cases = []
    for dtype in DTYPES:
        for case, calls in opdb_sweep.cases_for(op, dtype, 2, opdb_sweep.ENTRIES):
            opdb_sweep.run_case(case, calls)
            cases.append(case)
    bad = [f"{c.name}: {c.outcome} {c.detail}" for c in cases if c.outcome in ("wrong", "error")]
    assert not bad, "\n".join(bad)
    unexplained = [c.name for c in cases if c.outcome == "not-replayed" and not c.detail]
    assert not unexplained, unexplained


def test_the_slice_replays_most_cases_bitwise():
    """Not a slice of cases that all ran eagerly: most are captured, replayed and bitwise."""
    assert len(OPS) >= 40
    done = []
    for op in OPS[:12]:
        for case, calls in opdb_sweep.cases_for(op, "float32", 1, opdb_sweep.ENTRIES):
            done.append(opdb_sweep.run_case(case, calls).outcome)
    assert done.count("bitwise") >= 0.6 * len(done), done


@pytest.mark.parametrize("entry", ["compile", "capture"])
def test_an_out_kernel_that_uses_its_output_as_scratch_runs_functionally(entry):
    """binary_cross_entropy.out writes the unreduced loss into its 0-dim output before reducing:
    in the arena it wrote over its neighbours and every replay returned a wrong loss."""
    fn = lambda x, t: F.binary_cross_entropy(x, t) * 2   # noqa: E731
    b = backend()
    with torch.no_grad():
        step = (torch.compile(fn, backend=b, dynamic=False) if entry == "compile" else
                torchreplay.capture(fn, (torch.rand(5), torch.rand(5)), config=config()))
        for _ in range(4):
            x, t = torch.rand(5).clamp(0.05, 0.95), torch.rand(5)
            assert_bitwise(step(x, t), fn(x, t))
    assert (step.stats() if entry == "capture" else b.stats()[0])["replays"] == 3


@pytest.mark.parametrize("mode", ["reduced", "complete", "r"])
@pytest.mark.parametrize("shape", [(5, 5), (5, 2), (2, 5), (3, 5, 0), (4, 6, 3)])
def test_qr_in_every_mode_and_shape(mode, shape):
    """linalg_qr.out picks its path by whether R shares Q's storage: on one arena storage it wrote
    Q from R (wrong values) or asserted (Q.size(-1) == m). Every arena buffer is now a storage of
    its own (Note [One storage per buffer])."""
    fn = lambda a: torch.linalg.qr(a, mode=mode)   # noqa: E731
    b = backend()
    with torch.no_grad():
        step = torch.compile(fn, backend=b, dynamic=False)
        for _ in range(4):
            a = torch.randn(shape)
            got, want = step(a), fn(a)
            assert_bitwise(got, want)
    assert b.stats()[0]["replays"] == 3
