"""Where one training step of a causal language model peaks, with its next-token loss over chunks of positions or
at once: peak live-tensor memory and the operators running at that peak, per system, on an OPT shape with fewer
layers (its widths and vocabulary unchanged), batch 8, sequence 128, bf16 autocast, in this one process.

The loss's memory depends on batch, sequence and vocabulary, not on depth, so a few layers show what chunking the
loss changes in seconds where the whole model (``large_models``) takes minutes per method."""

from __future__ import annotations

import argparse
import functools
import gc

import torch
from torch.profiler import ProfilerActivity, profile

from dpopt import bench, model_shapes


def where_it_peaks(step) -> tuple[float, str]:
    """The peak (MB) of ``bench.peak_tensor_mb``'s count while ``step`` runs, and the operators running at it,
    outermost first."""
    gc.collect()
    start = bench._live_tensor_bytes()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = list(prof.profiler.kineto_results.events())
    running = peak = at = 0
    for record in sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns()):
        running += record.nbytes()
        if running > peak:
            peak, at = running, record.start_ns()
    chain = sorted((e for e in events if e.name() != "[memory]" and e.start_ns() <= at <= e.start_ns() + e.duration_ns()),
                   key=lambda e: -e.duration_ns())
    names = [e.name() for e in chain]
    return (start + peak) / 2**20, " > ".join(n for k, n in enumerate(names) if k == 0 or n != names[k - 1])


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="dpopt reproduce lm_loss_peak", description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="opt-350m", choices=[s for s in model_shapes.SHAPES if s.startswith("opt")])
    p.add_argument("--layers", type=int, default=4, help="decoder layers kept")
    p.add_argument("--systems", nargs="+", default=["dp-grape", "inference", "pytorch"], choices=bench.SYSTEMS)
    p.add_argument("--chunks", nargs="+", type=int, default=[0, model_shapes.LOSS_CHUNK],
                   help="positions per chunk of the loss (0: all at once)")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    family, numbers = model_shapes.SHAPES[a.size]
    shape = f"{a.size}-{a.layers}-layers"
    model_shapes.SHAPES[shape] = (family, {**numbers, "num_hidden_layers": a.layers})
    loss = model_shapes.causal_lm_loss
    print(f"{a.size} widths, {a.layers} layers, batch 8, sequence 128, bf16 autocast, one thread\n")
    print("| system | loss chunk | peak MB | running at the peak |\n|---|---|---|---|")
    try:
        for chunk in a.chunks:
            model_shapes.causal_lm_loss = functools.partial(loss, chunk=chunk or None)
            for system in a.systems:
                case = bench.Case(shape, 8, 128, "adam", 16, 1, precision="bf16")
                peak, running = where_it_peaks(bench._step_fn(system, case, *bench._workload(case, system)))
                print(f"| {system} | {chunk or 'all at once'} | {peak:,.1f} | {running} |", flush=True)
    finally:
        model_shapes.causal_lm_loss = loss
        del model_shapes.SHAPES[shape]
    return 0
