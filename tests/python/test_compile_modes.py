"""torch.compile's own arguments with torchreplay's backend (Note [torch.compile's mode] in
backend.py): mode="reduce-overhead" captures and replays, "default" runs the lowered graph op by
op, the max-autotune modes are refused with a clear error, options= sets any setting (torch.compile
refuses mode= and options= together), for the named backend and for a backend object alike; dynamic= and fullgraph= are Dynamo's and keep
working. Each case compares bits with eager's and says whether replay happened."""
import pytest
import torch
import torch.nn as nn

import torchreplay
from configs import config
from differential import assert_bitwise


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8)).eval()


def _engine_counts(before):
    """calls, replays and captures of the engines made since `before` (torchreplay.stats())."""
    seen = {s["name"] for s in before}
    new = [s for s in torchreplay.stats() if s["name"] not in seen]
    return {k: sum(s[k] for s in new) for k in ("calls", "replays", "captures")}


def _run(compiled, model, calls=4, sizes=(5,)):
    with torch.no_grad():
        for i in range(calls):
            for n in sizes:
                x = torch.randn(n, 16)
                assert_bitwise(compiled(x), model(x), f"call {i}, batch {n}")


SPELLINGS = {
    # name: (torch.compile keyword arguments given a named or object backend, replays expected)
    "mode reduce-overhead": (dict(mode="reduce-overhead"), True),
    "mode default": (dict(mode="default"), False),
    "no mode": (dict(), False),
    "options mode": (dict(options={"mode": "reduce-overhead"}), True),
    "options with others": (dict(options={"mode": "reduce-overhead", "warmup_iters": 2, "clone_outputs": True}), True),
    "dynamic": (dict(mode="reduce-overhead", dynamic=True), True),
    "fullgraph": (dict(mode="reduce-overhead", fullgraph=True), True),
}


@pytest.mark.parametrize("backend", ["named", "object"])
@pytest.mark.parametrize("spelling", list(SPELLINGS))
def test_torch_compile_arguments_reach_the_engine(spelling, backend):
    kwargs, replays = SPELLINGS[spelling]
    model = _model()
    if "options" in kwargs and backend == "object":
        pytest.skip("torch.compile passes options= to a backend object too; tested with the named backend")
    b = "torchreplay" if backend == "named" else torchreplay.get_backend()
    before = torchreplay.stats()
    compiled = torch.compile(model, backend=b, **kwargs)
    _run(compiled, model, sizes=(5, 3) if kwargs.get("dynamic") else (5,))
    counts = _engine_counts(before)
    assert counts["calls"] > 0, counts
    if replays:
        assert counts["replays"] > 0 and counts["captures"] > 0, counts
    else:
        assert counts["replays"] == counts["captures"] == 0, counts
    if backend == "object":
        assert sum(s["calls"] for s in b.stats()) == counts["calls"]  # the variant's engines in its stats


def test_a_backend_objects_own_mode_holds_without_torch_compiles():
    """get_backend(compiler_config=...) with config.mode "reduce-overhead": torch.compile without
    mode= replays; the object's config is left as the user made it when mode= is given."""
    cfg = config("default")
    b = torchreplay.get_backend(compiler_config=cfg)
    model = _model()
    _run(torch.compile(model, backend=b, mode="reduce-overhead"), model)
    assert cfg.mode == "default" and b.config is cfg
    assert sum(s["replays"] for s in b.stats()) > 0
    b2 = torchreplay.get_backend(compiler_config=config("reduce-overhead"))
    _run(torch.compile(model, backend=b2), model)
    assert sum(s["replays"] for s in b2.stats()) > 0


@pytest.mark.parametrize("mode", ["max-autotune", "max-autotune-no-cudagraphs"])
@pytest.mark.parametrize("backend", ["named", "object"])
def test_autotune_modes_are_refused_with_what_to_use(mode, backend):
    b = "torchreplay" if backend == "named" else torchreplay.get_backend()
    compiled = torch.compile(_model(), backend=b, mode=mode)
    with pytest.raises(Exception, match="autotune the kernels it generates; torchreplay generates none"):
        with torch.no_grad():
            compiled(torch.randn(5, 16))


def test_an_unknown_option_is_refused():
    compiled = torch.compile(_model(), backend="torchreplay", options={"warmup_itrs": 2})
    with pytest.raises(Exception, match="unknown option 'warmup_itrs'"):
        with torch.no_grad():
            compiled(torch.randn(5, 16))


def test_transformers_compile_config_spelling():
    """transformers compiles a decode step as torch.compile(model.__call__,
    **CompileConfig(...).to_dict()): backend="torchreplay" with its default mode "reduce-overhead"
    replays."""
    transformers = pytest.importorskip("transformers")
    cc = transformers.CompileConfig(backend="torchreplay")
    assert cc.mode == "reduce-overhead"
    model = _model()
    before = torchreplay.stats()
    _run(torch.compile(model, **cc.to_dict()), model)
    counts = _engine_counts(before)
    assert counts["replays"] > 0, counts
