"""torchreplay.save and torchreplay.load: a torchreplay.capture result as a .trp file (Note [The
.trp format] in torchreplay/format.h), for torchreplay::Load in a C++ program with no Python, and
such a file loaded back through the same C++ loader."""
from __future__ import annotations

import os
from typing import Any, Optional

from . import _C
from .captured import Captured
from .config import CompilerConfig
from .engines import engine_options


def save(captured: Captured, path: Any) -> None:
    """Writes a torchreplay.capture result to `path` as a .trp file (Note [The .trp format] in
    torchreplay/format.h): its graph, weights and buffers, and what its trace assumed, for
    torchreplay::Load in a C++ program (torchreplay/torchreplay.h) with no Python. The C++ program
    takes the call's arguments flattened (Program::ArgumentNames) and returns the outputs flattened.
    Only the capture's own trace is saved: with dynamic=True, sizes it does not hold for (0 and 1
    where it was traced with more) are refused by the loaded program. CPU programs only."""
    if not isinstance(captured, Captured):
        raise TypeError(f"torchreplay.save: want what torchreplay.capture returned, got {type(captured).__name__}")
    if getattr(captured, "numerics", {}).get("numerics") == "close":
        raise NotImplementedError("torchreplay.save: this capture was rewritten for numerics 'close' (weights folded "
                                  "and packed at capture, some in oneDNN's layout, which a .trp file does not hold); "
                                  "save a capture made with the default numerics 'bitwise'")
    same, _ = captured._trace.identity_checks()
    if same:  # Note [Arguments passed twice]: a loaded program could not tell
        i, j = same[0]
        raise NotImplementedError(f"torchreplay.save: the capture was traced with arguments {i} and {j} one tensor, "
                                  "so its graph reads one of them; capture the model with distinct tensors to save it")
    if captured._trace.size_exprs:
        raise NotImplementedError("torchreplay.save: the trace relates its sizes by expressions only Python checks "
                                  f"({', '.join(map(str, captured._trace.size_exprs))}); capture with dynamic=False")
    kinds, names = [], []
    for described in captured._bound_names:  # "parameter 'fc.weight'"
        kind, _, name = described.partition(" ")
        kinds.append(kind)
        names.append(name.strip("'"))
    _C.save_program(captured, os.fspath(path), kinds, names)


def load(path: Any, config: Optional[CompilerConfig] = None) -> Any:
    """A .trp file loaded by the C++ loader, exactly as torchreplay::Load in a C++ program loads
    it, callable from Python with the flattened arguments (to check a file before shipping it).
    `config`: the engine's settings (default: reduce-overhead)."""
    options = engine_options(config, "graph") if config is not None else None
    return _C.load_program(os.fspath(path), options)
