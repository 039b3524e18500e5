"""The call path: what runs between the caller and the C++ engine on each call."""
import sys

import torch
import torch.nn as nn

import torchreplay
from configs import backend
from differential import assert_bitwise
from torchreplay import _C




def python_frames_of_one_call(fn, *args):
    """The files of the Python functions entered while fn(*args) runs."""
    files = []

    def prof(frame, event, arg):
        if event == "call":
            files.append(frame.f_code.co_filename)

    sys.setprofile(prof)
    try:
        fn(*args)
    finally:
        sys.setprofile(None)
    return files


def test_inference_graph_is_called_straight_into_cpp():
    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    b = backend()
    compiled = torch.compile(model, backend=b)
    x = torch.randn(2, 8)
    with torch.no_grad():
        for _ in range(3):
            assert_bitwise(compiled(x), model(x))
        files = python_frames_of_one_call(compiled, x)
    assert list(b.call_paths.values()) == ["direct"]
    assert b.stats()[0]["replays"] >= 1
    # No frame of torchreplay's Python package, nor AOTAutograd's runtime wrappers, runs per call
    # (Dynamo's guards call two AOTAutograd utilities about saved-tensor hooks: not ours).
    ours = [f for f in files if "torchreplay" in f or "runtime_wrappers" in f or "aot_autograd.py" in f]
    assert ours == [], ours


def test_training_graph_is_a_training_call_without_python_between_the_engines():
    """Note [Training calls]: Dynamo calls a TrainingCall; the autograd node it makes runs the
    backward engine (no Python frame of AOTAutograd's in either); gradients are eager's bits."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    eager = nn.Linear(4, 3)
    eager.load_state_dict(model.state_dict())
    b = backend()
    compiled = torch.compile(model, backend=b)
    x = torch.randn(2, 4)
    for _ in range(3):
        out = compiled(x)
        assert out.grad_fn.name() == "TorchreplayBackward"
        out.sum().backward()
        eager(x).sum().backward()
        assert_bitwise(model.weight.grad, eager.weight.grad)
        assert_bitwise(model.bias.grad, eager.bias.grad)
    assert list(b.call_paths.values()) == ["direct"], b.call_paths
    assert {e.name.split(".")[1] for e in b.engines} == {"forward", "backward"}
    assert all(s["replays"] >= 2 for s in b.stats()), b.stats()


def test_direct_call_bumps_versions_of_mutated_inputs():
    """As AOTAutograd's wrapper does: an input the graph writes to has its version bumped."""
    torch._dynamo.reset()

    def f(x, y):
        x.mul_(2)
        return x + y

    b = backend()
    compiled = torch.compile(f, backend=b)
    with torch.no_grad():
        for _ in range(4):
            x, y = torch.randn(5), torch.randn(5)
            xe = x.clone()
            v0 = x._version
            out = compiled(x, y)
            assert_bitwise(out, f(xe, y))
            assert_bitwise(x, xe)
            assert x._version > v0 and y._version == 0
    assert list(b.call_paths.values()) == ["direct"]


def test_aliasing_outputs_are_autograd_views_as_in_eager():
    """Outputs that alias an input come back as AOTAutograd's wrapper gives them: the input
    itself, or a view whose ._base is the input. An output that is a view of another output
    shares its memory; after a replay it is no autograd view of it (._base is None), with or
    without the wrapper (AOTAutograd calls such outputs non-aliasing under no_grad)."""
    torch._dynamo.reset()

    def f(x):
        y = x * 2
        return x.view(-1), x, y, y.t(), x[1:].t()

    b = backend()
    compiled = torch.compile(f, backend=b)
    x = torch.randn(2, 3)
    with torch.no_grad():
        for _ in range(4):
            v, same, y, yt, d = compiled(x)
            assert v._base is x and same is x
            assert_bitwise(y, x * 2)
            assert_bitwise(yt, y.t())   # shares y's memory (not an autograd view of it: below)
            assert d._base is x
            assert_bitwise(d, x[1:].t())
            y.add_(1)                                   # a write through one output shows in its view
            assert_bitwise(yt, y.t())
    assert list(b.call_paths.values()) == ["direct"]


