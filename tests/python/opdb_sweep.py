"""PyTorch's op database as a differential test: every OpInfo's CPU samples through torchreplay,
compared with eager bit for bit.

    .venv/bin/python tests/python/opdb_sweep.py                 # the whole sweep, both entry points
    .venv/bin/python tests/python/opdb_sweep.py --ops add,qr --dtypes float32 --entry compile
    .venv/bin/python tests/python/opdb_sweep.py --shard 0/2 --json out.json   # half of it
    .venv/bin/python tests/python/opdb_sweep.py --summarize a.json b.json      # shards' summary together

Each case is one op, one of its first sample inputs, one dtype and one entry point:
`torch.compile(backend=torchreplay, mode "reduce-overhead")` or `torchreplay.capture`. The case
is called CALLS times, each on fresh sample inputs of the same structure (regenerated with
another seed; the first sample's values again where the regenerated structure differs): warm-up,
capture, then replays. Before each call the random generator is seeded, and eager runs the op on
copies of the same inputs under the same seed. Outputs and every tensor argument afterwards
(inputs the op writes) are compared with eager's by their bits (dtype, shape and strides too).

Outcomes, one per case:
  bitwise       every call equal to eager, bit for bit, and replays happened
  as-reference  what torchreplay builds on gives the same without torchreplay: torch.compile with
                backend="aot_eager" (AOTAutograd's decompositions change the arithmetic), or the
                module torch.export makes, with the decompositions capture applies (capture); bit
                for bit, or the same exception
  random        a random op: equal to eager in dtype and shape, its values drawn from the same
                distribution (mean and spread within tolerance); exact bits are not promised
  wrong         a result that differs from eager (and from aot_eager)
  error         torchreplay raised where eager did not
  not-replayed  nothing was replayed: Dynamo made no graph, the graph ran eagerly (the reason is
                printed), or the export refused the function (capture)
Cases whose eager run raises (samples that test error paths) are skipped.
"""
from __future__ import annotations

import argparse
import collections
import json
import math
import os
import sys
import time
import traceback
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch.utils import _pytree as pytree

import torchreplay
from differential import bitwise_diff, snapshot

CALLS = 4  # warm-up, capture (+ replay), replay, replay
OUTCOMES = ["bitwise", "as-reference", "random", "wrong", "error", "not-replayed"]
DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
          "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32, "bool": torch.bool}
ENTRIES = ("compile", "capture")


def op_db() -> List[Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.testing._internal.common_methods_invocations import op_db as db
    return list(db)


def samples(op: Any, dtype: torch.dtype, seed: int, limit: int) -> List[Any]:
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = []
        for s in op.sample_inputs("cpu", dtype, requires_grad=False):
            out.append(s)
            if len(out) == limit:
                break
    return out


def _structure(x: Any) -> Any:
    leaves, spec = pytree.tree_flatten(x)
    return spec, [(t.dtype, t.layout, t.shape, t.stride() if t.layout == torch.strided else None)
                  if isinstance(t, torch.Tensor) else
                  (type(t), t if isinstance(t, (int, float, bool, str, type(None))) else None) for t in leaves]


def _fresh_tensors(first: Any, fresh: Any) -> Any:
    """`first` with the tensors of `fresh` (same structure): other arguments (modules, dtypes, ...)
    stay the objects the first call had, as a caller's would."""
    a, spec = pytree.tree_flatten(first)
    b, _ = pytree.tree_flatten(fresh)
    return pytree.tree_unflatten([y if isinstance(y, torch.Tensor) else x for x, y in zip(a, b)], spec)


def _clone(x: Any) -> Any:
    return pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, x)


def _snapshot(x: Any) -> Any:
    """Copies of x's tensors with their strides (a pool output may be reused by the next call)."""
    return pytree.tree_map(lambda t: snapshot(t) if isinstance(t, torch.Tensor) else t, x)


