"""DiSK on every base optimizer: ``disk-sgd``, ``disk-adam``, ``disk-adamw`` (Zhang et al. 2024, Alg. 3).
The filter is one transform plus its statistic; the privacy cost is the base method's (one release/step)."""

from __future__ import annotations

from dpopt.algorithms.base import DPOptimizer, Privatizer
from dpopt.algorithms.first_order import BASES
from dpopt.algorithms.registry import Hyperparameters, register
from dpopt.grad.engine import PerExampleEngine
from dpopt.transforms.kalman import KalmanFilter


def _disk(base: str):
    def recipe(engine: PerExampleEngine, privatizer: Privatizer, hp: Hyperparameters) -> DPOptimizer:
        kf = KalmanFilter(hp.kappa, hp.gamma)
        return DPOptimizer(engine, privatizer, BASES[base](engine.params, hp), transforms=[kf],
                           statistic=kf.statistic)

    return recipe


for _name in BASES:
    register(f"disk-{_name}")(_disk(_name))
