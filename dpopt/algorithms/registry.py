"""The named recipes: each is a short function that picks the parts of the private step."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from dpopt.algorithms.base import DPOptimizer, Privatizer
from dpopt.grad.engine import PerExampleEngine


@dataclass(frozen=True)
class Hyperparameters:
    lr: float = 0.1
    momentum: float = 0.0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8

    def __post_init__(self) -> None:
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"learning rate must be a finite number > 0, got {self.lr}")
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"momentum must lie in [0, 1), got {self.momentum}")
        if self.weight_decay < 0:
            raise ValueError(f"weight decay must be >= 0, got {self.weight_decay}")
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"Adam betas must lie in [0, 1), got {self.betas}")


Recipe = Callable[[PerExampleEngine, Privatizer, Hyperparameters], DPOptimizer]
ALGORITHMS: dict[str, Recipe] = {}


def register(name: str) -> Callable[[Recipe], Recipe]:
    def add(recipe: Recipe) -> Recipe:
        ALGORITHMS[name] = recipe
        return recipe

    return add


def build_algorithm(name: str, engine: PerExampleEngine, privatizer: Privatizer,
                    hp: Hyperparameters) -> DPOptimizer:
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; choose one of {', '.join(sorted(ALGORITHMS))}")
    return ALGORITHMS[name](engine, privatizer, hp)