def differs(a: Any, b: Any, strides: bool = True) -> Optional[str]:
    """None if b (torchreplay's) is a (the reference's) bit for bit (differential.bitwise_diff:
    dtypes, shapes, strides, every element's bits); else what differs first."""
    la, sa = pytree.tree_flatten(a)
    lb, sb = pytree.tree_flatten(b)
    if sa != sb:
        return f"structure {sb} vs {sa}"
    for i, (x, y) in enumerate(zip(la, lb)):
        d = bitwise_diff(y, x, f"leaf {i}", strides=strides)
        if d is None:
            continue
        if (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.shape == y.shape
                and x.dtype == y.dtype and (x.is_floating_point() or x.is_complex()) and x.layout == torch.strided
                and y.layout == torch.strided):
            dd = (y.detach().resolve_conj() - x.detach().resolve_conj()).abs().double()
            d += f" (max |diff| {dd.nan_to_num(nan=float('inf')).max().item():.3g})" if dd.numel() else ""
        return d
    return None


def _meta(x: Any) -> Any:
    return (x.dtype, tuple(x.shape)) if isinstance(x, torch.Tensor) else x


def _same_distribution(a: Any, b: Any) -> bool:
    """For random ops: same structure, dtypes and shapes, and floating results with a similar mean
    and spread (integer and bool results: a similar mean)."""
    la, sa = pytree.tree_flatten(a)
    lb, sb = pytree.tree_flatten(b)
    if sa != sb:
        return False
    for x, y in zip(la, lb):
        if not isinstance(x, torch.Tensor):
            continue
        if not isinstance(y, torch.Tensor) or x.dtype != y.dtype or x.shape != y.shape:
            return False
        if x.numel() < 16 or x.is_complex():
            continue
        xd, yd = x.double(), y.double()
        if not (xd.isfinite().all() and yd.isfinite().all()):
            continue
        scale = max(xd.std().item(), yd.std().item(), 1e-6)
        if abs(xd.mean().item() - yd.mean().item()) > 4 * scale / math.sqrt(x.numel()) + 0.05 * scale:
            return False
    return True


class Case:
    def __init__(self, op: Any, dtype_name: str, index: int, entry: str) -> None:
        self.op, self.dtype_name, self.index, self.entry = op, dtype_name, index, entry
        self.outcome, self.detail = "", ""

    @property
    def name(self) -> str:
        variant = f".{self.op.variant_test_name}" if self.op.variant_test_name else ""
        return f"{self.op.name}{variant}[{self.dtype_name}#{self.index}]/{self.entry}"


def _call_op(op: Any) -> Callable:
    def fn(inp: Any, *args: Any, **kwargs: Any) -> Any:
        return op(inp, *args, **kwargs)
    return fn


def _inputs(sample: Any) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    return (sample.input, *sample.args), dict(sample.kwargs)


def _eager(fn: Callable, args: Sequence[Any], kwargs: Dict[str, Any], seed: int) -> Tuple[Any, Any]:
    args, kwargs = _clone((tuple(args), kwargs))
    torch.manual_seed(seed)
    out = fn(*args, **kwargs)
    return _snapshot(out), (args, kwargs)


DUMP_DIR: Optional[str] = None  # --refusals: where the captured tapes' plans are written


def _config() -> Any:
    cfg = torchreplay.CompilerConfig()
    cfg.mode = "reduce-overhead"
    cfg.reduce_overhead.warmup_iters = 1
    if DUMP_DIR:
        cfg.debug.graph_dump.type = "txt"
        cfg.debug.graph_dump.path = DUMP_DIR
    return cfg


def refusals(dump_dir: str) -> List[Tuple[str, str, int]]:
    """The out= overloads the recording refused (Note [Checked out= kernels]), from the plans of
    every captured tape: (overload, why, how many tapes)."""
    import glob
    import re
    seen: collections.Counter = collections.Counter()
    for path in glob.glob(os.path.join(dump_dir, "*.key*.txt")):
        with open(path) as f:
            for m in re.finditer(r"\((aten::[\w.]+) refused: ([^\n]*)\)\n", f.read()):
                why = re.sub(r"\d+", "N", m.group(2))[:120]
                seen[(m.group(1), why)] += 1
    return [(op, why, n) for (op, why), n in seen.most_common()]


