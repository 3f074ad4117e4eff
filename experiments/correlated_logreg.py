"""Multinomial logistic regression with correlated noise (Choquette-Choo et al. 2024, Sec. 5, Figure 1):
DP-SGD without amplification, DP-FTRL (tree), DP-MEMF (Alg. 2) and DP-SRG-MEMF (Alg. 3) with the "ones"
and "true" workloads, and non-private, on fixed-order batches of 500; many seeds, mean and 95% interval.

    dpopt reproduce correlated_logreg --dataset mnist --epochs 1 --epsilon 0.1
    dpopt reproduce correlated_logreg --dataset fashion-mnist --epochs 6 --epsilon 2

A direct loop over the library's parts (engine, FixedOrderSampler, noise mechanisms, Privatizer, recipes),
with the data loaded and each factorization computed once per process. Hyper-parameters (lr x clip) are
chosen per method by mean test accuracy over ``--tune-seeds`` seeds disjoint from the reported seeds.
Noise: ``--calibration zcdp`` (default) is the paper's (rho-zCDP, L441: z = 1/sqrt(2 rho) at sensitivity 1,
per step z*sqrt(epochs) for iid noise); ``exact`` calibrates the ledger's PLD epsilon to the target. The
reported epsilon is always the ledger's (PLD).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from dpopt.algorithms import CONFIGS, Privatizer, build_algorithm
from dpopt.clipping import Clipping
from dpopt.data.datasets import load_dataset
from dpopt.data.samplers import FixedOrderSampler
from dpopt.grad import PerExampleEngine
from dpopt.noise import SecretStream, build_noise
from dpopt.noise.correlated import CorrelatedNoise
from dpopt.privacy import FixedOrderParticipation, PrivacyLedger, noise_multiplier_for, zcdp_noise_multiplier
from dpopt.run import accuracy, classification_loss

RESULTS = Path(__file__).resolve().parent / "results" / "correlated"
DECAY = math.exp(-2.5)  # the paper's c (L470)
# method -> (recipe, noise, workload, decay)
METHODS = {
    "non-private": ("dp-sgd", "gaussian", "ones", 0.0),
    "dp-sgd (no amplification)": ("dp-sgd", "gaussian", "ones", 0.0),
    "dp-ftrl (tree)": ("dp-ftrl", "tree", "ones", 0.0),
    "dp-memf ones": ("dp-memf", "mf", "ones", 0.0),
    "dp-memf true": ("dp-memf", "mf", "true", 0.0),
    "dp-srg-memf ones": ("dp-srg-memf", "mf", "ones", DECAY),
    "dp-srg-memf true": ("dp-srg-memf", "mf", "true", DECAY),
}
PAPER_MNIST = {"dp-memf ones": 82.555, "dp-memf true": 83.593, "dp-srg-memf ones": 82.456,
               "dp-srg-memf true": 83.753, "non-private": 91.530}
MOMENTUM = 0.9


def run_once(data, method: str, lr: float, clip: float, seed: int, epochs: int, batch: int, z: float,
             delta: float) -> dict:
    recipe, kind, workload, decay = METHODS[method]
    private = method != "non-private"
    n = len(data)
    model = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(data.input_shape), data.num_classes))
    nn.init.zeros_(model[1].weight)
    nn.init.zeros_(model[1].bias)
    sampler = FixedOrderSampler(n, batch, SecretStream(seed, "sampling"))
    steps = epochs * sampler.steps_per_epoch
    clip = clip if private else 1e6
    mw = (MOMENTUM if workload == "true" else 0.0, decay if workload == "true" else 0.0)
    noise = build_noise(kind, z if private else 0.0, clip, SecretStream(seed, "noise"), steps,
                        sampler.steps_per_epoch, momentum=mw[0], decay=mw[1])
    privatizer = Privatizer(Clipping(clip), noise, sampler, PrivacyLedger())
    hp = CONFIGS[recipe](lr=lr, momentum=MOMENTUM, **({"decay": decay} if recipe == "dp-srg-memf" else {}))
    opt = build_algorithm(recipe, PerExampleEngine(model, classification_loss), privatizer, hp)
    for _ in range(steps):
        opt.step(data.train)
    eps = privatizer.ledger.epsilon(delta) if private else math.inf
    return {"accuracy": accuracy(model, data.test), "epsilon": eps}


def noise_for(method: str, calibration: str, epsilon: float, delta: float, steps: int, period: int,
              epochs: int) -> float:
    """The noise multiplier each method runs at (see the module docstring)."""
    if method == "non-private":
        return 0.0
    _, kind, workload, decay = METHODS[method]
    iid = kind == "gaussian"
    if calibration == "zcdp":
        z = zcdp_noise_multiplier(epsilon, delta)
        return z * math.sqrt(epochs) if iid else z
    mech = build_noise(kind, 1.0, 1.0, SecretStream(0, "noise"), steps, period,
                       momentum=MOMENTUM if workload == "true" else 0.0, decay=decay if workload == "true" else 0.0)
    part = FixedOrderParticipation(period)
    release = (lambda v: mech.whole_run(v, part)) if isinstance(mech, CorrelatedNoise) else None
    return noise_multiplier_for(epsilon, delta, part, steps, release=release)


def interval(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of a 95% t-interval."""
    from scipy import stats

    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, float("nan")
    half = stats.t.ppf(0.975, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return mean, half


PAIRS = [("dp-srg-memf ones", "dp-memf ones"), ("dp-srg-memf true", "dp-memf true"), ("dp-memf true", "dp-memf ones"),
         ("dp-memf ones", "dp-ftrl (tree)"), ("dp-ftrl (tree)", "dp-sgd (no amplification)")]


def paired_differences(results: dict) -> list[str]:
    """Table rows "a − b: mean ± 95% t-interval" in points over the seeds both ran: seed s gives both methods the
    same batches and noise draws, so the difference is paired."""
    rows = []
    for a, b in PAIRS:
        if a in results and b in results:
            mean, half = interval([100 * (x["accuracy"] - y["accuracy"])
                                   for x, y in zip(results[a]["runs"], results[b]["runs"])])
            rows.append(f"| {a} − {b} | {mean:+.2f} ± {half:.2f} |")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dpopt reproduce correlated_logreg", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="mnist", choices=["mnist", "fashion-mnist"])
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=500)
    p.add_argument("--epsilon", type=float, default=0.1)
    p.add_argument("--delta", type=float, default=1e-6)
    p.add_argument("--calibration", default="zcdp", choices=["zcdp", "exact"])
    p.add_argument("--features", default="standardized", choices=["standardized", "raw"],
                   help="raw: pixels rescaled to [0, 1] instead of the loader's mean/std standardisation")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--lrs", type=float, nargs="+", default=[0.1, 0.3, 1.0, 3.0])
    p.add_argument("--clips", type=float, nargs="+", default=[0.3, 1.0, 3.0])
    p.add_argument("--tune-seeds", type=int, default=2)
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    torch.set_num_threads(1)

    data = load_dataset(args.dataset)
    if args.features == "raw":
        lo, hi = data.train[0].min(), data.train[0].max()  # the images of pixel values 0 and 255
        data.train = ((data.train[0] - lo) / (hi - lo), data.train[1])
        data.test = ((data.test[0] - lo) / (hi - lo), data.test[1])
    period = math.ceil(len(data) / args.batch_size)
    steps = args.epochs * period
    name = (f"logreg_{args.dataset}_e{args.epochs}_eps{args.epsilon:g}_{args.calibration}"
            + ("_raw" if args.features == "raw" else ""))
    out_file = Path(args.out) / f"{name}.json"
    results = json.loads(out_file.read_text()) if out_file.exists() else {}
    results.pop("_setup", None)
    for method in args.methods:
        if method in results and len(results[method]["runs"]) >= args.seeds:
            continue
        start = time.process_time()
        z = noise_for(method, args.calibration, args.epsilon, args.delta, steps, period, args.epochs)
        grid = {}
        for lr in args.lrs:
            for clip in (args.clips if method != "non-private" else [1.0]):
                accs = [run_once(data, method, lr, clip, 1000 + s, args.epochs, args.batch_size, z,
                                 args.delta)["accuracy"] for s in range(args.tune_seeds)]
                grid[f"{lr:g}/{clip:g}"] = statistics.fmean(accs)
                print(f"{method}: lr {lr:g} clip {clip:g}: {grid[f'{lr:g}/{clip:g}']:.4f}", flush=True)
        best = max(grid, key=grid.get)
        lr, clip = map(float, best.split("/"))
        runs = [run_once(data, method, lr, clip, s, args.epochs, args.batch_size, z, args.delta)
                for s in range(args.seeds)]
        mean, half = interval([100 * r["accuracy"] for r in runs])
        results[method] = {"lr": lr, "clip": clip, "noise_multiplier": z, "grid": grid, "runs": runs,
                           "mean": mean, "ci95": half, "epsilon": max(r["epsilon"] for r in runs),
                           "cpu_s": time.process_time() - start}
        print(f"== {method}: {mean:.2f} ± {half:.2f} (lr {lr:g}, clip {clip:g}, z {z:.4g}, "
              f"epsilon {results[method]['epsilon']:.4g})", flush=True)
        out_file.parent.mkdir(parents=True, exist_ok=True)
        out_file.write_text(json.dumps({**results, "_setup": vars(args) | {"steps": steps, "period": period}},
                                       indent=1))
    paper = PAPER_MNIST if args.dataset == "mnist" and args.epochs == 1 else {}
    print(f"\n| method | accuracy % (mean ± 95% CI, {args.seeds} seeds) | paper (MNIST, 100 runs) | lr | clip | "
          f"z | ledger epsilon |")
    print("|---|---|---|---|---|---|---|")
    for method in args.methods:
        r = results[method]
        print(f"| {method} | {r['mean']:.2f} ± {r['ci95']:.2f} | {paper.get(method, '–')} | {r['lr']:g} | "
              f"{r['clip']:g} | {r['noise_multiplier']:.4g} | {r['epsilon']:.4g} |")
    print("\n| paired difference (points) | mean ± 95% CI |\n|---|---|\n" + "\n".join(paired_differences(results)))
    return 0
