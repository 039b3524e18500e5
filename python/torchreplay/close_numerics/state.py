"""The one state object of the close rewrite (Note [Close numerics] in __init__.py)."""
from __future__ import annotations

import logging
from typing import Any, Dict, Optional, Sequence

import torch
import torch.fx

from ..fx_views import is_view

logger = logging.getLogger("torchreplay")


def written(node: torch.fx.Node) -> bool:
    """Whether an op of the graph may write `node`'s tensor: a mutable op reads it or a view of
    it (a buffer the forward updates in place is no weight known at capture)."""
    return any(u.op == "call_function" and (
        (isinstance(u.target, torch._ops.OpOverload) and u.target._schema.is_mutable) or (is_view(u) and written(u)))
        for u in node.users)


class Rewrite:
    """The state every rewrite of Note [Close numerics] reads and adds to: the graph, the bound
    tensors' values and names, what was folded into constants (guarded by check_frozen), which
    results may be channels-last, the counts and the choices made by measurement."""

    def __init__(self, gm: torch.fx.GraphModule, bound: Sequence[Any], names: Sequence[str]) -> None:
        self.gm, self.graph = gm, gm.graph
        placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        # the bound tensors the graph does not write: what the rewrites may take as known at capture
        self.value: Dict[torch.fx.Node, torch.Tensor] = {
            p: t for p, t in zip(placeholders, bound) if isinstance(t, torch.Tensor) and not written(p)}
        self.names: Dict[torch.fx.Node, str] = dict(zip(placeholders, names))
        self.frozen: Dict[torch.fx.Node, torch.Tensor] = {}  # placeholders folded into constants
        self.counts: Dict[str, int] = {"batch_norms_folded": 0, "convolutions_onednn": 0, "convolutions_gemm": 0,
                                       "convolutions_depthwise": 0, "convolutions_small_gemm": 0, "post_ops_fused": 0,
                                       "layout_copies": 0, "linears_transposed_once": 0, "linears_small_gemm": 0,
                                       "linears_onednn": 0,
                                       "convolutions_eager": 0, "grus_fused": 0, "results_channels_last": 0,
                                       "means_small_gemm": 0, "scales_folded": 0,
                                       "convolutions_int8": 0, "linears_int8": 0, "weights_dequantized_once": 0,
                                       "quantize_pairs_fused": 0}
        self.channels_last: set = set()  # results that may be channels-last where eager's are not
        self.contiguous: set = set()  # results made contiguous where eager's may be channels-last
        # Per node whose kernel was chosen (by measurement, where "times" has them): the way it
        # took and the µs of each way timed at capture (step.numerics["choices"], by node name)
        self.choices: Dict[torch.fx.Node, Dict[str, Any]] = {}
        self._names = 0

    def chose(self, node: torch.fx.Node, way: str, times: Optional[Dict[str, float]] = None) -> None:
        """`node` takes `way`, chosen from `times` (µs by way; a node timed twice, as a PT2E
        convolution's int8 and fp32 ways, keeps every time)."""
        choice = self.choices.setdefault(node, {"chose": way, "times": {}})
        choice["chose"] = way
        choice["times"].update(times or {})

    def moved(self, old: torch.fx.Node, new: torch.fx.Node) -> None:
        """`new` replaced `old`: the choice made for `old` is `new`'s."""
        if old in self.choices:
            self.choices[new] = self.choices.pop(old)

    def choices_by_name(self) -> Dict[str, Dict[str, Any]]:
        """The choices of the nodes still in the graph, by node name."""
        nodes = set(self.graph.nodes)
        return {n.name: c for n, c in self.choices.items() if n in nodes}

    def tensor(self, node: Any) -> Optional[torch.Tensor]:
        """The value of a placeholder bound to a parameter, buffer or constant, or of a get_attr,
        that the graph does not write (else None: no value known at capture)."""
        if not isinstance(node, torch.fx.Node):
            return None
        if node.op == "get_attr":
            v = getattr(self.gm, node.target, None)
            return v if isinstance(v, torch.Tensor) and not written(node) else None
        return self.value.get(node)

    def constant(self, t: torch.Tensor, hint: str) -> torch.fx.Node:
        name = f"_close_{hint}_{self._names}"
        self._names += 1
        self.gm.register_buffer(name, t, persistent=False)
        return self.graph.get_attr(name)

    def freeze(self, *nodes: Any) -> None:
        for n in nodes:
            if isinstance(n, torch.fx.Node) and n.op == "placeholder" and n in self.value:
                self.frozen[n] = self.value[n]

    def guard(self, every_call: bool = False) -> None:
        """The first step checks that nothing folded into the graph's constants changed since;
        `every_call`: every folded tensor's contents compared on every call (per-channel vectors
        with their copies, the others with their hashes: reading the tensor once)."""
        if not self.frozen:
            return
        nodes = list(self.frozen)
        versions = [-1 if t.is_inference() else t._version for t in self.frozen.values()]
        inference = [self.names.get(n, n.name) for n, t in self.frozen.items() if t.is_inference()]
        if inference and not every_call:
            # An inference tensor has no version counter: a write to it (under inference_mode)
            # is seen only by comparing its contents, so they are compared on every call.
            logger.warning("torchreplay.capture: %d folded tensors are inference tensors (%s%s; the model was made "
                           "under torch.inference_mode()): a write to them moves no version counter, so every call "
                           "compares their contents (%.1f MB); make the model outside inference_mode to skip that",
                           len(inference), ", ".join(inference[:3]), ", ..." if len(inference) > 3 else "",
                           sum(t.nbytes for t in self.frozen.values() if t.is_inference()) / 1e6)
            every_call = True
        # Per-channel vectors (a batch norm's statistics and affine, biases) are also compared with
        # their contents at capture on every call: a train-mode forward updates the statistics
        # without their version counters; their size keeps the comparison a small part of a call.
        # The others' contents are hashed now and compared after a folded parameter was reached
        # through .data (Note [Writes a capture would not see] in patches.py).
        small = [t.dim() <= 1 and t.is_contiguous() for t in self.frozen.values()]
        every = torch.iinfo(torch.int64).min  # check_frozen.cc's kEveryCall
        hashes = [every if every_call else -1] + [0 if s else torch.ops.torchreplay.content_hash(t)
                                                  for s, t in zip(small, self.frozen.values())]
        first = next(n for n in self.graph.nodes if n.op != "placeholder")
        with self.graph.inserting_before(first):
            empty = self.constant(torch.empty(0), "copy") if not all(small) else None
            copies = [self.constant(t.detach().clone(), "copy") if s else empty for s, t in zip(small, self.frozen.values())]
            self.graph.call_function(torch.ops.torchreplay.check_frozen.default,
                                     (nodes, versions, [self.names.get(n, n.name) for n in nodes], copies,
                                      self.constant(torch.tensor(hashes, dtype=torch.int64), "hashes")))
