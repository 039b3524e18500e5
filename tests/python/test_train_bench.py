"""The training harness's table of optimizer updates (python -m torchreplay_bench.train
--optimizers), on the MLP's parameters: it runs, its checks hold, and it reports torchreplay's
update as one fused step bitwise aot_eager's."""
import re

from torchreplay_bench import train


def test_optimizer_updates_table(capsys):
    assert train.bench_optimizers("mlp", ["sgd_nesterov", "rmsprop"], rounds=1, seconds=0.05)
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines()[2:]}
    assert set(rows) == {"sgd_nesterov", "rmsprop"}, out
    for name, line in rows.items():
        assert "torchreplay bitwise vs aot_eager (1 steps, 1 fused)" in line, line
    # RMSprop has no fused=True kernel; SGD's is timed and checked.
    assert "(none)" in rows["rmsprop"] and ", fused " not in rows["rmsprop"], rows
    assert "(none)" not in rows["sgd_nesterov"] and re.search(r", fused (bitwise|close)$", rows["sgd_nesterov"]), rows
