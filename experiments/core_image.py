"""Core benchmark: DP-SGD with the Tanh CNN on MNIST and Fashion-MNIST at epsilon 3 (delta 1e-5).

Literature: end-to-end DP CNNs reach 98.1% (MNIST) and 86.0% (Fashion-MNIST) at epsilon ~3 (Tramèr &
Boneh 2021, Table 1, with the tempered-sigmoid CNN of Papernot et al. 2021). Writes one metrics.json per run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dpopt.algorithms import SGD
from dpopt.run import TrainConfig, train


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="dpopt reproduce core_image")
    p.add_argument("--dataset", default="mnist", choices=["mnist", "fashion-mnist"])
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--lr", type=float, default=1.0)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--clip", type=float, default=0.1)
    p.add_argument("--epsilon", type=float, default=3.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/core_image")
    a = p.parse_args(argv)
    config = TrainConfig(algorithm="dp-sgd", dataset=a.dataset, model="cnn", epsilon=a.epsilon, delta=1e-5,
                         epochs=a.epochs, batch_size=a.batch_size, clip=a.clip, seed=a.seed,
                         hyperparameters=SGD(lr=a.lr, momentum=a.momentum))
    out = Path(a.out) / f"{a.dataset}_seed{a.seed}"
    metrics = train(config, out, progress=False)
    keys = ("dataset", "test_accuracy", "epsilon", "steps", "wall_time_s", "cpu_time_s", "threads")
    print(json.dumps({k: metrics[k] for k in keys}))
    return 0
