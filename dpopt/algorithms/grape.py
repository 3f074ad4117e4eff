"""DP-GRAPE (Algorithm 1) and naive DP-GaLore (Algorithm 5): projected Adam after two ways of privatizing.

* ``dp-grape``: per-example gradients projected by public random P inside backprop, clipped flat over
  projected and unprojected parts, noised in the projected space, Adam with projected moments.
* ``dp-galore``: the full gradient privatized as in DP-Adam, then P from the SVD of the private gradient
  every F steps (post-processing), the same projected Adam.
"""

from __future__ import annotations

from dpopt.algorithms.base import DPOptimizer, Privatizer
from dpopt.algorithms.registry import Hyperparameters, register
from dpopt.grad.engine import PerExampleEngine
from dpopt.grad.projection import RandomProjection, SVDProjection
from dpopt.transforms.projected_adam import ProjectedAdam


@register("dp-grape")
def dp_grape(engine: PerExampleEngine, privatizer: Privatizer, hp: Hyperparameters) -> DPOptimizer:
    projection = RandomProjection(engine, hp.rank, hp.subspace_every, hp.projection_seed)
    engine.projection = projection
    update = ProjectedAdam(engine.params, projection, hp.lr, hp.betas, hp.eps, hp.weight_decay)
    return DPOptimizer(engine, privatizer, update, transforms=[projection])


@register("dp-galore")
def dp_galore(engine: PerExampleEngine, privatizer: Privatizer, hp: Hyperparameters) -> DPOptimizer:
    projection = SVDProjection(engine, hp.rank, hp.subspace_every)
    update = ProjectedAdam(engine.params, projection, hp.lr, hp.betas, hp.eps, hp.weight_decay)
    return DPOptimizer(engine, privatizer, update, transforms=[projection])