def run_case(case: Case, calls: List[Tuple[Tuple[Any, ...], Dict[str, Any]]]) -> Case:
    # Over 80 lines: eager, both entry points and every comparison of one case, in the order they run.
    fn = _call_op(case.op)
    seeds = [1000 + k for k in range(len(calls))]
    # Eager, twice per call under the same seed: a result that changes is not deterministic.
    eager = []
    try:
        for (args, kwargs), seed in zip(calls, seeds):
            eager.append(_eager(fn, args, kwargs, seed))
        again = _eager(fn, *calls[0], seeds[0])
    except Exception as e:  # noqa: BLE001 - a sample of an error path
        case.outcome, case.detail = "skip", f"eager raised {type(e).__name__}"
        return case
    # Uninitialized memory (empty, new_empty, ...) may repeat by chance: its ops by name too.
    nondeterministic = differs(eager[0], again) is not None or "empty" in case.op.name
    random_op = nondeterministic or differs(eager[0], _eager(fn, *calls[0], seeds[0] + 7)) is not None

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    backend = None
    stats: Callable[[], List[Dict[str, Any]]]
    got = []
    try:
        if case.entry == "compile":
            backend = torchreplay.get_backend(compiler_config=_config())
            compiled = torch.compile(fn, backend=backend, dynamic=False)
            stats = backend.stats
        else:
            args0, kwargs0 = _clone(calls[0])
            try:
                compiled = torchreplay.capture(fn, args0, kwargs0, config=_config())
            except Exception as e:  # noqa: BLE001
                if not _is_refusal(e):
                    raise
                case.outcome, case.detail = "not-replayed", f"capture refused: {type(e).__name__}: {e}"[:300]
                return case
            stats = lambda: [compiled.stats()]  # noqa: E731
        for (args, kwargs), seed in zip(calls, seeds):
            args, kwargs = _clone((tuple(args), kwargs))
            torch.manual_seed(seed)
            out = compiled(*args, **kwargs)
            got.append((_snapshot(out), (args, kwargs)))
    except Exception as e:  # noqa: BLE001
        text = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
        ref = _reference_error(case, fn, calls, seeds)
        if ref is not None and type(ref) is type(e):
            case.outcome, case.detail = "as-reference", f"{_REFERENCE[case.entry]} raises too: {text}"
        else:
            case.outcome, case.detail = "error", text
        return case
    engine_stats = stats()
    replays = sum(s["replays"] for s in engine_stats)
    if replays == 0:
        reasons = [r for s in engine_stats for r in s.get("fallback_reasons", [])]
        why = "; ".join(sorted({str(r)[:160] for r in reasons})) or (
            "no graph reached torchreplay" if not engine_stats else "no replay")
        if case.entry == "compile" and not engine_stats:
            breaks = sorted(torch._dynamo.utils.counters["graph_break"])
            why = ("Dynamo graph break: " + "; ".join(b[:120] for b in breaks[:2]) if breaks else
                   "not lowered: " + "; ".join(v[:160] for v in backend.eager_graphs.values())
                   if backend.eager_graphs else "Dynamo made no graph")
        case.outcome, case.detail = "not-replayed", why
        return case
    # Compare: outputs and the arguments after the call.
    first = None
    for k, ((e_out, e_in), (g_out, g_in)) in enumerate(zip(eager, got)):
        d = differs((e_out, e_in), (g_out, g_in), strides=not nondeterministic)
        if d is not None:
            first = (k, d)
            break
    if first is None:
        case.outcome = "bitwise"
        return case
    if nondeterministic:  # uninitialized memory (empty): only dtypes and shapes mean anything
        same = all(differs(pytree.tree_map(_meta, e), pytree.tree_map(_meta, g)) is None for e, g in zip(eager, got))
        case.outcome, case.detail = ("random", "") if same else ("wrong", f"call {first[0]}: {first[1]}")
        return case
    if random_op:
        same = all(_same_distribution((e_out, e_in), (g_out, g_in)) for (e_out, e_in), (g_out, g_in) in zip(eager, got))
        case.outcome, case.detail = ("random", "") if same else ("wrong", f"call {first[0]}: {first[1]}")
        return case
    # Not bitwise: is it what the reference gives (AOTAutograd's or the export's decompositions)?
    torch._dynamo.reset()
    try:
        aot = _reference_path(case.entry, fn, *_clone(calls[0]))
        aot_out = []
        for (args, kwargs), seed in zip(calls, seeds):
            args, kwargs = _clone((tuple(args), kwargs))
            torch.manual_seed(seed)
            aot_out.append((_snapshot(aot(*args, **kwargs)), (args, kwargs)))
        if all(differs(a, g) is None for a, g in zip(aot_out, got)):
            case.outcome, case.detail = "as-reference", f"as {_REFERENCE[case.entry]}; eager differs: {first[1]}"
            return case
    except Exception:  # noqa: BLE001 - aot_eager failing says nothing about torchreplay
        pass
    case.outcome, case.detail = "wrong", f"call {first[0]}: {first[1]}"
    return case


