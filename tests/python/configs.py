"""The configs and backends the Python tests build."""
import torchreplay


def config(mode="reduce-overhead", trace_backward=True, **reduce_overhead):
    """A CompilerConfig in `mode` with these config.reduce_overhead settings."""
    cfg = torchreplay.CompilerConfig()
    cfg.mode = mode
    cfg.trace_backward = trace_backward
    for k, v in reduce_overhead.items():
        setattr(cfg.reduce_overhead, k, v)
    return cfg


def backend(mode="reduce-overhead", trace_backward=True, **reduce_overhead):
    """A torch.compile backend for config(mode, trace_backward, **reduce_overhead)."""
    return torchreplay.get_backend(compiler_config=config(mode, trace_backward, **reduce_overhead))
