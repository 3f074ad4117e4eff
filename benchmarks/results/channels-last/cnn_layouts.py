"""The Tanh CNN's training step on the CPU in its two memory layouts: channels-last (``dpopt.models.cnn``) and
channels-first (the same weights made contiguous), one process, one thread, the layouts interleaved step by step
so that load from other jobs falls on both. PyTorch's channels-first CPU max-pool is the difference. Run from the
repository root: ``python benchmarks/results/channels-last/cnn_layouts.py``.
"""

import statistics
import time

import torch

from dpopt import bench

torch.set_num_threads(1)
ROUNDS, WARMUP = 10, 2
print(f"median step time over {ROUNDS} interleaved rounds (after {WARMUP} warm-up steps), torch {torch.__version__}, "
      "1 thread")
print("| workload | system | channels-first (s) | channels-last (s) | channels-first / channels-last |")
print("|---|---|---|---|---|")
for batch in (256, 1000):
    for system in ("pytorch", "dpopt"):
        case = bench.Case("cnn", batch, threads=1)
        steps = {}
        for layout in (torch.contiguous_format, torch.channels_last):
            model, data, loss = bench._workload(case, system)
            steps[layout] = bench._step_fn(system, case, model.to(memory_format=layout), data, loss)
        times = {layout: [] for layout in steps}
        for _ in range(WARMUP):
            for step in steps.values():
                step()
        for _ in range(ROUNDS):
            for layout, step in steps.items():
                start = time.perf_counter()
                step()
                times[layout].append(time.perf_counter() - start)
        first, last = (statistics.median(times[k]) for k in (torch.contiguous_format, torch.channels_last))
        print(f"| cnn b{batch} | {system} | {first:.3f} | {last:.3f} | **{first / last:.2f}** |", flush=True)
