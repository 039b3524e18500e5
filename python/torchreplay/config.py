"""CompilerConfig: the settings of a torchreplay backend, shaped after torchair's.

    config = torchreplay.CompilerConfig()
    config.mode = "reduce-overhead"                 # or "default"
    config.reduce_overhead.warmup_iters = 1
    config.reduce_overhead.cuda_graphs = "cudagraph_trees"  # or "torchreplay" (tried on one H100 only)
    config.debug.graph_dump.type = "txt"            # "txt", "py", "dot" (or None)
    config.post_grad_custom_pre_pass = my_pass      # fn(gm, example_inputs, config) -> None

Every field is checked when it is set, so a typo fails where it is written.
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Dict, Optional

MODES = ("default", "reduce-overhead")
DUMP_TYPES = (None, "txt", "py", "dot")
CUDA_GRAPHS = ("cudagraph_trees", "torchreplay")
NUMERICS = ("bitwise", "close")

FxPass = Callable[[Any, Any, "CompilerConfig"], None]


class _Section:
    """A group of typed settings; unknown names and wrong types raise at assignment."""

    _fields: Dict[str, tuple] = {}

    def __init__(self) -> None:
        for name, (default, _check, _doc) in self._fields.items():
            object.__setattr__(self, name, default)

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in self._fields:
            raise AttributeError(
                f"{type(self).__name__} has no setting '{name}'; settings: {sorted(self._fields)}"
            )
        _default, check, doc = self._fields[name]
        error = check(value)
        if error:
            raise ValueError(f"{type(self).__name__}.{name} = {value!r}: {error} ({doc})")
        object.__setattr__(self, name, value)

    def as_dict(self) -> Dict[str, Any]:
        return {name: getattr(self, name) for name in self._fields}

    def __repr__(self) -> str:
        body = ", ".join(f"{k}={v!r}" for k, v in self.as_dict().items())
        return f"{type(self).__name__}({body})"


def _is_int_at_least(lo: int) -> Callable[[Any], Optional[str]]:
    return lambda v: None if isinstance(v, int) and not isinstance(v, bool) and v >= lo else f"want an int >= {lo}"


def _is_bool(v: Any) -> Optional[str]:
    return None if isinstance(v, bool) else "want True or False"


def _is_sizes(v: Any) -> Optional[str]:
    ok = v is None or (isinstance(v, (list, tuple)) and len(v) > 0 and
                       all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in v))
    return None if ok else "want None or a non-empty list of ints >= 1"


def _is_pass(v: Any) -> Optional[str]:
    return None if v is None or callable(v) else "want a callable fn(gm, example_inputs, config) or None"


class ReduceOverheadConfig(_Section):
    _fields = {
        "warmup_iters": (1, _is_int_at_least(0), "eager runs of a new shape before it is captured"),
        "capture_limit": (64, _is_int_at_least(0), "shapes captured per graph; later new shapes run eagerly"),
        "cache_limit": (256, _is_int_at_least(1), "shapes held per graph; the least recently used is evicted"),
        "capture_sizes": (None, _is_sizes, "batch sizes captured; other batches padded up to the next"),
        "capture_sizes_bitwise": (True, _is_bool, "pad only graphs whose real rows stay bitwise equal to eager; "
                                  "False: also graphs whose rows come out close (GEMMs, sigmoid, ...)"),
        "clone_outputs": (False, _is_bool, "hand out copies instead of views of the static pool"),
        "numerics": ("bitwise", lambda v: None if v in NUMERICS else f"want one of {NUMERICS}",
                     "\"bitwise\": outputs bitwise equal to eager's on the CPU; \"close\" (torchreplay.capture): "
                     "the graph rewritten as CPU runtimes do (batch norm folded, convolutions through oneDNN "
                     "on packed weights with fused activations, channels-last, LSTM decomposed), outputs close "
                     "to eager's"),
        "cuda_graphs": ("cudagraph_trees", lambda v: None if v in CUDA_GRAPHS else f"want one of {CUDA_GRAPHS}",
                        "who captures CUDA graphs: PyTorch's cudagraph trees around the C++ engine "
                        "(torch.compile; torchreplay.capture then runs CUDA op by op), or torchreplay's own "
                        "(tried on one H100 only)"),
    }


class GraphDumpConfig(_Section):
    _fields = {
        "type": (None, lambda v: None if v in DUMP_TYPES else f"want one of {DUMP_TYPES}", "what to dump"),
        "path": (".", lambda v: None if isinstance(v, str) and v else "want a directory path", "where"),
    }


class DebugConfig(_Section):
    _fields = {
        "run_eagerly": (False, _is_bool, "run the lowered FX graph in Python instead of the C++ runtime"),
        "graph_dump": (None, lambda v: None if isinstance(v, GraphDumpConfig) else "want a GraphDumpConfig", ""),
    }

    def __init__(self) -> None:
        super().__init__()
        self.graph_dump = GraphDumpConfig()


class CompilerConfig(_Section):
    _fields = {
        "mode": ("default", lambda v: None if v in MODES else f"want one of {MODES}", "execution mode"),
        "keep_inference_input_mutations": (True, _is_bool, "keep input mutations inside the graph"),
        "trace_backward": (True, _is_bool, "trace loss.backward() inside a compiled function into its graph, "
                           "so that the whole training step replays as one graph; False: the graph breaks "
                           "there and autograd runs the backward, as with other backends"),
        "post_grad_custom_pre_pass": (None, _is_pass, "FX pass run before the built-in passes"),
        "post_grad_custom_post_pass": (None, _is_pass, "FX pass run after the built-in passes"),
        "reduce_overhead": (None, lambda v: None if isinstance(v, ReduceOverheadConfig) else "want a ReduceOverheadConfig", ""),
        "debug": (None, lambda v: None if isinstance(v, DebugConfig) else "want a DebugConfig", ""),
    }

    def __init__(self) -> None:
        super().__init__()
        self.reduce_overhead = ReduceOverheadConfig()
        self.debug = DebugConfig()

    # Names accepted in torch.compile(..., backend="torchreplay", options={...}).
    _OPTION_PATHS = {
        "mode": ("mode",),
        "keep_inference_input_mutations": ("keep_inference_input_mutations",),
        "trace_backward": ("trace_backward",),
        "post_grad_custom_pre_pass": ("post_grad_custom_pre_pass",),
        "post_grad_custom_post_pass": ("post_grad_custom_post_pass",),
        "warmup_iters": ("reduce_overhead", "warmup_iters"),
        "capture_limit": ("reduce_overhead", "capture_limit"),
        "cache_limit": ("reduce_overhead", "cache_limit"),
        "capture_sizes": ("reduce_overhead", "capture_sizes"),
        "capture_sizes_bitwise": ("reduce_overhead", "capture_sizes_bitwise"),
        "clone_outputs": ("reduce_overhead", "clone_outputs"),
        "numerics": ("reduce_overhead", "numerics"),
        "cuda_graphs": ("reduce_overhead", "cuda_graphs"),
        "run_eagerly": ("debug", "run_eagerly"),
        "graph_dump_type": ("debug", "graph_dump", "type"),
        "graph_dump_path": ("debug", "graph_dump", "path"),
    }

    @classmethod
    def from_options(cls, options: Optional[Dict[str, Any]]) -> "CompilerConfig":
        """Builds a config from a flat options dict; dotted paths ("reduce_overhead.warmup_iters")
        are accepted too."""
        return cls().with_options(options)

    def with_options(self, options: Optional[Dict[str, Any]]) -> "CompilerConfig":
        """A copy of this config with a flat options dict applied (as from_options takes it)."""
        config = copy.deepcopy(self)
        for key, value in (options or {}).items():
            path = self._OPTION_PATHS.get(key) or tuple(key.split("."))
            target: Any = config
            for part in path[:-1]:
                target = getattr(target, part, None)
            if not isinstance(target, _Section) or (len(path) == 1 and key not in self._OPTION_PATHS):
                raise ValueError(f"torchreplay: unknown option '{key}'; options: {sorted(self._OPTION_PATHS)}")
            setattr(target, path[-1], value)
        return config
