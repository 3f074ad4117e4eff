"""DP-SGD (with or without momentum), DP-Adam and DP-AdamW: the privatized gradient fed to the stock
torch optimizer (Abadi et al. 2016, Alg. 1; DP-Adam as in the DP-GRAPE spec's Algorithm 3)."""

from __future__ import annotations

from typing import Callable

import torch

from dpopt.algorithms.base import PrivateStep, Privatizer
from dpopt.algorithms.hyperparameters import SGD, Adam, Hyperparameters, StepRule
from dpopt.algorithms.registry import register
from dpopt.grad.engine import PerExampleEngine

BASES: dict[str, Callable[[list[torch.Tensor], Hyperparameters], torch.optim.Optimizer]] = {
    "sgd": lambda params, hp: torch.optim.SGD(params, lr=hp.lr, momentum=hp.momentum, weight_decay=hp.weight_decay),
    "adam": lambda params, hp: torch.optim.Adam(params, lr=hp.lr, betas=hp.betas, eps=hp.eps,
                                                weight_decay=hp.weight_decay),
    "adamw": lambda params, hp: torch.optim.AdamW(params, lr=hp.lr, betas=hp.betas, eps=hp.eps,
                                                  weight_decay=hp.weight_decay),
}


def _dp(base: str):
    def recipe(engine: PerExampleEngine, privatizer: Privatizer, hp: Hyperparameters) -> PrivateStep:
        return PrivateStep(engine, privatizer, BASES[base](engine.params, hp))

    return recipe


# Adam's step is about lr per coordinate whatever the gradient's scale, so its noise walk grows like lr * sqrt(T):
# lr = 0.15 / sqrt(T): 0.0101 on digits (220 steps), 0.00155 on MNIST (9,380), 0.024 on ionosphere (40)
# (docs/defaults.md).
ADAM_DEFAULTS = {"lr": StepRule(0.15, 0.5)}
for _name in BASES:
    register(f"dp-{_name}", SGD if _name == "sgd" else Adam,
             defaults=None if _name == "sgd" else ADAM_DEFAULTS)(_dp(_name))
