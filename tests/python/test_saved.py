"""torchreplay.save and the C++ loader (torchreplay/torchreplay.h): a program saved from a capture
and loaded by the C++ loader gives bitwise the captured model's outputs, call after call, its
buffers (KV caches) live in the loaded program, and what it was traced for is checked per call.
The loader itself is fuzzed in torchreplay/format_test.cc; examples/replay_saved runs a file from C++.
"""
import copy
import os
import subprocess

import pytest
import torch

import torchreplay
from differential import assert_bitwise
from torchreplay_bench.models import MODELS, DemoModel

# examples/replay_saved: Bazel's, or (tools/cmake_check.sh) the one built against the CMake package.
BIN = os.environ.get("TORCHREPLAY_EXAMPLE_BIN") or \
    os.path.join(os.path.dirname(__file__), "..", "..", "bazel-bin", "examples", "replay_saved")


def _config():
    config = torchreplay.CompilerConfig()
    config.mode = "reduce-overhead"
    return config


@pytest.mark.parametrize("name", ["mlp", "demo", "attention_decode", "convnet", "chain64", "llama_decode"])
def test_loaded_program_is_bitwise_the_capture(name, tmp_path):
    if name == "llama_decode":
        pytest.importorskip("transformers")
    factory, _ = MODELS[name]
    torch.manual_seed(0)
    model, make_inputs = factory()
    torch.manual_seed(0)
    reference, _ = factory()  # the same model with buffers of its own (the capture writes the model's)
    with torch.no_grad():
        step = torchreplay.capture(model, make_inputs(0), config=_config())
        torchreplay.save(step, tmp_path / "m.trp")
        program = torchreplay.load(tmp_path / "m.trp")
        for i in range(6):
            args = make_inputs(i)
            want, got = step(*args), program(*args)
            want = list(want) if isinstance(want, (tuple, list)) else [want]
            assert len(got) == len(want), name
            for g, w in zip(got, want):
                assert_bitwise(g, w, f"name={name}, i={i}")
            eager = reference(*args)
            eager = eager if isinstance(eager, torch.Tensor) else eager[0]
            assert_bitwise(got[0], eager, f"{name} call {i}: against eager")
    s = program.stats()
    assert s["captures"] == 1 and s["replays"] == 5, s
    for state in program.state_names:  # the loaded program's buffers moved as the model's did
        tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        assert_bitwise(program.state(state), tensors[state].detach(), f"state {state}")   # a plain tensor


def test_buffers_live_in_the_loaded_program_and_reset(tmp_path):
    torch.manual_seed(0)
    model, make_inputs = MODELS["attention_decode"][0]()
    with torch.no_grad():
        torchreplay.save(torchreplay.capture(model, make_inputs(0), config=_config()), tmp_path / "a.trp")
        program = torchreplay.load(tmp_path / "a.trp")
        assert program.argument_names == ["x", "pos"]
        assert set(program.state_names) >= {"k_cache", "v_cache", "qkv.weight"}
        steps = [make_inputs(i) for i in range(3)]
        firsts = [program(*args)[0].clone() for args in steps]
        assert program.state("k_cache")[0, :, :3].abs().sum() > 0
        program.state("k_cache").zero_()
        program.state("v_cache").zero_()
        again = [program(*args)[0].clone() for args in steps]
    for a, b in zip(firsts, again):
        assert_bitwise(a, b)  # reset caches: the same three steps again
    with pytest.raises(KeyError, match="no parameter, buffer or constant named 'nope'"):
        program.state("nope")


def test_loaded_program_checks_what_the_trace_assumed(tmp_path):
    torch.manual_seed(0)
    model = DemoModel().eval()
    with torch.no_grad():
        torchreplay.save(torchreplay.capture(model, (torch.randn(100, 128), 100), config=_config()), tmp_path / "d.trp")
        program = torchreplay.load(tmp_path / "d.trp")
        x = torch.randn(100, 128)
        assert_bitwise(program(x, 100)[0], model(x, 100))
        with pytest.raises(ValueError, match="argument 1 is 7, but the graph was captured with 100"):
            program(x, 7)
        with pytest.raises(ValueError, match="argument 0 has size 50 in dim 0"):
            program(torch.randn(50, 128), 100)
        with pytest.raises(ValueError, match="takes 2 arguments, got 1"):
            program(x)
        with pytest.raises(ValueError, match="dtype"):
            program(x.double(), 100)
        with pytest.raises(ValueError, match=r"argument 0 has strides \(1, 100\), but the graph was traced for "
                                             r"strides \(128, 1\)"):   # Note [Traced strides]
            program(torch.randn(128, 100).t(), 100)
        assert_bitwise(program(x[:, :1].expand(100, 128).contiguous(), 100)[0],
                       model(x[:, :1].expand(100, 128).contiguous(), 100))


