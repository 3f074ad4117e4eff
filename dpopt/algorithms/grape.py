"""DP-GRAPE (Algorithm 1), naive DP-GaLore (Algorithm 5) and non-private GaLore (Algorithm 4): projected Adam
after three ways of forming the gradient.

* ``dp-grape``: per-example gradients projected by public random P inside backprop, clipped flat over
  projected and unprojected parts, noised in the projected space, Adam with projected moments.
* ``dp-galore``: the full gradient privatized as in DP-Adam, then P from the SVD of the private gradient
  every F steps (post-processing), the same projected Adam.
* ``GaLore``: the non-private baseline, a torch-style optimizer on ``.grad`` (no privacy at all; for
  memory and accuracy references only, never a ``dpopt train`` algorithm).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dpopt.algorithms.base import PrivateStep, Privatizer
from dpopt.algorithms.first_order import ADAM_DEFAULTS
from dpopt.algorithms.hyperparameters import Projection, StepRule
from dpopt.algorithms.registry import register
from dpopt.grad.engine import PerExampleEngine
from dpopt.grad.projection import EXCLUDE, RandomProjection, SVDProjection, parse_exclude, projectable
from dpopt.transforms.projected_adam import ProjectedAdam


@register("dp-grape", Projection, defaults=ADAM_DEFAULTS)
def dp_grape(engine: PerExampleEngine, privatizer: Privatizer, hp: Projection) -> PrivateStep:
    projection = RandomProjection.on(engine, hp.rank, hp.subspace_every, hp.projection_seed,
                                     parse_exclude(hp.projection_exclude))
    engine.projection = projection
    update = ProjectedAdam(engine.params, projection, hp.lr, hp.betas, hp.eps, hp.weight_decay, hp.reset_moments)
    return PrivateStep(engine, privatizer, update, transforms=[projection])


# Twice the Adam family's rule: at 0.15 / sqrt(T) DP-GaLore missed on the ViT (76.92% against dp-sgd's 87.14);
# 0.3 / sqrt(T) gives 83.13% there and keeps every other pair learning (docs/defaults.md, fifth round).
GALORE_DEFAULTS = {"lr": StepRule(0.3, 0.5)}


@register("dp-galore", Projection, defaults=GALORE_DEFAULTS)
def dp_galore(engine: PerExampleEngine, privatizer: Privatizer, hp: Projection) -> PrivateStep:
    projection = SVDProjection.on(engine, hp.rank, hp.subspace_every, parse_exclude(hp.projection_exclude))
    update = ProjectedAdam(engine.params, projection, hp.lr, hp.betas, hp.eps, hp.weight_decay, hp.reset_moments)
    return PrivateStep(engine, privatizer, update, transforms=[projection])


class GaLore:
    """Non-private GaLore (Algorithm 4, L300-L315): every ``every`` steps P = top-r singular vectors of each
    projected weight's batch gradient (stored per layer), Adam with projected moments. Use like a torch
    optimizer: ``loss.backward(); opt.step(); opt.zero_grad()``. NOT differentially private."""

    def __init__(self, model: nn.Module, rank: int, every: int, lr: float, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0, exclude: tuple[str, ...] = EXCLUDE,
                 reset_moments: bool = False) -> None:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        sides = projectable(model, self.params, rank, exclude)
        self.projection = SVDProjection(self.params, [n for n, _ in named], sides, rank, every)
        self.update = ProjectedAdam(self.params, self.projection, lr, betas, eps, weight_decay, reset_moments)

    @torch.no_grad()
    def step(self) -> None:
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in self.params]
        self.update.apply(self.projection(grads))
        self.projection.after_update(self.params)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    def state_dict(self) -> dict[str, Any]:
        return {"projection": self.projection.state_dict(), "update": self.update.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.projection.load_state_dict(state["projection"])
        self.update.load_state_dict(state["update"])
