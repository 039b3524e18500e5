import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Every test compiles from scratch (Dynamo's caches and recompile limits are global)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
