"""CUDA graphs on a GPU, against eager: torchreplay's own CUDA graphs (EngineOptions.cuda_graphs,
config.reduce_overhead.cuda_graphs = "torchreplay"; engine-level tests below) and the default,
PyTorch's cudagraph trees around the engine (torch.compile tests at the end).

Every test needs a CUDA device and a build with the CUDA backend; elsewhere the module is skipped
with the reason. tools/gpu_check.sh runs it on a GPU machine. The host-side parts are tested
without a GPU in capture/cuda/cuda_plan_test.cc and test_cuda_host.py.
"""
import re
import threading

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import torchreplay
from torchreplay import _C
from torchreplay.lowering import lower

if not _C.built_with_cuda():
    pytest.skip("torchreplay was built without its CUDA backend", allow_module_level=True)
if not torch.cuda.is_available():
    pytest.skip("no CUDA device here (torch.cuda.is_available() is False); "
                "tools/gpu_check.sh runs these tests on a GPU machine", allow_module_level=True)

from differential import assert_bitwise, assert_close_not_bitwise, bitwise_diff, engine_for as _engine_for, run  # noqa: E402
from fuzz_graphs import C, make_inputs, make_program  # noqa: E402
from scope_pass import compile_with_scopes  # noqa: E402

DEV = "cuda"


def engine_for(fn, example_inputs, static=(), **opts):
    """An engine capturing with torchreplay's own CUDA graphs (off by default)."""
    return _engine_for(fn, example_inputs, static, cuda_graphs=True, **opts)


def own_options(**opts):
    return _C.EngineOptions(cuda_graphs=True, **opts)


# ------------------------------------------------------------------------------ differential

@pytest.mark.parametrize("chunk", range(4))
def test_random_graphs_on_cuda_bitwise_equal_to_eager(chunk):
    rows = [5, 5, 3, 5, 3, 3]
    for seed in range(chunk * 50, (chunk + 1) * 50):
        prog = make_program(seed, num_ops=6 + seed % 7, device=DEV)
        engine = _C.Engine(prog.graph, own_options(warmup_iters=seed % 2, name=f"cuda{seed}"))
        gen = torch.Generator().manual_seed(seed)
        w = torch.randn(C, C, generator=gen).to(DEV)
        w_ref = w.clone()
        for call, r in enumerate(rows):
            inputs = make_inputs(gen, r, w, device=DEV)
            ref_inputs = [t.clone() if isinstance(t, torch.Tensor) else t for t in inputs]
            ref_inputs[2] = w_ref
            want = prog.eager(ref_inputs)
            got = engine.run(list(inputs))
            assert len(got) == len(want), f"seed {seed} call {call}"
            for i, (g, e) in enumerate(zip(got, want)):
                d = bitwise_diff(g, e, f"seed {seed} call {call} output {i}")
                assert d is None, f"{d}\n{prog.graph}"
            for i in (0, 1):
                assert_bitwise(inputs[i], ref_inputs[i], f"seed {seed} call {call} input {i}")
        s = engine.stats()
        assert (s["captures"], s["eager_fallbacks"]) == (2, 0), (seed, s["fallback_reasons"])


# ------------------------------------------------------------------------------ semantics

def test_keys_change_and_come_back_one_capture_each():
    e = engine_for(lambda x: torch.relu(x) * 2, [torch.randn(4, 4, device=DEV)])
    for shape in [(4, 4), (4, 4), (8, 4), (8, 4), (4, 4), (8, 4)]:
        x = torch.randn(shape, device=DEV)
        assert_bitwise(run(e, x)[0], torch.relu(x) * 2)
    s = e.stats()
    assert (s["captures"], s["replays"]) == (2, 4)
    assert "sizes (4, 4) -> (8, 4)" in s["capture_log"][1]["reason"]


