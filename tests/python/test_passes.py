"""The built-in FX passes, on hand-built ATen graphs: what they rewrite, what they must leave."""
import torch
import torch.fx

from differential import assert_bitwise
from torchreplay.passes import reinplace_input_updates

aten = torch.ops.aten


def kv_graph(read_old_after_update: bool, view_before: bool = False) -> torch.fx.GraphModule:
    g = torch.fx.Graph()
    buf, x, i = g.placeholder("buf"), g.placeholder("x"), g.placeholder("i")
    view = g.call_function(aten.t.default, (buf,)) if view_before else None
    new = g.call_function(aten.index_copy.default, (buf, 0, i, x))
    out = g.call_function(aten.mul.Tensor, (new, 2))
    if read_old_after_update:
        out = g.call_function(aten.add.Tensor, (out, buf))           # the old value, after the update
    if view is not None:
        out = g.call_function(aten.add.Tensor, (out, g.call_function(aten.t.default, (view,))))
    g.call_function(aten.copy_.default, (buf, new))
    g.output((out,))
    return torch.fx.GraphModule(torch.nn.Module(), g)


def run(gm, buf):
    x, i = torch.arange(8.0).view(2, 4), torch.tensor([3, 1])
    out = gm(buf, x, i)[0]
    return out, buf


def test_update_then_copy_back_becomes_in_place():
    gm = kv_graph(read_old_after_update=False)
    want_out, want_buf = run(gm, torch.ones(5, 4))
    assert reinplace_input_updates(gm) == 1
    gm.recompile()
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert aten.index_copy_.default in targets and aten.copy_.default not in targets
    got_out, got_buf = run(gm, torch.ones(5, 4))
    assert_bitwise(got_out, want_out)
    assert_bitwise(got_buf, want_buf)


def test_left_alone_when_the_old_value_is_read_after_the_update():
    for kwargs in ({"read_old_after_update": True}, {"read_old_after_update": False, "view_before": True}):
        gm = kv_graph(**kwargs)
        want_out, want_buf = run(gm, torch.ones(5, 4))
        assert reinplace_input_updates(gm) == 0, kwargs
        gm.recompile()
        got_out, got_buf = run(gm, torch.ones(5, 4))
        assert_bitwise(got_out, want_out)
        assert_bitwise(got_buf, want_buf)
