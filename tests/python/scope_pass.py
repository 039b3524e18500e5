"""A custom FX pass that puts mm and abs on a side stream with torchreplay's multi-stream scope ops
(as torchair's passes do with torch.ops.air.*)."""
import torch

import torchreplay


def side_stream_pass(gm, example_inputs, config):
    """mm and abs on stream_1; the first node after the scope that reads either waits for them."""
    g, record_node, side = gm.graph, None, set()
    for node in list(g.nodes):
        if node.target == torch.ops.aten.mm.default:
            with g.inserting_before(node):
                g.call_function(torch.ops.torchreplay.scope_enter.default, args=(["_user_stream_label"], ["stream_1"]))
            side.add(node)
        if node.target == torch.ops.aten.abs.default:
            side.add(node)
            with g.inserting_after(node):
                record_node = g.call_function(torch.ops.torchreplay.record.default, args=())
            with g.inserting_after(record_node):
                g.call_function(torch.ops.torchreplay.scope_exit.default, args=())
    reader = next(n for n in g.nodes if n not in side and any(a in side for a in n.all_input_nodes))
    with g.inserting_before(reader):
        g.call_function(torch.ops.torchreplay.wait.default, args=([record_node],))


def compile_with_scopes(model, mode, dump_type, dump_path, **reduce_overhead):
    """`model` through torch.compile with the pass above and a graph dump (the backend is the
    compiled function's `backend` attribute)."""
    config = torchreplay.CompilerConfig()
    config.mode = mode
    for k, v in reduce_overhead.items():
        setattr(config.reduce_overhead, k, v)
    config.post_grad_custom_pre_pass = side_stream_pass
    config.debug.graph_dump.type = dump_type
    config.debug.graph_dump.path = str(dump_path)
    backend = torchreplay.get_backend(compiler_config=config)
    compiled = torch.compile(model, backend=backend)
    compiled.backend = backend
    return compiled
