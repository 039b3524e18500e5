"""The harness's report: the table per model and mode, the summary that splits torchreplay's time
through torch.compile, the host-time and trace tables, and the plot.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from torchreplay_bench.models import MODELS
from torchreplay_bench.modes import MODES, REFERENCES

def plot(rows: List[Dict[str, Any]], path: str) -> None:
    """Time per call on a log axis: on the left what a user picks between (eager, torchreplay
    through torch.compile and capture, Inductor, AOTInductor, ...), on the right the reference
    rows (Dynamo's floor, the bare engine, ...), hatched: they are no product to pick."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows}, key=list(MODELS).index)
    timed = [m for m in MODES if any(r["mode"] == m and "median_us" in r for r in rows)]
    panels = [("what to pick between", [m for m in timed if m not in REFERENCES]),
              ("references (not products)", [m for m in timed if m in REFERENCES])]
    panels = [(title, modes) for title, modes in panels if modes]
    fig, axes = plt.subplots(1, len(panels), figsize=(2 + 2.2 * len(models) * len(panels), 4.5), squeeze=False)
    for ax, (title, modes) in zip(axes[0], panels):
        width = 0.8 / max(1, len(modes))
        for j, mode in enumerate(modes):
            ys = [next((r["median_us"] for r in rows if r["model"] == m and r["mode"] == mode and "median_us" in r),
                       float("nan")) for m in models]
            ax.bar([i + j * width for i in range(len(models))], ys, width, label=mode,
                   hatch="//" if mode in REFERENCES else None)
        ax.set_yscale("log")
        ax.set_xticks([i + width * (len(modes) - 1) / 2 for i in range(len(models))], models, fontsize=7)
        ax.set_ylabel("us per call (log scale, lower is better)")
        ax.set_title(title)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def render_table(rows: List[Dict[str, Any]], models: List[str], modes: List[str], device: str) -> str:
    host = device == "cuda"
    where = torch.cuda.get_device_name() if host else f"{torch.get_num_threads()} threads"
    lines = [f"torchreplay benchmark: device {device} ({where}), torch {torch.__version__}",
             f"{'model':<18}{'mode':<38}{'us/call':>10}{'iqr':>8}{'vs eager':>10}{'compile s':>11}"
             + (f"{'host us':>10}" if host else "") + "  check"]
    for m in models:
        for mode in modes:
            r = next((x for x in rows if x["model"] == m and x["mode"] == mode), None)
            if r is None:
                continue
            if "median_us" not in r:
                why = r.get("error", "output differs from eager")
                lines.append(f"{m:<18}{mode:<38}{'WRONG':>10}{'':>8}{'':>10}{r.get('compile_s', 0):>11.2f}  {why}")
                continue
            check = r.get("check") or ("bitwise" if r["bitwise"] else "close")
            lines.append(f"{m:<18}{mode:<38}{r['median_us']:>10.1f}{r['iqr_us']:>8.1f}"
                         f"{r.get('speedup', 0):>9.2f}x{r['compile_s']:>11.2f}"
                         + (f"{r.get('host_us', 0):>10.1f}" if host else "") + f"  {check}")
    return "\n".join(lines)


def summarize(rows: List[Dict[str, Any]], models: List[str]) -> List[Dict[str, Any]]:
    """Per model: eager, dynamo-floor, engine and torchreplay reduce-overhead through torch.compile
    (us per call), what the torch.compile path adds (ours - floor - engine) and ours vs eager."""
    def us(model: str, mode: str) -> Optional[float]:
        r = next((x for x in rows if x["model"] == model and x["mode"] == mode), None)
        return r.get("median_us") if r else None

    out = []
    for m in models:
        eager, floor, engine, both, ours, captured, by_hand = (
            us(m, mode) for mode in ("eager", "dynamo-floor", "engine", "floor+engine",
                                     "torchreplay-reduce-overhead", "torchreplay-capture", "out-by-hand"))
        if ours is None:
            continue
        out.append({"model": m, "eager_us": eager, "dynamo_floor_us": floor, "engine_us": engine, "ours_us": ours,
                    "added_us": ours - floor - engine if floor is not None and engine is not None else None,
                    "floor_then_engine_us": both, "added_over_back_to_back_us": ours - both if both else None,
                    "ours_vs_eager": eager / ours if eager is not None else None,
                    "capture_us": captured, "out_by_hand_us": by_hand,
                    "capture_vs_eager": eager / captured if eager is not None and captured else None})
    return out


def render_summary(summary: List[Dict[str, Any]]) -> str:
    def cell(v: Optional[float], fmt: str = "{:.1f}") -> str:
        return "-" if v is None else fmt.format(v)

    lines = ["where torchreplay reduce-overhead's time goes, us per call (ours: through torch.compile; "
             "added = ours - floor - engine; back to back: floor then engine, nothing of ours between; "
             "capture: torchreplay.capture, no Dynamo)",
             f"{'model':<18}{'eager':>9}{'dynamo-floor':>14}{'engine':>9}{'ours':>9}{'added':>9}{'ours vs eager':>15}"
             f"{'back to back':>14}{'ours - it':>11}{'capture':>9}{'capture vs eager':>18}{'out= by hand':>14}"]
    for s in summary:
        lines.append(f"{s['model']:<18}{cell(s['eager_us']):>9}{cell(s['dynamo_floor_us']):>14}{cell(s['engine_us']):>9}"
                     f"{cell(s['ours_us']):>9}{cell(s['added_us']):>9}{cell(s['ours_vs_eager'], '{:.2f}x'):>15}"
                     f"{cell(s.get('floor_then_engine_us')):>14}{cell(s.get('added_over_back_to_back_us')):>11}"
                     f"{cell(s.get('capture_us')):>9}{cell(s.get('capture_vs_eager'), '{:.2f}x'):>18}"
                     f"{cell(s.get('out_by_hand_us')):>14}")
    return "\n".join(lines)


def render_host_ratios(rows: List[Dict[str, Any]], models: List[str]) -> str:
    """Host time per call of torchreplay against the graph-replay peers (CUDA)."""
    def host(model: str, mode: str) -> Optional[float]:
        r = next((x for x in rows if x["model"] == model and x["mode"] == mode), None)
        return r.get("host_us") if r and r.get("correct") else None

    lines = ["host time per call, torchreplay reduce-overhead (PyTorch's cudagraph trees around the engine) "
             "against (lower is better for torchreplay); own graphs: torchreplay's own CUDA graphs / it",
             f"{'model':<18}{'x by-hand replay':>18}{'cudagraphs / it':>17}{'inductor-ro / it':>18}"
             f"{'own graphs / it':>17}"]
    for m in models:
        ours = host(m, "torchreplay-reduce-overhead")
        if not ours:
            continue
        cells = []
        for mode, ratio in (("cuda-graph-by-hand", lambda o: ours / o), ("cudagraphs", lambda o: o / ours),
                            ("inductor-reduce-overhead", lambda o: o / ours),
                            ("torchreplay-own-cuda-graphs", lambda o: o / ours)):
            other = host(m, mode)
            cells.append(f"{ratio(other):.2f}x" if other else "-")
        lines.append(f"{m:<18}{cells[0]:>18}{cells[1]:>17}{cells[2]:>18}{cells[3]:>17}")
    return "\n".join(lines)


def render_trace_table(rows: List[Dict[str, Any]]) -> str:
    lines = [f"profiler traces (median per step; python -m torchreplay.trace summarize FILE for the rest)",
             f"{'model':<18}{'mode':<30}{'host us':>10}{'replays':>9}{'aten ops':>10}{'launches':>10}{'graph launches':>16}  file"]
    for r in rows:
        if "trace" not in r:
            continue
        lines.append(f"{r['model']:<18}{r['mode']:<30}{r['trace_host_us']:>10.1f}{r['trace_replays']:>9.0f}"
                     f"{r['trace_aten_ops']:>10.0f}{r['trace_kernel_launches']:>10.0f}{r['trace_graph_launches']:>16.0f}"
                     f"  {r['trace']}")
    return "\n".join(lines)
