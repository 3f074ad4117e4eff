"""Kernel launches of a captured private step outside its graph, counted on the CPU with the accelerator's settings.

With ``--graph on`` a step on CUDA launches its graph (forward, backward, norms, clip weights, clipped sums and
status: one launch per physical batch) and, eagerly, what surrounds it: the batch gathered and copied into the
graph's inputs, the status read, the sums added up, the noise, the division and the base optimizer's update. This
script counts the eager part: the bench's dpopt step with the graph replaced by ``graphs.Rerun`` whose replays are
not counted (``_disable_current_modes``), after the warm-up steps that capture and check the graph. Run from the
repository root: ``python benchmarks/results/captured-step/launches_outside_the_graph.py``.
"""

import torch
from torch.utils._python_dispatch import _disable_current_modes

from dpopt import bench, launches
from dpopt.algorithms.base import PrivateStep
from dpopt.grad.graphs import CHECKS, Rerun


class Uncounted(Rerun):
    """A replay whose operations stand for one graph launch: not counted."""

    def replay(self) -> None:
        with _disable_current_modes():
            super().replay()


capture = PrivateStep.capture
PrivateStep.capture = lambda self, choice, log=print, replayed=None: capture(self, choice, log, Uncounted)

print("| workload | PyTorch launching ops | dpopt eager launching ops | dpopt captured: eager + graph launches | "
      "host syncs (captured) |")
print("|---|---|---|---|---|")
for workload, batch, seq in (("cnn", 64, 64), ("cnn", 256, 64), ("mlp", 64, 64), ("bert", 4, 16)):
    counts = {}
    for system, graph in (("pytorch", "off"), ("dpopt", "off"), ("dpopt", "on")):
        case = bench.Case(workload, batch, seq, graph=graph)
        torch.manual_seed(0)
        with launches.accelerator_settings():
            step = bench._step_fn(system, case, *bench._workload(case, system))
            counts[(system, graph)] = launches.count_step(step, warmup=CHECKS + 2)
    captured = counts[("dpopt", "on")]
    label = f"{workload} b{batch}" + (f" s{seq}" if workload == "bert" else "")
    print(f"| {label} | {counts[('pytorch', 'off')].launching_ops} | {counts[('dpopt', 'off')].launching_ops} | "
          f"{captured.launching_ops} + 1 | {captured.host_syncs} |", flush=True)
