"""FX passes run on the ATen graph before lowering: the user's pre pass, the built-in passes, the
user's post pass (seed 004's post_grad_custom_pre_pass / post_grad_custom_post_pass)."""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.fx


def remove_dead_code(gm: torch.fx.GraphModule) -> None:
    """Drops pure nodes whose results are unused (mutating ops are kept: FX sees them impure)."""
    gm.graph.eliminate_dead_code()


BUILTIN_PASSES = (remove_dead_code,)


def run_passes(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], config: Any) -> None:
    if config.post_grad_custom_pre_pass is not None:
        config.post_grad_custom_pre_pass(gm, example_inputs, config)
    for p in BUILTIN_PASSES:
        p(gm)
    if config.post_grad_custom_post_pass is not None:
        config.post_grad_custom_post_pass(gm, example_inputs, config)
    gm.graph.lint()
    gm.recompile()
