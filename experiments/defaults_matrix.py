"""Each private recipe's defaults on built-in dataset and model pairs other than digits + MLP (docs/defaults.md).

``dpopt reproduce defaults_matrix [--recipes A ...] [--pairs DATASET/MODEL ...] [--out DIR]`` runs, for every
recipe and pair, exactly ``dpopt train --algorithm A --dataset D --model M --epsilon 2 --secret-seed 0`` (every
other flag at its default) on one thread, prints one JSON line per run and appends it to ``DIR/runs.jsonl``.
``--summarize`` writes ``DIR/table.md`` from runs.jsonl: test accuracy per recipe and pair, and the majority-class
test rate of each pair.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from dpopt.data.datasets import labels_of, load_dataset
from dpopt.train import TrainConfig, train

RECIPES = ["dp-sgd", "dp-adam", "dp-adamw", "disk-sgd", "disk-adam", "disk-adamw", "dp-grape", "disk-grape",
           "dp-galore", "dp-ftrl", "dp-memf", "dp-srg-memf", "accel-dp-srgd", "dp-srgd"]
PAIRS = ["digits/logreg", "breast-cancer/logreg", "mnist1d/mlp", "pima/mlp", "mnist/logreg", "mnist/mlp"]
OUT = Path(__file__).resolve().parent / "results" / "defaults_matrix"


def run(recipe: str, pair: str) -> dict:
    """One ``dpopt train`` run with the recipe's defaults at epsilon 2, secret seed 0; a run that raises (a
    recipe that does not apply to the model) is recorded with its error."""
    dataset, model = pair.split("/")
    start = time.process_time()
    try:
        metrics = train(TrainConfig(algorithm=recipe, dataset=dataset, model=model, epsilon=2.0, secret_seed=0),
                        progress=False, log=lambda _: None)
    except Exception as e:  # noqa: BLE001 - recorded, the matrix goes on
        return {"recipe": recipe, "dataset": dataset, "model": model, "error": f"{type(e).__name__}: {e}"}
    return {"recipe": recipe, "dataset": dataset, "model": model, "test_accuracy": round(metrics["test_accuracy"], 4),
            "epsilon": round(metrics["epsilon"], 3), "steps": metrics["steps"],
            "cpu_s": round(time.process_time() - start, 1)}


def majority_rate(dataset: str) -> float:
    """The test split's most frequent label's share."""
    labels = labels_of(load_dataset(dataset).test)
    return torch.bincount(labels).max().item() / len(labels)


def summarize(out: Path) -> str:
    """``out/table.md``: test accuracy (%) per recipe (rows) and pair (columns); the last run of each cell."""
    runs = {(r["recipe"], f"{r['dataset']}/{r['model']}"): r
            for r in map(json.loads, (out / "runs.jsonl").read_text().splitlines())}
    pairs = [p for p in PAIRS if any(k[1] == p for k in runs)]
    pairs += sorted({k[1] for k in runs} - set(pairs))
    recipes = [r for r in RECIPES if any(k[0] == r for k in runs)]
    recipes += sorted({k[0] for k in runs} - set(recipes))

    def cell(r: str, p: str) -> str:
        run = runs.get((r, p))
        return "—" if run is None else "error" if "error" in run else f"{100 * run['test_accuracy']:.2f}"

    lines = ["| recipe | " + " | ".join(pairs) + " |", "|---" * (len(pairs) + 1) + "|"]
    lines += [f"| {r} | " + " | ".join(cell(r, p) for p in pairs) + " |" for r in recipes]
    majority = [f"{100 * majority_rate(p.split('/')[0]):.2f}" for p in pairs]
    lines.append("| majority class | " + " | ".join(majority) + " |")
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
    table = "\n".join(lines) + "\n"
    (out / "table.md").write_text(table)
    return table


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dpopt reproduce defaults_matrix")
    p.add_argument("--recipes", nargs="+", default=RECIPES, metavar="A")
    p.add_argument("--pairs", nargs="+", default=PAIRS, metavar="DATASET/MODEL")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--summarize", action="store_true", help="write OUT/table.md from OUT/runs.jsonl and exit")
    a = p.parse_args(argv)
    if a.summarize:
        print(summarize(a.out), end="")
        return 0
    torch.set_num_threads(1)
    a.out.mkdir(parents=True, exist_ok=True)
    for pair in a.pairs:
        for recipe in a.recipes:
            line = json.dumps(run(recipe, pair))
            print(line, flush=True)
            with open(a.out / "runs.jsonl", "a") as f:
                f.write(line + "\n")
    return 0
