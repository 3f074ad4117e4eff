"""The floor under the Tanh CNN's DP step time (issue 3): what the per-example gradient norms of its two
convolutions cost alone, against the whole non-private step.

CPU milliseconds at one thread (``time.process_time``; each measurement warmed up, then the median of
``--rounds`` calls in a row, so that every one runs with warm caches, as inside a step): the non-private
PyTorch step and dpopt's DP-SGD step (``dpopt.bench``'s steps), and, on the activations and output gradients
of one real backward pass, the squared per-example norms of each convolution's weight gradient by dpopt's
route (``captures.sq_norms``: per chunk of examples, one copy of the patches, channels-last or by stride phase,
and one batched product with the output gradient), by one grouped convolution per chunk of 64 examples with
the batch folded into the groups (Rochette et al., 2019; dpopt's route until 2026-11-23), and by the ghost
route (Gram matrices of the unfolded patches and of the output gradients, Li et al., 2022; the route
``ConvOuter.ghost_cost`` rules out).

Writes ``norm_cost.json`` and ``norm_cost.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import warnings
from typing import Callable

import torch
from torch import nn

from dpopt import bench
from dpopt.data.samplers import take
from dpopt.grad.captures import ConvOuter, sq_norms
from experiments._report import write_table


def _conv_captures(case: bench.Case) -> list[ConvOuter]:
    """Each Conv2d's input and output gradient from one backward pass of the CNN on the case's batch."""
    model, dataset, loss = bench._workload(case, "pytorch")
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    seen: dict[nn.Module, list[torch.Tensor]] = {m: [] for m in convs}
    handles = [m.register_forward_hook(lambda m, i, o: seen[m].append(i[0].detach())) for m in convs]
    handles += [m.register_full_backward_hook(lambda m, gi, go: seen[m].append(go[0].detach())) for m in convs]
    dataset = take(dataset, torch.arange(len(dataset[1]) if isinstance(dataset, tuple) else len(dataset["labels"])))
    with warnings.catch_warnings():  # the first layer's input needs no gradient: the hook still sees its output's
        warnings.simplefilter("ignore")
        loss(model, dataset).sum().backward()
    for h in handles:
        h.remove()
    return [ConvOuter(seen[m][0], seen[m][1], m.kernel_size, m.stride, m.dilation, m.padding, m.groups, m.weight.shape)
            for m in convs]


def ghost_norms(c: ConvOuter) -> torch.Tensor:
    """sum over positions s, t of <u_s, u_t><g_s, g_t> per example, a chunk of 64 examples at a time."""
    out = []
    for start in range(0, c.batch_size, 64):
        g, u = c.factors(slice(start, start + 64))
        out.append((torch.bmm(g, g.transpose(1, 2)) * torch.bmm(u, u.transpose(1, 2))).sum((1, 2)))
    return torch.cat(out)


def grouped_norms(c: ConvOuter) -> torch.Tensor:
    """The per-example gradients by one grouped convolution (batch folded into the groups) per 64 examples."""
    out = []
    for start in range(0, c.batch_size, 64):
        x, g = c.x[start:start + 64], c.g[start:start + 64]
        n, c_in, c_out = x.shape[0], x.shape[1], g.shape[1]
        grads = torch.nn.grad.conv2d_weight(x.reshape(1, n * c_in, *x.shape[2:]), (n * c_out, c_in, *c.kernel),
                                            g.reshape(1, n * c_out, *g.shape[2:]), stride=c.stride,
                                            padding=c.padding, dilation=c.dilation, groups=n)
        out.append(grads.reshape(n, -1).square().sum(1))
    return torch.cat(out)


def measure(batch: int, rounds: int) -> dict[str, float]:
    case = bench.Case("cnn", batch, threads=1)
    steps = {s: bench._step_fn(s, case, *bench._workload(case, s)) for s in ("pytorch", "dpopt")}
    convs = _conv_captures(case)
    for c in convs:
        for route in (ghost_norms, grouped_norms):
            assert torch.allclose(sq_norms(c), route(c), rtol=1e-3), f"{route.__name__} disagrees with dpopt's"
    jobs: dict[str, Callable[[], object]] = {f"{s} step": f for s, f in steps.items()}
    for i, c in enumerate(convs, 1):
        jobs[f"conv{i} norms, dpopt (patches + batched product)"] = lambda c=c: sq_norms(c)
        jobs[f"conv{i} norms, grouped convolution"] = lambda c=c: grouped_norms(c)
        jobs[f"conv{i} norms, ghost (Gram)"] = lambda c=c: ghost_norms(c)
    return {k: 1e3 * bench.cpu_medians_in_turn({k: f}, rounds, warmup=3)[k] for k, f in jobs.items()}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="dpopt reproduce conv_norm_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", nargs="+", type=int, default=[256, 1024])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--out", default="benchmarks/results/conv-norms")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    results = {b: measure(b, args.rounds) for b in args.batches}
    lines = ["| batch | measurement | CPU ms | / non-private step |", "|---|---|---|---|"]
    for b, r in results.items():
        base = r["pytorch step"]
        lines += [f"| {b} | {k} | {v:.2f} | {v / base:.3f} |" for k, v in r.items()]
        own = sum(v for k, v in r.items() if "norms, dpopt" in k)
        lines.append(f"| {b} | both convolutions' norms, dpopt's route | {own:.2f} | {own / base:.3f} |")
    write_table(args.out, "norm_cost", results, lines)
    return 0
