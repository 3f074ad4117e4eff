"""DPZero §5.1 / App. B.1 (Figures 1 and 2): a quadratic with low effective rank, DPZero vs DPGD-0th vs DP-GD.

f(x; x_i) = 1/2 (x - x_i)^T A (x - x_i), x_i ~ N(1, I_d) iid, n training and n test points (L516-526);
A = diag(a) with a_j = 1 (mode a, rank d), 1/sqrt(j) (mode b, O(sqrt d)), 1/j (mode c, O(log d)).
(epsilon, delta) = (2, 1e-6), full batch, noise calibrated by the paper's advanced composition (Lemma 2.2):
sigma = 4 C sqrt(2 T log(e + eps/delta)) / (n eps) for all three methods; lambda = 1e-4; u on the sphere of
radius sqrt(d); x_0 = 0; the last iterate is evaluated (the paper does not say which; spec 7.1).

Every (T, alpha, C) of the grid is a separate run; the runs of one T are advanced together, sharing u_t
(public, data-independent: each run on its own is a valid run) and with their own secret noise. For a
quadratic the central difference is exact: s_i = u^T A (x - x_i) = (a*u)^T x - X (a*u), one product with
the data per step for all runs (test_dpzero.py checks this step against the library's ``dpzero`` recipe).
Reported: for each (mode, d, method), the best final train gradient norm ||A (x - xbar_train)|| over the
grid (mean over seeds), the test gradient norm and the losses at the same setting, and the best test value
selected on its own (the paper's wording allows either).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from dpopt.grad.zeroth_order import Direction
from dpopt.noise.rng import SecretStream, derive_seed
from dpopt.privacy import advanced_composition_noise

EPSILON, DELTA, SMOOTHING = 2.0, 1e-6, 1e-4
MODES = {"a": lambda j: torch.ones_like(j), "b": lambda j: j.rsqrt(), "c": lambda j: 1.0 / j}
METHODS = ("dpzero", "dpgd-0th", "dp-gd")
PAPER = dict(n=10000, dims=[20, 50, 100, 200, 500, 1000, 2000], steps=[10, 20, 40, 80, 160, 320, 640, 1280, 2560, 5120],
             lrs=[1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0],
             clips=[0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0, 300.0])
QUICK = dict(n=2000, dims=[20, 100, 500, 2000], steps=[80, 320, 1280], lrs=[1e-3, 1e-2, 1e-1, 1.0],
             clips=[0.3, 3.0, 30.0, 300.0])


def spectrum(mode: str, d: int) -> torch.Tensor:
    return MODES[mode](torch.arange(1, d + 1, dtype=torch.float64))


def data(n: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Train and test points, entries iid N(1, 1), drawn afresh for each (d, seed)."""
    g = torch.Generator().manual_seed(derive_seed(seed, "synthetic data", d))
    return (torch.randn(n, d, generator=g, dtype=torch.float64) + 1.0,
            torch.randn(n, d, generator=g, dtype=torch.float64) + 1.0)


def run(method: str, x: torch.Tensor, a: torch.Tensor, lrs: torch.Tensor, clips: torch.Tensor,
        sigmas: torch.Tensor, steps: int, seed: int) -> torch.Tensor:
    """``steps`` iterations of ``method`` from x_0 = 0 for K runs at once (lrs, clips, sigmas: [K], sigma the
    noise std on the clipped mean); returns the final iterates [K, d]."""
    n, d = x.shape
    k = len(lrs)
    point = torch.zeros(k, d, dtype=torch.float64)
    direction = Direction([torch.zeros(d, dtype=torch.float64)], seed, law="sphere")
    noise = SecretStream(seed, f"synthetic noise {method}")
    lr, clip, sigma = lrs.unsqueeze(1), clips.unsqueeze(1), sigmas.unsqueeze(1)
    x32, a2 = x.float(), a.square()
    for t in range(steps):
        if method == "dp-gd":  # per-example gradients a*(x_k - x_i), clipped to C: two products with the data
            sq = ((a * point).square().sum(1, keepdim=True) - 2 * (x32 @ (a2 * point).float().T).T.double()
                  + (a * x).square().sum(1).unsqueeze(0))  # [K, n]
            w = (clip / sq.clamp_min(1e-30).sqrt()).clamp(max=1.0)
            mean = a * (point * w.sum(1, keepdim=True) - (w.float() @ x32).double()) / n
            z = noise.normals([torch.Size([k, d])], t, dtype=torch.float64)[0]
            point -= lr * (mean + sigma * z)
            continue
        u = direction.materialize(t)[0]
        v = a * u
        s = (point @ v).unsqueeze(1) - (x @ v).unsqueeze(0)  # [K, n]: s_i = u^T A (x_k - x_i)
        if method == "dpzero":  # clip the scalar to C, one scalar of noise (Alg. 2)
            g = s.clamp(-clip, clip).mean(1, keepdim=True) + sigma * noise.normals([torch.Size([k, 1])], t,
                                                                                  dtype=torch.float64)[0]
            point -= lr * g * u
        else:  # DPGD-0th: clip the vector s_i u to C, i.e. s_i to C / ||u||; d-dimensional noise (Alg. 1)
            bound = clip / float(u.norm())
            z = noise.normals([torch.Size([k, d])], t, dtype=torch.float64)[0]
            point -= lr * (s.clamp(-bound, bound).mean(1, keepdim=True) * u + sigma * z)
    return point