class _Refusing(torch.nn.Module):
    """Ops whose kernels refuse values: one_hot (RuntimeError), cholesky (LinAlgError), index_select
    (IndexError)."""

    def forward(self, classes, a, x, index):
        return (torch.nn.functional.one_hot(classes, 4) * 2, torch.linalg.cholesky(a) * 2,
                x.index_select(0, index) * 2)


def test_a_loaded_program_raises_a_kernels_error_as_eager_does(tmp_path):
    """Note [Kernel errors keep their type]: a kernel's error out of a loaded program is the
    exception eager raises; a call's own mistakes (arity, sizes) are ValueErrors."""
    torch.manual_seed(0)
    good = (torch.tensor([0, 3]), torch.eye(3) * 2, torch.randn(5, 2), torch.tensor([1, 4]))
    torchreplay.save(torchreplay.capture(_Refusing(), good), tmp_path / "refusing.trp")
    program = torchreplay.load(tmp_path / "refusing.trp")
    for i in range(3):
        for got, want in zip(program(*good), _Refusing()(*good)):
            assert_bitwise(got, want, f"call {i}")
    assert program.stats()["replays"] == 2, program.stats()
    bad = {0: torch.tensor([0, 9]), 1: -torch.eye(3), 3: torch.tensor([1, 7])}
    for k, value in bad.items():
        args = list(good)
        args[k] = value
        with pytest.raises(Exception) as eager:
            _Refusing()(*args)
        with pytest.raises(type(eager.value)) as loaded:
            program(*args)
        assert type(loaded.value) is type(eager.value), (k, loaded.value)
    with pytest.raises(ValueError, match="takes 4 arguments, got 3"):
        program(*good[:3])


def test_save_refuses_what_a_file_cannot_hold_and_load_refuses_other_files(tmp_path):
    with pytest.raises(TypeError, match="torchreplay.capture"):
        torchreplay.save(torch.nn.Linear(2, 2), tmp_path / "x.trp")
    (tmp_path / "zip.trp").write_bytes(b"PK\x03\x04not a program")
    with pytest.raises(ValueError, match="not a torchreplay program"):
        torchreplay.load(tmp_path / "zip.trp")
    with pytest.raises(ValueError, match="cannot open"):
        torchreplay.load(tmp_path / "missing.trp")
    model = torch.nn.Linear(4, 4).eval()
    with torch.no_grad():
        torchreplay.save(torchreplay.capture(model, (torch.randn(1, 4),), config=_config()), tmp_path / "l.trp")
    data = (tmp_path / "l.trp").read_bytes()
    (tmp_path / "cut.trp").write_bytes(data[:-10])
    with pytest.raises(ValueError, match="truncated"):
        torchreplay.load(tmp_path / "cut.trp")


@pytest.mark.skipif(not os.path.exists(BIN), reason="examples/replay_saved is built by bazel build //... "
                    "(or tools/cmake_check.sh)")
def test_the_cpp_example_runs_a_saved_model_without_python(tmp_path):
    torch.manual_seed(0)
    model, make_inputs = MODELS["attention_decode"][0]()
    reference = copy.deepcopy(model)
    with torch.no_grad():
        torchreplay.save(torchreplay.capture(model, make_inputs(0), config=_config()), tmp_path / "a.trp")
    out = subprocess.run([BIN, str(tmp_path / "a.trp"), "4"], capture_output=True, text=True, timeout=120,
                         env={"PATH": os.environ.get("PATH", "")})
    assert out.returncode == 0, out.stderr
    sums = {line.split(":")[0]: float.fromhex(line.split(": ")[-1]) for line in out.stdout.splitlines()
            if line.startswith("call ")}
    # The example feeds arange-filled arguments: step i gets (arange(64) / 64 + i, i).
    with torch.no_grad():
        for i in range(4):
            x = (torch.arange(64, dtype=torch.float32) / 64 + i).view(1, 1, 64)
            want = reference(x, torch.tensor([i]))
            assert sums[f"call {i}"] == want.sum().item(), (i, out.stdout)  # exactly: printed as %a
    assert "replays 3" in out.stdout, out.stdout


@pytest.mark.parametrize("dynamic", [False, True])
def test_a_program_of_many_arguments_without_stride_checks_loads(dynamic, tmp_path):
    """A dynamic capture's stride checks of contiguous arguments, and a static capture's of 0-d
    tensors, hold no strides: the file's count of them is checked against their smallest size."""
    def fn(a, b, c, d):
        return a * 2 + b.sum() + c.sum() + d

    args = (torch.randn(2, 3), torch.randn(3, 4, 5), torch.randn(4), torch.tensor(1.5)) if dynamic else \
        (torch.tensor(1.0), torch.tensor(2.0), torch.tensor(3.0), torch.tensor(4.0))
    with torch.no_grad():
        step = torchreplay.capture(fn, args, config=_config(), dynamic=dynamic)
        torchreplay.save(step, tmp_path / "many.trp")
        program = torchreplay.load(tmp_path / "many.trp")
        for i in range(3):
            assert_bitwise(program(*args)[0], fn(*args), f"call {i}")
    assert program.stats()["replays"] == 2
