"""Note [Close numerics]'s GRU layers as one call, torchreplay::gru_sequence."""
from __future__ import annotations

import operator

import torch

from .state import Rewrite

aten = torch.ops.aten


def rewrite_grus(r: Rewrite) -> None:
    """A GRU the export kept whole for it (rnn.fused_gru) as torchreplay::gru_sequence, one
    call a layer (Note [GRU steps] in capture/kernels/recurrent.h), on its weights transposed once; h_n
    the layers' last states stacked. A GRU whose weights are not known at capture stays
    eager's op."""
    for node in list(r.graph.nodes):
        if node.op != "call_function" or node.target != torch.ops.torchreplay.eager_gru.input:
            continue
        x, hx, params, has_biases, layers, _dropout, _train, bidirectional, batch_first = node.args
        per = 4 if has_biases else 2
        weights = [r.tensor(p) for p in params]
        vals = node.meta.get("val")
        if bidirectional or len(params) != per * layers or any(w is None for w in weights) or \
                not isinstance(vals, (tuple, list)) or not all(u.target is operator.getitem for u in node.users):
            continue
        r.freeze(*(params[per * layer + i] for layer in range(layers) for i in (0, 1)))  # the weights
        states = []
        with r.graph.inserting_before(node):
            for layer in range(layers):
                w_ih, w_hh = weights[per * layer:per * layer + 2]
                b_ih, b_hh = params[per * layer + 2:per * (layer + 1)] if has_biases else (None, None)
                h0 = r.graph.call_function(aten.select.int, (hx, 0, layer))
                h0.meta["val"] = vals[1].select(0, layer)
                seq = r.graph.call_function(torch.ops.torchreplay.gru_sequence.default, (
                    x, h0, r.constant(w_ih.detach().t().contiguous(), "w_ih_kn"), b_ih,
                    r.constant(w_hh.detach().t().contiguous(), "w_hh_kn"), b_hh, batch_first))
                seq.meta["val"] = (vals[0], h0.meta["val"])
                x = r.graph.call_function(operator.getitem, (seq, 0))
                states.append(r.graph.call_function(operator.getitem, (seq, 1)))
                x.meta["val"], states[-1].meta["val"] = seq.meta["val"]
            h_n = r.graph.call_function(aten.stack.default, (states, 0))
            h_n.meta["val"] = vals[1]
        for u in list(node.users):
            u.replace_all_uses_with(x if u.args[1] == 0 else h_n)
            r.graph.erase_node(u)
        r.graph.erase_node(node)
        r.counts["grus_fused"] += 1