def test_static_input_moved_is_recaptured():
    w = torch.randn(4, 4, device=DEV)
    e = engine_for(lambda x, w: x @ w.t(), [torch.randn(2, 4, device=DEV), w], static=[1])
    x = torch.randn(2, 4, device=DEV)
    for _ in range(3):
        assert_bitwise(run(e, x, w)[0], x @ w.t())
    w2 = torch.randn(4, 4, device=DEV)
    for _ in range(3):  # a warm-up of the moved weight, its capture, a replay
        assert_bitwise(run(e, x, w2)[0], x @ w2.t())
    assert_bitwise(run(e, x, w)[0], x @ w.t())  # and back: never the stale capture
    log = e.stats()["capture_log"]
    assert len(log) == 2 and "static input 1" in log[1]["reason"] and "moved" in log[1]["reason"]


def test_mutated_inputs_hold_what_eager_leaves():
    def step(cache, pos, kv, x):
        cache.index_copy_(0, pos, kv)
        x.mul_(2)
        return cache.sum(0) + x

    shapes = [torch.zeros(8, 4, device=DEV), torch.tensor([0], device=DEV),
              torch.randn(1, 4, device=DEV), torch.randn(4, device=DEV)]
    e = engine_for(step, [t.clone() for t in shapes])
    cache, cache_ref = torch.zeros(8, 4, device=DEV), torch.zeros(8, 4, device=DEV)
    for i in range(6):
        pos = torch.tensor([i], device=DEV)
        kv = torch.randn(1, 4, device=DEV)
        x = torch.randn(4, device=DEV)
        x_ref = x.clone()
        got = run(e, cache, pos, kv, x)[0]
        want = step(cache_ref, pos, kv, x_ref)
        assert_bitwise(got, want)
        assert_bitwise(cache, cache_ref)
        assert_bitwise(x, x_ref)
    assert e.stats()["replays"] >= 4


def test_stale_output_raises_and_clone_outputs_keeps_them():
    e = engine_for(lambda x: x * 3, [torch.randn(4, device=DEV)])
    outs = [run(e, torch.randn(4, device=DEV))[0] for _ in range(3)]
    latest = outs[-1].clone()
    with pytest.raises(RuntimeError, match="later replay has reused its memory"):
        outs[-2].sum()
    assert_bitwise(outs[-1], latest)
    kept = engine_for(lambda x: x * 3, [torch.randn(4, device=DEV)], clone_outputs=True)
    xs = [torch.randn(4, device=DEV) for _ in range(4)]
    outs = [run(kept, x)[0] for x in xs]
    for x, o in zip(xs, outs):
        assert_bitwise(o, x * 3)


def test_output_aliasing_input_is_a_view_of_the_callers_tensor():
    e = engine_for(lambda x: (x.t(), x.sum()), [torch.randn(3, 5, device=DEV)])
    for _ in range(3):
        x = torch.randn(3, 5, device=DEV)
        view, total = run(e, x)
        assert view.data_ptr() == x.data_ptr()
        assert_bitwise(view, x.t())
        assert_bitwise(total, x.sum())


def test_threads_on_one_engine():
    e = engine_for(lambda x: torch.tanh(x) + 1, [torch.randn(64, device=DEV)], clone_outputs=True)
    errors = []

    def worker(seed):
        try:
            g = torch.Generator(device=DEV).manual_seed(seed)
            for _ in range(20):
                x = torch.randn(64, device=DEV, generator=g)
                d = bitwise_diff(run(e, x)[0], torch.tanh(x) + 1)
                if d is not None:
                    errors.append(f"{seed}: {d}")
        except Exception as exc:  # reported below
            errors.append(repr(exc))

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


# ------------------------------------------------------------------------------ pool, failures

def _graph_with_big_intermediates():
    return lambda x: ((torch.relu(x) * 2 + 1).sin() * 3).sum(1)


