"""Quantized models as CPU users quantize them (docs/guide.md, "Quantized models"): torchao's
quantize_ configs whose eager runs on the CPU, through torchreplay.capture, torch.compile and a
saved program, compared bit for bit with the quantized model's eager, at one thread and several,
over short and long rows, with the thread count changed between capture and call."""
import copy
import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torchao.prototype.quantization.int4 import Int4WeightOnlyOpaqueTensorConfig
from torchao.quantization import (Int8DynamicActivationInt8WeightConfig, Int8DynamicActivationIntxWeightConfig,
                                  Int8WeightOnlyConfig, IntxWeightOnlyConfig, quantize_)

from configs import backend
from differential import assert_bitwise, assert_exercised, gen, rn
from test_conditions import ENTRIES, Entry, threads

CONFIGS = {   # torchao's configs with a CPU eager in torchao 0.17 (version 1 is the int8 default)
    "int8 weight-only": lambda: Int8WeightOnlyConfig(),
    "int8 weight-only v2": lambda: Int8WeightOnlyConfig(version=2),
    "int8 dynamic activation": lambda: Int8DynamicActivationInt8WeightConfig(),
    "int8 dynamic activation v2": lambda: Int8DynamicActivationInt8WeightConfig(version=2),
    "int4 weight-only (CPU packing)": lambda: Int4WeightOnlyOpaqueTensorConfig(group_size=32),
    "intx int4 weight-only": lambda: IntxWeightOnlyConfig(weight_dtype=torch.int4),
    "int8 dynamic activation, int4 weights": lambda: Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4),
}


def encoder(k):
    """Linear (no bias, as in decoders), GELU, LayerNorm, Linear over rows of k features (k =
    4096: a long row)."""
    return nn.Sequential(nn.Linear(k, 96, bias=False), nn.GELU(), nn.LayerNorm(96), nn.Linear(96, 32)).eval()


def quantized(name, k):
    torch.manual_seed(0)
    m = encoder(k)
    with warnings.catch_warnings():   # torchao's deprecations of its version-1 tensors
        warnings.simplefilter("ignore", UserWarning)
        quantize_(m, CONFIGS[name]())
    assert is_traceable_wrapper_subclass(m[0].weight), "torchao left the weight unquantized"
    return m


@pytest.mark.parametrize("k", [64, 4096])
@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_torchao_models_replay_the_quantized_eagers_bits(name, entry, k, tmp_path):
    m = quantized(name, k)
    g = gen(1)
    with torch.no_grad():
        f = Entry(entry, copy.deepcopy(m), (rn(g, 2, 3, k),), tmp_path)
        for i, n_threads in enumerate([1, 3, 3, 1, 2]):   # changed between capture and calls
            x = rn(g, 2, 3, k)
            with threads(n_threads):
                assert_bitwise(f(x), m(x), f"{name}, {entry}, k={k}, call {i} at {n_threads} threads")
    s = f.stats()
    assert s["replays"] >= 1 and s["eager_fallbacks"] == 0, s


@pytest.mark.parametrize("name", list(CONFIGS))
def test_compiled_quantized_graphs_skip_aotautograds_wrapper(name):
    """Note [Tensor-subclass arguments]: the graph's call flattens the quantized weights itself."""
    m = quantized(name, 64)
    b = backend()
    f = torch.compile(copy.deepcopy(m), backend=b)
    g = gen(2)
    with torch.no_grad():
        for i in range(4):
            x = rn(g, 5, 64)
            assert_bitwise(f(x), m(x), f"{name}, call {i}")
    assert list(b.call_paths.values()) == ["direct"], b.call_paths
    assert_exercised(b)


def test_a_quantized_weight_replaced_or_written_after_compiling_is_the_one_used():
    m = quantized("int8 dynamic activation v2", 64)
    b = backend()
    f = torch.compile(m, backend=b)
    x = rn(gen(3), 5, 64)
    with torch.no_grad():
        for _ in range(3):
            assert_bitwise(f(x), m(x), "before")
        m[0].weight = quantized("int8 dynamic activation v2", 64)[0].weight   # torch.manual_seed(0) again:
        m[0].weight.qdata.neg_()                                              # other values, then written
        assert_bitwise(f(x), m(x), "another weight")
        m[3].weight.qdata.zero_()
        assert_bitwise(f(x), m(x), "a weight written in place")
    assert_exercised(b)


def test_a_quantized_model_called_with_grad_mode_on_replays_eagers_bits():
    """The biases still require grad: a training graph, its weights flattened by AOTAutograd."""
    m = quantized("int8 dynamic activation", 64)
    b = backend()
    f = torch.compile(copy.deepcopy(m), backend=b)
    g = gen(4)
    for i in range(4):
        x = rn(g, 5, 64)
        assert_bitwise(f(x), m(x), f"call {i}")
    assert_exercised(b)
