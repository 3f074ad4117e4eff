"""Which copy of a convolution's unfolded input is faster (issue 3): ``ConvOuter._patches`` channels-last
(contiguous runs of kw * C_in) or by phase (the input split into its stride phases, contiguous runs of an
output row), over a grid of layer shapes, against the rule ``ConvOuter.by_phase`` (by phase where an output
row is at least half a channels-last run, if the stride divides the kernel).

CPU milliseconds at one thread for ``ConvOuter.flat`` (the per-example weight gradients of a batch, patches
and batched products) on random inputs, each layout checked against the other and timed in turn
(``bench.cpu_medians_in_turn``). Writes ``layouts.json`` and ``layouts.md`` under ``--out``.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from dpopt import bench
from dpopt.grad.captures import ConvOuter
from experiments._report import write_table

# (C_in, C_out, kernel, stride, padding, input height = width, batch); the first two are the Tanh CNN's layers
SHAPES = [(1, 16, 8, 2, 3, 28, 256), (16, 32, 4, 2, 0, 13, 256),
          *[(c, 32, 3, 1, 1, 16, 32) for c in (1, 4, 8, 16, 32, 64)],
          *[(c, 32, 4, 2, 1, 32, 32) for c in (1, 2, 4, 8, 16, 32)],
          *[(c, 32, 3, 1, 1, 8, 32) for c in (2, 4, 8, 16)],
          (3, 32, 3, 1, 1, 32, 64), (1, 8, 5, 1, 2, 28, 64), (16, 16, 2, 2, 0, 32, 32), (8, 16, 3, 1, 1, 20, 32)]


def measure(shape: tuple[int, ...], rounds: int) -> dict[str, float | bool]:
    c_in, c_out, k, s, p, hw, batch = shape
    x = torch.randn(batch, c_in, hw, hw)
    conv = nn.Conv2d(c_in, c_out, k, s, p)
    g = torch.randn_like(conv(x))
    make = lambda: ConvOuter(x, g, (k, k), (s, s), (1, 1), (p, p), 1, conv.weight.shape)  # noqa: E731
    chosen = make().by_phase
    layouts = {"by phase": make(), "channels-last": make()}
    layouts["by phase"].by_phase, layouts["channels-last"].by_phase = True, False
    phase, last = (t.materialize() for t in layouts.values())
    assert torch.allclose(phase, last, atol=1e-4, rtol=1e-4), f"the layouts disagree on {shape}"
    ms = {k: 1e3 * v for k, v in bench.cpu_medians_in_turn({k: t.flat for k, t in layouts.items()}, rounds, 2).items()}
    return {**ms, "rule picks by phase": chosen}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="dpopt reproduce conv_patch_layouts", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--out", default="benchmarks/results/conv-patch-layouts")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    results = {str(s): measure(s, args.rounds) for s in SHAPES}
    lines = ["| C_in, C_out, kernel, stride, padding, size, batch | by phase ms | channels-last ms | rule picks | "
             "pick / faster |", "|---|---|---|---|---|"]
    for s, r in results.items():
        pick = r["by phase"] if r["rule picks by phase"] else r["channels-last"]
        lines.append(f"| {s} | {r['by phase']:.2f} | {r['channels-last']:.2f} | "
                     f"{'by phase' if r['rule picks by phase'] else 'channels-last'} | "
                     f"{pick / min(r['by phase'], r['channels-last']):.2f} |")
    write_table(args.out, "layouts", results, lines)
    return 0