def metrics(point: torch.Tensor, a: torch.Tensor, train: torch.Tensor, test: torch.Tensor) -> dict[str, torch.Tensor]:
    out = {}
    for name, x in (("train", train), ("test", test)):
        mean, var = x.mean(0), x.var(0, unbiased=False)
        out[f"{name}_grad"] = (a * (point - mean)).norm(dim=1)
        out[f"{name}_loss"] = 0.5 * (a * ((point - mean).square() + var)).sum(1)
    return {k: torch.nan_to_num(v, nan=math.inf) for k, v in out.items()}


def sweep(mode: str, d: int, method: str, grid: dict, seeds: int) -> dict:
    """Every (T, lr, C) run for ``seeds`` seeds; the best setting by mean final train gradient norm."""
    lrs, clips = torch.tensor(grid["lrs"], dtype=torch.float64), torch.tensor(grid["clips"], dtype=torch.float64)
    lr, clip = lrs.repeat_interleave(len(clips)), clips.repeat(len(lrs))
    a, n = spectrum(mode, d), grid["n"]
    table = []
    start = time.process_time()
    for steps in grid["steps"]:
        sigma = advanced_composition_noise(EPSILON, DELTA, steps) * 2 * clip / n  # Delta = 2C/n (replace-one)
        per_seed = []
        for seed in range(seeds):
            train, test = data(n, d, seed)
            per_seed.append(metrics(run(method, train, a, lr, clip, sigma, steps, seed), a, train, test))
        mean = {k: torch.stack([m[k] for m in per_seed]).mean(0) for k in per_seed[0]}
        table += [dict(steps=steps, lr=float(lr[i]), clip=float(clip[i]), **{k: float(v[i]) for k, v in mean.items()})
                  for i in range(len(lr))]
    best = min(table, key=lambda r: r["train_grad"])
    return {"cpu_s": time.process_time() - start, "best": best, "best_test_grad": min(r["test_grad"] for r in table),
            "best_train_loss": min(r["train_loss"] for r in table), "best_test_loss": min(r["test_loss"] for r in table),
            "best_per_steps": {str(t): min((r for r in table if r["steps"] == t), key=lambda r: r["train_grad"])
                               for t in grid["steps"]}}


def plot(results: dict, dims: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    titles = {"a": "(a) a_j = 1, r = d", "b": "(b) a_j = 1/sqrt(j), r = O(sqrt d)", "c": "(c) a_j = 1/j, r = O(log d)"}
    fig, axes = plt.subplots(2, 3, figsize=(12, 7), sharex=True)
    for col, mode in enumerate(MODES):
        for row, key in enumerate(("train", "test")):
            ax = axes[row, col]
            for method, style in zip(METHODS, ("o-", "s--", "^:")):
                ys = [results[mode][str(d)][method]["best"][f"{key}_grad"] if key == "train"
                      else results[mode][str(d)][method]["best_test_grad"] for d in dims]
                ax.plot(dims, ys, style, label=method)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_title(titles[mode] if row == 0 else "", fontsize=9)
            ax.set_ylabel(f"best {key} gradient norm")
            if row == 1:
                ax.set_xlabel("dimension d")
    axes[0, 0].legend()
    fig.suptitle("Quadratic with low effective rank, (2, 1e-6)-DP (cf. DPZero Fig. 1)")
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def markdown(results: dict, dims: list[int], modes: list[str]) -> str:
    lines = ["| mode | d | " + " | ".join(f"{m} train (test)" for m in METHODS) + " |", "|---|---|" + "---|" * len(METHODS)]
    for mode in modes:
        for d in dims:
            cells = []
            for m in METHODS:
                r = results[mode][str(d)][m]
                cells.append(f"{r['best']['train_grad']:.3g} ({r['best_test_grad']:.3g})")
            lines.append(f"| {mode} | {d} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="dpopt reproduce dpzero_synthetic")
    p.add_argument("--quick", action="store_true", help="the spec's CI-sized grid (n=2000, 4 dims, 3x4x4 settings)")
    p.add_argument("--n", type=int, help="training (and test) set size")
    p.add_argument("--dims", type=int, nargs="+")
    p.add_argument("--steps", type=int, nargs="+", help="the T grid")
    p.add_argument("--lrs", type=float, nargs="+")
    p.add_argument("--clips", type=float, nargs="+")
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--out", default="experiments/results/dpzero")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    grid = dict(QUICK if a.quick else PAPER)
    for key in ("n", "dims", "steps", "lrs", "clips"):
        if getattr(a, key) is not None:
            grid[key] = getattr(a, key)
    results: dict = {"grid": grid, "seeds": a.seeds, "epsilon": EPSILON, "delta": DELTA}
    start = time.process_time()
    for mode in a.modes:
        results[mode] = {}
        for d in grid["dims"]:
            results[mode][str(d)] = {m: sweep(mode, d, m, grid, a.seeds) for m in METHODS}
            row = ", ".join(f"{m} {results[mode][str(d)][m]['best']['train_grad']:.4g}" for m in METHODS)
            print(f"mode {mode} d {d}: best train gradient norm {row} ({time.process_time() - start:.0f} CPU s)",
                  flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = "synthetic_quick" if a.quick else "synthetic"
    (out / f"{tag}.json").write_text(json.dumps(results, indent=1))
    (out / f"{tag}.md").write_text(markdown(results, grid["dims"], a.modes) + "\n")
    if set(a.modes) == set(MODES):
        plot(results, grid["dims"], out / f"{tag}.png")
    print(markdown(results, grid["dims"], a.modes))
    return 0