_REFERENCE = {"compile": "aot_eager", "capture": "torch.export's module (decomposed as capture does)"}


def _reference_path(entry: str, fn: Callable, args: Any, kwargs: Any) -> Callable:
    """What torchreplay's entry point builds on, without torchreplay: torch.compile with
    aot_eager (AOTAutograd's graph run by PyTorch), or the module torch.export gives."""
    if entry == "compile":
        return torch.compile(fn, backend="aot_eager", dynamic=False)

    class M(torch.nn.Module):
        def forward(self, *a: Any, **k: Any) -> Any:
            return fn(*a, **k)

    from torchreplay.export import _decompositions   # the ones capture applies
    ep = torch.export.export(M(), tuple(args), kwargs, strict=False)
    return ep.run_decompositions(_decompositions(None)).module()


def _reference_error(case: "Case", fn: Callable, calls: Any, seeds: Sequence[int]) -> Optional[Exception]:
    """The exception the reference path raises on the same calls, if it raises."""
    torch._dynamo.reset()
    try:
        ref = _reference_path(case.entry, fn, *_clone(calls[0]))
        for (args, kwargs), seed in zip(calls, seeds):
            args, kwargs = _clone((tuple(args), kwargs))
            torch.manual_seed(seed)
            ref(*args, **kwargs)
    except Exception as e:  # noqa: BLE001
        return e
    return None


def _is_refusal(e: Exception) -> bool:
    """An error that refuses a capture for a stated reason (the export's, or torchreplay's: a
    ValueError, TypeError or NotImplementedError), rather than one that breaks inside."""
    mod = type(e).__module__ or ""
    return (any(m in mod for m in ("torch._dynamo", "torch.export", "torch._export", "torch.fx", "torch._subclasses"))
            or type(e) in (ValueError, TypeError, NotImplementedError) or "Unsupported" in type(e).__name__)


def cases_for(op: Any, dtype_name: str, limit: int, entries: Sequence[str]) -> List[Tuple[Case, Any]]:
    dtype = DTYPES[dtype_name]
    if dtype not in op.supported_dtypes("cpu"):
        return []
    try:
        base = samples(op, dtype, 0, limit)
        fresh = [samples(op, dtype, seed, limit) for seed in range(1, CALLS)]
    except Exception:  # noqa: BLE001 - an OpInfo that cannot make samples here
        return []
    out = []
    for i, s in enumerate(base):
        calls = [_inputs(s)]
        for more in fresh:
            t = _inputs(more[i]) if i < len(more) else None
            calls.append(_fresh_tensors(calls[0], t) if t is not None and _structure(t) == _structure(calls[0])
                         else _clone(calls[0]))
        for entry in entries:
            out.append((Case(op, dtype_name, i, entry), calls))
    return out


