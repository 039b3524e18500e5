"""nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerEncoder and nn.Transformer in
eval, as eager runs them (Note [Transformer fast paths] in fast_paths.py): the fused fast-path ops
where eager takes them, at 1 thread and several, short and long sequences, static and dynamic
captures and loaded programs; the fast path switched off after a capture; the nested-tensor path
refused. Each call is compared bit for bit with eager and the capture must have replayed."""
import logging

import pytest
import torch
import torch.nn as nn

import torchreplay
from differential import assert_bitwise, gen, rn
from test_conditions import threads

E = 32


def _padding(batch, length):
    mask = torch.zeros(batch, length, dtype=torch.bool)
    mask[-1, length * 2 // 3:] = True
    return mask


def _layer(**kw):
    return nn.TransformerEncoderLayer(E, 4, 64, batch_first=True, **kw)


class _SelfAttention(nn.Module):
    """Attention over one input, as models call it (one argument: a saved program takes it)."""

    def __init__(self):
        super().__init__()
        self.attention = nn.MultiheadAttention(E, 4, batch_first=True)

    def forward(self, x, key_padding_mask=None):
        return self.attention(x, x, x, need_weights=False, key_padding_mask=key_padding_mask)[0]


# name -> (module, arguments for a batch and a length: (args, kwargs))
MODELS = {
    "self-attention, padded": (_SelfAttention, lambda x: ((x,), {"key_padding_mask": _padding(*x.shape[:2])})),
    "attention": (lambda: nn.MultiheadAttention(E, 4, batch_first=True),
                  lambda x: ((x, x, x), {})),
    "attention without weights, padded": (lambda: nn.MultiheadAttention(E, 4, batch_first=True),
                                          lambda x: ((x, x, x), {"need_weights": False,
                                                                 "key_padding_mask": _padding(*x.shape[:2])})),
    "attention with per-head weights": (lambda: nn.MultiheadAttention(E, 4, batch_first=True),
                                        lambda x: ((x, x, x), {"average_attn_weights": False})),
    "cross attention": (lambda: nn.MultiheadAttention(E, 4, batch_first=True),
                        lambda x: ((x, x[:, :5], x[:, :5]), {})),
    "encoder layer": (lambda: _layer(), lambda x: ((x,), {})),
    "encoder layer, gelu, norm first, padded": (
        lambda: _layer(activation="gelu", norm_first=True),
        lambda x: ((x,), {"src_key_padding_mask": _padding(*x.shape[:2])})),
    "encoder layer, causal": (lambda: _layer(), lambda x: (
        (x,), {"src_mask": nn.Transformer.generate_square_subsequent_mask(x.shape[1]), "is_causal": True})),
    "encoder with nested tensors, padded and causal": (   # eager nests no tensor given both masks
        lambda: nn.TransformerEncoder(_layer(), 2),
        lambda x: ((x,), {"src_key_padding_mask": _padding(*x.shape[:2]), "is_causal": True,
                          "mask": nn.Transformer.generate_square_subsequent_mask(x.shape[1])})),
    "encoder without nested tensors, padded": (
        lambda: nn.TransformerEncoder(_layer(), 2, enable_nested_tensor=False),
        lambda x: ((x,), {"src_key_padding_mask": _padding(*x.shape[:2])})),
    "transformer": (lambda: nn.Transformer(E, 4, 2, 2, 64, batch_first=True), lambda x: ((x, x[:, :7]), {})),
}


def _flat(out):
    return out if isinstance(out, tuple) else (out,)


def _check(step, model, args, kwargs, what):
    got, want = _flat(step(*args, **kwargs)), _flat(model(*args, **kwargs))
    assert len(got) == len(want), what
    for k, (g, w) in enumerate(zip(got, want)):
        if w is None:
            assert g is None, f"{what}, output {k}"
        else:
            assert_bitwise(g, w, f"{what}, output {k}")


@pytest.mark.parametrize("length", [17, 300], ids=["short", "long"])
@pytest.mark.parametrize("n_threads", [1, 3])
@pytest.mark.parametrize("name", list(MODELS))
def test_transformer_modules_replay_eagers_bits(name, n_threads, length):
    make, arguments = MODELS[name]
    torch.manual_seed(0)
    model = make().eval()
    args, kwargs = arguments(rn(gen(1), 3, length, E))
    with threads(n_threads), torch.no_grad():
        step = torchreplay.capture(model, args, kwargs)
        for i in range(3):
            _check(step, model, args, kwargs, f"{name}, {n_threads} threads, length {length}, call {i}")
    s = step.stats()
    assert s["captures"] == 1 and s["replays"] == 2, s


@pytest.mark.parametrize("name", ["self-attention, padded", "encoder layer, gelu, norm first, padded"])
def test_transformer_modules_dynamic_and_loaded(name, tmp_path):
    """A dynamic capture over three lengths and batches, and the program saved and loaded."""
    make, arguments = MODELS[name]
    torch.manual_seed(0)
    model = make().eval()
    g = gen(2)
    with torch.no_grad():
        args, kwargs = arguments(rn(g, 2, 11, E))
        step = torchreplay.capture(model, args, kwargs, dynamic=True)
        for batch, length in ((2, 11), (3, 40), (5, 7)):
            for i in range(2):  # a size's first call warms up, its second replays
                args, kwargs = arguments(rn(g, batch, length, E))
                _check(step, model, args, kwargs, f"{name}, dynamic, {batch}x{length}, call {i}")
        assert step.stats()["captures"] == 3 and step.stats()["replays"] == 3, step.stats()  # one a size
        args, kwargs = arguments(rn(g, 2, 11, E))
        static = torchreplay.capture(model, args, kwargs)
        torchreplay.save(static, tmp_path / "model.trp")
        program = torchreplay.load(tmp_path / "model.trp")
        for i in range(3):
            args, kwargs = arguments(rn(g, 2, 11, E))
            got = program(*args, *kwargs.values())
            want = _flat(model(*args, **kwargs))
            for k, w in enumerate(want):
                if w is not None:
                    assert_bitwise(got[k], w, f"{name}, loaded, call {i}, output {k}")
        assert program.stats()["replays"] >= 2, program.stats()


def test_the_fast_path_switched_after_a_capture_traces_again(replay_log):
    """torch.backends.mha.set_fastpath_enabled decides eager's program: a capture called after it
    changed traces again (said in the log), and calls back under the first setting replay the
    first trace."""
    replay_log.set_level(logging.INFO, logger="torchreplay")
    torch.manual_seed(0)
    model = _layer().eval()
    x = rn(gen(3), 2, 17, E)
    before = torch.backends.mha.get_fastpath_enabled()
    with torch.no_grad():
        step = torchreplay.capture(model, (x,))
        try:
            for enabled in (True, False, True, False):
                torch.backends.mha.set_fastpath_enabled(enabled)
                for i in range(2):
                    _check(step, model, (x,), {}, f"fast path {enabled}, call {i}")
        finally:
            torch.backends.mha.set_fastpath_enabled(before)
    s = step.stats()
    assert s["replays"] >= 3, s
    assert sum("transformer fast path False" in r.getMessage() for r in replay_log.records) == 1


def test_an_encoder_eager_runs_on_nested_tensors_is_refused():
    """nn.TransformerEncoder (enable_nested_tensor, its default) in eval with a padding mask runs
    nested tensors in eager and gives zeros at padded positions: the capture says what to do; built
    without nested tensors it replays eager's bits (test above)."""
    torch.manual_seed(0)
    model = nn.TransformerEncoder(_layer(), 2).eval()
    x = rn(gen(4), 2, 17, E)
    mask = _padding(2, 17)
    with torch.no_grad():
        assert model(x, src_key_padding_mask=mask)[-1, -1].abs().max() == 0  # eager's zeros
        with pytest.raises(NotImplementedError, match="enable_nested_tensor=False"):
            torchreplay.capture(model, (x,), {"src_key_padding_mask": mask})
        step = torchreplay.capture(model, (x,))  # no mask: eager takes no nested path
        for i in range(2):
            _check(step, model, (x,), {}, f"no mask, call {i}")
    assert step.stats()["replays"] == 1, step.stats()


class _Sum(nn.Module):
    def forward(self, a, b):
        return a * 2 + b


@pytest.mark.parametrize("model", ["plain", "attention"])
def test_arguments_passed_as_one_tensor_or_not_trace_each_pattern(model, tmp_path):
    """Note [Arguments passed twice]: a capture made with one tensor passed twice (export's graph
    reads one of them; attention takes its fused path for query is key is value) and called with
    distinct ones, or the reverse, traces again for the call's pattern: every call eager's bits,
    each pattern replayed; such a capture is not saved."""
    torch.manual_seed(0)
    m = _Sum() if model == "plain" else nn.MultiheadAttention(E, 4, batch_first=True).eval()
    g = gen(5)
    x, q, k, v = (rn(g, 3, 17, E) for _ in range(4))
    patterns = [(x, x), (q, k)] if model == "plain" else [(x, x, x), (q, k, k), (q, k, v), (x, x, x)]
    with torch.no_grad():
        for made_with in (patterns[0], patterns[1]):
            step = torchreplay.capture(m, made_with)
            for args in patterns + patterns:
                _check(step, m, args, {}, f"{model}, made with {len(set(map(id, made_with)))} tensors, called "
                       f"with {len(set(map(id, args)))}")
            assert step.stats()["replays"] >= len(set(map(lambda a: len(set(map(id, a))), patterns))), step.stats()
        with pytest.raises(NotImplementedError, match="capture the model with distinct tensors"):
            torchreplay.save(torchreplay.capture(m, patterns[0]), tmp_path / "model.trp")


def test_a_mask_whose_values_decide_causality_is_refused_naming_the_line():
    """nn.Transformer given tgt_mask without tgt_is_causal compares the mask's values with a causal
    one to decide (a branch on values export cannot trace): the capture says where and what to
    pass; given tgt_is_causal it replays eager's bits."""
    torch.manual_seed(0)
    model = nn.Transformer(E, 4, 1, 1, 64, batch_first=True).eval()
    g = gen(6)
    src, tgt = rn(g, 2, 9, E), rn(g, 2, 7, E)
    mask = nn.Transformer.generate_square_subsequent_mask(7)
    with torch.no_grad():
        with pytest.raises(NotImplementedError, match=r"reads a tensor.s value .*transformer\.py:\d+ .*tgt_is_causal"):
            torchreplay.capture(model, (src, tgt), {"tgt_mask": mask})
        kwargs = {"tgt_mask": mask, "tgt_is_causal": True}
        step = torchreplay.capture(model, (src, tgt), kwargs)
        for i in range(3):
            _check(step, model, (src, tgt), kwargs, f"tgt_is_causal given, call {i}")
    assert step.stats()["replays"] == 2, step.stats()
