"""Recipes with correlated noise (Choquette-Choo et al. 2024, spec ``dp_srgd.md``). Each picks a default
noise mechanism (``--noise`` overrides it). At an ``--epsilon`` they default to amplified BandMF: banded
noise on cyclic Poisson sampling (Choquette-Choo et al. 2023), which measured better on most pairs tried
(docs/defaults.md); ``--sampling fixed`` runs their own noise (the tree, multi-epoch MF) on fixed-order batches.

* ``dp-ftrl`` — SGD (with optional momentum) on correlated noise: tree aggregation (Kairouz et al. 2021; Sec. 2.4),
  BandMF by default.
* ``dp-memf`` — Alg. 2: momentum SGD on matrix-factorization noise optimised for the run's epochs.
* ``dp-srg-memf`` — Alg. 3: the SRG increment grad(x_t) - c grad(x_t-1) is privatized, the running sum
  feeds momentum SGD (``transforms.srg``).
* ``accel-dp-srgd`` — Alg. 1: weighted gradient differences, clipped, with continual-counting noise on their
  prefix sums (the tree in the paper's theory, L174-L186; BandMF by default) and Nesterov's y/z coupling
  (``transforms.nesterov``); ``lr`` is 1/beta. ``dp-srgd`` is its unaccelerated variant (Sec. 4.3).
"""

from __future__ import annotations

import warnings

from dpopt.algorithms.base import PrivateStep, Privatizer
from dpopt.algorithms.first_order import BASES
from dpopt.algorithms.hyperparameters import SGD, SRG, SRGD, StepRule
from dpopt.algorithms.registry import register
from dpopt.grad.engine import PerExampleEngine
from dpopt.transforms.nesterov import AcceleratedSRG
from dpopt.transforms.srg import RecursiveGradient


# defaults: tuned on digits, MLP, epsilon 2 (docs/defaults.md)
def _sgd(engine: PerExampleEngine, privatizer: Privatizer, hp: SGD) -> PrivateStep:
    return PrivateStep(engine, privatizer, BASES["sgd"](engine.params, hp))


# The tree-noise SGD recipes' lr shrinks like 1/sqrt(T) from its digits value (240 steps), as MNIST's 9,380 steps
# want on the tree: DP-FTRL 0.465 / sqrt(T) (0.03 there; one full-batch step on golub needs a step the size of
# DP-SGD's), but at least 0.03 (dp-memf's step 0.3 under DP-FTRL's momentum 0.9): on its default amplified BandMF the
# noise grows with T as DP-SGD's does, and the shrinking step starved the long runs; DP-SRGD 3.1 / sqrt(T) (0.2
# there) but at most 0.2: a larger step on a short run lets the per-example gradient differences it clips grow
# (sonar, golub); and at least 0.1, for the same reason as DP-FTRL's floor (MNIST's 9,380 steps) (docs/defaults.md).
FTRL_LR = StepRule(0.465, 0.5, floor=0.03)
SRGD_LR = StepRule(3.1, 0.5, cap=0.2, floor=0.1)
register("dp-ftrl", SGD, noise="tree", sampling="cyclic", tree_decoder="least-squares",
         defaults={"lr": FTRL_LR, "momentum": 0.9})(_sgd)
register("dp-memf", SGD, noise="mf", sampling="cyclic", defaults={"lr": 0.3})(_sgd)


@register("dp-srg-memf", SRG, noise="mf", sampling="cyclic", defaults={"lr": 0.3})
def dp_srg_memf(engine: PerExampleEngine, privatizer: Privatizer, hp: SRG) -> PrivateStep:
    srg = RecursiveGradient(hp.decay)
    return PrivateStep(engine, privatizer, BASES["sgd"](engine.params, hp), transforms=[srg], statistic=srg.statistic)


# Accelerated-DP-SRGD's step 1/β must shrink like 1/T: the weighted differences η_t∇f(x_t) − η_{t−1}∇f(x_{t−1})
# stay bounded only for β ≥ 2MT (Claim 4.2). Its default lr is 1.1 / T up to digits' 240 steps, where lr·T = 1.1 was
# measured, and shrinks like T^(-3/2) beyond, as Thm 4.10's β ∝ T^(3/2): at 1.1 / T MNIST's 9,380 steps peaked at
# epoch 4 and drifted off (docs/defaults.md).
ACCELERATED_LR = StepRule(1.1 * 240 ** 0.5, 1.5, cap=StepRule(1.1, 1.0))
TOO_LARGE = 4.0  # a given lr above this multiple of the default draws a warning (2.2 / T still learns)
# Its statistic is divided by max(1, T / 938) before the clip: 10 on MNIST's 9,380 steps, where a clip of 10 with the
# step a tenth (the same noise in x) measured better than 1 on the three models (the clip cut 79-93% of examples);
# 1 up to 938 steps, where a larger clip measured worse (digits' 220 steps: 89.72 -> 80.28) (docs/defaults.md).
ACCELERATED_SCALE = StepRule(1 / 938, -1.0, floor=1.0)


def _srgd(accelerate: bool):
    def recipe(engine: PerExampleEngine, privatizer: Privatizer, hp: SRGD) -> PrivateStep:
        steps = getattr(privatizer.noise, "horizon", 0)  # the run's length, where the noise is built for it
        if accelerate and steps and hp.lr > TOO_LARGE * ACCELERATED_LR(steps):
            warnings.warn(f"accel-dp-srgd's step 1/beta = lr = {hp.lr:g} over {steps} steps is likely too large: "
                          f"its per-example differences grow with t unless the step shrinks like 1/T (Claim 4.2, "
                          f"beta >= 2MT); its default is {ACCELERATED_LR} = {ACCELERATED_LR(steps):.2g} "
                          "(docs/defaults.md)", stacklevel=2)
        coupling = AcceleratedSRG(engine.params, hp.lr, hp.radius, accelerate, hp.statistic_scale)
        return PrivateStep(engine, privatizer, coupling, statistic=coupling.statistic)

    return recipe


register("accel-dp-srgd", SRGD, noise="tree", sampling="cyclic",
         defaults={"lr": ACCELERATED_LR, "statistic_scale": ACCELERATED_SCALE})(_srgd(True))
register("dp-srgd", SRGD, noise="tree", sampling="cyclic", defaults={"lr": SRGD_LR})(_srgd(False))