def summarize(cases: Sequence[Any]) -> str:
    """The summary table of cases (Case objects, or the dicts --json writes)."""
    rows: Dict[Tuple[str, str], collections.Counter] = collections.defaultdict(collections.Counter)
    for c in cases:
        entry, dtype, outcome = ((c["entry"], c["dtype"], c["outcome"]) if isinstance(c, dict)
                                 else (c.entry, c.dtype_name, c.outcome))
        if outcome != "skip":
            rows[(entry, dtype)][outcome] += 1
    lines = ["| entry | dtype | cases | " + " | ".join(OUTCOMES) + " |",
             "|---|---|---:|" + "---:|" * len(OUTCOMES)]
    for entry in ENTRIES:
        total = collections.Counter()
        for dtype in DTYPES:
            c = rows.get((entry, dtype))
            if not c:
                continue
            total += c
            lines.append(f"| {entry} | {dtype} | {sum(c.values())} | " + " | ".join(str(c[o]) for o in OUTCOMES) + " |")
        if total:
            lines.append(f"| {entry} | all | {sum(total.values())} | " + " | ".join(str(total[o]) for o in OUTCOMES) + " |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", help="comma-separated OpInfo names (default: all)")
    p.add_argument("--dtypes", default=",".join(DTYPES), help="comma-separated, of " + ", ".join(DTYPES))
    p.add_argument("--entry", choices=ENTRIES + ("both",), default="both")
    p.add_argument("--samples", type=int, default=3, help="sample inputs per op and dtype")
    p.add_argument("--shard", default="0/1", help="i/n: every n-th op from the i-th")
    p.add_argument("--json", help="write every case here")
    p.add_argument("--quiet", action="store_true", help="print only the cases that are not bitwise")
    p.add_argument("--refusals", action="store_true",
                   help="also list the out= overloads refused while recording (Note [Checked out= kernels])")
    p.add_argument("--summarize", nargs="+", metavar="JSON",
                   help="print the summary of cases written by --json (several shards together) and exit")
    a = p.parse_args(argv)
    if a.summarize:
        cases: List[Dict[str, Any]] = []
        for path in a.summarize:
            with open(path) as f:
                cases += json.load(f)
        print(summarize(cases))
        for c in cases:
            if c["outcome"] in ("wrong", "error"):
                print(f"{c['outcome']:13s} {c['op']}.{c['variant']}[{c['dtype']}#{c['sample']}]/{c['entry']} {c['detail']}")
        return 0 if not any(c["outcome"] in ("wrong", "error") for c in cases) else 1
    torch.set_num_threads(1)
    logging_off()
    warnings.simplefilter("ignore")
    global DUMP_DIR
    if a.refusals:
        import tempfile
        DUMP_DIR = tempfile.mkdtemp(prefix="opdb-plans-")
    wanted = set(a.ops.split(",")) if a.ops else None
    entries = ENTRIES if a.entry == "both" else (a.entry,)
    shard, of = (int(x) for x in a.shard.split("/"))
    ops = [op for op in op_db() if wanted is None or op.name in wanted]
    ops = ops[shard::of]
    done: List[Case] = []
    t0 = time.time()
    for n, op in enumerate(ops):
        for dtype_name in a.dtypes.split(","):
            for case, calls in cases_for(op, dtype_name, a.samples, entries):
                try:
                    run_case(case, calls)
                except Exception as e:  # noqa: BLE001 - the sweep goes on
                    case.outcome, case.detail = "error", f"sweep: {type(e).__name__}: {e}"[:300]
                    traceback.print_exc()
                done.append(case)
                if case.outcome != "skip" and (not a.quiet or case.outcome not in ("bitwise", "random")):
                    print(f"{case.outcome:13s} {case.name} {case.detail}", flush=True)
        if (n + 1) % 25 == 0:
            print(f"# {n + 1}/{len(ops)} ops, {len(done)} cases, {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    print(summarize(done))
    if DUMP_DIR:
        print("\nout= overloads refused while recording (they run functionally):")
        for op, why, n in refusals(DUMP_DIR):
            print(f"  {op}: {why} ({n} tapes)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump([dict(op=c.op.name, variant=c.op.variant_test_name, dtype=c.dtype_name, sample=c.index,
                            entry=c.entry, outcome=c.outcome, detail=c.detail) for c in done], f, indent=0)
    return 0 if not any(c.outcome in ("wrong", "error") for c in done) else 1


def logging_off() -> None:
    """The sweep's own output only (its cases fall back and recompile on purpose)."""
    import logging
    logging.getLogger("torchreplay").setLevel(logging.ERROR)
    torchreplay._C.set_log_level(3)


if __name__ == "__main__":
    sys.exit(main())