def test_keys_share_one_pool_about_the_largest_key():
    fn = _graph_with_big_intermediates()
    rows = [1024, 512, 256, 128]   # 4 MiB per intermediate at 1024 x 1024 floats
    single = engine_for(fn, [torch.randn(rows[0], 1024, device=DEV)])
    single.precapture([[torch.randn(rows[0], 1024, device=DEV)]])
    shared = engine_for(fn, [torch.randn(rows[0], 1024, device=DEV)])
    shared.precapture([[torch.randn(n, 1024, device=DEV)] for n in rows])
    assert shared.stats()["captures"] == 4
    assert shared.stats()["pool_bytes"] <= 1.1 * single.stats()["pool_bytes"]
    for n in rows:
        x = torch.randn(n, 1024, device=DEV)
        assert_bitwise(run(shared, x)[0], fn(x))


def test_capture_failure_falls_back_and_releases_the_pool():
    @torch.library.custom_op("torchreplay_test::synced_add", mutates_args=())
    def synced_add(x: torch.Tensor) -> torch.Tensor:
        torch.cuda.synchronize()   # not allowed while a stream is capturing
        return x + 1

    gm = make_fx(lambda x: torch.ops.torchreplay_test.synced_add(x * 2) * 3)(torch.randn(4, device=DEV))
    warm = engine_for(lambda x: x @ x, [torch.randn(4, 4, device=DEV)])  # this thread's capture stream and
    for _ in range(3):                                                  # its cuBLAS workspace, made once
        run(warm, torch.randn(4, 4, device=DEV))
    del warm
    reserved = []
    for _ in range(3):
        e = _C.Engine(lower(gm, [torch.randn(4, device=DEV)]), own_options())
        for _ in range(4):
            x = torch.randn(4, device=DEV)
            assert_bitwise(e.run([x])[0], (x * 2 + 1) * 3)
        s = e.stats()
        assert s["captures"] == 0 and s["eager_fallbacks"] == 3
        assert "CUDA capture" in s["fallback_reasons"][0]
        del e
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        reserved.append(torch.cuda.memory_reserved())
    # The pool outlives its graphs (Note [The pool outlives its graphs]): the first failed capture
    # may leave a block reserved in it (2 MiB on an H100); later ones must not add to it.
    assert reserved[2] <= reserved[0], reserved
    # Eager random numbers still work (the RNG state left capture mode with the stream).
    assert torch.rand(1000, device=DEV).std() > 0.2
    # The stream left capture mode: a later capture in this process works.
    ok = engine_for(lambda x: x + 1, [torch.randn(4, device=DEV)])
    for _ in range(3):
        x = torch.randn(4, device=DEV)
        assert_bitwise(run(ok, x)[0], x + 1)
    assert ok.stats()["captures"] == 1


def test_host_reads_and_cpu_tensors_run_eagerly_with_reason():
    # x * x.sum().item(), built by hand: make_fx refuses to trace the host read
    b = _C.GraphBuilder()
    x = b.add_input("x", "Tensor", torch.float32, torch.device(DEV), 1)
    total = b.add_op("aten::sum", [("v", x)], {})[0]
    item = b.add_op("aten::item", [("v", total)], {})[0]
    b.set_outputs([("v", b.add_op("aten::mul.Scalar", [("v", x), ("v", item)], {})[0])])
    e = _C.Engine(b.build(), own_options(name="host_read"))
    for _ in range(3):
        x = torch.randn(4, device=DEV)
        assert_bitwise(run(e, x)[0], x * x.sum().item())   # run eagerly: eager's kernels
    assert "reads a value from tensor data on the host" in e.stats()["fallback_reasons"][0]
    e = engine_for(lambda x, c: x + c.to(x.device), [torch.randn(4, device=DEV), torch.randn(4)])
    for _ in range(3):
        x, c = torch.randn(4, device=DEV), torch.randn(4)
        assert_bitwise(run(e, x, c)[0], x + c.to(DEV))
    assert "CPU tensor inside a CUDA graph" in e.stats()["fallback_reasons"][0]


