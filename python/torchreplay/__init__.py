"""torchreplay: captured-graph replay for PyTorch ("reduce-overhead").

    import torch, torchreplay
    config = torchreplay.CompilerConfig()
    config.mode = "reduce-overhead"
    model = torch.compile(model, backend=torchreplay.get_backend(compiler_config=config))

or torch.compile(model, backend="torchreplay", options={"mode": "reduce-overhead"}); or, with no
Dynamo frame per call, step = torchreplay.capture(model, example_args, config=config).
"""
import logging as _logging
import os as _os

import torch as _torch  # loads libtorch before the extension

from . import _C
from .backend import Backend, get_backend, named_backend
from .captured import Captured, capture
from .config import CompilerConfig
from .engines import precapture, stats
from .lowering import LoweringError
from .patches import install as _install_patches
from .saved import load, save

__all__ = ["Backend", "Captured", "CompilerConfig", "LoweringError", "capture", "get_backend", "load", "precapture", "save", "stats",
           "set_log_level", "cuda_available"]

_LEVELS = (_logging.DEBUG, _logging.INFO, _logging.WARNING, _logging.ERROR)


def set_log_level(level: int) -> None:
    """The level of the "torchreplay" logger: 0 debug, 1 info (every capture), 2 warning (the
    default), 3 error. Same as TORCHREPLAY_LOG_LEVEL=level, TORCH_LOGS="torchreplay" (info) or
    logging.getLogger("torchreplay").setLevel(...)."""
    if level not in range(4):
        raise ValueError("torchreplay: log level must be 0 (debug), 1 (info), 2 (warning) or 3 (error)")
    _logging.getLogger("torchreplay").setLevel(_LEVELS[level])


def _setup_logging() -> None:
    # Note [One log] (bindings/module.cc): one logger, registered with torch._logging so that
    # TORCH_LOGS and torch._logging.set_logs reach it; set up as torch sets up its own (a stream
    # handler of torch's format, no propagation) unless torch does it: TORCH_LOGS="torchreplay"
    # imports this package from torch's own log set-up, which then adds the handler itself.
    import sys

    from torch._logging import _internal

    log = _logging.getLogger("torchreplay")
    _internal.register_log("torchreplay", "torchreplay")
    frame, inside_torch_setup = sys._getframe(), False
    while frame is not None and not inside_torch_setup:
        inside_torch_setup = frame.f_code is _internal._init_logs.__code__
        frame = frame.f_back
    if not inside_torch_setup and not any(_internal._is_torch_handler(h) for h in log.handlers):
        _internal._setup_handlers(_logging.StreamHandler, log)
        log.propagate = False
    level = _os.environ.get("TORCHREPLAY_LOG_LEVEL")
    if level is not None:
        try:
            set_log_level(min(max(int(level), 0), 3))
        except ValueError:
            raise ValueError(f"torchreplay: TORCHREPLAY_LOG_LEVEL={level!r}: want 0 (debug) ... 3 (error)") from None


def cuda_available() -> bool:
    """True when this build has the CUDA backend and a CUDA device is present. (The CUDA backend
    has never run on a GPU: it is untested.)"""
    return bool(_C.built_with_cuda()) and _torch.cuda.is_available()


def _register() -> None:
    from torch._dynamo.backends.registry import _BACKENDS, register_backend

    if "torchreplay" not in _BACKENDS:
        register_backend(name="torchreplay")(named_backend)
    # The multi-stream scope ops and check_frozen (registered by _C) return nothing a later node
    # uses; they must survive dead-code elimination.
    import torch.fx

    for op in ("scope_enter", "scope_exit", "record", "wait", "check_frozen"):
        torch.fx.node.has_side_effect(getattr(_torch.ops.torchreplay, op).default)


_install_patches()  # every import-time patch of PyTorch, once (patches.py)
_setup_logging()
_register()
