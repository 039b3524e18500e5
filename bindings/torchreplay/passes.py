"""FX passes run on the ATen graph before lowering: the user's pre pass, the built-in passes, the
user's post pass (config.post_grad_custom_pre_pass / post_grad_custom_post_pass, as in torchair)."""
from __future__ import annotations

from typing import Any, Dict, Sequence

import torch
import torch.fx

aten = torch.ops.aten

# Functional "update" ops AOTAutograd leaves for in-place writes into graph inputs, and the
# in-place op that does the same write without copying the whole input.
_INPLACE_OF = {
    aten.index_copy.default: aten.index_copy_.default,
    aten.index_put.default: aten.index_put_.default,
    aten.index_add.default: aten.index_add_.default,
    aten.scatter.src: aten.scatter_.src,
    aten.scatter.value: aten.scatter_.value,
    aten.masked_fill.Scalar: aten.masked_fill_.Scalar,
}


def remove_dead_code(gm: torch.fx.GraphModule) -> None:
    """Drops pure nodes whose results are unused (mutating ops are kept: FX sees them impure)."""
    gm.graph.eliminate_dead_code()


def _is_view(node: torch.fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return bool(schema and schema.returns and schema.returns[0].alias_info is not None
                and not schema.returns[0].alias_info.is_write)


def _read_after(node: torch.fx.Node, position: int, order: Dict[torch.fx.Node, int],
                skip: Sequence[torch.fx.Node]) -> bool:
    """Whether `node`'s memory is read at or after `position` (through views too), other than by
    the nodes in `skip`."""
    for user in node.users:
        if user in skip:
            continue
        if order[user] >= position or (_is_view(user) and _read_after(user, position, order, skip)):
            return True
    return False


def reinplace_input_updates(gm: torch.fx.GraphModule) -> int:
    """`new = index_copy(buf, ...); ...; copy_(buf, new)` -> `index_copy_(buf, ...)`.

    With keep_inference_input_mutations, AOTAutograd expresses a write into an input (a KV cache
    updated in place, a buffer) as a functional op that copies the whole input, and a copy_ back
    at the end: two full copies per call. When nothing reads the input's old value after the
    functional op, the in-place op does the same write and both copies go. Returns how many were
    rewritten."""
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    rewritten = 0
    for copy in list(graph.nodes):
        if copy.op != "call_function" or copy.target is not aten.copy_.default or len(copy.args) != 2:
            continue
        buf, new = copy.args
        if not isinstance(buf, torch.fx.Node) or buf.op != "placeholder" or not isinstance(new, torch.fx.Node):
            continue
        inplace = _INPLACE_OF.get(new.target)
        if inplace is None or not new.args or new.args[0] is not buf or order[new] > order[copy]:
            continue
        if any(a is buf for a in list(new.args[1:]) + list(new.kwargs.values())):
            continue
        if _read_after(buf, order[new], order, skip=(new, copy)):
            continue  # the old value is still needed after the update
        if any(_is_view(u) and new in _users_closure(u) for u in buf.users if u is not new):
            continue  # an argument of the update is a view of the input itself
        new.target = inplace
        copy.replace_all_uses_with(new)
        graph.erase_node(copy)
        rewritten += 1
    return rewritten


def _users_closure(node: torch.fx.Node) -> set:
    seen, todo = set(), [node]
    while todo:
        for u in todo.pop().users:
            if u not in seen:
                seen.add(u)
                todo.append(u)
    return seen


def sink_waits(gm: torch.fx.GraphModule) -> int:
    """Moves the wait of each collective down to the first node that reads its result.

    A trace puts `wait_tensor` right after its collective, so nothing could run while the
    collective is in flight. Moved down, the nodes between run meanwhile: compute overlaps with
    communication (Note [Collective steps] in capture/collective_steps.h). The collectives are
    issued where they were, in the same order on every rank; only waits move. A wait stops before
    any node that writes memory (the process group may still be reading the collective's input)
    and before the output. Returns how many waits moved."""
    wait = getattr(getattr(torch.ops, "_c10d_functional", None), "wait_tensor", None)
    if wait is None:
        return 0
    moved = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not wait.default:
            continue
        at = node.next
        while at.op == "call_function" and node not in at.all_input_nodes:
            schema = getattr(at.target, "_schema", None)
            if schema is None or schema.is_mutable:
                break
            at = at.next
        if at is not node.next:
            at.prepend(node)
            moved += 1
    return moved


BUILTIN_PASSES = (reinplace_input_updates, remove_dead_code, sink_waits)


def run_passes(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], config: Any) -> None:
    if config.post_grad_custom_pre_pass is not None:
        config.post_grad_custom_pre_pass(gm, example_inputs, config)
    for p in BUILTIN_PASSES:
        p(gm)
    if config.post_grad_custom_post_pass is not None:
        config.post_grad_custom_post_pass(gm, example_inputs, config)
    gm.graph.lint()
    gm.recompile()