def test_random_ops_draw_like_eager():
    fn = lambda x: torch.nn.functional.dropout(x, 0.5, training=True) + torch.rand_like(x)  # noqa: E731
    e = engine_for(fn, [torch.ones(4096, device=DEV)])
    torch.manual_seed(7)
    want = [fn(torch.ones(4096, device=DEV)) for _ in range(4)]
    torch.manual_seed(7)
    got = [run(e, torch.ones(4096, device=DEV))[0].clone() for _ in range(4)]
    assert e.stats()["replays"] >= 2
    assert not torch.equal(got[2], got[3])           # fresh numbers every replay
    for g, w in zip(got, want):
        assert_bitwise(g, w)                     # the same stream of numbers as eager


# ------------------------------------------------------------------------------ scopes, dot

def _ancestors(edges, node):
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        for a, b in edges:
            if b == n and a not in seen:
                seen.add(a)
                todo.append(a)
    return seen


def test_scopes_make_parallel_branches_in_the_captured_graph(tmp_path):
    b = _C.GraphBuilder()
    x = b.add_input("x", "Tensor", torch.float32, torch.device(DEV), 2)
    y = b.add_input("y", "Tensor", torch.float32, torch.device(DEV), 2)
    b.add_op("torchreplay::scope_enter", [("c", ["branch"]), ("c", ["stream_1"])], {})
    a = b.add_op("aten::mm", [("v", x), ("v", x)], {})[0]
    r = b.add_op("torchreplay::record", [], {})[0]
    b.add_op("torchreplay::scope_exit", [], {})
    m = b.add_op("aten::mm", [("v", y), ("v", y)], {})[0]
    b.add_op("torchreplay::wait", [("l", [("v", r)])], {})
    out = b.add_op("aten::add.Tensor", [("v", a), ("v", m)], {})[0]
    b.set_outputs([("v", out)])
    e = _C.Engine(b.build(), own_options(name="scopes", dump_dir=str(tmp_path)))
    for _ in range(4):
        xs, ys = torch.randn(256, 256, device=DEV), torch.randn(256, 256, device=DEV)
        assert_bitwise(e.run([xs, ys])[0], xs @ xs + ys @ ys)
    assert e.stats()["captures"] == 1 and e.stats()["replays"] >= 3
    dot = (tmp_path / "torchreplay_scopes.key0.dot").read_text()  # the engine's first capture
    nodes = dict(re.findall(r'"?(\w+)"?\s*\[[^\]]*?label="([^"]*)', dot))
    edges = re.findall(r'"?(\w+)"?\s*->\s*"?(\w+)"?', dot)
    gemms = [n for n, label in nodes.items() if re.search("gemm|cutlass|sm90|xmma", label, re.I)]
    # cuBLAS may launch more than one kernel per product (on an H100, 4 for the two): some pair
    # of them, one from each branch, has no path between them
    assert len(gemms) >= 2, nodes
    assert any(g1 not in _ancestors(edges, g2) and g2 not in _ancestors(edges, g1)
               for g1 in gemms for g2 in gemms if g1 != g2), (gemms, edges)


def test_a_multi_stream_scope_pass_with_a_dot_dump_through_torch_compile(tmp_path):
    from torchreplay_bench.models import MmAbsModel

    model = MmAbsModel()
    compiled = compile_with_scopes(model, "reduce-overhead", "dot", tmp_path, cuda_graphs="torchreplay")
    for _ in range(4):
        x = torch.randn(64, 64, device=DEV)
        got, want = compiled(x), model(x)
        assert_bitwise(got, want)
    assert sum(s["replays"] for s in compiled.backend.stats()) >= 2
    dumps = sorted(p.name for p in tmp_path.iterdir())
    assert any(n.endswith(".key0.dot") for n in dumps) and any(n.endswith(".txt") for n in dumps), dumps


# ------------------------------------------------------------------------------ failures, streams

def _syncs_above(n):
    """A custom op that synchronizes (uncapturable) for inputs of more than n elements."""
    name = f"torchreplay_test::sync_above_{n}"

    @torch.library.custom_op(name, mutates_args=())
    def op(x: torch.Tensor) -> torch.Tensor:
        if x.numel() > n:
            torch.cuda.synchronize()
        return x + 1

    @op.register_fake
    def _(x):
        return torch.empty_like(x)

    return getattr(torch.ops.torchreplay_test, f"sync_above_{n}")


