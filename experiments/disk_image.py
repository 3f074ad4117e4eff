"""DiSK vs its base on MNIST and Fashion-MNIST with the small Tanh CNN (the paper's Fig. 1a analogue).

For each dataset, epsilon in {0.5, 1, 2, 4, 8} (delta 1e-5), base in {DP-SGD, DP-Adam} and seed: the base
and DiSK (kappa 0.7, gamma 0.5; several values of ``--kappa``/``--gamma`` make an ablation over their grid)
with the *same* base hyper-parameters (the paper tunes the base only, L744). ``--tune`` first picks each
base's learning rate on a held-out split (the last 10,000 training images as validation, the base alone, one
epsilon, a seed outside the grid) and writes tuning.json, which the grid then reads. Every finished run is
appended to results.jsonl and skipped when the command is run again; ``--summarize`` writes table.md (mean ±
std test accuracy, the paired DiSK - base differences) and accuracy_vs_epsilon.png. ``--clipping flat automatic``
adds the paper's automatic clipping (every example scaled to norm C = 1, L742) as a second grid; ``--batch-size
5000 --physical-batch-size 1000`` is the paper's batch (Table 2) in chunks that fit memory.
Paper claim (Fig. 1, L288-300): DiSK beats its base at every epsilon, with a larger gain at small epsilon.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path

import torch

from dpopt.algorithms import CONFIGS, SGD, Adam, Hyperparameters
from dpopt.data.datasets import DATASETS, Dataset, labels_of, load_dataset
from dpopt.data.samplers import PoissonSampler
from dpopt.noise.rng import SecretStream
from dpopt.privacy import noise_multiplier_for
from dpopt.run import TrainConfig, train

BASES = {"sgd": SGD(lr=1.0, momentum=0.9), "adam": Adam(lr=2e-3)}
LR_GRID = {("sgd", "flat"): [1.0, 2.0, 4.0, 8.0, 16.0], ("adam", "flat"): [2e-3, 4e-3, 8e-3, 1.6e-2],
           # automatic clipping scales every example to norm C = 1 (10x the flat runs' C = 0.1): SGD's steps 10x lower
           ("sgd", "automatic"): [0.2, 0.4, 0.8, 1.6], ("adam", "automatic"): [2e-3, 4e-3, 8e-3, 1.6e-2]}
CLIP = {"flat": None, "automatic": 1.0}  # None: --clip; automatic clipping uses the paper's C = 1 (L742)
VALIDATION = 10_000
TUNING_SEED = 100  # not one of the grid's seeds


def validation_split(name: str) -> str:
    """Register ``NAME/validation``: the first N - 10,000 training images to train on, the last 10,000 to
    evaluate on (the test set is not looked at while tuning)."""
    def load(download: bool) -> Dataset:
        full = load_dataset(name, download)
        x, y = full.train
        n = len(y) - VALIDATION
        return Dataset(f"{name}/validation", (x[:n], y[:n]), (x[n:], y[n:]), full.num_classes)

    DATASETS[f"{name}/validation"] = load
    return f"{name}/validation"


def tune(a: argparse.Namespace, out: Path) -> dict[str, dict[str, float]]:
    """Each base's learning rate, chosen by validation accuracy at one epsilon; DiSK reuses it."""
    log = out / "tuning.jsonl"
    rows = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    done = {(r["dataset"], r["base"], r["lr"]) for r in rows}
    for dataset in a.datasets:
        held_out = validation_split(dataset)
        for base, clipping in [(b, c) for b in a.bases for c in a.clipping]:
            for lr in LR_GRID[(base, clipping)]:
                if (dataset, tuning_key(base, clipping), lr) in done:
                    continue
                hp = dataclasses.replace(BASES[base], lr=lr)
                config = run_config(a, f"dp-{base}", held_out, a.tune_epsilon, clipping, TUNING_SEED, hp)
                m = train(config, progress=False, log=lambda s: None)
                row = {"dataset": dataset, "base": tuning_key(base, clipping), "lr": lr, "epsilon": a.tune_epsilon,
                       "validation_accuracy": m["test_accuracy"]}
                rows.append(row)
                with log.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                print(json.dumps(row), flush=True)
    scores: dict[tuple[str, str], dict[float, float]] = {}
    for r in rows:
        scores.setdefault((r["dataset"], r["base"]), {})[r["lr"]] = r["validation_accuracy"]
    best: dict[str, dict[str, float]] = {}
    for (dataset, base), by_lr in scores.items():
        best.setdefault(dataset, {})[base] = max(by_lr, key=by_lr.get)
    (out / "tuning.json").write_text(json.dumps(best, indent=2) + "\n")
    return best


