import logging
import os
import sys
import warnings

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))


def pytest_configure(config):
    """TORCHREPLAY_TEST_THREADS=n: the session runs at n intra-op threads instead of the machine's
    default (tools/test.sh runs the differential slice so at two more counts: Note [Ambient state])."""
    threads = os.environ.get("TORCHREPLAY_TEST_THREADS")
    if threads:
        torch.set_num_threads(int(threads))


def pytest_report_header(config):
    return f"torch intra-op threads: {torch.get_num_threads()}"


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Every test compiles from scratch (Dynamo's caches and recompile limits are global), with
    Dynamo's config as it found it: torch.compile(dynamic=True) patches the global config for
    the duration of a call, and calls racing in threads can leave the patch in place."""
    saved = torch._dynamo.config.save_config()
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    torch._dynamo.config.load_config(saved)


def _thread_state():
    return {"grad mode": torch.is_grad_enabled(), "inference mode": torch.is_inference_mode_enabled(),
            "default dtype": torch.get_default_dtype(),
            "deterministic algorithms": torch.are_deterministic_algorithms_enabled(),
            "matmul precision": _matmul_precision()}


def _matmul_precision():
    # Process-wide; torchao's quantize_ configs set "high" (set_inductor_config=True, their default).
    return (torch.get_float32_matmul_precision(), torch.backends.mkldnn.matmul.fp32_precision,
            torch.backends.cuda.matmul.fp32_precision)


@pytest.fixture(autouse=True)
def _state_put_back():
    """Each test leaves the modes Dynamo guards on (and the process's matmul precision, a part of
    a capture's key) as it found them. A mode left changed on the main
    thread (grad mode is per thread) makes a later test's worker threads, which start with the
    defaults, fail the guards of what the main thread compiled and compile again, racing the other
    workers (Dynamo's FX-tracing flag is process-wide): test_threads.py failed so once. A change
    is reported as a warning naming the test, and put back (all but an inference mode left
    entered, which only its own guard can leave)."""
    before = _thread_state()
    yield
    after = _thread_state()
    if after == before:
        return
    torch.set_grad_enabled(before["grad mode"])
    torch.set_default_dtype(before["default dtype"])
    torch.use_deterministic_algorithms(before["deterministic algorithms"])
    generic, mkldnn, cuda = before["matmul precision"]
    torch.set_float32_matmul_precision(generic)
    torch.backends.mkldnn.matmul.fp32_precision, torch.backends.cuda.matmul.fp32_precision = mkldnn, cuda
    changed = {k: (before[k], after[k]) for k in before if before[k] != after[k]}
    warnings.warn(f"the test left {changed} changed", stacklevel=1)


@pytest.fixture
def replay_log(caplog):
    """caplog for the "torchreplay" logger, which does not propagate to the root logger (Note [One
    log]): its records, C++ engines' included, reach caplog through a handler of its own."""
    log = logging.getLogger("torchreplay")
    log.addHandler(caplog.handler)
    try:
        yield caplog
    finally:
        log.removeHandler(caplog.handler)
