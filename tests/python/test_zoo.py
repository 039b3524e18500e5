"""The model zoo through torch.compile, compared exactly with eager over several calls with fresh
inputs, in mode "default" (C++ interpreter) and "reduce-overhead" (capture and replay)."""
import copy
import os
import subprocess
import sys

import pytest
import torch

import torchreplay
from torchreplay import _C
from torchreplay_bench.models import (MLP, ConvBN, CountingModel, DecodeAttention, DemoModel, ElementwiseChain,
                    MmAbsModel, ViewOfInput)
from differential import assert_bitwise, assert_exercised, assert_same, total
from scope_pass import compile_with_scopes

MODES = ["default", "reduce-overhead"]


def backend_for(mode, **ro):
    config = torchreplay.CompilerConfig()
    config.mode = mode
    for k, v in ro.items():
        setattr(config.reduce_overhead, k, v)
    return torchreplay.get_backend(compiler_config=config)


def run_against_eager(model, make_inputs, mode, calls=5, dynamic=False, grad=False):
    """Compiles a copy of `model` and checks outputs, and the state (buffers) both models end
    with, against eager on identical inputs, and that torchreplay ran the graph (and replayed it,
    in "reduce-overhead"); returns the backend for its stats."""
    eager = model
    compiled_model = copy.deepcopy(model)
    backend = backend_for(mode)
    compiled = torch.compile(compiled_model, backend=backend, dynamic=dynamic)
    ctx = torch.enable_grad() if grad else torch.no_grad()
    with ctx:
        for i in range(calls):
            inputs = make_inputs(i)
            want = eager(*copy.deepcopy(inputs))
            got = compiled(*inputs)
            assert_same(got, want)
            for (name, a), (_, b) in zip(eager.named_buffers(), compiled_model.named_buffers()):
                assert_bitwise(a, b, f"buffer {name} differs after call {i}")
    assert_exercised(backend, require_replay=mode == "reduce-overhead")
    return backend


@pytest.mark.parametrize("mode", MODES)
def test_demo_model_static(mode):
    b = run_against_eager(DemoModel().eval(), lambda i: (torch.randn(100, 128), 100), mode)
    if mode == "reduce-overhead":
        assert total(b, "captures") == 1 and total(b, "replays") == 4  # 5 calls: warm-up, then replays


@pytest.mark.parametrize("mode", MODES)
def test_demo_model_dynamic(mode):
    sizes = [100, 64, 100, 64, 37]
    b = run_against_eager(DemoModel().eval(), lambda i: (torch.randn(sizes[i], 128), 3 + i % 2), mode,
                          dynamic=True)
    if mode == "reduce-overhead":
        # one graph; keys differ by batch size only (the scale is bound per call): 100 and 64 are
        # warmed up, then captured on their second call and replayed once; 37 only warms up
        assert (total(b, "captures"), total(b, "replays"), total(b, "warmups")) == (2, 2, 3)


@pytest.mark.parametrize("mode", MODES)
def test_demo_model_mark_static(mode):
    inp = torch.randn(100, 128)
    torch._dynamo.mark_static(inp)

    def make(i):
        return (inp + i, 100)

    run_against_eager(DemoModel().eval(), make, mode, dynamic=True)


@pytest.mark.parametrize("mode", MODES)
def test_a_model_with_two_outputs_sharing_a_matmul(mode):
    run_against_eager(MmAbsModel(), lambda i: (torch.randn(3, 3),), mode)


@pytest.mark.parametrize("mode", MODES)
def test_mlp(mode):
    b = run_against_eager(MLP().eval(), lambda i: (torch.randn(1, 64),), mode)
    if mode == "reduce-overhead":
        log = [c for s in b.stats() for c in s["capture_log"]]
        assert log and log[0]["functional_steps"] == 0 and log[0]["out_variant_steps"] >= 5


@pytest.mark.parametrize("mode", MODES)
def test_conv_bn_eval(mode):
    run_against_eager(ConvBN().eval(), lambda i: (torch.randn(2, 3, 8, 8),), mode)


@pytest.mark.parametrize("mode", MODES)
def test_buffer_mutation_in_forward(mode):
    run_against_eager(CountingModel(), lambda i: (torch.randn(4),), mode)


