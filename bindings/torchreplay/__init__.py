"""torchreplay: captured-graph replay for PyTorch ("reduce-overhead").

    import torch, torchreplay
    config = torchreplay.CompilerConfig()
    config.mode = "reduce-overhead"
    model = torch.compile(model, backend=torchreplay.get_backend(compiler_config=config))

or torch.compile(model, backend="torchreplay", options={"mode": "reduce-overhead"}); or, with no
Dynamo frame per call, step = torchreplay.capture(model, example_args, config=config).
"""
import logging as _logging

import torch as _torch  # loads libtorch before the extension

from . import _C
from .backend import Backend, get_backend, named_backend, precapture, stats
from .captured import Captured, capture
from .config import CompilerConfig
from .lowering import LoweringError

__all__ = ["Backend", "Captured", "CompilerConfig", "LoweringError", "capture", "get_backend", "precapture", "stats",
           "set_log_level", "cuda_available"]

_logging.getLogger("torchreplay").addHandler(_logging.NullHandler())


def set_log_level(level: int) -> None:
    """C++ log level: 0 debug, 1 info, 2 warning (default), 3 error. Same as TORCHREPLAY_LOG_LEVEL."""
    _C.set_log_level(level)


def cuda_available() -> bool:
    """True when this build has the CUDA backend and a CUDA device is present. (The CUDA backend
    has never run on a GPU: it is untested.)"""
    return bool(_C.built_with_cuda()) and _torch.cuda.is_available()


def _register() -> None:
    from torch._dynamo.backends.registry import _BACKENDS, register_backend

    if "torchreplay" not in _BACKENDS:
        register_backend(name="torchreplay")(named_backend)
    # The multi-stream scope ops (registered by _C) return nothing a later node uses; they must
    # survive dead-code elimination.
    import torch.fx

    for op in ("scope_enter", "scope_exit", "record", "wait"):
        torch.fx.node.has_side_effect(getattr(_torch.ops.torchreplay, op).default)


_register()
