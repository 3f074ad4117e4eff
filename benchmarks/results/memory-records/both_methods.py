"""Both peak-memory methods on one profiled step (issue 24): which part of a changed figure is the method.

The bench's old method (before 2026-11-25) summed each profiler event's net memory
(``self_cpu_memory_usage``) at the event's start; the new one sums the allocator's ``[memory]`` records in
time order (``dpopt.bench.peak_tensor_mb``). Both are computed here from the same trace of one step of the
current code, after one warm-up step, so a difference between them is the method alone.

    PYTHONPATH=. python benchmarks/results/memory-records/both_methods.py bench cnn 256 pytorch dpopt
    PYTHONPATH=. python benchmarks/results/memory-records/both_methods.py disk bert sgd "disk c=1"
    PYTHONPATH=. python benchmarks/results/memory-records/both_methods.py dpzero minilm 16 sgd dp-adam

Prints one JSON line per system: live MB at the start, old-method peak MB, new-method peak MB.
"""

from __future__ import annotations

import gc
import json
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from dpopt import bench


def both(step) -> dict[str, float]:
    gc.collect()
    start = bench._live_tensor_bytes()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    old = peak_old = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        old += event.self_cpu_memory_usage
        peak_old = max(peak_old, old)
    records = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    new = peak_new = 0
    for record in sorted(records, key=lambda e: e.start_ns()):
        new += record.nbytes()
        peak_new = max(peak_new, new)
    mb = 2**20
    return {"start_mb": start / mb, "old_method_mb": (start + peak_old) / mb, "new_method_mb": (start + peak_new) / mb}


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    kind, workload, arg, *systems = argv
    for system in systems:
        if kind == "bench":
            case = bench.Case(workload, int(arg), threads=1)
            step = bench._step_fn(system, case, *bench._workload(case, system))
            step()
        elif kind == "dpzero":  # experiments/dpzero_systems.py's worker: one warm-up call
            from experiments.dpzero_systems import systems as dpzero_systems

            step = dpzero_systems(int(arg), (system,))[system]
            step()
        else:  # experiments/disk_cost.py: build() already ran two warm-up steps
            from experiments.disk_cost import WORKLOADS, build

            opt, data = build(workload, WORKLOADS[workload], arg, system)
            step = lambda: opt.step(data)  # noqa: E731
        print(json.dumps({"kind": kind, "workload": workload, "arg": arg, "system": system, **both(step)}), flush=True)
        del step
        gc.collect()


if __name__ == "__main__":
    main(sys.argv[1:])