@pytest.mark.parametrize("mode", MODES)
def test_view_of_input_output(mode):
    model = ViewOfInput()
    compiled = torch.compile(model, backend=backend_for(mode))
    for _ in range(4):
        x = torch.randn(3, 5)
        t, s = compiled(x)
        assert_bitwise(t, x.t())
        assert_bitwise(s, x.sum(0))
        assert t.data_ptr() == x.data_ptr()  # a view of the caller's tensor, not of a copy
        x.add_(1)
        assert_bitwise(t, x.t())


@pytest.mark.parametrize("mode", MODES)
def test_decode_attention_kv_cache(mode):
    b = run_against_eager(DecodeAttention().eval(), lambda i: (torch.randn(1, 1, 64), torch.tensor([i])),
                          mode, calls=8)
    if mode == "reduce-overhead":
        assert total(b, "replays") >= 6
        # The cache writes are done in place (reinplace_input_updates): the arena holds no copy
        # of the 2 x 8 KiB caches, only the small activations.
        log = b.stats()[0]["capture_log"][0]
        assert log["arena_bytes"] < 4096, log


@pytest.mark.parametrize("mode", MODES)
def test_elementwise_chain(mode):
    run_against_eager(ElementwiseChain(), lambda i: (torch.randn(16),), mode)


@pytest.mark.parametrize("mode", MODES)
def test_training_steps_match_eager(mode):
    torch.manual_seed(0)
    eager = MLP(16, 32)
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, backend=backend_for(mode))
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
    opt_c = torch.optim.SGD(compiled_model.parameters(), lr=0.1)
    for step in range(4):
        x, y = torch.randn(8, 16), torch.randn(8, 16)
        losses = []
        for model, fn, opt in ((eager, eager, opt_e), (compiled_model, compiled, opt_c)):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(fn(x), y)
            loss.backward()
            losses.append(loss.detach())
        assert_bitwise(losses[0], losses[1], f"step={step}")
        for (n, p), (_, q) in zip(eager.named_parameters(), compiled_model.named_parameters()):
            assert_bitwise(p.grad, q.grad, f"grad of {n} at step {step}")
        opt_e.step()
        opt_c.step()


def test_named_backend_with_options():
    model = MLP().eval()
    compiled = torch.compile(model, backend="torchreplay",
                             options={"mode": "reduce-overhead", "warmup_iters": 2})
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(1, 64)
            assert_bitwise(compiled(x), model(x))
    assert any((s["calls"], s["warmups"], s["replays"]) == (4, 2, 2) for s in torchreplay.stats())


def test_config_rejects_bad_values():
    config = torchreplay.CompilerConfig()
    with pytest.raises(ValueError, match="mode"):
        config.mode = "max-speed"
    with pytest.raises(AttributeError, match="no setting"):
        config.reduce_overhead.warmup = 3
    with pytest.raises(ValueError):
        config.reduce_overhead.capture_limit = -1
    with pytest.raises(ValueError, match="unknown option"):
        torchreplay.CompilerConfig.from_options({"nope.nope": 1})
    with pytest.raises(ValueError, match="cudagraph_trees"):
        config.reduce_overhead.cuda_graphs = "cudagraphs"


def test_cuda_graphs_setting_reaches_the_engine():
    """PyTorch's cudagraph trees by default: the engine's own CUDA graphs stay off unless asked for
    (their use on a GPU is in test_cuda.py)."""
    from torchreplay.engines import engine_options

    config = torchreplay.CompilerConfig()
    assert config.reduce_overhead.cuda_graphs == "cudagraph_trees"
    assert engine_options(config, "g").cuda_graphs is False
    assert _C.EngineOptions().cuda_graphs is False
    mine = torchreplay.CompilerConfig.from_options({"cuda_graphs": "torchreplay"})
    assert engine_options(mine, "g").cuda_graphs is True
    assert engine_options(mine, "g", mode="default").mode == "default"