def test_failed_capture_then_another_key_captures_into_the_same_pool():
    op = _syncs_above(4)
    gm = make_fx(lambda x: op(x * 2) * 3)(torch.randn(8, device=DEV))
    e = _C.Engine(lower(gm, [torch.randn(8, device=DEV)]), own_options())
    for n in (8, 8, 8, 4, 4, 4, 8):
        x = torch.randn(n, device=DEV)
        assert_bitwise(e.run([x])[0], (x * 2 + 1) * 3)
    s = e.stats()
    assert s["captures"] == 1 and s["replays"] >= 2, s  # the 4-element key, after the 8's failed
    assert "CUDA capture" in s["fallback_reasons"][0]
    assert torch.rand(1000, device=DEV).std() > 0.2  # eager RNG out of capture mode


def test_eviction_then_recapture():
    e = engine_for(lambda x: torch.sin(x) * 2, [torch.randn(4, device=DEV)], warmup_iters=0, cache_limit=1)
    for n in (4, 4, 8, 8, 4, 4):
        x = torch.randn(n, device=DEV)
        assert_bitwise(run(e, x)[0], torch.sin(x) * 2)
    s = e.stats()  # each key warms up once, then captures: as the CPU engine counts the same calls
    assert (s["warmups"], s["captures"], s["evictions"], s["replays"]) == (3, 3, 2, 3), s


def test_expanded_input_is_captured():
    e = engine_for(lambda x: x * 2 + 1, [torch.randn(1, 64, device=DEV).expand(8, 64)])
    for _ in range(4):
        x = torch.randn(1, 64, device=DEV).expand(8, 64)
        assert_bitwise(run(e, x)[0], x * 2 + 1)
    s = e.stats()
    assert (s["captures"], s["eager_fallbacks"]) == (1, 0) and s["replays"] >= 3, s


def test_calls_alternating_between_two_streams():
    fn = lambda x: torch.tanh(x @ x) * 2  # noqa: E731
    e = engine_for(fn, [torch.randn(512, 512, device=DEV)])
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for i in range(8):
        with torch.cuda.stream(streams[i % 2]):
            x = torch.randn(512, 512, device=DEV)
            got = run(e, x)[0].clone()
            want = fn(x)
        torch.cuda.synchronize()
        assert_bitwise(got, want, f"i={i}")
    assert e.stats()["replays"] >= 6


def test_engine_without_its_cuda_graphs_runs_op_by_op():
    e = _engine_for(lambda x: x * 2, [torch.randn(4, device=DEV)])
    for _ in range(3):
        x = torch.randn(4, device=DEV)
        assert_bitwise(run(e, x)[0], x * 2)
    s = e.stats()
    assert s["captures"] == 0 and "cudagraph trees" in s["fallback_reasons"][0]


# ------------------------------------------------------------------------------ torch.compile

def _compiled(model, cuda_graphs):
    config = torchreplay.CompilerConfig()
    config.mode = "reduce-overhead"
    config.reduce_overhead.cuda_graphs = cuda_graphs
    backend = torchreplay.get_backend(compiler_config=config)
    return torch.compile(model, backend=backend), backend


