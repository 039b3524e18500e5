"""transformers' generate with a static cache, as reduce-overhead's users run it: tokens per second
and the first generate's time (compile and capture) per backend, with a bitwise check per row.

    python -m torchreplay_bench.generate [--archs llama,qwen2,mistral,gemma,phi3] [--threads 1,2]
                                         [--new-tokens 32] [--prompt 8] [--rounds 5] [--out DIR]

Tiny random configs (hidden 64, 2 layers, 4 heads, 2 key/value heads: grouped-query attention;
vocabulary 512; no downloads), one prompt, greedy. transformers compiles the decode step itself
(`compile_config=CompileConfig(backend=..., mode=...)`, with the private `_compile_all_devices`,
without which it compiles on CUDA only); the prefill runs eagerly. Modes:

  eager        generate as it is
  torchreplay  CompileConfig(backend="torchreplay")            (mode "reduce-overhead")
  inductor     CompileConfig(backend="inductor")               (mode "reduce-overhead")
  aot_eager    CompileConfig(backend="aot_eager", mode="default")

Each mode's first generate is timed alone (compile, warm-up and capture included); then rounds of
one generate per mode in turn, the median per mode. Every mode's tokens and the scores of every
step are compared with eager's: "bitwise", "same tokens" (scores close) or "WRONG" (other tokens).
Each thread count builds its models anew and resets Dynamo.

Where a compiled decode step's time goes, from one more generate per compiled mode under
torch.profiler (whose own cost inflates every range a little): per decode step, Dynamo's guard
check ("TorchDynamo Cache Lookup"), the compiled frame ("Torch-Compiled Region": the frame's
bytecode around the graph, and the graph's call) and, of that, the backend's graph call
("torchreplay::replay", Inductor's "## Call CompiledFxGraph ...", nothing for aot_eager). What is
left of a generate's time is transformers' Python between the steps and the eager prefill.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Dict, List, Optional

import torch

ARCHS = ["llama", "qwen2", "mistral", "gemma", "phi3"]
MODES = ["eager", "torchreplay", "inductor", "aot_eager"]
_BACKENDS = {"torchreplay": ("torchreplay", "reduce-overhead"), "inductor": ("inductor", "reduce-overhead"),
             "aot_eager": ("aot_eager", "default")}


def tiny_model(arch: str) -> Any:
    """A tiny random decoder of `arch` with grouped-query attention."""
    import transformers
    kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=512, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    config = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
              "mistral": transformers.MistralConfig, "gemma": transformers.GemmaConfig,
              "phi3": transformers.Phi3Config}[arch](**kw)
    if arch == "gemma":
        config.head_dim = 16
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def _compile_config(mode: str) -> Optional[Any]:
    if mode == "eager":
        return None
    import transformers
    backend, compile_mode = _BACKENDS[mode]
    cc = transformers.CompileConfig(backend=backend, mode=compile_mode)
    cc._compile_all_devices = True
    return cc


def _check(got: Any, want: Any) -> str:
    if not torch.equal(got.sequences, want.sequences):
        return "WRONG"
    same = all(torch.equal(g.view(torch.int32), w.view(torch.int32)) for g, w in zip(got.scores, want.scores))
    return "bitwise" if same else "same tokens"


_GRAPH_CALLS = ("torchreplay::replay", "## Call CompiledFxGraph")


def step_split(generate: Any) -> Dict[str, float]:
    """µs per compiled decode step in one `generate()` under torch.profiler: Dynamo's guard check,
    the compiled frame, and the backend's graph call inside it (0 where it records none)."""
    from torch.profiler import profile
    with profile() as p:
        generate()
    totals = {"guards_us": 0.0, "frame_us": 0.0, "graph_us": 0.0}
    steps = 0
    for e in p.events():
        if e.name == "TorchDynamo Cache Lookup":
            totals["guards_us"] += e.cpu_time_total
        elif e.name.startswith("Torch-Compiled Region"):
            totals["frame_us"] += e.cpu_time_total
            steps += 1
        elif e.name.startswith(_GRAPH_CALLS):
            totals["graph_us"] += e.cpu_time_total
    return {k: v / max(steps, 1) for k, v in totals.items()}