def test_custom_passes_take_effect():
    """A pre pass rewrites abs into neg and a post pass sees it; the result follows the rewrite."""
    seen = []

    def pre(gm, example_inputs, config):
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target == torch.ops.aten.abs.default:
                node.target = torch.ops.aten.neg.default

    def post(gm, example_inputs, config):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")

    config = torchreplay.CompilerConfig()
    config.mode = "reduce-overhead"
    config.post_grad_custom_pre_pass = pre
    config.post_grad_custom_post_pass = post
    compiled = torch.compile(MmAbsModel(), backend=torchreplay.get_backend(compiler_config=config))
    for _ in range(3):
        x = torch.randn(3, 3)
        add, sub = compiled(x)
        mm = x @ x
        assert_bitwise(add, -mm + 1)
        assert_bitwise(sub, x - mm)
    assert "aten.neg.default" in seen and "aten.abs.default" not in seen


@pytest.mark.parametrize("kind", ["txt", "py"])
def test_graph_dump_written_and_readable(tmp_path, kind):
    torch._dynamo.reset()  # a static graph (earlier MmAbsModel shapes would make it dynamic)
    config = torchreplay.CompilerConfig()
    config.debug.graph_dump.type = kind
    config.debug.graph_dump.path = str(tmp_path)
    compiled = torch.compile(MmAbsModel(), backend=torchreplay.get_backend(compiler_config=config))
    x = torch.randn(3, 3)
    compiled(x)
    files = list(tmp_path.iterdir())
    assert len(files) == 1 and files[0].suffix == "." + kind
    text = files[0].read_text()
    if kind == "txt":
        assert "aten::mm" in text and "aten::abs" in text and "return" in text
    else:  # runnable Python that computes the same thing
        scope = {}
        exec(compile(text, str(files[0]), "exec"), scope)
        add, sub = scope["forward"](None, x)
        assert_bitwise(add, torch.abs(x @ x) + 1)
        assert_bitwise(sub, x - x @ x)


def test_dot_dump_of_the_graph(tmp_path):
    config = torchreplay.CompilerConfig()
    config.mode = "reduce-overhead"
    config.debug.graph_dump.type = "dot"
    config.debug.graph_dump.path = str(tmp_path)
    compiled = torch.compile(MmAbsModel(), backend=torchreplay.get_backend(compiler_config=config))
    for _ in range(3):
        compiled(torch.randn(3, 3))
    names = sorted(p.name for p in tmp_path.iterdir())
    stem = names[0].rsplit(".", 1)[0]                      # torchreplay_gN.inference
    # The graph as DOT and as text, and the captured key's tape plan (no CUDA graph on the CPU).
    assert names == [stem + ".dot", stem + ".key0.txt", stem + ".txt"]
    plan = (tmp_path / (stem + ".key0.txt")).read_text()
    # each node with its out= step (which GEMM kernel: timed at capture, so not asserted)
    assert "%mm = aten::mm: out= " in plan and "%abs_1 = aten::abs: out= " in plan and "arena: " in plan, plan
    dot = (tmp_path / names[0]).read_text()
    assert dot.startswith(f'digraph "{stem}"')
    assert '"mm" -> "abs_1";' in dot and '"mm" -> "sub";' in dot


@pytest.mark.parametrize("mode", MODES)
def test_scope_ops_keep_their_place_and_results_on_cpu(tmp_path, mode):
    model = MmAbsModel()
    compiled = compile_with_scopes(model, mode, "txt", tmp_path)
    for _ in range(4):
        x = torch.randn(3, 3)
        assert_same(compiled(x), model(x))
    (dump,) = [p for p in tmp_path.iterdir() if ".key" not in p.name]  # not a captured key's plan
    ops = [line.split("= ")[1].split("(")[0] for line in dump.read_text().splitlines() if "= " in line]
    # Dead-code elimination kept them, in the order the pass put them.
    assert ops[:5] == ["torchreplay::scope_enter", "aten::mm", "aten::abs", "torchreplay::record",
                       "torchreplay::scope_exit"], ops
    # The wait comes before anything outside the scope reads mm or abs (add reads abs, sub mm).
    wait = ops.index("torchreplay::wait")
    assert wait == ops.index("torchreplay::scope_exit") + 1 and wait < ops.index("aten::add.Tensor"), ops


