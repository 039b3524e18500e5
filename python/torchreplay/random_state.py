"""The watch on PyTorch's random generators while torchreplay.capture traces a model
(_RandomStateWatch): a model that sets a generator's state while traced is refused, since its
replays would draw other numbers than eager, and the CPU generator is put back as it was."""
from __future__ import annotations

import os
from typing import Any

import torch

from . import _C


class _RandomStateWatch:
    """Sees a model set the state of a random generator while it is traced (torch.manual_seed,
    torch.set_rng_state, a Generator's manual_seed/seed/set_state, also inside fork_rng), and then
    puts the CPU generator back as it was. (Random ops in the model are graph ops, traced on fake
    tensors: they draw nothing while traced.) The calls are seen by a C profile function on this
    thread (Note [Watching the random generators] in bindings/module.cc), counted only when the code
    calling them (past torch's own Python wrappers) is not torch's or torchreplay's: export's own
    bookkeeping is not the model's. A seed no profile function sees (manual_seed called from C, as
    through map or functools.partial, or from another thread) shows in the CPU generator's initial
    seed, compared before and after (not its state: other threads may draw from it meanwhile).
    Python's `random` module is not watched: its values are constants of the trace, as any Python
    value is. With calls=False only the initial seed is compared (a trace through Dynamo, whose
    generated code sets generator states of its own)."""

    _SETTERS = ["manual_seed", "seed", "set_state", "graphsafe_set_state"]

    def __init__(self, calls: bool = True) -> None:
        self._calls = calls

    def __enter__(self) -> "_RandomStateWatch":
        self._state = torch.random.get_rng_state()
        self._seed = torch.initial_seed()
        self._changed = ""
        self._watch = _C.GeneratorWatch(torch.Generator, self._SETTERS, _TORCH_DIR, _PACKAGE_DIR)
        if self._calls:
            self._watch.start()
        return self

    @property
    def touched(self) -> str:
        return (self._watch.touched if self._calls else "") or self._changed

    def check(self) -> None:
        """Raises if the model touched a generator while it was traced."""
        if self.touched:
            raise ValueError(f"torchreplay.capture: the model {self.touched} while it was traced; a capture "
                             "replays the graph's ops, not that (its replays would draw other numbers than "
                             "eager): seed outside the captured model")

    def __exit__(self, *exc: Any) -> None:
        if self._calls:
            self._watch.stop()
        if not self.touched and torch.initial_seed() != self._seed:
            self._changed = "seeded the CPU generator"
        if self.touched:  # else the state is left alone: another thread may be drawing from it
            torch.random.set_rng_state(self._state)


# Calls from code under these are torch's or torchreplay's own, not the model's.
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_PACKAGE_DIR = os.path.dirname(__file__) + os.sep