def bench(arch: str, threads: int, new_tokens: int, prompt: int, rounds: int, modes: List[str]) -> List[Dict[str, Any]]:
    torch.set_num_threads(threads)
    torch._dynamo.reset()
    ids = torch.randint(3, 512, (1, prompt), generator=torch.Generator().manual_seed(1))
    models = {m: tiny_model(arch) for m in modes}
    configs = {m: _compile_config(m) for m in modes}

    def generate(mode: str) -> Any:
        kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, cache_implementation="static",
                  output_scores=True, return_dict_in_generate=True, pad_token_id=0)
        if configs[mode] is not None:
            kw["compile_config"] = configs[mode]
        with torch.no_grad():
            return models[mode].generate(ids, **kw)

    reference = generate_eager(arch, ids, new_tokens)
    rows: Dict[str, Dict[str, Any]] = {}
    for mode in modes:
        t0 = time.perf_counter()
        out = generate(mode)
        first = time.perf_counter() - t0
        rows[mode] = {"arch": arch, "threads": threads, "mode": mode, "first_s": first, "check": _check(out, reference),
                      "times": []}
    for _ in range(rounds):
        for mode in modes:
            t0 = time.perf_counter()
            generate(mode)
            rows[mode]["times"].append(time.perf_counter() - t0)
    for mode in modes:
        if mode != "eager":
            rows[mode].update(step_split(lambda: generate(mode)))
    for r in rows.values():
        r["ms"] = statistics.median(r["times"]) * 1e3
        r["tokens_per_s"] = new_tokens / (r["ms"] / 1e3)
        del r["times"]
    eager_ms = rows["eager"]["ms"] if "eager" in rows else None
    for r in rows.values():
        r["vs_eager"] = eager_ms / r["ms"] if eager_ms else None
    return list(rows.values())


def generate_eager(arch: str, ids: torch.Tensor, new_tokens: int) -> Any:
    with torch.no_grad():
        return tiny_model(arch).generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                         cache_implementation="static", output_scores=True,
                                         return_dict_in_generate=True, pad_token_id=0)


def _table(rows: List[Dict[str, Any]], new_tokens: int, prompt: int) -> str:
    lines = [f"generate: {new_tokens} new tokens after a {prompt}-token prompt, static cache; ms per generate "
             "(median), tokens/s, speedup against eager, first generate (compile + capture), check against eager"
             "; per compiled decode step under torch.profiler, µs: Dynamo's guards, the compiled frame, the "
             "backend's graph call in it",
             f"  {'arch':<9}{'threads':>8}  {'mode':<12}{'ms':>9}{'tok/s':>9}{'vs eager':>10}{'first s':>10}"
             f"{'guards':>8}{'frame':>8}{'graph':>8}  check"]
    for r in rows:
        vs = f"{r['vs_eager']:.2f}x" if r["vs_eager"] else "-"
        split = "".join(f"{r[k]:>8.0f}" if k in r else f"{'-':>8}" for k in ("guards_us", "frame_us", "graph_us"))
        lines.append(f"  {r['arch']:<9}{r['threads']:>8}  {r['mode']:<12}{r['ms']:>9.2f}{r['tokens_per_s']:>9.0f}"
                     f"{vs:>10}{r['first_s']:>10.2f}{split}  {r['check']}")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m torchreplay_bench.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--archs", default=",".join(ARCHS))
    p.add_argument("--threads", default="1,2")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--prompt", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default="bench_out")
    a = p.parse_args(argv)
    archs, modes = a.archs.split(","), a.modes.split(",")
    if any(x not in ARCHS for x in archs) or any(m not in MODES for m in modes):
        p.error(f"archs among {ARCHS}, modes among {MODES}")
    import torchreplay  # noqa: F401 (registers the backend)
    rows = [r for t in (int(x) for x in a.threads.split(",")) for arch in archs
            for r in bench(arch, t, a.new_tokens, a.prompt, a.rounds, modes)]
    print(_table(rows, a.new_tokens, a.prompt))
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "generate.json"), "w") as f:
        json.dump(rows, f, indent=1)
    ours_wrong = [r for r in rows if r["mode"] == "torchreplay" and r["check"] != "bitwise"]
    return 1 if ours_wrong or any(r["check"] == "WRONG" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
