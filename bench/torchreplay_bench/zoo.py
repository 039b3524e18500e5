"""Model zoo benchmark: tiny random-weight transformers architectures and torchvision CNNs, each
through eager, torchreplay (torch.compile, reduce-overhead), torchreplay.capture and Inductor.

    python -m torchreplay_bench.zoo [--models llama,resnet18] [--modes eager,inductor]
                                    [--rounds 7] [--out DIR]

Per model every mode is compiled (compile time reported), checked against eager on fresh inputs
(bitwise or close), then timed interleaved: each round times every mode once (a block of calls
each), and the median over rounds is reported, so that the machine's drift hits every mode alike.
One thread, torch.no_grad(). Writes DIR/zoo.json and prints a table with each mode's ratio to eager
and torchreplay's to Inductor. transformers (in tools/requirements.txt) and torchvision are needed.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from torchreplay_bench.__main__ import compile_for, fresh_dynamo, same

MODES = ["eager", "torchreplay-reduce-overhead", "torchreplay-capture", "inductor", "conv-bound"]


def _transformer(name: str) -> Callable[[], Tuple[torch.nn.Module, Callable[[int], tuple]]]:
    """A tiny config of one transformers architecture, eval mode, and a make_inputs(i)."""
    def build() -> Tuple[torch.nn.Module, Callable[[int], tuple]]:
        import transformers as tf
        common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, max_position_embeddings=128)
        decoders = {
            "llama": (tf.LlamaConfig, tf.LlamaModel, dict(num_key_value_heads=2)),
            "mistral": (tf.MistralConfig, tf.MistralModel, dict(num_key_value_heads=2, sliding_window=None)),
            "qwen2": (tf.Qwen2Config, tf.Qwen2Model, dict(num_key_value_heads=2)),
            "qwen3": (tf.Qwen3Config, tf.Qwen3Model, dict(num_key_value_heads=2, head_dim=16)),
            "gemma": (tf.GemmaConfig, tf.GemmaModel, dict(num_key_value_heads=2, head_dim=16)),
            "gemma2": (tf.Gemma2Config, tf.Gemma2Model, dict(num_key_value_heads=2, head_dim=16)),
            "phi": (tf.PhiConfig, tf.PhiModel, {}),
            "phi3": (tf.Phi3Config, tf.Phi3Model, dict(num_key_value_heads=2, pad_token_id=0)),
            "mixtral": (tf.MixtralConfig, tf.MixtralModel, dict(num_key_value_heads=2, num_local_experts=4,
                                                                 num_experts_per_tok=2)),
            "gpt_neox": (tf.GPTNeoXConfig, tf.GPTNeoXModel, {}),
        }
        if name in decoders:
            cfg_cls, model_cls, extra = decoders[name]
            model = model_cls(cfg_cls(**common, **extra))
        elif name == "gpt2":
            model = tf.GPT2Model(tf.GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=128))
        elif name == "opt":
            model = tf.OPTModel(tf.OPTConfig(vocab_size=256, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                                             num_attention_heads=4, max_position_embeddings=128,
                                             word_embed_proj_dim=64))
        elif name in ("bert", "roberta"):
            cfg_cls, model_cls = (tf.BertConfig, tf.BertModel) if name == "bert" else (tf.RobertaConfig, tf.RobertaModel)
            model = model_cls(cfg_cls(**common, pad_token_id=1))
        elif name == "distilbert":
            model = tf.DistilBertModel(tf.DistilBertConfig(vocab_size=256, dim=64, hidden_dim=128, n_layers=2,
                                                           n_heads=4, max_position_embeddings=128))
        elif name == "t5":
            model = tf.T5EncoderModel(tf.T5Config(vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                                  num_heads=4))
        elif name == "vit":
            model = tf.ViTModel(tf.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                             intermediate_size=128, image_size=32, patch_size=8))
            return _Outputs(model.eval(), "pixel_values"), lambda i: (
                torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(i)),)
        else:
            raise KeyError(name)
        return _Outputs(model.eval()), lambda i: (torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(i)),)
    return build


def _cnn(name: str, size: int = 64) -> Callable[[], Tuple[torch.nn.Module, Callable[[int], tuple]]]:
    """A torchvision CNN with random weights, eval mode, on one image of size x size."""
    def build() -> Tuple[torch.nn.Module, Callable[[int], tuple]]:
        import torchvision
        model = getattr(torchvision.models, name)(weights=None).eval()
        return model, lambda i: (torch.randn(1, 3, size, size, generator=torch.Generator().manual_seed(i)),)
    return build


class _Outputs(torch.nn.Module):
    """A transformers model called on one tensor (`key`), returning its last hidden state only (a
    tensor, not a ModelOutput), with no KV cache."""

    def __init__(self, model: torch.nn.Module, key: str = "input_ids") -> None:
        super().__init__()
        import inspect
        self.model, self.key = model, key
        self.no_cache = "use_cache" in inspect.signature(model.forward).parameters

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kwargs = {self.key: x, "use_cache": False} if self.no_cache else {self.key: x}
        return self.model(**kwargs).last_hidden_state


TRANSFORMERS = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi", "phi3", "mixtral", "gpt2",
                "gpt_neox", "opt", "bert", "roberta", "distilbert", "t5", "vit"]
CNNS = ["resnet18", "mobilenet_v2", "mobilenet_v3_small", "squeezenet1_0", "shufflenet_v2_x0_5",
        "efficientnet_b0", "regnet_y_400mf", "mnasnet0_5"]
MODELS: Dict[str, Callable[[], Tuple[torch.nn.Module, Callable[[int], tuple]]]] = {
    **{n: _transformer(n) for n in TRANSFORMERS}, **{n: _cnn(n) for n in CNNS}}


def build(name: str, size: Optional[int] = None) -> Tuple[torch.nn.Module, Callable[[int], tuple]]:
    """(model, make_inputs) of a zoo model; `size`: a CNN's image size instead of 64."""
    if size is not None:
        if name not in CNNS:
            raise ValueError(f"size is for the CNNs, not {name}")
        return _cnn(name, size)()
    return MODELS[name]()


