"""Quantized models as CPU users quantize them, side by side with their fp32 selves and with the
int8 paths of the runtimes they weigh: per model, quantization and thread count,

- fp32: eager, torchreplay.capture (and with numerics "close", for PT2E);
- quantized with torchao's quantize_, torch.ao.quantization's quantize_dynamic (its Linears,
  LSTMs and GRUs) or PT2E static int8 (torchao's convert_pt2e, X86InductorQuantizer): eager,
  torchreplay.capture (and with numerics "close", for PT2E: oneDNN's int8 kernels where they
  time faster), torch.compile + torchreplay, Inductor (torch.compile, freezing on: Inductor's
  int8 lowerings run only with it);
- ONNX Runtime: the fp32 model exported, then its quantize_dynamic (int8 weights, activations
  quantized per call) for the dynamic int8 rows, its quantize_static (QDQ, per-channel weights,
  calibrated on the inputs PT2E calibrates on) for PT2E's; IO binding;
- OpenVINO: the fp32 model converted, then quantized by NNCF, OpenVINO's own tool: nncf.quantize
  (int8 weights and activations, calibrated on the same inputs; its transformer preset for the
  encoder) for the dynamic int8 and PT2E rows (OpenVINO quantizes activations statically), and
  nncf.compress_weights (int8 weights) for torchao's int8 weight-only; a bound infer request;
- ExecuTorch: the fp32 model through PT2E with its XNNPACKQuantizer (per-channel int8 weights;
  activations quantized per call for the dynamic int8 rows, calibrated on the same inputs for
  PT2E's), lowered to XNNPACK, its thread pool set.

    python -m torchreplay_bench.quantized [--threads 1,2] [--rounds 7] [--seconds 0.3] [--out DIR]

Each row is checked over three calls against the quantized model's eager ("bitwise", or the
largest absolute error) and against fp32 eager (the largest absolute error: what quantizing
costs), then the rows of one model are timed interleaved (median over rounds, µs per call) with
the ratios to the quantized eager and to fp32 through torchreplay.capture. Writes
DIR/quantized.json. The CPU's int8 instructions (VNNI, AMX) are printed from /proc/cpuinfo.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from torchreplay_bench.peers import ExecuTorch, OnnxRuntime, OpenVino, quiet
from torchreplay_bench.runtimes import compare
from torchreplay_bench.timing import time_interleaved

CHECK_CALLS = 3


def _bert_mini() -> Tuple[torch.nn.Module, Callable[[int], tuple]]:
    """An encoder of BERT-mini's size (4 layers, width 256, 4 heads, FFN 1024), 32 tokens."""
    import transformers as tf
    from torchreplay_bench.zoo_models import _Outputs
    cfg = tf.BertConfig(vocab_size=1024, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                        intermediate_size=1024, max_position_embeddings=128)
    return _Outputs(tf.BertModel(cfg).eval()), \
        lambda i: (torch.randint(0, 1024, (1, 32), generator=torch.Generator().manual_seed(i)),)


def _llama_step() -> Tuple[torch.nn.Module, Callable[[int], tuple]]:
    from torchreplay_bench.models import MODELS
    return MODELS["llama_decode"][0]()


class _RecurrentHead(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.head = torch.nn.LSTM(64, 256, 2), torch.nn.Linear(256, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0])


def _lstm() -> Tuple[torch.nn.Module, Callable[[int], tuple]]:
    """A 2-layer LSTM of width 256 with a Linear head, over 16 steps of 64 features, batch 1."""
    return _RecurrentHead().eval(), \
        lambda i: (torch.randn(16, 1, 64, generator=torch.Generator().manual_seed(i)),)


def _harness(name: str) -> Callable[[], Tuple[torch.nn.Module, Callable[[int], tuple]]]:
    from torchreplay_bench.models import MODELS as HARNESS
    return HARNESS[name][0]


# Inputs PT2E and ONNX Runtime's quantize_static calibrate on (seeds apart from the checked ones).
CALIBRATION = range(100, 108)


def _pt2e(model: torch.nn.Module, make_inputs: Callable[[int], tuple]) -> torch.nn.Module:
    """PT2E static int8 (torchao's prepare_pt2e / convert_pt2e, X86InductorQuantizer's default
    config) calibrated on CALIBRATION's inputs. Exported strict: non-strict export leaves the
    quantizer nothing to annotate with torch 2.11."""
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
    from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
        X86InductorQuantizer, get_default_x86_inductor_quantization_config)
    exported = torch.export.export(model, make_inputs(0), strict=True).module()
    prepared = prepare_pt2e(exported, X86InductorQuantizer().set_global(get_default_x86_inductor_quantization_config()))
    for i in CALIBRATION:
        prepared(*make_inputs(i))
    quantized = convert_pt2e(prepared)
    if not any(n.target == torch.ops.quantized_decomposed.dequantize_per_channel.default for n in quantized.graph.nodes):
        raise RuntimeError("PT2E left the model fp32")
    return quantized


