"""Each private recipe's defaults on built-in dataset and model pairs other than digits + MLP (docs/defaults.md).

``dpopt reproduce defaults_matrix [--recipes A ...] [--pairs DATASET/MODEL ...] [--secret-seeds S ...] [--device D]
[--out DIR]`` runs, for every recipe, pair and secret seed S (default 0), exactly ``dpopt train --algorithm A --dataset
D --model M --epsilon 2 --secret-seed S [--device D]`` (every other flag at its default) on one thread, prints one
JSON line per run and appends it to ``DIR/runs.jsonl`` (a run off the CPU records its device, and the table marks
its cell). ``--summarize`` writes ``DIR/table.md`` from runs.jsonl: test accuracy per recipe
and pair at secret seed 0, the majority-class test rate of each pair, the cells run with several seeds, and the
verdict: which recipes learn on each pair (``verdict``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from dpopt.data.datasets import labels_of, load_dataset
from dpopt.device import add_device_arguments, resolve_device
from dpopt.run import TrainConfig, train

RECIPES = ["dp-sgd", "dp-adam", "dp-adamw", "disk-sgd", "disk-adam", "disk-adamw", "dp-grape", "disk-grape",
           "dp-galore", "dp-ftrl", "dp-memf", "dp-srg-memf", "accel-dp-srgd", "dp-srgd"]
PAIRS = ["digits/logreg", "breast-cancer/logreg", "breast-cancer/mlp", "mnist1d/mlp", "pima/mlp", "mnist/logreg",
         "mnist/mlp", "sonar/logreg", "sonar/mlp", "ionosphere/logreg", "ionosphere/mlp", "golub/logreg"]
OUT = Path(__file__).resolve().parent / "results" / "defaults_matrix"


def run(recipe: str, pair: str, secret_seed: int = 0, device: str = "cpu") -> dict:
    """One ``dpopt train`` run with the recipe's defaults at epsilon 2; a run that raises (a recipe that does not
    apply to the model) is recorded with its error."""
    dataset, model = pair.split("/")
    cell = {"recipe": recipe, "dataset": dataset, "model": model, "secret_seed": secret_seed}
    if device != "cpu":
        cell["device"] = device
    start, wall = time.process_time(), time.perf_counter()
    try:
        metrics = train(TrainConfig(algorithm=recipe, dataset=dataset, model=model, epsilon=2.0,
                                    secret_seed=secret_seed, device=device), progress=False, log=lambda _: None)
    except Exception as e:  # noqa: BLE001 - recorded, the matrix goes on
        return {**cell, "error": f"{type(e).__name__}: {e}"}
    return {**cell, "test_accuracy": round(metrics["test_accuracy"], 4), "epsilon": round(metrics["epsilon"], 3),
            "steps": metrics["steps"], "cpu_s": round(time.process_time() - start, 1),
            "wall_s": round(time.perf_counter() - wall, 1)}


def majority_rate(dataset: str) -> float:
    """The test split's most frequent label's share."""
    labels = labels_of(load_dataset(dataset).test)
    return torch.bincount(labels).max().item() / len(labels)


def summarize(out: Path) -> str:
    """``out/table.md``: test accuracy (%) per recipe (rows) and pair (columns), the last run of each cell at
    secret seed 0; then each cell run with several secret seeds: the mean and each seed's accuracy; then the
    verdict."""
    every = list(map(json.loads, (out / "runs.jsonl").read_text().splitlines()))
    runs = {(r["recipe"], f"{r['dataset']}/{r['model']}"): r for r in every if r.get("secret_seed", 0) == 0}
    seeded: dict[tuple[str, str], dict[int, float]] = {}  # the last run of each cell and seed
    for r in filter(lambda r: "error" not in r, every):
        cell = seeded.setdefault((r["recipe"], f"{r['dataset']}/{r['model']}"), {})
        cell[r.get("secret_seed", 0)] = 100 * r["test_accuracy"]
    pairs = [p for p in PAIRS if any(k[1] == p for k in runs)]
    pairs += sorted({k[1] for k in runs} - set(pairs))
    recipes = [r for r in RECIPES if any(k[0] == r for k in runs)]
    recipes += sorted({k[0] for k in runs} - set(recipes))

    def cell(r: str, p: str) -> str:
        run = runs.get((r, p))
        if run is None:
            return "—"
        if "error" in run:
            return "error"
        return f"{100 * run['test_accuracy']:.2f}" + (f" ({run['device']})" if "device" in run else "")

    lines = ["| recipe | " + " | ".join(pairs) + " |", "|---" * (len(pairs) + 1) + "|"]
    lines += [f"| {r} | " + " | ".join(cell(r, p) for p in pairs) + " |" for r in recipes]
    rates = {d: 100 * majority_rate(d) for d in {p.split("/")[0] for p in pairs}}
    lines.append("| majority class | " + " | ".join(f"{rates[p.split('/')[0]]:.2f}" for p in pairs) + " |")
    done = {k: r for k, r in runs.items() if "error" not in r}
    eps = sorted({r["epsilon"] for r in done.values()})
    steps = {p: sorted({done[k]["steps"] for k in done if k[1] == p}) for p in pairs}
    cpu = sum(r["cpu_s"] for r in done.values())
    lines.append(f"\nepsilon {eps[0]}–{eps[-1]}; steps per pair: "
                 + ", ".join(f"{p} {'/'.join(map(str, s))}" for p, s in steps.items())
                 + f"; {len(done)} runs, {cpu:.0f} CPU-seconds")
    errors: dict[str, list[str]] = {}
    for (r, p), run in runs.items():
        if "error" in run:
            errors.setdefault(run["error"], []).append(f"{r} on {p}")
    lines += [f"\nerror ({', '.join(cells)}): {error}" for error, cells in errors.items()]
    several = {k: v for k, v in seeded.items() if len(v) > 1}
    if several:
        lines += ["\n| recipe | pair | mean test accuracy (%) | each secret seed |", "|---|---|---|---|"]
        lines += [f"| {r} | {p} | {sum(v.values()) / len(v):.2f} | "
                  + ", ".join(f"{s}: {a:.2f}" for s, a in sorted(v.items())) + " |"
                  for (r, p), v in sorted(several.items(), key=lambda kv: (kv[0][1], kv[0][0]))]
    lines += ["", *verdict(runs, seeded, pairs, recipes, rates)]
    table = "\n".join(lines) + "\n"
    (out / "table.md").write_text(table)
    return table


def verdict(runs: dict, seeded: dict, pairs: list[str], recipes: list[str], rates: dict[str, float]) -> list[str]:
    """Per pair, the recipes that learn: test accuracy at least 10 points above the majority rate and at most 5
    below dp-sgd's (the reference, with the global defaults), on the mean over the secret seeds run; a run that
    does not start is a miss."""
    def mean(r: str, p: str) -> float | None:
        return None if (r, p) not in seeded else sum(seeded[r, p].values()) / len(seeded[r, p])

    lines = ["| pair | majority | dp-sgd | learn | miss | not run |", "|---|---|---|---|---|---|"]
    for p in pairs:
        reference, majority = mean("dp-sgd", p), rates[p.split("/")[0]]
        learn, miss, missing = [], [], []
        for r in (r for r in recipes if r != "dp-sgd"):
            if "error" in runs.get((r, p), {}):
                miss.append(f"{r} (error)")
            elif mean(r, p) is None:
                missing.append(r)
            elif reference is not None and mean(r, p) >= max(majority + 10, reference - 5):
                learn.append(r)
            else:
                miss.append(f"**{r} {mean(r, p):.2f}**")
        shown = "—" if reference is None else f"{reference:.2f}"
        lines.append(f"| {p} | {majority:.2f} | {shown} | {', '.join(learn)} | {', '.join(miss)} | "
                     f"{', '.join(missing)} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dpopt reproduce defaults_matrix")
    p.add_argument("--recipes", nargs="+", default=RECIPES, metavar="A")
    p.add_argument("--pairs", nargs="+", default=PAIRS, metavar="DATASET/MODEL")
    p.add_argument("--secret-seeds", nargs="+", type=int, default=[0], metavar="S")
    add_device_arguments(p)
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--summarize", action="store_true", help="write OUT/table.md from OUT/runs.jsonl and exit")
    a = p.parse_args(argv)
    if a.summarize:
        print(summarize(a.out), end="")
        return 0
    resolve_device(a.device)  # bad input: refused before any run
    torch.set_num_threads(1)
    a.out.mkdir(parents=True, exist_ok=True)
    for pair in a.pairs:
        for recipe in a.recipes:
            for seed in a.secret_seeds:
                line = json.dumps(run(recipe, pair, seed, a.device))
                print(line, flush=True)
                with open(a.out / "runs.jsonl", "a") as f:
                    f.write(line + "\n")
    return 0
