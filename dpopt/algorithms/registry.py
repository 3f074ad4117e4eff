"""The named recipes: each is a short function that picks the parts of the private step."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from dpopt.algorithms.base import DPOptimizer, Privatizer
from dpopt.grad.engine import PerExampleEngine


def hyper(default, help: str):  # noqa: A002
    """A hyper-parameter field; its help text becomes the ``dpopt train`` flag's help."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class Hyperparameters:
    """The optimisation hyper-parameters of every recipe; each becomes a ``dpopt train`` flag.
    A recipe reads the fields it needs; a new method adds its own fields here."""

    lr: float = hyper(0.5, "learning rate")
    momentum: float = hyper(0.0, "SGD momentum (dp-sgd)")
    weight_decay: float = hyper(0.0, "weight decay (decoupled for dp-adamw)")
    betas: tuple[float, float] = hyper((0.9, 0.999), "Adam betas")
    eps: float = hyper(1e-8, "Adam epsilon")
    kappa: float = hyper(0.7, "DiSK Kalman gain: weight of the new privatized gradient (disk-*)")
    gamma: float = hyper(0.5, "DiSK extrapolation step: second point x + gamma * d (disk-*)")
    rank: int = hyper(16, "projection rank r (dp-grape, dp-galore)")
    subspace_every: int = hyper(100, "refresh the projection subspace every F steps (dp-grape, dp-galore)")
    projection_seed: int = hyper(0, "public seed of DP-GRAPE's random projections (safe to publish)")
    projection_exclude: str = hyper("head,classifier,lm_head", "comma-separated module-name parts whose Linear "
                                    "weights are not projected (dp-grape, dp-galore)")
    reset_moments: bool = hyper(False, "zero the projected Adam moments at every subspace refresh; the paper "
                                "keeps them (dp-grape, dp-galore)")

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