def _quantizations() -> Dict[str, Callable[[torch.nn.Module, Callable[[int], tuple]], torch.nn.Module]]:
    """name -> quantize(model, make_inputs): the quantized model (torchao's in place)."""
    from torchao.prototype.quantization.int4 import Int4WeightOnlyOpaqueTensorConfig
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig, quantize_

    def torchao(config: Callable[[], Any]) -> Callable[[torch.nn.Module, Any], torch.nn.Module]:
        return lambda m, _: quantize_(m, config()) or m
    return {"int8 dynamic": torchao(Int8DynamicActivationInt8WeightConfig),
            "int8 weight-only": torchao(Int8WeightOnlyConfig),
            "int4 weight-only": torchao(lambda: Int4WeightOnlyOpaqueTensorConfig(group_size=32)),
            "quantize_dynamic": lambda m, _: torch.ao.quantization.quantize_dynamic(
                m, {torch.nn.Linear, torch.nn.LSTM, torch.nn.GRU}, torch.qint8),
            "pt2e static": _pt2e}


# model -> (builder, the quantizations it is measured with)
MODELS = {
    "bert_mini": (_bert_mini, ["int8 dynamic", "quantize_dynamic"]),
    "llama_decode": (_llama_step, ["int8 weight-only", "int4 weight-only"]),   # the harness's decode step
    "lstm": (_lstm, ["quantize_dynamic"]),
    "convnet": (_harness("convnet"), ["pt2e static"]),   # the harness's small CNN (its batch norm folded by PT2E)
    "mobilenet_v3_small": (_harness("mobilenet_v3_small_96"), ["pt2e static"]),   # 96x96, batch 1
}


TRANSFORMERS = {"bert_mini"}   # quantized by NNCF with its transformer preset


def _capture(model: torch.nn.Module, inputs: tuple) -> Callable:
    import torchreplay
    config = torchreplay.CompilerConfig()
    config.mode = "reduce-overhead"
    return torchreplay.capture(model, inputs, config=config)


def _alone(model: torch.nn.Module) -> torch.nn.Module:
    """`model` in a module whose forward is a code object of its own. Dynamo keeps its compiled
    versions per code object and checks the newest first: two torch.compile modes of one model
    class would each pay for the guards of the other's version (a user has one)."""
    namespace: Dict[str, Any] = {}
    exec("def forward(self, *args):\n    return self.inner(*args)\n", namespace)  # a new code object
    wrapper = type("Alone", (torch.nn.Module,), {"forward": namespace["forward"]})()
    wrapper.inner = model
    return wrapper


def _capture_close(model: torch.nn.Module, inputs: tuple) -> Callable:
    import torchreplay
    config = torchreplay.CompilerConfig()
    config.mode = "reduce-overhead"
    config.reduce_overhead.numerics = "close"
    return torchreplay.capture(model, inputs, config=config)


def _compile(model: torch.nn.Module, inputs: tuple) -> Callable:
    return torch.compile(_alone(model), backend="torchreplay", mode="reduce-overhead")


def _inductor(model: torch.nn.Module, inputs: tuple) -> Callable:
    torch._inductor.config.freezing = True
    return torch.compile(_alone(model))


def rows_for(quantization: str, make_inputs: Callable[[int], tuple],
             transformer: bool = False) -> Dict[str, Tuple[bool, Callable]]:
    """mode -> (runs the quantized model?, build(model, inputs)); `transformer`: NNCF's preset for
    transformers."""
    rows = {"fp32 eager": (False, lambda m, x: m), "fp32 capture": (False, _capture),
            "eager": (True, lambda m, x: m), "capture": (True, _capture), "compile+tr": (True, _compile),
            "Inductor (freezing)": (True, _inductor)}
    calibration = [make_inputs(i) for i in CALIBRATION]
    if quantization in ("int8 dynamic", "quantize_dynamic"):
        rows["ONNX Runtime int8"] = (False, lambda m, x: OnnxRuntime(m, x, torch.get_num_threads(),
                                                                     quantize="dynamic"))
    if quantization == "pt2e static":
        rows["fp32 capture close"] = (False, _capture_close)
        rows["capture close"] = (True, _capture_close)
        rows["ONNX Runtime int8"] = (False, lambda m, x: OnnxRuntime(
            m, x, torch.get_num_threads(), quantize="static", calibration=calibration))
    if quantization in ("int8 dynamic", "quantize_dynamic", "pt2e static"):   # OpenVINO has no dynamic int8
        rows["OpenVINO int8 (NNCF)"] = (False, lambda m, x: OpenVino(   # activations: its static int8
            m, x, torch.get_num_threads(), quantize="static", calibration=calibration, transformer=transformer))
    if quantization in ("int8 dynamic", "quantize_dynamic", "pt2e static"):   # XNNPACK's int8
        rows["ExecuTorch int8 (XNNPACK)"] = (False, lambda m, x: ExecuTorch(
            m, x, torch.get_num_threads(), quantize="static" if quantization == "pt2e static" else "dynamic",
            calibration=calibration))
    if quantization == "int8 weight-only":
        rows["OpenVINO int8 weights (NNCF)"] = (False, lambda m, x: OpenVino(m, x, torch.get_num_threads(),
                                                                            quantize="weights"))
    return rows


