"""Views in FX graphs of ATen ops: whether a node is a view, the tensor a chain of views starts
from, every node downstream of one. Shared by the graph passes (passes.py, foreach_passes.py) and
torchreplay.capture's export (export.py)."""
from __future__ import annotations

import torch.fx


def is_view(node: torch.fx.Node) -> bool:
    """Whether the op returns a view of an argument it does not write."""
    schema = getattr(node.target, "_schema", None)
    return bool(schema and schema.returns and schema.returns[0].alias_info is not None
                and not schema.returns[0].alias_info.is_write)


def root(n: torch.fx.Node) -> torch.fx.Node:
    """The tensor a chain of views starts from."""
    while is_view(n) and n.args and isinstance(n.args[0], torch.fx.Node):
        n = n.args[0]
    return n


def users_closure(node: torch.fx.Node) -> set:
    seen, todo = set(), [node]
    while todo:
        for u in todo.pop().users:
            if u not in seen:
                seen.add(u)
                todo.append(u)
    return seen
