import logging
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))


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