def measure(name: str, quantization: str, threads: int, rounds: int, seconds: float) -> List[Dict[str, Any]]:
    torch.set_num_threads(threads)
    torch._dynamo.reset()
    build_model, _ = MODELS[name]
    torch.manual_seed(0)
    fp32, make_inputs = build_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantized = _quantizations()[quantization](copy.deepcopy(fp32), make_inputs)
    refs = [copy.deepcopy(quantized), copy.deepcopy(fp32)]   # each with its own cache, where it has one
    rows, steps = {}, {}
    for mode, (is_quantized, build) in rows_for(quantization, make_inputs, name in TRANSFORMERS).items():
        row = {"model": name, "quantization": quantization, "mode": mode, "threads": threads}
        rows[mode] = row
        try:
            with torch.no_grad(), quiet([]), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                fn = build(copy.deepcopy(quantized if is_quantized else fp32), make_inputs(0))
                bits, err_q, err_fp = True, 0.0, 0.0
                for i in range(CHECK_CALLS):
                    inputs = make_inputs(i)
                    got = fn(*copy.deepcopy(inputs))
                    q = compare(got, refs[0](*copy.deepcopy(inputs)))
                    f = compare(got, refs[1](*copy.deepcopy(inputs)))
                    bits, err_q, err_fp = bits and q["bitwise"], max(err_q, q["abs_err"]), max(err_fp, f["abs_err"])
        except Exception as e:  # noqa: BLE001 - a mode that fails says why in its row
            row["check"] = f"failed: {type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
            print(f"{threads}t {name} {quantization} {mode}: {row['check']}", file=sys.stderr, flush=True)
            continue
        row.update(bitwise_to_quantized_eager=bits, err_vs_quantized_eager=err_q, err_vs_fp32=err_fp)
        row["check"] = ("bitwise to the quantized eager" if bits else f"{err_q:.2g} from the quantized eager") + \
            f", {err_fp:.2g} from fp32"
        inputs = make_inputs(CHECK_CALLS)
        steps[mode] = (lambda f, x: lambda: f(*x))(fn, inputs)
        print(f"{threads}t {name} {quantization} {mode}: {row['check']}", file=sys.stderr, flush=True)
    for mode, timing in time_interleaved(steps, rounds, seconds * rounds).items():
        rows[mode].update(timing)
    q_eager = rows["eager"].get("median_us")
    fp32_capture = rows["fp32 capture"].get("median_us")
    for r in rows.values():
        if "median_us" in r:
            r["vs_quantized_eager"] = q_eager / r["median_us"] if q_eager else None
            r["vs_fp32_capture"] = fp32_capture / r["median_us"] if fp32_capture else None
    return list(rows.values())


def int8_instructions() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return "unknown"
    have = [x for x in ("avx512_vnni", "avx_vnni", "amx_int8") if x in flags]
    return ", ".join(have) or "none of VNNI, AMX"


def render(rows: List[Dict[str, Any]]) -> str:
    lines = [f"{'threads':>7}  {'model':<14}{'quantization':<18}{'mode':<22}{'us/call':>9}{'vs q-eager':>11}"
             f"{'vs fp32 cap':>12}  check"]
    for r in rows:
        us = f"{r['median_us']:.1f}" if "median_us" in r else "-"
        ratio = lambda k: f"{r[k]:.2f}x" if r.get(k) else "-"  # noqa: E731
        lines.append(f"{r['threads']:>7}  {r['model']:<14}{r['quantization']:<18}{r['mode']:<22}{us:>9}"
                     f"{ratio('vs_quantized_eager'):>11}{ratio('vs_fp32_capture'):>12}  {r['check']}")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--threads", default="1,2")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--seconds", type=float, default=0.3, help="timing per mode and round")
    p.add_argument("--out", default="bench_out")
    args = p.parse_args(argv)
    print(f"CPU int8 instructions: {int8_instructions()}; torch {torch.__version__}", file=sys.stderr)
    rows: List[Dict[str, Any]] = []
    for threads in [int(t) for t in args.threads.split(",")]:
        for name in args.models.split(","):
            for quantization in MODELS[name][1]:
                rows += measure(name, quantization, threads, args.rounds, args.seconds)
    print(render(rows))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "quantized.json"), "w") as f:
        json.dump({"cpu_int8": int8_instructions(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
