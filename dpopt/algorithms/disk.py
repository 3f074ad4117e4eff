"""DiSK on every base method (Zhang et al. 2024, Alg. 3): ``disk-sgd``, ``disk-adam``, ``disk-adamw`` and
``disk-grape`` (DP-GRAPE's projected Adam). ``with_kalman`` turns any recipe whose statistic is the plain
gradient into its DiSK version: the two-point mixture becomes the statistic, the Kalman filter the first
transform (it filters the release; the base's own transforms and update then see g~). Sampling, clipping,
noise and ledger stay the base's: one release per step, whatever noise mechanism the privatizer holds.
"""

from __future__ import annotations

from dpopt.algorithms import first_order, grape  # noqa: F401  (registers the bases wrapped below)
from dpopt.algorithms.base import PrivateStep, Privatizer
from dpopt.algorithms.hyperparameters import DiSKAdam, DiSKProjection, DiSKSGD, Hyperparameters
from dpopt.algorithms.registry import ALGORITHMS, DEFAULTS, Recipe, register
from dpopt.grad.engine import PerExampleEngine
from dpopt.transforms.kalman import KalmanFilter

WRAPPED = {"disk-sgd": ("dp-sgd", DiSKSGD), "disk-adam": ("dp-adam", DiSKAdam), "disk-adamw": ("dp-adamw", DiSKAdam),
           "disk-grape": ("dp-grape", DiSKProjection)}


def with_kalman(recipe: Recipe) -> Recipe:
    def disk(engine: PerExampleEngine, privatizer: Privatizer, hp: Hyperparameters) -> PrivateStep:
        base = recipe(engine, privatizer, hp)
        if base._statistic is not None:
            raise ValueError("DiSK privatizes its own two-point statistic; it wraps only a method whose "
                             "statistic is the plain per-example gradient")
        kf = KalmanFilter(hp.kappa, hp.gamma)
        return PrivateStep(engine, privatizer, base.base, transforms=[kf, *base.transforms], statistic=kf.statistic)

    return disk


for _name, (_base, _config) in WRAPPED.items():
    register(_name, _config, defaults=DEFAULTS[_base])(with_kalman(ALGORITHMS[_base]))
