"""Large causal language models per method: peak memory, step time and samples/s of one training step on OPT
(and Llama) shapes with random weights, batch 8, sequence 128, bf16 autocast, one process per size and method.

Methods (``dpopt bench`` systems): non-private Adam (``pytorch``), the forward pass alone (``inference``),
dpopt's DP-Adam (``dpopt``), DP-GRAPE (``dp-grape``, rank 16), DPZero (``dpzero``) and DiSK on Adam
(``disk-adam``). Sizes run smallest first; each (size, method) is its own process with its address space
capped at ``--memory-gb`` (on the CPU), so running out of memory costs that row alone, and a method that
failed at one size is not tried at larger ones. A size whose parameters and optimizer state alone exceed the
cap (``floor_gb``: bytes per parameter the method must hold, a lower bound) is recorded as skipped rather
than run. Writes ``OUT/results.jsonl`` (a row per process, appended as it finishes) and ``OUT/table.md``
(a table per method, the largest size that completed a step, and the papers' numbers beside).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from dpopt import bench, model_shapes

METHODS = {"pytorch": "non-private Adam", "inference": "inference (forward only)", "dpopt": "DP-Adam",
           "dp-grape": "DP-GRAPE (rank 16)", "dpzero": "DPZero", "disk-adam": "DiSK (Adam)"}
DEFAULT_SIZES = ("opt-125m", "opt-350m", "opt-1.3b", "opt-2.7b", "opt-6.7b", "opt-13b", "opt-30b")
# Bytes per parameter a step must hold whatever else it does, in float32: the weights, plus for Adam the
# gradient (or clipped sum) and two moments, plus for DiSK its filter's estimate and last parameter change. DP-GRAPE's moments and sums are
# projected (small) and DPZero holds the weights alone, so both are bounded by the weights.
FLOOR_BYTES = {"pytorch": 16, "inference": 4, "dpopt": 16, "dp-grape": 4, "dpzero": 4, "disk-adam": 24}
# The papers' numbers, beside ours (different hardware and implementations: for scale, not for a ratio).
PAPERS = {
    ("opt-1.3b", "dpzero"): "14.8 samples/s (DP-GRAPE Table 13, H100)",
    ("opt-2.7b", "dpzero"): "8.6 samples/s (DP-GRAPE Table 13, H100)",
    ("opt-6.7b", "dpzero"): "4.1 samples/s (DP-GRAPE Table 13, H100); fits a 24 GB GPU (DPZero Table 11)",
    ("opt-1.3b", "dp-grape"): "10.7 samples/s (DP-GRAPE Table 13, H100)",
    ("opt-2.7b", "dp-grape"): "5.6 samples/s (DP-GRAPE Table 13, H100)",
    ("opt-6.7b", "dp-grape"): "2.5 samples/s (DP-GRAPE Table 13, H100)",
    ("opt-6.7b", "dpopt"): "out of memory on an 80 GB H100 (DP-GRAPE Table 13)",
    ("opt-350m", "dp-grape"): "RoBERTa-large (355M), batch 40: 24.4 GB (DP-GRAPE)",
    ("opt-350m", "dpopt"): "RoBERTa-large (355M), batch 40: 78.1 GB (DP-GRAPE's DP-Adam)",
}


def floor_gb(method: str, size: str) -> float:
    """A lower bound (GB) of what ``method`` holds on shape ``size``: ``FLOOR_BYTES`` per parameter."""
    return FLOOR_BYTES[method] * model_shapes.parameter_count(size) / 2**30


def _settings(a: argparse.Namespace) -> dict[str, Any]:
    """What makes two rows comparable."""
    return {k: getattr(a, k) for k in ("batch", "seq", "precision", "device", "rank", "threads", "memory_gb", "warmup",
                                       "steps")}


def earlier_rows(path: Path, a: argparse.Namespace) -> list[dict[str, Any]]:
    """The rows of ``path`` measured with this run's settings for a (size, method) this run does not measure, so
    that a later run with other sizes extends the table."""
    if not path.is_file():
        return []
    planned = {(s, m) for s in a.sizes for m in a.methods}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    latest = {(r["size"], r["method"]): r for r in rows if all(r.get(k) == v for k, v in _settings(a).items())}
    return [r for key, r in latest.items() if key not in planned]


def run_row(size: str, method: str, a: argparse.Namespace) -> dict[str, Any]:
    """One (size, method): skipped if its floor exceeds the cap, else measured in its own process."""
    row: dict[str, Any] = {"size": size, "method": method, **_settings(a),
                           "parameters": model_shapes.parameter_count(size)}
    limit = int(a.memory_gb * 2**30) if a.device == "cpu" else None
    floor = floor_gb(method, size)
    if limit and floor * 2**30 > limit:
        return {**row, "error": f"skipped: needs at least {floor:.1f} GB (weights and optimizer state), "
                                f"over the {a.memory_gb:g} GB cap"}
    case = bench.Case(size, a.batch, a.seq, "adam", a.rank, a.threads, device=a.device, precision=a.precision)
    result = bench.measure(method, case, a.warmup, a.steps, timeout=a.timeout, memory_limit=limit)
    if "s_per_step" in result:
        result["samples_per_s"] = a.batch / result["s_per_step"]
    return {**row, **result}


def _cell(r: dict[str, Any]) -> list[str]:
    if "error" in r:
        return [r["error"][:100], "", "", ""]
    return [f"{r['peak_mb'] / 1024:.2f}", f"{r['s_per_step']:.1f}", f"{r['cpu_s_per_step']:.1f}",
            f"{r['samples_per_s']:.2f}"]


def _ratio(by: dict[tuple[str, str], dict[str, Any]], size: str, method: str, reference: str) -> str:
    """``method``'s peak over ``reference``'s at ``size``, or a dash where either did not complete a step."""
    top, bottom = by.get((size, method), {}), by.get((size, reference), {})
    return f"{top['peak_mb'] / bottom['peak_mb']:.3f}" if "peak_mb" in top and "peak_mb" in bottom else "—"


def table(rows: list[dict[str, Any]], a: argparse.Namespace) -> str:
    """A table per method (peak GB, s/step, samples/s per size, the papers' numbers beside), then the largest
    size that completed a step per method, then the memory ratios at each size where both ran."""
    cap = f", address space capped at {a.memory_gb:g} GB per process" if a.device == "cpu" else ""
    timing = (f"median of {a.steps} step(s) after {a.warmup} warm-up" if a.steps else
              f"one step after {a.warmup} warm-up, timed while its peak is measured")
    lines = [f"batch {a.batch}, sequence {a.seq}, {a.precision} autocast, {a.device}, {a.threads} thread(s){cap}; "
             f"{timing}; peak: dpopt.bench's peak live-tensor memory (CUDA: max_memory_allocated)", ""]
    by = {(r["size"], r["method"]): r for r in rows}
    sizes = [s for s in model_shapes.SHAPES if any(r["size"] == s for r in rows)]
    for method in [m for m in METHODS if any(r["method"] == m for r in rows)]:
        lines += [f"### {METHODS[method]} (`{method}`)", "", "| size | parameters | peak GB | s/step | CPU s/step | "
                  "samples/s | paper |", "|---|---|---|---|---|---|---|"]
        for size in sizes:
            if (size, method) in by:
                r = by[size, method]
                paper = PAPERS.get((size, method), "")
                lines.append(f"| {size} | {r['parameters'] / 1e6:,.0f}M | " + " | ".join(_cell(r)) + f" | {paper} |")
        lines.append("")
    lines += ["### Largest size that completed a step", "", "| method | largest size |", "|---|---|"]
    for method in [m for m in METHODS if any(r["method"] == m for r in rows)]:
        done = [s for s in sizes if "peak_mb" in by.get((s, method), {})]
        lines.append(f"| {METHODS[method]} | {done[-1] if done else 'none'} |")
    lines += ["", "### Peak memory ratios", "", "| size | DPZero / inference (target <= 1.10) | DP-GRAPE / DP-Adam "
              "(target <= 0.6) | DP-Adam / non-private Adam (target <= 1.15) |", "|---|---|---|---|"]
    for size in sizes:
        lines.append(f"| {size} | {_ratio(by, size, 'dpzero', 'inference')} | {_ratio(by, size, 'dp-grape', 'dpopt')} | "
                     f"{_ratio(by, size, 'dpopt', 'pytorch')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="dpopt reproduce large_models", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", default=list(DEFAULT_SIZES), choices=list(model_shapes.SHAPES),
                   metavar="SIZE", help=f"model shapes, run smallest first (of: {', '.join(model_shapes.SHAPES)})")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--precision", default="bf16", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--device", default="cpu", help="cpu or cuda (on CUDA no address-space cap: the GPU's own "
                                                    "out-of-memory error ends the row)")
    p.add_argument("--rank", type=int, default=16, help="DP-GRAPE's projection rank")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--memory-gb", type=float, default=14.0, help="address-space cap of each process (CPU)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=2,
                   help="timed steps (0: time the one step whose peak is measured; for slow CPU steps)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per process")
    p.add_argument("--out", default="experiments/results/large_models")
    p.add_argument("--table-only", action="store_true",
                   help="measure nothing: rewrite OUT/table.md from the rows of OUT/results.jsonl with these settings")
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.table_only:
        a.sizes = []
        (out / "table.md").write_text(table(earlier_rows(out / "results.jsonl", a), a))
        print((out / "table.md").read_text(), end="")
        return 0
    sizes = sorted(a.sizes, key=model_shapes.parameter_count)
    rows, failed = earlier_rows(out / "results.jsonl", a), set()
    for size in sizes:
        for method in a.methods:
            if method in failed:
                row = {"size": size, "method": method, **_settings(a), "parameters": model_shapes.parameter_count(size),
                       "error": "not run: failed at a smaller size"}
            else:
                row = run_row(size, method, a)
                if "error" in row:
                    failed.add(method)
            rows.append(row)
            with (out / "results.jsonl").open("a") as f:
                f.write(json.dumps(row) + "\n")
            (out / "table.md").write_text(table(rows, a))
            print(json.dumps({k: row.get(k) for k in ("size", "method", "peak_mb", "s_per_step", "error")}),
                  flush=True)
    print(table(rows, a), end="")
    return 0
