"""DP-SGD (with or without momentum), DP-Adam and DP-AdamW: the privatized gradient fed to the stock
torch optimizer (Abadi et al. 2016, Alg. 1; DP-Adam as in the DP-GRAPE spec's Algorithm 3)."""

from __future__ import annotations

import torch

from dpopt.algorithms.base import DPOptimizer, Privatizer
from dpopt.algorithms.registry import Hyperparameters, register
from dpopt.grad.engine import PerExampleEngine


@register("dp-sgd")
def dp_sgd(engine: PerExampleEngine, privatizer: Privatizer, hp: Hyperparameters) -> DPOptimizer:
    base = torch.optim.SGD(engine.params, lr=hp.lr, momentum=hp.momentum, weight_decay=hp.weight_decay)
    return DPOptimizer(engine, privatizer, base)


@register("dp-adam")
def dp_adam(engine: PerExampleEngine, privatizer: Privatizer, hp: Hyperparameters) -> DPOptimizer:
    base = torch.optim.Adam(engine.params, lr=hp.lr, betas=hp.betas, eps=hp.eps, weight_decay=hp.weight_decay)
    return DPOptimizer(engine, privatizer, base)


@register("dp-adamw")
def dp_adamw(engine: PerExampleEngine, privatizer: Privatizer, hp: Hyperparameters) -> DPOptimizer:
    base = torch.optim.AdamW(engine.params, lr=hp.lr, betas=hp.betas, eps=hp.eps, weight_decay=hp.weight_decay)
    return DPOptimizer(engine, privatizer, base)
