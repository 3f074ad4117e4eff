"""Singular values of privatized layer gradients (the paper's Figure 1, L94-L96, L369): clipping and noise
flatten the spectrum, so an SVD subspace of the private gradient holds little more than a random one.

For a batch of ``--batch`` examples at initialisation (tiny ViT on MNIST, from scratch) or at the pretrained
point (MiniLM on Rotten Tomatoes), the gradient of every projected-eligible Linear weight is formed as
(1/B)(sum_i clip(g_i, C) + N(0, C^2 sigma^2 I)) for (C, sigma) in {(inf, 0), (1, 0), (1, 0.5), (1, 2)},
then:

* its singular values s_1 >= s_2 >= ..., normalised by s_1 and averaged over layers (the figure);
* the effective rank exp(H(s / sum s)), averaged over layers;
* the share of the *noiseless* clipped gradient's energy (||P P^T G||^2 / ||G||^2, P on the layer's smaller
  side) captured by the top-r singular subspace of the privatized gradient, against r / min(m, n) for a
  random subspace (the quantity that decides whether naive DP-GaLore's SVD beats DP-GRAPE's random P).

Writes spectrum.json, spectrum.md and spectrum.png.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import torch

from dpopt.clipping import Clipping
from dpopt.data.datasets import load_dataset
from dpopt.data.samplers import take
from dpopt.grad import PerExampleEngine
from dpopt.grad.projection import engine_projectable
from dpopt.models import build_model
from dpopt.noise.gaussian import GaussianNoise
from dpopt.noise.rng import SecretStream
from dpopt.run import classification_loss

SETTINGS = [(math.inf, 0.0), (1.0, 0.0), (1.0, 0.5), (1.0, 2.0)]
CASES = {"vit-tiny-mnist": ("mnist", "vit-tiny", 8), "minilm-rotten-tomatoes": ("rotten-tomatoes-512", "minilm", 16)}


def clipped_sums(engine: PerExampleEngine, data: Any, index: torch.Tensor, chunk: int) -> dict[float, list[torch.Tensor]]:
    """sum_i g_i (C = inf) and sum_i clip(g_i, 1) over the examples in ``index``, a chunk at a time (clipping
    is per example, so chunking changes nothing but memory)."""
    sums: dict[float, list[torch.Tensor]] = {}
    for start in range(0, len(index), chunk):
        grads = engine.gradients(take(data, index[start:start + chunk]))
        w, _ = Clipping(1.0).weights(grads.sq_norms(), engine.groups)
        for clip, weights in ((math.inf, torch.ones_like(w)), (1.0, w)):
            part = grads.weighted_sum(weights)
            sums[clip] = part if clip not in sums else [a + b for a, b in zip(sums[clip], part)]
    return sums


def analyse(case: str, batch_size: int, top: int, chunk: int) -> dict[str, Any]:
    dataset, model_name, rank = CASES[case]
    data = load_dataset(dataset)
    torch.manual_seed(0)
    model = build_model(model_name, data)
    engine = PerExampleEngine(model, classification_loss)
    layers = sorted(engine_projectable(engine, rank))
    n = len(data)
    index = torch.randperm(n, generator=torch.Generator().manual_seed(0))[:min(batch_size, n)]
    b = len(index)
    sums = clipped_sums(engine, data.train, index, chunk)
    clean = [s / b for s in sums[1.0]]
    out: dict[str, Any] = {"case": case, "batch": b, "layers": len(layers), "rank": rank, "settings": []}
    for k, (clip, sigma) in enumerate(SETTINGS):
        g = [s.clone() for s in sums[clip]]
        if sigma > 0:  # (1/B)(sum_i clip(g_i, C) + N(0, C^2 sigma^2 I))
            g = GaussianNoise(sigma, clip, SecretStream(k, "spectrum"))(g, 0)
        g = [x / b for x in g]
        curves, eff, captured, random_share = [], [], [], []
        for i in layers:
            u, s, vh = torch.linalg.svd(g[i].double(), full_matrices=False)
            curves.append((s[:top] / s[0]).tolist())
            p = s / s.sum()
            eff.append(float(torch.exp(-(p * p.clamp_min(1e-300).log()).sum())))
            left = g[i].shape[0] < g[i].shape[1]
            basis = u[:, :rank] if left else vh[:rank].T
            c = clean[i].double()
            proj = basis.T @ c if left else c @ basis
            captured.append(float(proj.square().sum() / c.square().sum()))
            random_share.append(rank / min(g[i].shape))
        width = min(len(c) for c in curves)
        mean_curve = [sum(c[j] for c in curves) / len(curves) for j in range(width)]
        out["settings"].append({"clip": clip, "sigma": sigma, "normalised_singular_values": mean_curve,
                                "effective_rank": sum(eff) / len(eff), "top_r_energy": sum(captured) / len(captured),
                                "random_r_energy": sum(random_share) / len(random_share),
                                "s1_over_sk": 1 / mean_curve[-1]})
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="dpopt reproduce grape_spectrum")
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--batch", type=int, default=1000, help="examples per gradient (the paper: 1000)")
    p.add_argument("--top", type=int, default=64, help="singular values shown (the paper: 64)")
    p.add_argument("--chunk", type=int, default=100, help="examples per forward/backward")
    p.add_argument("--out", default="experiments/results/grape/spectrum")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results = [analyse(c, a.batch, a.top, a.chunk) for c in a.cases]
    (out / "spectrum.json").write_text(json.dumps(results, indent=1))
    lines = ["| model | C | sigma | s_1 / s_top | effective rank | top-r SVD subspace of the private gradient: "
             "share of the clean gradient's energy | random r-subspace (expected) |", "|---|---|---|---|---|---|---|"]
    for r in results:
        for s in r["settings"]:
            lines.append(f"| {r['case']} (B={r['batch']}, {r['layers']} layers, r={r['rank']}) | {s['clip']:g} | "
                         f"{s['sigma']:g} | {s['s1_over_sk']:.1f} | {s['effective_rank']:.1f} | "
                         f"{s['top_r_energy']:.3f} | {s['random_r_energy']:.3f} |")
    table = "\n".join(lines) + "\n"
    (out / "spectrum.md").write_text(table)
    print(table)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4), squeeze=False)
    for ax, r in zip(axes[0], results):
        for s in r["settings"]:
            v = s["normalised_singular_values"]
            label = "C = inf, sigma = 0" if math.isinf(s["clip"]) else f"C = {s['clip']:g}, sigma = {s['sigma']:g}"
            ax.plot(range(1, len(v) + 1), v, label=label)
        ax.set_xlabel("singular value index")
        ax.set_ylabel("s_i / s_1 (mean over layers)")
        ax.set_title(f"{r['case']}, B = {r['batch']}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "spectrum.png", dpi=110)
    return 0