def tuning_key(base: str, clipping: str) -> str:
    """The base's name in tuning.json: "sgd" for flat clipping (the first grid's files), "sgd/automatic"."""
    return base if clipping == "flat" else f"{base}/{clipping}"


def run_config(a: argparse.Namespace, algorithm: str, dataset: str, epsilon: float, clipping: str, seed: int,
               hp: Hyperparameters) -> TrainConfig:
    """One run of the grid; the seed is also the secret seed, so a base and its DiSK see the same noise."""
    noise = {"epsilon": epsilon}
    if a.calibration_epochs:  # the noise of a calibration_epochs-long run at epsilon; this run is its first epochs
        n = len(labels_of(load_dataset(dataset).train))
        sampler = PoissonSampler.with_batch_size(n, a.batch_size, SecretStream(None, "unused"))
        noise = {"noise_multiplier": noise_multiplier_for(epsilon, 1e-5, sampler.participation,
                                                          a.calibration_epochs * sampler.steps_per_epoch)}
    return TrainConfig(algorithm=algorithm, dataset=dataset, model="cnn", delta=1e-5, epochs=a.epochs,
                       batch_size=a.batch_size, physical_batch_size=a.physical_batch_size,
                       clip=CLIP[clipping] or a.clip, clipping=clipping, seed=seed, secret_seed=seed, hyperparameters=hp,
                       lr_schedule=a.lr_schedule, warmup=a.warmup, **noise)


def hyperparameters(tuned: Path, dataset: str, base: str, clipping: str, kappa: float | None,
                    gamma: float | None) -> Hyperparameters:
    """The base's tuned learning rate (tuning.json), shared by the base and DiSK; kappa and gamma for DiSK
    (None for the base, which does not read them)."""
    lr = json.loads(tuned.read_text()).get(dataset, {}).get(tuning_key(base, clipping)) if tuned.exists() else None
    hp = BASES[base] if lr is None else dataclasses.replace(BASES[base], lr=lr)
    return hp if kappa is None else CONFIGS[f"disk-{base}"](**dataclasses.asdict(hp), kappa=kappa, gamma=gamma)


def variant(row: dict) -> tuple[float | None, float | None]:
    """(kappa, gamma) of a DiSK row, (None, None) for a base row; rows written before the ablation flags
    existed were all kappa 0.7, gamma 0.5."""
    return (None, None) if row["method"] == "base" else (row.get("kappa", 0.7), row.get("gamma", 0.5))


