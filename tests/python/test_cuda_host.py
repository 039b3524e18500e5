"""The CUDA paths' host-side wiring, without a GPU (the device runs are in test_cuda.py).

Graphs whose tensors are on a CUDA device go to PyTorch's cudagraph trees by default (Note [CUDA
graphs] in backend.py). Here the device check is told that a CPU graph is on CUDA: PyTorch's own
skip check (check_for_skip) then refuses it for its CPU tensors, exactly the path a real CUDA graph
with a CPU op takes. What must hold: the engine runs op by op (mode default: nothing captured by
torchreplay), results stay bitwise, the reason is in stats() and call_paths, and a training
graph's backward follows its forward.
"""
import pytest
import torch

import torchreplay
from torchreplay import backend as backend_module
from differential import assert_bitwise


@pytest.fixture
def seen_as_cuda(monkeypatch):
    monkeypatch.setattr(backend_module, "_on_cuda", lambda gm: True)


def _compiled(model, **options):
    config = torchreplay.CompilerConfig.from_options(dict(mode="reduce-overhead", **options))
    backend = torchreplay.get_backend(compiler_config=config)
    torch._dynamo.reset()
    return torch.compile(model, backend=backend), backend


def test_cuda_graph_skipped_by_the_trees_runs_op_by_op(seen_as_cuda):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()).eval()
    compiled, backend = _compiled(model)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(2, 8)
            assert_bitwise(compiled(x), model(x))
    (s,) = backend.stats()
    assert s["cuda_graphs"].startswith("not captured (run op by op): ") and "cpu" in s["cuda_graphs"]
    assert (s["calls"], s["captures"], s["replays"]) == (4, 0, 0)
    assert s["cuda_graph_calls"] == 0
    assert backend.call_paths == {
        next(iter(backend.call_paths)): "AOTAutograd wrapper: CUDA graphs by PyTorch's cudagraph trees "
                                        "(config.reduce_overhead.cuda_graphs)"}


def test_training_graph_backward_follows_its_forward(seen_as_cuda):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    reference = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    reference.load_state_dict(model.state_dict())
    compiled, backend = _compiled(model)
    for _ in range(3):
        x = torch.randn(4, 8)
        compiled(x).sum().backward()
        reference(x).sum().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert_bitwise(p.grad, q.grad)
    by_kind = {s["name"].split(".")[1]: s for s in backend.stats()}
    assert set(by_kind) == {"forward", "backward"}
    assert "cpu" in by_kind["forward"]["cuda_graphs"]
    assert by_kind["backward"]["cuda_graphs"].startswith("not captured (run op by op): ")
    assert all(s["captures"] == 0 and s["calls"] == 3 for s in by_kind.values())


def test_own_cuda_graphs_are_opt_in_and_cpu_graphs_untouched():
    """Without CUDA tensors nothing of the CUDA paths applies, whichever the setting."""
    model = torch.nn.Linear(4, 4).eval()
    for setting in ("cudagraph_trees", "torchreplay"):
        compiled, backend = _compiled(model, cuda_graphs=setting)
        with torch.no_grad():
            for _ in range(3):
                x = torch.randn(1, 4)
                assert_bitwise(compiled(x), model(x))
        (s,) = backend.stats()
        assert "cuda_graphs" not in s and (s["calls"], s["captures"], s["replays"]) == (3, 1, 2)


def test_compiled_optimizer_step_with_list_writes(seen_as_cuda):
    """A compiled foreach Adam: reinplace_foreach writes its state through list arguments, which
    the trees' mutation finder must read (the step's written inputs are all static: parameters,
    state), and PyTorch's skip check then refuses the CPU graph; the step matches aot_eager's."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 4)) for _ in range(2)]
    same = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p, q in zip(params, same):
        p.grad = torch.randn(4, 4)
        q.grad = p.grad.clone()
    ours, ref = torch.optim.Adam(params, foreach=True), torch.optim.Adam(same, foreach=True)
    config = torchreplay.CompilerConfig.from_options({"mode": "reduce-overhead"})
    backend = torchreplay.get_backend(compiler_config=config)
    torch._dynamo.reset()
    step = torch.compile(ours.step, backend=backend)
    ref_step = torch.compile(ref.step, backend="aot_eager")
    for _ in range(3):
        step()
        ref_step()
    for p, q in zip(params, same):
        assert_bitwise(p, q)
    reasons = [s["cuda_graphs"] for s in backend.stats()]
    assert reasons and all(r.startswith("not captured (run op by op): ") for r in reasons), reasons
    assert not any("mutated inputs" in r for r in reasons), reasons