def test_unsupported_op_error_names_node_and_run_eagerly_fallback():
    from torchreplay.lowering import LoweringError, lower

    gm = torch.fx.symbolic_trace(lambda x: torch.nn.functional.relu(x) * 2)
    with pytest.raises(LoweringError, match="relu"):
        lower(gm, [torch.randn(2)])
    # With debug.run_eagerly the graph runs in Python and still matches eager.
    config = torchreplay.CompilerConfig()
    config.debug.run_eagerly = True
    compiled = torch.compile(MLP().eval(), backend=torchreplay.get_backend(compiler_config=config))
    x = torch.randn(1, 64)
    with torch.no_grad():
        assert_bitwise(compiled(x), compiled._orig_mod(x))


def test_the_example_script_matches_eager():
    script = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "test_compile.py")
    for dynamic in ("0", "1"):
        out = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=300,
                             env=dict(os.environ, TEST_COMPILE_DYNAMIC=dynamic))
        assert out.returncode == 0, out.stderr[-3000:]
        assert "matches eager: True" in out.stdout


def test_llama_decode_step_with_static_cache():
    """The real-world case: a tiny Llama decode step (grouped-query attention) writing a static KV
    cache, eager's bits (Note [transformers' attention as eager runs it]; needs transformers,
    skipped without it)."""
    pytest.importorskip("transformers")
    from torchreplay_bench.models import MODELS

    torch.manual_seed(0)
    model, make_inputs = MODELS["llama_decode"][0]()
    eager = copy.deepcopy(model)
    backend = backend_for("reduce-overhead")
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        for i in range(6):
            want = eager(*make_inputs(i))
            got = compiled(*make_inputs(i))
            assert_bitwise(got, want, f"call {i} against eager")
        assert_bitwise(dict(model.named_buffers()), dict(eager.named_buffers()), "the caches")
    stats = backend.stats()
    assert total(backend, "replays") >= 4 and total(backend, "eager_fallbacks") == 0
    # Cache writes are in place: the arena holds activations, not copies of the caches.
    assert max(c["arena_bytes"] for s in stats for c in s["capture_log"]) < 64 * 1024


@pytest.mark.parametrize("warmup_iters", [0, 1, 2, 3])
def test_precapture_through_torch_compile_largest_first(warmup_iters):
    # However many warm-ups the config asks for, precapture leaves every shape captured: the
    # calls after it are all replays.
    backend = backend_for("reduce-overhead", warmup_iters=warmup_iters)
    model = MLP(d=16, hidden=32).eval()
    compiled = torch.compile(model, backend=backend, dynamic=True)
    with torch.no_grad():
        # (batch sizes other than 16: Dynamo would give a batch equal to the width one symbol)
        torchreplay.precapture(compiled, [(torch.randn(n, 16),) for n in (3, 24, 12)])
        (before,) = backend.stats()
        keys = [c["key"] for c in before["capture_log"]]
        assert len(keys) == 3 and "(24, 16)" in keys[0] and "(12, 16)" in keys[1] and "(3, 16)" in keys[2], keys
        assert before["captures"] == 3 and before["warmups"] == 3 * max(warmup_iters, 1)
        # warmup_iters + 1 calls per shape (with no warm-up of its own, one more, a replay).
        assert before["calls"] == 3 * (warmup_iters + 1 if warmup_iters else 2)
        for n in (3, 12, 24, 3):
            x = torch.randn(n, 16)
            assert_bitwise(compiled(x), model(x))
        (after,) = backend.stats()
        assert after["replays"] == before["replays"] + 4
        assert (after["captures"], after["warmups"], after["eager_fallbacks"]) == (3, before["warmups"], 0)
        # Shapes already captured take one call each.
        torchreplay.precapture(compiled, [(torch.randn(n, 16),) for n in (3, 24)])
        assert backend.stats()[0]["calls"] == after["calls"] + 2


def test_precapture_of_a_captured_model_is_its_engines():
    config = torchreplay.CompilerConfig()
    config.mode = "reduce-overhead"
    config.reduce_overhead.warmup_iters = 2
    model = CountingModel()
    step = torchreplay.capture(model, (torch.randn(4),), config=config)
    torchreplay.precapture(step, [(torch.randn(4),)])
    s = step.stats()
    assert (s["calls"], s["warmups"], s["captures"]) == (3, 2, 1)
    assert_bitwise(model.count, torch.full((4,), 3.0))   # three real calls' updates
    step(torch.randn(4))
    assert step.stats()["replays"] == s["replays"] + 1 and step.stats()["warmups"] == 2