def _time_block(fn: Callable[..., Any], inputs: tuple, seconds: float) -> float:
    """Microseconds per call over a block of calls lasting about `seconds`."""
    n, t0 = 0, time.perf_counter()
    while True:
        fn(*inputs)
        n += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds:
            return elapsed / n * 1e6


def measure(name: str, modes: List[str], rounds: int, seconds: float) -> Dict[str, Any]:
    fresh_dynamo(len(modes))
    torch.manual_seed(0)
    model, make_inputs = MODELS[name]()
    reference = copy.deepcopy(model)
    row: Dict[str, Any] = {"model": name, "modes": {}}
    fns: Dict[str, Callable] = {}
    for mode in modes:
        entry: Dict[str, Any] = {}
        row["modes"][mode] = entry
        t0 = time.perf_counter()
        try:
            fn = compile_for(mode, copy.deepcopy(model), list(make_inputs(0)))
            if fn is None:  # no version of this model in this mode (conv-bound of a transformer)
                del row["modes"][mode]
                continue
            ok = bitwise = True
            for i in range(4):
                inputs = make_inputs(i)
                close, exact = same(fn(*inputs), reference(*inputs))
                ok, bitwise = ok and close, bitwise and exact
            entry["compile_s"] = time.perf_counter() - t0
            entry["check"] = "bitwise" if bitwise else "close" if ok else "WRONG"
            if ok:
                fns[mode] = fn
        except Exception as e:  # noqa: BLE001 - a mode that fails for a model says why
            entry["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
    inputs = make_inputs(5)
    times: Dict[str, List[float]] = {m: [] for m in fns}
    for _ in range(rounds):
        for mode, fn in fns.items():
            timed = fn.time_us(inputs, seconds) if hasattr(fn, "time_us") else _time_block(fn, inputs, seconds)
            times[mode].append(timed)
    for mode, ts in times.items():
        row["modes"][mode]["us"] = statistics.median(ts)
    return row


def render(rows: List[Dict[str, Any]], modes: List[str]) -> str:
    head = f"{'model':<20}" + "".join(f"{m:>30}" for m in modes) + \
        f"{'ours / Inductor':>18}{'capture / Inductor':>20}{'conv-bound / Inductor':>23}"
    lines = [head]
    for r in rows:
        eager = r["modes"].get("eager", {}).get("us")
        cells = []
        for m in modes:
            e = r["modes"].get(m, {})
            if "us" in e:
                ratio = f" ({eager / e['us']:.2f}x)" if eager else ""
                cells.append(f"{e['us']:.1f}{ratio} {e['check']}")
            else:
                cells.append(e.get("error", e.get("check", "-"))[:28])
        ind = r["modes"].get("inductor", {}).get("us")
        ours = r["modes"].get("torchreplay-reduce-overhead", {}).get("us")
        cap = r["modes"].get("torchreplay-capture", {}).get("us")
        vs = f"{ind / ours:.2f}x" if ind and ours else "-"
        vs_cap = f"{ind / cap:.2f}x" if ind and cap else "-"
        bound = r["modes"].get("conv-bound", {}).get("us")
        vs_bound = f"{ind / bound:.2f}x" if ind and bound else "-"
        lines.append(f"{r['model']:<20}" + "".join(f"{c:>30}" for c in cells) + f"{vs:>18}{vs_cap:>20}{vs_bound:>23}")
    lines.append("(us per call, median over rounds; (x) = eager / mode; ours / Inductor = Inductor's time / "
                 "torchreplay's through torch.compile, above 1 where torchreplay is faster; conv-bound = the "
                 "convolution steps of capture's tape alone, the floor under a replay bitwise equal to eager: "
                 "conv-bound / Inductor below 1 where Inductor's whole model takes less than eager's "
                 "convolutions)")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m torchreplay_bench.zoo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated, of " + ", ".join(MODELS))
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--seconds", type=float, default=0.2, help="length of each timed block")
    p.add_argument("--out", default="bench_out")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    names = a.models.split(",")
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        p.error(f"unknown models {unknown}")
    modes = a.modes.split(",")
    rows = []
    with torch.no_grad():
        for name in names:
            rows.append(measure(name, modes, a.rounds, a.seconds))
            print(render(rows[-1:], modes).splitlines()[1], flush=True, file=sys.stderr)
    print(render(rows, modes))
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "zoo.json"), "w") as f:
        json.dump({"threads": torch.get_num_threads(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