def summarize(out: Path) -> str:
    """Mean ± std over seeds; "DiSK ahead" counts the seeds in which DiSK beat its base (a paired comparison:
    at one seed both see the same batches and the same noise draws: the runs pass the seed as --secret-seed)."""
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    groups: dict[tuple, dict[int, float]] = {}
    for r in rows:  # rows written before --clipping existed were flat
        base = tuning_key(r["base"], r.get("clipping", "flat"))
        groups.setdefault((r["dataset"], base, r["epsilon"], variant(r)), {})[r["seed"]] = r["test_accuracy"]
    lines = ["| dataset | base | epsilon | DiSK κ, γ | base accuracy (%) | DiSK accuracy (%) "
             "| DiSK − base, paired by seed (points, mean ± std) | DiSK ahead |",
             "|---|---|---|---|---|---|---|---|"]
    curves: dict[tuple, list[tuple[float, float, float]]] = {}  # (dataset, base, label) -> (eps, mean, std)
    sd = lambda v: statistics.stdev(v) if len(v) > 1 else 0.0  # noqa: E731
    base_key = (None, None)
    disk_keys = sorted(k for k in groups if k[3] != base_key and k[:3] + (base_key,) in groups)
    for dataset, base, eps, (kappa, gamma) in disk_keys:
        by_seed_b, by_seed_k = groups[(dataset, base, eps, base_key)], groups[(dataset, base, eps, (kappa, gamma))]
        seeds = sorted(set(by_seed_b) & set(by_seed_k))
        b, k = [by_seed_b[s] for s in seeds], [by_seed_k[s] for s in seeds]
        ahead = sum(y > x for x, y in zip(b, k))
        diffs = [100 * (y - x) for x, y in zip(b, k)]
        lines.append(f"| {dataset} | dp-{base} | {eps} | {kappa:g}, {gamma:g} | "
                     f"{100 * statistics.mean(b):.2f} ± {100 * sd(b):.2f} | "
                     f"{100 * statistics.mean(k):.2f} ± {100 * sd(k):.2f} | "
                     f"{statistics.mean(diffs):+.2f} ± {sd(diffs):.2f} | {ahead}/{len(seeds)} |")
        base_curve = curves.setdefault((dataset, base, "base"), [])
        if eps not in {q[0] for q in base_curve}:  # the base point once per epsilon, whatever the DiSK variants
            base_curve.append((eps, statistics.mean(b), sd(b)))
        curves.setdefault((dataset, base, f"κ {kappa:g}, γ {gamma:g}"), []).append((eps, statistics.mean(k), sd(k)))
    table = "\n".join(lines) + "\n"
    (out / "table.md").write_text(table)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets, bases = sorted({k[0] for k in curves}), sorted({k[1] for k in curves}, key=lambda b: ("/" in b, b[0] == "a"))
    fig, axes = plt.subplots(len(datasets), len(bases), figsize=(4.5 * len(bases), 3.5 * len(datasets)), squeeze=False)
    for row, dataset in zip(axes, datasets):
        for ax, base in zip(row, bases):
            name = ("SGD" if base.startswith("sgd") else "Adam") + (", automatic clipping" if "/" in base else "")
            variants = sorted({k[2] for k in curves if k[:2] == (dataset, base) and k[2] != "base"})
            styles = [("base", dict(color="0.45", linestyle="--", label=f"DP-{name}"))] + [
                (v, dict(color=f"C{3 + i}", linestyle="-", label=f"DiSK ({v}) on DP-{name}"))
                for i, v in enumerate(variants)]
            for m, style in styles:
                pts = sorted(curves.get((dataset, base, m), []))
                ax.errorbar([q[0] for q in pts], [100 * q[1] for q in pts], [100 * q[2] for q in pts], capsize=3,
                            marker="o", **style)
            ax.set_xscale("log")
            eps = sorted({q[0] for q in curves.get((dataset, base, "base"), [])})
            ax.set_xticks(eps, [f"{e:g}" for e in eps])
            ax.minorticks_off()
            ax.set_xlabel("epsilon (delta = 1e-5)")
            ax.set_ylabel("test accuracy (%), mean ± std")
            ax.set_title(f"{dataset}, Tanh CNN, DP-{name} base", fontsize=9)
            ax.legend()
    fig.tight_layout()
    fig.savefig(out / "accuracy_vs_epsilon.png", dpi=120)
    return table


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="dpopt reproduce disk_image")
    p.add_argument("--datasets", nargs="+", default=["mnist", "fashion-mnist"])
    p.add_argument("--epsilons", nargs="+", type=float, default=[0.5, 1.0, 2.0, 4.0, 8.0])
    p.add_argument("--bases", nargs="+", default=["sgd", "adam"], choices=sorted(BASES))
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--clip", type=float, default=0.1, help="flat clipping's C (automatic clipping uses C = 1)")
    p.add_argument("--clipping", nargs="+", default=["flat"], choices=sorted(CLIP))
    p.add_argument("--calibration-epochs", type=int,
                   help="calibrate the noise for this many epochs and run --epochs of them: the first epochs of a "
                        "longer run, at its noise per step (epsilon spent is then below the target)")
    p.add_argument("--physical-batch-size", type=int, help="examples per forward/backward (default: the trainer's)")
    p.add_argument("--out", default="runs/disk_image")
    p.add_argument("--summarize", action="store_true", help="only write the table and the plot")
    p.add_argument("--tune", action="store_true", help="only choose the bases' learning rates (tuning.json)")
    p.add_argument("--tune-epsilon", type=float, default=2.0)
    p.add_argument("--tuning", help="tuning.json to read (default: the one in --out)")
    p.add_argument("--kappa", type=float, nargs="+", default=[0.7], help="DiSK's Kalman gain (several: an ablation)")
    p.add_argument("--gamma", type=float, nargs="+", default=[0.5],
                   help="DiSK's extrapolation step (several: an ablation over the kappa x gamma grid)")
    p.add_argument("--lr-schedule", default="constant", choices=["constant", "cosine", "linear"],
                   help="the paper's runs: cosine, with --warmup 0.05 (a linear warm-up over 1/20 of the steps)")
    p.add_argument("--warmup", type=float, default=0.0, help="a fraction of the run's steps if below 1, else steps")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.tune:
        print(json.dumps(tune(a, out), indent=2))
        return 0
    log = out / "results.jsonl"
    tuned = Path(a.tuning) if a.tuning else out / "tuning.json"
    if not a.summarize:
        done = {(r["dataset"], r["base"], r.get("clipping", "flat"), r["epsilon"], r["method"], r["seed"], *variant(r))
                for r in map(json.loads, log.read_text().splitlines())} if log.exists() else set()
        variants = [("base", None, None)] + [("disk", k, g) for k in a.kappa for g in a.gamma]
        for dataset in a.datasets:
            for seed in range(a.seeds):  # seeds outermost: a run cut short leaves whole seeds of every cell
                for eps in a.epsilons:
                    for base, clipping in [(b, c) for b in a.bases for c in a.clipping]:
                        for method, kappa, gamma in variants:
                            if (dataset, base, clipping, eps, method, seed, kappa, gamma) in done:
                                continue
                            algorithm = f"{'disk' if method == 'disk' else 'dp'}-{base}"
                            hp = hyperparameters(tuned, dataset, base, clipping, kappa, gamma)
                            config = run_config(a, algorithm, dataset, eps, clipping, seed, hp)
                            m = train(config, progress=False, log=lambda s: None)
                            row = {"dataset": dataset, "base": base, "clipping": clipping, "epsilon": eps,
                                   "method": method, "seed": seed,
                                   "test_accuracy": m["test_accuracy"], "epsilon_spent": m["epsilon"],
                                   "lr": config.hyperparameters.lr, "epochs": a.epochs, "batch_size": a.batch_size,
                                   "clip": config.clip, "calibration_epochs": a.calibration_epochs,
                                   "lr_schedule": a.lr_schedule, "warmup": a.warmup,
                                   **({"kappa": kappa, "gamma": gamma} if method == "disk" else {}),
                                   "noise_multiplier": m["noise_multiplier"], "steps": m["steps"],
                                   "accuracy_per_epoch": [h["test_accuracy"] for h in m["history"]],
                                   "wall_time_s": m["wall_time_s"]}
                            with log.open("a") as f:
                                f.write(json.dumps(row) + "\n")
                            print(json.dumps(row), flush=True)
    print(summarize(out))
    return 0
