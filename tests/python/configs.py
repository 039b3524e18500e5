"""The configs and backends the Python tests build."""
import torchreplay


def config(mode="reduce-overhead", **reduce_overhead):
    """A CompilerConfig in `mode` with these config.reduce_overhead settings."""
    cfg = torchreplay.CompilerConfig()
    cfg.mode = mode
    for k, v in reduce_overhead.items():
        setattr(cfg.reduce_overhead, k, v)
    return cfg


def backend(mode="reduce-overhead", **reduce_overhead):
    """A torch.compile backend for config(mode, **reduce_overhead)."""
    return torchreplay.get_backend(compiler_config=config(mode, **reduce_overhead))