@pytest.mark.parametrize("cuda_graphs", ["cudagraph_trees", "torchreplay"])
def test_zoo_models_on_cuda_match_eager(cuda_graphs):
    import copy

    from torchreplay_bench.models import MODELS

    for name in ("mlp", "demo", "attention_decode", "convnet", "chain64"):
        torch._dynamo.reset()
        factory, _ = MODELS[name]
        torch.manual_seed(0)
        model, make_inputs_fn = factory()
        model = model.to(DEV)
        reference = copy.deepcopy(model)
        compiled, backend = _compiled(copy.deepcopy(model), cuda_graphs)
        with torch.no_grad():
            for i in range(5):
                inputs = [t.to(DEV) if isinstance(t, torch.Tensor) else t for t in make_inputs_fn(i)]
                want = reference(*[t.clone() if isinstance(t, torch.Tensor) else t for t in inputs])
                got = compiled(*inputs)
                want = want if isinstance(want, tuple) else (want,)
                got = got if isinstance(got, tuple) else (got,)
                assert len(got) == len(want), name
                # Close, not bitwise: on CUDA nothing promises eager's bits (cuBLAS picks its
                # kernels per stream and workspace; AOTAutograd's decompositions change the arithmetic).
                assert_close_not_bitwise(list(got), list(want), 1e-5, 1e-6, f"{name} call {i}")
        stats = backend.stats()
        if cuda_graphs == "torchreplay":
            assert sum(s["replays"] for s in stats) >= 2, (name, stats)
        else:  # the trees replay: the engine runs only for their warm-up and recording
            assert all(s["cuda_graphs"] == "PyTorch's cudagraph trees" for s in stats), (name, stats)
            assert sum(s["cuda_graph_calls"] for s in stats) == 5 * len(stats), (name, stats)
            assert all(s["calls"] < s["cuda_graph_calls"] for s in stats), (name, stats)


def test_training_through_cudagraph_trees_matches_eager():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4)).to(DEV)
    import copy

    reference = copy.deepcopy(model)
    torch._dynamo.reset()
    compiled, backend = _compiled(model, "cudagraph_trees")
    # Gradients set to None each step, as training through the trees needs: with them accumulated
    # across steps, AccumulateGrad keeps the backward graph's output as .grad and the next replay
    # overwrites it ("accessing tensor output of CUDAGraphs that has been overwritten"), with
    # torch.compile(backend="cudagraphs") alike (H100, torch 2.11).
    for _ in range(4):
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
        x, y = torch.randn(16, 32, device=DEV), torch.randn(16, 4, device=DEV)
        torch.nn.functional.mse_loss(compiled(x), y).backward()
        torch.nn.functional.mse_loss(reference(x), y).backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert_close_not_bitwise(p.grad, q.grad, 1e-5, 1e-6, "grad")   # close, not bitwise: CUDA (above)
    assert {s["cuda_graphs"] for s in backend.stats()} == {"PyTorch's cudagraph trees"}
    # A compiled foreach Adam (its state written through list arguments) through the trees too.
    # Its call is a new generation of the trees, which takes back the memory of the last one's
    # outputs, the gradients among them: they are cloned out of the pool first, as the trees' error
    # says to ("accessing tensor output of CUDAGraphs that has been overwritten by a subsequent
    # run" otherwise, with torch.compile(backend="cudagraphs") alike).
    ours, ref = torch.optim.Adam(model.parameters(), foreach=True), torch.optim.Adam(reference.parameters(), foreach=True)
    for p, q in zip(model.parameters(), reference.parameters()):
        p.grad = p.grad.clone()
        q.grad = p.grad.clone()
    step, ref_step = _compiled(ours.step, "cudagraph_trees")[0], torch.compile(ref.step, backend="aot_eager")
    for _ in range(3):
        step()
        ref_step()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert_bitwise(p, q)


def test_capture_on_cuda_runs_op_by_op_unless_asked():
    model = torch.nn.Linear(8, 8).to(DEV).eval()
    x = torch.randn(2, 8, device=DEV)
    for setting in ("cudagraph_trees", "torchreplay"):
        config = torchreplay.CompilerConfig()
        config.mode = "reduce-overhead"
        config.reduce_overhead.cuda_graphs = setting
        step = torchreplay.capture(model, (x,), config=config)
        with torch.no_grad():
            for _ in range(3):
                assert_bitwise(step(x), model(x))
        s = step.stats()
        if setting == "torchreplay":
            assert s["captures"] == 1 and s["replays"] >= 2, s
        else:
            assert s["captures"] == 0 and "cudagraph trees" in s["fallback_reasons"][0], s
