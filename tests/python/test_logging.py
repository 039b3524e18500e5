"""One log (Note [One log] in bindings/module.cc): the C++ engines' messages and the package's go
to Python's "torchreplay" logger, which torch._logging knows (TORCH_LOGS), at the levels asked."""
import logging
import os
import subprocess
import sys

import pytest
import torch

import torchreplay
from configs import config

SCRIPT = """
import torch, torchreplay
cfg = torchreplay.CompilerConfig(); cfg.mode = "reduce-overhead"
f = torchreplay.capture(lambda x: x.sin() + 1, (torch.randn(3),), config=cfg)
for _ in range(3):
    f(torch.randn(3))
"""


def test_a_capture_is_logged_at_info_by_the_engine(replay_log):
    f = torchreplay.capture(lambda x: x.cos() * 2, (torch.randn(4),), config=config())
    with replay_log.at_level(logging.INFO, logger="torchreplay"):
        for _ in range(3):
            f(torch.randn(4))
    captured = [r for r in replay_log.records if "captured key" in r.getMessage()]
    assert len(captured) == 1 and f.stats()["captures"] == 1
    assert captured[0].name == "torchreplay" and captured[0].levelno == logging.INFO
    assert captured[0].getMessage().startswith(f"graph '{f.name}': captured key")


def test_below_the_loggers_level_nothing_is_logged(replay_log):
    f = torchreplay.capture(lambda x: x.cos() * 3, (torch.randn(4),), config=config())
    with replay_log.at_level(logging.WARNING, logger="torchreplay"):
        for _ in range(3):
            f(torch.randn(4))
    assert f.stats()["captures"] == 1 and not replay_log.records


def test_set_log_level_sets_the_loggers_level():
    log = logging.getLogger("torchreplay")
    saved = log.level
    try:
        for level, want in [(0, logging.DEBUG), (1, logging.INFO), (2, logging.WARNING), (3, logging.ERROR)]:
            torchreplay.set_log_level(level)
            assert log.level == want
        with pytest.raises(ValueError, match="log level must be"):
            torchreplay.set_log_level(4)
    finally:
        log.setLevel(saved)


@pytest.mark.parametrize("env, lines", [({}, 0), ({"TORCH_LOGS": "torchreplay"}, 1),
                                        ({"TORCHREPLAY_LOG_LEVEL": "1"}, 1)])
def test_torch_logs_and_the_environment_show_captures_once(env, lines):
    clean = {k: v for k, v in os.environ.items() if k not in ("TORCH_LOGS", "TORCHREPLAY_LOG_LEVEL")}
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300,
                         env=dict(clean, **env))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stderr.count("captured key") == lines, out.stderr[-3000:]


def test_an_rnn_dynamo_leaves_eager_is_explained_once_for_torchreplay_compiles(replay_log):
    """For torchreplay's compiles Dynamo traces nn.GRU / nn.LSTM with grad disabled (Note
    [Recurrent modules whole]); with grad enabled it makes no graph of them, and the log says so
    and why once per module class, with what replays the model whole; other backends' compiles
    add nothing."""
    from differential import assert_bitwise

    class Gru(torch.nn.GRU):  # a class of this test's own: the message is once per class
        pass

    class Lstm(torch.nn.LSTM):
        pass

    class Model(torch.nn.Module):
        def __init__(self, rnn):
            super().__init__()
            self.rnn, self.head = rnn, torch.nn.Linear(8, 2)

        def forward(self, x):
            return self.head(self.rnn(x)[0][:, -1]).tanh()

    torch._dynamo.reset()
    x = torch.randn(1, 5, 8)
    ours = [Model(Gru(8, 8, batch_first=True)).eval() for _ in range(2)]
    other = Model(Lstm(8, 8, batch_first=True)).eval()
    with replay_log.at_level(logging.WARNING, logger="torchreplay"):
        traced = torchreplay.get_backend(compiler_config=config())
        f = torch.compile(ours[0], backend=traced)
        with torch.no_grad():
            for _ in range(3):
                assert_bitwise(f(x), ours[0](x), "GRU model through torch.compile, grad disabled")
        assert [s["replays"] for s in traced.stats()] == [2] and not replay_log.records
        for m in ours:
            b = torchreplay.get_backend(compiler_config=config())
            f = torch.compile(m, backend=b)
            for _ in range(3):  # Dynamo makes no graph of the GRU: it runs eagerly
                assert_bitwise(f(x), m(x), "GRU model through torch.compile, grad enabled")
        g = torch.compile(other, backend="aot_eager")
        for _ in range(2):
            g(x)
    said = [r.getMessage() for r in replay_log.records if "Dynamo does not trace" in r.getMessage()]
    assert len(said) == 1, said
    assert said[0].startswith("torchreplay: Dynamo does not trace this Gru: grad is enabled") \
        and "torchreplay.capture" in said[0]
    assert replay_log.records[0].levelno == logging.WARNING


@pytest.mark.parametrize("kind", ["gru", "lstm"])
def test_a_graph_that_is_one_whole_recurrent_call_is_explained_once(replay_log, kind):
    """A compiled graph with nothing but a recurrent call kept whole (Note [Recurrent modules
    whole]) replays eager's one call under Dynamo's frame: the log says so once per backend, with
    what replays it without that frame; a graph with more in it says nothing. A GRU's at WARNING;
    an LSTM's at INFO, with the faster kernel its capture may take (Note [Checked LSTMs])."""
    from differential import assert_bitwise

    class Step(torch.nn.Module):
        def __init__(self, head):
            super().__init__()
            self.rnn = (torch.nn.LSTM if kind == "lstm" else torch.nn.GRU)(8, 16, num_layers=2, batch_first=True)
            self.head = head

        def forward(self, x, h, c):
            if kind == "lstm":
                y, (h, c) = self.rnn(x, (h, c))
            else:
                y, h = self.rnn(x, h)
            return (self.head(y) if self.head is not None else y), h, c

    torch.manual_seed(0)
    batch = 1 if kind == "lstm" else 3  # a GRU over one row decomposes (Note [Recurrent modules whole])
    args = (torch.randn(batch, 1, 8), torch.randn(2, batch, 16), torch.randn(2, batch, 16))
    torch._dynamo.reset()
    with replay_log.at_level(logging.INFO, logger="torchreplay"), torch.no_grad():
        backend = torchreplay.get_backend(compiler_config=config())
        for model in (Step(None).eval(), Step(None).eval(), Step(torch.nn.Linear(16, 4)).eval()):
            f = torch.compile(model, backend=backend)
            for _ in range(3):
                assert_bitwise(f(*args), model(*args), f"{kind} step through torch.compile")
    stats = backend.stats()
    assert sum(s["calls"] for s in stats) == 9 and sum(s["replays"] for s in stats) == 6, stats
    said = [r for r in replay_log.records if "recurrent module" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in said]
    message = said[0].getMessage()
    assert message.startswith(f"torchreplay: a compiled graph is only the {kind} call of a recurrent module") \
        and "torchreplay.capture(model, example_args)" in message, message
    assert said[0].levelno == (logging.INFO if kind == "lstm" else logging.WARNING)
    assert ("Note [Checked LSTMs]" in message) == (kind == "lstm"), message
