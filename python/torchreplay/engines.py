"""What both entry points share: the C++ engine made for a lowered graph (its options from a
CompilerConfig), the process's registry of live engines (stats, precapture), and graph dumps.
torch.compile's backend (backend.py) and torchreplay.capture (captured.py) both build on this
module; neither imports the other.

Ownership: an engine belongs to what calls it (the compiled function, or a Captured); the
registry holds it weakly.
"""
from __future__ import annotations

import logging
import os
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.fx

from . import _C
from .config import CompilerConfig

logger = logging.getLogger("torchreplay")

_all_engines: "weakref.WeakSet[Any]" = weakref.WeakSet()


def engine_options(config: CompilerConfig, name: str, **fields: Any) -> Any:
    """The C++ engine's options for one graph compiled with `config` (plus `fields`)."""
    ro, dump = config.reduce_overhead, config.debug.graph_dump
    options = dict(mode=config.mode, warmup_iters=ro.warmup_iters, capture_limit=ro.capture_limit,
                   cache_limit=ro.cache_limit, clone_outputs=ro.clone_outputs, name=name,
                   dump_dir=os.path.abspath(dump.path) if dump.type in ("txt", "dot") else "",
                   cuda_graphs=ro.cuda_graphs == "torchreplay")
    options.update(fields)
    return _C.EngineOptions(**options)


def new_engine(graph: Any, config: CompilerConfig, name: str, **fields: Any) -> Any:
    """A C++ engine for the lowered `graph`, registered for stats() and precapture()."""
    engine = _C.Engine(graph, engine_options(config, name, **fields))
    _all_engines.add(engine)
    return engine


def dump_graph(config: CompilerConfig, name: str, gm: torch.fx.GraphModule, graph: Optional[Any],
               choices: Optional[Dict[str, Dict[str, Any]]] = None) -> None:
    """Writes the graph as config.debug.graph_dump asks ("txt", "py" or "dot"), if it does; a
    "txt" or "py" dump ends with the kernel numerics "close" chose per node (`choices`), if any."""
    kind = config.debug.graph_dump.type
    if kind is None:
        return
    directory = config.debug.graph_dump.path
    os.makedirs(directory, exist_ok=True)
    if kind == "dot":
        # The IR as text and as a DOT graph. With "txt" or "dot", each captured key follows at
        # capture time (written by the engine): torchreplay_{name}.keyK.txt, the CPU tape's plan,
        # or torchreplay_{name}.keyK.dot, the CUDA graph.
        with open(os.path.join(directory, f"torchreplay_{name}.txt"), "w") as f:
            f.write(str(graph) if graph is not None else str(gm.graph))
    path = os.path.join(directory, f"torchreplay_{name}.{kind}")
    with open(path, "w") as f:
        if kind == "txt":
            f.write(str(graph) if graph is not None else str(gm.graph))
        elif kind == "dot":
            f.write(_fx_to_dot(gm, name))
        else:  # "py": the ATen graph as runnable Python
            f.write(f"# torchreplay graph {name}, mode {config.mode!r}\n")
            f.write("import torch\nfrom math import inf, nan\nfrom torch import device\n")
            f.write(gm.code)
        if choices and kind in ("txt", "py"):
            from .close_numerics import choice_text
            f.write("\n# numerics \"close\": the kernel chosen per node, and the µs of each way timed at capture\n")
            f.writelines(f"#   {node}: {choice_text(c)}\n" for node, c in choices.items())
    logger.info("torchreplay: dumped graph %s to %s", name, path)


def _fx_to_dot(gm: torch.fx.GraphModule, name: str) -> str:
    """The ATen graph in Graphviz DOT: one box per node, an edge per use."""
    def q(s: str) -> str:
        return '"' + s.replace('"', '\\"') + '"'

    lines = [f"digraph {q('torchreplay_' + name)} {{", "  node [shape=box, fontname=monospace];"]
    for node in gm.graph.nodes:
        label = node.name if node.op in ("placeholder", "output") else f"{node.name}\\n{node.target}"
        lines.append(f"  {q(node.name)} [label={q(label)}];")
        for user in node.users:
            lines.append(f"  {q(node.name)} -> {q(user.name)};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def precapture(fn: Callable, input_sets: Sequence[Sequence[Any]]) -> None:
    """Warms up and captures a compiled model for shapes known ahead, largest first (by tensor
    bytes), so that on CUDA (untested) the smaller shapes reuse the largest one's pool memory.

    How many runs make a capture is the engine's to decide (config.reduce_overhead.warmup_iters
    warm-ups, then capture). A model from torchreplay.capture goes straight to its engine's
    precapture. A torch.compile'd model's engines sit behind Dynamo's guards and AOTAutograd's
    wrapper, which only a call of the model passes (and the first call compiles), so each input set
    is called until a call runs no warm-up in any engine: warmup_iters + 1 calls for a new shape,
    the last of them the capture (one more, a replay, when warmup_iters is 0), none past that for a
    shape already captured. These are real calls: in-place updates (KV caches, BN statistics)
    happen once per call. Compile with dynamic=True (or mark dynamic dims) so that all shapes share
    one graph and one pool."""
    if isinstance(fn, _C.Call) and hasattr(fn, "precapture"):  # a Captured: through its engine
        fn.precapture(input_sets)
        return

    def nbytes(inputs: Sequence[Any]) -> int:
        return sum(t.numel() * t.element_size() for t in inputs if isinstance(t, torch.Tensor))

    def warmups() -> Dict[int, int]:
        return {id(e): e.stats()["warmups"] for e in list(_all_engines)}

    for inputs in sorted(input_sets, key=nbytes, reverse=True):
        while True:
            before = warmups()
            fn(*inputs)
            if all(n == before.get(k, 0) for k, n in warmups().items()):
                break


def stats() -> List[Dict[str, Any]]:
    """Stats of every live engine in the process."""
    return [dict(e.stats(), name=e.name) for e in list(_all_engines)]
