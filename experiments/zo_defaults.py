"""The held-out sweep behind the zeroth-order recipes' defaults (docs/defaults.md): digits' training split cut
80/20 into train / validation, the test split untouched.

``dpopt reproduce zo_defaults ALGORITHM KEY=V1,V2 ...`` runs every combination of the values given: keys are
hyper-parameters (lr, smoothing, direction, direction_seed, ...) or epochs, batch_size, clip; each run
is ``train(TrainConfig(algorithm, dataset=<the split>, epsilon=2 (none for mezo), secret_seed=0, ...))`` on
one thread, and prints one JSON line with the validation accuracy and the CPU seconds.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import numpy as np
import torch

from dpopt.algorithms import NON_PRIVATE, hyperparameters_for
from dpopt.algorithms.hyperparameters import all_fields
from dpopt.data import datasets
from dpopt.data.datasets import DATASETS, Dataset
from dpopt.run import TrainConfig, train

CONFIG_KEYS = {"epochs": int, "batch_size": int, "clip": float}
SPLIT = "digits-validation"


def digits_validation(download: bool = False) -> Dataset:
    """digits' training split (1437) cut 80/20, stratified, random_state 1: 1149 train / 288 validation."""
    from sklearn.model_selection import train_test_split

    x, y = datasets.digits().train
    train_idx, val_idx = (torch.tensor(i) for i in train_test_split(
        np.arange(len(y)), test_size=0.2, random_state=1, stratify=y.numpy()))
    return Dataset(SPLIT, (x[train_idx], y[train_idx]), (x[val_idx], y[val_idx]), 10)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dpopt reproduce zo_defaults")
    p.add_argument("algorithm")
    p.add_argument("grid", nargs="*", metavar="KEY=V1,V2", help="values to sweep (lr=0.1,0.2 direction_seed=0,1)")
    a = p.parse_args(argv)
    types = {name: type(f.default) for name, f in all_fields().items()} | CONFIG_KEYS
    grid = {}
    for item in a.grid:
        key, values = item.split("=", 1)
        if key not in types:
            raise ValueError(f"unknown key {key!r}; choose among {', '.join(sorted(types))}")
        grid[key] = [types[key](v) for v in values.split(",")]
    DATASETS.setdefault(SPLIT, digits_validation)
    torch.set_num_threads(1)
    for combo in itertools.product(*grid.values()):
        chosen = dict(zip(grid, combo))
        hp = hyperparameters_for(a.algorithm, **{k: v for k, v in chosen.items() if k not in CONFIG_KEYS})
        config = TrainConfig(algorithm=a.algorithm, dataset=SPLIT, secret_seed=0, hyperparameters=hp,
                             epsilon=None if a.algorithm in NON_PRIVATE else 2.0,
                             **{k: v for k, v in chosen.items() if k in CONFIG_KEYS})
        start = time.process_time()
        metrics = train(config, progress=False, log=lambda _: None)
        print(json.dumps({"algorithm": a.algorithm, **chosen, "validation_accuracy": round(metrics["test_accuracy"], 4),
                          "steps": metrics["steps"], "cpu_s": round(time.process_time() - start, 1)}), flush=True)
    return 0