def test_detached_inputs_are_given_back_detached_by_the_direct_call():
    """x.detach() shares x's memory and version counter but is no view of it in eager (._base is
    None): the direct call gives back x detached, as AOTAutograd's wrapper does (the step after
    a training graph's break at backward is often just `return loss.detach()`)."""
    torch._dynamo.reset()
    b = backend()
    compiled = torch.compile(lambda x: (x.detach(), x.detach() + 1), backend=b)
    x = torch.randn(3, requires_grad=True)   # as a loss after its backward: no output requires grad
    for _ in range(3):
        d, y = compiled(x)
        want = x.detach()
        assert d._base is None and d.data_ptr() == x.data_ptr() and not d.requires_grad
        assert d._version == want._version
        assert_bitwise(y, want + 1)
        with torch.no_grad():
            x.add_(1)
        assert d._version == x._version  # shares x's version counter, as eager's does
    assert list(b.call_paths.values()) == ["direct"], b.call_paths
    assert sum(s["replays"] for s in b.stats()) >= 1


def test_an_alias_output_keeps_the_aot_wrapper():
    """aten.alias of an input (no view, no detach): the graph keeps AOTAutograd's wrapper."""
    torch._dynamo.reset()
    b = backend()
    compiled = torch.compile(lambda x: (torch.ops.aten.alias(x), x + 1), backend=b)
    x = torch.randn(3)
    with torch.no_grad():
        for _ in range(3):
            a, y = compiled(x)
    assert a.data_ptr() == x.data_ptr()
    assert_bitwise(y, x + 1)
    paths = list(b.call_paths.values())
    assert len(paths) == 1 and "alias" in paths[0], b.call_paths
    assert sum(s["replays"] for s in b.stats()) >= 1


def test_dynamic_graphs_are_called_directly_and_mark_outputs_dynamic_as_aot_does():
    """A dynamic=True graph goes straight to C++ too. Its outputs carry the dims Dynamo should
    treat as dynamic when they reach a later compile (`_dynamo_weak_dynamic_indices`), added to
    what an output that is an input already held, exactly as AOTAutograd's wrapper sets them."""
    def f(x, s):
        y = torch.sin(x) * s
        return y, x, y.sum(0), s * 2

    def run(backend_):
        torch._dynamo.reset()
        compiled = torch.compile(f, backend=backend_, dynamic=True)
        got = []
        with torch.no_grad():
            for i in range(4):
                x = torch.randn(3, 2)
                x._dynamo_weak_dynamic_indices = {1}
                outs = compiled(x, i + 2)
                got.append(([getattr(o, "_dynamo_weak_dynamic_indices", None) for o in outs[:3]],
                            outs[1] is x, outs[3]))
                assert_bitwise(outs[0], torch.sin(x) * (i + 2))
        return got

    b = backend()
    ours = run(b)
    assert list(b.call_paths.values()) == ["direct"] and b.stats()[0]["replays"] >= 1
    theirs = run("aot_eager")
    assert ours == theirs and ours[0][0] == [{0, 1}, {1}, {0}], ours


def test_call_object_checks_its_arguments():
    torch._dynamo.reset()
    b = backend()
    compiled = torch.compile(lambda x: torch.relu(x) + 1, backend=b)
    x = torch.randn(3)
    with torch.no_grad():
        compiled(x)
    engine = b.engines[0]
    call = _C.Call(engine, num_outputs=1)
    assert_bitwise(call(x)[0], torch.relu(x) + 1)
    for bad, what in [((), "takes 1 arguments"), ((x, x), "takes 1 arguments"),
                      ((x.double(),), "dtype"), ((x.view(1, 3),), "1-d"), ((3,), "expected a tensor")]:
        try:
            call(*bad)
        except (TypeError, ValueError) as e:
            assert what in str(e), (what, str(e))
        else:
            raise AssertionError(f"no error for {what}")
    try:
        _C.Call(engine, mutated=[1])
    except ValueError as e:
        assert "out of range" in str(e)
    else:
        raise AssertionError("mutated index out of range accepted")
