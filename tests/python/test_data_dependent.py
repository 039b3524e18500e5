"""Data-dependent ops: nonzero, masked_select, item() and friends run eagerly or replay as eager does.

Compiled with torchreplay's "reduce-overhead" mode against eager, call by call, through the
differential harness (differential.py: outputs, mutated inputs, aliasing, state, replays)."""
import pytest
import torch

from configs import backend
from differential import (  # noqa: F401 (recompile_limits is autouse)
    recompile_limits, CALLS, run, total, gen, rn, ri, assert_same, run_diff)


def _dd_unique(x):
    return torch.unique(x)


def _dd_mutation_then_mask(x):
    x.add_(0.5)
    return x[x > 0.5]


def _dd_item_slice(x, k):
    n = k.item()
    torch._check_is_size(n)
    torch._check(n <= x.shape[0])
    return x[:n] * 2


DD_CASES = [
    pytest.param(lambda x: x[x > 0] * 2, lambda i, g: (rn(g, 12),), id="bool_mask_index"),
    pytest.param(lambda x: torch.nonzero(x > 0.3), lambda i, g: (rn(g, 4, 3),), id="nonzero"),
    pytest.param(_dd_unique, lambda i, g: (ri(g, 0, 6, 12),), id="unique"),
    pytest.param(lambda x: torch.unique(x, return_counts=True), lambda i, g: (ri(g, 0, 6, 12),), id="unique_counts"),
    pytest.param(lambda x, m: torch.masked_select(x, m) + 1, lambda i, g: (rn(g, 3, 4), rn(g, 3, 4) > 0),
                 id="masked_select"),
    pytest.param(lambda x, r: torch.repeat_interleave(x, r, dim=0), lambda i, g: (rn(g, 4, 2), ri(g, 0, 4, 4)),
                 id="repeat_interleave_tensor_repeats"),
    pytest.param(lambda x: torch.where(x > 0), lambda i, g: (rn(g, 3, 4),), id="where_one_arg"),
    pytest.param(lambda x: torch.bincount(x), lambda i, g: (ri(g, 0, 7, 10),), id="bincount"),
    pytest.param(lambda x, w: torch.bincount(x, w, minlength=6), lambda i, g: (ri(g, 0, 8, 10), rn(g, 10)),
                 id="bincount_weights_minlength"),
    pytest.param(lambda x: torch.argwhere(x < 0) * 2, lambda i, g: (rn(g, 3, 3),), id="argwhere"),
    pytest.param(lambda x: x[torch.nonzero(x[:, 0] > 0)[:, 0]].sum(0), lambda i, g: (rn(g, 6, 3),),
                 id="nonzero_then_gather"),
    pytest.param(lambda x: (x[x > 0] ** 2).sum() + x.sum(), lambda i, g: (rn(g, 10),), id="mask_then_reduce"),
    pytest.param(_dd_mutation_then_mask, lambda i, g: (rn(g, 10),), id="mutation_then_mask"),
    pytest.param(lambda x: torch.unique_consecutive(x), lambda i, g: (ri(g, 0, 3, 12),), id="unique_consecutive"),
    # (x * t.item() is rewritten by Dynamo into tensor ops: no host read, no fallback expected)
    pytest.param(lambda x: x * x.sum().item(), lambda i, g: (rn(g, 5),), id="item_scalar_folded_into_tensor_ops"),
    pytest.param(_dd_item_slice, lambda i, g: (rn(g, 6), torch.tensor(i % 4 + 1)), id="item_as_size"),
]


@pytest.mark.parametrize("fn,make_inputs", DD_CASES)
def test_data_dependent(fn, make_inputs, request):
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True, capture_scalar_outputs=True):
        with torch.no_grad():
            b = run_diff(fn, make_inputs, calls=CALLS, seed=50, require_replay=False)
    s = b.stats()
    assert s, "nothing was compiled"
    if "folded" not in request.node.callspec.id:   # documented: data-dependent graphs run eagerly, with a reason
        assert total(b, "eager_fallbacks") > 0 and any(x["fallback_reasons"] for x in s), s


def test_data_dependent_with_backward():
    def fn(x):
        return (x[x > 0] ** 2).sum() + x.sin().sum()

    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        compiled = torch.compile(fn, backend=backend())
        for i in range(CALLS):
            x_c = rn(gen(i), 8).requires_grad_()
            x_e = x_c.detach().clone().requires_grad_()
            got, want = compiled(x_c), fn(x_e)
            assert_same(got, want, what=f"call {i}")
            got.backward()
            want.backward()
            assert_same(x_c.grad, x_e.grad, what=f"call {i}: x.grad")
